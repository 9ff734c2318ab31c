/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the body of POST /v1/completions (kvb__pxy_parse, src/pd/proxy/flow.c):
 * what any client of the public endpoint sends. */
#include <jansson.h>
#include <string.h>

#include "fuzz.h"
#include "kvbridge/engine.h"
#include "pd/proxy/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvb__pxy_creq_t rq;
    kvb__pxy_err_t err;
    memset(&err, 0, sizeof err);
    if (kvb__pxy_parse((const char *)data, size, 30000, &rq, &err) == 0) {
        if (!rq.prompt || rq.max_tokens == 0 || rq.timeout_ms == 0)
            __builtin_trap(); /* a validated request has what the proxy goes on to use */
        json_decref(rq.root);
    } else if (err.status < 400 || err.status > 599 || !memchr(err.msg, 0, sizeof err.msg)) {
        __builtin_trap(); /* every refusal is a client or server error with a message */
    }
    return 0;
}
