/* SPDX-License-Identifier: Apache-2.0 */
/* `kvbridge proxy`: the PD front end - OpenAI-style completions routed over prefill and decode
 * instances (docs/pd-protocol.md), until SIGINT or SIGTERM. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/proxy/proxy.h"
#include "tools/cli.h"

#define MAX_INSTANCES 64

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvbridge proxy --prefill URL[,URL...] --decode URL[,URL...] --port P\n"
            "       kvbridge proxy --discover URI [--cluster NAME] [--discover-interval-ms N]\n"
            "                      [--prefill URL[,URL...]] [--decode URL[,URL...]] --port P\n"
            "                      [--bind ADDR] [--kv-mode pull|push] [--timeout-ms N]\n"
            "                      [--max-connections N] [--idle-timeout-s N]\n"
            "                      [--secret-file PATH] [--api-key-file PATH]\n\n"
            "Serves POST /v1/completions, GET /health and GET /metrics; each request goes to\n"
            "the next prefill and decode instance in turn. --kv-mode defaults to what the\n"
            "prefill instance reports; --timeout-ms (default 30000) bounds every request.\n\n"
            "  --discover URI  find instances in a metadata store (etcd://H:P[,H:P],\n"
            "                  redis://[:PW@]H:P[/DB] or http://H:P[/PREFIX]) where\n"
            "                  `kvbridge serve --metadata URI` registers them: the proxy lists\n"
            "                  kvbridge/CLUSTER/instances/ every interval, adds new prefill and\n"
            "                  decode instances and drops those whose key is gone (--prefill and\n"
            "                  --decode entries are never dropped). While the store cannot be\n"
            "                  reached it keeps the instances it knows; with none of a role,\n"
            "                  requests get 503\n"
            "  --cluster NAME  namespace of the keys (default \"default\")\n"
            "  --discover-interval-ms N  time between two listings (default %u)\n"
            "  --max-connections N  client connections at once, a thread each (default %u);\n"
            "                  one more is closed as it is accepted\n"
            "  --idle-timeout-s N  a client connection silent this long is closed (default:\n"
            "                  the timeout plus 60 s)\n"
            "  --secret-file PATH  the cluster secret (also KVB_SECRET_FILE): calls to the\n"
            "                  instances' /pd/ endpoints are signed with it, as instances that\n"
            "                  have it require\n"
            "  --api-key-file PATH  bearer keys for /v1/completions, one per line ('#'\n"
            "                  comments); without it /v1/completions is open\n\n"
            "Prints \"proxy on http://ADDR:PORT\" when ready.\n"
            "exit status: 0 stopped by a signal, 1 cannot start, 2 bad command line\n",
            KVB_PD_PROXY_DISCOVER_MS, KVB_PD_PROXY_MAX_CONNS);
}

/* Splits a comma-separated list in place into urls[], appending to *n. */
static int split_urls(char *list, const char **urls, size_t *n)
{
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (*n == MAX_INSTANCES)
            return -1;
        urls[(*n)++] = tok;
    }
    return 0;
}

typedef struct {
    const char *prefill[MAX_INSTANCES], *decode[MAX_INSTANCES];
    kvb_pd_proxy_opts_t o;
} args_t;

static int parse_one(args_t *a, const char *opt, char *val)
{
    uint64_t v;
    if (!strcmp(opt, "--prefill"))
        return split_urls(val, a->prefill, &a->o.n_prefill);
    if (!strcmp(opt, "--decode"))
        return split_urls(val, a->decode, &a->o.n_decode);
    if (!strcmp(opt, "--bind")) {
        a->o.bind = val;
        return 0;
    }
    if (!strcmp(opt, "--kv-mode"))
        return kvb_pd_kv_mode_parse(val, &a->o.kv_mode);
    if (!strcmp(opt, "--port")) {
        if (kvb_cli_parse_uint(val, 65535, &v))
            return -1;
        a->o.port = (uint16_t)v;
        return 0;
    }
    if (!strcmp(opt, "--max-connections")) { /* one more is closed as it is accepted */
        if (kvb_cli_parse_uint(val, 100000, &v) || !v)
            return -1;
        a->o.max_connections = (uint32_t)v;
        return 0;
    }
    if (!strcmp(opt, "--idle-timeout-s")) {
        if (kvb_cli_parse_uint(val, 86400, &v) || !v)
            return -1;
        a->o.idle_timeout_s = (uint32_t)v;
        return 0;
    }
    if (!strcmp(opt, "--secret-file"))
        return kvb_cli_secret_file("proxy", val);
    if (!strcmp(opt, "--api-key-file")) {
        a->o.api_key_file = val;
        return *val ? 0 : -1;
    }
    if (!strcmp(opt, "--timeout-ms")) {
        if (kvb_cli_parse_uint(val, 3600000, &v) || !v)
            return -1;
        a->o.timeout_ms = (uint32_t)v;
        return 0;
    }
    if (!strcmp(opt, "--discover")) {
        a->o.discover = val;
        return kvb_pd_store_uri_valid(val) ? 0 : -1;
    }
    if (!strcmp(opt, "--cluster")) {
        a->o.cluster = val;
        return kvb_pd_cluster_valid(val) ? 0 : -1;
    }
    if (!strcmp(opt, "--discover-interval-ms")) {
        if (kvb_cli_parse_uint(val, 3600000, &v) || !v)
            return -1;
        a->o.discover_interval_ms = (uint32_t)v;
        return 0;
    }
    return -1;
}

static int parse(args_t *a, int argc, char **argv)
{
    bool have_port = false;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        if (i + 1 >= argc || parse_one(a, argv[i], argv[i + 1])) {
            fprintf(stderr, "kvbridge proxy: bad or incomplete option '%s%s%s'\n", argv[i],
                    i + 1 < argc ? " " : "", i + 1 < argc ? argv[i + 1] : "");
            return -1;
        }
        have_port |= !strcmp(argv[i], "--port");
    }
    if (((!a->o.n_prefill || !a->o.n_decode) && !a->o.discover) || !have_port) {
        fprintf(stderr, "kvbridge proxy: --port, and --prefill and --decode or --discover, are "
                        "required\n");
        return -1;
    }
    if (!a->o.discover && (a->o.cluster || a->o.discover_interval_ms)) {
        fprintf(stderr, "kvbridge proxy: --cluster and --discover-interval-ms need --discover\n");
        return -1;
    }
    a->o.prefill = a->prefill;
    a->o.decode = a->decode;
    return 0;
}

int kvb_cmd_proxy(int argc, char **argv)
{
    if (kvb_cli_wants_help(argc, argv)) {
        usage(stdout);
        return 0;
    }
    args_t a = {0};
    if (parse(&a, argc, argv)) {
        usage(stderr);
        return 2;
    }
    kvb_cli_block_stop_signals(); /* before any thread exists */
    kvb_pd_proxy_t *px;
    char why[256];
    if (kvb_pd_proxy_start(&a.o, &px, why, sizeof why)) {
        fprintf(stderr, "kvbridge proxy: %s\n", why);
        return 1;
    }
    printf("proxy on http://%s:%u\n", a.o.bind ? a.o.bind : "127.0.0.1",
           (unsigned)kvb_pd_proxy_port(px));
    fflush(stdout);
    int sig = kvb_cli_wait_stop();
    fprintf(stderr, "kvbridge proxy: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    kvb_pd_proxy_stop(px);
    return 0;
}
