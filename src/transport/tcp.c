/* SPDX-License-Identifier: Apache-2.0 */
/* TCP transport: one listening port per engine, several persistent connections ("lanes") per
 * peer, epoll progress threads, scatter/gather sends that coalesce many frames into one syscall,
 * payloads received straight into their destination, and READ answers in runs (one header for
 * many requests' bytes, received with one scattering call). Also carries the p2p handshake. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/checked.h"
#include "common/clock.h"
#include "common/log.h"
#include "engine/internal.h"
#include "transport/shm.h"
#include "transport/stage.h"

#define RXBUF_SIZE (64u << 10) /* read-ahead for headers and small payloads */
#define SMALL_RECV (16u << 10) /* payload remainders below this are read through rxbuf */
/* Frames with at least this much payload are received in place, header to header (sink_bytes):
 * one recvmsg and one copy per frame. Below it a syscall per frame costs more than the second
 * copy it saves (interleaved medians against the read-ahead alone: 0.75x at 16 KiB READ when it
 * applied there, 1.02x at 32 KiB, 1.16x at 256 KiB READ, 1.23x for 1 MiB WRITEs), so smaller
 * payloads come through the read-ahead - except that one of SMALL_RECV or more that starts with
 * rxbuf empty is received in place too (a run of 16-32 KiB frames then stays in place). Reading
 * those through the read-ahead as well was tried: no faster in steady state, 2-3x slower in the
 * first pulls over a fresh pool (18 KiB frames, deepseek-v3 over TCP). */
#define DIRECT_RECV (32u << 10)
#define IOV_CAP     512
/* Bytes of an answer run taken per receive call: bounds how long a request ending early waits for
 * a copy into its batch (copies_drain) and how long a request whose bytes are in waits to be
 * ended. Interleaved against no bound (1 MiB READs, deepseek-v3's 18 KiB KV blocks, 64 KiB
 * READs): no difference beyond the noise. */
#define RUN_RECV_MAX (1u << 20)
/* No receive wake threshold (SO_RCVLOWAT): a reader takes what has arrived. One of up to 256 KiB
 * helped where both ends slept between reads (2026-11-24: 1 MiB READ batch 32 +15%), but with the
 * progress threads lingering it only held them back - without it 1 MiB READs moved more in 16 of 22
 * interleaved pairs, 64 KiB READs in 11 of 14, 1 MiB WRITEs in 10 of 22, and llama3-8b KV pulls
 * over TCP came closer to their ceiling in 4 of 4 (docs/performance-notes.md, "The receive wake
 * threshold, again"). */
#define TX_MAX_BYTES (8u << 20) /* bytes offered to one sendmsg */
#define LANE_SPREAD  (1u << 20) /* a submit moves to the next lane after this many bytes */
#define MAX_EVENTS   64
#define MAX_LANES    16 /* connections to one peer (kvb_config_t.lanes is checked against it) */
/* A peer that sends requests faster than it reads the answers is held off: past TXQ_HIGH queued
 * frames we stop reading from it, and resume below TXQ_LOW. Bounds a target's memory per peer. */
#define TXQ_HIGH 8192
#define JOBS_MAX 128 /* same-host copies gathered before they run */
#define TXQ_LOW  1024
#define TICK_MS  250 /* how often a progress thread with connections checks their deadlines */
/* Answers copied into local device memory are waited for once this many bytes of them are queued,
 * or once no more answers are in flight (see conn_read). */
#define DEV_FLUSH_BYTES (2ull << 20)
/* WRITEs from local device memory go to the lanes as soon as this many bytes of them are copied
 * out (see lanes_submit), and a target answers READs of its device memory in chunks of this many
 * bytes (see read_frames). */
#define STAGE_OUT_CHUNK (1ull << 20)

typedef struct tcp_thread tcp_thread_t;
typedef struct tcp_conn tcp_conn_t;

/* One frame waiting to be sent: a header plus an optional payload that stays where it is. */
typedef struct tcp_frame {
    struct tcp_frame *next;
    uint8_t hdr[KVB_WIRE_HDR_SIZE];
    const uint8_t *data;
    uint64_t len;
    kvb_region_t *pin; /* target side: region `data` points into, unpinned once sent */
    void *owned;       /* heap payload (malloc'd or a bounce buffer) released once sent */
    bool nohdr;        /* the next request's bytes in an answer run: no header of its own */
} tcp_frame_t;
/* Adds [base, base+len) to iov[0..*cnt), as part of the last piece when it continues it. */
static void iov_add(struct iovec *iov, int *cnt, const void *base, size_t len)
{
    struct iovec *last = *cnt ? &iov[*cnt - 1] : NULL;
    if (last && (const uint8_t *)last->iov_base + last->iov_len == (const uint8_t *)base)
        last->iov_len += len;
    else
        iov[(*cnt)++] = (struct iovec){(void *)base, len};
}

/* Target side: same-host requests whose copies are owed, and their answers' headers. */
typedef struct {
    kvb_shm_job_t jobs[JOBS_MAX];
    kvb_frame_hdr_t hdr[JOBS_MAX];
    kvb_region_t *pin[JOBS_MAX]; /* held until the copy is done */
    size_t n;
    kvb_shm_set_t run; /* started: the copies are under way */
} job_set_t;

enum { ROLE_INIT, ROLE_TARGET };
/* A target connection's handshake: nothing but HELLO, then nothing but AUTH, is accepted before
 * the initiator has proved it knows the cluster secret. */
enum { AUTH_HELLO, AUTH_PROOF, AUTH_DONE };
enum { RX_HDR, RX_PAYLOAD };
enum { SINK_DRAIN, SINK_OP, SINK_RUN, SINK_REGION, SINK_BUF, SINK_ENTRIES };

struct tcp_conn {
    atomic_uint refs;
    int fd;
    int role;
    tcp_thread_t *th;
    kvb_peer_t *peer;      /* ROLE_INIT: the peer this lane belongs to (ref held) */
    struct tcp_conn *next; /* the owning thread's list */

    kvb_registry_t *registry; /* where pinned regions go back */

    /* The send side, guarded by mu: submitting threads encode their requests and send them
     * inline when the socket is idle; the owner thread finishes what the socket did not take
     * (EPOLLOUT) and sends a target's answers. Requests join the in-flight list in wire order,
     * which is the order their answers come back in. */
    pthread_mutex_t mu;
    bool dead;             /* closed: submissions fail at once */
    atomic_bool close_req; /* someone asked the owner thread to close it (read unlocked) */
    int close_err;
    kvb_op_t *inflight_head, *inflight_tail;
    uint64_t next_id;
    tcp_frame_t *txq_head, *txq_tail;
    /* Written under mu; read without it by the owner's read loop (backpressure), which only needs
     * a recent value. */
    atomic_size_t txq_count;
    uint64_t tx_off; /* bytes of txq_head already sent */
    bool want_out;   /* EPOLLOUT armed */
    bool rx_paused;  /* EPOLLIN disarmed: too many answers queued */
    tcp_frame_t *free_frames;
    /* ROLE_TARGET: the READ answer run that the next READ of host memory may join - its first
     * frame and its last (still the queue's tail), the id it wants next, its size. Ended by any
     * send, since its header goes out with its first bytes. */
    tcp_frame_t *run_head, *run_last;
    uint64_t run_next, run_count, run_total;
    bool driven; /* a waiting thread reads this connection; EPOLLIN is off meanwhile */
    /* When bytes last moved either way (monotonic ns): requests in flight on a connection that
     * stays silent for the peer timeout fail it (a frozen host, a cut link, a stopped process). */
    atomic_ullong last_io;
    bool in_epoll; /* its owner thread has added it: until then events are only recorded */

    /* The receive side: the owner thread's, or a waiting thread's that drives the connection
     * (kvb_batch_wait); rx_mu is held while either reads. */
    pthread_mutex_t rx_mu;
    int auth;          /* ROLE_TARGET: AUTH_* */
    uint64_t conn_id;  /* ROLE_TARGET: names it to kvb_notify_reply (never 0, never reused) */
    uint64_t born_ns;  /* ROLE_TARGET: accepted at; the handshake must end within the deadline */
    bool hello_done;   /* ROLE_TARGET: authenticated, HELLO_ACK queued */
    kvb_hello_t their; /* ROLE_TARGET: the initiator's hello, as sent */
    uint8_t expect[KVB_WIRE_MAC_LEN]; /* ROLE_TARGET: the initiator's proof, once challenged */
    kvb_shm_offer_t *offer;           /* ROLE_TARGET: the same-host link token it was given */
    bool rx_more;     /* read budget ran out with bytes left: read again on the scan */
    uint8_t *scratch; /* where discarded payload bytes go; allocated on first use */
    char from[KVB_NAME_MAX + 1];
    uint64_t their_incarnation;      /* ROLE_TARGET: the initiator's, from its hello */
    kvb_shm_peer_t *shm_peer;        /* ROLE_TARGET: its same-host link (bound through offer) */
    uint8_t ent[KVB_WIRE_SHM_ENTRY]; /* SINK_ENTRIES: a same-host request split across reads */
    /* Same-host copies owed, in arrival order, in sets of up to JOBS_MAX: the set being filled
     * (jsets[jfill]) and at most one started before it, whose copies the pool makes while this
     * thread reads the next requests (see start_jobs). */
    job_set_t jsets[2];
    int jfill;
    uint8_t *rxbuf;
    size_t rx_len, rx_pos;
    int rx_state;
    kvb_frame_hdr_t rx_hdr;
    uint64_t rx_plen, rx_got;
    int rx_sink, rx_status;
    bool local;            /* a Unix socket (same-host lane): no TCP options */
    uint32_t cred_pid;     /* ROLE_TARGET, local: the connecting process, as the kernel says */
    const char *refused;   /* ROLE_TARGET: why the handshake was refused, if not for the secret */
    uint8_t *rx_dst;       /* SINK_REGION / SINK_BUF */
    kvb_region_t *rx_pin;  /* ROLE_TARGET: a WRITE's region, until its payload is in */
    kvb_region_t *rx_hold; /* ROLE_TARGET: the region the last request found, pinned for the
                            * rest of the read pass (target_range) */
    uint8_t *rx_stage;     /* a WRITE to device memory lands here first */
    kvb_op_t *rx_op;       /* SINK_OP */
    uint64_t rx_run;       /* ROLE_INIT: requests the answer run being read still answers */
    uint64_t rx_off;       /* ROLE_INIT, SINK_RUN: bytes of rx_op (the run's current request) in */
    /* Device memory through bounce buffers: copies queued during a read pass, waited for once at
     * its end (or before any answer that must follow them). ROLE_TARGET: requests answered then,
     * in order; ROLE_INIT: READ answers whose bytes go into local device memory. */
    kvb_stage_queue_t *sq;
    struct dev_job {
        kvb_frame_hdr_t hdr;
        kvb_region_t *pin;
        uint8_t *buf; /* the bounce buffer */
        int status;
    } djobs[JOBS_MAX];
    size_t ndjobs;
    uint64_t djob_bytes;             /* the bytes they copy */
    kvb_op_t *dops_head, *dops_tail; /* ROLE_INIT: ops whose copy into the device is queued */
    uint64_t dops_bytes;             /* their bytes */
};

struct tcp_thread {
    kvb_transport_t *tp;
    pthread_t tid;
    int epfd, evfd;
    atomic_bool wake_pending;
    pthread_mutex_t mu;   /* guards incoming */
    tcp_conn_t *incoming; /* new connections handed to this thread */
    tcp_conn_t *conns;    /* owner only */
    bool need_scan;       /* owner only: some conn wants closing */
    uint64_t next_tick;   /* owner only: when to check the connections' deadlines next */
    uint8_t *scratch;     /* owner only: where discarded payload bytes go */
    /* Its connections with EPOLLOUT armed (a full socket): it does not busy-poll while any is,
     * since the peer reading that socket needs the core. Changed under the connection's mu. */
    atomic_int out_armed;
};

struct kvb_transport {
    kvb_engine_t *engine;
    int listen_fd;
    int local_fd;   /* same-host lanes' Unix listener (LANE_SOCK), or -1 */
    int reserve_fd; /* kept open to be given up when accept() hits EMFILE */
    /* Accepted connections by id, for answers on the connection a notification came in on. */
    pthread_mutex_t targets_mu;
    tcp_conn_t **targets;
    size_t ntargets, captargets;
    uint64_t next_conn_id; /* guarded by targets_mu */
    bool listen_paused;    /* thread 0 only: the listeners' EPOLLIN off after an EMFILE it could
                            * not shed */
    atomic_uint nconns;    /* accepted connections open now (cfg.max_connections) */
    uint16_t port;
    int nthreads; /* set before any thread starts: thread_adopt spreads over all of them */
    int nstarted; /* threads running (joined at destroy) */
    tcp_thread_t *threads;
    atomic_uint next_thread;
    atomic_bool stop;
    uint64_t spin_ns; /* how long a progress thread polls after requests before it sleeps:
                       * cfg.linger_us, or cfg.busy_poll_us where longer */
};

typedef struct {
    int nlanes;
    atomic_uint rr;
    tcp_conn_t *lanes[MAX_LANES];
} tcp_peer_t;

static char listen_tag, local_tag, wake_tag; /* epoll data.ptr markers */
static __thread tcp_thread_t *tls_self;      /* the progress thread running this code, if any */

/* ---- connections ---------------------------------------------------------------------------- */

static void conn_release(tcp_conn_t *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    if (c->fd >= 0)
        close(c->fd);
    kvb__shm_offer_drop(c->offer);
    while (c->free_frames) {
        tcp_frame_t *f = c->free_frames;
        c->free_frames = f->next;
        free(f);
    }
    kvb__peer_release(c->peer);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->rx_mu);
    free(c->scratch);
    free(c->rxbuf);
    free(c);
}

static int set_sock_opts(int fd, uint32_t peer_timeout_ms)
{
    /* NODELAY: small control frames must not wait for Nagle; data is already coalesced by us.
     * Keepalive + USER_TIMEOUT: a vanished host (no RST, link cut) is detected within the peer
     * timeout, not hours: unacknowledged data fails after it, and an idle connection is probed
     * after a third of it and given up after two unanswered probes. */
    int one = 1, secs = (int)(peer_timeout_ms / 1000);
    int idle = secs / 3 > 1 ? secs / 3 : 1, intvl = secs / 3 > 1 ? secs / 3 : 1, cnt = 2;
    unsigned user_timeout = peer_timeout_ms;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) ||
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) ||
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) ||
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl) ||
        setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt) ||
        setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout)) {
        KVB_ERROR("setsockopt: %s", strerror(errno));
        return KVB_ERR_SYSTEM;
    }
    return KVB_OK;
}

static tcp_conn_t *conn_new(kvb_transport_t *tp, int fd, int role)
{
    tcp_conn_t *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->rxbuf = malloc(RXBUF_SIZE);
    if (!c->rxbuf) {
        free(c);
        return NULL;
    }
    atomic_init(&c->refs, 1);
    c->fd = fd;
    c->role = role;
    c->registry = &tp->engine->registry;
    c->next_id = 1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->rx_mu, NULL);
    return c;
}

static void thread_wake(tcp_thread_t *th)
{
    if (atomic_exchange(&th->wake_pending, true))
        return;
    uint64_t one = 1;
    if (write(th->evfd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVB_ERROR("eventfd write: %s", strerror(errno));
}

/* Hands a connection (with one reference for the thread) to a progress thread. */
static void thread_adopt(kvb_transport_t *tp, tcp_conn_t *c)
{
    tcp_thread_t *th = &tp->threads[atomic_fetch_add(&tp->next_thread, 1) % (unsigned)tp->nthreads];
    c->th = th;
    pthread_mutex_lock(&th->mu);
    c->next = th->incoming;
    th->incoming = c;
    pthread_mutex_unlock(&th->mu);
    thread_wake(th);
}

/* Asks the owner thread to close c; safe from any thread. */
static void conn_request_close(tcp_conn_t *c, int err)
{
    pthread_mutex_lock(&c->mu);
    bool first = !c->close_req;
    if (first) {
        c->close_req = true;
        c->close_err = err;
    }
    pthread_mutex_unlock(&c->mu);
    if (first && c->th)
        thread_wake(c->th);
}

/* A fatal error on c. */
static void conn_fail(tcp_conn_t *c, int err, const char *what)
{
    if (c->role == ROLE_INIT) {
        /* c->peer goes NULL once the owner thread closed c: take a reference under the lock. */
        pthread_mutex_lock(&c->mu);
        kvb_peer_t *p = c->peer;
        if (p)
            atomic_fetch_add(&p->refs, 1);
        pthread_mutex_unlock(&c->mu);
        if (p && (err == KVB_ERR_PROTOCOL || err == KVB_ERR_VERSION))
            KVB_ERROR("connection to %s: %s", p->name, what);
        if (p)
            kvb__peer_fail(p, err); /* closes every lane of the peer, this one included */
        kvb__peer_release(p);
    } else if (err == KVB_ERR_AUTH) {
        KVB_WARN("connection from %s closed: %s",
                 c->auth == AUTH_DONE ? c->from : "(unauthenticated)", what);
    } else if (err == KVB_ERR_PROTOCOL || err == KVB_ERR_VERSION) {
        KVB_ERROR("connection from %s closed: %s", c->hello_done ? c->from : "(no handshake)",
                  what);
    } else {
        KVB_DEBUG("connection from %s closed: %s", c->hello_done ? c->from : "?", what);
    }
    conn_request_close(c, err);
    if (tls_self && tls_self == c->th)
        c->th->need_scan = true;
}

/* Target side: lets go of the region a read pass held (target_range). */
static void release_hold(tcp_conn_t *c)
{
    if (c->rx_hold)
        kvb__region_unpin(c->registry, c->rx_hold);
    c->rx_hold = NULL;
}

/* Returns a sent (or dropped) frame to c's free list. Caller holds c->mu. */
static void frame_release(tcp_conn_t *c, tcp_frame_t *f)
{
    if (f->pin)
        kvb__region_unpin(c->registry, f->pin);
    kvb__stage_put(f->owned); /* malloc'd, or a bounce buffer */
    f->next = c->free_frames;
    c->free_frames = f;
}

/* Ends an op, giving its bounce buffer back. */
static void op_end(kvb_op_t *op, int status)
{
    kvb__stage_put(op->stage);
    op->stage = NULL;
    kvb__op_done(op, status, status ? 0 : op->len);
}

/* Ends a list of ops (linked by op->next, NULL-terminated) with one status: their bounce buffers
 * given back, then the ops of each batch ended under one hold of its lock (kvb__ops_done). */
static void ops_end(kvb_op_t *ops, int status)
{
    for (kvb_op_t *op = ops; op; op = op->next) {
        kvb__stage_put(op->stage);
        op->stage = NULL;
    }
    kvb__ops_done(ops, status);
}

/* Initiator: the copies into local device memory queued by this read pass are done: end their
 * ops. */
static void flush_dev_ops(tcp_conn_t *c)
{
    if (!c->dops_head)
        return;
    int rc = kvb__stage_wait(c->sq);
    kvb_op_t *ops = c->dops_head;
    c->dops_head = c->dops_tail = NULL;
    c->dops_bytes = 0;
    ops_end(ops, rc);
}

/* Initiator: a READ answer for local device memory is in its bounce buffer; queue the copy into
 * the device (unless the request ended meanwhile: then nothing may be written there) and end the
 * op once it is done. */
static void dev_op_arrived(tcp_conn_t *c, kvb_op_t *op, int status)
{
    if (status == KVB_OK && !op->stage)
        status = KVB_ERR_NOMEM; /* the answer had nowhere to land */
    if (status == KVB_OK) {
        unsigned slot = kvb__batch_copy_begin(op->batch);
        uint8_t *dst = kvb__op_dst_held(op);
        status =
            !dst ? KVB_ERR_CANCELED
                 : kvb__stage_in_async(&c->sq, (uintptr_t)dst, op->stage, op->len, op->pin->device);
        kvb__batch_copy_end(op->batch, slot);
    }
    if (status) {
        op_end(op, status);
        return;
    }
    if (c->dops_tail)
        c->dops_tail->next = op;
    else
        c->dops_head = op;
    c->dops_tail = op;
    c->dops_bytes += op->len;
}

/* Target side: releases the regions a set's requests pinned (their copies are done). */
static void set_unpin(tcp_conn_t *c, job_set_t *js)
{
    for (size_t i = 0; i < js->n; i++)
        if (js->pin[i]) {
            kvb__region_unpin(c->registry, js->pin[i]);
            js->pin[i] = NULL;
        }
}

/* Owner thread: tears c down and ends everything it held. */
static void conn_close(tcp_conn_t *c)
{
    /* First wait out a waiting thread that drives c (kvb_batch_wait): it may be reading from the
     * fd or holding the in-flight op it is filling. rx_mu comes before mu everywhere. */
    pthread_mutex_lock(&c->rx_mu);
    pthread_mutex_lock(&c->mu);
    c->dead = true;
    if (c->want_out && c->th) /* nothing will be sent: no longer holds the thread's busy polling */
        atomic_fetch_sub(&c->th->out_armed, 1);
    c->want_out = false;
    int err = c->close_err ? c->close_err : KVB_ERR_PEER_LOST;
    while (c->txq_head) {
        tcp_frame_t *f = c->txq_head;
        c->txq_head = f->next;
        frame_release(c, f);
    }
    c->txq_tail = NULL;
    c->txq_count = 0;
    c->run_head = c->run_last = NULL;
    kvb_op_t *inflight = c->inflight_head;
    c->inflight_head = c->inflight_tail = NULL;
    pthread_mutex_unlock(&c->mu);

    if (c->fd >= 0) {
        if (c->th)
            epoll_ctl(c->th->epfd, EPOLL_CTL_DEL, c->fd, NULL); /* close() would drop it anyway */
        close(c->fd);
        c->fd = -1;
    }
    if (c->role == ROLE_TARGET && c->th) {
        kvb_transport_t *tp = c->th->tp;
        atomic_fetch_sub(&tp->nconns, 1);
        pthread_mutex_lock(&tp->targets_mu);
        for (size_t i = 0; i < tp->ntargets; i++)
            if (tp->targets[i] == c) {
                tp->targets[i] = tp->targets[--tp->ntargets];
                break;
            }
        pthread_mutex_unlock(&tp->targets_mu);
    }
    c->rx_op = NULL;
    if (c->rx_pin)
        kvb__region_unpin(c->registry, c->rx_pin);
    c->rx_pin = NULL;
    release_hold(c);
    kvb__stage_put(c->rx_stage);
    c->rx_stage = NULL;
    /* Device copies still queued write into bounce buffers and device memory: let them finish
     * before those go. */
    flush_dev_ops(c);
    kvb__stage_queue_free(c->sq);
    c->sq = NULL;
    for (size_t i = 0; i < c->ndjobs; i++) {
        kvb__stage_put(c->djobs[i].buf);
        if (c->djobs[i].pin)
            kvb__region_unpin(c->registry, c->djobs[i].pin);
    }
    c->ndjobs = 0;
    if (c->rx_sink == SINK_BUF)
        free(c->rx_dst);
    for (int k = 0; k < 2; k++) { /* a set started before the connection failed */
        job_set_t *js = &c->jsets[k];
        kvb__shm_abandon(c->th->tp->engine->shm, &js->run); /* copies under way end first */
        set_unpin(c, js);
        js->n = 0;
    }
    kvb__shm_peer_put(c->shm_peer);
    c->shm_peer = NULL;
    c->rx_dst = NULL;
    c->rx_sink = SINK_DRAIN;
    kvb__shm_offer_drop(c->offer);
    c->offer = NULL;
    pthread_mutex_unlock(&c->rx_mu);
    ops_end(inflight, err);
    /* Break the peer <-> lane reference cycle: a closed lane no longer needs its peer. */
    pthread_mutex_lock(&c->mu);
    kvb_peer_t *p = c->peer;
    c->peer = NULL;
    pthread_mutex_unlock(&c->mu);
    kvb__peer_release(p);
}

/* ---- sending -------------------------------------------------------------------------------- */

/* Caller holds c->mu. */
static tcp_frame_t *frame_get(tcp_conn_t *c)
{
    tcp_frame_t *f = c->free_frames;
    if (f) {
        c->free_frames = f->next;
        memset(f, 0, sizeof *f);
        return f;
    }
    return calloc(1, sizeof *f);
}

static void txq_push(tcp_conn_t *c, tcp_frame_t *f)
{
    c->txq_count++;
    f->next = NULL;
    if (c->txq_tail)
        c->txq_tail->next = f;
    else
        c->txq_head = f;
    c->txq_tail = f;
}

/* Appends a frame to the send queue. Caller holds c->mu. */
static int queue_frame_locked(tcp_conn_t *c, const kvb_frame_hdr_t *h, const uint8_t *data,
                              kvb_region_t *pin, void *owned)
{
    tcp_frame_t *f = frame_get(c);
    if (!f) {
        if (pin)
            kvb__region_unpin(c->registry, pin);
        kvb__stage_put(owned);
        return KVB_ERR_NOMEM;
    }
    kvb__wire_encode_hdr(h, f->hdr);
    f->data = data;
    f->len = kvb__wire_payload_len(h);
    f->pin = pin;
    f->owned = owned;
    txq_push(c, f);
    return KVB_OK;
}

static int queue_frame(tcp_conn_t *c, const kvb_frame_hdr_t *h, const uint8_t *data,
                       kvb_region_t *pin, void *owned)
{
    pthread_mutex_lock(&c->mu);
    int rc = queue_frame_locked(c, h, data, pin, owned);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Caller holds c->mu. Returns KVB_OK or KVB_ERR_SYSTEM. */
/* Applies c's wanted events to epoll. Caller holds c->mu. Returns KVB_OK or KVB_ERR_SYSTEM. */
static int apply_events(tcp_conn_t *c)
{
    if (!c->in_epoll)
        return KVB_OK; /* the owner thread adds it with these events */
    struct epoll_event ev = {.events = (c->rx_paused || c->driven ? 0 : EPOLLIN) |
                                       (c->want_out ? EPOLLOUT : 0),
                             .data.ptr = c};
    return epoll_ctl(c->th->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0 ? KVB_OK : KVB_ERR_SYSTEM;
}

/* Caller holds c->mu. Returns KVB_OK or KVB_ERR_SYSTEM. */
static int set_events(tcp_conn_t *c, bool want_out, bool rx_paused)
{
    if (c->want_out == want_out && c->rx_paused == rx_paused)
        return KVB_OK;
    if (c->want_out != want_out && c->th && !c->dead)
        atomic_fetch_add(&c->th->out_armed, want_out ? 1 : -1);
    c->want_out = want_out;
    c->rx_paused = rx_paused;
    return apply_events(c);
}

/* Sends as much of the queue as the socket takes, many frames per sendmsg. Caller holds c->mu.
 * Returns KVB_OK (all sent, or the rest waits for EPOLLOUT) or the error that ends c. */
static int conn_flush_locked(tcp_conn_t *c)
{
    struct iovec iov[IOV_CAP];
    c->run_head = c->run_last = NULL; /* a run's header is final once it may have gone out */
    while (c->txq_head && !c->close_req) {
        int cnt = 0;
        uint64_t bytes = 0, skip = c->tx_off;
        for (tcp_frame_t *f = c->txq_head; f && cnt + 2 <= IOV_CAP && bytes < TX_MAX_BYTES;
             f = f->next) {
            /* Only the head frame can be partly sent: skip its first tx_off bytes. */
            uint64_t hsize = f->nohdr ? 0 : KVB_WIRE_HDR_SIZE;
            uint64_t hskip = skip < hsize ? skip : hsize;
            uint64_t pskip = skip - hskip;
            if (hskip < hsize) {
                iov_add(iov, &cnt, f->hdr + hskip, hsize - hskip);
                bytes += hsize - hskip;
            }
            if (f->len > pskip) { /* adjacent blocks of an answer run go as one piece */
                iov_add(iov, &cnt, f->data + pskip, f->len - pskip);
                bytes += f->len - pskip;
            }
            skip = 0;
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return set_events(c, true, c->rx_paused);
        if (n < 0)
            return KVB_ERR_PEER_LOST;
        atomic_store_explicit(&c->last_io, kvb__now_ns(), memory_order_relaxed);
        for (uint64_t left = (uint64_t)n; left > 0;) {
            tcp_frame_t *f = c->txq_head;
            uint64_t rem = (f->nohdr ? 0 : KVB_WIRE_HDR_SIZE) + f->len - c->tx_off;
            if (left < rem) {
                c->tx_off += left;
                break;
            }
            left -= rem;
            c->tx_off = 0;
            c->txq_head = f->next;
            if (!c->txq_head)
                c->txq_tail = NULL;
            c->txq_count--;
            frame_release(c, f);
        }
        if (c->rx_paused && c->txq_count < TXQ_LOW && !c->close_req) {
            /* Only targets pause, and only their owner thread sends their answers. */
            if (set_events(c, c->want_out, false))
                return KVB_ERR_SYSTEM;
            c->rx_more = true; /* frames may wait in rxbuf with nothing new on the socket */
            c->th->need_scan = true;
        }
    }
    if (!c->txq_head && c->want_out && !c->close_req)
        return set_events(c, false, c->rx_paused);
    return KVB_OK;
}

static void conn_flush(tcp_conn_t *c)
{
    pthread_mutex_lock(&c->mu);
    int rc = c->txq_head ? conn_flush_locked(c) : KVB_OK;
    pthread_mutex_unlock(&c->mu);
    if (rc) /* outside the lock: failing a peer closes (and locks) all of its lanes */
        conn_fail(c, rc, rc == KVB_ERR_SYSTEM ? "epoll_ctl failed" : "send failed");
}

/* Moves op in flight, behind the requests already sent or queued. Caller holds c->mu. */
static void inflight_push(tcp_conn_t *c, kvb_op_t *op)
{
    if (c->inflight_tail) {
        c->inflight_tail->next = op;
    } else {
        c->inflight_head = op;
        /* The silence that counts against the peer starts with its first request. */
        atomic_store_explicit(&c->last_io, kvb__now_ns(), memory_order_relaxed);
    }
    c->inflight_tail = op;
}

/* Queues the same-host ops at *opp of op's kind - up to KVB_WIRE_MAX_RUN of them in a row - as
 * one request run, and moves them in flight; *opp then points past them. Caller holds c->mu.
 * Returns KVB_OK, or KVB_ERR_NOMEM with nothing queued or moved. */
static int queue_shm_run(tcp_conn_t *c, kvb_op_t **opp)
{
    kvb_op_t *first = *opp, *op = first;
    uint64_t n = 0;
    for (; op && op->path == KVB_PATH_SHM && op->kind == first->kind && n < KVB_WIRE_MAX_RUN;
         op = op->next)
        n++;
    uint8_t *buf = malloc(n * KVB_WIRE_SHM_ENTRY);
    if (!buf)
        return KVB_ERR_NOMEM;
    kvb_frame_hdr_t h = {.type =
                             first->kind == KVB_OPK_READ ? KVB_FRAME_READ_REQ : KVB_FRAME_WRITE_REQ,
                         .flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN,
                         .id = c->next_id,
                         .addr = n,
                         .len = n * KVB_WIRE_SHM_ENTRY};
    int rc = queue_frame_locked(c, &h, buf, NULL, buf); /* frees buf on failure */
    if (rc)
        return rc;
    /* The target copies the data itself: each entry names our address for it. */
    op = first;
    for (uint64_t k = 0; k < n; k++) {
        kvb_op_t *next = op->next;
        kvb_shm_entry_t e = {.remote = op->remote,
                             .len = op->len,
                             .local = (uintptr_t)op->local,
                             .deadline = op->batch->deadline};
        kvb__wire_shm_entry_encode(&e, buf + k * KVB_WIRE_SHM_ENTRY);
        op->wire_id = c->next_id++;
        op->next = NULL;
        inflight_push(c, op);
        op = next;
    }
    *opp = op;
    return KVB_OK;
}

/* Queues one request that is not same-host as a frame of its own. Caller holds c->mu. */
static int queue_request(tcp_conn_t *c, kvb_op_t *op)
{
    static const uint8_t type_of[] = {KVB_FRAME_READ_REQ, KVB_FRAME_WRITE_REQ, KVB_FRAME_NOTIFY};
    op->wire_id = c->next_id++;
    kvb_frame_hdr_t h = {.type = type_of[op->kind],
                         .flags = kvb__op_lane_read(op) ? KVB_FRAME_F_RUN : 0,
                         .id = op->wire_id,
                         .addr = op->remote,
                         .len = op->len};
    const uint8_t *payload = op->stage ? op->stage : op->local;
    return queue_frame_locked(c, &h, op->kind == KVB_OPK_READ ? NULL : payload, NULL, NULL);
}

/* Encodes ops (linked through op->next) as request frames behind what is queued and moves them
 * in flight, in order. Caller holds c->mu. Ops that cannot be queued end in *failed (a same-host
 * run without memory for its frame: its first op, the rest try again). */
static void queue_ops_locked(tcp_conn_t *c, kvb_op_t *op, kvb_op_t **failed)
{
    while (op) {
        if (op->path == KVB_PATH_SHM && queue_shm_run(c, &op) == KVB_OK)
            continue;
        kvb_op_t *next = op->next;
        op->next = NULL;
        if (op->path == KVB_PATH_SHM || queue_request(c, op) != KVB_OK) {
            op->next = *failed;
            *failed = op;
        } else {
            inflight_push(c, op);
        }
        op = next;
    }
}

/* ---- receiving ------------------------------------------------------------------------------ */

static void flush_jobs(tcp_conn_t *c);

/* Target side: checks a requested range against the registry and pins its region. The lanes
 * reach device memory through bounce buffers; same-host copies reach host memory only. */
static int check_range(kvb_registry_t *reg, uint64_t addr, uint64_t len, unsigned access, bool shm,
                       kvb_region_t **pin)
{
    int st = kvb__registry_check(reg, addr, len, access, KVB_ERR_REMOTE_NOT_REGISTERED, pin);
    if (st == KVB_OK && (*pin)->kind != KVB_MEM_CPU && (shm || !kvb__stage_can((*pin)->kind))) {
        kvb__region_unpin(reg, *pin);
        *pin = NULL;
        st = shm ? KVB_ERR_SHM_COPY : KVB_ERR_REMOTE_DEVICE;
    }
    return st;
}

/* Target side: checks a request's range and pins its region (check_range; shm: a same-host
 * request). A read pass's requests mostly fall in one region: the connection keeps a pin of its
 * own on the region the last one found (c->rx_hold, until the pass ends: release_hold), so the
 * next is pinned again without the registry's lock and search - unless that region is going, lacks
 * the rights asked, or is device memory that a same-host copy cannot reach. */
static int target_range(tcp_conn_t *c, uint64_t addr, uint64_t len, unsigned access, bool shm,
                        kvb_region_t **pin)
{
    if (c->rx_hold && (!shm || c->rx_hold->kind == KVB_MEM_CPU) &&
        kvb__region_repin(c->rx_hold, addr, len, access)) {
        *pin = c->rx_hold;
        return KVB_OK;
    }
    int st = check_range(c->registry, addr, len, access, shm, pin);
    if (st == KVB_OK) {
        release_hold(c);
        c->rx_hold = kvb__region_repin(*pin, addr, len, access) ? *pin : NULL;
    }
    return st;
}

/* Target side: the device copies owed are done - answer their requests, in order. */
static void flush_dev_jobs(tcp_conn_t *c)
{
    if (c->ndjobs == 0)
        return;
    int rc = kvb__stage_wait(c->sq) ? KVB_ERR_REMOTE_DEVICE : KVB_OK;
    for (size_t i = 0; i < c->ndjobs; i++) {
        struct dev_job *j = &c->djobs[i];
        int st = j->status ? j->status : rc;
        bool read = j->hdr.type == KVB_FRAME_READ_REQ;
        kvb_frame_hdr_t r = {.type = read ? KVB_FRAME_READ_RESP : KVB_FRAME_WRITE_ACK,
                             .status = st,
                             .id = j->hdr.id,
                             .len = st ? 0 : j->hdr.len};
        int qrc;
        if (read && st == KVB_OK) { /* the answer's payload is the bounce buffer, sent later */
            qrc = queue_frame(c, &r, j->buf, j->pin, j->buf);
        } else {
            kvb__stage_put(j->buf);
            if (j->pin)
                kvb__region_unpin(c->registry, j->pin);
            qrc = queue_frame(c, &r, NULL, NULL, NULL);
        }
        j->buf = NULL;
        j->pin = NULL;
        if (qrc != KVB_OK)
            conn_fail(c, KVB_ERR_NOMEM, "out of memory for an answer");
    }
    c->ndjobs = 0;
    c->djob_bytes = 0;
}

/* Target side: a device copy is queued for request h (its buffer and pin now the job's). */
static void add_dev_job(tcp_conn_t *c, const kvb_frame_hdr_t *h, kvb_region_t *pin, uint8_t *buf,
                        int status)
{
    c->djobs[c->ndjobs++] = (struct dev_job){.hdr = *h, .pin = pin, .buf = buf, .status = status};
    c->djob_bytes += h->len;
    if (c->ndjobs == JOBS_MAX)
        flush_dev_jobs(c);
}

/* Target side: a READ of device memory: its bytes are copied out into a bounce buffer, and the
 * answer goes once the copy is done. */
static int answer_staged_read(tcp_conn_t *c, const kvb_frame_hdr_t *h, kvb_region_t *pin)
{
    uint8_t *buf = kvb__stage_get(h->len);
    int st = buf ? kvb__stage_out_async(&c->sq, buf, h->addr, h->len, pin->device) : KVB_ERR_NOMEM;
    if (st && st != KVB_ERR_NOMEM)
        st = KVB_ERR_REMOTE_DEVICE;
    add_dev_job(c, h, pin, buf, st);
    return KVB_OK;
}

/* Target side: answers a READ of host memory, or its failure, straight from the region. A success
 * that asked for a run and follows the id of the run at the queue's tail joins it: its bytes go
 * behind the run's and the run's header counts them, so the initiator takes many small answers
 * in one receive and the target sends one header for them. */
static int answer_read(tcp_conn_t *c, const kvb_frame_hdr_t *h, int st, kvb_region_t *pin)
{
    const uint8_t *data = (const uint8_t *)(uintptr_t)h->addr;
    kvb_frame_hdr_t r = {
        .type = KVB_FRAME_READ_RESP, .status = st, .id = h->id, .len = st ? 0 : h->len};
    bool runs = st == KVB_OK && (h->flags & KVB_FRAME_F_RUN);
    int rc = KVB_OK;
    pthread_mutex_lock(&c->mu);
    if (runs && c->run_head && c->txq_tail == c->run_last && h->id == c->run_next &&
        c->run_count < KVB_WIRE_MAX_RUN && h->len <= KVB_WIRE_MAX_DATA - c->run_total) {
        tcp_frame_t *f = frame_get(c);
        if (f) {
            f->nohdr = true;
            f->data = data;
            f->len = h->len;
            f->pin = pin;
            txq_push(c, f);
            c->run_last = f;
            c->run_next++;
            c->run_count++;
            c->run_total += h->len;
            r = (kvb_frame_hdr_t){.type = KVB_FRAME_READ_RESP,
                                  .flags = KVB_FRAME_F_RUN,
                                  .id = h->id - (c->run_count - 1),
                                  .addr = c->run_count,
                                  .len = c->run_total};
            kvb__wire_encode_hdr(&r, c->run_head->hdr);
        } else {
            kvb__region_unpin(c->registry, pin);
            rc = KVB_ERR_NOMEM;
        }
    } else {
        rc = queue_frame_locked(c, &r, st ? NULL : data, pin, NULL);
        bool start = rc == KVB_OK && runs;
        c->run_head = c->run_last = start ? c->txq_tail : NULL;
        c->run_next = h->id + 1;
        c->run_count = 1;
        c->run_total = h->len;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Target side: a request header arrived; decide where its payload goes and what to answer. */
static int target_on_header(tcp_conn_t *c, const kvb_frame_hdr_t *h)
{
    if (c->auth != AUTH_DONE) {
        /* Before the proof only the handshake's own frames: no region, data or notification. */
        int want = c->auth == AUTH_HELLO ? KVB_FRAME_HELLO : KVB_FRAME_AUTH;
        if (h->type == KVB_FRAME_ERROR)
            return h->status == KVB_ERR_AUTH ? KVB_ERR_AUTH : KVB_ERR_PROTOCOL;
        if (h->type != want || h->len == 0)
            return KVB_ERR_AUTH;
        c->rx_dst = malloc(h->len);
        if (!c->rx_dst)
            return KVB_ERR_NOMEM;
        c->rx_sink = SINK_BUF;
        return KVB_OK;
    }
    bool shm = h->flags & KVB_FRAME_F_SHM;
    if (shm && h->type != KVB_FRAME_READ_REQ && h->type != KVB_FRAME_WRITE_REQ)
        return KVB_ERR_PROTOCOL; /* a same-host answer run: initiators get those, not targets */
    unsigned access = h->type == KVB_FRAME_READ_REQ ? KVB_ACCESS_READ : KVB_ACCESS_WRITE;
    if (!shm)
        flush_jobs(c); /* this frame's answer must follow the copies owed before it */
    if (shm || (h->type != KVB_FRAME_READ_REQ && h->type != KVB_FRAME_WRITE_REQ))
        flush_dev_jobs(c); /* likewise (requests on host memory flush below, once known) */
    if (shm) { /* a request run: each request is owed as its entry comes in (sink_entries) */
        c->rx_sink = SINK_ENTRIES;
        return KVB_OK;
    }
    switch (h->type) {
    case KVB_FRAME_NOTIFY:
        c->rx_dst = malloc(h->len ? h->len : 1);
        if (!c->rx_dst)
            return KVB_ERR_NOMEM;
        c->rx_sink = SINK_BUF;
        return KVB_OK;
    case KVB_FRAME_READ_REQ: { /* answered right away, straight from the region */
        kvb_region_t *pin = NULL;
        int st = target_range(c, h->addr, h->len, access, false, &pin);
        if (st == KVB_OK && pin->kind != KVB_MEM_CPU)
            return answer_staged_read(c, h, pin);
        flush_dev_jobs(c);
        return answer_read(c, h, st, pin);
    }
    case KVB_FRAME_WRITE_REQ:
        c->rx_status = target_range(c, h->addr, h->len, access, false, &c->rx_pin);
        c->rx_sink = c->rx_status ? SINK_DRAIN : SINK_REGION;
        c->rx_dst = c->rx_status ? NULL : (uint8_t *)(uintptr_t)h->addr;
        if (c->rx_dst && c->rx_pin->kind != KVB_MEM_CPU) { /* device memory: bounce it */
            c->rx_stage = kvb__stage_get(h->len);
            c->rx_dst = c->rx_stage;
            if (!c->rx_stage) {
                c->rx_status = KVB_ERR_NOMEM;
                c->rx_sink = SINK_DRAIN;
            }
        } else {
            flush_dev_jobs(c);
        }
        return KVB_OK;
    default:
        return KVB_ERR_PROTOCOL;
    }
}

/* The initiator's HELLO is in: answer with our hello (a fresh nonce) and our proof, and keep the
 * proof we expect back. */
static int send_challenge(tcp_conn_t *c, const uint8_t *body, size_t len)
{
    kvb_engine_t *e = c->th->tp->engine;
    int rc = kvb__wire_hello_decode(body, len, &c->their);
    if (rc)
        return rc;
    /* A same-host lane is the process the kernel says it is, on this host: a hello that names
     * another would have its same-host token checked against the wrong process. */
    if (c->local && (c->their.pid != c->cred_pid || !kvb__same_host(e, &c->their))) {
        c->refused = "its hello names another process than the one connected";
        return KVB_ERR_AUTH;
    }
    kvb_hello_t me = e->hello;
    me.lane = c->their.lane;
    uint8_t *buf = malloc(kvb__wire_hello_size(&me) + KVB_WIRE_MAC_LEN);
    if (!buf)
        return KVB_ERR_NOMEM;
    size_t hl = 0;
    if ((rc = kvb__random(me.nonce, sizeof me.nonce)) == KVB_OK)
        hl = kvb__wire_hello_encode(&me, buf);
    if (rc == KVB_OK)
        rc =
            kvb__wire_auth_mac(e->secret, e->secret_len, KVB_AUTH_TARGET, &c->their, &me, buf + hl);
    if (rc == KVB_OK)
        rc = kvb__wire_auth_mac(e->secret, e->secret_len, KVB_AUTH_INITIATOR, &c->their, &me,
                                c->expect);
    if (rc) {
        free(buf);
        return rc;
    }
    c->auth = AUTH_PROOF;
    kvb_frame_hdr_t h = {.type = KVB_FRAME_CHALLENGE, .len = hl + KVB_WIRE_MAC_LEN};
    return queue_frame(c, &h, buf, NULL, buf);
}

/* Tells an initiator that failed authentication why, before closing: one small frame behind the
 * challenge, sent now if the socket takes them (best effort: the connection closes either way). */
static void send_auth_error(tcp_conn_t *c)
{
    uint8_t hdr[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t h = {.type = KVB_FRAME_ERROR, .status = KVB_ERR_AUTH};
    kvb__wire_encode_hdr(&h, hdr);
    pthread_mutex_lock(&c->mu);
    if (c->txq_head && c->fd >= 0) /* the challenge, if it is still queued */
        (void)conn_flush_locked(c);
    if (!c->txq_head && c->fd >= 0 && send(c->fd, hdr, sizeof hdr, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        KVB_DEBUG("auth error frame not sent: %s", strerror(errno));
    pthread_mutex_unlock(&c->mu);
}

static int send_hello_ack(tcp_conn_t *c)
{
    kvb_engine_t *e = c->th->tp->engine;
    const kvb_hello_t *their = &c->their;
    kvb_region_desc_t *regions;
    size_t n, len, alen;
    uint8_t *buf, *attrs;
    kvb_hello_t me = e->hello;
    me.lane = their->lane;
    /* A same-host initiator gets a one-time token that binds its link to this connection. */
    int rc = KVB_OK;
    if (kvb__same_host(e, their))
        rc = kvb__shm_offer(e->shm, their->pid, me.nonce, &c->offer);
    if (rc || (rc = kvb__registry_list(&e->registry, &regions, &n)))
        return rc;
    rc = kvb__wire_hello_ack_encode(&me, regions, n, &buf, &len);
    free(regions);
    kvb__wipe(me.nonce, sizeof me.nonce);
    if (rc)
        return rc;
    snprintf(c->from, sizeof c->from, "%s", their->name);
    c->their_incarnation = their->incarnation;
    c->hello_done = true;
    kvb_frame_hdr_t h = {.type = KVB_FRAME_HELLO_ACK, .len = len};
    rc = queue_frame(c, &h, buf, NULL, buf);
    if (rc || their->lane != 0)
        return rc;
    /* Lane 0 also learns what we publish with the segment. */
    if ((rc = kvb__engine_attrs_encode(e, &attrs, &alen)))
        return rc;
    h = (kvb_frame_hdr_t){.type = KVB_FRAME_ATTRS, .len = alen};
    return queue_frame(c, &h, attrs, NULL, attrs);
}

/* Target side: waits for a started set's copies (copying too), then queues its answers in
 * order and releases its pins. */
static void answer_set(tcp_conn_t *c, job_set_t *js)
{
    if (js->n == 0)
        return;
    kvb__shm_finish(c->th->tp->engine->shm, &js->run);
    set_unpin(c, js);
    /* Successes answer in runs: consecutive ids of one type (an initiator numbers its requests
     * in order, so a batch's copies make one run); a failure answers alone. */
    for (size_t i = 0, k; i < js->n; i = k) {
        const kvb_frame_hdr_t *h = &js->hdr[i];
        int st = js->jobs[i].status;
        uint64_t total = h->len;
        for (k = i + 1; st == KVB_OK && k < js->n && js->jobs[k].status == KVB_OK &&
                        js->hdr[k].type == h->type && js->hdr[k].id == h->id + (k - i);
             k++)
            total += js->hdr[k].len;
        kvb_frame_hdr_t r = {.type = h->type == KVB_FRAME_READ_REQ ? KVB_FRAME_READ_RESP
                                                                   : KVB_FRAME_WRITE_ACK,
                             .flags = KVB_FRAME_F_SHM | (st ? 0 : KVB_FRAME_F_RUN),
                             .status = st,
                             .id = h->id,
                             .addr = st ? 0 : k - i,
                             .len = total};
        if (st)
            r.len = 0;
        if (queue_frame(c, &r, NULL, NULL, NULL) != KVB_OK)
            conn_fail(c, KVB_ERR_NOMEM, "out of memory for an answer");
    }
    js->n = 0;
}

/* Target side: hands the set being filled to the copy pool, then finishes and answers the set
 * started before it, and fills the other set next. The pool thus copies one set while this
 * thread answers the one before and reads the requests of the next: with the sets run one after
 * the other, the pool sat idle while each set's requests were read (about a tenth of a
 * same-host KV pull, see docs/performance-notes.md, "Same-host KV pulls"). */
static void start_jobs(tcp_conn_t *c)
{
    job_set_t *js = &c->jsets[c->jfill];
    if (js->n == 0)
        return;
    if (c->shm_peer) /* else every job already carries its error */
        kvb__shm_start(c->th->tp->engine->shm, c->shm_peer, js->jobs, js->n, &js->run);
    answer_set(c, &c->jsets[!c->jfill]);
    c->jfill = !c->jfill;
}

/* Target side: runs every same-host copy owed and queues their answers, in order. */
static void flush_jobs(tcp_conn_t *c)
{
    start_jobs(c);
    answer_set(c, &c->jsets[!c->jfill]);
}

/* Target side: request `k` of the same-host request run being read has come in (`ent`); owe
 * its copy (its region pinned by target_range, mostly without a lookup). */
static int owe_shm(tcp_conn_t *c, const uint8_t *ent, uint64_t k)
{
    const kvb_frame_hdr_t *run = &c->rx_hdr;
    kvb_shm_entry_t e;
    if (kvb__wire_shm_entry_decode(ent, &e))
        return KVB_ERR_PROTOCOL;
    bool read = run->type == KVB_FRAME_READ_REQ;
    unsigned access = read ? KVB_ACCESS_READ : KVB_ACCESS_WRITE;
    kvb_region_t *pin = NULL;
    int st = target_range(c, e.remote, e.len, access, true, &pin);
    if (st == KVB_OK && !c->shm_peer)
        c->shm_peer = kvb__shm_offer_peer(c->offer);
    if (st == KVB_OK && !c->shm_peer)
        st = KVB_ERR_SHM_COPY; /* no same-host link bound to this connection */
    if (c->jsets[c->jfill].n == JOBS_MAX)
        start_jobs(c);
    job_set_t *js = &c->jsets[c->jfill];
    size_t i = js->n++;
    js->jobs[i] = (kvb_shm_job_t){.to_peer = read,
                                  .theirs = e.local,
                                  .mine = (uint8_t *)(uintptr_t)e.remote,
                                  .len = e.len,
                                  .mine_span = pin ? pin->len : 0,
                                  .deadline = e.deadline,
                                  .status = st};
    js->hdr[i] = (kvb_frame_hdr_t){.type = run->type,
                                   .flags = KVB_FRAME_F_SHM,
                                   .id = run->id + k,
                                   .addr = e.remote,
                                   .len = e.len};
    js->pin[i] = pin;
    return KVB_OK;
}

/* Target side: a request's payload is complete (or it had none). */
static int target_on_frame(tcp_conn_t *c, const kvb_frame_hdr_t *h)
{
    kvb_engine_t *e = c->th->tp->engine;
    if (h->flags & KVB_FRAME_F_SHM) /* a request run: every request is owed (owe_shm) */
        return KVB_OK;
    switch (h->type) {
    case KVB_FRAME_HELLO: {
        int rc = send_challenge(c, c->rx_dst, h->len);
        free(c->rx_dst);
        c->rx_dst = NULL;
        return rc;
    }
    case KVB_FRAME_AUTH: {
        bool ok = kvb__ct_equal(c->rx_dst, c->expect, KVB_WIRE_MAC_LEN);
        free(c->rx_dst);
        c->rx_dst = NULL;
        kvb__wipe(c->expect, sizeof c->expect);
        if (!ok) {
            send_auth_error(c);
            return KVB_ERR_AUTH;
        }
        c->auth = AUTH_DONE;
        KVB_DEBUG("connection from %s (lane %u) authenticated", c->their.name, c->their.lane);
        return send_hello_ack(c);
    }
    case KVB_FRAME_WRITE_REQ: {
        if (!c->rx_stage)
            flush_dev_jobs(c); /* its answer follows theirs */
        if (c->rx_stage) {     /* the payload is in its bounce buffer: into the device with it */
            int st = c->rx_status;
            if (st == KVB_OK &&
                kvb__stage_in_async(&c->sq, h->addr, c->rx_stage, h->len, c->rx_pin->device))
                st = KVB_ERR_REMOTE_DEVICE;
            add_dev_job(c, h, c->rx_pin, c->rx_stage, st); /* acknowledged once it is done */
            c->rx_stage = NULL;
            c->rx_pin = NULL;
            return KVB_OK;
        }
        if (c->rx_pin)
            kvb__region_unpin(&e->registry, c->rx_pin);
        c->rx_pin = NULL;
        kvb_frame_hdr_t r = {.type = KVB_FRAME_WRITE_ACK,
                             .status = c->rx_status,
                             .id = h->id,
                             .len = c->rx_status ? 0 : h->len};
        return queue_frame(c, &r, NULL, NULL, NULL);
    }
    case KVB_FRAME_NOTIFY: {
        int st = kvb__notify_deliver(e, c->from, c->rx_dst, h->len, c->conn_id);
        free(c->rx_dst);
        c->rx_dst = NULL;
        kvb_frame_hdr_t r = {.type = KVB_FRAME_NOTIFY_ACK, .status = st, .id = h->id};
        return queue_frame(c, &r, NULL, NULL, NULL);
    }
    default:
        return KVB_OK; /* READ_REQ was answered at its header */
    }
}

/* Initiator side: an answer run (KVB_FRAME_F_RUN) must name the next `addr` requests in flight
 * exactly - their ids, all of its type and path (same-host requests, or READs that asked for a
 * run), their total length - checked before any of them ends. */
static int check_run(tcp_conn_t *c, const kvb_frame_hdr_t *h)
{
    bool shm = h->flags & KVB_FRAME_F_SHM;
    int want = h->type == KVB_FRAME_READ_RESP ? KVB_OPK_READ : KVB_OPK_WRITE;
    uint64_t total = 0, k = 0;
    pthread_mutex_lock(&c->mu); /* submitters append behind the tail meanwhile */
    kvb_op_t *first = c->inflight_head;
    for (kvb_op_t *op = first; op && k < h->addr; op = op->next, k++) {
        if (op->wire_id != h->id + k || (int)op->kind != want ||
            (shm ? op->path != KVB_PATH_SHM : !kvb__op_lane_read(op)) ||
            kvb__add_u64(total, op->len, &total))
            break;
    }
    pthread_mutex_unlock(&c->mu);
    if (k != h->addr || total != h->len)
        return KVB_ERR_PROTOCOL;
    c->rx_run = h->addr;
    if (shm) {
        c->rx_sink = SINK_DRAIN; /* nothing follows the header */
        return KVB_OK;
    }
    c->rx_op = first; /* stays valid: only this thread retires in-flight ops */
    c->rx_off = 0;
    c->rx_sink = SINK_RUN;
    return KVB_OK;
}

/* Initiator side: a response header arrived; it must answer the oldest request in flight. */
static int init_on_header(tcp_conn_t *c, const kvb_frame_hdr_t *h)
{
    static const uint8_t resp_of[] = {KVB_FRAME_READ_RESP, KVB_FRAME_WRITE_ACK,
                                      KVB_FRAME_NOTIFY_ACK};
    if (h->type == KVB_FRAME_ERROR)
        return kvb__wire_error_status(h->status);
    if (h->type == KVB_FRAME_NOTIFY) { /* a kvb_notify_reply from the target */
        c->rx_dst = malloc(h->len ? h->len : 1);
        if (!c->rx_dst)
            return KVB_ERR_NOMEM;
        c->rx_sink = SINK_BUF;
        return KVB_OK;
    }
    if (h->flags & KVB_FRAME_F_RUN)
        return check_run(c, h);
    pthread_mutex_lock(&c->mu);
    kvb_op_t *op = c->inflight_head; /* stays valid: only this thread retires in-flight ops */
    pthread_mutex_unlock(&c->mu);
    if (!op || h->id != op->wire_id || h->type != resp_of[op->kind] ||
        ((h->flags & KVB_FRAME_F_SHM) != 0) != (op->path == KVB_PATH_SHM))
        return KVB_ERR_PROTOCOL;
    if (h->type == KVB_FRAME_READ_RESP && h->status == 0 && h->len != op->len)
        return KVB_ERR_PROTOCOL;
    /* Targets only answer per-request errors - and TIMEOUT for a same-host copy that was not
     * started by its deadline. */
    if (h->status != 0 && !(h->status <= -200 && h->status > -300) &&
        h->status != KVB_ERR_TOO_LARGE && h->status != KVB_ERR_NOMEM &&
        !(h->status == KVB_ERR_TIMEOUT && (h->flags & KVB_FRAME_F_SHM)))
        return KVB_ERR_PROTOCOL;
    if (h->type == KVB_FRAME_READ_RESP && h->status == 0 && op->pin && op->pin->kind != KVB_MEM_CPU)
        op->stage = kvb__stage_get(op->len); /* NULL: the payload is dropped, the op fails */
    c->rx_op = op;
    c->rx_sink = SINK_OP;
    return KVB_OK;
}

/* Initiator: the `done` requests at the head of the in-flight list were answered (an answer run
 * checked by check_run, or the part of one whose bytes are all in): end them. */
static void end_run_ops(tcp_conn_t *c, uint64_t done)
{
    pthread_mutex_lock(&c->mu);
    kvb_op_t *first = c->inflight_head, *last = first;
    for (uint64_t k = 1; k < done; k++)
        last = last->next;
    c->inflight_head = last->next;
    if (!c->inflight_head)
        c->inflight_tail = NULL;
    pthread_mutex_unlock(&c->mu);
    last->next = NULL;
    ops_end(first, KVB_OK);
}

static void init_on_frame(tcp_conn_t *c, const kvb_frame_hdr_t *h)
{
    if (h->type == KVB_FRAME_NOTIFY) {
        /* From the peer we authenticated: its proven name, and no connection to answer on. */
        kvb_peer_t *p = c->peer;
        if (p)
            kvb__notify_deliver(p->engine, p->hello.name, c->rx_dst, h->len, 0);
        free(c->rx_dst);
        c->rx_dst = NULL;
        c->rx_sink = SINK_DRAIN;
        return;
    }
    if (h->flags & KVB_FRAME_F_RUN) {
        if (h->flags & KVB_FRAME_F_SHM) /* checked whole by check_run; nothing followed */
            end_run_ops(c, c->rx_run);
        /* else sink_run ended the requests as their bytes came in */
        c->rx_run = 0;
        c->rx_op = NULL;
        return;
    }
    pthread_mutex_lock(&c->mu);
    kvb_op_t *op = c->inflight_head;
    c->inflight_head = op->next;
    if (!c->inflight_head)
        c->inflight_tail = NULL;
    pthread_mutex_unlock(&c->mu);
    op->next = NULL;
    c->rx_op = NULL;
    if (op->kind == KVB_OPK_READ && op->pin && op->pin->kind != KVB_MEM_CPU)
        dev_op_arrived(c, op, h->status);
    else
        op_end(op, h->status);
}

/* Moves up to `n` payload bytes from src (or the socket, when src is NULL) into the current
 * sink. Returns bytes consumed, 0 on EAGAIN, or a negative status. Reading from the socket, the
 * payload lands in place and the next frame's header, if it is already there, lands in the empty
 * rxbuf in the same recvmsg: a run of large frames then takes one syscall and one copy per frame
 * (a plain read-ahead into rxbuf would pull the next payload through rxbuf, a second copy). */
static ssize_t sink_run(tcp_conn_t *c, const uint8_t *src, size_t n);

/* Target, SINK_ENTRIES: n bytes of a same-host request run's payload, always from rxbuf (see
 * read_frames): owes each request whose entry is complete. Returns n, or the error that ends c. */
static ssize_t sink_entries(tcp_conn_t *c, const uint8_t *src, size_t n)
{
    size_t at = (size_t)(c->rx_got % KVB_WIRE_SHM_ENTRY), used = 0;
    uint64_t k = c->rx_got / KVB_WIRE_SHM_ENTRY;
    while (used < n) {
        const uint8_t *ent = src + used;
        size_t take = KVB_WIRE_SHM_ENTRY - at;
        if (at > 0 || n - used < take) { /* an entry split across reads */
            take = take < n - used ? take : n - used;
            memcpy(c->ent + at, src + used, take);
            ent = c->ent;
            at += take;
            used += take;
            if (at < KVB_WIRE_SHM_ENTRY)
                break;
        } else {
            used += take;
        }
        at = 0;
        int rc = owe_shm(c, ent, k++);
        if (rc)
            return rc;
    }
    return (ssize_t)n;
}

static ssize_t sink_bytes(tcp_conn_t *c, const uint8_t *src, size_t n)
{
    if (c->rx_sink == SINK_RUN)
        return sink_run(c, src, n);
    if (c->rx_sink == SINK_ENTRIES)
        return sink_entries(c, src, n);
    uint8_t *dst = NULL;
    kvb_batch_t *copying = NULL; /* a copy into the caller's memory under way (its slot) */
    unsigned slot = 0;
    bool staged = c->rx_sink == SINK_OP && c->rx_op->pin && c->rx_op->pin->kind != KVB_MEM_CPU;
    if (c->rx_sink == SINK_OP && c->rx_hdr.type == KVB_FRAME_READ_RESP && staged) {
        dst = c->rx_op->stage ? c->rx_op->stage + c->rx_got : NULL; /* ours until the op ends */
    } else if (c->rx_sink == SINK_OP && c->rx_hdr.type == KVB_FRAME_READ_RESP) {
        copying = c->rx_op->batch;
        slot = kvb__batch_copy_begin(copying);
        dst = kvb__op_dst_held(c->rx_op);
        if (dst)
            dst += c->rx_got;
    } else if (c->rx_sink == SINK_REGION || c->rx_sink == SINK_BUF) {
        dst = c->rx_dst + c->rx_got;
    }
    ssize_t got;
    if (!dst) { /* discard: the request ended meanwhile, or the target refused it */
        if (n > RXBUF_SIZE)
            n = RXBUF_SIZE;
        if (!c->scratch && !(c->scratch = malloc(RXBUF_SIZE)))
            return KVB_ERR_NOMEM;
        dst = c->scratch;
    }
    if (src) {
        memcpy(dst, src, n);
        got = (ssize_t)n;
    } else {
        struct iovec iov[2] = {{.iov_base = dst, .iov_len = n},
                               {.iov_base = c->rxbuf, .iov_len = KVB_WIRE_HDR_SIZE}};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = c->rx_pos == c->rx_len ? 2 : 1};
        if (m.msg_iovlen == 2)
            c->rx_pos = c->rx_len = 0;
        got = recvmsg(c->fd, &m, MSG_DONTWAIT);
        if (got > 0)
            atomic_store_explicit(&c->last_io, kvb__now_ns(), memory_order_relaxed);
        if (got > (ssize_t)n) { /* the next header came along */
            c->rx_len = (size_t)got - n;
            got = (ssize_t)n;
        }
    }
    if (copying)
        kvb__batch_copy_end(copying, slot);
    if (got < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : KVB_ERR_PEER_LOST;
    if (got == 0)
        return KVB_ERR_PEER_LOST;
    return got;
}

/* Initiator, SINK_RUN: moves up to n bytes (at most RUN_RECV_MAX) of an answer run into its
 * requests' destinations - from src, or from the socket in one scattering recvmsg - and ends
 * every request whose bytes are all in. One call covers the requests of one batch, as one copy
 * into it (kvb__batch_copy_begin: a request that ends meanwhile waits for it, and threads on
 * other lanes copy into the same batch at once); a request that ended already (canceled, its
 * batch freed) has its bytes dropped. Returns as sink_bytes. */
static ssize_t sink_run(tcp_conn_t *c, const uint8_t *src, size_t n)
{
    struct iovec iov[IOV_CAP + 1];
    if (!c->scratch && !(c->scratch = malloc(RXBUF_SIZE)))
        return KVB_ERR_NOMEM;
    kvb_op_t *op = c->rx_op;
    kvb_batch_t *b = op->batch;
    size_t cnt = 0, want = 0;
    uint64_t off = c->rx_off;
    size_t rest = n;
    if (n > RUN_RECV_MAX)
        n = RUN_RECV_MAX;
    unsigned slot = kvb__batch_copy_begin(b);
    for (uint64_t k = 0; k < c->rx_run && want < n && cnt < IOV_CAP; k++, off = 0) {
        if (k > 0 && (op = op->next)->batch != b)
            break;
        uint64_t seg = op->len - off;
        if (seg > n - want)
            seg = n - want;
        uint8_t *dst = kvb__op_dst_held(op);
        if (!dst && seg > RXBUF_SIZE)
            seg = RXBUF_SIZE;
        iov[cnt++] = (struct iovec){.iov_base = dst ? dst + off : c->scratch, .iov_len = seg};
        want += seg;
        if (seg < op->len - off)
            break; /* the rest of it next time */
    }
    ssize_t got;
    int err = 0;
    if (src) {
        for (size_t i = 0, at = 0; i < cnt; at += iov[i].iov_len, i++)
            memcpy(iov[i].iov_base, src + at, iov[i].iov_len);
        got = (ssize_t)want;
    } else {
        /* Where this takes the rest of the run, the next header may come along into rxbuf. */
        bool hdr = want == rest && c->rx_pos == c->rx_len;
        if (hdr) {
            iov[cnt] = (struct iovec){.iov_base = c->rxbuf, .iov_len = KVB_WIRE_HDR_SIZE};
            c->rx_pos = c->rx_len = 0;
        }
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = cnt + hdr};
        got = recvmsg(c->fd, &m, MSG_DONTWAIT);
        err = errno;
        if (got > (ssize_t)want) {
            c->rx_len = (size_t)got - want;
            got = (ssize_t)want;
        }
    }
    kvb__batch_copy_end(b, slot);
    if (got < 0)
        return err == EAGAIN || err == EWOULDBLOCK || err == EINTR ? 0 : KVB_ERR_PEER_LOST;
    if (got == 0)
        return KVB_ERR_PEER_LOST;
    if (!src)
        atomic_store_explicit(&c->last_io, kvb__now_ns(), memory_order_relaxed);
    uint64_t done = 0;
    op = c->rx_op;
    for (uint64_t left = (uint64_t)got; left > 0;) {
        uint64_t take = op->len - c->rx_off < left ? op->len - c->rx_off : left;
        c->rx_off += take;
        left -= take;
        if (c->rx_off < op->len)
            break;
        c->rx_off = 0;
        done++;
        op = done < c->rx_run ? op->next : NULL;
    }
    c->rx_run -= done;
    c->rx_op = op;
    if (done)
        end_run_ops(c, done);
    return got;
}

static int on_header(tcp_conn_t *c)
{
    char why[96];
    int rc = kvb__wire_decode_hdr(c->rxbuf + c->rx_pos, &c->rx_hdr, why, sizeof why);
    if (rc) {
        conn_fail(c, rc, why);
        return rc;
    }
    c->rx_pos += KVB_WIRE_HDR_SIZE;
    c->rx_plen = kvb__wire_payload_len(&c->rx_hdr);
    c->rx_got = 0;
    c->rx_sink = SINK_DRAIN;
    rc = c->role == ROLE_TARGET ? target_on_header(c, &c->rx_hdr) : init_on_header(c, &c->rx_hdr);
    if (rc == KVB_ERR_AUTH && c->rx_hdr.type == KVB_FRAME_ERROR) {
        conn_fail(c, rc, "the peer refused our proof: cluster secrets differ");
        return rc;
    }
    if (rc == KVB_ERR_AUTH) {
        snprintf(why, sizeof why, "frame type %u before authentication", c->rx_hdr.type);
        conn_fail(c, rc, why);
        return rc;
    }
    if (rc) {
        snprintf(why, sizeof why, "unexpected frame type %u id %llu: %s", c->rx_hdr.type,
                 (unsigned long long)c->rx_hdr.id, kvb_strerror(rc));
        conn_fail(c, rc, why);
        return rc;
    }
    c->rx_state = RX_PAYLOAD;
    return KVB_OK;
}

static int on_frame_end(tcp_conn_t *c)
{
    c->rx_state = RX_HDR;
    if (c->role == ROLE_INIT) {
        init_on_frame(c, &c->rx_hdr);
        return KVB_OK;
    }
    int rc = target_on_frame(c, &c->rx_hdr);
    c->rx_sink = SINK_DRAIN;
    if (rc)
        conn_fail(c, rc,
                  c->refused           ? c->refused
                  : rc == KVB_ERR_AUTH ? "authentication failed (wrong or missing cluster secret)"
                                       : kvb_strerror(rc));
    return rc;
}

/* Reads and dispatches whatever the socket has, up to a budget of recv calls so that other
 * connections get a turn. */
static void read_frames(tcp_conn_t *c)
{
    int budget = 32;
    bool drained = false; /* the last read took less than offered: the socket is empty */
    while (!c->close_req) {
        if (c->rx_state == RX_PAYLOAD) {
            uint64_t want = c->rx_plen - c->rx_got;
            if (want == 0) {
                if (on_frame_end(c))
                    return;
                continue;
            }
            size_t avail = c->rx_len - c->rx_pos;
            ssize_t n;
            if (avail > 0) {
                n = sink_bytes(c, c->rxbuf + c->rx_pos, avail < want ? avail : (size_t)want);
                if (n > 0)
                    c->rx_pos += (size_t)n;
            } else if ((c->rx_plen < DIRECT_RECV && want < SMALL_RECV) ||
                       c->rx_sink == SINK_ENTRIES) {
                goto fill; /* a small remainder, or requests: read with what follows, at once */
            } else {
                if (budget-- == 0)
                    break;
                n = sink_bytes(c, NULL, (size_t)want);
                if (n == 0)
                    return;
            }
            if (n < 0) {
                conn_fail(c, (int)n,
                          n == KVB_ERR_PEER_LOST  ? "connection closed by peer"
                          : n == KVB_ERR_PROTOCOL ? "a same-host request over the data limit"
                                                  : kvb_strerror((int)n));
                return;
            }
            c->rx_got += (uint64_t)n;
            continue;
        }
        if (c->role == ROLE_TARGET && c->txq_count >= TXQ_HIGH) {
            pthread_mutex_lock(&c->mu); /* resumed by conn_flush once the answers drain */
            int rc = set_events(c, true, true);
            pthread_mutex_unlock(&c->mu);
            if (rc)
                conn_fail(c, rc, "epoll_ctl failed");
            return;
        }
        /* A chunk's worth of device copies owed: conn_read waits for them and the loop sends
         * their answers before the rest of the requests are read (a batch's first answers
         * leave after one chunk's copies, not after all of them). */
        if (c->djob_bytes >= STAGE_OUT_CHUNK)
            break;
        if (c->rx_len - c->rx_pos >= KVB_WIRE_HDR_SIZE) {
            if (on_header(c))
                return;
            continue;
        }
    fill:
        if (drained)
            return; /* saves the recv that would only say EAGAIN; epoll is level-triggered */
        if (budget-- == 0)
            break;
        if (c->rx_pos > 0) { /* compact what is left of a partial header */
            memmove(c->rxbuf, c->rxbuf + c->rx_pos, c->rx_len - c->rx_pos);
            c->rx_len -= c->rx_pos;
            c->rx_pos = 0;
        }
        size_t space = RXBUF_SIZE - c->rx_len;
        if (c->rx_plen >= DIRECT_RECV && c->rx_len < KVB_WIRE_HDR_SIZE &&
            c->rx_sink != SINK_ENTRIES)
            space = KVB_WIRE_HDR_SIZE - c->rx_len; /* see sink_bytes: large frames come in place */
        ssize_t n = recv(c->fd, c->rxbuf + c->rx_len, space, MSG_DONTWAIT);
        if (n > 0) {
            atomic_store_explicit(&c->last_io, kvb__now_ns(), memory_order_relaxed);
            c->rx_len += (size_t)n;
            drained = (size_t)n < space;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        conn_fail(c, KVB_ERR_PEER_LOST, n == 0 ? "connection closed by peer" : strerror(errno));
        return;
    }
    if (!c->close_req) { /* budget used up: come back after the others */
        c->rx_more = true;
        if (tls_self == c->th)
            c->th->need_scan = true;
        else
            thread_wake(c->th);
    }
}

/* Reads what there is, then runs the same-host copies the read asked for. */
static void conn_read(tcp_conn_t *c)
{
    read_frames(c);
    release_hold(c);
    if (!c->close_req) {
        flush_jobs(c);
        /* Device copies owed are waited for together too: not while a frame is still arriving
         * (its bytes bring the next read, which flushes) and few bytes wait. */
        if (c->rx_state != RX_PAYLOAD || c->djob_bytes >= DEV_FLUSH_BYTES)
            flush_dev_jobs(c);
        /* Copies into the device are waited for together, not after every read: each wait
         * stalls this connection's reads. While more answers are on their way and few bytes
         * wait, the next read's flush (or, should the peer stall, the next tick's) ends them. */
        if (c->dops_head) {
            pthread_mutex_lock(&c->mu);
            bool more = c->inflight_head != NULL;
            pthread_mutex_unlock(&c->mu);
            if (!more || c->dops_bytes >= DEV_FLUSH_BYTES)
                flush_dev_ops(c);
        }
    }
}

/* ---- progress threads ----------------------------------------------------------------------- */

static void thread_scan(tcp_thread_t *th)
{
    pthread_mutex_lock(&th->mu);
    tcp_conn_t *in = th->incoming;
    th->incoming = NULL;
    pthread_mutex_unlock(&th->mu);
    th->need_scan = false;
    while (in) {
        tcp_conn_t *c = in;
        in = in->next;
        c->next = th->conns;
        th->conns = c;
        /* A submitting thread may have used the lane already (and wanted EPOLLOUT). */
        pthread_mutex_lock(&c->mu);
        struct epoll_event ev = {.events = (c->driven ? 0 : EPOLLIN) | (c->want_out ? EPOLLOUT : 0),
                                 .data.ptr = c};
        int rc = epoll_ctl(th->epfd, EPOLL_CTL_ADD, c->fd, &ev);
        c->in_epoll = rc == 0;
        pthread_mutex_unlock(&c->mu);
        if (rc != 0)
            conn_fail(c, KVB_ERR_SYSTEM, "epoll_ctl add failed");
    }
    for (tcp_conn_t **pp = &th->conns; *pp;) {
        tcp_conn_t *c = *pp;
        if (c->close_req) {
            *pp = c->next;
            conn_close(c);
            conn_release(c);
            continue;
        }
        pthread_mutex_lock(&c->rx_mu);
        if (c->rx_more) {
            c->rx_more = false;
            conn_read(c);
        }
        pthread_mutex_unlock(&c->rx_mu);
        conn_flush(c);
        pp = &c->next;
    }
}

/* Turns the listeners' EPOLLIN on or off. Thread 0 only. True if every change took. */
static bool listeners_listen(kvb_transport_t *tp, bool on)
{
    struct epoll_event ev = {.events = on ? EPOLLIN : 0, .data.ptr = &listen_tag};
    bool ok = epoll_ctl(tp->threads[0].epfd, EPOLL_CTL_MOD, tp->listen_fd, &ev) == 0;
    ev.data.ptr = &local_tag;
    if (tp->local_fd >= 0 && epoll_ctl(tp->threads[0].epfd, EPOLL_CTL_MOD, tp->local_fd, &ev))
        ok = false;
    return ok;
}

/* Out of descriptors, a listening socket stays readable (epoll is level-triggered) and the
 * progress thread would spin on it: give up the reserve descriptor, accept and close the
 * connection at once (the peer sees a reset, not a hang), and take the reserve back. */
static void shed_one(kvb_transport_t *tp, int lfd)
{
    static atomic_bool warned;
    if (!atomic_exchange(&warned, true))
        KVB_ERROR("accept: out of file descriptors; refusing connections until some close");
    if (tp->reserve_fd >= 0)
        close(tp->reserve_fd);
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0)
        close(fd);
    tp->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    /* Could not even shed it: stop listening until the next tick rather than spin. */
    if ((fd < 0 || tp->reserve_fd < 0) && listeners_listen(tp, false))
        tp->listen_paused = true;
}

/* Owner thread: fails connections past a deadline - a handshake not done within the connect
 * timeout (a peer that connects and says nothing holds no slot for long), and requests in flight
 * on a connection silent for the peer timeout. */
static void thread_tick(tcp_thread_t *th, uint64_t now)
{
    const kvb_config_t *cfg = &th->tp->engine->cfg;
    th->next_tick = now + TICK_MS * 1000000ull;
    kvb_transport_t *tp = th->tp;
    if (th == &tp->threads[0] && tp->listen_paused && listeners_listen(tp, true))
        tp->listen_paused = false;
    for (tcp_conn_t *c = th->conns; c; c = c->next) {
        if (c->close_req)
            continue;
        if (c->role == ROLE_TARGET && c->auth != AUTH_DONE &&
            now - c->born_ns > cfg->connect_timeout_ms * 1000000ull) {
            conn_fail(c, KVB_ERR_AUTH, "no authenticated handshake within the connect timeout");
            continue;
        }
        /* An initiator waits for answers; a target waits for its peer to read what it queued
         * (a peer that never reads would otherwise hold its answers forever) and to finish a
         * frame it began (a WRITE's region stays pinned, a device WRITE's bounce buffer held,
         * until its last byte is in: a peer stopped mid-payload would hold them forever). */
        pthread_mutex_lock(&c->mu);
        bool unread = c->txq_head != NULL;
        bool waiting = c->role == ROLE_INIT ? c->inflight_head != NULL : unread;
        pthread_mutex_unlock(&c->mu);
        uint64_t last = atomic_load_explicit(&c->last_io, memory_order_relaxed);
        pthread_mutex_lock(&c->rx_mu);
        /* A payload or a header begun (whole headers left unread are our hold-off, not this). */
        bool mid_frame = c->rx_state == RX_PAYLOAD ||
                         (c->rx_len > c->rx_pos && c->rx_len - c->rx_pos < KVB_WIRE_HDR_SIZE);
        if (c->role == ROLE_TARGET && mid_frame)
            waiting = true;
        flush_dev_ops(c); /* answers that waited for more (see conn_read) wait no longer */
        pthread_mutex_unlock(&c->rx_mu);
        if (waiting && now > last && now - last > cfg->peer_timeout_ms * 1000000ull) {
            char why[96];
            snprintf(why, sizeof why,
                     c->role == ROLE_INIT ? "no answer for %u ms with requests in flight"
                     : unread             ? "peer read nothing for %u ms"
                                          : "peer sent nothing for %u ms in the middle of a frame",
                     cfg->peer_timeout_ms);
            KVB_WARN("connection %s %s: %s", c->role == ROLE_INIT ? "to" : "from",
                     c->role == ROLE_INIT ? (c->peer ? c->peer->name : "?") : c->from, why);
            conn_fail(c, KVB_ERR_PEER_LOST, why);
        }
    }
}

/* Accepts what waits on listener lfd: TCP, or (local) the Unix socket of same-host lanes. */
static void accept_all(kvb_transport_t *tp, int lfd, bool local)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE) {
                shed_one(tp, lfd);
                if (tp->listen_paused)
                    return;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                KVB_WARN("accept: %s", strerror(errno));
            return;
        }
        if (atomic_load(&tp->nconns) >= tp->engine->cfg.max_connections) {
            KVB_WARN("connection refused: %u connections open (max_connections)",
                     atomic_load(&tp->nconns));
            close(fd);
            continue;
        }
        /* TCP: its congestion control it has from the listener (take_congestion). Local: the
         * kernel names the process at the other end, which its hello must name too. */
        struct ucred cr = {0};
        socklen_t cl = sizeof cr;
        tcp_conn_t *c = (local ? getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) == 0
                               : set_sock_opts(fd, tp->engine->cfg.peer_timeout_ms) == KVB_OK)
                            ? conn_new(tp, fd, ROLE_TARGET)
                            : NULL;
        if (!c) {
            close(fd);
            continue;
        }
        c->local = local;
        c->cred_pid = (uint32_t)cr.pid;
        pthread_mutex_lock(&tp->targets_mu);
        bool listed = tp->ntargets < tp->captargets;
        if (!listed) {
            size_t ncap = tp->captargets ? tp->captargets * 2 : 16;
            tcp_conn_t **n = realloc(tp->targets, ncap * sizeof *n);
            if (n) {
                tp->targets = n;
                tp->captargets = ncap;
                listed = true;
            }
        }
        if (listed) {
            c->conn_id = ++tp->next_conn_id;
            tp->targets[tp->ntargets++] = c;
        }
        pthread_mutex_unlock(&tp->targets_mu);
        if (!listed) {
            conn_release(c); /* closes fd */
            continue;
        }
        atomic_fetch_add(&tp->nconns, 1);
        c->born_ns = kvb__now_ns();
        thread_adopt(tp, c);
    }
}

/* Only thread 0 listens, and only it reads or writes listen_paused. */
static bool listen_paused_here(const tcp_thread_t *th)
{
    return th == &th->tp->threads[0] && th->tp->listen_paused;
}

static void *thread_main(void *arg)
{
    tcp_thread_t *th = arg;
    struct epoll_event evs[MAX_EVENTS];
    tls_self = th;
    uint64_t spin_ns = th->tp->spin_ns, busy_at = 0, answers_at = 0;
    bool owed = false; /* the initiator connection read last still waits for answers */
    while (!atomic_load(&th->tp->stop)) {
        /* A scan that queued more work (a read budget ran out, a conn to close) polls again
         * without sleeping; so does a thread for spin_ns (cfg.linger_us, or cfg.busy_poll_us
         * where longer) after it last took in requests - a peer's next batch, submitted once the
         * last one's answers are in, then finds it awake - or answers over TCP with more owed on
         * that connection, which follow at the stream's pace: a thread that slept each time it
         * had read what had come was woken every few hundred KB of a KV pull, and every wake took
         * the sending thread of the other side, the busiest of the transfer, away from its
         * copies (KV pulls over loopback came closer to their ceilings in 18 of 18 interleaved
         * pairs, 1 MiB READs in 5 of 6; docs/performance-notes.md, "Polling for answers"); it
         * sleeps once that connection owes none. Not on a same-host lane, whose answers come once
         * the other side's threads copied on these same cores. Nor while a connection waits for
         * room to send: the peer reading it needs the core. A batch on one connection is read by
         * its waiting thread (tcp_drive), not here. */
        uint64_t t = spin_ns ? kvb__now_ns() : 0;
        bool spin = spin_ns && (t - busy_at < spin_ns || (owed && t - answers_at < spin_ns)) &&
                    atomic_load_explicit(&th->out_armed, memory_order_relaxed) == 0;
        int n = epoll_wait(th->epfd, evs, MAX_EVENTS,
                           th->need_scan || spin                 ? 0
                           : th->conns || listen_paused_here(th) ? TICK_MS
                                                                 : -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            KVB_ERROR("epoll_wait: %s", strerror(errno));
            break;
        }
        bool served = false; /* requests came in: more may follow at once */
        for (int i = 0; i < n; i++) {
            void *tag = evs[i].data.ptr;
            if (tag == &wake_tag) {
                uint64_t v;
                if (read(th->evfd, &v, sizeof v) < 0 && errno != EAGAIN)
                    KVB_ERROR("eventfd read: %s", strerror(errno));
                atomic_store(&th->wake_pending, false);
                th->need_scan = true;
            } else if (tag == &listen_tag) {
                accept_all(th->tp, th->tp->listen_fd, false);
            } else if (tag == &local_tag) {
                accept_all(th->tp, th->tp->local_fd, true);
            } else {
                tcp_conn_t *c = tag;
                if (c->close_req || c->fd < 0)
                    continue; /* closed in the scan below, never freed before it */
                served |= c->role == ROLE_TARGET;
                if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                    pthread_mutex_lock(&c->rx_mu);
                    conn_read(c);
                    pthread_mutex_unlock(&c->rx_mu);
                    if (spin_ns && c->role == ROLE_INIT && !c->local) {
                        pthread_mutex_lock(&c->mu);
                        owed = c->inflight_head != NULL;
                        pthread_mutex_unlock(&c->mu);
                        answers_at = owed ? kvb__now_ns() : answers_at;
                    }
                }
                /* A target's answers were queued by the read; an initiator's requests wait
                 * for EPOLLOUT only when the socket was full. */
                if (!c->close_req && (c->role == ROLE_TARGET || (evs[i].events & EPOLLOUT)))
                    conn_flush(c);
            }
        }
        if (served && spin_ns)
            busy_at = kvb__now_ns();
        if (th->need_scan)
            thread_scan(th);
        uint64_t now = kvb__now_ns();
        if ((th->conns || listen_paused_here(th)) && now >= th->next_tick) {
            thread_tick(th, now);
            if (th->need_scan)
                thread_scan(th);
        }
    }
    return NULL;
}

/* ---- listening ------------------------------------------------------------------------------ */

static int listen_on(kvb_transport_t *tp, const kvb_config_t *cfg)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                    *res;
    uint16_t first = cfg->port, last = cfg->port_max ? cfg->port_max : cfg->port;
    int gai = getaddrinfo(cfg->bind_addr, "0", &hints, &res);
    if (gai) {
        KVB_ERROR("bind address %s: %s", cfg->bind_addr, gai_strerror(gai));
        return KVB_ERR_RESOLVE;
    }
    int rc = KVB_ERR_ADDR_IN_USE;
    for (uint32_t port = first; port <= last && rc == KVB_ERR_ADDR_IN_USE; port++) {
        int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            rc = KVB_ERR_SYSTEM;
            break;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_storage ss;
        memcpy(&ss, res->ai_addr, res->ai_addrlen);
        if (ss.ss_family == AF_INET)
            ((struct sockaddr_in *)&ss)->sin_port = htons((uint16_t)port);
        else
            ((struct sockaddr_in6 *)&ss)->sin6_port = htons((uint16_t)port);
        if (bind(fd, (struct sockaddr *)&ss, res->ai_addrlen) == 0 && listen(fd, 512) == 0) {
            socklen_t sl = sizeof ss;
            getsockname(fd, (struct sockaddr *)&ss, &sl);
            tp->port = ntohs(ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                                     : ((struct sockaddr_in6 *)&ss)->sin6_port);
            tp->listen_fd = fd;
            rc = KVB_OK;
        } else {
            if (errno != EADDRINUSE) {
                KVB_ERROR("bind %s:%u: %s", cfg->bind_addr, port, strerror(errno));
                rc = KVB_ERR_SYSTEM;
            }
            close(fd);
        }
        if (port == 65535)
            break;
    }
    freeaddrinfo(res);
    if (rc == KVB_ERR_ADDR_IN_USE)
        KVB_ERROR("no free port in %u..%u on %s", first, last, cfg->bind_addr);
    return rc;
}

/* Gives the listening socket the configured congestion control (accepted connections inherit it;
 * an algorithm this kernel lacks or refuses this process fails here, at create, with a clear
 * message) and records the one in use in the engine, the system's default if none was set. */
static int take_congestion(kvb_transport_t *tp)
{
    kvb_engine_t *e = tp->engine;
    const char *cc = e->cfg.tcp_congestion;
    if (cc && setsockopt(tp->listen_fd, IPPROTO_TCP, TCP_CONGESTION, cc, (socklen_t)strlen(cc))) {
        int err = errno;
        bool perm = err == EPERM;
        char list[256] = "unknown";
        FILE *f = fopen(perm ? "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
                             : "/proc/sys/net/ipv4/tcp_available_congestion_control",
                        "re");
        if (f && fgets(list, sizeof list, f))
            list[strcspn(list, "\n")] = '\0';
        if (f)
            fclose(f);
        KVB_ERROR("TCP congestion control '%s': %s (%s here: %s)", cc,
                  err == ENOENT ? "not available" : strerror(err), perm ? "allowed" : "available",
                  list);
        return KVB_ERR_INVALID_ARG;
    }
    char name[sizeof e->tcp_congestion] = "";
    socklen_t len = sizeof name - 1;
    if (getsockopt(tp->listen_fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) == 0) {
        name[len < sizeof name ? len : sizeof name - 1] = '\0';
        memcpy(e->tcp_congestion, name, sizeof name);
    }
    return KVB_OK;
}

static void tcp_destroy(kvb_transport_t *tp);

static int tcp_create(kvb_engine_t *e, kvb_transport_t **out)
{
    kvb_transport_t *tp = calloc(1, sizeof *tp);
    if (!tp)
        return KVB_ERR_NOMEM;
    tp->engine = e;
    tp->spin_ns = (uint64_t)kvb_engine_linger_us(e) * 1000;
    tp->listen_fd = tp->local_fd = -1;
    pthread_mutex_init(&tp->targets_mu, NULL);
    tp->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    tp->threads = calloc((size_t)e->cfg.progress_threads, sizeof *tp->threads);
    if (!tp->threads) {
        if (tp->reserve_fd >= 0)
            close(tp->reserve_fd);
        pthread_mutex_destroy(&tp->targets_mu);
        free(tp);
        return KVB_ERR_NOMEM;
    }
    /* Every thread's state exists before any thread runs (a thread hands connections to the
     * others); the listening socket joins thread 0's epoll only at tcp_start, once the engine's
     * identity is complete. */
    int rc = listen_on(tp, &e->cfg);
    if (rc == KVB_OK)
        rc = take_congestion(tp);
    for (int i = 0; i < e->cfg.progress_threads && rc == KVB_OK; i++) {
        tcp_thread_t *th = &tp->threads[i];
        th->tp = tp;
        th->epfd = epoll_create1(EPOLL_CLOEXEC);
        th->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        th->scratch = malloc(RXBUF_SIZE);
        pthread_mutex_init(&th->mu, NULL);
        struct epoll_event wev = {.events = EPOLLIN, .data.ptr = &wake_tag};
        if (th->epfd < 0 || th->evfd < 0 || !th->scratch ||
            epoll_ctl(th->epfd, EPOLL_CTL_ADD, th->evfd, &wev))
            rc = KVB_ERR_SYSTEM;
    }
    if (rc == KVB_OK)
        tp->nthreads = e->cfg.progress_threads;
    for (int i = 0; i < tp->nthreads && rc == KVB_OK; i++) {
        if (kvb__thread_create(&tp->threads[i].tid, &e->cpus, i, "kvb-tcp", i, thread_main,
                               &tp->threads[i]) != 0)
            rc = KVB_ERR_SYSTEM;
        else
            tp->nstarted = i + 1;
    }
    if (rc) {
        tcp_destroy(tp);
        return rc;
    }
    *out = tp;
    return KVB_OK;
}

/* Where an engine takes its same-host lanes: an abstract Unix stream socket, "kvbridge-<its
 * incarnation>-lanes" (kvb__sock_name). Its name anyone on the host could have taken first: an
 * initiator checks who holds it (kvb__sock_connect), and each lane authenticates like any other. */
#define LANE_SOCK "-lanes"

/* Same-host lanes: a Unix stream socket, where the engine has a same-host path. Not fatal: a
 * same-host initiator that cannot reach it keeps its TCP lanes. */
static void listen_local(kvb_transport_t *tp)
{
    kvb_engine_t *e = tp->engine;
    if (!kvb__shm_listening(e->shm))
        return;
    struct sockaddr_un sa;
    socklen_t sl;
    kvb__sock_name(e->hello.incarnation, LANE_SOCK, &sa, &sl);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &local_tag};
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sl) || listen(fd, 512) ||
        epoll_ctl(tp->threads[0].epfd, EPOLL_CTL_ADD, fd, &ev)) {
        KVB_WARN("same-host lanes' socket: %s; same-host peers keep TCP lanes", strerror(errno));
        if (fd >= 0)
            close(fd);
        return;
    }
    tp->local_fd = fd;
}

/* Starts accepting connections: the engine's identity (name, incarnation) is complete now. */
static int tcp_start(kvb_transport_t *tp)
{
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &listen_tag};
    if (epoll_ctl(tp->threads[0].epfd, EPOLL_CTL_ADD, tp->listen_fd, &lev) != 0) {
        KVB_ERROR("epoll_ctl (listening socket): %s", strerror(errno));
        return KVB_ERR_SYSTEM;
    }
    listen_local(tp);
    return KVB_OK;
}

static void tcp_destroy(kvb_transport_t *tp)
{
    atomic_store(&tp->stop, true);
    for (int i = 0; i < tp->nstarted; i++) {
        uint64_t one = 1;
        if (write(tp->threads[i].evfd, &one, sizeof one) < 0)
            KVB_ERROR("eventfd write: %s", strerror(errno));
        pthread_join(tp->threads[i].tid, NULL);
    }
    /* Threads are gone: finish their connections here, single-threaded. */
    int nalloc = tp->engine->cfg.progress_threads;
    for (int i = 0; i < nalloc; i++) {
        tcp_thread_t *th = &tp->threads[i];
        if (!th->tp)
            continue;
        pthread_mutex_lock(&th->mu);
        tcp_conn_t *in = th->incoming;
        th->incoming = NULL;
        pthread_mutex_unlock(&th->mu);
        while (in) {
            tcp_conn_t *c = in;
            in = in->next;
            c->next = th->conns;
            th->conns = c;
        }
        while (th->conns) {
            tcp_conn_t *c = th->conns;
            th->conns = c->next;
            pthread_mutex_lock(&c->mu);
            if (!c->close_err)
                c->close_err = KVB_ERR_SHUTDOWN;
            c->close_req = true;
            pthread_mutex_unlock(&c->mu);
            conn_close(c);
            c->th = NULL;
            conn_release(c);
        }

        if (th->epfd >= 0)
            close(th->epfd);
        if (th->evfd >= 0)
            close(th->evfd);
        free(th->scratch);
        pthread_mutex_destroy(&th->mu);
    }
    if (tp->listen_fd >= 0)
        close(tp->listen_fd);
    if (tp->local_fd >= 0)
        close(tp->local_fd);
    if (tp->reserve_fd >= 0)
        close(tp->reserve_fd);
    free(tp->targets);
    pthread_mutex_destroy(&tp->targets_mu);
    free(tp->threads);
    free(tp);
}

static uint16_t tcp_port(const kvb_transport_t *tp)
{
    return tp->port;
}

/* ---- connecting (caller's thread, blocking with a deadline) ---------------------------------- */

static int wait_fd(int fd, short events, uint64_t deadline)
{
    struct pollfd p = {.fd = fd, .events = events};
    for (;;) {
        int ms = kvb__ms_left(deadline);
        if (ms == 0)
            return KVB_ERR_TIMEOUT;
        int n = poll(&p, 1, ms);
        if (n > 0)
            return KVB_OK;
        if (n < 0 && errno != EINTR)
            return KVB_ERR_SYSTEM;
    }
}

static int io_all(int fd, void *buf, size_t len, bool sending, uint64_t deadline)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = sending ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recv(fd, p, len, MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0)
            return KVB_ERR_PEER_LOST;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return KVB_ERR_PEER_LOST;
        int rc = wait_fd(fd, sending ? POLLOUT : POLLIN, deadline);
        if (rc)
            return rc;
    }
    return KVB_OK;
}

static int dial(const kvb_peer_t *p, uint64_t deadline, int *out)
{
    char port[8];
    snprintf(port, sizeof port, "%u", p->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV},
                    *res;
    int gai = getaddrinfo(p->host, port, &hints, &res);
    if (gai) {
        KVB_ERROR("segment %s: cannot resolve %s: %s", p->name, p->host, gai_strerror(gai));
        return KVB_ERR_RESOLVE;
    }
    int rc = KVB_ERR_CONNECT, err = 0;
    *out = -1;
    for (struct addrinfo *ai = res; ai && rc != KVB_OK; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
            continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS) {
            socklen_t sl = sizeof err;
            int w = wait_fd(fd, POLLOUT, deadline);
            if (w == KVB_OK && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) == 0 && err == 0) {
                *out = fd;
                rc = KVB_OK;
                break;
            }
            if (w == KVB_ERR_TIMEOUT)
                err = ETIMEDOUT;
        } else {
            err = errno;
        }
        close(fd);
    }
    freeaddrinfo(res);
    if (rc)
        KVB_WARN("segment %s: connect failed: %s", p->name, strerror(err ? err : ECONNREFUSED));
    if (rc)
        return err == ETIMEDOUT ? KVB_ERR_TIMEOUT : rc;
    /* The congestion control was checked at create against the listening socket (which accepted
     * connections inherit it from), so this fails only if the kernel lost the algorithm since. */
    const char *cc = p->engine->cfg.tcp_congestion;
    if (!(rc = set_sock_opts(*out, p->engine->cfg.peer_timeout_ms)) && cc &&
        setsockopt(*out, IPPROTO_TCP, TCP_CONGESTION, cc, (socklen_t)strlen(cc))) {
        KVB_ERROR("TCP congestion control %s: %s", cc, strerror(errno));
        rc = KVB_ERR_SYSTEM;
    }
    if (rc) {
        close(*out); /* ours until it is returned */
        *out = -1;
    }
    return rc;
}

/* Reads one whole frame of type `want` (or an ERROR frame's status) before `deadline`. */
static int recv_frame(int fd, uint8_t want, uint64_t deadline, uint8_t **body, size_t *len,
                      char *why, size_t why_len)
{
    uint8_t rh[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t h;
    int rc = io_all(fd, rh, sizeof rh, false, deadline);
    if (!rc)
        rc = kvb__wire_decode_hdr(rh, &h, why, why_len);
    if (!rc && h.type == KVB_FRAME_ERROR)
        return kvb__wire_error_status(h.status);
    if (!rc && (h.type != want || h.status != 0 || h.len == 0))
        rc = KVB_ERR_PROTOCOL;
    if (!rc && !(*body = malloc(h.len)))
        rc = KVB_ERR_NOMEM;
    if (!rc && (rc = io_all(fd, *body, h.len, false, deadline))) {
        free(*body);
        *body = NULL;
    }
    *len = rc ? 0 : h.len;
    return rc;
}

/* Sends one frame (header and payload) before `deadline`. */
static int send_frame(int fd, uint8_t type, int32_t status, const uint8_t *body, size_t len,
                      uint64_t deadline)
{
    uint8_t hdr[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t h = {.type = type, .status = status, .len = len};
    kvb__wire_encode_hdr(&h, hdr);
    int rc = io_all(fd, hdr, sizeof hdr, true, deadline);
    return rc || !len ? rc : io_all(fd, (void *)body, len, true, deadline);
}

/* The initiator's half of the mutual authentication: HELLO with our nonce, the target's proof
 * checked against its CHALLENGE, then our proof. Fills *their with the target's hello. */
static int authenticate(kvb_engine_t *e, int fd, uint32_t lane, uint64_t deadline,
                        kvb_hello_t *their, char *why, size_t why_len)
{
    kvb_hello_t me = e->hello;
    me.lane = lane;
    uint8_t msg[KVB_WIRE_MAX_HELLO], *body = NULL, mac[KVB_WIRE_MAC_LEN], want[KVB_WIRE_MAC_LEN];
    size_t len = 0;
    int rc = kvb__random(me.nonce, sizeof me.nonce);
    if (!rc)
        rc = send_frame(fd, KVB_FRAME_HELLO, 0, msg, kvb__wire_hello_encode(&me, msg), deadline);
    if (!rc)
        rc = recv_frame(fd, KVB_FRAME_CHALLENGE, deadline, &body, &len, why, why_len);
    if (!rc)
        rc = kvb__wire_challenge_decode(body, len, their, mac);
    free(body);
    if (!rc)
        rc = kvb__wire_auth_mac(e->secret, e->secret_len, KVB_AUTH_TARGET, &me, their, want);
    if (!rc && !kvb__ct_equal(mac, want, sizeof mac)) {
        /* Tell the target why we hang up, so that both sides log the same cause. */
        send_frame(fd, KVB_FRAME_ERROR, KVB_ERR_AUTH, NULL, 0, deadline);
        snprintf(why, why_len, "the target's proof does not match our cluster secret");
        rc = KVB_ERR_AUTH;
    }
    if (!rc)
        rc = kvb__wire_auth_mac(e->secret, e->secret_len, KVB_AUTH_INITIATOR, &me, their, mac);
    if (!rc)
        rc = send_frame(fd, KVB_FRAME_AUTH, 0, mac, sizeof mac, deadline);
    return rc;
}

/* Connects one lane - over TCP, or (local) over the same-host lane socket - and runs the
 * handshake on it: mutual authentication, then HELLO_ACK (the region list and this lane's
 * same-host token) and, on lane 0, the attributes. The first lane 0 records the peer's identity,
 * regions and attributes; every later lane must meet the same incarnation. */
static int handshake(kvb_transport_t *tp, kvb_peer_t *p, uint32_t lane, bool local,
                     uint64_t deadline, int *out)
{
    /* Local: the socket must be held by the process lane 0 authenticated (its pid). */
    int fd, rc = local ? kvb__sock_connect(&p->hello, LANE_SOCK, SOCK_STREAM | SOCK_NONBLOCK, false,
                                           &fd)
                       : dial(p, deadline, &fd);
    if (rc)
        return rc;
    bool first = lane == 0 && !local;
    char why[96] = "";
    uint8_t *body = NULL, token[KVB_LINK_TOKEN_LEN];
    size_t len = 0, n = 0;
    kvb_hello_t their, ack;
    kvb_region_desc_t *regions = NULL;
    rc = authenticate(tp->engine, fd, lane, deadline, &their, why, sizeof why);
    if (!rc)
        rc = recv_frame(fd, KVB_FRAME_HELLO_ACK, deadline, &body, &len, why, sizeof why);
    if (!rc)
        rc = kvb__wire_hello_ack_decode(body, len, &ack, &regions, &n);
    free(body);
    body = NULL;
    if (!rc && ack.incarnation != their.incarnation)
        rc = KVB_ERR_PROTOCOL;
    if (!rc) {
        memcpy(token, ack.nonce, sizeof token);
        kvb__wipe(ack.nonce, sizeof ack.nonce);
        memset(their.nonce, 0, sizeof their.nonce);
    }
    if (!rc && !first && their.incarnation != p->hello.incarnation)
        rc = KVB_ERR_PEER_RESTARTED;
    if (!rc && first) {
        p->hello = their;
        p->rlist = kvb__region_list_new(regions, n);
        regions = NULL;
        if (!p->rlist)
            rc = KVB_ERR_NOMEM;
    }
    if (!rc && lane == 0) { /* a second lane 0 (local) has them too: read, and kept the first's */
        rc = recv_frame(fd, KVB_FRAME_ATTRS, deadline, &body, &len, why, sizeof why);
        if (!rc && first)
            rc = kvb__wire_attrs_decode(body, len, &p->attrs, &p->nattrs);
        free(body);
    }
    free(regions);
    if (!rc) { /* the lane's token, once the lane is sure to be used */
        _Static_assert(sizeof p->link_tokens / sizeof p->link_tokens[0] >= 16, "a token a lane");
        memcpy(p->link_tokens[lane], token, KVB_LINK_TOKEN_LEN);
        p->nlink_tokens = lane + 1;
    }
    kvb__wipe(token, sizeof token);
    if (rc) {
        if (rc == KVB_ERR_AUTH)
            KVB_ERROR("segment %s: authentication failed: %s", p->name,
                      why[0] ? why : "the target refused our proof (cluster secrets differ)");
        else
            KVB_WARN("segment %s: %shandshake failed: %s%s%s", p->name,
                     local ? "same-host lane " : "", kvb_strerror(rc), why[0] ? ": " : "", why);
        close(fd);
        return rc;
    }
    *out = fd;
    return KVB_OK;
}

/* Same-host lanes, for a peer on our host that we reach with the same-host path: its requests are
 * small frames both ways, and a loopback TCP send runs the whole TCP receive path (and the peer's
 * wake-up) in the sender - a 64 B same-host READ round trip took p50 39-40 us on TCP lanes,
 * 24-27 us on Unix ones (docs/performance-notes.md, "Same-host lanes"). */
static bool wants_local(const kvb_transport_t *tp, const kvb_peer_t *p)
{
    const kvb_engine_t *e = tp->engine;
    return (e->paths & (1u << KVB_PATH_SHM)) && kvb__same_host(e, &p->hello);
}

static void tcp_peer_free(kvb_peer_t *p)
{
    tcp_peer_t *tpp = p->tp;
    if (!tpp)
        return;
    for (int i = 0; i < tpp->nlanes; i++)
        conn_release(tpp->lanes[i]);
    free(tpp);
    p->tp = NULL;
}

static int tcp_connect(kvb_transport_t *tp, kvb_peer_t *p, uint64_t deadline)
{
    tcp_peer_t *tpp = calloc(1, sizeof *tpp);
    if (!tpp)
        return KVB_ERR_NOMEM;
    p->tp = tpp;
    int rc = KVB_OK;
    int lanes = tp->engine->cfg.lanes; /* at most MAX_LANES: checked at engine create */
    int fds[MAX_LANES];
    /* Lane 0 over TCP proves who the peer is; a same-host peer's lanes are then all Unix sockets
     * (lane 0 again too), where it has them. */
    rc = handshake(tp, p, 0, false, deadline, &fds[0]);
    bool local[MAX_LANES] = {false}, want = rc == KVB_OK && wants_local(tp, p);
    int fd0;
    if (want && (want = handshake(tp, p, 0, true, deadline, &fd0) == KVB_OK)) {
        close(fds[0]);
        fds[0] = fd0;
        local[0] = true;
    }
    for (int i = 1; i < lanes && rc == KVB_OK; i++) {
        /* A lane that finds no room on the lane socket (a full backlog) goes over TCP. */
        rc = want ? handshake(tp, p, (uint32_t)i, true, deadline, &fds[i]) : KVB_ERR_CONNECT;
        local[i] = rc == KVB_OK;
        if (rc == KVB_ERR_CONNECT)
            rc = handshake(tp, p, (uint32_t)i, false, deadline, &fds[i]);
        if (rc) {
            while (i-- > 0)
                close(fds[i]);
        }
    }
    if (rc)
        return rc; /* the caller's release frees tpp */
    if (want)
        KVB_DEBUG("segment %s: same host, lanes over Unix sockets", p->name);
    for (int i = 0; i < lanes; i++) {
        tcp_conn_t *c = conn_new(tp, fds[i], ROLE_INIT);
        if (c)
            c->local = local[i];
        if (!c) {
            for (int j = i; j < lanes; j++)
                close(fds[j]);
            rc = KVB_ERR_NOMEM;
            break;
        }
        atomic_fetch_add(&p->refs, 1);
        c->peer = p;
        atomic_fetch_add(&c->refs, 1); /* one for the peer, one for the thread */
        tpp->lanes[tpp->nlanes++] = c;
        thread_adopt(tp, c);
    }
    if (rc) {
        for (int i = 0; i < tpp->nlanes; i++)
            conn_request_close(tpp->lanes[i], KVB_ERR_CANCELED);
    }
    return rc;
}

/* Queues ops on a lane and, if the socket was idle, sends them from this thread right away: a
 * small request reaches the wire without waking the progress thread. */
static void lane_append(tcp_conn_t *c, kvb_op_t *head)
{
    kvb_op_t *failed = NULL;
    int rc = KVB_OK;
    pthread_mutex_lock(&c->mu);
    int err = c->close_err ? c->close_err : KVB_ERR_PEER_LOST;
    bool dead = c->dead || c->close_req;
    if (!dead) {
        bool idle = c->txq_head == NULL; /* else a flush is owed already (EPOLLOUT is armed) */
        queue_ops_locked(c, head, &failed);
        if (idle)
            rc = conn_flush_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    if (dead)
        ops_end(head, err);
    ops_end(failed, KVB_ERR_NOMEM);
    if (rc)
        conn_fail(c, rc, "send failed");
}

/* What an op puts on its lane: a header and its data, or for a same-host op its run's entry. */
static uint64_t wire_bytes(const kvb_op_t *op)
{
    return op->path == KVB_PATH_SHM ? KVB_WIRE_SHM_ENTRY : KVB_WIRE_HDR_SIZE + op->len;
}

static void hint_release(void *hint)
{
    conn_release(hint);
}

/* A batch whose ops all go to one lane may be driven from its waiting thread. Called before the
 * ops are queued, so no waiter can look yet. */
static void set_drive_hint(kvb_op_t *ops, tcp_conn_t *c)
{
    kvb_batch_t *b = ops->batch;
    if (ops->req == KVB_OP_NOTIFY_REQ)
        return;
    uint64_t bytes = 0;
    for (kvb_op_t *op = ops; op; op = op->next) {
        if (op->batch != b)
            return;
        bytes += wire_bytes(op);
    }
    if (bytes >= LANE_SPREAD || b->drive_hint) {
        if (b->drive_hint) { /* a second run to another peer: no single connection */
            b->hint_release(b->drive_hint);
            b->drive_hint = NULL;
        }
        return;
    }
    atomic_fetch_add(&c->refs, 1);
    b->hint_release = hint_release;
    b->drive_hint = c;
}

/* Reads c from this (waiting) thread until the batch is done or something was read. */
static int tcp_drive(kvb_batch_t *b, uint64_t deadline)
{
    tcp_conn_t *c = b->drive_hint;
    pthread_mutex_lock(&c->mu);
    if (c->dead || c->close_req || c->driven || c->fd < 0 || !c->in_epoll) {
        pthread_mutex_unlock(&c->mu);
        return KVB_ERR_BUSY;
    }
    c->driven = true;
    int rc = apply_events(c), fd = c->fd;
    pthread_mutex_unlock(&c->mu);
    /* The owner thread may have been reading when EPOLLIN went off: let it finish, then look. */
    pthread_mutex_lock(&c->rx_mu);
    pthread_mutex_unlock(&c->rx_mu);
    /* Read until the batch is done, the connection ends or the deadline passes: EPOLLIN goes
     * off and on again once per wait, not once per read. */
    int ms;
    /* Busy polling (cfg.busy_poll_us): poll without sleeping until spin_ns pass with nothing
     * to read - from the start, since the answers are owed now. */
    uint64_t spin_ns = (uint64_t)b->engine->cfg.busy_poll_us * 1000, busy_at = kvb__now_ns();
    while (rc == KVB_OK && !kvb__batch_done(b) && !c->close_req &&
           (ms = kvb__ms_left(deadline)) != 0) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        bool spin = spin_ns && kvb__now_ns() - busy_at < spin_ns;
        bool ready = poll(&p, 1, spin ? 0 : ms < 0 || ms > 10 ? 10 : ms) > 0;
        if (spin_ns && ready)
            busy_at = kvb__now_ns();
        pthread_mutex_lock(&c->rx_mu);
        if (ready && !c->close_req && c->fd >= 0)
            conn_read(c);
        pthread_mutex_unlock(&c->rx_mu);
    }
    pthread_mutex_lock(&c->mu);
    c->driven = false;
    if (!c->dead && c->fd >= 0)
        rc = apply_events(c);
    pthread_mutex_unlock(&c->mu);
    if (rc)
        conn_fail(c, rc, "epoll_ctl failed");
    return KVB_OK;
}

static void tcp_submit(kvb_transport_t *tp, kvb_peer_t *p, kvb_op_t *ops)
{
    (void)tp;
    int lost = atomic_load(&p->lost);
    tcp_peer_t *tpp = p->tp;
    if (lost || !tpp || tpp->nlanes == 0) {
        ops_end(ops, lost ? lost : KVB_ERR_PEER_LOST);
        return;
    }
    /* Consecutive ops stay on one lane until LANE_SPREAD bytes, so small requests coalesce into
     * few large writes while big transfers spread over every lane. Each lane's share is then
     * appended - one send - at once, so the submitting thread is out of the sockets before the
     * answers pour in: a thread sending on a socket also takes in the data that arrives on it
     * meanwhile (the kernel's backlog), and appending each LANE_SPREAD share on its own kept a
     * submit of 128 64 KiB READs busy 80-160 us on loopback, the receiving thread waiting for a
     * core behind it. One send per lane: 35-55 us, the first answers read 90 us after the
     * submit instead of 200-1000 (docs/performance-notes.md, "64 KiB READ at batch 128"). */
    unsigned first = atomic_fetch_add(&tpp->rr, 1) % (unsigned)tpp->nlanes, lane = first;
    kvb_op_t *head[MAX_LANES] = {NULL}, **tail[MAX_LANES];
    for (int i = 0; i < tpp->nlanes; i++)
        tail[i] = &head[i];
    set_drive_hint(ops, tpp->lanes[lane]);
    while (ops) {
        uint64_t bytes = 0;
        do {
            bytes += wire_bytes(ops);
            *tail[lane] = ops;
            tail[lane] = &ops->next;
            ops = ops->next;
        } while (ops && bytes < LANE_SPREAD);
        lane = (lane + 1) % (unsigned)tpp->nlanes;
    }
    for (int i = 0; i < tpp->nlanes; i++) {
        unsigned l = (first + (unsigned)i) % (unsigned)tpp->nlanes;
        *tail[l] = NULL;
        if (head[l])
            lane_append(tpp->lanes[l], head[l]);
    }
}

static void tcp_disconnect(kvb_transport_t *tp, kvb_peer_t *p, int err)
{
    (void)tp;
    tcp_peer_t *tpp = p->tp;
    if (!tpp)
        return;
    for (int i = 0; i < tpp->nlanes; i++)
        conn_request_close(tpp->lanes[i], err);
}

static int tcp_reply(kvb_transport_t *tp, uint64_t conn_id, const void *msg, size_t len)
{
    tcp_conn_t *c = NULL;
    pthread_mutex_lock(&tp->targets_mu);
    for (size_t i = 0; i < tp->ntargets && !c; i++)
        if (tp->targets[i]->conn_id == conn_id) {
            c = tp->targets[i];
            atomic_fetch_add(&c->refs, 1);
        }
    pthread_mutex_unlock(&tp->targets_mu);
    if (!c)
        return KVB_ERR_PEER_LOST;
    uint8_t *copy = malloc(len ? len : 1);
    int rc = copy ? KVB_OK : KVB_ERR_NOMEM;
    if (copy && len)
        memcpy(copy, msg, len);
    pthread_mutex_lock(&c->mu);
    if (rc == KVB_OK && (c->dead || c->close_req || c->auth != AUTH_DONE))
        rc = KVB_ERR_PEER_LOST;
    if (rc == KVB_OK) {
        kvb_frame_hdr_t h = {.type = KVB_FRAME_NOTIFY, .len = len};
        rc = queue_frame_locked(c, &h, copy, NULL, copy);
        copy = NULL; /* the frame owns it now, whatever happened */
    }
    pthread_mutex_unlock(&c->mu);
    /* A target connection's sends are its owner thread's (it also manages backpressure): its
     * next scan flushes the queue. */
    if (rc == KVB_OK && c->th)
        thread_wake(c->th);
    free(copy);
    conn_release(c);
    return rc;
}

const kvb_transport_ops_t kvb__tcp_ops = {
    .name = "tcp",
    .create = tcp_create,
    .destroy = tcp_destroy,
    .port = tcp_port,
    .start = tcp_start,
    .connect = tcp_connect,
    .submit = tcp_submit,
    .disconnect = tcp_disconnect,
    .peer_free = tcp_peer_free,
    .drive = tcp_drive,
    .reply = tcp_reply,
};

/* ---- the TCP data path: payloads on the lanes ----------------------------------------------- */

/* Host memory needs nothing; device memory is checked against the driver (and "*" resolved) here,
 * for every path: the lanes come first. */
static int lanes_reg(kvb_provider_t *pv, kvb_region_t *reg, uint8_t *key, size_t *key_len)
{
    (void)pv;
    (void)key;
    *key_len = 0;
    return kvb__stage_region(reg);
}

/* The lanes carry bytes between host memory on both sides; the target checks the remote range
 * itself, so a range its list does not name (registered since) may still be tried. */
static bool lanes_reach(kvb_provider_t *pv, kvb_peer_t *p, const kvb_op_t *op, kvb_span_t *span)
{
    (void)pv;
    (void)p;
    *span = KVB_SPAN_ALL; /* the answer is the local region's */
    /* Device memory goes through bounce buffers on either side (the target stages its own). */
    return !op->pin || kvb__stage_can(op->pin->kind);
}

/* A WRITE from local device memory gets a bounce buffer, its bytes copied out of the device now,
 * before its frame is queued. (A READ into device memory gets one when its answer arrives: one at
 * a time per connection, since answers arrive in order.) */
/* Hands ops (a list ending at *tail) to the lanes once the copies out of the device queued for
 * them are done (*queued bytes of them); empties the list. */
static void hand_over(kvb_peer_t *p, kvb_stage_queue_t **q, kvb_op_t **head, kvb_op_t ***tail,
                      uint64_t *queued)
{
    if (q && *queued && kvb__stage_wait(*q))
        ops_end(*head, KVB_ERR_DEVICE);
    else if (*head)
        tcp_submit(p->engine->tp, p, *head);
    *head = NULL;
    *tail = head;
    *queued = 0;
}

static void lanes_submit(kvb_provider_t *pv, kvb_peer_t *p, kvb_op_t *ops)
{
    (void)pv;
    kvb_op_t *head = NULL, **tail = &head, *failed = NULL;
    kvb_stage_queue_t **q = NULL;
    uint64_t queued = 0;
    while (ops) {
        kvb_op_t *op = ops;
        ops = ops->next;
        op->next = NULL;
        if (op->pin && op->pin->kind != KVB_MEM_CPU && op->kind == KVB_OPK_WRITE) {
            q = q ? q : kvb__stage_thread_queue();
            int rc = (op->stage = kvb__stage_get(op->len)) ? KVB_OK : KVB_ERR_NOMEM;
            if (rc == KVB_OK)
                rc = kvb__stage_out_async(q, op->stage, (uintptr_t)op->local, op->len,
                                          op->pin->device);
            if (rc) {
                op->next = failed;
                failed = op;
                continue;
            }
            queued += op->len;
        }
        *tail = op;
        tail = &op->next;
        /* Copies out of the device are waited for a chunk at a time, each chunk's frames handed
         * to the lanes at once: the sockets send one chunk while the next is copied. */
        if (queued >= STAGE_OUT_CHUNK)
            hand_over(p, q, &head, &tail, &queued);
    }
    hand_over(p, q, &head, &tail, &queued);
    ops_end(failed, KVB_ERR_DEVICE);
}

static int lanes_progress(kvb_batch_t *b, uint64_t deadline)
{
    return tcp_drive(b, deadline);
}

const kvb_provider_ops_t kvb__tcp_provider = {
    .name = "tcp",
    .id = KVB_PATH_TCP,
    .reg = lanes_reg,
    .reaches = lanes_reach,
    .submit = lanes_submit,
    .progress = lanes_progress,
};
