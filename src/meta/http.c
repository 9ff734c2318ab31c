/* SPDX-License-Identifier: Apache-2.0 */
/* The "http://host:port[/prefix]" backend: the client of `kvbridge metadata-server`
 * (GET/PUT/DELETE <prefix>/v1/kv/<key>, PUT with ?ttl_ms=N and, to renew an owned key, &renew=1;
 * GET <prefix>/v1/list?prefix=P). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "meta/internal.h"

#define LIST_MAX (64u << 20) /* largest list answer accepted */

typedef struct {
    char base[KVB_META_URI_MAX + 1]; /* "http://host:port/prefix", no trailing '/' */
    void *curl;
} http_be_t;

/* Appends s percent-escaped (everything outside [A-Za-z0-9._~-]) to out at *pos. */
static int escape(char *out, size_t cap, size_t *pos, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        bool plain = (*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') ||
                     (*p >= '0' && *p <= '9') || *p == '.' || *p == '_' || *p == '~' || *p == '-';
        if (*pos + 4 > cap)
            return -1;
        if (plain) {
            out[(*pos)++] = (char)*p;
        } else {
            out[(*pos)++] = '%';
            out[(*pos)++] = hex[*p >> 4];
            out[(*pos)++] = hex[*p & 15];
        }
    }
    out[*pos] = '\0';
    return 0;
}

/* base + path + escaped(arg) + tail, malloc'd. */
static char *make_url(const http_be_t *h, const char *path, const char *arg, const char *tail)
{
    size_t cap = strlen(h->base) + strlen(path) + strlen(arg) * 3 + strlen(tail) + 1;
    char *u = malloc(cap);
    if (!u)
        return NULL;
    size_t pos = (size_t)snprintf(u, cap, "%s%s", h->base, path);
    if (escape(u, cap, &pos, arg) || pos + strlen(tail) + 1 > cap) {
        free(u);
        return NULL;
    }
    strcpy(u + pos, tail);
    return u;
}

/* One call; maps the answer's status: 2xx KVB_OK, 404 KVB_ERR_NOT_FOUND, others an error with
 * the server's message logged. On success the body goes to *resp when resp is not NULL. */
static int call(kvb_meta_t *m, const char *method, char *url, const char *body, size_t len,
                char **resp, size_t *resp_len, size_t max)
{
    http_be_t *h = m->be;
    long status = 0;
    char *r = NULL;
    size_t rl = 0;
    int rc = url ? kvb__meta_http(m, &h->curl, 0, method, url, body, len, &status, &r, &rl, max)
                 : KVB_ERR_NOMEM;
    if (rc == KVB_OK && (status < 200 || status > 299)) {
        if (status == 404) {
            rc = KVB_ERR_NOT_FOUND;
        } else if (status == 412) {
            rc = KVB_ERR_BUSY; /* a renewal refused: the key holds another writer's value */
        } else {
            KVB_WARN("metadata server %s: %s answered %ld: %.200s", m->uri, method, status, r);
            rc = status == 413                    ? KVB_ERR_TOO_LARGE
                 : status >= 502 && status <= 504 ? KVB_ERR_META_UNREACHABLE
                                                  : KVB_ERR_PROTOCOL;
        }
    }
    free(url);
    if (rc == KVB_OK && resp) {
        *resp = r;
        *resp_len = rl;
    } else {
        free(r);
    }
    return rc;
}

static int h_put(kvb_meta_t *m, const char *key, const char *val, size_t len, uint32_t ttl_ms)
{
    char tail[32];
    snprintf(tail, sizeof tail, "?ttl_ms=%u", ttl_ms);
    return call(m, "PUT", make_url(m->be, "/v1/kv/", key, tail), val, len, NULL, NULL, 4096);
}

static int h_put_owned(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    return h_put(m, key, val, len, m->ttl_ms);
}

static int h_renew(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    char tail[48];
    snprintf(tail, sizeof tail, "?ttl_ms=%u&renew=1", m->ttl_ms);
    return call(m, "PUT", make_url(m->be, "/v1/kv/", key, tail), val, len, NULL, NULL, 4096);
}

static int h_get(kvb_meta_t *m, const char *key, char **val, size_t *len)
{
    return call(m, "GET", make_url(m->be, "/v1/kv/", key, ""), NULL, 0, val, len,
                KVB_META_VALUE_MAX);
}

static int h_del(kvb_meta_t *m, const char *key)
{
    return call(m, "DELETE", make_url(m->be, "/v1/kv/", key, ""), NULL, 0, NULL, NULL, 4096);
}

static int h_list(kvb_meta_t *m, const char *prefix, kvb_meta_kv_t **out, size_t *n)
{
    char *body = NULL;
    size_t len = 0;
    int rc = call(m, "GET", make_url(m->be, "/v1/list?prefix=", prefix, ""), NULL, 0, &body, &len,
                  LIST_MAX);
    if (rc)
        return rc;
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    free(body);
    json_t *items = json_object_get(root, "items");
    if (!json_is_array(items)) {
        KVB_WARN("metadata server %s: list answer is not {\"items\":[...]}", m->uri);
        json_decref(root);
        return KVB_ERR_PROTOCOL;
    }
    size_t cnt = json_array_size(items);
    kvb_meta_kv_t *kvs = calloc(cnt ? cnt : 1, sizeof *kvs);
    rc = kvs ? KVB_OK : KVB_ERR_NOMEM;
    size_t got = 0;
    for (size_t i = 0; rc == KVB_OK && i < cnt; i++) {
        json_t *it = json_array_get(items, i);
        const char *k = json_string_value(json_object_get(it, "key"));
        json_t *v = json_object_get(it, "value");
        if (!k || !json_is_string(v) || strncmp(k, prefix, strlen(prefix))) {
            rc = KVB_ERR_PROTOCOL;
            break;
        }
        size_t vl = json_string_length(v);
        kvs[got].key = strdup(k);
        kvs[got].value = malloc(vl + 1);
        if (!kvs[got].key || !kvs[got].value) {
            free(kvs[got].key);
            free(kvs[got].value);
            rc = KVB_ERR_NOMEM;
            break;
        }
        memcpy(kvs[got].value, json_string_value(v), vl + 1);
        kvs[got++].len = vl;
    }
    json_decref(root);
    if (rc) {
        if (rc == KVB_ERR_PROTOCOL)
            KVB_WARN("metadata server %s: malformed list item", m->uri);
        kvb__meta_kvs_free(kvs, got);
        return rc;
    }
    *out = kvs;
    *n = got;
    return KVB_OK;
}

static void h_free(kvb_meta_t *m)
{
    http_be_t *h = m->be;
    kvb__meta_http_free(h->curl);
    free(h);
}

const kvb_meta_ops_t kvb__meta_http_ops = {
    .kind = "http",
    .put = h_put,
    .get = h_get,
    .del = h_del,
    .list = h_list,
    .put_owned = h_put_owned,
    .renew = h_renew,
    .free = h_free,
};

int kvb__meta_http_init(kvb_meta_t *m, const char *uri)
{
    const char *rest = uri + 7, *slash = strchr(rest, '/');
    size_t hp = slash ? (size_t)(slash - rest) : strlen(rest);
    char host[256];
    uint16_t port;
    if (kvb__meta_hostport(rest, hp, host, sizeof host, &port)) {
        KVB_ERROR("metadata '%s': expected http://host:port[/prefix]", uri);
        return KVB_ERR_INVALID_ARG;
    }
    for (const char *p = slash; p && *p; p++)
        if ((unsigned char)*p <= 0x20 || *p == '?' || *p == '#' || *p == 0x7f) {
            KVB_ERROR("metadata '%s': the prefix may not hold spaces, '?' or '#'", uri);
            return KVB_ERR_INVALID_ARG;
        }
    http_be_t *h = calloc(1, sizeof *h);
    if (!h)
        return KVB_ERR_NOMEM;
    snprintf(h->base, sizeof h->base, "%s", uri);
    size_t bl = strlen(h->base);
    while (bl > 7 && h->base[bl - 1] == '/')
        h->base[--bl] = '\0';
    m->ops = &kvb__meta_http_ops;
    m->be = h;
    return KVB_OK;
}
