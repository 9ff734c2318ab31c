/* SPDX-License-Identifier: Apache-2.0 */
/* Two real processes over loopback TCP: random sizes and offsets, READ and WRITE, many batches
 * and threads with every byte verified, and the failure cases (peer killed, stopped, restarted,
 * bad remote addresses, notifications). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/peer.h"
#include "kvbridge/engine.h"

#define SEED 1234

static test_peer_t peer;
static kvb_engine_t *eng;
static uint8_t *buf; /* local registered buffer, as large as the peer's RW region */
static kvb_segment_t seg;

static void start(void)
{
    cr_assert_eq(test_peer_start(&peer, 0, SEED, "tcp"), 0, "peer did not start");
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.timeout_ms = 10000;
    cfg.protocol = "tcp"; /* same host: without this, the data would go through shared memory */
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    buf = mmap(NULL, TEST_PEER_RW_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(buf, MAP_FAILED);
    cr_assert_eq(kvb_register(eng, buf, TEST_PEER_RW_LEN, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_OK);
}

static void stop(void)
{
    kvb_engine_destroy(eng);
    munmap(buf, TEST_PEER_RW_LEN);
    test_peer_stop(&peer);
}

TestSuite(tcp_peer, .init = start, .fini = stop, .timeout = 120);

static int run_batch(const kvb_request_t *r, size_t n, const kvb_batch_opts_t *o)
{
    kvb_batch_t *b;
    int rc = kvb_batch_submit(eng, r, n, o, &b);
    if (rc)
        return rc;
    rc = kvb_batch_wait(b, -1);
    kvb_batch_free(b);
    return rc;
}

static void expect_notification(const char *want, int timeout_ms)
{
    kvb_notification_t *n = malloc(sizeof *n);
    cr_assert_eq(kvb_notify_recv(eng, n, timeout_ms), KVB_OK, "no notification");
    cr_assert_eq(n->len, strlen(want), "got '%.*s'", (int)n->len, n->data);
    cr_assert_eq(memcmp(n->data, want, n->len), 0, "got '%.*s'", (int)n->len, n->data);
    cr_assert_str_eq(n->from, peer.name);
    free(n);
}

Test(tcp_peer, handshake_learns_regions)
{
    kvb_region_info_t r[4];
    size_t count = 0;
    cr_assert_eq(kvb_segment_regions(eng, seg, 0, r, 4, &count), KVB_OK);
    cr_assert_eq(count, 2);
    int rw = r[0].addr == peer.rw_addr ? 0 : 1;
    cr_assert_eq(r[rw].addr, peer.rw_addr);
    cr_assert_eq(r[rw].len, TEST_PEER_RW_LEN);
    cr_assert_eq(r[rw].access, KVB_ACCESS_RW);
    cr_assert_str_eq(r[rw].location, "cpu:0");
    cr_assert_eq(r[1 - rw].access, KVB_ACCESS_READ);
    cr_assert_eq(kvb_segment_regions(eng, seg, 1, r, 4, &count), KVB_OK, "refresh");
    cr_assert_eq(count, 2);
    kvb_segment_t again;
    cr_assert_eq(kvb_segment_open(eng, peer.name, &again), KVB_OK);
    cr_assert_eq(again, seg, "a second open returns the same handle");
    cr_assert_eq(kvb_segment_close(eng, again), KVB_OK);
}

/* Random size from 1 B to 8 MiB, log-uniform so that small and large both get exercised. */
static uint64_t rand_size(uint64_t *rs, uint64_t max)
{
    uint64_t bits = test_rand(rs) % 24; /* up to 2^23 = 8 MiB */
    uint64_t v = 1 + test_rand(rs) % (1ull << bits);
    return v < max ? v : max;
}

typedef struct {
    uint64_t off, len; /* an area of the peer's RW region owned by one thread */
    uint64_t seed;
    int failures;
} area_t;

/* READs random ranges and checks them against the peer's pattern. */
static void *reader(void *arg)
{
    area_t *a = arg;
    uint64_t rs = a->seed;
    for (int round = 0; round < 12; round++) {
        kvb_request_t r[8];
        size_t n = 1 + test_rand(&rs) % 8;
        for (size_t i = 0; i < n; i++) {
            uint64_t len = rand_size(&rs, a->len / n);
            uint64_t slot = a->len / n;
            uint64_t off = a->off + i * slot + test_rand(&rs) % (slot - len + 1);
            r[i] = (kvb_request_t){KVB_OP_READ, buf + off, seg, peer.rw_addr + off, len};
            memset(buf + off, 0xEE, len);
        }
        if (run_batch(r, n, NULL) != KVB_OK)
            a->failures++;
        for (size_t i = 0; i < n; i++) {
            uint64_t off = (uint64_t)((uint8_t *)r[i].local - buf);
            if (test_pattern_check(buf + off, off, r[i].len, SEED) >= 0)
                a->failures++;
        }
    }
    return NULL;
}

Test(tcp_peer, random_reads_from_threads_verified)
{
    enum { T = 4 };
    pthread_t tid[T];
    area_t a[T];
    for (int t = 0; t < T; t++) {
        a[t] = (area_t){.off = (uint64_t)t * (TEST_PEER_RW_LEN / T),
                        .len = TEST_PEER_RW_LEN / T,
                        .seed = 77 + (uint64_t)t};
        pthread_create(&tid[t], NULL, reader, &a[t]);
    }
    for (int t = 0; t < T; t++) {
        pthread_join(tid[t], NULL);
        cr_expect_eq(a[t].failures, 0, "thread %d: %d failures", t, a[t].failures);
    }
}

/* WRITEs random ranges of a new pattern, then has the peer check them and READs them back. */
static void *writer(void *arg)
{
    area_t *a = arg;
    uint64_t rs = a->seed, wseed = a->seed * 1000;
    for (int round = 0; round < 8; round++) {
        kvb_request_t r[8];
        size_t n = 1 + test_rand(&rs) % 8;
        uint64_t slot = a->len / n;
        for (size_t i = 0; i < n; i++) {
            uint64_t len = rand_size(&rs, slot);
            uint64_t off = a->off + i * slot + test_rand(&rs) % (slot - len + 1);
            test_pattern_fill(buf + off, off, len, wseed);
            r[i] = (kvb_request_t){KVB_OP_WRITE, buf + off, seg, peer.rw_addr + off, len};
        }
        if (run_batch(r, n, NULL) != KVB_OK)
            a->failures++;
        for (size_t i = 0; i < n; i++) { /* read back into the same place, poisoned first */
            uint64_t off = (uint64_t)((uint8_t *)r[i].local - buf);
            memset(buf + off, 0x11, r[i].len);
            r[i].opcode = KVB_OP_READ;
        }
        if (run_batch(r, n, NULL) != KVB_OK)
            a->failures++;
        for (size_t i = 0; i < n; i++) {
            uint64_t off = (uint64_t)((uint8_t *)r[i].local - buf);
            if (test_pattern_check(buf + off, off, r[i].len, wseed) >= 0)
                a->failures++;
        }
    }
    return NULL;
}

Test(tcp_peer, random_writes_from_threads_verified)
{
    enum { T = 3 };
    pthread_t tid[T];
    area_t a[T];
    for (int t = 0; t < T; t++) {
        a[t] = (area_t){.off = (uint64_t)t * (TEST_PEER_RW_LEN / T),
                        .len = TEST_PEER_RW_LEN / T,
                        .seed = 900 + (uint64_t)t};
        pthread_create(&tid[t], NULL, writer, &a[t]);
    }
    for (int t = 0; t < T; t++) {
        pthread_join(tid[t], NULL);
        cr_expect_eq(a[t].failures, 0, "thread %d: %d failures", t, a[t].failures);
    }
}

Test(tcp_peer, notification_arrives_after_the_data)
{
    /* One batch writes 6 MiB and carries a notification; the peer checks its memory when the
     * notification arrives and answers. */
    uint64_t off = 1 << 20, len = 6 << 20, wseed = 4242;
    test_pattern_fill(buf + off, off, len, wseed);
    kvb_request_t r[3];
    for (int i = 0; i < 3; i++)
        r[i] = (kvb_request_t){KVB_OP_WRITE, buf + off + (uint64_t)i * (2 << 20), seg,
                               peer.rw_addr + off + (uint64_t)i * (2 << 20), 2 << 20};
    char msg[80];
    snprintf(msg, sizeof msg, "verify %d %llu %llu", (int)wseed, (unsigned long long)off,
             (unsigned long long)len);
    kvb_batch_opts_t o = {.notify_segment = seg, .notify = msg, .notify_len = strlen(msg)};
    cr_assert_eq(run_batch(r, 3, &o), KVB_OK);
    expect_notification("ok", 5000);

    cr_assert_eq(kvb_notify_send(eng, seg, "ping", 4, 2000), KVB_OK);
    expect_notification("pong", 5000);
}

Test(tcp_peer, bad_remote_ranges_fail_only_their_request)
{
    uint64_t ro_end = peer.ro_addr + TEST_PEER_RO_LEN;
    kvb_request_t r[] = {
        {KVB_OP_READ, buf, seg, peer.rw_addr, 4096},
        {KVB_OP_READ, buf + 8192, seg, peer.rw_addr + TEST_PEER_RW_LEN - 10, 11}, /* 1 B past */
        {KVB_OP_READ, buf + 16384, seg, 0x1000, 64},                              /* unregistered */
        {KVB_OP_WRITE, buf + 32768, seg, peer.ro_addr, 64},                       /* read-only */
        {KVB_OP_READ, buf + 65536, seg, ro_end - 100, 100},                       /* ok */
        {KVB_OP_WRITE, buf + 131072, seg, UINT64_MAX - 10, 10},                   /* wraps */
    };
    const int want[] = {
        KVB_OK, KVB_ERR_REMOTE_NOT_REGISTERED, KVB_ERR_REMOTE_NOT_REGISTERED, KVB_ERR_ACCESS_DENIED,
        KVB_OK, KVB_ERR_REMOTE_NOT_REGISTERED};
    size_t n = sizeof r / sizeof r[0];
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, r, n, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, 5000), KVB_ERR_REMOTE_NOT_REGISTERED);
    for (size_t i = 0; i < n; i++) {
        kvb_req_status_t st;
        cr_assert_eq(kvb_batch_status(b, i, &st), KVB_OK);
        cr_expect_eq(st.error, want[i], "request %zu: %s", i, kvb_status_name(st.error));
        cr_expect_eq(st.state, want[i] ? KVB_REQ_FAILED : KVB_REQ_COMPLETED);
    }
    kvb_batch_free(b);
    cr_expect_eq(test_pattern_check(buf, 0, 4096, SEED), -1);
    cr_expect_eq(test_pattern_check(buf + 65536, TEST_PEER_RO_LEN - 100, 100, SEED + 1), -1);
    /* The connection is still good. */
    kvb_request_t ok = {KVB_OP_READ, buf, seg, peer.rw_addr + 100, 1000};
    cr_assert_eq(run_batch(&ok, 1, NULL), KVB_OK);
}

Test(tcp_peer, bad_local_range_submits_nothing)
{
    uint8_t stack[64];
    kvb_request_t r[] = {{KVB_OP_READ, buf, seg, peer.rw_addr, 64},
                         {KVB_OP_READ, stack, seg, peer.rw_addr, 64}};
    kvb_batch_t *b = NULL;
    cr_assert_eq(kvb_batch_submit(eng, r, 2, NULL, &b), KVB_ERR_LOCAL_NOT_REGISTERED);
    cr_assert_null(b);
    r[1] = (kvb_request_t){KVB_OP_READ, buf + TEST_PEER_RW_LEN - 8, seg, peer.rw_addr, 64};
    cr_assert_eq(kvb_batch_submit(eng, r, 2, NULL, &b), KVB_ERR_LOCAL_NOT_REGISTERED);
    r[1] = (kvb_request_t){KVB_OP_READ, buf, 999, peer.rw_addr, 64};
    cr_assert_eq(kvb_batch_submit(eng, r, 2, NULL, &b), KVB_ERR_BAD_SEGMENT);
    r[1] = (kvb_request_t){KVB_OP_READ, buf, seg, peer.rw_addr, 0};
    cr_assert_eq(kvb_batch_submit(eng, r, 2, NULL, &b), KVB_ERR_INVALID_ARG);
}

Test(tcp_peer, peer_killed_mid_batch_fails_fast_and_reopen_works)
{
    /* Enough reads to keep the wire busy for a while. */
    enum { N = 256 };
    kvb_request_t r[N];
    for (int i = 0; i < N; i++)
        r[i] = (kvb_request_t){KVB_OP_READ, buf + (uint64_t)(i % 4) * (8 << 20), seg,
                               peer.rw_addr + (uint64_t)(i % 4) * (8 << 20), 8 << 20};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, r, N, NULL, &b), KVB_OK);
    usleep(20000);
    uint16_t port = test_peer_port(&peer);
    uint64_t old_inc;
    cr_assert_eq(kvb_segment_incarnation(eng, seg, &old_inc), KVB_OK);
    uint64_t t0 = kvb__now_ns();
    test_peer_signal(&peer, SIGKILL);
    int rc = kvb_batch_wait(b, 5000);
    double secs = (double)(kvb__now_ns() - t0) / 1e9;
    cr_assert_eq(rc, KVB_ERR_PEER_LOST, "wait gave %s", kvb_status_name(rc));
    cr_assert_lt(secs, 2.0, "took %.2f s", secs);
    int failed = 0;
    for (int i = 0; i < N; i++) {
        kvb_req_status_t st;
        kvb_batch_status(b, (size_t)i, &st);
        cr_assert_neq(st.state, KVB_REQ_PENDING);
        if (st.state == KVB_REQ_FAILED) {
            cr_assert_eq(st.error, KVB_ERR_PEER_LOST);
            failed++;
        }
    }
    cr_assert_gt(failed, 0);
    kvb_batch_free(b);

    /* Later submissions fail at once, until reopened. */
    t0 = kvb__now_ns();
    cr_assert_eq(run_batch(r, 1, NULL), KVB_ERR_PEER_LOST);
    cr_assert_lt(kvb__now_ns() - t0, 200000000ull);

    /* A new process under the same name: reopening links to the new incarnation. */
    cr_assert_eq(test_peer_start(&peer, port, SEED + 7, "tcp"), 0);
    kvb_segment_t again;
    cr_assert_eq(kvb_segment_open(eng, peer.name, &again), KVB_OK);
    cr_assert_eq(again, seg);
    uint64_t new_inc;
    cr_assert_eq(kvb_segment_incarnation(eng, seg, &new_inc), KVB_OK);
    cr_assert_neq(new_inc, old_inc);
    kvb_request_t one = {KVB_OP_READ, buf, seg, peer.rw_addr + 4096, 65536};
    int rc1 = run_batch(&one, 1, NULL);
    cr_assert_eq(rc1, KVB_OK, "read after reopen: %s", kvb_status_name(rc1));
    cr_assert_eq(test_pattern_check(buf, 4096, 65536, SEED + 7), -1);
}

Test(tcp_peer, stopped_peer_times_out_then_recovers)
{
    test_peer_signal(&peer, SIGSTOP);
    kvb_request_t r = {KVB_OP_READ, buf, seg, peer.rw_addr, 1 << 20};
    kvb_batch_opts_t o = {.timeout_ms = 300};
    kvb_batch_t *b;
    uint64_t t0 = kvb__now_ns();
    cr_assert_eq(kvb_batch_submit(eng, &r, 1, &o, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, -1), KVB_ERR_TIMEOUT);
    double secs = (double)(kvb__now_ns() - t0) / 1e9;
    cr_assert(secs >= 0.29 && secs < 1.5, "timed out after %.2f s", secs);
    kvb_req_status_t st;
    kvb_batch_status(b, 0, &st);
    cr_assert_eq(st.state, KVB_REQ_TIMEOUT);
    /* Settled at once: the lane keeps the request until the stopped peer answers, but that
     * answer's bytes are dropped (checked below, once the peer runs again). */
    cr_assert_eq(kvb_batch_settle(b, 0), KVB_OK);
    cr_assert_eq(kvb_batch_settle(b, -1), KVB_ERR_INVALID_ARG);
    kvb_batch_free(b);

    /* A WRITE is not settled until the peer acknowledged it (it writes what is there). */
    test_pattern_fill(buf, 0, 4096, SEED);
    kvb_request_t w = {KVB_OP_WRITE, buf, seg, peer.rw_addr, 4096};
    cr_assert_eq(kvb_batch_submit(eng, &w, 1, &o, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, -1), KVB_ERR_TIMEOUT);
    cr_assert_eq(kvb_batch_settle(b, 0), KVB_ERR_AGAIN);
    test_peer_signal(&peer, SIGCONT);
    int src = kvb_batch_settle(b, 5000);
    cr_assert_eq(src, KVB_OK, "settle: %s", kvb_status_name(src));
    kvb_batch_free(b);
    test_peer_signal(&peer, SIGSTOP);

    /* A cancelled batch on the stopped peer. */
    cr_assert_eq(kvb_batch_submit(eng, &r, 1, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, 50), KVB_ERR_AGAIN);
    cr_assert_eq(kvb_batch_cancel(b), KVB_OK);
    kvb_batch_status(b, 0, &st);
    cr_assert_eq(st.state, KVB_REQ_CANCELED);
    cr_assert_eq(kvb_batch_wait(b, 0), KVB_ERR_CANCELED);
    kvb_batch_free(b);

    /* The late answers are discarded; new requests on the same lanes complete correctly. */
    memset(buf, 0, 2 << 20);
    test_peer_signal(&peer, SIGCONT);
    r = (kvb_request_t){KVB_OP_READ, buf + (2 << 20), seg, peer.rw_addr + 12345, 100000};
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(buf + (2 << 20), 12345, 100000, SEED), -1);
    for (int i = 0; i < (1 << 20); i++)
        cr_assert_eq(buf[i], 0, "a discarded reply landed at %d", i);
}

Test(tcp_peer, close_then_submit_is_refused)
{
    cr_assert_eq(kvb_segment_close(eng, seg), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, buf, seg, peer.rw_addr, 64};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, &r, 1, NULL, &b), KVB_ERR_BAD_SEGMENT);
    cr_assert_eq(kvb_segment_close(eng, seg), KVB_ERR_BAD_SEGMENT);
}

/* Two threads, one small request per batch, over the default two lanes: at times both batches
 * share a lane, one thread drives it and the other sleeps. No wait may outlast its answer - a
 * lost wake-up shows as a wait that only ends at the batch's deadline. */
typedef struct {
    int id;
    double max_wait_s;
    int failures;
} racer_t;

static void *racer(void *arg)
{
    racer_t *r = arg;
    uint64_t off = (uint64_t)r->id * 65536;
    for (int i = 0; i < 3000; i++) {
        kvb_request_t q = {i % 2 ? KVB_OP_WRITE : KVB_OP_READ, buf + off, seg, peer.rw_addr + off,
                           4096};
        uint64_t t0 = kvb__now_ns();
        if (run_batch(&q, 1, NULL) != KVB_OK)
            r->failures++;
        double s = (double)(kvb__now_ns() - t0) / 1e9;
        if (s > r->max_wait_s)
            r->max_wait_s = s;
    }
    return NULL;
}

Test(tcp_peer, concurrent_small_batches_never_wait_for_their_deadline)
{
    pthread_t t[2];
    racer_t r[2] = {{.id = 0}, {.id = 1}};
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, racer, &r[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(r[i].failures, 0);
        cr_expect_lt(r[i].max_wait_s, 1.0, "thread %d waited %.2f s for one 4 KiB request", i,
                     r[i].max_wait_s);
    }
}

/* A peer that stops answering without closing (a frozen host, a stopped process: its kernel still
 * acknowledges, so TCP alone never notices) fails its in-flight requests after the peer timeout,
 * long before their own deadline; a reopen after it wakes up works. */
static double stall_until_lost(uint32_t peer_timeout_ms)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "tcp";
    cfg.timeout_ms = 30000;
    if (peer_timeout_ms)
        cfg.peer_timeout_ms = peer_timeout_ms;
    kvb_engine_t *e;
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_OK);
    static uint8_t local[1 << 20];
    cr_assert_eq(kvb_register(e, local, sizeof local, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(e, peer.name, &s), KVB_OK);
    test_peer_signal(&peer, SIGSTOP);
    kvb_request_t r = {KVB_OP_READ, local, s, peer.rw_addr, sizeof local};
    kvb_batch_t *b;
    uint64_t t0 = kvb__now_ns();
    cr_assert_eq(kvb_batch_submit(e, &r, 1, NULL, &b), KVB_OK);
    int rc = kvb_batch_wait(b, -1);
    double secs = (double)(kvb__now_ns() - t0) / 1e9;
    cr_assert_eq(rc, KVB_ERR_PEER_LOST, "%s", kvb_strerror(rc));
    kvb_batch_free(b);
    test_peer_signal(&peer, SIGCONT);
    cr_assert_eq(kvb_segment_open(e, peer.name, &s), KVB_OK, "reopen after the peer woke up");
    cr_assert_eq(kvb_batch_submit(e, &r, 1, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, 10000), KVB_OK);
    kvb_batch_free(b);
    cr_assert_eq(test_pattern_check(local, 0, sizeof local, SEED), -1);
    kvb_engine_destroy(e);
    return secs;
}

Test(tcp_peer, silent_peer_fails_requests_after_the_peer_timeout)
{
    double secs = stall_until_lost(1000);
    cr_assert(secs >= 0.9 && secs < 2.5, "lost after %.2f s with a 1 s peer timeout", secs);
    secs = stall_until_lost(0); /* the default */
    cr_assert(secs >= 4.9 && secs < 6.0, "lost after %.2f s with the default (5 s)", secs);
}
