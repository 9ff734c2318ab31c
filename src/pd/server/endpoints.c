/* SPDX-License-Identifier: Apache-2.0 */
/* The instance endpoints the proxy drives (docs/pd-protocol.md): /pd/info; /pd/prefill (pull:
 * compute and lease the blocks; push: compute and write each layer to the decode as it is done);
 * /pd/reserve and /pd/abort (push, decode side); /pd/decode (pull the KV or wait for the pushed
 * one, then generate from T0). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/server/internal.h"

/* A request's KV transfer ends this long before the other instance's grant of the blocks does
 * (a pull lease, a push reservation: the ticket's expiry, in the other host's clock): room for
 * the two hosts' clocks to differ and for the other instance's reaper to run early. */
#define GRANT_MARGIN_MS 500
_Static_assert(KVB_PD_SERVER_LEASE_MIN_MS > GRANT_MARGIN_MS, "a lease leaves time to read");
/* How long a decode waits for its "nothing will be read" notices to go (give_up_reads). */
#define GIVE_UP_MS 1000

/* One /pd request as it is handled: what was parsed, what is held, and how it failed. */
typedef struct {
    kvb_pd_server_t *srv;
    const char *id;
    kvb__srv_params_t p;
    kvb_pd_kv_mode_t mode;
    uint32_t t0;
    char *segs[KVB__SRV_SEGS_MAX]; /* the other instance's segments (the body's strings) */
    size_t nsegs;
    uint64_t *rblocks; /* the other instance's block ids */
    size_t nrblocks;
    uint32_t *toks;
    size_t ntoks;
    uint64_t nb;           /* blocks of the prompt */
    kvb_kv_link_t **links; /* [tp * nsegs] */
    kvb__srv_ent_t *ent;   /* ACTIVE while the handler owns it; NULL once handed on */
    uint64_t grant_ends; /* the other instance's lease or reservation ends (its ticket, Unix ms) */
    uint64_t t_start;
    unsigned status; /* 0, or the failure's HTTP status */
    char why[1024];
    kvb__srv_refusal_t ref; /* when status came from admission: answered with its reason */
    bool refused;
    kvb_kv_xfer_t **unsettled; /* failed transfers that may still place bytes in its blocks */
    size_t nunsettled;
} pdreq_t;

static int req_fail(pdreq_t *q, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int req_fail(pdreq_t *q, unsigned status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(q->why, sizeof q->why, fmt, ap);
    va_end(ap);
    q->status = status;
    return -1;
}

/* Refuses the request with a machine-readable reason in the error object. */
static int req_deny(pdreq_t *q, unsigned status, const char *reason, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int req_deny(pdreq_t *q, unsigned status, const char *reason, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(q->ref.msg, sizeof q->ref.msg, fmt, ap);
    va_end(ap);
    q->ref.status = status;
    q->ref.reason = reason;
    q->ref.retry_after_s = 0;
    q->refused = true;
    return req_fail(q, status, "%s", q->ref.msg);
}

static void req_init(pdreq_t *q, kvb_pd_server_t *srv)
{
    memset(q, 0, sizeof *q);
    q->srv = srv;
    q->t_start = kvb__now_ns();
}

/* Frees what the request still holds (an ACTIVE entry with its blocks included; blocks a failed
 * transfer may still write go to the reaper, which frees them once it cannot). */
static void req_free(pdreq_t *q)
{
    if (q->nunsettled)
        kvb__srv_ent_settle(q->srv, q->ent, q->unsettled, q->nunsettled);
    else if (q->ent)
        kvb__srv_ent_done(q->srv, q->id);
    q->ent = NULL;
    q->unsettled = NULL;
    q->nunsettled = 0;
    free(q->toks);
    free(q->rblocks);
    free(q->links);
}

/* Answers (ok, or the recorded failure) and frees the request. */
static enum MHD_Result req_answer(pdreq_t *q, struct MHD_Connection *conn, json_t *ok)
{
    enum MHD_Result ret;
    if (q->refused) {
        ret = kvb__srv_http_refuse(q->srv, conn, &q->ref);
        json_decref(ok);
    } else if (q->status || !ok) {
        ret = kvb__srv_http_fail(q->srv, conn, q->status ? q->status : 500, "%s",
                                 q->status ? q->why : "out of memory");
        json_decref(ok);
    } else {
        ret = kvb__http_json(conn, 200, ok);
    }
    req_free(q);
    return ret;
}

/* ---- body fields -------------------------------------------------------------------------- */

static int get_id(pdreq_t *q, json_t *b)
{
    json_t *v = json_object_get(b, "request_id");
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    size_t n = s ? json_string_length(v) : 0;
    bool ok = n >= 1 && n <= KVB__SRV_REQ_ID_MAX;
    for (size_t i = 0; ok && i < n; i++)
        ok = s[i] >= 0x21 && s[i] <= 0x7e;
    if (!ok)
        return req_fail(q, 400, "\"request_id\" must be 1..%u printable characters",
                        KVB__SRV_REQ_ID_MAX);
    q->id = s;
    return 0;
}

static int get_segs(pdreq_t *q, json_t *b, const char *key)
{
    json_t *a = json_object_get(b, key);
    size_t n = json_is_array(a) ? json_array_size(a) : 0;
    if (n < 1 || n > KVB__SRV_SEGS_MAX)
        return req_fail(q, 400, "\"%s\" must be an array of 1..%u segment names", key,
                        KVB__SRV_SEGS_MAX);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        size_t len = json_is_string(v) ? json_string_length(v) : 0;
        if (len < 1 || len > KVB_NAME_MAX || strlen(json_string_value(v)) != len)
            return req_fail(q, 400, "\"%s\"[%zu] must be a segment name (\"host:port\")", key, i);
        q->segs[i] = (char *)json_string_value(v);
    }
    q->nsegs = n;
    return 0;
}

static int get_blocks(pdreq_t *q, json_t *b, const char *key)
{
    json_t *a = json_object_get(b, key);
    size_t n = json_is_array(a) ? json_array_size(a) : 0;
    if (!json_is_array(a) || n > UINT32_MAX)
        return req_fail(q, 400, "\"%s\" must be an array of block ids", key);
    q->rblocks = calloc(n ? n : 1, sizeof *q->rblocks);
    if (!q->rblocks)
        return req_fail(q, 500, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return req_fail(q, 400, "\"%s\"[%zu] must be a block id (an integer >= 0)", key, i);
        q->rblocks[i] = (uint64_t)json_integer_value(v);
    }
    q->nrblocks = n;
    return 0;
}

static int get_mode(pdreq_t *q, json_t *b)
{
    json_t *v = json_object_get(b, "kv_mode");
    q->mode = q->srv->opts.kv_mode; /* the body's, when it says */
    if (v && (!json_is_string(v) || kvb_pd_kv_mode_parse(json_string_value(v), &q->mode)))
        return req_fail(q, 400, "\"kv_mode\" must be \"pull\" or \"push\"");
    return 0;
}

static int get_t0(pdreq_t *q, json_t *b)
{
    json_t *v = json_object_get(b, "t0");
    uint32_t vocab = kvb_pd_model_config(q->srv->model)->vocab;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab)
        return req_fail(q, 400, "\"t0\" must be a token id in 0..%u", vocab - 1);
    q->t0 = (uint32_t)json_integer_value(v);
    return 0;
}

/* The other instance's blocks and segments must be the ones its ticket vouches for: a lease
 * (pull) or reservation (push) of this very request, still held. Anything else - another
 * request's blocks, a segment it never named, a made-up list - is refused before any link. */
static int check_ticket(pdreq_t *q, json_t *b, const char *key, const char *kind)
{
    json_t *v = json_object_get(b, key);
    const char *t = json_is_string(v) ? json_string_value(v) : NULL;
    kvb__pd_grant_t g = {.kind = kind,
                         .request_id = q->id,
                         .segs = q->segs,
                         .nsegs = q->nsegs,
                         .blocks = q->rblocks,
                         .nblocks = q->nrblocks};
    const char *reason;
    if (v && !t)
        return req_fail(q, 400, "\"%s\" must be a string", key);
    if (!kvb__pd_ticket_check(q->srv->auth, &g, t, &q->grant_ends, &reason))
        return 0;
    return req_deny(q, 403, reason,
                    "\"%s\" does not vouch for these blocks and segments of %s %s (%s)", key, kind,
                    q->id, reason);
}

/* A ticket for the blocks this instance holds for the request, on its own segments. */
static json_t *ticket_json(pdreq_t *q, const char *kind, uint64_t valid_ms)
{
    kvb_pd_server_t *srv = q->srv;
    char *segs[KVB__SRV_SEGS_MAX], t[KVB_PD_TICKET_MAX];
    for (uint32_t r = 0; r < srv->tp; r++)
        segs[r] = (char *)kvb_engine_segment_name(srv->ranks[r].engine);
    kvb__pd_grant_t g = {.kind = kind,
                         .request_id = q->id,
                         .segs = segs,
                         .nsegs = srv->tp,
                         .blocks = q->ent->seq.blocks,
                         .nblocks = q->nb};
    if (kvb__pd_ticket_make(srv->auth, &g, kvb__pd_unix_ms() + valid_ms, t))
        return NULL;
    return json_string(t);
}

/* The fields every /pd request has: id, prompt and generation parameters, kv_mode. */
static int parse_common(pdreq_t *q, json_t *b)
{
    if (get_id(q, b) || get_mode(q, b))
        return -1;
    /* A push decode may leave the prompt out: the reservation has its tokens. */
    bool need_prompt = q->mode == KVB_PD_KV_PULL || json_object_get(b, "prompt");
    char why[512];
    if (kvb__srv_params_parse(b, &q->p, need_prompt, why, sizeof why))
        return req_fail(q, 400, "%s", why);
    return 0;
}

/* Holds the id, tokenizes the prompt and links to the other instance's ranks. */
static int prepare(pdreq_t *q, bool link)
{
    kvb_pd_server_t *srv = q->srv;
    int rc = kvb__srv_ent_add(srv, q->id, &q->ent);
    if (rc)
        return req_fail(q, rc == KVB_ERR_BUSY ? 409 : 500, "request id %s: %s", q->id,
                        rc == KVB_ERR_BUSY ? "already in use" : kvb_strerror(rc));
    if (kvb__srv_tokenize(q->p.prompt, q->p.prompt_len, &q->toks, &q->ntoks))
        return req_fail(q, 500, "out of memory tokenizing the prompt");
    q->nb = kvb_pd_blocks_for(q->ntoks, srv->tpb);
    if (!link)
        return 0;
    q->links = calloc(srv->tp * q->nsegs, sizeof *q->links);
    if (!q->links)
        return req_fail(q, 500, "out of memory");
    char why[sizeof q->why];
    rc = kvb__srv_links_get(srv, q->segs, q->nsegs, q->links, why, sizeof why);
    if (rc == KVB_ERR_INCOMPATIBLE)
        return req_fail(q, 409, "%s", why);
    if (kvb__srv_links_unknown(rc)) /* not a member of this cluster: nothing to retry */
        return req_deny(q, 400, "unknown_segment", "%s", why);
    if (rc)
        return req_fail(q, 502, "%s", why);
    return 0;
}

/* The request's deadline (monotonic ns): its timeout, counted from when it came. */
static uint64_t req_deadline(const pdreq_t *q)
{
    return q->t_start + (uint64_t)q->p.timeout_ms * 1000000ull;
}

/* Takes blocks for `tokens` positions into the entry, waiting in the admission queue until the
 * request's deadline while they are not free. */
static int admit(pdreq_t *q, uint64_t tokens)
{
    kvb_pd_server_t *srv = q->srv;
    if (!kvb__srv_admit(srv, &q->ent->seq, tokens, req_deadline(q), &q->ref))
        return 0;
    q->refused = true;
    return req_fail(q, q->ref.status, "%s", q->ref.msg);
}

static int reserve_prompt(pdreq_t *q)
{
    return admit(q, q->ntoks);
}

static json_t *segs_json(kvb_pd_server_t *srv)
{
    json_t *a = json_array();
    for (uint32_t r = 0; a && r < srv->tp; r++)
        json_array_append_new(a, json_string(kvb_engine_segment_name(srv->ranks[r].engine)));
    return a;
}

static json_t *blocks_json(const uint64_t *b, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        json_array_append_new(a, json_integer((json_int_t)b[i]));
    return a;
}

static int status_of(int rc)
{
    return rc == KVB_ERR_TIMEOUT || rc == KVB_ERR_AGAIN ? 504 : 502;
}

/* Forgets the links of the request's peers when a transfer says a peer is gone. */
static void drop_if_lost(pdreq_t *q, int rc)
{
    for (size_t m = 0; KVB_IS_PEER_ERROR(rc) && m < q->nsegs; m++)
        kvb__srv_links_drop(q->srv, q->segs[m]);
}

/* ---- transfers ---------------------------------------------------------------------------- */

/* How long the request may still move KV, in ms: until its own deadline or GRANT_MARGIN_MS
 * before the other instance's grant of its blocks ends (the ticket's expiry), whichever is
 * sooner. The other instance frees the blocks when its grant ends, moved or not, and may hand them
 * to another request: a read after it could take that request's KV, a write overwrite it. 0, the
 * request failed with 503 `reason`, when it waited for its own blocks until the grant was (nearly)
 * over. */
static int grant_left_ms(pdreq_t *q, const char *grant, const char *reason)
{
    int64_t now_ms = (int64_t)kvb__pd_unix_ms();
    int64_t ends = (int64_t)q->grant_ends - now_ms;
    int64_t left = ends - GRANT_MARGIN_MS;
    int64_t req_left = kvb__ms_left(req_deadline(q));
    if (left <= 0 && req_left <= GRANT_MARGIN_MS) { /* the request's own time is up as well */
        req_fail(q, 504, "request %s has %lld ms left of its deadline: too little to move its KV",
                 q->id, (long long)req_left);
        return 0;
    }
    if (left <= 0) {
        req_deny(q, 503, reason,
                 "the %s of %s's blocks %s %lld ms%s, too soon to move its KV (the request waited "
                 "%.0f ms for its own blocks)",
                 grant, q->id, ends < 0 ? "ended" : "ends in", (long long)(ends < 0 ? -ends : ends),
                 ends < 0 ? " ago" : "", (double)(kvb__now_ns() - q->t_start) / 1e6);
        q->ref.retry_after_s = 1;
        return 0;
    }
    return (int)(req_left < left ? (req_left > 1 ? req_left : 1) : left);
}

/* Begins a transfer over every routed link (local rank r, remote rank m) into xs[r * n + m],
 * each batch bounded by `ms`. */
static int xfers_begin(pdreq_t *q, kvb_opcode_t op, const uint64_t *src, const uint64_t *dst,
                       kvb_kv_xfer_t **xs, int ms)
{
    char why[KVB_KV_REASON_MAX];
    size_t n = q->nsegs;
    for (size_t i = 0; i < q->srv->tp * n; i++) {
        if (!kvb_kv_link_has_route(q->links[i]))
            continue;
        int rc =
            kvb_kv_xfer_begin(q->links[i], q->id, op, src, dst, q->nb, ms, &xs[i], why, sizeof why);
        if (rc)
            return req_fail(q, rc == KVB_ERR_INVALID_ARG ? 400 : 500,
                            "KV transfer with %s cannot start: %s", q->segs[i % n], why);
    }
    return 0;
}

/* Frees a finished transfer or, for a pull (the peer copies into our blocks), keeps it with the
 * request while bytes of it may still land (a failed one: kvb_kv_xfer_finish gave it a second
 * past its deadline already), so that its blocks stay out of use. A push's bytes land in the
 * other instance's blocks, which kvb_kv_xfer_finish protected as far as it could by telling it
 * only once they were in, or a second past the deadline. */
static void keep_or_free(pdreq_t *q, kvb_kv_xfer_t *x, bool pull)
{
    if (pull && kvb_kv_xfer_settle(x, 0) != KVB_OK) {
        kvb_kv_xfer_t **grown = realloc(q->unsettled, (q->nunsettled + 1) * sizeof *grown);
        if (grown) {
            q->unsettled = grown;
            q->unsettled[q->nunsettled++] = x;
            return;
        }
        KVB_WARN("request %s: no memory to keep an unsettled transfer; waiting for it here", q->id);
        (void)kvb_kv_xfer_settle(x, 5000); /* about a peer timeout: then it is lost */
    }
    kvb_kv_xfer_free(x);
}

/* Finishes every begun transfer (each notifies its peer) and frees them; the first error. */
static int xfers_finish(pdreq_t *q, kvb_kv_xfer_t **xs, int failed, bool pull)
{
    size_t n = q->nsegs;
    for (size_t i = 0; i < q->srv->tp * n; i++) {
        if (!xs[i])
            continue;
        int rc = kvb_kv_xfer_finish(xs[i]);
        keep_or_free(q, xs[i], pull);
        xs[i] = NULL;
        if (rc && !failed) {
            drop_if_lost(q, rc);
            failed = req_fail(q, status_of(rc), "KV transfer with %s failed: %s", q->segs[i % n],
                              kvb_strerror(rc));
        }
    }
    return failed;
}

/* Bytes a request's blocks take on the decode ranks: `per_block` summed over them, nb times. */
static uint64_t kv_bytes(uint64_t nb, uint64_t per_block)
{
    return nb * per_block; /* nb <= blocks of a pool, per_block of one rank's layout: no wrap */
}

static uint64_t slots_bytes(const kvb_kv_layout_t *l)
{
    uint64_t s = 0;
    for (size_t i = 0; i < l->num_slots; i++)
        s += l->slots[i].block_bytes;
    return s;
}

/* ---- /pd/prefill -------------------------------------------------------------------------- */

typedef struct {
    pdreq_t *q;
    kvb_kv_xfer_t **xs;
    int rc;
} push_hook_t;

/* A layer is in every rank's cache: start writing it to the decode while the next is computed. */
static void on_layer(uint32_t layer, void *user)
{
    push_hook_t *h = user;
    kvb_pd_server_t *srv = h->q->srv;
    for (size_t i = 0; i < srv->tp * h->q->nsegs; i++) {
        int rc = h->xs[i] ? kvb_kv_xfer_layer(h->xs[i], layer) : KVB_OK;
        if (rc && !h->rc)
            h->rc = rc;
    }
    if (layer == srv->stall_layer) { /* test fault hook: wait here to be killed */
        KVB_WARN("fault hook: stalling after pushing layer %u of %s", layer, h->q->id);
        for (int i = 0; i < 600 && !srv->stop; i++)
            usleep(100000);
    }
}

/* Runs the prompt (pushing layers through `hook` when given) and samples T0. */
static int run_prompt(pdreq_t *q, const kvb_pd_hook_t *hook)
{
    kvb_pd_server_t *srv = q->srv;
    char why[KVB_PD_REASON_MAX];
    uint32_t vocab = kvb_pd_model_config(srv->model)->vocab;
    float *logits = calloc(vocab, sizeof *logits);
    if (!logits)
        return req_fail(q, 500, "out of memory");
    pthread_mutex_lock(&srv->fwd_mu);
    int rc = kvb_pd_forward(srv->model, srv->caches, srv->tp, &q->ent->seq, q->toks, q->ntoks,
                            logits, hook, why, sizeof why);
    pthread_mutex_unlock(&srv->fwd_mu);
    if (!rc)
        rc = kvb_pd_sample(logits, vocab, q->p.temperature, q->p.seed, 0, &q->t0);
    free(logits);
    if (rc)
        return req_fail(q, 500, "prefill failed: %s",
                        rc == KVB_ERR_INVALID_ARG ? why : kvb_strerror(rc));
    double ttft = (double)(kvb__now_ns() - q->t_start) / 1e9;
    kvb__srv_metric_timing(srv, ttft, 0.0, false);
    return 0;
}

/* Tells every rank's agent to expect the other instance's ranks to move the request's blocks
 * within `ms`. Returns the ranks that do, as a mask. A rank no peer is routed to answers
 * KVB_ERR_NOT_FOUND: with `all` (push: every rank is written to) that fails the request, without
 * it (pull) the rank is skipped. */
static uint64_t expect_all(pdreq_t *q, uint32_t ms, bool all)
{
    kvb_pd_server_t *srv = q->srv;
    uint64_t mask = 0;
    size_t n = q->nsegs;
    for (uint32_t r = 0; r < srv->tp && !q->status; r++) {
        int rc = kvb_kv_expect(srv->ranks[r].agent, q->id, &q->links[r * n], n, (int)ms);
        if (!rc)
            mask |= 1ull << r;
        else if (all || rc != KVB_ERR_NOT_FOUND)
            req_fail(q, rc == KVB_ERR_BUSY ? 409 : 500, "request %s, rank %u: cannot expect: %s",
                     q->id, r, kvb_strerror(rc));
    }
    return mask;
}

/* Adds a ticket for the request's blocks to the answer `ok`; NULL (and `ok` freed) when it
 * cannot. */
static json_t *with_ticket(pdreq_t *q, json_t *ok, const char *kind, uint64_t valid_ms)
{
    if (ok && json_object_set_new(ok, "ticket", ticket_json(q, kind, valid_ms))) {
        json_decref(ok);
        ok = NULL;
    }
    return ok;
}

/* Hands the request's entry to the reaper: as `kind`, the ranks in `mask` pending, until `ms`
 * from now (a reservation also keeps the prompt's tokens) - or, when the request failed or its
 * answer `ok` could not be built, drained (what the ranks expect is released). Returns `ok`, or
 * NULL with the request failed. */
static json_t *hand_over(pdreq_t *q, json_t *ok, int kind, uint64_t mask, uint32_t ms)
{
    kvb_pd_server_t *srv = q->srv;
    uint64_t deadline = kvb__deadline_ms(ms);
    pthread_mutex_lock(&srv->mu);
    if (q->status || !ok || kvb__srv_ent_set_segs(q->ent, q->segs, q->nsegs)) {
        kvb__srv_ent_drain(srv, q->ent, mask, deadline, true, 0); /* no writer was told */
        json_decref(ok);
        ok = NULL;
    } else {
        q->ent->kind = kind;
        if (kind == KVB__SRV_ENT_RESERVED) {
            q->ent->n_prompt = (uint32_t)q->ntoks;
            q->ent->toks = q->toks;
            q->toks = NULL;
        }
        q->ent->pending_mask = mask;
        q->ent->deadline_ns = deadline;
        pthread_cond_broadcast(&srv->cv);
    }
    pthread_mutex_unlock(&srv->mu);
    q->ent = NULL; /* the reaper's now */
    if (!q->status && !ok)
        req_fail(q, 500, "out of memory");
    return ok;
}

static json_t *prefill_answer(pdreq_t *q, uint64_t bytes, double secs)
{
    kvb_pd_server_t *srv = q->srv;
    return json_pack("{s:s,s:i,s:I,s:o*,s:o*,s:{s:I,s:f,s:f}}", "request_id", q->id, "t0",
                     (int)q->t0, "prompt_tokens", (json_int_t)q->ntoks, "blocks",
                     blocks_json(q->ent->seq.blocks, q->nb), "prefill_segments", segs_json(srv),
                     "kvbridge", "kv_bytes", (json_int_t)bytes, "kv_transfer_ms", secs * 1e3,
                     "prefill_ms", (double)(kvb__now_ns() - q->t_start) / 1e6);
}

/* Pull: the blocks stay under a lease until every routed decode rank has read them. */
static json_t *prefill_pull(pdreq_t *q)
{
    kvb_pd_server_t *srv = q->srv;
    if (reserve_prompt(q) || run_prompt(q, NULL))
        return NULL;
    uint32_t ms = srv->opts.lease_ms;
    uint64_t mask = expect_all(q, ms, false); /* a rank no decode rank reads from: skipped */
    json_t *ok = q->status ? NULL : with_ticket(q, prefill_answer(q, 0, 0.0), "lease", ms);
    return hand_over(q, ok, KVB__SRV_ENT_LEASE, mask, ms);
}

/* Push: each layer goes to the decode ranks as soon as it is computed. */
static json_t *prefill_push(pdreq_t *q)
{
    kvb_pd_server_t *srv = q->srv;
    if (q->nrblocks != q->nb) {
        req_fail(q, 400, "\"decode_blocks\" has %zu ids; the prompt needs %llu", q->nrblocks,
                 (unsigned long long)q->nb);
        return NULL;
    }
    kvb_kv_xfer_t **xs = calloc(srv->tp * q->nsegs, sizeof *xs);
    if (!xs)
        req_fail(q, 500, "out of memory");
    if (!xs || reserve_prompt(q)) {
        free(xs);
        return NULL;
    }
    int ms = grant_left_ms(q, "decode's reservation", "reservation_expired");
    if (!ms) {
        free(xs);
        return NULL;
    }
    uint64_t t0 = kvb__now_ns();
    push_hook_t h = {.q = q, .xs = xs};
    kvb_pd_hook_t hook = {.on_layer_done = on_layer, .user = &h};
    int failed = xfers_begin(q, KVB_OP_WRITE, q->ent->seq.blocks, q->rblocks, xs, ms);
    if (!failed)
        failed = run_prompt(q, &hook);
    if (!failed && h.rc)
        failed = req_fail(q, status_of(h.rc), "KV push to %s failed: %s", q->segs[0],
                          kvb_strerror(h.rc));
    /* Finished even after a failure: the notices tell the decode ranks not to wait. */
    failed = xfers_finish(q, xs, failed, false);
    free(xs);
    double secs = (double)(kvb__now_ns() - t0) / 1e9;
    uint64_t bytes = 0;
    for (size_t m = 0; m < q->nsegs; m++)
        bytes += kv_bytes(q->nb, slots_bytes(kvb_kv_link_layout(q->links[m])));
    if (failed)
        return NULL;
    kvb__srv_metric_kv(srv, bytes, secs);
    return prefill_answer(q, bytes, secs);
}

enum MHD_Result kvb__srv_prefill(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body)
{
    pdreq_t q;
    req_init(&q, srv);
    json_t *ok = NULL;
    if (srv->opts.role != KVB_PD_ROLE_PREFILL)
        return kvb__srv_http_fail(srv, conn, 404, "/pd/prefill is served by prefill instances");
    kvb__srv_metric_request(srv);
    if (!parse_common(&q, body) && !get_segs(&q, body, "decode_segments") &&
        (q.mode == KVB_PD_KV_PULL || (!get_blocks(&q, body, "decode_blocks") &&
                                      !check_ticket(&q, body, "decode_ticket", "reservation"))) &&
        !prepare(&q, true))
        ok = q.mode == KVB_PD_KV_PULL ? prefill_pull(&q) : prefill_push(&q);
    return req_answer(&q, conn, ok);
}

/* ---- /pd/reserve, /pd/abort (push, decode side) ------------------------------------------- */

static json_t *reserve(pdreq_t *q)
{
    kvb_pd_server_t *srv = q->srv;
    /* Every position the generation will need, now: blocks taken later could wait behind
     * requests that wait for this one's. */
    if (admit(q, q->ntoks + q->p.max_tokens - 1))
        return NULL;
    /* The reservation lasts until the request's deadline, counted from when it came, not from
     * when its blocks were free: a proxy that gave up waiting for this answer would otherwise
     * leave the blocks held for one more whole timeout. */
    int left = kvb__ms_left(req_deadline(q));
    uint32_t ms = left > 0 ? (uint32_t)left : 1;
    uint64_t mask = expect_all(q, ms, true);
    json_t *ok = q->status ? NULL
                           : with_ticket(q,
                                         json_pack("{s:s,s:o*,s:o*}", "request_id", q->id, "blocks",
                                                   blocks_json(q->ent->seq.blocks, q->nb),
                                                   "decode_segments", segs_json(srv)),
                                         "reservation", ms);
    return hand_over(q, ok, KVB__SRV_ENT_RESERVED, mask, ms);
}

enum MHD_Result kvb__srv_reserve(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body)
{
    pdreq_t q;
    req_init(&q, srv);
    json_t *ok = NULL;
    if (srv->opts.role != KVB_PD_ROLE_DECODE)
        return kvb__srv_http_fail(srv, conn, 404, "/pd/reserve is served by decode instances");
    if (!parse_common(&q, body) && !get_segs(&q, body, "prefill_segments") && !prepare(&q, true))
        ok = reserve(&q);
    return req_answer(&q, conn, ok);
}

enum MHD_Result kvb__srv_abort(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body)
{
    pdreq_t q;
    req_init(&q, srv);
    if (srv->opts.role != KVB_PD_ROLE_DECODE)
        return kvb__srv_http_fail(srv, conn, 404, "/pd/abort is served by decode instances");
    if (get_id(&q, body))
        return req_answer(&q, conn, NULL);
    pthread_mutex_lock(&srv->mu);
    kvb__srv_ent_t *e = kvb__srv_ent_find(srv, q.id);
    if (!e)
        req_fail(&q, 404, "no reservation for request %s", q.id);
    else if (e->kind == KVB__SRV_ENT_ACTIVE)
        req_fail(&q, 409, "request %s is being served", q.id);
    else if (e->kind == KVB__SRV_ENT_RESERVED) /* see docs/pd-protocol.md, /pd/abort */
        kvb__srv_ent_drain(srv, e, e->pending_mask, e->deadline_ns,
                           json_is_true(json_object_get(body, "writers_done")), 0);
    pthread_mutex_unlock(&srv->mu);
    return req_answer(&q, conn, json_pack("{s:s,s:b}", "request_id", q.id, "aborted", 1));
}

/* ---- /pd/decode ----------------------------------------------------------------------------- */

/* Generates from T0 over the KV now in the entry's blocks; the generation takes them over. */
static enum MHD_Result decode_generate(pdreq_t *q, struct MHD_Connection *conn, uint64_t bytes,
                                       double secs)
{
    kvb_pd_server_t *srv = q->srv;
    q->ent->seq.len = (uint32_t)q->ntoks;
    kvb__srv_gen_t *g = NULL;
    int rc = kvb__srv_gen_create(srv, q->id, &q->p, q->toks, q->ntoks, &q->ent->seq, true, q->t0,
                                 q->t_start, &g, &q->ref);
    q->toks = NULL; /* taken over, even on error */
    if (rc) {
        q->refused = true;
        req_fail(q, q->ref.status, "%s", q->ref.msg);
        return req_answer(q, conn, NULL);
    }
    kvb__srv_metric_kv(srv, bytes, secs);
    kvb__srv_gen_set_kv(g, bytes, secs);
    q->ent = NULL; /* the generation drops the entry when it ends */
    req_free(q);
    return kvb__srv_gen_respond(g, conn);
}

static uint64_t local_bytes(kvb_pd_server_t *srv, uint64_t nb)
{
    uint64_t s = 0;
    for (uint32_t r = 0; r < srv->tp; r++)
        s += kv_bytes(nb, srv->ranks[r].block_bytes);
    return s;
}

/* Tells every prefill rank the request reads from over a link without a transfer in xs (NULL:
 * every link) that it will read nothing: each frees its leased blocks now, not when the lease
 * ends - a decode that turns requests away would otherwise hold the prefill's pool for them. */
static void give_up_reads(pdreq_t *q, kvb_kv_xfer_t *const *xs)
{
    uint64_t until = kvb__deadline_ms(GIVE_UP_MS); /* for all of them: the answer waits */
    for (size_t i = 0; q->links && i < q->srv->tp * q->nsegs; i++) {
        uint64_t now = kvb__now_ns();
        if (now >= until)
            break; /* those not told free the blocks when the lease ends */
        if (q->links[i] && (!xs || !xs[i]) && kvb_kv_link_has_route(q->links[i]))
            kvb_kv_give_up(q->links[i], q->id, (int)((until - now + 999999) / 1000000));
    }
}

static enum MHD_Result decode_pull(pdreq_t *q, struct MHD_Connection *conn)
{
    kvb_pd_server_t *srv = q->srv;
    if (q->nrblocks != q->nb) {
        req_fail(q, 400, "\"prefill_blocks\" has %zu ids; the prompt needs %llu", q->nrblocks,
                 (unsigned long long)q->nb);
        give_up_reads(q, NULL);
        return req_answer(q, conn, NULL);
    }
    kvb_kv_xfer_t **xs = calloc(srv->tp * q->nsegs, sizeof *xs);
    int ms = 0;
    if (!xs)
        req_fail(q, 500, "out of memory");
    if (!xs || admit(q, q->ntoks + q->p.max_tokens - 1) ||
        !(ms = grant_left_ms(q, "prefill's lease", "lease_expired"))) {
        give_up_reads(q, xs);
        free(xs);
        return req_answer(q, conn, NULL);
    }
    uint64_t t0 = kvb__now_ns();
    int failed = xfers_begin(q, KVB_OP_READ, q->rblocks, q->ent->seq.blocks, xs, ms);
    for (size_t i = 0; !failed && i < srv->tp * q->nsegs; i++) {
        int rc = xs[i] ? kvb_kv_xfer_all(xs[i]) : KVB_OK;
        if (rc)
            failed = req_fail(q, 502, "KV pull from %s cannot start: %s", q->segs[i % q->nsegs],
                              kvb_strerror(rc));
    }
    if (failed)
        give_up_reads(q, xs); /* the links a transfer never began on (begun ones notify) */
    failed = xfers_finish(q, xs, failed, true);
    free(xs);
    if (failed)
        return req_answer(q, conn, NULL);
    return decode_generate(q, conn, local_bytes(srv, q->nb), (double)(kvb__now_ns() - t0) / 1e9);
}

/* Claims the reservation of q->id; fails when there is none or it is already in use. */
static int claim(pdreq_t *q)
{
    kvb_pd_server_t *srv = q->srv;
    pthread_mutex_lock(&srv->mu);
    kvb__srv_ent_t *e = kvb__srv_ent_find(srv, q->id);
    if (!e || e->kind == KVB__SRV_ENT_DRAIN)
        req_fail(q, 404, "no reservation for request %s (never made, expired or aborted)", q->id);
    else if (e->kind != KVB__SRV_ENT_RESERVED)
        req_fail(q, 409, "request %s is already being served", q->id);
    else
        e->kind = KVB__SRV_ENT_ACTIVE;
    pthread_mutex_unlock(&srv->mu);
    q->ent = q->status ? NULL : e;
    return q->status ? -1 : 0;
}

/* Waits for every rank's notices; on a failure the other ranks are left to the reaper, and the
 * blocks stay out of use while a prefill rank may still write into them: until every rank has
 * heard from its writers (each says so only once its bytes are in, or a second past its deadline),
 * and past the reservation's end when one never said (KVB__SRV_WRITE_SETTLE_MS). */
static int wait_pushed(pdreq_t *q)
{
    kvb_pd_server_t *srv = q->srv;
    kvb__srv_ent_t *e = q->ent;
    for (uint32_t r = 0; r < srv->tp; r++) {
        int rc = kvb_kv_wait(srv->ranks[r].agent, q->id, -1); /* until the reservation's end */
        if (!rc)
            continue;
        for (size_t m = 0; KVB_IS_PEER_ERROR(rc) && m < e->nsegs; m++)
            kvb__srv_links_drop(srv, e->segs[m]);
        /* Said before the drain, which may free the entry (and its segments). */
        req_fail(q, status_of(rc), "KV push for request %s from %s failed: %s%s", q->id,
                 e->nsegs ? e->segs[0] : "?", kvb_strerror(rc),
                 rc == KVB_ERR_PEER_LOST ? " (the prefill instance was lost)" : "");
        uint64_t rest = (srv->tp >= 64 ? ~0ull : (1ull << srv->tp) - 1) & ~((2ull << r) - 1);
        uint64_t hold = rc == KVB_ERR_TIMEOUT /* rank r's writers never said they finished */
                            ? e->deadline_ns + KVB__SRV_WRITE_SETTLE_MS * 1000000ull
                            : 0;
        pthread_mutex_lock(&srv->mu);
        kvb__srv_ent_drain(srv, e, rest, e->deadline_ns, false, hold);
        pthread_mutex_unlock(&srv->mu);
        q->ent = NULL;
        return -1;
    }
    return 0;
}

/* The body's prompt is the reserved one (byte tokens after the BOS). */
static bool same_prompt(const pdreq_t *q)
{
    for (size_t i = 0; i < q->p.prompt_len; i++)
        if (q->toks[i + 1] != (uint8_t)q->p.prompt[i])
            return false;
    return true;
}

static enum MHD_Result decode_push(pdreq_t *q, struct MHD_Connection *conn)
{
    uint64_t t0 = kvb__now_ns();
    if (claim(q) || wait_pushed(q))
        return req_answer(q, conn, NULL);
    q->toks = q->ent->toks; /* the reservation's prompt */
    q->ntoks = q->ent->n_prompt;
    q->ent->toks = NULL;
    if (q->p.prompt && (q->p.prompt_len + 1 != q->ntoks || !same_prompt(q))) {
        req_fail(q, 400, "the prompt differs from the reserved one");
        return req_answer(q, conn, NULL);
    }
    q->nb = kvb_pd_blocks_for(q->ntoks, q->srv->tpb);
    return decode_generate(q, conn, local_bytes(q->srv, q->nb), (double)(kvb__now_ns() - t0) / 1e9);
}

enum MHD_Result kvb__srv_decode(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body)
{
    pdreq_t q;
    req_init(&q, srv);
    if (srv->opts.role != KVB_PD_ROLE_DECODE)
        return kvb__srv_http_fail(srv, conn, 404, "/pd/decode is served by decode instances");
    kvb__srv_metric_request(srv);
    if (parse_common(&q, body) || get_t0(&q, body))
        return req_answer(&q, conn, NULL);
    if (q.mode == KVB_PD_KV_PUSH)
        return decode_push(&q, conn);
    if (get_segs(&q, body, "prefill_segments") || get_blocks(&q, body, "prefill_blocks") ||
        check_ticket(&q, body, "prefill_ticket", "lease") || prepare(&q, true))
        return req_answer(&q, conn, NULL);
    return decode_pull(&q, conn);
}

/* ---- /pd/info ------------------------------------------------------------------------------- */

enum MHD_Result kvb__srv_info(kvb_pd_server_t *srv, struct MHD_Connection *conn)
{
    return kvb__http_json(conn, 200,
                          json_pack("{s:s,s:s,s:i,s:s,s:i,s:o*}", "role",
                                    kvb_pd_role_name(srv->opts.role), "model",
                                    kvb_pd_model_id(srv->model), "tp", (int)srv->tp, "kv_mode",
                                    kvb_pd_kv_mode_name(srv->opts.kv_mode), "tokens_per_block",
                                    (int)srv->tpb, "segments", segs_json(srv)));
}
