/* SPDX-License-Identifier: Apache-2.0 */
/* KV transfers over the engine: agents (one per TP rank) that publish their layout, links checked
 * by the topology guard when opened, pull/push transfers planned once and started layer by layer,
 * and completion notices from every sending rank aggregated per request. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "engine/export.h"
#include "kv/aggregate.h"
#include "kv/internal.h"

#define NOTICE_TAG    "kvbkv1 "
#define PUMP_SLICE_MS 20
#define OTHER_MAX     256 /* foreign notifications kept for kvb_kv_agent_notify_recv */
#define AGG_ACTIVE    65536
#define AGG_FINISHED  65536

typedef struct {
    char id[KVB_AGG_ID_MAX + 1];
    uint32_t *links; /* link ids expected to report */
    size_t n;
} expect_t;

/* A notice that came before its kvb_kv_expect(): kept (bounded) and replayed then, so that the
 * order of expect and notice between two processes does not matter. It is kept by its sender's
 * engine, not by a link: which link it counts for is known only once the request names its
 * links (see credit()). */
typedef struct {
    char id[KVB_AGG_ID_MAX + 1];
    char from[KVB_NAME_MAX + 1];
    int status;
} early_t;

#define EARLY_MAX 1024
/* How long past its deadline kvb_kv_xfer_finish lets a failed transfer's bytes still under way
 * land before it tells the other side. */
#define SETTLE_MS 1000
/* A failure notice is best effort (the other side gives up when its grant ends anyway): it waits
 * for the peer at most this long after that, so a request's transfers to a stalled peer, finished
 * one after another, do not wait a whole timeout each. */
#define FAIL_NOTICE_MS 1000

struct kvb_kv_agent {
    kvb_engine_t *engine;
    kvb_kv_role_t role;
    kvb_kv_layout_t layout;
    kvb_kv_slot_t *slots;
    void **registered;
    size_t nregistered;

    pthread_mutex_t mu; /* everything below */
    pthread_cond_t cv;
    bool pumping; /* one waiter at a time reads the engine's notifications */
    /* Reads of the notifications begun (each takes the next number) and the highest number of
     * one that ended, having handled everything queued when it began. */
    uint64_t pump_started, pump_done;
    kvb_agg_t *agg;
    expect_t *expects;
    size_t nexpects, cap_expects;
    kvb_kv_link_t **links;
    size_t nlinks, cap_links;
    uint32_t next_link_id;
    kvb_notification_t *other;
    size_t other_head, other_count;
    early_t *early;
    size_t early_head, early_count;
};

struct kvb_kv_link {
    kvb_kv_agent_t *agent;
    uint32_t id;
    kvb_segment_t seg;
    char peer_name[KVB_NAME_MAX + 1]; /* the remote engine's own segment name: notices' `from` */
    kvb_kv_layout_t *remote;
    kvb_kv_verdict_t verdict;
    bool has_route;
    kvb_kv_route_t route;
    /* Its engine seen gone (kvb__segment_state), and a->pump_started then: the loss counts once
     * a read of the notifications that began after it has ended (check_senders). */
    bool lost_seen;
    uint64_t lost_ticket;
};

struct kvb_kv_xfer {
    kvb_kv_link_t *link;
    char id[KVB_AGG_ID_MAX + 1];
    int timeout_ms;
    uint64_t deadline_ns; /* begin + timeout_ms: every layer's batch ends by then */
    uint32_t nlayers;
    kvb_request_t **reqs; /* per layer */
    size_t *nreqs;
    bool *started;
    kvb_batch_t **batches; /* per layer, NULL until started */
    int failed;            /* the first layer that could not start: its error */
    bool finished;
};

/* ---- agent -------------------------------------------------------------------------------- */

static int copy_layout(kvb_kv_agent_t *a, const kvb_kv_layout_t *l)
{
    a->slots = calloc(l->num_slots, sizeof *a->slots);
    if (!a->slots)
        return KVB_ERR_NOMEM;
    memcpy(a->slots, l->slots, l->num_slots * sizeof *a->slots);
    a->layout = *l;
    a->layout.slots = a->slots;
    return KVB_OK;
}

/* Registers every slot buffer not already inside a registered region. */
static int register_buffers(kvb_kv_agent_t *a, char *reason, size_t cap)
{
    a->registered = calloc(a->layout.num_slots, sizeof *a->registered);
    if (!a->registered)
        return KVB_ERR_NOMEM;
    for (size_t i = 0; i < a->layout.num_slots; i++) {
        const kvb_kv_slot_t *s = &a->slots[i];
        if (kvb__engine_registered(a->engine, s->base, s->len))
            continue;
        int rc = kvb_register(a->engine, (void *)(uintptr_t)s->base, s->len, "cpu", KVB_ACCESS_RW);
        if (rc)
            return kvb__kv_slot_fail(reason, cap, rc, s, "cannot register its buffer: %s",
                                     kvb_strerror(rc));
        a->registered[a->nregistered++] = (void *)(uintptr_t)s->base;
    }
    return KVB_OK;
}

static const char *role_name(kvb_kv_role_t role)
{
    return role == KVB_KV_ROLE_PREFILL ? "prefill" : "decode";
}

/* The role first: a peer that sees the layout sees the role too. */
static int publish(kvb_kv_agent_t *a)
{
    const char *role = role_name(a->role);
    int rc = kvb_engine_set_attr(a->engine, KVB_KV_ROLE_ATTR, role, strlen(role));
    if (rc)
        return rc;
    size_t len;
    rc = kvb_kv_layout_encode(&a->layout, NULL, 0, &len);
    if (rc != KVB_ERR_TOO_LARGE && rc != KVB_OK)
        return rc;
    char *json = malloc(len + 1);
    if (!json)
        return KVB_ERR_NOMEM;
    rc = kvb_kv_layout_encode(&a->layout, json, len + 1, &len);
    if (rc == KVB_OK)
        rc = kvb_engine_set_attr(a->engine, KVB_KV_LAYOUT_ATTR, json, len);
    free(json);
    return rc;
}

int kvb_kv_agent_create(kvb_engine_t *engine, const kvb_kv_layout_t *layout, kvb_kv_role_t role,
                        kvb_kv_agent_t **out, char *reason, size_t cap)
{
    if (!engine || !layout || !out || (role != KVB_KV_ROLE_PREFILL && role != KVB_KV_ROLE_DECODE))
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "missing engine, layout or role");
    int rc = kvb_kv_layout_validate(layout, reason, cap);
    if (rc)
        return rc;
    kvb_kv_agent_t *a = calloc(1, sizeof *a);
    if (!a)
        return KVB_ERR_NOMEM;
    a->engine = engine;
    a->role = role;
    a->other = calloc(OTHER_MAX, sizeof *a->other);
    a->early = calloc(EARLY_MAX, sizeof *a->early);
    pthread_mutex_init(&a->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->cv, &ca);
    pthread_condattr_destroy(&ca);
    rc = a->other && a->early ? copy_layout(a, layout) : KVB_ERR_NOMEM;
    if (!rc)
        rc = kvb__agg_create(AGG_ACTIVE, AGG_FINISHED, &a->agg);
    if (!rc)
        rc = register_buffers(a, reason, cap);
    if (!rc && (rc = publish(a)))
        kvb__fail(reason, cap, rc, "cannot publish the layout: %s", kvb_strerror(rc));
    if (rc) {
        kvb_kv_agent_destroy(a);
        return rc;
    }
    kvb__reason_clear(reason, cap);
    *out = a;
    return KVB_OK;
}

void kvb_kv_agent_destroy(kvb_kv_agent_t *a)
{
    if (!a)
        return;
    kvb_engine_set_attr(a->engine, KVB_KV_LAYOUT_ATTR, NULL, 0);
    kvb_engine_set_attr(a->engine, KVB_KV_ROLE_ATTR, NULL, 0);
    for (size_t i = 0; i < a->nregistered; i++)
        kvb_unregister(a->engine, a->registered[i]);
    for (size_t i = 0; i < a->nexpects; i++)
        free(a->expects[i].links);
    free(a->expects);
    free(a->links);
    free(a->registered);
    free(a->slots);
    free(a->other);
    free(a->early);
    kvb__agg_destroy(a->agg);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    free(a);
}

/* ---- links -------------------------------------------------------------------------------- */

static const kvb_kv_layout_t *prefill_of(const kvb_kv_link_t *l)
{
    return l->agent->role == KVB_KV_ROLE_PREFILL ? &l->agent->layout : l->remote;
}

static const kvb_kv_layout_t *decode_of(const kvb_kv_link_t *l)
{
    return l->agent->role == KVB_KV_ROLE_DECODE ? &l->agent->layout : l->remote;
}

/* Finds the route between this link's prefill rank and decode rank, in the decode's dp group. */
static int find_route(kvb_kv_link_t *l)
{
    kvb_kv_topo_t pt, dt;
    const kvb_kv_layout_t *p = prefill_of(l), *d = decode_of(l);
    kvb__kv_topo_of(p, &pt);
    kvb__kv_topo_of(d, &dt);
    size_t n = 0;
    int rc = kvb_kv_route(&pt, &dt, d->dp_rank, NULL, 0, &n);
    kvb_kv_route_t *r = rc || !n ? NULL : calloc(n, sizeof *r);
    if (!rc && n && !r)
        return KVB_ERR_NOMEM;
    if (!rc && n)
        rc = kvb_kv_route(&pt, &dt, d->dp_rank, r, n, &n);
    for (size_t i = 0; !rc && i < n; i++)
        if (r[i].src_rank == p->tp_rank && r[i].dst_rank == d->tp_rank) {
            l->route = r[i];
            l->has_route = true;
        }
    free(r);
    return rc;
}

/* The remote's descriptor; refreshes the segment once if it was opened before it published. */
static int fetch_layout(kvb_kv_link_t *l, char *reason, size_t cap)
{
    kvb_engine_t *e = l->agent->engine;
    size_t len = 0;
    int rc = kvb_segment_attr(e, l->seg, KVB_KV_LAYOUT_ATTR, NULL, 0, &len);
    if (rc == KVB_ERR_NOT_FOUND && kvb_segment_refresh(e, l->seg) == KVB_OK)
        rc = kvb_segment_attr(e, l->seg, KVB_KV_LAYOUT_ATTR, NULL, 0, &len);
    if (rc)
        return kvb__fail(reason, cap, rc, "the peer publishes no KV layout: %s", kvb_strerror(rc));
    /* A refresh of the shared segment (another link, the application) may swap in a longer
     * descriptor between the two reads: the length the second read reports then exceeds the
     * buffer, and the buffer holds only its start - read again into one as long. */
    for (int tries = 0; tries < 4; tries++) {
        char *json = malloc(len ? len : 1);
        if (!json)
            return KVB_ERR_NOMEM;
        size_t got = 0;
        rc = kvb_segment_attr(e, l->seg, KVB_KV_LAYOUT_ATTR, json, len, &got);
        if (!rc && got <= len)
            rc = kvb_kv_layout_decode(json, got, &l->remote, reason, cap);
        free(json);
        if (rc || got <= len)
            return rc;
        len = got;
    }
    return kvb__fail(reason, cap, KVB_ERR_PROTOCOL,
                     "the peer's KV layout kept changing as it was read");
}

/* A link joins a prefill rank and a decode rank: a decode rank reads from, or is written by,
 * prefill ranks. Two ranks of one role would pass the guard (their layouts can match) and then
 * each take the other's blocks for its own side's. The layout is read first, and the role is
 * published before it, so a peer with a layout and no role is of a build from before roles were
 * published: taken at its word, with a warning, so that such peers still link while they are
 * upgraded. */
static int check_role(kvb_kv_link_t *l, char *reason, size_t cap)
{
    kvb_kv_role_t other =
        l->agent->role == KVB_KV_ROLE_PREFILL ? KVB_KV_ROLE_DECODE : KVB_KV_ROLE_PREFILL;
    const char *ours = role_name(l->agent->role), *theirs = role_name(other);
    char role[16];
    size_t len = 0;
    int rc = kvb_segment_attr(l->agent->engine, l->seg, KVB_KV_ROLE_ATTR, role, sizeof role, &len);
    if (rc == KVB_ERR_NOT_FOUND) {
        KVB_WARN("KV link to %s: the peer publishes no KV role (an older build); taking it for a "
                 "%s rank",
                 l->peer_name, theirs);
        return KVB_OK;
    }
    if (rc)
        return kvb__fail(reason, cap, rc, "cannot read the peer's KV role: %s", kvb_strerror(rc));
    if (len == strlen(theirs) && !memcmp(role, theirs, len))
        return KVB_OK;
    KVB_WARN("KV link to %s refused: the peer is not a %s rank", l->peer_name, theirs);
    if (len == strlen(ours) && !memcmp(role, ours, len))
        return kvb__fail(reason, cap, KVB_ERR_INCOMPATIBLE,
                         "both ends are %s ranks: a link joins a prefill rank and a decode rank",
                         ours);
    return kvb__fail(reason, cap, KVB_ERR_INCOMPATIBLE,
                     "the peer's KV role is neither prefill nor decode");
}

static int check_pair(kvb_kv_link_t *l, char *reason, size_t cap)
{
    kvb_kv_agent_t *a = l->agent;
    int rc = check_role(l, reason, cap);
    if (rc)
        return rc;
    l->verdict = kvb_kv_guard(&a->layout, l->remote, reason, cap);
    if (l->verdict != KVB_KV_ALLOW_HOMO && l->verdict != KVB_KV_ALLOW_HETERO) {
        KVB_WARN("KV link to %s refused: %s: %s", l->peer_name, kvb_kv_verdict_name(l->verdict),
                 reason ? reason : "");
        return KVB_ERR_INCOMPATIBLE;
    }
    return find_route(l);
}

static int add_link(kvb_kv_agent_t *a, kvb_kv_link_t *l)
{
    int rc = KVB_OK;
    pthread_mutex_lock(&a->mu);
    if (a->nlinks == a->cap_links) {
        size_t ncap = a->cap_links ? a->cap_links * 2 : 8;
        kvb_kv_link_t **n = realloc(a->links, ncap * sizeof *n);
        if (n) {
            a->links = n;
            a->cap_links = ncap;
        } else {
            rc = KVB_ERR_NOMEM;
        }
    }
    if (!rc) {
        l->id = ++a->next_link_id;
        a->links[a->nlinks++] = l;
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

int kvb_kv_link_open(kvb_kv_agent_t *a, const char *segment, kvb_kv_link_t **out, char *reason,
                     size_t cap)
{
    if (!a || !segment || !out)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "missing agent or segment");
    kvb_kv_link_t *l = calloc(1, sizeof *l);
    if (!l)
        return KVB_ERR_NOMEM;
    l->agent = a;
    int rc = kvb_segment_open(a->engine, segment, &l->seg);
    if (rc) {
        free(l);
        return kvb__fail(reason, cap, rc, "cannot open segment %s: %s", segment, kvb_strerror(rc));
    }
    kvb__segment_proven_name(a->engine, l->seg, l->peer_name, sizeof l->peer_name);
    rc = fetch_layout(l, reason, cap);
    if (!rc)
        rc = check_pair(l, reason, cap);
    if (!rc)
        rc = add_link(a, l);
    if (rc) {
        kvb_segment_close(a->engine, l->seg);
        kvb_kv_layout_free(l->remote);
        free(l);
        return rc;
    }
    kvb__reason_clear(reason, cap);
    *out = l;
    return KVB_OK;
}

void kvb_kv_link_close(kvb_kv_link_t *l)
{
    if (!l)
        return;
    kvb_kv_agent_t *a = l->agent;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->nlinks; i++)
        if (a->links[i] == l) {
            a->links[i] = a->links[--a->nlinks];
            break;
        }
    pthread_mutex_unlock(&a->mu);
    kvb_segment_close(a->engine, l->seg);
    kvb_kv_layout_free(l->remote);
    free(l);
}

kvb_kv_verdict_t kvb_kv_link_verdict(const kvb_kv_link_t *l)
{
    return l->verdict;
}

const kvb_kv_layout_t *kvb_kv_link_layout(const kvb_kv_link_t *l)
{
    return l->remote;
}

int kvb_kv_link_has_route(const kvb_kv_link_t *l)
{
    return l && l->has_route;
}

/* ---- transfers ---------------------------------------------------------------------------- */

static bool id_ok(const char *id)
{
    size_t n = id ? strlen(id) : 0;
    if (n == 0 || n > KVB_AGG_ID_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (id[i] < 0x21 || id[i] > 0x7e)
            return false;
    return true;
}

static int plan_layers(kvb_kv_xfer_t *x, kvb_opcode_t op, const uint64_t *src, const uint64_t *dst,
                       size_t n, char *reason, size_t cap)
{
    kvb_kv_link_t *l = x->link;
    kvb_kv_plan_args_t args = {.op = op,
                               .segment = l->seg,
                               .src_blocks = src,
                               .num_src = n,
                               .dst_blocks = dst,
                               .num_dst = n,
                               .route = &l->route};
    return kvb__kv_plan_layers(&l->agent->layout, l->remote, &args, x->reqs, x->nreqs, reason, cap);
}

int kvb_kv_xfer_begin(kvb_kv_link_t *l, const char *req_id, kvb_opcode_t op, const uint64_t *src,
                      const uint64_t *dst, size_t n, int timeout_ms, kvb_kv_xfer_t **out,
                      char *reason, size_t cap)
{
    if (!l || !out || !id_ok(req_id) || timeout_ms <= 0)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "bad link, request id or timeout");
    kvb_kv_role_t want = op == KVB_OP_READ ? KVB_KV_ROLE_DECODE : KVB_KV_ROLE_PREFILL;
    if (l->agent->role != want)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "%s is issued by the %s side",
                         op == KVB_OP_READ ? "pull" : "push",
                         want == KVB_KV_ROLE_DECODE ? "decode" : "prefill");
    if (!l->has_route)
        return kvb__fail(reason, cap, KVB_ERR_NOT_FOUND, "no route between these ranks");
    kvb_kv_xfer_t *x = calloc(1, sizeof *x);
    uint32_t L = l->agent->layout.num_layers;
    if (!x)
        return KVB_ERR_NOMEM;
    x->link = l;
    x->nlayers = L;
    x->timeout_ms = timeout_ms;
    x->deadline_ns = kvb__deadline_ms((uint32_t)timeout_ms);
    strcpy(x->id, req_id);
    x->reqs = calloc(L, sizeof *x->reqs);
    x->nreqs = calloc(L, sizeof *x->nreqs);
    x->started = calloc(L, sizeof *x->started);
    x->batches = calloc(L, sizeof *x->batches);
    int rc = x->reqs && x->nreqs && x->started && x->batches ? KVB_OK : KVB_ERR_NOMEM;
    if (!rc)
        rc = plan_layers(x, op, src, dst, n, reason, cap);
    if (rc) {
        kvb_kv_xfer_free(x);
        return rc;
    }
    kvb__reason_clear(reason, cap);
    *out = x;
    return KVB_OK;
}

int kvb_kv_xfer_layer(kvb_kv_xfer_t *x, uint32_t layer)
{
    if (!x || layer >= x->nlayers || x->started[layer] || x->finished)
        return KVB_ERR_INVALID_ARG;
    x->started[layer] = true;
    if (x->nreqs[layer] == 0)
        return KVB_OK;
    /* The time left of the transfer's, not a fresh timeout: a layer started late (a long
     * prompt's last) must still end when the caller's grant of the blocks does. */
    uint64_t now = kvb__now_ns();
    int rc = KVB_ERR_TIMEOUT;
    if (now < x->deadline_ns) {
        kvb_batch_opts_t o = {.timeout_ms = (uint32_t)((x->deadline_ns - now + 999999) / 1000000)};
        rc = kvb_batch_submit(x->link->agent->engine, x->reqs[layer], x->nreqs[layer], &o,
                              &x->batches[layer]);
    }
    if (rc && !x->failed)
        x->failed = rc; /* finish reports it: the other side must not hear "done" */
    return rc;
}

int kvb_kv_xfer_all(kvb_kv_xfer_t *x)
{
    if (!x || x->finished)
        return KVB_ERR_INVALID_ARG;
    for (uint32_t layer = 0; layer < x->nlayers; layer++) {
        if (x->started[layer])
            continue;
        int rc = kvb_kv_xfer_layer(x, layer);
        if (rc)
            return rc;
    }
    return KVB_OK;
}

/* Tells the other side of `l` how request `id` ended there (its kvb_kv_wait returns `rc`). */
static int notice(kvb_kv_link_t *l, const char *id, int rc, int timeout_ms)
{
    char msg[32 + KVB_AGG_ID_MAX];
    int len = snprintf(msg, sizeof msg, NOTICE_TAG "%d %s", rc, id);
    int nrc = kvb_notify_send(l->agent->engine, l->seg, msg, (size_t)len, timeout_ms);
    if (nrc)
        KVB_WARN("request %s: cannot notify %s: %s", id, l->peer_name, kvb_strerror(nrc));
    return nrc;
}

int kvb_kv_xfer_settle(kvb_kv_xfer_t *x, int timeout_ms)
{
    if (!x || timeout_ms < 0)
        return KVB_ERR_INVALID_ARG;
    uint64_t until = kvb__deadline_ms(timeout_ms);
    for (uint32_t layer = 0; layer < x->nlayers; layer++) {
        if (!x->batches[layer])
            continue;
        int rc = kvb_batch_settle(x->batches[layer], (int)kvb__ms_left(until));
        if (rc)
            return rc;
    }
    return KVB_OK;
}

int kvb_kv_xfer_finish(kvb_kv_xfer_t *x)
{
    if (!x || x->finished)
        return KVB_ERR_INVALID_ARG;
    x->finished = true;
    int rc = x->failed;
    for (uint32_t layer = 0; layer < x->nlayers; layer++) {
        if (!x->started[layer] && rc == KVB_OK)
            rc = KVB_ERR_INVALID_ARG; /* a layer never started: the receiver must not see "done" */
        if (x->batches[layer]) {
            int brc = kvb_batch_wait(x->batches[layer], -1);
            if (rc == KVB_OK)
                rc = brc;
        }
    }
    /* A failed transfer may still have bytes under way (a copy a peer began, an answer not yet
     * in): the other side hears of the failure only once they are done, or after a while - it
     * frees its blocks when it hears (see kvb_kv_xfer_settle). */
    int notice_ms = x->timeout_ms;
    if (rc) { /* until SETTLE_MS past the deadline: a request's transfers, finished one after
               * another, share the wait */
        uint64_t until = x->deadline_ns + (uint64_t)SETTLE_MS * 1000000ull;
        (void)kvb_kv_xfer_settle(x, kvb__ms_left(until));
        int left = kvb__ms_left(until + (uint64_t)FAIL_NOTICE_MS * 1000000ull);
        notice_ms = left < 1 ? 1 : left < notice_ms ? left : notice_ms;
    }
    /* Every byte is in place (or the transfer failed): say so to the other side. */
    int nrc = notice(x->link, x->id, rc, notice_ms);
    return rc ? rc : nrc;
}

int kvb_kv_give_up(kvb_kv_link_t *l, const char *req_id, int timeout_ms)
{
    if (!l || !id_ok(req_id) || timeout_ms <= 0)
        return KVB_ERR_INVALID_ARG;
    if (!l->has_route)
        return KVB_ERR_NOT_FOUND;
    return notice(l, req_id, KVB_ERR_CANCELED, timeout_ms);
}

void kvb_kv_xfer_free(kvb_kv_xfer_t *x)
{
    if (!x)
        return;
    for (uint32_t layer = 0; layer < x->nlayers; layer++) {
        if (x->reqs)
            kvb_kv_plan_free(x->reqs[layer]);
        if (x->batches)
            kvb_batch_free(x->batches[layer]);
    }
    free(x->reqs);
    free(x->nreqs);
    free(x->started);
    free(x->batches);
    free(x);
}

/* ---- completion: notices from every sending rank ------------------------------------------- */

static kvb_kv_link_t *link_by_id(kvb_kv_agent_t *a, uint32_t id)
{
    for (size_t i = 0; i < a->nlinks; i++)
        if (a->links[i]->id == id)
            return a->links[i];
    return NULL;
}

static expect_t *find_expect(kvb_kv_agent_t *a, const char *id)
{
    for (size_t i = 0; i < a->nexpects; i++)
        if (!strcmp(a->expects[i].id, id))
            return &a->expects[i];
    return NULL;
}

/* Counts a notice that engine `from` sent for request `id` for the first of this agent's links to
 * that engine which the request expects and which has not reported yet. A notice names the
 * sending engine, not a link, and two links can lead to one engine (one still open from before
 * that engine reconnected, say): counting it for the first link of that name lost it whenever
 * the request expected another, and the request timed out with every byte in place. Sets
 * *linked to whether any link leads to `from`. Returns KVB_AGG_COUNTED or KVB_AGG_LATE (the
 * request ended) as kvb__agg_add() says; KVB_ERR_NOT_FOUND while `id` is not expected (yet);
 * KVB_AGG_DUPLICATE if every expected link to `from` has reported; KVB_ERR_INVALID_ARG if the
 * request expects no link to `from`. Caller holds a->mu. */
static int credit(kvb_kv_agent_t *a, const char *id, const char *from, int status, bool *linked)
{
    bool dup = false;
    *linked = false;
    for (size_t i = 0; i < a->nlinks; i++) {
        if (strcmp(a->links[i]->peer_name, from) != 0)
            continue;
        *linked = true;
        int rc = kvb__agg_add(a->agg, id, a->links[i]->id, status, kvb__now_ns());
        if (rc == KVB_AGG_DUPLICATE)
            dup = true;
        else if (rc != KVB_ERR_INVALID_ARG)
            return rc; /* counted, late, or an id not expected: the same for every link */
    }
    return dup ? KVB_AGG_DUPLICATE : KVB_ERR_INVALID_ARG;
}

static void drop_expect(kvb_kv_agent_t *a, const char *id)
{
    expect_t *x = find_expect(a, id);
    if (!x)
        return;
    free(x->links);
    *x = a->expects[--a->nexpects];
}

int kvb_kv_expect(kvb_kv_agent_t *a, const char *req_id, kvb_kv_link_t *const *links, size_t n,
                  int timeout_ms)
{
    if (!a || !id_ok(req_id) || (n && !links) || timeout_ms <= 0)
        return KVB_ERR_INVALID_ARG;
    uint32_t *ids = calloc(n ? n : 1, sizeof *ids);
    if (!ids)
        return KVB_ERR_NOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (links[i] && links[i]->agent == a && links[i]->has_route)
            ids[k++] = links[i]->id;
    int rc = k ? KVB_OK : KVB_ERR_NOT_FOUND;
    pthread_mutex_lock(&a->mu);
    if (!rc && a->nexpects == a->cap_expects) {
        size_t ncap = a->cap_expects ? a->cap_expects * 2 : 16;
        expect_t *ne = realloc(a->expects, ncap * sizeof *ne);
        rc = ne ? KVB_OK : KVB_ERR_NOMEM;
        if (ne) {
            a->expects = ne;
            a->cap_expects = ncap;
        }
    }
    if (!rc)
        rc = kvb__agg_expect(a->agg, req_id, ids, k, kvb__deadline_ms(timeout_ms));
    if (!rc) {
        expect_t *x = &a->expects[a->nexpects++];
        snprintf(x->id, sizeof x->id, "%s", req_id);
        x->links = ids;
        x->n = k;
        ids = NULL;
        for (size_t i = 0; i < a->early_count; i++) {
            early_t *e = &a->early[(a->early_head + i) % EARLY_MAX];
            if (!strcmp(e->id, req_id)) {
                bool linked;
                credit(a, e->id, e->from, e->status, &linked);
                e->id[0] = '\0'; /* consumed */
            }
        }
    }
    pthread_mutex_unlock(&a->mu);
    free(ids);
    return rc;
}

static void keep_early(kvb_kv_agent_t *a, const char *id, const char *from, int status)
{
    if (a->early_count == EARLY_MAX) { /* forget the oldest */
        a->early_head = (a->early_head + 1) % EARLY_MAX;
        a->early_count--;
    }
    early_t *e = &a->early[(a->early_head + a->early_count++) % EARLY_MAX];
    snprintf(e->id, sizeof e->id, "%s", id);
    snprintf(e->from, sizeof e->from, "%s", from);
    e->status = status;
}

/* One received notification: a notice for the aggregator, or someone else's message. Caller
 * holds a->mu. */
static void handle_notification(kvb_kv_agent_t *a, const kvb_notification_t *n)
{
    size_t tl = strlen(NOTICE_TAG);
    if (n->len <= tl || memcmp(n->data, NOTICE_TAG, tl) != 0) {
        if (a->other_count == OTHER_MAX) {
            KVB_WARN("dropping a notification from %s: %d unread ones queued", n->from, OTHER_MAX);
            a->other_head = (a->other_head + 1) % OTHER_MAX;
            a->other_count--;
        }
        a->other[(a->other_head + a->other_count++) % OTHER_MAX] = *n;
        return;
    }
    char buf[64 + KVB_AGG_ID_MAX], id[KVB_AGG_ID_MAX + 1];
    size_t l = n->len < sizeof buf - 1 ? n->len : sizeof buf - 1;
    memcpy(buf, n->data, l);
    buf[l] = '\0';
    int status;
    if (sscanf(buf + tl, "%d %255s", &status, id) != 2 || status > 0) {
        KVB_WARN("malformed KV notice from %s", n->from);
        return;
    }
    bool linked;
    int rc = credit(a, id, n->from, status, &linked);
    if (!linked)
        KVB_WARN("KV notice for %s from %s, which is not linked here", id, n->from);
    else if (rc == KVB_ERR_NOT_FOUND)
        keep_early(a, id, n->from, status);
    else if (rc == KVB_ERR_INVALID_ARG)
        KVB_WARN("KV notice for %s from %s: the request expects none from it", id, n->from);
}

/* Fails the expected ranks of `id` whose engines are gone - but only once every notice they
 * sent before going has been handled: a peer that finishes a transfer and exits at once has its
 * notice queued here before its loss shows, and its transfer must not fail. So a loss counts once
 * a read of the notifications that began after the loss was first seen has ended (it read all
 * that was queued); a rank that reported by then makes it a duplicate, ignored. Caller holds
 * a->mu. */
static void check_senders(kvb_kv_agent_t *a, const char *id)
{
    expect_t *x = find_expect(a, id);
    for (size_t i = 0; x && i < x->n; i++) {
        kvb_kv_link_t *l = link_by_id(a, x->links[i]);
        if (l && !kvb__segment_state(a->engine, l->seg)) {
            l->lost_seen = false; /* there (again: a peer reconnected in place) */
            continue;
        }
        if (l && !l->lost_seen) {
            l->lost_seen = true;
            l->lost_ticket = a->pump_started;
        }
        if (!l || a->pump_done > l->lost_ticket)
            kvb__agg_add(a->agg, id, x->links[i], KVB_ERR_PEER_LOST, kvb__now_ns());
    }
}

/* Reads the notifications that come within `ms` (0: those already queued) without a->mu held, if
 * nobody else is reading; else sleeps a slice (0: returns). */
static void pump_once(kvb_kv_agent_t *a, int ms)
{
    if (a->pumping) {
        struct timespec ts = kvb__timespec_of(kvb__now_ns() + PUMP_SLICE_MS * 1000000ull);
        if (ms)
            pthread_cond_timedwait(&a->cv, &a->mu, &ts);
        return;
    }
    a->pumping = true;
    uint64_t ticket = ++a->pump_started;
    pthread_mutex_unlock(&a->mu);
    kvb_notification_t *n = malloc(sizeof *n);
    int rc = n ? kvb_notify_recv(a->engine, n, ms) : KVB_ERR_NOMEM;
    pthread_mutex_lock(&a->mu);
    /* Still the one reader while draining what is queued: a second one could take a notice
     * this one has not handled yet, end, and let a waiter count its sender's loss first. */
    while (rc == KVB_OK) {
        handle_notification(a, n);
        pthread_mutex_unlock(&a->mu);
        rc = kvb_notify_recv(a->engine, n, 0);
        pthread_mutex_lock(&a->mu);
    }
    a->pumping = false;
    free(n);
    if (rc != KVB_ERR_NOMEM && ticket > a->pump_done)
        a->pump_done = ticket; /* what was queued when it began is handled */
    pthread_cond_broadcast(&a->cv);
}

int kvb_kv_wait(kvb_kv_agent_t *a, const char *req_id, int timeout_ms)
{
    if (!a || !id_ok(req_id))
        return KVB_ERR_INVALID_ARG;
    uint64_t until = kvb__deadline_ms(timeout_ms);
    int rc;
    pthread_mutex_lock(&a->mu);
    for (bool first = true;; first = false) {
        /* Losses first seen now count after a read that begins after them (check_senders). On
         * the first pass, what is queued is read at once, unless another thread is reading (its
         * end wakes us) - also with timeout 0, so that a caller that polls sees the notices come
         * in; later passes follow a read of their own or another's. */
        check_senders(a, req_id);
        if (first && !a->pumping) {
            pump_once(a, 0);
            check_senders(a, req_id);
        }
        int err = KVB_OK, st = kvb__agg_poll(a->agg, req_id, kvb__now_ns(), &err);
        if (st < 0) {
            rc = st;
            break;
        }
        if (st != KVB_AGG_PENDING) {
            rc = st == KVB_AGG_DONE ? KVB_OK : err ? err : KVB_ERR_TIMEOUT;
            kvb__agg_release(a->agg, req_id);
            drop_expect(a, req_id);
            break;
        }
        if (kvb__now_ns() >= until) {
            rc = KVB_ERR_AGAIN;
            break;
        }
        pump_once(a, PUMP_SLICE_MS);
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

int kvb_kv_agent_notify_recv(kvb_kv_agent_t *a, kvb_notification_t *out, int timeout_ms)
{
    if (!a || !out)
        return KVB_ERR_INVALID_ARG;
    uint64_t until = kvb__deadline_ms(timeout_ms);
    int rc = KVB_ERR_AGAIN;
    pthread_mutex_lock(&a->mu);
    for (bool drained = false;; drained = true) {
        if (!drained)
            pump_once(a, 0); /* what is queued already, timeout 0 too */
        if (a->other_count) {
            *out = a->other[a->other_head];
            a->other_head = (a->other_head + 1) % OTHER_MAX;
            a->other_count--;
            rc = KVB_OK;
            break;
        }
        if (kvb__now_ns() >= until) {
            rc = timeout_ms == 0 ? KVB_ERR_AGAIN : KVB_ERR_TIMEOUT;
            break;
        }
        pump_once(a, PUMP_SLICE_MS);
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}
