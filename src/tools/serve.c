/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge serve: runs one PD instance (prefill, decode or colocated) until SIGINT or SIGTERM. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "pd/server/server.h"
#include "tools/cli.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvbridge serve --role prefill|decode|both --model PRESET|FILE [--seed N]\n"
            "                      [--tp N] --port P [--bind ADDR] [--kv-mode pull|push]\n"
            "                      [--blocks N] [--lease-ms N] [--max-queue N]\n"
            "                      [--max-connections N] [--idle-timeout-s N] [--protocol P]\n"
            "                      [--fabric-provider NAME]\n"
            "                      [--metadata URI [--cluster NAME] [--metadata-ttl-ms N]]\n"
            "                      [--secret-file PATH] [--insecure] [--api-key-file PATH]\n\n"
            "Serves one instance of the PD runtime over HTTP (docs/pd-protocol.md).\n\n"
            "  --role R        prefill, decode, or both (colocated: /v1/completions locally)\n"
            "  --model M       a preset (tiny-gqa, tiny-mla) or a weight file\n"
            "  --seed N        seed of a preset's weights (default 0)\n"
            "  --tp N          TP ranks, each with its own engine and cache (default 1)\n"
            "  --port P        HTTP port (0: any free one; the ready line says which)\n"
            "  --bind ADDR     address of HTTP and the engines (default 127.0.0.1)\n"
            "  --kv-mode M     pull (default) or push\n"
            "  --blocks N      KV blocks of 16 tokens per rank (default %u)\n"
            "  --lease-ms N    how long a prefill keeps blocks for the decode (default %u,\n"
            "                  at least %u)\n"
            "  --max-queue N   requests that may wait for KV blocks at once, first come first\n"
            "                  served, each until its deadline (default %u); one more, or one\n"
            "                  whose deadline passes, gets 503 with Retry-After and a reason\n"
            "  --protocol P    the engines' data paths in the order tried: auto (default),\n"
            "                  or a list such as fabric,tcp or shm,tcp (see the README)\n"
            "  --fabric-provider NAME  libfabric provider of the fabric path (verbs;ofi_rxm,\n"
            "                  efa, cxi; tcp;ofi_rxm or shm for testing)\n"
            "  --max-connections N  HTTP connections at once, a thread each (default %u); one\n"
            "                  more is closed as it is accepted\n"
            "  --idle-timeout-s N  a connection silent this long - a stalled or slow client,\n"
            "                  an idle keep-alive - is closed (default %u)\n"
            "  --metadata URI  a metadata store: etcd://H:P[,H:P], redis://[:PW@]H:P[/DB] or\n"
            "                  http://H:P[/PREFIX] (kvbridge metadata-server). The engines\n"
            "                  publish their segments there, and once HTTP serves the instance\n"
            "                  registers as kvbridge/CLUSTER/instances/ADDR:PORT, so that\n"
            "                  `kvbridge proxy --discover URI` finds it; withdrawn at exit, and\n"
            "                  gone within the TTL after a crash. Unreachable at start: exit 1\n"
            "  --cluster NAME  namespace of the keys (default \"default\")\n"
            "  --metadata-ttl-ms N  how long the keys outlive a crash (default 10000, min 1000)\n"
            "  --secret-file PATH  the cluster secret the engines authenticate peers with (also\n"
            "                  KVB_SECRET_FILE); required with a non-loopback --bind. With it,\n"
            "                  the /pd/ endpoints take only calls the proxy signed with it\n"
            "  --api-key-file PATH  bearer keys for /v1/completions, one per line ('#'\n"
            "                  comments); without it /v1/completions is open\n"
            "  --insecure      allow a non-loopback --bind without a secret (warns)\n\n"
            "Prints \"serving ROLE on http://ADDR:PORT (tp N, kv-mode M)\" when ready.\n"
            "exit status: 0 stopped by a signal, 1 cannot start, 2 bad command line\n",
            KVB_PD_SERVER_BLOCKS, KVB_PD_SERVER_LEASE_MS, KVB_PD_SERVER_LEASE_MIN_MS,
            KVB_PD_SERVER_MAX_QUEUE, KVB_PD_SERVER_MAX_CONNS, KVB_PD_SERVER_IDLE_S);
}

static int bad(const char *what, const char *arg)
{
    fprintf(stderr, "kvbridge serve: %s%s%s\n(see kvbridge serve --help)\n", what, arg ? ": " : "",
            arg ? arg : "");
    return 2;
}

/* One option and its value; returns 0, 1 for help, or 2 after a message. */
static int parse_opt(kvb_pd_server_opts_t *o, const char *opt, const char *val, bool *port_set)
{
    uint64_t v;
    if (!strcmp(opt, "--role"))
        return kvb_pd_role_parse(val, &o->role) ? bad("bad --role", val) : 0;
    if (!strcmp(opt, "--kv-mode"))
        return kvb_pd_kv_mode_parse(val, &o->kv_mode) ? bad("bad --kv-mode", val) : 0;
    if (!strcmp(opt, "--model"))
        return (o->model = val) && *val ? 0 : bad("empty --model", NULL);
    if (!strcmp(opt, "--bind"))
        return (o->bind = val) && *val ? 0 : bad("empty --bind", NULL);
    if (!strcmp(opt, "--seed"))
        return kvb_cli_parse_uint(val, UINT64_MAX, &o->seed) ? bad("bad --seed", val) : 0;
    if (!strcmp(opt, "--tp")) {
        if (kvb_cli_parse_uint(val, KVB_PD_SERVER_TP_MAX, &v) || !v)
            return bad("bad --tp", val);
        o->tp = (uint32_t)v;
    } else if (!strcmp(opt, "--port")) {
        if (kvb_cli_parse_uint(val, 65535, &v))
            return bad("bad --port", val);
        o->port = (uint16_t)v;
        *port_set = true;
    } else if (!strcmp(opt, "--blocks")) {
        if (kvb_cli_parse_uint(val, UINT32_MAX, &o->blocks) || !o->blocks)
            return bad("bad --blocks", val);
    } else if (!strcmp(opt, "--lease-ms")) {
        if (kvb_cli_parse_uint(val, 3600000, &v) || v < KVB_PD_SERVER_LEASE_MIN_MS)
            return bad("bad --lease-ms", val);
        o->lease_ms = (uint32_t)v;
    } else if (!strcmp(opt, "--max-queue")) {
        if (kvb_cli_parse_uint(val, 1000000, &v) || !v)
            return bad("bad --max-queue (1..1000000)", val);
        o->max_queue = (uint32_t)v;
    } else if (!strcmp(opt, "--protocol")) {
        if (!*val)
            return bad("empty --protocol", NULL);
        o->protocol = val;
    } else if (!strcmp(opt, "--fabric-provider")) {
        if (!*val)
            return bad("empty --fabric-provider", NULL);
        o->fabric_provider = val;
    } else if (!strcmp(opt, "--max-connections")) {
        if (kvb_cli_parse_uint(val, 100000, &v) || !v)
            return bad("bad --max-connections (1..100000)", val);
        o->max_connections = (uint32_t)v;
    } else if (!strcmp(opt, "--idle-timeout-s")) {
        if (kvb_cli_parse_uint(val, 86400, &v) || !v)
            return bad("bad --idle-timeout-s (1..86400)", val);
        o->idle_timeout_s = (uint32_t)v;
    } else if (!strcmp(opt, "--metadata")) {
        if (!kvb_pd_store_uri_valid(val))
            return bad("bad --metadata (want etcd://H:P[,H:P], redis://[:PW@]H:P[/DB] or "
                       "http://H:P[/PREFIX])",
                       val);
        o->metadata = val;
    } else if (!strcmp(opt, "--cluster")) {
        if (!kvb_pd_cluster_valid(val))
            return bad("bad --cluster (1..63 characters of [A-Za-z0-9._-])", val);
        o->cluster = val;
    } else if (!strcmp(opt, "--secret-file")) {
        if (kvb_cli_secret_file("serve", val))
            return 2;
    } else if (!strcmp(opt, "--api-key-file")) {
        if (!*val)
            return bad("empty --api-key-file", NULL);
        o->api_key_file = val;
    } else if (!strcmp(opt, "--metadata-ttl-ms")) {
        if (kvb_cli_parse_uint(val, 3600000, &v) || v < 1000)
            return bad("bad --metadata-ttl-ms (1000..3600000)", val);
        o->metadata_ttl_ms = (uint32_t)v;
    } else {
        return bad("unknown option", opt);
    }
    return 0;
}

static int parse_args(int argc, char **argv, kvb_pd_server_opts_t *o)
{
    bool port_set = false;
    *o = (kvb_pd_server_opts_t){.kv_mode = KVB_PD_KV_PULL, .tp = 1};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(argv[i], "--insecure")) { /* the one flag without a value */
            o->insecure = true;
            continue;
        }
        if (i + 1 >= argc)
            return bad("missing value of", argv[i]);
        int rc = parse_opt(o, argv[i], argv[i + 1], &port_set);
        if (rc)
            return rc;
        i++;
    }
    if (!o->role)
        return bad("--role is required", NULL);
    if (!o->model)
        return bad("--model is required", NULL);
    if (!o->metadata && (o->cluster || o->metadata_ttl_ms))
        return bad("--cluster and --metadata-ttl-ms need --metadata", NULL);
    return port_set ? 0 : bad("--port is required", NULL);
}

int kvb_cmd_serve(int argc, char **argv)
{
    kvb_pd_server_opts_t o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    kvb_cli_block_stop_signals(); /* before any thread exists */
    char why[512];
    kvb_pd_server_t *srv = NULL;
    if (kvb_pd_server_create(&o, &srv, why, sizeof why)) {
        fprintf(stderr, "kvbridge serve: %s\n", why);
        return 1;
    }
    printf("serving %s on http://%s:%u (tp %u, kv-mode %s)\n", kvb_pd_role_name(o.role),
           kvb_pd_server_addr(srv), kvb_pd_server_port(srv), o.tp, kvb_pd_kv_mode_name(o.kv_mode));
    fflush(stdout);
    int sig = kvb_cli_wait_stop();
    fprintf(stderr, "kvbridge serve: %s, stopping\n", strsignal(sig));
    kvb_pd_server_destroy(srv);
    return 0;
}
