/* SPDX-License-Identifier: Apache-2.0 */
/* Status codes shared by every kvbridge API: one X-macro list generates the enum, the names and
 * the messages, so the three can never disagree. */
#ifndef KVBRIDGE_STATUS_H
#define KVBRIDGE_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the library's public symbols; everything else is hidden in the shared library. */
#define KVB_API __attribute__((visibility("default")))

/* XX(name, value, message). 0 is success, negatives are errors. Ranges:
 *   -1 .. -99    local errors (arguments, resources, registry)
 *   -100 .. -199 peer errors: the connection to that peer is gone or unusable (KVB_IS_PEER_ERROR)
 *   -200 .. -299 per-request errors reported by the remote side; the connection stays up */
#define KVB_STATUS_MAP(XX)                                                                         \
    XX(OK, 0, "success")                                                                           \
    XX(ERR_INVALID_ARG, -1, "invalid argument")                                                    \
    XX(ERR_NOMEM, -2, "out of memory")                                                             \
    XX(ERR_OVERFLOW, -3, "size or address arithmetic overflows")                                   \
    XX(ERR_TIMEOUT, -4, "timed out")                                                               \
    XX(ERR_CANCELED, -5, "canceled")                                                               \
    XX(ERR_AGAIN, -6, "nothing available yet")                                                     \
    XX(ERR_NOT_FOUND, -7, "not found")                                                             \
    XX(ERR_OVERLAP, -8, "region overlaps an existing registration")                                \
    XX(ERR_LOCAL_NOT_REGISTERED, -9, "local address range is not registered")                      \
    XX(ERR_SYSTEM, -10, "system call failed")                                                      \
    XX(ERR_ADDR_IN_USE, -11, "no free port in the configured range")                               \
    XX(ERR_SHUTDOWN, -12, "engine is shutting down")                                               \
    XX(ERR_BAD_SEGMENT, -13, "unknown or closed segment handle")                                   \
    XX(ERR_UNSUPPORTED, -14, "not supported")                                                      \
    XX(ERR_TOO_LARGE, -15, "message or request too large")                                         \
    XX(ERR_BUSY, -16, "resource busy")                                                             \
    XX(ERR_INCOMPATIBLE, -17, "incompatible KV layouts or topology (refused at link time)")        \
    XX(ERR_SEGMENT_NOT_FOUND, -18, "segment not found (no live descriptor in the metadata store)") \
    XX(ERR_META_UNREACHABLE, -19, "metadata store unreachable")                                    \
    XX(ERR_DEVICE, -20, "GPU operation failed (the log has CUDA's message)")                       \
    XX(ERR_PEER_LOST, -100, "peer lost (connection closed or reset)")                              \
    XX(ERR_CONNECT, -101, "cannot connect to peer")                                                \
    XX(ERR_PROTOCOL, -102, "protocol error: malformed or unexpected frame")                        \
    XX(ERR_VERSION, -103, "peer speaks an incompatible protocol version")                          \
    XX(ERR_PEER_RESTARTED, -104, "peer restarted (new incarnation); reopen the segment")           \
    XX(ERR_RESOLVE, -105, "cannot resolve segment address")                                        \
    XX(ERR_AUTH, -106, "peer authentication failed (wrong or missing cluster secret)")             \
    XX(ERR_REMOTE_NOT_REGISTERED, -200, "remote address range is not registered")                  \
    XX(ERR_ACCESS_DENIED, -201, "remote region does not grant this access")                        \
    XX(ERR_REMOTE_NO_SPACE, -202, "peer's notification queue is full")                             \
    XX(ERR_SHM_COPY, -203, "same-host copy to or from the initiator's memory failed")              \
    XX(ERR_REMOTE_DEVICE, -204, "the peer's copy to or from its GPU memory failed")

typedef enum {
#define KVB_STATUS_ENUM(name, value, msg) KVB_##name = value,
    KVB_STATUS_MAP(KVB_STATUS_ENUM)
#undef KVB_STATUS_ENUM
} kvb_status_t;

/* True for errors after which the connection to that peer is gone: every in-flight request on
 * it fails and the segment must be reopened. */
#define KVB_IS_PEER_ERROR(s) ((s) <= -100 && (s) > -200)

/* Human-readable message for a status code; never NULL (unknown codes get a generic text). */
KVB_API const char *kvb_strerror(int status);

/* The code's name without prefix, e.g. "ERR_PEER_LOST"; never NULL. */
KVB_API const char *kvb_status_name(int status);

#ifdef __cplusplus
}
#endif
#endif
