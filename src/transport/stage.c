/* SPDX-License-Identifier: Apache-2.0 */
/* Host bounce buffers and the copies through them (see stage.h). The pool keeps up to POOL_MAX
 * pinned buffers of one size - a request's largest chunk - and hands out others as plain malloc
 * memory: pinned memory is a scarce system resource, and a pageable copy is still correct. */
#include "transport/stage.h"

#include <pthread.h>
#include <stdlib.h>

#include "engine/internal.h"
#include "transport/cuda_driver.h"

#define POOL_MAX 16 /* pinned buffers of KVB_CHUNK_SIZE: 64 MiB per process at most */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *pool_free[POOL_MAX]; /* pinned buffers not in use */
static uint8_t *pool_all[POOL_MAX];  /* every pinned buffer made */
static size_t nfree, nall;

bool kvb__stage_can(kvb_mem_kind_t kind)
{
    return kind == KVB_MEM_CPU || (kind == KVB_MEM_CUDA && kvb__cuda_available());
}

static bool pinned(const uint8_t *buf)
{
    for (size_t i = 0; i < nall; i++)
        if (pool_all[i] == buf)
            return true;
    return false;
}

uint8_t *kvb__stage_get(size_t len)
{
    if (len <= KVB_CHUNK_SIZE) {
        pthread_mutex_lock(&pool_mu);
        uint8_t *buf = nfree ? pool_free[--nfree] : NULL;
        if (!buf && nall < POOL_MAX && kvb__cuda_available()) {
            /* Pinned memory belongs to a context; PORTABLE makes it pinned for every one. */
            kvb_cu_ctx_t prev = NULL;
            const kvb__cuda_api_t *api = kvb__cuda();
            api->CtxGetCurrent(&prev);
            void *p = NULL;
            if (kvb__cuda_use(0) == KVB_OK &&
                api->MemHostAlloc(&p, KVB_CHUNK_SIZE, KVB_CU_MEMHOSTALLOC_PORTABLE) ==
                    KVB_CUDA_SUCCESS)
                buf = pool_all[nall++] = p;
            api->CtxSetCurrent(prev);
        }
        pthread_mutex_unlock(&pool_mu);
        if (buf)
            return buf;
    }
    return malloc(len ? len : 1);
}

void kvb__stage_put(uint8_t *buf, size_t len)
{
    (void)len;
    if (!buf)
        return;
    pthread_mutex_lock(&pool_mu);
    bool mine = pinned(buf);
    if (mine)
        pool_free[nfree++] = buf;
    pthread_mutex_unlock(&pool_mu);
    if (!mine)
        free(buf);
}

static int copy(uint64_t dst, uint64_t src, size_t len, int dev, bool out)
{
    const kvb__cuda_api_t *api = kvb__cuda();
    if (!api)
        return KVB_ERR_UNSUPPORTED;
    kvb_cu_ctx_t prev = NULL;
    api->CtxGetCurrent(&prev);
    int rc = kvb__cuda_use(dev);
    if (rc == KVB_OK)
        rc = out ? kvb__cuda_status(api->MemcpyDtoH((void *)(uintptr_t)dst, src, len),
                                    "cuMemcpyDtoH (staging device memory out)")
                 : kvb__cuda_status(api->MemcpyHtoD(dst, (const void *)(uintptr_t)src, len),
                                    "cuMemcpyHtoD (staging device memory in)");
    api->CtxSetCurrent(prev);
    return rc;
}

int kvb__stage_out(uint8_t *host, uint64_t device_src, size_t len, int dev)
{
    return copy((uintptr_t)host, device_src, len, dev, true);
}

int kvb__stage_in(uint64_t device_dst, const uint8_t *host, size_t len, int dev)
{
    return copy(device_dst, (uintptr_t)host, len, dev, false);
}
