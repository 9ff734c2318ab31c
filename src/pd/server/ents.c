/* SPDX-License-Identifier: Apache-2.0 */
/* The ids an instance holds (requests in progress, pull leases, push reservations) and the reaper
 * thread that frees a lease's blocks once every routed decode rank confirmed its reads (or the
 * lease expired), expires reservations, and releases the agents' expectations of aborted ones. */
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/server/internal.h"

/* One kvb_kv_wait of the reaper is short, so that one slow id delays no other. */
#define WAIT_SLICE_MS 10
#define IDLE_MS       100 /* sleep when there is nothing to wait for */
#define JOBS_MAX      64  /* ids served per pass */

int kvb__srv_ent_add(kvb_pd_server_t *srv, const char *id, kvb__srv_ent_t **out)
{
    kvb__srv_ent_t *e = calloc(1, sizeof *e);
    if (!e)
        return KVB_ERR_NOMEM;
    snprintf(e->id, sizeof e->id, "%s", id);
    e->kind = KVB__SRV_ENT_ACTIVE;
    kvb_pd_seq_init(&e->seq);
    pthread_mutex_lock(&srv->mu);
    int rc = kvb__srv_ent_find(srv, id) ? KVB_ERR_BUSY : KVB_OK;
    if (!rc) {
        e->next = srv->ents;
        srv->ents = e;
    }
    pthread_mutex_unlock(&srv->mu);
    if (rc) {
        free(e);
        return rc;
    }
    if (out)
        *out = e;
    return KVB_OK;
}

kvb__srv_ent_t *kvb__srv_ent_find(kvb_pd_server_t *srv, const char *id)
{
    for (kvb__srv_ent_t *e = srv->ents; e; e = e->next)
        if (!strcmp(e->id, id))
            return e;
    return NULL;
}

void kvb__srv_ent_remove(kvb_pd_server_t *srv, kvb__srv_ent_t *e)
{
    for (kvb__srv_ent_t **p = &srv->ents; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    kvb_pd_seq_release(&e->seq, srv->pool);
    kvb__srv_admit_wake(srv);
    for (size_t i = 0; i < e->nxfers; i++) /* settled, or the server stops */
        kvb_kv_xfer_free(e->xfers[i]);
    free(e->xfers);
    free(e->toks);
    free(e->segs);
    free(e);
}

void kvb__srv_ent_done(kvb_pd_server_t *srv, const char *id)
{
    pthread_mutex_lock(&srv->mu);
    kvb__srv_ent_t *e = kvb__srv_ent_find(srv, id);
    if (e && e->kind == KVB__SRV_ENT_ACTIVE)
        kvb__srv_ent_remove(srv, e);
    pthread_mutex_unlock(&srv->mu);
}

void kvb__srv_ent_settle(kvb_pd_server_t *srv, kvb__srv_ent_t *e, kvb_kv_xfer_t **xs, size_t n)
{
    if (!e) { /* no blocks to keep (never taken): nothing else to wait for */
        for (size_t i = 0; i < n; i++)
            kvb_kv_xfer_free(xs[i]);
        free(xs);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    KVB_WARN("request %s: %zu failed transfer(s) may still place bytes; keeping its %zu blocks "
             "out of use until they cannot",
             e->id, n, e->seq.num_blocks);
    e->kind = KVB__SRV_ENT_SETTLE;
    e->xfers = xs;
    e->nxfers = n;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

int kvb__srv_ent_set_segs(kvb__srv_ent_t *e, char *const *segs, size_t n)
{
    e->segs = calloc(n ? n : 1, sizeof *e->segs);
    if (!e->segs)
        return KVB_ERR_NOMEM;
    for (size_t i = 0; i < n; i++)
        snprintf(e->segs[i], sizeof e->segs[i], "%s", segs[i]);
    e->nsegs = n;
    return KVB_OK;
}

void kvb__srv_ent_drain(kvb_pd_server_t *srv, kvb__srv_ent_t *e, uint64_t mask, uint64_t deadline,
                        bool writers_done, uint64_t hold_until)
{
    if (!mask && (writers_done || !hold_until)) {
        kvb__srv_ent_remove(srv, e);
        return;
    }
    if (writers_done) {
        kvb_pd_seq_release(&e->seq, srv->pool);
        kvb__srv_admit_wake(srv);
    }
    e->kind = KVB__SRV_ENT_DRAIN;
    e->pending_mask = mask;
    e->deadline_ns = deadline;
    e->hold_until_ns = writers_done ? 0 : hold_until;
    pthread_cond_broadcast(&srv->cv);
}

/* A drained reservation's blocks, held while a pushing prefill may still write into them. */
static void hold_blocks(kvb__srv_ent_t *e, uint64_t until)
{
    if (e->seq.num_blocks && e->hold_until_ns < until)
        e->hold_until_ns = until;
}

/* ---- the reaper -------------------------------------------------------------------------------
 */

typedef struct {
    kvb__srv_ent_t *e; /* LEASE and DRAIN entries are removed by the reaper only: stable */
    char id[KVB__SRV_REQ_ID_MAX + 1];
    uint64_t mask;
} job_t;

/* Expires reservations, and lists the ids to wait for. Caller holds srv->mu. */
static size_t collect(kvb_pd_server_t *srv, job_t *jobs)
{
    uint64_t now = kvb__now_ns();
    size_t n = 0;
    for (kvb__srv_ent_t *e = srv->ents; e; e = e->next) {
        if (e->kind == KVB__SRV_ENT_RESERVED && now >= e->deadline_ns) {
            /* A prefill told of it may still be writing (its decode call never came): the
             * blocks go back once that cannot be any more. */
            KVB_WARN("reservation of request %s expired unused; its blocks are free in %d ms",
                     e->id, KVB__SRV_WRITE_SETTLE_MS);
            e->kind = KVB__SRV_ENT_DRAIN;
            hold_blocks(e, e->deadline_ns + KVB__SRV_WRITE_SETTLE_MS * 1000000ull);
        }
        bool waits = e->kind == KVB__SRV_ENT_LEASE || e->kind == KVB__SRV_ENT_DRAIN;
        if (waits && e->pending_mask && n < JOBS_MAX) {
            jobs[n].e = e;
            jobs[n].mask = e->pending_mask;
            memcpy(jobs[n].id, e->id, sizeof jobs[n].id);
            n++;
        }
    }
    return n;
}

/* One rank of a lease or drain has its answer: log what a lease ended with. */
static void rank_done(kvb_pd_server_t *srv, job_t *j, uint32_t r, int rc)
{
    bool lease = j->e->kind == KVB__SRV_ENT_LEASE;
    if (lease && rc == KVB_ERR_TIMEOUT)
        KVB_WARN("lease of request %s expired after %u ms (rank %u): freeing its blocks", j->id,
                 srv->opts.lease_ms, r);
    else if (lease && rc)
        KVB_WARN("request %s, rank %u: decode side reported %s; freeing its blocks", j->id, r,
                 kvb_strerror(rc));
    if (KVB_IS_PEER_ERROR(rc))
        for (size_t i = 0; i < j->e->nsegs; i++)
            kvb__srv_links_drop(srv, j->e->segs[i]);
    pthread_mutex_lock(&srv->mu);
    j->e->pending_mask &= ~(1ull << r);
    if (!lease && rc == KVB_ERR_TIMEOUT) /* its writers never said they finished */
        hold_blocks(j->e, j->e->deadline_ns + KVB__SRV_WRITE_SETTLE_MS * 1000000ull);
    pthread_mutex_unlock(&srv->mu);
}

static void run_job(kvb_pd_server_t *srv, job_t *j)
{
    for (uint32_t r = 0; r < srv->tp; r++) {
        if (!(j->mask & (1ull << r)))
            continue;
        int rc = kvb_kv_wait(srv->ranks[r].agent, j->id, WAIT_SLICE_MS);
        if (rc != KVB_ERR_AGAIN)
            rank_done(srv, j, r, rc);
    }
}

/* Whether every transfer of a SETTLE entry has settled (polls). Caller holds srv->mu. */
static bool settled(const kvb__srv_ent_t *e)
{
    for (size_t i = 0; i < e->nxfers; i++)
        if (kvb_kv_xfer_settle(e->xfers[i], 0) != KVB_OK)
            return false;
    return true;
}

/* Frees the entries whose every rank has answered, and the blocks of failed transfers that have
 * settled. Caller holds srv->mu. */
static void sweep(kvb_pd_server_t *srv)
{
    kvb__srv_ent_t *e = srv->ents, *next;
    for (; e; e = next) {
        next = e->next;
        bool waits = e->kind == KVB__SRV_ENT_LEASE || e->kind == KVB__SRV_ENT_DRAIN;
        bool held = e->kind == KVB__SRV_ENT_DRAIN && kvb__now_ns() < e->hold_until_ns;
        if ((waits && !e->pending_mask && !held) ||
            (e->kind == KVB__SRV_ENT_SETTLE && settled(e))) {
            if (e->kind == KVB__SRV_ENT_SETTLE)
                KVB_INFO("request %s: its failed transfers have settled; %zu blocks free again",
                         e->id, e->seq.num_blocks);
            kvb__srv_ent_remove(srv, e);
        }
    }
}

void *kvb__srv_reaper_main(void *arg)
{
    kvb_pd_server_t *srv = arg;
    job_t *jobs = calloc(JOBS_MAX, sizeof *jobs);
    pthread_mutex_lock(&srv->mu);
    while (!srv->stop) {
        size_t n = jobs ? collect(srv, jobs) : 0;
        if (!n) {
            sweep(srv); /* SETTLE entries, polled once an idle pass */
            struct timespec ts = kvb__timespec_of(kvb__now_ns() + IDLE_MS * 1000000ull);
            pthread_cond_timedwait(&srv->cv, &srv->mu, &ts);
            continue;
        }
        pthread_mutex_unlock(&srv->mu);
        for (size_t i = 0; i < n; i++)
            run_job(srv, &jobs[i]);
        pthread_mutex_lock(&srv->mu);
        sweep(srv);
    }
    pthread_mutex_unlock(&srv->mu);
    free(jobs);
    return NULL;
}

void kvb__srv_ents_clear(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    while (srv->ents)
        kvb__srv_ent_remove(srv, srv->ents);
    pthread_mutex_unlock(&srv->mu);
}

void kvb__srv_ents_count(kvb_pd_server_t *srv, uint64_t counts[KVB__SRV_ENT_KINDS])
{
    memset(counts, 0, KVB__SRV_ENT_KINDS * sizeof *counts);
    pthread_mutex_lock(&srv->mu);
    for (kvb__srv_ent_t *e = srv->ents; e; e = e->next)
        counts[e->kind < KVB__SRV_ENT_KINDS ? e->kind : 0]++;
    pthread_mutex_unlock(&srv->mu);
}
