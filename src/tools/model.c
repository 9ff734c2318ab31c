/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge model: placeholder until the reference model lands. */
#include <stdio.h>

#include "tools/cli.h"

int kvb_cmd_model(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvbridge model: not built yet\n");
    return 2;
}
