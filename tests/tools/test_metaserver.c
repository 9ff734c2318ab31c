/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for `kvbridge metadata-server` (src/tools/metaserver.c): start the built command (KVB_BIN)
 * on a free port and speak its HTTP protocol with libcurl - round trips, TTL expiry, renewals,
 * listing by prefix, --prefix routing, bad input, body limits, a full store, many clients - then
 * SIGTERM it and check that it exits 0. Bad command lines exit 2; a port in use exits 1. */
#include <criterion/criterion.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "helpers/cli.h"

#define MIB (1u << 20)

static pid_t srv_pid;
static unsigned srv_port;
static char root[64]; /* http://127.0.0.1:PORT */
static const char *pfx = "";

/* ---- The server process ---------------------------------------------------------------------- */

static const char *bin(void)
{
    const char *b = getenv("KVB_BIN");
    if (!b || !*b)
        cr_skip_test("KVB_BIN is not set (run through ctest)");
    return b;
}

/* Reads the first line of fd, giving up after 10 s without news (the ready line is the first
 * thing the command prints, right after it starts listening). */
static void read_line(int fd, char *line, size_t cap)
{
    size_t n = 0;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    line[0] = '\0';
    while (n < cap - 1 && !strchr(line, '\n') && poll(&pf, 1, 10000) == 1) {
        ssize_t k = read(fd, line + n, cap - 1 - n);
        if (k <= 0)
            break;
        n += (size_t)k;
        line[n] = '\0';
    }
}

/* Starts `kvbridge metadata-server --port 0 [--prefix prefix]` (max_keys: the test hook that
 * shrinks the store, or NULL) and waits for its ready line. The child dies with the test process
 * (PDEATHSIG), so a test that times out leaves nothing behind. */
static void start_server(const char *prefix, const char *max_keys)
{
    const char *b = bin();
    int po[2];
    cr_assert_eq(pipe(po), 0);
    pid_t parent = getpid();
    srv_pid = fork();
    cr_assert_geq(srv_pid, 0);
    if (srv_pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        if (max_keys)
            setenv("KVB_METASERVER_MAX_KEYS", max_keys, 1);
        dup2(po[1], 1);
        close(po[0]);
        if (prefix)
            execl(b, b, "metadata-server", "--port", "0", "--prefix", prefix, NULL);
        else
            execl(b, b, "metadata-server", "--port", "0", NULL);
        _exit(127);
    }
    close(po[1]);
    char line[256], want[128];
    read_line(po[0], line, sizeof line);
    close(po[0]);
    pfx = prefix ? prefix : "";
    cr_assert_eq(sscanf(line, "metadata server on http://127.0.0.1:%u", &srv_port), 1,
                 "ready line: '%s'", line);
    snprintf(want, sizeof want, "metadata server on http://127.0.0.1:%u%s\n", srv_port, pfx);
    cr_assert_str_eq(line, want);
    snprintf(root, sizeof root, "http://127.0.0.1:%u", srv_port);
}

/* SIGTERM, then SIGKILL after 5 s; returns the exit status (-1: it did not exit by itself). */
static int stop_server(void)
{
    if (srv_pid <= 0)
        return -1;
    int st = 0, rc = -1;
    kill(srv_pid, SIGTERM);
    for (int i = 0; i < 500; i++) {
        pid_t r = waitpid(srv_pid, &st, WNOHANG);
        if (r == srv_pid) {
            rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
            goto reaped;
        }
        if (r < 0 && errno == ECHILD)
            goto reaped;
        usleep(10000);
    }
    kill(srv_pid, SIGKILL);
    waitpid(srv_pid, NULL, 0);
reaped:
    srv_pid = 0;
    return rc;
}

static void setup(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

static void teardown(void)
{
    stop_server();
    curl_global_cleanup();
}

TestSuite(metaserver, .init = setup, .fini = teardown, .timeout = 60);

/* ---- HTTP ------------------------------------------------------------------------------------ */

typedef struct {
    long status;
    char *body; /* NUL-terminated */
    size_t len, cap;
    char ctype[64];
    char allow[64];
    json_t *json; /* the body parsed, when it is JSON */
} resp_t;

static void resp_free(resp_t *r)
{
    free(r->body);
    json_decref(r->json);
    memset(r, 0, sizeof *r);
}

/* The buffer grows by doubling. Growing it by each piece (curl hands over 16 KiB at a time) made
 * reading a 16 MiB value quadratic: a thousand reallocs that each copy the whole body - which
 * under AddressSanitizer, whose realloc always moves and maps fresh pages, took 30 s and more. */
static size_t on_data(char *p, size_t sz, size_t n, void *u)
{
    resp_t *r = u;
    size_t k = sz * n;
    if (r->len + k + 1 > r->cap) {
        size_t ncap = r->cap ? r->cap : 4096;
        while (ncap < r->len + k + 1)
            ncap *= 2;
        char *nb = realloc(r->body, ncap);
        if (!nb)
            return 0;
        r->body = nb;
        r->cap = ncap;
    }
    memcpy(r->body + r->len, p, k);
    r->len += k;
    r->body[r->len] = '\0';
    return k;
}

static size_t on_header(char *p, size_t sz, size_t n, void *u)
{
    resp_t *r = u;
    if (sz * n > 6 && !strncasecmp(p, "Allow:", 6))
        snprintf(r->allow, sizeof r->allow, "%.*s", (int)(sz * n - 8), p + 7); /* no CRLF */
    return sz * n;
}

/* A chunked upload of `left` bytes of 'x' (no Content-Length). */
static size_t on_read(char *p, size_t sz, size_t n, void *u)
{
    size_t *left = u, k = sz * n < *left ? sz * n : *left;
    memset(p, 'x', k);
    *left -= k;
    return k;
}

typedef struct {
    const char *method;
    const void *body; /* sent with Content-Length (len bytes) unless chunked */
    size_t len;
    size_t chunked; /* > 0: send this many bytes chunked instead */
    bool expect;    /* add "Expect: 100-continue" */
} req_opts_t;

/* `o->method` root + path on a curl handle of its own (so also from other threads); fills *r
 * (free with resp_free) and returns curl's result without asserting anything. */
static CURLcode http_try(const char *path, const req_opts_t *o, resp_t *r)
{
    char url[8192];
    snprintf(url, sizeof url, "%s%s", root, path);
    memset(r, 0, sizeof *r);
    CURL *c = curl_easy_init();
    if (!c)
        return CURLE_OUT_OF_MEMORY;
    struct curl_slist *hdrs = NULL;
    size_t left = o->chunked;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 30000L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, o->method);
    if (!strcmp(o->method, "HEAD"))
        curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    if (o->chunked) {
        curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(c, CURLOPT_READFUNCTION, on_read);
        curl_easy_setopt(c, CURLOPT_READDATA, &left);
    } else if (o->body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, o->body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)o->len);
    }
    hdrs = curl_slist_append(hdrs, o->expect ? "Expect: 100-continue" : "Expect:");
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
    CURLcode rc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    char *ct = NULL;
    curl_easy_getinfo(c, CURLINFO_CONTENT_TYPE, &ct);
    snprintf(r->ctype, sizeof r->ctype, "%s", ct ? ct : "");
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(c);
    if (r->body && !strcmp(r->ctype, "application/json"))
        r->json = json_loadb(r->body, r->len, 0, NULL);
    return rc;
}

/* http_try, asserting that an answer came. */
static void http(const char *path, const req_opts_t *o, resp_t *r)
{
    CURLcode rc = http_try(path, o, r);
    cr_assert_eq(rc, CURLE_OK, "%s %.200s: %s", o->method, path, curl_easy_strerror(rc));
}

/* Percent-escapes every byte outside [A-Za-z0-9._~-], as the HTTP metadata client does. */
static void escape(const char *key, size_t n, char *out, size_t cap)
{
    static const char safe[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._~-";
    size_t w = 0;
    for (size_t i = 0; i < n && w + 4 < cap; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c && strchr(safe, c))
            out[w++] = (char)c;
        else
            w += (size_t)snprintf(out + w, cap - w, "%%%02X", c);
    }
    out[w] = '\0';
}

static void kv_path(const char *key, char *path, size_t cap)
{
    char esc[4096];
    escape(key, strlen(key), esc, sizeof esc);
    snprintf(path, cap, "%s/v1/kv/%s", pfx, esc);
}

static long put_ttl(const char *key, const char *val, size_t len, const char *ttl)
{
    char path[8192];
    kv_path(key, path, sizeof path);
    if (ttl)
        snprintf(path + strlen(path), sizeof path - strlen(path), "?ttl_ms=%s", ttl);
    resp_t r;
    http(path, &(req_opts_t){.method = "PUT", .body = val, .len = len}, &r);
    cr_expect(r.status != 204 || r.len == 0, "204 with a body: %s", r.body);
    long st = r.status;
    resp_free(&r);
    return st;
}

static long put(const char *key, const char *val)
{
    return put_ttl(key, val, strlen(val), NULL);
}

/* GET of a key: the status; on 200 the value goes into *r as well. */
static long get(const char *key, resp_t *r)
{
    char path[8192];
    kv_path(key, path, sizeof path);
    http(path, &(req_opts_t){.method = "GET"}, r);
    return r->status;
}

static long del(const char *key)
{
    char path[8192];
    resp_t r;
    kv_path(key, path, sizeof path);
    http(path, &(req_opts_t){.method = "DELETE"}, &r);
    long st = r.status;
    resp_free(&r);
    return st;
}

/* Checks that r is `status` with a JSON {"error": "<non-empty message>"}. */
static void expect_error(const resp_t *r, long status, const char *what)
{
    cr_expect_eq(r->status, status, "%s: status %ld, want %ld (%s)", what, r->status, status,
                 r->body ? r->body : "");
    cr_expect_str_eq(r->ctype, "application/json", "%s", what);
    json_t *e = json_object_get(r->json, "error");
    cr_expect(json_is_string(e) && json_string_length(e) > 0, "%s: body %s", what,
              r->body ? r->body : "(none)");
    cr_expect_eq(json_object_size(r->json), 1, "%s: body %s", what, r->body ? r->body : "");
}

static void expect_path_error(const char *method, const char *path, long status)
{
    resp_t r;
    http(path, &(req_opts_t){.method = method, .body = "v", .len = 1}, &r);
    char what[256];
    snprintf(what, sizeof what, "%s %.200s", method, path);
    expect_error(&r, status, what);
    resp_free(&r);
}

/* GET /health: the number of keys (asserting the answer's shape). */
static long health_keys(void)
{
    char path[128];
    resp_t r;
    snprintf(path, sizeof path, "%s/health", pfx);
    http(path, &(req_opts_t){.method = "GET"}, &r);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cr_assert_str_eq(json_string_value(json_object_get(r.json, "status")), "ok");
    json_t *k = json_object_get(r.json, "keys");
    cr_assert(json_is_integer(k), "%s", r.body);
    long n = (long)json_integer_value(k);
    resp_free(&r);
    return n;
}

/* GET /v1/list[?prefix=escaped]: the items array (a new reference). */
static json_t *list(const char *prefix)
{
    char path[4096], esc[2048];
    if (prefix) {
        escape(prefix, strlen(prefix), esc, sizeof esc);
        snprintf(path, sizeof path, "%s/v1/list?prefix=%s", pfx, esc);
    } else {
        snprintf(path, sizeof path, "%s/v1/list", pfx);
    }
    resp_t r;
    http(path, &(req_opts_t){.method = "GET"}, &r);
    cr_assert_eq(r.status, 200, "%s", r.body);
    json_t *items = json_incref(json_object_get(r.json, "items"));
    cr_assert(json_is_array(items), "%s", r.body);
    resp_free(&r);
    return items;
}

/* Checks that items hold exactly keys[] in that order, each with value "v:<key>". */
static void expect_keys(json_t *items, const char *const *keys)
{
    size_t n = 0;
    for (; keys[n]; n++) {
        json_t *it = json_array_get(items, n);
        char want[256];
        snprintf(want, sizeof want, "v:%s", keys[n]);
        cr_expect_str_eq(json_string_value(json_object_get(it, "key")), keys[n], "item %zu", n);
        cr_expect_str_eq(json_string_value(json_object_get(it, "value")), want, "item %zu", n);
        cr_expect_eq(json_integer_value(json_object_get(it, "ttl_ms")), 0, "item %zu", n);
    }
    cr_expect_eq(json_array_size(items), n);
    json_decref(items);
}

/* The end of every test that started a server: it must still answer, then stop cleanly. */
static void finish(void)
{
    health_keys();
    cr_expect_eq(stop_server(), 0, "the server exits 0 on SIGTERM");
}

/* ---- Tests ----------------------------------------------------------------------------------- */

Test(metaserver, put_get_delete_round_trip, .timeout = 60)
{
    start_server(NULL, NULL);
    const char *key = "kvbridge/default/segment/node-1:rank/0";
    const char *v1 = "{\"name\":\"node-1\",\"addr\":\"127.0.0.1:9000\",\"regions\":[1,2,3]}";
    const char *v2 = "{\"name\":\"node-1\",\"addr\":\"127.0.0.1:9001\"}";
    cr_assert_eq(put(key, v1), 204);
    resp_t r;
    cr_assert_eq(get(key, &r), 200, "%s", r.body);
    cr_expect_eq(r.len, strlen(v1));
    cr_expect_str_eq(r.body, v1);
    cr_expect_str_eq(r.ctype, "application/octet-stream");
    resp_free(&r);
    /* HEAD answers like GET, without the body. */
    char path[8192];
    kv_path(key, path, sizeof path);
    http(path, &(req_opts_t){.method = "HEAD"}, &r);
    cr_expect_eq(r.status, 200);
    resp_free(&r);
    cr_assert_eq(put(key, v2), 204, "a PUT replaces the value");
    cr_assert_eq(get(key, &r), 200);
    cr_expect_str_eq(r.body, v2);
    resp_free(&r);
    /* An empty value and one with a NUL byte are values like any other. */
    cr_assert_eq(put_ttl("empty", "", 0, NULL), 204);
    cr_assert_eq(get("empty", &r), 200);
    cr_expect_eq(r.len, 0);
    resp_free(&r);
    cr_assert_eq(put_ttl("nul", "a\0b", 3, NULL), 204);
    cr_assert_eq(get("nul", &r), 200);
    cr_expect(r.len == 3 && !memcmp(r.body, "a\0b", 3));
    resp_free(&r);
    cr_expect_eq(health_keys(), 3);
    cr_assert_eq(del(key), 204);
    get(key, &r);
    expect_error(&r, 404, "GET after DELETE");
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "error")), "not found");
    resp_free(&r);
    kv_path(key, path, sizeof path);
    http(path, &(req_opts_t){.method = "DELETE"}, &r);
    expect_error(&r, 404, "DELETE of a deleted key");
    resp_free(&r);
    cr_expect_eq(health_keys(), 2);
    finish();
}

Test(metaserver, unknown_paths_are_404, .timeout = 60)
{
    start_server(NULL, NULL);
    expect_path_error("GET", "/", 404);
    expect_path_error("GET", "/nope", 404);
    expect_path_error("GET", "/v1/kv", 404);
    expect_path_error("GET", "/v1/kvx/a", 404);
    expect_path_error("GET", "/v1/list/more", 404);
    expect_path_error("GET", "/health/", 404);
    expect_path_error("PUT", "/v2/kv/a", 404);
    resp_t r;
    get("never-stored", &r);
    expect_error(&r, 404, "GET of a missing key");
    resp_free(&r);
    finish();
}

static uint64_t now_ms(void)
{
    return kvb__now_ns() / 1000000;
}

Test(metaserver, ttl_expiry, .timeout = 60)
{
    start_server(NULL, NULL);
    resp_t r;
    uint64_t t0 = now_ms();
    cr_assert_eq(put_ttl("t/short", "v", 1, "300"), 204);
    cr_expect_eq(get("t/short", &r), 200, "visible at once");
    resp_free(&r);
    cr_assert_eq(put_ttl("t/zero", "v", 1, "0"), 204); /* 0: never expires */
    cr_assert_eq(put("t/forever", "v"), 204);
    cr_assert_eq(put_ttl("t/renewed", "v", 1, "300"), 204);
    cr_assert_eq(put("t/renewed", "w"), 204); /* a PUT without ttl_ms clears the TTL */
    cr_assert_eq(put("t/shortened", "v"), 204);
    cr_assert_eq(put_ttl("t/shortened", "w", 1, "300"), 204);
    json_t *items = list("t/");
    /* On a machine so loaded that 300 ms went by already, t/short may be gone: not a failure. */
    if (now_ms() - t0 < 250) {
        cr_assert_eq(json_array_size(items), 5);
        json_t *it = json_array_get(items, 2); /* forever, renewed, short, shortened, zero */
        cr_expect_str_eq(json_string_value(json_object_get(it, "key")), "t/short");
        json_int_t left = json_integer_value(json_object_get(it, "ttl_ms"));
        cr_expect(left > 0 && left <= 300, "ttl_ms left %lld", (long long)left);
    } else {
        cr_log_warn("slow machine: %llu ms for a few requests",
                    (unsigned long long)(now_ms() - t0));
    }
    cr_expect_eq(json_integer_value(json_object_get(json_array_get(items, 0), "ttl_ms")), 0);
    json_decref(items);
    uint64_t t1 = now_ms();
    if (t1 - t0 < 1000)
        usleep((useconds_t)(1000 - (t1 - t0)) * 1000);
    cr_expect_eq(get("t/short", &r), 404, "expired after 1 s");
    resp_free(&r);
    cr_expect_eq(get("t/shortened", &r), 404);
    resp_free(&r);
    cr_expect_eq(get("t/renewed", &r), 200);
    cr_expect_str_eq(r.body, "w");
    resp_free(&r);
    cr_expect_eq(del("t/shortened"), 404, "an expired key cannot be deleted");
    items = list(NULL);
    cr_expect_eq(json_array_size(items), 3, "expired keys are not listed");
    for (size_t i = 0; i < json_array_size(items); i++)
        cr_expect(
            !strstr(json_string_value(json_object_get(json_array_get(items, i), "key")), "short"));
    json_decref(items);
    cr_expect_eq(health_keys(), 3);
    finish();
}

/* renew=1 is how an owner keeps its key alive: it stores only over an absent (or expired) key or
 * the same value, so that an old owner never writes back a key that a new one took over. */
Test(metaserver, renew_only_over_absent_or_same, .timeout = 60)
{
    start_server(NULL, NULL);
    resp_t r;
    cr_assert_eq(put_ttl("k", "mine", 4, "60000&renew=1"), 204, "renewing an absent key");
    cr_assert_eq(put_ttl("k", "mine", 4, "60000&renew=1"), 204, "renewing the same value");
    http("/v1/kv/k?ttl_ms=60000&renew=1",
         &(req_opts_t){.method = "PUT", .body = "theirs", .len = 6}, &r);
    expect_error(&r, 412, "renewing over another value");
    resp_free(&r);
    cr_assert_eq(put_ttl("k", "mine!", 5, "60000&renew=1"), 412, "a longer value is another");
    cr_expect_eq(get("k", &r), 200);
    cr_expect_str_eq(r.body, "mine", "a refused renewal changes nothing");
    resp_free(&r);
    cr_assert_eq(put_ttl("k", "theirs", 6, "60000&renew=0"), 204, "renew=0 is a plain PUT");
    cr_assert_eq(put_ttl("k", "mine", 4, "60000&renew=1"), 412);
    cr_assert_eq(put_ttl("t", "v", 1, "200"), 204);
    usleep(400000);
    cr_assert_eq(put_ttl("t", "w", 1, "60000&renew=1"), 204, "an expired key counts as absent");
    cr_expect_eq(get("t", &r), 200);
    cr_expect_str_eq(r.body, "w");
    resp_free(&r);
    expect_path_error("PUT", "/v1/kv/k?renew=2", 400);
    expect_path_error("PUT", "/v1/kv/k?renew=yes", 400);
    cr_expect_eq(get("k", &r), 200);
    cr_expect_str_eq(r.body, "theirs");
    resp_free(&r);
    finish();
}

Test(metaserver, list_by_prefix_sorted, .timeout = 60)
{
    start_server(NULL, NULL);
    /* Stored out of order; "a/\xc3\xa9" (a/é) sorts after ASCII by bytes. */
    const char *keys[] = {"a/2", "b/1", "a/\xc3\xa9", "a/10", "ab", "a", "a/1", "a/:x/y", NULL};
    for (int i = 0; keys[i]; i++) {
        char v[64];
        snprintf(v, sizeof v, "v:%s", keys[i]);
        cr_assert_eq(put(keys[i], v), 204, "%s", keys[i]);
    }
    expect_keys(list("a/"),
                (const char *const[]){"a/1", "a/10", "a/2", "a/:x/y", "a/\xc3\xa9", NULL});
    expect_keys(list(NULL), (const char *const[]){"a", "a/1", "a/10", "a/2", "a/:x/y", "a/\xc3\xa9",
                                                  "ab", "b/1", NULL});
    expect_keys(list(""), (const char *const[]){"a", "a/1", "a/10", "a/2", "a/:x/y", "a/\xc3\xa9",
                                                "ab", "b/1", NULL});
    expect_keys(list("a"), (const char *const[]){"a", "a/1", "a/10", "a/2", "a/:x/y", "a/\xc3\xa9",
                                                 "ab", NULL});
    expect_keys(list("a/1"), (const char *const[]){"a/1", "a/10", NULL});
    expect_keys(list("b/1"), (const char *const[]){"b/1", NULL});
    expect_keys(list("zzz"), (const char *const[]){NULL});
    expect_keys(list("a/2/"), (const char *const[]){NULL});
    /* A JSON value comes back as a string holding the same text. */
    const char *jv = "{\"k\": [1, \"two\", null], \"\xe2\x82\xac\": \"\\u0000\"}";
    cr_assert_eq(put("j", jv), 204);
    json_t *items = list("j");
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(items, 0), "value")), jv);
    json_decref(items);
    finish();
}

Test(metaserver, prefix_routing, .timeout = 60)
{
    start_server("/meta", NULL);
    cr_assert_eq(put("k/1", "one"), 204); /* under /meta */
    resp_t r;
    cr_assert_eq(get("k/1", &r), 200);
    cr_expect_str_eq(r.body, "one");
    resp_free(&r);
    http("/meta/v1/kv/k%2F1", &(req_opts_t){.method = "GET"}, &r);
    cr_expect_eq(r.status, 200);
    resp_free(&r);
    expect_path_error("GET", "/v1/kv/k%2F1", 404);
    expect_path_error("PUT", "/v1/kv/k%2F2", 404);
    expect_path_error("GET", "/health", 404);
    expect_path_error("GET", "/v1/list", 404);
    expect_path_error("GET", "/metax/v1/kv/k%2F1", 404);
    expect_path_error("GET", "/meta", 404);
    cr_assert_eq(put("k/2", "v:k/2"), 204);
    cr_assert_eq(del("k/1"), 204);
    expect_keys(list("k/"), (const char *const[]){"k/2", NULL});
    expect_keys(list(NULL), (const char *const[]){"k/2", NULL});
    cr_expect_eq(health_keys(), 1);
    finish();
}

Test(metaserver, bad_input_rejected, .timeout = 60)
{
    start_server(NULL, NULL);
    cr_assert_eq(put("good", "v"), 204);
    /* TTLs: decimal digits only, at most a day. */
    const char *bad_ttls[] = {"abc", "-1",       "+5",  "%205", "5ms",
                              "",    "86400001", "1e3", "%005", "99999999999999999999999",
                              NULL};
    for (int i = 0; bad_ttls[i]; i++) {
        char path[128];
        snprintf(path, sizeof path, "/v1/kv/t?ttl_ms=%s", bad_ttls[i]);
        expect_path_error("PUT", path, 400);
    }
    expect_path_error("PUT", "/v1/kv/t?ttl_ms", 400);
    cr_expect_eq(put_ttl("t", "v", 1, "86400000"), 204, "a day is allowed");
    cr_expect_eq(put_ttl("t0", "v", 1, "000"), 204);
    /* Values must be UTF-8 (lone continuation, overlong, surrogate, truncated, > U+10FFFF). */
    const char *bad_vals[] = {"\x80", "\xc0\xaf", "\xed\xa0\x80", "ok\xe2\x82", "\xf4\x90\x80\x80",
                              "\xff", NULL};
    for (int i = 0; bad_vals[i]; i++) {
        resp_t r;
        http("/v1/kv/bad-value",
             &(req_opts_t){.method = "PUT", .body = bad_vals[i], .len = strlen(bad_vals[i])}, &r);
        expect_error(&r, 400, "invalid UTF-8 value");
        resp_free(&r);
    }
    cr_expect_eq(put("utf8", "\xf0\x9f\x98\x80 \xc3\xa9 \xe2\x82\xac"), 204);
    /* Keys: not empty, <= 1024 bytes, no control bytes, UTF-8. */
    const char *bad_keys[] = {"/v1/kv/",      "/v1/kv/a%01b",  "/v1/kv/%00",
                              "/v1/kv/a%00b", "/v1/kv/%7F",    "/v1/kv/a%0Ab",
                              "/v1/kv/%1F",   "/v1/kv/%C3%28", NULL};
    for (int i = 0; bad_keys[i]; i++) {
        expect_path_error("PUT", bad_keys[i], 400);
        expect_path_error("GET", bad_keys[i], 400);
        expect_path_error("DELETE", bad_keys[i], 400);
    }
    char key[1100];
    memset(key, 'k', 1025);
    key[1025] = '\0';
    char path[1200];
    snprintf(path, sizeof path, "/v1/kv/%s", key);
    expect_path_error("PUT", path, 400);
    key[1024] = '\0';
    cr_expect_eq(put(key, "v"), 204, "1024 bytes is the limit");
    /* Wrong methods on known paths. */
    resp_t r;
    http("/v1/kv/good", &(req_opts_t){.method = "POST", .body = "v", .len = 1}, &r);
    expect_error(&r, 405, "POST /v1/kv/good");
    cr_expect(strstr(r.allow, "PUT"), "Allow: %s", r.allow);
    resp_free(&r);
    expect_path_error("PATCH", "/v1/kv/good", 405);
    expect_path_error("PUT", "/health", 405);
    expect_path_error("DELETE", "/v1/list", 405);
    expect_path_error("POST", "/v1/list?prefix=a", 405);
    /* Nothing bad was stored and the server still serves. */
    cr_expect_eq(get("good", &r), 200);
    cr_expect_str_eq(r.body, "v");
    resp_free(&r);
    cr_expect_eq(health_keys(), 5); /* good, t, t0, utf8, kkk... */
    finish();
}

Test(metaserver, body_limits, .timeout = 60)
{
    start_server(NULL, NULL);
    size_t max = 16 * MIB;
    char *big = malloc(17 * MIB);
    cr_assert(big);
    memset(big, 'x', 17 * MIB);
    big[7] = 'y';
    big[max - 1] = 'z';
    cr_assert_eq(put_ttl("big", big, max, NULL), 204, "16 MiB is the limit");
    resp_t r;
    cr_assert_eq(get("big", &r), 200);
    cr_expect(r.len == max && !memcmp(r.body, big, max), "16 MiB back, byte for byte");
    resp_free(&r);
    /* One byte over, announced by Content-Length: refused before the body is sent. */
    http("/v1/kv/big1", &(req_opts_t){.method = "PUT", .body = big, .len = max + 1, .expect = true},
         &r);
    expect_error(&r, 413, "16 MiB + 1 with Content-Length");
    resp_free(&r);
    http("/v1/kv/big2",
         &(req_opts_t){.method = "PUT", .body = big, .len = 17 * MIB, .expect = true}, &r);
    expect_error(&r, 413, "17 MiB with Content-Length");
    resp_free(&r);
    /* Chunked, so no size ahead: counted as it arrives. */
    http("/v1/kv/big3", &(req_opts_t){.method = "PUT", .chunked = 17 * MIB}, &r);
    expect_error(&r, 413, "17 MiB chunked");
    resp_free(&r);
    http("/v1/kv/small", &(req_opts_t){.method = "PUT", .chunked = 1000}, &r);
    cr_expect_eq(r.status, 204, "a small chunked PUT: %s", r.body);
    resp_free(&r);
    free(big);
    cr_expect_eq(get("big1", &r), 404);
    resp_free(&r);
    cr_expect_eq(get("big3", &r), 404);
    resp_free(&r);
    cr_expect_eq(get("small", &r), 200);
    cr_expect_eq(r.len, 1000);
    resp_free(&r);
    cr_expect_eq(del("big"), 204);
    cr_expect_eq(health_keys(), 1);
    finish();
}

Test(metaserver, full_store, .timeout = 60)
{
    start_server(NULL, "3"); /* test hook: 3 keys at most */
    cr_assert_eq(put("k1", "v"), 204);
    cr_assert_eq(put("k2", "v"), 204);
    cr_assert_eq(put("k3", "v"), 204);
    resp_t r;
    http("/v1/kv/k4", &(req_opts_t){.method = "PUT", .body = "v", .len = 1}, &r);
    expect_error(&r, 507, "a fourth key");
    cr_expect(strstr(r.body, "full"), "%s", r.body);
    resp_free(&r);
    cr_expect_eq(put("k1", "replaced"), 204, "replacing needs no room");
    cr_expect_eq(del("k2"), 204);
    cr_expect_eq(put_ttl("t", "v", 1, "1000"), 204);
    cr_expect_eq(put("k5", "v"), 507);
    usleep(1200 * 1000);
    cr_expect_eq(put("k5", "v"), 204, "an expired key makes room");
    cr_expect_eq(health_keys(), 3);
    expect_keys(list("t"), (const char *const[]){NULL});
    finish();
}

/* ---- Many clients at once -------------------------------------------------------------------- */

#define THREADS 8
#define ROUNDS  25

/* One request of a client thread: the status, or 0 if no answer came (no cr_assert off the
 * test's own thread). `want`, when given, is the body expected. */
static long call(const char *path, const req_opts_t *o, const char *want)
{
    resp_t r;
    long st = http_try(path, o, &r) == CURLE_OK ? r.status : 0;
    if (want && (!r.body || strcmp(r.body, want)))
        st = 0;
    resp_free(&r);
    return st;
}

static void *client_main(void *arg)
{
    long id = (long)arg, bad = 0;
    for (int i = 0; i < ROUNDS; i++) {
        char val[64], path[128];
        snprintf(val, sizeof val, "{\"client\":%ld,\"round\":%d}", id, i);
        snprintf(path, sizeof path, "/v1/kv/c%%2F%ld%%2F%d", id, i); /* c/<id>/<i> */
        req_opts_t put_val = {.method = "PUT", .body = val, .len = strlen(val)};
        bad += call(path, &put_val, NULL) != 204;
        bad += call(path, &(req_opts_t){.method = "GET"}, val) != 200;
        bad += call("/v1/kv/shared", &put_val, NULL) != 204;
        if (i % 2)
            bad += call(path, &(req_opts_t){.method = "DELETE"}, NULL) != 204;
    }
    return (void *)bad;
}

Test(metaserver, concurrent_clients, .timeout = 60)
{
    start_server(NULL, NULL);
    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, client_main, (void *)i), 0);
    long bad = 0;
    for (int i = 0; i < THREADS; i++) {
        void *b;
        pthread_join(t[i], &b);
        bad += (long)b;
    }
    cr_expect_eq(bad, 0, "%ld unexpected answers", bad);
    cr_expect_eq(health_keys(), THREADS * ((ROUNDS + 1) / 2) + 1);
    json_t *items = list("c/");
    cr_expect_eq(json_array_size(items), THREADS * ((ROUNDS + 1) / 2));
    for (size_t i = 1; i < json_array_size(items); i++)
        cr_expect_lt(strcmp(json_string_value(json_object_get(json_array_get(items, i - 1), "key")),
                            json_string_value(json_object_get(json_array_get(items, i), "key"))),
                     0, "sorted at %zu", i);
    json_decref(items);
    finish();
}

/* ---- The command line ------------------------------------------------------------------------ */

typedef struct {
    int status;
    char out[4096], err[4096];
} result_t;

static void run(result_t *res, const char *const *args)
{
    bin();
    res->status =
        test_run_cli("metadata-server", args, res->out, sizeof res->out, res->err, sizeof res->err);
    cr_assert_neq(res->status, -2, "cannot run $KVB_BIN metadata-server");
}

#define RUN(res, ...) run(res, (const char *const[]){__VA_ARGS__, NULL})

Test(metaserver, bad_options_exit_2, .timeout = 60)
{
    static const char *const bad[][5] = {
        {NULL},
        {"--port", NULL},
        {"--port", "abc", NULL},
        {"--port", "-1", NULL},
        {"--port", "65536", NULL},
        {"--bind", "127.0.0.1", NULL},
        {"--port", "0", "--bind", "not-an-address", NULL},
        {"--port", "0", "--prefix", "meta", NULL},
        {"--port", "0", "--prefix", "/meta/", NULL},
        {"--port", "0", "--prefix", "/", NULL},
        {"--port", "0", "--prefix", "/a b", NULL},
        {"--port", "0", "--bogus", "1", NULL},
        {"--port", "0", "extra", NULL},
    };
    result_t res;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bin();
        res.status = test_run_cli("metadata-server", bad[i], res.out, sizeof res.out, res.err,
                                  sizeof res.err);
        cr_expect_eq(res.status, 2, "case %zu (%s %s %s): exit %d; %s", i, bad[i][0],
                     bad[i][0] ? bad[i][1] : "", bad[i][0] && bad[i][1] ? bad[i][2] : "",
                     res.status, res.err);
        cr_expect(strstr(res.err, "usage: kvbridge metadata-server"), "case %zu: %s", i, res.err);
        cr_expect_str_eq(res.out, "", "case %zu: nothing on stdout", i);
    }
    RUN(&res, "--help");
    cr_expect_eq(res.status, 0);
    cr_expect(strstr(res.out, "usage: kvbridge metadata-server"), "%s", res.out);
}

Test(metaserver, port_in_use_exits_1, .timeout = 60)
{
    start_server(NULL, NULL);
    char port[16];
    snprintf(port, sizeof port, "%u", srv_port);
    result_t res;
    RUN(&res, "--port", port);
    cr_expect_eq(res.status, 1, "exit %d; %s", res.status, res.err);
    cr_expect(strstr(res.err, "cannot listen"), "%s", res.err);
    cr_expect_str_eq(res.out, "");
    finish();
}
