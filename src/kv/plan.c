/* SPDX-License-Identifier: Apache-2.0 */
/* Transfer plans: block pairs in, engine requests out. Pure and deterministic, so that the part
 * that decides which bytes go where can be tested exhaustively without a network. Every address
 * is computed with checked arithmetic and checked against its slot's buffer before it is emitted.
 */
#include "kv/internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

#define INVAL KVB_ERR_INVALID_ARG

typedef struct {
    uint64_t src, dst, n; /* src .. src+n-1 -> dst .. dst+n-1 */
} run_t;

typedef struct {
    const kvb_kv_plan_args_t *args;
    const kvb_kv_layout_t *local, *remote;
    const kvb_kv_layout_t *src_l, *dst_l; /* sending and receiving side */
    uint32_t *src_idx, *dst_idx;          /* slot indexes of src_l and dst_l */
    run_t *runs;
    size_t num_runs;
    int partial;        /* head-split slots move heads [h0, h1) only, block by block */
    uint32_t h0, h1;    /* model-wide head range when partial */
    int send_unsplit;   /* this route also carries the slots that are not head split */
    kvb_request_t *out; /* filled up to n */
    size_t n;
    char *reason;
    size_t cap;
} plan_t;

static int check_lists(const kvb_kv_plan_args_t *a, char *r, size_t cap)
{
    if (a->op != KVB_OP_READ && a->op != KVB_OP_WRITE)
        return kvb__fail(r, cap, INVAL, "op %d is neither READ nor WRITE", (int)a->op);
    if (a->segment == 0)
        return kvb__fail(r, cap, INVAL, "segment handle 0 is never valid");
    if (a->num_src != a->num_dst)
        return kvb__fail(r, cap, INVAL, "%zu source blocks but %zu destination blocks", a->num_src,
                         a->num_dst);
    if (a->num_src && (!a->src_blocks || !a->dst_blocks))
        return kvb__fail(r, cap, INVAL, "block list is NULL");
    if (a->layers && a->num_layers == 0)
        return kvb__fail(r, cap, INVAL, "layer list is empty (pass NULL for all layers)");
    return KVB_OK;
}

static int check_layers(const kvb_kv_plan_args_t *a, uint32_t num_layers, char *r, size_t cap)
{
    if (!a->layers)
        return KVB_OK;
    uint8_t *seen = calloc(num_layers, 1);
    if (!seen)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    int rc = KVB_OK;
    for (size_t i = 0; i < a->num_layers && !rc; i++) {
        uint32_t l = a->layers[i];
        if (l >= num_layers)
            rc = kvb__fail(r, cap, INVAL,
                           "layer %" PRIu32 " is out of range (num_layers %" PRIu32 ")", l,
                           num_layers);
        else if (seen[l]++)
            rc = kvb__fail(r, cap, INVAL, "layer %" PRIu32 " is listed twice", l);
    }
    free(seen);
    return rc;
}

static int cmp_run_src(const void *a, const void *b)
{
    const run_t *x = a, *y = b;
    return x->src < y->src ? -1 : x->src > y->src;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Two sources for one destination block would race; reject rather than pick one. */
static int check_dst_unique(const kvb_kv_plan_args_t *a, char *r, size_t cap)
{
    uint64_t *d = malloc(a->num_dst * sizeof *d);
    if (!d)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    memcpy(d, a->dst_blocks, a->num_dst * sizeof *d);
    qsort(d, a->num_dst, sizeof *d, cmp_u64);
    int rc = KVB_OK;
    for (size_t i = 1; i < a->num_dst && !rc; i++) {
        if (d[i] == d[i - 1])
            rc = kvb__fail(r, cap, INVAL, "destination block %" PRIu64 " is listed twice", d[i]);
    }
    free(d);
    return rc;
}

/* Sorts the pairs by source block in place (as one-block runs) and merges neighbours whose source
 * and destination both step by one. */
static int make_runs(plan_t *p)
{
    const kvb_kv_plan_args_t *a = p->args;
    size_t n = a->num_src, m = 0;
    run_t *v = malloc(n * sizeof *v);
    if (!v)
        return kvb__fail(p->reason, p->cap, KVB_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        v[i] = (run_t){.src = a->src_blocks[i], .dst = a->dst_blocks[i], .n = 1};
    qsort(v, n, sizeof *v, cmp_run_src);
    for (size_t i = 1; i < n; i++) {
        if (v[i].src == v[i - 1].src) {
            uint64_t dup = v[i].src;
            free(v);
            return kvb__fail(p->reason, p->cap, INVAL, "source block %" PRIu64 " is listed twice",
                             dup);
        }
    }
    for (size_t i = 0; i < n; i++) {
        run_t *last = m ? &v[m - 1] : NULL;
        if (last && v[i].src == last->src + last->n && v[i].dst == last->dst + last->n)
            last->n++;
        else
            v[m++] = v[i];
    }
    p->runs = v;
    p->num_runs = m;
    return KVB_OK;
}

/* A GQA route names the heads this pair moves; they must be heads both ranks hold. When they are
 * all of both ranks' heads (same TP) blocks move whole and runs stay merged. */
static int route_heads(plan_t *p, const kvb_kv_route_t *rt)
{
    const kvb_kv_layout_t *s = p->src_l, *d = p->dst_l;
    uint32_t h = d->num_kv_heads;
    uint32_t sf = kvb__kv_first_head(s->tp_rank, s->tp_size, h);
    uint32_t sl = sf + kvb__kv_heads_held(s->tp_size, h);
    uint32_t df = kvb__kv_first_head(d->tp_rank, d->tp_size, h);
    uint32_t dl = df + kvb__kv_heads_held(d->tp_size, h);
    if (rt->head_begin >= rt->head_end || rt->head_begin < sf || rt->head_end > sl ||
        rt->head_begin < df || rt->head_end > dl)
        return kvb__fail(p->reason, p->cap, INVAL,
                         "route heads [%" PRIu32 ", %" PRIu32 ") are not held by both the "
                         "sender ([%" PRIu32 ", %" PRIu32 ")) and the receiver ([%" PRIu32
                         ", %" PRIu32 "))",
                         rt->head_begin, rt->head_end, sf, sl, df, dl);
    p->partial = !(rt->head_begin == sf && rt->head_end == sl && sf == df && sl == dl);
    p->h0 = rt->head_begin;
    p->h1 = rt->head_end;
    p->send_unsplit = rt->head_begin == df;
    return KVB_OK;
}

static int resolve_route(plan_t *p)
{
    const kvb_kv_route_t *rt = p->args->route;
    p->send_unsplit = 1;
    if (!rt) {
        if (p->src_l->tp_size != p->dst_l->tp_size && p->src_l->attn == KVB_KV_ATTN_GQA)
            return kvb__fail(p->reason, p->cap, INVAL,
                             "GQA sides with different TP (%" PRId32 " and %" PRId32
                             ") need the pair's route",
                             p->src_l->tp_size, p->dst_l->tp_size);
        return KVB_OK;
    }
    if (rt->src_rank != p->src_l->tp_rank || rt->dst_rank != p->dst_l->tp_rank)
        return kvb__fail(p->reason, p->cap, INVAL,
                         "route is for ranks %" PRId32 " -> %" PRId32 ", the layouts are ranks "
                         "%" PRId32 " -> %" PRId32,
                         rt->src_rank, rt->dst_rank, p->src_l->tp_rank, p->dst_l->tp_rank);
    if (p->src_l->attn == KVB_KV_ATTN_MLA) {
        if (rt->head_begin || rt->head_end)
            return kvb__fail(p->reason, p->cap, INVAL, "an MLA route has no head range");
        return KVB_OK;
    }
    return route_heads(p, rt);
}

/* Requests one slot pair contributes: one per run, one per block for a partial head range, none
 * for an unsplit slot this route does not carry. */
static size_t slot_requests(const plan_t *p, const kvb_kv_slot_t *s)
{
    if (s->num_heads && p->partial)
        return p->args->num_src;
    if (!s->num_heads && !p->send_unsplit)
        return 0;
    return p->num_runs;
}

static uint32_t layer_at(const plan_t *p, size_t i)
{
    return p->args->layers ? p->args->layers[i] : (uint32_t)i;
}

static size_t layer_count(const plan_t *p)
{
    return p->args->layers ? p->args->num_layers : p->dst_l->num_layers;
}

/* Adds the requests of one layer to *total. */
static int layer_requests(const plan_t *p, uint32_t layer, size_t *total)
{
    for (unsigned k = 0; k < KVB_KV_SLOT_COUNT; k++) {
        const kvb_kv_slot_t *s = kvb__kv_slot_at(p->src_l, p->src_idx, layer, k);
        if (s && kvb__add_size(*total, slot_requests(p, s), total))
            return kvb__fail(p->reason, p->cap, KVB_ERR_OVERFLOW, "too many requests");
    }
    return KVB_OK;
}

static int count_requests(const plan_t *p, size_t *out)
{
    size_t total = 0;
    int rc = KVB_OK;
    for (size_t i = 0; i < layer_count(p) && !rc; i++)
        rc = layer_requests(p, layer_at(p, i), &total);
    *out = total;
    return rc;
}

/* Address of `len` bytes at offset `off` into block `block` of slot s, which must lie inside the
 * slot's buffer. */
static int slot_addr(plan_t *p, const kvb_kv_slot_t *s, const char *side, uint64_t block,
                     uint64_t n, uint64_t off, uint64_t len, uint64_t *out)
{
    uint64_t a;
    if (kvb__mul_u64(block, s->block_bytes, &a) || kvb__add_u64(a, off, &a) ||
        kvb__add_u64(s->base, a, &a))
        return kvb__kv_slot_fail(p->reason, p->cap, KVB_ERR_OVERFLOW, s,
                                 "%s block %" PRIu64 " * %" PRIu64 " bytes overflows", side, block,
                                 s->block_bytes);
    if (!kvb__range_within(a, len, s->base, s->len))
        return kvb__kv_slot_fail(p->reason, p->cap, INVAL, s,
                                 "%s blocks %" PRIu64 "..%" PRIu64 " exceed its %" PRIu64 " blocks",
                                 side, block, block + n - 1, s->num_blocks);
    *out = a;
    return KVB_OK;
}

static const char *side_name(const plan_t *p, const kvb_kv_layout_t *l)
{
    return l == p->local ? "local" : "remote";
}

/* Moves n blocks from ss block sb to ds block db, or with a partial head range the heads' share
 * of one block (n == 1). */
static int emit(plan_t *p, const kvb_kv_slot_t *ss, const kvb_kv_slot_t *ds, uint64_t sb,
                uint64_t db, uint64_t n)
{
    uint64_t soff = 0, doff = 0, len, sa = 0, da = 0; /* sa, da: set when rc is 0 */
    if (ss->num_heads && p->partial &&
        (ss->order != KVB_KV_ORDER_HND || ds->order != KVB_KV_ORDER_HND))
        return kvb__kv_slot_fail(p->reason, p->cap, KVB_ERR_INVALID_ARG, ss,
                                 "a route over part of the heads needs HND blocks on both sides "
                                 "(in NHD blocks a head range is no contiguous byte range)");
    if (ss->num_heads && p->partial) {
        uint64_t stride = (uint64_t)p->dst_l->tokens_per_block * ss->head_bytes;
        const kvb_kv_layout_t *s = p->src_l, *d = p->dst_l;
        soff = (p->h0 - kvb__kv_first_head(s->tp_rank, s->tp_size, s->num_kv_heads)) * stride;
        doff = (p->h0 - kvb__kv_first_head(d->tp_rank, d->tp_size, d->num_kv_heads)) * stride;
        len = (uint64_t)(p->h1 - p->h0) * stride;
    } else if (kvb__mul_u64(n, ss->block_bytes, &len)) {
        return kvb__kv_slot_fail(p->reason, p->cap, KVB_ERR_OVERFLOW, ss, "run length overflows");
    }
    int rc = slot_addr(p, ss, side_name(p, p->src_l), sb, n, soff, len, &sa);
    if (!rc)
        rc = slot_addr(p, ds, side_name(p, p->dst_l), db, n, doff, len, &da);
    if (rc)
        return rc;
    int read = p->args->op == KVB_OP_READ;
    p->out[p->n++] = (kvb_request_t){.opcode = p->args->op,
                                     .local = (void *)(uintptr_t)(read ? da : sa),
                                     .segment = p->args->segment,
                                     .remote = read ? sa : da,
                                     .len = (size_t)len};
    return KVB_OK;
}

static int emit_slot(plan_t *p, const kvb_kv_slot_t *ss, const kvb_kv_slot_t *ds)
{
    int rc = KVB_OK;
    if (slot_requests(p, ss) == 0)
        return KVB_OK;
    for (size_t i = 0; i < p->num_runs && !rc; i++) {
        const run_t *r = &p->runs[i];
        if (ss->num_heads && p->partial) {
            for (uint64_t j = 0; j < r->n && !rc; j++)
                rc = emit(p, ss, ds, r->src + j, r->dst + j, 1);
        } else {
            rc = emit(p, ss, ds, r->src, r->dst, r->n);
        }
    }
    return rc;
}

static int emit_layer(plan_t *p, uint32_t layer)
{
    int rc = KVB_OK;
    for (unsigned k = 0; k < KVB_KV_SLOT_COUNT && !rc; k++) {
        const kvb_kv_slot_t *ss = kvb__kv_slot_at(p->src_l, p->src_idx, layer, k);
        const kvb_kv_slot_t *ds = kvb__kv_slot_at(p->dst_l, p->dst_idx, layer, k);
        if (ss)
            rc = emit_slot(p, ss, ds);
    }
    return rc;
}

static int emit_all(plan_t *p)
{
    int rc = KVB_OK;
    for (size_t i = 0; i < layer_count(p) && !rc; i++)
        rc = emit_layer(p, layer_at(p, i));
    return rc;
}

/* Everything that does not depend on the output array. */
static int prepare(plan_t *p)
{
    int rc = check_lists(p->args, p->reason, p->cap);
    if (!rc)
        rc = kvb_kv_layout_check_pair(p->local, p->remote, p->reason, p->cap);
    if (!rc)
        rc = check_layers(p->args, p->local->num_layers, p->reason, p->cap);
    if (!rc && p->args->num_src)
        rc = check_dst_unique(p->args, p->reason, p->cap);
    if (!rc)
        rc = resolve_route(p);
    if (!rc && p->args->num_src)
        rc = make_runs(p);
    if (!rc &&
        (kvb__kv_slot_index(p->src_l, &p->src_idx) || kvb__kv_slot_index(p->dst_l, &p->dst_idx)))
        rc = kvb__fail(p->reason, p->cap, KVB_ERR_NOMEM, "out of memory");
    return rc;
}

static int build(plan_t *p, size_t *total)
{
    size_t bytes;
    int rc = prepare(p);
    if (!rc)
        rc = count_requests(p, total);
    if (rc || *total == 0)
        return rc;
    if (kvb__mul_size(*total, sizeof *p->out, &bytes))
        return kvb__fail(p->reason, p->cap, KVB_ERR_OVERFLOW, "too many requests");
    p->out = malloc(bytes);
    if (!p->out)
        return kvb__fail(p->reason, p->cap, KVB_ERR_NOMEM, "out of memory");
    return emit_all(p);
}

static plan_t plan_of(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                      const kvb_kv_plan_args_t *args, char *reason, size_t cap)
{
    int read = args->op == KVB_OP_READ;
    return (plan_t){.args = args,
                    .local = local,
                    .remote = remote,
                    .src_l = read ? remote : local,
                    .dst_l = read ? local : remote,
                    .reason = reason,
                    .cap = cap};
}

/* Frees what prepare() made (not the output). */
static void plan_release(plan_t *p)
{
    free(p->runs);
    free(p->src_idx);
    free(p->dst_idx);
}

int kvb_kv_plan(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                const kvb_kv_plan_args_t *args, kvb_request_t **reqs, size_t *count, char *reason,
                size_t reason_cap)
{
    if (!args || !reqs || !count)
        return kvb__fail(reason, reason_cap, INVAL, "args, reqs and count must not be NULL");
    plan_t p = plan_of(local, remote, args, reason, reason_cap);
    size_t total = 0;
    int rc = build(&p, &total);
    plan_release(&p);
    if (rc) {
        free(p.out);
        return rc;
    }
    *reqs = p.out;
    *count = total;
    kvb__reason_clear(reason, reason_cap);
    return KVB_OK;
}

int kvb__kv_plan_layers(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                        const kvb_kv_plan_args_t *args, kvb_request_t **reqs, size_t *counts,
                        char *reason, size_t reason_cap)
{
    plan_t p = plan_of(local, remote, args, reason, reason_cap);
    int rc = args->layers ? kvb__fail(reason, reason_cap, INVAL,
                                      "a per-layer plan covers every layer: pass no layer list")
                          : prepare(&p);
    uint32_t n = rc ? 0 : local->num_layers, done = 0;
    for (; done < n && !rc; done++) {
        size_t count = 0, bytes = 0;
        reqs[done] = NULL;
        counts[done] = 0;
        rc = layer_requests(&p, done, &count);
        if (rc || count == 0)
            continue;
        if (kvb__mul_size(count, sizeof *p.out, &bytes) || !(p.out = malloc(bytes))) {
            rc = kvb__fail(reason, reason_cap, KVB_ERR_NOMEM, "out of memory");
            continue;
        }
        p.n = 0;
        rc = emit_layer(&p, done);
        reqs[done] = p.out;
        counts[done] = count;
        p.out = NULL;
    }
    plan_release(&p);
    if (rc) {
        for (uint32_t i = 0; i < done; i++) {
            free(reqs[i]);
            reqs[i] = NULL;
            counts[i] = 0;
        }
        return rc;
    }
    kvb__reason_clear(reason, reason_cap);
    return KVB_OK;
}

void kvb_kv_plan_free(kvb_request_t *reqs)
{
    free(reqs);
}
