/* SPDX-License-Identifier: Apache-2.0 */
/* Layout builders shared by the KV tests: small valid GQA and MLA layouts that a test then bends
 * to break exactly one rule. Header-only so that each test binary stays self-contained. */
#ifndef KVB_TESTS_KV_FIXTURE_H
#define KVB_TESTS_KV_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvbridge/kv.h"

#define FX_MAX_SLOTS 64
#define FX_TOKENS    4                     /* tokens per block */
#define FX_HEAD      16                    /* head_bytes: bytes of one head of one token */
#define FX_STRIDE    (FX_TOKENS * FX_HEAD) /* one head's share of an HND block */
#define FX_SPACING   0x100000ull           /* address distance between slot buffers */

typedef struct {
    kvb_kv_layout_t l;
    kvb_kv_slot_t slots[FX_MAX_SLOTS];
} fx_layout_t;

static inline void fx_header(fx_layout_t *f, kvb_kv_attn_t attn, uint32_t heads, int32_t tp,
                             int32_t rank, uint32_t layers)
{
    memset(f, 0, sizeof *f);
    snprintf(f->l.model, sizeof f->l.model, "test-model");
    f->l.dtype = KVB_KV_DTYPE_BF16;
    f->l.tokens_per_block = FX_TOKENS;
    f->l.attn = attn;
    f->l.num_kv_heads = heads;
    f->l.dp_size = 1;
    f->l.tp_size = tp;
    f->l.tp_rank = rank;
    f->l.num_layers = layers;
    f->l.slots = f->slots;
}

/* Appends a slot that is not head split; its buffer follows the previous one. */
static inline kvb_kv_slot_t *fx_add(fx_layout_t *f, uint64_t base0, uint32_t layer,
                                    kvb_kv_slot_kind_t kind, uint64_t block_bytes, uint64_t blocks)
{
    kvb_kv_slot_t *s = &f->slots[f->l.num_slots];
    *s = (kvb_kv_slot_t){.layer = layer,
                         .kind = kind,
                         .base = base0 + f->l.num_slots * FX_SPACING,
                         .len = block_bytes * blocks,
                         .block_bytes = block_bytes,
                         .num_blocks = blocks};
    f->l.num_slots++;
    return s;
}

/* Appends a head-split HND slot holding what this rank holds of the layout's heads. */
static inline kvb_kv_slot_t *fx_add_split(fx_layout_t *f, uint64_t base0, uint32_t layer,
                                          kvb_kv_slot_kind_t kind, uint64_t blocks)
{
    uint32_t held =
        (uint32_t)f->l.tp_size > f->l.num_kv_heads ? 1 : f->l.num_kv_heads / (uint32_t)f->l.tp_size;
    kvb_kv_slot_t *s = fx_add(f, base0, layer, kind, (uint64_t)held * FX_STRIDE, blocks);
    s->num_heads = held;
    s->head_bytes = FX_HEAD;
    s->order = KVB_KV_ORDER_HND;
    return s;
}

/* GQA: per layer K and V head split (HND), `blocks` blocks each, buffers from base0 on. */
static inline void fx_gqa(fx_layout_t *f, uint32_t heads, int32_t tp, int32_t rank, uint32_t layers,
                          uint64_t blocks, uint64_t base0)
{
    fx_header(f, KVB_KV_ATTN_GQA, heads, tp, rank, layers);
    for (uint32_t layer = 0; layer < layers; layer++) {
        fx_add_split(f, base0, layer, KVB_KV_SLOT_K, blocks);
        fx_add_split(f, base0, layer, KVB_KV_SLOT_V, blocks);
    }
}

/* MLA: per layer one LATENT slot of 0x40-byte blocks. */
static inline void fx_mla(fx_layout_t *f, int32_t tp, int32_t rank, uint32_t layers,
                          uint64_t blocks, uint64_t base0)
{
    fx_header(f, KVB_KV_ATTN_MLA, 0, tp, rank, layers);
    for (uint32_t layer = 0; layer < layers; layer++)
        fx_add(f, base0, layer, KVB_KV_SLOT_LATENT, 0x40, blocks);
}

#endif
