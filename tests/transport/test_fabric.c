/* SPDX-License-Identifier: Apache-2.0 */
/* The fabric data path (src/transport/fabric.c) between two real processes, over libfabric's
 * "tcp;ofi_rxm" and "shm" providers: READ and WRITE at random sizes and offsets with every byte
 * checked, segments and registrations split small, several threads, notifications after the data,
 * WRITEs flushed by a READ (as without delivery-complete), read-only and unregistered ranges, a key
 * revoked by unregistering, a request past its deadline, cancel, the peer SIGKILLed mid-batch, and
 * `kvbridge bench --verify` over both providers.
 * Exits 77 (skipped) when libfabric or both providers are missing. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/peer.h"
#include "kvbridge/engine.h"

#define SEED   4242
#define RW_LEN (8u << 20)
#define RO_LEN (1u << 20)
#define LOCAL  (8u << 20)

static const char *provider; /* the suite's provider */
static bool available(const char *prov);

static struct {
    pid_t pid;
    int life_fd;
    char name[KVB_NAME_MAX + 1];
    uint64_t rw, ro;
} peer = {.pid = -1, .life_fd = -1};

static kvb_engine_t *eng;
static kvb_segment_t seg;
static uint8_t *local;

/* ---- the peer process ------------------------------------------------------------------------ */

static void reply(kvb_engine_t *e, const kvb_notification_t *n, const char *msg)
{
    if (kvb_notify_reply(e, n, msg, strlen(msg)) != KVB_OK)
        fprintf(stderr, "peer: cannot reply '%s'\n", msg);
}

/* Answers "verify SEED OFF LEN" (checks its RW region), "unreg-ro" (unregisters its RO region). */
static void peer_serve(kvb_engine_t *e, uint8_t *rw, uint8_t *ro, int life_fd)
{
    kvb_notification_t *n = malloc(sizeof *n);
    for (;;) {
        struct pollfd p = {.fd = life_fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0)
            break;
        if (!n || kvb_notify_recv(e, n, 50) != KVB_OK)
            continue;
        char msg[160], out[64] = "?";
        size_t l = n->len < sizeof msg - 1 ? n->len : sizeof msg - 1;
        memcpy(msg, n->data, l);
        msg[l] = '\0';
        unsigned long long seed, off, len;
        if (sscanf(msg, "verify %llu %llu %llu", &seed, &off, &len) == 3) {
            int64_t bad = off + len <= RW_LEN ? test_pattern_check(rw + off, off, len, seed) : 0;
            if (bad < 0)
                snprintf(out, sizeof out, "ok");
            else
                snprintf(out, sizeof out, "bad %lld", (long long)(off + (uint64_t)bad));
        } else if (!strcmp(msg, "unreg-ro")) {
            snprintf(out, sizeof out, "%d", kvb_unregister(e, ro));
        }
        reply(e, n, out);
    }
    free(n);
}

static int peer_main(int report_fd, int life_fd)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "fabric";
    cfg.fabric_provider = provider;
    kvb_engine_t *e;
    if (kvb_engine_create(&cfg, &e) != KVB_OK)
        return 1;
    uint8_t *rw = mmap(NULL, RW_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *ro = mmap(NULL, RO_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (rw == MAP_FAILED || ro == MAP_FAILED)
        return 1;
    test_pattern_fill(rw, 0, RW_LEN, SEED);
    test_pattern_fill(ro, 0, RO_LEN, SEED + 1);
    if (kvb_register(e, rw, RW_LEN, "cpu:0", KVB_ACCESS_RW) ||
        kvb_register(e, ro, RO_LEN, "cpu:0", KVB_ACCESS_READ))
        return 1;
    dprintf(report_fd, "%s %llu %llu\n", kvb_engine_segment_name(e),
            (unsigned long long)(uintptr_t)rw, (unsigned long long)(uintptr_t)ro);
    close(report_fd);
    peer_serve(e, rw, ro, life_fd);
    kvb_engine_destroy(e);
    return 0;
}

static void peer_start(void)
{
    int rep[2], life[2];
    cr_assert(pipe(rep) == 0 && pipe(life) == 0);
    peer.pid = fork();
    cr_assert(peer.pid >= 0);
    if (peer.pid == 0) {
        close(rep[0]);
        close(life[1]);
        _exit(peer_main(rep[1], life[0]));
    }
    close(rep[1]);
    close(life[0]);
    peer.life_fd = life[1];
    char line[512] = {0};
    size_t got = 0;
    ssize_t r;
    while (got < sizeof line - 1 && (r = read(rep[0], line + got, sizeof line - 1 - got)) > 0)
        got += (size_t)r;
    close(rep[0]);
    unsigned long long rw = 0, ro = 0;
    cr_assert_eq(sscanf(line, "%255s %llu %llu", peer.name, &rw, &ro), 3, "peer did not start");
    peer.rw = rw;
    peer.ro = ro;
}

/* libfabric 1.17's shm provider keeps an endpoint's queues in /dev/shm/PID:DOMAIN:EP and removes
 * them when the endpoint closes; a peer SIGKILLed cannot, so the test does. */
static int regions_of(pid_t pid, bool remove)
{
    char prefix[32];
    int n = snprintf(prefix, sizeof prefix, "%d:", (int)pid), found = 0;
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (!strncmp(de->d_name, prefix, (size_t)n) &&
            (!remove || !unlinkat(dirfd(d), de->d_name, 0)))
            found++;
    if (d)
        closedir(d);
    return found;
}

static void forget_regions(pid_t pid)
{
    regions_of(pid, true);
}

static void peer_stop(void)
{
    if (peer.life_fd >= 0)
        close(peer.life_fd);
    peer.life_fd = -1;
    if (peer.pid <= 0)
        return;
    int st;
    for (int i = 0; i < 300 && waitpid(peer.pid, &st, WNOHANG) == 0; i++)
        usleep(10000);
    if (waitpid(peer.pid, &st, WNOHANG) == 0) {
        kill(peer.pid, SIGKILL);
        waitpid(peer.pid, &st, 0);
        forget_regions(peer.pid);
    }
    peer.pid = -1;
}

/* ---- the initiator --------------------------------------------------------------------------- */

static void start(const char *prov)
{
    provider = prov;
    if (!available(prov))
        cr_skip_test("libfabric provider %s is not available here", prov);
    peer_start();
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "fabric";
    cfg.fabric_provider = prov;
    cfg.timeout_ms = 5000;
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_str_eq(kvb_engine_fabric_provider(eng), prov);
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_OK);
    const char *path;
    cr_assert_eq(kvb_segment_transport(eng, seg, &path), KVB_OK);
    cr_assert_str_eq(path, "fabric");
    local = mmap(NULL, LOCAL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(local != MAP_FAILED);
    cr_assert_eq(kvb_register(eng, local, LOCAL, "cpu:0", KVB_ACCESS_RW), KVB_OK);
}

static void stop(void)
{
    if (eng) {
        kvb_engine_destroy(eng);
        eng = NULL;
    }
    peer_stop();
    if (local && local != MAP_FAILED)
        munmap(local, LOCAL);
    local = NULL;
}

static void start_tcp(void)
{
    start("tcp;ofi_rxm");
}

static void start_shm(void)
{
    start("shm");
}

/* Registrations of 1 MiB (8 per RW region) and segments of 192 KiB: ops cross both. */
static void start_split(const char *prov)
{
    setenv("KVB_FABRIC_MR_MAX", "1048576", 1);
    setenv("KVB_FABRIC_SEG_MAX", "196608", 1);
    start(prov);
}

static void start_split_tcp(void)
{
    start_split("tcp;ofi_rxm");
}

static void start_split_shm(void)
{
    start_split("shm");
}

/* As a provider without delivery-complete writes runs: each WRITE flushed by a READ. */
static void start_flush_tcp(void)
{
    setenv("KVB_FABRIC_FLUSH", "1", 1);
    start("tcp;ofi_rxm");
}

static int run(const kvb_request_t *r, size_t n, const kvb_batch_opts_t *o)
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
    cr_assert_eq(n->len, strlen(want), "got '%.*s', want '%s'", (int)n->len, n->data, want);
    cr_assert_eq(memcmp(n->data, want, n->len), 0, "got '%.*s'", (int)n->len, n->data);
    free(n);
}

static void ask(const char *msg, const char *want)
{
    cr_assert_eq(kvb_notify_send(eng, seg, msg, strlen(msg), 5000), KVB_OK);
    expect_reply(want);
}

static kvb_request_t req(int op, uint64_t loff, uint64_t remote, uint64_t len)
{
    return (kvb_request_t){
        .opcode = op, .local = local + loff, .remote = remote, .len = len, .segment = seg};
}

/* Random READs checked against the peer's pattern; random WRITEs checked by the peer, whose
 * check is the batch's notification: it runs when the notification arrives, so it also proves
 * the data was placed before the notification was sent. */
static void exercise(int rounds)
{
    uint64_t rs = 99991;
    for (int round = 0; round < rounds; round++) {
        kvb_request_t r[8];
        size_t n = 1 + test_rand(&rs) % 8;
        uint64_t slot = RW_LEN / n;
        for (size_t i = 0; i < n; i++) {
            uint64_t len = 1 + test_rand(&rs) % (test_rand(&rs) % 2 ? 4096 : slot - 1);
            uint64_t off = i * slot + test_rand(&rs) % (slot - len);
            memset(local + off, 0x5A, len);
            r[i] = req(KVB_OP_READ, off, peer.rw + off, len);
        }
        cr_assert_eq(run(r, n, NULL), KVB_OK, "READ round %d", round);
        for (size_t i = 0; i < n; i++) {
            uint64_t off = (uint64_t)(r[i].local - (void *)local);
            cr_assert_eq(test_pattern_check(local + off, off, r[i].len, SEED), -1,
                         "READ round %d request %zu: wrong bytes", round, i);
        }
        /* WRITE back one range with a new seed, the peer verifies it on the notification. */
        uint64_t seed = SEED + 10 + (uint64_t)round;
        uint64_t len = 1 + test_rand(&rs) % (RW_LEN / 2), off = test_rand(&rs) % (RW_LEN - len);
        test_pattern_fill(local + off, off, len, seed);
        char note[96];
        snprintf(note, sizeof note, "verify %llu %llu %llu", (unsigned long long)seed,
                 (unsigned long long)off, (unsigned long long)len);
        kvb_batch_opts_t o = {.notify_segment = seg, .notify = note, .notify_len = strlen(note)};
        /* Split in a few requests, so the notification waits for several ops. */
        kvb_request_t w[4];
        size_t nw = 0;
        for (uint64_t done = 0; done < len; nw++) {
            uint64_t part = nw == 3 ? len - done : (len - done + 1) / 2;
            w[nw] = req(KVB_OP_WRITE, off + done, peer.rw + off + done, part);
            done += part;
        }
        cr_assert_eq(run(w, nw, &o), KVB_OK, "WRITE round %d", round);
        expect_reply("ok");
        /* And restore the pattern the READs expect. */
        test_pattern_fill(local + off, off, len, SEED);
        kvb_request_t back = req(KVB_OP_WRITE, off, peer.rw + off, len);
        cr_assert_eq(run(&back, 1, NULL), KVB_OK);
    }
    kvb_stats_t st;
    cr_assert_eq(kvb_engine_stats(eng, &st), KVB_OK);
    cr_assert(kvb_stats_bytes(&st, "fabric") > 0);
    cr_assert_eq(kvb_stats_bytes(&st, "tcp"), 0, "data went over the TCP lanes");
}

static void whole_region(void)
{
    memset(local, 0, RW_LEN);
    kvb_request_t r = req(KVB_OP_READ, 0, peer.rw, RW_LEN);
    cr_assert_eq(run(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(local, 0, RW_LEN, SEED), -1);
}

TestSuite(fabric_tcp, .init = start_tcp, .fini = stop, .timeout = 120);
TestSuite(fabric_shm, .init = start_shm, .fini = stop, .timeout = 120);
TestSuite(fabric_split_tcp, .init = start_split_tcp, .fini = stop, .timeout = 120);
TestSuite(fabric_split_shm, .init = start_split_shm, .fini = stop, .timeout = 120);
TestSuite(fabric_flush_tcp, .init = start_flush_tcp, .fini = stop, .timeout = 120);

Test(fabric_tcp, read_write_every_byte)
{
    exercise(12);
    whole_region();
}

Test(fabric_shm, read_write_every_byte)
{
    exercise(12);
    whole_region();
}

Test(fabric_split_tcp, across_registrations_and_segments)
{
    exercise(8);
    whole_region();
}

Test(fabric_split_shm, across_registrations_and_segments)
{
    exercise(8);
    whole_region();
}

/* The peer checks each WRITE when the batch's notification arrives: the flush READ must have
 * waited for the writes. */
Test(fabric_flush_tcp, writes_flushed_by_a_read)
{
    exercise(8);
    whole_region();
}

/* ---- several threads ------------------------------------------------------------------------- */

#define THREADS 4

static void *thread_main(void *arg)
{
    uintptr_t t = (uintptr_t)arg;
    uint64_t part = RW_LEN / THREADS, base = t * part, rs = 7 + t;
    for (int i = 0; i < 20; i++) {
        uint64_t len = 1 + test_rand(&rs) % part, off = base + test_rand(&rs) % (part - len + 1);
        kvb_request_t r = req(KVB_OP_READ, off, peer.rw + off, len);
        if (run(&r, 1, NULL) != KVB_OK || test_pattern_check(local + off, off, len, SEED) != -1)
            return (void *)1;
        r.opcode = KVB_OP_WRITE; /* the same bytes back: the pattern stays */
        if (run(&r, 1, NULL) != KVB_OK)
            return (void *)1;
    }
    return NULL;
}

static void threads(void)
{
    pthread_t tid[THREADS];
    for (uintptr_t t = 0; t < THREADS; t++)
        cr_assert_eq(pthread_create(&tid[t], NULL, thread_main, (void *)t), 0);
    for (int t = 0; t < THREADS; t++) {
        void *res;
        pthread_join(tid[t], &res);
        cr_assert_null(res, "thread %d saw an error or wrong bytes", t);
    }
    whole_region();
}

Test(fabric_tcp, threads)
{
    threads();
}

Test(fabric_shm, threads)
{
    threads();
}

/* ---- rights, unregistered ranges, revoked keys ----------------------------------------------- */

static void rights(void)
{
    /* Read-only: READ works, WRITE is refused (by us; the key itself grants no remote write). */
    kvb_request_t r = req(KVB_OP_READ, 0, peer.ro, RO_LEN);
    cr_assert_eq(run(&r, 1, NULL), KVB_OK);
    cr_assert_eq(test_pattern_check(local, 0, RO_LEN, SEED + 1), -1);
    r.opcode = KVB_OP_WRITE;
    cr_assert_eq(run(&r, 1, NULL), KVB_ERR_ACCESS_DENIED);
    /* Past the end of a region, and nowhere registered: refused, nothing moves. */
    r = req(KVB_OP_READ, 0, peer.rw + RW_LEN - 100, 4096);
    int rc = run(&r, 1, NULL);
    cr_assert(rc == KVB_ERR_REMOTE_NOT_REGISTERED, "past the end: %s", kvb_strerror(rc));
    r = req(KVB_OP_WRITE, 0, 4096, 4096);
    rc = run(&r, 1, NULL);
    cr_assert(rc == KVB_ERR_REMOTE_NOT_REGISTERED, "unregistered: %s", kvb_strerror(rc));
    /* Unregistering revokes the key: a request with the key we hold fails, never reads. */
    ask("unreg-ro", "0");
    memset(local, 0, RO_LEN);
    r = req(KVB_OP_READ, 0, peer.ro, RO_LEN);
    rc = run(&r, 1, NULL);
    if (!strcmp(provider, "shm") && rc == KVB_OK) {
        /* libfabric 1.17's shm provider reads by address (cross-memory attach) without checking
         * the key: a test provider, not a security boundary. Said so in the README. */
        fprintf(stderr, "test_fabric: shm provider: a closed registration was still readable\n");
    } else {
        cr_assert(rc < 0, "read of an unregistered region succeeded");
        cr_assert_eq(test_pattern_check(local, 0, RO_LEN, SEED + 1), 0, "its bytes arrived");
    }
    /* The path still works afterwards. With tcp;ofi_rxm a remote key error makes the provider
     * drop the connection (the READ above ends FI_ECANCELED: "peer lost"), and ofi_rxm connects
     * again on a request it posts once it has seen the drop; one posted before that fails too
     * (FI_ENOTCONN, "peer lost"; 7-9 runs in 40 here). kvbridge reports such a failure, never
     * bytes that did not arrive, and a later request goes through. */
    kvb_request_t all = req(KVB_OP_READ, 0, peer.rw, RW_LEN);
    for (int tries = 1;; tries++) {
        memset(local, 0, RW_LEN);
        rc = run(&all, 1, NULL);
        if (rc == KVB_OK)
            break;
        cr_assert_eq(rc, KVB_ERR_PEER_LOST, "after a revoked key: %s", kvb_strerror(rc));
        cr_assert(!strcmp(provider, "tcp;ofi_rxm") && tries < 5,
                  "the path did not recover after a revoked key (%d tries)", tries);
        usleep(20000);
    }
    cr_assert_eq(test_pattern_check(local, 0, RW_LEN, SEED), -1);
}

Test(fabric_tcp, rights_and_revoked_keys)
{
    rights();
}

Test(fabric_shm, rights_and_revoked_keys)
{
    rights();
}

/* ---- deadlines, cancel, a peer that dies ----------------------------------------------------- */

/* A stopped peer makes no progress: with a manual-progress provider its requests never finish,
 * and the batch ends at its deadline. The READs' segments are still out then, and the peer's
 * side serves them once it runs again - the bytes land after the requests ended: the batch is
 * not settled until they have, and nothing lands after it is. Afterwards the path still works. */
static void deadline(void)
{
    kvb_request_t r[8];
    for (int i = 0; i < 8; i++)
        r[i] = req(KVB_OP_READ, (uint64_t)i << 20, peer.rw + ((uint64_t)i << 20), 1u << 20);
    /* Connected first: a provider that connects on the first post (ofi_rxm) posts nothing
     * while the peer cannot answer, and the READs are then never out. */
    cr_assert_eq(run(r, 1, NULL), KVB_OK);
    /* Stopped, not only signalled: a peer thread woken by the requests first could still serve
     * them (this test once saw its READs complete in 40 ms). */
    cr_assert_eq(test_child_signal(peer.pid, SIGSTOP), 0);
    kvb_batch_opts_t o = {.timeout_ms = 300};
    uint64_t t0 = kvb__now_ns();
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, r, 8, &o, &b), KVB_OK);
    int rc = kvb_batch_wait(b, -1);
    double ms = (double)(kvb__now_ns() - t0) / 1e6;
    usleep(50000); /* the path's own scan (every 10 ms) ends the ops too */
    int early = kvb_batch_settle(b, 0);
    cr_assert_eq(test_child_signal(peer.pid, SIGCONT), 0);
    /* shm: the initiator may copy by itself (cross-memory attach) and finish in time. */
    cr_assert(rc == KVB_ERR_TIMEOUT || (rc == KVB_OK && !strcmp(provider, "shm")), "got %s",
              kvb_strerror(rc));
    cr_assert(ms < 2000, "the deadline of 300 ms ended the batch after %.0f ms", ms);
    if (!strcmp(provider, "tcp;ofi_rxm"))
        cr_assert_eq(early, KVB_ERR_AGAIN, "settled with the READs' segments still out");
    int settled = kvb_batch_settle(b, 10000);
    cr_assert_eq(settled, KVB_OK, "settle: %s", kvb_status_name(settled));
    memset(local, 0xA5, 8u << 20);
    usleep(100000);
    for (size_t i = 0; i < (8u << 20); i++)
        cr_assert_eq(local[i], 0xA5, "byte %zu landed after the batch settled", i);
    kvb_batch_free(b);
    whole_region();
}

Test(fabric_tcp, request_past_its_deadline)
{
    deadline();
}

Test(fabric_shm, request_past_its_deadline)
{
    deadline();
}

static void cancel(void)
{
    kvb_request_t r[8];
    for (int i = 0; i < 8; i++)
        r[i] = req(i % 2 ? KVB_OP_WRITE : KVB_OP_READ, (uint64_t)i << 20,
                   peer.rw + ((uint64_t)i << 20), 1u << 20);
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(eng, r, 8, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_cancel(b), KVB_OK);
    int rc = kvb_batch_wait(b, 5000);
    cr_assert(rc == KVB_ERR_CANCELED || rc == KVB_OK, "got %s", kvb_strerror(rc));
    kvb_batch_free(b);
    /* The writes put back what the reads got: restore the pattern, then check the path works and
     * our region is free to go once the provider returned everything. */
    test_pattern_fill(local, 0, 8u << 20, SEED);
    kvb_request_t all = req(KVB_OP_WRITE, 0, peer.rw, RW_LEN);
    cr_assert_eq(run(&all, 1, NULL), KVB_OK);
    whole_region();
    cr_assert_eq(kvb_unregister(eng, local), KVB_OK);
    cr_assert_eq(kvb_register(eng, local, LOCAL, "cpu:0", KVB_ACCESS_RW), KVB_OK);
}

Test(fabric_tcp, cancel)
{
    cancel();
}

Test(fabric_shm, cancel)
{
    cancel();
}

/* The peer dies with a batch in flight: the batch ends with a peer error well before its
 * deadline (the control plane sees the peer go), never hangs and never reports success. */
static void peer_killed(void)
{
    kvb_request_t r[64];
    for (int i = 0; i < 64; i++)
        r[i] = req(i % 2 ? KVB_OP_WRITE : KVB_OP_READ, (uint64_t)(i % 8) << 20,
                   peer.rw + ((uint64_t)(i % 8) << 20), 1u << 20);
    kvb_batch_opts_t o = {.timeout_ms = 20000};
    bool failed = false;
    uint64_t t0 = kvb__now_ns();
    for (int round = 0; round < 200 && !failed; round++) {
        kvb_batch_t *b;
        int rc = kvb_batch_submit(eng, r, 64, &o, &b);
        if (round == 2) {
            kill(peer.pid, SIGKILL);
            waitpid(peer.pid, NULL, 0);
            forget_regions(peer.pid);
            peer.pid = -1;
        }
        if (rc == KVB_OK) {
            rc = kvb_batch_wait(b, -1);
            kvb_batch_free(b);
        }
        failed = rc != KVB_OK;
        if (failed)
            cr_assert(KVB_IS_PEER_ERROR(rc) || rc == KVB_ERR_BAD_SEGMENT, "got %s",
                      kvb_strerror(rc));
    }
    double s = (double)(kvb__now_ns() - t0) / 1e9;
    cr_assert(failed, "batches kept succeeding after the peer died");
    cr_assert(s < 15, "the peer's death took %.1f s to fail the batch", s);
}

Test(fabric_tcp, peer_killed_mid_batch)
{
    peer_killed();
}

Test(fabric_shm, peer_killed_mid_batch)
{
    peer_killed();
}

/* An engine destroyed right after freeing a batch whose segments are still out: its completions
 * come back while the engine goes, and must not reach a region after the registry freed it (a
 * use after free under AddressSanitizer, found by `make test`: the path's thread unpinned a
 * region the registry had freed). Each round a fresh engine, 64 x 1 MiB in flight. */
static void destroyed_in_flight(void)
{
    for (int round = 0; round < 8; round++) {
        kvb_config_t cfg;
        kvb_config_init(&cfg);
        cfg.protocol = "fabric";
        cfg.fabric_provider = provider;
        kvb_engine_t *e;
        kvb_segment_t s;
        cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_OK);
        cr_assert_eq(kvb_segment_open(e, peer.name, &s), KVB_OK);
        uint8_t *buf =
            mmap(NULL, LOCAL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        cr_assert(buf != MAP_FAILED);
        cr_assert_eq(kvb_register(e, buf, LOCAL, "cpu:0", KVB_ACCESS_RW), KVB_OK);
        kvb_request_t r[64];
        for (int i = 0; i < 64; i++)
            r[i] = (kvb_request_t){.opcode = i % 2 ? KVB_OP_WRITE : KVB_OP_READ,
                                   .local = buf + ((uint64_t)(i % 8) << 20),
                                   .segment = s,
                                   .remote = peer.rw + ((uint64_t)(i % 8) << 20),
                                   .len = 1u << 20};
        kvb_batch_t *b;
        cr_assert_eq(kvb_batch_submit(e, r, 64, NULL, &b), KVB_OK);
        if (round % 2)
            usleep(1000); /* some rounds with the first segments back */
        kvb_batch_free(b);
        kvb_engine_destroy(e);
        munmap(buf, LOCAL);
    }
    /* The peer served all of that and still works. */
    kvb_request_t one = req(KVB_OP_READ, 0, peer.rw, 4096);
    cr_assert_eq(run(&one, 1, NULL), KVB_OK);
}

Test(fabric_tcp, destroyed_with_segments_out)
{
    destroyed_in_flight();
}

/* Not over libfabric's shm provider: there the target process (the peer) crashed inside its
 * fi_cq_read, with the teardown from before fab_stop too (1 run in 3; README, "fabric"). */

/* ---- configuration --------------------------------------------------------------------------- */

Test(fabric_config, unknown_provider_refused)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.fabric_provider = "no-such-provider";
    kvb_engine_t *e = NULL;
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_ERR_INVALID_ARG);
    cfg.fabric_provider = NULL;
    cfg.protocol = "fabric,tcp";
    /* No RDMA NIC here: the default finds none, and a protocol naming the path fails. */
    int rc = kvb_engine_create(&cfg, &e);
    if (rc == KVB_OK) {
        cr_assert_str_neq(kvb_engine_fabric_provider(e), "");
        kvb_engine_destroy(e);
    } else {
        cr_assert_eq(rc, KVB_ERR_UNSUPPORTED);
    }
}

/* True if this process has a library whose path contains `name` mapped. */
static bool mapped(const char *name)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f))
        found = strstr(line, name) != NULL;
    if (f)
        fclose(f);
    return found;
}

/* libfabric (and the PSM libraries whose constructors take over signal handlers) is opened only
 * when the path is wanted: not by linking kvbridge, not by an engine with the default protocol
 * on a host without an RDMA device. (Criterion runs each test in a fresh process.) */
Test(fabric_config, libfabric_not_loaded_unless_wanted)
{
    if (access("/sys/class/infiniband", F_OK) == 0 || access("/sys/class/cxi", F_OK) == 0)
        cr_skip_test("this host lists an RDMA device: auto rightly opens libfabric here");
    cr_assert(!mapped("libfabric"), "libfabric is mapped before any engine");
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "auto";
    cfg.fabric_provider = NULL;
    kvb_engine_t *e = NULL;
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_OK);
    cr_expect(!mapped("libfabric"), "an auto engine without an RDMA device opened libfabric");
    cr_expect(!mapped("infinipath"), "libinfinipath is mapped");
    kvb_engine_destroy(e);
    if (!available("tcp;ofi_rxm"))
        return;
    cfg.fabric_provider = "tcp;ofi_rxm";
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_OK);
    cr_expect(mapped("libfabric"), "a named provider opens libfabric");
    kvb_engine_destroy(e);
}

Test(fabric_config, auto_takes_fabric_after_shm)
{
    if (!available("tcp;ofi_rxm"))
        cr_skip_test("libfabric provider tcp;ofi_rxm is not available here");
    provider = "tcp;ofi_rxm";
    peer_start();
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "auto";
    cfg.fabric_provider = provider;
    cr_assert_eq(kvb_engine_create(&cfg, &eng), KVB_OK);
    cr_assert_str_eq(kvb_engine_fabric_provider(eng), "tcp;ofi_rxm");
    cr_assert_eq(kvb_segment_open(eng, peer.name, &seg), KVB_OK);
    const char *path;
    cr_assert_eq(kvb_segment_transport(eng, seg, &path), KVB_OK);
    /* The peer runs fabric only (no shm): fabric is the best path both have. */
    cr_assert_str_eq(path, "fabric");
    stop();
}

/* A process SIGKILLed with a shm endpoint open leaves its region in /dev/shm, named after its pid.
 * The next process the kernel gives that pid must still open an endpoint: libfabric 1.17 refuses
 * the name once, taking the pid written in the region - now its own - for a live owner (open_ep
 * opens another). The pid is handed on through ns_last_pid, which needs root. */
Test(fabric_config, shm_pid_of_a_killed_process, .timeout = 60)
{
    if (!available("shm"))
        cr_skip_test("libfabric provider shm is not available here");
    provider = "shm";
    peer_start();
    pid_t dead = peer.pid;
    close(peer.life_fd);
    peer.life_fd = -1;
    kill(dead, SIGKILL);
    waitpid(dead, NULL, 0);
    peer.pid = -1;
    if (!regions_of(dead, false))
        cr_skip_test("the killed peer left no /dev/shm/%d:*: this libfabric names its regions "
                     "otherwise",
                     (int)dead);
    int status = -1;
    for (int tries = 0; tries < 100 && status < 0; tries++) {
        FILE *f = fopen("/proc/sys/kernel/ns_last_pid", "w");
        bool set = f && fprintf(f, "%d", (int)dead - 1) > 0;
        int err = errno;
        if (f && fclose(f) != 0)
            set = false;
        if (!set) {
            forget_regions(dead);
            cr_skip_test("cannot choose the next pid (ns_last_pid: %s)", strerror(err));
        }
        pid_t c = fork();
        cr_assert(c >= 0);
        if (c == 0) {
            if (getpid() != dead)
                _exit(99); /* another process took the pid first: again */
            kvb_config_t cfg;
            kvb_config_init(&cfg);
            cfg.protocol = "fabric";
            cfg.fabric_provider = "shm";
            kvb_engine_t *e = NULL;
            int rc = kvb_engine_create(&cfg, &e);
            kvb_engine_destroy(e);
            _exit(rc == KVB_OK ? 0 : 1);
        }
        int st;
        cr_assert_eq(waitpid(c, &st, 0), c);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 99)
            status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    forget_regions(dead);
    if (status < 0)
        cr_skip_test("pid %d went to other processes 100 times", (int)dead);
    cr_assert_eq(status, 0, "an engine under the killed peer's pid could not open its endpoint");
}

/* ---- kvbridge bench over the path ------------------------------------------------------------ */

/* `kvbridge bench --loopback --verify --json` over the path: exit 0, every byte verified, the
 * provider in the output. */
static void bench_verified(const char *prov, const char *op)
{
    if (!available(prov))
        cr_skip_test("libfabric provider %s is not available here", prov);
    const char *bin = getenv("KVB_BIN");
    cr_assert_not_null(bin, "KVB_BIN is not set (run through ctest)");
    char cmd[1024], line[4096], last[4096] = "";
    snprintf(cmd, sizeof cmd,
             "%s bench --loopback --verify --json --protocol fabric --fabric-provider '%s' "
             "--operation %s --duration 1 --buffer-size 32M --block-size 256K --batch-size 16 "
             "2>/dev/null",
             bin, prov, op);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    while (fgets(line, sizeof line, p))
        snprintf(last, sizeof last, "%s", line);
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "bench %s over %s failed: %s", op, prov, last);
    json_error_t err;
    json_t *j = json_loads(last, 0, &err);
    cr_assert_not_null(j, "last line is not JSON: %s", last);
    cr_assert_str_eq(json_string_value(json_object_get(j, "protocol")), "fabric");
    cr_assert_str_eq(json_string_value(json_object_get(j, "fabric_provider")), prov);
    cr_assert(json_is_true(json_object_get(j, "verified")));
    cr_assert_eq(json_integer_value(json_object_get(j, "errors")), 0);
    cr_assert_gt(json_integer_value(json_object_get(j, "bytes")), 0);
    json_decref(j);
}

TestSuite(fabric_bench, .timeout = 120);

Test(fabric_bench, tcp_read_verified)
{
    bench_verified("tcp;ofi_rxm", "read");
}

Test(fabric_bench, tcp_write_verified)
{
    bench_verified("tcp;ofi_rxm", "write");
}

Test(fabric_bench, shm_read_verified)
{
    bench_verified("shm", "read");
}

Test(fabric_bench, shm_write_verified)
{
    bench_verified("shm", "write");
}

/* Whether an engine runs the fabric path on `prov` here. */
static bool available(const char *prov)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = "fabric";
    cfg.fabric_provider = prov;
    kvb_engine_t *e;
    int rc = kvb_engine_create(&cfg, &e);
    if (rc == KVB_OK)
        kvb_engine_destroy(e);
    else
        fprintf(stderr, "test_fabric: provider %s unavailable: %s\n", prov, kvb_strerror(rc));
    return rc == KVB_OK;
}

/* Skips the whole program (CTest: 77) when neither provider runs here. */
int main(int argc, char *argv[])
{
    if (!available("tcp;ofi_rxm") && !available("shm")) {
        fprintf(stderr, "test_fabric: SKIPPED: libfabric with the tcp;ofi_rxm or shm provider is "
                        "not available (install libfabric-dev and rebuild)\n");
        return 77;
    }
    struct criterion_test_set *tests = criterion_initialize();
    int result = 0;
    if (criterion_handle_args(argc, argv, true))
        result = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    return result;
}
