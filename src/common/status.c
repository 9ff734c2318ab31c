/* SPDX-License-Identifier: Apache-2.0 */
/* Names and messages of the status codes, generated from KVB_STATUS_MAP. */
#include "kvbridge/status.h"

const char *kvb_strerror(int status)
{
    switch (status) {
#define KVB_STATUS_MSG(name, value, msg)                                                           \
    case value:                                                                                    \
        return msg;
        KVB_STATUS_MAP(KVB_STATUS_MSG)
#undef KVB_STATUS_MSG
    }
    return "unknown status code";
}

const char *kvb_status_name(int status)
{
    switch (status) {
#define KVB_STATUS_NAME(name, value, msg)                                                          \
    case value:                                                                                    \
        return #name;
        KVB_STATUS_MAP(KVB_STATUS_NAME)
#undef KVB_STATUS_NAME
    }
    return "UNKNOWN";
}
