/* SPDX-License-Identifier: Apache-2.0 */
/* The proxy's instance sets: static ones from the command line, and ones discovered in a metadata
 * store (kvbridge/<cluster>/instances/, docs/pd-protocol.md) by a thread that lists the store
 * every interval and adds or drops instances as their keys come and go. Upstreams are reference
 * counted, so that a request goes on with an instance that discovery has just dropped. */
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "pd/proxy/internal.h"

#define STORE_TIMEOUT_MS 2000u       /* one list call; also bounds how long a stop waits for it */
#define VALUE_MAX        (64u << 10) /* an instance's value over this is refused */

/* One line on stderr for an operator (instances coming and going, store outages): shown at the
 * default log level, silenced by KVB_LOG_LEVEL=0; one write(2) so lines never interleave. */
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void say(const char *fmt, ...)
{
    if (kvb__log_level() < KVB_LOG_WARN)
        return;
    char line[1024];
    size_t n = (size_t)snprintf(line, sizeof line, "proxy: ");
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    va_end(ap);
    if (k < 0)
        return;
    n += (size_t)k;
    if (n > sizeof line - 2)
        n = sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, n);
    (void)w; /* nowhere left to report a failing stderr */
}

/* ---- Upstreams ------------------------------------------------------------------------------- */

static int check_url(const char *u, char *reason, size_t cap)
{
    if (!u || strncmp(u, "http://", 7) || strlen(u) < 8 || strlen(u) >= 256) {
        kvb__pxy_fmt(reason, cap, "bad instance URL '%s' (want http://HOST:PORT)", u ? u : "");
        return -1;
    }
    return 0;
}

static kvb__upstream_t *upstream_new(const char *url, bool prefill)
{
    kvb__upstream_t *u = calloc(1, sizeof *u);
    if (!u)
        return NULL;
    atomic_init(&u->refs, 1);
    u->prefill = prefill;
    pthread_mutex_init(&u->mu, NULL);
    kvb__pxy_fmt(u->url, sizeof u->url, "%s", url);
    size_t l = strlen(u->url);
    while (l > 7 && u->url[l - 1] == '/')
        u->url[--l] = '\0';
    return u;
}

void kvb__pxy_upstream_ref(kvb__upstream_t *u)
{
    atomic_fetch_add(&u->refs, 1);
}

void kvb__pxy_upstream_unref(kvb__upstream_t *u)
{
    if (!u || atomic_fetch_sub(&u->refs, 1) != 1)
        return;
    json_decref(u->info);
    pthread_mutex_destroy(&u->mu);
    free(u);
}

/* ---- Sets ------------------------------------------------------------------------------------ */

/* Appends `u`, taking over the caller's reference on success. */
static int set_add(kvb__upset_t *s, kvb__upstream_t *u)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        kvb__upstream_t **v = realloc(s->v, cap * sizeof *v);
        if (!v)
            return KVB_ERR_NOMEM;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = u;
    return KVB_OK;
}

/* Takes entry i out, keeping the order (the caller drops the set's reference). */
static void set_remove(kvb__upset_t *s, size_t i)
{
    memmove(&s->v[i], &s->v[i + 1], (s->n - i - 1) * sizeof *s->v);
    s->n--;
}

static bool set_has_url(const kvb__upset_t *s, const char *url)
{
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->v[i]->url, url))
            return true;
    return false;
}

static void set_free(kvb__upset_t *s)
{
    for (size_t i = 0; i < s->n; i++)
        kvb__pxy_upstream_unref(s->v[i]);
    free(s->v);
    memset(s, 0, sizeof *s);
}

static int add_static(kvb__upset_t *s, const char *const *urls, size_t n, bool prefill,
                      char *reason, size_t cap)
{
    for (size_t i = 0; i < n; i++)
        if (check_url(urls[i], reason, cap))
            return KVB_ERR_INVALID_ARG;
    for (size_t i = 0; i < n; i++) {
        kvb__upstream_t *u = upstream_new(urls[i], prefill);
        if (!u || set_add(s, u)) {
            kvb__pxy_upstream_unref(u);
            kvb__pxy_fmt(reason, cap, "out of memory");
            return KVB_ERR_NOMEM;
        }
    }
    return KVB_OK;
}

static int open_store(kvb_pd_proxy_t *px, const kvb_pd_proxy_opts_t *o, char *reason, size_t cap)
{
    const char *cluster = o->cluster ? o->cluster : KVB_META_CLUSTER;
    if (!kvb_pd_cluster_valid(cluster)) {
        kvb__pxy_fmt(reason, cap, "cluster name '%s' is not 1..63 characters of [A-Za-z0-9._-]",
                     cluster);
        return KVB_ERR_INVALID_ARG;
    }
    /* Opening parses the URI and contacts nothing: a store that is down is the discovery
     * thread's business (it keeps trying), a malformed URI is the caller's mistake. */
    if (kvb__meta_open(o->discover, STORE_TIMEOUT_MS, 0, &px->meta) || !px->meta) {
        kvb__pxy_fmt(reason, cap,
                     "bad discovery URI '%s' (want etcd://HOST:PORT[,HOST:PORT], "
                     "redis://[:PASSWORD@]HOST:PORT[/DB] or http://HOST:PORT[/PREFIX])",
                     o->discover);
        return KVB_ERR_INVALID_ARG;
    }
    kvb__pxy_fmt(px->cluster, sizeof px->cluster, "%s", cluster);
    if (kvb__meta_key(px->prefix, sizeof px->prefix, cluster, "instances", "")) {
        kvb__pxy_fmt(reason, cap, "bad cluster name '%s'", cluster);
        return KVB_ERR_INVALID_ARG;
    }
    px->discover_ms = o->discover_interval_ms ? o->discover_interval_ms : KVB_PD_PROXY_DISCOVER_MS;
    return KVB_OK;
}

int kvb__pxy_sets_init(kvb_pd_proxy_t *px, const kvb_pd_proxy_opts_t *o, char *reason, size_t cap)
{
    bool discover = o->discover && *o->discover;
    for (int p = 1; p >= 0; p--) {
        const char *const *urls = p ? o->prefill : o->decode;
        size_t n = p ? o->n_prefill : o->n_decode;
        if ((!n && !discover) || (n && !urls)) {
            kvb__pxy_fmt(reason, cap, "no %s instance given", p ? "prefill" : "decode");
            return KVB_ERR_INVALID_ARG;
        }
        int rc = add_static(p ? &px->prefill : &px->decode, urls, n, p, reason, cap);
        if (rc)
            return rc;
    }
    return discover ? open_store(px, o, reason, cap) : KVB_OK;
}

kvb__upstream_t *kvb__pxy_pick(kvb_pd_proxy_t *px, bool prefill)
{
    kvb__upset_t *s = prefill ? &px->prefill : &px->decode;
    atomic_uint_fast64_t *rr = prefill ? &px->rr_prefill : &px->rr_decode;
    uint64_t now = kvb__now_ns();
    pthread_mutex_lock(&px->up_mu);
    kvb__upstream_t *u = NULL;
    /* The next in turn that is not marked down; when every one is, the next in turn anyway. */
    for (size_t i = 0; i < s->n && (!u || atomic_load(&u->down_until) > now); i++)
        u = s->v[atomic_fetch_add(rr, 1) % s->n];
    if (u)
        kvb__pxy_upstream_ref(u);
    pthread_mutex_unlock(&px->up_mu);
    return u;
}

void kvb__pxy_upstream_down(kvb__upstream_t *u)
{
    atomic_store(&u->down_until, kvb__now_ns() + KVB__PXY_DOWN_MS * 1000000ull);
    kvb__pxy_info_forget(u, NULL); /* if it comes back it may be another process */
}

void kvb__pxy_info_forget(kvb__upstream_t *u, const struct json_t *info)
{
    pthread_mutex_lock(&u->mu);
    json_t *old = u->info && (!info || u->info == info) ? u->info : NULL;
    if (old)
        u->info = NULL;
    pthread_mutex_unlock(&u->mu);
    json_decref(old);
}

static bool skipped(const kvb__upstream_t *u, const char *const *skip, size_t nskip)
{
    for (size_t i = 0; i < nskip; i++)
        if (!strcmp(u->url, skip[i]))
            return true;
    return false;
}

kvb__upstream_t *kvb__pxy_pick_other(kvb_pd_proxy_t *px, bool prefill, const char *const *skip,
                                     size_t nskip)
{
    kvb__upset_t *s = prefill ? &px->prefill : &px->decode;
    atomic_uint_fast64_t *rr = prefill ? &px->rr_prefill : &px->rr_decode;
    uint64_t now = kvb__now_ns();
    pthread_mutex_lock(&px->up_mu);
    kvb__upstream_t *u = NULL;
    for (int pass = 0; pass < 2 && !u; pass++) /* first those not marked down */
        for (size_t i = 0; !u && i < s->n; i++) {
            u = s->v[atomic_fetch_add(rr, 1) % s->n];
            if (skipped(u, skip, nskip) || (pass == 0 && atomic_load(&u->down_until) > now))
                u = NULL;
        }
    if (u)
        kvb__pxy_upstream_ref(u);
    pthread_mutex_unlock(&px->up_mu);
    return u;
}

kvb__upstream_t **kvb__pxy_snapshot(kvb_pd_proxy_t *px, size_t *n)
{
    pthread_mutex_lock(&px->up_mu);
    size_t total = px->prefill.n + px->decode.n;
    kvb__upstream_t **v = calloc(total ? total : 1, sizeof *v);
    *n = 0;
    for (size_t i = 0; v && i < total; i++) {
        v[i] = i < px->prefill.n ? px->prefill.v[i] : px->decode.v[i - px->prefill.n];
        kvb__pxy_upstream_ref(v[i]);
        *n = i + 1;
    }
    pthread_mutex_unlock(&px->up_mu);
    return v;
}

void kvb__pxy_snapshot_free(kvb__upstream_t **v, size_t n)
{
    for (size_t i = 0; v && i < n; i++)
        kvb__pxy_upstream_unref(v[i]);
    free(v);
}

void kvb__pxy_sets_free(kvb_pd_proxy_t *px)
{
    set_free(&px->prefill);
    set_free(&px->decode);
    kvb__meta_close(px->meta); /* owns no key: deletes nothing */
    px->meta = NULL;
}

/* ---- Store values ---------------------------------------------------------------------------- */

/* A prefill or decode instance as its key's value describes it. */
typedef struct {
    const char *key; /* the list result's */
    char url[256];
    bool prefill;
    char incarnation[KVB__PXY_INCARN_MAX + 1];
} found_t;

/* What is wrong with a parsed value (written into why), or false when it is a registration. */
static bool malformed(json_t *v, char *why, size_t cap)
{
    json_t *ver = json_object_get(v, "kvbridge"), *inc = json_object_get(v, "incarnation");
    const char *role = json_string_value(json_object_get(v, "role"));
    const char *url = json_string_value(json_object_get(v, "url"));
    if (!json_is_object(v))
        kvb__pxy_fmt(why, cap, "not a JSON object");
    else if (!json_is_integer(ver) || json_integer_value(ver) != 1)
        kvb__pxy_fmt(why, cap, "\"kvbridge\" is not 1");
    else if (!role || (strcmp(role, "prefill") && strcmp(role, "decode") && strcmp(role, "both")))
        kvb__pxy_fmt(why, cap, "\"role\" is not prefill, decode or both");
    else if (!url)
        kvb__pxy_fmt(why, cap, "no \"url\"");
    else if (inc && (!json_is_string(inc) || json_string_length(inc) > KVB__PXY_INCARN_MAX))
        kvb__pxy_fmt(why, cap, "\"incarnation\" is not a short string");
    else
        return check_url(url, why, cap) != 0;
    return true;
}

/* Reads one value. Returns 1 for a prefill or decode instance (*f filled but for its key), 0 for
 * a valid registration that is no PD half (role "both"), -1 for a malformed one; `why` says why
 * for 0 and -1. */
static int parse_value(const kvb_meta_kv_t *kv, found_t *f, char *why, size_t cap)
{
    if (kv->len > VALUE_MAX) {
        kvb__pxy_fmt(why, cap, "value over %u bytes", VALUE_MAX);
        return -1;
    }
    json_t *v = json_loadb(kv->value, kv->len, JSON_REJECT_DUPLICATES, NULL);
    int rc = malformed(v, why, cap) ? -1 : 0;
    const char *role = json_string_value(json_object_get(v, "role"));
    if (rc == 0 && !strcmp(role, "both")) {
        kvb__pxy_fmt(why, cap, "role \"both\" is colocated, not a prefill or decode half");
    } else if (rc == 0) {
        const char *inc = json_string_value(json_object_get(v, "incarnation"));
        f->prefill = !strcmp(role, "prefill");
        kvb__pxy_fmt(f->url, sizeof f->url, "%s", json_string_value(json_object_get(v, "url")));
        size_t l = strlen(f->url);
        while (l > 7 && f->url[l - 1] == '/')
            f->url[--l] = '\0';
        kvb__pxy_fmt(f->incarnation, sizeof f->incarnation, "%s", inc ? inc : "");
        rc = 1;
    }
    json_decref(v);
    return rc;
}

/* A key whose value was refused, so that it is logged once rather than every round. */
struct kvb__pxy_noted {
    kvb__pxy_noted_t *next;
    uint64_t hash; /* of the refused value: a new bad value is logged again */
    bool seen;     /* listed in this round */
    char key[];
};

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static void note_refused(kvb_pd_proxy_t *px, const kvb_meta_kv_t *kv, int rc, const char *why)
{
    uint64_t h = fnv1a(kv->value, kv->len);
    kvb__pxy_noted_t *n = px->noted;
    while (n && strcmp(n->key, kv->key))
        n = n->next;
    if (n && n->hash == h) {
        n->seen = true;
        return;
    }
    if (!n && (n = calloc(1, sizeof *n + strlen(kv->key) + 1))) {
        strcpy(n->key, kv->key);
        n->next = px->noted;
        px->noted = n;
    }
    if (n) {
        n->hash = h;
        n->seen = true;
    }
    say("ignoring %s in the store: %s%s", kv->key, rc < 0 ? "malformed: " : "", why);
}

/* Forgets the keys not listed this round (gone, or valid now). */
static void prune_noted(kvb_pd_proxy_t *px)
{
    for (kvb__pxy_noted_t **pp = &px->noted; *pp;) {
        kvb__pxy_noted_t *n = *pp;
        if (!n->seen) {
            *pp = n->next;
            free(n);
            continue;
        }
        n->seen = false;
        pp = &n->next;
    }
}

/* ---- Discovery rounds ------------------------------------------------------------------------ */

static const found_t *find_key(const found_t *f, size_t n, const char *key)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(f[i].key, key))
            return &f[i];
    return NULL;
}

/* Brings one set in line with the store: drops the discovered instances whose key went away or
 * now names another instance (a restart: new incarnation), then adds the new ones. Static
 * entries stay; an instance already there under its URL is not added twice. Called with up_mu. */
static void apply(kvb__upset_t *s, bool prefill, const found_t *f, size_t nf)
{
    const char *role = prefill ? "prefill" : "decode";
    for (size_t i = s->n; i-- > 0;) {
        kvb__upstream_t *u = s->v[i];
        const found_t *m = u->discovered ? find_key(f, nf, u->key) : NULL;
        if (!u->discovered || (m && m->prefill == prefill && !strcmp(m->url, u->url) &&
                               !strcmp(m->incarnation, u->incarnation)))
            continue;
        say("- %s %s (%s)", role, u->url,
            m ? "its key names another instance now" : "gone from the store");
        set_remove(s, i);
        kvb__pxy_upstream_unref(u); /* requests that picked it keep their own references */
    }
    for (size_t k = 0; k < nf; k++) {
        if (f[k].prefill != prefill || set_has_url(s, f[k].url))
            continue;
        kvb__upstream_t *u = upstream_new(f[k].url, prefill);
        if (u) {
            u->discovered = true;
            kvb__pxy_fmt(u->key, sizeof u->key, "%s", f[k].key);
            kvb__pxy_fmt(u->incarnation, sizeof u->incarnation, "%s", f[k].incarnation);
        }
        if (!u || set_add(s, u)) {
            kvb__pxy_upstream_unref(u);
            KVB_WARN("proxy: out of memory adding %s; retrying next round", f[k].url);
            continue;
        }
        say("+ %s %s (discovered)", role, u->url);
    }
}

static size_t known(kvb_pd_proxy_t *px)
{
    pthread_mutex_lock(&px->up_mu);
    size_t n = px->prefill.n + px->decode.n;
    pthread_mutex_unlock(&px->up_mu);
    return n;
}

/* A failed list keeps every instance known: a store outage must not take the whole deployment
 * down with it, and an instance that really died fails its requests on its own. */
static void round_failed(kvb_pd_proxy_t *px, int rc)
{
    atomic_store(&px->store_ok, false);
    if (px->outage_logged)
        return;
    px->outage_logged = true;
    say("metadata store %s %s; keeping %zu known instances", kvb__meta_uri(px->meta),
        rc == KVB_ERR_META_UNREACHABLE ? "unreachable" : kvb_strerror(rc), known(px));
}

static void discover_round(kvb_pd_proxy_t *px)
{
    kvb_meta_kv_t *kvs = NULL;
    size_t n = 0;
    int rc = kvb__meta_list(px->meta, px->prefix, &kvs, &n);
    if (rc == KVB_ERR_NOT_FOUND) { /* nothing under the prefix */
        kvb__meta_kvs_free(kvs, n);
        kvs = NULL;
        n = 0;
        rc = KVB_OK;
    }
    found_t *f = rc == KVB_OK && n ? calloc(n, sizeof *f) : NULL;
    if (rc == KVB_OK && n && !f)
        rc = KVB_ERR_NOMEM;
    if (rc) {
        round_failed(px, rc);
        kvb__meta_kvs_free(kvs, n);
        return;
    }
    if (px->outage_logged)
        say("metadata store %s reachable again", kvb__meta_uri(px->meta));
    px->outage_logged = false;
    atomic_store(&px->store_ok, true);
    size_t nf = 0;
    for (size_t i = 0; i < n; i++) {
        char why[300];
        int r = parse_value(&kvs[i], &f[nf], why, sizeof why);
        if (r == 1)
            f[nf++].key = kvs[i].key;
        else
            note_refused(px, &kvs[i], r, why);
    }
    prune_noted(px);
    pthread_mutex_lock(&px->up_mu);
    apply(&px->prefill, true, f, nf);
    apply(&px->decode, false, f, nf);
    pthread_mutex_unlock(&px->up_mu);
    free(f);
    kvb__meta_kvs_free(kvs, n);
}

static void *discover_main(void *arg)
{
    kvb_pd_proxy_t *px = arg;
    pthread_mutex_lock(&px->disc_mu);
    while (!px->disc_stop) {
        pthread_mutex_unlock(&px->disc_mu);
        discover_round(px);
        atomic_fetch_add(&px->rounds, 1);
        pthread_mutex_lock(&px->disc_mu);
        /* A timed wait, not a sleep: a stop wakes the thread at once. */
        struct timespec ts = kvb__timespec_of(kvb__deadline_ms(px->discover_ms));
        while (!px->disc_stop && pthread_cond_timedwait(&px->disc_cv, &px->disc_mu, &ts) == 0)
            ;
    }
    pthread_mutex_unlock(&px->disc_mu);
    return NULL;
}

int kvb__pxy_discover_start(kvb_pd_proxy_t *px, char *reason, size_t cap)
{
    if (!px->meta)
        return KVB_OK;
    if (pthread_create(&px->disc, NULL, discover_main, px)) {
        kvb__pxy_fmt(reason, cap, "cannot start the discovery thread");
        return KVB_ERR_SYSTEM;
    }
    px->disc_started = true;
    return KVB_OK;
}

void kvb__pxy_discover_stop(kvb_pd_proxy_t *px)
{
    pthread_mutex_lock(&px->disc_mu);
    px->disc_stop = true;
    pthread_cond_broadcast(&px->disc_cv);
    pthread_mutex_unlock(&px->disc_mu);
    if (px->disc_started)
        pthread_join(px->disc, NULL);
    px->disc_started = false;
    while (px->noted) {
        kvb__pxy_noted_t *n = px->noted;
        px->noted = n->next;
        free(n);
    }
}

json_t *kvb__pxy_discovery_health(kvb_pd_proxy_t *px)
{
    if (!px->meta)
        return NULL;
    uint64_t rounds = atomic_load(&px->rounds);
    /* "reachable" is the last round's outcome; null until a round has run. */
    return json_pack("{s:s, s:s, s:i, s:I, s:o}", "uri", kvb__meta_uri(px->meta), "cluster",
                     px->cluster, "interval_ms", (int)px->discover_ms, "rounds", (json_int_t)rounds,
                     "reachable", rounds ? json_boolean(atomic_load(&px->store_ok)) : json_null());
}
