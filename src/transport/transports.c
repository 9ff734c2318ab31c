/* SPDX-License-Identifier: Apache-2.0 */
/* The transports built into this library, by name. The engine core names none of them: it looks
 * its control plane up here (today "tcp", which also carries the same-host path's requests). */
#include <string.h>

#include "engine/internal.h"

extern const kvb_transport_ops_t kvb__tcp_ops;

static const kvb_transport_ops_t *const transports[] = {&kvb__tcp_ops};

const kvb_transport_ops_t *kvb__transport_find(const char *name)
{
    for (size_t i = 0; i < sizeof transports / sizeof transports[0]; i++)
        if (!name || !strcmp(transports[i]->name, name))
            return transports[i];
    return NULL;
}
