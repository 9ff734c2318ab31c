/* SPDX-License-Identifier: Apache-2.0 */
/* Self-test of the store fixture (tests/helpers/store.c): each real store starts and answers its
 * own protocol, refuses connections after a halt, answers on the same port after a restart (etcd
 * with the data it had, Redis without), and leaves no process and no dir after stop. Clients here
 * are deliberately independent of src/meta: RESP over a raw socket, etcd's JSON gateway and the
 * metadata server over libcurl. */
#include <criterion/criterion.h>
#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base64.h"
#include "helpers/peer.h"
#include "helpers/store.h"

#define KEY "kvbridge/fixture/key"

static char tmpdir[200]; /* TMPDIR of the test, so that anything left behind can be seen */

static void setup(void)
{
    const char *base = getenv("TMPDIR");
    cr_assert_eq(curl_global_init(CURL_GLOBAL_DEFAULT), CURLE_OK);
    snprintf(tmpdir, sizeof tmpdir, "%s/kvbridge-fixture-test-XXXXXX",
             base && *base && strlen(base) < 100 ? base : "/tmp");
    cr_assert_not_null(mkdtemp(tmpdir));
    cr_assert_eq(setenv("TMPDIR", tmpdir, 1), 0);
}

static void teardown(void)
{
    rmdir(tmpdir); /* empty unless a test failed; a failed test's leftovers are worth a look */
    curl_global_cleanup();
}

TestSuite(store_fixture, .init = setup, .fini = teardown);

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int entries(const char *dir)
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "opendir %s: %s", dir, strerror(errno));
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

/* fd connected to 127.0.0.1:port, or -1 with errno. */
static int dial(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    struct timeval tv = {.tv_sec = 5};
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/* ---- Redis: RESP over a raw socket ---- */

/* Sends a command of argc bulk strings, reads one reply (status, error or bulk) into buf and
 * returns its length. */
static size_t resp_call(uint16_t port, int argc, const char *const *argv, char *buf, size_t cap)
{
    char req[1024];
    int len = snprintf(req, sizeof req, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++) {
        len += snprintf(req + len, sizeof req - (size_t)len, "$%zu\r\n%s\r\n", strlen(argv[i]),
                        argv[i]);
        cr_assert_lt((size_t)len, sizeof req, "command too long for the test's buffer");
    }
    int fd = dial(port);
    cr_assert_geq(fd, 0, "connect to redis on %u: %s", port, strerror(errno));
    cr_assert_eq(send(fd, req, (size_t)len, MSG_NOSIGNAL), len);
    size_t got = 0;
    for (;;) {
        char *eol = memmem(buf, got, "\r\n", 2);
        if (eol) {
            long bulk = buf[0] == '$' ? strtol(buf + 1, NULL, 10) : -1;
            size_t need = (size_t)(eol + 2 - buf) + (bulk >= 0 ? (size_t)bulk + 2 : 0);
            if (got >= need)
                break;
        }
        cr_assert_lt(got, cap - 1, "redis reply too long");
        ssize_t k = recv(fd, buf + got, cap - 1 - got, 0);
        cr_assert_gt(k, 0, "redis closed or timed out after %zu bytes", got);
        got += (size_t)k;
    }
    close(fd);
    buf[got] = '\0';
    return got;
}

static void redis_put(const test_store_t *s, const char *key, const char *val)
{
    char r[256];
    resp_call(s->port, 3, (const char *[]){"SET", key, val}, r, sizeof r);
    cr_assert_str_eq(r, "+OK\r\n");
}

/* 1 and the value in out, or 0 if the key is not there. */
static int redis_get(const test_store_t *s, const char *key, char *out, size_t cap)
{
    char r[512];
    size_t n = resp_call(s->port, 2, (const char *[]){"GET", key}, r, sizeof r);
    if (!strcmp(r, "$-1\r\n"))
        return 0;
    cr_assert_eq(r[0], '$', "GET answered %s", r);
    char *v = strstr(r, "\r\n") + 2;
    size_t len = (size_t)(r + n - 2 - v);
    cr_assert_eq((size_t)strtol(r + 1, NULL, 10), len);
    cr_assert_lt(len, cap);
    memcpy(out, v, len);
    out[len] = '\0';
    return 1;
}

/* ---- etcd and the metadata server: HTTP with libcurl ---- */

typedef struct {
    char data[8192];
    size_t len;
} body_t;

static size_t on_body(char *p, size_t size, size_t n, void *user)
{
    body_t *b = user;
    size_t len = size * n;
    if (len > sizeof b->data - 1 - b->len)
        return 0; /* fails the transfer: a body this size is wrong anyway */
    memcpy(b->data + b->len, p, len);
    b->len += len;
    b->data[b->len] = '\0';
    return len;
}

/* Returns the HTTP status; the body lands in b. */
static long http_call(const char *method, const char *url, const char *body, body_t *b)
{
    CURL *c = curl_easy_init();
    cr_assert_not_null(c);
    b->len = 0;
    b->data[0] = '\0';
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    if (body)
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 5000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    cr_assert_eq(rc, CURLE_OK, "%s %s: %s", method, url, curl_easy_strerror(rc));
    return code;
}

static char *b64(const char *s)
{
    char *e = kvb__b64_encode(s, strlen(s));
    cr_assert_not_null(e);
    return e;
}

static void etcd_put(const test_store_t *s, const char *key, const char *val)
{
    char url[160], *k = b64(key), *v = b64(val);
    json_t *req = json_pack("{s:s, s:s}", "key", k, "value", v);
    char *body = json_dumps(req, JSON_COMPACT);
    body_t b;
    snprintf(url, sizeof url, "http://127.0.0.1:%u/v3/kv/put", s->port);
    cr_assert_eq(http_call("POST", url, body, &b), 200, "put: %s", b.data);
    free(body);
    json_decref(req);
    free(k);
    free(v);
}

static int etcd_get(const test_store_t *s, const char *key, char *out, size_t cap)
{
    char url[160], body[256], *k = b64(key);
    body_t b;
    snprintf(url, sizeof url, "http://127.0.0.1:%u/v3/kv/range", s->port);
    snprintf(body, sizeof body, "{\"key\":\"%s\"}", k);
    free(k);
    cr_assert_eq(http_call("POST", url, body, &b), 200, "range: %s", b.data);
    json_error_t err;
    json_t *resp = json_loads(b.data, 0, &err);
    cr_assert_not_null(resp, "range answered %s", b.data);
    json_t *kvs = json_object_get(resp, "kvs"); /* absent when nothing matched */
    int found = json_array_size(kvs) > 0;
    if (found) {
        cr_assert_eq(json_array_size(kvs), 1);
        const char *v = json_string_value(json_object_get(json_array_get(kvs, 0), "value"));
        cr_assert_not_null(v, "range answered %s", b.data);
        char *dec;
        size_t len;
        cr_assert_eq(kvb__b64_decode(v, strlen(v), &dec, &len), 0);
        cr_assert_lt(len, cap);
        memcpy(out, dec, len + 1);
        free(dec);
    }
    json_decref(resp);
    return found;
}

static void meta_put(const test_store_t *s, const char *key, const char *val)
{
    char url[1200];
    body_t b;
    snprintf(url, sizeof url, "%s/v1/kv/%s", s->uri, key);
    long code = http_call("PUT", url, val, &b);
    cr_assert(code >= 200 && code < 300, "PUT %s: %ld %s", url, code, b.data);
}

static int meta_get(const test_store_t *s, const char *key, char *out, size_t cap)
{
    char url[1200];
    body_t b;
    snprintf(url, sizeof url, "%s/v1/kv/%s", s->uri, key);
    long code = http_call("GET", url, NULL, &b);
    if (code == 404)
        return 0;
    cr_assert_eq(code, 200, "GET %s: %ld %s", url, code, b.data);
    cr_assert_lt(b.len, cap);
    memcpy(out, b.data, b.len + 1);
    return 1;
}

static void put(const test_store_t *s, const char *key, const char *val)
{
    if (s->kind == TEST_STORE_REDIS)
        redis_put(s, key, val);
    else if (s->kind == TEST_STORE_ETCD)
        etcd_put(s, key, val);
    else
        meta_put(s, key, val);
}

static int get(const test_store_t *s, const char *key, char *out, size_t cap)
{
    if (s->kind == TEST_STORE_REDIS)
        return redis_get(s, key, out, cap);
    if (s->kind == TEST_STORE_ETCD)
        return etcd_get(s, key, out, cap);
    return meta_get(s, key, out, cap);
}

/* ---- the tests ---- */

/* start, talk, halt, restart, stop. `keeps`: whether data survives a restart. */
static void lifecycle(test_store_kind_t kind, int keeps)
{
    const char *name = test_store_kind_name(kind);
    char want[64], got[256], uri[128], dir[256];
    test_store_t s;

    int64_t t0 = now_ms();
    cr_assert_eq(test_store_start(&s, kind), 0, "%s did not start", name);
    int64_t start_ms = now_ms() - t0;
    cr_assert_gt(s.pid, 0);
    cr_assert_neq(s.port, 0);
    snprintf(uri, sizeof uri, "%s://127.0.0.1:%u", name, s.port);
    cr_assert_str_eq(s.uri, uri);
    struct stat st;
    cr_assert(stat(s.dir, &st) == 0 && S_ISDIR(st.st_mode), "no dir %s", s.dir);
    cr_assert_eq(strncmp(s.dir, tmpdir, strlen(tmpdir)), 0, "dir %s not under TMPDIR", s.dir);
    if (kind == TEST_STORE_ETCD)
        cr_assert(s.peer_port && s.peer_port != s.port);

    snprintf(want, sizeof want, "value of %s %d", name, (int)getpid());
    cr_assert_eq(get(&s, KEY, got, sizeof got), 0, "a fresh %s has " KEY, name);
    put(&s, KEY, want);
    cr_assert_eq(get(&s, KEY, got, sizeof got), 1);
    cr_assert_str_eq(got, want);

    /* An outage: refused at once, not hanging. */
    uint16_t port = s.port;
    pid_t first = s.pid;
    cr_assert_eq(test_store_halt(&s), 0);
    cr_assert_eq(s.pid, 0);
    cr_assert(kill(first, 0) == -1 && errno == ESRCH, "halted %s (pid %d) still exists", name,
              (int)first);
    cr_assert_eq(dial(port), -1, "%s still accepts on %u after halt", name, port);
    cr_assert_eq(errno, ECONNREFUSED, "connect after halt: %s", strerror(errno));
    cr_assert_eq(test_store_halt(&s), -1, "halting a halted store");

    t0 = now_ms();
    cr_assert_eq(test_store_restart(&s), 0, "%s did not restart", name);
    int64_t restart_ms = now_ms() - t0;
    cr_assert_gt(s.pid, 0);
    cr_assert_eq(s.port, port);
    cr_assert_str_eq(s.uri, uri);
    int kept = get(&s, KEY, got, sizeof got);
    cr_assert_eq(kept, keeps, "%s %s the key over a restart", name, kept ? "kept" : "lost");
    if (kept)
        cr_assert_str_eq(got, want);
    put(&s, KEY, "again");
    cr_assert_eq(get(&s, KEY, got, sizeof got), 1);
    cr_assert_str_eq(got, "again");

    pid_t last = s.pid;
    snprintf(dir, sizeof dir, "%s", s.dir);
    test_store_stop(&s);
    cr_assert_eq(s.pid, 0);
    cr_assert(kill(last, 0) == -1 && errno == ESRCH, "stopped %s (pid %d) still exists", name,
              (int)last);
    cr_assert(stat(dir, &st) == -1 && errno == ENOENT, "%s still there", dir);
    cr_assert_eq(entries(tmpdir), 0, "left behind in %s", tmpdir);
    test_store_stop(&s); /* idempotent */
    fprintf(stderr, "store_fixture: %-5s ready in %4lld ms, after a restart in %4lld ms (%s)\n",
            name, (long long)start_ms, (long long)restart_ms,
            kept ? "kept its data" : "lost its data");
}

Test(store_fixture, redis, .timeout = 60)
{
    lifecycle(TEST_STORE_REDIS, 0);
}

Test(store_fixture, etcd, .timeout = 60)
{
    lifecycle(TEST_STORE_ETCD, 1);
}

Test(store_fixture, http, .timeout = 60)
{
    lifecycle(TEST_STORE_HTTP, 0); /* keys live in its memory */
}

/* A server that does not answer SIGTERM (here: stopped) is killed after the 3 s grace. */
Test(store_fixture, stop_escalates_to_sigkill, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, TEST_STORE_REDIS), 0);
    pid_t pid = s.pid;
    cr_assert_eq(test_child_signal(pid, SIGSTOP), 0); /* stopped, or it could obey SIGTERM */
    int64_t t0 = now_ms();
    test_store_stop(&s);
    int64_t took = now_ms() - t0;
    cr_assert(took >= 2900 && took < 10000, "stop took %lld ms", (long long)took);
    cr_assert(kill(pid, 0) == -1 && errno == ESRCH);
    cr_assert_eq(entries(tmpdir), 0);
}

/* A server that exits while starting: -1, and nothing left running or on disk. */
Test(store_fixture, failed_start_leaves_nothing, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(setenv("KVB_BIN", "/bin/false", 1), 0);
    cr_assert_eq(test_store_start(&s, TEST_STORE_HTTP), -1);
    cr_assert_eq(s.pid, 0);
    cr_assert_eq(s.dir[0], '\0');
    cr_assert_eq(entries(tmpdir), 0);
    cr_assert_eq(test_store_restart(&s), -1);
    cr_assert_eq(test_store_halt(&s), -1);
    test_store_stop(&s);

    cr_assert_eq(unsetenv("KVB_BIN"), 0);
    cr_assert_eq(test_store_start(&s, TEST_STORE_HTTP), -1);
    cr_assert_eq(entries(tmpdir), 0);
}

/* A listening socket on 127.0.0.1:port (0: any) that never accepts: the port is taken. */
static int squat(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_geq(fd, 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0, "bind %u: %s", port,
                 strerror(errno));
    cr_assert_eq(listen(fd, 4), 0);
    return fd;
}

static uint16_t local_port(int fd)
{
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    return ntohs(a.sin_port);
}

/* The first port is taken: the fixture says so and starts on new ports. */
Test(store_fixture, start_retries_a_taken_port, .timeout = 60)
{
    for (test_store_kind_t k = TEST_STORE_REDIS; k <= TEST_STORE_ETCD; k++) {
        int fd = squat(0);
        char num[8];
        snprintf(num, sizeof num, "%u", local_port(fd));
        cr_assert_eq(setenv("KVB_TEST_STORE_FIRST_PORT", num, 1), 0);
        test_store_t s;
        cr_assert_eq(test_store_start(&s, k), 0, "%s", test_store_kind_name(k));
        cr_assert_neq(s.port, local_port(fd));
        char got[64];
        cr_assert_eq(get(&s, KEY, got, sizeof got), 0);
        test_store_stop(&s);
        close(fd);
        cr_assert_eq(entries(tmpdir), 0);
    }
}

static void *unsquat_later(void *arg)
{
    usleep(700 * 1000);
    close(*(int *)arg);
    return NULL;
}

/* While down, its port was taken for a while: restart keeps the port and waits it out. */
Test(store_fixture, restart_waits_for_its_port, .timeout = 60)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, TEST_STORE_REDIS), 0);
    uint16_t port = s.port;
    cr_assert_eq(test_store_halt(&s), 0);
    int fd = squat(port);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, unsquat_later, &fd), 0);
    int64_t t0 = now_ms();
    int rc = test_store_restart(&s);
    int64_t took = now_ms() - t0;
    pthread_join(t, NULL);
    cr_assert_eq(rc, 0);
    cr_assert_eq(s.port, port);
    cr_assert_geq(took, 700);
    redis_put(&s, KEY, "back");
    test_store_stop(&s);
    cr_assert_eq(entries(tmpdir), 0);
}

/* A test that fails between start and stop (an assertion leaves by longjmp, then the process
 * exits): the fixture's exit handler still kills the server and removes the dir - only the
 * exiting process's own, not those of the parent it was forked from. */
Test(store_fixture, exit_sweeps_what_a_test_left, .timeout = 60)
{
    test_store_t mine;
    cr_assert_eq(test_store_start(&mine, TEST_STORE_REDIS), 0);
    int p[2];
    cr_assert_eq(pipe(p), 0);
    fflush(NULL);
    pid_t child = fork();
    cr_assert_geq(child, 0);
    if (child == 0) {
        test_store_t s;
        if (test_store_start(&s, TEST_STORE_REDIS) == 0)
            dprintf(p[1], "%d %s", (int)s.pid, s.dir);
        exit(0); /* without test_store_stop */
    }
    close(p[1]);
    char msg[320] = "";
    ssize_t n = read(p[0], msg, sizeof msg - 1);
    close(p[0]);
    int status;
    cr_assert_eq(waitpid(child, &status, 0), child);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    int pid = 0;
    char dir[300] = "";
    cr_assert(n > 0 && sscanf(msg, "%d %299s", &pid, dir) == 2, "child said '%s'", msg);
    cr_assert(kill(pid, 0) == -1 && errno == ESRCH, "server %d outlived the sweep", pid);
    struct stat st;
    cr_assert(stat(dir, &st) == -1 && errno == ENOENT, "%s outlived the sweep", dir);
    redis_put(&mine, KEY, "still here");
    cr_assert(stat(mine.dir, &st) == 0);
    test_store_stop(&mine);
    cr_assert_eq(entries(tmpdir), 0);
}

Test(store_fixture, free_port, .timeout = 60)
{
    uint16_t p = test_free_port();
    cr_assert_neq(p, 0);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(p), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0, "port %u: %s", p, strerror(errno));
    close(fd);
}
