/* SPDX-License-Identifier: Apache-2.0 */
/* CPU lists ("0-3,8,10-11", as Linux writes them) and the engine's named, optionally pinned,
 * threads: where an engine's data threads run when its configuration gives them CPUs (engine.h,
 * `cpus`), how the bench's copy ceiling runs its threads on the same ones, and how an unbound
 * thread steps off a CPU it would share with one it works beside. */
#ifndef KVB_COMMON_CPUS_H
#define KVB_COMMON_CPUS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* CPU numbers go up to CPU_SETSIZE - 1 (glibc's cpu_set_t), and a list names at most as many. */
#define KVB_CPUS_MAX 1024

typedef struct {
    int n;                      /* 0: no list, threads run wherever the scheduler puts them */
    uint16_t cpu[KVB_CPUS_MAX]; /* in the order given, each range ascending */
} kvb_cpus_t;

/* Parses `s` into *out: comma-separated CPU numbers and ranges "a-b" (a <= b), decimal, no blanks,
 * each CPU one this process may run on now (sched_getaffinity). On error returns -1 with a
 * sentence in err (never longer than errlen) and leaves *out untouched; else 0. */
int kvb__cpus_parse(const char *s, kvb_cpus_t *out, char *err, size_t errlen);

/* Writes `c` as a list into buf ("0-3,8": runs of consecutive CPUs as ranges, in the order
 * given), "" for an empty one. Returns the length it needed (a longer one than bufsz was cut). */
size_t kvb__cpus_format(const kvb_cpus_t *c, char *buf, size_t bufsz);

/* The CPUs this process may run on (its affinity: a container's cpuset, `taskset`), else the
 * CPUs online; at least 1. */
int kvb__cpus_usable(void);

/* Threads for one side of `conns` TCP streams: half the usable CPUs, at most one per stream, at
 * least one. Where the two sides of a stream share two cores, a second thread per side contends
 * for them: 15-20% less streamed (the ceiling's raw streams, 2026-11) and 13% less through the
 * lanes (1 MiB READs at batch 32, 3 pairs); with 16 CPUs a thread per lane moved 3-17% more
 * through kvbridge's lanes (6 pairs, 64 KiB and 1 MiB READs). Both the engine's default
 * progress_threads and the bench's TCP ceiling take it. */
int kvb__threads_per_side(int conns);

/* pthread_create, the thread named `name`, or `name`-`index` when index >= 0 (what `top -H`,
 * `ps -L` and `perf` show; cut at 15 characters, the most a thread name holds) and, when `cpus`
 * holds a list and ordinal >= 0, bound to cpus->cpu[ordinal % n] from its first instruction.
 * Returns 0 or pthread_create's error (ENOMEM if the start could not be allocated). */
int kvb__thread_create(pthread_t *t, const kvb_cpus_t *cpus, int ordinal, const char *name,
                       int index, void *(*fn)(void *), void *arg);

/* Moves the calling thread off CPU `cpu`, where it runs now, to another CPU it may run on, and
 * then lets it run on every CPU it could before (the scheduler may bring it back later). For a
 * thread that would otherwise take turns on one CPU with a thread it works beside: waking
 * threads are placed on the CPU they last ran on while the last-level cache's CPUs look busy
 * (Linux skips the search for an idle one), so two copying threads that once met on a CPU can
 * stay there with another CPU idle. Returns true if the thread now runs elsewhere; false if it
 * may run on `cpu` alone (bound by a CPU list, a cpuset of one), is not on `cpu`, or the
 * affinity calls failed. Two system calls and a migration: call it rarely. */
bool kvb__thread_move_off(int cpu);

#endif
