/* SPDX-License-Identifier: Apache-2.0 */
/* `kvbridge loadgen`: closed-loop load on a completions endpoint (proxy or instance) from C
 * threads; reports TTFT and TPOT percentiles, tokens/s and errors, optionally as one JSON line. */
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "pd/proxy.h"
#include "tools/cli.h"

#define CONC_MAX 1024u

typedef struct {
    const char *url;
    uint32_t conc, requests, prompt_len, max_tokens, timeout_ms;
    bool stream, json;
} lg_opts_t;

typedef struct {
    const lg_opts_t *o;
    atomic_uint next; /* requests handed out */
    pthread_mutex_t mu;
    double *ttft, *tpot; /* ms, one per successful request */
    size_t n_ok, n_err;
    uint64_t tokens;
    char first_error[KVB_PD_ERR_MAX + 32];
} lg_t;

static void usage(FILE *f)
{
    fprintf(f, "usage: kvbridge loadgen --url URL --concurrency C --requests N --prompt-len L\n"
               "                        --max-tokens M [--stream] [--json] [--timeout-ms T]\n\n"
               "C threads send N completions in all (prompt of L bytes, M tokens each, greedy).\n"
               "With --stream, TTFT and TPOT are measured here from the events; without it they\n"
               "are the answers' kvbridge stats. --json adds one JSON object as the last line.\n");
}

/* Request i's prompt: L printable bytes, different per request so that nothing is cached. */
static char *body_for(const lg_opts_t *o, uint32_t i)
{
    char *p = malloc((size_t)o->prompt_len + 1);
    if (!p)
        return NULL;
    for (uint32_t k = 0; k < o->prompt_len; k++)
        p[k] = (char)('a' + (k * 31 + i * 7) % 26);
    p[o->prompt_len] = '\0';
    json_t *j = json_pack("{s:s, s:i, s:b, s:i}", "prompt", p, "max_tokens", (int)o->max_tokens,
                          "stream", o->stream, "timeout_ms", (int)o->timeout_ms);
    free(p);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void record(lg_t *lg, const kvb_pd_completion_t *c)
{
    pthread_mutex_lock(&lg->mu);
    if (!c->ok) {
        if (!lg->n_err++)
            snprintf(lg->first_error, sizeof lg->first_error, "HTTP %ld: %s", c->status, c->error);
    } else {
        size_t n = c->n_tokens ? c->n_tokens : c->completion_tokens;
        double ttft = c->streamed ? c->client_ttft_ms : c->ttft_ms;
        double tpot = c->tpot_ms;
        if (c->streamed && n > 1)
            tpot = (c->client_total_ms - c->client_ttft_ms) / (double)(n - 1);
        lg->ttft[lg->n_ok] = ttft;
        lg->tpot[lg->n_ok] = tpot;
        lg->n_ok++;
        lg->tokens += n;
    }
    pthread_mutex_unlock(&lg->mu);
}

static void *worker(void *arg)
{
    lg_t *lg = arg;
    uint32_t i;
    while ((i = atomic_fetch_add(&lg->next, 1)) < lg->o->requests) {
        char *body = body_for(lg->o, i);
        kvb_pd_completion_t c;
        if (body)
            kvb_pd_complete(lg->o->url, body, lg->o->timeout_ms, &c);
        else
            memset(&c, 0, sizeof c);
        record(lg, &c);
        kvb_pd_completion_free(&c);
        free(body);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted v[0..n). */
static double pct(const double *v, size_t n, double p)
{
    if (!n)
        return 0.0;
    size_t k = (size_t)(p / 100.0 * (double)n + 0.999999);
    return v[k ? k - 1 : 0];
}

static void report(lg_t *lg, double secs)
{
    qsort(lg->ttft, lg->n_ok, sizeof *lg->ttft, cmp_double);
    qsort(lg->tpot, lg->n_ok, sizeof *lg->tpot, cmp_double);
    double t50 = pct(lg->ttft, lg->n_ok, 50), t99 = pct(lg->ttft, lg->n_ok, 99);
    double p50 = pct(lg->tpot, lg->n_ok, 50), p99 = pct(lg->tpot, lg->n_ok, 99);
    double tps = secs > 0 ? (double)lg->tokens / secs : 0.0;
    printf("requests %zu ok, %zu errors in %.2f s (concurrency %u, prompt %u bytes, %u tokens%s)\n",
           lg->n_ok, lg->n_err, secs, lg->o->conc, lg->o->prompt_len, lg->o->max_tokens,
           lg->o->stream ? ", streamed" : "");
    printf("TTFT ms   p50 %8.2f   p99 %8.2f\n", t50, t99);
    printf("TPOT ms   p50 %8.3f   p99 %8.3f\n", p50, p99);
    printf("tokens/s  %.1f\n", tps);
    if (lg->n_err)
        printf("first error: %s\n", lg->first_error);
    if (lg->o->json)
        printf("{\"url\":\"%s\",\"concurrency\":%u,\"requests\":%u,\"prompt_len\":%u,"
               "\"max_tokens\":%u,\"stream\":%s,\"ok\":%zu,\"errors\":%zu,\"seconds\":%.3f,"
               "\"ttft_ms_p50\":%.3f,\"ttft_ms_p99\":%.3f,\"tpot_ms_p50\":%.4f,"
               "\"tpot_ms_p99\":%.4f,\"tokens_per_s\":%.1f}\n",
               lg->o->url, lg->o->conc, lg->o->requests, lg->o->prompt_len, lg->o->max_tokens,
               lg->o->stream ? "true" : "false", lg->n_ok, lg->n_err, secs, t50, t99, p50, p99,
               tps);
    fflush(stdout);
}

static int parse_num(const char *opt, const char *val, uint64_t lo, uint64_t hi, uint32_t *out)
{
    uint64_t v;
    if (!val || kvb_cli_parse_uint(val, hi, &v) || v < lo) {
        fprintf(stderr, "kvbridge loadgen: %s wants an integer in [%llu, %llu]\n", opt,
                (unsigned long long)lo, (unsigned long long)hi);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int parse(lg_opts_t *o, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--stream") || !strcmp(a, "--json")) {
            *(a[2] == 's' ? &o->stream : &o->json) = true;
            continue;
        }
        if (!strcmp(a, "--url"))
            o->url = v, rc = v ? 0 : -1;
        else if (!strcmp(a, "--concurrency"))
            rc = parse_num(a, v, 1, CONC_MAX, &o->conc);
        else if (!strcmp(a, "--requests"))
            rc = parse_num(a, v, 1, 10000000, &o->requests);
        else if (!strcmp(a, "--prompt-len"))
            rc = parse_num(a, v, 0, KVB_PD_PROXY_BODY_MAX / 2, &o->prompt_len);
        else if (!strcmp(a, "--max-tokens"))
            rc = parse_num(a, v, 1, KVB_PD_SERVER_MAX_TOKENS, &o->max_tokens);
        else if (!strcmp(a, "--timeout-ms"))
            rc = parse_num(a, v, 1, 3600000, &o->timeout_ms);
        else
            rc = -1;
        if (rc) {
            fprintf(stderr, "kvbridge loadgen: bad or incomplete option '%s'\n", a);
            return -1;
        }
        i++;
    }
    if (!o->url) {
        fprintf(stderr, "kvbridge loadgen: --url is required\n");
        return -1;
    }
    return 0;
}

static int run(const lg_opts_t *o)
{
    lg_t lg = {.o = o};
    pthread_t th[CONC_MAX];
    uint32_t started = 0;
    lg.ttft = calloc(o->requests, sizeof *lg.ttft);
    lg.tpot = calloc(o->requests, sizeof *lg.tpot);
    if (!lg.ttft || !lg.tpot || kvb_pd_client_init()) {
        fprintf(stderr, "kvbridge loadgen: out of memory\n");
        free(lg.ttft);
        free(lg.tpot);
        return 1;
    }
    pthread_mutex_init(&lg.mu, NULL);
    uint64_t t0 = kvb__now_ns();
    for (; started < o->conc; started++)
        if (pthread_create(&th[started], NULL, worker, &lg))
            break;
    if (!started)
        worker(&lg);
    for (uint32_t i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    report(&lg, (double)(kvb__now_ns() - t0) / 1e9);
    pthread_mutex_destroy(&lg.mu);
    free(lg.ttft);
    free(lg.tpot);
    return lg.n_err ? 1 : 0;
}

int kvb_cmd_loadgen(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
    lg_opts_t o = {
        .conc = 4, .requests = 32, .prompt_len = 64, .max_tokens = 16, .timeout_ms = 60000};
    if (parse(&o, argc, argv)) {
        usage(stderr);
        return 2;
    }
    return run(&o);
}
