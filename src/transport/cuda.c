/* SPDX-License-Identifier: Apache-2.0 */
/* The cuda data path: device memory of a same-host peer, reached one-sided through CUDA IPC.
 *
 * Registering device memory (location "cuda:N", or "*" when the driver says it is device memory)
 * makes a key blob: the IPC handle of the allocation holding the region, the allocation's base
 * and size, and the PCI bus id of its device (ordinals differ between processes that see
 * different CUDA_VISIBLE_DEVICES). A same-host peer opens that handle once per allocation, on the
 * device at that bus id, and from then on copies with cuMemcpyAsync on a stream of that device:
 * no request frames, no target thread. Where the handle cannot be opened (no shared PID namespace,
 * memory that is not IPC-capable, the device not visible here) the path says why, once, and does
 * not take that memory, so the engine's next path does.
 *
 * Submitting starts the copies at once, in the submitting thread, on a stream per device
 * (consecutive requests as one copy), and records an event after them. The ops end together when
 * the event has: a READ is COMPLETED only when its bytes are in local memory, a WRITE only when
 * they are in the peer's. The batch's waiting thread watches the event itself (cuda_progress), so
 * the usual submit-and-wait costs no hand-off between threads; a worker thread ends the copies
 * nobody waits for. The streams are blocking ones (flags 0), so each copy is ordered after work
 * the application queued on the legacy default stream of the same context before it submitted.
 *
 * What the peer is trusted with: CUDA IPC maps a whole allocation, so a same-host peer that
 * proved the cluster secret can reach all of an allocation that holds a registered region. The
 * engine's own requests stay within registered regions and their rights (checked here, on the
 * initiator, since no target sees them); register whole allocations, or leave `cuda` out of
 * `protocol`, where that matters. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "engine/internal.h"
#include "transport/cuda_driver.h"

/* The key blob of a device region, in host byte order (only a same-host peer uses it). */
typedef struct {
    kvb_cu_ipc_mem_handle_t handle; /* of the allocation's base */
    uint64_t base, size;            /* the allocation, in the owner's address space */
    char bus[KVB_CUDA_BUS_ID_LEN];  /* its device, NUL-terminated */
} cuda_key_t;
_Static_assert(sizeof(cuda_key_t) <= KVB_KEY_MAX, "the key fits a key blob");

/* A peer's allocation, opened here (or found unopenable). */
typedef struct {
    kvb_cu_ipc_mem_handle_t handle;
    uint64_t base, size;
    kvb_cu_ptr_t mapped; /* where it is mapped here; 0 if it could not be opened */
    int dev;             /* our ordinal of its device */
} cuda_map_t;

typedef struct {
    pthread_mutex_t mu; /* guards maps; held while opening one (once per allocation) */
    cuda_map_t *maps;
    size_t n, cap;
    bool warned; /* a failed open was logged */
} cuda_peer_t;

/* One submit's copies on one device: ops of one batch, started on the device's stream, and an
 * event recorded after the last. Whoever takes it off the path's list ends its ops. */
typedef struct cuda_group {
    struct cuda_group *next;
    kvb_op_t *ops, **tail; /* linked by op->next, ended together */
    kvb_peer_t *peer;      /* a reference, so the peer's maps outlive the copies */
    kvb_cu_event_t event;  /* recorded after the last copy; NULL until one started */
    int dev;
    int status;  /* the first launch error: the ops fail with it */
    bool driven; /* a waiting thread watches the event (cuda_path_t.mu) */
    /* The run of consecutive requests being gathered into one copy. */
    kvb_cu_ptr_t run_dst, run_src;
    uint64_t run_len;
} cuda_group_t;

typedef struct {
    kvb_cu_stream_t stream; /* NULL where it could not be made (logged at create) */
    kvb_cu_event_t *events; /* recorded and ended, ready to use again (cuda_path_t.mu) */
    size_t nevents, cap;
} cuda_dev_t;

typedef struct {
    atomic_uint refs; /* the engine's, plus one per batch naming it as its drive hint */
    kvb_engine_t *engine;
    pthread_t worker;
    pthread_mutex_t mu; /* guards the groups, the spare events, stop and driving */
    pthread_cond_t cv;
    cuda_group_t *head, **tail; /* copies in flight, oldest first */
    bool stop;
    bool idle;        /* the worker sleeps on cv: a new group must wake it */
    atomic_uint seq;  /* moves on when a group comes or a waiter lets one go, and at stop */
    unsigned driving; /* waiting threads watching events (cuda_progress) */
    cuda_dev_t *devs; /* per device, made at create */
    int ndev;
} cuda_path_t;

/* ---- registration -----------------------------------------------------------------------------
 */

/* The TCP lanes' registration ran first (transports.c orders paths by id) and checked the memory
 * against the driver (kvb__stage_region): here device memory is known to be what it says. */
static int cuda_reg(kvb_provider_t *pv, kvb_region_t *reg, uint8_t *key, size_t *key_len)
{
    (void)pv;
    if (reg->kind != KVB_MEM_CUDA)
        return KVB_ERR_UNSUPPORTED;
    int rc, dev = reg->device;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    cuda_key_t k;
    memset(&k, 0, sizeof k);
    rc = kvb__cuda_range(reg->addr, &k.base, &k.size);
    /* The region's last byte must be in the same allocation as its first. */
    bool whole = false;
    if (rc == KVB_OK) {
        uint64_t end_base = 0, end_size = 0;
        rc = kvb__cuda_range(reg->addr + reg->len - 1, &end_base, &end_size);
        whole = rc == KVB_OK && end_base == k.base;
    }
    const char *why = whole ? NULL : "it spans several allocations (CUDA IPC maps one)";
    if (rc == KVB_OK && whole) {
        kvb_cu_result_t r = kvb__cuda()->IpcGetMemHandle(&k.handle, k.base);
        if (r != KVB_CUDA_SUCCESS) /* VMM memory that is not IPC-capable, for one */
            why = kvb__cuda_errstr(r);
    }
    if (rc == KVB_OK)
        rc = kvb__cuda_bus_id(dev, k.bus, sizeof k.bus);
    kvb__cuda_ctx_restore(prev);
    if (rc)
        return rc;
    if (why) { /* device memory the other paths still serve, but no one handle reaches */
        KVB_INFO("register %s at 0x%llx: same-host peers cannot map it: %s", reg->location,
                 (unsigned long long)reg->addr, why);
        return KVB_ERR_UNSUPPORTED;
    }
    memcpy(key, &k, sizeof k);
    *key_len = sizeof k;
    return KVB_OK;
}

/* ---- peers ------------------------------------------------------------------------------------
 */

static int cuda_attach(kvb_provider_t *pv, kvb_peer_t *p, uint64_t deadline)
{
    (void)deadline;
    cuda_path_t *cp = (cuda_path_t *)pv;
    if (!kvb__same_host(cp->engine, &p->hello))
        return KVB_ERR_UNSUPPORTED; /* IPC is for the same host */
    cuda_peer_t *cpp = calloc(1, sizeof *cpp);
    if (!cpp)
        return KVB_ERR_NOMEM;
    pthread_mutex_init(&cpp->mu, NULL);
    p->path_state[KVB_PATH_CUDA] = cpp;
    return KVB_OK;
}

static void cuda_detach(kvb_peer_t *p)
{
    cuda_peer_t *cpp = p->path_state[KVB_PATH_CUDA];
    if (!cpp)
        return;
    if (cpp->n) {
        kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
        for (size_t i = 0; i < cpp->n; i++)
            if (cpp->maps[i].mapped && kvb__cuda_use(cpp->maps[i].dev) == KVB_OK)
                kvb__cuda_status(kvb__cuda()->IpcCloseMemHandle(cpp->maps[i].mapped),
                                 "cuIpcCloseMemHandle");
        kvb__cuda_ctx_restore(prev);
    }
    free(cpp->maps);
    pthread_mutex_destroy(&cpp->mu);
    free(cpp);
    p->path_state[KVB_PATH_CUDA] = NULL;
}

/* The peer's key for op's remote region, checked: the allocation holds the region. */
static bool op_key(const kvb_op_t *op, cuda_key_t *k)
{
    size_t len = 0;
    const uint8_t *blob = op->rregion ? kvb__region_key(op->rregion, KVB_PATH_CUDA, &len) : NULL;
    if (!blob || len != sizeof *k)
        return false;
    memcpy(k, blob, sizeof *k);
    const kvb_region_info_t *r = &op->rregion->info;
    return memchr(k->bus, '\0', sizeof k->bus) && k->size > 0 && k->base + k->size > k->base &&
           r->addr >= k->base && r->addr + r->len <= k->base + k->size;
}

/* The peer's allocation opened here, opening it on first use; NULL if it cannot be. Caller holds
 * cpp->mu. */
static const cuda_map_t *map_of(cuda_peer_t *cpp, const kvb_peer_t *p, const cuda_key_t *k)
{
    for (size_t i = 0; i < cpp->n; i++) /* a reused base has a new handle: match both */
        if (cpp->maps[i].base == k->base &&
            !memcmp(&cpp->maps[i].handle, &k->handle, sizeof k->handle))
            return cpp->maps[i].mapped ? &cpp->maps[i] : NULL;
    if (cpp->n == cpp->cap) {
        size_t ncap = cpp->cap ? cpp->cap * 2 : 8;
        cuda_map_t *m = realloc(cpp->maps, ncap * sizeof *m);
        if (!m)
            return NULL;
        cpp->maps = m;
        cpp->cap = ncap;
    }
    cuda_map_t *m = &cpp->maps[cpp->n++];
    *m = (cuda_map_t){.handle = k->handle, .base = k->base, .size = k->size, .dev = -1};
    int rc = kvb__cuda_device_by_bus_id(k->bus, &m->dev);
    const char *why = rc == KVB_ERR_NOT_FOUND ? "its GPU is not visible here" : NULL;
    if (rc == KVB_OK) {
        kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
        rc = kvb__cuda_use(m->dev);
        kvb_cu_result_t r = KVB_CUDA_SUCCESS;
        if (rc == KVB_OK)
            r = kvb__cuda()->IpcOpenMemHandle(&m->mapped, k->handle,
                                              KVB_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        kvb__cuda_ctx_restore(prev);
        if (r != KVB_CUDA_SUCCESS) {
            m->mapped = 0;
            why = kvb__cuda_errstr(r);
        }
    }
    if (!m->mapped && !cpp->warned) {
        cpp->warned = true;
        KVB_WARN("segment %s: cannot map its GPU memory at 0x%llx (device %s) with CUDA IPC: %s; "
                 "that memory takes another path",
                 p->name, (unsigned long long)k->base, k->bus, why ? why : "unknown error");
    }
    return m->mapped ? m : NULL;
}

static bool cuda_reaches(kvb_provider_t *pv, kvb_peer_t *p, const kvb_op_t *op, kvb_span_t *span)
{
    (void)pv;
    *span = KVB_SPAN_ALL; /* the answer is the remote region's, whatever the local side */
    cuda_peer_t *cpp = p->path_state[KVB_PATH_CUDA];
    cuda_key_t k;
    if (!cpp || !op_key(op, &k))
        return false;
    pthread_mutex_lock(&cpp->mu);
    bool ok = map_of(cpp, p, &k) != NULL;
    pthread_mutex_unlock(&cpp->mu);
    return ok;
}

/* ---- copies -----------------------------------------------------------------------------------
 */

static void path_put(cuda_path_t *cp)
{
    if (atomic_fetch_sub(&cp->refs, 1) != 1)
        return;
    pthread_mutex_destroy(&cp->mu);
    pthread_cond_destroy(&cp->cv);
    free(cp->devs);
    free(cp);
}

static void hint_release(void *hint)
{
    path_put(hint);
}

/* An event of device d to record, from the spares or made now (d's context is current). */
static kvb_cu_event_t event_get(cuda_path_t *cp, int d)
{
    kvb_cu_event_t ev = NULL;
    pthread_mutex_lock(&cp->mu);
    if (cp->devs[d].nevents)
        ev = cp->devs[d].events[--cp->devs[d].nevents];
    pthread_mutex_unlock(&cp->mu);
    if (!ev && kvb__cuda_status(kvb__cuda()->EventCreate(&ev, KVB_CU_EVENT_DISABLE_TIMING),
                                "cuEventCreate"))
        ev = NULL;
    return ev;
}

/* Keeps an ended group's event for the next one. Caller holds cp->mu. */
static void event_put_locked(cuda_path_t *cp, int d, kvb_cu_event_t ev)
{
    cuda_dev_t *dv = &cp->devs[d];
    if (dv->nevents == dv->cap) {
        size_t ncap = dv->cap ? dv->cap * 2 : 8;
        kvb_cu_event_t *n = realloc(dv->events, ncap * sizeof *n);
        if (!n) /* rare: let it go (destroying needs d's context, which this thread may lack) */
            return;
        dv->events = n;
        dv->cap = ncap;
    }
    dv->events[dv->nevents++] = ev;
}

/* Ends g's ops with its status (the caller took g off the list, its event has ended). */
static void group_end(cuda_path_t *cp, cuda_group_t *g)
{
    if (g->event) {
        pthread_mutex_lock(&cp->mu);
        event_put_locked(cp, g->dev, g->event);
        pthread_mutex_unlock(&cp->mu);
    }
    kvb__ops_done(g->ops, g->status);
    kvb__peer_release(g->peer);
    free(g);
}

/* Whether g's copies have ended: 1 yes (g->status says how), 0 not yet. Any thread may ask. */
static int group_poll(cuda_group_t *g)
{
    if (!g->event || g->status)
        return 1;
    kvb_cu_result_t r = kvb__cuda()->EventQuery(g->event);
    if (r == KVB_CUDA_ERROR_NOT_READY)
        return 0;
    if (r != KVB_CUDA_SUCCESS)
        g->status = kvb__cuda_status(r, "cuda path: the copies");
    return 1;
}

/* Starts the copy of g's gathered run on its device's stream (its context is current). */
static void run_flush(cuda_path_t *cp, cuda_group_t *g)
{
    if (!g->run_len || g->status)
        return;
    g->status = kvb__cuda_status(
        kvb__cuda()->MemcpyAsync(g->run_dst, g->run_src, g->run_len, cp->devs[g->dev].stream),
        "cuMemcpyAsync");
    g->run_len = 0;
}

/* Records g's event after its copies; on an error, waits for what was started (the ops must not
 * end while a copy still touches their memory) and leaves no event. */
static void group_seal(cuda_path_t *cp, cuda_group_t *g)
{
    const kvb__cuda_api_t *api = kvb__cuda();
    kvb_cu_stream_t st = cp->devs[g->dev].stream;
    run_flush(cp, g);
    if (!g->status && !(g->event = event_get(cp, g->dev)))
        g->status = KVB_ERR_DEVICE;
    if (!g->status)
        g->status = kvb__cuda_status(api->EventRecord(g->event, st), "cuEventRecord");
    if (g->status) {
        kvb__cuda_status(api->StreamSynchronize(st), "cuStreamSynchronize");
        if (g->event) {
            pthread_mutex_lock(&cp->mu);
            event_put_locked(cp, g->dev, g->event);
            pthread_mutex_unlock(&cp->mu);
            g->event = NULL;
        }
    }
}

static void cuda_submit(kvb_provider_t *pv, kvb_peer_t *p, kvb_op_t *ops)
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    cuda_peer_t *cpp = p->path_state[KVB_PATH_CUDA];
    kvb_batch_t *b = ops ? ops->batch : NULL;
    /* One group per device the ops reach (nearly always one). */
    cuda_group_t *groups = NULL;
    kvb_op_t *failed = NULL, **ftail = &failed;
    int fail_st = KVB_OK, cur = -1;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    const kvb_region_desc_t *last_region = NULL; /* the key and map of the previous op's region */
    cuda_key_t k;
    cuda_map_t m = {.mapped = 0};
    while (ops) {
        kvb_op_t *op = ops;
        ops = ops->next;
        op->next = NULL;
        unsigned need = op->kind == KVB_OPK_READ ? KVB_ACCESS_READ : KVB_ACCESS_WRITE;
        int st = atomic_load(&p->lost);
        if (st == KVB_OK && op->rregion != last_region) {
            m.mapped = 0;
            last_region = NULL;
            if (!op_key(op, &k)) {
                st = KVB_ERR_PROTOCOL; /* cannot happen: reaches() said yes for this region */
            } else {
                pthread_mutex_lock(&cpp->mu);
                const cuda_map_t *found = map_of(cpp, p, &k);
                if (found)
                    m = *found; /* a copy: the array may move once the lock is dropped */
                pthread_mutex_unlock(&cpp->mu);
                last_region = m.mapped ? op->rregion : NULL;
            }
        }
        if (st == KVB_OK && !m.mapped)
            st = KVB_ERR_UNSUPPORTED;
        if (st == KVB_OK && (op->rregion->info.access & need) != need)
            st = KVB_ERR_ACCESS_DENIED; /* no target checks one-sided requests: we do */
        if (st == KVB_OK && (m.dev < 0 || m.dev >= cp->ndev || !cp->devs[m.dev].stream))
            st = KVB_ERR_DEVICE; /* its stream could not be made (logged at create) */
        cuda_group_t *g = groups;
        while (st == KVB_OK && g && g->dev != m.dev)
            g = g->next;
        if (st == KVB_OK && !g) {
            if ((g = calloc(1, sizeof *g))) {
                atomic_fetch_add(&p->refs, 1);
                *g = (cuda_group_t){.next = groups, .peer = p, .dev = m.dev};
                g->tail = &g->ops;
                groups = g;
            } else {
                st = KVB_ERR_NOMEM;
            }
        }
        if (st != KVB_OK) {
            if (failed && st != fail_st) { /* one status per list: end the ones gathered */
                kvb__ops_done(failed, fail_st);
                failed = NULL;
                ftail = &failed;
            }
            fail_st = st;
            *ftail = op;
            ftail = &op->next;
            continue;
        }
        *g->tail = op;
        g->tail = &op->next;
        if (g->status)
            continue; /* a copy failed to start: the rest of the group fails with it */
        kvb_cu_ptr_t remote = m.mapped + (op->remote - m.base), local = (uintptr_t)op->local;
        kvb_cu_ptr_t dst = op->kind == KVB_OPK_READ ? local : remote;
        kvb_cu_ptr_t src = op->kind == KVB_OPK_READ ? remote : local;
        /* Requests that continue each other on both sides (a batch of consecutive blocks) go
         * as one copy: small copies are bound by their launch, not by the copy engine. */
        if (g->run_len && dst == g->run_dst + g->run_len && src == g->run_src + g->run_len) {
            g->run_len += op->len;
            continue;
        }
        if (cur != g->dev && (g->status = kvb__cuda_use(g->dev)) == KVB_OK)
            cur = g->dev;
        if (g->status == KVB_OK)
            run_flush(cp, g);
        g->run_dst = dst;
        g->run_src = src;
        g->run_len = op->len;
    }
    if (failed)
        kvb__ops_done(failed, fail_st);
    for (cuda_group_t *g = groups; g; g = g->next) {
        if (cur != g->dev && kvb__cuda_use(g->dev) == KVB_OK)
            cur = g->dev;
        if (cur == g->dev)
            group_seal(cp, g); /* after a failed launch too: it waits for what started */
        else if (!g->status)
            g->status = KVB_ERR_DEVICE;
    }
    kvb__cuda_ctx_restore(prev);
    if (!groups)
        return;
    /* The batch's waiter watches the events itself (cuda_progress); the hint keeps the path's
     * struct (not its streams or worker) alive until the batch goes. */
    if (!b->drive_hint) {
        atomic_fetch_add(&cp->refs, 1);
        b->drive_hint = cp;
        b->hint_release = hint_release;
    }
    cuda_group_t *now = NULL; /* nothing to wait for (an error), or the path is stopping */
    pthread_mutex_lock(&cp->mu);
    while (groups) {
        cuda_group_t *g = groups;
        groups = g->next;
        g->next = NULL;
        if (g->event && !cp->stop) {
            *cp->tail = g;
            cp->tail = &g->next;
        } else {
            g->next = now;
            now = g;
        }
    }
    atomic_fetch_add(&cp->seq, 1);
    if (cp->idle)
        pthread_cond_signal(&cp->cv);
    pthread_mutex_unlock(&cp->mu);
    while (now) { /* stopping: the worker is gone or going, so wait here */
        cuda_group_t *g = now;
        now = g->next;
        if (g->event)
            kvb__cuda_status(kvb__cuda()->EventSynchronize(g->event), "cuEventSynchronize");
        if (g->event && !g->status)
            g->status = KVB_ERR_SHUTDOWN;
        group_end(cp, g);
    }
}

/* Takes g off the path's list. Caller holds cp->mu. */
static void unlink_locked(cuda_path_t *cp, cuda_group_t *g)
{
    cuda_group_t **pp = &cp->head;
    while (*pp != g)
        pp = &(*pp)->next;
    *pp = g->next;
    if (cp->tail == &g->next)
        cp->tail = pp;
    g->next = NULL;
}

/* How long the worker looks for new groups before it sleeps: batches submitted back to back then
 * find it awake, and their submits wake no one (a futex wake costs the submitter microseconds). */
#define LINGER_NS 100000

/* Ends the copies nobody waits for: sleeps on the oldest group no waiting thread watches, then
 * ends every such group whose copies are done. */
static void *worker(void *arg)
{
    cuda_path_t *cp = arg;
    const kvb__cuda_api_t *api = kvb__cuda();
    int cur = -1;
    pthread_mutex_lock(&cp->mu);
    for (;;) {
        cuda_group_t *g = cp->head;
        while (g && g->driven)
            g = g->next;
        if (!g) {
            if (cp->stop && !cp->head)
                break;
            unsigned seen = atomic_load(&cp->seq);
            pthread_mutex_unlock(&cp->mu);
            uint64_t until = kvb__now_ns() + LINGER_NS;
            while (atomic_load_explicit(&cp->seq, memory_order_relaxed) == seen &&
                   kvb__now_ns() < until)
                for (int i = 0; i < 64; i++)
                    kvb__cpu_relax();
            pthread_mutex_lock(&cp->mu);
            if (atomic_load(&cp->seq) != seen)
                continue;
            cp->idle = true;
            pthread_cond_wait(&cp->cv, &cp->mu);
            cp->idle = false;
            continue;
        }
        /* Events are kept for reuse until the path goes, never destroyed before: waiting on one
         * that a later group recorded again only waits longer. */
        kvb_cu_event_t ev = g->event;
        int dev = g->dev;
        pthread_mutex_unlock(&cp->mu);
        if (cur != dev && kvb__cuda_use(dev) == KVB_OK)
            cur = dev;
        api->EventSynchronize(ev); /* its result is read again below, per group */
        pthread_mutex_lock(&cp->mu);
        cuda_group_t *done = NULL;
        for (cuda_group_t *n, *x = cp->head; x; x = n) {
            n = x->next;
            if (!x->driven && group_poll(x)) {
                unlink_locked(cp, x);
                x->next = done;
                done = x;
            }
        }
        pthread_mutex_unlock(&cp->mu);
        while (done) {
            cuda_group_t *x = done;
            done = x->next;
            group_end(cp, x);
        }
        pthread_mutex_lock(&cp->mu);
    }
    pthread_mutex_unlock(&cp->mu);
    return NULL;
}

/* A thread waiting for batch b watches b's copies itself and ends them: no hand-off to the worker
 * and back. KVB_ERR_BUSY when none is left to watch (the worker is ending them). */
static int cuda_progress(kvb_batch_t *b, uint64_t deadline)
{
    cuda_path_t *cp = b->drive_hint;
    enum { MAX = 16 };
    cuda_group_t *mine[MAX];
    size_t n = 0;
    pthread_mutex_lock(&cp->mu);
    for (cuda_group_t *g = cp->head; g && n < MAX; g = g->next)
        if (g->ops->batch == b && !g->driven) { /* a group has ops from its making on */
            g->driven = true;
            mine[n++] = g;
        }
    if (n)
        cp->driving++;
    pthread_mutex_unlock(&cp->mu);
    if (!n)
        return KVB_ERR_BUSY;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    int cur = -1;
    size_t left = n;
    bool ended[MAX] = {false};
    /* Copies are short: spin on the events, up to the deadline. */
    while (left && kvb__now_ns() < deadline)
        for (size_t i = 0; i < n; i++) {
            if (ended[i])
                continue;
            if (cur != mine[i]->dev && kvb__cuda_use(mine[i]->dev) == KVB_OK)
                cur = mine[i]->dev;
            if (group_poll(mine[i])) {
                ended[i] = true;
                left--;
            }
        }
    kvb__cuda_ctx_restore(prev);
    pthread_mutex_lock(&cp->mu);
    for (size_t i = 0; i < n; i++) {
        if (ended[i])
            unlink_locked(cp, mine[i]);
        else
            mine[i]->driven = false; /* the deadline came first: the worker watches it again */
    }
    if (left) {
        atomic_fetch_add(&cp->seq, 1);
        pthread_cond_broadcast(&cp->cv);
    }
    pthread_mutex_unlock(&cp->mu);
    for (size_t i = 0; i < n; i++)
        if (ended[i])
            group_end(cp, mine[i]);
    pthread_mutex_lock(&cp->mu); /* only now: cuda_stop waits for this thread's group_end */
    if (--cp->driving == 0 && cp->stop)
        pthread_cond_broadcast(&cp->cv);
    pthread_mutex_unlock(&cp->mu);
    return KVB_OK;
}

/* ---- the path ---------------------------------------------------------------------------------
 */

static int cuda_create(kvb_engine_t *e, kvb_provider_t **out)
{
    if (!kvb__cuda_available()) {
        KVB_DEBUG("no GPU memory paths: %s", kvb__cuda_reason());
        return KVB_ERR_UNSUPPORTED;
    }
    cuda_path_t *cp = calloc(1, sizeof *cp);
    if (!cp)
        return KVB_ERR_NOMEM;
    atomic_init(&cp->refs, 1);
    cp->engine = e;
    cp->ndev = kvb__cuda_device_count();
    cp->devs = calloc((size_t)cp->ndev, sizeof *cp->devs);
    cp->tail = &cp->head;
    pthread_mutex_init(&cp->mu, NULL);
    pthread_cond_init(&cp->cv, NULL);
    /* A blocking stream per device (ordered after the legacy default stream's work), shared by
     * every submitting thread; stream handles may be used from any thread. */
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    for (int d = 0; cp->devs && d < cp->ndev; d++)
        if (kvb__cuda_use(d) != KVB_OK ||
            kvb__cuda_status(kvb__cuda()->StreamCreate(&cp->devs[d].stream, KVB_CU_STREAM_DEFAULT),
                             "cuStreamCreate"))
            cp->devs[d].stream = NULL;
    kvb__cuda_ctx_restore(prev);
    if (!cp->devs || kvb__thread_create(&cp->worker, NULL, -1, "kvb-cuda", -1, worker, cp)) {
        pthread_mutex_destroy(&cp->mu);
        pthread_cond_destroy(&cp->cv);
        free(cp->devs);
        free(cp);
        return KVB_ERR_SYSTEM;
    }
    *out = (kvb_provider_t *)cp;
    return KVB_OK;
}

/* Runs after the control plane is gone, before the registry: copies still in flight end, and
 * their ops with them, while the regions they pin still exist. */
static void cuda_stop(kvb_provider_t *pv)
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    pthread_mutex_lock(&cp->mu);
    cp->stop = true;
    atomic_fetch_add(&cp->seq, 1);
    pthread_cond_broadcast(&cp->cv);
    while (cp->driving > 0) /* waiting threads ending their groups: they finish first */
        pthread_cond_wait(&cp->cv, &cp->mu);
    pthread_mutex_unlock(&cp->mu);
    pthread_join(cp->worker, NULL); /* it leaves once no group is left */
}

static void cuda_destroy(kvb_provider_t *pv) /* after cuda_stop */
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    for (int d = 0; d < cp->ndev; d++) {
        cuda_dev_t *dv = &cp->devs[d];
        if (kvb__cuda_use(d) == KVB_OK) {
            for (size_t i = 0; i < dv->nevents; i++)
                kvb__cuda()->EventDestroy(dv->events[i]);
            if (dv->stream)
                kvb__cuda()->StreamDestroy(dv->stream);
        }
        free(dv->events);
    }
    kvb__cuda_ctx_restore(prev);
    path_put(cp);
}

const kvb_provider_ops_t kvb__cuda_provider = {
    .name = "cuda",
    .id = KVB_PATH_CUDA,
    .remote_region = true,
    .device_only = true,
    .create = cuda_create,
    .stop = cuda_stop,
    .destroy = cuda_destroy,
    .reg = cuda_reg,
    .attach = cuda_attach,
    .detach = cuda_detach,
    .reaches = cuda_reaches,
    .submit = cuda_submit,
    .progress = cuda_progress,
    /* no .cancel: copies start at submit, and their ops end when they do */
};
