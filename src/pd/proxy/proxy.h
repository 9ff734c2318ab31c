/* SPDX-License-Identifier: Apache-2.0 */
/* The PD proxy (docs/pd-protocol.md): an OpenAI-style front end that pairs a prefill and a decode
 * instance per request, drives the pull or push flow with libcurl and relays the answer; and the
 * small HTTP client (completions, streamed or not) that the proxy's tools and tests share. */
#ifndef KVB_PD_PROXY_H
#define KVB_PD_PROXY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/server/server.h" /* kvb_pd_kv_mode_t and its parser */

#define KVB_PD_PROXY_TIMEOUT_MS 30000u     /* default deadline of a request */
#define KVB_PD_PROXY_MAX_CONNS  4096u      /* default bound of client connections (a thread each) */
#define KVB_PD_PROXY_BODY_MAX   (1u << 20) /* largest client request body */
#define KVB_PD_ERR_MAX          512u       /* bytes of an error message kept, with the NUL */

/* A proxy's kv_mode when it takes what the prefill instance's /pd/info says. */
#define KVB_PD_KV_AUTO ((kvb_pd_kv_mode_t)0)

#define KVB_PD_PROXY_DISCOVER_MS 1000u /* default interval of discovery rounds */

/* What the caller fills in to start a proxy. Strings are copied. */
typedef struct {
    const char *const *prefill; /* base URLs ("http://127.0.0.1:8001"); n_prefill >= 1 unless
                                 * `discover` is set */
    size_t n_prefill;
    const char *const *decode; /* base URLs; n_decode >= 1 unless `discover` is set */
    size_t n_decode;
    const char *bind; /* IPv4 address to listen on; NULL: 127.0.0.1 */
    uint16_t port;    /* 0: any free port (see kvb_pd_proxy_port) */
    kvb_pd_kv_mode_t kv_mode;
    uint32_t timeout_ms; /* a request's deadline; 0: KVB_PD_PROXY_TIMEOUT_MS */
    /* Client connections served at once, each on a thread of its own; one more is closed as it
     * is accepted. 0: KVB_PD_PROXY_MAX_CONNS. */
    uint32_t max_connections;
    /* A metadata store to discover instances from (kvb_pd_server_opts_t.metadata's forms), or
     * NULL. A thread lists kvbridge/<cluster>/instances/ every discover_interval_ms and adds
     * the prefill and decode instances it finds, dropping those whose key went away; the static
     * lists above are kept whatever the store says. */
    const char *discover;
    const char *cluster;           /* NULL: "default" */
    uint32_t discover_interval_ms; /* 0: KVB_PD_PROXY_DISCOVER_MS */
    /* Bearer keys for /v1/completions (one per line, '#' comments), or NULL: open. Calls to the
     * instances' /pd/ endpoints are signed with the cluster secret (KVB_SECRET_FILE) when set. */
    const char *api_key_file;
    /* Seconds a client connection may stay silent before it is closed; 0: the request timeout
     * plus 60 s (a streamed answer's pauses stay within it). */
    uint32_t idle_timeout_s;
} kvb_pd_proxy_opts_t;

typedef struct kvb_pd_proxy kvb_pd_proxy_t;

/* Starts a proxy serving POST /v1/completions, GET /health and GET /metrics on its own threads
 * (one per connection, plus one per streamed answer, plus the discovery thread). Contacts no
 * instance yet: each one's /pd/info is fetched on first use and cached; the store is first listed
 * by the discovery thread, so a store that is down does not stop the start. While a set is empty
 * requests get 503. Returns KVB_OK, KVB_ERR_INVALID_ARG (bad options - a malformed store URI
 * too - the reason says which), KVB_ERR_SYSTEM (cannot listen) or KVB_ERR_NOMEM; *out is set
 * only on success. */
int kvb_pd_proxy_start(const kvb_pd_proxy_opts_t *opts, kvb_pd_proxy_t **out, char *reason,
                       size_t reason_cap);

/* The port the proxy listens on (the chosen one when opts->port was 0). */
uint16_t kvb_pd_proxy_port(const kvb_pd_proxy_t *px);

/* Stops the discovery thread (at once between rounds; a list call in progress ends within its
 * deadline), stops accepting, fails the requests in flight (upstream calls are aborted; a stream
 * ends with an error event), waits for every thread and frees the proxy. NULL is ignored. */
void kvb_pd_proxy_stop(kvb_pd_proxy_t *px);

/* ---- Client side: one completion, as a client of the proxy or of an instance sees it ----------
 */

/* The outcome of kvb_pd_complete(). `tokens` and `text` are malloc'd; free with
 * kvb_pd_completion_free(). */
typedef struct {
    long status;      /* HTTP status; 0 when no response came (error says why) */
    bool ok;          /* 200 and a complete answer (for a stream: [DONE] seen, no error event) */
    bool streamed;    /* the answer came as server-sent events */
    char *text;       /* the generated text, NUL-terminated */
    uint32_t *tokens; /* kvbridge.tokens */
    size_t n_tokens;
    char finish_reason[16];
    uint32_t prompt_tokens, completion_tokens; /* usage */
    double ttft_ms, tpot_ms, kv_transfer_ms;   /* the answer's "kvbridge" stats */
    uint64_t kv_bytes;
    double client_ttft_ms;      /* request sent -> first token event (streams) or the answer */
    double client_total_ms;     /* request sent -> answer complete */
    uint32_t events;            /* token events received (streams) */
    char error[KVB_PD_ERR_MAX]; /* the error message, when !ok */
    /* When !ok, what kind of failure: the error's "reason" (an instance's admission refusal:
     * "queue_full", "deadline", "too_large", ...), else "timeout", "no_response",
     * "stream_error" (an error event), "stream_broken" (no [DONE]) or "" (see status). */
    char reason[32];
} kvb_pd_completion_t;

/* POSTs `body` (a JSON text) to base_url + "/v1/completions" and collects the answer, parsing
 * server-sent events when the answer is a stream. Every outcome is reported in *out (which the
 * caller must free with kvb_pd_completion_free, whatever happened); the return is 0 when out->ok,
 * else -1. Thread-safe once curl_global_init() has run (kvb_pd_client_init). */
int kvb_pd_complete(const char *base_url, const char *body, uint32_t timeout_ms,
                    kvb_pd_completion_t *out);
/* The same with "Authorization: Bearer <api_key>" (NULL: none); the key is 1..256 printable
 * characters without spaces, as an --api-key-file line (kvb__pd_auth_first_key). */
int kvb_pd_complete_as(const char *base_url, const char *api_key, const char *body,
                       uint32_t timeout_ms, kvb_pd_completion_t *out);

void kvb_pd_completion_free(kvb_pd_completion_t *c);

/* Sends one request (body NULL: GET, else POST of a JSON text) and returns the status (0 when no
 * response came, error says why) with the body in *resp (malloc'd, NUL-terminated, or NULL). */
long kvb_pd_http(const char *url, const char *body, uint32_t timeout_ms, char **resp, char *error,
                 size_t error_cap);

/* Initializes libcurl once per process (idempotent, thread-safe). Returns 0 or -1. */
int kvb_pd_client_init(void);

#endif
