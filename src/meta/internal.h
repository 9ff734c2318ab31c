/* SPDX-License-Identifier: Apache-2.0 */
/* What the metadata client core (meta.c) shares with its backends (etcd.c, redis.c, http.c): the
 * client, the backend ops table, and the libcurl call that the two HTTP-speaking backends use. */
#ifndef KVB_META_INTERNAL_H
#define KVB_META_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "meta/meta.h"

/* A backend. Every op runs with m->io_mu held, so a backend needs no locking of its own. */
typedef struct {
    const char *kind;
    int (*put)(kvb_meta_t *m, const char *key, const char *val, size_t len, uint32_t ttl_ms);
    int (*get)(kvb_meta_t *m, const char *key, char **val, size_t *len);
    int (*del)(kvb_meta_t *m, const char *key);
    /* Unsorted is fine: the core sorts. */
    int (*list)(kvb_meta_t *m, const char *prefix, kvb_meta_kv_t **out, size_t *n);
    /* Publishes an owned key so that it lives as long as refresh keeps it alive. */
    int (*put_owned)(kvb_meta_t *m, const char *key, const char *val, size_t len);
    /* put_owned only if the store holds nothing or this same value under the key, decided by the
     * store in one step; KVB_ERR_BUSY (nothing written) when it holds another value: another
     * process took the key over, and the keeper must not write it back. */
    int (*renew)(kvb_meta_t *m, const char *key, const char *val, size_t len);
    /* Keeps owned keys alive without re-sending them (etcd: the lease keepalive). NULL: the core
     * re-puts every owned key each round. KVB_ERR_NOT_FOUND: they are gone, re-put them all. */
    int (*refresh)(kvb_meta_t *m);
    /* Releases what put_owned holds at close (etcd: revokes the lease, which deletes the owned
     * keys still on it); NULL: close deletes the owned keys one by one. */
    void (*release)(kvb_meta_t *m);
    void (*free)(kvb_meta_t *m);
} kvb_meta_ops_t;

typedef struct {
    char *key;
    char *val;
    size_t len;
    uint64_t version, published; /* published == version: nothing to send until the next round */
    bool renewal; /* the pending send is a keeper round's renewal (ops->renew), not a new value */
    bool yielded; /* the store held another writer's value at the last renewal: left to it */
} kvb_meta_owned_t;

struct kvb_meta {
    const kvb_meta_ops_t *ops;
    void *be;                       /* the backend's state */
    char uri[KVB_META_URI_MAX + 1]; /* password masked */
    uint32_t timeout_ms, ttl_ms;
    pthread_mutex_t io_mu; /* one store call at a time, and whole keeper rounds */
    /* When the call that holds io_mu must end (monotonic ns): every request the backend sends
     * for it - to each etcd endpoint in turn, a reconnect, a renewal's several steps - shares
     * the client's timeout (kvb__meta_left_ms). */
    uint64_t call_deadline;
    pthread_mutex_t mu; /* the owned table and the keeper's state */
    pthread_cond_t cv;
    kvb_meta_owned_t *owned;
    size_t nowned;
    bool keeper_started, stopping, dirty, in_tick;
    pthread_t keeper;
    kvb_meta_tick_cb tick;
    void *tick_user;
    atomic_bool reachable;
    atomic_int outage_logged; /* 1 after an unreachable store was reported, until it answers */
};

/* Milliseconds left to the call in progress (caller holds io_mu), at least 1 while any is left;
 * 0 once its deadline passed (the backend then gives KVB_ERR_META_UNREACHABLE without sending).
 * Running out of time is reported by the caller's kvb__meta_note, as any unanswered request. */
uint32_t kvb__meta_left_ms(kvb_meta_t *m);

/* Splits "host:port" (host may be "[v6]") into host (no brackets) and port. 0 or -1. */
int kvb__meta_hostport(const char *s, size_t n, char *host, size_t cap, uint16_t *port);

/* One HTTP call with libcurl on the backend's reusable handle `*curl` (created on first use),
 * allowed `ms` milliseconds (0: what is left of the client's call; with none left nothing is
 * sent). method "GET", "PUT", "POST" or "DELETE"; body may be NULL. Returns KVB_OK with the status
 * in *status and the body in *resp (malloc'd, NUL-terminated, up to `resp_max` bytes), or
 * KVB_ERR_META_UNREACHABLE when no answer came (connection refused, timeout) - with curl's
 * reason logged at most once per outage. */
int kvb__meta_http(kvb_meta_t *m, void **curl, uint32_t ms, const char *method, const char *url,
                   const char *body, size_t len, long *status, char **resp, size_t *resp_len,
                   size_t resp_max);
void kvb__meta_http_free(void *curl);

extern const kvb_meta_ops_t kvb__meta_etcd_ops, kvb__meta_redis_ops, kvb__meta_http_ops;

/* Backend constructors: parse what follows "scheme://" and fill m->be. */
int kvb__meta_etcd_init(kvb_meta_t *m, const char *rest);
int kvb__meta_redis_init(kvb_meta_t *m, const char *rest);
int kvb__meta_http_init(kvb_meta_t *m, const char *uri);

/* Records a store call's outcome for kvb__meta_reachable and outage logging. */
void kvb__meta_note(kvb_meta_t *m, int rc, const char *what);

#endif
