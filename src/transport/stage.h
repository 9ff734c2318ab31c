/* SPDX-License-Identifier: Apache-2.0 */
/* Staging for device memory on the host-only paths: the TCP lanes send and receive host bytes, so
 * a request on GPU memory moves through a host bounce buffer - copied out of the device before it
 * is sent, or into the device once it has arrived. Bounce buffers come from a process-wide pool
 * of pinned (page-locked) host memory, so the copies run at the PCIe link's speed, and fall back
 * to ordinary memory when the pool is spent. Copies are synchronous with the calling thread and
 * issued on the device's legacy default stream, so they are ordered after the work the
 * application queued there before. */
#ifndef KVB_TRANSPORT_STAGE_H
#define KVB_TRANSPORT_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/registry.h"

/* Checks a region being registered against what the driver says of its memory: "cuda:N" must be
 * device memory of device N from its first byte to its last (else KVB_ERR_INVALID_ARG, logged),
 * and "*" becomes "cuda:N" where it is device memory. KVB_ERR_UNSUPPORTED for device memory
 * without a driver; KVB_OK for host memory. */
int kvb__stage_region(kvb_region_t *reg);

/* True if the lanes can stage memory of this kind here (device memory with a CUDA driver). */
bool kvb__stage_can(kvb_mem_kind_t kind);

/* A bounce buffer of at least len bytes (NULL: out of memory); give it back with kvb__stage_put,
 * which also frees plain malloc memory (NULL is ignored). */
uint8_t *kvb__stage_get(size_t len);
void kvb__stage_put(uint8_t *buf);

/* Copies between device memory of device `dev` and host memory; KVB_ERR_DEVICE (logged with CUDA's
 * message) if the driver fails. Safe on any thread: the thread's current context is restored. */
int kvb__stage_out(uint8_t *host, uint64_t device_src, size_t len, int dev);
int kvb__stage_in(uint64_t device_dst, const uint8_t *host, size_t len, int dev);

#endif
