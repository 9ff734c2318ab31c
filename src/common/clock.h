/* SPDX-License-Identifier: Apache-2.0 */
/* Monotonic clock and deadline helpers: every wait in kvbridge is bounded by one of these. */
#ifndef KVB_COMMON_CLOCK_H
#define KVB_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kvb__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Deadline `ms` milliseconds from now; UINT64_MAX for "never". */
static inline uint64_t kvb__deadline_ms(int64_t ms)
{
    return ms < 0 ? UINT64_MAX : kvb__now_ns() + (uint64_t)ms * 1000000ull;
}

/* Milliseconds left until `deadline` rounded up, clamped to [0, INT32_MAX]; -1 for "never". */
static inline int kvb__ms_left(uint64_t deadline)
{
    if (deadline == UINT64_MAX)
        return -1;
    uint64_t now = kvb__now_ns();
    if (now >= deadline)
        return 0;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* One step of a polling loop: tells the core that this thread spins (it gives a sibling
 * hyperthread the core meanwhile and leaves the loop without a memory-order flush). */
static inline void kvb__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* Absolute CLOCK_MONOTONIC timespec for pthread_cond_timedwait. */
static inline struct timespec kvb__timespec_of(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull),
                          .tv_nsec = (long)(ns % 1000000000ull)};
    return ts;
}

#endif
