/* SPDX-License-Identifier: Apache-2.0 */
/* The forward pass: GQA or MLA attention over the paged cache of every TP rank, SwiGLU MLP, and
 * the lm_head. A TP-N pass runs its ranks in N threads at once (the caller is rank 0): each writes
 * and reads only its own cache and computes only its own query heads, and their per-head output
 * contributions are summed in global head order after a barrier, which is what makes the logits
 * bitwise independent of the TP size. The MLP and lm_head are shared out among the threads by
 * token or by output row: every value is still one dot product of the same inputs, so how the
 * work is split changes no bit either. */
#include "pd/model/internal.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

#define INVAL KVB_ERR_INVALID_ARG
#define CHUNK 64 /* tokens whose head contributions are held at once */

/* One call's state and scratch buffers. */
typedef struct {
    const kvb_pd_model_t *m;
    const kvb_pd_config_t *c;
    kvb_pd_cache_t *const *caches;
    uint32_t tp;
    const uint64_t *blocks;    /* the sequence's block table */
    kvb_pd_seq_t *const *seqs; /* a batched step: token t is the next of seqs[t]; else NULL */
    float *const *blogits;     /* a batched step: every token's logits */
    uint32_t tpb;
    uint32_t pos0;      /* position of the first new token */
    size_t n;           /* new tokens */
    float *x, *xn;      /* [n][hidden]: residual stream, normed input */
    float *cosv, *sinv; /* [n][rope_dim / 2] */
    /* Rank-private scratch (each rank thread has its own). */
    float *q, *qlat, *kv, *scores, *hout, *vout, *sum, *ffn, *xt;
    float *contrib; /* [chunk][n_heads][hidden]: each query head's share of the attention output */
    size_t chunk;   /* tokens whose contributions are held at once */
    size_t max_len; /* the longest attention span of a new token */
    /* Shared by the rank threads of one pass (all NULL/0 when tp is 1). */
    pthread_barrier_t *bar;
    float *mlp_xn, *mlp_ffn; /* row-split MLP (fewer tokens than ranks): the normed input, gate */
} fwd_t;

float kvb__model_dot(const float *a, const float *b, size_t n)
{
    /* Eight independent partial sums, combined in a fixed tree: the compiler may vectorise the
     * lanes, which never changes a lane's result, so the value depends only on the inputs. */
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float *x = a + i, *y = b + i;
        s0 += x[0] * y[0];
        s1 += x[1] * y[1];
        s2 += x[2] * y[2];
        s3 += x[3] * y[3];
        s4 += x[4] * y[4];
        s5 += x[5] * y[5];
        s6 += x[6] * y[6];
        s7 += x[7] * y[7];
    }
    float t = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

void kvb__model_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps)
{
    float r = 1.0f / sqrtf(kvb__model_dot(x, x, n) / (float)n + eps);
    for (uint32_t i = 0; i < n; i++)
        out[i] = x[i] * r * w[i];
}

/* out[i] = W[i] . x for rows i of a [rows][cols] matrix. */
static void matvec(float *out, const float *w, const float *x, size_t rows, size_t cols)
{
    for (size_t i = 0; i < rows; i++)
        out[i] = kvb__model_dot(w + i * cols, x, cols);
}

static uint32_t rope_dim(const kvb_pd_config_t *c)
{
    return c->attn == KVB_KV_ATTN_GQA ? c->head_dim : c->rope_dim;
}

/* Token t's block table and position: its own sequence's in a batched step. */
static const uint64_t *tok_blocks(const fwd_t *f, size_t t)
{
    return f->seqs ? f->seqs[t]->blocks : f->blocks;
}

static uint32_t tok_pos(const fwd_t *f, size_t t)
{
    return f->seqs ? f->seqs[t]->len : f->pos0 + (uint32_t)t;
}

/* cos and sin of every new position's angles, computed in double and rounded once. */
static void rope_tables(fwd_t *f)
{
    uint32_t d = rope_dim(f->c), half = d / 2;
    for (size_t t = 0; t < f->n; t++)
        for (uint32_t i = 0; i < half; i++) {
            double inv = pow((double)f->c->rope_theta, -2.0 * i / d);
            double a = (double)tok_pos(f, t) * inv;
            f->cosv[t * half + i] = (float)cos(a);
            f->sinv[t * half + i] = (float)sin(a);
        }
}

/* NeoX-style rotation of v[0..rope_dim) for new token t. */
static void rope(const fwd_t *f, float *v, size_t t)
{
    uint32_t half = rope_dim(f->c) / 2;
    const float *cs = f->cosv + t * half, *sn = f->sinv + t * half;
    for (uint32_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = a * sn[i] + b * cs[i];
    }
}

/* Where position p's row of `slot` (0..2*layers) starts in a rank's cache; for GQA, `head` is
 * the rank-local KV head (HND: heads outermost within the block). */
static float *cache_row(const fwd_t *f, const kvb_pd_cache_t *c, const uint64_t *blocks,
                        size_t slot, uint32_t pos, uint32_t head)
{
    float *base = (float *)(void *)(c->mem + slot * c->slot_bytes);
    uint64_t block = blocks[pos / f->tpb];
    size_t row = (size_t)head * f->tpb + pos % f->tpb;
    return base + (size_t)block * c->block_floats + row * c->token_floats;
}

/* In-place softmax of s[0..n) with a sequential sum. */
static void softmax(float *s, size_t n)
{
    float max = s[0], sum = 0.0f;
    for (size_t i = 1; i < n; i++)
        max = s[i] > max ? s[i] : max;
    for (size_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    for (size_t i = 0; i < n; i++)
        s[i] /= sum;
}

/* ---- Cache writes ---------------------------------------------------------------------------- */

/* GQA: rank r computes and stores the K and V of the KV heads it holds. */
static void write_gqa(fwd_t *f, uint32_t l, uint32_t r)
{
    const kvb__model_layer_t *w = &f->m->layers[l];
    uint32_t hd = f->c->head_dim, H = f->c->hidden;
    const kvb_pd_cache_t *c = f->caches[r];
    for (size_t t = 0; t < f->n; t++) {
        uint32_t pos = tok_pos(f, t);
        const uint64_t *bt = tok_blocks(f, t);
        for (uint32_t j = 0; j < c->heads_held; j++) {
            size_t g = (size_t)r * c->heads_held + j;
            float *k = cache_row(f, c, bt, 2 * (size_t)l, pos, j);
            matvec(k, w->wk + g * hd * H, f->xn + t * H, hd, H);
            rope(f, k, t);
            matvec(cache_row(f, c, bt, 2 * (size_t)l + 1, pos, j), w->wv + g * hd * H,
                   f->xn + t * H, hd, H);
        }
    }
}

/* MLA: the latent and the shared RoPE key of the tokens rank r takes (t = r mod tp), computed
 * once and stored on every rank (replicated compute in a real deployment gives the same bits). */
static void write_mla(fwd_t *f, uint32_t l, uint32_t r)
{
    const kvb__model_layer_t *w = &f->m->layers[l];
    uint32_t rank = f->c->kv_lora_rank, H = f->c->hidden;
    size_t row = rank + f->c->rope_dim;
    for (size_t t = r; t < f->n; t += f->tp) {
        matvec(f->kv, w->wkv_a, f->xn + t * H, row, H);
        kvb__model_rmsnorm(f->kv, f->kv, w->kv_norm, rank, f->c->norm_eps);
        rope(f, f->kv + rank, t);
        for (uint32_t k = 0; k < f->tp; k++)
            memcpy(cache_row(f, f->caches[k], tok_blocks(f, t), l, tok_pos(f, t), 0), f->kv,
                   row * sizeof(float));
    }
}

/* ---- Attention heads ------------------------------------------------------------------------- */

/* Query head h of rank r (which holds KV head h / group) for new token t: its output through
 * h's columns of wo, into `out` (hidden floats). */
static void head_gqa(fwd_t *f, uint32_t l, uint32_t r, uint32_t h, size_t t, float *out)
{
    const kvb__model_layer_t *w = &f->m->layers[l];
    const kvb_pd_cache_t *c = f->caches[r];
    uint32_t hd = f->c->head_dim, H = f->c->hidden, nh = f->c->n_heads;
    uint32_t j = h / (nh / f->c->n_kv_heads) - r * c->heads_held;
    size_t len = (size_t)tok_pos(f, t) + 1;
    const uint64_t *bt = tok_blocks(f, t);
    float scale = 1.0f / sqrtf((float)hd);
    matvec(f->q, w->wq + (size_t)h * hd * H, f->xn + t * H, hd, H);
    rope(f, f->q, t);
    for (size_t p = 0; p < len; p++)
        f->scores[p] =
            kvb__model_dot(f->q, cache_row(f, c, bt, 2 * (size_t)l, (uint32_t)p, j), hd) * scale;
    softmax(f->scores, len);
    memset(f->hout, 0, hd * sizeof(float));
    for (size_t p = 0; p < len; p++) {
        const float *v = cache_row(f, c, bt, 2 * (size_t)l + 1, (uint32_t)p, j);
        for (uint32_t d = 0; d < hd; d++)
            f->hout[d] += f->scores[p] * v[d];
    }
    for (uint32_t i = 0; i < H; i++)
        out[i] = kvb__model_dot(w->wo + (size_t)i * nh * hd + (size_t)h * hd, f->hout, hd);
}

/* MLA head h for new token t, in the absorbed form: the query is taken into latent space through
 * wk_b[h], the softmax-weighted latent out through wv_b[h]. */
static void head_mla(fwd_t *f, uint32_t l, uint32_t r, uint32_t h, size_t t, float *out)
{
    const kvb__model_layer_t *w = &f->m->layers[l];
    const kvb_pd_cache_t *c = f->caches[r];
    uint32_t nope = f->c->nope_dim, rd = f->c->rope_dim, rank = f->c->kv_lora_rank;
    uint32_t vd = f->c->v_head_dim, H = f->c->hidden, nh = f->c->n_heads;
    size_t len = (size_t)tok_pos(f, t) + 1;
    const uint64_t *bt = tok_blocks(f, t);
    float scale = 1.0f / sqrtf((float)(nope + rd));
    matvec(f->q, w->wq + (size_t)h * (nope + rd) * H, f->xn + t * H, nope + rd, H);
    rope(f, f->q + nope, t);
    memset(f->qlat, 0, rank * sizeof(float));
    for (uint32_t i = 0; i < nope; i++) {
        const float *wk = w->wk_b + ((size_t)h * nope + i) * rank;
        for (uint32_t k = 0; k < rank; k++)
            f->qlat[k] += f->q[i] * wk[k];
    }
    for (size_t p = 0; p < len; p++) {
        const float *lat = cache_row(f, c, bt, l, (uint32_t)p, 0);
        f->scores[p] =
            (kvb__model_dot(f->qlat, lat, rank) + kvb__model_dot(f->q + nope, lat + rank, rd)) *
            scale;
    }
    softmax(f->scores, len);
    memset(f->hout, 0, rank * sizeof(float));
    for (size_t p = 0; p < len; p++) {
        const float *lat = cache_row(f, c, bt, l, (uint32_t)p, 0);
        for (uint32_t k = 0; k < rank; k++)
            f->hout[k] += f->scores[p] * lat[k];
    }
    matvec(f->vout, w->wv_b + (size_t)h * vd * rank, f->hout, vd, rank);
    for (uint32_t i = 0; i < H; i++)
        out[i] = kvb__model_dot(w->wo + (size_t)i * nh * vd + (size_t)h * vd, f->vout, vd);
}

/* Waits for every rank thread of the pass (nothing to wait for at TP 1). */
static void rank_sync(fwd_t *f)
{
    if (f->bar)
        pthread_barrier_wait(f->bar);
}

/* Attention of every new token: rank r computes its query heads of a chunk of tokens; then, the
 * chunk complete, each token's contributions are summed in global head order (the TP-invariant
 * "all-reduce") and added to the residual, the tokens shared out among the ranks. */
static void attention(fwd_t *f, uint32_t l, uint32_t r)
{
    uint32_t H = f->c->hidden, nh = f->c->n_heads, per_rank = nh / f->tp;
    for (size_t c0 = 0; c0 < f->n; c0 += f->chunk) {
        size_t cn = f->n - c0 < f->chunk ? f->n - c0 : f->chunk;
        for (size_t t = c0; t < c0 + cn; t++)
            for (uint32_t h = r * per_rank; h < (r + 1) * per_rank; h++) {
                float *out = f->contrib + ((t - c0) * nh + h) * H;
                if (f->c->attn == KVB_KV_ATTN_GQA)
                    head_gqa(f, l, r, h, t, out);
                else
                    head_mla(f, l, r, h, t, out);
            }
        rank_sync(f);
        for (size_t t = c0 + r; t < c0 + cn; t += f->tp) {
            const float *ct = f->contrib + (t - c0) * nh * H;
            memcpy(f->sum, ct, H * sizeof(float));
            for (uint32_t h = 1; h < nh; h++)
                for (uint32_t i = 0; i < H; i++)
                    f->sum[i] += ct[(size_t)h * H + i];
            for (uint32_t i = 0; i < H; i++)
                f->x[t * H + i] += f->sum[i];
        }
        rank_sync(f); /* contrib is reused by the next chunk */
    }
}

/* The MLP of token t, whole, in rank-private scratch (xn and ffn are this rank's). */
static void mlp_token(fwd_t *f, const kvb__model_layer_t *w, size_t t)
{
    uint32_t H = f->c->hidden, F = f->c->ffn;
    float *gate = f->ffn, *up = f->ffn + F, *x = f->x + t * H;
    kvb__model_rmsnorm(f->xt, x, w->ffn_norm, H, f->c->norm_eps);
    matvec(gate, w->ffn_gate, f->xt, F, H);
    matvec(up, w->ffn_up, f->xt, F, H);
    for (uint32_t i = 0; i < F; i++)
        gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    for (uint32_t i = 0; i < H; i++)
        x[i] += kvb__model_dot(w->ffn_down + (size_t)i * F, gate, F);
}

/* Rows [lo, hi) of `rows` for rank r of tp: an even share, the remainder to the first ranks. */
static void share(uint32_t rows, uint32_t r, uint32_t tp, uint32_t *lo, uint32_t *hi)
{
    uint32_t base = rows / tp, extra = rows % tp;
    *lo = r * base + (r < extra ? r : extra);
    *hi = *lo + base + (r < extra);
}

/* The MLP of token t with its output rows shared out among the ranks (fewer tokens than ranks:
 * a decode step). */
static void mlp_rows(fwd_t *f, const kvb__model_layer_t *w, size_t t, uint32_t r)
{
    uint32_t H = f->c->hidden, F = f->c->ffn, lo, hi;
    float *x = f->x + t * H, *gate = f->mlp_ffn, *up = f->mlp_ffn + F;
    if (r == 0)
        kvb__model_rmsnorm(f->mlp_xn, x, w->ffn_norm, H, f->c->norm_eps);
    rank_sync(f);
    share(F, r, f->tp, &lo, &hi);
    matvec(gate + lo, w->ffn_gate + (size_t)lo * H, f->mlp_xn, hi - lo, H);
    matvec(up + lo, w->ffn_up + (size_t)lo * H, f->mlp_xn, hi - lo, H);
    for (uint32_t i = lo; i < hi; i++)
        gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    rank_sync(f);
    share(H, r, f->tp, &lo, &hi);
    for (uint32_t i = lo; i < hi; i++)
        x[i] += kvb__model_dot(w->ffn_down + (size_t)i * F, gate, F);
    rank_sync(f); /* x complete before the next token's norm */
}

static void mlp(fwd_t *f, uint32_t l, uint32_t r)
{
    const kvb__model_layer_t *w = &f->m->layers[l];
    if (f->n >= f->tp || !f->mlp_ffn) {
        for (size_t t = r; t < f->n; t += f->tp)
            mlp_token(f, w, t);
    } else {
        for (size_t t = 0; t < f->n; t++)
            mlp_rows(f, w, t, r);
    }
}

/* A batched step's logits, every token's: whole tokens per rank when there are enough of them,
 * else each token's rows shared out (the same dot products either way). */
static void batch_logits(fwd_t *f, uint32_t r)
{
    uint32_t H = f->c->hidden, V = f->c->vocab, lo, hi;
    if (f->n >= f->tp || !f->bar) {
        for (size_t t = r; t < f->n; t += f->tp) {
            kvb__model_rmsnorm(f->xt, f->x + t * H, f->m->out_norm, H, f->c->norm_eps);
            matvec(f->blogits[t], f->m->lm_head, f->xt, V, H);
        }
        return;
    }
    share(V, r, f->tp, &lo, &hi);
    for (size_t t = 0; t < f->n; t++) {
        if (r == 0)
            kvb__model_rmsnorm(f->mlp_xn, f->x + t * H, f->m->out_norm, H, f->c->norm_eps);
        rank_sync(f);
        matvec(f->blogits[t] + lo, f->m->lm_head + (size_t)lo * H, f->mlp_xn, hi - lo, H);
        rank_sync(f); /* mlp_xn is the next token's */
    }
}

/* Rank r's share of a pass; every rank runs it, rank 0 in the caller's thread. */
static void run_rank(fwd_t *f, uint32_t r, float *logits, const kvb_pd_hook_t *hook)
{
    uint32_t H = f->c->hidden;
    for (uint32_t l = 0; l < f->c->n_layers; l++) {
        for (size_t t = r; t < f->n; t += f->tp)
            kvb__model_rmsnorm(f->xn + t * H, f->x + t * H, f->m->layers[l].attn_norm, H,
                               f->c->norm_eps);
        rank_sync(f);
        if (f->c->attn == KVB_KV_ATTN_GQA)
            write_gqa(f, l, r);
        else
            write_mla(f, l, r);
        rank_sync(f);
        /* Every rank's cache holds the layer: the hook may send it while attention runs. */
        if (r == 0 && hook && hook->on_layer_done)
            hook->on_layer_done(l, hook->user);
        attention(f, l, r);
        mlp(f, l, r);
        rank_sync(f);
    }
    if (f->blogits) {
        batch_logits(f, r);
        return;
    }
    if (!logits)
        return;
    uint32_t lo, hi;
    if (r == 0)
        kvb__model_rmsnorm(f->xn, f->x + (f->n - 1) * H, f->m->out_norm, H, f->c->norm_eps);
    rank_sync(f);
    share(f->c->vocab, r, f->tp, &lo, &hi);
    matvec(logits + lo, f->m->lm_head + (size_t)lo * H, f->xn, hi - lo, H);
}

/* ---- Argument checks and scratch ------------------------------------------------------------- */

static int check_ranks(const kvb_pd_model_t *m, kvb_pd_cache_t *const *caches, uint32_t tp, char *r,
                       size_t cap)
{
    if (!caches || tp == 0)
        return kvb__fail(r, cap, INVAL, "no caches");
    for (uint32_t i = 0; i < tp; i++) {
        const kvb_pd_cache_t *c = caches[i];
        if (!c || c->model != m)
            return kvb__fail(r, cap, INVAL, "cache %u is missing or made for another model", i);
        if (c->tp_size != tp || c->tp_rank != i)
            return kvb__fail(r, cap, INVAL, "cache %u is rank %u of %u, not rank %u of %u", i,
                             c->tp_rank, c->tp_size, i, tp);
        if (c->tpb != caches[0]->tpb || c->num_blocks != caches[0]->num_blocks)
            return kvb__fail(r, cap, INVAL, "cache %u has another block geometry than rank 0", i);
    }
    return KVB_OK;
}

static int check_seq(const kvb_pd_model_t *m, const kvb_pd_cache_t *c0, const kvb_pd_seq_t *seq,
                     const uint32_t *tokens, size_t n, char *r, size_t cap)
{
    if (!seq || !tokens || n == 0)
        return kvb__fail(r, cap, INVAL, "no sequence or no tokens");
    for (size_t i = 0; i < n; i++)
        if (tokens[i] >= m->cfg.vocab)
            return kvb__fail(r, cap, INVAL, "token %zu is %u, outside the vocab of %u", i,
                             tokens[i], m->cfg.vocab);
    if (n > UINT32_MAX - seq->len)
        return kvb__fail(r, cap, INVAL, "sequence would pass 2^32 positions");
    uint64_t need = kvb_pd_blocks_for((uint64_t)seq->len + n, c0->tpb);
    if (need > seq->num_blocks || (need && !seq->blocks))
        return kvb__fail(r, cap, INVAL, "positions up to %llu need %llu blocks, the table has %zu",
                         (unsigned long long)seq->len + n, (unsigned long long)need,
                         seq->num_blocks);
    for (uint64_t i = 0; i < need; i++)
        if (seq->blocks[i] >= c0->num_blocks)
            return kvb__fail(r, cap, INVAL, "block table entry %llu is %llu, over the %llu blocks",
                             (unsigned long long)i, (unsigned long long)seq->blocks[i],
                             (unsigned long long)c0->num_blocks);
    return KVB_OK;
}

/* Allocates `count` floats (at least one) into *p; returns non-zero on overflow or no memory. */
static int falloc(float **p, size_t a, size_t b)
{
    size_t n;
    if (kvb__mul_size(a ? a : 1, b ? b : 1, &n) || kvb__mul_size(n, sizeof(float), &n))
        return -1;
    *p = malloc(n);
    return *p == NULL;
}

static void bufs_free(float **const *bufs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(*bufs[i]);
        *bufs[i] = NULL;
    }
}

#define PRIVATE_BUFS(f)                                                                            \
    {                                                                                              \
        &(f)->q, &(f)->qlat, &(f)->kv, &(f)->scores, &(f)->hout, &(f)->vout, &(f)->sum, &(f)->ffn, \
            &(f)->xt                                                                               \
    }
#define SHARED_BUFS(f)                                                                             \
    {                                                                                              \
        &(f)->x, &(f)->xn, &(f)->cosv, &(f)->sinv, &(f)->contrib, &(f)->mlp_xn, &(f)->mlp_ffn      \
    }

static void private_free(fwd_t *f)
{
    float **const bufs[] = PRIVATE_BUFS(f);
    bufs_free(bufs, sizeof bufs / sizeof bufs[0]);
}

static void shared_free(fwd_t *f)
{
    float **const bufs[] = SHARED_BUFS(f);
    bufs_free(bufs, sizeof bufs / sizeof bufs[0]);
}

/* What one rank needs for itself. */
static int private_alloc(fwd_t *f)
{
    const kvb_pd_config_t *c = f->c;
    size_t qd = c->attn == KVB_KV_ATTN_GQA ? c->head_dim : (size_t)c->nope_dim + c->rope_dim;
    size_t hd = c->attn == KVB_KV_ATTN_GQA ? c->head_dim : c->kv_lora_rank;
    int bad = falloc(&f->q, qd, 1) | falloc(&f->qlat, c->kv_lora_rank, 1) |
              falloc(&f->kv, (size_t)c->kv_lora_rank + c->rope_dim, 1) |
              falloc(&f->scores, f->max_len, 1) | falloc(&f->hout, hd, 1) |
              falloc(&f->vout, c->v_head_dim, 1) | falloc(&f->sum, c->hidden, 1) |
              falloc(&f->ffn, c->ffn, 2) | falloc(&f->xt, c->hidden, 1);
    if (bad)
        private_free(f);
    return bad;
}

/* What the ranks share: the residual stream, normed inputs, RoPE tables, head contributions. */
static int shared_alloc(fwd_t *f)
{
    const kvb_pd_config_t *c = f->c;
    f->chunk = f->n < CHUNK ? f->n : CHUNK;
    int bad = falloc(&f->x, f->n, c->hidden) | falloc(&f->xn, f->n, c->hidden) |
              falloc(&f->cosv, f->n, rope_dim(c) / 2) | falloc(&f->sinv, f->n, rope_dim(c) / 2) |
              falloc(&f->contrib, f->chunk * c->n_heads, c->hidden) |
              falloc(&f->mlp_xn, c->hidden, 1) | falloc(&f->mlp_ffn, c->ffn, 2);
    if (bad)
        shared_free(f);
    return bad;
}

/* ---- Rank threads ---------------------------------------------------------------------------- */

/* A pass's rank threads start together or not at all: each waits at the gate until every one was
 * created (then they meet at the barrier) or one could not be (then they all leave). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state; /* 0 wait, 1 go, -1 leave */
} gate_t;

typedef struct {
    fwd_t f; /* the rank's view: shared buffers, its own scratch */
    uint32_t r;
    gate_t *gate;
    float *logits;
} rank_job_t;

static void *rank_main(void *arg)
{
    rank_job_t *j = arg;
    pthread_mutex_lock(&j->gate->mu);
    while (!j->gate->state)
        pthread_cond_wait(&j->gate->cv, &j->gate->mu);
    int go = j->gate->state > 0;
    pthread_mutex_unlock(&j->gate->mu);
    if (go)
        run_rank(&j->f, j->r, j->logits, NULL);
    return NULL;
}

static void gate_open(gate_t *g, int state)
{
    pthread_mutex_lock(&g->mu);
    g->state = state;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Runs ranks 1..tp-1 in threads of their own and rank 0 here. */
static int run_parallel(fwd_t *f, float *logits, const kvb_pd_hook_t *hook)
{
    uint32_t tp = f->tp, started = 0;
    rank_job_t *jobs = calloc(tp, sizeof *jobs);
    pthread_t *th = calloc(tp, sizeof *th);
    pthread_barrier_t bar;
    gate_t gate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    int rc = jobs && th && !pthread_barrier_init(&bar, NULL, tp) ? KVB_OK : KVB_ERR_NOMEM;
    f->bar = rc ? NULL : &bar;
    for (uint32_t r = 1; !rc && r < tp; r++) {
        jobs[r] = (rank_job_t){.f = *f, .r = r, .gate = &gate, .logits = logits};
        float **const bufs[] = PRIVATE_BUFS(&jobs[r].f);
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            *bufs[i] = NULL;
        if (private_alloc(&jobs[r].f))
            rc = KVB_ERR_NOMEM;
        else if (pthread_create(&th[r], NULL, rank_main, &jobs[r]))
            rc = KVB_ERR_SYSTEM;
        else
            started = r;
    }
    gate_open(&gate, rc ? -1 : 1);
    if (!rc)
        run_rank(f, 0, logits, hook);
    for (uint32_t r = 1; r <= started; r++)
        pthread_join(th[r], NULL);
    for (uint32_t r = 1; jobs && r < tp; r++)
        private_free(&jobs[r].f);
    if (f->bar)
        pthread_barrier_destroy(&bar);
    f->bar = NULL;
    free(jobs);
    free(th);
    return rc;
}

/* Runs a prepared pass (f's inputs set) over `tokens`: scratch, embeddings, the ranks. */
static int forward(fwd_t *f, const uint32_t *tokens, float *logits, const kvb_pd_hook_t *hook,
                   char *r, size_t cap)
{
    if (shared_alloc(f))
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory for %zu tokens", f->n);
    if (private_alloc(f)) {
        shared_free(f);
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory for %zu tokens", f->n);
    }
    uint32_t H = f->c->hidden;
    int rc = KVB_OK;
    rope_tables(f);
    for (size_t t = 0; t < f->n; t++)
        memcpy(f->x + t * H, f->m->tok_embd + (size_t)tokens[t] * H, H * sizeof(float));
    if (f->tp == 1)
        run_rank(f, 0, logits, hook);
    else
        rc = run_parallel(f, logits, hook);
    private_free(f);
    shared_free(f);
    if (rc)
        return kvb__fail(r, cap, rc, "cannot start the rank threads of a TP-%u pass", f->tp);
    return KVB_OK;
}

int kvb_pd_forward(const kvb_pd_model_t *model, kvb_pd_cache_t *const *caches, uint32_t tp,
                   kvb_pd_seq_t *seq, const uint32_t *tokens, size_t n_tokens, float *logits,
                   const kvb_pd_hook_t *hook, char *r, size_t cap)
{
    int rc;
    if (!model)
        return kvb__fail(r, cap, INVAL, "model is NULL");
    if ((rc = check_ranks(model, caches, tp, r, cap)) ||
        (rc = check_seq(model, caches[0], seq, tokens, n_tokens, r, cap)))
        return rc;
    fwd_t f = {.m = model,
               .c = &model->cfg,
               .caches = caches,
               .tp = tp,
               .blocks = seq->blocks,
               .tpb = caches[0]->tpb,
               .pos0 = seq->len,
               .n = n_tokens,
               .max_len = (size_t)seq->len + n_tokens};
    if ((rc = forward(&f, tokens, logits, hook, r, cap)))
        return rc;
    seq->len += (uint32_t)n_tokens;
    kvb__reason_clear(r, cap);
    return KVB_OK;
}

int kvb_pd_forward_batch(const kvb_pd_model_t *model, kvb_pd_cache_t *const *caches, uint32_t tp,
                         kvb_pd_seq_t *const *seqs, const uint32_t *tokens, size_t n,
                         float *const *logits, char *r, size_t cap)
{
    int rc;
    if (!model)
        return kvb__fail(r, cap, INVAL, "model is NULL");
    if (!seqs || !logits || n == 0)
        return kvb__fail(r, cap, INVAL, "no sequences");
    if ((rc = check_ranks(model, caches, tp, r, cap)))
        return rc;
    size_t max_len = 0;
    for (size_t i = 0; i < n; i++) {
        if (!logits[i])
            return kvb__fail(r, cap, INVAL, "no logits buffer for sequence %zu", i);
        if ((rc = check_seq(model, caches[0], seqs[i], &tokens[i], 1, r, cap)))
            return rc;
        for (size_t k = 0; k < i; k++)
            if (seqs[k] == seqs[i])
                return kvb__fail(r, cap, INVAL, "sequence %zu is also sequence %zu", i, k);
        max_len = seqs[i]->len + 1 > max_len ? seqs[i]->len + 1 : max_len;
    }
    fwd_t f = {.m = model,
               .c = &model->cfg,
               .caches = caches,
               .tp = tp,
               .seqs = seqs,
               .blogits = logits,
               .tpb = caches[0]->tpb,
               .n = n,
               .max_len = max_len};
    if ((rc = forward(&f, tokens, NULL, NULL, r, cap)))
        return rc;
    for (size_t i = 0; i < n; i++)
        seqs[i]->len++;
    kvb__reason_clear(r, cap);
    return KVB_OK;
}
