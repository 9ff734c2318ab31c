/* SPDX-License-Identifier: Apache-2.0 */
/* What the proxy's modules share: a libcurl call with a deadline and a cancel flag, a server-sent
 * events splitter, and the bounded pipe between a libcurl write callback and a libmicrohttpd
 * content reader. Private to src/pd/proxy/ and its tests.
 *
 * Names: what other programs, the tools and the tests call is in proxy.h (kvb_pd_*); a non-static
 * name used only inside src/pd/proxy/ is declared here as kvb__pxy_* (macros KVB__PXY_*), as
 * kvb__model_* is in model/ and kvb__srv_* in server/. Static functions are short and
 * unprefixed. */
#ifndef KVB_PD_PROXY_INTERNAL_H
#define KVB_PD_PROXY_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "meta/meta.h"
#include "pd/auth.h"
#include "pd/proxy/proxy.h"

#define KVB__PXY_BODY_MAX  (16u << 20) /* largest upstream answer kept in memory */
#define KVB__PXY_EVENT_MAX (1u << 20)  /* largest server-sent event */

/* Receives a 2xx answer's body as it arrives; returns false to abort the transfer. */
typedef bool (*kvb__pxy_sink_cb)(const char *data, size_t len, void *user);

typedef struct {
    const char *url;
    const char *body;           /* NULL: GET, else POST of this JSON text */
    uint64_t deadline_ns;       /* CLOCK_MONOTONIC; the whole call ends by then */
    const atomic_bool *cancel;  /* may be NULL: the call is aborted soon after it turns true */
    const atomic_bool *cancel2; /* a second such flag, may be NULL */
    kvb__pxy_sink_cb sink;      /* may be NULL: a 2xx body is collected instead */
    void *user;
    const kvb__pd_auth_t *auth; /* may be NULL: else the call is signed with its secret */
    const char *bearer;         /* may be NULL: else sent as "Authorization: Bearer <bearer>" */
} kvb__pxy_req_t;

typedef struct {
    long status; /* 0: no response */
    char *body;  /* collected body (non-2xx always; 2xx without a sink), NUL-terminated */
    size_t len;
    bool timed_out;             /* the deadline passed */
    bool canceled;              /* the cancel flag or the sink stopped it */
    bool unreached;             /* no connection was made: the request never left */
    bool content_sse;           /* Content-Type was text/event-stream */
    char error[KVB_PD_ERR_MAX]; /* transport error text when status is 0 or the call broke */
} kvb__pxy_res_t;

/* Performs one HTTP call on an easy handle of its own for the call's duration, taken from a
 * process-wide pool that keeps idle keep-alive connections per origin (http.c). Returns 0
 * when an answer arrived complete (whatever its status), -1 otherwise (rs->error says why).
 * rs->body must be freed by the caller in both cases. */
int kvb__pxy_call(const kvb__pxy_req_t *rq, kvb__pxy_res_t *rs);
#define KVB__PXY_POOL_MAX        128 /* idle pooled handles kept, all origins together */
#define KVB__PXY_POOL_PER_ORIGIN 32  /* ... and to one origin (scheme://host:port) */
#define KVB__PXY_POOL_IDLE_S     30  /* an idle pooled connection is closed after this long */
/* The pool's idle handles (each holds at most one connection), and closing them all (tests). */
size_t kvb__pxy_pool_idle(void);
void kvb__pxy_pool_flush(void);

/* Splits a byte stream into server-sent events; calls `on_event` with each event's data (the
 * text after "data: ", lines joined by '\n', NUL-terminated, valid during the call). Returns false
 * from feed when an event exceeds KVB__PXY_EVENT_MAX or on_event returned false. */
typedef bool (*kvb__pxy_sse_event_cb)(const char *data, size_t len, void *user);
typedef struct {
    char *buf;
    size_t len, cap;
    kvb__pxy_sse_event_cb on_event;
    void *user;
} kvb__pxy_sse_t;

void kvb__pxy_sse_init(kvb__pxy_sse_t *s, kvb__pxy_sse_event_cb on_event, void *user);
bool kvb__pxy_sse_feed(kvb__pxy_sse_t *s, const char *data, size_t len);
void kvb__pxy_sse_free(kvb__pxy_sse_t *s);

/* A bounded byte pipe with one writer and one reader, blocking with deadlines on both sides. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *buf;
    size_t cap, head, len;
    bool closed;   /* the writer is done: the reader drains then sees the end */
    bool detached; /* the reader is gone: writes fail */
} kvb__pxy_pipe_t;

int kvb__pxy_pipe_init(kvb__pxy_pipe_t *p, size_t cap);
void kvb__pxy_pipe_destroy(kvb__pxy_pipe_t *p);
/* Writes all of data[0..len), waiting for room until `deadline_ns` or `*cancel`. Returns 0, or -1
 * (reader detached, deadline passed, or canceled). */
int kvb__pxy_pipe_write(kvb__pxy_pipe_t *p, const char *data, size_t len, uint64_t deadline_ns,
                        const atomic_bool *cancel);
/* Reads up to `max` bytes, waiting for some. Returns the count, 0 at the end (closed and
 * drained), or -1 when `*cancel` turned true first. */
ssize_t kvb__pxy_pipe_read(kvb__pxy_pipe_t *p, char *out, size_t max, const atomic_bool *cancel);
void kvb__pxy_pipe_close(kvb__pxy_pipe_t *p);
void kvb__pxy_pipe_detach(kvb__pxy_pipe_t *p);

/* ---- The proxy ------------------------------------------------------------------------------- */

#define KVB__PXY_BUCKETS    13   /* histogram buckets, +Inf aside */
#define KVB__PXY_DOWN_MS    2000 /* an instance that did not answer is passed over this long */
#define KVB__PXY_INCARN_MAX 31u  /* bytes of an incarnation kept, without the NUL */

/* An instance the proxy routes to, with its /pd/info once learned. Reference counted: its set
 * holds one reference and every job that picked it another, so that discovery can drop it from
 * the set while requests still use it; the last kvb__pxy_upstream_unref frees it. */
typedef struct {
    atomic_uint refs;
    char url[256];   /* base URL, no trailing slash */
    bool prefill;    /* which set it is in */
    bool discovered; /* from the store, dropped when its key goes; else static, never dropped */
    char key[KVB_META_KEY_MAX + 1];            /* discovered: its store key */
    char incarnation[KVB__PXY_INCARN_MAX + 1]; /* discovered: its value's ("" if none) */
    pthread_mutex_t mu;
    struct json_t *info; /* NULL until fetched (again, once forgotten); readers take a reference */
    /* CLOCK_MONOTONIC ns until which picks pass it over: it did not answer at all (refused the
     * connection - killed, say - until discovery drops it or it is back). */
    atomic_uint_fast64_t down_until;
} kvb__upstream_t;

/* One set of instances (prefill or decode), in the order they were added. */
typedef struct {
    kvb__upstream_t **v;
    size_t n, cap;
} kvb__upset_t;

typedef struct kvb__pxy_noted kvb__pxy_noted_t; /* refused store values, logged once each */

typedef struct {
    uint64_t count, buckets[KVB__PXY_BUCKETS]; /* cumulative counts per le bucket */
    double sum;
} kvb__hist_t;

typedef struct {
    pthread_mutex_t mu;
    uint64_t requests, failures, streams;
    kvb__hist_t ttft, tpot;
    uint64_t kv_bytes;
    double kv_seconds;
} kvb__pxy_metrics_t;

struct MHD_Daemon;
struct MHD_Response;

struct kvb_pd_proxy {
    struct MHD_Daemon *mhd;
    pthread_mutex_t up_mu; /* the sets; an upstream taken out lives on while referenced */
    kvb__upset_t prefill, decode;
    atomic_uint_fast64_t rr_prefill, rr_decode, next_id;
    kvb_pd_kv_mode_t kv_mode;
    uint32_t timeout_ms;
    uint16_t port;
    char bind[64];
    uint32_t boot; /* request ids carry it so that two proxies' ids differ */
    atomic_bool stopping;
    pthread_mutex_t wk_mu; /* relay threads in flight: stop waits for them */
    pthread_cond_t wk_cv;
    unsigned workers;
    kvb__pxy_metrics_t m;
    kvb__pd_auth_t *auth; /* signs calls to instances; checks clients' API keys */

    /* Discovery (discover.c); meta is NULL without a store. */
    kvb_meta_t *meta;
    char cluster[64];
    char prefix[KVB_META_KEY_MAX + 1]; /* kvbridge/<cluster>/instances/ */
    uint32_t discover_ms;
    pthread_t disc;
    bool disc_started;
    pthread_mutex_t disc_mu; /* disc_stop; the wait between rounds */
    pthread_cond_t disc_cv;
    bool disc_stop;
    atomic_bool store_ok;        /* the last round's list call succeeded */
    atomic_uint_fast64_t rounds; /* rounds done */
    bool outage_logged;          /* discovery thread only */
    kvb__pxy_noted_t *noted;     /* discovery thread only */
};

/* A client's error: what the proxy answers, as HTTP status and a JSON error body. */
typedef struct {
    unsigned status;
    char type[32];
    char reason[32]; /* an instance's admission refusal ("queue_full", "deadline", ...) or "" */
    char msg[KVB_PD_ERR_MAX];
    /* The decode instance that could not take the request before it produced anything - it
     * answered 503 or did not answer at all - so another decode may; else "". */
    char busy_decode[256];
    /* The decode failed (502) before it produced anything, and an instance of the pair has new
     * segments since its /pd/info was cached (restarted): the request may run again. */
    bool stale_pair;
} kvb__pxy_err_t;

/* A validated POST /v1/completions. */
typedef struct {
    struct json_t *root; /* the client's body (owns prompt and model) */
    const char *prompt;
    uint32_t max_tokens;
    bool stream;
    double temperature;
    uint64_t seed;
    uint32_t timeout_ms;
    uint64_t t_start, deadline; /* CLOCK_MONOTONIC: when it came, and timeout_ms after that */
} kvb__pxy_creq_t;

/* One request on its way: the chosen pair, what the prefill step answered, and the decode call
 * still to be made. */
typedef struct {
    kvb_pd_proxy_t *px;
    char rid[48];
    kvb__upstream_t *p, *d; /* referenced until kvb__pxy_job_clear */
    kvb_pd_kv_mode_t mode;
    bool reserved; /* push: the decode holds blocks for us until /pd/abort or its deadline */
    uint64_t t_start, deadline;
    double prefill_ms;
    struct json_t *prefill_reply;
    char decode_url[300];
    char *decode_body; /* JSON text */
    /* The last upstream call's 503 (the instance could not admit it) or -1 when the instance did
     * not answer at all (connection refused): another instance may take the request. */
    long busy_status;
    bool busy_prefill;   /* ... and whether a prefill instance was called */
    long last_http;      /* the last upstream call's HTTP status (0: no answer at all) */
    bool last_unreached; /* ... and whether it never reached the instance (nothing was sent) */
    /* This attempt's /pd/prefill call, and whether an answer came: a pushing prefill answers
     * only once its writes into the decode's blocks are in (or settled), so /pd/abort may then
     * say the writers are done. */
    bool prefill_called, prefill_answered;
    struct json_t *pinfo, *dinfo; /* the /pd/info of the pair this attempt used */
    bool refetched;   /* the pair's /pd/info was fetched again after a failure (once a job) */
    unsigned retries; /* requests sent to another instance after a 503 */
    /* During kvb__pxy_prepare: the decode instances (URLs) earlier attempts of the client's
     * request found busy, which no pick of this one takes. */
    const char *const *avoid;
    size_t navoid;
} kvb__pxy_job_t;

/* How many decode instances one client request is offered to at most. */
#define KVB__PXY_DECODE_TRIES 8

/* Validates a client body; fills *out (whose root the caller frees with json_decref) or *err. */
int kvb__pxy_parse(const char *body, size_t len, uint32_t default_timeout_ms, kvb__pxy_creq_t *out,
                   kvb__pxy_err_t *err);

/* Picks a pair - its decode none of avoid[0..navoid) (URLs of decode instances that earlier
 * attempts found busy) where the set has another - and runs everything before the decode call.
 * Returns 0 with *job ready, or -1 with *err set (the job then needs no cleanup beyond
 * kvb__pxy_job_clear). */
int kvb__pxy_prepare(kvb_pd_proxy_t *px, const kvb__pxy_creq_t *rq, kvb__pxy_job_t *job,
                     kvb__pxy_err_t *err, const char *const *avoid, size_t navoid);
/* After a failed decode call: whether the request goes to another decode instance - the one
 * called could not take it (err->busy_decode) without having waited out the request's deadline,
 * `tried` instances did so before, the set has one more (and KVB__PXY_DECODE_TRIES allow it),
 * time is left and the proxy is not stopping. Logs the decision. */
bool kvb__pxy_decode_again(kvb_pd_proxy_t *px, const kvb__pxy_creq_t *rq, const kvb__pxy_err_t *err,
                           size_t tried);
/* Whether an instance could not take a call: 503 (it answered so: its admission queue is full, or
 * the request waited there until its deadline), -1 (no answer at all: nothing reached it) or 0. */
long kvb__pxy_busy_of(int rc, const kvb__pxy_res_t *rs);
/* The decode call for a whole answer: returns 0 with the patched answer in *answer, or -1 with
 * *err (and the reservation aborted). */
int kvb__pxy_decode_whole(kvb__pxy_job_t *job, struct json_t **answer, kvb__pxy_err_t *err);
/* The error for a failed upstream call. */
void kvb__pxy_upstream_error(const kvb__upstream_t *u, const char *path, int rc,
                             const kvb__pxy_res_t *rs, kvb__pxy_err_t *err);
/* Rewrites an answer's "kvbridge" stats as the proxy sees them (end-to-end TTFT, the KV moved by
 * whichever side moved it). */
void kvb__pxy_patch_stats(const kvb__pxy_job_t *job, struct json_t *answer, double ttft_ms);
/* Push mode: releases the decode's reservation after a failure (best effort, short deadline). */
void kvb__pxy_abort(kvb__pxy_job_t *job);
/* After a 502 (err->status): whether an instance of the job's pair has new segments since the
 * attempt fetched its /pd/info (it restarted on its URL) - the cache is dropped and fetched
 * again, once per job. */
bool kvb__pxy_pair_changed(kvb__pxy_job_t *job, const kvb__pxy_err_t *err);
void kvb__pxy_job_clear(kvb__pxy_job_t *job);
/* Records one finished request in the metrics (answer NULL: a failure). */
void kvb__pxy_record(kvb_pd_proxy_t *px, struct json_t *answer, bool stream);

/* Test-only fault hook: when set, called at each step of a request's flow ("reserved" after a
 * push reservation, "prefilled" after the prefill answered), so that a test can kill an instance
 * at a precise point. NULL in production. */
extern void (*kvb__pxy_fault_hook)(const char *stage, const kvb__pxy_job_t *job);

/* The upper bound of histogram bucket i (seconds). */
double kvb__pxy_bucket_bound(int i);

/* Starts the streamed decode call on a relay thread and waits until the decode starts streaming
 * or fails. Returns 0 with *resp (a libmicrohttpd response that owns the relay), or -1 with *err.
 * Takes the job over in both cases. */
int kvb__pxy_stream(kvb__pxy_job_t *job, struct MHD_Response **resp, kvb__pxy_err_t *err);

/* ---- Instance sets and discovery (discover.c) ------------------------------------------------ */

void kvb__pxy_upstream_ref(kvb__upstream_t *u);
/* Drops a reference; the last one frees the upstream. NULL is ignored. */
void kvb__pxy_upstream_unref(kvb__upstream_t *u);

/* Checks the options' instance lists and discovery settings and fills the static sets; opens
 * the store client (without contacting the store). KVB_ERR_INVALID_ARG with a reason. */
int kvb__pxy_sets_init(kvb_pd_proxy_t *px, const kvb_pd_proxy_opts_t *o, char *reason, size_t cap);
/* The next instance of a set in turn, with a reference for the caller; NULL when it is empty. */
kvb__upstream_t *kvb__pxy_pick(kvb_pd_proxy_t *px, bool prefill);
/* Marks an instance down for KVB__PXY_DOWN_MS (it gave no answer at all), and forgets its
 * /pd/info. */
void kvb__pxy_upstream_down(kvb__upstream_t *u);
/* Forgets u's cached /pd/info if it is still `info` (any, when NULL), so that the next use
 * fetches it again: a static instance restarted on its URL has new engine segments. */
void kvb__pxy_info_forget(kvb__upstream_t *u, const struct json_t *info);
/* The next instance of a set in turn whose URL is none of skip[0..nskip), referenced; NULL when
 * the set has no other. */
kvb__upstream_t *kvb__pxy_pick_other(kvb_pd_proxy_t *px, bool prefill, const char *const *skip,
                                     size_t nskip);
/* A referenced copy of both sets (prefill first) in a malloc'd array; *n its length. Release
 * with kvb__pxy_snapshot_free. */
kvb__upstream_t **kvb__pxy_snapshot(kvb_pd_proxy_t *px, size_t *n);
void kvb__pxy_snapshot_free(kvb__upstream_t **v, size_t n);
/* Starts the discovery thread (nothing without a store). KVB_ERR_SYSTEM with a reason. */
int kvb__pxy_discover_start(kvb_pd_proxy_t *px, char *reason, size_t cap);
/* Wakes and joins the discovery thread (idempotent). */
void kvb__pxy_discover_stop(kvb_pd_proxy_t *px);
/* Drops both sets and closes the store client; after kvb__pxy_discover_stop. */
void kvb__pxy_sets_free(kvb_pd_proxy_t *px);
/* The /health "discovery" object, or NULL without a store (a new reference). */
struct json_t *kvb__pxy_discovery_health(kvb_pd_proxy_t *px);

/* snprintf into a fixed buffer, never failing (truncates). */
void kvb__pxy_fmt(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
