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

/* Key blobs: what a peer needs, besides the address, to reach a region through one data path (a
 * remote key, an IPC handle). A region's keys are a run of (path id u8 | length u8 | blob)
 * entries, at most KVB_REGION_KEYS_MAX bytes together; most paths need none. */
#define KVB_KEY_MAX         160
#define KVB_REGION_KEYS_MAX 512
/* Data paths are numbered 0..KVB_PATHS_MAX-1 (their ids, engine/internal.h). */
#define KVB_PATHS_MAX 8

/* A region as the handshake carries it: what the owner declared, the memory kind parsed from its
 * location, and its key blobs. `keys` points into the same allocation as the array holding it. */
typedef struct {
    kvb_region_info_t info;
    kvb_mem_kind_t kind;
    int device;
    uint16_t keys_len;
    const uint8_t *keys;
} kvb_region_desc_t;

/* The key blob that region `d` carries for data path `path`, and its length; NULL if none. */
const uint8_t *kvb__region_key(const kvb_region_desc_t *d, unsigned path, size_t *len);

/* The region of descs[0..n) (sorted by address, as registries and handshakes list them) that
 * holds [addr, addr+len), or NULL. */
const kvb_region_desc_t *kvb__region_find(const kvb_region_desc_t *descs, size_t n, uint64_t addr,
                                          uint64_t len);

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
    uint16_t keys_len;   /* the key blobs data paths made for it (see kvb_region_desc_t) */
    uint8_t keys[KVB_REGION_KEYS_MAX];
    void *path_state[KVB_PATHS_MAX]; /* per data path (by id), what it keeps for the region (an MR,
                                        a map) */
} kvb_region_t;

/* Called once for each region as its last reference goes, before it is freed. */
typedef void (*kvb_region_release_fn)(void *ctx, kvb_region_t *region);

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
    kvb_region_release_fn release; /* may be NULL */
    void *release_ctx;
} kvb_registry_t;

int kvb__registry_init(kvb_registry_t *r);
/* Frees every region; callers guarantee no pins remain. */
void kvb__registry_fini(kvb_registry_t *r);

/* Makes a region (not yet visible) after checking its arguments: KVB_ERR_INVALID_ARG (empty,
 * bad rights or location), KVB_ERR_OVERFLOW. Data paths then add their keys to it, outside any
 * lock, before kvb__registry_insert publishes it. */
int kvb__region_new(uint64_t addr, uint64_t len, const char *location, unsigned access,
                    kvb_region_t **out);
/* Appends data path `path`'s key blob to the region's keys. KVB_ERR_TOO_LARGE if they are full. */
int kvb__region_add_key(kvb_region_t *reg, unsigned path, const uint8_t *key, size_t len);
/* Publishes a region made by kvb__region_new; KVB_ERR_OVERLAP (or KVB_ERR_NOMEM) leaves it to
 * the caller. */
int kvb__registry_insert(kvb_registry_t *r, kvb_region_t *reg);
/* kvb__region_new and kvb__registry_insert in one, for regions that need no keys. */
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
/* Drops n pins of `region` at once. */
void kvb__region_unpin_n(kvb_registry_t *r, kvb_region_t *region, unsigned n);
/* Pins `region` once more for [addr, addr+len) with `access`, without the registry's lock: for the
 * next of many requests into the region the caller checked last and still holds pinned (which
 * keeps its removal from completing meanwhile). False where the range or the access does not fit
 * or the region is being removed: then ask kvb__registry_check. */
bool kvb__region_repin(kvb_region_t *region, uint64_t addr, uint64_t len, unsigned access);
/* kvb__region_repin's test without the pin: for a caller that counts the pins it owes a region it
 * holds pinned, and adds them at once with kvb__region_pin_n. */
bool kvb__region_covers(kvb_region_t *region, uint64_t addr, uint64_t len, unsigned access);
/* Adds n pins to `region`, which the caller holds pinned. */
void kvb__region_pin_n(kvb_region_t *region, unsigned n);

/* True if any registered or draining region overlaps [addr, addr+len). */
bool kvb__registry_overlaps(kvb_registry_t *r, uint64_t addr, uint64_t len);

/* Snapshot of all regions, keys included, in one allocation (caller frees). */
int kvb__registry_list(kvb_registry_t *r, kvb_region_desc_t **out, size_t *n);

#endif
