/* SPDX-License-Identifier: Apache-2.0 */
/* The kvbridge command: dispatches to subcommands (bench, ...) and holds their shared parsers. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/auth.h"
#include "kvbridge/engine.h"
#include "tools/cli.h"

static sigset_t stop_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    return set;
}

void kvb_cli_block_stop_signals(void)
{
    sigset_t set = stop_signals();
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN); /* a peer gone mid-answer is an error return, not a death */
}

bool kvb_cli_wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return true;
    return false;
}

int kvb_cli_wait_stop(void)
{
    sigset_t set = stop_signals();
    int sig = 0;
    sigwait(&set, &sig);
    return sig;
}

int kvb_cli_secret_file(const char *cmd, const char *path)
{
    uint8_t *secret;
    size_t len;
    if (kvb__secret_load(path, &secret, &len) != KVB_OK) {
        fprintf(stderr, "kvbridge %s: --secret-file %s: unreadable, or not 16..4096 bytes\n", cmd,
                path);
        return -1;
    }
    kvb__secret_free(secret, len);
    return setenv("KVB_SECRET_FILE", path, 1) == 0 ? 0 : -1;
}

/* Digits only from the first character: strtoull would skip leading blanks and take " -1" as
 * UINT64_MAX. */
int kvb_cli_parse_uint(const char *s, uint64_t max, uint64_t *out)
{
    if (!s || *s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

int kvb_cli_parse_size(const char *s, uint64_t *out)
{
    if (!s || *s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    unsigned shift = 0;
    if (*end) {
        switch (*end) {
        case 'k':
        case 'K':
            shift = 10;
            break;
        case 'm':
        case 'M':
            shift = 20;
            break;
        case 'g':
        case 'G':
            shift = 30;
            break;
        default:
            return -1;
        }
        end++;
        if (*end == 'i' || *end == 'I')
            end++;
        if (*end == 'b' || *end == 'B')
            end++;
        if (*end)
            return -1;
    }
    if (shift && v > (UINT64_MAX >> shift))
        return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(
        f,
        "kvbridge %s - KV-cache transfer engine for PD-disaggregated LLM serving\n\n"
        "usage: kvbridge <command> [options]\n\n"
        "commands:\n"
        "  bench     measure transfer throughput and latency (kvbridge bench --help)\n"
        "  serve     run a prefill, decode or colocated instance (kvbridge serve --help)\n"
        "  proxy     OpenAI-style front end over prefill and decode instances\n"
        "  metadata-server  HTTP key-value store with TTLs for \"http://\" metadata URIs\n"
        "  loadgen   load a completions endpoint; TTFT and TPOT percentiles\n"
        "  demo      start a PD deployment on loopback and check it against colocated\n"
        "  model     write or inspect reference-model weight files (kvbridge model --help)\n"
        "  topo      check a prefill/decode topology and print its routes (kvbridge topo --help)\n"
        "  version   print the version\n",
        KVB_VERSION_STRING);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "bench"))
        return kvb_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "topo"))
        return kvb_cmd_topo(argc - 1, argv + 1);
    if (!strcmp(cmd, "model"))
        return kvb_cmd_model(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve"))
        return kvb_cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "proxy"))
        return kvb_cmd_proxy(argc - 1, argv + 1);
    if (!strcmp(cmd, "metadata-server"))
        return kvb_cmd_metadata_server(argc - 1, argv + 1);
    if (!strcmp(cmd, "loadgen"))
        return kvb_cmd_loadgen(argc - 1, argv + 1);
    if (!strcmp(cmd, "demo"))
        return kvb_cmd_demo(argc - 1, argv + 1);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
        printf("kvbridge %s\n", KVB_VERSION_STRING);
        return 0;
    }
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "kvbridge: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
