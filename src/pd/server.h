/* SPDX-License-Identifier: Apache-2.0 */
/* The PD instance server: one prefill, decode or colocated instance of TP N ranks serving the
 * HTTP API of docs/pd-protocol.md with libmicrohttpd, moving KV caches through kvbridge agents. */
#ifndef KVB_PD_SERVER_H
#define KVB_PD_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "kvbridge/status.h"

typedef enum { KVB_PD_ROLE_PREFILL = 1, KVB_PD_ROLE_DECODE, KVB_PD_ROLE_BOTH } kvb_pd_role_t;
typedef enum { KVB_PD_KV_PULL = 1, KVB_PD_KV_PUSH } kvb_pd_kv_mode_t;

#define KVB_PD_SERVER_TP_MAX     64u
#define KVB_PD_SERVER_BLOCKS     512u       /* default blocks per rank cache */
#define KVB_PD_SERVER_LEASE_MS   30000u     /* default pull lease */
#define KVB_PD_SERVER_BODY_MAX   (1u << 20) /* request bodies over this get 413 */
#define KVB_PD_SERVER_TIMEOUT_MS 30000u     /* default deadline of a request */
#define KVB_PD_SERVER_MAX_TOKENS 4096u

/* What `kvbridge serve` takes; zero-initialise, then fill. */
typedef struct {
    kvb_pd_role_t role;
    kvb_pd_kv_mode_t kv_mode;
    const char *model; /* preset name or weight file */
    uint64_t seed;     /* preset weights' seed */
    uint32_t tp;       /* ranks, 1..KVB_PD_SERVER_TP_MAX */
    const char *bind;  /* address for HTTP and the engines; NULL: "127.0.0.1" */
    uint16_t port;     /* HTTP port; 0: any free one (see kvb_pd_server_port) */
    uint64_t blocks;   /* blocks per rank; 0: KVB_PD_SERVER_BLOCKS */
    uint32_t lease_ms; /* pull lease; 0: KVB_PD_SERVER_LEASE_MS */
} kvb_pd_server_opts_t;

typedef struct kvb_pd_server kvb_pd_server_t;

/* "prefill", "decode", "both" / "pull", "push" (static strings), and their parsers (0 or -1). */
const char *kvb_pd_role_name(kvb_pd_role_t role);
const char *kvb_pd_kv_mode_name(kvb_pd_kv_mode_t mode);
int kvb_pd_role_parse(const char *s, kvb_pd_role_t *out);
int kvb_pd_kv_mode_parse(const char *s, kvb_pd_kv_mode_t *out);

/* Loads the model, creates the rank engines, caches and agents, starts the lease reaper and the
 * HTTP daemon; requests are served from other threads as soon as this returns. Returns KVB_OK,
 * or an error with a reason (bad options, model refused, port in use: KVB_ERR_ADDR_IN_USE);
 * *out is set only on success. `opts` strings need not outlive the call. */
int kvb_pd_server_create(const kvb_pd_server_opts_t *opts, kvb_pd_server_t **out, char *reason,
                         size_t reason_cap);

/* The HTTP port served (the one picked when opts->port was 0). */
uint16_t kvb_pd_server_port(const kvb_pd_server_t *srv);

/* The address served, as given (or "127.0.0.1"). Valid while the server is. */
const char *kvb_pd_server_addr(const kvb_pd_server_t *srv);

/* Stops the HTTP daemon (waiting for requests in progress, whose waits all have deadlines), the
 * reaper, frees every lease and reservation, links, agents, caches and engines. NULL is ignored. */
void kvb_pd_server_destroy(kvb_pd_server_t *srv);

#endif
