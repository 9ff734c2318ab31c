/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the KV modules: reason strings, enum names, head arithmetic and the
 * (layer, slot) index of a layout. Private to src/kv/ and its tests. */
#ifndef KVB_KV_INTERNAL_H
#define KVB_KV_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/reason.h"
#include "kvbridge/kv.h"

/* Like kvb__fail, prefixed with "layer L slot S: ". */
int kvb__kv_slot_fail(char *reason, size_t cap, int status, const kvb_kv_slot_t *slot,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Names for the enums; NULL if the value is unknown. Parsers return 0 on success. */
const char *kvb__kv_dtype_name(kvb_kv_dtype_t dtype);
const char *kvb__kv_attn_name(kvb_kv_attn_t attn);
const char *kvb__kv_order_name(kvb_kv_order_t order);
int kvb__kv_dtype_parse(const char *s, kvb_kv_dtype_t *out);
int kvb__kv_attn_parse(const char *s, kvb_kv_attn_t *out);
int kvb__kv_order_parse(const char *s, kvb_kv_order_t *out);
int kvb__kv_slot_parse(const char *s, kvb_kv_slot_kind_t *out);

/* KV heads one rank holds with `heads` heads over `tp` ranks: heads/tp, or 1 when tp > heads
 * (replicated). Callers pass a valid topology (tp > 0, heads > 0). */
static inline uint32_t kvb__kv_heads_held(int32_t tp, uint32_t heads)
{
    return (uint32_t)tp > heads ? 1 : heads / (uint32_t)tp;
}

/* The first model-wide head that TP rank `rank` of `tp` holds. */
static inline uint32_t kvb__kv_first_head(int32_t rank, int32_t tp, uint32_t heads)
{
    return (uint32_t)((uint64_t)(uint32_t)rank * heads / (uint32_t)tp);
}

/* Checks dp, tp, attention kind and head count of a topology (not its order): KVB_OK or
 * KVB_ERR_INVALID_ARG with a reason. */
int kvb__kv_topo_check(const kvb_kv_topo_t *t, char *reason, size_t cap);

/* The topology of a valid layout (kvb_kv_layout_topo without the validation). */
void kvb__kv_topo_of(const kvb_kv_layout_t *layout, kvb_kv_topo_t *out);

/* Index of a valid layout's slots: idx[layer * KVB_KV_SLOT_COUNT + kind] is the slot's position
 * in layout->slots plus one, 0 where the layer has no such slot. malloc'd; the caller frees. */
int kvb__kv_slot_index(const kvb_kv_layout_t *layout, uint32_t **out);

/* kvb_kv_plan for every layer of `local` at once (args->layers must be NULL): one
 * request array per layer (reqs[i], counts[i]; NULL and 0 for a layer with none; free each with
 * kvb_kv_plan_free), with the checks, the sort and the runs done once rather than per layer -
 * on a 61-layer pull of 512 blocks that was 2 ms of planning before the first request went out. */
int kvb__kv_plan_layers(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                        const kvb_kv_plan_args_t *args, kvb_request_t **reqs, size_t *counts,
                        char *reason, size_t reason_cap);

static inline const kvb_kv_slot_t *kvb__kv_slot_at(const kvb_kv_layout_t *l, const uint32_t *idx,
                                                   uint32_t layer, unsigned kind)
{
    uint32_t i = idx[(size_t)layer * KVB_KV_SLOT_COUNT + kind];
    return i ? &l->slots[i - 1] : NULL;
}

#endif
