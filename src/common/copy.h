/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's bulk copy: on x86-64 processors with fast string moves (ERMS), `rep movsb` for
 * copies of at least KVB_COPY_MOVSB_MIN bytes - it beats glibc's memcpy on large copies between
 * uncached buffers by 10-25% on the machines we measured (`kvbridge bench --baseline copy` shows
 * both) - and memcpy otherwise. */
#ifndef KVB_COMMON_COPY_H
#define KVB_COMMON_COPY_H

#include <stddef.h>

#define KVB_COPY_MOVSB_MIN 4096

void kvb__copy(void *dst, const void *src, size_t n);
/* `rep movsb` itself, whatever the CPU says of it (memcpy where there is no such instruction):
 * for measuring it against memcpy. */
void kvb__copy_movsb(void *dst, const void *src, size_t n);

#endif
