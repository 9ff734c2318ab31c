/* SPDX-License-Identifier: Apache-2.0 */
/* Device memory for `kvbridge bench --gpu`: buffers on CUDA device 0 (through the driver that the
 * library loads at run time), moving patterns in and out of them for --verify, and the copy
 * ceilings measured in the same run - device-to-host, host-to-device and device-to-device
 * cuMemcpy bandwidth at the benchmark's block size. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "tools/cli.h"
#include "transport/cuda_driver.h"

#define GPU_DEVICE 0

/* Every driver call below runs on a thread with device 0 current: make it so, once per thread. */
static int use_device(void)
{
    static __thread bool ready;
    if (ready)
        return 0;
    if (!kvb__cuda_available()) {
        fprintf(stderr, "bench: --gpu needs a CUDA GPU: %s\n", kvb__cuda_reason());
        return -1;
    }
    if (kvb__cuda_use(GPU_DEVICE))
        return -1;
    ready = true;
    return 0;
}

uint8_t *kvb_bench_gpu_alloc(uint64_t len)
{
    kvb_cu_ptr_t p = 0;
    if (use_device())
        return NULL;
    if (kvb__cuda_status(kvb__cuda()->MemAlloc(&p, len), "bench: cuMemAlloc"))
        return NULL;
    return (uint8_t *)(uintptr_t)p;
}

void kvb_bench_gpu_free(uint8_t *p)
{
    if (p && use_device() == 0)
        kvb__cuda()->MemFree((uintptr_t)p);
}

int kvb_bench_gpu_upload(uint8_t *dev, const uint8_t *host, uint64_t len)
{
    if (use_device())
        return -1;
    return kvb__cuda_status(kvb__cuda()->MemcpyHtoD((uintptr_t)dev, host, len),
                            "bench: cuMemcpyHtoD")
               ? -1
               : 0;
}

int kvb_bench_gpu_download(uint8_t *host, const uint8_t *dev, uint64_t len)
{
    if (use_device())
        return -1;
    return kvb__cuda_status(kvb__cuda()->MemcpyDtoH(host, (uintptr_t)dev, len),
                            "bench: cuMemcpyDtoH")
               ? -1
               : 0;
}

int kvb_bench_gpu_fill(uint8_t *dev, uint8_t value, uint64_t len)
{
    if (use_device())
        return -1;
    return kvb__cuda_status(kvb__cuda()->MemsetD8((uintptr_t)dev, value, len), "bench: cuMemsetD8")
               ? -1
               : 0;
}

/* Copies `batch` blocks of `block` bytes at a time - queued together on one stream, then waited
 * for, as the engine's copies are, consecutive blocks as one copy - `what` = "d2h", "h2d" or "d2d",
 * round-robin over a 256 MiB working set (the bench's default buffer) for `secs` seconds; GB/s, or
 * < 0 on error. The host side is pinned memory, as the engine's bounce buffers are. */
double kvb_bench_gpu_ceiling(const char *what, uint64_t block, uint64_t batch, int secs)
{
    const kvb__cuda_api_t *api = kvb__cuda();
    uint64_t set = 256ull << 20;
    if (block > set)
        set = block;
    if (use_device())
        return -1;
    kvb_cu_ptr_t a = 0, b = 0;
    kvb_cu_stream_t st = NULL;
    void *host = NULL;
    double gbps = -1;
    if (api->MemAlloc(&a, set) || api->MemAlloc(&b, set) ||
        api->MemHostAlloc(&host, set, KVB_CU_MEMHOSTALLOC_PORTABLE) ||
        api->StreamCreate(&st, KVB_CU_STREAM_NON_BLOCKING)) {
        fprintf(stderr, "bench: GPU ceiling: cannot allocate %llu bytes\n",
                (unsigned long long)set);
        goto out;
    }
    uint64_t nblocks = set / block, bytes = 0, i = 0;
    uint64_t t0 = kvb__now_ns(), end = t0 + (uint64_t)secs * 1000000000ull;
    kvb_cu_result_t r = KVB_CUDA_SUCCESS;
    while (r == KVB_CUDA_SUCCESS && kvb__now_ns() < end) {
        /* The batch's blocks as a plain program would copy them: one copy per run of
         * consecutive blocks (the working set wraps around between runs). */
        for (uint64_t k = 0; k < batch && r == KVB_CUDA_SUCCESS;) {
            uint64_t first = i % nblocks, n = 1;
            while (k + n < batch && first + n < nblocks)
                n++;
            uint64_t off = first * block, len = n * block;
            if (!strcmp(what, "d2h"))
                r = api->MemcpyDtoHAsync((uint8_t *)host + off, a + off, len, st);
            else if (!strcmp(what, "h2d"))
                r = api->MemcpyHtoDAsync(a + off, (uint8_t *)host + off, len, st);
            else
                r = api->MemcpyDtoDAsync(b + off, a + off, len, st);
            bytes += len;
            k += n;
            i += n;
        }
        if (r == KVB_CUDA_SUCCESS)
            r = api->StreamSynchronize(st);
    }
    if (r == KVB_CUDA_SUCCESS)
        gbps = (double)bytes / ((double)(kvb__now_ns() - t0) / 1e9) / 1e9;
    else
        kvb__cuda_status(r, "bench: GPU ceiling copy");
out:
    if (st)
        api->StreamDestroy(st);
    if (a)
        api->MemFree(a);
    if (b)
        api->MemFree(b);
    if (host)
        api->MemFreeHost(host);
    return gbps;
}
