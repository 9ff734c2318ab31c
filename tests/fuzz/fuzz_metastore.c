/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the store of `kvbridge metadata-server` and the checks its requests pass
 * (src/tools/metastore.c): each input is a run of PUTs, GETs, DELETEs, lists and counts on one
 * small store under a fake clock, every key, TTL and value checked as the server checks them. A
 * model of the live keys says what each answer must be; any difference, or a broken invariant of
 * the store, traps.
 *
 * Input: max_keys byte, max_bytes byte, then operations, each an op byte and its fields:
 *   0 PUT key ttl value   1 PUT key ttl value with renew=1   7 PUT key ttl renew value
 *   2 GET key   3 DELETE key   4 LIST prefix   5 advance the clock: u16   6 count (/health)
 * A field is a length byte (0xf0 | n, then a byte: n << 8 | that byte, up to 4095) and its bytes;
 * a C string field stops at its first NUL (the server's strings cannot hold one). An empty ttl or
 * renew field is an absent query argument. */
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "tools/metastore.h"

#define TTL_MAX_MS 86400000u /* the server's MS_TTL_MAX_MS */
#define MODEL_MAX  16u       /* keys the model holds at most: max_keys is at most 8 here */

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            __builtin_trap();                                                                      \
    } while (0)

typedef struct {
    const uint8_t *p;
    size_t n;
} rd_t;

/* A live key as the store must hold it: its value lies in the input. */
typedef struct {
    char key[KVB__MS_KEY_MAX + 1];
    const uint8_t *val;
    size_t vlen;
    uint64_t expires;
} mkey_t;

typedef struct {
    kvb__ms_store_t st;
    uint64_t now; /* the fake monotonic clock, ns */
    mkey_t m[MODEL_MAX];
    size_t nm;
    json_t *held; /* the value of the last GET, still held by its "answer" */
    const uint8_t *held_val;
    size_t held_len;
} ctx_t;

static unsigned rd_byte(rd_t *r)
{
    if (!r->n)
        return 0;
    r->n--;
    return *r->p++;
}

static size_t rd_field(rd_t *r, const uint8_t **out)
{
    size_t len = rd_byte(r);
    if (len >= 0xf0)
        len = (len & 0x0fu) << 8 | rd_byte(r);
    if (len > r->n)
        len = r->n;
    *out = r->p;
    r->p += len;
    r->n -= len;
    return len;
}

/* The next field as a C string (malloc'd), or NULL if it is empty. */
static char *rd_cstr(rd_t *r)
{
    const uint8_t *b;
    size_t n = rd_field(r, &b);
    if (!n)
        return NULL;
    char *s = malloc(n + 1);
    if (!s)
        abort();
    memcpy(s, b, n);
    s[n] = '\0';
    return s;
}

/* ---- The validators against references of their own ------------------------------------------ */

/* jansson's own UTF-8 check, which the values' must equal (/v1/list hands them to jansson). */
static bool utf8_checked(const uint8_t *s, size_t n)
{
    bool ok = kvb__ms_utf8_valid(s, n);
    json_t *j = json_stringn((const char *)s, n);
    CHECK(ok == (j != NULL));
    json_decref(j);
    return ok;
}

static bool key_checked(const char *key)
{
    const char *why = kvb__ms_key_problem(key);
    size_t n = strlen(key);
    bool ctl = false;
    for (size_t i = 0; i < n; i++)
        ctl |= (unsigned char)key[i] < 0x20 || key[i] == 0x7f;
    json_t *j = json_stringn(key, n);
    CHECK((why == NULL) == (n && n <= KVB__MS_KEY_MAX && !ctl && j));
    CHECK(!why || *why);
    json_decref(j);
    return !why;
}

/* A query argument through kvb__ms_parse_dec, as the server parses ttl_ms and renew (absent:
 * dflt). Returns false if the server answers 400. */
static bool dec_checked(const char *s, uint64_t max, uint64_t dflt, uint64_t *out)
{
    *out = dflt;
    if (!s)
        return true;
    int rc = kvb__ms_parse_dec(s, max, out);
    size_t n = strlen(s);
    bool digits = n && strspn(s, "0123456789") == n;
    errno = 0;
    unsigned long long ref = digits ? strtoull(s, NULL, 10) : 0;
    CHECK((rc == 0) == (digits && errno != ERANGE && ref <= max));
    CHECK(rc ? *out == dflt : *out == ref);
    return rc == 0;
}

/* ---- The model ---------------------------------------------------------------------------------
 */

static mkey_t *model_find(ctx_t *c, const char *key)
{
    for (size_t i = 0; i < c->nm; i++)
        if (!strcmp(c->m[i].key, key))
            return &c->m[i];
    return NULL;
}

static void model_drop(ctx_t *c, mkey_t *k)
{
    *k = c->m[--c->nm];
}

/* Keys expired by now are gone, whether or not the store purged them yet. */
static void model_expire(ctx_t *c)
{
    for (size_t i = 0; i < c->nm;)
        if (c->m[i].expires <= c->now)
            model_drop(c, &c->m[i]);
        else
            i++;
}

static uint64_t model_bytes(const ctx_t *c)
{
    uint64_t b = 0;
    for (size_t i = 0; i < c->nm; i++)
        b += c->m[i].vlen;
    return b;
}

static bool same(const json_t *s, const uint8_t *val, size_t vlen)
{
    return json_is_string(s) && json_string_length(s) == vlen &&
           !memcmp(json_string_value(s), val, vlen);
}

/* What a PUT must answer: expired keys never count against the limits. */
static kvb__ms_put_rc_t model_put_rc(ctx_t *c, const mkey_t *k, size_t vlen, const uint8_t *val,
                                     bool renew)
{
    if (renew && k && (k->vlen != vlen || memcmp(k->val, val, vlen)))
        return KVB__MS_PUT_TAKEN;
    if (!k && c->nm >= c->st.max_keys)
        return KVB__MS_PUT_FULL_KEYS;
    if (model_bytes(c) - (k ? k->vlen : 0) + vlen > c->st.max_bytes)
        return KVB__MS_PUT_FULL_BYTES;
    return KVB__MS_PUT_OK;
}

/* The store's own invariants, and that its live keys are exactly the model's. */
static void check_store(ctx_t *c)
{
    kvb__ms_store_t *st = &c->st;
    CHECK(!pthread_mutex_trylock(&st->mu)); /* every path unlocked */
    pthread_mutex_unlock(&st->mu);
    CHECK(st->n <= st->cap && st->n <= st->max_keys);
    uint64_t bytes = 0;
    size_t live = 0;
    for (size_t i = 0; i < st->n; i++) {
        const kvb__ms_entry_t *e = &st->v[i];
        const char *key = json_string_value(e->key);
        CHECK(key && json_is_string(e->val));
        CHECK(!kvb__ms_key_problem(key)); /* a refused key never gets in */
        CHECK(strlen(key) == json_string_length(e->key));
        CHECK(kvb__ms_utf8_valid((const uint8_t *)json_string_value(e->val),
                                 json_string_length(e->val)));
        CHECK(!i || strcmp(json_string_value(st->v[i - 1].key), key) < 0);
        bytes += json_string_length(e->val);
        if (e->expires <= c->now)
            continue;
        live++;
        const mkey_t *k = model_find(c, key);
        CHECK(k && k->expires == e->expires && same(e->val, k->val, k->vlen));
    }
    CHECK(bytes == st->bytes); /* never underflows, never drifts */
    CHECK(live == c->nm);
    if (c->held) /* a value handed out stays as it was, whatever happened to its key */
        CHECK(same(c->held, c->held_val, c->held_len));
}

/* ---- The operations, as the server's handlers call the store -------------------------------- */

static void op_put(ctx_t *c, rd_t *r, int renew_how)
{
    char *key = rd_cstr(r), *ttl_s = rd_cstr(r), *renew_s = renew_how == 2 ? rd_cstr(r) : NULL;
    const uint8_t *val;
    size_t vlen = rd_field(r, &val);
    uint64_t ttl, renew;
    bool ok = key_checked(key ? key : ""); /* the route's checks, then the body's */
    ok &= dec_checked(ttl_s, TTL_MAX_MS, 0, &ttl);
    ok &= dec_checked(renew_s, 1, renew_how == 1, &renew);
    ok &= utf8_checked(val, vlen);
    json_t *v = ok ? json_stringn_nocheck((const char *)val, vlen) : NULL;
    if (v) {
        uint64_t expires = ttl ? c->now + ttl * 1000000ull : UINT64_MAX;
        mkey_t *k = model_find(c, key);
        kvb__ms_put_rc_t want = model_put_rc(c, k, vlen, val, renew == 1);
        kvb__ms_put_rc_t rc = kvb__ms_store_put(&c->st, key, v, expires, renew == 1, c->now);
        CHECK(rc == want || (rc == KVB__MS_PUT_NOMEM && want == KVB__MS_PUT_OK && !k));
        if (rc == KVB__MS_PUT_OK && !k) {
            CHECK(c->nm < MODEL_MAX);
            k = &c->m[c->nm++];
            strcpy(k->key, key);
        }
        if (rc == KVB__MS_PUT_OK) {
            k->val = val;
            k->vlen = vlen;
            k->expires = expires;
        }
    }
    free(key);
    free(ttl_s);
    free(renew_s);
}

static void op_get(ctx_t *c, rd_t *r)
{
    char *key = rd_cstr(r);
    if (key_checked(key ? key : "")) {
        json_t *v = kvb__ms_store_get(&c->st, key, c->now);
        const mkey_t *k = model_find(c, key);
        CHECK(!v == !k);
        if (v) {
            CHECK(same(v, k->val, k->vlen));
            json_decref(c->held);
            c->held = v;
            c->held_val = k->val;
            c->held_len = k->vlen;
        }
    }
    free(key);
}

static void op_del(ctx_t *c, rd_t *r)
{
    char *key = rd_cstr(r);
    if (key_checked(key ? key : "")) {
        mkey_t *k = model_find(c, key);
        CHECK(kvb__ms_store_del(&c->st, key, c->now) == (k != NULL));
        if (k)
            model_drop(c, k);
    }
    free(key);
}

static void op_list(ctx_t *c, rd_t *r)
{
    char *prefix = rd_cstr(r);
    const char *p = prefix ? prefix : ""; /* ?prefix= absent: every key */
    size_t plen = strlen(p), want = 0;
    json_t *items = kvb__ms_store_list(&c->st, p, c->now);
    if (items) {
        CHECK(json_is_array(items));
        const char *last = NULL;
        for (size_t i = 0; i < json_array_size(items); i++) {
            json_t *it = json_array_get(items, i), *jk = json_object_get(it, "key"),
                   *jv = json_object_get(it, "value"), *jt = json_object_get(it, "ttl_ms");
            CHECK(json_is_string(jk) && json_is_string(jv) && json_is_integer(jt));
            const char *key = json_string_value(jk);
            CHECK(!strncmp(key, p, plen));
            CHECK(!last || strcmp(last, key) < 0); /* sorted, no key twice */
            last = key;
            const mkey_t *k = model_find(c, key);
            CHECK(k && same(jv, k->val, k->vlen));
            CHECK(
                kvb__ms_utf8_valid((const uint8_t *)json_string_value(jv), json_string_length(jv)));
            json_int_t ttl = json_integer_value(jt);
            if (k->expires == UINT64_MAX)
                CHECK(ttl == 0);
            else
                CHECK(ttl >= 1 && (uint64_t)ttl == (k->expires - c->now + 999999) / 1000000);
        }
        for (size_t i = 0; i < c->nm; i++)
            want += !strncmp(c->m[i].key, p, plen);
        CHECK(json_array_size(items) == want);
        /* What /v1/list sends: it serializes, and reads back the same (values may hold NULs). */
        char *s = json_dumps(items, JSON_COMPACT);
        CHECK(s);
        json_t *back = json_loads(s, JSON_ALLOW_NUL, NULL);
        CHECK(back && json_equal(back, items));
        json_decref(back);
        free(s);
        json_decref(items);
    }
    free(prefix);
}

/* u16: 14 bits of amount, 2 of unit (us, ms, s, min). The clock stops at 2^62 ns, so that no
 * expiry time overflows (146 years, far beyond what any input reaches). */
static void op_advance(ctx_t *c, rd_t *r)
{
    static const uint64_t unit[] = {1000ull, 1000000ull, 1000000000ull, 60000000000ull};
    unsigned v = rd_byte(r);
    v |= rd_byte(r) << 8;
    if (c->now < 1ull << 62)
        c->now += (v & 0x3fffu) * unit[v >> 14];
}

static void op_count(ctx_t *c)
{
    size_t n = kvb__ms_store_count(&c->st, c->now);
    CHECK(n == c->nm && n <= c->st.max_keys);
    CHECK(c->st.n == n && c->st.bytes == model_bytes(c)); /* everything expired is purged */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rd_t r = {data, size};
    static ctx_t c; /* 16 KiB of model keys: not on the stack */
    memset(&c, 0, sizeof c);
    size_t max_keys = 1 + rd_byte(&r) % 8;
    uint64_t max_bytes = (uint64_t)rd_byte(&r) * 8;
    kvb__ms_store_init(&c.st, max_keys, max_bytes);
    while (r.n) {
        unsigned op = rd_byte(&r) % 8;
        switch (op) {
        case 0:
        case 1:
        case 7:
            op_put(&c, &r, op == 7 ? 2 : (int)op);
            break;
        case 2:
            op_get(&c, &r);
            break;
        case 3:
            op_del(&c, &r);
            break;
        case 4:
            op_list(&c, &r);
            break;
        case 5:
            op_advance(&c, &r);
            break;
        default:
            op_count(&c);
            break;
        }
        model_expire(&c);
        check_store(&c);
    }
    op_count(&c);
    check_store(&c);
    json_decref(c.held);
    kvb__ms_store_free(&c.st);
    return 0;
}
