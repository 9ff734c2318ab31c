/* SPDX-License-Identifier: Apache-2.0 */
/* Base64 (RFC 4648, standard alphabet, padded): etcd's JSON API carries keys and values in it, and
 * segment descriptors carry binary attributes in it. */
#ifndef KVB_COMMON_BASE64_H
#define KVB_COMMON_BASE64_H

#include <stddef.h>

/* Encodes len bytes into a malloc'd NUL-terminated string; NULL on overflow or out of memory. */
char *kvb__b64_encode(const void *data, size_t len);

/* Decodes `len` characters of padded base64 into a malloc'd buffer (NUL-terminated for
 * convenience; *out_len excludes the NUL). Returns 0, or -1 for malformed input or no memory. */
int kvb__b64_decode(const char *text, size_t len, char **out, size_t *out_len);

#endif
