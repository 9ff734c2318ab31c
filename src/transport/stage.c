/* SPDX-License-Identifier: Apache-2.0 */
/* Host bounce buffers and the copies through them (see stage.h). Pinned memory is a scarce system
 * resource, so the pool is capped; past it, and for anything larger than a slab, buffers are plain
 * malloc memory (a pageable copy is slower, but still correct). */
#include "transport/stage.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/internal.h"
#include "transport/cuda_driver.h"

/* Pinned memory comes in 4 MiB slabs, cut into buffers of one power-of-two size class each
 * (4 KiB .. 4 MiB) on demand and kept on that class's free list; at most PINNED_MAX bytes are
 * pinned per process, after which buffers are plain malloc memory. */
#define SLAB       KVB_CHUNK_SIZE
#define PINNED_MAX (256ull << 20)
#define CLASS_MIN  12 /* 4 KiB */
#define CLASS_MAX  22 /* 4 MiB = SLAB */
#define CLASSES    (CLASS_MAX - CLASS_MIN + 1)
_Static_assert(SLAB == 1ull << CLASS_MAX, "a slab is the largest class");

typedef struct free_buf {
    struct free_buf *next;
} free_buf_t;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static free_buf_t *free_list[CLASSES];
static uint8_t *slabs[PINNED_MAX / SLAB]; /* every slab, to tell pinned buffers apart */
static int slab_class[PINNED_MAX / SLAB]; /* the class it was cut into */
static size_t nslabs;

/* The class of a len-byte buffer, or -1 if larger than a slab. */
static int class_of(size_t len)
{
    int c = CLASS_MIN;
    while (c <= CLASS_MAX && (1ull << c) < len)
        c++;
    return c <= CLASS_MAX ? c - CLASS_MIN : -1;
}

/* Pins one more slab and cuts it into class c's buffers. Caller holds pool_mu. */
static bool grow(int c)
{
    if (nslabs == sizeof slabs / sizeof slabs[0] || !kvb__cuda_available())
        return false;
    /* Pinned memory belongs to a context; PORTABLE makes it pinned for every one. */
    const kvb__cuda_api_t *api = kvb__cuda();
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    void *p = NULL;
    bool ok = kvb__cuda_use(0) == KVB_OK &&
              api->MemHostAlloc(&p, SLAB, KVB_CU_MEMHOSTALLOC_PORTABLE) == KVB_CUDA_SUCCESS;
    kvb__cuda_ctx_restore(prev);
    if (!ok)
        return false;
    slab_class[nslabs] = c;
    slabs[nslabs++] = p;
    size_t size = 1ull << (c + CLASS_MIN);
    for (size_t off = 0; off < SLAB; off += size) {
        free_buf_t *f = (free_buf_t *)((uint8_t *)p + off);
        f->next = free_list[c];
        free_list[c] = f;
    }
    return true;
}

/* The class of a pinned buffer, or -1 for malloc memory. Caller holds pool_mu. */
static int pinned_class(const uint8_t *buf)
{
    for (size_t i = 0; i < nslabs; i++)
        if (buf >= slabs[i] && buf < slabs[i] + SLAB)
            return slab_class[i];
    return -1;
}

uint8_t *kvb__stage_get(size_t len)
{
    int c = class_of(len);
    if (c >= 0) {
        pthread_mutex_lock(&pool_mu);
        if (!free_list[c])
            grow(c);
        free_buf_t *f = free_list[c];
        if (f)
            free_list[c] = f->next;
        pthread_mutex_unlock(&pool_mu);
        if (f)
            return (uint8_t *)f;
    }
    return malloc(len ? len : 1);
}

void kvb__stage_put(uint8_t *buf)
{
    if (!buf)
        return;
    pthread_mutex_lock(&pool_mu);
    int c = pinned_class(buf);
    if (c >= 0) {
        free_buf_t *f = (free_buf_t *)buf;
        f->next = free_list[c];
        free_list[c] = f;
    }
    pthread_mutex_unlock(&pool_mu);
    if (c < 0)
        free(buf);
}

bool kvb__stage_can(kvb_mem_kind_t kind)
{
    return kind == KVB_MEM_CPU || (kind == KVB_MEM_CUDA && kvb__cuda_available());
}

int kvb__stage_region(kvb_region_t *reg)
{
    bool auto_kind = !strcmp(reg->location, "*");
    if (reg->kind != KVB_MEM_CUDA && !auto_kind)
        return KVB_OK;
    if (!kvb__cuda_available())
        return auto_kind ? KVB_OK : KVB_ERR_UNSUPPORTED;
    bool first_dev = false, last_dev = false;
    int first = -1, last = -1;
    int rc = kvb__cuda_pointer(reg->addr, &first_dev, &first);
    if (rc == KVB_OK)
        rc = kvb__cuda_pointer(reg->addr + reg->len - 1, &last_dev, &last);
    if (rc)
        return rc;
    if (!first_dev && auto_kind)
        return KVB_OK; /* host memory after all */
    const char *why = !first_dev                   ? "it is not CUDA device memory"
                      : !last_dev || last != first ? "it runs past that device's memory"
                      : reg->kind == KVB_MEM_CUDA && reg->device != first
                          ? "it is on another device"
                          : NULL;
    if (why) {
        KVB_WARN("register %s at 0x%llx+%llu: %s (CUDA device %d)", reg->location,
                 (unsigned long long)reg->addr, (unsigned long long)reg->len, why, first);
        return KVB_ERR_INVALID_ARG;
    }
    reg->kind = KVB_MEM_CUDA;
    reg->device = first;
    if (auto_kind) /* peers learn the kind from the location */
        snprintf(reg->location, sizeof reg->location, "cuda:%d", first);
    return KVB_OK;
}

/* ---- queued copies -------------------------------------------------------------------------- */

struct kvb_stage_queue {
    int ndev;
    int err;             /* the first failure since the last wait */
    uint64_t used;       /* devices with copies queued since the last wait (bit per ordinal) */
    kvb_cu_stream_t *st; /* per device, created on first use */
};

static kvb_stage_queue_t *queue_new(void)
{
    int n = kvb__cuda_device_count();
    kvb_stage_queue_t *q = calloc(1, sizeof *q);
    if (q && !(q->st = calloc(n > 0 ? (size_t)n : 1, sizeof *q->st))) {
        free(q);
        return NULL;
    }
    if (q)
        q->ndev = n;
    return q;
}

static int queue_copy(kvb_stage_queue_t **qp, uint64_t dst, uint64_t src, size_t len, int dev,
                      bool out)
{
    const kvb__cuda_api_t *api = kvb__cuda();
    if (!api)
        return KVB_ERR_UNSUPPORTED;
    if (!*qp && !(*qp = queue_new()))
        return KVB_ERR_NOMEM;
    kvb_stage_queue_t *q = *qp;
    if (dev < 0 || dev >= q->ndev || dev >= 64)
        return KVB_ERR_INVALID_ARG;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    int rc = kvb__cuda_use(dev);
    if (rc == KVB_OK && !q->st[dev])
        rc = kvb__cuda_status(api->StreamCreate(&q->st[dev], KVB_CU_STREAM_DEFAULT),
                              "cuStreamCreate (staging)");
    if (rc == KVB_OK)
        rc = out ? kvb__cuda_status(
                       api->MemcpyDtoHAsync((void *)(uintptr_t)dst, src, len, q->st[dev]),
                       "cuMemcpyDtoHAsync (staging device memory out)")
                 : kvb__cuda_status(
                       api->MemcpyHtoDAsync(dst, (const void *)(uintptr_t)src, len, q->st[dev]),
                       "cuMemcpyHtoDAsync (staging device memory in)");
    kvb__cuda_ctx_restore(prev);
    if (rc == KVB_OK)
        q->used |= 1ull << dev;
    else if (!q->err)
        q->err = rc;
    return rc;
}

int kvb__stage_out_async(kvb_stage_queue_t **q, uint8_t *host, uint64_t device_src, size_t len,
                         int dev)
{
    return queue_copy(q, (uintptr_t)host, device_src, len, dev, true);
}

int kvb__stage_in_async(kvb_stage_queue_t **q, uint64_t device_dst, const uint8_t *host, size_t len,
                        int dev)
{
    return queue_copy(q, device_dst, (uintptr_t)host, len, dev, false);
}

int kvb__stage_wait(kvb_stage_queue_t *q)
{
    if (!q || (!q->used && !q->err))
        return KVB_OK;
    const kvb__cuda_api_t *api = kvb__cuda();
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    int rc = q->err;
    for (int d = 0; d < q->ndev && q->used; d++)
        if (q->used & (1ull << d)) {
            int r = kvb__cuda_use(d);
            if (r == KVB_OK)
                r = kvb__cuda_status(api->StreamSynchronize(q->st[d]), "cuStreamSynchronize");
            rc = rc ? rc : r;
        }
    kvb__cuda_ctx_restore(prev);
    q->used = 0;
    q->err = 0;
    return rc;
}

/* The calling thread's own queue, freed when the thread exits. */
static pthread_key_t thread_key;
static pthread_once_t thread_once = PTHREAD_ONCE_INIT;

static void thread_queue_free(void *q)
{
    kvb__stage_queue_free(q);
}

static void thread_key_make(void)
{
    pthread_key_create(&thread_key, thread_queue_free);
}

kvb_stage_queue_t **kvb__stage_thread_queue(void)
{
    static __thread kvb_stage_queue_t *q;
    pthread_once(&thread_once, thread_key_make);
    if (!q && (q = queue_new()))
        pthread_setspecific(thread_key, q);
    return &q;
}

void kvb__stage_queue_free(kvb_stage_queue_t *q)
{
    if (!q)
        return;
    kvb__stage_wait(q);
    const kvb__cuda_api_t *api = kvb__cuda();
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    for (int d = 0; d < q->ndev; d++)
        if (q->st[d] && kvb__cuda_use(d) == KVB_OK)
            api->StreamDestroy(q->st[d]);
    kvb__cuda_ctx_restore(prev);
    free(q->st);
    free(q);
}
