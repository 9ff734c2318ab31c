/* SPDX-License-Identifier: Apache-2.0 */
/* Instance discovery through a real metadata store (etcd, Redis, kvbridge metadata-server; see
 * src/pd/server/reg.c and src/pd/proxy/discover.c): a proxy with no instance answers 503, finds
 * instances registered after it and routes through them token for token like a colocated one,
 * drops one withdrawn by a clean stop at once and one killed with SIGKILL once its key expires,
 * and takes a replacement; malformed values are ignored (logged once), static instances stay, a
 * store outage keeps the known set; bad command lines and an unreachable store fail clearly. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/cli.h"
#include "helpers/store.h"
#include "meta/meta.h"
#include "pd/proxy/proxy.h"
#include "pd/proxy/internal.h"
#include "pd/server/server.h"

#define TTL_MS      2000u
#define INTERVAL_MS 200u
#define MAX_SRV     6
#define MAX_KIDS    4

static test_store_t store;
static kvb_pd_proxy_t *px;
static char px_url[64];
static kvb_pd_server_t *srvs[MAX_SRV];
static pid_t kids[MAX_KIDS];
static int saved_stderr = -1;
static char err_file[64];

/* ---- Fixture --------------------------------------------------------------------------------- */

static void restore_stderr(void)
{
    if (saved_stderr < 0)
        return;
    dup2(saved_stderr, 2);
    close(saved_stderr);
    saved_stderr = -1;
    unlink(err_file);
}

static void kill_kid(pid_t pid)
{
    for (int i = 0; i < MAX_KIDS; i++)
        if (kids[i] == pid && pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            kids[i] = 0;
        }
}

static void fini(void)
{
    kvb__pxy_fault_hook = NULL;
    kvb_pd_proxy_stop(px);
    px = NULL;
    for (int i = 0; i < MAX_SRV; i++) {
        kvb_pd_server_destroy(srvs[i]);
        srvs[i] = NULL;
    }
    for (int i = 0; i < MAX_KIDS; i++)
        kill_kid(kids[i]);
    test_store_stop(&store);
    restore_stderr();
}

TestSuite(discovery, .fini = fini, .timeout = 120);

static void store_up(test_store_kind_t kind)
{
    cr_assert_eq(test_store_start(&store, kind), 0, "cannot start %s", test_store_kind_name(kind));
}

static void proxy_up(const char *discover, const char *static_prefill, uint32_t interval_ms)
{
    kvb_pd_proxy_opts_t o = {.prefill = (const char *const[]){static_prefill},
                             .n_prefill = static_prefill ? 1 : 0,
                             .discover = discover,
                             .discover_interval_ms = interval_ms,
                             .timeout_ms = 20000};
    char why[256];
    cr_assert_eq(kvb_pd_proxy_start(&o, &px, why, sizeof why), 0, "proxy: %s", why);
    snprintf(px_url, sizeof px_url, "http://127.0.0.1:%u", (unsigned)kvb_pd_proxy_port(px));
}

/* An instance in this process (port picked by the server), registered in the store. */
static kvb_pd_server_t *server_up(kvb_pd_role_t role, char *url, size_t cap)
{
    int slot = 0;
    while (slot < MAX_SRV && srvs[slot])
        slot++;
    cr_assert_lt(slot, MAX_SRV);
    kvb_pd_server_opts_t o = {.role = role,
                              .kv_mode = KVB_PD_KV_PULL,
                              .model = "tiny-gqa",
                              .tp = 1,
                              .blocks = 64,
                              .lease_ms = 5000,
                              .metadata = store.uri,
                              .metadata_ttl_ms = TTL_MS};
    char why[512];
    cr_assert_eq(kvb_pd_server_create(&o, &srvs[slot], why, sizeof why), 0, "%s: %s",
                 kvb_pd_role_name(role), why);
    snprintf(url, cap, "http://127.0.0.1:%u", (unsigned)kvb_pd_server_port(srvs[slot]));
    return srvs[slot];
}

static void server_down(kvb_pd_server_t *srv)
{
    for (int i = 0; i < MAX_SRV; i++)
        if (srvs[i] == srv)
            srvs[i] = NULL;
    kvb_pd_server_destroy(srv);
}

/* `kvbridge serve` in a child process (dies with this thread: PDEATHSIG); returns its pid and
 * its URL from the ready line. */
static pid_t serve_child(const char *role, char *url, size_t cap)
{
    const char *bin = getenv("KVB_BIN");
    if (!bin)
        cr_skip_test("KVB_BIN is not set (run through ctest)");
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%u", TTL_MS);
    int po[2];
    cr_assert_eq(pipe(po), 0);
    pid_t parent = getpid(), pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        dup2(po[1], 1);
        close(po[0]);
        execl(bin, bin, "serve", "--role", role, "--model", "tiny-gqa", "--port", "0", "--blocks",
              "64", "--metadata", store.uri, "--metadata-ttl-ms", ttl, NULL);
        _exit(127);
    }
    close(po[1]);
    for (int i = 0; i < MAX_KIDS; i++)
        if (!kids[i]) {
            kids[i] = pid;
            break;
        }
    char line[256] = "";
    size_t n = 0;
    struct pollfd pf = {.fd = po[0], .events = POLLIN};
    while (n < sizeof line - 1 && !strchr(line, '\n') && poll(&pf, 1, 30000) == 1) {
        ssize_t k = read(po[0], line + n, sizeof line - 1 - n);
        if (k <= 0)
            break;
        n += (size_t)k;
        line[n] = '\0';
    }
    close(po[0]);
    unsigned port = 0;
    char want[64];
    snprintf(want, sizeof want, "serving %s on http://127.0.0.1:%%u", role);
    cr_assert_eq(sscanf(line, want, &port), 1, "ready line: '%s'", line);
    snprintf(url, cap, "http://127.0.0.1:%u", port);
    return pid;
}

/* ---- Talking to the proxy -------------------------------------------------------------------- */

static json_t *proxy_health(void)
{
    char url[96], *body = NULL;
    snprintf(url, sizeof url, "%s/health", px_url);
    long st = kvb_pd_http(url, NULL, 10000, &body, NULL, 0);
    json_t *j = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    cr_assert_not_null(j, "proxy /health: %ld", st);
    return j;
}

/* How many instances /health lists, and whether `url` (as `role`, when given) is among them. */
static size_t listed(const char *url, const char *role, bool *found)
{
    json_t *h = proxy_health(), *insts = json_object_get(h, "instances"), *e;
    size_t i, n = json_array_size(insts);
    *found = false;
    json_array_foreach(insts, i, e)
    {
        const char *u = json_string_value(json_object_get(e, "url"));
        const char *r = json_string_value(json_object_get(e, "role"));
        if (url && u && !strcmp(u, url) && (!role || (r && !strcmp(r, role))))
            *found = true;
    }
    json_decref(h);
    return n;
}

/* Polls /health until `url` is listed (want) or not (!want); returns the ms it took or -1. */
static double wait_listed(const char *url, bool want, uint32_t ms)
{
    uint64_t t0 = kvb__now_ns(), dl = kvb__deadline_ms(ms);
    do {
        bool found;
        listed(url, NULL, &found);
        if (found == want)
            return (double)(kvb__now_ns() - t0) / 1e6;
        usleep(50000);
    } while (kvb__now_ns() < dl);
    return -1;
}

static long post(const char *body, char *msg, size_t cap)
{
    char url[96], *resp = NULL;
    snprintf(url, sizeof url, "%s/v1/completions", px_url);
    long st = kvb_pd_http(url, body, 20000, &resp, msg, cap);
    json_t *j = resp ? json_loads(resp, 0, NULL) : NULL;
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    if (m)
        snprintf(msg, cap, "%s", m);
    json_decref(j);
    free(resp);
    return st;
}

static void expect_503(const char *role, const char *uri)
{
    char msg[512], want[256];
    long st = post("{\"prompt\": \"hello\", \"max_tokens\": 2}", msg, sizeof msg);
    snprintf(want, sizeof want, "no %s instance available (discovering from %s)", role, uri);
    cr_assert_eq(st, 503, "status %ld: %s", st, msg);
    cr_assert(strstr(msg, want), "'%s' lacks '%s'", msg, want);
}

/* Prompts through the proxy (alternately streamed) equal the colocated reference's answers, and
 * went through `dec` (the proxy's stats name the pair). */
static void same_as_reference(const char *ref_url, const char *dec_url, unsigned salt)
{
    static const char *prompts[] = {"", "The KV cache moves",
                                    "from prefill to decode, block by "
                                    "block, sixteen tokens at a time."};
    for (unsigned i = 0; i < 3; i++) {
        json_t *j = json_pack("{s:s, s:i, s:b}", "prompt", prompts[i], "max_tokens",
                              (int)(3 + (i + salt) % 3), "stream", (i + salt) % 2 == 1);
        char *b = json_dumps(j, JSON_COMPACT);
        json_object_set_new(j, "stream", json_false());
        char *rb = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        kvb_pd_completion_t pd, rc;
        kvb_pd_complete(px_url, b, 20000, &pd);
        kvb_pd_complete(ref_url, rb, 20000, &rc);
        cr_assert(rc.ok, "colocated, prompt %u: %ld %s", i, rc.status, rc.error);
        cr_assert(pd.ok, "proxy, prompt %u: %ld %s", i, pd.status, pd.error);
        cr_assert_gt(rc.n_tokens, 0);
        cr_assert_eq(pd.n_tokens, rc.n_tokens, "prompt %u: %zu tokens, colocated %zu", i,
                     pd.n_tokens, rc.n_tokens);
        for (size_t k = 0; k < rc.n_tokens; k++)
            cr_assert_eq(pd.tokens[k], rc.tokens[k], "prompt %u token %zu: %u, colocated %u", i, k,
                         pd.tokens[k], rc.tokens[k]);
        cr_assert_str_eq(pd.text, rc.text, "prompt %u", i);
        cr_assert_gt(pd.kv_bytes, 0, "prompt %u: no KV moved", i);
        kvb_pd_completion_free(&pd);
        kvb_pd_completion_free(&rc);
        free(b);
        free(rb);
    }
    /* Which decode answered: the non-streamed answer's kvbridge.decode. */
    char msg[256], url[96], *resp = NULL;
    snprintf(url, sizeof url, "%s/v1/completions", px_url);
    long st =
        kvb_pd_http(url, "{\"prompt\": \"x\", \"max_tokens\": 1}", 20000, &resp, msg, sizeof msg);
    json_t *a = resp ? json_loads(resp, 0, NULL) : NULL;
    const char *d = json_string_value(json_object_get(json_object_get(a, "kvbridge"), "decode"));
    cr_assert_eq(st, 200, "%ld %s", st, msg);
    cr_assert(d && !strcmp(d, dec_url), "decoded by %s, want %s", d ? d : "?", dec_url);
    json_decref(a);
    free(resp);
}

/* ---- The life of a deployment ---------------------------------------------------------------- */

static void lifecycle(test_store_kind_t kind)
{
    store_up(kind);
    proxy_up(store.uri, NULL, INTERVAL_MS);
    expect_503("prefill", store.uri);

    /* Instances registered after the proxy started; the colocated reference registers too, as
     * role "both", which a proxy must not take for a PD half. */
    char ref[64], pre[64], dec[64], kid[64], dec2[64];
    server_up(KVB_PD_ROLE_BOTH, ref, sizeof ref);
    server_up(KVB_PD_ROLE_PREFILL, pre, sizeof pre);
    uint64_t t = kvb__now_ns();
    kvb_pd_server_t *d = server_up(KVB_PD_ROLE_DECODE, dec, sizeof dec);
    cr_assert_geq(wait_listed(pre, true, 5000), 0, "prefill %s never discovered", pre);
    cr_assert_geq(wait_listed(dec, true, 5000), 0, "decode %s never discovered", dec);
    cr_log_info("%s: both discovered %.0f ms after the decode started", store.uri,
                (double)(kvb__now_ns() - t) / 1e6);
    bool found;
    cr_assert_eq(listed(ref, NULL, &found), 2, "only the prefill and the decode are listed");
    cr_assert(!found, "the colocated instance is no PD half");
    same_as_reference(ref, dec, 0);

    /* A clean stop withdraws the key before HTTP stops: gone from the store at once. */
    char key[KVB_META_KEY_MAX + 1], *val = NULL;
    size_t len;
    kvb_meta_t *m = NULL;
    cr_assert_eq(kvb__meta_open(store.uri, 2000, 0, &m), KVB_OK);
    cr_assert_eq(kvb__meta_key(key, sizeof key, "default", "instances", dec + 7), KVB_OK);
    cr_assert_eq(kvb__meta_get(m, key, &val, &len), KVB_OK, "%s not registered", key);
    cr_assert(strstr(val, "\"role\":\"decode\"") && strstr(val, "\"kvbridge\":1"), "%s", val);
    free(val);
    t = kvb__now_ns();
    server_down(d);
    double stop_ms = (double)(kvb__now_ns() - t) / 1e6;
    int rc = kvb__meta_get(m, key, &val, &len);
    if (rc == KVB_OK)
        free(val);
    kvb__meta_close(m);
    cr_assert_eq(rc, KVB_ERR_NOT_FOUND, "%s still there after a stop of %.0f ms", key, stop_ms);
    double ms = wait_listed(dec, false, 3000);
    cr_assert_geq(ms, 0, "a withdrawn decode stays listed");
    cr_log_info("%s: withdrawn decode dropped %.0f ms after its %.0f ms stop", store.uri, ms,
                stop_ms);
    expect_503("decode", store.uri);

    /* A decode that crashes: its key outlives it until the TTL. */
    pid_t pid = serve_child("decode", kid, sizeof kid);
    cr_assert_geq(wait_listed(kid, true, 5000), 0, "decode %s never discovered", kid);
    same_as_reference(ref, kid, 1);
    kill_kid(pid);
    t = kvb__now_ns();
    ms = wait_listed(kid, false, TTL_MS + 2000);
    cr_assert_geq(ms, 0, "a killed decode is still listed %u ms later", TTL_MS + 2000);
    cr_log_info("%s: killed decode dropped after %.0f ms (TTL %u ms)", store.uri, ms, TTL_MS);
    expect_503("decode", store.uri);

    /* A replacement: traffic flows again. */
    server_up(KVB_PD_ROLE_DECODE, dec2, sizeof dec2);
    cr_assert_geq(wait_listed(dec2, true, 5000), 0, "replacement %s never discovered", dec2);
    same_as_reference(ref, dec2, 2);
}

Test(discovery, etcd_lifecycle)
{
    lifecycle(TEST_STORE_ETCD);
}

Test(discovery, redis_lifecycle)
{
    lifecycle(TEST_STORE_REDIS);
}

Test(discovery, http_lifecycle)
{
    lifecycle(TEST_STORE_HTTP);
}

/* ---- An instance dropped while a request uses it --------------------------------------------- */

static kvb_pd_server_t *victim;
static char victim_url[64];
static bool victim_dropped;

static bool in_decode_set(const char *url)
{
    bool found = false;
    pthread_mutex_lock(&px->up_mu);
    for (size_t i = 0; i < px->decode.n; i++)
        found |= !strcmp(px->decode.v[i]->url, url);
    pthread_mutex_unlock(&px->up_mu);
    return found;
}

/* After the prefill answered and before the decode call: stop the decode (which withdraws its
 * key) and wait until discovery has dropped it from the set, freeing the set's reference. */
static void drop_decode(const char *stage, const kvb__pxy_job_t *job)
{
    (void)job;
    if (strcmp(stage, "prefilled") || !victim)
        return;
    server_down(victim);
    victim = NULL;
    uint64_t dl = kvb__deadline_ms(3000);
    while (in_decode_set(victim_url) && kvb__now_ns() < dl)
        usleep(20000);
    victim_dropped = !in_decode_set(victim_url);
}

/* The request goes on with the instance it picked, whose upstream only it still references: it
 * fails (the decode is gone) naming that decode, and frees it when done (AddressSanitizer checks
 * the rest). Once whole, once streamed. */
Test(discovery, dropped_while_in_use)
{
    store_up(TEST_STORE_REDIS);
    proxy_up(store.uri, NULL, INTERVAL_MS);
    char pre[64];
    server_up(KVB_PD_ROLE_PREFILL, pre, sizeof pre);
    kvb__pxy_fault_hook = drop_decode;
    for (int stream = 0; stream < 2; stream++) {
        victim = server_up(KVB_PD_ROLE_DECODE, victim_url, sizeof victim_url);
        victim_dropped = false;
        cr_assert_geq(wait_listed(victim_url, true, 5000), 0, "%s never discovered", victim_url);
        kvb_pd_completion_t c;
        kvb_pd_complete(px_url,
                        stream ? "{\"prompt\": \"abc\", \"max_tokens\": 4, \"stream\": true}"
                               : "{\"prompt\": \"abc\", \"max_tokens\": 4}",
                        20000, &c);
        cr_assert(victim_dropped, "discovery kept %s after its stop", victim_url);
        cr_assert(!c.ok, "an answer from a stopped decode");
        cr_assert(strstr(c.error, victim_url), "stream %d: %ld '%s' does not name %s", stream,
                  c.status, c.error, victim_url);
        cr_log_info("stream %d: %ld %s", stream, c.status, c.error);
        kvb_pd_completion_free(&c);
    }
}

/* ---- Store values, static instances, outages ------------------------------------------------- */

static void put(kvb_meta_t *m, const char *name, const char *val)
{
    char key[KVB_META_KEY_MAX + 1];
    cr_assert_eq(kvb__meta_key(key, sizeof key, "default", "instances", name), KVB_OK);
    cr_assert_eq(kvb__meta_put(m, key, val, strlen(val), 0), KVB_OK, "put %s", key);
}

/* Sends stderr to a file, to count the proxy's log lines. */
static void capture_stderr(void)
{
    snprintf(err_file, sizeof err_file, "/tmp/kvb_discovery_%d.err", (int)getpid());
    int fd = open(err_file, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    saved_stderr = dup(2);
    dup2(fd, 2);
    close(fd);
}

static unsigned count_in_stderr(const char *needle)
{
    static char buf[1 << 16];
    FILE *f = fopen(err_file, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    unsigned c = 0;
    for (const char *p = buf; (p = strstr(p, needle)); p += strlen(needle))
        c++;
    return c;
}

static bool store_reachable(void)
{
    json_t *h = proxy_health();
    bool r = json_is_true(json_object_get(json_object_get(h, "discovery"), "reachable"));
    json_decref(h);
    return r;
}

static uint64_t rounds(void)
{
    json_t *h = proxy_health();
    uint64_t n =
        (uint64_t)json_integer_value(json_object_get(json_object_get(h, "discovery"), "rounds"));
    json_decref(h);
    return n;
}

/* Waits until the discovery thread has done `want` rounds in all. */
static void wait_rounds_total(uint64_t want)
{
    uint64_t dl = kvb__deadline_ms(5000);
    while (rounds() < want && kvb__now_ns() < dl)
        usleep(50000);
    cr_assert_geq(rounds(), want, "discovery stalled");
}

/* Waits for `more` rounds from now. */
static void wait_rounds(uint64_t more)
{
    wait_rounds_total(rounds() + more);
}

Test(discovery, values_static_and_outage)
{
    store_up(TEST_STORE_REDIS);
    kvb_meta_t *m = NULL;
    cr_assert_eq(kvb__meta_open(store.uri, 2000, 0, &m), KVB_OK);
    char stat[64], dec[128], other[160];
    snprintf(stat, sizeof stat, "http://127.0.0.1:%u", (unsigned)test_free_port());
    snprintf(dec, sizeof dec,
             "{\"kvbridge\":1,\"role\":\"decode\",\"url\":\"http://127.0.0.1:%u\"}",
             (unsigned)test_free_port());
    put(m, "bad-json", "{\"kvbridge\":1,");
    put(m, "bad-version", "{\"kvbridge\":2,\"role\":\"decode\",\"url\":\"http://127.0.0.1:9\"}");
    put(m, "bad-url", "{\"kvbridge\":1,\"role\":\"decode\",\"url\":\"ftp://x\"}");
    put(m, "colocated", "{\"kvbridge\":1,\"role\":\"both\",\"url\":\"http://127.0.0.1:10\"}");
    snprintf(other, sizeof other, "{\"kvbridge\":1,\"role\":\"prefill\",\"url\":\"%s\"}", stat);
    put(m, "same-as-static", other);
    cr_assert_eq(kvb__meta_put(m, "kvbridge/elsewhere/instances/x", dec, strlen(dec), 0), KVB_OK);

    capture_stderr();
    proxy_up(store.uri, stat, INTERVAL_MS);
    wait_rounds_total(1);
    expect_503("decode", store.uri);
    put(m, "good", dec);
    const char *dec_url = strstr(dec, "http://");
    char want[64];
    snprintf(want, sizeof want, "%.*s", (int)(strchr(dec_url, '"') - dec_url), dec_url);
    cr_assert_geq(wait_listed(want, true, 3000), 0, "%s never discovered", want);
    wait_rounds(3);
    bool found;
    cr_assert_eq(listed(stat, "prefill", &found), 2, "the static prefill and one decode");
    cr_assert(found, "the static prefill is listed once");
    cr_assert(store_reachable());
    cr_expect_eq(count_in_stderr("ignoring kvbridge/default/instances/bad-json in the store: "
                                 "malformed: not a JSON object"),
                 1, "one line per refused key, not per round");
    cr_expect_eq(count_in_stderr("instances/bad-version in the store: malformed: \"kvbridge\" "
                                 "is not 1"),
                 1);
    cr_expect_eq(count_in_stderr("instances/bad-url in the store: malformed: bad instance URL"), 1);
    cr_expect_eq(count_in_stderr("instances/colocated in the store: role \"both\""), 1);
    cr_expect_eq(count_in_stderr("proxy: + decode "), 1);
    cr_expect_eq(count_in_stderr("proxy: + prefill "), 0, "the static URL is not added twice");

    /* The store goes away: the known set stays, and the outage is logged once. */
    cr_assert_eq(test_store_halt(&store), 0);
    uint64_t dl = kvb__deadline_ms(5000);
    while (store_reachable() && kvb__now_ns() < dl)
        usleep(50000);
    cr_assert(!store_reachable(), "the proxy never noticed the outage");
    wait_rounds(3);
    cr_assert_eq(listed(want, NULL, &found), 2);
    cr_assert(found, "a store outage dropped the discovered decode");
    cr_expect_eq(count_in_stderr("unreachable; keeping 2 known instances"), 1, "logged once");

    /* Back (Redis runs without persistence: it lost every key): the decode goes, the static
     * prefill stays. */
    cr_assert_eq(test_store_restart(&store), 0);
    cr_assert_geq(wait_listed(want, false, 5000), 0, "a vanished key stays listed");
    cr_assert(store_reachable());
    cr_assert_eq(listed(stat, "prefill", &found), 1);
    cr_assert(found, "a static instance was dropped");
    cr_expect_eq(count_in_stderr(" (gone from the store)"), 1);
    kvb__meta_close(m);

    /* Stopping does not wait for the next round. */
    kvb_pd_proxy_stop(px);
    px = NULL;
    proxy_up(store.uri, stat, 60000);
    wait_rounds_total(1);
    uint64_t t = kvb__now_ns();
    kvb_pd_proxy_stop(px);
    px = NULL;
    double ms = (double)(kvb__now_ns() - t) / 1e6;
    cr_expect_lt(ms, 1000.0, "stop took %.0f ms with a 60 s interval", ms);
    restore_stderr();
}

/* ---- Command lines and an unreachable store -------------------------------------------------- */

typedef struct {
    char out[4096], err[8192];
} output_t;

static int run(output_t *o, const char *sub, const char *const *args)
{
    if (!getenv("KVB_BIN"))
        cr_skip_test("KVB_BIN is not set (run through ctest)");
    int st = test_run_cli(sub, args, o->out, sizeof o->out, o->err, sizeof o->err);
    cr_assert_neq(st, -2, "cannot run $KVB_BIN %s", sub);
    return st;
}

Test(discovery, unreachable_store_fails_start)
{
    output_t o;
    char uri[2][64], want[160];
    uint16_t port = test_free_port();
    snprintf(uri[0], sizeof uri[0], "redis://127.0.0.1:%u", (unsigned)port);
    snprintf(uri[1], sizeof uri[1], "etcd://127.0.0.1:%u", (unsigned)port);
    for (int i = 0; i < 2; i++) {
        int st = run(&o, "serve",
                     (const char *const[]){"--role", "prefill", "--model", "tiny-gqa", "--port",
                                           "0", "--metadata", uri[i], NULL});
        snprintf(want, sizeof want, "metadata store %s unreachable", uri[i]);
        cr_expect_eq(st, 1, "%s: exit %d: %s", uri[i], st, o.err);
        cr_expect(strstr(o.err, want), "%s: stderr lacks '%s': %s", uri[i], want, o.err);
        cr_expect(!strstr(o.out, "serving"), "%s: a ready line: %s", uri[i], o.out);
    }
    kvb_pd_server_opts_t so = {.role = KVB_PD_ROLE_DECODE,
                               .kv_mode = KVB_PD_KV_PULL,
                               .model = "tiny-gqa",
                               .tp = 1,
                               .metadata = uri[0]};
    kvb_pd_server_t *srv = NULL;
    char why[512];
    cr_expect_eq(kvb_pd_server_create(&so, &srv, why, sizeof why), KVB_ERR_META_UNREACHABLE);
    cr_expect_null(srv);
    cr_expect(strstr(why, "unreachable"), "%s", why);
    /* A proxy starts anyway: it keeps trying, and says so in /health. */
    proxy_up(uri[0], NULL, INTERVAL_MS);
    wait_rounds_total(1);
    cr_expect(!store_reachable());
    expect_503("prefill", uri[0]);
}

Test(discovery, bad_command_lines)
{
    output_t o;
    static const char *const proxy_cases[][10] = {
        {"--discover", "etcd://no-port", "--port", "0"},
        {"--discover", "ftp://127.0.0.1:1", "--port", "0"},
        {"--discover", "redis://", "--port", "0"},
        {"--discover", "p2p", "--port", "0"},
        {"--discover", "redis://127.0.0.1:1", "--cluster", "a/b", "--port", "0"},
        {"--discover", "redis://127.0.0.1:1", "--discover-interval-ms", "0", "--port", "0"},
        {"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--cluster", "x",
         "--port", "0"},
        {"--prefill", "http://127.0.0.1:1", "--port", "0"},
    };
    for (size_t i = 0; i < sizeof proxy_cases / sizeof proxy_cases[0]; i++) {
        int st = run(&o, "proxy", proxy_cases[i]);
        cr_expect_eq(st, 2, "proxy %s %s: exit %d: %s", proxy_cases[i][0], proxy_cases[i][1], st,
                     o.err);
    }
    static const char *const serve_cases[][6] = {
        {"--metadata", "etcd://no-port"},
        {"--metadata", "bogus://h:1"},
        {"--metadata", "redis://127.0.0.1:1", "--metadata-ttl-ms", "999"},
        {"--metadata", "redis://127.0.0.1:1", "--cluster", "no/slash"},
        {"--cluster", "c"},
    };
    for (size_t i = 0; i < sizeof serve_cases / sizeof serve_cases[0]; i++) {
        const char *a[16] = {"--role", "prefill", "--model", "tiny-gqa", "--port", "0"};
        memcpy(a + 6, serve_cases[i], sizeof serve_cases[i]);
        int st = run(&o, "serve", a);
        cr_expect_eq(st, 2, "serve %s %s: exit %d: %s", serve_cases[i][0], serve_cases[i][1], st,
                     o.err);
    }
    /* The library refuses the same. */
    kvb_pd_proxy_opts_t po = {.discover = "etcd://"};
    char why[256];
    cr_expect_eq(kvb_pd_proxy_start(&po, &px, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_expect(strstr(why, "bad discovery URI 'etcd://'"), "%s", why);
    po.discover = NULL;
    cr_expect_eq(kvb_pd_proxy_start(&po, &px, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_expect(strstr(why, "no prefill instance given"), "%s", why);
    kvb_pd_server_opts_t so = {.role = KVB_PD_ROLE_DECODE,
                               .kv_mode = KVB_PD_KV_PULL,
                               .model = "tiny-gqa",
                               .tp = 1,
                               .metadata = "redis://127.0.0.1:1",
                               .metadata_ttl_ms = 500};
    kvb_pd_server_t *srv = NULL;
    cr_expect_eq(kvb_pd_server_create(&so, &srv, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_expect(strstr(why, "under the minimum"), "%s", why);
    so.metadata_ttl_ms = 0;
    so.metadata = "etcd://";
    cr_expect_eq(kvb_pd_server_create(&so, &srv, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_expect(strstr(why, "bad metadata URI"), "%s", why);
    so.metadata = NULL;
    so.lease_ms = KVB_PD_SERVER_LEASE_MIN_MS - 1; /* reads end 500 ms before a lease does */
    cr_expect_eq(kvb_pd_server_create(&so, &srv, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_expect(strstr(why, "lease_ms must be at least"), "%s", why);
    cr_expect_null(srv);
}
