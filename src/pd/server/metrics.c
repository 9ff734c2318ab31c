/* SPDX-License-Identifier: Apache-2.0 */
/* An instance's counters and latency histograms, served as Prometheus text on /metrics, and its
 * state on /health (free blocks, links and the guard's verdicts). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/server/internal.h"

/* Upper bounds of the histogram buckets in seconds; the last bucket is +Inf. */
static const double bounds[KVB__SRV_HIST_N - 1] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                   0.25,  0.5,    1.0,   2.5,  5.0,   10.0};

void kvb__srv_hist_add(kvb__srv_hist_t *h, double v)
{
    size_t i = 0;
    while (i < KVB__SRV_HIST_N - 1 && v > bounds[i])
        i++;
    h->buckets[i]++;
    h->count++;
    h->sum += v;
}

void kvb__srv_metric_request(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    srv->m_requests++;
    pthread_mutex_unlock(&srv->mu);
}

void kvb__srv_metric_failure(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    srv->m_failures++;
    pthread_mutex_unlock(&srv->mu);
}

void kvb__srv_metric_timing(kvb_pd_server_t *srv, double ttft_s, double tpot_s, bool has_tpot)
{
    pthread_mutex_lock(&srv->mu);
    kvb__srv_hist_add(&srv->m_ttft, ttft_s);
    if (has_tpot)
        kvb__srv_hist_add(&srv->m_tpot, tpot_s);
    pthread_mutex_unlock(&srv->mu);
}

void kvb__srv_metric_kv(kvb_pd_server_t *srv, uint64_t bytes, double seconds)
{
    pthread_mutex_lock(&srv->mu);
    srv->m_kv_bytes += bytes;
    srv->m_kv_seconds += seconds;
    pthread_mutex_unlock(&srv->mu);
}

/* Appends to a growing buffer; a failed allocation leaves it NULL (answered as 500). */
typedef struct {
    char *s;
    size_t len, cap;
} text_t;

static void put(text_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text_t *t, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (!t->s || n < 0)
        return;
    size_t k = (size_t)n < sizeof line ? (size_t)n : sizeof line - 1;
    if (t->len + k + 1 > t->cap) {
        char *p = realloc(t->s, (t->cap = (t->len + k + 1) * 2));
        if (!p)
            free(t->s);
        t->s = p;
        if (!p)
            return;
    }
    memcpy(t->s + t->len, line, k + 1);
    t->len += k;
}

static void put_hist(text_t *t, const char *name, const char *help, const char *role,
                     const kvb__srv_hist_t *h)
{
    put(t, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t i = 0; i < KVB__SRV_HIST_N; i++) {
        cum += h->buckets[i];
        if (i < KVB__SRV_HIST_N - 1)
            put(t, "%s_bucket{role=\"%s\",le=\"%g\"} %llu\n", name, role, bounds[i],
                (unsigned long long)cum);
        else
            put(t, "%s_bucket{role=\"%s\",le=\"+Inf\"} %llu\n", name, role,
                (unsigned long long)cum);
    }
    put(t, "%s_sum{role=\"%s\"} %.9f\n%s_count{role=\"%s\"} %llu\n", name, role, h->sum, name, role,
        (unsigned long long)h->count);
}

static void put_counter(text_t *t, const char *name, const char *help, const char *role, double v)
{
    put(t, "# HELP %s %s\n# TYPE %s counter\n%s{role=\"%s\"} %.17g\n", name, help, name, name, role,
        v);
}

static void put_gauge(text_t *t, const char *name, const char *help, const char *role, double v)
{
    put(t, "# HELP %s %s\n# TYPE %s gauge\n%s{role=\"%s\"} %.17g\n", name, help, name, name, role,
        v);
}

enum MHD_Result kvb__srv_metrics(kvb_pd_server_t *srv, struct MHD_Connection *conn)
{
    const char *role = kvb_pd_role_name(srv->opts.role);
    text_t t = {.s = malloc(4096), .cap = 4096};
    if (t.s)
        t.s[0] = '\0';
    pthread_mutex_lock(&srv->mu);
    put_counter(&t, "kvbridge_requests_total", "Generation requests received.", role,
                (double)srv->m_requests);
    put_counter(&t, "kvbridge_request_failures_total", "Requests answered with an error.", role,
                (double)srv->m_failures);
    put_hist(&t, "kvbridge_ttft_seconds", "Time to first token.", role, &srv->m_ttft);
    put_hist(&t, "kvbridge_tpot_seconds", "Time per output token after the first.", role,
             &srv->m_tpot);
    put_counter(&t, "kvbridge_kv_bytes_total", "KV-cache bytes moved.", role,
                (double)srv->m_kv_bytes);
    put_counter(&t, "kvbridge_kv_transfer_seconds_total", "Time spent moving KV caches.", role,
                srv->m_kv_seconds);
    put_gauge(&t, "kvbridge_queue_depth", "Requests waiting for KV blocks.", role,
              (double)srv->q_len);
    put_hist(&t, "kvbridge_queue_wait_seconds", "Time admitted requests waited for KV blocks.",
             role, &srv->m_wait);
    put(&t,
        "# HELP kvbridge_queue_rejected_total Requests refused by admission.\n"
        "# TYPE kvbridge_queue_rejected_total counter\n"
        "kvbridge_queue_rejected_total{role=\"%s\",reason=\"queue_full\"} %llu\n"
        "kvbridge_queue_rejected_total{role=\"%s\",reason=\"deadline\"} %llu\n",
        role, (unsigned long long)srv->m_rej_full, role, (unsigned long long)srv->m_rej_deadline);
    pthread_mutex_unlock(&srv->mu);
    uint64_t n[KVB__SRV_ENT_KINDS];
    kvb__srv_ents_count(srv, n);
    put_gauge(&t, "kvbridge_kv_free_blocks", "KV blocks free.", role,
              (double)kvb_pd_blocks_available(srv->pool));
    put_gauge(&t, "kvbridge_kv_total_blocks", "KV blocks in all.", role, (double)srv->total_blocks);
    put_gauge(&t, "kvbridge_leases", "Pull leases held (prefill).", role,
              (double)n[KVB__SRV_ENT_LEASE]);
    put_gauge(&t, "kvbridge_reservations", "Push reservations held (decode).", role,
              (double)n[KVB__SRV_ENT_RESERVED]);
    put_gauge(&t, "kvbridge_settling",
              "Requests whose failed transfers may still place bytes: their blocks are kept "
              "out of use.",
              role, (double)n[KVB__SRV_ENT_SETTLE]);
    if (!t.s)
        return kvb__http_error(conn, 500, "out of memory");
    enum MHD_Result ret =
        kvb__http_text(conn, 200, "text/plain; version=0.0.4; charset=utf-8", t.s, t.len);
    free(t.s);
    return ret;
}

enum MHD_Result kvb__srv_health(kvb_pd_server_t *srv, struct MHD_Connection *conn)
{
    json_t *links = json_array();
    bool degraded = false;
    if (links && srv->opts.role != KVB_PD_ROLE_BOTH)
        kvb__srv_links_health(srv, links, &degraded);
    json_t *o =
        json_pack("{s:s,s:s,s:s,s:i,s:s,s:I,s:I,s:o*}", "status", degraded ? "degraded" : "ok",
                  "role", kvb_pd_role_name(srv->opts.role), "model", kvb_pd_model_id(srv->model),
                  "tp", (int)srv->tp, "kv_mode", kvb_pd_kv_mode_name(srv->opts.kv_mode),
                  "free_blocks", (json_int_t)kvb_pd_blocks_available(srv->pool), "total_blocks",
                  (json_int_t)srv->total_blocks, "links", links);
    uint64_t n[KVB__SRV_ENT_KINDS];
    kvb__srv_ents_count(srv, n);
    if (o) {
        json_object_set_new(o, "queue", kvb__srv_admit_health(srv));
        json_object_set_new(o, "batching", kvb__srv_batch_health(srv));
        json_object_set_new(o, "active", json_integer((json_int_t)n[KVB__SRV_ENT_ACTIVE]));
        json_object_set_new(o, "leases", json_integer((json_int_t)n[KVB__SRV_ENT_LEASE]));
        json_object_set_new(o, "reservations", json_integer((json_int_t)n[KVB__SRV_ENT_RESERVED]));
        json_object_set_new(o, "draining", json_integer((json_int_t)n[KVB__SRV_ENT_DRAIN]));
        json_object_set_new(o, "settling", json_integer((json_int_t)n[KVB__SRV_ENT_SETTLE]));
    }
    kvb__srv_reg_health(srv, o);
    return kvb__http_json(conn, 200, o);
}
