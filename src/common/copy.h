/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's bulk copies.
 *
 * kvb__copy: on x86-64 processors with fast string moves (ERMS), `rep movsb` for copies of at
 * least KVB_COPY_MOVSB_MIN bytes - it beat glibc's memcpy on large copies between uncached buffers
 * by 10-25% on some machines we measured, and is within a few percent of it on others (`kvbridge
 * bench --baseline copy` shows both) - and memcpy otherwise.
 *
 * kvb__copy_stream: the same bytes with non-temporal stores (they bypass the caches), for
 * destinations that will not be read from cache soon: a copy with ordinary stores first reads
 * every destination line from memory (to own it) and writes it back later, three trips to
 * memory per line where streaming makes two. Between buffers larger than the last-level cache it
 * moved 1.5-1.7x the bytes of memcpy or `rep movsb` here (2 threads, 64 KiB blocks, 256 MiB
 * buffers: 15-16 against 9-10 GB/s); into buffers that fit in the cache it is 2-3x slower. The
 * stores are fenced before it returns: a caller may signal completion right after. */
#ifndef KVB_COMMON_COPY_H
#define KVB_COMMON_COPY_H

#include <stddef.h>
#include <stdint.h>

#define KVB_COPY_MOVSB_MIN 4096
/* Copies shorter than this take kvb__copy even when streaming is asked for. */
#define KVB_COPY_STREAM_MIN 4096

void kvb__copy(void *dst, const void *src, size_t n);
void kvb__copy_stream(void *dst, const void *src, size_t n);
/* `rep movsb` itself, whatever the CPU says of it (memcpy where there is no such instruction):
 * for measuring it against memcpy. */
void kvb__copy_movsb(void *dst, const void *src, size_t n);
/* The size of the largest cache cpu0 reports in sysfs (the last level), or 0 if it reports none. */
uint64_t kvb__llc_size(void);

#endif
