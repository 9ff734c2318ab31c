/* SPDX-License-Identifier: Apache-2.0 */
/* TP routing: for a request on one decode dp group, which prefill rank sends which heads to which
 * decode rank, so that every decode rank receives every byte it needs exactly once. */
#include "kv/internal.h"

typedef struct {
    kvb_kv_route_t *out;
    size_t cap, n;
} emitter_t;

static void emit(emitter_t *e, uint32_t src, uint32_t dst, uint32_t h0, uint32_t h1)
{
    if (e->n < e->cap)
        e->out[e->n] = (kvb_kv_route_t){
            .src_rank = (int32_t)src, .dst_rank = (int32_t)dst, .head_begin = h0, .head_end = h1};
    e->n++;
}

/* Same TP: rank k feeds rank k with everything it holds (for GQA, its own heads, which with
 * replicated heads is the one head k shares with its replicas). */
static void route_homo(const kvb_kv_topo_t *t, emitter_t *e)
{
    for (uint32_t k = 0; k < (uint32_t)t->tp_size; k++) {
        uint32_t h0 = 0, h1 = 0;
        if (t->attn == KVB_KV_ATTN_GQA) {
            h0 = kvb__kv_first_head((int32_t)k, t->tp_size, t->num_kv_heads);
            h1 = h0 + kvb__kv_heads_held(t->tp_size, t->num_kv_heads);
        }
        emit(e, k, k, h0, h1);
    }
}

/* MLA: every rank holds the whole latent, so each decode rank needs exactly one writer. With more
 * prefill ranks, the writer rotates with the decode dp group so that groups spread their load over
 * different prefill ranks; dst_tp consecutive values modulo src_tp >= dst_tp never collide. With
 * fewer, prefill rank r writes decode ranks r, r + src_tp, ... (k % src_tp == r). */
static void route_mla(uint32_t src_tp, uint32_t dst_tp, uint32_t dd, emitter_t *e)
{
    for (uint32_t k = 0; k < dst_tp; k++) {
        uint32_t src =
            src_tp >= dst_tp ? (uint32_t)(((uint64_t)dd * dst_tp + k) % src_tp) : k % src_tp;
        emit(e, src, k, 0, 0);
    }
}

/* GQA with HND blocks, no replication (the guard ensures both TP sizes divide the heads): decode
 * rank k holds [k*hd, (k+1)*hd) and takes each overlap with a prefill rank's [r*hs, (r+1)*hs). */
static void route_gqa(uint32_t src_tp, uint32_t dst_tp, uint32_t heads, emitter_t *e)
{
    uint32_t hs = heads / src_tp, hd = heads / dst_tp;
    for (uint32_t k = 0; k < dst_tp; k++) {
        uint32_t d0 = k * hd, d1 = d0 + hd;
        for (uint32_t r = d0 / hs; r <= (d1 - 1) / hs; r++) {
            uint32_t s0 = r * hs, s1 = s0 + hs;
            emit(e, r, k, s0 > d0 ? s0 : d0, s1 < d1 ? s1 : d1);
        }
    }
}

int kvb_kv_route(const kvb_kv_topo_t *prefill, const kvb_kv_topo_t *decode, int32_t decode_dp,
                 kvb_kv_route_t *out, size_t cap, size_t *count)
{
    kvb_kv_verdict_t v = kvb_kv_guard_topo(prefill, decode, NULL, 0);
    if (v != KVB_KV_ALLOW_HOMO && v != KVB_KV_ALLOW_HETERO)
        return KVB_ERR_INVALID_ARG;
    if (!count || (!out && cap) || decode_dp < 0 || decode_dp >= decode->dp_size)
        return KVB_ERR_INVALID_ARG;
    emitter_t e = {.out = out, .cap = cap};
    uint32_t src_tp = (uint32_t)prefill->tp_size, dst_tp = (uint32_t)decode->tp_size;
    if (src_tp == dst_tp)
        route_homo(decode, &e);
    else if (decode->attn == KVB_KV_ATTN_MLA)
        route_mla(src_tp, dst_tp, (uint32_t)decode_dp, &e);
    else
        route_gqa(src_tp, dst_tp, decode->num_kv_heads, &e);
    *count = e.n;
    return KVB_OK;
}
