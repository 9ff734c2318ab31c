/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the reference model's weight files (kvb_pd_model_parse,
 * src/pd/weightfile.c): a file an operator points `serve --model` at. */
#include "pd/model.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvb_log_set_level(0);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvb_pd_model_t *m = NULL;
    char why[256];
    if (kvb_pd_model_parse(data, size, &m, why, sizeof why) == 0)
        kvb_pd_model_free(m);
    return 0;
}
