/* SPDX-License-Identifier: Apache-2.0 */
/* Little-endian integers at unaligned addresses, as every kvbridge wire format and key stores
 * them. memcpy compiles to one move; byte-by-byte loops were not merged into one by the compiler
 * (decoding same-host request entries byte by byte was a tenth of both sides' CPU in runs of
 * small requests). */
#ifndef KVB_COMMON_LE_H
#define KVB_COMMON_LE_H

#include <endian.h>
#include <stdint.h>
#include <string.h>

static inline void kvb__put_le16(uint8_t *p, uint16_t v)
{
    v = htole16(v);
    memcpy(p, &v, sizeof v);
}

static inline void kvb__put_le32(uint8_t *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, sizeof v);
}

static inline void kvb__put_le64(uint8_t *p, uint64_t v)
{
    v = htole64(v);
    memcpy(p, &v, sizeof v);
}

static inline uint16_t kvb__get_le16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return le16toh(v);
}

static inline uint32_t kvb__get_le32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return le32toh(v);
}

static inline uint64_t kvb__get_le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return le64toh(v);
}

#endif
