/* SPDX-License-Identifier: Apache-2.0 */
/* Engine internals shared between the engine core and its transports: the engine, peers, batches,
 * operations, and the transport ops table. Transports see these; callers of the API never do. */
#ifndef KVB_ENGINE_INTERNAL_H
#define KVB_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "common/auth.h"
#include "common/cpus.h"
#include "engine/export.h"
#include "engine/registry.h"
#include "engine/wire.h"
#include "kvbridge/engine.h"

/* Requests longer than this are split into operations of at most this size, spread over lanes. */
#define KVB_CHUNK_SIZE (4ull << 20)

typedef struct kvb_peer kvb_peer_t;
typedef struct kvb_shm kvb_shm_t;
typedef struct kvb_transport kvb_transport_t;
typedef struct kvb_transport_ops kvb_transport_ops_t;
typedef struct kvb_provider kvb_provider_t;
typedef struct kvb_provider_ops kvb_provider_ops_t;

typedef enum { KVB_OPK_READ = 0, KVB_OPK_WRITE = 1, KVB_OPK_NOTIFY = 2 } kvb_op_kind_t;

/* The data paths built in, by id: an op's path, a key blob's tag on the wire, the order of
 * kvb_engine_stats' list. Each is a provider (kvb_provider_ops_t) named in transports.c. */
enum { KVB_PATH_TCP = 0, KVB_PATH_SHM = 1, KVB_PATH_CUDA = 2, KVB_PATH_FABRIC = 3, KVB_PATHS = 4 };
_Static_assert(KVB_PATHS <= KVB_PATHS_MAX, "path ids fit the registry's per-path slots");

/* One unit of work on one lane: a whole request, a chunk of one, or a batch's notification. The
 * transport owns the op from submit until it calls kvb__op_done() exactly once. */
typedef struct kvb_op {
    struct kvb_op *next; /* transport queue linkage */
    kvb_batch_t *batch;
    uint32_t req; /* request index; KVB_OP_NOTIFY_REQ for the batch's notification */
    uint8_t kind;
    uint8_t ended; /* its path let go of it (kvb__op_done); under the batch's lock */
    uint8_t *local;
    uint64_t remote;
    uint64_t len;
    uint64_t wire_id;  /* assigned by the transport */
    kvb_region_t *pin; /* the local region, pinned until the op ends (kvb_unregister waits) */
    const kvb_region_desc_t *rregion; /* the peer's region holding it, if its list names one;
                                       * valid only until the provider's submit returns */
    uint8_t path;                     /* KVB_PATH_*: the provider carrying it */
    uint8_t *stage; /* a host bounce buffer for local device memory (the lanes' own) */
} kvb_op_t;

#define KVB_OP_NOTIFY_REQ UINT32_MAX

/* A READ over the lanes into host memory: its answer's bytes go straight into place as a copy
 * into its batch (kvb__batch_copy_begin), so they may come in answer runs, and once the request
 * has ended they are dropped. */
static inline bool kvb__op_lane_read(const kvb_op_t *op)
{
    return op->kind == KVB_OPK_READ && op->path == KVB_PATH_TCP &&
           !(op->pin && op->pin->kind != KVB_MEM_CPU);
}

typedef struct {
    kvb_req_state_t state;
    int error;
    uint64_t bytes;
    uint32_t ops_left;
} kvb_req_t;

struct kvb_batch {
    kvb_engine_t *engine;
    pthread_mutex_t mu; /* guards everything below but the copy counters; requests end under it */
    pthread_cond_t cv;
    atomic_uint refs;  /* the caller's, plus one per op the transport still holds */
    uint64_t deadline; /* monotonic ns */
    size_t n;
    kvb_req_t *reqs; /* in the batch's own block, behind it */
    kvb_op_t *ops;   /* likewise */
    size_t nops;
    size_t mem_cap;    /* the block's size */
    size_t open;       /* requests not yet ended */
    size_t held;       /* ops their path has not let go of yet (kvb__op_done), and accesses that
                        * outlive theirs (kvb__op_linger): kvb_batch_settle waits for them */
    size_t settlers;   /* threads in kvb_batch_settle: ops that end wake them */
    size_t lane_reads; /* ops that drop their late bytes once ended (see kvb_batch_settle) */
    bool freed;        /* kvb_batch_free was called (every request ended first) */
    /* notification sent once all requests completed */
    kvb_peer_t *notify_peer;
    kvb_op_t notify_op;
    int notify_state; /* KVB_NOTIFY_* below */
    /* Set by the transport when every op went to one connection: a waiter may then receive the
     * answers itself (no thread hop) through the provider's progress, if every op took the same
     * provider (drive_path). Released with the batch through hint_release. */
    void *drive_hint;
    void (*hint_release)(void *hint);
    int drive_path; /* KVB_PATH_*, or -1: ops took several paths */
    int notify_error;
    unsigned char *notify_buf;
    /* Copies into the destinations under way (kvb__batch_copy_begin), counted in the slot of the
     * epoch they began in; ending a request early advances the epoch under mu and waits for the
     * old slot to empty (copies_drain), which copies begun later do not hold up. */
    atomic_uint copy_epoch;
    atomic_uint copying[2];
};

enum { KVB_NOTIFY_NONE = 0, KVB_NOTIFY_WAITING, KVB_NOTIFY_SENT, KVB_NOTIFY_DONE };

/* A peer's region list (kvb_region_desc_t, sorted by address, keys included), shared by
 * reference: a refresh replaces the peer's list while submits may still be reading the old one. */
typedef struct kvb_region_list {
    atomic_uint refs;
    size_t n;
    kvb_region_desc_t *d; /* one allocation, keys included (as the wire decoder makes it) */
} kvb_region_list_t;

/* Wraps d (taken over, freed with the list) in a list with one reference. */
kvb_region_list_t *kvb__region_list_new(kvb_region_desc_t *d, size_t n);
void kvb__region_list_put(kvb_region_list_t *l);
/* The peer's current list, with a reference taken. */
kvb_region_list_t *kvb__peer_regions(kvb_peer_t *p);

/* A remote engine as seen from here: its identity, its regions and the transport's connections
 * to it. Reference counted: the segment table, batches notifying it, and its lanes hold it. */
struct kvb_peer {
    atomic_uint refs;
    kvb_engine_t *engine;
    char name[KVB_NAME_MAX + 1]; /* the name it was opened by */
    char host[KVB_NAME_MAX + 1];
    uint16_t port;
    kvb_hello_t hello;        /* the peer's stated identity */
    atomic_int lost;          /* 0 while usable, else the error that ended it */
    pthread_mutex_t mu;       /* guards rlist and attrs */
    kvb_region_list_t *rlist; /* its regions and their keys, as the last handshake listed them */
    kvb_attr_t *attrs;        /* published by the peer; guarded by mu */
    size_t nattrs;
    void *tp; /* the control plane's state */
    const kvb_transport_ops_t *tp_ops;
    /* Same-host link tokens the control plane received (one per lane), for the shm path. */
    uint8_t link_tokens[16][KVB_LINK_TOKEN_LEN];
    size_t nlink_tokens;
    /* Data paths attached to this peer, and each one's state for it. */
    unsigned paths; /* bit i: path i attached */
    void *path_state[KVB_PATHS_MAX];
};

/* The control plane: connections, the authenticated handshake (identities, region lists with
 * their keys, attributes, same-host tokens), notifications and answers, liveness, and the
 * request frames of the two-sided data paths. It serves peers' requests against the engine's
 * registry, reports completions with kvb__op_done and notifications with kvb__notify_deliver. */
struct kvb_transport_ops {
    const char *name;
    /* Starts listening and progress threads; fills *tp. */
    int (*create)(kvb_engine_t *engine, kvb_transport_t **tp);
    /* Stops threads and closes everything; ops still held end with KVB_ERR_SHUTDOWN. */
    void (*destroy)(kvb_transport_t *tp);
    uint16_t (*port)(const kvb_transport_t *tp);
    /* Starts accepting connections, once the engine's identity is complete. */
    int (*start)(kvb_transport_t *tp);
    /* Connects to peer->host:port and handshakes before `deadline`; fills peer->hello,
     * peer->rlist, peer->attrs, peer->link_tokens and peer->tp. */
    int (*connect)(kvb_transport_t *tp, kvb_peer_t *peer, uint64_t deadline);
    /* Sends ops (linked through op->next) to the peer as request frames: with their payload, or
     * for the shm path (op->path) just the address. Never blocks on the network; ops that cannot be
     * sent end at once through kvb__op_done. */
    void (*submit)(kvb_transport_t *tp, kvb_peer_t *peer, kvb_op_t *ops);
    /* Closes the peer's connections; ops still held end with `error`. Frees peer->tp later. */
    void (*disconnect)(kvb_transport_t *tp, kvb_peer_t *peer, int error);
    /* Frees peer->tp when the peer's last reference goes; must not touch the transport itself,
     * which may be gone already. */
    void (*peer_free)(kvb_peer_t *peer);
    /* Receives on the batch's connection (its drive_hint) from the waiting thread itself until
     * the batch is done, something arrived, or `deadline` (monotonic ns); KVB_ERR_BUSY if another
     * thread already drives that connection. */
    int (*drive)(kvb_batch_t *b, uint64_t deadline);
    /* Queues a notification to the initiator of the accepted connection `conn_id` (from a
     * notification's reply_to). KVB_ERR_PEER_LOST if that connection is gone. */
    int (*reply)(kvb_transport_t *tp, uint64_t conn_id, const void *msg, size_t len);
};

/* Local addresses [lo, hi), hi exclusive (reaches()). */
typedef struct {
    uint64_t lo, hi;
} kvb_span_t;
#define KVB_SPAN_ALL ((kvb_span_t){0, UINT64_MAX})

/* A data path: one way for bytes to reach a peer's registered memory. The engine creates every
 * built-in provider that works here, lets each make key blobs for the regions it registers
 * (they travel in the handshake), attaches those that reach a peer once its control connection
 * is up, and gives every op to the first provider in the engine's path order that reaches it. */
struct kvb_provider_ops {
    const char *name;   /* in stats, logs and `protocol` lists */
    uint8_t id;         /* KVB_PATH_* */
    bool device_only;   /* it never carries a request between host memory on both sides */
    bool remote_region; /* its reaches() looks at op->rregion (the engine finds it only then) */
    /* Engine-wide state; KVB_ERR_UNSUPPORTED: this path does not work here (the engine runs
     * without it). NULL: the path needs none. */
    int (*create)(kvb_engine_t *e, kvb_provider_t **out);
    /* Optional: the engine is going - its control plane is gone, its registry not yet. Stops the
     * path's threads and ends every op still open (KVB_ERR_SHUTDOWN), letting go of its pins, so
     * that nothing touches a region after the registry frees them. The engine calls it for every
     * path it created, always before `destroy`, which follows the registry (whose regions' dereg
     * still comes here). */
    void (*stop)(kvb_provider_t *pv);
    void (*destroy)(kvb_provider_t *pv);
    /* A region is being registered: prepare to serve it (reg->path_state[id] is the provider's)
     * and write the key blob peers need to reach it this way into key (KVB_KEY_MAX bytes;
     * *key_len 0: none needed). KVB_ERR_UNSUPPORTED: this path cannot serve that memory. */
    int (*reg)(kvb_provider_t *pv, kvb_region_t *reg, uint8_t *key, size_t *key_len);
    /* A region goes (unregistered and no op uses it any more, or its registration failed):
     * called for every region, also ones this path refused; look at reg->path_state[id]. */
    void (*dereg)(kvb_provider_t *pv, kvb_region_t *reg);
    /* Sets this path up to a peer whose control connection is authenticated, storing its state
     * in peer->path_state[id]. KVB_ERR_UNSUPPORTED: it does not reach this peer (elsewhere). */
    int (*attach)(kvb_provider_t *pv, kvb_peer_t *peer, uint64_t deadline);
    /* Frees peer->path_state[id] as the peer's last reference goes (its control connection is
     * closed); must not touch the provider's engine-wide state, which may be gone already. */
    void (*detach)(kvb_peer_t *peer);
    /* True if this path can carry `op` to the attached peer: its local memory (op->pin) and its
     * remote range (op->rregion, NULL if the peer's list names no region holding it, which only a
     * two-sided path may leave to the target to check). May block once per local allocation.
     * *span comes in as op's own local range; a path widens it to the local addresses for which
     * its answer is the same for every op of the same op->pin and op->rregion, and the engine
     * then asks once per such run of requests, not per request. */
    bool (*reaches)(kvb_provider_t *pv, kvb_peer_t *peer, const kvb_op_t *op, kvb_span_t *span);
    /* Starts ops (linked through op->next, all of this path). Never blocks on the network; each
     * op ends exactly once through kvb__op_done, with its data placed or an error. */
    void (*submit)(kvb_provider_t *pv, kvb_peer_t *peer, kvb_op_t *ops);
    /* Optional: makes progress on the batch's ops from its waiting thread until something
     * completed or `deadline`; KVB_ERR_BUSY when another thread does that now. */
    int (*progress)(kvb_batch_t *b, uint64_t deadline);
    /* Optional: the batch was cancelled or freed; ops of it this path has not started yet may end
     * now with KVB_ERR_CANCELED instead of moving their bytes. (The TCP lanes have none: frames
     * queued are sent, and their answers discarded.) */
    void (*cancel)(kvb_provider_t *pv, kvb_batch_t *b);
    /* Optional: a notification is about to reach the application; make what peers wrote here
     * one-sided (a NIC into GPU memory) visible to its consumers first. */
    void (*settle)(kvb_provider_t *pv);
};

/* The built-in providers by id (NULL where none), from transport/transports.c. */
const kvb_provider_ops_t *kvb__provider(unsigned id);
/* The id of the provider called `name`, or -1. */
int kvb__provider_id(const char *name);
/* The libfabric provider the fabric path runs on ("tcp;ofi_rxm"), from transport/fabric.c; ""
 * when pv is NULL or the path is compiled out. */
const char *kvb__fabric_provider_name(const kvb_provider_t *pv);

/* The built-in transport named `name` (NULL: the default), from transport/transports.c. */
const kvb_transport_ops_t *kvb__transport_find(const char *name);

/* A segment handle is (generation << 16) | (slot index + 1): a slot's generation moves on when
 * it is freed, so a handle kept after its last close never reaches the slot's next peer. */
#define KVB_SEG_SLOTS_MAX 0xFFFFu
typedef struct kvb_segment_slot {
    kvb_peer_t *peer; /* NULL: free, or being opened */
    unsigned opens;
    uint16_t gen;
    bool opening; /* a thread is connecting it (without holding any lock); others wait */
    char name[KVB_NAME_MAX + 1];
} kvb_segment_slot_t;

struct kvb_engine {
    /* The caller's reference, plus one per batch not yet released: batches stay valid after
     * kvb_engine_destroy (engine.h) and still read a few fields, so the struct itself is freed
     * by the last of them (kvb__engine_put). */
    atomic_uint refs;
    kvb_config_t cfg;
    uint8_t *secret; /* the cluster secret (wiped when freed); NULL: none, loopback only */
    size_t secret_len;
    char bind_addr[KVB_NAME_MAX + 1];
    char advertise_addr[KVB_NAME_MAX + 1];
    char segment_name[KVB_NAME_MAX + 1];
    char tcp_congestion[16]; /* TCP_CA_NAME_MAX: the configured algorithm, then the one in use */
    kvb_cpus_t cpus;         /* where the data threads run (cfg.cpus); n == 0: anywhere */
    char *cpus_text;         /* cpus as a list, for kvb_engine_cpus; NULL: none */
    kvb_hello_t hello;       /* our identity: incarnation, pid, host id, name */
    kvb_registry_t registry;
    const kvb_transport_ops_t *tp_ops;
    kvb_transport_t *tp;
    kvb_shm_t *shm; /* kvb_alloc memory and the same-host data path's engine-wide state */
    /* Data paths: the providers running here, the order ops try them in (`protocol`), and the
     * ones that must reach every peer (named explicitly there). */
    kvb_provider_t *path_state[KVB_PATHS];
    /* Batches may be freed after kvb_engine_destroy: their cancel reaches the paths only under
     * this lock's read side, and only while `paths` is not 0 (destroy clears it, write side). */
    pthread_rwlock_t paths_lock;
    unsigned paths; /* bit i: provider i runs here */
    uint8_t order[KVB_PATHS];
    size_t norder;
    unsigned required;

    pthread_mutex_t seg_mu; /* the segment table; held only briefly, never across a connect */
    pthread_cond_t seg_cv;  /* a slot stopped `opening` */
    kvb_segment_slot_t *segs;
    size_t nsegs;

    pthread_mutex_t notify_mu; /* received notifications: a bounded ring */
    pthread_cond_t notify_cv;
    unsigned notify_waiters; /* threads in kvb_notify_recv: destroy waits until they left */
    kvb_notification_t *notify_ring;
    size_t notify_head, notify_count, notify_cap;
    bool stopping;
    atomic_long live_batches;
    /* Memory of released batches, kept for the next ones (see batch_mem_get); lives until the
     * engine's last reference goes. */
    pthread_mutex_t batch_mu;
    struct batch_mem *batch_cache;
    size_t batch_cached;     /* bytes */
    pthread_mutex_t attr_mu; /* our published attributes */
    kvb_attr_t *attrs;
    size_t nattrs;
    /* the metadata store binding (NULL in p2p mode) */
    kvb_segbind_t *segbind;
    char cluster[KVB_CLUSTER_MAX + 1];
    /* kvb_engine_stats counters, initiator side */
    atomic_ullong st_completed, st_failed;
    atomic_ullong st_path_ops[KVB_PATHS], st_path_bytes[KVB_PATHS]; /* by KVB_PATH_* */
};

/* Our published attributes, encoded for the wire (malloc'd). */
int kvb__engine_attrs_encode(kvb_engine_t *e, uint8_t **out, size_t *len);

/* Drops a reference to the engine's struct (see refs); the last one frees it. */
void kvb__engine_put(kvb_engine_t *e);
/* Frees the memory kept for batches (the engine's last reference is going). */
void kvb__batch_cache_drain(kvb_engine_t *e);

/* Returns the peer behind `seg` with a reference taken, or NULL. */
kvb_peer_t *kvb__segment_peer(kvb_engine_t *e, kvb_segment_t seg);

/* Called by transports. */
bool kvb__batch_done(kvb_batch_t *b); /* locks the batch */
void kvb__op_done(kvb_op_t *op, int status, uint64_t bytes);
/* kvb__op_done for a list of ops (linked by next, consecutive ops of one batch together), each
 * ending with `status` and, when it is KVB_OK, all of its bytes: one hold of each batch's lock. */
void kvb__ops_done(kvb_op_t *ops, int status);
/* For a path whose access to op's local memory outlives the op (a NIC's RDMA still out when
 * the op timed out or was cancelled): call before kvb__op_done; kvb_batch_settle then waits for
 * the kvb__batch_unlinger that the returned batch (kept alive until then) is owed. */
kvb_batch_t *kvb__op_linger(kvb_op_t *op);
void kvb__batch_unlinger(kvb_batch_t *b);
/* For READ payloads, which land in the caller's memory: a copy into a batch's destinations
 * begins with kvb__batch_copy_begin and ends with kvb__batch_copy_end (given what begin
 * returned); between them, kvb__op_dst_held says where op's bytes may go, or NULL when they must
 * be dropped (its request ended, its batch was freed). A request that ends other than by its own
 * bytes - a deadline, a cancel, a free, a failure on another lane - waits out the copies begun
 * before its end was published, so no byte lands once its caller can see the end. Neither takes
 * the batch's lock or blocks: threads receiving one batch's answers on several lanes copy at once.
 * Nothing between them may take the batch's lock or end a request. */
unsigned kvb__batch_copy_begin(kvb_batch_t *b);
uint8_t *kvb__op_dst_held(const kvb_op_t *op);
void kvb__batch_copy_end(kvb_batch_t *b, unsigned slot);
/* Queues a received notification; KVB_ERR_REMOTE_NO_SPACE if the queue is full. */
int kvb__notify_deliver(kvb_engine_t *e, const char *from, const void *data, size_t len,
                        uint64_t reply_to);

void kvb__peer_release(kvb_peer_t *peer);
/* Marks the peer lost (first error wins) and tells the transport to close it. */
void kvb__peer_fail(kvb_peer_t *peer, int error);

/* Same-host memory, implemented in transport/shm.c: engine-wide state (kvb_alloc allocations,
 * the Unix listener for same-host links when `listen`, the copy pool) and the allocations. */
int kvb__shm_create(kvb_engine_t *e, bool listen, int copy_threads, kvb_shm_t **out);
void kvb__shm_destroy(kvb_shm_t *s);
int kvb__shm_alloc(kvb_shm_t *s, size_t len, unsigned flags, void **out);
int kvb__shm_free(kvb_shm_t *s, void *ptr);
/* The allocation holding [addr, addr+len), as (id, base, length); false if none. */
bool kvb__shm_alloc_of(kvb_shm_t *s, uint64_t addr, uint64_t len, uint64_t *id, uint64_t *base,
                       uint64_t *alloc_len);

/* Fills buf with the 16-byte id of this host (boot id; hostname hash as a fallback). */
void kvb__host_id(uint8_t out[KVB_HOST_ID_LEN]);

/* Whether a hello names e's host. Only a claim: a same-host path still checks who the kernel says
 * is at the other end (SO_PEERCRED, the link tokens). */
static inline bool kvb__same_host(const kvb_engine_t *e, const kvb_hello_t *h)
{
    return memcmp(h->host_id, e->hello.host_id, KVB_HOST_ID_LEN) == 0;
}

#endif
