/* SPDX-License-Identifier: Apache-2.0 */
/* HTTP helpers of the PD servers: body gathering under a limit and JSON/text/error answers. */
#include "pd/http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvb__http_body_t *kvb__http_body_start(struct MHD_Connection *conn, size_t limit)
{
    kvb__http_body_t *b = calloc(1, sizeof *b);
    const char *cl =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (b && cl && strtoull(cl, NULL, 10) > limit)
        b->too_large = true;
    return b;
}

void kvb__http_body_feed(kvb__http_body_t *b, const char *data, size_t n, size_t limit)
{
    if (b->too_large || b->nomem)
        return;
    /* Checked against the limit before any size arithmetic, so nothing here can overflow. */
    if (n > limit || b->len > limit - n) {
        b->too_large = true;
        return;
    }
    if (b->len + n + 1 > b->cap) {
        size_t ncap = b->cap ? b->cap : 1024;
        while (ncap < b->len + n + 1)
            ncap *= 2;
        char *p = realloc(b->data, ncap);
        if (!p) {
            b->nomem = true;
            return;
        }
        b->data = p;
        b->cap = ncap;
    }
    memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void kvb__http_body_free(kvb__http_body_t *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

enum MHD_Result kvb__http_text(struct MHD_Connection *conn, unsigned status, const char *ctype,
                               const char *text, size_t len)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)text, MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

enum MHD_Result kvb__http_json(struct MHD_Connection *conn, unsigned status, json_t *obj)
{
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!s) { /* out of memory: still say something rather than drop the connection */
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}";
        return kvb__http_text(conn, 500, "application/json", oom, sizeof oom - 1);
    }
    enum MHD_Result ret = kvb__http_text(conn, status, "application/json", s, strlen(s));
    free(s);
    return ret;
}

const char *kvb__http_error_type(unsigned status)
{
    switch (status) {
    case 400:
        return "invalid_request_error";
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 405:
        return "method_not_allowed";
    case 409:
        return "conflict_error";
    case 413:
        return "request_too_large";
    case 502:
        return "upstream_error";
    case 503:
        return "unavailable_error";
    case 504:
        return "timeout_error";
    default:
        return "server_error";
    }
}

enum MHD_Result kvb__http_error(struct MHD_Connection *conn, unsigned status, const char *msg)
{
    json_t *o = json_pack("{s:{s:s,s:s}}", "error", "message", msg ? msg : "error", "type",
                          kvb__http_error_type(status));
    return kvb__http_json(conn, status, o);
}

enum MHD_Result kvb__http_error_ex(struct MHD_Connection *conn, unsigned status, const char *msg,
                                   const char *reason, unsigned retry_after_s)
{
    json_t *o = json_pack("{s:{s:s,s:s,s:s*}}", "error", "message", msg ? msg : "error", "type",
                          kvb__http_error_type(status), "reason", reason);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s)
        return kvb__http_error(conn, status, msg);
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(s);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (retry_after_s) {
        char ra[16];
        snprintf(ra, sizeof ra, "%u", retry_after_s);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}
