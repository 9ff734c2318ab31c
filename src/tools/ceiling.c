/* SPDX-License-Identifier: Apache-2.0 */
/* Ceilings: what this machine gives without kvbridge, for the same working set, so that a ratio
 * to one means something.
 *
 * The working set is every block of two buffers of the benchmark's size, or the blocks a KV
 * transfer moves (a prompt's blocks, scattered over pools several times larger).
 *
 * TCP: plain streaming sockets on loopback (or across two network namespaces, kvb_ceiling_net), as
 * many connections as kvbridge's lanes, a sender process and this one, each with a buffer of its
 * own allocated and populated after the fork (a buffer shared copy-on-write across fork() makes
 * the first write to each page a fault and the measurement a measurement of page faults), the
 * benchmark's blocks gathered into sends of at least 1 MiB and received in pieces as large,
 * straight into place (as kvbridge's lanes do: a syscall per small block is not what the hardware
 * gives), kernel-tuned socket buffers as kvbridge has them, one thread per side driving all
 * connections where there are two cores (as kvbridge's progress thread); one pass over the working
 * set not counted (the first time the kernel reaches a page is not what a long-lived pool costs),
 * then the best of a few windows.
 *
 * Copy: the best of glibc memcpy, `rep movsb` and streaming stores between two buffers of the
 * benchmark's size - the run's own where the benchmark can reach both (kvb_ceiling_open_on), else
 * two allocated as kvb_alloc allocates (shared memfd pages) and populated - blocks spread over as
 * many threads as the copy path uses; one pass not counted, then the best of a few runs. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/copy.h"
#include "common/cpus.h"
#include "tools/cli.h"

#define CONN_MAX    16
#define THREADS_MAX 16
#define IOVS_MAX    256
#define NSIZES      3            /* syscall sizes a TCP ceiling tries (syscall_sizes) */
#define CHUNK_MAX   (8ull << 20) /* the largest: kvbridge's lanes' TX_MAX_BYTES */
#define CONNECT_MS  60000        /* the sender populates its buffer first */
#define WARM_MAX_NS (120ull * 1000 * 1000 * 1000) /* a warm pass slower than this: give up */
/* A receiving side that has taken in bytes polls its sockets this long for the next before it
 * sleeps, as kvbridge's progress threads do for answers owed over TCP (linger_us by default):
 * a receiver that slept each time it had read what had come made its sender wake it every few
 * hundred KB, on the sender's CPU, and streamed 0.91-0.94 as much on loopback. */
#define POLL_NS (100ull * 1000)
/* Between measurements the TCP ceiling's sender is paused and its connections drained (see
 * quiesce): no more than this long for the last bytes, and done once none came for QUIET_MS. */
#define QUIESCE_MAX_NS (5ull * 1000 * 1000 * 1000)
#define QUIET_MS       5

/* kvb_ceiling_net: where the receiver listens, and the namespace the sender joins ("": none). */
static struct in_addr net_addr = {.s_addr = 0};
static char net_peer[256];

int kvb_ceiling_net(const char *addr, const char *peer_netns)
{
    struct in_addr a = {.s_addr = htonl(INADDR_LOOPBACK)};
    if (addr && inet_pton(AF_INET, addr, &a) != 1) {
        fprintf(stderr, "bench: ceiling: %s is not an IPv4 address\n", addr);
        return -1;
    }
    size_t len = peer_netns ? strlen(peer_netns) : 0;
    if (peer_netns && (len == 0 || len >= sizeof net_peer || strchr(peer_netns, '/') ||
                       !strcmp(peer_netns, ".") || !strcmp(peer_netns, ".."))) {
        fprintf(stderr, "bench: ceiling: bad network namespace name\n");
        return -1;
    }
    net_addr = a;
    snprintf(net_peer, sizeof net_peer, "%s", peer_netns ? peer_netns : "");
    return 0;
}

/* Gives a socket of the stream the congestion control kvbridge's connections take by default
 * (KVB_TCP_CONGESTION, as kvb_config_init reads it; else the system's), so that the stream is
 * paced - or not - as they are. 0, or -1 if the kernel refuses it. */
static int same_congestion(int fd)
{
    const char *cc = getenv("KVB_TCP_CONGESTION");
    if (!cc || !*cc || !setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, (socklen_t)strlen(cc)))
        return 0;
    fprintf(stderr, "bench: ceiling: TCP congestion control %s: %s\n", cc,
            errno == ENOENT ? "not available here" : strerror(errno));
    return -1;
}

/* The congestion control a stream socket gets here, for the method line ("?" if unknown). */
static void congestion_name(char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len = (socklen_t)cap - 1;
    snprintf(out, cap, "?");
    if (fd >= 0 && !same_congestion(fd) && !getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, out, &len))
        out[len < cap ? len : cap - 1] = '\0';
    if (fd >= 0)
        close(fd);
}

/* The sender's side of kvb_ceiling_net: joins the peer's network namespace. */
static int join_peer_netns(void)
{
    if (!net_peer[0])
        return 0;
    char path[300];
    snprintf(path, sizeof path, "/run/netns/%s", net_peer);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET)) {
        fprintf(stderr, "bench: ceiling: cannot join network namespace %s: %s\n", net_peer,
                strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

uint8_t *kvb_cli_populated(uint64_t len)
{
    void *p =
        mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    /* Not inherited by a child forked later (a ceiling's sender, the request/response reference's
     * server): shared copy-on-write, each page's next write here would be a fault, and with
     * buffers of 512 MiB and more the run and its ceiling measured those faults (a 2 GiB ceiling
     * at 0.33 GB/s). Every user of these buffers is the process that allocated them. */
    if (madvise(p, len, MADV_DONTFORK)) {
        int e = errno;
        munmap(p, len);
        errno = e;
        return NULL;
    }
    /* And touched: on a VM with shadow page tables the first access to each page costs a
     * hypervisor exit even after MAP_POPULATE (0.7-1.2 GB/s for a stream over a fresh 512 MiB
     * buffer against 3.5 over a touched one). */
    for (uint64_t off = 0; off < len; off += 4096)
        ((volatile uint8_t *)p)[off] = 0;
    return p;
}

int kvb_cli_memfd(const char *name, uint64_t len)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)len) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        fd = -1;
    }
    return fd;
}

uint8_t *kvb_cli_map_memfd(int fd, uint64_t len, bool writable)
{
    void *p = mmap(NULL, len, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                   MAP_SHARED | MAP_POPULATE, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* A populated buffer of shared memfd pages, as kvb_alloc makes (and same-host peers map). */
static uint8_t *shared_buffer(uint64_t len)
{
    int fd = kvb_cli_memfd("kvbridge-ceiling", len);
    uint8_t *p = fd >= 0 ? kvb_cli_map_memfd(fd, len, true) : NULL;
    if (fd >= 0)
        close(fd);
    if (p)
        memset(p, 0x5a, len); /* written once, so no copy below meets a fresh page */
    return p;
}

/* ---- the working set --------------------------------------------------------------------------
 */

/* Where a connection or a copying thread is in its share of the blocks: block i of `n`, `in`
 * bytes into it. Passes wrap around. */
typedef struct {
    const uint64_t *src, *dst; /* the share's block offsets on the sending and receiving side */
    size_t n, i;
    uint64_t in;
} cursor_t;

/* The next `max` bytes (fewer where IOVS_MAX iovecs end first) from the cursor on, as iovecs over
 * `base` at the offsets of `off` (the cursor's src or dst), adjacent blocks merged; the number of
 * iovecs. */
static int cursor_iov(const cursor_t *c, const uint64_t *off, uint8_t *base, uint64_t block,
                      uint64_t max, struct iovec *iov)
{
    int k = 0;
    size_t i = c->i;
    uint64_t in = c->in;
    for (uint64_t bytes = 0; k < IOVS_MAX && bytes < max; i = (i + 1) % c->n, in = 0) {
        uint8_t *p = base + off[i] + in;
        uint64_t len = block - in < max - bytes ? block - in : max - bytes;
        if (k > 0 && (uint8_t *)iov[k - 1].iov_base + iov[k - 1].iov_len == p)
            iov[k - 1].iov_len += len;
        else
            iov[k++] = (struct iovec){.iov_base = p, .iov_len = len};
        bytes += len;
    }
    return k;
}

static void cursor_advance(cursor_t *c, uint64_t block, uint64_t bytes)
{
    bytes += c->in;
    c->i = (size_t)((c->i + bytes / block) % c->n);
    c->in = bytes % block;
}

/* ---- TCP ------------------------------------------------------------------------------------- */

/* The receivers' shared clock for one measurement: whatever arrives before t0 is not counted
 * (the socket buffers filled while nobody read), then `runs` windows of `window_ns`. */
typedef struct {
    pthread_barrier_t start; /* every receiving thread started, and the main thread */
    uint64_t t0, window_ns;
    int runs;
    uint8_t size[KVB_CEILING_RUNS_MAX]; /* window r streams in syscalls of sizes[size[r]] */
} windows_t;

/* What the receiver tells the sender, one byte on the connection: the syscall size of the next
 * window (0..NSIZES-1: send, of that size) or CMD_PAUSE (send nothing until the next size). */
#define CMD_PAUSE 0xff

/* One connection's end. */
typedef struct {
    int fd;
    uint8_t *buf;
    uint64_t block, chunk;  /* chunk: bytes offered to one sendmsg or recvmsg */
    uint64_t sizes[NSIZES]; /* the chunks tried, window by window (see syscall_sizes) */
    bool paused;            /* sending side: told CMD_PAUSE, not yet another size */
    cursor_t at;
} end_t;

/* The connections one thread drives: as kvbridge's progress thread drives its lanes, every
 * socket non-blocking, poll() when none can move. */
typedef struct {
    end_t *e[CONN_MAX];
    int n;
    windows_t *w;
    uint64_t bytes[KVB_CEILING_RUNS_MAX]; /* received in each window */
    bool ok;                              /* no socket failed */
} group_t;

/* Bytes per syscall: a stream of small blocks is gathered into large sends (sendmsg with one
 * iovec per block) and received in large pieces straight into place (recvmsg, one iovec per
 * block), as kvbridge does - the ceiling is the kernel's copies, not a syscall per block. */
#define CHUNK_MIN (1ull << 20)

static uint64_t chunk_of(uint64_t block)
{
    uint64_t c = block >= CHUNK_MIN ? block : CHUNK_MIN / block * block;
    return c / block > IOVS_MAX ? IOVS_MAX * block : c;
}

/* Three sizes per syscall, tried in turn window by window, the best window counting: the blocks
 * gathered into at least 1 MiB, 15/16 of that, and the blocks gathered into up to 8 MiB, what
 * kvbridge's lanes offer one sendmsg. On this project's VMs writes and reads of exactly 1 MiB (or
 * 128 KiB) stream at 3.7-4.5 GB/s where 960 KiB (or 124 KiB) ones stream at 6-8 GB/s - iperf3 -l
 * 1048576 against -l 1032192 shows it too (36.5 vs 50.6 Gbit/s) - and on another host 1 MiB
 * READs through kvbridge's 8 MiB sends moved 5.8-6.4 GB/s against a stream of 1 MiB and 960 KiB
 * syscalls at 5.5-5.7: a ceiling must not depend on the size a benchmark happened to pick. */
static void syscall_sizes(uint64_t block, uint64_t out[NSIZES])
{
    out[0] = chunk_of(block);
    out[1] = (out[0] - out[0] / 16 + 4095) / 4096 * 4096;
    uint64_t big = block >= CHUNK_MAX ? block : CHUNK_MAX / block * block;
    out[2] = big / block > IOVS_MAX ? IOVS_MAX * block : big;
}

/* Polls a group's sockets for `events` - a sending side, whose sockets wait for the receiver's
 * commands too, for POLLIN and, where not paused, POLLOUT - up to timeout_ms: 1 when one is
 * ready, 0 when none came, -1 when a socket failed or the peer left. */
static int poll_group(const group_t *g, short events, int timeout_ms)
{
    struct pollfd pf[CONN_MAX];
    for (int i = 0; i < g->n; i++) {
        short ev = events;
        if (events & POLLOUT)
            ev = (short)(g->e[i]->paused ? POLLIN : POLLIN | POLLOUT);
        pf[i] = (struct pollfd){.fd = g->e[i]->fd, .events = ev};
    }
    int r = poll(pf, (nfds_t)g->n, timeout_ms);
    if (r < 0)
        return errno == EINTR ? 1 : -1;
    for (int i = 0; i < g->n; i++)
        if (pf[i].revents & (POLLERR | POLLHUP | POLLNVAL))
            return -1;
    return r > 0;
}

static bool wait_group(const group_t *g, short events)
{
    return poll_group(g, events, 1000) >= 0;
}

/* Sends command `cmd` to the sender on each of the group's connections; false if one failed. */
static bool tell_group(const group_t *g, uint8_t cmd)
{
    for (int i = 0; i < g->n; i++)
        if (send(g->e[i]->fd, &cmd, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1)
            return false;
    return true;
}

/* One non-blocking sendmsg or recvmsg on each of a group's sockets (receiving: whatever has
 * arrived, straight into place - no MSG_WAITALL, which would leave the sender blocked on a full
 * socket buffer meanwhile); the bytes moved, 0 when none could move, -1 when a socket failed. */
static int64_t group_round(group_t *g, bool send)
{
    int64_t total = 0;
    for (int i = 0; i < g->n; i++) {
        end_t *e = g->e[i];
        uint8_t cmd[16];
        ssize_t nc = send ? recv(e->fd, cmd, sizeof cmd, MSG_DONTWAIT) : 0;
        if (nc > 0) { /* the receiver's next window, or a pause: the last word counts */
            e->paused = cmd[nc - 1] == CMD_PAUSE;
            if (!e->paused)
                e->chunk = e->sizes[cmd[nc - 1] % NSIZES];
        }
        if (send && e->paused)
            continue;
        struct iovec iov[IOVS_MAX];
        struct msghdr m = {.msg_iov = iov};
        m.msg_iovlen = (size_t)cursor_iov(&e->at, send ? e->at.src : e->at.dst, e->buf, e->block,
                                          e->chunk, iov);
        ssize_t n = send ? sendmsg(e->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT)
                         : recvmsg(e->fd, &m, MSG_DONTWAIT);
        if (n > 0) {
            cursor_advance(&e->at, e->block, (uint64_t)n);
            total += n;
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            return -1;
        }
    }
    return total;
}

/* Ends a group's streaming until its next measurement: tells the sender to pause, then receives
 * what was under way (its socket buffers and ours) until none came for QUIET_MS. Without it the
 * sender went on filling socket buffers that nobody read - in the KV bench, 20-40 MB and 6-7 ms of
 * CPU during each 90 ms pull it was then compared with, taken from the pull's own threads.
 * False when a socket failed or the bytes did not stop within QUIESCE_MAX_NS. */
static bool quiesce(group_t *g)
{
    if (!tell_group(g, CMD_PAUSE))
        return false;
    for (uint64_t give_up = kvb__now_ns() + QUIESCE_MAX_NS; kvb__now_ns() < give_up;) {
        int64_t n = group_round(g, false);
        if (n < 0)
            return false;
        int r = n > 0 ? 1 : poll_group(g, POLLIN, QUIET_MS);
        if (r <= 0)
            return r == 0;
    }
    return false;
}

/* The warm pass, not counted: every block of the group's shares once through the socket path on
 * both sides. A serving instance's pools have been, for hours; the first time the kernel reaches a
 * page of a process may cost far more than a copy (on this project's VMs, shadow page tables: 0.7
 * GB/s for the first pass over 2 GiB, 3-4 GB/s for the next), and a ceiling that counts it
 * measures the mapping, not the stream. Slow start and socket buffers settle meanwhile. */
static void *warm_main(void *arg)
{
    group_t *g = arg;
    uint64_t got = 0, need = 0;
    for (int i = 0; i < g->n; i++)
        need += g->e[i]->at.n * g->e[i]->block;
    g->ok = true;
    for (uint64_t give_up = kvb__now_ns() + WARM_MAX_NS; g->ok && got < need;) {
        int64_t n = group_round(g, false);
        g->ok = n >= 0 && (n > 0 || wait_group(g, POLLIN)) && kvb__now_ns() < give_up;
        got += n > 0 ? (uint64_t)n : 0;
    }
    g->ok = g->ok && quiesce(g);
    return NULL;
}

/* One measurement: receives from the start, counts from t0 on, window by window. */
static void *receive_main(void *arg)
{
    group_t *g = arg;
    windows_t *w = g->w;
    memset(g->bytes, 0, sizeof g->bytes);
    g->ok = tell_group(g, 0);        /* the sender, paused since the last measurement, goes on */
    pthread_barrier_wait(&w->start); /* the main thread sets t0 once every receiver runs */
    pthread_barrier_wait(&w->start);
    uint64_t end = w->t0 + (uint64_t)w->runs * w->window_ns, cur = UINT64_MAX, came = 0;
    while (g->ok) {
        uint64_t now = kvb__now_ns();
        if (now >= end)
            break;
        uint64_t r = now < w->t0 ? UINT64_MAX : (now - w->t0) / w->window_ns;
        for (int i = 0; r != cur && r != UINT64_MAX && i < g->n; i++) {
            uint8_t cmd = w->size[r]; /* a new window: both ends change size */
            g->e[i]->chunk = g->e[i]->sizes[cmd];
            g->ok = g->ok && send(g->e[i]->fd, &cmd, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1;
        }
        cur = r;
        int64_t n = group_round(g, false);
        came = n > 0 ? now : came;
        g->ok = g->ok && n >= 0 && (n > 0 || now - came < POLL_NS || wait_group(g, POLLIN));
        if (n > 0 && r != UINT64_MAX)
            g->bytes[r] += (uint64_t)n;
    }
    g->ok = g->ok && quiesce(g);
    return NULL;
}

/* Streams until the connections break, pausing where told (CMD_PAUSE). */
static void *send_main(void *arg)
{
    group_t *g = arg;
    for (;;) {
        int64_t n = group_round(g, true);
        if (n < 0 || (n == 0 && !wait_group(g, POLLOUT)))
            return NULL;
    }
}

/* Connection i's share of the working set: a contiguous run of its blocks. */
static cursor_t share(const uint64_t *src, const uint64_t *dst, size_t n, int i, int conns)
{
    size_t lo = n * (size_t)i / (size_t)conns, hi = n * (size_t)(i + 1) / (size_t)conns;
    return (cursor_t){.src = src + lo, .dst = dst + lo, .n = hi - lo};
}

/* Connections dealt round-robin to `threads` groups, each driven by a thread running `fn`. */
static void run_groups(end_t *e, int conns, int threads, windows_t *w, group_t *g, pthread_t *t,
                       void *(*fn)(void *))
{
    for (int k = 0; k < threads; k++)
        g[k] = (group_t){.w = w};
    for (int i = 0; i < conns; i++) {
        group_t *gk = &g[i % threads];
        gk->e[gk->n++] = &e[i];
    }
    for (int k = 0; k < threads; k++)
        pthread_create(&t[k], NULL, fn, &g[k]);
}

typedef struct {
    uint64_t buffer, block;
    const uint64_t *src, *dst; /* block offsets, `n` of them */
    size_t n;
    int conns;
} set_t;

/* Connection i's end, sending or receiving in `buf`. */
static end_t end_of(const set_t *ws, int fd, uint8_t *buf, int i)
{
    end_t e = {.fd = fd,
               .buf = buf,
               .block = ws->block,
               .at = share(ws->src, ws->dst, ws->n, i, ws->conns)};
    syscall_sizes(ws->block, e.sizes);
    e.chunk = e.sizes[0];
    return e;
}

/* ---- the peer process of a TCP measurement: this side listens, a forked child connects ------- */

/* A listener on the stream's address (kvb_ceiling_net), then `child(sa, arg)` in a forked process
 * (it connects to `sa` and never returns). The listener, or -1 with the reason on stderr. */
static int peer_start(int backlog, pid_t *pid,
                      void (*child)(const struct sockaddr_in *, const void *), const void *arg)
{
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr = net_addr};
    if (!net_addr.s_addr)
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    if (lfd >= 0 && same_congestion(lfd)) {
        close(lfd);
        return -1;
    }
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, backlog) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        perror("bench: ceiling socket");
        if (lfd >= 0)
            close(lfd);
        return -1;
    }
    fflush(stdout);
    *pid = fork();
    if (*pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(lfd);
        child(&sa, arg);
    }
    return lfd;
}

/* Up to `n` of the child's connections accepted into fds[] within CONNECT_MS (the child populates
 * its buffer first); closes the listener. *pid becomes 0 if the child died before it connected.
 * The number accepted. */
static int peer_accept(int lfd, pid_t *pid, int n, int *fds)
{
    int got = 0;
    for (uint64_t until = kvb__now_ns() + (uint64_t)CONNECT_MS * 1000000;
         *pid > 0 && got < n && kvb__now_ns() < until;) {
        struct pollfd pl = {.fd = lfd, .events = POLLIN};
        if (poll(&pl, 1, 100) == 1) {
            int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (fd < 0)
                break;
            fds[got++] = fd;
        } else if (waitpid(*pid, NULL, WNOHANG) == *pid) {
            *pid = 0;
        }
    }
    close(lfd);
    return got;
}

/* In the child: one connection to this side, set up as kvbridge's lanes are; exits the process
 * if it cannot be had. */
static int peer_connect(const struct sockaddr_in *sa)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0 || same_congestion(fd) || connect(fd, (const struct sockaddr *)sa, sizeof *sa))
        _exit(1);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* Ends the child and reaps it. */
static void peer_stop(pid_t pid)
{
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
}

/* The sender process: its own buffer; ends when its connections break. */
static void sender(const struct sockaddr_in *sa, const void *arg)
{
    const set_t *ws = arg;
    if (join_peer_netns())
        _exit(1);
    uint8_t *buf = kvb_cli_populated(ws->buffer);
    end_t e[CONN_MAX];
    group_t g[CONN_MAX];
    pthread_t t[CONN_MAX];
    if (!buf)
        _exit(1);
    memset(buf, 0x5a, ws->buffer);
    for (int i = 0; i < ws->conns; i++)
        e[i] = end_of(ws, peer_connect(sa), buf, i);
    int threads = kvb__threads_per_side(ws->conns);
    run_groups(e, ws->conns, threads, NULL, g, t, send_main);
    for (int k = 0; k < threads; k++)
        pthread_join(t[k], NULL);
    _exit(0);
}

/* The ways a copy ceiling copies (copy_measure). */
enum { COPY_MEMCPY, COPY_MOVSB, COPY_STREAM, COPY_WAYS };

/* A ceiling kept between measurements (kvb_ceiling_open): its working set, and for "tcp" the
 * sender process and the connections, for "copy" the two buffers - so that a figure and its
 * ceiling can be measured in turn, seconds apart, without paying the set-up each time. */
struct kvb_ceiling_session {
    set_t ws;
    bool tcp;
    int parallel;
    /* tcp */
    pid_t pid;
    uint8_t *buf;
    end_t e[CONN_MAX];
    int n, threads;
    /* copy: from a to b; borrowed (the caller's, kvb_ceiling_open_on) or ours */
    uint8_t *a, *b;
    bool borrowed;
    /* Where the copying threads run: thread i on cpus.cpu[i % n] - with KVB_CPUS (bench --cpus)
     * in every run, on the list's first CPUs (where the copy path's threads run with one progress
     * thread); without it in every other run, on the first `parallel` CPUs this thread may use,
     * the runs between unbound. */
    kvb_cpus_t cpus;
    bool cpus_given;
    /* Each way's best rate in the session's measurements so far (copy_measure): 0 before the
     * first. */
    double way_best[COPY_WAYS];
    /* tcp: each syscall size's best window so far (0: not tried yet); the measurements taken
     * and the windows that took turns (plan_sizes) */
    double size_best[NSIZES];
    unsigned measured, turns;
};

/* The sender process, its connections accepted and the warm pass received; 0 or -1. */
static int tcp_open(kvb_ceiling_session_t *s)
{
    const set_t *ws = &s->ws;
    int lfd = peer_start(ws->conns, &s->pid, sender, ws), fds[CONN_MAX];
    if (lfd < 0)
        return -1;
    s->buf = s->pid > 0 ? kvb_cli_populated(ws->buffer) : NULL;
    s->threads = kvb__threads_per_side(ws->conns);
    s->n = s->buf ? peer_accept(lfd, &s->pid, ws->conns, fds) : (close(lfd), 0);
    for (int i = 0; i < s->n; i++)
        s->e[i] = end_of(ws, fds[i], s->buf, i);
    if (s->n < ws->conns)
        return -1;
    group_t g[CONN_MAX];
    pthread_t t[CONN_MAX];
    bool ok = true;
    run_groups(s->e, s->n, s->threads, NULL, g, t, warm_main);
    for (int k = 0; k < s->threads; k++) {
        pthread_join(t[k], NULL);
        ok = ok && g[k].ok;
    }
    return ok ? 0 : -1;
}

/* Before the windows: the paused sender's restart (slow start after the idle) goes uncounted. */
#define DRAIN_NS (50ull * 1000 * 1000)

/* The syscall size of each of a measurement's windows; true if they took turns. Until every size
 * has had a window, they take turns. After that, every window but the last streams in the size
 * whose best window so far is the best, and the last in one of the others, in turn from one
 * measurement to the next: the stream's rate has depended on the size (syscall_sizes) by 5-17%
 * here, and a best of windows spread evenly over the sizes is a best of a third as many - in two
 * of nine KV runs over TCP of `make bench` on 2026-11-28 the median pull came out above such a
 * ceiling (7 windows as long as the pull, 2-3 of them in the fastest size). A size that was slow
 * once is still tried again. */
static bool plan_sizes(kvb_ceiling_session_t *s, int runs, uint8_t *size)
{
    int lead = 0, untried = 0;
    for (int z = 0; z < NSIZES; z++) {
        untried += s->size_best[z] <= 0;
        lead = s->size_best[z] > s->size_best[lead] ? z : lead;
    }
    int other = (lead + 1 + (int)(s->measured++ % (NSIZES - 1))) % NSIZES;
    for (int r = 0; r < runs; r++)
        size[r] = (uint8_t)(untried                     ? (int)(s->turns++ % NSIZES)
                            : r == runs - 1 && runs > 1 ? other
                                                        : lead);
    return untried;
}

/* `runs` back-to-back windows of `secs`; the best window's rate, or -1. Each size's best is
 * kept in s->size_best, and *turns tells whether the sizes took turns (plan_sizes). */
static double tcp_measure(kvb_ceiling_session_t *s, double secs, int runs, bool *turns)
{
    windows_t w = {.window_ns = (uint64_t)(secs * 1e9), .runs = runs};
    *turns = plan_sizes(s, runs, w.size);
    group_t g[CONN_MAX];
    pthread_t t[CONN_MAX];
    if (pthread_barrier_init(&w.start, NULL, (unsigned)s->threads + 1))
        return -1;
    run_groups(s->e, s->n, s->threads, &w, g, t, receive_main);
    pthread_barrier_wait(&w.start);
    w.t0 = kvb__now_ns() + DRAIN_NS;
    pthread_barrier_wait(&w.start);
    bool ok = true;
    for (int k = 0; k < s->threads; k++) {
        pthread_join(t[k], NULL);
        ok = ok && g[k].ok;
    }
    pthread_barrier_destroy(&w.start);
    double gbps = -1;
    for (int r = 0; ok && r < runs; r++) {
        uint64_t bytes = 0;
        for (int k = 0; k < s->threads; k++)
            bytes += g[k].bytes[r];
        double rate = (double)bytes / secs / 1e9, *best = &s->size_best[w.size[r]];
        gbps = rate > gbps ? rate : gbps;
        *best = rate > *best ? rate : *best;
    }
    return gbps;
}

static void tcp_close(kvb_ceiling_session_t *s)
{
    for (int i = 0; i < s->n; i++)
        close(s->e[i].fd);
    peer_stop(s->pid);
    if (s->buf)
        munmap(s->buf, s->ws.buffer);
}

/* ---- copies ---------------------------------------------------------------------------------- */

static const char *const copy_way_name[COPY_WAYS] = {"memcpy", "rep movsb", "streaming stores"};

/* One window's start, shared by its copying threads: they are all running before the clock starts,
 * and the window ends at the last one's last block, so neither a thread's start nor the caller's
 * wake after the joins counts as copying time. On this VM a thread started on, or joining, a CPU
 * that sleeps waits 0.05-3 ms for the hypervisor to run that CPU again (notes, "The KV copy
 * ceiling's windows") - a tenth of a window as long as a 30 ms pull. */
typedef struct {
    atomic_int ready;
    atomic_bool go;
    uint64_t t0, end_ns; /* written before go is set, read after it is seen */
} copy_start_t;

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    const set_t *ws;
    copy_start_t *start;
    size_t first; /* its share's first block: the blocks from there on are its, in order */
    int way;
    uint64_t bytes, done_ns;
} copier_t;

static void *copy_main(void *arg)
{
    copier_t *c = arg;
    const set_t *ws = c->ws;
    atomic_fetch_add(&c->start->ready, 1);
    while (!atomic_load_explicit(&c->start->go, memory_order_acquire))
        kvb__cpu_relax();
    uint64_t now = c->start->t0, end = c->start->end_ns;
    for (size_t i = c->first; now < end; now = kvb__now_ns()) {
        for (int k = 0; k < 16; k++, i = (i + 1) % ws->n) { /* 16 blocks per clock read */
            uint8_t *d = c->dst + ws->dst[i];
            const uint8_t *s = c->src + ws->src[i];
            if (c->way == COPY_MOVSB)
                kvb__copy_movsb(d, s, ws->block);
            else if (c->way == COPY_STREAM)
                kvb__copy_stream(d, s, ws->block);
            else
                memcpy(d, s, ws->block);
            c->bytes += ws->block;
        }
    }
    c->done_ns = now;
    return NULL;
}

/* One window of `secs`: its threads' bytes over the time from the start they shared to the last
 * one's end, in GB/s. Each thread copies a run of the blocks in order from its own start, an
 * n/threads share apart, as a plain parallel copy splits a list (and as the copy path's pool
 * takes a set's copies in runs, shm.c): with every other block each, the two threads' streaming
 * stores moved 3-4% less (20.6 against 21.2-21.3 GB/s, llama3-8b's 32 KiB blocks, 45 of 51 windows
 * here), and same-host KV pulls came out faster than their ceiling again. */
static double copy_once(const uint8_t *a, uint8_t *b, const set_t *ws, const kvb_cpus_t *cpus,
                        int threads, int way, double secs)
{
    copier_t c[THREADS_MAX];
    pthread_t t[THREADS_MAX];
    copy_start_t start = {.ready = 0, .go = false};
    for (int i = 0; i < threads; i++) {
        c[i] = (copier_t){.src = a,
                          .dst = b,
                          .ws = ws,
                          .start = &start,
                          .first = (size_t)i * ws->n / (size_t)threads,
                          .way = way};
        if (kvb__thread_create(&t[i], cpus, i, "ceiling-copy", i, copy_main, &c[i])) {
            threads = i; /* the ones started still count; the run is shorter of one thread */
            break;
        }
    }
    /* Yielding, not spinning: on two CPUs a spinning caller would keep the second thread from
     * starting. */
    while (atomic_load(&start.ready) < threads)
        sched_yield();
    start.t0 = kvb__now_ns();
    start.end_ns = start.t0 + (uint64_t)(secs * 1e9);
    atomic_store_explicit(&start.go, true, memory_order_release);
    uint64_t bytes = 0, last = start.t0;
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        bytes += c[i].bytes;
        last = c[i].done_ns > last ? c[i].done_ns : last;
    }
    return last > start.t0 ? (double)bytes / ((double)(last - start.t0) / 1e9) / 1e9 : 0;
}

/* The best of memcpy, `rep movsb` and streaming (non-temporal) stores, sharing every run, the ways
 * interleaved so that they see the same moments. Streaming stores are what the copy path uses into
 * memory larger than the last-level cache (shm.c), and on the machines measured the fastest way to
 * copy between such buffers: a ceiling without them was 1.5-1.7x too low there. A way that came
 * out more than WAY_DROP below the best in an earlier measurement of the session is not measured
 * again, its share of the runs going to the ways that can win: with the three sharing every run
 * of 0.2 s, the winner's 67 ms windows after each KV pull came out below the pull they divided in
 * two of three `make bench` runs (streaming stores 17.6 GB/s, memcpy 12.5 and rep movsb 12.2 for
 * deepseek-v3's 18 KiB blocks here). */
#define WAY_DROP 0.15

static void copy_measure(kvb_ceiling_session_t *s, double secs, int runs, kvb_ceiling_t *out)
{
    bool on[COPY_WAYS];
    int ways = 0;
    double lead = 0;
    for (int w = 0; w < COPY_WAYS; w++)
        lead = s->way_best[w] > lead ? s->way_best[w] : lead;
    for (int w = 0; w < COPY_WAYS; w++)
        ways += on[w] = s->way_best[w] >= lead * (1 - WAY_DROP);
    /* Placed and unbound in turn (unless --cpus placed the copy path's threads): two copying
     * threads that the scheduler stacks on one CPU now and then copy less than two that cannot
     * be (bound: 17.1-19.5 GB/s against 16.5-17.8 unbound in 3 interleaved pairs of 18 KiB
     * blocks here), and a ceiling is the best plain copy there is. */
    double best[COPY_WAYS] = {0}, placed = 0, unbound = 0;
    for (int r = 0; r < runs; r++) {
        bool bound = s->cpus.n && (s->cpus_given || r % 2 == 0);
        for (int w = 0; w < COPY_WAYS; w++) {
            if (!on[w])
                continue;
            double v =
                copy_once(s->a, s->b, &s->ws, bound ? &s->cpus : NULL, s->parallel, w, secs / ways);
            best[w] = v > best[w] ? v : best[w];
            double *b = bound ? &placed : &unbound;
            *b = v > *b ? v : *b;
        }
    }
    out->gbps = 0;
    for (int w = 0; w < COPY_WAYS; w++) {
        out->gbps = best[w] > out->gbps ? best[w] : out->gbps;
        s->way_best[w] = best[w] > s->way_best[w] ? best[w] : s->way_best[w];
    }
    char cpus[32] = "", where[96] = "";
    kvb__cpus_format(&s->cpus, cpus, sizeof cpus);
    if (s->cpus_given)
        snprintf(where, sizeof where, " on CPUs %s", cpus);
    else if (s->cpus.n && runs > 1)
        snprintf(where, sizeof where, " (on CPUs %s %.2f, unbound %.2f GB/s)", cpus, placed,
                 unbound);
    /* Piece by piece, each bounded by what is left (a long CPU list is cut, not overrun). */
    size_t cap = sizeof out->method;
    int n = snprintf(out->method, cap, "best copy %s, %d thread%s%s, %llu B blocks: ",
                     s->borrowed ? "between the run's own buffers" : "of memfd pages", s->parallel,
                     s->parallel == 1 ? "" : "s", where, (unsigned long long)s->ws.block);
    for (int w = 0; w < COPY_WAYS && n >= 0 && (size_t)n < cap; w++)
        n += snprintf(out->method + n, cap - (size_t)n,
                      on[w] ? "%s%s %.2f GB/s" : "%s%s %.2f GB/s earlier, not retried",
                      w ? ", " : "", copy_way_name[w], on[w] ? best[w] : s->way_best[w]);
    if (n >= 0 && (size_t)n < cap)
        snprintf(out->method + n, cap - (size_t)n, "; best of %d", runs);
}

/* The CPUs of the copying threads (see kvb_ceiling_session): KVB_CPUS, else the first `parallel`
 * this process may run on (none if it may run on fewer). */
static int copy_cpus(kvb_ceiling_session_t *s)
{
    const char *list = getenv("KVB_CPUS");
    char err[160];
    if (list && *list) {
        if (kvb__cpus_parse(list, &s->cpus, err, sizeof err)) {
            fprintf(stderr, "bench: ceiling: KVB_CPUS %s\n", err);
            return -1;
        }
        s->cpus_given = true;
        return 0;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) || CPU_COUNT(&set) < s->parallel)
        return 0;
    for (int c = 0; c < CPU_SETSIZE && s->cpus.n < s->parallel; c++)
        if (CPU_ISSET(c, &set))
            s->cpus.cpu[s->cpus.n++] = (uint16_t)c;
    return 0;
}

/* ---- the interface ----------------------------------------------------------------------------
 */

static int session_open(const char *what, uint64_t buffer, uint64_t block, const uint64_t *src,
                        const uint64_t *dst, size_t n, int parallel, const uint8_t *from,
                        uint8_t *to, kvb_ceiling_session_t **out)
{
    *out = NULL;
    bool tcp = what && !strcmp(what, "tcp");
    if (!what || (!tcp && strcmp(what, "copy")) || block == 0 || buffer < block || n == 0 ||
        parallel < 1 || parallel > (tcp ? CONN_MAX : THREADS_MAX) || (size_t)parallel > n) {
        fprintf(stderr, "bench: ceiling: bad arguments\n");
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        if (src[i] > buffer - block || dst[i] > buffer - block) {
            fprintf(stderr, "bench: ceiling: block %zu is outside the buffer\n", i);
            return -1;
        }
    kvb_ceiling_session_t *s = calloc(1, sizeof *s);
    if (!s)
        return -1;
    s->ws = (set_t){
        .buffer = buffer, .block = block, .src = src, .dst = dst, .n = n, .conns = parallel};
    s->tcp = tcp;
    s->parallel = parallel;
    int rc = 0;
    if (!tcp && copy_cpus(s)) {
        rc = -1;
    } else if (tcp) {
        rc = tcp_open(s);
    } else if (from) {
        s->a = (uint8_t *)(uintptr_t)from; /* only ever read */
        s->b = to;
        s->borrowed = true;
    } else {
        s->a = shared_buffer(buffer);
        s->b = shared_buffer(buffer);
        rc = s->a && s->b ? 0 : -1;
        if (rc)
            fprintf(stderr, "bench: ceiling: cannot allocate 2 x %llu bytes\n",
                    (unsigned long long)buffer);
    }
    /* One pass not counted, as for TCP: every block copied once before the clock runs. */
    for (size_t i = 0; rc == 0 && !tcp && i < n; i++)
        memcpy(s->b + dst[i], s->a + src[i], block);
    if (rc) {
        kvb_ceiling_close(s);
        return -1;
    }
    *out = s;
    return 0;
}

int kvb_ceiling_measure(kvb_ceiling_session_t *s, double secs, int runs, kvb_ceiling_t *out)
{
    memset(out, 0, sizeof *out);
    if (!s || runs < 1 || runs > KVB_CEILING_RUNS_MAX || secs <= 0) {
        fprintf(stderr, "bench: ceiling: bad arguments\n");
        return -1;
    }
    if (!s->tcp) {
        copy_measure(s, secs, runs, out);
        return out->gbps > 0 ? 0 : -1;
    }
    bool turns;
    out->gbps = tcp_measure(s, secs, runs, &turns);
    if (out->gbps <= 0) {
        out->gbps = 0;
        return -1;
    }
    uint64_t sz[NSIZES];
    char cc[16];
    syscall_sizes(s->ws.block, sz);
    congestion_name(cc, sizeof cc);
    snprintf(out->method, sizeof out->method,
             "raw %s TCP stream (%s), %d connection%s, %d thread%s per side, %llu B blocks in "
             "syscalls of %llu, %llu or %llu B (best windows so far %.2f, %.2f, %.2f GB/s), one "
             "warm pass, then the best of %d windows, %s",
             net_peer[0] ? "cross-namespace" : "loopback", cc, s->parallel,
             s->parallel == 1 ? "" : "s", s->threads, s->threads == 1 ? "" : "s",
             (unsigned long long)s->ws.block, (unsigned long long)sz[0], (unsigned long long)sz[1],
             (unsigned long long)sz[2], s->size_best[0], s->size_best[1], s->size_best[2], runs,
             turns ? "the sizes in turn" : "all but one in the size best so far");
    return 0;
}

int kvb_ceiling_open(const char *what, uint64_t buffer, uint64_t block, const uint64_t *src,
                     const uint64_t *dst, size_t n, int parallel, kvb_ceiling_session_t **out)
{
    return session_open(what, buffer, block, src, dst, n, parallel, NULL, NULL, out);
}

int kvb_ceiling_open_on(const uint8_t *from, uint8_t *to, uint64_t buffer, uint64_t block,
                        const uint64_t *src, const uint64_t *dst, size_t n, int parallel,
                        kvb_ceiling_session_t **out)
{
    if (!from || !to) {
        *out = NULL;
        fprintf(stderr, "bench: ceiling: bad arguments\n");
        return -1;
    }
    return session_open("copy", buffer, block, src, dst, n, parallel, from, to, out);
}

void kvb_ceiling_close(kvb_ceiling_session_t *s)
{
    if (!s)
        return;
    if (s->tcp)
        tcp_close(s);
    if (s->a && !s->borrowed)
        munmap(s->a, s->ws.buffer);
    if (s->b && !s->borrowed)
        munmap(s->b, s->ws.buffer);
    free(s);
}

/* ---- one batch at a time over TCP -------------------------------------------------------------
 *
 * The ceiling above is a stream: it never stops. A benchmark that submits a batch and waits for it
 * before the next stops once a batch: the last bytes drain from the socket buffers while the
 * sender has nothing left to send, the waiting side learns the batch is done, and the next
 * requests cross before the first new byte does. The reference below pays exactly that and
 * nothing else: a plain program with the batch's shape - per batch one 16-byte request on each
 * connection ("your share is N bytes"), the shares moved as the stream moves them (sends offered
 * up to 8 MiB, received straight into place up to 1 MiB a call, as kvbridge's lanes), WRITE shares
 * answered with 8 bytes once in, the next batch when every share is done - with no requests,
 * frames, completions or threads handing work over. The server plays the target (in the peer's
 * namespace with kvb_ceiling_net), so its data flows the benchmark's way for READ and WRITE. */

#define RPC_RECV_MAX (1ull << 20) /* kvbridge's RUN_RECV_MAX */
#define RPC_STALL_MS 10000        /* a share that moves nothing this long: the peer is gone */
/* The warm pass ends once both buffers moved, or after this long (tiny batches would take hours
 * over a large buffer: their round trips, not the pages, are what they measure anyway). */
#define RPC_WARM_MAX_NS (5ull * 1000 * 1000 * 1000)

typedef struct {
    uint64_t bytes; /* this connection's share of the batch */
    uint64_t write; /* 1: the client sends it, the server acknowledges */
} rpc_req_t;        /* host order: both ends are this program */

/* One connection's end: its part of the buffer, where the next byte goes in it, and what is
 * left of the share under way. */
typedef struct {
    int fd;
    uint8_t *base;
    uint64_t part, at, share, want;
} rpc_end_t;

struct kvb_rpcref {
    pid_t pid;
    uint8_t *buf;
    uint64_t buffer, batch;
    bool write;
    int n, threads;
    rpc_end_t e[CONN_MAX];
    /* kvb_rpcref_measure with threads > 1: every thread's share of a batch between two barriers */
    pthread_barrier_t start, end;
    bool go;
    atomic_bool failed;
};

/* Connection i of n: the i-th n-th of the buffer, and of each batch. */
static rpc_end_t rpc_end_of(int fd, uint8_t *buf, uint64_t buffer, uint64_t batch, int i, int n)
{
    uint64_t lo = buffer / (uint64_t)n * (uint64_t)i, hi = buffer / (uint64_t)n * (uint64_t)(i + 1);
    uint64_t s0 = batch * (uint64_t)i / (uint64_t)n, s1 = batch * (uint64_t)(i + 1) / (uint64_t)n;
    return (rpc_end_t){.fd = fd, .base = buf + lo, .part = hi - lo, .share = s1 - s0};
}

/* Moves what is left of each end's share, sending or receiving, on non-blocking calls with poll()
 * when none can move - receiving, once POLL_NS passed since bytes last came; false when a socket
 * failed, the peer left or nothing moved for RPC_STALL_MS. */
static bool rpc_move(rpc_end_t *const *e, int n, bool sending)
{
    for (uint64_t came = 0;;) {
        struct pollfd pf[CONN_MAX];
        bool left = false, moved = false;
        for (int i = 0; i < n; i++) {
            rpc_end_t *x = e[i];
            pf[i] =
                (struct pollfd){.fd = x->want ? x->fd : -1, .events = sending ? POLLOUT : POLLIN};
            if (!x->want)
                continue;
            left = true;
            uint64_t len = x->part - x->at, max = sending ? CHUNK_MAX : RPC_RECV_MAX;
            len = len < x->want ? len : x->want;
            len = len < max ? len : max;
            ssize_t got = sending ? send(x->fd, x->base + x->at, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                                  : recv(x->fd, x->base + x->at, len, MSG_DONTWAIT);
            if (got > 0) {
                x->want -= (uint64_t)got;
                x->at = (x->at + (uint64_t)got) % x->part;
                moved = true;
            } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
                return false;
            }
        }
        if (!left)
            return true;
        if (moved && !sending)
            came = kvb__now_ns();
        if (moved || (!sending && kvb__now_ns() - came < POLL_NS))
            continue;
        int ready = poll(pf, (nfds_t)n, RPC_STALL_MS);
        if (ready == 0 || (ready < 0 && errno != EINTR))
            return false;
    }
}

/* A whole small message on a blocking socket (the requests, the acknowledgements). */
static bool rpc_msg(int fd, void *p, size_t len, bool sending)
{
    for (uint8_t *q = p; len > 0;) {
        ssize_t got = sending ? send(fd, q, len, MSG_NOSIGNAL) : recv(fd, q, len, MSG_WAITALL);
        if (got <= 0 && !(got < 0 && errno == EINTR))
            return false;
        if (got > 0)
            q += got, len -= (size_t)got;
    }
    return true;
}

typedef struct {
    rpc_end_t *e[CONN_MAX];
    int n;
    struct kvb_rpcref *r; /* the client's; NULL in the server */
} rpc_group_t;

/* The server's thread: answers its connections' requests until the client closes them. */
static void *rpc_serve(void *arg)
{
    rpc_group_t *g = arg;
    for (;;) {
        bool write = false;
        for (int i = 0; i < g->n; i++) {
            rpc_req_t q;
            if (!rpc_msg(g->e[i]->fd, &q, sizeof q, false))
                return NULL;
            g->e[i]->want = q.bytes;
            write = q.write != 0;
        }
        if (!rpc_move(g->e, g->n, !write))
            return NULL;
        uint64_t ack = 1;
        for (int i = 0; write && i < g->n; i++)
            if (!rpc_msg(g->e[i]->fd, &ack, sizeof ack, true))
                return NULL;
    }
}

/* The client's share of one batch on a group's connections. */
static bool rpc_batch(rpc_group_t *g)
{
    bool write = g->r->write;
    for (int i = 0; i < g->n; i++) {
        rpc_req_t q = {.bytes = g->e[i]->share, .write = write};
        g->e[i]->want = q.bytes;
        if (!rpc_msg(g->e[i]->fd, &q, sizeof q, true))
            return false;
    }
    if (!rpc_move(g->e, g->n, write))
        return false;
    for (int i = 0; write && i < g->n; i++) {
        uint64_t ack;
        if (!rpc_msg(g->e[i]->fd, &ack, sizeof ack, false))
            return false;
    }
    return true;
}

/* Connections dealt round-robin to `threads` groups. */
static void rpc_groups(rpc_end_t *e, int n, int threads, struct kvb_rpcref *r, rpc_group_t *g)
{
    for (int k = 0; k < threads; k++)
        g[k] = (rpc_group_t){.r = r};
    for (int i = 0; i < n; i++)
        g[i % threads].e[g[i % threads].n++] = &e[i];
}

/* What the server process is given. */
typedef struct {
    uint64_t buffer, batch;
    int conns;
} rpc_shape_t;

/* The server process: a buffer of its own, connected to the client; ends when they close. */
static void rpc_server(const struct sockaddr_in *sa, const void *arg)
{
    const rpc_shape_t *sh = arg;
    int n = sh->conns;
    if (join_peer_netns())
        _exit(1);
    uint8_t *buf = kvb_cli_populated(sh->buffer);
    if (!buf)
        _exit(1);
    memset(buf, 0x5a, sh->buffer);
    rpc_end_t e[CONN_MAX];
    for (int i = 0; i < n; i++)
        e[i] = rpc_end_of(peer_connect(sa), buf, sh->buffer, sh->batch, i, n);
    int threads = kvb__threads_per_side(n);
    rpc_group_t g[CONN_MAX];
    pthread_t t[CONN_MAX];
    rpc_groups(e, n, threads, NULL, g);
    for (int k = 1; k < threads; k++)
        pthread_create(&t[k], NULL, rpc_serve, &g[k]);
    rpc_serve(&g[0]);
    _exit(0); /* the client closed (or a socket failed): the other threads end with us */
}

static void *rpc_client_main(void *arg)
{
    rpc_group_t *g = arg;
    struct kvb_rpcref *r = g->r;
    for (;;) {
        pthread_barrier_wait(&r->start);
        if (!r->go)
            return NULL;
        if (!rpc_batch(g))
            atomic_store(&r->failed, true);
        pthread_barrier_wait(&r->end);
    }
}

/* Batches until `until` (monotonic ns), and on until `min_bytes` moved unless `give_up` passes
 * first; the bytes moved, or -1 when a connection failed. Thread 0's share runs on the calling
 * thread: with one thread per side nothing hands a batch over. */
static int64_t rpc_run(struct kvb_rpcref *r, uint64_t until, uint64_t min_bytes, uint64_t give_up)
{
    rpc_group_t g[CONN_MAX];
    pthread_t t[CONN_MAX];
    rpc_groups(r->e, r->n, r->threads, r, g);
    atomic_store(&r->failed, false);
    if (r->threads > 1 && (pthread_barrier_init(&r->start, NULL, (unsigned)r->threads) ||
                           pthread_barrier_init(&r->end, NULL, (unsigned)r->threads)))
        return -1;
    for (int k = 1; k < r->threads; k++)
        pthread_create(&t[k], NULL, rpc_client_main, &g[k]);
    uint64_t bytes = 0;
    for (;;) {
        uint64_t now = kvb__now_ns();
        r->go = !atomic_load(&r->failed) && (now < until || (bytes < min_bytes && now < give_up));
        if (r->threads > 1)
            pthread_barrier_wait(&r->start);
        if (!r->go)
            break;
        if (!rpc_batch(&g[0]))
            atomic_store(&r->failed, true);
        if (r->threads > 1)
            pthread_barrier_wait(&r->end);
        bytes += r->batch;
    }
    for (int k = 1; k < r->threads; k++)
        pthread_join(t[k], NULL);
    if (r->threads > 1) {
        pthread_barrier_destroy(&r->start);
        pthread_barrier_destroy(&r->end);
    }
    return atomic_load(&r->failed) ? -1 : (int64_t)bytes;
}

int kvb_rpcref_open(bool write, uint64_t buffer, uint64_t batch, int conns, kvb_rpcref_t **out)
{
    if (conns < 1 || conns > CONN_MAX || batch < (uint64_t)conns ||
        buffer / (uint64_t)conns < 4096) {
        fprintf(stderr,
                "bench: request/response reference: a batch of %llu B and a buffer of %llu B "
                "over %d connections (1-%d): each needs a byte of each batch and 4 KiB of the "
                "buffer\n",
                (unsigned long long)batch, (unsigned long long)buffer, conns, CONN_MAX);
        return -1;
    }
    kvb_rpcref_t *r = calloc(1, sizeof *r);
    rpc_shape_t sh = {.buffer = buffer, .batch = batch, .conns = conns};
    int lfd = r ? peer_start(conns, &r->pid, rpc_server, &sh) : -1, fds[CONN_MAX];
    if (lfd < 0) {
        free(r);
        return -1;
    }
    r->buffer = buffer;
    r->batch = batch;
    r->write = write;
    r->buf = r->pid > 0 ? kvb_cli_populated(buffer) : NULL;
    r->threads = kvb__threads_per_side(conns);
    r->n = r->buf ? peer_accept(lfd, &r->pid, conns, fds) : (close(lfd), 0);
    struct timeval stall = {.tv_sec = RPC_STALL_MS / 1000};
    for (int i = 0; i < r->n; i++) {
        setsockopt(fds[i], SOL_SOCKET, SO_RCVTIMEO, &stall, sizeof stall); /* the acks */
        r->e[i] = rpc_end_of(fds[i], r->buf, buffer, batch, i, conns);
    }
    /* The warm pass: every byte of both buffers through the sockets once, not counted. */
    if (r->n < conns || rpc_run(r, 0, buffer, kvb__now_ns() + RPC_WARM_MAX_NS) < 0) {
        fprintf(stderr, "bench: request/response reference: %s\n",
                !r->buf        ? "cannot allocate its buffer"
                : r->n < conns ? "the server did not connect"
                               : "the server did not answer");
        kvb_rpcref_close(r);
        return -1;
    }
    *out = r;
    return 0;
}

double kvb_rpcref_measure(kvb_rpcref_t *r, double secs)
{
    uint64_t t0 = kvb__now_ns();
    int64_t bytes = rpc_run(r, t0 + (uint64_t)(secs * 1e9), 0, 0);
    double took = (double)(kvb__now_ns() - t0) / 1e9;
    return bytes > 0 && took > 0 ? (double)bytes / took / 1e9 : -1;
}

void kvb_rpcref_method(const kvb_rpcref_t *r, char *out, size_t cap)
{
    char cc[16];
    congestion_name(cc, sizeof cc);
    snprintf(out, cap,
             "raw %s TCP (%s), one %s batch of %llu B at a time over %d connection%s: on each a "
             "16-byte request, then its share %s; %d thread%s per side",
             net_peer[0] ? "cross-namespace" : "loopback", cc, r->write ? "WRITE" : "READ",
             (unsigned long long)r->batch, r->n, r->n == 1 ? "" : "s",
             r->write ? "sent and 8 bytes back once it is in" : "streamed back", r->threads,
             r->threads == 1 ? "" : "s");
}

void kvb_rpcref_close(kvb_rpcref_t *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->n; i++)
        close(r->e[i].fd);
    peer_stop(r->pid);
    if (r->buf)
        munmap(r->buf, r->buffer);
    free(r);
}
