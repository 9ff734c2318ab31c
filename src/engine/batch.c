/* SPDX-License-Identifier: Apache-2.0 */
/* Batches: checking and splitting requests into per-lane operations, tracking each request's
 * state as transports report completions, deadlines, cancellation, and the notification that a
 * batch sends once all of its data is placed. */
#include "engine/internal.h"

#include <errno.h>
#include <sanitizer/asan_interface.h> /* no-ops unless built with AddressSanitizer */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/clock.h"
#include "common/log.h"

/* ---- batch memory ---------------------------------------------------------------------------
 * A batch, its requests and its ops are one block. Released blocks are kept per engine, up to
 * BATCH_CACHE_BYTES, and the next batch that fits takes one: a KV pull submits a batch per layer
 * and frees them all at its end, and with plain malloc/free the heap gave those megabytes back to
 * the kernel and the next pull faulted them in again - a quarter of the CPU a same-host pull's
 * submits took (see docs/performance-notes.md, "Same-host KV pulls"). */
#define BATCH_CACHE_BYTES (16u << 20)
#define BATCH_CACHE_SLACK 4 /* a kept block serves batches down to a quarter of its size */

typedef struct batch_mem {
    struct batch_mem *next;
    size_t cap;
} batch_mem_t;

_Static_assert(sizeof(size_t) == sizeof(uint64_t), "op counts are size_t");
#define ALIGN_UP(x) (((x) + _Alignof(max_align_t) - 1) & ~(size_t)(_Alignof(max_align_t) - 1))

/* A zeroed block of at least `need` bytes (its size in *cap), kept or new; NULL if none. */
static void *batch_mem_get(kvb_engine_t *e, size_t need, size_t *cap)
{
    batch_mem_t *m = NULL;
    pthread_mutex_lock(&e->batch_mu);
    for (batch_mem_t **pp = &e->batch_cache; *pp; pp = &(*pp)->next)
        if ((*pp)->cap >= need && (*pp)->cap / BATCH_CACHE_SLACK <= need) {
            m = *pp;
            *pp = m->next;
            e->batch_cached -= m->cap;
            break;
        }
    pthread_mutex_unlock(&e->batch_mu);
    if (m) {
        *cap = m->cap;
        ASAN_UNPOISON_MEMORY_REGION(m, need); /* the rest stays out of bounds */
        memset(m, 0, need);
        return m;
    }
    *cap = need;
    return calloc(1, need);
}

static void batch_mem_put(kvb_engine_t *e, void *p, size_t cap)
{
    pthread_mutex_lock(&e->batch_mu);
    if (e->batch_cached + cap <= BATCH_CACHE_BYTES) {
        batch_mem_t *m = p;
        ASAN_UNPOISON_MEMORY_REGION(m, sizeof *m);
        *m = (batch_mem_t){.next = e->batch_cache, .cap = cap};
        /* A released batch reached through a stale pointer stays an error under ASan. */
        ASAN_POISON_MEMORY_REGION((uint8_t *)p + sizeof *m, cap - sizeof *m);
        e->batch_cache = m;
        e->batch_cached += cap;
        p = NULL;
    }
    pthread_mutex_unlock(&e->batch_mu);
    free(p);
}

void kvb__batch_cache_drain(kvb_engine_t *e)
{
    while (e->batch_cache) {
        batch_mem_t *m = e->batch_cache;
        e->batch_cache = m->next;
        ASAN_UNPOISON_MEMORY_REGION(m, m->cap);
        free(m);
    }
    e->batch_cached = 0;
}

/* Drops n references; the last one frees the batch. */
static void batch_release_n(kvb_batch_t *b, unsigned n)
{
    if (atomic_fetch_sub(&b->refs, n) != n)
        return;
    kvb__peer_release(b->notify_peer);
    if (b->drive_hint)
        b->hint_release(b->drive_hint);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    kvb_engine_t *e = b->engine;
    free(b->notify_buf);
    batch_mem_put(e, b, b->mem_cap);
    kvb__engine_put(e);
}

static void batch_release(kvb_batch_t *b)
{
    batch_release_n(b, 1);
}

static bool batch_done(const kvb_batch_t *b)
{
    return b->open == 0 && b->notify_state != KVB_NOTIFY_WAITING &&
           b->notify_state != KVB_NOTIFY_SENT;
}

/* A request's state leaves PENDING: stored so that a copy looking without the lock
 * (kvb__op_dst_held) sees it whole. Caller holds b->mu. */
static void req_end(kvb_req_t *r, kvb_req_state_t state)
{
    __atomic_store_n(&r->state, state, __ATOMIC_SEQ_CST);
}

/* Waits out the copies into b's destinations that began before the requests just ended were
 * published as ended. A copy announces itself in the current epoch's slot, then checks that the
 * epoch did not move, and only then looks at its requests (kvb__batch_copy_begin): one that
 * began after the epoch moved sees the ends and drops its bytes; one counted in the old slot is
 * waited for here. Copies never take mu and never block (a non-blocking receive, a queued device
 * copy), so the wait is one copy's length; copies begun meanwhile count in the new slot and do
 * not hold it up. Caller holds b->mu, which orders the epoch's moves. */
static void copies_drain(kvb_batch_t *b)
{
    unsigned old = atomic_fetch_add(&b->copy_epoch, 1) & 1u;
    for (unsigned spins = 0; atomic_load(&b->copying[old]) != 0; spins++) {
        if (spins < 256)
            kvb__cpu_relax();
        else
            sched_yield();
    }
}

unsigned kvb__batch_copy_begin(kvb_batch_t *b)
{
    for (;;) {
        unsigned e = atomic_load(&b->copy_epoch);
        atomic_fetch_add(&b->copying[e & 1u], 1);
        if (atomic_load(&b->copy_epoch) == e)
            return e & 1u;
        atomic_fetch_sub(&b->copying[e & 1u], 1); /* an end came in between: look again */
    }
}

void kvb__batch_copy_end(kvb_batch_t *b, unsigned slot)
{
    atomic_fetch_sub(&b->copying[slot & 1u], 1);
}

/* Ends every request still pending with `state`/`error`. Caller holds b->mu. */
static void end_pending(kvb_batch_t *b, kvb_req_state_t state, int error)
{
    bool ended = false;
    for (size_t i = 0; i < b->n && b->open > 0; i++) {
        if (b->reqs[i].state == KVB_REQ_PENDING) {
            req_end(&b->reqs[i], state);
            b->reqs[i].error = error;
            b->open--;
            ended = true;
            if (state == KVB_REQ_TIMEOUT)
                atomic_fetch_add_explicit(&b->engine->st_failed, 1, memory_order_relaxed);
        }
    }
    if (ended)
        copies_drain(b);
    if (b->notify_state == KVB_NOTIFY_WAITING || b->notify_state == KVB_NOTIFY_SENT) {
        b->notify_state = KVB_NOTIFY_DONE;
        b->notify_error = error;
    }
    pthread_cond_broadcast(&b->cv);
}

/* Applies the deadline lazily: whoever looks at the batch after it sees the timeout. */
static void check_deadline(kvb_batch_t *b)
{
    if (!batch_done(b) && kvb__now_ns() >= b->deadline)
        end_pending(b, KVB_REQ_TIMEOUT, KVB_ERR_TIMEOUT);
}

static void send_notify(kvb_batch_t *b)
{
    kvb_peer_t *p = b->notify_peer;
    b->notify_op.next = NULL;
    p->engine->tp_ops->submit(p->engine->tp, p, &b->notify_op);
}

/* The engine's counters for ops that ended, gathered, then added once. */
typedef struct {
    unsigned paths; /* bit i: path_ops[i] and path_bytes[i] in use */
    uint64_t failed, completed, path_ops[KVB_PATHS], path_bytes[KVB_PATHS];
} op_tally_t;

static void tally_add(kvb_engine_t *e, const op_tally_t *t)
{
    if (t->failed)
        atomic_fetch_add_explicit(&e->st_failed, t->failed, memory_order_relaxed);
    if (t->completed)
        atomic_fetch_add_explicit(&e->st_completed, t->completed, memory_order_relaxed);
    for (unsigned m = t->paths; m; m &= m - 1) {
        unsigned i = (unsigned)__builtin_ctz(m);
        atomic_fetch_add_explicit(&e->st_path_ops[i], t->path_ops[i], memory_order_relaxed);
        atomic_fetch_add_explicit(&e->st_path_bytes[i], t->path_bytes[i], memory_order_relaxed);
    }
}

/* Counts op's bytes or failure against its request. Caller holds b->mu. */
static void op_account(kvb_batch_t *b, kvb_op_t *op, int status, uint64_t bytes, op_tally_t *t)
{
    kvb_req_t *r = &b->reqs[op->req];
    op->ended = 1;
    if (r->state != KVB_REQ_PENDING)
        return;
    if (status < 0) { /* its other ops may be copying: the caller drains (t->failed) */
        req_end(r, status == KVB_ERR_TIMEOUT ? KVB_REQ_TIMEOUT : KVB_REQ_FAILED);
        r->error = status;
        b->open--;
        t->failed++;
        return;
    }
    r->bytes += bytes;
    t->paths |= 1u << op->path;
    t->path_bytes[op->path] += bytes;
    t->path_ops[op->path]++;
    if (--r->ops_left == 0) { /* every byte in: no copy for it is left to wait for */
        req_end(r, KVB_REQ_COMPLETED);
        b->open--;
        t->completed++;
    }
}

/* Whether the batch's notification goes now: every request ended, all of them COMPLETED (else
 * the notification ends CANCELED). Caller holds b->mu; a true answer holds a batch reference
 * for send_notify. */
static bool notify_due(kvb_batch_t *b)
{
    if (b->open != 0 || b->notify_state != KVB_NOTIFY_WAITING)
        return false;
    bool all_ok = !b->freed;
    for (size_t i = 0; i < b->n && all_ok; i++)
        all_ok = b->reqs[i].state == KVB_REQ_COMPLETED;
    if (!all_ok) {
        b->notify_state = KVB_NOTIFY_DONE;
        b->notify_error = KVB_ERR_CANCELED;
        return false;
    }
    b->notify_state = KVB_NOTIFY_SENT;
    atomic_fetch_add(&b->refs, 1);
    return true;
}

void kvb__op_done(kvb_op_t *op, int status, uint64_t bytes)
{
    kvb_batch_t *b = op->batch;
    bool notify = false;
    pthread_mutex_lock(&b->mu);
    if (op->req == KVB_OP_NOTIFY_REQ) {
        if (b->notify_state == KVB_NOTIFY_SENT) {
            b->notify_state = KVB_NOTIFY_DONE;
            b->notify_error = status;
        }
    } else {
        op_tally_t t = {0};
        op_account(b, op, status, bytes, &t);
        if (t.failed)
            copies_drain(b);
        tally_add(b->engine, &t);
        notify = notify_due(b);
        b->held--;
    }
    if (batch_done(b) || b->held == 0 || b->settlers)
        pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    if (op->pin)
        kvb__region_unpin(&b->engine->registry, op->pin);
    op->pin = NULL;
    /* Outside the lock: the transport may complete the op synchronously (peer lost). */
    if (notify)
        send_notify(b);
    batch_release(b);
}

void kvb__ops_done(kvb_op_t *ops, int status)
{
    while (ops) {
        if (ops->req == KVB_OP_NOTIFY_REQ) { /* a notification's op ends on its own */
            kvb_op_t *next = ops->next;
            kvb__op_done(ops, status, 0);
            ops = next;
            continue;
        }
        kvb_batch_t *b = ops->batch;
        kvb_op_t *end = ops;
        unsigned n = 0;
        op_tally_t t = {0};
        pthread_mutex_lock(&b->mu);
        for (; end && end->batch == b && end->req != KVB_OP_NOTIFY_REQ; end = end->next, n++)
            op_account(b, end, status, status ? 0 : end->len, &t);
        if (t.failed)
            copies_drain(b);
        tally_add(b->engine, &t);
        bool notify = notify_due(b);
        b->held -= n;
        if (batch_done(b) || b->held == 0 || b->settlers)
            pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        /* Pins of one region come in runs: dropped per run. */
        kvb_region_t *pin = NULL;
        unsigned pins = 0;
        for (kvb_op_t *op = ops; op != end; op = op->next) {
            if (op->pin != pin && pins) {
                kvb__region_unpin_n(&b->engine->registry, pin, pins);
                pins = 0;
            }
            pin = op->pin;
            pins += pin != NULL;
            op->pin = NULL;
        }
        if (pins)
            kvb__region_unpin_n(&b->engine->registry, pin, pins);
        if (notify)
            send_notify(b);
        batch_release_n(b, n); /* `end` was read first: the ops live in the batch's memory */
        ops = end;
    }
}

kvb_batch_t *kvb__op_linger(kvb_op_t *op)
{
    kvb_batch_t *b = op->batch;
    atomic_fetch_add(&b->refs, 1);
    pthread_mutex_lock(&b->mu);
    b->held++;
    pthread_mutex_unlock(&b->mu);
    return b;
}

void kvb__batch_unlinger(kvb_batch_t *b)
{
    pthread_mutex_lock(&b->mu);
    if (--b->held == 0 || b->settlers)
        pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    batch_release(b);
}

/* A freed batch needs no look of its own: kvb_batch_free ends every pending request first. */
uint8_t *kvb__op_dst_held(const kvb_op_t *op)
{
    kvb_req_state_t st = __atomic_load_n(&op->batch->reqs[op->req].state, __ATOMIC_SEQ_CST);
    return st == KVB_REQ_PENDING ? op->local : NULL;
}

/* Pins of one region counted while a submit checks its requests and added at once - one atomic
 * add for a run of requests into the region, not one each. The first request's pin holds the
 * region meanwhile. */
typedef struct {
    kvb_region_t *region; /* the region the last request found, pinned */
    unsigned n;           /* pins counted for it since, not added yet */
} owed_pins_t;

static void owed_settle(owed_pins_t *o)
{
    kvb__region_pin_n(o->region, o->n);
    o->n = 0;
}

/* Checks request i and pins its local region into *pin: the region the previous request found
 * (owed) is pinned without the registry's lock when the range lies in it (requests come in runs),
 * its pin counted there. *pin stays set on a failure after the pin (the caller unpins it). */
static int check_request(kvb_engine_t *e, const kvb_request_t *r, size_t i, uint64_t *nops,
                         owed_pins_t *owed, kvb_region_t **pin)
{
    uint64_t end, chunks;
    if ((r->opcode != KVB_OP_READ && r->opcode != KVB_OP_WRITE) || !r->local || r->len == 0 ||
        r->segment == 0) {
        KVB_WARN("request %zu: invalid opcode, address, length or segment", i);
        return KVB_ERR_INVALID_ARG;
    }
    if (kvb__add_u64(r->remote, r->len, &end) || kvb__add_u64((uintptr_t)r->local, r->len, &end)) {
        KVB_WARN("request %zu: address + length overflows", i);
        return KVB_ERR_OVERFLOW;
    }
    if (owed->region && kvb__region_covers(owed->region, (uintptr_t)r->local, r->len, 0)) {
        *pin = owed->region;
        owed->n++;
    } else {
        owed_settle(owed);
        int rc = kvb__registry_check(&e->registry, (uintptr_t)r->local, r->len, 0,
                                     KVB_ERR_LOCAL_NOT_REGISTERED, pin);
        if (rc) {
            KVB_WARN("request %zu: local range %p+%zu is not registered", i, r->local, r->len);
            return rc;
        }
        owed->region = *pin;
    }
    chunks = r->len / KVB_CHUNK_SIZE + (r->len % KVB_CHUNK_SIZE != 0); /* no len + CHUNK - 1 wrap */
    return kvb__add_u64(*nops, chunks, nops) ? KVB_ERR_OVERFLOW : KVB_OK;
}

static int batch_alloc(kvb_engine_t *e, size_t n, uint64_t nops, const kvb_batch_opts_t *o,
                       kvb_batch_t **out)
{
    /* [batch][requests][ops]; the counts are bounded by the caller (KVB_BATCH_MAX requests,
     * their ops counted without overflow), the sizes checked here all the same. */
    size_t at_reqs = ALIGN_UP(sizeof(kvb_batch_t)), at_ops, need, cap;
    if (kvb__mul_size(n, sizeof(kvb_req_t), &at_ops) || kvb__add_size(at_reqs, at_ops, &at_ops) ||
        kvb__mul_size((size_t)nops, sizeof(kvb_op_t), &need) ||
        kvb__add_size(ALIGN_UP(at_ops), need, &need))
        return KVB_ERR_OVERFLOW;
    at_ops = ALIGN_UP(at_ops);
    uint8_t *mem = batch_mem_get(e, need, &cap);
    if (!mem)
        return KVB_ERR_NOMEM;
    kvb_batch_t *b = (kvb_batch_t *)mem;
    int rc = KVB_ERR_NOMEM;
    b->mem_cap = cap;
    b->reqs = n ? (kvb_req_t *)(mem + at_reqs) : NULL;
    b->ops = nops ? (kvb_op_t *)(mem + at_ops) : NULL;
    if (o && o->notify_segment) {
        b->notify_buf = malloc(o->notify_len ? o->notify_len : 1);
        if (!b->notify_buf)
            goto fail;
        b->notify_peer = kvb__segment_peer(e, o->notify_segment);
        if (!b->notify_peer) {
            rc = KVB_ERR_BAD_SEGMENT;
            goto fail;
        }
        if (o->notify_len)
            memcpy(b->notify_buf, o->notify, o->notify_len);
        b->notify_op = (kvb_op_t){.batch = b,
                                  .req = KVB_OP_NOTIFY_REQ,
                                  .kind = KVB_OPK_NOTIFY,
                                  .local = b->notify_buf,
                                  .len = o->notify_len};
        b->notify_state = KVB_NOTIFY_WAITING;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    uint32_t tmo = o && o->timeout_ms ? o->timeout_ms : e->cfg.timeout_ms;
    b->engine = e;
    atomic_fetch_add(&e->refs, 1); /* dropped by batch_release */
    b->deadline = kvb__deadline_ms(tmo);
    b->drive_path = -2; /* no op routed yet */
    b->n = n;
    b->nops = (size_t)nops;
    b->open = n;
    b->held = (size_t)nops;
    atomic_init(&b->refs, 1 + (unsigned)nops);
    *out = b;
    return KVB_OK;
fail:
    free(b->notify_buf);
    batch_mem_put(e, b, cap);
    return rc;
}

/* Builds the ops of request i, each holding a pin on the local region (the request's own pin
 * goes to its first op), and appends them in order to the list ending at *tail. */
static void split_request(kvb_batch_t *b, const kvb_request_t *r, uint32_t i, kvb_region_t *pin,
                          size_t *next_op, kvb_op_t ***tail)
{
    uint64_t off = 0;
    b->reqs[i].state = KVB_REQ_PENDING;
    while (off < r->len) {
        uint64_t len = r->len - off < KVB_CHUNK_SIZE ? r->len - off : KVB_CHUNK_SIZE;
        kvb_op_t *op = &b->ops[(*next_op)++];
        if (off > 0)
            atomic_fetch_add(&pin->refs, 1);
        /* Field by field: the op is zeroed already (batch_mem_get), and a compound literal
         * zeroed each 88-byte op again with its own `rep stos`, a third of submit's time in
         * batches of small requests. */
        op->batch = b;
        op->req = i;
        op->kind = r->opcode == KVB_OP_READ ? KVB_OPK_READ : KVB_OPK_WRITE;
        op->local = (uint8_t *)r->local + off;
        op->remote = r->remote + off;
        op->len = len;
        op->pin = pin;
        b->reqs[i].ops_left++;
        **tail = op;
        *tail = &op->next;
        off += len;
    }
}

/* Gives each op of `ops` (all to peer p) to the first path in the engine's order that reaches it,
 * and starts them, one list per path in their original order. An op no path reaches (device
 * memory that no path to this peer can serve) ends at once with KVB_ERR_UNSUPPORTED. */
static void route(kvb_engine_t *e, kvb_peer_t *p, kvb_op_t *ops)
{
    /* The peer's region of each op, when a path to it looks at it (the lanes do not: the target
     * checks); the list is held across the submits (op->rregion). */
    bool need = false;
    for (size_t i = 0; i < e->norder; i++)
        need =
            need || ((p->paths & (1u << e->order[i])) && kvb__provider(e->order[i])->remote_region);
    kvb_region_list_t *rl = need ? kvb__peer_regions(p) : NULL;
    kvb_op_t *head[KVB_PATHS] = {0}, **tail[KVB_PATHS];
    for (unsigned id = 0; id < KVB_PATHS; id++)
        tail[id] = &head[id];
    kvb_batch_t *b = ops ? ops->batch : NULL;
    kvb_op_t *unreached = NULL;
    int drive = b ? b->drive_path : -1;
    /* Requests come in runs: on one remote region (the previous op's), and from local memory
     * where every path asked gave the same answer as for the previous op (the span their
     * reaches() widened), so the paths are asked once per run, not per request. */
    const kvb_region_desc_t *last = NULL;
    const kvb_region_t *run_pin = NULL;
    kvb_span_t run = {0, 0}; /* empty: no run yet */
    int run_path = -1;
    while (ops) {
        kvb_op_t *op = ops;
        ops = ops->next;
        op->next = NULL;
        if (last && kvb__range_within(op->remote, op->len, last->info.addr, last->info.len))
            op->rregion = last;
        else
            op->rregion = rl ? kvb__region_find(rl->d, rl->n, op->remote, op->len) : NULL;
        /* check_request made local + len not wrap */
        uint64_t lo = (uintptr_t)op->local, hi = lo + op->len;
        int path = -1;
        if (op->rregion == last && op->pin == run_pin && lo >= run.lo && hi <= run.hi) {
            path = run_path;
        } else {
            kvb_span_t all = KVB_SPAN_ALL;
            for (size_t i = 0; i < e->norder && path < 0; i++) {
                unsigned id = e->order[i];
                if (!(p->paths & (1u << id)))
                    continue;
                kvb_span_t s = {lo, hi};
                if (kvb__provider(id)->reaches(e->path_state[id], p, op, &s))
                    path = (int)id;
                all.lo = s.lo > all.lo ? s.lo : all.lo;
                all.hi = s.hi < all.hi ? s.hi : all.hi;
            }
            last = op->rregion;
            run_pin = op->pin;
            run = all;
            run_path = path;
        }
        if (path < 0) {
            op->next = unreached;
            unreached = op;
            continue;
        }
        op->path = (uint8_t)path;
        if (kvb__op_lane_read(op)) /* before any submit: the batch is not the caller's yet */
            b->lane_reads++;
        *tail[path] = op;
        tail[path] = &op->next;
        drive = drive == -2 || drive == path ? path : -1;
    }
    if (b) /* before any submit: the batch reaches no waiter until submit() returns it */
        b->drive_path = drive;
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if (head[id])
            kvb__provider(id)->submit(e->path_state[id], p, head[id]);
    for (bool first = true; unreached; first = false) {
        kvb_op_t *op = unreached;
        unreached = op->next;
        if (first)
            KVB_WARN("segment %s: no data path reaches %s memory at 0x%llx from local %s memory",
                     p->name, op->rregion ? op->rregion->info.location : "its",
                     (unsigned long long)op->remote, op->pin ? op->pin->location : "host");
        kvb__op_done(op, KVB_ERR_UNSUPPORTED, 0);
    }
    kvb__region_list_put(rl);
}

static int submit(kvb_engine_t *e, const kvb_request_t *reqs, size_t n, const kvb_batch_opts_t *o,
                  kvb_batch_t **out)
{
    if (!e || (n && !reqs) || !out || n > UINT32_MAX - 1)
        return KVB_ERR_INVALID_ARG;
    if (o && o->notify_segment && ((o->notify_len && !o->notify) || o->notify_len > KVB_NOTIFY_MAX))
        return o->notify_len > KVB_NOTIFY_MAX ? KVB_ERR_TOO_LARGE : KVB_ERR_INVALID_ARG;
    /* Check everything, pin local regions and resolve every segment before anything is queued,
     * so that an error submits nothing. Up to ON_STACK requests keep their peers and pins here. */
    enum { ON_STACK = 128 };
    kvb_peer_t *peers_here[ON_STACK];
    kvb_region_t *pins_here[ON_STACK];
    bool heap = n > ON_STACK;
    kvb_peer_t **peers = heap ? calloc(n, sizeof *peers) : peers_here;
    kvb_region_t **pins = heap ? calloc(n, sizeof *pins) : pins_here;
    if (!peers || !pins) {
        free(heap ? peers : NULL);
        free(heap ? pins : NULL);
        return KVB_ERR_NOMEM;
    }
    if (!heap) { /* only the n used */
        memset(peers_here, 0, n * sizeof *peers);
        memset(pins_here, 0, n * sizeof *pins);
    }
    uint64_t nops = 0;
    int rc = KVB_OK;
    owed_pins_t owed = {NULL, 0};
    for (size_t i = 0; i < n && rc == KVB_OK; i++)
        rc = check_request(e, &reqs[i], i, &nops, &owed, &pins[i]);
    owed_settle(&owed); /* every pins[i] counted before any is let go */
    if (rc == KVB_OK && nops > UINT32_MAX)
        rc = KVB_ERR_TOO_LARGE;
    /* Requests come grouped by segment in practice: reuse the previous lookup. */
    for (size_t i = 0; i < n && rc == KVB_OK; i++) {
        if (i > 0 && reqs[i].segment == reqs[i - 1].segment) {
            peers[i] = peers[i - 1];
            continue;
        }
        peers[i] = kvb__segment_peer(e, reqs[i].segment);
        if (!peers[i])
            rc = KVB_ERR_BAD_SEGMENT;
    }
    kvb_batch_t *b = NULL;
    if (rc == KVB_OK)
        rc = batch_alloc(e, n, nops, o, &b);
    if (rc == KVB_OK) {
        atomic_fetch_add(&e->live_batches, 1);
        /* Queue per run of requests to one peer; the transport spreads each list over lanes. */
        size_t next_op = 0;
        for (size_t i = 0; i < n;) {
            kvb_op_t *head = NULL, **tail = &head;
            size_t j = i;
            for (; j < n && peers[j] == peers[i]; j++) {
                split_request(b, &reqs[j], (uint32_t)j, pins[j], &next_op, &tail);
                pins[j] = NULL; /* owned by the ops now */
            }
            route(e, peers[i], head);
            i = j;
        }
        if (n == 0) { /* a notification alone: nothing to wait for before sending it */
            b->notify_state = KVB_NOTIFY_SENT;
            atomic_fetch_add(&b->refs, 1);
            send_notify(b);
        }
        *out = b;
    }
    for (size_t i = 0; i < n; i++) {
        if (pins[i])
            kvb__region_unpin(&e->registry, pins[i]);
        if (peers[i] && (i == 0 || peers[i] != peers[i - 1]))
            kvb__peer_release(peers[i]);
    }
    if (heap) {
        free(peers);
        free(pins);
    }
    return rc;
}

int kvb_batch_submit(kvb_engine_t *e, const kvb_request_t *reqs, size_t n,
                     const kvb_batch_opts_t *opts, kvb_batch_t **out)
{
    if (n == 0)
        return KVB_ERR_INVALID_ARG;
    return submit(e, reqs, n, opts, out);
}

size_t kvb_batch_size(const kvb_batch_t *b)
{
    return b ? b->n : 0;
}

int kvb_batch_status(kvb_batch_t *b, size_t i, kvb_req_status_t *out)
{
    if (!b || !out || i >= b->n)
        return KVB_ERR_INVALID_ARG;
    pthread_mutex_lock(&b->mu);
    check_deadline(b);
    const kvb_req_t *r = &b->reqs[i];
    *out = (kvb_req_status_t){.state = r->state, .error = r->error, .bytes = r->bytes};
    pthread_mutex_unlock(&b->mu);
    return KVB_OK;
}

/* First error in request order, then the notification's; KVB_OK if none. Caller holds b->mu. */
static int batch_result(const kvb_batch_t *b)
{
    for (size_t i = 0; i < b->n; i++)
        if (b->reqs[i].state != KVB_REQ_COMPLETED)
            return b->reqs[i].error;
    return b->notify_state == KVB_NOTIFY_DONE ? b->notify_error : KVB_OK;
}

bool kvb__batch_done(kvb_batch_t *b)
{
    pthread_mutex_lock(&b->mu);
    bool done = batch_done(b);
    pthread_mutex_unlock(&b->mu);
    return done;
}

int kvb_batch_wait(kvb_batch_t *b, int timeout_ms)
{
    if (!b)
        return KVB_ERR_INVALID_ARG;
    uint64_t user = kvb__deadline_ms(timeout_ms);
    int rc;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        check_deadline(b);
        if (batch_done(b)) {
            rc = batch_result(b);
            break;
        }
        uint64_t now = kvb__now_ns(), until = user < b->deadline ? user : b->deadline;
        if (now >= user) {
            rc = KVB_ERR_AGAIN;
            break;
        }
        /* One connection carries the whole batch: sleep on its socket and read the answers
         * here. A wakeup from the socket is much cheaper than a hand-off between threads. */
        const kvb_provider_ops_t *pv =
            b->drive_path >= 0 ? kvb__provider((unsigned)b->drive_path) : NULL;
        if (b->drive_hint && pv && pv->progress) {
            pthread_mutex_unlock(&b->mu);
            int drc = pv->progress(b, until);
            pthread_mutex_lock(&b->mu);
            /* Another thread drives the connection: sleep on the condition - but only after
             * looking again, since answers may have landed while we held no lock. */
            if (drc != KVB_ERR_BUSY || batch_done(b))
                continue;
        }
        struct timespec ts = kvb__timespec_of(until);
        int err = pthread_cond_timedwait(&b->cv, &b->mu, &ts);
        if (err && err != ETIMEDOUT) {
            rc = KVB_ERR_SYSTEM;
            break;
        }
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

/* Whether some op of the batch may still move data. A READ over the lanes into host memory
 * whose request has ended does not, although the lane keeps it until its answer: that answer's
 * bytes are dropped (a device READ's copy, queued before the end, may still run). Caller holds
 * b->mu. */
static bool unsettled(const kvb_batch_t *b)
{
    size_t n = b->held;
    for (size_t i = 0; i < b->nops && n > 0 && b->lane_reads > 0; i++) {
        const kvb_op_t *op = &b->ops[i]; /* pin is valid while the op has not ended */
        if (!op->ended && b->reqs[op->req].state != KVB_REQ_PENDING && kvb__op_lane_read(op))
            n--;
    }
    return n > 0;
}

int kvb_batch_settle(kvb_batch_t *b, int timeout_ms)
{
    if (!b || timeout_ms < 0)
        return KVB_ERR_INVALID_ARG;
    uint64_t until = kvb__deadline_ms(timeout_ms);
    int rc = KVB_OK;
    pthread_mutex_lock(&b->mu);
    b->settlers++;
    for (;;) {
        check_deadline(b);
        if (!unsettled(b))
            break;
        if (kvb__now_ns() >= until) {
            rc = KVB_ERR_AGAIN;
            break;
        }
        /* The deadline, when it comes first, ends requests (and settles READs over the lanes)
         * without a wake: look again then. */
        uint64_t wake = !batch_done(b) && b->deadline < until ? b->deadline : until;
        struct timespec ts = kvb__timespec_of(wake);
        int err = pthread_cond_timedwait(&b->cv, &b->mu, &ts);
        if (err && err != ETIMEDOUT) {
            rc = KVB_ERR_SYSTEM;
            break;
        }
    }
    b->settlers--;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

/* Lets the paths drop the batch's ops they have not started. */
static void cancel_paths(kvb_batch_t *b)
{
    kvb_engine_t *e = b->engine;
    pthread_rwlock_rdlock(&e->paths_lock); /* the engine may be going, or gone: see paths_lock */
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if ((e->paths & (1u << id)) && kvb__provider(id)->cancel)
            kvb__provider(id)->cancel(e->path_state[id], b);
    pthread_rwlock_unlock(&e->paths_lock);
}

int kvb_batch_cancel(kvb_batch_t *b)
{
    if (!b)
        return KVB_ERR_INVALID_ARG;
    pthread_mutex_lock(&b->mu);
    end_pending(b, KVB_REQ_CANCELED, KVB_ERR_CANCELED);
    pthread_mutex_unlock(&b->mu);
    cancel_paths(b);
    return KVB_OK;
}

void kvb_batch_free(kvb_batch_t *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&b->mu);
    end_pending(b, KVB_REQ_CANCELED, KVB_ERR_CANCELED); /* waits out copies into them */
    b->freed = true;
    pthread_mutex_unlock(&b->mu);
    cancel_paths(b);
    atomic_fetch_sub(&b->engine->live_batches, 1);
    batch_release(b);
}

int kvb_notify_send(kvb_engine_t *e, kvb_segment_t seg, const void *msg, size_t len, int timeout_ms)
{
    if (!e || seg == 0 || (len && !msg))
        return KVB_ERR_INVALID_ARG;
    kvb_batch_opts_t o = {.timeout_ms = timeout_ms < 0 ? 0 : (uint32_t)timeout_ms,
                          .notify_segment = seg,
                          .notify = msg,
                          .notify_len = len};
    if (timeout_ms == 0)
        o.timeout_ms = 1;
    kvb_batch_t *b;
    int rc = submit(e, NULL, 0, &o, &b);
    if (rc)
        return rc;
    rc = kvb_batch_wait(b, -1);
    kvb_batch_free(b);
    return rc;
}
