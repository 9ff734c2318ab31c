/* SPDX-License-Identifier: Apache-2.0 */
#include "common/copy.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
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

#if defined(__x86_64__)
/* The body of a streaming copy: d aligned to 64 bytes, n a multiple of 128. Unaligned loads (the
 * source may sit anywhere), aligned non-temporal stores of whole cache lines. */
__attribute__((target("avx2"))) static void stream_avx2(uint8_t *d, const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
}

static void stream_sse2(uint8_t *d, const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

static bool avx2(void)
{
    static int known = -1;
    int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (k < 0) {
        __builtin_cpu_init();
        k = __builtin_cpu_supports("avx2") != 0;
        __atomic_store_n(&known, k, __ATOMIC_RELAXED);
    }
    return k;
}
#endif

void kvb__copy_stream(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
    if (n >= KVB_COPY_STREAM_MIN) {
        uint8_t *d = dst;
        const uint8_t *s = src;
        size_t head = (size_t)(-(uintptr_t)d & 63); /* up to the first whole line */
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        size_t body = n & ~(size_t)127;
        if (avx2())
            stream_avx2(d, s, body);
        else
            stream_sse2(d, s, body);
        memcpy(d + body, s + body, n - body);
        _mm_sfence(); /* the streamed lines are visible before whatever the caller does next */
        return;
    }
#endif
    kvb__copy(dst, src, n);
}

uint64_t kvb__llc_size(void)
{
    /* The highest cache level cpu0 reports (index3 on most x86 machines). sysfs, not
     * sysconf(_SC_LEVEL3_CACHE_SIZE): glibc 2.36 says 256 MiB for this AMD guest's 32 MiB. */
    uint64_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], line[64];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        unsigned long long v = 0;
        char unit = 0;
        if (fgets(line, sizeof line, f) && sscanf(line, "%llu%c", &v, &unit) >= 1) {
            uint64_t bytes = v * (unit == 'K' ? 1024ull : unit == 'M' ? 1024ull * 1024 : 1ull);
            best = bytes > best ? bytes : best;
        }
        fclose(f);
    }
    return best;
}
