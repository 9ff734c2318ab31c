/* SPDX-License-Identifier: Apache-2.0 */
/* `kvbridge bench` as users run it: loopback READ and WRITE with --verify and --json, and
 * rejection of bad options. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "helpers/store.h"

TestSuite(bench, .timeout = 120);

/* Runs the command, returns its exit status and its last stdout line in `last`. */
static int run(const char *args, char *last, size_t cap)
{
    const char *bin = getenv("KVB_BIN");
    cr_assert_not_null(bin, "KVB_BIN is not set (run through ctest)");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s 2>/dev/null", bin, args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    char line[4096];
    last[0] = '\0';
    while (fgets(line, sizeof line, p))
        snprintf(last, cap, "%s", line);
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void check_json(const char *op, const char *protocol)
{
    char args[256], last[4096];
    snprintf(args, sizeof args,
             "bench --loopback --verify --json --operation %s --protocol %s --duration 1 "
             "--buffer-size 32M --block-size 256K --batch-size 16 --threads 2",
             op, protocol);
    cr_assert_eq(run(args, last, sizeof last), 0, "bench %s failed: %s", op, last);
    json_error_t err;
    json_t *j = json_loads(last, 0, &err);
    cr_assert_not_null(j, "last line is not JSON: %s", last);
    cr_assert_str_eq(json_string_value(json_object_get(j, "operation")), op);
    cr_assert_str_eq(json_string_value(json_object_get(j, "protocol")), protocol);
    cr_assert_eq(json_integer_value(json_object_get(j, "block_size")), 256 << 10);
    cr_assert_eq(json_integer_value(json_object_get(j, "batch_size")), 16);
    cr_assert_eq(json_integer_value(json_object_get(j, "threads")), 2);
    cr_assert_eq(json_integer_value(json_object_get(j, "errors")), 0);
    cr_assert(json_is_true(json_object_get(j, "verified")));
    cr_assert_gt(json_integer_value(json_object_get(j, "bytes")), 0);
    const char *keys[] = {"duration_s", "gbps", "ops_per_s", "lat_p50_us", "lat_p99_us"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        cr_assert(json_is_number(json_object_get(j, keys[i])), "%s missing", keys[i]);
    json_decref(j);
}

Test(bench, loopback_read_verified)
{
    check_json("read", "tcp");
}

Test(bench, loopback_write_verified)
{
    check_json("write", "tcp");
}

Test(bench, loopback_shm_read_verified)
{
    check_json("read", "shm");
}

Test(bench, loopback_shm_write_verified)
{
    check_json("write", "shm");
}

Test(bench, baseline_prints_json)
{
    char last[4096];
    cr_assert_eq(
        run("bench --baseline tcp --duration 1 --buffer-size 8M --json", last, sizeof last), 0);
    json_t *j = json_loads(last, 0, NULL);
    cr_assert_not_null(j, "%s", last);
    cr_assert_gt(json_real_value(json_object_get(j, "gbps")), 0);
    json_decref(j);
}

Test(bench, bad_options_are_refused)
{
    char last[4096];
    const char *bad[] = {"bench",
                         "bench --mode sideways",
                         "bench --mode initiator",
                         "bench --loopback --block-size 0",
                         "bench --loopback --block-size 12Q",
                         "bench --loopback --batch-size -3",
                         "bench --loopback --protocol rdma",
                         "bench --loopback --protocol",
                         "bench --loopback --operation copy",
                         "bench --loopback --threads 99999",
                         "bench --loopback --block-size 64M --buffer-size 1M",
                         "bench --nope",
                         "bench --loopback extra"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_expect_eq(run(bad[i], last, sizeof last), 2, "'%s' was not refused", bad[i]);
    cr_expect_eq(run("nonsense", last, sizeof last), 2);
    cr_expect_eq(run("bench --help", last, sizeof last), 0);
    /* The message names the option whose value was refused (it once printed "--5" here). */
    char cmd[1024], msg[512];
    snprintf(cmd, sizeof cmd, "%s bench --loopback --duration 1.5 2>&1 >/dev/null",
             getenv("KVB_BIN"));
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(msg, 1, sizeof msg - 1, p);
    msg[n] = '\0';
    pclose(p);
    cr_expect(strstr(msg, "invalid value '1.5' for --duration") != NULL, "got: %s", msg);
}

/* `bench --metadata URI` against each real store: the target publishes a name, the initiator
 * finds it there, and every byte is verified; then the split form (target and initiator as two
 * commands) with the name given. */
static void bench_with_store(test_store_kind_t kind)
{
    test_store_t s;
    cr_assert_eq(test_store_start(&s, kind), 0, "cannot start %s", test_store_kind_name(kind));
    char args[512], last[4096];
    snprintf(args, sizeof args,
             "bench --loopback --verify --json --metadata %s --cluster bench --operation write "
             "--duration 1 --buffer-size 16M --block-size 64K --batch-size 16",
             s.uri);
    int rc = run(args, last, sizeof last);
    cr_assert_eq(rc, 0, "bench --metadata %s failed: %s", s.uri, last);
    json_t *j = json_loads(last, 0, NULL);
    cr_assert_not_null(j, "last line is not JSON: %s", last);
    cr_assert_str_eq(json_string_value(json_object_get(j, "metadata")), s.uri);
    cr_assert(json_is_true(json_object_get(j, "verified")));
    cr_assert_eq(json_integer_value(json_object_get(j, "errors")), 0);
    cr_log_info("bench --metadata %s: %.3f GB/s, segment opened in %.1f ms",
                test_store_kind_name(kind), json_number_value(json_object_get(j, "gbps")),
                json_number_value(json_object_get(j, "open_ms")));
    json_decref(j);
    /* a name nobody published: a clear failure, not a hang */
    snprintf(args, sizeof args,
             "bench --mode initiator --metadata %s --segment nobody --duration 1 2>&1", s.uri);
    cr_assert_eq(run(args, last, sizeof last), 1);
    test_store_stop(&s);
}

Test(bench, metadata_redis)
{
    bench_with_store(TEST_STORE_REDIS);
}

Test(bench, metadata_etcd)
{
    bench_with_store(TEST_STORE_ETCD);
}

Test(bench, metadata_http)
{
    bench_with_store(TEST_STORE_HTTP);
}
