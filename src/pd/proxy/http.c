/* SPDX-License-Identifier: Apache-2.0 */
/* One libcurl call with a deadline and a cancel flag: how the proxy talks to instances and how
 * its tools talk to the proxy. Each call runs on an easy handle of its own for its duration, taken
 * from a pool of idle handles kept per origin, so that calls to the same instance reuse one
 * keep-alive connection (see "The pool" below). */
#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "common/clock.h"
#include "common/checked.h"
#include "pd/proxy/internal.h"

void kvb__pxy_fmt(char *buf, size_t cap, const char *fmt, ...)
{
    if (!cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
    if (n < 0)
        buf[0] = '\0';
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static int curl_init_rc = -1;

static void curl_init_once(void)
{
    curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? 0 : -1;
}

int kvb_pd_client_init(void)
{
    pthread_once(&curl_once, curl_init_once);
    return curl_init_rc;
}

/* ---- The pool -------------------------------------------------------------------------------
 *
 * Idle easy handles, kept per origin (scheme://host:port), each with at most one connection in its
 * own cache: a call takes the most recently used handle of its URL's origin (or a new one) and
 * puts it back when done, so N sequential calls to an instance share one keep-alive connection and
 * C concurrent ones settle on C (tests/pd/test_pool.c counts them at the server).
 *
 * Why this and not curl_share with CURL_LOCK_DATA_CONNECT:
 * - libcurl does not support a shared connection cache used by concurrent threads (7.88's
 *   KNOWN_BUGS 11.11 "A shared connection cache is not thread-safe", curl issue #4915; the
 *   CURLSHOPT_SHARE man page says so to this day), and the proxy calls from many threads;
 * - measured on a 2-core VM (libcurl 7.88.1, a libmicrohttpd thread-per-connection server on
 *   loopback, small POSTs, two runs each): a fresh handle per call about 7.5k calls/s with one
 *   thread, 7.0k with four; fresh handles on a share (CONNECT + DNS) 14k and 21k (a handle and
 *   its internal multi made and freed per call, and the share's locks); a reused handle 21k and
 *   46-55k.
 *
 * Bounds: KVB__PXY_POOL_MAX idle handles in all, KVB__PXY_POOL_PER_ORIGIN to one origin (the
 * oldest goes first), and none idle longer than KVB__PXY_POOL_IDLE_S (checked whenever the pool is
 * used, and by libcurl's own CURLOPT_MAXAGE_CONN) - under an instance's default idle limit
 * (KVB_PD_SERVER_IDLE_S), so that we usually close an idle connection before the server does.
 * Idle connections keep the liveness probes of liveness_sockopt (one tiny packet a second each).
 *
 * Reuse is safe across an instance's death and restart, or a server closing an idle connection
 * first: libcurl checks an idle connection before reusing it (a peer's FIN or RST makes it dead:
 * it opens a new one), and a request that a reused connection drops before any answer byte is sent
 * again on a fresh connection (Curl_retry_request). A call that ends abnormally (canceled,
 * deadline, sink refused, a broken answer) leaves no half-read connection behind: libcurl closes
 * the connection of a transfer that ended in error (multi.c: "Transfer returned error",
 * "Disconnected with pending data", multi_done with premature set; confirmed: with such handles
 * pooled anyway, test_pool.c's abnormal_end_is_not_reused still sees a new connection after
 * each), and we drop such a handle altogether rather than pool it. */

#define POOL_ORIGIN_MAX 256

typedef struct {
    CURL *h;
    uint64_t idle_since;          /* CLOCK_MONOTONIC ns it was put back */
    char origin[POOL_ORIGIN_MAX]; /* "": not pooled (no origin found, or too long) */
} pooled_t;

static struct {
    pthread_mutex_t mu;
    pooled_t *v[KVB__PXY_POOL_MAX]; /* idle, oldest first */
    size_t n;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* "scheme://authority" of a URL: everything up to the path, query or fragment. */
static bool origin_of(const char *url, char *out, size_t cap)
{
    const char *sep = strstr(url, "://");
    if (!sep)
        return false;
    size_t len = (size_t)(sep + 3 - url) + strcspn(sep + 3, "/?#");
    if (len >= cap)
        return false;
    memcpy(out, url, len);
    out[len] = '\0';
    return true;
}

static void pooled_free(pooled_t *p)
{
    if (!p)
        return;
    curl_easy_cleanup(p->h); /* closes its connection, if any */
    free(p);
}

static void pooled_free_all(pooled_t **v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        pooled_free(v[i]);
}

static pooled_t *pool_remove_locked(size_t i)
{
    pooled_t *p = pool.v[i];
    memmove(pool.v + i, pool.v + i + 1, (pool.n - i - 1) * sizeof *pool.v);
    pool.n--;
    return p;
}

/* Moves the handles idle longer than KVB__PXY_POOL_IDLE_S into out[] (freed by the caller,
 * unlocked). */
static size_t pool_expire_locked(uint64_t now, pooled_t **out)
{
    /* (Not now - since: a handle put back by another thread after we read the clock is newer.) */
    size_t k = 0;
    while (k < pool.n &&
           pool.v[k]->idle_since + (uint64_t)KVB__PXY_POOL_IDLE_S * 1000000000ull < now)
        k++;
    memcpy(out, pool.v, k * sizeof *out);
    memmove(pool.v, pool.v + k, (pool.n - k) * sizeof *pool.v);
    pool.n -= k;
    return k;
}

/* The most recently used idle handle of the URL's origin, or a new one; NULL without memory. */
static pooled_t *pool_take(const char *url)
{
    char origin[POOL_ORIGIN_MAX];
    bool keyed = origin_of(url, origin, sizeof origin);
    pooled_t *p = NULL, *gone[KVB__PXY_POOL_MAX];
    pthread_mutex_lock(&pool.mu);
    size_t n_gone = pool_expire_locked(kvb__now_ns(), gone);
    for (size_t i = pool.n; keyed && i-- > 0;)
        if (!strcmp(pool.v[i]->origin, origin)) {
            p = pool_remove_locked(i);
            break;
        }
    pthread_mutex_unlock(&pool.mu);
    pooled_free_all(gone, n_gone);
    if (p)
        return p;
    p = calloc(1, sizeof *p);
    if (!p || !(p->h = curl_easy_init())) {
        free(p);
        return NULL;
    }
    if (keyed)
        memcpy(p->origin, origin, strlen(origin) + 1);
    return p;
}

/* Puts a handle back after a call that ended well (`reusable`), else frees it. */
static void pool_put(pooled_t *p, bool reusable)
{
    if (!reusable || !p->origin[0]) {
        pooled_free(p);
        return;
    }
    curl_easy_reset(p->h); /* drops the call's options and pointers; keeps the connection */
    pooled_t *gone[KVB__PXY_POOL_MAX + 1];
    uint64_t now = kvb__now_ns();
    p->idle_since = now;
    pthread_mutex_lock(&pool.mu);
    size_t n_gone = pool_expire_locked(now, gone), same = 0, oldest = 0;
    for (size_t i = 0; i < pool.n; i++)
        if (!strcmp(pool.v[i]->origin, p->origin) && same++ == 0)
            oldest = i;
    if (same >= KVB__PXY_POOL_PER_ORIGIN)
        gone[n_gone++] = pool_remove_locked(oldest);
    else if (pool.n == KVB__PXY_POOL_MAX)
        gone[n_gone++] = pool_remove_locked(0);
    pool.v[pool.n++] = p;
    pthread_mutex_unlock(&pool.mu);
    pooled_free_all(gone, n_gone);
}

size_t kvb__pxy_pool_idle(void)
{
    pthread_mutex_lock(&pool.mu);
    size_t n = pool.n;
    pthread_mutex_unlock(&pool.mu);
    return n;
}

void kvb__pxy_pool_flush(void)
{
    pooled_t *gone[KVB__PXY_POOL_MAX];
    pthread_mutex_lock(&pool.mu);
    size_t n = pool.n;
    memcpy(gone, pool.v, n * sizeof *gone);
    pool.n = 0;
    pthread_mutex_unlock(&pool.mu);
    pooled_free_all(gone, n);
}

/* ---- One call -------------------------------------------------------------------------------- */

typedef struct {
    const kvb__pxy_req_t *rq;
    kvb__pxy_res_t *rs;
    CURL *h;
    size_t cap;
    bool checked; /* status and content type looked at */
    bool to_sink;
} call_t;

static bool collect(call_t *c, const char *data, size_t n)
{
    size_t need;
    if (kvb__add_size(c->rs->len, n + 1, &need) || need > KVB__PXY_BODY_MAX)
        return false;
    if (need > c->cap) {
        size_t cap = c->cap ? c->cap : 4096;
        while (cap < need)
            cap *= 2;
        char *nb = realloc(c->rs->body, cap);
        if (!nb)
            return false;
        c->rs->body = nb;
        c->cap = cap;
    }
    memcpy(c->rs->body + c->rs->len, data, n);
    c->rs->len += n;
    c->rs->body[c->rs->len] = '\0';
    return true;
}

/* The first body bytes decide where the rest goes: a 2xx answer to the sink (if any), anything
 * else into the body, so that an error's JSON is always there to read. */
static void check_head(call_t *c)
{
    long st = 0;
    char *ct = NULL;
    curl_easy_getinfo(c->h, CURLINFO_RESPONSE_CODE, &st);
    curl_easy_getinfo(c->h, CURLINFO_CONTENT_TYPE, &ct);
    c->rs->status = st;
    c->rs->content_sse = ct && !strncasecmp(ct, "text/event-stream", 17);
    c->to_sink = c->rq->sink && st >= 200 && st < 300;
    c->checked = true;
}

static bool canceled(const kvb__pxy_req_t *rq)
{
    return (rq->cancel && atomic_load(rq->cancel)) || (rq->cancel2 && atomic_load(rq->cancel2));
}

static size_t on_write(char *data, size_t size, size_t nmemb, void *user)
{
    call_t *c = user;
    size_t n = size * nmemb;
    if (!c->checked)
        check_head(c);
    if (canceled(c->rq)) {
        c->rs->canceled = true;
        return 0;
    }
    if (c->to_sink) {
        if (!c->rq->sink(data, n, c->rq->user)) {
            c->rs->canceled = true;
            return 0;
        }
        return n;
    }
    return collect(c, data, n) ? n : 0;
}

/* Polled by libcurl about once a second and on every transfer event: how a stopping proxy gets
 * its upstream calls to end now rather than at their deadlines. */
static int on_progress(void *user, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    (void)dt, (void)dn, (void)ut, (void)un;
    call_t *c = user;
    if (canceled(c->rq)) {
        c->rs->canceled = true;
        return 1;
    }
    return 0;
}

/* An instance's liveness, as the engines judge their peers' (5 s): TCP keepalive probes after
 * 1 s of silence, 1 s apart, 3 unanswered and the connection fails; TCP_USER_TIMEOUT bounds
 * unacknowledged data the same way. A link cut or a host gone mid-call thus ends the call within
 * about 5 s instead of at the request's deadline; a busy but live instance's kernel still answers
 * the probes, so a long generation is never cut short. */
static int liveness_sockopt(void *user, curl_socket_t fd, curlsocktype purpose)
{
    (void)user;
    if (purpose != CURLSOCKTYPE_IPCXN)
        return CURL_SOCKOPT_OK;
    int on = 1, idle = 1, intvl = 1, cnt = 3;
    unsigned user_timeout_ms = 5000;
    /* Best effort: a socket that refuses these is still a working connection. */
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
    return CURL_SOCKOPT_OK;
}

/* Sockets that a child process does not inherit: a pooled connection lives on between calls,
 * and one inherited by a spawned process (a test's or a tool's instance, say) would keep the
 * connection, and the server's thread for it, open after we close ours. */
static curl_socket_t open_cloexec(void *user, curlsocktype purpose, struct curl_sockaddr *a)
{
    (void)user, (void)purpose;
    return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

/* The X-Kvb-Auth line of a call to rq->url (its path: what follows scheme://host[:port]). */
static int sign(const kvb__pxy_req_t *rq, struct curl_slist **hdrs)
{
    const char *host = strstr(rq->url, "://"), *path = host ? strchr(host + 3, '/') : NULL;
    char line[KVB_PD_AUTH_LINE_MAX];
    size_t len = rq->body ? strlen(rq->body) : 0;
    if (kvb__pd_auth_sign(rq->auth, rq->body ? "POST" : "GET", path ? path : "/", rq->body, len,
                          line))
        return -1;
    if (!line[0]) /* no secret: nothing to sign with */
        return 0;
    struct curl_slist *h = curl_slist_append(*hdrs, line);
    if (!h)
        return -1;
    *hdrs = h;
    return 0;
}

static int setup(call_t *c, struct curl_slist **hdrs, char *errbuf)
{
    const kvb__pxy_req_t *rq = c->rq;
    int left = kvb__ms_left(rq->deadline_ns);
    long ms = left <= 0 ? 1 : left;
    curl_easy_setopt(c->h, CURLOPT_URL, rq->url);
    curl_easy_setopt(c->h, CURLOPT_NOSIGNAL, 1L); /* threads: no SIGALRM for DNS timeouts */
    curl_easy_setopt(c->h, CURLOPT_TIMEOUT_MS, ms);
    curl_easy_setopt(c->h, CURLOPT_CONNECTTIMEOUT_MS, ms < 5000 ? ms : 5000L);
    curl_easy_setopt(c->h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(c->h, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(c->h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c->h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c->h, CURLOPT_XFERINFODATA, c);
    curl_easy_setopt(c->h, CURLOPT_ERRORBUFFER, errbuf);
    /* Loopback peers: Nagle would only add latency to small streamed events. */
    curl_easy_setopt(c->h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c->h, CURLOPT_SOCKOPTFUNCTION, liveness_sockopt);
    curl_easy_setopt(c->h, CURLOPT_OPENSOCKETFUNCTION, open_cloexec);
    /* Pooled handles (see the pool): one connection each, none reused after KVB__PXY_POOL_IDLE_S
     * idle. */
    curl_easy_setopt(c->h, CURLOPT_MAXCONNECTS, 1L);
    curl_easy_setopt(c->h, CURLOPT_MAXAGE_CONN, (long)KVB__PXY_POOL_IDLE_S);
    if (rq->body) {
        if (!(*hdrs = curl_slist_append(NULL, "Content-Type: application/json")))
            return -1;
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDS, rq->body);
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(rq->body));
    }
    if (rq->auth && sign(rq, hdrs))
        return -1;
    if (rq->bearer) { /* checked in kvb__pxy_call */
        char line[KVB_PD_API_KEY_MAX + 32];
        snprintf(line, sizeof line, "Authorization: Bearer %s", rq->bearer);
        struct curl_slist *h = curl_slist_append(*hdrs, line);
        if (!h)
            return -1;
        *hdrs = h;
    }
    curl_easy_setopt(c->h, CURLOPT_HTTPHEADER, *hdrs);
    return 0;
}

int kvb__pxy_call(const kvb__pxy_req_t *rq, kvb__pxy_res_t *rs)
{
    memset(rs, 0, sizeof *rs);
    if (rq->bearer &&
        !kvb__pd_api_key_valid(rq->bearer, strnlen(rq->bearer, KVB_PD_API_KEY_MAX + 1))) {
        kvb__pxy_fmt(rs->error, sizeof rs->error,
                     "the API key must be 1..%u printable characters without spaces",
                     KVB_PD_API_KEY_MAX);
        return -1;
    }
    if (kvb_pd_client_init()) {
        kvb__pxy_fmt(rs->error, sizeof rs->error, "libcurl initialization failed");
        return -1;
    }
    pooled_t *p = pool_take(rq->url);
    if (!p) {
        kvb__pxy_fmt(rs->error, sizeof rs->error, "out of memory (curl handle)");
        return -1;
    }
    call_t c = {.rq = rq, .rs = rs, .h = p->h};
    struct curl_slist *hdrs = NULL;
    char errbuf[CURL_ERROR_SIZE] = "";
    if (setup(&c, &hdrs, errbuf)) {
        pool_put(p, false);
        curl_slist_free_all(hdrs);
        kvb__pxy_fmt(rs->error, sizeof rs->error, "cannot sign or set up the call");
        return -1;
    }
    CURLcode rc = curl_easy_perform(c.h);
    if (!c.checked)
        check_head(&c);
    /* Only a call that ended well gives its handle (and connection) back to the pool. */
    pool_put(p, rc == CURLE_OK && !rs->canceled);
    curl_slist_free_all(hdrs); /* after the handle let go of it */
    if (rc == CURLE_OK)
        return 0;
    rs->timed_out = rc == CURLE_OPERATION_TIMEDOUT;
    rs->unreached = rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST;
    if (rs->canceled)
        kvb__pxy_fmt(rs->error, sizeof rs->error, "canceled");
    else
        kvb__pxy_fmt(rs->error, sizeof rs->error, "%s",
                     errbuf[0] ? errbuf : curl_easy_strerror(rc));
    return -1;
}

long kvb_pd_http(const char *url, const char *body, uint32_t timeout_ms, char **resp, char *error,
                 size_t error_cap)
{
    kvb__pxy_req_t rq = {.url = url, .body = body, .deadline_ns = kvb__deadline_ms(timeout_ms)};
    kvb__pxy_res_t rs;
    int rc = kvb__pxy_call(&rq, &rs);
    if (rc && error)
        kvb__pxy_fmt(error, error_cap, "%s", rs.error);
    else if (error && error_cap)
        error[0] = '\0';
    if (resp)
        *resp = rs.body;
    else
        free(rs.body);
    return rc ? 0 : rs.status;
}
