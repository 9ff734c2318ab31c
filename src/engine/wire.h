/* SPDX-License-Identifier: Apache-2.0 */
/* The kvbridge wire protocol: fixed 40-byte little-endian frame headers plus typed payloads. The
 * codecs here do no I/O: they turn bytes into messages or a precise error, checking every length.
 */
#ifndef KVB_ENGINE_WIRE_H
#define KVB_ENGINE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/registry.h"
#include "kvbridge/engine.h"

#define KVB_WIRE_MAGIC 0x3142564Bu /* "KVB1" read as little-endian */
/* 2: mutual authentication; 3: same-host answer runs; 4: answer runs over TCP; 5: same-host
 * request runs; 6: same-host requests carry their deadline. Other versions are refused at the
 * first frame. */
#define KVB_WIRE_VERSION  6
#define KVB_WIRE_HDR_SIZE 40

/* Limits on what a peer may announce; anything larger is a protocol error. */
#define KVB_WIRE_MAX_DATA      (64ull << 20) /* data bytes in one READ_RESP / WRITE_REQ frame */
#define KVB_WIRE_MAX_HELLO     4096u
#define KVB_WIRE_MAX_HELLO_ACK (16u << 20)
#define KVB_WIRE_MAX_REGIONS   65536u
#define KVB_HOST_ID_LEN        16

typedef enum {
    KVB_FRAME_HELLO = 1,     /* initiator -> target: who I am; payload: hello */
    KVB_FRAME_HELLO_ACK = 2, /* target -> initiator: who I am and my regions; payload: hello_ack */
    KVB_FRAME_READ_REQ = 3,  /* addr, len; no payload */
    KVB_FRAME_READ_RESP = 4, /* status; payload: len data bytes when status is OK */
    KVB_FRAME_WRITE_REQ = 5, /* addr, len; payload: len data bytes */
    KVB_FRAME_WRITE_ACK = 6, /* status, len placed */
    KVB_FRAME_NOTIFY = 7,    /* payload: len message bytes */
    KVB_FRAME_NOTIFY_ACK = 8,
    KVB_FRAME_ERROR = 9,  /* status; the sender closes the connection after it */
    KVB_FRAME_ATTRS = 10, /* target -> initiator after HELLO_ACK on lane 0; payload: attrs */
    /* target -> initiator, answering HELLO: payload: hello (with the target's nonce) | mac[32],
     * the target's proof (kvb__wire_auth_mac, KVB_AUTH_TARGET) */
    KVB_FRAME_CHALLENGE = 11,
    /* initiator -> target: payload: mac[32], the initiator's proof (KVB_AUTH_INITIATOR). Only
     * after it checks out does the target send HELLO_ACK and accept anything else. */
    KVB_FRAME_AUTH = 12,
    KVB_FRAME_TYPE_MAX = 12,
} kvb_frame_type_t;

/* Header flag: the data moves through shared memory, not this connection (same host). Such
 * requests always come in runs (F_SHM | F_RUN on READ_REQ or WRITE_REQ): one frame asks for
 * `addr` requests (1..KVB_WIRE_MAX_RUN), ids id .. id+addr-1, all of this type; its payload, `len`
 * = addr x KVB_WIRE_SHM_ENTRY bytes, names each one (kvb_shm_entry_t). Answers carry no data. */
#define KVB_FRAME_F_SHM 0x1u
/* Header flag for answer runs: one answer frame for many consecutive requests. A KV cache moves
 * as thousands of small blocks; one answer frame per block cost both sides more than the blocks'
 * own bookkeeping (and over TCP, one receive call per block).
 * - On a successful same-host answer (READ_RESP or WRITE_ACK with F_SHM, status 0): it answers
 *   `addr` requests at once (1..KVB_WIRE_MAX_RUN), ids id .. id+addr-1, all of this type, `len`
 *   their total length; no payload.
 * - On a READ_REQ without F_SHM: the initiator takes this answer's bytes straight into host memory,
 *   so it may come in a run.
 * - On a successful READ_RESP without F_SHM: it answers `addr` such requests (1..KVB_WIRE_MAX_RUN),
 *   ids id .. id+addr-1; the payload is their `len` bytes (at most KVB_WIRE_MAX_DATA), each
 *   request's after the one before. */
#define KVB_FRAME_F_RUN  0x2u
#define KVB_WIRE_MAX_RUN 4096u

/* One request of a same-host request run: u64 remote address | u64 length | u64 the initiator's
 * address, where the target's copy takes the bytes from (WRITE) or puts them (READ) | u64 the
 * request's deadline, CLOCK_MONOTONIC ns (one clock: both ends are on this host). A KV pull asks
 * for tens of thousands of small blocks; a 40-byte header and its decoding for each one cost the
 * initiator's submits and the target's reading thread more than the request itself. The target
 * starts no copy past the deadline (it answers KVB_ERR_TIMEOUT): the initiator may reuse its
 * memory once a request has timed out, and a target that was stalled - stopped, swapped out -
 * must not copy into it when it resumes. */
#define KVB_WIRE_SHM_ENTRY 32u
typedef struct {
    uint64_t remote, len, local, deadline;
} kvb_shm_entry_t;

void kvb__wire_shm_entry_encode(const kvb_shm_entry_t *e, uint8_t out[KVB_WIRE_SHM_ENTRY]);
/* KVB_OK, or KVB_ERR_PROTOCOL for a length over KVB_WIRE_MAX_DATA (what a lone request's header
 * may ask). A length of 0 is the request's own failure, found when its range is checked. */
int kvb__wire_shm_entry_decode(const uint8_t in[KVB_WIRE_SHM_ENTRY], kvb_shm_entry_t *out);

typedef struct {
    uint8_t type;
    uint8_t version;
    uint16_t flags;
    int32_t status;
    uint64_t id;   /* request id chosen by the initiator, echoed by the target */
    uint64_t addr; /* remote absolute address (requests) */
    uint64_t len;  /* data length: what follows the header (see payload_len) or what is asked */
} kvb_frame_hdr_t;

void kvb__wire_encode_hdr(const kvb_frame_hdr_t *h, uint8_t out[KVB_WIRE_HDR_SIZE]);

/* Decodes and validates a header: magic, version, type, status/length consistency and limits.
 * Returns KVB_OK, KVB_ERR_VERSION or KVB_ERR_PROTOCOL (with a reason in why[0..why_len)). */
int kvb__wire_decode_hdr(const uint8_t in[KVB_WIRE_HDR_SIZE], kvb_frame_hdr_t *out, char *why,
                         size_t why_len);

/* The status an ERROR frame reports, as this side may pass it up: a known peer-level error, or
 * KVB_ERR_PROTOCOL for anything a peer should not send (unknown codes, local-only ones). */
int kvb__wire_error_status(int32_t status);

/* Number of payload bytes that follow a (validated) header on the wire. */
uint64_t kvb__wire_payload_len(const kvb_frame_hdr_t *h);

#define KVB_WIRE_NONCE_LEN 32
#define KVB_WIRE_MAC_LEN   32

/* The identity each side states in the handshake. `nonce` is fresh per connection in HELLO and
 * CHALLENGE; in HELLO_ACK it carries the one-time token that binds a same-host link to this
 * (authenticated) connection, or zeros. */
typedef struct {
    uint64_t incarnation;
    uint32_t pid;
    uint32_t lane;
    uint8_t host_id[KVB_HOST_ID_LEN];
    uint8_t nonce[KVB_WIRE_NONCE_LEN];
    char name[KVB_NAME_MAX + 1];
} kvb_hello_t;

/* Encoded hello size (bounded by KVB_WIRE_MAX_HELLO). */
size_t kvb__wire_hello_size(const kvb_hello_t *h);
size_t kvb__wire_hello_encode(const kvb_hello_t *h, uint8_t *out);
int kvb__wire_hello_decode(const uint8_t *in, size_t len, kvb_hello_t *out);

/* The proofs of the handshake: HMAC-SHA256 under the cluster secret over the protocol version, the
 * role, and both hellos as sent (so both nonces, names, incarnations, pids, hosts and the lane).
 * The two roles use distinct labels, so one side's proof can never be replayed as the other's. */
enum { KVB_AUTH_TARGET = 0, KVB_AUTH_INITIATOR = 1 };
int kvb__wire_auth_mac(const uint8_t *key, size_t key_len, int role, const kvb_hello_t *initiator,
                       const kvb_hello_t *target, uint8_t out[KVB_WIRE_MAC_LEN]);

/* CHALLENGE payload: hello | mac. */
int kvb__wire_challenge_decode(const uint8_t *in, size_t len, kvb_hello_t *hello,
                               uint8_t mac[KVB_WIRE_MAC_LEN]);

/* Segment attributes: small named blobs an engine publishes with its segment (a KV layout
 * descriptor, say). */
#define KVB_ATTR_KEY_MAX   63
#define KVB_ATTR_VALUE_MAX (4u << 20)
#define KVB_ATTRS_MAX      64
#define KVB_WIRE_MAX_ATTRS (16u << 20)

typedef struct {
    char key[KVB_ATTR_KEY_MAX + 1];
    uint8_t *value; /* malloc'd */
    size_t len;
} kvb_attr_t;

/* attrs: count u32 | count x (key_len u16 | key | value_len u32 | value). Encode allocates *out;
 * decode allocates *attrs (free with kvb__attrs_free). Keys are printable, unique, not empty. */
int kvb__wire_attrs_encode(const kvb_attr_t *attrs, size_t n, uint8_t **out, size_t *out_len);
int kvb__wire_attrs_decode(const uint8_t *in, size_t len, kvb_attr_t **attrs, size_t *n);
void kvb__attrs_free(kvb_attr_t *attrs, size_t n);

/* HELLO_ACK = hello + region list, each region with its key blobs. Encode allocates *out (caller
 * frees). Decode allocates *regions as one block, keys included (caller frees; NULL when there
 * are none), and refuses regions out of address order or overlapping, locations that are not a
 * memory kind, and key runs that are not well formed. */
int kvb__wire_hello_ack_encode(const kvb_hello_t *h, const kvb_region_desc_t *regions, size_t n,
                               uint8_t **out, size_t *out_len);
int kvb__wire_hello_ack_decode(const uint8_t *in, size_t len, kvb_hello_t *hello,
                               kvb_region_desc_t **regions, size_t *n);

#endif
