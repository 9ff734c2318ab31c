/* SPDX-License-Identifier: Apache-2.0 */
/* Subcommands of the kvbridge command and the small helpers they share. */
#ifndef KVB_TOOLS_CLI_H
#define KVB_TOOLS_CLI_H

#include <stdint.h>

int kvb_cmd_bench(int argc, char **argv);
int kvb_cmd_topo(int argc, char **argv); /* src/tools/topo.c */

/* Parses a size with an optional K/M/G suffix (powers of 1024). Returns 0 on success. */
int kvb_cli_parse_size(const char *s, uint64_t *out);
/* Parses a non-negative integer no larger than max. Returns 0 on success. */
int kvb_cli_parse_uint(const char *s, uint64_t max, uint64_t *out);

#endif
