/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the wire codecs (src/engine/wire.c): the first byte picks a decoder, the
 * rest is what a peer sent (5: same-host request entries). A header that decodes must encode back
 * to the same bytes; whatever else decodes is freed (so a leak or an overrun fails under ASan). */
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "engine/wire.h"

static void header(const uint8_t *in, size_t len)
{
    kvb_frame_hdr_t h;
    char why[128];
    if (len < KVB_WIRE_HDR_SIZE || kvb__wire_decode_hdr(in, &h, why, sizeof why) != KVB_OK)
        return;
    uint8_t out[KVB_WIRE_HDR_SIZE];
    kvb__wire_encode_hdr(&h, out);
    if (memcmp(out, in, KVB_WIRE_HDR_SIZE) != 0)
        __builtin_trap(); /* a header must mean one thing only */
    (void)kvb__wire_payload_len(&h);
}

/* Same-host request entries, one after another: each that decodes encodes back to its bytes. */
static void shm_entries(const uint8_t *in, size_t len)
{
    for (; len >= KVB_WIRE_SHM_ENTRY; in += KVB_WIRE_SHM_ENTRY, len -= KVB_WIRE_SHM_ENTRY) {
        kvb_shm_entry_t e;
        if (kvb__wire_shm_entry_decode(in, &e) != KVB_OK) {
            if (e.len <= KVB_WIRE_MAX_DATA)
                __builtin_trap(); /* refused only over the data limit */
            continue;
        }
        uint8_t out[KVB_WIRE_SHM_ENTRY];
        kvb__wire_shm_entry_encode(&e, out);
        if (memcmp(out, in, KVB_WIRE_SHM_ENTRY) != 0 || e.len > KVB_WIRE_MAX_DATA)
            __builtin_trap();
    }
}

static void hello_ack(const uint8_t *in, size_t len)
{
    kvb_hello_t h;
    kvb_region_desc_t *regions = NULL;
    size_t n = 0;
    if (kvb__wire_hello_ack_decode(in, len, &h, &regions, &n) != KVB_OK)
        return;
    /* What decodes re-encodes and decodes to the same region list. */
    uint8_t *again = NULL;
    size_t again_len = 0;
    kvb_region_desc_t *r2 = NULL;
    size_t n2 = 0;
    kvb_hello_t h2;
    if (kvb__wire_hello_ack_encode(&h, regions, n, &again, &again_len) != KVB_OK ||
        kvb__wire_hello_ack_decode(again, again_len, &h2, &r2, &n2) != KVB_OK || n2 != n)
        __builtin_trap();
    for (size_t i = 0; i < n; i++)
        if (r2[i].info.addr != regions[i].info.addr || r2[i].info.len != regions[i].info.len ||
            r2[i].info.access != regions[i].info.access || r2[i].kind != regions[i].kind ||
            strcmp(r2[i].info.location, regions[i].info.location) != 0 ||
            r2[i].keys_len != regions[i].keys_len ||
            memcmp(r2[i].keys, regions[i].keys, regions[i].keys_len) != 0)
            __builtin_trap();
    free(again);
    free(r2);
    free(regions);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const uint8_t *in = data + 1;
    size_t len = size - 1;
    switch (data[0] % 6) {
    case 0:
        header(in, len);
        break;
    case 1: {
        kvb_hello_t h;
        (void)kvb__wire_hello_decode(in, len, &h);
        break;
    }
    case 2: {
        kvb_hello_t h;
        uint8_t mac[KVB_WIRE_MAC_LEN];
        (void)kvb__wire_challenge_decode(in, len, &h, mac);
        break;
    }
    case 3:
        hello_ack(in, len);
        break;
    case 5:
        shm_entries(in, len);
        break;
    default: {
        kvb_attr_t *attrs = NULL;
        size_t n = 0;
        if (kvb__wire_attrs_decode(in, len, &attrs, &n) == KVB_OK)
            kvb__attrs_free(attrs, n);
        break;
    }
    }
    return 0;
}
