/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's copies: streaming (non-temporal) stores, `rep movsb` and the default copy move
 * exactly the bytes asked for, at every alignment of source and destination and every length
 * around the points where their code changes (the first whole cache line, the 128-byte body,
 * the streaming threshold), and touch nothing on either side. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/copy.h"

TestSuite(copy, .timeout = 60);

typedef void copy_fn(void *dst, const void *src, size_t n);

static void exact(copy_fn *fn, const char *name)
{
    enum { PAD = 256, MAX = 3 * KVB_COPY_STREAM_MIN + 1024 };
    static const size_t lens[] = {0,
                                  1,
                                  63,
                                  64,
                                  127,
                                  128,
                                  129,
                                  1000,
                                  KVB_COPY_STREAM_MIN - 1,
                                  KVB_COPY_STREAM_MIN,
                                  KVB_COPY_STREAM_MIN + 1,
                                  KVB_COPY_STREAM_MIN + 63,
                                  KVB_COPY_STREAM_MIN + 127,
                                  KVB_COPY_STREAM_MIN + 128,
                                  2 * KVB_COPY_STREAM_MIN + 77,
                                  MAX};
    size_t size = (MAX + 2 * PAD + 4095) & ~(size_t)4095; /* a multiple of the alignment (C11) */
    uint8_t *src = aligned_alloc(4096, size), *dst = aligned_alloc(4096, size);
    cr_assert(src && dst);
    for (size_t i = 0; i < MAX + 2 * PAD; i++)
        src[i] = (uint8_t)(i * 131 + 7);
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++)
        for (size_t da = 0; da < 128; da += 1 + (da > 8) * 6) /* 0-8, then every 7th */
            for (size_t sa = 0; sa < 80; sa += 13) {
                size_t n = lens[l];
                memset(dst, 0xEE, MAX + 2 * PAD);
                fn(dst + PAD + da, src + PAD + sa, n);
                for (size_t i = 0; i < MAX + 2 * PAD; i++) {
                    bool in = i >= PAD + da && i < PAD + da + n;
                    uint8_t want = in ? src[i - da + sa] : 0xEE;
                    cr_assert_eq(dst[i], want,
                                 "%s of %zu bytes, destination +%zu, source +%zu: byte %zd is "
                                 "0x%02x, not 0x%02x",
                                 name, n, da, sa, (ssize_t)i - PAD - (ssize_t)da, dst[i], want);
                }
            }
    free(src);
    free(dst);
}

Test(copy, streaming_stores_exact)
{
    exact(kvb__copy_stream, "kvb__copy_stream");
}

Test(copy, rep_movsb_exact)
{
    exact(kvb__copy_movsb, "kvb__copy_movsb");
}

Test(copy, default_copy_exact)
{
    exact(kvb__copy, "kvb__copy");
}

/* The cache size the streaming threshold defaults to is read from sysfs; where sysfs has it, it
 * is a cache's size (at least 32 KiB and at most 4 GiB), not a misparse. */
Test(copy, last_level_cache_size)
{
    uint64_t llc = kvb__llc_size();
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index0/size", "r");
    if (!f)
        cr_skip_test("no cache sizes in sysfs");
    fclose(f);
    cr_expect_geq(llc, 32u << 10);
    cr_expect_leq(llc, 4ull << 30);
}
