/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the PD tests that run real instances: `kvbridge serve` processes (KVB_BIN) started on
 * free ports (read from their ready line), tracked and stopped, and a few HTTP helpers. Header-only
 * with static functions so that each test binary stays self-contained. */
#ifndef KVB_TESTS_PD_PROCS_H
#define KVB_TESTS_PD_PROCS_H

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <microhttpd.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "pd/proxy/proxy.h"

#define MAX_PROCS 8

typedef struct {
    pid_t pid;
    uint16_t port;
    char url[64];
    char log[96];
} inst_t;

static pid_t procs[MAX_PROCS];

static inline void track(pid_t pid)
{
    for (int i = 0; i < MAX_PROCS; i++)
        if (!procs[i]) {
            procs[i] = pid;
            return;
        }
}

/* SIGTERM, then SIGKILL after 3 s; reaps. */
static inline void stop_pid(pid_t pid)
{
    if (pid <= 0)
        return;
    kill(pid, SIGTERM);
    for (int i = 0; i < 300; i++) {
        pid_t r = waitpid(pid, NULL, WNOHANG);
        if (r == pid || (r < 0 && errno == ECHILD)) /* ECHILD: reaped already */
            goto reaped;
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
reaped:
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i] == pid)
            procs[i] = 0;
}

static inline void stop_all(void)
{
    for (int i = 0; i < MAX_PROCS; i++)
        stop_pid(procs[i]);
}

static inline uint16_t free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    close(fd);
    return ntohs(sa.sin_port);
}

static inline const char *bin(void)
{
    const char *b = getenv("KVB_BIN");
    return b && *b ? b : NULL;
}

/* Runs `$KVB_BIN args` with output discarded; its exit code or -1. */
static inline int run_quiet(const char *const *args)
{
    const char *argv[16] = {bin()};
    int n = 1;
    for (; args[n - 1] && n < 15; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    if (pid < 0 || waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Skips the test unless the binary has a working `serve` (the instance servers exist). */
static inline void need_serve(void)
{
    if (!bin())
        cr_skip_test("KVB_BIN is not set (run through ctest)");
    if (run_quiet((const char *const[]){"serve", "--help", NULL}) != 0)
        cr_skip_test("`kvbridge serve` is not available yet");
}

static inline void print_log(const inst_t *in)
{
    char buf[4096];
    FILE *f = fopen(in->log, "r");
    if (!f)
        return;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    cr_log_error("%s log:\n%s", in->url, buf);
}

static inline bool healthy(const inst_t *in)
{
    char url[96];
    snprintf(url, sizeof url, "%s/health", in->url);
    char *body = NULL;
    long st = kvb_pd_http(url, NULL, 500, &body, NULL, 0);
    free(body);
    return st == 200;
}

/* Reads the port from the server's ready line ("serving ROLE on http://ADDR:PORT ...") once it
 * is in the log; false until then. */
static inline bool ready_port(inst_t *in)
{
    FILE *f = fopen(in->log, "r");
    char line[256];
    unsigned port = 0;
    while (f && !port && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "on http://");
        const char *colon = at ? strchr(at + strlen("on http://"), ':') : NULL;
        if (colon && sscanf(colon + 1, "%u", &port) == 1 && port > 0 && port < 65536) {
            in->port = (uint16_t)port;
            snprintf(in->url, sizeof in->url, "http://127.0.0.1:%u", port);
        }
    }
    if (f)
        fclose(f);
    return in->port != 0;
}

/* Forks `kvbridge serve` with `extra` options after the usual ones (NULL-terminated, may be
 * NULL) and waits (10 s at most) until its /health answers. The child dies with the test process
 * (PDEATHSIG), so a test that times out leaves nothing behind. */
static inline void serve_with(inst_t *in, const char *role, const char *model, int tp,
                              const char *mode, const char *const *extra)
{
    static unsigned seq;
    char tps[8];
    memset(in, 0, sizeof *in);
    snprintf(tps, sizeof tps, "%d", tp);
    snprintf(in->log, sizeof in->log, "/tmp/kvb_pd_test_%d_%u.log", (int)getpid(), seq++);
    /* Port 0: the server binds a free port itself and says which on its ready line. (A port
     * found free here and bound later by the child can be taken in between by any process on
     * the machine - a parallel test's connection, say: seen as "Address already in use".) */
    const char *argv[32] = {bin(),  "serve", "--role", role, "--model",   model,
                            "--tp", tps,     "--port", "0",  "--kv-mode", mode};
    int n = 12;
    for (; extra && *extra && n < 31; extra++)
        argv[n++] = *extra;
    argv[n] = NULL;
    pid_t parent = getpid();
    in->pid = fork();
    cr_assert_geq(in->pid, 0);
    if (in->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        int fd = open(in->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    track(in->pid);
    uint64_t dl = kvb__deadline_ms(10000);
    while (!(in->port || ready_port(in)) || !healthy(in)) {
        int st;
        if (waitpid(in->pid, &st, WNOHANG) == in->pid || kvb__now_ns() > dl) {
            print_log(in);
            cr_assert_fail("%s %s tp %d did not come up", role, model, tp);
        }
        usleep(20000);
    }
    if (!getenv("KVB_KEEP_LOGS"))
        unlink(in->log);
}

static inline void serve(inst_t *in, const char *role, const char *model, int tp, const char *mode)
{
    serve_with(in, role, model, tp, mode, NULL);
}

/* ---- Plain HTTP ------------------------------------------------------------------------------ */

/* An answer as post_raw() reads it. */
typedef struct {
    long status;
    char retry_after[16];
    char reason[32];
    char body[1024];
} answer_t;

/* POSTs body to 127.0.0.1:port + path over a plain socket, keeping what kvb_pd_http drops: the
 * Retry-After header and the error's "reason". */
static inline void post_raw(uint16_t port, const char *path, const char *body, answer_t *a)
{
    memset(a, 0, sizeof *a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                     path, strlen(body), body);
    cr_assert_eq(write(fd, req, (size_t)n), n);
    char resp[8192];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof resp - 1 && (k = read(fd, resp + len, sizeof resp - 1 - len)) > 0)
        len += (size_t)k;
    resp[len] = '\0';
    close(fd);
    sscanf(resp, "HTTP/1.1 %ld", &a->status);
    const char *ra = strcasestr(resp, "\r\nRetry-After: ");
    if (ra)
        sscanf(ra + 15, "%15[0-9]", a->retry_after);
    const char *b = strstr(resp, "\r\n\r\n");
    snprintf(a->body, sizeof a->body, "%s", b ? b + 4 : "");
    json_t *j = json_loads(a->body, 0, NULL);
    const char *r = json_string_value(json_object_get(json_object_get(j, "error"), "reason"));
    snprintf(a->reason, sizeof a->reason, "%s", r ? r : "");
    json_decref(j);
}

/* Writes `text` to a file only its owner reads (a secret, an API key file). */
static inline void pd_write_private(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(chmod(path, 0600), 0);
}

/* A fake upstream's answer: `text` as a JSON body with status `st` (the proxy and pool tests). */
static inline enum MHD_Result pd_json_reply(struct MHD_Connection *c, unsigned st, const char *text)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", "application/json");
    enum MHD_Result ret = MHD_queue_response(c, st, r);
    MHD_destroy_response(r);
    return ret;
}

#endif
