/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's binding to a metadata store (declared in engine/internal.h, as transports are): its
 * segment descriptor (built, published, kept alive by the store client's keeper), the lookup
 * behind kvb_segment_open, and the revalidation of open segments that notices a name taken over by
 * a new incarnation. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base64.h"
#include "common/log.h"
#include "engine/internal.h"
#include "meta/meta.h"

#define DESC_SCHEMA 1 /* the descriptor's "kvbridge" field; readers refuse others */

static const char *access_name(unsigned a)
{
    return a == KVB_ACCESS_RW      ? "rw"
           : a == KVB_ACCESS_WRITE ? "w"
           : a == KVB_ACCESS_READ  ? "r"
                                   : "";
}

/* An attribute's value: its JSON text embedded as JSON when it is JSON (KV layouts), else base64.
 */
static json_t *attr_json(const kvb_attr_t *a)
{
    json_error_t err;
    json_t *v = a->len ? json_loadb((const char *)a->value, a->len, JSON_DECODE_ANY, &err) : NULL;
    if (v)
        return json_pack("{s:o}", "json", v);
    char *b = kvb__b64_encode(a->value ? a->value : (const uint8_t *)"", a->len);
    json_t *o = b ? json_pack("{s:s}", "base64", b) : NULL;
    free(b);
    return o;
}

static json_t *build(kvb_engine_t *e)
{
    kvb_region_info_t *regs = NULL;
    size_t nregs = 0;
    if (kvb__registry_list(&e->registry, &regs, &nregs))
        return NULL;
    char inc[17], host[2 * KVB_HOST_ID_LEN + 1];
    snprintf(inc, sizeof inc, "%016" PRIx64, e->hello.incarnation);
    for (size_t i = 0; i < KVB_HOST_ID_LEN; i++)
        snprintf(host + 2 * i, 3, "%02x", e->hello.host_id[i]);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    json_t *d = json_pack(
        "{s:i,s:s,s:s,s:I,s:s,s:[{s:s,s:i}],s:[s],s:I}", "kvbridge", DESC_SCHEMA, "name",
        e->segment_name, "incarnation", inc, "pid", (json_int_t)e->hello.pid, "host_id", host,
        "addresses", "host", e->advertise_addr, "port", (int)e->tp_ops->port(e->tp), "transports",
        "tcp", "published_ms", (json_int_t)now.tv_sec * 1000 + now.tv_nsec / 1000000);
    json_t *rl = json_array(), *al = json_object();
    if (d && e->protocol != KVB_PROTO_TCP)
        json_array_append_new(json_object_get(d, "transports"), json_string("shm"));
    for (size_t i = 0; d && rl && i < nregs; i++) {
        char addr[24];
        snprintf(addr, sizeof addr, "0x%" PRIx64, regs[i].addr);
        json_array_append_new(
            rl, json_pack("{s:s,s:I,s:s,s:s}", "addr", addr, "len", (json_int_t)regs[i].len,
                          "access", access_name(regs[i].access), "location", regs[i].location));
    }
    free(regs);
    pthread_mutex_lock(&e->attr_mu);
    for (size_t i = 0; d && al && i < e->nattrs; i++)
        json_object_set_new(al, e->attrs[i].key, attr_json(&e->attrs[i]));
    pthread_mutex_unlock(&e->attr_mu);
    if (!d || !rl || !al || json_object_set_new(d, "regions", rl) ||
        json_object_set_new(d, "attrs", al)) {
        json_decref(d);
        return NULL;
    }
    return d;
}

int kvb__segdesc_publish(kvb_engine_t *e, bool now)
{
    if (!e->meta)
        return KVB_OK;
    json_t *d = build(e);
    char *text = d ? json_dumps(d, JSON_COMPACT) : NULL;
    json_decref(d);
    if (!text)
        return KVB_ERR_NOMEM;
    int rc = now ? kvb__meta_own(e->meta, e->meta_key, text, strlen(text))
                 : kvb__meta_own_async(e->meta, e->meta_key, text, strlen(text));
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

int kvb__segdesc_lookup(kvb_engine_t *e, const char *name, kvb_segdesc_t *out)
{
    char key[KVB_META_KEY_MAX + 1];
    if (kvb__meta_key(key, sizeof key, e->cluster, "segments", name))
        return KVB_ERR_INVALID_ARG;
    char *text = NULL;
    size_t len = 0;
    int rc = kvb__meta_get(e->meta, key, &text, &len);
    if (rc == KVB_ERR_NOT_FOUND) {
        KVB_WARN("segment %s not found: no live descriptor at %s in %s", name, key,
                 kvb__meta_uri(e->meta));
        return KVB_ERR_SEGMENT_NOT_FOUND;
    }
    if (rc == KVB_ERR_META_UNREACHABLE) {
        KVB_WARN("cannot open segment %s: metadata store %s unreachable", name,
                 kvb__meta_uri(e->meta));
        return rc;
    }
    if (rc)
        return rc;
    rc = kvb__segdesc_parse(text, len, name, out);
    free(text);
    return rc;
}

/* The keeper's tick: drop open segments whose name now belongs to another incarnation. */
static void revalidate(void *user)
{
    kvb_engine_t *e = user;
    pthread_mutex_lock(&e->seg_mu);
    size_t n = 0;
    kvb_peer_t **live = calloc(e->nsegs ? e->nsegs : 1, sizeof *live);
    for (size_t i = 0; live && i < e->nsegs; i++) {
        kvb_peer_t *p = e->segs[i].peer;
        if (p && atomic_load(&p->lost) == 0) {
            atomic_fetch_add(&p->refs, 1);
            live[n++] = p;
        }
    }
    pthread_mutex_unlock(&e->seg_mu);
    for (size_t i = 0; i < n; i++) {
        kvb_peer_t *p = live[i];
        char key[KVB_META_KEY_MAX + 1], *text = NULL;
        size_t len;
        kvb_segdesc_t d;
        if (!kvb__meta_key(key, sizeof key, e->cluster, "segments", p->name) &&
            kvb__meta_get(e->meta, key, &text, &len) == KVB_OK &&
            kvb__segdesc_parse(text, len, p->name, &d) == KVB_OK &&
            d.incarnation != p->hello.incarnation) {
            KVB_WARN("segment %s now belongs to incarnation %016" PRIx64 " (we hold %016" PRIx64
                     "): failing it so that a reopen reaches the new owner",
                     p->name, d.incarnation, p->hello.incarnation);
            kvb__peer_fail(p, KVB_ERR_PEER_RESTARTED);
        }
        /* A missing descriptor alone proves nothing (the store may have restarted empty, or its
         * owner's refresh failed): the connection stays the judge of a linked peer's life. */
        free(text);
        kvb__peer_release(p);
    }
    free(live);
}

_Static_assert(KVB_SEG_KEY_MAX == KVB_META_KEY_MAX, "engine key buffer matches the store's limit");

int kvb__segdesc_open(kvb_engine_t *e)
{
    if (!kvb__meta_cluster_valid(e->cluster)) {
        KVB_ERROR("cluster name '%s' is not 1..%d characters of [A-Za-z0-9._-]", e->cluster,
                  KVB_CLUSTER_MAX);
        return KVB_ERR_INVALID_ARG;
    }
    return kvb__meta_open(e->cfg.metadata, e->cfg.connect_timeout_ms, e->cfg.metadata_ttl_ms,
                          &e->meta);
}

int kvb__segdesc_start(kvb_engine_t *e)
{
    if (!e->meta)
        return KVB_OK;
    int rc =
        kvb__meta_key(e->meta_key, sizeof e->meta_key, e->cluster, "segments", e->segment_name);
    if (rc) {
        KVB_ERROR("segment name %s does not fit in a metadata key", e->segment_name);
        return rc;
    }
    char *old = NULL;
    size_t len;
    kvb_segdesc_t prev;
    if (kvb__meta_get(e->meta, e->meta_key, &old, &len) == KVB_OK &&
        kvb__segdesc_parse(old, len, e->segment_name, &prev) == KVB_OK)
        KVB_INFO("segment %s: replacing the descriptor of incarnation %016" PRIx64
                 " (a restart, or another process under this name)",
                 e->segment_name, prev.incarnation);
    free(old);
    rc = kvb__segdesc_publish(e, true);
    if (rc) {
        KVB_ERROR("cannot publish segment %s to metadata store %s: %s", e->segment_name,
                  kvb__meta_uri(e->meta), kvb_strerror(rc));
        return rc;
    }
    kvb__meta_set_tick(e->meta, revalidate, e);
    return KVB_OK;
}

void kvb__segdesc_stop(kvb_engine_t *e)
{
    if (!e->meta)
        return;
    kvb__meta_set_tick(e->meta, NULL, NULL);
    kvb__meta_close(e->meta); /* deletes our descriptor */
    e->meta = NULL;
}
