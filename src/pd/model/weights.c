/* SPDX-License-Identifier: Apache-2.0 */
/* Model weights: allocation around the canonical tensor table, seeded generation for presets,
 * and the model's identity (payload checksum and id). The file format lives in weightfile.c. */
#include "common/crc32c.h"
#include "pd/model/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INVAL KVB_ERR_INVALID_ARG

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    return mix(*s);
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !memcmp(s + n - m, suffix, m);
}

/* Points the model's named weights into its payload, walking the table in canonical order. */
static void bind(kvb_pd_model_t *m)
{
    size_t i = 0;
#define NEXT() (m->data + m->tensors[i++].offset)
    m->tok_embd = NEXT();
    for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
        kvb__model_layer_t *w = &m->layers[l];
        w->attn_norm = NEXT();
        w->wq = NEXT();
        if (m->cfg.attn == KVB_KV_ATTN_GQA) {
            w->wk = NEXT();
            w->wv = NEXT();
        } else {
            w->wkv_a = NEXT();
            w->kv_norm = NEXT();
            w->wk_b = NEXT();
            w->wv_b = NEXT();
        }
        w->wo = NEXT();
        w->ffn_norm = NEXT();
        w->ffn_gate = NEXT();
        w->ffn_up = NEXT();
        w->ffn_down = NEXT();
    }
    m->out_norm = NEXT();
    m->lm_head = NEXT();
#undef NEXT
}

int kvb__model_alloc(const kvb_pd_config_t *cfg, const char *name, kvb_pd_model_t **out, char *r,
                     size_t cap)
{
    uint64_t floats = 0;
    kvb_pd_model_t *m = calloc(1, sizeof *m);
    if (!m)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    m->cfg = *cfg;
    snprintf(m->name, sizeof m->name, "%s", name);
    if (kvb__model_tensor_table(cfg, &m->tensors, &m->num_tensors, &floats))
        goto nomem;
    m->payload_bytes = floats * sizeof(float);
    /* floats is bounded by the config check (KVB_PD_WEIGHTS_MAX), so the size_t cast is exact
     * on 64-bit hosts; on 32-bit ones calloc refuses what does not fit. */
    if (floats > SIZE_MAX / sizeof(float))
        goto nomem;
    m->data = calloc((size_t)floats ? (size_t)floats : 1, sizeof(float));
    m->layers = calloc(cfg->n_layers, sizeof *m->layers);
    if (!m->data || !m->layers)
        goto nomem;
    bind(m);
    *out = m;
    return KVB_OK;
nomem:
    kvb_pd_model_free(m);
    return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory for %llu bytes of weights",
                     (unsigned long long)floats * sizeof(float));
}

void kvb__model_seal(kvb_pd_model_t *m)
{
    m->payload_crc = kvb__crc32c(0, m->data, (size_t)m->payload_bytes);
    snprintf(m->id, sizeof m->id, "%s@%08x", m->name, m->payload_crc);
}

/* Half-width of the uniform distribution of row `row` of tensor t (std * sqrt(3)). */
static float amplitude(const kvb__model_tensor_t *t, uint32_t row, uint32_t hidden)
{
    float std;
    if (!strcmp(t->name, "tok_embd"))
        std = 1.0f;
    else if (!strcmp(t->name, "lm_head"))
        std = row >= 32 && row <= 126 ? 4.0f / sqrtf((float)hidden)
                                      : 1.0f / (4.0f * sqrtf((float)hidden));
    else
        std = 1.0f / sqrtf((float)t->cols);
    return sqrtf(3.0f) * std;
}

static void fill(kvb_pd_model_t *m, size_t k, uint64_t seed)
{
    const kvb__model_tensor_t *t = &m->tensors[k];
    float *w = m->data + t->offset;
    size_t n = (size_t)t->rows * t->cols;
    if (ends_with(t->name, "norm")) {
        for (size_t i = 0; i < n; i++)
            w[i] = 1.0f;
        return;
    }
    uint64_t s = mix(seed ^ mix((uint64_t)k + 1));
    for (uint32_t row = 0; row < t->rows; row++) {
        float a = amplitude(t, row, m->cfg.hidden);
        for (uint32_t c = 0; c < t->cols; c++) {
            float u = (float)(next(&s) >> 40) * 0x1p-24f;
            w[(size_t)row * t->cols + c] = (2.0f * u - 1.0f) * a;
        }
    }
}

int kvb_pd_model_random(const kvb_pd_config_t *cfg, const char *name, uint64_t seed,
                        kvb_pd_model_t **out, char *r, size_t cap)
{
    kvb_pd_model_t *m;
    int rc;
    if (!out)
        return kvb__fail(r, cap, INVAL, "out is NULL");
    if ((rc = kvb__model_config_check(cfg, r, cap)) ||
        (rc = kvb__model_name_check(name, name ? strlen(name) : 0, r, cap)) ||
        (rc = kvb__model_alloc(cfg, name, &m, r, cap)))
        return rc;
    for (size_t k = 0; k < m->num_tensors; k++)
        fill(m, k, seed);
    kvb__model_seal(m);
    kvb__reason_clear(r, cap);
    *out = m;
    return KVB_OK;
}

int kvb_pd_model_preset(const char *preset, uint64_t seed, kvb_pd_model_t **out, char *r,
                        size_t cap)
{
    kvb_pd_config_t cfg;
    if (kvb_pd_preset_config(preset, &cfg))
        return kvb__fail(r, cap, KVB_ERR_NOT_FOUND,
                         "unknown preset '%s' (known: tiny-gqa, tiny-mla)",
                         preset ? preset : "(null)");
    return kvb_pd_model_random(&cfg, preset, seed, out, r, cap);
}

int kvb_pd_model_open(const char *spec, uint64_t seed, kvb_pd_model_t **out, char *r, size_t cap)
{
    kvb_pd_config_t cfg;
    if (!spec || !*spec)
        return kvb__fail(r, cap, INVAL, "model is empty (give a preset or a file)");
    if (kvb_pd_preset_config(spec, &cfg) == KVB_OK)
        return kvb_pd_model_random(&cfg, spec, seed, out, r, cap);
    return kvb_pd_model_load(spec, out, r, cap);
}

void kvb_pd_model_free(kvb_pd_model_t *m)
{
    if (!m)
        return;
    free(m->data);
    free(m->tensors);
    free(m->layers);
    free(m);
}

const kvb_pd_config_t *kvb_pd_model_config(const kvb_pd_model_t *m)
{
    return &m->cfg;
}

const char *kvb_pd_model_name(const kvb_pd_model_t *m)
{
    return m->name;
}

const char *kvb_pd_model_id(const kvb_pd_model_t *m)
{
    return m->id;
}

uint64_t kvb_pd_model_weight_bytes(const kvb_pd_model_t *m)
{
    return m->payload_bytes;
}

size_t kvb_pd_model_num_tensors(const kvb_pd_model_t *m)
{
    return m->num_tensors;
}
