/* SPDX-License-Identifier: Apache-2.0 */
/* Checks the run-time CUDA driver loader (src/transport/cuda_driver.c) against a real GPU:
 * devices and PCI ids, allocation, fills and copies, allocation ranges, pointer queries from
 * threads with and without a current context, a stream with an event, and an IPC handle opened by
 * a second process. Not a Criterion suite: a plain program for machines with a GPU. Exits 0
 * after printing "gpu_driver_check: OK", 77 (skipped) when no driver or device is there, and 1
 * with a message on the first failure. */
#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvbridge/status.h"
#include "transport/cuda_driver.h"

#define ALLOC_SIZE  (64u << 20)
#define COPY_SIZE   (1u << 20)
#define FILL        0xA5
#define CHILD_FILL  0x5A
#define CHILD_OFF   (1u << 20) /* where the IPC child writes, and how much */
#define CHILD_LEN   4096
#define NUM_THREADS 8

static const kvb__cuda_api_t *cu;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
    va_list ap;
    fputs("gpu_driver_check: FAIL: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

/* A driver call that must succeed. */
#define CU(call)                                                                                   \
    do {                                                                                           \
        kvb_cu_result_t r_ = (call);                                                               \
        if (r_ != KVB_CUDA_SUCCESS)                                                                \
            fail("line %d: %s: %s", __LINE__, #call, kvb__cuda_errstr(r_));                        \
    } while (0)

/* A kvb__cuda_* call that must return `want`. */
#define EXPECT(call, want)                                                                         \
    do {                                                                                           \
        int s_ = (call);                                                                           \
        if (s_ != (want))                                                                          \
            fail("line %d: %s: %s, expected %s", __LINE__, #call, kvb_status_name(s_),             \
                 kvb_status_name(want));                                                           \
    } while (0)

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            fail(__VA_ARGS__);                                                                     \
    } while (0)

static void check_bytes(const unsigned char *p, size_t len, unsigned char want, const char *what)
{
    for (size_t i = 0; i < len; i++)
        CHECK(p[i] == want, "%s: byte %zu is %#x, expected %#x", what, i, p[i], want);
}

/* Bus ids print, round-trip through kvb__cuda_device_by_bus_id in either case, and unknown ids
 * are "not found". */
static void check_devices(void)
{
    int version = 0;
    int n = kvb__cuda_device_count();
    CU(cu->DriverGetVersion(&version));
    printf("driver %d.%d, %d device%s\n", version / 1000, version % 1000 / 10, n,
           n == 1 ? "" : "s");
    for (int i = 0; i < n; i++) {
        char bus[KVB_CUDA_BUS_ID_LEN];
        char upper[KVB_CUDA_BUS_ID_LEN];
        int found = -1;
        EXPECT(kvb__cuda_bus_id(i, bus, sizeof bus), KVB_OK);
        printf("device %d: %s\n", i, bus);
        for (size_t k = 0; k <= strlen(bus); k++) {
            CHECK(!isupper((unsigned char)bus[k]), "bus id %s is not lower-case", bus);
            upper[k] = (char)toupper((unsigned char)bus[k]);
        }
        EXPECT(kvb__cuda_device_by_bus_id(bus, &found), KVB_OK);
        CHECK(found == i, "bus id %s maps to device %d, expected %d", bus, found, i);
        found = -1;
        EXPECT(kvb__cuda_device_by_bus_id(upper, &found), KVB_OK);
        CHECK(found == i, "bus id %s maps to device %d, expected %d", upper, found, i);
        EXPECT(kvb__cuda_bus_id(i, bus, strlen(bus)), KVB_ERR_INVALID_ARG);
    }
    int found = -1;
    EXPECT(kvb__cuda_device_by_bus_id("ffff:ff:1f.7", &found), KVB_ERR_NOT_FOUND);
    EXPECT(kvb__cuda_device_by_bus_id("not a bus id", &found), KVB_ERR_NOT_FOUND);
    CHECK(found == -1, "device set on failure");
    EXPECT(kvb__cuda_use(n), KVB_ERR_INVALID_ARG);
    EXPECT(kvb__cuda_use(-1), KVB_ERR_INVALID_ARG);
}

/* 64 MiB filled on the device read back on the host; the range of an interior pointer is the
 * whole allocation; pointer queries tell device, pageable and pinned host memory apart. */
static void check_memory(kvb_cu_ptr_t dev)
{
    unsigned char *host = malloc(ALLOC_SIZE);
    CHECK(host, "out of host memory");
    memset(host, 0, ALLOC_SIZE);
    CU(cu->MemsetD8(dev, FILL, ALLOC_SIZE));
    CU(cu->MemcpyDtoH(host, dev, ALLOC_SIZE));
    check_bytes(host, ALLOC_SIZE, FILL, "cuMemsetD8 then cuMemcpyDtoH");

    uint64_t base = 0, size = 0;
    EXPECT(kvb__cuda_range(dev + ALLOC_SIZE / 2 + 12345, &base, &size), KVB_OK);
    CHECK(base == dev && size == ALLOC_SIZE, "range %#llx+%llu, expected %#llx+%u",
          (unsigned long long)base, (unsigned long long)size, (unsigned long long)dev, ALLOC_SIZE);
    EXPECT(kvb__cuda_range((uintptr_t)host, &base, &size), KVB_ERR_INVALID_ARG);

    bool is_device = false;
    int device = -1;
    EXPECT(kvb__cuda_pointer(dev + 100, &is_device, &device), KVB_OK);
    CHECK(is_device && device == 0, "device pointer seen as %s on %d",
          is_device ? "device" : "host", device);
    EXPECT(kvb__cuda_pointer((uintptr_t)host, &is_device, &device), KVB_OK);
    CHECK(!is_device && device == -1, "malloc'd pointer seen as device memory");
    EXPECT(kvb__cuda_pointer(0, &is_device, &device), KVB_OK);
    CHECK(!is_device, "NULL seen as device memory");

    /* Registered (pinned) host memory is known to the driver but still host memory. */
    CU(cu->MemHostRegister(host, ALLOC_SIZE, KVB_CU_MEMHOSTREGISTER_PORTABLE));
    EXPECT(kvb__cuda_pointer((uintptr_t)host + 4096, &is_device, &device), KVB_OK);
    CHECK(!is_device, "registered host memory seen as device memory");
    CU(cu->MemHostUnregister(host));
    free(host);
}

/* A pinned buffer goes to the device and back through cuMemcpyAsync (unified addresses) on a
 * non-blocking stream, with an event marking the first copy's completion. */
static void check_stream(kvb_cu_ptr_t dev)
{
    kvb_cu_stream_t stream = NULL;
    kvb_cu_event_t event = NULL;
    unsigned char *src = NULL, *dst = NULL;
    CU(cu->StreamCreate(&stream, KVB_CU_STREAM_NON_BLOCKING));
    CU(cu->EventCreate(&event, KVB_CU_EVENT_DISABLE_TIMING));
    CU(cu->MemHostAlloc((void **)&src, COPY_SIZE, KVB_CU_MEMHOSTALLOC_PORTABLE));
    CU(cu->MemHostAlloc((void **)&dst, COPY_SIZE, KVB_CU_MEMHOSTALLOC_PORTABLE));
    for (size_t i = 0; i < COPY_SIZE; i++)
        src[i] = (unsigned char)(i * 131 + 7);
    memset(dst, 0, COPY_SIZE);

    bool is_device = true;
    int device = 0;
    EXPECT(kvb__cuda_pointer((uintptr_t)src, &is_device, &device), KVB_OK);
    CHECK(!is_device, "cuMemHostAlloc memory seen as device memory");

    kvb_cu_ptr_t mid = dev + ALLOC_SIZE - COPY_SIZE;
    CU(cu->MemcpyAsync(mid, (uintptr_t)src, COPY_SIZE, stream));
    CU(cu->EventRecord(event, stream));
    CU(cu->EventSynchronize(event));
    CU(cu->EventQuery(event));
    CU(cu->MemcpyDtoDAsync(dev, mid, COPY_SIZE, stream));
    CU(cu->MemcpyAsync((uintptr_t)dst, dev, COPY_SIZE, stream));
    CU(cu->StreamSynchronize(stream));
    CU(cu->StreamQuery(stream));
    CHECK(memcmp(src, dst, COPY_SIZE) == 0, "cuMemcpyAsync round trip differs");

    memset(dst, 0, COPY_SIZE);
    CU(cu->MemcpyHtoDAsync(dev, src, COPY_SIZE, stream));
    CU(cu->MemcpyDtoHAsync(dst, dev, COPY_SIZE, stream));
    CU(cu->StreamSynchronize(stream));
    CHECK(memcmp(src, dst, COPY_SIZE) == 0, "cuMemcpyHtoDAsync/DtoHAsync round trip differs");
    CU(cu->MemsetD8(dev, FILL, COPY_SIZE)); /* back to the fill the IPC check expects */

    CU(cu->MemFreeHost(src));
    CU(cu->MemFreeHost(dst));
    CU(cu->EventDestroy(event));
    CU(cu->StreamDestroy(stream));
}

/* Threads with no current context: pointer queries need none; kvb__cuda_use and
 * kvb__cuda_range race on the first retain of nothing (already retained) and of the current
 * context. */
static void *thread_main(void *arg)
{
    kvb_cu_ptr_t dev = *(const kvb_cu_ptr_t *)arg;
    bool is_device = false;
    int device = -1;
    kvb_cu_ctx_t ctx = NULL;
    uint64_t base = 0, size = 0;
    CU(cu->CtxGetCurrent(&ctx));
    CHECK(ctx == NULL, "a new thread has a current context");
    EXPECT(kvb__cuda_pointer(dev + 1, &is_device, &device), KVB_OK);
    CHECK(is_device && device == 0, "device pointer not recognized without a context");
    EXPECT(kvb__cuda_range(dev + 2, &base, &size), KVB_OK);
    CHECK(base == dev && size == ALLOC_SIZE, "range from a thread differs");
    CU(cu->CtxGetCurrent(&ctx));
    CHECK(ctx != NULL, "kvb__cuda_range left no current context");
    EXPECT(kvb__cuda_use(0), KVB_OK);
    return NULL;
}

static void check_threads(kvb_cu_ptr_t dev)
{
    pthread_t threads[NUM_THREADS];
    for (int i = 0; i < NUM_THREADS; i++)
        CHECK(pthread_create(&threads[i], NULL, thread_main, &dev) == 0, "pthread_create");
    for (int i = 0; i < NUM_THREADS; i++)
        CHECK(pthread_join(threads[i], NULL) == 0, "pthread_join");
}

/* The IPC child: opens the parent's allocation, checks the fill, writes its own into a slice. */
static int ipc_child(const char *hex)
{
    kvb_cu_ipc_mem_handle_t handle;
    CHECK(strlen(hex) == 2 * sizeof handle, "bad handle argument");
    for (size_t i = 0; i < sizeof handle; i++) {
        unsigned byte = 0;
        CHECK(sscanf(hex + 2 * i, "%2x", &byte) == 1, "bad handle argument");
        handle.reserved[i] = (char)byte;
    }
    EXPECT(kvb__cuda_use(0), KVB_OK);
    kvb_cu_ptr_t peer = 0;
    CU(cu->IpcOpenMemHandle(&peer, handle, KVB_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    bool is_device = false;
    int device = -1;
    EXPECT(kvb__cuda_pointer(peer, &is_device, &device), KVB_OK);
    CHECK(is_device && device == 0, "IPC-mapped memory not seen as device memory");
    uint64_t base = 0, size = 0;
    EXPECT(kvb__cuda_range(peer + 77, &base, &size), KVB_OK);
    CHECK(base == peer && size >= ALLOC_SIZE, "IPC-mapped range %#llx+%llu",
          (unsigned long long)base, (unsigned long long)size);
    unsigned char buf[CHILD_LEN];
    CU(cu->MemcpyDtoH(buf, peer + CHILD_OFF, sizeof buf));
    check_bytes(buf, sizeof buf, FILL, "IPC child reading the parent's memory");
    CU(cu->MemsetD8(peer + CHILD_OFF, CHILD_FILL, CHILD_LEN));
    CU(cu->CtxSynchronize());
    CU(cu->IpcCloseMemHandle(peer));
    return 0;
}

/* Exports the allocation and has a second process of this program open it. */
static void check_ipc(kvb_cu_ptr_t dev, const char *self)
{
    kvb_cu_ipc_mem_handle_t handle;
    char hex[2 * sizeof handle + 1];
    memset(&handle, 0, sizeof handle);
    CU(cu->IpcGetMemHandle(&handle, dev));
    for (size_t i = 0; i < sizeof handle; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)handle.reserved[i]);
    CHECK(strspn(hex, "0") != strlen(hex), "IPC handle is all zeros");
    CU(cu->CtxSynchronize());

    pid_t pid = fork();
    CHECK(pid >= 0, "fork failed");
    if (pid == 0) {
        /* exec at once: CUDA state is not usable in a forked child. */
        execl(self, self, "--ipc-child", hex, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid failed");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "IPC child failed (status %#x)", status);

    unsigned char buf[CHILD_LEN + 2];
    CU(cu->MemcpyDtoH(buf, dev + CHILD_OFF - 1, sizeof buf));
    CHECK(buf[0] == FILL && buf[CHILD_LEN + 1] == FILL, "IPC child wrote outside its slice");
    check_bytes(buf + 1, CHILD_LEN, CHILD_FILL, "the IPC child's write");
}

/* Optional entry points are reported, not required. */
static void report_optional(void)
{
    if (!cu->FlushGPUDirectRDMAWrites) {
        printf("cuFlushGPUDirectRDMAWrites: not exported\n");
        return;
    }
    int options = 0;
    CU(cu->DeviceGetAttribute(&options,
                              KVB_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS, 0));
    kvb_cu_result_t r =
        cu->FlushGPUDirectRDMAWrites(KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                     KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
    printf("cuFlushGPUDirectRDMAWrites: options %#x, flush to owner: %s\n", options,
           kvb__cuda_errstr(r));
}

int main(int argc, char **argv)
{
    if (!kvb__cuda_available()) {
        printf("gpu_driver_check: skipped: %s\n", kvb__cuda_reason());
        return 77;
    }
    cu = kvb__cuda();
    CHECK(cu != NULL, "kvb__cuda() is NULL although the driver is available");
    CHECK(kvb__cuda_reason()[0] == '\0', "reason set although available: %s", kvb__cuda_reason());
    if (argc == 3 && strcmp(argv[1], "--ipc-child") == 0)
        return ipc_child(argv[2]);

    check_devices();
    EXPECT(kvb__cuda_use(0), KVB_OK);
    kvb_cu_ptr_t dev = 0;
    CU(cu->MemAlloc(&dev, ALLOC_SIZE));
    check_memory(dev);
    check_stream(dev);
    check_threads(dev);
    check_ipc(dev, "/proc/self/exe");
    report_optional();
    CU(cu->MemFree(dev));
    printf("gpu_driver_check: OK\n");
    return 0;
}
