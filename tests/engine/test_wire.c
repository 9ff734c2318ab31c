/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the wire codecs (src/engine/wire.c), protocol version 3: header round trips and
 * validation, hello, challenge and hello_ack round trips, the handshake MACs, ERROR status mapping,
 * every truncation, every limit and one over, and a seeded mutation fuzz.
 * Inputs are decoded from exact-size heap copies so that AddressSanitizer sees any over-read. */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/wire.h"

/* --- helpers ------------------------------------------------------------------------------ */

/* hello: incarnation u64 | pid u32 | lane u32 | host_id[16] | nonce[32] | name_len u16 | name,
 * spelled out independently of wire.c. */
#define HELLO_HOST_OFF     16
#define HELLO_NONCE_OFF    (HELLO_HOST_OFF + KVB_HOST_ID_LEN)
#define HELLO_NAME_LEN_OFF (HELLO_NONCE_OFF + KVB_WIRE_NONCE_LEN)
#define HELLO_NAME_OFF     (HELLO_NAME_LEN_OFF + 2)

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* Deterministic xorshift64*: the fuzz loop and the test data must be reproducible. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* A heap copy of exactly len bytes (at least one byte allocated), so reads past len are caught. */
static uint8_t *exact_copy(const uint8_t *src, size_t len)
{
    uint8_t *p = malloc(len ? len : 1);
    cr_assert_not_null(p);
    if (len)
        memcpy(p, src, len);
    return p;
}

static kvb_frame_hdr_t mkhdr(uint8_t type, int32_t status, uint64_t len)
{
    kvb_frame_hdr_t h = {.type = type,
                         .version = KVB_WIRE_VERSION,
                         .status = status,
                         .id = 0x1122334455667788ull,
                         .addr = 0xfedcba9876543210ull,
                         .len = len};
    return h;
}

/* Encodes h and decodes it back into *out. */
static int hdr_roundtrip(const kvb_frame_hdr_t *h, kvb_frame_hdr_t *out)
{
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    char why[128];
    kvb__wire_encode_hdr(h, buf);
    return kvb__wire_decode_hdr(buf, out, why, sizeof why);
}

static int hdr_decode_raw(const uint8_t buf[KVB_WIRE_HDR_SIZE])
{
    kvb_frame_hdr_t out;
    char why[128] = "";
    int rc = kvb__wire_decode_hdr(buf, &out, why, sizeof why);
    if (rc != KVB_OK)
        cr_assert_gt(strlen(why), 0, "an error must come with a reason");
    return rc;
}

static int is_response_type(int t)
{
    return t == KVB_FRAME_HELLO_ACK || t == KVB_FRAME_READ_RESP || t == KVB_FRAME_WRITE_ACK ||
           t == KVB_FRAME_NOTIFY_ACK || t == KVB_FRAME_ERROR;
}

static uint64_t type_limit(int t)
{
    switch (t) {
    case KVB_FRAME_HELLO:
        return KVB_WIRE_MAX_HELLO;
    case KVB_FRAME_HELLO_ACK:
        return KVB_WIRE_MAX_HELLO_ACK;
    case KVB_FRAME_ATTRS:
        return KVB_WIRE_MAX_ATTRS;
    case KVB_FRAME_CHALLENGE:
        return KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN;
    case KVB_FRAME_AUTH:
        return KVB_WIRE_MAC_LEN;
    case KVB_FRAME_NOTIFY:
        return KVB_NOTIFY_MAX;
    case KVB_FRAME_READ_REQ:
    case KVB_FRAME_READ_RESP:
    case KVB_FRAME_WRITE_REQ:
    case KVB_FRAME_WRITE_ACK:
        return KVB_WIRE_MAX_DATA;
    default:
        return 0;
    }
}

/* The smallest length a header of type t may carry: AUTH is exactly one MAC, nothing else. */
static uint64_t type_min(int t)
{
    return t == KVB_FRAME_AUTH ? KVB_WIRE_MAC_LEN : 0;
}

static kvb_hello_t sample_hello(const char *name)
{
    kvb_hello_t h = {.incarnation = 0x0102030405060708ull, .pid = 0xA1B2C3D4u, .lane = 7};
    for (int i = 0; i < KVB_HOST_ID_LEN; i++)
        h.host_id[i] = (uint8_t)(0xF0 + i);
    for (int i = 0; i < KVB_WIRE_NONCE_LEN; i++)
        h.nonce[i] = (uint8_t)(0x40 + 3 * i);
    snprintf(h.name, sizeof h.name, "%s", name);
    return h;
}

static void assert_hello_eq(const kvb_hello_t *a, const kvb_hello_t *b)
{
    cr_assert_eq(a->incarnation, b->incarnation);
    cr_assert_eq(a->pid, b->pid);
    cr_assert_eq(a->lane, b->lane);
    cr_assert_arr_eq(a->host_id, b->host_id, KVB_HOST_ID_LEN);
    cr_assert_arr_eq(a->nonce, b->nonce, KVB_WIRE_NONCE_LEN);
    cr_assert_str_eq(a->name, b->name);
}

/* Encodes a hello into a fresh heap buffer of exactly its size. */
static uint8_t *hello_bytes(const kvb_hello_t *h, size_t *len)
{
    size_t n = kvb__wire_hello_size(h);
    uint8_t *buf = malloc(n);
    cr_assert_not_null(buf);
    cr_assert_eq(kvb__wire_hello_encode(h, buf), n);
    *len = n;
    return buf;
}

/* Raw hello bytes with an arbitrary name length field and name bytes (for over-limit cases the
 * encoder cannot produce). */
static uint8_t *raw_hello(uint16_t name_len_field, const uint8_t *name, size_t name_bytes,
                          size_t *len)
{
    size_t n = HELLO_NAME_OFF + name_bytes;
    uint8_t *buf = calloc(1, n);
    cr_assert_not_null(buf);
    put64(buf, 42);
    put32(buf + 8, 1234);
    put32(buf + 12, 0);
    memset(buf + HELLO_HOST_OFF, 0xAB, KVB_HOST_ID_LEN);
    memset(buf + HELLO_NONCE_OFF, 0xCD, KVB_WIRE_NONCE_LEN);
    put16(buf + HELLO_NAME_LEN_OFF, name_len_field);
    if (name_bytes)
        memcpy(buf + HELLO_NAME_OFF, name, name_bytes);
    *len = n;
    return buf;
}

static int hello_decode_exact(const uint8_t *src, size_t len, kvb_hello_t *out)
{
    uint8_t *copy = exact_copy(src, len);
    int rc = kvb__wire_hello_decode(copy, len, out);
    free(copy);
    return rc;
}

/* Decodes a hello_ack from an exact-size copy; on failure checks the outputs were not touched. */
static int ack_decode_exact(const uint8_t *src, size_t len, kvb_hello_t *hello,
                            kvb_region_desc_t **regions, size_t *n)
{
    uint8_t *copy = exact_copy(src, len);
    kvb_region_desc_t *const sentinel_ptr = (kvb_region_desc_t *)(uintptr_t)0x5a5a5a5a;
    *regions = sentinel_ptr;
    *n = 0xdeadbeef;
    kvb_hello_t before;
    memset(&before, 0x5a, sizeof before);
    memcpy(hello, &before, sizeof before);
    int rc = kvb__wire_hello_ack_decode(copy, len, hello, regions, n);
    free(copy);
    if (rc != KVB_OK) {
        cr_assert_arr_eq(hello, &before, sizeof before, "hello set on failure");
        cr_assert_eq(*regions, sentinel_ptr, "regions set on failure");
        cr_assert_eq(*n, 0xdeadbeef, "count set on failure");
        *regions = NULL;
    }
    return rc;
}

/* Room for one region's key run in the tests: more than a valid run may take, so that runs over
 * KVB_REGION_KEYS_MAX can be written too. */
#define KEYS_CAP 1024

/* Deterministic key bytes for (path, salt). */
static void key_fill(uint8_t *dst, size_t n, unsigned path, unsigned salt)
{
    for (size_t j = 0; j < n; j++)
        dst[j] = (uint8_t)(path * 37u + salt * 101u + j * 11u + 1u);
}

/* Appends a (path u8 | key_len u8 | key) entry with key_fill bytes to d's key run, which lives in
 * store[0..KEYS_CAP). No validity checks: the tests build bad runs with it too. */
static void add_key(kvb_region_desc_t *d, uint8_t *store, unsigned path, size_t klen, unsigned salt)
{
    cr_assert(d->keys == NULL || d->keys == store, "one store per region");
    cr_assert_leq(klen, 0xFF);
    cr_assert_leq(d->keys_len + 2u + klen, KEYS_CAP);
    uint8_t *p = store + d->keys_len;
    p[0] = (uint8_t)path;
    p[1] = (uint8_t)klen;
    key_fill(p + 2, klen, path, salt);
    d->keys = store;
    d->keys_len = (uint16_t)(d->keys_len + 2 + klen);
}

/* Sets a descriptor's declared fields, and kind/device as kvb__mem_kind_parse reads location. */
static void set_region(kvb_region_desc_t *d, uint64_t addr, uint64_t len, unsigned access,
                       const char *location)
{
    memset(d, 0, sizeof *d);
    d->info.addr = addr;
    d->info.len = len;
    d->info.access = access;
    cr_assert_leq(strlen(location), KVB_LOCATION_MAX);
    strcpy(d->info.location, location);
    if (kvb__mem_kind_parse(location, &d->kind, &d->device) != KVB_OK) {
        d->kind = KVB_MEM_CPU; /* a location the tests mean to be refused */
        d->device = -1;
    }
}

/* Writes a valid location of exactly n bytes (n = 1, 3 or >= 5): "*", "cpu" or "cpu:00..07". */
static void valid_location(char *dst, size_t n)
{
    cr_assert(n == 1 || n == 3 || n >= 5, "no valid location of %zu bytes", n);
    if (n == 1) {
        memcpy(dst, "*", 1);
    } else if (n == 3) {
        memcpy(dst, "cpu", 3);
    } else {
        memcpy(dst, "cpu:", 4);
        memset(dst + 4, '0', n - 4);
        dst[n - 1] = '7';
    }
}

/* Sorted, disjoint regions (sometimes adjacent) with random valid locations and, when keys is not
 * NULL (n * KEYS_CAP bytes), 0..3 key entries each for distinct paths, 1..max_key bytes long. */
static void fill_regions(kvb_region_desc_t *r, size_t n, uint64_t seed, uint8_t *keys,
                         size_t max_key)
{
    uint64_t addr = rng_next(&seed) % (1ull << 40);
    for (size_t i = 0; i < n; i++) {
        uint64_t len = 1 + rng_next(&seed) % (1ull << 32);
        char loc[KVB_LOCATION_MAX + 1];
        unsigned dev = (unsigned)(rng_next(&seed) % 65536);
        switch (rng_next(&seed) % 4) {
        case 0:
            strcpy(loc, "*");
            break;
        case 1:
            strcpy(loc, "cpu");
            break;
        case 2:
            snprintf(loc, sizeof loc, "cpu:%u", dev);
            break;
        default:
            snprintf(loc, sizeof loc, "cuda:%u", dev);
            break;
        }
        set_region(&r[i], addr, len, 1 + (unsigned)(i % 3), loc);
        cr_assert_eq(kvb__mem_kind_parse(loc, &r[i].kind, &r[i].device), KVB_OK, "%s", loc);
        if (keys) {
            unsigned used = 0, nkeys = (unsigned)(rng_next(&seed) % 4);
            for (unsigned k = 0; k < nkeys; k++) {
                unsigned path = (unsigned)(rng_next(&seed) % KVB_PATHS_MAX);
                if (used & (1u << path))
                    continue;
                used |= 1u << path;
                add_key(&r[i], keys + i * KEYS_CAP, path, 1 + rng_next(&seed) % max_key,
                        (unsigned)i);
            }
        }
        uint64_t gap = rng_next(&seed) % 3 == 0 ? 0 : rng_next(&seed) % (1ull << 20);
        addr += len + gap;
    }
}

static void assert_regions_eq(const kvb_region_desc_t *a, const kvb_region_desc_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(a[i].info.addr, b[i].info.addr, "region %zu", i);
        cr_assert_eq(a[i].info.len, b[i].info.len, "region %zu", i);
        cr_assert_eq(a[i].info.access, b[i].info.access, "region %zu", i);
        cr_assert_str_eq(a[i].info.location, b[i].info.location, "region %zu", i);
        cr_assert_eq(a[i].kind, b[i].kind, "region %zu", i);
        cr_assert_eq(a[i].device, b[i].device, "region %zu", i);
        cr_assert_eq(a[i].keys_len, b[i].keys_len, "region %zu", i);
        if (a[i].keys_len)
            cr_assert_arr_eq(a[i].keys, b[i].keys, a[i].keys_len, "region %zu keys", i);
    }
}

/* hello_ack spelled out independently of wire.c: hello | count u32 | count x (addr u64 | len u64 |
 * access u32 | loc_len u16 | loc | keys_len u16 | keys). Writes the fields as given, valid or not
 * (keys_len too, so runs over KVB_REGION_KEYS_MAX can be sent). */
#define REGION_MIN_WIRE 24u

static uint8_t *ack_by_hand(const kvb_hello_t *h, const kvb_region_desc_t *r, size_t n, size_t *len)
{
    size_t hs = kvb__wire_hello_size(h);
    size_t total = hs + 4;
    for (size_t i = 0; i < n; i++)
        total += REGION_MIN_WIRE + strlen(r[i].info.location) + r[i].keys_len;
    uint8_t *buf = malloc(total);
    cr_assert_not_null(buf);
    kvb__wire_hello_encode(h, buf);
    put32(buf + hs, (uint32_t)n);
    uint8_t *p = buf + hs + 4;
    for (size_t i = 0; i < n; i++) {
        size_t ll = strlen(r[i].info.location);
        put64(p, r[i].info.addr);
        put64(p + 8, r[i].info.len);
        put32(p + 16, r[i].info.access);
        put16(p + 20, (uint16_t)ll);
        memcpy(p + 22, r[i].info.location, ll);
        put16(p + 22 + ll, r[i].keys_len);
        if (r[i].keys_len)
            memcpy(p + 24 + ll, r[i].keys, r[i].keys_len);
        p += REGION_MIN_WIRE + ll + r[i].keys_len;
    }
    *len = total;
    return buf;
}

/* Offset of the region count in a hello_ack whose hello has a name of name_len bytes. */
static size_t ack_count_off(size_t name_len)
{
    return HELLO_NAME_OFF + name_len;
}

/* --- frame headers ------------------------------------------------------------------------ */

TestSuite(wire_hdr, .timeout = 30);

Test(wire_hdr, layout_is_fixed_little_endian)
{
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_READ_RESP, -201, 0x0102030405060708ull);
    h.flags = 0;
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    memset(buf, 0xEE, sizeof buf);
    kvb__wire_encode_hdr(&h, buf);
    const uint8_t magic[4] = {'K', 'V', 'B', '1'};
    cr_assert_arr_eq(buf, magic, 4);
    cr_assert_eq(KVB_WIRE_VERSION, 6, "protocol version 6: same-host requests with deadlines");
    cr_assert_eq(buf[4], 6);
    cr_assert_eq(buf[5], KVB_FRAME_READ_RESP);
    cr_assert_eq(get16(buf + 6), 0);
    cr_assert_eq((int32_t)get32(buf + 8), -201);
    cr_assert_eq(get32(buf + 12), 0, "reserved word must be zero");
    cr_assert_eq(get64(buf + 16), 0x1122334455667788ull);
    cr_assert_eq(get64(buf + 24), 0xfedcba9876543210ull);
    cr_assert_eq(buf[32], 0x08);
    cr_assert_eq(buf[39], 0x01);
}

Test(wire_hdr, roundtrip_every_type)
{
    uint64_t seed = 0x1234;
    for (int t = KVB_FRAME_HELLO; t <= KVB_FRAME_TYPE_MAX; t++) {
        uint64_t lim = type_limit(t), min = type_min(t);
        uint64_t lens[] = {min, min + (lim - min) / 2, lim};
        int32_t statuses[] = {0, KVB_ERR_PEER_LOST, KVB_ERR_ACCESS_DENIED, INT32_MIN};
        for (size_t li = 0; li < 3; li++) {
            for (size_t si = 0; si < 4; si++) {
                if (statuses[si] != 0 && !is_response_type(t))
                    continue;
                kvb_frame_hdr_t h = mkhdr((uint8_t)t, statuses[si], lens[li]);
                h.id = rng_next(&seed);
                h.addr = rng_next(&seed);
                kvb_frame_hdr_t out;
                memset(&out, 0, sizeof out);
                cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "type %d len %llu status %d", t,
                             (unsigned long long)lens[li], statuses[si]);
                cr_assert_eq(out.type, t);
                cr_assert_eq(out.version, KVB_WIRE_VERSION);
                cr_assert_eq(out.flags, 0);
                cr_assert_eq(out.status, statuses[si]);
                cr_assert_eq(out.id, h.id);
                cr_assert_eq(out.addr, h.addr);
                cr_assert_eq(out.len, lens[li]);
            }
        }
    }
}

Test(wire_hdr, bad_magic_rejected)
{
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_READ_REQ, 0, 16);
    uint8_t good[KVB_WIRE_HDR_SIZE];
    kvb__wire_encode_hdr(&h, good);
    cr_assert_eq(hdr_decode_raw(good), KVB_OK);
    for (int bit = 0; bit < 32; bit++) {
        uint8_t buf[KVB_WIRE_HDR_SIZE];
        memcpy(buf, good, sizeof buf);
        buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_PROTOCOL, "magic bit %d flipped", bit);
    }
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    memcpy(buf, good, sizeof buf);
    put32(buf, 0);
    cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_PROTOCOL);
    memcpy(buf, "1BVK", 4); /* the magic in the wrong byte order */
    cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_PROTOCOL);
    /* An all-zero or all-ones header is not a frame either. */
    memset(buf, 0, sizeof buf);
    cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_PROTOCOL);
    memset(buf, 0xFF, sizeof buf);
    cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_PROTOCOL);
}

Test(wire_hdr, wrong_version_is_a_version_error)
{
    /* Version 1 peers (no authentication), version 2 ones (no answer runs), version 3 ones
     * (same-host answer runs only), version 4 ones (same-host requests one frame each) and
     * version 5 ones (same-host requests without their deadline) are refused outright, as is
     * anything newer. */
    const uint8_t types[] = {KVB_FRAME_HELLO, KVB_FRAME_CHALLENGE, KVB_FRAME_AUTH,
                             KVB_FRAME_READ_REQ};
    for (size_t t = 0; t < sizeof types; t++) {
        kvb_frame_hdr_t h = mkhdr(types[t], 0, type_min(types[t]));
        uint8_t buf[KVB_WIRE_HDR_SIZE];
        kvb__wire_encode_hdr(&h, buf);
        cr_assert_eq(buf[4], 6);
        cr_assert_eq(hdr_decode_raw(buf), KVB_OK, "type %u at version 6", types[t]);
        const uint8_t versions[] = {0, 1, 2, 3, 4, 5, 7, 0x7F, 0x80, 0xFF};
        for (size_t i = 0; i < sizeof versions; i++) {
            buf[4] = versions[i];
            cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_VERSION, "type %u version %u", types[t],
                         versions[i]);
        }
    }
    /* A version-1 HELLO exactly as an old peer would send it (old hello layout, 40 bytes). */
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_HELLO, 0, 18 + KVB_HOST_ID_LEN + 6);
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    kvb__wire_encode_hdr(&h, buf);
    buf[4] = 1;
    kvb_frame_hdr_t out, before;
    memset(&out, 0xA5, sizeof out);
    memcpy(&before, &out, sizeof out);
    char why[128] = "";
    cr_assert_eq(kvb__wire_decode_hdr(buf, &out, why, sizeof why), KVB_ERR_VERSION);
    cr_assert_neq(strstr(why, "version"), NULL, "reason: %s", why);
    cr_assert_arr_eq(&out, &before, sizeof out, "output written for a version-1 header");
}

Test(wire_hdr, unknown_type_rejected)
{
    cr_assert_eq(KVB_FRAME_CHALLENGE, 11);
    cr_assert_eq(KVB_FRAME_AUTH, 12);
    cr_assert_eq(KVB_FRAME_TYPE_MAX, 12);
    const unsigned types[] = {0, KVB_FRAME_TYPE_MAX + 1, 13, 14, 0x7F, 0x80, 0xFF};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        kvb_frame_hdr_t h = mkhdr((uint8_t)types[i], 0, 0);
        kvb_frame_hdr_t out;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %u", types[i]);
    }
}

Test(wire_hdr, flags_set_rejected)
{
    for (int bit = 1; bit < 16; bit++) {
        kvb_frame_hdr_t h = mkhdr(KVB_FRAME_WRITE_REQ, 0, 8);
        h.flags = (uint16_t)(1u << bit);
        kvb_frame_hdr_t out;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "flag bit %d", bit);
    }
    /* The shared-memory flag only on data frames. */
    const uint8_t control[] = {KVB_FRAME_HELLO,      KVB_FRAME_HELLO_ACK, KVB_FRAME_NOTIFY,
                               KVB_FRAME_NOTIFY_ACK, KVB_FRAME_ERROR,     KVB_FRAME_ATTRS,
                               KVB_FRAME_CHALLENGE,  KVB_FRAME_AUTH};
    for (size_t i = 0; i < sizeof control; i++) {
        kvb_frame_hdr_t h = mkhdr(control[i], 0, type_min(control[i])), out;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "type %u without the flag", control[i]);
        h.flags = KVB_FRAME_F_SHM;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %u", control[i]);
    }
}

/* An answer run: only a successful same-host answer, 1..KVB_WIRE_MAX_RUN requests, a total
 * length the requests could have asked, and no payload. */
Test(wire_hdr, answer_runs)
{
    const uint8_t resp[] = {KVB_FRAME_READ_RESP, KVB_FRAME_WRITE_ACK};
    for (int i = 0; i < 2; i++) {
        kvb_frame_hdr_t h = mkhdr(resp[i], 0, 128ull << 20), out;
        h.flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN;
        h.addr = 128;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "128 answers of 1 MiB");
        cr_assert_eq(out.addr, 128);
        cr_assert_eq(kvb__wire_payload_len(&out), 0, "a run carries no data");
        h.addr = KVB_WIRE_MAX_RUN;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "at the limit");
        h.addr = KVB_WIRE_MAX_RUN + 1;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "one over the limit");
        h.addr = 0;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "a run of none");
        h.addr = 2;
        h.len = 2 * KVB_WIRE_MAX_DATA + 1;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "more than 2 requests can ask");
        h.len = 2 * KVB_WIRE_MAX_DATA;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK);
        h.status = KVB_ERR_REMOTE_NOT_REGISTERED;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "failures answer alone");
    }
    const uint8_t other[] = {KVB_FRAME_READ_REQ, KVB_FRAME_WRITE_REQ, KVB_FRAME_NOTIFY,
                             KVB_FRAME_HELLO_ACK};
    for (size_t i = 0; i < sizeof other; i++) {
        kvb_frame_hdr_t h = mkhdr(other[i], 0, 8), out;
        h.flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN;
        h.addr = 1;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %u", other[i]);
    }
}

/* Over TCP: a READ asks for a run with F_RUN; a successful READ_RESP with it answers 1..MAX_RUN
 * such READs, their bytes one after another, at most KVB_WIRE_MAX_DATA in all. */
Test(wire_hdr, answer_runs_over_tcp)
{
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_READ_REQ, 0, 4096), out;
    h.flags = KVB_FRAME_F_RUN;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "a READ that may be answered in a run");
    cr_assert_eq(out.flags, KVB_FRAME_F_RUN);
    cr_assert_eq(kvb__wire_payload_len(&out), 0, "a READ carries no data");
    h.flags = KVB_FRAME_F_RUN | KVB_FRAME_F_SHM;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "same-host READs are not run-asked");

    h = mkhdr(KVB_FRAME_READ_RESP, 0, 3 * 4096);
    h.flags = KVB_FRAME_F_RUN;
    h.addr = 3;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "3 answers of 4 KiB");
    cr_assert_eq(out.addr, 3);
    cr_assert_eq(kvb__wire_payload_len(&out), 3 * 4096, "the run carries their bytes");
    h.len = KVB_WIRE_MAX_DATA;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "at the data limit");
    h.len = KVB_WIRE_MAX_DATA + 1;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "over the data limit");
    h.len = 4096;
    h.addr = KVB_WIRE_MAX_RUN + 1;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "one request over the limit");
    h.addr = 0;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "a run of none");
    h.addr = 1;
    h.status = KVB_ERR_REMOTE_NOT_REGISTERED;
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "failures answer alone");

    const uint8_t other[] = {KVB_FRAME_WRITE_REQ, KVB_FRAME_WRITE_ACK, KVB_FRAME_NOTIFY,
                             KVB_FRAME_NOTIFY_ACK};
    for (size_t i = 0; i < sizeof other; i++) {
        h = mkhdr(other[i], 0, 8);
        h.flags = KVB_FRAME_F_RUN;
        h.addr = 1;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %u", other[i]);
    }
}

/* Same-host requests come in runs only: F_SHM | F_RUN, 1..KVB_WIRE_MAX_RUN requests, whose
 * entries are the payload (exactly addr x KVB_WIRE_SHM_ENTRY bytes). Their answers carry no data.
 */
Test(wire_hdr, shm_request_runs)
{
    const uint8_t req[] = {KVB_FRAME_READ_REQ, KVB_FRAME_WRITE_REQ};
    const uint8_t resp[] = {KVB_FRAME_READ_RESP, KVB_FRAME_WRITE_ACK};
    for (int i = 0; i < 2; i++) {
        kvb_frame_hdr_t h = mkhdr(req[i], 0, 3 * KVB_WIRE_SHM_ENTRY), out;
        h.flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN;
        h.addr = 3;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK);
        cr_assert_eq(out.flags, KVB_FRAME_F_SHM | KVB_FRAME_F_RUN);
        cr_assert_eq(kvb__wire_payload_len(&out), 3 * KVB_WIRE_SHM_ENTRY, "the entries follow");
        h.len = 3 * KVB_WIRE_SHM_ENTRY + 1;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "a length that is not 3 entries");
        h.len = 2 * KVB_WIRE_SHM_ENTRY;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "one entry short");
        h.addr = KVB_WIRE_MAX_RUN;
        h.len = KVB_WIRE_MAX_RUN * KVB_WIRE_SHM_ENTRY;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "at the limit");
        h.addr = KVB_WIRE_MAX_RUN + 1;
        h.len = (KVB_WIRE_MAX_RUN + 1) * KVB_WIRE_SHM_ENTRY;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "one over the limit");
        h.addr = 0;
        h.len = 0;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "a run of none");
        h.addr = 1;
        h.len = KVB_WIRE_SHM_ENTRY;
        h.flags = KVB_FRAME_F_SHM;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "a same-host request alone");
        h.flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN;
        h.status = KVB_ERR_REMOTE_NOT_REGISTERED;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "status on a request");
        h = mkhdr(resp[i], 0, 1 << 20);
        h.flags = KVB_FRAME_F_SHM;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK);
        cr_assert_eq(kvb__wire_payload_len(&out), 0, "an answer carries no data");
    }
}

Test(wire_hdr, shm_entries)
{
    kvb_shm_entry_t e = {.remote = 0x7f0012345678ull,
                         .len = 18432,
                         .local = 0x55aa00000040ull,
                         .deadline = 0x0000123456789abcull},
                    out;
    uint8_t b[KVB_WIRE_SHM_ENTRY];
    cr_assert_eq(KVB_WIRE_SHM_ENTRY, 32);
    kvb__wire_shm_entry_encode(&e, b);
    cr_assert_eq(b[0], 0x78, "little-endian");
    cr_assert_eq(b[8], 0x00);
    cr_assert_eq(b[9], 0x48);
    cr_assert_eq(b[24], 0xbc, "the deadline last");
    cr_assert_eq(b[29], 0x12);
    cr_assert_eq(kvb__wire_shm_entry_decode(b, &out), KVB_OK);
    cr_assert_eq(out.remote, e.remote);
    cr_assert_eq(out.len, e.len);
    cr_assert_eq(out.local, e.local);
    cr_assert_eq(out.deadline, e.deadline);
    e.len = KVB_WIRE_MAX_DATA;
    kvb__wire_shm_entry_encode(&e, b);
    cr_assert_eq(kvb__wire_shm_entry_decode(b, &out), KVB_OK, "what a lone request may ask");
    e.len = KVB_WIRE_MAX_DATA + 1;
    kvb__wire_shm_entry_encode(&e, b);
    cr_assert_eq(kvb__wire_shm_entry_decode(b, &out), KVB_ERR_PROTOCOL, "over the data limit");
    e.len = UINT64_MAX;
    kvb__wire_shm_entry_encode(&e, b);
    cr_assert_eq(kvb__wire_shm_entry_decode(b, &out), KVB_ERR_PROTOCOL);
    e.len = 0; /* refused by the range check, as the request's own failure */
    kvb__wire_shm_entry_encode(&e, b);
    cr_assert_eq(kvb__wire_shm_entry_decode(b, &out), KVB_OK);
}

Test(wire_hdr, reserved_bits_set_rejected)
{
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_NOTIFY_ACK, 0, 0);
    uint8_t good[KVB_WIRE_HDR_SIZE];
    kvb__wire_encode_hdr(&h, good);
    cr_assert_eq(hdr_decode_raw(good), KVB_OK);
    for (int bit = 0; bit < 32; bit++) {
        uint8_t buf[KVB_WIRE_HDR_SIZE];
        memcpy(buf, good, sizeof buf);
        buf[12 + bit / 8] ^= (uint8_t)(1u << (bit % 8));
        cr_assert_eq(hdr_decode_raw(buf), KVB_ERR_PROTOCOL, "reserved bit %d", bit);
    }
}

Test(wire_hdr, positive_status_rejected_for_every_type)
{
    const int32_t statuses[] = {1, 2, 100, 200, INT32_MAX};
    for (int t = KVB_FRAME_HELLO; t <= KVB_FRAME_TYPE_MAX; t++) {
        for (size_t i = 0; i < sizeof statuses / sizeof statuses[0]; i++) {
            kvb_frame_hdr_t h = mkhdr((uint8_t)t, statuses[i], type_min(t));
            kvb_frame_hdr_t out;
            cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %d status %d", t,
                         statuses[i]);
        }
    }
}

Test(wire_hdr, status_on_request_frame_rejected)
{
    /* CHALLENGE and AUTH carry no status: a failed handshake is an ERROR frame. */
    const int requests[] = {KVB_FRAME_HELLO,  KVB_FRAME_READ_REQ,  KVB_FRAME_WRITE_REQ,
                            KVB_FRAME_NOTIFY, KVB_FRAME_CHALLENGE, KVB_FRAME_AUTH,
                            KVB_FRAME_ATTRS};
    const int32_t statuses[] = {-1, KVB_ERR_PROTOCOL, KVB_ERR_AUTH, KVB_ERR_ACCESS_DENIED,
                                INT32_MIN};
    for (size_t t = 0; t < sizeof requests / sizeof requests[0]; t++) {
        kvb_frame_hdr_t ok = mkhdr((uint8_t)requests[t], 0, type_min(requests[t])), out0;
        cr_assert_eq(hdr_roundtrip(&ok, &out0), KVB_OK, "type %d without status", requests[t]);
        for (size_t i = 0; i < sizeof statuses / sizeof statuses[0]; i++) {
            kvb_frame_hdr_t h = mkhdr((uint8_t)requests[t], statuses[i], type_min(requests[t]));
            kvb_frame_hdr_t out;
            cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %d status %d",
                         requests[t], statuses[i]);
        }
    }
}

Test(wire_hdr, status_on_response_frame_accepted)
{
    const int responses[] = {KVB_FRAME_HELLO_ACK, KVB_FRAME_READ_RESP, KVB_FRAME_WRITE_ACK,
                             KVB_FRAME_NOTIFY_ACK, KVB_FRAME_ERROR};
    for (size_t t = 0; t < sizeof responses / sizeof responses[0]; t++) {
        kvb_frame_hdr_t h = mkhdr((uint8_t)responses[t], KVB_ERR_REMOTE_NOT_REGISTERED, 0);
        kvb_frame_hdr_t out;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "type %d", responses[t]);
        cr_assert_eq(out.status, KVB_ERR_REMOTE_NOT_REGISTERED);
    }
}

Test(wire_hdr, length_at_limit_and_one_over)
{
    for (int t = KVB_FRAME_HELLO; t <= KVB_FRAME_TYPE_MAX; t++) {
        uint64_t lim = type_limit(t);
        kvb_frame_hdr_t out;
        kvb_frame_hdr_t h = mkhdr((uint8_t)t, 0, lim);
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "type %d at limit %llu", t,
                     (unsigned long long)lim);
        cr_assert_eq(out.len, lim);
        h.len = lim + 1;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %d one over", t);
        h.len = UINT64_MAX;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %d max u64", t);
        h.len = 1ull << 63;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "type %d 2^63", t);
    }
    /* The named limits, spelled out. */
    cr_assert_eq(type_limit(KVB_FRAME_READ_RESP), 64ull << 20);
    cr_assert_eq(type_limit(KVB_FRAME_HELLO), 4096);
    cr_assert_eq(type_limit(KVB_FRAME_NOTIFY), KVB_NOTIFY_MAX);
    cr_assert_eq(type_limit(KVB_FRAME_HELLO_ACK), 16u << 20);
    cr_assert_eq(type_limit(KVB_FRAME_CHALLENGE), 4096 + 32);
    cr_assert_eq(type_limit(KVB_FRAME_AUTH), 32);
    cr_assert_eq(KVB_WIRE_MAC_LEN, 32);
    cr_assert_eq(KVB_WIRE_NONCE_LEN, 32);
}

Test(wire_hdr, challenge_length_at_limit_and_one_over)
{
    kvb_frame_hdr_t out;
    const uint64_t ok[] = {0,
                           1,
                           KVB_WIRE_MAC_LEN,
                           KVB_WIRE_MAX_HELLO,
                           KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN - 1,
                           KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        kvb_frame_hdr_t h = mkhdr(KVB_FRAME_CHALLENGE, 0, ok[i]);
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "len %llu", (unsigned long long)ok[i]);
        cr_assert_eq(kvb__wire_payload_len(&out), ok[i]);
    }
    const uint64_t bad[] = {KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN + 1,
                            KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN + 2, 1ull << 32, UINT64_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvb_frame_hdr_t h = mkhdr(KVB_FRAME_CHALLENGE, 0, bad[i]);
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL, "len %llu",
                     (unsigned long long)bad[i]);
    }
}

Test(wire_hdr, auth_length_is_exactly_one_mac)
{
    kvb_frame_hdr_t out;
    for (uint64_t len = 0; len <= 2 * KVB_WIRE_MAC_LEN + 1; len++) {
        kvb_frame_hdr_t h = mkhdr(KVB_FRAME_AUTH, 0, len);
        int rc = hdr_roundtrip(&h, &out);
        if (len == KVB_WIRE_MAC_LEN) {
            cr_assert_eq(rc, KVB_OK);
            cr_assert_eq(out.len, KVB_WIRE_MAC_LEN);
            cr_assert_eq(kvb__wire_payload_len(&out), KVB_WIRE_MAC_LEN);
        } else {
            cr_assert_eq(rc, KVB_ERR_PROTOCOL, "AUTH of %llu bytes accepted",
                         (unsigned long long)len);
        }
    }
    const uint64_t bad[] = {KVB_WIRE_MAX_HELLO, 1ull << 32, 1ull << 63, UINT64_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvb_frame_hdr_t h = mkhdr(KVB_FRAME_AUTH, 0, bad[i]);
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL);
    }
    /* The reason names the problem. */
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_AUTH, 0, 0);
    kvb__wire_encode_hdr(&h, buf);
    char why[128] = "";
    cr_assert_eq(kvb__wire_decode_hdr(buf, &out, why, sizeof why), KVB_ERR_PROTOCOL);
    cr_assert_gt(strlen(why), 0);
}

Test(wire_hdr, length_limit_also_applies_with_error_status)
{
    kvb_frame_hdr_t out;
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_READ_RESP, KVB_ERR_ACCESS_DENIED, KVB_WIRE_MAX_DATA + 1);
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL);
    h = mkhdr(KVB_FRAME_ERROR, KVB_ERR_PROTOCOL, 1);
    cr_assert_eq(hdr_roundtrip(&h, &out), KVB_ERR_PROTOCOL);
}

Test(wire_hdr, payload_len_per_type)
{
    struct {
        int type;
        int32_t status;
        uint64_t len;
        uint64_t payload;
    } cases[] = {
        {KVB_FRAME_HELLO, 0, 77, 77},
        {KVB_FRAME_HELLO_ACK, 0, 1000, 1000},
        {KVB_FRAME_HELLO_ACK, KVB_ERR_VERSION, 1000, 0},
        {KVB_FRAME_READ_REQ, 0, 4096, 0}, /* len is what is asked, nothing follows */
        {KVB_FRAME_READ_RESP, 0, 4096, 4096},
        {KVB_FRAME_READ_RESP, KVB_ERR_ACCESS_DENIED, 4096, 0},
        {KVB_FRAME_READ_RESP, 0, KVB_WIRE_MAX_DATA, KVB_WIRE_MAX_DATA},
        {KVB_FRAME_WRITE_REQ, 0, 123, 123},
        {KVB_FRAME_WRITE_REQ, 0, KVB_WIRE_MAX_DATA, KVB_WIRE_MAX_DATA},
        {KVB_FRAME_WRITE_ACK, 0, 123, 0}, /* len placed, nothing follows */
        {KVB_FRAME_WRITE_ACK, KVB_ERR_REMOTE_NOT_REGISTERED, 0, 0},
        {KVB_FRAME_NOTIFY, 0, KVB_NOTIFY_MAX, KVB_NOTIFY_MAX},
        {KVB_FRAME_NOTIFY, 0, 0, 0},
        {KVB_FRAME_NOTIFY_ACK, 0, 0, 0},
        {KVB_FRAME_NOTIFY_ACK, KVB_ERR_REMOTE_NO_SPACE, 0, 0},
        {KVB_FRAME_ERROR, KVB_ERR_PROTOCOL, 0, 0},
        {KVB_FRAME_ERROR, KVB_ERR_AUTH, 0, 0},
        {KVB_FRAME_ATTRS, 0, 555, 555},
        {KVB_FRAME_CHALLENGE, 0, 100, 100},
        {KVB_FRAME_CHALLENGE, 0, KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN,
         KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN},
        {KVB_FRAME_AUTH, 0, KVB_WIRE_MAC_LEN, KVB_WIRE_MAC_LEN},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvb_frame_hdr_t h = mkhdr((uint8_t)cases[i].type, cases[i].status, cases[i].len);
        kvb_frame_hdr_t out;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK, "case %zu", i);
        cr_assert_eq(kvb__wire_payload_len(&out), cases[i].payload, "case %zu (type %d)", i,
                     cases[i].type);
    }
}

Test(wire_hdr, why_buffer_optional_and_bounded)
{
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t h = mkhdr(KVB_FRAME_HELLO, 0, KVB_WIRE_MAX_HELLO + 1);
    kvb__wire_encode_hdr(&h, buf);
    kvb_frame_hdr_t out;
    cr_assert_eq(kvb__wire_decode_hdr(buf, &out, NULL, 0), KVB_ERR_PROTOCOL);
    char why[8];
    memset(why, 'x', sizeof why);
    cr_assert_eq(kvb__wire_decode_hdr(buf, &out, why, 1), KVB_ERR_PROTOCOL);
    cr_assert_eq(why[0], '\0');
    cr_assert_eq(why[1], 'x', "wrote past why_len");
    memset(why, 'x', sizeof why);
    cr_assert_eq(kvb__wire_decode_hdr(buf, &out, why, 4), KVB_ERR_PROTOCOL);
    cr_assert_eq(strlen(why), 3);
    cr_assert_eq(why[4], 'x', "wrote past why_len");
}

Test(wire_hdr, output_untouched_on_error)
{
    uint8_t buf[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t bad[] = {
        mkhdr(0, 0, 0),
        mkhdr(KVB_FRAME_HELLO, -1, 0),
        mkhdr(KVB_FRAME_HELLO, 1, 0),
        mkhdr(KVB_FRAME_NOTIFY, 0, KVB_NOTIFY_MAX + 1),
        mkhdr(KVB_FRAME_AUTH, 0, KVB_WIRE_MAC_LEN - 1),
        mkhdr(KVB_FRAME_AUTH, 0, KVB_WIRE_MAC_LEN + 1),
        mkhdr(KVB_FRAME_CHALLENGE, 0, KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN + 1),
        mkhdr(KVB_FRAME_CHALLENGE, KVB_ERR_AUTH, 64),
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvb__wire_encode_hdr(&bad[i], buf);
        kvb_frame_hdr_t out, before;
        memset(&out, 0xA5, sizeof out);
        memcpy(&before, &out, sizeof out);
        char why[64];
        cr_assert_neq(kvb__wire_decode_hdr(buf, &out, why, sizeof why), KVB_OK, "case %zu", i);
        cr_assert_arr_eq(&out, &before, sizeof out, "case %zu: output written on error", i);
    }
}

Test(wire_hdr, random_headers_never_crash)
{
    uint64_t seed = 0xC0FFEE;
    int accepted = 0, per_type[KVB_FRAME_TYPE_MAX + 1] = {0};
    for (int it = 0; it < 20000; it++) {
        uint8_t buf[KVB_WIRE_HDR_SIZE];
        for (int i = 0; i < KVB_WIRE_HDR_SIZE; i += 8)
            put64(buf + i, rng_next(&seed));
        /* Keep magic and version valid most of the time so the later checks are reached. */
        if (it % 4 != 0) {
            put32(buf, KVB_WIRE_MAGIC);
            buf[4] = KVB_WIRE_VERSION;
            buf[5] = (uint8_t)(buf[5] % (KVB_FRAME_TYPE_MAX + 1));
            if (it % 2) {
                put16(buf + 6, 0);
                put32(buf + 12, 0);
            }
            if (it % 7 == 1)
                put64(buf + 32, KVB_WIRE_MAC_LEN + (it % 3) - 1); /* AUTH's exact length +-1 */
            else if (it % 3)
                put64(buf + 32, get64(buf + 32) % (KVB_WIRE_MAX_DATA + 2));
            if (it % 5)
                put32(buf + 8, 0);
        }
        kvb_frame_hdr_t out;
        char why[64];
        int rc = kvb__wire_decode_hdr(buf, &out, why, sizeof why);
        cr_assert(rc == KVB_OK || rc == KVB_ERR_PROTOCOL || rc == KVB_ERR_VERSION);
        if (rc == KVB_OK) {
            accepted++;
            cr_assert(out.type >= KVB_FRAME_HELLO && out.type <= KVB_FRAME_TYPE_MAX);
            per_type[out.type]++;
            cr_assert_eq(out.flags, 0);
            cr_assert_leq(out.status, 0);
            cr_assert_leq(out.len, type_limit(out.type));
            cr_assert_geq(out.len, type_min(out.type));
            if (out.type == KVB_FRAME_AUTH)
                cr_assert_eq(out.len, KVB_WIRE_MAC_LEN);
            cr_assert_leq(kvb__wire_payload_len(&out), out.len);
            /* What was accepted encodes back to the same bytes. */
            uint8_t again[KVB_WIRE_HDR_SIZE];
            kvb__wire_encode_hdr(&out, again);
            cr_assert_arr_eq(again, buf, KVB_WIRE_HDR_SIZE);
        }
    }
    cr_assert_gt(accepted, 0, "the fuzz never reached an accepted header");
    cr_assert_gt(per_type[KVB_FRAME_CHALLENGE], 0, "no CHALLENGE header accepted");
    cr_assert_gt(per_type[KVB_FRAME_AUTH], 0, "no AUTH header accepted");
}

/* --- hello -------------------------------------------------------------------------------- */

TestSuite(wire_hello, .timeout = 30);

Test(wire_hello, layout)
{
    kvb_hello_t h = sample_hello("node-a");
    size_t n;
    uint8_t *buf = hello_bytes(&h, &n);
    cr_assert_eq(n, 8 + 4 + 4 + 16 + 32 + 2 + 6);
    cr_assert_eq(HELLO_NAME_OFF, 66);
    cr_assert_eq(kvb__wire_hello_size(&h), n);
    cr_assert_eq(get64(buf), 0x0102030405060708ull);
    cr_assert_eq(get32(buf + 8), 0xA1B2C3D4u);
    cr_assert_eq(get32(buf + 12), 7);
    cr_assert_arr_eq(buf + 16, h.host_id, KVB_HOST_ID_LEN);
    cr_assert_arr_eq(buf + 32, h.nonce, KVB_WIRE_NONCE_LEN);
    cr_assert_eq(get16(buf + 64), 6);
    cr_assert_arr_eq(buf + 66, "node-a", 6);
    free(buf);
}

Test(wire_hello, nonce_roundtrips)
{
    uint64_t seed = 0xBADC0DE;
    for (int k = 0; k < 64; k++) {
        kvb_hello_t h = sample_hello("nonce-node");
        if (k == 0)
            memset(h.nonce, 0x00, sizeof h.nonce); /* HELLO_ACK without a link token */
        else if (k == 1)
            memset(h.nonce, 0xFF, sizeof h.nonce);
        else
            for (int i = 0; i < KVB_WIRE_NONCE_LEN; i++)
                h.nonce[i] = (uint8_t)rng_next(&seed);
        size_t n;
        uint8_t *buf = hello_bytes(&h, &n);
        cr_assert_arr_eq(buf + HELLO_NONCE_OFF, h.nonce, KVB_WIRE_NONCE_LEN, "case %d", k);
        kvb_hello_t out;
        memset(&out, 0x33, sizeof out);
        cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_OK, "case %d", k);
        assert_hello_eq(&out, &h);
        free(buf);
    }
    /* Every nonce byte is opaque: any value at any position decodes, and lands only there. */
    kvb_hello_t h = sample_hello("n");
    size_t n;
    uint8_t *buf = hello_bytes(&h, &n);
    for (int pos = 0; pos < KVB_WIRE_NONCE_LEN; pos++) {
        const uint8_t vals[] = {0x00, ' ', 0x7f, 0x80, 0xff};
        for (size_t v = 0; v < sizeof vals; v++) {
            uint8_t saved = buf[HELLO_NONCE_OFF + pos];
            buf[HELLO_NONCE_OFF + pos] = vals[v];
            kvb_hello_t out, expect = h;
            expect.nonce[pos] = vals[v];
            cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_OK, "pos %d val 0x%02x", pos,
                         vals[v]);
            assert_hello_eq(&out, &expect);
            buf[HELLO_NONCE_OFF + pos] = saved;
        }
    }
    free(buf);
    /* Two hellos differing only in the nonce encode differently, in the nonce bytes only. */
    kvb_hello_t a = sample_hello("same"), b = a;
    b.nonce[KVB_WIRE_NONCE_LEN - 1] ^= 1;
    size_t na, nb;
    uint8_t *ea = hello_bytes(&a, &na), *eb = hello_bytes(&b, &nb);
    cr_assert_eq(na, nb);
    for (size_t i = 0; i < na; i++)
        if (i == HELLO_NONCE_OFF + KVB_WIRE_NONCE_LEN - 1)
            cr_assert_neq(ea[i], eb[i]);
        else
            cr_assert_eq(ea[i], eb[i], "byte %zu", i);
    free(ea);
    free(eb);
}

Test(wire_hello, roundtrip)
{
    const char *names[] = {"a", "node-a:7000", "127.0.0.1:65535", "~!@#$%^&*()_+{}|:\"<>?"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        kvb_hello_t h = sample_hello(names[i]);
        h.incarnation = UINT64_MAX - i;
        h.lane = (uint32_t)i;
        size_t n;
        uint8_t *buf = hello_bytes(&h, &n);
        cr_assert_leq(n, KVB_WIRE_MAX_HELLO);
        kvb_hello_t out;
        memset(&out, 0x33, sizeof out);
        cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_OK, "name %s", names[i]);
        assert_hello_eq(&out, &h);
        free(buf);
    }
}

Test(wire_hello, name_at_max_length_roundtrips)
{
    char name[KVB_NAME_MAX + 1];
    for (int i = 0; i < KVB_NAME_MAX; i++)
        name[i] = (char)('!' + i % 94);
    name[KVB_NAME_MAX] = '\0';
    kvb_hello_t h = sample_hello("");
    memcpy(h.name, name, sizeof name);
    size_t n;
    uint8_t *buf = hello_bytes(&h, &n);
    cr_assert_eq(n, 66 + KVB_NAME_MAX);
    cr_assert_leq(n, KVB_WIRE_MAX_HELLO);
    kvb_hello_t out;
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_OK);
    assert_hello_eq(&out, &h);
    cr_assert_eq(strlen(out.name), KVB_NAME_MAX);
    free(buf);
}

Test(wire_hello, every_truncation_rejected)
{
    kvb_hello_t h = sample_hello("truncate-me:1234");
    size_t n;
    uint8_t *buf = hello_bytes(&h, &n);
    for (size_t len = 0; len < n; len++) {
        kvb_hello_t out;
        memset(&out, 0x77, sizeof out);
        kvb_hello_t before = out;
        cr_assert_eq(hello_decode_exact(buf, len, &out), KVB_ERR_PROTOCOL, "prefix %zu of %zu", len,
                     n);
        cr_assert_arr_eq(&out, &before, sizeof out, "output written for prefix %zu", len);
    }
    free(buf);
}

Test(wire_hello, trailing_bytes_rejected)
{
    kvb_hello_t h = sample_hello("node");
    size_t n;
    uint8_t *buf = hello_bytes(&h, &n);
    uint8_t *longer = calloc(1, n + 16);
    cr_assert_not_null(longer);
    memcpy(longer, buf, n);
    for (size_t extra = 1; extra <= 16; extra++) {
        kvb_hello_t out;
        cr_assert_eq(hello_decode_exact(longer, n + extra, &out), KVB_ERR_PROTOCOL,
                     "%zu trailing bytes", extra);
    }
    free(longer);
    free(buf);
}

Test(wire_hello, name_length_zero_rejected)
{
    size_t n;
    uint8_t *buf = raw_hello(0, NULL, 0, &n);
    kvb_hello_t out;
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
    free(buf);
    /* The encoder will write an empty name; the decoder must still refuse it. */
    kvb_hello_t h = sample_hello("");
    buf = hello_bytes(&h, &n);
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
    free(buf);
}

Test(wire_hello, name_length_over_max_rejected)
{
    uint8_t name[KVB_NAME_MAX + 2];
    memset(name, 'n', sizeof name);
    size_t n;
    kvb_hello_t out;
    /* 255 is fine, 256 is one over even when the bytes are all there. */
    uint8_t *buf = raw_hello(KVB_NAME_MAX, name, KVB_NAME_MAX, &n);
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_OK);
    free(buf);
    buf = raw_hello(KVB_NAME_MAX + 1, name, KVB_NAME_MAX + 1, &n);
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
    free(buf);
    /* A huge length with few bytes behind it. */
    buf = raw_hello(0xFFFF, name, 10, &n);
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
    free(buf);
    /* A length one larger than the bytes present. */
    buf = raw_hello(11, name, 10, &n);
    cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
    free(buf);
}

Test(wire_hello, non_printable_name_bytes_rejected)
{
    for (int c = 0; c < 256; c++) {
        uint8_t name[3] = {'a', (uint8_t)c, 'z'};
        size_t n;
        uint8_t *buf = raw_hello(3, name, 3, &n);
        kvb_hello_t out;
        int rc = hello_decode_exact(buf, n, &out);
        if (c >= 0x21 && c <= 0x7e) {
            cr_assert_eq(rc, KVB_OK, "byte 0x%02x", c);
            cr_assert_eq((uint8_t)out.name[1], c);
            cr_assert_eq(strlen(out.name), 3);
        } else {
            cr_assert_eq(rc, KVB_ERR_PROTOCOL, "byte 0x%02x accepted in a name", c);
        }
        free(buf);
    }
    /* At the first and last position too. */
    const uint8_t bad[] = {0x00, ' ', '\n', 0x7f, 0x80, 0xff};
    for (size_t i = 0; i < sizeof bad; i++) {
        uint8_t first[2] = {bad[i], 'x'}, last[2] = {'x', bad[i]};
        size_t n;
        kvb_hello_t out;
        uint8_t *buf = raw_hello(2, first, 2, &n);
        cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
        free(buf);
        buf = raw_hello(2, last, 2, &n);
        cr_assert_eq(hello_decode_exact(buf, n, &out), KVB_ERR_PROTOCOL);
        free(buf);
    }
}

/* --- handshake MACs ----------------------------------------------------------------------- */

TestSuite(wire_auth, .timeout = 30);

static const uint8_t auth_key[] = "kvbridge-test-cluster-secret-0123456789";
#define AUTH_KEY_LEN (sizeof auth_key - 1)

/* A plausible handshake transcript: the two sides differ in every field but the lane. */
static void auth_pair(kvb_hello_t *initiator, kvb_hello_t *target)
{
    *initiator = sample_hello("initiator:7001");
    initiator->lane = 3;
    *target = sample_hello("target:7002");
    target->lane = 3;
    target->incarnation = 0x1111222233334444ull;
    target->pid = 4242;
    for (int i = 0; i < KVB_HOST_ID_LEN; i++)
        target->host_id[i] = (uint8_t)(0x10 + i);
    for (int i = 0; i < KVB_WIRE_NONCE_LEN; i++)
        target->nonce[i] = (uint8_t)(0xC0 ^ (7 * i));
}

/* Computes a MAC, checking it succeeds and writes exactly KVB_WIRE_MAC_LEN bytes. */
static void auth_mac(const uint8_t *key, size_t key_len, int role, const kvb_hello_t *initiator,
                     const kvb_hello_t *target, uint8_t out[KVB_WIRE_MAC_LEN])
{
    uint8_t buf[KVB_WIRE_MAC_LEN + 16];
    memset(buf, 0xE7, sizeof buf);
    cr_assert_eq(kvb__wire_auth_mac(key, key_len, role, initiator, target, buf + 8), KVB_OK);
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(buf[i], 0xE7, "wrote before the MAC");
        cr_assert_eq(buf[8 + KVB_WIRE_MAC_LEN + i], 0xE7, "wrote past the MAC");
    }
    memcpy(out, buf + 8, KVB_WIRE_MAC_LEN);
}

static int mac_eq(const uint8_t *a, const uint8_t *b)
{
    return memcmp(a, b, KVB_WIRE_MAC_LEN) == 0;
}

/* Asserts that, under both roles, the MAC over (key, i, t) differs from the one over the base
 * transcript (auth_key, auth_pair()). */
static void assert_mac_differs(const char *what, const uint8_t *key, size_t key_len,
                               const kvb_hello_t *i, const kvb_hello_t *t)
{
    kvb_hello_t bi, bt;
    auth_pair(&bi, &bt);
    const int roles[] = {KVB_AUTH_TARGET, KVB_AUTH_INITIATOR};
    for (int r = 0; r < 2; r++) {
        uint8_t base[KVB_WIRE_MAC_LEN], changed[KVB_WIRE_MAC_LEN];
        auth_mac(auth_key, AUTH_KEY_LEN, roles[r], &bi, &bt, base);
        auth_mac(key, key_len, roles[r], i, t, changed);
        cr_assert(!mac_eq(base, changed), "%s: same MAC for role %d", what, roles[r]);
    }
}

Test(wire_auth, deterministic)
{
    const int roles[] = {KVB_AUTH_TARGET, KVB_AUTH_INITIATOR};
    for (int r = 0; r < 2; r++) {
        kvb_hello_t i1, t1, i2, t2;
        auth_pair(&i1, &t1);
        auth_pair(&i2, &t2); /* separately built, equal content */
        uint8_t a[KVB_WIRE_MAC_LEN], b[KVB_WIRE_MAC_LEN], c[KVB_WIRE_MAC_LEN];
        auth_mac(auth_key, AUTH_KEY_LEN, roles[r], &i1, &t1, a);
        auth_mac(auth_key, AUTH_KEY_LEN, roles[r], &i1, &t1, b);
        uint8_t key_copy[sizeof auth_key];
        memcpy(key_copy, auth_key, sizeof auth_key);
        auth_mac(key_copy, AUTH_KEY_LEN, roles[r], &i2, &t2, c);
        cr_assert(mac_eq(a, b), "role %d: not deterministic", roles[r]);
        cr_assert(mac_eq(a, c), "role %d: depends on more than the content", roles[r]);
        uint8_t zero[KVB_WIRE_MAC_LEN] = {0};
        cr_assert(!mac_eq(a, zero));
        /* The inputs are left alone. */
        cr_assert_arr_eq(&i1, &i2, sizeof i1);
        cr_assert_arr_eq(&t1, &t2, sizeof t1);
    }
}

Test(wire_auth, covers_the_hellos_as_sent)
{
    /* The receiver recomputes the MAC from decoded hellos: they must give the sender's MAC, even
     * when the sender's name buffers hold garbage after the terminating NUL. */
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    kvb_hello_t gi = i, gt = t;
    memset(gi.name + strlen(gi.name) + 1, 'Q', sizeof gi.name - strlen(gi.name) - 1);
    memset(gt.name + strlen(gt.name) + 1, 0xFF, sizeof gt.name - strlen(gt.name) - 1);
    size_t ni, nt;
    uint8_t *ei = hello_bytes(&gi, &ni), *et = hello_bytes(&gt, &nt);
    kvb_hello_t di, dt;
    cr_assert_eq(hello_decode_exact(ei, ni, &di), KVB_OK);
    cr_assert_eq(hello_decode_exact(et, nt, &dt), KVB_OK);
    const int roles[] = {KVB_AUTH_TARGET, KVB_AUTH_INITIATOR};
    for (int r = 0; r < 2; r++) {
        uint8_t a[KVB_WIRE_MAC_LEN], b[KVB_WIRE_MAC_LEN], c[KVB_WIRE_MAC_LEN];
        auth_mac(auth_key, AUTH_KEY_LEN, roles[r], &i, &t, a);
        auth_mac(auth_key, AUTH_KEY_LEN, roles[r], &gi, &gt, b);
        auth_mac(auth_key, AUTH_KEY_LEN, roles[r], &di, &dt, c);
        cr_assert(mac_eq(a, b), "role %d: bytes after the name's NUL were MACed", roles[r]);
        cr_assert(mac_eq(a, c), "role %d: decoded hellos give another MAC", roles[r]);
    }
    free(ei);
    free(et);
}

Test(wire_auth, differs_when_the_key_changes)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    uint8_t key[sizeof auth_key];
    for (size_t pos = 0; pos < AUTH_KEY_LEN; pos++) {
        memcpy(key, auth_key, sizeof key);
        key[pos] ^= 0x01;
        assert_mac_differs("key byte flipped", key, AUTH_KEY_LEN, &i, &t);
    }
    assert_mac_differs("key one byte shorter", auth_key, AUTH_KEY_LEN - 1, &i, &t);
    assert_mac_differs("key one byte prefix", auth_key, 1, &i, &t);
    assert_mac_differs("empty key", auth_key, 0, &i, &t);
    uint8_t other[16];
    memset(other, 'k', sizeof other);
    assert_mac_differs("another key", other, sizeof other, &i, &t);
}

Test(wire_auth, differs_when_either_nonce_changes)
{
    kvb_hello_t i, t;
    for (int pos = 0; pos < KVB_WIRE_NONCE_LEN; pos++) {
        auth_pair(&i, &t);
        i.nonce[pos] ^= 0x80;
        assert_mac_differs("initiator nonce", auth_key, AUTH_KEY_LEN, &i, &t);
        auth_pair(&i, &t);
        t.nonce[pos] ^= 0x01;
        assert_mac_differs("target nonce", auth_key, AUTH_KEY_LEN, &i, &t);
    }
    /* Swapping the two nonces is a different transcript too. */
    auth_pair(&i, &t);
    uint8_t tmp[KVB_WIRE_NONCE_LEN];
    memcpy(tmp, i.nonce, sizeof tmp);
    memcpy(i.nonce, t.nonce, sizeof tmp);
    memcpy(t.nonce, tmp, sizeof tmp);
    assert_mac_differs("nonces swapped", auth_key, AUTH_KEY_LEN, &i, &t);
}

Test(wire_auth, differs_when_either_name_changes)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    i.name[0] = 'J';
    assert_mac_differs("initiator name", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    t.name[strlen(t.name) - 1] = '3';
    assert_mac_differs("target name", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    strcat(i.name, "x");
    assert_mac_differs("initiator name longer", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    t.name[strlen(t.name) - 1] = '\0';
    assert_mac_differs("target name shorter", auth_key, AUTH_KEY_LEN, &i, &t);
    /* Moving a byte from one name to the other keeps the concatenated bytes the same. */
    auth_pair(&i, &t);
    snprintf(i.name, sizeof i.name, "%s%c", "initiator:7001", t.name[0]);
    snprintf(t.name, sizeof t.name, "%s", "arget:7002");
    assert_mac_differs("byte moved between names", auth_key, AUTH_KEY_LEN, &i, &t);
}

Test(wire_auth, differs_when_any_other_field_changes)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    i.lane = 4;
    assert_mac_differs("initiator lane", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    t.lane = 4;
    assert_mac_differs("target lane", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    i.lane = t.lane = 0;
    assert_mac_differs("both lanes", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    i.incarnation++;
    assert_mac_differs("initiator incarnation", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    t.incarnation ^= 1ull << 63;
    assert_mac_differs("target incarnation", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    i.pid ^= 1;
    assert_mac_differs("initiator pid", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    t.pid ^= 0x80000000u;
    assert_mac_differs("target pid", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    i.host_id[KVB_HOST_ID_LEN - 1] ^= 1;
    assert_mac_differs("initiator host", auth_key, AUTH_KEY_LEN, &i, &t);
    auth_pair(&i, &t);
    t.host_id[0] ^= 1;
    assert_mac_differs("target host", auth_key, AUTH_KEY_LEN, &i, &t);
    /* The same two hellos in the other order. */
    auth_pair(&i, &t);
    assert_mac_differs("hellos swapped", auth_key, AUTH_KEY_LEN, &t, &i);
}

Test(wire_auth, roles_give_different_proofs)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    const size_t key_lens[] = {AUTH_KEY_LEN, 1, 0};
    for (size_t k = 0; k < sizeof key_lens / sizeof key_lens[0]; k++) {
        uint8_t tp[KVB_WIRE_MAC_LEN], ip[KVB_WIRE_MAC_LEN], reflected[KVB_WIRE_MAC_LEN];
        auth_mac(auth_key, key_lens[k], KVB_AUTH_TARGET, &i, &t, tp);
        auth_mac(auth_key, key_lens[k], KVB_AUTH_INITIATOR, &i, &t, ip);
        cr_assert(!mac_eq(tp, ip), "key length %zu: target and initiator proofs equal",
                  key_lens[k]);
        /* A target's proof cannot be reflected back as an initiator's on a connection the
         * attacker opens with the roles (and so the hellos) swapped, nor the other way. */
        auth_mac(auth_key, key_lens[k], KVB_AUTH_INITIATOR, &t, &i, reflected);
        cr_assert(!mac_eq(tp, reflected));
        auth_mac(auth_key, key_lens[k], KVB_AUTH_TARGET, &t, &i, reflected);
        cr_assert(!mac_eq(ip, reflected));
    }
    /* Identical hellos on both sides (a loopback connection to itself): roles still differ. */
    uint8_t tp[KVB_WIRE_MAC_LEN], ip[KVB_WIRE_MAC_LEN];
    auth_mac(auth_key, AUTH_KEY_LEN, KVB_AUTH_TARGET, &i, &i, tp);
    auth_mac(auth_key, AUTH_KEY_LEN, KVB_AUTH_INITIATOR, &i, &i, ip);
    cr_assert(!mac_eq(tp, ip));
}

Test(wire_auth, empty_key_allowed)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    const int roles[] = {KVB_AUTH_TARGET, KVB_AUTH_INITIATOR};
    uint8_t per_role[2][KVB_WIRE_MAC_LEN];
    for (int r = 0; r < 2; r++) {
        uint8_t a[KVB_WIRE_MAC_LEN], b[KVB_WIRE_MAC_LEN], c[KVB_WIRE_MAC_LEN];
        auth_mac(NULL, 0, roles[r], &i, &t, a);
        auth_mac(NULL, 0, roles[r], &i, &t, b);
        auth_mac(auth_key, 0, roles[r], &i, &t, c); /* a pointer with no bytes: the same key */
        cr_assert(mac_eq(a, b), "role %d: empty-key MAC not deterministic", roles[r]);
        cr_assert(mac_eq(a, c), "role %d: empty key depends on the pointer", roles[r]);
        uint8_t zero[KVB_WIRE_MAC_LEN] = {0};
        cr_assert(!mac_eq(a, zero));
        memcpy(per_role[r], a, KVB_WIRE_MAC_LEN);
        /* Still bound to the transcript. */
        kvb_hello_t i2 = i;
        i2.nonce[0] ^= 1;
        auth_mac(NULL, 0, roles[r], &i2, &t, b);
        cr_assert(!mac_eq(a, b), "role %d: empty-key MAC ignores the nonce", roles[r]);
    }
    cr_assert(!mac_eq(per_role[0], per_role[1]));
}

Test(wire_auth, longest_hellos_and_long_keys)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    memset(i.name, 'i', KVB_NAME_MAX);
    i.name[KVB_NAME_MAX] = '\0';
    memset(t.name, 't', KVB_NAME_MAX);
    t.name[KVB_NAME_MAX] = '\0';
    static uint8_t key[4096];
    for (size_t k = 0; k < sizeof key; k++)
        key[k] = (uint8_t)(k * 31 + 7);
    uint8_t a[KVB_WIRE_MAC_LEN], b[KVB_WIRE_MAC_LEN];
    auth_mac(key, sizeof key, KVB_AUTH_INITIATOR, &i, &t, a);
    auth_mac(key, sizeof key, KVB_AUTH_INITIATOR, &i, &t, b);
    cr_assert(mac_eq(a, b));
    /* The last name byte and the last key byte count. */
    t.name[KVB_NAME_MAX - 1] = 'u';
    auth_mac(key, sizeof key, KVB_AUTH_INITIATOR, &i, &t, b);
    cr_assert(!mac_eq(a, b));
    t.name[KVB_NAME_MAX - 1] = 't';
    key[sizeof key - 1] ^= 1;
    auth_mac(key, sizeof key, KVB_AUTH_INITIATOR, &i, &t, b);
    cr_assert(!mac_eq(a, b));
}

/* --- challenge ---------------------------------------------------------------------------- */

TestSuite(wire_challenge, .timeout = 30);

/* CHALLENGE payload bytes: hello | mac, in a heap buffer of exactly that size. */
static uint8_t *challenge_bytes(const kvb_hello_t *h, const uint8_t mac[KVB_WIRE_MAC_LEN],
                                size_t *len)
{
    size_t hs = kvb__wire_hello_size(h);
    uint8_t *buf = malloc(hs + KVB_WIRE_MAC_LEN);
    cr_assert_not_null(buf);
    cr_assert_eq(kvb__wire_hello_encode(h, buf), hs);
    memcpy(buf + hs, mac, KVB_WIRE_MAC_LEN);
    *len = hs + KVB_WIRE_MAC_LEN;
    return buf;
}

/* Decodes from an exact-size copy; on failure checks the outputs were not touched. */
static int challenge_decode_exact(const uint8_t *src, size_t len, kvb_hello_t *hello,
                                  uint8_t mac[KVB_WIRE_MAC_LEN])
{
    uint8_t *copy = exact_copy(src, len);
    kvb_hello_t hello_before;
    uint8_t mac_before[KVB_WIRE_MAC_LEN];
    memset(&hello_before, 0x5a, sizeof hello_before);
    memset(mac_before, 0xa5, sizeof mac_before);
    memcpy(hello, &hello_before, sizeof hello_before);
    memcpy(mac, mac_before, sizeof mac_before);
    int rc = kvb__wire_challenge_decode(copy, len, hello, mac);
    free(copy);
    if (rc != KVB_OK) {
        cr_assert_arr_eq(hello, &hello_before, sizeof hello_before, "hello set on failure");
        cr_assert_arr_eq(mac, mac_before, sizeof mac_before, "mac set on failure");
    }
    return rc;
}

Test(wire_challenge, roundtrip)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    uint8_t proof[KVB_WIRE_MAC_LEN];
    auth_mac(auth_key, AUTH_KEY_LEN, KVB_AUTH_TARGET, &i, &t, proof);
    uint8_t macs[4][KVB_WIRE_MAC_LEN];
    memcpy(macs[0], proof, KVB_WIRE_MAC_LEN);
    memset(macs[1], 0x00, KVB_WIRE_MAC_LEN);
    memset(macs[2], 0xFF, KVB_WIRE_MAC_LEN);
    for (int k = 0; k < KVB_WIRE_MAC_LEN; k++)
        macs[3][k] = (uint8_t)k;
    const char *names[] = {"t", "target:7002", "~!@#$%^&*()_+{}|:\"<>?"};
    for (size_t n = 0; n < sizeof names / sizeof names[0]; n++) {
        for (int m = 0; m < 4; m++) {
            kvb_hello_t h = t;
            snprintf(h.name, sizeof h.name, "%s", names[n]);
            size_t len;
            uint8_t *buf = challenge_bytes(&h, macs[m], &len);
            cr_assert_eq(len, HELLO_NAME_OFF + strlen(names[n]) + KVB_WIRE_MAC_LEN);
            kvb_hello_t out;
            uint8_t mac[KVB_WIRE_MAC_LEN];
            cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_OK, "name %s mac %d",
                         names[n], m);
            assert_hello_eq(&out, &h);
            cr_assert_arr_eq(mac, macs[m], KVB_WIRE_MAC_LEN);
            cr_assert_arr_eq(mac, buf + len - KVB_WIRE_MAC_LEN, KVB_WIRE_MAC_LEN);
            free(buf);
        }
    }
    /* The longest challenge fits its frame limit and decodes. */
    kvb_hello_t h = t;
    memset(h.name, 'z', KVB_NAME_MAX);
    h.name[KVB_NAME_MAX] = '\0';
    size_t len;
    uint8_t *buf = challenge_bytes(&h, proof, &len);
    cr_assert_eq(len, 66 + KVB_NAME_MAX + 32);
    cr_assert_leq(len, KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN);
    kvb_hello_t out;
    uint8_t mac[KVB_WIRE_MAC_LEN];
    cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_OK);
    assert_hello_eq(&out, &h);
    cr_assert_arr_eq(mac, proof, KVB_WIRE_MAC_LEN);
    free(buf);
}

Test(wire_challenge, every_truncation_rejected)
{
    kvb_hello_t i, t;
    auth_pair(&i, &t);
    uint8_t proof[KVB_WIRE_MAC_LEN];
    auth_mac(auth_key, AUTH_KEY_LEN, KVB_AUTH_TARGET, &i, &t, proof);
    size_t len;
    uint8_t *buf = challenge_bytes(&t, proof, &len);
    for (size_t cut = 0; cut < len; cut++) {
        kvb_hello_t out;
        uint8_t mac[KVB_WIRE_MAC_LEN];
        cr_assert_eq(challenge_decode_exact(buf, cut, &out, mac), KVB_ERR_PROTOCOL,
                     "prefix %zu of %zu", cut, len);
    }
    free(buf);
}

Test(wire_challenge, short_payload_rejected)
{
    /* Nothing, part of a MAC, or a MAC alone: no hello at all. */
    uint8_t bytes[KVB_WIRE_MAC_LEN + 1];
    memset(bytes, 'a', sizeof bytes);
    for (size_t len = 0; len <= KVB_WIRE_MAC_LEN; len++) {
        kvb_hello_t out;
        uint8_t mac[KVB_WIRE_MAC_LEN];
        cr_assert_eq(challenge_decode_exact(bytes, len, &out, mac), KVB_ERR_PROTOCOL, "len %zu",
                     len);
    }
    /* A hello with no MAC behind it (a HELLO payload sent as CHALLENGE). */
    kvb_hello_t h = sample_hello("target");
    size_t n;
    uint8_t *hb = hello_bytes(&h, &n);
    kvb_hello_t out;
    uint8_t mac[KVB_WIRE_MAC_LEN];
    cr_assert_eq(challenge_decode_exact(hb, n, &out, mac), KVB_ERR_PROTOCOL);
    free(hb);
    /* A hello with a MAC one byte short. */
    uint8_t proof[KVB_WIRE_MAC_LEN];
    memset(proof, 0x42, sizeof proof);
    size_t len;
    uint8_t *buf = challenge_bytes(&h, proof, &len);
    cr_assert_eq(challenge_decode_exact(buf, len - 1, &out, mac), KVB_ERR_PROTOCOL);
    free(buf);
}

Test(wire_challenge, trailing_bytes_rejected)
{
    kvb_hello_t h = sample_hello("target");
    uint8_t proof[KVB_WIRE_MAC_LEN];
    for (int k = 0; k < KVB_WIRE_MAC_LEN; k++)
        proof[k] = (uint8_t)(0x80 + k);
    size_t len;
    uint8_t *buf = challenge_bytes(&h, proof, &len);
    size_t hs = len - KVB_WIRE_MAC_LEN;
    uint8_t *longer = calloc(1, len + 16);
    cr_assert_not_null(longer);
    for (size_t extra = 1; extra <= 16; extra++) {
        kvb_hello_t out;
        uint8_t mac[KVB_WIRE_MAC_LEN];
        /* hello | mac | extra */
        memset(longer, 0, len + 16);
        memcpy(longer, buf, len);
        cr_assert_eq(challenge_decode_exact(longer, len + extra, &out, mac), KVB_ERR_PROTOCOL,
                     "%zu bytes after the MAC", extra);
        /* hello | extra | mac */
        memset(longer, 'x', len + 16);
        memcpy(longer, buf, hs);
        memcpy(longer + hs + extra, proof, KVB_WIRE_MAC_LEN);
        cr_assert_eq(challenge_decode_exact(longer, len + extra, &out, mac), KVB_ERR_PROTOCOL,
                     "%zu bytes between hello and MAC", extra);
    }
    free(longer);
    free(buf);
}

Test(wire_challenge, bad_hello_part_rejected)
{
    kvb_hello_t h = sample_hello("tgt");
    uint8_t proof[KVB_WIRE_MAC_LEN];
    memset(proof, 0x11, sizeof proof);
    size_t len;
    uint8_t *buf = challenge_bytes(&h, proof, &len);
    kvb_hello_t out;
    uint8_t mac[KVB_WIRE_MAC_LEN];
    cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_OK);
    cr_assert_eq(get16(buf + HELLO_NAME_LEN_OFF), 3);
    buf[HELLO_NAME_OFF] = ' '; /* a non-printable first name byte */
    cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_ERR_PROTOCOL);
    buf[HELLO_NAME_OFF] = 't';
    put16(buf + HELLO_NAME_LEN_OFF, 0);
    cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_ERR_PROTOCOL);
    /* A name length that reaches into the MAC, even if the MAC bytes are printable. */
    memset(buf + len - KVB_WIRE_MAC_LEN, 'm', KVB_WIRE_MAC_LEN);
    const uint16_t lens[] = {4, 3 + KVB_WIRE_MAC_LEN, KVB_NAME_MAX + 1, 0xFFFF};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        put16(buf + HELLO_NAME_LEN_OFF, lens[k]);
        cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_ERR_PROTOCOL,
                     "name length %u", lens[k]);
    }
    /* A shorter name length leaves bytes between hello and MAC. */
    put16(buf + HELLO_NAME_LEN_OFF, 2);
    cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_ERR_PROTOCOL);
    put16(buf + HELLO_NAME_LEN_OFF, 3);
    cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_OK);
    free(buf);
}

Test(wire_challenge, mac_bytes_are_opaque)
{
    kvb_hello_t h = sample_hello("target");
    uint8_t proof[KVB_WIRE_MAC_LEN] = {0};
    size_t len;
    uint8_t *buf = challenge_bytes(&h, proof, &len);
    const uint8_t vals[] = {0x00, '\n', ' ', 0x7f, 0x80, 0xff};
    for (int pos = 0; pos < KVB_WIRE_MAC_LEN; pos++) {
        for (size_t v = 0; v < sizeof vals; v++) {
            buf[len - KVB_WIRE_MAC_LEN + pos] = vals[v];
            kvb_hello_t out;
            uint8_t mac[KVB_WIRE_MAC_LEN];
            cr_assert_eq(challenge_decode_exact(buf, len, &out, mac), KVB_OK, "pos %d", pos);
            assert_hello_eq(&out, &h);
            cr_assert_arr_eq(mac, buf + len - KVB_WIRE_MAC_LEN, KVB_WIRE_MAC_LEN);
        }
        buf[len - KVB_WIRE_MAC_LEN + pos] = 0;
    }
    free(buf);
}

/* --- ERROR frame status --------------------------------------------------------------------- */

TestSuite(wire_error_status, .timeout = 30);

static int is_passed_status(int64_t s)
{
    return s == KVB_ERR_VERSION || s == KVB_ERR_AUTH || s == KVB_ERR_PROTOCOL ||
           s == KVB_ERR_PEER_LOST;
}

Test(wire_error_status, peer_level_errors_pass_through)
{
    cr_assert_eq(kvb__wire_error_status(KVB_ERR_VERSION), KVB_ERR_VERSION);
    cr_assert_eq(kvb__wire_error_status(KVB_ERR_AUTH), KVB_ERR_AUTH);
    cr_assert_eq(kvb__wire_error_status(KVB_ERR_PROTOCOL), KVB_ERR_PROTOCOL);
    cr_assert_eq(kvb__wire_error_status(KVB_ERR_PEER_LOST), KVB_ERR_PEER_LOST);
}

Test(wire_error_status, anything_else_is_a_protocol_error)
{
    const int32_t others[] = {
        KVB_OK, 1, 2, 100, 102, 103, 106, 200, 201, INT32_MAX, INT_MAX, INT32_MIN, INT_MIN,
        INT32_MIN + 1, -1, -99, -101, -104, -105, -107, -199, -204, -299, -300, -1000,
        /* per-request codes are answered in READ_RESP / WRITE_ACK / NOTIFY_ACK, never ERROR */
        KVB_ERR_ACCESS_DENIED, KVB_ERR_REMOTE_NOT_REGISTERED, KVB_ERR_REMOTE_NO_SPACE,
        KVB_ERR_SHM_COPY,
        /* local-only codes a peer has no business reporting */
        KVB_ERR_INVALID_ARG, KVB_ERR_NOMEM, KVB_ERR_TIMEOUT, KVB_ERR_SYSTEM, KVB_ERR_SHUTDOWN,
        KVB_ERR_SEGMENT_NOT_FOUND, KVB_ERR_META_UNREACHABLE,
        /* peer-level, but only ever decided locally */
        KVB_ERR_CONNECT, KVB_ERR_PEER_RESTARTED, KVB_ERR_RESOLVE};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
        cr_assert_eq(kvb__wire_error_status(others[i]), KVB_ERR_PROTOCOL, "status %d mapped to %d",
                     others[i], kvb__wire_error_status(others[i]));
}

Test(wire_error_status, every_known_code)
{
    int n = 0, passed = 0;
#define CHECK_CODE(name, value, msg)                                                               \
    do {                                                                                           \
        int got = kvb__wire_error_status(KVB_##name);                                              \
        if (is_passed_status(KVB_##name)) {                                                        \
            cr_assert_eq(got, KVB_##name, #name " not passed through");                            \
            passed++;                                                                              \
        } else {                                                                                   \
            cr_assert_eq(got, KVB_ERR_PROTOCOL, #name " mapped to %d", got);                       \
        }                                                                                          \
        n++;                                                                                       \
    } while (0);
    KVB_STATUS_MAP(CHECK_CODE)
#undef CHECK_CODE
    cr_assert_eq(passed, 4);
    cr_assert_gt(n, 4);
}

Test(wire_error_status, sweep)
{
    uint64_t seed = 0xE77;
    for (int64_t s = -70000; s <= 70000; s++) {
        int got = kvb__wire_error_status((int32_t)s);
        cr_assert_eq(got, is_passed_status(s) ? (int)s : KVB_ERR_PROTOCOL, "status %lld",
                     (long long)s);
    }
    for (int it = 0; it < 100000; it++) {
        int32_t s = (int32_t)(uint32_t)rng_next(&seed);
        int got = kvb__wire_error_status(s);
        cr_assert(is_passed_status(got), "status %d mapped to %d", s, got);
        cr_assert_eq(got, is_passed_status(s) ? s : KVB_ERR_PROTOCOL, "status %d", s);
    }
}

/* --- hello_ack ---------------------------------------------------------------------------- */

TestSuite(wire_hello_ack, .timeout = 30);

/* Encodes, checks the bytes are hello + 4 + sum(24 + loc + keys) exactly as ack_by_hand lays them
 * out, decodes and compares. Returns the decoded regions (caller frees; NULL when n is 0). */
static kvb_region_desc_t *ack_roundtrip(const kvb_hello_t *h, const kvb_region_desc_t *regions,
                                        size_t n)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    cr_assert_eq(kvb__wire_hello_ack_encode(h, regions, n, &buf, &len), KVB_OK, "n=%zu", n);
    size_t expect = kvb__wire_hello_size(h) + 4;
    for (size_t i = 0; i < n; i++)
        expect += REGION_MIN_WIRE + strlen(regions[i].info.location) + regions[i].keys_len;
    cr_assert_eq(len, expect);
    cr_assert_leq(len, KVB_WIRE_MAX_HELLO_ACK);
    cr_assert_eq(get32(buf + kvb__wire_hello_size(h)), n);
    size_t hand_len;
    uint8_t *hand = ack_by_hand(h, regions, n, &hand_len);
    cr_assert_eq(hand_len, len);
    cr_assert_arr_eq(buf, hand, len, "encoding differs from the documented layout");
    free(hand);

    kvb_hello_t hout;
    kvb_region_desc_t *rout;
    size_t nout;
    cr_assert_eq(ack_decode_exact(buf, len, &hout, &rout, &nout), KVB_OK, "n=%zu", n);
    assert_hello_eq(&hout, h);
    cr_assert_eq(nout, n);
    if (n == 0) {
        cr_assert_null(rout);
    } else {
        assert_regions_eq(rout, regions, n);
        /* One allocation: the keys live after the descriptors, within what the wire carried. */
        uintptr_t lo = (uintptr_t)(rout + n), hi = lo + len;
        for (size_t i = 0; i < n; i++)
            if (rout[i].keys_len)
                cr_assert((uintptr_t)rout[i].keys >= lo &&
                              (uintptr_t)rout[i].keys + rout[i].keys_len <= hi,
                          "region %zu: keys outside the decoded block", i);
    }
    free(buf);
    return rout;
}

/* kvb__region_key(d, path) is want[0..want_len), or NULL when want is NULL. */
static void assert_key(const kvb_region_desc_t *d, unsigned path, const uint8_t *want,
                       size_t want_len, size_t region)
{
    size_t got_len = 0xdead;
    const uint8_t *got = kvb__region_key(d, path, &got_len);
    if (!want) {
        cr_assert_null(got, "region %zu path %u: a key where none was sent", region, path);
        return;
    }
    cr_assert_not_null(got, "region %zu path %u: key missing", region, path);
    cr_assert_eq(got_len, want_len, "region %zu path %u: key length", region, path);
    if (want_len)
        cr_assert_arr_eq(got, want, want_len, "region %zu path %u: key bytes", region, path);
}

Test(wire_hello_ack, roundtrip_zero_regions)
{
    kvb_hello_t h = sample_hello("target:1");
    cr_assert_null(ack_roundtrip(&h, NULL, 0));
}

Test(wire_hello_ack, roundtrip_one_region)
{
    kvb_hello_t h = sample_hello("target:1");
    kvb_region_desc_t r;
    set_region(&r, 0x7f0000001000ull, 1ull << 30, KVB_ACCESS_RW, "cuda:0");
    kvb_region_desc_t *out = ack_roundtrip(&h, &r, 1);
    cr_assert_eq(out[0].kind, KVB_MEM_CUDA);
    cr_assert_eq(out[0].device, 0);
    cr_assert_eq(out[0].keys_len, 0);
    free(out);
    /* The highest region there can be: it ends at UINT64_MAX. */
    set_region(&r, UINT64_MAX - 4096, 4096, KVB_ACCESS_READ, "*");
    free(ack_roundtrip(&h, &r, 1));
    set_region(&r, 0, UINT64_MAX, KVB_ACCESS_WRITE, "cpu");
    free(ack_roundtrip(&h, &r, 1));
}

Test(wire_hello_ack, roundtrip_memory_kinds)
{
    static const struct {
        const char *loc;
        kvb_mem_kind_t kind;
        int device;
    } cases[] = {{"cpu", KVB_MEM_CPU, -1},      {"cpu:3", KVB_MEM_CPU, 3},
                 {"cuda:0", KVB_MEM_CUDA, 0},   {"*", KVB_MEM_CPU, -1},
                 {"cuda:7", KVB_MEM_CUDA, 7},   {"cpu:65535", KVB_MEM_CPU, 65535},
                 {"cuda:12", KVB_MEM_CUDA, 12}, {"cpu:0", KVB_MEM_CPU, 0}};
    const size_t n = sizeof cases / sizeof cases[0];
    kvb_hello_t h = sample_hello("target:kinds");
    kvb_region_desc_t r[sizeof cases / sizeof cases[0]];
    for (size_t i = 0; i < n; i++)
        set_region(&r[i], 0x100000 * (i + 1), 0x1000, KVB_ACCESS_RW, cases[i].loc);
    kvb_region_desc_t *out = ack_roundtrip(&h, r, n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_str_eq(out[i].info.location, cases[i].loc);
        cr_assert_eq(out[i].kind, cases[i].kind, "%s: kind %d", cases[i].loc, out[i].kind);
        cr_assert_eq(out[i].device, cases[i].device, "%s: device %d", cases[i].loc, out[i].device);
    }
    free(out);
}

Test(wire_hello_ack, roundtrip_with_keys)
{
    kvb_hello_t h = sample_hello("target:keys");
    enum { N = 5 };
    static uint8_t store[N][KEYS_CAP];
    kvb_region_desc_t r[N];
    set_region(&r[0], 0x10000, 0x1000, KVB_ACCESS_RW, "cpu"); /* no keys */
    set_region(&r[1], 0x11000, 0x2000, KVB_ACCESS_READ, "cuda:0");
    add_key(&r[1], store[1], 2, 32, 1);
    set_region(&r[2], 0x20000, 0x100, KVB_ACCESS_WRITE, "cpu:3");
    add_key(&r[2], store[2], 5, KVB_KEY_MAX, 2);
    add_key(&r[2], store[2], 0, 1, 2);
    add_key(&r[2], store[2], KVB_PATHS_MAX - 1, 17, 2);
    set_region(&r[3], 0x30000, 0x100, KVB_ACCESS_RW, "*");
    add_key(&r[3], store[3], 1, 100, 3);
    add_key(&r[3], store[3], 3, KVB_KEY_MAX, 3);
    add_key(&r[3], store[3], 6, 2, 3);
    set_region(&r[4], 0x40000, 0x100, KVB_ACCESS_RW, "cuda:1");
    add_key(&r[4], store[4], 0, KVB_KEY_MAX, 4);
    cr_assert_eq(r[2].keys_len, 3 * 2 + KVB_KEY_MAX + 1 + 17);

    /* What each region should hold per path: its length, or -1 for none. */
    const int want[N][KVB_PATHS_MAX] = {
        {-1, -1, -1, -1, -1, -1, -1, -1},          /* r[0]: none */
        {-1, -1, 32, -1, -1, -1, -1, -1},          /* r[1]: one */
        {1, -1, -1, -1, -1, KVB_KEY_MAX, -1, 17},  /* r[2]: three */
        {-1, 100, -1, KVB_KEY_MAX, -1, -1, 2, -1}, /* r[3]: three */
        {KVB_KEY_MAX, -1, -1, -1, -1, -1, -1, -1}, /* r[4]: one, at the limit */
    };
    kvb_region_desc_t *out = ack_roundtrip(&h, r, N);
    for (size_t i = 0; i < N; i++) {
        for (unsigned p = 0; p < KVB_PATHS_MAX; p++) {
            uint8_t expect[KVB_KEY_MAX];
            if (want[i][p] < 0) {
                assert_key(&out[i], p, NULL, 0, i);
                assert_key(&r[i], p, NULL, 0, i); /* the local descriptors read the same */
                continue;
            }
            key_fill(expect, (size_t)want[i][p], p, (unsigned)i);
            assert_key(&out[i], p, expect, (size_t)want[i][p], i);
            assert_key(&r[i], p, expect, (size_t)want[i][p], i);
        }
        /* Ids past the last path are never found. */
        assert_key(&out[i], KVB_PATHS_MAX, NULL, 0, i);
        assert_key(&out[i], 255, NULL, 0, i);
        assert_key(&out[i], 0x100 | 2, NULL, 0, i);
        cr_assert(out[i].keys_len == 0 || out[i].keys != r[i].keys, "keys copied, not aliased");
    }
    free(out);
    /* A descriptor without keys at all. */
    kvb_region_desc_t bare;
    set_region(&bare, 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    for (unsigned p = 0; p < KVB_PATHS_MAX; p++)
        assert_key(&bare, p, NULL, 0, 0);
}

Test(wire_hello_ack, roundtrip_many_regions)
{
    kvb_hello_t h = sample_hello("target:many");
    size_t n = 1000;
    kvb_region_desc_t *r = calloc(n, sizeof *r);
    uint8_t *keys = calloc(n, KEYS_CAP);
    cr_assert_not_null(r);
    cr_assert_not_null(keys);
    fill_regions(r, n, 99, keys, KVB_KEY_MAX);
    free(ack_roundtrip(&h, r, n));
    fill_regions(r, n, 100, NULL, 0);
    free(ack_roundtrip(&h, r, n));
    free(keys);
    free(r);
}

Test(wire_hello_ack, roundtrip_max_regions_and_location)
{
    kvb_hello_t h = sample_hello("target:max");
    size_t n = KVB_WIRE_MAX_REGIONS;
    kvb_region_desc_t *r = calloc(n + 1, sizeof *r);
    cr_assert_not_null(r);
    static uint8_t key[2 + 64];
    key[0] = 4;
    key[1] = 64;
    key_fill(key + 2, 64, 4, 0);
    char loc[KVB_LOCATION_MAX + 1];
    valid_location(loc, KVB_LOCATION_MAX); /* "cpu:000...07", at the location limit */
    loc[KVB_LOCATION_MAX] = '\0';
    for (size_t i = 0; i <= n; i++) {
        set_region(&r[i], (uint64_t)i << 12, 4096, KVB_ACCESS_WRITE, loc);
        r[i].keys = key;
        r[i].keys_len = sizeof key;
    }
    kvb_region_desc_t *out = ack_roundtrip(&h, r, n);
    cr_assert_eq(out[n - 1].device, 7);
    free(out);
    uint8_t *buf = NULL;
    size_t len = 0;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, n + 1, &buf, &len), KVB_ERR_TOO_LARGE);
    cr_assert_null(buf);
    free(r);
}

Test(wire_hello_ack, encode_refuses_what_cannot_be_sent)
{
    kvb_hello_t h = sample_hello("target:big");
    static uint8_t keys[KEYS_CAP];
    kvb_region_desc_t one;
    set_region(&one, 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    one.keys = keys;
    one.keys_len = KVB_REGION_KEYS_MAX + 1;
    uint8_t *buf = NULL;
    size_t len = 0;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, &one, 1, &buf, &len), KVB_ERR_TOO_LARGE);
    cr_assert_null(buf);

    /* Every region at the key limit: over KVB_WIRE_MAX_HELLO_ACK in all. */
    size_t n = KVB_WIRE_MAX_REGIONS;
    kvb_region_desc_t *r = calloc(n, sizeof *r);
    cr_assert_not_null(r);
    for (size_t i = 0; i < n; i++) {
        set_region(&r[i], (uint64_t)i << 12, 4096, KVB_ACCESS_RW, "*");
        r[i].keys = keys;
        r[i].keys_len = KVB_REGION_KEYS_MAX;
    }
    cr_assert_gt(n * (REGION_MIN_WIRE + 1 + KVB_REGION_KEYS_MAX), KVB_WIRE_MAX_HELLO_ACK);
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, n, &buf, &len), KVB_ERR_TOO_LARGE);
    cr_assert_null(buf);
    free(r);
}

/* n minimal valid regions ("*", no keys: 25 bytes each) after a count of `count`. */
static uint8_t *ack_minimal_regions(const kvb_hello_t *h, uint32_t count, size_t n, size_t *len)
{
    size_t hs = kvb__wire_hello_size(h);
    *len = hs + 4 + n * (REGION_MIN_WIRE + 1);
    uint8_t *buf = calloc(1, *len);
    cr_assert_not_null(buf);
    kvb__wire_hello_encode(h, buf);
    put32(buf + hs, count);
    for (size_t i = 0; i < n; i++) {
        uint8_t *p = buf + hs + 4 + i * (REGION_MIN_WIRE + 1);
        put64(p, (uint64_t)i << 12);
        put64(p + 8, 4096);
        put32(p + 16, KVB_ACCESS_READ);
        put16(p + 20, 1);
        p[22] = '*';
        put16(p + 23, 0);
    }
    return buf;
}

Test(wire_hello_ack, region_count_over_max_rejected)
{
    /* Bytes for KVB_WIRE_MAX_REGIONS + 1 minimal regions are present; the count is still over. */
    kvb_hello_t h = sample_hello("t");
    size_t count = KVB_WIRE_MAX_REGIONS + 1, len;
    uint8_t *buf = ack_minimal_regions(&h, (uint32_t)count, count, &len);
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    /* One fewer region and count: accepted. */
    put32(buf + kvb__wire_hello_size(&h), (uint32_t)(count - 1));
    cr_assert_eq(ack_decode_exact(buf, len - (REGION_MIN_WIRE + 1), &ho, &ro, &no), KVB_OK);
    cr_assert_eq(no, count - 1);
    cr_assert_eq(ro[count - 2].info.addr, (uint64_t)(count - 2) << 12);
    free(ro);
    free(buf);
}

Test(wire_hello_ack, region_count_larger_than_bytes_rejected)
{
    kvb_hello_t h = sample_hello("target");
    kvb_region_desc_t r[2];
    set_region(&r[0], 1, 2, 1, "cpu");
    char loc[37];
    valid_location(loc, 36); /* > 24 bytes of location */
    loc[36] = '\0';
    set_region(&r[1], 3, 4, 2, loc);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 2, &buf, &len), KVB_OK);
    size_t off = ack_count_off(strlen(h.name));
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK);
    cr_assert_eq(no, 2);
    free(ro);
    const size_t room = len - off - 4; /* region bytes */
    const uint32_t counts[] = {3,
                               4,
                               (uint32_t)(room / REGION_MIN_WIRE + 1),
                               (uint32_t)(room / 22 + 1),
                               1000,
                               KVB_WIRE_MAX_REGIONS,
                               KVB_WIRE_MAX_REGIONS + 1,
                               0x7FFFFFFF,
                               0xFFFFFFFF};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        /* Would need about count * sizeof(kvb_region_desc_t) bytes if trusted: must fail fast
         * with a protocol error rather than allocating it (or reporting NOMEM). */
        put32(buf + off, counts[i]);
        cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL, "count %u",
                     counts[i]);
    }
    /* And a count one short leaves bytes unaccounted for. */
    put32(buf + off, 1);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    put32(buf + off, 0);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);

    /* Count with no region bytes at all. */
    size_t hs = kvb__wire_hello_size(&h);
    uint8_t *small = calloc(1, hs + 4);
    cr_assert_not_null(small);
    kvb__wire_hello_encode(&h, small);
    put32(small + hs, 0xFFFFFFFF);
    cr_assert_eq(ack_decode_exact(small, hs + 4, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    put32(small + hs, 1);
    cr_assert_eq(ack_decode_exact(small, hs + 4, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(small);

    /* The bound is 24 bytes a region: a count that 22-byte regions would fit in `room` bytes of
     * zeros, but 24-byte ones do not, is a protocol error too (not a huge allocation). */
    for (size_t room2 = 0; room2 < 8 * REGION_MIN_WIRE; room2++) {
        uint8_t *m = calloc(1, hs + 4 + room2);
        cr_assert_not_null(m);
        kvb__wire_hello_encode(&h, m);
        const uint32_t cs[] = {(uint32_t)(room2 / REGION_MIN_WIRE + 1), (uint32_t)(room2 / 22)};
        for (size_t c = 0; c < 2; c++) {
            if (cs[c] == 0)
                continue;
            put32(m + hs, cs[c]);
            cr_assert_eq(ack_decode_exact(m, hs + 4 + room2, &ho, &ro, &no), KVB_ERR_PROTOCOL,
                         "count %u, %zu region bytes", cs[c], room2);
        }
        free(m);
    }
}

/* A single-region ack with the given location length field and location bytes (a valid location
 * where ll_bytes allows one) and no keys. */
static uint8_t *ack_with_location(uint16_t ll_field, size_t ll_bytes, uint32_t access, size_t *len)
{
    kvb_hello_t h = sample_hello("t");
    size_t hs = kvb__wire_hello_size(&h);
    *len = hs + 4 + REGION_MIN_WIRE + ll_bytes;
    uint8_t *buf = calloc(1, *len);
    cr_assert_not_null(buf);
    kvb__wire_hello_encode(&h, buf);
    put32(buf + hs, 1);
    uint8_t *p = buf + hs + 4;
    put64(p, 0x1000);
    put64(p + 8, 0x2000);
    put32(p + 16, access);
    put16(p + 20, ll_field);
    if (ll_bytes == 1 || ll_bytes == 3 || ll_bytes >= 5)
        valid_location((char *)p + 22, ll_bytes);
    else
        memset(p + 22, 'g', ll_bytes);
    put16(p + 22 + ll_bytes, 0); /* keys_len */
    return buf;
}

Test(wire_hello_ack, location_length_limit)
{
    size_t len;
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    uint8_t *buf = ack_with_location(KVB_LOCATION_MAX, KVB_LOCATION_MAX, KVB_ACCESS_RW, &len);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK);
    cr_assert_eq(no, 1);
    cr_assert_eq(strlen(ro[0].info.location), KVB_LOCATION_MAX);
    cr_assert_eq(ro[0].kind, KVB_MEM_CPU);
    cr_assert_eq(ro[0].device, 7);
    free(ro);
    free(buf);

    /* One byte over, the same valid form: refused for its length alone. */
    buf = ack_with_location(KVB_LOCATION_MAX + 1, KVB_LOCATION_MAX + 1, KVB_ACCESS_RW, &len);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);
    buf = ack_with_location(0xFFFF, 0xFFFF, KVB_ACCESS_RW, &len);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);
    /* A location length pointing past the end of the input. */
    buf = ack_with_location(10, 9, KVB_ACCESS_RW, &len);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);
}

Test(wire_hello_ack, access_bits)
{
    const uint32_t good[] = {KVB_ACCESS_READ, KVB_ACCESS_WRITE, KVB_ACCESS_RW};
    const uint32_t bad[] = {0, 4, 5, 7, 8, 0x100, 0x80000000u, 0x80000003u, 0xFFFFFFFFu};
    size_t len;
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        uint8_t *buf = ack_with_location(3, 3, good[i], &len);
        cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK, "access %u", good[i]);
        cr_assert_eq(ro[0].info.access, good[i]);
        free(ro);
        free(buf);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t *buf = ack_with_location(3, 3, bad[i], &len);
        cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL, "access 0x%x",
                     bad[i]);
        free(buf);
    }
}

Test(wire_hello_ack, bad_access_in_a_later_region_rejected)
{
    kvb_hello_t h = sample_hello("target");
    kvb_region_desc_t r[5];
    static uint8_t keys[5 * KEYS_CAP];
    fill_regions(r, 5, 7, keys, 40);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 5, &buf, &len), KVB_OK);
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK);
    free(ro);
    /* Walk to the last region and corrupt its access word. */
    size_t off = ack_count_off(strlen(h.name)) + 4;
    for (int i = 0; i < 4; i++) {
        size_t ll = get16(buf + off + 20);
        off += REGION_MIN_WIRE + ll + get16(buf + off + 22 + ll);
    }
    cr_assert_eq(get64(buf + off), r[4].info.addr, "walked to the last region");
    put32(buf + off + 16, 0x10);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);
}

Test(wire_hello_ack, bad_hello_part_rejected)
{
    kvb_hello_t h = sample_hello("tgt");
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, NULL, 0, &buf, &len), KVB_OK);
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK);
    cr_assert_eq(buf[66], 't');
    buf[66] = ' '; /* first name byte */
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    buf[66] = 't';
    cr_assert_eq(get16(buf + 64), 3);
    put16(buf + 64, 0);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    put16(buf + 64, 4); /* swallows one byte of the count */
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);
}

Test(wire_hello_ack, every_truncation_rejected)
{
    kvb_hello_t h = sample_hello("target:trunc");
    kvb_region_desc_t r[3];
    static uint8_t keys[3 * KEYS_CAP];
    fill_regions(r, 3, 1234, NULL, 0);
    strcpy(r[1].info.location, "*"); /* the shortest location in the middle */
    add_key(&r[0], keys, 3, KVB_KEY_MAX, 0);
    add_key(&r[0], keys, 1, 5, 0);
    add_key(&r[2], keys + 2 * KEYS_CAP, 0, 9, 2);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 3, &buf, &len), KVB_OK);
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK, "the whole message");
    free(ro);
    for (size_t cut = 0; cut < len; cut++)
        cr_assert_eq(ack_decode_exact(buf, cut, &ho, &ro, &no), KVB_ERR_PROTOCOL,
                     "prefix %zu of %zu", cut, len);
    free(buf);
}

Test(wire_hello_ack, trailing_bytes_rejected)
{
    kvb_hello_t h = sample_hello("target");
    kvb_region_desc_t r[2];
    static uint8_t keys[2 * KEYS_CAP];
    fill_regions(r, 2, 5, keys, 20);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 2, &buf, &len), KVB_OK);
    uint8_t *longer = calloc(1, len + 30);
    cr_assert_not_null(longer);
    memcpy(longer, buf, len);
    for (size_t extra = 1; extra <= 30; extra++) {
        kvb_hello_t ho;
        kvb_region_desc_t *ro;
        size_t no;
        cr_assert_eq(ack_decode_exact(longer, len + extra, &ho, &ro, &no), KVB_ERR_PROTOCOL,
                     "%zu trailing bytes", extra);
    }
    free(longer);
    free(buf);
}

/* --- hello_ack: what decode refuses ------------------------------------------------------- */

/* Builds regions[0..n) by hand and decodes them: KVB_OK (freeing the result) or the error. */
static int ack_try(const kvb_region_desc_t *r, size_t n)
{
    kvb_hello_t h = sample_hello("target:rules");
    size_t len;
    uint8_t *buf = ack_by_hand(&h, r, n, &len);
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    int rc = ack_decode_exact(buf, len, &ho, &ro, &no);
    if (rc == KVB_OK) {
        cr_assert_eq(no, n);
        free(ro);
    }
    free(buf);
    return rc;
}

Test(wire_hello_ack, empty_region_rejected)
{
    kvb_region_desc_t r[2];
    set_region(&r[0], 0x1000, 1, KVB_ACCESS_RW, "cpu");
    set_region(&r[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(ack_try(r, 2), KVB_OK, "a one-byte region is fine");
    r[0].info.len = 0;
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "len 0 in the first region");
    cr_assert_eq(ack_try(r, 1), KVB_ERR_PROTOCOL, "len 0 alone");
    r[0].info.len = 1;
    r[1].info.len = 0;
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "len 0 in a later region");
}

Test(wire_hello_ack, address_overflow_rejected)
{
    kvb_region_desc_t r;
    set_region(&r, UINT64_MAX - 4096, 4096, KVB_ACCESS_READ, "*");
    cr_assert_eq(ack_try(&r, 1), KVB_OK, "ends at UINT64_MAX");
    const uint64_t bad[][2] = {{UINT64_MAX, UINT64_MAX},
                               {UINT64_MAX - 4095, 4096}, /* ends one past UINT64_MAX */
                               {UINT64_MAX, 1},
                               {1, UINT64_MAX},
                               {1ull << 63, 1ull << 63}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        set_region(&r, bad[i][0], bad[i][1], KVB_ACCESS_READ, "*");
        cr_assert_eq(ack_try(&r, 1), KVB_ERR_PROTOCOL, "addr 0x%llx len 0x%llx",
                     (unsigned long long)bad[i][0], (unsigned long long)bad[i][1]);
    }
    /* In a later region, after a valid one. */
    kvb_region_desc_t two[2];
    set_region(&two[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&two[1], 0x10000, UINT64_MAX, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(ack_try(two, 2), KVB_ERR_PROTOCOL);
}

Test(wire_hello_ack, location_must_be_a_memory_kind)
{
    static const char *const good[] = {"cpu", "cpu:3", "cuda:0", "*", "cpu:0", "cuda:65535"};
    static const char *const bad[] = {"",       "gpu",    "cpu:",   "cpu:x",    "cuda",
                                      "cuda:",  "cpu:-1", "cpu:1a", "cuda:1:2", "cpu:99999999",
                                      " cpu",   "cpu ",   "CPU",    "**",       "cuda:65536",
                                      "cuda:*", "host"};
    kvb_region_desc_t r;
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, good[i]);
        cr_assert_eq(ack_try(&r, 1), KVB_OK, "location \"%s\"", good[i]);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, bad[i]);
        cr_assert_eq(ack_try(&r, 1), KVB_ERR_PROTOCOL, "location \"%s\"", bad[i]);
    }
    /* The encoder sends whatever it is given: an empty location goes out but does not come back. */
    kvb_hello_t h = sample_hello("target");
    set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, "");
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, &r, 1, &buf, &len), KVB_OK);
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    free(buf);
    /* A bad location in a later region. */
    kvb_region_desc_t two[2];
    set_region(&two[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cuda:1");
    set_region(&two[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cuda");
    cr_assert_eq(ack_try(two, 2), KVB_ERR_PROTOCOL);
}

Test(wire_hello_ack, regions_must_be_sorted_and_disjoint)
{
    kvb_region_desc_t r[3];
    set_region(&r[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&r[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cpu"); /* adjacent: fine */
    set_region(&r[2], 0x8000, 0x1000, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(ack_try(r, 3), KVB_OK);

    const struct {
        uint64_t addr, len;
        const char *what;
    } bad[] = {
        {0x1fff, 0x1000, "overlaps the previous region by one byte"},
        {0x1000, 0x1000, "same range as the previous one"},
        {0x1000, 0x10, "same start"},
        {0x1800, 0x10, "inside the previous one"},
        {0x0, 0x1000, "before the previous one, adjacent"},
        {0x0, 0x10, "before the previous one"},
        {0x0, 0x100000, "before, and covering the previous one"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        set_region(&r[1], bad[i].addr, bad[i].len, KVB_ACCESS_RW, "cpu");
        cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "second region: %s", bad[i].what);
        cr_assert_eq(ack_try(r, 3), KVB_ERR_PROTOCOL, "second of three: %s", bad[i].what);
    }
    /* The first two in order, the third back before them. */
    set_region(&r[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&r[2], 0x1000, 0x100, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(ack_try(r, 3), KVB_ERR_PROTOCOL, "third region out of order");
    set_region(&r[2], 0x2fff, 0x100, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(ack_try(r, 3), KVB_ERR_PROTOCOL, "third region overlapping the second");
    set_region(&r[2], 0x3000, 0x100, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(ack_try(r, 3), KVB_OK, "third region adjacent to the second");
}

Test(wire_hello_ack, keys_len_over_max_rejected)
{
    static uint8_t store[KEYS_CAP];
    kvb_region_desc_t r;
    /* A well-formed run of exactly KVB_REGION_KEYS_MAX bytes... */
    set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    size_t left = KVB_REGION_KEYS_MAX;
    for (unsigned p = 0; left > 0; p++) {
        cr_assert_lt(p, KVB_PATHS_MAX);
        size_t k = left - 2 > KVB_KEY_MAX ? KVB_KEY_MAX : left - 2;
        add_key(&r, store, p, k, 0);
        left -= 2 + k;
    }
    cr_assert_eq(r.keys_len, KVB_REGION_KEYS_MAX);
    cr_assert_eq(ack_try(&r, 1), KVB_OK, "keys at the limit");
    /* ...and one a byte longer (its last key one byte longer): refused for its length alone. */
    size_t last = KVB_REGION_KEYS_MAX - 2 - (KVB_REGION_KEYS_MAX % (2 + KVB_KEY_MAX) - 2);
    cr_assert_lt(store[last + 1], KVB_KEY_MAX);
    store[last + 1]++;
    r.keys_len++;
    cr_assert_eq(r.keys_len, KVB_REGION_KEYS_MAX + 1);
    cr_assert_eq(ack_try(&r, 1), KVB_ERR_PROTOCOL, "keys one byte over the limit");
    /* A keys_len far over the limit, bytes present. */
    memset(store, 0, sizeof store);
    r.keys_len = 0;
    r.keys = NULL;
    for (unsigned p = 0; p < 6; p++)
        add_key(&r, store, p, KVB_KEY_MAX, 0);
    cr_assert_gt(r.keys_len, KVB_REGION_KEYS_MAX);
    cr_assert_eq(ack_try(&r, 1), KVB_ERR_PROTOCOL, "keys_len %u", r.keys_len);
}

Test(wire_hello_ack, key_path_out_of_range_rejected)
{
    static uint8_t store[KEYS_CAP];
    const unsigned bad[] = {KVB_PATHS_MAX, KVB_PATHS_MAX + 1, 31, 32, 128, 255};
    for (size_t i = 0; i <= sizeof bad / sizeof bad[0]; i++) {
        kvb_region_desc_t r[2];
        set_region(&r[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
        set_region(&r[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cuda:0");
        add_key(&r[1], store, 0, 8, 0);
        unsigned path = i < sizeof bad / sizeof bad[0] ? bad[i] : KVB_PATHS_MAX - 1;
        add_key(&r[1], store, path, 8, 0);
        int want = i < sizeof bad / sizeof bad[0] ? KVB_ERR_PROTOCOL : KVB_OK;
        cr_assert_eq(ack_try(r, 2), want, "path id %u", path);
    }
}

Test(wire_hello_ack, key_path_twice_rejected)
{
    static uint8_t store[KEYS_CAP];
    kvb_region_desc_t r;
    set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    add_key(&r, store, 0, 4, 0);
    add_key(&r, store, 1, 4, 0);
    add_key(&r, store, 2, 4, 0);
    cr_assert_eq(ack_try(&r, 1), KVB_OK, "distinct paths");
    add_key(&r, store, 0, 4, 1);
    cr_assert_eq(ack_try(&r, 1), KVB_ERR_PROTOCOL, "path 0 twice, apart");

    r.keys = NULL;
    r.keys_len = 0;
    add_key(&r, store, 5, 3, 0);
    add_key(&r, store, 5, 3, 0);
    cr_assert_eq(ack_try(&r, 1), KVB_ERR_PROTOCOL, "path 5 twice in a row");
    /* The same path in two different regions is fine. */
    static uint8_t store2[KEYS_CAP];
    kvb_region_desc_t two[2];
    set_region(&two[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&two[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cpu");
    add_key(&two[0], store, 5, 3, 0);
    add_key(&two[1], store2, 5, 3, 1);
    cr_assert_eq(ack_try(two, 2), KVB_OK, "one path in two regions");
}

Test(wire_hello_ack, key_too_long_rejected)
{
    static uint8_t store[KEYS_CAP];
    const size_t lens[] = {KVB_KEY_MAX, KVB_KEY_MAX + 1, KVB_KEY_MAX + 2, 255};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        kvb_region_desc_t r;
        set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
        add_key(&r, store, 2, lens[i], 0);
        cr_assert_leq(r.keys_len, KVB_REGION_KEYS_MAX);
        cr_assert_eq(ack_try(&r, 1), lens[i] <= KVB_KEY_MAX ? KVB_OK : KVB_ERR_PROTOCOL,
                     "key of %zu bytes", lens[i]);
        /* The same after a valid entry. */
        memset(store, 0, sizeof store);
        set_region(&r, 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
        add_key(&r, store, 0, 10, 0);
        add_key(&r, store, 2, lens[i], 0);
        cr_assert_eq(ack_try(&r, 1), lens[i] <= KVB_KEY_MAX ? KVB_OK : KVB_ERR_PROTOCOL,
                     "second key of %zu bytes", lens[i]);
    }
}

Test(wire_hello_ack, keys_must_fill_keys_len_exactly)
{
    static uint8_t store[KEYS_CAP];
    kvb_region_desc_t r[2];
    set_region(&r[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    add_key(&r[0], store, 0, 5, 0);
    add_key(&r[0], store, 1, 3, 0);
    set_region(&r[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cpu");
    cr_assert_eq(r[0].keys_len, 12);
    cr_assert_eq(ack_try(r, 2), KVB_OK);
    cr_assert_eq(ack_try(r, 1), KVB_OK);

    /* keys_len ends inside the last entry's key (the message length still matches). */
    r[0].keys_len = 11;
    cr_assert_eq(ack_try(r, 1), KVB_ERR_PROTOCOL, "last key cut short");
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "last key cut short, region follows");
    /* keys_len ends inside an entry's header. */
    r[0].keys_len = 8;
    cr_assert_eq(ack_try(r, 1), KVB_ERR_PROTOCOL, "dangling path byte");
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "dangling path byte, region follows");
    /* keys_len ends inside the first entry. */
    for (uint16_t kl = 1; kl < 7; kl++) {
        r[0].keys_len = kl;
        cr_assert_eq(ack_try(r, 1), KVB_ERR_PROTOCOL, "keys_len %u", kl);
    }
    /* A byte left after the last entry: no room for another entry's header. */
    store[12] = 2;
    r[0].keys_len = 13;
    cr_assert_eq(ack_try(r, 1), KVB_ERR_PROTOCOL, "one byte after the entries");
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "one byte after the entries, region follows");
    /* An entry claiming more than the run (and the message) holds. */
    r[0].keys_len = 12;
    cr_assert_eq(store[8], 3, "second entry's length byte");
    store[8] = 100;
    cr_assert_eq(ack_try(r, 1), KVB_ERR_PROTOCOL, "key past the end of the message");
    store[8] = 4;
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "key one byte past the run");
    store[8] = 2;
    cr_assert_eq(ack_try(r, 2), KVB_ERR_PROTOCOL, "key one byte short of the run");
    store[8] = 3;
    cr_assert_eq(ack_try(r, 2), KVB_OK);
}

Test(wire_hello_ack, keys_then_missing_regions_rejected)
{
    /* A count promising more regions than follow, after a region with a long key run: the keys
     * already read must not be copied past the block sized from the count (each region at least
     * 24 bytes), and the message is a protocol error. */
    kvb_hello_t h = sample_hello("target:short");
    static uint8_t store[KEYS_CAP];
    kvb_region_desc_t r[3];
    set_region(&r[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    add_key(&r[0], store, 0, KVB_KEY_MAX, 0);
    add_key(&r[0], store, 1, KVB_KEY_MAX, 0);
    add_key(&r[0], store, 2, KVB_KEY_MAX, 0);
    set_region(&r[1], 0x2000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&r[2], 0x3000, 0x1000, KVB_ACCESS_RW, "cpu");
    kvb_hello_t ho;
    kvb_region_desc_t *ro;
    size_t no;
    size_t len;
    uint8_t *buf = ack_by_hand(&h, r, 3, &len);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK);
    free(ro);
    const size_t count_off = ack_count_off(strlen(h.name));
    const size_t first = REGION_MIN_WIRE + 3 + r[0].keys_len;
    for (uint32_t count = 2; count <= 24; count++) {
        /* Only the first region present, or the first two; the count says more. */
        for (size_t have = 1; have <= 2; have++) {
            size_t cut = count_off + 4 + first + (have - 1) * (REGION_MIN_WIRE + 3);
            if (count <= have || (size_t)count * REGION_MIN_WIRE > cut - count_off - 4)
                continue;
            put32(buf + count_off, count);
            cr_assert_eq(ack_decode_exact(buf, cut, &ho, &ro, &no), KVB_ERR_PROTOCOL,
                         "count %u, %zu regions present", count, have);
        }
    }
    free(buf);
}

/* --- hello_ack: consistency under mutation ------------------------------------------------ */

/* Checks a successfully decoded hello_ack against an independent reading of its bytes. */
static void check_consistent(const uint8_t *in, size_t len, const kvb_hello_t *h,
                             const kvb_region_desc_t *r, size_t n)
{
    cr_assert_geq(len, HELLO_NAME_OFF + 1 + 4);
    cr_assert_eq(h->incarnation, get64(in));
    cr_assert_eq(h->pid, get32(in + 8));
    cr_assert_eq(h->lane, get32(in + 12));
    cr_assert_arr_eq(h->host_id, in + HELLO_HOST_OFF, KVB_HOST_ID_LEN);
    cr_assert_arr_eq(h->nonce, in + HELLO_NONCE_OFF, KVB_WIRE_NONCE_LEN);
    size_t nl = get16(in + HELLO_NAME_LEN_OFF);
    cr_assert(nl >= 1 && nl <= KVB_NAME_MAX, "name length %zu accepted", nl);
    cr_assert_eq(strlen(h->name), nl);
    cr_assert_arr_eq(h->name, in + HELLO_NAME_OFF, nl);
    for (size_t i = 0; i < nl; i++)
        cr_assert(h->name[i] >= 0x21 && h->name[i] <= 0x7e, "name byte 0x%02x accepted",
                  (unsigned char)h->name[i]);
    size_t off = HELLO_NAME_OFF + nl;
    cr_assert_leq(off + 4, len);
    cr_assert_eq(get32(in + off), n);
    cr_assert_leq(n, KVB_WIRE_MAX_REGIONS);
    cr_assert((n == 0) == (r == NULL));
    off += 4;
    int canonical = 1;
    for (size_t i = 0; i < n; i++) {
        cr_assert_leq(off + REGION_MIN_WIRE, len);
        cr_assert_eq(r[i].info.addr, get64(in + off));
        cr_assert_eq(r[i].info.len, get64(in + off + 8));
        cr_assert_eq(r[i].info.access, get32(in + off + 16));
        cr_assert_neq(r[i].info.access, 0);
        cr_assert_eq(r[i].info.access & ~(unsigned)KVB_ACCESS_RW, 0);
        cr_assert_neq(r[i].info.len, 0, "region %zu: empty", i);
        cr_assert_leq(r[i].info.addr, UINT64_MAX - r[i].info.len, "region %zu: overflows", i);
        if (i > 0)
            cr_assert_geq(r[i].info.addr, r[i - 1].info.addr + r[i - 1].info.len,
                          "region %zu: out of order or overlapping", i);
        size_t ll = get16(in + off + 20);
        cr_assert_leq(ll, KVB_LOCATION_MAX);
        cr_assert_leq(off + REGION_MIN_WIRE + ll, len);
        cr_assert_arr_eq(r[i].info.location, in + off + 22, ll);
        cr_assert_eq(r[i].info.location[ll], '\0');
        if (strlen(r[i].info.location) != ll)
            canonical = 0; /* an embedded NUL: the string cannot re-encode to these bytes */
        kvb_mem_kind_t kind;
        int device;
        cr_assert_eq(kvb__mem_kind_parse(r[i].info.location, &kind, &device), KVB_OK,
                     "location \"%s\" accepted", r[i].info.location);
        cr_assert_eq(r[i].kind, kind);
        cr_assert_eq(r[i].device, device);
        off += 22 + ll;
        size_t kl = get16(in + off);
        off += 2;
        cr_assert_leq(kl, KVB_REGION_KEYS_MAX);
        cr_assert_leq(off + kl, len);
        cr_assert_eq(r[i].keys_len, kl);
        if (kl)
            cr_assert_arr_eq(r[i].keys, in + off, kl);
        /* The run, read independently: entries filling it exactly, known paths, none twice. */
        unsigned seen = 0;
        size_t e = 0;
        while (e < kl) {
            cr_assert_leq(e + 2, kl, "region %zu: dangling entry header", i);
            unsigned path = in[off + e], klen = in[off + e + 1];
            cr_assert_lt(path, KVB_PATHS_MAX, "region %zu: path %u", i, path);
            cr_assert_eq(seen & (1u << path), 0, "region %zu: path %u twice", i, path);
            cr_assert_leq(klen, KVB_KEY_MAX);
            cr_assert_leq(e + 2 + klen, kl, "region %zu: key past the run", i);
            seen |= 1u << path;
            size_t got_len;
            const uint8_t *got = kvb__region_key(&r[i], path, &got_len);
            cr_assert_not_null(got);
            cr_assert_eq(got_len, klen);
            if (klen)
                cr_assert_arr_eq(got, in + off + e + 2, klen);
            e += 2 + klen;
        }
        for (unsigned p = 0; p < KVB_PATHS_MAX; p++) {
            size_t got_len;
            if (!(seen & (1u << p)))
                cr_assert_null(kvb__region_key(&r[i], p, &got_len));
        }
        off += kl;
    }
    cr_assert_eq(off, len);
    if (canonical) {
        uint8_t *again;
        size_t again_len;
        cr_assert_eq(kvb__wire_hello_ack_encode(h, r, n, &again, &again_len), KVB_OK);
        cr_assert_eq(again_len, len);
        cr_assert_arr_eq(again, in, len);
        free(again);
    }
}

Test(wire_hello_ack, mutation_fuzz)
{
    kvb_hello_t h = sample_hello("fuzz-target:4242");
    kvb_region_desc_t r[4];
    static uint8_t keys[4 * KEYS_CAP];
    fill_regions(r, 4, 31337, NULL, 0);
    strcpy(r[0].info.location, "cpu");
    strcpy(r[2].info.location, "*");
    add_key(&r[0], keys, 0, 6, 0);
    add_key(&r[0], keys, 7, 3, 0);
    add_key(&r[1], keys + KEYS_CAP, 2, 12, 1);
    add_key(&r[3], keys + 3 * KEYS_CAP, 4, 1, 3);
    add_key(&r[3], keys + 3 * KEYS_CAP, 1, 9, 3);
    add_key(&r[3], keys + 3 * KEYS_CAP, 6, 2, 3);
    uint8_t *base;
    size_t base_len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 4, &base, &base_len), KVB_OK);

    uint64_t seed = 0x9E3779B97F4A7C15ull;
    uint8_t work[1024];
    cr_assert_lt(base_len + 8, sizeof work);
    int ok = 0, failed = 0;
    for (int it = 0; it < 20000; it++) {
        size_t len = base_len;
        memcpy(work, base, base_len);
        memset(work + base_len, 0, sizeof work - base_len);
        int flips = 1 + (int)(rng_next(&seed) % 4);
        for (int f = 0; f < flips; f++) {
            size_t pos = (size_t)(rng_next(&seed) % base_len);
            uint64_t how = rng_next(&seed);
            switch (how % 4) {
            case 0: /* single bit */
                work[pos] ^= (uint8_t)(1u << ((how >> 8) % 8));
                break;
            case 1: /* random byte */
                work[pos] = (uint8_t)(how >> 8);
                break;
            case 2: /* small increment/decrement: hits lengths and counts */
                work[pos] = (uint8_t)(work[pos] + ((how >> 8) % 2 ? 1 : -1));
                break;
            default: /* an extreme value */
                work[pos] = (how >> 8) % 2 ? 0xFF : 0x00;
                break;
            }
        }
        uint64_t resize = rng_next(&seed) % 16;
        if (resize == 0)
            len -= 1 + (size_t)(rng_next(&seed) % 8);
        else if (resize == 1)
            len += 1 + (size_t)(rng_next(&seed) % 8);

        kvb_hello_t ho;
        kvb_region_desc_t *ro;
        size_t no;
        int rc = ack_decode_exact(work, len, &ho, &ro, &no);
        cr_assert(rc == KVB_OK || rc == KVB_ERR_PROTOCOL, "iteration %d: rc %d", it, rc);
        if (rc == KVB_OK) {
            ok++;
            check_consistent(work, len, &ho, ro, no);
        } else {
            failed++;
        }
        free(ro);
    }
    /* Both outcomes must have been exercised for the loop to mean anything. */
    cr_assert_gt(ok, 100, "only %d mutations decoded", ok);
    cr_assert_gt(failed, 100, "only %d mutations failed", failed);
    free(base);
}

/* --- kvb__region_find --------------------------------------------------------------------- */

TestSuite(region_find, .timeout = 30);

Test(region_find, hits_and_misses)
{
    kvb_region_desc_t d[4];
    set_region(&d[0], 0x1000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&d[1], 0x3000, 0x1000, KVB_ACCESS_RW, "cpu");
    set_region(&d[2], 0x4000, 0x2000, KVB_ACCESS_RW, "cuda:0"); /* adjacent to d[1] */
    set_region(&d[3], 0x10000, 0x100, KVB_ACCESS_READ, "cpu");
    const struct {
        uint64_t addr, len;
        int want; /* index into d, or -1 */
        const char *what;
    } cases[] = {
        {0x1000, 1, 0, "first byte of the first region"},
        {0x1000, 0x10, 0, "start of the first region"},
        {0x1800, 0x10, 0, "middle of the first region"},
        {0x1fff, 1, 0, "last byte of the first region"},
        {0x1ff0, 0x10, 0, "end of the first region"},
        {0x1000, 0x1000, 0, "all of the first region"},
        {0x3000, 0x10, 1, "start of a middle region"},
        {0x3ff0, 0x10, 1, "end of a region followed by an adjacent one"},
        {0x4000, 0x10, 2, "start of a region right after another"},
        {0x4800, 0x100, 2, "middle of a middle region"},
        {0x5ff0, 0x10, 2, "end of a middle region"},
        {0x10000, 0x100, 3, "all of the last region"},
        {0x100ff, 1, 3, "last byte of the last region"},
        {0x3ff0, 0x20, -1, "straddling two adjacent regions"},
        {0x1ff0, 0x2000, -1, "straddling two regions across a gap"},
        {0x1000, 0x1001, -1, "one byte past the end of a region"},
        {0x2000, 1, -1, "in the gap after a region"},
        {0x2fff, 2, -1, "from the gap into a region"},
        {0x0, 0x10, -1, "before the first region"},
        {0xfff, 1, -1, "just before the first region"},
        {0xfff, 2, -1, "across the start of the first region"},
        {0x10100, 1, -1, "just after the last region"},
        {0x100ff, 2, -1, "across the end of the last region"},
        {0x20000, 0x10, -1, "after the last region"},
        {UINT64_MAX, 1, -1, "at the top of the address space"},
        {0x10000, UINT64_MAX, -1, "a range that overflows"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const kvb_region_desc_t *got = kvb__region_find(d, 4, cases[i].addr, cases[i].len);
        const kvb_region_desc_t *want = cases[i].want < 0 ? NULL : &d[cases[i].want];
        cr_assert_eq(got, want, "%s [0x%llx, +0x%llx): got region %td", cases[i].what,
                     (unsigned long long)cases[i].addr, (unsigned long long)cases[i].len,
                     got ? got - d : (ptrdiff_t)-1);
    }
    /* Fewer regions: only those are searched. */
    cr_assert_eq(kvb__region_find(d, 1, 0x1800, 0x10), &d[0]);
    cr_assert_null(kvb__region_find(d, 1, 0x3000, 0x10));
    cr_assert_eq(kvb__region_find(d, 3, 0x4000, 0x10), &d[2]);
    cr_assert_null(kvb__region_find(d, 3, 0x10000, 0x10));
    /* None at all. */
    cr_assert_null(kvb__region_find(d, 0, 0x1000, 1));
    cr_assert_null(kvb__region_find(NULL, 0, 0x1000, 1));
}

Test(region_find, decoded_regions)
{
    /* What a handshake delivers is searchable: every region found by its first and last byte,
     * nothing found in the gaps between them. */
    kvb_hello_t h = sample_hello("target:find");
    size_t n = 500;
    kvb_region_desc_t *r = calloc(n, sizeof *r);
    cr_assert_not_null(r);
    fill_regions(r, n, 4242, NULL, 0);
    kvb_region_desc_t *out = ack_roundtrip(&h, r, n);
    for (size_t i = 0; i < n; i++) {
        uint64_t a = out[i].info.addr, l = out[i].info.len;
        cr_assert_eq(kvb__region_find(out, n, a, 1), &out[i], "region %zu, first byte", i);
        cr_assert_eq(kvb__region_find(out, n, a + l - 1, 1), &out[i], "region %zu, last byte", i);
        cr_assert_eq(kvb__region_find(out, n, a, l), &out[i], "region %zu, all of it", i);
        cr_assert_null(kvb__region_find(out, n, a, l + 1), "region %zu and one byte more", i);
        if (a > 0 && (i == 0 || out[i - 1].info.addr + out[i - 1].info.len < a))
            cr_assert_null(kvb__region_find(out, n, a - 1, 1), "gap before region %zu", i);
    }
    free(out);
    free(r);
}
