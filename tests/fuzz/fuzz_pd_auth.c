/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for what a caller of a PD instance controls in src/pd/auth.c: the X-Kvb-Auth
 * header of an internal call, the body it signs, a ticket, and the Authorization header of
 * /v1/completions. Nothing forged may ever be accepted, and nothing may crash or read out of
 * bounds. Input: header line '\n' ticket line '\n' Authorization line '\n' body. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "fuzz.h"
#include "kvbridge/engine.h"
#include "pd/auth.h"

static kvb__pd_auth_t *auth;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvb_log_set_level(0);
    char secret[] = "/tmp/kvb-fuzz-secret-XXXXXX", keys[] = "/tmp/kvb-fuzz-keys-XXXXXX";
    int fs = mkstemp(secret), fk = mkstemp(keys);
    if (fs < 0 || fk < 0 || write(fs, "a secret for the fuzzer only\n", 29) != 29 ||
        write(fk, "sk-fuzz\n", 8) != 8)
        abort();
    close(fs);
    close(fk);
    setenv("KVB_SECRET_FILE", secret, 1);
    char why[256];
    if (kvb__pd_auth_create(keys, &auth, why, sizeof why))
        abort();
    unlink(secret);
    unlink(keys);
    return 0;
}

/* The next line of data[*at..size) as a NUL-terminated copy (NULL when empty). */
static char *next_line(const uint8_t *data, size_t size, size_t *at)
{
    const uint8_t *s = data + *at, *nl = memchr(s, '\n', size - *at);
    size_t n = nl ? (size_t)(nl - s) : size - *at;
    *at += n + (nl ? 1 : 0);
    if (!n)
        return NULL;
    char *c = malloc(n + 1);
    if (!c)
        abort();
    memcpy(c, s, n);
    c[n] = '\0';
    return c;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t at = 0;
    char *hdr = next_line(data, size, &at), *ticket = next_line(data, size, &at);
    char *authz = next_line(data, size, &at);
    const char *body = (const char *)data + at, *reason;
    size_t len = size - at;
    if (kvb__pd_auth_check(auth, "POST", "/pd/prefill", hdr, body, len, &reason) == KVB_OK)
        __builtin_trap(); /* a signature without the secret */
    if (!reason)
        __builtin_trap();
    static char *segs[] = {"127.0.0.1:7000"};
    uint64_t blocks[] = {1, 2, 3};
    kvb__pd_grant_t g = {.kind = "lease",
                         .request_id = "r",
                         .segs = segs,
                         .nsegs = 1,
                         .blocks = blocks,
                         .nblocks = 3};
    if (kvb__pd_ticket_check(auth, &g, ticket, NULL, &reason) == KVB_OK)
        __builtin_trap(); /* a ticket without the secret */
    if (kvb__pd_auth_api_key(auth, authz) == KVB_OK) {
        /* Only "Bearer" (any case), spaces, then exactly the key. */
        const char *k = authz + 7;
        while (*k == ' ')
            k++;
        if (strncasecmp(authz, "bearer ", 7) || strcmp(k, "sk-fuzz"))
            __builtin_trap();
    }
    free(hdr);
    free(ticket);
    free(authz);
    return 0;
}
