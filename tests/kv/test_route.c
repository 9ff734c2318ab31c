/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/kv/route.c: the routing examples, and for every small TP pair the
 * property that matters - each decode rank receives each of its bytes exactly once. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "kvbridge/kv.h"

#define MAXR 256

static kvb_kv_topo_t mla(int32_t dp, int32_t tp)
{
    return (kvb_kv_topo_t){.dp_size = dp, .tp_size = tp, .attn = KVB_KV_ATTN_MLA};
}

static kvb_kv_topo_t gqa(int32_t dp, int32_t tp, uint32_t heads)
{
    return (kvb_kv_topo_t){.dp_size = dp,
                           .tp_size = tp,
                           .attn = KVB_KV_ATTN_GQA,
                           .num_kv_heads = heads,
                           .order = KVB_KV_ORDER_HND};
}

static size_t routes(kvb_kv_topo_t p, kvb_kv_topo_t d, int32_t dd, kvb_kv_route_t *out)
{
    size_t n = 0;
    cr_assert_eq(kvb_kv_route(&p, &d, dd, out, MAXR, &n), KVB_OK);
    cr_assert_leq(n, MAXR);
    return n;
}

static void expect_route(const kvb_kv_route_t *r, int src, int dst, unsigned h0, unsigned h1)
{
    cr_assert_eq(r->src_rank, src, "src %d want %d", r->src_rank, src);
    cr_assert_eq(r->dst_rank, dst, "dst %d want %d", r->dst_rank, dst);
    cr_assert_eq(r->head_begin, h0, "head_begin %u want %u", r->head_begin, h0);
    cr_assert_eq(r->head_end, h1, "head_end %u want %u", r->head_end, h1);
}

TestSuite(route, .timeout = 30);

Test(route, mla_multicast_example_tp2_to_tp8_dd3)
{
    /* Prefill rank 1 multicasts to decode ranks 1, 3, 5, 7: global 25, 27, 29, 31. */
    kvb_kv_route_t v[MAXR];
    kvb_kv_topo_t d = mla(4, 8);
    size_t n = routes(mla(1, 2), d, 3, v);
    cr_assert_eq(n, 8);
    int globals[8], g = 0;
    for (size_t i = 0; i < n; i++) {
        expect_route(&v[i], (int)i % 2, (int)i, 0, 0);
        if (v[i].src_rank == 1)
            globals[g++] = 3 * d.tp_size + v[i].dst_rank;
    }
    cr_assert_eq(g, 4);
    cr_assert_arr_eq(globals, ((int[]){25, 27, 29, 31}), 4 * sizeof(int));
}

Test(route, mla_one_writer_example_tp8_to_tp3_dd2)
{
    /* Writer of decode rank k is (2*3 + k) % 8: 6, 7, 0. xLLM's rule would not be valid here. */
    kvb_kv_route_t v[MAXR];
    size_t n = routes(mla(1, 8), mla(3, 3), 2, v);
    cr_assert_eq(n, 3);
    expect_route(&v[0], 6, 0, 0, 0);
    expect_route(&v[1], 7, 1, 0, 0);
    expect_route(&v[2], 0, 2, 0, 0);
}

Test(route, mla_spreads_writers_over_dp_groups)
{
    kvb_kv_route_t v[MAXR];
    int used[4] = {0};
    for (int32_t dd = 0; dd < 4; dd++) {
        size_t n = routes(mla(1, 4), mla(4, 1), dd, v);
        cr_assert_eq(n, 1);
        used[v[0].src_rank]++;
    }
    for (int r = 0; r < 4; r++)
        cr_assert_eq(used[r], 1, "prefill rank %d writes for %d groups", r, used[r]);
}

/* Every decode rank has exactly one writer, a valid prefill rank, for the rule in force. */
static void check_mla(int32_t src_tp, int32_t dst_tp, int32_t dd)
{
    kvb_kv_route_t v[MAXR];
    int writers[MAXR] = {0};
    size_t n = routes(mla(1, src_tp), mla(dd + 1, dst_tp), dd, v);
    cr_assert_eq(n, (size_t)dst_tp);
    for (size_t i = 0; i < n; i++) {
        cr_assert(v[i].src_rank >= 0 && v[i].src_rank < src_tp);
        cr_assert(v[i].dst_rank >= 0 && v[i].dst_rank < dst_tp);
        cr_assert_eq(v[i].head_begin, 0);
        cr_assert_eq(v[i].head_end, 0);
        writers[v[i].dst_rank]++;
        int want =
            src_tp >= dst_tp ? (dd * dst_tp + v[i].dst_rank) % src_tp : v[i].dst_rank % src_tp;
        cr_assert_eq(v[i].src_rank, want, "tp %d->%d dd %d", src_tp, dst_tp, dd);
    }
    for (int k = 0; k < dst_tp; k++)
        cr_assert_eq(writers[k], 1, "tp %d->%d dd %d: rank %d has %d writers", src_tp, dst_tp, dd,
                     k, writers[k]);
}

Test(route, mla_exactly_one_writer_for_all_small_pairs)
{
    for (int32_t s = 1; s <= 16; s++)
        for (int32_t d = 1; d <= 16; d++)
            for (int32_t dd = 0; dd < 5; dd++)
                check_mla(s, d, dd);
}

Test(route, gqa_8_heads_tp2_to_tp4)
{
    kvb_kv_route_t v[MAXR];
    size_t n = routes(gqa(1, 2, 8), gqa(1, 4, 8), 0, v);
    cr_assert_eq(n, 4);
    expect_route(&v[0], 0, 0, 0, 2);
    expect_route(&v[1], 0, 1, 2, 4);
    expect_route(&v[2], 1, 2, 4, 6);
    expect_route(&v[3], 1, 3, 6, 8);
}

Test(route, gqa_8_heads_tp4_to_tp1)
{
    kvb_kv_route_t v[MAXR];
    size_t n = routes(gqa(1, 4, 8), gqa(1, 1, 8), 0, v);
    cr_assert_eq(n, 4);
    for (int r = 0; r < 4; r++)
        expect_route(&v[r], r, 0, 2 * (unsigned)r, 2 * (unsigned)r + 2);
}

Test(route, gqa_dp2_to_dp1)
{
    /* Same TP: identity, each rank its own heads; the decode dp group does not change it. */
    kvb_kv_route_t v[MAXR];
    size_t n = routes(gqa(2, 2, 8), gqa(1, 2, 8), 0, v);
    cr_assert_eq(n, 2);
    expect_route(&v[0], 0, 0, 0, 4);
    expect_route(&v[1], 1, 1, 4, 8);
    n = routes(gqa(2, 2, 8), gqa(1, 4, 8), 0, v);
    cr_assert_eq(n, 4);
    expect_route(&v[3], 1, 3, 6, 8);
}

Test(route, gqa_uneven_overlap_tp3_to_tp4_12_heads)
{
    /* Prefill ranks hold 4 heads, decode ranks 3: decode 1 ([3,6)) takes [3,4) from prefill 0
     * and [4,6) from prefill 1. */
    kvb_kv_route_t v[MAXR];
    size_t n = routes(gqa(1, 3, 12), gqa(1, 4, 12), 0, v);
    cr_assert_eq(n, 6);
    expect_route(&v[0], 0, 0, 0, 3);
    expect_route(&v[1], 0, 1, 3, 4);
    expect_route(&v[2], 1, 1, 4, 6);
    expect_route(&v[3], 1, 2, 6, 8);
    expect_route(&v[4], 2, 2, 8, 9);
    expect_route(&v[5], 2, 3, 9, 12);
}

Test(route, gqa_homo_replicated_heads)
{
    kvb_kv_route_t v[MAXR];
    size_t n = routes(gqa(1, 16, 8), gqa(1, 16, 8), 0, v);
    cr_assert_eq(n, 16);
    for (int k = 0; k < 16; k++)
        expect_route(&v[k], k, k, (unsigned)k / 2, (unsigned)k / 2 + 1);
}

/* Every head of every decode rank arrives exactly once, from a prefill rank that holds it. */
static void check_gqa(uint32_t h, int32_t src_tp, int32_t dst_tp)
{
    kvb_kv_route_t v[MAXR];
    static int got[MAXR][MAXR]; /* [decode rank][head]; static: 256 KiB */
    memset(got, 0, sizeof got);
    size_t n = routes(gqa(1, src_tp, h), gqa(1, dst_tp, h), 0, v);
    uint32_t hs = h / (uint32_t)src_tp, hd = h / (uint32_t)dst_tp;
    for (size_t i = 0; i < n; i++) {
        const kvb_kv_route_t *r = &v[i];
        cr_assert_lt(r->head_begin, r->head_end);
        cr_assert_geq(r->head_begin, (uint32_t)r->src_rank * hs);
        cr_assert_leq(r->head_end, (uint32_t)(r->src_rank + 1) * hs);
        for (uint32_t x = r->head_begin; x < r->head_end; x++)
            got[r->dst_rank][x]++;
        if (i)
            cr_assert(v[i - 1].dst_rank < r->dst_rank ||
                      (v[i - 1].dst_rank == r->dst_rank && v[i - 1].src_rank < r->src_rank));
    }
    for (int32_t k = 0; k < dst_tp; k++)
        for (uint32_t x = 0; x < h; x++)
            cr_assert_eq(got[k][x], x / hd == (uint32_t)k, "H %u tp %d->%d rank %d head %u: %d", h,
                         src_tp, dst_tp, k, x, got[k][x]);
}

Test(route, gqa_every_head_exactly_once)
{
    uint32_t heads[] = {1, 2, 4, 8, 12, 16, 24, 32};
    for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++)
        for (uint32_t s = 1; s <= heads[i]; s++)
            for (uint32_t d = 1; d <= heads[i]; d++)
                if (heads[i] % s == 0 && heads[i] % d == 0)
                    check_gqa(heads[i], (int32_t)s, (int32_t)d);
}

Test(route, refused_pairs_and_bad_arguments)
{
    kvb_kv_route_t v[MAXR];
    size_t n = 99;
    kvb_kv_topo_t p = gqa(1, 4, 8), d = gqa(1, 16, 8), nhd = gqa(1, 2, 8);
    cr_assert_eq(kvb_kv_route(&p, &d, 0, v, MAXR, &n), KVB_ERR_INVALID_ARG, "denied");
    nhd.order = KVB_KV_ORDER_NHD;
    d = nhd;
    d.tp_size = 4;
    cr_assert_eq(kvb_kv_route(&nhd, &d, 0, v, MAXR, &n), KVB_ERR_INVALID_ARG, "NHD hetero");
    p = mla(1, 2);
    d = mla(2, 4);
    cr_assert_eq(kvb_kv_route(&p, &d, 2, v, MAXR, &n), KVB_ERR_INVALID_ARG, "dd == dp_size");
    cr_assert_eq(kvb_kv_route(&p, &d, -1, v, MAXR, &n), KVB_ERR_INVALID_ARG, "dd < 0");
    cr_assert_eq(kvb_kv_route(&p, &d, 0, v, MAXR, NULL), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_kv_route(&p, &d, 0, NULL, 3, &n), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_kv_route(NULL, &d, 0, v, MAXR, &n), KVB_ERR_INVALID_ARG);
    cr_assert_eq(n, 99, "count untouched on error");
}

Test(route, count_with_small_or_no_buffer)
{
    kvb_kv_route_t v[2];
    size_t n = 0;
    kvb_kv_topo_t p = gqa(1, 4, 8), d = gqa(1, 1, 8);
    cr_assert_eq(kvb_kv_route(&p, &d, 0, NULL, 0, &n), KVB_OK);
    cr_assert_eq(n, 4);
    memset(v, 0xff, sizeof v);
    cr_assert_eq(kvb_kv_route(&p, &d, 0, v, 2, &n), KVB_OK);
    cr_assert_eq(n, 4);
    expect_route(&v[1], 1, 0, 2, 4);
}
