/* SPDX-License-Identifier: Apache-2.0 */
/* The streaming relay: a thread makes the streamed /pd/decode call and its libcurl write callback
 * splits the answer into events, patches the final chunk's stats and feeds a bounded pipe; a
 * libmicrohttpd content reader drains the pipe to the client. A stream that breaks ends with an
 * error event and never with [DONE]. */
#include <jansson.h>
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/proxy/internal.h"

#define PIPE_BYTES (64u << 10)
#define GRACE_NS   2000000000ull /* past the deadline, to deliver the final error event */

enum { PENDING, STREAMING, FAILED };

typedef struct {
    atomic_int refs; /* the relay thread's, and the handler's (then the response's) */
    kvb__pxy_job_t job;
    kvb__pxy_pipe_t pipe;
    kvb__pxy_sse_t sse;
    pthread_mutex_t mu; /* guards state and err */
    pthread_cond_t cv;
    int state;
    kvb__pxy_err_t err;
    atomic_bool gone; /* the client left: stop the upstream call */
    bool done, error_seen;
    uint64_t first_ns;
    json_t *final; /* the chunk with the stats, for the metrics */
} relay_t;

static void relay_unref(relay_t *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    kvb__pxy_job_clear(&r->job);
    kvb__pxy_sse_free(&r->sse);
    kvb__pxy_pipe_destroy(&r->pipe);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    json_decref(r->final);
    free(r);
}

static void set_state(relay_t *r, int state)
{
    pthread_mutex_lock(&r->mu);
    if (r->state == PENDING)
        r->state = state;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static bool send_event(relay_t *r, const char *data, size_t len, uint64_t deadline)
{
    return !kvb__pxy_pipe_write(&r->pipe, "data: ", 6, deadline, &r->gone) &&
           !kvb__pxy_pipe_write(&r->pipe, data, len, deadline, &r->gone) &&
           !kvb__pxy_pipe_write(&r->pipe, "\n\n", 2, deadline, &r->gone);
}

/* The final chunk: stats as the proxy sees them. Returns the text to send (malloc'd) or NULL to
 * send the event as it came. */
static char *patch_final(relay_t *r, json_t *root)
{
    double ttft = r->first_ns ? (double)(r->first_ns - r->job.t_start) / 1e6 : 0.0;
    kvb__pxy_patch_stats(&r->job, root, ttft);
    json_decref(r->final);
    r->final = json_incref(root);
    return json_dumps(root, JSON_COMPACT);
}

static bool on_event(const char *data, size_t len, void *user)
{
    relay_t *r = user;
    if (r->done || r->error_seen)
        return true; /* nothing may follow [DONE] or an error */
    if (!strcmp(data, "[DONE]")) {
        r->done = true;
        return send_event(r, data, len, r->job.deadline + GRACE_NS);
    }
    json_t *root = json_loads(data, 0, NULL);
    char *text = NULL;
    if (json_object_get(root, "error"))
        r->error_seen = true;
    else if (json_object_get(root, "kvbridge"))
        text = patch_final(r, root);
    if (!r->first_ns && !r->error_seen)
        r->first_ns = kvb__now_ns();
    json_decref(root);
    bool ok = text ? send_event(r, text, strlen(text), r->job.deadline + GRACE_NS)
                   : send_event(r, data, len, r->job.deadline + GRACE_NS);
    free(text);
    return ok;
}

static bool on_body(const char *data, size_t len, void *user)
{
    relay_t *r = user;
    set_state(r, STREAMING);
    return kvb__pxy_sse_feed(&r->sse, data, len);
}

/* Ends a stream that broke: one error event, no [DONE]. */
static void send_error_event(relay_t *r, const char *msg)
{
    json_t *e = json_pack("{s:{s:s, s:s}}", "error", "message", msg, "type", "upstream_error");
    char *text = e ? json_dumps(e, JSON_COMPACT) : NULL;
    if (text)
        send_event(r, text, strlen(text), kvb__now_ns() + GRACE_NS);
    free(text);
    json_decref(e);
}

static void finish_stream(relay_t *r, int rc, const kvb__pxy_res_t *rs)
{
    char msg[KVB_PD_ERR_MAX + 64];
    if (r->done || r->error_seen)
        return;
    if (rc)
        kvb__pxy_fmt(msg, sizeof msg, "decode %s/pd/decode: stream broken: %s", r->job.d->url,
                     rs->timed_out ? "no answer before the deadline" : rs->error);
    else
        kvb__pxy_fmt(msg, sizeof msg, "decode %s/pd/decode: stream ended before [DONE]",
                     r->job.d->url);
    KVB_WARN("proxy %s: %s", r->job.rid, msg);
    r->error_seen = true;
    send_error_event(r, msg);
}

static void *relay_main(void *arg)
{
    relay_t *r = arg;
    kvb_pd_proxy_t *px = r->job.px;
    kvb__pxy_req_t rq = {.url = r->job.decode_url,
                         .body = r->job.decode_body,
                         .deadline_ns = r->job.deadline,
                         .cancel = &px->stopping,
                         .cancel2 = &r->gone,
                         .sink = on_body,
                         .user = r,
                         .auth = px->auth};
    kvb__pxy_res_t rs;
    int rc = kvb__pxy_call(&rq, &rs);
    pthread_mutex_lock(&r->mu);
    int state = r->state;
    pthread_mutex_unlock(&r->mu);
    if (state == PENDING) {
        long busy = kvb__pxy_busy_of(rc, &rs);
        if (busy == -1) /* no answer at all: pass it over for a while */
            kvb__pxy_upstream_down(r->job.d);
        kvb__pxy_err_t e = {0};
        kvb__pxy_upstream_error(r->job.d, "/pd/decode", rc, &rs, &e);
        if (!rc && rs.status == 200)
            kvb__pxy_fmt(e.msg, sizeof e.msg, "decode %s/pd/decode: empty answer", r->job.d->url);
        if (busy) /* nothing was streamed: another decode may take it */
            kvb__pxy_fmt(e.busy_decode, sizeof e.busy_decode, "%s", r->job.d->url);
        else /* a push decode waiting on a restarted prefill's old segments, say */
            e.stale_pair = kvb__pxy_pair_changed(&r->job, &e);
        pthread_mutex_lock(&r->mu);
        r->err = e;
        r->state = FAILED;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
    } else {
        finish_stream(r, rc, &rs);
        kvb__pxy_record(px, r->done && !r->error_seen ? r->final : NULL, true);
    }
    free(rs.body);
    if (state == PENDING || !r->done || r->error_seen)
        kvb__pxy_abort(&r->job);
    kvb__pxy_pipe_close(&r->pipe);
    relay_unref(r);
    pthread_mutex_lock(&px->wk_mu);
    if (--px->workers == 0)
        pthread_cond_broadcast(&px->wk_cv);
    pthread_mutex_unlock(&px->wk_mu);
    return NULL;
}

static ssize_t reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    relay_t *r = cls;
    /* Blocking here is fine: each connection has its own thread, and the relay thread closes the
     * pipe by the request's deadline (or within a second of a stop) whatever the decode does. */
    ssize_t n = kvb__pxy_pipe_read(&r->pipe, buf, max, NULL);
    if (n > 0)
        return n;
    return n == 0 ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
}

static void reader_free(void *cls)
{
    relay_t *r = cls;
    atomic_store(&r->gone, true);
    kvb__pxy_pipe_detach(&r->pipe);
    relay_unref(r);
}

static relay_t *relay_new(kvb__pxy_job_t *job)
{
    relay_t *r = calloc(1, sizeof *r);
    if (!r || kvb__pxy_pipe_init(&r->pipe, PIPE_BYTES)) {
        free(r);
        return NULL;
    }
    r->job = *job;
    memset(job, 0, sizeof *job);
    atomic_init(&r->refs, 2);
    atomic_init(&r->gone, false);
    kvb__pxy_sse_init(&r->sse, on_event, r);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&r->mu, NULL);
    return r;
}

static int spawn(relay_t *r)
{
    kvb_pd_proxy_t *px = r->job.px;
    pthread_attr_t at;
    pthread_t t;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_mutex_lock(&px->wk_mu);
    px->workers++;
    int rc = pthread_create(&t, &at, relay_main, r);
    if (rc)
        px->workers--;
    pthread_mutex_unlock(&px->wk_mu);
    pthread_attr_destroy(&at);
    return rc;
}

/* Waits until the decode streams or fails; its call ends by the deadline, so this does too. */
static int wait_start(relay_t *r, kvb__pxy_err_t *err)
{
    pthread_mutex_lock(&r->mu);
    struct timespec ts = kvb__timespec_of(r->job.deadline + GRACE_NS);
    while (r->state == PENDING)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts))
            break;
    int state = r->state;
    if (state == FAILED)
        *err = r->err;
    pthread_mutex_unlock(&r->mu);
    if (state == PENDING) {
        err->status = 504;
        kvb__pxy_fmt(err->type, sizeof err->type, "timeout");
        kvb__pxy_fmt(err->msg, sizeof err->msg, "decode did not start streaming in time");
    }
    return state == STREAMING ? 0 : -1;
}

static struct MHD_Response *sse_response(relay_t *r)
{
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, reader, r, reader_free);
    if (!resp)
        return NULL;
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    return resp;
}

int kvb__pxy_stream(kvb__pxy_job_t *job, struct MHD_Response **resp, kvb__pxy_err_t *err)
{
    relay_t *r = relay_new(job);
    if (!r || spawn(r)) {
        if (r) {
            atomic_store(&r->refs, 1);
            kvb__pxy_abort(&r->job);
            relay_unref(r);
        } else {
            kvb__pxy_abort(job);
            kvb__pxy_job_clear(job);
        }
        err->status = 500;
        kvb__pxy_fmt(err->type, sizeof err->type, "internal_error");
        kvb__pxy_fmt(err->msg, sizeof err->msg, "cannot start the stream relay");
        return -1;
    }
    struct MHD_Response *rsp = NULL;
    if (wait_start(r, err) || !(rsp = sse_response(r))) {
        if (err->status == 0) {
            err->status = 500;
            kvb__pxy_fmt(err->type, sizeof err->type, "internal_error");
            kvb__pxy_fmt(err->msg, sizeof err->msg, "out of memory");
        }
        atomic_store(&r->gone, true);
        kvb__pxy_pipe_detach(&r->pipe);
        relay_unref(r);
        return -1;
    }
    *resp = rsp; /* the response holds the handler's reference now */
    return 0;
}
