/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/kv/layout.c: every rule of a single layout and of a linked pair, each broken
 * alone on an otherwise valid layout, with the reason checked for the layer and slot it names. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv/internal.h"
#include "kv/kv_fixture.h"

#define BASE  0x10000000ull
#define RBASE 0x90000000ull

#define EXPECT_RC(rc_expr, want, reason, needle)                                                   \
    do {                                                                                           \
        int rc_ = (rc_expr);                                                                       \
        cr_assert_eq(rc_, (want), "rc %s, want %s; reason: %s", kvb_status_name(rc_),              \
                     kvb_status_name(want), reason);                                               \
        cr_assert(strstr(reason, needle), "reason '%s' lacks '%s'", reason, needle);               \
    } while (0)

#define EXPECT_INVALID(layout, want, needle)                                                       \
    do {                                                                                           \
        char r_[KVB_KV_REASON_MAX] = "";                                                           \
        EXPECT_RC(kvb_kv_layout_validate(layout, r_, sizeof r_), want, r_, needle);                \
    } while (0)

#define EXPECT_PAIR(a, b, want, needle)                                                            \
    do {                                                                                           \
        char r_[KVB_KV_REASON_MAX] = "";                                                           \
        EXPECT_RC(kvb_kv_layout_check_pair(a, b, r_, sizeof r_), want, r_, needle);                \
    } while (0)

static fx_layout_t g, m; /* a GQA layout (8 heads, TP 2, rank 1, 3 layers) and an MLA one */

static void setup(void)
{
    fx_gqa(&g, 8, 2, 1, 3, 16, BASE);
    fx_mla(&m, 4, 0, 3, 16, BASE);
    fx_add(&m, BASE, 1, KVB_KV_SLOT_INDEX, 8, 16);
}

TestSuite(layout, .init = setup, .timeout = 30);

Test(layout, valid_layouts_pass_with_empty_reason)
{
    char r[KVB_KV_REASON_MAX] = "junk";
    cr_assert_eq(kvb_kv_layout_validate(&g.l, r, sizeof r), KVB_OK, "%s", r);
    cr_assert_str_empty(r);
    cr_assert_eq(kvb_kv_layout_validate(&m.l, r, sizeof r), KVB_OK, "%s", r);
    cr_assert_eq(kvb_kv_layout_validate(&m.l, NULL, 0), KVB_OK);
}

Test(layout, null_layout)
{
    EXPECT_INVALID(NULL, KVB_ERR_INVALID_ARG, "NULL");
}

Test(layout, model_id_empty_or_unterminated)
{
    g.l.model[0] = '\0';
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "model id is empty");
    memset(g.l.model, 'x', sizeof g.l.model);
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "model id is longer");
    g.l.model[KVB_KV_MODEL_MAX] = '\0'; /* exactly at the limit */
    cr_assert_eq(kvb_kv_layout_validate(&g.l, NULL, 0), KVB_OK);
}

Test(layout, unknown_dtype_and_attention)
{
    g.l.dtype = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "unknown dtype 0");
    g.l.dtype = 99;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "unknown dtype 99");
    setup();
    g.l.attn = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "unknown attention");
    g.l.attn = (kvb_kv_attn_t)-1;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "unknown attention");
}

Test(layout, non_positive_counts)
{
    g.l.tokens_per_block = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "tokens_per_block is 0");
    setup();
    g.l.num_layers = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "num_layers 0");
    g.l.num_layers = KVB_KV_LAYERS_MAX + 1;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "num_layers 1025");
    setup();
    g.l.num_slots = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "no slots");
    setup();
    g.l.slots = NULL;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "no slots");
}

Test(layout, dp_and_tp_sizes_and_ranks)
{
    int32_t bad_sizes[] = {0, -1, INT32_MIN, KVB_KV_TP_MAX + 1};
    for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
        setup();
        g.l.dp_size = bad_sizes[i];
        EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "dp_size");
        setup();
        g.l.tp_size = bad_sizes[i];
        EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "tp_size");
    }
    setup();
    g.l.dp_rank = 1;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "dp_rank 1 is outside dp_size 1");
    g.l.dp_rank = -1;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "dp_rank -1");
    setup();
    g.l.tp_rank = 2;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "tp_rank 2 is outside tp_size 2");
    g.l.tp_rank = -3;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "tp_rank -3");
}

Test(layout, kv_heads_must_divide_tp)
{
    g.l.num_kv_heads = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "num_kv_heads 0");
    g.l.num_kv_heads = KVB_KV_HEADS_MAX + 1;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "num_kv_heads");
    fx_gqa(&g, 8, 3, 0, 1, 4, BASE);
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "8 KV heads do not divide over tp_size 3");
    fx_gqa(&g, 3, 4, 0, 1, 4, BASE); /* 4 ranks cannot replicate 3 heads evenly */
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "3 KV heads do not divide over tp_size 4");
    m.l.num_kv_heads = 1;
    EXPECT_INVALID(&m.l, KVB_ERR_INVALID_ARG, "MLA has no KV heads");
}

Test(layout, replicated_heads_are_valid)
{
    fx_gqa(&g, 2, 4, 3, 2, 4, BASE); /* 2 heads over 4 ranks: each holds 1 */
    cr_assert_eq(g.slots[0].num_heads, 1);
    cr_assert_eq(kvb_kv_layout_validate(&g.l, NULL, 0), KVB_OK);
}

Test(layout, layer_and_slot_ids_out_of_range)
{
    g.slots[5].layer = 3;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "slot entry 5: layer id 3 is out of range");
    setup();
    g.slots[2].kind = KVB_KV_SLOT_COUNT;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "slot entry 2 (layer 1): slot id 6 is out of range");
    g.slots[2].kind = (kvb_kv_slot_kind_t)-1;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "is out of range");
}

Test(layout, duplicate_layer_slot)
{
    g.slots[3].kind = KVB_KV_SLOT_K; /* layer 1 now has K twice */
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 1 slot K: duplicate (layer, slot) at entry 3");
}

Test(layout, layer_without_slots)
{
    g.l.num_layers = 4;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 3 has no slots");
}

Test(layout, non_positive_sizes_name_layer_and_slot)
{
    g.slots[3].base = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 1 slot V: base is 0");
    setup();
    g.slots[3].len = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 1 slot V: len is 0");
    setup();
    g.slots[3].block_bytes = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 1 slot V: block_bytes is 0");
    setup();
    g.slots[3].num_blocks = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 1 slot V: num_blocks is 0");
}

Test(layout, length_must_be_a_multiple_of_block_bytes)
{
    m.slots[1].len += 1;
    EXPECT_INVALID(&m.l, KVB_ERR_INVALID_ARG,
                   "layer 1 slot LATENT: len 1025 is not a multiple of block_bytes 64");
    setup();
    m.slots[1].len += 0x40; /* a whole extra block: the count disagrees */
    EXPECT_INVALID(&m.l, KVB_ERR_INVALID_ARG, "len 1088 holds 17 blocks, num_blocks is 16");
}

Test(layout, address_wrap_is_overflow)
{
    m.slots[2].base = UINT64_MAX - 0x100;
    EXPECT_INVALID(&m.l, KVB_ERR_OVERFLOW, "layer 2 slot LATENT: base 0xfffffffffffffeff");
}

Test(layout, overlapping_buffers)
{
    m.slots[2].base = m.slots[1].base + 0x3c0; /* last block of slot 1 */
    EXPECT_INVALID(&m.l, KVB_ERR_INVALID_ARG,
                   "layer 2 slot LATENT: buffer overlaps layer 1 slot LATENT");
    setup();
    m.slots[2].base = m.slots[1].base + 0x400; /* adjacent is fine */
    cr_assert_eq(kvb_kv_layout_validate(&m.l, NULL, 0), KVB_OK);
}

Test(layout, attention_kind_decides_head_split)
{
    m.slots[0].num_heads = 1;
    EXPECT_INVALID(&m.l, KVB_ERR_INVALID_ARG, "layer 0 slot LATENT: MLA slots are replicated");
    setup();
    g.slots[1].num_heads = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 0 slot V: GQA K and V must be head split");
    setup();
    fx_add(&g, BASE, 2, KVB_KV_SLOT_LATENT, 64, 16);
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 2 slot LATENT: a LATENT slot needs MLA");
    setup();
    fx_add(&g, BASE, 2, KVB_KV_SLOT_INDEX, 8, 16)->head_bytes = 4;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 2 slot INDEX: head_bytes must be 0");
    setup();
    fx_add(&g, BASE, 2, KVB_KV_SLOT_INDEX, 8, 16)->order = KVB_KV_ORDER_HND;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "order NONE when num_heads is 0");
}

Test(layout, gqa_scale_slots_may_be_head_split)
{
    fx_add_split(&g, BASE, 0, KVB_KV_SLOT_K_SCALE, 16);
    fx_add(&g, BASE, 0, KVB_KV_SLOT_INDEX, 8, 16);
    cr_assert_eq(kvb_kv_layout_validate(&g.l, NULL, 0), KVB_OK);
}

Test(layout, head_split_shape)
{
    g.slots[4].num_heads = 8;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG,
                   "layer 2 slot K: num_heads 8, but 8 KV heads over tp_size 2 leave 4 per rank");
    setup();
    g.slots[4].head_bytes = 0;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 2 slot K: head_bytes is 0");
    setup();
    g.slots[4].order = KVB_KV_ORDER_NONE;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "layer 2 slot K: order 0 is neither HND nor NHD");
    g.slots[4].order = 7;
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG, "order 7");
    setup();
    g.slots[4].head_bytes = 32; /* block would be 4*4*32 = 512, it is 256 */
    EXPECT_INVALID(&g.l, KVB_ERR_INVALID_ARG,
                   "block_bytes 256 != num_heads 4 * tokens_per_block 4 * head_bytes 32 = 512");
    setup();
    g.l.tokens_per_block = UINT32_MAX;
    g.slots[0].head_bytes = UINT32_MAX;
    g.l.num_kv_heads = 4096;
    g.slots[0].num_heads = 2048;
    EXPECT_INVALID(&g.l, KVB_ERR_OVERFLOW, "block size overflows");
}

Test(layout, errors_never_overrun_the_reason_buffer)
{
    char small[8];
    memset(small, 'Z', sizeof small);
    g.slots[3].base = 0;
    cr_assert_eq(kvb_kv_layout_validate(&g.l, small, sizeof small), KVB_ERR_INVALID_ARG);
    cr_assert_eq(strlen(small), 7);
    cr_assert_eq(kvb_kv_layout_validate(&g.l, small, 0), KVB_ERR_INVALID_ARG);
}

Test(layout, topo_of_a_layout)
{
    kvb_kv_topo_t t;
    cr_assert_eq(kvb_kv_layout_topo(&g.l, &t), KVB_OK);
    cr_assert_eq(t.tp_size, 2);
    cr_assert_eq(t.dp_size, 1);
    cr_assert_eq(t.attn, KVB_KV_ATTN_GQA);
    cr_assert_eq(t.num_kv_heads, 8);
    cr_assert_eq(t.order, KVB_KV_ORDER_HND);
    g.slots[5].order = KVB_KV_ORDER_NHD; /* one NHD slot makes the layout NHD */
    cr_assert_eq(kvb_kv_layout_topo(&g.l, &t), KVB_OK);
    cr_assert_eq(t.order, KVB_KV_ORDER_NHD);
    cr_assert_eq(kvb_kv_layout_topo(&m.l, &t), KVB_OK);
    cr_assert_eq(t.order, KVB_KV_ORDER_NONE);
    t.tp_size = 77;
    m.l.tokens_per_block = 0;
    cr_assert_eq(kvb_kv_layout_topo(&m.l, &t), KVB_ERR_INVALID_ARG);
    cr_assert_eq(t.tp_size, 77, "output untouched on error");
}

Test(layout, slot_names)
{
    cr_assert_str_eq(kvb_kv_slot_name(KVB_KV_SLOT_K), "K");
    cr_assert_str_eq(kvb_kv_slot_name(KVB_KV_SLOT_V_SCALE), "V_SCALE");
    cr_assert_str_eq(kvb_kv_slot_name(KVB_KV_SLOT_COUNT), "?");
    cr_assert_str_eq(kvb_kv_slot_name((kvb_kv_slot_kind_t)-1), "?");
}

/* ---- pairs ---- */

static fx_layout_t r; /* the remote side */

Test(layout, pair_same_tp)
{
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    char reason[KVB_KV_REASON_MAX] = "junk";
    cr_assert_eq(kvb_kv_layout_check_pair(&g.l, &r.l, reason, sizeof reason), KVB_OK, "%s", reason);
    cr_assert_str_empty(reason);
}

Test(layout, pair_different_block_counts_allowed)
{
    fx_gqa(&r, 8, 2, 0, 3, 1000, RBASE);
    cr_assert_eq(kvb_kv_layout_check_pair(&g.l, &r.l, NULL, 0), KVB_OK);
}

Test(layout, pair_hetero_tp_explains_block_bytes)
{
    fx_gqa(&r, 8, 4, 3, 3, 16, RBASE); /* 2 heads per rank: blocks half as big */
    cr_assert_neq(r.slots[0].block_bytes, g.slots[0].block_bytes);
    cr_assert_eq(kvb_kv_layout_check_pair(&g.l, &r.l, NULL, 0), KVB_OK);
    r.slots[2].head_bytes *= 2;
    r.slots[2].block_bytes *= 2;
    r.slots[2].len *= 2;
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG,
                "layer 1 slot K: head_bytes 16 locally, 32 remotely");
}

Test(layout, pair_hetero_mla)
{
    fx_mla(&r, 1, 0, 3, 8, RBASE);
    fx_add(&r, RBASE, 1, KVB_KV_SLOT_INDEX, 8, 8);
    cr_assert_eq(kvb_kv_layout_check_pair(&m.l, &r.l, NULL, 0), KVB_OK);
}

Test(layout, pair_names_the_invalid_side)
{
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    g.slots[0].num_blocks = 0;
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "local layout: layer 0 slot K: num_blocks is 0");
    setup();
    r.slots[5].layer = 9;
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "remote layout: slot entry 5: layer id 9");
    EXPECT_PAIR(&g.l, NULL, KVB_ERR_INVALID_ARG, "remote layout: layout is NULL");
}

Test(layout, pair_header_mismatches)
{
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    snprintf(r.l.model, sizeof r.l.model, "other");
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "model 'test-model' locally, 'other' remotely");
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    r.l.dtype = KVB_KV_DTYPE_FP8_E4M3;
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "dtype bf16 locally, fp8_e4m3 remotely");
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    r.l.tokens_per_block = 2;
    for (int i = 0; i < 6; i++) { /* keep the remote valid: halve its blocks */
        r.slots[i].block_bytes /= 2;
        r.slots[i].len /= 2;
    }
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "tokens_per_block 4 locally, 2 remotely");
    fx_mla(&r, 2, 0, 3, 16, RBASE);
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "attention gqa locally, mla remotely");
    fx_gqa(&r, 4, 2, 0, 3, 16, RBASE);
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "num_kv_heads 8 locally, 4 remotely");
    fx_gqa(&r, 8, 2, 0, 2, 16, RBASE);
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "num_layers 3 locally, 2 remotely");
}

Test(layout, pair_slot_set_mismatch)
{
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    fx_add(&r, RBASE, 2, KVB_KV_SLOT_INDEX, 8, 16);
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "layer 2 slot INDEX: present remotely only");
    EXPECT_PAIR(&r.l, &g.l, KVB_ERR_INVALID_ARG, "layer 2 slot INDEX: present locally only");
}

Test(layout, pair_block_bytes_mismatch_same_tp)
{
    fx_mla(&r, 4, 1, 3, 16, RBASE);
    fx_add(&r, RBASE, 1, KVB_KV_SLOT_INDEX, 16, 16);
    EXPECT_PAIR(&m.l, &r.l, KVB_ERR_INVALID_ARG,
                "layer 1 slot INDEX: block_bytes 8 locally, 16 remotely");
}

Test(layout, pair_order_and_split_mismatch)
{
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    r.slots[1].order = KVB_KV_ORDER_NHD;
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG, "layer 0 slot V: order HND locally, NHD remotely");
    fx_gqa(&r, 8, 2, 0, 3, 16, RBASE);
    fx_add(&r, RBASE, 0, KVB_KV_SLOT_K_SCALE, 4, 16);
    fx_add_split(&g, BASE, 0, KVB_KV_SLOT_K_SCALE, 16);
    EXPECT_PAIR(&g.l, &r.l, KVB_ERR_INVALID_ARG,
                "layer 0 slot K_SCALE: head split on one side only");
}

Test(layout, slot_index)
{
    uint32_t *idx;
    cr_assert_eq(kvb__kv_slot_index(&g.l, &idx), KVB_OK);
    cr_assert_eq(kvb__kv_slot_at(&g.l, idx, 1, KVB_KV_SLOT_V), &g.slots[3]);
    cr_assert_null(kvb__kv_slot_at(&g.l, idx, 1, KVB_KV_SLOT_INDEX));
    free(idx);
}
