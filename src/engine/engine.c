/* SPDX-License-Identifier: Apache-2.0 */
/* Engine lifecycle, memory registration, the segment table (open/close/query of peers) and the
 * queue of received notifications. Data movement lives in batch.c and the transports. */
#include "engine/internal.h"

#include "engine/export.h"

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/log.h"

#define NOTIFY_QUEUE_CAP 1024

/* The environment variable `name` if set and not empty, else `dflt`. */
static const char *env_or(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

/* KVB_BUSY_POLL_US, KVB_LINGER_US: a decimal number of microseconds, `dflt` where unset.
 * Anything else (or too large) becomes a value kvb_engine_create refuses, so a typo is an error
 * rather than a silent default. */
static uint32_t env_us(const char *name, uint32_t dflt)
{
    const char *v = env_or(name, NULL);
    if (!v)
        return dflt;
    char *end;
    errno = 0;
    unsigned long long us = strtoull(v, &end, 10);
    if (errno || end == v || *end || *v == '-' || us > KVB_BUSY_POLL_MAX_US)
        return UINT32_MAX;
    return (uint32_t)us;
}

void kvb_config_init_v(kvb_config_t *cfg, size_t size)
{
    if (!cfg || size < sizeof cfg->size)
        return;
    kvb_config_t d;
    memset(&d, 0, sizeof d);
    d.bind_addr = "127.0.0.1";
    d.metadata = "p2p";
    d.lanes = 2;
    d.progress_threads = kvb__threads_per_side(d.lanes); /* 1 on two CPUs, else one per lane */
    d.timeout_ms = 30000;
    d.connect_timeout_ms = 5000;
    /* Environment defaults for programs that cannot pass a config (a framework's connector);
     * what the caller sets afterwards wins. */
    d.protocol = env_or("KVB_PROTOCOL", "auto");
    d.fabric_provider = env_or("KVB_FABRIC_PROVIDER", NULL);
    d.tcp_congestion = env_or("KVB_TCP_CONGESTION", NULL);
    d.busy_poll_us = env_us("KVB_BUSY_POLL_US", 0);
    d.cpus = env_or("KVB_CPUS", NULL);
    d.linger_us = env_us("KVB_LINGER_US", KVB_LINGER_DEFAULT_US);
    d.copy_threads = 1;
    d.cluster = "default";
    d.metadata_ttl_ms = 10000;
    d.peer_timeout_ms = 5000;
    d.max_connections = 4096;
    d.shm_map_max = 64ull << 30;
    /* The caller's struct may be older (smaller) or newer (larger) than ours. */
    size_t n = size < sizeof d ? size : sizeof d;
    memset(cfg, 0, size);
    memcpy(cfg, &d, n);
    cfg->size = size;
}

void kvb__host_id(uint8_t out[KVB_HOST_ID_LEN])
{
    memset(out, 0, KVB_HOST_ID_LEN);
    char buf[64] = {0};
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0)
        close(fd);
    if (n <= 0 && gethostname(buf, sizeof buf - 1) != 0)
        return;
    /* Fold the text (a UUID, or the host name) into 16 bytes with FNV-1a. */
    uint64_t h1 = 1469598103934665603ull, h2 = 1099511628211ull * 7;
    for (const char *p = buf; *p && *p != '\n'; p++) {
        h1 = (h1 ^ (uint8_t)*p) * 1099511628211ull;
        h2 = (h2 ^ (uint8_t)*p) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
    }
    memcpy(out, &h1, 8);
    memcpy(out + 8, &h2, 8);
}

static int copy_str(char *dst, size_t cap, const char *src)
{
    if (!src || strlen(src) >= cap)
        return KVB_ERR_INVALID_ARG;
    strcpy(dst, src);
    return KVB_OK;
}

/* Parses `protocol` into the engine's path order: "auto" (or NULL) is every path that runs here
 * in the built-in order; otherwise a comma-separated list of path names, tried in that order, each
 * required to reach every peer. The TCP lanes are the last resort either way: they carry the
 * control plane, so a request no listed path reaches goes there. */
static int parse_paths(kvb_engine_t *e, const char *protocol)
{
    static const uint8_t builtin[] = {KVB_PATH_CUDA, KVB_PATH_SHM, KVB_PATH_FABRIC, KVB_PATH_TCP};
    _Static_assert(sizeof builtin == KVB_PATHS, "every path has a place in the default order");
    e->norder = 0;
    e->required = 0;
    unsigned seen = 0;
    if (!protocol || !strcmp(protocol, "auto")) {
        for (size_t i = 0; i < sizeof builtin; i++)
            e->order[e->norder++] = builtin[i];
        return KVB_OK;
    }
    for (const char *p = protocol;;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char name[16];
        int id = -1;
        if (n > 0 && n < sizeof name) {
            memcpy(name, p, n);
            name[n] = '\0';
            id = kvb__provider_id(name);
        }
        if (id < 0 || (seen & (1u << id))) {
            KVB_ERROR(
                "protocol '%s': '%.*s' is %s (paths: auto, or a list of tcp, shm, cuda, fabric)",
                protocol, (int)n, p, id < 0 ? "not a data path" : "named twice");
            return KVB_ERR_INVALID_ARG;
        }
        seen |= 1u << id;
        e->order[e->norder++] = (uint8_t)id;
        e->required |= 1u << id;
        if (!end)
            break;
        p = end + 1;
    }
    if (!(seen & (1u << KVB_PATH_TCP)))
        e->order[e->norder++] = KVB_PATH_TCP;
    return KVB_OK;
}

/* Creates the providers of the paths in the order; one that cannot run here is left out, unless
 * the order names it. */
static int paths_create(kvb_engine_t *e)
{
    for (size_t i = 0; i < e->norder; i++) {
        unsigned id = e->order[i];
        const kvb_provider_ops_t *ops = kvb__provider(id);
        int rc = ops->create ? ops->create(e, &e->path_state[id]) : KVB_OK;
        if (rc == KVB_OK) {
            e->paths |= 1u << id;
        } else if (rc != KVB_ERR_UNSUPPORTED || (e->required & (1u << id))) {
            KVB_ERROR("data path %s: %s", ops->name, kvb_strerror(rc));
            return rc;
        } else {
            KVB_DEBUG("data path %s does not run here", ops->name);
        }
    }
    return KVB_OK;
}

/* Before the registry goes: no path's thread may end an op (and unpin its region) after it. A
 * batch freed meanwhile on another thread has its cancel finish in the path first, or come after
 * (and find nothing open). */
static void paths_stop(kvb_engine_t *e)
{
    pthread_rwlock_wrlock(&e->paths_lock);
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if ((e->paths & (1u << id)) && kvb__provider(id)->stop)
            kvb__provider(id)->stop(e->path_state[id]);
    pthread_rwlock_unlock(&e->paths_lock);
}

static void paths_destroy(kvb_engine_t *e)
{
    pthread_rwlock_wrlock(&e->paths_lock); /* no batch's cancel is in a path now, or comes */
    unsigned paths = e->paths;
    e->paths = 0;
    pthread_rwlock_unlock(&e->paths_lock);
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if ((paths & (1u << id)) && kvb__provider(id)->destroy)
            kvb__provider(id)->destroy(e->path_state[id]);
}

/* The registry's release hook: each path that served the region lets go of it. */
static void region_release(void *ctx, kvb_region_t *reg)
{
    kvb_engine_t *e = ctx;
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if ((e->paths & (1u << id)) && kvb__provider(id)->dereg)
            kvb__provider(id)->dereg(e->path_state[id], reg);
}

/* A time in microseconds from the config (`field`) or the environment (`env`), up to
 * KVB_BUSY_POLL_MAX_US; says which was wrong. */
static bool check_us(const char *field, const char *env, uint32_t us, uint32_t dflt)
{
    if (us <= KVB_BUSY_POLL_MAX_US)
        return true;
    if (us == UINT32_MAX && env_us(env, dflt) == UINT32_MAX) /* a bad value */
        KVB_ERROR("%s=\"%.32s\" is not a number of microseconds up to %u", env, getenv(env),
                  KVB_BUSY_POLL_MAX_US);
    else
        KVB_ERROR("%s %u is over the maximum of %u", field, us, KVB_BUSY_POLL_MAX_US);
    return false;
}

static int check_config(const kvb_config_t *c)
{
    if (c->metadata_ttl_ms && c->metadata_ttl_ms < 1000) {
        KVB_ERROR("metadata TTL %u ms is under the minimum of 1000 ms", c->metadata_ttl_ms);
        return KVB_ERR_INVALID_ARG;
    }
    if (c->copy_threads < 0 || c->copy_threads > 16 || c->progress_threads < 1 ||
        c->progress_threads > 64 || c->lanes < 1 || c->lanes > 16 ||
        (c->port_max && c->port_max < c->port) || c->timeout_ms == 0 ||
        c->connect_timeout_ms == 0 || c->peer_timeout_ms < 100 || c->max_connections == 0) {
        KVB_ERROR("invalid engine configuration (threads %d, lanes %d, ports %u..%u)",
                  c->progress_threads, c->lanes, c->port, c->port_max);
        return KVB_ERR_INVALID_ARG;
    }
    if (!check_us("busy_poll_us", "KVB_BUSY_POLL_US", c->busy_poll_us, 0) ||
        !check_us("linger_us", "KVB_LINGER_US", c->linger_us, KVB_LINGER_DEFAULT_US))
        return KVB_ERR_INVALID_ARG;
    return KVB_OK;
}

static int init_locks(kvb_engine_t *e)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_mutex_init(&e->seg_mu, NULL) || pthread_cond_init(&e->seg_cv, NULL) ||
             pthread_mutex_init(&e->attr_mu, NULL) || pthread_mutex_init(&e->notify_mu, NULL) ||
             pthread_cond_init(&e->notify_cv, &ca) || pthread_rwlock_init(&e->paths_lock, NULL) ||
             pthread_mutex_init(&e->batch_mu, NULL);
    pthread_condattr_destroy(&ca);
    return rc ? KVB_ERR_SYSTEM : KVB_OK;
}

/* Copies what the caller's (possibly older or newer) config holds over our defaults. */
static int take_config(const kvb_config_t *in, kvb_config_t *cfg)
{
    kvb_config_init(cfg);
    if (!in)
        return KVB_OK;
    if (in->size < offsetof(kvb_config_t, metadata_ttl_ms) + sizeof in->metadata_ttl_ms) {
        KVB_ERROR("kvb_config_t not initialised with kvb_config_init() (size %zu)", in->size);
        return KVB_ERR_INVALID_ARG;
    }
    memcpy(cfg, in, in->size < sizeof *cfg ? in->size : sizeof *cfg);
    cfg->size = sizeof *cfg;
    return KVB_OK;
}

static bool is_loopback(const char *addr)
{
    return !strncmp(addr, "127.", 4) || !strcmp(addr, "::1") || !strcmp(addr, "localhost") ||
           !strcmp(addr, "[::1]");
}

/* The CPUs of the data threads (cfg.cpus), checked against those this process may run on now. */
static int take_cpus(kvb_engine_t *e, const char *list)
{
    e->cfg.cpus = NULL; /* the caller's string; cpus_text is ours */
    if (!list || !*list)
        return KVB_OK;
    char err[160];
    if (kvb__cpus_parse(list, &e->cpus, err, sizeof err)) {
        const char *env = getenv("KVB_CPUS");
        KVB_ERROR("cpus %s%s", err, env && !strcmp(env, list) ? " (from KVB_CPUS)" : "");
        return KVB_ERR_INVALID_ARG;
    }
    size_t len = kvb__cpus_format(&e->cpus, NULL, 0);
    if (!(e->cpus_text = malloc(len + 1)))
        return KVB_ERR_NOMEM;
    kvb__cpus_format(&e->cpus, e->cpus_text, len + 1);
    e->cfg.cpus = e->cpus_text;
    return KVB_OK;
}

/* The cluster secret from the config or KVB_SECRET_FILE, and the rule that a non-loopback bind
 * needs one unless the caller said `insecure`. */
static int take_secret(kvb_engine_t *e, const kvb_config_t *cfg)
{
    const char *file = getenv("KVB_SECRET_FILE");
    int rc = KVB_OK;
    if (cfg->secret) {
        if (cfg->secret_len < KVB_SECRET_MIN || cfg->secret_len > KVB_SECRET_MAX) {
            KVB_ERROR("the cluster secret must be %d to %d bytes", KVB_SECRET_MIN, KVB_SECRET_MAX);
            return KVB_ERR_INVALID_ARG;
        }
        if (!(e->secret = malloc(cfg->secret_len)))
            return KVB_ERR_NOMEM;
        memcpy(e->secret, cfg->secret, cfg->secret_len);
        e->secret_len = cfg->secret_len;
    } else if (file && *file) {
        rc = kvb__secret_load(file, &e->secret, &e->secret_len);
        if (rc)
            return rc == KVB_ERR_NOT_FOUND ? KVB_ERR_INVALID_ARG : rc;
    }
    e->cfg.secret = NULL; /* the caller's memory */
    e->cfg.secret_len = 0;
    if (e->secret || is_loopback(e->bind_addr))
        return KVB_OK;
    if (!cfg->insecure) {
        KVB_ERROR("bind address %s is not loopback and no cluster secret is set (secret, "
                  "KVB_SECRET_FILE or --secret-file); set insecure to run without one",
                  e->bind_addr);
        return KVB_ERR_INVALID_ARG;
    }
    static atomic_bool warned;
    if (!atomic_exchange(&warned, true))
        KVB_WARN("INSECURE: engine on %s without a cluster secret: anyone who reaches its port "
                 "may read and write its registered memory",
                 e->bind_addr);
    return KVB_OK;
}

int kvb_engine_create(const kvb_config_t *cfg_in, kvb_engine_t **out)
{
    kvb_config_t cfg;
    if (!out)
        return KVB_ERR_INVALID_ARG;
    int rc = take_config(cfg_in, &cfg);
    if (rc)
        return rc;
    rc = check_config(&cfg);
    if (rc)
        return rc;
    kvb_engine_t *e = calloc(1, sizeof *e);
    if (!e)
        return KVB_ERR_NOMEM;
    e->notify_ring = calloc(NOTIFY_QUEUE_CAP, sizeof *e->notify_ring);
    if (!e->notify_ring) {
        free(e);
        return KVB_ERR_NOMEM;
    }
    e->notify_cap = NOTIFY_QUEUE_CAP;
    atomic_init(&e->refs, 1);
    e->cfg = cfg;
    if ((rc = copy_str(e->bind_addr, sizeof e->bind_addr,
                       cfg.bind_addr ? cfg.bind_addr : "127.0.0.1")))
        goto fail_free;
    const char *adv = cfg.advertise_addr ? cfg.advertise_addr : e->bind_addr;
    char hostname[KVB_NAME_MAX + 1] = "localhost";
    if (!cfg.advertise_addr && (!strcmp(adv, "0.0.0.0") || !strcmp(adv, "::"))) {
        if (gethostname(hostname, sizeof hostname - 1) != 0)
            strcpy(hostname, "localhost");
        adv = hostname;
    }
    if ((rc = copy_str(e->advertise_addr, sizeof e->advertise_addr, adv)))
        goto fail_free;
    e->cfg.bind_addr = e->bind_addr;
    e->cfg.advertise_addr = e->advertise_addr;
    e->cfg.segment_name = NULL;
    if ((rc = copy_str(e->cluster, sizeof e->cluster, cfg.cluster ? cfg.cluster : "default"))) {
        KVB_ERROR("cluster name longer than %d characters", KVB_CLUSTER_MAX);
        goto fail_free;
    }
    e->cfg.cluster = e->cluster;
    if (cfg.tcp_congestion && *cfg.tcp_congestion &&
        (rc = copy_str(e->tcp_congestion, sizeof e->tcp_congestion, cfg.tcp_congestion))) {
        KVB_ERROR("TCP congestion control name longer than %zu characters",
                  sizeof e->tcp_congestion - 1);
        goto fail_free;
    }
    /* The caller's string; the transport puts the system's default in tcp_congestion if empty. */
    e->cfg.tcp_congestion = e->tcp_congestion[0] ? e->tcp_congestion : NULL;
    if ((rc = take_cpus(e, cfg.cpus)))
        goto fail_free;
    if ((rc = take_secret(e, &cfg)))
        goto fail_free;
    if ((rc = init_locks(e)) || (rc = kvb__registry_init(&e->registry)))
        goto fail_free;
    /* A malformed URI fails before anything listens. */
    if ((rc = kvb__segdesc_open(e, cfg.metadata, e->cluster, cfg.connect_timeout_ms,
                                cfg.metadata_ttl_ms, &e->segbind)))
        goto fail_registry;
    e->cfg.metadata = NULL; /* the caller's string; the binding holds what it said */
    if (getrandom(&e->hello.incarnation, sizeof e->hello.incarnation, 0) !=
        sizeof e->hello.incarnation)
        e->hello.incarnation = kvb__now_ns() ^ ((uint64_t)getpid() << 32);
    e->hello.pid = (uint32_t)getpid();
    kvb__host_id(e->hello.host_id);

    if ((rc = parse_paths(e, cfg.protocol)))
        goto fail_registry;
    e->cfg.protocol = NULL;
    /* kvb_alloc memory is the engine's, whichever paths run; its Unix listener (the target side
     * of same-host links) only where the shm path may be used. */
    bool shm_path = false;
    for (size_t i = 0; i < e->norder; i++)
        shm_path = shm_path || e->order[i] == KVB_PATH_SHM;
    if ((rc = kvb__shm_create(e, shm_path, cfg.copy_threads, &e->shm)))
        goto fail_registry;
    rc = paths_create(e);
    e->cfg.fabric_provider = NULL; /* the caller's string; the fabric path keeps what it uses */
    if (rc)
        goto fail_paths;
    e->registry.release = region_release;
    e->registry.release_ctx = e;
    e->tp_ops = kvb__transport_find("tcp");
    if ((rc = e->tp_ops->create(e, &e->tp)))
        goto fail_paths;
    if (cfg.segment_name) {
        rc = copy_str(e->segment_name, sizeof e->segment_name, cfg.segment_name);
    } else {
        int n = snprintf(e->segment_name, sizeof e->segment_name, "%s:%u", e->advertise_addr,
                         e->tp_ops->port(e->tp));
        rc = n > 0 && (size_t)n < sizeof e->segment_name ? KVB_OK : KVB_ERR_INVALID_ARG;
    }
    if (rc == KVB_OK && e->segbind)
        for (const char *c = e->segment_name; *c; c++)
            if (*c <= 0x20 || *c == '/' || *c == 0x7f) {
                KVB_ERROR("segment name '%s': with a metadata store, names may not hold spaces, "
                          "control characters or '/'",
                          e->segment_name);
                rc = KVB_ERR_INVALID_ARG;
                break;
            }
    if (rc)
        goto fail_tp;
    strcpy(e->hello.name, e->segment_name);
    if ((rc = e->tp_ops->start(e->tp)) || (rc = kvb__segdesc_start(e->segbind)))
        goto fail_tp;
    KVB_INFO("engine %s up (incarnation %016llx, TCP congestion control %s%s, data threads on "
             "CPUs %s)",
             e->segment_name, (unsigned long long)e->hello.incarnation, e->tcp_congestion,
             e->cfg.tcp_congestion ? "" : ", the system's", e->cpus_text ? e->cpus_text : "any");
    *out = e;
    return KVB_OK;
fail_tp:
    e->tp_ops->destroy(e->tp);
fail_paths:
    paths_stop(e);
    kvb__registry_fini(&e->registry); /* nothing registered yet, but releases go to the paths */
    paths_destroy(e);
    kvb__shm_destroy(e->shm);
    kvb__segdesc_stop(e->segbind);
    goto fail_free;
fail_registry:
    kvb__segdesc_stop(e->segbind);
    kvb__registry_fini(&e->registry);
fail_free:
    kvb__secret_free(e->secret, e->secret_len);
    free(e->cpus_text);
    free(e->notify_ring);
    free(e);
    return rc;
}

void kvb_engine_destroy(kvb_engine_t *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->notify_mu);
    e->stopping = true;
    pthread_cond_broadcast(&e->notify_cv);
    /* Threads woken in kvb_notify_recv still need notify_mu: wait until they have left. */
    while (e->notify_waiters > 0)
        pthread_cond_wait(&e->notify_cv, &e->notify_mu);
    pthread_mutex_unlock(&e->notify_mu);
    if (atomic_load(&e->live_batches) > 0)
        KVB_WARN("engine destroyed with %ld batches not freed; free them before destroying",
                 atomic_load(&e->live_batches));
    kvb__segdesc_stop(e->segbind); /* first: withdraws our descriptor, stops revalidating */
    e->segbind = NULL;

    pthread_mutex_lock(&e->seg_mu);
    for (size_t i = 0; i < e->nsegs; i++) {
        kvb_peer_t *p = e->segs[i].peer;
        if (!p)
            continue;
        e->segs[i].peer = NULL;
        e->tp_ops->disconnect(e->tp, p, KVB_ERR_SHUTDOWN);
        kvb__peer_release(p);
    }
    pthread_mutex_unlock(&e->seg_mu);
    e->tp_ops->destroy(e->tp);
    free(e->segs);
    paths_stop(e); /* their threads end their last ops while the regions those pin still exist */
    kvb__registry_fini(&e->registry); /* before the paths: regions release their state there */
    paths_destroy(e);
    kvb__shm_destroy(e->shm); /* after the transport: its connections hold same-host peers */
    pthread_mutex_destroy(&e->seg_mu);
    pthread_cond_destroy(&e->seg_cv);
    pthread_mutex_destroy(&e->notify_mu);
    pthread_cond_destroy(&e->notify_cv);
    pthread_mutex_destroy(&e->attr_mu);
    kvb__attrs_free(e->attrs, e->nattrs);
    kvb__secret_free(e->secret, e->secret_len);
    e->secret = NULL;
    free(e->notify_ring);
    e->notify_ring = NULL;
    kvb__engine_put(e); /* batches not yet freed keep the struct itself */
}

void kvb__engine_put(kvb_engine_t *e)
{
    if (e && atomic_fetch_sub(&e->refs, 1) == 1) {
        pthread_rwlock_destroy(&e->paths_lock); /* the last batch's cancel may have used it */
        kvb__batch_cache_drain(e);
        pthread_mutex_destroy(&e->batch_mu);
        free(e->cpus_text);
        free(e);
    }
}

int kvb_engine_stats(kvb_engine_t *e, kvb_stats_t *out)
{
    _Static_assert(KVB_PATHS <= KVB_STATS_PATHS_MAX, "kvb_stats_t has room for every path");
    if (!e || !out)
        return KVB_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    out->requests_completed = atomic_load(&e->st_completed);
    out->requests_failed = atomic_load(&e->st_failed);
    for (unsigned id = 0; id < KVB_PATHS; id++) { /* every built-in path, running here or not */
        __typeof__(out->paths[0]) *ps = &out->paths[out->npaths++];
        snprintf(ps->name, sizeof ps->name, "%s", kvb__provider(id)->name);
        ps->ops = atomic_load(&e->st_path_ops[id]);
        ps->bytes = atomic_load(&e->st_path_bytes[id]);
    }
    return KVB_OK;
}

uint64_t kvb_stats_bytes(const kvb_stats_t *st, const char *path)
{
    for (size_t i = 0; st && path && i < st->npaths && i < KVB_STATS_PATHS_MAX; i++)
        if (!strcmp(st->paths[i].name, path))
            return st->paths[i].bytes;
    return 0;
}

const char *kvb_engine_segment_name(const kvb_engine_t *e)
{
    return e ? e->segment_name : "";
}

uint16_t kvb_engine_port(const kvb_engine_t *e)
{
    return e ? e->tp_ops->port(e->tp) : 0;
}

const char *kvb_engine_tcp_congestion(const kvb_engine_t *e)
{
    return e ? e->tcp_congestion : "";
}

uint32_t kvb_engine_busy_poll_us(const kvb_engine_t *e)
{
    return e ? e->cfg.busy_poll_us : 0;
}

uint32_t kvb_engine_linger_us(const kvb_engine_t *e)
{
    if (!e)
        return 0;
    return e->cfg.linger_us > e->cfg.busy_poll_us ? e->cfg.linger_us : e->cfg.busy_poll_us;
}

const char *kvb_engine_cpus(const kvb_engine_t *e)
{
    return e && e->cpus_text ? e->cpus_text : "";
}

const char *kvb_engine_fabric_provider(const kvb_engine_t *e)
{
    return e && (e->paths & (1u << KVB_PATH_FABRIC))
               ? kvb__fabric_provider_name(e->path_state[KVB_PATH_FABRIC])
               : "";
}

/* Lets every running path prepare the region and make its key blob. Memory that only some paths
 * serve (device memory) needs at least one; host memory is served by the control plane's lanes
 * whatever the others say. */
static int region_prepare(kvb_engine_t *e, kvb_region_t *reg)
{
    unsigned served = 0;
    for (unsigned id = 0; id < KVB_PATHS; id++) {
        const kvb_provider_ops_t *ops = kvb__provider(id);
        if (!(e->paths & (1u << id)) || !ops->reg)
            continue;
        uint8_t key[KVB_KEY_MAX];
        size_t key_len = 0;
        int rc = ops->reg(e->path_state[id], reg, key, &key_len);
        if (rc == KVB_OK && key_len)
            rc = kvb__region_add_key(reg, id, key, key_len);
        if (rc == KVB_OK) {
            served |= 1u << id;
        } else if (rc != KVB_ERR_UNSUPPORTED) { /* the caller releases what others took */
            KVB_WARN("register %s memory at 0x%llx: data path %s: %s", reg->location,
                     (unsigned long long)reg->addr, ops->name, kvb_strerror(rc));
            return rc;
        }
    }
    if (reg->kind != KVB_MEM_CPU && !served) {
        KVB_WARN("register %s memory at 0x%llx: no data path here serves it", reg->location,
                 (unsigned long long)reg->addr);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

int kvb_register(kvb_engine_t *e, void *addr, size_t len, const char *location, unsigned access)
{
    if (!e || !addr)
        return KVB_ERR_INVALID_ARG;
    kvb_region_t *reg = NULL;
    int rc = kvb__region_new((uint64_t)(uintptr_t)addr, len, location, access, &reg);
    if (rc == KVB_OK &&
        ((rc = region_prepare(e, reg)) || (rc = kvb__registry_insert(&e->registry, reg)))) {
        region_release(e, reg);
        free(reg);
    }
    if (rc)
        KVB_WARN("register %p+%zu failed: %s", addr, len, kvb_strerror(rc));
    else
        kvb__segdesc_publish(e->segbind, false);
    return rc;
}

int kvb_alloc(kvb_engine_t *e, size_t len, unsigned flags, void **out)
{
    if (!e || !out || (flags & ~(unsigned)KVB_ALLOC_HUGE))
        return KVB_ERR_INVALID_ARG;
    return kvb__shm_alloc(e->shm, len, flags, out);
}

int kvb_free(kvb_engine_t *e, void *ptr)
{
    uint64_t id, base, len;
    if (!e || !ptr)
        return KVB_ERR_INVALID_ARG;
    if (!kvb__shm_alloc_of(e->shm, (uintptr_t)ptr, 1, &id, &base, &len) || base != (uintptr_t)ptr)
        return KVB_ERR_NOT_FOUND;
    if (kvb__registry_overlaps(&e->registry, base, len)) {
        KVB_WARN("kvb_free(%p): memory inside it is still registered", ptr);
        return KVB_ERR_BUSY;
    }
    return kvb__shm_free(e->shm, ptr);
}

int kvb_unregister(kvb_engine_t *e, void *addr)
{
    if (!e || !addr)
        return KVB_ERR_INVALID_ARG;
    int rc = kvb__registry_remove(&e->registry, (uint64_t)(uintptr_t)addr, (int)e->cfg.timeout_ms);
    if (rc != KVB_ERR_NOT_FOUND)
        kvb__segdesc_publish(e->segbind, false);
    return rc;
}

/* ---- peers and segments ------------------------------------------------------------------ */

void kvb__peer_release(kvb_peer_t *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1)
        return;
    if (p->tp_ops && p->tp_ops->peer_free)
        p->tp_ops->peer_free(p);
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if ((p->paths & (1u << id)) && kvb__provider(id)->detach)
            kvb__provider(id)->detach(p);
    kvb__region_list_put(p->rlist);
    kvb__attrs_free(p->attrs, p->nattrs);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

void kvb__peer_fail(kvb_peer_t *p, int error)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&p->lost, &expected, error))
        return;
    if (error != KVB_ERR_SHUTDOWN && error != KVB_ERR_CANCELED)
        KVB_WARN("peer %s lost: %s", p->name, kvb_strerror(error));
    p->engine->tp_ops->disconnect(p->engine->tp, p, error);
}

kvb_region_list_t *kvb__region_list_new(kvb_region_desc_t *d, size_t n)
{
    kvb_region_list_t *l = malloc(sizeof *l);
    if (!l) {
        free(d);
        return NULL;
    }
    atomic_init(&l->refs, 1);
    l->n = n;
    l->d = d;
    return l;
}

void kvb__region_list_put(kvb_region_list_t *l)
{
    if (l && atomic_fetch_sub(&l->refs, 1) == 1) {
        free(l->d);
        free(l);
    }
}

kvb_region_list_t *kvb__peer_regions(kvb_peer_t *p)
{
    pthread_mutex_lock(&p->mu);
    kvb_region_list_t *l = p->rlist;
    if (l)
        atomic_fetch_add(&l->refs, 1);
    pthread_mutex_unlock(&p->mu);
    return l;
}

/* Attaches the running paths to a peer whose control connection is up. A path the protocol
 * names must reach it; the others may not (elsewhere, another user) and are left out. */
static int attach_paths(kvb_engine_t *e, kvb_peer_t *p, uint64_t deadline)
{
    for (size_t i = 0; i < e->norder; i++) {
        unsigned id = e->order[i];
        const kvb_provider_ops_t *ops = kvb__provider(id);
        if (!(e->paths & (1u << id)))
            continue;
        int rc = ops->attach ? ops->attach(e->path_state[id], p, deadline) : KVB_OK;
        if (rc == KVB_OK) {
            p->paths |= 1u << id;
        } else if (e->required & (1u << id)) {
            KVB_ERROR("segment %s: data path %s required but unavailable: %s", p->name, ops->name,
                      rc == KVB_ERR_UNSUPPORTED ? "it does not reach this peer" : kvb_strerror(rc));
            return KVB_ERR_UNSUPPORTED;
        } else {
            KVB_DEBUG("segment %s: no %s path (%s)", p->name, ops->name, kvb_strerror(rc));
        }
    }
    return KVB_OK;
}

/* Splits "host:port" (host may be "[v6]"). */
static int parse_name(const char *name, char *host, size_t cap, uint16_t *port)
{
    const char *colon = strrchr(name, ':');
    if (!colon || colon == name || !colon[1])
        return KVB_ERR_INVALID_ARG;
    char *end;
    errno = 0;
    unsigned long v = strtoul(colon + 1, &end, 10);
    if (errno || *end || v == 0 || v > 65535)
        return KVB_ERR_INVALID_ARG;
    const char *h = name;
    size_t hl = (size_t)(colon - name);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl == 0 || hl >= cap)
        return KVB_ERR_INVALID_ARG;
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (uint16_t)v;
    return KVB_OK;
}

/* Connects to segment `name` at host:port (NULL host: the name is "host:port"). */
static int connect_peer(kvb_engine_t *e, const char *name, const char *host, uint16_t port,
                        bool probe, kvb_peer_t **out)
{
    kvb_peer_t *p = calloc(1, sizeof *p);
    if (!p)
        return KVB_ERR_NOMEM;
    atomic_init(&p->refs, 1);
    atomic_init(&p->lost, 0);
    p->engine = e;
    pthread_mutex_init(&p->mu, NULL);
    strcpy(p->name, name);
    int rc = KVB_OK;
    if (host) {
        snprintf(p->host, sizeof p->host, "%s", host);
        p->port = port;
    } else {
        rc = parse_name(name, p->host, sizeof p->host, &p->port);
    }
    if (rc) {
        KVB_ERROR("segment name '%s' is not host:port (p2p metadata)", name);
    } else {
        uint64_t deadline = kvb__deadline_ms(e->cfg.connect_timeout_ms);
        rc = e->tp_ops->connect(e->tp, p, deadline);
        p->tp_ops = e->tp_ops; /* from here on, releasing it frees the transport's part too */
        if (rc == KVB_OK && !probe && (rc = attach_paths(e, p, deadline)))
            e->tp_ops->disconnect(e->tp, p, KVB_ERR_CANCELED);
    }
    if (rc) {
        kvb__peer_release(p);
        return rc;
    }
    *out = p;
    return KVB_OK;
}

/* With a metadata store: looks `name` up, connects to the address its descriptor gives and checks
 * that the peer there is the incarnation the descriptor names. A mismatch means the descriptor
 * went stale (the owner restarted and has not republished yet, or another engine took the port):
 * look again once, then give up with KVB_ERR_PEER_RESTARTED. */
static int connect_named(kvb_engine_t *e, const char *name, kvb_peer_t **out)
{
    for (int attempt = 0;; attempt++) {
        kvb_segdesc_t d;
        int rc = kvb__segdesc_lookup(e->segbind, name, &d);
        if (rc)
            return rc;
        kvb_peer_t *p = NULL;
        for (size_t i = 0; i < d.naddr; i++)
            if ((rc = connect_peer(e, name, d.addr[i].host, d.addr[i].port, false, &p)) == KVB_OK ||
                !KVB_IS_PEER_ERROR(rc))
                break;
        if (rc)
            return rc;
        if (p->hello.incarnation == d.incarnation) {
            *out = p;
            return KVB_OK;
        }
        kvb__peer_fail(p, KVB_ERR_CANCELED);
        kvb__peer_release(p);
        if (attempt == 1) {
            KVB_WARN("segment %s: the peer at its address is not the incarnation its descriptor "
                     "names (%016llx)",
                     name, (unsigned long long)d.incarnation);
            return KVB_ERR_PEER_RESTARTED;
        }
    }
}

static kvb_segment_t handle_of(const kvb_engine_t *e, size_t idx)
{
    return ((kvb_segment_t)e->segs[idx].gen << 16) | (kvb_segment_t)(idx + 1);
}

/* The slot a handle names, if it is open and of the same generation. Caller holds seg_mu. */
static kvb_segment_slot_t *slot_of(kvb_engine_t *e, kvb_segment_t seg)
{
    size_t i = (size_t)(seg & 0xFFFFu);
    if (i == 0 || i > e->nsegs)
        return NULL;
    kvb_segment_slot_t *s = &e->segs[i - 1];
    return s->peer && s->gen == (uint16_t)(seg >> 16) ? s : NULL;
}

static kvb_segment_slot_t *find_slot(kvb_engine_t *e, const char *name, size_t *idx)
{
    for (size_t i = 0; i < e->nsegs; i++)
        if ((e->segs[i].peer || e->segs[i].opening) && !strcmp(e->segs[i].name, name)) {
            *idx = i;
            return &e->segs[i];
        }
    return NULL;
}

/* Takes a free slot for `name`, marked opening. Caller holds seg_mu. */
static int insert_slot(kvb_engine_t *e, const char *name, size_t *idx)
{
    size_t i = 0;
    while (i < e->nsegs && (e->segs[i].peer || e->segs[i].opening))
        i++;
    if (i == e->nsegs) {
        if (e->nsegs >= KVB_SEG_SLOTS_MAX)
            return KVB_ERR_TOO_LARGE;
        size_t ncap = e->nsegs ? e->nsegs * 2 : 8;
        if (ncap > KVB_SEG_SLOTS_MAX)
            ncap = KVB_SEG_SLOTS_MAX;
        kvb_segment_slot_t *n = realloc(e->segs, ncap * sizeof *n);
        if (!n)
            return KVB_ERR_NOMEM;
        memset(n + e->nsegs, 0, (ncap - e->nsegs) * sizeof *n);
        e->segs = n;
        e->nsegs = ncap;
    }
    e->segs[i].opening = true;
    e->segs[i].opens = 0;
    strcpy(e->segs[i].name, name);
    *idx = i;
    return KVB_OK;
}

/* The slot's peer is gone for good: later handles to it must not match. Caller holds seg_mu. */
static void free_slot(kvb_segment_slot_t *s)
{
    s->peer = NULL;
    s->opens = 0;
    s->gen++;
    s->name[0] = '\0';
}

int kvb_segment_open(kvb_engine_t *e, const char *name, kvb_segment_t *out)
{
    if (!e || !name || !out || strlen(name) > KVB_NAME_MAX)
        return KVB_ERR_INVALID_ARG;
    size_t idx;
    pthread_mutex_lock(&e->seg_mu);
    kvb_segment_slot_t *slot;
    /* One connect per name at a time; opens of other names never wait for it. */
    while ((slot = find_slot(e, name, &idx)) && slot->opening)
        pthread_cond_wait(&e->seg_cv, &e->seg_mu);
    kvb_peer_t *old = slot ? slot->peer : NULL;
    if (old && atomic_load(&old->lost) == 0) {
        slot->opens++;
        *out = handle_of(e, idx);
        pthread_mutex_unlock(&e->seg_mu);
        return KVB_OK;
    }
    int rc = KVB_OK;
    if (slot)
        slot->opening = true; /* a lost peer: reconnect it in place, the handle stays */
    else
        rc = insert_slot(e, name, &idx);
    pthread_mutex_unlock(&e->seg_mu);
    if (rc)
        return rc;

    kvb_peer_t *p = NULL;
    rc = e->segbind ? connect_named(e, name, &p) : connect_peer(e, name, NULL, 0, false, &p);

    pthread_mutex_lock(&e->seg_mu);
    slot = &e->segs[idx]; /* the table may have moved meanwhile */
    slot->opening = false;
    if (rc == KVB_OK) {
        if (old && old->hello.incarnation != p->hello.incarnation)
            KVB_INFO("segment %s restarted (incarnation %016llx -> %016llx); cached "
                     "descriptor dropped",
                     name, (unsigned long long)old->hello.incarnation,
                     (unsigned long long)p->hello.incarnation);
        slot->peer = p;
        slot->opens++;
        *out = handle_of(e, idx);
    } else if (!old) {
        free_slot(slot);
    }
    pthread_cond_broadcast(&e->seg_cv);
    pthread_mutex_unlock(&e->seg_mu);
    if (rc == KVB_OK && old)
        kvb__peer_release(old);
    return rc;
}

int kvb_segment_close(kvb_engine_t *e, kvb_segment_t seg)
{
    if (!e)
        return KVB_ERR_INVALID_ARG;
    kvb_peer_t *gone = NULL;
    pthread_mutex_lock(&e->seg_mu);
    kvb_segment_slot_t *s;
    /* A lost peer being reconnected in place keeps its handle: wait for that (bounded by the
     * connect timeout) rather than refuse the close, which would leave the segment open. */
    while ((s = slot_of(e, seg)) && s->opening)
        pthread_cond_wait(&e->seg_cv, &e->seg_mu);
    int rc = KVB_ERR_BAD_SEGMENT;
    if (s) {
        rc = KVB_OK;
        if (--s->opens == 0) {
            gone = s->peer;
            free_slot(s);
        }
    }
    pthread_mutex_unlock(&e->seg_mu);
    if (gone) {
        kvb__peer_fail(gone, KVB_ERR_CANCELED);
        kvb__peer_release(gone);
    }
    return rc;
}

kvb_peer_t *kvb__segment_peer(kvb_engine_t *e, kvb_segment_t seg)
{
    kvb_peer_t *p = NULL;
    pthread_mutex_lock(&e->seg_mu);
    kvb_segment_slot_t *s = slot_of(e, seg);
    if (s) {
        p = s->peer;
        atomic_fetch_add(&p->refs, 1);
    }
    pthread_mutex_unlock(&e->seg_mu);
    return p;
}

int kvb_segment_refresh(kvb_engine_t *e, kvb_segment_t seg)
{
    if (!e)
        return KVB_ERR_INVALID_ARG;
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (!p)
        return KVB_ERR_BAD_SEGMENT;
    /* A fresh handshake on connections of its own returns the current lists. */
    kvb_peer_t *probe;
    int rc = connect_peer(e, p->name, p->host, p->port, true, &probe);
    if (rc == KVB_OK) {
        if (probe->hello.incarnation != p->hello.incarnation) {
            rc = KVB_ERR_PEER_RESTARTED;
            kvb__peer_fail(p, rc);
        } else {
            pthread_mutex_lock(&p->mu);
            kvb_region_list_t *r = p->rlist;
            kvb_attr_t *a = p->attrs;
            size_t na = p->nattrs;
            p->rlist = probe->rlist;
            p->attrs = probe->attrs;
            p->nattrs = probe->nattrs;
            probe->rlist = r;
            probe->attrs = a;
            probe->nattrs = na;
            pthread_mutex_unlock(&p->mu);
        }
        kvb__peer_fail(probe, KVB_ERR_CANCELED);
        kvb__peer_release(probe);
    }
    kvb__peer_release(p);
    return rc;
}

int kvb_segment_regions(kvb_engine_t *e, kvb_segment_t seg, int refresh, kvb_region_info_t *out,
                        size_t cap, size_t *count)
{
    if (!e || !count || (cap && !out))
        return KVB_ERR_INVALID_ARG;
    int rc = refresh ? kvb_segment_refresh(e, seg) : KVB_OK;
    kvb_peer_t *p = rc ? NULL : kvb__segment_peer(e, seg);
    if (!p)
        return rc ? rc : KVB_ERR_BAD_SEGMENT;
    kvb_region_list_t *l = kvb__peer_regions(p);
    size_t total = l ? l->n : 0, n = total < cap ? total : cap;
    for (size_t i = 0; i < n; i++)
        out[i] = l->d[i].info;
    *count = total;
    kvb__region_list_put(l);
    kvb__peer_release(p);
    return KVB_OK;
}

int kvb_segment_attr(kvb_engine_t *e, kvb_segment_t seg, const char *key, void *buf, size_t cap,
                     size_t *len)
{
    if (!e || !key || !len || (cap && !buf))
        return KVB_ERR_INVALID_ARG;
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (!p)
        return KVB_ERR_BAD_SEGMENT;
    int rc = KVB_ERR_NOT_FOUND;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->nattrs; i++) {
        if (strcmp(p->attrs[i].key, key))
            continue;
        *len = p->attrs[i].len;
        if (cap) /* cap 0 (buf may be NULL) asks for the length only */
            memcpy(buf, p->attrs[i].value, p->attrs[i].len < cap ? p->attrs[i].len : cap);
        rc = KVB_OK;
        break;
    }
    pthread_mutex_unlock(&p->mu);
    kvb__peer_release(p);
    return rc;
}

int kvb_engine_set_attr(kvb_engine_t *e, const char *key, const void *value, size_t len)
{
    if (!e || !key || !*key || strlen(key) > KVB_ATTR_KEY_MAX || (len && !value) ||
        len > KVB_ATTR_VALUE_MAX)
        return KVB_ERR_INVALID_ARG;
    for (const char *k = key; *k; k++)
        if (*k < 0x21 || *k > 0x7e)
            return KVB_ERR_INVALID_ARG;
    uint8_t *copy = NULL;
    if (value && !(copy = malloc(len ? len : 1)))
        return KVB_ERR_NOMEM;
    if (copy && len)
        memcpy(copy, value, len);
    int rc = KVB_OK;
    pthread_mutex_lock(&e->attr_mu);
    size_t i = 0, total = 4 + (value ? 6 + strlen(key) + len : 0);
    while (i < e->nattrs && strcmp(e->attrs[i].key, key))
        i++;
    for (size_t k = 0; k < e->nattrs; k++)
        if (k != i)
            total += 6 + strlen(e->attrs[k].key) + e->attrs[k].len;
    if (total > KVB_WIRE_MAX_ATTRS) {
        /* Peers receive all attributes in one frame: more would make every handshake fail. */
        pthread_mutex_unlock(&e->attr_mu);
        free(copy);
        KVB_WARN("set_attr %s: attributes would take %zu bytes, over the %u-byte limit", key, total,
                 KVB_WIRE_MAX_ATTRS);
        return KVB_ERR_TOO_LARGE;
    }
    if (!value) { /* remove */
        if (i < e->nattrs) {
            free(e->attrs[i].value);
            e->attrs[i] = e->attrs[--e->nattrs];
        }
    } else if (i < e->nattrs) {
        free(e->attrs[i].value);
        e->attrs[i].value = copy;
        e->attrs[i].len = len;
    } else if (e->nattrs == KVB_ATTRS_MAX) {
        rc = KVB_ERR_TOO_LARGE;
    } else {
        kvb_attr_t *n = realloc(e->attrs, (e->nattrs + 1) * sizeof *n);
        if (!n) {
            rc = KVB_ERR_NOMEM;
        } else {
            e->attrs = n;
            memset(&n[e->nattrs], 0, sizeof *n);
            strcpy(n[e->nattrs].key, key);
            n[e->nattrs].value = copy;
            n[e->nattrs].len = len;
            e->nattrs++;
        }
    }
    pthread_mutex_unlock(&e->attr_mu);
    if (rc)
        free(copy);
    else
        kvb__segdesc_publish(e->segbind, false);
    return rc;
}

int kvb__engine_attrs_encode(kvb_engine_t *e, uint8_t **out, size_t *len)
{
    pthread_mutex_lock(&e->attr_mu);
    int rc = kvb__wire_attrs_encode(e->attrs, e->nattrs, out, len);
    pthread_mutex_unlock(&e->attr_mu);
    return rc;
}

int kvb_segment_transport(kvb_engine_t *e, kvb_segment_t seg, const char **out)
{
    if (!e || !out)
        return KVB_ERR_INVALID_ARG;
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (!p)
        return KVB_ERR_BAD_SEGMENT;
    /* The first path in the order that reaches it and carries host memory. */
    *out = kvb__provider(KVB_PATH_TCP)->name;
    for (size_t i = 0; i < e->norder; i++)
        if ((p->paths & (1u << e->order[i])) && !kvb__provider(e->order[i])->device_only) {
            *out = kvb__provider(e->order[i])->name;
            break;
        }
    kvb__peer_release(p);
    return KVB_OK;
}

void kvb__engine_identity(kvb_engine_t *e, kvb_engine_identity_t *out)
{
    *out = (kvb_engine_identity_t){.name = e->segment_name,
                                   .advertise = e->advertise_addr,
                                   .port = e->tp_ops->port(e->tp),
                                   .incarnation = e->hello.incarnation,
                                   .pid = e->hello.pid,
                                   .same_host = (e->paths & (1u << KVB_PATH_SHM)) != 0,
                                   .cluster = e->cluster};
    _Static_assert(sizeof out->host_id == KVB_HOST_ID_LEN, "host id sizes agree");
    memcpy(out->host_id, e->hello.host_id, sizeof out->host_id);
}

int kvb__engine_regions(kvb_engine_t *e, kvb_region_info_t **out, size_t *n)
{
    kvb_region_desc_t *d;
    int rc = kvb__registry_list(&e->registry, &d, n);
    kvb_region_info_t *v = rc || !*n ? NULL : malloc(*n * sizeof *v);
    if (rc == KVB_OK && *n && !v)
        rc = KVB_ERR_NOMEM;
    for (size_t i = 0; rc == KVB_OK && i < *n; i++)
        v[i] = d[i].info;
    free(d);
    *out = v;
    return rc;
}

void kvb__engine_each_attr(kvb_engine_t *e,
                           void (*fn)(void *arg, const char *key, const uint8_t *value, size_t len),
                           void *arg)
{
    pthread_mutex_lock(&e->attr_mu);
    for (size_t i = 0; i < e->nattrs; i++)
        fn(arg, e->attrs[i].key, e->attrs[i].value, e->attrs[i].len);
    pthread_mutex_unlock(&e->attr_mu);
}

int kvb__engine_open_segments(kvb_engine_t *e, kvb_open_segment_t **out, size_t *n)
{
    pthread_mutex_lock(&e->seg_mu);
    kvb_open_segment_t *v = e->nsegs ? calloc(e->nsegs, sizeof *v) : NULL;
    size_t k = 0;
    for (size_t i = 0; v && i < e->nsegs; i++) {
        kvb_peer_t *p = e->segs[i].peer;
        if (!p || atomic_load(&p->lost) != 0)
            continue;
        v[k].seg = handle_of(e, i);
        snprintf(v[k].name, sizeof v[k].name, "%s", p->name);
        v[k++].incarnation = p->hello.incarnation;
    }
    pthread_mutex_unlock(&e->seg_mu);
    if (e->nsegs && !v)
        return KVB_ERR_NOMEM;
    *out = v;
    *n = k;
    return KVB_OK;
}

void kvb__segment_fail(kvb_engine_t *e, kvb_segment_t seg, uint64_t incarnation, int error)
{
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (p && p->hello.incarnation == incarnation)
        kvb__peer_fail(p, error);
    kvb__peer_release(p);
}

bool kvb__engine_registered(kvb_engine_t *e, uint64_t addr, uint64_t len)
{
    return kvb__registry_check(&e->registry, addr, len, 0, KVB_ERR_NOT_FOUND, NULL) == KVB_OK;
}

int kvb__segment_proven_name(kvb_engine_t *e, kvb_segment_t seg, char *buf, size_t cap)
{
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (!p)
        return KVB_ERR_BAD_SEGMENT;
    snprintf(buf, cap, "%s", p->hello.name);
    kvb__peer_release(p);
    return KVB_OK;
}

int kvb__segment_state(kvb_engine_t *e, kvb_segment_t seg)
{
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (!p)
        return KVB_ERR_BAD_SEGMENT;
    int lost = atomic_load(&p->lost);
    kvb__peer_release(p);
    return lost;
}

int kvb_segment_incarnation(kvb_engine_t *e, kvb_segment_t seg, uint64_t *out)
{
    if (!e || !out)
        return KVB_ERR_INVALID_ARG;
    kvb_peer_t *p = kvb__segment_peer(e, seg);
    if (!p)
        return KVB_ERR_BAD_SEGMENT;
    *out = p->hello.incarnation;
    kvb__peer_release(p);
    return KVB_OK;
}

/* ---- notifications ------------------------------------------------------------------------ */

int kvb__notify_deliver(kvb_engine_t *e, const char *from, const void *data, size_t len,
                        uint64_t reply_to)
{
    if (len > KVB_NOTIFY_MAX)
        return KVB_ERR_TOO_LARGE;
    for (unsigned id = 0; id < KVB_PATHS; id++) /* the paths live until the control plane went */
        if ((e->paths & (1u << id)) && kvb__provider(id)->settle)
            kvb__provider(id)->settle(e->path_state[id]);
    pthread_mutex_lock(&e->notify_mu);
    if (e->notify_count == e->notify_cap) {
        pthread_mutex_unlock(&e->notify_mu);
        KVB_WARN("notification from %s dropped: queue of %zu full", from, e->notify_cap);
        return KVB_ERR_REMOTE_NO_SPACE;
    }
    kvb_notification_t *n = &e->notify_ring[(e->notify_head + e->notify_count) % e->notify_cap];
    snprintf(n->from, sizeof n->from, "%s", from);
    n->len = len;
    n->reply_to = reply_to;
    if (len)
        memcpy(n->data, data, len);
    e->notify_count++;
    pthread_cond_signal(&e->notify_cv);
    pthread_mutex_unlock(&e->notify_mu);
    return KVB_OK;
}

int kvb_notify_reply(kvb_engine_t *e, const kvb_notification_t *received, const void *msg,
                     size_t len)
{
    if (!e || !received || (len && !msg) || received->reply_to == 0)
        return KVB_ERR_INVALID_ARG;
    if (len > KVB_NOTIFY_MAX)
        return KVB_ERR_TOO_LARGE;
    return e->tp_ops->reply(e->tp, received->reply_to, msg, len);
}

int kvb_notify_recv(kvb_engine_t *e, kvb_notification_t *out, int timeout_ms)
{
    if (!e || !out)
        return KVB_ERR_INVALID_ARG;
    uint64_t deadline = kvb__deadline_ms(timeout_ms);
    int rc = KVB_OK;
    pthread_mutex_lock(&e->notify_mu);
    e->notify_waiters++;
    while (e->notify_count == 0) {
        if (e->stopping) {
            rc = KVB_ERR_SHUTDOWN;
            break;
        }
        if (timeout_ms == 0) {
            rc = KVB_ERR_AGAIN;
            break;
        }
        if (deadline == UINT64_MAX) {
            pthread_cond_wait(&e->notify_cv, &e->notify_mu);
            continue;
        }
        struct timespec ts = kvb__timespec_of(deadline);
        if (pthread_cond_timedwait(&e->notify_cv, &e->notify_mu, &ts) == ETIMEDOUT &&
            e->notify_count == 0) {
            rc = KVB_ERR_TIMEOUT;
            break;
        }
    }
    if (rc == KVB_OK) {
        *out = e->notify_ring[e->notify_head];
        e->notify_head = (e->notify_head + 1) % e->notify_cap;
        e->notify_count--;
    }
    if (--e->notify_waiters == 0 && e->stopping)
        pthread_cond_broadcast(&e->notify_cv); /* kvb_engine_destroy waits for this */
    pthread_mutex_unlock(&e->notify_mu);
    return rc;
}
