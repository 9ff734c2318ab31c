/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/kv/guard.c: every verdict of the topology guard, on bare topologies (what
 * `kvbridge topo` checks) and on full layouts (what happens at link time). */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "kv/internal.h"
#include "kv/kv_fixture.h"

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

static void expect(kvb_kv_topo_t a, kvb_kv_topo_t b, kvb_kv_verdict_t want, const char *needle)
{
    char reason[KVB_KV_REASON_MAX] = "";
    kvb_kv_verdict_t v = kvb_kv_guard_topo(&a, &b, reason, sizeof reason);
    cr_assert_eq(v, want, "got %s want %s: %s", kvb_kv_verdict_name(v), kvb_kv_verdict_name(want),
                 reason);
    cr_assert_neq(reason[0], '\0', "the guard always explains");
    cr_assert(strstr(reason, needle), "reason '%s' lacks '%s'", reason, needle);
}

TestSuite(guard, .timeout = 30);

Test(guard, homo_same_tp)
{
    expect(mla(1, 4), mla(1, 4), KVB_KV_ALLOW_HOMO, "same TP 4");
    expect(gqa(1, 2, 8), gqa(1, 2, 8), KVB_KV_ALLOW_HOMO, "rank k sends whole blocks to rank k");
    expect(gqa(2, 2, 8), gqa(1, 2, 8), KVB_KV_ALLOW_HOMO, "local dp 2, remote dp 1");
}

Test(guard, homo_allows_nhd_and_replicated_heads)
{
    kvb_kv_topo_t a = gqa(1, 4, 8);
    a.order = KVB_KV_ORDER_NHD;
    expect(a, a, KVB_KV_ALLOW_HOMO, "same TP");
    expect(gqa(1, 16, 8), gqa(3, 16, 8), KVB_KV_ALLOW_HOMO, "same TP 16");
}

Test(guard, hetero_mla_both_directions)
{
    expect(mla(1, 2), mla(4, 8), KVB_KV_ALLOW_HETERO, "MLA latent is replicated");
    expect(mla(1, 8), mla(3, 3), KVB_KV_ALLOW_HETERO, "local TP 8, remote TP 3");
    expect(mla(1, 1), mla(1, 64), KVB_KV_ALLOW_HETERO, "one writer per receiving rank");
}

Test(guard, hetero_gqa_hnd_when_heads_divide_both)
{
    expect(gqa(1, 2, 8), gqa(1, 4, 8), KVB_KV_ALLOW_HETERO,
           "local TP 2 (4 per rank), remote TP 4 (2 per rank)");
    expect(gqa(1, 4, 8), gqa(1, 1, 8), KVB_KV_ALLOW_HETERO, "8 KV heads in HND blocks");
    expect(gqa(2, 8, 8), gqa(1, 1, 8), KVB_KV_ALLOW_HETERO, "local TP 8 (1 per rank)");
    expect(gqa(1, 3, 12), gqa(1, 4, 12), KVB_KV_ALLOW_HETERO, "12 KV heads");
}

Test(guard, deny_hetero_nhd)
{
    kvb_kv_topo_t a = gqa(1, 2, 8), b = gqa(1, 4, 8);
    a.order = b.order = KVB_KV_ORDER_NHD;
    expect(a, b, KVB_KV_DENY_HETERO, "needs HND blocks (heads outermost)");
}

Test(guard, deny_hetero_replicated_heads)
{
    expect(gqa(1, 4, 8), gqa(1, 16, 8), KVB_KV_DENY_HETERO,
           "replicated heads: remote TP 16 exceeds the 8 KV heads");
    expect(gqa(1, 4, 2), gqa(1, 1, 2), KVB_KV_DENY_HETERO, "replicated heads: local TP 4");
    expect(gqa(1, 2, 1), gqa(1, 1, 1), KVB_KV_DENY_HETERO, "not supported yet");
}

Test(guard, invalid_local)
{
    expect(mla(0, 2), mla(1, 2), KVB_KV_INVALID_LOCAL, "local: dp_size 0 is outside 1..4096");
    expect(mla(1, 0), mla(1, 2), KVB_KV_INVALID_LOCAL, "local: tp_size 0");
    expect(mla(-2, 2), mla(1, 2), KVB_KV_INVALID_LOCAL, "dp_size -2");
    expect(mla(1, KVB_KV_TP_MAX + 1), mla(1, 2), KVB_KV_INVALID_LOCAL, "tp_size 4097");
    expect(gqa(1, 3, 8), gqa(1, 2, 8), KVB_KV_INVALID_LOCAL,
           "local: 8 KV heads do not divide over tp_size 3");
    expect(gqa(1, 2, 0), gqa(1, 2, 8), KVB_KV_INVALID_LOCAL, "num_kv_heads 0");
    kvb_kv_topo_t m = mla(1, 2);
    m.num_kv_heads = 4;
    expect(m, mla(1, 2), KVB_KV_INVALID_LOCAL, "MLA has no KV heads");
    m = mla(1, 2);
    m.order = KVB_KV_ORDER_HND;
    expect(m, mla(1, 2), KVB_KV_INVALID_LOCAL, "order must be NONE");
    kvb_kv_topo_t g = gqa(1, 2, 8);
    g.order = KVB_KV_ORDER_NONE;
    expect(g, gqa(1, 2, 8), KVB_KV_INVALID_LOCAL, "neither HND nor NHD");
    g = gqa(1, 2, 8);
    g.attn = 0;
    expect(g, gqa(1, 2, 8), KVB_KV_INVALID_LOCAL, "unknown attention kind 0");
}

Test(guard, invalid_remote)
{
    expect(mla(1, 2), mla(1, -1), KVB_KV_INVALID_REMOTE, "remote: tp_size -1");
    expect(gqa(1, 2, 8), gqa(0, 2, 8), KVB_KV_INVALID_REMOTE, "remote: dp_size 0");
    expect(gqa(1, 2, 8), gqa(1, 4, 6), KVB_KV_INVALID_REMOTE,
           "6 KV heads do not divide over tp_size 4");
    /* Both malformed: the local side is named first. */
    expect(mla(0, 2), mla(0, 2), KVB_KV_INVALID_LOCAL, "local");
}

Test(guard, mismatched_model_shape_is_invalid_remote)
{
    expect(gqa(1, 2, 8), mla(1, 2), KVB_KV_INVALID_REMOTE, "attention gqa locally, mla remotely");
    expect(gqa(1, 2, 8), gqa(1, 2, 16), KVB_KV_INVALID_REMOTE, "8 KV heads locally, 16 remotely");
    kvb_kv_topo_t b = gqa(1, 2, 8);
    b.order = KVB_KV_ORDER_NHD;
    expect(gqa(1, 2, 8), b, KVB_KV_INVALID_REMOTE, "block order HND locally, NHD remotely");
}

Test(guard, null_topologies)
{
    kvb_kv_topo_t a = mla(1, 1);
    cr_assert_eq(kvb_kv_guard_topo(NULL, &a, NULL, 0), KVB_KV_INVALID_LOCAL);
    cr_assert_eq(kvb_kv_guard_topo(&a, NULL, NULL, 0), KVB_KV_INVALID_REMOTE);
}

Test(guard, reason_is_truncated_safely)
{
    kvb_kv_topo_t a = gqa(1, 2, 8), b = gqa(1, 4, 8);
    char small[10];
    memset(small, 'Z', sizeof small);
    cr_assert_eq(kvb_kv_guard_topo(&a, &b, small, sizeof small), KVB_KV_ALLOW_HETERO);
    cr_assert_eq(strlen(small), 9);
}

Test(guard, verdict_names)
{
    cr_assert_str_eq(kvb_kv_verdict_name(KVB_KV_ALLOW_HOMO), "ALLOW_HOMO");
    cr_assert_str_eq(kvb_kv_verdict_name(KVB_KV_ALLOW_HETERO), "ALLOW_HETERO");
    cr_assert_str_eq(kvb_kv_verdict_name(KVB_KV_DENY_HETERO), "DENY_HETERO");
    cr_assert_str_eq(kvb_kv_verdict_name(KVB_KV_INVALID_LOCAL), "INVALID_LOCAL");
    cr_assert_str_eq(kvb_kv_verdict_name(KVB_KV_INVALID_REMOTE), "INVALID_REMOTE");
    cr_assert_str_eq(kvb_kv_verdict_name((kvb_kv_verdict_t)5), "?");
    cr_assert_str_eq(kvb_kv_verdict_name((kvb_kv_verdict_t)-1), "?");
}

/* ---- the link-time guard on layouts ---- */

static fx_layout_t a, b;

static void expect_layouts(kvb_kv_verdict_t want, const char *needle)
{
    char reason[KVB_KV_REASON_MAX] = "";
    kvb_kv_verdict_t v = kvb_kv_guard(&a.l, &b.l, reason, sizeof reason);
    cr_assert_eq(v, want, "got %s want %s: %s", kvb_kv_verdict_name(v), kvb_kv_verdict_name(want),
                 reason);
    cr_assert(strstr(reason, needle), "reason '%s' lacks '%s'", reason, needle);
}

Test(guard, layouts_homo_and_hetero)
{
    fx_gqa(&a, 8, 2, 0, 2, 16, 0x100000000ull);
    fx_gqa(&b, 8, 2, 1, 2, 64, 0x200000000ull);
    expect_layouts(KVB_KV_ALLOW_HOMO, "same TP 2");
    fx_gqa(&b, 8, 4, 3, 2, 64, 0x200000000ull);
    expect_layouts(KVB_KV_ALLOW_HETERO, "8 KV heads in HND blocks");
    fx_mla(&a, 2, 1, 4, 8, 0x100000000ull);
    fx_mla(&b, 8, 7, 4, 8, 0x200000000ull);
    expect_layouts(KVB_KV_ALLOW_HETERO, "MLA latent");
}

Test(guard, layouts_deny)
{
    fx_gqa(&a, 8, 2, 0, 1, 16, 0x100000000ull);
    fx_gqa(&b, 8, 4, 0, 1, 16, 0x200000000ull);
    a.slots[1].order = b.slots[1].order = KVB_KV_ORDER_NHD;
    expect_layouts(KVB_KV_DENY_HETERO, "needs HND");
    fx_gqa(&a, 4, 2, 0, 1, 16, 0x100000000ull);
    fx_gqa(&b, 4, 8, 5, 1, 16, 0x200000000ull);
    expect_layouts(KVB_KV_DENY_HETERO, "replicated heads");
}

Test(guard, layouts_invalid)
{
    fx_gqa(&a, 8, 2, 0, 2, 16, 0x100000000ull);
    fx_gqa(&b, 8, 2, 1, 2, 16, 0x200000000ull);
    a.slots[2].len = 5;
    expect_layouts(KVB_KV_INVALID_LOCAL, "local layout: layer 1 slot K: len 5 is not a multiple");
    fx_gqa(&a, 8, 2, 0, 2, 16, 0x100000000ull);
    b.slots[3].kind = KVB_KV_SLOT_K;
    expect_layouts(KVB_KV_INVALID_REMOTE, "remote layout: layer 1 slot K: duplicate");
    fx_gqa(&b, 8, 2, 1, 2, 16, 0x200000000ull);
    b.l.dtype = KVB_KV_DTYPE_FP16;
    expect_layouts(KVB_KV_INVALID_REMOTE, "remote layout does not match: dtype bf16 locally");
    fx_gqa(&b, 8, 2, 1, 3, 16, 0x200000000ull);
    expect_layouts(KVB_KV_INVALID_REMOTE, "num_layers 2 locally, 3 remotely");
    fx_mla(&b, 2, 1, 2, 16, 0x200000000ull);
    expect_layouts(KVB_KV_INVALID_REMOTE, "attention gqa locally, mla remotely");
}
