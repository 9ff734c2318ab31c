/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/kv/plan.c: the issue's worked example, coalescing (gaps, reversed order,
 * duplicates, asymmetric capacity, overflow), argument checks, and a byte-level simulation that
 * executes the plans of every route with memcpy between simulated TP ranks and checks that each
 * destination byte arrives exactly once with the source's content. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "kv/internal.h"
#include "kv/kv_fixture.h"

#define SEG 7

static fx_layout_t loc, rem;

static void expect_req(const kvb_request_t *q, kvb_opcode_t op, uint64_t local, uint64_t remote,
                       size_t len)
{
    cr_assert_eq(q->opcode, op);
    cr_assert_eq(q->segment, SEG);
    cr_assert_eq((uint64_t)(uintptr_t)q->local, local, "local 0x%llx want 0x%llx",
                 (unsigned long long)(uintptr_t)q->local, (unsigned long long)local);
    cr_assert_eq(q->remote, remote, "remote 0x%llx want 0x%llx", (unsigned long long)q->remote,
                 (unsigned long long)remote);
    cr_assert_eq(q->len, len, "len 0x%zx want 0x%zx", q->len, len);
}

static kvb_kv_plan_args_t args_of(kvb_opcode_t op, const uint64_t *src, size_t ns,
                                  const uint64_t *dst, size_t nd)
{
    return (kvb_kv_plan_args_t){.op = op,
                                .segment = SEG,
                                .src_blocks = src,
                                .num_src = ns,
                                .dst_blocks = dst,
                                .num_dst = nd};
}

static size_t plan_ok(const kvb_kv_plan_args_t *a, kvb_request_t **reqs)
{
    size_t n = 0;
    char reason[KVB_KV_REASON_MAX] = "junk";
    int rc = kvb_kv_plan(&loc.l, &rem.l, a, reqs, &n, reason, sizeof reason);
    cr_assert_eq(rc, KVB_OK, "%s: %s", kvb_status_name(rc), reason);
    cr_assert_str_empty(reason);
    return n;
}

static void plan_fails(const kvb_kv_plan_args_t *a, int want, const char *needle)
{
    kvb_request_t *reqs = (kvb_request_t *)&loc; /* sentinel */
    size_t n = 12345;
    char reason[KVB_KV_REASON_MAX] = "";
    int rc = kvb_kv_plan(&loc.l, &rem.l, a, &reqs, &n, reason, sizeof reason);
    cr_assert_eq(rc, want, "rc %s want %s: %s", kvb_status_name(rc), kvb_status_name(want), reason);
    cr_assert(strstr(reason, needle), "reason '%s' lacks '%s'", reason, needle);
    cr_assert_eq(reqs, (kvb_request_t *)&loc, "outputs untouched on error");
    cr_assert_eq(n, 12345);
}

/* One MLA layer: LATENT with 0x40-byte blocks at `base`, INDEX with 8-byte blocks at `ibase`. */
static void example_layout(fx_layout_t *f, uint64_t base, uint64_t ibase, uint64_t blocks)
{
    fx_mla(f, 1, 0, 1, blocks, base);
    fx_add(f, base, 0, KVB_KV_SLOT_INDEX, 8, blocks)->base = ibase;
}

TestSuite(plan, .timeout = 30);

Test(plan, worked_example_from_the_issue)
{
    /* READ, remote block 1 -> local block 3, run of 2, 0x40-byte blocks, local base 0x1000,
     * remote base 0x5000: local 0x10C0, remote 0x5040, length 0x80; INDEX (8-byte blocks): 0x10. */
    example_layout(&loc, 0x1000, 0x3000, 8);
    example_layout(&rem, 0x5000, 0x7000, 8);
    uint64_t src[] = {1, 2}, dst[] = {3, 4};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 2, dst, 2);
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2);
    expect_req(&q[0], KVB_OP_READ, 0x10C0, 0x5040, 0x80);
    expect_req(&q[1], KVB_OP_READ, 0x3000 + 3 * 8, 0x7000 + 1 * 8, 0x10);
    kvb_kv_plan_free(q);
}

Test(plan, write_direction_reads_source_ids_locally)
{
    example_layout(&loc, 0x1000, 0x3000, 8);
    example_layout(&rem, 0x5000, 0x7000, 8);
    uint64_t src[] = {1, 2}, dst[] = {3, 4}; /* local 1, 2 -> remote 3, 4 */
    kvb_kv_plan_args_t a = args_of(KVB_OP_WRITE, src, 2, dst, 2);
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2);
    expect_req(&q[0], KVB_OP_WRITE, 0x1040, 0x50C0, 0x80);
    expect_req(&q[1], KVB_OP_WRITE, 0x3008, 0x7018, 0x10);
    kvb_kv_plan_free(q);
}

Test(plan, gaps_split_runs_and_input_order_does_not_matter)
{
    example_layout(&loc, 0x1000, 0x3000, 32);
    example_layout(&rem, 0x5000, 0x7000, 32);
    /* Sorted by source: 1-3 -> 11-13 (a run), 5 -> 15 (gap in both), 7-8 -> 20-21 (run), 9 -> 23
     * (destination gap only), 10 -> 22 (destination steps back). */
    uint64_t src[] = {8, 5, 1, 10, 3, 2, 7, 9}, dst[] = {21, 15, 11, 22, 13, 12, 20, 23};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 8, dst, 8);
    kvb_request_t *q = NULL;
    size_t n = plan_ok(&a, &q);
    cr_assert_eq(n, 10, "5 runs x 2 slots");
    expect_req(&q[0], KVB_OP_READ, 0x1000 + 11 * 0x40, 0x5000 + 1 * 0x40, 3 * 0x40);
    expect_req(&q[1], KVB_OP_READ, 0x1000 + 15 * 0x40, 0x5000 + 5 * 0x40, 0x40);
    expect_req(&q[2], KVB_OP_READ, 0x1000 + 20 * 0x40, 0x5000 + 7 * 0x40, 2 * 0x40);
    expect_req(&q[3], KVB_OP_READ, 0x1000 + 23 * 0x40, 0x5000 + 9 * 0x40, 0x40);
    expect_req(&q[4], KVB_OP_READ, 0x1000 + 22 * 0x40, 0x5000 + 10 * 0x40, 0x40);
    expect_req(&q[5], KVB_OP_READ, 0x3000 + 11 * 8, 0x7000 + 1 * 8, 3 * 8);
    kvb_kv_plan_free(q);
}

Test(plan, reversed_lists_merge_into_one_run)
{
    example_layout(&loc, 0x1000, 0x3000, 32);
    example_layout(&rem, 0x5000, 0x7000, 32);
    uint64_t src[] = {6, 5, 4, 3}, dst[] = {13, 12, 11, 10};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 4, dst, 4);
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2);
    expect_req(&q[0], KVB_OP_READ, 0x1000 + 10 * 0x40, 0x5000 + 3 * 0x40, 4 * 0x40);
    kvb_kv_plan_free(q);
}

Test(plan, anti_parallel_ids_do_not_merge)
{
    example_layout(&loc, 0x1000, 0x3000, 32);
    example_layout(&rem, 0x5000, 0x7000, 32);
    uint64_t src[] = {1, 2, 3}, dst[] = {3, 2, 1};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 3, dst, 3);
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 6);
    expect_req(&q[0], KVB_OP_READ, 0x1000 + 3 * 0x40, 0x5040, 0x40);
    expect_req(&q[2], KVB_OP_READ, 0x1000 + 1 * 0x40, 0x50C0, 0x40);
    kvb_kv_plan_free(q);
}

Test(plan, duplicates_are_rejected)
{
    example_layout(&loc, 0x1000, 0x3000, 32);
    example_layout(&rem, 0x5000, 0x7000, 32);
    uint64_t src[] = {4, 2, 4}, dst[] = {1, 2, 3};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 3, dst, 3);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "source block 4 is listed twice");
    uint64_t src2[] = {1, 2, 3}, dst2[] = {9, 8, 9};
    a = args_of(KVB_OP_READ, src2, 3, dst2, 3);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "destination block 9 is listed twice");
}

Test(plan, mismatched_list_lengths_are_an_error)
{
    example_layout(&loc, 0x1000, 0x3000, 32);
    example_layout(&rem, 0x5000, 0x7000, 32);
    uint64_t src[] = {1, 2, 3}, dst[] = {1, 2};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 3, dst, 2);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "3 source blocks but 2 destination blocks");
}

Test(plan, asymmetric_capacity_is_checked_per_side)
{
    example_layout(&loc, 0x1000, 0x3000, 4);   /* the local side holds 4 blocks */
    example_layout(&rem, 0x5000, 0x7000, 100); /* the remote 100 */
    uint64_t src[] = {98, 99}, dst[] = {2, 3};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 2, dst, 2);
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2);
    expect_req(&q[0], KVB_OP_READ, 0x1080, 0x5000 + 98 * 0x40, 0x80);
    kvb_kv_plan_free(q);
    uint64_t dst2[] = {3, 4}; /* the run 3..4 leaves the local buffer */
    a = args_of(KVB_OP_READ, src, 2, dst2, 2);
    plan_fails(&a, KVB_ERR_INVALID_ARG,
               "layer 0 slot LATENT: local blocks 3..4 exceed its 4 blocks");
    uint64_t src3[] = {100}, dst3[] = {0};
    a = args_of(KVB_OP_READ, src3, 1, dst3, 1);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "remote blocks 100..100 exceed its 100 blocks");
}

Test(plan, address_overflow)
{
    example_layout(&loc, 0x1000, 0x3000, 4);
    example_layout(&rem, 0x5000, 0x7000, 4);
    uint64_t src[] = {UINT64_MAX / 0x20}, dst[] = {0};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 1, dst, 1);
    plan_fails(&a, KVB_ERR_OVERFLOW, "remote block 576460752303423487 * 64 bytes overflows");
    uint64_t src2[] = {UINT64_MAX - 1, UINT64_MAX}, dst2[] = {0, 1};
    a = args_of(KVB_OP_READ, src2, 2, dst2, 2);
    plan_fails(&a, KVB_ERR_OVERFLOW, "overflows");
    /* Near the top of the address space: the block fits, base + offset must not wrap. */
    example_layout(&rem, 0xFFFFFFFFFFFFF000ull - 0x400, 0x7000, 16);
    example_layout(&loc, 0x1000, 0x3000, 16);
    uint64_t src3[] = {15}, dst3[] = {0};
    a = args_of(KVB_OP_READ, src3, 1, dst3, 1);
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2);
    expect_req(&q[0], KVB_OP_READ, 0x1000, 0xFFFFFFFFFFFFF000ull - 0x40, 0x40);
    kvb_kv_plan_free(q);
}

Test(plan, layers_subset_in_given_order)
{
    fx_gqa(&loc, 8, 2, 0, 4, 16, 0x100000000ull);
    fx_gqa(&rem, 8, 2, 0, 4, 16, 0x200000000ull);
    uint64_t src[] = {0, 1}, dst[] = {4, 5};
    uint32_t layers[] = {3, 1};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 2, dst, 2);
    a.layers = layers;
    a.num_layers = 2;
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 4, "2 layers x (K, V) x 1 run");
    uint64_t bb = 4 * FX_STRIDE;
    expect_req(&q[0], KVB_OP_READ, loc.slots[6].base + 4 * bb, rem.slots[6].base, 2 * bb);
    expect_req(&q[1], KVB_OP_READ, loc.slots[7].base + 4 * bb, rem.slots[7].base, 2 * bb);
    expect_req(&q[2], KVB_OP_READ, loc.slots[2].base + 4 * bb, rem.slots[2].base, 2 * bb);
    kvb_kv_plan_free(q);
    uint32_t bad[] = {1, 4};
    a.layers = bad;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "layer 4 is out of range (num_layers 4)");
    uint32_t twice[] = {2, 0, 2};
    a.layers = twice;
    a.num_layers = 3;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "layer 2 is listed twice");
    a.num_layers = 0;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "layer list is empty");
}

Test(plan, all_layers_slot_by_slot)
{
    fx_gqa(&loc, 8, 2, 1, 3, 16, 0x100000000ull);
    fx_gqa(&rem, 8, 2, 1, 3, 16, 0x200000000ull);
    uint64_t src[] = {2, 9}, dst[] = {3, 4};
    kvb_kv_plan_args_t a = args_of(KVB_OP_WRITE, src, 2, dst, 2);
    kvb_request_t *q = NULL;
    size_t n = plan_ok(&a, &q);
    cr_assert_eq(n, 12, "3 layers x 2 slots x 2 runs");
    for (size_t i = 0; i < n; i++) {
        const kvb_kv_slot_t *s = &loc.slots[i / 2];
        cr_assert_geq((uint64_t)(uintptr_t)q[i].local, s->base, "request %zu in slot %zu", i,
                      i / 2);
        cr_assert_lt((uint64_t)(uintptr_t)q[i].local, s->base + s->len);
    }
    kvb_kv_plan_free(q);
}

Test(plan, empty_lists_give_no_requests)
{
    example_layout(&loc, 0x1000, 0x3000, 4);
    example_layout(&rem, 0x5000, 0x7000, 4);
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, NULL, 0, NULL, 0);
    kvb_request_t *q = (kvb_request_t *)&loc;
    cr_assert_eq(plan_ok(&a, &q), 0);
    cr_assert_null(q);
    kvb_kv_plan_free(NULL);
}

Test(plan, argument_checks)
{
    example_layout(&loc, 0x1000, 0x3000, 4);
    example_layout(&rem, 0x5000, 0x7000, 4);
    uint64_t src[] = {1}, dst[] = {2};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 1, dst, 1);
    a.segment = 0;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "segment handle 0");
    a = args_of((kvb_opcode_t)5, src, 1, dst, 1);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "op 5 is neither READ nor WRITE");
    a = args_of(KVB_OP_READ, NULL, 1, dst, 1);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "block list is NULL");
    plan_fails(NULL, KVB_ERR_INVALID_ARG, "must not be NULL");
    a = args_of(KVB_OP_READ, src, 1, dst, 1);
    size_t n;
    cr_assert_eq(kvb_kv_plan(&loc.l, &rem.l, &a, NULL, &n, NULL, 0), KVB_ERR_INVALID_ARG);
}

Test(plan, layouts_must_link)
{
    example_layout(&loc, 0x1000, 0x3000, 4);
    example_layout(&rem, 0x5000, 0x7000, 4);
    rem.slots[1].block_bytes = 16;
    rem.slots[1].len = 64;
    uint64_t src[] = {1}, dst[] = {2};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 1, dst, 1);
    plan_fails(&a, KVB_ERR_INVALID_ARG, "layer 0 slot INDEX: block_bytes 8 locally, 16 remotely");
    rem.slots[1].len = 0;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "remote layout: layer 0 slot INDEX: len is 0");
}

/* ---- routes: head ranges ---- */

Test(plan, gqa_pull_tp2_to_tp4_head_range)
{
    /* Decode rank 1 (local, 2 heads: [2,4)) reads from prefill rank 0 (remote, [0,4)): per block
     * the remote range starts 2 heads in, the local range is its whole block. */
    fx_gqa(&loc, 8, 4, 1, 1, 16, 0x100000000ull);
    fx_add(&loc, 0x100000000ull, 0, KVB_KV_SLOT_INDEX, 8, 16);
    fx_gqa(&rem, 8, 2, 0, 1, 16, 0x200000000ull);
    fx_add(&rem, 0x200000000ull, 0, KVB_KV_SLOT_INDEX, 8, 16);
    uint64_t src[] = {5, 6, 7}, dst[] = {0, 1, 2};
    kvb_kv_route_t rt = {.src_rank = 0, .dst_rank = 1, .head_begin = 2, .head_end = 4};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 3, dst, 3);
    a.route = &rt;
    kvb_request_t *q = NULL;
    size_t n = plan_ok(&a, &q);
    cr_assert_eq(n, 7, "K and V: one per block (3 each); INDEX: one run");
    uint64_t lbb = 2 * FX_STRIDE, rbb = 4 * FX_STRIDE;
    for (int b = 0; b < 3; b++) {
        expect_req(&q[b], KVB_OP_READ, loc.slots[0].base + (uint64_t)b * lbb,
                   rem.slots[0].base + (uint64_t)(5 + b) * rbb + 2 * FX_STRIDE, 2 * FX_STRIDE);
        expect_req(&q[3 + b], KVB_OP_READ, loc.slots[1].base + (uint64_t)b * lbb,
                   rem.slots[1].base + (uint64_t)(5 + b) * rbb + 2 * FX_STRIDE, 2 * FX_STRIDE);
    }
    expect_req(&q[6], KVB_OP_READ, loc.slots[2].base, rem.slots[2].base + 5 * 8, 3 * 8);
    kvb_kv_plan_free(q);
}

/* The same route over NHD blocks: a head range is not one byte range there, and the plan used to
 * move the range's bytes as if it were (the wrong bytes, in bounds). The guard refuses such a pair
 * at link time; a direct caller of kvb_kv_plan is refused here. */
Test(plan, a_partial_head_route_over_nhd_blocks_is_refused)
{
    fx_gqa(&loc, 8, 4, 1, 1, 16, 0x100000000ull);
    fx_gqa(&rem, 8, 2, 0, 1, 16, 0x200000000ull);
    for (size_t i = 0; i < loc.l.num_slots; i++)
        loc.slots[i].order = KVB_KV_ORDER_NHD;
    for (size_t i = 0; i < rem.l.num_slots; i++)
        rem.slots[i].order = KVB_KV_ORDER_NHD;
    uint64_t src[] = {5}, dst[] = {0};
    kvb_kv_route_t rt = {.src_rank = 0, .dst_rank = 1, .head_begin = 2, .head_end = 4};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 1, dst, 1);
    a.route = &rt;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "HND");
}

Test(plan, gqa_push_tp4_to_tp1_only_first_sender_moves_unsplit_slots)
{
    /* Prefill rank 2 (local, heads [4,6)) writes into decode rank 0 (remote, all 8 heads). */
    fx_gqa(&loc, 8, 4, 2, 1, 16, 0x100000000ull);
    fx_add(&loc, 0x100000000ull, 0, KVB_KV_SLOT_INDEX, 8, 16);
    fx_gqa(&rem, 8, 1, 0, 1, 16, 0x200000000ull);
    fx_add(&rem, 0x200000000ull, 0, KVB_KV_SLOT_INDEX, 8, 16);
    uint64_t src[] = {1}, dst[] = {9};
    kvb_kv_route_t rt = {.src_rank = 2, .dst_rank = 0, .head_begin = 4, .head_end = 6};
    kvb_kv_plan_args_t a = args_of(KVB_OP_WRITE, src, 1, dst, 1);
    a.route = &rt;
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2, "K and V only: rank 0 sends INDEX");
    expect_req(&q[0], KVB_OP_WRITE, loc.slots[0].base + 2 * FX_STRIDE,
               rem.slots[0].base + 9 * 8 * FX_STRIDE + 4 * FX_STRIDE, 2 * FX_STRIDE);
    kvb_kv_plan_free(q);
    /* Prefill rank 0 sends heads [0,2) and the INDEX slot. */
    fx_gqa(&loc, 8, 4, 0, 1, 16, 0x100000000ull);
    fx_add(&loc, 0x100000000ull, 0, KVB_KV_SLOT_INDEX, 8, 16);
    rt = (kvb_kv_route_t){.src_rank = 0, .dst_rank = 0, .head_begin = 0, .head_end = 2};
    cr_assert_eq(plan_ok(&a, &q), 3);
    expect_req(&q[2], KVB_OP_WRITE, loc.slots[2].base + 8, rem.slots[2].base + 9 * 8, 8);
    kvb_kv_plan_free(q);
}

Test(plan, homo_route_keeps_runs_whole)
{
    fx_gqa(&loc, 8, 2, 1, 1, 16, 0x100000000ull);
    fx_gqa(&rem, 8, 2, 1, 1, 16, 0x200000000ull);
    uint64_t src[] = {1, 2, 3}, dst[] = {4, 5, 6};
    kvb_kv_route_t rt = {.src_rank = 1, .dst_rank = 1, .head_begin = 4, .head_end = 8};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 3, dst, 3);
    a.route = &rt;
    kvb_request_t *q = NULL;
    cr_assert_eq(plan_ok(&a, &q), 2);
    expect_req(&q[0], KVB_OP_READ, loc.slots[0].base + 4 * 4 * FX_STRIDE,
               rem.slots[0].base + 4 * FX_STRIDE, 3 * 4 * FX_STRIDE);
    kvb_kv_plan_free(q);
}

Test(plan, route_must_fit_the_layouts)
{
    fx_gqa(&loc, 8, 4, 1, 1, 16, 0x100000000ull);
    fx_gqa(&rem, 8, 2, 0, 1, 16, 0x200000000ull);
    uint64_t src[] = {1}, dst[] = {2};
    kvb_kv_plan_args_t a = args_of(KVB_OP_READ, src, 1, dst, 1);
    plan_fails(&a, KVB_ERR_INVALID_ARG,
               "GQA sides with different TP (2 and 4) need the pair's route");
    kvb_kv_route_t rt = {.src_rank = 1, .dst_rank = 1, .head_begin = 2, .head_end = 4};
    a.route = &rt;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "route is for ranks 1 -> 1, the layouts are ranks 0 -> 1");
    rt = (kvb_kv_route_t){.src_rank = 0, .dst_rank = 1, .head_begin = 0, .head_end = 2};
    plan_fails(&a, KVB_ERR_INVALID_ARG, "route heads [0, 2) are not held by both");
    rt.head_begin = rt.head_end = 3;
    plan_fails(&a, KVB_ERR_INVALID_ARG, "route heads [3, 3)");
    example_layout(&loc, 0x1000, 0x3000, 4);
    example_layout(&rem, 0x5000, 0x7000, 4);
    rt = (kvb_kv_route_t){.src_rank = 0, .dst_rank = 0, .head_begin = 0, .head_end = 1};
    plan_fails(&a, KVB_ERR_INVALID_ARG, "an MLA route has no head range");
}

/* ---- simulation: execute every route's plan and check every byte ---- */

#define SIM_LAYERS 2
#define SIM_MAXTP  16

typedef struct {
    fx_layout_t f;
    uint8_t *cover[FX_MAX_SLOTS]; /* decode side: times each byte was written */
} sim_rank_t;

static sim_rank_t pre[SIM_MAXTP], dec[SIM_MAXTP];

static uint8_t pattern(uint32_t layer, unsigned kind, uint64_t block, uint32_t head, uint64_t off)
{
    uint64_t h = layer * 1000003ull ^ kind * 7919ull ^ block * 104729ull ^ head * 1299709ull ^
                 off * 15485863ull;
    return (uint8_t)(h ^ (h >> 13) ^ (h >> 29));
}

/* Byte `off` of block `block` of slot s on a rank whose first head is `first`. */
static uint8_t expected(const kvb_kv_slot_t *s, uint32_t first, uint64_t block, uint64_t off)
{
    if (!s->num_heads)
        return pattern(s->layer, s->kind, block, UINT32_MAX, off);
    uint64_t stride = s->block_bytes / s->num_heads;
    return pattern(s->layer, s->kind, block, first + (uint32_t)(off / stride), off % stride);
}

static uint32_t first_head(const kvb_kv_layout_t *l)
{
    return l->attn == KVB_KV_ATTN_MLA ? 0
                                      : kvb__kv_first_head(l->tp_rank, l->tp_size, l->num_kv_heads);
}

/* A rank with real buffers: K, V (GQA) or LATENT (MLA), plus an INDEX slot, per layer. */
static void sim_rank(sim_rank_t *r, kvb_kv_attn_t attn, uint32_t heads, int32_t dp, int32_t dp_rank,
                     int32_t tp, int32_t rank, uint64_t blocks, int fill)
{
    if (attn == KVB_KV_ATTN_MLA)
        fx_mla(&r->f, tp, rank, SIM_LAYERS, blocks, 0x1000);
    else
        fx_gqa(&r->f, heads, tp, rank, SIM_LAYERS, blocks, 0x1000);
    for (uint32_t layer = 0; layer < SIM_LAYERS; layer++)
        fx_add(&r->f, 0x1000, layer, KVB_KV_SLOT_INDEX, 8, blocks);
    r->f.l.dp_size = dp;
    r->f.l.dp_rank = dp_rank;
    for (size_t i = 0; i < r->f.l.num_slots; i++) {
        kvb_kv_slot_t *s = &r->f.slots[i];
        uint8_t *mem = malloc(s->len);
        r->cover[i] = calloc(s->len, 1);
        s->base = (uint64_t)(uintptr_t)mem;
        for (uint64_t o = 0; o < s->len; o++)
            mem[o] = fill ? expected(s, first_head(&r->f.l), o / s->block_bytes, o % s->block_bytes)
                          : 0xEE;
    }
}

static void sim_free(sim_rank_t *r)
{
    for (size_t i = 0; i < r->f.l.num_slots; i++) {
        free((void *)(uintptr_t)r->f.slots[i].base);
        free(r->cover[i]);
    }
}

/* Counts the write into whichever decode slot holds [addr, addr+len). */
static void cover(sim_rank_t *d, uint64_t addr, size_t len)
{
    for (size_t i = 0; i < d->f.l.num_slots; i++) {
        const kvb_kv_slot_t *s = &d->f.slots[i];
        if (kvb__range_within(addr, len, s->base, s->len)) {
            for (size_t k = 0; k < len; k++)
                d->cover[i][addr - s->base + k]++;
            return;
        }
    }
    cr_assert_fail("write outside every decode slot");
}

static void execute(const kvb_request_t *q, size_t n, sim_rank_t *d)
{
    for (size_t i = 0; i < n; i++) {
        if (q[i].opcode == KVB_OP_READ) {
            memcpy(q[i].local, (const void *)(uintptr_t)q[i].remote, q[i].len);
            cover(d, (uint64_t)(uintptr_t)q[i].local, q[i].len);
        } else {
            memcpy((void *)(uintptr_t)q[i].remote, q[i].local, q[i].len);
            cover(d, q[i].remote, q[i].len);
        }
    }
}

static const uint64_t sim_src[] = {7, 2, 3, 4, 9, 10, 11};
static const uint64_t sim_dst[] = {1, 5, 6, 7, 0, 8, 2};
#define SIM_N 7

static int64_t src_of(uint64_t dst_block)
{
    for (int i = 0; i < SIM_N; i++)
        if (sim_dst[i] == dst_block)
            return (int64_t)sim_src[i];
    return -1;
}

static void verify(const sim_rank_t *d, const char *what)
{
    for (size_t i = 0; i < d->f.l.num_slots; i++) {
        const kvb_kv_slot_t *s = &d->f.slots[i];
        const uint8_t *mem = (const uint8_t *)(uintptr_t)s->base;
        for (uint64_t o = 0; o < s->len; o++) {
            int64_t sb = src_of(o / s->block_bytes);
            uint8_t want =
                sb < 0 ? 0xEE : expected(s, first_head(&d->f.l), (uint64_t)sb, o % s->block_bytes);
            cr_assert_eq(d->cover[i][o], sb < 0 ? 0 : 1,
                         "%s: rank %d slot %zu byte %llu covered %d", what, d->f.l.tp_rank, i,
                         (unsigned long long)o, d->cover[i][o]);
            cr_assert_eq(mem[o], want, "%s: rank %d slot %zu byte %llu", what, d->f.l.tp_rank, i,
                         (unsigned long long)o);
        }
    }
}

/* The per-layer plan (what layer-wise pulls and pushes use) is, layer by layer, exactly what
 * kvb_kv_plan gives for that one layer. */
static void same_per_layer(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                           const kvb_kv_plan_args_t *all)
{
    uint32_t L = local->num_layers;
    kvb_request_t **per = calloc(L, sizeof *per);
    size_t *counts = calloc(L, sizeof *counts);
    char reason[KVB_KV_REASON_MAX] = "junk";
    int rc = kvb__kv_plan_layers(local, remote, all, per, counts, reason, sizeof reason);
    cr_assert_eq(rc, KVB_OK, "%s", reason);
    cr_assert_str_empty(reason);
    for (uint32_t layer = 0; layer < L; layer++) {
        kvb_kv_plan_args_t one = *all;
        one.layers = &layer;
        one.num_layers = 1;
        kvb_request_t *q = NULL;
        size_t n = 0;
        cr_assert_eq(kvb_kv_plan(local, remote, &one, &q, &n, reason, sizeof reason), KVB_OK);
        cr_assert_eq(counts[layer], n, "layer %u", layer);
        for (size_t i = 0; i < n; i++) {
            const kvb_request_t *x = &per[layer][i];
            cr_assert(x->opcode == q[i].opcode && x->local == q[i].local &&
                          x->segment == q[i].segment && x->remote == q[i].remote &&
                          x->len == q[i].len,
                      "layer %u request %zu", layer, i);
        }
        kvb_kv_plan_free(q);
        kvb_kv_plan_free(per[layer]);
    }
    kvb_kv_plan_args_t listed = *all;
    uint32_t zero = 0;
    listed.layers = &zero;
    listed.num_layers = 1;
    cr_assert_eq(kvb__kv_plan_layers(local, remote, &listed, per, counts, reason, sizeof reason),
                 KVB_ERR_INVALID_ARG, "a layer list");
    free(per);
    free(counts);
}

static void plan_route(const kvb_kv_route_t *rt, int push)
{
    sim_rank_t *p = &pre[rt->src_rank], *d = &dec[rt->dst_rank];
    kvb_kv_plan_args_t a = {.op = push ? KVB_OP_WRITE : KVB_OP_READ,
                            .segment = 1,
                            .src_blocks = sim_src,
                            .num_src = SIM_N,
                            .dst_blocks = sim_dst,
                            .num_dst = SIM_N,
                            .route = rt};
    kvb_request_t *q = NULL;
    size_t n = 0;
    char reason[KVB_KV_REASON_MAX] = "";
    const kvb_kv_layout_t *local = push ? &p->f.l : &d->f.l, *remote = push ? &d->f.l : &p->f.l;
    cr_assert_eq(kvb_kv_guard(local, remote, reason, sizeof reason) <= KVB_KV_ALLOW_HETERO, 1,
                 "guard: %s", reason);
    int rc = kvb_kv_plan(local, remote, &a, &q, &n, reason, sizeof reason);
    cr_assert_eq(rc, KVB_OK, "plan %d -> %d: %s", rt->src_rank, rt->dst_rank, reason);
    execute(q, n, d);
    kvb_kv_plan_free(q);
    same_per_layer(local, remote, &a);
}

/* Prefill (dp 2, group 1) -> decode group dd of dst_dp: every route planned from the side that
 * issues the requests, executed, and every decode byte checked. */
static void simulate(kvb_kv_attn_t attn, uint32_t heads, int32_t src_tp, int32_t dst_tp,
                     int32_t dst_dp, int32_t dd, int push)
{
    for (int32_t r = 0; r < src_tp; r++)
        sim_rank(&pre[r], attn, heads, 2, 1, src_tp, r, 12, 1);
    for (int32_t k = 0; k < dst_tp; k++)
        sim_rank(&dec[k], attn, heads, dst_dp, dd, dst_tp, k, 9, 0);
    kvb_kv_topo_t pt, dt;
    cr_assert_eq(kvb_kv_layout_topo(&pre[0].f.l, &pt), KVB_OK);
    cr_assert_eq(kvb_kv_layout_topo(&dec[0].f.l, &dt), KVB_OK);
    kvb_kv_route_t routes[64];
    size_t n = 0;
    cr_assert_eq(kvb_kv_route(&pt, &dt, dd, routes, 64, &n), KVB_OK);
    for (size_t i = 0; i < n; i++)
        plan_route(&routes[i], push);
    char what[96];
    snprintf(what, sizeof what, "%s H%u tp %d->%d dd %d %s",
             attn == KVB_KV_ATTN_MLA ? "mla" : "gqa", heads, src_tp, dst_tp, dd,
             push ? "push" : "pull");
    for (int32_t k = 0; k < dst_tp; k++)
        verify(&dec[k], what);
    for (int32_t r = 0; r < src_tp; r++)
        sim_free(&pre[r]);
    for (int32_t k = 0; k < dst_tp; k++)
        sim_free(&dec[k]);
}

Test(plan, simulate_gqa_tp2_to_tp4_pull_and_push)
{
    simulate(KVB_KV_ATTN_GQA, 8, 2, 4, 1, 0, 0);
    simulate(KVB_KV_ATTN_GQA, 8, 2, 4, 1, 0, 1);
}

Test(plan, simulate_gqa_tp4_to_tp1_pull_and_push)
{
    simulate(KVB_KV_ATTN_GQA, 8, 4, 1, 1, 0, 0);
    simulate(KVB_KV_ATTN_GQA, 8, 4, 1, 1, 0, 1);
}

Test(plan, simulate_gqa_dp2_to_dp1_same_tp)
{
    simulate(KVB_KV_ATTN_GQA, 8, 2, 2, 1, 0, 0);
    simulate(KVB_KV_ATTN_GQA, 8, 2, 2, 1, 0, 1);
}

Test(plan, simulate_gqa_uneven_and_replicated)
{
    simulate(KVB_KV_ATTN_GQA, 12, 3, 4, 2, 1, 0);
    simulate(KVB_KV_ATTN_GQA, 12, 4, 3, 1, 0, 1);
    simulate(KVB_KV_ATTN_GQA, 4, 8, 8, 1, 0, 0); /* same TP, heads replicated */
    simulate(KVB_KV_ATTN_GQA, 8, 1, 8, 1, 0, 1);
}

Test(plan, simulate_mla_both_directions)
{
    simulate(KVB_KV_ATTN_MLA, 0, 2, 8, 4, 3, 0);
    simulate(KVB_KV_ATTN_MLA, 0, 8, 3, 3, 2, 1);
    simulate(KVB_KV_ATTN_MLA, 0, 4, 4, 2, 1, 0);
    simulate(KVB_KV_ATTN_MLA, 0, 3, 16, 1, 0, 1);
}
