/* SPDX-License-Identifier: Apache-2.0 */
/* What the reference-model modules share: the model and cache structs and the canonical tensor
 * table (reason strings and CRC32C come from common/). Private to src/pd/model/ and its tests (the
 * naive reference forward in the tests reads the weights through these structs).
 *
 * Names in src/pd/: what a folder's interface header (model.h, server.h, proxy.h; auth.h and
 * http.h for what they share) exports to the other programs, the tools and the tests keeps its
 * name (kvb_pd_*, kvb__pd_auth_*, kvb__http_*); a non-static name used only inside one folder is
 * declared in that folder's internal.h as kvb__<folder>_* (macros KVB__<FOLDER>_*): kvb__model_*
 * here, kvb__srv_* in server/, kvb__pxy_* in proxy/. Static functions are short and unprefixed. */
#ifndef KVB_PD_MODEL_INTERNAL_H
#define KVB_PD_MODEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/reason.h"
#include "pd/model/model.h"

#define KVB__MODEL_TENSOR_NAME_MAX 39u /* bytes of a tensor name, without the NUL */
#define KVB__MODEL_ALIGN_FLOATS    16u /* tensors start on 64-byte boundaries in the payload */
#define KVB__MODEL_FILE_HEADER     128u
#define KVB__MODEL_FILE_ENTRY      64u
#define KVB__MODEL_FILE_VERSION    1u

/* One tensor of the canonical table: its name, shape and place in the payload, in floats. */
typedef struct {
    char name[KVB__MODEL_TENSOR_NAME_MAX + 1];
    uint32_t rows, cols;
    uint64_t offset; /* floats from the payload start */
} kvb__model_tensor_t;

/* One layer's weights, pointing into the model's payload. MLA-only and GQA-only ones are NULL
 * for the other kind. Matrices are row-major [rows][cols] and map cols inputs to rows outputs. */
typedef struct {
    const float *attn_norm;
    const float *wq, *wk, *wv;    /* GQA */
    const float *wkv_a, *kv_norm; /* MLA */
    const float *wk_b, *wv_b;     /* MLA */
    const float *wo;              /* both */
    const float *ffn_norm, *ffn_gate, *ffn_up, *ffn_down;
} kvb__model_layer_t;

struct kvb_pd_model {
    kvb_pd_config_t cfg;
    char name[KVB_PD_NAME_MAX + 1];
    char id[KVB_PD_ID_MAX + 1];
    float *data; /* the payload: every tensor at its offset */
    uint64_t payload_bytes;
    uint32_t payload_crc;
    kvb__model_tensor_t *tensors; /* the canonical table */
    size_t num_tensors;
    const float *tok_embd, *out_norm, *lm_head;
    kvb__model_layer_t *layers;
};

struct kvb_pd_cache {
    const kvb_pd_model_t *model;
    uint32_t tp_size, tp_rank, tpb;
    uint32_t heads_held;   /* GQA: KV heads of this rank; MLA: 0 */
    uint32_t token_floats; /* floats of one head (GQA) or one latent row (MLA) of one token */
    uint64_t num_blocks;
    size_t block_floats; /* floats of one block of one slot */
    size_t slot_bytes;   /* bytes of one slot's buffer: num_blocks blocks */
    unsigned char *mem;  /* every slot: GQA layer l's K at 2l, V at 2l+1; MLA layer l at l */
    size_t mem_len;
    kvb_pd_allocator_t alloc;
};

/* Checks a config against the limits and rules of model.h. Returns KVB_OK, or KVB_ERR_INVALID_ARG
 * (KVB_ERR_TOO_LARGE if the weights exceed KVB_PD_WEIGHTS_MAX) with a reason. */
int kvb__model_config_check(const kvb_pd_config_t *cfg, char *reason, size_t reason_cap);

/* The canonical tensor table of a checked config: stores a malloc'd array in *out, its length in
 * *n and the payload size in floats in *floats. Returns KVB_OK or KVB_ERR_NOMEM. */
int kvb__model_tensor_table(const kvb_pd_config_t *cfg, kvb__model_tensor_t **out, size_t *n,
                            uint64_t *floats);

/* Builds a model around a checked config: allocates the zeroed payload and the table, and points
 * the layer structs into it. The caller fills the payload and then calls kvb__model_seal(). */
int kvb__model_alloc(const kvb_pd_config_t *cfg, const char *name, kvb_pd_model_t **out,
                     char *reason, size_t cap);

/* Computes the payload checksum and the model id once the payload is final. */
void kvb__model_seal(kvb_pd_model_t *model);

/* Checks a model name: 1..KVB_PD_NAME_MAX printable ASCII characters. */
int kvb__model_name_check(const char *name, size_t len, char *reason, size_t cap);

/* RMSNorm of x[0..n) times w into out (which may be x), with the model's summation order. */
void kvb__model_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps);

/* Dot product of a[0..n) and b[0..n) in the model's fixed summation order. */
float kvb__model_dot(const float *a, const float *b, size_t n);

#endif
