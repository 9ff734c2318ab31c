/* SPDX-License-Identifier: Apache-2.0 */
/* The PD proxy's HTTP front end (libmicrohttpd, one thread per connection): routes, request bodies,
 * JSON errors, /health and /metrics, and the proxy's lifetime. The flow itself is in flow.c, the
 * streaming relay in stream.c, the instance sets and their discovery in discover.c. */
#include <arpa/inet.h>
#include <jansson.h>
#include <stdarg.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvbridge/status.h"
#include "pd/http.h"
#include "pd/proxy/internal.h"

#define HEALTH_TIMEOUT_MS 1000u

/* ---- Responses ------------------------------------------------------------------------------- */

static enum MHD_Result respond(struct MHD_Connection *c, unsigned status, const char *type,
                               const char *text)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    if (status == 503) /* every 503 of ours is worth a retry: busy instances, none yet */
        MHD_add_response_header(r, "Retry-After", "1");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result respond_json(struct MHD_Connection *c, unsigned status, json_t *j)
{
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    enum MHD_Result ret = text ? respond(c, status, "application/json", text) : MHD_NO;
    free(text);
    return ret;
}

static enum MHD_Result respond_err(struct MHD_Connection *c, const kvb__pxy_err_t *e)
{
    json_t *j = json_pack("{s:{s:s, s:s, s:s*}}", "error", "message", e->msg, "type", e->type,
                          "reason", e->reason[0] ? e->reason : NULL);
    enum MHD_Result ret = respond_json(c, e->status, j);
    json_decref(j);
    return ret;
}

static enum MHD_Result respond_simple(struct MHD_Connection *c, unsigned status, const char *type,
                                      const char *msg)
{
    kvb__pxy_err_t e = {.status = status};
    kvb__pxy_fmt(e.type, sizeof e.type, "%s", type);
    kvb__pxy_fmt(e.msg, sizeof e.msg, "%s", msg);
    return respond_err(c, &e);
}

/* ---- POST /v1/completions -------------------------------------------------------------------- */

static enum MHD_Result completions(kvb_pd_proxy_t *px, struct MHD_Connection *c, const char *body,
                                   size_t len)
{
    kvb__pxy_creq_t rq;
    kvb__pxy_err_t err = {0};
    kvb__pxy_job_t job;
    if (kvb__pxy_parse(body, len, px->timeout_ms, &rq, &err))
        return respond_err(c, &err); /* a client's mistake: not an upstream failure */
    enum MHD_Result ret;
    /* A decode instance that could not take the request before producing anything (busy: 503,
     * or gone) hands it to another decode, with a new prefill for that one: the prefill's KV is
     * granted to the decode it was made for. */
    char busy[KVB__PXY_DECODE_TRIES][sizeof err.busy_decode];
    const char *avoid[KVB__PXY_DECODE_TRIES];
    size_t nbusy = 0;
    bool relearned = false;
    for (;;) {
        struct MHD_Response *resp = NULL;
        json_t *ans = NULL;
        int rc = kvb__pxy_prepare(px, &rq, &job, &err, avoid, nbusy);
        if (rc) {
            kvb__pxy_job_clear(&job);
        } else if (rq.stream) {
            rc = kvb__pxy_stream(&job, &resp, &err); /* takes the job over */
        } else {
            rc = kvb__pxy_decode_whole(&job, &ans, &err);
            kvb__pxy_job_clear(&job);
        }
        if (rc && err.stale_pair && !relearned) { /* the pair's infos are fetched anew */
            relearned = true;
            memset(&err, 0, sizeof err);
            continue;
        }
        if (rc && kvb__pxy_decode_again(px, &rq, &err, nbusy)) {
            kvb__pxy_fmt(busy[nbusy], sizeof busy[nbusy], "%s", err.busy_decode);
            avoid[nbusy] = busy[nbusy];
            nbusy++;
            memset(&err, 0, sizeof err);
            continue;
        }
        if (resp) { /* a stream: the relay records it when it ends */
            ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
            MHD_destroy_response(resp);
        } else {
            kvb__pxy_record(px, rc ? NULL : ans, rq.stream);
            ret = rc ? respond_err(c, &err) : respond_json(c, 200, ans);
        }
        json_decref(ans);
        break;
    }
    json_decref(rq.root);
    return ret;
}

/* ---- GET /health ----------------------------------------------------------------------------- */

/* One instance's live health, and whether it counts as ok. */
static json_t *instance_health(const kvb__upstream_t *u, bool *ok)
{
    char url[300], err[256], *body = NULL;
    kvb__pxy_fmt(url, sizeof url, "%s/health", u->url);
    long st = kvb_pd_http(url, NULL, HEALTH_TIMEOUT_MS, &body, err, sizeof err);
    json_t *h = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    const char *status = json_string_value(json_object_get(h, "status"));
    bool good = status && !strcmp(status, "ok");
    *ok = *ok && good;
    json_t *e =
        json_pack("{s:s, s:s, s:s, s:b}", "url", u->url, "role", u->prefill ? "prefill" : "decode",
                  "source", u->discovered ? "discovered" : "static", "reachable", h != NULL);
    if (e && u->discovered)
        json_object_set_new(e, "key", json_string(u->key));
    if (e && h)
        json_object_set(e, "health", h);
    else if (e)
        json_object_set_new(e, "error", json_string(st ? "bad /health answer" : err));
    json_decref(h);
    return e;
}

static enum MHD_Result health(kvb_pd_proxy_t *px, struct MHD_Connection *c)
{
    size_t n = 0, np = 0;
    kvb__upstream_t **v = kvb__pxy_snapshot(px, &n);
    /* Both halves present, and the store answered on the last round (when there is one). */
    bool ok = v != NULL;
    json_t *insts = json_array();
    for (size_t i = 0; i < n; i++) {
        np += v[i]->prefill;
        json_array_append_new(insts, instance_health(v[i], &ok));
    }
    ok = ok && np > 0 && n > np && (!px->meta || atomic_load(&px->store_ok));
    kvb__pxy_snapshot_free(v, n);
    const char *mode = px->kv_mode == KVB_PD_KV_PUSH   ? "push"
                       : px->kv_mode == KVB_PD_KV_PULL ? "pull"
                                                       : "auto";
    json_t *j =
        json_pack("{s:s, s:s, s:s, s:o, s:o*}", "status", ok ? "ok" : "degraded", "role", "proxy",
                  "kv_mode", mode, "instances", insts, "discovery", kvb__pxy_discovery_health(px));
    enum MHD_Result ret = respond_json(c, 200, j);
    json_decref(j);
    return ret;
}

/* ---- GET /metrics ---------------------------------------------------------------------------- */

typedef struct {
    char *buf;
    size_t len, cap;
} text_t;

static void put(text_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text_t *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = t->buf ? vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap) : -1;
    va_end(ap);
    if (n < 0 || (size_t)n >= t->cap - t->len) {
        t->len = t->cap; /* the page is sized for the worst case; never reached */
        return;
    }
    t->len += (size_t)n;
}

static void put_hist(text_t *t, const char *name, const char *help, const kvb__hist_t *h)
{
    put(t, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < KVB__PXY_BUCKETS; i++)
        put(t, "%s_bucket{role=\"proxy\",le=\"%g\"} %llu\n", name, kvb__pxy_bucket_bound(i),
            (unsigned long long)h->buckets[i]);
    put(t, "%s_bucket{role=\"proxy\",le=\"+Inf\"} %llu\n", name, (unsigned long long)h->count);
    put(t, "%s_sum{role=\"proxy\"} %.6f\n%s_count{role=\"proxy\"} %llu\n", name, h->sum, name,
        (unsigned long long)h->count);
}

static enum MHD_Result metrics(kvb_pd_proxy_t *px, struct MHD_Connection *c)
{
    text_t t = {.cap = 8192};
    t.buf = malloc(t.cap);
    kvb__pxy_metrics_t m;
    pthread_mutex_lock(&px->m.mu);
    m = px->m;
    pthread_mutex_unlock(&px->m.mu);
    put(&t,
        "# HELP kvbridge_requests_total Completions requests answered.\n"
        "# TYPE kvbridge_requests_total counter\n"
        "kvbridge_requests_total{role=\"proxy\"} %llu\n"
        "# HELP kvbridge_streams_total Requests answered as server-sent events.\n"
        "# TYPE kvbridge_streams_total counter\n"
        "kvbridge_streams_total{role=\"proxy\"} %llu\n"
        "# TYPE kvbridge_request_failures_total counter\n"
        "kvbridge_request_failures_total{role=\"proxy\"} %llu\n",
        (unsigned long long)m.requests, (unsigned long long)m.streams,
        (unsigned long long)m.failures);
    put_hist(&t, "kvbridge_ttft_seconds", "Time to first token, seen by the proxy.", &m.ttft);
    put_hist(&t, "kvbridge_tpot_seconds", "Time per output token after the first.", &m.tpot);
    put(&t,
        "# TYPE kvbridge_kv_bytes_total counter\nkvbridge_kv_bytes_total{role=\"proxy\"} %llu\n"
        "# TYPE kvbridge_kv_transfer_seconds_total counter\n"
        "kvbridge_kv_transfer_seconds_total{role=\"proxy\"} %.6f\n",
        (unsigned long long)m.kv_bytes, m.kv_seconds);
    enum MHD_Result ret = MHD_NO;
    if (t.buf && t.len < t.cap)
        ret = respond(c, 200, "text/plain; version=0.0.4", t.buf);
    free(t.buf);
    return ret;
}

/* ---- Routing --------------------------------------------------------------------------------- */

static enum MHD_Result route(kvb_pd_proxy_t *px, struct MHD_Connection *c, const char *url,
                             const char *method, kvb__http_body_t *b)
{
    bool get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/v1/completions")) {
        const char *authz = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
        if (kvb__pd_auth_api_key(px->auth, authz)) {
            kvb__pxy_err_t e = {.status = 401};
            kvb__pxy_fmt(e.type, sizeof e.type, "authentication_error");
            kvb__pxy_fmt(e.reason, sizeof e.reason, "invalid_api_key");
            kvb__pxy_fmt(e.msg, sizeof e.msg,
                         "a valid API key is required (Authorization: Bearer)");
            return respond_err(c, &e);
        }
        if (!post)
            return respond_simple(c, 405, "invalid_request_error", "use POST");
        if (b->too_large)
            return respond_simple(c, 413, "invalid_request_error", "request body too large");
        if (b->nomem)
            return respond_simple(c, 500, "internal_error", "out of memory reading the body");
        return completions(px, c, b->data ? b->data : "", b->len);
    }
    if (!strcmp(url, "/health") || !strcmp(url, "/metrics")) {
        if (!get)
            return respond_simple(c, 405, "invalid_request_error", "use GET");
        return url[1] == 'h' ? health(px, c) : metrics(px, c);
    }
    return respond_simple(c, 404, "not_found", "no such endpoint");
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *data,
                                  size_t *data_len, void **con_cls)
{
    (void)version;
    if (!*con_cls) { /* headers only: refuse an announced oversize body before it is sent */
        kvb__http_body_t *b = kvb__http_body_start(c, KVB_PD_PROXY_BODY_MAX);
        if (!b)
            return MHD_NO;
        *con_cls = b;
        if (b->too_large)
            return respond_simple(c, 413, "invalid_request_error", "request body too large");
        return MHD_YES;
    }
    kvb__http_body_t *b = *con_cls;
    if (*data_len) {
        kvb__http_body_feed(b, data, *data_len, KVB_PD_PROXY_BODY_MAX);
        *data_len = 0;
        return MHD_YES;
    }
    return route(cls, c, url, method, b);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode why)
{
    (void)cls, (void)c, (void)why;
    kvb__http_body_t *b = *con_cls;
    if (b) {
        kvb__http_body_free(b);
        free(b);
    }
    *con_cls = NULL;
}

/* ---- Lifetime -------------------------------------------------------------------------------- */

static int listen_on(kvb_pd_proxy_t *px, const kvb_pd_proxy_opts_t *o, char *reason, size_t cap)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(o->port)};
    if (inet_pton(AF_INET, px->bind, &sa.sin_addr) != 1) {
        kvb__pxy_fmt(reason, cap, "bad bind address '%s' (want IPv4)", px->bind);
        return KVB_ERR_INVALID_ARG;
    }
    /* Thread per connection: a streamed answer's content reader may block on the relay pipe. */
    px->mhd = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ERROR_LOG, 0,
        NULL, NULL, on_request, px, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, px, MHD_OPTION_CONNECTION_TIMEOUT,
        o->idle_timeout_s ? o->idle_timeout_s : (unsigned)(px->timeout_ms / 1000 + 60),
        MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(o->max_connections ? o->max_connections : KVB_PD_PROXY_MAX_CONNS),
        MHD_OPTION_END);
    if (!px->mhd) {
        kvb__pxy_fmt(reason, cap, "cannot listen on %s:%u", px->bind, (unsigned)o->port);
        return KVB_ERR_SYSTEM;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(px->mhd, MHD_DAEMON_INFO_BIND_PORT);
    px->port = di ? di->port : o->port;
    return KVB_OK;
}

static kvb_pd_proxy_t *proxy_new(const kvb_pd_proxy_opts_t *o)
{
    kvb_pd_proxy_t *px = calloc(1, sizeof *px);
    if (!px)
        return NULL;
    px->kv_mode = o->kv_mode;
    px->timeout_ms = o->timeout_ms ? o->timeout_ms : KVB_PD_PROXY_TIMEOUT_MS;
    kvb__pxy_fmt(px->bind, sizeof px->bind, "%s", o->bind ? o->bind : "127.0.0.1");
    px->boot = (uint32_t)(kvb__now_ns() ^ ((uint64_t)getpid() << 16) ^ (uint64_t)time(NULL));
    atomic_init(&px->stopping, false);
    atomic_init(&px->store_ok, false);
    atomic_init(&px->rounds, 0);
    pthread_mutex_init(&px->wk_mu, NULL);
    pthread_cond_init(&px->wk_cv, NULL);
    pthread_mutex_init(&px->m.mu, NULL);
    pthread_mutex_init(&px->up_mu, NULL);
    pthread_mutex_init(&px->disc_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the rounds' timed waits use it */
    pthread_cond_init(&px->disc_cv, &ca);
    pthread_condattr_destroy(&ca);
    return px;
}

int kvb_pd_proxy_start(const kvb_pd_proxy_opts_t *opts, kvb_pd_proxy_t **out, char *reason,
                       size_t reason_cap)
{
    if (!opts || !out ||
        (opts->kv_mode != KVB_PD_KV_AUTO && opts->kv_mode != KVB_PD_KV_PULL &&
         opts->kv_mode != KVB_PD_KV_PUSH)) {
        kvb__pxy_fmt(reason, reason_cap, "invalid options");
        return KVB_ERR_INVALID_ARG;
    }
    if (kvb_pd_client_init()) {
        kvb__pxy_fmt(reason, reason_cap, "libcurl initialization failed");
        return KVB_ERR_SYSTEM;
    }
    kvb_pd_proxy_t *px = proxy_new(opts);
    if (!px)
        return KVB_ERR_NOMEM;
    int rc = kvb__pd_auth_create(opts->api_key_file, &px->auth, reason, reason_cap);
    if (!rc)
        rc = kvb__pxy_sets_init(px, opts, reason, reason_cap);
    if (!rc)
        rc = listen_on(px, opts, reason, reason_cap);
    if (!rc)
        rc = kvb__pxy_discover_start(px, reason, reason_cap);
    if (rc) {
        kvb_pd_proxy_stop(px);
        return rc;
    }
    *out = px;
    return KVB_OK;
}

uint16_t kvb_pd_proxy_port(const kvb_pd_proxy_t *px)
{
    return px->port;
}

void kvb_pd_proxy_stop(kvb_pd_proxy_t *px)
{
    if (!px)
        return;
    kvb__pxy_discover_stop(px); /* first: the sets stop changing */
    atomic_store(&px->stopping, true);
    if (px->mhd)
        MHD_stop_daemon(px->mhd); /* joins the connection threads */
    pthread_mutex_lock(&px->wk_mu);
    while (px->workers)
        pthread_cond_wait(&px->wk_cv, &px->wk_mu);
    pthread_mutex_unlock(&px->wk_mu);
    kvb__pxy_sets_free(px); /* every job is gone: these are the last references */
    kvb__pd_auth_free(px->auth);
    pthread_cond_destroy(&px->disc_cv);
    pthread_mutex_destroy(&px->disc_mu);
    pthread_mutex_destroy(&px->up_mu);
    pthread_mutex_destroy(&px->m.mu);
    pthread_cond_destroy(&px->wk_cv);
    pthread_mutex_destroy(&px->wk_mu);
    free(px);
}
