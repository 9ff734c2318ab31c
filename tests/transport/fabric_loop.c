/* SPDX-License-Identifier: Apache-2.0 */
/* A plain libfabric RMA loop, to know the fabric path's overhead over libfabric itself: two
 * processes, one RDM endpoint each, batches of fi_read or fi_write (FI_DELIVERY_COMPLETE, as the
 * fabric path sends them) of `block` bytes into one registered buffer, both sides busy-polling
 * their CQ. Prints GB/s.
 *
 * usage: fabric_loop PROVIDER read|write BLOCK BATCH SECONDS */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        int rc_ = (int)(x);                                                                        \
        if (rc_ < 0) {                                                                             \
            fprintf(stderr, "fabric_loop: %s: %s\n", #x, fi_strerror(-rc_));                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    struct fid_mr *mr;
    uint8_t *buf;
    size_t len;
} side_t;

typedef struct {
    uint64_t base, key;
    size_t addr_len;
    uint8_t addr[64];
} card_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void side_open(side_t *s, const char *prov, size_t len)
{
    struct fi_info *hints = fi_allocinfo();
    hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    hints->fabric_attr->prov_name = strdup(prov);
    uint32_t v = fi_version(), h = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    CHECK(fi_getinfo(v < h ? v : h, NULL, NULL, 0, hints, &s->info));
    fi_freeinfo(hints);
    CHECK(fi_fabric(s->info->fabric_attr, &s->fabric, NULL));
    CHECK(fi_domain(s->fabric, s->info, &s->domain, NULL));
    struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_NONE};
    CHECK(fi_cq_open(s->domain, &ca, &s->cq, NULL));
    struct fi_av_attr aa = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(s->domain, &aa, &s->av, NULL));
    CHECK(fi_endpoint(s->domain, s->info, &s->ep, NULL));
    CHECK(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_ep_bind(s->ep, &s->av->fid, 0));
    CHECK(fi_enable(s->ep));
    s->len = len;
    s->buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (s->buf == MAP_FAILED)
        exit(1);
    memset(s->buf, 0x11, len);
    CHECK(fi_mr_reg(s->domain, s->buf, len, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE,
                    0, 7, 0, &s->mr, NULL));
    if (s->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        CHECK(fi_mr_bind(s->mr, &s->ep->fid, 0));
        CHECK(fi_mr_enable(s->mr));
    }
}

static void card_of(side_t *s, card_t *c)
{
    c->addr_len = sizeof c->addr;
    CHECK(fi_getname(&s->ep->fid, c->addr, &c->addr_len));
    c->key = fi_mr_key(s->mr);
    c->base = (s->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uintptr_t)s->buf : 0;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: fabric_loop PROVIDER read|write BLOCK BATCH SECONDS\n");
        return 2;
    }
    const char *prov = argv[1];
    int write_op = !strcmp(argv[2], "write");
    size_t block = strtoull(argv[3], NULL, 0), batch = strtoull(argv[4], NULL, 0);
    double secs = atof(argv[5]);
    size_t len = block * batch;
    int up[2], life[2];
    if (pipe(up) || pipe(life))
        return 1;
    pid_t pid = fork();
    if (pid == 0) { /* the target: registers, reports, progresses until told to stop */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(life[1]); /* else its end never sees EOF */
        close(up[0]);
        side_t t;
        side_open(&t, prov, len);
        card_t c;
        card_of(&t, &c);
        if (write(up[1], &c, sizeof c) != sizeof c)
            _exit(1);
        struct fi_cq_entry e;
        /* Manual-progress providers move nothing for a target that never reads its CQ. */
        for (unsigned n = 1;; n++) {
            fi_cq_read(t.cq, &e, 1);
            struct pollfd p = {.fd = life[0], .events = POLLIN};
            if ((n & 1023) == 0 && poll(&p, 1, 0) > 0) /* the parent closed it: done */
                break;
        }
        _exit(0);
    }
    close(life[0]);
    side_t s;
    side_open(&s, prov, len);
    card_t c;
    if (read(up[0], &c, sizeof c) != sizeof c)
        return 1;
    fi_addr_t peer;
    if (fi_av_insert(s.av, c.addr, 1, &peer, 0, NULL) != 1)
        return 1;
    void *desc = fi_mr_desc(s.mr);
    struct fi_context2 *ctx = calloc(batch, sizeof *ctx);
    uint64_t bytes = 0;
    double t0 = now_s(), t = t0;
    while (t - t0 < secs) {
        size_t posted = 0, done = 0;
        while (done < batch) {
            while (posted < batch) {
                struct iovec iov = {.iov_base = s.buf + posted * block, .iov_len = block};
                struct fi_rma_iov riov = {
                    .addr = c.base + posted * block, .len = block, .key = c.key};
                struct fi_msg_rma m = {.msg_iov = &iov,
                                       .desc = &desc,
                                       .iov_count = 1,
                                       .addr = peer,
                                       .rma_iov = &riov,
                                       .rma_iov_count = 1,
                                       .context = &ctx[posted]};
                ssize_t rc = write_op ? fi_writemsg(s.ep, &m, FI_COMPLETION | FI_DELIVERY_COMPLETE)
                                      : fi_readmsg(s.ep, &m, FI_COMPLETION);
                if (rc == -FI_EAGAIN)
                    break;
                CHECK(rc);
                posted++;
            }
            struct fi_cq_entry e[16];
            ssize_t n = fi_cq_read(s.cq, e, 16);
            if (n > 0) {
                done += (size_t)n;
            } else if (n == -FI_EAVAIL) {
                struct fi_cq_err_entry err = {0};
                fi_cq_readerr(s.cq, &err, 0);
                fprintf(stderr, "fabric_loop: completion error: %s\n", fi_strerror(err.err));
                return 1;
            }
        }
        bytes += len;
        t = now_s();
    }
    printf("fabric_loop %s %s block %zu batch %zu: %.3f GB/s\n", prov, write_op ? "write" : "read",
           block, batch, (double)bytes / (t - t0) / 1e9);
    close(life[1]);
    waitpid(pid, NULL, 0);
    return 0;
}
