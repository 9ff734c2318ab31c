/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for `kvbridge topo` (src/tools/topo.c, on top of the guard and routes): runs the built
 * binary (KVB_BIN, set by CTest), parses its --json output with jansson and checks the routes;
 * bad command lines exit 2 with a message and never crash. */
#include "helpers/cli.h"
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXARGS 20 /* arguments a test passes, at most (test_run_cli takes 20) */
#define OUTMAX  (1 << 20)

typedef struct {
    int status; /* exit code, or -1 if it did not exit normally */
    char out[OUTMAX];
    char err[8192];
} result_t;

static result_t res;

/* Runs `kvbridge topo args...` (NULL-terminated), capturing stdout and stderr. */
static void run(const char *const *args)
{
    if (!getenv("KVB_BIN"))
        cr_skip_test("KVB_BIN is not set (run through ctest)");
    res.status = test_run_cli("topo", args, res.out, sizeof res.out, res.err, sizeof res.err);
    cr_assert_neq(res.status, -2, "cannot run $KVB_BIN topo");
}

/* Runs with --json appended and returns the parsed object (exactly status, reason, routes). */
static json_t *run_json(const char *const *args, int want_status)
{
    const char *a[MAXARGS];
    int n = 0;
    for (; args[n]; n++)
        a[n] = args[n];
    a[n++] = "--json";
    a[n] = NULL;
    run(a);
    cr_assert_eq(res.status, want_status, "exit %d want %d; stderr: %s", res.status, want_status,
                 res.err);
    json_error_t e;
    json_t *j = json_loads(res.out, 0, &e);
    cr_assert_not_null(j, "not one JSON object (%s): %s", e.text, res.out);
    cr_assert(json_is_object(j));
    cr_assert_eq(json_object_size(j), 3, "%s", res.out);
    cr_assert(json_is_string(json_object_get(j, "status")));
    cr_assert(json_is_string(json_object_get(j, "reason")));
    cr_assert(json_is_array(json_object_get(j, "routes")));
    return j;
}

static const char *status_of(json_t *j)
{
    return json_string_value(json_object_get(j, "status"));
}

static json_t *route_at(json_t *j, size_t i)
{
    return json_array_get(json_object_get(j, "routes"), i);
}

static int field(json_t *r, const char *key)
{
    json_t *v = json_object_get(r, key);
    cr_assert(json_is_integer(v), "%s is not an integer", key);
    return (int)json_integer_value(v);
}

static void expect_route(json_t *r, int dd, int src, int dst, int h0, int h1)
{
    cr_assert_eq(json_object_size(r), 4);
    cr_assert_eq(field(r, "dst_dp"), dd);
    cr_assert_eq(field(r, "src_rank"), src);
    cr_assert_eq(field(r, "dst_rank"), dst);
    json_t *heads = json_object_get(r, "heads");
    if (h1 < 0) {
        cr_assert(json_is_null(heads), "heads should be null for MLA");
        return;
    }
    cr_assert(json_is_array(heads) && json_array_size(heads) == 2);
    cr_assert_eq(json_integer_value(json_array_get(heads, 0)), h0);
    cr_assert_eq(json_integer_value(json_array_get(heads, 1)), h1);
}

TestSuite(topo, .timeout = 30);

Test(topo, gqa_tp2_to_tp4_json)
{
    const char *a[] = {"--prefill", "dp=1,tp=2",  "--decode", "dp=1,tp=4", "--attn",
                       "gqa",       "--kv-heads", "8",        NULL};
    json_t *j = run_json(a, 0);
    cr_assert_str_eq(status_of(j), "ALLOW_HETERO");
    cr_assert_eq(json_array_size(json_object_get(j, "routes")), 4);
    expect_route(route_at(j, 0), 0, 0, 0, 0, 2);
    expect_route(route_at(j, 1), 0, 0, 1, 2, 4);
    expect_route(route_at(j, 2), 0, 1, 2, 4, 6);
    expect_route(route_at(j, 3), 0, 1, 3, 6, 8);
    json_decref(j);
}

Test(topo, gqa_tp4_to_tp1_push_two_dp_groups)
{
    const char *a[] = {"--prefill=dp=1,tp=4", "--decode=tp=1,dp=2", "--attn=gqa",
                       "--kv-heads=8",        "--mode=push",        NULL};
    json_t *j = run_json(a, 0);
    cr_assert_str_eq(status_of(j), "ALLOW_HETERO");
    cr_assert_eq(json_array_size(json_object_get(j, "routes")), 8);
    for (int dd = 0; dd < 2; dd++)
        for (int r = 0; r < 4; r++)
            expect_route(route_at(j, (size_t)(dd * 4 + r)), dd, r, 0, 2 * r, 2 * r + 2);
    json_decref(j);
}

Test(topo, mla_tp2_to_tp8_multicast)
{
    const char *a[] = {"--prefill", "dp=1,tp=2", "--decode", "dp=4,tp=8", "--attn", "mla", NULL};
    json_t *j = run_json(a, 0);
    cr_assert_str_eq(status_of(j), "ALLOW_HETERO");
    cr_assert_eq(json_array_size(json_object_get(j, "routes")), 32);
    int globals[4], g = 0;
    for (size_t i = 0; i < 32; i++) {
        json_t *r = route_at(j, i);
        expect_route(r, (int)i / 8, (int)(i % 8) % 2, (int)i % 8, 0, -1);
        if (field(r, "dst_dp") == 3 && field(r, "src_rank") == 1)
            globals[g++] = 3 * 8 + field(r, "dst_rank");
    }
    cr_assert_eq(g, 4);
    cr_assert_arr_eq(globals, ((int[]){25, 27, 29, 31}), sizeof globals);
    json_decref(j);
}

Test(topo, mla_tp8_to_tp3_one_writer)
{
    const char *a[] = {"--prefill", "dp=1,tp=8", "--decode", "dp=3,tp=3", "--attn", "mla", NULL};
    json_t *j = run_json(a, 0);
    expect_route(route_at(j, 6), 2, 6, 0, 0, -1);
    expect_route(route_at(j, 7), 2, 7, 1, 0, -1);
    expect_route(route_at(j, 8), 2, 0, 2, 0, -1);
    json_decref(j);
}

Test(topo, homo_dp2_to_dp1)
{
    const char *a[] = {"--prefill", "dp=2,tp=2",  "--decode", "dp=1,tp=2", "--attn",
                       "gqa",       "--kv-heads", "8",        NULL};
    json_t *j = run_json(a, 0);
    cr_assert_str_eq(status_of(j), "ALLOW_HOMO");
    expect_route(route_at(j, 1), 0, 1, 1, 4, 8);
    json_decref(j);
}

Test(topo, denied_and_invalid_exit_1_with_no_routes)
{
    const char *nhd[] = {"--prefill",  "dp=1,tp=2", "--decode", "dp=1,tp=4", "--attn", "gqa",
                         "--kv-heads", "8",         "--order",  "nhd",       NULL};
    json_t *j = run_json(nhd, 1);
    cr_assert_str_eq(status_of(j), "DENY_HETERO");
    cr_assert_eq(json_array_size(json_object_get(j, "routes")), 0);
    json_decref(j);
    const char *rep[] = {"--prefill", "dp=1,tp=2",  "--decode", "dp=1,tp=16", "--attn",
                         "gqa",       "--kv-heads", "8",        NULL};
    j = run_json(rep, 1);
    cr_assert_str_eq(status_of(j), "DENY_HETERO");
    cr_assert(strstr(json_string_value(json_object_get(j, "reason")), "replicated heads"));
    json_decref(j);
    const char *bad_dp[] = {"--prefill", "dp=0,tp=2", "--decode", "dp=1,tp=2",
                            "--attn",    "mla",       NULL};
    j = run_json(bad_dp, 1);
    cr_assert_str_eq(status_of(j), "INVALID_REMOTE", "pulling: the prefill side is remote");
    json_decref(j);
    const char *bad_push[] = {"--prefill", "dp=0,tp=2", "--decode", "dp=1,tp=2", "--attn",
                              "mla",       "--mode",    "push",     NULL};
    j = run_json(bad_push, 1);
    cr_assert_str_eq(status_of(j), "INVALID_LOCAL", "pushing: the prefill side is local");
    json_decref(j);
    const char *heads[] = {"--prefill", "dp=1,tp=3",  "--decode", "dp=1,tp=2", "--attn",
                           "gqa",       "--kv-heads", "8",        NULL};
    j = run_json(heads, 1);
    cr_assert(strstr(json_string_value(json_object_get(j, "reason")), "do not divide"));
    json_decref(j);
}

Test(topo, text_output)
{
    const char *a[] = {"--prefill", "dp=1,tp=2",  "--decode", "dp=2,tp=4", "--attn",
                       "gqa",       "--kv-heads", "8",        NULL};
    run(a);
    cr_assert_eq(res.status, 0, "%s", res.err);
    cr_assert(strstr(res.out, "status: ALLOW_HETERO\nreason: "), "%s", res.out);
    cr_assert(strstr(res.out, "decode dp 1:\n"), "%s", res.out);
    cr_assert(strstr(res.out, "decode rank 3 (global 7) reads heads [6, 8) from prefill rank 1"),
              "%s", res.out);
}

Test(topo, help)
{
    const char *a[] = {"--help", NULL};
    run(a);
    cr_assert_eq(res.status, 0);
    cr_assert(strstr(res.out, "usage: kvbridge topo"));
}

static void expect_bad(const char *const *args, const char *needle)
{
    run(args);
    cr_assert_eq(res.status, 2, "exit %d for %s %s", res.status, args[0], args[1] ? args[1] : "");
    cr_assert_str_empty(res.out, "nothing on stdout: %s", res.out);
    cr_assert(strstr(res.err, "kvbridge topo: "), "%s", res.err);
    cr_assert(strstr(res.err, needle), "stderr '%s' lacks '%s'", res.err, needle);
}

Test(topo, bad_command_lines_exit_2)
{
#define BAD(needle, ...) expect_bad((const char *const[]){__VA_ARGS__, NULL}, needle)
    BAD("are required", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=2");
    BAD("are required", "--json");
    BAD("--prefill: expected dp=D,tp=T", "--prefill", "dp=1", "--decode", "dp=1,tp=2", "--attn",
        "mla");
    BAD("--prefill: expected", "--prefill", "dp=1,tp=2,", "--decode", "dp=1,tp=2", "--attn", "mla");
    BAD("--prefill: expected", "--prefill", "dp=1,dp=2", "--decode", "dp=1,tp=2", "--attn", "mla");
    BAD("--prefill: expected", "--prefill", "dp=1,tp=x", "--decode", "dp=1,tp=2", "--attn", "mla");
    BAD("--prefill: expected", "--prefill", "dp=-1,tp=2", "--decode", "dp=1,tp=2", "--attn", "mla");
    BAD("--decode: expected", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=99999999999999999999",
        "--attn", "mla");
    BAD("--decode: expected", "--prefill", "dp=1,tp=2", "--decode", "pp=1,tp=2", "--attn", "mla");
    BAD("--decode: expected", "--prefill", "dp=1,tp=2", "--decode", "", "--attn", "mla");
    BAD("--decode: expected", "--prefill", "dp=1,tp=2", "--decode",
        "dp=1,tp=2222222222222222222222222222222222222222", "--attn", "mla");
    BAD("--attn: expected mla or gqa", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=2", "--attn",
        "mqa");
    BAD("needs --kv-heads", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=2", "--attn", "gqa");
    BAD("apply to gqa only", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=2", "--attn", "mla",
        "--kv-heads", "8");
    BAD("--kv-heads: expected", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=2", "--attn", "gqa",
        "--kv-heads", "8x");
    BAD("--order: expected hnd or nhd", "--prefill", "dp=1,tp=2", "--decode", "dp=1,tp=2", "--attn",
        "gqa", "--kv-heads", "8", "--order", "dhn");
    BAD("--mode: expected pull or push", "--mode", "sideways");
    BAD("unknown option '--frobnicate'", "--frobnicate");
    BAD("unknown option 'stray'", "stray");
    BAD("unknown option", "--a-very-long-option-name-indeed=1");
    BAD("--attn needs a value", "--attn");
#undef BAD
}
