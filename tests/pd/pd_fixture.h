/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the reference-model tests: small configs, an instance of TP ranks with calloc'd
 * caches, and a naive forward pass written independently of src/pd/model/model.c (contiguous K/V,
 * no paging, sequential sums, MLA without absorption) that returns the logits of every position.
 * Header-only so that each test binary stays self-contained. */
#ifndef KVB_TESTS_PD_FIXTURE_H
#define KVB_TESTS_PD_FIXTURE_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pd/model/internal.h"
#include "pd/model/model.h"

#define FX_MAX_TP 8

/* Small configs for the heavier tests: the same code paths as the presets, a tenth of the work. */
static inline kvb_pd_config_t fx_mini(kvb_kv_attn_t attn)
{
    kvb_pd_config_t c = {.attn = attn,
                         .n_layers = 2,
                         .hidden = 64,
                         .ffn = 96,
                         .vocab = KVB_PD_VOCAB_MIN,
                         .n_heads = 8,
                         .rope_theta = 10000.0f,
                         .norm_eps = 1e-5f};
    if (attn == KVB_KV_ATTN_GQA) {
        c.n_kv_heads = 4;
        c.head_dim = 8;
    } else {
        c.kv_lora_rank = 16;
        c.nope_dim = 8;
        c.rope_dim = 8;
        c.v_head_dim = 12;
    }
    return c;
}

static inline kvb_pd_model_t *fx_model_cfg(const kvb_pd_config_t *c, uint64_t seed)
{
    kvb_pd_model_t *m = NULL;
    char why[KVB_PD_REASON_MAX];
    int rc = kvb_pd_model_random(c, "mini", seed, &m, why, sizeof why);
    cr_assert_eq(rc, KVB_OK, "model: %s", why);
    return m;
}

static inline kvb_pd_model_t *fx_preset(const char *name, uint64_t seed)
{
    kvb_pd_model_t *m = NULL;
    char why[KVB_PD_REASON_MAX];
    int rc = kvb_pd_model_preset(name, seed, &m, why, sizeof why);
    cr_assert_eq(rc, KVB_OK, "preset %s: %s", name, why);
    return m;
}

/* One instance: tp ranks' caches of num_blocks blocks each. */
typedef struct {
    const kvb_pd_model_t *m;
    uint32_t tp, tpb;
    uint64_t num_blocks;
    kvb_pd_cache_t *caches[FX_MAX_TP];
} fx_inst_t;

static inline void fx_inst(fx_inst_t *in, const kvb_pd_model_t *m, uint32_t tp, uint64_t blocks,
                           uint32_t tpb)
{
    char why[KVB_PD_REASON_MAX];
    memset(in, 0, sizeof *in);
    in->m = m;
    in->tp = tp;
    in->tpb = tpb ? tpb : KVB_PD_TOKENS_PER_BLOCK;
    in->num_blocks = blocks;
    for (uint32_t r = 0; r < tp; r++) {
        int rc = kvb_pd_cache_create(m, tp, r, blocks, tpb, NULL, &in->caches[r], why, sizeof why);
        cr_assert_eq(rc, KVB_OK, "cache %u/%u: %s", r, tp, why);
    }
}

static inline void fx_inst_free(fx_inst_t *in)
{
    for (uint32_t r = 0; r < in->tp; r++)
        kvb_pd_cache_destroy(in->caches[r]);
    memset(in, 0, sizeof *in);
}

static inline void fx_forward(fx_inst_t *in, kvb_pd_seq_t *seq, const uint32_t *toks, size_t n,
                              float *logits)
{
    char why[KVB_PD_REASON_MAX];
    int rc = kvb_pd_forward(in->m, in->caches, in->tp, seq, toks, n, logits, NULL, why, sizeof why);
    cr_assert_eq(rc, KVB_OK, "forward: %s", why);
}

static inline uint64_t fx_gcd(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* A permuted block table: entry i is (i * step + first) % nb, with step raised until it is
 * coprime to nb so that the n <= nb entries are distinct. */
static inline void fx_table(uint64_t *t, size_t n, uint64_t step, uint64_t first, uint64_t nb)
{
    while (fx_gcd(step, nb) != 1)
        step++;
    for (size_t i = 0; i < n; i++)
        t[i] = (i * step + first) % nb;
}

/* Deterministic prompt bytes of length n after a BOS. */
static inline void fx_prompt(uint32_t *p, size_t n, uint32_t salt)
{
    p[0] = KVB_PD_BOS;
    for (size_t i = 1; i < n; i++)
        p[i] = 32 + (uint32_t)((i * 37 + salt * 11) % 95);
}

/* ---- The naive reference --------------------------------------------------------------------- */

static inline void nv_matvec(float *out, const float *w, const float *x, size_t rows, size_t cols)
{
    for (size_t i = 0; i < rows; i++) {
        float s = 0.0f;
        for (size_t k = 0; k < cols; k++)
            s += w[i * cols + k] * x[k];
        out[i] = s;
    }
}

static inline void nv_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps)
{
    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (size_t i = 0; i < n; i++)
        out[i] = x[i] * r * w[i];
}

static inline void nv_rope(float *v, size_t d, size_t pos, float theta)
{
    size_t half = d / 2;
    for (size_t i = 0; i < half; i++) {
        double a = (double)pos * pow((double)theta, -2.0 * (double)i / (double)d);
        float c = (float)cos(a), s = (float)sin(a), x = v[i], y = v[i + half];
        v[i] = x * c - y * s;
        v[i + half] = x * s + y * c;
    }
}

/* Attention output (before wo) of every position and head: out[p][h][dv]. */
static inline void nv_attn_gqa(const kvb_pd_config_t *c, const kvb__model_layer_t *w,
                               const float *xn, size_t n, float *out)
{
    size_t hd = c->head_dim, H = c->hidden, nh = c->n_heads, nk = c->n_kv_heads;
    float *q = calloc(n * nh * hd, 4), *k = calloc(n * nk * hd, 4), *v = calloc(n * nk * hd, 4);
    float *s = calloc(n, 4);
    for (size_t p = 0; p < n; p++) {
        nv_matvec(q + p * nh * hd, w->wq, xn + p * H, nh * hd, H);
        nv_matvec(k + p * nk * hd, w->wk, xn + p * H, nk * hd, H);
        nv_matvec(v + p * nk * hd, w->wv, xn + p * H, nk * hd, H);
        for (size_t h = 0; h < nh; h++)
            nv_rope(q + (p * nh + h) * hd, hd, p, c->rope_theta);
        for (size_t h = 0; h < nk; h++)
            nv_rope(k + (p * nk + h) * hd, hd, p, c->rope_theta);
    }
    for (size_t p = 0; p < n; p++)
        for (size_t h = 0; h < nh; h++) {
            size_t g = h / (nh / nk);
            float max = -INFINITY, sum = 0.0f;
            for (size_t j = 0; j <= p; j++) {
                float d = 0.0f;
                for (size_t e = 0; e < hd; e++)
                    d += q[(p * nh + h) * hd + e] * k[(j * nk + g) * hd + e];
                s[j] = d / sqrtf((float)hd);
                max = fmaxf(max, s[j]);
            }
            for (size_t j = 0; j <= p; j++)
                sum += (s[j] = expf(s[j] - max));
            for (size_t e = 0; e < hd; e++) {
                float o = 0.0f;
                for (size_t j = 0; j <= p; j++)
                    o += s[j] / sum * v[(j * nk + g) * hd + e];
                out[(p * nh + h) * hd + e] = o;
            }
        }
    free(q), free(k), free(v), free(s);
}

/* MLA without absorption: each head's k_nope and v are expanded from the latent per position. */
static inline void nv_attn_mla(const kvb_pd_config_t *c, const kvb__model_layer_t *w,
                               const float *xn, size_t n, float *out)
{
    size_t H = c->hidden, nh = c->n_heads, R = c->kv_lora_rank, rd = c->rope_dim;
    size_t nd = c->nope_dim, vd = c->v_head_dim, qd = nd + rd;
    float *q = calloc(n * nh * qd, 4), *lat = calloc(n * (R + rd), 4), *s = calloc(n, 4);
    float *kn = calloc(n * nd, 4), *v = calloc(n * vd, 4);
    for (size_t p = 0; p < n; p++) {
        nv_matvec(q + p * nh * qd, w->wq, xn + p * H, nh * qd, H);
        for (size_t h = 0; h < nh; h++)
            nv_rope(q + (p * nh + h) * qd + nd, rd, p, c->rope_theta);
        float *l = lat + p * (R + rd);
        nv_matvec(l, w->wkv_a, xn + p * H, R + rd, H);
        nv_rmsnorm(l, l, w->kv_norm, R, c->norm_eps);
        nv_rope(l + R, rd, p, c->rope_theta);
    }
    for (size_t h = 0; h < nh; h++) {
        for (size_t j = 0; j < n; j++) {
            nv_matvec(kn + j * nd, w->wk_b + h * nd * R, lat + j * (R + rd), nd, R);
            nv_matvec(v + j * vd, w->wv_b + h * vd * R, lat + j * (R + rd), vd, R);
        }
        for (size_t p = 0; p < n; p++) {
            const float *qh = q + (p * nh + h) * qd;
            float max = -INFINITY, sum = 0.0f;
            for (size_t j = 0; j <= p; j++) {
                float d = 0.0f;
                for (size_t e = 0; e < nd; e++)
                    d += qh[e] * kn[j * nd + e];
                for (size_t e = 0; e < rd; e++)
                    d += qh[nd + e] * lat[j * (R + rd) + R + e];
                s[j] = d / sqrtf((float)qd);
                max = fmaxf(max, s[j]);
            }
            for (size_t j = 0; j <= p; j++)
                sum += (s[j] = expf(s[j] - max));
            for (size_t e = 0; e < vd; e++) {
                float o = 0.0f;
                for (size_t j = 0; j <= p; j++)
                    o += s[j] / sum * v[j * vd + e];
                out[(p * nh + h) * vd + e] = o;
            }
        }
    }
    free(q), free(lat), free(s), free(kn), free(v);
}

/* Logits of every position of toks[0..n): logits[p * vocab ..]. */
static inline void fx_naive(const kvb_pd_model_t *m, const uint32_t *toks, size_t n, float *logits)
{
    const kvb_pd_config_t *c = &m->cfg;
    size_t H = c->hidden, F = c->ffn, nh = c->n_heads;
    size_t dv = c->attn == KVB_KV_ATTN_GQA ? c->head_dim : c->v_head_dim;
    float *x = calloc(n * H, 4), *xn = calloc(n * H, 4), *att = calloc(n * nh * dv, 4);
    float *tmp = calloc(H, 4), *g = calloc(F, 4), *u = calloc(F, 4);
    for (size_t p = 0; p < n; p++)
        memcpy(x + p * H, m->tok_embd + toks[p] * H, H * 4);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const kvb__model_layer_t *w = &m->layers[l];
        for (size_t p = 0; p < n; p++)
            nv_rmsnorm(xn + p * H, x + p * H, w->attn_norm, H, c->norm_eps);
        if (c->attn == KVB_KV_ATTN_GQA)
            nv_attn_gqa(c, w, xn, n, att);
        else
            nv_attn_mla(c, w, xn, n, att);
        for (size_t p = 0; p < n; p++) {
            nv_matvec(tmp, w->wo, att + p * nh * dv, H, nh * dv);
            for (size_t i = 0; i < H; i++)
                x[p * H + i] += tmp[i];
            nv_rmsnorm(xn + p * H, x + p * H, w->ffn_norm, H, c->norm_eps);
            nv_matvec(g, w->ffn_gate, xn + p * H, F, H);
            nv_matvec(u, w->ffn_up, xn + p * H, F, H);
            for (size_t i = 0; i < F; i++)
                g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            nv_matvec(tmp, w->ffn_down, g, H, F);
            for (size_t i = 0; i < H; i++)
                x[p * H + i] += tmp[i];
        }
    }
    for (size_t p = 0; p < n; p++) {
        nv_rmsnorm(tmp, x + p * H, m->out_norm, H, c->norm_eps);
        nv_matvec(logits + p * c->vocab, m->lm_head, tmp, c->vocab, H);
    }
    free(x), free(xn), free(att), free(tmp), free(g), free(u);
}

/* Largest |a - b| over n floats. */
static inline float fx_maxdiff(const float *a, const float *b, size_t n)
{
    float d = 0.0f;
    for (size_t i = 0; i < n; i++)
        d = fmaxf(d, fabsf(a[i] - b[i]));
    return d;
}

#endif
