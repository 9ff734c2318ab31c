/* SPDX-License-Identifier: Apache-2.0 */
/* Engines that find each other through a real metadata store (Redis, etcd, kvbridge
 * metadata-server), each test once per store: open by name and move verified bytes; the owner
 * killed (its key expires within the TTL, opening fails "segment not found"); a restart or a
 * takeover under the same name (peers reach the new incarnation); the store stopped mid-run
 * (linked transfers go on, new opens fail "metadata store unreachable", then recover). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/peer.h"
#include "helpers/store.h"
#include "kvbridge/engine.h"
#include "meta/meta.h"

#define TTL_MS 2000u
#define LEN    (4u << 20)

typedef struct {
    test_store_t store;
    kvb_engine_t *eng;
    uint8_t *buf;
} fixture_t;

static void setup(fixture_t *f, test_store_kind_t kind)
{
    memset(f, 0, sizeof *f);
    cr_assert_eq(test_store_start(&f->store, kind), 0, "cannot start %s",
                 test_store_kind_name(kind));
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.metadata = f->store.uri;
    cfg.metadata_ttl_ms = TTL_MS;
    cfg.segment_name = "decode-0";
    cfg.timeout_ms = 5000;
    cfg.connect_timeout_ms = 2000;
    cr_assert_eq(kvb_engine_create(&cfg, &f->eng), KVB_OK);
    f->buf = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(f->buf, MAP_FAILED);
    cr_assert_eq(kvb_register(f->eng, f->buf, LEN, "cpu:0", KVB_ACCESS_RW), KVB_OK);
}

static void teardown(fixture_t *f)
{
    kvb_engine_destroy(f->eng);
    munmap(f->buf, LEN);
    test_store_stop(&f->store);
}

static void start_peer(fixture_t *f, test_peer_t *p, const char *name, uint64_t seed)
{
    test_peer_opts_t o = {.metadata = f->store.uri, .name = name, .ttl_ms = TTL_MS};
    cr_assert_eq(test_peer_start_opts(p, 0, seed, &o), 0, "peer %s did not start", name);
    cr_assert_str_eq(p->name, name);
}

/* READs LEN bytes at offset `off` of the peer's RW region; returns the batch's status. */
static int read_at(fixture_t *f, kvb_segment_t seg, const test_peer_t *p, uint64_t off)
{
    kvb_request_t r = {.opcode = KVB_OP_READ,
                       .local = f->buf,
                       .segment = seg,
                       .remote = p->rw_addr + off,
                       .len = LEN};
    kvb_batch_t *b;
    int rc = kvb_batch_submit(f->eng, &r, 1, NULL, &b);
    if (rc)
        return rc;
    rc = kvb_batch_wait(b, 10000);
    if (rc == KVB_OK) {
        kvb_req_status_t st;
        kvb_batch_status(b, 0, &st);
        rc = st.state == KVB_REQ_COMPLETED ? KVB_OK : st.error;
    }
    kvb_batch_free(b);
    return rc;
}

static void expect_read(fixture_t *f, kvb_segment_t seg, const test_peer_t *p, uint64_t off,
                        uint64_t seed)
{
    memset(f->buf, 0, LEN);
    int rc = read_at(f, seg, p, off);
    cr_assert_eq(rc, KVB_OK, "READ failed: %s", kvb_strerror(rc));
    cr_assert_eq(test_pattern_check(f->buf, off, LEN, seed), -1, "READ brought wrong bytes");
}

static char *descriptor(fixture_t *f, const char *name)
{
    kvb_meta_t *m;
    cr_assert_eq(kvb__meta_open(f->store.uri, 2000, 0, &m), KVB_OK);
    char key[256], *v = NULL;
    size_t len;
    snprintf(key, sizeof key, "kvbridge/default/segments/%s", name);
    int rc = kvb__meta_get(m, key, &v, &len);
    kvb__meta_close(m);
    cr_assert(rc == KVB_OK || rc == KVB_ERR_NOT_FOUND, "store lookup: %s", kvb_strerror(rc));
    return v;
}

TEST_STORE_EACH(meta_engine, open_by_name)

ParameterizedTest(test_store_kind_t *kind, meta_engine, open_by_name, .timeout = 90)
{
    fixture_t f;
    setup(&f, *kind);
    test_peer_t p;
    start_peer(&f, &p, "prefill-0", 7);
    kvb_segment_t seg;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &seg), KVB_OK);
    kvb_region_info_t r[4];
    size_t n;
    cr_assert_eq(kvb_segment_regions(f.eng, seg, 0, r, 4, &n), KVB_OK);
    cr_assert_eq(n, 2);

    /* the published descriptor says what the handshake says - once the peer's keeper has sent
     * it: a region registered after the engine started is published in the background, so the
     * store may still hold the descriptor of one region when the handshake shows two */
    json_t *d = NULL;
    uint64_t until = kvb__deadline_ms(5000);
    do {
        json_decref(d);
        if (d)
            usleep(20000);
        char *text = descriptor(&f, "prefill-0");
        cr_assert_not_null(text, "no descriptor in the store");
        d = json_loads(text, 0, NULL);
        free(text);
    } while (json_array_size(json_object_get(d, "regions")) != 2 && kvb__now_ns() < until);
    uint64_t inc;
    cr_assert_eq(kvb_segment_incarnation(f.eng, seg, &inc), KVB_OK);
    char want[17];
    snprintf(want, sizeof want, "%016llx", (unsigned long long)inc);
    cr_assert_eq(json_integer_value(json_object_get(d, "kvbridge")), 1);
    cr_assert_str_eq(json_string_value(json_object_get(d, "name")), "prefill-0");
    cr_assert_str_eq(json_string_value(json_object_get(d, "incarnation")), want);
    cr_assert_eq(json_array_size(json_object_get(d, "regions")), 2);
    cr_assert_eq(json_integer_value(
                     json_object_get(json_array_get(json_object_get(d, "addresses"), 0), "port")),
                 p.port);
    json_decref(d);

    /* every byte of a READ, then a WRITE that the peer checks and answers by opening us by name */
    for (uint64_t off = 0; off < TEST_PEER_RW_LEN; off += 3 * LEN)
        expect_read(&f, seg, &p, off, 7);
    test_pattern_fill(f.buf, 4096, LEN, 99);
    kvb_request_t w = {.opcode = KVB_OP_WRITE,
                       .local = f.buf,
                       .segment = seg,
                       .remote = p.rw_addr + 4096,
                       .len = LEN};
    kvb_batch_t *b;
    char msg[64];
    snprintf(msg, sizeof msg, "verify 99 4096 %u", LEN);
    kvb_batch_opts_t o = {.notify_segment = seg, .notify = msg, .notify_len = strlen(msg)};
    cr_assert_eq(kvb_batch_submit(f.eng, &w, 1, &o, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, 10000), KVB_OK);
    kvb_batch_free(b);
    kvb_notification_t *nt = malloc(sizeof *nt);
    cr_assert_eq(kvb_notify_recv(f.eng, nt, 10000), KVB_OK, "the peer did not answer");
    cr_assert_eq(nt->len, 2, "peer says '%.*s'", (int)nt->len, nt->data);
    cr_assert_eq(memcmp(nt->data, "ok", 2), 0);
    cr_assert_str_eq(nt->from, "prefill-0");
    free(nt);

    kvb_segment_t none;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-9", &none), KVB_ERR_SEGMENT_NOT_FOUND);
    kvb_segment_close(f.eng, seg);
    test_peer_stop(&p);
    /* a clean stop withdraws the descriptor at once */
    char *text = descriptor(&f, "prefill-0");
    cr_assert_null(text, "descriptor left behind by a clean stop");
    teardown(&f);
}

TEST_STORE_EACH(meta_engine, owner_killed)

ParameterizedTest(test_store_kind_t *kind, meta_engine, owner_killed, .timeout = 90)
{
    fixture_t f;
    setup(&f, *kind);
    test_peer_t p;
    start_peer(&f, &p, "prefill-0", 7);
    kvb_segment_t seg;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &seg), KVB_OK);
    expect_read(&f, seg, &p, 0, 7);
    test_peer_signal(&p, SIGKILL);
    uint64_t t0 = kvb__now_ns();
    char *text;
    while ((text = descriptor(&f, "prefill-0")) != NULL) {
        free(text);
        cr_assert_lt(kvb__now_ns() - t0, (TTL_MS + 2000) * 1000000ull,
                     "the key of a dead owner outlived its TTL");
        usleep(100000);
    }
    cr_log_info("%s: key gone %.0f ms after SIGKILL (TTL %u ms)", test_store_kind_name(*kind),
                (double)(kvb__now_ns() - t0) / 1e6, TTL_MS);
    int rc = read_at(&f, seg, &p, 0);
    cr_assert(KVB_IS_PEER_ERROR(rc), "a READ from a dead peer: %s", kvb_strerror(rc));
    kvb_segment_t again;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &again), KVB_ERR_SEGMENT_NOT_FOUND);
    teardown(&f);
}

TEST_STORE_EACH(meta_engine, restart_and_takeover)

ParameterizedTest(test_store_kind_t *kind, meta_engine, restart_and_takeover, .timeout = 90)
{
    fixture_t f;
    setup(&f, *kind);
    test_peer_t a, b, c;
    start_peer(&f, &a, "prefill-0", 1);
    kvb_segment_t seg;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &seg), KVB_OK);
    expect_read(&f, seg, &a, 0, 1);
    uint64_t inc_a, inc_b, inc_c;
    kvb_segment_incarnation(f.eng, seg, &inc_a);

    /* restart: the owner dies and comes back on another port with other data */
    test_peer_signal(&a, SIGKILL);
    start_peer(&f, &b, "prefill-0", 2);
    cr_assert_neq(b.port, a.port);
    int rc = read_at(&f, seg, &b, 0);
    cr_assert(KVB_IS_PEER_ERROR(rc), "the old handle must not reach the new owner: %s",
              kvb_strerror(rc));
    kvb_segment_t seg2;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &seg2), KVB_OK);
    cr_assert_eq(seg2, seg, "a reopen keeps the handle");
    kvb_segment_incarnation(f.eng, seg, &inc_b);
    cr_assert_neq(inc_b, inc_a);
    expect_read(&f, seg, &b, LEN, 2);

    /* takeover: a new owner publishes the name while the old one still runs; revalidation
     * (every TTL/3) fails the segment, and a reopen reaches the new owner */
    start_peer(&f, &c, "prefill-0", 3);
    uint64_t t0 = kvb__now_ns();
    while ((rc = read_at(&f, seg, &b, 0)) == KVB_OK) {
        cr_assert_lt(kvb__now_ns() - t0, 3ull * TTL_MS * 1000000ull,
                     "the segment was not revalidated");
        usleep(50000);
    }
    cr_assert_eq(rc, KVB_ERR_PEER_RESTARTED, "%s", kvb_strerror(rc));
    cr_log_info("%s: takeover noticed after %.0f ms", test_store_kind_name(*kind),
                (double)(kvb__now_ns() - t0) / 1e6);
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &seg2), KVB_OK);
    kvb_segment_incarnation(f.eng, seg, &inc_c);
    cr_assert(inc_c != inc_b && inc_c != inc_a);
    expect_read(&f, seg, &c, 0, 3);
    test_peer_stop(&b);
    test_peer_stop(&c);
    teardown(&f);
}

TEST_STORE_EACH(meta_engine, store_outage)

ParameterizedTest(test_store_kind_t *kind, meta_engine, store_outage, .timeout = 120)
{
    fixture_t f;
    setup(&f, *kind);
    test_peer_t a, b;
    start_peer(&f, &a, "prefill-0", 1);
    start_peer(&f, &b, "prefill-1", 2);
    kvb_segment_t seg;
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-0", &seg), KVB_OK);
    cr_assert_eq(test_store_halt(&f.store), 0);

    /* linked transfers go on, for longer than a TTL */
    uint64_t end = kvb__deadline_ms(TTL_MS + 1000);
    int rounds = 0;
    while (kvb__now_ns() < end || rounds < 10) {
        expect_read(&f, seg, &a, (uint64_t)(rounds % 7) * LEN, 1);
        rounds++;
    }
    /* new opens fail promptly and clearly */
    kvb_segment_t s1;
    uint64_t t0 = kvb__now_ns();
    cr_assert_eq(kvb_segment_open(f.eng, "prefill-1", &s1), KVB_ERR_META_UNREACHABLE);
    cr_assert_lt(kvb__now_ns() - t0, 2500000000ull);

    /* the store returns (Redis and the HTTP server empty): owners republish, opens succeed */
    cr_assert_eq(test_store_restart(&f.store), 0);
    uint64_t deadline = kvb__deadline_ms(2 * TTL_MS + 3000);
    int rc;
    while ((rc = kvb_segment_open(f.eng, "prefill-1", &s1)) != KVB_OK && kvb__now_ns() < deadline)
        usleep(100000);
    cr_assert_eq(rc, KVB_OK, "no open after the store came back: %s", kvb_strerror(rc));
    expect_read(&f, s1, &b, 0, 2);
    expect_read(&f, seg, &a, 0, 1);
    cr_log_info("%s: %d verified READs of 4 MiB during the outage", test_store_kind_name(*kind),
                rounds);
    test_peer_stop(&a);
    test_peer_stop(&b);
    teardown(&f);
}

Test(meta_engine, bad_config, .timeout = 30)
{
    kvb_config_t cfg;
    kvb_engine_t *e = NULL;
    kvb_config_init(&cfg);
    cfg.metadata = "etcd://nohost";
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_ERR_INVALID_ARG);
    cfg.metadata = "zk://127.0.0.1:1";
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_ERR_UNSUPPORTED);
    cfg.metadata = "p2p";
    cfg.cluster = "a/b";
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_ERR_INVALID_ARG);
    cfg.cluster = "prod";
    cfg.metadata_ttl_ms = 10;
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_ERR_INVALID_ARG);
    /* a store that is not there: create fails, clearly, without hanging */
    kvb_config_init(&cfg);
    uint16_t port = test_free_port();
    char uri[64];
    snprintf(uri, sizeof uri, "redis://127.0.0.1:%u", port);
    cfg.metadata = uri;
    cr_assert_eq(kvb_engine_create(&cfg, &e), KVB_ERR_META_UNREACHABLE);
    cr_assert_null(e);
}
