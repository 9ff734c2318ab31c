/* SPDX-License-Identifier: Apache-2.0 */
/* CRC32C (Castagnoli) for weight files and model ids: the SSE4.2 instruction where the CPU has it,
 * else a table-driven loop. Both give the same value; the fast path matters because a model id is
 * a checksum over all weights, computed whenever a preset is generated. */
#include "common/crc32c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#define POLY 0x82f63b78u /* reflected Castagnoli polynomial */

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[i] = c;
    }
}

static uint32_t crc_soft(uint32_t c, const unsigned char *p, size_t len)
{
    pthread_once(&table_once, table_init);
    while (len--)
        c = table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const unsigned char *p,
                                                         size_t len)
{
    uint64_t c64 = c;
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* unaligned-safe; x86 is little-endian like the format */
        c64 = __builtin_ia32_crc32di(c64, w);
    }
    c = (uint32_t)c64;
    for (; len; p++, len--)
        c = __builtin_ia32_crc32qi(c, *p);
    return c;
}

static int have_hw(void)
{
    static atomic_int have = -1; /* every thread that races here stores the same value */
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (h < 0) {
        h = __builtin_cpu_supports("sse4.2") ? 1 : 0;
        atomic_store_explicit(&have, h, memory_order_relaxed);
    }
    return h;
}
#endif

uint32_t kvb__crc32c(uint32_t crc, const void *buf, size_t len)
{
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_hw())
        return ~crc_hw(c, buf, len);
#endif
    return ~crc_soft(c, buf, len);
}
