/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge topo: runs the topology guard on a prefill/decode pair given on the command line and
 * prints, for every decode dp group, which prefill rank sends what to which decode rank - the
 * routing the KV layer will use, so operators can check a deployment before starting it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvbridge/kv.h"
#include "tools/cli.h"

typedef struct {
    kvb_kv_topo_t prefill, decode;
    int have_prefill, have_decode;
    const char *attn, *order, *heads; /* as given; NULL when absent */
    int push, json;
} topo_opts_t;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvbridge topo --prefill dp=D,tp=T --decode dp=D,tp=T --attn mla|gqa\n"
            "                     [--kv-heads N] [--order hnd|nhd] [--mode pull|push] [--json]\n\n"
            "Checks whether a prefill and a decode deployment can exchange KV blocks and prints\n"
            "the guard's verdict, its reason, and for every decode dp group which prefill local\n"
            "rank sends which KV heads (GQA) or whole blocks (MLA) to which decode local rank.\n\n"
            "  --prefill, --decode  dp and tp size of each side\n"
            "  --attn               mla (latent replicated over TP) or gqa (MHA/GQA, heads split)\n"
            "  --kv-heads N         gqa: the model's KV head count (required for gqa)\n"
            "  --order              gqa: in-block order, hnd (default) or nhd\n"
            "  --mode               pull (decode reads; default) or push (prefill writes)\n"
            "  --json               print one JSON object {status, reason, routes}\n\n"
            "exit status: 0 allowed, 1 denied or invalid topology, 2 bad command line\n");
}

static int bad(const char *fmt, const char *arg)
{
    fprintf(stderr, "kvbridge topo: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see kvbridge topo --help)\n");
    return 2;
}

/* Sets *out from "N" for key dp/tp of "dp=D,tp=T"; keys once each, in any order. */
static int parse_field(const char *tok, size_t n, int32_t *dp, int32_t *tp)
{
    char buf[32];
    uint64_t v;
    if (n >= sizeof buf)
        return -1;
    memcpy(buf, tok, n);
    buf[n] = '\0';
    char *eq = strchr(buf, '=');
    if (!eq || kvb_cli_parse_uint(eq + 1, INT32_MAX, &v))
        return -1;
    *eq = '\0';
    int32_t *slot = !strcmp(buf, "dp") ? dp : !strcmp(buf, "tp") ? tp : NULL;
    if (!slot || *slot >= 0)
        return -1;
    *slot = (int32_t)v;
    return 0;
}

static int parse_group(const char *s, kvb_kv_topo_t *t)
{
    int32_t dp = -1, tp = -1;
    while (s && *s) {
        const char *comma = strchr(s, ',');
        size_t n = comma ? (size_t)(comma - s) : strlen(s);
        if (parse_field(s, n, &dp, &tp))
            return -1;
        s = comma ? comma + 1 : s + n;
        if (comma && !*s)
            return -1;
    }
    if (dp < 0 || tp < 0)
        return -1;
    t->dp_size = dp;
    t->tp_size = tp;
    return 0;
}

/* Handles one option that takes a value; returns 2 on a bad value, 0 otherwise. */
static int take_value(topo_opts_t *o, const char *name, const char *val)
{
    if (!strcmp(name, "--prefill") || !strcmp(name, "--decode")) {
        int pre = name[2] == 'p';
        if (parse_group(val, pre ? &o->prefill : &o->decode))
            return bad("%s: expected dp=D,tp=T with non-negative integers", name);
        *(pre ? &o->have_prefill : &o->have_decode) = 1;
    } else if (!strcmp(name, "--attn")) {
        o->attn = val;
    } else if (!strcmp(name, "--kv-heads")) {
        o->heads = val;
    } else if (!strcmp(name, "--order")) {
        o->order = val;
    } else { /* --mode, the last option is_valued() accepts */
        if (strcmp(val, "pull") && strcmp(val, "push"))
            return bad("--mode: expected pull or push, got '%s'", val);
        o->push = !strcmp(val, "push");
    }
    return 0;
}

static int is_valued(const char *name)
{
    static const char *const names[] = {"--prefill", "--decode", "--attn", "--kv-heads",
                                        "--order",   "--mode",   NULL};
    for (int i = 0; names[i]; i++) {
        if (!strcmp(name, names[i]))
            return 1;
    }
    return 0;
}

/* Returns 0 to go on, 2 on a bad command line, -1 after --help. */
static int parse_args(int argc, char **argv, topo_opts_t *o)
{
    for (int i = 1; i < argc; i++) {
        char name[16];
        const char *arg = argv[i], *eq = strchr(arg, '='), *val;
        size_t n = eq ? (size_t)(eq - arg) : strlen(arg);
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h"))
            return -1;
        if (!strcmp(arg, "--json")) {
            o->json = 1;
            continue;
        }
        if (n >= sizeof name)
            return bad("unknown option '%s'", arg);
        memcpy(name, arg, n);
        name[n] = '\0';
        if (!is_valued(name))
            return bad("unknown option '%s'", arg);
        if (!eq && i + 1 >= argc)
            return bad("%s needs a value", name);
        val = eq ? eq + 1 : argv[++i];
        if (take_value(o, name, val))
            return 2;
    }
    return 0;
}

/* Fills attention kind, heads and order into both topologies from the parsed options. */
static int finish_topos(topo_opts_t *o)
{
    kvb_kv_topo_t *p = &o->prefill, *d = &o->decode;
    uint64_t heads = 0;
    if (!o->have_prefill || !o->have_decode || !o->attn)
        return bad("%s", "--prefill, --decode and --attn are required");
    if (strcmp(o->attn, "mla") && strcmp(o->attn, "gqa") && strcmp(o->attn, "mha"))
        return bad("--attn: expected mla or gqa, got '%s'", o->attn);
    int mla = !strcmp(o->attn, "mla");
    if (mla && (o->heads || o->order))
        return bad("%s", "--kv-heads and --order apply to gqa only");
    if (!mla && !o->heads)
        return bad("%s", "--attn gqa needs --kv-heads N");
    if (o->heads && kvb_cli_parse_uint(o->heads, UINT32_MAX, &heads))
        return bad("--kv-heads: expected a non-negative integer, got '%s'", o->heads);
    kvb_kv_order_t order = mla ? KVB_KV_ORDER_NONE : KVB_KV_ORDER_HND;
    if (o->order && strcmp(o->order, "hnd") && strcmp(o->order, "nhd"))
        return bad("--order: expected hnd or nhd, got '%s'", o->order);
    if (o->order && !strcmp(o->order, "nhd"))
        order = KVB_KV_ORDER_NHD;
    p->attn = d->attn = mla ? KVB_KV_ATTN_MLA : KVB_KV_ATTN_GQA;
    p->num_kv_heads = d->num_kv_heads = (uint32_t)heads;
    p->order = d->order = order;
    return 0;
}

static void print_route_text(const kvb_kv_topo_t *d, int32_t dd, const kvb_kv_route_t *r, int push)
{
    char what[48] = "whole blocks";
    if (r->head_end)
        snprintf(what, sizeof what, "heads [%u, %u)", (unsigned)r->head_begin,
                 (unsigned)r->head_end);
    long long global = (long long)dd * d->tp_size + r->dst_rank;
    if (push)
        printf("  prefill rank %d writes %s to decode rank %d (global %lld)\n", (int)r->src_rank,
               what, (int)r->dst_rank, global);
    else
        printf("  decode rank %d (global %lld) reads %s from prefill rank %d\n", (int)r->dst_rank,
               global, what, (int)r->src_rank);
}

static void print_route_json(const kvb_kv_route_t *r, int32_t dd, int first)
{
    printf("%s{\"dst_dp\": %d, \"src_rank\": %d, \"dst_rank\": %d, \"heads\": ", first ? "" : ", ",
           (int)dd, (int)r->src_rank, (int)r->dst_rank);
    if (r->head_end)
        printf("[%u, %u]}", (unsigned)r->head_begin, (unsigned)r->head_end);
    else
        printf("null}");
}

/* Prints every decode dp group's routes; returns 0, or 1 if they cannot be computed. */
static int print_routes(const topo_opts_t *o)
{
    size_t cap = (size_t)o->prefill.tp_size + (size_t)o->decode.tp_size, n;
    kvb_kv_route_t *v = malloc(cap * sizeof *v);
    int first = 1;
    if (!v)
        return 1;
    for (int32_t dd = 0; dd < o->decode.dp_size; dd++) {
        if (kvb_kv_route(&o->prefill, &o->decode, dd, v, cap, &n) || n > cap) {
            free(v);
            return 1;
        }
        if (!o->json)
            printf("decode dp %d:\n", (int)dd);
        for (size_t i = 0; i < n; i++, first = 0) {
            if (o->json)
                print_route_json(&v[i], dd, first);
            else
                print_route_text(&o->decode, dd, &v[i], o->push);
        }
    }
    free(v);
    return 0;
}

/* The reason as a JSON string literal (quotes and escapes included). */
static void print_json_string(const char *s)
{
    json_t *j = json_string(s);
    char *text = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    fputs(text ? text : "\"\"", stdout);
    free(text);
    json_decref(j);
}

static int report(const topo_opts_t *o)
{
    char reason[KVB_KV_REASON_MAX];
    /* The guard's local side is the one issuing the requests: decode when pulling, prefill when
     * pushing. It only decides which side an INVALID_* verdict names. */
    const kvb_kv_topo_t *local = o->push ? &o->prefill : &o->decode;
    const kvb_kv_topo_t *remote = o->push ? &o->decode : &o->prefill;
    kvb_kv_verdict_t v = kvb_kv_guard_topo(local, remote, reason, sizeof reason);
    int allowed = v == KVB_KV_ALLOW_HOMO || v == KVB_KV_ALLOW_HETERO;
    if (o->json) {
        printf("{\"status\": \"%s\", \"reason\": ", kvb_kv_verdict_name(v));
        print_json_string(reason);
        printf(", \"routes\": [");
    } else {
        printf("status: %s\nreason: %s\nmode: %s (local side: %s)\n", kvb_kv_verdict_name(v),
               reason, o->push ? "push" : "pull", o->push ? "prefill" : "decode");
    }
    int rc = allowed ? print_routes(o) : 1;
    if (o->json)
        printf("]}\n");
    return rc;
}

int kvb_cmd_topo(int argc, char **argv)
{
    topo_opts_t o = {0};
    int rc = parse_args(argc, argv, &o);
    if (rc < 0) {
        usage(stdout);
        return 0;
    }
    if (rc || finish_topos(&o))
        return 2;
    return report(&o);
}
