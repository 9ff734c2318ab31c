/* SPDX-License-Identifier: Apache-2.0 */
/* The libcurl call behind the etcd and HTTP backends: one reusable handle per client (its
 * connection stays open between calls), a deadline on every request (within the client call's
 * timeout), and a bounded answer. */
#include <curl/curl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "meta/internal.h"

typedef struct {
    char *buf;
    size_t len, cap, max;
    bool too_big;
} sink_t;

static size_t on_data(char *data, size_t size, size_t nmemb, void *user)
{
    sink_t *s = user;
    size_t n = size * nmemb;
    if (n > s->max - s->len) {
        s->too_big = true;
        return 0; /* aborts the transfer */
    }
    if (s->len + n + 1 > s->cap) {
        size_t ncap = s->cap ? s->cap : 1024;
        while (ncap < s->len + n + 1)
            ncap *= 2;
        char *nb = realloc(s->buf, ncap);
        if (!nb)
            return 0;
        s->buf = nb;
        s->cap = ncap;
    }
    memcpy(s->buf + s->len, data, n);
    s->len += n;
    s->buf[s->len] = '\0';
    return n;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

int kvb__meta_http(kvb_meta_t *m, void **handle, uint32_t ms, const char *method, const char *url,
                   const char *body, size_t len, long *status, char **resp, size_t *resp_len,
                   size_t resp_max)
{
    pthread_once(&curl_once, curl_init_once);
    if (ms == 0 && (ms = kvb__meta_left_ms(m)) == 0)
        return KVB_ERR_META_UNREACHABLE;
    CURL *c = *handle;
    if (!c && !(c = *handle = curl_easy_init()))
        return KVB_ERR_NOMEM;
    curl_easy_reset(c);
    sink_t s = {.max = resp_max};
    char errbuf[CURL_ERROR_SIZE] = "";
    struct curl_slist *hdrs = curl_slist_append(NULL, "Expect:");
    if (body)
        hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)ms);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)ms);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(c, CURLOPT_PROXY, ""); /* never through an environment proxy */
    if (!strcmp(method, "GET"))
        curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    }
    CURLcode cc = curl_easy_perform(c);
    curl_slist_free_all(hdrs);
    if (cc != CURLE_OK) {
        free(s.buf);
        if (s.too_big) {
            KVB_WARN("metadata store %s: answer to %s %s over %zu bytes", m->uri, method, url,
                     resp_max);
            return KVB_ERR_TOO_LARGE;
        }
        KVB_DEBUG("%s %s: %s", method, url, errbuf[0] ? errbuf : curl_easy_strerror(cc));
        kvb__meta_note(m, KVB_ERR_META_UNREACHABLE, errbuf[0] ? errbuf : curl_easy_strerror(cc));
        return KVB_ERR_META_UNREACHABLE;
    }
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    if (!s.buf && !(s.buf = calloc(1, 1)))
        return KVB_ERR_NOMEM;
    *resp = s.buf;
    *resp_len = s.len;
    return KVB_OK;
}

void kvb__meta_http_free(void *handle)
{
    if (handle)
        curl_easy_cleanup(handle);
}
