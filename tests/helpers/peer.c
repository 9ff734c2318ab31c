/* SPDX-License-Identifier: Apache-2.0 */
/* A peer engine in a child process for integration tests, plus the shared byte pattern. The child
 * re-executes the test binary (a constructor below takes over before Criterion's main), so that it
 * starts clean rather than with a copy of the parent's threads' locks: the parent's engine and
 * store-client threads may hold any lock at the moment of fork. */
#include "helpers/peer.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint8_t pattern_byte(uint64_t pos, uint64_t seed)
{
    return (uint8_t)(mix(seed + pos / 8) >> (8 * (pos % 8)));
}

void test_pattern_fill(uint8_t *buf, uint64_t off, uint64_t len, uint64_t seed)
{
    for (uint64_t i = 0; i < len; i++)
        buf[i] = pattern_byte(off + i, seed);
}

int64_t test_pattern_check(const uint8_t *buf, uint64_t off, uint64_t len, uint64_t seed)
{
    for (uint64_t i = 0; i < len; i++)
        if (buf[i] != pattern_byte(off + i, seed))
            return (int64_t)i;
    return -1;
}

uint64_t test_rand(uint64_t *s)
{
    uint64_t x = *s ? *s : 0x2545F4914F6CDD1Dull;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static void reply(kvb_engine_t *e, const char *to, const char *msg)
{
    kvb_segment_t seg;
    if (kvb_segment_open(e, to, &seg) == KVB_OK) {
        kvb_notify_send(e, seg, msg, strlen(msg), 5000);
        kvb_segment_close(e, seg);
    }
}

static void serve(kvb_engine_t *e, uint8_t *rw, int life_fd)
{
    kvb_notification_t *n = malloc(sizeof *n);
    for (;;) {
        struct pollfd p = {.fd = life_fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0)
            break;
        if (!n || kvb_notify_recv(e, n, 50) != KVB_OK)
            continue;
        char msg[160], out[64];
        size_t l = n->len < sizeof msg - 1 ? n->len : sizeof msg - 1;
        memcpy(msg, n->data, l);
        msg[l] = '\0';
        unsigned long long seed, off, len;
        if (!strcmp(msg, "ping")) {
            reply(e, n->from, "pong");
        } else if (sscanf(msg, "verify %llu %llu %llu", &seed, &off, &len) == 3) {
            int64_t bad =
                off + len <= TEST_PEER_RW_LEN ? test_pattern_check(rw + off, off, len, seed) : 0;
            if (bad < 0)
                snprintf(out, sizeof out, "ok");
            else
                snprintf(out, sizeof out, "bad %lld", (long long)(off + (uint64_t)bad));
            reply(e, n->from, out);
        }
    }
    free(n);
}

static int child_main(uint16_t port, uint64_t seed, const test_peer_opts_t *o, int report_fd,
                      int life_fd)
{
    const char *protocol = o->protocol ? o->protocol : "auto";
    bool nobody = !strcmp(protocol, "shm-nobody");
    if (nobody && (setgid(65534) != 0 || setuid(65534) != 0))
        return 1;
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* after setuid, which clears it */
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.port = port;
    cfg.protocol = nobody ? "shm" : protocol;
    cfg.timeout_ms = 5000;
    cfg.metadata = o->metadata;
    cfg.segment_name = o->name;
    if (o->cluster)
        cfg.cluster = o->cluster;
    if (o->ttl_ms)
        cfg.metadata_ttl_ms = o->ttl_ms;
    kvb_engine_t *e;
    if (kvb_engine_create(&cfg, &e) != KVB_OK)
        return 1;
    uint8_t *rw =
        mmap(NULL, TEST_PEER_RW_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *ro =
        mmap(NULL, TEST_PEER_RO_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (rw == MAP_FAILED || ro == MAP_FAILED)
        return 1;
    test_pattern_fill(rw, 0, TEST_PEER_RW_LEN, seed);
    test_pattern_fill(ro, 0, TEST_PEER_RO_LEN, seed + 1);
    if (kvb_register(e, rw, TEST_PEER_RW_LEN, "cpu:0", KVB_ACCESS_RW) ||
        kvb_register(e, ro, TEST_PEER_RO_LEN, "cpu:0", KVB_ACCESS_READ))
        return 1;
    dprintf(report_fd, "%s %u %llu %llu\n", kvb_engine_segment_name(e), kvb_engine_port(e),
            (unsigned long long)(uintptr_t)rw, (unsigned long long)(uintptr_t)ro);
    close(report_fd);
    serve(e, rw, life_fd);
    kvb_engine_destroy(e);
    return 0;
}

#define PEER_ENV "KVB_TEST_PEER"

/* In a re-executed child: runs the peer and never returns to main. */
__attribute__((constructor)) static void peer_exec_entry(void)
{
    char *env = getenv(PEER_ENV);
    if (!env || !(env = strdup(env)))
        return;
    char *f[9], *rest = env, *tok;
    size_t n = 0;
    while (n < 9 && (tok = strsep(&rest, "\x1f")))
        f[n++] = tok;
    if (n != 9 || rest)
        _exit(125);
    test_peer_opts_t o = {.protocol = *f[2] ? f[2] : NULL,
                          .metadata = *f[3] ? f[3] : NULL,
                          .name = *f[4] ? f[4] : NULL,
                          .cluster = *f[5] ? f[5] : NULL,
                          .ttl_ms = (uint32_t)strtoul(f[6], NULL, 10)};
    int report_fd = atoi(f[7]), life_fd = atoi(f[8]);
    fcntl(report_fd, F_SETFD, FD_CLOEXEC);
    fcntl(life_fd, F_SETFD, FD_CLOEXEC);
    uint16_t port = (uint16_t)strtoul(f[0], NULL, 10);
    uint64_t seed = strtoull(f[1], NULL, 10);
    unsetenv(PEER_ENV);
    _exit(child_main(port, seed, &o, report_fd, life_fd));
}

int test_peer_start(test_peer_t *p, uint16_t port, uint64_t seed, const char *protocol)
{
    test_peer_opts_t o = {.protocol = protocol};
    return test_peer_start_opts(p, port, seed, &o);
}

#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif

/* Makes the next exec run in a new time namespace whose CLOCK_MONOTONIC is `s` seconds off ours
 * (the caller itself stays in its own until it execs). */
static int time_offset_for_exec(int64_t s)
{
    if (unshare(CLONE_NEWTIME))
        return -1;
    char line[64];
    int n = snprintf(line, sizeof line, "monotonic %lld 0\n", (long long)s);
    int fd = open("/proc/self/timens_offsets", O_WRONLY | O_CLOEXEC);
    bool ok = fd >= 0 && write(fd, line, (size_t)n) == n;
    if (fd >= 0)
        close(fd);
    return ok ? 0 : -1;
}

bool test_time_namespaces(void)
{
    pid_t pid = fork();
    if (pid == 0)
        _exit(time_offset_for_exec(1) ? 1 : 0);
    int st;
    return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

int test_peer_start_opts(test_peer_t *p, uint16_t port, uint64_t seed, const test_peer_opts_t *o)
{
    int rep[2], life[2];
    memset(p, 0, sizeof *p);
    if (pipe2(rep, O_CLOEXEC) || pipe2(life, O_CLOEXEC))
        return -1;
    fflush(NULL);
    p->pid = fork();
    if (p->pid < 0)
        return -1;
    if (p->pid == 0) {
        close(rep[0]);
        close(life[1]);
        /* Hand the settings and the two pipe ends over through the environment. */
        char env[2048];
        int n = snprintf(env, sizeof env, "%u\x1f%llu\x1f%s\x1f%s\x1f%s\x1f%s\x1f%u\x1f%d\x1f%d",
                         port, (unsigned long long)seed, o->protocol ? o->protocol : "",
                         o->metadata ? o->metadata : "", o->name ? o->name : "",
                         o->cluster ? o->cluster : "", o->ttl_ms, rep[1], life[0]);
        if (n <= 0 || (size_t)n >= sizeof env || fcntl(rep[1], F_SETFD, 0) ||
            fcntl(life[0], F_SETFD, 0) || setenv(PEER_ENV, env, 1))
            _exit(126);
        if (o->monotonic_offset_s && time_offset_for_exec(o->monotonic_offset_s))
            _exit(125);
        char *argv[] = {"kvb-test-peer", NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(rep[1]);
    close(life[0]);
    p->life_fd = life[1];
    char line[512] = "";
    size_t got = 0;
    ssize_t n;
    while (got < sizeof line - 1 && (n = read(rep[0], line + got, sizeof line - 1 - got)) > 0)
        got += (size_t)n;
    close(rep[0]);
    unsigned long long rw, ro;
    unsigned lport;
    if (sscanf(line, "%255s %u %llu %llu", p->name, &lport, &rw, &ro) != 4 || lport > 65535) {
        test_peer_signal(p, SIGKILL);
        return -1;
    }
    p->port = (uint16_t)lport;
    p->rw_addr = rw;
    p->ro_addr = ro;
    return 0;
}

uint16_t test_peer_port(const test_peer_t *p)
{
    return p->port;
}

int test_child_signal(pid_t pid, int sig)
{
    int st;
    if (kill(pid, sig) != 0)
        return -1;
    if (sig == SIGSTOP)
        return waitpid(pid, &st, WUNTRACED) == pid && WIFSTOPPED(st) ? 0 : -1;
    if (sig == SIGCONT)
        return waitpid(pid, &st, WCONTINUED) == pid && WIFCONTINUED(st) ? 0 : -1;
    return 0;
}

void test_peer_signal(test_peer_t *p, int sig)
{
    if (p->pid <= 0)
        return;
    test_child_signal(p->pid, sig);
    if (sig == SIGKILL) {
        waitpid(p->pid, NULL, 0);
        p->pid = 0;
        if (p->life_fd > 0)
            close(p->life_fd);
        p->life_fd = -1;
    }
}

void test_peer_stop(test_peer_t *p)
{
    if (p->pid <= 0)
        return;
    kill(p->pid, SIGCONT);
    close(p->life_fd);
    p->life_fd = -1;
    for (int i = 0; i < 300; i++) {
        if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
            p->pid = 0;
            return;
        }
        usleep(10000);
    }
    test_peer_signal(p, SIGKILL);
}
