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

typedef struct kvb_region {
    uint64_t addr;
    uint64_t len;
    unsigned access;
    char location[KVB_LOCATION_MAX + 1];
    atomic_uint refs;    /* 1 while registered, +1 per pin */
    atomic_bool removed; /* unregistered: a remover may be waiting for the pins to drop */
} kvb_region_t;

typedef struct kvb_registry {
    pthread_rwlock_t lock;
    kvb_region_t **regions; /* sorted by addr, non-overlapping */
    size_t count, cap;
    pthread_mutex_t drain_mu; /* unregister sleeps here until pins drop */
    pthread_cond_t drain_cv;
} kvb_registry_t;

int kvb__registry_init(kvb_registry_t *r);
/* Frees every region; callers guarantee no pins remain. */
void kvb__registry_fini(kvb_registry_t *r);

int kvb__registry_add(kvb_registry_t *r, uint64_t addr, uint64_t len, const char *location,
                      unsigned access);
/* Removes the region starting at addr and waits up to timeout_ms for its pins to drop:
 * KVB_OK, KVB_ERR_NOT_FOUND, or KVB_ERR_BUSY (still pinned; it is freed by the last unpin). */
int kvb__registry_remove(kvb_registry_t *r, uint64_t addr, int timeout_ms);

/* Checks that [addr, addr+len) lies in one region granting `access` (0: any). On success and if
 * `pin` is not NULL, pins the region into *pin (release with kvb__region_unpin). Returns KVB_OK,
 * the not-registered error given as `missing`, or KVB_ERR_ACCESS_DENIED. */
int kvb__registry_check(kvb_registry_t *r, uint64_t addr, uint64_t len, unsigned access,
                        int missing, kvb_region_t **pin);
void kvb__region_unpin(kvb_registry_t *r, kvb_region_t *region);

/* True if any registered region overlaps [addr, addr+len). */
bool kvb__registry_overlaps(kvb_registry_t *r, uint64_t addr, uint64_t len);

/* Snapshot of all regions (malloc'd; caller frees). */
int kvb__registry_list(kvb_registry_t *r, kvb_region_info_t **out, size_t *n);

#endif
