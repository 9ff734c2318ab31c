/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the wire codecs (src/engine/wire.c), protocol version 2: header round trips and
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
                            kvb_region_info_t **regions, size_t *n)
{
    uint8_t *copy = exact_copy(src, len);
    kvb_region_info_t *const sentinel_ptr = (kvb_region_info_t *)(uintptr_t)0x5a5a5a5a;
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

static void fill_regions(kvb_region_info_t *r, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++) {
        r[i].addr = rng_next(&seed);
        r[i].len = rng_next(&seed);
        r[i].access = 1 + (unsigned)(i % 3);
        size_t ll = (size_t)(rng_next(&seed) % (KVB_LOCATION_MAX + 1));
        for (size_t j = 0; j < ll; j++)
            r[i].location[j] = (char)('a' + (rng_next(&seed) % 26));
        r[i].location[ll] = '\0';
    }
}

static void assert_regions_eq(const kvb_region_info_t *a, const kvb_region_info_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(a[i].addr, b[i].addr, "region %zu", i);
        cr_assert_eq(a[i].len, b[i].len, "region %zu", i);
        cr_assert_eq(a[i].access, b[i].access, "region %zu", i);
        cr_assert_str_eq(a[i].location, b[i].location, "region %zu", i);
    }
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
    cr_assert_eq(KVB_WIRE_VERSION, 2, "protocol version 2: mutual authentication");
    cr_assert_eq(buf[4], 2);
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
    /* Version 1 peers (no authentication) are refused outright, as is anything newer. */
    const uint8_t types[] = {KVB_FRAME_HELLO, KVB_FRAME_CHALLENGE, KVB_FRAME_AUTH,
                             KVB_FRAME_READ_REQ};
    for (size_t t = 0; t < sizeof types; t++) {
        kvb_frame_hdr_t h = mkhdr(types[t], 0, type_min(types[t]));
        uint8_t buf[KVB_WIRE_HDR_SIZE];
        kvb__wire_encode_hdr(&h, buf);
        cr_assert_eq(buf[4], 2);
        cr_assert_eq(hdr_decode_raw(buf), KVB_OK, "type %u at version 2", types[t]);
        const uint8_t versions[] = {0, 1, 3, 4, 0x7F, 0x80, 0xFF};
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

Test(wire_hdr, shm_flag_changes_payload)
{
    const uint8_t req[] = {KVB_FRAME_READ_REQ, KVB_FRAME_WRITE_REQ};
    const uint8_t resp[] = {KVB_FRAME_READ_RESP, KVB_FRAME_WRITE_ACK};
    for (int i = 0; i < 2; i++) {
        kvb_frame_hdr_t h = mkhdr(req[i], 0, 1 << 20), out;
        h.flags = KVB_FRAME_F_SHM;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK);
        cr_assert_eq(out.flags, KVB_FRAME_F_SHM);
        cr_assert_eq(kvb__wire_payload_len(&out), 8, "a request carries the local address");
        h = mkhdr(resp[i], 0, 1 << 20);
        h.flags = KVB_FRAME_F_SHM;
        cr_assert_eq(hdr_roundtrip(&h, &out), KVB_OK);
        cr_assert_eq(kvb__wire_payload_len(&out), 0, "an answer carries no data");
    }
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

/* Encodes, checks the size matches hello + 4 + sum(22 + loc), decodes and compares. */
static void ack_roundtrip(const kvb_hello_t *h, const kvb_region_info_t *regions, size_t n)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    cr_assert_eq(kvb__wire_hello_ack_encode(h, regions, n, &buf, &len), KVB_OK, "n=%zu", n);
    size_t expect = kvb__wire_hello_size(h) + 4;
    for (size_t i = 0; i < n; i++)
        expect += 22 + strlen(regions[i].location);
    cr_assert_eq(len, expect);
    cr_assert_leq(len, KVB_WIRE_MAX_HELLO_ACK);
    cr_assert_eq(get32(buf + kvb__wire_hello_size(h)), n);

    kvb_hello_t hout;
    kvb_region_info_t *rout;
    size_t nout;
    cr_assert_eq(ack_decode_exact(buf, len, &hout, &rout, &nout), KVB_OK, "n=%zu", n);
    assert_hello_eq(&hout, h);
    cr_assert_eq(nout, n);
    if (n == 0)
        cr_assert_null(rout);
    else
        assert_regions_eq(rout, regions, n);
    free(rout);
    free(buf);
}

Test(wire_hello_ack, roundtrip_zero_regions)
{
    kvb_hello_t h = sample_hello("target:1");
    ack_roundtrip(&h, NULL, 0);
}

Test(wire_hello_ack, roundtrip_one_region)
{
    kvb_hello_t h = sample_hello("target:1");
    kvb_region_info_t r = {.addr = 0x7f0000001000ull, .len = 1ull << 30, .access = KVB_ACCESS_RW};
    strcpy(r.location, "cuda:0");
    ack_roundtrip(&h, &r, 1);
    r.location[0] = '\0'; /* an empty location is representable */
    r.access = KVB_ACCESS_READ;
    r.addr = UINT64_MAX;
    r.len = UINT64_MAX;
    ack_roundtrip(&h, &r, 1);
}

Test(wire_hello_ack, roundtrip_many_regions)
{
    kvb_hello_t h = sample_hello("target:many");
    size_t n = 1000;
    kvb_region_info_t *r = calloc(n, sizeof *r);
    cr_assert_not_null(r);
    fill_regions(r, n, 99);
    ack_roundtrip(&h, r, n);
    free(r);
}

Test(wire_hello_ack, roundtrip_max_regions_and_location)
{
    kvb_hello_t h = sample_hello("target:max");
    size_t n = KVB_WIRE_MAX_REGIONS;
    kvb_region_info_t *r = calloc(n + 1, sizeof *r);
    cr_assert_not_null(r);
    for (size_t i = 0; i <= n; i++) {
        r[i].addr = i << 12;
        r[i].len = 4096;
        r[i].access = KVB_ACCESS_WRITE;
        memset(r[i].location, 'L', KVB_LOCATION_MAX); /* at the location limit */
        r[i].location[KVB_LOCATION_MAX] = '\0';
    }
    ack_roundtrip(&h, r, n);
    uint8_t *buf = NULL;
    size_t len = 0;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, n + 1, &buf, &len), KVB_ERR_TOO_LARGE);
    cr_assert_null(buf);
    free(r);
}

Test(wire_hello_ack, region_count_over_max_rejected)
{
    /* Bytes for KVB_WIRE_MAX_REGIONS + 1 minimal regions are present; the count is still over. */
    kvb_hello_t h = sample_hello("t");
    size_t hs = kvb__wire_hello_size(&h);
    size_t count = KVB_WIRE_MAX_REGIONS + 1;
    size_t len = hs + 4 + count * 22;
    uint8_t *buf = calloc(1, len);
    cr_assert_not_null(buf);
    kvb__wire_hello_encode(&h, buf);
    put32(buf + hs, (uint32_t)count);
    for (size_t i = 0; i < count; i++)
        put32(buf + hs + 4 + i * 22 + 16, KVB_ACCESS_READ);
    kvb_hello_t ho;
    kvb_region_info_t *ro;
    size_t no;
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL);
    /* One fewer region and count: accepted. */
    put32(buf + hs, (uint32_t)(count - 1));
    cr_assert_eq(ack_decode_exact(buf, len - 22, &ho, &ro, &no), KVB_OK);
    cr_assert_eq(no, count - 1);
    free(ro);
    free(buf);
}

Test(wire_hello_ack, region_count_larger_than_bytes_rejected)
{
    kvb_hello_t h = sample_hello("target");
    kvb_region_info_t r[2] = {{.addr = 1, .len = 2, .access = 1},
                              {.addr = 3, .len = 4, .access = 2}};
    strcpy(r[0].location, "cpu");
    strcpy(r[1].location, "0123456789abcdefghijklmnopqrstuvwxyz"); /* > 22 bytes of location */
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 2, &buf, &len), KVB_OK);
    size_t off = ack_count_off(strlen(h.name));
    const uint32_t counts[] = {
        3, 4, 1000, KVB_WIRE_MAX_REGIONS, KVB_WIRE_MAX_REGIONS + 1, 0x7FFFFFFF, 0xFFFFFFFF};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        /* Would need about count * sizeof(kvb_region_info_t) bytes if trusted: must fail fast
         * with a protocol error rather than allocating it (or reporting NOMEM). */
        put32(buf + off, counts[i]);
        kvb_hello_t ho;
        kvb_region_info_t *ro;
        size_t no;
        cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_ERR_PROTOCOL, "count %u",
                     counts[i]);
    }
    /* And a count one short leaves bytes unaccounted for. */
    put32(buf + off, 1);
    kvb_hello_t ho;
    kvb_region_info_t *ro;
    size_t no;
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
}

/* A single-region ack with the given location length field and location bytes. */
static uint8_t *ack_with_location(uint16_t ll_field, size_t ll_bytes, uint32_t access, size_t *len)
{
    kvb_hello_t h = sample_hello("t");
    size_t hs = kvb__wire_hello_size(&h);
    *len = hs + 4 + 22 + ll_bytes;
    uint8_t *buf = calloc(1, *len);
    cr_assert_not_null(buf);
    kvb__wire_hello_encode(&h, buf);
    put32(buf + hs, 1);
    uint8_t *p = buf + hs + 4;
    put64(p, 0x1000);
    put64(p + 8, 0x2000);
    put32(p + 16, access);
    put16(p + 20, ll_field);
    memset(p + 22, 'g', ll_bytes);
    return buf;
}

Test(wire_hello_ack, location_length_limit)
{
    size_t len;
    kvb_hello_t ho;
    kvb_region_info_t *ro;
    size_t no;
    uint8_t *buf = ack_with_location(KVB_LOCATION_MAX, KVB_LOCATION_MAX, KVB_ACCESS_RW, &len);
    cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK);
    cr_assert_eq(no, 1);
    cr_assert_eq(strlen(ro[0].location), KVB_LOCATION_MAX);
    free(ro);
    free(buf);

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
    const uint32_t bad[] = {4, 5, 7, 8, 0x100, 0x80000000u, 0x80000003u, 0xFFFFFFFFu};
    size_t len;
    kvb_hello_t ho;
    kvb_region_info_t *ro;
    size_t no;
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        uint8_t *buf = ack_with_location(3, 3, good[i], &len);
        cr_assert_eq(ack_decode_exact(buf, len, &ho, &ro, &no), KVB_OK, "access %u", good[i]);
        cr_assert_eq(ro[0].access, good[i]);
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
    kvb_region_info_t r[5];
    memset(r, 0, sizeof r);
    fill_regions(r, 5, 7);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 5, &buf, &len), KVB_OK);
    /* Walk to the last region and corrupt its access word. */
    size_t off = ack_count_off(strlen(h.name)) + 4;
    for (int i = 0; i < 4; i++)
        off += 22 + get16(buf + off + 20);
    put32(buf + off + 16, 0x10);
    kvb_hello_t ho;
    kvb_region_info_t *ro;
    size_t no;
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
    kvb_region_info_t *ro;
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
    kvb_region_info_t r[3];
    memset(r, 0, sizeof r);
    fill_regions(r, 3, 1234);
    strcpy(r[1].location, ""); /* a zero-length location in the middle */
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 3, &buf, &len), KVB_OK);
    for (size_t cut = 0; cut < len; cut++) {
        kvb_hello_t ho;
        kvb_region_info_t *ro;
        size_t no;
        cr_assert_eq(ack_decode_exact(buf, cut, &ho, &ro, &no), KVB_ERR_PROTOCOL,
                     "prefix %zu of %zu", cut, len);
    }
    free(buf);
}

Test(wire_hello_ack, trailing_bytes_rejected)
{
    kvb_hello_t h = sample_hello("target");
    kvb_region_info_t r[2];
    memset(r, 0, sizeof r);
    fill_regions(r, 2, 5);
    uint8_t *buf;
    size_t len;
    cr_assert_eq(kvb__wire_hello_ack_encode(&h, r, 2, &buf, &len), KVB_OK);
    uint8_t *longer = calloc(1, len + 30);
    cr_assert_not_null(longer);
    memcpy(longer, buf, len);
    for (size_t extra = 1; extra <= 30; extra++) {
        kvb_hello_t ho;
        kvb_region_info_t *ro;
        size_t no;
        cr_assert_eq(ack_decode_exact(longer, len + extra, &ho, &ro, &no), KVB_ERR_PROTOCOL,
                     "%zu trailing bytes", extra);
    }
    free(longer);
    free(buf);
}

/* Checks a successfully decoded hello_ack against an independent reading of its bytes. */
static void check_consistent(const uint8_t *in, size_t len, const kvb_hello_t *h,
                             const kvb_region_info_t *r, size_t n)
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
        cr_assert_leq(off + 22, len);
        cr_assert_eq(r[i].addr, get64(in + off));
        cr_assert_eq(r[i].len, get64(in + off + 8));
        cr_assert_eq(r[i].access, get32(in + off + 16));
        cr_assert_eq(r[i].access & ~(unsigned)KVB_ACCESS_RW, 0);
        size_t ll = get16(in + off + 20);
        cr_assert_leq(ll, KVB_LOCATION_MAX);
        cr_assert_leq(off + 22 + ll, len);
        cr_assert_arr_eq(r[i].location, in + off + 22, ll);
        cr_assert_eq(r[i].location[ll], '\0');
        if (strlen(r[i].location) != ll)
            canonical = 0; /* an embedded NUL: the string cannot re-encode to these bytes */
        off += 22 + ll;
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
    kvb_region_info_t r[4];
    memset(r, 0, sizeof r);
    fill_regions(r, 4, 31337);
    strcpy(r[0].location, "cpu");
    strcpy(r[2].location, "");
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
        kvb_region_info_t *ro;
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
