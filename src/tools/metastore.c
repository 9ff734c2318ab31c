/* SPDX-License-Identifier: Apache-2.0 */
/* The store of `kvbridge metadata-server` (src/tools/metaserver.c): sorted keys with values and
 * TTLs under one mutex, and the validators of keys, values and numbers from its HTTP requests. */
#include "tools/metastore.h"

#include <stdlib.h>
#include <string.h>

static const char *ekey(const kvb__ms_entry_t *e)
{
    return json_string_value(e->key);
}

/* Index of `key`, or where it would go; *found says which. */
static size_t find(const kvb__ms_store_t *st, const char *key, bool *found)
{
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(ekey(&st->v[mid]), key) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < st->n && !strcmp(ekey(&st->v[lo]), key);
    return lo;
}

static void entry_drop(kvb__ms_store_t *st, kvb__ms_entry_t *e)
{
    st->bytes -= json_string_length(e->val);
    json_decref(e->key);
    json_decref(e->val);
}

/* Purges every key expired by `now`, in one pass that keeps the order. */
static void sweep(kvb__ms_store_t *st, uint64_t now)
{
    size_t w = 0;
    for (size_t r = 0; r < st->n; r++) {
        if (st->v[r].expires <= now)
            entry_drop(st, &st->v[r]);
        else
            st->v[w++] = st->v[r];
    }
    st->n = w;
    st->next_sweep = now + KVB__MS_SWEEP_NS;
}

/* Expired keys are invisible at once (every reader compares with `now`); their memory goes back
 * here, on the first request a second after the last sweep, so no thread is needed for it. */
static void sweep_due(kvb__ms_store_t *st, uint64_t now)
{
    if (now >= st->next_sweep)
        sweep(st, now);
}

/* The live entry of `key`, or NULL (an expired one is purged on the way). */
static kvb__ms_entry_t *lookup(kvb__ms_store_t *st, const char *key, uint64_t now)
{
    bool found;
    sweep_due(st, now);
    size_t i = find(st, key, &found);
    if (!found)
        return NULL;
    if (st->v[i].expires > now)
        return &st->v[i];
    entry_drop(st, &st->v[i]);
    memmove(&st->v[i], &st->v[i + 1], (st->n - i - 1) * sizeof *st->v);
    st->n--;
    return NULL;
}

static kvb__ms_put_rc_t insert_at(kvb__ms_store_t *st, size_t i, const char *key, json_t *val,
                                  uint64_t expires)
{
    if (st->n == st->cap) {
        size_t ncap = st->cap ? st->cap * 2 : 64;
        kvb__ms_entry_t *v = realloc(st->v, ncap * sizeof *v);
        if (!v)
            return KVB__MS_PUT_NOMEM;
        st->v = v;
        st->cap = ncap;
    }
    json_t *k = json_string_nocheck(key); /* checked by kvb__ms_key_problem() */
    if (!k)
        return KVB__MS_PUT_NOMEM;
    memmove(&st->v[i + 1], &st->v[i], (st->n - i) * sizeof *st->v);
    st->v[i] = (kvb__ms_entry_t){.key = k, .val = val, .expires = expires};
    st->n++;
    st->bytes += json_string_length(val);
    return KVB__MS_PUT_OK;
}

static kvb__ms_put_rc_t room_for(const kvb__ms_store_t *st, bool found, size_t old_len, size_t len)
{
    if (!found && st->n >= st->max_keys)
        return KVB__MS_PUT_FULL_KEYS;
    return st->bytes - old_len + len > st->max_bytes ? KVB__MS_PUT_FULL_BYTES : KVB__MS_PUT_OK;
}

/* True if a live entry at i holds a value other than `val`. */
static bool holds_other(const kvb__ms_store_t *st, size_t i, bool found, const json_t *val,
                        uint64_t now)
{
    const json_t *old = found && st->v[i].expires > now ? st->v[i].val : NULL;
    return old && (json_string_length(old) != json_string_length(val) ||
                   memcmp(json_string_value(old), json_string_value(val), json_string_length(val)));
}

void kvb__ms_store_init(kvb__ms_store_t *st, size_t max_keys, uint64_t max_bytes)
{
    *st = (kvb__ms_store_t){.max_keys = max_keys, .max_bytes = max_bytes};
    pthread_mutex_init(&st->mu, NULL);
}

kvb__ms_put_rc_t kvb__ms_store_put(kvb__ms_store_t *st, const char *key, json_t *val,
                                   uint64_t expires, bool renew, uint64_t now)
{
    size_t len = json_string_length(val);
    bool found;
    pthread_mutex_lock(&st->mu);
    sweep_due(st, now);
    size_t i = find(st, key, &found);
    size_t old_len = found ? json_string_length(st->v[i].val) : 0;
    kvb__ms_put_rc_t rc = renew && holds_other(st, i, found, val, now)
                              ? KVB__MS_PUT_TAKEN
                              : room_for(st, found, old_len, len);
    /* Full: expired keys count until purged, so purge them and look again. */
    if (rc != KVB__MS_PUT_OK && rc != KVB__MS_PUT_TAKEN) {
        sweep(st, now);
        i = find(st, key, &found);
        old_len = found ? json_string_length(st->v[i].val) : 0;
        rc = room_for(st, found, old_len, len);
    }
    if (rc == KVB__MS_PUT_OK && found) {
        json_decref(st->v[i].val);
        st->v[i].val = val;
        st->v[i].expires = expires;
        st->bytes = st->bytes - old_len + len;
    } else if (rc == KVB__MS_PUT_OK) {
        rc = insert_at(st, i, key, val, expires);
    }
    pthread_mutex_unlock(&st->mu);
    if (rc != KVB__MS_PUT_OK)
        json_decref(val);
    return rc;
}

json_t *kvb__ms_store_get(kvb__ms_store_t *st, const char *key, uint64_t now)
{
    pthread_mutex_lock(&st->mu);
    kvb__ms_entry_t *e = lookup(st, key, now);
    json_t *v = e ? json_incref(e->val) : NULL;
    pthread_mutex_unlock(&st->mu);
    return v;
}

bool kvb__ms_store_del(kvb__ms_store_t *st, const char *key, uint64_t now)
{
    pthread_mutex_lock(&st->mu);
    kvb__ms_entry_t *e = lookup(st, key, now);
    if (e) {
        size_t i = (size_t)(e - st->v);
        entry_drop(st, e);
        memmove(&st->v[i], &st->v[i + 1], (st->n - i - 1) * sizeof *st->v);
        st->n--;
    }
    pthread_mutex_unlock(&st->mu);
    return e != NULL;
}

/* Milliseconds until `expires`, rounded up (0 is "never" on the wire, so a key about to expire
 * reports 1). */
static json_int_t ttl_left(uint64_t expires, uint64_t now)
{
    return expires == UINT64_MAX ? 0 : (json_int_t)((expires - now + 999999) / 1000000);
}

json_t *kvb__ms_store_list(kvb__ms_store_t *st, const char *prefix, uint64_t now)
{
    json_t *items = json_array();
    size_t plen = strlen(prefix);
    bool found;
    pthread_mutex_lock(&st->mu);
    sweep_due(st, now);
    for (size_t i = find(st, prefix, &found);
         items && i < st->n && !strncmp(ekey(&st->v[i]), prefix, plen); i++) {
        const kvb__ms_entry_t *e = &st->v[i];
        if (e->expires <= now)
            continue;
        json_t *it = json_pack("{s:O,s:O,s:I}", "key", e->key, "value", e->val, "ttl_ms",
                               ttl_left(e->expires, now));
        if (!it || json_array_append_new(items, it)) {
            json_decref(items);
            items = NULL;
        }
    }
    pthread_mutex_unlock(&st->mu);
    return items;
}

size_t kvb__ms_store_count(kvb__ms_store_t *st, uint64_t now)
{
    pthread_mutex_lock(&st->mu);
    sweep(st, now);
    size_t n = st->n;
    pthread_mutex_unlock(&st->mu);
    return n;
}

void kvb__ms_store_free(kvb__ms_store_t *st)
{
    for (size_t i = 0; i < st->n; i++)
        entry_drop(st, &st->v[i]);
    free(st->v);
    pthread_mutex_destroy(&st->mu);
}

/* ---- Input checks ---------------------------------------------------------------------------- */

bool kvb__ms_utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80                 ? 1
                     : c >= 0xc2 && c <= 0xdf ? 2
                     : c >= 0xe0 && c <= 0xef ? 3
                     : c >= 0xf0 && c <= 0xf4 ? 4
                                              : 0;
        if (!len || n - i < len)
            return false;
        uint32_t cp = len == 1 ? c : c & (0x7fu >> len);
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80)
                return false;
            cp = cp << 6 | (s[i + k] & 0x3fu);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += len;
    }
    return true;
}

const char *kvb__ms_key_problem(const char *key)
{
    size_t n = strlen(key);
    if (!n)
        return "empty key";
    if (n > KVB__MS_KEY_MAX)
        return "key longer than 1024 bytes";
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)key[i] < 0x20 || key[i] == 0x7f)
            return "key holds a control byte (below 0x20, or 0x7f)";
    return kvb__ms_utf8_valid((const unsigned char *)key, n) ? NULL : "key is not valid UTF-8";
}

int kvb__ms_parse_dec(const char *s, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    if (!s || !*s)
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        v = v * 10 + (uint64_t)(*s - '0');
        if (v > max) /* checked every digit, so v never overflows */
            return -1;
    }
    *out = v;
    return 0;
}
