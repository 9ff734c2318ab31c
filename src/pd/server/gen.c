/* SPDX-License-Identifier: Apache-2.0 */
/* Token generation on an instance (colocated, or a decode continuing from the prefill's T0) and
 * its answers: an OpenAI-style completion, or server-sent events produced step by step from
 * libmicrohttpd's content reader, so a token goes out as soon as it is sampled. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/server/internal.h"

struct kvb__srv_gen {
    kvb_pd_server_t *srv;
    char req_id[KVB__SRV_REQ_ID_MAX + 1]; /* the entry dropped at the end; "" for none */
    char cmpl_id[96];
    kvb__srv_params_t p;
    uint32_t *prompt;
    size_t n_prompt;
    kvb_pd_seq_t seq; /* colocated: empty until the first step; decode: the prompt's KV */
    bool has_t0;
    uint32_t t0;
    uint32_t *out; /* generated tokens */
    size_t n_out;
    float *logits;
    bool done, failed;
    const char *finish;
    unsigned err_status;
    char err[512];
    uint64_t t_start, t_first, t_last, deadline;
    uint64_t kv_bytes;
    double kv_s;
    long long created;
    char *ev; /* streaming: the event being sent */
    size_t ev_len, ev_off;
    int phase; /* streaming: 0 generating, 1 last event queued */
};

/* ---- parameters -------------------------------------------------------------------------------
 */

static int get_uint(json_t *b, const char *key, uint64_t lo, uint64_t hi, uint64_t *out, char *why,
                    size_t cap)
{
    json_t *v = json_object_get(b, key);
    if (!v)
        return KVB_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || (uint64_t)json_integer_value(v) < lo ||
        (uint64_t)json_integer_value(v) > hi) {
        snprintf(why, cap, "\"%s\" must be an integer in %llu..%llu", key, (unsigned long long)lo,
                 (unsigned long long)hi);
        return KVB_ERR_INVALID_ARG;
    }
    *out = (uint64_t)json_integer_value(v);
    return KVB_OK;
}

static int get_float(json_t *b, const char *key, float *out, char *why, size_t cap)
{
    json_t *v = json_object_get(b, key);
    if (!v)
        return KVB_OK;
    double d = json_is_number(v) ? json_number_value(v) : -1.0;
    if (!isfinite(d) || d < 0.0 || d > 1e6) {
        snprintf(why, cap, "\"%s\" must be a number in [0, 1e6]", key);
        return KVB_ERR_INVALID_ARG;
    }
    *out = (float)d;
    return KVB_OK;
}

static int get_prompt(json_t *b, kvb__srv_params_t *p, bool need, char *why, size_t cap)
{
    json_t *v = json_object_get(b, "prompt");
    if ((v || need) && !json_is_string(v)) {
        snprintf(why, cap, "\"prompt\" must be a string");
        return KVB_ERR_INVALID_ARG;
    }
    p->prompt = v ? json_string_value(v) : NULL;
    p->prompt_len = v ? json_string_length(v) : 0;
    json_t *m = json_object_get(b, "model"), *s = json_object_get(b, "stream");
    if (m && !json_is_string(m)) {
        snprintf(why, cap, "\"model\" must be a string");
        return KVB_ERR_INVALID_ARG;
    }
    if (s && !json_is_boolean(s)) {
        snprintf(why, cap, "\"stream\" must be true or false");
        return KVB_ERR_INVALID_ARG;
    }
    p->stream = s && json_is_true(s);
    return KVB_OK;
}

int kvb__srv_params_parse(json_t *b, kvb__srv_params_t *p, bool need_prompt, char *why, size_t cap)
{
    uint64_t max_tokens = 16, seed = 0, timeout = KVB_PD_SERVER_TIMEOUT_MS;
    memset(p, 0, sizeof *p);
    int rc = get_prompt(b, p, need_prompt, why, cap);
    if (!rc)
        rc = get_uint(b, "max_tokens", 1, KVB_PD_SERVER_MAX_TOKENS, &max_tokens, why, cap);
    if (!rc)
        rc = get_uint(b, "seed", 0, INT64_MAX, &seed, why, cap);
    if (!rc)
        rc = get_uint(b, "timeout_ms", 1, 600000, &timeout, why, cap);
    if (!rc)
        rc = get_float(b, "temperature", &p->temperature, why, cap);
    p->max_tokens = (uint32_t)max_tokens;
    p->seed = seed;
    p->timeout_ms = (uint32_t)timeout;
    return rc;
}

int kvb__srv_tokenize(const char *prompt, size_t len, uint32_t **out, size_t *n)
{
    if (len > KVB_PD_SERVER_BODY_MAX) /* bodies are smaller; this keeps len + 1 exact */
        return KVB_ERR_TOO_LARGE;
    uint32_t *t = malloc((len + 1) * sizeof *t);
    if (!t)
        return KVB_ERR_NOMEM;
    int rc = kvb_pd_tokenize(prompt, len, true, t, len + 1, n);
    if (rc) {
        free(t);
        return rc;
    }
    *out = t;
    return KVB_OK;
}

/* ---- generation -------------------------------------------------------------------------------
 */

static void gen_free(kvb__srv_gen_t *g)
{
    kvb_pd_server_t *srv = g->srv;
    if (g->failed)
        kvb__srv_metric_failure(srv);
    else if (g->n_out) {
        double tpot =
            g->n_out > 1 ? (double)(g->t_last - g->t_first) / 1e9 / (double)(g->n_out - 1) : 0.0;
        kvb__srv_metric_timing(srv, (double)(g->t_first - g->t_start) / 1e9, tpot, g->n_out > 1);
    }
    kvb_pd_seq_release(&g->seq, srv->pool);
    kvb__srv_admit_wake_locked(srv);
    if (g->req_id[0])
        kvb__srv_ent_done(srv, g->req_id);
    free(g->prompt);
    free(g->out);
    free(g->logits);
    free(g->ev);
    free(g);
}

static int nomem(kvb__srv_refusal_t *ref)
{
    ref->status = 500;
    ref->reason = "out_of_memory";
    ref->retry_after_s = 0;
    snprintf(ref->msg, sizeof ref->msg, "out of memory");
    return KVB_ERR_NOMEM;
}

int kvb__srv_gen_create(kvb_pd_server_t *srv, const char *req_id, const kvb__srv_params_t *p,
                        uint32_t *prompt, size_t n_prompt, kvb_pd_seq_t *seq, bool has_t0,
                        uint32_t t0, uint64_t t_start, kvb__srv_gen_t **out,
                        kvb__srv_refusal_t *ref)
{
    kvb__srv_gen_t *g = calloc(1, sizeof *g);
    if (!g) {
        kvb_pd_seq_release(seq, srv->pool);
        kvb__srv_admit_wake_locked(srv);
        free(prompt);
        return nomem(ref);
    }
    g->srv = srv;
    snprintf(g->req_id, sizeof g->req_id, "%s", req_id ? req_id : "");
    snprintf(g->cmpl_id, sizeof g->cmpl_id, "cmpl-%s-%lu", req_id && *req_id ? req_id : "local",
             (unsigned long)atomic_fetch_add(&srv->req_counter, 1));
    g->p = *p;
    g->p.prompt = NULL; /* the body's, gone after the handler */
    g->prompt = prompt;
    g->n_prompt = n_prompt;
    g->seq = *seq;
    kvb_pd_seq_init(seq);
    g->has_t0 = has_t0;
    g->t0 = t0;
    g->t_start = t_start;
    g->deadline = t_start + (uint64_t)p->timeout_ms * 1000000ull;
    g->created = (long long)time(NULL);
    g->out = calloc(p->max_tokens, sizeof *g->out);
    g->logits = calloc(kvb_pd_model_config(srv->model)->vocab, sizeof *g->logits);
    /* Every position the answer can need, now (waiting for them in the admission queue): a
     * stream never fails for want of blocks. Callers that reserved them already wait for
     * nothing here. */
    uint64_t positions = (uint64_t)n_prompt + p->max_tokens - 1;
    int rc = g->out && g->logits ? KVB_OK : nomem(ref);
    if (!rc)
        rc = kvb__srv_admit(srv, &g->seq, positions, g->deadline, ref);
    if (rc) {
        g->req_id[0] = '\0'; /* the caller answers the error and drops the entry */
        gen_free(g);
        return rc;
    }
    *out = g;
    return KVB_OK;
}

void kvb__srv_gen_set_kv(kvb__srv_gen_t *g, uint64_t bytes, double seconds)
{
    g->kv_bytes = bytes;
    g->kv_s = seconds;
}

static void gen_fail(kvb__srv_gen_t *g, unsigned status, const char *msg, const char *detail)
{
    g->failed = true;
    g->err_status = status;
    snprintf(g->err, sizeof g->err, "%s after %zu tokens: %s", msg, g->n_out, detail);
}

/* ---- continuous batching ------------------------------------------------------------------- */

#define BATCH_MAX 64u /* decode steps in one pass; the rest wait for the next */

/* One generation's decode step waiting for a batched pass (on its thread's stack). */
typedef struct kvb__srv_step {
    struct kvb__srv_step *next;
    kvb_pd_seq_t *seq;
    uint32_t tok;
    float *logits;
    bool done;
    int rc;
    char why[KVB_PD_REASON_MAX];
} step_t;

/* Runs steps[0..n) as one pass; when the pass refuses them, each on its own (so that one bad
 * sequence fails alone). */
static void run_batch(kvb_pd_server_t *srv, step_t **steps, size_t n)
{
    kvb_pd_seq_t *seqs[BATCH_MAX];
    uint32_t toks[BATCH_MAX];
    float *logits[BATCH_MAX];
    for (size_t i = 0; i < n; i++) {
        seqs[i] = steps[i]->seq;
        toks[i] = steps[i]->tok;
        logits[i] = steps[i]->logits;
    }
    char why[KVB_PD_REASON_MAX] = "";
    pthread_mutex_lock(&srv->fwd_mu);
    int rc = kvb_pd_forward_batch(srv->model, srv->caches, srv->tp, seqs, toks, n, logits, why,
                                  sizeof why);
    for (size_t i = 0; rc && i < n; i++)
        steps[i]->rc = kvb_pd_forward(srv->model, srv->caches, srv->tp, seqs[i], &toks[i], 1,
                                      logits[i], NULL, steps[i]->why, sizeof steps[i]->why);
    pthread_mutex_unlock(&srv->fwd_mu);
}

/* Advances `seq` by `tok` and writes the next logits, batched with every other generation's step
 * that waits at the same time (continuous batching: generations join and leave between passes).
 * No thread of its own: whichever waiting thread finds no pass running runs the next one for all
 * that wait, FIFO, then wakes them. */
static int batched_step(kvb_pd_server_t *srv, kvb_pd_seq_t *seq, uint32_t tok, float *logits,
                        char *why, size_t cap)
{
    step_t me = {.seq = seq, .tok = tok, .logits = logits};
    pthread_mutex_lock(&srv->bat_mu);
    if (srv->bat_tail)
        srv->bat_tail->next = &me;
    else
        srv->bat_head = &me;
    srv->bat_tail = &me;
    while (!me.done) {
        if (srv->bat_running) {
            pthread_cond_wait(&srv->bat_cv, &srv->bat_mu);
            continue;
        }
        step_t *steps[BATCH_MAX];
        size_t n = 0;
        while (srv->bat_head && n < BATCH_MAX) {
            steps[n++] = srv->bat_head;
            srv->bat_head = srv->bat_head->next;
        }
        if (!srv->bat_head)
            srv->bat_tail = NULL;
        srv->bat_running = true;
        srv->m_batches++;
        srv->m_batch_tokens += n;
        srv->m_batch_max = n > srv->m_batch_max ? n : srv->m_batch_max;
        pthread_mutex_unlock(&srv->bat_mu);
        run_batch(srv, steps, n);
        pthread_mutex_lock(&srv->bat_mu);
        for (size_t i = 0; i < n; i++)
            steps[i]->done = true; /* `me` may be among those not taken (over BATCH_MAX) */
        srv->bat_running = false;
        pthread_cond_broadcast(&srv->bat_cv);
    }
    pthread_mutex_unlock(&srv->bat_mu);
    if (me.rc)
        snprintf(why, cap, "%s", me.why);
    return me.rc;
}

json_t *kvb__srv_batch_health(kvb_pd_server_t *srv)
{
    pthread_mutex_lock(&srv->bat_mu);
    json_t *o =
        json_pack("{s:I,s:I,s:I,s:f}", "passes", (json_int_t)srv->m_batches, "steps",
                  (json_int_t)srv->m_batch_tokens, "max", (json_int_t)srv->m_batch_max, "mean",
                  srv->m_batches ? (double)srv->m_batch_tokens / srv->m_batches : 0.0);
    pthread_mutex_unlock(&srv->bat_mu);
    return o;
}

/* The next token's logits: the prompt on a colocated instance's first step (a pass of its own),
 * else the last token, in a batched pass with the other generations' steps. */
static int gen_forward(kvb__srv_gen_t *g, char *why, size_t cap)
{
    kvb_pd_server_t *srv = g->srv;
    if (g->n_out)
        return batched_step(srv, &g->seq, g->out[g->n_out - 1], g->logits, why, cap);
    pthread_mutex_lock(&srv->fwd_mu);
    int rc = kvb_pd_forward(srv->model, srv->caches, srv->tp, &g->seq, g->prompt, g->n_prompt,
                            g->logits, NULL, why, cap);
    pthread_mutex_unlock(&srv->fwd_mu);
    return rc;
}

/* Generates one token (T0 as given on a decode). Ends the generation after EOS or max_tokens. */
static void gen_step(kvb__srv_gen_t *g)
{
    char why[KVB_PD_REASON_MAX] = "";
    uint32_t tok = 0;
    if (kvb__now_ns() > g->deadline)
        return gen_fail(g, 504, "request deadline passed", "timeout_ms exceeded");
    if (g->n_out == 0 && g->has_t0) {
        tok = g->t0;
    } else {
        int rc = gen_forward(g, why, sizeof why);
        if (!rc)
            rc = kvb_pd_sample(g->logits, kvb_pd_model_config(g->srv->model)->vocab,
                               g->p.temperature, g->p.seed, g->n_out, &tok);
        if (rc)
            return gen_fail(g, 500, "forward pass failed", *why ? why : kvb_strerror(rc));
    }
    g->out[g->n_out++] = tok;
    g->t_last = kvb__now_ns();
    if (g->n_out == 1)
        g->t_first = g->t_last;
    if (tok == KVB_PD_EOS || g->n_out == g->p.max_tokens) {
        g->done = true;
        g->finish = tok == KVB_PD_EOS ? "stop" : "length";
    }
}

/* ---- answers ----------------------------------------------------------------------------------
 */

/* The text of tokens: bytes below 0x80 as they are, others as the Latin-1 character of that
 * code point, so the JSON string is always valid UTF-8 and a stream never splits a character
 * (token ids in "tokens" are the exact output). BOS/EOS have no text. */
static json_t *text_json(const uint32_t *t, size_t n)
{
    char *s = malloc(n * 2 + 1);
    size_t k = 0;
    for (size_t i = 0; s && i < n; i++) {
        if (t[i] >= 256)
            continue;
        if (t[i] < 0x80) {
            s[k++] = (char)t[i];
        } else {
            s[k++] = (char)(0xC0 | (t[i] >> 6));
            s[k++] = (char)(0x80 | (t[i] & 0x3F));
        }
    }
    json_t *j = s ? json_stringn(s, k) : NULL;
    free(s);
    return j;
}

static json_t *stats_json(const kvb__srv_gen_t *g)
{
    json_t *toks = json_array();
    for (size_t i = 0; toks && i < g->n_out; i++)
        json_array_append_new(toks, json_integer(g->out[i]));
    double ttft = g->n_out ? (double)(g->t_first - g->t_start) / 1e6 : 0.0;
    double tpot =
        g->n_out > 1 ? (double)(g->t_last - g->t_first) / 1e6 / (double)(g->n_out - 1) : 0.0;
    return json_pack("{s:f,s:f,s:I,s:f,s:o*}", "ttft_ms", ttft, "tpot_ms", tpot, "kv_bytes",
                     (json_int_t)g->kv_bytes, "kv_transfer_ms", g->kv_s * 1e3, "tokens", toks);
}

static json_t *usage_json(const kvb__srv_gen_t *g)
{
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)g->n_prompt, "completion_tokens",
                     (json_int_t)g->n_out, "total_tokens", (json_int_t)(g->n_prompt + g->n_out));
}

/* A completion (tokens [from, from + n), finish NULL while streaming) in the OpenAI shape. */
static json_t *completion_json(const kvb__srv_gen_t *g, size_t from, size_t n, bool last)
{
    json_t *choice = json_pack("{s:i,s:o*,s:s?}", "index", 0, "text", text_json(g->out + from, n),
                               "finish_reason", last ? g->finish : NULL);
    if (choice && !last)
        json_object_set_new(choice, "finish_reason", json_null());
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:[o*]}", "id", g->cmpl_id, "object", "text_completion",
                          "created", (json_int_t)g->created, "model",
                          kvb_pd_model_id(g->srv->model), "choices", choice);
    if (o && last) {
        json_object_set_new(o, "usage", usage_json(g));
        json_object_set_new(o, "kvbridge", stats_json(g));
    }
    return o;
}

static enum MHD_Result respond_whole(kvb__srv_gen_t *g, struct MHD_Connection *conn)
{
    while (!g->done && !g->failed)
        gen_step(g);
    enum MHD_Result ret;
    if (g->failed) {
        KVB_WARN("request %s: %s", g->cmpl_id, g->err);
        ret = kvb__http_error(conn, g->err_status, g->err);
    } else {
        ret = kvb__http_json(conn, 200, completion_json(g, 0, g->n_out, true));
    }
    gen_free(g);
    return ret;
}

/* Puts "data: <json>\n\n" (or the [DONE] marker when obj is NULL) in the event buffer. */
static void set_event(kvb__srv_gen_t *g, json_t *obj)
{
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    const char *body = s ? s : "[DONE]";
    size_t len = strlen(body) + 8;
    free(g->ev);
    g->ev = malloc(len + 1);
    g->ev_len = g->ev ? (size_t)snprintf(g->ev, len + 1, "data: %s\n\n", body) : 0;
    g->ev_off = 0;
    free(s);
}

/* The next event of the stream: a token, then the final chunk, then [DONE]; or an error. */
static void next_event(kvb__srv_gen_t *g)
{
    if (g->phase == 1) {
        set_event(g, NULL);
        g->phase = 2;
        return;
    }
    gen_step(g);
    if (g->failed) {
        KVB_WARN("request %s: %s", g->cmpl_id, g->err);
        set_event(g, json_pack("{s:{s:s,s:s}}", "error", "message", g->err, "type",
                               kvb__http_error_type(g->err_status)));
        g->phase = 3; /* ends without [DONE] */
        return;
    }
    set_event(g, completion_json(g, g->n_out - 1, 1, false));
    if (g->done) { /* append the final chunk to this token's event */
        char *tok = g->ev;
        size_t tlen = g->ev_len;
        g->ev = NULL;
        set_event(g, completion_json(g, g->n_out, 0, true));
        char *both = malloc(tlen + g->ev_len + 1);
        if (both) {
            memcpy(both, tok, tlen);
            memcpy(both + tlen, g->ev, g->ev_len + 1);
            free(g->ev);
            g->ev = both;
            g->ev_len += tlen;
        }
        free(tok);
        g->phase = 1;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    kvb__srv_gen_t *g = cls;
    (void)pos;
    while (g->ev_off == g->ev_len) {
        if (g->phase >= 2 && g->ev_off == g->ev_len && g->ev)
            return MHD_CONTENT_READER_END_OF_STREAM;
        next_event(g);
        if (!g->ev) /* out of memory: cut the stream; without [DONE] it reads as failed */
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = g->ev_len - g->ev_off < max ? g->ev_len - g->ev_off : max;
    memcpy(buf, g->ev + g->ev_off, n);
    g->ev_off += n;
    return (ssize_t)n;
}

static void stream_free(void *cls)
{
    gen_free(cls);
}

enum MHD_Result kvb__srv_gen_respond(kvb__srv_gen_t *g, struct MHD_Connection *conn)
{
    if (!g->p.stream)
        return respond_whole(g, conn);
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, g, stream_free);
    if (!r) {
        gen_free(g);
        return kvb__http_error(conn, 500, "cannot create a streaming response");
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r); /* the connection holds it; stream_free runs when it is done */
    return ret;
}

/* ---- POST /v1/completions ------------------------------------------------------------------- */

enum MHD_Result kvb__srv_completions(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                     json_t *body)
{
    uint64_t t_start = kvb__now_ns();
    char why[512];
    if (srv->opts.role != KVB_PD_ROLE_BOTH)
        return kvb__srv_http_fail(srv, conn, 404,
                                  "/v1/completions is served by colocated instances and the proxy; "
                                  "this is a %s instance",
                                  kvb_pd_role_name(srv->opts.role));
    kvb__srv_metric_request(srv);
    kvb__srv_params_t p;
    if (kvb__srv_params_parse(body, &p, true, why, sizeof why))
        return kvb__srv_http_fail(srv, conn, 400, "%s", why);
    uint32_t *toks = NULL;
    size_t n = 0;
    if (kvb__srv_tokenize(p.prompt, p.prompt_len, &toks, &n))
        return kvb__srv_http_fail(srv, conn, 500, "out of memory tokenizing the prompt");
    kvb_pd_seq_t seq;
    kvb_pd_seq_init(&seq);
    kvb__srv_gen_t *g = NULL;
    kvb__srv_refusal_t ref;
    int rc = kvb__srv_gen_create(srv, NULL, &p, toks, n, &seq, false, 0, t_start, &g, &ref);
    if (rc)
        return kvb__srv_http_refuse(srv, conn, &ref);
    return kvb__srv_gen_respond(g, conn);
}
