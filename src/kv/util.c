/* SPDX-License-Identifier: Apache-2.0 */
/* Reason strings and enum names shared by the KV modules. The names are also the spellings of the
 * JSON descriptor, so they never change once released. */
#include "kv/internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const slot_names[KVB_KV_SLOT_COUNT] = {
    [KVB_KV_SLOT_K] = "K",
    [KVB_KV_SLOT_V] = "V",
    [KVB_KV_SLOT_LATENT] = "LATENT",
    [KVB_KV_SLOT_INDEX] = "INDEX",
    [KVB_KV_SLOT_K_SCALE] = "K_SCALE",
    [KVB_KV_SLOT_V_SCALE] = "V_SCALE",
};

static const char *const dtype_names[] = {
    [KVB_KV_DTYPE_FP32] = "fp32",         [KVB_KV_DTYPE_FP16] = "fp16",
    [KVB_KV_DTYPE_BF16] = "bf16",         [KVB_KV_DTYPE_FP8_E4M3] = "fp8_e4m3",
    [KVB_KV_DTYPE_FP8_E5M2] = "fp8_e5m2", [KVB_KV_DTYPE_INT8] = "int8",
    [KVB_KV_DTYPE_UINT8] = "uint8",
};

static const char *const attn_names[] = {
    [KVB_KV_ATTN_GQA] = "gqa",
    [KVB_KV_ATTN_MLA] = "mla",
};

static const char *const order_names[] = {
    [KVB_KV_ORDER_NONE] = "NONE",
    [KVB_KV_ORDER_HND] = "HND",
    [KVB_KV_ORDER_NHD] = "NHD",
};

#define COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

/* Enum values are read as unsigned so that a negative value from a careless caller is simply out
 * of range. Gaps (index 0 of dtype and attn) hold NULL. */
static const char *name_of(const char *const *names, size_t n, unsigned v)
{
    return v < n ? names[v] : NULL;
}

static int parse_name(const char *const *names, size_t n, const char *s, unsigned *out)
{
    for (unsigned v = 0; s && v < n; v++) {
        if (names[v] && !strcmp(names[v], s)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

const char *kvb_kv_slot_name(kvb_kv_slot_kind_t kind)
{
    const char *n = name_of(slot_names, COUNT_OF(slot_names), (unsigned)kind);
    return n ? n : "?";
}

const char *kvb__kv_dtype_name(kvb_kv_dtype_t dtype)
{
    return name_of(dtype_names, COUNT_OF(dtype_names), (unsigned)dtype);
}

const char *kvb__kv_attn_name(kvb_kv_attn_t attn)
{
    return name_of(attn_names, COUNT_OF(attn_names), (unsigned)attn);
}

const char *kvb__kv_order_name(kvb_kv_order_t order)
{
    return name_of(order_names, COUNT_OF(order_names), (unsigned)order);
}

int kvb__kv_dtype_parse(const char *s, kvb_kv_dtype_t *out)
{
    unsigned v;
    if (parse_name(dtype_names, COUNT_OF(dtype_names), s, &v))
        return -1;
    *out = (kvb_kv_dtype_t)v;
    return 0;
}

int kvb__kv_attn_parse(const char *s, kvb_kv_attn_t *out)
{
    unsigned v;
    if (parse_name(attn_names, COUNT_OF(attn_names), s, &v))
        return -1;
    *out = (kvb_kv_attn_t)v;
    return 0;
}

int kvb__kv_order_parse(const char *s, kvb_kv_order_t *out)
{
    unsigned v;
    if (parse_name(order_names, COUNT_OF(order_names), s, &v))
        return -1;
    *out = (kvb_kv_order_t)v;
    return 0;
}

int kvb__kv_slot_parse(const char *s, kvb_kv_slot_kind_t *out)
{
    unsigned v;
    if (parse_name(slot_names, COUNT_OF(slot_names), s, &v))
        return -1;
    *out = (kvb_kv_slot_kind_t)v;
    return 0;
}

int kvb__kv_slot_fail(char *reason, size_t cap, int status, const kvb_kv_slot_t *slot,
                      const char *fmt, ...)
{
    char msg[KVB_KV_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvb__fail(reason, cap, status, "layer %u slot %s: %s", (unsigned)slot->layer,
                     kvb_kv_slot_name(slot->kind), msg);
}
