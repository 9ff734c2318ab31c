/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the paged KV cache (src/pd/model/cache.c): the block pool and sequences, layouts the KV
 * layer accepts (validation, guard, routes), a caller's allocator, and the PD round trip - a
 * prefill instance's blocks copied into a decode instance of another TP with other block ids
 * (by kvb_kv_plan's requests, and by hand from the HND layout), after which decode continues with
 * exactly the tokens of a colocated instance. */
#include "pd_fixture.h"

#include "kvbridge/kv.h"

#define MAXB   32
#define MAXTOK 128

TestSuite(cache, .timeout = 60);

Test(cache, pool_alloc_free)
{
    kvb_pd_blocks_t *p;
    uint64_t ids[8], more[8];
    cr_assert_eq(kvb_pd_blocks_create(0, &p), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_blocks_create(6, &p), KVB_OK);
    cr_assert_eq(kvb_pd_blocks_alloc(p, 4, ids), KVB_OK);
    for (uint64_t i = 0; i < 4; i++)
        cr_assert_eq(ids[i], i);
    cr_assert_eq(kvb_pd_blocks_alloc(p, 3, more), KVB_ERR_NOMEM, "all or nothing");
    cr_assert_eq(kvb_pd_blocks_available(p), 2);
    uint64_t dup[2] = {1, 1}, out_of_range[1] = {6}, not_used[1] = {5};
    cr_assert_eq(kvb_pd_blocks_free(p, dup, 2), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_blocks_free(p, out_of_range, 1), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_blocks_free(p, not_used, 1), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_blocks_available(p), 2, "a refused free frees nothing");
    cr_assert_eq(kvb_pd_blocks_free(p, ids + 1, 2), KVB_OK);
    cr_assert_eq(kvb_pd_blocks_free(p, ids + 1, 1), KVB_ERR_INVALID_ARG, "double free");
    cr_assert_eq(kvb_pd_blocks_alloc(p, 4, more), KVB_OK);
    cr_assert_eq(more[0], 2, "last freed first");
    cr_assert_eq(more[1], 1);
    cr_assert_eq(kvb_pd_blocks_available(p), 0);
    kvb_pd_blocks_destroy(p);
}

Test(cache, seq_reserve_release)
{
    kvb_pd_blocks_t *p;
    kvb_pd_seq_t s;
    cr_assert_eq(kvb_pd_blocks_create(10, &p), KVB_OK);
    kvb_pd_seq_init(&s);
    cr_assert_eq(kvb_pd_blocks_for(0, 16), 0);
    cr_assert_eq(kvb_pd_blocks_for(16, 16), 1);
    cr_assert_eq(kvb_pd_blocks_for(17, 16), 2);
    cr_assert_eq(kvb_pd_seq_reserve(&s, p, 16, 1), KVB_OK);
    cr_assert_eq(s.num_blocks, 1);
    cr_assert_eq(kvb_pd_seq_reserve(&s, p, 16, 16), KVB_OK);
    cr_assert_eq(s.num_blocks, 1);
    cr_assert_eq(kvb_pd_seq_reserve(&s, p, 16, 100), KVB_OK);
    cr_assert_eq(s.num_blocks, 7);
    cr_assert_eq(kvb_pd_seq_reserve(&s, p, 16, 200), KVB_ERR_NOMEM);
    cr_assert_eq(s.num_blocks, 7, "a failed reserve leaves the table");
    cr_assert_eq(kvb_pd_blocks_available(p), 3);
    cr_assert_eq(kvb_pd_seq_release(&s, p), KVB_OK);
    cr_assert_eq(kvb_pd_blocks_available(p), 10);
    cr_assert_eq(s.num_blocks, 0);
    uint64_t mine[1] = {3};
    kvb_pd_seq_t own = {.blocks = mine, .num_blocks = 1};
    cr_assert_eq(kvb_pd_seq_reserve(&own, p, 16, 40), KVB_ERR_INVALID_ARG);
    kvb_pd_blocks_destroy(p);
}

/* Layout of every rank, checked by the KV layer, for several TP sizes. */
Test(cache, layouts_validate)
{
    const char *presets[] = {"tiny-gqa", "tiny-mla"};
    for (size_t k = 0; k < 2; k++) {
        kvb_pd_model_t *m = fx_preset(presets[k], 0);
        for (uint32_t tp = 1; tp <= 4; tp *= 2) {
            fx_inst_t in;
            fx_inst(&in, m, tp, 5, 16);
            for (uint32_t r = 0; r < tp; r++) {
                kvb_kv_layout_t l;
                kvb_kv_slot_t slots[16];
                char why[KVB_KV_REASON_MAX];
                int rc = kvb_pd_cache_layout(in.caches[r], 2, 1, &l, slots, 16, why, sizeof why);
                cr_assert_eq(rc, KVB_OK, "%s tp %u rank %u: %s", presets[k], tp, r, why);
                cr_assert_str_eq(l.model, kvb_pd_model_id(m));
                cr_assert_eq(l.dtype, KVB_KV_DTYPE_FP32);
                cr_assert_eq(l.num_slots, k ? 4 : 8);
                cr_assert_eq(l.tp_rank, (int32_t)r);
                if (k == 0) {
                    cr_assert_eq(slots[0].kind, KVB_KV_SLOT_K);
                    cr_assert_eq(slots[1].kind, KVB_KV_SLOT_V);
                    cr_assert_eq(slots[0].num_heads, 4 / tp);
                    cr_assert_eq(slots[0].block_bytes, (4 / tp) * 16 * 32 * 4);
                    cr_assert_eq(slots[0].order, KVB_KV_ORDER_HND);
                } else {
                    cr_assert_eq(slots[0].kind, KVB_KV_SLOT_LATENT);
                    cr_assert_eq(slots[0].block_bytes, 16 * (64 + 16) * 4);
                }
                cr_assert_eq(kvb_pd_cache_layout(in.caches[r], 1, 0, &l, slots, 1, why, sizeof why),
                             KVB_ERR_INVALID_ARG);
            }
            fx_inst_free(&in);
        }
        kvb_pd_model_free(m);
    }
}

Test(cache, create_refuses_bad_split)
{
    kvb_pd_model_t *g = fx_preset("tiny-gqa", 0), *a = fx_preset("tiny-mla", 0);
    kvb_pd_cache_t *c = NULL;
    char why[KVB_PD_REASON_MAX];
    cr_assert_eq(kvb_pd_cache_create(g, 3, 0, 4, 16, NULL, &c, why, sizeof why),
                 KVB_ERR_INVALID_ARG);
    cr_assert(strstr(why, "4 KV heads"), "%s", why);
    cr_assert_eq(kvb_pd_cache_create(g, 8, 0, 4, 16, NULL, &c, why, sizeof why),
                 KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_cache_create(g, 2, 2, 4, 16, NULL, &c, why, sizeof why),
                 KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_cache_create(g, 2, 0, 0, 16, NULL, &c, why, sizeof why),
                 KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb_pd_cache_create(a, 3, 0, 4, 16, NULL, &c, why, sizeof why),
                 KVB_ERR_INVALID_ARG);
    cr_assert_null(c);
    cr_assert_eq(kvb_pd_cache_create(a, 8, 7, 4, 16, NULL, &c, why, sizeof why), KVB_OK);
    kvb_pd_cache_destroy(c);
    kvb_pd_model_free(g);
    kvb_pd_model_free(a);
}

/* A caller's allocator: counts calls and poisons nothing (memory must come back zeroed). */
typedef struct {
    int allocs, frees;
    size_t bytes;
    int fail;
} alloc_state_t;

static void *my_alloc(void *user, size_t len)
{
    alloc_state_t *s = user;
    if (s->fail)
        return NULL;
    s->allocs++;
    s->bytes = len;
    return calloc(1, len);
}

static void my_free(void *user, void *ptr, size_t len)
{
    alloc_state_t *s = user;
    cr_assert_eq(len, s->bytes);
    s->frees++;
    free(ptr);
}

Test(cache, caller_allocator)
{
    kvb_pd_model_t *m = fx_preset("tiny-gqa", 0);
    alloc_state_t st = {0};
    kvb_pd_allocator_t al = {.alloc = my_alloc, .free = my_free, .user = &st};
    kvb_pd_cache_t *c;
    char why[KVB_PD_REASON_MAX];
    cr_assert_eq(kvb_pd_cache_create(m, 2, 1, 3, 0, &al, &c, why, sizeof why), KVB_OK);
    cr_assert_eq(st.allocs, 1);
    cr_assert_eq(st.bytes, 4 * 2 * 3 * (2 * 16 * 32 * 4), "layers * K,V * blocks * block");
    cr_assert_eq(kvb_pd_cache_tokens_per_block(c), KVB_PD_TOKENS_PER_BLOCK);
    cr_assert_eq(kvb_pd_cache_num_blocks(c), 3);
    kvb_pd_cache_destroy(c);
    cr_assert_eq(st.frees, 1);
    st.fail = 1;
    cr_assert_eq(kvb_pd_cache_create(m, 1, 0, 3, 0, &al, &c, why, sizeof why), KVB_ERR_NOMEM);
    kvb_pd_model_free(m);
}

/* ---- PD round trip --------------------------------------------------------------------------- */

typedef struct {
    kvb_kv_layout_t l[FX_MAX_TP];
    kvb_kv_slot_t slots[FX_MAX_TP][64];
} layouts_t;

static void layouts_of(const fx_inst_t *in, layouts_t *out)
{
    char why[KVB_KV_REASON_MAX];
    for (uint32_t r = 0; r < in->tp; r++)
        cr_assert_eq(kvb_pd_cache_layout(in->caches[r], 1, 0, &out->l[r], out->slots[r], 64, why,
                                         sizeof why),
                     KVB_OK, "%s", why);
}

/* Moves blocks src_ids[i] of instance `src` into dst_ids[i] of `dst` the way a decode instance
 * pulls them: guard, routes, and kvb_kv_plan's READ requests, executed with memcpy. */
static void transfer_planned(const fx_inst_t *src, const fx_inst_t *dst, const uint64_t *src_ids,
                             const uint64_t *dst_ids, size_t n)
{
    static layouts_t ls, ld;
    char why[KVB_KV_REASON_MAX];
    kvb_kv_topo_t ts, td;
    kvb_kv_route_t routes[16];
    size_t nr;
    layouts_of(src, &ls);
    layouts_of(dst, &ld);
    kvb_kv_verdict_t v = kvb_kv_guard(&ld.l[0], &ls.l[0], why, sizeof why);
    cr_assert_eq(v, src->tp == dst->tp ? KVB_KV_ALLOW_HOMO : KVB_KV_ALLOW_HETERO, "guard: %s", why);
    cr_assert_eq(kvb_kv_layout_topo(&ls.l[0], &ts), KVB_OK);
    cr_assert_eq(kvb_kv_layout_topo(&ld.l[0], &td), KVB_OK);
    cr_assert_eq(kvb_kv_route(&ts, &td, 0, routes, 16, &nr), KVB_OK);
    for (size_t i = 0; i < nr; i++) {
        kvb_kv_plan_args_t a = {.op = KVB_OP_READ,
                                .segment = 1,
                                .src_blocks = src_ids,
                                .num_src = n,
                                .dst_blocks = dst_ids,
                                .num_dst = n,
                                .route = &routes[i]};
        kvb_request_t *reqs;
        size_t nq;
        int rc = kvb_kv_plan(&ld.l[routes[i].dst_rank], &ls.l[routes[i].src_rank], &a, &reqs, &nq,
                             why, sizeof why);
        cr_assert_eq(rc, KVB_OK, "plan: %s", why);
        for (size_t q = 0; q < nq; q++)
            memcpy(reqs[q].local, (const void *)(uintptr_t)reqs[q].remote, reqs[q].len);
        kvb_kv_plan_free(reqs);
    }
}

/* The same move by hand from the documented block format: GQA head g's [tpb][head_dim] chunk
 * lives on rank g / heads_held at index g % heads_held of an HND block; MLA blocks are whole. */
static void transfer_by_hand(const fx_inst_t *src, const fx_inst_t *dst, const uint64_t *src_ids,
                             const uint64_t *dst_ids, size_t n)
{
    static layouts_t ls, ld;
    layouts_of(src, &ls);
    layouts_of(dst, &ld);
    const kvb_pd_config_t *c = kvb_pd_model_config(src->m);
    uint32_t heads = c->attn == KVB_KV_ATTN_GQA ? c->n_kv_heads : 1;
    for (size_t s = 0; s < ls.l[0].num_slots; s++)
        for (size_t i = 0; i < n; i++)
            for (uint32_t g = 0; g < heads; g++) {
                uint32_t hs = heads / (c->attn == KVB_KV_ATTN_GQA ? src->tp : 1);
                uint32_t hd = heads / (c->attn == KVB_KV_ATTN_GQA ? dst->tp : 1);
                const kvb_kv_slot_t *a = &ls.slots[g / hs][s];
                uint64_t chunk = a->block_bytes / hs;
                for (uint32_t r = 0; r < dst->tp; r++) {
                    if (c->attn == KVB_KV_ATTN_GQA && r != g / hd)
                        continue;
                    const kvb_kv_slot_t *b = &ld.slots[r][s];
                    memcpy((void *)(uintptr_t)(b->base + dst_ids[i] * b->block_bytes +
                                               (g % hd) * chunk),
                           (const void *)(uintptr_t)(a->base + src_ids[i] * a->block_bytes +
                                                     (g % hs) * chunk),
                           chunk);
                }
            }
}

typedef void (*transfer_fn)(const fx_inst_t *, const fx_inst_t *, const uint64_t *,
                            const uint64_t *, size_t);

/* Prefill on TP src_tp (block ids permuted one way), move the blocks to a TP dst_tp decode
 * instance (other ids), decode there, and compare every token with a colocated TP-1 run. */
static void pd_round_trip(const kvb_pd_model_t *m, uint32_t src_tp, uint32_t dst_tp, size_t np,
                          uint32_t max_tokens, float temperature, transfer_fn move)
{
    uint32_t V = kvb_pd_model_config(m)->vocab, prompt[MAXTOK], want[MAXTOK], got[MAXTOK];
    float *logits = malloc(V * sizeof(float));
    size_t nwant;
    fx_prompt(prompt, np, (uint32_t)(np + dst_tp));
    kvb_pd_gen_opts_t o = {.max_tokens = max_tokens, .temperature = temperature, .seed = 99};
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, np, want, &nwant, NULL, 0), KVB_OK);

    fx_inst_t pre, dec;
    uint64_t nb = kvb_pd_blocks_for(np + max_tokens, 16), ptab[MAXB], dtab[MAXB];
    fx_inst(&pre, m, src_tp, nb + 5, 16);
    fx_inst(&dec, m, dst_tp, nb + 3, 16);
    fx_table(ptab, nb, 3, 4, nb + 5);
    fx_table(dtab, nb, 5, 1, nb + 3);
    kvb_pd_seq_t ps = {.blocks = ptab, .num_blocks = nb}, ds = {.blocks = dtab, .num_blocks = nb};
    fx_forward(&pre, &ps, prompt, np, logits);
    cr_assert_eq(kvb_pd_sample(logits, V, temperature, 99, 0, &got[0]), KVB_OK); /* T0 */
    move(&pre, &dec, ptab, dtab, kvb_pd_blocks_for(np, 16));
    ds.len = (uint32_t)np;
    size_t n = 1;
    while (n < max_tokens && got[n - 1] != KVB_PD_EOS) {
        fx_forward(&dec, &ds, &got[n - 1], 1, logits);
        cr_assert_eq(kvb_pd_sample(logits, V, temperature, 99, n, &got[n]), KVB_OK);
        n++;
    }
    cr_assert_eq(n, nwant);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(got[i], want[i], "%s TP %u -> %u prompt %zu: token %zu is %u, colocated %u",
                     kvb_pd_model_id(m), src_tp, dst_tp, np, i, got[i], want[i]);
    fx_inst_free(&pre);
    fx_inst_free(&dec);
    free(logits);
}

Test(cache, pd_round_trip_planned_presets)
{
    kvb_pd_model_t *g = fx_preset("tiny-gqa", 3), *a = fx_preset("tiny-mla", 3);
    pd_round_trip(g, 2, 1, 16, 4, 0.0f, transfer_planned);
    pd_round_trip(g, 1, 4, 5, 3, 0.8f, transfer_planned);
    pd_round_trip(a, 2, 1, 17, 4, 0.0f, transfer_planned);
    pd_round_trip(a, 1, 2, 5, 3, 0.8f, transfer_planned);
    kvb_pd_model_free(g);
    kvb_pd_model_free(a);
}

Test(cache, pd_round_trip_mini)
{
    const size_t prompts[] = {1, 15, 16, 17, 32, 40};
    const uint32_t pairs[][2] = {{2, 1}, {1, 2}, {4, 2}, {2, 4}, {2, 2}, {4, 1}};
    for (int k = 0; k < 2; k++) {
        kvb_pd_config_t c = fx_mini(k ? KVB_KV_ATTN_MLA : KVB_KV_ATTN_GQA);
        kvb_pd_model_t *m = fx_model_cfg(&c, 8);
        for (size_t i = 0; i < 6; i++) {
            transfer_fn move = i % 2 ? transfer_by_hand : transfer_planned;
            pd_round_trip(m, pairs[i][0], pairs[i][1], prompts[i], 10, 0.0f, move);
            pd_round_trip(m, pairs[i][1], pairs[i][0], prompts[5 - i], 7, 1.0f, move);
        }
        kvb_pd_model_free(m);
    }
}
