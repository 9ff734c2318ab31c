/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the weight-file format (src/pd/model/weightfile.c, weights.c, config.c, crc32c.c): save
 * and load round trip bit for bit, and every kind of bad file - truncated at every header length
 * and throughout the payload, bad magic, version, checksums, shapes (also ones whose byte size
 * overflows, with valid checksums), config values, trailing bytes, non-finite weights, and random
 * mutations with repaired checksums - refused with a reason and never a crash. */
#include "common/crc32c.h"
#include "pd_fixture.h"

#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

TestSuite(weights, .timeout = 60);

#define RESET() memcpy(c, b, len)

static char path[64];

static void tmp_path(void)
{
    snprintf(path, sizeof path, "/tmp/kvb_pd_weights_%d.kvbm", (int)getpid());
}

/* The bytes of a saved file: malloc'd, length in *len. */
static unsigned char *save_bytes(const kvb_pd_model_t *m, size_t *len)
{
    char why[KVB_PD_REASON_MAX];
    tmp_path();
    cr_assert_eq(kvb_pd_model_save(m, path, why, sizeof why), KVB_OK, "%s", why);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*len);
    cr_assert_eq(fread(b, 1, *len, f), *len);
    fclose(f);
    unlink(path);
    return b;
}

static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void wr32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* Recomputes both checksums as a careful attacker would, so that the structural checks are what
 * refuses the file. header_bytes is read from the (possibly mutated) header and clamped. */
static void fix_crcs(unsigned char *b, size_t len)
{
    size_t hb = rd32(b + 12);
    if (hb < 128 || hb > len)
        hb = len < 128 ? len : 128;
    wr32(b + 108, kvb__crc32c(0, b + hb, len - hb));
    wr32(b + 124, 0);
    wr32(b + 124, kvb__crc32c(0, b, hb));
}

/* Expects `b` refused with `status` and a reason containing `what`. */
static void refused(const unsigned char *b, size_t len, int status, const char *what)
{
    kvb_pd_model_t *m = NULL;
    char why[KVB_PD_REASON_MAX] = "";
    int rc = kvb_pd_model_parse(b, len, &m, why, sizeof why);
    cr_assert_eq(rc, status, "len %zu: rc %d (%s), want %d for '%s'", len, rc, why, status, what);
    cr_assert_null(m);
    cr_assert(strstr(why, what), "len %zu: reason '%s' lacks '%s'", len, why, what);
}

static kvb_pd_model_t *mini(kvb_kv_attn_t attn)
{
    kvb_pd_config_t c = fx_mini(attn);
    return fx_model_cfg(&c, 5);
}

Test(weights, crc32c_known_values)
{
    cr_assert_eq(kvb__crc32c(0, "123456789", 9), 0xe3069283u);
    cr_assert_eq(kvb__crc32c(0, "", 0), 0);
    /* Every length and alignment against a bitwise reference, and chaining. */
    unsigned char buf[64];
    for (int i = 0; i < 64; i++)
        buf[i] = (unsigned char)(i * 29 + 7);
    for (size_t off = 0; off < 8; off++)
        for (size_t n = 0; off + n <= 64; n++) {
            uint32_t c = ~0u;
            for (size_t i = 0; i < n; i++) {
                c ^= buf[off + i];
                for (int k = 0; k < 8; k++)
                    c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
            }
            cr_assert_eq(kvb__crc32c(0, buf + off, n), ~c, "off %zu len %zu", off, n);
            cr_assert_eq(
                kvb__crc32c(kvb__crc32c(0, buf + off, n / 2), buf + off + n / 2, n - n / 2), ~c);
        }
}

static void round_trip(kvb_pd_model_t *m)
{
    char why[KVB_PD_REASON_MAX];
    kvb_pd_model_t *back = NULL;
    tmp_path();
    cr_assert_eq(kvb_pd_model_save(m, path, why, sizeof why), KVB_OK, "%s", why);
    cr_assert_eq(kvb_pd_model_load(path, &back, why, sizeof why), KVB_OK, "%s", why);
    cr_assert(!memcmp(&m->cfg, &back->cfg, sizeof m->cfg));
    cr_assert_str_eq(kvb_pd_model_id(m), kvb_pd_model_id(back));
    cr_assert_str_eq(kvb_pd_model_name(m), kvb_pd_model_name(back));
    cr_assert_eq(m->payload_bytes, back->payload_bytes);
    cr_assert(!memcmp(m->data, back->data, (size_t)m->payload_bytes));
    cr_assert_eq(kvb_pd_model_num_tensors(m), kvb_pd_model_num_tensors(back));
    kvb_pd_model_free(back);
    cr_assert_eq(kvb_pd_model_open(path, 123, &back, why, sizeof why), KVB_OK, "%s", why);
    cr_assert_str_eq(kvb_pd_model_id(m), kvb_pd_model_id(back));
    kvb_pd_model_free(back);
    unlink(path);
}

Test(weights, save_load_round_trip)
{
    kvb_pd_model_t *g = mini(KVB_KV_ATTN_GQA), *a = fx_preset("tiny-mla", 4);
    round_trip(g);
    round_trip(a);
    /* Same weights, same generation: the loaded model is the model. */
    kvb_pd_model_free(g);
    kvb_pd_model_free(a);
}

Test(weights, load_reports_io_errors)
{
    kvb_pd_model_t *m = NULL;
    char why[KVB_PD_REASON_MAX];
    cr_assert_eq(kvb_pd_model_load("/nonexistent/x.kvbm", &m, why, sizeof why), KVB_ERR_SYSTEM);
    cr_assert(strstr(why, "/nonexistent/x.kvbm"), "%s", why);
    cr_assert_eq(kvb_pd_model_load("/tmp", &m, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_assert(strstr(why, "not a regular file"), "%s", why);
    cr_assert_eq(kvb_pd_model_open("", 0, &m, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_assert_null(m);
    kvb_pd_model_t *g = mini(KVB_KV_ATTN_GQA);
    cr_assert_eq(kvb_pd_model_save(g, "/nonexistent/dir/x.kvbm", why, sizeof why), KVB_ERR_SYSTEM);
    cr_assert(strstr(why, "cannot write"), "%s", why);
    kvb_pd_model_free(g);
}

Test(weights, truncated_anywhere)
{
    for (int k = 0; k < 2; k++) {
        kvb_pd_model_t *m = mini(k ? KVB_KV_ATTN_MLA : KVB_KV_ATTN_GQA);
        size_t len, hb;
        unsigned char *b = save_bytes(m, &len);
        hb = rd32(b + 12);
        for (size_t n = 0; n < hb + 256; n++)
            refused(b, n, KVB_ERR_INVALID_ARG, "truncated");
        for (size_t n = hb + 256; n < len; n += 509)
            refused(b, n, KVB_ERR_INVALID_ARG, "truncated");
        refused(b, len - 1, KVB_ERR_INVALID_ARG, "truncated");
        /* And through the file API. */
        char why[KVB_PD_REASON_MAX];
        tmp_path();
        FILE *f = fopen(path, "wb");
        cr_assert_eq(fwrite(b, 1, len / 2, f), len / 2);
        fclose(f);
        kvb_pd_model_t *back = NULL;
        cr_assert_eq(kvb_pd_model_load(path, &back, why, sizeof why), KVB_ERR_INVALID_ARG);
        cr_assert(strstr(why, "truncated") && strstr(why, path), "%s", why);
        unlink(path);
        free(b);
        kvb_pd_model_free(m);
    }
}

Test(weights, bad_magic_version_checksums)
{
    kvb_pd_model_t *m = mini(KVB_KV_ATTN_GQA);
    size_t len;
    unsigned char *b = save_bytes(m, &len), *c = malloc(len + 8);
    size_t hb = rd32(b + 12);
    RESET();
    c[0] = 'X';
    refused(c, len, KVB_ERR_INVALID_ARG, "bad magic");
    RESET();
    wr32(c + 8, 2);
    refused(c, len, KVB_ERR_UNSUPPORTED, "version 2");
    /* A flipped bit anywhere past the version in the header is caught by the header checksum. */
    for (size_t i = 16; i < hb; i += 7) {
        RESET();
        c[i] ^= 0x10;
        refused(c, len, KVB_ERR_INVALID_ARG, i >= 104 && i < 108 ? "" : "header checksum");
    }
    for (size_t i = hb; i < len; i += len / 97) {
        RESET();
        c[i] ^= 0x01;
        refused(c, len, KVB_ERR_INVALID_ARG, "payload checksum");
    }
    RESET();
    c[len] = 0;
    refused(c, len + 1, KVB_ERR_INVALID_ARG, "1 unexpected bytes after the payload");
    free(b);
    free(c);
    kvb_pd_model_free(m);
}

/* Offsets of table entry i's fields. */
#define ENTRY(i) (128 + 64 * (size_t)(i))

Test(weights, bad_shapes_with_valid_checksums)
{
    kvb_pd_model_t *m = mini(KVB_KV_ATTN_MLA);
    size_t len;
    unsigned char *b = save_bytes(m, &len), *c = malloc(len);
    RESET();
    wr32(c + ENTRY(3) + 40, 0xffffffffu);
    wr32(c + ENTRY(3) + 44, 0xffffffffu);
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_OVERFLOW, "overflows");
    RESET();
    wr32(c + ENTRY(2) + 40, rd32(c + ENTRY(2) + 40) + 1);
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_INVALID_ARG, "the config needs");
    RESET();
    wr32(c + ENTRY(1) + 48, rd32(c + ENTRY(1) + 48) + 64);
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_INVALID_ARG, "offset");
    RESET();
    c[ENTRY(4)] = 'X';
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_INVALID_ARG, "expected 'blk.0.kv_norm'");
    RESET();
    wr32(c + 104, rd32(c + 104) - 1); /* tensor count no longer matches header_bytes */
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_INVALID_ARG, "header_bytes");
    RESET();
    wr32(c + 112, rd32(c + 112) + 4);
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_INVALID_ARG, "payload_bytes");
    free(b);
    free(c);
    kvb_pd_model_free(m);
}

Test(weights, bad_config_values)
{
    kvb_pd_model_t *m = mini(KVB_KV_ATTN_GQA);
    size_t len;
    unsigned char *b = save_bytes(m, &len), *c = malloc(len);
    struct {
        size_t off;
        uint32_t value;
        int status;
        const char *what;
    } cases[] = {
        {16, 3, KVB_ERR_INVALID_ARG, "unknown attention kind 3"},
        {16, 2, KVB_ERR_INVALID_ARG, "kv_lora_rank 0"}, /* MLA fields missing */
        {20, 0, KVB_ERR_INVALID_ARG, "n_layers 0"},     /* n_layers */
        {20, 100000, KVB_ERR_INVALID_ARG, "n_layers 100000"},
        {24, 0xffffffffu, KVB_ERR_INVALID_ARG, "hidden"}, /* hidden */
        {32, 100, KVB_ERR_INVALID_ARG, "vocab 100"},
        {40, 3, KVB_ERR_INVALID_ARG, "not a multiple"}, /* n_kv_heads 3 vs 8 heads */
        {44, 7, KVB_ERR_INVALID_ARG, "odd"},            /* head_dim */
        {48, 4, KVB_ERR_INVALID_ARG, "MLA fields"},
        {64, 0x7fc00000u, KVB_ERR_INVALID_ARG, "rope_theta"}, /* NaN */
        {68, 0x3f800000u, KVB_ERR_INVALID_ARG, "norm_eps"},   /* 1.0 */
        {72, 0x20202020u, KVB_ERR_INVALID_ARG, "model name"}, /* spaces */
        {76, 0x00410000u, KVB_ERR_INVALID_ARG, "NUL"},        /* text after the NUL */
        {120, 1, KVB_ERR_INVALID_ARG, "reserved"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        RESET();
        wr32(c + cases[i].off, cases[i].value);
        fix_crcs(c, len);
        refused(c, len, cases[i].status, cases[i].what);
    }
    /* Each value within its limit, but together far too large: refused before any allocation. */
    RESET();
    wr32(c + 20, 256);
    wr32(c + 24, 16384);
    wr32(c + 28, 16384);
    fix_crcs(c, len);
    refused(c, len, KVB_ERR_TOO_LARGE, "over the");
    free(b);
    free(c);
    kvb_pd_model_free(m);
}

Test(weights, non_finite_weights)
{
    kvb_pd_model_t *m = mini(KVB_KV_ATTN_GQA);
    size_t len;
    unsigned char *b = save_bytes(m, &len);
    size_t hb = rd32(b + 12);
    wr32(b + hb + 4 * 70, 0x7f800000u); /* +inf in tok_embd */
    fix_crcs(b, len);
    refused(b, len, KVB_ERR_INVALID_ARG, "tok_embd");
    free(b);
    kvb_pd_model_free(m);
}

/* Random mutations of the header and table with repaired checksums: the parser must refuse them
 * (or, rarely, accept an equivalent file) without crashing or reading out of bounds. */
Test(weights, fuzz_header_mutations)
{
    kvb_pd_model_t *m = mini(KVB_KV_ATTN_MLA);
    size_t len;
    unsigned char *b = save_bytes(m, &len), *c = malloc(len);
    size_t hb = rd32(b + 12);
    uint64_t s = 12345;
    for (int it = 0; it < 3000; it++) {
        RESET();
        int flips = 1 + it % 4;
        for (int k = 0; k < flips; k++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            size_t at = (size_t)(s >> 33) % hb;
            c[at] = (unsigned char)(s >> 20);
        }
        size_t n = it % 5 == 0 ? (size_t)(s >> 40) % len : len;
        if (it % 2)
            fix_crcs(c, n);
        kvb_pd_model_t *out = NULL;
        char why[KVB_PD_REASON_MAX] = "";
        int rc = kvb_pd_model_parse(c, n, &out, why, sizeof why);
        if (rc == KVB_OK)
            kvb_pd_model_free(out);
        else
            cr_assert(why[0], "iteration %d: rc %d without a reason", it, rc);
    }
    free(b);
    free(c);
    kvb_pd_model_free(m);
}
