/* SPDX-License-Identifier: Apache-2.0 */
/* Peer authentication primitives over OpenSSL's libcrypto: HMAC-SHA256, fresh nonces, a constant-
 * time compare, and the cluster secret (loaded once, kept in one place, wiped when freed). */
#ifndef KVB_COMMON_AUTH_H
#define KVB_COMMON_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVB_MAC_LEN        32 /* HMAC-SHA256 */
#define KVB_NONCE_LEN      32
#define KVB_SECRET_MIN     16 /* a shorter secret is refused: it could be guessed offline */
#define KVB_SECRET_MAX     4096
#define KVB_LINK_TOKEN_LEN 16

/* One piece of a message to authenticate. */
typedef struct {
    const void *p;
    size_t len;
} kvb_mac_part_t;

/* out = HMAC-SHA256(key, parts[0] | parts[1] | ...). An empty key (len 0) is allowed: engines
 * without a secret on loopback still run the same handshake. Returns KVB_OK or KVB_ERR_SYSTEM. */
int kvb__hmac(const void *key, size_t key_len, const kvb_mac_part_t *parts, size_t nparts,
              uint8_t out[KVB_MAC_LEN]);

/* Fills buf with cryptographically strong random bytes. KVB_OK or KVB_ERR_SYSTEM. */
int kvb__random(void *buf, size_t len);

/* True if a and b hold the same n bytes; takes the same time wherever they differ. */
bool kvb__ct_equal(const void *a, const void *b, size_t n);

/* Overwrites n bytes in a way the compiler may not remove. */
void kvb__wipe(void *p, size_t n);

/* Reads a secret file: its bytes, less one trailing newline; KVB_SECRET_MIN..KVB_SECRET_MAX bytes.
 * Warns if other users may read it. Stores a malloc'd copy in *out (free with kvb__secret_free).
 * KVB_ERR_NOT_FOUND (cannot open), KVB_ERR_INVALID_ARG (too short or long), KVB_ERR_SYSTEM. */
int kvb__secret_load(const char *path, uint8_t **out, size_t *len);
void kvb__secret_free(uint8_t *secret, size_t len);

#endif
