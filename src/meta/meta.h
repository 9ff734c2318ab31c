/* SPDX-License-Identifier: Apache-2.0 */
/* Metadata backends behind one small interface (DESIGN layer 4): a key-value store client chosen
 * by URI - "etcd://h:p[,h:p...]" (v3 JSON API over libcurl), "redis://[:pw@]h:p[/db]" (hiredis),
 * "http://h:p[/prefix]" (`kvbridge metadata-server`) - with keys this process owns kept alive by
 * a keeper thread (etcd: a lease; Redis and HTTP: a TTL refreshed by re-putting). "p2p" needs no
 * store: kvb__meta_open returns KVB_OK with *out NULL.
 *
 * Every call is bounded by the client's timeout, counted once it has the client (calls are
 * serialised): what it sends - to each etcd endpoint in turn, a reconnect and its AUTH, a
 * renewal's several requests - shares that timeout (a keeper round counts as one call). A store
 * that cannot be reached gives KVB_ERR_META_UNREACHABLE, a key that is not there
 * KVB_ERR_NOT_FOUND, an answer that makes no sense KVB_ERR_PROTOCOL. A client is thread-safe (calls
 * are serialised on one connection). */
#ifndef KVB_META_H
#define KVB_META_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvbridge/status.h"

#define KVB_META_KEY_MAX   1024u       /* longest key, bytes */
#define KVB_META_VALUE_MAX (16u << 20) /* largest value, bytes */
#define KVB_META_URI_MAX   1024u       /* longest URI */
#define KVB_META_TTL_MS    10000u      /* default TTL of owned keys */
#define KVB_META_CLUSTER   "default"   /* default cluster name in keys */

typedef struct kvb_meta kvb_meta_t;

/* One key and its value (NUL-terminated; len excludes the NUL). */
typedef struct {
    char *key;
    char *value;
    size_t len;
} kvb_meta_kv_t;

/* Called by the keeper thread after each round of refreshing owned keys (every ttl/3). */
typedef void (*kvb_meta_tick_cb)(void *user);

/* Parses `uri` and creates a client whose calls each end within `timeout_ms`, and whose owned
 * keys expire `ttl_ms` after the last refresh (0: KVB_META_TTL_MS). Does not contact the store.
 * KVB_ERR_INVALID_ARG (with a log line saying why) for a malformed URI; KVB_ERR_UNSUPPORTED for
 * an unknown scheme. "p2p" (or NULL, or "") gives KVB_OK and *out = NULL. */
int kvb__meta_open(const char *uri, uint32_t timeout_ms, uint32_t ttl_ms, kvb_meta_t **out);

/* Stops the keeper, deletes the owned keys (best effort, one short attempt) and frees the
 * client. NULL is ignored. */
void kvb__meta_close(kvb_meta_t *m);

/* "etcd", "redis" or "http" (static). */
const char *kvb__meta_kind(const kvb_meta_t *m);

/* The URI with any password masked, for messages. Valid while the client is. */
const char *kvb__meta_uri(const kvb_meta_t *m);

uint32_t kvb__meta_ttl_ms(const kvb_meta_t *m);

/* Plain store access. put: ttl_ms 0 never expires. get: *val malloc'd, NUL-terminated. list:
 * every key that starts with `prefix`, once each, sorted by key; free with kvb__meta_kvs_free. */
int kvb__meta_put(kvb_meta_t *m, const char *key, const char *val, size_t len, uint32_t ttl_ms);
int kvb__meta_get(kvb_meta_t *m, const char *key, char **val, size_t *len);
int kvb__meta_del(kvb_meta_t *m, const char *key);
int kvb__meta_list(kvb_meta_t *m, const char *prefix, kvb_meta_kv_t **out, size_t *n);
void kvb__meta_kvs_free(kvb_meta_kv_t *kvs, size_t n);

/* Owned keys: stored with the client's TTL and kept alive by its keeper thread until disowned or
 * the client closes; re-created if the store lost them (restart, expiry during an outage).
 * kvb__meta_own sets or replaces the value and publishes it now (blocking, bounded by the
 * timeout); if that fails the key is still owned, the keeper retries, and the error is returned.
 * kvb__meta_own_async only records it and wakes the keeper. kvb__meta_disown deletes it.
 * The keeper only renews: a key that another process has set to another value (a restarted
 * owner under the same name while the old one still runs) is left to it - never written back,
 * nor deleted by disown or close - and published again only once it is gone (Redis and HTTP:
 * checked every round; etcd: when our lease has to be renewed). kvb__meta_own then returns
 * KVB_ERR_BUSY. */
int kvb__meta_own(kvb_meta_t *m, const char *key, const char *val, size_t len);
int kvb__meta_own_async(kvb_meta_t *m, const char *key, const char *val, size_t len);
int kvb__meta_disown(kvb_meta_t *m, const char *key);

/* Runs `cb` on the keeper thread after each refresh round (at most one callback; NULL clears).
 * Returns after any callback in progress has finished. */
void kvb__meta_set_tick(kvb_meta_t *m, kvb_meta_tick_cb cb, void *user);

/* True while the last store call succeeded (for health reports). */
bool kvb__meta_reachable(const kvb_meta_t *m);

/* A cluster name is one path element of a key: 1..63 characters of [A-Za-z0-9._-], not "." or
 * "..". */
bool kvb__meta_cluster_valid(const char *cluster);

/* Builds "kvbridge/<cluster>/<kind>/<name>" into buf; KVB_ERR_INVALID_ARG if it does not fit
 * or cluster is empty or holds '/'. */
int kvb__meta_key(char *buf, size_t cap, const char *cluster, const char *kind, const char *name);

#endif
