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

static void region_free(kvb_registry_t *r, kvb_region_t *reg)
{
    if (r->release)
        r->release(r->release_ctx, reg);
    free(reg);
}

void kvb__registry_fini(kvb_registry_t *r)
{
    for (size_t i = 0; i < r->count; i++)
        region_free(r, r->regions[i]);
    free(r->regions);
    for (size_t i = 0; i < r->ndraining; i++)
        region_free(r, r->draining[i]);
    free(r->draining);
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

int kvb__mem_kind_parse(const char *location, kvb_mem_kind_t *kind, int *device)
{
    static const struct {
        const char *prefix;
        kvb_mem_kind_t kind;
    } kinds[] = {{"cpu", KVB_MEM_CPU}, {"cuda", KVB_MEM_CUDA}};
    if (!location || !strcmp(location, "*")) {
        *kind = KVB_MEM_CPU;
        *device = -1;
        return KVB_OK;
    }
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        size_t pl = strlen(kinds[k].prefix);
        if (strncmp(location, kinds[k].prefix, pl))
            continue;
        const char *p = location + pl;
        if (*p == '\0' && kinds[k].kind == KVB_MEM_CPU) {
            *kind = KVB_MEM_CPU;
            *device = -1;
            return KVB_OK;
        }
        if (*p++ != ':' || *p < '0' || *p > '9')
            return KVB_ERR_INVALID_ARG;
        long n = 0;
        for (; *p >= '0' && *p <= '9' && n <= 65535; p++)
            n = n * 10 + (*p - '0');
        if (*p || n > 65535)
            return KVB_ERR_INVALID_ARG;
        *kind = kinds[k].kind;
        *device = (int)n;
        return KVB_OK;
    }
    return KVB_ERR_INVALID_ARG;
}

/* True if [addr, end) overlaps a draining region. Caller holds the lock. */
static bool overlaps_draining(const kvb_registry_t *r, uint64_t addr, uint64_t end)
{
    for (size_t i = 0; i < r->ndraining; i++)
        if (r->draining[i]->addr < end && addr < r->draining[i]->addr + r->draining[i]->len)
            return true;
    return false;
}

int kvb__region_new(uint64_t addr, uint64_t len, const char *location, unsigned access,
                    kvb_region_t **out)
{
    uint64_t end;
    if (len == 0 || access == 0 || (access & ~(unsigned)KVB_ACCESS_RW))
        return KVB_ERR_INVALID_ARG;
    if (kvb__add_u64(addr, len, &end))
        return KVB_ERR_OVERFLOW;
    if (!location)
        location = "cpu";
    kvb_mem_kind_t kind;
    int device;
    if (strlen(location) > KVB_LOCATION_MAX || kvb__mem_kind_parse(location, &kind, &device))
        return KVB_ERR_INVALID_ARG;
    kvb_region_t *reg = calloc(1, sizeof *reg);
    if (!reg)
        return KVB_ERR_NOMEM;
    reg->addr = addr;
    reg->len = len;
    reg->access = access;
    reg->kind = kind;
    reg->device = device;
    strcpy(reg->location, location);
    atomic_init(&reg->refs, 1);
    atomic_init(&reg->removed, false);
    *out = reg;
    return KVB_OK;
}

int kvb__region_add_key(kvb_region_t *reg, unsigned path, const uint8_t *key, size_t len)
{
    if (path >= KVB_PATHS_MAX || len > KVB_KEY_MAX)
        return KVB_ERR_INVALID_ARG;
    if (len + 2 > sizeof reg->keys - reg->keys_len)
        return KVB_ERR_TOO_LARGE;
    uint8_t *p = reg->keys + reg->keys_len;
    p[0] = (uint8_t)path;
    p[1] = (uint8_t)len;
    memcpy(p + 2, key, len);
    reg->keys_len = (uint16_t)(reg->keys_len + 2 + len);
    return KVB_OK;
}

const uint8_t *kvb__region_key(const kvb_region_desc_t *d, unsigned path, size_t *len)
{
    /* Well formed by construction (local) or by kvb__wire_hello_ack_decode (a peer's). */
    for (size_t off = 0; d && off + 2 <= d->keys_len; off += 2u + d->keys[off + 1])
        if (d->keys[off] == path) {
            *len = d->keys[off + 1];
            return d->keys + off + 2;
        }
    return NULL;
}

const kvb_region_desc_t *kvb__region_find(const kvb_region_desc_t *descs, size_t n, uint64_t addr,
                                          uint64_t len)
{
    size_t lo = 0, hi = n;
    while (lo < hi) { /* first region starting above addr */
        size_t mid = lo + (hi - lo) / 2;
        if (descs[mid].info.addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    const kvb_region_desc_t *d = &descs[lo - 1];
    return kvb__range_within(addr, len, d->info.addr, d->info.len) ? d : NULL;
}

int kvb__registry_insert(kvb_registry_t *r, kvb_region_t *reg)
{
    uint64_t addr = reg->addr, end = reg->addr + reg->len; /* checked by kvb__region_new */
    int rc = KVB_OK;
    pthread_rwlock_wrlock(&r->lock);
    ptrdiff_t i = find_floor(r, addr);
    if ((i >= 0 && r->regions[i]->addr + r->regions[i]->len > addr) ||
        ((size_t)(i + 1) < r->count && r->regions[i + 1]->addr < end) ||
        overlaps_draining(r, addr, end)) {
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
    return rc;
}

int kvb__registry_add(kvb_registry_t *r, uint64_t addr, uint64_t len, const char *location,
                      unsigned access)
{
    kvb_region_t *reg;
    int rc = kvb__region_new(addr, len, location, access, &reg);
    if (rc == KVB_OK && (rc = kvb__registry_insert(r, reg)))
        free(reg);
    return rc;
}

int kvb__registry_remove(kvb_registry_t *r, uint64_t addr, int timeout_ms)
{
    kvb_region_t *reg = NULL;
    int rc = KVB_OK;
    pthread_rwlock_wrlock(&r->lock);
    for (size_t k = 0; k < r->ndraining && !reg; k++)
        if (r->draining[k]->addr == addr)
            reg = r->draining[k]; /* a BUSY unregister before: wait for it again */
    ptrdiff_t i = reg ? -1 : find_floor(r, addr);
    if (i >= 0 && r->regions[i]->addr == addr) {
        if (r->ndraining == r->capdraining) {
            size_t ncap = r->capdraining ? r->capdraining * 2 : 4;
            kvb_region_t **n = realloc(r->draining, ncap * sizeof *n);
            if (n) {
                r->draining = n;
                r->capdraining = ncap;
            } else {
                rc = KVB_ERR_NOMEM;
            }
        }
        if (rc == KVB_OK) {
            reg = r->regions[i];
            memmove(r->regions + i, r->regions + i + 1,
                    (r->count - (size_t)i - 1) * sizeof *r->regions);
            r->count--;
            r->draining[r->ndraining++] = reg;
            atomic_store(&reg->removed, true);
        }
    }
    if (reg) { /* each waiter holds a reference of its own, so the region outlives its wait */
        reg->waiters++;
        atomic_fetch_add(&reg->refs, 1);
    }
    pthread_rwlock_unlock(&r->lock);
    if (rc)
        return rc;
    if (!reg)
        return KVB_ERR_NOT_FOUND;

    /* No new pins can start now. Wait for the ones in flight: until only the registration's
     * reference and the waiters' are left. Sleeps in slices of at most 10 ms: an unpin that read
     * `removed` just before it was set does not signal, and must not cost us the whole timeout. */
    uint64_t deadline = kvb__deadline_ms(timeout_ms);
    pthread_mutex_lock(&r->drain_mu);
    for (;;) {
        pthread_rwlock_rdlock(&r->lock);
        bool drained = atomic_load(&reg->refs) <= 1 + reg->waiters;
        pthread_rwlock_unlock(&r->lock);
        if (drained)
            break;
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
    /* Drained: the first waiter to get here takes it off the draining list and drops the
     * registration's reference. BUSY: it stays draining for a later call. */
    bool mine = false;
    pthread_rwlock_wrlock(&r->lock);
    reg->waiters--;
    for (size_t k = 0; rc == KVB_OK && k < r->ndraining && !mine; k++)
        if (r->draining[k] == reg) {
            r->draining[k] = r->draining[--r->ndraining];
            mine = true;
        }
    pthread_rwlock_unlock(&r->lock);
    if (mine)
        kvb__region_unpin(r, reg);
    kvb__region_unpin(r, reg); /* this waiter's */
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
    kvb__region_unpin_n(r, reg, 1);
}

void kvb__region_unpin_n(kvb_registry_t *r, kvb_region_t *reg, unsigned n)
{
    /* Read before the decrement: once it is done, a remover may free the region. */
    bool removed = atomic_load(&reg->removed);
    unsigned prev = atomic_fetch_sub(&reg->refs, n);
    if (prev == n) {
        if (r->release)
            r->release(r->release_ctx, reg);
        free(reg);
    } else if (removed) {
        /* A pin of a region being unregistered: its removers check whether it was the last. */
        pthread_mutex_lock(&r->drain_mu);
        pthread_cond_broadcast(&r->drain_cv);
        pthread_mutex_unlock(&r->drain_mu);
    }
}

bool kvb__region_covers(kvb_region_t *reg, uint64_t addr, uint64_t len, unsigned access)
{
    return len != 0 && kvb__range_within(addr, len, reg->addr, reg->len) &&
           (reg->access & access) == access && !atomic_load(&reg->removed);
}

void kvb__region_pin_n(kvb_region_t *reg, unsigned n)
{
    if (n)
        atomic_fetch_add(&reg->refs, n);
}

bool kvb__region_repin(kvb_region_t *reg, uint64_t addr, uint64_t len, unsigned access)
{
    if (!kvb__region_covers(reg, addr, len, access))
        return false;
    atomic_fetch_add(&reg->refs, 1);
    return true;
}

bool kvb__registry_overlaps(kvb_registry_t *r, uint64_t addr, uint64_t len)
{
    bool hit = false;
    pthread_rwlock_rdlock(&r->lock);
    for (size_t i = 0; i < r->count && !hit; i++)
        hit = r->regions[i]->addr < addr + len && addr < r->regions[i]->addr + r->regions[i]->len;
    hit = hit || overlaps_draining(r, addr, addr + len);
    pthread_rwlock_unlock(&r->lock);
    return hit;
}

int kvb__registry_list(kvb_registry_t *r, kvb_region_desc_t **out, size_t *n)
{
    pthread_rwlock_rdlock(&r->lock);
    size_t keys = 0;
    for (size_t i = 0; i < r->count; i++)
        keys += r->regions[i]->keys_len;
    /* One block: the descriptors, then their keys. */
    kvb_region_desc_t *v = r->count ? calloc(1, r->count * sizeof *v + keys) : NULL;
    if (r->count && !v) {
        pthread_rwlock_unlock(&r->lock);
        return KVB_ERR_NOMEM;
    }
    uint8_t *kp = (uint8_t *)(v + r->count);
    for (size_t i = 0; i < r->count; i++) {
        const kvb_region_t *g = r->regions[i];
        v[i].info.addr = g->addr;
        v[i].info.len = g->len;
        v[i].info.access = g->access;
        strcpy(v[i].info.location, g->location);
        v[i].kind = g->kind;
        v[i].device = g->device;
        v[i].keys_len = g->keys_len;
        v[i].keys = kp;
        memcpy(kp, g->keys, g->keys_len);
        kp += g->keys_len;
    }
    *n = r->count;
    pthread_rwlock_unlock(&r->lock);
    *out = v;
    return KVB_OK;
}
