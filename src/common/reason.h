/* SPDX-License-Identifier: Apache-2.0 */
/* Reason strings: the caller-supplied buffers in which kvbridge explains a refusal. */
#ifndef KVB_COMMON_REASON_H
#define KVB_COMMON_REASON_H

#include <stddef.h>

/* Writes a formatted reason (when reason and cap allow; truncated to cap) and returns `status`,
 * so that a check reads `return kvb__fail(r, cap, KVB_ERR_INVALID_ARG, "...", ...)`. */
int kvb__fail(char *reason, size_t cap, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Empties the reason buffer (success). */
void kvb__reason_clear(char *reason, size_t cap);

#endif
