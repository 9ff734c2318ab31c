/* SPDX-License-Identifier: Apache-2.0 */
/* Small HTTP helpers over libmicrohttpd for the PD servers: request bodies gathered under a size
 * limit, and JSON, text and error answers in the format of docs/pd-protocol.md. */
#ifndef KVB_PD_HTTP_H
#define KVB_PD_HTTP_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>

/* A request body as it arrives; `data` is NUL-terminated once anything was added. */
typedef struct {
    char *data;
    size_t len, cap;
    bool too_large; /* more than the limit arrived: the rest is dropped, the answer is 413 */
    bool nomem;
} kvb__http_body_t;

/* A new body for a request whose headers just came (NULL: no memory), marked too large at once
 * when its Content-Length announces more than `limit` bytes: refused before it is sent. */
kvb__http_body_t *kvb__http_body_start(struct MHD_Connection *conn, size_t limit);
/* Appends data[0..n) unless that takes the body over `limit` bytes (then marks it too large). */
void kvb__http_body_feed(kvb__http_body_t *b, const char *data, size_t n, size_t limit);
void kvb__http_body_free(kvb__http_body_t *b);

/* Answers `status` with `obj` serialized (the reference is stolen, also on error). */
enum MHD_Result kvb__http_json(struct MHD_Connection *conn, unsigned status, json_t *obj);

/* Answers `status` with a copy of text[0..len) of content type `ctype`. */
enum MHD_Result kvb__http_text(struct MHD_Connection *conn, unsigned status, const char *ctype,
                               const char *text, size_t len);

/* Answers {"error": {"message": msg, "type": <by status>}} with `status`. */
enum MHD_Result kvb__http_error(struct MHD_Connection *conn, unsigned status, const char *msg);

/* The same with a machine-readable "reason" in the error object (when not NULL) and, when
 * retry_after_s > 0, a Retry-After header. */
enum MHD_Result kvb__http_error_ex(struct MHD_Connection *conn, unsigned status, const char *msg,
                                   const char *reason, unsigned retry_after_s);

/* The error "type" the protocol gives a status ("invalid_request_error", ...). Static. */
const char *kvb__http_error_type(unsigned status);

#endif
