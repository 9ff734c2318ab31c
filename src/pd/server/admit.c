/* SPDX-License-Identifier: Apache-2.0 */
/* Admission: a request whose KV blocks are not free yet waits for them in a bounded FIFO queue
 * instead of being turned away; it is refused (503, Retry-After) only when the queue is full or
 * its deadline passes, and at once (400) when it needs more blocks than the instance has. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"
#include "pd/server/internal.h"

/* A waiter lives on its request thread's stack while it is queued. Only the head of the queue
 * tries to take blocks: a small request never overtakes a large one that waits longer (FIFO). */
struct kvb__srv_waiter {
    struct kvb__srv_waiter *next;
    uint64_t since_ns;
};

/* Even a missed wakeup costs at most this much: blocks freed outside srv->mu (a pool is shared
 * with code that does not know the queue) are noticed on the next slice. */
#define SLICE_MS 50u

void kvb__srv_admit_wake(kvb_pd_server_t *srv)
{
    if (srv->q_len)
        pthread_cond_broadcast(&srv->adm_cv);
}

void kvb__srv_admit_wake_locked(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    kvb__srv_admit_wake(srv);
    pthread_mutex_unlock(&srv->mu);
}

void kvb__srv_admit_stop(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    srv->adm_stop = true;
    pthread_cond_broadcast(&srv->adm_cv);
    pthread_mutex_unlock(&srv->mu);
}

static int refuse(kvb__srv_refusal_t *ref, unsigned status, const char *reason, unsigned retry,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int refuse(kvb__srv_refusal_t *ref, unsigned status, const char *reason, unsigned retry,
                  const char *fmt, ...)
{
    ref->status = status;
    ref->reason = reason;
    ref->retry_after_s = retry;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ref->msg, sizeof ref->msg, fmt, ap);
    va_end(ap);
    return status == 400 ? KVB_ERR_TOO_LARGE : KVB_ERR_BUSY;
}

static void dequeue(kvb_pd_server_t *srv, struct kvb__srv_waiter *w)
{
    for (struct kvb__srv_waiter **p = &srv->q_head; *p; p = &(*p)->next)
        if (*p == w) {
            *p = w->next;
            break;
        }
    if (srv->q_tail == w) {
        srv->q_tail = srv->q_head;
        while (srv->q_tail && srv->q_tail->next)
            srv->q_tail = srv->q_tail->next;
    }
    srv->q_len--;
    /* The next head may fit where this one did not (or this one left blocks behind). */
    pthread_cond_broadcast(&srv->adm_cv);
}

/* Caller holds srv->mu. */
static void account(kvb_pd_server_t *srv, uint64_t since, bool admitted, const char *why)
{
    double s = (double)(kvb__now_ns() - since) / 1e9;
    if (admitted) {
        srv->m_admitted++;
        kvb__srv_hist_add(&srv->m_wait, s);
    } else if (!strcmp(why, "queue_full")) {
        srv->m_rej_full++;
    } else {
        srv->m_rej_deadline++;
    }
}

int kvb__srv_admit(kvb_pd_server_t *srv, kvb_pd_seq_t *seq, uint64_t tokens, uint64_t deadline_ns,
                   kvb__srv_refusal_t *ref)
{
    uint64_t need = kvb_pd_blocks_for(tokens, srv->tpb);
    if (need <= seq->num_blocks) /* reserved already (a decode's blocks, taken on arrival) */
        return KVB_OK;
    if (need > srv->total_blocks)
        return refuse(ref, 400, "too_large", 0,
                      "%llu tokens need %llu KV blocks; this instance has %llu in all, so the "
                      "request can never be admitted",
                      (unsigned long long)tokens, (unsigned long long)need,
                      (unsigned long long)srv->total_blocks);
    struct kvb__srv_waiter w = {.since_ns = kvb__now_ns()};
    pthread_mutex_lock(&srv->mu);
    /* Nobody waits: take the blocks now if they are free. */
    if (!srv->q_len && !kvb_pd_seq_reserve(seq, srv->pool, srv->tpb, tokens)) {
        account(srv, w.since_ns, true, NULL);
        pthread_mutex_unlock(&srv->mu);
        return KVB_OK;
    }
    if (srv->q_len >= srv->max_queue || srv->adm_stop) {
        int rc = srv->adm_stop
                     ? refuse(ref, 503, "stopping", 1, "the instance is stopping")
                     : refuse(ref, 503, "queue_full", 1,
                              "admission queue full (%u requests wait for KV blocks; %llu "
                              "needed, %llu free)",
                              srv->q_len, (unsigned long long)need,
                              (unsigned long long)kvb_pd_blocks_available(srv->pool));
        account(srv, w.since_ns, false, "queue_full");
        pthread_mutex_unlock(&srv->mu);
        return rc;
    }
    srv->m_waited++;
    if (srv->q_tail)
        srv->q_tail->next = &w;
    else
        srv->q_head = &w;
    srv->q_tail = &w;
    srv->q_len++;
    int rc = KVB_OK;
    for (;;) {
        if (srv->q_head == &w && !kvb_pd_seq_reserve(seq, srv->pool, srv->tpb, tokens))
            break;
        uint64_t now = kvb__now_ns();
        if (srv->adm_stop || now >= deadline_ns) {
            uint64_t free_now = kvb_pd_blocks_available(srv->pool);
            uint32_t ahead = 0;
            for (struct kvb__srv_waiter *x = srv->q_head; x && x != &w; x = x->next)
                ahead++;
            rc = refuse(ref, 503, srv->adm_stop ? "stopping" : "deadline", 1,
                        "request deadline passed after %.0f ms waiting for KV blocks (%llu "
                        "needed, %llu free, %u requests ahead)",
                        (double)(now - w.since_ns) / 1e6, (unsigned long long)need,
                        (unsigned long long)free_now, ahead);
            break;
        }
        uint64_t until = now + SLICE_MS * 1000000ull;
        struct timespec ts = kvb__timespec_of(until < deadline_ns ? until : deadline_ns);
        pthread_cond_timedwait(&srv->adm_cv, &srv->mu, &ts);
    }
    dequeue(srv, &w);
    account(srv, w.since_ns, !rc, rc ? ref->reason : NULL);
    pthread_mutex_unlock(&srv->mu);
    return rc;
}

json_t *kvb__srv_admit_health(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    double oldest = srv->q_head ? (double)(kvb__now_ns() - srv->q_head->since_ns) / 1e6 : 0.0;
    double avg = srv->m_wait.count ? srv->m_wait.sum / (double)srv->m_wait.count * 1e3 : 0.0;
    json_t *o = json_pack("{s:I,s:I,s:f,s:I,s:I,s:I,s:I,s:f}", "depth", (json_int_t)srv->q_len,
                          "max", (json_int_t)srv->max_queue, "oldest_wait_ms", oldest, "admitted",
                          (json_int_t)srv->m_admitted, "waited", (json_int_t)srv->m_waited,
                          "rejected_full", (json_int_t)srv->m_rej_full, "rejected_deadline",
                          (json_int_t)srv->m_rej_deadline, "wait_ms_avg", avg);
    pthread_mutex_unlock(&srv->mu);
    return o;
}
