/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for KV layout descriptors (kvb_kv_layout_decode, src/kv/desc.c): JSON a peer
 * publishes with its segment. A descriptor that decodes must validate, encode, and decode again. */
#include <stdlib.h>

#include "fuzz.h"
#include "kvbridge/kv.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvb_kv_layout_t *l = NULL, *again = NULL;
    char why[KVB_KV_REASON_MAX];
    if (kvb_kv_layout_decode((const char *)data, size, &l, why, sizeof why) != KVB_OK)
        return 0;
    static char buf[1 << 20];
    size_t len = 0;
    if (kvb_kv_layout_validate(l, why, sizeof why) != KVB_OK ||
        kvb_kv_layout_encode(l, buf, sizeof buf, &len) != KVB_OK ||
        kvb_kv_layout_decode(buf, len, &again, why, sizeof why) != KVB_OK)
        __builtin_trap(); /* what we accept we can say back */
    kvb_kv_layout_free(again);
    kvb_kv_layout_free(l);
    return 0;
}
