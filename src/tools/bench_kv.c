/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge bench --kv MODEL --tokens N: moves one prompt's KV cache the way a PD deployment does -
 * a prefill agent and a decode agent in two processes, block ids shuffled as a paged allocator
 * leaves them, pulled through the KV layer's plans - and compares the time with bytes / ceiling. */
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/copy.h"
#include "kvbridge/kv.h"
#include "tools/cli.h"

typedef struct {
    const char *name;
    kvb_kv_attn_t attn;
    uint32_t layers, kv_heads, head_bytes; /* head_bytes: one head of one token (GQA) */
    uint32_t latent_bytes;                 /* MLA: (kv_lora_rank + rope_dim) * dtype size */
} kv_model_t;

static const kv_model_t MODELS[] = {
    {"llama3-8b", KVB_KV_ATTN_GQA, 32, 8, 128 * 2, 0},
    {"llama3-70b", KVB_KV_ATTN_GQA, 80, 8, 128 * 2, 0},
    {"deepseek-v3", KVB_KV_ATTN_MLA, 61, 0, 0, (512 + 64) * 2},
};

#define TOKENS_PER_BLOCK 16
/* The pool a prompt's blocks are drawn from is this many times the prompt: a serving instance
 * holds many prompts at once, so a prompt's blocks are scattered over far more memory than the
 * prompt itself, and beyond the last-level cache. */
#define POOL_FACTOR 4

typedef struct {
    kvb_engine_t *engine;
    uint8_t *pool;
    uint64_t pool_bytes;
    bool mapped; /* the pool is a mapping of a memfd made by the parent (side_init's fd) */
    kvb_kv_slot_t *slots;
    kvb_kv_layout_t layout;
    kvb_kv_agent_t *agent;
} side_t;

/* Block sizes are multiples of 8 bytes (the fill and the check go word by word). */
static uint64_t block_bytes(const kv_model_t *m)
{
    return m->attn == KVB_KV_ATTN_MLA ? (uint64_t)TOKENS_PER_BLOCK * m->latent_bytes
                                      : (uint64_t)m->kv_heads * TOKENS_PER_BLOCK * m->head_bytes;
}

/* Slot buffers per layer: K and V, or MLA's one latent. */
static uint32_t slots_per_layer(const kv_model_t *m)
{
    return m->attn == KVB_KV_ATTN_MLA ? 1 : 2;
}

/* One rank's layout over a pool of `blocks` blocks per slot, slot buffers back to back: in the
 * memfd `fd` where one is given (the prefill's, so that the copy ceiling can copy its pages), else
 * kvb_alloc memory, or anonymous memory over TCP. */
static int side_init(side_t *s, const kv_model_t *m, uint64_t blocks, const char *protocol,
                     kvb_kv_role_t role, int fd)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = protocol;
    int rc = kvb_engine_create(&cfg, &s->engine);
    if (rc)
        return rc;
    uint32_t per_layer = slots_per_layer(m);
    uint64_t bb = block_bytes(m), slot_bytes = bb * blocks;
    s->pool_bytes = slot_bytes * per_layer * m->layers;
    void *p = NULL;
    if (fd >= 0) {
        p = kvb_cli_map_memfd(fd, s->pool_bytes, true);
        rc = p ? KVB_OK : KVB_ERR_NOMEM;
        s->mapped = p != NULL;
    } else if (strcmp(protocol, "tcp") == 0) {
        p = kvb_cli_populated(s->pool_bytes);
        rc = p ? KVB_OK : KVB_ERR_NOMEM;
    } else {
        rc = kvb_alloc(s->engine, s->pool_bytes, 0, &p);
    }
    s->pool = p;
    s->slots = calloc((size_t)per_layer * m->layers, sizeof *s->slots);
    if (rc || !s->slots)
        return rc ? rc : KVB_ERR_NOMEM;
    for (uint32_t l = 0; l < m->layers; l++)
        for (uint32_t k = 0; k < per_layer; k++) {
            kvb_kv_slot_t *sl = &s->slots[l * per_layer + k];
            *sl = (kvb_kv_slot_t){.layer = l,
                                  .kind = m->attn == KVB_KV_ATTN_MLA ? KVB_KV_SLOT_LATENT
                                          : k == 0                   ? KVB_KV_SLOT_K
                                                                     : KVB_KV_SLOT_V,
                                  .base = (uintptr_t)s->pool + (l * per_layer + k) * slot_bytes,
                                  .len = slot_bytes,
                                  .block_bytes = bb,
                                  .num_blocks = blocks};
            if (m->attn == KVB_KV_ATTN_GQA) {
                sl->num_heads = m->kv_heads;
                sl->head_bytes = m->head_bytes;
                sl->order = KVB_KV_ORDER_HND;
            }
        }
    s->layout = (kvb_kv_layout_t){.dtype = KVB_KV_DTYPE_BF16,
                                  .tokens_per_block = TOKENS_PER_BLOCK,
                                  .attn = m->attn,
                                  .num_kv_heads = m->kv_heads,
                                  .dp_size = 1,
                                  .tp_size = 1,
                                  .num_layers = m->layers,
                                  .slots = s->slots,
                                  .num_slots = (size_t)per_layer * m->layers};
    snprintf(s->layout.model, sizeof s->layout.model, "%s", m->name);
    char why[KVB_KV_REASON_MAX];
    rc = kvb_kv_agent_create(s->engine, &s->layout, role, &s->agent, why, sizeof why);
    if (rc)
        fprintf(stderr, "bench --kv: agent: %s\n", why);
    return rc;
}

static void side_fini(side_t *s, const char *protocol)
{
    kvb_kv_agent_destroy(s->agent);
    kvb_engine_destroy(s->engine); /* frees kvb_alloc memory */
    if (s->pool && (s->mapped || strcmp(protocol, "tcp") == 0))
        munmap(s->pool, s->pool_bytes);
    free(s->slots);
}

/* The 8 bytes at word `w` of a block: a function of (slot index, block id, w) so moves can be
 * checked. Word-wise: pools are gigabytes, and a byte-wise fill took seconds. */
static uint64_t block_word(size_t slot, uint64_t block, uint64_t w)
{
    uint64_t x = (slot * 0x9E3779B97F4A7C15ull) ^ (block << 24) ^ w;
    x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 31);
}

static void fill_blocks(side_t *s)
{
    for (size_t i = 0; i < s->layout.num_slots; i++) {
        const kvb_kv_slot_t *sl = &s->slots[i];
        uint8_t *p = (uint8_t *)(uintptr_t)sl->base;
        for (uint64_t b = 0; b < sl->num_blocks; b++)
            for (uint64_t w = 0; w < sl->block_bytes / 8; w++) {
                uint64_t v = block_word(i, b, w);
                memcpy(p + b * sl->block_bytes + w * 8, &v, 8);
            }
    }
}

static uint64_t check_blocks(const side_t *s, const uint64_t *src, const uint64_t *dst, size_t n)
{
    uint64_t bad = 0;
    for (size_t i = 0; i < s->layout.num_slots; i++) {
        const kvb_kv_slot_t *sl = &s->slots[i];
        const uint8_t *p = (const uint8_t *)(uintptr_t)sl->base;
        for (size_t k = 0; k < n; k++)
            for (uint64_t w = 0; w < sl->block_bytes / 8; w++) {
                uint64_t v;
                memcpy(&v, p + dst[k] * sl->block_bytes + w * 8, 8);
                bad += v != block_word(i, src[k], w);
            }
    }
    return bad;
}

/* n distinct ids out of 0..pool-1 in random order: what a paged allocator hands out. False if
 * there is no memory for it. */
static bool shuffled_ids(uint64_t *out, size_t n, uint64_t pool, uint64_t *seed)
{
    uint64_t *all = malloc(pool * sizeof *all);
    if (!all)
        return false;
    for (uint64_t i = 0; i < pool; i++)
        all[i] = i;
    for (uint64_t i = pool - 1; i > 0; i--) {
        *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t j = (*seed >> 33) % (i + 1), t = all[i];
        all[i] = all[j];
        all[j] = t;
    }
    memcpy(out, all, n * sizeof *out);
    free(all);
    return true;
}

/* The prefill process: serves its pool until the parent closes `life`. */
static int prefill_main(const kv_model_t *m, uint64_t pool, const char *protocol, int fd,
                        int report, int life)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* The decode's completion notices come to an agent that expects none (a serving prefill
     * would have called kvb_kv_expect and linked back): a warning per pull, not worth showing. */
    if (!getenv("KVB_LOG_LEVEL"))
        kvb_log_set_level(0);
    side_t s = {0};
    if (side_init(&s, m, pool, protocol, KVB_KV_ROLE_PREFILL, fd))
        return 1;
    fill_blocks(&s);
    dprintf(report, "%s\n", kvb_engine_segment_name(s.engine));
    close(report);
    /* Pull mode: the decode confirms each request; counting them is the prefill's half. */
    struct pollfd p = {.fd = life, .events = POLLIN};
    while (poll(&p, 1, 100) == 0) {
        kvb_notification_t *n = malloc(sizeof *n);
        if (n)
            kvb_kv_agent_notify_recv(s.agent, n, 0);
        free(n);
    }
    side_fini(&s, protocol);
    return 0;
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int pull_once(kvb_kv_link_t *link, const char *id, const uint64_t *src, const uint64_t *dst,
                     size_t n, double *secs)
{
    char why[KVB_KV_REASON_MAX];
    kvb_kv_xfer_t *x;
    int rc = kvb_kv_xfer_begin(link, id, KVB_OP_READ, src, dst, n, 60000, &x, why, sizeof why);
    if (rc) {
        fprintf(stderr, "bench --kv: %s\n", why);
        return rc;
    }
    uint64_t t0 = kvb__now_ns(); /* planning is done; time the move, as a connector sees it */
    rc = kvb_kv_xfer_all(x);
    int frc = kvb_kv_xfer_finish(x);
    *secs = (double)(kvb__now_ns() - t0) / 1e9;
    kvb_kv_xfer_free(x);
    return rc ? rc : frc;
}

/* A pull's figure against its ceiling: each timed pull is followed by a measurement of the ceiling
 * over the same working set, and the ratio is the median of the pairs' ratios - seconds apart,
 * so that a slow stretch of a shared machine moves both halves of a pair (a ceiling measured once
 * before the pulls came out below the pulls they divided when the machine sped up between). */
#define CEILING_SECS 0.2 /* per window of the first measurement, the best of CEILING_RUNS */
#define CEILING_RUNS 3

/* After each pull: the best of windows as long as the pull (within 20-200 ms), about 0.6 s of
 * them (at most KVB_CEILING_RUNS_MAX). A pull is one window of its own length, and this machine's
 * rate varies more over 30 ms than over 200: in `make bench` at 10:24 on 2026-11-28 the deepseek-v3
 * same-host pulls, 29 ms at 19.6 GB/s, beat the best of three 0.2 s windows (19.1 GB/s) in 3 of 5
 * pairs. */
#define PAIR_MIN_SECS 0.02
#define PAIR_ALL_SECS 0.6
static void pair_windows(double pull_secs, double *secs, int *runs)
{
    *secs = pull_secs < PAIR_MIN_SECS  ? PAIR_MIN_SECS
            : pull_secs > CEILING_SECS ? CEILING_SECS
                                       : pull_secs;
    *runs = (int)(PAIR_ALL_SECS / *secs + 0.5);
    *runs = *runs > KVB_CEILING_RUNS_MAX ? KVB_CEILING_RUNS_MAX
            : *runs < CEILING_RUNS       ? CEILING_RUNS
                                         : *runs;
}

static int decode_run(const kv_model_t *m, uint64_t tokens, uint64_t pool, const side_t *s,
                      const char *segment, int reps, bool verify, kvb_ceiling_session_t *cs,
                      const char *method, bool json)
{
    kvb_kv_link_t *link = NULL;
    char why[KVB_KV_REASON_MAX];
    int rc = kvb_kv_link_open(s->agent, segment, &link, why, sizeof why);
    if (rc)
        fprintf(stderr, "bench --kv: link: %s\n", why);
    size_t n = (size_t)((tokens + TOKENS_PER_BLOCK - 1) / TOKENS_PER_BLOCK);
    uint64_t *src = calloc(n, sizeof *src), *dst = calloc(n, sizeof *dst), seed = 7;
    double *t = calloc((size_t)reps, sizeof *t), *cg = calloc((size_t)reps, sizeof *cg),
           *ratio = calloc((size_t)reps, sizeof *ratio);
    uint64_t bad = 0;
    uint64_t bytes = (uint64_t)n * block_bytes(m) * s->layout.num_slots;
    /* Warm-up, not timed: one pull of the whole pool, so every page of both pools has been
     * reached once through the path - as in a serving instance, whose pools stay shared and
     * mapped for hours. On this VM the first touch of each page through a new mapping costs a
     * hypervisor exit (shadow page tables): without it the first timed pulls ran 5-15x slower and
     * the median measured the mapping, not the transfer. */
    uint64_t *all = calloc((size_t)pool, sizeof *all);
    if (!rc && (!src || !dst || !t || !cg || !ratio || !all))
        rc = KVB_ERR_NOMEM;
    for (uint64_t i = 0; all && i < pool; i++)
        all[i] = i;
    double warm = 0;
    if (!rc)
        rc = pull_once(link, "bench-warm-up", all, all, (size_t)pool, &warm);
    free(all);
    for (int r = 0; !rc && r < reps; r++) {
        if (!shuffled_ids(src, n, pool, &seed) || !shuffled_ids(dst, n, pool, &seed)) {
            rc = KVB_ERR_NOMEM;
            break;
        }
        char id[32];
        snprintf(id, sizeof id, "bench-%d", r);
        rc = pull_once(link, id, src, dst, n, &t[r]);
        if (!rc && verify && r == reps - 1)
            bad = check_blocks(s, src, dst, n);
        kvb_ceiling_t c;
        double secs;
        int runs;
        pair_windows(t[r], &secs, &runs);
        if (!rc && cs && !kvb_ceiling_measure(cs, secs, runs, &c)) {
            cg[r] = c.gbps;
            ratio[r] = t[r] / ((double)bytes / (c.gbps * 1e9)); /* time / bytes-over-ceiling */
        } else if (!rc && cs) {
            cs = NULL; /* reported as not measured */
        }
    }
    if (!rc) {
        if (!cs)
            memset(ratio, 0, (size_t)reps * sizeof *ratio);
        qsort(t, (size_t)reps, sizeof *t, cmp_dbl);
        qsort(cg, (size_t)reps, sizeof *cg, cmp_dbl);
        qsort(ratio, (size_t)reps, sizeof *ratio, cmp_dbl);
        double med = t[reps / 2], ceiling = cs ? cg[reps / 2] : 0, r_med = ratio[reps / 2];
        const char *path = "?";
        kvb_segment_t seg;
        if (kvb_segment_open(s->engine, segment, &seg) == KVB_OK) {
            kvb_segment_transport(s->engine, seg, &path);
            kvb_segment_close(s->engine, seg);
        }
        printf("kvbridge bench --kv %s: %llu tokens, %u layers, %zu blocks of %llu B per slot, "
               "%s\n  one prompt's KV: %llu bytes in %.2f ms (median of %d; fastest %.2f, "
               "slowest %.2f), %.3f GB/s\n",
               m->name, (unsigned long long)tokens, m->layers, n,
               (unsigned long long)block_bytes(m), path, (unsigned long long)bytes, med * 1e3, reps,
               t[0] * 1e3, t[reps - 1] * 1e3, (double)bytes / med / 1e9);
        const char *cpus = kvb_engine_cpus(s->engine);
        if (*cpus)
            printf("  engines' data threads on CPUs %s\n", cpus);
        if (cs)
            printf("  ceiling %.3f GB/s (median; %.3f-%.3f), measured after each pull (%s) -> "
                   "bytes/ceiling %.2f ms; ratio %.3f (the median of the %d pairs' ratios; "
                   "%.3f-%.3f)%s\n",
                   ceiling, cg[0], cg[reps - 1], method, (double)bytes / (ceiling * 1e9) * 1e3,
                   r_med, reps, ratio[0], ratio[reps - 1],
                   verify ? (bad ? ", verify FAILED" : ", verified") : "");
        else
            printf("  ceiling not measured%s\n",
                   verify ? (bad ? ", verify FAILED" : ", verified") : "");
        if (cs && r_med < 1)
            printf("  WARNING: faster than bytes / ceiling - the ceiling does not measure this "
                   "path; do not believe the ratio\n");
        if (json)
            printf("{\"kv_model\":\"%s\",\"tokens\":%llu,\"protocol\":\"%s\",\"bytes\":%llu,"
                   "\"median_ms\":%.3f,\"min_ms\":%.3f,\"max_ms\":%.3f,\"gbps\":%.4f,"
                   "\"ceiling_gbps\":%.4f,\"ratio\":%.4f,\"ratio_min\":%.4f,\"ratio_max\":%.4f,"
                   "\"verified\":%s,\"cpus\":\"%s\"}\n",
                   m->name, (unsigned long long)tokens, path, (unsigned long long)bytes, med * 1e3,
                   t[0] * 1e3, t[reps - 1] * 1e3, (double)bytes / med / 1e9, ceiling, r_med,
                   ratio[0], ratio[reps - 1], verify ? (bad ? "false" : "true") : "null", cpus);
    } else {
        fprintf(stderr, "bench --kv: transfer failed: %s\n", kvb_strerror(rc));
    }
    free(src);
    free(dst);
    free(t);
    free(cg);
    free(ratio);
    kvb_kv_link_close(link);
    return rc || bad ? 1 : 0;
}

/* What bounds the path: a socket stream for TCP and for libfabric's tcp provider, a memory copy
 * for the same-host paths (shm, libfabric's shm provider). */
static const char *ceiling_kind(const char *protocol)
{
    const char *prov = getenv("KVB_FABRIC_PROVIDER");
    if (!strcmp(protocol, "fabric"))
        return prov && !strcmp(prov, "shm") ? "copy" : "tcp";
    return strcmp(protocol, "tcp") ? "copy" : "tcp";
}

typedef struct {
    uint64_t src, dst;
} id_pair_t;

static int cmp_src(const void *x, const void *y)
{
    const id_pair_t *a = x, *b = y;
    return a->src < b->src ? -1 : a->src > b->src;
}

/* Reorders the pairs (src[i], dst[i]) by source id. False if there is no memory for it. */
static bool by_source(uint64_t *src, uint64_t *dst, size_t n)
{
    id_pair_t *p = malloc(n * sizeof *p);
    if (!p)
        return false;
    for (size_t i = 0; i < n; i++)
        p[i] = (id_pair_t){src[i], dst[i]};
    qsort(p, n, sizeof *p, cmp_src);
    for (size_t i = 0; i < n; i++)
        src[i] = p[i].src, dst[i] = p[i].dst;
    free(p);
    return true;
}

/* The ceiling for this path, on the same working set: the blocks the timed pulls move, rep by rep
 * (each rep's prompt drawn as decode_run draws it; the first CEILING_REPS of them), from one pool
 * of this size to another - a raw socket stream over as many connections as the engine's lanes
 * for TCP, the best copy with the copy path's threads otherwise; set up here, measured after each
 * pull (decode_run). Each rep's blocks go in source address order, slot by slot: the KV plans sort
 * a pull's copies so (plan.c), as any plain copy of a scattered set would, and in the order they
 * were drawn the copy ceiling came out below the pull it divided (15.8 and 18.7 GB/s against 17.9
 * and 19.4; README, "Performance", KV ceilings). Only within a rep: two reps draw some of the same
 * blocks, and sorted together their second copy would read the first's from cache. The offsets
 * go to *src and *dst, which must outlive the session; NULL if it could not be set up. */
#define CEILING_REPS 5

static kvb_ceiling_session_t *kv_ceiling(const kv_model_t *m, uint64_t n, uint64_t pool,
                                         const char *protocol, int reps, const uint8_t *from,
                                         uint8_t *to, uint64_t **src_out, uint64_t **dst_out)
{
    reps = reps < CEILING_REPS ? reps : CEILING_REPS;
    uint64_t slots = slots_per_layer(m) * (uint64_t)m->layers;
    uint64_t bb = block_bytes(m), slot_bytes = bb * pool, per = n * slots,
             all = per * (uint64_t)reps;
    uint64_t *ids = calloc(2 * n, sizeof *ids), *src = calloc(all, sizeof *src),
             *dst = calloc(all, sizeof *dst), seed = 7;
    kvb_ceiling_session_t *cs = NULL;
    bool ok = ids && src && dst;
    for (int r = 0; ok && r < reps; r++) {
        ok = shuffled_ids(ids, n, pool, &seed) && shuffled_ids(ids + n, n, pool, &seed) &&
             by_source(ids, ids + n, n);
        for (uint64_t sl = 0, i = per * (uint64_t)r; ok && sl < slots; sl++)
            for (uint64_t k = 0; k < n; k++, i++) {
                src[i] = sl * slot_bytes + ids[k] * bb;
                dst[i] = sl * slot_bytes + ids[n + k] * bb;
            }
    }
    if (ok && (from ? kvb_ceiling_open_on(from, to, slot_bytes * slots, bb, src, dst, all, 2, &cs)
                    : kvb_ceiling_open(ceiling_kind(protocol), slot_bytes * slots, bb, src, dst,
                                       all, 2, &cs)))
        cs = NULL;
    free(ids);
    if (!cs) {
        free(src);
        free(dst);
        src = dst = NULL;
    }
    *src_out = src;
    *dst_out = dst;
    return cs;
}

int kvb_bench_kv(const char *model, uint64_t tokens, const char *protocol, int reps, bool verify,
                 bool json)
{
    const kv_model_t *m = NULL;
    for (size_t i = 0; i < sizeof MODELS / sizeof MODELS[0]; i++)
        if (!strcmp(MODELS[i].name, model))
            m = &MODELS[i];
    if (!m) {
        fprintf(stderr,
                "kvbridge bench: unknown --kv model '%s' (llama3-8b, llama3-70b, "
                "deepseek-v3)\n",
                model);
        return 2;
    }
    if (tokens == 0 || tokens > (1u << 20)) {
        fprintf(stderr, "kvbridge bench: --tokens must be 1..1048576\n");
        return 2;
    }
    uint64_t n = (tokens + TOKENS_PER_BLOCK - 1) / TOKENS_PER_BLOCK, pool = n * POOL_FACTOR;
    uint64_t slots = slots_per_layer(m) * (uint64_t)m->layers;
    uint64_t ws = pool * block_bytes(m) * slots; /* one side's pool */
    int name_pipe[2], life[2];
    if (pipe(name_pipe) || pipe(life))
        return 1;
    /* Over a copy, the prefill's pool lives in a memfd made here, so that the ceiling can copy
     * the very pages the pulls copy (kvb_ceiling_open_on; not with --verify, whose check its
     * copies would blind). Its pages are still allocated by the prefill, as it populates them. */
    bool copy = !strcmp(ceiling_kind(protocol), "copy");
    int pfd = copy ? kvb_cli_memfd("kvbridge-bench-prefill", ws) : -1;
    if (copy && pfd < 0)
        fprintf(stderr, "bench --kv: a memfd for the prefill's pool: %s; kvb_alloc then\n",
                strerror(errno));
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(name_pipe[0]);
        close(life[1]);
        _exit(prefill_main(m, pool, protocol, pfd, name_pipe[1], life[0]));
    }
    if (pid < 0)
        perror("bench --kv: fork");
    close(name_pipe[1]);
    close(life[0]);
    /* A ceiling of its own is set up before the decode's pool exists: over TCP it forks a sender
     * process, which would otherwise share that pool copy-on-write. */
    bool borrow = pfd >= 0 && !verify;
    uint64_t *csrc = NULL, *cdst = NULL;
    kvb_ceiling_session_t *cs =
        pid > 0 && !borrow ? kv_ceiling(m, n, pool, protocol, reps, NULL, NULL, &csrc, &cdst)
                           : NULL;
    side_t dec = {0};
    int rc = pid < 0 ? KVB_ERR_SYSTEM : side_init(&dec, m, pool, protocol, KVB_KV_ROLE_DECODE, -1);
    if (rc)
        fprintf(stderr, "bench --kv: the decode side: %s\n", kvb_strerror(rc));
    /* The prefill reports its segment once its pool is filled: the ceiling's pass comes after. */
    char seg[KVB_NAME_MAX + 2] = "";
    ssize_t got = rc ? -1 : read(name_pipe[0], seg, sizeof seg - 1);
    close(name_pipe[0]);
    char *nl = got > 0 ? strchr(seg, '\n') : NULL;
    uint8_t *prefill_pool = NULL; /* mapped here for the ceiling */
    if (nl && borrow) {
        prefill_pool = kvb_cli_map_memfd(pfd, ws, false);
        if (!prefill_pool)
            fprintf(stderr, "bench --kv: the prefill's pool: %s; no ceiling\n", strerror(errno));
        else
            cs = kv_ceiling(m, n, pool, protocol, reps, prefill_pool, dec.pool, &csrc, &cdst);
    }
    kvb_ceiling_t c = {0};
    if (cs && kvb_ceiling_measure(cs, CEILING_SECS, CEILING_RUNS, &c)) /* the method line */
        c.method[0] = '\0';
    uint64_t llc = kvb__llc_size();
    char cache[32] = "unknown (sysfs has none)";
    if (llc)
        snprintf(cache, sizeof cache, "%llu KiB", (unsigned long long)(llc >> 10));
    printf("bench --kv: pool of %llu blocks per slot (%dx the prompt), %llu MiB per side; "
           "last-level cache %s\n  ceiling: %s%s\n",
           (unsigned long long)pool, POOL_FACTOR, (unsigned long long)(ws >> 20), cache,
           c.method[0] ? c.method : "not measured",
           c.method[0] ? "; each pull's blocks in source order, as its plan orders them" : "");
    rc = 1;
    if (nl) {
        *nl = '\0';
        char how[96];
        snprintf(how, sizeof how,
                 "the best of windows as long as the pull (%.2f-%.1f s), about %.1f s of them",
                 PAIR_MIN_SECS, CEILING_SECS, PAIR_ALL_SECS);
        rc = decode_run(m, tokens, pool, &dec, seg, reps, verify, c.method[0] ? cs : NULL, how,
                        json);
    } else if (dec.engine) {
        fprintf(stderr, "bench --kv: the prefill process did not start\n");
    }
    kvb_ceiling_close(cs); /* first: its sender process holds a copy of life[1] */
    if (prefill_pool)
        munmap(prefill_pool, ws);
    side_fini(&dec, protocol); /* after the ceiling, which may copy into its pool */
    close(life[1]);
    if (pid > 0)
        waitpid(pid, NULL, 0);
    if (pfd >= 0)
        close(pfd);
    free(csrc);
    free(cdst);
    return rc;
}
