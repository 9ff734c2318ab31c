/* SPDX-License-Identifier: Apache-2.0 */
/* Model configs: the built-in presets, the rules a config (and so a weight file) must follow, and
 * the canonical tensor table that both the preset generator and the file format are built on. */
#include "pd/model/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

#define INVAL KVB_ERR_INVALID_ARG

int kvb_pd_preset_config(const char *preset, kvb_pd_config_t *out)
{
    kvb_pd_config_t c = {.n_layers = 4,
                         .hidden = 256,
                         .ffn = 512,
                         .vocab = KVB_PD_VOCAB_MIN,
                         .n_heads = 8,
                         .rope_theta = 10000.0f,
                         .norm_eps = 1e-5f};
    if (!preset)
        return KVB_ERR_NOT_FOUND;
    if (!strcmp(preset, "tiny-gqa")) {
        c.attn = KVB_KV_ATTN_GQA;
        c.n_kv_heads = 4;
        c.head_dim = 32;
    } else if (!strcmp(preset, "tiny-mla")) {
        c.attn = KVB_KV_ATTN_MLA;
        c.kv_lora_rank = 64;
        c.nope_dim = 32;
        c.rope_dim = 16;
        c.v_head_dim = 32;
    } else {
        return KVB_ERR_NOT_FOUND;
    }
    *out = c;
    return KVB_OK;
}

/* One dimension in [lo, hi]. */
static int dim_check(const char *what, uint32_t v, uint32_t lo, uint32_t hi, char *r, size_t cap)
{
    if (v < lo || v > hi)
        return kvb__fail(r, cap, INVAL, "%s %u is out of range [%u, %u]", what, v, lo, hi);
    return KVB_OK;
}

static int gqa_check(const kvb_pd_config_t *c, char *r, size_t cap)
{
    int rc;
    if ((rc = dim_check("n_kv_heads", c->n_kv_heads, 1, KVB_PD_HEADS_MAX, r, cap)) ||
        (rc = dim_check("head_dim", c->head_dim, 2, KVB_PD_DIM_MAX, r, cap)))
        return rc;
    if (c->n_heads % c->n_kv_heads)
        return kvb__fail(r, cap, INVAL, "n_heads %u is not a multiple of n_kv_heads %u", c->n_heads,
                         c->n_kv_heads);
    if (c->head_dim % 2)
        return kvb__fail(r, cap, INVAL, "head_dim %u is odd (RoPE rotates pairs)", c->head_dim);
    if (c->kv_lora_rank || c->nope_dim || c->rope_dim || c->v_head_dim)
        return kvb__fail(r, cap, INVAL, "GQA config has MLA fields set");
    return KVB_OK;
}

static int mla_check(const kvb_pd_config_t *c, char *r, size_t cap)
{
    int rc;
    if ((rc = dim_check("kv_lora_rank", c->kv_lora_rank, 1, KVB_PD_DIM_MAX, r, cap)) ||
        (rc = dim_check("nope_dim", c->nope_dim, 1, KVB_PD_DIM_MAX, r, cap)) ||
        (rc = dim_check("rope_dim", c->rope_dim, 2, KVB_PD_DIM_MAX, r, cap)) ||
        (rc = dim_check("v_head_dim", c->v_head_dim, 1, KVB_PD_DIM_MAX, r, cap)))
        return rc;
    if (c->rope_dim % 2)
        return kvb__fail(r, cap, INVAL, "rope_dim %u is odd (RoPE rotates pairs)", c->rope_dim);
    if (c->n_kv_heads || c->head_dim)
        return kvb__fail(r, cap, INVAL, "MLA config has GQA fields set");
    return KVB_OK;
}

int kvb__model_config_check(const kvb_pd_config_t *c, char *r, size_t cap)
{
    int rc;
    if (!c)
        return kvb__fail(r, cap, INVAL, "config is NULL");
    if (c->attn != KVB_KV_ATTN_GQA && c->attn != KVB_KV_ATTN_MLA)
        return kvb__fail(r, cap, INVAL, "unknown attention kind %d (1 GQA, 2 MLA)", (int)c->attn);
    if ((rc = dim_check("n_layers", c->n_layers, 1, KVB_PD_LAYERS_MAX, r, cap)) ||
        (rc = dim_check("hidden", c->hidden, 1, KVB_PD_DIM_MAX, r, cap)) ||
        (rc = dim_check("ffn", c->ffn, 1, KVB_PD_DIM_MAX, r, cap)) ||
        (rc = dim_check("vocab", c->vocab, KVB_PD_VOCAB_MIN, KVB_PD_VOCAB_MAX, r, cap)) ||
        (rc = dim_check("n_heads", c->n_heads, 1, KVB_PD_HEADS_MAX, r, cap)))
        return rc;
    if (!(c->rope_theta > 1.0f) || isinf(c->rope_theta))
        return kvb__fail(r, cap, INVAL, "rope_theta %g is not a finite value > 1",
                         (double)c->rope_theta);
    if (!(c->norm_eps > 0.0f && c->norm_eps < 1.0f))
        return kvb__fail(r, cap, INVAL, "norm_eps %g is not in (0, 1)", (double)c->norm_eps);
    rc = c->attn == KVB_KV_ATTN_GQA ? gqa_check(c, r, cap) : mla_check(c, r, cap);
    if (rc)
        return rc;
    /* The limits keep every single product far below 2^64; only the total needs a bound. */
    kvb__model_tensor_t *t;
    size_t n;
    uint64_t floats;
    if (kvb__model_tensor_table(c, &t, &n, &floats))
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    free(t);
    if (floats > KVB_PD_WEIGHTS_MAX / sizeof(float))
        return kvb__fail(r, cap, KVB_ERR_TOO_LARGE, "weights take %llu bytes, over the %llu limit",
                         (unsigned long long)floats * sizeof(float),
                         (unsigned long long)KVB_PD_WEIGHTS_MAX);
    return KVB_OK;
}

int kvb__model_name_check(const char *name, size_t len, char *r, size_t cap)
{
    if (!name || len == 0 || len > KVB_PD_NAME_MAX)
        return kvb__fail(r, cap, INVAL, "model name must have 1..%u characters", KVB_PD_NAME_MAX);
    for (size_t i = 0; i < len; i++)
        if (name[i] < 0x21 || name[i] > 0x7e || name[i] == '@')
            return kvb__fail(r, cap, INVAL,
                             "model name has a character that is not printable ASCII, a space "
                             "or '@' at %zu",
                             i);
    return KVB_OK;
}

typedef struct {
    kvb__model_tensor_t *t;
    size_t n;
    uint64_t floats; /* payload so far, in floats */
} table_t;

/* Appends a tensor at the next 64-byte boundary. Config limits keep the arithmetic in range. */
static void add(table_t *tb, const char *name, uint32_t layer, uint32_t rows, uint32_t cols)
{
    kvb__model_tensor_t *t = &tb->t[tb->n++];
    if (layer == UINT32_MAX)
        snprintf(t->name, sizeof t->name, "%s", name);
    else
        snprintf(t->name, sizeof t->name, "blk.%u.%s", layer, name);
    t->rows = rows;
    t->cols = cols;
    t->offset = tb->floats;
    uint64_t end = tb->floats + (uint64_t)rows * cols;
    tb->floats =
        (end + KVB__MODEL_ALIGN_FLOATS - 1) / KVB__MODEL_ALIGN_FLOATS * KVB__MODEL_ALIGN_FLOATS;
}

static void add_layer(table_t *tb, const kvb_pd_config_t *c, uint32_t l)
{
    uint32_t h = c->hidden, nh = c->n_heads;
    add(tb, "attn_norm", l, 1, h);
    if (c->attn == KVB_KV_ATTN_GQA) {
        add(tb, "wq", l, nh * c->head_dim, h);
        add(tb, "wk", l, c->n_kv_heads * c->head_dim, h);
        add(tb, "wv", l, c->n_kv_heads * c->head_dim, h);
        add(tb, "wo", l, h, nh * c->head_dim);
    } else {
        add(tb, "wq", l, nh * (c->nope_dim + c->rope_dim), h);
        add(tb, "wkv_a", l, c->kv_lora_rank + c->rope_dim, h);
        add(tb, "kv_norm", l, 1, c->kv_lora_rank);
        add(tb, "wk_b", l, nh * c->nope_dim, c->kv_lora_rank);
        add(tb, "wv_b", l, nh * c->v_head_dim, c->kv_lora_rank);
        add(tb, "wo", l, h, nh * c->v_head_dim);
    }
    add(tb, "ffn_norm", l, 1, h);
    add(tb, "ffn_gate", l, c->ffn, h);
    add(tb, "ffn_up", l, c->ffn, h);
    add(tb, "ffn_down", l, h, c->ffn);
}

int kvb__model_tensor_table(const kvb_pd_config_t *c, kvb__model_tensor_t **out, size_t *n,
                            uint64_t *floats)
{
    size_t per_layer = c->attn == KVB_KV_ATTN_GQA ? 9 : 11;
    table_t tb = {.t = calloc(3 + per_layer * c->n_layers, sizeof(kvb__model_tensor_t))};
    if (!tb.t)
        return KVB_ERR_NOMEM;
    add(&tb, "tok_embd", UINT32_MAX, c->vocab, c->hidden);
    for (uint32_t l = 0; l < c->n_layers; l++)
        add_layer(&tb, c, l);
    add(&tb, "out_norm", UINT32_MAX, 1, c->hidden);
    add(&tb, "lm_head", UINT32_MAX, c->vocab, c->hidden);
    *out = tb.t;
    *n = tb.n;
    *floats = tb.floats;
    return KVB_OK;
}
