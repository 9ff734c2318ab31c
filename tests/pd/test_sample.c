/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the tokenizer, the sampler and colocated generation (src/pd/model/sample.c): greedy
 * ties and NaNs, the documented seeded draw reproduced independently, sampling frequencies, refused
 * temperatures, and generation that is deterministic and the same for every TP size. */
#include "pd_fixture.h"

TestSuite(sample, .timeout = 30);

Test(sample, tokenizer)
{
    uint32_t t[8];
    size_t n;
    cr_assert_eq(kvb_pd_tokenize("Hi\xff", 3, true, t, 8, &n), KVB_OK);
    cr_assert_eq(n, 4);
    cr_assert_eq(t[0], KVB_PD_BOS);
    cr_assert_eq(t[1], 'H');
    cr_assert_eq(t[3], 0xff);
    cr_assert_eq(kvb_pd_tokenize("Hi", 2, false, t, 8, &n), KVB_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(kvb_pd_tokenize("Hello", 5, true, t, 3, &n), KVB_ERR_TOO_LARGE);
    cr_assert_eq(n, 6);
    cr_assert_eq(kvb_pd_tokenize("", 0, true, t, 1, &n), KVB_OK);
    cr_assert_eq(n, 1);
    uint32_t in[] = {KVB_PD_BOS, 'o', 'k', KVB_PD_EOS, '!'};
    char out[8];
    cr_assert_eq(kvb_pd_detokenize(in, 5, out, sizeof out), 3);
    cr_assert(!memcmp(out, "ok!", 3));
    cr_assert_eq(kvb_pd_detokenize(in, 5, out, 1), 3, "the full length even when cut");
}

Test(sample, greedy_ties_and_nan)
{
    uint32_t tok;
    const float ties[] = {1, 3, 3, 2};
    cr_assert_eq(kvb_pd_sample(ties, 4, 0.0f, 0, 0, &tok), KVB_OK);
    cr_assert_eq(tok, 1, "lowest id wins a tie");
    const float nans[] = {NAN, 1, NAN, 1, -INFINITY};
    cr_assert_eq(kvb_pd_sample(nans, 5, 0.0f, 0, 0, &tok), KVB_OK);
    cr_assert_eq(tok, 1);
    cr_assert_eq(kvb_pd_sample(nans, 5, 0.7f, 3, 9, &tok), KVB_OK);
    cr_assert(tok == 1 || tok == 3, "NaN never sampled, got %u", tok);
    const float allnan[] = {NAN, NAN};
    cr_assert_eq(kvb_pd_sample(allnan, 2, 0.0f, 0, 0, &tok), KVB_OK);
    cr_assert_eq(tok, 0);
    const float tiny[] = {0.5f, 0.25f, 0.75f};
    cr_assert_eq(kvb_pd_sample(tiny, 3, 1e-30f, 1, 1, &tok), KVB_OK);
    cr_assert_eq(tok, 2, "a vanishing temperature is greedy");
}

Test(sample, refuses_bad_arguments)
{
    uint32_t tok = 77;
    const float l[] = {1, 2};
    cr_assert_eq(kvb_pd_sample(l, 2, -1.0f, 0, 0, &tok), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_sample(l, 2, NAN, 0, 0, &tok), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_sample(l, 0, 1.0f, 0, 0, &tok), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_sample(NULL, 2, 1.0f, 0, 0, &tok), KVB_ERR_INVALID_ARG);
    cr_assert_eq(tok, 77);
}

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* With equal logits the documented draw picks floor(u * vocab): reproduce it from the doc. */
Test(sample, documented_draw)
{
    float flat[100] = {0};
    for (uint64_t seed = 0; seed < 4; seed++)
        for (uint64_t step = 0; step < 200; step++) {
            double u = (double)(mix(seed + (step + 1) * 0x9e3779b97f4a7c15ull) >> 11) * 0x1p-53;
            uint32_t tok, want = (uint32_t)(u * 100.0);
            cr_assert_eq(kvb_pd_sample(flat, 100, 1.0f, seed, step, &tok), KVB_OK);
            cr_assert_eq(tok, want, "seed %llu step %llu", (unsigned long long)seed,
                         (unsigned long long)step);
        }
}

Test(sample, frequencies_follow_softmax)
{
    const float l[] = {0.0f, logf(3.0f), -INFINITY}; /* p = 1/4, 3/4, 0 */
    int count[3] = {0};
    for (uint64_t step = 0; step < 20000; step++) {
        uint32_t tok;
        cr_assert_eq(kvb_pd_sample(l, 3, 1.0f, 42, step, &tok), KVB_OK);
        count[tok]++;
    }
    cr_assert_eq(count[2], 0);
    cr_assert(count[1] > 14600 && count[1] < 15400, "p(1) = %d / 20000", count[1]);
    /* Temperature 2 flattens it: p(1) = sqrt(3) / (1 + sqrt(3)) = 0.634. */
    count[0] = count[1] = 0;
    for (uint64_t step = 0; step < 20000; step++) {
        uint32_t tok;
        kvb_pd_sample(l, 3, 2.0f, 43, step, &tok);
        count[tok]++;
    }
    cr_assert(count[1] > 12280 && count[1] < 13080, "p(1) = %d / 20000", count[1]);
}

Test(sample, generation_deterministic_across_tp)
{
    kvb_pd_config_t c = fx_mini(KVB_KV_ATTN_MLA);
    kvb_pd_model_t *m = fx_model_cfg(&c, 6);
    uint32_t prompt[20], a[30], b[30];
    size_t na, nb;
    fx_prompt(prompt, 20, 2);
    kvb_pd_gen_opts_t o = {.max_tokens = 30, .temperature = 0.9f, .seed = 5, .tp = 1};
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, 20, a, &na, NULL, 0), KVB_OK);
    for (uint32_t tp = 2; tp <= 8; tp *= 2) {
        o.tp = tp;
        o.tokens_per_block = tp; /* block size does not matter either */
        cr_assert_eq(kvb_pd_generate(m, &o, prompt, 20, b, &nb, NULL, 0), KVB_OK);
        cr_assert_eq(na, nb);
        cr_assert(!memcmp(a, b, na * sizeof a[0]), "TP %u sampled other tokens", tp);
    }
    o.seed = 6;
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, 20, b, &nb, NULL, 0), KVB_OK);
    cr_assert(na != nb || memcmp(a, b, na * sizeof a[0]), "another seed, the same 30 tokens");
    char why[KVB_PD_REASON_MAX];
    o.temperature = -1.0f;
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, 20, b, &nb, why, sizeof why), KVB_ERR_INVALID_ARG);
    o = (kvb_pd_gen_opts_t){.max_tokens = 3, .tp = 3};
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, 20, b, &nb, why, sizeof why), KVB_ERR_INVALID_ARG);
    cr_assert(strstr(why, "query heads"), "%s", why);
    o.tp = 1;
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, 0, b, &nb, why, sizeof why), KVB_ERR_INVALID_ARG);
    kvb_pd_model_free(m);
}
