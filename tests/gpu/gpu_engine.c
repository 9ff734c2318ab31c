/* SPDX-License-Identifier: Apache-2.0 */
/* GPU memory through the engine, between two processes on one host: READ and WRITE of device
 * memory over the TCP lanes (staged) and over CUDA IPC, every byte checked by copying it back to
 * the host; a batch that mixes host and device memory on both sides; a peer killed in the middle
 * of device transfers; registrations with the wrong device ordinal or kind.
 *
 * A plain program (no Criterion: the GPU machines have none), run by `make test-gpu` and by CTest,
 * where it exits 77 - skipped, with the reason on stdout - on a machine without a CUDA GPU. The
 * target is this program again, exec'd with "target" (CUDA does not survive fork). */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvbridge/engine.h"
#include "transport/cuda_driver.h"

#define DEV_LEN  (64u << 20)
#define HOST_LEN (16u << 20)

extern char **environ;
static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                            \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
            fflush(stdout);                                                                        \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    exit(1);
}

/* Byte i of the pattern `seed`. */
static uint8_t pat(uint64_t seed, uint64_t i)
{
    uint64_t x = (i / 8 + seed) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    return (uint8_t)(x >> (8 * (i % 8)));
}

static void fill_host(uint8_t *p, uint64_t len, uint64_t seed, uint64_t base)
{
    for (uint64_t i = 0; i < len; i++)
        p[i] = pat(seed, base + i);
}

/* Index of the first byte of p[0..len) that is not pattern `seed` from `base`, or -1. */
static int64_t bad_byte(const uint8_t *p, uint64_t len, uint64_t seed, uint64_t base)
{
    for (uint64_t i = 0; i < len; i++)
        if (p[i] != pat(seed, base + i))
            return (int64_t)i;
    return -1;
}

static const kvb__cuda_api_t *cu(void)
{
    static bool ready;
    if (!ready && kvb__cuda_use(0))
        die("cannot use CUDA device 0");
    ready = true;
    return kvb__cuda();
}

static uint8_t *dev_alloc(uint64_t len)
{
    kvb_cu_ptr_t p = 0;
    if (cu()->MemAlloc(&p, len))
        die("cuMemAlloc(%llu)", (unsigned long long)len);
    return (uint8_t *)(uintptr_t)p;
}

static void dev_fill(uint8_t *dev, uint64_t len, uint64_t seed, uint64_t base)
{
    uint8_t *h = malloc(len);
    fill_host(h, len, seed, base);
    if (cu()->MemcpyHtoD((uintptr_t)dev, h, len))
        die("cuMemcpyHtoD");
    free(h);
}

/* Copies device memory back to the host and checks it against the pattern. */
static int64_t dev_bad_byte(const uint8_t *dev, uint64_t len, uint64_t seed, uint64_t base)
{
    uint8_t *h = malloc(len);
    if (cu()->MemcpyDtoH(h, (uintptr_t)dev, len))
        die("cuMemcpyDtoH");
    int64_t bad = bad_byte(h, len, seed, base);
    free(h);
    return bad;
}

/* ---- the target process ------------------------------------------------------------------------
 */

/* Serves a device buffer and a host buffer; answers "check dev|host SEED OFF LEN" notifications
 * (the bytes written there) and stops at "exit" or when stdin closes. */
static int target_main(void)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    kvb_engine_t *e;
    if (kvb_engine_create(&cfg, &e))
        die("target engine");
    uint8_t *dev = dev_alloc(DEV_LEN), *host = malloc(HOST_LEN);
    dev_fill(dev, DEV_LEN, 1, 0);
    fill_host(host, HOST_LEN, 2, 0);
    if (kvb_register(e, dev, DEV_LEN, "cuda:0", KVB_ACCESS_RW) ||
        kvb_register(e, host, HOST_LEN, "cpu", KVB_ACCESS_RW))
        die("target register");
    printf("%s %llx %llx\n", kvb_engine_segment_name(e), (unsigned long long)(uintptr_t)dev,
           (unsigned long long)(uintptr_t)host);
    fflush(stdout);
    for (;;) {
        kvb_notification_t n;
        int rc = kvb_notify_recv(e, &n, 200);
        if (rc == KVB_ERR_AGAIN || rc == KVB_ERR_TIMEOUT) {
            if (getppid() == 1)
                break; /* the test went away */
            continue;
        }
        if (rc)
            break;
        char msg[128], which[8];
        unsigned long long seed, off, len;
        snprintf(msg, sizeof msg, "%.*s", (int)n.len, (const char *)n.data);
        if (!strcmp(msg, "exit"))
            break;
        const char *answer = "bad request";
        if (sscanf(msg, "check %7s %llu %llu %llu", which, &seed, &off, &len) == 4) {
            bool d = !strcmp(which, "dev");
            uint64_t cap = d ? DEV_LEN : HOST_LEN;
            if (off <= cap && len <= cap - off) {
                int64_t bad = d ? dev_bad_byte(dev + off, len, seed, off)
                                : bad_byte(host + off, len, seed, off);
                answer = bad < 0 ? "ok" : "mismatch";
            }
        }
        kvb_notify_reply(e, &n, answer, strlen(answer));
    }
    kvb_engine_destroy(e);
    return 0;
}

/* ---- the test process --------------------------------------------------------------------------
 */

typedef struct {
    pid_t pid;
    FILE *out;
    int in; /* its stdin: closing it is no signal, but getppid() is */
    char name[KVB_NAME_MAX + 1];
    uint64_t dev, host;
} target_t;

static void target_start(target_t *t)
{
    int out[2];
    if (pipe(out))
        die("pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    char *argv[] = {"gpu_engine", "target", NULL};
    if (posix_spawn(&t->pid, "/proc/self/exe", &fa, NULL, argv, environ))
        die("spawn target: %s", strerror(errno));
    posix_spawn_file_actions_destroy(&fa);
    close(out[1]);
    t->out = fdopen(out[0], "r");
    unsigned long long dev, host;
    if (fscanf(t->out, "%255s %llx %llx", t->name, &dev, &host) != 3)
        die("the target did not start");
    t->dev = dev;
    t->host = host;
}

static void target_stop(target_t *t, kvb_engine_t *e, kvb_segment_t seg)
{
    if (e)
        kvb_notify_send(e, seg, "exit", 4, 2000);
    int status;
    for (int i = 0; i < 100 && waitpid(t->pid, &status, WNOHANG) == 0; i++)
        usleep(50000);
    kill(t->pid, SIGKILL);
    waitpid(t->pid, &status, 0);
    fclose(t->out);
}

/* Asks the target whether [off, off+len) of its dev or host buffer holds pattern `seed`. */
static bool target_check(kvb_engine_t *e, kvb_segment_t seg, const char *which, uint64_t seed,
                         uint64_t off, uint64_t len)
{
    char msg[96];
    snprintf(msg, sizeof msg, "check %s %llu %llu %llu", which, (unsigned long long)seed,
             (unsigned long long)off, (unsigned long long)len);
    kvb_notification_t n;
    return kvb_notify_send(e, seg, msg, strlen(msg), 5000) == KVB_OK &&
           kvb_notify_recv(e, &n, 10000) == KVB_OK && n.len == 2 && !memcmp(n.data, "ok", 2);
}

static kvb_engine_t *engine(const char *protocol)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = protocol;
    kvb_engine_t *e;
    if (kvb_engine_create(&cfg, &e))
        die("engine (%s)", protocol);
    return e;
}

static int run_batch(kvb_engine_t *e, kvb_request_t *r, size_t n)
{
    kvb_batch_t *b;
    int rc = kvb_batch_submit(e, r, n, NULL, &b);
    if (rc)
        return rc;
    rc = kvb_batch_wait(b, 30000);
    kvb_batch_free(b);
    return rc;
}

/* READ and WRITE of device memory in several request sizes, then a batch mixing host and device
 * memory on both sides; `path` is what device-to-device requests must take. */
static void transfers(const char *protocol, const char *path)
{
    printf("-- transfers, protocol %s\n", protocol);
    fflush(stdout);
    target_t t;
    target_start(&t);
    kvb_engine_t *e = engine(protocol);
    uint8_t *dev = dev_alloc(DEV_LEN), *host = malloc(HOST_LEN);
    CHECK(kvb_register(e, dev, DEV_LEN, "cuda:0", KVB_ACCESS_RW) == KVB_OK, "register dev");
    CHECK(kvb_register(e, host, HOST_LEN, NULL, KVB_ACCESS_RW) == KVB_OK, "register host");
    kvb_segment_t seg;
    if (kvb_segment_open(e, t.name, &seg))
        die("open %s", t.name);

    static const uint64_t sizes[] = {4096, 64 << 10, 1 << 20, 9 << 20}; /* 9 MiB: chunked */
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        uint64_t bs = sizes[s], n = (16u << 20) / bs;
        kvb_request_t *r = calloc(n, sizeof *r);
        cu()->MemsetD8((uintptr_t)dev, 0xA5, DEV_LEN);
        for (uint64_t i = 0; i < n; i++)
            r[i] = (kvb_request_t){KVB_OP_READ, dev + i * bs, seg, t.dev + i * bs, bs};
        CHECK(run_batch(e, r, n) == KVB_OK, "READ dev<-dev %llu B", (unsigned long long)bs);
        int64_t bad = dev_bad_byte(dev, n * bs, 1, 0);
        CHECK(bad < 0, "READ %llu B: byte %lld differs", (unsigned long long)bs, (long long)bad);
        /* WRITE a fresh pattern to another part of the target's buffer. */
        uint64_t off = 32u << 20;
        dev_fill(dev, n * bs, 10 + s, off);
        for (uint64_t i = 0; i < n; i++)
            r[i] = (kvb_request_t){KVB_OP_WRITE, dev + i * bs, seg, t.dev + off + i * bs, bs};
        CHECK(run_batch(e, r, n) == KVB_OK, "WRITE dev->dev %llu B", (unsigned long long)bs);
        CHECK(target_check(e, seg, "dev", 10 + s, off, n * bs), "WRITE %llu B not at the target",
              (unsigned long long)bs);
        free(r);
    }
    kvb_stats_t st;
    kvb_engine_stats(e, &st);
    CHECK(kvb_stats_bytes(&st, path) == 3 * (32ull << 20) + 2 * (9ull << 20),
          "device bytes went over %s: %llu", path, (unsigned long long)kvb_stats_bytes(&st, path));

    /* One batch, four kinds of pair: dev<-host, host<-dev, dev->host, host->dev (remote first). */
    uint64_t q = 1 << 20;
    cu()->MemsetD8((uintptr_t)dev, 0, DEV_LEN);
    memset(host, 0, HOST_LEN);
    dev_fill(dev + 4 * q, q, 21, 8 * q);    /* WRITE to target host at 8q */
    fill_host(host + 4 * q, q, 22, 40 * q); /* WRITE to target dev at 40q */
    kvb_request_t mixed[] = {
        {KVB_OP_READ, dev, seg, t.host, q},                   /* target host -> our dev */
        {KVB_OP_READ, host, seg, t.dev + q, q},               /* target dev -> our host */
        {KVB_OP_WRITE, dev + 4 * q, seg, t.host + 8 * q, q},  /* our dev -> target host */
        {KVB_OP_WRITE, host + 4 * q, seg, t.dev + 40 * q, q}, /* our host -> target dev */
    };
    CHECK(run_batch(e, mixed, 4) == KVB_OK, "mixed batch");
    CHECK(dev_bad_byte(dev, q, 2, 0) < 0, "mixed: target host -> our dev");
    CHECK(bad_byte(host, q, 1, q) < 0, "mixed: target dev -> our host");
    CHECK(target_check(e, seg, "host", 21, 8 * q, q), "mixed: our dev -> target host");
    CHECK(target_check(e, seg, "dev", 22, 40 * q, q), "mixed: our host -> target dev");

    /* A READ beyond the target's registered device memory is refused, and only that request. */
    kvb_request_t outside[] = {{KVB_OP_READ, dev, seg, t.dev + DEV_LEN - 4096, 8192},
                               {KVB_OP_READ, dev + q, seg, t.dev, 4096}};
    kvb_batch_t *b;
    int rc = kvb_batch_submit(e, outside, 2, NULL, &b);
    CHECK(rc == KVB_OK, "submit outside: %s", kvb_strerror(rc));
    if (rc == KVB_OK) {
        kvb_batch_wait(b, 10000);
        kvb_req_status_t s0, s1;
        kvb_batch_status(b, 0, &s0);
        kvb_batch_status(b, 1, &s1);
        CHECK(s0.state == KVB_REQ_FAILED, "a range past the region must fail");
        CHECK(s1.state == KVB_REQ_COMPLETED, "its neighbour must complete");
        kvb_batch_free(b);
    }

    target_stop(&t, e, seg);
    kvb_engine_destroy(e);
    cu()->MemFree((uintptr_t)dev);
    free(host);
}

/* The target dies while device transfers run: every request ends, none hangs, nothing is
 * reported COMPLETED that did not land. */
static void peer_killed(const char *protocol)
{
    printf("-- peer killed mid-transfer, protocol %s\n", protocol);
    fflush(stdout);
    target_t t;
    target_start(&t);
    kvb_engine_t *e = engine(protocol);
    uint8_t *dev = dev_alloc(DEV_LEN);
    CHECK(kvb_register(e, dev, DEV_LEN, "cuda:0", KVB_ACCESS_RW) == KVB_OK, "register");
    kvb_segment_t seg;
    if (kvb_segment_open(e, t.name, &seg))
        die("open");
    enum { N = 512 };
    kvb_request_t r[N];
    for (int round = 0; round < 8; round++) {
        for (int i = 0; i < N; i++)
            r[i] = (kvb_request_t){KVB_OP_READ, dev + (uint64_t)(i % 64) * (1 << 20), seg,
                                   t.dev + (uint64_t)(i % 64) * (1 << 20), 1 << 20};
        kvb_batch_t *b;
        if (kvb_batch_submit(e, r, N, NULL, &b))
            break;
        if (round == 3)
            kill(t.pid, SIGKILL);
        int rc = kvb_batch_wait(b, 20000);
        CHECK(rc != KVB_ERR_AGAIN, "round %d: the batch did not end within 20 s", round);
        kvb_batch_free(b);
    }
    int status;
    waitpid(t.pid, &status, 0);
    fclose(t.out);
    kvb_engine_destroy(e);
    cu()->MemFree((uintptr_t)dev);
}

static void *second_waiter(void *b)
{
    return (void *)(intptr_t)kvb_batch_wait(b, 20000);
}

/* The cuda path's copies end whoever watches them: a waiter whose deadline comes first (the
 * worker takes them over), nobody (the requests polled with kvb_batch_status), two waiters on one
 * batch; and a batch freed with its copies in flight, the engine destroyed right after. */
static void cuda_completions(void)
{
    printf("-- cuda path: who ends the copies\n");
    fflush(stdout);
    target_t t;
    target_start(&t);
    kvb_engine_t *e = engine("cuda");
    uint8_t *dev = dev_alloc(DEV_LEN);
    CHECK(kvb_register(e, dev, DEV_LEN, "cuda:0", KVB_ACCESS_RW) == KVB_OK, "register");
    kvb_segment_t seg;
    if (kvb_segment_open(e, t.name, &seg))
        die("open %s", t.name);
    enum { N = 2048, MB = 1 << 20 };
    kvb_request_t *r = calloc(N, sizeof *r); /* 2 GiB of copies: milliseconds */
    for (int i = 0; i < N; i++)
        r[i] = (kvb_request_t){KVB_OP_READ, dev + (uint64_t)(i % 64) * MB, seg,
                               t.dev + (uint64_t)(i % 64) * MB, MB};
    kvb_batch_t *b = NULL;
    CHECK(kvb_batch_submit(e, r, N, NULL, &b) == KVB_OK, "submit");
    int rc = b ? kvb_batch_wait(b, 1) : KVB_ERR_INVALID_ARG;
    printf("   a waiter with 1 ms: %s\n",
           rc == KVB_ERR_AGAIN ? "gave up first; the worker ends the copies" : kvb_strerror(rc));
    CHECK(rc == KVB_OK || rc == KVB_ERR_AGAIN, "wait 1 ms: %s", kvb_strerror(rc));
    CHECK(b && kvb_batch_wait(b, 20000) == KVB_OK, "the batch a waiter gave up on ended");
    kvb_batch_free(b);
    CHECK(dev_bad_byte(dev, DEV_LEN, 1, 0) < 0, "its bytes");

    /* Nobody waits: eight batches of 8 MiB, polled. */
    cu()->MemsetD8((uintptr_t)dev, 0, DEV_LEN);
    kvb_batch_t *bs[8] = {NULL};
    for (int k = 0; k < 8; k++) {
        kvb_request_t q[8];
        for (int i = 0; i < 8; i++)
            q[i] = (kvb_request_t){KVB_OP_READ, dev + (uint64_t)(k * 8 + i) * MB, seg,
                                   t.dev + (uint64_t)(k * 8 + i) * MB, MB};
        CHECK(kvb_batch_submit(e, q, 8, NULL, &bs[k]) == KVB_OK, "submit %d", k);
    }
    bool all = false;
    for (int spin = 0; spin < 200000 && !all; spin++) { /* up to about 20 s */
        all = true;
        for (int k = 0; k < 8 && all; k++)
            for (size_t i = 0; bs[k] && i < 8 && all; i++) {
                kvb_req_status_t st;
                all = kvb_batch_status(bs[k], i, &st) == KVB_OK && st.state == KVB_REQ_COMPLETED;
            }
        if (!all)
            usleep(100);
    }
    CHECK(all, "batches nobody waits for complete");
    for (int k = 0; k < 8; k++)
        kvb_batch_free(bs[k]);
    CHECK(dev_bad_byte(dev, DEV_LEN, 1, 0) < 0, "their bytes");

    /* Two waiters on one batch: one watches the copies, the other sleeps until they end. */
    CHECK(kvb_batch_submit(e, r, N, NULL, &b) == KVB_OK, "submit");
    pthread_t th;
    void *other = NULL;
    CHECK(pthread_create(&th, NULL, second_waiter, b) == 0, "thread");
    rc = kvb_batch_wait(b, 20000);
    pthread_join(th, &other);
    CHECK(rc == KVB_OK && (intptr_t)other == KVB_OK, "two waiters: %s and %s", kvb_strerror(rc),
          kvb_strerror((int)(intptr_t)other));
    kvb_batch_free(b);

    /* Freed in flight, then the engine goes: its copies end first (nothing hangs or crashes). */
    CHECK(kvb_batch_submit(e, r, N, NULL, &b) == KVB_OK, "submit");
    kvb_batch_free(b);
    target_stop(&t, e, seg);
    kvb_engine_destroy(e);
    free(r);
    cu()->MemFree((uintptr_t)dev);
}

static void registrations(void)
{
    printf("-- registrations\n");
    fflush(stdout);
    kvb_engine_t *e = engine("auto");
    uint8_t *dev = dev_alloc(1 << 20), *host = malloc(1 << 20);
    char wrong[16];
    snprintf(wrong, sizeof wrong, "cuda:%d", kvb__cuda_device_count()); /* one past the last */
    CHECK(kvb_register(e, dev, 1 << 20, wrong, KVB_ACCESS_RW) == KVB_ERR_INVALID_ARG,
          "device memory registered as %s", wrong);
    CHECK(kvb_register(e, host, 1 << 20, "cuda:0", KVB_ACCESS_RW) == KVB_ERR_INVALID_ARG,
          "host memory registered as cuda:0");
    CHECK(kvb_register(e, dev, 1 << 20, "*", KVB_ACCESS_RW) == KVB_OK, "'*' on device memory");
    /* A peer sees what '*' found. */
    kvb_engine_t *peer = engine("tcp");
    kvb_segment_t seg;
    kvb_region_info_t info;
    size_t n = 0;
    CHECK(kvb_segment_open(peer, kvb_engine_segment_name(e), &seg) == KVB_OK, "open");
    CHECK(kvb_segment_regions(peer, seg, 0, &info, 1, &n) == KVB_OK && n == 1, "regions");
    CHECK(n == 1 && !strcmp(info.location, "cuda:0"), "'*' on device memory shows as '%s'",
          n ? info.location : "");
    kvb_engine_destroy(peer);
    CHECK(kvb_unregister(e, dev) == KVB_OK, "unregister");
    CHECK(kvb_register(e, host, 1 << 20, "*", KVB_ACCESS_RW) == KVB_OK, "'*' on host memory");
    kvb_engine_destroy(e);
    cu()->MemFree((uintptr_t)dev);
    free(host);
}

static kvb_engine_t *fabric_engine(const char *protocol)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.protocol = protocol;
    cfg.fabric_provider = "tcp;ofi_rxm"; /* RDMA without an RDMA device */
    kvb_engine_t *e = NULL;
    int rc = kvb_engine_create(&cfg, &e);
    return rc == KVB_OK ? e : NULL;
}

/* Device memory and the fabric path: a provider offering FI_HMEM moves it, every byte of it; one
 * without (Debian's libfabric has no CUDA support) does not take it (the log says why once) and the
 * TCP lanes, which serve whatever the named paths do not, move it instead - bytes checked too. */
static void fabric_device_memory(void)
{
    printf("-- device memory and the fabric path (tcp;ofi_rxm)\n");
    fflush(stdout);
    kvb_engine_t *t = fabric_engine("fabric"), *e = t ? fabric_engine("fabric") : NULL;
    if (!t || !e) {
        printf("   no libfabric with tcp;ofi_rxm here: skipped\n");
        if (t)
            kvb_engine_destroy(t);
        return;
    }
    uint8_t *tdev = dev_alloc(DEV_LEN), *dev = dev_alloc(DEV_LEN);
    dev_fill(tdev, DEV_LEN, 7, 0);
    CHECK(kvb_register(t, tdev, DEV_LEN, "cuda:0", KVB_ACCESS_RW) == KVB_OK, "register");
    CHECK(kvb_register(e, dev, DEV_LEN, "cuda:0", KVB_ACCESS_RW) == KVB_OK, "register local");
    kvb_segment_t seg;
    CHECK(kvb_segment_open(e, kvb_engine_segment_name(t), &seg) == KVB_OK, "open");
    uint64_t bs = 256 << 10, n = DEV_LEN / bs;
    kvb_request_t *r = calloc(n, sizeof *r);
    for (uint64_t i = 0; i < n; i++)
        r[i] = (kvb_request_t){.opcode = KVB_OP_READ,
                               .local = dev + i * bs,
                               .segment = seg,
                               .remote = (uintptr_t)tdev + i * bs,
                               .len = bs};
    int rc = run_batch(e, r, n);
    CHECK(rc == KVB_OK, "READ of device memory: %s", kvb_strerror(rc));
    int64_t bad = dev_bad_byte(dev, DEV_LEN, 7, 0);
    CHECK(bad < 0, "READ of device memory: byte %lld differs", (long long)bad);
    kvb_stats_t st;
    memset(&st, 0, sizeof st);
    kvb_engine_stats(e, &st);
    uint64_t fabric = kvb_stats_bytes(&st, "fabric"), tcp = kvb_stats_bytes(&st, "tcp");
    printf("   device READ took %s\n", fabric ? "fabric (FI_HMEM)" : "tcp (no FI_HMEM)");
    CHECK((fabric == DEV_LEN && tcp == 0) || (fabric == 0 && tcp == DEV_LEN),
          "one path moves it all: fabric %llu, tcp %llu bytes", (unsigned long long)fabric,
          (unsigned long long)tcp);
    free(r);
    kvb_engine_destroy(e);
    kvb_engine_destroy(t);
    cu()->MemFree((uintptr_t)tdev);
    cu()->MemFree((uintptr_t)dev);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && !strcmp(argv[1], "target"))
        return target_main();
    if (!kvb__cuda_available()) {
        printf("GPU tests skipped: %s\n", kvb__cuda_reason());
        return 77;
    }
    char bus[KVB_CUDA_BUS_ID_LEN] = "";
    kvb__cuda_bus_id(0, bus, sizeof bus);
    printf("GPU tests on device 0 (%s), %d device(s)\n", bus, kvb__cuda_device_count());
    if (argc > 1 && !strcmp(argv[1], "--probe"))
        return 0;
    registrations();
    transfers("tcp", "tcp");
    transfers("cuda", "cuda");
    transfers("auto", "cuda");
    peer_killed("tcp");
    peer_killed("cuda");
    cuda_completions();
    fabric_device_memory();
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
