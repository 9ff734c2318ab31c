/* SPDX-License-Identifier: Apache-2.0 */
/* Loads the CUDA driver with dlopen on first use and fills the function table from its exported
 * symbols; keeps each device's primary context once retained, and answers the questions every GPU
 * data path asks: is this address device memory, which allocation holds it, which PCI device. */
#include "transport/cuda_driver.h"

#include <assert.h>
#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvbridge/status.h"

#define DEFAULT_LIBRARY "libcuda.so.1"

/* dlsym hands back object pointers; POSIX requires them to convert to function pointers, and we
 * store them by representation into the table's typed fields. */
static_assert(sizeof(void *) == sizeof(void (*)(void)), "function pointers are pointer-sized");
static_assert(sizeof(kvb_cu_ipc_mem_handle_t) == 64, "CU_IPC_HANDLE_SIZE is 64");
static_assert(sizeof(kvb_cu_ptr_t) == sizeof(uint64_t), "CUdeviceptr is 64 bits on 64-bit hosts");

/* One table entry: the field to fill, the symbol cuda.h's macros resolve the function to, an
 * older name to try when that one is missing, and whether the driver may lack both. */
typedef struct {
    size_t offset;
    const char *name;
    const char *alt;
    bool optional;
} entry_t;

/* One initializer per line (clang-format would spread each over four). */
/* clang-format off */
#define REQ(field, sym)       {offsetof(kvb__cuda_api_t, field), sym, NULL, false}
#define REQ2(field, sym, old) {offsetof(kvb__cuda_api_t, field), sym, old, false}
#define OPT(field, sym)       {offsetof(kvb__cuda_api_t, field), sym, NULL, true}
/* clang-format on */

static const entry_t entries[] = {
    /* cuInit first: a library that is no driver at all is reported by the name everyone knows. */
    REQ(Init, "cuInit"),
    REQ(DriverGetVersion, "cuDriverGetVersion"),
    REQ(DeviceGet, "cuDeviceGet"),
    REQ(DeviceGetCount, "cuDeviceGetCount"),
    REQ(DeviceGetAttribute, "cuDeviceGetAttribute"),
    REQ(DeviceGetPCIBusId, "cuDeviceGetPCIBusId"),
    REQ(DeviceGetByPCIBusId, "cuDeviceGetByPCIBusId"),
    REQ(DeviceCanAccessPeer, "cuDeviceCanAccessPeer"),
    REQ(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    REQ2(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
    REQ(CtxSetCurrent, "cuCtxSetCurrent"),
    REQ(CtxGetCurrent, "cuCtxGetCurrent"),
    REQ(CtxGetDevice, "cuCtxGetDevice"),
    REQ(CtxSynchronize, "cuCtxSynchronize"),
    REQ(PointerGetAttribute, "cuPointerGetAttribute"),
    REQ(MemGetAddressRange, "cuMemGetAddressRange_v2"),
    REQ(MemAlloc, "cuMemAlloc_v2"),
    REQ(MemFree, "cuMemFree_v2"),
    REQ(MemHostAlloc, "cuMemHostAlloc"),
    REQ(MemFreeHost, "cuMemFreeHost"),
    REQ(MemHostRegister, "cuMemHostRegister_v2"),
    REQ(MemHostUnregister, "cuMemHostUnregister"),
    REQ(Memcpy, "cuMemcpy"),
    REQ(MemcpyAsync, "cuMemcpyAsync"),
    REQ(MemcpyHtoD, "cuMemcpyHtoD_v2"),
    REQ(MemcpyDtoH, "cuMemcpyDtoH_v2"),
    REQ(MemcpyDtoD, "cuMemcpyDtoD_v2"),
    REQ(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    REQ(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
    REQ(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
    REQ(MemsetD8, "cuMemsetD8_v2"),
    REQ(MemsetD8Async, "cuMemsetD8Async"),
    REQ(IpcGetMemHandle, "cuIpcGetMemHandle"),
    REQ2(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
    REQ(IpcCloseMemHandle, "cuIpcCloseMemHandle"),
    REQ(StreamCreate, "cuStreamCreate"),
    REQ(StreamDestroy, "cuStreamDestroy_v2"),
    REQ(StreamSynchronize, "cuStreamSynchronize"),
    REQ(StreamQuery, "cuStreamQuery"),
    REQ(StreamWaitEvent, "cuStreamWaitEvent"),
    REQ(EventCreate, "cuEventCreate"),
    REQ(EventDestroy, "cuEventDestroy_v2"),
    REQ(EventRecord, "cuEventRecord"),
    REQ(EventQuery, "cuEventQuery"),
    REQ(EventSynchronize, "cuEventSynchronize"),
    OPT(GetErrorName, "cuGetErrorName"),
    OPT(GetErrorString, "cuGetErrorString"),
    OPT(FlushGPUDirectRDMAWrites, "cuFlushGPUDirectRDMAWrites"),
};

/* Every field of the table has its entry (the table is nothing but function pointers). */
static_assert(sizeof entries / sizeof entries[0] == sizeof(kvb__cuda_api_t) / sizeof(void *),
              "one entry per field of kvb__cuda_api_t");

/* Written once by load() under `once`; read-only afterwards, so pthread_once's ordering is all
 * the synchronization the readers need. */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static kvb__cuda_api_t api;
static bool available;
static int ndevices;
static char reason[512];

/* Each device's retained primary context, NULL until first used. Read without the lock on the
 * fast path; the lock makes the first retain happen once, so each device holds exactly one
 * reference however many threads race to use it. */
static _Atomic(kvb_cu_ctx_t) *contexts;
static pthread_mutex_t contexts_lock = PTHREAD_MUTEX_INITIALIZER;

/* Names for the results we have constants for, used when the driver cannot name them. */
static const char *known_name(kvb_cu_result_t r)
{
    switch (r) {
    case KVB_CUDA_SUCCESS:
        return "CUDA_SUCCESS";
    case KVB_CUDA_ERROR_INVALID_VALUE:
        return "CUDA_ERROR_INVALID_VALUE";
    case KVB_CUDA_ERROR_OUT_OF_MEMORY:
        return "CUDA_ERROR_OUT_OF_MEMORY";
    case KVB_CUDA_ERROR_NOT_INITIALIZED:
        return "CUDA_ERROR_NOT_INITIALIZED";
    case KVB_CUDA_ERROR_DEINITIALIZED:
        return "CUDA_ERROR_DEINITIALIZED";
    case KVB_CUDA_ERROR_STUB_LIBRARY:
        return "CUDA_ERROR_STUB_LIBRARY";
    case KVB_CUDA_ERROR_NO_DEVICE:
        return "CUDA_ERROR_NO_DEVICE";
    case KVB_CUDA_ERROR_INVALID_DEVICE:
        return "CUDA_ERROR_INVALID_DEVICE";
    case KVB_CUDA_ERROR_INVALID_CONTEXT:
        return "CUDA_ERROR_INVALID_CONTEXT";
    case KVB_CUDA_ERROR_NOT_FOUND:
        return "CUDA_ERROR_NOT_FOUND";
    case KVB_CUDA_ERROR_NOT_READY:
        return "CUDA_ERROR_NOT_READY";
    case KVB_CUDA_ERROR_NOT_SUPPORTED:
        return "CUDA_ERROR_NOT_SUPPORTED";
    }
    return NULL;
}

/* kvb__cuda_errstr without the load: usable by load() itself, which runs inside `once`. */
static const char *describe(kvb_cu_result_t r)
{
    static _Thread_local char buf[256];
    const char *name = NULL;
    const char *text = NULL;
    /* Both fill in NULL and fail for codes the driver does not know. */
    if (api.GetErrorName && api.GetErrorName(r, &name) != KVB_CUDA_SUCCESS)
        name = NULL;
    if (api.GetErrorString && api.GetErrorString(r, &text) != KVB_CUDA_SUCCESS)
        text = NULL;
    if (!name)
        name = known_name(r);
    if (name && text)
        snprintf(buf, sizeof buf, "%s: %s", name, text);
    else if (name)
        snprintf(buf, sizeof buf, "%s (%d)", name, r);
    else
        snprintf(buf, sizeof buf, "CUDA error %d", r);
    return buf;
}

static void unavailable(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void unavailable(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
}

/* Fills `api` from `lib`; on a missing required symbol sets the reason and fails. */
static int resolve(void *lib, const char *path)
{
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        const entry_t *e = &entries[i];
        void *sym = dlsym(lib, e->name);
        if (!sym && e->alt)
            sym = dlsym(lib, e->alt);
        if (!sym && !e->optional) {
            unavailable("%s has no %s (not a CUDA driver, or one too old)", path, e->name);
            return -1;
        }
        memcpy((char *)&api + e->offset, &sym, sizeof sym);
    }
    return 0;
}

/* Runs cuInit and counts the devices; on failure sets the reason. */
static int start(void)
{
    kvb_cu_result_t r = api.Init(0);
    if (r != KVB_CUDA_SUCCESS) {
        unavailable("cuInit failed: %s", describe(r));
        return -1;
    }
    int n = 0;
    r = api.DeviceGetCount(&n);
    if (r != KVB_CUDA_SUCCESS) {
        unavailable("cuDeviceGetCount failed: %s", describe(r));
        return -1;
    }
    if (n <= 0) {
        unavailable("no CUDA devices");
        return -1;
    }
    contexts = malloc((size_t)n * sizeof *contexts);
    if (!contexts) {
        unavailable("out of memory for %d CUDA device contexts", n);
        return -1;
    }
    for (int i = 0; i < n; i++)
        atomic_init(&contexts[i], NULL);
    ndevices = n;
    return 0;
}

static void load(void)
{
    const char *path = getenv("KVB_CUDA_LIBRARY");
    if (!path || !*path)
        path = DEFAULT_LIBRARY;
    /* RTLD_LOCAL: the driver's symbols stay out of the global namespace, where they could
     * otherwise satisfy (or clash with) an application's own CUDA symbols. */
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *err = dlerror();
        if (err && strstr(err, path)) /* glibc's message starts with the path */
            unavailable("cannot load the CUDA driver: %s", err);
        else
            unavailable("cannot load the CUDA driver %s: %s", path, err ? err : "dlopen failed");
    } else if (resolve(lib, path) != 0) {
        /* Nothing of it ran: unloading is safe, and the table must not point into it. */
        memset(&api, 0, sizeof api);
        dlclose(lib);
    } else if (start() == 0) {
        available = true;
    }
    /* A driver that failed in start() stays loaded: cuInit may have started threads or
     * registered fork handlers that must not outlive its code. */
    if (!available) {
        KVB_INFO("CUDA unavailable: %s", reason);
        return;
    }
    int version = 0;
    if (api.DriverGetVersion(&version) != KVB_CUDA_SUCCESS)
        version = 0;
    KVB_INFO("CUDA driver %d.%d (%s): %d device%s", version / 1000, version % 1000 / 10, path,
             ndevices, ndevices == 1 ? "" : "s");
}

bool kvb__cuda_available(void)
{
    pthread_once(&once, load);
    return available;
}

const char *kvb__cuda_reason(void)
{
    pthread_once(&once, load);
    return reason;
}

int kvb__cuda_device_count(void)
{
    pthread_once(&once, load);
    return ndevices;
}

const kvb__cuda_api_t *kvb__cuda(void)
{
    pthread_once(&once, load);
    return available ? &api : NULL;
}

const char *kvb__cuda_errstr(kvb_cu_result_t r)
{
    pthread_once(&once, load);
    return describe(r);
}

int kvb__cuda_status(kvb_cu_result_t r, const char *what)
{
    if (r == KVB_CUDA_SUCCESS)
        return KVB_OK;
    KVB_ERROR("%s: %s", what, kvb__cuda_errstr(r));
    return KVB_ERR_DEVICE;
}

/* KVB_OK if `device` names one of our devices; logs and fails otherwise. */
static int check_device(int device, const char *what)
{
    if (!kvb__cuda_available()) {
        KVB_ERROR("%s: CUDA unavailable: %s", what, reason);
        return KVB_ERR_UNSUPPORTED;
    }
    if (device < 0 || device >= ndevices) {
        KVB_ERROR("%s: CUDA device %d out of range (%d device%s)", what, device, ndevices,
                  ndevices == 1 ? "" : "s");
        return KVB_ERR_INVALID_ARG;
    }
    return KVB_OK;
}

/* The slow path of kvb__cuda_use: retains the primary context of `device` unless a racing thread
 * already has. */
static int retain(int device, kvb_cu_ctx_t *out)
{
    char what[64];
    kvb_cu_device_t dev;
    int rc = KVB_OK;
    pthread_mutex_lock(&contexts_lock);
    kvb_cu_ctx_t ctx = atomic_load_explicit(&contexts[device], memory_order_relaxed);
    if (!ctx) {
        snprintf(what, sizeof what, "cuDeviceGet(%d)", device);
        rc = kvb__cuda_status(api.DeviceGet(&dev, device), what);
        if (rc == KVB_OK) {
            snprintf(what, sizeof what, "cuDevicePrimaryCtxRetain(device %d)", device);
            rc = kvb__cuda_status(api.DevicePrimaryCtxRetain(&ctx, dev), what);
        }
        if (rc == KVB_OK)
            atomic_store_explicit(&contexts[device], ctx, memory_order_release);
    }
    pthread_mutex_unlock(&contexts_lock);
    if (rc == KVB_OK)
        *out = ctx;
    return rc;
}

int kvb__cuda_use(int device)
{
    int rc = check_device(device, "kvb__cuda_use");
    if (rc != KVB_OK)
        return rc;
    kvb_cu_ctx_t ctx = atomic_load_explicit(&contexts[device], memory_order_acquire);
    if (!ctx && (rc = retain(device, &ctx)) != KVB_OK)
        return rc;
    return kvb__cuda_status(api.CtxSetCurrent(ctx), "cuCtxSetCurrent");
}

kvb_cu_ctx_t kvb__cuda_ctx_save(void)
{
    kvb_cu_ctx_t ctx = NULL;
    if (kvb__cuda_available())
        api.CtxGetCurrent(&ctx);
    return ctx;
}

void kvb__cuda_ctx_restore(kvb_cu_ctx_t ctx)
{
    if (kvb__cuda_available())
        api.CtxSetCurrent(ctx);
}

int kvb__cuda_pointer(uint64_t addr, bool *is_device, int *device)
{
    if (!kvb__cuda_available()) {
        *is_device = false;
        *device = -1;
        return KVB_OK;
    }
    /* Unified addressing answers without a current context. Memory the driver never saw is
     * CUDA_ERROR_INVALID_VALUE; registered or driver-allocated host memory is HOST. Managed
     * memory reports DEVICE: the copy functions reach it like device memory. */
    unsigned int type = 0;
    kvb_cu_result_t r = api.PointerGetAttribute(&type, KVB_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr);
    if (r == KVB_CUDA_ERROR_INVALID_VALUE ||
        (r == KVB_CUDA_SUCCESS && type != KVB_CU_MEMORYTYPE_DEVICE &&
         type != KVB_CU_MEMORYTYPE_UNIFIED)) {
        *is_device = false;
        *device = -1;
        return KVB_OK;
    }
    int rc = kvb__cuda_status(r, "cuPointerGetAttribute(MEMORY_TYPE)");
    if (rc != KVB_OK)
        return rc;
    int ordinal = -1;
    r = api.PointerGetAttribute(&ordinal, KVB_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr);
    if ((rc = kvb__cuda_status(r, "cuPointerGetAttribute(DEVICE_ORDINAL)")) != KVB_OK)
        return rc;
    *is_device = true;
    *device = ordinal;
    return KVB_OK;
}

int kvb__cuda_range(uint64_t addr, uint64_t *base, uint64_t *size)
{
    bool is_device = false;
    int device = -1;
    if (!kvb__cuda_available()) {
        KVB_ERROR("address range of %#llx: CUDA unavailable: %s", (unsigned long long)addr, reason);
        return KVB_ERR_UNSUPPORTED;
    }
    int rc = kvb__cuda_pointer(addr, &is_device, &device);
    if (rc != KVB_OK)
        return rc;
    if (!is_device) {
        KVB_ERROR("address range of %#llx: not CUDA device memory", (unsigned long long)addr);
        return KVB_ERR_INVALID_ARG;
    }
    /* cuMemGetAddressRange looks the allocation up in the current context's view. */
    if ((rc = kvb__cuda_use(device)) != KVB_OK)
        return rc;
    kvb_cu_ptr_t b = 0;
    size_t n = 0;
    rc = kvb__cuda_status(api.MemGetAddressRange(&b, &n, addr), "cuMemGetAddressRange");
    if (rc != KVB_OK)
        return rc;
    *base = b;
    *size = n;
    return KVB_OK;
}

int kvb__cuda_bus_id(int device, char *out, size_t cap)
{
    int rc = check_device(device, "kvb__cuda_bus_id");
    if (rc != KVB_OK)
        return rc;
    kvb_cu_device_t dev;
    char id[KVB_CUDA_BUS_ID_LEN] = "";
    if ((rc = kvb__cuda_status(api.DeviceGet(&dev, device), "cuDeviceGet")) != KVB_OK)
        return rc;
    rc = kvb__cuda_status(api.DeviceGetPCIBusId(id, (int)sizeof id, dev), "cuDeviceGetPCIBusId");
    if (rc != KVB_OK)
        return rc;
    id[sizeof id - 1] = '\0';
    size_t len = strlen(id);
    if (len >= cap) {
        KVB_ERROR("PCI bus id %s of CUDA device %d needs %zu bytes, buffer has %zu", id, device,
                  len + 1, cap);
        return KVB_ERR_INVALID_ARG;
    }
    /* Lower case, as Linux names the device in sysfs (/sys/bus/pci/devices/0000:1b:00.0). */
    for (size_t i = 0; i <= len; i++)
        out[i] = (char)tolower((unsigned char)id[i]);
    return KVB_OK;
}

int kvb__cuda_device_by_bus_id(const char *bus, int *device)
{
    if (!bus) {
        KVB_ERROR("CUDA device by PCI bus id: no id given");
        return KVB_ERR_INVALID_ARG;
    }
    if (!kvb__cuda_available()) {
        KVB_ERROR("CUDA device at %s: CUDA unavailable: %s", bus, reason);
        return KVB_ERR_UNSUPPORTED;
    }
    kvb_cu_device_t dev;
    kvb_cu_result_t r = api.DeviceGetByPCIBusId(&dev, bus);
    /* An unknown or malformed id is an answer ("not here"), not a failure: the caller decides. */
    if (r == KVB_CUDA_ERROR_INVALID_DEVICE || r == KVB_CUDA_ERROR_INVALID_VALUE) {
        KVB_DEBUG("no CUDA device at %s: %s", bus, kvb__cuda_errstr(r));
        return KVB_ERR_NOT_FOUND;
    }
    int rc = kvb__cuda_status(r, "cuDeviceGetByPCIBusId");
    if (rc != KVB_OK)
        return rc;
    /* Handles and ordinals coincide in today's drivers, but only the ordinal is promised. */
    for (int i = 0; i < ndevices; i++) {
        kvb_cu_device_t d;
        if ((rc = kvb__cuda_status(api.DeviceGet(&d, i), "cuDeviceGet")) != KVB_OK)
            return rc;
        if (d == dev) {
            *device = i;
            return KVB_OK;
        }
    }
    KVB_DEBUG("CUDA device at %s is not one of ours", bus);
    return KVB_ERR_NOT_FOUND;
}

int kvb__cuda_flush_rdma_writes(int device)
{
    int rc = check_device(device, "kvb__cuda_flush_rdma_writes");
    if (rc != KVB_OK || !api.FlushGPUDirectRDMAWrites)
        return rc;
    kvb_cu_device_t dev;
    int options = 0;
    if (api.DeviceGet(&dev, device) != KVB_CUDA_SUCCESS ||
        api.DeviceGetAttribute(&options,
                               KVB_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
                               dev) != KVB_CUDA_SUCCESS ||
        !(options & KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST))
        return KVB_OK;
    kvb_cu_ctx_t prev = kvb__cuda_ctx_save();
    rc = kvb__cuda_use(device);
    if (rc == KVB_OK)
        rc = kvb__cuda_status(
            api.FlushGPUDirectRDMAWrites(KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                         KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER),
            "cuFlushGPUDirectRDMAWrites");
    kvb__cuda_ctx_restore(prev);
    return rc;
}
