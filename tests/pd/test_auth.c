/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/pd/auth.c: signed internal calls (round trip, every field covered by the MAC,
 * stale, replayed, malformed, the bounded nonce memory), tickets (exact grant, expiry, any other
 * request, block or segment refused) and bearer API keys (file format, constant-time match). */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/auth.h"
#include "kvbridge/status.h"
#include "pd/auth.h"

static char dir[64];
static char secret_path[128];
static uint8_t *test_secret; /* loaded once per test: sign_at runs 65536 times in one */
static size_t test_secret_len;

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/kvb-auth-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(secret_path, sizeof secret_path, "%s/secret", dir);
    write_file(secret_path, "a cluster secret of some length\n");
    chmod(secret_path, 0600);
    setenv("KVB_SECRET_FILE", secret_path, 1);
}

static void teardown(void)
{
    kvb__secret_free(test_secret, test_secret_len);
    test_secret = NULL;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(pd_auth, .init = setup, .fini = teardown, .timeout = 60);

static kvb__pd_auth_t *make(const char *keys)
{
    kvb__pd_auth_t *a = NULL;
    char why[256] = "";
    cr_assert_eq(kvb__pd_auth_create(keys, &a, why, sizeof why), KVB_OK, "%s", why);
    return a;
}

/* The header's value: what follows "X-Kvb-Auth: ". */
static const char *value(const char *line)
{
    const char *v = strchr(line, ':');
    cr_assert_not_null(v);
    return v + 2;
}

static const char *check(kvb__pd_auth_t *a, const char *method, const char *path, const char *hdr,
                         const char *body)
{
    const char *reason = "unset";
    int rc = kvb__pd_auth_check(a, method, path, hdr, body, body ? strlen(body) : 0, &reason);
    cr_assert_eq(rc == KVB_OK, reason == NULL, "rc %d, reason %s", rc, reason ? reason : "-");
    return rc == KVB_OK ? "ok" : reason;
}

Test(pd_auth, signed_call_round_trip)
{
    kvb__pd_auth_t *a = make(NULL);
    cr_assert(kvb__pd_auth_signed(a));
    char line[KVB_PD_AUTH_LINE_MAX];
    const char *body = "{\"request_id\": \"r1\"}";
    cr_assert_eq(kvb__pd_auth_sign(a, "POST", "/pd/prefill", body, strlen(body), line), KVB_OK);
    cr_assert(!strncmp(line, KVB_PD_AUTH_HEADER ": v1 ", strlen(KVB_PD_AUTH_HEADER) + 5), "%s",
              line);
    cr_assert_str_eq(check(a, "POST", "/pd/prefill", value(line), body), "ok");
    /* The same call again is a replay, however correct its signature. */
    cr_assert_str_eq(check(a, "POST", "/pd/prefill", value(line), body), "replayed");
    kvb__pd_auth_free(a);
}

Test(pd_auth, every_field_is_signed)
{
    kvb__pd_auth_t *a = make(NULL);
    char line[KVB_PD_AUTH_LINE_MAX];
    const char *body = "{\"request_id\": \"r1\", \"decode_blocks\": [1, 2]}";
    cr_assert_eq(kvb__pd_auth_sign(a, "POST", "/pd/prefill", body, strlen(body), line), KVB_OK);
    char v[KVB_PD_AUTH_LINE_MAX];
    snprintf(v, sizeof v, "%s", value(line));
    cr_assert_str_eq(check(a, "GET", "/pd/prefill", v, body), "bad_signature");
    cr_assert_str_eq(check(a, "POST", "/pd/decode", v, body), "bad_signature");
    cr_assert_str_eq(check(a, "POST", "/pd/prefill", v,
                           "{\"request_id\": \"r1\", "
                           "\"decode_blocks\": [1, 3]}"),
                     "bad_signature");
    /* Each of timestamp, nonce and MAC changed by one digit. */
    size_t n = strlen(v);
    char *m = strdup(v);
    size_t at[] = {3, strchr(v + 3, ' ') - v + 1, n - 1};
    for (size_t i = 0; i < 3; i++) {
        strcpy(m, v);
        m[at[i]] = m[at[i]] == '1' ? '2' : '1';
        cr_assert_str_eq(check(a, "POST", "/pd/prefill", m, body), "bad_signature", "field %zu", i);
    }
    /* Another secret signs differently. */
    write_file(secret_path, "another secret, just as long\n");
    kvb__pd_auth_t *b = make(NULL);
    cr_assert_eq(kvb__pd_auth_sign(b, "POST", "/pd/prefill", body, strlen(body), line), KVB_OK);
    cr_assert_str_eq(check(a, "POST", "/pd/prefill", value(line), body), "bad_signature");
    cr_assert_str_eq(check(a, "POST", "/pd/prefill", v, body), "ok"); /* the original, untouched */
    free(m);
    kvb__pd_auth_free(a);
    kvb__pd_auth_free(b);
}

Test(pd_auth, malformed_headers)
{
    kvb__pd_auth_t *a = make(NULL);
    const char *bad[] = {
        "",
        "v1",
        "v2 1 00000000000000000000000000000000 "
        "0000000000000000000000000000000000000000000000000000000000000000",
        "v1  00000000000000000000000000000000 "
        "0000000000000000000000000000000000000000000000000000000000000000",
        "v1 123456789012345678901 00000000000000000000000000000000 "
        "0000000000000000000000000000000000000000000000000000000000000000",
        "v1 1 0000000000000000000000000000000 "
        "0000000000000000000000000000000000000000000000000000000000000000",
        "v1 1 00000000000000000000000000000000 "
        "000000000000000000000000000000000000000000000000000000000000000",
        "v1 1 00000000000000000000000000000000 "
        "00000000000000000000000000000000000000000000000000000000000000000",
        "v1 1 0000000000000000000000000000000G "
        "0000000000000000000000000000000000000000000000000000000000000000",
        "v1 1 00000000000000000000000000000000 "
        "000000000000000000000000000000000000000000000000000000000000000A",
    };
    cr_assert_str_eq(check(a, "GET", "/pd/info", NULL, NULL), "unauthenticated");
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_str_eq(check(a, "GET", "/pd/info", bad[i], NULL), "unauthenticated", "#%zu", i);
    kvb__pd_auth_free(a);
}

/* A header signed as kvb__pd_auth_sign would, at a timestamp of our choosing. */
static void sign_at(uint64_t ts_ms, const char *nonce_hex, const char *path, char *out, size_t cap)
{
    uint8_t mac[KVB_MAC_LEN];
    if (!test_secret)
        cr_assert_eq(kvb__secret_load(secret_path, &test_secret, &test_secret_len), KVB_OK);
    const uint8_t *secret = test_secret;
    size_t len = test_secret_len;
    char ts[24];
    snprintf(ts, sizeof ts, "%" PRIu64, ts_ms);
    kvb_mac_part_t parts[] = {{"kvbridge-pd-call-v1\nGET\n", 24},
                              {path, strlen(path)},
                              {"\n", 1},
                              {ts, strlen(ts)},
                              {"\n", 1},
                              {nonce_hex, 32},
                              {"\n", 1}};
    cr_assert_eq(kvb__hmac(secret, len, parts, sizeof parts / sizeof *parts, mac), KVB_OK);
    int n = snprintf(out, cap, "v1 %s %s ", ts, nonce_hex);
    for (size_t i = 0; i < KVB_MAC_LEN; i++)
        n += snprintf(out + n, cap - (size_t)n, "%02x", mac[i]);
}

Test(pd_auth, stale_calls)
{
    kvb__pd_auth_t *a = make(NULL);
    char h[200];
    uint64_t now = kvb__pd_unix_ms();
    sign_at(now, "0123456789abcdef0123456789abcdef", "/pd/info", h, sizeof h);
    cr_assert_str_eq(check(a, "GET", "/pd/info", h, NULL), "ok"); /* the format is the one above */
    sign_at(now - KVB_PD_AUTH_SKEW_MS - 5000, "1123456789abcdef0123456789abcdef", "/pd/info", h,
            sizeof h);
    cr_assert_str_eq(check(a, "GET", "/pd/info", h, NULL), "stale");
    sign_at(now + KVB_PD_AUTH_SKEW_MS + 5000, "2123456789abcdef0123456789abcdef", "/pd/info", h,
            sizeof h);
    cr_assert_str_eq(check(a, "GET", "/pd/info", h, NULL), "stale");
    sign_at(now - 1000, "3123456789abcdef0123456789abcdef", "/pd/info", h, sizeof h);
    cr_assert_str_eq(check(a, "GET", "/pd/info", h, NULL), "ok"); /* within the skew */
    kvb__pd_auth_free(a);
}

/* Once the nonce memory is full the oldest is forgotten, and with it every call as old: a
 * forgotten nonce is refused as stale, never accepted again. */
Test(pd_auth, nonce_memory_is_bounded_and_safe)
{
    kvb__pd_auth_t *a = make(NULL);
    char first[200], h[200], nonce[33];
    uint64_t t0 = kvb__pd_unix_ms() - 2000;
    sign_at(t0, "ffffffffffffffffffffffffffffffff", "/pd/info", first, sizeof first);
    cr_assert_str_eq(check(a, "GET", "/pd/info", first, NULL), "ok");
    for (uint32_t i = 0; i < KVB_PD_AUTH_SEEN_MAX; i++) {
        /* Signed now (a slow, sanitized run takes tens of seconds), and always after t0. */
        uint64_t ts = kvb__pd_unix_ms() - 1000;
        snprintf(nonce, sizeof nonce, "%032" PRIx32, i);
        sign_at(ts > t0 ? ts : t0 + 1, nonce, "/pd/info", h, sizeof h);
        cr_assert_str_eq(check(a, "GET", "/pd/info", h, NULL), "ok", "call %u", i);
    }
    cr_assert_str_eq(check(a, "GET", "/pd/info", first, NULL), "stale");
    /* The newest are still remembered. */
    cr_assert_str_eq(check(a, "GET", "/pd/info", h, NULL), "replayed");
    kvb__pd_auth_free(a);
}

Test(pd_auth, no_secret_no_signature)
{
    unsetenv("KVB_SECRET_FILE");
    kvb__pd_auth_t *a = make(NULL);
    cr_assert(!kvb__pd_auth_signed(a));
    char line[KVB_PD_AUTH_LINE_MAX] = "x";
    cr_assert_eq(kvb__pd_auth_sign(a, "GET", "/pd/info", NULL, 0, line), KVB_OK);
    cr_assert_str_eq(line, "");
    cr_assert_str_eq(check(a, "GET", "/pd/info", NULL, NULL), "ok");
    kvb__pd_auth_free(a);
}

Test(pd_auth, bad_secret_file)
{
    char p[160], why[256] = "";
    snprintf(p, sizeof p, "%s/short", dir);
    write_file(p, "too short\n");
    setenv("KVB_SECRET_FILE", p, 1);
    kvb__pd_auth_t *a = NULL;
    cr_assert_neq(kvb__pd_auth_create(NULL, &a, why, sizeof why), KVB_OK);
    cr_assert_null(a);
    cr_assert(strstr(why, p), "%s", why);
    setenv("KVB_SECRET_FILE", "/nonexistent/secret", 1);
    cr_assert_neq(kvb__pd_auth_create(NULL, &a, why, sizeof why), KVB_OK);
}

/* ---- tickets ------------------------------------------------------------------------------ */

static char *segs[] = {"127.0.0.1:4000", "127.0.0.1:4001"};
static const uint64_t blocks[] = {7, 3, 12};

static kvb__pd_grant_t grant(void)
{
    return (kvb__pd_grant_t){.kind = "lease",
                             .request_id = "r1",
                             .segs = segs,
                             .nsegs = 2,
                             .blocks = blocks,
                             .nblocks = 3};
}

static const char *ticket_verdict(kvb__pd_auth_t *a, const kvb__pd_grant_t *g, const char *t)
{
    const char *reason = "unset";
    int rc = kvb__pd_ticket_check(a, g, t, NULL, &reason);
    return rc == KVB_OK ? "ok" : reason;
}

Test(pd_auth, tickets_vouch_for_exactly_one_grant)
{
    kvb__pd_auth_t *a = make(NULL);
    kvb__pd_grant_t g = grant();
    char t[KVB_PD_TICKET_MAX];
    uint64_t expires = kvb__pd_unix_ms() + 10000, said = 0;
    cr_assert_eq(kvb__pd_ticket_make(a, &g, expires, t), KVB_OK);
    cr_assert_str_eq(ticket_verdict(a, &g, t), "ok");
    const char *reason;
    cr_assert_eq(kvb__pd_ticket_check(a, &g, t, &said, &reason), KVB_OK);
    cr_assert_eq(said, expires, "the expiry it vouches for"); /* what a decode's reads must beat */
    cr_assert_str_eq(ticket_verdict(a, &g, NULL), "missing_ticket");

    kvb__pd_grant_t o = g;
    o.request_id = "r2";
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    o = g;
    o.kind = "reservation";
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    uint64_t other[] = {7, 3, 13};
    o = g;
    o.blocks = other;
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    o = g;
    o.nblocks = 2; /* a prefix of the grant */
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    o = g;
    o.nsegs = 1;
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    char *moved[] = {"127.0.0.1:4000", "127.0.0.1:5001"};
    o = g;
    o.segs = moved;
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    /* A later expiry written into the ticket breaks its MAC. */
    char longer[KVB_PD_TICKET_MAX];
    snprintf(longer, sizeof longer, "%s", t);
    longer[3] = longer[3] == '9' ? '8' : '9';
    cr_assert_str_eq(ticket_verdict(a, &g, longer), "foreign_blocks");
    cr_assert_str_eq(ticket_verdict(a, &g, "v1"), "foreign_blocks");
    cr_assert_str_eq(ticket_verdict(a, &g, "v1.12.zz"), "foreign_blocks");
    cr_assert_str_eq(ticket_verdict(a, &g, ""), "foreign_blocks");
    kvb__pd_auth_free(a);
}

Test(pd_auth, tickets_expire)
{
    kvb__pd_auth_t *a = make(NULL);
    kvb__pd_grant_t g = grant();
    char t[KVB_PD_TICKET_MAX];
    cr_assert_eq(kvb__pd_ticket_make(a, &g, kvb__pd_unix_ms() - 1, t), KVB_OK);
    cr_assert_str_eq(ticket_verdict(a, &g, t), "ticket_expired");
    kvb__pd_auth_free(a);
}

Test(pd_auth, tickets_without_a_secret_still_bind_the_grant)
{
    unsetenv("KVB_SECRET_FILE");
    kvb__pd_auth_t *a = make(NULL);
    kvb__pd_grant_t g = grant(), o = grant();
    o.request_id = "r2";
    char t[KVB_PD_TICKET_MAX];
    cr_assert_eq(kvb__pd_ticket_make(a, &g, kvb__pd_unix_ms() + 10000, t), KVB_OK);
    cr_assert_str_eq(ticket_verdict(a, &g, t), "ok");
    cr_assert_str_eq(ticket_verdict(a, &o, t), "foreign_blocks");
    kvb__pd_auth_free(a);
}

/* ---- API keys ----------------------------------------------------------------------------- */

Test(pd_auth, api_keys)
{
    char p[160];
    snprintf(p, sizeof p, "%s/keys", dir);
    write_file(p, "# serving keys\n\n  sk-first-key  \nsk-second\r\n");
    kvb__pd_auth_t *a = make(p);
    cr_assert(kvb__pd_auth_has_api_keys(a));
    cr_assert_eq(kvb__pd_auth_api_key(a, "Bearer sk-first-key"), KVB_OK);
    cr_assert_eq(kvb__pd_auth_api_key(a, "bearer sk-second"), KVB_OK);
    cr_assert_eq(kvb__pd_auth_api_key(a, NULL), KVB_ERR_AUTH);
    cr_assert_eq(kvb__pd_auth_api_key(a, ""), KVB_ERR_AUTH);
    cr_assert_eq(kvb__pd_auth_api_key(a, "sk-second"), KVB_ERR_AUTH);
    cr_assert_eq(kvb__pd_auth_api_key(a, "Bearer sk-secon"), KVB_ERR_AUTH);
    cr_assert_eq(kvb__pd_auth_api_key(a, "Bearer sk-second2"), KVB_ERR_AUTH);
    cr_assert_eq(kvb__pd_auth_api_key(a, "Bearer # serving keys"), KVB_ERR_AUTH);
    cr_assert_eq(kvb__pd_auth_api_key(a, "Basic c2stc2Vjb25k"), KVB_ERR_AUTH);
    kvb__pd_auth_free(a);
    a = make(NULL); /* no keys: open */
    cr_assert(!kvb__pd_auth_has_api_keys(a));
    cr_assert_eq(kvb__pd_auth_api_key(a, NULL), KVB_OK);
    kvb__pd_auth_free(a);
}

Test(pd_auth, bad_api_key_files)
{
    const char *bad[] = {"", "# only a comment\n", "two words\n", "tab\there\n"};
    char p[160], why[256];
    snprintf(p, sizeof p, "%s/keys", dir);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_file(p, bad[i]);
        kvb__pd_auth_t *a = NULL;
        why[0] = '\0';
        cr_assert_eq(kvb__pd_auth_create(p, &a, why, sizeof why), KVB_ERR_INVALID_ARG, "#%zu", i);
        cr_assert_null(a);
        cr_assert_neq(why[0], '\0');
    }
    char big[KVB_PD_API_KEY_MAX + 3];
    memset(big, 'k', sizeof big - 2);
    big[sizeof big - 2] = '\n';
    big[sizeof big - 1] = '\0';
    write_file(p, big);
    kvb__pd_auth_t *a = NULL;
    cr_assert_eq(kvb__pd_auth_create(p, &a, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__pd_auth_create("/nonexistent/keys", &a, why, sizeof why), KVB_ERR_NOT_FOUND);
}
