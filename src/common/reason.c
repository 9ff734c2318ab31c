/* SPDX-License-Identifier: Apache-2.0 */
/* Reason strings shared by the KV layer and the PD runtime. */
#include "common/reason.h"

#include <stdarg.h>
#include <stdio.h>

int kvb__fail(char *reason, size_t cap, int status, const char *fmt, ...)
{
    if (reason && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(reason, cap, fmt, ap);
        va_end(ap);
    }
    return status;
}

void kvb__reason_clear(char *reason, size_t cap)
{
    if (reason && cap)
        reason[0] = '\0';
}
