/* SPDX-License-Identifier: Apache-2.0 */
/* One libcurl call with a deadline and a cancel flag: how the proxy talks to instances and how
 * its tools talk to the proxy. One easy handle per call keeps calls independent across threads. */
#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/clock.h"
#include "common/checked.h"
#include "pd/proxy_internal.h"

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

static void setup(call_t *c, struct curl_slist **hdrs, char *errbuf)
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
    if (rq->body) {
        *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
        curl_easy_setopt(c->h, CURLOPT_HTTPHEADER, *hdrs);
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDS, rq->body);
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(rq->body));
    }
}

int kvb__pxy_call(const kvb__pxy_req_t *rq, kvb__pxy_res_t *rs)
{
    memset(rs, 0, sizeof *rs);
    if (kvb_pd_client_init()) {
        kvb__pxy_fmt(rs->error, sizeof rs->error, "libcurl initialization failed");
        return -1;
    }
    call_t c = {.rq = rq, .rs = rs, .h = curl_easy_init()};
    if (!c.h) {
        kvb__pxy_fmt(rs->error, sizeof rs->error, "out of memory (curl handle)");
        return -1;
    }
    struct curl_slist *hdrs = NULL;
    char errbuf[CURL_ERROR_SIZE] = "";
    setup(&c, &hdrs, errbuf);
    CURLcode rc = curl_easy_perform(c.h);
    if (!c.checked)
        check_head(&c);
    curl_easy_cleanup(c.h);
    curl_slist_free_all(hdrs);
    if (rc == CURLE_OK)
        return 0;
    rs->timed_out = rc == CURLE_OPERATION_TIMEDOUT;
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
