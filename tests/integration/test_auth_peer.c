/* SPDX-License-Identifier: Apache-2.0 */
/* Peer authentication end to end, with the peer in a real process: a wrong or missing cluster
 * secret is refused with KVB_ERR_AUTH before anything is learnt, while peers that know it move
 * verified data; received notifications carry the sender's proven segment name. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "helpers/peer.h"
#include "kvbridge/engine.h"

#define SEED   77
#define SECRET "correct horse battery staple, 2026"

static test_peer_t peer;
static char secret_path[64];

/* The peer reads its secret the way a deployment does: KVB_SECRET_FILE, inherited. */
static void start_peer_with_secret(void)
{
    snprintf(secret_path, sizeof secret_path, "/tmp/kvb-auth-%d", (int)getpid());
    FILE *f = fopen(secret_path, "w");
    cr_assert_not_null(f);
    fprintf(f, "%s\n", SECRET);
    fclose(f);
    chmod(secret_path, 0600);
    setenv("KVB_SECRET_FILE", secret_path, 1);
    cr_assert_eq(test_peer_start(&peer, 0, SEED, "tcp"), 0, "peer did not start");
    unsetenv("KVB_SECRET_FILE");
}

static void stop_peer(void)
{
    test_peer_stop(&peer);
    unlink(secret_path);
}

TestSuite(auth_peer, .init = start_peer_with_secret, .fini = stop_peer, .timeout = 60);

static int open_with(const char *secret, kvb_engine_t **e, kvb_segment_t *seg)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.protocol = "tcp";
    c.connect_timeout_ms = 2000;
    c.secret = secret;
    c.secret_len = secret ? strlen(secret) : 0;
    cr_assert_eq(kvb_engine_create(&c, e), KVB_OK);
    return kvb_segment_open(*e, peer.name, seg);
}

Test(auth_peer, wrong_or_missing_secret_is_refused)
{
    kvb_engine_t *e;
    kvb_segment_t seg;
    cr_assert_eq(open_with("an entirely different secret", &e, &seg), KVB_ERR_AUTH);
    kvb_engine_destroy(e);
    cr_assert_eq(open_with(NULL, &e, &seg), KVB_ERR_AUTH, "no secret at all");
    kvb_engine_destroy(e);
    /* A secret that differs in its last byte only. */
    char near[sizeof SECRET];
    strcpy(near, SECRET);
    near[sizeof SECRET - 2] ^= 1;
    cr_assert_eq(open_with(near, &e, &seg), KVB_ERR_AUTH);
    kvb_engine_destroy(e);
}

Test(auth_peer, the_right_secret_moves_verified_data)
{
    kvb_engine_t *e;
    kvb_segment_t seg;
    cr_assert_eq(open_with(SECRET, &e, &seg), KVB_OK);
    size_t len = 4u << 20;
    uint8_t *buf = malloc(len);
    cr_assert_eq(kvb_register(e, buf, len, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_request_t r = {KVB_OP_READ, buf, seg, peer.rw_addr + 4096, len};
    kvb_batch_t *b;
    cr_assert_eq(kvb_batch_submit(e, &r, 1, NULL, &b), KVB_OK);
    cr_assert_eq(kvb_batch_wait(b, 10000), KVB_OK);
    kvb_batch_free(b);
    cr_assert_eq(test_pattern_check(buf, 4096, len, SEED), -1);
    /* The peer answers "ping" by opening our segment - which it can, knowing the secret - and
     * the reply carries the name it proved. */
    cr_assert_eq(kvb_notify_send(e, seg, "ping", 4, 5000), KVB_OK);
    kvb_notification_t *n = malloc(sizeof *n);
    cr_assert_eq(kvb_notify_recv(e, n, 5000), KVB_OK);
    cr_assert_eq(n->len, 4);
    cr_assert_eq(memcmp(n->data, "pong", 4), 0);
    cr_assert_str_eq(n->from, peer.name);
    free(n);
    cr_assert_eq(kvb_unregister(e, buf), KVB_OK);
    free(buf);
    kvb_engine_destroy(e);
}

Test(auth_peer, non_loopback_bind_needs_a_secret)
{
    kvb_config_t c;
    kvb_config_init(&c);
    c.bind_addr = "0.0.0.0";
    kvb_engine_t *e = NULL;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG);
    cr_assert_null(e);
    c.secret = "too short";
    c.secret_len = 9;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_ERR_INVALID_ARG, "a 9-byte secret");
    c.secret = SECRET;
    c.secret_len = strlen(SECRET);
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK);
    kvb_engine_destroy(e);
    c.secret = NULL;
    c.insecure = 1;
    cr_assert_eq(kvb_engine_create(&c, &e), KVB_OK, "insecure, explicitly");
    kvb_engine_destroy(e);
}
