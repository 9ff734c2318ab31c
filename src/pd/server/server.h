/* SPDX-License-Identifier: Apache-2.0 */
/* The PD instance server: one prefill, decode or colocated instance of TP N ranks serving the
 * HTTP API of docs/pd-protocol.md with libmicrohttpd, moving KV caches through kvbridge agents. */
#ifndef KVB_PD_SERVER_H
#define KVB_PD_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvbridge/status.h"

typedef enum { KVB_PD_ROLE_PREFILL = 1, KVB_PD_ROLE_DECODE, KVB_PD_ROLE_BOTH } kvb_pd_role_t;
typedef enum { KVB_PD_KV_PULL = 1, KVB_PD_KV_PUSH } kvb_pd_kv_mode_t;

#define KVB_PD_SERVER_TP_MAX       64u
#define KVB_PD_SERVER_BLOCKS       512u       /* default blocks per rank cache */
#define KVB_PD_SERVER_LEASE_MS     30000u     /* default pull lease */
#define KVB_PD_SERVER_LEASE_MIN_MS 1000u      /* shortest: a decode's reads end 500 ms before it */
#define KVB_PD_SERVER_BODY_MAX     (1u << 20) /* request bodies over this get 413 */
#define KVB_PD_SERVER_TIMEOUT_MS   30000u     /* default deadline of a request */
#define KVB_PD_SERVER_MAX_TOKENS   4096u
#define KVB_PD_SERVER_META_MS      3000u /* deadline of each metadata store call */
#define KVB_PD_SERVER_MAX_QUEUE    256u  /* default bound of the admission queue */
#define KVB_PD_SERVER_MAX_CONNS    1024u /* default bound of HTTP connections (a thread each) */
#define KVB_PD_SERVER_IDLE_S       120u  /* an HTTP connection silent this long is closed */

/* What `kvbridge serve` takes; zero-initialise, then fill. */
typedef struct {
    kvb_pd_role_t role;
    kvb_pd_kv_mode_t kv_mode;
    const char *model; /* preset name or weight file */
    uint64_t seed;     /* preset weights' seed */
    uint32_t tp;       /* ranks, 1..KVB_PD_SERVER_TP_MAX */
    /* Address of HTTP and the engines; NULL: "127.0.0.1". */
    const char *bind;
    bool insecure;     /* engines may bind a non-loopback address without a cluster secret */
    uint16_t port;     /* HTTP port; 0: any free one (see kvb_pd_server_port) */
    uint64_t blocks;   /* blocks per rank; 0: KVB_PD_SERVER_BLOCKS */
    uint32_t lease_ms; /* pull lease; 0: KVB_PD_SERVER_LEASE_MS */
    /* Requests that may wait for KV blocks at once (FIFO, each until its deadline); one more is
     * answered 503 with Retry-After. 0: KVB_PD_SERVER_MAX_QUEUE. */
    uint32_t max_queue;
    /* HTTP connections served at once, each on a thread of its own; one more is closed as it is
     * accepted. 0: KVB_PD_SERVER_MAX_CONNS. */
    uint32_t max_connections;
    /* Seconds an HTTP connection may stay silent (a slow or stalled client, an idle keep-alive
     * connection) before it is closed and its thread freed. 0: KVB_PD_SERVER_IDLE_S. */
    uint32_t idle_timeout_s;
    /* The engines' data paths and libfabric provider (kvb_config_t.protocol, .fabric_provider);
     * NULL: the engine's defaults ("auto", or KVB_PROTOCOL / KVB_FABRIC_PROVIDER). */
    const char *protocol;
    const char *fabric_provider;
    /* A metadata store ("etcd://h:p[,h:p]", "redis://[:pw@]h:p[/db]", "http://h:p[/prefix]"),
     * or NULL, "" or "p2p" for none. With one, every rank's engine publishes its segment there
     * and the instance registers itself under kvbridge/<cluster>/instances/<addr>:<port> (see
     * docs/pd-protocol.md) for proxies to discover. */
    const char *metadata;
    const char *cluster;      /* namespace of the keys; NULL: "default" */
    uint32_t metadata_ttl_ms; /* how long the keys outlive a crash; 0: 10000, else >= 1000 */
    /* Bearer keys for /v1/completions (one per line), or NULL: open. The /pd/ endpoints are
     * authenticated with the cluster secret (KVB_SECRET_FILE) instead: docs/pd-protocol.md. */
    const char *api_key_file;
} kvb_pd_server_opts_t;

typedef struct kvb_pd_server kvb_pd_server_t;

/* Whether `name` can be a cluster name in metadata keys: 1..63 characters of [A-Za-z0-9._-]. */
bool kvb_pd_cluster_valid(const char *name);

/* Whether `uri` names a metadata store in a form the store client accepts (the store is not
 * contacted; "p2p" and "" name none, so they are not). Logs why when it is not. */
bool kvb_pd_store_uri_valid(const char *uri);

/* "prefill", "decode", "both" / "pull", "push" (static strings), and their parsers (0 or -1). */
const char *kvb_pd_role_name(kvb_pd_role_t role);
const char *kvb_pd_kv_mode_name(kvb_pd_kv_mode_t mode);
int kvb_pd_role_parse(const char *s, kvb_pd_role_t *out);
int kvb_pd_kv_mode_parse(const char *s, kvb_pd_kv_mode_t *out);

/* Loads the model, creates the rank engines, caches and agents, starts the lease reaper and the
 * HTTP daemon and, with a metadata store, registers the instance once HTTP serves; requests are
 * served from other threads as soon as this returns. Returns KVB_OK, or an error with a reason
 * (bad options, model refused, port in use: KVB_ERR_ADDR_IN_USE, the store cannot be reached:
 * KVB_ERR_META_UNREACHABLE); *out is set only on success. `opts` strings need not outlive the
 * call. */
int kvb_pd_server_create(const kvb_pd_server_opts_t *opts, kvb_pd_server_t **out, char *reason,
                         size_t reason_cap);

/* The HTTP port served (the one picked when opts->port was 0). */
uint16_t kvb_pd_server_port(const kvb_pd_server_t *srv);

/* The address served, as given (or "127.0.0.1"). Valid while the server is. */
const char *kvb_pd_server_addr(const kvb_pd_server_t *srv);

/* Withdraws the instance's registration (so that proxies stop routing to it first), stops the
 * HTTP daemon (waiting for requests in progress, whose waits all have deadlines), the reaper,
 * frees every lease and reservation, links, agents, caches and engines. NULL is ignored. */
void kvb_pd_server_destroy(kvb_pd_server_t *srv);

#endif
