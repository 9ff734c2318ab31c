/* SPDX-License-Identifier: Apache-2.0 */
/* Engine stress under ThreadSanitizer: against a target engine in a child process, four threads
 * move random READ/WRITE batches and check every byte, while others ping-pong notifications,
 * reopen and refresh the segment, connect to and disconnect from a second target, read stats,
 * and register and unregister memory.
 * Usage: engine_stress tcp|auto [seconds]. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stress.h"

#define WORKERS  4
#define SLICE    (STRESS_REGION_LEN / 2) /* each RW region of the target serves two workers */
#define MAX_REQS 8
#define SEED     4242

typedef struct {
    const char *protocol;
    kvb_engine_t *e;
    stress_target_t t;
    stress_target_t t2; /* opened and closed in full, over and over, while t carries the load */
    kvb_segment_t seg;
    uint64_t incarnation;
    atomic_bool stop;
    atomic_ullong notified; /* batches whose notification the target has queued */
} run_t;

typedef struct {
    run_t *r;
    int id;
    uint8_t *local;  /* SLICE bytes of registered memory, this worker's alone */
    uint8_t *shadow; /* what the worker's remote slice holds */
    uint64_t remote; /* the remote slice */
    uint64_t rs;
    unsigned long long batches, bytes;
} worker_t;

typedef struct {
    run_t *r;
    unsigned long long rounds;
} helper_t;

/* Mostly small requests, some medium, a few up to 1 MiB: small ones batch, large ones spread. */
static uint64_t pick_len(uint64_t *rs, uint64_t cap)
{
    uint64_t k = stress_rand_below(rs, 8), len;
    if (k < 4)
        len = 1 + stress_rand_below(rs, 4096);
    else if (k < 7)
        len = 4097 + stress_rand_below(rs, 60 << 10);
    else
        len = 1 + stress_rand_below(rs, 1 << 20);
    return len < cap ? len : cap;
}

static void one_batch(worker_t *w)
{
    run_t *r = w->r;
    kvb_request_t reqs[MAX_REQS];
    size_t n = 1 + stress_rand_below(&w->rs, MAX_REQS);
    uint64_t slot = SLICE / n;
    for (size_t i = 0; i < n; i++) {
        uint64_t len = pick_len(&w->rs, slot);
        uint64_t off = i * slot + stress_rand_below(&w->rs, slot - len + 1);
        kvb_opcode_t op = stress_rand_below(&w->rs, 2) ? KVB_OP_WRITE : KVB_OP_READ;
        if (op == KVB_OP_WRITE)
            stress_random_fill(w->local + off, len, &w->rs);
        else
            memset(w->local + off, 0xA5, len);
        reqs[i] = (kvb_request_t){op, w->local + off, r->seg, w->remote + off, len};
    }
    kvb_batch_opts_t o = {0};
    bool notify = stress_rand_below(&w->rs, 4) == 0;
    if (notify)
        o = (kvb_batch_opts_t){.notify_segment = r->seg, .notify = "batch", .notify_len = 5};
    kvb_batch_t *b;
    int rc = kvb_batch_submit(r->e, reqs, n, &o, &b);
    CHECK(rc == KVB_OK, "worker %d: submit: %s", w->id, kvb_status_name(rc));
    if (rc)
        return;
    rc = stress_wait(b, (int)stress_rand_below(&w->rs, 3), 200);
    CHECK(rc == KVB_OK, "worker %d: wait: %s", w->id, kvb_status_name(rc));
    for (size_t i = 0; i < n && rc == KVB_OK; i++) {
        kvb_req_status_t st;
        CHECK_RC(kvb_batch_status(b, i, &st), KVB_OK);
        CHECK(st.state == KVB_REQ_COMPLETED && st.bytes == reqs[i].len,
              "worker %d: request %zu: state %d bytes %llu of %zu", w->id, i, (int)st.state,
              (unsigned long long)st.bytes, reqs[i].len);
        uint64_t off = (uint64_t)((uint8_t *)reqs[i].local - w->local);
        if (reqs[i].opcode == KVB_OP_WRITE) {
            memcpy(w->shadow + off, w->local + off, reqs[i].len);
        } else {
            int64_t bad = stress_first_diff(w->local + off, w->shadow + off, reqs[i].len);
            CHECK(bad < 0, "worker %d: READ of %zu bytes at slice offset %llu: byte %lld differs",
                  w->id, reqs[i].len, (unsigned long long)off, (long long)bad);
        }
        w->bytes += reqs[i].len;
    }
    kvb_batch_free(b);
    if (rc == KVB_OK && notify)
        atomic_fetch_add(&r->notified, 1);
    w->batches++;
}

/* Reads the whole slice back: every WRITE of the run must have landed where it was sent. */
static void verify_slice(worker_t *w)
{
    run_t *r = w->r;
    const uint64_t chunk = 1 << 20;
    kvb_request_t reqs[SLICE / (1 << 20)];
    size_t n = SLICE / chunk;
    memset(w->local, 0x5A, SLICE);
    for (size_t i = 0; i < n; i++)
        reqs[i] = (kvb_request_t){KVB_OP_READ, w->local + i * chunk, r->seg, w->remote + i * chunk,
                                  chunk};
    kvb_batch_t *b;
    int rc = kvb_batch_submit(r->e, reqs, n, NULL, &b);
    CHECK(rc == KVB_OK, "worker %d: final submit: %s", w->id, kvb_status_name(rc));
    if (rc)
        return;
    CHECK_RC(kvb_batch_wait(b, -1), KVB_OK);
    kvb_batch_free(b);
    int64_t bad = stress_first_diff(w->local, w->shadow, SLICE);
    CHECK(bad < 0, "worker %d: remote slice differs at offset %lld after the run", w->id,
          (long long)bad);
}

static void *worker_main(void *arg)
{
    worker_t *w = arg;
    while (!atomic_load(&w->r->stop))
        one_batch(w);
    verify_slice(w);
    return NULL;
}

/* Ping-pong: every ping is answered by the target on its own connection back to us. */
static void *notifier_main(void *arg)
{
    helper_t *h = arg;
    run_t *r = h->r;
    kvb_notification_t *n = malloc(sizeof *n);
    CHECK(n != NULL, "malloc");
    for (unsigned long long k = 1; n && !atomic_load(&r->stop); k++) {
        char msg[64], want[64];
        int len = snprintf(msg, sizeof msg, "ping %llu", k);
        snprintf(want, sizeof want, "pong %llu", k);
        int rc = kvb_notify_send(r->e, r->seg, msg, (size_t)len, 10000);
        CHECK(rc == KVB_OK, "notify_send: %s", kvb_status_name(rc));
        if (rc)
            break;
        rc = kvb_notify_recv(r->e, n, 20000);
        CHECK(rc == KVB_OK, "notify_recv: %s", kvb_status_name(rc));
        if (rc)
            break;
        CHECK(n->len == strlen(want) && !memcmp(n->data, want, n->len), "got '%.*s', want '%s'",
              (int)n->len, (const char *)n->data, want);
        CHECK(!strcmp(n->from, r->t.name), "from '%s', want '%s'", n->from, r->t.name);
        h->rounds++;
    }
    free(n);
    return NULL;
}

static void check_regions(run_t *r, const kvb_region_info_t *info, size_t count)
{
    const struct {
        uint64_t addr, len;
        unsigned access;
    } want[3] = {{r->t.shm_addr, STRESS_REGION_LEN, KVB_ACCESS_RW},
                 {r->t.plain_addr, STRESS_REGION_LEN, KVB_ACCESS_RW},
                 {r->t.ro_addr, STRESS_RO_LEN, KVB_ACCESS_READ}};
    /* The target's churn thread adds and removes a fourth region all the time. */
    CHECK(count == 3 || count == 4, "segment has %zu regions, want 3 or 4", count);
    for (size_t k = 0; k < 3; k++) {
        bool found = false;
        for (size_t i = 0; i < count && i < 8; i++)
            found |= info[i].addr == want[k].addr && info[i].len == want[k].len &&
                     info[i].access == want[k].access;
        CHECK(found, "region %zu (0x%llx) missing from the region list", k,
              (unsigned long long)want[k].addr);
    }
}

/* Connects to the second target, reads from it, refreshes it and closes its last reference:
 * connection set-up and teardown (and for "auto" the same-host link) under the workers' load. */
static void second_target(run_t *r, uint8_t *buf, uint8_t *expect, uint64_t *rs)
{
    kvb_segment_t s;
    int rc = kvb_segment_open(r->e, r->t2.name, &s);
    CHECK(rc == KVB_OK, "open second target: %s", kvb_status_name(rc));
    if (rc)
        return;
    CHECK(s != r->seg, "two targets, one handle");
    size_t len = 1 + stress_rand_below(rs, 64 << 10);
    uint64_t off = stress_rand_below(rs, STRESS_RO_LEN - len + 1);
    kvb_request_t q = {KVB_OP_READ, buf, s, r->t2.ro_addr + off, len};
    kvb_batch_t *b;
    rc = kvb_batch_submit(r->e, &q, 1, NULL, &b);
    CHECK(rc == KVB_OK, "submit to second target: %s", kvb_status_name(rc));
    if (rc == KVB_OK) {
        CHECK_RC(kvb_batch_wait(b, -1), KVB_OK);
        kvb_batch_free(b);
        stress_pattern_fill(expect, off, len, r->t2.seed + 2);
        int64_t bad = stress_first_diff(buf, expect, len);
        CHECK(bad < 0, "READ of %zu bytes from the second target: byte %lld differs", len,
              (long long)bad);
    }
    size_t count = 0;
    CHECK_RC(kvb_segment_regions(r->e, s, 1, NULL, 0, &count), KVB_OK);
    CHECK(count == 3, "second target has %zu regions", count);
    CHECK_RC(kvb_segment_close(r->e, s), KVB_OK);
}

/* Opens a second reference, looks at the segment through it (cached and refreshed), closes it;
 * every other round does the same with a second target, in full. */
static void *segmenter_main(void *arg)
{
    helper_t *h = arg;
    run_t *r = h->r;
    const char *want_tp = strcmp(r->protocol, "tcp") ? "shm" : "tcp";
    kvb_stats_t prev = {0};
    uint64_t rs = 99;
    uint8_t *buf = stress_map(64 << 10), *expect = malloc(64 << 10);
    CHECK(buf && expect, "out of memory");
    if (!buf || !expect)
        return NULL;
    CHECK_RC(kvb_register(r->e, buf, 64 << 10, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    for (unsigned i = 0; !atomic_load(&r->stop); i++) {
        if (i % 2)
            second_target(r, buf, expect, &rs);
        kvb_segment_t s;
        int rc = kvb_segment_open(r->e, r->t.name, &s);
        CHECK(rc == KVB_OK, "reopen: %s", kvb_status_name(rc));
        if (rc)
            break;
        CHECK(s == r->seg, "reopen gave handle %u, want %u", s, r->seg);
        kvb_region_info_t info[8];
        size_t count = 0;
        CHECK_RC(kvb_segment_regions(r->e, s, (int)(i % 2), info, 8, &count), KVB_OK);
        check_regions(r, info, count);
        if (i % 4 == 3)
            CHECK_RC(kvb_segment_refresh(r->e, s), KVB_OK);
        char val[64];
        size_t vlen;
        rc = kvb_segment_attr(r->e, s, "churn", val, sizeof val, &vlen);
        CHECK(rc == KVB_OK || rc == KVB_ERR_NOT_FOUND, "attr: %s", kvb_status_name(rc));
        const char *tp = NULL;
        CHECK_RC(kvb_segment_transport(r->e, s, &tp), KVB_OK);
        CHECK(tp && !strcmp(tp, want_tp), "transport %s, want %s", tp ? tp : "(null)", want_tp);
        uint64_t inc = 0;
        CHECK_RC(kvb_segment_incarnation(r->e, s, &inc), KVB_OK);
        CHECK(inc == r->incarnation, "incarnation changed");
        kvb_stats_t st;
        CHECK_RC(kvb_engine_stats(r->e, &st), KVB_OK);
        CHECK(st.requests_completed >= prev.requests_completed &&
                  kvb_stats_bytes(&st, "tcp") >= kvb_stats_bytes(&prev, "tcp") &&
                  kvb_stats_bytes(&st, "shm") >= kvb_stats_bytes(&prev, "shm"),
              "stats went backwards");
        prev = st;
        CHECK_RC(kvb_segment_close(r->e, s), KVB_OK);
        h->rounds++;
        stress_sleep_us(1000);
    }
    CHECK_RC(kvb_unregister(r->e, buf), KVB_OK);
    stress_unmap(buf, 64 << 10);
    free(expect);
    return NULL;
}

/* Registers fresh memory (kvb_alloc and plain in turn), reads into it, unregisters it. */
static void *registrar_main(void *arg)
{
    helper_t *h = arg;
    run_t *r = h->r;
    uint64_t rs = 77;
    uint8_t *expect = malloc(256 << 10);
    CHECK(expect != NULL, "malloc");
    for (unsigned i = 0; expect && !atomic_load(&r->stop); i++) {
        size_t len = 4096 * (1 + stress_rand_below(&rs, 64));
        bool shm = i % 2 == 0;
        uint8_t *buf = NULL;
        if (shm)
            CHECK_RC(kvb_alloc(r->e, len, 0, (void **)&buf), KVB_OK);
        else
            buf = stress_map(len);
        if (!buf)
            break;
        CHECK_RC(kvb_register(r->e, buf, len, "cpu:0", KVB_ACCESS_RW), KVB_OK);
        bool probe = i % 16 == 0; /* the error paths, now and then (each logs a warning) */
        if (probe)
            CHECK_RC(kvb_register(r->e, buf, len, "cpu:0", KVB_ACCESS_RW), KVB_ERR_OVERLAP);
        uint64_t off = stress_rand_below(&rs, STRESS_RO_LEN - len + 1);
        kvb_request_t req = {KVB_OP_READ, buf, r->seg, r->t.ro_addr + off, len};
        kvb_batch_t *b;
        int rc = kvb_batch_submit(r->e, &req, 1, NULL, &b);
        CHECK(rc == KVB_OK, "registrar: submit: %s", kvb_status_name(rc));
        if (rc == KVB_OK) {
            CHECK_RC(kvb_batch_wait(b, -1), KVB_OK);
            kvb_batch_free(b);
            stress_pattern_fill(expect, off, len, r->t.seed + 2);
            int64_t bad = stress_first_diff(buf, expect, len);
            CHECK(bad < 0, "registrar: READ of %zu bytes from RO+%llu: byte %lld differs", len,
                  (unsigned long long)off, (long long)bad);
        }
        CHECK_RC(kvb_unregister(r->e, buf), KVB_OK);
        if (probe)
            CHECK_RC(kvb_batch_submit(r->e, &req, 1, NULL, &b), KVB_ERR_LOCAL_NOT_REGISTERED);
        if (shm)
            CHECK_RC(kvb_free(r->e, buf), KVB_OK);
        else
            stress_unmap(buf, len);
        h->rounds++;
    }
    free(expect);
    return NULL;
}

static void final_checks(run_t *r, unsigned long long batches)
{
    /* The target counts "batch" notifications in arrival order; ours were all queued at the
     * target before their batches completed, so this question is answered after all of them. */
    kvb_notification_t *n = malloc(sizeof *n);
    CHECK(n != NULL, "malloc");
    if (n) {
        CHECK_RC(kvb_notify_send(r->e, r->seg, "count", 5, 10000), KVB_OK);
        CHECK_RC(kvb_notify_recv(r->e, n, 20000), KVB_OK);
        char want[64];
        snprintf(want, sizeof want, "count %llu", atomic_load(&r->notified));
        CHECK(n->len == strlen(want) && !memcmp(n->data, want, n->len), "got '%.*s', want '%s'",
              (int)n->len, (const char *)n->data, want);
        free(n);
    }
    kvb_stats_t st;
    CHECK_RC(kvb_engine_stats(r->e, &st), KVB_OK);
    CHECK(st.requests_failed == 0, "%llu requests failed", (unsigned long long)st.requests_failed);
    CHECK(st.requests_completed >= batches, "only %llu requests completed",
          (unsigned long long)st.requests_completed);
    if (!strcmp(r->protocol, "tcp"))
        CHECK(kvb_stats_bytes(&st, "shm") == 0 && kvb_stats_bytes(&st, "tcp") > 0,
              "tcp run: %llu bytes over tcp, %llu shm",
              (unsigned long long)kvb_stats_bytes(&st, "tcp"),
              (unsigned long long)kvb_stats_bytes(&st, "shm"));
    else
        CHECK(kvb_stats_bytes(&st, "shm") > 0, "auto run moved nothing through shared memory");
}

static void run(const char *protocol, unsigned seconds)
{
    static run_t r; /* large enough to keep off the stack; one run at a time */
    memset(&r, 0, sizeof r);
    r.protocol = protocol;
    if (stress_target_start(&r.t, protocol, SEED, true)) {
        stress_fail(__FILE__, __LINE__, "%s: target did not start", protocol);
        return;
    }
    if (stress_target_start(&r.t2, protocol, SEED + 100, false)) {
        stress_fail(__FILE__, __LINE__, "%s: second target did not start", protocol);
        stress_target_kill(&r.t);
        return;
    }
    kvb_config_t cfg;
    stress_config(&cfg, protocol);
    cfg.progress_threads = 2;
    cfg.copy_threads = 2;
    int rc = kvb_engine_create(&cfg, &r.e);
    CHECK(rc == KVB_OK, "engine: %s", kvb_status_name(rc));
    if (rc) {
        stress_target_kill(&r.t);
        stress_target_kill(&r.t2);
        return;
    }
    CHECK_RC(kvb_segment_open(r.e, r.t.name, &r.seg), KVB_OK);
    CHECK_RC(kvb_segment_incarnation(r.e, r.seg, &r.incarnation), KVB_OK);

    /* Workers 0 and 1 use kvb_alloc memory, 2 and 3 plain memory; even workers write the
     * target's kvb_alloc region, odd ones its plain region: every pairing of the same-host path. */
    uint8_t *alloc_buf = NULL, *plain_buf = stress_map(2 * SLICE);
    CHECK_RC(kvb_alloc(r.e, 2 * SLICE, 0, (void **)&alloc_buf), KVB_OK);
    CHECK(plain_buf != NULL, "mmap");
    CHECK_RC(kvb_register(r.e, alloc_buf, 2 * SLICE, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    CHECK_RC(kvb_register(r.e, plain_buf, 2 * SLICE, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    worker_t w[WORKERS];
    for (int i = 0; i < WORKERS; i++) {
        uint64_t slice = (uint64_t)(i / 2) * SLICE;
        bool to_shm = i % 2 == 0;
        w[i] = (worker_t){.r = &r,
                          .id = i,
                          .local = (i < 2 ? alloc_buf : plain_buf) + (i % 2) * SLICE,
                          .shadow = malloc(SLICE),
                          .remote = (to_shm ? r.t.shm_addr : r.t.plain_addr) + slice,
                          .rs = 1000 + (uint64_t)i};
        CHECK(w[i].shadow != NULL, "malloc");
        stress_pattern_fill(w[i].shadow, slice, SLICE, to_shm ? SEED : SEED + 1);
    }
    if (stress_failures) {
        stress_target_kill(&r.t);
        stress_target_kill(&r.t2);
        return;
    }

    uint64_t t0 = stress_now_ms();
    pthread_t tw[WORKERS], tn, ts, tr;
    helper_t hn = {&r, 0}, hs = {&r, 0}, hr = {&r, 0};
    for (int i = 0; i < WORKERS; i++)
        pthread_create(&tw[i], NULL, worker_main, &w[i]);
    pthread_create(&tn, NULL, notifier_main, &hn);
    pthread_create(&ts, NULL, segmenter_main, &hs);
    pthread_create(&tr, NULL, registrar_main, &hr);
    stress_sleep_us((uint64_t)seconds * 1000000u);
    atomic_store(&r.stop, true);
    unsigned long long batches = 0, bytes = 0;
    for (int i = 0; i < WORKERS; i++) {
        pthread_join(tw[i], NULL);
        batches += w[i].batches;
        bytes += w[i].bytes;
        free(w[i].shadow);
    }
    pthread_join(tn, NULL);
    pthread_join(ts, NULL);
    pthread_join(tr, NULL);
    final_checks(&r, batches);
    fprintf(stderr,
            "%s: %.1f s: %llu batches, %llu MiB checked, %llu pings, %llu reopens, %llu "
            "registrations\n",
            protocol, (double)(stress_now_ms() - t0) / 1000, batches, bytes >> 20, hn.rounds,
            hs.rounds, hr.rounds);

    CHECK_RC(kvb_unregister(r.e, alloc_buf), KVB_OK);
    CHECK_RC(kvb_unregister(r.e, plain_buf), KVB_OK);
    CHECK_RC(kvb_free(r.e, alloc_buf), KVB_OK);
    CHECK_RC(kvb_segment_close(r.e, r.seg), KVB_OK);
    kvb_engine_destroy(r.e);
    stress_unmap(plain_buf, 2 * SLICE);
    int st = stress_target_stop(&r.t);
    CHECK(st == 0, "target exited with %d", st);
    st = stress_target_stop(&r.t2);
    CHECK(st == 0, "second target exited with %d", st);
}

int main(int argc, char **argv)
{
    int rc = stress_target_main(argc, argv);
    if (rc >= 0)
        return rc;
    if (argc < 2 || (strcmp(argv[1], "tcp") && strcmp(argv[1], "auto"))) {
        fprintf(stderr, "usage: %s tcp|auto [seconds]\n", argv[0]);
        return 2;
    }
    unsigned seconds = argc > 2 ? (unsigned)atoi(argv[2]) : 15;
    run(argv[1], seconds);
    return stress_exit_status(argv[1]);
}
