/* SPDX-License-Identifier: Apache-2.0 */
/* The PD runtime under load (issue 16): 32 concurrent clients through the proxy to a TP 2 prefill
 * and a TP 1 decode with small block pools, pull and push, prompts of 1 to 40 blocks (most longer
 * than the pool has free at that moment, so requests wait in the admission queues), streamed and
 * not: no errors, every answer equal to a colocated instance's, and afterwards every pool full
 * again with no lease or reservation left. Also admission's refusals one by one: queue full,
 * deadline passed (503 with Retry-After and a reason), more blocks than the instance has (400 at
 * once), and an expiring reservation that frees its blocks and wakes the queue. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "pd/model/model.h"
#include "pd/proxy/proxy.h"
#include "pd_procs.h"

#define CLIENTS 32
#if defined(__SANITIZE_ADDRESS__)
/* An AddressSanitizer build (-O0) computes some 30 times slower: one request per client still
 * covers every prompt length from 1 to 40 blocks (request 0: 1 block, request 3: 40). */
#define PER_CLIENT 1
#else
#define PER_CLIENT 3
#endif
#define N_REQ       (CLIENTS * PER_CLIENT)
#define MAX_BLOCKS  40 /* longest prompt, in blocks of 16 tokens */
#define POOL_BLOCKS "64"

static char model_path[96];
static kvb_pd_proxy_t *px;
static char px_url[64];

/* A small GQA model (2 layers, hidden 64) saved to a file: the same code paths as the presets at a
 * twentieth of the work, so that 2 x 96 prompts of up to 640 tokens stay a few seconds. */
static void model_file(void)
{
    kvb_pd_config_t c = {.attn = KVB_KV_ATTN_GQA,
                         .n_layers = 2,
                         .hidden = 64,
                         .ffn = 128,
                         .vocab = KVB_PD_VOCAB_MIN,
                         .n_heads = 4,
                         .n_kv_heads = 2,
                         .head_dim = 16,
                         .rope_theta = 10000.0f,
                         .norm_eps = 1e-5f};
    kvb_pd_model_t *m = NULL;
    char why[256];
    cr_assert_eq(kvb_pd_model_random(&c, "load", 7, &m, why, sizeof why), KVB_OK, "%s", why);
    snprintf(model_path, sizeof model_path, "/tmp/kvb_load_model_%d.kvbm", (int)getpid());
    cr_assert_eq(kvb_pd_model_save(m, model_path, why, sizeof why), KVB_OK, "%s", why);
    kvb_pd_model_free(m);
}

static void init(void)
{
    cr_assert_eq(kvb_pd_client_init(), 0);
    model_file();
}

static void fini(void)
{
    kvb_pd_proxy_stop(px);
    px = NULL;
    stop_all();
    unlink(model_path);
}

TestSuite(load, .init = init, .fini = fini, .timeout = 120);

static void proxy_up(const char *prefill, const char *decode, kvb_pd_kv_mode_t mode)
{
    kvb_pd_proxy_opts_t o = {.prefill = (const char *const[]){prefill},
                             .n_prefill = 1,
                             .decode = (const char *const[]){decode},
                             .n_decode = 1,
                             .kv_mode = mode,
                             .timeout_ms = 60000};
    char why[256];
    cr_assert_eq(kvb_pd_proxy_start(&o, &px, why, sizeof why), 0, "proxy: %s", why);
    snprintf(px_url, sizeof px_url, "http://127.0.0.1:%u", (unsigned)kvb_pd_proxy_port(px));
}

/* ---- Requests -------------------------------------------------------------------------------- */

/* Request i: a prompt of 1..40 blocks (every length met, both ends included; BOS + bytes), a few
 * tokens, streamed every other time. */
static size_t prompt_bytes(unsigned i)
{
    unsigned blocks = 1 + (i * 13) % MAX_BLOCKS;
    return (size_t)(blocks - 1) * 16 + (i * 7) % 16; /* + BOS: 16 (b - 1) + 1 .. 16 b tokens */
}

static char *body_for(unsigned i, bool stream)
{
    size_t n = prompt_bytes(i);
    char *p = malloc(n + 1);
    for (size_t k = 0; k < n; k++)
        p[k] = (char)(' ' + (k * 31 + i * 17) % 95);
    p[n] = '\0';
    json_t *j = json_pack("{s:s, s:i, s:b, s:i}", "prompt", p, "max_tokens", (int)(2 + i % 5),
                          "stream", stream, "timeout_ms", 60000);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    free(p);
    return s;
}

typedef struct {
    const char *ref_url;
    atomic_uint next;
    pthread_mutex_t mu;
    unsigned errors, differ;
    char first[768];
} load_t;

static void note(load_t *l, bool differ, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void note(load_t *l, bool differ, const char *fmt, ...)
{
    pthread_mutex_lock(&l->mu);
    if (!l->errors && !l->differ) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(l->first, sizeof l->first, fmt, ap);
        va_end(ap);
    }
    *(differ ? &l->differ : &l->errors) += 1;
    pthread_mutex_unlock(&l->mu);
}

static bool same(const kvb_pd_completion_t *a, const kvb_pd_completion_t *b)
{
    if (a->n_tokens != b->n_tokens || !a->n_tokens || strcmp(a->text, b->text))
        return false;
    return !memcmp(a->tokens, b->tokens, a->n_tokens * sizeof *a->tokens);
}

static void *client(void *arg)
{
    load_t *l = arg;
    unsigned i;
    while ((i = atomic_fetch_add(&l->next, 1)) < N_REQ) {
        bool stream = i % 2;
        char *b = body_for(i, stream), *rb = body_for(i, false);
        kvb_pd_completion_t pd, ref;
        kvb_pd_complete(px_url, b, 60000, &pd);
        kvb_pd_complete(l->ref_url, rb, 60000, &ref);
        if (!pd.ok)
            note(l, false, "request %u (%zu bytes, stream %d): HTTP %ld: %s", i, prompt_bytes(i),
                 stream, pd.status, pd.error);
        else if (!ref.ok)
            note(l, false, "colocated, request %u: HTTP %ld: %s", i, ref.status, ref.error);
        else if (!same(&pd, &ref))
            note(l, true, "request %u: %zu tokens '%s', colocated %zu '%s'", i, pd.n_tokens,
                 pd.text, ref.n_tokens, ref.text);
        kvb_pd_completion_free(&pd);
        kvb_pd_completion_free(&ref);
        free(b);
        free(rb);
    }
    return NULL;
}

/* ---- Instance state -------------------------------------------------------------------------- */

static json_t *health(const inst_t *in)
{
    char url[96], *body = NULL;
    snprintf(url, sizeof url, "%s/health", in->url);
    long st = kvb_pd_http(url, NULL, 2000, &body, NULL, 0);
    json_t *j = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    return j;
}

static json_int_t num(json_t *j, const char *key)
{
    return json_integer_value(json_object_get(j, key));
}

/* Whether the instance holds nothing: every block free, no lease, reservation, request or waiter.
 */
static bool idle(json_t *h)
{
    json_t *q = json_object_get(h, "queue");
    return h && num(h, "free_blocks") == num(h, "total_blocks") && num(h, "leases") == 0 &&
           num(h, "reservations") == 0 && num(h, "draining") == 0 && num(h, "active") == 0 &&
           num(q, "depth") == 0;
}

/* Waits (5 s at most: leases end when the decode's reads are confirmed) until the instance is
 * idle; fails with its last /health otherwise. */
static void expect_idle(const inst_t *in, const char *what)
{
    uint64_t dl = kvb__deadline_ms(5000);
    json_t *h = health(in);
    while (!idle(h) && kvb__now_ns() < dl) {
        json_decref(h);
        usleep(20000);
        h = health(in);
    }
    char *s = h ? json_dumps(h, JSON_COMPACT) : NULL;
    cr_expect(idle(h), "%s holds something after the load: %s", what, s ? s : "(no /health)");
    free(s);
    json_decref(h);
}

/* The largest batched decode pass the instance ran. */
static json_int_t batch_max(const inst_t *in)
{
    json_t *h = health(in);
    json_int_t n = num(json_object_get(h, "batching"), "max");
    json_decref(h);
    return n;
}

static json_int_t waited(const inst_t *in)
{
    json_t *h = health(in);
    json_int_t n = num(json_object_get(h, "queue"), "waited");
    json_decref(h);
    return n;
}

/* ---- The load -------------------------------------------------------------------------------- */

static void load(const char *mode)
{
    need_serve();
    inst_t ref, pre, dec;
    serve_with(&ref, "both", model_path, 1, mode, (const char *const[]){"--blocks", "4096", NULL});
    serve_with(&pre, "prefill", model_path, 2, mode,
               (const char *const[]){"--blocks", POOL_BLOCKS, NULL});
    serve_with(&dec, "decode", model_path, 1, mode,
               (const char *const[]){"--blocks", POOL_BLOCKS, NULL});
    kvb_pd_kv_mode_t m;
    kvb_pd_kv_mode_parse(mode, &m);
    proxy_up(pre.url, dec.url, m);

    load_t l = {.ref_url = ref.url};
    pthread_mutex_init(&l.mu, NULL);
    pthread_t th[CLIENTS];
    uint64_t t0 = kvb__now_ns();
    for (int i = 0; i < CLIENTS; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, client, &l), 0);
    for (int i = 0; i < CLIENTS; i++)
        pthread_join(th[i], NULL);
    double secs = (double)(kvb__now_ns() - t0) / 1e9;
    cr_log_info("%s: %d requests from %d clients in %.2f s; %u errors, %u differ; waited: "
                "prefill %lld, decode %lld; largest decode batch: decode %lld, colocated %lld",
                mode, N_REQ, CLIENTS, secs, l.errors, l.differ, (long long)waited(&pre),
                (long long)waited(&dec), (long long)batch_max(&dec), (long long)batch_max(&ref));
    /* 32 clients on one colocated instance: their decode steps share passes. */
    cr_expect_gt(batch_max(&ref), 1, "%s: no decode step was ever batched", mode);
    cr_expect_eq(l.errors, 0, "%s: %u errors; first: %s", mode, l.errors, l.first);
    cr_expect_eq(l.differ, 0, "%s: %u answers differ from the colocated; first: %s", mode, l.differ,
                 l.first);
    /* The pools are small: requests must have waited for blocks rather than been turned away. */
    cr_expect_gt(waited(&pre) + waited(&dec), 0, "%s: no request ever waited for blocks", mode);
    expect_idle(&pre, "the prefill");
    expect_idle(&dec, "the decode");
    expect_idle(&ref, "the colocated instance");
    pthread_mutex_destroy(&l.mu);
}

Test(load, pull_32_clients)
{
    load("pull");
}

Test(load, push_32_clients)
{
    load("push");
}

/* ---- Admission's refusals, one at a time ------------------------------------------------------
 */

static char psegs[256];

/* A push reservation of `bytes` prompt bytes (+ BOS) and 1 token, held for timeout_ms. */
static void reserve(const inst_t *dec, const char *id, size_t bytes, int timeout_ms, answer_t *a)
{
    char *p = malloc(bytes + 1);
    memset(p, 'x', bytes);
    p[bytes] = '\0';
    char *body = malloc(bytes + 512);
    sprintf(body,
            "{\"request_id\":\"%s\",\"prompt\":\"%s\",\"prefill_segments\":%s,\"timeout_ms\":%d,"
            "\"max_tokens\":1}",
            id, p, psegs, timeout_ms);
    post_raw(dec->port, "/pd/reserve", body, a);
    free(p);
    free(body);
}

typedef struct {
    const inst_t *dec;
    const char *id;
    size_t bytes;
    int timeout_ms;
    answer_t a;
    double ms;
} bg_t;

static void *bg_reserve(void *arg)
{
    bg_t *b = arg;
    uint64_t t = kvb__now_ns();
    reserve(b->dec, b->id, b->bytes, b->timeout_ms, &b->a);
    b->ms = (double)(kvb__now_ns() - t) / 1e6;
    return NULL;
}

static void wait_depth(const inst_t *in, json_int_t depth)
{
    uint64_t dl = kvb__deadline_ms(3000);
    json_int_t d = -1;
    while (d != depth && kvb__now_ns() < dl) {
        json_t *h = health(in);
        d = num(json_object_get(h, "queue"), "depth");
        json_decref(h);
        if (d != depth)
            usleep(5000);
    }
    cr_assert_eq(d, depth, "queue depth %lld, want %lld", (long long)d, (long long)depth);
}

/* A decode of 8 blocks and a queue of 1. Blocks of 16 tokens: 95 bytes + BOS = 6 blocks. */
Test(load, admission_refusals)
{
    need_serve();
    inst_t pre, dec;
    serve(&pre, "prefill", model_path, 1, "push");
    serve_with(&dec, "decode", model_path, 1, "push",
               (const char *const[]){"--blocks", "8", "--max-queue", "1", NULL});
    char url[96], *info = NULL;
    snprintf(url, sizeof url, "%s/pd/info", pre.url);
    cr_assert_eq(kvb_pd_http(url, NULL, 5000, &info, NULL, 0), 200);
    json_t *ij = json_loads(info, 0, NULL);
    char *segs = json_dumps(json_object_get(ij, "segments"), JSON_COMPACT);
    snprintf(psegs, sizeof psegs, "%s", segs);
    free(segs);
    json_decref(ij);
    free(info);

    answer_t a;
    reserve(&dec, "r1", 95, 3000, &a); /* 6 of 8 blocks */
    cr_assert_eq(a.status, 200, "%s", a.body);

    /* r2 needs 4: it waits; r3 finds the queue full at once. */
    bg_t b2 = {.dec = &dec, .id = "r2", .bytes = 60, .timeout_ms = 400};
    pthread_t t2;
    cr_assert_eq(pthread_create(&t2, NULL, bg_reserve, &b2), 0);
    wait_depth(&dec, 1);
    uint64_t t = kvb__now_ns();
    reserve(&dec, "r3", 10, 5000, &a);
    cr_expect_eq(a.status, 503, "%s", a.body);
    cr_expect_str_eq(a.reason, "queue_full", "%s", a.body);
    cr_expect(a.retry_after[0], "a 503 carries Retry-After");
    cr_expect_lt(kvb__now_ns() - t, 500000000ull, "queue full is answered at once");
    pthread_join(t2, NULL);
    cr_expect_eq(b2.a.status, 503, "%s", b2.a.body);
    cr_expect_str_eq(b2.a.reason, "deadline", "%s", b2.a.body);
    cr_expect(b2.a.retry_after[0], "a 503 carries Retry-After");
    cr_expect(b2.ms >= 350 && b2.ms < 2500, "deadline refusal after %.0f ms", b2.ms);

    /* More blocks than the instance has: refused at once, not queued. */
    t = kvb__now_ns();
    reserve(&dec, "r4", 200, 5000, &a);
    cr_expect_eq(a.status, 400, "%s", a.body);
    cr_expect_str_eq(a.reason, "too_large", "%s", a.body);
    cr_expect(strstr(a.body, "never"), "%s", a.body);
    cr_expect_lt(kvb__now_ns() - t, 500000000ull, "too large is answered at once");

    /* r1 is aborted by a caller that says no prefill was told of it ("writers_done"): its
     * blocks are free at once. r5 holds 6 blocks for 300 ms and expires unused: a prefill told of
     * it could still be writing into them, so they stay out of use for another second
     * (KVB__SRV_WRITE_SETTLE_MS), and r6 (4 blocks) is admitted only then. */
    cr_expect_eq(kvb_pd_http(strcat(strcpy(url, dec.url), "/pd/abort"),
                             "{\"request_id\":\"r1\",\"writers_done\":true}", 2000, &info, NULL, 0),
                 200);
    free(info);
    reserve(&dec, "r5", 95, 300, &a);
    cr_assert_eq(a.status, 200, "%s", a.body);
    bg_t b6 = {.dec = &dec, .id = "r6", .bytes = 60, .timeout_ms = 4000};
    bg_reserve(&b6);
    cr_expect_eq(b6.a.status, 200, "%s", b6.a.body);
    cr_expect(b6.ms >= 1000 && b6.ms < 3900, /* 1300 ms from r5's arrival, less its reply */
              "admitted after %.0f ms (r5 expires at 300, its blocks are free a second later)",
              b6.ms);
    cr_expect_eq(
        kvb_pd_http(url, "{\"request_id\":\"r6\",\"writers_done\":true}", 2000, &info, NULL, 0),
        200);
    free(info);
    /* Aborted without "writers_done" (a prefill that was told may not have finished): the blocks
     * stay out of use until the writers say so or a second past the reservation's end. */
    reserve(&dec, "r7", 10, 500, &a);
    cr_assert_eq(a.status, 200, "%s", a.body);
    cr_expect_eq(kvb_pd_http(url, "{\"request_id\":\"r7\"}", 2000, &info, NULL, 0), 200);
    free(info);
    json_t *h = health(&dec);
    cr_expect_lt(json_integer_value(json_object_get(h, "free_blocks")), 8,
                 "an aborted reservation's blocks went back while a writer could still land");
    json_decref(h);
    expect_idle(&dec, "the decode");
}

/* Through the proxy: a prompt longer than the prefill's whole pool fails at once with the reason.
 */
Test(load, too_large_fails_at_once)
{
    need_serve();
    inst_t pre, dec;
    serve_with(&pre, "prefill", model_path, 1, "pull",
               (const char *const[]){"--blocks", "8", NULL});
    serve(&dec, "decode", model_path, 1, "pull");
    proxy_up(pre.url, dec.url, KVB_PD_KV_PULL);
    char p[200], body[300];
    memset(p, 'y', 150);
    p[150] = '\0';
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":2}", p);
    kvb_pd_completion_t c;
    uint64_t t = kvb__now_ns();
    kvb_pd_complete(px_url, body, 10000, &c);
    cr_expect_eq(c.status, 400, "%ld %s", c.status, c.error);
    cr_expect(strstr(c.error, "can never be admitted"), "%s", c.error);
    cr_expect_lt(kvb__now_ns() - t, 1000000000ull);
    kvb_pd_completion_free(&c);
}

/* ---- kvbridge loadgen ------------------------------------------------------------------------ */

/* Runs `$KVB_BIN loadgen args...` and returns its exit status with its last output line parsed
 * as JSON (--json) in *summary. */
static int loadgen(const char *const *args, json_t **summary)
{
    const char *argv[32] = {bin(), "loadgen"};
    int n = 2;
    for (; args[n - 2] && n < 31; n++)
        argv[n] = args[n - 2];
    argv[n] = NULL;
    int po[2];
    cr_assert_eq(pipe(po), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(po[1], 1);
        close(po[0]);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(po[1]);
    static char out[65536];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof out - 1 && (k = read(po[0], out + len, sizeof out - 1 - len)) > 0)
        len += (size_t)k;
    out[len] = '\0';
    close(po[0]);
    int st = -1;
    waitpid(pid, &st, 0);
    while (len && out[len - 1] == '\n')
        out[--len] = '\0';
    const char *last = strrchr(out, '\n');
    *summary = json_loads(last ? last + 1 : out, 0, NULL);
    cr_log_info("loadgen:\n%s", out);
    cr_assert(*summary, "no JSON summary line in:\n%s", out);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The count of one error kind in a summary (logging every kind counted). */
static json_int_t kind_count(json_t *summary, const char *kind)
{
    char *all = json_dumps(json_object_get(summary, "errors_by_kind"), JSON_COMPACT);
    cr_log_info("errors by kind: %s", all ? all : "?");
    free(all);
    return json_integer_value(json_object_get(json_object_get(summary, "errors_by_kind"), kind));
}

/* Through the proxy, compared with a colocated instance: nothing differs, nothing fails. */
Test(load, loadgen_compare_and_json)
{
    need_serve();
    inst_t ref, pre, dec;
    serve(&ref, "both", model_path, 1, "pull");
    serve(&pre, "prefill", model_path, 2, "pull");
    serve(&dec, "decode", model_path, 1, "pull");
    proxy_up(pre.url, dec.url, KVB_PD_KV_PULL);
    json_t *s = NULL;
    int rc = loadgen((const char *const[]){"--url", px_url, "--compare", ref.url, "--json",
                                           "--concurrency", "8", "--requests", "16", "--prompt-len",
                                           "100", "--max-tokens", "4", "--stream", NULL},
                     &s);
    cr_expect_eq(rc, 0);
    cr_expect_eq(num(s, "ok"), 16);
    cr_expect_eq(num(s, "errors"), 0);
    cr_expect_eq(num(s, "compared"), 16);
    cr_expect_eq(num(s, "differ"), 0);
    cr_expect_eq(json_object_size(json_object_get(s, "errors_by_kind")), 0);
    json_decref(s);
    /* Other weights (a preset's seed) as the reference: every answer differs, and the exit
     * status says so. */
    inst_t a, b;
    serve_with(&a, "both", "tiny-gqa", 1, "pull", (const char *const[]){"--seed", "1", NULL});
    serve_with(&b, "both", "tiny-gqa", 1, "pull", (const char *const[]){"--seed", "2", NULL});
    rc = loadgen((const char *const[]){"--url", a.url, "--compare", b.url, "--json",
                                       "--concurrency", "2", "--requests", "4", "--prompt-len",
                                       "20", "--max-tokens", "8", NULL},
                 &s);
    cr_expect_eq(rc, 1);
    cr_expect_eq(num(s, "errors"), 0);
    cr_expect_eq(num(s, "differ"), 4, "differ %lld", (long long)num(s, "differ"));
    json_decref(s);
}

/* Errors are counted by kind: here every prompt needs more blocks than the instance has. */
Test(load, loadgen_errors_by_kind)
{
    need_serve();
    inst_t in;
    serve_with(&in, "both", model_path, 1, "pull", (const char *const[]){"--blocks", "4", NULL});
    json_t *s = NULL;
    int rc = loadgen((const char *const[]){"--url", in.url, "--json", "--concurrency", "2",
                                           "--requests", "5", "--prompt-len", "100", NULL},
                     &s);
    cr_expect_eq(rc, 1);
    cr_expect_eq(num(s, "errors"), 5);
    cr_expect_eq(kind_count(s, "HTTP 400 too_large"), 5);
    json_decref(s);
    /* Nothing listens: no response. */
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u", (unsigned)free_port());
    rc = loadgen((const char *const[]){"--url", url, "--json", "--requests", "3", NULL}, &s);
    cr_expect_eq(rc, 1);
    cr_expect_eq(kind_count(s, "no_response"), 3);
    json_decref(s);
}

/* --api-key-file: an instance that wants a bearer key refuses loadgen's requests without one
 * (counted as 401 invalid_api_key) and serves them with the file's first key; a file that holds
 * no key is a command-line error. */
Test(load, loadgen_api_key)
{
    need_serve();
    char keys[64], bad[64];
    snprintf(keys, sizeof keys, "/tmp/kvb-load-keys-%d", (int)getpid());
    snprintf(bad, sizeof bad, "/tmp/kvb-load-nokey-%d", (int)getpid());
    pd_write_private(keys, "# loadgen's key\n\nsk-load-first\nsk-load-second\n");
    pd_write_private(bad, "# no key here\n");
    inst_t in;
    serve_with(&in, "both", model_path, 1, "pull",
               (const char *const[]){"--api-key-file", keys, NULL});
    json_t *s = NULL;
    int rc = loadgen((const char *const[]){"--url", in.url, "--json", "--concurrency", "2",
                                           "--requests", "4", "--max-tokens", "2", NULL},
                     &s);
    cr_expect_eq(rc, 1);
    cr_expect_eq(kind_count(s, "HTTP 401 invalid_api_key"), 4);
    json_decref(s);
    rc = loadgen((const char *const[]){"--url", in.url, "--json", "--concurrency", "2",
                                       "--requests", "4", "--max-tokens", "2", "--api-key-file",
                                       keys, "--stream", NULL},
                 &s);
    cr_expect_eq(rc, 0);
    cr_expect_eq(num(s, "ok"), 4);
    cr_expect_eq(num(s, "errors"), 0);
    json_decref(s);
    const char *const args[] = {"loadgen", "--url", in.url, "--api-key-file", bad, NULL};
    cr_expect_eq(run_quiet(args), 2, "a key file without a key is a bad command line");
    unlink(keys);
    unlink(bad);
}

/* A connected, idle client: what a slow or hostile client holds. */
static int idle_client(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

/* What a request on `fd` gets within `ms`: 1 an HTTP answer, 0 nothing yet, -1 the connection
 * closed. */
static int answer_within(int fd, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    char buf[16];
    if (poll(&p, 1, ms) != 1)
        return 0;
    ssize_t n = recv(fd, buf, sizeof buf, MSG_PEEK);
    return n >= 5 && !memcmp(buf, "HTTP/", 5) ? 1 : n <= 0 ? -1 : 0;
}

static void send_health(int fd)
{
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    cr_assert_eq(send(fd, req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)sizeof req - 1);
}

/* --max-connections bounds an instance's connections (a thread each): with the limit held by
 * idle clients one more is not served - closed at accept, or left in the listen backlog, as
 * libmicrohttpd chooses - and once one closes the instance serves again. The proxy takes the
 * same option. */
Test(load, connection_limit)
{
    need_serve();
    inst_t in;
    serve_with(&in, "both", model_path, 1, "pull",
               (const char *const[]){"--max-connections", "3", NULL});
    usleep(300000); /* the readiness probes' connections are gone */
    int held[3];
    for (int i = 0; i < 3; i++)
        held[i] = idle_client(in.port);
    usleep(300000); /* accepted, each on its thread */
    int extra = idle_client(in.port);
    send_health(extra);
    int got = answer_within(extra, 1000);
    cr_expect_neq(got, 1, "a 4th connection past --max-connections 3 was served");
    close(held[0]);
    if (got == -1) { /* closed at accept: a new one is served now */
        close(extra);
        usleep(300000);
        extra = idle_client(in.port);
        send_health(extra);
    }
    cr_expect_eq(answer_within(extra, 10000), 1, "served once a connection closed");
    close(extra);
    close(held[1]);
    close(held[2]);
}
