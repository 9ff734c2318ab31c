/* SPDX-License-Identifier: Apache-2.0 */
/* An instance's registration in a metadata store: the key
 * kvbridge/<cluster>/instances/<addr>:<port> whose JSON value tells proxies what the instance is
 * (docs/pd-protocol.md), published once HTTP serves, kept alive by the store client's keeper and
 * withdrawn before HTTP stops. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/reason.h"
#include "pd/server/internal.h"

bool kvb_pd_cluster_valid(const char *c)
{
    return kvb__meta_cluster_valid(c);
}

static bool has_store(const char *uri)
{
    return uri && *uri && strcmp(uri, "p2p");
}

bool kvb_pd_store_uri_valid(const char *uri)
{
    kvb_meta_t *m = NULL;
    if (!has_store(uri) || strlen(uri) > KVB_META_URI_MAX ||
        kvb__meta_open(uri, KVB_PD_SERVER_META_MS, 0, &m) != KVB_OK)
        return false;
    kvb__meta_close(m); /* owns nothing, started nothing: contacts nothing */
    return true;
}

int kvb__srv_reg_check(const kvb_pd_server_opts_t *o, char *reason, size_t cap)
{
    if (o->cluster && !kvb_pd_cluster_valid(o->cluster))
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG,
                         "cluster name '%s' is not 1..63 characters of [A-Za-z0-9._-]", o->cluster);
    if (o->metadata_ttl_ms && o->metadata_ttl_ms < 1000)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG,
                         "metadata TTL %u ms is under the minimum of 1000 ms", o->metadata_ttl_ms);
    if (o->metadata && strlen(o->metadata) > KVB_META_URI_MAX)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "metadata URI longer than %u bytes",
                         KVB_META_URI_MAX);
    return KVB_OK;
}

int kvb__srv_reg_open(kvb_pd_server_t *srv, char *reason, size_t cap)
{
    if (!has_store(srv->metadata))
        return KVB_OK;
    int rc =
        kvb__meta_open(srv->metadata, KVB_PD_SERVER_META_MS, srv->opts.metadata_ttl_ms, &srv->meta);
    if (rc)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG,
                         "bad metadata URI '%s' (want etcd://HOST:PORT[,HOST:PORT], "
                         "redis://[:PASSWORD@]HOST:PORT[/DB] or http://HOST:PORT[/PREFIX])",
                         srv->metadata);
    /* One read now, so that a store that is down fails the start at once and says so, rather
     * than as an engine error after the model has loaded. */
    char prefix[KVB_META_KEY_MAX + 1];
    kvb_meta_kv_t *kvs = NULL;
    size_t n = 0;
    rc = kvb__meta_key(prefix, sizeof prefix, srv->cluster, "instances", "");
    if (!rc)
        rc = kvb__meta_list(srv->meta, prefix, &kvs, &n);
    kvb__meta_kvs_free(kvs, n);
    if (rc == KVB_OK || rc == KVB_ERR_NOT_FOUND)
        return KVB_OK;
    if (rc == KVB_ERR_META_UNREACHABLE)
        return kvb__fail(reason, cap, rc, "metadata store %s unreachable",
                         kvb__meta_uri(srv->meta));
    return kvb__fail(reason, cap, rc, "metadata store %s: %s", kvb__meta_uri(srv->meta),
                     kvb_strerror(rc));
}

/* The host proxies dial: the bind address, or this host's name for a wildcard one. */
static void advertised_host(const kvb_pd_server_t *srv, char *out, size_t cap)
{
    if (!strcmp(srv->addr, "0.0.0.0") || !strcmp(srv->addr, "::")) {
        if (gethostname(out, cap) == 0 && out[0]) {
            out[cap - 1] = '\0';
            return;
        }
    }
    snprintf(out, cap, "%s", srv->addr);
}

static void new_incarnation(char out[17])
{
    uint64_t v;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
        v = kvb__now_ns() ^ ((uint64_t)getpid() << 32);
    snprintf(out, 17, "%016llx", (unsigned long long)v);
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The registration's value (a malloc'd JSON text) or NULL. */
static char *reg_value(kvb_pd_server_t *srv, const char *host)
{
    char url[300];
    bool v6 = strchr(host, ':') != NULL;
    snprintf(url, sizeof url, "http://%s%s%s:%u", v6 ? "[" : "", host, v6 ? "]" : "",
             (unsigned)srv->port);
    json_t *v =
        json_pack("{s:i, s:s, s:s, s:s, s:i, s:i, s:s, s:s, s:I}", "kvbridge", 1, "role",
                  kvb_pd_role_name(srv->opts.role), "url", url, "model", srv->model_spec, "tp",
                  (int)srv->tp, "dp", 1, "kv_mode", kvb_pd_kv_mode_name(srv->opts.kv_mode),
                  "incarnation", srv->incarnation, "started_ms", (json_int_t)unix_ms());
    char *text = v ? json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(v);
    return text;
}

int kvb__srv_reg_publish(kvb_pd_server_t *srv, char *reason, size_t cap)
{
    if (!srv->meta)
        return KVB_OK;
    char host[256], name[300], key[KVB_META_KEY_MAX + 1];
    advertised_host(srv, host, sizeof host);
    snprintf(name, sizeof name, "%s:%u", host, (unsigned)srv->port);
    /* /health may be reading these under reg_mu: HTTP serves already when the server publishes
     * (once, at start; the store client itself keeps the key alive after). This thread alone
     * writes them. */
    char inc[sizeof srv->incarnation];
    new_incarnation(inc);
    pthread_mutex_lock(&srv->reg_mu);
    memcpy(srv->incarnation, inc, sizeof inc);
    pthread_mutex_unlock(&srv->reg_mu);
    int rc = kvb__meta_key(key, sizeof key, srv->cluster, "instances", name);
    if (rc)
        return kvb__fail(reason, cap, rc, "instance key for %s does not fit", name);
    char *val = reg_value(srv, host);
    if (!val)
        return kvb__fail(reason, cap, KVB_ERR_NOMEM, "out of memory");
    rc = kvb__meta_own(srv->meta, key, val, strlen(val));
    free(val);
    if (rc == KVB_ERR_META_UNREACHABLE)
        return kvb__fail(reason, cap, rc, "metadata store %s unreachable: cannot register %s",
                         kvb__meta_uri(srv->meta), key);
    if (rc)
        return kvb__fail(reason, cap, rc, "metadata store %s refused %s: %s",
                         kvb__meta_uri(srv->meta), key, kvb_strerror(rc));
    pthread_mutex_lock(&srv->reg_mu);
    snprintf(srv->inst_key, sizeof srv->inst_key, "%s", key);
    pthread_mutex_unlock(&srv->reg_mu);
    KVB_INFO("registered %s in %s (incarnation %s)", key, kvb__meta_uri(srv->meta),
             srv->incarnation);
    return KVB_OK;
}

void kvb__srv_reg_health(kvb_pd_server_t *srv, json_t *health)
{
    pthread_mutex_lock(&srv->reg_mu);
    if (srv->meta && health)
        json_object_set_new(health, "metadata",
                            json_pack("{s:s, s:s, s:s, s:s, s:b}", "store",
                                      kvb__meta_uri(srv->meta), "cluster", srv->cluster, "key",
                                      srv->inst_key, "incarnation", srv->incarnation, "reachable",
                                      kvb__meta_reachable(srv->meta)));
    pthread_mutex_unlock(&srv->reg_mu);
}

void kvb__srv_reg_close(kvb_pd_server_t *srv)
{
    /* Closing deletes the owned key: proxies drop us on their next round instead of after the
     * TTL, and, since this runs before HTTP stops, never pick us while we refuse connections -
     * while /health may still read the store's state: it is taken out under reg_mu first. */
    pthread_mutex_lock(&srv->reg_mu);
    kvb_meta_t *m = srv->meta;
    srv->meta = NULL;
    pthread_mutex_unlock(&srv->reg_mu);
    kvb__meta_close(m);
}
