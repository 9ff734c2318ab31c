/* SPDX-License-Identifier: Apache-2.0 */
/* `kvbridge demo` (what `make demo` runs): starts a colocated reference instance, a prefill
 * instance (TP 2), a decode instance (TP 1) and a proxy on free loopback ports, sends a handful of
 * prompts through both paths, prints each PD answer with its stats, checks that every one is
 * identical to the colocated answer, and stops every process it started. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "pd/proxy/proxy.h"
#include "tools/cli.h"

#define READY_MS 20000
#define N_PROCS  4

typedef struct {
    const char *name;
    pid_t pid;
    uint16_t port;
    char url[64];
    char log[128];
} proc_t;

static const char *prompts[] = {
    "Hello",
    "The KV cache moves from prefill to decode",
    "",
    "Disaggregated serving splits prompt processing from token generation, so each can scale.",
    "0123456789abcde", /* with BOS: exactly one 16-token block */
    "A longer prompt that spans several blocks of sixteen tokens each, to show paging at work.",
};

static uint16_t free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    uint16_t port = 0;
    if (fd >= 0 && !bind(fd, (struct sockaddr *)&sa, sizeof sa) &&
        !getsockname(fd, (struct sockaddr *)&sa, &sl))
        port = ntohs(sa.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

/* Forks `self argv...` with output to p->log; the child dies with us (PDEATHSIG). */
static int spawn(proc_t *p, const char *self, const char *const *argv)
{
    pid_t parent = getpid();
    p->pid = fork();
    if (p->pid < 0)
        return -1;
    if (p->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(self, (char *const *)argv);
        _exit(127);
    }
    return 0;
}

static void show_log(const proc_t *p)
{
    char buf[2048];
    FILE *f = fopen(p->log, "r");
    if (!f)
        return;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    fprintf(stderr, "--- %s log (%s) ---\n%s\n", p->name, p->log, buf);
}

/* Waits until the process answers GET /health, fails if it exits or the deadline passes. */
static int wait_ready(proc_t *p, uint64_t deadline)
{
    char url[96];
    snprintf(url, sizeof url, "%s/health", p->url);
    for (;;) {
        char *body = NULL;
        long st = kvb_pd_http(url, NULL, 500, &body, NULL, 0);
        free(body);
        if (st == 200)
            return 0;
        int ws;
        if (waitpid(p->pid, &ws, WNOHANG) == p->pid) {
            p->pid = 0;
            fprintf(stderr, "kvbridge demo: %s exited before it was ready\n", p->name);
            show_log(p);
            return -1;
        }
        if (kvb__now_ns() > deadline) {
            fprintf(stderr, "kvbridge demo: %s not ready after %d ms\n", p->name, READY_MS);
            show_log(p);
            return -1;
        }
        usleep(20000);
    }
}

static void stop(proc_t *p)
{
    if (p->pid <= 0)
        return;
    kill(p->pid, SIGTERM);
    for (int i = 0; i < 300; i++) {
        if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
            p->pid = 0;
            return;
        }
        usleep(10000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

static int start_all(proc_t *ps, const char *self, const char *model, const char *mode)
{
    char port[N_PROCS][8];
    for (int i = 0; i < N_PROCS; i++) {
        ps[i].port = free_port();
        snprintf(port[i], sizeof port[i], "%u", (unsigned)ps[i].port);
        snprintf(ps[i].url, sizeof ps[i].url, "http://127.0.0.1:%u", (unsigned)ps[i].port);
        snprintf(ps[i].log, sizeof ps[i].log, "/tmp/kvbridge-demo-%d-%s.log", (int)getpid(),
                 ps[i].name);
    }
    const char *ref[] = {self, "serve",  "--role", "both",      "--model", model, "--tp",
                         "1",  "--port", port[0],  "--kv-mode", mode,      NULL};
    const char *pre[] = {self, "serve",  "--role", "prefill",   "--model", model, "--tp",
                         "2",  "--port", port[1],  "--kv-mode", mode,      NULL};
    const char *dec[] = {self, "serve",  "--role", "decode",    "--model", model, "--tp",
                         "1",  "--port", port[2],  "--kv-mode", mode,      NULL};
    const char *pxy[] = {self,     "proxy", "--prefill", ps[1].url, "--decode", ps[2].url,
                         "--port", port[3], "--kv-mode", mode,      NULL};
    const char *const *argvs[N_PROCS] = {ref, pre, dec, pxy};
    uint64_t deadline = kvb__deadline_ms(READY_MS);
    for (int i = 0; i < N_PROCS; i++)
        if (spawn(&ps[i], self, argvs[i])) {
            fprintf(stderr, "kvbridge demo: cannot start %s\n", ps[i].name);
            return -1;
        }
    for (int i = 0; i < N_PROCS; i++)
        if (wait_ready(&ps[i], deadline))
            return -1;
    return 0;
}

static bool same(const kvb_pd_completion_t *a, const kvb_pd_completion_t *b)
{
    return a->ok && b->ok && a->n_tokens == b->n_tokens && a->n_tokens > 0 &&
           !memcmp(a->tokens, b->tokens, a->n_tokens * sizeof *a->tokens) &&
           !strcmp(a->text, b->text);
}

static char *body_for(const char *prompt, bool stream, unsigned max_tokens)
{
    char *esc = NULL;
    size_t n = strlen(prompt);
    esc = malloc(n * 2 + 1);
    if (!esc)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) { /* the prompts are plain ASCII: quote and backslash only */
        if (prompt[i] == '"' || prompt[i] == '\\')
            esc[k++] = '\\';
        esc[k++] = prompt[i];
    }
    esc[k] = '\0';
    char *b = malloc(k + 96);
    if (b)
        snprintf(b, k + 96, "{\"prompt\": \"%s\", \"max_tokens\": %u, \"stream\": %s}", esc,
                 max_tokens, stream ? "true" : "false");
    free(esc);
    return b;
}

/* Sends prompt i both ways and prints the PD answer; returns true when they are identical. */
static bool one_prompt(const proc_t *ps, size_t i, unsigned max_tokens)
{
    bool stream = i % 2 == 0;
    char *pb = body_for(prompts[i], stream, max_tokens),
         *rb = body_for(prompts[i], false, max_tokens);
    kvb_pd_completion_t pd = {0}, ref = {0};
    if (pb && rb) {
        kvb_pd_complete(ps[3].url, pb, 30000, &pd);
        kvb_pd_complete(ps[0].url, rb, 30000, &ref);
    }
    bool ok = same(&pd, &ref);
    printf("[%zu] %-6s \"%.40s%s\"\n", i + 1, stream ? "stream" : "whole", prompts[i],
           strlen(prompts[i]) > 40 ? "..." : "");
    if (pd.ok)
        printf("    PD:        \"%s\"\n    TTFT %.2f ms (client %.2f ms), TPOT %.3f ms, "
               "KV %llu bytes in %.3f ms, %u prompt tokens\n",
               pd.text, pd.ttft_ms, pd.client_ttft_ms, pd.tpot_ms, (unsigned long long)pd.kv_bytes,
               pd.kv_transfer_ms, pd.prompt_tokens);
    else
        printf("    PD failed: HTTP %ld: %s\n", pd.status, pd.error);
    if (!ok)
        printf("    colocated: %s\"%s\" -> DIFFERENT\n", ref.ok ? "" : "(failed) ",
               ref.ok ? ref.text : ref.error);
    kvb_pd_completion_free(&pd);
    kvb_pd_completion_free(&ref);
    free(pb);
    free(rb);
    return ok;
}

int kvb_cmd_demo(int argc, char **argv)
{
    const char *model = "tiny-gqa", *mode = "pull";
    uint64_t max_tokens = 24;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--model") && v)
            model = v;
        else if (!strcmp(argv[i], "--kv-mode") && v && (!strcmp(v, "pull") || !strcmp(v, "push")))
            mode = v;
        else if (!strcmp(argv[i], "--max-tokens") && v &&
                 !kvb_cli_parse_uint(v, 4096, &max_tokens) && max_tokens)
            ;
        else {
            fprintf(stderr, "usage: kvbridge demo [--model PRESET|FILE] [--kv-mode pull|push] "
                            "[--max-tokens N]\n");
            return !strcmp(argv[i], "--help") ? 0 : 2;
        }
    }
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0 || kvb_pd_client_init()) {
        fprintf(stderr, "kvbridge demo: cannot find its own binary\n");
        return 1;
    }
    self[n] = '\0';
    signal(SIGPIPE, SIG_IGN);
    proc_t ps[N_PROCS] = {
        {.name = "colocated"}, {.name = "prefill"}, {.name = "decode"}, {.name = "proxy"}};
    int rc = 1;
    if (!start_all(ps, self, model, mode)) {
        printf("kvbridge demo: %s, %s mode; colocated %s (TP 1), prefill %s (TP 2), "
               "decode %s (TP 1), proxy %s\n\n",
               model, mode, ps[0].url, ps[1].url, ps[2].url, ps[3].url);
        size_t np = sizeof prompts / sizeof *prompts, same_n = 0;
        for (size_t i = 0; i < np; i++)
            same_n += one_prompt(ps, i, (unsigned)max_tokens);
        printf("\nPD output identical to colocated: %zu/%zu\n", same_n, np);
        rc = same_n == np ? 0 : 1;
    }
    fflush(stdout);
    for (int i = N_PROCS - 1; i >= 0; i--) {
        stop(&ps[i]);
        if (!rc)
            unlink(ps[i].log);
    }
    return rc;
}
