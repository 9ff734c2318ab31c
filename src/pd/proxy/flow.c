/* SPDX-License-Identifier: Apache-2.0 */
/* The proxy's request flow (docs/pd-protocol.md): client body validation, the choice of a
 * prefill/decode pair, /pd/info caching, the pull and push sequences up to the decode call, and
 * the mapping of every upstream failure to a client error. */
#include <jansson.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/proxy/internal.h"

#define INFO_TIMEOUT_MS  5000u
#define ABORT_TIMEOUT_MS 2000u

void (*kvb__pxy_fault_hook)(const char *stage, const kvb__pxy_job_t *job);

static void fault(const char *stage, const kvb__pxy_job_t *job)
{
    if (kvb__pxy_fault_hook)
        kvb__pxy_fault_hook(stage, job);
}

static void set_err(kvb__pxy_err_t *err, unsigned status, const char *type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void set_err(kvb__pxy_err_t *err, unsigned status, const char *type, const char *fmt, ...)
{
    err->status = status;
    err->reason[0] = '\0';
    kvb__pxy_fmt(err->type, sizeof err->type, "%s", type);
    va_list ap;
    va_start(ap, fmt);
    if (vsnprintf(err->msg, sizeof err->msg, fmt, ap) < 0)
        err->msg[0] = '\0';
    va_end(ap);
}

/* ---- Client body ----------------------------------------------------------------------------- */

/* An optional integer field in [lo, hi]; -1 with *err when present and wrong. */
static int get_uint(json_t *root, const char *key, uint64_t lo, uint64_t hi, uint64_t *v,
                    kvb__pxy_err_t *err)
{
    json_t *j = json_object_get(root, key);
    if (!j || json_is_null(j))
        return 0;
    if (!json_is_integer(j) || json_integer_value(j) < 0 || (uint64_t)json_integer_value(j) < lo ||
        (uint64_t)json_integer_value(j) > hi) {
        set_err(err, 400, "invalid_request_error", "'%s' must be an integer in [%llu, %llu]", key,
                (unsigned long long)lo, (unsigned long long)hi);
        return -1;
    }
    *v = (uint64_t)json_integer_value(j);
    return 0;
}

static int get_fields(json_t *root, kvb__pxy_creq_t *out, kvb__pxy_err_t *err)
{
    json_t *prompt = json_object_get(root, "prompt"), *model = json_object_get(root, "model");
    json_t *stream = json_object_get(root, "stream"), *temp = json_object_get(root, "temperature");
    if (!json_is_string(prompt)) {
        set_err(err, 400, "invalid_request_error", "'prompt' must be a string");
        return -1;
    }
    if (model && !json_is_string(model) && !json_is_null(model)) {
        set_err(err, 400, "invalid_request_error", "'model' must be a string");
        return -1;
    }
    if (stream && !json_is_boolean(stream) && !json_is_null(stream)) {
        set_err(err, 400, "invalid_request_error", "'stream' must be a boolean");
        return -1;
    }
    if (temp && !json_is_null(temp) &&
        (!json_is_number(temp) || !(json_number_value(temp) >= 0) ||
         !isfinite(json_number_value(temp)))) {
        set_err(err, 400, "invalid_request_error", "'temperature' must be a number >= 0");
        return -1;
    }
    out->prompt = json_string_value(prompt);
    out->stream = json_is_true(stream);
    out->temperature = temp ? json_number_value(temp) : 0.0;
    return 0;
}

int kvb__pxy_parse(const char *body, size_t len, uint32_t default_timeout_ms, kvb__pxy_creq_t *out,
                   kvb__pxy_err_t *err)
{
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        set_err(err, 400, "invalid_request_error", "malformed JSON body: %s (line %d, column %d)",
                je.text, je.line, je.column);
        return -1;
    }
    uint64_t max_tokens = 16, seed = 0, timeout = default_timeout_ms;
    if (!json_is_object(root)) {
        set_err(err, 400, "invalid_request_error", "the body must be a JSON object");
    } else if (!get_fields(root, out, err) &&
               !get_uint(root, "max_tokens", 1, KVB_PD_SERVER_MAX_TOKENS, &max_tokens, err) &&
               !get_uint(root, "seed", 0, INT64_MAX, &seed, err) &&
               !get_uint(root, "timeout_ms", 1, 600000, &timeout, err)) {
        out->root = root;
        out->max_tokens = (uint32_t)max_tokens;
        out->seed = seed;
        out->timeout_ms = (uint32_t)timeout;
        out->t_start = kvb__now_ns();
        out->deadline = kvb__deadline_ms(out->timeout_ms);
        return 0;
    }
    json_decref(root);
    memset(out, 0, sizeof *out);
    return -1;
}

/* ---- Upstream calls -------------------------------------------------------------------------- */

static const char *role_name(const kvb__upstream_t *u)
{
    return u->prefill ? "prefill" : "decode";
}

void kvb__pxy_upstream_error(const kvb__upstream_t *u, const char *path, int rc,
                             const kvb__pxy_res_t *rs, kvb__pxy_err_t *err)
{
    const char *who = role_name(u);
    if (rs->status >= 200 && rs->status < 300 && !rc) {
        set_err(err, 502, "upstream_error", "%s %s%s: malformed answer", who, u->url, path);
    } else if (rs->status >= 300 && !(rc && rs->canceled)) {
        json_t *root = rs->body ? json_loads(rs->body, 0, NULL) : NULL;
        json_t *e = json_object_get(root, "error");
        const char *msg = json_string_value(json_object_get(e, "message"));
        const char *type = json_string_value(json_object_get(e, "type"));
        const char *reason = json_string_value(json_object_get(e, "reason"));
        /* 4xx carry the instance's verdict (a refused pair is 409 with the guard's reason):
         * pass them through; 503/504 too; any other failure of theirs is a bad gateway - and so
         * are those that judge what the proxy sent, not what the client did: 401 and 403 (its
         * credentials, its grants), 404 (a path or a reservation the instance does not have)
         * and 400 `unknown_segment` (an instance it paired that is not in the cluster). */
        bool ours = rs->status == 401 || rs->status == 403 || rs->status == 404 ||
                    (rs->status == 400 && reason && !strcmp(reason, "unknown_segment"));
        unsigned st = !ours && (rs->status < 500 || rs->status == 503 || rs->status == 504)
                          ? (unsigned)rs->status
                          : 502u;
        set_err(err, st, type ? type : "upstream_error", "%s %s%s: HTTP %ld: %s", who, u->url, path,
                rs->status, msg && *msg ? msg : "(no reason given)");
        kvb__pxy_fmt(err->reason, sizeof err->reason, "%s", reason ? reason : "");
        json_decref(root);
    } else if (rs->timed_out) {
        set_err(err, 504, "timeout", "%s %s%s: no answer before the deadline", who, u->url, path);
    } else if (rs->canceled) {
        set_err(err, 503, "unavailable", "%s %s%s: canceled (the proxy is stopping)", who, u->url,
                path);
    } else {
        set_err(err, 502, "upstream_unreachable", "%s %s%s: %s", who, u->url, path, rs->error);
    }
}

long kvb__pxy_busy_of(int rc, const kvb__pxy_res_t *rs)
{
    if (!rc && rs->status == 503)
        return 503;
    return rc && rs->status == 0 && !rs->timed_out && !rs->canceled ? -1 : 0;
}

/* POSTs `req` (or GETs when NULL) to u + path and returns its JSON object answer, or NULL with
 * *err set. Takes `req` over. */
static json_t *call(kvb__pxy_job_t *job, kvb__upstream_t *u, const char *path, json_t *req,
                    uint64_t deadline, kvb__pxy_err_t *err)
{
    char url[300], *text = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (req && !text) {
        set_err(err, 500, "internal_error", "out of memory");
        return NULL;
    }
    kvb__pxy_fmt(url, sizeof url, "%s%s", u->url, path);
    kvb__pxy_req_t rq = {.url = url,
                         .body = text,
                         .deadline_ns = deadline,
                         .cancel = &job->px->stopping,
                         .auth = job->px->auth};
    kvb__pxy_res_t rs;
    int rc = kvb__pxy_call(&rq, &rs);
    free(text);
    job->busy_status = kvb__pxy_busy_of(rc, &rs);
    job->last_http = rs.status;
    job->last_unreached = rs.unreached;
    if (job->busy_status == -1) /* no answer at all: pass it over for a while */
        kvb__pxy_upstream_down(u);
    job->busy_prefill = u->prefill;
    json_t *ans = !rc && rs.status == 200 && rs.body ? json_loads(rs.body, 0, NULL) : NULL;
    if (!json_is_object(ans)) {
        json_decref(ans);
        ans = NULL;
        kvb__pxy_upstream_error(u, path, rc, &rs, err);
        KVB_WARN("proxy %s: %s", job->rid, err->msg);
    }
    free(rs.body);
    return ans;
}

/* The instance's /pd/info (a new reference), fetched on first use and cached. A failed fetch is
 * not cached, so an instance that comes up later is used then. */
static json_t *info_of(kvb__pxy_job_t *job, kvb__upstream_t *u, kvb__pxy_err_t *err)
{
    pthread_mutex_lock(&u->mu);
    json_t *info = json_incref(u->info);
    pthread_mutex_unlock(&u->mu);
    if (info)
        return info;
    uint64_t dl = kvb__deadline_ms(INFO_TIMEOUT_MS);
    if (dl > job->deadline)
        dl = job->deadline;
    info = call(job, u, "/pd/info", NULL, dl, err);
    if (!info)
        return NULL;
    const char *role = json_string_value(json_object_get(info, "role"));
    bool fits = role && (!strcmp(role, "both") || !strcmp(role, role_name(u)));
    if (!fits || !json_is_array(json_object_get(info, "segments"))) {
        set_err(err, 502, "upstream_error", "%s %s: /pd/info says role '%s'%s", role_name(u),
                u->url, role ? role : "?", fits ? " but lists no segments" : "");
        json_decref(info);
        return NULL;
    }
    pthread_mutex_lock(&u->mu);
    if (!u->info)
        u->info = json_incref(info);
    pthread_mutex_unlock(&u->mu);
    return info;
}

static kvb_pd_kv_mode_t mode_of(const kvb_pd_proxy_t *px, json_t *pinfo)
{
    kvb_pd_kv_mode_t m = px->kv_mode;
    const char *s = json_string_value(json_object_get(pinfo, "kv_mode"));
    if (m == KVB_PD_KV_AUTO && (!s || kvb_pd_kv_mode_parse(s, &m)))
        m = KVB_PD_KV_PULL;
    return m;
}

static int left_ms(const kvb__pxy_job_t *job)
{
    int ms = kvb__ms_left(job->deadline);
    return ms < 1 ? 1 : ms;
}

/* The fields every step's body shares. */
static json_t *base_body(const kvb__pxy_job_t *job, const kvb__pxy_creq_t *rq)
{
    return json_pack("{s:s, s:s, s:f, s:I, s:s, s:i}", "request_id", job->rid, "prompt", rq->prompt,
                     "temperature", rq->temperature, "seed", (json_int_t)rq->seed, "kv_mode",
                     job->mode == KVB_PD_KV_PUSH ? "push" : "pull", "timeout_ms", left_ms(job));
}

/* The /pd/decode body, kept as text for whichever thread makes the call. */
static int decode_body(kvb__pxy_job_t *job, const kvb__pxy_creq_t *rq, json_t *psegs,
                       json_t *pblocks, kvb__pxy_err_t *err)
{
    json_t *b = base_body(job, rq);
    json_t *t0 = json_object_get(job->prefill_reply, "t0");
    if (b) {
        json_object_set(b, "t0", t0);
        json_object_set(b, "prefill_segments", psegs);
        json_object_set_new(b, "prefill_blocks", pblocks ? json_incref(pblocks) : json_array());
        if (pblocks) /* pull: the prefill's ticket vouches for its lease's blocks */
            json_object_set(b, "prefill_ticket", json_object_get(job->prefill_reply, "ticket"));
        json_object_set_new(b, "max_tokens", json_integer(rq->max_tokens));
        json_object_set_new(b, "stream", json_boolean(rq->stream));
    }
    job->decode_body = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    kvb__pxy_fmt(job->decode_url, sizeof job->decode_url, "%s/pd/decode", job->d->url);
    if (!job->decode_body) {
        set_err(err, 500, "internal_error", "out of memory");
        return -1;
    }
    return 0;
}

static bool valid_t0(json_t *ans)
{
    json_t *t0 = json_object_get(ans, "t0");
    return json_is_integer(t0) && json_integer_value(t0) >= 0;
}

/* Calls the prefill with body `b` (consumed), timing it; its answer must carry T0. */
static int prefill(kvb__pxy_job_t *job, json_t *b, kvb__pxy_err_t *err)
{
    uint64_t t = kvb__now_ns();
    job->prefill_called = b != NULL;
    job->prefill_reply = b ? call(job, job->p, "/pd/prefill", b, job->deadline, err) : NULL;
    /* An answer (any status), or a call that never reached it: no write of it can be running. */
    job->prefill_answered = b && (job->last_http != 0 || job->last_unreached);
    job->prefill_ms = (double)(kvb__now_ns() - t) / 1e6;
    if (!job->prefill_reply)
        return -1;
    if (!valid_t0(job->prefill_reply)) {
        set_err(err, 502, "upstream_error", "prefill %s/pd/prefill: answer has no t0", job->p->url);
        return -1;
    }
    fault("prefilled", job);
    return 0;
}

static int run_pull(kvb__pxy_job_t *job, const kvb__pxy_creq_t *rq, json_t *pinfo, json_t *dinfo,
                    kvb__pxy_err_t *err)
{
    json_t *b = base_body(job, rq);
    if (b)
        json_object_set(b, "decode_segments", json_object_get(dinfo, "segments"));
    if (prefill(job, b, err))
        return -1;
    json_t *psegs = json_object_get(job->prefill_reply, "prefill_segments");
    return decode_body(job, rq, psegs ? psegs : json_object_get(pinfo, "segments"),
                       json_object_get(job->prefill_reply, "blocks"), err);
}

static int run_push(kvb__pxy_job_t *job, const kvb__pxy_creq_t *rq, json_t *pinfo, json_t *dinfo,
                    kvb__pxy_err_t *err)
{
    json_t *psegs = json_object_get(pinfo, "segments");
    json_t *b = json_pack("{s:s, s:s, s:O, s:i, s:i}", "request_id", job->rid, "prompt", rq->prompt,
                          "prefill_segments", psegs, "timeout_ms", left_ms(job), "max_tokens",
                          (int)rq->max_tokens);
    json_t *res = b ? call(job, job->d, "/pd/reserve", b, job->deadline, err) : NULL;
    if (!res)
        return -1;
    job->reserved = true;
    fault("reserved", job);
    json_t *dsegs = json_object_get(res, "decode_segments");
    b = base_body(job, rq);
    if (b) {
        json_object_set(b, "decode_blocks", json_object_get(res, "blocks"));
        json_object_set(b, "decode_ticket", json_object_get(res, "ticket"));
        json_object_set(b, "decode_segments", dsegs ? dsegs : json_object_get(dinfo, "segments"));
    }
    json_decref(res);
    if (prefill(job, b, err))
        return -1;
    return decode_body(job, rq, psegs, NULL, err);
}

/* Readies the job for another attempt: a new request id (an aborted push reservation keeps the
 * old one on its decode until it drains), nothing of the last attempt's answers. */
static void job_again(kvb__pxy_job_t *job)
{
    job->retries++;
    json_decref(job->prefill_reply);
    job->prefill_reply = NULL;
    free(job->decode_body);
    job->decode_body = NULL;
    size_t k = strcspn(job->rid, ".");
    kvb__pxy_fmt(job->rid + k, sizeof job->rid - k, ".%u", job->retries);
}

/* The segments an instance's /pd/info lists. */
static json_t *segs_of(json_t *info)
{
    return json_object_get(info, "segments");
}

bool kvb__pxy_pair_changed(kvb__pxy_job_t *job, const kvb__pxy_err_t *err)
{
    if (job->refetched || err->status != 502 || !job->pinfo || !job->dinfo ||
        kvb__now_ns() + 1000000ull >= job->deadline)
        return false;
    job->refetched = true;
    kvb__pxy_info_forget(job->p, job->pinfo);
    kvb__pxy_info_forget(job->d, job->dinfo);
    long busy_status = job->busy_status; /* what the failed call left, as kvb__pxy_abort keeps */
    bool busy_prefill = job->busy_prefill;
    kvb__pxy_err_t e2;
    json_t *p2 = info_of(job, job->p, &e2), *d2 = p2 ? info_of(job, job->d, &e2) : NULL;
    bool changed = d2 && (!json_equal(segs_of(job->pinfo), segs_of(p2)) ||
                          !json_equal(segs_of(job->dinfo), segs_of(d2)));
    json_decref(p2);
    json_decref(d2);
    job->busy_status = busy_status;
    job->busy_prefill = busy_prefill;
    if (changed)
        KVB_INFO("proxy %s: %s; an instance of the pair has new segments (restarted): the "
                 "request runs again",
                 job->rid, err->msg);
    return changed;
}

/* One attempt with the job's pair: the pull or push sequence up to the decode call. */
static int attempt(kvb__pxy_job_t *job, const kvb__pxy_creq_t *rq, kvb__pxy_err_t *err, bool *again)
{
    kvb_pd_proxy_t *px = job->px;
    job->prefill_called = job->prefill_answered = false;
    json_decref(job->pinfo);
    json_decref(job->dinfo);
    job->pinfo = info_of(job, job->p, err);
    job->dinfo = job->pinfo ? info_of(job, job->d, err) : NULL;
    int rc = -1;
    if (job->dinfo) {
        job->mode = mode_of(px, job->pinfo);
        rc = job->mode == KVB_PD_KV_PUSH ? run_push(job, rq, job->pinfo, job->dinfo, err)
                                         : run_pull(job, rq, job->pinfo, job->dinfo, err);
    }
    if (rc)
        kvb__pxy_abort(job);
    /* The other instance could not link to segments the proxy passed on from its cache. */
    *again = rc && kvb__pxy_pair_changed(job, err);
    if (*again)
        job_again(job);
    return rc;
}

/* After a 503 (the instance could not admit the request: its queue is full, or the request
 * waited there until its deadline) or no answer at all (the instance is gone: killed, not yet
 * dropped by discovery): another instance of that role, if the set has one not tried yet and the
 * deadline allows. Returns whether the job has a new pair. */
static bool other_instance(kvb__pxy_job_t *job, uint32_t *tried_p, uint32_t *tried_d)
{
    kvb_pd_proxy_t *px = job->px;
    bool pre = job->busy_prefill;
    if (!job->busy_status || kvb__now_ns() + 1000000ull >= job->deadline)
        return false;
    pthread_mutex_lock(&px->up_mu);
    size_t n = pre ? px->prefill.n : px->decode.n;
    pthread_mutex_unlock(&px->up_mu);
    uint32_t *tried = pre ? tried_p : tried_d;
    if (*tried >= n)
        return false;
    kvb__upstream_t **slot = pre ? &job->p : &job->d;
    /* Not this one, and no decode an earlier attempt found busy either. */
    const char *skip[1 + KVB__PXY_DECODE_TRIES] = {(*slot)->url};
    size_t nskip = 1;
    for (size_t i = 0; !pre && i < job->navoid && nskip < sizeof skip / sizeof *skip; i++)
        skip[nskip++] = job->avoid[i];
    kvb__upstream_t *u = kvb__pxy_pick_other(px, pre, skip, nskip);
    if (!u)
        return false;
    KVB_INFO("proxy %s: %s %s %s; trying %s", job->rid, pre ? "prefill" : "decode", (*slot)->url,
             job->busy_status == 503 ? "is busy (503)" : "does not answer", u->url);
    kvb__pxy_upstream_unref(*slot);
    *slot = u;
    (*tried)++;
    job_again(job);
    return true;
}

int kvb__pxy_prepare(kvb_pd_proxy_t *px, const kvb__pxy_creq_t *rq, kvb__pxy_job_t *job,
                     kvb__pxy_err_t *err, const char *const *avoid, size_t navoid)
{
    memset(job, 0, sizeof *job);
    job->px = px;
    job->avoid = avoid;
    job->navoid = navoid;
    job->t_start = rq->t_start; /* an attempt after a busy decode keeps the client's clock */
    job->deadline = rq->deadline;
    kvb__pxy_fmt(job->rid, sizeof job->rid, "r-%08x-%llu", px->boot,
                 (unsigned long long)atomic_fetch_add(&px->next_id, 1));
    /* References: discovery may drop either from its set while this request runs. */
    job->p = kvb__pxy_pick(px, true);
    if (job->p && navoid)
        job->d = kvb__pxy_pick_other(px, false, avoid, navoid);
    if (job->p && !job->d)
        job->d = kvb__pxy_pick(px, false);
    if (!job->d) {
        const char *uri = px->meta ? kvb__meta_uri(px->meta) : NULL;
        set_err(err, 503, "unavailable", "no %s instance available%s%s%s",
                job->p ? "decode" : "prefill", uri ? " (discovering from " : "", uri ? uri : "",
                uri ? ")" : "");
        return -1;
    }
    uint32_t tried_p = 1, tried_d = 1;
    int rc;
    bool again;
    while ((rc = attempt(job, rq, err, &again)) &&
           (again || other_instance(job, &tried_p, &tried_d)))
        ;
    job->avoid = NULL; /* the caller's, valid only during the call */
    job->navoid = 0;
    return rc;
}

/* ---- Answers --------------------------------------------------------------------------------- */

void kvb__pxy_patch_stats(const kvb__pxy_job_t *job, json_t *answer, double ttft_ms)
{
    json_t *kv = json_object_get(answer, "kvbridge");
    if (!json_is_object(kv))
        return;
    json_t *pr = job->prefill_reply;
    /* In push mode the prefill moved the KV and may be the one that counted it. */
    if (json_integer_value(json_object_get(kv, "kv_bytes")) == 0 &&
        json_is_integer(json_object_get(pr, "kv_bytes"))) {
        json_object_set(kv, "kv_bytes", json_object_get(pr, "kv_bytes"));
        json_object_set(kv, "kv_transfer_ms", json_object_get(pr, "kv_transfer_ms"));
    }
    json_object_set_new(kv, "ttft_ms", json_real(ttft_ms));
    json_object_set_new(kv, "prefill_ms", json_real(job->prefill_ms));
    json_object_set_new(kv, "kv_mode", json_string(job->mode == KVB_PD_KV_PUSH ? "push" : "pull"));
    json_object_set_new(kv, "prefill", json_string(job->p->url));
    json_object_set_new(kv, "decode", json_string(job->d->url));
}

bool kvb__pxy_decode_again(kvb_pd_proxy_t *px, const kvb__pxy_creq_t *rq, const kvb__pxy_err_t *err,
                           size_t tried)
{
    /* One that waited in the decode's queue until its deadline has no time for another. */
    if (!err->busy_decode[0] || !strcmp(err->reason, "deadline") || atomic_load(&px->stopping) ||
        kvb__now_ns() + 1000000ull >= rq->deadline)
        return false;
    pthread_mutex_lock(&px->up_mu);
    size_t n = px->decode.n;
    pthread_mutex_unlock(&px->up_mu);
    if (tried + 1 >= n || tried + 1 >= KVB__PXY_DECODE_TRIES) /* each had its turn */
        return false;
    KVB_INFO("proxy: decode %s could not take a request (%s); it goes to another decode",
             err->busy_decode, err->status == 503 ? "busy, 503" : "no answer");
    return true;
}

int kvb__pxy_decode_whole(kvb__pxy_job_t *job, json_t **answer, kvb__pxy_err_t *err)
{
    json_t *b = json_loads(job->decode_body, 0, NULL);
    uint64_t t = kvb__now_ns();
    json_t *ans = b ? call(job, job->d, "/pd/decode", b, job->deadline, err) : NULL;
    if (!ans) {
        if (!b)
            set_err(err, 500, "internal_error", "out of memory");
        else if (job->busy_status) /* nothing was decoded: another decode may take it */
            kvb__pxy_fmt(err->busy_decode, sizeof err->busy_decode, "%s", job->d->url);
        else /* a push decode waiting on a restarted prefill's old segments, say */
            err->stale_pair = kvb__pxy_pair_changed(job, err);
        kvb__pxy_abort(job);
        return -1;
    }
    /* No stream to time: the first token left the decode after its own TTFT (KV read included). */
    double dttft = json_number_value(json_object_get(json_object_get(ans, "kvbridge"), "ttft_ms"));
    double before = (double)(t - job->t_start) / 1e6;
    kvb__pxy_patch_stats(job, ans, before + dttft);
    *answer = ans;
    return 0;
}

void kvb__pxy_abort(kvb__pxy_job_t *job)
{
    if (!job->reserved)
        return;
    job->reserved = false;
    /* Without "writers_done" the decode keeps the blocks until the prefill's ranks say they
     * finished (or past the reservation's end): a prefill that did not answer may still push. */
    bool done = !job->prefill_called || job->prefill_answered;
    json_t *b = json_pack("{s:s, s:b}", "request_id", job->rid, "writers_done", done);
    kvb__pxy_err_t err;
    /* Whether another instance is tried (other_instance) depends on the call that failed, not
     * on this one: keep what that call left. */
    long busy_status = job->busy_status;
    bool busy_prefill = job->busy_prefill;
    json_t *ans =
        b ? call(job, job->d, "/pd/abort", b, kvb__deadline_ms(ABORT_TIMEOUT_MS), &err) : NULL;
    json_decref(ans);
    job->busy_status = busy_status;
    job->busy_prefill = busy_prefill;
}

void kvb__pxy_job_clear(kvb__pxy_job_t *job)
{
    json_decref(job->pinfo);
    json_decref(job->dinfo);
    job->pinfo = job->dinfo = NULL;
    json_decref(job->prefill_reply);
    free(job->decode_body);
    kvb__pxy_upstream_unref(job->p);
    kvb__pxy_upstream_unref(job->d);
    job->prefill_reply = NULL;
    job->decode_body = NULL;
    job->p = job->d = NULL;
}

/* ---- Metrics --------------------------------------------------------------------------------- */

static const double bounds[KVB__PXY_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                0.25,  0.5,    1,     2.5,  5,     10};

static void observe(kvb__hist_t *h, double v)
{
    h->count++;
    h->sum += v;
    for (int i = 0; i < KVB__PXY_BUCKETS; i++)
        if (v <= bounds[i])
            h->buckets[i]++;
}

void kvb__pxy_record(kvb_pd_proxy_t *px, json_t *answer, bool stream)
{
    json_t *kv = json_object_get(answer, "kvbridge");
    pthread_mutex_lock(&px->m.mu);
    px->m.requests++;
    px->m.streams += stream;
    if (!answer) {
        px->m.failures++;
    } else {
        observe(&px->m.ttft, json_number_value(json_object_get(kv, "ttft_ms")) / 1e3);
        observe(&px->m.tpot, json_number_value(json_object_get(kv, "tpot_ms")) / 1e3);
        px->m.kv_bytes += (uint64_t)json_integer_value(json_object_get(kv, "kv_bytes"));
        px->m.kv_seconds += json_number_value(json_object_get(kv, "kv_transfer_ms")) / 1e3;
    }
    pthread_mutex_unlock(&px->m.mu);
}

double kvb__pxy_bucket_bound(int i)
{
    return bounds[i];
}
