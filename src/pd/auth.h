/* SPDX-License-Identifier: Apache-2.0 */
/* Who may drive a PD instance: internal calls signed with the cluster secret (HMAC over method,
 * path, timestamp, nonce and body; stale or replayed calls refused), tickets that bind a lease's
 * or a reservation's block ids to its request, and bearer API keys for /v1/completions. */
#ifndef KVB_PD_AUTH_H
#define KVB_PD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVB_PD_AUTH_HEADER   "X-Kvb-Auth"
#define KVB_PD_AUTH_LINE_MAX 192u   /* "X-Kvb-Auth: v1 <ts> <nonce> <mac>" with its NUL */
#define KVB_PD_AUTH_SKEW_MS  30000u /* a call signed further from our clock is stale */
#define KVB_PD_AUTH_SEEN_MAX 65536u /* nonces remembered (a minute of ~1000 calls/s) */
#define KVB_PD_TICKET_MAX    96u    /* "v1.<expiry ms>.<64 hex>" with its NUL */
#define KVB_PD_API_KEYS_MAX  1024u  /* keys in one --api-key-file */
#define KVB_PD_API_KEY_MAX   256u   /* bytes of one key */

typedef struct kvb__pd_auth kvb__pd_auth_t;

/* Loads the cluster secret from KVB_SECRET_FILE (none: calls are not signed nor checked, and
 * tickets use an empty key, which still catches a block list paired with the wrong request) and,
 * when `api_key_file` is not NULL, the API keys (one per line; blank lines and lines starting
 * with '#' skipped). KVB_OK; KVB_ERR_INVALID_ARG / KVB_ERR_NOT_FOUND with `why` filled;
 * KVB_ERR_NOMEM. *out is set only on success. */
int kvb__pd_auth_create(const char *api_key_file, kvb__pd_auth_t **out, char *why, size_t cap);
void kvb__pd_auth_free(kvb__pd_auth_t *a);

/* True when a cluster secret is set: internal calls must then carry a valid signature. */
bool kvb__pd_auth_signed(const kvb__pd_auth_t *a);
/* True when API keys were loaded: /v1/completions then needs "Authorization: Bearer <key>". */
bool kvb__pd_auth_has_api_keys(const kvb__pd_auth_t *a);
/* Whether s[0..n) can be an API key: 1..KVB_PD_API_KEY_MAX printable characters without spaces
 * (nothing else can ride along in the header that carries it). */
bool kvb__pd_api_key_valid(const char *s, size_t n);
/* The first API key loaded (a client's key file), NUL-terminated; NULL when none was. */
const char *kvb__pd_auth_first_key(const kvb__pd_auth_t *a);

/* Writes the header line "X-Kvb-Auth: v1 <unix ms> <nonce hex> <mac hex>" for a call of
 * `method` to `path` (no query) with body[0..len) into out[KVB_PD_AUTH_LINE_MAX]. KVB_OK, or
 * KVB_ERR_SYSTEM (no randomness or HMAC). Without a secret it writes "" and returns KVB_OK. */
int kvb__pd_auth_sign(const kvb__pd_auth_t *a, const char *method, const char *path,
                      const char *body, size_t len, char out[KVB_PD_AUTH_LINE_MAX]);

/* Checks the X-Kvb-Auth value `hdr` (NULL: absent) of a call. KVB_OK (also when no secret is
 * set), else KVB_ERR_AUTH with *reason one of "unauthenticated" (absent or malformed),
 * "bad_signature", "stale" (more than KVB_PD_AUTH_SKEW_MS from our clock) or "replayed" (this
 * nonce was accepted before). Remembers the nonce of every call it accepts. Thread-safe. */
int kvb__pd_auth_check(kvb__pd_auth_t *a, const char *method, const char *path, const char *hdr,
                       const char *body, size_t len, const char **reason);

/* What a ticket vouches for: the blocks an instance holds for one request, on its segments,
 * until `expires_ms` (Unix time). `kind` is "lease" (prefill, pull) or "reservation" (decode,
 * push). */
typedef struct {
    const char *kind;
    const char *request_id;
    char *const *segs;
    size_t nsegs;
    const uint64_t *blocks;
    size_t nblocks;
} kvb__pd_grant_t;

/* Writes "v1.<expires_ms>.<hex HMAC of the grant>" into out[KVB_PD_TICKET_MAX]. */
int kvb__pd_ticket_make(const kvb__pd_auth_t *a, const kvb__pd_grant_t *g, uint64_t expires_ms,
                        char out[KVB_PD_TICKET_MAX]);
/* KVB_OK when `ticket` (NULL: absent) vouches for exactly `g` and has not expired, with its
 * expiry (Unix ms) in *expires_ms (when not NULL); else KVB_ERR_AUTH with *reason
 * "missing_ticket", "foreign_blocks" (it vouches for other blocks, segments or another request)
 * or "ticket_expired". */
int kvb__pd_ticket_check(const kvb__pd_auth_t *a, const kvb__pd_grant_t *g, const char *ticket,
                         uint64_t *expires_ms, const char **reason);

/* KVB_OK when `authorization` (the header's value; NULL: absent) is "Bearer <key>" for a loaded
 * key, or no keys are loaded; else KVB_ERR_AUTH. Compared in constant time per key. */
int kvb__pd_auth_api_key(const kvb__pd_auth_t *a, const char *authorization);

/* Unix time in ms (CLOCK_REALTIME: signatures and tickets cross hosts). */
uint64_t kvb__pd_unix_ms(void);

#endif
