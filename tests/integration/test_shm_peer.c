/* SPDX-License-Identifier: Apache-2.0 */
/* Two real processes on one host over the shared-memory data path: kvb_alloc (memfd) buffers and
 * plain buffers (cross-memory attach), every byte verified; the fallback to TCP when the kernel
 * refuses cross-memory attach; a peer killed mid-batch; unregister and free while in use. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/peer.h"
#include "kvbridge/engine.h"

#define SEED 555
#define BUF  TEST_PEER_RW_LEN

static test_peer_t peer;
static kvb_engine_t *eng;
static kvb_segment_t seg;

/* A peer serving `peer_protocol`, and our engine (`protocol`) linked to it through shared
 * memory. */
static void start_with(const char *peer_protocol, const char *protocol)
{
    cr_assert_eq(test_peer_start(&peer, 0, SEED, peer_protocol), 0, "peer did not start");
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = protocol;
    cfg.timeout_ms = 1000;
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_OK);
    const char *path;
    cr_assert_eq(kvb_segment_transport(eng, seg, &path), KVB_OK);
    cr_assert_str_eq(path, "shm");
}

static void start(void)
{
    start_with("shm", "shm");
}

static void stop(void)
{
    kvb_engine_destroy(eng);
    test_peer_stop(&peer);
}

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

static void expect_reply(const char *want)
{
    kvb_notification_t *n = malloc(sizeof *n);
    cr_assert_eq(kvb_notify_recv(eng, n, 5000), KVB_OK, "no reply");
    cr_assert_eq(n->len, strlen(want), "got '%.*s'", (int)n->len, n->data);
    cr_assert_eq(memcmp(n->data, want, n->len), 0, "got '%.*s'", (int)n->len, n->data);
    free(n);
}

/* Random READs checked against the peer's pattern, random WRITEs checked by the peer itself. */
static void exercise(uint8_t *buf)
{
    uint64_t rs = 31337;
    for (int round = 0; round < 20; round++) {
        kvb_request_t r[6];
        size_t n = 1 + test_rand(&rs) % 6;
        uint64_t slot = BUF / n;
        for (size_t i = 0; i < n; i++) {
            uint64_t len = 1 + test_rand(&rs) % (test_rand(&rs) % 2 ? 4096 : (3 << 20));
            uint64_t off = i * slot + test_rand(&rs) % (slot - len);
            memset(buf + off, 0x3C, len);
            r[i] = (kvb_request_t){KVB_OP_READ, buf + off, seg, peer.rw_addr + off, len};
        }
        cr_assert_eq(run_batch(r, n, NULL), KVB_OK);
        for (size_t i = 0; i < n; i++) {
            uint64_t off = (uint64_t)((uint8_t *)r[i].local - buf);
            cr_assert_eq(test_pattern_check(buf + off, off, r[i].len, SEED), -1, "read %zu", i);
        }
    }
    /* One WRITE batch of 8 MiB in 3 requests, checked by the peer on the batch's notification. */
    uint64_t off = 4 << 20, len = 8 << 20, wseed = 99;
    test_pattern_fill(buf + off, off, len, wseed);
    kvb_request_t w[3] = {
        {KVB_OP_WRITE, buf + off, seg, peer.rw_addr + off, 1},
        {KVB_OP_WRITE, buf + off + 1, seg, peer.rw_addr + off + 1, (4 << 20) - 1},
        {KVB_OP_WRITE, buf + off + (4 << 20), seg, peer.rw_addr + off + (4 << 20), 4 << 20}};
    char msg[80];
    snprintf(msg, sizeof msg, "verify %d %llu %llu", (int)wseed, (unsigned long long)off,
             (unsigned long long)len);
    kvb_batch_opts_t o = {.notify_segment = seg, .notify = msg, .notify_len = strlen(msg)};
    cr_assert_eq(run_batch(w, 3, &o), KVB_OK);
    expect_reply("ok");
}

TestSuite(shm_peer, .init = start, .fini = stop, .timeout = 120);

Test(shm_peer, kvb_alloc_memory_is_mapped_and_verified)
{
    uint8_t *buf;
    cr_assert_eq(kvb_alloc(eng, BUF, 0, (void **)&buf), KVB_OK);
    cr_assert_eq(kvb_register(eng, buf, BUF, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    exercise(buf);
    kvb_stats_t st;
    cr_assert_eq(kvb_engine_stats(eng, &st), KVB_OK);
    cr_assert_gt(kvb_stats_bytes(&st, "shm"), 8u << 20);
    cr_assert_eq(kvb_stats_bytes(&st, "tcp"), 0);
    cr_assert_eq(kvb_free(eng, buf), KVB_ERR_BUSY, "still registered");
    cr_assert_eq(kvb_unregister(eng, buf), KVB_OK);
    cr_assert_eq(kvb_free(eng, buf), KVB_OK);
    cr_assert_eq(kvb_free(eng, buf), KVB_ERR_NOT_FOUND);
    /* A new allocation, possibly at the same address, is shared afresh and reads right. */
    cr_assert_eq(kvb_alloc(eng, BUF, 0, (void **)&buf), KVB_OK);
    cr_assert_eq(kvb_register(eng, buf, BUF, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, buf + 100, seg, peer.rw_addr + 100, 1 << 20};
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(buf + 100, 100, 1 << 20, SEED), -1);
}

Test(shm_peer, plain_memory_goes_by_cross_memory_attach)
{
    if (geteuid() != 0 && access("/proc/sys/kernel/yama/ptrace_scope", F_OK) == 0) {
        FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
        int scope = f && fscanf(f, "%d", &scope) == 1 ? scope : 1;
        if (f)
            fclose(f);
        if (scope > 0)
            cr_skip_test("the kernel refuses cross-memory attach here (yama scope %d)", scope);
    }
    uint8_t *buf = mmap(NULL, BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_eq(kvb_register(eng, buf, BUF, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    exercise(buf);
    kvb_stats_t st;
    kvb_engine_stats(eng, &st);
    cr_assert_gt(kvb_stats_bytes(&st, "shm"), 8u << 20);
    cr_assert_eq(kvb_stats_bytes(&st, "tcp"), 0);
    cr_assert_eq(kvb_unregister(eng, buf), KVB_OK);
    munmap(buf, BUF);
}

Test(shm_peer, peer_killed_mid_batch)
{
    uint8_t *buf;
    cr_assert_eq(kvb_alloc(eng, BUF, 0, (void **)&buf), KVB_OK);
    cr_assert_eq(kvb_register(eng, buf, BUF, NULL, KVB_ACCESS_RW), KVB_OK);
    enum { N = 512 };
    kvb_request_t *r = calloc(N, sizeof *r);
    for (int i = 0; i < N; i++)
        r[i] = (kvb_request_t){KVB_OP_READ, buf, seg, peer.rw_addr, BUF};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, r, N, NULL, &b), KVB_OK);
    usleep(20000);
    uint64_t t0 = kvb__now_ns();
    test_peer_signal(&peer, SIGKILL);
    int rc = kvb_batch_wait(b, 5000);
    cr_assert_eq(rc, KVB_ERR_PEER_LOST, "wait gave %s", kvb_status_name(rc));
    cr_assert_lt(kvb__now_ns() - t0, 2000000000ull);
    kvb_batch_free(b);
    cr_assert_eq(run_batch(r, 1, NULL), KVB_ERR_PEER_LOST);
    free(r);
}

Test(shm_peer, unregister_waits_for_a_copy_in_flight)
{
    uint8_t *buf;
    cr_assert_eq(kvb_alloc(eng, BUF, 0, (void **)&buf), KVB_OK);
    cr_assert_eq(kvb_register(eng, buf, BUF, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, buf, seg, peer.rw_addr, 1 << 20};
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK); /* shared while the peer runs */
    test_peer_signal(&peer, SIGSTOP);
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, &r, 1, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_cancel(b), KVB_OK);
    kvb_batch_free(b);
    /* The stopped peer may still copy into buf: unregister must not pretend otherwise. */
    cr_assert_eq(kvb_unregister(eng, buf), KVB_ERR_BUSY);
    test_peer_signal(&peer, SIGCONT);
    /* The region no longer takes requests; its last pin goes once the peer answers, and then
     * asking again says the memory is free. */
    cr_assert_eq(kvb_notify_send(eng, seg, "ping", 4, 2000), KVB_OK);
    expect_reply("pong");
    cr_assert_eq(kvb_unregister(eng, buf), KVB_OK);
    cr_assert_eq(kvb_free(eng, buf), KVB_OK);
}

/* A peer that stalls - stopped here; swapped out or descheduled in life - past a READ's deadline
 * finds the request when it resumes. It must not copy then: the initiator has moved on, and its
 * buffer may hold another request's data by now (a KV pool hands a failed request's blocks to the
 * next one). kvb_batch_settle says when nothing more can land: not while the peer still owes its
 * answer, and at once when it has answered. */
Test(shm_peer, a_stalled_peer_copies_nothing_past_the_deadline)
{
    enum { LEN = 1 << 20 };
    uint8_t *buf;
    cr_assert_eq(kvb_alloc(eng, LEN, 0, (void **)&buf), KVB_OK);
    cr_assert_eq(kvb_register(eng, buf, LEN, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, buf, seg, peer.rw_addr, LEN};
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK); /* shared while the peer runs */
    memset(buf, 0, LEN);
    test_peer_signal(&peer, SIGSTOP);
    kvb_batch_opts_t o = {.timeout_ms = 300};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, &r, 1, &o, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, -1), KVB_ERR_TIMEOUT);
    cr_assert_eq(kvb_batch_settle(b, 0), KVB_ERR_AGAIN, "the stopped peer still owes its answer");
    test_peer_signal(&peer, SIGCONT);
    int rc = kvb_batch_settle(b, 5000);
    cr_assert_eq(rc, KVB_OK, "settle: %s", kvb_status_name(rc));
    for (size_t i = 0; i < LEN; i++)
        cr_assert_eq(buf[i], 0, "the peer copied past the deadline (byte %zu)", i);
    kvb_req_status_t st;
    cr_assert_eq(kvb_batch_status(b, 0, &st), KVB_OK);
    cr_assert_eq(st.state, KVB_REQ_TIMEOUT);
    kvb_batch_free(b);
    /* The link is intact: the same READ in time lands. */
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(buf, 0, LEN, SEED), -1);
    kvb_stats_t stats;
    kvb_engine_stats(eng, &stats);
    cr_assert_eq(kvb_stats_bytes(&stats, "tcp"), 0, "it went through shared memory");
    cr_assert_eq(kvb_unregister(eng, buf), KVB_OK);
    cr_assert_eq(kvb_free(eng, buf), KVB_OK);
}

/* A share the peer took in only after we gave up on it (the peer stalled: stopped here, stuck
 * mapping another peer's memory in life) breaks the same-host link. The peer then maps memory we
 * believe unshared: freed, it is not unmapped there, and a new allocation at the same address
 * would have its READs copied into the old pages - reported COMPLETED, its own bytes untouched.
 * After a broken link nothing goes to that peer through shared memory; with "auto" its data takes
 * the lanes, every byte where it belongs. */
Test(shm_broken, a_share_answered_late_sends_nothing_more_through_shared_memory, .timeout = 120)
{
    start_with("shm", "auto");
    enum { LEN = 1 << 20 };
    uint8_t *x, *y;
    cr_assert_eq(kvb_alloc(eng, LEN, 0, (void **)&x), KVB_OK);
    cr_assert_eq(kvb_register(eng, x, LEN, NULL, KVB_ACCESS_RW), KVB_OK);
    /* The first request on x shares it; the stopped peer answers after the 2 s we wait. */
    test_peer_signal(&peer, SIGSTOP);
    kvb_request_t r = {KVB_OP_READ, x, seg, peer.rw_addr, LEN};
    kvb_batch_opts_t o = {.timeout_ms = 300};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, &r, 1, &o, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, -1), KVB_ERR_TIMEOUT);
    test_peer_signal(&peer, SIGCONT);
    cr_assert_eq(kvb_batch_settle(b, 5000), KVB_OK);
    kvb_batch_free(b);
    /* The peer has mapped x by now (its control thread took the share in on waking). */
    cr_assert_eq(kvb_notify_send(eng, seg, "ping", 4, 2000), KVB_OK);
    expect_reply("pong");
    usleep(100000);
    cr_assert_eq(kvb_unregister(eng, x), KVB_OK);
    cr_assert_eq(kvb_free(eng, x), KVB_OK);
    cr_assert_eq(kvb_alloc(eng, LEN, 0, (void **)&y), KVB_OK);
    if (y != x) {
        kvb_free(eng, y);
        stop();
        cr_skip_test("the new allocation did not take the freed one's address");
    }
    cr_assert_eq(kvb_register(eng, y, LEN, NULL, KVB_ACCESS_RW), KVB_OK);
    memset(y, 0, LEN);
    r.local = y;
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(y, 0, LEN, SEED), -1, "the READ's bytes went elsewhere");
    kvb_stats_t st;
    kvb_engine_stats(eng, &st);
    cr_assert_eq(kvb_stats_bytes(&st, "tcp"), LEN, "over the lanes");
    cr_assert_eq(kvb_unregister(eng, y), KVB_OK);
    cr_assert_eq(kvb_free(eng, y), KVB_OK);
    stop();
}

/* The peer is on this host but may not be linked through shared memory: "shm" says so, and
 * "auto" moves everything over TCP - every byte of a READ, none through shared memory. */
static void linked_over_tcp_only(void)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "shm";
    cfg.timeout_ms = 1000;
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_ERR_UNSUPPORTED);
    kvb_engine_destroy(eng);
    cfg.protocol = "auto";
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_OK);
    const char *path;
    cr_assert_eq(kvb_segment_transport(eng, seg, &path), KVB_OK);
    cr_assert_str_eq(path, "tcp");

    uint8_t *shared;
    cr_assert_eq(kvb_alloc(eng, 8 << 20, 0, (void **)&shared), KVB_OK);
    cr_assert_eq(kvb_register(eng, shared, 8 << 20, NULL, KVB_ACCESS_RW), KVB_OK);
    uint64_t off = (16 << 20) + 7;
    kvb_request_t r = {KVB_OP_READ, shared, seg, peer.rw_addr + off, 8 << 20};
    cr_assert_eq(run_batch(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(shared, off, 8 << 20, SEED), -1);
    kvb_stats_t st;
    kvb_engine_stats(eng, &st);
    cr_assert_eq(kvb_stats_bytes(&st, "shm"), 0, "nothing may go through shared memory");
    cr_assert_eq(kvb_stats_bytes(&st, "tcp"), 8u << 20);
    cr_assert_eq(kvb_unregister(eng, shared), KVB_OK);
    cr_assert_eq(kvb_free(eng, shared), KVB_OK);
    stop();
}

/* The peer runs as another user. The same-host path is for processes of one user only (another
 * user's process could otherwise have us copy into memory it cannot reach itself): the link is
 * refused on both sides (SO_PEERCRED). */
Test(shm_nobody, another_uid_gets_no_same_host_link, .timeout = 120)
{
    if (geteuid() != 0)
        cr_skip_test("needs root to start a peer under another uid");
    cr_assert_eq(test_peer_start(&peer, 0, SEED, "shm-nobody"), 0, "peer did not start");
    linked_over_tcp_only();
}

static bool same_time_namespace(pid_t pid)
{
    char path[64];
    struct stat a, b;
    snprintf(path, sizeof path, "/proc/%d/ns/time", (int)pid);
    return stat(path, &a) == 0 && stat("/proc/self/ns/time", &b) == 0 && a.st_ino == b.st_ino &&
           a.st_dev == b.st_dev;
}

/* The peer's CLOCK_MONOTONIC is set off by a time namespace, ahead or behind. It would read the
 * deadlines of our same-host requests against its own clock - refusing every one, or copying long
 * after we gave up on it and reused the memory - so it is not linked through shared memory. */
Test(shm_clock, a_peer_on_another_clock_gets_no_same_host_link, .timeout = 120)
{
    if (!test_time_namespaces())
        cr_skip_test("this process may not make time namespaces (needs CAP_SYS_ADMIN)");
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    /* Behind: at most half our clock, which a namespace's may not go below 0. */
    int64_t behind = now.tv_sec / 2 < 1000 ? now.tv_sec / 2 : 1000;
    const int64_t offsets[] = {1000, -behind};
    for (size_t i = 0; i < 2; i++) {
        if (offsets[i] > -2 && offsets[i] < 2)
            continue; /* a machine up for less than 4 s */
        test_peer_opts_t o = {.protocol = "shm", .monotonic_offset_s = offsets[i]};
        cr_assert_eq(test_peer_start_opts(&peer, 0, SEED, &o), 0, "peer did not start");
        if (same_time_namespace(peer.pid)) { /* the peer's exec did not move it (old kernels) */
            test_peer_stop(&peer);
            cr_skip_test("this kernel does not move a process into its time namespace on exec");
        }
        linked_over_tcp_only();
    }
}

Test(shm_only, peer_elsewhere_is_refused_with_protocol_shm)
{
    /* Same host, but the peer serves TCP only: "shm" cannot be honoured, and says so. */
    cr_assert_eq(test_peer_start(&peer, 0, SEED, "tcp"), 0);
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "shm";
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_ERR_UNSUPPORTED);
    kvb_engine_destroy(eng);
    /* "auto" quietly uses TCP. */
    cfg.protocol = "auto";
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_OK);
    const char *path;
    kvb_segment_transport(eng, seg, &path);
    cr_assert_str_eq(path, "tcp");
    kvb_engine_destroy(eng);
    test_peer_stop(&peer);
}
