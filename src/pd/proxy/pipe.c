/* SPDX-License-Identifier: Apache-2.0 */
/* The streaming relay's plumbing: a server-sent events splitter (bytes in, events out, no I/O)
 * and the bounded pipe that carries a stream from the libcurl thread to the libmicrohttpd one. */
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/clock.h"
#include "pd/proxy/internal.h"

/* ---- Server-sent events ---------------------------------------------------------------------- */

void kvb__pxy_sse_init(kvb__pxy_sse_t *s, kvb__pxy_sse_event_cb on_event, void *user)
{
    memset(s, 0, sizeof *s);
    s->on_event = on_event;
    s->user = user;
}

void kvb__pxy_sse_free(kvb__pxy_sse_t *s)
{
    free(s->buf);
    s->buf = NULL;
    s->len = s->cap = 0;
}

/* Joins the "data:" lines of one event (ev[0..n), without its blank line) into `out`, which has
 * room for n + 1 bytes; other fields (event:, id:, comments) are ignored. */
static size_t event_data(const char *ev, size_t n, char *out)
{
    size_t k = 0, i = 0;
    bool any = false;
    while (i < n) {
        const char *nl = memchr(ev + i, '\n', n - i);
        size_t end = nl ? (size_t)(nl - ev) : n, len = end - i;
        if (len >= 5 && !memcmp(ev + i, "data:", 5)) {
            size_t off = i + 5 + (len > 5 && ev[i + 5] == ' ');
            if (any)
                out[k++] = '\n';
            memcpy(out + k, ev + off, end - off);
            k += end - off;
            any = true;
        }
        i = end + 1;
    }
    out[k] = '\0';
    return any ? k : SIZE_MAX;
}

/* Hands every complete event in the buffer to the callback and keeps the rest. */
static bool drain(kvb__pxy_sse_t *s)
{
    size_t start = 0;
    for (;;) {
        char *end = s->len - start >= 2 ? memmem(s->buf + start, s->len - start, "\n\n", 2) : NULL;
        if (!end)
            break;
        size_t n = (size_t)(end - (s->buf + start));
        char *data = malloc(n + 1);
        if (!data)
            return false;
        size_t dl = event_data(s->buf + start, n, data);
        bool ok = dl == SIZE_MAX || s->on_event(data, dl, s->user);
        free(data);
        if (!ok)
            return false;
        start += n + 2;
    }
    memmove(s->buf, s->buf + start, s->len - start);
    s->len -= start;
    return true;
}

bool kvb__pxy_sse_feed(kvb__pxy_sse_t *s, const char *data, size_t len)
{
    size_t need;
    if (kvb__add_size(s->len, len, &need) || need > KVB__PXY_EVENT_MAX + 2)
        return false;
    if (need > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < need)
            cap *= 2;
        char *nb = realloc(s->buf, cap);
        if (!nb)
            return false;
        s->buf = nb;
        s->cap = cap;
    }
    memcpy(s->buf + s->len, data, len);
    s->len += len;
    return drain(s);
}

/* ---- Bounded pipe ---------------------------------------------------------------------------- */

int kvb__pxy_pipe_init(kvb__pxy_pipe_t *p, size_t cap)
{
    memset(p, 0, sizeof *p);
    p->buf = malloc(cap);
    if (!p->buf)
        return -1;
    p->cap = cap;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    /* Deadlines are CLOCK_MONOTONIC: a wall-clock step must not stretch a wait. */
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&p->mu, NULL);
    return 0;
}

void kvb__pxy_pipe_destroy(kvb__pxy_pipe_t *p)
{
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->buf);
    p->buf = NULL;
}

/* Waits on the pipe's condition at most 100 ms, so that cancel flags (set without the lock by
 * whoever stops the proxy) are seen soon. */
static void wait_slice(kvb__pxy_pipe_t *p, uint64_t deadline_ns)
{
    uint64_t until = kvb__now_ns() + 100000000ull;
    if (until > deadline_ns)
        until = deadline_ns;
    struct timespec ts = kvb__timespec_of(until);
    pthread_cond_timedwait(&p->cv, &p->mu, &ts);
}

int kvb__pxy_pipe_write(kvb__pxy_pipe_t *p, const char *data, size_t len, uint64_t deadline_ns,
                        const atomic_bool *cancel)
{
    pthread_mutex_lock(&p->mu);
    while (len) {
        if (p->detached || p->closed || (cancel && atomic_load(cancel)) ||
            kvb__now_ns() >= deadline_ns)
            break;
        if (p->len == p->cap) {
            wait_slice(p, deadline_ns);
            continue;
        }
        size_t tail = (p->head + p->len) % p->cap;
        size_t room = p->cap - p->len, run = p->cap - tail;
        size_t n = len < room ? len : room;
        if (n > run)
            n = run;
        memcpy(p->buf + tail, data, n);
        p->len += n;
        data += n;
        len -= n;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return len ? -1 : 0;
}

ssize_t kvb__pxy_pipe_read(kvb__pxy_pipe_t *p, char *out, size_t max, const atomic_bool *cancel)
{
    pthread_mutex_lock(&p->mu);
    ssize_t got = -1;
    for (;;) {
        if (p->len) {
            size_t run = p->cap - p->head, n = p->len < max ? p->len : max;
            if (n > run)
                n = run;
            memcpy(out, p->buf + p->head, n);
            p->head = (p->head + n) % p->cap;
            p->len -= n;
            got = (ssize_t)n;
            pthread_cond_broadcast(&p->cv);
            break;
        }
        if (p->closed) {
            got = 0;
            break;
        }
        if (cancel && atomic_load(cancel))
            break;
        wait_slice(p, UINT64_MAX);
    }
    pthread_mutex_unlock(&p->mu);
    return got;
}

void kvb__pxy_pipe_close(kvb__pxy_pipe_t *p)
{
    pthread_mutex_lock(&p->mu);
    p->closed = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void kvb__pxy_pipe_detach(kvb__pxy_pipe_t *p)
{
    pthread_mutex_lock(&p->mu);
    p->detached = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}
