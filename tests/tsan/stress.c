/* SPDX-License-Identifier: Apache-2.0 */
/* Failure accounting, patterns and the target engine process shared by the ThreadSanitizer stress
 * programs. The target is this same program re-executed with "--target ...": a child of a threaded
 * parent that only forks and execs starts clean, with none of the parent's locks held. */
#include "stress.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "patterns are built word-wise");

atomic_int stress_failures;

void stress_fail(const char *file, int line, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL [pid %d] %s:%d: %s\n", (int)getpid(), file, line, msg);
    atomic_fetch_add(&stress_failures, 1);
}

int stress_exit_status(const char *what)
{
    int n = atomic_load(&stress_failures);
    fprintf(stderr, "%s: %s (%d failure%s)\n", what, n ? "FAILED" : "passed", n, n == 1 ? "" : "s");
    return n ? 1 : 0;
}

uint64_t stress_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void stress_sleep_us(uint64_t us)
{
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000u),
                          .tv_nsec = (long)(us % 1000000u) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

int stress_wait(kvb_batch_t *b, int mode, uint64_t poll_us)
{
    int rc;
    switch (mode) {
    case 0:
        return kvb_batch_wait(b, -1);
    case 1:
        while ((rc = kvb_batch_wait(b, 1)) == KVB_ERR_AGAIN)
            ;
        return rc;
    default:
        for (;;) {
            bool pending = false;
            for (size_t i = 0; i < kvb_batch_size(b) && !pending; i++) {
                kvb_req_status_t st;
                CHECK_RC(kvb_batch_status(b, i, &st), KVB_OK);
                pending = st.state == KVB_REQ_PENDING;
            }
            if (!pending && (rc = kvb_batch_wait(b, 0)) != KVB_ERR_AGAIN)
                return rc;
            stress_sleep_us(poll_us);
        }
    }
}

uint64_t stress_rand(uint64_t *s)
{
    uint64_t x = *s ? *s : 0x2545F4914F6CDD1Dull;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

uint64_t stress_rand_below(uint64_t *s, uint64_t n)
{
    return n ? stress_rand(s) % n : 0;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void stress_pattern_fill(uint8_t *buf, uint64_t pos, size_t len, uint64_t seed)
{
    size_t i = 0;
    for (; i < len && (pos + i) % 8; i++)
        buf[i] = (uint8_t)(mix(seed + (pos + i) / 8) >> (8 * ((pos + i) % 8)));
    for (; i + 8 <= len; i += 8) {
        uint64_t w = mix(seed + (pos + i) / 8);
        memcpy(buf + i, &w, 8);
    }
    for (; i < len; i++)
        buf[i] = (uint8_t)(mix(seed + (pos + i) / 8) >> (8 * ((pos + i) % 8)));
}

void stress_random_fill(uint8_t *buf, size_t len, uint64_t *state)
{
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w = stress_rand(state);
        memcpy(buf + i, &w, 8);
    }
    for (; i < len; i++)
        buf[i] = (uint8_t)stress_rand(state);
}

int64_t stress_first_diff(const uint8_t *a, const uint8_t *b, size_t len)
{
    if (memcmp(a, b, len) == 0)
        return -1;
    for (size_t i = 0; i < len; i++)
        if (a[i] != b[i])
            return (int64_t)i;
    return -1;
}

void *stress_map(size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void stress_unmap(void *p, size_t len)
{
    if (p)
        munmap(p, len);
}

void stress_config(kvb_config_t *cfg, const char *protocol)
{
    kvb_config_init(cfg);
    cfg->bind_addr = "127.0.0.1";
    cfg->port = 0;
    cfg->protocol = protocol;
}

/* ---- the target (runs in the child) ------------------------------------------------------- */

#define CHURN_LEN (64u << 10)

typedef struct {
    kvb_engine_t *e;
    atomic_bool stop;
} churn_t;

/* Registers, publishes, unregisters: the region list and attributes peers fetch keep changing. */
static void *churn_main(void *arg)
{
    churn_t *c = arg;
    for (unsigned i = 0; !atomic_load(&c->stop); i++) {
        void *buf = malloc(CHURN_LEN);
        CHECK(buf != NULL, "malloc");
        if (!buf)
            break;
        CHECK_RC(kvb_register(c->e, buf, CHURN_LEN, "cpu:0", KVB_ACCESS_RW), KVB_OK);
        char val[32];
        int n = snprintf(val, sizeof val, "round %u", i);
        CHECK_RC(kvb_engine_set_attr(c->e, "churn", val, (size_t)n), KVB_OK);
        stress_sleep_us(2000);
        CHECK_RC(kvb_unregister(c->e, buf), KVB_OK);
        free(buf);
        stress_sleep_us(2000);
    }
    return NULL;
}

typedef struct {
    char name[KVB_NAME_MAX + 1];
    kvb_segment_t seg;
} reply_seg_t;

/* Sends `msg` back to `to` on a segment kept open for the target's life (a reconnect per reply
 * would turn this into a connection churn test). */
static void reply(kvb_engine_t *e, reply_seg_t *segs, size_t cap, const char *to, const char *msg)
{
    size_t i = 0;
    while (i < cap && segs[i].seg && strcmp(segs[i].name, to))
        i++;
    if (i == cap) {
        stress_fail(__FILE__, __LINE__, "target: too many senders");
        return;
    }
    if (!segs[i].seg) {
        int rc = kvb_segment_open(e, to, &segs[i].seg);
        if (rc) {
            stress_fail(__FILE__, __LINE__, "target: open %s: %s", to, kvb_status_name(rc));
            return;
        }
        snprintf(segs[i].name, sizeof segs[i].name, "%s", to);
    }
    int rc = kvb_notify_send(e, segs[i].seg, msg, strlen(msg), 10000);
    if (rc == KVB_ERR_PEER_LOST || rc == KVB_ERR_BAD_SEGMENT) {
        /* The sender's engine went away (a lifecycle test destroyed it): forget it. */
        kvb_segment_close(e, segs[i].seg);
        segs[i].seg = 0;
        return;
    }
    CHECK(rc == KVB_OK, "target: reply '%s' to %s: %s", msg, to, kvb_status_name(rc));
}

static void serve(kvb_engine_t *e, int life_fd)
{
    reply_seg_t segs[16] = {0};
    kvb_notification_t *n = malloc(sizeof *n);
    unsigned long long batches = 0;
    CHECK(n != NULL, "malloc");
    while (n) {
        struct pollfd p = {.fd = life_fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0)
            break;
        int rc = kvb_notify_recv(e, n, 50);
        if (rc == KVB_ERR_TIMEOUT)
            continue;
        CHECK(rc == KVB_OK, "target: recv: %s", kvb_status_name(rc));
        if (rc)
            break;
        char msg[128], out[128];
        size_t l = n->len < sizeof msg - 1 ? n->len : sizeof msg - 1;
        memcpy(msg, n->data, l);
        msg[l] = '\0';
        unsigned long long k;
        if (sscanf(msg, "ping %llu", &k) == 1) {
            int len = snprintf(out, sizeof out, "pong %llu", k);
            if (k % 2) { /* on the sender's own connection */
                rc = kvb_notify_reply(e, n, out, (size_t)len);
                CHECK(rc == KVB_OK || rc == KVB_ERR_PEER_LOST, "target: notify_reply: %s",
                      kvb_status_name(rc));
            } else { /* on one of ours */
                reply(e, segs, 16, n->from, out);
            }
        } else if (!strcmp(msg, "batch")) {
            batches++;
        } else if (!strcmp(msg, "count")) {
            snprintf(out, sizeof out, "count %llu", batches);
            reply(e, segs, 16, n->from, out);
        } else {
            stress_fail(__FILE__, __LINE__, "target: unexpected notification '%s'", msg);
        }
    }
    for (size_t i = 0; i < 16; i++)
        if (segs[i].seg)
            CHECK_RC(kvb_segment_close(e, segs[i].seg), KVB_OK);
    free(n);
}

static int target_run(const char *protocol, uint64_t seed, bool churn, int report_fd, int life_fd)
{
    kvb_config_t cfg;
    stress_config(&cfg, protocol);
    cfg.timeout_ms = 10000;
    /* One progress thread: when a READ answer leaves on one connection (sendmsg reads the region)
     * and the initiator, having received it, WRITEs the same bytes on another, the order between
     * the two runs through the socket and the other process - which ThreadSanitizer cannot see, so
     * with two threads here it reports a race that cannot happen (seen in CI). The initiator side,
     * where every such order is visible (connection and batch locks), keeps two threads. */
    cfg.progress_threads = 1;
    cfg.copy_threads = 2;
    kvb_engine_t *e;
    int rc = kvb_engine_create(&cfg, &e);
    if (rc) {
        fprintf(stderr, "target: engine: %s\n", kvb_status_name(rc));
        return 2;
    }
    uint8_t *shm = NULL, *plain = stress_map(STRESS_REGION_LEN), *ro = stress_map(STRESS_RO_LEN);
    if (kvb_alloc(e, STRESS_REGION_LEN, 0, (void **)&shm) || !plain || !ro) {
        fprintf(stderr, "target: out of memory\n");
        return 2;
    }
    stress_pattern_fill(shm, 0, STRESS_REGION_LEN, seed);
    stress_pattern_fill(plain, 0, STRESS_REGION_LEN, seed + 1);
    stress_pattern_fill(ro, 0, STRESS_RO_LEN, seed + 2);
    if (kvb_register(e, shm, STRESS_REGION_LEN, "cpu:0", KVB_ACCESS_RW) ||
        kvb_register(e, plain, STRESS_REGION_LEN, "cpu:0", KVB_ACCESS_RW) ||
        kvb_register(e, ro, STRESS_RO_LEN, "cpu:0", KVB_ACCESS_READ)) {
        fprintf(stderr, "target: register failed\n");
        return 2;
    }
    churn_t c = {.e = e};
    pthread_t churner;
    if (churn && pthread_create(&churner, NULL, churn_main, &c) != 0)
        return 2;
    dprintf(report_fd, "%s %llu %llu %llu\n", kvb_engine_segment_name(e),
            (unsigned long long)(uintptr_t)shm, (unsigned long long)(uintptr_t)plain,
            (unsigned long long)(uintptr_t)ro);
    close(report_fd);
    serve(e, life_fd);
    if (churn) {
        atomic_store(&c.stop, true);
        pthread_join(churner, NULL);
    }
    CHECK_RC(kvb_unregister(e, shm), KVB_OK);
    CHECK_RC(kvb_unregister(e, plain), KVB_OK);
    CHECK_RC(kvb_unregister(e, ro), KVB_OK);
    CHECK_RC(kvb_free(e, shm), KVB_OK);
    kvb_engine_destroy(e);
    stress_unmap(plain, STRESS_REGION_LEN);
    stress_unmap(ro, STRESS_RO_LEN);
    return atomic_load(&stress_failures) ? 1 : 0;
}

int stress_target_main(int argc, char **argv)
{
    if (argc != 7 || strcmp(argv[1], "--target"))
        return -1;
    int report_fd = atoi(argv[5]), life_fd = atoi(argv[6]);
    fcntl(report_fd, F_SETFD, FD_CLOEXEC);
    fcntl(life_fd, F_SETFD, FD_CLOEXEC);
    return target_run(argv[2], strtoull(argv[3], NULL, 10), atoi(argv[4]) != 0, report_fd, life_fd);
}

/* ---- the target (seen from the parent) ---------------------------------------------------- */

/* Reads the target's one-line report, waiting at most 60 s (a TSan build starts slowly). */
static int read_report(int fd, char *line, size_t cap)
{
    size_t got = 0;
    uint64_t deadline = stress_now_ms() + 60000;
    while (got + 1 < cap) {
        uint64_t now = stress_now_ms();
        if (now >= deadline)
            return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(deadline - now));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t n = read(fd, line + got, cap - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        got += (size_t)n;
        line[got] = '\0';
        if (strchr(line, '\n'))
            return 0;
    }
    return -1;
}

int stress_target_start(stress_target_t *t, const char *protocol, uint64_t seed, bool churn)
{
    int rep[2], life[2];
    memset(t, 0, sizeof *t);
    t->life_fd = -1;
    t->seed = seed;
    if (pipe2(rep, O_CLOEXEC))
        return -1;
    if (pipe2(life, O_CLOEXEC)) {
        close(rep[0]);
        close(rep[1]);
        return -1;
    }
    /* Everything the child needs is prepared before fork: after it, only async-signal-safe calls
     * until exec. */
    char a_seed[24], a_churn[4], a_rep[16], a_life[16];
    snprintf(a_seed, sizeof a_seed, "%llu", (unsigned long long)seed);
    snprintf(a_churn, sizeof a_churn, "%d", churn ? 1 : 0);
    snprintf(a_rep, sizeof a_rep, "%d", rep[1]);
    snprintf(a_life, sizeof a_life, "%d", life[0]);
    char *args[] = {
        "kvb-stress-target", "--target", (char *)protocol, a_seed, a_churn, a_rep, a_life, NULL};
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* Die with the parent (the thread that forked, which must be its main thread). */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (fcntl(rep[1], F_SETFD, 0) || fcntl(life[0], F_SETFD, 0))
            _exit(126);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(rep[1]);
    close(life[0]);
    t->pid = pid;
    t->life_fd = life[1];
    char line[KVB_NAME_MAX + 128];
    int ok = read_report(rep[0], line, sizeof line);
    close(rep[0]);
    unsigned long long shm, plain, ro;
    char fmt[32];
    snprintf(fmt, sizeof fmt, "%%%ds %%llu %%llu %%llu", KVB_NAME_MAX);
    if (ok != 0 || sscanf(line, fmt, t->name, &shm, &plain, &ro) != 4) {
        fprintf(stderr, "target did not start\n");
        stress_target_kill(t);
        return -1;
    }
    t->shm_addr = shm;
    t->plain_addr = plain;
    t->ro_addr = ro;
    return 0;
}

int stress_target_stop(stress_target_t *t)
{
    if (t->pid <= 0)
        return -1;
    close(t->life_fd);
    t->life_fd = -1;
    uint64_t deadline = stress_now_ms() + 30000;
    int status;
    for (;;) {
        pid_t r = waitpid(t->pid, &status, WNOHANG);
        if (r == t->pid)
            break;
        if (r < 0 && errno != EINTR)
            return -1;
        if (stress_now_ms() >= deadline) {
            fprintf(stderr, "target %d did not exit: killing it\n", (int)t->pid);
            kill(t->pid, SIGKILL);
            waitpid(t->pid, &status, 0);
            t->pid = 0;
            return -1;
        }
        stress_sleep_us(10000);
    }
    t->pid = 0;
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

void stress_target_kill(stress_target_t *t)
{
    if (t->pid > 0) {
        kill(t->pid, SIGKILL);
        while (waitpid(t->pid, NULL, 0) < 0 && errno == EINTR)
            ;
    }
    t->pid = 0;
    if (t->life_fd >= 0)
        close(t->life_fd);
    t->life_fd = -1;
}
