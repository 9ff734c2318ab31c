/* SPDX-License-Identifier: Apache-2.0 */
/* The "etcd://host:port[,host:port...]" backend: etcd's v3 JSON API (the gRPC gateway) over
 * libcurl. Keys and values travel base64-encoded; owned keys hang off one lease that the keeper
 * keeps alive, so they vanish within the TTL of the process's death. A call that finds no
 * endpoint answering moves on to the next one. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base64.h"
#include "common/log.h"
#include "meta/internal.h"

#define ETCD_MAX_ENDPOINTS 16
#define ETCD_ANSWER_MAX    (64u << 20)

typedef struct {
    char url[300]; /* "http://host:port" */
} endpoint_t;

typedef struct {
    endpoint_t ep[ETCD_MAX_ENDPOINTS];
    size_t nep, cur;
    void *curl;
    char lease[32]; /* the owned keys' lease ID (decimal), "" when none */
} etcd_be_t;

/* POSTs the JSON `req` (consumed) to `path` on the current endpoint, then the others while none
 * answers and the call has time left. Returns KVB_OK with the parsed answer in *ans (2xx),
 * KVB_ERR_NOT_FOUND for etcd's "not found" errors (code 5: a lease that is gone), or an error. */
static int post(kvb_meta_t *m, const char *path, json_t *req, json_t **ans)
{
    etcd_be_t *b = m->be;
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (!body)
        return KVB_ERR_NOMEM;
    int rc = KVB_ERR_META_UNREACHABLE;
    long status = 0;
    char *resp = NULL;
    size_t len = 0;
    for (size_t tries = 0; tries < b->nep && rc == KVB_ERR_META_UNREACHABLE; tries++) {
        /* The endpoints share the call's timeout: each one tried gets an equal part of what is
         * left for those not tried yet, so that a dead or hung member leaves the others time (a
         * keepalive that failed over only after the whole timeout came too late for the lease)
         * and the call still ends within its timeout. An endpoint with no time left is not
         * tried, nor passed over: the next call starts there. */
        uint32_t left = kvb__meta_left_ms(m), part = left / (uint32_t)(b->nep - tries);
        if (left == 0)
            break;
        char url[400];
        snprintf(url, sizeof url, "%s%s", b->ep[b->cur].url, path);
        rc = kvb__meta_http(m, &b->curl, part ? part : left, "POST", url, body, strlen(body),
                            &status, &resp, &len, ETCD_ANSWER_MAX);
        if (rc == KVB_OK && status >= 502 && status <= 504) {
            free(resp); /* a gateway without a leader is as good as down */
            resp = NULL;
            rc = KVB_ERR_META_UNREACHABLE;
        }
        if (rc == KVB_ERR_META_UNREACHABLE)
            b->cur = (b->cur + 1) % b->nep;
    }
    free(body);
    if (rc)
        return rc;
    json_error_t jerr;
    json_t *root = json_loadb(resp, len, 0, &jerr);
    if (!json_is_object(root)) {
        KVB_WARN("etcd %s%s: answer is not JSON (%ld): %.200s", m->uri, path, status, resp);
        free(resp);
        json_decref(root);
        return KVB_ERR_PROTOCOL;
    }
    if (status < 200 || status > 299) {
        json_int_t code = json_integer_value(json_object_get(root, "code"));
        const char *msg = json_string_value(json_object_get(root, "message"));
        rc = code == 5 ? KVB_ERR_NOT_FOUND : KVB_ERR_PROTOCOL;
        if (rc == KVB_ERR_PROTOCOL)
            KVB_WARN("etcd %s%s answered %ld: %s", m->uri, path, status, msg ? msg : resp);
        free(resp);
        json_decref(root);
        return rc;
    }
    free(resp);
    *ans = root;
    return KVB_OK;
}

/* {"key": b64(key)} plus, for a prefix, "range_end" = the prefix with its last byte + 1. */
static json_t *key_req(const char *key, bool prefix)
{
    json_t *req = json_object();
    size_t kl = strlen(key);
    char *k = kvb__b64_encode(kl ? key : "", kl ? kl : (prefix ? 1 : 0));
    char *end = NULL;
    if (prefix) {
        char *upper = strdup(kl ? key : "");
        if (upper) {
            size_t ul = kl;
            /* The smallest key above every key with this prefix. A prefix of all 0xff (or an
             * empty one) has none: range over everything from key, with end "\0". */
            while (ul > 0 && (unsigned char)upper[ul - 1] == 0xff)
                ul--;
            if (ul > 0) {
                upper[ul - 1] = (char)((unsigned char)upper[ul - 1] + 1);
                end = kvb__b64_encode(upper, ul);
            } else {
                end = kvb__b64_encode("", 1);
            }
            free(upper);
        }
    }
    if (!req || !k || (prefix && !end) || json_object_set_new(req, "key", json_string(k)) ||
        (prefix && json_object_set_new(req, "range_end", json_string(end)))) {
        json_decref(req);
        req = NULL;
    }
    free(k);
    free(end);
    return req;
}

static int grant(kvb_meta_t *m, uint32_t ttl_ms, char *id, size_t cap)
{
    json_t *req = json_object(), *ans = NULL;
    json_object_set_new(req, "TTL", json_integer((ttl_ms + 999) / 1000));
    int rc = post(m, "/v3/lease/grant", req, &ans);
    if (rc)
        return rc;
    const char *s = json_string_value(json_object_get(ans, "ID"));
    if (!s || !*s || strlen(s) >= cap || strspn(s, "0123456789") != strlen(s)) {
        KVB_WARN("etcd %s: lease grant answer has no ID", m->uri);
        rc = KVB_ERR_PROTOCOL;
    } else {
        strcpy(id, s);
    }
    json_decref(ans);
    return rc;
}

static int put_lease(kvb_meta_t *m, const char *key, const char *val, size_t len, const char *lease)
{
    json_t *req = key_req(key, false), *ans = NULL;
    char *v = kvb__b64_encode(val, len);
    if (!req || !v || json_object_set_new(req, "value", json_string(v)) ||
        (lease && json_object_set_new(req, "lease", json_string(lease)))) {
        json_decref(req);
        free(v);
        return KVB_ERR_NOMEM;
    }
    free(v);
    int rc = post(m, "/v3/kv/put", req, &ans);
    json_decref(ans);
    return rc;
}

static int e_put(kvb_meta_t *m, const char *key, const char *val, size_t len, uint32_t ttl_ms)
{
    char lease[32];
    int rc = ttl_ms ? grant(m, ttl_ms, lease, sizeof lease) : KVB_OK;
    return rc ? rc : put_lease(m, key, val, len, ttl_ms ? lease : NULL);
}

static int e_put_owned(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    etcd_be_t *b = m->be;
    for (int attempt = 0; attempt < 2; attempt++) {
        int rc = b->lease[0] ? KVB_OK : grant(m, m->ttl_ms, b->lease, sizeof b->lease);
        if (rc == KVB_OK)
            rc = put_lease(m, key, val, len, b->lease);
        if (rc != KVB_ERR_NOT_FOUND)
            return rc;
        b->lease[0] = '\0'; /* the lease expired: take a new one, once */
    }
    return KVB_ERR_NOT_FOUND;
}

/* One transaction: key = val on our lease if `cmp` (consumed; a comparison on the key) holds.
 * KVB_OK if it put, KVB_ERR_BUSY if the comparison failed. */
static int put_if(kvb_meta_t *m, const char *key, const char *val, size_t len, json_t *cmp)
{
    etcd_be_t *b = m->be;
    json_t *put = key_req(key, false), *ans = NULL;
    char *v = kvb__b64_encode(val, len);
    json_t *req =
        put && v && cmp && !json_object_set_new(put, "value", json_string(v)) &&
                !json_object_set_new(put, "lease", json_string(b->lease))
            ? json_pack("{s:[O],s:[{s:O}]}", "compare", cmp, "success", "request_put", put)
            : NULL;
    free(v);
    json_decref(put);
    json_decref(cmp);
    if (!req)
        return KVB_ERR_NOMEM;
    int rc = post(m, "/v3/kv/txn", req, &ans);
    if (rc == KVB_OK) /* "succeeded" is left out when false */
        rc = json_is_true(json_object_get(ans, "succeeded")) ? KVB_OK : KVB_ERR_BUSY;
    json_decref(ans);
    return rc;
}

/* A comparison on `key`: its value equals val (a key that is absent fails it), or, with val NULL,
 * it does not exist (create revision 0). */
static json_t *compare(const char *key, const char *val, size_t len)
{
    json_t *c = key_req(key, false);
    char *v = val ? kvb__b64_encode(val, len) : NULL;
    if (!c || (val && !v) || json_object_set_new(c, "result", json_string("EQUAL")) ||
        (val ? json_object_set_new(c, "target", json_string("VALUE")) ||
                   json_object_set_new(c, "value", json_string(v))
             : json_object_set_new(c, "target", json_string("CREATE")) ||
                   json_object_set_new(c, "create_revision", json_string("0")))) {
        json_decref(c);
        c = NULL;
    }
    free(v);
    return c;
}

/* Renews an owned key when its lease was lost or could not be kept alive (and, every round, one
 * that another process took over): puts it on our lease only while it holds our value or nothing
 * (each a compare-and-put), never over another process's value. */
static int e_renew(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    etcd_be_t *b = m->be;
    for (int attempt = 0; attempt < 2; attempt++) {
        int rc = b->lease[0] ? KVB_OK : grant(m, m->ttl_ms, b->lease, sizeof b->lease);
        if (rc == KVB_OK)
            rc = put_if(m, key, val, len, compare(key, val, len));
        if (rc == KVB_ERR_BUSY)
            rc = put_if(m, key, val, len, compare(key, NULL, 0));
        if (rc != KVB_ERR_NOT_FOUND)
            return rc;
        b->lease[0] = '\0'; /* the lease expired: take a new one, once */
    }
    return KVB_ERR_NOT_FOUND;
}

static int e_refresh(kvb_meta_t *m)
{
    etcd_be_t *b = m->be;
    if (!b->lease[0])
        return KVB_ERR_NOT_FOUND;
    json_t *req = json_object(), *ans = NULL;
    json_object_set_new(req, "ID", json_string(b->lease));
    int rc = post(m, "/v3/lease/keepalive", req, &ans);
    if (rc)
        return rc;
    /* An expired lease is answered without a TTL. */
    const char *ttl = json_string_value(json_object_get(json_object_get(ans, "result"), "TTL"));
    if (!ttl || atol(ttl) <= 0) {
        b->lease[0] = '\0';
        rc = KVB_ERR_NOT_FOUND;
    }
    json_decref(ans);
    return rc;
}

static void e_release(kvb_meta_t *m)
{
    etcd_be_t *b = m->be;
    if (!b->lease[0])
        return;
    json_t *req = json_object(), *ans = NULL;
    json_object_set_new(req, "ID", json_string(b->lease));
    if (post(m, "/v3/lease/revoke", req, &ans) == KVB_OK)
        b->lease[0] = '\0';
    json_decref(ans);
}

/* Decodes a kvs[] item's base64 field into a malloc'd string. */
static int field(json_t *kv, const char *name, char **out, size_t *len)
{
    const char *s = json_string_value(json_object_get(kv, name));
    if (!s) { /* etcd omits empty values */
        *out = calloc(1, 1);
        *len = 0;
        return *out ? KVB_OK : KVB_ERR_NOMEM;
    }
    return kvb__b64_decode(s, strlen(s), out, len) ? KVB_ERR_PROTOCOL : KVB_OK;
}

static int e_get(kvb_meta_t *m, const char *key, char **val, size_t *len)
{
    json_t *req = key_req(key, false), *ans = NULL;
    if (!req)
        return KVB_ERR_NOMEM;
    int rc = post(m, "/v3/kv/range", req, &ans);
    if (rc)
        return rc;
    json_t *kv = json_array_get(json_object_get(ans, "kvs"), 0);
    rc = kv ? field(kv, "value", val, len) : KVB_ERR_NOT_FOUND;
    json_decref(ans);
    return rc;
}

static int e_del(kvb_meta_t *m, const char *key)
{
    json_t *req = key_req(key, false), *ans = NULL;
    if (!req)
        return KVB_ERR_NOMEM;
    int rc = post(m, "/v3/kv/deleterange", req, &ans);
    if (rc == KVB_OK) {
        const char *d = json_string_value(json_object_get(ans, "deleted"));
        rc = d && atol(d) > 0 ? KVB_OK : KVB_ERR_NOT_FOUND;
    }
    json_decref(ans);
    return rc;
}

static int e_list(kvb_meta_t *m, const char *prefix, kvb_meta_kv_t **out, size_t *n)
{
    json_t *req = key_req(prefix, true), *ans = NULL;
    if (!req)
        return KVB_ERR_NOMEM;
    int rc = post(m, "/v3/kv/range", req, &ans);
    if (rc)
        return rc;
    json_t *kvs = json_object_get(ans, "kvs");
    size_t cnt = json_array_size(kvs);
    kvb_meta_kv_t *items = calloc(cnt ? cnt : 1, sizeof *items);
    size_t got = 0;
    rc = items ? KVB_OK : KVB_ERR_NOMEM;
    for (size_t i = 0; rc == KVB_OK && i < cnt; i++) {
        json_t *kv = json_array_get(kvs, i);
        size_t kl;
        rc = field(kv, "key", &items[got].key, &kl);
        if (rc == KVB_OK && (rc = field(kv, "value", &items[got].value, &items[got].len)))
            free(items[got].key);
        if (rc == KVB_OK)
            got++;
    }
    json_decref(ans);
    if (rc) {
        if (rc == KVB_ERR_PROTOCOL)
            KVB_WARN("etcd %s: malformed base64 in a range answer", m->uri);
        kvb__meta_kvs_free(items, got);
        return rc;
    }
    *out = items;
    *n = got;
    return KVB_OK;
}

static void e_free(kvb_meta_t *m)
{
    etcd_be_t *b = m->be;
    kvb__meta_http_free(b->curl);
    free(b);
}

const kvb_meta_ops_t kvb__meta_etcd_ops = {
    .kind = "etcd",
    .put = e_put,
    .get = e_get,
    .del = e_del,
    .list = e_list,
    .put_owned = e_put_owned,
    .renew = e_renew,
    .refresh = e_refresh,
    .release = e_release,
    .free = e_free,
};

int kvb__meta_etcd_init(kvb_meta_t *m, const char *rest)
{
    etcd_be_t *b = calloc(1, sizeof *b);
    if (!b)
        return KVB_ERR_NOMEM;
    size_t rl = strlen(rest);
    while (rl && rest[rl - 1] == '/')
        rl--;
    bool ok = rl > 0 && rest[rl - 1] != ',';
    for (size_t i = 0; ok && i < rl;) {
        size_t j = i;
        while (j < rl && rest[j] != ',')
            j++;
        char host[256];
        uint16_t port;
        if (b->nep == ETCD_MAX_ENDPOINTS ||
            kvb__meta_hostport(rest + i, j - i, host, sizeof host, &port)) {
            ok = false;
            break;
        }
        bool v6 = strchr(host, ':') != NULL;
        snprintf(b->ep[b->nep++].url, sizeof b->ep[0].url, "http://%s%s%s:%u", v6 ? "[" : "", host,
                 v6 ? "]" : "", port);
        i = j + 1;
    }
    if (!ok || b->nep == 0) {
        KVB_ERROR("metadata 'etcd://%s': expected etcd://host:port[,host:port...] (at most %d "
                  "endpoints)",
                  rest, ETCD_MAX_ENDPOINTS);
        free(b);
        return KVB_ERR_INVALID_ARG;
    }
    m->ops = &kvb__meta_etcd_ops;
    m->be = b;
    return KVB_OK;
}
