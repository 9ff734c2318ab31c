/* SPDX-License-Identifier: Apache-2.0 */
/* Runs a real metadata store (redis-server, etcd, `kvbridge metadata-server`) for tests: fork/exec
 * on free loopback ports, output in a log in a private temp dir, ready once it answers a request,
 * and SIGKILL/restart on the same ports to play an outage. */
#include "helpers/store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define READY_MS      10000 /* from spawn to the first good answer */
#define START_TRIES   3     /* fresh ports when the chosen ones were taken */
#define STOP_GRACE_MS 3000  /* SIGTERM to SIGKILL */
#define PROBE_IO_MS   1000  /* one readiness request; etcd may hold one until it has a leader */
#define LOG_NAME      "server.log"
#define LOG_TAIL      3072 /* bytes of log shown when a server fails */
#define MAX_ARGS      32

typedef enum { UP, DIED, BUSY, LATE, NOSPAWN } launch_t;

typedef struct {
    const char *argv[MAX_ARGS];
    int argc;
    char buf[4096]; /* backing store of the formatted arguments */
    size_t used;
    bool overflow;
} cmd_t;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

const char *test_store_kind_name(test_store_kind_t k)
{
    switch (k) {
    case TEST_STORE_REDIS:
        return "redis";
    case TEST_STORE_ETCD:
        return "etcd";
    case TEST_STORE_HTTP:
        return "http";
    }
    return "?";
}

uint16_t test_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    uint16_t port = 0;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &alen) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

int test_silent_listener(uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 16) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &alen) != 0) {
        close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

/* ---- dir and log ---- */

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    if (remove(path) != 0 && errno != ENOENT)
        fprintf(stderr, "store: remove %s: %s\n", path, strerror(errno));
    return 0;
}

static void rm_rf(const char *dir)
{
    /* FTW_DEPTH: a dir's entries before the dir; FTW_PHYS: never follow a link out of it. */
    if (nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT)
        fprintf(stderr, "store: remove %s: %s\n", dir, strerror(errno));
}

/* Every store this process started and has not stopped, so that a test that fails between start
 * and stop (a Criterion assertion leaves the test body by longjmp, and the worker then exits
 * normally) still leaves no server and no dir behind: an atexit handler stops what is left.
 * Entries are copies, keyed by dir: the caller's struct may have lived on a stack that is gone.
 * Each entry names the process that made it, since a forked child inherits the table and the
 * handler but must not tear down its parent's stores. */
#define MAX_LIVE 32

static struct {
    pid_t owner, pid;
    char dir[sizeof(((test_store_t *)0)->dir)];
} live[MAX_LIVE];
static bool live_hooked;

static void live_sweep(void)
{
    for (int i = 0; i < MAX_LIVE; i++) {
        if (live[i].owner != getpid() || !live[i].dir[0])
            continue;
        fprintf(stderr, "store: at exit, removing %s (pid %d), which the test did not stop\n",
                live[i].dir, (int)live[i].pid);
        if (live[i].pid > 0 && kill(live[i].pid, SIGKILL) == 0)
            waitpid(live[i].pid, NULL, 0);
        rm_rf(live[i].dir);
        live[i].dir[0] = '\0';
    }
}

/* This process's entry for `dir`, or with dir NULL a free one (entries a parent made count as
 * free in its forked child); -1 if none. */
static int live_find(const char *dir)
{
    for (int i = 0; i < MAX_LIVE; i++) {
        bool mine = live[i].owner == getpid() && live[i].dir[0];
        if (dir ? mine && !strcmp(live[i].dir, dir) : !mine)
            return i;
    }
    return -1;
}

/* Sets s->pid and records it with s->dir for the sweep at exit; keep=false forgets the dir. */
static void track(test_store_t *s, pid_t pid, bool keep)
{
    s->pid = pid;
    int i = live_find(s->dir);
    if (!keep) {
        if (i >= 0)
            live[i].dir[0] = '\0';
        return;
    }
    if (i < 0 && (i = live_find(NULL)) < 0) { /* only the safety net is lost */
        fprintf(stderr, "store: more than %d stores at once; %s is not swept at exit\n", MAX_LIVE,
                s->dir);
        return;
    }
    if (!live_hooked && atexit(live_sweep) != 0)
        fprintf(stderr, "store: atexit failed; what a failed test leaves behind stays\n");
    live_hooked = true;
    live[i].owner = getpid();
    live[i].pid = pid;
    snprintf(live[i].dir, sizeof live[i].dir, "%s", s->dir);
}

static int make_dir(test_store_t *s)
{
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp)
        tmp = "/tmp";
    int n = snprintf(s->dir, sizeof s->dir, "%s/kvbridge-store-XXXXXX", tmp);
    if (n < 0 || (size_t)n >= sizeof s->dir || !mkdtemp(s->dir)) {
        fprintf(stderr, "store: cannot make a temp dir under %s: %s\n", tmp,
                n >= 0 && (size_t)n < sizeof s->dir ? strerror(errno) : "path too long");
        s->dir[0] = '\0';
        return -1;
    }
    track(s, 0, true);
    return 0;
}

static void log_path(const test_store_t *s, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/" LOG_NAME, s->dir);
}

/* Reads the log from `from` (where this launch began), at most the last cap - 1 bytes. */
static size_t log_read(const test_store_t *s, off_t from, char *buf, size_t cap)
{
    char path[300];
    log_path(s, path, sizeof path);
    size_t n = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0) {
        off_t start = st.st_size - from > (off_t)cap - 1 ? st.st_size - ((off_t)cap - 1) : from;
        ssize_t k;
        while (n < cap - 1 && (k = pread(fd, buf + n, cap - 1 - n, start + (off_t)n)) > 0)
            n += (size_t)k;
    }
    if (fd >= 0)
        close(fd);
    buf[n] = '\0';
    return n;
}

/* The servers say it in their own words, but all through strerror(EADDRINUSE) (etcd, a Go
 * program, in lower case). */
static bool log_says_busy(const test_store_t *s, off_t from)
{
    char buf[LOG_TAIL];
    log_read(s, from, buf, sizeof buf);
    return strcasestr(buf, "address already in use") != NULL;
}

static void report(const test_store_t *s, off_t from, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "store: %s on 127.0.0.1:%u: ", test_store_kind_name(s->kind), s->port);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    char buf[LOG_TAIL];
    size_t n = log_read(s, from, buf, sizeof buf);
    const char *tail = buf;
    if (n == sizeof buf - 1 && strchr(buf, '\n')) /* cut: start at a whole line */
        tail = strchr(buf, '\n') + 1;
    fprintf(stderr, "\n---- %s/" LOG_NAME " ----\n%s%s---- end of log ----\n", s->dir, tail,
            n && buf[n - 1] != '\n' ? "\n" : "");
}

/* ---- process ---- */

static void cmd_add(cmd_t *c, const char *fmt, ...)
{
    va_list ap;
    size_t room = sizeof c->buf - c->used;
    va_start(ap, fmt);
    int n = vsnprintf(c->buf + c->used, room, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= room || c->argc >= MAX_ARGS - 1) {
        c->overflow = true;
        return;
    }
    c->argv[c->argc++] = c->buf + c->used;
    c->argv[c->argc] = NULL;
    c->used += (size_t)n + 1;
}

static int build_cmd(const test_store_t *s, cmd_t *c)
{
    memset(c, 0, sizeof *c);
    unsigned p = s->port, pp = s->peer_port;
    switch (s->kind) {
    case TEST_STORE_REDIS:
        /* No RDB, no AOF: a restart loses everything, as a cache store's outage does. */
        cmd_add(c, "redis-server");
        cmd_add(c, "--port");
        cmd_add(c, "%u", p);
        cmd_add(c, "--bind");
        cmd_add(c, "127.0.0.1");
        cmd_add(c, "--save");
        cmd_add(c, "");
        cmd_add(c, "--appendonly");
        cmd_add(c, "no");
        cmd_add(c, "--dir");
        cmd_add(c, "%s", s->dir);
        cmd_add(c, "--daemonize");
        cmd_add(c, "no");
        cmd_add(c, "--protected-mode");
        cmd_add(c, "no");
        cmd_add(c, "--logfile"); /* "": stdout, which is our log */
        cmd_add(c, "");
        break;
    case TEST_STORE_ETCD:
        /* A one-member cluster whose data dir outlives a restart, keeping keys and leases. */
        cmd_add(c, "etcd");
        cmd_add(c, "--name");
        cmd_add(c, "kvbt");
        cmd_add(c, "--data-dir");
        cmd_add(c, "%s/etcd", s->dir);
        cmd_add(c, "--listen-client-urls");
        cmd_add(c, "http://127.0.0.1:%u", p);
        cmd_add(c, "--advertise-client-urls");
        cmd_add(c, "http://127.0.0.1:%u", p);
        cmd_add(c, "--listen-peer-urls");
        cmd_add(c, "http://127.0.0.1:%u", pp);
        cmd_add(c, "--initial-advertise-peer-urls");
        cmd_add(c, "http://127.0.0.1:%u", pp);
        cmd_add(c, "--initial-cluster");
        cmd_add(c, "kvbt=http://127.0.0.1:%u", pp);
        cmd_add(c, "--logger"); /* 3.4 defaults to capnslog, which ignores --log-level */
        cmd_add(c, "zap");
        cmd_add(c, "--log-level");
        cmd_add(c, "error");
        break;
    case TEST_STORE_HTTP: {
        const char *bin = getenv("KVB_BIN");
        if (!bin || !*bin) {
            fprintf(stderr, "store: KVB_BIN is not set (the kvbridge command, set by CTest)\n");
            return -1;
        }
        cmd_add(c, "%s", bin);
        cmd_add(c, "metadata-server");
        cmd_add(c, "--port");
        cmd_add(c, "%u", p);
        cmd_add(c, "--bind");
        cmd_add(c, "127.0.0.1");
        break;
    }
    default:
        fprintf(stderr, "store: unknown kind %d\n", (int)s->kind);
        return -1;
    }
    if (c->overflow) {
        fprintf(stderr, "store: command line too long (dir %s)\n", s->dir);
        return -1;
    }
    return 0;
}

static __attribute__((noreturn)) void child_exec(const cmd_t *c, int logfd, int nullfd,
                                                 pid_t parent)
{
    /* Die with the test: one that crashes or that Criterion kills for its timeout must not leave
     * a server holding a port. The getppid check closes the race with a parent that died before
     * the prctl. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(126);
    if (dup2(nullfd, 0) < 0 || dup2(logfd, 1) < 0 || dup2(logfd, 2) < 0)
        _exit(126);
    /* Whatever the test holds open without O_CLOEXEC (Criterion's pipes to its runner, sockets)
     * must not live on in the server. */
    close_range(3, ~0u, 0);
    /* Ignored signals and the mask survive exec; the server must see SIGTERM and SIGPIPE as it
     * would when started from a shell. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    const int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGPIPE, SIGCHLD};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        signal(sigs[i], SIG_DFL);
    execvp(c->argv[0], (char *const *)c->argv);
    dprintf(2, "store: exec %s: %s\n", c->argv[0], strerror(errno));
    _exit(127);
}

/* Forks and execs the server, appending its output to the log; *from is where it begins. */
static int spawn(test_store_t *s, off_t *from)
{
    cmd_t c;
    char path[300];
    if (build_cmd(s, &c) != 0)
        return -1;
    log_path(s, path, sizeof path);
    int logfd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (logfd < 0) {
        fprintf(stderr, "store: open %s: %s\n", path, strerror(errno));
        return -1;
    }
    int nullfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (nullfd < 0 || fstat(logfd, &st) != 0) {
        fprintf(stderr, "store: open /dev/null or stat %s: %s\n", path, strerror(errno));
        close(logfd);
        if (nullfd >= 0)
            close(nullfd);
        return -1;
    }
    *from = st.st_size;
    pid_t parent = getpid();
    fflush(NULL); /* or the child's copy of stdio buffers could be written twice */
    pid_t pid = fork();
    if (pid == 0)
        child_exec(&c, logfd, nullfd, parent);
    int err = errno;
    close(logfd);
    close(nullfd);
    if (pid < 0) {
        fprintf(stderr, "store: fork: %s\n", strerror(err));
        return -1;
    }
    track(s, pid, true);
    return 0;
}

/* Waits up to `ms` (-1: for ever) for the child to exit; true once it has been reaped (or was,
 * by someone else). */
static bool reap(pid_t pid, int ms, int *status)
{
    int64_t end = now_ms() + ms;
    for (;;) {
        pid_t w = waitpid(pid, status, ms < 0 ? 0 : WNOHANG);
        if (w == pid || (w < 0 && errno == ECHILD))
            return true;
        if (w < 0 && errno != EINTR)
            return false;
        if (ms >= 0 && now_ms() >= end)
            return false;
        if (ms >= 0)
            sleep_ms(10);
    }
}

static void kill_hard(test_store_t *s)
{
    if (s->pid <= 0)
        return;
    if (kill(s->pid, SIGKILL) != 0 && errno != ESRCH)
        fprintf(stderr, "store: kill %d: %s\n", (int)s->pid, strerror(errno));
    reap(s->pid, -1, NULL);
    track(s, 0, true);
}

/* ---- readiness ---- */

/* A blocking TCP connection to 127.0.0.1:port whose connect, sends and receives each give up
 * after `ms` (Linux applies SO_SNDTIMEO to connect); -1 with errno set. */
static int dial(uint16_t port, int ms)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
        connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/* Sends `req` and reads the reply's first line into buf; true if that worked. */
static bool ask(uint16_t port, int ms, const char *req, char *buf, size_t cap)
{
    int fd = dial(port, ms);
    if (fd < 0)
        return false;
    size_t len = strlen(req), off = 0, got = 0;
    ssize_t k;
    while (off < len && (k = send(fd, req + off, len - off, MSG_NOSIGNAL)) > 0)
        off += (size_t)k;
    buf[0] = '\0';
    while (off == len && got < cap - 1 && !memchr(buf, '\n', got) &&
           (k = recv(fd, buf + got, cap - 1 - got, 0)) > 0) {
        got += (size_t)k;
        buf[got] = '\0';
    }
    close(fd);
    return off == len && got > 0;
}

static bool http_ok(const char *line)
{
    int code = 0;
    return sscanf(line, "HTTP/1.%*d %d", &code) == 1 && code == 200;
}

/* One readiness request: true if the server answered it as a ready one does. */
static bool probe(const test_store_t *s, int ms)
{
    char req[512], line[128];
    switch (s->kind) {
    case TEST_STORE_REDIS:
        return ask(s->port, ms, "PING\r\n", line, sizeof line) && !strncmp(line, "+PONG", 5);
    case TEST_STORE_ETCD: {
        /* A range needs a leader (a linearizable read), which /health's quick answer does not
         * prove in every version: ready means it can serve what the client will ask. */
        const char *body = "{\"key\":\"AA==\"}";
        snprintf(req, sizeof req,
                 "POST /v3/kv/range HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n"
                 "Content-Type: application/json\r\nContent-Length: %zu\r\n"
                 "Connection: close\r\n\r\n%s",
                 s->port, strlen(body), body);
        return ask(s->port, ms, req, line, sizeof line) && http_ok(line);
    }
    case TEST_STORE_HTTP:
        snprintf(req, sizeof req,
                 "GET /health HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nConnection: close\r\n\r\n",
                 s->port);
        return ask(s->port, ms, req, line, sizeof line) && http_ok(line);
    }
    return false;
}

/* Polls until the server answers, exits, or `deadline` passes. Leaves it running only on UP. */
static launch_t wait_ready(test_store_t *s, int64_t deadline, off_t from, int *status)
{
    for (int pause = 5;; pause = pause < 100 ? pause * 2 : 100) {
        int64_t left = deadline - now_ms();
        bool ok = probe(s, left < PROBE_IO_MS ? (left > 50 ? (int)left : 50) : PROBE_IO_MS);
        /* Checked after the probe: an answer counts only while our server is alive, since one
         * that lost the port to another server dies on bind, and the other could answer. (One
         * that has not died yet still slips through; with ports fresh from the kernel, that
         * takes a stranger speaking the same protocol.) */
        pid_t w = waitpid(s->pid, status, WNOHANG);
        if (w == s->pid || (w < 0 && errno == ECHILD)) {
            track(s, 0, true);
            return log_says_busy(s, from) ? BUSY : DIED;
        }
        if (ok)
            return UP;
        if (now_ms() >= deadline) {
            kill_hard(s);
            return LATE;
        }
        sleep_ms(pause);
    }
}

static void describe(const test_store_t *s, launch_t r, off_t from, int status, int waited)
{
    if (r == LATE)
        report(s, from, "not ready after %d ms", waited);
    else if (r == BUSY)
        report(s, from, "port taken");
    else if (WIFEXITED(status))
        report(s, from, "exited with status %d while starting", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        report(s, from, "killed by signal %d while starting", WTERMSIG(status));
    else
        report(s, from, "gone while starting");
}

/* One spawn and wait; prints why on failure unless it is BUSY and the caller may retry. */
static launch_t launch(test_store_t *s, int64_t deadline, bool last)
{
    off_t from = 0;
    int status = 0;
    int64_t t0 = now_ms();
    if (spawn(s, &from) != 0)
        return NOSPAWN;
    launch_t r = wait_ready(s, deadline, from, &status);
    if (r != UP && (r != BUSY || last))
        describe(s, r, from, status, (int)(now_ms() - t0));
    return r;
}

/* ---- lifecycle ---- */

static int pick_ports(test_store_t *s, bool first)
{
    const char *hook = first ? getenv("KVB_TEST_STORE_FIRST_PORT") : NULL;
    s->port = hook && *hook ? (uint16_t)strtoul(hook, NULL, 10) : test_free_port();
    s->peer_port = 0;
    /* Two bind(0)s in a row may well hand out the same number: the first socket is closed. */
    for (int i = 0;
         s->kind == TEST_STORE_ETCD && i < 16 && (!s->peer_port || s->peer_port == s->port); i++)
        s->peer_port = test_free_port();
    if (!s->port || (s->kind == TEST_STORE_ETCD && (!s->peer_port || s->peer_port == s->port))) {
        fprintf(stderr, "store: no free port on 127.0.0.1: %s\n", strerror(errno));
        return -1;
    }
    snprintf(s->uri, sizeof s->uri, "%s://127.0.0.1:%u", test_store_kind_name(s->kind), s->port);
    return 0;
}

int test_store_start(test_store_t *s, test_store_kind_t kind)
{
    memset(s, 0, sizeof *s);
    s->kind = kind;
    for (int try = 1; try <= START_TRIES; try++) {
        if (make_dir(s) != 0 || pick_ports(s, try == 1) != 0)
            break;
        launch_t r = launch(s, now_ms() + READY_MS, try == START_TRIES);
        if (r == UP)
            return 0;
        /* Fresh dir too: etcd may have written the old peer URL into its data dir already. */
        test_store_stop(s);
        if (r != BUSY)
            break;
        if (try < START_TRIES)
            fprintf(stderr, "store: %s: port %u%s was taken; trying new ports\n",
                    test_store_kind_name(kind), s->port, s->peer_port ? " or its peer port" : "");
    }
    test_store_stop(s);
    s->port = s->peer_port = 0;
    s->uri[0] = '\0';
    return -1;
}

int test_store_halt(test_store_t *s)
{
    if (s->pid <= 0)
        return -1;
    kill_hard(s);
    return 0;
}

int test_store_restart(test_store_t *s)
{
    if (s->pid > 0 || !s->dir[0] || !s->port) {
        fprintf(stderr, "store: restart of a %s store that is %s\n", test_store_kind_name(s->kind),
                s->pid > 0 ? "running" : "not started");
        return -1;
    }
    /* The port is the point of a restart, so it stays: a port still busy (a client's connection
     * that happened to get the number while we were down) is retried until the deadline. */
    int64_t deadline = now_ms() + READY_MS;
    for (;;) {
        bool last = now_ms() + 100 >= deadline;
        launch_t r = launch(s, deadline, last);
        if (r == UP)
            return 0;
        if (r != BUSY || last)
            return -1;
        sleep_ms(100);
    }
}

void test_store_stop(test_store_t *s)
{
    if (s->pid > 0) {
        if (kill(s->pid, SIGTERM) != 0 && errno != ESRCH)
            fprintf(stderr, "store: kill %d: %s\n", (int)s->pid, strerror(errno));
        if (reap(s->pid, STOP_GRACE_MS, NULL))
            track(s, 0, true);
        else
            kill_hard(s);
    }
    if (s->dir[0]) {
        track(s, 0, false);
        rm_rf(s->dir);
        s->dir[0] = '\0';
    }
}
