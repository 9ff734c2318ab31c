/* SPDX-License-Identifier: Apache-2.0 */
/* Authentication of the PD runtime's HTTP calls: signed internal calls with a bounded memory of
 * the nonces seen, tickets for block grants, and bearer API keys. The cryptography is libcrypto's
 * (common/auth.c); this file only decides what is signed and what is accepted. */
#include "pd/auth.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/auth.h"
#include "kvbridge/status.h"

#define NONCE_BYTES 16
#define NO_ENTRY    UINT32_MAX

/* A nonce accepted, kept until KVB_PD_AUTH_SEEN_MAX newer ones push it out. */
typedef struct {
    uint8_t nonce[NONCE_BYTES];
    uint64_t ts_ms;
    uint32_t next; /* the next entry of its hash bucket, or NO_ENTRY */
} seen_t;

typedef struct {
    char *key;
    size_t len;
} api_key_t;

struct kvb__pd_auth {
    uint8_t *secret; /* NULL: no cluster secret */
    size_t secret_len;
    api_key_t *keys;
    size_t nkeys;

    /* Replay memory: a ring in arrival order (the oldest is overwritten) indexed by a chained
     * hash of the nonce. A call whose timestamp is not after the newest one ever overwritten is
     * refused as stale, so forgetting a nonce can never let it be replayed. */
    pthread_mutex_t mu;
    seen_t *ring;
    uint32_t *buckets; /* KVB_PD_AUTH_SEEN_MAX heads */
    uint32_t head, count;
    uint64_t floor_ms;
};

uint64_t kvb__pd_unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int fail(char *why, size_t cap, int rc, const char *fmt, const char *arg)
{
    if (why && cap)
        snprintf(why, cap, fmt, arg);
    return rc;
}

/* ---- API keys ------------------------------------------------------------------------------ */

static int add_key(kvb__pd_auth_t *a, const char *s, size_t n)
{
    api_key_t *nk = realloc(a->keys, (a->nkeys + 1) * sizeof *nk);
    if (!nk)
        return KVB_ERR_NOMEM;
    a->keys = nk;
    if (!(nk[a->nkeys].key = malloc(n + 1)))
        return KVB_ERR_NOMEM;
    memcpy(nk[a->nkeys].key, s, n);
    nk[a->nkeys].key[n] = '\0';
    nk[a->nkeys++].len = n;
    return KVB_OK;
}

bool kvb__pd_api_key_valid(const char *s, size_t n)
{
    bool ok = n >= 1 && n <= KVB_PD_API_KEY_MAX;
    for (size_t i = 0; ok && i < n; i++)
        ok = s[i] > 0x20 && s[i] < 0x7f;
    return ok;
}

/* One line of a key file (without its newline): a key, or nothing to add. */
static int key_line(kvb__pd_auth_t *a, char *line, size_t lineno, char *why, size_t cap)
{
    size_t n = strlen(line);
    while (n && isspace((unsigned char)line[n - 1]))
        line[--n] = '\0';
    char *s = line;
    while (isspace((unsigned char)*s))
        s++;
    n = strlen(s);
    if (!n || *s == '#')
        return KVB_OK;
    if (!kvb__pd_api_key_valid(s, n)) {
        if (why && cap)
            snprintf(why, cap, "line %zu: a key is 1..%u printable characters without spaces",
                     lineno, KVB_PD_API_KEY_MAX);
        return KVB_ERR_INVALID_ARG;
    }
    if (a->nkeys >= KVB_PD_API_KEYS_MAX) {
        if (why && cap)
            snprintf(why, cap, "more than %u keys", KVB_PD_API_KEYS_MAX);
        return KVB_ERR_INVALID_ARG;
    }
    return add_key(a, s, n);
}

static int load_keys(kvb__pd_auth_t *a, const char *path, char *why, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return fail(why, cap, KVB_ERR_NOT_FOUND, "cannot open %s", path);
    char line[KVB_PD_API_KEY_MAX + 64];
    size_t lineno = 0;
    int rc = KVB_OK;
    while (rc == KVB_OK && fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            snprintf(why, cap, "line %zu is too long", lineno);
            rc = KVB_ERR_INVALID_ARG;
            break;
        }
        rc = key_line(a, line, lineno, why, cap);
    }
    if (rc == KVB_OK && ferror(f))
        rc = fail(why, cap, KVB_ERR_SYSTEM, "cannot read %s", path);
    fclose(f);
    if (rc == KVB_OK && !a->nkeys)
        rc = fail(why, cap, KVB_ERR_INVALID_ARG, "%s holds no key", path);
    return rc;
}

int kvb__pd_auth_api_key(const kvb__pd_auth_t *a, const char *authorization)
{
    if (!a->nkeys)
        return KVB_OK;
    if (!authorization || strncasecmp(authorization, "Bearer ", 7))
        return KVB_ERR_AUTH;
    const char *k = authorization + 7;
    while (*k == ' ')
        k++;
    size_t n = strlen(k);
    bool match = false;
    /* Every key is looked at, so the time taken does not say which one nearly matched. */
    for (size_t i = 0; i < a->nkeys; i++)
        match |= a->keys[i].len == n && kvb__ct_equal(a->keys[i].key, k, n);
    return match ? KVB_OK : KVB_ERR_AUTH;
}

bool kvb__pd_auth_has_api_keys(const kvb__pd_auth_t *a)
{
    return a && a->nkeys;
}

const char *kvb__pd_auth_first_key(const kvb__pd_auth_t *a)
{
    return a && a->nkeys ? a->keys[0].key : NULL;
}

/* ---- create / free ------------------------------------------------------------------------- */

int kvb__pd_auth_create(const char *api_key_file, kvb__pd_auth_t **out, char *why, size_t cap)
{
    kvb__pd_auth_t *a = calloc(1, sizeof *a);
    if (!a)
        return KVB_ERR_NOMEM;
    pthread_mutex_init(&a->mu, NULL);
    int rc = KVB_OK;
    const char *file = getenv("KVB_SECRET_FILE");
    if (file && *file && (rc = kvb__secret_load(file, &a->secret, &a->secret_len)))
        fail(why, cap, rc, "cluster secret %s: unreadable, or not 16..4096 bytes", file);
    if (!rc && a->secret) {
        a->ring = calloc(KVB_PD_AUTH_SEEN_MAX, sizeof *a->ring);
        a->buckets = malloc(KVB_PD_AUTH_SEEN_MAX * sizeof *a->buckets);
        if (!a->ring || !a->buckets)
            rc = KVB_ERR_NOMEM;
        for (uint32_t i = 0; !rc && i < KVB_PD_AUTH_SEEN_MAX; i++)
            a->buckets[i] = NO_ENTRY;
    }
    if (!rc && api_key_file)
        rc = load_keys(a, api_key_file, why, cap);
    if (rc) {
        kvb__pd_auth_free(a);
        return rc;
    }
    *out = a;
    return KVB_OK;
}

void kvb__pd_auth_free(kvb__pd_auth_t *a)
{
    if (!a)
        return;
    kvb__secret_free(a->secret, a->secret_len);
    for (size_t i = 0; i < a->nkeys; i++) {
        kvb__wipe(a->keys[i].key, a->keys[i].len + 1);
        free(a->keys[i].key);
    }
    free(a->keys);
    free(a->ring);
    free(a->buckets);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

bool kvb__pd_auth_signed(const kvb__pd_auth_t *a)
{
    return a && a->secret;
}

/* ---- hex ------------------------------------------------------------------------------------ */

static void hex(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = '\0';
}

static int nibble(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Exactly 2n lowercase hex digits at s into b[0..n); false otherwise. */
static bool unhex(const char *s, uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int hi = nibble(s[2 * i]), lo = hi < 0 ? -1 : nibble(s[2 * i + 1]);
        if (lo < 0)
            return false;
        b[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

/* A decimal uint64 of 1..20 digits at *s, ending at `end`; advances *s past it. */
static bool parse_u64(const char **s, char end, uint64_t *v)
{
    const char *p = *s;
    uint64_t x = 0;
    size_t n = 0;
    for (; *p >= '0' && *p <= '9'; p++, n++) {
        if (x > (UINT64_MAX - 9) / 10)
            return false;
        x = x * 10 + (uint64_t)(*p - '0');
    }
    if (!n || n > 20 || *p != end)
        return false;
    *s = p + (end ? 1 : 0);
    *v = x;
    return true;
}

/* ---- signed calls --------------------------------------------------------------------------- */

static int call_mac(const kvb__pd_auth_t *a, const char *method, const char *path, const char *ts,
                    const char *nonce, const char *body, size_t len, uint8_t mac[KVB_MAC_LEN])
{
    /* Fields are newline-separated; none of them can hold a newline (the path is checked). */
    static const char tag[] = "kvbridge-pd-call-v1\n", nl[] = "\n";
    kvb_mac_part_t parts[] = {{tag, sizeof tag - 1},
                              {method, strlen(method)},
                              {nl, 1},
                              {path, strlen(path)},
                              {nl, 1},
                              {ts, strlen(ts)},
                              {nl, 1},
                              {nonce, strlen(nonce)},
                              {nl, 1},
                              {body ? body : "", body ? len : 0}};
    return kvb__hmac(a->secret, a->secret_len, parts, sizeof parts / sizeof parts[0], mac);
}

int kvb__pd_auth_sign(const kvb__pd_auth_t *a, const char *method, const char *path,
                      const char *body, size_t len, char out[KVB_PD_AUTH_LINE_MAX])
{
    out[0] = '\0';
    if (!kvb__pd_auth_signed(a))
        return KVB_OK;
    uint8_t nonce[NONCE_BYTES], mac[KVB_MAC_LEN];
    char ts[24], nonce_hex[2 * NONCE_BYTES + 1], mac_hex[2 * KVB_MAC_LEN + 1];
    snprintf(ts, sizeof ts, "%" PRIu64, kvb__pd_unix_ms());
    int rc = kvb__random(nonce, sizeof nonce);
    if (rc)
        return rc;
    hex(nonce, sizeof nonce, nonce_hex);
    if ((rc = call_mac(a, method, path, ts, nonce_hex, body, len, mac)))
        return rc;
    hex(mac, sizeof mac, mac_hex);
    snprintf(out, KVB_PD_AUTH_LINE_MAX, "%s: v1 %s %s %s", KVB_PD_AUTH_HEADER, ts, nonce_hex,
             mac_hex);
    return KVB_OK;
}

/* All 16 bytes mixed (a signer's nonces are random, but nothing here should depend on which of
 * their bytes vary: chains stay short whoever made them). */
static uint32_t bucket_of(const uint8_t *nonce)
{
    uint64_t lo, hi;
    memcpy(&lo, nonce, sizeof lo);
    memcpy(&hi, nonce + 8, sizeof hi);
    uint64_t h = lo ^ (hi + 0x9e3779b97f4a7c15ull); /* splitmix64's finalizer: every bit counts */
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    return (uint32_t)h & (KVB_PD_AUTH_SEEN_MAX - 1);
}

static bool seen_find(const kvb__pd_auth_t *a, const uint8_t *nonce)
{
    for (uint32_t i = a->buckets[bucket_of(nonce)]; i != NO_ENTRY; i = a->ring[i].next)
        if (!memcmp(a->ring[i].nonce, nonce, NONCE_BYTES))
            return true;
    return false;
}

/* Drops ring slot i from its bucket's chain. */
static void seen_unlink(kvb__pd_auth_t *a, uint32_t i)
{
    uint32_t *p = &a->buckets[bucket_of(a->ring[i].nonce)];
    while (*p != NO_ENTRY && *p != i)
        p = &a->ring[*p].next;
    if (*p == i)
        *p = a->ring[i].next;
}

static void seen_add(kvb__pd_auth_t *a, const uint8_t *nonce, uint64_t ts_ms)
{
    uint32_t i = a->head;
    if (a->count == KVB_PD_AUTH_SEEN_MAX) { /* full: forget the oldest, refuse anything older */
        seen_unlink(a, i);
        if (a->ring[i].ts_ms > a->floor_ms)
            a->floor_ms = a->ring[i].ts_ms;
    } else {
        a->count++;
    }
    memcpy(a->ring[i].nonce, nonce, NONCE_BYTES);
    a->ring[i].ts_ms = ts_ms;
    uint32_t b = bucket_of(nonce);
    a->ring[i].next = a->buckets[b];
    a->buckets[b] = i;
    a->head = (i + 1) % KVB_PD_AUTH_SEEN_MAX;
}

/* "v1 <ts> <32 hex> <64 hex>" into its parts; false if it is anything else. */
static bool parse_header(const char *h, uint64_t *ts, char ts_s[24], char nonce_hex[33],
                         uint8_t nonce[NONCE_BYTES], uint8_t mac[KVB_MAC_LEN])
{
    if (strncmp(h, "v1 ", 3))
        return false;
    const char *p = h + 3, *t = p;
    if (!parse_u64(&p, ' ', ts))
        return false;
    snprintf(ts_s, 24, "%.*s", (int)(p - 1 - t), t);
    if (strlen(p) != 2 * NONCE_BYTES + 1 + 2 * KVB_MAC_LEN || p[2 * NONCE_BYTES] != ' ' ||
        !unhex(p, nonce, NONCE_BYTES) || !unhex(p + 2 * NONCE_BYTES + 1, mac, KVB_MAC_LEN))
        return false;
    memcpy(nonce_hex, p, 2 * NONCE_BYTES);
    nonce_hex[2 * NONCE_BYTES] = '\0';
    return true;
}

int kvb__pd_auth_check(kvb__pd_auth_t *a, const char *method, const char *path, const char *hdr,
                       const char *body, size_t len, const char **reason)
{
    *reason = NULL;
    if (!kvb__pd_auth_signed(a))
        return KVB_OK;
    uint64_t ts;
    char ts_s[24], nonce_hex[2 * NONCE_BYTES + 1];
    uint8_t nonce[NONCE_BYTES], mac[KVB_MAC_LEN], want[KVB_MAC_LEN];
    *reason = "unauthenticated";
    if (!hdr || strchr(path, '\n') || !parse_header(hdr, &ts, ts_s, nonce_hex, nonce, mac))
        return KVB_ERR_AUTH;
    *reason = "bad_signature";
    if (call_mac(a, method, path, ts_s, nonce_hex, body, len, want) ||
        !kvb__ct_equal(mac, want, KVB_MAC_LEN))
        return KVB_ERR_AUTH;
    uint64_t now = kvb__pd_unix_ms();
    *reason = "stale";
    if (ts + KVB_PD_AUTH_SKEW_MS < now || ts > now + KVB_PD_AUTH_SKEW_MS)
        return KVB_ERR_AUTH;
    pthread_mutex_lock(&a->mu);
    int rc = KVB_OK;
    if (ts <= a->floor_ms)
        rc = KVB_ERR_AUTH;
    else if (seen_find(a, nonce))
        rc = KVB_ERR_AUTH, *reason = "replayed";
    else
        seen_add(a, nonce, ts);
    pthread_mutex_unlock(&a->mu);
    if (!rc)
        *reason = NULL;
    return rc;
}

/* ---- tickets -------------------------------------------------------------------------------- */

static int grant_mac(const kvb__pd_auth_t *a, const kvb__pd_grant_t *g, const char *expires,
                     uint8_t mac[KVB_MAC_LEN])
{
    static const char tag[] = "kvbridge-pd-ticket-v1\n", nl[] = "\n";
    size_t n = 6 + 2 * g->nsegs + 1, k = 0;
    kvb_mac_part_t *parts = calloc(n, sizeof *parts);
    uint8_t *blocks = calloc(g->nblocks ? g->nblocks : 1, 8);
    int rc = KVB_ERR_NOMEM;
    if (parts && blocks) {
        parts[k++] = (kvb_mac_part_t){tag, sizeof tag - 1};
        parts[k++] = (kvb_mac_part_t){g->kind, strlen(g->kind) + 1}; /* with its NUL */
        parts[k++] = (kvb_mac_part_t){g->request_id, strlen(g->request_id) + 1};
        parts[k++] = (kvb_mac_part_t){expires, strlen(expires) + 1};
        for (size_t i = 0; i < g->nsegs; i++) {
            parts[k++] = (kvb_mac_part_t){g->segs[i], strlen(g->segs[i])};
            parts[k++] = (kvb_mac_part_t){nl, 1};
        }
        parts[k++] = (kvb_mac_part_t){nl, 1};   /* the end of the segment list */
        for (size_t i = 0; i < g->nblocks; i++) /* little-endian, fixed width */
            for (int b = 0; b < 8; b++)
                blocks[8 * i + (size_t)b] = (uint8_t)(g->blocks[i] >> (8 * b));
        parts[k++] = (kvb_mac_part_t){blocks, 8 * g->nblocks};
        rc = kvb__hmac(a->secret, a->secret_len, parts, k, mac);
    }
    free(parts);
    free(blocks);
    return rc;
}

int kvb__pd_ticket_make(const kvb__pd_auth_t *a, const kvb__pd_grant_t *g, uint64_t expires_ms,
                        char out[KVB_PD_TICKET_MAX])
{
    char exp[24], mac_hex[2 * KVB_MAC_LEN + 1];
    uint8_t mac[KVB_MAC_LEN];
    snprintf(exp, sizeof exp, "%" PRIu64, expires_ms);
    int rc = grant_mac(a, g, exp, mac);
    if (rc)
        return rc;
    hex(mac, sizeof mac, mac_hex);
    snprintf(out, KVB_PD_TICKET_MAX, "v1.%s.%s", exp, mac_hex);
    return KVB_OK;
}

int kvb__pd_ticket_check(const kvb__pd_auth_t *a, const kvb__pd_grant_t *g, const char *ticket,
                         uint64_t *expires_ms, const char **reason)
{
    *reason = "missing_ticket";
    if (!ticket)
        return KVB_ERR_AUTH;
    *reason = "foreign_blocks";
    if (strncmp(ticket, "v1.", 3))
        return KVB_ERR_AUTH;
    const char *p = ticket + 3, *e = p;
    uint64_t expires;
    uint8_t mac[KVB_MAC_LEN], want[KVB_MAC_LEN];
    if (!parse_u64(&p, '.', &expires) || strlen(p) != 2 * KVB_MAC_LEN ||
        !unhex(p, mac, KVB_MAC_LEN))
        return KVB_ERR_AUTH;
    char exp[24];
    snprintf(exp, sizeof exp, "%.*s", (int)(p - 1 - e), e);
    if (grant_mac(a, g, exp, want) || !kvb__ct_equal(mac, want, KVB_MAC_LEN))
        return KVB_ERR_AUTH;
    *reason = "ticket_expired";
    if (kvb__pd_unix_ms() > expires)
        return KVB_ERR_AUTH;
    if (expires_ms)
        *expires_ms = expires;
    *reason = NULL;
    return KVB_OK;
}
