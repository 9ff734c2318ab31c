/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the generation fields of an instance's request bodies
 * (kvb__srv_params_parse, src/pd/server/gen.c): /v1/completions on a colocated instance and every
 * /pd/ call parse them, and then tokenize the prompt. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pd/server/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_t *b = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, NULL);
    if (!json_is_object(b)) {
        json_decref(b);
        return 0;
    }
    for (int need = 0; need < 2; need++) {
        kvb__srv_params_t p;
        char why[512] = "";
        if (kvb__srv_params_parse(b, &p, need, why, sizeof why)) {
            if (!why[0] || !memchr(why, 0, sizeof why))
                __builtin_trap(); /* every refusal says why */
            continue;
        }
        if ((need && !p.prompt) || !p.max_tokens || p.max_tokens > KVB_PD_SERVER_MAX_TOKENS ||
            !p.timeout_ms || !(p.temperature >= 0))
            __builtin_trap(); /* what passed is what the handlers rely on */
        uint32_t *toks = NULL;
        size_t n = 0;
        if (p.prompt && !kvb__srv_tokenize(p.prompt, p.prompt_len, &toks, &n) &&
            n != p.prompt_len + 1)
            __builtin_trap(); /* BOS and one token per byte */
        free(toks);
    }
    json_decref(b);
    return 0;
}
