/* SPDX-License-Identifier: Apache-2.0 */
/* A completions client: sends one request to a proxy or an instance and assembles the answer,
 * whole or streamed, into one record (text, tokens, stats, client-side timings). Used by
 * `kvbridge loadgen`, `kvbridge demo` and the tests. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "pd/proxy/internal.h"

typedef struct {
    kvb_pd_completion_t *out;
    kvb__pxy_sse_t sse;
    uint64_t t0_ns;
    bool done, failed;
    char *text;
    size_t text_len;
    const kvb__pxy_res_t *rs; /* its content type is known before the first body byte */
    char *raw;                /* a whole (non-stream) answer */
    size_t raw_len;
} client_t;

static double ms_since(uint64_t t0)
{
    return (double)(kvb__now_ns() - t0) / 1e6;
}

static bool append_text(client_t *c, const char *s)
{
    size_t n = strlen(s);
    char *t = realloc(c->text, c->text_len + n + 1);
    if (!t)
        return false;
    memcpy(t + c->text_len, s, n + 1);
    c->text = t;
    c->text_len += n;
    return true;
}

static void read_stats(kvb_pd_completion_t *o, json_t *root)
{
    json_t *kv = json_object_get(root, "kvbridge"), *usage = json_object_get(root, "usage");
    o->prompt_tokens = (uint32_t)json_integer_value(json_object_get(usage, "prompt_tokens"));
    o->completion_tokens =
        (uint32_t)json_integer_value(json_object_get(usage, "completion_tokens"));
    if (!json_is_object(kv))
        return;
    o->ttft_ms = json_number_value(json_object_get(kv, "ttft_ms"));
    o->tpot_ms = json_number_value(json_object_get(kv, "tpot_ms"));
    o->kv_transfer_ms = json_number_value(json_object_get(kv, "kv_transfer_ms"));
    o->kv_bytes = (uint64_t)json_integer_value(json_object_get(kv, "kv_bytes"));
    json_t *toks = json_object_get(kv, "tokens");
    size_t n = json_array_size(toks);
    free(o->tokens);
    o->tokens = n ? calloc(n, sizeof *o->tokens) : NULL;
    o->n_tokens = o->tokens ? n : 0;
    for (size_t i = 0; i < o->n_tokens; i++)
        o->tokens[i] = (uint32_t)json_integer_value(json_array_get(toks, i));
}

static void read_error(kvb_pd_completion_t *o, json_t *root, const char *raw)
{
    json_t *msg = json_object_get(json_object_get(root, "error"), "message");
    const char *why = json_string_value(json_object_get(json_object_get(root, "error"), "reason"));
    kvb__pxy_fmt(o->reason, sizeof o->reason, "%s", why ? why : "");
    if (json_is_string(msg))
        kvb__pxy_fmt(o->error, sizeof o->error, "%s", json_string_value(msg));
    else
        kvb__pxy_fmt(o->error, sizeof o->error, "malformed answer: %.200s", raw ? raw : "");
}

/* One streamed chunk: text of choices[0], and the stats on the final one. */
static bool on_event(const char *data, size_t len, void *user)
{
    (void)len;
    client_t *c = user;
    if (c->done || c->failed)
        return true;
    if (!strcmp(data, "[DONE]")) {
        c->done = true;
        return true;
    }
    json_t *root = json_loads(data, 0, NULL);
    if (!json_is_object(root) || json_object_get(root, "error")) {
        read_error(c->out, root, data);
        if (!c->out->reason[0])
            kvb__pxy_fmt(c->out->reason, sizeof c->out->reason, "stream_error");
        c->failed = true;
        json_decref(root);
        return true;
    }
    json_t *ch = json_array_get(json_object_get(root, "choices"), 0);
    const char *t = json_string_value(json_object_get(ch, "text"));
    const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
    if (t && *t && !c->out->events++)
        c->out->client_ttft_ms = ms_since(c->t0_ns);
    bool ok = !t || append_text(c, t);
    if (fr)
        kvb__pxy_fmt(c->out->finish_reason, sizeof c->out->finish_reason, "%s", fr);
    if (json_object_get(root, "kvbridge"))
        read_stats(c->out, root);
    json_decref(root);
    return ok;
}

static bool on_body(const char *data, size_t len, void *user)
{
    client_t *c = user;
    if (c->rs->content_sse)
        return kvb__pxy_sse_feed(&c->sse, data, len);
    if (c->raw_len + len > KVB__PXY_BODY_MAX)
        return false;
    char *r = realloc(c->raw, c->raw_len + len + 1);
    if (!r)
        return false;
    memcpy(r + c->raw_len, data, len);
    c->raw = r;
    c->raw_len += len;
    r[c->raw_len] = '\0';
    return true;
}

static void finish_whole(client_t *c, const kvb__pxy_res_t *rs)
{
    kvb_pd_completion_t *o = c->out;
    json_t *root = rs->body ? json_loads(rs->body, 0, NULL) : NULL;
    json_t *ch = json_array_get(json_object_get(root, "choices"), 0);
    const char *t = json_string_value(json_object_get(ch, "text"));
    if (rs->status != 200 || !t) {
        read_error(o, root, rs->body);
    } else {
        o->ok = true;
        append_text(c, t);
        const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
        kvb__pxy_fmt(o->finish_reason, sizeof o->finish_reason, "%s", fr ? fr : "");
        read_stats(o, root);
        o->client_ttft_ms = o->client_total_ms;
    }
    json_decref(root);
}

int kvb_pd_complete(const char *base_url, const char *body, uint32_t timeout_ms,
                    kvb_pd_completion_t *out)
{
    return kvb_pd_complete_as(base_url, NULL, body, timeout_ms, out);
}

int kvb_pd_complete_as(const char *base_url, const char *api_key, const char *body,
                       uint32_t timeout_ms, kvb_pd_completion_t *out)
{
    memset(out, 0, sizeof *out);
    char url[1024];
    kvb__pxy_fmt(url, sizeof url, "%s/v1/completions", base_url);
    client_t c = {.out = out, .t0_ns = kvb__now_ns()};
    kvb__pxy_sse_init(&c.sse, on_event, &c);
    kvb__pxy_req_t rq = {.url = url,
                         .body = body,
                         .deadline_ns = kvb__deadline_ms(timeout_ms),
                         .sink = on_body,
                         .user = &c,
                         .bearer = api_key};
    kvb__pxy_res_t rs;
    c.rs = &rs;
    int rc = kvb__pxy_call(&rq, &rs);
    out->status = rs.status;
    out->streamed = rs.content_sse;
    out->client_total_ms = ms_since(c.t0_ns);
    if (rs.status >= 200 && rs.status < 300 && !rs.content_sse) {
        free(rs.body); /* a 2xx answer went to the sink */
        rs.body = c.raw;
        rs.len = c.raw_len;
        c.raw = NULL;
    }
    if (rc && !c.failed) {
        kvb__pxy_fmt(out->error, sizeof out->error, "%s", rs.error);
        kvb__pxy_fmt(out->reason, sizeof out->reason, "%s",
                     rs.timed_out                         ? "timeout"
                     : rs.status == 0                     ? "no_response"
                     : rs.content_sse && rs.status == 200 ? "stream_broken"
                                                          : "");
    } else if (rs.content_sse && rs.status == 200) {
        out->ok = c.done && !c.failed;
        if (!c.done && !c.failed) {
            kvb__pxy_fmt(out->error, sizeof out->error, "stream ended without [DONE]");
            kvb__pxy_fmt(out->reason, sizeof out->reason, "stream_broken");
        }
    } else if (!rc) {
        finish_whole(&c, &rs);
    }
    out->text = c.text ? c.text : strdup("");
    kvb__pxy_sse_free(&c.sse);
    free(c.raw);
    free(rs.body);
    return out->ok ? 0 : -1;
}

void kvb_pd_completion_free(kvb_pd_completion_t *c)
{
    free(c->text);
    free(c->tokens);
    c->text = NULL;
    c->tokens = NULL;
}
