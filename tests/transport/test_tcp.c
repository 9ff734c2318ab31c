/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport against hostile or broken peers on raw sockets: unauthenticated peers get
 * nothing (wrong or missing secret, replayed handshakes, frames before the proof), malformed
 * frames close that connection (never the engine), per-request errors keep it open, and a broken
 * target fails the initiator's handshake or requests promptly. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/clock.h"
#include "engine/internal.h"
#include "engine/wire.h"
#include "kvbridge/engine.h"

static kvb_engine_t *eng;
static uint8_t mem[1 << 16];

static void setup(void)
{
    kvb_log_set_level(0); /* the hostile cases log errors by design */
    kvb_config_t c;
    kvb_config_init(&c);
    c.connect_timeout_ms = 500;
    cr_assert_eq(kvb_engine_create(&c, &eng), KVB_OK);
    cr_assert_eq(kvb_register(eng, mem, sizeof mem, NULL, KVB_ACCESS_RW), KVB_OK);
}

static void teardown(void)
{
    kvb_engine_destroy(eng);
}

TestSuite(tcp, .init = setup, .fini = teardown, .timeout = 60);

static int raw_connect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

static void put_hdr(uint8_t *out, uint8_t type, int32_t status, uint64_t id, uint64_t addr,
                    uint64_t len)
{
    kvb_frame_hdr_t h = {.type = type, .status = status, .id = id, .addr = addr, .len = len};
    kvb__wire_encode_hdr(&h, out);
}

static size_t hello_frame(uint8_t *out)
{
    kvb_hello_t h = {.incarnation = 7, .pid = 1};
    strcpy(h.name, "raw:1");
    for (size_t i = 0; i < sizeof h.nonce; i++)
        h.nonce[i] = (uint8_t)rand();
    size_t n = kvb__wire_hello_encode(&h, out + KVB_WIRE_HDR_SIZE);
    put_hdr(out, KVB_FRAME_HELLO, 0, 0, 0, n);
    return KVB_WIRE_HDR_SIZE + n;
}

/* Reads one frame's header and body (malloc'd into *body). */
static kvb_frame_hdr_t recv_frame(int fd, uint8_t **body)
{
    uint8_t h[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t hdr;
    cr_assert_eq(recv(fd, h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
    cr_assert_eq(kvb__wire_decode_hdr(h, &hdr, NULL, 0), KVB_OK);
    uint8_t *b = malloc(hdr.len ? hdr.len : 1);
    if (hdr.len)
        cr_assert_eq(recv(fd, b, hdr.len, MSG_WAITALL), (ssize_t)hdr.len);
    if (body)
        *body = b;
    else
        free(b);
    return hdr;
}

/* Runs the initiator's side of the handshake by hand with `secret` (NULL: none): HELLO, the
 * target's CHALLENGE (its proof checked), our AUTH. The HELLO_ACK (and ATTRS) stay unread. Fills
 * *target with the target's hello and, if auth_out is not NULL, the AUTH frame sent. */
static void raw_login_as(int fd, const char *secret, uint32_t lane, kvb_hello_t *target,
                         uint8_t auth_out[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN])
{
    kvb_hello_t me = {.incarnation = 7, .pid = (uint32_t)getpid(), .lane = lane};
    kvb__host_id(me.host_id); /* same host: the engine offers a same-host link token */
    strcpy(me.name, "raw:1");
    for (size_t i = 0; i < sizeof me.nonce; i++)
        me.nonce[i] = (uint8_t)rand();
    uint8_t out[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAX_HELLO], *body;
    size_t n = kvb__wire_hello_encode(&me, out + KVB_WIRE_HDR_SIZE);
    put_hdr(out, KVB_FRAME_HELLO, 0, 0, 0, n);
    cr_assert_eq(send(fd, out, KVB_WIRE_HDR_SIZE + n, 0), (ssize_t)(KVB_WIRE_HDR_SIZE + n));
    kvb_frame_hdr_t h = recv_frame(fd, &body);
    cr_assert_eq(h.type, KVB_FRAME_CHALLENGE);
    kvb_hello_t their;
    uint8_t mac[KVB_WIRE_MAC_LEN], want[KVB_WIRE_MAC_LEN];
    cr_assert_eq(kvb__wire_challenge_decode(body, h.len, &their, mac), KVB_OK);
    free(body);
    size_t sl = secret ? strlen(secret) : 0;
    cr_assert_eq(
        kvb__wire_auth_mac((const uint8_t *)secret, sl, KVB_AUTH_TARGET, &me, &their, want),
        KVB_OK);
    cr_assert_arr_eq(mac, want, sizeof mac, "the target's proof does not check out");
    uint8_t auth[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN];
    put_hdr(auth, KVB_FRAME_AUTH, 0, 0, 0, KVB_WIRE_MAC_LEN);
    kvb__wire_auth_mac((const uint8_t *)secret, sl, KVB_AUTH_INITIATOR, &me, &their,
                       auth + KVB_WIRE_HDR_SIZE);
    cr_assert_eq(send(fd, auth, sizeof auth, 0), (ssize_t)sizeof auth);
    if (target)
        *target = their;
    if (auth_out)
        memcpy(auth_out, auth, sizeof auth);
}

static void raw_login(int fd)
{
    raw_login_as(fd, NULL, 0, NULL, NULL);
}

/* Reads and discards until EOF; true if the engine closed within 2 s. */
/* Reads the engine's answer to a lane-0 hello: HELLO_ACK, then the ATTRS frame. */
static void read_handshake_reply(int fd)
{
    const uint8_t want[] = {KVB_FRAME_HELLO_ACK, KVB_FRAME_ATTRS};
    for (int i = 0; i < 2; i++) {
        uint8_t h[KVB_WIRE_HDR_SIZE];
        kvb_frame_hdr_t hdr;
        cr_assert_eq(recv(fd, h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
        cr_assert_eq(kvb__wire_decode_hdr(h, &hdr, NULL, 0), KVB_OK);
        cr_assert_eq(hdr.type, want[i]);
        uint8_t *body = malloc(hdr.len);
        cr_assert_eq(recv(fd, body, hdr.len, MSG_WAITALL), (ssize_t)hdr.len);
        free(body);
    }
}

static bool closed_by_engine(int fd)
{
    uint8_t sink[4096];
    uint64_t deadline = kvb__deadline_ms(2000);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = kvb__ms_left(deadline);
        if (ms == 0 || poll(&p, 1, ms) <= 0)
            return false;
        ssize_t n = recv(fd, sink, sizeof sink, 0);
        if (n <= 0)
            return true;
    }
}

static void engine_still_serves(void)
{
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(eng, kvb_engine_segment_name(eng), &s), KVB_OK);
    cr_assert_eq(kvb_notify_send(eng, s, "alive", 5, 2000), KVB_OK);
    kvb_notification_t *n = malloc(sizeof *n);
    cr_assert_eq(kvb_notify_recv(eng, n, 2000), KVB_OK);
    cr_assert_eq(n->len, 5);
    free(n);
    kvb_segment_close(eng, s);
}

static void expect_closed_after(const uint8_t *bytes, size_t len, bool with_hello)
{
    int fd = raw_connect(kvb_engine_port(eng));
    if (with_hello)
        raw_login(fd);
    cr_assert_eq(send(fd, bytes, len, MSG_NOSIGNAL), (ssize_t)len);
    cr_assert(closed_by_engine(fd), "engine kept a hostile connection open");
    close(fd);
}

Test(tcp, garbage_closes_the_connection_only)
{
    uint8_t junk[64];
    memset(junk, 0x5A, sizeof junk);
    expect_closed_after(junk, sizeof junk, false);
    engine_still_serves();
}

Test(tcp, hostile_headers_are_refused)
{
    uint8_t f[KVB_WIRE_HDR_SIZE];
    put_hdr(f, KVB_FRAME_READ_REQ, 0, 1, (uintptr_t)mem, 8);
    expect_closed_after(f, sizeof f, false); /* request before the handshake */
    f[4] = 1;                                /* a version-1 peer */
    expect_closed_after(f, sizeof f, false);
    put_hdr(f, KVB_FRAME_HELLO, 0, 0, 0, KVB_WIRE_MAX_HELLO + 1);
    expect_closed_after(f, sizeof f, false);
    put_hdr(f, KVB_FRAME_WRITE_REQ, 0, 1, (uintptr_t)mem, KVB_WIRE_MAX_DATA + 1);
    expect_closed_after(f, sizeof f, true);
    put_hdr(f, KVB_FRAME_NOTIFY, 0, 1, 0, KVB_NOTIFY_MAX + 1);
    expect_closed_after(f, sizeof f, true);
    put_hdr(f, KVB_FRAME_READ_RESP, 0, 1, 0, 0); /* a response sent to a target */
    expect_closed_after(f, sizeof f, true);
    /* ... and same-host answer runs sent to a target (they used to pass unnoticed) */
    static const uint8_t answers[] = {KVB_FRAME_READ_RESP, KVB_FRAME_WRITE_ACK};
    for (size_t i = 0; i < sizeof answers; i++) {
        kvb_frame_hdr_t h = {.type = answers[i],
                             .flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN,
                             .id = 1,
                             .addr = 1,
                             .len = 8};
        kvb__wire_encode_hdr(&h, f);
        cr_assert_eq(kvb__wire_decode_hdr(f, &h, NULL, 0), KVB_OK, "the wire allows it");
        expect_closed_after(f, sizeof f, true);
    }
    put_hdr(f, KVB_FRAME_HELLO, 0, 0, 0, 10); /* a second hello */
    expect_closed_after(f, sizeof f, true);
    f[5] = 77; /* unknown type */
    expect_closed_after(f, sizeof f, true);
    uint8_t bad_hello[KVB_WIRE_HDR_SIZE + 10];
    put_hdr(bad_hello, KVB_FRAME_HELLO, 0, 0, 0, 10);
    memset(bad_hello + KVB_WIRE_HDR_SIZE, 0xFF, 10);
    expect_closed_after(bad_hello, sizeof bad_hello, false);
    engine_still_serves();
}

Test(tcp, truncated_frames_and_early_close)
{
    for (size_t cut = 1; cut < KVB_WIRE_HDR_SIZE + 20; cut += 7) {
        uint8_t f[KVB_WIRE_HDR_SIZE + 128];
        size_t n = hello_frame(f);
        int fd = raw_connect(kvb_engine_port(eng));
        cr_assert_eq(send(fd, f, cut < n ? cut : n, 0) > 0, true);
        close(fd);
    }
    engine_still_serves();
}

Test(tcp, per_request_errors_keep_the_connection)
{
    int fd = raw_connect(kvb_engine_port(eng));
    raw_login(fd);
    uint8_t out[KVB_WIRE_HDR_SIZE * 2];
    put_hdr(out, KVB_FRAME_READ_REQ, 0, 1, 0x10, 8); /* unregistered */
    put_hdr(out + KVB_WIRE_HDR_SIZE, KVB_FRAME_READ_REQ, 0, 2, (uintptr_t)mem, 4);
    cr_assert_eq(send(fd, out, sizeof out, 0), (ssize_t)sizeof out);
    /* HELLO_ACK and ATTRS, then READ_RESP(error), then READ_RESP(4 bytes). */
    read_handshake_reply(fd);
    uint8_t h[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t hdr;
    cr_assert_eq(recv(fd, h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
    cr_assert_eq(kvb__wire_decode_hdr(h, &hdr, NULL, 0), KVB_OK);
    cr_assert_eq(hdr.type, KVB_FRAME_READ_RESP);
    cr_assert_eq(hdr.id, 1);
    cr_assert_eq(hdr.status, KVB_ERR_REMOTE_NOT_REGISTERED);
    cr_assert_eq(recv(fd, h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
    cr_assert_eq(kvb__wire_decode_hdr(h, &hdr, NULL, 0), KVB_OK);
    cr_assert_eq(hdr.id, 2);
    cr_assert_eq(hdr.status, 0);
    cr_assert_eq(hdr.len, 4);
    close(fd);
}

/* READs that ask for a run (F_RUN) are answered in runs: successes with consecutive ids share
 * one header and their bytes follow one another; a failure, a READ that did not ask, and one
 * whose id does not follow answer alone (or start a run of their own). */
Test(tcp, reads_are_answered_in_runs)
{
    for (size_t i = 0; i < sizeof mem; i++)
        mem[i] = (uint8_t)(i * 7 + 3);
    struct {
        uint64_t id, off, len;
        uint16_t flags;
    } q[] = {{1, 0, 100, KVB_FRAME_F_RUN},
             {2, 500, 3000, KVB_FRAME_F_RUN},
             {3, 0, 0, KVB_FRAME_F_RUN}, /* unregistered */
             {4, 9000, 1, KVB_FRAME_F_RUN},
             {5, 100, 60000, KVB_FRAME_F_RUN},
             {6, 7, 50, 0},
             {7, 0, 10, KVB_FRAME_F_RUN},
             {9, 20, 30, KVB_FRAME_F_RUN},
             {10, 40, 5, KVB_FRAME_F_RUN}};
    enum { NQ = sizeof q / sizeof q[0] };
    /* The answers: first id, requests, flags, status, bytes. */
    const struct {
        uint64_t id, count;
        uint16_t flags;
        int32_t status;
        uint64_t len;
    } want[] = {{1, 2, KVB_FRAME_F_RUN, 0, 3100},
                {3, 0, 0, KVB_ERR_REMOTE_NOT_REGISTERED, 0},
                {4, 2, KVB_FRAME_F_RUN, 0, 60001},
                {6, 0, 0, 0, 50},
                {7, 0, 0, 0, 10},
                {9, 2, KVB_FRAME_F_RUN, 0, 35}};
    int fd = raw_connect(kvb_engine_port(eng));
    raw_login(fd);
    uint8_t out[NQ * KVB_WIRE_HDR_SIZE];
    for (size_t i = 0; i < NQ; i++) {
        kvb_frame_hdr_t h = {.type = KVB_FRAME_READ_REQ,
                             .flags = q[i].flags,
                             .id = q[i].id,
                             .addr = q[i].len ? (uintptr_t)mem + q[i].off : 0x10,
                             .len = q[i].len ? q[i].len : 8};
        kvb__wire_encode_hdr(&h, out + i * KVB_WIRE_HDR_SIZE);
    }
    cr_assert_eq(send(fd, out, sizeof out, 0), (ssize_t)sizeof out, "one send: one read pass");
    read_handshake_reply(fd);
    size_t next = 0; /* the request whose bytes come next */
    for (size_t a = 0; a < sizeof want / sizeof want[0]; a++) {
        uint8_t *body;
        kvb_frame_hdr_t h = recv_frame(fd, &body);
        cr_assert_eq(h.type, KVB_FRAME_READ_RESP, "answer %zu", a);
        cr_assert_eq(h.id, want[a].id, "answer %zu", a);
        cr_assert_eq(h.flags, want[a].flags, "answer %zu", a);
        cr_assert_eq(h.status, want[a].status, "answer %zu", a);
        cr_assert_eq(h.len, want[a].len, "answer %zu", a);
        if (want[a].count)
            cr_assert_eq(h.addr, want[a].count, "answer %zu", a);
        uint64_t at = 0;
        for (uint64_t k = 0; k < (want[a].count ? want[a].count : 1); k++, next++) {
            cr_assert_eq(q[next].id, h.id + k);
            if (h.status)
                continue;
            cr_assert_arr_eq(body + at, mem + q[next].off, q[next].len, "request %llu",
                             (unsigned long long)q[next].id);
            at += q[next].len;
        }
        cr_assert_eq(at, h.len);
        free(body);
    }
    cr_assert_eq(next, NQ);
    close(fd);
}

/* ---- a broken target --------------------------------------------------------------------------
 */

typedef struct {
    int listen_fd;
    /* 0: silent, 1: garbage after hello; after a good hello: 2: a wrong READ_RESP id, 3: a run
     * of two answers to one request, 4: a run one byte short, 5: a run of one, as it should be
     * (if the request asked for a run), 6: the same as 5 with the bytes trickling in - half at
     * once, the rest 4 KiB at a time, 2 ms apart */
    int mode;
} fake_t;

static void *fake_target(void *arg)
{
    fake_t *f = arg;
    int fd = accept(f->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    uint8_t in[4096];
    kvb_hello_t their;
    /* the hello */
    ssize_t n = recv(fd, in, KVB_WIRE_HDR_SIZE, MSG_WAITALL);
    kvb_frame_hdr_t hh;
    if (n == KVB_WIRE_HDR_SIZE && kvb__wire_decode_hdr(in, &hh, NULL, 0) == 0 &&
        recv(fd, in, hh.len, MSG_WAITALL) == (ssize_t)hh.len)
        kvb__wire_hello_decode(in, hh.len, &their);
    if (f->mode == 1) {
        memset(in, 0x42, 100);
        send(fd, in, 100, MSG_NOSIGNAL);
    } else if (f->mode >= 2) {
        kvb_hello_t me = {.incarnation = 9};
        strcpy(me.name, "fake:1");
        kvb_region_desc_t r = {.info = {.addr = 0x1000, .len = 1 << 20, .access = KVB_ACCESS_RW}};
        strcpy(r.info.location, "cpu");
        uint8_t *body, hdr[KVB_WIRE_HDR_SIZE];
        size_t len;
        /* A target that knows the (empty) secret: challenge, then the initiator's proof. */
        uint8_t ch[KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN];
        size_t hl = kvb__wire_hello_encode(&me, ch);
        kvb__wire_auth_mac(NULL, 0, KVB_AUTH_TARGET, &their, &me, ch + hl);
        put_hdr(hdr, KVB_FRAME_CHALLENGE, 0, 0, 0, hl + KVB_WIRE_MAC_LEN);
        send(fd, hdr, sizeof hdr, MSG_NOSIGNAL);
        send(fd, ch, hl + KVB_WIRE_MAC_LEN, MSG_NOSIGNAL);
        recv(fd, in, KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN, MSG_WAITALL);
        kvb__wire_hello_ack_encode(&me, &r, 1, &body, &len);
        put_hdr(hdr, KVB_FRAME_HELLO_ACK, 0, 0, 0, len);
        send(fd, hdr, sizeof hdr, MSG_NOSIGNAL);
        send(fd, body, len, MSG_NOSIGNAL);
        free(body);
        kvb__wire_attrs_encode(NULL, 0, &body, &len);
        put_hdr(hdr, KVB_FRAME_ATTRS, 0, 0, 0, len);
        send(fd, hdr, sizeof hdr, MSG_NOSIGNAL);
        send(fd, body, len, MSG_NOSIGNAL);
        free(body);
        kvb_frame_hdr_t req;
        if (recv(fd, in, KVB_WIRE_HDR_SIZE, MSG_WAITALL) == KVB_WIRE_HDR_SIZE &&
            kvb__wire_decode_hdr(in, &req, NULL, 0) == KVB_OK) {
            kvb_frame_hdr_t ans = {.type = KVB_FRAME_READ_RESP, .id = 999}; /* never asked */
            if (f->mode >= 3 && (req.flags & KVB_FRAME_F_RUN))
                ans = (kvb_frame_hdr_t){.type = KVB_FRAME_READ_RESP,
                                        .flags = KVB_FRAME_F_RUN,
                                        .id = req.id,
                                        .addr = f->mode == 3 ? 2 : 1,
                                        .len = req.len * (f->mode == 3 ? 2 : 1) - (f->mode == 4)};
            kvb__wire_encode_hdr(&ans, hdr);
            uint8_t *data = malloc(ans.len);
            memset(data, 0x5A, ans.len);
            send(fd, hdr, sizeof hdr, MSG_NOSIGNAL);
            uint64_t at = f->mode == 6 ? ans.len / 2 : ans.len;
            send(fd, data, at, MSG_NOSIGNAL);
            for (; at < ans.len; at += 4096) {
                usleep(2000);
                send(fd, data + at, ans.len - at < 4096 ? ans.len - at : 4096, MSG_NOSIGNAL);
            }
            free(data);
        }
    }
    /* Hold the connection until the engine gives up on it. */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    poll(&p, 1, 3000);
    close(fd);
    return NULL;
}

static int fake_open(fake_t *f, pthread_t *tid, char *name, size_t cap)
{
    f->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t sl = sizeof sa;
    bind(f->listen_fd, (struct sockaddr *)&sa, sizeof sa);
    listen(f->listen_fd, 4);
    getsockname(f->listen_fd, (struct sockaddr *)&sa, &sl);
    snprintf(name, cap, "127.0.0.1:%u", ntohs(sa.sin_port));
    return pthread_create(tid, NULL, fake_target, f);
}

static uint8_t fake_local[256 << 10]; /* where open_fake's READ lands */
static size_t fake_len = 64;          /* its length */

static int open_fake(int mode, kvb_segment_t *s)
{
    fake_t f = {.mode = mode};
    pthread_t tid;
    char name[64];
    fake_open(&f, &tid, name, sizeof name);
    kvb_config_t c;
    kvb_config_init(&c);
    c.lanes = 1;
    c.connect_timeout_ms = 400;
    kvb_engine_t *e;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    int rc = kvb_segment_open(e, name, s);
    if (rc == KVB_OK) {
        memset(fake_local, 0, sizeof fake_local);
        kvb_register(e, fake_local, sizeof fake_local, NULL, KVB_ACCESS_RW);
        kvb_request_t r = {KVB_OP_READ, fake_local, *s, 0x1000, fake_len};
        kvb_batch_t *b;
        cr_assert_eq(kvb_batch_submit(e, &r, 1, NULL, &b), KVB_OK);
        rc = kvb_batch_wait(b, 2000);
        kvb_batch_free(b);
    }
    kvb_engine_destroy(e);
    pthread_join(tid, NULL);
    close(f.listen_fd);
    return rc;
}

Test(tcp, silent_target_times_out_the_handshake)
{
    kvb_segment_t s;
    uint64_t t0 = kvb__now_ns();
    cr_assert_eq(open_fake(0, &s), KVB_ERR_TIMEOUT);
    cr_assert_lt(kvb__now_ns() - t0, 3500000000ull);
}

Test(tcp, garbage_handshake_is_a_protocol_error)
{
    kvb_segment_t s;
    cr_assert_eq(open_fake(1, &s), KVB_ERR_PROTOCOL);
}

Test(tcp, reply_to_unknown_request_is_a_protocol_error)
{
    kvb_segment_t s;
    cr_assert_eq(open_fake(2, &s), KVB_ERR_PROTOCOL);
}

/* An answer run must answer exactly the requests in flight that asked for one, with exactly
 * their bytes; a READ into host memory asks. */
Test(tcp, answer_runs_are_checked_whole)
{
    kvb_segment_t s;
    int rc = open_fake(3, &s);
    cr_assert_eq(rc, KVB_ERR_PROTOCOL, "a run longer than what is in flight: %s", kvb_strerror(rc));
    cr_assert_eq(open_fake(4, &s), KVB_ERR_PROTOCOL, "a run one byte short");
    cr_assert_eq(open_fake(5, &s), KVB_OK, "a run of one");
    for (size_t i = 0; i < fake_len; i++)
        cr_assert_eq(fake_local[i], 0x5A, "byte %zu", i);
}

/* A large answer whose second half trickles in 4 KiB at a time still ends, whole, as its last
 * byte lands - 128 KiB at once, then 32 pieces 2 ms apart: a reader never waits for more than is
 * owed, and never for a deadline. */
Test(tcp, trickling_answer_completes_whole)
{
    kvb_segment_t s;
    fake_len = sizeof fake_local;
    uint64_t t0 = kvb__now_ns();
    int rc = open_fake(6, &s);
    cr_assert_eq(rc, KVB_OK, "%s", kvb_strerror(rc));
    for (size_t i = 0; i < fake_len; i++)
        cr_assert_eq(fake_local[i], 0x5A, "byte %zu", i);
    /* The engine's wait is 2 s: ended by the bytes, not by a deadline. */
    cr_assert_lt(kvb__now_ns() - t0, 1500000000ull);
}

/* A peer that floods requests and reads no answers is held off (its sends start to block), and
 * every answer still arrives, in order, once it reads. */
Test(tcp, flooding_peer_is_held_off_then_served)
{
    int fd = raw_connect(kvb_engine_port(eng));
    raw_login(fd);
    enum { MAX = 1000000 };
    uint64_t sent = 0;
    bool blocked = false;
    /* One frame per send, each after POLLOUT, so that no send is partial. */
    while (sent < MAX && !blocked) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        if (poll(&p, 1, 1000) == 0) { /* no room for 1 s: the engine holds us off */
            blocked = true;
            break;
        }
        uint8_t f[KVB_WIRE_HDR_SIZE];
        put_hdr(f, KVB_FRAME_READ_REQ, 0, sent + 1, (uintptr_t)mem, 4);
        cr_assert_eq(send(fd, f, sizeof f, MSG_DONTWAIT), (ssize_t)sizeof f);
        sent++;
    }
    cr_assert(blocked, "the engine queued answers for %llu unread requests",
              (unsigned long long)sent);
    /* Now read: the handshake reply, then one 4-byte READ_RESP per request, in order. */
    read_handshake_reply(fd);
    kvb_frame_hdr_t hdr;
    for (uint64_t id = 1; id <= sent; id++) {
        uint8_t r[KVB_WIRE_HDR_SIZE + 4];
        cr_assert_eq(recv(fd, r, sizeof r, MSG_WAITALL), (ssize_t)sizeof r, "answer %llu",
                     (unsigned long long)id);
        cr_assert_eq(kvb__wire_decode_hdr(r, &hdr, NULL, 0), KVB_OK);
        cr_assert_eq(hdr.id, id);
        cr_assert_eq(hdr.status, 0);
    }
    close(fd);
}

/* ---- authentication and the same-host path against hostile peers ------------------------------
 */

#define SECRET "kvbridge test cluster secret 0123456789"

static void setup_secret(void)
{
    kvb_log_set_level(0);
    kvb_config_t c;
    kvb_config_init(&c);
    c.connect_timeout_ms = 500;
    c.secret = SECRET;
    c.secret_len = strlen(SECRET);
    c.max_connections = 8;
    c.shm_map_max = 1u << 20;
    cr_assert_eq(kvb_engine_create(&c, &eng), KVB_OK);
    cr_assert_eq(kvb_register(eng, mem, sizeof mem, NULL, KVB_ACCESS_RW), KVB_OK);
}

TestSuite(hostile, .init = setup_secret, .fini = teardown, .timeout = 60);

/* Everything the engine sends until it closes, as a list of frame types (0-terminated). */
static void frames_until_close(int fd, uint8_t *types, size_t cap, int32_t *last_status)
{
    size_t n = 0;
    *last_status = 0;
    for (;;) {
        uint8_t h[KVB_WIRE_HDR_SIZE];
        struct pollfd p = {.fd = fd, .events = POLLIN};
        cr_assert_gt(poll(&p, 1, 3000), 0, "engine neither answered nor closed");
        ssize_t got = recv(fd, h, sizeof h, MSG_WAITALL);
        if (got <= 0)
            break;
        cr_assert_eq(got, (ssize_t)sizeof h);
        kvb_frame_hdr_t hdr;
        cr_assert_eq(kvb__wire_decode_hdr(h, &hdr, NULL, 0), KVB_OK);
        if (hdr.len) {
            uint8_t *skip = malloc(hdr.len);
            cr_assert_eq(recv(fd, skip, hdr.len, MSG_WAITALL), (ssize_t)hdr.len);
            free(skip);
        }
        cr_assert_lt(n + 1, cap);
        types[n++] = hdr.type;
        *last_status = hdr.status;
    }
    types[n] = 0;
}

static void engine_serves_with_secret(void)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.secret = SECRET;
    c.secret_len = strlen(SECRET);
    kvb_engine_t *me;
    cr_assert_eq(kvb_engine_create(&c, &me), KVB_OK);
    kvb_segment_t s;
    cr_assert_eq(kvb_segment_open(me, kvb_engine_segment_name(eng), &s), KVB_OK);
    static uint8_t local[4096];
    memset(mem, 0xA7, sizeof local);
    cr_assert_eq(kvb_register(me, local, sizeof local, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, local, s, (uintptr_t)mem, sizeof local};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(me, &r, 1, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, 5000), KVB_OK);
    kvb_batch_free(b);
    for (size_t i = 0; i < sizeof local; i++)
        cr_assert_eq(local[i], 0xA7);
    kvb_engine_destroy(me);
}

Test(hostile, frames_before_the_proof_get_nothing)
{
    /* HELLO, then a READ and a NOTIFY without AUTH: the engine answers the HELLO with its
     * challenge and nothing else, and closes. */
    int fd = raw_connect(kvb_engine_port(eng));
    uint8_t out[KVB_WIRE_HDR_SIZE + 512];
    size_t n = hello_frame(out);
    put_hdr(out + n, KVB_FRAME_READ_REQ, 0, 1, (uintptr_t)mem, 64);
    put_hdr(out + n + KVB_WIRE_HDR_SIZE, KVB_FRAME_NOTIFY, 0, 2, 0, 4);
    memcpy(out + n + 2 * KVB_WIRE_HDR_SIZE, "evil", 4);
    send(fd, out, n + 2 * KVB_WIRE_HDR_SIZE + 4, MSG_NOSIGNAL);
    uint8_t types[16];
    int32_t st;
    frames_until_close(fd, types, sizeof types, &st);
    /* The challenge may or may not have left before the engine hung up; nothing else may. */
    for (int i = 0; types[i]; i++)
        cr_assert_eq(types[i], KVB_FRAME_CHALLENGE, "got frame type %u before authenticating",
                     types[i]);
    close(fd);
    kvb_notification_t *nt = malloc(sizeof *nt);
    cr_assert_eq(kvb_notify_recv(eng, nt, 300), KVB_ERR_TIMEOUT, "a forged notification arrived");
    free(nt);
    engine_serves_with_secret();
}

Test(hostile, a_wrong_secret_gets_an_auth_error_and_nothing_else)
{
    int fd = raw_connect(kvb_engine_port(eng));
    uint8_t out[KVB_WIRE_HDR_SIZE + 512], *body;
    kvb_hello_t me = {.incarnation = 3, .pid = 1};
    strcpy(me.name, "mallory:1");
    size_t n = kvb__wire_hello_encode(&me, out + KVB_WIRE_HDR_SIZE);
    put_hdr(out, KVB_FRAME_HELLO, 0, 0, 0, n);
    send(fd, out, KVB_WIRE_HDR_SIZE + n, 0);
    kvb_frame_hdr_t h = recv_frame(fd, &body);
    cr_assert_eq(h.type, KVB_FRAME_CHALLENGE);
    kvb_hello_t their;
    uint8_t mac[KVB_WIRE_MAC_LEN];
    cr_assert_eq(kvb__wire_challenge_decode(body, h.len, &their, mac), KVB_OK);
    free(body);
    uint8_t auth[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN];
    put_hdr(auth, KVB_FRAME_AUTH, 0, 0, 0, KVB_WIRE_MAC_LEN);
    const char *guess = "not the cluster secret at all";
    kvb__wire_auth_mac((const uint8_t *)guess, strlen(guess), KVB_AUTH_INITIATOR, &me, &their,
                       auth + KVB_WIRE_HDR_SIZE);
    send(fd, auth, sizeof auth, MSG_NOSIGNAL);
    uint8_t types[8];
    int32_t st;
    frames_until_close(fd, types, sizeof types, &st);
    cr_assert_eq(types[0], KVB_FRAME_ERROR, "no region list for a wrong proof");
    cr_assert_eq(types[1], 0);
    cr_assert_eq(st, KVB_ERR_AUTH);
    close(fd);
    engine_serves_with_secret();
}

Test(hostile, a_replayed_handshake_is_refused)
{
    /* Record a genuine handshake (with the secret), then replay its HELLO and AUTH on a new
     * connection: the engine's fresh nonce makes the old proof worthless. */
    int fd = raw_connect(kvb_engine_port(eng));
    uint8_t auth[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN];
    kvb_hello_t target;
    srand(1234);
    raw_login_as(fd, SECRET, 0, &target, auth);
    read_handshake_reply(fd); /* accepted: HELLO_ACK and ATTRS */
    close(fd);
    srand(1234); /* the same HELLO bytes (same nonce) again */
    uint8_t hello[KVB_WIRE_HDR_SIZE + 512];
    kvb_hello_t me = {.incarnation = 7, .pid = (uint32_t)getpid()};
    kvb__host_id(me.host_id);
    strcpy(me.name, "raw:1");
    for (size_t i = 0; i < sizeof me.nonce; i++)
        me.nonce[i] = (uint8_t)rand();
    size_t n = kvb__wire_hello_encode(&me, hello + KVB_WIRE_HDR_SIZE);
    put_hdr(hello, KVB_FRAME_HELLO, 0, 0, 0, n);
    fd = raw_connect(kvb_engine_port(eng));
    send(fd, hello, KVB_WIRE_HDR_SIZE + n, 0);
    send(fd, auth, sizeof auth, MSG_NOSIGNAL);
    uint8_t types[8];
    int32_t st;
    frames_until_close(fd, types, sizeof types, &st);
    cr_assert_eq(types[0], KVB_FRAME_CHALLENGE);
    cr_assert_eq(types[1], KVB_FRAME_ERROR, "a replayed proof was accepted");
    cr_assert_eq(st, KVB_ERR_AUTH);
    close(fd);
    engine_serves_with_secret();
}

Test(hostile, notifications_carry_the_proven_name)
{
    int fd = raw_connect(kvb_engine_port(eng));
    raw_login_as(fd, SECRET, 0, NULL, NULL);
    read_handshake_reply(fd);
    uint8_t f[KVB_WIRE_HDR_SIZE + 4];
    put_hdr(f, KVB_FRAME_NOTIFY, 0, 1, 0, 4);
    memcpy(f + KVB_WIRE_HDR_SIZE, "done", 4);
    send(fd, f, sizeof f, 0);
    kvb_frame_hdr_t h = recv_frame(fd, NULL);
    cr_assert_eq(h.type, KVB_FRAME_NOTIFY_ACK);
    kvb_notification_t *nt = malloc(sizeof *nt);
    cr_assert_eq(kvb_notify_recv(eng, nt, 2000), KVB_OK);
    cr_assert_str_eq(nt->from, "raw:1", "the name proved in the handshake");
    free(nt);
    close(fd);
}

Test(hostile, silent_connections_are_closed_at_the_handshake_deadline)
{
    int fd = raw_connect(kvb_engine_port(eng));
    uint64_t t0 = kvb__now_ns();
    struct pollfd p = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 3000), 1, "a silent connection was kept past the deadline");
    uint8_t b;
    cr_assert_leq(recv(fd, &b, 1, 0), 0);
    cr_assert_lt(kvb__now_ns() - t0, 2000000000ull);
    close(fd);
}

Test(hostile, connections_past_the_cap_are_refused)
{
    int fds[8];
    for (int i = 0; i < 8; i++)
        fds[i] = raw_connect(kvb_engine_port(eng));
    usleep(100000);
    int extra = raw_connect(kvb_engine_port(eng));
    struct pollfd p = {.fd = extra, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 400), 1, "the 9th connection was kept");
    uint8_t b;
    cr_assert_leq(recv(extra, &b, 1, 0), 0);
    close(extra);
    for (int i = 0; i < 8; i++)
        close(fds[i]);
    usleep(100000);
    engine_serves_with_secret();
}

Test(hostile, out_of_descriptors_sheds_connections_without_spinning)
{
    struct rlimit old, low;
    getrlimit(RLIMIT_NOFILE, &old);
    int probe = dup(0);
    low = old;
    low.rlim_cur = (rlim_t)probe + 4;
    close(probe);
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
    int held[16], nheld = 0, d;
    while (nheld < 16 && (d = dup(0)) >= 0)
        held[nheld++] = d;
    cr_assert_eq(errno, EMFILE);
    /* Clients need descriptors too: give two back for them. */
    close(held[--nheld]);
    close(held[--nheld]);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    int c1 = raw_connect(kvb_engine_port(eng));
    struct pollfd p = {.fd = c1, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 2000), 1, "a connection the engine cannot take must be closed");
    usleep(500000);
    getrusage(RUSAGE_SELF, &r1);
    double cpu = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec -
                          r0.ru_stime.tv_sec) +
                 (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec -
                          r0.ru_stime.tv_usec) /
                     1e6;
    cr_assert_lt(cpu, 0.3, "the engine spun on EMFILE: %.2f s of CPU in 0.5 s", cpu);
    close(c1);
    while (nheld > 0)
        close(held[--nheld]);
    setrlimit(RLIMIT_NOFILE, &old);
    usleep(300000);
    engine_serves_with_secret();
}

/* The same-host side channel, spoken by hand: the message layout of src/transport/shm.c. */
typedef struct {
    uint32_t magic;
    uint16_t version, type;
    int32_t status;
    uint32_t reserved;
    uint64_t a, b, c, d;
} shm_msg_t;

static int unix_call(int fd, uint16_t type, const uint8_t *token, uint64_t c, uint64_t d,
                     int pass_fd)
{
    shm_msg_t m = {.magic = 0x5342564Bu, .version = 3, .type = type, .c = c, .d = d}; /* MSG_* */
    if (token) {
        memcpy(&m.a, token, 8);
        memcpy(&m.b, token + 8, 8);
    }
    struct iovec iov = {.iov_base = &m, .iov_len = sizeof m};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (pass_fd >= 0) {
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof u.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &pass_fd, sizeof(int));
    }
    if (sendmsg(fd, &mh, MSG_NOSIGNAL) != (ssize_t)sizeof m)
        return 1;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 2000) != 1 || recv(fd, &m, sizeof m, 0) != (ssize_t)sizeof m)
        return 1; /* closed: a refusal that ends the link */
    return m.status;
}

/* Logs in over TCP with the secret and returns the same-host token from HELLO_ACK; *unix_fd is
 * connected to the engine's side channel. */
static int raw_link(int *tcp_fd, int *unix_fd, uint8_t token[16])
{
    *tcp_fd = raw_connect(kvb_engine_port(eng));
    kvb_hello_t target, ack;
    raw_login_as(*tcp_fd, SECRET, 0, &target, NULL);
    uint8_t *body;
    kvb_frame_hdr_t h = recv_frame(*tcp_fd, &body);
    cr_assert_eq(h.type, KVB_FRAME_HELLO_ACK);
    kvb_region_desc_t *regions;
    size_t n;
    cr_assert_eq(kvb__wire_hello_ack_decode(body, h.len, &ack, &regions, &n), KVB_OK);
    free(body);
    free(regions);
    recv_frame(*tcp_fd, NULL); /* ATTRS */
    memcpy(token, ack.nonce, 16);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int len = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "kvbridge-%016llx",
                       (unsigned long long)target.incarnation);
    *unix_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    cr_assert_eq(connect(*unix_fd, (struct sockaddr *)&sa,
                         (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)len)),
                 0);
    return 0;
}

/* raw_link, bound: the side channel's HELLO spends the token, so that the connection's same-host
 * requests may copy into this process. */
static void raw_bound_link(int *tcp_fd, int *unix_fd)
{
    uint8_t token[16];
    raw_link(tcp_fd, unix_fd, token);
    static uint64_t probe = 0x1234;
    cr_assert_eq(unix_call(*unix_fd, 1 /* M_HELLO */, token, (uintptr_t)&probe, probe, -1), 0);
}

/* The next frame on fd, a same-host READ answer (a header alone). */
static kvb_frame_hdr_t recv_shm_answer(int fd)
{
    uint8_t b[KVB_WIRE_HDR_SIZE];
    kvb_frame_hdr_t h;
    cr_assert_eq(recv(fd, b, sizeof b, MSG_WAITALL), (ssize_t)sizeof b);
    cr_assert_eq(kvb__wire_decode_hdr(b, &h, NULL, 0), KVB_OK);
    cr_assert_eq(h.type, KVB_FRAME_READ_RESP);
    cr_assert(h.flags & KVB_FRAME_F_SHM);
    cr_assert_eq(kvb__wire_payload_len(&h), 0, "a same-host answer carries no data");
    return h;
}

/* A raw connection to the engine's same-host lane socket: an abstract Unix stream socket named
 * by its incarnation. */
static int raw_connect_local(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int len = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "kvbridge-%016llx-lanes",
                       (unsigned long long)eng->hello.incarnation);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa,
                         (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)len)),
                 0, "no same-host lane socket: %s", strerror(errno));
    return fd;
}

/* Sends a HELLO naming process `pid` on `host` and expects the engine to hang up without a
 * challenge. */
static void local_hello_refused(uint32_t pid, const uint8_t host[KVB_HOST_ID_LEN])
{
    int fd = raw_connect_local();
    kvb_hello_t me = {.incarnation = 7, .pid = pid};
    memcpy(me.host_id, host, KVB_HOST_ID_LEN);
    strcpy(me.name, "raw:1");
    uint8_t out[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAX_HELLO];
    size_t n = kvb__wire_hello_encode(&me, out + KVB_WIRE_HDR_SIZE);
    put_hdr(out, KVB_FRAME_HELLO, 0, 0, 0, n);
    cr_assert_eq(send(fd, out, KVB_WIRE_HDR_SIZE + n, 0), (ssize_t)(KVB_WIRE_HDR_SIZE + n));
    uint8_t types[8];
    int32_t st;
    frames_until_close(fd, types, sizeof types, &st);
    cr_assert_eq(types[0], 0, "pid %u: got frame type %u, not a hang-up", pid, types[0]);
    close(fd);
}

/* A same-host lane is the process the kernel says is at the other end: a hello naming another
 * process, or another host, is refused before any challenge (so no same-host token is ever
 * offered for a process that did not connect). This process itself is served, on the same socket,
 * exactly as over TCP. */
Test(hostile, same_host_lanes_take_only_the_process_connected)
{
    uint8_t here[KVB_HOST_ID_LEN], elsewhere[KVB_HOST_ID_LEN];
    kvb__host_id(here);
    memcpy(elsewhere, here, sizeof here);
    elsewhere[0] ^= 1;
    local_hello_refused((uint32_t)getpid() + 1, here);
    local_hello_refused(1, here);
    local_hello_refused((uint32_t)getpid(), elsewhere);
    int fd = raw_connect_local();
    raw_login_as(fd, SECRET, 0, NULL, NULL);
    read_handshake_reply(fd);
    close(fd);
    engine_serves_with_secret();
}

/* A same-host request run (F_SHM | F_RUN) of n READs, ids id..id+n-1: request k asks for lens[k]
 * bytes (NULL: 64) of mem at 64k, to go to theirs + step * k, within a minute. Returns its size. */
static size_t shm_run(uint8_t *out, uint64_t id, size_t n, const uint64_t *lens, uint64_t theirs,
                      uint64_t step)
{
    kvb_frame_hdr_t h = {.type = KVB_FRAME_READ_REQ,
                         .flags = KVB_FRAME_F_SHM | KVB_FRAME_F_RUN,
                         .id = id,
                         .addr = n,
                         .len = n * KVB_WIRE_SHM_ENTRY};
    kvb__wire_encode_hdr(&h, out);
    for (size_t k = 0; k < n; k++) {
        kvb_shm_entry_t e = {.remote = (uintptr_t)mem + 64 * k,
                             .len = lens ? lens[k] : 64,
                             .local = theirs + step * k,
                             .deadline = kvb__now_ns() + 60000000000ull};
        kvb__wire_shm_entry_encode(&e, out + KVB_WIRE_HDR_SIZE + k * KVB_WIRE_SHM_ENTRY);
    }
    return KVB_WIRE_HDR_SIZE + n * KVB_WIRE_SHM_ENTRY;
}

Test(hostile, shm_requests_need_a_bound_link)
{
    /* Authenticated, same host, but no link bound: READs naming an address in some process must
     * not make the engine copy anywhere. Each is refused on its own, in order. */
    int fd = raw_connect(kvb_engine_port(eng));
    raw_login_as(fd, SECRET, 0, NULL, NULL);
    read_handshake_reply(fd);
    uint8_t f[KVB_WIRE_HDR_SIZE + 2 * KVB_WIRE_SHM_ENTRY];
    static const uint64_t lens[] = {64, 64};
    size_t n = shm_run(f, 1, 2, lens, 0x7f0000001000ull, 0);
    cr_assert_eq(send(fd, f, n, 0), (ssize_t)n);
    for (uint64_t id = 1; id <= 2; id++) {
        kvb_frame_hdr_t h = recv_frame(fd, NULL);
        cr_assert_eq(h.type, KVB_FRAME_READ_RESP);
        cr_assert_eq(h.id, id);
        cr_assert_eq(h.status, KVB_ERR_SHM_COPY);
    }
    close(fd);
}

/* A same-host request outside a run, or a run entry asking for more than a frame may carry,
 * ends the connection (nothing answered as done); the engine goes on serving others. */
Test(hostile, shm_request_runs_are_checked)
{
    for (int bad = 0; bad < 3; bad++) {
        int fd = raw_connect(kvb_engine_port(eng));
        raw_login_as(fd, SECRET, 0, NULL, NULL);
        read_handshake_reply(fd);
        uint8_t f[KVB_WIRE_HDR_SIZE + 3 * KVB_WIRE_SHM_ENTRY];
        uint64_t lens[] = {64, KVB_WIRE_MAX_DATA + 1, 64};
        size_t n = shm_run(f, 1, 3, lens, 0x7f0000001000ull, 0);
        if (bad == 1) { /* the old single form: a header and an 8-byte address */
            kvb_frame_hdr_t h = {.type = KVB_FRAME_WRITE_REQ,
                                 .flags = KVB_FRAME_F_SHM,
                                 .id = 1,
                                 .addr = (uintptr_t)mem,
                                 .len = 64};
            kvb__wire_encode_hdr(&h, f);
            memset(f + KVB_WIRE_HDR_SIZE, 0, 8);
            n = KVB_WIRE_HDR_SIZE + 8;
        } else if (bad == 2) { /* a header whose length does not match its count */
            f[32] = (uint8_t)(3 * KVB_WIRE_SHM_ENTRY - 1);
        }
        cr_assert_eq(send(fd, f, n, MSG_NOSIGNAL), (ssize_t)n);
        uint8_t types[8];
        int32_t st;
        frames_until_close(fd, types, sizeof types, &st);
        /* bad 0: the first request's refusal may go out before the second is read */
        for (size_t i = 0; types[i]; i++) {
            cr_assert_eq(bad, 0, "case %d: frame type %u", bad, types[i]);
            cr_assert_eq(types[i], KVB_FRAME_READ_RESP);
            cr_assert_neq(st, KVB_OK, "a request of an ill-formed run was answered as done");
        }
        close(fd);
    }
    engine_serves_with_secret();
}

Test(hostile, link_tokens_are_one_time_and_memfds_must_be_sealed)
{
    int tfd, ufd;
    uint8_t token[16], wrong[16];
    raw_link(&tfd, &ufd, token);
    memcpy(wrong, token, 16);
    wrong[0] ^= 0x80;
    static uint64_t probe = 0x1234;
    /* A wrong token ends the link at once. */
    cr_assert_neq(unix_call(ufd, 1 /* M_HELLO */, wrong, (uintptr_t)&probe, probe, -1), 0);
    close(ufd);
    close(tfd);

    raw_link(&tfd, &ufd, token);
    cr_assert_eq(unix_call(ufd, 1 /* M_HELLO */, token, (uintptr_t)&probe, probe, -1), 0);
    /* Spent: the same token cannot bind again. */
    cr_assert_neq(unix_call(ufd, 7 /* M_BIND */, token, 0, 0, -1), 0, "a token was reused");
    close(ufd);
    close(tfd);

    raw_link(&tfd, &ufd, token);
    cr_assert_eq(unix_call(ufd, 1, token, (uintptr_t)&probe, probe, -1), 0);
    int unsealed = memfd_create("t", MFD_CLOEXEC);
    cr_assert_eq(ftruncate(unsealed, 65536), 0);
    shm_msg_t dummy;
    (void)dummy;
    cr_assert_eq(unix_call(ufd, 3 /* M_SHARE */,
                           (const uint8_t *)"\1\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 65536, 0, unsealed),
                 KVB_ERR_ACCESS_DENIED, "an unsealed memfd (could shrink under the engine)");
    close(unsealed);
    /* Sealed but past the engine's map cap (1 MiB here): refused, nothing mapped. */
    int big = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_eq(ftruncate(big, 2 << 20), 0);
    cr_assert_eq(fcntl(big, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    cr_assert_eq(
        unix_call(ufd, 3, (const uint8_t *)"\2\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 2 << 20, 0, big),
        KVB_ERR_TOO_LARGE);
    close(big);
    close(ufd);
    close(tfd);
    engine_serves_with_secret();
}

/* A same-host request whose deadline has passed is not copied (its initiator may have reused the
 * memory meanwhile: a target that stalled must not write into it when it resumes) and is
 * answered KVB_ERR_TIMEOUT; the request beside it, still in time, is copied and answered. */
Test(hostile, shm_request_past_its_deadline_copies_nothing)
{
    for (size_t i = 0; i < 128; i++)
        mem[i] = (uint8_t)(i * 7 + 3);
    int tfd, ufd;
    raw_bound_link(&tfd, &ufd);
    static uint8_t dst[128];
    memset(dst, 0, sizeof dst);
    uint8_t f[KVB_WIRE_HDR_SIZE + 2 * KVB_WIRE_SHM_ENTRY];
    size_t len = shm_run(f, 1, 2, NULL, (uintptr_t)dst, 64);
    kvb_shm_entry_t late = {.remote = (uintptr_t)mem,
                            .len = 64,
                            .local = (uintptr_t)dst,
                            .deadline = kvb__now_ns() - 1000000};
    kvb__wire_shm_entry_encode(&late, f + KVB_WIRE_HDR_SIZE);
    cr_assert_eq(send(tfd, f, len, 0), (ssize_t)len);
    for (uint64_t id = 1; id <= 2;) {
        kvb_frame_hdr_t h = recv_shm_answer(tfd);
        cr_assert_eq(h.id, id);
        cr_assert_eq(h.status, id == 1 ? KVB_ERR_TIMEOUT : KVB_OK, "request %llu: %s",
                     (unsigned long long)id, kvb_status_name(h.status));
        id += h.flags & KVB_FRAME_F_RUN ? h.addr : 1;
    }
    static const uint8_t zero[64];
    cr_assert_eq(memcmp(dst, zero, 64), 0, "a request past its deadline was copied");
    cr_assert_eq(memcmp(dst + 64, mem + 64, 64), 0);
    close(tfd);
    close(ufd);
    engine_serves_with_secret();
}

/* Same-host request runs spoken by hand over a bound link. A run of 300 READs sent in two parts,
 * cut inside an entry, lands byte for byte (by cross-memory attach: this memory is not shared)
 * and is answered in runs that name every id in order. Then a run that ends its connection
 * midway (a set of its copies started, then abandoned) leaves nothing pinned: the region
 * unregisters at once, where a pin left behind would keep it BUSY. */
Test(hostile, shm_request_runs_by_hand)
{
    for (size_t i = 0; i < sizeof mem; i++)
        mem[i] = (uint8_t)(i * 13 + 5);
    int tfd, ufd;
    raw_bound_link(&tfd, &ufd);
    enum { N = 300 };
    static uint8_t dst[N * 64];
    memset(dst, 0, sizeof dst);
    uint8_t *f = malloc(KVB_WIRE_HDR_SIZE + N * KVB_WIRE_SHM_ENTRY);
    size_t len = shm_run(f, 1, N, NULL, (uintptr_t)dst, 64);
    size_t cut = KVB_WIRE_HDR_SIZE + 3 * KVB_WIRE_SHM_ENTRY + 5;
    cr_assert_eq(send(tfd, f, cut, 0), (ssize_t)cut);
    usleep(50000); /* read on its own: the fourth entry is split across two reads */
    cr_assert_eq(send(tfd, f + cut, len - cut, 0), (ssize_t)(len - cut));
    for (uint64_t next = 1; next <= N;) {
        kvb_frame_hdr_t h = recv_shm_answer(tfd);
        cr_assert_eq(h.status, KVB_OK, "request %llu: %s", (unsigned long long)h.id,
                     kvb_strerror(h.status));
        cr_assert_eq(h.id, next, "answers in order");
        next += h.flags & KVB_FRAME_F_RUN ? h.addr : 1;
    }
    cr_assert_eq(memcmp(dst, mem, sizeof dst), 0);

    /* Its 290th entry asks for more than a frame may carry: the engine ends the connection
     * there, with the copies of requests 129-256 started and 257-289 owed. */
    len = shm_run(f, N + 1, N, NULL, (uintptr_t)dst, 64);
    kvb_shm_entry_t bad = {.remote = (uintptr_t)mem, .len = KVB_WIRE_MAX_DATA + 1};
    kvb__wire_shm_entry_encode(&bad, f + KVB_WIRE_HDR_SIZE + 289 * KVB_WIRE_SHM_ENTRY);
    cr_assert_eq(send(tfd, f, len, 0), (ssize_t)len);
    uint8_t types[8];
    int32_t st;
    frames_until_close(tfd, types, sizeof types, &st);
    cr_assert_eq(types[0], 0, "nothing answered: frame type %u", types[0]);
    close(tfd);
    close(ufd);
    free(f);
    int rc = kvb_unregister(eng, mem);
    cr_assert_eq(rc, KVB_OK, "a pin outlived its connection: %s", kvb_strerror(rc));
}

/* The suite's engine again, with a peer timeout of 1 s and `timeout_ms` (0: the default). */
static void engine_with_peer_timeout(uint32_t timeout_ms)
{
    kvb_engine_destroy(eng);
    kvb_config_t c;
    kvb_config_init(&c);
    c.secret = SECRET;
    c.secret_len = strlen(SECRET);
    c.peer_timeout_ms = 1000;
    if (timeout_ms)
        c.timeout_ms = timeout_ms;
    cr_assert_eq(kvb_engine_create(&c, &eng), KVB_OK);
}

/* A peer that authenticates, floods requests and never reads: held off, then dropped after the
 * peer timeout (its queued answers freed), while honest peers keep being served. */
Test(hostile, a_peer_that_never_reads_is_dropped)
{
    engine_with_peer_timeout(0);
    cr_assert_eq(kvb_register(eng, mem, sizeof mem, NULL, KVB_ACCESS_RW), KVB_OK);
    int fd = raw_connect(kvb_engine_port(eng));
    raw_login_as(fd, SECRET, 0, NULL, NULL);
    int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    uint8_t f[KVB_WIRE_HDR_SIZE];
    for (uint64_t id = 1;; id++) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        if (poll(&p, 1, 500) == 0)
            break; /* held off */
        put_hdr(f, KVB_FRAME_READ_REQ, 0, id, (uintptr_t)mem, sizeof mem);
        if (send(fd, f, sizeof f, MSG_DONTWAIT | MSG_NOSIGNAL) <= 0)
            break;
    }
    uint64_t t0 = kvb__now_ns();
    engine_serves_with_secret();
    /* Now its connection goes: reading shows the end of the stream within a few seconds. */
    uint8_t sink[1 << 16];
    ssize_t n;
    while ((n = recv(fd, sink, sizeof sink, 0)) > 0)
        cr_assert_lt(kvb__now_ns() - t0, 8000000000ull, "never dropped");
    cr_assert_leq(n, 0);
    close(fd);
    engine_serves_with_secret();
}

/* A peer that stops in the middle of a WRITE's payload (a stopped process, a frozen host whose
 * kernel still answers keepalives) held the region pinned for as long as it stayed connected:
 * kvb_unregister said BUSY at its deadline, again and again. The target drops it after the peer
 * timeout, as it drops one that never reads. */
Test(hostile, a_peer_stopped_mid_frame_is_dropped)
{
    engine_with_peer_timeout(6000); /* kvb_unregister's deadline: BUSY after it while pinned */
    /* The unregister must come after the engine read the WRITE's header: the engine says nothing
     * until the payload ends, so the test waits, and tries again (waiting longer) if the header
     * came second after all - the WRITE is then refused at once with a WRITE_ACK. Either way the
     * stalled connection must go. */
    bool pinned = false;
    for (int attempt = 1; attempt <= 5 && !pinned; attempt++) {
        cr_assert_eq(kvb_register(eng, mem, sizeof mem, NULL, KVB_ACCESS_RW), KVB_OK);
        int fd = raw_connect(kvb_engine_port(eng));
        raw_login_as(fd, SECRET, 0, NULL, NULL);
        static uint8_t f[KVB_WIRE_HDR_SIZE + sizeof mem / 2]; /* the header, half the payload */
        put_hdr(f, KVB_FRAME_WRITE_REQ, 0, 1, (uintptr_t)mem, sizeof mem);
        memset(f + KVB_WIRE_HDR_SIZE, 0x3c, sizeof f - KVB_WIRE_HDR_SIZE);
        cr_assert_eq(send(fd, f, sizeof f, MSG_NOSIGNAL), (ssize_t)sizeof f);
        usleep(100000 * attempt);
        uint64_t t0 = kvb__now_ns();
        int rc = kvb_unregister(eng, mem);
        double waited = (kvb__now_ns() - t0) / 1e9;
        cr_assert_eq(rc, KVB_OK, "unregister: %s after %.1f s", kvb_strerror(rc), waited);
        uint8_t types[8];
        int32_t st;
        frames_until_close(fd, types, sizeof types, &st); /* fails if the engine keeps it */
        close(fd);
        pinned = !memchr(types, KVB_FRAME_WRITE_ACK, strlen((char *)types));
        if (pinned)
            cr_assert_lt(waited, 4.0, "the region stayed pinned %.1f s", waited);
    }
    cr_assert(pinned, "the engine never read the WRITE's header before the unregister");
    cr_assert_eq(kvb_register(eng, mem, sizeof mem, NULL, KVB_ACCESS_RW), KVB_OK);
    engine_serves_with_secret();
}
