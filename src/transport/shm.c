/* SPDX-License-Identifier: Apache-2.0 */
/* Same-host data path: memfd-backed allocations that peers map, the Unix-socket side channel that
 * passes their descriptors (and probes whether cross-memory attach is allowed), and the copies
 * themselves, split over a small thread pool when large. */
#include "transport/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/checked.h"
#include "common/clock.h"
#include "common/copy.h"
#include "common/cpus.h"
#include "common/log.h"

#define MSG_MAGIC      0x5342564Bu /* "KVBS" */
#define MSG_VERSION    3           /* 3: HELLO_ACK carries the target's CLOCK_MONOTONIC */
#define MAX_CLIENTS    1024
#define MAX_MAPPINGS   4096
#define SPLIT_MIN      (1u << 20) /* copies below this stay on the calling thread */
#define SPLIT_PART_MIN (256u << 10)
/* A set of fewer bytes is copied by the thread that finishes it, alone: waking a pool thread
 * (a futex wake, and 7-8 us before it copies on the VMs measured) costs more than the half of
 * such a set it would take (docs/performance-notes.md, "Same-host copies: parts and small sets").
 */
#define POOL_MIN (256u << 10)

/* HELLO opens a link with the token of one authenticated connection, BIND adds another's. */
enum {
    M_HELLO = 1,
    M_HELLO_ACK,
    M_SHARE,
    M_SHARE_ACK,
    M_UNSHARE,
    M_UNSHARE_ACK,
    M_BIND,
    M_BIND_ACK
};

/* Side-channel message; fixed size, host byte order (both ends are on this host). */
typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    int32_t status;
    uint32_t reserved;
    uint64_t a, b, c, d;
} shm_msg_t;
_Static_assert(sizeof(shm_msg_t) == 48, "shm_msg_t is a wire format");

typedef struct shm_alloc {
    struct shm_alloc *next;
    uint64_t id, addr, len;
    int fd;
} shm_alloc_t;

typedef struct {
    uint64_t id, addr, len; /* the initiator's allocation */
    uint8_t *ptr;           /* our mapping of it */
} shm_map_t;

struct kvb_shm_peer {
    atomic_uint refs;
    pid_t pid; /* as the kernel says (SO_PEERCRED), never as the peer claims */
    bool cma_ok;
    pthread_rwlock_t lock; /* copies hold it shared; share and unshare take it exclusive */
    shm_map_t *maps;
    size_t nmaps;
    uint64_t mapped; /* bytes in maps, capped by cfg.shm_map_max */
};

struct kvb_shm_offer {
    struct kvb_shm_offer *next;
    kvb_shm_t *shm;
    atomic_uint refs; /* the connection's, and the table's while listed */
    bool listed;      /* in s->offers: the token is still good (guarded by s->mu) */
    uint32_t pid;     /* the pid the connection authenticated as */
    uint8_t token[KVB_LINK_TOKEN_LEN];
    _Atomic(kvb_shm_peer_t *) peer; /* set once by the control thread */
};

struct kvb_shm_link {
    kvb_shm_t *shm;
    struct kvb_shm_link *next;
    pthread_mutex_t mu; /* one request at a time on the socket */
    int fd;
    bool cma_ok, broken, said_broken;
    uint64_t *shared;
    size_t nshared, cap;
    uint64_t hit_base, hit_len; /* the allocation last found shared: most ops fall inside it */
};

typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    size_t len;
    bool stream;       /* with streaming stores (kvb__copy_stream) */
    uint64_t deadline; /* its job's: not copied from then on, and the job answers TIMEOUT */
    int *status;       /* its job's */
} copy_seg_t;

/* A queued share of one set (kvb__shm_start): a run of copies taken by one thread under one lock.
 */
typedef struct {
    const copy_seg_t *segs;
    size_t n;
    atomic_int *left;
    int cpu; /* where the thread that queued it ran then (-1: unknown) */
} copy_part_t;

struct kvb_shm {
    kvb_engine_t *engine;
    /* Lock order: links_mu, then a link's mu, then mu. */
    pthread_mutex_t links_mu; /* the list of links */
    pthread_mutex_t mu;       /* allocations and offers */
    shm_alloc_t *allocs;
    uint64_t next_id;
    kvb_shm_link_t *links;
    kvb_shm_offer_t *offers;
    /* control thread */
    int listen_fd, stop_fd;
    pthread_t ctl;
    bool ctl_started;
    /* copy pool */
    int nthreads;
    pthread_t *threads;
    pthread_mutex_t pool_mu;
    pthread_cond_t pool_cv, done_cv;
    copy_part_t *queue;
    size_t qhead, qcount, qcap;
    bool pool_stop;
    /* Copies into memory larger than this (the region or allocation the destination lies in)
     * bypass the caches: see stream_into. */
    uint64_t stream_min;
    /* How long a thread ending a set polls for the parts pool threads are still copying before it
     * sleeps (the engine's linger_us; 0 on one CPU, where the copy cannot run while it polls). */
    uint64_t spin_ns;
    uint64_t probe; /* its address and value let a peer test cross-memory attach on us */
};

/* ---- allocations -------------------------------------------------------------------------- */

int kvb__shm_alloc(kvb_shm_t *s, size_t len, unsigned flags, void **out)
{
    if (len == 0 || !out)
        return KVB_ERR_INVALID_ARG;
    unsigned mf = MFD_CLOEXEC | MFD_ALLOW_SEALING | ((flags & KVB_ALLOC_HUGE) ? MFD_HUGETLB : 0);
    int fd = memfd_create("kvbridge", mf);
    /* Sealed against resizing: a peer that maps it can trust its size for as long as it maps it
     * (a shrink would SIGBUS the peer's copies), and peers refuse descriptors without the seal. */
    if (fd < 0 || ftruncate(fd, (off_t)len) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        KVB_WARN("kvb_alloc(%zu%s): %s", len, (flags & KVB_ALLOC_HUGE) ? ", huge" : "",
                 strerror(err));
        return err == ENOMEM || err == ENOSPC ? KVB_ERR_NOMEM : KVB_ERR_SYSTEM;
    }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    shm_alloc_t *a = p == MAP_FAILED ? NULL : calloc(1, sizeof *a);
    if (!a) {
        if (p != MAP_FAILED)
            munmap(p, len);
        close(fd);
        return KVB_ERR_NOMEM;
    }
    pthread_mutex_lock(&s->mu);
    *a = (shm_alloc_t){
        .next = s->allocs, .id = ++s->next_id, .addr = (uintptr_t)p, .len = len, .fd = fd};
    s->allocs = a;
    pthread_mutex_unlock(&s->mu);
    *out = p;
    return KVB_OK;
}

bool kvb__shm_alloc_of(kvb_shm_t *s, uint64_t addr, uint64_t len, uint64_t *id, uint64_t *base,
                       uint64_t *alloc_len)
{
    bool found = false;
    pthread_mutex_lock(&s->mu);
    for (shm_alloc_t *a = s->allocs; a && !found; a = a->next)
        if (kvb__range_within(addr, len, a->addr, a->len)) {
            *id = a->id;
            *base = a->addr;
            if (alloc_len)
                *alloc_len = a->len;
            found = true;
        }
    pthread_mutex_unlock(&s->mu);
    return found;
}

static int link_call(kvb_shm_link_t *l, shm_msg_t *m, int fd, uint64_t deadline);

/* Marks a link broken after a share or unshare went wrong, saying so once. Caller holds l->mu.
 * The peer may then hold a mapping we do not know of - a share it took in after we gave up on it,
 * an allocation we freed that it did not unmap - at an address a later allocation can take: a copy
 * through it would land in the old pages and answer success. So nothing more goes to that peer
 * through shared memory (kvb__shm_link_reaches); its data takes the lanes. */
static void link_break(kvb_shm_link_t *l, const char *what, int rc)
{
    if (!l->said_broken)
        KVB_WARN("same-host link: %s (%s); this peer's data goes over the lanes from now on", what,
                 kvb_strerror(rc));
    l->broken = l->said_broken = true;
}

int kvb__shm_free(kvb_shm_t *s, void *ptr)
{
    pthread_mutex_lock(&s->mu);
    shm_alloc_t **pp = &s->allocs;
    while (*pp && (*pp)->addr != (uintptr_t)ptr)
        pp = &(*pp)->next;
    shm_alloc_t *a = *pp;
    if (a)
        *pp = a->next;
    pthread_mutex_unlock(&s->mu);
    /* Peers that mapped it must drop their mapping first: the address may be reused by a new
     * allocation, and a stale mapping would take its bytes. A share racing with this either ran
     * before the allocation left the list (it holds l->mu throughout, so we see its id below) or
     * finds it gone. s->mu is not held here: share() takes it under l->mu. */
    pthread_mutex_lock(&s->links_mu);
    for (kvb_shm_link_t *l = a ? s->links : NULL; l; l = l->next) {
        pthread_mutex_lock(&l->mu);
        for (size_t i = 0; i < l->nshared; i++) {
            if (l->shared[i] != a->id)
                continue;
            shm_msg_t m = {.type = M_UNSHARE, .a = a->id};
            int rc = link_call(l, &m, -1, kvb__deadline_ms(2000));
            if (rc != KVB_OK)
                link_break(l, "the peer did not unmap a freed allocation", rc);
            l->shared[i] = l->shared[--l->nshared];
            l->hit_base = l->hit_len = 0;
            break;
        }
        pthread_mutex_unlock(&l->mu);
    }
    pthread_mutex_unlock(&s->links_mu);
    if (!a)
        return KVB_ERR_NOT_FOUND;
    munmap((void *)(uintptr_t)a->addr, a->len);
    close(a->fd);
    free(a);
    return KVB_OK;
}

/* ---- copies -----------------------------------------------------------------------------------
 */

/* Copies a segment, unless its job's deadline has passed (`now`: see segs_copy). Pool threads
 * may mark one job at once. */
static void seg_copy(const copy_seg_t *g, uint64_t now)
{
    if (now >= g->deadline) {
        __atomic_store_n(g->status, KVB_ERR_TIMEOUT, __ATOMIC_RELAXED);
        return;
    }
    if (g->stream)
        kvb__copy_stream(g->dst, g->src, g->len);
    else
        kvb__copy(g->dst, g->src, g->len);
}

/* Copies segs[0..n), reading the clock for their deadlines again after every RECHECK_BYTES
 * copied (about 50-100 us here): often enough that no copy starts much past its deadline, rarely
 * enough to cost nothing beside the copies of small blocks. */
#define RECHECK_BYTES (1u << 20)
static void segs_copy(const copy_seg_t *segs, size_t n)
{
    uint64_t now = kvb__now_ns(), since = 0;
    for (size_t i = 0; i < n; i++) {
        if (since >= RECHECK_BYTES) {
            now = kvb__now_ns();
            since = 0;
        }
        seg_copy(&segs[i], now);
        since += segs[i].len;
    }
}

static bool pool_take(kvb_shm_t *s);

/* A pool thread about to take a part queued from its own CPU moves to another: the thread that
 * queued it copies the set's other parts, and the two would take turns on one CPU. `perf sched`
 * showed same-host KV pulls copied that way for 10 ms and more while the other of two cores ran
 * little else, each such pull 1.2-1.6x as long as the next: Linux wakes a thread on the CPU it last
 * ran on unless its search finds an idle one, and skips the search while the cache's CPUs look busy
 * (SIS_UTIL, since 6.0), so two threads that met on a CPU kept meeting there. With the move, of the
 * pulls that follow 0.6 s of idle 6% took more than 1.15x as long as the same pull right after,
 * against 18% without (72 pairs each; docs/performance-notes.md, "Two copying threads on one CPU,
 * and the copy ceiling's shares"). At most once per MOVE_GAP_NS, so that a thread the scheduler
 * keeps bringing back (every other CPU busy) costs little. Caller holds s->pool_mu, and the queue
 * is not empty; returns whether the lock was dropped (the thread moved, or tried to). */
#define MOVE_GAP_NS 10000000ull
static bool move_off_queuer(kvb_shm_t *s, uint64_t *last)
{
    int cpu = sched_getcpu();
    uint64_t now;
    if (cpu < 0 || cpu != s->queue[s->qhead].cpu || (now = kvb__now_ns()) - *last < MOVE_GAP_NS)
        return false;
    *last = now;
    pthread_mutex_unlock(&s->pool_mu);
    (void)kvb__thread_move_off(cpu);
    pthread_mutex_lock(&s->pool_mu);
    return true;
}

static void *pool_main(void *arg)
{
    kvb_shm_t *s = arg;
    uint64_t moved = 0; /* when this thread last moved off a CPU */
    pthread_mutex_lock(&s->pool_mu);
    while (!s->pool_stop) {
        /* After a move, look again before anything else: with the lock dropped, the queuer may
         * have copied every part itself and kvb__shm_destroy may have set pool_stop and sent its
         * one wake - a wait here would never end (a test's engine teardown hung in CI). */
        if (s->qcount && move_off_queuer(s, &moved))
            continue;
        if (!pool_take(s))
            pthread_cond_wait(&s->pool_cv, &s->pool_mu);
    }
    pthread_mutex_unlock(&s->pool_mu);
    return NULL;
}

/* Takes one queued part, if any, and copies it. Caller holds s->pool_mu; drops it to copy. */
static bool pool_take(kvb_shm_t *s)
{
    if (s->qcount == 0)
        return false;
    copy_part_t p = s->queue[s->qhead];
    s->qhead = (s->qhead + 1) % s->qcap;
    s->qcount--;
    pthread_mutex_unlock(&s->pool_mu);
    segs_copy(p.segs, p.n);
    if (atomic_fetch_sub(p.left, 1) == 1) {
        /* The set's last part. The lock, taken and dropped, orders the count's change before a
         * waiter's test of it (set_end tests it holding the lock); the wake is sent without the
         * lock, so the waiter it wakes does not find the lock taken and sleep on it again. */
        pthread_mutex_lock(&s->pool_mu);
        pthread_mutex_unlock(&s->pool_mu);
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_lock(&s->pool_mu);
    return true;
}

/* Queues segs[0..n) as parts cut at segment boundaries, each a share of what is left: a
 * thread takes the pool lock once per part, not once per copy - with a KV cache's thousands of
 * 16-64 KiB blocks, a lock per copy was a tenth of the copying threads' time. The parts shrink
 * (a part is 1/(2 x threads) of the bytes not yet queued, at least SPLIT_PART_MIN), so the
 * threads run out of work close together: with two shares per thread of equal size, the last
 * thread to end finished 13-92 us after the other in 2 ms sets of 32 1 MiB copies (median 56
 * over 4 runs), with shrinking parts 14-16 us (docs/performance-notes.md, "Same-host copies: parts
 * and small sets"). Caller holds s->pool_mu; if the queue is full the caller copies. */
static void pool_put(kvb_shm_t *s, const copy_seg_t *segs, size_t n, uint64_t total,
                     atomic_int *left)
{
    int cpu = sched_getcpu();
    uint64_t ways = 2 * ((uint64_t)s->nthreads + 1), rest = total, acc = 0;
    uint64_t share = rest / ways > SPLIT_PART_MIN ? rest / ways : SPLIT_PART_MIN;
    for (size_t first = 0, i = 0; i < n; i++) {
        acc += segs[i].len;
        if (acc < share && i + 1 < n)
            continue;
        rest -= acc;
        share = rest / ways > SPLIT_PART_MIN ? rest / ways : SPLIT_PART_MIN;
        copy_part_t part = {.segs = segs + first, .n = i + 1 - first, .left = left, .cpu = cpu};
        if (s->qcount == s->qcap) {
            pthread_mutex_unlock(&s->pool_mu);
            segs_copy(part.segs, part.n);
            pthread_mutex_lock(&s->pool_mu);
        } else {
            s->queue[(s->qhead + s->qcount++) % s->qcap] = part;
            atomic_fetch_add(left, 1);
        }
        first = i + 1;
        acc = 0;
    }
}

/* Appends the copy of `len` bytes as segments, a large one cut so that every thread gets a share
 * of it. Returns the new count. */
static size_t add_segs(const kvb_shm_t *s, copy_seg_t *segs, size_t n, kvb_shm_job_t *j,
                       uint8_t *dst, const uint8_t *src, bool stream)
{
    size_t len = j->len;
    size_t parts = len >= SPLIT_MIN ? len / SPLIT_PART_MIN : 1;
    if (parts > (size_t)s->nthreads + 1)
        parts = (size_t)s->nthreads + 1;
    /* Rounded up (to whole cache lines): at most `parts` pieces, the room kvb__shm_start made.
     * (Rounding len / parts down could leave a few bytes for one piece more.) */
    size_t each = parts > 1 ? ((len + parts - 1) / parts + 63) & ~(size_t)63 : len;
    for (size_t off = 0; off < len; off += each)
        segs[n++] = (copy_seg_t){.dst = dst + off,
                                 .src = src + off,
                                 .len = len - off < each ? len - off : each,
                                 .stream = stream,
                                 .deadline = j->deadline,
                                 .status = &j->status};
    return n;
}

/* The mapping of the initiator's [theirs, theirs+len), or NULL; *span is the length of the
 * allocation it lies in. Caller holds p->lock. */
static uint8_t *resolve(kvb_shm_peer_t *p, uint64_t theirs, uint64_t len, uint64_t *span)
{
    for (size_t i = 0; i < p->nmaps; i++)
        if (kvb__range_within(theirs, len, p->maps[i].addr, p->maps[i].len)) {
            *span = p->maps[i].len;
            return p->maps[i].ptr + (theirs - p->maps[i].addr);
        }
    return NULL;
}

/* Whether a copy into memory that lies in `span` bytes (a registered region, a peer's allocation)
 * should bypass the caches (kvb__copy_stream itself copies short ones with ordinary stores). A KV
 * pool larger than the last-level cache is streamed through, not reused from cache: ordinary stores
 * would read each destination line from memory first, to own it, and write it back later -
 * streaming stores skip that read, 1.5-1.7x the bytes per second on the machines measured (README,
 * "Streaming stores"). Memory that fits in the cache may be read again from it soon, and is copied
 * into with ordinary stores. */
static bool stream_into(const kvb_shm_t *s, uint64_t span)
{
    return s->stream_min && span > s->stream_min;
}

static int cma_copy(pid_t pid, bool to_peer, uint64_t theirs, uint8_t *mine, uint64_t len)
{
    while (len > 0) {
        struct iovec l = {.iov_base = mine, .iov_len = len};
        struct iovec r = {.iov_base = (void *)(uintptr_t)theirs, .iov_len = len};
        ssize_t n = to_peer ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                            : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n <= 0) {
            KVB_WARN("cross-memory %s of %llu bytes at 0x%llx in pid %d: %s",
                     to_peer ? "write" : "read", (unsigned long long)len,
                     (unsigned long long)theirs, (int)pid, n < 0 ? strerror(errno) : "no progress");
            return KVB_ERR_SHM_COPY;
        }
        mine += n;
        theirs += (uint64_t)n;
        len -= (uint64_t)n;
    }
    return KVB_OK;
}

void kvb__shm_start(kvb_shm_t *s, kvb_shm_peer_t *p, kvb_shm_job_t *jobs, size_t n,
                    kvb_shm_set_t *set)
{
    *set = (kvb_shm_set_t){.peer = p, .jobs = jobs, .n = n};
    atomic_init(&set->left, 0);
    size_t nsegs = 0;
    uint64_t total = 0;
    /* Not zeroed: add_segs writes each segment before anything reads it (zeroing them was 1% of
     * the CPU of a same-host deepseek-v3 pull, the largest cost outside the copies). */
    size_t count, bytes; /* at most nthreads + 1 segments per copy (add_segs) */
    copy_seg_t *segs = kvb__mul_size(n, (size_t)s->nthreads + 1, &count) ||
                               kvb__mul_size(count, sizeof *segs, &bytes)
                           ? NULL
                           : malloc(bytes ? bytes : 1);
    set->segs = segs;
    /* Shared until the set is finished: an unshare waits until these copies are done with its
     * mapping. */
    pthread_rwlock_rdlock(&p->lock);
    for (size_t i = 0; i < n; i++) {
        kvb_shm_job_t *j = &jobs[i];
        if (j->status != KVB_OK)
            continue;
        uint64_t span = 0;
        uint8_t *at = resolve(p, j->theirs, j->len, &span);
        uint8_t *dst = j->to_peer ? at : j->mine;
        const uint8_t *src = j->to_peer ? j->mine : at;
        bool stream = stream_into(s, j->to_peer ? span : j->mine_span);
        if (!at)
            j->status = KVB_ERR_AGAIN; /* cross-memory attach, at the finish */
        else if (segs)
            nsegs = add_segs(s, segs, nsegs, j, dst, src, stream), total += j->len;
        else /* no memory for the plan: copy here, alone */
            seg_copy(&(copy_seg_t){.dst = dst,
                                   .src = src,
                                   .len = j->len,
                                   .stream = stream,
                                   .deadline = j->deadline,
                                   .status = &j->status},
                     kvb__now_ns());
    }
    if (nsegs == 0)
        return;
    if (total < POOL_MIN) { /* copied at the finish, so the set before is answered first */
        set->nsegs = nsegs;
        return;
    }
    pthread_mutex_lock(&s->pool_mu);
    pool_put(s, segs, nsegs, total, &set->left);
    pthread_mutex_unlock(&s->pool_mu);
    pthread_cond_broadcast(&s->pool_cv); /* unlocked: the woken thread takes the lock at once */
}

static void set_end(kvb_shm_t *s, kvb_shm_set_t *set, bool answered)
{
    kvb_shm_peer_t *p = set->peer;
    if (!p)
        return;
    if (answered) /* a small set, not queued */
        segs_copy(set->segs, set->nsegs);
    if (atomic_load(&set->left) > 0) {
        pthread_mutex_lock(&s->pool_mu);
        bool spun = false;
        while (atomic_load(&set->left) > 0) {
            if (pool_take(s)) /* this thread copies too */
                continue;
            /* The last parts are being copied on other CPUs, and with parts that shrink they end
             * within microseconds of ours: poll for them once before sleeping. A wake through
             * done_cv let this thread run again 10-20 us after the copy ended (64 KiB READs at
             * batch 128 on 2 cores, a twentieth of a set's time); the answer waits for it. */
            if (!spun && s->spin_ns) {
                pthread_mutex_unlock(&s->pool_mu);
                uint64_t until = kvb__now_ns() + s->spin_ns;
                do {
                    for (int i = 0; i < 64 && atomic_load(&set->left) > 0; i++)
                        kvb__cpu_relax();
                } while (atomic_load(&set->left) > 0 && kvb__now_ns() < until);
                pthread_mutex_lock(&s->pool_mu);
                spun = true;
                continue;
            }
            pthread_cond_wait(&s->done_cv, &s->pool_mu);
        }
        pthread_mutex_unlock(&s->pool_mu);
    }
    pthread_rwlock_unlock(&p->lock);
    free(set->segs);
    for (size_t i = 0; i < set->n; i++) {
        kvb_shm_job_t *j = &set->jobs[i];
        if (j->status != KVB_ERR_AGAIN)
            continue;
        if (!answered)
            j->status = KVB_ERR_PEER_LOST;
        else if (kvb__now_ns() >= j->deadline) /* this copy starts only now */
            j->status = KVB_ERR_TIMEOUT;
        else
            j->status = p->cma_ok ? cma_copy(p->pid, j->to_peer, j->theirs, j->mine, j->len)
                                  : KVB_ERR_SHM_COPY;
    }
    set->peer = NULL;
    set->segs = NULL;
    set->nsegs = 0;
}

void kvb__shm_finish(kvb_shm_t *s, kvb_shm_set_t *set)
{
    set_end(s, set, true);
}

void kvb__shm_abandon(kvb_shm_t *s, kvb_shm_set_t *set)
{
    set_end(s, set, false);
}

/* ---- the side channel: messages with an optional descriptor ---------------------------------- */

static int msg_send(int fd, shm_msg_t *m, int pass_fd, int flags)
{
    m->magic = MSG_MAGIC;
    m->version = MSG_VERSION;
    struct iovec iov = {.iov_base = m, .iov_len = sizeof *m};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (pass_fd >= 0) {
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    ssize_t n;
    do
        n = sendmsg(fd, &mh, MSG_NOSIGNAL | flags);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof *m ? KVB_OK : KVB_ERR_PEER_LOST;
}

/* Receives one message; *got_fd is the passed descriptor or -1 (extra ones are closed). */
static int msg_recv(int fd, shm_msg_t *m, int *got_fd)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } u;
    struct iovec iov = {.iov_base = m, .iov_len = sizeof *m};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t n;
    do
        n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    *got_fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; i++) {
            int f;
            memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
            if (*got_fd < 0)
                *got_fd = f;
            else
                close(f); /* one descriptor per message, no more */
        }
    }
    if (n != (ssize_t)sizeof *m || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
        m->magic != MSG_MAGIC || m->version != MSG_VERSION) {
        if (*got_fd >= 0)
            close(*got_fd);
        *got_fd = -1;
        return n == 0 ? KVB_ERR_PEER_LOST : KVB_ERR_PROTOCOL;
    }
    return KVB_OK;
}

void kvb__sock_name(uint64_t incarnation, const char *kind, struct sockaddr_un *sa, socklen_t *len)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    /* Abstract namespace: nothing on disk to clean up, gone when the engine's socket closes. */
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "kvbridge-%016llx%s",
                     (unsigned long long)incarnation, kind);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* ---- target side: the control thread ----------------------------------------------------------
 */

static void peer_put(kvb_shm_peer_t *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1)
        return;
    for (size_t i = 0; i < p->nmaps; i++)
        munmap(p->maps[i].ptr, p->maps[i].len);
    free(p->maps);
    pthread_rwlock_destroy(&p->lock);
    free(p);
}

void kvb__shm_peer_put(kvb_shm_peer_t *p)
{
    peer_put(p);
}

/* ---- offers: one-time tokens that bind a link to an authenticated connection ---------------- */

static void offer_put(kvb_shm_offer_t *o)
{
    if (!o || atomic_fetch_sub(&o->refs, 1) != 1)
        return;
    peer_put(atomic_load(&o->peer));
    kvb__wipe(o->token, sizeof o->token);
    free(o);
}

int kvb__shm_offer(kvb_shm_t *s, uint32_t pid, uint8_t token[KVB_LINK_TOKEN_LEN],
                   kvb_shm_offer_t **out)
{
    *out = NULL;
    if (!s->ctl_started)
        return KVB_OK; /* no same-host path into this engine */
    kvb_shm_offer_t *o = calloc(1, sizeof *o);
    if (!o)
        return KVB_ERR_NOMEM;
    if (kvb__random(o->token, sizeof o->token)) {
        free(o);
        return KVB_ERR_SYSTEM;
    }
    atomic_init(&o->refs, 2);
    atomic_init(&o->peer, NULL);
    o->pid = pid;
    o->shm = s;
    o->listed = true;
    pthread_mutex_lock(&s->mu);
    o->next = s->offers;
    s->offers = o;
    pthread_mutex_unlock(&s->mu);
    memcpy(token, o->token, sizeof o->token);
    *out = o;
    return KVB_OK;
}

/* Caller holds s->mu. Unlists o; the caller then drops the table's reference. */
static void offer_unlist(kvb_shm_t *s, kvb_shm_offer_t *o)
{
    for (kvb_shm_offer_t **pp = &s->offers; *pp; pp = &(*pp)->next)
        if (*pp == o) {
            *pp = o->next;
            break;
        }
    o->listed = false;
}

void kvb__shm_offer_drop(kvb_shm_offer_t *o)
{
    if (!o)
        return;
    /* The engine's shm state outlives every connection (it is destroyed after the transport). */
    kvb_shm_t *s = o->shm;
    pthread_mutex_lock(&s->mu);
    bool listed = o->listed;
    if (listed)
        offer_unlist(s, o);
    pthread_mutex_unlock(&s->mu);
    if (listed)
        offer_put(o); /* the table's */
    offer_put(o);
}

kvb_shm_peer_t *kvb__shm_offer_peer(kvb_shm_offer_t *o)
{
    kvb_shm_peer_t *p = o ? atomic_load_explicit(&o->peer, memory_order_acquire) : NULL;
    if (p)
        atomic_fetch_add(&p->refs, 1);
    return p;
}

/* Redeems a token presented on the Unix socket by process `pid`: binds its offer to p. The token
 * is spent whatever the outcome, so a guess or a replay gets one try. */
static int offer_redeem(kvb_shm_t *s, const shm_msg_t *m, pid_t pid, kvb_shm_peer_t *p)
{
    uint8_t token[KVB_LINK_TOKEN_LEN];
    memcpy(token, &m->a, 8);
    memcpy(token + 8, &m->b, 8);
    kvb_shm_offer_t *o = NULL;
    pthread_mutex_lock(&s->mu);
    for (kvb_shm_offer_t *it = s->offers; it && !o; it = it->next)
        if (kvb__ct_equal(it->token, token, sizeof token))
            o = it;
    if (o)
        offer_unlist(s, o);
    pthread_mutex_unlock(&s->mu);
    if (!o) {
        KVB_WARN("same-host link from pid %d: unknown or spent token; refused", (int)pid);
        return KVB_ERR_AUTH;
    }
    int rc = KVB_OK;
    if ((pid_t)o->pid != pid) {
        KVB_WARN("same-host link from pid %d with the token of pid %u's connection; refused",
                 (int)pid, o->pid);
        rc = KVB_ERR_AUTH;
    } else {
        atomic_fetch_add(&p->refs, 1);
        atomic_store_explicit(&o->peer, p, memory_order_release);
    }
    offer_put(o); /* the table's reference */
    return rc;
}

static int on_hello(kvb_shm_t *s, const shm_msg_t *m, pid_t pid, kvb_shm_peer_t **slot)
{
    if (*slot)
        return KVB_ERR_PROTOCOL;
    kvb_shm_peer_t *p = calloc(1, sizeof *p);
    if (!p)
        return KVB_ERR_NOMEM;
    atomic_init(&p->refs, 1);
    /* Readers first, made explicit: a progress thread holds the read lock twice while one set
     * of copies finishes and the next is started (kvb__shm_start), which must not wait behind a
     * share or unshare queued in between - that would wait for the first set forever. */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_READER_NP);
    pthread_rwlock_init(&p->lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    p->pid = pid;
    int rc = offer_redeem(s, m, pid, p);
    if (rc) {
        peer_put(p);
        return rc;
    }
    /* Probe cross-memory attach: read 8 bytes whose address and value the initiator told us. */
    uint64_t v = 0;
    struct iovec l = {.iov_base = &v, .iov_len = sizeof v};
    struct iovec r = {.iov_base = (void *)(uintptr_t)m->c, .iov_len = sizeof v};
    ssize_t n = process_vm_readv(p->pid, &l, 1, &r, 1, 0);
    p->cma_ok = n == (ssize_t)sizeof v && v == m->d;
    if (!p->cma_ok)
        KVB_WARN("cross-memory attach to pid %d refused (%s): only its kvb_alloc memory goes "
                 "through shared memory, the rest over TCP",
                 (int)p->pid, n < 0 ? strerror(errno) : "probe mismatch");
    *slot = p;
    return KVB_OK;
}

static int on_bind(kvb_shm_t *s, const shm_msg_t *m, pid_t pid, kvb_shm_peer_t *p)
{
    return p ? offer_redeem(s, m, pid, p) : KVB_ERR_PROTOCOL;
}

/* Maps a descriptor the initiator shares. It must be a memfd sealed against shrinking (or it
 * could SIGBUS our copies later), large enough, and within what we map for one peer. */
static int on_share(kvb_shm_t *s, kvb_shm_peer_t *p, const shm_msg_t *m, int fd)
{
    uint64_t end, total;
    struct stat st;
    if (!p || fd < 0 || m->c == 0 || m->c > SIZE_MAX || kvb__add_u64(m->b, m->c, &end) ||
        fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size < m->c ||
        p->nmaps >= MAX_MAPPINGS)
        return KVB_ERR_PROTOCOL;
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        KVB_WARN("same-host peer pid %d shared memory not sealed against shrinking; refused",
                 (int)p->pid);
        return KVB_ERR_ACCESS_DENIED;
    }
    if (kvb__add_u64(p->mapped, m->c, &total) || total > s->engine->cfg.shm_map_max) {
        KVB_WARN("same-host peer pid %d: mapping %llu more bytes would pass the cap of %llu",
                 (int)p->pid, (unsigned long long)m->c,
                 (unsigned long long)s->engine->cfg.shm_map_max);
        return KVB_ERR_TOO_LARGE;
    }
    /* Page tables are filled up front (no fault per page in the copies) only when the initiator
     * already backed every page (kvb_alloc does): populating a sparse descriptor would allocate
     * its memory here, charged to us. */
    bool dense = (uint64_t)st.st_blocks * 512 >= m->c;
    void *ptr =
        mmap(NULL, m->c, PROT_READ | PROT_WRITE, MAP_SHARED | (dense ? MAP_POPULATE : 0), fd, 0);
    if (ptr == MAP_FAILED)
        return KVB_ERR_NOMEM;
    pthread_rwlock_wrlock(&p->lock); /* copies resolve() under the read lock */
    shm_map_t *nm = realloc(p->maps, (p->nmaps + 1) * sizeof *nm);
    if (nm) {
        p->maps = nm;
        p->maps[p->nmaps++] = (shm_map_t){.id = m->a, .addr = m->b, .len = m->c, .ptr = ptr};
        p->mapped = total;
    }
    pthread_rwlock_unlock(&p->lock);
    if (!nm) {
        munmap(ptr, m->c);
        return KVB_ERR_NOMEM;
    }
    return KVB_OK;
}

static int on_unshare(kvb_shm_peer_t *p, const shm_msg_t *m)
{
    if (!p)
        return KVB_ERR_PROTOCOL;
    pthread_rwlock_wrlock(&p->lock); /* waits for copies using it */
    for (size_t i = 0; i < p->nmaps; i++)
        if (p->maps[i].id == m->a) {
            munmap(p->maps[i].ptr, p->maps[i].len);
            p->mapped -= p->maps[i].len;
            p->maps[i] = p->maps[--p->nmaps];
            break;
        }
    pthread_rwlock_unlock(&p->lock);
    return KVB_OK;
}

/* Handles one message from the client process `pid`; false if the connection must close. */
static bool ctl_handle(kvb_shm_t *s, int fd, pid_t pid, kvb_shm_peer_t **slot)
{
    shm_msg_t m, r = {0};
    int pfd, rc = msg_recv(fd, &m, &pfd);
    if (rc)
        return false;
    switch (m.type) {
    case M_HELLO:
        rc = on_hello(s, &m, pid, slot);
        r = (shm_msg_t){.type = M_HELLO_ACK,
                        .status = rc,
                        .a = *slot && (*slot)->cma_ok,
                        .b = kvb__now_ns()}; /* the clock our copies' deadlines are read on */
        break;
    case M_BIND:
        rc = on_bind(s, &m, pid, *slot);
        r = (shm_msg_t){.type = M_BIND_ACK, .status = rc};
        break;
    case M_SHARE:
        rc = on_share(s, *slot, &m, pfd);
        r = (shm_msg_t){.type = M_SHARE_ACK, .status = rc, .a = m.a};
        break;
    case M_UNSHARE:
        rc = on_unshare(*slot, &m);
        r = (shm_msg_t){.type = M_UNSHARE_ACK, .status = rc, .a = m.a};
        break;
    default:
        rc = KVB_ERR_PROTOCOL;
    }
    if (pfd >= 0)
        close(pfd); /* mapped (or refused); the mapping keeps the memory */
    if (rc == KVB_ERR_PROTOCOL) {
        KVB_ERROR("shared-memory side channel: malformed message (type %u); closing", m.type);
        return false;
    }
    /* Never blocking: one thread serves every linked process, and a client that asks without
     * reading the answers (its socket full) must not stop the others'. */
    if (msg_send(fd, &r, -1, MSG_DONTWAIT) != KVB_OK)
        return false;
    return rc != KVB_ERR_AUTH; /* a refused token ends the link */
}

static void *ctl_main(void *arg)
{
    kvb_shm_t *s = arg;
    struct pollfd *pf = calloc(MAX_CLIENTS + 2, sizeof *pf);
    kvb_shm_peer_t **peer = calloc(MAX_CLIENTS + 2, sizeof *peer);
    pid_t *pids = calloc(MAX_CLIENTS + 2, sizeof *pids);
    if (!pf || !peer || !pids) {
        free(pf);
        free(peer);
        free(pids);
        return NULL;
    }
    size_t n = 2;
    pf[0] = (struct pollfd){.fd = s->stop_fd, .events = POLLIN};
    pf[1] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
    for (;;) {
        if (poll(pf, n, -1) < 0 && errno != EINTR)
            break;
        if (pf[0].revents)
            break;
        if (pf[1].revents & POLLIN) {
            int c = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            struct ucred cr;
            socklen_t cl = sizeof cr;
            if (c >= 0 && getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) {
                close(c);
                c = -1;
            }
            /* Only processes of our own user may link: another user's process could otherwise
             * make us copy into memory it could not reach itself. */
            if (c >= 0 && cr.uid != geteuid()) {
                KVB_WARN("same-host link from pid %d of uid %u refused: not our uid %u",
                         (int)cr.pid, (unsigned)cr.uid, (unsigned)geteuid());
                close(c);
                c = -1;
            }
            if (c >= 0 && n < MAX_CLIENTS + 2) {
                pf[n] = (struct pollfd){.fd = c, .events = POLLIN};
                pids[n] = cr.pid;
                peer[n++] = NULL;
            } else if (c >= 0) {
                close(c);
            }
        }
        for (size_t i = 2; i < n; i++) {
            if (!pf[i].revents || ctl_handle(s, pf[i].fd, pids[i], &peer[i]))
                continue;
            close(pf[i].fd);
            peer_put(peer[i]); /* connections bound to it keep theirs */
            pf[i] = pf[n - 1];
            peer[i] = peer[n - 1];
            pids[i] = pids[n - 1];
            n--;
            i--;
        }
    }
    for (size_t i = 2; i < n; i++) {
        close(pf[i].fd);
        peer_put(peer[i]);
    }
    free(pf);
    free(peer);
    free(pids);
    return NULL;
}

/* ---- initiator side: links --------------------------------------------------------------------
 */

/* One request/answer on the link, bounded by `deadline`. Caller holds l->mu. */
static int link_call(kvb_shm_link_t *l, shm_msg_t *m, int fd, uint64_t deadline)
{
    if (l->broken)
        return KVB_ERR_PEER_LOST;
    uint16_t want = (uint16_t)(m->type + 1);
    int rc = msg_send(l->fd, m, fd, 0);
    struct pollfd p = {.fd = l->fd, .events = POLLIN};
    if (rc == KVB_OK && poll(&p, 1, kvb__ms_left(deadline)) != 1)
        rc = KVB_ERR_TIMEOUT;
    int extra = -1;
    if (rc == KVB_OK)
        rc = msg_recv(l->fd, m, &extra);
    if (extra >= 0)
        close(extra);
    if (rc == KVB_OK && m->type != want)
        rc = KVB_ERR_PROTOCOL;
    if (rc == KVB_OK)
        rc = m->status;
    if (rc == KVB_ERR_PEER_LOST || rc == KVB_ERR_TIMEOUT || rc == KVB_ERR_PROTOCOL)
        l->broken = true;
    return rc;
}

int kvb__sock_connect(const kvb_hello_t *target, const char *kind, int type, bool same_user,
                      int *out)
{
    struct sockaddr_un sa;
    socklen_t sl;
    kvb__sock_name(target->incarnation, kind, &sa, &sl);
    int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sl) != 0) {
        /* Not on our host after all, or another network namespace; non-blocking, a full backlog
         * (a Unix connect does not go on in the background: errno EAGAIN, kept for the caller). */
        int err = errno;
        if (fd >= 0)
            close(fd);
        errno = err;
        return KVB_ERR_CONNECT;
    }
    struct ucred cr = {0};
    socklen_t cl = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 ||
        (same_user && cr.uid != geteuid()) || (uint32_t)cr.pid != target->pid) {
        KVB_WARN("same-host socket %s of pid %u is held by pid %d uid %u; not using it",
                 sa.sun_path + 1, target->pid, (int)cr.pid, (unsigned)cr.uid);
        close(fd);
        return KVB_ERR_AUTH;
    }
    *out = fd;
    return KVB_OK;
}

static void token_put(shm_msg_t *m, const uint8_t token[KVB_LINK_TOKEN_LEN])
{
    memcpy(&m->a, token, 8);
    memcpy(&m->b, token + 8, 8);
}

/* The peer copies only until a request's deadline, read on its CLOCK_MONOTONIC, which is ours
 * unless a time namespace sets it off: then that rule would be read against another clock - a
 * request refused at once, or copied long after the initiator gave up on it and reused the
 * memory. Its clock, read while it answered, must fall between our sending and our receiving
 * (give or take CLOCK_SLACK_NS). */
#define CLOCK_SLACK_NS 100000000ull
static bool same_clock(const kvb_hello_t *target, uint64_t theirs, uint64_t sent, uint64_t got)
{
    if (theirs + CLOCK_SLACK_NS >= sent && theirs <= got + CLOCK_SLACK_NS)
        return true;
    KVB_WARN("segment %s: its CLOCK_MONOTONIC is %+.3f s from ours (another time namespace): "
             "same-host requests carry deadlines on that clock, so its data goes over the lanes "
             "instead of shared memory",
             target->name, ((double)theirs - (double)sent) / 1e9);
    return false;
}

int kvb__shm_link_open(kvb_shm_t *s, const kvb_hello_t *target,
                       const uint8_t (*tokens)[KVB_LINK_TOKEN_LEN], size_t ntokens,
                       uint64_t deadline, kvb_shm_link_t **out)
{
    static const uint8_t none[KVB_LINK_TOKEN_LEN];
    if (!kvb__same_host(s->engine, target))
        return KVB_ERR_UNSUPPORTED;
    if (ntokens == 0 || !memcmp(tokens[0], none, sizeof none))
        return KVB_ERR_UNSUPPORTED; /* the target offered no same-host path */
    /* Connected non-blocking: a Unix connect to a full backlog (a target whose control thread
     * is stuck) would otherwise wait without a deadline; then blocking, link_call bounds it. */
    int fd, rc;
    while ((rc = kvb__sock_connect(target, "", SOCK_SEQPACKET | SOCK_NONBLOCK, true, &fd)) ==
               KVB_ERR_CONNECT &&
           errno == EAGAIN && kvb__now_ns() < deadline)
        usleep(1000); /* its backlog is full: the control thread is behind, for now */
    if (rc)
        return rc;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        close(fd);
        return KVB_ERR_CONNECT;
    }
    kvb_shm_link_t *l = calloc(1, sizeof *l);
    if (!l) {
        close(fd);
        return KVB_ERR_NOMEM;
    }
    l->shm = s;
    l->fd = fd;
    pthread_mutex_init(&l->mu, NULL);
    shm_msg_t m = {.type = M_HELLO, .c = (uintptr_t)&s->probe, .d = s->probe};
    token_put(&m, tokens[0]);
    uint64_t sent = kvb__now_ns();
    rc = link_call(l, &m, -1, deadline);
    l->cma_ok = rc == KVB_OK && m.a != 0;
    if (rc == KVB_OK && !same_clock(target, m.b, sent, kvb__now_ns()))
        rc = KVB_ERR_UNSUPPORTED;
    for (size_t i = 1; i < ntokens && rc == KVB_OK; i++) {
        m = (shm_msg_t){.type = M_BIND};
        token_put(&m, tokens[i]);
        rc = link_call(l, &m, -1, deadline);
    }
    if (rc) {
        close(fd);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return rc;
    }
    pthread_mutex_lock(&s->links_mu);
    l->next = s->links;
    s->links = l;
    pthread_mutex_unlock(&s->links_mu);
    *out = l;
    return KVB_OK;
}

void kvb__shm_link_close(kvb_shm_link_t *l)
{
    if (!l)
        return;
    kvb_shm_t *s = l->shm;
    if (s) {
        pthread_mutex_lock(&s->links_mu);
        for (kvb_shm_link_t **pp = &s->links; *pp; pp = &(*pp)->next)
            if (*pp == l) {
                *pp = l->next;
                break;
            }
        pthread_mutex_unlock(&s->links_mu);
    }
    close(l->fd); /* the target unmaps everything we shared with it */
    pthread_mutex_destroy(&l->mu);
    free(l->shared);
    free(l);
}

bool kvb__shm_link_cma(const kvb_shm_link_t *l)
{
    return l->cma_ok;
}

static int share(kvb_shm_link_t *l, uint64_t id)
{
    kvb_shm_t *s = l->shm;
    int fd = -1;
    uint64_t base = 0, len = 0;
    pthread_mutex_lock(&s->mu);
    for (shm_alloc_t *a = s->allocs; a; a = a->next)
        if (a->id == id) {
            fd = a->fd;
            base = a->addr;
            len = a->len;
        }
    pthread_mutex_unlock(&s->mu);
    if (fd < 0)
        return KVB_ERR_NOT_FOUND;
    if (l->nshared == l->cap) {
        size_t ncap = l->cap ? l->cap * 2 : 8;
        uint64_t *n = realloc(l->shared, ncap * sizeof *n);
        if (!n)
            return KVB_ERR_NOMEM;
        l->shared = n;
        l->cap = ncap;
    }
    shm_msg_t m = {.type = M_SHARE, .a = id, .b = base, .c = len};
    int rc = link_call(l, &m, fd, kvb__deadline_ms(2000));
    if (rc == KVB_OK)
        l->shared[l->nshared++] = id;
    else if (l->broken) /* no answer: the peer may still map it, later */
        link_break(l, "the peer did not answer a share in time", rc);
    return rc;
}

bool kvb__shm_link_reaches(kvb_shm_link_t *l, uint64_t addr, uint64_t len, uint64_t *span_base,
                           uint64_t *span_size)
{
    pthread_mutex_lock(&l->mu);
    /* A broken link reaches nothing: the peer may hold stale mappings (link_break). */
    bool broken = l->broken, hit = kvb__range_within(addr, len, l->hit_base, l->hit_len);
    if (hit && !broken) {
        *span_base = l->hit_base;
        *span_size = l->hit_len;
    }
    pthread_mutex_unlock(&l->mu);
    if (broken || hit)
        return !broken;
    uint64_t id, base, alen;
    if (!l->shm || !kvb__shm_alloc_of(l->shm, addr, len, &id, &base, &alen))
        return l->cma_ok;
    bool ok = false;
    pthread_mutex_lock(&l->mu);
    for (size_t i = 0; i < l->nshared && !ok; i++)
        ok = l->shared[i] == id;
    if (!ok && !l->broken)
        ok = share(l, id) == KVB_OK;
    if (ok) {
        l->hit_base = base;
        l->hit_len = alen;
    }
    broken = l->broken;
    pthread_mutex_unlock(&l->mu);
    if (ok && !broken) {
        *span_base = base;
        *span_size = alen;
    }
    return !broken && (ok || l->cma_ok);
}

/* ---- lifecycle --------------------------------------------------------------------------------
 */

static int start_listener(kvb_shm_t *s)
{
    struct sockaddr_un sa;
    socklen_t sl;
    kvb__sock_name(s->engine->hello.incarnation, "", &sa, &sl);
    s->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    s->stop_fd = eventfd(0, EFD_CLOEXEC);
    if (s->listen_fd < 0 || s->stop_fd < 0 || bind(s->listen_fd, (struct sockaddr *)&sa, sl) ||
        listen(s->listen_fd, 64)) {
        KVB_WARN("shared-memory listener: %s; same-host peers will use TCP", strerror(errno));
        return KVB_ERR_SYSTEM;
    }
    if (kvb__thread_create(&s->ctl, NULL, -1, "kvb-shm", -1, ctl_main, s) != 0)
        return KVB_ERR_SYSTEM;
    s->ctl_started = true;
    return KVB_OK;
}

static int start_pool(kvb_shm_t *s, int n)
{
    /* Adaptive: a thread that finds the pool lock taken spins a moment before it sleeps. The lock
     * is held for a queue step only, but the copying threads meet at it at every set's start and
     * end - and a sleeping waiter on a VM's halted vCPU took 60-75 us to wake and run, 0.15 of a
     * 64 KiB x 128 set's copy time (docs/performance-notes.md, "A host with slow wakes"). */
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&s->pool_mu, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_cond_init(&s->pool_cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    s->qcap = 256;
    s->queue = calloc(s->qcap, sizeof *s->queue);
    s->threads = n ? calloc((size_t)n, sizeof *s->threads) : NULL;
    if (!s->queue || (n && !s->threads))
        return KVB_ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        /* In the engine's CPU list (cfg.cpus), after the progress threads. */
        if (kvb__thread_create(&s->threads[i], &s->engine->cpus,
                               s->engine->cfg.progress_threads + i, "kvb-copy", i, pool_main,
                               s) != 0)
            return KVB_ERR_SYSTEM;
        s->nthreads = i + 1;
    }
    return KVB_OK;
}

/* KVB_SHM_STREAM_MIN: bytes, or "off"; else the last-level cache's size (none if unknown). */
static uint64_t stream_min(void)
{
    const char *v = getenv("KVB_SHM_STREAM_MIN");
    if (!v || !*v)
        return kvb__llc_size();
    if (strcmp(v, "off") == 0)
        return 0; /* never */
    char *end = NULL;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 0);
    if (errno == 0 && end != v && *end == '\0' && v[0] != '-')
        return n ? n : 1; /* 0: into any memory (larger than 1 byte) */
    KVB_WARN("KVB_SHM_STREAM_MIN=%s is neither a byte count nor \"off\"; ignored", v);
    return kvb__llc_size();
}

int kvb__shm_create(kvb_engine_t *e, bool listen, int copy_threads, kvb_shm_t **out)
{
    kvb_shm_t *s = calloc(1, sizeof *s);
    if (!s)
        return KVB_ERR_NOMEM;
    s->engine = e;
    s->listen_fd = s->stop_fd = -1;
    s->probe = e->hello.incarnation ^ 0x70726f6265ull;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->links_mu, NULL);
    s->stream_min = stream_min();
    if (kvb__cpus_usable() > 1)
        s->spin_ns = (uint64_t)kvb_engine_linger_us(e) * 1000;
    int rc = start_pool(s, copy_threads);
    if (rc == KVB_OK && listen && start_listener(s) != KVB_OK) {
        if (s->listen_fd >= 0)
            close(s->listen_fd);
        s->listen_fd = -1; /* no same-host path into this engine; not fatal */
    }
    if (rc) {
        kvb__shm_destroy(s);
        return rc;
    }
    *out = s;
    return KVB_OK;
}

bool kvb__shm_listening(const kvb_shm_t *s)
{
    return s && s->ctl_started;
}

void kvb__shm_destroy(kvb_shm_t *s)
{
    if (!s)
        return;
    if (s->ctl_started) {
        uint64_t one = 1;
        if (write(s->stop_fd, &one, sizeof one) < 0)
            KVB_ERROR("eventfd write: %s", strerror(errno));
        pthread_join(s->ctl, NULL);
    }
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    if (s->stop_fd >= 0)
        close(s->stop_fd);
    pthread_mutex_lock(&s->pool_mu);
    s->pool_stop = true;
    pthread_cond_broadcast(&s->pool_cv);
    pthread_mutex_unlock(&s->pool_mu);
    for (int i = 0; i < s->nthreads; i++)
        pthread_join(s->threads[i], NULL);
    free(s->threads);
    free(s->queue);
    /* Links belong to peers, which may outlive us (a batch can hold one): detach them. */
    for (kvb_shm_link_t *l = s->links; l; l = l->next) {
        l->shm = NULL;
        l->broken = true;
    }
    while (s->allocs) {
        shm_alloc_t *a = s->allocs;
        s->allocs = a->next;
        munmap((void *)(uintptr_t)a->addr, a->len);
        close(a->fd);
        free(a);
    }
    while (s->offers) { /* tokens never redeemed; their connections are gone already */
        kvb_shm_offer_t *o = s->offers;
        offer_unlist(s, o);
        offer_put(o);
    }
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->links_mu);
    pthread_mutex_destroy(&s->pool_mu);
    pthread_cond_destroy(&s->pool_cv);
    pthread_cond_destroy(&s->done_cv);
    free(s);
}

/* ---- the shm data path ---------------------------------------------------------------------- */

/* Its requests are two-sided frames on the control plane's lanes (so the target checks bounds
 * and rights as for TCP); only the bytes take the shortcut. The engine-wide state is e->shm. */
static int path_create(kvb_engine_t *e, kvb_provider_t **out)
{
    *out = (kvb_provider_t *)e->shm;
    return KVB_OK;
}

/* Links to a same-host peer with the one-time tokens its lanes' HELLO_ACKs carried. */
static int path_attach(kvb_provider_t *pv, kvb_peer_t *p, uint64_t deadline)
{
    kvb_shm_link_t *l = NULL;
    int rc = kvb__shm_link_open((kvb_shm_t *)pv, &p->hello,
                                (const uint8_t(*)[KVB_LINK_TOKEN_LEN])p->link_tokens,
                                p->nlink_tokens, deadline, &l);
    if (rc == KVB_OK) {
        p->path_state[KVB_PATH_SHM] = l;
        KVB_INFO("segment %s: same host, data through shared memory%s", p->name,
                 kvb__shm_link_cma(l) ? "" : " (kvb_alloc memory only)");
    }
    return rc;
}

static void path_detach(kvb_peer_t *p)
{
    kvb__shm_link_close(p->path_state[KVB_PATH_SHM]);
    p->path_state[KVB_PATH_SHM] = NULL;
}

/* Host memory on both sides, and ours where the target can reach it (may block once per
 * kvb_alloc allocation, to share it). */
static bool path_reaches(kvb_provider_t *pv, kvb_peer_t *p, const kvb_op_t *op, kvb_span_t *span)
{
    (void)pv;
    if ((op->pin && op->pin->kind != KVB_MEM_CPU) ||
        (op->rregion && op->rregion->kind != KVB_MEM_CPU)) {
        *span = KVB_SPAN_ALL; /* never device memory, wherever it lies */
        return false;
    }
    /* The answer is the local allocation's: all of a shared one holds it. */
    uint64_t base = span->lo, size = span->hi - span->lo;
    bool ok = kvb__shm_link_reaches(p->path_state[KVB_PATH_SHM], (uintptr_t)op->local, op->len,
                                    &base, &size);
    *span = (kvb_span_t){base, base + size};
    return ok;
}

static void path_submit(kvb_provider_t *pv, kvb_peer_t *p, kvb_op_t *ops)
{
    (void)pv; /* op->path tells the control plane to send addresses, not bytes */
    p->engine->tp_ops->submit(p->engine->tp, p, ops);
}

static int path_progress(kvb_batch_t *b, uint64_t deadline)
{
    return b->engine->tp_ops->drive(b, deadline);
}

const kvb_provider_ops_t kvb__shm_provider = {
    .name = "shm",
    .id = KVB_PATH_SHM,
    .remote_region = true,
    .create = path_create,
    .attach = path_attach,
    .detach = path_detach,
    .reaches = path_reaches,
    .submit = path_submit,
    .progress = path_progress,
};
