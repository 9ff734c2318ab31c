/* SPDX-License-Identifier: Apache-2.0 */
/* LLVMFuzzerInitialize of the parser harnesses: errors only in the log. */
#include "fuzz.h"
#include "kvbridge/engine.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvb_log_set_level(0);
    return 0;
}
