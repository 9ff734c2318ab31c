/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge model: writes a preset's weights to a file (init), describes a weight file (info), and
 * generates text colocated on a TP-N instance (generate) - for humans, and as the reference the
 * PD tests compare disaggregated output against. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/model/model.h"
#include "tools/cli.h"

/* Bounds that keep a colocated run's cache (a few KiB per token for the presets) small. */
#define PROMPT_MAX     (64u << 10)
#define MAX_TOKENS_MAX 65536u

typedef struct {
    const char *preset, *out, *model, *prompt;
    uint64_t seed, sample_seed, max_tokens, tp;
    float temperature;
    int tokens; /* generate: print token ids instead of text */
} model_opts_t;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvbridge model init --preset tiny-gqa|tiny-mla [--seed N] --out FILE\n"
            "       kvbridge model info PRESET|FILE [--seed N]\n"
            "       kvbridge model generate --model PRESET|FILE [--seed N] --prompt TEXT\n"
            "                               --max-tokens N [--tp N] [--temperature T]\n"
            "                               [--sample-seed N] [--tokens]\n\n"
            "The reference model of the PD runtime: a small fp32 transformer (GQA or MLA) whose\n"
            "output is bitwise the same for every TP size.\n\n"
            "  --preset, --model  a built-in preset (tiny-gqa, tiny-mla) or a weight file\n"
            "  --seed N           seed of a preset's weights (default 0)\n"
            "  --prompt TEXT      prompt bytes; a BOS token is put before them\n"
            "  --max-tokens N     tokens to generate at most (generation stops after EOS)\n"
            "  --tp N             TP ranks of the colocated instance (default 1)\n"
            "  --temperature T    0 (default) is greedy; > 0 samples with --sample-seed\n"
            "  --tokens           print the generated token ids instead of the text\n\n"
            "exit status: 0 done, 1 the model or file was refused, 2 bad command line\n");
}

static int bad(const char *fmt, const char *arg)
{
    fprintf(stderr, "kvbridge model: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see kvbridge model --help)\n");
    return 2;
}

static int parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = s && *s ? strtof(s, &end) : NAN;
    if (!s || !*s || errno || *end || !isfinite(v) || v < 0.0f || v > 1e6f)
        return -1;
    *out = v;
    return 0;
}

/* Options that take a value; returns 0, or the exit status for a bad one. */
static int parse_value(model_opts_t *o, const char *opt, const char *v)
{
    uint64_t *num = !strcmp(opt, "--seed")          ? &o->seed
                    : !strcmp(opt, "--sample-seed") ? &o->sample_seed
                    : !strcmp(opt, "--max-tokens")  ? &o->max_tokens
                    : !strcmp(opt, "--tp")          ? &o->tp
                                                    : NULL;
    if (num) {
        uint64_t max = !strcmp(opt, "--max-tokens") ? MAX_TOKENS_MAX
                       : !strcmp(opt, "--tp")       ? 4096
                                                    : UINT64_MAX;
        if (kvb_cli_parse_uint(v, max, num) || (!strcmp(opt, "--tp") && *num == 0))
            return bad("bad value for %s", opt);
        return 0;
    }
    if (!strcmp(opt, "--temperature"))
        return parse_float(v, &o->temperature) ? bad("bad value for %s", opt) : 0;
    const char **str = !strcmp(opt, "--preset")   ? &o->preset
                       : !strcmp(opt, "--out")    ? &o->out
                       : !strcmp(opt, "--model")  ? &o->model
                       : !strcmp(opt, "--prompt") ? &o->prompt
                                                  : NULL;
    if (!str)
        return bad("unknown option %s", opt);
    if (!*v && str != &o->prompt)
        return bad("empty value for %s", opt);
    *str = v;
    return 0;
}

/* True if `opt` is one of the space-separated words of `allowed`. */
static int allowed_opt(const char *allowed, const char *opt)
{
    size_t n = strlen(opt);
    for (const char *p = strstr(allowed, opt); p; p = strstr(p + 1, opt))
        if ((p == allowed || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\0'))
            return 1;
    return 0;
}

/* Parses argv[2..] allowing the options listed in `allowed`; a lone non-option argument goes to
 * *positional (when given). Returns 0, -1 after printing the help, or the exit status 2. */
static int parse(int argc, char **argv, const char *allowed, model_opts_t *o,
                 const char **positional)
{
    *o = (model_opts_t){.tp = 1};
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return -1;
        } else if (a[0] == '-' && a[1] == '-' && !allowed_opt(allowed, a)) {
            return bad("unknown option %s", a);
        } else if (!strcmp(a, "--tokens")) {
            o->tokens = 1;
        } else if (a[0] == '-' && a[1] == '-') {
            if (i + 1 >= argc)
                return bad("%s needs a value", a);
            int rc = parse_value(o, a, argv[++i]);
            if (rc)
                return rc;
        } else if (positional && !*positional) {
            *positional = a;
        } else {
            return bad("unexpected argument '%s'", a);
        }
    }
    return 0;
}

static int cmd_init(int argc, char **argv)
{
    model_opts_t o;
    kvb_pd_model_t *m;
    char why[KVB_PD_REASON_MAX];
    kvb_pd_config_t cfg;
    int rc = parse(argc, argv, "--preset --seed --out", &o, NULL);
    if (rc)
        return rc < 0 ? 0 : rc;
    if (!o.preset || !o.out)
        return bad("%s", "init needs --preset and --out");
    if (kvb_pd_preset_config(o.preset, &cfg))
        return bad("unknown preset '%s' (known: tiny-gqa, tiny-mla)", o.preset);
    if (kvb_pd_model_preset(o.preset, o.seed, &m, why, sizeof why) ||
        kvb_pd_model_save(m, o.out, why, sizeof why)) {
        fprintf(stderr, "kvbridge model init: %s\n", why);
        return 1;
    }
    printf("wrote %s: %s, %llu bytes of weights\n", o.out, kvb_pd_model_id(m),
           (unsigned long long)kvb_pd_model_weight_bytes(m));
    kvb_pd_model_free(m);
    return 0;
}

static void print_info(const char *spec, const kvb_pd_model_t *m)
{
    const kvb_pd_config_t *c = kvb_pd_model_config(m);
    int gqa = c->attn == KVB_KV_ATTN_GQA;
    unsigned long long row = gqa ? 2ull * c->n_kv_heads * c->head_dim
                                 : (unsigned long long)c->kv_lora_rank + c->rope_dim;
    printf("model:      %s\nname:       %s\nid:         %s\n", spec, kvb_pd_model_name(m),
           kvb_pd_model_id(m));
    printf("attention:  %s\nlayers:     %u\nhidden:     %u\nffn:        %u\nvocab:      %u\n",
           gqa ? "GQA" : "MLA", c->n_layers, c->hidden, c->ffn, c->vocab);
    if (gqa)
        printf("heads:      %u query, %u KV, head_dim %u\n", c->n_heads, c->n_kv_heads,
               c->head_dim);
    else
        printf("heads:      %u query, kv_lora_rank %u, rope_dim %u, nope_dim %u, v_head_dim %u\n",
               c->n_heads, c->kv_lora_rank, c->rope_dim, c->nope_dim, c->v_head_dim);
    printf("rope_theta: %g\nnorm_eps:   %g\ntensors:    %zu\nweights:    %llu bytes\n",
           (double)c->rope_theta, (double)c->norm_eps, kvb_pd_model_num_tensors(m),
           (unsigned long long)kvb_pd_model_weight_bytes(m));
    printf("kv cache:   %llu bytes per token (all ranks together%s)\n", row * c->n_layers * 4ull,
           gqa ? "" : "; replicated on every TP rank");
}

static int cmd_info(int argc, char **argv)
{
    model_opts_t o;
    const char *spec = NULL;
    kvb_pd_model_t *m;
    char why[KVB_PD_REASON_MAX];
    int rc = parse(argc, argv, "--seed", &o, &spec);
    if (rc)
        return rc < 0 ? 0 : rc;
    if (!spec)
        return bad("%s", "info needs a preset or a file");
    if (kvb_pd_model_open(spec, o.seed, &m, why, sizeof why)) {
        fprintf(stderr, "kvbridge model info: %s\n", why);
        return 1;
    }
    print_info(spec, m);
    kvb_pd_model_free(m);
    return 0;
}

/* Prints generated bytes: printable ASCII and newlines as they are, anything else as \xNN. */
static void print_text(const uint32_t *toks, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (toks[i] > 255)
            continue;
        if (toks[i] == '\\')
            fputs("\\\\", stdout);
        else if ((toks[i] >= 32 && toks[i] < 127) || toks[i] == '\n')
            putchar((int)toks[i]);
        else
            printf("\\x%02x", toks[i]);
    }
    putchar('\n');
}

static int run_generate(const model_opts_t *o, kvb_pd_model_t *m, uint32_t *prompt, size_t np)
{
    char why[KVB_PD_REASON_MAX];
    size_t n = 0;
    uint32_t *out = malloc((o->max_tokens ? o->max_tokens : 1) * sizeof *out);
    kvb_pd_gen_opts_t g = {.tp = (uint32_t)o->tp,
                           .max_tokens = (uint32_t)o->max_tokens,
                           .temperature = o->temperature,
                           .seed = o->sample_seed};
    if (!out) {
        fprintf(stderr, "kvbridge model generate: out of memory\n");
        return 1;
    }
    int rc = kvb_pd_generate(m, &g, prompt, np, out, &n, why, sizeof why);
    if (rc) {
        fprintf(stderr, "kvbridge model generate: %s\n", why);
    } else if (o->tokens) {
        for (size_t i = 0; i < n; i++)
            printf("%s%u", i ? " " : "", out[i]);
        putchar('\n');
    } else {
        print_text(out, n);
    }
    free(out);
    return rc ? 1 : 0;
}

static int cmd_generate(int argc, char **argv)
{
    model_opts_t o;
    kvb_pd_model_t *m;
    char why[KVB_PD_REASON_MAX];
    size_t np;
    int rc = parse(argc, argv,
                   "--model --seed --prompt --max-tokens --tp --temperature --sample-seed --tokens",
                   &o, NULL);
    if (rc)
        return rc < 0 ? 0 : rc;
    if (!o.model || !o.prompt)
        return bad("%s", "generate needs --model and --prompt");
    if (strlen(o.prompt) > PROMPT_MAX)
        return bad("%s", "prompt is longer than 64 KiB");
    uint32_t *prompt = malloc((strlen(o.prompt) + 1) * sizeof *prompt);
    if (!prompt ||
        kvb_pd_tokenize(o.prompt, strlen(o.prompt), true, prompt, strlen(o.prompt) + 1, &np)) {
        free(prompt);
        fprintf(stderr, "kvbridge model generate: out of memory\n");
        return 1;
    }
    if (kvb_pd_model_open(o.model, o.seed, &m, why, sizeof why)) {
        fprintf(stderr, "kvbridge model generate: %s\n", why);
        free(prompt);
        return 1;
    }
    const kvb_pd_config_t *c = kvb_pd_model_config(m);
    uint32_t split = c->attn == KVB_KV_ATTN_GQA ? c->n_kv_heads : c->n_heads;
    if (split % o.tp)
        rc = bad("--tp must divide the model's %s heads",
                 c->attn == KVB_KV_ATTN_GQA ? "KV" : "query");
    else
        rc = run_generate(&o, m, prompt, np);
    kvb_pd_model_free(m);
    free(prompt);
    return rc;
}

int kvb_cmd_model(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(sub, "init"))
        return cmd_init(argc, argv);
    if (!strcmp(sub, "info"))
        return cmd_info(argc, argv);
    if (!strcmp(sub, "generate"))
        return cmd_generate(argc, argv);
    return bad("unknown subcommand '%s'", sub);
}
