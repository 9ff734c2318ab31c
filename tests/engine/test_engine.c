/* SPDX-License-Identifier: Apache-2.0 */
/* Engine API semantics with engines in one process: configuration, ports, segments, batches with
 * several lanes and progress threads, notifications and their limits. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <linux/tcp.h> /* struct tcp_info with its byte counts (glibc's lacks them) */
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "engine/internal.h"
#include "helpers/peer.h"
#include "helpers/store.h"
#include "kvbridge/engine.h"

TestSuite(engine, .timeout = 60);

static kvb_engine_t *make_proto(int threads, int lanes, const char *protocol)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.protocol = protocol;
    c.progress_threads = threads;
    c.lanes = lanes;
    kvb_engine_t *e;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    return e;
}

static kvb_engine_t *make(int threads, int lanes)
{
    return make_proto(threads, lanes, "auto");
}

/* b exposes `size` bytes of pattern `seed` read-only (*src), a registers as much zeroed memory
 * (*dst) and opens b's segment, which it returns. */
static kvb_segment_t pattern_pair(kvb_engine_t *a, kvb_engine_t *b, size_t size, uint64_t seed,
                                  uint8_t **src, uint8_t **dst)
{
    *src = malloc(size);
    *dst = calloc(1, size);
    cr_assert(*src && *dst);
    test_pattern_fill(*src, 0, size, seed);
    cr_assert_eq(kvb_register(b, *src, size, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(kvb_register(a, *dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
    return s;
}

/* Submits r[0..n) from a, waits up to timeout_ms for all of it to complete, frees the batch. */
static void move_ok(kvb_engine_t *a, const kvb_request_t *r, size_t n, int timeout_ms)
{
    kvb_batch_t *batch;
    cr_assert_eq(kvb_batch_submit(a, r, n, NULL, &batch), KVB_OK);
    cr_assert_eq(kvb_batch_wait(batch, timeout_ms), KVB_OK);
    kvb_batch_free(batch);
}

Test(engine, config_is_checked)
{
    kvb_config_t c;
    kvb_engine_t *e = NULL;
    kvb_config_init(&c);
    c.progress_threads = 0;
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    kvb_config_init(&c);
    c.lanes = 17;
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    kvb_config_init(&c);
    c.metadata = "consul://127.0.0.1:8500"; /* etcd, redis and http stores: tests/meta */
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_UNSUPPORTED);
    kvb_config_init(&c);
    c.port = 9000;
    c.port_max = 8000;
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    kvb_config_init(&c);
    c.bind_addr = "no-such-host.invalid";
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG, "not loopback, no secret");
    c.insecure = 1;
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_RESOLVE);
    cr_assert_null(e);
    cr_expect_eq(kvb_engine_create(NULL, NULL), KVB_ERR_INVALID_ARG);
}

/* How many of this process's threads have a name starting with `prefix`; with `out`, their tids
 * there, at most `max` of them (and the count stops there). */
static int threads_named_tids(const char *prefix, pid_t *out, int max)
{
    DIR *d = opendir("/proc/self/task");
    cr_assert_not_null(d);
    int n = 0;
    for (struct dirent *t; (t = readdir(d)) && (!out || n < max);) {
        char path[300], name[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", t->d_name);
        FILE *f = t->d_name[0] != '.' ? fopen(path, "re") : NULL;
        if (f && fgets(name, sizeof name, f) && !strncmp(name, prefix, strlen(prefix))) {
            if (out)
                out[n] = (pid_t)atoi(t->d_name);
            n++;
        }
        if (f)
            fclose(f);
    }
    closedir(d);
    return n;
}

/* Threads of this process whose name starts with `prefix`. */
static int threads_named(const char *prefix)
{
    return threads_named_tids(prefix, NULL, 0);
}

/* One progress thread per default lane where half the CPUs cover them, else half the CPUs (one
 * on two): what the defaults start, and what a config asks for instead. */
Test(engine, progress_threads_follow_the_cpus_by_default)
{
    cpu_set_t set; /* the CPUs this process may run on, as a container's cpuset says */
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    int cpus = CPU_COUNT(&set), half = cpus / 2 < 1 ? 1 : cpus / 2;
    kvb_config_t c;
    kvb_config_init(&c);
    cr_assert_eq(c.lanes, 2);
    cr_assert_eq(c.progress_threads, half < 2 ? half : 2, "%d CPUs", cpus);
    kvb_engine_t *e;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    cr_expect_eq(threads_named("kvb-tcp"), c.progress_threads);
    kvb_engine_destroy(e);
    c.progress_threads = 3;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    cr_expect_eq(threads_named("kvb-tcp"), 3);
    kvb_engine_destroy(e);
}

Test(engine, ports_and_names)
{
    kvb_engine_t *a = make(1, 1), *b, *c;
    uint16_t port = kvb_engine_port(a);
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%u", port);
    cr_assert_str_eq(kvb_engine_segment_name(a), want);

    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.port = port; /* taken */
    cr_assert_eq(kvb_engine_create(&cfg, &b), KVB_ERR_ADDR_IN_USE);
    cfg.port_max = (uint16_t)(port + 20); /* a range: the next free one */
    cfg.segment_name = "prefill-0";
    cr_assert_eq(kvb_engine_create(&cfg, &c), KVB_OK);
    cr_assert_gt(kvb_engine_port(c), port);
    cr_assert_leq(kvb_engine_port(c), port + 20);
    cr_assert_str_eq(kvb_engine_segment_name(c), "prefill-0");
    kvb_engine_destroy(c);
    kvb_engine_destroy(a);
}

/* A line of a /proc/sys file, its newline cut; "" if it cannot be read. */
static void read_line(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    out[0] = '\0';
    if (f && fgets(out, (int)cap, f))
        out[strcspn(out, "\n")] = '\0';
    if (f)
        fclose(f);
}

/* Counts this process's TCP sockets to or from `port` (connected ones: lanes of either side)
 * and checks that each runs the congestion control `want`. */
static int sockets_with_congestion(uint16_t port, const char *want)
{
    int seen = 0;
    for (int fd = 3; fd < 4096; fd++) {
        int proto = 0;
        socklen_t pl = sizeof proto;
        struct sockaddr_in mine, theirs;
        socklen_t ml = sizeof mine, tl = sizeof theirs;
        if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &pl) || proto != IPPROTO_TCP ||
            getsockname(fd, (struct sockaddr *)&mine, &ml) ||
            getpeername(fd, (struct sockaddr *)&theirs, &tl) || mine.sin_family != AF_INET ||
            (ntohs(mine.sin_port) != port && ntohs(theirs.sin_port) != port))
            continue;
        char cc[16] = "";
        socklen_t cl = sizeof cc - 1;
        cr_assert_eq(getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, &cl), 0);
        cr_expect_str_eq(cc, want, "fd %d (ports %u -> %u)", fd, ntohs(mine.sin_port),
                         ntohs(theirs.sin_port));
        seen++;
    }
    return seen;
}

Test(engine, tcp_congestion)
{
    char sys[64], allowed[512], other[16] = "";
    read_line("/proc/sys/net/ipv4/tcp_congestion_control", sys, sizeof sys);
    read_line("/proc/sys/net/ipv4/tcp_allowed_congestion_control", allowed, sizeof allowed);
    cr_assert(sys[0], "no /proc/sys/net/ipv4/tcp_congestion_control");
    /* An algorithm other than the system's, so that the setting shows on the sockets. */
    for (char *save = NULL, *tok = strtok_r(allowed, " ", &save); tok && !other[0];
         tok = strtok_r(NULL, " ", &save))
        if (strcmp(tok, sys) && strlen(tok) < sizeof other)
            strcpy(other, tok);

    kvb_config_t c;
    kvb_engine_t *e = NULL;
    kvb_config_init(&c);
    cr_assert_null(c.tcp_congestion);
    c.tcp_congestion = "no-such-cc"; /* unknown to the kernel */
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    c.tcp_congestion = "sixteen-chars-xx"; /* one more than the kernel's names hold */
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    cr_assert_null(e);
    c.tcp_congestion = ""; /* the same as NULL */
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    cr_expect_str_eq(kvb_engine_tcp_congestion(e), sys, "the system's default");
    kvb_engine_destroy(e);
    if (!other[0])
        cr_skip_test("only %s is allowed here: nothing to switch to", sys);

    /* From the environment, as a framework's connector would set it; both sides run it on every
     * connection, and data moves. */
    cr_assert_eq(setenv("KVB_TCP_CONGESTION", other, 1), 0);
    kvb_engine_t *a = make_proto(1, 3, "tcp"), *b = make_proto(1, 2, "tcp");
    cr_expect_str_eq(kvb_engine_tcp_congestion(a), other);
    cr_expect_str_eq(kvb_engine_tcp_congestion(b), other);
    size_t size = 1 << 20;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, 3, &src, &dst);
    kvb_request_t r = {KVB_OP_READ, dst, s, (uintptr_t)src, size};
    move_ok(a, &r, 1, 10000);
    cr_assert_eq(memcmp(dst, src, size), 0);
    /* a's 3 lanes to b: both ends of each are in this process. */
    cr_expect_eq(sockets_with_congestion(kvb_engine_port(b), other), 6);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);

    /* The config wins over the environment. */
    kvb_config_init(&c);
    cr_expect_str_eq(c.tcp_congestion, other);
    c.tcp_congestion = sys;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    cr_expect_str_eq(kvb_engine_tcp_congestion(e), sys);
    kvb_engine_destroy(e);
    free(src);
    free(dst);
}

/* CPU time this process used, in ms. */
static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static kvb_engine_t *make_polling(const char *protocol, uint32_t busy_poll_us, uint32_t linger_us)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.protocol = protocol;
    c.busy_poll_us = busy_poll_us;
    c.linger_us = linger_us;
    kvb_engine_t *e;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    cr_assert_eq(kvb_engine_busy_poll_us(e), busy_poll_us);
    cr_assert_eq(kvb_engine_linger_us(e), linger_us > busy_poll_us ? linger_us : busy_poll_us);
    return e;
}

static kvb_engine_t *make_spinning(const char *protocol, uint32_t busy_poll_us)
{
    return make_polling(protocol, busy_poll_us, KVB_LINGER_DEFAULT_US);
}

/* Milliseconds of this process's CPU in the 150 ms after one 4 KiB READ from a to b, and in 200
 * ms half a second later (only the engines' ticks then). */
static void cpu_after_read(kvb_engine_t *a, kvb_engine_t *b, uint64_t seed, double *spun,
                           double *idle)
{
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, 4096, seed, &src, &dst);
    kvb_request_t r = {KVB_OP_READ, dst, s, (uintptr_t)src, 4096};
    double t0 = cpu_ms();
    move_ok(a, &r, 1, 10000);
    usleep(150000);
    *spun = cpu_ms() - t0;
    usleep(350000);
    t0 = cpu_ms();
    usleep(200000);
    *idle = cpu_ms() - t0;
    cr_assert_eq(memcmp(dst, src, 4096), 0);
    free(src);
    free(dst);
}

/* Busy polling: checked where it is set; data moves the same on every path and batch shape
 * (one connection, which the waiting thread polls, or several); threads spin after traffic for
 * as long as they were told, and not longer. */
/* A setting in microseconds: the uint32_t of kvb_config_t at `off` and its variable `env` -
 * `dflt` where unset, over the maximum refused from the config and from the environment (so is
 * what is not a number), and 250 taken from the environment. */
static void us_setting(size_t off, const char *env, uint32_t dflt)
{
    kvb_config_t c;
    uint32_t *us = (uint32_t *)((char *)&c + off);
    kvb_engine_t *e = NULL;
    cr_assert_eq(unsetenv(env), 0);
    kvb_config_init(&c);
    cr_expect_eq(*us, dflt, "%s unset", env);
    *us = KVB_BUSY_POLL_MAX_US + 1;
    cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    static const char *bad[] = {"abc", "-5", "12us", "100001", "99999999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_eq(setenv(env, bad[i], 1), 0);
        kvb_config_init(&c);
        cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG, "%s=%s", env, bad[i]);
    }
    cr_assert_null(e);
    cr_assert_eq(setenv(env, "250", 1), 0);
    kvb_config_init(&c);
    cr_expect_eq(*us, 250);
    cr_assert_eq(unsetenv(env), 0);
}

/* With the longest spin there is (100 ms, busy polling or lingering): after a transfer the
 * target's progress thread (b's, which took the request in) polls without sleeping - the process
 * burns CPU - and once the spin has passed it sleeps. The window holds the whole spin; loose
 * bounds (a fifth of a core for it), since the machine may be loaded. */
static void spins_then_sleeps(const char *protocol, uint32_t busy_poll_us, uint32_t linger_us,
                              uint64_t seed)
{
    kvb_engine_t *a = make_polling(protocol, busy_poll_us, linger_us);
    kvb_engine_t *b = make_polling(protocol, busy_poll_us, linger_us);
    double spun, idle;
    cpu_after_read(a, b, seed, &spun, &idle);
    cr_expect_gt(spun, 20, "%.1f ms of CPU in the 150 ms after requests: no spin", spun);
    cr_expect_lt(idle, 30, "%.1f ms of CPU in 200 ms, half a second after the transfer", idle);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
}

static void busy_polling(const char *protocol)
{
    us_setting(offsetof(kvb_config_t, busy_poll_us), "KVB_BUSY_POLL_US", 0); /* off by default */

    kvb_engine_t *a = make_spinning(protocol, 300), *b = make_spinning(protocol, 300);
    size_t size = 4 << 20;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, 11, &src, &dst);
    const char *path = NULL;
    cr_assert_eq(kvb_segment_transport(a, s, &path), KVB_OK);
    cr_expect_str_eq(path, protocol);
    /* 128 small READs (one lane: the waiting thread polls it), then the whole buffer in 1 MiB
     * READs (every lane: the progress threads read them). */
    kvb_request_t r[128];
    for (int round = 0; round < 20; round++) {
        memset(dst, 0, size);
        for (size_t i = 0; i < 128; i++)
            r[i] = (kvb_request_t){KVB_OP_READ, dst + i * 4096, s, (uintptr_t)src + i * 4096, 4096};
        move_ok(a, r, 128, 10000);
        cr_assert_eq(memcmp(dst, src, 128 * 4096), 0, "round %d", round);
        for (size_t i = 0; i < 4; i++)
            r[i] = (kvb_request_t){KVB_OP_READ, dst + (i << 20), s, (uintptr_t)src + (i << 20),
                                   1 << 20};
        move_ok(a, r, 4, 10000);
        cr_assert_eq(memcmp(dst, src, size), 0, "round %d", round);
    }
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(src);
    free(dst);

    spins_then_sleeps(protocol, KVB_BUSY_POLL_MAX_US, KVB_LINGER_DEFAULT_US, 12);
}

/* Lingering: on by default (KVB_LINGER_DEFAULT_US), checked where it is set; a target's progress
 * thread polls for that long after it took requests in (the longest there is, 100 ms, burns CPU
 * the way busy polling does), then sleeps; 0 sleeps at once. */
static void lingering(const char *protocol)
{
    us_setting(offsetof(kvb_config_t, linger_us), "KVB_LINGER_US", KVB_LINGER_DEFAULT_US);
    kvb_engine_t *e = NULL;
    /* busy polling, where longer, takes its place */
    kvb_engine_destroy(make_polling(protocol, 300, 50));
    /* A caller built before `linger_us` existed gets the default, or KVB_LINGER_US. */
    kvb_config_t old;
    kvb_config_init_v(&old, offsetof(kvb_config_t, linger_us));
    cr_assert_eq(kvb_engine_create(&old, &e), KVB_OK);
    cr_expect_eq(kvb_engine_linger_us(e), KVB_LINGER_DEFAULT_US);
    kvb_engine_destroy(e);
    cr_assert_eq(setenv("KVB_LINGER_US", "7", 1), 0);
    cr_assert_eq(kvb_engine_create(&old, &e), KVB_OK);
    cr_assert_eq(unsetenv("KVB_LINGER_US"), 0);
    cr_expect_eq(kvb_engine_linger_us(e), 7);
    kvb_engine_destroy(e);

    spins_then_sleeps(protocol, 0, KVB_BUSY_POLL_MAX_US, 13);

    kvb_engine_t *a = make_polling(protocol, 0, 0), *b = make_polling(protocol, 0, 0);
    double spun, idle;
    cpu_after_read(a, b, 14, &spun, &idle);
    cr_expect_lt(spun, 20, "%.1f ms of CPU in the 150 ms after requests with lingering off", spun);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
}

/* How often thread `tid` of this process blocked (its voluntary context switches). */
static long blocked_times(pid_t tid)
{
    char path[64], line[128];
    snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
    FILE *f = fopen(path, "re");
    cr_assert_not_null(f, "%s", path);
    long n = -1;
    while (n < 0 && fgets(line, sizeof line, f))
        if (sscanf(line, "voluntary_ctxt_switches: %ld", &n) != 1)
            n = -1;
    fclose(f);
    cr_assert_geq(n, 0, "%s has no voluntary_ctxt_switches", path);
    return n;
}

/* 4 rounds of 64 1 MiB READs over TCP (both lanes: the initiator's progress thread reads the
 * answers) by an initiator lingering `linger_us` from a target that does not linger: how often
 * the initiator's progress threads blocked during them, and the milliseconds of this process's
 * CPU in the 150 ms after them. */
static void answers_read(uint32_t linger_us, uint64_t seed, long *blocked, double *after)
{
    pid_t before[16], tids[16], mine[16];
    int nb = threads_named_tids("kvb-tcp-", before, 16), nm = 0;
    kvb_engine_t *a = make_polling("tcp", 0, linger_us);
    int n = threads_named_tids("kvb-tcp-", tids, 16);
    for (int i = 0; i < n; i++) {
        bool old = false;
        for (int k = 0; k < nb; k++)
            old |= tids[i] == before[k];
        if (!old)
            mine[nm++] = tids[i];
    }
    cr_assert_gt(nm, 0, "no progress thread of the initiator's found");
    kvb_engine_t *b = make_polling("tcp", 0, 0);
    size_t size = 64u << 20;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, seed, &src, &dst);
    kvb_request_t r[64];
    for (size_t i = 0; i < 64; i++)
        r[i] =
            (kvb_request_t){KVB_OP_READ, dst + (i << 20), s, (uintptr_t)src + (i << 20), 1 << 20};
    move_ok(a, r, 64, 10000); /* the pages reached once */
    long v0 = 0, v1 = 0;
    for (int i = 0; i < nm; i++)
        v0 += blocked_times(mine[i]);
    for (int round = 0; round < 4; round++)
        move_ok(a, r, 64, 10000);
    for (int i = 0; i < nm; i++)
        v1 += blocked_times(mine[i]);
    *blocked = v1 - v0;
    double t0 = cpu_ms();
    usleep(150000);
    *after = cpu_ms() - t0;
    cr_assert_eq(memcmp(dst, src, size), 0);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(src);
    free(dst);
}

/* Polling for answers: an initiator's progress thread that read answers over TCP with more owed
 * on that connection polls for linger_us before it sleeps - during READs spread over both lanes
 * it blocks a few times (between the batches), where with lingering off it blocked 860-980 times
 * here (35-1201 times with two busy loops beside it, which often keep it from emptying its
 * sockets: hence the comparison only where it blocked often enough without) - and
 * sleeps at once when none is owed: with the longest linger there is (100 ms), no CPU spent after
 * the transfer. */
Test(engine, answers_polled_over_tcp, .timeout = 60)
{
    long off, on;
    double after_off, after_on;
    answers_read(0, 21, &off, &after_off);
    answers_read(KVB_BUSY_POLL_MAX_US, 22, &on, &after_on);
    cr_log_info("256 MiB of READ answers: the initiator's progress thread blocked %ld times, "
                "%ld polling for them; %.1f ms of CPU in the 150 ms after",
                off, on, after_on);
    cr_expect(on < 32 && (off < 64 || on * 4 < off),
              "it blocked %ld times polling for answers, %ld times without", on, off);
    cr_expect_lt(after_on, 20, "%.1f ms of CPU in the 150 ms after the answers were in", after_on);
}

Test(engine, lingering_tcp)
{
    lingering("tcp");
}

Test(engine, lingering_shm)
{
    lingering("shm");
}

Test(engine, busy_polling_tcp)
{
    busy_polling("tcp");
}

Test(engine, busy_polling_shm)
{
    busy_polling("shm");
}

/* The CPUs a thread of this process named `name` may run on, as the kernel lists them ("0-1"),
 * or "" if there is no such thread. */
static void thread_cpus(const char *name, char *out, size_t outsz)
{
    out[0] = '\0';
    DIR *d = opendir("/proc/self/task");
    cr_assert_not_null(d);
    for (struct dirent *t; (t = readdir(d));) {
        char path[300], comm[32] = "", line[256];
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", t->d_name);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        bool match = fgets(comm, sizeof comm, f) && !strncmp(comm, name, strlen(name)) &&
                     comm[strlen(name)] == '\n';
        fclose(f);
        snprintf(path, sizeof path, "/proc/self/task/%s/status", t->d_name);
        if (!match || !(f = fopen(path, "re")))
            continue;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "Cpus_allowed_list: %63s", out) == 1)
                break;
        fclose(f);
    }
    closedir(d);
    cr_assert_lt(strlen(out), outsz);
}

/* cpus: checked where it is set (the config, KVB_CPUS); each data thread runs on its CPU of the
 * list from its start - progress threads first, then copy threads, wrapping around - and is
 * named; bytes move as they do unbound, on both paths. */
Test(engine, data_threads_on_cpus)
{
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    int first = -1, last = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) {
            first = first < 0 ? c : first;
            last = c;
        }
    kvb_config_t c;
    kvb_engine_t *e = NULL;
    cr_assert_eq(unsetenv("KVB_CPUS"), 0);
    kvb_config_init(&c);
    cr_expect_null(c.cpus, "unbound unless asked for");
    static const char *bad[] = {"x", "0-", "1-0", "0,,1", "1024", "0 1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        c.cpus = bad[i];
        cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG, "cpus \"%s\"", bad[i]);
        cr_assert_eq(setenv("KVB_CPUS", bad[i], 1), 0);
        kvb_config_init(&c);
        cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG, "KVB_CPUS=%s", bad[i]);
        cr_assert_eq(unsetenv("KVB_CPUS"), 0);
    }
    cr_assert_null(e);

    char list[32], want[32], got[64];
    snprintf(list, sizeof list, "%d,%d", last, first);
    cr_assert_eq(setenv("KVB_CPUS", list, 1), 0);
    kvb_config_init(&c);
    cr_assert_eq(unsetenv("KVB_CPUS"), 0);
    cr_expect_str_eq(c.cpus, list);
    c.progress_threads = 2;
    c.copy_threads = 1;
    /* A caller built before `cpus` existed: its struct ends where the field would start, and
     * KVB_CPUS (read when the engine is created) still binds the threads. */
    kvb_config_t old;
    kvb_config_init_v(&old, offsetof(kvb_config_t, cpus));
    cr_assert_eq(setenv("KVB_CPUS", list, 1), 0);
    cr_assert_eq(kvb_engine_create(&old, &e), KVB_OK);
    cr_assert_eq(unsetenv("KVB_CPUS"), 0);
    cr_expect_str_eq(kvb_engine_cpus(e), list);
    kvb_engine_destroy(e);
    cr_assert_eq(kvb_engine_create(&old, &e), KVB_OK);
    cr_expect_str_eq(kvb_engine_cpus(e), "", "unbound without KVB_CPUS");
    kvb_engine_destroy(e);

    kvb_engine_t *a;
    cr_assert_eq(kvb_engine_create(&c, &a), KVB_OK);
    cr_expect_str_eq(kvb_engine_cpus(a), list, "the list in the order given");
    static const char *names[] = {"kvb-tcp-0", "kvb-tcp-1", "kvb-copy-0"};
    for (int i = 0; i < 3; i++) {
        snprintf(want, sizeof want, "%d", i % 2 ? first : last);
        thread_cpus(names[i], got, sizeof got);
        cr_expect_str_eq(got, want, "%s", names[i]);
    }
    thread_cpus("kvb-shm", got, sizeof got); /* the same-host listener: not a data thread */
    cr_expect_str_neq(got, "");

    for (int round = 0; round < 4; round++) {
        /* b unbound (the scheduler places its threads), same-host copies or the TCP lanes; a
         * the initiator, then the target. */
        kvb_engine_t *b = make_proto(1, 2, round / 2 ? "tcp" : "auto");
        cr_expect_str_eq(kvb_engine_cpus(b), "");
        kvb_engine_t *from = round % 2 ? b : a, *to = round % 2 ? a : b;
        size_t size = 8 << 20;
        uint8_t *src, *dst;
        kvb_segment_t s = pattern_pair(from, to, size, 21 + (uint64_t)round, &src, &dst);
        const char *path = NULL;
        cr_assert_eq(kvb_segment_transport(from, s, &path), KVB_OK);
        cr_expect_str_eq(path, round / 2 ? "tcp" : "shm");
        kvb_request_t r[8];
        for (size_t i = 0; i < 8; i++)
            r[i] = (kvb_request_t){KVB_OP_READ, dst + (i << 20), s, (uintptr_t)src + (i << 20),
                                   1 << 20};
        move_ok(from, r, 8, 10000);
        cr_expect_eq(memcmp(dst, src, size), 0, "round %d", round);
        kvb_segment_close(from, s);
        kvb_engine_destroy(b);
        cr_assert_eq(kvb_unregister(a, round % 2 ? src : dst), KVB_OK);
        free(src);
        free(dst);
    }
    kvb_engine_destroy(a);
}

/* Bytes this process received and had acknowledged on its TCP connections to `port` (lanes it
 * dialled): one entry per socket, up to cap; returns the count. */
static int lane_bytes(uint16_t port, uint64_t *rx, uint64_t *tx, int cap)
{
    int n = 0;
    for (int fd = 3; fd < 4096 && n < cap; fd++) {
        int proto = 0;
        socklen_t pl = sizeof proto;
        struct sockaddr_in theirs;
        socklen_t tl = sizeof theirs;
        if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &pl) || proto != IPPROTO_TCP ||
            getpeername(fd, (struct sockaddr *)&theirs, &tl) || theirs.sin_family != AF_INET ||
            ntohs(theirs.sin_port) != port)
            continue;
        struct tcp_info ti;
        socklen_t il = sizeof ti;
        memset(&ti, 0, sizeof ti);
        cr_assert_eq(getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &il), 0);
        cr_assert_geq(il, offsetof(struct tcp_info, tcpi_bytes_received) + 8, "an old kernel");
        rx[n] = ti.tcpi_bytes_received;
        tx[n] = ti.tcpi_bytes_acked;
        n++;
    }
    return n;
}

/* A batch of many large requests goes out one append per lane, each lane taking every third
 * 1 MiB share: every byte lands in both directions, and every lane carries its part. */
Test(engine, large_batches_spread_over_every_lane_tcp)
{
    kvb_engine_t *a = make_proto(2, 3, "tcp"), *b = make_proto(1, 1, "tcp");
    size_t size = 24 << 20, block = 256 << 10;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, 17, &src, &dst);
    enum { N = 96 }; /* 24 MiB: 24 shares of 1 MiB, 8 for each lane */
    kvb_request_t r[N];
    for (int i = 0; i < N; i++) /* destinations in reverse order: no share is where it came from */
        r[i] = (kvb_request_t){KVB_OP_READ, dst + (size_t)(N - 1 - i) * block, s,
                               (uintptr_t)src + (size_t)i * block, block};
    move_ok(a, r, N, 20000);
    for (int i = 0; i < N; i++)
        cr_assert_eq(memcmp(dst + (size_t)(N - 1 - i) * block, src + (size_t)i * block, block), 0,
                     "READ %d", i);
    /* WRITEs of a's dst, now a permutation of the pattern, back over b's src */
    uint8_t *want = malloc(size);
    cr_assert_not_null(want);
    memcpy(want, dst, size);
    cr_assert_eq(kvb_unregister(b, src), KVB_OK); /* b's pattern, writable now, and cleared */
    memset(src, 0, size);
    cr_assert_eq(kvb_register(b, src, size, NULL, KVB_ACCESS_RW), KVB_OK);
    for (int i = 0; i < N; i++)
        r[i] = (kvb_request_t){KVB_OP_WRITE, dst + (size_t)i * block, s,
                               (uintptr_t)src + (size_t)i * block, block};
    move_ok(a, r, N, 20000);
    cr_assert_eq(memcmp(src, want, size), 0, "WRITE");
    uint64_t rx[8], tx[8];
    cr_assert_eq(lane_bytes(kvb_engine_port(b), rx, tx, 8), 3, "a's three lanes to b");
    for (int i = 0; i < 3; i++) {
        cr_expect_geq(rx[i], 6u << 20, "lane %d received %llu B of the 24 MiB READ", i,
                      (unsigned long long)rx[i]);
        cr_expect_geq(tx[i], 6u << 20, "lane %d sent %llu B of the 24 MiB WRITE", i,
                      (unsigned long long)tx[i]);
    }
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(want);
    free(src);
    free(dst);
}

Test(engine, open_errors_are_prompt)
{
    kvb_engine_t *a = make(1, 1);
    kvb_segment_t s;
    cr_expect_eq(kvb_segment_open(a, "no-port", &s), KVB_ERR_INVALID_ARG);
    cr_expect_eq(kvb_segment_open(a, "127.0.0.1:0", &s), KVB_ERR_INVALID_ARG);
    cr_expect_eq(kvb_segment_open(a, "127.0.0.1:99999", &s), KVB_ERR_INVALID_ARG);
    cr_expect_eq(kvb_segment_open(a, "host.invalid:80", &s), KVB_ERR_RESOLVE);
    /* A port nobody listens on: refused at once. */
    kvb_engine_t *tmp = make(1, 1);
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%u", kvb_engine_port(tmp));
    kvb_engine_destroy(tmp);
    uint64_t t0 = kvb__now_ns();
    cr_expect_eq(kvb_segment_open(a, name, &s), KVB_ERR_CONNECT);
    cr_expect_lt(kvb__now_ns() - t0, 1000000000ull);
    kvb_region_info_t r;
    size_t n;
    cr_expect_eq(kvb_segment_regions(a, 42, 0, &r, 1, &n), KVB_ERR_BAD_SEGMENT);
    kvb_engine_destroy(a);
}

Test(engine, register_rules)
{
    kvb_engine_t *a = make(1, 1);
    static uint8_t mem[8192];
    cr_expect_eq(kvb_register(a, mem, 4096, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_expect_eq(kvb_register(a, mem + 100, 10, NULL, KVB_ACCESS_RW), KVB_ERR_OVERLAP);
    cr_expect_eq(kvb_register(a, mem + 4096, 4096, "cpu:1", KVB_ACCESS_READ), KVB_OK);
    cr_expect_eq(kvb_register(a, NULL, 10, NULL, KVB_ACCESS_RW), KVB_ERR_INVALID_ARG);
    cr_expect_eq(kvb_register(a, mem, 0, NULL, KVB_ACCESS_RW), KVB_ERR_INVALID_ARG);
    cr_expect_eq(kvb_unregister(a, mem + 1), KVB_ERR_NOT_FOUND);
    cr_expect_eq(kvb_unregister(a, mem), KVB_OK);
    cr_expect_eq(kvb_unregister(a, mem), KVB_ERR_NOT_FOUND);
    kvb_engine_destroy(a);
}

/* A submit that fails on a later request lets go of every pin the earlier ones took - runs in
 * one region are counted and pinned at once - and of nothing more: right after, both local regions
 * unregister at once (a pin left would say BUSY), and a batch of the same runs still moves. Sizes
 * below and above the requests the submit keeps on its stack. */
Test(engine, failed_submit_leaves_no_pins)
{
    kvb_engine_t *a = make(1, 1), *b = make(1, 1);
    size_t size = 1 << 20;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, 21, &src, &dst);
    uint8_t *other = calloc(1, size);
    cr_assert_eq(kvb_register(a, other, size, NULL, KVB_ACCESS_RW), KVB_OK);
    static const size_t counts[] = {3, 128, 129, 600};
    for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
        size_t n = counts[c];
        kvb_request_t *r = calloc(n, sizeof *r);
        for (size_t i = 0; i < n; i++) { /* runs of 7 in dst, then 5 in other, in turn */
            uint8_t *base = i % 12 < 7 ? dst : other;
            uint64_t off = (i * 1024) % size;
            r[i] = (kvb_request_t){KVB_OP_READ, base + off, s, (uintptr_t)src + off, 1024};
        }
        static uint8_t unregistered[64];
        kvb_request_t last = r[n - 1];
        r[n - 1].local = unregistered;
        kvb_batch_t *batch = NULL;
        cr_expect_eq(kvb_batch_submit(a, r, n, NULL, &batch), KVB_ERR_LOCAL_NOT_REGISTERED);
        cr_expect_null(batch);
        r[n - 1] = last;
        r[0].len = 0; /* the first one bad: nothing pinned yet */
        cr_expect_eq(kvb_batch_submit(a, r, n, NULL, &batch), KVB_ERR_INVALID_ARG);
        r[0].len = 1024;
        cr_assert_eq(kvb_unregister(a, dst), KVB_OK, "%zu requests: a pin of dst left", n);
        cr_assert_eq(kvb_unregister(a, other), KVB_OK, "%zu requests: a pin of other left", n);
        cr_assert_eq(kvb_register(a, dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
        cr_assert_eq(kvb_register(a, other, size, NULL, KVB_ACCESS_RW), KVB_OK);
        move_ok(a, r, n, 10000);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(memcmp(r[i].local, src + (r[i].remote - (uintptr_t)src), 1024), 0,
                         "%zu requests: request %zu", n, i);
        cr_assert_eq(kvb_unregister(a, dst), KVB_OK, "%zu requests: the batch left a pin", n);
        cr_assert_eq(kvb_unregister(a, other), KVB_OK);
        cr_assert_eq(kvb_register(a, dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
        cr_assert_eq(kvb_register(a, other, size, NULL, KVB_ACCESS_RW), KVB_OK);
        free(r);
    }
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(src);
    free(dst);
    free(other);
}

/* Many small requests between two engines with several lanes and progress threads each. */
static void many_small_requests(const char *protocol)
{
    kvb_engine_t *a = make_proto(3, 4, protocol), *b = make_proto(2, 3, protocol);
    size_t size = 4 << 20;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, 5, &src, &dst);
    enum { N = 2000 };
    kvb_request_t *r = calloc(N, sizeof *r);
    uint64_t rs = 99;
    for (int i = 0; i < N; i++) {
        uint64_t len = 1 + test_rand(&rs) % 2000, off = test_rand(&rs) % (size - len);
        r[i] = (kvb_request_t){KVB_OP_READ, dst + off, s, (uintptr_t)src + off, len};
    }
    kvb_batch_t *batch;
    cr_assert_eq(kvb_batch_submit(a, r, N, NULL, &batch), KVB_OK);
    cr_assert_eq(kvb_batch_size(batch), N);
    cr_assert_eq(kvb_batch_wait(batch, 10000), KVB_OK);
    kvb_req_status_t st;
    cr_assert_eq(kvb_batch_status(batch, N, &st), KVB_ERR_INVALID_ARG);
    for (int i = 0; i < N; i++) {
        kvb_batch_status(batch, (size_t)i, &st);
        cr_assert_eq(st.state, KVB_REQ_COMPLETED);
        cr_assert_eq(st.bytes, r[i].len);
        uint64_t off = (uint64_t)((uint8_t *)r[i].local - dst);
        cr_assert_eq(memcmp(dst + off, src + off, r[i].len), 0, "request %d", i);
    }
    kvb_batch_free(batch);
    /* Writing to a read-only region is refused by the target. */
    kvb_request_t w = {KVB_OP_WRITE, dst, s, (uintptr_t)src, 16};
    cr_assert_eq(kvb_batch_submit(a, &w, 1, NULL, &batch), KVB_OK);
    cr_assert_eq(kvb_batch_wait(batch, 5000), KVB_ERR_ACCESS_DENIED);
    kvb_batch_free(batch);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(r);
    free(src);
    free(dst);
}

/* Whether socket inode `ino` is one of this process's descriptors (/proc/self/fd). */
static bool own_socket(unsigned long ino)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *de;
    char path[300], link[64], want[64];
    bool own = false;
    snprintf(want, sizeof want, "socket:[%lu]", ino);
    while (d && !own && (de = readdir(d))) {
        snprintf(path, sizeof path, "/proc/self/fd/%s", de->d_name);
        ssize_t n = readlink(path, link, sizeof link - 1);
        own = n > 0 && (link[n] = '\0', !strcmp(link, want));
    }
    if (d)
        closedir(d);
    return own;
}

/* This process's connections in state ESTABLISHED with `port` at either end (/proc/net/tcp).
 * Only its own: with another test process running beside it (ctest -j2), counting every socket
 * of the host found 8 and 9 ends where this test has 6 (2 runs of 60 with two instances of the
 * test at once); counting this process's sockets, 60 of 60 found 6. */
static int established_on(uint16_t port)
{
    int n = 0;
    const char *files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    for (size_t i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "r");
        char line[512];
        unsigned lp, rp, st;
        unsigned long ino;
        while (f && fgets(line, sizeof line, f))
            if (sscanf(line, " %*u: %*[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%x %x %*s %*s %*s %*s %*s %lu",
                       &lp, &rp, &st, &ino) == 4 &&
                st == 1 && (lp == port || rp == port) && own_socket(ino))
                n++;
        if (f)
            fclose(f);
    }
    return n;
}

/* Connected Unix sockets bound to the abstract name `name`: a listener's accepted ends
 * (/proc/net/unix, state 03). */
static int unix_connected(const char *name)
{
    int n = 0;
    FILE *f = fopen("/proc/net/unix", "r");
    char line[512], path[256];
    unsigned st;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "%*s %*s %*s %*s %*s %x %*s %255s", &st, path) == 2 && st == 3 &&
            path[0] == '@' && !strcmp(path + 1, name))
            n++;
    if (f)
        fclose(f);
    return n;
}

/* A same-host peer's lanes are Unix sockets: lane 0 proves over TCP who the peer is, then every
 * lane is a Unix socket and no TCP connection stays. An initiator limited to TCP keeps TCP lanes.
 * Both move the same bytes. */
Test(engine, same_host_lanes_are_unix_sockets)
{
    kvb_engine_t *b = make(1, 1), *a = make(2, 3), *t = make_proto(1, 3, "tcp");
    size_t size = 1 << 20;
    uint8_t *src, *dst;
    kvb_segment_t s = pattern_pair(a, b, size, 5, &src, &dst);
    uint64_t inc;
    cr_assert_eq(kvb_segment_incarnation(a, s, &inc), KVB_OK);
    char name[64];
    snprintf(name, sizeof name, "kvbridge-%016llx-lanes", (unsigned long long)inc);
    uint16_t port = kvb_engine_port(b);
    int tcp = -1;
    for (int i = 0; i < 200 && (tcp = established_on(port)) != 0; i++)
        usleep(10000); /* lane 0's TCP connection closes just after the handshake */
    cr_assert_eq(tcp, 0, "%d TCP connections stay with a same-host peer", tcp);
    cr_assert_eq(unix_connected(name), 3);
    kvb_request_t r = {KVB_OP_READ, dst, s, (uintptr_t)src, size};
    move_ok(a, &r, 1, 10000);
    cr_assert_eq(memcmp(dst, src, size), 0);

    cr_assert_eq(kvb_register(t, dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t ts;
    cr_assert_eq(kvb_segment_open(t, kvb_engine_segment_name(b), &ts), KVB_OK);
    int lanes = established_on(port);
    cr_assert_eq(lanes, 2 * 3, "both ends of 3 TCP lanes: %d connection ends on port %u", lanes,
                 port);
    cr_assert_eq(unix_connected(name), 3);
    memset(dst, 0, size);
    r.segment = ts;
    move_ok(t, &r, 1, 10000);
    cr_assert_eq(memcmp(dst, src, size), 0);
    kvb_engine_destroy(t);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(src);
    free(dst);
}

Test(engine, many_small_requests_over_many_lanes_tcp)
{
    many_small_requests("tcp");
}

Test(engine, many_small_requests_over_many_lanes_shm)
{
    many_small_requests("shm");
}

/* READ answers come in runs (over TCP one header, then many requests' bytes, received in one
 * scattering call; same-host, one header for a set's copies): a failed request in the middle
 * answers alone and the rest still land. Over TCP a batch freed with its READs in flight has its
 * bytes dropped, never written where it pointed (same-host, a copy under way may still land: see
 * the README); the next batch on the same lanes is whole. Same-host, the 3000 requests make 24
 * sets of copies, each started on the copy pool while the one before is answered (the
 * initiator's memory is kvb_alloc'd, so the target copies through its mapping, in the pool). */
static void runs_with_failures(const char *proto)
{
    bool shm = !strcmp(proto, "shm");
    kvb_engine_t *a = make_proto(1, 1, proto), *b = make_proto(1, 1, proto);
    size_t size = 32 << 20;
    uint8_t *src = malloc(size), *dst, *gone = malloc(size);
    test_pattern_fill(src, 0, size, 11);
    if (shm) {
        cr_assert_eq(kvb_alloc(a, size, 0, (void **)&dst), KVB_OK);
        memset(dst, 0, size);
    } else {
        dst = calloc(1, size);
    }
    cr_assert_eq(kvb_register(b, src, size, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(kvb_register(a, dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb_register(a, gone, size, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
    const char *path;
    cr_assert_eq(kvb_segment_transport(a, s, &path), KVB_OK);
    cr_assert_str_eq(path, proto);
    enum { N = 3000 };
    kvb_request_t *r = calloc(N, sizeof *r);
    uint64_t rs = 7, at = 0;
    for (int i = 0; i < N; i++) { /* disjoint destinations, sizes from 1 byte to 16 KB */
        uint64_t len = 1 + test_rand(&rs) % 16000, off = test_rand(&rs) % (size - len);
        /* every 97th asks past the end of the target's region: refused on its own */
        uint64_t remote = i % 97 == 50 ? (uintptr_t)src + size - len / 2 : (uintptr_t)src + off;
        r[i] = (kvb_request_t){KVB_OP_READ, dst + at, s, remote, len};
        at += len;
    }
    cr_assert_leq(at, size);
    kvb_batch_t *batch;
    cr_assert_eq(kvb_batch_submit(a, r, N, NULL, &batch), KVB_OK);
    cr_assert_eq(kvb_batch_wait(batch, 20000), KVB_ERR_REMOTE_NOT_REGISTERED);
    for (int i = 0; i < N; i++) {
        kvb_req_status_t st;
        kvb_batch_status(batch, (size_t)i, &st);
        if (i % 97 == 50) {
            cr_assert_eq(st.state, KVB_REQ_FAILED, "request %d", i);
            cr_assert_eq(st.error, KVB_ERR_REMOTE_NOT_REGISTERED);
            continue;
        }
        cr_assert_eq(st.state, KVB_REQ_COMPLETED, "request %d", i);
        cr_assert_eq(st.bytes, r[i].len);
        cr_assert_eq(memcmp(r[i].local, (uint8_t *)(uintptr_t)r[i].remote, r[i].len), 0,
                     "request %d", i);
    }
    kvb_batch_free(batch);
    for (int i = 0; i < N; i++)
        r[i].remote = (uintptr_t)src + (size_t)((uint8_t *)r[i].local - dst);

    if (!shm) { /* Freed in flight: whatever still arrives goes nowhere. */
        for (int i = 0; i < N; i++)
            r[i].local = gone + ((uint8_t *)r[i].local - dst);
        cr_assert_eq(kvb_batch_submit(a, r, N, NULL, &batch), KVB_OK);
        kvb_batch_free(batch);
        memset(gone, 0xEE, size);
        for (int i = 0; i < N; i++)
            r[i].local = dst + ((uint8_t *)r[i].local - gone);
    }
    /* The next batch on the same lane: whole and right. */
    memset(dst, 0, size);
    move_ok(a, r, N, 20000);
    cr_assert_eq(memcmp(dst, src, at), 0);
    if (!shm) {
        size_t touched = 0;
        while (touched < size && gone[touched] == 0xEE)
            touched++;
        cr_assert_eq(touched, size, "byte %zu of a freed batch's buffer was written", touched);
    }
    kvb_stats_t st;
    cr_assert_eq(kvb_engine_stats(a, &st), KVB_OK);
    cr_assert_gt(kvb_stats_bytes(&st, proto), at, "the requests went by %s", proto);
    cr_assert_eq(kvb_unregister(a, dst), KVB_OK);
    if (shm)
        cr_assert_eq(kvb_free(a, dst), KVB_OK);
    else
        free(dst);
    kvb_engine_destroy(b);
    kvb_engine_destroy(a);
    free(r);
    free(src);
    free(gone);
}

Test(engine, read_runs_with_failures_and_freed_batches_tcp)
{
    runs_with_failures("tcp");
}

Test(engine, copy_sets_with_failures_in_order_shm)
{
    runs_with_failures("shm");
}

/* Same-host copies into memory larger than KVB_SHM_STREAM_MIN take streaming stores
 * (kvb__copy_stream: ordinary stores up to the first whole cache line and after the last, the
 * lines between streamed). At every alignment and length, READs (into the initiator's kvb_alloc
 * memory) and WRITEs (into the target's registered region) land exactly, and the bytes between
 * the destinations are left alone. `min` "off" copies the same requests with ordinary stores. */
static void streamed_copies(const char *min)
{
    cr_assert_eq(setenv("KVB_SHM_STREAM_MIN", min, 1), 0);
    kvb_engine_t *a = make_proto(1, 1, "shm"), *b = make_proto(1, 1, "shm");
    size_t size = 16 << 20;
    uint8_t *mine, *theirs = malloc(size), *want = malloc(size);
    cr_assert_eq(kvb_alloc(a, size, 0, (void **)&mine), KVB_OK);
    cr_assert(theirs && want);
    cr_assert_eq(kvb_register(a, mine, size, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb_register(b, theirs, size, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
    enum { N = 300 };
    kvb_request_t r[N];
    for (int op = 0; op < 2; op++) {
        bool read = op == 0;
        uint8_t *src = read ? theirs : mine, *dst = read ? mine : theirs;
        test_pattern_fill(src, 0, size, 21 + (uint64_t)op);
        memset(dst, 0xEE, size);
        memset(want, 0xEE, size);
        uint64_t rs = 5 + (uint64_t)op, at = 0;
        for (int i = 0; i < N; i++) { /* 1 byte to 96 KiB, odd gaps: every alignment */
            uint64_t len = i % 10 == 0 ? 1 + test_rand(&rs) % 200 : 1 + test_rand(&rs) % 98304;
            at += test_rand(&rs) % 131;
            uint64_t from = test_rand(&rs) % (size - len);
            cr_assert_leq(at + len, size);
            memcpy(want + at, src + from, len);
            r[i] = read
                       ? (kvb_request_t){KVB_OP_READ, mine + at, s, (uintptr_t)theirs + from, len}
                       : (kvb_request_t){KVB_OP_WRITE, mine + from, s, (uintptr_t)theirs + at, len};
            at += len;
        }
        move_ok(a, r, N, 20000);
        size_t bad = 0;
        while (bad < size && dst[bad] == want[bad])
            bad++;
        cr_assert_eq(bad, size, "%s: byte %zu differs", read ? "READ" : "WRITE", bad);
    }
    kvb_stats_t st;
    cr_assert_eq(kvb_engine_stats(a, &st), KVB_OK);
    cr_assert_gt(kvb_stats_bytes(&st, "shm"), 0, "the requests went by shm");
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    free(theirs);
    free(want);
}

Test(engine, shm_streamed_copies_exact)
{
    streamed_copies("4096");
}

Test(engine, shm_ordinary_copies_exact)
{
    streamed_copies("off");
}

/* Same-host requests travel in runs, one frame naming many (KVB_FRAME_F_SHM | KVB_FRAME_F_RUN),
 * and the target pins the region the request before it pinned without a lookup where it can. Every
 * request is still checked on its own: a run of WRITEs that hops between a writable region, a
 * read-only one, a second writable one and past the end fails exactly the ones it must; once a
 * region is unregistered, a later run cannot reach it. */
Test(engine, shm_request_runs_check_each_request)
{
    kvb_engine_t *a = make_proto(1, 1, "shm"), *b = make_proto(1, 1, "shm");
    enum { N = 600, SZ = 1 << 20 };
    uint8_t *src, *t[3];
    cr_assert_eq(kvb_alloc(a, 3 * SZ, 0, (void **)&src), KVB_OK);
    for (int i = 0; i < 3; i++)
        t[i] = calloc(1, SZ);
    test_pattern_fill(src, 0, 3 * SZ, 5);
    cr_assert_eq(kvb_register(a, src, 3 * SZ, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb_register(b, t[0], SZ, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb_register(b, t[1], SZ, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(kvb_register(b, t[2], SZ, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
    kvb_request_t *r = calloc(N, sizeof *r);
    int *want = calloc(N, sizeof *want), *where = calloc(N, sizeof *where);
    uint64_t rs = 3;
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) {
            /* mostly several in a row into one region, then a hop; disjoint 1 KiB slots */
            int reg = (int)(test_rand(&rs) % 8 < 6 && i > 0 ? (unsigned)where[i - 1]
                                                            : test_rand(&rs) % 3);
            uint64_t len = 1 + test_rand(&rs) % 1024, off = (uint64_t)i * 1024;
            bool past = i % 61 == 7;
            uint64_t remote = past ? (uintptr_t)t[reg] + SZ - len / 2 : (uintptr_t)t[reg] + off;
            where[i] = reg;
            want[i] = past || (round == 1 && reg == 2) ? KVB_ERR_REMOTE_NOT_REGISTERED
                      : reg == 1                       ? KVB_ERR_ACCESS_DENIED
                                                       : KVB_OK;
            r[i] = (kvb_request_t){KVB_OP_WRITE, src + (uint64_t)reg * SZ + off, s, remote, len};
        }
        kvb_batch_t *batch;
        cr_assert_eq(kvb_batch_submit(a, r, N, NULL, &batch), KVB_OK);
        cr_assert_neq(kvb_batch_wait(batch, 20000), KVB_OK);
        size_t fine = 0;
        for (int i = 0; i < N; i++) {
            kvb_req_status_t st;
            kvb_batch_status(batch, (size_t)i, &st);
            if (want[i] != KVB_OK) {
                cr_assert_eq(st.state, KVB_REQ_FAILED, "round %d request %d", round, i);
                cr_assert_eq(st.error, want[i], "round %d request %d: %s", round, i,
                             kvb_strerror(st.error));
                continue;
            }
            fine++;
            cr_assert_eq(st.state, KVB_REQ_COMPLETED, "round %d request %d", round, i);
            cr_assert_eq(memcmp((uint8_t *)(uintptr_t)r[i].remote, r[i].local, r[i].len), 0,
                         "round %d request %d", round, i);
        }
        cr_assert_gt(fine, N / 4);
        for (int i = 0; i < N; i++) /* nothing reached the read-only region */
            cr_assert_eq(t[1][(uint64_t)i * 1024], 0, "slot %d of the read-only region", i);
        kvb_batch_free(batch);
        if (round == 0)
            cr_assert_eq(kvb_unregister(b, t[2]), KVB_OK);
    }
    free(r);
    free(want);
    free(where);
    cr_assert_eq(kvb_unregister(a, src), KVB_OK);
    cr_assert_eq(kvb_free(a, src), KVB_OK);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
    for (int i = 0; i < 3; i++)
        free(t[i]);
}

/* `protocol` is a path order: bad lists are refused; "tcp,shm" attaches both but sends host
 * memory over TCP (first that reaches it); "shm,tcp" the other way; every op is counted once. */
Test(engine, path_order)
{
    static const char *const bad[] = {"", "rdma", "tcp,tcp", "shm,", ",shm", "tcp;shm", "auto,tcp"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvb_config_t c;
        kvb_config_init(&c);
        c.protocol = bad[i];
        kvb_engine_t *e = NULL;
        cr_expect_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG, "protocol '%s'", bad[i]);
    }
    static const struct {
        const char *order, *path;
    } cases[] = {{"tcp,shm", "tcp"}, {"shm,tcp", "shm"}, {"shm", "shm"}, {"tcp", "tcp"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvb_engine_t *a = make_proto(1, 2, cases[i].order), *b = make_proto(1, 2, "auto");
        size_t size = 1 << 20;
        uint8_t *src, *dst;
        cr_assert_eq(kvb_alloc(b, size, 0, (void **)&src), KVB_OK);
        cr_assert_eq(kvb_alloc(a, size, 0, (void **)&dst), KVB_OK);
        test_pattern_fill(src, 0, size, 7 + i);
        cr_assert_eq(kvb_register(b, src, size, NULL, KVB_ACCESS_RW), KVB_OK);
        cr_assert_eq(kvb_register(a, dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
        kvb_segment_t s;
        cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
        const char *path;
        cr_assert_eq(kvb_segment_transport(a, s, &path), KVB_OK);
        cr_expect_str_eq(path, cases[i].path, "protocol %s", cases[i].order);
        kvb_request_t r = {KVB_OP_READ, dst, s, (uintptr_t)src, size};
        move_ok(a, &r, 1, 10000);
        cr_assert_eq(memcmp(dst, src, size), 0);
        kvb_stats_t st;
        cr_assert_eq(kvb_engine_stats(a, &st), KVB_OK);
        cr_expect_eq(kvb_stats_bytes(&st, cases[i].path), size, "protocol %s", cases[i].order);
        cr_expect_eq(kvb_stats_bytes(&st, "tcp") + kvb_stats_bytes(&st, "shm"), size);
        kvb_segment_close(a, s);
        kvb_engine_destroy(a);
        kvb_engine_destroy(b);
    }
}

Test(engine, notifications_limits)
{
    kvb_engine_t *a = make(1, 1), *b = make(1, 1);
    kvb_notification_t *n = malloc(sizeof *n);
    cr_assert_eq(kvb_notify_recv(b, n, 0), KVB_ERR_AGAIN);
    uint64_t t0 = kvb__now_ns();
    cr_assert_eq(kvb_notify_recv(b, n, 100), KVB_ERR_TIMEOUT);
    cr_assert_geq(kvb__now_ns() - t0, 99000000ull);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
    static uint8_t big[KVB_NOTIFY_MAX + 1];
    cr_assert_eq(kvb_notify_send(a, s, big, sizeof big, 1000), KVB_ERR_TOO_LARGE);
    cr_assert_eq(kvb_notify_send(a, s, big, KVB_NOTIFY_MAX, 1000), KVB_OK);
    cr_assert_eq(kvb_notify_send(a, s, NULL, 0, 1000), KVB_OK);
    cr_assert_eq(kvb_notify_recv(b, n, 1000), KVB_OK);
    cr_assert_eq(n->len, KVB_NOTIFY_MAX);
    cr_assert_str_eq(n->from, kvb_engine_segment_name(a));
    cr_assert_eq(kvb_notify_recv(b, n, 1000), KVB_OK);
    cr_assert_eq(n->len, 0);
    /* Nobody reads: the receiver's queue fills and the sender is told so. */
    int rc = KVB_OK, sent = 0;
    while (rc == KVB_OK && sent < 5000) {
        rc = kvb_notify_send(a, s, "x", 1, 1000);
        sent += rc == KVB_OK;
    }
    cr_assert_eq(rc, KVB_ERR_REMOTE_NO_SPACE);
    cr_assert_gt(sent, 100);
    cr_assert_eq(kvb_notify_recv(b, n, 0), KVB_OK);
    cr_assert_eq(kvb_notify_send(a, s, "y", 1, 1000), KVB_OK, "room again after one is taken");
    free(n);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
}

Test(engine, destroyed_peer_fails_requests)
{
    /* Over TCP: in one process, shared memory would finish the 4 GiB before the destroy. */
    kvb_engine_t *a = make_proto(1, 2, "tcp"), *b = make_proto(1, 2, "tcp");
    size_t size = 64 << 20;
    uint8_t *src = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *dst = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_eq(kvb_register(b, src, size, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb_register(a, dst, size, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(a, kvb_engine_segment_name(b), &s), KVB_OK);
    enum { N = 64 };
    kvb_request_t r[N];
    for (int i = 0; i < N; i++)
        r[i] = (kvb_request_t){KVB_OP_READ, dst, s, (uintptr_t)src, size};
    kvb_batch_t *batch;
    cr_assert_eq(kvb_batch_submit(a, r, N, NULL, &batch), KVB_OK);
    kvb_engine_destroy(b);
    int rc = kvb_batch_wait(batch, 3000);
    cr_assert_eq(rc, KVB_ERR_PEER_LOST, "got %s", kvb_status_name(rc));
    kvb_batch_free(batch);
    kvb_engine_destroy(a);
    munmap(src, size);
    munmap(dst, size);
}

/* ---- lifetimes and concurrency -------------------------------------------------------------- */

typedef struct {
    kvb_engine_t *e;
    int rc;
} waiter_t;

static void *recv_forever(void *arg)
{
    waiter_t *w = arg;
    kvb_notification_t *n = malloc(sizeof *n);
    w->rc = kvb_notify_recv(w->e, n, -1);
    free(n);
    return NULL;
}

/* Threads blocked in kvb_notify_recv still need the engine's mutex once destroy wakes them:
 * destroy must wait for them to leave (ASan saw the use after free). */
Test(engine, destroy_wakes_notify_waiters_before_freeing)
{
    for (int round = 0; round < 20; round++) {
        kvb_engine_t *e = make(1, 1);
        waiter_t w[4];
        pthread_t t[4];
        for (int i = 0; i < 4; i++) {
            w[i] = (waiter_t){.e = e, .rc = 1};
            cr_assert_eq(pthread_create(&t[i], NULL, recv_forever, &w[i]), 0);
        }
        /* Destroy only once all four are inside kvb_notify_recv (calling into a destroyed engine
         * would be the caller's bug); then sometimes at once, sometimes a little later. */
        for (unsigned in = 0; in < 4;) {
            pthread_mutex_lock(&e->notify_mu);
            in = e->notify_waiters;
            pthread_mutex_unlock(&e->notify_mu);
            usleep(1000);
        }
        if (round % 2)
            usleep(20000);
        kvb_engine_destroy(e);
        for (int i = 0; i < 4; i++) {
            pthread_join(t[i], NULL);
            cr_assert_eq(w[i].rc, KVB_ERR_SHUTDOWN);
        }
    }
}

/* A handle kept after its last close must not address whatever peer the slot holds next. */
Test(engine, stale_segment_handles_do_not_reach_a_new_peer)
{
    kvb_engine_t *e = make(1, 1), *a = make(1, 1), *b = make(1, 1);
    kvb_segment_t sa, sb;
    cr_assert_eq(kvb_segment_open(e, kvb_engine_segment_name(a), &sa), KVB_OK);
    cr_assert_eq(kvb_segment_close(e, sa), KVB_OK);
    cr_assert_eq(kvb_segment_open(e, kvb_engine_segment_name(b), &sb), KVB_OK);
    cr_assert_neq(sa, sb, "a freed slot's next handle differs");
    uint64_t inc;
    cr_assert_eq(kvb_segment_incarnation(e, sa, &inc), KVB_ERR_BAD_SEGMENT);
    cr_assert_eq(kvb_segment_close(e, sa), KVB_ERR_BAD_SEGMENT);
    cr_assert_eq(kvb_segment_incarnation(e, sb, &inc), KVB_OK);
    cr_assert_eq(kvb_segment_close(e, sb), KVB_OK);
    kvb_engine_destroy(e);
    kvb_engine_destroy(a);
    kvb_engine_destroy(b);
}

typedef struct {
    kvb_engine_t *e;
    const char *name;
    int rc;
    uint64_t ms;
} opener_t;

static void *open_it(void *arg)
{
    opener_t *o = arg;
    uint64_t t0 = kvb__now_ns();
    kvb_segment_t s;
    o->rc = kvb_segment_open(o->e, o->name, &s);
    o->ms = (kvb__now_ns() - t0) / 1000000;
    return NULL;
}

/* A host that accepts and never answers stalls only the opens of its own name. */
Test(engine, a_dead_host_does_not_stall_other_opens)
{
    uint16_t port;
    int lfd = test_silent_listener(&port);
    cr_assert_geq(lfd, 0);
    char dead[64];
    snprintf(dead, sizeof dead, "127.0.0.1:%u", port);
    kvb_config_t c;
    kvb_config_init(&c);
    c.connect_timeout_ms = 1500;
    kvb_engine_t *e, *good = make(1, 1);
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    opener_t slow = {.e = e, .name = dead}, fast = {.e = e, .name = kvb_engine_segment_name(good)};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, open_it, &slow);
    usleep(100000);
    pthread_create(&t2, NULL, open_it, &fast);
    pthread_join(t2, NULL);
    pthread_join(t1, NULL);
    cr_assert_eq(fast.rc, KVB_OK);
    cr_assert_lt(fast.ms, 1000, "an open waited %llu ms for another host's handshake",
                 (unsigned long long)fast.ms);
    cr_assert_eq(slow.rc, KVB_ERR_TIMEOUT);
    kvb_engine_destroy(e);
    kvb_engine_destroy(good);
    close(lfd);
}

/* A close while another thread reconnects a lost peer in place (same handle) waits for that to
 * end rather than refuse: refused, the caller thought the segment closed while it stayed open. */
Test(engine, close_during_a_reconnect_in_place_closes)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.protocol = "tcp";
    c.connect_timeout_ms = 1000;
    kvb_engine_t *e, *b = make_proto(1, 1, "tcp");
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    char name[64];
    snprintf(name, sizeof name, "%s", kvb_engine_segment_name(b));
    uint16_t port = kvb_engine_port(b);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(e, name, &s), KVB_OK);
    /* The peer goes; its port then answers the next handshake with silence. */
    kvb_engine_destroy(b);
    int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(bind(lfd, (struct sockaddr *)&sa, sizeof sa), 0, "port %u: %s", port,
                 strerror(errno));
    cr_assert_eq(listen(lfd, 8), 0);
    uint8_t buf[64];
    cr_assert_eq(kvb_register(e, buf, sizeof buf, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, buf, s, 4096, sizeof buf};
    kvb_batch_t *batch;
    int rc = kvb_batch_submit(e, &r, 1, NULL, &batch);
    if (rc == KVB_OK) {
        rc = kvb_batch_wait(batch, 3000);
        kvb_batch_free(batch);
    }
    cr_assert(KVB_IS_PEER_ERROR(rc), "the peer is gone: %s", kvb_status_name(rc));
    opener_t again = {.e = e, .name = name};
    pthread_t t;
    pthread_create(&t, NULL, open_it, &again);
    usleep(200000); /* inside the handshake with the silent port */
    cr_assert_eq(kvb_segment_close(e, s), KVB_OK);
    pthread_join(t, NULL);
    cr_assert_eq(again.rc, KVB_ERR_TIMEOUT);
    cr_assert_eq(kvb_segment_close(e, s), KVB_ERR_BAD_SEGMENT, "the segment stayed open");
    kvb_engine_destroy(e);
    close(lfd);
}

/* Peers get every attribute in one frame: set_attr refuses what would not fit. */
Test(engine, attributes_past_the_frame_limit_are_refused)
{
    kvb_engine_t *e = make(1, 1), *peer = make(1, 1);
    size_t big = 4u << 20;
    uint8_t *v = calloc(1, big);
    char key[16];
    int set = 0;
    for (int i = 0; i < 8; i++) {
        snprintf(key, sizeof key, "k%d", i);
        int rc = kvb_engine_set_attr(e, key, v, big);
        if (rc == KVB_OK) {
            set++;
            continue;
        }
        cr_assert_eq(rc, KVB_ERR_TOO_LARGE);
    }
    cr_assert_eq(set, 3, "three 4 MiB values fit in 16 MiB, a fourth does not");
    /* Replacing one with something as large still fits; the segment still opens. */
    cr_assert_eq(kvb_engine_set_attr(e, "k0", v, big), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(peer, kvb_engine_segment_name(e), &s), KVB_OK);
    size_t len;
    cr_assert_eq(kvb_segment_attr(peer, s, "k2", NULL, 0, &len), KVB_OK);
    cr_assert_eq(len, big);
    free(v);
    kvb_engine_destroy(peer);
    kvb_engine_destroy(e);
}

/* An initiator that cannot be dialled (it advertises an address nobody can reach) still gets
 * answers: the target replies on the connection the initiator opened. */
Test(engine, replies_need_no_connection_back)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.advertise_addr = "192.0.2.1"; /* TEST-NET-1: never reachable */
    kvb_engine_t *init, *target = make(1, 1);
    cr_assert_eq(kvb_engine_create(&c, &init), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(init, kvb_engine_segment_name(target), &s), KVB_OK);
    cr_assert_eq(kvb_notify_send(init, s, "question", 8, 2000), KVB_OK);
    kvb_notification_t *n = malloc(sizeof *n), *r = malloc(sizeof *r);
    cr_assert_eq(kvb_notify_recv(target, n, 2000), KVB_OK);
    cr_assert_str_eq(n->from, kvb_engine_segment_name(init));
    cr_assert_neq(n->reply_to, 0);
    cr_assert_eq(kvb_notify_reply(target, n, "answer", 6), KVB_OK);
    cr_assert_eq(kvb_notify_recv(init, r, 2000), KVB_OK);
    cr_assert_eq(r->len, 6);
    cr_assert_eq(memcmp(r->data, "answer", 6), 0);
    cr_assert_str_eq(r->from, kvb_engine_segment_name(target));
    cr_assert_eq(r->reply_to, 0, "a reply is not itself answerable");
    cr_assert_eq(kvb_notify_reply(init, r, "x", 1), KVB_ERR_INVALID_ARG);
    /* Once the connection is gone, a late reply says so instead of dialling. */
    cr_assert_eq(kvb_segment_close(init, s), KVB_OK);
    uint64_t t0 = kvb__now_ns();
    int rc;
    while ((rc = kvb_notify_reply(target, n, "late", 4)) == KVB_OK &&
           kvb__now_ns() - t0 < 2000000000ull)
        usleep(10000);
    cr_assert_eq(rc, KVB_ERR_PEER_LOST);
    free(n);
    free(r);
    kvb_engine_destroy(init);
    kvb_engine_destroy(target);
}
