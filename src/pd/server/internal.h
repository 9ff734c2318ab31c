/* SPDX-License-Identifier: Apache-2.0 */
/* What the server modules share: the instance, its ranks, peer links, the table of active requests
 * (leases, reservations) and metrics. Private to src/pd/server/ and its tests.
 *
 * Names: what other programs, the tools and the tests call is in server.h (kvb_pd_*); a non-static
 * name used only inside src/pd/server/ is declared here as kvb__srv_* (macros KVB__SRV_*), as
 * kvb__model_* is in model/ and kvb__pxy_* in proxy/. Static functions are short and unprefixed. */
#ifndef KVB_PD_SERVER_INTERNAL_H
#define KVB_PD_SERVER_INTERNAL_H

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "kvbridge/engine.h"
#include "kvbridge/kv.h"
#include "meta/meta.h"
#include "pd/auth.h"
#include "pd/http.h"
#include "pd/model/model.h"
#include "pd/server/server.h"

#define KVB__SRV_REQ_ID_MAX 64u
#define KVB__SRV_SEGS_MAX   KVB_PD_SERVER_TP_MAX
#define KVB__SRV_HIST_N     14 /* histogram buckets, +Inf included */

/* One TP rank: its engine, the cache in that engine's kvb_alloc memory, and its KV agent. */
typedef struct {
    kvb_engine_t *engine;
    kvb_pd_cache_t *cache;
    kvb_kv_agent_t *agent; /* NULL for a colocated instance: it never transfers */
    kvb_kv_layout_t layout;
    kvb_kv_slot_t *slots;
    uint64_t block_bytes; /* sum of the layout's block_bytes: what one block of this rank holds */
} kvb__srv_rank_t;

/* The links of every local rank to one remote rank (segment), or why the guard refused them. */
typedef struct {
    char seg[KVB_NAME_MAX + 1];
    kvb_kv_link_t **links; /* [tp]; NULL entries when refused */
    kvb_kv_verdict_t verdict;
    char reason[KVB_KV_REASON_MAX];
    bool refused;
} kvb__srv_peer_t;

/* An id the instance holds: a prefill's lease (pull), a decode's reservation (push), or a request
 * being served (so that an id used twice while active is refused). */
typedef enum {
    KVB__SRV_ENT_ACTIVE = 1, /* a request in a handler: nothing for the reaper */
    KVB__SRV_ENT_LEASE,      /* prefill, pull: blocks kept until every routed decode rank read */
    KVB__SRV_ENT_RESERVED,   /* decode, push: blocks reserved, notices expected */
    KVB__SRV_ENT_DRAIN,      /* the agents' expectations still to be released; the blocks
                              * kept too while a writer may still land bytes in them */
    KVB__SRV_ENT_SETTLE,     /* a failed transfer's blocks, kept out of use until no byte of
                              * it can land any more (kvb_kv_xfer_settle) */
    KVB__SRV_ENT_KINDS
} kvb__srv_ent_kind_t;

typedef struct kvb__srv_ent {
    struct kvb__srv_ent *next;
    char id[KVB__SRV_REQ_ID_MAX + 1];
    kvb__srv_ent_kind_t kind;
    kvb_pd_seq_t seq;               /* LEASE / RESERVED: the blocks held */
    uint32_t n_prompt;              /* RESERVED: tokens of the prompt */
    uint32_t *toks;                 /* RESERVED: the prompt's tokens */
    uint64_t deadline_ns;           /* LEASE / RESERVED / DRAIN: when the agents give up */
    uint64_t hold_until_ns;         /* DRAIN: its blocks stay out of use until then as well */
    uint64_t pending_mask;          /* ranks whose kvb_kv_wait has not returned (bit r) */
    char (*segs)[KVB_NAME_MAX + 1]; /* the peer's segments, to relink if it is lost */
    size_t nsegs;
    kvb_kv_xfer_t **xfers; /* SETTLE: the transfers still unsettled, freed with the entry */
    size_t nxfers;
} kvb__srv_ent_t;

typedef struct {
    uint64_t count;
    double sum;
    uint64_t buckets[KVB__SRV_HIST_N];
} kvb__srv_hist_t;

/* Why a request was not admitted: the HTTP status, a machine-readable reason ("queue_full",
 * "deadline", "too_large", "stopping") and the seconds a client should wait before retrying. */
typedef struct {
    unsigned status;
    const char *reason; /* static */
    unsigned retry_after_s;
    char msg[512];
} kvb__srv_refusal_t;

struct kvb__srv_waiter;

struct kvb_pd_server {
    kvb_pd_server_opts_t opts;
    char addr[64];
    char model_spec[4096];
    kvb_pd_model_t *model;
    uint32_t tp, tpb;
    kvb__srv_rank_t *ranks;
    kvb_pd_cache_t **caches; /* [tp], for kvb_pd_forward */
    kvb_pd_blocks_t *pool;
    uint64_t total_blocks;
    uint64_t stall_layer; /* fault hook KVB_PD_FAULT_STALL_LAYER: push stalls after it; or ~0 */

    /* Forward passes are serialized: the caches are not thread-safe per sequence, and one
     * pass at a time keeps a small instance simple and deterministic. */
    pthread_mutex_t fwd_mu;

    pthread_mutex_t links_mu; /* peers, dead links */
    kvb__srv_peer_t *peers;
    size_t npeers;
    kvb_kv_link_t **dead; /* links to lost peers, closed at destroy (in-flight users may remain) */
    size_t ndead;

    pthread_mutex_t mu; /* the entry table, metrics, stop */
    pthread_cond_t cv;
    kvb__srv_ent_t *ents;
    bool stop;
    pthread_t reaper;
    bool reaper_started;
    atomic_ulong req_counter;
    atomic_ullong refused_logged_ns; /* when a refused /pd/ call was last logged */
    atomic_uint refused_unlogged;    /* refused since then, not logged one by one */

    /* Admission (admit.c), under mu: the FIFO of requests waiting for blocks. */
    pthread_cond_t adm_cv; /* broadcast when blocks come back or the head changes */
    struct kvb__srv_waiter *q_head, *q_tail;
    uint32_t q_len, max_queue;
    bool adm_stop;
    uint64_t m_admitted, m_waited, m_rej_full, m_rej_deadline; /* m_waited: had to queue */
    kvb__srv_hist_t m_wait;

    /* Continuous batching (gen.c): decode steps waiting for the next batched pass. */
    pthread_mutex_t bat_mu;
    pthread_cond_t bat_cv;
    struct kvb__srv_step *bat_head, *bat_tail;
    bool bat_running;
    uint64_t m_batches, m_batch_tokens, m_batch_max; /* under bat_mu */

    uint64_t m_requests, m_failures, m_kv_bytes;
    double m_kv_seconds;
    kvb__srv_hist_t m_ttft, m_tpot;

    struct MHD_Daemon *httpd;
    uint16_t port;
    kvb__pd_auth_t *auth; /* signed /pd/ calls, tickets, API keys */

    /* Registration with a metadata store (reg.c); meta is NULL without one. reg_mu guards meta
     * once HTTP serves (/health reads it while a stop closes it). */
    char metadata[KVB_META_URI_MAX + 1];
    char cluster[64];
    pthread_mutex_t reg_mu;
    kvb_meta_t *meta;
    char inst_key[KVB_META_KEY_MAX + 1]; /* our key, once registered */
    char incarnation[17];                /* 16 hex digits, new at every start */
};

/* ---- server.c -------------------------------------------------------------------------------- */

/* Routes one complete request; `body` is NUL-terminated. */
enum MHD_Result kvb__srv_route(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                               const char *method, const char *url, const char *body, size_t len);

/* ---- ents.c: the entry table and the reaper -------------------------------------------------- */

/* Adds an entry for `id` (ACTIVE); KVB_ERR_BUSY if the id is held, KVB_ERR_NOMEM. */
int kvb__srv_ent_add(kvb_pd_server_t *srv, const char *id, kvb__srv_ent_t **out);
/* Finds the entry of `id`; caller holds srv->mu. */
kvb__srv_ent_t *kvb__srv_ent_find(kvb_pd_server_t *srv, const char *id);
/* Unlinks and frees an entry (its blocks must be released already); caller holds srv->mu. */
void kvb__srv_ent_remove(kvb_pd_server_t *srv, kvb__srv_ent_t *e);
/* Drops the ACTIVE entry of `id` (handlers call this when they end). */
void kvb__srv_ent_done(kvb_pd_server_t *srv, const char *id);
/* Copies segs[0..n) into the entry (KVB_ERR_NOMEM). Caller holds srv->mu or owns the entry. */
int kvb__srv_ent_set_segs(kvb__srv_ent_t *e, char *const *segs, size_t n);
/* How long past a reservation's end a pushing prefill's bytes may still land: its writes end
 * GRANT_MARGIN_MS (500 ms) before that end, and a failed transfer settles for up to 1 s past its
 * deadline before it says so (kvb_kv_xfer_finish). Half a second to spare. */
#define KVB__SRV_WRITE_SETTLE_MS 1000
/* Turns the entry into DRAIN for the ranks in `mask`, or removes it when mask is 0 and nothing is
 * held. `writers_done`: no byte of a writer can land in its blocks any more (none was told of
 * them, or each one that was has finished) - they go back to the pool now. Otherwise they stay out
 * of use until every rank in `mask` has heard from its writers and, when `hold_until` (monotonic
 * ns) is not 0, until then (a writer that never said it finished). Caller holds srv->mu. */
void kvb__srv_ent_drain(kvb_pd_server_t *srv, kvb__srv_ent_t *e, uint64_t mask, uint64_t deadline,
                        bool writers_done, uint64_t hold_until);
void *kvb__srv_reaper_main(void *arg);
/* Counts the entries by kind: counts[KVB__SRV_ENT_ACTIVE] ... counts[KVB__SRV_ENT_SETTLE]. */
void kvb__srv_ents_count(kvb_pd_server_t *srv, uint64_t counts[KVB__SRV_ENT_KINDS]);
/* The ACTIVE entry `e` (the handler's own; NULL: it holds no blocks) failed with transfers `xs`
 * (n, taken over) still unsettled: its blocks stay out of use until the reaper sees them all
 * settled. */
void kvb__srv_ent_settle(kvb_pd_server_t *srv, kvb__srv_ent_t *e, kvb_kv_xfer_t **xs, size_t n);
/* Frees every entry's blocks (at shutdown). */
void kvb__srv_ents_clear(kvb_pd_server_t *srv);

/* ---- admit.c: admission ---------------------------------------------------------------------- */

/* Reserves blocks for `tokens` positions in seq, waiting in the instance's FIFO queue while they
 * are not free, until deadline_ns. Returns KVB_OK; KVB_ERR_TOO_LARGE (400: more blocks than the
 * instance has, refused at once) or KVB_ERR_BUSY (503: queue full, deadline passed, stopping)
 * with *ref filled. */
int kvb__srv_admit(kvb_pd_server_t *srv, kvb_pd_seq_t *seq, uint64_t tokens, uint64_t deadline_ns,
                   kvb__srv_refusal_t *ref);
/* Wakes the queue after blocks went back to the pool; caller holds srv->mu. */
void kvb__srv_admit_wake(kvb_pd_server_t *srv);
/* The same, taking srv->mu. */
void kvb__srv_admit_wake_locked(kvb_pd_server_t *srv);
/* Fails every waiter and every later admission (the server is stopping). */
void kvb__srv_admit_stop(kvb_pd_server_t *srv);
/* The /health "queue" object. */
json_t *kvb__srv_admit_health(kvb_pd_server_t *srv);
/* Answers a refusal: the error JSON with its "reason", Retry-After on a 503. Counts a failure. */
enum MHD_Result kvb__srv_http_refuse(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                     const kvb__srv_refusal_t *ref);

/* ---- reg.c: registration with a metadata store ----------------------------------------------- */

/* Checks the metadata options (cluster name, TTL, URI length); the reason says what is wrong. */
int kvb__srv_reg_check(const kvb_pd_server_opts_t *o, char *reason, size_t cap);
/* Opens the store client (when opts name a store) and checks that the store answers, before
 * anything slow starts. KVB_ERR_INVALID_ARG for a malformed URI, KVB_ERR_META_UNREACHABLE. */
int kvb__srv_reg_open(kvb_pd_server_t *srv, char *reason, size_t cap);
/* Registers the instance (HTTP must serve already); the store client keeps the key alive. */
int kvb__srv_reg_publish(kvb_pd_server_t *srv, char *reason, size_t cap);
/* Appends the /health "metadata" object (nothing without a store). */
void kvb__srv_reg_health(kvb_pd_server_t *srv, json_t *health);
/* Withdraws the registration and closes the client (idempotent). */
void kvb__srv_reg_close(kvb_pd_server_t *srv);

/* ---- links.c --------------------------------------------------------------------------------- */

/* Links every local rank to every segment of segs[0..n): out[r * n + m] is rank r's link to
 * segs[m]. Cached by segment. On a refusal returns KVB_ERR_INCOMPATIBLE; on any error `why`
 * says which peer and why. */
int kvb__srv_links_get(kvb_pd_server_t *srv, char *const *segs, size_t n, kvb_kv_link_t **out,
                       char *why, size_t why_cap);
/* True for a kvb__srv_links_get failure that says the segment is no member of this cluster (no
 * such name, not a kvbridge engine, or it does not know the cluster secret). */
bool kvb__srv_links_unknown(int rc);
/* Moves the cached links to `seg` aside (the peer was lost), so the next request relinks. */
void kvb__srv_links_drop(kvb_pd_server_t *srv, const char *seg);
/* Appends the /health "links" array. */
void kvb__srv_links_health(kvb_pd_server_t *srv, json_t *arr, bool *degraded);
void kvb__srv_links_free(kvb_pd_server_t *srv);

/* ---- gen.c: generation, completions, streaming ----------------------------------------------- */

/* Parameters of a generation, parsed from a body. */
typedef struct {
    const char *prompt; /* the body's string, valid while the body is */
    size_t prompt_len;
    uint32_t max_tokens;
    bool stream;
    float temperature;
    uint64_t seed;
    uint32_t timeout_ms;
} kvb__srv_params_t;

typedef struct kvb__srv_gen kvb__srv_gen_t;

/* Reads the generation fields of `body` (defaults for missing ones; "prompt" may be missing
 * unless need_prompt, then p->prompt is NULL); an error's 400 text in `why`. */
int kvb__srv_params_parse(json_t *body, kvb__srv_params_t *p, bool need_prompt, char *why,
                          size_t cap);

/* Creates a generation over `seq` (taken over: the generation releases its blocks) holding
 * n_prompt cached positions (or, when colocated, none yet: the first step runs the prompt),
 * admitting it for every position it can need (waiting in the queue until the deadline).
 * has_t0: t0 is the first token, already sampled by a prefill. On an error *ref says why. */
int kvb__srv_gen_create(kvb_pd_server_t *srv, const char *req_id, const kvb__srv_params_t *p,
                        uint32_t *prompt, size_t n_prompt, kvb_pd_seq_t *seq, bool has_t0,
                        uint32_t t0, uint64_t t_start, kvb__srv_gen_t **out,
                        kvb__srv_refusal_t *ref);
/* Records the KV transfer of this request (for the answer's stats). */
void kvb__srv_gen_set_kv(kvb__srv_gen_t *g, uint64_t bytes, double seconds);
/* Answers: the whole completion as JSON, or an SSE stream. Frees `g` (now or when the stream
 * ends) and drops the request's entry. */
enum MHD_Result kvb__srv_gen_respond(kvb__srv_gen_t *g, struct MHD_Connection *conn);

/* The /health "batching" object: passes, tokens, largest batch. */
json_t *kvb__srv_batch_health(kvb_pd_server_t *srv);

/* POST /v1/completions on a colocated instance. */
enum MHD_Result kvb__srv_completions(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                     json_t *body);

/* Tokenizes prompt with BOS into a malloc'd array. */
int kvb__srv_tokenize(const char *prompt, size_t len, uint32_t **out, size_t *n);

/* ---- endpoints.c: the /pd endpoints ---------------------------------------------------------- */

enum MHD_Result kvb__srv_info(kvb_pd_server_t *srv, struct MHD_Connection *conn);
enum MHD_Result kvb__srv_prefill(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body);
enum MHD_Result kvb__srv_decode(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body);
enum MHD_Result kvb__srv_reserve(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body);
enum MHD_Result kvb__srv_abort(kvb_pd_server_t *srv, struct MHD_Connection *conn, json_t *body);

/* ---- metrics.c ------------------------------------------------------------------------------- */

void kvb__srv_hist_add(kvb__srv_hist_t *h, double v);
void kvb__srv_metric_request(kvb_pd_server_t *srv);
void kvb__srv_metric_failure(kvb_pd_server_t *srv);
void kvb__srv_metric_timing(kvb_pd_server_t *srv, double ttft_s, double tpot_s, bool has_tpot);
void kvb__srv_metric_kv(kvb_pd_server_t *srv, uint64_t bytes, double seconds);
enum MHD_Result kvb__srv_metrics(kvb_pd_server_t *srv, struct MHD_Connection *conn);
enum MHD_Result kvb__srv_health(kvb_pd_server_t *srv, struct MHD_Connection *conn);

/* A failure answer that also counts in the failures metric. */
enum MHD_Result kvb__srv_http_fail(kvb_pd_server_t *srv, struct MHD_Connection *conn,
                                   unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
