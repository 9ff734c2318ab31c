/* SPDX-License-Identifier: Apache-2.0 */
/* kvbridge topo: placeholder until the KV layer lands. */
#include <stdio.h>

#include "tools/cli.h"

int kvb_cmd_topo(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvbridge topo: not built yet\n");
    return 2;
}
