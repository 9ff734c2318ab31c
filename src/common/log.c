/* SPDX-License-Identifier: Apache-2.0 */
/* Leveled logging: one line per message, written with a single write(2) so that lines from
 * several threads or processes never interleave. */
#include "common/log.h"
#include "kvbridge/engine.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* -1: not read from the environment yet. */
static atomic_int log_level = -1;

int kvb__log_level(void)
{
    int lvl = atomic_load_explicit(&log_level, memory_order_relaxed);
    if (lvl >= 0)
        return lvl;
    const char *env = getenv("KVB_LOG_LEVEL");
    lvl = env && *env >= '0' && *env <= '3' ? *env - '0' : KVB_LOG_WARN;
    atomic_store(&log_level, lvl);
    return lvl;
}

void kvb_log_set_level(int level)
{
    if (level < 0)
        level = 0;
    if (level > KVB_LOG_DEBUG)
        level = KVB_LOG_DEBUG;
    atomic_store(&log_level, level);
}

void kvb__log(int level, const char *file, int line, const char *fmt, ...)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    char buf[1024];
    const char *base = strrchr(file, '/');
    int n = snprintf(buf, sizeof buf, "kvbridge[%d] %s: ", (int)getpid(), names[level & 3]);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 40)
        n = (int)sizeof buf - 40;
    n += snprintf(buf + n, sizeof buf - (size_t)n, " (%s:%d)\n", base ? base + 1 : file, line);
    if (n > (int)sizeof buf)
        n = (int)sizeof buf;
    ssize_t rc = write(STDERR_FILENO, buf, (size_t)n);
    (void)rc; /* nowhere left to report a failing stderr */
}
