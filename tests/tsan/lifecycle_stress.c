/* SPDX-License-Identifier: Apache-2.0 */
/* Lifecycle stress under ThreadSanitizer: engines destroyed under blocked callers, batches
 * cancelled, freed and orphaned while in flight, a peer SIGKILLed mid-batch, and one batch waited
 * on from several threads. One scenario per run, so that a crash in one hides no other.
 * Usage: lifecycle_stress destroy-waiters|destroy-in-flight|cancel-free|close-in-flight|peer-kill|
 *        multi-wait. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stress.h"

#define SEED     9090
#define SPAN     (4u << 20) /* each lane's share of a target region half */
#define MAX_REQS 8

/* "Promptly": the README promises peer loss within 2 s; TSan slows everything down. */
#define PROMPT_MS 3000

static const char *const protocols[] = {"tcp", "auto"};

/* ---- lanes: one thread's registered buffer and its share of the target's memory ------------ */

/* A lane reads from the first half of one target RW region (nobody writes it in these
 * scenarios, so every completed READ is checked against the pattern) and writes its own quarter
 * of the second half. Local memory: [0, SPAN) receives READs, [SPAN, 2 SPAN) sources WRITEs. */
typedef struct {
    kvb_engine_t *e;
    kvb_segment_t seg;
    uint8_t *local;
    bool alloc; /* kvb_alloc memory (else mmap) */
    uint64_t region, region_seed, write_off;
    uint8_t *expect;
    uint64_t rs;
} lane_t;

/* Lane i of 4 reads region i % 2 and uses kvb_alloc memory when i / 2 is even and `alloc`. */
static int lane_init(lane_t *l, kvb_engine_t *e, kvb_segment_t seg, const stress_target_t *t, int i,
                     bool alloc)
{
    bool plain = i % 2;
    *l = (lane_t){.e = e,
                  .seg = seg,
                  .alloc = alloc && i / 2 % 2 == 0,
                  .region = plain ? t->plain_addr : t->shm_addr,
                  .region_seed = plain ? t->seed + 1 : t->seed,
                  .write_off = STRESS_REGION_LEN / 2 + (uint64_t)(i / 2 % 2) * SPAN,
                  .expect = malloc(SPAN),
                  .rs = 500 + (uint64_t)i};
    if (l->alloc)
        CHECK_RC(kvb_alloc(e, 2 * SPAN, 0, (void **)&l->local), KVB_OK);
    else
        l->local = stress_map(2 * SPAN);
    if (!l->local || !l->expect)
        return -1;
    int rc = kvb_register(e, l->local, 2 * SPAN, "cpu:0", KVB_ACCESS_RW);
    CHECK(rc == KVB_OK, "lane %d: register: %s", i, kvb_status_name(rc));
    return rc;
}

static void lane_fini(lane_t *l)
{
    if (l->local) {
        CHECK_RC(kvb_unregister(l->e, l->local), KVB_OK);
        if (l->alloc)
            CHECK_RC(kvb_free(l->e, l->local), KVB_OK);
        else
            stress_unmap(l->local, 2 * SPAN);
    }
    free(l->expect);
    l->local = NULL;
}

/* After a batch that did not complete, a cancelled copy may still touch the buffer (same-host
 * peers copy into it themselves): unregistering waits for that, then the lane is usable again. */
static void lane_quiesce(lane_t *l)
{
    CHECK_RC(kvb_unregister(l->e, l->local), KVB_OK);
    CHECK_RC(kvb_register(l->e, l->local, 2 * SPAN, "cpu:0", KVB_ACCESS_RW), KVB_OK);
}

/* Fills reqs with n random READs and WRITEs, disjoint locally and (for WRITEs) remotely. */
static size_t lane_build(lane_t *l, kvb_request_t *reqs, uint64_t min_len, uint64_t max_len)
{
    size_t n = 1 + stress_rand_below(&l->rs, MAX_REQS);
    uint64_t slot = SPAN / n;
    for (size_t i = 0; i < n; i++) {
        uint64_t len = min_len + stress_rand_below(&l->rs, max_len - min_len + 1);
        len = len < slot ? len : slot;
        uint64_t off = i * slot + stress_rand_below(&l->rs, slot - len + 1);
        if (stress_rand_below(&l->rs, 2)) {
            stress_random_fill(l->local + SPAN + off, len, &l->rs);
            reqs[i] = (kvb_request_t){KVB_OP_WRITE, l->local + SPAN + off, l->seg,
                                      l->region + l->write_off + off, len};
        } else {
            uint64_t from = stress_rand_below(&l->rs, STRESS_REGION_LEN / 2 - len + 1);
            memset(l->local + off, 0xA5, len);
            reqs[i] = (kvb_request_t){KVB_OP_READ, l->local + off, l->seg, l->region + from, len};
        }
    }
    return n;
}

/* Checks the requests' end states against `allowed` (a bit per kvb_req_state_t), the errors of
 * failed ones against `want_err` (0: any peer error), and every byte of each completed READ.
 * Returns true when all requests COMPLETED. */
static bool lane_check(lane_t *l, kvb_batch_t *b, const kvb_request_t *reqs, size_t n,
                       unsigned allowed, int want_err, const char *what)
{
    bool all = true;
    for (size_t i = 0; i < n; i++) {
        kvb_req_status_t st;
        CHECK_RC(kvb_batch_status(b, i, &st), KVB_OK);
        CHECK(allowed & (1u << st.state), "%s: request %zu ended %d (%s)", what, i, (int)st.state,
              kvb_status_name(st.error));
        if (st.state == KVB_REQ_FAILED)
            CHECK(want_err ? st.error == want_err : KVB_IS_PEER_ERROR(st.error),
                  "%s: request %zu failed with %s", what, i, kvb_status_name(st.error));
        all &= st.state == KVB_REQ_COMPLETED;
        if (st.state != KVB_REQ_COMPLETED || reqs[i].opcode != KVB_OP_READ)
            continue;
        CHECK(st.bytes == reqs[i].len, "%s: request %zu: %llu of %zu bytes", what, i,
              (unsigned long long)st.bytes, reqs[i].len);
        uint64_t from = reqs[i].remote - l->region;
        stress_pattern_fill(l->expect, from, reqs[i].len, l->region_seed);
        int64_t bad = stress_first_diff(reqs[i].local, l->expect, reqs[i].len);
        CHECK(bad < 0, "%s: READ of %zu bytes from +%llu: byte %lld differs", what, reqs[i].len,
              (unsigned long long)from, (long long)bad);
    }
    return all;
}

#define ST(s) (1u << (s))

/* A target plus an engine connected to it. */
typedef struct {
    const char *protocol;
    stress_target_t t;
    kvb_engine_t *e;
    kvb_segment_t seg;
} setup_t;

static int setup_start(setup_t *s, const char *protocol, bool churn)
{
    memset(s, 0, sizeof *s);
    s->protocol = protocol;
    if (stress_target_start(&s->t, protocol, SEED, churn)) {
        stress_fail(__FILE__, __LINE__, "%s: target did not start", protocol);
        return -1;
    }
    kvb_config_t cfg;
    stress_config(&cfg, protocol);
    cfg.progress_threads = 2;
    int rc = kvb_engine_create(&cfg, &s->e);
    CHECK(rc == KVB_OK, "engine: %s", kvb_status_name(rc));
    if (rc == KVB_OK) {
        rc = kvb_segment_open(s->e, s->t.name, &s->seg);
        CHECK(rc == KVB_OK, "open %s: %s", s->t.name, kvb_status_name(rc));
    }
    if (rc) {
        kvb_engine_destroy(s->e);
        s->e = NULL;
        stress_target_kill(&s->t);
    }
    return rc;
}

/* ---- destroy-waiters ------------------------------------------------------------------------- */

typedef struct {
    kvb_engine_t *e;
    int timeout_ms;
    atomic_int *started;
    int rc;
    uint64_t returned;
} recv_waiter_t;

static void *recv_waiter_main(void *arg)
{
    recv_waiter_t *w = arg;
    kvb_notification_t *n = malloc(sizeof *n);
    atomic_fetch_add(w->started, 1);
    w->rc = n ? kvb_notify_recv(w->e, n, w->timeout_ms) : KVB_ERR_NOMEM;
    w->returned = stress_now_ms();
    free(n);
    return NULL;
}

typedef struct {
    kvb_engine_t *e;
    kvb_segment_t seg;
    uint8_t *buf;
    uint64_t remote;
    atomic_bool *running;
    int rc;
    uint64_t returned;
    unsigned long long batches;
} reader_t;

/* Reads from the engine being destroyed until that fails: the victim serves transfers while it
 * goes down. */
static void *reader_main(void *arg)
{
    reader_t *r = arg;
    atomic_store(r->running, true);
    for (;;) {
        kvb_request_t q = {KVB_OP_READ, r->buf, r->seg, r->remote, 1 << 20};
        kvb_batch_t *b;
        r->rc = kvb_batch_submit(r->e, &q, 1, NULL, &b);
        if (r->rc == KVB_OK) {
            r->rc = kvb_batch_wait(b, -1);
            kvb_batch_free(b);
        }
        if (r->rc)
            break;
        r->batches++;
    }
    r->returned = stress_now_ms();
    return NULL;
}

typedef struct {
    kvb_engine_t *e;
    uint64_t started, returned;
} destroyer_t;

static void *destroyer_main(void *arg)
{
    destroyer_t *d = arg;
    d->started = stress_now_ms();
    kvb_engine_destroy(d->e);
    d->returned = stress_now_ms();
    return NULL;
}

/* kvb_notify_recv(-1) waits "until the engine is destroyed": destroy must wake every waiter, and
 * no waiter may touch the engine after it is freed. */
static void scenario_destroy_waiters(void)
{
    enum { WAITERS = 6, ROUNDS = 8 };
    for (int round = 0; round < ROUNDS; round++) {
        kvb_config_t cfg;
        stress_config(&cfg, "tcp");
        kvb_engine_t *victim, *peer;
        CHECK_RC(kvb_engine_create(&cfg, &victim), KVB_OK);
        CHECK_RC(kvb_engine_create(&cfg, &peer), KVB_OK);
        uint8_t *mem = stress_map(1 << 20), *dst = stress_map(1 << 20);
        CHECK(mem && dst, "mmap");
        CHECK_RC(kvb_register(victim, mem, 1 << 20, "cpu:0", KVB_ACCESS_RW), KVB_OK);
        CHECK_RC(kvb_register(peer, dst, 1 << 20, "cpu:0", KVB_ACCESS_RW), KVB_OK);
        kvb_segment_t seg = 0;
        CHECK_RC(kvb_segment_open(peer, kvb_engine_segment_name(victim), &seg), KVB_OK);
        if (atomic_load(&stress_failures))
            return;

        atomic_int started = 0;
        atomic_bool reading = false;
        recv_waiter_t w[WAITERS];
        pthread_t tw[WAITERS], tr, td;
        for (int i = 0; i < WAITERS; i++) {
            w[i] =
                (recv_waiter_t){.e = victim, .timeout_ms = i % 2 ? -1 : 60000, .started = &started};
            pthread_create(&tw[i], NULL, recv_waiter_main, &w[i]);
        }
        reader_t rd = {.e = peer,
                       .seg = seg,
                       .buf = dst,
                       .remote = (uint64_t)(uintptr_t)mem,
                       .running = &reading};
        pthread_create(&tr, NULL, reader_main, &rd);
        while (atomic_load(&started) < WAITERS || !atomic_load(&reading))
            stress_sleep_us(1000);
        stress_sleep_us(200000); /* into their condition waits */

        destroyer_t d = {.e = victim};
        pthread_create(&td, NULL, destroyer_main, &d);
        for (int i = 0; i < WAITERS; i++) {
            pthread_join(tw[i], NULL);
            CHECK(w[i].rc == KVB_ERR_SHUTDOWN, "round %d: waiter %d (timeout %d) got %s", round, i,
                  w[i].timeout_ms, kvb_status_name(w[i].rc));
        }
        pthread_join(td, NULL);
        pthread_join(tr, NULL);
        for (int i = 0; i < WAITERS; i++)
            CHECK(w[i].returned - d.started < PROMPT_MS, "round %d: waiter %d woke after %llu ms",
                  round, i, (unsigned long long)(w[i].returned - d.started));
        CHECK(d.returned - d.started < 10000, "round %d: destroy took %llu ms", round,
              (unsigned long long)(d.returned - d.started));
        CHECK(KVB_IS_PEER_ERROR(rd.rc), "round %d: reader ended with %s", round,
              kvb_status_name(rd.rc));
        CHECK(rd.returned - d.started < PROMPT_MS, "round %d: reader failed after %llu ms", round,
              (unsigned long long)(rd.returned - d.started));
        CHECK_RC(kvb_segment_close(peer, seg), KVB_OK);
        CHECK_RC(kvb_unregister(peer, dst), KVB_OK);
        kvb_engine_destroy(peer);
        stress_unmap(mem, 1 << 20);
        stress_unmap(dst, 1 << 20);
    }
}

/* ---- destroy-in-flight ----------------------------------------------------------------------- */

typedef struct {
    lane_t lane;
    int id;
    pthread_rwlock_t *gate; /* read-held around submit; the destroyer write-locks it first */
    bool *closing;
    int rc;
    bool crossed; /* a batch was in flight when the engine went */
    uint64_t returned;
    unsigned long long batches;
} orphan_t;

/* Submits and waits until a wait fails. Then, as an application would, looks at that batch and
 * frees it right here, while or after destroy runs, synchronising with nothing the destroying
 * thread does: ThreadSanitizer sees any use of the freed engine. */
static void *orphan_main(void *arg)
{
    orphan_t *o = arg;
    kvb_request_t reqs[MAX_REQS];
    for (;;) {
        pthread_rwlock_rdlock(o->gate);
        if (*o->closing) {
            pthread_rwlock_unlock(o->gate);
            break;
        }
        kvb_batch_t *b;
        size_t n = lane_build(&o->lane, reqs, 64 << 10, 2 << 20);
        int rc = kvb_batch_submit(o->lane.e, reqs, n, NULL, &b);
        pthread_rwlock_unlock(o->gate);
        CHECK(rc == KVB_OK, "submit: %s", kvb_status_name(rc));
        if (rc)
            break;
        o->rc = kvb_batch_wait(b, -1);
        if (o->rc != KVB_OK) {
            o->returned = stress_now_ms();
            o->crossed = true;
            if (o->id % 2)
                stress_sleep_us(300000); /* most likely after destroy returned */
            lane_check(&o->lane, b, reqs, n, ST(KVB_REQ_COMPLETED) | ST(KVB_REQ_FAILED),
                       KVB_ERR_SHUTDOWN, "after destroy");
            kvb_batch_free(b);
            break;
        }
        lane_check(&o->lane, b, reqs, n, ST(KVB_REQ_COMPLETED), 0, "before destroy");
        kvb_batch_free(b);
        o->batches++;
    }
    return NULL;
}

/* kvb_engine_destroy: "Requests still in flight end FAILED with KVB_ERR_SHUTDOWN; their batches
 * stay valid until kvb_batch_free()" - with threads blocked in kvb_batch_wait on them. */
static void scenario_destroy_in_flight(void)
{
    enum { THREADS = 4, ROUNDS = 3 };
    for (size_t p = 0; p < 2; p++) {
        for (int round = 0; round < ROUNDS; round++) {
            setup_t s;
            if (setup_start(&s, protocols[p], false))
                return;
            pthread_rwlock_t gate = PTHREAD_RWLOCK_INITIALIZER;
            bool closing = false;
            orphan_t o[THREADS];
            pthread_t t[THREADS];
            for (int i = 0; i < THREADS; i++) {
                memset(&o[i], 0, sizeof o[i]);
                o[i].id = i;
                o[i].gate = &gate;
                o[i].closing = &closing;
                /* Plain memory only: kvb_alloc memory goes with the engine, and these threads may
                 * still check a READ that completed while destroy runs. */
                if (lane_init(&o[i].lane, s.e, s.seg, &s.t, i, false))
                    return;
            }
            for (int i = 0; i < THREADS; i++)
                pthread_create(&t[i], NULL, orphan_main, &o[i]);
            stress_sleep_us(300000 + 100000 * (uint64_t)round);
            pthread_rwlock_wrlock(&gate);
            closing = true;
            pthread_rwlock_unlock(&gate);
            uint64_t t0 = stress_now_ms();
            /* The lanes' memory stays mapped: requests may use it until destroy returns. */
            kvb_engine_destroy(s.e);
            uint64_t t1 = stress_now_ms();
            unsigned long long batches = 0;
            int crossed = 0;
            for (int i = 0; i < THREADS; i++) {
                pthread_join(t[i], NULL);
                batches += o[i].batches;
                if (o[i].crossed) {
                    CHECK(o[i].rc == KVB_ERR_SHUTDOWN, "%s: wait across destroy returned %s",
                          s.protocol, kvb_status_name(o[i].rc));
                    CHECK(o[i].returned < t0 + PROMPT_MS, "%s: wait returned %llu ms after destroy",
                          s.protocol, (unsigned long long)(o[i].returned - t0));
                    crossed++;
                }
                stress_unmap(o[i].lane.local, 2 * SPAN);
                free(o[i].lane.expect);
            }
            CHECK(t1 - t0 < 10000, "%s: destroy took %llu ms", s.protocol,
                  (unsigned long long)(t1 - t0));
            fprintf(stderr, "%s round %d: %llu batches before destroy, %d in flight across it\n",
                    s.protocol, round, batches, crossed);
            int st = stress_target_stop(&s.t);
            CHECK(st == 0, "target exited with %d", st);
            pthread_rwlock_destroy(&gate);
        }
    }
}

/* ---- cancel-free ----------------------------------------------------------------------------- */

typedef struct {
    lane_t lane;
    const char *protocol;
    atomic_bool *stop;
    /* the canceller pair: the submitter hands each batch over and waits on it meanwhile */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvb_batch_t *handed;
    bool cancelled, quit;
    unsigned long long freed, cancels, completed;
} canceller_t;

/* Over TCP no READ writes into a cancelled or freed request's buffer once the call returned: a
 * sentinel written after it must survive. */
static void check_sentinel(canceller_t *c, const kvb_request_t *reqs, size_t n)
{
    if (strcmp(c->protocol, "tcp"))
        return;
    for (size_t i = 0; i < n; i++)
        if (reqs[i].opcode == KVB_OP_READ)
            memset(reqs[i].local, 0xEE, reqs[i].len);
    stress_sleep_us(2000);
    for (size_t i = 0; i < n; i++) {
        if (reqs[i].opcode != KVB_OP_READ)
            continue;
        const uint8_t *p = reqs[i].local;
        for (size_t k = 0; k < reqs[i].len; k++)
            if (p[k] != 0xEE) {
                stress_fail(__FILE__, __LINE__, "byte %zu of a cancelled READ changed", k);
                break;
            }
    }
}

/* Submits, sleeps a little, frees without waiting. */
static void *freeer_main(void *arg)
{
    canceller_t *c = arg;
    kvb_request_t reqs[MAX_REQS];
    while (!atomic_load(c->stop)) {
        size_t n = lane_build(&c->lane, reqs, 64 << 10, 2 << 20);
        kvb_batch_t *b;
        int rc = kvb_batch_submit(c->lane.e, reqs, n, NULL, &b);
        CHECK(rc == KVB_OK, "submit: %s", kvb_status_name(rc));
        if (rc)
            break;
        stress_sleep_us(stress_rand_below(&c->lane.rs, 3000));
        if (stress_rand_below(&c->lane.rs, 2)) {
            kvb_batch_free(b);
        } else {
            CHECK_RC(kvb_batch_cancel(b), KVB_OK);
            int w = kvb_batch_wait(b, -1);
            CHECK(w == KVB_OK || w == KVB_ERR_CANCELED, "wait after cancel: %s",
                  kvb_status_name(w));
            lane_check(&c->lane, b, reqs, n, ST(KVB_REQ_COMPLETED) | ST(KVB_REQ_CANCELED), 0,
                       "cancel");
            kvb_batch_free(b);
            c->cancels++;
        }
        check_sentinel(c, reqs, n);
        lane_quiesce(&c->lane);
        c->freed++;
    }
    return NULL;
}

static void *canceller_main(void *arg)
{
    canceller_t *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->handed && !c->quit)
            pthread_cond_wait(&c->cv, &c->mu);
        if (c->quit)
            break;
        kvb_batch_t *b = c->handed;
        pthread_mutex_unlock(&c->mu);
        stress_sleep_us(stress_rand_below(&c->lane.rs, 2000));
        CHECK_RC(kvb_batch_cancel(b), KVB_OK);
        pthread_mutex_lock(&c->mu);
        c->handed = NULL;
        c->cancelled = true;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Waits on each batch while the canceller thread cancels it. */
static void *submitter_main(void *arg)
{
    canceller_t *c = arg;
    kvb_request_t reqs[MAX_REQS];
    while (!atomic_load(c->stop)) {
        size_t n = lane_build(&c->lane, reqs, 4096, 2 << 20);
        kvb_batch_t *b;
        int rc = kvb_batch_submit(c->lane.e, reqs, n, NULL, &b);
        CHECK(rc == KVB_OK, "submit: %s", kvb_status_name(rc));
        if (rc)
            break;
        pthread_mutex_lock(&c->mu);
        c->handed = b;
        c->cancelled = false;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        rc = kvb_batch_wait(b, -1);
        CHECK(rc == KVB_OK || rc == KVB_ERR_CANCELED, "wait: %s", kvb_status_name(rc));
        pthread_mutex_lock(&c->mu);
        while (!c->cancelled)
            pthread_cond_wait(&c->cv, &c->mu);
        pthread_mutex_unlock(&c->mu);
        bool all = lane_check(&c->lane, b, reqs, n, ST(KVB_REQ_COMPLETED) | ST(KVB_REQ_CANCELED), 0,
                              "cancel from another thread");
        CHECK(all == (rc == KVB_OK), "wait said %s", kvb_status_name(rc));
        kvb_batch_free(b);
        if (!all) {
            check_sentinel(c, reqs, n);
            lane_quiesce(&c->lane);
        } else {
            c->completed++;
        }
        c->cancels++;
    }
    pthread_mutex_lock(&c->mu);
    c->quit = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void scenario_cancel_free(void)
{
    enum { LANES = 4 };
    for (size_t p = 0; p < 2; p++) {
        setup_t s;
        if (setup_start(&s, protocols[p], false))
            return;
        atomic_bool stop = false;
        canceller_t c[LANES];
        pthread_t t[LANES + 2];
        for (int i = 0; i < LANES; i++) {
            memset(&c[i], 0, sizeof c[i]);
            c[i].protocol = s.protocol;
            c[i].stop = &stop;
            pthread_mutex_init(&c[i].mu, NULL);
            pthread_cond_init(&c[i].cv, NULL);
            if (lane_init(&c[i].lane, s.e, s.seg, &s.t, i, true))
                return;
        }
        /* Lanes 0 and 1 free or cancel their own batches; lanes 2 and 3 have a canceller. */
        pthread_create(&t[0], NULL, freeer_main, &c[0]);
        pthread_create(&t[1], NULL, freeer_main, &c[1]);
        pthread_create(&t[2], NULL, submitter_main, &c[2]);
        pthread_create(&t[3], NULL, canceller_main, &c[2]);
        pthread_create(&t[4], NULL, submitter_main, &c[3]);
        pthread_create(&t[5], NULL, canceller_main, &c[3]);
        stress_sleep_us(10000000);
        atomic_store(&stop, true);
        for (int i = 0; i < LANES + 2; i++)
            pthread_join(t[i], NULL);

        /* The engine is still sound: a batch afterwards completes and reads right. */
        kvb_request_t reqs[MAX_REQS];
        size_t n = lane_build(&c[0].lane, reqs, 1, 1 << 20);
        kvb_batch_t *b;
        CHECK_RC(kvb_batch_submit(s.e, reqs, n, NULL, &b), KVB_OK);
        CHECK_RC(kvb_batch_wait(b, -1), KVB_OK);
        lane_check(&c[0].lane, b, reqs, n, ST(KVB_REQ_COMPLETED), 0, "after the storm");
        kvb_batch_free(b);
        kvb_stats_t st;
        CHECK_RC(kvb_engine_stats(s.e, &st), KVB_OK);
        CHECK(st.requests_failed == 0, "%llu requests failed (cancelled ones do not count)",
              (unsigned long long)st.requests_failed);
        fprintf(stderr,
                "%s: %llu+%llu freed/cancelled, %llu+%llu cancelled from another thread "
                "(%llu+%llu completed first)\n",
                s.protocol, c[0].freed + c[1].freed, c[0].cancels + c[1].cancels, c[2].cancels,
                c[3].cancels, c[2].completed, c[3].completed);
        for (int i = 0; i < LANES; i++) {
            lane_fini(&c[i].lane);
            pthread_mutex_destroy(&c[i].mu);
            pthread_cond_destroy(&c[i].cv);
        }
        CHECK_RC(kvb_segment_close(s.e, s.seg), KVB_OK);
        kvb_engine_destroy(s.e);
        int rc = stress_target_stop(&s.t);
        CHECK(rc == 0, "target exited with %d", rc);
    }
}

/* ---- groups: one batch, several waiting threads ---------------------------------------------- */

enum { FOLLOWERS = 2 };

typedef struct group group_t;
typedef struct {
    group_t *g;
    int k;
} follower_t;

struct group {
    lane_t lane;
    atomic_bool *stop;
    bool stop_on_failure; /* peer-kill: the first failed batch ends the group */
    bool short_deadlines; /* multi-wait: some batches time out */
    pthread_barrier_t bar;
    kvb_batch_t *batch;
    bool quit;
    int rcs[1 + FOLLOWERS];
    uint64_t returned[1 + FOLLOWERS];
    unsigned round;
    follower_t f[FOLLOWERS];
    /* results */
    unsigned long long batches, timeouts;
    int last_rc;
    uint64_t last_returned; /* the latest of the waiters, for the failed batch */
};

static int group_wait(group_t *g, int k)
{
    return stress_wait(g->batch, (k + g->round) % 3, 300);
}

static void *follower_main(void *arg)
{
    follower_t *f = arg;
    group_t *g = f->g;
    for (;;) {
        pthread_barrier_wait(&g->bar); /* the leader submitted (or quit) */
        if (g->quit)
            break;
        g->rcs[f->k] = group_wait(g, f->k);
        g->returned[f->k] = stress_now_ms();
        pthread_barrier_wait(&g->bar); /* all waits returned */
    }
    return NULL;
}

static void *leader_main(void *arg)
{
    group_t *g = arg;
    kvb_request_t reqs[MAX_REQS];
    for (;; g->round++) {
        if (atomic_load(g->stop)) {
            g->quit = true;
            pthread_barrier_wait(&g->bar);
            break;
        }
        size_t n = lane_build(&g->lane, reqs, 1, 2 << 20);
        kvb_batch_opts_t o = {0};
        if (g->short_deadlines && g->round % 4 == 3)
            o.timeout_ms = 1 + (uint32_t)stress_rand_below(&g->lane.rs, 5);
        int rc = kvb_batch_submit(g->lane.e, reqs, n, &o, &g->batch);
        if (rc) {
            /* Only a lost peer may refuse: its requests usually end FAILED instead. */
            CHECK(g->stop_on_failure && KVB_IS_PEER_ERROR(rc), "submit: %s", kvb_status_name(rc));
            g->last_rc = rc;
            g->last_returned = stress_now_ms();
            g->quit = true;
            pthread_barrier_wait(&g->bar);
            break;
        }
        pthread_barrier_wait(&g->bar);
        g->rcs[0] = group_wait(g, 0);
        g->returned[0] = stress_now_ms();
        pthread_barrier_wait(&g->bar);
        for (int k = 1; k <= FOLLOWERS; k++)
            CHECK(g->rcs[k] == g->rcs[0], "waiters disagree: %s vs %s", kvb_status_name(g->rcs[0]),
                  kvb_status_name(g->rcs[k]));
        unsigned allowed = ST(KVB_REQ_COMPLETED);
        if (o.timeout_ms)
            allowed |= ST(KVB_REQ_TIMEOUT);
        if (g->stop_on_failure)
            allowed |= ST(KVB_REQ_FAILED);
        bool all = lane_check(&g->lane, g->batch, reqs, n, allowed, 0, "group");
        CHECK(all == (g->rcs[0] == KVB_OK), "wait said %s", kvb_status_name(g->rcs[0]));
        kvb_batch_free(g->batch);
        g->batch = NULL;
        g->batches++;
        if (!all) {
            g->timeouts++;
            g->last_rc = g->rcs[0];
            g->last_returned = 0;
            for (int k = 0; k <= FOLLOWERS; k++)
                if (g->returned[k] > g->last_returned)
                    g->last_returned = g->returned[k];
            if (g->stop_on_failure) {
                g->quit = true;
                pthread_barrier_wait(&g->bar);
                break;
            }
            lane_quiesce(&g->lane);
        }
    }
    return NULL;
}

static void group_start(group_t *g, pthread_t *t)
{
    pthread_barrier_init(&g->bar, NULL, 1 + FOLLOWERS);
    pthread_create(&t[0], NULL, leader_main, g);
    for (int k = 0; k < FOLLOWERS; k++) {
        g->f[k] = (follower_t){g, k + 1};
        pthread_create(&t[1 + k], NULL, follower_main, &g->f[k]);
    }
}

static void group_join(group_t *g, pthread_t *t)
{
    for (int k = 0; k <= FOLLOWERS; k++)
        pthread_join(t[k], NULL);
    pthread_barrier_destroy(&g->bar);
}

/* ---- multi-wait ------------------------------------------------------------------------------ */

static void scenario_multi_wait(void)
{
    enum { GROUPS = 3 };
    for (size_t p = 0; p < 2; p++) {
        setup_t s;
        if (setup_start(&s, protocols[p], false))
            return;
        atomic_bool stop = false;
        group_t g[GROUPS];
        pthread_t t[GROUPS][1 + FOLLOWERS];
        for (int i = 0; i < GROUPS; i++) {
            memset(&g[i], 0, sizeof g[i]);
            g[i].stop = &stop;
            g[i].short_deadlines = true;
            if (lane_init(&g[i].lane, s.e, s.seg, &s.t, i, true))
                return;
        }
        for (int i = 0; i < GROUPS; i++)
            group_start(&g[i], t[i]);
        stress_sleep_us(10000000);
        atomic_store(&stop, true);
        unsigned long long batches = 0, timeouts = 0;
        for (int i = 0; i < GROUPS; i++) {
            group_join(&g[i], t[i]);
            batches += g[i].batches;
            timeouts += g[i].timeouts;
            lane_fini(&g[i].lane);
        }
        fprintf(stderr, "%s: %llu batches waited on by %d threads each, %llu timed out\n",
                s.protocol, batches, 1 + FOLLOWERS, timeouts);
        CHECK_RC(kvb_segment_close(s.e, s.seg), KVB_OK);
        kvb_engine_destroy(s.e);
        int rc = stress_target_stop(&s.t);
        CHECK(rc == 0, "target exited with %d", rc);
    }
}

/* ---- peer-kill ------------------------------------------------------------------------------- */

typedef struct {
    kvb_engine_t *e;
    kvb_segment_t seg;
    const char *target;
    atomic_bool *stop;
    atomic_bool *killed;
    int rc;
    uint64_t returned;
    unsigned long long pings;
} pinger_t;

/* Ping-pong until the peer goes: a send to a dead peer must fail, not hang. */
static void *pinger_main(void *arg)
{
    pinger_t *p = arg;
    kvb_notification_t *n = malloc(sizeof *n);
    for (unsigned long long k = 1; n && !atomic_load(p->stop); k++) {
        char msg[64];
        int len = snprintf(msg, sizeof msg, "ping %llu", k);
        p->rc = kvb_notify_send(p->e, p->seg, msg, (size_t)len, 20000);
        if (p->rc)
            break;
        int rc = kvb_notify_recv(p->e, n, 4000);
        CHECK(rc == KVB_OK || (rc == KVB_ERR_TIMEOUT && atomic_load(p->killed)), "pong %llu: %s", k,
              kvb_status_name(rc));
        if (rc == KVB_OK)
            CHECK(!strcmp(n->from, p->target), "pong from %s", n->from);
        p->pings++;
    }
    p->returned = stress_now_ms();
    free(n);
    return NULL;
}

/* SIGKILL the target while several threads wait on batches (and on a notification): every
 * request ends promptly, COMPLETED or FAILED with a peer error; the engine recovers. */
static void scenario_peer_kill(void)
{
    enum { GROUPS = 2, ROUNDS = 2 };
    for (size_t p = 0; p < 2; p++) {
        for (int round = 0; round < ROUNDS; round++) {
            setup_t s;
            if (setup_start(&s, protocols[p], true))
                return;
            atomic_bool stop = false, killed = false;
            group_t g[GROUPS];
            pthread_t t[GROUPS][1 + FOLLOWERS], tp;
            for (int i = 0; i < GROUPS; i++) {
                memset(&g[i], 0, sizeof g[i]);
                g[i].stop = &stop;
                g[i].stop_on_failure = true;
                if (lane_init(&g[i].lane, s.e, s.seg, &s.t, i + 2 * round, true))
                    return;
            }
            pinger_t pg = {
                .e = s.e, .seg = s.seg, .target = s.t.name, .stop = &stop, .killed = &killed};
            for (int i = 0; i < GROUPS; i++)
                group_start(&g[i], t[i]);
            pthread_create(&tp, NULL, pinger_main, &pg);
            stress_sleep_us(800000 + 400000 * (uint64_t)round);
            uint64_t t0 = stress_now_ms();
            atomic_store(&killed, true);
            stress_target_kill(&s.t);
            /* Each group stops at its first failed batch; pinging stops at its first failed
             * send. The flag only ends whichever loop started after the kill went unnoticed. */
            for (int i = 0; i < GROUPS; i++) {
                group_join(&g[i], t[i]);
                CHECK(g[i].last_rc != KVB_OK, "%s: group %d never saw the peer go", s.protocol, i);
                CHECK(KVB_IS_PEER_ERROR(g[i].last_rc), "%s: group %d ended with %s", s.protocol, i,
                      kvb_status_name(g[i].last_rc));
                CHECK(g[i].last_returned - t0 < PROMPT_MS,
                      "%s: group %d's waiters returned %llu ms after the kill", s.protocol, i,
                      (unsigned long long)(g[i].last_returned - t0));
            }
            atomic_store(&stop, true);
            pthread_join(tp, NULL);
            CHECK(pg.rc == KVB_OK || KVB_IS_PEER_ERROR(pg.rc), "%s: notify_send: %s", s.protocol,
                  kvb_status_name(pg.rc));

            /* Later requests fail at once; reopening a dead peer fails within its deadline. */
            kvb_request_t reqs[MAX_REQS];
            size_t n = lane_build(&g[0].lane, reqs, 1, 4096);
            kvb_batch_t *b;
            uint64_t t1 = stress_now_ms();
            int rc = kvb_batch_submit(s.e, reqs, n, NULL, &b);
            if (rc == KVB_OK) {
                rc = kvb_batch_wait(b, -1);
                kvb_batch_free(b);
            }
            CHECK(KVB_IS_PEER_ERROR(rc), "%s: request after the kill: %s", s.protocol,
                  kvb_status_name(rc));
            CHECK(stress_now_ms() - t1 < 1000, "%s: request after the kill took %llu ms",
                  s.protocol, (unsigned long long)(stress_now_ms() - t1));
            kvb_segment_t again;
            rc = kvb_segment_open(s.e, s.t.name, &again);
            CHECK(rc != KVB_OK, "%s: reopened a dead peer", s.protocol);
            if (rc == KVB_OK)
                kvb_segment_close(s.e, again);
            kvb_stats_t st;
            CHECK_RC(kvb_engine_stats(s.e, &st), KVB_OK);
            unsigned long long batches = 0;
            for (int i = 0; i < GROUPS; i++) {
                batches += g[i].batches;
                lane_fini(&g[i].lane); /* unregister: nothing may still use the memory */
            }
            fprintf(stderr,
                    "%s round %d: %llu batches, %llu pings before the kill; %llu "
                    "requests failed\n",
                    s.protocol, round, batches, pg.pings, (unsigned long long)st.requests_failed);
            CHECK_RC(kvb_segment_close(s.e, s.seg), KVB_OK);
            kvb_engine_destroy(s.e);
        }
    }
}

/* ---- close-in-flight ------------------------------------------------------------------------- */

typedef struct {
    lane_t lane;
    pthread_barrier_t *bar;
    kvb_request_t reqs[MAX_REQS];
    size_t n;
    int rc;
    uint64_t returned;
} closer_t;

static void *close_waiter_main(void *arg)
{
    closer_t *c = arg;
    kvb_batch_t *b = NULL;
    c->n = lane_build(&c->lane, c->reqs, 256 << 10, 2 << 20);
    int rc = kvb_batch_submit(c->lane.e, c->reqs, c->n, NULL, &b);
    CHECK(rc == KVB_OK, "submit: %s", kvb_status_name(rc));
    pthread_barrier_wait(c->bar); /* all submitted: the main thread closes the segment */
    if (rc)
        return NULL;
    c->rc = kvb_batch_wait(b, -1);
    c->returned = stress_now_ms();
    bool all = lane_check(&c->lane, b, c->reqs, c->n, ST(KVB_REQ_COMPLETED) | ST(KVB_REQ_FAILED),
                          KVB_ERR_CANCELED, "segment closed");
    CHECK(all == (c->rc == KVB_OK), "wait said %s", kvb_status_name(c->rc));
    kvb_batch_free(b);
    return NULL;
}

/* kvb_segment_close of the last reference: "Requests in flight on it end FAILED with
 * KVB_ERR_CANCELED"; the handle is gone, and reopening works. */
static void scenario_close_in_flight(void)
{
    enum { THREADS = 3, ROUNDS = 6 };
    for (size_t p = 0; p < 2; p++) {
        setup_t s;
        if (setup_start(&s, protocols[p], false))
            return;
        closer_t c[THREADS];
        for (int i = 0; i < THREADS; i++) {
            memset(&c[i], 0, sizeof c[i]);
            if (lane_init(&c[i].lane, s.e, s.seg, &s.t, i, true))
                return;
        }
        unsigned cancelled = 0;
        for (int round = 0; round < ROUNDS; round++) {
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, NULL, THREADS + 1);
            pthread_t t[THREADS];
            for (int i = 0; i < THREADS; i++) {
                c[i].bar = &bar;
                c[i].lane.seg = s.seg;
                pthread_create(&t[i], NULL, close_waiter_main, &c[i]);
            }
            pthread_barrier_wait(&bar);
            stress_sleep_us(stress_rand_below(&c[0].lane.rs, 3000));
            uint64_t t0 = stress_now_ms();
            CHECK_RC(kvb_segment_close(s.e, s.seg), KVB_OK);
            for (int i = 0; i < THREADS; i++) {
                pthread_join(t[i], NULL);
                CHECK(c[i].rc == KVB_OK || c[i].rc == KVB_ERR_CANCELED, "%s: wait: %s", s.protocol,
                      kvb_status_name(c[i].rc));
                CHECK(c[i].returned < t0 + PROMPT_MS, "%s: wait returned %llu ms after close",
                      s.protocol, (unsigned long long)(c[i].returned - t0));
                if (c[i].rc != KVB_OK) {
                    cancelled++;
                    lane_quiesce(&c[i].lane);
                }
            }
            pthread_barrier_destroy(&bar);
            kvb_request_t q = {KVB_OP_READ, c[0].lane.local, s.seg, s.t.ro_addr, 64};
            kvb_batch_t *b;
            CHECK_RC(kvb_batch_submit(s.e, &q, 1, NULL, &b), KVB_ERR_BAD_SEGMENT);
            CHECK_RC(kvb_segment_open(s.e, s.t.name, &s.seg), KVB_OK);
        }
        fprintf(stderr, "%s: %u of %d batches cut short by the close\n", s.protocol, cancelled,
                ROUNDS * THREADS);
        for (int i = 0; i < THREADS; i++)
            lane_fini(&c[i].lane);
        CHECK_RC(kvb_segment_close(s.e, s.seg), KVB_OK);
        kvb_engine_destroy(s.e);
        int rc = stress_target_stop(&s.t);
        CHECK(rc == 0, "target exited with %d", rc);
    }
}

int main(int argc, char **argv)
{
    int rc = stress_target_main(argc, argv);
    if (rc >= 0)
        return rc;
    static const struct {
        const char *name;
        void (*run)(void);
    } scenarios[] = {{"destroy-waiters", scenario_destroy_waiters},
                     {"destroy-in-flight", scenario_destroy_in_flight},
                     {"cancel-free", scenario_cancel_free},
                     {"close-in-flight", scenario_close_in_flight},
                     {"peer-kill", scenario_peer_kill},
                     {"multi-wait", scenario_multi_wait}};
    for (size_t i = 0; argc == 2 && i < sizeof scenarios / sizeof *scenarios; i++) {
        if (strcmp(argv[1], scenarios[i].name))
            continue;
        uint64_t t0 = stress_now_ms();
        scenarios[i].run();
        fprintf(stderr, "%s: %.1f s\n", argv[1], (double)(stress_now_ms() - t0) / 1000);
        return stress_exit_status(argv[1]);
    }
    fprintf(stderr, "usage: %s SCENARIO (", argv[0]);
    for (size_t i = 0; i < sizeof scenarios / sizeof *scenarios; i++)
        fprintf(stderr, "%s%s", i ? "|" : "", scenarios[i].name);
    fprintf(stderr, ")\n");
    return 2;
}
