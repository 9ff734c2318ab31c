/* SPDX-License-Identifier: Apache-2.0 */
/* Shared pieces of the ThreadSanitizer stress programs: failure accounting that never aborts (a
 * stress run reports every problem it meets), byte patterns, and a target engine in a child
 * process started by re-executing the program (never a bare fork of a threaded parent). */
#ifndef KVB_TESTS_TSAN_STRESS_H
#define KVB_TESTS_TSAN_STRESS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvbridge/engine.h"

/* ---- failures ---------------------------------------------------------------------------- */

extern atomic_int stress_failures;

void stress_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Counts and prints a failure when `cond` is false; the run goes on (other threads must still be
 * stopped and joined) and the program exits non-zero at its end. */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            stress_fail(__FILE__, __LINE__, __VA_ARGS__);                                          \
    } while (0)

/* CHECK that an API call returned `want`, naming both statuses. */
#define CHECK_RC(expr, want)                                                                       \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ != (want))                                                                         \
            stress_fail(__FILE__, __LINE__, "%s: %s, want %s", #expr, kvb_status_name(rc_),        \
                        kvb_status_name(want));                                                    \
    } while (0)

/* Exit status for main: 0 when nothing failed. Prints a one-line summary. */
int stress_exit_status(const char *what);

/* ---- time, randomness, patterns ------------------------------------------------------------ */

uint64_t stress_now_ms(void);
void stress_sleep_us(uint64_t us);
/* Waits for a batch in one of three ways (mode 0: blocking; 1: short timed waits; 2: polling each
 * request's status every poll_us), so that every waiting path meets the progress threads. */
int stress_wait(kvb_batch_t *b, int mode, uint64_t poll_us);
uint64_t stress_rand(uint64_t *state); /* xorshift; a zero state is seeded first */
uint64_t stress_rand_below(uint64_t *state, uint64_t n);

/* The pattern that byte `pos` of a region seeded `seed` starts with (word-wise, so that filling
 * 16 MiB under ThreadSanitizer stays cheap). */
void stress_pattern_fill(uint8_t *buf, uint64_t pos, size_t len, uint64_t seed);
/* Fills `buf` with fresh random bytes. */
void stress_random_fill(uint8_t *buf, size_t len, uint64_t *state);
/* Offset of the first byte where a and b differ, or -1. */
int64_t stress_first_diff(const uint8_t *a, const uint8_t *b, size_t len);

/* Anonymous zeroed memory of `len` bytes (mmap), or NULL. */
void *stress_map(size_t len);
void stress_unmap(void *p, size_t len);

/* ---- the target process -------------------------------------------------------------------- */

/* The target's registered regions: SHM (kvb_alloc, RW, pattern seed), PLAIN (mmap, RW, pattern
 * seed + 1) and RO (mmap, READ only, pattern seed + 2). With `churn` it also registers and
 * unregisters an extra region and republishes an attribute "churn" in a loop, so region lists
 * that peers fetch change under them. */
#define STRESS_REGION_LEN (16u << 20)
#define STRESS_RO_LEN     (1u << 20)

typedef struct {
    pid_t pid;
    int life_fd; /* closing it asks the target to exit */
    char name[KVB_NAME_MAX + 1];
    uint64_t seed;
    uint64_t shm_addr, plain_addr, ro_addr;
} stress_target_t;

/* Starts `self` (argv[0] of this program, re-executed through /proc/self/exe) as a target
 * engine with `protocol` ("tcp", "auto", "shm") and waits until it serves. Call it from the main
 * thread: the child dies with the thread that forked it. Returns 0 on success. */
int stress_target_start(stress_target_t *t, const char *protocol, uint64_t seed, bool churn);
/* Asks the target to exit and reaps it; returns its exit status (0: it saw no failure), or -1
 * when it had to be killed. */
int stress_target_stop(stress_target_t *t);
/* SIGKILLs the target and reaps it. */
void stress_target_kill(stress_target_t *t);

/* In main, first: if argv names the target role, runs the target and returns its exit status;
 * else returns -1 and the program goes on. The target answers notifications "ping N" with
 * "pong N" (odd N with kvb_notify_reply, even N on a segment it keeps open to the sender) and
 * "count" with "count M" (M: notifications "batch" received so far). */
int stress_target_main(int argc, char **argv);

/* An engine config for these tests: loopback, any port, `protocol`. */
void stress_config(kvb_config_t *cfg, const char *protocol);

#endif
