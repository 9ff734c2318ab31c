/* SPDX-License-Identifier: Apache-2.0 */
/* The metadata store clients against real servers (redis-server, etcd, kvbridge metadata-server)
 * started on free loopback ports: plain put/get/delete/list, TTLs, owned keys kept alive,
 * left to a process that took them over, and re-created after an outage, and the URI parser. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/store.h"
#include "meta/meta.h"

TEST_STORE_EACH(meta_client, basic)

static kvb_meta_t *client(const test_store_t *s, uint32_t ttl_ms)
{
    kvb_meta_t *m = NULL;
    cr_assert_eq(kvb__meta_open(s->uri, 2000, ttl_ms, &m), KVB_OK);
    cr_assert_not_null(m);
    return m;
}

static int get_str(kvb_meta_t *m, const char *key, char *buf, size_t cap)
{
    char *v = NULL;
    size_t len = 0;
    int rc = kvb__meta_get(m, key, &v, &len);
    if (rc == KVB_OK) {
        cr_assert_lt(len, cap);
        memcpy(buf, v, len + 1);
        free(v);
    }
    return rc;
}

/* Polls until `key` is absent (true) or `ms` passed (false). */
static bool gone_within(kvb_meta_t *m, const char *key, uint32_t ms)
{
    uint64_t deadline = kvb__deadline_ms(ms);
    char buf[256];
    while (kvb__now_ns() < deadline) {
        if (get_str(m, key, buf, sizeof buf) == KVB_ERR_NOT_FOUND)
            return true;
        usleep(100000);
    }
    return false;
}

ParameterizedTest(test_store_kind_t *kind, meta_client, basic, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, *kind), 0, "cannot start %s", test_store_kind_name(*kind));
    kvb_meta_t *m = client(&s, 0);
    cr_assert_str_eq(kvb__meta_kind(m), test_store_kind_name(*kind));
    const char *json = "{\"name\":\"a b:c\",\"n\":[1,2,3]}";
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/segments/10.0.0.1:7000", json, strlen(json), 0),
                 KVB_OK);
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/segments/b", "2", 1, 0), KVB_OK);
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/instances/x", "3", 1, 0), KVB_OK);
    cr_assert_eq(kvb__meta_put(m, "kvbridge/u/segments/c", "4", 1, 0), KVB_OK);
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/segments/empty", "", 0, 0), KVB_OK);
    char buf[256];
    cr_assert_eq(get_str(m, "kvbridge/t/segments/10.0.0.1:7000", buf, sizeof buf), KVB_OK);
    cr_assert_str_eq(buf, json);
    cr_assert_eq(get_str(m, "kvbridge/t/segments/empty", buf, sizeof buf), KVB_OK);
    cr_assert_str_eq(buf, "");
    cr_assert_eq(get_str(m, "kvbridge/t/segments/none", buf, sizeof buf), KVB_ERR_NOT_FOUND);
    /* replace */
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/segments/b", "22", 2, 0), KVB_OK);

    kvb_meta_kv_t *kvs = NULL;
    size_t n = 0;
    cr_assert_eq(kvb__meta_list(m, "kvbridge/t/segments/", &kvs, &n), KVB_OK);
    cr_assert_eq(n, 3);
    cr_assert_str_eq(kvs[0].key, "kvbridge/t/segments/10.0.0.1:7000");
    cr_assert_str_eq(kvs[1].key, "kvbridge/t/segments/b");
    cr_assert_str_eq(kvs[1].value, "22");
    cr_assert_eq(kvs[1].len, 2);
    cr_assert_str_eq(kvs[2].key, "kvbridge/t/segments/empty");
    kvb__meta_kvs_free(kvs, n);
    cr_assert_eq(kvb__meta_list(m, "kvbridge/none/", &kvs, &n), KVB_OK);
    cr_assert_eq(n, 0);
    kvb__meta_kvs_free(kvs, n);

    cr_assert_eq(kvb__meta_del(m, "kvbridge/t/segments/b"), KVB_OK);
    cr_assert_eq(kvb__meta_del(m, "kvbridge/t/segments/b"), KVB_ERR_NOT_FOUND);
    cr_assert_eq(get_str(m, "kvbridge/t/segments/b", buf, sizeof buf), KVB_ERR_NOT_FOUND);
    /* bad keys never reach the store */
    cr_assert_eq(kvb__meta_put(m, "", "x", 1, 0), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__meta_put(m, "a\nb", "x", 1, 0), KVB_ERR_INVALID_ARG);
    kvb__meta_close(m);
    test_store_stop(&s);
}

TEST_STORE_EACH(meta_client, ttl_and_owned)

/* A key put with a TTL expires; an owned key outlives several TTLs while its client lives and is
 * deleted when the client closes. */
ParameterizedTest(test_store_kind_t *kind, meta_client, ttl_and_owned, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, *kind), 0);
    kvb_meta_t *m = client(&s, 2000), *reader = client(&s, 0);
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/ttl", "v", 1, 1000), KVB_OK);
    char buf[64];
    cr_assert_eq(get_str(reader, "kvbridge/t/ttl", buf, sizeof buf), KVB_OK);
    cr_assert(gone_within(reader, "kvbridge/t/ttl", 4000), "a TTL key did not expire");

    cr_assert_eq(kvb__meta_own(m, "kvbridge/t/owned", "one", 3), KVB_OK);
    cr_assert_eq(kvb__meta_own_async(m, "kvbridge/t/owned", "two", 3), KVB_OK);
    usleep(5000000); /* 2.5 TTLs */
    cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_OK,
                 "the keeper did not keep the owned key alive");
    cr_assert_str_eq(buf, "two");
    kvb__meta_close(m);
    cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_ERR_NOT_FOUND,
                 "close did not withdraw the owned key");
    kvb__meta_close(reader);
    test_store_stop(&s);
}

TEST_STORE_EACH(meta_client, taken_over)

/* Another process sets an owned key to its own value (a restarted owner while the old one still
 * runs): the old owner's keeper must leave it alone - a re-put every TTL/3 would flip the key
 * between the two, and readers would see either - and its close must not delete it. */
ParameterizedTest(test_store_kind_t *kind, meta_client, taken_over, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, *kind), 0);
    kvb_meta_t *old = client(&s, 1500), *new = client(&s, 1500), *reader = client(&s, 0);
    cr_assert_eq(kvb__meta_own(old, "kvbridge/t/owned", "old", 3), KVB_OK);
    usleep(200000); /* the two keepers out of phase */
    cr_assert_eq(kvb__meta_own(new, "kvbridge/t/owned", "new", 3), KVB_OK);
    char buf[64];
    uint64_t end = kvb__deadline_ms(4 * 1500); /* 12 rounds of each keeper */
    int reads = 0;
    while (kvb__now_ns() < end) {
        cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_OK);
        cr_assert_str_eq(buf, "new", "the old owner wrote its value back (read %d)", reads);
        reads++;
        usleep(50000);
    }
    kvb__meta_close(old);
    cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_OK,
                 "the old owner's close deleted the new owner's key");
    cr_assert_str_eq(buf, "new");
    kvb__meta_close(new);
    cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_ERR_NOT_FOUND);
    kvb__meta_close(reader);
    test_store_stop(&s);
}

TEST_STORE_EACH(meta_client, outage)

/* The store goes away: calls fail at once with KVB_ERR_META_UNREACHABLE; when it is back, owned
 * keys are there again within a TTL (Redis restarts empty: the keeper re-creates them). */
ParameterizedTest(test_store_kind_t *kind, meta_client, outage, .timeout = 90)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, *kind), 0);
    kvb_meta_t *m = client(&s, 2000), *reader = client(&s, 0);
    cr_assert_eq(kvb__meta_own(m, "kvbridge/t/owned", "alive", 5), KVB_OK);
    cr_assert_eq(test_store_halt(&s), 0);
    char buf[64];
    uint64_t t0 = kvb__now_ns();
    cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_ERR_META_UNREACHABLE);
    cr_assert_lt(kvb__now_ns() - t0, 2500000000ull, "an unreachable store must fail promptly");
    cr_assert_not(kvb__meta_reachable(reader));
    usleep(1500000); /* a keeper round or two fails meanwhile */
    cr_assert_eq(test_store_restart(&s), 0);
    uint64_t deadline = kvb__deadline_ms(6000);
    int rc;
    while ((rc = get_str(reader, "kvbridge/t/owned", buf, sizeof buf)) != KVB_OK &&
           kvb__now_ns() < deadline)
        usleep(100000);
    cr_assert_eq(rc, KVB_OK, "the owned key did not come back after the outage: %s",
                 kvb_strerror(rc));
    cr_assert_str_eq(buf, "alive");
    cr_assert(kvb__meta_reachable(reader));
    kvb__meta_close(m);
    kvb__meta_close(reader);
    test_store_stop(&s);
}

Test(meta_client, uris)
{
    kvb_meta_t *m = (kvb_meta_t *)1;
    cr_assert_eq(kvb__meta_open("p2p", 1000, 0, &m), KVB_OK);
    cr_assert_null(m);
    cr_assert_eq(kvb__meta_open(NULL, 1000, 0, &m), KVB_OK);
    cr_assert_null(m);
    const char *good[] = {"etcd://127.0.0.1:2379",
                          "etcd://127.0.0.1:2379,127.0.0.1:2479,[::1]:2579",
                          "redis://127.0.0.1:6379",
                          "redis://:secret@127.0.0.1:6379/3",
                          "redis://user:secret@localhost:6379",
                          "http://127.0.0.1:8080",
                          "http://127.0.0.1:8080/meta/data/"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        cr_assert_eq(kvb__meta_open(good[i], 1000, 0, &m), KVB_OK, "%s", good[i]);
        cr_assert_not_null(m);
        cr_assert_null(strstr(kvb__meta_uri(m), "secret"), "the password must not show");
        kvb__meta_close(m);
    }
    const char *bad[] = {"etcd://",        "etcd://host",   "etcd://h:0",
                         "etcd://h:70000", "etcd://h:1,",   "etcd://h:1,,h:2",
                         "redis://h",      "redis://h:1/x", "redis://nopass@h:1",
                         "redis://:@h:1",  "http://",       "http://h:1/a b",
                         "http://h:1/a?b", "http://:80"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_eq(kvb__meta_open(bad[i], 1000, 0, &m), KVB_ERR_INVALID_ARG, "%s", bad[i]);
    cr_assert_eq(kvb__meta_open("zookeeper://h:1", 1000, 0, &m), KVB_ERR_UNSUPPORTED);
    char key[KVB_META_KEY_MAX + 8];
    cr_assert_eq(kvb__meta_key(key, sizeof key, "prod", "segments", "p0"), KVB_OK);
    cr_assert_str_eq(key, "kvbridge/prod/segments/p0");
    cr_assert_eq(kvb__meta_key(key, sizeof key, "a/b", "segments", "p0"), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__meta_key(key, sizeof key, "", "segments", "p0"), KVB_ERR_INVALID_ARG);
}

/* One raw command to the test's redis-server (RESP); its first reply line. */
static void redis_raw(const test_store_t *s, const char *const *argv, int argc, char *out,
                      size_t cap)
{
    char req[512];
    int len = snprintf(req, sizeof req, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++)
        len += snprintf(req + len, sizeof req - (size_t)len, "$%zu\r\n%s\r\n", strlen(argv[i]),
                        argv[i]);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(s->port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(send(fd, req, (size_t)len, MSG_NOSIGNAL), len);
    ssize_t n = recv(fd, out, cap - 1, 0);
    cr_assert_gt(n, 0);
    out[n] = '\0';
    close(fd);
}

/* A passing refusal of the renewal script (here OOM: the server over its maxmemory for a moment)
 * does not turn renewals into plain SETs for good - which would write our value back over a key
 * that another process took over since. Only a server that can never run it (no EVAL, an ACL
 * that forbids it) gets those. */
Test(meta_client, redis_passing_refusal_keeps_renewals_conditional, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, TEST_STORE_REDIS), 0);
    kvb_meta_t *old = client(&s, 900), *reader = client(&s, 0);
    cr_assert_eq(kvb__meta_own(old, "kvbridge/t/owned", "old", 3), KVB_OK);
    char r[256];
    redis_raw(&s, (const char *[]){"CONFIG", "SET", "maxmemory-policy", "noeviction"}, 4, r,
              sizeof r);
    cr_assert_str_eq(r, "+OK\r\n");
    redis_raw(&s, (const char *[]){"CONFIG", "SET", "maxmemory", "1"}, 4, r, sizeof r);
    cr_assert_str_eq(r, "+OK\r\n");
    usleep(700000); /* two renewal rounds (every 300 ms), refused */
    redis_raw(&s, (const char *[]){"CONFIG", "SET", "maxmemory", "0"}, 4, r, sizeof r);
    cr_assert_str_eq(r, "+OK\r\n");
    cr_assert_eq(kvb__meta_put(reader, "kvbridge/t/owned", "new", 3, 0), KVB_OK); /* taken over */
    char buf[64];
    uint64_t end = kvb__deadline_ms(1500); /* five more rounds */
    while (kvb__now_ns() < end) {
        cr_assert_eq(get_str(reader, "kvbridge/t/owned", buf, sizeof buf), KVB_OK);
        cr_assert_str_eq(buf, "new", "the old owner wrote its value back over the new one");
        usleep(50000);
    }
    kvb__meta_close(old);
    kvb__meta_close(reader);
    test_store_stop(&s);
}

/* `INFO commandstats`' call count of `cmd` ("get", "mget", "scan"); 0 if not called. */
static long redis_calls(const test_store_t *s, const char *cmd)
{
    char r[4096], want[64];
    redis_raw(s, (const char *[]){"INFO", "commandstats"}, 2, r, sizeof r);
    snprintf(want, sizeof want, "cmdstat_%s:calls=", cmd);
    const char *at = strstr(r, want);
    return at ? strtol(at + strlen(want), NULL, 10) : 0;
}

/* A Redis list takes one round trip per SCAN page for the values (MGET), not one per key: with a
 * GET per key, listing a few thousand segments took thousands of round trips, all within one
 * call's timeout. Every key and value comes back, each once. */
Test(meta_client, redis_list_reads_a_page_per_round_trip, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, TEST_STORE_REDIS), 0);
    kvb_meta_t *m = client(&s, 0);
    enum { KEYS = 1500 };
    char key[64], val[64];
    for (int i = 0; i < KEYS; i++) {
        snprintf(key, sizeof key, "kvbridge/t/segments/s%04d", i);
        snprintf(val, sizeof val, "v%d", i * 7);
        cr_assert_eq(kvb__meta_put(m, key, val, strlen(val), 0), KVB_OK);
    }
    cr_assert_eq(kvb__meta_put(m, "kvbridge/t/other", "x", 1, 0), KVB_OK);
    char r[256];
    redis_raw(&s, (const char *[]){"CONFIG", "RESETSTAT"}, 2, r, sizeof r);
    kvb_meta_kv_t *kvs = NULL;
    size_t n = 0;
    cr_assert_eq(kvb__meta_list(m, "kvbridge/t/segments/", &kvs, &n), KVB_OK);
    cr_assert_eq(n, KEYS);
    for (size_t i = 0; i < n; i++) { /* sorted by key */
        snprintf(key, sizeof key, "kvbridge/t/segments/s%04zu", i);
        snprintf(val, sizeof val, "v%zu", i * 7);
        cr_assert_str_eq(kvs[i].key, key);
        cr_assert_str_eq(kvs[i].value, val);
        cr_assert_eq(kvs[i].len, strlen(val));
    }
    kvb__meta_kvs_free(kvs, n);
    long scans = redis_calls(&s, "scan"), mgets = redis_calls(&s, "mget"),
         gets = redis_calls(&s, "get");
    cr_log_info("listing %d keys: %ld SCAN, %ld MGET, %ld GET", KEYS, scans, mgets, gets);
    cr_expect_eq(gets, 0, "%ld GETs: a round trip per key", gets);
    cr_expect(mgets >= 1 && mgets <= scans, "%ld MGETs for %ld SCAN pages", mgets, scans);
    kvb__meta_close(m);
    test_store_stop(&s);
}

static double get_ms(kvb_meta_t *m, int *rc)
{
    char buf[64];
    uint64_t t0 = kvb__now_ns();
    *rc = get_str(m, "kvbridge/t/absent", buf, sizeof buf);
    return (double)(kvb__now_ns() - t0) / 1e6;
}

/* A call ends within the client's timeout however many etcd endpoints it tries, and fails over
 * within it: each endpoint used to get the whole timeout, so two hung ones made a 1.5 s call take
 * 3 s before the third answered - and a keepalive that failed over that late found its lease
 * expired. Now each endpoint tried gets its part of what is left; a refused one costs nothing. */
Test(meta_client, etcd_endpoints_share_the_call_timeout, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, TEST_STORE_ETCD), 0);
    uint16_t p1, p2, closed = test_free_port();
    int h1 = test_silent_listener(&p1), h2 = test_silent_listener(&p2), rc;
    cr_assert(h1 >= 0 && h2 >= 0);
    char uri[160];
    kvb_meta_t *m = NULL;

    snprintf(uri, sizeof uri, "etcd://127.0.0.1:%u,127.0.0.1:%u,127.0.0.1:%u", p1, p2, s.port);
    cr_assert_eq(kvb__meta_open(uri, 1500, 0, &m), KVB_OK);
    double ms = get_ms(m, &rc);
    cr_assert_eq(rc, KVB_ERR_NOT_FOUND, "past two hung endpoints: %s", kvb_strerror(rc));
    cr_assert_lt(ms, 2200.0, "the call took %.0f ms with a 1500 ms timeout", ms);
    ms = get_ms(m, &rc); /* the next call starts at the endpoint that answered */
    cr_assert_eq(rc, KVB_ERR_NOT_FOUND, "%s", kvb_strerror(rc));
    cr_assert_lt(ms, 400.0, "the second call took %.0f ms", ms);
    kvb__meta_close(m);

    snprintf(uri, sizeof uri, "etcd://127.0.0.1:%u,127.0.0.1:%u", p1, p2);
    cr_assert_eq(kvb__meta_open(uri, 1500, 0, &m), KVB_OK);
    ms = get_ms(m, &rc);
    cr_assert_eq(rc, KVB_ERR_META_UNREACHABLE, "%s", kvb_strerror(rc));
    cr_assert_lt(ms, 2200.0, "two hung endpoints took %.0f ms with a 1500 ms timeout", ms);
    kvb__meta_close(m);

    snprintf(uri, sizeof uri, "etcd://127.0.0.1:%u,127.0.0.1:%u", closed, s.port);
    cr_assert_eq(kvb__meta_open(uri, 1500, 0, &m), KVB_OK);
    ms = get_ms(m, &rc);
    cr_assert_eq(rc, KVB_ERR_NOT_FOUND, "past a refused endpoint: %s", kvb_strerror(rc));
    cr_assert_lt(ms, 400.0, "past a refused endpoint: %.0f ms", ms);
    kvb__meta_close(m);

    close(h1);
    close(h2);
    test_store_stop(&s);
}
