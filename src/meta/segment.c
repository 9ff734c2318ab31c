/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's binding to a metadata store (declared in engine/export.h): its segment descriptor
 * (built, published, kept alive by the store client's keeper), the lookup behind kvb_segment_open,
 * and the revalidation of open segments that notices a name taken over by a new incarnation. It
 * sees the engine only through what engine/export.h offers. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base64.h"
#include "common/log.h"
#include "engine/export.h"
#include "meta/meta.h"

#define DESC_SCHEMA 1 /* the descriptor's "kvbridge" field; readers refuse others */

struct kvb_segbind {
    kvb_engine_t *engine;
    kvb_meta_t *meta;
    char cluster[KVB_CLUSTER_MAX + 1];
    char key[KVB_META_KEY_MAX + 1]; /* our descriptor's */
};

static const char *access_name(unsigned a)
{
    return a == KVB_ACCESS_RW      ? "rw"
           : a == KVB_ACCESS_WRITE ? "w"
           : a == KVB_ACCESS_READ  ? "r"
                                   : "";
}

/* An attribute's value: its JSON text embedded as JSON when it is JSON (KV layouts), else base64.
 */
static json_t *attr_json(const uint8_t *value, size_t len)
{
    json_error_t err;
    json_t *v = len ? json_loadb((const char *)value, len, JSON_DECODE_ANY, &err) : NULL;
    if (v)
        return json_pack("{s:o}", "json", v);
    char *b = kvb__b64_encode(value ? value : (const uint8_t *)"", len);
    json_t *o = b ? json_pack("{s:s}", "base64", b) : NULL;
    free(b);
    return o;
}

static void add_attr(void *arg, const char *key, const uint8_t *value, size_t len)
{
    json_object_set_new((json_t *)arg, key, attr_json(value, len));
}

static json_t *build(kvb_engine_t *e)
{
    kvb_region_info_t *regs = NULL;
    size_t nregs = 0;
    if (kvb__engine_regions(e, &regs, &nregs))
        return NULL;
    kvb_engine_identity_t id;
    kvb__engine_identity(e, &id);
    char inc[17], host[2 * sizeof id.host_id + 1];
    snprintf(inc, sizeof inc, "%016" PRIx64, id.incarnation);
    for (size_t i = 0; i < sizeof id.host_id; i++)
        snprintf(host + 2 * i, 3, "%02x", id.host_id[i]);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    json_t *d =
        json_pack("{s:i,s:s,s:s,s:I,s:s,s:[{s:s,s:i}],s:[s],s:I}", "kvbridge", DESC_SCHEMA, "name",
                  id.name, "incarnation", inc, "pid", (json_int_t)id.pid, "host_id", host,
                  "addresses", "host", id.advertise, "port", (int)id.port, "transports", "tcp",
                  "published_ms", (json_int_t)now.tv_sec * 1000 + now.tv_nsec / 1000000);
    json_t *rl = json_array(), *al = json_object();
    if (d && id.same_host)
        json_array_append_new(json_object_get(d, "transports"), json_string("shm"));
    for (size_t i = 0; d && rl && i < nregs; i++) {
        char addr[24];
        snprintf(addr, sizeof addr, "0x%" PRIx64, regs[i].addr);
        json_array_append_new(
            rl, json_pack("{s:s,s:I,s:s,s:s}", "addr", addr, "len", (json_int_t)regs[i].len,
                          "access", access_name(regs[i].access), "location", regs[i].location));
    }
    free(regs);
    if (al)
        kvb__engine_each_attr(e, add_attr, al);
    if (!d || !rl || !al || json_object_set_new(d, "regions", rl) ||
        json_object_set_new(d, "attrs", al)) {
        json_decref(d);
        return NULL;
    }
    return d;
}

int kvb__segdesc_publish(kvb_segbind_t *b, bool now)
{
    if (!b)
        return KVB_OK;
    json_t *d = build(b->engine);
    char *text = d ? json_dumps(d, JSON_COMPACT) : NULL;
    json_decref(d);
    if (!text)
        return KVB_ERR_NOMEM;
    int rc = now ? kvb__meta_own(b->meta, b->key, text, strlen(text))
                 : kvb__meta_own_async(b->meta, b->key, text, strlen(text));
    free(text);
    return rc;
}

int kvb__segdesc_parse(const char *text, size_t len, const char *name, kvb_segdesc_t *out)
{
    json_error_t err;
    json_t *d = json_loadb(text, len, 0, &err);
    int rc = KVB_ERR_PROTOCOL;
    memset(out, 0, sizeof *out);
    json_t *schema = json_object_get(d, "kvbridge"), *addrs = json_object_get(d, "addresses");
    const char *n = json_string_value(json_object_get(d, "name"));
    const char *inc = json_string_value(json_object_get(d, "incarnation"));
    char *end = NULL;
    if (!json_is_object(d)) {
        KVB_WARN("descriptor of segment %s is not a JSON object", name);
    } else if (!json_is_integer(schema) || json_integer_value(schema) != DESC_SCHEMA) {
        KVB_WARN("descriptor of segment %s has schema %lld; this build reads %d", name,
                 json_is_integer(schema) ? (long long)json_integer_value(schema) : -1LL,
                 DESC_SCHEMA);
        rc = KVB_ERR_VERSION;
    } else if (!n || strcmp(n, name)) {
        KVB_WARN("descriptor under the name %s names segment %s", name, n ? n : "(none)");
    } else if (!inc || strlen(inc) != 16 ||
               (out->incarnation = strtoull(inc, &end, 16), *end != '\0')) {
        KVB_WARN("descriptor of segment %s has no valid incarnation", name);
    } else if (!json_is_array(addrs) || json_array_size(addrs) == 0) {
        KVB_WARN("descriptor of segment %s has no address", name);
    } else {
        rc = KVB_OK;
        for (size_t i = 0; i < json_array_size(addrs) && out->naddr < KVB_SEGDESC_ADDRS; i++) {
            json_t *a = json_array_get(addrs, i);
            const char *h = json_string_value(json_object_get(a, "host"));
            json_int_t p = json_integer_value(json_object_get(a, "port"));
            if (!h || !*h || strlen(h) > KVB_NAME_MAX || p <= 0 || p > 65535) {
                KVB_WARN("descriptor of segment %s has a malformed address", name);
                rc = KVB_ERR_PROTOCOL;
                break;
            }
            strcpy(out->addr[out->naddr].host, h);
            out->addr[out->naddr++].port = (uint16_t)p;
        }
    }
    json_decref(d);
    return rc;
}

int kvb__segdesc_lookup(kvb_segbind_t *b, const char *name, kvb_segdesc_t *out)
{
    char key[KVB_META_KEY_MAX + 1];
    if (kvb__meta_key(key, sizeof key, b->cluster, "segments", name))
        return KVB_ERR_INVALID_ARG;
    char *text = NULL;
    size_t len = 0;
    int rc = kvb__meta_get(b->meta, key, &text, &len);
    if (rc == KVB_ERR_NOT_FOUND) {
        KVB_WARN("segment %s not found: no live descriptor at %s in %s", name, key,
                 kvb__meta_uri(b->meta));
        return KVB_ERR_SEGMENT_NOT_FOUND;
    }
    if (rc == KVB_ERR_META_UNREACHABLE) {
        KVB_WARN("cannot open segment %s: metadata store %s unreachable", name,
                 kvb__meta_uri(b->meta));
        return rc;
    }
    if (rc)
        return rc;
    rc = kvb__segdesc_parse(text, len, name, out);
    free(text);
    return rc;
}

/* The keeper's tick: fail open segments whose name now belongs to another incarnation. */
static void revalidate(void *user)
{
    kvb_segbind_t *b = user;
    kvb_open_segment_t *open = NULL;
    size_t n = 0;
    if (kvb__engine_open_segments(b->engine, &open, &n))
        return;
    for (size_t i = 0; i < n; i++) {
        char key[KVB_META_KEY_MAX + 1], *text = NULL;
        size_t len;
        kvb_segdesc_t d;
        if (!kvb__meta_key(key, sizeof key, b->cluster, "segments", open[i].name) &&
            kvb__meta_get(b->meta, key, &text, &len) == KVB_OK &&
            kvb__segdesc_parse(text, len, open[i].name, &d) == KVB_OK &&
            d.incarnation != open[i].incarnation) {
            KVB_WARN("segment %s now belongs to incarnation %016" PRIx64 " (we hold %016" PRIx64
                     "): failing it so that a reopen reaches the new owner",
                     open[i].name, d.incarnation, open[i].incarnation);
            kvb__segment_fail(b->engine, open[i].seg, open[i].incarnation, KVB_ERR_PEER_RESTARTED);
        }
        /* A missing descriptor alone proves nothing (the store may have restarted empty, or its
         * owner's refresh failed): the connection stays the judge of a linked peer's life. */
        free(text);
    }
    free(open);
}

int kvb__segdesc_open(kvb_engine_t *e, const char *uri, const char *cluster,
                      uint32_t connect_timeout_ms, uint32_t ttl_ms, kvb_segbind_t **out)
{
    *out = NULL;
    if (!kvb__meta_cluster_valid(cluster)) {
        KVB_ERROR("cluster name '%s' is not 1..%d characters of [A-Za-z0-9._-]", cluster,
                  KVB_CLUSTER_MAX);
        return KVB_ERR_INVALID_ARG;
    }
    kvb_meta_t *meta = NULL;
    int rc = kvb__meta_open(uri, connect_timeout_ms, ttl_ms, &meta);
    if (rc || !meta)
        return rc; /* p2p: no binding */
    kvb_segbind_t *b = calloc(1, sizeof *b);
    if (!b) {
        kvb__meta_close(meta);
        return KVB_ERR_NOMEM;
    }
    b->engine = e;
    b->meta = meta;
    snprintf(b->cluster, sizeof b->cluster, "%s", cluster);
    *out = b;
    return KVB_OK;
}

int kvb__segdesc_start(kvb_segbind_t *b)
{
    if (!b)
        return KVB_OK;
    kvb_engine_identity_t id;
    kvb__engine_identity(b->engine, &id);
    int rc = kvb__meta_key(b->key, sizeof b->key, b->cluster, "segments", id.name);
    if (rc) {
        KVB_ERROR("segment name %s does not fit in a metadata key", id.name);
        return rc;
    }
    char *old = NULL;
    size_t len;
    kvb_segdesc_t prev;
    if (kvb__meta_get(b->meta, b->key, &old, &len) == KVB_OK &&
        kvb__segdesc_parse(old, len, id.name, &prev) == KVB_OK)
        KVB_INFO("segment %s: replacing the descriptor of incarnation %016" PRIx64
                 " (a restart, or another process under this name)",
                 id.name, prev.incarnation);
    free(old);
    rc = kvb__segdesc_publish(b, true);
    if (rc) {
        KVB_ERROR("cannot publish segment %s to metadata store %s: %s", id.name,
                  kvb__meta_uri(b->meta), kvb_strerror(rc));
        return rc;
    }
    kvb__meta_set_tick(b->meta, revalidate, b);
    return KVB_OK;
}

void kvb__segdesc_stop(kvb_segbind_t *b)
{
    if (!b)
        return;
    kvb__meta_set_tick(b->meta, NULL, NULL);
    kvb__meta_close(b->meta); /* deletes our descriptor */
    free(b);
}
