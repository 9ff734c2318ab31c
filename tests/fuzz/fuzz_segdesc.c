/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for segment descriptors (kvb__segdesc_parse, src/meta/segment.c): the JSON a
 * metadata store returns for a segment name - anything anyone who can write to the store wrote. */
#include <string.h>

#include "fuzz.h"
#include "engine/export.h"
#include "kvbridge/engine.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvb_segdesc_t d;
    if (kvb__segdesc_parse((const char *)data, size, "seg", &d) != KVB_OK)
        return 0;
    if (d.naddr == 0 || d.naddr > KVB_SEGDESC_ADDRS)
        __builtin_trap();
    for (size_t i = 0; i < d.naddr; i++)
        if (d.addr[i].port == 0 || strnlen(d.addr[i].host, sizeof d.addr[i].host) == 0 ||
            strnlen(d.addr[i].host, sizeof d.addr[i].host) > KVB_NAME_MAX)
            __builtin_trap();
    return 0;
}
