/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge bench: throughput and latency of READ/WRITE batches between two engines, modelled on
 * Mooncake's transfer_engine_bench so results compare directly; --verify checks every byte. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <sched.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/copy.h"
#include "common/cpus.h"
#include "kvbridge/engine.h"
#include "tools/cli.h"

typedef struct {
    const char *mode;
    const char *segment;
    const char *bind;
    const char *peer_netns; /* --baseline tcp|rpc: the sender's (server's) network namespace */
    bool insecure;          /* --insecure */
    const char *baseline;   /* "tcp", "rpc" or "memcpy" (or "copy"): measure the ceiling instead */
    bool ceiling; /* --ceiling: measure the path's ceiling after the run, print the ratio */
    double ceiling_gbps;
    char ceiling_method[sizeof((kvb_ceiling_t *)0)->method]; /* a kvb_ceiling_t's method */
    /* --ceiling --reps N (N > 1): the run's windows and the ceiling's, in turn (measure_pairs) */
    double pair_gbps, pair_ratio, pair_lo, pair_hi; /* medians over the pairs; their range */
    double window_s;
    /* ... over TCP with one submitting thread, a third window in each pair: the same batches
     * through a raw request/response program (kvb_rpcref_open); medians over the pairs */
    double rpc_gbps, rpc_ratio, vs_rpc; /* its GB/s, its share of the ceiling, the run's of it */
    char rpc_method[256];
    uint64_t area_bytes;         /* the registered buffer each side used */
    const char *protocol;        /* tcp, shm or auto */
    const char *fabric_provider; /* --fabric-provider: the fabric path's libfabric provider */
    char fabric_in_use[64];      /* the provider the initiator's engine runs it on, or "" */
    char congestion[16];         /* the TCP congestion control of the initiator's engine */
    uint32_t busy_poll_us;       /* the busy polling of the initiator's engine */
    uint32_t linger_us;          /* its progress threads' polling after requests */
    char cpus[256];              /* the CPUs of its data threads (--cpus), "" if unbound */
    const char *kv_model;        /* --kv: the KV-shaped workload instead */
    const char *metadata;        /* --metadata URI: segments found through a store */
    const char *cluster, *name;
    double open_ms; /* how long kvb_segment_open took (a store lookup plus the handshake) */
    uint64_t tokens, reps;
    bool latency, block_given;
    const char *path; /* what the initiator's engine chose: "tcp" or "shm" */
    bool loopback, verify, json;
    bool gpu_local, gpu_remote; /* --gpu, --gpu-local, --gpu-remote: buffers on CUDA device 0 */
    double gpu_d2h, gpu_h2d, gpu_d2d; /* their copy ceilings, measured after the run (GB/s) */
    int write;                        /* operation */
    uint64_t port, block, batch, threads, duration, buffer, seed, lanes, progress;
    /* --loopback over a same-host path: the memfd the target's buffer lives in, made before the
     * target's process is forked, so that the copy ceiling can copy the run's own pages
     * (copy_ceiling_open); -1 if none */
    int target_fd;
} bench_opts_t;

typedef struct {
    bench_opts_t *o;
    kvb_engine_t *engine;
    kvb_segment_t seg;
    uint8_t *local;        /* whole local buffer */
    const uint8_t *expect; /* READ --verify: the target's pattern */
    uint64_t remote_base;
    uint64_t area_off, area_len; /* this thread's slice, same offsets locally and remotely */
    uint64_t deadline;
    /* results */
    uint64_t bytes, reqs, errors, mismatches, covered;
    double *lat_us;
    size_t nlat, cap_lat;
    int first_error;
} worker_t;

static volatile sig_atomic_t g_stop;
static atomic_ullong g_progress_bytes; /* for the progress line of long runs on a terminal */

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

/* ---- the data pattern: byte o of a buffer filled with seed s -----------------------------------
 */

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fill_pattern(uint8_t *buf, uint64_t len, uint64_t seed)
{
    uint64_t words = len / 8;
    for (uint64_t w = 0; w < words; w++) {
        uint64_t v = splitmix64(seed + w);
        memcpy(buf + w * 8, &v, 8);
    }
    uint64_t v = splitmix64(seed + words);
    memcpy(buf + words * 8, &v, len - words * 8);
}

/* Index of the first byte of [off, off+len) that differs from the pattern, or -1. */
static int64_t check_pattern(const uint8_t *buf, uint64_t off, uint64_t len, uint64_t seed)
{
    uint8_t chunk[4096];
    for (uint64_t done = 0; done < len;) {
        uint64_t pos = off + done, w0 = pos / 8, skip = pos % 8;
        uint64_t n = len - done < sizeof chunk - 8 ? len - done : sizeof chunk - 8;
        for (uint64_t w = 0; w * 8 < n + skip; w++) {
            uint64_t v = splitmix64(seed + w0 + w);
            memcpy(chunk + w * 8, &v, 8);
        }
        if (memcmp(buf + pos, chunk + skip, n) != 0)
            for (uint64_t i = 0; i < n; i++)
                if (buf[pos + i] != chunk[skip + i])
                    return (int64_t)(pos + i);
        done += n;
    }
    return -1;
}

/* "auto", or a comma-separated list of distinct data path names (the engine's `protocol`). */
static bool protocol_ok(const char *s)
{
    static const char *const paths[] = {"tcp", "shm", "cuda", "fabric"};
    if (!strcmp(s, "auto"))
        return true;
    unsigned seen = 0;
    for (;;) {
        size_t n = strcspn(s, ",");
        size_t k = 0;
        while (k < sizeof paths / sizeof paths[0] &&
               (strlen(paths[k]) != n || strncmp(paths[k], s, n)))
            k++;
        if (k == sizeof paths / sizeof paths[0] || (seen & (1u << k)))
            return false;
        seen |= 1u << k;
        if (!s[n])
            return true;
        s += n + 1;
    }
}

static uint8_t *alloc_buffer(uint64_t len);

/* The benchmark's registered buffers: kvb_alloc memory (what same-host peers map) unless the run
 * is TCP-only. kvb_alloc memory belongs to the engine and goes with it. */
static uint8_t *engine_buffer(kvb_engine_t *e, const bench_opts_t *o, uint64_t len, bool gpu)
{
    void *p = NULL;
    if (gpu)
        return kvb_bench_gpu_alloc(len);
    if (strcmp(o->protocol, "tcp") != 0) {
        int rc = kvb_alloc(e, len, 0, &p);
        if (rc)
            fprintf(stderr, "bench: kvb_alloc(%llu): %s\n", (unsigned long long)len,
                    kvb_strerror(rc));
        return p;
    }
    return kvb_cli_populated(len);
}

static void engine_buffer_free(const bench_opts_t *o, uint8_t *p, uint64_t len, bool gpu)
{
    if (gpu)
        kvb_bench_gpu_free(p);
    else if (p && strcmp(o->protocol, "tcp") == 0)
        munmap(p, len);
}

/* Fills a buffer (host or device) with the pattern of `seed`. */
static int fill_buffer(uint8_t *buf, uint64_t len, uint64_t seed, bool gpu)
{
    if (!gpu) {
        fill_pattern(buf, len, seed);
        return 0;
    }
    uint8_t *tmp = alloc_buffer(len);
    int rc = tmp ? 0 : -1;
    if (tmp) {
        fill_pattern(tmp, len, seed);
        rc = kvb_bench_gpu_upload(buf, tmp, len);
        munmap(tmp, len);
    }
    return rc;
}

static uint8_t *alloc_buffer(uint64_t len)
{
    return kvb_cli_populated(len);
}

static void target_buffer_free(const bench_opts_t *o, uint8_t *buf)
{
    if (o->target_fd >= 0)
        munmap(buf, o->buffer);
    else
        engine_buffer_free(o, buf, o->buffer, o->gpu_remote);
}

/* ---- target
 * -------------------------------------------------------------------------------------- */

/* Answers "verify SEED OFF LEN" notifications: checks bytes that initiators wrote here. */
static void answer_verify(kvb_engine_t *e, const kvb_notification_t *n, const uint8_t *buf,
                          uint64_t size, bool gpu)
{
    char msg[128];
    unsigned long long seed, off, len;
    size_t l = n->len < sizeof msg - 1 ? n->len : sizeof msg - 1;
    memcpy(msg, n->data, l);
    msg[l] = '\0';
    if (sscanf(msg, "verify %llu %llu %llu", &seed, &off, &len) != 3)
        return;
    char reply[96];
    if (off > size || len > size - off) {
        snprintf(reply, sizeof reply, "verified bad-range");
    } else {
        uint8_t *host = gpu ? alloc_buffer(size) : (uint8_t *)buf;
        int64_t bad = host && (!gpu || kvb_bench_gpu_download(host, buf, size) == 0)
                          ? check_pattern(host, off, len, seed)
                          : 0;
        if (gpu && host)
            munmap(host, size);
        if (bad < 0)
            snprintf(reply, sizeof reply, "verified ok %llu", len);
        else
            snprintf(reply, sizeof reply, "verified mismatch %lld", (long long)bad);
    }
    /* On the initiator's own connection: it need not be reachable at its advertised address. */
    int rc = kvb_notify_reply(e, n, reply, strlen(reply));
    if (rc)
        fprintf(stderr, "bench target: verification answer to %s: %s\n", n->from, kvb_strerror(rc));
}

/* Serves until a signal, or until `parent_fd` (loopback) reports that the parent went away. */
static int run_target(bench_opts_t *o, int report_fd, int parent_fd)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.bind_addr = o->bind;
    cfg.insecure = o->insecure;
    cfg.port = (uint16_t)o->port;
    cfg.protocol = o->protocol;
    cfg.fabric_provider = o->fabric_provider;
    cfg.lanes = (int)o->lanes;
    if (o->progress) /* else the engine's default (kvb_config_init) */
        cfg.progress_threads = (int)o->progress;
    cfg.metadata = o->metadata;
    cfg.cluster = o->cluster;
    cfg.segment_name = o->name;
    kvb_engine_t *e;
    int rc = kvb_engine_create(&cfg, &e);
    if (rc) {
        fprintf(stderr, "bench target: engine: %s\n", kvb_strerror(rc));
        return 1;
    }
    uint8_t *buf = o->target_fd >= 0 ? kvb_cli_map_memfd(o->target_fd, o->buffer, true)
                                     : engine_buffer(e, o, o->buffer, o->gpu_remote);
    if (!buf ||
        (rc = kvb_register(e, buf, o->buffer, o->gpu_remote ? "cuda:0" : "cpu:0", KVB_ACCESS_RW))) {
        fprintf(stderr, "bench target: buffer of %llu bytes: %s\n", (unsigned long long)o->buffer,
                buf             ? kvb_strerror(rc)
                : o->gpu_remote ? "no GPU memory"
                                : strerror(errno));
        kvb_engine_destroy(e);
        return 1;
    }
    if (fill_buffer(buf, o->buffer, o->seed, o->gpu_remote)) { /* what READs must bring back */
        kvb_engine_destroy(e);
        target_buffer_free(o, buf);
        return 1;
    }
    if (report_fd >= 0) {
        dprintf(report_fd, "%s\n", kvb_engine_segment_name(e));
        close(report_fd);
    } else {
        printf("target ready: segment %s, buffer %llu bytes (stop with Ctrl-C)\n",
               kvb_engine_segment_name(e), (unsigned long long)o->buffer);
        fflush(stdout);
    }
    while (!g_stop) {
        kvb_notification_t *n = malloc(sizeof *n);
        if (n && kvb_notify_recv(e, n, 100) == KVB_OK)
            answer_verify(e, n, buf, o->buffer, o->gpu_remote);
        free(n);
        if (parent_fd >= 0) {
            struct pollfd p = {.fd = parent_fd, .events = POLLIN};
            if (poll(&p, 1, 0) > 0)
                break; /* EOF: the parent closed its end or died */
        }
    }
    kvb_engine_destroy(e);
    target_buffer_free(o, buf);
    return 0;
}

/* ---- initiator
 * ----------------------------------------------------------------------------------- */

static void record_latency(worker_t *w, double us)
{
    if (w->nlat == w->cap_lat) {
        size_t ncap = w->cap_lat ? w->cap_lat * 2 : 4096;
        double *n = realloc(w->lat_us, ncap * sizeof *n);
        if (!n)
            return;
        w->lat_us = n;
        w->cap_lat = ncap;
    }
    w->lat_us[w->nlat++] = us;
}

static void *worker_main(void *arg)
{
    worker_t *w = arg;
    bench_opts_t *o = w->o;
    uint64_t nblocks = w->area_len / o->block, cursor = 0;
    kvb_request_t *reqs = calloc(o->batch, sizeof *reqs);
    uint8_t *copy = NULL; /* --gpu-local --verify: a block brought back to look at */
    if (!reqs)
        return NULL;
    while (kvb__now_ns() < w->deadline && !g_stop) {
        for (uint64_t i = 0; i < o->batch; i++) {
            uint64_t off = w->area_off + (cursor++ % nblocks) * o->block;
            reqs[i] = (kvb_request_t){.opcode = o->write ? KVB_OP_WRITE : KVB_OP_READ,
                                      .local = w->local + off,
                                      .segment = w->seg,
                                      .remote = w->remote_base + off,
                                      .len = o->block};
            if (o->verify && !o->write) { /* poison, so a READ that did not land shows */
                if (!o->gpu_local)
                    memset(w->local + off, 0xA5, o->block);
                else if (kvb_bench_gpu_fill(w->local + off, 0xA5, o->block))
                    w->mismatches++;
            }
        }
        uint64_t t0 = kvb__now_ns();
        kvb_batch_t *b;
        int rc = kvb_batch_submit(w->engine, reqs, o->batch, NULL, &b);
        if (rc == KVB_OK) {
            rc = kvb_batch_wait(b, -1);
            record_latency(w, (double)(kvb__now_ns() - t0) / 1e3);
            if (rc == KVB_OK) { /* every request COMPLETED: no need to ask each */
                w->bytes += o->batch * o->block;
                atomic_fetch_add_explicit(&g_progress_bytes, o->batch * o->block,
                                          memory_order_relaxed);
                w->reqs += o->batch;
            }
            for (uint64_t i = 0; rc != KVB_OK && i < o->batch; i++) {
                kvb_req_status_t st;
                kvb_batch_status(b, i, &st);
                if (st.state == KVB_REQ_COMPLETED) {
                    w->bytes += o->block;
                    atomic_fetch_add_explicit(&g_progress_bytes, o->block, memory_order_relaxed);
                    w->reqs++;
                } else {
                    w->errors++;
                    if (!w->first_error)
                        w->first_error = st.error;
                }
            }
            kvb_batch_free(b);
        } else {
            w->errors += o->batch;
            if (!w->first_error)
                w->first_error = rc;
        }
        if (rc != KVB_OK)
            break;
        if (o->verify && !o->write)
            for (uint64_t i = 0; i < o->batch; i++) {
                uint64_t off = (uint64_t)((uint8_t *)reqs[i].local - w->local);
                const uint8_t *got = w->local + off;
                if (o->gpu_local) { /* device memory: look at it through a host copy */
                    if (!copy && !(copy = malloc(o->block))) {
                        w->mismatches++;
                        continue;
                    }
                    if (kvb_bench_gpu_download(copy, got, o->block)) {
                        w->mismatches++;
                        continue;
                    }
                    got = copy;
                }
                if (memcmp(got, w->expect + off, o->block) != 0)
                    w->mismatches++;
            }
    }
    uint64_t covered = (cursor < nblocks ? cursor : nblocks) * o->block;
    w->covered = covered > w->covered ? covered : w->covered; /* a run in windows: the most */
    free(copy);
    free(reqs);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Asks the target to check what each worker wrote; returns the number of bad areas. */
static int verify_writes(kvb_engine_t *e, kvb_segment_t seg, worker_t *w, uint64_t n, uint64_t seed)
{
    int bad = 0;
    for (uint64_t t = 0; t < n; t++) {
        char msg[96];
        snprintf(msg, sizeof msg, "verify %llu %llu %llu", (unsigned long long)seed,
                 (unsigned long long)w[t].area_off, (unsigned long long)w[t].covered);
        kvb_notification_t *reply = malloc(sizeof *reply);
        int rc = reply ? kvb_notify_send(e, seg, msg, strlen(msg), 5000) : KVB_ERR_NOMEM;
        if (rc == KVB_OK)
            rc = kvb_notify_recv(e, reply, 30000);
        if (rc != KVB_OK || reply->len < 11 || memcmp(reply->data, "verified ok", 11) != 0) {
            fprintf(stderr, "bench: write verification of thread %llu failed: %.*s\n",
                    (unsigned long long)t, rc ? 20 : (int)reply->len,
                    rc ? kvb_strerror(rc) : (const char *)reply->data);
            bad++;
        }
        free(reply);
    }
    return bad;
}

static void report(const bench_opts_t *o, worker_t *w, double secs, int verified)
{
    uint64_t bytes = 0, reqs = 0, errors = 0;
    size_t nlat = 0;
    int first_error = 0;
    for (uint64_t t = 0; t < o->threads; t++) {
        bytes += w[t].bytes;
        reqs += w[t].reqs;
        errors += w[t].errors;
        nlat += w[t].nlat;
        if (!first_error)
            first_error = w[t].first_error;
    }
    double *lat = calloc(nlat ? nlat : 1, sizeof *lat);
    size_t k = 0;
    for (uint64_t t = 0; t < o->threads && lat; t++)
        for (size_t i = 0; i < w[t].nlat; i++)
            lat[k++] = w[t].lat_us[i];
    if (lat)
        qsort(lat, k, sizeof *lat, cmp_double);
    double p50 = k ? lat[(k - 1) / 2] : 0, p99 = k ? lat[(size_t)((double)(k - 1) * 0.99)] : 0;
    free(lat);
    double gbps = secs > 0 ? (double)bytes / secs / 1e9 : 0;
    const char *op = o->write ? "write" : "read";
    printf("kvbridge bench: %s %s, block %llu B, batch %llu, %llu thread(s), %.2f s\n"
           "  %.3f GB/s, %.0f requests/s, %llu bytes, batch latency p50 %.1f us p99 %.1f us\n"
           "  errors %llu%s%s, verified %s\n",
           op, o->path, (unsigned long long)o->block, (unsigned long long)o->batch,
           (unsigned long long)o->threads, secs, gbps, secs > 0 ? (double)reqs / secs : 0,
           (unsigned long long)bytes, p50, p99, (unsigned long long)errors,
           first_error ? " (first: " : "", first_error ? kvb_strerror(first_error) : "",
           verified < 0 ? "n/a"
           : verified   ? "yes"
                        : "NO");
    if (first_error)
        printf(")\n");
    printf("  metadata %s: segment %s opened in %.1f ms\n", o->metadata ? o->metadata : "p2p",
           o->segment, o->open_ms);
    if (o->fabric_in_use[0])
        printf("  fabric path on libfabric provider %s\n", o->fabric_in_use);
    if (!strcmp(o->path, "tcp"))
        printf("  TCP congestion control %s\n", o->congestion);
    if (o->busy_poll_us)
        printf("  busy polling %u us\n", o->busy_poll_us);
    printf("  progress threads linger %u us after requests\n", o->linger_us);
    if (o->cpus[0])
        printf("  engines' data threads on CPUs %s\n", o->cpus);
    if (o->ceiling_gbps > 0) {
        uint64_t llc = kvb__llc_size();
        double ratio = o->pair_ratio > 0 ? o->pair_ratio : gbps / o->ceiling_gbps;
        char cache[48] = "unknown";
        if (llc)
            snprintf(cache, sizeof cache, "%llu KiB", (unsigned long long)(llc >> 10));
        printf("  ceiling %.3f GB/s (%s), ratio %.3f; working set %llu MiB per side, last-level "
               "cache %s\n",
               o->ceiling_gbps, o->ceiling_method, ratio, (unsigned long long)(o->area_bytes >> 20),
               cache);
        if (o->pair_ratio > 0)
            printf("  in %llu interleaved pairs of %.2f s windows (the run's, then its ceiling's, "
                   "after one of each not counted): the run's median %.3f GB/s, the ceiling's "
                   "median above, the ratio the median of the pairs' (%.3f-%.3f)\n",
                   (unsigned long long)o->reps, o->window_s, o->pair_gbps, o->pair_lo, o->pair_hi);
        if (o->rpc_gbps > 0)
            printf("  the same batches without kvbridge (%s): %.3f GB/s, %.3f of the ceiling; the "
                   "run %.3f of it (medians over the pairs, each pair's third window)\n",
                   o->rpc_method, o->rpc_gbps, o->rpc_ratio, o->vs_rpc);
        if (ratio > 1.0)
            printf("  WARNING: above the ceiling - the ceiling does not measure what this run "
                   "did; do not believe the ratio\n");
    }
    bool gpu = o->gpu_local || o->gpu_remote;
    /* Through CUDA IPC the copy engine moves device to device: that is the ceiling. Staged
     * paths are bound by the network; the copies in and out are shown beside them. */
    double ceiling = !strcmp(o->path, "cuda") ? o->gpu_d2d : 0;
    if (gpu)
        printf("  GPU memory (%s%s): cuMemcpyAsync ceilings at this block and batch size: d2h "
               "%.3f, h2d %.3f, "
               "d2d %.3f GB/s%s",
               o->gpu_local ? "local" : "",
               o->gpu_local && o->gpu_remote ? " and remote"
               : o->gpu_remote               ? "remote"
                                             : "",
               o->gpu_d2h, o->gpu_h2d, o->gpu_d2d, ceiling > 0 ? "" : "\n");
    if (gpu && ceiling > 0)
        printf("; ratio to d2d %.2f\n", gbps / ceiling);
    if (o->json) {
        json_t *j = json_pack(
            "{s:s, s:s, s:I, s:I, s:I, s:f, s:I, s:f, s:f, s:f, s:f, s:I, s:o}", "operation", op,
            "protocol", o->path, "block_size", (json_int_t)o->block, "batch_size",
            (json_int_t)o->batch, "threads", (json_int_t)o->threads, "duration_s", secs, "bytes",
            (json_int_t)bytes, "gbps", gbps, "ops_per_s", secs > 0 ? (double)reqs / secs : 0.0,
            "lat_p50_us", p50, "lat_p99_us", p99, "errors", (json_int_t)errors, "verified",
            verified < 0 ? json_null() : json_boolean(verified));
        json_object_set_new(j, "metadata", json_string(o->metadata ? o->metadata : "p2p"));
        json_object_set_new(j, "open_ms", json_real(o->open_ms));
        if (o->fabric_in_use[0])
            json_object_set_new(j, "fabric_provider", json_string(o->fabric_in_use));
        json_object_set_new(j, "tcp_congestion", json_string(o->congestion));
        json_object_set_new(j, "busy_poll_us", json_integer(o->busy_poll_us));
        json_object_set_new(j, "linger_us", json_integer(o->linger_us));
        json_object_set_new(j, "cpus", json_string(o->cpus));
        if (o->ceiling_gbps > 0) {
            json_object_set_new(j, "ceiling_gbps", json_real(o->ceiling_gbps));
            json_object_set_new(j, "ceiling_method", json_string(o->ceiling_method));
            json_object_set_new(
                j, "ratio", json_real(o->pair_ratio > 0 ? o->pair_ratio : gbps / o->ceiling_gbps));
        }
        if (o->pair_ratio > 0) {
            json_object_set_new(j, "pairs", json_integer((json_int_t)o->reps));
            json_object_set_new(j, "window_s", json_real(o->window_s));
            json_object_set_new(j, "pair_gbps", json_real(o->pair_gbps));
            json_object_set_new(j, "ratio_min", json_real(o->pair_lo));
            json_object_set_new(j, "ratio_max", json_real(o->pair_hi));
        }
        if (o->rpc_gbps > 0) {
            json_object_set_new(j, "rpc_gbps", json_real(o->rpc_gbps));
            json_object_set_new(j, "rpc_ratio", json_real(o->rpc_ratio));
            json_object_set_new(j, "vs_rpc", json_real(o->vs_rpc));
            json_object_set_new(j, "rpc_method", json_string(o->rpc_method));
        }
        if (gpu) {
            json_object_set_new(j, "gpu_local", json_boolean(o->gpu_local));
            json_object_set_new(j, "gpu_remote", json_boolean(o->gpu_remote));
            json_object_set_new(j, "ceiling_d2h_gbps", json_real(o->gpu_d2h));
            json_object_set_new(j, "ceiling_h2d_gbps", json_real(o->gpu_h2d));
            json_object_set_new(j, "ceiling_d2d_gbps", json_real(o->gpu_d2d));
        }
        char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
    }
    fflush(stdout);
}

/* The copy path's threads: the target's thread running a peer's copies plus its copy pool (the
 * engine's default copy_threads, 1). */
#define COPY_THREADS 2

/* The copy ceiling's session over the blocks at off[0..n) (the same offsets on both sides, as the
 * run's): between the run's own buffers where this process can reach the target's (a loopback
 * target's memfd, o->target_fd) - the same pages in the same places, which moved a plain copy by
 * 10-25% here (kvb_ceiling_open_on) - else between buffers of its own. Not with --verify: the
 * ceiling's copies would put in place the very bytes that a READ or WRITE which did not land
 * should have, and the check could not see it. *peer: the target's buffer mapped here, to unmap
 * (o->buffer bytes) after the session is closed, or NULL. */
static int copy_ceiling_open(const bench_opts_t *o, uint8_t *local, uint64_t size,
                             const uint64_t *off, size_t n, kvb_ceiling_session_t **cs,
                             uint8_t **peer)
{
    *peer = NULL;
    if (o->target_fd >= 0 && !o->verify && local && size <= o->buffer) {
        uint8_t *m = kvb_cli_map_memfd(o->target_fd, o->buffer, o->write); /* WRITE copies in */
        if (m) {
            *peer = m;
            return kvb_ceiling_open_on(o->write ? local : m, o->write ? m : local, size, o->block,
                                       off, off, n, COPY_THREADS, cs);
        }
        fprintf(stderr, "bench: the target's buffer: %s; the copy ceiling uses its own\n",
                strerror(errno));
    }
    return kvb_ceiling_open("copy", size, o->block, off, off, n, COPY_THREADS, cs);
}

/* A ceiling session for a run over `path` ("tcp": a raw stream over the run's lanes; else the copy
 * ceiling, copy_ceiling_open) on every block of its first `size` bytes, in order. Close it with
 * path_ceiling_close. */
typedef struct {
    kvb_ceiling_session_t *cs;
    uint64_t *off;
    uint8_t *peer; /* the target's buffer, mapped for the copy ceiling */
} path_ceiling_t;

static int path_ceiling_open(const bench_opts_t *o, const char *path, uint8_t *local, uint64_t size,
                             path_ceiling_t *pc)
{
    *pc = (path_ceiling_t){0};
    size_t n = (size_t)(size / o->block);
    if (n == 0 || !(pc->off = malloc(n * sizeof *pc->off)))
        return -1;
    for (size_t i = 0; i < n; i++)
        pc->off[i] = (uint64_t)i * o->block;
    if (!strcmp(path, "tcp"))
        return kvb_ceiling_open("tcp", size, o->block, pc->off, pc->off, n, (int)o->lanes, &pc->cs);
    return copy_ceiling_open(o, local, size, pc->off, n, &pc->cs, &pc->peer);
}

static void path_ceiling_close(const bench_opts_t *o, path_ceiling_t *pc)
{
    kvb_ceiling_close(pc->cs);
    if (pc->peer)
        munmap(pc->peer, o->buffer);
    free(pc->off);
    *pc = (path_ceiling_t){0};
}

/* The ceiling of the path a run took, on its working set (block, buffer, connections), over
 * about `secs` seconds: the best of 6 windows for TCP (each of its three syscall sizes twice), of
 * 4 runs for the copy - between the run's buffers where it can (`local`, the initiator's; see
 * copy_ceiling_open). */
static int measure_ceiling(const bench_opts_t *o, const char *path, uint64_t buffer, double secs,
                           uint8_t *local, kvb_ceiling_t *c)
{
    int runs = !strcmp(path, "tcp") ? 6 : 4;
    double each = secs / runs > 0.2 ? secs / runs : 0.2;
    path_ceiling_t pc;
    int rc = path_ceiling_open(o, path, local, buffer, &pc);
    if (rc == 0)
        rc = kvb_ceiling_measure(pc.cs, each, runs, c);
    else
        memset(c, 0, sizeof *c);
    path_ceiling_close(o, &pc);
    return rc;
}

/* Runs the workers until `deadline`: the run, or one window of it. With `tty`, a long run shows
 * how it goes, once a second, on stderr. */
static void run_window(const bench_opts_t *o, worker_t *w, pthread_t *tids, uint64_t deadline,
                       bool tty)
{
    for (uint64_t t = 0; t < o->threads; t++) {
        w[t].deadline = deadline;
        pthread_create(&tids[t], NULL, worker_main, &w[t]);
    }
    for (uint64_t s = 1; tty && s < o->duration && !g_stop; s++) {
        struct timespec one = {.tv_sec = 1};
        nanosleep(&one, NULL);
        double gb = (double)atomic_load(&g_progress_bytes) / 1e9;
        fprintf(stderr, "\r  %llu/%llu s  %.2f GB  %.3f GB/s ", (unsigned long long)s,
                (unsigned long long)o->duration, gb, gb / (double)s);
    }
    for (uint64_t t = 0; t < o->threads; t++)
        pthread_join(tids[t], NULL);
    if (tty)
        fprintf(stderr, "\r%60s\r", "");
}

static uint64_t bytes_moved(const worker_t *w, uint64_t n)
{
    uint64_t bytes = 0;
    for (uint64_t t = 0; t < n; t++)
        bytes += w[t].bytes;
    return bytes;
}

static double median_of(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* One window of the request/response reference into *gbps (if given): the reference, or NULL
 * (closed) if it failed. */
static kvb_rpcref_t *rpc_window(kvb_rpcref_t *rs, double secs, double *gbps)
{
    double g = rs ? kvb_rpcref_measure(rs, secs) : 0;
    if (rs && g <= 0) {
        fprintf(stderr, "bench: the request/response reference failed; going on without it\n");
        kvb_rpcref_close(rs);
        return NULL;
    }
    if (gbps)
        *gbps = g;
    return rs;
}

/* --ceiling --reps N: the run in N windows of --duration / N seconds, each followed at once by a
 * window of its ceiling as long (the same working set, set up once), after one of each not
 * counted; the ratio is the median of the pairs'. On the 2-CPU VMs measured the copy bandwidth
 * flips between two levels (about 22 and 29 GB/s) and stays at one for a few seconds: a 2 s run
 * and a 2 s ceiling run seconds apart straddled a flip often enough that pair ratios spread over
 * 0.69-0.94 (docs/performance-notes.md, "Pairs a second apart"). Over TCP with one submitting
 * thread a third window follows, half as long (make bench stays within 10 minutes): the same
 * batches through a raw request/response program (kvb_rpcref_open), what one batch at a time
 * costs the stream without kvbridge - a reference beside the ratio, so a failure of it ends it,
 * not the run. Returns the seconds the counted windows took, 0 if the ceiling could not be
 * measured. */
static double measure_pairs(bench_opts_t *o, worker_t *w, pthread_t *tids, uint64_t size)
{
    bool tcp = !strcmp(o->path, "tcp");
    size_t reps = (size_t)o->reps, done = 0;
    /* TCP: each syscall size once, then all but one window in the best (ceiling.c, plan_sizes);
     * copies: placed, then unbound */
    int runs = tcp ? 3 : 2;
    double win = (double)o->duration / (double)reps, secs = 0;
    uint64_t win_ns = (uint64_t)(win * 1e9);
    /* per pair: the run, the ceiling, their ratio; the raw batches, theirs to the ceiling, the
     * run's to them */
    double *k = calloc(6 * reps, sizeof *k), *c = k + reps, *r = c + reps, *p = r + reps,
           *pc = p + reps, *kp = pc + reps;
    path_ceiling_t pcs = {0};
    kvb_rpcref_t *rs = NULL;
    kvb_ceiling_t cl;
    if (!k || path_ceiling_open(o, o->path, w[0].local, size, &pcs))
        goto out;
    if (tcp && o->threads == 1 &&
        kvb_rpcref_open(o->write, size, o->block * o->batch, (int)o->lanes, &rs))
        fprintf(stderr, "bench: going on without the request/response reference\n");
    run_window(o, w, tids, kvb__now_ns() + win_ns, false); /* warm, like the ceiling's pass */
    for (uint64_t t = 0; t < o->threads; t++) {
        w[t].bytes = w[t].reqs = 0;
        w[t].nlat = 0;
    }
    if (kvb_ceiling_measure(pcs.cs, win / runs, runs, &cl))
        goto out;
    rs = rpc_window(rs, win / 2, NULL);
    for (; done < reps && !g_stop; done++) {
        uint64_t before = bytes_moved(w, o->threads), t0 = kvb__now_ns();
        run_window(o, w, tids, t0 + win_ns, false);
        double s = (double)(kvb__now_ns() - t0) / 1e9;
        if (kvb_ceiling_measure(pcs.cs, win / runs, runs, &cl))
            goto out;
        rs = rpc_window(rs, win / 2, &p[done]);
        secs += s;
        k[done] = (double)(bytes_moved(w, o->threads) - before) / s / 1e9;
        c[done] = cl.gbps;
        r[done] = k[done] / c[done];
        pc[done] = rs ? p[done] / c[done] : 0;
        kp[done] = rs ? k[done] / p[done] : 0;
    }
    if (done == 0)
        goto out;
    o->reps = done;
    o->window_s = win;
    o->pair_gbps = median_of(k, done);
    o->ceiling_gbps = median_of(c, done);
    o->pair_ratio = median_of(r, done); /* sorted now: the range is at its ends */
    o->pair_lo = r[0];
    o->pair_hi = r[done - 1];
    snprintf(o->ceiling_method, sizeof o->ceiling_method, "%s", cl.method);
    if (rs) {
        o->rpc_gbps = median_of(p, done);
        o->rpc_ratio = median_of(pc, done);
        o->vs_rpc = median_of(kp, done);
        kvb_rpcref_method(rs, o->rpc_method, sizeof o->rpc_method);
    }
out:
    if (o->pair_ratio == 0) {
        fprintf(stderr, "bench: %s\n",
                g_stop ? "interrupted" : "the ceiling could not be measured in turn with the run");
        secs = 0;
    }
    kvb_rpcref_close(rs);
    path_ceiling_close(o, &pcs);
    free(k);
    return secs;
}

static int run_initiator(bench_opts_t *o)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.bind_addr = o->bind;
    cfg.insecure = o->insecure;
    cfg.protocol = o->protocol;
    cfg.fabric_provider = o->fabric_provider;
    cfg.lanes = (int)o->lanes;
    if (o->progress) /* else the engine's default (kvb_config_init) */
        cfg.progress_threads = (int)o->progress;
    cfg.metadata = o->metadata;
    cfg.cluster = o->cluster;
    kvb_engine_t *e;
    int rc = kvb_engine_create(&cfg, &e), status = 1;
    if (rc) {
        fprintf(stderr, "bench: engine: %s\n", kvb_strerror(rc));
        return 1;
    }
    kvb_segment_t seg;
    kvb_region_info_t region;
    size_t nregions = 0;
    uint8_t *local = NULL, *expect = NULL;
    worker_t *w = calloc(o->threads, sizeof *w);
    pthread_t *tids = calloc(o->threads, sizeof *tids);
    uint64_t t_open = kvb__now_ns();
    if ((rc = kvb_segment_open(e, o->segment, &seg))) {
        fprintf(stderr, "bench: cannot open segment %s: %s\n", o->segment, kvb_strerror(rc));
        goto out;
    }
    o->open_ms = (double)(kvb__now_ns() - t_open) / 1e6;
    kvb_segment_transport(e, seg, &o->path);
    /* A ceiling is measured here for the TCP lanes (a raw stream) and same-host copies (the best
     * plain copy); a libfabric path's is its provider's own loop (build/fabric_loop), and device
     * memory's the cuMemcpy ceilings printed with --gpu. */
    if (o->ceiling && !o->gpu_local && !o->gpu_remote && strcmp(o->path, "tcp") &&
        strcmp(o->path, "shm")) {
        fprintf(stderr,
                "bench: --ceiling: no ceiling is measured here for the %s path (fabric: "
                "build/fabric_loop); the run goes on without a ratio\n",
                o->path);
        o->ceiling = false;
    }
    snprintf(o->fabric_in_use, sizeof o->fabric_in_use, "%s", kvb_engine_fabric_provider(e));
    snprintf(o->congestion, sizeof o->congestion, "%s", kvb_engine_tcp_congestion(e));
    o->busy_poll_us = kvb_engine_busy_poll_us(e);
    o->linger_us = kvb_engine_linger_us(e);
    snprintf(o->cpus, sizeof o->cpus, "%s", kvb_engine_cpus(e));
    if ((rc = kvb_segment_regions(e, seg, 0, &region, 1, &nregions)) || nregions == 0) {
        fprintf(stderr, "bench: segment %s has no registered memory\n", o->segment);
        goto out;
    }
    uint64_t size = region.len < o->buffer ? region.len : o->buffer;
    uint64_t area = size / o->threads / o->block * o->block;
    o->area_bytes = size;
    if (area == 0) {
        fprintf(stderr, "bench: buffer of %llu bytes cannot hold a %llu-byte block per thread\n",
                (unsigned long long)size, (unsigned long long)o->block);
        goto out;
    }
    local = engine_buffer(e, o, size, o->gpu_local);
    if (!w || !tids || !local ||
        (rc = kvb_register(e, local, size, o->gpu_local ? "cuda:0" : "cpu:0", KVB_ACCESS_RW))) {
        fprintf(stderr, "bench: local buffer: %s\n", rc ? kvb_strerror(rc) : "out of memory");
        goto out;
    }
    uint64_t wseed = o->seed ^ 0x5752495445ull; /* "WRITE": distinct from the target's fill */
    if (o->write && fill_buffer(local, size, wseed, o->gpu_local))
        goto out;
    if (o->verify && !o->write) {
        expect = alloc_buffer(size);
        if (!expect)
            goto out;
        fill_pattern(expect, size, o->seed);
    }
    bool pairs = o->ceiling && o->reps > 1;
    for (uint64_t t = 0; t < o->threads; t++)
        w[t] = (worker_t){.o = o,
                          .engine = e,
                          .seg = seg,
                          .local = local,
                          .expect = expect,
                          .remote_base = region.addr,
                          .area_off = t * area,
                          .area_len = area};
    double secs;
    if (pairs) {
        if ((secs = measure_pairs(o, w, tids, size)) <= 0)
            goto out;
    } else {
        uint64_t t0 = kvb__now_ns();
        run_window(o, w, tids, t0 + o->duration * 1000000000ull,
                   isatty(STDERR_FILENO) && o->duration >= 3);
        secs = (double)(kvb__now_ns() - t0) / 1e9;
    }
    int verified = -1;
    uint64_t errors = 0, mismatches = 0;
    for (uint64_t t = 0; t < o->threads; t++) {
        errors += w[t].errors;
        mismatches += w[t].mismatches;
    }
    if (o->verify) {
        verified = mismatches == 0 && errors == 0;
        if (mismatches)
            fprintf(stderr, "bench: %llu READ blocks differ from the target's pattern\n",
                    (unsigned long long)mismatches);
        if (o->write && verify_writes(e, seg, w, o->threads, wseed))
            verified = 0;
    }
    /* The path the bytes took (device memory may take another than host memory would). */
    kvb_stats_t st;
    if (kvb_engine_stats(e, &st) == KVB_OK) {
        static char used[sizeof st.paths[0].name];
        uint64_t most = 0;
        for (size_t i = 0; i < st.npaths; i++)
            if (st.paths[i].bytes > most) {
                most = st.paths[i].bytes;
                snprintf(used, sizeof used, "%s", st.paths[i].name);
                o->path = used;
            }
    }
    if (o->ceiling && !pairs && !o->gpu_local && !o->gpu_remote) {
        kvb_ceiling_t c;
        if (measure_ceiling(o, o->path, size, 4.0, local, &c) == 0) {
            o->ceiling_gbps = c.gbps;
            snprintf(o->ceiling_method, sizeof o->ceiling_method, "%s", c.method);
        }
    }
    if (o->gpu_local || o->gpu_remote) { /* the ceilings, on the same block size */
        o->gpu_d2h = kvb_bench_gpu_ceiling("d2h", o->block, o->batch * o->threads, 1);
        o->gpu_h2d = kvb_bench_gpu_ceiling("h2d", o->block, o->batch * o->threads, 1);
        o->gpu_d2d = kvb_bench_gpu_ceiling("d2d", o->block, o->batch * o->threads, 1);
    }
    report(o, w, secs, verified);
    status = errors == 0 && verified != 0 ? 0 : 1;
out:
    for (uint64_t t = 0; w && t < o->threads; t++)
        free(w[t].lat_us);
    free(w);
    free(tids);
    kvb_engine_destroy(e);
    engine_buffer_free(o, local, size, o->gpu_local);
    if (expect)
        munmap(expect, size);
    return status;
}

/* ---- latency: small READ round trips beside a raw socket ping-pong ----------------------------
 */

/* Latency on a 2-core VM is mostly where the scheduler puts the two ends: the same core is
 * several times faster than two. Both pairs get the same placement - client on CPU 0, server on
 * CPU 1 (all on CPU 0 with one core) - so the comparison is fair and repeatable. */
static void pin_to(int cpu)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(n > 1 ? cpu : 0, &set);
    sched_setaffinity(0, sizeof set, &set);
}

/* Receives exactly len bytes. With spin_ns, polls the socket without sleeping until that long
 * passes with nothing read, as an engine's threads do (a waiting thread with busy polling,
 * cfg.busy_poll_us; a progress thread after requests, cfg.linger_us), so that the ping-pong
 * measures what a round trip costs with the same wakes skipped. */
static bool recv_all(int fd, uint8_t *b, uint64_t len, uint64_t spin_ns)
{
    uint64_t got = 0, busy_at = kvb__now_ns();
    while (got < len) {
        bool spin = spin_ns && kvb__now_ns() - busy_at < spin_ns;
        ssize_t r = recv(fd, b + got, len - got, spin ? MSG_DONTWAIT : MSG_WAITALL);
        if (r > 0) {
            got += (uint64_t)r;
            busy_at = kvb__now_ns();
        } else if (r == 0 || !spin || (errno != EAGAIN && errno != EINTR)) {
            return false;
        }
    }
    return true;
}

/* A child that echoes `len`-byte messages, polling spin_ns for the next after each as a target's
 * progress thread does (cfg.linger_us); returns the client fd. The socket is the kind the
 * measured requests ride: a Unix socket (local) for same-host peers, whose lanes are Unix sockets,
 * else loopback TCP. */
static int start_echo(uint64_t len, bool local, uint64_t spin_ns, pid_t *pid)
{
    int lfd = -1, sv[2] = {-1, -1}, one = 1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (local ? socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)
              : (lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
                    bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 1) ||
                    getsockname(lfd, (struct sockaddr *)&sa, &sl))
        return -1;
    fflush(stdout);
    *pid = fork();
    if (*pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        pin_to(1);
        int fd = local ? sv[1] : accept(lfd, NULL, NULL);
        uint8_t *b = malloc(len);
        if (!local)
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        while (b && recv_all(fd, b, len, spin_ns))
            if (send(fd, b, len, MSG_NOSIGNAL) != (ssize_t)len)
                break;
        _exit(0);
    }
    if (local) {
        close(sv[1]);
        return sv[0];
    }
    close(lfd);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa))
        return -1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static double pct(double *v, size_t n, double q)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n ? v[(size_t)((double)(n - 1) * q)] : 0;
}

/* Interleaves rounds of kvbridge READs (one request per batch) and raw ping-pongs, so both see
 * the same machine noise. */
static int run_latency(bench_opts_t *o)
{
    pin_to(0); /* before the engine: its threads inherit it */
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = o->protocol;
    cfg.fabric_provider = o->fabric_provider;
    cfg.metadata = o->metadata;
    cfg.cluster = o->cluster;
    kvb_engine_t *e;
    kvb_segment_t seg;
    kvb_region_info_t region;
    size_t nreg = 0;
    if (kvb_engine_create(&cfg, &e))
        return 1;
    int rc = kvb_segment_open(e, o->segment, &seg);
    if (!rc)
        rc = kvb_segment_regions(e, seg, 0, &region, 1, &nreg);
    kvb_segment_transport(e, seg, &o->path);
    uint8_t *local = rc ? NULL : engine_buffer(e, o, o->block, false);
    pid_t echo = -1;
    bool unix_lanes = !strcmp(o->path, "shm"); /* a same-host peer's lanes are Unix sockets */
    o->busy_poll_us = kvb_engine_busy_poll_us(e);
    o->linger_us = kvb_engine_linger_us(e); /* the target's, from the same defaults */
    uint64_t spin_ns = (uint64_t)o->busy_poll_us * 1000;
    int fd = local ? start_echo(o->block, unix_lanes, (uint64_t)o->linger_us * 1000, &echo) : -1;
    enum { ROUNDS = 20, PER = 250 };
    double *kl = calloc(ROUNDS * PER, sizeof *kl), *rl = calloc(ROUNDS * PER, sizeof *rl);
    size_t nk = 0, nr = 0;
    if (fd < 0 || !kl || !rl || !nreg || kvb_register(e, local, o->block, NULL, KVB_ACCESS_RW)) {
        fprintf(stderr, "bench --latency: setup failed\n");
        rc = 1;
    }
    kvb_request_t r = {KVB_OP_READ, local, seg, region.addr, o->block};
    for (int round = -1; !rc && round < ROUNDS; round++) { /* round -1 warms up */
        for (int i = 0; i < PER && !rc; i++) {
            uint64_t t0 = kvb__now_ns();
            kvb_batch_t *b;
            rc = kvb_batch_submit(e, &r, 1, NULL, &b);
            if (!rc) {
                rc = kvb_batch_wait(b, -1);
                kvb_batch_free(b);
            }
            if (round >= 0)
                kl[nk++] = (double)(kvb__now_ns() - t0) / 1e3;
        }
        for (int i = 0; i < PER && !rc; i++) {
            uint64_t t0 = kvb__now_ns();
            if (send(fd, local, o->block, MSG_NOSIGNAL) != (ssize_t)o->block ||
                !recv_all(fd, local, o->block, spin_ns))
                rc = 1;
            if (round >= 0)
                rl[nr++] = (double)(kvb__now_ns() - t0) / 1e3;
        }
    }
    if (!rc) {
        double k50 = pct(kl, nk, 0.5), k99 = pct(kl, nk, 0.99);
        double r50 = pct(rl, nr, 0.5), r99 = pct(rl, nr, 0.99);
        char spun[96];
        snprintf(spun, sizeof spun, " (the echo lingering %u us%s)", o->linger_us,
                 o->busy_poll_us ? ", both busy-polling" : "");
        printf("kvbridge bench --latency: %llu-byte READ round trip over %s: p50 %.1f us, p99 "
               "%.1f us\n  raw %s ping-pong: p50 %.1f us, p99 %.1f us; ratio p50 %.2f%s\n",
               (unsigned long long)o->block, o->path, k50, k99,
               unix_lanes ? "Unix-socket" : "TCP loopback", r50, r99, k50 / r50, spun);
        if (o->json)
            printf("{\"latency_block\":%llu,\"protocol\":\"%s\",\"lat_p50_us\":%.2f,"
                   "\"lat_p99_us\":%.2f,\"raw_socket\":\"%s\",\"raw_p50_us\":%.2f,"
                   "\"raw_p99_us\":%.2f,\"ratio_p50\":%.3f,\"busy_poll_us\":%u,"
                   "\"linger_us\":%u}\n",
                   (unsigned long long)o->block, o->path, k50, k99, unix_lanes ? "unix" : "tcp",
                   r50, r99, k50 / r50, o->busy_poll_us, o->linger_us);
    }
    if (fd >= 0)
        close(fd);
    if (echo > 0) {
        kill(echo, SIGKILL);
        waitpid(echo, NULL, 0);
    }
    free(kl);
    free(rl);
    kvb_engine_destroy(e);
    engine_buffer_free(o, local, o->block, false);
    return rc ? 1 : 0;
}

/* Starts a target in a child process on 127.0.0.1, runs the initiator against it, stops it. */
static int run_loopback(bench_opts_t *o)
{
    int name_pipe[2], life_pipe[2];
    char own_name[64];
    if (o->metadata && !o->name) { /* a name, not an address: the store must resolve it */
        snprintf(own_name, sizeof own_name, "kvbridge-bench-%d", (int)getpid());
        o->name = own_name;
    }
    if (pipe2(name_pipe, O_CLOEXEC) || pipe2(life_pipe, O_CLOEXEC)) {
        perror("bench: pipe");
        return 1;
    }
    /* A same-host run's target keeps its buffer in a memfd made here, so that the copy ceiling
     * can copy the run's own pages (copy_ceiling_open). Its pages are still allocated by the
     * target, when it populates them, as they would be with kvb_alloc. */
    if (strcmp(o->protocol, "tcp") != 0 && !o->gpu_remote && !o->latency) {
        o->target_fd = kvb_cli_memfd("kvbridge-bench-target", o->buffer);
        if (o->target_fd < 0)
            fprintf(stderr, "bench: a memfd for the target's buffer: %s; kvb_alloc then\n",
                    strerror(errno));
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        perror("bench: fork");
        if (o->target_fd >= 0)
            close(o->target_fd);
        return 1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(name_pipe[0]);
        close(life_pipe[1]);
        o->port = 0;
        if (o->latency)
            pin_to(1);
        _exit(run_target(o, name_pipe[1], life_pipe[0]));
    }
    close(name_pipe[1]);
    close(life_pipe[0]);
    char name[KVB_NAME_MAX + 2] = "";
    size_t got = 0;
    for (;;) {
        ssize_t n = read(name_pipe[0], name + got, sizeof name - 1 - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(name_pipe[0]);
    name[got] = '\0';
    char *nl = strchr(name, '\n');
    int status = 1;
    if (!nl) {
        fprintf(stderr, "bench: the loopback target did not start\n");
    } else {
        *nl = '\0';
        o->segment = name;
        status = o->latency ? run_latency(o) : run_initiator(o);
    }
    close(life_pipe[1]); /* tells the child to stop */
    bool gone = false;
    for (int i = 0; i < 100 && !gone; i++) {
        gone = waitpid(pid, NULL, WNOHANG) == pid;
        if (!gone)
            usleep(50000);
    }
    if (!gone) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    if (o->target_fd >= 0) /* the target's pages go with the last reference */
        close(o->target_fd);
    return status;
}

/* --baseline rpc: the request/response reference alone, after its warm pass. */
static int measure_rpc(const bench_opts_t *o, kvb_ceiling_t *c)
{
    kvb_rpcref_t *r;
    if (kvb_rpcref_open(o->write, o->buffer, o->block * o->batch, (int)o->lanes, &r))
        return -1;
    c->gbps = kvb_rpcref_measure(r, (double)o->duration);
    kvb_rpcref_method(r, c->method, sizeof c->method);
    kvb_rpcref_close(r);
    return c->gbps > 0 ? 0 : -1;
}

static int run_baseline(const bench_opts_t *o)
{
    kvb_ceiling_t c;
    bool tcp = !strcmp(o->baseline, "tcp"), rpc = !strcmp(o->baseline, "rpc");
    if ((tcp || rpc) && kvb_ceiling_net(o->bind, o->peer_netns))
        return 1;
    if (rpc ? measure_rpc(o, &c)
            : measure_ceiling(o, tcp ? "tcp" : "shm", o->buffer, (double)o->duration, NULL, &c))
        return 1;
    printf("baseline %s: block %llu B, buffer %llu B, %.3f GB/s (%s)\n", o->baseline,
           (unsigned long long)o->block, (unsigned long long)o->buffer, c.gbps, c.method);
    if (o->json) {
        json_t *j =
            json_pack("{s:s, s:I, s:I, s:I, s:f, s:s}", "baseline", o->baseline, "block_size",
                      (json_int_t)o->block, "batch_size", (json_int_t)o->batch, "buffer_size",
                      (json_int_t)o->buffer, "gbps", c.gbps, "method", c.method);
        char *js = j ? json_dumps(j, JSON_COMPACT) : NULL;
        printf("%s\n", js ? js : "{}");
        free(js);
        json_decref(j);
    }
    fflush(stdout);
    return 0;
}

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: kvbridge bench [options]\n"
        "  --mode target|initiator   serve memory, or drive transfers against --segment\n"
        "  --loopback                run a target in a child process on 127.0.0.1 and an\n"
        "                            initiator against it\n"
        "  --segment NAME            target segment for --mode initiator (host:port, or the\n"
        "                            name it published with --metadata)\n"
        "  --metadata URI            find segments through a store: etcd://h:p[,h:p...],\n"
        "                            redis://[:pw@]h:p[/db], http://h:p[/prefix] (default p2p)\n"
        "  --cluster NAME            key namespace in the store (default \"default\")\n"
        "  --name NAME               the target's segment name (default host:port)\n"
        "  --port P                  target port (default: any free port, printed)\n"
        "  --bind ADDR               address to bind (default 127.0.0.1)\n"
        "  --secret-file PATH        the cluster secret (both sides; also KVB_SECRET_FILE)\n"
        "  --insecure                allow a non-loopback --bind without a secret\n"
        "  --operation read|write    default read\n"
        "  --block-size N[K|M]       bytes per request (default 64K)\n"
        "  --batch-size N            requests per batch (default 128)\n"
        "  --threads N               submitting threads (default 1)\n"
        "  --duration S              seconds to run (default 5)\n"
        "  --buffer-size N[K|M|G]    registered buffer per side (default 256M)\n"
        "  --protocol P              data paths in the order tried: tcp (default), shm, a list\n"
        "                            such as shm,tcp, or auto (every path, best first);\n"
        "                            fabric: one-sided RDMA through libfabric\n"
        "  --fabric-provider NAME    libfabric provider of the fabric path: verbs;ofi_rxm,\n"
        "                            efa, cxi, or tcp;ofi_rxm / shm for testing (default:\n"
        "                            the first RDMA provider found; never a slower one)\n"
        "  --tcp-congestion NAME     TCP congestion control of the engines' connections and of\n"
        "                            the raw-stream ceilings (cubic, reno, bbr, ...; default\n"
        "                            KVB_TCP_CONGESTION, else the system's)\n"
        "  --busy-poll US            engines' busy polling in microseconds (0: off; default\n"
        "                            KVB_BUSY_POLL_US, else 0); --latency's raw ping-pong\n"
        "                            then polls as long\n"
        "  --linger US               how long the engines' progress threads poll for more\n"
        "                            requests after some came in, and for the rest of the\n"
        "                            answers owed over TCP (0: sleep at once; default\n"
        "                            KVB_LINGER_US, else 100); --latency's raw echo lingers\n"
        "                            as long\n"
        "  --cpus LIST               CPUs of both engines' data threads, such as 0,1 (progress\n"
        "                            threads, then copy threads, one CPU each in turn; \"\":\n"
        "                            unbound; default KVB_CPUS, else unbound); the copy\n"
        "                            ceiling's threads then run on the list's first CPUs. Over\n"
        "                            TCP both progress threads take the first: one core for\n"
        "                            both ends of the stream\n"
        "  --lanes N                 connections per peer (default 2)\n"
        "  --progress-threads N      engine progress threads (default: the engine's, one per\n"
        "                            lane with half the CPUs for them, 1 on two CPUs)\n"
        "  --verify                  seeded pattern; check every byte that arrives\n"
        "  --gpu                     buffers in GPU memory (CUDA device 0) on both sides;\n"
        "  --gpu-local, --gpu-remote   only the initiator's, or only the target's; prints\n"
        "                            cuMemcpy ceilings (d2h, h2d, d2d) measured after the run\n"
        "  --seed N                  pattern seed (default 42)\n"
        "  --json                    also print one JSON object as the last line\n"
        "  --ceiling                 after the run, measure the ceiling of the path it took on\n"
        "                            the same working set (--loopback over shm: a copy between\n"
        "                            the run's own buffers, unless --verify), and print the\n"
        "                            ratio to it; with --reps N (N > 1) in turn with the run\n"
        "                            instead: N windows of --duration / N seconds (at least\n"
        "                            0.5) each followed by one of the ceiling, the ratio the\n"
        "                            median of the pairs' (over TCP with one thread, then one\n"
        "                            of --baseline rpc half as long)\n"
        "  --baseline tcp|copy|rpc   measure the ceiling instead: a raw TCP stream over --lanes\n"
        "                            connections, or the best plain copy; same block size;\n"
        "                            rpc: the same batches, one at a time, through a raw\n"
        "                            request/response program over --lanes connections\n"
        "  --peer-netns NAME         --baseline tcp|rpc across namespaces: listen on --bind\n"
        "                            here, the sender (rpc: server) in network namespace NAME\n"
        "  --latency                 READ round trips (64 B unless --block-size) beside a raw\n"
        "                            ping-pong on the socket kind the lanes use (Unix for\n"
        "                            shm, else TCP), interleaved; p50/p99 of both\n"
        "  --kv MODEL --tokens N     KV-shaped pull of one prompt (llama3-8b, llama3-70b,\n"
        "                            deepseek-v3) through the KV layer; --reps N (default 5)\n");
}

enum { OPT_LINGER = 256 }; /* long options without a letter */

static int parse_args(int argc, char **argv, bench_opts_t *o)
{
    static const struct option longs[] = {{"mode", 1, 0, 'm'},
                                          {"segment", 1, 0, 's'},
                                          {"port", 1, 0, 'p'},
                                          {"operation", 1, 0, 'o'},
                                          {"block-size", 1, 0, 'b'},
                                          {"batch-size", 1, 0, 'B'},
                                          {"threads", 1, 0, 't'},
                                          {"duration", 1, 0, 'd'},
                                          {"buffer-size", 1, 0, 'z'},
                                          {"protocol", 1, 0, 'P'},
                                          {"fabric-provider", 1, 0, 'W'},
                                          {"tcp-congestion", 1, 0, 'Z'},
                                          {"busy-poll", 1, 0, 'U'},
                                          {"linger", 1, 0, OPT_LINGER},
                                          {"cpus", 1, 0, 'A'},
                                          {"verify", 0, 0, 'v'},
                                          {"loopback", 0, 0, 'l'},
                                          {"json", 0, 0, 'j'},
                                          {"seed", 1, 0, 'S'},
                                          {"bind", 1, 0, 'i'},
                                          {"lanes", 1, 0, 'L'},
                                          {"progress-threads", 1, 0, 'T'},
                                          {"help", 0, 0, 'h'},
                                          {"baseline", 1, 0, 'X'},
                                          {"peer-netns", 1, 0, 'Q'},
                                          {"latency", 0, 0, 'Y'},
                                          {"kv", 1, 0, 'K'},
                                          {"tokens", 1, 0, 'N'},
                                          {"reps", 1, 0, 'R'},
                                          {"metadata", 1, 0, 'M'},
                                          {"cluster", 1, 0, 'C'},
                                          {"name", 1, 0, 'n'},
                                          {"secret-file", 1, 0, 'F'},
                                          {"insecure", 0, 0, 'I'},
                                          {"gpu", 0, 0, 'g'},
                                          {"ceiling", 0, 0, 'c'},
                                          {"gpu-local", 0, 0, 'G'},
                                          {"gpu-remote", 0, 0, 'H'},
                                          {0, 0, 0, 0}};
    *o = (bench_opts_t){.mode = NULL,
                        .protocol = "tcp",
                        .path = "tcp",
                        .bind = "127.0.0.1",
                        .block = 64 << 10,
                        .batch = 128,
                        .threads = 1,
                        .duration = 5,
                        .buffer = 256 << 20,
                        .seed = 42,
                        .lanes = 2,
                        .progress = 0,
                        .target_fd = -1};
    int c, which = -1;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", longs, &which)) != -1) {
        int bad = 0;
        switch (c) {
        case 'm':
            o->mode = optarg;
            break;
        case 's':
            o->segment = optarg;
            break;
        case 'i':
            o->bind = optarg;
            break;
        case 'p':
            bad = kvb_cli_parse_uint(optarg, 65535, &o->port);
            break;
        case 'o':
            bad = strcmp(optarg, "read") && strcmp(optarg, "write");
            o->write = !strcmp(optarg, "write");
            break;
        case 'b':
            o->block_given = true;
            bad = kvb_cli_parse_size(optarg, &o->block) || !o->block || o->block > (1ull << 30);
            break;
        case 'B':
            bad = kvb_cli_parse_uint(optarg, 1 << 20, &o->batch) || !o->batch;
            break;
        case 't':
            bad = kvb_cli_parse_uint(optarg, 256, &o->threads) || !o->threads;
            break;
        case 'd':
            bad = kvb_cli_parse_uint(optarg, 86400, &o->duration) || !o->duration;
            break;
        case 'z':
            bad = kvb_cli_parse_size(optarg, &o->buffer) || !o->buffer || o->buffer > (64ull << 30);
            break;
        case 'S':
            bad = kvb_cli_parse_uint(optarg, UINT64_MAX, &o->seed);
            break;
        case 'L':
            bad = kvb_cli_parse_uint(optarg, 16, &o->lanes) || !o->lanes;
            break;
        case 'T':
            bad = kvb_cli_parse_uint(optarg, 64, &o->progress) || !o->progress;
            break;
        case 'P':
            if (!protocol_ok(optarg)) {
                fprintf(stderr,
                        "kvbridge bench: protocol '%s' is not auto or a list of data paths "
                        "(tcp, shm, cuda, fabric), such as shm,tcp\n",
                        optarg);
                return 2;
            }
            o->protocol = optarg;
            break;
        case 'v':
            o->verify = true;
            break;
        case 'g':
            o->gpu_local = o->gpu_remote = true;
            break;
        case 'c':
            o->ceiling = true;
            break;
        case 'G':
            o->gpu_local = true;
            break;
        case 'H':
            o->gpu_remote = true;
            break;
        case 'l':
            o->loopback = true;
            break;
        case 'Y':
            o->latency = true;
            break;
        case 'K':
            o->kv_model = optarg;
            break;
        case 'N':
            bad = kvb_cli_parse_uint(optarg, 1u << 20, &o->tokens) || !o->tokens;
            break;
        case 'R':
            bad = kvb_cli_parse_uint(optarg, 1000, &o->reps) || !o->reps;
            break;
        case 'X':
            bad = strcmp(optarg, "tcp") && strcmp(optarg, "rpc") && strcmp(optarg, "memcpy") &&
                  strcmp(optarg, "copy");
            o->baseline = optarg;
            break;
        case 'Q':
            o->peer_netns = optarg;
            break;
        case 'j':
            o->json = true;
            break;
        case 'M':
            o->metadata = strcmp(optarg, "p2p") ? optarg : NULL; /* NULL: no store */
            break;
        case 'C':
            o->cluster = optarg;
            break;
        case 'n':
            bad = !*optarg || strlen(optarg) > KVB_NAME_MAX;
            o->name = optarg;
            break;
        case 'F':
            if (kvb_cli_secret_file("bench", optarg))
                return 2;
            break;
        case 'I':
            o->insecure = true;
            break;
        case 'W':
            o->fabric_provider = optarg;
            break;
        case 'Z': /* every engine and ceiling of this process and its children reads it */
            bad = !*optarg || strlen(optarg) >= sizeof o->congestion ||
                  setenv("KVB_TCP_CONGESTION", optarg, 1) != 0;
            break;
        case 'U': { /* every engine of this process and its children reads it */
            uint64_t us;
            bad = kvb_cli_parse_uint(optarg, KVB_BUSY_POLL_MAX_US, &us) ||
                  setenv("KVB_BUSY_POLL_US", optarg, 1) != 0;
            break;
        }
        case OPT_LINGER: { /* every engine of this process and its children reads it */
            uint64_t us;
            bad = kvb_cli_parse_uint(optarg, KVB_BUSY_POLL_MAX_US, &us) ||
                  setenv("KVB_LINGER_US", optarg, 1) != 0;
            break;
        }
        case 'A': { /* every engine and copy ceiling of this process and its children reads it */
            kvb_cpus_t cpus;
            char err[160];
            if (*optarg && kvb__cpus_parse(optarg, &cpus, err, sizeof err)) { /* "": unbound */
                fprintf(stderr, "kvbridge bench: --cpus %s\n", err);
                return 2;
            }
            bad = setenv("KVB_CPUS", optarg, 1) != 0;
            break;
        }
        case 'h':
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvbridge bench: invalid value '%s' for --%s\n", optarg,
                    which >= 0 ? longs[which].name : "?");
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvbridge bench: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (o->latency && !o->block_given)
        o->block = 64;
    if (o->kv_model)
        return 0; /* a self-contained workload: the other options do not apply */
    if (o->peer_netns &&
        (!o->baseline || (strcmp(o->baseline, "tcp") && strcmp(o->baseline, "rpc")))) {
        fprintf(stderr, "kvbridge bench: --peer-netns goes with --baseline tcp or rpc\n");
        return 2;
    }
    if (!o->loopback && !o->mode && !o->baseline) {
        fprintf(stderr, "kvbridge bench: give --mode target|initiator, or --loopback\n");
        return 2;
    }
    if (o->mode && strcmp(o->mode, "target") && strcmp(o->mode, "initiator")) {
        fprintf(stderr, "kvbridge bench: --mode must be target or initiator\n");
        return 2;
    }
    if (o->mode && !strcmp(o->mode, "initiator") && !o->segment) {
        fprintf(stderr, "kvbridge bench: --mode initiator needs --segment host:port\n");
        return 2;
    }
    if (o->reps && (!o->ceiling || o->baseline)) {
        fprintf(stderr, "kvbridge bench: --reps goes with --kv, or with --ceiling\n");
        return 2;
    }
    if (o->ceiling && o->reps > 1 &&
        (o->gpu_local || o->gpu_remote || o->latency ||
         (double)o->duration / (double)o->reps < 0.5)) {
        fprintf(stderr, "kvbridge bench: --ceiling --reps N takes a throughput run in host memory "
                        "with --duration / N of at least 0.5 s\n");
        return 2;
    }
    if ((o->gpu_local || o->gpu_remote) && (o->latency || o->baseline)) {
        fprintf(stderr, "kvbridge bench: --gpu applies to throughput runs, not --latency or "
                        "--baseline\n");
        return 2;
    }
    if (o->block > o->buffer) {
        fprintf(stderr, "kvbridge bench: --block-size is larger than --buffer-size\n");
        return 2;
    }
    return 0;
}

int kvb_cmd_bench(int argc, char **argv)
{
    bench_opts_t o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* Both sides of --kv are engines of processes forked from this one: the provider reaches
     * them as the engine's default. */
    if (o.kv_model && o.fabric_provider && setenv("KVB_FABRIC_PROVIDER", o.fabric_provider, 1))
        return 1;
    if (o.kv_model)
        return kvb_bench_kv(o.kv_model, o.tokens ? o.tokens : 4096, o.protocol,
                            (int)(o.reps ? o.reps : 5), o.verify, o.json);
    if (o.baseline)
        return run_baseline(&o);
    if (o.latency && o.mode && !strcmp(o.mode, "initiator"))
        return run_latency(&o);
    if (o.loopback)
        return run_loopback(&o);
    if (!strcmp(o.mode, "target"))
        return run_target(&o, -1, -1);
    return run_initiator(&o);
}
