/* SPDX-License-Identifier: Apache-2.0 */
/* What the engine exports to the layers above it (meta/, kv/) beyond the public API: small
 * questions answered under the engine's own locks, so that those layers never reach into its
 * structures (engine/internal.h is for the engine and its transports only). */
#ifndef KVB_ENGINE_EXPORT_H
#define KVB_ENGINE_EXPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvbridge/engine.h"

/* True if [addr, addr+len) lies inside one region registered with this engine. */
bool kvb__engine_registered(kvb_engine_t *e, uint64_t addr, uint64_t len);

/* The segment name the peer behind `seg` proved in its handshake (may differ from the name it
 * was opened by, e.g. a metadata alias). KVB_ERR_BAD_SEGMENT for an unknown handle. */
int kvb__segment_proven_name(kvb_engine_t *e, kvb_segment_t seg, char *buf, size_t cap);

/* KVB_OK while the peer behind `seg` is usable, else the error that ended it
 * (KVB_ERR_BAD_SEGMENT for an unknown handle). */
int kvb__segment_state(kvb_engine_t *e, kvb_segment_t seg);

#endif
