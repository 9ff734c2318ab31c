/* SPDX-License-Identifier: Apache-2.0 */
/* Validation of KV layouts, alone and in pairs at link time. A layout that passes here can be
 * planned against without further shape checks, so every rule that keeps a request inside its
 * buffer or a head range inside its block is enforced here, with a reason naming layer and slot. */
#include "kv/internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

#define INVAL KVB_ERR_INVALID_ARG

static int check_header(const kvb_kv_layout_t *l, char *r, size_t cap)
{
    if (!memchr(l->model, '\0', sizeof l->model))
        return kvb__fail(r, cap, INVAL, "model id is longer than %d bytes", KVB_KV_MODEL_MAX);
    if (!l->model[0])
        return kvb__fail(r, cap, INVAL, "model id is empty");
    if (!kvb__kv_dtype_name(l->dtype))
        return kvb__fail(r, cap, INVAL, "unknown dtype %d", (int)l->dtype);
    if (l->tokens_per_block == 0)
        return kvb__fail(r, cap, INVAL, "tokens_per_block is 0");
    if (l->num_layers == 0 || l->num_layers > KVB_KV_LAYERS_MAX)
        return kvb__fail(r, cap, INVAL, "num_layers %" PRIu32 " is outside 1..%d", l->num_layers,
                         KVB_KV_LAYERS_MAX);
    if (!l->slots || l->num_slots == 0)
        return kvb__fail(r, cap, INVAL, "the layout has no slots");
    kvb_kv_topo_t t = {.dp_size = l->dp_size,
                       .tp_size = l->tp_size,
                       .attn = l->attn,
                       .num_kv_heads = l->num_kv_heads};
    int rc = kvb__kv_topo_check(&t, r, cap);
    if (rc)
        return rc;
    if (l->dp_rank < 0 || l->dp_rank >= l->dp_size)
        return kvb__fail(r, cap, INVAL, "dp_rank %" PRId32 " is outside dp_size %" PRId32,
                         l->dp_rank, l->dp_size);
    if (l->tp_rank < 0 || l->tp_rank >= l->tp_size)
        return kvb__fail(r, cap, INVAL, "tp_rank %" PRId32 " is outside tp_size %" PRId32,
                         l->tp_rank, l->tp_size);
    return KVB_OK;
}

static int check_sizes(const kvb_kv_slot_t *s, char *r, size_t cap)
{
    uint64_t end;
    if (s->base == 0)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "base is 0");
    if (s->len == 0)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "len is 0");
    if (s->block_bytes == 0)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "block_bytes is 0");
    if (s->num_blocks == 0)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "num_blocks is 0");
    if (s->len % s->block_bytes)
        return kvb__kv_slot_fail(r, cap, INVAL, s,
                                 "len %" PRIu64 " is not a multiple of block_bytes %" PRIu64,
                                 s->len, s->block_bytes);
    if (s->len / s->block_bytes != s->num_blocks)
        return kvb__kv_slot_fail(r, cap, INVAL, s,
                                 "len %" PRIu64 " holds %" PRIu64 " blocks, num_blocks is %" PRIu64,
                                 s->len, s->len / s->block_bytes, s->num_blocks);
    if (kvb__add_u64(s->base, s->len, &end))
        return kvb__kv_slot_fail(r, cap, KVB_ERR_OVERFLOW, s,
                                 "base 0x%" PRIx64 " + len %" PRIu64 " wraps", s->base, s->len);
    return KVB_OK;
}

/* Which slots may or must be head split depends on the attention kind. */
static int check_split_rules(const kvb_kv_layout_t *l, const kvb_kv_slot_t *s, char *r, size_t cap)
{
    int split = s->num_heads > 0;
    if (l->attn == KVB_KV_ATTN_MLA && split)
        return kvb__kv_slot_fail(r, cap, INVAL, s,
                                 "MLA slots are replicated over TP and cannot "
                                 "be head split (num_heads must be 0)");
    if (l->attn == KVB_KV_ATTN_GQA && s->kind == KVB_KV_SLOT_LATENT)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "a LATENT slot needs MLA attention");
    if (l->attn == KVB_KV_ATTN_GQA && !split &&
        (s->kind == KVB_KV_SLOT_K || s->kind == KVB_KV_SLOT_V))
        return kvb__kv_slot_fail(r, cap, INVAL, s,
                                 "GQA K and V must be head split (num_heads > 0)");
    if (!split && (s->head_bytes || s->order != KVB_KV_ORDER_NONE))
        return kvb__kv_slot_fail(r, cap, INVAL, s,
                                 "head_bytes must be 0 and order NONE when num_heads is 0");
    return KVB_OK;
}

static int check_split_shape(const kvb_kv_layout_t *l, const kvb_kv_slot_t *s, char *r, size_t cap)
{
    uint32_t held = kvb__kv_heads_held(l->tp_size, l->num_kv_heads);
    uint64_t want;
    if (s->num_heads != held)
        return kvb__kv_slot_fail(r, cap, INVAL, s,
                                 "num_heads %" PRIu32 ", but %" PRIu32 " KV heads over tp_size "
                                 "%" PRId32 " leave %" PRIu32 " per rank",
                                 s->num_heads, l->num_kv_heads, l->tp_size, held);
    if (s->head_bytes == 0)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "head_bytes is 0");
    if (s->order != KVB_KV_ORDER_HND && s->order != KVB_KV_ORDER_NHD)
        return kvb__kv_slot_fail(r, cap, INVAL, s, "order %d is neither HND nor NHD",
                                 (int)s->order);
    if (kvb__mul_u64((uint64_t)s->num_heads * l->tokens_per_block, s->head_bytes, &want))
        return kvb__kv_slot_fail(r, cap, KVB_ERR_OVERFLOW, s, "block size overflows");
    if (want != s->block_bytes)
        return kvb__kv_slot_fail(
            r, cap, INVAL, s,
            "block_bytes %" PRIu64 " != num_heads %" PRIu32 " * tokens_per_block %" PRIu32
            " * head_bytes %" PRIu32 " = %" PRIu64,
            s->block_bytes, s->num_heads, l->tokens_per_block, s->head_bytes, want);
    return KVB_OK;
}

/* seen[layer] is a bit set of the slot ids met so far in that layer. */
static int check_slot(const kvb_kv_layout_t *l, size_t i, uint8_t *seen, char *r, size_t cap)
{
    const kvb_kv_slot_t *s = &l->slots[i];
    if (s->layer >= l->num_layers)
        return kvb__fail(r, cap, INVAL,
                         "slot entry %zu: layer id %" PRIu32 " is out of range (num_layers "
                         "%" PRIu32 ")",
                         i, s->layer, l->num_layers);
    if ((unsigned)s->kind >= KVB_KV_SLOT_COUNT)
        return kvb__fail(r, cap, INVAL,
                         "slot entry %zu (layer %" PRIu32 "): slot id %u is out "
                         "of range",
                         i, s->layer, (unsigned)s->kind);
    if (seen[s->layer] & (1u << s->kind))
        return kvb__kv_slot_fail(r, cap, INVAL, s, "duplicate (layer, slot) at entry %zu", i);
    seen[s->layer] |= (uint8_t)(1u << s->kind);
    int rc = check_sizes(s, r, cap);
    if (!rc)
        rc = check_split_rules(l, s, r, cap);
    if (!rc && s->num_heads)
        rc = check_split_shape(l, s, r, cap);
    return rc;
}

static int cmp_base(const void *a, const void *b)
{
    const kvb_kv_slot_t *x = *(const kvb_kv_slot_t *const *)a;
    const kvb_kv_slot_t *y = *(const kvb_kv_slot_t *const *)b;
    return x->base < y->base ? -1 : x->base > y->base;
}

/* Two slots sharing bytes would let one transfer overwrite another's blocks. Runs after the size
 * checks, so base + len does not wrap. */
static int check_overlaps(const kvb_kv_layout_t *l, char *r, size_t cap)
{
    const kvb_kv_slot_t **v = malloc(l->num_slots * sizeof *v);
    if (!v)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < l->num_slots; i++)
        v[i] = &l->slots[i];
    qsort(v, l->num_slots, sizeof *v, cmp_base);
    int rc = KVB_OK;
    for (size_t i = 1; i < l->num_slots && !rc; i++) {
        if (v[i - 1]->base + v[i - 1]->len > v[i]->base)
            rc = kvb__kv_slot_fail(r, cap, INVAL, v[i], "buffer overlaps layer %" PRIu32 " slot %s",
                                   v[i - 1]->layer, kvb_kv_slot_name(v[i - 1]->kind));
    }
    free(v);
    return rc;
}

static int check_slots(const kvb_kv_layout_t *l, char *r, size_t cap)
{
    uint8_t *seen = calloc(l->num_layers, 1);
    if (!seen)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    int rc = KVB_OK;
    for (size_t i = 0; i < l->num_slots && !rc; i++)
        rc = check_slot(l, i, seen, r, cap);
    for (uint32_t layer = 0; layer < l->num_layers && !rc; layer++) {
        if (!seen[layer])
            rc = kvb__fail(r, cap, INVAL, "layer %" PRIu32 " has no slots", layer);
    }
    free(seen);
    return rc ? rc : check_overlaps(l, r, cap);
}

int kvb_kv_layout_validate(const kvb_kv_layout_t *layout, char *reason, size_t reason_cap)
{
    if (!layout)
        return kvb__fail(reason, reason_cap, INVAL, "layout is NULL");
    int rc = check_header(layout, reason, reason_cap);
    if (!rc)
        rc = check_slots(layout, reason, reason_cap);
    if (!rc)
        kvb__reason_clear(reason, reason_cap);
    return rc;
}

int kvb__kv_slot_index(const kvb_kv_layout_t *l, uint32_t **out)
{
    uint32_t *idx = calloc((size_t)l->num_layers * KVB_KV_SLOT_COUNT, sizeof *idx);
    if (!idx)
        return KVB_ERR_NOMEM;
    for (size_t i = 0; i < l->num_slots; i++) {
        const kvb_kv_slot_t *s = &l->slots[i];
        idx[(size_t)s->layer * KVB_KV_SLOT_COUNT + s->kind] = (uint32_t)i + 1;
    }
    *out = idx;
    return KVB_OK;
}

void kvb__kv_topo_of(const kvb_kv_layout_t *layout, kvb_kv_topo_t *out)
{
    kvb_kv_order_t order = KVB_KV_ORDER_NONE;
    for (size_t i = 0; i < layout->num_slots; i++) {
        kvb_kv_order_t o = layout->slots[i].order;
        if (o == KVB_KV_ORDER_NHD || (o == KVB_KV_ORDER_HND && order == KVB_KV_ORDER_NONE))
            order = o;
    }
    *out = (kvb_kv_topo_t){.dp_size = layout->dp_size,
                           .tp_size = layout->tp_size,
                           .attn = layout->attn,
                           .num_kv_heads = layout->num_kv_heads,
                           .order = order};
}

int kvb_kv_layout_topo(const kvb_kv_layout_t *layout, kvb_kv_topo_t *out)
{
    int rc = kvb_kv_layout_validate(layout, NULL, 0);
    if (!rc)
        kvb__kv_topo_of(layout, out);
    return rc;
}

/* ---- pairs ---- */

static int validate_side(const char *side, const kvb_kv_layout_t *l, char *r, size_t cap)
{
    char msg[KVB_KV_REASON_MAX];
    int rc = kvb_kv_layout_validate(l, msg, sizeof msg);
    return rc ? kvb__fail(r, cap, rc, "%s layout: %s", side, msg) : KVB_OK;
}

static int pair_header(const kvb_kv_layout_t *a, const kvb_kv_layout_t *b, char *r, size_t cap)
{
    if (strcmp(a->model, b->model))
        return kvb__fail(r, cap, INVAL, "model '%s' locally, '%s' remotely", a->model, b->model);
    if (a->dtype != b->dtype)
        return kvb__fail(r, cap, INVAL, "dtype %s locally, %s remotely",
                         kvb__kv_dtype_name(a->dtype), kvb__kv_dtype_name(b->dtype));
    if (a->tokens_per_block != b->tokens_per_block)
        return kvb__fail(r, cap, INVAL,
                         "tokens_per_block %" PRIu32 " locally, %" PRIu32 " remotely",
                         a->tokens_per_block, b->tokens_per_block);
    if (a->attn != b->attn)
        return kvb__fail(r, cap, INVAL, "attention %s locally, %s remotely",
                         kvb__kv_attn_name(a->attn), kvb__kv_attn_name(b->attn));
    if (a->num_kv_heads != b->num_kv_heads)
        return kvb__fail(r, cap, INVAL, "num_kv_heads %" PRIu32 " locally, %" PRIu32 " remotely",
                         a->num_kv_heads, b->num_kv_heads);
    if (a->num_layers != b->num_layers)
        return kvb__fail(r, cap, INVAL, "num_layers %" PRIu32 " locally, %" PRIu32 " remotely",
                         a->num_layers, b->num_layers);
    return KVB_OK;
}

/* Head-split slots of sides with different TP hold different head counts, so their blocks
 * differ in size; what must agree is the size of one head's share of a block. */
static int pair_slot(const kvb_kv_slot_t *a, const kvb_kv_slot_t *b, int hetero, char *r,
                     size_t cap)
{
    if (!a->num_heads != !b->num_heads)
        return kvb__kv_slot_fail(r, cap, INVAL, a,
                                 "head split on one side only (num_heads %" PRIu32
                                 " locally, %" PRIu32 " remotely)",
                                 a->num_heads, b->num_heads);
    if (a->order != b->order)
        return kvb__kv_slot_fail(r, cap, INVAL, a, "order %s locally, %s remotely",
                                 kvb__kv_order_name(a->order), kvb__kv_order_name(b->order));
    if (a->num_heads && hetero) {
        if (a->head_bytes != b->head_bytes)
            return kvb__kv_slot_fail(r, cap, INVAL, a,
                                     "head_bytes %" PRIu32 " locally, %" PRIu32 " remotely",
                                     a->head_bytes, b->head_bytes);
        return KVB_OK;
    }
    if (a->block_bytes != b->block_bytes)
        return kvb__kv_slot_fail(r, cap, INVAL, a,
                                 "block_bytes %" PRIu64 " locally, %" PRIu64 " remotely",
                                 a->block_bytes, b->block_bytes);
    return KVB_OK;
}

static int pair_slots(const kvb_kv_layout_t *a, const kvb_kv_layout_t *b, const uint32_t *ia,
                      const uint32_t *ib, char *r, size_t cap)
{
    int hetero = a->tp_size != b->tp_size;
    for (uint32_t layer = 0; layer < a->num_layers; layer++) {
        for (unsigned k = 0; k < KVB_KV_SLOT_COUNT; k++) {
            const kvb_kv_slot_t *sa = kvb__kv_slot_at(a, ia, layer, k);
            const kvb_kv_slot_t *sb = kvb__kv_slot_at(b, ib, layer, k);
            if (!sa != !sb)
                return kvb__fail(r, cap, INVAL, "layer %" PRIu32 " slot %s: present %s only", layer,
                                 kvb_kv_slot_name((kvb_kv_slot_kind_t)k),
                                 sa ? "locally" : "remotely");
            int rc = sa ? pair_slot(sa, sb, hetero, r, cap) : KVB_OK;
            if (rc)
                return rc;
        }
    }
    return KVB_OK;
}

int kvb_kv_layout_check_pair(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                             char *reason, size_t reason_cap)
{
    int rc = validate_side("local", local, reason, reason_cap);
    if (!rc)
        rc = validate_side("remote", remote, reason, reason_cap);
    if (!rc)
        rc = pair_header(local, remote, reason, reason_cap);
    if (rc)
        return rc;
    uint32_t *ia = NULL, *ib = NULL;
    if (kvb__kv_slot_index(local, &ia) || kvb__kv_slot_index(remote, &ib))
        rc = kvb__fail(reason, reason_cap, KVB_ERR_NOMEM, "out of memory");
    else
        rc = pair_slots(local, remote, ia, ib, reason, reason_cap);
    free(ia);
    free(ib);
    if (!rc)
        kvb__reason_clear(reason, reason_cap);
    return rc;
}
