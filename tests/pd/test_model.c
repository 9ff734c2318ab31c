/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the forward pass (src/pd/model/model.c): logits bitwise the same for every TP size,
 * prefill and step-by-step decode through the paged cache bitwise equal to recomputing everything,
 * both close to an independent naive implementation, the per-layer hook, and refused arguments. */
#include "pd_fixture.h"

#define MAXTOK 160

TestSuite(model, .timeout = 60);

/* Prefill `np` prompt tokens then `steps` greedy decode steps on a TP-tp instance whose table is
 * permuted by `perm`; stores the logits after the prefill and after each step. */
static void run_seq(const kvb_pd_model_t *m, uint32_t tp, uint32_t tpb, uint64_t perm,
                    const uint32_t *prompt, size_t np, size_t steps, float *logits)
{
    fx_inst_t in;
    uint32_t V = kvb_pd_model_config(m)->vocab;
    tpb = tpb ? tpb : KVB_PD_TOKENS_PER_BLOCK;
    uint64_t nb = kvb_pd_blocks_for(np + steps, tpb) + 3, table[MAXTOK];
    fx_inst(&in, m, tp, nb, tpb);
    fx_table(table, nb, perm, 2, nb);
    kvb_pd_seq_t seq = {.blocks = table, .num_blocks = nb};
    fx_forward(&in, &seq, prompt, np, logits);
    for (size_t s = 0; s < steps; s++) {
        uint32_t tok;
        cr_assert_eq(kvb_pd_sample(logits + s * V, V, 0.0f, 0, s, &tok), KVB_OK);
        fx_forward(&in, &seq, &tok, 1, logits + (s + 1) * V);
    }
    cr_assert_eq(seq.len, np + steps);
    fx_inst_free(&in);
}

static void check_tp_invariant(const kvb_pd_model_t *m, const uint32_t *tps, size_t ntp,
                               uint32_t tpb, size_t np, size_t steps)
{
    uint32_t V = kvb_pd_model_config(m)->vocab, prompt[MAXTOK];
    size_t n = (steps + 1) * V;
    float *ref = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    fx_prompt(prompt, np, 3);
    run_seq(m, tps[0], tpb, 1, prompt, np, steps, ref);
    for (size_t i = 1; i < ntp; i++) {
        run_seq(m, tps[i], tpb, 5, prompt, np, steps, got);
        cr_assert(!memcmp(ref, got, n * sizeof(float)),
                  "%s: TP %u differs from TP %u (max diff %g)", kvb_pd_model_id(m), tps[i], tps[0],
                  (double)fx_maxdiff(ref, got, n));
    }
    free(ref);
    free(got);
}

Test(model, tp_invariant_presets)
{
    const uint32_t tps[] = {1, 2, 4};
    const char *presets[] = {"tiny-gqa", "tiny-mla"};
    for (size_t p = 0; p < 2; p++) {
        kvb_pd_model_t *m = fx_preset(presets[p], 7);
        check_tp_invariant(m, tps, 3, 4, 9, 2); /* 4-token blocks: 3 boundaries in 11 */
        kvb_pd_model_free(m);
    }
}

Test(model, tp_invariant_mini)
{
    const uint32_t gqa_tps[] = {1, 2, 4}, mla_tps[] = {1, 2, 4, 8};
    kvb_pd_config_t g = fx_mini(KVB_KV_ATTN_GQA), a = fx_mini(KVB_KV_ATTN_MLA);
    kvb_pd_model_t *mg = fx_model_cfg(&g, 1), *ma = fx_model_cfg(&a, 2);
    check_tp_invariant(mg, gqa_tps, 3, 4, 13, 6);
    check_tp_invariant(ma, mla_tps, 4, 4, 13, 6);
    /* MHA (as many KV heads as query heads) is GQA with group 1. */
    g.n_kv_heads = 8;
    kvb_pd_model_t *mh = fx_model_cfg(&g, 3);
    const uint32_t mha_tps[] = {1, 8, 2};
    check_tp_invariant(mh, mha_tps, 3, 16, 20, 3);
    kvb_pd_model_free(mg);
    kvb_pd_model_free(ma);
    kvb_pd_model_free(mh);
}

/* A TP-N pass runs its ranks in N threads: a prompt of more tokens than the head contributions
 * held at once (64) is summed chunk by chunk, and a single-token step (fewer tokens than ranks)
 * shares out the MLP's rows; both must stay bitwise what TP 1 computes. */
Test(model, tp_threads_long_prompt_and_steps)
{
    const uint32_t tps[] = {1, 2, 4};
    kvb_pd_config_t g = fx_mini(KVB_KV_ATTN_GQA), a = fx_mini(KVB_KV_ATTN_MLA);
    kvb_pd_model_t *mg = fx_model_cfg(&g, 4), *ma = fx_model_cfg(&a, 5);
    check_tp_invariant(mg, tps, 3, 16, 150, 3);
    check_tp_invariant(ma, tps, 3, 16, 129, 3);
    kvb_pd_model_free(mg);
    kvb_pd_model_free(ma);
}

/* Decoding token by token must give bitwise the logits of one prefill over the whole sequence,
 * on another instance with another block table: the cache append and block boundaries are exact. */
static void check_incremental(const kvb_pd_model_t *m, size_t np, size_t steps)
{
    uint32_t V = kvb_pd_model_config(m)->vocab, seq_toks[MAXTOK];
    float *inc = malloc((steps + 1) * V * sizeof(float)), *full = malloc(V * sizeof(float));
    fx_prompt(seq_toks, np, (uint32_t)np);
    run_seq(m, 2, 16, 3, seq_toks, np, steps, inc);
    for (size_t s = 0; s < steps; s++)
        cr_assert_eq(kvb_pd_sample(inc + s * V, V, 0.0f, 0, s, &seq_toks[np + s]), KVB_OK);
    for (size_t s = 0; s <= steps; s++) {
        /* Recompute at the ends and around every block boundary the decode crossed. */
        if (s > 1 && s < steps && (np + s) % 16 > 1)
            continue;
        fx_inst_t in;
        uint64_t nb = kvb_pd_blocks_for(np + s, 16), table[MAXTOK];
        fx_inst(&in, m, 1, nb + 2, 16);
        fx_table(table, nb + 2, 1, 1, nb + 2);
        kvb_pd_seq_t seq = {.blocks = table, .num_blocks = nb + 2};
        fx_forward(&in, &seq, seq_toks, np + s, full);
        cr_assert(!memcmp(full, inc + s * V, V * sizeof(float)),
                  "prompt %zu step %zu: recomputed logits differ (max diff %g)", np, s,
                  (double)fx_maxdiff(full, inc + s * V, V));
        fx_inst_free(&in);
    }
    free(inc);
    free(full);
}

Test(model, decode_equals_recompute)
{
    const size_t prompts[] = {1, 2, 15, 16, 17, 31, 32, 33, 48};
    for (int k = 0; k < 2; k++) {
        kvb_pd_config_t c = fx_mini(k ? KVB_KV_ATTN_MLA : KVB_KV_ATTN_GQA);
        kvb_pd_model_t *m = fx_model_cfg(&c, 11);
        for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++)
            check_incremental(m, prompts[i], prompts[i] % 16 == 0 ? 17 : 5);
        kvb_pd_model_free(m);
    }
}

/* The paged model's logits at every step against the naive reference over the final sequence;
 * greedy tokens must agree wherever the reference's top two logits are clearly apart. */
static void check_naive(const kvb_pd_model_t *m, uint32_t tp, size_t np, size_t steps)
{
    uint32_t V = kvb_pd_model_config(m)->vocab, toks[MAXTOK];
    size_t n = np + steps;
    float *paged = malloc((steps + 1) * V * sizeof(float)), *ref = malloc(n * V * sizeof(float));
    fx_prompt(toks, np, 5);
    run_seq(m, tp, 16, 7, toks, np, steps, paged);
    for (size_t s = 0; s < steps; s++)
        kvb_pd_sample(paged + s * V, V, 0.0f, 0, s, &toks[np + s]);
    fx_naive(m, toks, n, ref);
    for (size_t s = 0; s <= steps; s++) {
        const float *want = ref + (np - 1 + s) * V, *got = paged + s * V;
        float d = fx_maxdiff(want, got, V);
        cr_assert_lt(d, 2e-3f, "%s prompt %zu step %zu: max logit diff %g", kvb_pd_model_id(m), np,
                     s, (double)d);
        if (s == steps)
            break;
        uint32_t best, second = UINT32_MAX;
        kvb_pd_sample(want, V, 0.0f, 0, 0, &best);
        for (uint32_t i = 0; i < V; i++)
            if (i != best && (second == UINT32_MAX || want[i] > want[second]))
                second = i;
        if (want[best] - want[second] > 1e-2f)
            cr_assert_eq(toks[np + s], best, "step %zu: paged token %u, naive %u", s, toks[np + s],
                         best);
    }
    free(paged);
    free(ref);
}

Test(model, paged_matches_naive_mini)
{
    const size_t prompts[] = {1, 16, 17, 40};
    for (int k = 0; k < 2; k++) {
        kvb_pd_config_t c = fx_mini(k ? KVB_KV_ATTN_MLA : KVB_KV_ATTN_GQA);
        kvb_pd_model_t *m = fx_model_cfg(&c, 21);
        for (size_t i = 0; i < 4; i++)
            check_naive(m, k ? 4 : 2, prompts[i], 12);
        kvb_pd_model_free(m);
    }
}

Test(model, paged_matches_naive_presets)
{
    kvb_pd_model_t *g = fx_preset("tiny-gqa", 0), *a = fx_preset("tiny-mla", 0);
    check_naive(g, 2, 17, 3);
    check_naive(a, 4, 15, 3);
    kvb_pd_model_free(g);
    kvb_pd_model_free(a);
}

/* ---- The per-layer hook ---------------------------------------------------------------------- */

typedef struct {
    fx_inst_t *in;
    uint32_t calls;
    uint64_t block; /* the sequence's only block */
    uint32_t pos0, n;
} hook_state_t;

/* Floats of layer l's first slot of `block`, rows pos0..pos0+n (token rows of head 0 for GQA). */
static int rows_written(const hook_state_t *s, uint32_t r, uint32_t l)
{
    kvb_kv_layout_t lay;
    kvb_kv_slot_t slots[64];
    cr_assert_eq(kvb_pd_cache_layout(s->in->caches[r], 1, 0, &lay, slots, 64, NULL, 0), KVB_OK);
    const kvb_kv_slot_t *sl =
        &slots[kvb_pd_model_config(s->in->m)->attn == KVB_KV_ATTN_GQA ? 2 * l : l];
    const float *b = (const float *)(uintptr_t)(sl->base + s->block * sl->block_bytes);
    size_t row = sl->num_heads ? sl->head_bytes / 4 : sl->block_bytes / 4 / s->in->tpb;
    int nonzero = 0;
    for (size_t i = s->pos0 * row; i < (s->pos0 + s->n) * row; i++)
        nonzero |= b[i] != 0.0f;
    return nonzero;
}

static void on_layer(uint32_t layer, void *user)
{
    hook_state_t *s = user;
    cr_assert_eq(layer, s->calls, "hook for layer %u, expected %u", layer, s->calls);
    for (uint32_t r = 0; r < s->in->tp; r++) {
        cr_assert(rows_written(s, r, layer), "rank %u layer %u not written at its hook", r, layer);
        if (layer + 1 < kvb_pd_model_config(s->in->m)->n_layers)
            cr_assert(!rows_written(s, r, layer + 1), "layer %u written before its hook",
                      layer + 1);
    }
    s->calls++;
}

Test(model, layer_hook_after_cache_writes)
{
    for (int k = 0; k < 2; k++) {
        kvb_pd_config_t c = fx_mini(k ? KVB_KV_ATTN_MLA : KVB_KV_ATTN_GQA);
        kvb_pd_model_t *m = fx_model_cfg(&c, 4);
        fx_inst_t in;
        uint32_t toks[6];
        uint64_t table[1] = {2};
        fx_inst(&in, m, 2, 4, 16);
        fx_prompt(toks, 6, 1);
        kvb_pd_seq_t seq = {.blocks = table, .num_blocks = 1};
        hook_state_t s = {.in = &in, .block = 2, .pos0 = 0, .n = 4};
        kvb_pd_hook_t hook = {.on_layer_done = on_layer, .user = &s};
        cr_assert_eq(kvb_pd_forward(m, in.caches, 2, &seq, toks, 4, NULL, &hook, NULL, 0), KVB_OK);
        cr_assert_eq(s.calls, c.n_layers);
        s = (hook_state_t){.in = &in, .block = 2, .pos0 = 4, .n = 2};
        cr_assert_eq(kvb_pd_forward(m, in.caches, 2, &seq, toks + 4, 2, NULL, &hook, NULL, 0),
                     KVB_OK);
        cr_assert_eq(s.calls, c.n_layers);
        fx_inst_free(&in);
        kvb_pd_model_free(m);
    }
}

/* ---- Refused arguments ----------------------------------------------------------------------- */

static void expect_refused(const kvb_pd_model_t *m, kvb_pd_cache_t *const *caches, uint32_t tp,
                           kvb_pd_seq_t *seq, const uint32_t *toks, size_t n, const char *what)
{
    char why[KVB_PD_REASON_MAX] = "";
    uint32_t len = seq ? seq->len : 0;
    int rc = kvb_pd_forward(m, caches, tp, seq, toks, n, NULL, NULL, why, sizeof why);
    cr_assert_eq(rc, KVB_ERR_INVALID_ARG, "%s: rc %d", what, rc);
    cr_assert(strstr(why, what), "reason '%s' lacks '%s'", why, what);
    if (seq)
        cr_assert_eq(seq->len, len);
}

Test(model, forward_refuses_bad_arguments)
{
    kvb_pd_config_t c = fx_mini(KVB_KV_ATTN_GQA);
    kvb_pd_model_t *m = fx_model_cfg(&c, 1), *other = fx_model_cfg(&c, 2);
    fx_inst_t in, in1, oth;
    fx_inst(&in, m, 2, 4, 16);
    fx_inst(&in1, m, 1, 4, 16);
    fx_inst(&oth, other, 2, 4, 16);
    uint64_t table[4] = {0, 1, 2, 3}, bad_table[2] = {1, 4};
    uint32_t toks[40], bad_tok = 258;
    fx_prompt(toks, 40, 0);
    kvb_pd_seq_t seq = {.blocks = table, .num_blocks = 2};
    expect_refused(m, in.caches, 2, &seq, &bad_tok, 1, "outside the vocab");
    expect_refused(m, in.caches, 2, &seq, toks, 33, "need 3 blocks");
    expect_refused(m, in.caches, 2, &seq, toks, 0, "no tokens");
    expect_refused(m, oth.caches, 2, &seq, toks, 1, "another model");
    expect_refused(m, in.caches, 1, &seq, toks, 1, "rank 0 of 2");
    kvb_pd_cache_t *swapped[2] = {in.caches[1], in.caches[0]};
    expect_refused(m, swapped, 2, &seq, toks, 1, "rank 1 of 2");
    kvb_pd_cache_t *mixed[2] = {in.caches[0], in1.caches[0]};
    expect_refused(m, mixed, 2, &seq, toks, 1, "rank 0 of 1");
    kvb_pd_seq_t bad = {.blocks = bad_table, .num_blocks = 2};
    expect_refused(m, in.caches, 2, &bad, toks, 17, "over the 4 blocks");
    /* Nothing was written by any refused call. */
    size_t len;
    const unsigned char *mem = kvb_pd_cache_memory(in.caches[0], &len);
    for (size_t i = 0; i < len; i++)
        cr_assert_eq(mem[i], 0, "byte %zu written by a refused call", i);
    fx_inst_free(&in);
    fx_inst_free(&in1);
    fx_inst_free(&oth);
    kvb_pd_model_free(m);
    kvb_pd_model_free(other);
}

Test(model, presets_and_ids)
{
    kvb_pd_config_t c;
    cr_assert_eq(kvb_pd_preset_config("tiny-gqa", &c), KVB_OK);
    cr_assert_eq(c.attn, KVB_KV_ATTN_GQA);
    cr_assert_eq(c.n_heads, 8);
    cr_assert_eq(c.n_kv_heads, 4);
    cr_assert_eq(c.head_dim, 32);
    cr_assert_eq(kvb_pd_preset_config("tiny-mla", &c), KVB_OK);
    cr_assert_eq(c.kv_lora_rank, 64);
    cr_assert_eq(c.rope_dim, 16);
    cr_assert_eq(kvb_pd_preset_config("huge", &c), KVB_ERR_NOT_FOUND);
    kvb_pd_model_t *a = fx_preset("tiny-gqa", 1), *b = fx_preset("tiny-gqa", 1);
    kvb_pd_model_t *d = fx_preset("tiny-gqa", 2);
    cr_assert_str_eq(kvb_pd_model_id(a), kvb_pd_model_id(b));
    cr_assert_str_neq(kvb_pd_model_id(a), kvb_pd_model_id(d));
    cr_assert(!strncmp(kvb_pd_model_id(a), "tiny-gqa@", 9));
    cr_assert(!memcmp(a->data, b->data, (size_t)a->payload_bytes));
    kvb_pd_model_free(a);
    kvb_pd_model_free(b);
    kvb_pd_model_free(d);
    char why[KVB_PD_REASON_MAX];
    kvb_pd_model_t *m = NULL;
    cr_assert_eq(kvb_pd_model_preset("nope", 0, &m, why, sizeof why), KVB_ERR_NOT_FOUND);
    cr_assert(strstr(why, "unknown preset"));
    c = fx_mini(KVB_KV_ATTN_GQA);
    cr_assert_eq(kvb_pd_model_random(&c, "bad name", 0, &m, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_assert_null(m);
}

/* Greedy generation gives varied text, not one repeated byte. */
Test(model, presets_generate_varied_text)
{
    const char *presets[] = {"tiny-gqa", "tiny-mla"};
    for (size_t p = 0; p < 2; p++) {
        kvb_pd_model_t *m = fx_preset(presets[p], 0);
        uint32_t prompt[8], out[16];
        size_t n = 0, distinct = 0;
        fx_prompt(prompt, 8, 9);
        kvb_pd_gen_opts_t o = {.max_tokens = 16};
        cr_assert_eq(kvb_pd_generate(m, &o, prompt, 8, out, &n, NULL, 0), KVB_OK);
        cr_assert_eq(n, 16);
        for (size_t i = 0; i < n; i++) {
            int seen = 0;
            for (size_t k = 0; k < i; k++)
                seen |= out[k] == out[i];
            distinct += !seen;
        }
        cr_assert_geq(distinct, 4, "%s: only %zu distinct tokens", presets[p], distinct);
        kvb_pd_model_free(m);
    }
}

/* A batched decode step gives every sequence bitwise the logits (and next cache rows) that its
 * own single-token pass gives: the first ns of 5 sequences of different lengths, on TP tp,
 * several steps. */
static void check_batch(const kvb_pd_model_t *m, uint32_t tp, size_t ns)
{
    enum { NS = 5, STEPS = 3 };
    const size_t lens[NS] = {1, 15, 16, 33, 70};
    uint32_t V = kvb_pd_model_config(m)->vocab, prompt[MAXTOK];
    fx_inst_t a, b; /* a: one pass per sequence; b: batched steps */
    uint64_t per = kvb_pd_blocks_for(70 + STEPS, 16);
    fx_inst(&a, m, tp, per * NS, 16);
    fx_inst(&b, m, tp, per * NS, 16);
    uint64_t tables[NS][8];
    kvb_pd_seq_t sa[NS], sb[NS];
    kvb_pd_seq_t *bp[NS];
    float *la = malloc(V * sizeof(float)), *lb[NS];
    uint32_t next[NS];
    for (size_t i = 0; i < ns; i++) {
        for (uint64_t k = 0; k < per; k++)
            tables[i][k] = (NS - 1 - i) * per + k; /* disjoint, in another order than i */
        sa[i] = (kvb_pd_seq_t){.blocks = tables[i], .num_blocks = per};
        sb[i] = sa[i];
        bp[i] = &sb[i];
        lb[i] = malloc(V * sizeof(float));
        fx_prompt(prompt, lens[i], (uint32_t)i);
        fx_forward(&a, &sa[i], prompt, lens[i], la);
        fx_forward(&b, &sb[i], prompt, lens[i], lb[i]);
        cr_assert_eq(kvb_pd_sample(la, V, 0.0f, 0, 0, &next[i]), KVB_OK);
    }
    char why[KVB_PD_REASON_MAX];
    for (int s = 0; s < STEPS; s++) {
        uint32_t toks[NS];
        memcpy(toks, next, sizeof toks);
        int rc = kvb_pd_forward_batch(m, b.caches, tp, bp, toks, ns, lb, why, sizeof why);
        cr_assert_eq(rc, KVB_OK, "batch: %s", why);
        for (size_t i = 0; i < ns; i++) {
            fx_forward(&a, &sa[i], &toks[i], 1, la);
            cr_assert(!memcmp(la, lb[i], V * sizeof(float)),
                      "TP %u step %d sequence %zu (length %zu): batched logits differ (max %g)", tp,
                      s, i, lens[i], (double)fx_maxdiff(la, lb[i], V));
            cr_assert_eq(sb[i].len, sa[i].len);
            cr_assert_eq(kvb_pd_sample(la, V, 0.0f, 0, 0, &next[i]), KVB_OK);
        }
    }
    /* Misuse: the same sequence twice is refused, nothing advanced. */
    kvb_pd_seq_t *twice[2] = {bp[0], bp[0]};
    uint32_t before = sb[0].len;
    cr_expect_eq(kvb_pd_forward_batch(m, b.caches, tp, twice, next, 2, lb, why, sizeof why),
                 KVB_ERR_INVALID_ARG);
    cr_expect_eq(sb[0].len, before);
    for (size_t i = 0; i < ns; i++)
        free(lb[i]);
    free(la);
    fx_inst_free(&a);
    fx_inst_free(&b);
}

Test(model, batched_step_equals_single)
{
    kvb_pd_config_t g = fx_mini(KVB_KV_ATTN_GQA), a = fx_mini(KVB_KV_ATTN_MLA);
    kvb_pd_model_t *mg = fx_model_cfg(&g, 8), *ma = fx_model_cfg(&a, 9);
    const uint32_t tps[] = {1, 2, 4};
    for (size_t i = 0; i < 3; i++) {
        check_batch(mg, tps[i], 5);
        check_batch(ma, tps[i], 5);
    }
    /* Fewer sequences than ranks: each token's MLP and logits rows are shared out. */
    check_batch(mg, 4, 2);
    check_batch(ma, 4, 3);
    kvb_pd_model_free(mg);
    kvb_pd_model_free(ma);
}
