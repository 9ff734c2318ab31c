/* SPDX-License-Identifier: Apache-2.0 */
/* Subcommands of the kvbridge command and the small helpers they share. */
#ifndef KVB_TOOLS_CLI_H
#define KVB_TOOLS_CLI_H

#include <stdbool.h>
#include <stdint.h>

int kvb_cmd_bench(int argc, char **argv);
int kvb_cmd_topo(int argc, char **argv);    /* src/tools/topo.c */
int kvb_cmd_model(int argc, char **argv);   /* src/tools/model.c */
int kvb_cmd_serve(int argc, char **argv);   /* src/tools/serve.c */
int kvb_cmd_proxy(int argc, char **argv);   /* src/tools/proxy.c */
int kvb_cmd_loadgen(int argc, char **argv); /* src/tools/loadgen.c */
int kvb_cmd_demo(int argc, char **argv);    /* src/tools/demo.c */

int kvb_cmd_metadata_server(int argc, char **argv); /* src/tools/metaserver.c */

/* The KV-shaped workload of `kvbridge bench --kv` (src/tools/bench_kv.c). */
int kvb_bench_kv(const char *model, uint64_t tokens, const char *protocol, int reps, bool verify,
                 bool json);
/* Ceilings (src/tools/ceiling.c), measured now on the same working set as the figure they divide:
 * "tcp" - a raw loopback stream over `parallel` connections, sender and receiver in separate
 * processes with buffers of their own; "copy" - the best of memcpy, rep movsb and streaming stores
 * over `parallel` threads between two populated memfd buffers. `buffer` bytes per side, `block`
 * bytes per send or copy, the `n` blocks at offsets src[i] (sending side) to dst[i] (receiving
 * side), as a KV transfer moves them, after one pass over them that is not counted. Measured in
 * steps, in turn with the figure (seconds apart, so that a slow minute of a shared machine moves
 * both): open sets the working set up once (the buffers, the sender process and its connections,
 * the uncounted pass; src and dst must stay valid until close), each measure takes the best of
 * `runs` windows (tcp) or runs (copy) of `secs` seconds (1..KVB_CEILING_RUNS_MAX) and returns 0
 * (out->gbps > 0) or -1 - while none runs, the ceiling takes no CPU: its sender is paused and its
 * connections drained. */
typedef struct {
    double gbps;
    char method[384];
} kvb_ceiling_t;
#define KVB_CEILING_RUNS_MAX 16
typedef struct kvb_ceiling_session kvb_ceiling_session_t;
int kvb_ceiling_open(const char *what, uint64_t buffer, uint64_t block, const uint64_t *src,
                     const uint64_t *dst, size_t n, int parallel, kvb_ceiling_session_t **out);
/* The "copy" session between two buffers the caller holds - the run's own, so that the ceiling
 * copies the very pages the run's copies did: where a buffer's pages lie in physical memory moved
 * a plain copy by 10-25% on the VMs measured (freshly allocated buffers came out faster than the
 * benchmark's own, which the kernel had handed out in pieces; docs/performance-notes.md, "Where
 * the pages lie"). Copies `from` (only read) into `to`, which must both stay mapped until close
 * and hold `buffer` bytes; the uncounted pass and every run write the blocks of `to` at dst[i]. */
int kvb_ceiling_open_on(const uint8_t *from, uint8_t *to, uint64_t buffer, uint64_t block,
                        const uint64_t *src, const uint64_t *dst, size_t n, int parallel,
                        kvb_ceiling_session_t **out);
int kvb_ceiling_measure(kvb_ceiling_session_t *s, double secs, int runs, kvb_ceiling_t *out);
void kvb_ceiling_close(kvb_ceiling_session_t *s);
/* Where the "tcp" ceiling streams: by default over loopback (127.0.0.1) in this network
 * namespace. kvb_ceiling_net(addr, peer_netns) makes the receiver (this process) listen on `addr`,
 * an IPv4 address of its namespace, and the sender process join the network namespace
 * `peer_netns` (a name under /run/netns, as `ip netns` makes them) before it connects - so the
 * stream crosses the same link as a benchmark between two namespaces. NULLs restore loopback.
 * Returns 0, or -1 with a message on stderr (a bad address or name). */
int kvb_ceiling_net(const char *addr, const char *peer_netns);
/* A reference for a benchmark that moves one batch at a time over TCP (src/tools/ceiling.c): a
 * plain request/response program with the same shape - per batch a 16-byte request on each of
 * `conns` connections, then that connection's share of `batch` bytes streamed back (READ) or sent
 * and acknowledged (`write`), the next batch once every share is done - over the same endpoints as
 * the "tcp" ceiling (kvb_ceiling_net), `buffer` bytes per side. What the stream loses to the
 * batches' round trips and drains, with nothing of kvbridge. open connects its server process and
 * moves both buffers once, not counted (0 or -1); measure runs batches for about `secs` and
 * returns GB/s, or -1; method describes it. */
typedef struct kvb_rpcref kvb_rpcref_t;
int kvb_rpcref_open(bool write, uint64_t buffer, uint64_t batch, int conns, kvb_rpcref_t **out);
double kvb_rpcref_measure(kvb_rpcref_t *r, double secs);
void kvb_rpcref_method(const kvb_rpcref_t *r, char *out, size_t cap);
void kvb_rpcref_close(kvb_rpcref_t *r);
/* A buffer of private anonymous memory, populated up front (first-touch page faults would
 * otherwise be timed as transfer cost) and not inherited by children forked later (shared
 * copy-on-write, its writes would be timed as page faults); free with munmap. NULL if it cannot
 * be had. */
uint8_t *kvb_cli_populated(uint64_t len);
/* A memfd of `len` bytes (close-on-exec, `name` for /proc): its descriptor, or -1 with errno set.
 * The benches make one before they fork, for a buffer that the child populates and uses and the
 * parent maps again for the copy ceiling. */
int kvb_cli_memfd(const char *name, uint64_t len);
/* `len` bytes of the memfd `fd`, mapped shared (read-only unless `writable`) and populated; free
 * with munmap. NULL with errno set on failure. */
uint8_t *kvb_cli_map_memfd(int fd, uint64_t len, bool writable);

/* Device memory for bench --gpu (src/tools/bench_gpu.c), on CUDA device 0; each reports its own
 * errors on stderr. A ceiling is a stream of cuMemcpyAsync ("d2h", "h2d", "d2d"), `batch` blocks
 * queued at a time, in GB/s (< 0: error). */
uint8_t *kvb_bench_gpu_alloc(uint64_t len);
void kvb_bench_gpu_free(uint8_t *p);
int kvb_bench_gpu_upload(uint8_t *dev, const uint8_t *host, uint64_t len);
int kvb_bench_gpu_download(uint8_t *host, const uint8_t *dev, uint64_t len);
int kvb_bench_gpu_fill(uint8_t *dev, uint8_t value, uint64_t len);
double kvb_bench_gpu_ceiling(const char *what, uint64_t block, uint64_t batch, int secs);

/* For the long-running commands (serve, proxy, metadata-server): blocks SIGINT and SIGTERM in
 * the calling thread - call it before any thread exists, so that every thread inherits the mask -
 * and ignores SIGPIPE; kvb_cli_wait_stop() then waits for one of the two and returns it. */
void kvb_cli_block_stop_signals(void);
/* True if argv[1..argc) holds --help or -h. */
bool kvb_cli_wants_help(int argc, char **argv);
int kvb_cli_wait_stop(void);

/* --secret-file PATH: checks that the file holds a usable cluster secret and exports it as
 * KVB_SECRET_FILE, where every engine this process creates reads it. Returns 0, or -1 after a
 * message on stderr. */
int kvb_cli_secret_file(const char *cmd, const char *path);

/* Parses a size with an optional K/M/G suffix (powers of 1024). Returns 0 on success. */
int kvb_cli_parse_size(const char *s, uint64_t *out);
/* Parses a non-negative integer no larger than max. Returns 0 on success. */
int kvb_cli_parse_uint(const char *s, uint64_t max, uint64_t *out);

#endif
