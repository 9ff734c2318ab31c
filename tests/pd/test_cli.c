/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for `kvbridge model` (src/tools/model.c): runs the built binary (KVB_BIN, set by CTest) to
 * write, describe and generate from weight files and presets, checks that its tokens are the
 * library's for every TP size, and that bad command lines exit 2 and bad files 1, with a message.
 */
#include "helpers/cli.h"
#include "pd_fixture.h"

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct {
    int status; /* exit code, or -1 if it did not exit normally */
    char out[1 << 16];
    char err[8192];
} result_t;

static result_t res;
static char file[64];

TestSuite(cli, .timeout = 60);

/* Runs `kvbridge model args...` (NULL-terminated), capturing stdout and stderr. */
static void run(const char *const *args)
{
    if (!getenv("KVB_BIN"))
        cr_skip_test("KVB_BIN is not set (run through ctest)");
    res.status = test_run_cli("model", args, res.out, sizeof res.out, res.err, sizeof res.err);
    cr_assert_neq(res.status, -2, "cannot run $KVB_BIN model");
}

#define RUN(...) run((const char *const[]){__VA_ARGS__, NULL})

static void expect(int status, const char *in_out, const char *in_err)
{
    cr_assert_eq(res.status, status, "exit %d want %d; stderr: %s", res.status, status, res.err);
    if (in_out)
        cr_assert(strstr(res.out, in_out), "stdout lacks '%s': %s", in_out, res.out);
    if (in_err)
        cr_assert(strstr(res.err, in_err), "stderr lacks '%s': %s", in_err, res.err);
}

static void setup(void)
{
    snprintf(file, sizeof file, "/tmp/kvb_pd_cli_%d.kvbm", (int)getpid());
}

static void teardown(void)
{
    unlink(file);
}

/* The library's greedy tokens for `text`, as the CLI prints them with --tokens. */
static void library_tokens(const char *preset, uint64_t seed, const char *text, uint32_t max,
                           char *out, size_t cap)
{
    kvb_pd_model_t *m = fx_preset(preset, seed);
    uint32_t prompt[64], gen[64];
    size_t np, n, k = 0;
    cr_assert_eq(kvb_pd_tokenize(text, strlen(text), true, prompt, 64, &np), KVB_OK);
    kvb_pd_gen_opts_t o = {.max_tokens = max};
    cr_assert_eq(kvb_pd_generate(m, &o, prompt, np, gen, &n, NULL, 0), KVB_OK);
    for (size_t i = 0; i < n; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%u", i ? " " : "", gen[i]);
    snprintf(out + k, cap - k, "\n");
    kvb_pd_model_free(m);
}

Test(cli, init_info_generate, .init = setup, .fini = teardown)
{
    char want[1024], id[64];
    RUN("init", "--preset", "tiny-gqa", "--seed", "3", "--out", file);
    expect(0, "tiny-gqa@", NULL);
    snprintf(id, sizeof id, "%.17s", strstr(res.out, "tiny-gqa@"));
    RUN("info", file);
    expect(0, "attention:  GQA", NULL);
    cr_assert(strstr(res.out, id), "info shows another id than init: %s", res.out);
    cr_assert(strstr(res.out, "tensors:    39"), "%s", res.out);
    library_tokens("tiny-gqa", 3, "Hello", 6, want, sizeof want);
    RUN("generate", "--model", file, "--prompt", "Hello", "--max-tokens", "6", "--tokens");
    expect(0, NULL, NULL);
    cr_assert_str_eq(res.out, want);
    RUN("generate", "--model", "tiny-gqa", "--seed", "3", "--prompt", "Hello", "--max-tokens", "6",
        "--tp", "4", "--tokens");
    expect(0, NULL, NULL);
    cr_assert_str_eq(res.out, want, "preset with TP 4 differs from the file with TP 1");
    RUN("generate", "--model", file, "--prompt", "Hello", "--max-tokens", "6");
    expect(0, NULL, NULL);
    cr_assert_gt(strlen(res.out), 6, "text: %s", res.out);
}

Test(cli, mla_generate_and_sampling)
{
    char want[1024];
    library_tokens("tiny-mla", 0, "", 5, want, sizeof want);
    RUN("generate", "--model", "tiny-mla", "--prompt", "", "--max-tokens", "5", "--tp", "8",
        "--tokens");
    expect(0, NULL, NULL);
    cr_assert_str_eq(res.out, want);
    static char first[sizeof res.out];
    RUN("generate", "--model", "tiny-mla", "--prompt", "abc", "--max-tokens", "5", "--temperature",
        "0.8", "--sample-seed", "4", "--tokens");
    expect(0, NULL, NULL);
    snprintf(first, sizeof first, "%s", res.out);
    RUN("generate", "--model", "tiny-mla", "--prompt", "abc", "--max-tokens", "5", "--tp", "2",
        "--temperature", "0.8", "--sample-seed", "4", "--tokens");
    expect(0, NULL, NULL);
    cr_assert_str_eq(res.out, first);
    RUN("info", "tiny-mla");
    expect(0, "attention:  MLA", NULL);
}

Test(cli, bad_command_lines)
{
    RUN("--help");
    expect(0, "usage:", NULL);
    RUN("generate", "--help");
    expect(0, "usage:", NULL);
    struct {
        const char *args[8];
        const char *err;
    } cases[] = {
        {{"frobnicate"}, "unknown subcommand"},
        {{"init", "--preset", "tiny-gqa"}, "needs --preset and --out"},
        {{"init", "--preset", "huge", "--out", "/tmp/x"}, "unknown preset"},
        {{"init", "--preset", "tiny-gqa", "--seed", "abc", "--out", "/tmp/x"}, "bad value"},
        {{"init", "--preset", "tiny-gqa", "--seed", " -1", "--out", "/tmp/x"}, "bad value"},
        {{"init", "--preset", "tiny-gqa", "--prompt", "x", "--out", "/tmp/x"}, "unknown option"},
        {{"info"}, "needs a preset or a file"},
        {{"info", "a", "b"}, "unexpected argument"},
        {{"generate", "--model", "tiny-gqa", "--prompt"}, "needs a value"},
        {{"generate", "--prompt", "x", "--max-tokens", "3"}, "needs --model"},
        {{"generate", "--model", "tiny-gqa", "--prompt", "x", "--tp", "0"}, "bad value"},
        {{"generate", "--model", "tiny-gqa", "--prompt", "x", "--tp", "3"}, "must divide"},
        {{"generate", "--model", "tiny-gqa", "--prompt", "x", "--temperature", "-1"}, "bad value"},
        {{"generate", "--model", "tiny-gqa", "--prompt", "x", "--max-tokens", "-4"}, "bad value"},
        {{"generate", "--model", "tiny-gqa", "--prompt", "x", "--bogus", "1"}, "unknown option"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *a[9] = {0};
        memcpy(a, cases[i].args, sizeof cases[i].args);
        run(a);
        expect(2, NULL, cases[i].err);
    }
    run((const char *const[]){NULL});
    expect(2, NULL, "usage:");
}

Test(cli, bad_files_exit_1, .init = setup, .fini = teardown)
{
    FILE *f = fopen(file, "wb");
    cr_assert_not_null(f);
    fputs("this is not a model file, but it is long enough to hold a header, and then some more "
          "text so that the magic check is what refuses it, not the length check: padding....",
          f);
    fclose(f);
    RUN("info", file);
    expect(1, NULL, "bad magic");
    RUN("generate", "--model", file, "--prompt", "x", "--max-tokens", "2");
    expect(1, NULL, "bad magic");
    RUN("info", "/nonexistent/model.kvbm");
    expect(1, NULL, "No such file");
    RUN("init", "--preset", "tiny-mla", "--out", "/nonexistent/dir/m.kvbm");
    expect(1, NULL, "cannot write");
}
