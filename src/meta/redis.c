/* SPDX-License-Identifier: Apache-2.0 */
/* The "redis://[[user]:password@]host:port[/db]" backend over hiredis. Owned keys carry a TTL
 * (SET ... PX) that the keeper refreshes by setting them again - in a script that leaves a key
 * another process took over alone - which also re-creates them after a restart of a Redis that
 * does not persist. A broken connection is dropped and redialled on the next call. */
#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "meta/internal.h"

typedef struct {
    char host[256];
    uint16_t port;
    char user[128], password[256];
    unsigned db;
    redisContext *c;
    bool no_script;   /* EVAL was refused: renew by plain SET */
    char err[128];    /* the last error reply */
    char err_cmd[16]; /* ... to this command */
} redis_be_t;

static void drop(redis_be_t *r)
{
    if (r->c) {
        redisFree(r->c);
        r->c = NULL;
    }
}

/* Runs one command (argv with lengths); on success *out holds the reply (caller frees). */
static int command(kvb_meta_t *m, int argc, const char **argv, const size_t *lens,
                   redisReply **out);

static int dial(kvb_meta_t *m)
{
    redis_be_t *r = m->be;
    if (r->c)
        return KVB_OK;
    uint32_t ms = kvb__meta_left_ms(m);
    if (ms == 0)
        return KVB_ERR_META_UNREACHABLE;
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    r->c = redisConnectWithTimeout(r->host, r->port, tv);
    if (!r->c || r->c->err) {
        kvb__meta_note(m, KVB_ERR_META_UNREACHABLE, r->c ? r->c->errstr : "out of memory");
        drop(r);
        return KVB_ERR_META_UNREACHABLE;
    }
    redisReply *rep = NULL;
    int rc = KVB_OK;
    if (r->password[0]) {
        const char *a[3] = {"AUTH", r->user[0] ? r->user : r->password, r->password};
        size_t l[3] = {4, strlen(a[1]), strlen(a[2])};
        rc = command(m, r->user[0] ? 3 : 2, a, l, &rep);
        freeReplyObject(rep);
        rep = NULL;
    }
    if (rc == KVB_OK && r->db) {
        char db[16];
        snprintf(db, sizeof db, "%u", r->db);
        const char *a[2] = {"SELECT", db};
        size_t l[2] = {6, strlen(db)};
        rc = command(m, 2, a, l, &rep);
        freeReplyObject(rep);
    }
    if (rc)
        drop(r);
    return rc;
}

static int command(kvb_meta_t *m, int argc, const char **argv, const size_t *lens, redisReply **out)
{
    redis_be_t *r = m->be;
    int rc = dial(m);
    if (rc)
        return rc;
    /* Each command has what is left of the call's timeout (a call may reconnect, authenticate
     * and select its database first). */
    uint32_t ms = kvb__meta_left_ms(m);
    if (ms == 0)
        return KVB_ERR_META_UNREACHABLE;
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    if (redisSetTimeout(r->c, tv) != REDIS_OK) {
        drop(r);
        return KVB_ERR_META_UNREACHABLE;
    }
    redisReply *rep = redisCommandArgv(r->c, argc, argv, lens);
    if (!rep) {
        kvb__meta_note(m, KVB_ERR_META_UNREACHABLE, r->c->errstr);
        drop(r);
        return KVB_ERR_META_UNREACHABLE;
    }
    if (rep->type == REDIS_REPLY_ERROR) {
        KVB_WARN("redis %s refused %s: %s", m->uri, argv[0], rep->str);
        snprintf(r->err, sizeof r->err, "%s", rep->str ? rep->str : "");
        snprintf(r->err_cmd, sizeof r->err_cmd, "%s", argv[0]);
        freeReplyObject(rep);
        return KVB_ERR_PROTOCOL;
    }
    *out = rep;
    return KVB_OK;
}

static int r_put(kvb_meta_t *m, const char *key, const char *val, size_t len, uint32_t ttl_ms)
{
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%u", ttl_ms);
    const char *a[5] = {"SET", key, val, "PX", ttl};
    size_t l[5] = {3, strlen(key), len, 2, strlen(ttl)};
    redisReply *rep = NULL;
    int rc = command(m, ttl_ms ? 5 : 3, a, l, &rep);
    freeReplyObject(rep);
    return rc;
}

static int r_put_owned(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    return r_put(m, key, val, len, m->ttl_ms);
}

/* A renewal decided by the server in one step: SET ... PX only while the key is absent or holds
 * our value. Returns 1 if it set the key, 0 if another value is there. */
static const char renew_script[] = "local v = redis.call('GET', KEYS[1]) "
                                   "if v and v ~= ARGV[1] then return 0 end "
                                   "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) "
                                   "return 1";

static int r_renew(kvb_meta_t *m, const char *key, const char *val, size_t len)
{
    redis_be_t *r = m->be;
    if (r->no_script)
        return r_put_owned(m, key, val, len);
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%u", m->ttl_ms);
    const char *a[6] = {"EVAL", renew_script, "1", key, val, ttl};
    size_t l[6] = {4, sizeof renew_script - 1, 1, strlen(key), len, strlen(ttl)};
    redisReply *rep = NULL;
    r->err[0] = '\0';
    int rc = command(m, 6, a, l, &rep);
    /* A server without scripting, or an ACL that forbids EVAL (command() logged its words) - not
     * a passing refusal (LOADING, OOM, READONLY, BUSY), which the next round tries again: once
     * set, the plain SET stays. */
    bool never = !strcmp(r->err_cmd, "EVAL") && /* not a reconnect's AUTH or SELECT */
                 (!strncmp(r->err, "NOPERM", 6) || strstr(r->err, "unknown command"));
    if (rc == KVB_ERR_PROTOCOL && never) {
        KVB_WARN("redis %s: renewing owned keys by plain SET from now on, which overwrites a key "
                 "that another process took over",
                 m->uri);
        r->no_script = true;
        return r_put_owned(m, key, val, len);
    }
    if (rc == KVB_OK)
        rc = rep->type != REDIS_REPLY_INTEGER ? KVB_ERR_PROTOCOL
             : rep->integer                   ? KVB_OK
                                              : KVB_ERR_BUSY;
    freeReplyObject(rep);
    return rc;
}

static int r_get(kvb_meta_t *m, const char *key, char **val, size_t *len)
{
    const char *a[2] = {"GET", key};
    size_t l[2] = {3, strlen(key)};
    redisReply *rep = NULL;
    int rc = command(m, 2, a, l, &rep);
    if (rc)
        return rc;
    if (rep->type == REDIS_REPLY_NIL) {
        rc = KVB_ERR_NOT_FOUND;
    } else if (rep->type != REDIS_REPLY_STRING) {
        rc = KVB_ERR_PROTOCOL;
    } else if (!(*val = malloc(rep->len + 1))) {
        rc = KVB_ERR_NOMEM;
    } else {
        memcpy(*val, rep->str, rep->len);
        (*val)[rep->len] = '\0';
        *len = rep->len;
    }
    freeReplyObject(rep);
    return rc;
}

static int r_del(kvb_meta_t *m, const char *key)
{
    const char *a[2] = {"DEL", key};
    size_t l[2] = {3, strlen(key)};
    redisReply *rep = NULL;
    int rc = command(m, 2, a, l, &rep);
    if (rc == KVB_OK && (rep->type != REDIS_REPLY_INTEGER || rep->integer == 0))
        rc = KVB_ERR_NOT_FOUND;
    freeReplyObject(rep);
    return rc;
}

/* prefix with the glob characters escaped, then '*'. */
static char *glob_of(const char *prefix)
{
    char *g = malloc(strlen(prefix) * 2 + 2), *o = g;
    if (!g)
        return NULL;
    for (const char *p = prefix; *p; p++) {
        if (strchr("*?[]\\", *p))
            *o++ = '\\';
        *o++ = *p;
    }
    *o++ = '*';
    *o = '\0';
    return g;
}

/* Appends (key, value) to the list, taking a copy of both. */
static int list_add(kvb_meta_kv_t **items, size_t *got, size_t *cap, const char *key,
                    const char *val, size_t len)
{
    if (*got == *cap) {
        size_t ncap = *cap ? *cap * 2 : 16;
        kvb_meta_kv_t *ni = realloc(*items, ncap * sizeof *ni);
        if (!ni)
            return KVB_ERR_NOMEM;
        *items = ni;
        *cap = ncap;
    }
    kvb_meta_kv_t *it = &(*items)[*got];
    *it = (kvb_meta_kv_t){.key = strdup(key), .value = malloc(len + 1), .len = len};
    if (!it->key || !it->value) {
        free(it->key);
        free(it->value);
        return KVB_ERR_NOMEM;
    }
    memcpy(it->value, val, len);
    it->value[len] = '\0';
    (*got)++;
    return KVB_OK;
}

/* The values of one SCAN page's keys, with one MGET (a round trip per page, not per key): a key
 * that expired between the SCAN and the MGET (nil) is skipped. A key SCAN returns twice is listed
 * twice here; kvb__meta_list keeps one. */
static int list_page(kvb_meta_t *m, const redisReply *keys, kvb_meta_kv_t **items, size_t *got,
                     size_t *cap)
{
    const char **a = malloc((keys->elements + 1) * sizeof *a);
    size_t *l = malloc((keys->elements + 1) * sizeof *l), k = 1;
    if (!a || !l) {
        free(a);
        free(l);
        return KVB_ERR_NOMEM;
    }
    a[0] = "MGET";
    l[0] = 4;
    for (size_t i = 0; i < keys->elements; i++) {
        const redisReply *key = keys->element[i];
        if (key->type != REDIS_REPLY_STRING || strlen(key->str) != key->len)
            continue; /* not a key of ours */
        a[k] = key->str;
        l[k++] = key->len;
    }
    redisReply *rep = NULL;
    int rc = k > 1 ? command(m, (int)k, a, l, &rep) : KVB_OK;
    if (rc == KVB_OK && rep && (rep->type != REDIS_REPLY_ARRAY || rep->elements != k - 1))
        rc = KVB_ERR_PROTOCOL;
    for (size_t i = 0; rc == KVB_OK && rep && i < rep->elements; i++) {
        const redisReply *v = rep->element[i];
        if (v->type == REDIS_REPLY_NIL)
            continue;
        rc = v->type != REDIS_REPLY_STRING ? KVB_ERR_PROTOCOL
                                           : list_add(items, got, cap, a[i + 1], v->str, v->len);
    }
    freeReplyObject(rep);
    free(a);
    free(l);
    return rc;
}

static int r_list(kvb_meta_t *m, const char *prefix, kvb_meta_kv_t **out, size_t *n)
{
    char *glob = glob_of(prefix), cursor[32] = "0";
    kvb_meta_kv_t *items = NULL;
    size_t got = 0, cap = 0;
    int rc = glob ? KVB_OK : KVB_ERR_NOMEM;
    /* SCAN for the keys, a page at a time, and MGET each page's values. */
    do {
        const char *a[6] = {"SCAN", cursor, "MATCH", glob, "COUNT", "512"};
        size_t l[6] = {4, strlen(cursor), 5, strlen(glob), 5, 3};
        redisReply *rep = NULL;
        if ((rc = command(m, 6, a, l, &rep)))
            break;
        if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
            rep->element[0]->type != REDIS_REPLY_STRING || rep->element[0]->len >= sizeof cursor ||
            rep->element[1]->type != REDIS_REPLY_ARRAY) {
            freeReplyObject(rep);
            rc = KVB_ERR_PROTOCOL;
            break;
        }
        memcpy(cursor, rep->element[0]->str, rep->element[0]->len);
        cursor[rep->element[0]->len] = '\0';
        rc = list_page(m, rep->element[1], &items, &got, &cap);
        freeReplyObject(rep);
    } while (rc == KVB_OK && strcmp(cursor, "0"));
    free(glob);
    if (rc) {
        kvb__meta_kvs_free(items, got);
        return rc;
    }
    *out = items;
    *n = got;
    return KVB_OK;
}

static void r_free(kvb_meta_t *m)
{
    redis_be_t *r = m->be;
    drop(r);
    free(r);
}

const kvb_meta_ops_t kvb__meta_redis_ops = {
    .kind = "redis",
    .put = r_put,
    .get = r_get,
    .del = r_del,
    .list = r_list,
    .put_owned = r_put_owned,
    .renew = r_renew,
    .free = r_free,
};

int kvb__meta_redis_init(kvb_meta_t *m, const char *rest)
{
    redis_be_t *r = calloc(1, sizeof *r);
    if (!r)
        return KVB_ERR_NOMEM;
    const char *at = strrchr(rest, '@'), *hp = at ? at + 1 : rest;
    bool ok = true;
    if (at) { /* "[user]:password@" */
        const char *colon = memchr(rest, ':', (size_t)(at - rest));
        size_t ul = colon ? (size_t)(colon - rest) : 0;
        size_t pl = colon ? (size_t)(at - colon - 1) : 0;
        ok = colon && ul < sizeof r->user && pl > 0 && pl < sizeof r->password;
        if (ok) {
            memcpy(r->user, rest, ul);
            memcpy(r->password, colon + 1, pl);
        }
    }
    const char *slash = strchr(hp, '/');
    size_t hl = slash ? (size_t)(slash - hp) : strlen(hp);
    ok = ok && !kvb__meta_hostport(hp, hl, r->host, sizeof r->host, &r->port);
    if (ok && slash && slash[1]) {
        char *end;
        unsigned long db = strtoul(slash + 1, &end, 10);
        ok = *end == '\0' && slash[1] >= '0' && slash[1] <= '9' && db <= 65535;
        r->db = (unsigned)db;
    }
    if (!ok) {
        KVB_ERROR("metadata URI: expected redis://[[user]:password@]host:port[/db]");
        free(r);
        return KVB_ERR_INVALID_ARG;
    }
    if (at) /* never print the password */
        snprintf(m->uri, sizeof m->uri, "redis://%s%s***@%s", r->user, ":", hp);
    m->ops = &kvb__meta_redis_ops;
    m->be = r;
    return KVB_OK;
}
