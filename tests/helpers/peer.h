/* SPDX-License-Identifier: Apache-2.0 */
/* Test helpers: a real peer engine in a child process, and the seeded byte pattern the tests use
 * to check every byte that moves. */
#ifndef KVB_TESTS_PEER_H
#define KVB_TESTS_PEER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvbridge/engine.h"

#define TEST_PEER_RW_LEN (32u << 20) /* read-write region, filled with pattern(seed) */
#define TEST_PEER_RO_LEN (1u << 20)  /* read-only region, filled with pattern(seed + 1) */

typedef struct {
    pid_t pid;
    int life_fd; /* closing it tells the child to exit */
    char name[KVB_NAME_MAX + 1];
    uint16_t port;
    uint64_t rw_addr, ro_addr;
} test_peer_t;

/* What a peer runs with beyond its port and seed; NULL fields take the engine's defaults. */
typedef struct {
    const char *protocol; /* as for test_peer_start; NULL: "auto" */
    const char *metadata; /* metadata URI; NULL: p2p */
    const char *name;     /* segment name; NULL: host:port */
    const char *cluster;
    uint32_t ttl_ms; /* metadata TTL; 0: default */
    /* Not 0: the peer runs in a time namespace of its own whose CLOCK_MONOTONIC is this many
     * seconds off ours (needs CAP_SYS_ADMIN; see test_time_namespaces) */
    int64_t monotonic_offset_s;
} test_peer_opts_t;

/* Forks a peer engine listening on 127.0.0.1:port (0: any) with the given protocol ("tcp",
 * "shm", "auto"; "shm-nobody": shm, and the child drops to uid 65534 first, so that the kernel
 * refuses it cross-memory attach to us) and waits until it serves. It answers
 * notifications "verify SEED OFF LEN" (checks its RW region at OFF against pattern SEED) with
 * "ok" or "bad <offset>", and "ping" with "pong". Returns 0 on success. */
int test_peer_start(test_peer_t *p, uint16_t port, uint64_t seed, const char *protocol);
int test_peer_start_opts(test_peer_t *p, uint16_t port, uint64_t seed, const test_peer_opts_t *o);
/* Asks the child to exit and reaps it (SIGKILL after 3 s). */
void test_peer_stop(test_peer_t *p);
/* Sends `sig`; with SIGKILL also reaps the child. */
void test_peer_signal(test_peer_t *p, int sig);
/* Sends `sig` to child `pid` and, for SIGSTOP and SIGCONT, waits until it has stopped or
 * continued: kill() returns before the child has, and a child not yet stopped may still serve a
 * request or obey a signal sent next. 0, or -1 if the child did not report it. */
int test_child_signal(pid_t pid, int sig);
uint16_t test_peer_port(const test_peer_t *p);
/* Whether this process may make time namespaces (monotonic_offset_s). */
bool test_time_namespaces(void);

/* Byte i of a buffer that holds the pattern starting at offset `off` of an infinite stream. */
void test_pattern_fill(uint8_t *buf, uint64_t off, uint64_t len, uint64_t seed);
/* Offset of the first byte of buf[0..len) that differs from the stream at `off`, or -1. */
int64_t test_pattern_check(const uint8_t *buf, uint64_t off, uint64_t len, uint64_t seed);

/* Deterministic xorshift generator for test inputs. */
uint64_t test_rand(uint64_t *state);

#endif
