/* SPDX-License-Identifier: Apache-2.0 */
/* What this library has built in: the control plane (today the TCP connections, which also carry
 * the two-sided paths' requests) and the data-path providers, by id. The engine core names none
 * of them; it looks them up here. */
#include <string.h>

#include "engine/internal.h"

extern const kvb_transport_ops_t kvb__tcp_ops;
extern const kvb_provider_ops_t kvb__tcp_provider, kvb__shm_provider, kvb__cuda_provider,
    kvb__fabric_provider;

static const kvb_transport_ops_t *const transports[] = {&kvb__tcp_ops};

static const kvb_provider_ops_t *const providers[KVB_PATHS] = {
    [KVB_PATH_TCP] = &kvb__tcp_provider,
    [KVB_PATH_SHM] = &kvb__shm_provider,
    [KVB_PATH_CUDA] = &kvb__cuda_provider,
    [KVB_PATH_FABRIC] = &kvb__fabric_provider,
};

const kvb_transport_ops_t *kvb__transport_find(const char *name)
{
    for (size_t i = 0; i < sizeof transports / sizeof transports[0]; i++)
        if (!name || !strcmp(transports[i]->name, name))
            return transports[i];
    return NULL;
}

const kvb_provider_ops_t *kvb__provider(unsigned id)
{
    return id < KVB_PATHS ? providers[id] : NULL;
}

int kvb__provider_id(const char *name)
{
    for (unsigned id = 0; id < KVB_PATHS; id++)
        if (providers[id] && !strcmp(providers[id]->name, name))
            return (int)id;
    return -1;
}
