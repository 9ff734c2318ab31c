/* SPDX-License-Identifier: Apache-2.0 */
/* Registry of local memory regions: a sorted array under a reader-writer lock, searched by
 * binary search on every remote request, with per-region pin counts so that a region is never
 * freed while a socket is reading from or writing into it. */
#include "engine/registry.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/clock.h"

int kvb__registry_init(kvb_registry_t *r)
{
    memset(r, 0, sizeof *r);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_rwlock_init(&r->lock, NULL) || pthread_mutex_init(&r->drain_mu, NULL) ||
             pthread_cond_init(&r->drain_cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc ? KVB_ERR_SYSTEM : KVB_OK;
}

void kvb__registry_fini(kvb_registry_t *r)
{
    for (size_t i = 0; i < r->count; i++)
        free(r->regions[i]);
    free(r->regions);
    pthread_rwlock_destroy(&r->lock);
    pthread_mutex_destroy(&r->drain_mu);
    pthread_cond_destroy(&r->drain_cv);
}

/* Index of the last region with addr <= a, or -1. Caller holds the lock. */
static ptrdiff_t find_floor(const kvb_registry_t *r, uint64_t a)
{
    size_t lo = 0, hi = r->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->regions[mid]->addr <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (ptrdiff_t)lo - 1;
}

int kvb__registry_add(kvb_registry_t *r, uint64_t addr, uint64_t len, const char *location,
                      unsigned access)
{
    uint64_t end;
    if (len == 0 || access == 0 || (access & ~(unsigned)KVB_ACCESS_RW))
        return KVB_ERR_INVALID_ARG;
    if (kvb__add_u64(addr, len, &end))
        return KVB_ERR_OVERFLOW;
    if (!location)
        location = "cpu";
    if (strlen(location) > KVB_LOCATION_MAX)
        return KVB_ERR_INVALID_ARG;
    kvb_region_t *reg = calloc(1, sizeof *reg);
    if (!reg)
        return KVB_ERR_NOMEM;
    reg->addr = addr;
    reg->len = len;
    reg->access = access;
    strcpy(reg->location, location);
    atomic_init(&reg->refs, 1);
    atomic_init(&reg->removed, false);

    int rc = KVB_OK;
    pthread_rwlock_wrlock(&r->lock);
    ptrdiff_t i = find_floor(r, addr);
    if ((i >= 0 && r->regions[i]->addr + r->regions[i]->len > addr) ||
        ((size_t)(i + 1) < r->count && r->regions[i + 1]->addr < end)) {
        rc = KVB_ERR_OVERLAP;
    } else if (r->count == r->cap) {
        size_t ncap = r->cap ? r->cap * 2 : 16;
        kvb_region_t **n = realloc(r->regions, ncap * sizeof *n);
        if (!n)
            rc = KVB_ERR_NOMEM;
        else {
            r->regions = n;
            r->cap = ncap;
        }
    }
    if (rc == KVB_OK) {
        size_t pos = (size_t)(i + 1);
        memmove(r->regions + pos + 1, r->regions + pos, (r->count - pos) * sizeof *r->regions);
        r->regions[pos] = reg;
        r->count++;
    }
    pthread_rwlock_unlock(&r->lock);
    if (rc != KVB_OK)
        free(reg);
    return rc;
}

int kvb__registry_remove(kvb_registry_t *r, uint64_t addr, int timeout_ms)
{
    kvb_region_t *reg = NULL;
    pthread_rwlock_wrlock(&r->lock);
    ptrdiff_t i = find_floor(r, addr);
    if (i >= 0 && r->regions[i]->addr == addr) {
        reg = r->regions[i];
        memmove(r->regions + i, r->regions + i + 1,
                (r->count - (size_t)i - 1) * sizeof *r->regions);
        r->count--;
    }
    pthread_rwlock_unlock(&r->lock);
    if (!reg)
        return KVB_ERR_NOT_FOUND;
    atomic_store(&reg->removed, true);

    /* No new pins can start now. Wait for the ones in flight; if we give up first, the last
     * unpin frees the region. Sleeps in slices of at most 10 ms: an unpin that read `removed`
     * just before we set it does not signal, and must not cost us the whole timeout. */
    uint64_t deadline = kvb__deadline_ms(timeout_ms);
    int rc = KVB_OK;
    pthread_mutex_lock(&r->drain_mu);
    while (atomic_load(&reg->refs) > 1) {
        uint64_t now = kvb__now_ns();
        if (now >= deadline) {
            rc = KVB_ERR_BUSY;
            break;
        }
        uint64_t until = now + 10000000ull < deadline ? now + 10000000ull : deadline;
        struct timespec ts = kvb__timespec_of(until);
        pthread_cond_timedwait(&r->drain_cv, &r->drain_mu, &ts);
    }
    pthread_mutex_unlock(&r->drain_mu);
    kvb__region_unpin(r, reg); /* drops the registration's own reference */
    return rc;
}

int kvb__registry_check(kvb_registry_t *r, uint64_t addr, uint64_t len, unsigned access,
                        int missing, kvb_region_t **pin)
{
    int rc = missing;
    pthread_rwlock_rdlock(&r->lock);
    ptrdiff_t i = find_floor(r, addr);
    if (i >= 0 && len > 0) {
        kvb_region_t *reg = r->regions[i];
        if (kvb__range_within(addr, len, reg->addr, reg->len)) {
            if ((reg->access & access) != access) {
                rc = KVB_ERR_ACCESS_DENIED;
            } else {
                rc = KVB_OK;
                if (pin) {
                    atomic_fetch_add(&reg->refs, 1);
                    *pin = reg;
                }
            }
        }
    }
    pthread_rwlock_unlock(&r->lock);
    return rc;
}

void kvb__region_unpin(kvb_registry_t *r, kvb_region_t *reg)
{
    /* Read before the decrement: once it is done, a remover may free the region. */
    bool removed = atomic_load(&reg->removed);
    unsigned prev = atomic_fetch_sub(&reg->refs, 1);
    if (prev == 1) {
        free(reg);
    } else if (prev == 2 && removed) {
        /* The last pin of a region being unregistered: wake its remover. */
        pthread_mutex_lock(&r->drain_mu);
        pthread_cond_broadcast(&r->drain_cv);
        pthread_mutex_unlock(&r->drain_mu);
    }
}

bool kvb__registry_overlaps(kvb_registry_t *r, uint64_t addr, uint64_t len)
{
    bool hit = false;
    pthread_rwlock_rdlock(&r->lock);
    for (size_t i = 0; i < r->count && !hit; i++)
        hit = r->regions[i]->addr < addr + len && addr < r->regions[i]->addr + r->regions[i]->len;
    pthread_rwlock_unlock(&r->lock);
    return hit;
}

int kvb__registry_list(kvb_registry_t *r, kvb_region_info_t **out, size_t *n)
{
    pthread_rwlock_rdlock(&r->lock);
    kvb_region_info_t *v = r->count ? calloc(r->count, sizeof *v) : NULL;
    if (r->count && !v) {
        pthread_rwlock_unlock(&r->lock);
        return KVB_ERR_NOMEM;
    }
    for (size_t i = 0; i < r->count; i++) {
        v[i].addr = r->regions[i]->addr;
        v[i].len = r->regions[i]->len;
        v[i].access = r->regions[i]->access;
        strcpy(v[i].location, r->regions[i]->location);
    }
    *n = r->count;
    pthread_rwlock_unlock(&r->lock);
    *out = v;
    return KVB_OK;
}
