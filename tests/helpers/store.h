/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper: a real metadata store (redis-server, etcd, or `kvbridge metadata-server`) in a child
 * process on free loopback ports, with a private temp dir, that a test can halt and restart to
 * play an outage. */
#ifndef KVB_TESTS_STORE_H
#define KVB_TESTS_STORE_H

#include <stdint.h>
#include <sys/types.h>

typedef enum { TEST_STORE_REDIS = 0, TEST_STORE_ETCD, TEST_STORE_HTTP } test_store_kind_t;

typedef struct {
    test_store_kind_t kind;
    pid_t pid;          /* 0 while stopped */
    uint16_t port;      /* client port, kept across restarts */
    uint16_t peer_port; /* etcd's peer port */
    char dir[256];      /* private temp dir (data, logs), removed by test_store_stop */
    char uri[128];      /* "redis://127.0.0.1:P", "etcd://127.0.0.1:P", "http://127.0.0.1:P" */
} test_store_t;

/* Criterion parameters that run a ParameterizedTest(test_store_kind_t *kind, suite, name) once
 * per store (the including file includes <criterion/parameterized.h>). */
#define TEST_STORE_EACH(suite, name)                                                               \
    ParameterizedTestParameters(suite, name)                                                       \
    {                                                                                              \
        static test_store_kind_t kinds[] = {TEST_STORE_REDIS, TEST_STORE_ETCD, TEST_STORE_HTTP};   \
        return cr_make_param_array(test_store_kind_t, kinds, 3);                                   \
    }

/* "redis", "etcd", "http" (static); "?" for anything else. */
const char *test_store_kind_name(test_store_kind_t k);

/* Makes a temp dir (kvbridge-store-XXXXXX under $TMPDIR or /tmp), starts the store on free
 * 127.0.0.1 ports with its output in dir/server.log, and waits (10 s at most) until it answers a
 * request. If a port was taken before the server could bind it, tries again with new ports (3
 * tries; env KVB_TEST_STORE_FIRST_PORT, a fault hook, names the first try's port). Redis runs
 * without persistence (a restart loses the data); etcd keeps its data dir across restarts; "http"
 * runs `$KVB_BIN metadata-server`. Returns 0 with *s filled in, or -1 with the reason and the end
 * of the server's log on stderr, nothing left running and *s stopped. A store still running at
 * exit() (a failed assertion skipped test_store_stop) is killed and its dir removed then; the
 * server also gets SIGKILL when the calling thread dies, so that a crashed or timed-out test
 * leaves no process behind (its dir stays). Call test_store_stop from the same thread. */
int test_store_start(test_store_t *s, test_store_kind_t kind);

/* SIGKILLs the server and reaps it (an outage); port and dir are kept for test_store_restart.
 * Returns 0, or -1 if it was not running. */
int test_store_halt(test_store_t *s);

/* Starts the server again on the same ports and dir and waits until it is ready (10 s); a port
 * that is still busy is retried on the same number until then. Returns 0, or -1 (stderr says
 * why; nothing left running, dir kept for test_store_stop) - also if it is running already or
 * was never started. */
int test_store_restart(test_store_t *s);

/* SIGTERM (SIGKILL after 3 s), reap, and remove the dir with everything in it. Idempotent, and
 * safe on a zeroed struct or after a failed start. */
void test_store_stop(test_store_t *s);

/* A currently free 127.0.0.1 TCP port (binds port 0, reads it, closes), or 0 on error. Another
 * process may take it before the caller binds it. */
uint16_t test_free_port(void);

/* A listening socket on a free 127.0.0.1 port that nobody accepts from: the kernel completes
 * connections to it, and nothing ever answers (a hung host). Returns its fd (close it when done)
 * with the port in *port, or -1. */
int test_silent_listener(uint16_t *port);

#endif
