/* SPDX-License-Identifier: Apache-2.0 */
/* Encoding and validating wire frames. Little-endian on the wire whatever the host order; every
 * length a peer sends is checked against the limits in wire.h before anything is read or sized. */
#include "engine/wire.h"

#include "common/auth.h"
#include "common/le.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Layout: magic u32 | version u8 | type u8 | flags u16 | status i32 | reserved u32 | id u64 |
 *         addr u64 | len u64 */
void kvb__wire_encode_hdr(const kvb_frame_hdr_t *h, uint8_t out[KVB_WIRE_HDR_SIZE])
{
    kvb__put_le32(out, KVB_WIRE_MAGIC);
    out[4] = KVB_WIRE_VERSION;
    out[5] = h->type;
    kvb__put_le16(out + 6, h->flags);
    kvb__put_le32(out + 8, (uint32_t)h->status);
    kvb__put_le32(out + 12, 0);
    kvb__put_le64(out + 16, h->id);
    kvb__put_le64(out + 24, h->addr);
    kvb__put_le64(out + 32, h->len);
}

static int fail(char *why, size_t why_len, int code, const char *fmt, unsigned long long v)
{
    if (why && why_len)
        snprintf(why, why_len, fmt, v);
    return code;
}

int kvb__wire_decode_hdr(const uint8_t in[KVB_WIRE_HDR_SIZE], kvb_frame_hdr_t *out, char *why,
                         size_t why_len)
{
    uint32_t magic = kvb__get_le32(in);
    if (magic != KVB_WIRE_MAGIC)
        return fail(why, why_len, KVB_ERR_PROTOCOL, "bad frame magic 0x%08llx", magic);
    if (in[4] != KVB_WIRE_VERSION)
        return fail(why, why_len, KVB_ERR_VERSION, "unsupported protocol version %llu", in[4]);
    kvb_frame_hdr_t h = {
        .version = in[4],
        .type = in[5],
        .flags = kvb__get_le16(in + 6),
        .status = (int32_t)kvb__get_le32(in + 8),
        .id = kvb__get_le64(in + 16),
        .addr = kvb__get_le64(in + 24),
        .len = kvb__get_le64(in + 32),
    };
    if (h.type < KVB_FRAME_HELLO || h.type > KVB_FRAME_TYPE_MAX)
        return fail(why, why_len, KVB_ERR_PROTOCOL, "unknown frame type %llu", h.type);
    bool data_frame = h.type == KVB_FRAME_READ_REQ || h.type == KVB_FRAME_READ_RESP ||
                      h.type == KVB_FRAME_WRITE_REQ || h.type == KVB_FRAME_WRITE_ACK;
    if ((h.flags & ~(KVB_FRAME_F_SHM | KVB_FRAME_F_RUN)) || (h.flags && !data_frame) ||
        kvb__get_le32(in + 12) != 0)
        return fail(why, why_len, KVB_ERR_PROTOCOL, "reserved bits set (flags 0x%llx)", h.flags);
    if (h.status > 0)
        return fail(why, why_len, KVB_ERR_PROTOCOL, "positive status %llu", (unsigned)h.status);
    bool shm = h.flags & KVB_FRAME_F_SHM;
    if (shm && (h.type == KVB_FRAME_READ_REQ || h.type == KVB_FRAME_WRITE_REQ)) {
        if (!(h.flags & KVB_FRAME_F_RUN) || h.status != 0)
            return fail(why, why_len, KVB_ERR_PROTOCOL,
                        "same-host request (type %llu) outside a request run", h.type);
        if (h.addr == 0 || h.addr > KVB_WIRE_MAX_RUN || h.len != h.addr * KVB_WIRE_SHM_ENTRY)
            return fail(why, why_len, KVB_ERR_PROTOCOL, "same-host request run of %llu requests",
                        (unsigned long long)h.addr);
        *out = h; /* the payload names each request */
        return KVB_OK;
    }
    if ((h.flags & KVB_FRAME_F_RUN) && !(h.type == KVB_FRAME_READ_REQ && !shm)) {
        bool shm_run = shm && (h.type == KVB_FRAME_READ_RESP || h.type == KVB_FRAME_WRITE_ACK);
        if ((!shm_run && (shm || h.type != KVB_FRAME_READ_RESP)) || h.status != 0)
            return fail(why, why_len, KVB_ERR_PROTOCOL, "answer run on frame type %llu", h.type);
        if (h.addr == 0 || h.addr > KVB_WIRE_MAX_RUN ||
            h.len > (shm_run ? h.addr * KVB_WIRE_MAX_DATA : KVB_WIRE_MAX_DATA))
            return fail(why, why_len, KVB_ERR_PROTOCOL, "answer run of %llu requests",
                        (unsigned long long)h.addr);
        *out = h; /* same-host: no payload, `len` only totals what the requests asked */
        return KVB_OK;
    }
    uint64_t limit = 0;
    switch (h.type) {
    case KVB_FRAME_HELLO:
        limit = KVB_WIRE_MAX_HELLO;
        break;
    case KVB_FRAME_HELLO_ACK:
        limit = KVB_WIRE_MAX_HELLO_ACK;
        break;
    case KVB_FRAME_ATTRS:
        limit = KVB_WIRE_MAX_ATTRS;
        break;
    case KVB_FRAME_CHALLENGE:
        limit = KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN;
        break;
    case KVB_FRAME_AUTH:
        if (h.len != KVB_WIRE_MAC_LEN)
            return fail(why, why_len, KVB_ERR_PROTOCOL, "AUTH frame of %llu bytes",
                        (unsigned long long)h.len);
        limit = KVB_WIRE_MAC_LEN;
        break;
    case KVB_FRAME_NOTIFY:
        limit = KVB_NOTIFY_MAX;
        break;
    case KVB_FRAME_READ_REQ:
    case KVB_FRAME_READ_RESP:
    case KVB_FRAME_WRITE_REQ:
    case KVB_FRAME_WRITE_ACK:
        limit = KVB_WIRE_MAX_DATA;
        break;
    default: /* NOTIFY_ACK, ERROR carry no length */
        limit = 0;
    }
    if (h.len > limit)
        return fail(why, why_len, KVB_ERR_PROTOCOL, "frame length %llu over the limit",
                    (unsigned long long)h.len);
    if (h.status != 0 && h.type != KVB_FRAME_READ_RESP && h.type != KVB_FRAME_WRITE_ACK &&
        h.type != KVB_FRAME_NOTIFY_ACK && h.type != KVB_FRAME_ERROR &&
        h.type != KVB_FRAME_HELLO_ACK)
        return fail(why, why_len, KVB_ERR_PROTOCOL, "status on a request frame (type %llu)",
                    h.type);
    *out = h;
    return KVB_OK;
}

int kvb__wire_error_status(int32_t status)
{
    switch (status) {
    case KVB_ERR_VERSION:
    case KVB_ERR_AUTH:
    case KVB_ERR_PROTOCOL:
    case KVB_ERR_PEER_LOST:
        return status;
    default:
        return KVB_ERR_PROTOCOL;
    }
}

void kvb__wire_shm_entry_encode(const kvb_shm_entry_t *e, uint8_t out[KVB_WIRE_SHM_ENTRY])
{
    kvb__put_le64(out, e->remote);
    kvb__put_le64(out + 8, e->len);
    kvb__put_le64(out + 16, e->local);
    kvb__put_le64(out + 24, e->deadline);
}

int kvb__wire_shm_entry_decode(const uint8_t in[KVB_WIRE_SHM_ENTRY], kvb_shm_entry_t *out)
{
    *out = (kvb_shm_entry_t){.remote = kvb__get_le64(in),
                             .len = kvb__get_le64(in + 8),
                             .local = kvb__get_le64(in + 16),
                             .deadline = kvb__get_le64(in + 24)};
    return out->len > KVB_WIRE_MAX_DATA ? KVB_ERR_PROTOCOL : KVB_OK;
}

uint64_t kvb__wire_payload_len(const kvb_frame_hdr_t *h)
{
    if (h->flags & KVB_FRAME_F_SHM)
        return h->type == KVB_FRAME_READ_REQ || h->type == KVB_FRAME_WRITE_REQ ? h->len : 0;
    switch (h->type) {
    case KVB_FRAME_HELLO:
    case KVB_FRAME_WRITE_REQ:
    case KVB_FRAME_NOTIFY:
    case KVB_FRAME_ATTRS:
    case KVB_FRAME_CHALLENGE:
    case KVB_FRAME_AUTH:
        return h->len;
    case KVB_FRAME_HELLO_ACK:
    case KVB_FRAME_READ_RESP:
        return h->status == 0 ? h->len : 0;
    default:
        return 0;
    }
}

/* hello: incarnation u64 | pid u32 | lane u32 | host_id[16] | nonce[32] | name_len u16 | name */
#define HELLO_FIXED (16 + KVB_HOST_ID_LEN + KVB_WIRE_NONCE_LEN + 2)

size_t kvb__wire_hello_size(const kvb_hello_t *h)
{
    return HELLO_FIXED + strnlen(h->name, KVB_NAME_MAX);
}

size_t kvb__wire_hello_encode(const kvb_hello_t *h, uint8_t *out)
{
    size_t nl = strnlen(h->name, KVB_NAME_MAX);
    kvb__put_le64(out, h->incarnation);
    kvb__put_le32(out + 8, h->pid);
    kvb__put_le32(out + 12, h->lane);
    memcpy(out + 16, h->host_id, KVB_HOST_ID_LEN);
    memcpy(out + 16 + KVB_HOST_ID_LEN, h->nonce, KVB_WIRE_NONCE_LEN);
    kvb__put_le16(out + HELLO_FIXED - 2, (uint16_t)nl);
    memcpy(out + HELLO_FIXED, h->name, nl);
    return HELLO_FIXED + nl;
}

/* Decodes a hello from in[0..len); on success *used (if not NULL) is its encoded size. */
static int hello_decode(const uint8_t *in, size_t len, kvb_hello_t *out, size_t *used)
{
    const size_t fixed = HELLO_FIXED;
    if (len < fixed)
        return KVB_ERR_PROTOCOL;
    size_t nl = kvb__get_le16(in + HELLO_FIXED - 2);
    if (nl == 0 || nl > KVB_NAME_MAX || nl > len - fixed)
        return KVB_ERR_PROTOCOL;
    const uint8_t *name = in + fixed;
    for (size_t i = 0; i < nl; i++)
        if (name[i] < 0x21 || name[i] > 0x7e) /* printable, no spaces: it ends up in logs */
            return KVB_ERR_PROTOCOL;
    kvb_hello_t h = {.incarnation = kvb__get_le64(in),
                     .pid = kvb__get_le32(in + 8),
                     .lane = kvb__get_le32(in + 12)};
    memcpy(h.host_id, in + 16, KVB_HOST_ID_LEN);
    memcpy(h.nonce, in + 16 + KVB_HOST_ID_LEN, KVB_WIRE_NONCE_LEN);
    memcpy(h.name, name, nl);
    h.name[nl] = '\0';
    *out = h;
    if (used)
        *used = fixed + nl;
    return KVB_OK;
}

int kvb__wire_hello_decode(const uint8_t *in, size_t len, kvb_hello_t *out)
{
    size_t used;
    kvb_hello_t h;
    int rc = hello_decode(in, len, &h, &used);
    if (rc == KVB_OK && used != len)
        return KVB_ERR_PROTOCOL; /* trailing bytes */
    if (rc == KVB_OK)
        *out = h;
    return rc;
}

int kvb__wire_auth_mac(const uint8_t *key, size_t key_len, int role, const kvb_hello_t *initiator,
                       const kvb_hello_t *target, uint8_t out[KVB_WIRE_MAC_LEN])
{
    static const char label[2][24] = {"kvbridge/2 target", "kvbridge/2 initiator"};
    uint8_t hi[KVB_WIRE_MAX_HELLO], ht[KVB_WIRE_MAX_HELLO];
    size_t li = kvb__wire_hello_encode(initiator, hi), lt = kvb__wire_hello_encode(target, ht);
    uint8_t lens[4];
    kvb__put_le16(lens, (uint16_t)li); /* lengths first: no two transcripts concatenate alike */
    kvb__put_le16(lens + 2, (uint16_t)lt);
    const uint8_t version = KVB_WIRE_VERSION;
    kvb_mac_part_t parts[] = {{label[role != KVB_AUTH_TARGET], sizeof label[0]},
                              {&version, 1},
                              {lens, sizeof lens},
                              {hi, li},
                              {ht, lt}};
    return kvb__hmac(key, key_len, parts, sizeof parts / sizeof parts[0], out);
}

int kvb__wire_challenge_decode(const uint8_t *in, size_t len, kvb_hello_t *hello,
                               uint8_t mac[KVB_WIRE_MAC_LEN])
{
    if (len <= KVB_WIRE_MAC_LEN)
        return KVB_ERR_PROTOCOL;
    kvb_hello_t h;
    int rc = kvb__wire_hello_decode(in, len - KVB_WIRE_MAC_LEN, &h);
    if (rc)
        return rc;
    *hello = h;
    memcpy(mac, in + len - KVB_WIRE_MAC_LEN, KVB_WIRE_MAC_LEN);
    return KVB_OK;
}

/* hello_ack: hello | count u32 | count x region, where region is
 *   addr u64 | len u64 | access u32 | loc_len u16 | loc | keys_len u16 | keys
 * and keys is a run of (path u8 | key_len u8 | key) entries. */
#define REGION_MIN 24u

int kvb__wire_hello_ack_encode(const kvb_hello_t *h, const kvb_region_desc_t *regions, size_t n,
                               uint8_t **out, size_t *out_len)
{
    if (n > KVB_WIRE_MAX_REGIONS)
        return KVB_ERR_TOO_LARGE;
    size_t size = kvb__wire_hello_size(h) + 4;
    for (size_t i = 0; i < n; i++) {
        if (regions[i].keys_len > KVB_REGION_KEYS_MAX)
            return KVB_ERR_TOO_LARGE;
        size +=
            REGION_MIN + strnlen(regions[i].info.location, KVB_LOCATION_MAX) + regions[i].keys_len;
    }
    if (size > KVB_WIRE_MAX_HELLO_ACK)
        return KVB_ERR_TOO_LARGE;
    uint8_t *buf = malloc(size);
    if (!buf)
        return KVB_ERR_NOMEM;
    uint8_t *p = buf + kvb__wire_hello_encode(h, buf);
    kvb__put_le32(p, (uint32_t)n);
    p += 4;
    for (size_t i = 0; i < n; i++) {
        const kvb_region_info_t *r = &regions[i].info;
        size_t ll = strnlen(r->location, KVB_LOCATION_MAX);
        kvb__put_le64(p, r->addr);
        kvb__put_le64(p + 8, r->len);
        kvb__put_le32(p + 16, r->access);
        kvb__put_le16(p + 20, (uint16_t)ll);
        memcpy(p + 22, r->location, ll);
        p += 22 + ll;
        kvb__put_le16(p, regions[i].keys_len);
        if (regions[i].keys_len)
            memcpy(p + 2, regions[i].keys, regions[i].keys_len);
        p += 2 + regions[i].keys_len;
    }
    *out = buf;
    *out_len = size;
    return KVB_OK;
}

/* A key run: entries that fill it exactly, each for a known path, none twice. */
static bool keys_ok(const uint8_t *k, size_t n)
{
    unsigned seen = 0;
    size_t off = 0;
    while (off < n) {
        if (n - off < 2 || k[off] >= KVB_PATHS_MAX || (seen & (1u << k[off])) ||
            k[off + 1] > KVB_KEY_MAX || k[off + 1] > n - off - 2)
            return false;
        seen |= 1u << k[off];
        off += 2u + k[off + 1];
    }
    return true;
}

/* Decodes one region at in[*off..len) into r (location, kind) and returns its keys' offset and
 * length; KVB_ERR_PROTOCOL if it is malformed. */
static int region_decode(const uint8_t *in, size_t len, size_t *off, kvb_region_desc_t *r,
                         size_t *keys_off)
{
    size_t o = *off;
    if (len - o < REGION_MIN)
        return KVB_ERR_PROTOCOL;
    size_t ll = kvb__get_le16(in + o + 20);
    if (ll > KVB_LOCATION_MAX || ll > len - o - REGION_MIN)
        return KVB_ERR_PROTOCOL;
    r->info.addr = kvb__get_le64(in + o);
    r->info.len = kvb__get_le64(in + o + 8);
    r->info.access = kvb__get_le32(in + o + 16);
    if (r->info.access == 0 || (r->info.access & ~(unsigned)KVB_ACCESS_RW) || r->info.len == 0 ||
        r->info.addr + r->info.len < r->info.addr)
        return KVB_ERR_PROTOCOL;
    for (size_t k = 0; k < ll; k++)
        if (in[o + 22 + k] < 0x20 || in[o + 22 + k] > 0x7e)
            return KVB_ERR_PROTOCOL;
    memcpy(r->info.location, in + o + 22, ll);
    r->info.location[ll] = '\0';
    if (kvb__mem_kind_parse(r->info.location, &r->kind, &r->device))
        return KVB_ERR_PROTOCOL;
    o += 22 + ll;
    size_t kl = kvb__get_le16(in + o);
    if (kl > KVB_REGION_KEYS_MAX || kl > len - o - 2 || !keys_ok(in + o + 2, kl))
        return KVB_ERR_PROTOCOL;
    r->keys_len = (uint16_t)kl;
    *keys_off = o + 2;
    *off = o + 2 + kl;
    return KVB_OK;
}

int kvb__wire_hello_ack_decode(const uint8_t *in, size_t len, kvb_hello_t *hello,
                               kvb_region_desc_t **regions, size_t *n)
{
    size_t off;
    kvb_hello_t h;
    if (hello_decode(in, len, &h, &off) != KVB_OK || len - off < 4)
        return KVB_ERR_PROTOCOL;
    uint32_t count = kvb__get_le32(in + off);
    off += 4;
    /* Bound the count by what is actually there before allocating anything for it; keys take
     * no more room here than on the wire. */
    if (count > KVB_WIRE_MAX_REGIONS || count > (len - off) / REGION_MIN)
        return KVB_ERR_PROTOCOL;
    size_t keys_room = len - off - (size_t)count * REGION_MIN;
    kvb_region_desc_t *r = count ? calloc(1, count * sizeof *r + keys_room) : NULL;
    if (count && !r)
        return KVB_ERR_NOMEM;
    uint8_t *kp = r ? (uint8_t *)(r + count) : NULL; /* no arithmetic on NULL (UB) for none */
    for (uint32_t i = 0; i < count; i++) {
        size_t keys_off;
        if (region_decode(in, len, &off, &r[i], &keys_off))
            goto bad;
        /* Sorted and disjoint, as a registry lists them: lookups rely on it. */
        if (i > 0 && r[i].info.addr < r[i - 1].info.addr + r[i - 1].info.len)
            goto bad;
        /* The room was sized for `count` regions of REGION_MIN bytes: a count that promises
         * more regions than follow must not let early keys overrun it. */
        if (r[i].keys_len > keys_room - (size_t)(kp - (uint8_t *)(r + count)))
            goto bad;
        memcpy(kp, in + keys_off, r[i].keys_len);
        r[i].keys = kp;
        kp += r[i].keys_len;
    }
    if (off != len)
        goto bad;
    *hello = h;
    *regions = r;
    *n = count;
    return KVB_OK;
bad:
    free(r);
    return KVB_ERR_PROTOCOL;
}

static bool key_ok(const uint8_t *k, size_t n)
{
    if (n == 0 || n > KVB_ATTR_KEY_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (k[i] < 0x21 || k[i] > 0x7e)
            return false;
    return true;
}

int kvb__wire_attrs_encode(const kvb_attr_t *attrs, size_t n, uint8_t **out, size_t *out_len)
{
    if (n > KVB_ATTRS_MAX)
        return KVB_ERR_TOO_LARGE;
    size_t size = 4;
    for (size_t i = 0; i < n; i++)
        size += 6 + strlen(attrs[i].key) + attrs[i].len;
    if (size > KVB_WIRE_MAX_ATTRS)
        return KVB_ERR_TOO_LARGE;
    uint8_t *buf = malloc(size), *p = buf;
    if (!buf)
        return KVB_ERR_NOMEM;
    kvb__put_le32(p, (uint32_t)n);
    p += 4;
    for (size_t i = 0; i < n; i++) {
        size_t kl = strlen(attrs[i].key);
        kvb__put_le16(p, (uint16_t)kl);
        memcpy(p + 2, attrs[i].key, kl);
        kvb__put_le32(p + 2 + kl, (uint32_t)attrs[i].len);
        if (attrs[i].len)
            memcpy(p + 6 + kl, attrs[i].value, attrs[i].len);
        p += 6 + kl + attrs[i].len;
    }
    *out = buf;
    *out_len = size;
    return KVB_OK;
}

void kvb__attrs_free(kvb_attr_t *attrs, size_t n)
{
    for (size_t i = 0; attrs && i < n; i++)
        free(attrs[i].value);
    free(attrs);
}

int kvb__wire_attrs_decode(const uint8_t *in, size_t len, kvb_attr_t **attrs, size_t *n)
{
    if (len < 4)
        return KVB_ERR_PROTOCOL;
    uint32_t count = kvb__get_le32(in);
    if (count > KVB_ATTRS_MAX || count > (len - 4) / 7)
        return KVB_ERR_PROTOCOL;
    kvb_attr_t *a = count ? calloc(count, sizeof *a) : NULL;
    if (count && !a)
        return KVB_ERR_NOMEM;
    size_t off = 4, i = 0;
    for (; i < count; i++) {
        if (len - off < 2)
            goto bad;
        size_t kl = kvb__get_le16(in + off);
        if (kl > len - off - 2 || len - off - 2 - kl < 4 || !key_ok(in + off + 2, kl))
            goto bad;
        size_t vl = kvb__get_le32(in + off + 2 + kl);
        if (vl > KVB_ATTR_VALUE_MAX || vl > len - off - 6 - kl)
            goto bad;
        memcpy(a[i].key, in + off + 2, kl);
        a[i].key[kl] = '\0';
        for (size_t j = 0; j < i; j++)
            if (!strcmp(a[j].key, a[i].key))
                goto bad;
        a[i].value = malloc(vl ? vl : 1);
        if (!a[i].value) {
            kvb__attrs_free(a, i);
            return KVB_ERR_NOMEM;
        }
        memcpy(a[i].value, in + off + 6 + kl, vl);
        a[i].len = vl;
        off += 6 + kl + vl;
    }
    if (off != len)
        goto bad;
    *attrs = a;
    *n = count;
    return KVB_OK;
bad:
    kvb__attrs_free(a, i);
    return KVB_ERR_PROTOCOL;
}
