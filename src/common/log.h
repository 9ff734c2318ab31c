/* SPDX-License-Identifier: Apache-2.0 */
/* Minimal leveled logging to stderr. Errors are logged once, where they are decided. */
#ifndef KVB_COMMON_LOG_H
#define KVB_COMMON_LOG_H

enum { KVB_LOG_ERROR = 0, KVB_LOG_WARN = 1, KVB_LOG_INFO = 2, KVB_LOG_DEBUG = 3 };

int kvb__log_level(void);
void kvb__log(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define KVB_LOG(level, ...)                                                                        \
    do {                                                                                           \
        if ((level) <= kvb__log_level())                                                           \
            kvb__log((level), __FILE__, __LINE__, __VA_ARGS__);                                    \
    } while (0)
#define KVB_ERROR(...) KVB_LOG(KVB_LOG_ERROR, __VA_ARGS__)
#define KVB_WARN(...)  KVB_LOG(KVB_LOG_WARN, __VA_ARGS__)
#define KVB_INFO(...)  KVB_LOG(KVB_LOG_INFO, __VA_ARGS__)
#define KVB_DEBUG(...) KVB_LOG(KVB_LOG_DEBUG, __VA_ARGS__)

#endif
