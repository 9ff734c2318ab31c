/* SPDX-License-Identifier: Apache-2.0 */
/* The PD instance server: creates the ranks (engine, cache in kvb_alloc memory, KV agent each) and
 * the shared block pool, runs the HTTP daemon and routes requests to the endpoint modules. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/reason.h"
#include "pd/server/internal.h"

const char *kvb_pd_role_name(kvb_pd_role_t role)
{
    return role == KVB_PD_ROLE_PREFILL  ? "prefill"
           : role == KVB_PD_ROLE_DECODE ? "decode"
           : role == KVB_PD_ROLE_BOTH   ? "both"
                                        : "?";
}

const char *kvb_pd_kv_mode_name(kvb_pd_kv_mode_t mode)
{
    return mode == KVB_PD_KV_PULL ? "pull" : mode == KVB_PD_KV_PUSH ? "push" : "?";
}

int kvb_pd_role_parse(const char *s, kvb_pd_role_t *out)
{
    kvb_pd_role_t r = !s                      ? 0
                      : !strcmp(s, "prefill") ? KVB_PD_ROLE_PREFILL
                      : !strcmp(s, "decode")  ? KVB_PD_ROLE_DECODE
                      : !strcmp(s, "both")    ? KVB_PD_ROLE_BOTH
                                              : 0;
    if (!r)
        return -1;
    *out = r;
    return 0;
}

int kvb_pd_kv_mode_parse(const char *s, kvb_pd_kv_mode_t *out)
{
    kvb_pd_kv_mode_t m = !s                   ? 0
                         : !strcmp(s, "pull") ? KVB_PD_KV_PULL
                         : !strcmp(s, "push") ? KVB_PD_KV_PUSH
                                              : 0;
    if (!m)
        return -1;
    *out = m;
    return 0;
}

/* ---- ranks ------------------------------------------------------------------------------------
 */

/* The cache allocator: kvb_alloc memory of the rank's engine, so same-host peers map it. */
static void *rank_alloc(void *user, size_t len)
{
    void *p = NULL;
    return kvb_alloc(user, len, 0, &p) == KVB_OK ? p : NULL;
}

static void rank_free(void *user, void *ptr, size_t len)
{
    (void)len;
    int rc = kvb_free(user, ptr);
    if (rc)
        KVB_WARN("freeing a rank cache: %s", kvb_strerror(rc));
}

static int rank_layout(kvb_pd_server_t *srv, kvb__srv_rank_t *rk, char *reason, size_t cap)
{
    size_t ns = kvb_pd_cache_num_slots(rk->cache);
    rk->slots = calloc(ns, sizeof *rk->slots);
    if (!rk->slots)
        return kvb__fail(reason, cap, KVB_ERR_NOMEM, "out of memory");
    int rc = kvb_pd_cache_layout(rk->cache, 1, 0, &rk->layout, rk->slots, ns, reason, cap);
    for (size_t i = 0; !rc && i < rk->layout.num_slots; i++)
        rk->block_bytes += rk->layout.slots[i].block_bytes;
    (void)srv;
    return rc;
}

static int rank_init(kvb_pd_server_t *srv, uint32_t r, char *reason, size_t cap)
{
    kvb__srv_rank_t *rk = &srv->ranks[r];
    kvb_config_t c;
    kvb_config_init(&c);
    c.bind_addr = srv->addr;
    c.insecure = srv->opts.insecure;
    if (srv->opts.protocol)
        c.protocol = srv->opts.protocol;
    if (srv->opts.fabric_provider)
        c.fabric_provider = srv->opts.fabric_provider;
    if (srv->meta) { /* the engine publishes its segment there; its name stays host:port */
        c.metadata = srv->metadata;
        c.cluster = srv->cluster;
        c.metadata_ttl_ms = srv->opts.metadata_ttl_ms;
    }
    int rc = kvb_engine_create(&c, &rk->engine);
    if (rc == KVB_ERR_META_UNREACHABLE)
        return kvb__fail(reason, cap, rc, "rank %u: metadata store %s unreachable", r,
                         kvb__meta_uri(srv->meta));
    if (rc)
        return kvb__fail(reason, cap, rc, "rank %u: cannot create engine on %s: %s", r, srv->addr,
                         kvb_strerror(rc));
    kvb_pd_allocator_t a = {.alloc = rank_alloc, .free = rank_free, .user = rk->engine};
    rc = kvb_pd_cache_create(srv->model, srv->tp, r, srv->total_blocks, srv->tpb, &a, &rk->cache,
                             reason, cap);
    if (!rc)
        rc = rank_layout(srv, rk, reason, cap);
    if (rc || srv->opts.role == KVB_PD_ROLE_BOTH)
        return rc;
    kvb_kv_role_t kr =
        srv->opts.role == KVB_PD_ROLE_PREFILL ? KVB_KV_ROLE_PREFILL : KVB_KV_ROLE_DECODE;
    return kvb_kv_agent_create(rk->engine, &rk->layout, kr, &rk->agent, reason, cap);
}

static void rank_fini(kvb__srv_rank_t *rk)
{
    kvb_kv_agent_destroy(rk->agent);
    kvb_pd_cache_destroy(rk->cache);
    kvb_engine_destroy(rk->engine);
    free(rk->slots);
}

/* ---- HTTP -------------------------------------------------------------------------------------
 */

enum MHD_Result kvb__srv_http_fail(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                   unsigned status, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvb__srv_metric_failure(srv);
    if (status >= 500)
        KVB_WARN("answering %u: %s", status, msg);
    return kvb__http_error(conn, status, msg);
}

enum MHD_Result kvb__srv_http_refuse(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                     const kvb__srv_refusal_t *ref)
{
    kvb__srv_metric_failure(srv);
    if (ref->status >= 500)
        KVB_WARN("answering %u (%s): %s", ref->status, ref->reason, ref->msg);
    return kvb__http_error_ex(conn, ref->status, ref->msg, ref->reason,
                              ref->status == 503 ? ref->retry_after_s : 0);
}

static enum MHD_Result route_post(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                  const char *url, json_t *body)
{
    if (!strcmp(url, "/v1/completions"))
        return kvb__srv_completions(srv, conn, body);
    if (!strcmp(url, "/pd/prefill"))
        return kvb__srv_prefill(srv, conn, body);
    if (!strcmp(url, "/pd/decode"))
        return kvb__srv_decode(srv, conn, body);
    if (!strcmp(url, "/pd/reserve"))
        return kvb__srv_reserve(srv, conn, body);
    return kvb__srv_abort(srv, conn, body);
}

static bool is_post_path(const char *url)
{
    return !strcmp(url, "/v1/completions") || !strcmp(url, "/pd/prefill") ||
           !strcmp(url, "/pd/decode") || !strcmp(url, "/pd/reserve") || !strcmp(url, "/pd/abort");
}

/* A refused /pd/ call is logged, one line a second at most: a flood of unsigned calls must not
 * flood the log as well. The next line says how many went unlogged. */
static void log_refused(kvb_pd_server_t *srv, const char *method, const char *url,
                        const char *reason)
{
    unsigned long long now = kvb__now_ns(), last = atomic_load(&srv->refused_logged_ns);
    if ((last != 0 && now - last < 1000000000ull) ||
        !atomic_compare_exchange_strong(&srv->refused_logged_ns, &last, now)) {
        atomic_fetch_add(&srv->refused_unlogged, 1);
        return;
    }
    unsigned quiet = atomic_exchange(&srv->refused_unlogged, 0);
    if (quiet)
        KVB_WARN("refused %s %s: %s (and %u more refused calls since the last such line)", method,
                 url, reason, quiet);
    else
        KVB_WARN("refused %s %s: %s", method, url, reason);
}

/* Who may call: /pd/ endpoints only the cluster (a call signed with its secret, fresh and never
 * seen before), /v1/completions a holder of an API key when keys are set, the rest anyone. */
static bool refuse_caller(kvb_pd_server_t *srv, struct MHD_Connection *conn, const char *method,
                          const char *url, const char *body, size_t len, enum MHD_Result *ret)
{
    const char *reason = NULL;
    if (!strncmp(url, "/pd/", 4)) {
        const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, KVB_PD_AUTH_HEADER);
        if (!kvb__pd_auth_check(srv->auth, method, url, h, body, len, &reason))
            return false;
        kvb__srv_metric_failure(srv);
        log_refused(srv, method, url, reason);
        *ret = kvb__http_error_ex(conn, 401,
                                  "internal endpoints take only calls signed with the cluster "
                                  "secret (" KVB_PD_AUTH_HEADER ")",
                                  reason, 0);
        return true;
    }
    if (!strcmp(url, "/v1/completions")) {
        const char *h =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (!kvb__pd_auth_api_key(srv->auth, h))
            return false;
        kvb__srv_metric_failure(srv);
        *ret = kvb__http_error_ex(conn, 401, "a valid API key is required (Authorization: Bearer)",
                                  "invalid_api_key", 0);
        return true;
    }
    return false;
}

enum MHD_Result kvb__srv_route(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                               const char *method, const char *url, const char *body, size_t len)
{
    enum MHD_Result ret;
    if (refuse_caller(srv, conn, method, url, body, len, &ret))
        return ret;
    bool get = !strcmp(method, "GET");
    bool get_path = !strcmp(url, "/health") || !strcmp(url, "/metrics") || !strcmp(url, "/pd/info");
    if (get_path && get)
        return !strcmp(url, "/health")    ? kvb__srv_health(srv, conn)
               : !strcmp(url, "/metrics") ? kvb__srv_metrics(srv, conn)
                                          : kvb__srv_info(srv, conn);
    if (!get_path && !is_post_path(url))
        return kvb__srv_http_fail(srv, conn, 404, "no such endpoint: %s", url);
    if (get_path || strcmp(method, "POST"))
        return kvb__srv_http_fail(srv, conn, 405, "%s does not take %s", url, method);
    json_error_t err;
    json_t *j = json_loadb(body, len, JSON_REJECT_DUPLICATES, &err);
    if (!j)
        return kvb__srv_http_fail(srv, conn, 400, "malformed JSON body: %s (line %d, column %d)",
                                  err.text, err.line, err.column);
    ret = json_is_object(j) ? route_post(srv, conn, url, j)
                            : kvb__srv_http_fail(srv, conn, 400, "the body must be a JSON object");
    json_decref(j);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    kvb_pd_server_t *srv = cls;
    kvb__http_body_t *b = *con_cls;
    (void)version;
    if (!b) { /* headers only: refuse an announced oversize body before it is sent */
        if (!(b = kvb__http_body_start(conn, KVB_PD_SERVER_BODY_MAX)))
            return MHD_NO;
        *con_cls = b;
        if (b->too_large)
            return kvb__srv_http_fail(srv, conn, 413, "request body over %u bytes",
                                      KVB_PD_SERVER_BODY_MAX);
        return MHD_YES;
    }
    if (*upload_data_size) {
        kvb__http_body_feed(b, upload_data, *upload_data_size, KVB_PD_SERVER_BODY_MAX);
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (b->too_large)
        return kvb__srv_http_fail(srv, conn, 413, "request body over %u bytes",
                                  KVB_PD_SERVER_BODY_MAX);
    if (b->nomem)
        return kvb__srv_http_fail(srv, conn, 500, "out of memory reading the body");
    return kvb__srv_route(srv, conn, method, url, b->data ? b->data : "", b->len);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)conn, (void)toe;
    kvb__http_body_t *b = *con_cls;
    if (b) {
        kvb__http_body_free(b);
        free(b);
        *con_cls = NULL;
    }
}

static int http_start(kvb_pd_server_t *srv, char *reason, size_t cap)
{
    struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_PASSIVE, .ai_socktype = SOCK_STREAM};
    struct addrinfo *ai = NULL;
    char port[8];
    snprintf(port, sizeof port, "%u", srv->opts.port);
    int gai = getaddrinfo(srv->addr, port, &hints, &ai);
    if (gai)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "bad bind address %s: %s", srv->addr,
                         gai_strerror(gai));
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    /* Thread per connection: handlers block on forward passes and KV waits (all bounded). */
    srv->httpd = MHD_start_daemon(flags, srv->opts.port, NULL, NULL, on_request, srv,
                                  MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
                                  MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_CONNECTION_TIMEOUT,
                                  (unsigned)srv->opts.idle_timeout_s, MHD_OPTION_CONNECTION_LIMIT,
                                  (unsigned)srv->opts.max_connections, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!srv->httpd)
        return kvb__fail(reason, cap, KVB_ERR_ADDR_IN_USE, "cannot serve HTTP on %s:%u", srv->addr,
                         srv->opts.port);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(srv->httpd, MHD_DAEMON_INFO_BIND_PORT);
    srv->port = info ? info->port : srv->opts.port;
    return KVB_OK;
}

/* ---- lifetime ---------------------------------------------------------------------------------
 */

static int check_opts(const kvb_pd_server_opts_t *o, char *reason, size_t cap)
{
    if (!o || !o->model || !*o->model)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "no model given");
    if (o->role < KVB_PD_ROLE_PREFILL || o->role > KVB_PD_ROLE_BOTH)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "bad role");
    if (o->kv_mode != KVB_PD_KV_PULL && o->kv_mode != KVB_PD_KV_PUSH)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "bad kv mode");
    if (o->tp < 1 || o->tp > KVB_PD_SERVER_TP_MAX)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "tp must be 1..%u",
                         KVB_PD_SERVER_TP_MAX);
    if (o->blocks > UINT32_MAX)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "too many blocks");
    if (o->lease_ms && o->lease_ms < KVB_PD_SERVER_LEASE_MIN_MS)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG,
                         "lease_ms must be at least %u (a decode's reads end 500 ms before the "
                         "lease does)",
                         KVB_PD_SERVER_LEASE_MIN_MS);
    if (o->bind && strlen(o->bind) >= 64)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "bind address too long");
    if (strlen(o->model) >= 4096)
        return kvb__fail(reason, cap, KVB_ERR_INVALID_ARG, "model path too long");
    return kvb__srv_reg_check(o, reason, cap);
}

static void copy_opts(kvb_pd_server_t *srv, const kvb_pd_server_opts_t *o)
{
    srv->opts = *o;
    snprintf(srv->addr, sizeof srv->addr, "%s", o->bind ? o->bind : "127.0.0.1");
    snprintf(srv->model_spec, sizeof srv->model_spec, "%s", o->model);
    srv->opts.model = srv->model_spec;
    srv->opts.bind = srv->addr;
    snprintf(srv->metadata, sizeof srv->metadata, "%s", o->metadata ? o->metadata : "");
    snprintf(srv->cluster, sizeof srv->cluster, "%s", o->cluster ? o->cluster : KVB_META_CLUSTER);
    srv->opts.metadata = srv->metadata;
    srv->opts.cluster = srv->cluster;
    if (!srv->opts.metadata_ttl_ms)
        srv->opts.metadata_ttl_ms = KVB_META_TTL_MS;
    if (!srv->opts.blocks)
        srv->opts.blocks = KVB_PD_SERVER_BLOCKS;
    if (!srv->opts.lease_ms)
        srv->opts.lease_ms = KVB_PD_SERVER_LEASE_MS;
    if (!srv->opts.max_queue)
        srv->opts.max_queue = KVB_PD_SERVER_MAX_QUEUE;
    if (!srv->opts.max_connections)
        srv->opts.max_connections = KVB_PD_SERVER_MAX_CONNS;
    if (!srv->opts.idle_timeout_s)
        srv->opts.idle_timeout_s = KVB_PD_SERVER_IDLE_S;
    srv->max_queue = srv->opts.max_queue;
    srv->tp = o->tp;
    srv->tpb = KVB_PD_TOKENS_PER_BLOCK;
    srv->total_blocks = srv->opts.blocks;
    /* Test fault hook: a push prefill stalls after pushing this layer (to be killed there). */
    const char *stall = getenv("KVB_PD_FAULT_STALL_LAYER");
    srv->stall_layer = stall && *stall ? strtoull(stall, NULL, 10) : UINT64_MAX;
}

static int start_all(kvb_pd_server_t *srv, char *reason, size_t cap)
{
    int rc = kvb__pd_auth_create(srv->opts.api_key_file, &srv->auth, reason, cap);
    srv->opts.api_key_file = NULL; /* the caller's string, read now */
    if (!rc)
        rc = kvb__srv_reg_open(srv, reason, cap);
    if (!rc)
        rc = kvb_pd_model_open(srv->opts.model, srv->opts.seed, &srv->model, reason, cap);
    if (!rc)
        rc = kvb_pd_blocks_create(srv->total_blocks, &srv->pool);
    srv->ranks = rc ? NULL : calloc(srv->tp, sizeof *srv->ranks);
    srv->caches = rc ? NULL : calloc(srv->tp, sizeof *srv->caches);
    if (!rc && (!srv->ranks || !srv->caches))
        rc = kvb__fail(reason, cap, KVB_ERR_NOMEM, "out of memory");
    for (uint32_t r = 0; !rc && r < srv->tp; r++) {
        rc = rank_init(srv, r, reason, cap);
        srv->caches[r] = srv->ranks[r].cache;
    }
    if (!rc && srv->opts.role != KVB_PD_ROLE_BOTH) {
        rc = pthread_create(&srv->reaper, NULL, kvb__srv_reaper_main, srv) ? KVB_ERR_SYSTEM : 0;
        srv->reaper_started = !rc;
        if (rc)
            kvb__fail(reason, cap, rc, "cannot start the lease thread");
    }
    if (!rc)
        rc = http_start(srv, reason, cap);
    if (!rc) /* only now: a proxy must never find an instance that cannot answer yet */
        rc = kvb__srv_reg_publish(srv, reason, cap);
    return rc;
}

int kvb_pd_server_create(const kvb_pd_server_opts_t *opts, kvb_pd_server_t **out, char *reason,
                         size_t reason_cap)
{
    int rc = check_opts(opts, reason, reason_cap);
    if (rc)
        return rc;
    kvb_pd_server_t *srv = calloc(1, sizeof *srv);
    if (!srv)
        return kvb__fail(reason, reason_cap, KVB_ERR_NOMEM, "out of memory");
    copy_opts(srv, opts);
    pthread_mutex_init(&srv->fwd_mu, NULL);
    pthread_mutex_init(&srv->links_mu, NULL);
    pthread_mutex_init(&srv->mu, NULL);
    pthread_mutex_init(&srv->bat_mu, NULL);
    pthread_mutex_init(&srv->reg_mu, NULL);
    pthread_cond_init(&srv->bat_cv, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&srv->cv, &ca);
    pthread_cond_init(&srv->adm_cv, &ca);
    pthread_condattr_destroy(&ca);
    rc = start_all(srv, reason, reason_cap);
    if (rc) {
        kvb_pd_server_destroy(srv);
        return rc;
    }
    kvb__reason_clear(reason, reason_cap);
    *out = srv;
    return KVB_OK;
}

uint16_t kvb_pd_server_port(const kvb_pd_server_t *srv)
{
    return srv->port;
}

const char *kvb_pd_server_addr(const kvb_pd_server_t *srv)
{
    return srv->addr;
}

void kvb_pd_server_destroy(kvb_pd_server_t *srv)
{
    if (!srv)
        return;
    kvb__srv_reg_close(srv);  /* withdrawn first: proxies stop routing here before HTTP stops */
    kvb__srv_admit_stop(srv); /* queued requests answer 503 now rather than at their deadline */
    if (srv->httpd)           /* joins the connection threads: no handler runs after this */
        MHD_stop_daemon(srv->httpd);
    pthread_mutex_lock(&srv->mu);
    srv->stop = true;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
    if (srv->reaper_started)
        pthread_join(srv->reaper, NULL);
    kvb__srv_ents_clear(srv);
    kvb__srv_links_free(srv); /* links before agents: an agent must have none left */
    for (uint32_t r = 0; srv->ranks && r < srv->tp; r++)
        rank_fini(&srv->ranks[r]);
    free(srv->ranks);
    free(srv->caches);
    kvb_pd_blocks_destroy(srv->pool);
    kvb_pd_model_free(srv->model);
    kvb__pd_auth_free(srv->auth);
    pthread_cond_destroy(&srv->cv);
    pthread_cond_destroy(&srv->adm_cv);
    pthread_mutex_destroy(&srv->mu);
    pthread_mutex_destroy(&srv->links_mu);
    pthread_mutex_destroy(&srv->fwd_mu);
    pthread_cond_destroy(&srv->bat_cv);
    pthread_mutex_destroy(&srv->bat_mu);
    pthread_mutex_destroy(&srv->reg_mu);
    free(srv);
}
