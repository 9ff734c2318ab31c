/* SPDX-License-Identifier: Apache-2.0 */
/* ABI check: a program that sees kvbridge as an embedding engine does - the public headers and
 * libkvbridge.so, nothing else - and calls every public function at least once with valid
 * arguments, checking what each returns. KVB_ABI_FUNCTIONS lists those functions; check_symbols.sh
 * compares the list with the headers' KVB_API declarations and the library's exports. */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvbridge/engine.h>
#include <kvbridge/kv.h>
#include <kvbridge/status.h>

/* Every public function, in header order. A new one is one line here plus a call below: the
 * program fails while a listed function is never called through CALL(), and check_symbols.sh
 * fails while a public function is missing from this list. */
#define KVB_ABI_FUNCTIONS(X)                                                                       \
    /* status.h */                                                                                 \
    X(kvb_strerror)                                                                                \
    X(kvb_status_name)                                                                             \
    /* engine.h */                                                                                 \
    X(kvb_config_init_v)                                                                           \
    X(kvb_engine_create)                                                                           \
    X(kvb_engine_destroy)                                                                          \
    X(kvb_engine_stats)                                                                            \
    X(kvb_stats_bytes)                                                                             \
    X(kvb_engine_segment_name)                                                                     \
    X(kvb_engine_port)                                                                             \
    X(kvb_engine_fabric_provider)                                                                  \
    X(kvb_engine_tcp_congestion)                                                                   \
    X(kvb_engine_busy_poll_us)                                                                     \
    X(kvb_engine_linger_us)                                                                        \
    X(kvb_engine_cpus)                                                                             \
    X(kvb_alloc)                                                                                   \
    X(kvb_free)                                                                                    \
    X(kvb_register)                                                                                \
    X(kvb_unregister)                                                                              \
    X(kvb_segment_open)                                                                            \
    X(kvb_segment_close)                                                                           \
    X(kvb_segment_regions)                                                                         \
    X(kvb_engine_set_attr)                                                                         \
    X(kvb_segment_attr)                                                                            \
    X(kvb_segment_refresh)                                                                         \
    X(kvb_segment_transport)                                                                       \
    X(kvb_segment_incarnation)                                                                     \
    X(kvb_batch_submit)                                                                            \
    X(kvb_batch_size)                                                                              \
    X(kvb_batch_status)                                                                            \
    X(kvb_batch_wait)                                                                              \
    X(kvb_batch_cancel)                                                                            \
    X(kvb_batch_settle)                                                                            \
    X(kvb_batch_free)                                                                              \
    X(kvb_notify_send)                                                                             \
    X(kvb_notify_recv)                                                                             \
    X(kvb_notify_reply)                                                                            \
    X(kvb_log_set_level)                                                                           \
    /* kv.h */                                                                                     \
    X(kvb_kv_slot_name)                                                                            \
    X(kvb_kv_layout_validate)                                                                      \
    X(kvb_kv_layout_check_pair)                                                                    \
    X(kvb_kv_layout_topo)                                                                          \
    X(kvb_kv_layout_encode)                                                                        \
    X(kvb_kv_layout_decode)                                                                        \
    X(kvb_kv_layout_free)                                                                          \
    X(kvb_kv_verdict_name)                                                                         \
    X(kvb_kv_guard_topo)                                                                           \
    X(kvb_kv_guard)                                                                                \
    X(kvb_kv_route)                                                                                \
    X(kvb_kv_plan)                                                                                 \
    X(kvb_kv_plan_free)                                                                            \
    X(kvb_kv_agent_create)                                                                         \
    X(kvb_kv_agent_destroy)                                                                        \
    X(kvb_kv_link_open)                                                                            \
    X(kvb_kv_link_close)                                                                           \
    X(kvb_kv_link_verdict)                                                                         \
    X(kvb_kv_link_layout)                                                                          \
    X(kvb_kv_link_has_route)                                                                       \
    X(kvb_kv_xfer_begin)                                                                           \
    X(kvb_kv_xfer_layer)                                                                           \
    X(kvb_kv_xfer_all)                                                                             \
    X(kvb_kv_xfer_finish)                                                                          \
    X(kvb_kv_xfer_settle)                                                                          \
    X(kvb_kv_xfer_free)                                                                            \
    X(kvb_kv_give_up)                                                                              \
    X(kvb_kv_expect)                                                                               \
    X(kvb_kv_wait)                                                                                 \
    X(kvb_kv_agent_notify_recv)

enum {
#define ABI_ENUM(fn) ABI_##fn,
    KVB_ABI_FUNCTIONS(ABI_ENUM)
#undef ABI_ENUM
        ABI_COUNT
};

/* Taking each function's address makes the program reference every symbol, so a missing one fails
 * the link (or, with LD_BIND_NOW, the start) even before its call is reached. */
static const struct {
    const char *name;
    void (*addr)(void);
} abi_functions[ABI_COUNT] = {
#define ABI_ENTRY(fn) {#fn, (void (*)(void))fn},
    KVB_ABI_FUNCTIONS(ABI_ENTRY)
#undef ABI_ENTRY
};

static unsigned char abi_called[ABI_COUNT];

/* Calls a public function and records that it was called. */
#define CALL(fn, ...) (abi_called[ABI_##fn] = 1, fn(__VA_ARGS__))

/* Checks stop the program at the first failure: later calls would only fail for its sake. */
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond))                                                                               \
            die(__LINE__, "check failed: %s", #cond);                                              \
    } while (0)
#define CHECK_RC(expr, want) check_rc((expr), (want), #expr, __LINE__)
#define CHECK_OK(expr)       CHECK_RC(expr, KVB_OK)

__attribute__((noreturn, format(printf, 2, 3))) static void die(int line, const char *fmt, ...);

static void die(int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "abi_check.c:%d: ", line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void check_rc(int rc, int want, const char *what, int line)
{
    if (rc != want)
        die(line, "%s returned %s (%d), expected %s", what, kvb_status_name(rc), rc,
            kvb_status_name(want));
}

static void fill(uint8_t *p, size_t len, unsigned seed)
{
    for (size_t i = 0; i < len; i++)
        p[i] = (uint8_t)(i * 31u + seed * 7u + (i >> 8));
}

/* ---- status.h ------------------------------------------------------------------------------ */

static void check_status(void)
{
    /* The library's tables must agree with the caller's copy of the header's list. */
#define CHECK_STATUS(name, value, msg)                                                             \
    CHECK(strcmp(CALL(kvb_status_name, value), #name) == 0);                                       \
    CHECK(strcmp(CALL(kvb_strerror, value), msg) == 0);
    KVB_STATUS_MAP(CHECK_STATUS)
#undef CHECK_STATUS
    CHECK(CALL(kvb_strerror, 12345) != NULL);
    CHECK(CALL(kvb_status_name, 12345) != NULL);
    CHECK(KVB_IS_PEER_ERROR(KVB_ERR_PEER_LOST) && !KVB_IS_PEER_ERROR(KVB_ERR_TIMEOUT));
}

/* ---- engine.h ------------------------------------------------------------------------------ */

enum { POOL = 1 << 20, CHUNK = 64 << 10 };

/* The cluster secret both engines prove they know (16..4096 bytes). */
static const char secret[] = "the abi-check cluster secret";

static kvb_engine_t *make_engine(const char *key)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg); /* the documented macro; kvb_config_init_v below */
    CALL(kvb_config_init_v, &cfg, sizeof cfg);
    CHECK(cfg.size == sizeof cfg);
    CHECK(cfg.bind_addr && strcmp(cfg.bind_addr, "127.0.0.1") == 0);
    CHECK(cfg.port == 0 && cfg.lanes == 2 && cfg.timeout_ms == 30000 && !cfg.secret);
    cfg.timeout_ms = 10000;
    cfg.secret = key;
    cfg.secret_len = strlen(key);
    kvb_engine_t *e = NULL;
    CHECK_OK(CALL(kvb_engine_create, &cfg, &e));
    CHECK(e != NULL);
    uint16_t port = CALL(kvb_engine_port, e);
    CHECK(port != 0);
    CHECK(CALL(kvb_engine_fabric_provider, e) != NULL);   /* "" unless an RDMA NIC is here */
    CHECK(CALL(kvb_engine_tcp_congestion, e)[0] != '\0'); /* the system's default */
    CHECK(CALL(kvb_engine_busy_poll_us, e) == cfg.busy_poll_us);
    CHECK(CALL(kvb_engine_linger_us, e) ==
          (cfg.linger_us > cfg.busy_poll_us ? cfg.linger_us : cfg.busy_poll_us));
    /* "" unless KVB_CPUS binds the threads (then the list, written back with runs as ranges) */
    CHECK(CALL(kvb_engine_cpus, e) && (cfg.cpus && *cfg.cpus) == (*CALL(kvb_engine_cpus, e) != 0));
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%u", (unsigned)port);
    const char *name = CALL(kvb_engine_segment_name, e);
    CHECK(name && strcmp(name, want) == 0);
    return e;
}

/* An engine that does not know the cluster secret learns nothing. */
static void check_auth(kvb_engine_t *a)
{
    fprintf(stderr, "abi_check: an engine with another secret; the errors it logs are expected\n");
    kvb_engine_t *stranger = make_engine("not the abi-check cluster secret");
    kvb_segment_t seg = 0;
    CHECK_RC(kvb_segment_open(stranger, kvb_engine_segment_name(a), &seg), KVB_ERR_AUTH);
    kvb_engine_destroy(stranger);
}

/* a (the initiator) and b: one READ and one WRITE with a notification, then the segment queries,
 * attributes, notifications, and a's own segment opened by name. */
static void check_engine(kvb_engine_t *a, kvb_engine_t *b)
{
    uint8_t *pool = NULL;
    CHECK_OK(CALL(kvb_alloc, a, POOL, 0, (void **)&pool));
    CHECK(pool != NULL && pool[0] == 0 && pool[POOL - 1] == 0);
    CHECK_OK(CALL(kvb_register, a, pool, POOL, "cpu:0", KVB_ACCESS_RW));
    uint8_t *target = malloc(2 * CHUNK);
    CHECK(target != NULL);
    fill(target, 2 * CHUNK, 1);
    CHECK_OK(CALL(kvb_register, b, target, 2 * CHUNK, NULL, KVB_ACCESS_RW));

    kvb_segment_t peer = 0, again = 0;
    CHECK_OK(CALL(kvb_segment_open, a, kvb_engine_segment_name(b), &peer));
    CHECK(peer != 0);
    CHECK_OK(kvb_segment_open(a, kvb_engine_segment_name(b), &again));
    CHECK(again == peer); /* the same handle, one more reference */
    CHECK_OK(CALL(kvb_segment_close, a, again));

    kvb_region_info_t regions[4];
    size_t count = 0;
    CHECK_OK(CALL(kvb_segment_regions, a, peer, 1, regions, 4, &count));
    CHECK(count == 1 && regions[0].addr == (uintptr_t)target && regions[0].len == 2 * CHUNK);
    CHECK(regions[0].access == KVB_ACCESS_RW && strncmp(regions[0].location, "cpu", 3) == 0);
    const char *transport = NULL;
    CHECK_OK(CALL(kvb_segment_transport, a, peer, &transport));
    CHECK(transport && (strcmp(transport, "shm") == 0 || strcmp(transport, "tcp") == 0));
    uint64_t incarnation = 0;
    CHECK_OK(CALL(kvb_segment_incarnation, a, peer, &incarnation));
    CHECK(incarnation != 0);

    /* WRITE pool[0, CHUNK) to target[0, CHUNK); READ target[CHUNK, 2 CHUNK) into pool. */
    fill(pool, CHUNK, 2);
    static const char note[] = "abi batch done";
    kvb_request_t reqs[] = {
        {KVB_OP_WRITE, pool, peer, (uintptr_t)target, CHUNK},
        {KVB_OP_READ, pool + CHUNK, peer, (uintptr_t)target + CHUNK, CHUNK},
    };
    kvb_batch_opts_t opts = {
        .timeout_ms = 10000, .notify_segment = peer, .notify = note, .notify_len = sizeof note};
    kvb_batch_t *batch = NULL;
    CHECK_OK(CALL(kvb_batch_submit, a, reqs, 2, &opts, &batch));
    CHECK(CALL(kvb_batch_size, batch) == 2);
    CHECK_OK(CALL(kvb_batch_wait, batch, 10000));
    for (size_t i = 0; i < 2; i++) {
        kvb_req_status_t st;
        CHECK_OK(CALL(kvb_batch_status, batch, i, &st));
        CHECK(st.state == KVB_REQ_COMPLETED && st.error == KVB_OK && st.bytes == CHUNK);
    }
    CHECK(memcmp(target, pool, CHUNK) == 0);
    CHECK(memcmp(pool + CHUNK, target + CHUNK, CHUNK) == 0);
    /* Nothing is pending: cancelling changes nothing. */
    CHECK_OK(CALL(kvb_batch_cancel, batch));
    CHECK_OK(CALL(kvb_batch_settle, batch, 0)); /* completed: settled already */
    CHECK_RC(kvb_batch_settle(batch, -1), KVB_ERR_INVALID_ARG);
    kvb_req_status_t st;
    CHECK_OK(kvb_batch_status(batch, 1, &st));
    CHECK(st.state == KVB_REQ_COMPLETED);
    CALL(kvb_batch_free, batch);

    kvb_notification_t *n = malloc(sizeof *n);
    CHECK(n != NULL);
    CHECK_OK(CALL(kvb_notify_recv, b, n, 5000));
    CHECK(strcmp(n->from, kvb_engine_segment_name(a)) == 0);
    CHECK(n->len == sizeof note && memcmp(n->data, note, sizeof note) == 0);
    CHECK_RC(kvb_notify_recv(b, n, 0), KVB_ERR_AGAIN);
    /* b answers on the connection a opened; a receives it with b's name. */
    kvb_notification_t *q = malloc(sizeof *q);
    CHECK(q != NULL);
    CHECK_OK(CALL(kvb_notify_reply, b, n, "ack", 3));
    CHECK_OK(kvb_notify_recv(a, q, 5000));
    CHECK(strcmp(q->from, kvb_engine_segment_name(b)) == 0);
    CHECK(q->len == 3 && memcmp(q->data, "ack", 3) == 0);
    free(q);

    kvb_stats_t stats;
    CHECK_OK(CALL(kvb_engine_stats, a, &stats));
    CHECK(stats.requests_completed >= 2 && stats.requests_failed == 0);
    CHECK(CALL(kvb_stats_bytes, &stats, "tcp") + kvb_stats_bytes(&stats, "shm") >= 2 * CHUNK);
    CHECK(stats.npaths >= 2 && kvb_stats_bytes(&stats, "no-such-path") == 0);

    /* An attribute b publishes reaches a on refresh. */
    CHECK_OK(CALL(kvb_engine_set_attr, b, "abi.check", "hello", 5));
    CHECK_OK(CALL(kvb_segment_refresh, a, peer));
    char value[16];
    size_t len = 0;
    CHECK_OK(CALL(kvb_segment_attr, a, peer, "abi.check", value, sizeof value, &len));
    CHECK(len == 5 && memcmp(value, "hello", 5) == 0);
    CHECK_OK(kvb_engine_set_attr(b, "abi.check", NULL, 0));

    /* a's own segment, opened by the name it publishes: its region and a notification to itself. */
    kvb_segment_t self = 0;
    CHECK_OK(kvb_segment_open(a, kvb_engine_segment_name(a), &self));
    CHECK_OK(kvb_segment_regions(a, self, 0, regions, 4, &count));
    CHECK(count == 1 && regions[0].addr == (uintptr_t)pool && regions[0].len == POOL);
    CHECK(strcmp(regions[0].location, "cpu:0") == 0);
    CHECK_OK(CALL(kvb_notify_send, a, self, "to self", 7, 5000));
    CHECK_OK(kvb_notify_recv(a, n, 5000));
    CHECK(strcmp(n->from, kvb_engine_segment_name(a)) == 0);
    CHECK(n->len == 7 && memcmp(n->data, "to self", 7) == 0);
    CHECK_OK(kvb_segment_close(a, self));
    CHECK_OK(kvb_segment_close(a, peer));
    free(n);

    CHECK_OK(CALL(kvb_unregister, b, target));
    CHECK_OK(CALL(kvb_unregister, a, pool));
    CHECK_OK(CALL(kvb_free, a, pool));
    free(target);
}

/* ---- kv.h ---------------------------------------------------------------------------------- */

enum {
    HEADS = 2,
    TOKENS = 4,
    HEAD_BYTES = 16,
    BLOCK = HEADS * TOKENS * HEAD_BYTES,
    BLOCKS = 8,
    LAYERS = 2,
    SLOTS = 2 * LAYERS, /* K and V per layer */
    SLOT_BYTES = BLOCK * BLOCKS,
};

typedef struct {
    kvb_kv_layout_t layout;
    kvb_kv_slot_t slots[SLOTS];
    uint8_t *mem;
} side_t;

/* GQA with TP 1: per layer a K and a V buffer of BLOCKS HND blocks, one after the other in mem. */
static void side_init(side_t *s, uint8_t *mem)
{
    memset(s, 0, sizeof *s);
    s->mem = mem;
    snprintf(s->layout.model, sizeof s->layout.model, "abi-model");
    s->layout.dtype = KVB_KV_DTYPE_BF16;
    s->layout.tokens_per_block = TOKENS;
    s->layout.attn = KVB_KV_ATTN_GQA;
    s->layout.num_kv_heads = HEADS;
    s->layout.dp_size = s->layout.tp_size = 1;
    s->layout.num_layers = LAYERS;
    s->layout.slots = s->slots;
    s->layout.num_slots = SLOTS;
    for (int i = 0; i < SLOTS; i++)
        s->slots[i] = (kvb_kv_slot_t){.layer = (uint32_t)i / 2,
                                      .kind = i % 2 ? KVB_KV_SLOT_V : KVB_KV_SLOT_K,
                                      .base = (uintptr_t)mem + (uint64_t)i * SLOT_BYTES,
                                      .len = SLOT_BYTES,
                                      .block_bytes = BLOCK,
                                      .num_blocks = BLOCKS,
                                      .num_heads = HEADS,
                                      .head_bytes = HEAD_BYTES,
                                      .order = KVB_KV_ORDER_HND};
}

/* The slot of `s` whose buffer holds addr, or NULL. */
static const kvb_kv_slot_t *slot_of(const side_t *s, uint64_t addr)
{
    for (int i = 0; i < SLOTS; i++)
        if (addr >= s->slots[i].base && addr < s->slots[i].base + s->slots[i].len)
            return &s->slots[i];
    return NULL;
}

static const uint64_t src_blocks[] = {1, 2, 3}, dst_blocks[] = {4, 5, 6};
enum { NBLOCKS = 3 };

/* The pure part: names, validation, topology, guard, routes, descriptors and plans. */
static void check_kv_pure(const side_t *prefill, const side_t *decode)
{
    char why[KVB_KV_REASON_MAX];
    CHECK(strcmp(CALL(kvb_kv_slot_name, KVB_KV_SLOT_K_SCALE), "K_SCALE") == 0);
    CHECK(strcmp(kvb_kv_slot_name(KVB_KV_SLOT_COUNT), "?") == 0);
    CHECK(strcmp(CALL(kvb_kv_verdict_name, KVB_KV_DENY_HETERO), "DENY_HETERO") == 0);

    CHECK_OK(CALL(kvb_kv_layout_validate, &prefill->layout, why, sizeof why));
    CHECK(why[0] == '\0');
    kvb_kv_layout_t bad = prefill->layout;
    bad.dtype = 0;
    CHECK_RC(kvb_kv_layout_validate(&bad, why, sizeof why), KVB_ERR_INVALID_ARG);
    CHECK(why[0] != '\0');
    CHECK_OK(CALL(kvb_kv_layout_check_pair, &decode->layout, &prefill->layout, why, sizeof why));

    kvb_kv_topo_t pt, dt;
    CHECK_OK(CALL(kvb_kv_layout_topo, &prefill->layout, &pt));
    CHECK_OK(kvb_kv_layout_topo(&decode->layout, &dt));
    CHECK(pt.dp_size == 1 && pt.tp_size == 1 && pt.attn == KVB_KV_ATTN_GQA);
    CHECK(pt.num_kv_heads == HEADS && pt.order == KVB_KV_ORDER_HND);
    CHECK(CALL(kvb_kv_guard_topo, &pt, &dt, why, sizeof why) == KVB_KV_ALLOW_HOMO);
    CHECK(why[0] != '\0');
    CHECK(CALL(kvb_kv_guard, &decode->layout, &prefill->layout, why, sizeof why) ==
          KVB_KV_ALLOW_HOMO);
    kvb_kv_route_t routes[4];
    size_t count = 0;
    CHECK_OK(CALL(kvb_kv_route, &pt, &dt, 0, routes, 4, &count));
    CHECK(count == 1 && routes[0].src_rank == 0 && routes[0].dst_rank == 0);
    CHECK(routes[0].head_begin == 0 && routes[0].head_end == HEADS);

    /* Descriptor round trip: size it, encode it, decode it, compare. */
    size_t len = 0;
    CHECK_RC(CALL(kvb_kv_layout_encode, &prefill->layout, NULL, 0, &len), KVB_ERR_TOO_LARGE);
    CHECK(len > 0);
    char *json = malloc(len + 1);
    CHECK(json != NULL);
    CHECK_OK(kvb_kv_layout_encode(&prefill->layout, json, len + 1, &len));
    CHECK(strlen(json) == len);
    kvb_kv_layout_t *copy = NULL;
    CHECK_OK(CALL(kvb_kv_layout_decode, json, len, &copy, why, sizeof why));
    CHECK(copy && strcmp(copy->model, "abi-model") == 0 && copy->num_slots == SLOTS);
    CHECK_OK(kvb_kv_layout_check_pair(copy, &prefill->layout, why, sizeof why));
    CALL(kvb_kv_layout_free, copy);
    free(json);

    /* A pull plan: blocks 1..3 of the prefill into 4..6 of the decode, one run per layer and slot.
     */
    kvb_kv_plan_args_t args = {.op = KVB_OP_READ,
                               .segment = 7,
                               .src_blocks = src_blocks,
                               .num_src = NBLOCKS,
                               .dst_blocks = dst_blocks,
                               .num_dst = NBLOCKS};
    kvb_request_t *reqs = NULL;
    CHECK_OK(CALL(kvb_kv_plan, &decode->layout, &prefill->layout, &args, &reqs, &count, why,
                  sizeof why));
    CHECK(reqs != NULL && count == SLOTS);
    for (size_t i = 0; i < count; i++) {
        const kvb_kv_slot_t *l = slot_of(decode, (uintptr_t)reqs[i].local);
        const kvb_kv_slot_t *r = slot_of(prefill, reqs[i].remote);
        CHECK(l && r && l->layer == r->layer && l->kind == r->kind);
        CHECK(reqs[i].opcode == KVB_OP_READ && reqs[i].segment == 7);
        CHECK(reqs[i].len == NBLOCKS * BLOCK);
        CHECK((uintptr_t)reqs[i].local == l->base + dst_blocks[0] * BLOCK);
        CHECK(reqs[i].remote == r->base + src_blocks[0] * BLOCK);
    }
    CALL(kvb_kv_plan_free, reqs);
}

/* Agents on two engines: the decode rank pulls three blocks and tells the prefill, which waits. */
static void check_kv_agents(kvb_engine_t *pe, kvb_engine_t *de, side_t *prefill, side_t *decode)
{
    char why[KVB_KV_REASON_MAX];
    fill(prefill->mem, SLOTS * SLOT_BYTES, 3);
    memset(decode->mem, 0xee, SLOTS * SLOT_BYTES);
    kvb_kv_agent_t *pa = NULL, *da = NULL;
    CHECK_OK(
        CALL(kvb_kv_agent_create, pe, &prefill->layout, KVB_KV_ROLE_PREFILL, &pa, why, sizeof why));
    CHECK_OK(kvb_kv_agent_create(de, &decode->layout, KVB_KV_ROLE_DECODE, &da, why, sizeof why));

    kvb_kv_link_t *dl = NULL, *pl = NULL;
    CHECK_OK(CALL(kvb_kv_link_open, da, kvb_engine_segment_name(pe), &dl, why, sizeof why));
    CHECK_OK(kvb_kv_link_open(pa, kvb_engine_segment_name(de), &pl, why, sizeof why));
    CHECK(CALL(kvb_kv_link_verdict, dl) == KVB_KV_ALLOW_HOMO);
    const kvb_kv_layout_t *remote = CALL(kvb_kv_link_layout, dl);
    CHECK(remote && remote->num_layers == LAYERS && remote->num_slots == SLOTS);
    CHECK(strcmp(remote->model, "abi-model") == 0);
    CHECK(CALL(kvb_kv_link_has_route, dl) == 1);

    CHECK_OK(CALL(kvb_kv_expect, pa, "abi-req-1", &pl, 1, 10000));
    kvb_kv_xfer_t *x = NULL;
    CHECK_OK(CALL(kvb_kv_xfer_begin, dl, "abi-req-1", KVB_OP_READ, src_blocks, dst_blocks, NBLOCKS,
                  10000, &x, why, sizeof why));
    CHECK_OK(CALL(kvb_kv_xfer_layer, x, 0));
    CHECK_OK(CALL(kvb_kv_xfer_all, x));
    CHECK_OK(CALL(kvb_kv_xfer_finish, x));
    CHECK_OK(CALL(kvb_kv_xfer_settle, x, 0));
    CALL(kvb_kv_xfer_free, x);
    CHECK_OK(CALL(kvb_kv_wait, pa, "abi-req-1", 10000));
    CHECK_OK(kvb_kv_expect(pa, "abi-req-2", &pl, 1, 10000));
    CHECK_OK(CALL(kvb_kv_give_up, dl, "abi-req-2", 10000));
    CHECK(kvb_kv_wait(pa, "abi-req-2", 10000) == KVB_ERR_CANCELED);
    for (int i = 0; i < SLOTS; i++) {
        const uint8_t *src = (const uint8_t *)(uintptr_t)prefill->slots[i].base;
        const uint8_t *dst = (const uint8_t *)(uintptr_t)decode->slots[i].base;
        CHECK(memcmp(dst + dst_blocks[0] * BLOCK, src + src_blocks[0] * BLOCK, NBLOCKS * BLOCK) ==
              0);
        for (size_t b = 0; b < BLOCKS * BLOCK; b++)
            if (b < dst_blocks[0] * BLOCK || b >= (dst_blocks[0] + NBLOCKS) * BLOCK)
                CHECK(dst[b] == 0xee);
    }

    /* A notification that is not the agents' own is kept for kvb_kv_agent_notify_recv. */
    kvb_segment_t seg = 0;
    CHECK_OK(kvb_segment_open(de, kvb_engine_segment_name(pe), &seg));
    CHECK_OK(kvb_notify_send(de, seg, "plain", 5, 5000));
    kvb_notification_t *n = malloc(sizeof *n);
    CHECK(n != NULL);
    CHECK_OK(CALL(kvb_kv_agent_notify_recv, pa, n, 5000));
    CHECK(n->len == 5 && memcmp(n->data, "plain", 5) == 0);
    CHECK(strcmp(n->from, kvb_engine_segment_name(de)) == 0);
    free(n);
    CHECK_OK(kvb_segment_close(de, seg));

    CALL(kvb_kv_link_close, dl);
    kvb_kv_link_close(pl);
    CALL(kvb_kv_agent_destroy, da);
    kvb_kv_agent_destroy(pa);
}

/* ---- main ---------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--list") == 0) {
        for (int i = 0; i < ABI_COUNT; i++)
            printf("%s\n", abi_functions[i].name);
        return 0;
    }
    /* Every function must come from the shared library, not from a copy linked in statically. */
    for (int i = 0; i < ABI_COUNT; i++) {
        Dl_info info = {0};
        if (!dladdr((void *)abi_functions[i].addr, &info) || !info.dli_fname ||
            !strstr(info.dli_fname, "libkvbridge.so"))
            die(__LINE__, "%s does not resolve into libkvbridge.so (%s)", abi_functions[i].name,
                info.dli_fname ? info.dli_fname : "?");
    }

    CALL(kvb_log_set_level, 1);
    check_status();
    kvb_engine_t *a = make_engine(secret), *b = make_engine(secret);
    check_auth(a);
    check_engine(a, b);

    uint8_t *mem = calloc(2, SLOTS * SLOT_BYTES);
    CHECK(mem != NULL);
    side_t prefill, decode;
    side_init(&prefill, mem);
    side_init(&decode, mem + SLOTS * SLOT_BYTES);
    check_kv_pure(&prefill, &decode);
    check_kv_agents(a, b, &prefill, &decode);
    free(mem);

    CALL(kvb_engine_destroy, b);
    CALL(kvb_engine_destroy, a);

    int missing = 0;
    for (int i = 0; i < ABI_COUNT; i++)
        if (!abi_called[i]) {
            fprintf(stderr, "abi_check: %s is listed but never called through CALL()\n",
                    abi_functions[i].name);
            missing = 1;
        }
    if (missing)
        return 1;
    printf("abi_check: %d public functions called through libkvbridge.so\n", ABI_COUNT);
    return 0;
}
