/* SPDX-License-Identifier: Apache-2.0 */
/* The KV-cache layer: layouts that say where each layer's blocks live, their link-time validation
 * and JSON descriptors, the topology guard, TP routing, and transfer plans that turn block lists
 * into engine requests. Everything here is pure: no call does I/O or blocks.
 *
 * Why plain structs rather than an opaque handle and builders: a layout is data the caller already
 * holds (tensor pointers and shapes), it is checked as a whole - by kvb_kv_layout_validate() and
 * again at link time - and it crosses the wire as a versioned JSON descriptor, never as this
 * struct. Builders would add one call per field without adding safety, and bindings (ctypes) fill
 * plain structs directly. The structs hold only what callers fill in; enums start at 1 where 0
 * would be a plausible mistake, so a zeroed struct is rejected rather than silently meaning
 * something. */
#ifndef KVBRIDGE_KV_H
#define KVBRIDGE_KV_H

#include <stddef.h>
#include <stdint.h>

#include "kvbridge/engine.h"
#include "kvbridge/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits. A layout over them is invalid; a descriptor longer than KVB_KV_DESC_MAX is refused
 * before it is parsed. */
#define KVB_KV_MODEL_MAX  127        /* bytes of the model id, without the NUL */
#define KVB_KV_LAYERS_MAX 1024       /* layers (groups) per layout */
#define KVB_KV_TP_MAX     4096       /* tp_size and dp_size */
#define KVB_KV_HEADS_MAX  4096       /* num_kv_heads */
#define KVB_KV_DESC_MAX   (2u << 20) /* bytes of a JSON descriptor */
#define KVB_KV_REASON_MAX 256        /* a reason buffer this long never truncates in practice */

/* What a slot of a layer holds. Ids are dense, 0 .. KVB_KV_SLOT_COUNT-1. */
typedef enum {
    KVB_KV_SLOT_K = 0,
    KVB_KV_SLOT_V,
    KVB_KV_SLOT_LATENT,  /* MLA: kv_lora_rank + rope_dim per token; there is no V */
    KVB_KV_SLOT_INDEX,   /* sparse-attention indexer cache */
    KVB_KV_SLOT_K_SCALE, /* quantisation scales */
    KVB_KV_SLOT_V_SCALE,
    KVB_KV_SLOT_COUNT
} kvb_kv_slot_kind_t;

/* Order of a head-split block. HND (heads outermost) makes one rank's heads one contiguous byte
 * range, which heterogeneous TP needs; NHD is fine when both sides have the same TP. */
typedef enum { KVB_KV_ORDER_NONE = 0, KVB_KV_ORDER_HND = 1, KVB_KV_ORDER_NHD = 2 } kvb_kv_order_t;

typedef enum {
    KVB_KV_ATTN_GQA = 1, /* MHA or GQA: K and V split by KV head across TP ranks */
    KVB_KV_ATTN_MLA = 2, /* MLA: one latent, replicated on every TP rank */
} kvb_kv_attn_t;

typedef enum {
    KVB_KV_DTYPE_FP32 = 1,
    KVB_KV_DTYPE_FP16,
    KVB_KV_DTYPE_BF16,
    KVB_KV_DTYPE_FP8_E4M3,
    KVB_KV_DTYPE_FP8_E5M2,
    KVB_KV_DTYPE_INT8,
    KVB_KV_DTYPE_UINT8,
} kvb_kv_dtype_t;

/* One buffer of one layer: blocks of block_bytes each at base, base + block_bytes, ...
 * A slot is head split when num_heads > 0; then a block holds num_heads heads of tokens_per_block
 * tokens of head_bytes each (block_bytes == num_heads * tokens_per_block * head_bytes). */
typedef struct {
    uint32_t layer;          /* layer (group) id, below the layout's num_layers */
    kvb_kv_slot_kind_t kind; /* slot id */
    uint64_t base;           /* address of block 0; not 0 */
    uint64_t len;            /* bytes of the buffer (e.g. the tensor's nbytes): a multiple of
                              * block_bytes holding exactly num_blocks blocks - a cross-check that
                              * catches a wrong stride or block count at registration */
    uint64_t block_bytes;    /* bytes per block */
    uint64_t num_blocks;     /* blocks in the buffer; may differ between the two sides */
    uint32_t num_heads;      /* head-split slots: KV heads this rank holds; 0: not head split */
    uint32_t head_bytes;     /* head-split slots: bytes of one head of one token; else 0 */
    kvb_kv_order_t order;    /* head-split slots: HND or NHD; else KVB_KV_ORDER_NONE */
} kvb_kv_slot_t;

/* One TP rank's KV cache. The rules kvb_kv_layout_validate() checks are listed there. */
typedef struct {
    char model[KVB_KV_MODEL_MAX + 1]; /* model id, NUL-terminated, not empty */
    kvb_kv_dtype_t dtype;
    uint32_t tokens_per_block;
    kvb_kv_attn_t attn;
    uint32_t num_kv_heads;    /* GQA: the model's KV heads over all ranks; MLA: 0 */
    int32_t dp_size, dp_rank; /* this rank's data-parallel group */
    int32_t tp_size, tp_rank; /* this rank within its group */
    uint32_t num_layers;
    const kvb_kv_slot_t *slots; /* num_slots entries, any order; owned by the caller */
    size_t num_slots;
} kvb_kv_layout_t;

/* The part of a layout that decides routing; what `kvbridge topo` takes on its command line. */
typedef struct {
    int32_t dp_size;
    int32_t tp_size;
    kvb_kv_attn_t attn;
    uint32_t num_kv_heads; /* GQA: total KV heads; MLA: 0 */
    kvb_kv_order_t order;  /* GQA: order of the head-split blocks; MLA: KVB_KV_ORDER_NONE */
} kvb_kv_topo_t;

/* Every function below that takes `reason` writes a NUL-terminated explanation into it (at most
 * reason_cap bytes, truncated if longer; nothing when reason is NULL or reason_cap is 0). On
 * success the reason is empty, except for the guard, which always explains its verdict. */

/* Name of a slot kind ("K", "V", "LATENT", "INDEX", "K_SCALE", "V_SCALE"); "?" if out of range.
 * The string is static. */
KVB_API const char *kvb_kv_slot_name(kvb_kv_slot_kind_t kind);

/* Checks one layout on its own. Rules: model id non-empty and terminated; known dtype and
 * attention kind; tokens_per_block, num_layers, dp_size, tp_size positive and within the limits,
 * ranks below their sizes; GQA: num_kv_heads positive and either divisible by tp_size or dividing
 * it (replicated heads); MLA: num_kv_heads 0. Per slot: layer and slot id in range, no duplicate
 * (layer, slot), every layer has a slot, base, len, block_bytes, num_blocks positive, len a
 * multiple of block_bytes holding num_blocks blocks, base + len not wrapping, no two buffers
 * overlapping. GQA: K and V head split, no LATENT; MLA: nothing head split. Head-split slots:
 * num_heads is what this rank holds (num_kv_heads / tp_size, or 1 if replicated), head_bytes
 * positive, order HND or NHD, block_bytes == num_heads * tokens_per_block * head_bytes; other
 * slots have num_heads, head_bytes 0 and order NONE.
 * Returns KVB_OK, KVB_ERR_INVALID_ARG, KVB_ERR_OVERFLOW (an address or size wraps) or
 * KVB_ERR_NOMEM, with the reason naming the layer and slot. Keeps no reference to `layout`. */
KVB_API int kvb_kv_layout_validate(const kvb_kv_layout_t *layout, char *reason, size_t reason_cap);

/* Checks that two layouts can be linked: each is valid on its own, and they agree on model id,
 * dtype, tokens per block, attention kind, KV head count, layer count, the slot set of every layer,
 * each slot's block order, and each slot's block_bytes - except that head-split slots of sides with
 * different TP need only agree on head_bytes. Block counts may differ. Returns KVB_OK or the first
 * error as kvb_kv_layout_validate() does; a side's own error is prefixed "local layout: " or
 * "remote layout: ", a mismatch names the layer and slot and both values. */
KVB_API int kvb_kv_layout_check_pair(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                                     char *reason, size_t reason_cap);

/* Extracts the routing topology of a valid layout into *out (order: NHD if any head-split slot is
 * NHD, else HND; NONE for MLA). Returns KVB_OK, or the validation error (out untouched). */
KVB_API int kvb_kv_layout_topo(const kvb_kv_layout_t *layout, kvb_kv_topo_t *out);

/* Encodes a valid layout as a compact JSON descriptor into buf (NUL-terminated). On KVB_OK and on
 * KVB_ERR_TOO_LARGE *len receives the descriptor's length without the NUL; cap must exceed it,
 * else buf is untouched and KVB_ERR_TOO_LARGE returned, so call once with cap 0 to size buf. `base`
 * is written as a "0x..." string (addresses may use all 64 bits), sizes as JSON integers, so a size
 * over INT64_MAX gives KVB_ERR_OVERFLOW. Returns KVB_OK, a validation error, KVB_ERR_OVERFLOW,
 * KVB_ERR_TOO_LARGE or KVB_ERR_NOMEM. */
KVB_API int kvb_kv_layout_encode(const kvb_kv_layout_t *layout, char *buf, size_t cap, size_t *len);

/* Parses a descriptor of `len` bytes (no NUL needed) strictly: every field present with the right
 * type and range, no unknown or duplicate keys, then the layout validated. On success stores a
 * layout in *out that owns its slots; free it with kvb_kv_layout_free(). On error returns
 * KVB_ERR_INVALID_ARG (KVB_ERR_TOO_LARGE over KVB_KV_DESC_MAX, KVB_ERR_NOMEM) with a reason and
 * leaves *out untouched. `json` need not outlive the call. */
KVB_API int kvb_kv_layout_decode(const char *json, size_t len, kvb_kv_layout_t **out, char *reason,
                                 size_t reason_cap);

/* Frees a layout from kvb_kv_layout_decode(). NULL is ignored. */
KVB_API void kvb_kv_layout_free(kvb_kv_layout_t *layout);

/* Topology guard verdicts. */
typedef enum {
    KVB_KV_ALLOW_HOMO = 0, /* same TP: rank k sends whole blocks to rank k */
    KVB_KV_ALLOW_HETERO,   /* different TP that routing handles (MLA; GQA with HND blocks) */
    KVB_KV_DENY_HETERO,    /* different TP that is not supported; the reason says why */
    KVB_KV_INVALID_LOCAL,  /* the local side is malformed */
    KVB_KV_INVALID_REMOTE, /* the remote side is malformed or does not match the local one */
} kvb_kv_verdict_t;

/* "ALLOW_HOMO", ... ; "?" if out of range. The string is static. */
KVB_API const char *kvb_kv_verdict_name(kvb_kv_verdict_t verdict);

/* Decides whether two topologies can exchange KV blocks. Malformed (dp or tp not positive or over
 * KVB_KV_TP_MAX, unknown attention kind, GQA heads that do not divide TP or are not divided by it,
 * MLA with heads): INVALID_LOCAL or INVALID_REMOTE. Different attention kind, head count or block
 * order: INVALID_REMOTE. Same TP (dp may differ): ALLOW_HOMO. Different TP: ALLOW_HETERO for MLA,
 * and for GQA when the blocks are HND and every TP size divides the head count; DENY_HETERO
 * otherwise (NHD blocks, or heads replicated because TP exceeds the head count). The guard is
 * symmetric but for which side INVALID_* names. Always writes a reason. */
KVB_API kvb_kv_verdict_t kvb_kv_guard_topo(const kvb_kv_topo_t *local, const kvb_kv_topo_t *remote,
                                           char *reason, size_t reason_cap);

/* The link-time guard on full layouts: INVALID_LOCAL / INVALID_REMOTE if one fails
 * kvb_kv_layout_validate(), then kvb_kv_guard_topo() on their topologies, then INVALID_REMOTE if
 * kvb_kv_layout_check_pair() refuses the pair. Always writes a reason. */
KVB_API kvb_kv_verdict_t kvb_kv_guard(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                                      char *reason, size_t reason_cap);

/* One (prefill rank, decode rank) pair of a request's routing, both local TP ranks of their dp
 * groups. GQA: the pair moves KV heads [head_begin, head_end) of the model's heads, one
 * contiguous byte range per HND block. MLA: head_begin == head_end == 0, whole blocks. */
typedef struct {
    int32_t src_rank; /* prefill local TP rank, 0 .. prefill tp_size-1 */
    int32_t dst_rank; /* decode local TP rank, 0 .. decode tp_size-1 */
    uint32_t head_begin;
    uint32_t head_end;
} kvb_kv_route_t;

/* Routes of a request whose decode dp group is `decode_dp`, so that every decode rank receives
 * every byte it needs exactly once. Same TP: rank k -> rank k. MLA, prefill TP >= decode TP:
 * decode rank k's one writer is prefill rank (decode_dp * decode_tp + k) % prefill_tp. MLA,
 * prefill TP < decode TP: prefill rank r multicasts to decode ranks r, r + prefill_tp, ...
 * GQA: decode rank k takes heads [k*H/decode_tp, (k+1)*H/decode_tp) from the prefill rank(s)
 * holding them. Routes are ordered by dst_rank, then src_rank. Copies up to `cap` routes into
 * `out` (may be NULL when cap is 0) and stores the total in *count. Returns KVB_OK, or
 * KVB_ERR_INVALID_ARG if the guard does not allow the pair or decode_dp is out of range. */
KVB_API int kvb_kv_route(const kvb_kv_topo_t *prefill, const kvb_kv_topo_t *decode,
                         int32_t decode_dp, kvb_kv_route_t *out, size_t cap, size_t *count);

/* What to move. The sending side is remote for READ (pull) and local for WRITE (push). */
typedef struct {
    kvb_opcode_t op;            /* KVB_OP_READ or KVB_OP_WRITE */
    kvb_segment_t segment;      /* the remote side's segment, copied into every request */
    const uint64_t *src_blocks; /* block ids on the sending side */
    size_t num_src;
    const uint64_t *dst_blocks; /* dst_blocks[i] receives src_blocks[i] */
    size_t num_dst;             /* must equal num_src */
    const uint32_t *layers;     /* layers to move, each once; NULL: all layers */
    size_t num_layers;
    const kvb_kv_route_t *route; /* the (sender, receiver) pair's route; NULL: whole blocks, which
                                  * needs equal block sizes (same TP, or MLA) */
} kvb_kv_plan_args_t;

/* Turns block lists into engine requests: pairs sorted by source block, runs merged where both ids
 * step by one, one request per (run, layer, slot) - or, for a route that moves only some of a
 * head-split block's heads, one per (block, layer, slot), since those ranges are not adjacent from
 * block to block. Requests come layer by layer (in args->layers order), slot by slot, run by run.
 * Slots that are not head split move once per receiver: with a GQA route only from the sender of
 * the receiver's first head. Both layouts must pass kvb_kv_layout_check_pair(); a route must name
 * the layouts' ranks and heads they hold. Addresses are base + block * block_bytes, overflow
 * checked, and both ranges lie inside their slot's buffer. Duplicate source or destination ids,
 * unequal list lengths and out-of-range ids are errors.
 * On success stores a malloc'd array in *reqs (NULL when there is nothing to move) and its length
 * in *count; free it with kvb_kv_plan_free(). Returns KVB_OK, KVB_ERR_INVALID_ARG,
 * KVB_ERR_OVERFLOW or KVB_ERR_NOMEM (outputs untouched). The requests' addresses point into the
 * layouts' buffers, which must stay registered until the batch completes. */
KVB_API int kvb_kv_plan(const kvb_kv_layout_t *local, const kvb_kv_layout_t *remote,
                        const kvb_kv_plan_args_t *args, kvb_request_t **reqs, size_t *count,
                        char *reason, size_t reason_cap);

/* Frees an array from kvb_kv_plan(). NULL is ignored. */
KVB_API void kvb_kv_plan_free(kvb_request_t *reqs);

/* ---- Transfers: agents, links, pull and push ------------------------------------------------
 *
 * One agent per TP rank, on that rank's engine. A link joins an agent to one rank of the other
 * side; it is checked once, when opened, so an incompatible pair is refused before any request.
 * A transfer moves one request's blocks over one link, as a whole or layer by layer; when it has
 * finished, the sending side of the notices (the one that moved data: decode in pull mode, prefill
 * in push mode) tells the other side, whose agent counts the notices of every rank that routes
 * to it (TP fan-in) before reporting the request done.
 *
 * A connector, decode side in pull mode (every call below returns a status to check):
 *
 *     kvb_kv_agent_create(engine, &layout, KVB_KV_ROLE_DECODE, &agent, why, sizeof why);
 *     for (r = 0; r < prefill_tp; r++)           // once per prefill instance
 *         kvb_kv_link_open(agent, prefill_segment[r], &link[r], why, sizeof why);
 *     // per request: read from every prefill rank that routes to this rank
 *     for (r = 0; r < prefill_tp; r++) {
 *         if (!kvb_kv_link_has_route(link[r])) continue;
 *         kvb_kv_xfer_begin(link[r], req_id, KVB_OP_READ, prefill_blocks, my_blocks, n, 30000, &x);
 *         kvb_kv_xfer_all(x);
 *         rc = kvb_kv_xfer_finish(x);            // data in place, prefill told it may free
 *         kvb_kv_xfer_free(x);
 *     }
 *
 * and the prefill side: kvb_kv_expect(agent, req_id, links, n, 30000) when the request is
 * handed over, kvb_kv_wait(agent, req_id, timeout) before freeing its blocks. In push mode the
 * roles swap: prefill calls kvb_kv_xfer_begin(..., KVB_OP_WRITE, ...) and kvb_kv_xfer_layer() as
 * each layer is computed, decode expects and waits. */

typedef struct kvb_kv_agent kvb_kv_agent_t;
typedef struct kvb_kv_link kvb_kv_link_t;
typedef struct kvb_kv_xfer kvb_kv_xfer_t;

typedef enum { KVB_KV_ROLE_PREFILL = 1, KVB_KV_ROLE_DECODE = 2 } kvb_kv_role_t;

/* The segment attributes under which an agent publishes its layout descriptor and its role
 * ("prefill" or "decode"; published first, withdrawn last). */
#define KVB_KV_LAYOUT_ATTR "kvbridge.kv.layout"
#define KVB_KV_ROLE_ATTR   "kvbridge.kv.role"

/* Creates the agent of one TP rank: validates `layout` (copied), registers every slot's buffer
 * with `engine` (read and write) unless already registered, and publishes its role and the
 * layout descriptor with the engine's segment. From then on the agent consumes the engine's
 * notifications; other messages are kept for kvb_kv_agent_notify_recv(). The engine must outlive
 * the agent; the buffers stay registered until kvb_kv_agent_destroy(). */
KVB_API int kvb_kv_agent_create(kvb_engine_t *engine, const kvb_kv_layout_t *layout,
                                kvb_kv_role_t role, kvb_kv_agent_t **out, char *reason,
                                size_t reason_cap);

/* Unregisters what the agent registered, withdraws the descriptor and frees the agent. Links and
 * transfers must be closed and freed first. NULL is ignored. */
KVB_API void kvb_kv_agent_destroy(kvb_kv_agent_t *agent);

/* Opens a link to the rank serving `segment` (of the other role): opens the segment, fetches its
 * layout descriptor and role and runs kvb_kv_guard(). An incompatible pair - the guard's verdict,
 * or two ranks of the same role - is refused with KVB_ERR_INCOMPATIBLE and the reason; a peer
 * without an agent with KVB_ERR_NOT_FOUND. A peer that publishes a layout but no role (a build
 * from before roles) is taken for a rank of the other role, with a warning.
 * Blocks up to the engine's connect timeout. */
KVB_API int kvb_kv_link_open(kvb_kv_agent_t *agent, const char *segment, kvb_kv_link_t **out,
                             char *reason, size_t reason_cap);
KVB_API void kvb_kv_link_close(kvb_kv_link_t *link);
/* The verdict the guard gave this link (ALLOW_HOMO or ALLOW_HETERO). */
KVB_API kvb_kv_verdict_t kvb_kv_link_verdict(const kvb_kv_link_t *link);
/* The remote rank's layout, as published; valid while the link is open. */
KVB_API const kvb_kv_layout_t *kvb_kv_link_layout(const kvb_kv_link_t *link);
/* 1 if the prefill and decode ranks of this link exchange data (for the decode rank's dp group),
 * 0 if other ranks serve this pair. */
KVB_API int kvb_kv_link_has_route(const kvb_kv_link_t *link);

/* Starts a transfer of request `req_id` (1..255 printable characters) over `link`: KVB_OP_READ
 * from the decode side (pull), KVB_OP_WRITE from the prefill side (push). src_blocks are the
 * prefill's block ids, dst_blocks the decode's; dst_blocks[i] receives src_blocks[i]. The lists
 * are planned once, here (KVB_ERR_INVALID_ARG with a reason for a bad list); nothing moves until
 * kvb_kv_xfer_layer() or kvb_kv_xfer_all(). KVB_ERR_NOT_FOUND if the link has no route.
 * `timeout_ms` bounds the whole transfer, from this call: a layer started later gets what is left
 * of it (none left: that layer fails with KVB_ERR_TIMEOUT and moves nothing), and every batch
 * ends by then however long the layers take to compute. Bytes a layer already handed to the
 * network may still land after it, so end the transfer some time before a grant of the blocks
 * (a lease, a reservation) does. The closing notice (kvb_kv_xfer_finish) has timeout_ms of its
 * own (a failure notice less: see there). */
KVB_API int kvb_kv_xfer_begin(kvb_kv_link_t *link, const char *req_id, kvb_opcode_t op,
                              const uint64_t *src_blocks, const uint64_t *dst_blocks, size_t n,
                              int timeout_ms, kvb_kv_xfer_t **out, char *reason, size_t reason_cap);
/* Layer `layer` is ready: its blocks start moving now, while the caller computes the next one.
 * Each layer at most once. Never blocks on the network. A layer that cannot start (its error is
 * returned) makes kvb_kv_xfer_finish fail too, so the other side is told. */
KVB_API int kvb_kv_xfer_layer(kvb_kv_xfer_t *xfer, uint32_t layer);
/* Every layer not yet started. */
KVB_API int kvb_kv_xfer_all(kvb_kv_xfer_t *xfer);
/* Waits until every started layer has landed (or failed), then notifies the other side with the
 * outcome, so its kvb_kv_wait() returns. Returns KVB_OK or the first error. Call once. A failed
 * transfer is first given until 1 s past its deadline to settle (kvb_kv_xfer_settle), so that
 * the other side, which frees its blocks when it hears, hears after the last byte; its failure
 * notice then waits for the peer until 2 s past the deadline at most (at least 1 ms). */
KVB_API int kvb_kv_xfer_finish(kvb_kv_xfer_t *xfer);
/* Waits up to `timeout_ms` (>= 0; 0 polls) until no byte of the transfer can still move:
 * KVB_OK, or KVB_ERR_AGAIN while some still can (kvb_batch_settle: over shared memory or RDMA the
 * peer, or its NIC, copies into a puller's memory, and a request that timed out may still have a
 * copy under way until the peer answers or the connection is lost; a pusher's WRITE is settled
 * once the peer acknowledged it). A puller whose transfer failed calls it before handing the
 * destination blocks to another request, and keeps them out of use while it says
 * KVB_ERR_AGAIN. */
KVB_API int kvb_kv_xfer_settle(kvb_kv_xfer_t *xfer, int timeout_ms);
/* Frees the transfer (cancelling what is still pending). NULL is ignored. */
KVB_API void kvb_kv_xfer_free(kvb_kv_xfer_t *xfer);
/* Tells the other side of `link` that request `req_id` will not be transferred over it at all
 * (the decode refused it before reading, say): its kvb_kv_wait returns KVB_ERR_CANCELED now, so a
 * prefill frees a leased prompt at once instead of at its lease's end. Waits up to `timeout_ms`
 * for the notice to go. KVB_ERR_NOT_FOUND if the link has no route. */
KVB_API int kvb_kv_give_up(kvb_kv_link_t *link, const char *req_id, int timeout_ms);

/* Announces that request `req_id` will be reported by every rank among `links` that has a route
 * to this one, within `timeout_ms`. Call before those ranks can finish. Returns KVB_OK,
 * KVB_ERR_NOT_FOUND if none of the links routes here, KVB_ERR_BUSY if the id is in use. */
KVB_API int kvb_kv_expect(kvb_kv_agent_t *agent, const char *req_id, kvb_kv_link_t *const *links,
                          size_t n, int timeout_ms);
/* Waits for `req_id`: KVB_OK once every expected rank reported success; the first error one
 * reported; KVB_ERR_PEER_LOST once an expected rank's engine is gone and the notices it sent before
 * going are read (a rank that finished and then exited counts as finished); KVB_ERR_TIMEOUT at the
 * request's deadline; KVB_ERR_AGAIN if `timeout_ms` (-1: the deadline; 0 polls, reading what is
 * queued) passed first. Except for KVB_ERR_AGAIN, the id is released. Several threads may wait
 * for different ids. */
KVB_API int kvb_kv_wait(kvb_kv_agent_t *agent, const char *req_id, int timeout_ms);

/* Takes a notification that was not the agent's (see kvb_kv_agent_create); like
 * kvb_notify_recv() otherwise. */
KVB_API int kvb_kv_agent_notify_recv(kvb_kv_agent_t *agent, kvb_notification_t *out,
                                     int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif
