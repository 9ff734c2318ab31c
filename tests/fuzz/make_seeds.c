/* SPDX-License-Identifier: Apache-2.0 */
/* Writes the seed corpora of tests/fuzz/corpus/ from the encoders themselves, so the seeds stay
 * well formed when a format changes: `make fuzz-seeds` (then commit what changed). Usage:
 * make_seeds DIR. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/wire.h"
#include "kvbridge/kv.h"

static const char *g_dir;

static void put(const char *corpus, const char *name, uint8_t sel, const void *data, size_t len,
                int with_sel)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s/%s", g_dir, corpus, name);
    FILE *f = fopen(path, "wb");
    if (!f || (with_sel && fwrite(&sel, 1, 1, f) != 1) || (len && fwrite(data, 1, len, f) != len)) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

static kvb_hello_t hello(const char *name, uint32_t lane)
{
    kvb_hello_t h = {.incarnation = 0x0102030405060708ull, .pid = 4242, .lane = lane};
    memset(h.host_id, 0xab, sizeof h.host_id);
    memset(h.nonce, 0x5c, sizeof h.nonce);
    snprintf(h.name, sizeof h.name, "%s", name);
    return h;
}

static void wire_seeds(void)
{
    const uint8_t types[] = {KVB_FRAME_HELLO,     KVB_FRAME_READ_REQ,  KVB_FRAME_READ_RESP,
                             KVB_FRAME_WRITE_REQ, KVB_FRAME_WRITE_ACK, KVB_FRAME_NOTIFY,
                             KVB_FRAME_AUTH};
    for (size_t i = 0; i < sizeof types; i++) {
        kvb_frame_hdr_t h = {.type = types[i],
                             .id = 7 + i,
                             .addr = 0x7f0000001000ull,
                             .len = types[i] == KVB_FRAME_AUTH ? KVB_WIRE_MAC_LEN : 4096};
        uint8_t b[KVB_WIRE_HDR_SIZE];
        kvb__wire_encode_hdr(&h, b);
        char name[32];
        snprintf(name, sizeof name, "hdr-type-%u", types[i]);
        put("wire", name, 0, b, sizeof b, 1);
    }
    kvb_frame_hdr_t run = {.type = KVB_FRAME_READ_RESP,
                           .flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN,
                           .id = 100,
                           .addr = 128,
                           .len = 128u << 15};
    uint8_t b[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN + KVB_WIRE_MAX_HELLO];
    kvb__wire_encode_hdr(&run, b);
    put("wire", "hdr-answer-run", 0, b, KVB_WIRE_HDR_SIZE, 1);
    run.flags = KVB_FRAME_F_RUN; /* over TCP: the run's bytes follow */
    run.len = 128u << 12;
    kvb__wire_encode_hdr(&run, b);
    put("wire", "hdr-answer-run-tcp", 0, b, KVB_WIRE_HDR_SIZE, 1);
    run = (kvb_frame_hdr_t){.type = KVB_FRAME_READ_REQ,
                            .flags = KVB_FRAME_F_RUN,
                            .id = 101,
                            .addr = 0x7f0000001000ull,
                            .len = 4096};
    kvb__wire_encode_hdr(&run, b);
    put("wire", "hdr-read-asks-run", 0, b, KVB_WIRE_HDR_SIZE, 1);
    run = (kvb_frame_hdr_t){.type = KVB_FRAME_WRITE_REQ,
                            .flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN,
                            .id = 102,
                            .addr = 3,
                            .len = 3 * KVB_WIRE_SHM_ENTRY};
    kvb__wire_encode_hdr(&run, b);
    put("wire", "hdr-shm-request-run", 0, b, KVB_WIRE_HDR_SIZE, 1);
    for (int k = 0; k < 3; k++) {
        kvb_shm_entry_t e = {.remote = 0x7f0000001000ull + 18432u * (unsigned)k,
                             .len = 18432,
                             .local = 0x10000,
                             .deadline = 0x00001d1a94a20000ull};
        kvb__wire_shm_entry_encode(&e, b + k * KVB_WIRE_SHM_ENTRY);
    }
    put("wire", "shm-entries", 5, b, 3 * KVB_WIRE_SHM_ENTRY, 1);
    kvb_hello_t h = hello("prefill-0", 1);
    size_t n = kvb__wire_hello_encode(&h, b);
    put("wire", "hello", 1, b, n, 1);
    memset(b + n, 0x33, KVB_WIRE_MAC_LEN);
    put("wire", "challenge", 2, b, n + KVB_WIRE_MAC_LEN, 1);
    static const uint8_t keys[] = {2, 4, 0xde, 0xad, 0xbe, 0xef, 5, 3, 1, 2, 3};
    kvb_region_desc_t r[2] = {
        {.info = {.addr = 0x10000, .len = 1 << 20, .access = KVB_ACCESS_RW, .location = "cpu:0"},
         .kind = KVB_MEM_CPU,
         .device = 0},
        {.info = {.addr = 0x7f0000000000ull,
                  .len = 4096,
                  .access = KVB_ACCESS_READ,
                  .location = "cuda:1"},
         .kind = KVB_MEM_CUDA,
         .device = 1,
         .keys_len = sizeof keys,
         .keys = keys}};
    uint8_t *ack = NULL;
    size_t ack_len = 0;
    if (kvb__wire_hello_ack_encode(&h, r, 2, &ack, &ack_len) != KVB_OK)
        exit(1);
    put("wire", "hello-ack", 3, ack, ack_len, 1);
    free(ack);
    kvb_attr_t a[2] = {{.key = "kv_layout", .value = (uint8_t *)"{}", .len = 2},
                       {.key = "role", .value = (uint8_t *)"prefill", .len = 7}};
    uint8_t *at = NULL;
    size_t at_len = 0;
    if (kvb__wire_attrs_encode(a, 2, &at, &at_len) != KVB_OK)
        exit(1);
    put("wire", "attrs", 4, at, at_len, 1);
    free(at);
}

/* Frames an authenticated peer sends (the session harness logs in first when the selector's low
 * bit is set), against the buffer fuzz_session.c registers at 0x7e0000000000. */
static void session_seeds(void)
{
    uint8_t b[4096];
    size_t n = 0;
    kvb_frame_hdr_t rd = {
        .type = KVB_FRAME_READ_REQ, .id = 1, .addr = 0x7e0000000000ull, .len = 4096};
    kvb__wire_encode_hdr(&rd, b);
    put("session", "read", 1, b, KVB_WIRE_HDR_SIZE, 1);
    /* READs that ask for a run: two join, an out-of-range one answers alone, one more joins */
    for (int i = 0; i < 4; i++) {
        kvb_frame_hdr_t q = {.type = KVB_FRAME_READ_REQ,
                             .flags = KVB_FRAME_F_RUN,
                             .id = 10 + (uint64_t)i,
                             .addr = 0x7e0000000000ull + (i == 2 ? 1ull << 30 : 512u * i),
                             .len = 512};
        kvb__wire_encode_hdr(&q, b + n);
        n += KVB_WIRE_HDR_SIZE;
    }
    put("session", "read-runs", 1, b, n, 1);
    n = 0;
    kvb_frame_hdr_t wr = {
        .type = KVB_FRAME_WRITE_REQ, .id = 2, .addr = 0x7e0000000100ull, .len = 16};
    kvb__wire_encode_hdr(&wr, b);
    memset(b + KVB_WIRE_HDR_SIZE, 0x61, 16);
    n = KVB_WIRE_HDR_SIZE + 16;
    kvb_frame_hdr_t no = {.type = KVB_FRAME_NOTIFY, .id = 3, .len = 5};
    kvb__wire_encode_hdr(&no, b + n);
    memcpy(b + n + KVB_WIRE_HDR_SIZE, "hello", 5);
    n += KVB_WIRE_HDR_SIZE + 5;
    kvb_frame_hdr_t sh = {.type = KVB_FRAME_READ_REQ, /* a same-host request run of two */
                          .flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN,
                          .id = 4,
                          .addr = 2,
                          .len = 2 * KVB_WIRE_SHM_ENTRY};
    kvb__wire_encode_hdr(&sh, b + n);
    n += KVB_WIRE_HDR_SIZE;
    for (int k = 0; k < 2; k++) {
        kvb_shm_entry_t e = {
            .remote = 0x7e0000000000ull + 64u * (unsigned)k, .len = 64, .deadline = UINT64_MAX};
        kvb__wire_shm_entry_encode(&e, b + n);
        n += KVB_WIRE_SHM_ENTRY;
    }
    put("session", "write-notify-shm", 1, b, n, 1);
    kvb_hello_t h = hello("stranger:1", 0);
    size_t hl = kvb__wire_hello_encode(&h, b + KVB_WIRE_HDR_SIZE);
    kvb_frame_hdr_t he = {.type = KVB_FRAME_HELLO, .len = hl};
    kvb__wire_encode_hdr(&he, b);
    put("session", "hello-only", 0, b, KVB_WIRE_HDR_SIZE + hl, 0);
}

static void layout_seed(const char *name, kvb_kv_attn_t attn, uint32_t tp)
{
    kvb_kv_slot_t slots[4];
    size_t ns = attn == KVB_KV_ATTN_MLA ? 2 : 4;
    for (size_t i = 0; i < ns; i++) {
        slots[i] = (kvb_kv_slot_t){.layer = (uint32_t)(attn == KVB_KV_ATTN_MLA ? i : i / 2),
                                   .kind = attn == KVB_KV_ATTN_MLA ? KVB_KV_SLOT_LATENT
                                           : i % 2                 ? KVB_KV_SLOT_V
                                                                   : KVB_KV_SLOT_K,
                                   .base = 0x100000 * (i + 1),
                                   .len = 16 * 8192,
                                   .block_bytes = 8192,
                                   .num_blocks = 16};
        if (attn == KVB_KV_ATTN_GQA) {
            slots[i].num_heads = 8 / tp;
            slots[i].head_bytes = 8192 / 16 / (8 / tp);
            slots[i].order = KVB_KV_ORDER_HND;
        }
    }
    kvb_kv_layout_t l = {.dtype = KVB_KV_DTYPE_BF16,
                         .tokens_per_block = 16,
                         .attn = attn,
                         .num_kv_heads = attn == KVB_KV_ATTN_GQA ? 8 : 0,
                         .dp_size = 1,
                         .tp_size = tp,
                         .num_layers = 2,
                         .slots = slots,
                         .num_slots = ns};
    snprintf(l.model, sizeof l.model, "seed");
    char buf[8192], why[KVB_KV_REASON_MAX];
    size_t len = 0;
    if (kvb_kv_layout_validate(&l, why, sizeof why) != KVB_OK ||
        kvb_kv_layout_encode(&l, buf, sizeof buf, &len) != KVB_OK) {
        fprintf(stderr, "make_seeds: layout %s: %s\n", name, why);
        exit(1);
    }
    put("kv_layout", name, 0, buf, len, 0);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_seeds DIR\n");
        return 2;
    }
    g_dir = argv[1];
    wire_seeds();
    session_seeds();
    layout_seed("gqa-tp1", KVB_KV_ATTN_GQA, 1);
    layout_seed("gqa-tp2", KVB_KV_ATTN_GQA, 2);
    layout_seed("mla", KVB_KV_ATTN_MLA, 1);
    const char *seg = "{\"kvbridge\":1,\"name\":\"seg\",\"incarnation\":\"00000000075bcd15\","
                      "\"pid\":42,\"host_id\":\"abababababababababababababababab\","
                      "\"addresses\":[{\"host\":\"127.0.0.1\",\"port\":4100},"
                      "{\"host\":\"::1\",\"port\":4101}],\"transports\":[\"tcp\",\"shm\"],"
                      "\"published_ms\":1,\"regions\":[{\"addr\":\"0x1000\",\"len\":4096,"
                      "\"access\":\"rw\",\"location\":\"cpu:0\"}],\"attrs\":{}}";
    put("segdesc", "two-addresses", 0, seg, strlen(seg), 0);
    static const char full[] = "{\"model\":\"tiny\",\"prompt\":\"the quick brown fox\","
                               "\"max_tokens\":16,\"stream\":true,\"temperature\":0.7,"
                               "\"seed\":3,\"timeout_ms\":5000}";
    const char *bodies[] = {"{\"prompt\":\"hello\",\"max_tokens\":8}", full,
                            "{\"prompt\":[\"a\",\"b\"],\"max_tokens\":0}"};
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++) {
        char name[16];
        snprintf(name, sizeof name, "body-%zu", i);
        put("proxy_body", name, 0, bodies[i], strlen(bodies[i]), 0);
    }
    return 0;
}
