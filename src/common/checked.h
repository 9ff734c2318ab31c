/* SPDX-License-Identifier: Apache-2.0 */
/* Overflow-checked integer arithmetic: each returns non-zero on overflow and then leaves *out
 * unspecified. Every size or address computed from peer, file or user input goes through these. */
#ifndef KVB_COMMON_CHECKED_H
#define KVB_COMMON_CHECKED_H

#include <stddef.h>
#include <stdint.h>

static inline int kvb__add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

static inline int kvb__mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}

static inline int kvb__add_size(size_t a, size_t b, size_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

static inline int kvb__mul_size(size_t a, size_t b, size_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}

/* True if [addr, addr+len) lies inside [base, base+size) without wrapping. */
static inline int kvb__range_within(uint64_t addr, uint64_t len, uint64_t base, uint64_t size)
{
    uint64_t end, bend;
    if (kvb__add_u64(addr, len, &end) || kvb__add_u64(base, size, &bend))
        return 0;
    return addr >= base && end <= bend;
}

#endif
