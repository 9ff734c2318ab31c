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
#include "kvbridge/status.h"
#include "pd/auth.h"
#include "pd/proxy/proxy.h"
#include "tools/cli.h"

#define CONC_MAX  1024u
#define KINDS_MAX 16u /* error kinds told apart; more are counted as "other" */

typedef struct {
    const char *url;
    const char *compare;      /* a reference instance, or NULL */
    const char *api_key_file; /* its first key goes to --url as a bearer key, or NULL */
    const char *api_key;      /* that key, loaded */
    uint32_t conc, requests, prompt_len, max_tokens, timeout_ms;
    bool stream, json;
} lg_opts_t;

/* One kind of error ("HTTP 503 queue_full", "timeout", ...), its count and its first message. */
typedef struct {
    char name[64];
    size_t n;
    char first[KVB_PD_ERR_MAX];
} lg_kind_t;

typedef struct {
    const lg_opts_t *o;
    atomic_uint next; /* requests handed out */
    pthread_mutex_t mu;
    double *ttft, *tpot; /* ms, one per successful request */
    size_t n_ok, n_err;
    uint64_t tokens;
    lg_kind_t kinds[KINDS_MAX + 1]; /* the last: "other" */
    size_t n_kinds;
    size_t compared, differ, ref_err; /* --compare: answers compared, differing, reference failed */
    char first_differ[256];
} lg_t;

static void usage(FILE *f)
{
    fprintf(f, "usage: kvbridge loadgen --url URL --concurrency C --requests N --prompt-len L\n"
               "                        --max-tokens M [--stream] [--json] [--timeout-ms T]\n"
               "                        [--compare REF_URL] [--api-key-file PATH]\n\n"
               "C threads send N completions in all (prompt of L bytes, M tokens each, greedy).\n"
               "With --stream, TTFT and TPOT are measured here from the events; without it they\n"
               "are the answers' kvbridge stats. Errors are counted by kind (HTTP status and the\n"
               "instance's reason, timeout, no response, broken stream). --compare sends every\n"
               "prompt to REF_URL too (a colocated instance, not timed) and counts the answers\n"
               "whose tokens differ. --api-key-file sends the file's first key (the format of\n"
               "serve's and proxy's --api-key-file) to URL as \"Authorization: Bearer\" (not to\n"
               "REF_URL). --json adds one JSON object as the last line.\n"
               "exit status: 0 no error and no difference, 1 otherwise, 2 bad command line\n");
}

/* Request i's prompt: L printable bytes, different per request so that nothing is cached. */
static char *body_for(const lg_opts_t *o, uint32_t i, bool stream)
{
    char *p = malloc((size_t)o->prompt_len + 1);
    if (!p)
        return NULL;
    for (uint32_t k = 0; k < o->prompt_len; k++)
        p[k] = (char)('a' + (k * 31 + i * 7) % 26);
    p[o->prompt_len] = '\0';
    json_t *j = json_pack("{s:s, s:i, s:b, s:i}", "prompt", p, "max_tokens", (int)o->max_tokens,
                          "stream", stream, "timeout_ms", (int)o->timeout_ms);
    free(p);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* The kind of a failed completion: "HTTP <status>[ <reason>]", or the reason alone when no
 * status came (timeout, no_response) or a 200 stream failed. */
static void kind_of(const kvb_pd_completion_t *c, char *out, size_t cap)
{
    if (c->status == 0 || (c->status == 200 && c->reason[0]))
        snprintf(out, cap, "%s", c->reason[0] ? c->reason : "no_response");
    else
        snprintf(out, cap, "HTTP %ld%s%s", c->status, c->reason[0] ? " " : "", c->reason);
}

/* Caller holds lg->mu. */
static void count_error(lg_t *lg, const kvb_pd_completion_t *c)
{
    char name[64];
    kind_of(c, name, sizeof name);
    size_t i = 0;
    while (i < lg->n_kinds && strcmp(lg->kinds[i].name, name))
        i++;
    if (i == lg->n_kinds) {
        i = lg->n_kinds < KINDS_MAX ? lg->n_kinds++ : KINDS_MAX;
        if (!lg->kinds[i].n)
            snprintf(lg->kinds[i].name, sizeof lg->kinds[i].name, "%s",
                     i == KINDS_MAX ? "other" : name);
    }
    if (!lg->kinds[i].n++)
        snprintf(lg->kinds[i].first, sizeof lg->kinds[i].first, "%s", c->error);
    lg->n_err++;
}

static bool same_answer(const kvb_pd_completion_t *a, const kvb_pd_completion_t *b)
{
    return a->n_tokens == b->n_tokens && a->n_tokens &&
           !memcmp(a->tokens, b->tokens, a->n_tokens * sizeof *a->tokens) &&
           !strcmp(a->text, b->text);
}

/* --compare: the reference's answer to the same prompt (not streamed, not timed). */
static void compare(lg_t *lg, uint32_t i, const kvb_pd_completion_t *c)
{
    char *body = body_for(lg->o, i, false);
    kvb_pd_completion_t ref;
    if (body)
        kvb_pd_complete(lg->o->compare, body, lg->o->timeout_ms, &ref);
    else
        memset(&ref, 0, sizeof ref);
    free(body);
    pthread_mutex_lock(&lg->mu);
    if (!ref.ok) {
        lg->ref_err++;
    } else {
        lg->compared++;
        if (!same_answer(c, &ref) && !lg->differ++)
            snprintf(lg->first_differ, sizeof lg->first_differ,
                     "request %u: %zu tokens, reference %zu", i, c->n_tokens, ref.n_tokens);
    }
    pthread_mutex_unlock(&lg->mu);
    kvb_pd_completion_free(&ref);
}

static void record(lg_t *lg, const kvb_pd_completion_t *c)
{
    pthread_mutex_lock(&lg->mu);
    if (!c->ok) {
        count_error(lg, c);
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
        char *body = body_for(lg->o, i, lg->o->stream);
        kvb_pd_completion_t c;
        if (body) {
            kvb_pd_complete_as(lg->o->url, lg->o->api_key, body, lg->o->timeout_ms, &c);
        } else {
            memset(&c, 0, sizeof c);
            snprintf(c.error, sizeof c.error, "out of memory");
            snprintf(c.reason, sizeof c.reason, "client_nomem");
        }
        record(lg, &c);
        if (c.ok && lg->o->compare)
            compare(lg, i, &c);
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

/* The summary as one JSON line (jansson escapes the URLs and messages). */
static void report_json(lg_t *lg, double secs, double t50, double t99, double p50, double p99,
                        double tps)
{
    const lg_opts_t *o = lg->o;
    json_t *kinds = json_object();
    for (size_t i = 0; kinds && i <= KINDS_MAX; i++)
        if (lg->kinds[i].n)
            json_object_set_new(kinds, lg->kinds[i].name, json_integer((json_int_t)lg->kinds[i].n));
    json_t *j = json_pack(
        "{s:s,s:i,s:i,s:i,s:i,s:b,s:I,s:I,s:o*,s:f,s:f,s:f,s:f,s:f,s:f}", "url", o->url,
        "concurrency", (int)o->conc, "requests", (int)o->requests, "prompt_len", (int)o->prompt_len,
        "max_tokens", (int)o->max_tokens, "stream", o->stream, "ok", (json_int_t)lg->n_ok, "errors",
        (json_int_t)lg->n_err, "errors_by_kind", kinds, "seconds", secs, "ttft_ms_p50", t50,
        "ttft_ms_p99", t99, "tpot_ms_p50", p50, "tpot_ms_p99", p99, "tokens_per_s", tps);
    if (j && o->compare) {
        json_object_set_new(j, "compare", json_string(o->compare));
        json_object_set_new(j, "compared", json_integer((json_int_t)lg->compared));
        json_object_set_new(j, "differ", json_integer((json_int_t)lg->differ));
        json_object_set_new(j, "reference_errors", json_integer((json_int_t)lg->ref_err));
    }
    char *s = j ? json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(6)) : NULL;
    printf("%s\n", s ? s : "{\"error\":\"out of memory\"}");
    free(s);
    json_decref(j);
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
    for (size_t i = 0; i <= KINDS_MAX; i++)
        if (lg->kinds[i].n)
            printf("errors    %zu x %s (first: %s)\n", lg->kinds[i].n, lg->kinds[i].name,
                   lg->kinds[i].first);
    if (lg->o->compare)
        printf("compare   %zu compared with %s, %zu differ, %zu reference errors%s%s\n",
               lg->compared, lg->o->compare, lg->differ, lg->ref_err, lg->differ ? "; first: " : "",
               lg->differ ? lg->first_differ : "");
    if (lg->o->json)
        report_json(lg, secs, t50, t99, p50, p99, tps);
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
        else if (!strcmp(a, "--compare"))
            o->compare = v, rc = v ? 0 : -1;
        else if (!strcmp(a, "--api-key-file"))
            o->api_key_file = v, rc = v ? 0 : -1;
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
    return lg.n_err || lg.differ || lg.ref_err ? 1 : 0;
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
    kvb__pd_auth_t *keys = NULL;
    if (o.api_key_file) {
        char why[256] = "";
        int rc = kvb__pd_auth_create(o.api_key_file, &keys, why, sizeof why);
        if (rc) {
            fprintf(stderr, "kvbridge loadgen: --api-key-file %s: %s\n", o.api_key_file,
                    why[0] ? why : kvb_strerror(rc));
            return 2;
        }
        o.api_key = kvb__pd_auth_first_key(keys);
    }
    int rc = run(&o);
    kvb__pd_auth_free(keys);
    return rc;
}
