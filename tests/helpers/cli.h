/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper: runs the built kvbridge command (KVB_BIN, set by CTest) and captures its output. */
#ifndef KVB_TESTS_CLI_H
#define KVB_TESTS_CLI_H

#include <stddef.h>

/* Runs `$KVB_BIN sub args...` (args NULL-terminated, at most 20), capturing stdout into out and
 * stderr into err (NUL-terminated, cut at cap - 1). Returns the exit status, -1 if the command did
 * not exit normally, -2 if KVB_BIN is unset or it could not be started. */
int test_run_cli(const char *sub, const char *const *args, char *out, size_t out_cap, char *err,
                 size_t err_cap);

#endif
