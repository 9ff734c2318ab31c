/* SPDX-License-Identifier: Apache-2.0 */
/* The PD runtime's reference model: a small fp32 decoder-only transformer (GQA or MLA attention)
 * with a byte-level tokenizer, seeded presets, a checked weight-file format, a paged KV cache per
 * TP rank stored in the KV layer's layouts, a TP-invariant forward pass and a sampler.
 *
 * Determinism is the point: every number is computed by one code path in a fixed order, so the
 * logits (and so the tokens) of a sequence are bitwise the same for any TP size dividing the head
 * counts, for prefill of n tokens or n decode steps, and after the cache has been copied between
 * instances of different TP. That makes a PD-disaggregated answer comparable token for token with
 * a colocated one. The guarantee holds within one build; across machines it also needs the same
 * libm and the same floating-point contraction (x86-64 baseline code has no FMA).
 *
 * Thread safety: a model is immutable after creation and may be shared by any number of threads.
 * A block pool (kvb_pd_blocks_t) is thread-safe. Caches and sequences are not: one forward pass at
 * a time per sequence, and concurrent passes only on disjoint blocks.
 *
 * ---- Model --------------------------------------------------------------------------------------
 * Token ids 0..255 are bytes, KVB_PD_BOS and KVB_PD_EOS follow; vocab >= 258 (ids above 257 are
 * never produced by the tokenizer). Per layer, with x the residual stream of `hidden` floats:
 *   h = RMSNorm(x) * attn_norm;  x += Attn(h);  h = RMSNorm(x) * ffn_norm;
 *   x += ffn_down (silu(ffn_gate h) * (ffn_up h))
 * then logits = lm_head (RMSNorm(x) * out_norm). RMSNorm(x) = x / sqrt(mean(x^2) + norm_eps).
 * RoPE is NeoX style (dimension i pairs with i + d/2), angle = pos * rope_theta^(-2i/d), computed
 * in double and rounded to float.
 *   GQA: q = wq h (n_heads x head_dim), k = wk h, v = wv h (n_kv_heads x head_dim); RoPE on all
 *        of q and k; query head j attends with KV head j / (n_heads / n_kv_heads), scale
 *        1/sqrt(head_dim). The cache holds k (after RoPE) and v.
 *   MLA: q = wq h (n_heads x (nope_dim + rope_dim)), RoPE on each head's last rope_dim;
 *        kv = wkv_a h; c = RMSNorm(kv[0, rank)) * kv_norm (the latent, rank = kv_lora_rank);
 *        kr = RoPE(kv[rank, rank + rope_dim)) (one key shared by all heads). The cache holds
 *        [c, kr] per token. Head j: k_nope = wk_b[j] c, v = wv_b[j] c, score = (q_nope . k_nope +
 *        q_rope . kr) / sqrt(nope_dim + rope_dim). It is computed in the absorbed form
 *        (q_nope through wk_b[j]^T, the softmax-weighted latent through wv_b[j]), which is the
 *        same function with other rounding.
 *   Both: the attention output is wo applied to the heads' outputs. To stay TP invariant, each
 *        query head's share of wo (its head_dim or v_head_dim columns) is applied separately and
 *        the per-head contributions are summed in global head order, whatever rank owns them.
 *
 * ---- Preset weights -----------------------------------------------------------------------------
 * Tensor k (its index in the tensor table below) is drawn from SplitMix64 started at state
 * mix(seed ^ mix(k + 1)), where mix is SplitMix64's output function. Each value takes one draw r:
 * u = (r >> 40) * 2^-24, w = (2u - 1) * a, so w is uniform in [-a, a) with a = sqrt(3) * std
 * (rounded to float). std: tok_embd 1; matrices 1/sqrt(cols); lm_head rows of printable ASCII
 * (32..126) 4/sqrt(hidden), other rows 1/(4 sqrt(hidden)) so that random models mostly emit
 * readable characters. Norm weights are 1.
 *
 * ---- Weight file (version 1), all integers little-endian, floats IEEE-754 binary32 LE ----------
 *   offset size  field
 *   0      8     magic "KVBMODEL"
 *   8      4     version = 1
 *   12     4     header_bytes: bytes before the payload, 128 + 64 * n_tensors (so the payload
 *                starts 64-byte aligned)
 *   16     4     attn (1 GQA, 2 MLA)
 *   20     4*11  n_layers, hidden, ffn, vocab, n_heads, n_kv_heads, head_dim, kv_lora_rank,
 *                nope_dim, rope_dim, v_head_dim (fields of the other attention kind are 0)
 *   64     4     rope_theta (f32)
 *   68     4     norm_eps (f32)
 *   72     32    name: 1..31 printable ASCII characters but space and '@', NUL padded
 *   104    4     n_tensors
 *   108    4     payload_crc: CRC32C (Castagnoli) of the payload bytes
 *   112    8     payload_bytes
 *   120    4     reserved, 0
 *   124    4     header_crc: CRC32C of bytes [0, header_bytes) with these 4 bytes taken as 0
 *   128    64*n  tensor table, one entry per tensor:
 *                  0 char[40] name, NUL padded;  40 u32 rows;  44 u32 cols;
 *                  48 u64 offset (from the payload start, a multiple of 64);  56 u64 nbytes
 *   header_bytes  payload_bytes  payload: each tensor's rows x cols floats, row-major, at its
 *                offset, zero padding between tensors; the file ends with the payload.
 * The tensor table must be exactly the canonical one for the config, in this order:
 *   tok_embd [vocab x hidden]; per layer L ("blk.L."): attn_norm [1 x hidden];
 *   GQA: wq [n_heads*head_dim x hidden], wk and wv [n_kv_heads*head_dim x hidden],
 *        wo [hidden x n_heads*head_dim];
 *   MLA: wq [n_heads*(nope_dim+rope_dim) x hidden], wkv_a [kv_lora_rank+rope_dim x hidden],
 *        kv_norm [1 x kv_lora_rank], wk_b [n_heads*nope_dim x kv_lora_rank],
 *        wv_b [n_heads*v_head_dim x kv_lora_rank], wo [hidden x n_heads*v_head_dim];
 *   ffn_norm [1 x hidden], ffn_gate and ffn_up [ffn x hidden], ffn_down [hidden x ffn];
 *   then out_norm [1 x hidden], lm_head [vocab x hidden].
 * A loader refuses, with a reason: a short file, a bad magic, another version, a bad header
 * checksum, config values out of range or inconsistent, a table entry that differs from the
 * canonical one (or whose size overflows), a file longer or shorter than header + payload, a bad
 * payload checksum, and non-finite weights.
 *
 * ---- Paged KV cache -----------------------------------------------------------------------------
 * An instance of TP size N owns one block pool (the free list of block ids) and N caches, one per
 * rank, each with the same number of blocks of tokens_per_block positions, so a sequence's block
 * table is valid on every rank. Position p of a sequence lives in block blocks[p / tpb] at slot
 * p % tpb. Per rank and layer:
 *   GQA: a K and a V buffer; a block is [heads_held][tpb][head_dim] floats (HND), heads_held =
 *        n_kv_heads / N, rank r holding KV heads [r * heads_held, (r + 1) * heads_held).
 *   MLA: one LATENT buffer; a block is [tpb][kv_lora_rank + rope_dim] floats, the same on every
 *        rank.
 * kvb_pd_cache_layout() describes exactly this as a kvb_kv_layout_t. */
#ifndef KVB_PD_MODEL_H
#define KVB_PD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvbridge/kv.h"
#include "kvbridge/status.h"

#define KVB_PD_BOS              256u
#define KVB_PD_EOS              257u
#define KVB_PD_VOCAB_MIN        258u
#define KVB_PD_TOKENS_PER_BLOCK 16u /* the default tokens per block */

/* Limits on a config (and so on a file); products are bounded by KVB_PD_WEIGHTS_MAX too. */
#define KVB_PD_LAYERS_MAX  256u
#define KVB_PD_DIM_MAX     16384u /* hidden, ffn, head dims, kv_lora_rank */
#define KVB_PD_HEADS_MAX   1024u  /* n_heads, n_kv_heads */
#define KVB_PD_VOCAB_MAX   (1u << 20)
#define KVB_PD_WEIGHTS_MAX (1ull << 32)           /* payload bytes */
#define KVB_PD_NAME_MAX    31u                    /* bytes of a model name, without the NUL */
#define KVB_PD_ID_MAX      (KVB_PD_NAME_MAX + 10) /* "name@crc32c-hex" */
#define KVB_PD_REASON_MAX  256u

/* The shape of a model. Fields of the other attention kind are 0. */
typedef struct {
    kvb_kv_attn_t attn;
    uint32_t n_layers;
    uint32_t hidden;     /* width of the residual stream */
    uint32_t ffn;        /* SwiGLU inner width */
    uint32_t vocab;      /* >= KVB_PD_VOCAB_MIN */
    uint32_t n_heads;    /* query heads */
    uint32_t n_kv_heads; /* GQA: KV heads, dividing n_heads */
    uint32_t head_dim;   /* GQA: q, k, v head width, even (RoPE) */
    uint32_t kv_lora_rank, nope_dim, rope_dim, v_head_dim; /* MLA; rope_dim even */
    float rope_theta;                                      /* > 1 */
    float norm_eps;                                        /* in (0, 1) */
} kvb_pd_config_t;

typedef struct kvb_pd_model kvb_pd_model_t;
typedef struct kvb_pd_cache kvb_pd_cache_t;
typedef struct kvb_pd_blocks kvb_pd_blocks_t;

/* ---- Configs and models ---------------------------------------------------------------------- */

/* The config of a built-in preset ("tiny-gqa": 4 layers, hidden 256, ffn 512, 8 heads, 4 KV
 * heads of 32; "tiny-mla": the same with MLA, 8 heads, kv_lora_rank 64, rope_dim 16, nope and v
 * head dims 32). Returns KVB_OK or KVB_ERR_NOT_FOUND. */
int kvb_pd_preset_config(const char *preset, kvb_pd_config_t *out);

/* Creates a model of config `cfg` named `name` (1..KVB_PD_NAME_MAX printable ASCII characters,
 * no space or '@') with weights drawn from `seed` as described above. Returns KVB_OK,
 * KVB_ERR_INVALID_ARG, KVB_ERR_TOO_LARGE or KVB_ERR_NOMEM with a reason; *out is set only on
 * success. */
int kvb_pd_model_random(const kvb_pd_config_t *cfg, const char *name, uint64_t seed,
                        kvb_pd_model_t **out, char *reason, size_t reason_cap);

/* kvb_pd_model_random() with a preset's config, named after the preset. KVB_ERR_NOT_FOUND for an
 * unknown preset. */
int kvb_pd_model_preset(const char *preset, uint64_t seed, kvb_pd_model_t **out, char *reason,
                        size_t reason_cap);

/* Parses a weight file held in memory (`buf` need not outlive the call). Returns KVB_OK,
 * KVB_ERR_INVALID_ARG (malformed: the reason says what), KVB_ERR_OVERFLOW (a tensor's byte size
 * overflows), KVB_ERR_UNSUPPORTED (another version), KVB_ERR_TOO_LARGE (weights over the limit)
 * or KVB_ERR_NOMEM; *out is set only on success. */
int kvb_pd_model_parse(const void *buf, size_t len, kvb_pd_model_t **out, char *reason,
                       size_t reason_cap);

/* Reads and parses the weight file at `path`. Errors as kvb_pd_model_parse(), plus
 * KVB_ERR_SYSTEM when the file cannot be read (the reason has the path and errno text). */
int kvb_pd_model_load(const char *path, kvb_pd_model_t **out, char *reason, size_t reason_cap);

/* A preset with `seed` if `spec` names one, else the file at `spec` (seed unused): what a
 * `--model PRESET|FILE` option means. */
int kvb_pd_model_open(const char *spec, uint64_t seed, kvb_pd_model_t **out, char *reason,
                      size_t reason_cap);

/* Writes the model as a weight file at `path` (created or truncated, mode 0644), through a
 * temporary file renamed into place so that readers never see half a file. Returns KVB_OK or
 * KVB_ERR_SYSTEM / KVB_ERR_NOMEM with a reason. */
int kvb_pd_model_save(const kvb_pd_model_t *model, const char *path, char *reason,
                      size_t reason_cap);

/* Frees a model. Every cache made for it must be destroyed first. NULL is ignored. */
void kvb_pd_model_free(kvb_pd_model_t *model);

/* The model's config; valid as long as the model. */
const kvb_pd_config_t *kvb_pd_model_config(const kvb_pd_model_t *model);

/* The model's name (the preset's, or the file's name field). */
const char *kvb_pd_model_name(const kvb_pd_model_t *model);

/* The model id used in KV layouts: "name@xxxxxxxx", the payload's CRC32C in hex, so that two
 * instances link only if their weights are the same, whether they came from a preset or a file. */
const char *kvb_pd_model_id(const kvb_pd_model_t *model);

/* Bytes of the weights (the file's payload) and the number of tensors. */
uint64_t kvb_pd_model_weight_bytes(const kvb_pd_model_t *model);
size_t kvb_pd_model_num_tensors(const kvb_pd_model_t *model);

/* ---- Block pool: the free list of one instance ------------------------------------------------
 */

/* Creates a pool of block ids 0 .. num_blocks-1, all free. Returns KVB_OK, KVB_ERR_INVALID_ARG
 * (num_blocks 0 or over UINT32_MAX) or KVB_ERR_NOMEM. */
int kvb_pd_blocks_create(uint64_t num_blocks, kvb_pd_blocks_t **out);

/* Frees the pool (allocated ids are simply forgotten). NULL is ignored. */
void kvb_pd_blocks_destroy(kvb_pd_blocks_t *pool);

/* Takes `n` free ids into ids[0..n), all or nothing; a fresh pool hands out 0, 1, 2, ... and
 * reuses freed ids last-freed first. Returns KVB_OK, or KVB_ERR_NOMEM if fewer than n are free. */
int kvb_pd_blocks_alloc(kvb_pd_blocks_t *pool, size_t n, uint64_t *ids);

/* Returns ids[0..n) to the pool, all or nothing: KVB_ERR_INVALID_ARG if one is out of range, not
 * allocated, or listed twice. */
int kvb_pd_blocks_free(kvb_pd_blocks_t *pool, const uint64_t *ids, size_t n);

/* Free ids now. */
uint64_t kvb_pd_blocks_available(kvb_pd_blocks_t *pool);

/* ---- Sequences: a block table and how many positions are cached -------------------------------
 */

/* A sequence's block table, shared by all ranks of an instance: blocks[i] holds positions
 * [i * tpb, (i + 1) * tpb). `len` positions have their K/V (or latent) in the cache; a forward
 * pass appends after them. The table may be the caller's own array (cap 0) or grown by
 * kvb_pd_seq_reserve(). */
typedef struct {
    uint64_t *blocks;
    size_t num_blocks;
    size_t cap; /* entries allocated by kvb_pd_seq_reserve(); 0: `blocks` is the caller's */
    uint32_t len;
} kvb_pd_seq_t;

/* An empty sequence. */
void kvb_pd_seq_init(kvb_pd_seq_t *seq);

/* Blocks needed for `tokens` positions: ceil(tokens / tpb) (tpb > 0). */
uint64_t kvb_pd_blocks_for(uint64_t tokens, uint32_t tpb);

/* Grows the table from `pool` until it covers `tokens` positions. Returns KVB_OK,
 * KVB_ERR_NOMEM (pool or memory exhausted; the table is unchanged), KVB_ERR_INVALID_ARG
 * (tokens over UINT32_MAX, tpb 0, or a table the caller owns that is too short). */
int kvb_pd_seq_reserve(kvb_pd_seq_t *seq, kvb_pd_blocks_t *pool, uint32_t tpb, uint64_t tokens);

/* Gives the table's blocks back to `pool` (when it allocated them: cap > 0), frees the table and
 * empties the sequence. Returns the pool's status. */
int kvb_pd_seq_release(kvb_pd_seq_t *seq, kvb_pd_blocks_t *pool);

/* ---- Per-rank KV cache ------------------------------------------------------------------------
 */

/* Who provides a cache's memory. alloc returns `len` zero-filled bytes aligned for floats, or
 * NULL; free releases them. A server passes a wrapper of kvb_alloc()/kvb_free() so that the
 * buffers can be mapped by same-host peers. */
typedef struct {
    void *(*alloc)(void *user, size_t len);
    void (*free)(void *user, void *ptr, size_t len);
    void *user;
} kvb_pd_allocator_t;

/* Creates rank `tp_rank` of `tp_size`'s cache of `num_blocks` blocks of `tokens_per_block`
 * positions (0: KVB_PD_TOKENS_PER_BLOCK) for `model`, in one allocation from `alloc` (NULL:
 * calloc). tp_size must divide the KV heads (GQA) or the query heads (MLA). Returns KVB_OK,
 * KVB_ERR_INVALID_ARG, KVB_ERR_OVERFLOW or KVB_ERR_NOMEM with a reason. `model` and `alloc->user`
 * must outlive the cache. */
int kvb_pd_cache_create(const kvb_pd_model_t *model, uint32_t tp_size, uint32_t tp_rank,
                        uint64_t num_blocks, uint32_t tokens_per_block,
                        const kvb_pd_allocator_t *alloc, kvb_pd_cache_t **out, char *reason,
                        size_t reason_cap);

/* Frees the cache's memory through its allocator. NULL is ignored. */
void kvb_pd_cache_destroy(kvb_pd_cache_t *cache);

/* Slots the cache's layout has: 2 per layer for GQA (K, V), 1 for MLA (LATENT). */
size_t kvb_pd_cache_num_slots(const kvb_pd_cache_t *cache);

/* Fills *layout and slots[0..kvb_pd_cache_num_slots()) with the rank's cache as the KV layer
 * sees it (dtype FP32, model id kvb_pd_model_id(), this rank's tp_size/tp_rank, the given dp
 * group), then validates it. layout->slots points at `slots`, which the caller owns. Returns
 * KVB_OK, KVB_ERR_INVALID_ARG (slots_cap too small, bad dp) or the validation's error, with a
 * reason. */
int kvb_pd_cache_layout(const kvb_pd_cache_t *cache, int32_t dp_size, int32_t dp_rank,
                        kvb_kv_layout_t *layout, kvb_kv_slot_t *slots, size_t slots_cap,
                        char *reason, size_t reason_cap);

/* The cache's memory: one buffer of *len bytes holding every slot, for registration. */
void *kvb_pd_cache_memory(const kvb_pd_cache_t *cache, size_t *len);

uint64_t kvb_pd_cache_num_blocks(const kvb_pd_cache_t *cache);
uint32_t kvb_pd_cache_tokens_per_block(const kvb_pd_cache_t *cache);

/* ---- Forward pass -----------------------------------------------------------------------------
 */

/* Called once per layer, in order, as soon as that layer's K/V (or latent) of every new position
 * is written on every rank - before the layer's attention - so a prefill server can start moving
 * layer L while L+1 is computed. */
typedef struct {
    void (*on_layer_done)(uint32_t layer, void *user);
    void *user;
} kvb_pd_hook_t;

/* Runs tokens[0..n_tokens) at positions seq->len .. seq->len + n_tokens - 1 of the sequence
 * through the model on an instance of `tp` ranks: caches[r] must be rank r of tp, made for this
 * model, all with the same block count and tokens per block. Appends every layer's K/V (or
 * latent) of those positions into each rank's blocks of seq's table, advances seq->len, and
 * writes the last position's vocab logits into `logits` (may be NULL). Prefill is one call with
 * the prompt, decode one call per token; the results are the same bitwise. `hook` may be NULL.
 * Returns KVB_OK, KVB_ERR_INVALID_ARG (bad token, block id, rank set, or a table that does not
 * cover the positions) or KVB_ERR_NOMEM with a reason; nothing is written on error. */
int kvb_pd_forward(const kvb_pd_model_t *model, kvb_pd_cache_t *const *caches, uint32_t tp,
                   kvb_pd_seq_t *seq, const uint32_t *tokens, size_t n_tokens, float *logits,
                   const kvb_pd_hook_t *hook, char *reason, size_t reason_cap);

/* One decode step of n sequences as one pass (continuous batching): tokens[i] at position
 * seqs[i]->len of sequence i, whose table must cover it; the vocab logits of each into
 * logits[i]; every seq->len advanced. Each sequence's logits and cache writes are bitwise what
 * kvb_pd_forward() of that token alone gives. The sequences must be distinct and use disjoint
 * blocks. Returns as kvb_pd_forward() does; nothing is written on error. */
int kvb_pd_forward_batch(const kvb_pd_model_t *model, kvb_pd_cache_t *const *caches, uint32_t tp,
                         kvb_pd_seq_t *const *seqs, const uint32_t *tokens, size_t n,
                         float *const *logits, char *reason, size_t reason_cap);

/* ---- Tokenizer and sampler --------------------------------------------------------------------
 */

/* Byte-level tokens of text[0..len), after a BOS when add_bos. Stores up to `cap` ids and the
 * full count in *n; returns KVB_OK, or KVB_ERR_TOO_LARGE when cap was short. */
int kvb_pd_tokenize(const char *text, size_t len, bool add_bos, uint32_t *out, size_t cap,
                    size_t *n);

/* The bytes of tokens[0..n) (ids >= 256 are skipped) into out (up to cap bytes, no NUL).
 * Returns the number of bytes the full text has. */
size_t kvb_pd_detokenize(const uint32_t *tokens, size_t n, char *out, size_t cap);

/* Picks the next token from `vocab` logits. temperature 0: the largest logit, the lowest id on a
 * tie (NaN counts as -inf). temperature > 0: id i with probability proportional to
 * exp((logit_i - max) / temperature) (computed in double, summed in id order), using the uniform
 * u = (mix(seed + (step + 1) * 0x9E3779B97F4A7C15) >> 11) * 2^-53 (mix: SplitMix64's output
 * function): the first id whose running sum exceeds u * total. `step` is the index of the token
 * within the answer (0 for the first), so a decode instance continues the prefill's stream from
 * (seed, step) without carrying any state. Returns KVB_OK or KVB_ERR_INVALID_ARG (negative or
 * NaN temperature, vocab 0). */
int kvb_pd_sample(const float *logits, uint32_t vocab, float temperature, uint64_t seed,
                  uint64_t step, uint32_t *token);

/* ---- Colocated generation ---------------------------------------------------------------------
 */

typedef struct {
    uint32_t tp;               /* ranks (0: 1) */
    uint32_t tokens_per_block; /* 0: KVB_PD_TOKENS_PER_BLOCK */
    uint32_t max_tokens;       /* tokens to generate at most */
    float temperature;         /* 0: greedy */
    uint64_t seed;             /* sampling seed */
} kvb_pd_gen_opts_t;

/* Generates up to opts->max_tokens tokens after `prompt` (n_prompt >= 1) on a private instance of
 * opts->tp ranks with calloc'd caches: one prefill pass, then one decode pass per token, sampling
 * token i with kvb_pd_sample(..., seed, i). Stops after an EOS, which is stored. `out` holds
 * max_tokens ids; *n_out receives how many were generated. Returns KVB_OK or an error of
 * kvb_pd_cache_create() / kvb_pd_forward() with a reason. */
int kvb_pd_generate(const kvb_pd_model_t *model, const kvb_pd_gen_opts_t *opts,
                    const uint32_t *prompt, size_t n_prompt, uint32_t *out, size_t *n_out,
                    char *reason, size_t reason_cap);

#endif
