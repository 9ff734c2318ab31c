/* SPDX-License-Identifier: Apache-2.0 */
/* KV transfers between real processes: a prefill process with TP 2 (two engines, one agent per
 * rank) and decode ranks with TP 1 and TP 4 in this process; GQA (HND heads) and MLA layouts; pull
 * and layer-wise push; every byte of every moved block checked against the source's head ranges,
 * and every other block checked untouched. Also: a mismatched layout refused at link time, and a
 * sender killed mid-request failing that request only. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "kv/kv_fixture.h"
#include "kvbridge/kv.h"

#define HEADS   8
#define LAYERS  3
#define PBLOCKS 32 /* prefill blocks per slot */
#define DBLOCKS 40 /* decode blocks per slot: capacities differ on purpose */
#define POISON  0xEE
#define REGION  (LAYERS * 2 * FX_SPACING)

/* ---- the byte every position must hold ------------------------------------------------------ */

static uint8_t expected(uint32_t layer, unsigned kind, uint64_t src_block, uint32_t head,
                        uint64_t off)
{
    uint64_t x = ((uint64_t)layer << 56) ^ ((uint64_t)kind << 48) ^ (src_block << 24) ^
                 ((uint64_t)head << 16) ^ off;
    x = (x ^ (x >> 31)) * 0x9e3779b97f4a7c15ull;
    return (uint8_t)(x >> 40);
}

/* Global head and offset-within-head of byte `o` of a block of slot `s` on rank `rank`. */
static void locate(const kvb_kv_layout_t *l, const kvb_kv_slot_t *s, uint64_t o, uint32_t *head,
                   uint64_t *rem)
{
    if (!s->num_heads) {
        *head = 0;
        *rem = o;
        return;
    }
    uint64_t per_head = (uint64_t)l->tokens_per_block * s->head_bytes;
    uint32_t first = (uint32_t)((uint64_t)l->tp_rank * l->num_kv_heads / (uint32_t)l->tp_size);
    *head = first + (uint32_t)(o / per_head);
    *rem = o % per_head;
}

static void fill_source(const kvb_kv_layout_t *l)
{
    for (size_t i = 0; i < l->num_slots; i++) {
        const kvb_kv_slot_t *s = &l->slots[i];
        uint8_t *p = (uint8_t *)(uintptr_t)s->base;
        for (uint64_t b = 0; b < s->num_blocks; b++)
            for (uint64_t o = 0; o < s->block_bytes; o++) {
                uint32_t h;
                uint64_t rem;
                locate(l, s, o, &h, &rem);
                p[b * s->block_bytes + o] = expected(s->layer, s->kind, b, h, rem);
            }
    }
}

/* Checks a decode rank's buffers: dst[i] holds src[i]'s bytes for its heads, all else poison. */
static void check_dest(const kvb_kv_layout_t *l, const uint64_t *src, const uint64_t *dst, size_t n)
{
    for (size_t i = 0; i < l->num_slots; i++) {
        const kvb_kv_slot_t *s = &l->slots[i];
        const uint8_t *p = (const uint8_t *)(uintptr_t)s->base;
        for (uint64_t b = 0; b < s->num_blocks; b++) {
            int64_t from = -1;
            for (size_t k = 0; k < n; k++)
                if (dst[k] == b)
                    from = (int64_t)src[k];
            for (uint64_t o = 0; o < s->block_bytes; o++) {
                uint32_t h;
                uint64_t rem;
                locate(l, s, o, &h, &rem);
                uint8_t want =
                    from < 0 ? POISON : expected(s->layer, s->kind, (uint64_t)from, h, rem);
                cr_assert_eq(p[b * s->block_bytes + o], want,
                             "rank %d layer %u slot %s block %llu byte %llu: %02x, want %02x",
                             l->tp_rank, s->layer, kvb_kv_slot_name(s->kind), (unsigned long long)b,
                             (unsigned long long)o, p[b * s->block_bytes + o], want);
            }
        }
    }
}

/* ---- one side's ranks: an engine, a buffer, a layout and an agent each ---------------------- */

typedef struct {
    kvb_engine_t *engine;
    uint8_t *mem;
    fx_layout_t fx;
    kvb_kv_agent_t *agent;
} rank_t;

static void rank_init(rank_t *r, bool mla, int tp, int rank, uint64_t blocks, kvb_kv_role_t role)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.timeout_ms = 5000;
    cr_assert_eq(kvb_engine_create(&c, &r->engine), KVB_OK);
    r->mem = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(r->mem, MAP_FAILED);
    if (mla)
        fx_mla(&r->fx, tp, rank, LAYERS, blocks, (uintptr_t)r->mem);
    else
        fx_gqa(&r->fx, HEADS, tp, rank, LAYERS, blocks, (uintptr_t)r->mem);
    memset(r->mem, POISON, REGION);
    char why[KVB_KV_REASON_MAX];
    cr_assert_eq(kvb_kv_agent_create(r->engine, &r->fx.l, role, &r->agent, why, sizeof why), KVB_OK,
                 "%s", why);
}

static void rank_fini(rank_t *r)
{
    kvb_kv_agent_destroy(r->agent);
    kvb_engine_destroy(r->engine);
    munmap(r->mem, REGION);
}

/* ---- the prefill process, driven by line commands on a pipe --------------------------------- */

typedef struct {
    pid_t pid;
    FILE *to, *from;
    char seg[2][KVB_NAME_MAX + 1];
} child_t;

static void child_serve(bool mla, FILE *in, FILE *out)
{
    rank_t r[2];
    kvb_kv_link_t *links[2][8];
    int nlinks = 0;
    for (int k = 0; k < 2; k++) {
        rank_init(&r[k], mla, 2, k, PBLOCKS, KVB_KV_ROLE_PREFILL);
        fill_source(&r[k].fx.l);
    }
    fprintf(out, "ready %s %s\n", kvb_engine_segment_name(r[0].engine),
            kvb_engine_segment_name(r[1].engine));
    fflush(out);
    char line[4096];
    while (fgets(line, sizeof line, in)) {
        char cmd[16], req[64];
        int pos = 0;
        sscanf(line, "%15s%n", cmd, &pos);
        if (!strcmp(cmd, "link")) { /* link <seg>...: every prefill rank to every decode rank */
            char seg[KVB_NAME_MAX + 1];
            int used;
            const char *p = line + pos;
            nlinks = 0;
            while (sscanf(p, "%255s%n", seg, &used) == 1) {
                for (int k = 0; k < 2; k++)
                    kvb_kv_link_open(r[k].agent, seg, &links[k][nlinks], NULL, 0);
                nlinks++;
                p += used;
            }
            fprintf(out, "linked\n");
        } else if (!strcmp(cmd, "expect")) { /* pull: the decode ranks will confirm their reads */
            sscanf(line + pos, "%63s", req);
            int rc[2];
            for (int k = 0; k < 2; k++)
                rc[k] = kvb_kv_expect(r[k].agent, req, links[k], (size_t)nlinks, 10000);
            fprintf(out, "expecting %d %d\n", rc[0], rc[1]);
        } else if (!strcmp(cmd, "wait")) {
            sscanf(line + pos, "%63s", req);
            int rc[2];
            for (int k = 0; k < 2; k++)
                rc[k] = kvb_kv_wait(r[k].agent, req, 10000);
            fprintf(out, "waited %d %d\n", rc[0], rc[1]);
        } else if (!strcmp(cmd, "push")) { /* push <req> <stall_layer> <n> src... dst... */
            int stall, n, used;
            sscanf(line + pos, "%63s %d %d%n", req, &stall, &n, &used);
            const char *p = line + pos + used;
            uint64_t src[64], dst[64];
            for (int i = 0; i < 2 * n; i++) {
                unsigned long long v;
                sscanf(p, "%llu%n", &v, &used);
                p += used;
                (i < n ? src : dst)[i % n] = v;
            }
            int rc = KVB_OK;
            kvb_kv_xfer_t *x[2][8] = {{0}};
            for (uint32_t layer = 0; layer < LAYERS; layer++) {
                for (int k = 0; k < 2; k++)
                    for (int d = 0; d < nlinks; d++) {
                        if (!kvb_kv_link_has_route(links[k][d]))
                            continue;
                        if (layer == 0)
                            kvb_kv_xfer_begin(links[k][d], req, KVB_OP_WRITE, src, dst, (size_t)n,
                                              10000, &x[k][d], NULL, 0);
                        kvb_kv_xfer_layer(x[k][d], layer);
                    }
                if ((int)layer == stall) { /* a crash mid-request: wait to be killed */
                    fprintf(out, "stalled\n");
                    fflush(out);
                    pause();
                }
            }
            for (int k = 0; k < 2; k++)
                for (int d = 0; d < nlinks; d++)
                    if (x[k][d]) {
                        int frc = kvb_kv_xfer_finish(x[k][d]);
                        rc = rc ? rc : frc;
                        kvb_kv_xfer_free(x[k][d]);
                    }
            fprintf(out, "pushed %d\n", rc);
        } else {
            break;
        }
        fflush(out);
    }
    for (int k = 0; k < 2; k++) {
        for (int d = 0; d < nlinks; d++)
            kvb_kv_link_close(links[k][d]);
        rank_fini(&r[k]);
    }
}

static void child_start(child_t *c, bool mla)
{
    int down[2], up[2];
    cr_assert_eq(pipe(down), 0);
    cr_assert_eq(pipe(up), 0);
    fflush(NULL);
    c->pid = fork();
    cr_assert_geq(c->pid, 0);
    if (c->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(down[1]);
        close(up[0]);
        child_serve(mla, fdopen(down[0], "r"), fdopen(up[1], "w"));
        _exit(0);
    }
    close(down[0]);
    close(up[1]);
    c->to = fdopen(down[1], "w");
    c->from = fdopen(up[0], "r");
    char line[1024];
    cr_assert_not_null(fgets(line, sizeof line, c->from), "prefill did not start");
    cr_assert_eq(sscanf(line, "ready %255s %255s", c->seg[0], c->seg[1]), 2);
}

static void child_cmd(child_t *c, const char *cmd, char *reply, size_t cap)
{
    fprintf(c->to, "%s\n", cmd);
    fflush(c->to);
    cr_assert_not_null(fgets(reply, (int)cap, c->from), "no reply to %s", cmd);
}

static void child_stop(child_t *c)
{
    if (c->pid <= 0)
        return;
    fprintf(c->to, "quit\n");
    fclose(c->to);
    fclose(c->from);
    waitpid(c->pid, NULL, 0);
    c->pid = 0;
}

TestSuite(kv_peer, .timeout = 120);

/* ---- scenarios ------------------------------------------------------------------------------- */

static const uint64_t SRC[] = {3, 4, 5, 9, 0, 31, 17, 18}; /* runs, gaps, out of order */
static const uint64_t DST[] = {10, 11, 12, 2, 39, 0, 20, 21};
#define NB (sizeof SRC / sizeof SRC[0])

static void link_all(rank_t *d, int dtp, child_t *c, kvb_kv_link_t *links[][2])
{
    char why[KVB_KV_REASON_MAX], cmd[2048] = "link", reply[256];
    for (int k = 0; k < dtp; k++) {
        for (int p = 0; p < 2; p++)
            cr_assert_eq(kvb_kv_link_open(d[k].agent, c->seg[p], &links[k][p], why, sizeof why),
                         KVB_OK, "%s", why);
        strcat(cmd, " ");
        strcat(cmd, kvb_engine_segment_name(d[k].engine));
    }
    child_cmd(c, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "linked\n");
}

static void run_pull(bool mla, int dtp)
{
    child_t c;
    child_start(&c, mla);
    rank_t d[4];
    kvb_kv_link_t *links[4][2];
    for (int k = 0; k < dtp; k++)
        rank_init(&d[k], mla, dtp, k, DBLOCKS, KVB_KV_ROLE_DECODE);
    link_all(d, dtp, &c, links);
    char reply[256];
    child_cmd(&c, "expect pull-1", reply, sizeof reply);
    for (int k = 0; k < dtp; k++)
        for (int p = 0; p < 2; p++) {
            if (!kvb_kv_link_has_route(links[k][p]))
                continue;
            kvb_kv_xfer_t *x;
            char why[KVB_KV_REASON_MAX];
            cr_assert_eq(kvb_kv_xfer_begin(links[k][p], "pull-1", KVB_OP_READ, SRC, DST, NB, 5000,
                                           &x, why, sizeof why),
                         KVB_OK, "%s", why);
            cr_assert_eq(kvb_kv_xfer_all(x), KVB_OK);
            cr_assert_eq(kvb_kv_xfer_finish(x), KVB_OK);
            kvb_kv_xfer_free(x);
        }
    for (int k = 0; k < dtp; k++)
        check_dest(&d[k].fx.l, SRC, DST, NB);
    /* Every prefill rank that sent data heard from every decode rank it served. */
    child_cmd(&c, "wait pull-1", reply, sizeof reply);
    int rc0, rc1;
    cr_assert_eq(sscanf(reply, "waited %d %d", &rc0, &rc1), 2);
    cr_assert(rc0 == KVB_OK || rc0 == KVB_ERR_NOT_FOUND, "rank 0: %s", kvb_status_name(rc0));
    cr_assert(rc1 == KVB_OK || rc1 == KVB_ERR_NOT_FOUND, "rank 1: %s", kvb_status_name(rc1));
    cr_assert(rc0 == KVB_OK || rc1 == KVB_OK);
    child_stop(&c);
    for (int k = 0; k < dtp; k++) {
        for (int p = 0; p < 2; p++)
            kvb_kv_link_close(links[k][p]);
        rank_fini(&d[k]);
    }
}

static void push_cmd(char *cmd, size_t cap, const char *req, int stall)
{
    int n = snprintf(cmd, cap, "push %s %d %zu", req, stall, NB);
    for (size_t i = 0; i < 2 * NB; i++)
        n += snprintf(cmd + n, cap - (size_t)n, " %llu",
                      (unsigned long long)(i < NB ? SRC[i] : DST[i - NB]));
}

static void run_push(bool mla, int dtp)
{
    child_t c;
    child_start(&c, mla);
    rank_t d[4];
    kvb_kv_link_t *links[4][2];
    for (int k = 0; k < dtp; k++)
        rank_init(&d[k], mla, dtp, k, DBLOCKS, KVB_KV_ROLE_DECODE);
    link_all(d, dtp, &c, links);
    for (int k = 0; k < dtp; k++)
        cr_assert_eq(kvb_kv_expect(d[k].agent, "push-1", links[k], 2, 10000), KVB_OK);
    char cmd[1024], reply[256];
    push_cmd(cmd, sizeof cmd, "push-1", -1);
    child_cmd(&c, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "pushed 0\n");
    for (int k = 0; k < dtp; k++) {
        cr_assert_eq(kvb_kv_wait(d[k].agent, "push-1", 5000), KVB_OK, "decode rank %d", k);
        check_dest(&d[k].fx.l, SRC, DST, NB);
    }
    child_stop(&c);
    for (int k = 0; k < dtp; k++) {
        for (int p = 0; p < 2; p++)
            kvb_kv_link_close(links[k][p]);
        rank_fini(&d[k]);
    }
}

Test(kv_peer, gqa_pull_tp2_to_tp1)
{
    run_pull(false, 1);
}

Test(kv_peer, gqa_pull_tp2_to_tp4)
{
    run_pull(false, 4);
}

Test(kv_peer, gqa_push_tp2_to_tp1)
{
    run_push(false, 1);
}

Test(kv_peer, gqa_push_tp2_to_tp4)
{
    run_push(false, 4);
}

Test(kv_peer, gqa_pull_tp2_to_tp2)
{
    run_pull(false, 2);
}

Test(kv_peer, mla_pull_tp2_to_tp1)
{
    run_pull(true, 1);
}

Test(kv_peer, mla_push_tp2_to_tp4)
{
    run_push(true, 4);
}

Test(kv_peer, mla_push_tp2_to_tp1)
{
    run_push(true, 1);
}

Test(kv_peer, mismatched_layout_is_refused_at_link_time)
{
    child_t c;
    child_start(&c, false);
    rank_t d;
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cr_assert_eq(kvb_engine_create(&cfg, &d.engine), KVB_OK);
    d.mem = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    fx_gqa(&d.fx, HEADS, 1, 0, LAYERS, DBLOCKS, (uintptr_t)d.mem);
    d.fx.l.dtype = KVB_KV_DTYPE_FP16; /* the prefill uses bf16 */
    char why[KVB_KV_REASON_MAX];
    cr_assert_eq(
        kvb_kv_agent_create(d.engine, &d.fx.l, KVB_KV_ROLE_DECODE, &d.agent, why, sizeof why),
        KVB_OK);
    kvb_kv_link_t *l = NULL;
    cr_assert_eq(kvb_kv_link_open(d.agent, c.seg[0], &l, why, sizeof why), KVB_ERR_INCOMPATIBLE);
    cr_assert_null(l);
    cr_assert(strstr(why, "dtype") != NULL, "reason: %s", why);
    child_stop(&c);
    rank_fini(&d);
}

/* Two ranks of one role have nothing to move between them; their layouts can match, so the
 * guard passed such a pair (ALLOW_HOMO), and each took the other's blocks for its side's. */
Test(kv_peer, two_ranks_of_one_role_are_refused_at_link_time)
{
    rank_t d[2];
    for (int k = 0; k < 2; k++)
        rank_init(&d[k], false, 1, 0, DBLOCKS, KVB_KV_ROLE_DECODE);
    kvb_kv_link_t *l = NULL;
    char why[KVB_KV_REASON_MAX];
    int rc =
        kvb_kv_link_open(d[0].agent, kvb_engine_segment_name(d[1].engine), &l, why, sizeof why);
    cr_assert_eq(rc, KVB_ERR_INCOMPATIBLE, "decode to decode: %s", kvb_status_name(rc));
    cr_assert_null(l);
    cr_assert(strstr(why, "both ends are decode ranks") != NULL, "reason: %s", why);
    /* A peer that publishes a layout but no role (a build from before roles) still links. */
    rank_t p;
    rank_init(&p, false, 1, 0, DBLOCKS, KVB_KV_ROLE_PREFILL);
    cr_assert_eq(kvb_engine_set_attr(p.engine, KVB_KV_ROLE_ATTR, NULL, 0), KVB_OK);
    rc = kvb_kv_link_open(d[0].agent, kvb_engine_segment_name(p.engine), &l, why, sizeof why);
    cr_assert_eq(rc, KVB_OK, "a peer without a role: %s: %s", kvb_status_name(rc), why);
    kvb_kv_link_close(l);
    rank_fini(&p);
    for (int k = 0; k < 2; k++)
        rank_fini(&d[k]);
}

/* A GQA prefill process (TP 2) and one decode rank (TP 1) here, linked both ways. */
static void one_decode(child_t *c, rank_t *d, kvb_kv_link_t *links[][2])
{
    child_start(c, false);
    rank_init(d, false, 1, 0, DBLOCKS, KVB_KV_ROLE_DECODE);
    link_all(d, 1, c, links);
}

/* A transfer's timeout bounds the whole transfer, from its begin: a layer started after it has
 * passed does not move (it used to get a fresh timeout of its own, overrunning whatever grant of
 * the blocks the timeout stood for), and the transfer fails on both sides (a layer that could
 * not start used to leave kvb_kv_xfer_finish reporting success to the other side). */
Test(kv_peer, a_layer_started_past_the_timeout_fails_the_transfer)
{
    child_t c;
    rank_t d;
    kvb_kv_link_t *links[1][2];
    one_decode(&c, &d, links);
    char reply[256];
    child_cmd(&c, "expect late-1", reply, sizeof reply);
    for (int p = 0; p < 2; p++) {
        kvb_kv_xfer_t *x;
        char why[KVB_KV_REASON_MAX];
        cr_assert_eq(kvb_kv_xfer_begin(links[0][p], "late-1", KVB_OP_READ, SRC, DST, NB, 300, &x,
                                       why, sizeof why),
                     KVB_OK, "%s", why);
        cr_assert_eq(kvb_kv_xfer_layer(x, 0), KVB_OK);
        usleep(400000);
        int rc = kvb_kv_xfer_layer(x, 1);
        cr_assert_eq(rc, KVB_ERR_TIMEOUT, "layer 1, 400 ms into a 300 ms transfer: %s",
                     kvb_status_name(rc));
        cr_assert_eq(kvb_kv_xfer_all(x), KVB_ERR_TIMEOUT);
        rc = kvb_kv_xfer_finish(x);
        cr_assert_eq(rc, KVB_ERR_TIMEOUT, "finish: %s", kvb_status_name(rc));
        kvb_kv_xfer_free(x);
    }
    /* Both prefill ranks heard that the reads failed, so neither frees its blocks as read - at
     * once, not at the end of their 10 s wait (which would end the same way). */
    uint64_t t0 = kvb__now_ns();
    child_cmd(&c, "wait late-1", reply, sizeof reply);
    double secs = (kvb__now_ns() - t0) / 1e9;
    int rc0, rc1;
    cr_assert_eq(sscanf(reply, "waited %d %d", &rc0, &rc1), 2);
    cr_assert_eq(rc0, KVB_ERR_TIMEOUT, "rank 0: %s", kvb_status_name(rc0));
    cr_assert_eq(rc1, KVB_ERR_TIMEOUT, "rank 1: %s", kvb_status_name(rc1));
    cr_assert_lt(secs, 5.0, "the prefill ranks heard nothing: they waited %.1f s", secs);
    child_stop(&c);
    for (int p = 0; p < 2; p++)
        kvb_kv_link_close(links[0][p]);
    rank_fini(&d);
}

Test(kv_peer, killed_sender_fails_its_request_only)
{
    child_t a, b;
    child_start(&a, false);
    child_start(&b, false);
    rank_t d;
    rank_init(&d, false, 1, 0, DBLOCKS, KVB_KV_ROLE_DECODE);
    kvb_kv_link_t *la[1][2], *lb[1][2];
    link_all(&d, 1, &a, la);
    link_all(&d, 1, &b, lb);
    cr_assert_eq(kvb_kv_expect(d.agent, "req-a", la[0], 2, 10000), KVB_OK);
    cr_assert_eq(kvb_kv_expect(d.agent, "req-b", lb[0], 2, 10000), KVB_OK);
    char cmd[1024], reply[256];
    push_cmd(cmd, sizeof cmd, "req-a", 0); /* a pushes layer 0, then stalls */
    child_cmd(&a, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "stalled\n");
    kill(a.pid, SIGKILL);
    waitpid(a.pid, NULL, 0);
    uint64_t t0 = kvb__now_ns();
    int rc = kvb_kv_wait(d.agent, "req-a", 10000);
    cr_assert_eq(rc, KVB_ERR_PEER_LOST, "got %s", kvb_status_name(rc));
    cr_assert_lt(kvb__now_ns() - t0, 2000000000ull);
    /* b's request, into other blocks of the same decode rank, is unaffected. */
    static const uint64_t dst_b[] = {30, 31, 32, 33, 34, 35, 36, 37};
    int n = snprintf(cmd, sizeof cmd, "push req-b -1 %zu", NB);
    for (size_t i = 0; i < NB; i++)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %llu", (unsigned long long)SRC[i]);
    for (size_t i = 0; i < NB; i++)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %llu", (unsigned long long)dst_b[i]);
    child_cmd(&b, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "pushed 0\n");
    cr_assert_eq(kvb_kv_wait(d.agent, "req-b", 5000), KVB_OK);
    /* Check b's blocks only (a's layer 0 landed in DST before the kill). */
    const kvb_kv_layout_t *l = &d.fx.l;
    for (size_t i = 0; i < l->num_slots; i++) {
        const kvb_kv_slot_t *s = &l->slots[i];
        const uint8_t *p = (const uint8_t *)(uintptr_t)s->base;
        for (size_t k = 0; k < NB; k++)
            for (uint64_t o = 0; o < s->block_bytes; o++) {
                uint32_t h;
                uint64_t rem;
                locate(l, s, o, &h, &rem);
                cr_assert_eq(p[dst_b[k] * s->block_bytes + o],
                             expected(s->layer, s->kind, SRC[k], h, rem));
            }
    }
    a.pid = 0;
    fclose(a.to);
    fclose(a.from);
    child_stop(&b);
    for (int p = 0; p < 2; p++) {
        kvb_kv_link_close(la[0][p]);
        kvb_kv_link_close(lb[0][p]);
    }
    rank_fini(&d);
}

/* A receiver that polls (kvb_kv_wait with timeout 0) sees the notices come in - it used to
 * return AGAIN without ever reading them, until the request timed out although every byte had
 * landed; and a notice the sender sent just before its engine went counts: the sender's loss
 * used to be applied before the queue was read, failing a complete transfer as PEER_LOST. */
Test(kv_peer, notices_reach_a_poller_and_outlive_their_sender)
{
    child_t c;
    rank_t d;
    kvb_kv_link_t *links[1][2];
    one_decode(&c, &d, links);
    cr_assert_eq(kvb_kv_expect(d.agent, "polled", links[0], 2, 10000), KVB_OK);
    cr_assert_eq(kvb_kv_expect(d.agent, "orphan", links[0], 2, 10000), KVB_OK);
    char cmd[1024], reply[256];
    push_cmd(cmd, sizeof cmd, "polled", -1);
    child_cmd(&c, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "pushed 0\n");
    int rc = KVB_ERR_AGAIN;
    uint64_t dl = kvb__deadline_ms(3000);
    while ((rc = kvb_kv_wait(d.agent, "polled", 0)) == KVB_ERR_AGAIN && kvb__now_ns() < dl)
        usleep(10000);
    cr_assert_eq(rc, KVB_OK, "polling: %s", kvb_status_name(rc));
    push_cmd(cmd, sizeof cmd, "orphan", -1);
    child_cmd(&c, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "pushed 0\n"); /* both notices queued here: kvb_notify_send waits */
    child_stop(&c);                        /* and the sender's engines go */
    usleep(200000);                        /* long enough for the loss to show */
    rc = kvb_kv_wait(d.agent, "orphan", 5000);
    cr_assert_eq(rc, KVB_OK, "after the sender left: %s", kvb_status_name(rc));
    check_dest(&d.fx.l, SRC, DST, NB);
    for (int p = 0; p < 2; p++)
        kvb_kv_link_close(links[0][p]);
    rank_fini(&d);
}

/* A notice names the sending engine, not a link, and two links can lead to one engine (one still
 * open from before that engine reconnected, say). It used to count for the first link of that
 * name, so a request that expected the second one never heard it and timed out with every byte
 * in place - whether the notice came before kvb_kv_expect or after. */
Test(kv_peer, a_notice_counts_for_the_link_its_request_expects)
{
    child_t c;
    rank_t d;
    kvb_kv_link_t *old[1][2], *links[1][2];
    one_decode(&c, &d, old);
    char why[KVB_KV_REASON_MAX];
    for (int p = 0; p < 2; p++)
        cr_assert_eq(kvb_kv_link_open(d.agent, c.seg[p], &links[0][p], why, sizeof why), KVB_OK,
                     "%s", why);
    cr_assert_eq(kvb_kv_expect(d.agent, "expected-first", links[0], 2, 10000), KVB_OK);
    char cmd[1024], reply[256];
    push_cmd(cmd, sizeof cmd, "expected-first", -1);
    child_cmd(&c, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "pushed 0\n");
    int rc = kvb_kv_wait(d.agent, "expected-first", 3000);
    cr_assert_eq(rc, KVB_OK, "notice after expect: %s", kvb_status_name(rc));
    push_cmd(cmd, sizeof cmd, "expected-late", -1);
    child_cmd(&c, cmd, reply, sizeof reply);
    cr_assert_str_eq(reply, "pushed 0\n"); /* both notices are here before the expect */
    cr_assert_eq(kvb_kv_agent_notify_recv(d.agent, &(kvb_notification_t){0}, 0), KVB_ERR_AGAIN);
    cr_assert_eq(kvb_kv_expect(d.agent, "expected-late", links[0], 2, 10000), KVB_OK);
    rc = kvb_kv_wait(d.agent, "expected-late", 3000);
    cr_assert_eq(rc, KVB_OK, "notice before expect: %s", kvb_status_name(rc));
    check_dest(&d.fx.l, SRC, DST, NB);
    child_stop(&c);
    for (int p = 0; p < 2; p++) {
        kvb_kv_link_close(old[0][p]);
        kvb_kv_link_close(links[0][p]);
    }
    rank_fini(&d);
}
