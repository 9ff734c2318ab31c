/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the reference model's weight files (kvb_pd_model_parse,
 * src/pd/model/weightfile.c): a file an operator points `serve --model` at. */
#include "fuzz.h"
#include "pd/model/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvb_pd_model_t *m = NULL;
    char why[256];
    if (kvb_pd_model_parse(data, size, &m, why, sizeof why) == 0)
        kvb_pd_model_free(m);
    return 0;
}
