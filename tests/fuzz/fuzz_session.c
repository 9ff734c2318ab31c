/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for a target engine's connection state machine (src/transport/tcp.c): the
 * handshake, and every frame an authenticated peer may send. One engine serves a registered
 * buffer at a fixed address (so seeds can name it); each input is one connection. The first
 * byte's low bit picks the mode: 0 sends the input raw from the first byte on (a stranger:
 * HELLO, CHALLENGE and AUTH order, frames before the proof); 1 first runs the handshake with the
 * cluster secret, then sends the input (an authenticated peer: requests, ranges, notifications,
 * same-host flags, answer runs a target must refuse). The connection is then half-closed and
 * drained until the engine closes it: anything it does with the input happens inside this call.
 */
#include <arpa/inet.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "fuzz.h"
#include "engine/internal.h"
#include "engine/wire.h"

#define BUF_ADDR 0x7e0000000000ull /* the registered buffer; seeds address it */
#define BUF_LEN  (1u << 20)

static const char SECRET[] = "fuzzing-secret-0123456789abcdef";
static kvb_engine_t *g_eng;
static uint16_t g_port;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvb_log_set_level(0);
    void *buf = mmap((void *)(uintptr_t)BUF_ADDR, BUF_LEN, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    kvb_config_t cfg;
    kvb_config_init(&cfg);
    cfg.secret = SECRET;
    cfg.secret_len = sizeof SECRET - 1;
    cfg.peer_timeout_ms = 2000;
    cfg.connect_timeout_ms = 2000;
    if (buf != (void *)(uintptr_t)BUF_ADDR || kvb_engine_create(&cfg, &g_eng) != KVB_OK ||
        kvb_register(g_eng, buf, BUF_LEN, "cpu:0", KVB_ACCESS_RW) != KVB_OK)
        abort();
    g_port = kvb_engine_port(g_eng);
    return 0;
}

static int dial(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(g_port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    static uint32_t next;
    for (int tries = 0; tries < 50; tries++) {
        /* Each connection from its own loopback address (127.0.0.0/8 is all ours): we close
         * first, so each leaves a TIME_WAIT behind, and a thousand a second from one address
         * would use up its ephemeral ports within a minute. */
        uint32_t n = next++ % (250u * 256u * 256u);
        struct sockaddr_in me = {.sin_family = AF_INET,
                                 .sin_addr.s_addr = htonl(0x7f000000u | (n + 2))};
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && bind(fd, (struct sockaddr *)&me, sizeof me) == 0 &&
            connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
            return fd;
        if (fd >= 0)
            close(fd);
        usleep(20000);
    }
    abort(); /* the engine stopped accepting for a second: that is a finding too */
}

static bool recv_all(int fd, void *p, size_t n)
{
    return recv(fd, p, n, MSG_WAITALL) == (ssize_t)n;
}

/* The initiator's side of the handshake; false if the engine does not play along. */
static bool login(int fd)
{
    kvb_hello_t me = {.incarnation = 7, .pid = (uint32_t)getpid()}, their;
    kvb__host_id(me.host_id);
    strcpy(me.name, "fuzz:1");
    memset(me.nonce, 0x42, sizeof me.nonce);
    uint8_t out[KVB_WIRE_HDR_SIZE + KVB_WIRE_MAX_HELLO + KVB_WIRE_MAC_LEN];
    size_t n = kvb__wire_hello_encode(&me, out + KVB_WIRE_HDR_SIZE);
    kvb__wire_encode_hdr(&(kvb_frame_hdr_t){.type = KVB_FRAME_HELLO, .len = n}, out);
    if (send(fd, out, KVB_WIRE_HDR_SIZE + n, MSG_NOSIGNAL) != (ssize_t)(KVB_WIRE_HDR_SIZE + n))
        return false;
    kvb_frame_hdr_t h;
    uint8_t mac[KVB_WIRE_MAC_LEN];
    if (!recv_all(fd, out, KVB_WIRE_HDR_SIZE) || kvb__wire_decode_hdr(out, &h, NULL, 0) ||
        h.type != KVB_FRAME_CHALLENGE || h.len > sizeof out || !recv_all(fd, out, h.len) ||
        kvb__wire_challenge_decode(out, h.len, &their, mac))
        return false;
    kvb__wire_encode_hdr(&(kvb_frame_hdr_t){.type = KVB_FRAME_AUTH, .len = KVB_WIRE_MAC_LEN}, out);
    kvb__wire_auth_mac((const uint8_t *)SECRET, sizeof SECRET - 1, KVB_AUTH_INITIATOR, &me, &their,
                       out + KVB_WIRE_HDR_SIZE);
    return send(fd, out, KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN, MSG_NOSIGNAL) ==
           KVB_WIRE_HDR_SIZE + KVB_WIRE_MAC_LEN;
}

/* Reads and drops what the engine sends until it closes the connection (deadline: 3 s). */
static void drain(int fd)
{
    static uint8_t sink[1 << 16];
    uint64_t deadline = kvb__deadline_ms(3000);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = kvb__ms_left(deadline);
        if (ms == 0 || poll(&p, 1, ms) <= 0 || recv(fd, sink, sizeof sink, 0) <= 0)
            return;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int fd = dial();
    bool authed = data[0] & 1;
    const uint8_t *in = authed ? data + 1 : data;
    size_t len = authed ? size - 1 : size;
    if (!authed || login(fd)) {
        for (size_t off = 0; off < len;) { /* the engine may close mid-way: that ends it */
            ssize_t n = send(fd, in + off, len - off, MSG_NOSIGNAL);
            if (n <= 0)
                break;
            off += (size_t)n;
        }
    }
    shutdown(fd, SHUT_WR);
    drain(fd);
    close(fd);
    kvb_notification_t *n = malloc(sizeof *n);
    while (n && kvb_notify_recv(g_eng, n, 0) == KVB_OK) /* what the input delivered */
        ;
    free(n);
    return 0;
}
