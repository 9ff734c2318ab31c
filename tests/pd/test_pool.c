/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the proxy's pooled upstream client (src/pd/proxy/http.c): calls to one origin reuse
 * one keep-alive connection (counted by the server), a call that ends abnormally (canceled, sink
 * refused, deadline) does not leave its connection to the next call, a killed and restarted
 * server (in-process, a forked process, a real `kvbridge serve` behind the proxy) causes no
 * spurious failure, a kept-alive connection the server drops under a request is retried on a
 * fresh one, and the pool is bounded. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "pd/proxy/proxy.h"
#include "pd/proxy/internal.h"
#include "pd_procs.h"

/* ---- A counting server ----------------------------------------------------------------------- */

#define OK_BODY "{\"ok\":true}"

static struct {
    struct MHD_Daemon *mhd;
    uint16_t port;
    atomic_int conns; /* connections accepted */
    atomic_bool stop;
} srv;

static void on_conn(void *cls, struct MHD_Connection *c, void **sctx,
                    enum MHD_ConnectionNotificationCode code)
{
    (void)cls, (void)c, (void)sctx;
    if (code == MHD_CONNECTION_NOTIFY_STARTED)
        atomic_fetch_add(&srv.conns, 1);
}

/* /stream: an event every 100 ms, 30 in all. */
static ssize_t slow_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    int *step = cls;
    if (*step >= 30)
        return MHD_CONTENT_READER_END_OF_STREAM;
    if ((*step)++ > 0)
        for (int i = 0; i < 10 && !atomic_load(&srv.stop); i++)
            usleep(10000);
    if (atomic_load(&srv.stop))
        return MHD_CONTENT_READER_END_WITH_ERROR;
    return snprintf(buf, max, "data: {\"n\":%d}\n\n", *step);
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url,
                               const char *method, const char *version, const char *data,
                               size_t *len, void **con_cls)
{
    (void)cls, (void)method, (void)version, (void)data;
    if (!*con_cls) {
        *con_cls = c; /* anything non-NULL: the headers are in */
        return MHD_YES;
    }
    if (*len) {
        *len = 0;
        return MHD_YES;
    }
    if (!strcmp(url, "/ok"))
        return pd_json_reply(c, 200, OK_BODY);
    if (!strcmp(url, "/slow")) {
        usleep(300000);
        return pd_json_reply(c, 200, OK_BODY);
    }
    if (!strcmp(url, "/busy"))
        return pd_json_reply(c, 503, "{\"error\":{\"message\":\"busy\"}}");
    if (!strcmp(url, "/stream")) {
        int *step = calloc(1, sizeof *step);
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 256, slow_reader, step, free);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    return pd_json_reply(c, 404, "{}");
}

/* Starts the server on `port` (0: any free one). */
static struct MHD_Daemon *start_on(uint16_t port)
{
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL, port, NULL,
        NULL, handler, NULL, MHD_OPTION_NOTIFY_CONNECTION, on_conn, NULL, MHD_OPTION_END);
    cr_assert(d, "cannot start a server on port %u", (unsigned)port);
    return d;
}

static void srv_up(void)
{
    atomic_store(&srv.stop, false);
    atomic_store(&srv.conns, 0);
    srv.mhd = start_on(0);
    srv.port = MHD_get_daemon_info(srv.mhd, MHD_DAEMON_INFO_BIND_PORT)->port;
}

static void fini(void)
{
    atomic_store(&srv.stop, true);
    kvb__pxy_pool_flush();
    if (srv.mhd)
        MHD_stop_daemon(srv.mhd);
    srv.mhd = NULL;
    stop_all();
}

TestSuite(pool, .init = srv_up, .fini = fini, .timeout = 30);

typedef struct {
    int rc;
    kvb__pxy_res_t rs;
} res_t;

static void call_ex(uint16_t port, const char *path, const char *body, uint32_t timeout_ms,
                    const atomic_bool *cancel, kvb__pxy_sink_cb sink, void *user, res_t *out)
{
    char url[96];
    snprintf(url, sizeof url, "http://127.0.0.1:%u%s", (unsigned)port, path);
    kvb__pxy_req_t rq = {.url = url,
                         .body = body,
                         .deadline_ns = kvb__deadline_ms(timeout_ms),
                         .cancel = cancel,
                         .sink = sink,
                         .user = user};
    out->rc = kvb__pxy_call(&rq, &out->rs);
}

/* A call that must answer 200 with OK_BODY. */
static void call_ok(uint16_t port, const char *path, const char *body, const char *what)
{
    res_t r;
    call_ex(port, path, body, 5000, NULL, NULL, NULL, &r);
    cr_assert_eq(r.rc, 0, "%s: %s", what, r.rs.error);
    cr_assert_eq(r.rs.status, 200, "%s: status %ld", what, r.rs.status);
    cr_assert_str_eq(r.rs.body ? r.rs.body : "", OK_BODY, "%s", what);
    free(r.rs.body);
}

/* ---- Reuse ----------------------------------------------------------------------------------- */

Test(pool, sequential_calls_share_one_connection)
{
    for (int i = 0; i < 20; i++)
        call_ok(srv.port, "/ok", i % 2 ? "{\"i\":1}" : NULL, i % 2 ? "POST" : "GET");
    /* A non-2xx answer is a complete answer too: its connection is kept. */
    res_t r;
    call_ex(srv.port, "/busy", "{}", 5000, NULL, NULL, NULL, &r);
    cr_expect_eq(r.rc, 0, "%s", r.rs.error);
    cr_expect_eq(r.rs.status, 503);
    free(r.rs.body);
    call_ok(srv.port, "/ok", NULL, "after a 503");
    cr_expect_eq(atomic_load(&srv.conns), 1, "22 calls opened %d connections",
                 atomic_load(&srv.conns));
    cr_expect_eq(kvb__pxy_pool_idle(), 1);
    /* Another origin (same server, other host name) is another connection. */
    char url[96];
    snprintf(url, sizeof url, "http://localhost:%u/ok", (unsigned)srv.port);
    char *body = NULL;
    cr_expect_eq(kvb_pd_http(url, NULL, 5000, &body, NULL, 0), 200);
    free(body);
    cr_expect_eq(kvb__pxy_pool_idle(), 2);
    kvb__pxy_pool_flush();
    cr_expect_eq(kvb__pxy_pool_idle(), 0);
    int before = atomic_load(&srv.conns);
    call_ok(srv.port, "/ok", NULL, "after a flush");
    cr_expect_eq(atomic_load(&srv.conns), before + 1, "a flushed pool connects anew");
}

/* ---- Abnormal ends --------------------------------------------------------------------------- */

static bool refuse_sink(const char *data, size_t len, void *user)
{
    (void)data, (void)len, (void)user;
    return false;
}

static bool cancel_sink(const char *data, size_t len, void *user)
{
    (void)data, (void)len;
    atomic_store((atomic_bool *)user, true);
    return true;
}

/* After each abnormal end the next call gets a clean answer on a new connection: the aborted
 * one, with the rest of a stream still coming, was not pooled. */
Test(pool, abnormal_end_is_not_reused)
{
    call_ok(srv.port, "/ok", NULL, "first");
    cr_assert_eq(atomic_load(&srv.conns), 1);

    res_t r;
    call_ex(srv.port, "/stream", "{}", 10000, NULL, refuse_sink, NULL, &r);
    cr_expect_neq(r.rc, 0, "the sink stopped it");
    cr_expect(r.rs.canceled);
    free(r.rs.body);
    call_ok(srv.port, "/ok", NULL, "after a refusing sink");
    cr_expect_eq(atomic_load(&srv.conns), 2, "connections: %d", atomic_load(&srv.conns));

    atomic_bool cancel = false;
    call_ex(srv.port, "/stream", "{}", 10000, &cancel, cancel_sink, &cancel, &r);
    cr_expect_neq(r.rc, 0, "the cancel flag stopped it");
    cr_expect(r.rs.canceled);
    cr_expect_str_eq(r.rs.error, "canceled");
    free(r.rs.body);
    call_ok(srv.port, "/ok", NULL, "after a cancel");
    cr_expect_eq(atomic_load(&srv.conns), 3, "connections: %d", atomic_load(&srv.conns));

    uint64_t t = kvb__now_ns();
    call_ex(srv.port, "/stream", NULL, 350, NULL, NULL, NULL, &r);
    cr_expect_neq(r.rc, 0);
    cr_expect(r.rs.timed_out, "%s", r.rs.error);
    cr_expect_lt(kvb__now_ns() - t, 2000000000ull);
    free(r.rs.body);
    call_ok(srv.port, "/ok", NULL, "after a deadline");
    cr_expect_eq(atomic_load(&srv.conns), 4, "connections: %d", atomic_load(&srv.conns));
    cr_expect_eq(kvb__pxy_pool_idle(), 1);
}

/* ---- Servers that go away -------------------------------------------------------------------- */

/* The pooled connection's server stops and another starts on its port: the next call is answered
 * (not failed on the dead connection), on a new connection. */
Test(pool, restarted_server_in_process)
{
    call_ok(srv.port, "/ok", NULL, "first");
    MHD_stop_daemon(srv.mhd);
    srv.mhd = NULL;
    res_t r;
    call_ex(srv.port, "/ok", NULL, 5000, NULL, NULL, NULL, &r);
    cr_expect_neq(r.rc, 0, "nobody listens");
    cr_expect(r.rs.status == 0 && !r.rs.timed_out && !r.rs.canceled,
              "no answer at all (what marks an instance down): %ld %s", r.rs.status, r.rs.error);
    free(r.rs.body);
    atomic_store(&srv.conns, 0);
    srv.mhd = start_on(srv.port);
    call_ok(srv.port, "/ok", "{}", "after the restart");
    call_ok(srv.port, "/ok", NULL, "and again");
    cr_expect_eq(atomic_load(&srv.conns), 1);
}

/* A server process that answers /ok; writes its port to `fd`; dies with the test. It is this
 * test binary run again (fork and exec): a child only forked from this process, which runs the
 * fake upstream's MHD threads, could inherit a lock one of them held at the fork - under ASan an
 * allocator lock - and hang in its first malloc (seen in CI: a call timed out with 0 bytes). */
#define SERVE_ENV "KVB_POOL_TEST_SERVE"

__attribute__((constructor)) static void serve_if_asked(void)
{
    const char *spec = getenv(SERVE_ENV);
    unsigned port, fd;
    if (!spec)
        return;
    if (sscanf(spec, "%u,%u", &port, &fd) != 2)
        _exit(2);
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL,
        (uint16_t)port, NULL, NULL, handler, NULL, MHD_OPTION_END);
    uint16_t p = d ? MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT)->port : 0;
    if (write((int)fd, &p, sizeof p) != sizeof p || !d)
        _exit(1);
    for (;;)
        pause();
}

static pid_t fork_server(uint16_t port, int fd)
{
    extern char **environ;
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = calloc(n + 2, sizeof *env), spec[64], self[4096];
    cr_assert_not_null(env);
    memcpy(env, environ, n * sizeof *env); /* ASAN_OPTIONS and the like stay */
    snprintf(spec, sizeof spec, SERVE_ENV "=%u,%d", (unsigned)port, fd);
    env[n] = spec;
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    cr_assert(len > 0);
    self[len] = '\0';
    char *argv[] = {self, NULL};
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execve(self, argv, env);
        _exit(127);
    }
    free(env);
    track(pid);
    return pid;
}

static uint16_t read_port(int fd)
{
    uint16_t p = 0;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&pf, 1, 5000), 1, "the server process did not start");
    cr_assert_eq(read(fd, &p, sizeof p), (ssize_t)sizeof p);
    cr_assert_neq(p, 0, "the server process could not listen");
    return p;
}

/* As above, the server a process killed with SIGKILL and started again. */
Test(pool, killed_and_restarted_process)
{
    int pp[2];
    cr_assert_eq(pipe(pp), 0);
    pid_t pid = fork_server(0, pp[1]);
    uint16_t port = read_port(pp[0]);
    for (int i = 0; i < 3; i++)
        call_ok(port, "/ok", i ? "{}" : NULL, "before the kill");
    cr_expect_eq(kvb__pxy_pool_idle(), 1);
    kill(pid, SIGKILL);
    stop_pid(pid);
    pid = fork_server(port, pp[1]);
    cr_assert_eq(read_port(pp[0]), port);
    for (int i = 0; i < 3; i++)
        call_ok(port, "/ok", i ? "{}" : NULL, "after the restart");
    stop_pid(pid);
    close(pp[0]);
    close(pp[1]);
}

/* A server that reads a second request on a kept-alive connection and closes it without an
 * answer (what a server closing an idle connection does when our request crosses its FIN): the
 * request is sent again on a new connection, and the call succeeds. */
static struct {
    int lfd;
    atomic_int accepts, requests;
} raw;

static bool read_request(int fd)
{
    char buf[4096];
    size_t n = 0;
    char *end = NULL;
    while (!end) {
        ssize_t k = read(fd, buf + n, sizeof buf - 1 - n);
        if (k <= 0)
            return false;
        n += (size_t)k;
        buf[n] = '\0';
        end = strstr(buf, "\r\n\r\n");
    }
    const char *cl = strcasestr(buf, "\r\nContent-Length:");
    size_t want = cl ? strtoul(cl + 17, NULL, 10) : 0, have = n - (size_t)(end + 4 - buf);
    while (have < want) {
        ssize_t k = read(fd, buf, sizeof buf);
        if (k <= 0)
            return false;
        have += (size_t)k;
    }
    return true;
}

static void *raw_main(void *arg)
{
    (void)arg;
    static const char answer[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 "Content-Length: 11\r\n\r\n" OK_BODY;
    for (;;) {
        int fd = accept(raw.lfd, NULL, NULL);
        if (fd < 0)
            return NULL;
        atomic_fetch_add(&raw.accepts, 1);
        for (int k = 0; read_request(fd); k++) {
            atomic_fetch_add(&raw.requests, 1);
            if (k == 1)
                break; /* the second request on a connection: close, no answer */
            if (write(fd, answer, sizeof answer - 1) != (ssize_t)sizeof answer - 1)
                break;
        }
        close(fd);
    }
}

Test(pool, dropped_keepalive_is_retried_on_a_new_connection)
{
    raw.lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    cr_assert_eq(bind(raw.lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(listen(raw.lfd, 8), 0);
    cr_assert_eq(getsockname(raw.lfd, (struct sockaddr *)&sa, &sl), 0);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, raw_main, NULL), 0);
    uint16_t port = ntohs(sa.sin_port);
    call_ok(port, "/ok", "{\"a\":1}", "first");
    call_ok(port, "/ok", "{\"a\":2}", "second, on the kept connection the server drops");
    cr_expect_eq(atomic_load(&raw.accepts), 2);
    cr_expect_eq(atomic_load(&raw.requests), 3, "the second request was sent twice");
    shutdown(raw.lfd, SHUT_RDWR); /* its accept fails */
    kvb__pxy_pool_flush();        /* its read of our kept connection sees the end */
    pthread_join(th, NULL);
    close(raw.lfd);
}

/* ---- Bounds ---------------------------------------------------------------------------------- */

static void *slow_call(void *arg)
{
    res_t *r = arg;
    call_ex(srv.port, "/slow", NULL, 10000, NULL, NULL, NULL, r);
    return NULL;
}

/* More concurrent calls than the pool keeps for an origin: each opens its connection, and only
 * KVB__PXY_POOL_PER_ORIGIN of them stay idle afterwards. */
Test(pool, idle_connections_are_bounded)
{
    enum { N = KVB__PXY_POOL_PER_ORIGIN + 8 };
    pthread_t th[N];
    static res_t r[N];
    for (int i = 0; i < N; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, slow_call, &r[i]), 0);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) {
        cr_expect_eq(r[i].rc, 0, "call %d: %s", i, r[i].rs.error);
        free(r[i].rs.body);
    }
    cr_expect_eq(atomic_load(&srv.conns), N);
    cr_expect_eq(kvb__pxy_pool_idle(), KVB__PXY_POOL_PER_ORIGIN);
    /* Sequential calls now reuse those connections. */
    for (int i = 0; i < 5; i++)
        call_ok(srv.port, "/ok", NULL, "after the burst");
    cr_expect_eq(atomic_load(&srv.conns), N);
}

/* ---- Through the proxy, real instances ------------------------------------------------------- */

/* The prefill instance is killed and started again on its port between two requests: the proxy's
 * pooled connection to it is dead, and the next request must not fail for it. */
Test(pool, proxy_survives_instance_restart, .timeout = 60)
{
    need_serve();
    inst_t pre, dec;
    serve(&pre, "prefill", "tiny-gqa", 1, "pull");
    serve(&dec, "decode", "tiny-gqa", 1, "pull");
    kvb_pd_proxy_opts_t o = {.prefill = (const char *const[]){pre.url},
                             .n_prefill = 1,
                             .decode = (const char *const[]){dec.url},
                             .n_decode = 1,
                             .kv_mode = KVB_PD_KV_PULL,
                             .timeout_ms = 20000};
    kvb_pd_proxy_t *px;
    char why[256], px_url[64];
    cr_assert_eq(kvb_pd_proxy_start(&o, &px, why, sizeof why), 0, "proxy: %s", why);
    snprintf(px_url, sizeof px_url, "http://127.0.0.1:%u", (unsigned)kvb_pd_proxy_port(px));
    const char *body = "{\"prompt\": \"the quick brown fox\", \"max_tokens\": 4}";
    for (int i = 0; i < 3; i++) {
        kvb_pd_completion_t c;
        kvb_pd_complete(px_url, body, 20000, &c);
        cr_expect(c.ok, "before: %ld %s", c.status, c.error);
        kvb_pd_completion_free(&c);
    }
    /* Kept: one connection to each instance, and the client's to the proxy. */
    cr_expect_eq(kvb__pxy_pool_idle(), 3);
    kill(pre.pid, SIGKILL);
    stop_pid(pre.pid);
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)pre.port);
    serve_with(&pre, "prefill", "tiny-gqa", 1, "pull", (const char *const[]){"--port", port, NULL});
    for (int i = 0; i < 3; i++) {
        kvb_pd_completion_t c;
        kvb_pd_complete(px_url, body, 20000, &c);
        cr_expect(c.ok, "after the restart, request %d: %ld %s", i, c.status, c.error);
        kvb_pd_completion_free(&c);
    }
    kvb_pd_proxy_stop(px);
}
