/* SPDX-License-Identifier: Apache-2.0 */
/* Base64 encode/decode with strict checking of the input alphabet, length and padding. */
#include "common/base64.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

static const char ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *kvb__b64_encode(const void *data, size_t len)
{
    const uint8_t *in = data;
    if (len > (SIZE_MAX - 1) / 4 * 3 - 3)
        return NULL;
    size_t olen = (len + 2) / 3 * 4;
    char *out = malloc(olen + 1), *o = out;
    if (!out)
        return NULL;
    size_t i = 0;
    for (; i + 3 <= len; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8 | in[i + 2];
        *o++ = ALPHABET[v >> 18];
        *o++ = ALPHABET[(v >> 12) & 63];
        *o++ = ALPHABET[(v >> 6) & 63];
        *o++ = ALPHABET[v & 63];
    }
    if (i < len) {
        uint32_t v = (uint32_t)in[i] << 16 | (i + 1 < len ? (uint32_t)in[i + 1] << 8 : 0);
        *o++ = ALPHABET[v >> 18];
        *o++ = ALPHABET[(v >> 12) & 63];
        *o++ = i + 1 < len ? ALPHABET[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    *o = '\0';
    return out;
}

static int value_of(char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

int kvb__b64_decode(const char *text, size_t len, char **out, size_t *out_len)
{
    if (len % 4)
        return -1;
    size_t pad = len && text[len - 1] == '=' ? (text[len - 2] == '=' ? 2 : 1) : 0;
    size_t olen = len / 4 * 3 - pad;
    uint8_t *buf = malloc(olen + 1);
    if (!buf)
        return -1;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        bool last = i + 4 == len;
        uint32_t v = 0;
        for (size_t k = 0; k < 4; k++) {
            int d = value_of(text[i + k]);
            if (d < 0 && !(last && text[i + k] == '=' && k >= 4 - pad)) {
                free(buf); /* a stray character, or '=' anywhere but the final padding */
                return -1;
            }
            v = v << 6 | (uint32_t)(d < 0 ? 0 : d);
        }
        buf[o++] = (uint8_t)(v >> 16);
        if (!last || pad < 2)
            buf[o++] = (uint8_t)(v >> 8);
        if (!last || pad < 1)
            buf[o++] = (uint8_t)v;
    }
    buf[olen] = '\0';
    *out = (char *)buf;
    *out_len = olen;
    return 0;
}
