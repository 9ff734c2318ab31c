/* SPDX-License-Identifier: Apache-2.0 */
/* What every libFuzzer harness here defines; fuzz_quiet.c gives the parser harnesses their
 * LLVMFuzzerInitialize (logging off: a warning per malformed input would be all they do). */
#ifndef KVB_TESTS_FUZZ_H
#define KVB_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
