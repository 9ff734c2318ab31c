/* SPDX-License-Identifier: Apache-2.0 */
/* The byte-level tokenizer, the sampler (greedy, or temperature with a stateless seeded draw per
 * step so that a decode instance continues a prefill's stream), and colocated generation. */
#include "pd/model/internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define INVAL KVB_ERR_INVALID_ARG

int kvb_pd_tokenize(const char *text, size_t len, bool add_bos, uint32_t *out, size_t cap,
                    size_t *n)
{
    if ((len && !text) || (cap && !out) || !n || len > SIZE_MAX - 1)
        return INVAL;
    size_t total = len + (add_bos ? 1 : 0), k = 0;
    if (add_bos && k < cap)
        out[k++] = KVB_PD_BOS;
    for (size_t i = 0; i < len && k < cap; i++)
        out[k++] = (unsigned char)text[i];
    *n = total;
    return total > cap ? KVB_ERR_TOO_LARGE : KVB_OK;
}

size_t kvb_pd_detokenize(const uint32_t *tokens, size_t n, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] > 255)
            continue;
        if (k < cap)
            out[k] = (char)tokens[i];
        k++;
    }
    return k;
}

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The largest logit, lowest id first; NaN never wins. */
static uint32_t argmax(const float *logits, uint32_t vocab)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best] || isnan(logits[best]))
            best = isnan(logits[i]) ? best : i;
    return best;
}

int kvb_pd_sample(const float *logits, uint32_t vocab, float temperature, uint64_t seed,
                  uint64_t step, uint32_t *token)
{
    if (!logits || !token || vocab == 0 || !(temperature >= 0.0f))
        return INVAL;
    uint32_t best = argmax(logits, vocab);
    float max = logits[best];
    if (temperature == 0.0f || !isfinite(max) || isinf(temperature)) {
        *token = best;
        return KVB_OK;
    }
    double total = 0.0;
    for (uint32_t i = 0; i < vocab; i++)
        total += isnan(logits[i]) ? 0.0 : exp(((double)logits[i] - max) / temperature);
    double u = (double)(mix(seed + (step + 1) * 0x9e3779b97f4a7c15ull) >> 11) * 0x1p-53;
    double target = u * total, run = 0.0;
    for (uint32_t i = 0; i < vocab; i++) {
        run += isnan(logits[i]) ? 0.0 : exp(((double)logits[i] - max) / temperature);
        if (run > target) {
            *token = i;
            return KVB_OK;
        }
    }
    *token = best; /* rounding left target at the very top: the argmax is as good as any */
    return KVB_OK;
}

/* ---- Colocated generation -------------------------------------------------------------------- */

typedef struct {
    kvb_pd_cache_t **caches;
    kvb_pd_blocks_t *pool;
    kvb_pd_seq_t seq;
    float *logits;
    uint32_t tp;
} gen_t;

static void gen_free(gen_t *g)
{
    if (g->caches)
        for (uint32_t r = 0; r < g->tp; r++)
            kvb_pd_cache_destroy(g->caches[r]);
    free(g->caches);
    kvb_pd_seq_release(&g->seq, g->pool);
    kvb_pd_blocks_destroy(g->pool);
    free(g->logits);
}

static int gen_setup(gen_t *g, const kvb_pd_model_t *m, uint32_t tpb, uint64_t tokens, char *r,
                     size_t cap)
{
    uint64_t nb = kvb_pd_blocks_for(tokens, tpb);
    g->caches = calloc(g->tp, sizeof *g->caches);
    g->logits = malloc((size_t)m->cfg.vocab * sizeof(float));
    if (!g->caches || !g->logits || kvb_pd_blocks_create(nb, &g->pool))
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; i < g->tp; i++) {
        int rc = kvb_pd_cache_create(m, g->tp, i, nb, tpb, NULL, &g->caches[i], r, cap);
        if (rc)
            return rc;
    }
    if (kvb_pd_seq_reserve(&g->seq, g->pool, tpb, tokens))
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    return KVB_OK;
}

int kvb_pd_generate(const kvb_pd_model_t *model, const kvb_pd_gen_opts_t *o, const uint32_t *prompt,
                    size_t n_prompt, uint32_t *out, size_t *n_out, char *r, size_t cap)
{
    if (!model || !o || !prompt || n_prompt == 0 || (o->max_tokens && !out) || !n_out)
        return kvb__fail(r, cap, INVAL, "missing model, options, prompt or output");
    if (n_prompt > UINT32_MAX - (uint64_t)o->max_tokens)
        return kvb__fail(r, cap, INVAL, "prompt too long");
    uint32_t tpb = o->tokens_per_block ? o->tokens_per_block : KVB_PD_TOKENS_PER_BLOCK;
    gen_t g = {.tp = o->tp ? o->tp : 1};
    kvb_pd_seq_init(&g.seq);
    size_t n = 0;
    int rc = gen_setup(&g, model, tpb, n_prompt + o->max_tokens, r, cap);
    if (!rc && o->max_tokens)
        rc =
            kvb_pd_forward(model, g.caches, g.tp, &g.seq, prompt, n_prompt, g.logits, NULL, r, cap);
    while (!rc && n < o->max_tokens) {
        uint32_t tok;
        if ((rc = kvb_pd_sample(g.logits, model->cfg.vocab, o->temperature, o->seed, n, &tok))) {
            kvb__fail(r, cap, rc, "bad temperature %g", (double)o->temperature);
            break;
        }
        out[n++] = tok;
        if (tok == KVB_PD_EOS || n == o->max_tokens)
            break;
        rc = kvb_pd_forward(model, g.caches, g.tp, &g.seq, &tok, 1, g.logits, NULL, r, cap);
    }
    gen_free(&g);
    if (rc)
        return rc;
    *n_out = n;
    return KVB_OK;
}
