/* SPDX-License-Identifier: Apache-2.0 */
/* What the engine exports to the layers above it (meta/, kv/) beyond the public API: small
 * questions answered under the engine's own locks, so that those layers never reach into its
 * structures (engine/internal.h is for the engine and its transports only). */
#ifndef KVB_ENGINE_EXPORT_H
#define KVB_ENGINE_EXPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvbridge/engine.h"

/* True if [addr, addr+len) lies inside one region registered with this engine. */
bool kvb__engine_registered(kvb_engine_t *e, uint64_t addr, uint64_t len);

/* The segment name the peer behind `seg` proved in its handshake (may differ from the name it
 * was opened by, e.g. a metadata alias). KVB_ERR_BAD_SEGMENT for an unknown handle. */
int kvb__segment_proven_name(kvb_engine_t *e, kvb_segment_t seg, char *buf, size_t cap);

/* KVB_OK while the peer behind `seg` is usable, else the error that ended it
 * (KVB_ERR_BAD_SEGMENT for an unknown handle). */
int kvb__segment_state(kvb_engine_t *e, kvb_segment_t seg);

/* ---- for meta/: what a segment descriptor says of this engine, and its open segments --------- */

typedef struct {
    const char *name;      /* segment name */
    const char *advertise; /* the address peers dial */
    uint16_t port;
    uint64_t incarnation;
    uint32_t pid;
    uint8_t host_id[16];
    bool same_host; /* serves a same-host (shm) path */
    const char *cluster;
} kvb_engine_identity_t;

/* Valid (strings included) while the engine is. */
void kvb__engine_identity(kvb_engine_t *e, kvb_engine_identity_t *out);
/* A snapshot of the registered regions (malloc'd; NULL when there are none). */
int kvb__engine_regions(kvb_engine_t *e, kvb_region_info_t **out, size_t *n);
/* Calls fn for every published attribute, under the engine's attribute lock (fn must not call
 * back into the engine). */
void kvb__engine_each_attr(kvb_engine_t *e,
                           void (*fn)(void *arg, const char *key, const uint8_t *value, size_t len),
                           void *arg);

typedef struct {
    kvb_segment_t seg;
    char name[KVB_NAME_MAX + 1]; /* the name it was opened by */
    uint64_t incarnation;
} kvb_open_segment_t;

/* A snapshot of the segments open and usable now (malloc'd; NULL when there are none). */
int kvb__engine_open_segments(kvb_engine_t *e, kvb_open_segment_t **out, size_t *n);
/* Fails the peer behind `seg` with `error` if it is still the incarnation `incarnation` (a reopen
 * meanwhile reached a newer one, which stays). */
void kvb__segment_fail(kvb_engine_t *e, kvb_segment_t seg, uint64_t incarnation, int error);

/* ---- the metadata binding (meta/segment.c), which the engine calls ----------------------------
 */

#define KVB_SEGDESC_ADDRS 4
#define KVB_CLUSTER_MAX   63

/* What a metadata store says of a segment. */
typedef struct {
    uint64_t incarnation;
    size_t naddr;
    struct {
        char host[KVB_NAME_MAX + 1];
        uint16_t port;
    } addr[KVB_SEGDESC_ADDRS];
} kvb_segdesc_t;

typedef struct kvb_segbind kvb_segbind_t;

/* open: creates the store client for `uri` (parses only, contacts nothing); *out stays NULL for
 *       p2p (uri NULL or "p2p"), and every other call then does nothing and returns KVB_OK.
 * start: publishes our descriptor now (failing if the store cannot take it) and starts the
 *        revalidation of open segments. stop: withdraws the descriptor, closes the client, frees.
 * publish: republishes after a change of regions or attributes (now, or by the keeper).
 * lookup: reads and checks the descriptor of segment `name`: KVB_ERR_SEGMENT_NOT_FOUND,
 *         KVB_ERR_META_UNREACHABLE, KVB_ERR_PROTOCOL/KVB_ERR_VERSION for a malformed one. */
int kvb__segdesc_open(kvb_engine_t *e, const char *uri, const char *cluster,
                      uint32_t connect_timeout_ms, uint32_t ttl_ms, kvb_segbind_t **out);
int kvb__segdesc_start(kvb_segbind_t *b);
void kvb__segdesc_stop(kvb_segbind_t *b);
int kvb__segdesc_publish(kvb_segbind_t *b, bool now);
int kvb__segdesc_lookup(kvb_segbind_t *b, const char *name, kvb_segdesc_t *out);
int kvb__segdesc_parse(const char *text, size_t len, const char *name, kvb_segdesc_t *out);

#endif
