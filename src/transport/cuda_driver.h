/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA driver API, loaded at run time: kvbridge builds without CUDA headers or libraries and
 * runs on hosts without a GPU; where libcuda.so.1 loads and finds a device, the data paths reach
 * GPU memory through the function table below. */
#ifndef KVB_TRANSPORT_CUDA_DRIVER_H
#define KVB_TRANSPORT_CUDA_DRIVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Our spelling of the driver's types: same sizes and calling conventions as cuda.h's (CUresult,
 * CUdevice, CUcontext, CUstream, CUevent, CUdeviceptr on 64-bit hosts, CUipcMemHandle). */
typedef int kvb_cu_result_t;
typedef int kvb_cu_device_t;
typedef struct kvb_cu_ctx_st *kvb_cu_ctx_t;
typedef struct kvb_cu_stream_st *kvb_cu_stream_t;
typedef struct kvb_cu_event_st *kvb_cu_event_t;
typedef unsigned long long kvb_cu_ptr_t;
typedef struct {
    char reserved[64];
} kvb_cu_ipc_mem_handle_t;

/* The constants we use, with the values of the public cuda.h (checked against CUDA 12.6); each
 * is cuda.h's name behind a KVB_ prefix, so that the two headers can meet in one file. */
enum {
    /* CUresult */
    KVB_CUDA_SUCCESS = 0,
    KVB_CUDA_ERROR_INVALID_VALUE = 1,
    KVB_CUDA_ERROR_OUT_OF_MEMORY = 2,
    KVB_CUDA_ERROR_NOT_INITIALIZED = 3,
    KVB_CUDA_ERROR_DEINITIALIZED = 4,
    KVB_CUDA_ERROR_STUB_LIBRARY = 34,
    KVB_CUDA_ERROR_NO_DEVICE = 100,
    KVB_CUDA_ERROR_INVALID_DEVICE = 101,
    KVB_CUDA_ERROR_INVALID_CONTEXT = 201,
    KVB_CUDA_ERROR_NOT_FOUND = 500,
    KVB_CUDA_ERROR_NOT_READY = 600,
    KVB_CUDA_ERROR_NOT_SUPPORTED = 801,

    /* CUpointer_attribute */
    KVB_CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    KVB_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    KVB_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
    KVB_CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,
    KVB_CU_POINTER_ATTRIBUTE_SYNC_MEMOPS = 6,
    KVB_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
    KVB_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
    KVB_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    KVB_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    KVB_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,

    /* CUmemorytype */
    KVB_CU_MEMORYTYPE_HOST = 1,
    KVB_CU_MEMORYTYPE_DEVICE = 2,
    KVB_CU_MEMORYTYPE_ARRAY = 3,
    KVB_CU_MEMORYTYPE_UNIFIED = 4,

    /* CUdevice_attribute */
    KVB_CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    KVB_CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
    KVB_CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    KVB_CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
    KVB_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116,
    KVB_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS = 117,
    KVB_CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING = 118,

    /* Flags: CUipcMem_flags, CU_MEMHOSTALLOC_*, CU_MEMHOSTREGISTER_*, CUstream_flags,
     * CUevent_flags */
    KVB_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
    KVB_CU_MEMHOSTALLOC_PORTABLE = 1,
    KVB_CU_MEMHOSTALLOC_DEVICEMAP = 2,
    KVB_CU_MEMHOSTREGISTER_PORTABLE = 1,
    KVB_CU_MEMHOSTREGISTER_DEVICEMAP = 2,
    KVB_CU_STREAM_DEFAULT = 0,
    KVB_CU_STREAM_NON_BLOCKING = 1,
    KVB_CU_EVENT_DEFAULT = 0,
    KVB_CU_EVENT_BLOCKING_SYNC = 1,
    KVB_CU_EVENT_DISABLE_TIMING = 2,

    /* CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope and the bits of
     * CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS */
    KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0,
    KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100,
    KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES = 200,
    KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST = 1,
    KVB_CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS = 2,
};

/* A buffer this large holds any PCI bus id, "dddd:bb:dd.f" and longer domains alike. */
#define KVB_CUDA_BUS_ID_LEN 32

/* The driver's entry points. Field X is the driver's cuX with its exact signature in our types:
 * enumerations are passed as int (as the C ABI passes them), byte counts are size_t and device
 * addresses kvb_cu_ptr_t. Each is resolved by the symbol that cuda.h's macros make a program call
 * (cuMemAlloc_v2, cuMemcpyDtoH_v2, cuStreamDestroy_v2, ...; the table in cuda_driver.c), so the
 * NULL stream is the legacy default stream, not the per-thread one. */
typedef struct {
    /* Initialization and devices */
    kvb_cu_result_t (*Init)(unsigned int flags);
    kvb_cu_result_t (*DriverGetVersion)(int *version);
    kvb_cu_result_t (*DeviceGet)(kvb_cu_device_t *dev, int ordinal);
    kvb_cu_result_t (*DeviceGetCount)(int *count);
    kvb_cu_result_t (*DeviceGetAttribute)(int *value, int attrib, kvb_cu_device_t dev);
    kvb_cu_result_t (*DeviceGetPCIBusId)(char *bus_id, int len, kvb_cu_device_t dev);
    kvb_cu_result_t (*DeviceGetByPCIBusId)(kvb_cu_device_t *dev, const char *bus_id);
    kvb_cu_result_t (*DeviceCanAccessPeer)(int *can, kvb_cu_device_t dev, kvb_cu_device_t peer);

    /* Contexts */
    kvb_cu_result_t (*DevicePrimaryCtxRetain)(kvb_cu_ctx_t *ctx, kvb_cu_device_t dev);
    kvb_cu_result_t (*DevicePrimaryCtxRelease)(kvb_cu_device_t dev);
    kvb_cu_result_t (*CtxSetCurrent)(kvb_cu_ctx_t ctx);
    kvb_cu_result_t (*CtxGetCurrent)(kvb_cu_ctx_t *ctx);
    kvb_cu_result_t (*CtxGetDevice)(kvb_cu_device_t *dev);
    kvb_cu_result_t (*CtxSynchronize)(void);

    /* Memory */
    kvb_cu_result_t (*PointerGetAttribute)(void *data, int attrib, kvb_cu_ptr_t ptr);
    kvb_cu_result_t (*MemGetAddressRange)(kvb_cu_ptr_t *base, size_t *size, kvb_cu_ptr_t ptr);
    kvb_cu_result_t (*MemAlloc)(kvb_cu_ptr_t *ptr, size_t size);
    kvb_cu_result_t (*MemFree)(kvb_cu_ptr_t ptr);
    kvb_cu_result_t (*MemHostAlloc)(void **p, size_t size, unsigned int flags);
    kvb_cu_result_t (*MemFreeHost)(void *p);
    kvb_cu_result_t (*MemHostRegister)(void *p, size_t size, unsigned int flags);
    kvb_cu_result_t (*MemHostUnregister)(void *p);

    /* Copies (cuMemcpy and cuMemcpyAsync take any unified address, host or device) */
    kvb_cu_result_t (*Memcpy)(kvb_cu_ptr_t dst, kvb_cu_ptr_t src, size_t size);
    kvb_cu_result_t (*MemcpyAsync)(kvb_cu_ptr_t dst, kvb_cu_ptr_t src, size_t size,
                                   kvb_cu_stream_t stream);
    kvb_cu_result_t (*MemcpyHtoD)(kvb_cu_ptr_t dst, const void *src, size_t size);
    kvb_cu_result_t (*MemcpyDtoH)(void *dst, kvb_cu_ptr_t src, size_t size);
    kvb_cu_result_t (*MemcpyDtoD)(kvb_cu_ptr_t dst, kvb_cu_ptr_t src, size_t size);
    kvb_cu_result_t (*MemcpyHtoDAsync)(kvb_cu_ptr_t dst, const void *src, size_t size,
                                       kvb_cu_stream_t stream);
    kvb_cu_result_t (*MemcpyDtoHAsync)(void *dst, kvb_cu_ptr_t src, size_t size,
                                       kvb_cu_stream_t stream);
    kvb_cu_result_t (*MemcpyDtoDAsync)(kvb_cu_ptr_t dst, kvb_cu_ptr_t src, size_t size,
                                       kvb_cu_stream_t stream);
    kvb_cu_result_t (*MemsetD8)(kvb_cu_ptr_t dst, unsigned char value, size_t size);
    kvb_cu_result_t (*MemsetD8Async)(kvb_cu_ptr_t dst, unsigned char value, size_t size,
                                     kvb_cu_stream_t stream);

    /* Inter-process memory (the handle is passed by value, as the driver takes it) */
    kvb_cu_result_t (*IpcGetMemHandle)(kvb_cu_ipc_mem_handle_t *handle, kvb_cu_ptr_t ptr);
    kvb_cu_result_t (*IpcOpenMemHandle)(kvb_cu_ptr_t *ptr, kvb_cu_ipc_mem_handle_t handle,
                                        unsigned int flags);
    kvb_cu_result_t (*IpcCloseMemHandle)(kvb_cu_ptr_t ptr);

    /* Streams and events */
    kvb_cu_result_t (*StreamCreate)(kvb_cu_stream_t *stream, unsigned int flags);
    kvb_cu_result_t (*StreamDestroy)(kvb_cu_stream_t stream);
    kvb_cu_result_t (*StreamSynchronize)(kvb_cu_stream_t stream);
    kvb_cu_result_t (*StreamQuery)(kvb_cu_stream_t stream);
    kvb_cu_result_t (*StreamWaitEvent)(kvb_cu_stream_t stream, kvb_cu_event_t event,
                                       unsigned int flags);
    kvb_cu_result_t (*EventCreate)(kvb_cu_event_t *event, unsigned int flags);
    kvb_cu_result_t (*EventDestroy)(kvb_cu_event_t event);
    kvb_cu_result_t (*EventRecord)(kvb_cu_event_t event, kvb_cu_stream_t stream);
    kvb_cu_result_t (*EventQuery)(kvb_cu_event_t event);
    kvb_cu_result_t (*EventSynchronize)(kvb_cu_event_t event);

    /* Optional: NULL where the driver is too old to export them. */
    kvb_cu_result_t (*GetErrorName)(kvb_cu_result_t r, const char **name);
    kvb_cu_result_t (*GetErrorString)(kvb_cu_result_t r, const char **text);
    kvb_cu_result_t (*FlushGPUDirectRDMAWrites)(int target, int scope);
} kvb__cuda_api_t;

/* Loading happens once, on the first call of any function below, from the path in
 * $KVB_CUDA_LIBRARY or else "libcuda.so.1"; it runs cuInit(0) and counts the devices. Every
 * function may be called from any thread. A child forked after loading inherits the answers but
 * not a usable driver (CUDA's rule): such children must exec before touching GPU memory. */

/* True if the driver loaded, initialized and has at least one device. */
bool kvb__cuda_available(void);

/* Why the driver is unavailable, for logs (e.g. "cuInit failed: CUDA_ERROR_NO_DEVICE: ..."); ""
 * when it is available. The string lives as long as the process. */
const char *kvb__cuda_reason(void);

/* The number of CUDA devices; 0 when the driver is unavailable. */
int kvb__cuda_device_count(void);

/* The driver's function table, valid for the life of the process; NULL when unavailable. */
const kvb__cuda_api_t *kvb__cuda(void);

/* "CUDA_ERROR_NAME: description" for a driver result (from the driver when it can say, else a
 * name we know or the number). The text lives in a per-thread buffer, valid until the calling
 * thread's next call. */
const char *kvb__cuda_errstr(kvb_cu_result_t r);

/* KVB_OK for CUDA_SUCCESS; otherwise logs "`what`: CUDA_ERROR_NAME: description" as an error and
 * returns KVB_ERR_DEVICE (the status of every failed driver call). */
int kvb__cuda_status(kvb_cu_result_t r, const char *what);

/* Makes device `device`'s primary context current in the calling thread, retaining it on the
 * first use; retained contexts are kept for the life of the process (the primary context is the
 * one the application's CUDA runtime shares, and releasing it during exit races the driver's own
 * teardown). It replaces the thread's current context, so call it on kvbridge's threads only.
 * KVB_ERR_INVALID_ARG for an ordinal out of range, KVB_ERR_UNSUPPORTED without a driver,
 * KVB_ERR_DEVICE if the driver fails. */
int kvb__cuda_use(int device);

/* The calling thread's current context, to be put back with kvb__cuda_ctx_restore after
 * kvb__cuda_use (on an application's thread: its own context stays as it was). NULL (no context)
 * when the driver is unavailable. */
kvb_cu_ctx_t kvb__cuda_ctx_save(void);
void kvb__cuda_ctx_restore(kvb_cu_ctx_t ctx);

/* Where `addr` lives: *is_device true and *device its ordinal for device (and managed) memory;
 * false and -1 for anything else - pageable or pinned host memory, unknown addresses, and every
 * address when the driver is unavailable (always KVB_OK then). Outputs are set only on KVB_OK;
 * KVB_ERR_DEVICE if the driver fails on a device address. */
int kvb__cuda_pointer(uint64_t addr, bool *is_device, int *device);

/* The device allocation holding `addr`: its base address and size. Makes the allocation's device
 * current in the calling thread (see kvb__cuda_use). KVB_ERR_INVALID_ARG if `addr` is not device
 * memory, KVB_ERR_UNSUPPORTED without a driver, KVB_ERR_DEVICE if the driver fails. */
int kvb__cuda_range(uint64_t addr, uint64_t *base, uint64_t *size);

/* The PCI bus id of device `device`, lower-case ("0000:1b:00.0"), written with its terminating
 * NUL into out[0..cap); KVB_CUDA_BUS_ID_LEN bytes always suffice. KVB_ERR_INVALID_ARG for an
 * ordinal out of range or a buffer too small, KVB_ERR_UNSUPPORTED without a driver. */
int kvb__cuda_bus_id(int device, char *out, size_t cap);

/* The ordinal of the device at PCI bus id `bus` (any case, as kvb__cuda_bus_id or nvidia-smi
 * write it). KVB_ERR_NOT_FOUND (not logged) if no device of ours is there, KVB_ERR_INVALID_ARG for
 * NULL, KVB_ERR_UNSUPPORTED without a driver. */
int kvb__cuda_device_by_bus_id(const char *bus, int *device);

/* Makes writes that a NIC made into memory of `device` (GPUDirect RDMA) visible to that device's
 * work before the caller reports them: cuFlushGPUDirectRDMAWrites on the device's context, where
 * the device says it supports the flush from the host. KVB_OK with nothing done where the driver
 * is too old to export it or the device does not offer it (there the platform's ordering of the
 * NIC's writes is what holds); KVB_ERR_DEVICE if the flush fails. */
int kvb__cuda_flush_rdma_writes(int device);

#endif
