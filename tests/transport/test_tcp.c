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
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
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

/* ---- a broken target --------------------------------------------------------------------------
 */

typedef struct {
    int listen_fd;
    int mode; /* 0: silent, 1: garbage after hello, 2: good hello then a wrong READ_RESP id */
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
    } else if (f->mode == 2) {
        kvb_hello_t me = {.incarnation = 9};
        strcpy(me.name, "fake:1");
        kvb_region_info_t r = {.addr = 0x1000, .len = 0x1000, .access = KVB_ACCESS_RW};
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
        if (recv(fd, in, KVB_WIRE_HDR_SIZE, MSG_WAITALL) == KVB_WIRE_HDR_SIZE) {
            put_hdr(hdr, KVB_FRAME_READ_RESP, 0, 999, 0, 0); /* answers a request never made */
            send(fd, hdr, sizeof hdr, MSG_NOSIGNAL);
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
        static uint8_t local[64];
        kvb_register(e, local, sizeof local, NULL, KVB_ACCESS_RW);
        kvb_request_t r = {KVB_OP_READ, local, *s, 0x1000, 64};
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
