/* SPDX-License-Identifier: Apache-2.0 */
#include "common/copy.h"

#include <stdbool.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if defined(__x86_64__)
/* CPUID leaf 7, EBX bit 9: enhanced REP MOVSB/STOSB. Asked once, by whoever copies first; the
 * answer is the same for every thread, so a racing first call is harmless. */
static bool erms(void)
{
    static int known = -1;
    int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (k < 0) {
        unsigned a, b, c, d;
        k = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 9));
        __atomic_store_n(&known, k, __ATOMIC_RELAXED);
    }
    return k;
}
#endif

void kvb__copy_movsb(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
#else
    memcpy(dst, src, n);
#endif
}

void kvb__copy(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
    if (n >= KVB_COPY_MOVSB_MIN && erms()) {
        kvb__copy_movsb(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}
