/* SPDX-License-Identifier: Apache-2.0 */
/* The in-memory key/value store with TTLs behind `kvbridge metadata-server`, and the checks its
 * HTTP input passes before reaching it: apart from the server so that a fuzzer can drive them. */
#ifndef KVB_TOOLS_METASTORE_H
#define KVB_TOOLS_METASTORE_H

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVB__MS_KEY_MAX  1024u         /* longest key, bytes (the client's KVB_META_KEY_MAX) */
#define KVB__MS_SWEEP_NS 1000000000ull /* expired keys are purged at least this often (if busy) */

/* One key. Key and value are jansson strings: immutable and atomically reference-counted, so an
 * answer can hold on to a value after the lock is released, even while a PUT replaces it. */
typedef struct {
    json_t *key, *val;
    uint64_t expires; /* CLOCK_MONOTONIC ns; UINT64_MAX: never */
} kvb__ms_entry_t;

/* The store. Every field is guarded by `mu`; only kvb__ms_store_init and kvb__ms_store_free run
 * without it (nothing else may use the store then). Times (`now`, `expires`) are the caller's
 * monotonic nanoseconds: kvb__now_ns() in the server, a fake clock in the fuzzer. */
typedef struct {
    pthread_mutex_t mu;
    kvb__ms_entry_t *v; /* sorted by key, byte order (strcmp compares as unsigned char) */
    size_t n, cap;
    size_t max_keys;     /* keys at most, expired ones purged first when it is reached */
    uint64_t max_bytes;  /* value bytes at most, all keys together, likewise */
    uint64_t bytes;      /* value bytes of all entries, expired ones included */
    uint64_t next_sweep; /* when the next request purges every expired key */
} kvb__ms_store_t;

typedef enum {
    KVB__MS_PUT_OK,
    KVB__MS_PUT_FULL_KEYS,  /* a new key, and max_keys live keys already */
    KVB__MS_PUT_FULL_BYTES, /* the live values would take over max_bytes */
    KVB__MS_PUT_NOMEM,
    KVB__MS_PUT_TAKEN, /* renew: the key is live and holds another value */
} kvb__ms_put_rc_t;

/* Makes *st an empty store of at most `max_keys` keys and `max_bytes` bytes of values. Undo with
 * kvb__ms_store_free. */
void kvb__ms_store_init(kvb__ms_store_t *st, size_t max_keys, uint64_t max_bytes);

/* Sets `key` (a C string that passed kvb__ms_key_problem; copied) to `val` (a jansson string of
 * valid UTF-8, see kvb__ms_utf8_valid; the reference is stolen, also on error) until `expires`
 * (UINT64_MAX: never), at time `now`. With `renew`, only if the key is absent or already holds
 * this very value (else KVB__MS_PUT_TAKEN): checked under the same lock as the write, so that an
 * owner renewing its key never overwrites another's. Returns KVB__MS_PUT_OK or why not; the
 * store is unchanged on error (but for purged expired keys). */
kvb__ms_put_rc_t kvb__ms_store_put(kvb__ms_store_t *st, const char *key, json_t *val,
                                   uint64_t expires, bool renew, uint64_t now);

/* The value of `key` at time `now` with a reference for the caller (json_decref it; it stays
 * valid whatever happens to the key), or NULL if the key is absent or expired. */
json_t *kvb__ms_store_get(kvb__ms_store_t *st, const char *key, uint64_t now);

/* Deletes `key` at time `now`. Returns true if it was there (and not expired). */
bool kvb__ms_store_del(kvb__ms_store_t *st, const char *key, uint64_t now);

/* A new JSON array [{"key","value","ttl_ms"}, ...] of the keys live at `now` that start with
 * `prefix` (any C string), in key order; ttl_ms is the time left rounded up to a millisecond, 0
 * for never. The caller owns the array (the items share the store's strings, so the lock is held
 * only to collect them); NULL if out of memory. */
json_t *kvb__ms_store_list(kvb__ms_store_t *st, const char *prefix, uint64_t now);

/* Purges every key expired at `now`; returns how many keys are left. */
size_t kvb__ms_store_count(kvb__ms_store_t *st, uint64_t now);

/* Releases every key and value of the store and its mutex (values held by callers stay valid). */
void kvb__ms_store_free(kvb__ms_store_t *st);

/* True if s[0..n) is RFC 3629 UTF-8, as jansson checks it: no overlong forms, no surrogates,
 * nothing past U+10FFFF (NUL bytes are fine). Values must be valid because /v1/list returns them
 * as JSON strings. */
bool kvb__ms_utf8_valid(const unsigned char *s, size_t n);

/* NULL if `key` (a C string) may be stored: 1 to KVB__MS_KEY_MAX bytes of UTF-8, no control
 * bytes. Else a static message saying what is wrong with it. */
const char *kvb__ms_key_problem(const char *key);

/* Parses `s`, a decimal integer <= max, digits only (strtoull would take spaces and signs), into
 * *out. Returns 0, or -1 (*out untouched) if s is NULL, empty, not all digits or above max.
 * `max` must be at most (UINT64_MAX - 9) / 10, so that no digit can overflow. */
int kvb__ms_parse_dec(const char *s, uint64_t max, uint64_t *out);

#endif
