/* SPDX-License-Identifier: Apache-2.0 */
/* Staging for device memory on the host-only paths: the TCP lanes send and receive host bytes, so
 * a request on GPU memory moves through a host bounce buffer - copied out of the device before it
 * is sent, or into the device once it has arrived. Bounce buffers come from a process-wide pool
 * of pinned (page-locked) host memory, so the copies run at the PCIe link's speed, and fall back
 * to ordinary memory when the pool is spent. Copies are queued on streams that are blocking with
 * respect to the legacy default stream, so they are ordered after the work the application queued
 * there before, and waited for together (one wait per batch of requests or read pass). */
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

/* Copies queued without waiting, on a stream per device (created on first use, in the calling
 * thread's context, blocking with respect to the legacy default stream); kvb__stage_wait waits for
 * all of them. A queue belongs to one thread at a time; NULL *q is a new, empty queue. */
typedef struct kvb_stage_queue kvb_stage_queue_t;
int kvb__stage_out_async(kvb_stage_queue_t **q, uint8_t *host, uint64_t device_src, size_t len,
                         int dev);
int kvb__stage_in_async(kvb_stage_queue_t **q, uint64_t device_dst, const uint8_t *host, size_t len,
                        int dev);
/* Waits for every copy queued since the last wait: KVB_OK, or KVB_ERR_DEVICE if any failed. */
int kvb__stage_wait(kvb_stage_queue_t *q);
void kvb__stage_queue_free(kvb_stage_queue_t *q);
/* The calling thread's own queue (for threads that are not kvbridge's: an application's thread
 * submitting), freed when the thread exits. */
kvb_stage_queue_t **kvb__stage_thread_queue(void);

#endif
