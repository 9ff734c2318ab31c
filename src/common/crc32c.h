/* SPDX-License-Identifier: Apache-2.0 */
/* CRC32C (Castagnoli), the checksum of weight files and model ids. */
#ifndef KVB_COMMON_CRC32C_H
#define KVB_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 to start) over len bytes of buf; the result is the finished CRC32C. */
uint32_t kvb__crc32c(uint32_t crc, const void *buf, size_t len);

#endif
