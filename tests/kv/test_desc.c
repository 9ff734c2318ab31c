/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/kv/desc.c: the JSON descriptor round-trips every field, and decoding rejects
 * malformed, truncated, mistyped, incomplete, over-long and semantically invalid input with a
 * reason - never a crash, never a partial layout. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv/internal.h"
#include "kv/kv_fixture.h"

static fx_layout_t g;
static char *desc; /* g encoded */
static size_t desc_len;

static char *encode(const kvb_kv_layout_t *l, size_t *len)
{
    size_t n = 0;
    cr_assert_eq(kvb_kv_layout_encode(l, NULL, 0, &n), KVB_ERR_TOO_LARGE);
    char *buf = malloc(n + 1);
    cr_assert_eq(kvb_kv_layout_encode(l, buf, n + 1, &n), KVB_OK);
    cr_assert_eq(strlen(buf), n);
    if (len)
        *len = n;
    return buf;
}

static void setup(void)
{
    fx_gqa(&g, 8, 4, 3, 2, 32, 0x7f0000000000ull);
    g.l.dp_size = 2;
    g.l.dp_rank = 1;
    fx_add_split(&g, 0x7f0000000000ull, 1, KVB_KV_SLOT_K_SCALE, 32);
    fx_add(&g, 0x7f0000000000ull, 0, KVB_KV_SLOT_INDEX, 8, 32);
    g.slots[1].order = g.slots[3].order = KVB_KV_ORDER_NHD;
    desc = encode(&g.l, &desc_len);
}

static void teardown(void)
{
    free(desc);
}

TestSuite(desc, .init = setup, .fini = teardown, .timeout = 30);

static void assert_same(const kvb_kv_layout_t *a, const kvb_kv_layout_t *b)
{
    cr_assert_str_eq(a->model, b->model);
    cr_assert_eq(a->dtype, b->dtype);
    cr_assert_eq(a->tokens_per_block, b->tokens_per_block);
    cr_assert_eq(a->attn, b->attn);
    cr_assert_eq(a->num_kv_heads, b->num_kv_heads);
    cr_assert_eq(a->dp_size, b->dp_size);
    cr_assert_eq(a->dp_rank, b->dp_rank);
    cr_assert_eq(a->tp_size, b->tp_size);
    cr_assert_eq(a->tp_rank, b->tp_rank);
    cr_assert_eq(a->num_layers, b->num_layers);
    cr_assert_eq(a->num_slots, b->num_slots);
    for (size_t i = 0; i < a->num_slots; i++)
        cr_assert_eq(memcmp(&a->slots[i], &b->slots[i], sizeof a->slots[i]), 0, "slot %zu", i);
}

/* Decodes text that must be refused with `want` and a reason containing `needle`. */
static void expect_refused(const char *text, size_t len, int want, const char *needle)
{
    char reason[KVB_KV_REASON_MAX] = "";
    kvb_kv_layout_t *out = (kvb_kv_layout_t *)&g; /* a sentinel that must stay untouched */
    int rc = kvb_kv_layout_decode(text, len, &out, reason, sizeof reason);
    cr_assert_eq(rc, want, "rc %s want %s for: %.200s (reason %s)", kvb_status_name(rc),
                 kvb_status_name(want), text, reason);
    cr_assert_eq(out, (kvb_kv_layout_t *)&g, "out written on error");
    cr_assert(strstr(reason, needle), "reason '%s' lacks '%s'", reason, needle);
}

/* The descriptor with root (slot < 0) or slots[slot] field `key` set to `v` (NULL: removed). */
static char *edited(int slot, const char *key, json_t *v)
{
    json_t *root = json_loads(desc, 0, NULL);
    json_t *o = slot < 0 ? root : json_array_get(json_object_get(root, "slots"), (size_t)slot);
    if (v)
        json_object_set_new(o, key, v);
    else
        json_object_del(o, key);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

static void expect_edit_refused(int slot, const char *key, json_t *v, const char *needle)
{
    char *s = edited(slot, key, v);
    expect_refused(s, strlen(s), KVB_ERR_INVALID_ARG, needle);
    free(s);
}

Test(desc, round_trip_every_field)
{
    kvb_kv_layout_t *out = NULL;
    char reason[KVB_KV_REASON_MAX] = "junk";
    cr_assert_eq(kvb_kv_layout_decode(desc, desc_len, &out, reason, sizeof reason), KVB_OK, "%s",
                 reason);
    cr_assert_str_empty(reason);
    assert_same(&g.l, out);
    size_t n;
    char *again = encode(out, &n);
    cr_assert_str_eq(again, desc, "re-encoding is stable");
    free(again);
    kvb_kv_layout_free(out);
}

Test(desc, round_trip_mla_and_high_addresses)
{
    fx_mla(&g, 8, 5, 3, 100, 0xffff800000000000ull);
    fx_add(&g, 0xffff800000000000ull, 2, KVB_KV_SLOT_INDEX, 8, 100);
    char *s = encode(&g.l, NULL);
    cr_assert(strstr(s, "\"base\":\"0xffff800000000000\""), "%s", s);
    kvb_kv_layout_t *out = NULL;
    cr_assert_eq(kvb_kv_layout_decode(s, strlen(s), &out, NULL, 0), KVB_OK);
    assert_same(&g.l, out);
    kvb_kv_layout_free(out);
    free(s);
}

Test(desc, encode_sizing)
{
    char *buf = malloc(desc_len + 1);
    size_t n = 0;
    memset(buf, 'Z', desc_len + 1);
    cr_assert_eq(kvb_kv_layout_encode(&g.l, buf, desc_len, &n), KVB_ERR_TOO_LARGE);
    cr_assert_eq(n, desc_len);
    cr_assert_eq(buf[0], 'Z', "buffer untouched when too small");
    cr_assert_eq(kvb_kv_layout_encode(&g.l, buf, desc_len + 1, &n), KVB_OK);
    cr_assert_str_eq(buf, desc);
    cr_assert_eq(kvb_kv_layout_encode(&g.l, NULL, 5, &n), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_kv_layout_encode(&g.l, buf, desc_len + 1, NULL), KVB_ERR_INVALID_ARG);
    free(buf);
}

Test(desc, encode_refuses_invalid_and_huge)
{
    size_t n = 0;
    g.slots[0].num_blocks = 0;
    cr_assert_eq(kvb_kv_layout_encode(&g.l, NULL, 0, &n), KVB_ERR_INVALID_ARG);
    fx_mla(&g, 1, 0, 1, 2, 0x1000);
    g.slots[0].block_bytes = 1ull << 62;
    g.slots[0].len = 1ull << 63; /* valid, but no JSON integer holds it */
    cr_assert_eq(kvb_kv_layout_validate(&g.l, NULL, 0), KVB_OK);
    cr_assert_eq(kvb_kv_layout_encode(&g.l, NULL, 0, &n), KVB_ERR_OVERFLOW);
}

Test(desc, every_truncation_is_refused)
{
    /* Feed the descriptor in pieces: every proper prefix is malformed JSON. */
    for (size_t n = 0; n < desc_len; n++)
        expect_refused(desc, n, KVB_ERR_INVALID_ARG, "malformed JSON");
}

Test(desc, not_json_or_not_an_object)
{
    const char *bad[] = {"", "nul", "[]", "42", "\"x\"", "{} {}", "{\"version\":1,}", "\xff\xfe"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_refused(bad[i], strlen(bad[i]), KVB_ERR_INVALID_ARG, "");
    expect_refused("[1]", 3, KVB_ERR_INVALID_ARG, "descriptor is not a JSON object");
    expect_refused(NULL, 0, KVB_ERR_INVALID_ARG, "malformed JSON");
    expect_refused(NULL, 5, KVB_ERR_INVALID_ARG, "must not be NULL");
    cr_assert_eq(kvb_kv_layout_decode(desc, desc_len, NULL, NULL, 0), KVB_ERR_INVALID_ARG);
}

Test(desc, embedded_nul_is_refused)
{
    char *s = strdup(desc);
    s[desc_len / 2] = '\0';
    expect_refused(s, desc_len, KVB_ERR_INVALID_ARG, "malformed JSON");
    free(s);
    const char esc[] = "{\"model\":\"a\\u0000b\"}";
    expect_refused(esc, strlen(esc), KVB_ERR_INVALID_ARG, "malformed JSON");
}

Test(desc, duplicate_keys_are_refused)
{
    char *s = malloc(desc_len + 32);
    snprintf(s, desc_len + 32, "{\"version\":1,%s", desc + 1);
    expect_refused(s, strlen(s), KVB_ERR_INVALID_ARG, "duplicate");
    free(s);
}

Test(desc, every_missing_field_is_named)
{
    const char *root[] = {"version", "model",        "dtype",      "tokens_per_block",
                          "attn",    "num_kv_heads", "dp_size",    "dp_rank",
                          "tp_size", "tp_rank",      "num_layers", "slots"};
    const char *slot[] = {"layer",      "kind",      "base",       "len",  "block_bytes",
                          "num_blocks", "num_heads", "head_bytes", "order"};
    char needle[64];
    for (size_t i = 0; i < sizeof root / sizeof root[0]; i++) {
        snprintf(needle, sizeof needle, "%s: missing", root[i]);
        expect_edit_refused(-1, root[i], NULL, needle);
    }
    for (size_t i = 0; i < sizeof slot / sizeof slot[0]; i++) {
        snprintf(needle, sizeof needle, "slots[2].%s: missing", slot[i]);
        expect_edit_refused(2, slot[i], NULL, needle);
    }
}

Test(desc, unknown_fields_are_refused)
{
    expect_edit_refused(-1, "extra", json_true(), "unknown field 'extra'");
    expect_edit_refused(4, "stride", json_integer(8), "unknown field 'slots[4].stride'");
}

Test(desc, wrong_types_and_ranges)
{
    expect_edit_refused(-1, "tokens_per_block", json_string("4"),
                        "tokens_per_block: expected an integer");
    expect_edit_refused(-1, "tokens_per_block", json_real(4.0),
                        "tokens_per_block: expected an integer");
    expect_edit_refused(-1, "num_layers", json_integer(-1), "num_layers: expected an integer");
    expect_edit_refused(-1, "num_layers", json_integer(1ll << 32), "in 0..4294967295");
    expect_edit_refused(-1, "tp_size", json_integer(1ll << 31),
                        "tp_size: expected an integer in 0..2147483647");
    expect_edit_refused(-1, "dp_rank", json_null(), "dp_rank: expected an integer");
    expect_edit_refused(-1, "model", json_integer(1), "model: expected a string");
    expect_edit_refused(-1, "slots", json_object(), "slots: expected an array");
    expect_edit_refused(-1, "slots", json_array(), "slots: 0 entries");
    expect_edit_refused(1, "len", json_false(), "slots[1].len: expected an integer");
    expect_edit_refused(1, "num_heads", json_integer(-5), "slots[1].num_heads");
    expect_edit_refused(0, "layer", json_string("0"), "slots[0].layer");
}

Test(desc, big_integers_are_refused)
{
    const char *p = strstr(desc, "\"num_layers\":2");
    cr_assert_not_null(p);
    char *s = malloc(desc_len + 64);
    int head = (int)(p - desc);
    snprintf(s, desc_len + 64, "%.*s\"num_layers\":99999999999999999999999%s", head, desc,
             p + strlen("\"num_layers\":2"));
    expect_refused(s, strlen(s), KVB_ERR_INVALID_ARG, "malformed JSON");
    free(s);
}

Test(desc, unknown_names_are_refused)
{
    expect_edit_refused(-1, "version", json_integer(2), "unsupported descriptor version 2");
    expect_edit_refused(-1, "dtype", json_string("bf17"), "dtype: unknown value 'bf17'");
    expect_edit_refused(-1, "attn", json_string("GQA"), "attn: unknown value 'GQA'");
    expect_edit_refused(3, "kind", json_string("Q"), "slots[3].kind: unknown value 'Q'");
    expect_edit_refused(3, "order", json_string("hnd"), "slots[3].order: unknown value 'hnd'");
}

Test(desc, base_must_be_a_hex_string)
{
    const char *bad[] = {"1000",  "0x",   "0X10", "0x12345678901234567", "0xZZ", "0x10 ",
                         " 0x10", "0x-1", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_edit_refused(0, "base", json_string(bad[i]), "slots[0].base: expected \"0x\"");
    expect_edit_refused(0, "base", json_integer(4096), "slots[0].base: expected a string");
}

Test(desc, model_length_limit)
{
    char name[KVB_KV_MODEL_MAX + 2];
    memset(name, 'm', sizeof name);
    name[KVB_KV_MODEL_MAX + 1] = '\0';
    expect_edit_refused(-1, "model", json_string(name), "model: longer than 127 bytes");
    name[KVB_KV_MODEL_MAX] = '\0'; /* exactly at the limit */
    char *s = edited(-1, "model", json_string(name));
    kvb_kv_layout_t *out = NULL;
    cr_assert_eq(kvb_kv_layout_decode(s, strlen(s), &out, NULL, 0), KVB_OK);
    cr_assert_eq(strlen(out->model), KVB_KV_MODEL_MAX);
    kvb_kv_layout_free(out);
    free(s);
}

Test(desc, semantic_errors_come_from_validation)
{
    expect_edit_refused(1, "num_blocks", json_integer(0),
                        "invalid layout: layer 0 slot V: num_blocks is 0");
    expect_edit_refused(0, "layer", json_integer(7), "invalid layout: slot entry 0: layer id 7");
    expect_edit_refused(-1, "tp_rank", json_integer(4), "invalid layout: tp_rank 4 is outside");
    expect_edit_refused(5, "kind", json_string("K"), "invalid layout: layer 0 slot K: duplicate");
}

Test(desc, size_limit_at_and_over)
{
    /* Pad a valid descriptor with whitespace to exactly the limit: accepted; one more: refused
     * before parsing. */
    char *big = malloc(KVB_KV_DESC_MAX + 1);
    memcpy(big, desc, desc_len);
    memset(big + desc_len, ' ', KVB_KV_DESC_MAX + 1 - desc_len);
    kvb_kv_layout_t *out = NULL;
    cr_assert_eq(kvb_kv_layout_decode(big, KVB_KV_DESC_MAX, &out, NULL, 0), KVB_OK);
    kvb_kv_layout_free(out);
    expect_refused(big, KVB_KV_DESC_MAX + 1, KVB_ERR_TOO_LARGE, "the limit is 2097152");
    free(big);
}

Test(desc, too_many_slots)
{
    json_t *root = json_loads(desc, 0, NULL);
    json_t *slots = json_object_get(root, "slots");
    json_t *one = json_array_get(slots, 0);
    while (json_array_size(slots) <= KVB_KV_LAYERS_MAX * KVB_KV_SLOT_COUNT)
        json_array_append(slots, one);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    expect_refused(s, strlen(s), KVB_ERR_INVALID_ARG, "slots: 6145 entries, expected 1..6144");
    free(s);
}

Test(desc, slot_entry_not_an_object)
{
    json_t *root = json_loads(desc, 0, NULL);
    json_array_set_new(json_object_get(root, "slots"), 1, json_integer(3));
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    expect_refused(s, strlen(s), KVB_ERR_INVALID_ARG, "slots[1]: expected an object");
    free(s);
}

Test(desc, random_corruption_never_crashes)
{
    /* Deterministic byte flips: each result is either a valid layout or an error with a reason. */
    uint32_t seed = 12345;
    char *s = malloc(desc_len);
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(s, desc, desc_len);
        for (int k = 0; k < 1 + iter % 4; k++) {
            seed = seed * 1103515245u + 12345u;
            size_t at = (seed >> 8) % desc_len;
            seed = seed * 1103515245u + 12345u;
            s[at] = (char)(seed >> 16);
        }
        char reason[KVB_KV_REASON_MAX] = "";
        kvb_kv_layout_t *out = NULL;
        int rc = kvb_kv_layout_decode(s, desc_len, &out, reason, sizeof reason);
        if (rc == KVB_OK) {
            cr_assert_eq(kvb_kv_layout_validate(out, NULL, 0), KVB_OK);
            kvb_kv_layout_free(out);
        } else {
            cr_assert_null(out);
            cr_assert_neq(reason[0], '\0', "error without a reason");
        }
    }
    free(s);
}

Test(desc, free_null)
{
    kvb_kv_layout_free(NULL);
}
