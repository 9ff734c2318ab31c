/* SPDX-License-Identifier: Apache-2.0 */
/* `kvbridge metadata-server`: the store behind "http://host:port[/prefix]" metadata URIs
 * (src/meta/meta.h) - keys, values and TTLs in memory (src/tools/metastore.c), served over HTTP
 * until SIGINT or SIGTERM. The protocol is written down above route(). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/http.h"
#include "tools/cli.h"
#include "tools/metastore.h"

#define MS_VALUE_MAX    (16u << 20)  /* largest value, bytes (the client's KVB_META_VALUE_MAX) */
#define MS_KEYS_MAX     100000u      /* keys in the store */
#define MS_BYTES_MAX    (1ull << 30) /* bytes of values in the store, all keys together */
#define MS_TTL_MAX_MS   86400000u    /* longest TTL: a day */
#define MS_PREFIX_MAX   256u         /* longest --prefix */
#define MS_CONNS_MAX    256u         /* connections at once (a thread each) */
#define MS_IDLE_TIMEOUT 30u          /* seconds a silent connection is kept */

/* ---- HTTP ------------------------------------------------------------------------------------ */

typedef struct {
    kvb__ms_store_t st;
    struct MHD_Daemon *httpd;
    char prefix[MS_PREFIX_MAX + 1];
    size_t plen;
} msrv_t;

typedef enum { OP_NONE, OP_GET, OP_PUT, OP_DEL, OP_LIST, OP_HEALTH } op_t;

/* One request, from its headers to its answer (libmicrohttpd's con_cls). */
typedef struct {
    op_t op;
    const char *key; /* inside the URL, which libmicrohttpd keeps until the request completes */
    uint64_t ttl_ms;
    bool renew;      /* PUT ...&renew=1 */
    unsigned status; /* an error found in the headers, answered once the body is in */
    const char *allow;
    char err[192];
    kvb__http_body_t body; /* a PUT's value */
    uint64_t dropped;      /* body bytes not kept (of another request, or past an error) */
} req_t;

static void reject(req_t *rq, unsigned status, const char *allow, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void reject(req_t *rq, unsigned status, const char *allow, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rq->err, sizeof rq->err, fmt, ap);
    va_end(ap);
    rq->status = status;
    rq->allow = allow;
}

/* Answers {"error": msg} (msg must be UTF-8: it never echoes request bytes). */
static enum MHD_Result fail(struct MHD_Connection *conn, unsigned status, const char *allow,
                            const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static enum MHD_Result fail(struct MHD_Connection *conn, unsigned status, const char *allow,
                            const char *fmt, ...)
{
    static const char oom[] = "{\"error\":\"out of memory\"}";
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (status >= 500)
        KVB_WARN("metadata server answering %u: %s", status, msg);
    json_t *o = json_pack("{s:s}", "error", msg);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    struct MHD_Response *r =
        s ? MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_COPY)
          : MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
    free(s);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (allow)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(conn, s ? status : 500, r);
    MHD_destroy_response(r);
    return ret;
}

/* The protocol (paths after --prefix; keys percent-decoded by libmicrohttpd):
 *   PUT    /v1/kv/<key>[?ttl_ms=N][&renew=1]  body = value (UTF-8, <= 16 MiB)  -> 204
 *   GET    /v1/kv/<key>             -> 200 raw value, or 404
 *   DELETE /v1/kv/<key>             -> 204, or 404
 *   GET    /v1/list[?prefix=P]      -> 200 {"items":[{"key","value","ttl_ms"}...]} sorted by key
 *   GET    /health                  -> 200 {"status":"ok","keys":N}
 * ttl_ms 0 or absent: never expires; else the key expires N ms after the PUT (N <= a day).
 * renew=1 (an owner keeping its key alive): stored only if the key is absent or holds this same
 * value, else 412 and the key stays as it is - another process took it over. renew=0: a plain PUT.
 * Errors are {"error": "..."}: 400 bad key/TTL/value, 404, 405, 412, 413, 507 store full. */
static void route(const msrv_t *ms, struct MHD_Connection *conn, const char *url,
                  const char *method, req_t *rq)
{
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    const char *p = strncmp(url, ms->prefix, ms->plen) ? NULL : url + ms->plen;
    if (p && (!strcmp(p, "/health") || !strcmp(p, "/v1/list"))) {
        rq->op = p[1] == 'h' ? OP_HEALTH : OP_LIST;
        if (!get)
            reject(rq, 405, "GET, HEAD", "this endpoint takes GET only");
        return;
    }
    if (!p || strncmp(p, "/v1/kv/", 7)) {
        reject(rq, 404, NULL, "no such endpoint (there are /v1/kv/<key>, /v1/list and /health)");
        return;
    }
    rq->op = get                         ? OP_GET
             : !strcmp(method, "PUT")    ? OP_PUT
             : !strcmp(method, "DELETE") ? OP_DEL
                                         : OP_NONE;
    rq->key = p + 7;
    const char *why = kvb__ms_key_problem(rq->key);
    if (rq->op == OP_NONE)
        reject(rq, 405, "GET, HEAD, PUT, DELETE", "/v1/kv/<key> takes GET, PUT or DELETE");
    else if (why)
        reject(rq, 400, NULL, "%s", why);
    if (rq->status)
        return;
    const char *ttl = NULL;
    bool has_ttl = MHD_lookup_connection_value_n(conn, MHD_GET_ARGUMENT_KIND, "ttl_ms", 6, &ttl,
                                                 NULL) == MHD_YES;
    if (rq->op == OP_PUT && has_ttl && kvb__ms_parse_dec(ttl, MS_TTL_MAX_MS, &rq->ttl_ms))
        reject(rq, 400, NULL, "ttl_ms must be a decimal integer from 0 to 86400000");
    const char *renew = NULL;
    uint64_t r = 0;
    bool has_renew = MHD_lookup_connection_value_n(conn, MHD_GET_ARGUMENT_KIND, "renew", 5, &renew,
                                                   NULL) == MHD_YES;
    if (rq->op == OP_PUT && has_renew && kvb__ms_parse_dec(renew, 1, &r))
        reject(rq, 400, NULL, "renew must be 0 or 1");
    rq->renew = r == 1;
}

static void free_value(void *val)
{
    json_decref(val);
}

static enum MHD_Result do_get(msrv_t *ms, struct MHD_Connection *conn, const char *key)
{
    json_t *v = kvb__ms_store_get(&ms->st, key, kvb__now_ns());
    if (!v)
        return fail(conn, 404, NULL, "not found");
    /* The response holds the reference: no copy of a value of up to 16 MiB. */
    struct MHD_Response *r = MHD_create_response_from_buffer_with_free_callback_cls(
        json_string_length(v), (void *)json_string_value(v), free_value, v);
    if (!r) {
        json_decref(v);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/octet-stream");
    enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result no_content(struct MHD_Connection *conn)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
    if (!r)
        return MHD_NO;
    enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_NO_CONTENT, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result do_put(msrv_t *ms, struct MHD_Connection *conn, req_t *rq)
{
    const char *data = rq->body.data ? rq->body.data : "";
    if (!kvb__ms_utf8_valid((const unsigned char *)data, rq->body.len))
        return fail(conn, 400, NULL,
                    "the value is not valid UTF-8 (/v1/list returns values as JSON strings)");
    json_t *v = json_stringn_nocheck(data, rq->body.len);
    kvb__http_body_free(&rq->body);
    if (!v)
        return fail(conn, 500, NULL, "out of memory");
    uint64_t now = kvb__now_ns();
    uint64_t expires = rq->ttl_ms ? now + rq->ttl_ms * 1000000ull : UINT64_MAX;
    switch (kvb__ms_store_put(&ms->st, rq->key, v, expires, rq->renew, now)) {
    case KVB__MS_PUT_OK:
        return no_content(conn);
    case KVB__MS_PUT_TAKEN:
        return fail(conn, 412, NULL, "renew=1: the key holds another value");
    case KVB__MS_PUT_FULL_KEYS:
        return fail(conn, 507, NULL, "store full: %zu keys already", ms->st.max_keys);
    case KVB__MS_PUT_FULL_BYTES:
        return fail(conn, 507, NULL, "store full: values would take over %llu bytes",
                    (unsigned long long)MS_BYTES_MAX);
    default:
        return fail(conn, 500, NULL, "out of memory");
    }
}

static enum MHD_Result do_list(msrv_t *ms, struct MHD_Connection *conn)
{
    const char *prefix = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "prefix");
    json_t *items = kvb__ms_store_list(&ms->st, prefix ? prefix : "", kvb__now_ns());
    json_t *o = items ? json_pack("{s:o}", "items", items) : NULL;
    if (!o)
        return fail(conn, 500, NULL, "out of memory");
    return kvb__http_json(conn, MHD_HTTP_OK, o);
}

static enum MHD_Result do_health(msrv_t *ms, struct MHD_Connection *conn)
{
    json_t *o = json_pack("{s:s,s:I}", "status", "ok", "keys",
                          (json_int_t)kvb__ms_store_count(&ms->st, kvb__now_ns()));
    return o ? kvb__http_json(conn, MHD_HTTP_OK, o) : fail(conn, 500, NULL, "out of memory");
}

static enum MHD_Result answer(msrv_t *ms, struct MHD_Connection *conn, req_t *rq)
{
    if (rq->status)
        return fail(conn, rq->status, rq->allow, "%s", rq->err);
    switch (rq->op) {
    case OP_GET:
        return do_get(ms, conn, rq->key);
    case OP_PUT:
        return do_put(ms, conn, rq);
    case OP_DEL:
        return kvb__ms_store_del(&ms->st, rq->key, kvb__now_ns())
                   ? no_content(conn)
                   : fail(conn, 404, NULL, "not found");
    case OP_LIST:
        return do_list(ms, conn);
    case OP_HEALTH:
        return do_health(ms, conn);
    default: /* OP_NONE comes with an error status, answered above */
        return fail(conn, 500, NULL, "request not routed");
    }
}

/* Keeps a PUT's value; drops any other body. A client that goes on sending long past the limit
 * (or past an error) is cut off rather than read forever. */
static enum MHD_Result take(req_t *rq, const char *data, size_t n)
{
    if (rq->op == OP_PUT && !rq->status) {
        kvb__http_body_feed(&rq->body, data, n, MS_VALUE_MAX);
        if (!rq->body.too_large && !rq->body.nomem)
            return MHD_YES;
        /* The value is lost: its memory (up to twice the limit) goes back now, not at the end. */
        if (rq->body.too_large)
            reject(rq, 413, NULL, "value over %u bytes", MS_VALUE_MAX);
        else
            reject(rq, 500, NULL, "out of memory reading the value");
        kvb__http_body_free(&rq->body);
    }
    rq->dropped += n;
    return rq->dropped > MS_VALUE_MAX ? MHD_NO : MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    msrv_t *ms = cls;
    req_t *rq = *con_cls;
    (void)version;
    if (!rq) { /* headers only */
        if (!(rq = calloc(1, sizeof *rq)))
            return MHD_NO;
        *con_cls = rq;
        route(ms, conn, url, method, rq);
        const char *cl =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        /* Refused before the body is sent: a client that asked "Expect: 100-continue" (curl
         * does for large bodies) never sends it. Other errors wait for the body, so that the
         * connection stays usable and no unread data turns the close into a reset. */
        if (cl && strtoull(cl, NULL, 10) > MS_VALUE_MAX)
            return fail(conn, 413, NULL, "value over %u bytes", MS_VALUE_MAX);
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        return take(rq, upload_data, n);
    }
    return answer(ms, conn, rq);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)conn, (void)toe;
    req_t *rq = *con_cls;
    if (rq) {
        kvb__http_body_free(&rq->body);
        free(rq);
        *con_cls = NULL;
    }
}

static int hexval(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* Percent-decodes s in place like libmicrohttpd's own decoder, except that "%00" becomes 0x7f:
 * a NUL would cut the C string handed to on_request ("a%00b" would be the key "a"), while 0x7f
 * is refused in keys and, in a list prefix, matches no key - as a NUL would. */
static size_t unescape(void *cls, struct MHD_Connection *conn, char *s)
{
    (void)cls, (void)conn;
    char *w = s;
    for (const char *r = s; *r;) {
        int hi, lo;
        if (r[0] == '%' && (hi = hexval(r[1])) >= 0 && (lo = hexval(r[2])) >= 0) {
            int c = hi << 4 | lo;
            *w++ = c ? (char)c : 0x7f;
            r += 3;
        } else {
            *w++ = *r++;
        }
    }
    *w = '\0';
    return (size_t)(w - s);
}

/* ---- The command ----------------------------------------------------------------------------- */

typedef struct {
    const char *bind, *prefix;
    uint16_t port;
    struct sockaddr_storage sa;
} args_t;

static void usage(FILE *f)
{
    fprintf(f, "usage: kvbridge metadata-server --port P [--bind ADDR] [--prefix /PATH]\n\n"
               "Serves the key-value store of \"http://ADDR:P[/PATH]\" metadata URIs:\n"
               "  PUT|GET|DELETE /PATH/v1/kv/<key>[?ttl_ms=N][&renew=1],\n"
               "  GET /PATH/v1/list?prefix=P, GET /PATH/health.\n"
               "--bind defaults to 127.0.0.1; --port 0 takes any free port; --prefix (default\n"
               "none) starts with '/' and does not end with one. Keys live in memory only.\n");
}

static bool prefix_ok(const char *p)
{
    size_t n = strlen(p);
    if (!n)
        return true;
    if (p[0] != '/' || p[n - 1] == '/' || n > MS_PREFIX_MAX)
        return false;
    return strspn(p, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._~-/") == n;
}

static int parse_addr(args_t *a, const char *s)
{
    struct sockaddr_in *in4 = (struct sockaddr_in *)&a->sa;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&a->sa;
    memset(&a->sa, 0, sizeof a->sa);
    if (inet_pton(AF_INET, s, &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        return 0;
    }
    if (inet_pton(AF_INET6, s, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        return 0;
    }
    return -1;
}

static int parse_one(args_t *a, const char *opt, const char *val)
{
    uint64_t v;
    if (!strcmp(opt, "--port")) {
        if (kvb_cli_parse_uint(val, 65535, &v))
            return -1;
        a->port = (uint16_t)v;
        return 0;
    }
    if (!strcmp(opt, "--bind")) {
        a->bind = val;
        return parse_addr(a, val);
    }
    if (!strcmp(opt, "--prefix")) {
        a->prefix = val;
        return prefix_ok(val) ? 0 : -1;
    }
    return -1;
}

static int parse(args_t *a, int argc, char **argv)
{
    bool have_port = false;
    a->bind = "127.0.0.1";
    a->prefix = "";
    parse_addr(a, a->bind);
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        if (i + 1 >= argc || parse_one(a, argv[i], argv[i + 1])) {
            fprintf(stderr, "kvbridge metadata-server: bad or incomplete option '%s'\n", argv[i]);
            return -1;
        }
        have_port |= !strcmp(argv[i], "--port");
    }
    if (!have_port) {
        fprintf(stderr, "kvbridge metadata-server: --port is required\n");
        return -1;
    }
    return 0;
}

static int start(msrv_t *ms, args_t *a)
{
    if (a->sa.ss_family == AF_INET)
        ((struct sockaddr_in *)&a->sa)->sin_port = htons(a->port);
    else
        ((struct sockaddr_in6 *)&a->sa)->sin6_port = htons(a->port);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG;
    if (a->sa.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    /* A thread per connection keeps the handlers simple (they only ever wait for the store's
     * mutex); the limit and the idle timeout bound what clients can hold. */
    ms->httpd = MHD_start_daemon(
        flags, a->port, NULL, NULL, on_request, ms, MHD_OPTION_NOTIFY_COMPLETED, on_completed, ms,
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&a->sa, MHD_OPTION_UNESCAPE_CALLBACK, unescape, ms,
        MHD_OPTION_CONNECTION_LIMIT, MS_CONNS_MAX, MHD_OPTION_CONNECTION_TIMEOUT, MS_IDLE_TIMEOUT,
        MHD_OPTION_END);
    if (!ms->httpd)
        return -1;
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(ms->httpd, MHD_DAEMON_INFO_BIND_PORT);
    if (info && info->port)
        a->port = info->port;
    return 0;
}

/* The key limit: MS_KEYS_MAX, or what the test hook KVB_METASERVER_MAX_KEYS says, so that a
 * full store can be tested in a few requests. */
static size_t keys_limit(void)
{
    const char *max = getenv("KVB_METASERVER_MAX_KEYS");
    uint64_t v;
    if (max && !kvb__ms_parse_dec(max, MS_KEYS_MAX, &v) && v)
        return (size_t)v;
    return MS_KEYS_MAX;
}

int kvb_cmd_metadata_server(int argc, char **argv)
{
    if (kvb_cli_wants_help(argc, argv)) {
        usage(stdout);
        return 0;
    }
    args_t a = {0};
    if (parse(&a, argc, argv)) {
        usage(stderr);
        return 2;
    }
    kvb_cli_block_stop_signals(); /* before any thread exists */
    msrv_t ms = {0};
    snprintf(ms.prefix, sizeof ms.prefix, "%s", a.prefix);
    ms.plen = strlen(ms.prefix);
    kvb__ms_store_init(&ms.st, keys_limit(), MS_BYTES_MAX);
    bool v6 = a.sa.ss_family == AF_INET6;
    if (start(&ms, &a)) {
        fprintf(stderr,
                "kvbridge metadata-server: cannot listen on %s%s%s:%u (in use, or not an "
                "address of this host)\n",
                v6 ? "[" : "", a.bind, v6 ? "]" : "", (unsigned)a.port);
        kvb__ms_store_free(&ms.st);
        return 1;
    }
    printf("metadata server on http://%s%s%s:%u%s\n", v6 ? "[" : "", a.bind, v6 ? "]" : "",
           (unsigned)a.port, ms.prefix);
    fflush(stdout);
    int sig = kvb_cli_wait_stop();
    fprintf(stderr, "kvbridge metadata-server: %s, stopping\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM");
    MHD_stop_daemon(ms.httpd); /* joins the connection threads: no handler runs after this */
    kvb__ms_store_free(&ms.st);
    return 0;
}
