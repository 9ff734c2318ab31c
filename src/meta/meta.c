/* SPDX-License-Identifier: Apache-2.0 */
/* The metadata client core: URI dispatch, serialised store calls, owned keys and the keeper
 * thread that keeps them alive (and re-creates them after the store lost them). */
#include "meta/internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/cpus.h"
#include "common/log.h"

int kvb__meta_hostport(const char *s, size_t n, char *host, size_t cap, uint16_t *port)
{
    const char *colon = NULL;
    for (size_t i = n; i > 0; i--)
        if (s[i - 1] == ':') {
            colon = s + i - 1;
            break;
        }
    if (!colon || colon == s || (size_t)(colon - s) + 1 >= n)
        return -1;
    unsigned long v = 0;
    for (const char *p = colon + 1; p < s + n; p++) {
        if (*p < '0' || *p > '9' || (v = v * 10 + (unsigned long)(*p - '0')) > 65535)
            return -1;
    }
    const char *h = s;
    size_t hl = (size_t)(colon - s);
    if (h[0] == '[') {
        if (hl < 3 || h[hl - 1] != ']')
            return -1;
        h++;
        hl -= 2;
    }
    if (v == 0 || hl == 0 || hl >= cap)
        return -1;
    for (size_t i = 0; i < hl; i++)
        if ((unsigned char)h[i] <= 0x20 || h[i] == '/' || h[i] == '@' || h[i] == 0x7f)
            return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (uint16_t)v;
    return 0;
}

bool kvb__meta_cluster_valid(const char *c)
{
    size_t n = c ? strlen(c) : 0;
    if (n == 0 || n > 63 || !strcmp(c, ".") || !strcmp(c, ".."))
        return false;
    for (const char *p = c; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '.' || *p == '_' || *p == '-'))
            return false;
    return true;
}

int kvb__meta_key(char *buf, size_t cap, const char *cluster, const char *kind, const char *name)
{
    if (!cluster || !*cluster || strchr(cluster, '/'))
        return KVB_ERR_INVALID_ARG;
    int n = snprintf(buf, cap, "kvbridge/%s/%s/%s", cluster, kind, name);
    return n > 0 && (size_t)n < cap && (size_t)n <= KVB_META_KEY_MAX ? KVB_OK : KVB_ERR_INVALID_ARG;
}

void kvb__meta_note(kvb_meta_t *m, int rc, const char *what)
{
    if (rc == KVB_ERR_META_UNREACHABLE) {
        atomic_store(&m->reachable, false);
        if (atomic_exchange(&m->outage_logged, 1) == 0)
            KVB_WARN("metadata store %s unreachable (%s); retrying", m->uri, what);
    } else {
        atomic_store(&m->reachable, true);
        if (atomic_exchange(&m->outage_logged, 0) == 1)
            KVB_INFO("metadata store %s reachable again", m->uri);
    }
}

int kvb__meta_open(const char *uri, uint32_t timeout_ms, uint32_t ttl_ms, kvb_meta_t **out)
{
    if (!out)
        return KVB_ERR_INVALID_ARG;
    *out = NULL;
    if (!uri || !*uri || !strcmp(uri, "p2p"))
        return KVB_OK;
    if (strlen(uri) > KVB_META_URI_MAX) {
        KVB_ERROR("metadata URI longer than %u bytes", KVB_META_URI_MAX);
        return KVB_ERR_INVALID_ARG;
    }
    kvb_meta_t *m = calloc(1, sizeof *m);
    if (!m)
        return KVB_ERR_NOMEM;
    m->timeout_ms = timeout_ms ? timeout_ms : 5000;
    m->ttl_ms = ttl_ms ? ttl_ms : KVB_META_TTL_MS;
    snprintf(m->uri, sizeof m->uri, "%s", uri);
    atomic_init(&m->reachable, true);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&m->io_mu, NULL);
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc;
    if (!strncmp(uri, "etcd://", 7)) {
        rc = kvb__meta_etcd_init(m, uri + 7);
    } else if (!strncmp(uri, "redis://", 8)) {
        rc = kvb__meta_redis_init(m, uri + 8);
    } else if (!strncmp(uri, "http://", 7)) {
        rc = kvb__meta_http_init(m, uri);
    } else {
        KVB_ERROR("metadata '%s': not p2p, etcd://, redis:// or http://", uri);
        rc = KVB_ERR_UNSUPPORTED;
    }
    if (rc) {
        pthread_mutex_destroy(&m->io_mu);
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->cv);
        free(m);
        return rc;
    }
    *out = m;
    return KVB_OK;
}

const char *kvb__meta_kind(const kvb_meta_t *m)
{
    return m ? m->ops->kind : "p2p";
}

const char *kvb__meta_uri(const kvb_meta_t *m)
{
    return m ? m->uri : "p2p";
}

uint32_t kvb__meta_ttl_ms(const kvb_meta_t *m)
{
    return m ? m->ttl_ms : 0;
}

bool kvb__meta_reachable(const kvb_meta_t *m)
{
    return m && atomic_load(&m->reachable);
}

static int check_key(const char *key)
{
    size_t n = key ? strlen(key) : 0;
    if (n == 0 || n > KVB_META_KEY_MAX)
        return KVB_ERR_INVALID_ARG;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)key[i] < 0x20 || key[i] == 0x7f)
            return KVB_ERR_INVALID_ARG;
    return KVB_OK;
}

/* Takes io_mu for one call: whatever the backend sends for it shares the client's timeout, counted
 * from here (a call queued behind another's has its own). */
static void io_begin(kvb_meta_t *m)
{
    pthread_mutex_lock(&m->io_mu);
    m->call_deadline = kvb__deadline_ms(m->timeout_ms);
}

uint32_t kvb__meta_left_ms(kvb_meta_t *m)
{
    int left = kvb__ms_left(m->call_deadline);
    return left < 0 || (uint32_t)left > m->timeout_ms ? m->timeout_ms : (uint32_t)left;
}

int kvb__meta_put(kvb_meta_t *m, const char *key, const char *val, size_t len, uint32_t ttl_ms)
{
    if (!m || check_key(key) || (len && !val))
        return KVB_ERR_INVALID_ARG;
    if (len > KVB_META_VALUE_MAX)
        return KVB_ERR_TOO_LARGE;
    io_begin(m);
    int rc = m->ops->put(m, key, val ? val : "", len, ttl_ms);
    pthread_mutex_unlock(&m->io_mu);
    kvb__meta_note(m, rc, "put");
    return rc;
}

int kvb__meta_get(kvb_meta_t *m, const char *key, char **val, size_t *len)
{
    if (!m || check_key(key) || !val || !len)
        return KVB_ERR_INVALID_ARG;
    io_begin(m);
    int rc = m->ops->get(m, key, val, len);
    pthread_mutex_unlock(&m->io_mu);
    kvb__meta_note(m, rc, "get");
    return rc;
}

int kvb__meta_del(kvb_meta_t *m, const char *key)
{
    if (!m || check_key(key))
        return KVB_ERR_INVALID_ARG;
    io_begin(m);
    int rc = m->ops->del(m, key);
    pthread_mutex_unlock(&m->io_mu);
    kvb__meta_note(m, rc, "delete");
    return rc;
}

void kvb__meta_kvs_free(kvb_meta_kv_t *kvs, size_t n)
{
    for (size_t i = 0; kvs && i < n; i++) {
        free(kvs[i].key);
        free(kvs[i].value);
    }
    free(kvs);
}

static int kv_cmp(const void *a, const void *b)
{
    return strcmp(((const kvb_meta_kv_t *)a)->key, ((const kvb_meta_kv_t *)b)->key);
}

int kvb__meta_list(kvb_meta_t *m, const char *prefix, kvb_meta_kv_t **out, size_t *n)
{
    if (!m || !prefix || !out || !n || strlen(prefix) > KVB_META_KEY_MAX)
        return KVB_ERR_INVALID_ARG;
    *out = NULL;
    *n = 0;
    io_begin(m);
    int rc = m->ops->list(m, prefix, out, n);
    pthread_mutex_unlock(&m->io_mu);
    kvb__meta_note(m, rc, "list");
    if (rc != KVB_OK || *n < 2)
        return rc;
    /* Sorted, each key once: a store may list a key twice (Redis's SCAN does, across pages). */
    qsort(*out, *n, sizeof **out, kv_cmp);
    size_t k = 1;
    for (size_t i = 1; i < *n; i++) {
        if (strcmp((*out)[i].key, (*out)[k - 1].key) != 0) {
            (*out)[k++] = (*out)[i];
        } else {
            free((*out)[i].key);
            free((*out)[i].value);
        }
    }
    *n = k;
    return rc;
}

/* ---- owned keys and the keeper ------------------------------------------------------------ */

static kvb_meta_owned_t *find_owned(kvb_meta_t *m, const char *key)
{
    for (size_t i = 0; i < m->nowned; i++)
        if (!strcmp(m->owned[i].key, key))
            return &m->owned[i];
    return NULL;
}

/* Records the outcome of sending owned key `key` at `version`: sent (KVB_OK), or left to another
 * writer (KVB_ERR_BUSY). Called with mu held. */
static void mark_sent(kvb_meta_t *m, const char *key, uint64_t version, int rc)
{
    kvb_meta_owned_t *o = find_owned(m, key);
    if (!o || o->version != version)
        return; /* replaced meanwhile: the new value is still due */
    bool taken = rc == KVB_ERR_BUSY;
    if (taken && !o->yielded)
        KVB_WARN("metadata store %s: key %s now holds another writer's value (taken over); "
                 "leaving it to them, and publishing ours again only if it disappears",
                 m->uri, key);
    else if (!taken && o->yielded)
        KVB_INFO("metadata store %s: key %s was free again; published ours", m->uri, key);
    o->published = version;
    o->renewal = false;
    o->yielded = taken;
}

/* Sends every owned key that is due. A new value replaces whatever the store holds (put_owned);
 * a keeper round's renewal, and anything for a key another writer holds, only renews (renew), so
 * that a process whose key was taken over never writes it back. Returns the first failure,
 * KVB_ERR_BUSY if a key was left to another writer, else KVB_OK. Called with io_mu held. */
static int publish_pending(kvb_meta_t *m)
{
    int first_err = KVB_OK;
    for (;;) {
        pthread_mutex_lock(&m->mu);
        kvb_meta_owned_t *o = NULL;
        for (size_t i = 0; i < m->nowned && !o; i++)
            if (m->owned[i].published != m->owned[i].version)
                o = &m->owned[i];
        if (!o) {
            pthread_mutex_unlock(&m->mu);
            return first_err;
        }
        /* Copy out, so that own_async may replace the value while the call runs. */
        uint64_t version = o->version;
        bool renew = o->renewal || o->yielded;
        char *key = strdup(o->key), *val = malloc(o->len + 1);
        size_t len = o->len;
        if (val)
            memcpy(val, o->val, len + 1);
        pthread_mutex_unlock(&m->mu);
        int rc = !key || !val ? KVB_ERR_NOMEM
                 : renew      ? m->ops->renew(m, key, val, len)
                              : m->ops->put_owned(m, key, val, len);
        kvb__meta_note(m, rc, "publish");
        if (rc == KVB_OK || rc == KVB_ERR_BUSY) {
            pthread_mutex_lock(&m->mu);
            mark_sent(m, key, version, rc);
            pthread_mutex_unlock(&m->mu);
        } else if (rc != KVB_ERR_META_UNREACHABLE) {
            KVB_WARN("metadata store %s refused key %s: %s", m->uri, key, kvb_strerror(rc));
        }
        free(key);
        free(val);
        if (rc != KVB_OK && first_err == KVB_OK)
            first_err = rc;
        if (rc != KVB_OK && rc != KVB_ERR_BUSY)
            return rc; /* the next round retries */
    }
}

/* One keeper round: keep owned keys alive, re-create lost ones. Called with io_mu held. */
static void keep_round(kvb_meta_t *m)
{
    pthread_mutex_lock(&m->mu);
    size_t n = m->nowned;
    pthread_mutex_unlock(&m->mu);
    if (n == 0)
        return;
    int rc = m->ops->refresh ? m->ops->refresh(m) : KVB_ERR_NOT_FOUND;
    if (m->ops->refresh)
        kvb__meta_note(m, rc, "keepalive");
    if (m->ops->refresh && rc == KVB_ERR_NOT_FOUND)
        KVB_INFO("metadata store %s lost our keys (lease expired); publishing them again", m->uri);
    /* Lost (or, without a lease, due for its TTL refresh): renew every key. Only renew: another
     * process that took a key over (a restart of ours whose old self still runs) now owns it, and
     * a blind re-put every TTL/3 would flip the key between the two of us - readers would see
     * either at random. Keys left to another writer are tried every round, so that ours comes
     * back if theirs disappears. A key with a new value still unsent stays a new value. */
    bool lost = rc == KVB_ERR_NOT_FOUND || rc == KVB_ERR_META_UNREACHABLE;
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < m->nowned; i++) {
        kvb_meta_owned_t *o = &m->owned[i];
        if ((lost || o->yielded) && o->published == o->version) {
            o->published = o->version - 1;
            o->renewal = true;
        }
    }
    pthread_mutex_unlock(&m->mu);
    publish_pending(m);
}

static void *keeper_main(void *arg)
{
    kvb_meta_t *m = arg;
    uint64_t period = (uint64_t)m->ttl_ms * 1000000ull / 3;
    if (period < 50000000ull)
        period = 50000000ull;
    uint64_t next = kvb__now_ns() + period;
    pthread_mutex_lock(&m->mu);
    while (!m->stopping) {
        if (!m->dirty && kvb__now_ns() < next) {
            struct timespec ts = kvb__timespec_of(next);
            pthread_cond_timedwait(&m->cv, &m->mu, &ts);
            continue;
        }
        bool full = kvb__now_ns() >= next;
        m->dirty = false;
        pthread_mutex_unlock(&m->mu);
        io_begin(m);
        if (full)
            keep_round(m);
        else
            publish_pending(m);
        pthread_mutex_unlock(&m->io_mu);
        pthread_mutex_lock(&m->mu);
        if (full) {
            next = kvb__now_ns() + period;
            kvb_meta_tick_cb cb = m->tick;
            void *user = m->tick_user;
            if (cb && !m->stopping) {
                /* The callback runs without mu; set_tick waits on io_mu-free ground: it takes mu
                 * and checks in_tick (below) through the cv. */
                m->in_tick = true;
                pthread_mutex_unlock(&m->mu);
                cb(user);
                pthread_mutex_lock(&m->mu);
                m->in_tick = false;
                pthread_cond_broadcast(&m->cv);
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* Starts the keeper on first need. Called with mu held. */
static int ensure_keeper(kvb_meta_t *m)
{
    if (m->keeper_started)
        return KVB_OK;
    if (kvb__thread_create(&m->keeper, NULL, -1, "kvb-meta", -1, keeper_main, m) != 0)
        return KVB_ERR_SYSTEM;
    m->keeper_started = true;
    return KVB_OK;
}

/* Records key = val in the owned table (a new version). Called with mu held. */
static int set_owned(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    char *copy = malloc(len + 1);
    if (!copy)
        return KVB_ERR_NOMEM;
    memcpy(copy, val, len);
    copy[len] = '\0';
    kvb_meta_owned_t *o = find_owned(m, key);
    if (!o) {
        kvb_meta_owned_t *n = realloc(m->owned, (m->nowned + 1) * sizeof *n);
        char *k = strdup(key);
        if (!n || !k) {
            if (n)
                m->owned = n;
            free(k);
            free(copy);
            return KVB_ERR_NOMEM;
        }
        m->owned = n;
        o = &n[m->nowned++];
        *o = (kvb_meta_owned_t){.key = k};
    }
    free(o->val);
    o->val = copy;
    o->len = len;
    o->version++;
    o->renewal = false;
    return ensure_keeper(m);
}

static int own(kvb_meta_t *m, const char *key, const char *val, size_t len, bool now)
{
    if (!m || check_key(key) || (len && !val))
        return KVB_ERR_INVALID_ARG;
    if (len > KVB_META_VALUE_MAX)
        return KVB_ERR_TOO_LARGE;
    if (now)
        io_begin(m);
    pthread_mutex_lock(&m->mu);
    int rc = set_owned(m, key, val ? val : "", len);
    if (!now) {
        m->dirty = true;
        pthread_cond_broadcast(&m->cv);
    }
    pthread_mutex_unlock(&m->mu);
    if (now) {
        if (rc == KVB_OK)
            rc = publish_pending(m);
        pthread_mutex_unlock(&m->io_mu);
    }
    return rc;
}

int kvb__meta_own(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    return own(m, key, val, len, true);
}

int kvb__meta_own_async(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    return own(m, key, val, len, false);
}

int kvb__meta_disown(kvb_meta_t *m, const char *key)
{
    if (!m || check_key(key))
        return KVB_ERR_INVALID_ARG;
    io_begin(m);
    pthread_mutex_lock(&m->mu);
    kvb_meta_owned_t *o = find_owned(m, key);
    int rc = o ? KVB_OK : KVB_ERR_NOT_FOUND;
    bool theirs = o && o->yielded; /* another writer's key: not ours to delete */
    if (o) {
        free(o->key);
        free(o->val);
        *o = m->owned[--m->nowned];
    }
    pthread_mutex_unlock(&m->mu);
    if (rc == KVB_OK && !theirs) {
        rc = m->ops->del(m, key);
        kvb__meta_note(m, rc, "delete");
        if (rc == KVB_ERR_NOT_FOUND)
            rc = KVB_OK;
    }
    pthread_mutex_unlock(&m->io_mu);
    return rc;
}

void kvb__meta_set_tick(kvb_meta_t *m, kvb_meta_tick_cb cb, void *user)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    while (m->in_tick && !pthread_equal(pthread_self(), m->keeper))
        pthread_cond_wait(&m->cv, &m->mu);
    m->tick = cb;
    m->tick_user = user;
    if (cb)
        ensure_keeper(m);
    pthread_mutex_unlock(&m->mu);
}

void kvb__meta_close(kvb_meta_t *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->stopping = true;
    pthread_cond_broadcast(&m->cv);
    bool started = m->keeper_started;
    pthread_mutex_unlock(&m->mu);
    if (started)
        pthread_join(m->keeper, NULL);
    /* Withdraw what we published, so that peers see us gone now rather than after the TTL - but
     * not a key another writer took over: that one is theirs. A backend with a lease withdraws by
     * releasing it, which deletes exactly the keys still on it (a key taken over hangs off the
     * new owner's lease, even if we never noticed the takeover). */
    io_begin(m);
    for (size_t i = 0; i < m->nowned; i++) {
        if (atomic_load(&m->reachable) && m->owned[i].published && !m->owned[i].yielded &&
            !m->ops->release)
            kvb__meta_note(m, m->ops->del(m, m->owned[i].key), "delete");
        free(m->owned[i].key);
        free(m->owned[i].val);
    }
    if (m->ops->release && atomic_load(&m->reachable))
        m->ops->release(m);
    pthread_mutex_unlock(&m->io_mu);
    m->ops->free(m);
    free(m->owned);
    pthread_mutex_destroy(&m->io_mu);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m);
}
