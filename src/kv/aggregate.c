/* SPDX-License-Identifier: Apache-2.0 */
/* Completion aggregation over TP fan-in: a chained hash table of requests keyed by id. Released
 * requests stay behind as id-only tombstones in a fixed-size ring, oldest evicted first, so that a
 * notice arriving after completion is told apart from one for a request never seen while memory
 * stays bounded by max_active + max_finished entries. */
#include "kv/aggregate.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvbridge/status.h"

#define RELEASED (-1) /* entry state of a tombstone */

typedef struct entry {
    struct entry *next; /* hash chain */
    int state;          /* kvb_agg_state_t, or RELEASED */
    int error;
    uint64_t deadline;
    uint32_t num_senders, num_seen;
    uint32_t *senders; /* sorted; NULL once released */
    uint8_t *seen;     /* seen[i]: senders[i] reported; shares the senders allocation */
    char id[];
} entry_t;

struct kvb_agg {
    entry_t **buckets;
    size_t mask; /* bucket count - 1, a power of two minus one */
    size_t max_active, active;
    entry_t **ring; /* tombstones, oldest at ring[head] */
    size_t max_finished, num_finished, head;
};

static uint64_t hash_id(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

static entry_t **slot_of(kvb_agg_t *a, const char *id)
{
    entry_t **pp = &a->buckets[hash_id(id) & a->mask];
    while (*pp && strcmp((*pp)->id, id))
        pp = &(*pp)->next;
    return pp;
}

static entry_t *find(kvb_agg_t *a, const char *id)
{
    return *slot_of(a, id);
}

static void drop(kvb_agg_t *a, entry_t *e)
{
    entry_t **pp = slot_of(a, e->id);
    *pp = e->next;
    free(e->senders);
    free(e);
}

int kvb__agg_create(size_t max_active, size_t max_finished, kvb_agg_t **out)
{
    const size_t limit = (size_t)1 << 24;
    if (!out || max_active == 0 || max_active > limit || max_finished > limit)
        return KVB_ERR_INVALID_ARG;
    size_t nb = 16;
    while (nb < max_active + max_finished)
        nb <<= 1;
    kvb_agg_t *a = calloc(1, sizeof *a);
    if (!a)
        return KVB_ERR_NOMEM;
    a->buckets = calloc(nb, sizeof *a->buckets);
    a->ring = calloc(max_finished ? max_finished : 1, sizeof *a->ring);
    if (!a->buckets || !a->ring) {
        kvb__agg_destroy(a);
        return KVB_ERR_NOMEM;
    }
    a->mask = nb - 1;
    a->max_active = max_active;
    a->max_finished = max_finished;
    *out = a;
    return KVB_OK;
}

void kvb__agg_destroy(kvb_agg_t *agg)
{
    if (!agg)
        return;
    for (size_t b = 0; agg->buckets && b <= agg->mask; b++) {
        while (agg->buckets[b])
            drop(agg, agg->buckets[b]);
    }
    free(agg->buckets);
    free(agg->ring);
    free(agg);
}

static int cmp_u32(const void *x, const void *y)
{
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return a < b ? -1 : a > b;
}

/* A new pending entry with a sorted copy of the senders; NULL with *rc set on error. */
static entry_t *entry_new(const char *id, size_t idlen, const uint32_t *senders, size_t n, int *rc)
{
    entry_t *e = calloc(1, sizeof *e + idlen + 1);
    uint32_t *s = malloc(n * (sizeof *s + 1));
    *rc = KVB_ERR_NOMEM;
    if (!e || !s)
        goto undo_alloc;
    memcpy(s, senders, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_u32);
    *rc = KVB_ERR_INVALID_ARG;
    for (size_t i = 1; i < n; i++) {
        if (s[i] == s[i - 1])
            goto undo_alloc;
    }
    memcpy(e->id, id, idlen + 1);
    e->senders = s;
    e->seen = (uint8_t *)(s + n);
    memset(e->seen, 0, n);
    e->num_senders = (uint32_t)n;
    e->state = KVB_AGG_PENDING;
    *rc = KVB_OK;
    return e;
undo_alloc:
    free(s);
    free(e);
    return NULL;
}

int kvb__agg_expect(kvb_agg_t *agg, const char *id, const uint32_t *senders, size_t n,
                    uint64_t deadline_ns)
{
    size_t idlen = id ? strnlen(id, KVB_AGG_ID_MAX + 1) : 0;
    if (!agg || idlen == 0 || idlen > KVB_AGG_ID_MAX || !senders || n == 0 ||
        n > KVB_AGG_SENDERS_MAX)
        return KVB_ERR_INVALID_ARG;
    if (find(agg, id) || agg->active == agg->max_active)
        return KVB_ERR_BUSY;
    int rc;
    entry_t *e = entry_new(id, idlen, senders, n, &rc);
    if (!e)
        return rc;
    e->deadline = deadline_ns;
    entry_t **pp = slot_of(agg, id);
    *pp = e;
    agg->active++;
    return KVB_OK;
}

/* A pending request whose deadline has come times out; checked on every look, so the outcome
 * depends only on the times callers pass, not on when they happen to poll. */
static void check_deadline(entry_t *e, uint64_t now_ns)
{
    if (e->state == KVB_AGG_PENDING && now_ns >= e->deadline) {
        e->state = KVB_AGG_TIMEOUT;
        e->error = KVB_ERR_TIMEOUT;
    }
}

int kvb__agg_add(kvb_agg_t *agg, const char *id, uint32_t sender, int status, uint64_t now_ns)
{
    entry_t *e = agg && id ? find(agg, id) : NULL;
    if (!e)
        return KVB_ERR_NOT_FOUND;
    check_deadline(e, now_ns);
    if (e->state != KVB_AGG_PENDING)
        return KVB_AGG_LATE;
    uint32_t *hit = bsearch(&sender, e->senders, e->num_senders, sizeof sender, cmp_u32);
    if (!hit)
        return KVB_ERR_INVALID_ARG;
    size_t i = (size_t)(hit - e->senders);
    if (e->seen[i])
        return KVB_AGG_DUPLICATE;
    e->seen[i] = 1;
    if (status != KVB_OK) {
        e->state = KVB_AGG_FAILED;
        e->error = status;
    } else if (++e->num_seen == e->num_senders) {
        e->state = KVB_AGG_DONE;
    }
    return KVB_AGG_COUNTED;
}

int kvb__agg_poll(kvb_agg_t *agg, const char *id, uint64_t now_ns, int *error)
{
    entry_t *e = agg && id ? find(agg, id) : NULL;
    if (!e || e->state == RELEASED)
        return KVB_ERR_NOT_FOUND;
    check_deadline(e, now_ns);
    if (error)
        *error = e->error;
    return e->state;
}

/* Keeps a released entry's id in the ring, evicting the oldest tombstone when full. */
static void remember(kvb_agg_t *a, entry_t *e)
{
    if (a->max_finished == 0) {
        drop(a, e);
        return;
    }
    if (a->num_finished == a->max_finished) {
        drop(a, a->ring[a->head]);
        a->ring[a->head] = e;
        a->head = (a->head + 1) % a->max_finished;
        return;
    }
    a->ring[(a->head + a->num_finished) % a->max_finished] = e;
    a->num_finished++;
}

int kvb__agg_release(kvb_agg_t *agg, const char *id)
{
    entry_t *e = agg && id ? find(agg, id) : NULL;
    if (!e || e->state == RELEASED)
        return KVB_ERR_NOT_FOUND;
    free(e->senders);
    e->senders = NULL;
    e->seen = NULL;
    e->state = RELEASED;
    agg->active--;
    remember(agg, e);
    return KVB_OK;
}

size_t kvb__agg_active(const kvb_agg_t *agg)
{
    return agg ? agg->active : 0;
}
