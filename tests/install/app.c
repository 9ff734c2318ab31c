/* SPDX-License-Identifier: Apache-2.0 */
/* A complete program in the shape of the README's engine example, built by check_install.sh
 * against an installed kvbridge with pkg-config: two engines in one process stand for the two
 * hosts, one READ and one WRITE with a notification, every byte checked. Exits 0 on success. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvbridge/engine.h>
#include <kvbridge/kv.h>

#define BLOCK (64 << 10)

static int fail(const char *what, int rc)
{
    fprintf(stderr, "app: %s: %s (%s)\n", what, kvb_strerror(rc), kvb_status_name(rc));
    return 1;
}

static kvb_engine_t *engine(void)
{
    kvb_config_t cfg;
    kvb_config_init(&cfg); /* 127.0.0.1, any free port */
    kvb_engine_t *e = NULL;
    int rc = kvb_engine_create(&cfg, &e);
    if (rc != KVB_OK)
        fail("kvb_engine_create", rc);
    return e;
}

int main(void)
{
    kvb_engine_t *e = engine(), *remote = engine();
    if (!e || !remote)
        return 1;
    static uint8_t kv_pool[2 * BLOCK], remote_pool[2 * BLOCK];
    for (size_t i = 0; i < sizeof kv_pool; i++) {
        kv_pool[i] = (uint8_t)(i * 7);
        remote_pool[i] = (uint8_t)(i * 13 + 1);
    }
    uint64_t remote_base = (uintptr_t)remote_pool;
    int rc = kvb_register(e, kv_pool, sizeof kv_pool, "cpu:0", KVB_ACCESS_RW);
    if (rc == KVB_OK)
        rc = kvb_register(remote, remote_pool, sizeof remote_pool, "cpu:0", KVB_ACCESS_RW);
    if (rc != KVB_OK)
        return fail("kvb_register", rc);

    kvb_segment_t peer;
    rc = kvb_segment_open(e, kvb_engine_segment_name(remote), &peer);
    if (rc != KVB_OK)
        return fail("kvb_segment_open", rc);

    /* READ the peer's first block into ours, WRITE our second block over the peer's. */
    uint8_t want_read[BLOCK], want_written[BLOCK];
    memcpy(want_read, remote_pool, BLOCK);
    memcpy(want_written, kv_pool + BLOCK, BLOCK);
    kvb_request_t reqs[] = {
        {KVB_OP_READ, kv_pool + 0, peer, remote_base + 0, BLOCK},
        {KVB_OP_WRITE, kv_pool + BLOCK, peer, remote_base + BLOCK, BLOCK},
    };
    kvb_batch_opts_t opts = {
        .timeout_ms = 5000, .notify_segment = peer, .notify = "req-42 done", .notify_len = 11};
    kvb_batch_t *b;
    rc = kvb_batch_submit(e, reqs, 2, &opts, &b);
    if (rc != KVB_OK)
        return fail("kvb_batch_submit", rc);
    rc = kvb_batch_wait(b, -1);
    kvb_batch_free(b);
    if (rc != KVB_OK)
        return fail("kvb_batch_wait", rc);
    if (memcmp(kv_pool, want_read, BLOCK) != 0 ||
        memcmp(remote_pool + BLOCK, want_written, BLOCK) != 0) {
        fprintf(stderr, "app: transferred bytes differ\n");
        return 1;
    }

    /* On the peer: the notification arrives after the batch's data. */
    kvb_notification_t *n = malloc(sizeof *n);
    rc = n ? kvb_notify_recv(remote, n, 5000) : KVB_ERR_NOMEM;
    if (rc != KVB_OK)
        return fail("kvb_notify_recv", rc);
    if (n->len != 11 || memcmp(n->data, "req-42 done", 11) != 0 ||
        strcmp(n->from, kvb_engine_segment_name(e)) != 0) {
        fprintf(stderr, "app: wrong notification from %s\n", n->from);
        return 1;
    }
    free(n);

    kvb_segment_close(e, peer);
    kvb_engine_destroy(remote);
    kvb_engine_destroy(e);
    printf("app: kvbridge %s: READ and WRITE of %d bytes each, notification received (%s)\n",
           KVB_VERSION_STRING, BLOCK, kvb_kv_slot_name(KVB_KV_SLOT_K));
    return 0;
}
