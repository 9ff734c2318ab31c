/* SPDX-License-Identifier: Apache-2.0 */
/* Same-host data path. Control stays on the TCP lanes (so requests are validated and pinned by
 * the target exactly as over TCP); the bytes move by one copy: the target maps the initiator's
 * kvb_alloc memory (memfd, passed over a Unix socket) or reaches any other registered memory with
 * cross-memory attach (process_vm_readv/writev). */
#ifndef KVB_TRANSPORT_SHM_H
#define KVB_TRANSPORT_SHM_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include "common/auth.h"
#include "engine/internal.h"

typedef struct kvb_shm_link kvb_shm_link_t;
typedef struct kvb_shm_peer kvb_shm_peer_t;

/* The engine-facing part (create, destroy, kvb_alloc memory) is declared in engine/internal.h. */
bool kvb__shm_listening(const kvb_shm_t *s);

/* The abstract Unix socket an engine of `incarnation` listens on: its same-host link's (kind "")
 * or its same-host lanes' ("-lanes", in the TCP transport). Anyone on the host may take such a
 * name first: whoever connects checks who holds it (SO_PEERCRED). */
void kvb__sock_name(uint64_t incarnation, const char *kind, struct sockaddr_un *sa, socklen_t *len);
/* Connects to `target`'s socket of that kind (SOCK_SEQPACKET or SOCK_STREAM, with any flags) and
 * checks, with the kernel's word for it, that the process behind it is the one that authenticated
 * over TCP (and, same_user, runs as our user): a local process that bound the name first gets
 * nothing from us. KVB_ERR_CONNECT where there is no such socket to reach (not on our host after
 * all, another network namespace, a full backlog), KVB_ERR_AUTH (logged) where another holds it. */
int kvb__sock_connect(const kvb_hello_t *target, const char *kind, int type, bool same_user,
                      int *out);

/* Initiator side: links to a same-host target named by its (authenticated) hello, presenting the
 * one-time tokens its lanes received in their HELLO_ACKs: tokens[0] opens the link, the others
 * bind the remaining lanes to it. Checks that the Unix socket's owner is the target's pid and our
 * uid. Blocks until `deadline`. Fails (and the caller stays on TCP) if the target is elsewhere or
 * refuses. */
int kvb__shm_link_open(kvb_shm_t *s, const kvb_hello_t *target,
                       const uint8_t (*tokens)[KVB_LINK_TOKEN_LEN], size_t ntokens,
                       uint64_t deadline, kvb_shm_link_t **out);
void kvb__shm_link_close(kvb_shm_link_t *l);
/* True if the target can reach local [addr, addr+len): kvb_alloc memory (shared with it on first
 * use, which blocks for one local round trip) or, where the kernel allows, any memory. Where the
 * range lies in a shared allocation, *span_base and *span_size are set to that allocation (the
 * same answer holds for all of it); else they are left as they are. */
bool kvb__shm_link_reaches(kvb_shm_link_t *l, uint64_t addr, uint64_t len, uint64_t *span_base,
                           uint64_t *span_size);
bool kvb__shm_link_cma(const kvb_shm_link_t *l);

/* Target side. An offer is made on each authenticated connection from a same-host initiator: a
 * fresh one-time token (sent back in HELLO_ACK) that the initiator presents on the Unix socket,
 * from the process the connection authenticated as (pid and uid checked with SO_PEERCRED), to
 * bind its same-host link to this connection. Same-host requests on a connection are honoured
 * only once its offer is bound. NULL *out (and KVB_OK) when the engine has no same-host path. */
typedef struct kvb_shm_offer kvb_shm_offer_t;
int kvb__shm_offer(kvb_shm_t *s, uint32_t pid, uint8_t token[KVB_LINK_TOKEN_LEN],
                   kvb_shm_offer_t **out);
/* The link bound to the offer (a reference), or NULL while none is. */
kvb_shm_peer_t *kvb__shm_offer_peer(kvb_shm_offer_t *o);
/* The connection closed: the token is void and the offer's references go. NULL is ignored. */
void kvb__shm_offer_drop(kvb_shm_offer_t *o);
void kvb__shm_peer_put(kvb_shm_peer_t *p);
/* A copy a target owes a same-host initiator: len bytes between our `mine` and the initiator's
 * `theirs` (to_peer: mine -> theirs), to be started by `deadline` (CLOCK_MONOTONIC ns; the
 * initiator's request ends then, and it may reuse its memory). */
typedef struct {
    bool to_peer;
    uint64_t theirs;
    uint8_t *mine;
    uint64_t len;
    uint64_t mine_span; /* the length of our registered region `mine` lies in */
    uint64_t deadline;
    int status; /* in: KVB_OK to run it (else it is skipped); out: the answer (KVB_ERR_TIMEOUT:
                 * not started by its deadline) */
} kvb_shm_job_t;

/* A set of jobs under way: started by kvb__shm_start, ended by kvb__shm_finish. */
typedef struct {
    kvb_shm_peer_t *peer; /* NULL: not started */
    kvb_shm_job_t *jobs;
    size_t n;
    void *segs;      /* the copies as queued, in parts */
    size_t nsegs;    /* a small set's copies, left to kvb__shm_finish's thread (none queued) */
    atomic_int left; /* parts not yet copied */
} kvb_shm_set_t;

/* Queues the jobs of one initiator as parts for the copy pool and returns at once, so the caller
 * can read the next requests while the pool copies (a second set may be started before the first
 * is finished). No part of a job is copied once its deadline has passed - checked as each run of
 * copies starts, in the pool or at the finish - and such a job answers KVB_ERR_TIMEOUT. A set of
 * under 256 KiB is not queued: kvb__shm_finish's thread copies it. Copies into memory larger than
 * the last-level cache use streaming stores. The jobs stay the caller's, untouched, until
 * kvb__shm_finish. */
void kvb__shm_start(kvb_shm_t *s, kvb_shm_peer_t *p, kvb_shm_job_t *jobs, size_t n,
                    kvb_shm_set_t *set);
/* Copies a small set's copies, or queued parts on this thread too (the oldest first, which may
 * be the next set's) until the set's are done, then sets each job's status (KVB_ERR_SHM_COPY if
 * its memory is not reachable). */
void kvb__shm_finish(kvb_shm_t *s, kvb_shm_set_t *set);
/* The same for a set no one will be answered for (its connection failed): waits for its queued
 * copies, makes no others (neither a small set's nor cross-memory ones). Does nothing for a set
 * not started. */
void kvb__shm_abandon(kvb_shm_t *s, kvb_shm_set_t *set);

#endif
