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
 * One worker thread issues the copies: it takes every queued op, starts them all on their
 * devices' streams, waits for the streams, then completes the ops - a READ is COMPLETED only
 * when its bytes are in local memory, a WRITE only when they are in the peer's. The streams are
 * blocking ones (flags 0), so each copy is ordered after work the application queued on the
 * legacy default stream of the same context before it submitted.
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

typedef struct cuda_job {
    struct cuda_job *next;
    kvb_op_t *op;
    kvb_peer_t *peer; /* a reference, so the peer's maps outlive the copy */
    kvb_cu_ptr_t dst, src;
    int dev;
} cuda_job_t;

typedef struct {
    atomic_uint refs; /* the engine's, plus one per batch naming it as its drive hint */
    kvb_engine_t *engine;
    pthread_t worker;
    pthread_mutex_t mu; /* guards the queue and stop */
    pthread_cond_t cv;
    cuda_job_t *head, **tail;
    bool stop;
    unsigned driving;         /* waiting threads running jobs themselves (cuda_progress) */
    kvb_cu_stream_t *streams; /* per device, made at create; NULL where that failed */
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
    if (memcmp(p->hello.host_id, cp->engine->hello.host_id, KVB_HOST_ID_LEN))
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

static bool cuda_reaches(kvb_provider_t *pv, kvb_peer_t *p, const kvb_op_t *op)
{
    (void)pv;
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

static void job_end(cuda_job_t *j, int status)
{
    kvb__op_done(j->op, status, status ? 0 : j->op->len);
    kvb__peer_release(j->peer);
    free(j);
}

static void path_put(cuda_path_t *cp)
{
    if (atomic_fetch_sub(&cp->refs, 1) != 1)
        return;
    pthread_mutex_destroy(&cp->mu);
    pthread_cond_destroy(&cp->cv);
    free(cp->streams);
    free(cp);
}

static void hint_release(void *hint)
{
    path_put(hint);
}

static void cuda_submit(kvb_provider_t *pv, kvb_peer_t *p, kvb_op_t *ops)
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    cuda_peer_t *cpp = p->path_state[KVB_PATH_CUDA];
    cuda_job_t *head = NULL, **tail = &head;
    while (ops) {
        kvb_op_t *op = ops;
        ops = ops->next;
        op->next = NULL;
        cuda_key_t k;
        unsigned need = op->kind == KVB_OPK_READ ? KVB_ACCESS_READ : KVB_ACCESS_WRITE;
        int st = KVB_OK;
        cuda_map_t m = {.mapped = 0};
        if (atomic_load(&p->lost))
            st = atomic_load(&p->lost);
        else if (!op_key(op, &k))
            st = KVB_ERR_PROTOCOL; /* cannot happen: reaches() said yes for this very region */
        else if ((op->rregion->info.access & need) != need)
            st = KVB_ERR_ACCESS_DENIED; /* no target checks one-sided requests: we do */
        if (st == KVB_OK) {             /* a copy: the array may move once the lock is dropped */
            pthread_mutex_lock(&cpp->mu);
            const cuda_map_t *found = map_of(cpp, p, &k);
            if (found)
                m = *found;
            pthread_mutex_unlock(&cpp->mu);
        }
        cuda_job_t *j = st || !m.mapped ? NULL : malloc(sizeof *j);
        if (!j) {
            kvb__op_done(op, st ? st : m.mapped ? KVB_ERR_NOMEM : KVB_ERR_UNSUPPORTED, 0);
            continue;
        }
        kvb_cu_ptr_t remote = m.mapped + (op->remote - m.base);
        atomic_fetch_add(&p->refs, 1);
        *j = (cuda_job_t){.op = op,
                          .peer = p,
                          .dst = op->kind == KVB_OPK_READ ? (uintptr_t)op->local : remote,
                          .src = op->kind == KVB_OPK_READ ? remote : (uintptr_t)op->local,
                          .dev = m.dev};
        *tail = j;
        tail = &j->next;
    }
    if (!head)
        return;
    /* The batch's waiter may run these itself (cuda_progress); the hint keeps the path's struct
     * (not its streams or worker) alive until the batch goes. */
    kvb_batch_t *b = head->op->batch;
    if (!b->drive_hint) {
        atomic_fetch_add(&cp->refs, 1);
        b->drive_hint = cp;
        b->hint_release = hint_release;
    }
    pthread_mutex_lock(&cp->mu);
    bool stop = cp->stop;
    if (!stop) {
        *cp->tail = head;
        cp->tail = tail;
        pthread_cond_signal(&cp->cv);
    }
    pthread_mutex_unlock(&cp->mu);
    while (stop && head) {
        cuda_job_t *j = head;
        head = j->next;
        job_end(j, KVB_ERR_SHUTDOWN);
    }
}

/* Starts every job on its device's stream, waits for the streams, completes the jobs. */
static void run_jobs(cuda_path_t *cp, cuda_job_t *jobs)
{
    const kvb__cuda_api_t *api = kvb__cuda();
    int fail[64] = {0}; /* per device: the first error */
    bool used[64] = {false};
    for (cuda_job_t *j = jobs; j; j = j->next) {
        int d = j->dev;
        if (d < 0 || d >= cp->ndev || d >= 64) {
            fail[0] = fail[0] ? fail[0] : KVB_ERR_INVALID_ARG;
            j->dev = 0;
            continue;
        }
        if (!fail[d] && !cp->streams[d])
            fail[d] = KVB_ERR_DEVICE; /* its stream could not be made (logged at create) */
        if (fail[d] || (fail[d] = kvb__cuda_use(d)))
            continue;
        used[d] = true;
        /* Requests that continue each other on both sides (a batch of consecutive blocks) go
         * as one copy: small copies are bound by their launch, not by the copy engine. */
        cuda_job_t *last = j;
        uint64_t len = j->op->len;
        while (last->next && last->next->dev == d && last->next->src == j->src + len &&
               last->next->dst == j->dst + len) {
            last = last->next;
            len += last->op->len;
        }
        fail[d] = kvb__cuda_status(api->MemcpyAsync(j->dst, j->src, len, cp->streams[d]),
                                   "cuMemcpyAsync");
        j = last;
    }
    for (int d = 0; d < cp->ndev && d < 64; d++)
        if (used[d] && kvb__cuda_use(d) == KVB_OK) {
            int rc =
                kvb__cuda_status(api->StreamSynchronize(cp->streams[d]), "cuStreamSynchronize");
            fail[d] = fail[d] ? fail[d] : rc;
        }
    while (jobs) {
        cuda_job_t *j = jobs;
        jobs = j->next;
        job_end(j, fail[j->dev]);
    }
}

static void *worker(void *arg)
{
    cuda_path_t *cp = arg;
    pthread_mutex_lock(&cp->mu);
    for (;;) {
        while (!cp->head && !cp->stop)
            pthread_cond_wait(&cp->cv, &cp->mu);
        if (!cp->head)
            break; /* stopping, and nothing left */
        cuda_job_t *jobs = cp->head;
        cp->head = NULL;
        cp->tail = &cp->head;
        pthread_mutex_unlock(&cp->mu);
        run_jobs(cp, jobs);
        pthread_mutex_lock(&cp->mu);
    }
    pthread_mutex_unlock(&cp->mu);
    return NULL;
}

/* A thread waiting for batch b runs b's jobs that the worker has not taken yet itself: no hand-off
 * to the worker and back. KVB_ERR_BUSY when there are none (the worker has them). */
static int cuda_progress(kvb_batch_t *b, uint64_t deadline)
{
    (void)deadline; /* the copies it starts are bounded; it waits for nothing else */
    cuda_path_t *cp = b->drive_hint;
    cuda_job_t *mine = NULL, **mt = &mine;
    pthread_mutex_lock(&cp->mu);
    for (cuda_job_t **pp = &cp->head; *pp && !cp->stop;) {
        cuda_job_t *j = *pp;
        if (j->op->batch == b) {
            *pp = j->next;
            j->next = NULL;
            *mt = j;
            mt = &j->next;
        } else {
            pp = &j->next;
        }
    }
    cp->tail = &cp->head;
    while (*cp->tail)
        cp->tail = &(*cp->tail)->next;
    if (mine)
        cp->driving++;
    pthread_mutex_unlock(&cp->mu);
    if (!mine)
        return KVB_ERR_BUSY;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    run_jobs(cp, mine);
    kvb__cuda_ctx_restore(prev);
    pthread_mutex_lock(&cp->mu);
    if (--cp->driving == 0 && cp->stop)
        pthread_cond_broadcast(&cp->cv);
    pthread_mutex_unlock(&cp->mu);
    return KVB_OK;
}

/* Jobs of a cancelled or freed batch that have not started end now. */
static void cuda_cancel(kvb_provider_t *pv, kvb_batch_t *b)
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    cuda_job_t *gone = NULL;
    pthread_mutex_lock(&cp->mu);
    for (cuda_job_t **pp = &cp->head; *pp;) {
        cuda_job_t *j = *pp;
        if (j->op->batch == b) {
            *pp = j->next;
            j->next = gone;
            gone = j;
        } else {
            pp = &j->next;
        }
    }
    cp->tail = &cp->head;
    while (*cp->tail)
        cp->tail = &(*cp->tail)->next;
    pthread_mutex_unlock(&cp->mu);
    while (gone) {
        cuda_job_t *j = gone;
        gone = j->next;
        job_end(j, KVB_ERR_CANCELED);
    }
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
    cp->streams = calloc((size_t)cp->ndev, sizeof *cp->streams);
    cp->tail = &cp->head;
    pthread_mutex_init(&cp->mu, NULL);
    pthread_cond_init(&cp->cv, NULL);
    /* A blocking stream per device (ordered after the legacy default stream's work), shared by
     * the worker and waiting threads; stream handles may be used from any thread. */
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    for (int d = 0; cp->streams && d < cp->ndev; d++)
        if (kvb__cuda_use(d) != KVB_OK ||
            kvb__cuda_status(kvb__cuda()->StreamCreate(&cp->streams[d], KVB_CU_STREAM_DEFAULT),
                             "cuStreamCreate"))
            cp->streams[d] = NULL;
    kvb__cuda_ctx_restore(prev);
    if (!cp->streams || pthread_create(&cp->worker, NULL, worker, cp)) {
        pthread_mutex_destroy(&cp->mu);
        pthread_cond_destroy(&cp->cv);
        free(cp->streams);
        free(cp);
        return KVB_ERR_SYSTEM;
    }
    *out = (kvb_provider_t *)cp;
    return KVB_OK;
}

/* Runs after the control plane is gone, before the registry: jobs still queued finish their
 * copies and end while the regions they pin still exist. */
static void cuda_stop(kvb_provider_t *pv)
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    pthread_mutex_lock(&cp->mu);
    cp->stop = true;
    pthread_cond_broadcast(&cp->cv);
    while (cp->driving > 0) /* waiting threads running jobs: their copies end first */
        pthread_cond_wait(&cp->cv, &cp->mu);
    pthread_mutex_unlock(&cp->mu);
    pthread_join(cp->worker, NULL);
}

static void cuda_destroy(kvb_provider_t *pv) /* after cuda_stop */
{
    cuda_path_t *cp = (cuda_path_t *)pv;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    for (int d = 0; d < cp->ndev; d++)
        if (cp->streams[d] && kvb__cuda_use(d) == KVB_OK)
            kvb__cuda()->StreamDestroy(cp->streams[d]);
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
    .cancel = cuda_cancel,
};
