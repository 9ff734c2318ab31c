/* SPDX-License-Identifier: Apache-2.0 */
/* The memory registry: which address ranges this process exposes, where they live and with which
 * rights. Lookups pin a region so that unregistering waits for transfers that are using it. */
#ifndef KVB_ENGINE_REGISTRY_H
#define KVB_ENGINE_REGISTRY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvbridge/engine.h"

/* Where a region's memory lives, parsed from its location string. Only host memory is addressable
 * by the engine itself; other kinds need a data path that can serve them. */
typedef enum { KVB_MEM_CPU = 0, KVB_MEM_CUDA = 1 } kvb_mem_kind_t;

/* Parses "cpu", "cpu:N", "cuda:N" or "*" (auto-detect: host memory until a device provider can
 * tell otherwise); NULL means "cpu". KVB_ERR_INVALID_ARG for anything else. */
int kvb__mem_kind_parse(const char *location, kvb_mem_kind_t *kind, int *device);

typedef struct kvb_region {
    uint64_t addr;
    uint64_t len;
    unsigned access;
    kvb_mem_kind_t kind;
    int device; /* N of cpu:N / cuda:N; -1 when not given */
    char location[KVB_LOCATION_MAX + 1];
    atomic_uint refs;    /* 1 while registered, +1 per pin, +1 per waiting remover */
    unsigned waiters;    /* kvb_unregister calls waiting for it (guarded by the registry lock) */
    atomic_bool removed; /* unregistered: a remover may be waiting for the pins to drop */
} kvb_region_t;

typedef struct kvb_registry {
    pthread_rwlock_t lock;
    kvb_region_t **regions; /* sorted by addr, non-overlapping */
    size_t count, cap;
    /* Unregistered regions whose memory may still be in use (kvb_unregister gave up with BUSY):
     * no request may use them, nothing may be registered over them, and the next
     * kvb_unregister of their address waits for them again. */
    kvb_region_t **draining;
    size_t ndraining, capdraining;
    pthread_mutex_t drain_mu; /* unregister sleeps here until pins drop */
    pthread_cond_t drain_cv;
} kvb_registry_t;

int kvb__registry_init(kvb_registry_t *r);
/* Frees every region; callers guarantee no pins remain. */
void kvb__registry_fini(kvb_registry_t *r);

int kvb__registry_add(kvb_registry_t *r, uint64_t addr, uint64_t len, const char *location,
                      unsigned access);
/* Removes the region starting at addr (or finds it among the draining ones) and waits up to
 * timeout_ms for its pins to drop: KVB_OK (gone; its memory is free to reuse), KVB_ERR_NOT_FOUND,
 * or KVB_ERR_BUSY (still pinned: it stays draining until a later call returns KVB_OK). */
int kvb__registry_remove(kvb_registry_t *r, uint64_t addr, int timeout_ms);

/* Checks that [addr, addr+len) lies in one region granting `access` (0: any). On success and if
 * `pin` is not NULL, pins the region into *pin (release with kvb__region_unpin). Returns KVB_OK,
 * the not-registered error given as `missing`, or KVB_ERR_ACCESS_DENIED. */
int kvb__registry_check(kvb_registry_t *r, uint64_t addr, uint64_t len, unsigned access,
                        int missing, kvb_region_t **pin);
void kvb__region_unpin(kvb_registry_t *r, kvb_region_t *region);

/* True if any registered or draining region overlaps [addr, addr+len). */
bool kvb__registry_overlaps(kvb_registry_t *r, uint64_t addr, uint64_t len);

/* Snapshot of all regions (malloc'd; caller frees). */
int kvb__registry_list(kvb_registry_t *r, kvb_region_info_t **out, size_t *n);

#endif
