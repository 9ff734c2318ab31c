/* SPDX-License-Identifier: Apache-2.0 */
/* The topology guard: decides at link time whether a prefill/decode pair can exchange KV blocks,
 * and if so whether rank k simply feeds rank k (homo) or routing splits the work (hetero). */
#include "kv/internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>

#define INVAL KVB_ERR_INVALID_ARG

static const char *const verdict_names[] = {
    [KVB_KV_ALLOW_HOMO] = "ALLOW_HOMO",         [KVB_KV_ALLOW_HETERO] = "ALLOW_HETERO",
    [KVB_KV_DENY_HETERO] = "DENY_HETERO",       [KVB_KV_INVALID_LOCAL] = "INVALID_LOCAL",
    [KVB_KV_INVALID_REMOTE] = "INVALID_REMOTE",
};

const char *kvb_kv_verdict_name(kvb_kv_verdict_t verdict)
{
    unsigned v = (unsigned)verdict;
    return v < sizeof verdict_names / sizeof verdict_names[0] ? verdict_names[v] : "?";
}

static int check_size(const char *what, int32_t v, char *r, size_t cap)
{
    if (v <= 0 || v > KVB_KV_TP_MAX)
        return kvb__fail(r, cap, INVAL, "%s %" PRId32 " is outside 1..%d", what, v, KVB_KV_TP_MAX);
    return KVB_OK;
}

/* GQA heads are split over TP: heads/tp per rank, or, with more ranks than heads, each head
 * replicated on tp/heads ranks. Anything else leaves some rank a fraction of a head. */
static int check_heads(const kvb_kv_topo_t *t, char *r, size_t cap)
{
    uint32_t h = t->num_kv_heads, tp = (uint32_t)t->tp_size;
    if (t->attn == KVB_KV_ATTN_MLA)
        return h ? kvb__fail(r, cap, INVAL,
                             "MLA has no KV heads to split (num_kv_heads %" PRIu32 " must be 0)", h)
                 : KVB_OK;
    if (h == 0 || h > KVB_KV_HEADS_MAX)
        return kvb__fail(r, cap, INVAL, "GQA num_kv_heads %" PRIu32 " is outside 1..%d", h,
                         KVB_KV_HEADS_MAX);
    if ((tp <= h && h % tp) || (tp > h && tp % h))
        return kvb__fail(r, cap, INVAL, "%" PRIu32 " KV heads do not divide over tp_size %" PRIu32,
                         h, tp);
    return KVB_OK;
}

int kvb__kv_topo_check(const kvb_kv_topo_t *t, char *reason, size_t cap)
{
    int rc = check_size("dp_size", t->dp_size, reason, cap);
    if (!rc)
        rc = check_size("tp_size", t->tp_size, reason, cap);
    if (rc)
        return rc;
    if (!kvb__kv_attn_name(t->attn))
        return kvb__fail(reason, cap, INVAL, "unknown attention kind %d", (int)t->attn);
    return check_heads(t, reason, cap);
}

/* The topology check plus the block order, which a layout carries per slot instead. */
static int topo_valid(const kvb_kv_topo_t *t, char *r, size_t cap)
{
    if (!t)
        return kvb__fail(r, cap, INVAL, "topology is NULL");
    int rc = kvb__kv_topo_check(t, r, cap);
    if (rc)
        return rc;
    if (t->attn == KVB_KV_ATTN_MLA && t->order != KVB_KV_ORDER_NONE)
        return kvb__fail(r, cap, INVAL, "MLA blocks are not head split (order must be NONE)");
    if (t->attn == KVB_KV_ATTN_GQA && t->order != KVB_KV_ORDER_HND && t->order != KVB_KV_ORDER_NHD)
        return kvb__fail(r, cap, INVAL, "GQA block order %d is neither HND nor NHD", (int)t->order);
    return KVB_OK;
}

static kvb_kv_verdict_t verdict(kvb_kv_verdict_t v, char *r, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static kvb_kv_verdict_t verdict(kvb_kv_verdict_t v, char *r, size_t cap, const char *fmt, ...)
{
    if (r && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r, cap, fmt, ap);
        va_end(ap);
    }
    return v;
}

/* Both sides are valid; is it the same model shape? */
static kvb_kv_verdict_t match(const kvb_kv_topo_t *a, const kvb_kv_topo_t *b, char *r, size_t cap)
{
    if (a->attn != b->attn)
        return verdict(KVB_KV_INVALID_REMOTE, r, cap, "attention %s locally, %s remotely",
                       kvb__kv_attn_name(a->attn), kvb__kv_attn_name(b->attn));
    if (a->num_kv_heads != b->num_kv_heads)
        return verdict(KVB_KV_INVALID_REMOTE, r, cap,
                       "%" PRIu32 " KV heads locally, %" PRIu32 " remotely", a->num_kv_heads,
                       b->num_kv_heads);
    if (a->order != b->order)
        return verdict(KVB_KV_INVALID_REMOTE, r, cap, "block order %s locally, %s remotely",
                       kvb__kv_order_name(a->order), kvb__kv_order_name(b->order));
    return KVB_KV_ALLOW_HOMO;
}

static kvb_kv_verdict_t hetero_gqa(const kvb_kv_topo_t *a, const kvb_kv_topo_t *b, char *r,
                                   size_t cap)
{
    uint32_t h = a->num_kv_heads;
    if (a->order != KVB_KV_ORDER_HND)
        return verdict(KVB_KV_DENY_HETERO, r, cap,
                       "heterogeneous TP (%" PRId32 " vs %" PRId32 ") for GQA needs HND blocks "
                       "(heads outermost) so that a head range is contiguous; these are %s",
                       a->tp_size, b->tp_size, kvb__kv_order_name(a->order));
    const kvb_kv_topo_t *big = a->tp_size > b->tp_size ? a : b;
    if ((uint32_t)big->tp_size > h)
        return verdict(KVB_KV_DENY_HETERO, r, cap,
                       "replicated heads: %s TP %" PRId32 " exceeds the %" PRIu32 " KV heads; "
                       "heterogeneous TP with replicated heads is not supported yet",
                       big == a ? "local" : "remote", big->tp_size, h);
    return verdict(KVB_KV_ALLOW_HETERO, r, cap,
                   "GQA with %" PRIu32 " KV heads in HND blocks: local TP %" PRId32 " (%" PRIu32
                   " per rank), remote TP %" PRId32 " (%" PRIu32 " per rank); each pair "
                   "moves one contiguous head range per block",
                   h, a->tp_size, h / (uint32_t)a->tp_size, b->tp_size, h / (uint32_t)b->tp_size);
}

kvb_kv_verdict_t kvb_kv_guard_topo(const kvb_kv_topo_t *local, const kvb_kv_topo_t *remote,
                                   char *reason, size_t reason_cap)
{
    char msg[KVB_KV_REASON_MAX];
    if (topo_valid(local, msg, sizeof msg))
        return verdict(KVB_KV_INVALID_LOCAL, reason, reason_cap, "local: %s", msg);
    if (topo_valid(remote, msg, sizeof msg))
        return verdict(KVB_KV_INVALID_REMOTE, reason, reason_cap, "remote: %s", msg);
    kvb_kv_verdict_t v = match(local, remote, reason, reason_cap);
    if (v != KVB_KV_ALLOW_HOMO)
        return v;
    if (local->tp_size == remote->tp_size)
        return verdict(KVB_KV_ALLOW_HOMO, reason, reason_cap,
                       "same TP %" PRId32 " on both sides (local dp %" PRId32 ", remote dp %" PRId32
                       "): rank k sends whole blocks to rank k",
                       local->tp_size, local->dp_size, remote->dp_size);
    if (local->attn == KVB_KV_ATTN_MLA)
        return verdict(KVB_KV_ALLOW_HETERO, reason, reason_cap,
                       "MLA latent is replicated on every TP rank: local TP %" PRId32 ", remote TP "
                       "%" PRId32 "; whole blocks, one writer per receiving rank",
                       local->tp_size, remote->tp_size);
    return hetero_gqa(local, remote, reason, reason_cap);
}

kvb_kv_verdict_t kvb_kv_guard(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                              char *reason, size_t reason_cap)
{
    char msg[KVB_KV_REASON_MAX];
    kvb_kv_topo_t lt, rt;
    if (kvb_kv_layout_validate(local, msg, sizeof msg))
        return verdict(KVB_KV_INVALID_LOCAL, reason, reason_cap, "local layout: %s", msg);
    if (kvb_kv_layout_validate(remote, msg, sizeof msg))
        return verdict(KVB_KV_INVALID_REMOTE, reason, reason_cap, "remote layout: %s", msg);
    kvb__kv_topo_of(local, &lt);
    kvb__kv_topo_of(remote, &rt);
    kvb_kv_verdict_t v = kvb_kv_guard_topo(&lt, &rt, reason, reason_cap);
    if (v != KVB_KV_ALLOW_HOMO && v != KVB_KV_ALLOW_HETERO)
        return v;
    if (kvb_kv_layout_check_pair(local, remote, msg, sizeof msg))
        return verdict(KVB_KV_INVALID_REMOTE, reason, reason_cap,
                       "remote layout does not match: %s", msg);
    return v;
}
