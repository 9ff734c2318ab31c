/* SPDX-License-Identifier: Apache-2.0 */
/* The paged KV cache: an instance's block pool (free list), sequences' block tables, and each TP
 * rank's cache buffers, laid out exactly as the kvb_kv_layout_t that describes them so that the
 * KV layer can move blocks between instances without knowing anything about the model. */
#include "pd/model/internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

#define INVAL KVB_ERR_INVALID_ARG

/* ---- Block pool ------------------------------------------------------------------------------ */

struct kvb_pd_blocks {
    pthread_mutex_t lock; /* request threads allocate and free concurrently */
    uint32_t *free_ids;   /* stack: free_ids[0 .. n_free) */
    uint64_t n_free, num_blocks;
    unsigned char *used; /* used[id]: allocated */
};

int kvb_pd_blocks_create(uint64_t num_blocks, kvb_pd_blocks_t **out)
{
    if (!out || num_blocks == 0 || num_blocks > UINT32_MAX)
        return INVAL;
    kvb_pd_blocks_t *p = calloc(1, sizeof *p);
    if (!p)
        return KVB_ERR_NOMEM;
    p->free_ids = malloc((size_t)num_blocks * sizeof *p->free_ids);
    p->used = calloc((size_t)num_blocks, 1);
    if (!p->free_ids || !p->used || pthread_mutex_init(&p->lock, NULL)) {
        free(p->free_ids);
        free(p->used);
        free(p);
        return KVB_ERR_NOMEM;
    }
    /* Pushed in reverse so that a fresh pool hands out 0, 1, 2, ... */
    for (uint64_t i = 0; i < num_blocks; i++)
        p->free_ids[i] = (uint32_t)(num_blocks - 1 - i);
    p->n_free = p->num_blocks = num_blocks;
    *out = p;
    return KVB_OK;
}

void kvb_pd_blocks_destroy(kvb_pd_blocks_t *p)
{
    if (!p)
        return;
    pthread_mutex_destroy(&p->lock);
    free(p->free_ids);
    free(p->used);
    free(p);
}

int kvb_pd_blocks_alloc(kvb_pd_blocks_t *p, size_t n, uint64_t *ids)
{
    if (!p || (n && !ids))
        return INVAL;
    pthread_mutex_lock(&p->lock);
    int rc = n > p->n_free ? KVB_ERR_NOMEM : KVB_OK;
    for (size_t i = 0; !rc && i < n; i++) {
        uint32_t id = p->free_ids[--p->n_free];
        p->used[id] = 1;
        ids[i] = id;
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int kvb_pd_blocks_free(kvb_pd_blocks_t *p, const uint64_t *ids, size_t n)
{
    if (!p || (n && !ids))
        return INVAL;
    pthread_mutex_lock(&p->lock);
    /* Check everything first (marking with 2 to catch an id listed twice), then free. */
    size_t i = 0;
    for (; i < n && ids[i] < p->num_blocks && p->used[ids[i]] == 1; i++)
        p->used[ids[i]] = 2;
    int rc = i == n ? KVB_OK : INVAL;
    for (size_t k = 0; k < i; k++) {
        p->used[ids[k]] = rc ? 1 : 0;
        if (!rc)
            p->free_ids[p->n_free++] = (uint32_t)ids[k];
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

uint64_t kvb_pd_blocks_available(kvb_pd_blocks_t *p)
{
    pthread_mutex_lock(&p->lock);
    uint64_t n = p->n_free;
    pthread_mutex_unlock(&p->lock);
    return n;
}

/* ---- Sequences ------------------------------------------------------------------------------- */

void kvb_pd_seq_init(kvb_pd_seq_t *seq)
{
    memset(seq, 0, sizeof *seq);
}

uint64_t kvb_pd_blocks_for(uint64_t tokens, uint32_t tpb)
{
    return tokens / tpb + (tokens % tpb != 0);
}

int kvb_pd_seq_reserve(kvb_pd_seq_t *seq, kvb_pd_blocks_t *pool, uint32_t tpb, uint64_t tokens)
{
    if (!seq || !pool || tpb == 0 || tokens > UINT32_MAX)
        return INVAL;
    uint64_t need = kvb_pd_blocks_for(tokens, tpb);
    if (need <= seq->num_blocks)
        return KVB_OK;
    if (seq->num_blocks && seq->cap == 0)
        return INVAL; /* the caller's own table: we may not grow it */
    if (need > seq->cap) {
        size_t cap = seq->cap ? seq->cap : 4;
        while (cap < need)
            cap *= 2;
        uint64_t *b = realloc(seq->blocks, cap * sizeof *b);
        if (!b)
            return KVB_ERR_NOMEM;
        seq->blocks = b;
        seq->cap = cap;
    }
    int rc =
        kvb_pd_blocks_alloc(pool, (size_t)(need - seq->num_blocks), seq->blocks + seq->num_blocks);
    if (rc == KVB_OK)
        seq->num_blocks = (size_t)need;
    return rc;
}

int kvb_pd_seq_release(kvb_pd_seq_t *seq, kvb_pd_blocks_t *pool)
{
    int rc = KVB_OK;
    if (!seq)
        return INVAL;
    if (seq->cap) {
        rc = pool ? kvb_pd_blocks_free(pool, seq->blocks, seq->num_blocks) : INVAL;
        free(seq->blocks);
    }
    kvb_pd_seq_init(seq);
    return rc;
}

/* ---- Per-rank caches ------------------------------------------------------------------------- */

static void *default_alloc(void *user, size_t len)
{
    (void)user;
    return calloc(1, len);
}

static void default_free(void *user, void *ptr, size_t len)
{
    (void)user;
    (void)len;
    free(ptr);
}

static size_t slot_count(const kvb_pd_config_t *c)
{
    return (size_t)c->n_layers * (c->attn == KVB_KV_ATTN_GQA ? 2 : 1);
}

/* Checks the TP split and fills the cache's geometry. */
static int geometry(kvb_pd_cache_t *c, const kvb_pd_config_t *cfg, char *r, size_t cap)
{
    uint32_t split = cfg->attn == KVB_KV_ATTN_GQA ? cfg->n_kv_heads : cfg->n_heads;
    if (c->tp_size == 0 || c->tp_size > KVB_KV_TP_MAX || split % c->tp_size ||
        c->tp_rank >= c->tp_size)
        return kvb__fail(r, cap, INVAL,
                         "TP %u rank %u does not split the model's %u %s heads evenly", c->tp_size,
                         c->tp_rank, split, cfg->attn == KVB_KV_ATTN_GQA ? "KV" : "query");
    if (c->tpb == 0 || c->num_blocks == 0 || c->num_blocks > UINT32_MAX)
        return kvb__fail(r, cap, INVAL, "tokens per block and block count must be positive");
    if (cfg->attn == KVB_KV_ATTN_GQA) {
        c->heads_held = cfg->n_kv_heads / c->tp_size;
        c->token_floats = cfg->head_dim;
    } else {
        c->token_floats = cfg->kv_lora_rank + cfg->rope_dim;
    }
    uint64_t bf, bytes, total;
    if (kvb__mul_u64((uint64_t)(c->heads_held ? c->heads_held : 1) * c->tpb, c->token_floats,
                     &bf) ||
        kvb__mul_u64(bf * sizeof(float), c->num_blocks, &bytes) ||
        kvb__mul_u64(bytes, slot_count(cfg), &total) || total > SIZE_MAX)
        return kvb__fail(r, cap, KVB_ERR_OVERFLOW, "cache size overflows");
    c->block_floats = (size_t)bf;
    c->slot_bytes = (size_t)bytes;
    c->mem_len = (size_t)total;
    return KVB_OK;
}

int kvb_pd_cache_create(const kvb_pd_model_t *model, uint32_t tp_size, uint32_t tp_rank,
                        uint64_t num_blocks, uint32_t tokens_per_block,
                        const kvb_pd_allocator_t *alloc, kvb_pd_cache_t **out, char *r, size_t cap)
{
    if (!model || !out)
        return kvb__fail(r, cap, INVAL, "model or out is NULL");
    if (alloc && (!alloc->alloc || !alloc->free))
        return kvb__fail(r, cap, INVAL, "allocator lacks alloc or free");
    kvb_pd_cache_t *c = calloc(1, sizeof *c);
    if (!c)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    *c = (kvb_pd_cache_t){
        .model = model,
        .tp_size = tp_size,
        .tp_rank = tp_rank,
        .tpb = tokens_per_block ? tokens_per_block : KVB_PD_TOKENS_PER_BLOCK,
        .num_blocks = num_blocks,
        .alloc =
            alloc ? *alloc : (kvb_pd_allocator_t){.alloc = default_alloc, .free = default_free}};
    int rc = geometry(c, &model->cfg, r, cap);
    if (!rc && !(c->mem = c->alloc.alloc(c->alloc.user, c->mem_len)))
        rc = kvb__fail(r, cap, KVB_ERR_NOMEM, "cannot allocate %zu bytes of KV cache", c->mem_len);
    if (rc) {
        free(c);
        return rc;
    }
    kvb__reason_clear(r, cap);
    *out = c;
    return KVB_OK;
}

void kvb_pd_cache_destroy(kvb_pd_cache_t *c)
{
    if (!c)
        return;
    c->alloc.free(c->alloc.user, c->mem, c->mem_len);
    free(c);
}

size_t kvb_pd_cache_num_slots(const kvb_pd_cache_t *c)
{
    return slot_count(&c->model->cfg);
}

void *kvb_pd_cache_memory(const kvb_pd_cache_t *c, size_t *len)
{
    if (len)
        *len = c->mem_len;
    return c->mem;
}

uint64_t kvb_pd_cache_num_blocks(const kvb_pd_cache_t *c)
{
    return c->num_blocks;
}

uint32_t kvb_pd_cache_tokens_per_block(const kvb_pd_cache_t *c)
{
    return c->tpb;
}

int kvb_pd_cache_layout(const kvb_pd_cache_t *c, int32_t dp_size, int32_t dp_rank,
                        kvb_kv_layout_t *layout, kvb_kv_slot_t *slots, size_t slots_cap, char *r,
                        size_t cap)
{
    const kvb_pd_config_t *cfg = &c->model->cfg;
    size_t n = slot_count(cfg);
    if (!layout || (n && !slots) || slots_cap < n)
        return kvb__fail(r, cap, INVAL, "room for %zu slots needed", n);
    int gqa = cfg->attn == KVB_KV_ATTN_GQA;
    *layout = (kvb_kv_layout_t){.dtype = KVB_KV_DTYPE_FP32,
                                .tokens_per_block = c->tpb,
                                .attn = cfg->attn,
                                .num_kv_heads = gqa ? cfg->n_kv_heads : 0,
                                .dp_size = dp_size,
                                .dp_rank = dp_rank,
                                .tp_size = (int32_t)c->tp_size,
                                .tp_rank = (int32_t)c->tp_rank,
                                .num_layers = cfg->n_layers,
                                .slots = slots,
                                .num_slots = n};
    snprintf(layout->model, sizeof layout->model, "%s", c->model->id);
    for (size_t i = 0; i < n; i++)
        slots[i] = (kvb_kv_slot_t){
            .layer = (uint32_t)(gqa ? i / 2 : i),
            .kind = gqa ? (i % 2 ? KVB_KV_SLOT_V : KVB_KV_SLOT_K) : KVB_KV_SLOT_LATENT,
            .base = (uint64_t)(uintptr_t)(c->mem + i * c->slot_bytes),
            .len = c->slot_bytes,
            .block_bytes = c->block_floats * sizeof(float),
            .num_blocks = c->num_blocks,
            .num_heads = gqa ? c->heads_held : 0,
            .head_bytes = gqa ? c->token_floats * (uint32_t)sizeof(float) : 0,
            .order = gqa ? KVB_KV_ORDER_HND : KVB_KV_ORDER_NONE};
    return kvb_kv_layout_validate(layout, r, cap);
}
