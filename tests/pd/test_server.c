/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the PD instance server (src/pd/server/): real instances in child processes (forked,
 * running the server API), driven over HTTP with libcurl the way the proxy drives them. Checks
 * that colocated, pull and push answers equal kvb_pd_generate() token for token, that bad
 * requests get 400/413, an incompatible pair 409 with the guard's reason, and that a prefill
 * killed mid-transfer fails the decode's request promptly and gives its blocks back. */
#include <criterion/criterion.h>
#include <curl/curl.h>
#include <jansson.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "pd/auth.h"
#include "pd/model/model.h"
#include "pd/server/server.h"

#define MAX_INST   4
#define BLOCKS     64
#define MAX_TOKENS 8

typedef struct {
    pid_t pid;
    uint16_t port;
} inst_t;

static inst_t insts[MAX_INST];
static int ninst;
static const char *api_key_file;      /* the next start()'s --api-key-file */
static uint32_t idle_timeout_s;       /* the next start()'s --idle-timeout-s */
static uint32_t lease_ms = 3000;      /* the next start()'s --lease-ms */
static uint32_t pool_blocks = BLOCKS; /* the next start()'s --blocks */
static kvb__pd_auth_t *signer;        /* signs /pd/ calls when set (instances with a secret) */
static const char *extra_header;      /* one more header line for every call, when set */
static const char *log_file;          /* the next start()'s stderr, when set */

/* ---- instances -------------------------------------------------------------------------------
 */

static void child_main(const kvb_pd_server_opts_t *o, int fd, const char *stall)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigprocmask(SIG_BLOCK, &set, NULL); /* before any thread: only sigwait() sees SIGTERM */
    if (stall)
        setenv("KVB_PD_FAULT_STALL_LAYER", stall, 1);
    int lfd = log_file ? open(log_file, O_WRONLY | O_CREAT | O_TRUNC, 0600) : -1;
    if (lfd >= 0) {
        dup2(lfd, STDERR_FILENO);
        close(lfd);
    }
    kvb_pd_server_t *srv = NULL;
    char why[512];
    uint16_t port = 0;
    if (kvb_pd_server_create(o, &srv, why, sizeof why) == KVB_OK)
        port = kvb_pd_server_port(srv);
    else
        fprintf(stderr, "server: %s\n", why);
    if (write(fd, &port, sizeof port) != sizeof port || !srv)
        _exit(1);
    int sig;
    sigwait(&set, &sig);
    kvb_pd_server_destroy(srv);
    _exit(0);
}

/* Starts an instance (port picked by the server) and waits until it serves. */
static inst_t *start(kvb_pd_role_t role, const char *model, uint64_t seed, uint32_t tp,
                     kvb_pd_kv_mode_t mode, const char *stall)
{
    cr_assert_lt(ninst, MAX_INST);
    kvb_pd_server_opts_t o = {.role = role,
                              .kv_mode = mode,
                              .model = model,
                              .seed = seed,
                              .tp = tp,
                              .blocks = pool_blocks,
                              .lease_ms = lease_ms,
                              .api_key_file = api_key_file,
                              .idle_timeout_s = idle_timeout_s};
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(p[0]);
        child_main(&o, p[1], stall);
    }
    close(p[1]);
    inst_t *in = &insts[ninst++];
    in->pid = pid;
    struct pollfd pfd = {.fd = p[0], .events = POLLIN};
    uint16_t port = 0;
    if (poll(&pfd, 1, 20000) == 1 && read(p[0], &port, sizeof port) == sizeof port)
        in->port = port;
    close(p[0]);
    cr_assert_neq(in->port, 0, "instance did not start");
    return in;
}

static void stop(inst_t *in)
{
    if (in->pid <= 0)
        return;
    kill(in->pid, SIGTERM);
    for (int i = 0; i < 100; i++) { /* 5 s to stop cleanly, then killed */
        if (waitpid(in->pid, NULL, WNOHANG) == in->pid) {
            in->pid = 0;
            return;
        }
        usleep(50000);
    }
    kill(in->pid, SIGKILL);
    waitpid(in->pid, NULL, 0);
    in->pid = 0;
}

static void kill_now(inst_t *in)
{
    kill(in->pid, SIGKILL);
    waitpid(in->pid, NULL, 0);
    in->pid = 0;
}

static void setup(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    ninst = 0;
    api_key_file = NULL;
    idle_timeout_s = 0;
    signer = NULL;
    extra_header = NULL;
    log_file = NULL;
}

static void teardown(void)
{
    for (int i = 0; i < ninst; i++)
        stop(&insts[i]);
    kvb__pd_auth_free(signer);
    curl_global_cleanup();
}

TestSuite(server, .init = setup, .fini = teardown, .timeout = 60);

/* ---- HTTP ------------------------------------------------------------------------------------ */

typedef struct {
    char *s;
    size_t len;
} buf_t;

static size_t on_data(char *p, size_t size, size_t n, void *user)
{
    buf_t *b = user;
    size_t k = size * n;
    char *s = realloc(b->s, b->len + k + 1);
    if (!s)
        return 0;
    memcpy(s + b->len, p, k);
    b->s = s;
    b->len += k;
    s[b->len] = '\0';
    return k;
}

/* POSTs `body` (GET when NULL); returns the status (0 on a transport error) and the answer. */
static long http(const inst_t *in, const char *path, const char *body, char **out, long timeout_ms)
{
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%u%s", in->port, path);
    CURL *c = curl_easy_init();
    buf_t b = {.s = calloc(1, 1)};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    if (body)
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    struct curl_slist *hdrs = NULL;
    char line[KVB_PD_AUTH_LINE_MAX];
    if (signer && !strncmp(path, "/pd/", 4)) {
        cr_assert_eq(kvb__pd_auth_sign(signer, body ? "POST" : "GET", path, body,
                                       body ? strlen(body) : 0, line),
                     KVB_OK);
        hdrs = curl_slist_append(hdrs, line);
    }
    if (extra_header)
        hdrs = curl_slist_append(hdrs, extra_header);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
    long status = 0;
    if (curl_easy_perform(c) == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    curl_slist_free_all(hdrs);
    if (out)
        *out = b.s;
    else
        free(b.s);
    return status;
}

/* POSTs and parses a JSON answer; asserts the status. */
static json_t *post_json(const inst_t *in, const char *path, long want, const char *fmt, ...)
{
    char body[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    char *out = NULL;
    long st = http(in, path, body, &out, 20000);
    cr_assert_eq(st, want, "%s -> %ld, want %ld: %s", path, st, want, out);
    json_t *j = json_loads(out, 0, NULL);
    cr_assert_not_null(j, "%s answered no JSON: %s", path, out);
    free(out);
    return j;
}

static json_t *get_json(const inst_t *in, const char *path)
{
    char *out = NULL;
    cr_assert_eq(http(in, path, NULL, &out, 5000), 200, "GET %s: %s", path, out);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    cr_assert_not_null(j);
    return j;
}

static char *dump(json_t *j)
{
    return json_dumps(j, JSON_COMPACT);
}

static long free_blocks(const inst_t *in)
{
    json_t *h = get_json(in, "/health");
    long n = (long)json_integer_value(json_object_get(h, "free_blocks"));
    json_decref(h);
    return n;
}

/* Waits up to 3 s for the instance's free block count to come back to `want`. */
static void expect_free(const inst_t *in, long want)
{
    long n = -1;
    for (int i = 0; i < 60 && (n = free_blocks(in)) != want; i++)
        usleep(50000);
    cr_assert_eq(n, want, "free blocks %ld, want %ld", n, want);
}

/* ---- the reference --------------------------------------------------------------------------- */

static const char *prompts[] = {
    "",                                                   /* BOS only: 1 token */
    "Hello world",                                        /* 12 tokens */
    "exactly 1 block",                                    /* 15 bytes + BOS = 16 */
    "thirty-one bytes make two block",                    /* 32: two full blocks */
    "a prompt that is longer than two blocks of sixteen", /* 51 */
};
#define NPROMPTS (sizeof prompts / sizeof *prompts)

static size_t reference(const char *model, const char *prompt, uint32_t *out)
{
    kvb_pd_model_t *m = NULL;
    char why[256];
    cr_assert_eq(kvb_pd_model_preset(model, 0, &m, why, sizeof why), KVB_OK, "%s", why);
    uint32_t toks[128];
    size_t n = 0, n_out = 0;
    cr_assert_eq(kvb_pd_tokenize(prompt, strlen(prompt), true, toks, 128, &n), KVB_OK);
    kvb_pd_gen_opts_t o = {.tp = 1, .max_tokens = MAX_TOKENS};
    cr_assert_eq(kvb_pd_generate(m, &o, toks, n, out, &n_out, why, sizeof why), KVB_OK, "%s", why);
    kvb_pd_model_free(m);
    return n_out;
}

/* Asserts that a completion's kvbridge.tokens are the reference's. */
static void check_tokens(json_t *answer, const char *model, const char *prompt)
{
    uint32_t want[MAX_TOKENS];
    size_t n = reference(model, prompt, want);
    json_t *toks = json_object_get(json_object_get(answer, "kvbridge"), "tokens");
    cr_assert_eq(json_array_size(toks), n, "prompt \"%s\": %zu tokens, want %zu", prompt,
                 json_array_size(toks), n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(json_integer_value(json_array_get(toks, i)), want[i],
                     "prompt \"%s\": token %zu differs", prompt, i);
    json_t *ch = json_array_get(json_object_get(answer, "choices"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")),
                     n == MAX_TOKENS && want[n - 1] != KVB_PD_EOS ? "length" : "stop");
}

/* ---- colocated ------------------------------------------------------------------------------- */

Test(server, colocated_equals_generate)
{
    inst_t *both = start(KVB_PD_ROLE_BOTH, "tiny-gqa", 0, 2, KVB_PD_KV_PULL, NULL);
    for (size_t i = 0; i < NPROMPTS; i++) {
        json_t *prompt = json_string(prompts[i]);
        char *p = json_dumps(prompt, JSON_ENCODE_ANY);
        json_t *a = post_json(both, "/v1/completions", 200, "{\"prompt\": %s, \"max_tokens\": %d}",
                              p, MAX_TOKENS);
        check_tokens(a, "tiny-gqa", prompts[i]);
        cr_assert_str_eq(json_string_value(json_object_get(a, "object")), "text_completion");
        json_decref(a);
        free(p);
        json_decref(prompt);
    }
    cr_assert_eq(free_blocks(both), BLOCKS);
}

Test(server, colocated_stream)
{
    inst_t *both = start(KVB_PD_ROLE_BOTH, "tiny-mla", 0, 1, KVB_PD_KV_PULL, NULL);
    char *out = NULL;
    long st =
        http(both, "/v1/completions",
             "{\"prompt\": \"Hello world\", \"max_tokens\": 8, \"stream\": true}", &out, 10000);
    cr_assert_eq(st, 200);
    /* 8 token events, one final event, then [DONE] */
    int events = 0;
    json_t *last = NULL;
    for (char *p = out; (p = strstr(p, "data: ")); p += 6) {
        events++;
        if (!strncmp(p + 6, "[DONE]", 6))
            break;
        json_decref(last);
        last = json_loads(p + 6, JSON_DISABLE_EOF_CHECK, NULL);
        cr_assert_not_null(last, "bad event: %.80s", p);
    }
    cr_assert_eq(events, MAX_TOKENS + 2, "%s", out);
    cr_assert(strstr(out, "data: [DONE]\n\n"));
    check_tokens(last, "tiny-mla", "Hello world");
    json_decref(last);
    free(out);
}

/* ---- disaggregated, driven as the proxy does ----------------------------------------------- */

/* The "ticket" an instance answered with (a lease's or a reservation's). */
static const char *ticket_of(json_t *answer)
{
    const char *t = json_string_value(json_object_get(answer, "ticket"));
    cr_assert_not_null(t, "the answer has no ticket");
    return t;
}

static json_t *segments(const inst_t *in)
{
    json_t *info = get_json(in, "/pd/info");
    json_t *s = json_incref(json_object_get(info, "segments"));
    json_decref(info);
    return s;
}

static json_t *pd_pull(const inst_t *pre, const inst_t *dec, const char *id, const char *prompt)
{
    json_t *ps = segments(pre), *ds = segments(dec), *pj = json_string(prompt);
    char *pss = dump(ps), *dss = dump(ds), *p = json_dumps(pj, JSON_ENCODE_ANY);
    json_t *r = post_json(pre, "/pd/prefill", 200,
                          "{\"request_id\": \"%s\", \"prompt\": %s, \"kv_mode\": \"pull\", "
                          "\"decode_segments\": %s}",
                          id, p, dss);
    char *blocks = dump(json_object_get(r, "blocks"));
    json_t *a = post_json(dec, "/pd/decode", 200,
                          "{\"request_id\": \"%s\", \"prompt\": %s, \"t0\": %lld, "
                          "\"prefill_blocks\": %s, \"prefill_segments\": %s, \"max_tokens\": %d, "
                          "\"kv_mode\": \"pull\", \"prefill_ticket\": \"%s\"}",
                          id, p, (long long)json_integer_value(json_object_get(r, "t0")), blocks,
                          pss, MAX_TOKENS, ticket_of(r));
    free(blocks), free(pss), free(dss), free(p);
    json_decref(r), json_decref(ps), json_decref(ds), json_decref(pj);
    return a;
}

static json_t *pd_push(const inst_t *pre, const inst_t *dec, const char *id, const char *prompt)
{
    json_t *ps = segments(pre), *ds = segments(dec), *pj = json_string(prompt);
    char *pss = dump(ps), *dss = dump(ds), *p = json_dumps(pj, JSON_ENCODE_ANY);
    json_t *res =
        post_json(dec, "/pd/reserve", 200,
                  "{\"request_id\": \"%s\", \"prompt\": %s, \"prefill_segments\": %s}", id, p, pss);
    char *blocks = dump(json_object_get(res, "blocks"));
    json_t *r =
        post_json(pre, "/pd/prefill", 200,
                  "{\"request_id\": \"%s\", \"prompt\": %s, \"kv_mode\": \"push\", "
                  "\"decode_segments\": %s, \"decode_blocks\": %s, \"decode_ticket\": \"%s\"}",
                  id, p, dss, blocks, ticket_of(res));
    json_t *a =
        post_json(dec, "/pd/decode", 200,
                  "{\"request_id\": \"%s\", \"prompt\": %s, \"t0\": %lld, \"max_tokens\": "
                  "%d, \"kv_mode\": \"push\"}",
                  id, p, (long long)json_integer_value(json_object_get(r, "t0")), MAX_TOKENS);
    free(blocks), free(pss), free(dss), free(p);
    json_decref(res), json_decref(r), json_decref(ps), json_decref(ds), json_decref(pj);
    return a;
}

static void pd_run(const char *model, kvb_pd_kv_mode_t mode)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, model, 0, 2, mode, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, model, 0, 1, mode, NULL);
    for (size_t i = 0; i < NPROMPTS; i++) {
        char id[32];
        snprintf(id, sizeof id, "r-%zu", i);
        json_t *a = mode == KVB_PD_KV_PULL ? pd_pull(pre, dec, id, prompts[i])
                                           : pd_push(pre, dec, id, prompts[i]);
        check_tokens(a, model, prompts[i]);
        json_decref(a);
    }
    expect_free(dec, BLOCKS);
    expect_free(pre, BLOCKS); /* pull: leases freed by the decode's notices */
}

Test(server, pull_gqa)
{
    pd_run("tiny-gqa", KVB_PD_KV_PULL);
}

Test(server, push_gqa)
{
    pd_run("tiny-gqa", KVB_PD_KV_PUSH);
}

Test(server, pull_mla)
{
    pd_run("tiny-mla", KVB_PD_KV_PULL);
}

Test(server, push_mla)
{
    pd_run("tiny-mla", KVB_PD_KV_PUSH);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static void expect_error(const inst_t *in, const char *path, const char *body, long want,
                         const char *needle)
{
    char *out = NULL;
    long st = http(in, path, body, &out, 5000);
    cr_assert_eq(st, want, "%s %s -> %ld: %s", path, body ? body : "GET", st, out);
    json_t *j = json_loads(out, 0, NULL);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert_not_null(msg, "no error message: %s", out);
    cr_assert(strstr(msg, needle), "message \"%s\" lacks \"%s\"", msg, needle);
    json_decref(j);
    free(out);
}

Test(server, bad_requests)
{
    inst_t *both = start(KVB_PD_ROLE_BOTH, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    expect_error(both, "/v1/completions", "{\"prompt\": \"x\"", 400, "malformed JSON");
    expect_error(both, "/v1/completions", "[1]", 400, "JSON object");
    expect_error(both, "/v1/completions", "{\"max_tokens\": 3}", 400, "prompt");
    expect_error(both, "/v1/completions", "{\"prompt\": 3}", 400, "prompt");
    expect_error(both, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 0}", 400,
                 "max_tokens");
    expect_error(both, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 4097}", 400,
                 "max_tokens");
    expect_error(both, "/v1/completions", "{\"prompt\": \"x\", \"temperature\": -1}", 400,
                 "temperature");
    expect_error(both, "/v1/completions", "{\"prompt\": \"x\", \"stream\": 1}", 400, "stream");
    expect_error(both, "/nope", "{}", 404, "no such endpoint");
    expect_error(both, "/health", "{}", 405, "does not take");
    expect_error(both, "/pd/prefill", "{}", 404, "prefill instances");
    char *big = malloc((2u << 20) + 64); /* over the 1 MiB body limit */
    memset(big, 'a', 2u << 20);
    memcpy(big, "{\"prompt\": \"", 12);
    strcpy(big + (2u << 20), "\"}");
    expect_error(both, "/v1/completions", big, 413, "over");
    free(big);
    cr_assert_eq(free_blocks(both), BLOCKS);
}

Test(server, pd_bad_requests)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    expect_error(pre, "/pd/prefill", "{\"prompt\": \"x\", \"decode_segments\": [\"a:1\"]}", 400,
                 "request_id");
    expect_error(pre, "/pd/prefill", "{\"request_id\": \"r\", \"prompt\": \"x\"}", 400,
                 "decode_segments");
    expect_error(dec, "/pd/decode", "{\"request_id\": \"r\", \"prompt\": \"x\", \"t0\": 99999}",
                 400, "t0");
    expect_error(dec, "/pd/decode", "{\"request_id\": \"r\", \"t0\": 1, \"kv_mode\": \"push\"}",
                 404, "no reservation");
    expect_error(dec, "/pd/abort", "{\"request_id\": \"nope\"}", 404, "no reservation");
    cr_assert_eq(free_blocks(dec), BLOCKS);
}

/* Different weights (seed) mean different model ids: the guard refuses the pair. */
Test(server, incompatible_pair)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 2, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 7, 1, KVB_PD_KV_PULL, NULL);
    inst_t *mla = start(KVB_PD_ROLE_DECODE, "tiny-mla", 0, 1, KVB_PD_KV_PULL, NULL);
    const inst_t *decs[2] = {dec, mla};
    for (int k = 0; k < 2; k++) {
        json_t *ds = segments(decs[k]);
        char *dss = dump(ds), body[1024];
        snprintf(body, sizeof body,
                 "{\"request_id\": \"x%d\", \"prompt\": \"hi\", \"decode_segments\": %s}", k, dss);
        expect_error(pre, "/pd/prefill", body, 409, "refused");
        free(dss);
        json_decref(ds);
    }
    json_t *h = get_json(pre, "/health");
    cr_assert_str_eq(json_string_value(json_object_get(h, "status")), "degraded");
    json_t *l = json_array_get(json_object_get(h, "links"), 0);
    cr_assert(strlen(json_string_value(json_object_get(l, "reason"))) > 0);
    cr_assert_str_neq(json_string_value(json_object_get(l, "verdict")), "ALLOW_HOMO");
    json_decref(h);
    cr_assert_eq(free_blocks(pre), BLOCKS);
}

/* ---- a prefill lost mid-transfer ------------------------------------------------------------ */

typedef struct {
    const inst_t *dec;
    char body[1024];
    long status;
    double secs;
} bg_t;

static void *bg_decode(void *arg)
{
    bg_t *b = arg;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    b->status = http(b->dec, "/pd/decode", b->body, NULL, 20000);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    b->secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    return NULL;
}

Test(server, push_prefill_killed)
{
    /* The prefill stalls after pushing layer 1 of 4 (fault hook), and is killed there. */
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 2, KVB_PD_KV_PUSH, "1");
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds);
    const char *prompt = "a prompt that is longer than two blocks of sixteen";
    json_t *res = post_json(
        dec, "/pd/reserve", 200,
        "{\"request_id\": \"k1\", \"prompt\": \"%s\", \"prefill_segments\": %s}", prompt, pss);
    cr_assert_lt(free_blocks(dec), BLOCKS);
    char *blocks = dump(json_object_get(res, "blocks")), body[1024];
    snprintf(body, sizeof body,
             "{\"request_id\": \"k1\", \"prompt\": \"%s\", \"kv_mode\": \"push\", "
             "\"decode_segments\": %s, \"decode_blocks\": %s, \"decode_ticket\": \"%s\"}",
             prompt, dss, blocks, ticket_of(res));
    cr_assert_eq(http(pre, "/pd/prefill", body, NULL, 500), 0); /* stalled: client times out */
    bg_t b = {.dec = dec};
    snprintf(b.body, sizeof b.body,
             "{\"request_id\": \"k1\", \"t0\": 65, \"max_tokens\": 4, \"kv_mode\": \"push\"}");
    pthread_t th;
    pthread_create(&th, NULL, bg_decode, &b);
    usleep(300000);
    kill_now(pre);
    pthread_join(th, NULL);
    cr_assert_geq(b.status, 500, "decode answered %ld", b.status);
    cr_assert_lt(b.secs, 5.0, "decode took %.1f s to fail", b.secs);
    expect_free(dec, BLOCKS);
    free(blocks), free(pss), free(dss);
    json_decref(res), json_decref(ps), json_decref(ds);
}

Test(server, pull_prefill_killed)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-mla", 0, 2, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-mla", 0, 1, KVB_PD_KV_PULL, NULL);
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds);
    json_t *r = post_json(pre, "/pd/prefill", 200,
                          "{\"request_id\": \"k2\", \"prompt\": \"Hello world\", "
                          "\"decode_segments\": %s}",
                          dss);
    char *blocks = dump(json_object_get(r, "blocks"));
    kill_now(pre); /* before the decode reads */
    bg_t b = {.dec = dec};
    snprintf(b.body, sizeof b.body,
             "{\"request_id\": \"k2\", \"prompt\": \"Hello world\", \"t0\": 65, "
             "\"prefill_blocks\": %s, \"prefill_segments\": %s, \"prefill_ticket\": \"%s\"}",
             blocks, pss, ticket_of(r));
    bg_decode(&b);
    cr_assert_geq(b.status, 500, "decode answered %ld", b.status);
    cr_assert_lt(b.secs, 5.0, "decode took %.1f s to fail", b.secs);
    expect_free(dec, BLOCKS);
    free(blocks), free(pss), free(dss);
    json_decref(r), json_decref(ps), json_decref(ds);
}

/* A decode that dies before reading: the prefill's lease frees the blocks at once. */
Test(server, decode_killed_frees_lease)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    json_t *ds = segments(dec);
    char *dss = dump(ds);
    json_t *r = post_json(pre, "/pd/prefill", 200,
                          "{\"request_id\": \"k3\", \"prompt\": \"Hello world\", "
                          "\"decode_segments\": %s}",
                          dss);
    cr_assert_eq(free_blocks(pre), BLOCKS - 1);
    kill_now(dec); /* the decode dies: the lease ends at once (peer lost) */
    expect_free(pre, BLOCKS);
    free(dss);
    json_decref(r), json_decref(ds);
}

/* ---- misuse: callers without the secret, foreign blocks, unknown segments, API keys --------- */

/* Asserts a refusal: the status and the error object's "reason". */
static void expect_refused(const inst_t *in, const char *path, const char *body, long want,
                           const char *reason)
{
    char *out = NULL;
    long st = http(in, path, body, &out, 10000);
    cr_assert_eq(st, want, "%s -> %ld, want %ld: %s", path, st, want, out);
    json_t *j = json_loads(out, 0, NULL);
    const char *r = json_string_value(json_object_get(json_object_get(j, "error"), "reason"));
    cr_assert(r && !strcmp(r, reason), "%s: reason %s, want %s (%s)", path, r ? r : "none", reason,
              out);
    json_decref(j);
    free(out);
}

/* A cluster secret for the instances started next (they inherit the environment) and for the
 * test's own signer. */
static void use_secret(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvb-secret-%d", (int)getpid());
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    chmod(path, 0600);
    setenv("KVB_SECRET_FILE", path, 1);
}

static kvb__pd_auth_t *auth_now(void)
{
    kvb__pd_auth_t *a = NULL;
    char why[256];
    cr_assert_eq(kvb__pd_auth_create(NULL, &a, why, sizeof why), KVB_OK, "%s", why);
    return a;
}

Test(server, internal_calls_need_the_cluster_secret)
{
    use_secret("the cluster secret of this test\n");
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    char dec_log[64];
    snprintf(dec_log, sizeof dec_log, "/tmp/kvb_pd_server_%d.log", (int)getpid());
    log_file = dec_log;
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    log_file = NULL;
    kvb__pd_auth_t *cluster = auth_now();
    unlink(getenv("KVB_SECRET_FILE"));
    cr_assert_eq(free_blocks(pre), BLOCKS); /* /health stays open */
    expect_refused(pre, "/pd/info", NULL, 401, "unauthenticated");
    expect_refused(dec, "/pd/decode", "{\"request_id\": \"x\"}", 401, "unauthenticated");
    extra_header = KVB_PD_AUTH_HEADER ": v1 1 00000000000000000000000000000000 "
                                      "00000000000000000000000000000000"
                                      "00000000000000000000000000000000";
    expect_refused(pre, "/pd/info", NULL, 401, "bad_signature");
    extra_header = NULL;

    signer = cluster; /* the whole pull path works */
    json_t *a = pd_pull(pre, dec, "s1", "Hello world");
    check_tokens(a, "tiny-gqa", "Hello world");
    json_decref(a);

    /* A call seen once is not accepted again, however valid its signature. */
    static char line[KVB_PD_AUTH_LINE_MAX];
    cr_assert_eq(kvb__pd_auth_sign(signer, "GET", "/pd/info", NULL, 0, line), KVB_OK);
    signer = NULL;
    extra_header = line;
    json_decref(get_json(pre, "/pd/info"));
    expect_refused(pre, "/pd/info", NULL, 401, "replayed");

    /* Signed for one body, sent with another (blocks of someone else's request, say). */
    const char *signed_body = "{\"request_id\": \"s2\", \"prompt\": \"x\", \"decode_segments\": "
                              "[\"127.0.0.1:1\"]}";
    cr_assert_eq(
        kvb__pd_auth_sign(cluster, "POST", "/pd/prefill", signed_body, strlen(signed_body), line),
        KVB_OK);
    expect_refused(pre, "/pd/prefill",
                   "{\"request_id\": \"s2\", \"prompt\": \"y\", \"decode_segments\": "
                   "[\"127.0.0.1:1\"]}",
                   401, "bad_signature");

    /* Another secret is no secret at all. */
    use_secret("somebody else's secret, as long\n");
    signer = auth_now();
    unlink(getenv("KVB_SECRET_FILE"));
    extra_header = NULL;
    expect_refused(pre, "/pd/info", NULL, 401, "bad_signature");
    kvb__pd_auth_free(cluster);
    cr_assert_eq(free_blocks(pre), BLOCKS);
    cr_assert_eq(free_blocks(dec), BLOCKS);

    /* A flood is refused call by call but logged a line a second at most; the next line after a
     * quiet second says how many went unlogged. */
    kvb__pd_auth_free(signer);
    signer = NULL;
    for (int i = 0; i < 40; i++)
        expect_refused(dec, "/pd/info", NULL, 401, "unauthenticated");
    usleep(1100 * 1000);
    expect_refused(dec, "/pd/info", NULL, 401, "unauthenticated");
    FILE *f = fopen(dec_log, "r");
    cr_assert_not_null(f);
    int lines = 0, summed = 0;
    while (fgets(line, sizeof line, f)) {
        lines += strstr(line, "warn: refused ") != NULL;
        summed += strstr(line, "more refused calls since the last such line") != NULL;
    }
    fclose(f);
    unlink(dec_log);
    cr_expect(lines >= 2 && lines <= 8, "%d log lines for 42 refused calls", lines);
    cr_expect(summed >= 1, "no line counts the calls that were not logged");
}

/* The prefill's answer: its lease's blocks (as JSON text) and ticket. */
static json_t *prefill_lease(const inst_t *pre, const char *id, const char *dss)
{
    return post_json(
        pre, "/pd/prefill", 200,
        "{\"request_id\": \"%s\", \"prompt\": \"Hello world\", \"decode_segments\": %s}", id, dss);
}

static void decode_refused(const inst_t *dec, const char *id, const char *blocks, const char *pss,
                           const char *ticket, const char *reason)
{
    char body[2048];
    snprintf(body, sizeof body,
             "{\"request_id\": \"%s\", \"prompt\": \"Hello world\", \"t0\": 65, "
             "\"prefill_blocks\": %s, \"prefill_segments\": %s%s%s%s}",
             id, blocks, pss, ticket ? ", \"prefill_ticket\": \"" : "", ticket ? ticket : "",
             ticket ? "\"" : "");
    expect_refused(dec, "/pd/decode", body, 403, reason);
}

Test(server, foreign_block_ids_pull)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds);
    json_t *r1 = prefill_lease(pre, "f1", dss), *r2 = prefill_lease(pre, "f2", dss);
    char *b1 = dump(json_object_get(r1, "blocks")), *b2 = dump(json_object_get(r2, "blocks"));
    cr_assert_str_neq(b1, b2);
    decode_refused(dec, "f1", b2, pss, ticket_of(r1), "foreign_blocks"); /* f2's blocks */
    decode_refused(dec, "f1", b2, pss, ticket_of(r2), "foreign_blocks"); /* f2's whole grant */
    decode_refused(dec, "f1", b1, pss, NULL, "missing_ticket");
    decode_refused(dec, "f1", b1, "[\"127.0.0.1:9\"]", ticket_of(r1), "foreign_blocks");
    decode_refused(dec, "f1", "[0, 1, 2, 3]", pss, ticket_of(r1), "foreign_blocks");
    /* Nothing changed: the decode holds nothing, the prefill both leases, and f1 still works. */
    cr_assert_eq(free_blocks(dec), BLOCKS);
    cr_assert_eq(free_blocks(pre), BLOCKS - 2);
    json_t *a = post_json(dec, "/pd/decode", 200,
                          "{\"request_id\": \"f1\", \"prompt\": \"Hello world\", \"t0\": %lld, "
                          "\"prefill_blocks\": %s, \"prefill_segments\": %s, \"max_tokens\": %d, "
                          "\"prefill_ticket\": \"%s\"}",
                          (long long)json_integer_value(json_object_get(r1, "t0")), b1, pss,
                          MAX_TOKENS, ticket_of(r1));
    check_tokens(a, "tiny-gqa", "Hello world");
    expect_free(pre, BLOCKS - 1); /* f2's lease only */
    json_decref(a), json_decref(r1), json_decref(r2), json_decref(ps), json_decref(ds);
    free(b1), free(b2), free(pss), free(dss);
}

/* Reserves every block of decode `dec` for `timeout_ms` (request "hog"): what needs a block there
 * next waits in its admission queue until the reservation expires. */
static json_t *reserve_every_block(const inst_t *dec, const char *pss, int timeout_ms)
{
    json_t *info = get_json(dec, "/pd/info");
    long tpb = (long)json_integer_value(json_object_get(info, "tokens_per_block"));
    json_decref(info);
    cr_assert_gt(tpb, 0);
    json_t *hog = post_json(dec, "/pd/reserve", 200,
                            "{\"request_id\": \"hog\", \"prompt\": \"x\", \"prefill_segments\": "
                            "%s, \"max_tokens\": %ld, \"timeout_ms\": %d}",
                            pss, BLOCKS * tpb - 1, timeout_ms); /* BOS, 'x', every other position */
    cr_assert_eq(free_blocks(dec), 0);
    return hog;
}

/* The /pd/decode body (pull) of request `id` for prefill answer `r`, with its ticket. */
static void pull_decode_body(char *body, size_t cap, const char *id, json_t *r, const char *pss,
                             int timeout_ms)
{
    char *blocks = dump(json_object_get(r, "blocks"));
    snprintf(body, cap,
             "{\"request_id\": \"%s\", \"prompt\": \"Hello world\", \"t0\": %lld, "
             "\"prefill_blocks\": %s, \"prefill_segments\": %s, \"max_tokens\": %d, "
             "\"prefill_ticket\": \"%s\", \"timeout_ms\": %d}",
             id, (long long)json_integer_value(json_object_get(r, "t0")), blocks, pss, MAX_TOKENS,
             ticket_of(r), timeout_ms);
    free(blocks);
}

/* A decode that waits for its blocks longer than the prefill's lease must not read the leased
 * blocks after all: the prefill freed them when the lease ended and may have handed them on. A
 * reservation that takes every decode block for 4 s holds the request back past the 3 s lease. */
Test(server, lease_ended_while_waiting_is_not_read)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds), body[2048];
    json_t *r = prefill_lease(pre, "w1", dss); /* a 3 s lease (start) */
    json_t *hog = reserve_every_block(dec, pss, 4000);
    pull_decode_body(body, sizeof body, "w1", r, pss, 9000);
    expect_refused(dec, "/pd/decode", body, 503, "lease_expired");
    expect_free(dec, BLOCKS);
    expect_free(pre, BLOCKS);
    free(pss), free(dss);
    json_decref(hog), json_decref(r), json_decref(ps), json_decref(ds);
}

/* A pull pair of tiny-gqa instances (TP 1): a prefill whose leases last `prefill_lease_ms`, and a
 * decode with the usual options. */
static void pull_pair(uint32_t prefill_lease_ms, inst_t **pre, inst_t **dec)
{
    uint32_t usual = lease_ms;
    lease_ms = prefill_lease_ms;
    *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    lease_ms = usual;
    *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
}

/* Stops or continues instance `in` and waits until it has. */
static void signal_inst(const inst_t *in, int sig)
{
    cr_assert_eq(kill(in->pid, sig), 0);
    int st;
    pid_t r = waitpid(in->pid, &st, sig == SIGSTOP ? WUNTRACED : WCONTINUED);
    cr_assert_eq(r, in->pid);
    cr_assert(sig == SIGSTOP ? WIFSTOPPED(st) : WIFCONTINUED(st));
}

static long health_count(const inst_t *in, const char *key)
{
    json_t *h = get_json(in, "/health");
    long n = (long)json_integer_value(json_object_get(h, key));
    json_decref(h);
    return n;
}

/* A prefill that stalls while a decode reads from it: the read times out and the request fails,
 * but the stalled prefill still owes its answer, and until it answers (or its connection is lost)
 * the decode cannot know that no copy of it will land in the request's blocks. They stay out of
 * use - "settling" in /health - until then, rather than going to the next request, whose KV a
 * late copy would overwrite. The engine's part (a same-host peer that resumes past a request's
 * deadline copies nothing) is tested in shm_peer. */
Test(server, blocks_of_a_stalled_read_stay_out_of_use_until_settled)
{
    inst_t *pre, *dec;
    pull_pair(1000, &pre, &dec); /* the decode reads for at most 500 ms of the lease */
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds), body[2048];
    /* A first request links the two. */
    json_t *r = prefill_lease(pre, "s0", dss);
    pull_decode_body(body, sizeof body, "s0", r, pss, 9000);
    json_t *a = post_json(dec, "/pd/decode", 200, "%s", body);
    json_decref(a), json_decref(r);
    expect_free(dec, BLOCKS);

    r = prefill_lease(pre, "s1", dss);
    pull_decode_body(body, sizeof body, "s1", r, pss, 9000);
    signal_inst(pre, SIGSTOP);
    char *out = NULL;
    uint64_t t0 = kvb__now_ns();
    long st = http(dec, "/pd/decode", body, &out, 10000);
    double secs = (double)(kvb__now_ns() - t0) / 1e9;
    cr_assert_eq(st, 504, "decode answered %ld after %.1f s: %s", st, secs, out);
    free(out);
    cr_assert_eq(health_count(dec, "settling"), 1);
    cr_assert_lt(free_blocks(dec), BLOCKS, "blocks a late copy may reach went back to the pool");
    signal_inst(pre, SIGCONT); /* it answers: past the deadline, it copies nothing */
    expect_free(dec, BLOCKS);
    cr_assert_eq(health_count(dec, "settling"), 0);

    /* The link is whole: the next pull is served. */
    json_decref(r);
    r = prefill_lease(pre, "s2", dss);
    pull_decode_body(body, sizeof body, "s2", r, pss, 9000);
    a = post_json(dec, "/pd/decode", 200, "%s", body);
    check_tokens(a, "tiny-gqa", "Hello world");
    json_decref(a), json_decref(r), json_decref(ps), json_decref(ds);
    free(pss), free(dss);
}

/* A decode that turns a pull request away before reading (here: no blocks free before the
 * request's deadline) tells the prefill, which frees the leased prompt at once rather than at the
 * end of its lease (20 s here) - a refusing decode would otherwise drain the prefill's pool too. */
Test(server, refused_decode_gives_the_lease_back)
{
    inst_t *pre, *dec;
    pull_pair(20000, &pre, &dec);
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds), body[2048];
    json_t *r = prefill_lease(pre, "g1", dss);
    cr_assert_eq(free_blocks(pre), BLOCKS - 1);
    json_t *hog = reserve_every_block(dec, pss, 5000);
    pull_decode_body(body, sizeof body, "g1", r, pss, 500);
    expect_refused(dec, "/pd/decode", body, 503, "deadline");
    expect_free(pre, BLOCKS); /* within 3 s: long before the lease would end */
    free(pss), free(dss);
    json_decref(hog), json_decref(r), json_decref(ps), json_decref(ds);
}

/* A reservation that had to wait for its blocks lasts until the request's deadline, counted from
 * when the request came: it used to last one more whole timeout from when the blocks were free,
 * held for a proxy that may long have given up. */
Test(server, reservation_ends_at_the_request_deadline)
{
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    json_t *ps = segments(pre);
    char *pss = dump(ps);
    json_t *hog = reserve_every_block(dec, pss, 3000);
    uint64_t sent = kvb__pd_unix_ms();
    json_t *res = post_json(dec, "/pd/reserve", 200,
                            "{\"request_id\": \"late\", \"prompt\": \"Hello world\", "
                            "\"prefill_segments\": %s, \"timeout_ms\": 6000}",
                            pss); /* admitted once the hog's reservation ends, about 3 s on */
    uint64_t answered = kvb__pd_unix_ms();
    cr_assert_geq(answered - sent, 2000, "it did not wait for its blocks");
    const char *t = ticket_of(res);
    cr_assert(!strncmp(t, "v1.", 3), "%s", t);
    uint64_t expires = strtoull(t + 3, NULL, 10);
    /* Slack for a loaded machine (the deadline counts from when the server took the request);
     * the old lifetime overshot by the 3 s wait. */
    cr_assert_leq(expires, sent + 6000 + 1000, "the reservation ends %lld ms after the deadline",
                  (long long)(expires - sent - 6000));
    free(pss);
    json_decref(res), json_decref(hog), json_decref(ps);
}

/* The same for push: a prefill that waits for its blocks longer than the decode's reservation
 * must not write into the reserved blocks after all (the decode freed them when the reservation
 * ended). A pull lease of every prefill block for 3 s holds it back past a 2 s reservation (a
 * prefill of 4 blocks: its hog prompt stays short, which matters under AddressSanitizer). */
Test(server, reservation_ended_while_waiting_is_not_written)
{
    pool_blocks = 4;
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    pool_blocks = BLOCKS;
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    json_t *ps = segments(pre), *ds = segments(dec), *info = get_json(pre, "/pd/info");
    char *pss = dump(ps), *dss = dump(ds);
    long tpb = (long)json_integer_value(json_object_get(info, "tokens_per_block"));
    cr_assert_gt(tpb, 0);
    char hog_prompt[256];
    cr_assert_lt(4 * tpb, (long)sizeof hog_prompt);
    memset(hog_prompt, 'a', (size_t)(4 * tpb - 1)); /* with BOS: every prefill block */
    hog_prompt[4 * tpb - 1] = '\0';
    json_t *hog = post_json(pre, "/pd/prefill", 200,
                            "{\"request_id\": \"hog\", \"prompt\": \"%s\", \"kv_mode\": "
                            "\"pull\", \"decode_segments\": %s}",
                            hog_prompt, dss);
    cr_assert_eq(free_blocks(pre), 0);
    json_t *res = post_json(dec, "/pd/reserve", 200,
                            "{\"request_id\": \"w2\", \"prompt\": \"Hello world\", "
                            "\"prefill_segments\": %s, \"timeout_ms\": 2000}",
                            pss);
    char *blocks = dump(json_object_get(res, "blocks")), body[2048];
    snprintf(body, sizeof body,
             "{\"request_id\": \"w2\", \"prompt\": \"Hello world\", \"kv_mode\": \"push\", "
             "\"decode_segments\": %s, \"decode_blocks\": %s, \"decode_ticket\": \"%s\", "
             "\"timeout_ms\": 9000}",
             dss, blocks, ticket_of(res));
    expect_refused(pre, "/pd/prefill", body, 503, "reservation_expired");
    expect_free(dec, BLOCKS);
    expect_free(pre, 4);
    free(blocks), free(pss), free(dss);
    json_decref(hog), json_decref(res), json_decref(info), json_decref(ps), json_decref(ds);
}

Test(server, foreign_block_ids_push)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    json_t *ps = segments(pre), *ds = segments(dec);
    char *pss = dump(ps), *dss = dump(ds);
    const char *prompt = "a prompt that is longer than two blocks of sixteen";
    json_t *res = post_json(dec, "/pd/reserve", 200,
                            "{\"request_id\": \"g1\", \"prompt\": \"%s\", \"max_tokens\": %d, "
                            "\"prefill_segments\": %s}",
                            prompt, MAX_TOKENS, pss);
    json_t *blocks = json_object_get(res, "blocks");
    cr_assert_eq(json_array_size(blocks), 4);
    char *good = dump(blocks), bad[128], body[2048];
    /* The same count, one id another request could hold. */
    snprintf(bad, sizeof bad, "[%lld, %lld, %lld, %lld]",
             (long long)json_integer_value(json_array_get(blocks, 0)),
             (long long)json_integer_value(json_array_get(blocks, 1)),
             (long long)json_integer_value(json_array_get(blocks, 2)),
             (long long)json_integer_value(json_array_get(blocks, 3)) + 1);
    long held = free_blocks(dec);
    const char *fmt = "{\"request_id\": \"%s\", \"prompt\": \"%s\", \"kv_mode\": \"push\", "
                      "\"decode_segments\": %s, \"decode_blocks\": %s%s%s%s}";
    snprintf(body, sizeof body, fmt, "g1", prompt, dss, bad, ", \"decode_ticket\": \"",
             ticket_of(res), "\"");
    expect_refused(pre, "/pd/prefill", body, 403, "foreign_blocks");
    snprintf(body, sizeof body, fmt, "g1", prompt, dss, good, "", "", "");
    expect_refused(pre, "/pd/prefill", body, 403, "missing_ticket");
    snprintf(body, sizeof body, fmt, "g2", prompt, dss, good, ", \"decode_ticket\": \"",
             ticket_of(res), "\"");
    expect_refused(pre, "/pd/prefill", body, 403, "foreign_blocks"); /* another request's id */
    cr_assert_eq(free_blocks(pre), BLOCKS);
    cr_assert_eq(free_blocks(dec), held); /* the reservation stands */
    json_decref(post_json(pre, "/pd/prefill", 200, fmt, "g1", prompt, dss, good,
                          ", \"decode_ticket\": \"", ticket_of(res), "\""));
    json_decref(res), json_decref(ps), json_decref(ds);
    free(good), free(pss), free(dss);
}

Test(server, unknown_segments)
{
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    inst_t *dec = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PUSH, NULL);
    use_secret("the secret of another cluster\n"); /* an engine that is no member of ours */
    inst_t *other = start(KVB_PD_ROLE_DECODE, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    signer = auth_now(); /* the other cluster's, to learn its segment */
    json_t *os = segments(other);
    char *oss = dump(os), body[512];
    kvb__pd_auth_free(signer);
    signer = NULL;
    unlink(getenv("KVB_SECRET_FILE"));
    unsetenv("KVB_SECRET_FILE");
    snprintf(body, sizeof body,
             "{\"request_id\": \"u1\", \"prompt\": \"x\", \"decode_segments\": %s}", oss);
    expect_refused(pre, "/pd/prefill", body, 400, "unknown_segment");
    snprintf(body, sizeof body,
             "{\"request_id\": \"u4\", \"prompt\": \"x\", \"prefill_segments\": %s}", oss);
    expect_refused(dec, "/pd/reserve", body, 400, "unknown_segment");
    json_decref(os);
    free(oss);
    expect_refused(pre, "/pd/prefill",
                   "{\"request_id\": \"u2\", \"prompt\": \"x\", \"decode_segments\": "
                   "[\"no-such-host.invalid:7000\"]}",
                   400, "unknown_segment");
    expect_refused(dec, "/pd/reserve",
                   "{\"request_id\": \"u3\", \"prompt\": \"x\", \"prefill_segments\": "
                   "[\"no-such-host.invalid:7000\"]}",
                   400, "unknown_segment");
    /* Nothing was kept: no blocks held, no link listed, the ids free to use. */
    cr_assert_eq(free_blocks(pre), BLOCKS);
    cr_assert_eq(free_blocks(dec), BLOCKS);
    json_t *h = get_json(pre, "/health");
    cr_assert_eq(json_array_size(json_object_get(h, "links")), 0, "links: %s",
                 json_dumps(json_object_get(h, "links"), 0));
    json_decref(h);
    json_t *ds = segments(dec);
    char *dss = dump(ds);
    json_decref(prefill_lease(pre, "u1", dss));
    json_decref(ds);
    free(dss);
}

Test(server, api_keys_guard_completions)
{
    static char keys[64];
    snprintf(keys, sizeof keys, "/tmp/kvb-keys-%d", (int)getpid());
    FILE *f = fopen(keys, "w");
    cr_assert_not_null(f);
    fputs("# test keys\nsk-test-one\nsk-test-two\n", f);
    fclose(f);
    api_key_file = keys;
    inst_t *both = start(KVB_PD_ROLE_BOTH, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    unlink(keys);
    const char *body = "{\"prompt\": \"Hello world\", \"max_tokens\": 8}";
    expect_refused(both, "/v1/completions", body, 401, "invalid_api_key");
    extra_header = "Authorization: Bearer sk-test-three";
    expect_refused(both, "/v1/completions", body, 401, "invalid_api_key");
    extra_header = "Authorization: Bearer sk-test-two";
    json_t *a = post_json(both, "/v1/completions", 200, "%s", body);
    check_tokens(a, "tiny-gqa", "Hello world");
    json_decref(a);
    extra_header = NULL;
    cr_assert_eq(free_blocks(both), BLOCKS); /* /health needs no key */
}

/* A client that sends half a request and stalls holds one connection thread until the idle
 * timeout, and nobody else waits for it. */
Test(server, slow_client_is_cut_off)
{
    idle_timeout_s = 2;
    inst_t *pre = start(KVB_PD_ROLE_PREFILL, "tiny-gqa", 0, 1, KVB_PD_KV_PULL, NULL);
    int fds[8];
    for (int i = 0; i < 8; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(pre->port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        cr_assert_eq(connect(fds[i], (struct sockaddr *)&a, sizeof a), 0);
        const char *half = i % 2 ? "POST /pd/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n"
                                   "\r\n{\"request_id\": "
                                 : "GET /pd/in";
        cr_assert_eq(send(fds[i], half, strlen(half), 0), (ssize_t)strlen(half));
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    cr_assert_eq(free_blocks(pre), BLOCKS); /* served while the stalled ones wait */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    cr_assert_lt(t1.tv_sec - t0.tv_sec, 2);
    for (int i = 0; i < 8; i++) {
        struct pollfd p = {.fd = fds[i], .events = POLLIN};
        cr_assert_eq(poll(&p, 1, 6000), 1, "connection %d still open after 6 s", i);
        char c;
        cr_assert_leq(recv(fds[i], &c, 1, 0), 0, "connection %d: no close but data", i);
        close(fds[i]);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    cr_assert_lt(t1.tv_sec - t0.tv_sec, 6);
    cr_assert_eq(free_blocks(pre), BLOCKS);
}
