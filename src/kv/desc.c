/* SPDX-License-Identifier: Apache-2.0 */
/* The JSON descriptor of a KV layout, what a peer fetches when it links. Decoding is strict -
 * exact key sets, types and ranges, bounded size - because the bytes come from another process;
 * a descriptor either yields a valid layout or a reason, never a partial one. */
#include "kv/internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#define INVAL        KVB_ERR_INVALID_ARG
#define DESC_VERSION 1

static const char *const root_keys[] = {"version", "model",        "dtype",      "tokens_per_block",
                                        "attn",    "num_kv_heads", "dp_size",    "dp_rank",
                                        "tp_size", "tp_rank",      "num_layers", "slots",
                                        NULL};

static const char *const slot_keys[] = {"layer",       "kind",       "base",      "len",
                                        "block_bytes", "num_blocks", "num_heads", "head_bytes",
                                        "order",       NULL};

/* Owns a decoded layout and its slots in one allocation; kvb_kv_layout_free() frees it. */
typedef struct {
    kvb_kv_layout_t layout;
    kvb_kv_slot_t slots[];
} owned_layout_t;

/* ---- encoding ---- */

static int set_u64(json_t *o, const char *key, uint64_t v)
{
    if (v > INT64_MAX)
        return KVB_ERR_OVERFLOW;
    return json_object_set_new(o, key, json_integer((json_int_t)v)) ? KVB_ERR_NOMEM : KVB_OK;
}

static int set_str(json_t *o, const char *key, const char *v)
{
    return json_object_set_new(o, key, json_string(v)) ? KVB_ERR_NOMEM : KVB_OK;
}

static json_t *encode_slot(const kvb_kv_slot_t *s, int *rc)
{
    char base[19];
    json_t *o = json_object();
    if (!o) {
        *rc = KVB_ERR_NOMEM;
        return NULL;
    }
    snprintf(base, sizeof base, "0x%" PRIx64, s->base);
    *rc = set_u64(o, "layer", s->layer);
    *rc = *rc ? *rc : set_str(o, "kind", kvb_kv_slot_name(s->kind));
    *rc = *rc ? *rc : set_str(o, "base", base);
    *rc = *rc ? *rc : set_u64(o, "len", s->len);
    *rc = *rc ? *rc : set_u64(o, "block_bytes", s->block_bytes);
    *rc = *rc ? *rc : set_u64(o, "num_blocks", s->num_blocks);
    *rc = *rc ? *rc : set_u64(o, "num_heads", s->num_heads);
    *rc = *rc ? *rc : set_u64(o, "head_bytes", s->head_bytes);
    *rc = *rc ? *rc : set_str(o, "order", kvb__kv_order_name(s->order));
    if (*rc) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static int encode_header(json_t *o, const kvb_kv_layout_t *l)
{
    int rc = set_u64(o, "version", DESC_VERSION);
    rc = rc ? rc : set_str(o, "model", l->model);
    rc = rc ? rc : set_str(o, "dtype", kvb__kv_dtype_name(l->dtype));
    rc = rc ? rc : set_u64(o, "tokens_per_block", l->tokens_per_block);
    rc = rc ? rc : set_str(o, "attn", kvb__kv_attn_name(l->attn));
    rc = rc ? rc : set_u64(o, "num_kv_heads", l->num_kv_heads);
    rc = rc ? rc : set_u64(o, "dp_size", (uint64_t)l->dp_size);
    rc = rc ? rc : set_u64(o, "dp_rank", (uint64_t)l->dp_rank);
    rc = rc ? rc : set_u64(o, "tp_size", (uint64_t)l->tp_size);
    rc = rc ? rc : set_u64(o, "tp_rank", (uint64_t)l->tp_rank);
    rc = rc ? rc : set_u64(o, "num_layers", l->num_layers);
    return rc;
}

static int encode_layout(const kvb_kv_layout_t *l, json_t **out)
{
    json_t *root = json_object(), *slots = json_array();
    int rc = root && slots ? encode_header(root, l) : KVB_ERR_NOMEM;
    for (size_t i = 0; i < l->num_slots && !rc; i++) {
        json_t *s = encode_slot(&l->slots[i], &rc);
        if (s && json_array_append_new(slots, s))
            rc = KVB_ERR_NOMEM;
    }
    if (!rc && json_object_set(root, "slots", slots))
        rc = KVB_ERR_NOMEM;
    json_decref(slots);
    if (rc)
        json_decref(root);
    else
        *out = root;
    return rc;
}

int kvb_kv_layout_encode(const kvb_kv_layout_t *layout, char *buf, size_t cap, size_t *len)
{
    if (!len || (!buf && cap))
        return INVAL;
    int rc = kvb_kv_layout_validate(layout, NULL, 0);
    json_t *root = NULL;
    if (!rc)
        rc = encode_layout(layout, &root);
    if (rc)
        return rc;
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!text)
        return KVB_ERR_NOMEM;
    size_t n = strlen(text);
    *len = n;
    if (cap > n)
        memcpy(buf, text, n + 1);
    free(text);
    return cap > n ? KVB_OK : KVB_ERR_TOO_LARGE;
}

/* ---- decoding ---- */

typedef struct {
    char *reason;
    size_t cap;
    char where[32]; /* "" at the root, "slots[7]." inside a slot */
} dec_t;

static int check_keys(dec_t *d, json_t *o, const char *const *keys)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        size_t i = 0;
        while (keys[i] && strcmp(keys[i], key))
            i++;
        if (!keys[i])
            return kvb__fail(d->reason, d->cap, INVAL, "unknown field '%s%.64s'", d->where, key);
    }
    for (size_t i = 0; keys[i]; i++) {
        if (!json_object_get(o, keys[i]))
            return kvb__fail(d->reason, d->cap, INVAL, "%s%s: missing", d->where, keys[i]);
    }
    return KVB_OK;
}

static int get_uint(dec_t *d, json_t *o, const char *key, uint64_t max, uint64_t *out)
{
    json_t *v = json_object_get(o, key);
    json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
    if (x < 0 || (uint64_t)x > max)
        return kvb__fail(d->reason, d->cap, INVAL, "%s%s: expected an integer in 0..%" PRIu64,
                         d->where, key, max);
    *out = (uint64_t)x;
    return KVB_OK;
}

static int get_u32(dec_t *d, json_t *o, const char *key, uint32_t *out)
{
    uint64_t v = 0;
    int rc = get_uint(d, o, key, UINT32_MAX, &v);
    if (!rc)
        *out = (uint32_t)v;
    return rc;
}

static int get_i32(dec_t *d, json_t *o, const char *key, int32_t *out)
{
    uint64_t v = 0;
    int rc = get_uint(d, o, key, INT32_MAX, &v);
    if (!rc)
        *out = (int32_t)v;
    return rc;
}

static int get_str(dec_t *d, json_t *o, const char *key, const char **out)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_string(v))
        return kvb__fail(d->reason, d->cap, INVAL, "%s%s: expected a string", d->where, key);
    *out = json_string_value(v);
    return KVB_OK;
}

/* A name looked up with `parse`; the int-typed out keeps one helper for every enum. */
static int get_enum(dec_t *d, json_t *o, const char *key, int (*parse)(const char *, int *),
                    int *out)
{
    const char *s = NULL; /* set whenever rc is 0; GCC cannot see kvb__fail never returns 0 */
    int rc = get_str(d, o, key, &s);
    if (!rc && parse(s, out))
        rc = kvb__fail(d->reason, d->cap, INVAL, "%s%s: unknown value '%.32s'", d->where, key, s);
    return rc;
}

#define ENUM_PARSER(name, type, fn)                                                                \
    static int name(const char *s, int *out)                                                       \
    {                                                                                              \
        type v;                                                                                    \
        if (fn(s, &v))                                                                             \
            return -1;                                                                             \
        *out = (int)v;                                                                             \
        return 0;                                                                                  \
    }
ENUM_PARSER(parse_dtype, kvb_kv_dtype_t, kvb__kv_dtype_parse)
ENUM_PARSER(parse_attn, kvb_kv_attn_t, kvb__kv_attn_parse)
ENUM_PARSER(parse_order, kvb_kv_order_t, kvb__kv_order_parse)
ENUM_PARSER(parse_slot, kvb_kv_slot_kind_t, kvb__kv_slot_parse)

/* "0x" and 1 to 16 hex digits, nothing else. */
static int get_addr(dec_t *d, json_t *o, const char *key, uint64_t *out)
{
    const char *s = NULL; /* set whenever rc is 0; GCC cannot see kvb__fail never returns 0 */
    int rc = get_str(d, o, key, &s);
    if (rc)
        return rc;
    size_t n = strlen(s);
    uint64_t v = 0;
    int ok = n > 2 && n <= 18 && s[0] == '0' && s[1] == 'x';
    for (size_t i = 2; ok && i < n; i++) {
        char c = s[i];
        int digit = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
        ok = digit >= 0;
        v = (v << 4) | (uint64_t)(digit & 0xf);
    }
    if (!ok)
        return kvb__fail(d->reason, d->cap, INVAL, "%s%s: expected \"0x\" and 1..16 hex digits",
                         d->where, key);
    *out = v;
    return KVB_OK;
}

static int decode_slot(dec_t *d, json_t *o, kvb_kv_slot_t *s)
{
    int kind = 0, order = 0;
    if (!json_is_object(o))
        return kvb__fail(d->reason, d->cap, INVAL, "%.*s: expected an object",
                         (int)strlen(d->where) - 1, d->where); /* without the '.' */
    int rc = check_keys(d, o, slot_keys);
    rc = rc ? rc : get_u32(d, o, "layer", &s->layer);
    rc = rc ? rc : get_enum(d, o, "kind", parse_slot, &kind);
    rc = rc ? rc : get_addr(d, o, "base", &s->base);
    rc = rc ? rc : get_uint(d, o, "len", INT64_MAX, &s->len);
    rc = rc ? rc : get_uint(d, o, "block_bytes", INT64_MAX, &s->block_bytes);
    rc = rc ? rc : get_uint(d, o, "num_blocks", INT64_MAX, &s->num_blocks);
    rc = rc ? rc : get_u32(d, o, "num_heads", &s->num_heads);
    rc = rc ? rc : get_u32(d, o, "head_bytes", &s->head_bytes);
    rc = rc ? rc : get_enum(d, o, "order", parse_order, &order);
    s->kind = (kvb_kv_slot_kind_t)kind;
    s->order = (kvb_kv_order_t)order;
    return rc;
}

static int decode_header(dec_t *d, json_t *o, kvb_kv_layout_t *l)
{
    uint64_t version = 0;
    const char *model = NULL; /* both set whenever rc is 0 */
    int dtype = 0, attn = 0;
    int rc = get_uint(d, o, "version", UINT32_MAX, &version);
    if (!rc && version != DESC_VERSION)
        rc =
            kvb__fail(d->reason, d->cap, INVAL, "unsupported descriptor version %" PRIu64, version);
    rc = rc ? rc : get_str(d, o, "model", &model);
    if (!rc && strlen(model) > KVB_KV_MODEL_MAX)
        rc = kvb__fail(d->reason, d->cap, INVAL, "model: longer than %d bytes", KVB_KV_MODEL_MAX);
    if (!rc)
        strcpy(l->model, model);
    rc = rc ? rc : get_enum(d, o, "dtype", parse_dtype, &dtype);
    rc = rc ? rc : get_u32(d, o, "tokens_per_block", &l->tokens_per_block);
    rc = rc ? rc : get_enum(d, o, "attn", parse_attn, &attn);
    rc = rc ? rc : get_u32(d, o, "num_kv_heads", &l->num_kv_heads);
    rc = rc ? rc : get_i32(d, o, "dp_size", &l->dp_size);
    rc = rc ? rc : get_i32(d, o, "dp_rank", &l->dp_rank);
    rc = rc ? rc : get_i32(d, o, "tp_size", &l->tp_size);
    rc = rc ? rc : get_i32(d, o, "tp_rank", &l->tp_rank);
    rc = rc ? rc : get_u32(d, o, "num_layers", &l->num_layers);
    l->dtype = (kvb_kv_dtype_t)dtype;
    l->attn = (kvb_kv_attn_t)attn;
    return rc;
}

static int decode_root(dec_t *d, json_t *root, owned_layout_t **out)
{
    if (!json_is_object(root))
        return kvb__fail(d->reason, d->cap, INVAL, "descriptor is not a JSON object");
    int rc = check_keys(d, root, root_keys);
    json_t *slots = json_object_get(root, "slots");
    if (!rc && !json_is_array(slots))
        rc = kvb__fail(d->reason, d->cap, INVAL, "slots: expected an array");
    size_t n = rc ? 0 : json_array_size(slots);
    if (!rc && (n == 0 || n > (size_t)KVB_KV_LAYERS_MAX * KVB_KV_SLOT_COUNT))
        rc = kvb__fail(d->reason, d->cap, INVAL, "slots: %zu entries, expected 1..%d", n,
                       KVB_KV_LAYERS_MAX * KVB_KV_SLOT_COUNT);
    if (rc)
        return rc;
    owned_layout_t *o = calloc(1, sizeof *o + n * sizeof o->slots[0]);
    if (!o)
        return kvb__fail(d->reason, d->cap, KVB_ERR_NOMEM, "out of memory");
    rc = decode_header(d, root, &o->layout);
    for (size_t i = 0; i < n && !rc; i++) {
        snprintf(d->where, sizeof d->where, "slots[%zu].", i);
        rc = decode_slot(d, json_array_get(slots, i), &o->slots[i]);
    }
    o->layout.slots = o->slots;
    o->layout.num_slots = n;
    if (rc)
        free(o);
    else
        *out = o;
    return rc;
}

/* The owned layout, then the semantic rules every layout obeys. */
static int decode_and_validate(dec_t *d, json_t *root, kvb_kv_layout_t **out)
{
    owned_layout_t *o = NULL;
    char msg[KVB_KV_REASON_MAX];
    int rc = decode_root(d, root, &o);
    if (rc)
        return rc;
    rc = kvb_kv_layout_validate(&o->layout, msg, sizeof msg);
    if (rc) {
        free(o);
        return kvb__fail(d->reason, d->cap, rc, "invalid layout: %s", msg);
    }
    *out = &o->layout;
    return KVB_OK;
}

int kvb_kv_layout_decode(const char *json, size_t len, kvb_kv_layout_t **out, char *reason,
                         size_t reason_cap)
{
    dec_t d = {.reason = reason, .cap = reason_cap};
    json_error_t err;
    if (!out || (!json && len))
        return kvb__fail(reason, reason_cap, INVAL, "json and out must not be NULL");
    if (len > KVB_KV_DESC_MAX)
        return kvb__fail(reason, reason_cap, KVB_ERR_TOO_LARGE,
                         "descriptor is %zu bytes, the limit is %u", len, KVB_KV_DESC_MAX);
    json_t *root = json_loadb(json ? json : "", len, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return kvb__fail(reason, reason_cap, INVAL, "malformed JSON at line %d column %d: %s",
                         err.line, err.column, err.text);
    int rc = decode_and_validate(&d, root, out);
    json_decref(root);
    if (!rc)
        kvb__reason_clear(reason, reason_cap);
    return rc;
}

void kvb_kv_layout_free(kvb_kv_layout_t *layout)
{
    /* The layout is the first member of its owned_layout_t, so this frees the slots too. */
    free(layout);
}
