/* SPDX-License-Identifier: Apache-2.0 */
/* The kvbridge transfer engine: register memory, open peers' segments by name, and move bytes with
 * one-sided READ/WRITE batches that complete only when the data is at its destination. */
#ifndef KVBRIDGE_ENGINE_H
#define KVBRIDGE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "kvbridge/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVB_VERSION_STRING "0.1.0"

/* Longest segment name, location string, and notification payload, in bytes. */
#define KVB_NAME_MAX     255
#define KVB_LOCATION_MAX 63
#define KVB_NOTIFY_MAX   4096

typedef struct kvb_engine kvb_engine_t;
typedef struct kvb_batch kvb_batch_t;

/* A handle to an opened remote segment. 0 is never a valid handle. A handle stays valid until its
 * last kvb_segment_close; after that it is refused (KVB_ERR_BAD_SEGMENT) even when another segment
 * is opened later, so a stale handle never addresses another peer. */
typedef uint32_t kvb_segment_t;

/* Engine configuration. Initialise with kvb_config_init() and change what you need; strings and
 * the secret are copied by kvb_engine_create() and need not outlive the call. The struct only
 * grows at its end: kvb_config_init() records the caller's sizeof in `size`, so a program built
 * against an older header keeps working with a newer library (fields it does not know about keep
 * their defaults). */
typedef struct {
    size_t size;                 /* set by kvb_config_init(); do not change */
    const char *bind_addr;       /* IPv4/IPv6 literal or host name; default "127.0.0.1" */
    const char *advertise_addr;  /* what peers dial; default bind_addr ("0.0.0.0": the host name) */
    uint16_t port;               /* 0: any free port; else the first port tried */
    uint16_t port_max;           /* with port: try port..port_max; 0 means just port */
    const char *segment_name;    /* default "advertise_addr:port" */
    const char *metadata;        /* where peers find segments; see "Metadata" below */
    int progress_threads;        /* epoll progress threads, at most 64; default one per default
                                  * lane (2) where half the CPUs the process may run on cover
                                  * them, else half of them, at least 1 (1 on two CPUs) */
    int lanes;                   /* TCP connections per peer; default 2, at most 16 */
    uint32_t timeout_ms;         /* default per-request deadline; default 30000 */
    uint32_t connect_timeout_ms; /* deadline of kvb_segment_open's handshake; default 5000 */
    /* The data paths requests may take, in the order they are tried: "auto" (default) is every
     * path that runs here, best first (shm, fabric, then tcp); or a comma-separated list such as
     * "tcp", "shm" or "shm,tcp", each path of which must reach every peer opened (else the open
     * fails). A request goes to the first listed path that can carry it; the TCP lanes come last
     * either way, since they carry the control plane. kvb_config_init() takes the default from the
     * environment variable KVB_PROTOCOL when it is set. */
    const char *protocol;
    int copy_threads;    /* extra threads splitting large same-host copies; default 1, max 16 */
    const char *cluster; /* namespace of this engine's keys in a metadata store; default
                          * "default" (1..63 characters of [A-Za-z0-9._-]) */
    uint32_t metadata_ttl_ms; /* how long a store keeps our descriptor after we stop refreshing
                               * it (we died); default 10000, at least 1000 */
    /* The cluster secret (see "Security" below): peers must prove they know it before they learn
     * or touch anything. NULL: read the file named by the environment variable KVB_SECRET_FILE,
     * if set; else no secret, which only an engine bound to a loopback address may run with. */
    const void *secret;
    size_t secret_len; /* 16..4096 bytes */
    int insecure;      /* non-zero: allow a non-loopback bind without a secret (warns once) */
    uint32_t peer_timeout_ms; /* a peer that neither sends nor acknowledges anything for this
                               * long while requests are in flight is lost; so is one that
                               * reads none of our answers, or stopped in the middle of a
                               * frame, for this long; default 5000 */
    uint32_t max_connections; /* connections this engine accepts at once; default 4096 */
    uint64_t shm_map_max;     /* bytes of one same-host peer's memory this engine maps at most;
                               * default 64 GiB */
    /* The libfabric provider of the `fabric` data path (one-sided RDMA READ/WRITE): "verbs;ofi_rxm"
     * (InfiniBand, RoCE), "efa", "cxi", or for testing "tcp;ofi_rxm" and "shm". NULL (default):
     * the first of verbs;ofi_rxm, efa, cxi that works here, else the path does not run. A named
     * provider that is not available fails kvb_engine_create (KVB_ERR_INVALID_ARG); it is never
     * replaced by another. With protocol "auto" the path is tried after shm and before tcp.
     * kvb_config_init() takes the default from KVB_FABRIC_PROVIDER when it is set. */
    const char *fabric_provider;
    /* The congestion control of this engine's TCP connections (Linux TCP_CONGESTION: "cubic",
     * "reno", "bbr", "dctcp", ...), which governs what each side sends: an initiator's WRITE data
     * and requests, a target's READ answers. NULL (default): the system's
     * (net.ipv4.tcp_congestion_control). One this kernel does not have, or does not allow this
     * process (net.ipv4.tcp_allowed_congestion_control, unless it has CAP_NET_ADMIN), fails
     * kvb_engine_create (KVB_ERR_INVALID_ARG). kvb_config_init() takes the default from
     * KVB_TCP_CONGESTION when it is set. See the README's Performance section for what it changes.
     */
    const char *tcp_congestion;
    /* Busy polling, in microseconds: 0 (default) is off, at most KVB_BUSY_POLL_MAX_US. A
     * progress thread that took in a peer's requests keeps polling its connections without
     * sleeping for this long before it sleeps, unless one of them waits for room to send (the
     * peer reading that socket needs the core then); a thread in kvb_batch_wait whose batch rides
     * one connection polls that connection for this long, from its wait's start and after each
     * read, before it sleeps. A round trip then skips the wake-ups of sleeping threads - on some
     * virtual machines 50-60 us each way - for a core kept busy that long after traffic: for
     * small and latency-bound transfers where cores are to spare (see the README's Performance
     * section). kvb_config_init() takes the default from KVB_BUSY_POLL_US when it is set (a value
     * that is not a number of microseconds up to the maximum fails kvb_engine_create with
     * KVB_ERR_INVALID_ARG). */
    uint32_t busy_poll_us;
    /* CPUs for this engine's data threads, as a list such as "0-3,8" (Linux's notation; each CPU
     * one the thread calling kvb_engine_create may run on, as sched_getaffinity says): the
     * progress threads, then the copy threads, each run on the
     * next CPU of the list in turn (progress thread i on the i-th CPU listed, copy thread j on the
     * (progress_threads + j)-th, wrapping around), from their start. NULL or "" (default): the
     * scheduler places them. On a host whose cores are shared by more threads than it has, a
     * waking copy thread may be placed on the CPU of the thread that woke it and share it for
     * milliseconds while another CPU idles; CPUs of their own keep the copies side by side (see
     * the README's Performance section). A malformed list, or one naming a CPU the calling thread
     * may not run on, fails kvb_engine_create (KVB_ERR_INVALID_ARG). kvb_config_init() takes the
     * default from KVB_CPUS when it is set. The threads are named kvb-tcp-N, kvb-copy-N (and
     * kvb-shm, kvb-fabric, kvb-cuda, kvb-meta for the others, which no list binds). */
    const char *cpus;
    /* How long a progress thread that took in a peer's requests keeps polling its connections
     * for the next ones before it sleeps, in microseconds: KVB_LINGER_DEFAULT_US (100) by
     * default, 0 sleeps at once, at most KVB_BUSY_POLL_MAX_US; busy_poll_us, where longer, takes
     * its place. Unlike busy_poll_us it never makes a thread in kvb_batch_wait poll, and so never
     * competes with the threads that move a batch's bytes: a peer that submits its next batch
     * soon after the last one's answers finds the target's thread awake, and that round trip
     * skips one wake-up, for up to this long of one core after each burst of requests. The same
     * span bounds how long an initiator's progress thread that took in answers over TCP polls
     * for the rest while its connection owes more: the other side's sending thread then does not
     * wake it every few hundred KB (see the README's Performance section). kvb_config_init()
     * takes the default from KVB_LINGER_US when it is set (as KVB_BUSY_POLL_US: a bad value fails
     * kvb_engine_create). */
    uint32_t linger_us;
} kvb_config_t;

#define KVB_BUSY_POLL_MAX_US  100000u
#define KVB_LINGER_DEFAULT_US 100u

/* Metadata. `metadata` selects how kvb_segment_open finds a segment by name:
 *   "p2p" (default)                 no store: the name is the peer's "host:port"
 *   "etcd://host:port[,host:port]"  etcd v3 (JSON API); our descriptor hangs off a lease
 *   "redis://[[user]:pw@]host:port[/db]"  Redis; our descriptor has a TTL
 *   "http://host:port[/prefix]"     `kvbridge metadata-server`; our descriptor has a TTL
 * With a store, the engine publishes a JSON descriptor of its segment (name, incarnation,
 * addresses, transports, regions, attributes) under kvbridge/<cluster>/segments/<name> at create
 * (failing with KVB_ERR_META_UNREACHABLE if the store cannot be reached), republishes it when
 * regions or attributes change, keeps it alive every ttl/3 and deletes it at destroy; if the
 * process dies it expires within the TTL. Opening a name reads its descriptor (no live one:
 * KVB_ERR_SEGMENT_NOT_FOUND; store down: KVB_ERR_META_UNREACHABLE) and connects to the address
 * it names, checking the incarnation. Open segments are revalidated every ttl/3: one whose name
 * now belongs to a new incarnation fails with KVB_ERR_PEER_RESTARTED, and reopening it connects to
 * the new owner. Transfers on open segments never touch the store. */

/* Security. Every connection between engines starts with a mutual challenge-response: each side
 * sends a fresh random nonce and proves knowledge of the cluster secret with an HMAC-SHA256 over
 * both nonces, both sides' identities (segment name, incarnation, pid, host), the connection's
 * lane and the protocol version. Until that succeeds nothing but the handshake is accepted: no
 * region list, attribute, data or notification. A peer with a wrong or missing secret fails
 * with KVB_ERR_AUTH (and is logged by both sides). Notifications carry the segment name the
 * sender proved in its handshake. The same-host path is bound to an authenticated connection by
 * a one-time token and to the same user id. Data on the wire is authenticated per connection
 * but NOT encrypted: run it on a trusted network or under a VPN/IPsec where that matters. */

/* Fills *cfg with the defaults listed above and records sizeof *cfg (a macro, so the size is the
 * caller's). kvb_config_init_v is what it calls, for bindings that cannot use the macro. */
KVB_API void kvb_config_init_v(kvb_config_t *cfg, size_t size);
#define kvb_config_init(cfg) kvb_config_init_v((cfg), sizeof *(cfg))

/* Creates an engine: binds and listens, starts the progress threads. On success stores the engine
 * in *out and returns KVB_OK; on error returns a negative status and leaves *out untouched. */
KVB_API int kvb_engine_create(const kvb_config_t *cfg, kvb_engine_t **out);

/* Stops the progress threads, closes every connection and frees the engine. Requests still in
 * flight end FAILED with KVB_ERR_SHUTDOWN; their batches stay valid until kvb_batch_free().
 * Blocks until the threads have exited. NULL is ignored. */
KVB_API void kvb_engine_destroy(kvb_engine_t *engine);

/* Counters of this engine's own requests (as initiator), since it was created, with the bytes each
 * data path moved. */
#define KVB_STATS_PATHS_MAX 8
typedef struct {
    uint64_t requests_completed;
    uint64_t requests_failed; /* FAILED or TIMEOUT; cancelled ones are not counted */
    size_t npaths;            /* entries of paths[] in use: every path this engine has */
    struct {
        char name[16];  /* "tcp" (data over the TCP lanes), "shm" (same-host copies), "cuda" */
        uint64_t ops;   /* operations (requests, or their chunks) completed on it */
        uint64_t bytes; /* their bytes */
    } paths[KVB_STATS_PATHS_MAX];
} kvb_stats_t;

KVB_API int kvb_engine_stats(kvb_engine_t *engine, kvb_stats_t *out);

/* The bytes `stats` counts for the path named `path` ("tcp", "shm"); 0 if it has no such path. */
KVB_API uint64_t kvb_stats_bytes(const kvb_stats_t *stats, const char *path);

/* This engine's segment name (what peers pass to kvb_segment_open). Valid while the engine is. */
KVB_API const char *kvb_engine_segment_name(const kvb_engine_t *engine);

/* The TCP port the engine listens on. */
KVB_API uint16_t kvb_engine_port(const kvb_engine_t *engine);

/* The libfabric provider the engine's fabric data path runs on (such as "verbs;ofi_rxm" or
 * "tcp;ofi_rxm"), or "" when that path does not run here. Valid while the engine is. */
KVB_API const char *kvb_engine_fabric_provider(const kvb_engine_t *engine);

/* The congestion control algorithm this engine's TCP connections use (the configured one, or the
 * system's default as the listening socket took it), such as "cubic". Valid while the engine is. */
KVB_API const char *kvb_engine_tcp_congestion(const kvb_engine_t *engine);

/* The busy polling this engine's threads do, in microseconds (0: none; see busy_poll_us). */
KVB_API uint32_t kvb_engine_busy_poll_us(const kvb_engine_t *engine);

/* How long this engine's progress threads poll for more requests after taking some in, in
 * microseconds (see linger_us; busy_poll_us where longer). */
KVB_API uint32_t kvb_engine_linger_us(const kvb_engine_t *engine);

/* The CPUs this engine's data threads run on (see `cpus`), in the order they are taken, written
 * back as a list with runs of consecutive CPUs as ranges ("0,1,2,5" reads "0-2,5"), or "" when
 * the scheduler places them. Valid while the engine is. */
KVB_API const char *kvb_engine_cpus(const kvb_engine_t *engine);

/* Access rights granted to peers on a registered region. */
enum { KVB_ACCESS_READ = 1u, KVB_ACCESS_WRITE = 2u, KVB_ACCESS_RW = 3u };

enum { KVB_ALLOC_HUGE = 1u }; /* kvb_alloc flag: back with huge pages (fails if none are free) */

/* Allocates `len` bytes that same-host peers can map directly (memfd-backed, zero-filled). The
 * memory is not registered: register it to use it in requests. It stays valid until kvb_free()
 * or kvb_engine_destroy(). Local buffers in kvb_alloc memory move by one memcpy with same-host
 * peers; other memory needs cross-memory attach, or goes over TCP where the kernel refuses it. */
KVB_API int kvb_alloc(kvb_engine_t *engine, size_t len, unsigned flags, void **out);

/* Frees kvb_alloc memory, after telling same-host peers to unmap it. Returns KVB_ERR_BUSY if a
 * registered region still lies inside it, KVB_ERR_NOT_FOUND if `ptr` is not an allocation. */
KVB_API int kvb_free(kvb_engine_t *engine, void *ptr);

/* Registers [addr, addr+len) so that peers may READ and/or WRITE it as `access` allows, and so
 * that local requests may use it. `location` names where the memory lives: "cpu", "cpu:N" (NUMA
 * node), NULL (same as "cpu") or "*" (detect; host memory while no device path is built in);
 * "cuda:N" is recognised and refused with KVB_ERR_UNSUPPORTED until a data path serves device
 * memory; anything else is KVB_ERR_INVALID_ARG. Returns KVB_ERR_OVERLAP if the range overlaps a
 * registered one. The memory must stay valid until kvb_unregister() returns KVB_OK. */
KVB_API int kvb_register(kvb_engine_t *engine, void *addr, size_t len, const char *location,
                         unsigned access);

/* Unregisters the region that starts at `addr`. New requests for it fail at once
 * (KVB_ERR_LOCAL_NOT_REGISTERED here, KVB_ERR_REMOTE_NOT_REGISTERED at peers). Then blocks until
 * nothing uses the memory any more: neither a local request in flight (one not yet ended, or
 * cancelled with its bytes still queued) nor a peer's transfer being served. KVB_OK: the memory
 * may be freed or reused. Gives up after the engine's timeout with KVB_ERR_BUSY: the memory may
 * still be read or written, so keep it valid, and call kvb_unregister(addr) again (it waits
 * again) until it returns KVB_OK; meanwhile nothing can be registered over it. Returns
 * KVB_ERR_NOT_FOUND if no region (registered, or left BUSY) starts at `addr`. */
KVB_API int kvb_unregister(kvb_engine_t *engine, void *addr);

/* Opens the segment `name` ("host:port" in p2p mode; with a metadata store, the name its owner
 * published): connects, checks protocol versions, learns the peer's incarnation and fetches its
 * region list. Blocks for at most the connect timeout (plus one store lookup).
 * Opening an already open segment returns the same handle (each open needs a close); opening a
 * segment whose peer was lost reconnects it in place (with a metadata store, to the address its
 * current descriptor names). With a store: KVB_ERR_SEGMENT_NOT_FOUND when no live descriptor has
 * this name, KVB_ERR_META_UNREACHABLE when the store does not answer. */
KVB_API int kvb_segment_open(kvb_engine_t *engine, const char *name, kvb_segment_t *out);

/* Drops one reference to `seg`; the last one closes its connections. Requests in flight on it
 * end FAILED with KVB_ERR_CANCELED. */
KVB_API int kvb_segment_close(kvb_engine_t *engine, kvb_segment_t seg);

/* One registered region of a segment, as its owner declared it. */
typedef struct {
    uint64_t addr;
    uint64_t len;
    unsigned access;
    char location[KVB_LOCATION_MAX + 1];
} kvb_region_info_t;

/* Copies up to `cap` of the segment's regions into `out` (may be NULL when cap is 0) and stores
 * the total number in *count. `refresh` non-zero fetches the list from the peer first (blocks);
 * otherwise the list cached at open time is returned. */
KVB_API int kvb_segment_regions(kvb_engine_t *engine, kvb_segment_t seg, int refresh,
                                kvb_region_info_t *out, size_t cap, size_t *count);

/* Publishes a named attribute with this engine's segment (a KV layout descriptor, for example):
 * peers see it when they open or refresh the segment. `key`: 1..63 printable characters; `value`:
 * at most 4 MiB, copied; NULL removes the key. At most 64 attributes, and at most 16 MiB for all
 * of them together (KVB_ERR_TOO_LARGE, nothing changed). */
KVB_API int kvb_engine_set_attr(kvb_engine_t *engine, const char *key, const void *value,
                                size_t len);

/* Copies up to `cap` bytes of the segment's attribute `key`, as learnt at open or refresh, into
 * `buf` and stores its full length in *len. KVB_ERR_NOT_FOUND if the peer did not publish it. */
KVB_API int kvb_segment_attr(kvb_engine_t *engine, kvb_segment_t seg, const char *key, void *buf,
                             size_t cap, size_t *len);

/* Fetches the segment's current region list and attributes again (a handshake on a connection
 * of its own; blocks up to the connect timeout). KVB_ERR_PEER_RESTARTED if the peer restarted:
 * reopen it. */
KVB_API int kvb_segment_refresh(kvb_engine_t *engine, kvb_segment_t seg);

/* The data path that host memory takes to `seg`: "shm" or "tcp" (a static string). Device memory
 * may take another ("cuda"); kvb_engine_stats counts the bytes each path moved. */
KVB_API int kvb_segment_transport(kvb_engine_t *engine, kvb_segment_t seg, const char **out);

/* The peer's incarnation id (random per engine start), as learnt at open. */
KVB_API int kvb_segment_incarnation(kvb_engine_t *engine, kvb_segment_t seg, uint64_t *out);

typedef enum { KVB_OP_READ = 0, KVB_OP_WRITE = 1 } kvb_opcode_t;

/* One one-sided request. READ copies [remote, remote+len) of `segment` into `local`; WRITE copies
 * `local` there. `local` must lie inside one locally registered region, the remote range inside
 * one region of the peer that grants the access. */
typedef struct {
    kvb_opcode_t opcode;
    void *local;
    kvb_segment_t segment;
    uint64_t remote;
    size_t len;
} kvb_request_t;

typedef enum {
    KVB_REQ_PENDING = 0,
    KVB_REQ_COMPLETED,
    KVB_REQ_FAILED,
    KVB_REQ_TIMEOUT,
    KVB_REQ_CANCELED,
} kvb_req_state_t;

typedef struct {
    kvb_req_state_t state;
    int error;      /* KVB_OK unless FAILED/TIMEOUT/CANCELED: why */
    uint64_t bytes; /* bytes placed so far */
} kvb_req_status_t;

/* Optional batch settings; zero-initialise and set what you need. */
typedef struct {
    uint32_t timeout_ms;          /* per-request deadline; 0: the engine's default */
    kvb_segment_t notify_segment; /* non-zero: send `notify` to this segment once every request
                                   * of the batch has COMPLETED (so after all its data is placed);
                                   * it is not sent if any request fails */
    const void *notify;
    size_t notify_len; /* at most KVB_NOTIFY_MAX */
} kvb_batch_opts_t;

/* Submits `n` requests (n >= 1) as one batch; `opts` may be NULL. Requests are checked first:
 * on an invalid argument, an unknown segment or an unregistered local range nothing is submitted
 * and an error is returned. Otherwise *out receives the batch; requests to a lost peer end FAILED
 * at once. `reqs` is copied. Local buffers must stay registered (and so valid) while requests use
 * them: kvb_unregister() waits for that. Never blocks on the network. */
KVB_API int kvb_batch_submit(kvb_engine_t *engine, const kvb_request_t *reqs, size_t n,
                             const kvb_batch_opts_t *opts, kvb_batch_t **out);

/* Number of requests in the batch. */
KVB_API size_t kvb_batch_size(const kvb_batch_t *batch);

/* Status of request `i` without blocking. A PENDING request past its deadline turns TIMEOUT here.
 */
KVB_API int kvb_batch_status(kvb_batch_t *batch, size_t i, kvb_req_status_t *out);

/* Waits until every request (and the batch's notification) has ended or `timeout_ms` passes
 * (-1: until each request's own deadline). Returns KVB_OK if all COMPLETED, KVB_ERR_AGAIN if the
 * wait timed out with requests still pending, else the first failed request's error. Sleeps;
 * never spins. */
KVB_API int kvb_batch_wait(kvb_batch_t *batch, int timeout_ms);

/* Marks every pending request CANCELED. Over TCP, data that arrives for them later is discarded:
 * after this returns no READ writes into their local buffers any more. Over shared memory the
 * peer copies into the buffer itself, so a copy already under way may still land until its answer
 * arrives; kvb_unregister() of the buffer waits for that. */
KVB_API int kvb_batch_cancel(kvb_batch_t *batch);

/* Waits up to `timeout_ms` (>= 0; 0 polls) until no request of the batch can still move data:
 * KVB_OK, or KVB_ERR_AGAIN while some still can. A request that ended (TIMEOUT, CANCELED) is not
 * always done with the memory: over shared memory the peer copies into it itself, and over RDMA
 * the NIC does, until the peer answers or the connection is lost; a WRITE is settled once the
 * peer acknowledged it (or is lost). A READ over TCP into host memory is settled when it ends:
 * the bytes of a late answer are dropped. Call it before reusing the local buffers of a batch that
 * failed for other memory (a pool that hands them to another request, say); a batch that
 * COMPLETED is settled already. Same-host peers start no copy past a request's deadline (read
 * on CLOCK_MONOTONIC; a peer whose clock a time namespace sets off is not linked through shared
 * memory), so a peer that stalled does not copy when it resumes; once the connection is lost the
 * engine cannot know about a copy that such a peer had already begun. */
KVB_API int kvb_batch_settle(kvb_batch_t *batch, int timeout_ms);

/* Cancels what is pending (as kvb_batch_cancel) and releases the batch. Safe while requests are in
 * flight: their late replies are discarded. NULL is ignored. */
KVB_API void kvb_batch_free(kvb_batch_t *batch);

/* A notification as received. */
typedef struct {
    char from[KVB_NAME_MAX + 1]; /* the sender's segment name */
    size_t len;
    unsigned char data[KVB_NOTIFY_MAX];
    uint64_t reply_to; /* the connection it came in on (kvb_notify_reply); 0: none */
} kvb_notification_t;

/* Sends a small message (at most KVB_NOTIFY_MAX bytes) to `seg` and waits until the peer has
 * queued it, for at most `timeout_ms` (-1: the engine's default). Messages sent on one segment
 * arrive in order only if each call waits for the previous. */
KVB_API int kvb_notify_send(kvb_engine_t *engine, kvb_segment_t seg, const void *msg, size_t len,
                            int timeout_ms);

/* Takes the oldest received notification into *out, waiting at most `timeout_ms` (0: poll;
 * -1: forever until the engine is destroyed). Returns KVB_OK, KVB_ERR_AGAIN (0 timeout, none) or
 * KVB_ERR_TIMEOUT. */
KVB_API int kvb_notify_recv(kvb_engine_t *engine, kvb_notification_t *out, int timeout_ms);

/* Answers a received notification over the connection it came in on, which the sender opened:
 * no connection back to the sender is made, so the answer reaches a sender that cannot be dialled
 * (behind NAT, or bound to another host's loopback). The sender receives it with
 * kvb_notify_recv, `from` set to our segment name. Returns once the message is queued on that
 * connection (there is no acknowledgement): KVB_ERR_PEER_LOST if the connection has closed,
 * KVB_ERR_INVALID_ARG if `received` came with no connection to answer on (reply_to 0). Never
 * blocks on the network. */
KVB_API int kvb_notify_reply(kvb_engine_t *engine, const kvb_notification_t *received,
                             const void *msg, size_t len);

/* Log verbosity: 0 errors, 1 warnings (default), 2 info, 3 debug. Also set by env KVB_LOG_LEVEL. */
KVB_API void kvb_log_set_level(int level);

#ifdef __cplusplus
}
#endif
#endif
