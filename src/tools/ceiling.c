/* SPDX-License-Identifier: Apache-2.0 */
/* Ceilings: what this machine gives without kvbridge, for the same working set, so that a ratio
 * to one means something.
 *
 * TCP: plain streaming sockets on loopback, as many connections as kvbridge's lanes, a sender
 * process and this one, each with a buffer of its own allocated and populated after the fork (a
 * buffer shared copy-on-write across fork() makes the first write to each page a fault and the
 * measurement a measurement of page faults), the benchmark's blocks gathered into sends of at
 * least 1 MiB and received in pieces as large, straight into place (as kvbridge's lanes do: a
 * syscall per small block is not what the hardware gives), kernel-tuned socket buffers as
 * kvbridge has them; the best of a few runs.
 *
 * Copy: the best of glibc memcpy and `rep movsb` between two buffers of the benchmark's size,
 * allocated as kvb_alloc allocates (shared memfd pages) and populated, blocks spread over as many
 * threads as the copy path uses; the best of a few runs. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
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
#include "tools/cli.h"

#define CONN_MAX    16
#define THREADS_MAX 16

uint8_t *kvb_cli_populated(uint64_t len)
{
    void *p =
        mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    /* And touched: on a VM with shadow page tables the first access to each page costs a
     * hypervisor exit even after MAP_POPULATE (0.7-1.2 GB/s for a stream over a fresh 512 MiB
     * buffer against 3.5 over a touched one). */
    for (uint64_t off = 0; off < len; off += 4096)
        ((volatile uint8_t *)p)[off] = 0;
    return p;
}

/* A populated buffer of shared memfd pages, as kvb_alloc makes (and same-host peers map). */
static uint8_t *shared_buffer(uint64_t len)
{
    int fd = memfd_create("kvbridge-ceiling", MFD_CLOEXEC);
    if (fd < 0)
        return NULL;
    void *p = MAP_FAILED;
    if (ftruncate(fd, (off_t)len) == 0)
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return NULL;
    memset(p, 0x5a, len); /* written once, so no copy below meets a fresh page */
    return p;
}

/* ---- TCP ------------------------------------------------------------------------------------- */

typedef struct {
    int fd;
    uint8_t *buf; /* this connection's slice */
    uint64_t slice, block, start_ns, end_ns;
    uint64_t chunk; /* bytes per send and per receive: whole blocks, at least CHUNK_MIN */
    uint64_t bytes;
} stream_t;

/* Bytes per syscall: a stream of small blocks is gathered into large sends (sendmsg with one
 * iovec per block) and received in large pieces straight into place, as kvbridge does - the
 * ceiling is the kernel's copies, not a syscall per block. */
#define CHUNK_MIN (1ull << 20)
#define WARMUP_NS (200ull * 1000 * 1000) /* not counted: slow start, buffers growing */
#define IOVS      256

static uint64_t chunk_of(uint64_t block, uint64_t slice)
{
    uint64_t c = block >= CHUNK_MIN ? block : CHUNK_MIN / block * block;
    if (c / block > IOVS)
        c = IOVS * block;
    return c <= slice ? c : slice / block * block;
}

static void *receive_main(void *arg)
{
    stream_t *s = arg;
    /* Whatever has arrived, straight into place (no MSG_WAITALL: waiting for a whole chunk would
     * leave the sender blocked on a full socket buffer meanwhile). Bytes before start_ns (the
     * connection's slow start, the socket buffers growing) do not count: the ceiling is the
     * steady stream, which is what a benchmark of several seconds sees. */
    for (uint64_t off = 0;;) {
        uint64_t now = kvb__now_ns();
        if (now >= s->end_ns)
            break;
        ssize_t n = recv(s->fd, s->buf + off, s->slice - off, 0);
        if (n <= 0)
            break;
        if (now >= s->start_ns)
            s->bytes += (uint64_t)n;
        off = (off + (uint64_t)n) % s->slice;
    }
    return NULL;
}

static void *send_main(void *arg)
{
    stream_t *s = arg;
    uint64_t nchunks = s->slice / s->chunk, per = s->chunk / s->block;
    struct iovec iov[IOVS];
    for (uint64_t i = 0;; i++) {
        uint8_t *p = s->buf + (i % nchunks) * s->chunk;
        for (uint64_t k = 0; k < per; k++)
            iov[k] = (struct iovec){.iov_base = p + k * s->block, .iov_len = s->block};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = per};
        while (m.msg_iovlen > 0) {
            ssize_t n = sendmsg(s->fd, &m, MSG_NOSIGNAL);
            if (n <= 0)
                return NULL;
            while (n > 0 && m.msg_iovlen > 0) { /* a short send: resume where it stopped */
                if ((size_t)n >= m.msg_iov->iov_len) {
                    n -= (ssize_t)m.msg_iov->iov_len;
                    m.msg_iov++;
                    m.msg_iovlen--;
                } else {
                    m.msg_iov->iov_base = (uint8_t *)m.msg_iov->iov_base + n;
                    m.msg_iov->iov_len -= (size_t)n;
                    n = 0;
                }
            }
        }
    }
}

/* The sender process: its own buffer, one thread per connection; ends when they break. */
static void sender(const struct sockaddr_in *sa, int conns, uint64_t buffer, uint64_t block)
{
    uint8_t *buf = kvb_cli_populated(buffer);
    stream_t s[CONN_MAX];
    pthread_t t[CONN_MAX];
    if (!buf)
        _exit(1);
    memset(buf, 0x5a, buffer);
    uint64_t slice = buffer / (uint64_t)conns / block * block;
    for (int i = 0; i < conns; i++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
        if (fd < 0 || connect(fd, (const struct sockaddr *)sa, sizeof *sa))
            _exit(1);
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* as kvbridge's lanes */
        s[i] = (stream_t){.fd = fd,
                          .buf = buf + (uint64_t)i * slice,
                          .slice = slice,
                          .block = block,
                          .chunk = chunk_of(block, slice)};
    }
    for (int i = 0; i < conns; i++)
        pthread_create(&t[i], NULL, send_main, &s[i]);
    for (int i = 0; i < conns; i++)
        pthread_join(t[i], NULL);
    _exit(0);
}

static double tcp_once(int conns, uint64_t buffer, uint64_t block, double secs)
{
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, conns) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        perror("bench: ceiling socket");
        if (lfd >= 0)
            close(lfd);
        return -1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(lfd);
        sender(&sa, conns, buffer, block);
    }
    double gbps = -1;
    uint8_t *buf = pid > 0 ? kvb_cli_populated(buffer) : NULL;
    stream_t s[CONN_MAX];
    pthread_t t[CONN_MAX];
    int n = 0;
    uint64_t slice = buffer / (uint64_t)conns / block * block;
    for (; buf && n < conns; n++) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            break;
        s[n] = (stream_t){.fd = fd,
                          .buf = buf + (uint64_t)n * slice,
                          .slice = slice,
                          .block = block,
                          .chunk = chunk_of(block, slice)};
    }
    close(lfd);
    if (n == conns) {
        uint64_t t0 = kvb__now_ns() + WARMUP_NS, bytes = 0;
        for (int i = 0; i < n; i++) {
            s[i].start_ns = t0;
            s[i].end_ns = t0 + (uint64_t)(secs * 1e9);
            pthread_create(&t[i], NULL, receive_main, &s[i]);
        }
        for (int i = 0; i < n; i++) {
            pthread_join(t[i], NULL);
            bytes += s[i].bytes;
        }
        gbps = (double)bytes / ((double)(kvb__now_ns() - t0) / 1e9) / 1e9;
    }
    for (int i = 0; i < n; i++)
        close(s[i].fd);
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    if (buf)
        munmap(buf, buffer);
    return gbps;
}

/* ---- copies ---------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t nblocks, block, first, step, end_ns;
    bool movsb;
    uint64_t bytes;
} copier_t;

static void *copy_main(void *arg)
{
    copier_t *c = arg;
    for (uint64_t i = c->first; kvb__now_ns() < c->end_ns;) {
        for (int k = 0; k < 16; k++, i += c->step) { /* 16 blocks between clock reads */
            uint64_t off = (i % c->nblocks) * c->block;
            if (c->movsb)
                kvb__copy_movsb(c->dst + off, c->src + off, c->block);
            else
                memcpy(c->dst + off, c->src + off, c->block);
            c->bytes += c->block;
        }
    }
    return NULL;
}

static double copy_once(const uint8_t *a, uint8_t *b, uint64_t buffer, uint64_t block, int threads,
                        bool movsb, double secs)
{
    copier_t c[THREADS_MAX];
    pthread_t t[THREADS_MAX];
    uint64_t t0 = kvb__now_ns(), bytes = 0;
    for (int i = 0; i < threads; i++) {
        c[i] = (copier_t){.src = a,
                          .dst = b,
                          .nblocks = buffer / block,
                          .block = block,
                          .first = (uint64_t)i,
                          .step = (uint64_t)threads,
                          .end_ns = t0 + (uint64_t)(secs * 1e9),
                          .movsb = movsb};
        pthread_create(&t[i], NULL, copy_main, &c[i]);
    }
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        bytes += c[i].bytes;
    }
    return (double)bytes / ((double)(kvb__now_ns() - t0) / 1e9) / 1e9;
}

/* ---- the interface -----------------------------------------------------------------------------
 */

int kvb_ceiling(const char *what, uint64_t buffer, uint64_t block, int parallel, double secs,
                int runs, kvb_ceiling_t *out)
{
    memset(out, 0, sizeof *out);
    if (block == 0 || buffer < block || parallel < 1 || runs < 1 || secs <= 0) {
        fprintf(stderr, "bench: ceiling: bad arguments\n");
        return -1;
    }
    if (!strcmp(what, "tcp")) {
        if (parallel > CONN_MAX || buffer / (uint64_t)parallel < block)
            return -1;
        for (int r = 0; r < runs; r++) {
            double g = tcp_once(parallel, buffer, block, secs);
            if (g > out->gbps)
                out->gbps = g;
        }
        snprintf(out->method, sizeof out->method,
                 "raw loopback TCP stream, %d connection%s, %llu B blocks gathered into %llu B "
                 "sends, best of %d",
                 parallel, parallel == 1 ? "" : "s", (unsigned long long)block,
                 (unsigned long long)chunk_of(block, buffer / (uint64_t)parallel / block * block),
                 runs);
        return out->gbps > 0 ? 0 : -1;
    }
    if (strcmp(what, "copy") || parallel > THREADS_MAX)
        return -1;
    uint8_t *a = shared_buffer(buffer), *b = shared_buffer(buffer);
    int rc = a && b ? 0 : -1;
    double best_memcpy = 0, best_movsb = 0;
    for (int r = 0; rc == 0 && r < runs; r++) { /* interleaved: the two see the same moments */
        double m = copy_once(a, b, buffer, block, parallel, false, secs / 2);
        double v = copy_once(a, b, buffer, block, parallel, true, secs / 2);
        best_memcpy = m > best_memcpy ? m : best_memcpy;
        best_movsb = v > best_movsb ? v : best_movsb;
    }
    if (a)
        munmap(a, buffer);
    if (b)
        munmap(b, buffer);
    if (rc)
        fprintf(stderr, "bench: ceiling: cannot allocate 2 x %llu bytes\n",
                (unsigned long long)buffer);
    out->gbps = best_memcpy > best_movsb ? best_memcpy : best_movsb;
    snprintf(out->method, sizeof out->method,
             "best copy of memfd pages, %d thread%s, %llu B blocks: memcpy %.2f, rep movsb %.2f "
             "GB/s, best of %d",
             parallel, parallel == 1 ? "" : "s", (unsigned long long)block, best_memcpy, best_movsb,
             runs);
    return rc;
}

uint64_t kvb_llc_bytes(void)
{
    /* The highest cache level cpu0 reports (index3 on most x86 machines). */
    uint64_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], line[64];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        unsigned long long v = 0;
        char unit = 0;
        if (fgets(line, sizeof line, f) && sscanf(line, "%llu%c", &v, &unit) >= 1) {
            uint64_t bytes = v * (unit == 'K' ? 1024ull : unit == 'M' ? 1024ull * 1024 : 1ull);
            best = bytes > best ? bytes : best;
        }
        fclose(f);
    }
    return best;
}
