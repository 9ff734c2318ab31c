/* SPDX-License-Identifier: Apache-2.0 */
/* The completion aggregator: collects per-request completion notices from every expected sender
 * (TP fan-in) and says when a request is done, failed or timed out. A pure data structure - no
 * clock reads, no locks: callers pass monotonic nanoseconds and serialise calls themselves. */
#ifndef KVB_KV_AGGREGATE_H
#define KVB_KV_AGGREGATE_H

#include <stddef.h>
#include <stdint.h>

#define KVB_AGG_ID_MAX      255  /* bytes of a request id, without the NUL */
#define KVB_AGG_SENDERS_MAX 4096 /* expected senders per request */

typedef struct kvb_agg kvb_agg_t;

/* State of a request as kvb__agg_poll() reports it. */
typedef enum {
    KVB_AGG_PENDING = 0,
    KVB_AGG_DONE,    /* every expected sender reported success */
    KVB_AGG_FAILED,  /* a sender reported an error; *error holds the first one */
    KVB_AGG_TIMEOUT, /* the deadline passed first; *error is KVB_ERR_TIMEOUT */
} kvb_agg_state_t;

/* What kvb__agg_add() did with a notice (negative values are errors). */
typedef enum {
    KVB_AGG_COUNTED = 0,   /* first notice from this sender, recorded */
    KVB_AGG_DUPLICATE = 1, /* this sender already reported; ignored */
    KVB_AGG_LATE = 2,      /* the request already ended (or was released); ignored */
} kvb_agg_event_t;

/* Creates an aggregator tracking at most `max_active` requests (registered and not yet released)
 * and remembering the ids of the last `max_finished` released ones, so that notices arriving
 * after release are recognised as late instead of unknown. Memory stays bounded by these two.
 * Returns KVB_OK, KVB_ERR_INVALID_ARG (max_active 0, or sizes too large) or KVB_ERR_NOMEM. */
int kvb__agg_create(size_t max_active, size_t max_finished, kvb_agg_t **out);

/* Frees the aggregator and everything it tracks. NULL is ignored. */
void kvb__agg_destroy(kvb_agg_t *agg);

/* Registers request `id` expecting one notice from each of the n distinct `senders` (e.g. the
 * prefill ranks routing to this decode rank) before `deadline_ns` (UINT64_MAX: none). Must be
 * called before any of them can send. Returns KVB_OK; KVB_ERR_INVALID_ARG (empty or overlong id,
 * n 0 or over KVB_AGG_SENDERS_MAX, a sender listed twice); KVB_ERR_BUSY (id active or recently
 * released - a retry needs a fresh id, or old late notices would count - or max_active reached);
 * KVB_ERR_NOMEM. `id` and `senders` are copied. */
int kvb__agg_expect(kvb_agg_t *agg, const char *id, const uint32_t *senders, size_t n,
                    uint64_t deadline_ns);

/* Records `sender`'s notice for `id`, with `status` KVB_OK or the error it reported, at time
 * `now_ns`. The first error fails the request; a notice at or after the deadline times it out
 * instead and is LATE. Returns a kvb_agg_event_t, or KVB_ERR_NOT_FOUND (id unknown or forgotten),
 * KVB_ERR_INVALID_ARG (sender not expected for id). */
int kvb__agg_add(kvb_agg_t *agg, const char *id, uint32_t sender, int status, uint64_t now_ns);

/* Reports the state of `id` at `now_ns` (a pending request past its deadline turns TIMEOUT here)
 * and, if error is not NULL, stores its error (KVB_OK unless FAILED or TIMEOUT). Returns a
 * kvb_agg_state_t, or KVB_ERR_NOT_FOUND if id is not active. */
int kvb__agg_poll(kvb_agg_t *agg, const char *id, uint64_t now_ns, int *error);

/* Ends tracking of `id` (in any state) and remembers it as finished. Returns KVB_OK or
 * KVB_ERR_NOT_FOUND if id is not active. */
int kvb__agg_release(kvb_agg_t *agg, const char *id);

/* Number of active requests. */
size_t kvb__agg_active(const kvb_agg_t *agg);

#endif
