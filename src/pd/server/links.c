/* SPDX-License-Identifier: Apache-2.0 */
/* KV links of an instance to its peers' ranks: opened on first use (every local rank to every
 * remote rank, through the topology guard), cached by remote segment, and remembered with the
 * guard's verdict and reason when refused so that /health can show why. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/reason.h"
#include "pd/server/internal.h"

static kvb__srv_peer_t *peer_find(kvb_pd_server_t *srv, const char *seg)
{
    for (size_t i = 0; i < srv->npeers; i++)
        if (!strcmp(srv->peers[i].seg, seg))
            return &srv->peers[i];
    return NULL;
}

static kvb__srv_peer_t *peer_add(kvb_pd_server_t *srv, const char *seg)
{
    kvb__srv_peer_t *np = realloc(srv->peers, (srv->npeers + 1) * sizeof *np);
    if (!np)
        return NULL;
    srv->peers = np;
    kvb__srv_peer_t *p = &np[srv->npeers];
    memset(p, 0, sizeof *p);
    p->links = calloc(srv->tp, sizeof *p->links);
    if (!p->links)
        return NULL;
    snprintf(p->seg, sizeof p->seg, "%s", seg);
    srv->npeers++;
    return p;
}

/* The guard's verdict on a refused peer, which kvb_kv_link_open() does not return: fetch the
 * peer's published layout and ask the guard ourselves. */
static kvb_kv_verdict_t refusal_verdict(kvb_pd_server_t *srv, const char *seg)
{
    kvb_engine_t *e = srv->ranks[0].engine;
    kvb_segment_t s;
    if (kvb_segment_open(e, seg, &s))
        return KVB_KV_INVALID_REMOTE;
    kvb_kv_verdict_t v = KVB_KV_INVALID_REMOTE;
    size_t len = 0;
    char *json = NULL;
    kvb_kv_layout_t *remote = NULL;
    if (!kvb_segment_attr(e, s, KVB_KV_LAYOUT_ATTR, NULL, 0, &len) && len && (json = malloc(len)) &&
        !kvb_segment_attr(e, s, KVB_KV_LAYOUT_ATTR, json, len, &len) &&
        !kvb_kv_layout_decode(json, len, &remote, NULL, 0))
        v = kvb_kv_guard(&srv->ranks[0].layout, remote, NULL, 0);
    if (v == KVB_KV_ALLOW_HOMO || v == KVB_KV_ALLOW_HETERO) /* refused for its role, say */
        v = KVB_KV_INVALID_REMOTE;
    kvb_kv_layout_free(remote);
    free(json);
    kvb_segment_close(e, s);
    return v;
}

static void peer_close_links(kvb_pd_server_t *srv, kvb__srv_peer_t *p)
{
    for (uint32_t r = 0; r < srv->tp; r++) {
        kvb_kv_link_close(p->links[r]);
        p->links[r] = NULL;
    }
}

/* Opens rank r's link to p->seg for every rank; a refusal is remembered in p. */
static int peer_open(kvb_pd_server_t *srv, kvb__srv_peer_t *p, char *why, size_t cap)
{
    char reason[KVB_KV_REASON_MAX] = "";
    for (uint32_t r = 0; r < srv->tp; r++) {
        int rc = kvb_kv_link_open(srv->ranks[r].agent, p->seg, &p->links[r], reason, sizeof reason);
        if (!rc)
            continue;
        peer_close_links(srv, p);
        if (rc != KVB_ERR_INCOMPATIBLE)
            return kvb__fail(why, cap, rc, "cannot link to %s: %s", p->seg, reason);
        p->refused = true;
        p->verdict = refusal_verdict(srv, p->seg);
        snprintf(p->reason, sizeof p->reason, "%s", reason);
        return kvb__fail(why, cap, rc, "KV link to %s refused (%s): %s", p->seg,
                         kvb_kv_verdict_name(p->verdict), reason);
    }
    p->refused = false;
    p->verdict = kvb_kv_link_verdict(p->links[0]);
    snprintf(p->reason, sizeof p->reason, "%s", "");
    return KVB_OK;
}

bool kvb__srv_links_unknown(int rc)
{
    return rc == KVB_ERR_SEGMENT_NOT_FOUND || rc == KVB_ERR_NOT_FOUND || rc == KVB_ERR_RESOLVE ||
           rc == KVB_ERR_AUTH || rc == KVB_ERR_VERSION || rc == KVB_ERR_PROTOCOL ||
           rc == KVB_ERR_INVALID_ARG;
}

/* Forgets a peer added for this request whose link failed for a reason other than the guard's
 * (remembered for /health): a name that led nowhere leaves nothing behind. */
static void peer_forget_last(kvb_pd_server_t *srv)
{
    kvb__srv_peer_t *p = &srv->peers[srv->npeers - 1];
    free(p->links);
    srv->npeers--;
}

int kvb__srv_links_get(kvb_pd_server_t *srv, char *const *segs, size_t n, kvb_kv_link_t **out,
                       char *why, size_t why_cap)
{
    int rc = KVB_OK;
    /* Held across link opens (each bounded by the connect timeout) so that two requests to a
     * new peer do not both open its links. */
    pthread_mutex_lock(&srv->links_mu);
    for (size_t m = 0; !rc && m < n; m++) {
        kvb__srv_peer_t *p = peer_find(srv, segs[m]);
        bool added = !p;
        if (!p && !(p = peer_add(srv, segs[m])))
            rc = kvb__fail(why, why_cap, KVB_ERR_NOMEM, "out of memory");
        else if (!p->links[0]) /* new, refused before, or dropped: (re)link */
            rc = peer_open(srv, p, why, why_cap);
        if (rc && rc != KVB_ERR_NOMEM && rc != KVB_ERR_INCOMPATIBLE && added)
            peer_forget_last(srv);
        for (uint32_t r = 0; !rc && r < srv->tp; r++)
            out[r * n + m] = p->links[r];
    }
    pthread_mutex_unlock(&srv->links_mu);
    return rc;
}

void kvb__srv_links_drop(kvb_pd_server_t *srv, const char *seg)
{
    pthread_mutex_lock(&srv->links_mu);
    kvb__srv_peer_t *p = peer_find(srv, seg);
    kvb_kv_link_t **nd =
        p && p->links[0] ? realloc(srv->dead, (srv->ndead + srv->tp) * sizeof *nd) : NULL;
    if (nd) { /* other requests may still use them: closed at shutdown */
        srv->dead = nd;
        for (uint32_t r = 0; r < srv->tp; r++) {
            srv->dead[srv->ndead++] = p->links[r];
            p->links[r] = NULL;
        }
        KVB_INFO("peer %s lost: its links will be reopened on next use", seg);
    }
    pthread_mutex_unlock(&srv->links_mu);
}

void kvb__srv_links_health(kvb_pd_server_t *srv, json_t *arr, bool *degraded)
{
    pthread_mutex_lock(&srv->links_mu);
    for (size_t i = 0; i < srv->npeers; i++) {
        kvb__srv_peer_t *p = &srv->peers[i];
        if (!p->refused && !p->links[0])
            continue; /* dropped after its peer was lost */
        json_array_append_new(arr, json_pack("{s:s,s:s,s:s}", "peer", p->seg, "verdict",
                                             kvb_kv_verdict_name(p->verdict), "reason", p->reason));
        *degraded = *degraded || p->refused;
    }
    pthread_mutex_unlock(&srv->links_mu);
}

void kvb__srv_links_free(kvb_pd_server_t *srv)
{
    for (size_t i = 0; i < srv->npeers; i++) {
        peer_close_links(srv, &srv->peers[i]);
        free(srv->peers[i].links);
    }
    for (size_t i = 0; i < srv->ndead; i++)
        kvb_kv_link_close(srv->dead[i]);
    free(srv->peers);
    free(srv->dead);
    srv->peers = NULL;
    srv->dead = NULL;
    srv->npeers = srv->ndead = 0;
}
