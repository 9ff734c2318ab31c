/* SPDX-License-Identifier: Apache-2.0 */
/* The fabric data path: one-sided RDMA READ/WRITE through libfabric (FI_EP_RDM + FI_RMA) - verbs
 * (InfiniBand, RoCE), EFA and cxi in production, libfabric's `tcp;ofi_rxm` and `shm` for testing.
 *
 * Provider. kvb_config_t.fabric_provider names it ("verbs;ofi_rxm", "efa", "tcp;ofi_rxm", ...);
 * NULL takes the first RDMA provider libfabric finds here (verbs;ofi_rxm, efa, cxi), asked only
 * where the kernel lists an RDMA device, and nothing else: a slower provider is never picked in
 * its place. The one in use is logged and reported by kvb_engine_fabric_provider() (bench prints
 * it).
 *
 * Memory. Each region is registered following the mr_mode the provider returned: our own keys or
 * the provider's (FI_MR_PROV_KEY), offsets or virtual addresses (FI_MR_VIRT_ADDR), a local
 * descriptor for every transfer (FI_MR_LOCAL), bind + enable on the endpoint (FI_MR_ENDPOINT).
 * A region larger than the registration limit (KVB_FABRIC_MR_MAX, else whatever the provider
 * accepts: a refused registration is split in halves down to 64 MiB) takes several registrations
 * of `split` bytes each. Rights are enforced at registration: a read-only region's keys grant
 * FI_REMOTE_READ only. Unregistering closes the registrations before kvb_unregister returns
 * (only after the engine's pins dropped, so none of our own requests still use them); a peer's
 * request in flight on a closed key fails on the peer.
 *
 * Key blob (per region, in the authenticated HELLO_ACK; little-endian):
 *   u8 'F' | u8 version 1 | u8 flags (bit 0: virtual addressing) | u8 nmr | u8 addr_len | u8 0[3]
 *   | u32 hash of the provider name | u64 split | u64 key[nmr] | addr_len bytes of fi_getname.
 * The endpoint address rides in every blob (it is tens of bytes: 16 for tcp, 19 for shm, 32 for
 * efa) so a region is self-contained; a region whose blob would not fit KVB_KEY_MAX (too many
 * registrations) is refused by this path with a warning, and the TCP lanes serve it.
 *
 * Transfers. One RDM endpoint, one CQ and one address vector per engine. An op (at most
 * KVB_CHUNK_SIZE) is cut into segments at registration boundaries on both sides and at the
 * message size limit; segments are posted while fewer than the tx queue depth are in flight, the
 * rest wait in a queue that the progress thread drains as completions free slots (-FI_EAGAIN
 * leaves the segment queued and progresses the CQ). WRITEs carry FI_DELIVERY_COMPLETE: an op is
 * COMPLETED only when its bytes are in the target's memory, so a batch's notification (sent by
 * the engine once every op completed) never overtakes the data. A provider without
 * delivery-complete (verbs;ofi_rxm may be one) is taken only if it orders a READ after earlier
 * WRITEs to the same peer (FI_ORDER_RAW): each WRITE op then ends with a 1-byte READ of what it
 * wrote, and completes when that READ does - a flush, not a fence for later ops (so writable
 * regions' keys also grant remote read there). Neither: the provider is refused.
 *
 * Progress. A thread reads the CQ: it completes our ops, and drives the provider for peers'
 * requests aimed at us (manual-progress providers move nothing for a target that never reads its
 * CQ). It sleeps on the CQ's wait fd where the provider has one (tcp, verbs) and polls with short
 * sleeps where it does not (shm). Every 10 ms at most it ends ops past their batch's deadline or
 * to a lost peer (the control plane's liveness); such an op's local region stays pinned until the
 * provider returns its segments, since the NIC may still write there. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/internal.h"

#ifndef KVB_HAVE_LIBFABRIC

/* Built without libfabric: the path never runs; naming it in `protocol` fails engine creation. */
static int fab_create(kvb_engine_t *e, kvb_provider_t **out)
{
    (void)out;
    if (e->required & (1u << KVB_PATH_FABRIC))
        KVB_ERROR("data path fabric: this kvbridge was built without libfabric (install "
                  "libfabric-dev and rebuild)");
    return KVB_ERR_UNSUPPORTED;
}

const char *kvb__fabric_provider_name(const kvb_provider_t *pv)
{
    (void)pv;
    return "";
}

const kvb_provider_ops_t kvb__fabric_provider = {
    .name = "fabric",
    .id = KVB_PATH_FABRIC,
    .remote_region = true,
    .create = fab_create,
};

#else

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdio.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/le.h"
#include "transport/cuda_driver.h"

/* libfabric is opened (dlopen) when a fabric path is first wanted, not linked: Debian's build
 * pulls in the PSM libraries, and libinfinipath's constructor installs signal handlers in the
 * process that loads it (SIGSEGV, SIGABRT, SIGTERM: a backtrace file in the working directory,
 * then exit()) - no inference engine embedding kvbridge should have its signals taken over for a
 * path it never asked for. KVB_FABRIC_LIBRARY names another file. These six are all the path calls
 * by symbol; the rest of libfabric's API is inline calls through its objects' ops tables. */
static struct {
    __typeof__(fi_getinfo) *getinfo;
    __typeof__(fi_freeinfo) *freeinfo;
    __typeof__(fi_dupinfo) *dupinfo;
    __typeof__(fi_fabric) *fabric;
    __typeof__(fi_version) *version;
    __typeof__(fi_strerror) *strerror;
    char error[160]; /* why it could not be opened; "" when it was */
} fab_lib;
static pthread_once_t fab_lib_once = PTHREAD_ONCE_INIT;

static void fab_lib_open(void)
{
    const char *file = getenv("KVB_FABRIC_LIBRARY");
    file = file && *file ? file : "libfabric.so.1";
    void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(fab_lib.error, sizeof fab_lib.error, "%s", dlerror());
        return;
    }
    /* Kept open for the life of the process: providers' threads may outlive any one engine. */
    *(void **)&fab_lib.getinfo = dlsym(h, "fi_getinfo");
    *(void **)&fab_lib.freeinfo = dlsym(h, "fi_freeinfo");
    *(void **)&fab_lib.dupinfo = dlsym(h, "fi_dupinfo");
    *(void **)&fab_lib.fabric = dlsym(h, "fi_fabric");
    *(void **)&fab_lib.version = dlsym(h, "fi_version");
    *(void **)&fab_lib.strerror = dlsym(h, "fi_strerror");
    if (!fab_lib.getinfo || !fab_lib.freeinfo || !fab_lib.dupinfo || !fab_lib.fabric ||
        !fab_lib.version || !fab_lib.strerror)
        snprintf(fab_lib.error, sizeof fab_lib.error, "%s lacks fi_getinfo, fi_fabric, ...", file);
}

/* Opens libfabric once per process; false (with the reason in fab_lib.error) if it cannot be. */
static bool fab_lib_ready(void)
{
    pthread_once(&fab_lib_once, fab_lib_open);
    return fab_lib.error[0] == '\0';
}

#define fi_getinfo     fab_lib.getinfo
#define fi_freeinfo    fab_lib.freeinfo
#define fi_dupinfo     fab_lib.dupinfo
#define fi_fabric      fab_lib.fabric
#define fi_version     fab_lib.version
#define fi_strerror    fab_lib.strerror
#define fi_allocinfo() fab_lib.dupinfo(NULL) /* the header's inline one calls the symbol */

#define KEY_MAGIC     'F'
#define KEY_VERSION   1
#define KEY_HDR       20
#define KEY_VIRT      1u
#define ADDR_MAX      64
#define MR_MIN_SPLIT  (64ull << 20)
#define SCAN_NS       (10ull * 1000 * 1000)
#define CQ_BATCH      32
#define POLL_MIN_NS   50000ull
#define POLL_MAX_NS   1000000ull
#define PROV_NAME_MAX 64
#define STOP_DRAIN_MS 2000u /* an engine going waits this long for its segments still out */

/* Registrations of one region (reg->path_state[KVB_PATH_FABRIC]). */
typedef struct {
    uint64_t split; /* registration i covers [addr + i*split, ...) */
    size_t n;
    struct {
        struct fid_mr *mr;
        void *desc;
        uint64_t key;
    } mr[];
} fab_reg_t;

/* A peer's endpoint, inserted into our address vector on first use. */
typedef struct {
    pthread_mutex_t mu;
    bool have;
    fi_addr_t fa;
    size_t addr_len;
    uint8_t addr[ADDR_MAX];
} fab_peer_t;

struct fab_op;
typedef struct {
    struct fi_context2 ctx; /* first: the CQ gives it back */
    struct fab_op *fo;
    uint8_t *local;
    void *desc;
    uint64_t raddr, key, len;
    bool read; /* a READ: the op's own, or a WRITE op's flush */
} fab_seg_t;

/* One engine op in flight, cut into segments. Lives until every posted segment came back. */
typedef struct fab_op {
    struct fab_op *next_pending, *next_active, **prev_active;
    kvb_op_t *op;        /* NULL once ended (completed, failed, timed out, cancelled) */
    kvb_batch_t *batch;  /* valid while op is: identifies the batch for cancel */
    kvb_batch_t *linger; /* the op ended with segments out: its batch, until they are back */
    kvb_peer_t *peer;    /* a reference */
    fi_addr_t fa;        /* its endpoint */
    kvb_region_t *pin;   /* the local region, pinned until the provider is done with it */
    uint64_t deadline;
    int status;
    bool write;
    size_t nseg, posted, out; /* segments, posted so far, posted and not yet returned */
    fab_seg_t seg[];
} fab_op_t;

typedef struct {
    kvb_engine_t *engine;
    char prov[PROV_NAME_MAX];
    uint32_t prov_hash;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    uint64_t mr_mode;
    uint64_t key_mask; /* keys we choose must fit mr_key_size */
    atomic_ullong next_key;
    uint64_t mr_max;  /* registration size limit (test knob), 0: none */
    uint64_t seg_max; /* segment size limit */
    size_t depth;     /* segments in flight at most */
    uint8_t addr[ADDR_MAX];
    size_t addr_len;
    int cq_fd;        /* the CQ's wait fd; -1: poll */
    uint64_t poll_ns; /* without one: the progress thread's current sleep */
    int wake_fd;
    bool flush; /* no FI_DELIVERY_COMPLETE: each WRITE op ends with a 1-byte READ (FI_ORDER_RAW) */
    bool hmem;  /* the provider registers CUDA device memory (FI_HMEM) */
    atomic_uint hmem_devs; /* bit d: device memory of CUDA device d registered (for settle) */
    atomic_bool hmem_told; /* device memory refused: logged once */
    uint8_t scratch[8];    /* where flush READs land */
    struct fid_mr *scratch_mr;
    void *scratch_desc;
    pthread_t thread;
    pthread_mutex_t mu; /* guards everything below, and posting */
    bool stop;          /* post nothing more; the thread ends once nothing is out, or at stop_by */
    uint64_t stop_by;
    size_t inflight;
    fab_op_t *pending, **pending_tail; /* ops with segments not yet posted, in order */
    fab_op_t *active;                  /* every op not yet freed */
    bool again;                        /* the provider said -FI_EAGAIN: post after progress */
    uint64_t next_log;                 /* CQ errors are logged once per second */
    unsigned long unlogged;
} fab_path_t;

/* ---- helpers --------------------------------------------------------------------------------- */

static uint32_t fnv32(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* A libfabric error (positive or negative FI_E*) as a kvbridge status. */
static int status_of(int err)
{
    switch (err < 0 ? -err : err) {
    case FI_ENOMEM:
        return KVB_ERR_NOMEM;
    case FI_EACCES:
    case FI_EPERM:
        return KVB_ERR_ACCESS_DENIED;
    case FI_EKEYREJECTED:
    case FI_EINVAL:
    case FI_EFAULT:
        return KVB_ERR_REMOTE_NOT_REGISTERED; /* an unknown key, or a range outside it */
    case FI_ECANCELED: /* we never cancel a posted request: the provider dropped the peer's */
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case FI_ENOTCONN:
    case FI_ESHUTDOWN:
    case FI_EADDRNOTAVAIL:
    case FI_EIO:
        return KVB_ERR_PEER_LOST;
    case FI_ETIMEDOUT:
        return KVB_ERR_TIMEOUT;
    case FI_ENOSYS:
    case FI_EOPNOTSUPP:
        return KVB_ERR_UNSUPPORTED;
    default:
        return KVB_ERR_SYSTEM;
    }
}

static uint64_t env_u64(const char *name)
{
    const char *s = getenv(name);
    return s && *s ? strtoull(s, NULL, 0) : 0;
}

/* ---- set-up ---------------------------------------------------------------------------------- */

/* The first fi_info of `prov` offering RDM endpoints with RMA and delivery-complete writes (and
 * device memory, with `hmem`). */
static int find_info(uint32_t version, const char *prov, bool dc, bool hmem, struct fi_info **out)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return -FI_ENOMEM;
    hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    if (hmem) {
        hints->caps |= FI_HMEM;
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
    }
    hints->domain_attr->threading = FI_THREAD_SAFE;
    if (dc)
        hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    else /* a READ after WRITEs to the same peer is ordered after them: the flush */
        hints->tx_attr->msg_order = FI_ORDER_RAW;
    hints->fabric_attr->prov_name = strdup(prov);
    struct fi_info *list = NULL;
    int rc = hints->fabric_attr->prov_name ? fi_getinfo(version, NULL, NULL, 0, hints, &list)
                                           : -FI_ENOMEM;
    fi_freeinfo(hints);
    if (rc)
        return rc;
    /* Exactly the provider asked for: a layered name must match in full. */
    struct fi_info *pick = NULL;
    for (struct fi_info *i = list; i && !pick; i = i->next)
        if (i->fabric_attr && i->fabric_attr->prov_name && !strcmp(i->fabric_attr->prov_name, prov))
            pick = i;
    if (!pick) {
        fi_freeinfo(list);
        return -FI_ENODATA;
    }
    *out = fi_dupinfo(pick);
    fi_freeinfo(list);
    return *out ? 0 : -FI_ENOMEM;
}

/* `prov` with delivery-complete writes, else (*flush) with reads ordered after writes, which
 * WRITEs are then flushed with. KVB_FABRIC_FLUSH=1 takes the second even where the first works
 * (the tests run the flush that way). */
static int pick_one(uint32_t version, const char *prov, bool hmem, bool *flush,
                    struct fi_info **out)
{
    int rc = env_u64("KVB_FABRIC_FLUSH") ? -FI_ENODATA : find_info(version, prov, true, hmem, out);
    *flush = rc != 0;
    if (rc)
        rc = find_info(version, prov, false, hmem, out);
    return rc;
}

/* pick_one with device memory (*hmem) where there is a CUDA driver and `prov` offers FI_HMEM,
 * else without. */
static int pick(uint32_t version, const char *prov, bool *flush, bool *hmem, struct fi_info **out)
{
    *hmem = kvb__cuda_available() && pick_one(version, prov, true, flush, out) == 0;
    return *hmem ? 0 : pick_one(version, prov, false, flush, out);
}

/* Registers the bytes flush READs land in (their value is never looked at). */
static int scratch_open(fab_path_t *fp)
{
    int rc = fi_mr_reg(fp->domain, fp->scratch, sizeof fp->scratch, FI_READ | FI_WRITE, 0,
                       atomic_fetch_add(&fp->next_key, 1) & fp->key_mask, 0, &fp->scratch_mr, NULL);
    if (!rc && (fp->mr_mode & FI_MR_ENDPOINT)) {
        rc = fi_mr_bind(fp->scratch_mr, &fp->ep->fid, 0);
        if (!rc)
            rc = fi_mr_enable(fp->scratch_mr);
    }
    if (!rc)
        fp->scratch_desc = fi_mr_desc(fp->scratch_mr);
    return rc;
}

/* Opens fabric, domain, CQ, AV and endpoint. */
static int open_ep(fab_path_t *fp)
{
    struct fi_info *info = fp->info;
    int rc = fi_fabric(info->fabric_attr, &fp->fabric, NULL);
    if (!rc)
        rc = fi_domain(fp->fabric, info, &fp->domain, NULL);
    if (rc)
        return rc;
    struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_FD};
    ca.size = info->tx_attr->size * 2;
    fp->cq_fd = -1;
    /* A wait fd lets the thread sleep until the provider has something; shm has none. */
    if (fi_cq_open(fp->domain, &ca, &fp->cq, NULL) == 0 &&
        fi_control(&fp->cq->fid, FI_GETWAIT, &fp->cq_fd) != 0) {
        fi_close(&fp->cq->fid);
        fp->cq = NULL;
        fp->cq_fd = -1;
    }
    if (!fp->cq) {
        ca.wait_obj = FI_WAIT_NONE;
        if ((rc = fi_cq_open(fp->domain, &ca, &fp->cq, NULL)))
            return rc;
    }
    struct fi_av_attr aa = {.type = FI_AV_TABLE};
    if ((rc = fi_av_open(fp->domain, &aa, &fp->av, NULL)))
        return rc;
    /* libfabric 1.17's shm provider names an endpoint's region "PID:DOMAIN:EP" in /dev/shm and,
     * finding one there already, takes it over only if the pid written in it is not alive. A
     * process killed with its endpoint open leaves its region behind, and the process that is
     * given its pid next finds that pid alive - its own - and fails with -FI_EBUSY, having
     * removed the region. A fresh endpoint is named with the next EP number: try again, a few
     * times (a dead process may have left several). */
    for (int attempt = 0;; attempt++) {
        if ((rc = fi_endpoint(fp->domain, info, &fp->ep, NULL)))
            return rc;
        if ((rc = fi_ep_bind(fp->ep, &fp->cq->fid, FI_TRANSMIT | FI_RECV)) ||
            (rc = fi_ep_bind(fp->ep, &fp->av->fid, 0)))
            return rc;
        if (!(rc = fi_enable(fp->ep)))
            break;
        if (rc != -FI_EBUSY || attempt == 3)
            return rc;
        KVB_INFO("data path fabric: provider %s: the endpoint's name was taken (a region left "
                 "by a dead process with this pid); opening another",
                 info->fabric_attr->prov_name);
        fi_close(&fp->ep->fid);
        fp->ep = NULL;
    }
    fp->addr_len = sizeof fp->addr;
    if ((rc = fi_getname(&fp->ep->fid, fp->addr, &fp->addr_len)))
        return rc == -FI_ETOOSMALL ? -FI_EOVERFLOW : rc;
    return 0;
}

static void close_ep(fab_path_t *fp)
{
    if (fp->scratch_mr)
        fi_close(&fp->scratch_mr->fid);
    if (fp->ep)
        fi_close(&fp->ep->fid);
    if (fp->av)
        fi_close(&fp->av->fid);
    if (fp->cq)
        fi_close(&fp->cq->fid);
    if (fp->domain)
        fi_close(&fp->domain->fid);
    if (fp->fabric)
        fi_close(&fp->fabric->fid);
    fi_freeinfo(fp->info);
}

static void *progress_main(void *arg);

/* Whether the kernel lists an RDMA device: InfiniBand/RoCE and EFA under infiniband, Slingshot
 * under cxi. */
static bool rdma_device(void)
{
    static const char *const dirs[] = {"/sys/class/infiniband", "/sys/class/cxi"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        DIR *d = opendir(dirs[i]);
        struct dirent *de;
        bool any = false;
        while (d && !any && (de = readdir(d)))
            any = de->d_name[0] != '.';
        if (d)
            closedir(d);
        if (any)
            return true;
    }
    return false;
}

static void path_free(fab_path_t *fp)
{
    close_ep(fp);
    if (fp->wake_fd >= 0)
        close(fp->wake_fd);
    pthread_mutex_destroy(&fp->mu);
    free(fp);
}

/* The provider this engine runs on: the one its config names, else the first RDMA provider here.
 * KVB_ERR_UNSUPPORTED: none (the path does not run); KVB_ERR_INVALID_ARG: the named one is not
 * available. */
static int choose(kvb_engine_t *e, struct fi_info **out, bool *flush_out, bool *hmem_out)
{
    bool required = e->required & (1u << KVB_PATH_FABRIC);
    const char *want = e->cfg.fabric_provider;
    static const char *const rdma[] = {"verbs;ofi_rxm", "efa", "cxi"};
    struct fi_info *info = NULL;
    int rc = -FI_ENODATA;
    bool flush = false, hmem = false;
    bool named = want && *want;
    if (!named && !rdma_device()) {
        /* libfabric's first fi_getinfo loads and probes every provider (0.3 s here): not for
         * every engine on a host that has no RDMA device to find. */
        if (required)
            KVB_ERROR("data path fabric: no RDMA device here (/sys/class/infiniband, "
                      "/sys/class/cxi); name a provider (fabric_provider, --fabric-provider) "
                      "such as \"tcp;ofi_rxm\" to test without one");
        else
            KVB_DEBUG("data path fabric: no RDMA device here");
        return KVB_ERR_UNSUPPORTED;
    }
    if (!fab_lib_ready()) {
        if (required || named)
            KVB_ERROR("data path fabric: cannot open libfabric (install libfabric1, or set "
                      "KVB_FABRIC_LIBRARY): %s",
                      fab_lib.error);
        return named ? KVB_ERR_INVALID_ARG : KVB_ERR_UNSUPPORTED;
    }
    /* The API we speak: the library's, capped at the headers we were built with (asking a 1.17
     * library for 1.18 fails with -FI_ENOSYS). */
    uint32_t lib = fi_version(), hdr = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    uint32_t version = lib < hdr ? lib : hdr;
    if (named) {
        rc = pick(version, want, &flush, &hmem, &info);
    } else {
        for (size_t i = 0; i < sizeof rdma / sizeof rdma[0] && rc; i++)
            rc = pick(version, rdma[i], &flush, &hmem, &info);
    }
    if (rc) {
        if (required || (want && *want))
            KVB_ERROR("data path fabric: libfabric %u.%u offers no %s%s with RDM endpoints, RMA "
                      "and delivery-complete writes (or reads ordered after writes) here: %s",
                      FI_MAJOR(lib), FI_MINOR(lib), want && *want ? "provider " : "RDMA provider",
                      want && *want ? want : " (verbs;ofi_rxm, efa, cxi)", fi_strerror(-rc));
        else
            KVB_DEBUG("data path fabric: no RDMA provider here (%s)", fi_strerror(-rc));
        /* A provider asked for by name and missing is a configuration error, not a path that
         * quietly does not run: the engine would otherwise move everything over TCP. */
        return want && *want ? KVB_ERR_INVALID_ARG : KVB_ERR_UNSUPPORTED;
    }
    *out = info;
    *flush_out = flush;
    *hmem_out = hmem;
    return KVB_OK;
}

static int fab_create(kvb_engine_t *e, kvb_provider_t **out)
{
    struct fi_info *info = NULL;
    bool flush = false, hmem = false;
    int rc = choose(e, &info, &flush, &hmem);
    if (rc)
        return rc;
    uint32_t lib = fi_version();
    fab_path_t *fp = calloc(1, sizeof *fp);
    if (!fp) {
        fi_freeinfo(info);
        return KVB_ERR_NOMEM;
    }
    fp->engine = e;
    fp->info = info;
    fp->flush = flush;
    fp->hmem = hmem;
    fp->wake_fd = -1;
    snprintf(fp->prov, sizeof fp->prov, "%s", info->fabric_attr->prov_name);
    fp->prov_hash = fnv32(fp->prov);
    fp->mr_mode = info->domain_attr->mr_mode;
    size_t ks = info->domain_attr->mr_key_size;
    fp->key_mask = ks >= 8 || ks == 0 ? UINT64_MAX : (1ull << (8 * ks)) - 1;
    atomic_init(&fp->next_key, 1);
    fp->mr_max = env_u64("KVB_FABRIC_MR_MAX"); /* tests force several registrations */
    fp->seg_max = info->ep_attr->max_msg_size ? info->ep_attr->max_msg_size : KVB_CHUNK_SIZE;
    uint64_t knob = env_u64("KVB_FABRIC_SEG_MAX");
    if (knob && knob < fp->seg_max)
        fp->seg_max = knob;
    fp->depth = info->tx_attr->size ? info->tx_attr->size : 64;
    fp->pending_tail = &fp->pending;
    pthread_mutex_init(&fp->mu, NULL);
    rc = open_ep(fp);
    if (!rc && fp->flush)
        rc = scratch_open(fp);
    if (rc) {
        KVB_ERROR("data path fabric: provider %s: cannot open an endpoint: %s", fp->prov,
                  fi_strerror(-rc));
        path_free(fp);
        return KVB_ERR_SYSTEM;
    }
    fp->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fp->wake_fd < 0 ||
        kvb__thread_create(&fp->thread, NULL, -1, "kvb-fabric", -1, progress_main, fp)) {
        path_free(fp);
        return KVB_ERR_SYSTEM;
    }
    KVB_INFO(
        "data path fabric: libfabric %u.%u provider %s (fabric %s, domain %s), mr_mode 0x%llx, "
        "queue depth %zu, %s progress, writes %s",
        FI_MAJOR(lib), FI_MINOR(lib), fp->prov, info->fabric_attr->name, info->domain_attr->name,
        (unsigned long long)fp->mr_mode, fp->depth, fp->cq_fd >= 0 ? "fd-driven" : "polled",
        fp->flush ? "flushed by a READ (no delivery-complete)" : "delivery-complete");
    *out = (kvb_provider_t *)fp;
    return KVB_OK;
}

const char *kvb__fabric_provider_name(const kvb_provider_t *pv)
{
    return pv ? ((const fab_path_t *)pv)->prov : "";
}

/* ---- registration ---------------------------------------------------------------------------- */

static void reg_close(fab_reg_t *r)
{
    for (size_t i = 0; r && i < r->n; i++)
        if (r->mr[i].mr)
            fi_close(&r->mr[i].mr->fid);
    free(r);
}

/* Registers [addr, addr+len) of `reg` (device memory through FI_HMEM_CUDA) as r->mr[i]. */
static int mr_one(fab_path_t *fp, const kvb_region_t *reg, uint64_t addr, uint64_t len,
                  uint64_t access, fab_reg_t *r, size_t i)
{
    uint64_t key = 0;
    if (!(fp->mr_mode & FI_MR_PROV_KEY))
        key = atomic_fetch_add(&fp->next_key, 1) & fp->key_mask;
    struct fid_mr *mr = NULL;
    struct iovec iov = {.iov_base = (void *)(uintptr_t)addr, .iov_len = len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = key;
    attr.iface = reg->kind == KVB_MEM_CUDA ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (reg->kind == KVB_MEM_CUDA)
        attr.device.cuda = reg->device;
    int rc = fi_mr_regattr(fp->domain, &attr, 0, &mr);
    if (!rc && (fp->mr_mode & FI_MR_ENDPOINT)) {
        rc = fi_mr_bind(mr, &fp->ep->fid, 0);
        if (!rc)
            rc = fi_mr_enable(mr);
    }
    if (rc) {
        if (mr)
            fi_close(&mr->fid);
        return rc;
    }
    r->mr[i].mr = mr;
    r->mr[i].desc = fi_mr_desc(mr);
    r->mr[i].key = fi_mr_key(mr);
    if (r->mr[i].key == FI_KEY_NOTAVAIL)
        return -FI_ENOKEY; /* FI_MR_RAW keys: not asked for, never expected */
    return 0;
}

/* Registers [addr, addr+len) in pieces of `split` bytes. */
static int reg_split(fab_path_t *fp, const kvb_region_t *reg, uint64_t split, uint64_t access,
                     fab_reg_t **out)
{
    size_t n = (size_t)((reg->len + split - 1) / split);
    fab_reg_t *r = calloc(1, sizeof *r + n * sizeof r->mr[0]);
    if (!r)
        return -FI_ENOMEM;
    r->split = split;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++, r->n = i) {
        uint64_t off = i * split, len = reg->len - off < split ? reg->len - off : split;
        rc = mr_one(fp, reg, reg->addr + off, len, access, r, i);
    }
    if (rc) {
        reg_close(r);
        return rc;
    }
    *out = r;
    return 0;
}

static int fab_reg(kvb_provider_t *pv, kvb_region_t *reg, uint8_t *key, size_t *key_len)
{
    fab_path_t *fp = (fab_path_t *)pv;
    if (reg->kind == KVB_MEM_CUDA && !fp->hmem) {
        if (!atomic_exchange(&fp->hmem_told, true))
            KVB_WARN("data path fabric: provider %s does not take GPU memory (it offers no "
                     "FI_HMEM: a libfabric built without CUDA support, as Debian's is), so %s "
                     "memory takes the cuda or tcp path",
                     fp->prov, reg->location);
        return KVB_ERR_UNSUPPORTED;
    }
    if (reg->kind != KVB_MEM_CPU && reg->kind != KVB_MEM_CUDA)
        return KVB_ERR_UNSUPPORTED;
    /* Rights at registration: a peer never gets a key granting more than the region does. */
    uint64_t access = FI_READ | FI_WRITE;
    if (reg->access & KVB_ACCESS_READ)
        access |= FI_REMOTE_READ;
    if (reg->access & KVB_ACCESS_WRITE)
        access |= FI_REMOTE_WRITE;
    /* Flushing a WRITE reads one byte of what it wrote: a write-only region is then readable by
     * the NIC (kvbridge itself still refuses READ requests on it). */
    if (fp->flush && (reg->access & KVB_ACCESS_WRITE))
        access |= FI_REMOTE_READ;
    uint64_t split = fp->mr_max ? fp->mr_max : reg->len;
    fab_reg_t *r = NULL;
    int rc;
    /* Providers limit one registration's size (verbs: the device's max_mr_size, which libfabric
     * does not report): halve until one is accepted, rather than register less than asked. */
    for (;;) {
        rc = reg_split(fp, reg, split, access, &r);
        if (rc != -FI_EINVAL && rc != -FI_ENOMEM && rc != -FI_E2BIG && rc != -FI_ETOOSMALL)
            break;
        if (split <= MR_MIN_SPLIT)
            break;
        split = split / 2 > MR_MIN_SPLIT ? split / 2 : MR_MIN_SPLIT;
    }
    if (rc && reg->kind == KVB_MEM_CUDA) { /* FI_HMEM offered, this memory refused */
        KVB_WARN("fabric: cannot register %s memory (%llu bytes at 0x%llx) with %s: %s; it takes "
                 "the cuda or tcp path",
                 reg->location, (unsigned long long)reg->len, (unsigned long long)reg->addr,
                 fp->prov, fi_strerror(-rc));
        return KVB_ERR_UNSUPPORTED;
    }
    if (rc) {
        KVB_WARN("fabric: cannot register %llu bytes at 0x%llx with %s: %s",
                 (unsigned long long)reg->len, (unsigned long long)reg->addr, fp->prov,
                 fi_strerror(-rc));
        return status_of(rc) == KVB_ERR_NOMEM ? KVB_ERR_NOMEM : KVB_ERR_SYSTEM;
    }
    size_t need = KEY_HDR + 8 * r->n + fp->addr_len;
    if (r->n > UINT8_MAX || need > KVB_KEY_MAX) {
        KVB_WARN(
            "fabric: region at 0x%llx needs %zu registrations of %llu bytes: their keys do not "
            "fit a key blob (%d bytes), so the TCP lanes serve it; register smaller regions",
            (unsigned long long)reg->addr, r->n, (unsigned long long)r->split, KVB_KEY_MAX);
        reg_close(r);
        return KVB_ERR_UNSUPPORTED;
    }
    memset(key, 0, KEY_HDR);
    key[0] = KEY_MAGIC;
    key[1] = KEY_VERSION;
    key[2] = (fp->mr_mode & FI_MR_VIRT_ADDR) ? KEY_VIRT : 0;
    key[3] = (uint8_t)r->n;
    key[4] = (uint8_t)fp->addr_len;
    kvb__put_le32(key + 8, fp->prov_hash);
    kvb__put_le64(key + 12, r->split);
    for (size_t i = 0; i < r->n; i++)
        kvb__put_le64(key + KEY_HDR + 8 * i, r->mr[i].key);
    memcpy(key + KEY_HDR + 8 * r->n, fp->addr, fp->addr_len);
    *key_len = need;
    reg->path_state[KVB_PATH_FABRIC] = r;
    if (reg->kind == KVB_MEM_CUDA && reg->device >= 0 && reg->device < 32)
        atomic_fetch_or(&fp->hmem_devs, 1u << reg->device);
    return KVB_OK;
}

static void fab_dereg(kvb_provider_t *pv, kvb_region_t *reg)
{
    (void)pv;
    fab_reg_t *r = reg->path_state[KVB_PATH_FABRIC];
    if (!r)
        return;
    /* No op of ours holds the region: it goes only once its pins dropped, or at the engine's
     * destroy, after fab_stop ended every op. */
    reg_close(r);
    reg->path_state[KVB_PATH_FABRIC] = NULL;
}

/* ---- peers ----------------------------------------------------------------------------------- */

/* A peer's key blob for one region, decoded and checked against the region's length. */
typedef struct {
    bool virt;
    size_t nmr, addr_len;
    uint64_t split;
    const uint8_t *keys, *addr;
} blob_t;

static bool blob_of(const fab_path_t *fp, const kvb_region_desc_t *d, blob_t *b)
{
    size_t len = 0;
    const uint8_t *k = d ? kvb__region_key(d, KVB_PATH_FABRIC, &len) : NULL;
    if (!k || len < KEY_HDR || k[0] != KEY_MAGIC || k[1] != KEY_VERSION)
        return false;
    uint32_t hash = kvb__get_le32(k + 8);
    *b = (blob_t){.virt = k[2] & KEY_VIRT,
                  .nmr = k[3],
                  .addr_len = k[4],
                  .split = kvb__get_le64(k + 12),
                  .keys = k + KEY_HDR};
    b->addr = b->keys + 8 * b->nmr;
    return hash == fp->prov_hash && b->nmr > 0 && b->addr_len > 0 && b->addr_len <= ADDR_MAX &&
           len == KEY_HDR + 8 * b->nmr + b->addr_len && b->split > 0 &&
           (d->info.len + b->split - 1) / b->split == b->nmr;
}

static int fab_attach(kvb_provider_t *pv, kvb_peer_t *p, uint64_t deadline)
{
    (void)deadline;
    fab_path_t *fp = (fab_path_t *)pv;
    /* A peer whose host regions carry no key of our provider does not run this path (or runs
     * another provider): say so now rather than let each request fall back. */
    kvb_region_list_t *l = kvb__peer_regions(p);
    size_t host = 0, ours = 0;
    for (size_t i = 0; l && i < l->n; i++) {
        blob_t b;
        host += l->d[i].kind == KVB_MEM_CPU;
        ours += blob_of(fp, &l->d[i], &b);
    }
    kvb__region_list_put(l);
    if (host > 0 && ours == 0) {
        KVB_WARN("segment %s: it offers no fabric keys for provider %s (it runs without the "
                 "fabric path, or with another provider)",
                 p->name, fp->prov);
        return KVB_ERR_UNSUPPORTED;
    }
    fab_peer_t *fpp = calloc(1, sizeof *fpp);
    if (!fpp)
        return KVB_ERR_NOMEM;
    pthread_mutex_init(&fpp->mu, NULL);
    p->path_state[KVB_PATH_FABRIC] = fpp;
    return KVB_OK;
}

static void fab_detach(kvb_peer_t *p)
{
    fab_peer_t *fpp = p->path_state[KVB_PATH_FABRIC];
    if (!fpp)
        return;
    /* Its address-vector entry stays until the path goes: the provider may be gone already. */
    pthread_mutex_destroy(&fpp->mu);
    free(fpp);
    p->path_state[KVB_PATH_FABRIC] = NULL;
}

/* The peer's fi_addr for the endpoint address in `b`, inserting it on first use. */
static bool peer_addr(fab_path_t *fp, kvb_peer_t *p, const blob_t *b, fi_addr_t *out)
{
    fab_peer_t *fpp = p->path_state[KVB_PATH_FABRIC];
    if (!fpp)
        return false;
    pthread_mutex_lock(&fpp->mu);
    bool ok = fpp->have && fpp->addr_len == b->addr_len && !memcmp(fpp->addr, b->addr, b->addr_len);
    if (!ok) {
        fi_addr_t fa = FI_ADDR_NOTAVAIL;
        int n = fi_av_insert(fp->av, b->addr, 1, &fa, 0, NULL);
        if (n == 1 && fa != FI_ADDR_NOTAVAIL) {
            fpp->have = ok = true;
            fpp->fa = fa;
            fpp->addr_len = b->addr_len;
            memcpy(fpp->addr, b->addr, b->addr_len);
        } else {
            KVB_WARN("segment %s: fabric address not accepted by %s (%d)", p->name, fp->prov, n);
        }
    }
    if (ok)
        *out = fpp->fa;
    pthread_mutex_unlock(&fpp->mu);
    return ok;
}

static bool fab_reaches(kvb_provider_t *pv, kvb_peer_t *p, const kvb_op_t *op, kvb_span_t *span)
{
    fab_path_t *fp = (fab_path_t *)pv;
    blob_t b;
    fi_addr_t fa;
    *span = KVB_SPAN_ALL; /* the answer is the local and the remote region's */
    /* The peer's key says it registered that memory with its provider (device memory too,
     * where it offers FI_HMEM); ours, that our side of it is registered here. */
    return op->pin && op->pin->path_state[KVB_PATH_FABRIC] && op->rregion &&
           blob_of(fp, op->rregion, &b) && peer_addr(fp, p, &b, &fa);
}

/* ---- transfers ------------------------------------------------------------------------------- */

static void wake(fab_path_t *fp)
{
    uint64_t one = 1;
    if (write(fp->wake_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVB_DEBUG("fabric: wake: %s", strerror(errno));
}

/* Cuts op into segments at both sides' registration boundaries and the message size limit. */
static fab_op_t *op_segments(fab_path_t *fp, kvb_op_t *op, const blob_t *b)
{
    const fab_reg_t *lr = op->pin->path_state[KVB_PATH_FABRIC];
    const uint64_t rbase = op->rregion->info.addr, lbase = op->pin->addr;
    size_t n = 0;
    fab_op_t *fo = NULL;
    bool flush = fp->flush && op->kind == KVB_OPK_WRITE;
    for (int pass = 0; pass < 2; pass++) {
        size_t k = 0;
        for (uint64_t off = 0; off < op->len; k++) {
            uint64_t r = op->remote + off - rbase, l = (uintptr_t)op->local + off - lbase;
            uint64_t len = op->len - off;
            len = len < b->split - r % b->split ? len : b->split - r % b->split;
            len = len < lr->split - l % lr->split ? len : lr->split - l % lr->split;
            len = len < fp->seg_max ? len : fp->seg_max;
            if (pass == 1) {
                size_t ri = (size_t)(r / b->split), li = (size_t)(l / lr->split);
                fab_seg_t *s = &fo->seg[k];
                s->fo = fo;
                s->local = op->local + off;
                s->desc = lr->mr[li].desc;
                s->key = kvb__get_le64(b->keys + 8 * ri);
                s->raddr = b->virt ? op->remote + off : r - ri * b->split;
                s->len = len;
                s->read = op->kind == KVB_OPK_READ;
            }
            off += len;
        }
        if (pass == 1 && flush) { /* after the writes, in order: RAW makes it wait for them */
            fo->seg[k] = fo->seg[k - 1];
            fo->seg[k].local = fp->scratch;
            fo->seg[k].desc = fp->scratch_desc;
            fo->seg[k].len = 1;
            fo->seg[k].read = true;
        }
        if (pass == 0) {
            n = k + flush;
            fo = calloc(1, sizeof *fo + n * sizeof fo->seg[0]);
            if (!fo)
                return NULL;
            fo->nseg = n;
        }
    }
    return fo;
}

/* Ends the engine's op now (its segments may still be out). Caller holds fp->mu; the op is
 * returned for kvb__op_done outside the lock. */
static kvb_op_t *op_end(fab_op_t *fo, int status)
{
    kvb_op_t *op = fo->op;
    fo->op = NULL;
    if (op)
        op->next = NULL;
    fo->status = fo->status ? fo->status : status;
    return op;
}

typedef struct {
    kvb_op_t *head, **tail; /* ended ops, for kvb__op_done */
    fab_op_t *reaped;       /* finished fab ops, to unpin and free */
} done_list_t;

/* Unlinks fo once nothing of it is out any more and it will post nothing else; it is freed by
 * done_run, outside mu (the last unpin of an unregistered region calls fab_dereg, which locks). */
static void op_reap(fab_path_t *fp, fab_op_t *fo, done_list_t *done)
{
    if (fo->out > 0 || (fo->op && fo->posted < fo->nseg))
        return;
    if (fo->next_pending != NULL || fp->pending_tail == &fo->next_pending)
        return; /* still queued: post_some drops it */
    *fo->prev_active = fo->next_active;
    if (fo->next_active)
        fo->next_active->prev_active = fo->prev_active;
    fo->next_pending = done->reaped;
    done->reaped = fo;
}

static void done_add(done_list_t *d, kvb_op_t *op, fab_op_t *fo)
{
    if (!op)
        return;
    if (fo->out > 0) /* the NIC may still write the op's memory: kvb_batch_settle waits */
        fo->linger = kvb__op_linger(op);
    op->wire_id = (uint64_t)(int64_t)fo->status; /* carried to done_run */
    *d->tail = op;
    d->tail = &op->next;
}

/* Reports ended ops to the engine, then lets go of finished ones; outside fp->mu (the engine
 * may send a notification, an unpin may release a region). */
static void done_run(fab_path_t *fp, done_list_t *d)
{
    /* READs that the NIC wrote into our GPU memory: visible to its kernels before COMPLETED. */
    unsigned flushed = 0;
    for (kvb_op_t *op = d->head; op; op = op->next) {
        int dev = op->pin ? op->pin->device : -1;
        if (op->kind == KVB_OPK_READ && op->wire_id == 0 && op->pin &&
            op->pin->kind == KVB_MEM_CUDA && dev >= 0 && dev < 32 && !(flushed & (1u << dev))) {
            flushed |= 1u << dev;
            if (kvb__cuda_flush_rdma_writes(dev) != KVB_OK)
                for (kvb_op_t *o = op; o; o = o->next) /* the flush failed: so did its READs */
                    if (o->kind == KVB_OPK_READ && o->pin && o->pin->device == dev)
                        o->wire_id = (uint64_t)(int64_t)KVB_ERR_DEVICE;
        }
    }
    while (d->head) {
        kvb_op_t *op = d->head;
        d->head = op->next;
        int st = (int)(int64_t)op->wire_id;
        kvb__op_done(op, st, st ? 0 : op->len);
    }
    d->tail = &d->head;
    while (d->reaped) {
        fab_op_t *fo = d->reaped;
        d->reaped = fo->next_pending;
        if (fo->linger)
            kvb__batch_unlinger(fo->linger);
        if (fo->pin)
            kvb__region_unpin(&fp->engine->registry, fo->pin);
        kvb__peer_release(fo->peer);
        free(fo);
    }
}

static int post_one(fab_path_t *fp, fab_op_t *fo, fab_seg_t *s, fi_addr_t fa)
{
    struct iovec iov = {.iov_base = s->local, .iov_len = s->len};
    struct fi_rma_iov riov = {.addr = s->raddr, .len = s->len, .key = s->key};
    struct fi_msg_rma msg = {.msg_iov = &iov,
                             .desc = &s->desc,
                             .iov_count = 1,
                             .addr = fa,
                             .rma_iov = &riov,
                             .rma_iov_count = 1,
                             .context = &s->ctx};
    /* A WRITE completes only once its bytes are placed at the target (not merely sent): with
     * delivery-complete, or once the READ that follows it (fp->flush) came back. */
    (void)fo;
    if (s->read)
        return (int)fi_readmsg(fp->ep, &msg, FI_COMPLETION);
    return (int)fi_writemsg(fp->ep, &msg, FI_COMPLETION | (fp->flush ? 0 : FI_DELIVERY_COMPLETE));
}

/* Posts queued segments while the queue depth allows. Caller holds mu. */
static void post_some(fab_path_t *fp, done_list_t *done)
{
    fp->again = false;
    while (fp->pending && fp->inflight < fp->depth && !fp->stop) {
        fab_op_t *fo = fp->pending;
        int rc = 0;
        if (fo->op && fo->posted < fo->nseg) {
            rc = post_one(fp, fo, &fo->seg[fo->posted], fo->fa);
            if (rc == -FI_EAGAIN) {
                fp->again = true; /* the provider's queue is full: progress first */
                break;
            }
            if (rc == 0) {
                fo->posted++;
                fo->out++;
                fp->inflight++;
            } else {
                KVB_WARN("fabric: %s to %s failed: %s", fo->write ? "fi_write" : "fi_read",
                         fo->peer->name, fi_strerror(-rc));
                done_add(done, op_end(fo, status_of(rc)), fo);
            }
            if (fo->op && fo->posted < fo->nseg)
                continue;
        }
        fp->pending = fo->next_pending;
        fo->next_pending = NULL;
        if (!fp->pending)
            fp->pending_tail = &fp->pending;
        op_reap(fp, fo, done);
    }
}

static void fab_submit(kvb_provider_t *pv, kvb_peer_t *p, kvb_op_t *ops)
{
    fab_path_t *fp = (fab_path_t *)pv;
    done_list_t done = {.tail = &done.head};
    pthread_mutex_lock(&fp->mu);
    while (ops) {
        kvb_op_t *op = ops;
        ops = ops->next;
        op->next = NULL;
        unsigned need = op->kind == KVB_OPK_READ ? KVB_ACCESS_READ : KVB_ACCESS_WRITE;
        blob_t b;
        fi_addr_t fa;
        int st = atomic_load(&p->lost);
        if (!st && fp->stop)
            st = KVB_ERR_SHUTDOWN;
        if (!st && (!blob_of(fp, op->rregion, &b) || !peer_addr(fp, p, &b, &fa)))
            st = KVB_ERR_PROTOCOL; /* cannot happen: reaches() said yes for this very region */
        if (!st && (op->rregion->info.access & need) != need)
            st = KVB_ERR_ACCESS_DENIED; /* the peer's key would refuse it too; say so here */
        fab_op_t *fo = st ? NULL : op_segments(fp, op, &b);
        if (!fo) {
            fab_op_t tmp = {.status = st ? st : KVB_ERR_NOMEM};
            done_add(&done, op, &tmp);
            continue;
        }
        fo->op = op;
        fo->batch = op->batch;
        fo->write = op->kind == KVB_OPK_WRITE;
        fo->deadline = op->batch->deadline;
        fo->pin = op->pin; /* ours now: released when the provider returned every segment */
        op->pin = NULL;
        atomic_fetch_add(&p->refs, 1);
        fo->peer = p;
        fo->fa = fa;
        fo->next_active = fp->active;
        if (fp->active)
            fp->active->prev_active = &fo->next_active;
        fo->prev_active = &fp->active;
        fp->active = fo;
        *fp->pending_tail = fo;
        fp->pending_tail = &fo->next_pending;
    }
    post_some(fp, &done);
    bool again = fp->again || fp->pending;
    pthread_mutex_unlock(&fp->mu);
    if (again)
        wake(fp);
    done_run(fp, &done);
}

/* One CQ entry came back. Caller holds mu. */
static void seg_back(fab_path_t *fp, fab_seg_t *s, int status, done_list_t *done)
{
    fab_op_t *fo = s->fo;
    fp->inflight--;
    fo->out--;
    if (status && fo->op)
        done_add(done, op_end(fo, status), fo);
    if (fo->op && fo->out == 0 && fo->posted == fo->nseg)
        done_add(done, op_end(fo, KVB_OK), fo);
    op_reap(fp, fo, done);
}

/* Reads what the CQ has; returns how many entries it handled. */
static int cq_drain(fab_path_t *fp, done_list_t *done)
{
    struct fi_cq_entry ent[CQ_BATCH];
    ssize_t n = fi_cq_read(fp->cq, ent, CQ_BATCH);
    if (n > 0) {
        pthread_mutex_lock(&fp->mu);
        for (ssize_t i = 0; i < n; i++)
            seg_back(fp, ent[i].op_context, KVB_OK, done);
        post_some(fp, done);
        pthread_mutex_unlock(&fp->mu);
        return (int)n;
    }
    if (n != -FI_EAVAIL) {
        if (n != -FI_EAGAIN)
            KVB_WARN("fabric: fi_cq_read: %s", fi_strerror((int)-n));
        return 0;
    }
    struct fi_cq_err_entry err;
    memset(&err, 0, sizeof err);
    if (fi_cq_readerr(fp->cq, &err, 0) != 1)
        return 0;
    fab_seg_t *s = err.op_context;
    char buf[256];
    const char *why = fi_cq_strerror(fp->cq, err.prov_errno, err.err_data, buf, sizeof buf);
    int st = status_of(err.err ? err.err : FI_EOTHER);
    pthread_mutex_lock(&fp->mu);
    if (s) {
        int lost = atomic_load(&s->fo->peer->lost);
        /* Once per second at most: a peer that dies fails every request in flight at once. */
        uint64_t now = kvb__now_ns();
        if (!lost && now >= fp->next_log) {
            KVB_WARN("fabric: %s of %llu bytes to %s failed: %s (%s: %s)%s",
                     s->fo->write ? "WRITE" : "READ", (unsigned long long)s->len, s->fo->peer->name,
                     kvb_strerror(st), fi_strerror(err.err), why ? why : "",
                     fp->unlogged ? " (and earlier errors not logged)" : "");
            fp->next_log = now + 1000000000ull;
            fp->unlogged = 0;
        } else {
            fp->unlogged++;
        }
        seg_back(fp, s, lost ? lost : st, done);
    }
    post_some(fp, done);
    pthread_mutex_unlock(&fp->mu);
    return 1;
}

/* Ends ops past their deadline or to a lost peer; their segments come back later. */
static void scan(fab_path_t *fp, done_list_t *done)
{
    uint64_t now = kvb__now_ns();
    pthread_mutex_lock(&fp->mu);
    for (fab_op_t *fo = fp->active; fo; fo = fo->next_active) {
        int lost = atomic_load(&fo->peer->lost);
        if (fo->op && (lost || now >= fo->deadline))
            done_add(done, op_end(fo, lost ? lost : KVB_ERR_TIMEOUT), fo);
    }
    for (fab_op_t *fo = fp->active, *next; fo; fo = next) {
        next = fo->next_active;
        op_reap(fp, fo, done);
    }
    post_some(fp, done);
    pthread_mutex_unlock(&fp->mu);
}

/* Sleeps until the CQ or a wake-up has something, or `ns`. */
static void idle(fab_path_t *fp, uint64_t ns)
{
    struct pollfd pfd[2] = {{.fd = fp->wake_fd, .events = POLLIN},
                            {.fd = fp->cq_fd, .events = POLLIN}};
    int ms = (int)((ns + 999999) / 1000000);
    if (fp->cq_fd >= 0) {
        struct fid *f = &fp->cq->fid;
        if (fi_trywait(fp->fabric, &f, 1) != FI_SUCCESS)
            return; /* the CQ needs reading first */
        if (poll(pfd, 2, ms) < 0 && errno != EINTR)
            KVB_DEBUG("fabric: poll: %s", strerror(errno));
    } else {
        /* No wait object (shm): poll the CQ, sleeping between empty reads - 50 us while our
         * requests are out, then twice as long after each empty read up to 1 ms (an idle target
         * then takes up to 1 ms to notice a peer's first request; about 1000 wake-ups a second
         * cost under 2% of a core). */
        pthread_mutex_lock(&fp->mu);
        bool busy = fp->inflight > 0 || fp->pending;
        pthread_mutex_unlock(&fp->mu);
        fp->poll_ns = busy || !fp->poll_ns        ? POLL_MIN_NS
                      : fp->poll_ns < POLL_MAX_NS ? fp->poll_ns * 2
                                                  : POLL_MAX_NS;
        if (poll(pfd, 1, 0) == 0) {
            uint64_t t = fp->poll_ns < ns ? fp->poll_ns : ns;
            struct timespec ts = {0, (long)t};
            nanosleep(&ts, NULL);
        }
    }
    uint64_t v;
    if (read(fp->wake_fd, &v, sizeof v) < 0 && errno != EAGAIN)
        KVB_DEBUG("fabric: wake read: %s", strerror(errno));
}

static void *progress_main(void *arg)
{
    fab_path_t *fp = arg;
    done_list_t done = {.tail = &done.head};
    uint64_t next_scan = kvb__now_ns() + SCAN_NS;
    for (;;) {
        pthread_mutex_lock(&fp->mu);
        bool stop = fp->stop, again = fp->again || fp->pending, out = fp->inflight > 0;
        uint64_t stop_by = fp->stop_by;
        pthread_mutex_unlock(&fp->mu);
        if (stop && (!out || kvb__now_ns() >= stop_by))
            break;
        int got = cq_drain(fp, &done);
        if (again && !got && !stop) { /* -FI_EAGAIN: the read progressed the provider; retry */
            pthread_mutex_lock(&fp->mu);
            post_some(fp, &done);
            pthread_mutex_unlock(&fp->mu);
        }
        uint64_t now = kvb__now_ns();
        if (now >= next_scan) {
            scan(fp, &done);
            next_scan = now + SCAN_NS;
        }
        done_run(fp, &done);
        uint64_t until = stop && stop_by < next_scan ? stop_by : next_scan;
        if (got)
            fp->poll_ns = 0;
        else /* after -FI_EAGAIN too: completions (the fd) say when to post again */
            idle(fp, until > now ? until - now : 0);
    }
    return NULL;
}

/* Ops of a cancelled or freed batch end now; segments already posted come back later. */
static void fab_cancel(kvb_provider_t *pv, kvb_batch_t *b)
{
    fab_path_t *fp = (fab_path_t *)pv;
    done_list_t done = {.tail = &done.head};
    pthread_mutex_lock(&fp->mu);
    for (fab_op_t *fo = fp->active; fo; fo = fo->next_active)
        if (fo->op && fo->batch == b)
            done_add(&done, op_end(fo, KVB_ERR_CANCELED), fo);
    pthread_mutex_unlock(&fp->mu);
    wake(fp); /* the thread drops their queued segments */
    done_run(fp, &done);
}

/* Runs after the control plane is gone and before the registry: nothing more is posted, the
 * progress thread takes the completions of segments still out (up to STOP_DRAIN_MS) and ends,
 * the endpoint closes (no completion comes after it), and ops still open end with
 * KVB_ERR_SHUTDOWN, their regions unpinned while they still exist. (Run after the registry, a
 * completion reaped meanwhile by the thread unpinned a freed region; an endpoint closed with RMA
 * still out crashed inside libfabric 1.17's tcp provider, in about 1 run in 6 of
 * fabric_tcp::destroyed_with_segments_out.) */
static void fab_stop(kvb_provider_t *pv)
{
    fab_path_t *fp = (fab_path_t *)pv;
    pthread_mutex_lock(&fp->mu);
    fp->stop = true;
    fp->stop_by = kvb__now_ns() + STOP_DRAIN_MS * 1000000ull;
    pthread_mutex_unlock(&fp->mu);
    wake(fp);
    pthread_join(fp->thread, NULL);
    if (fp->inflight > 0)
        KVB_WARN("fabric: closing the endpoint with %zu segments still out after %u ms",
                 fp->inflight, STOP_DRAIN_MS);
    fi_close(&fp->ep->fid);
    fp->ep = NULL;
    done_list_t done = {.tail = &done.head, .reaped = NULL};
    pthread_mutex_lock(&fp->mu);
    while (fp->active) {
        fab_op_t *fo = fp->active;
        fp->active = fo->next_active;
        done_add(&done, op_end(fo, KVB_ERR_SHUTDOWN), fo);
        fo->next_pending = done.reaped; /* the pending queue is dropped with the endpoint */
        done.reaped = fo;
    }
    fp->pending = NULL;
    fp->pending_tail = &fp->pending;
    pthread_mutex_unlock(&fp->mu);
    done_run(fp, &done);
}

static void fab_destroy(kvb_provider_t *pv)
{
    path_free((fab_path_t *)pv); /* after fab_stop: no thread, no endpoint, no op */
}

/* Before a notification reaches the application: what peers' NICs wrote into our GPU memory is
 * visible to its kernels (the peer's WRITEs had completed before it notified). */
static void fab_settle(kvb_provider_t *pv)
{
    fab_path_t *fp = (fab_path_t *)pv;
    unsigned devs = atomic_load(&fp->hmem_devs);
    for (int d = 0; devs; d++, devs >>= 1)
        if (devs & 1u)
            kvb__cuda_flush_rdma_writes(d); /* a failure is logged; nothing more to do here */
}

const kvb_provider_ops_t kvb__fabric_provider = {
    .name = "fabric",
    .id = KVB_PATH_FABRIC,
    .remote_region = true,
    .create = fab_create,
    .stop = fab_stop,
    .destroy = fab_destroy,
    .reg = fab_reg,
    .dereg = fab_dereg,
    .attach = fab_attach,
    .detach = fab_detach,
    .reaches = fab_reaches,
    .submit = fab_submit,
    .cancel = fab_cancel,
    .settle = fab_settle,
};

#endif
