/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the status table: every code in KVB_STATUS_MAP has its own name and message, unknown
 * codes get generic text, and KVB_IS_PEER_ERROR covers exactly the peer range. */
#include <criterion/criterion.h>
#include <limits.h>
#include <string.h>

#include "kvbridge/status.h"

typedef struct {
    int value;
    const char *name; /* as written in the map, without the KVB_ prefix */
    const char *msg;
} entry_t;

static const entry_t entries[] = {
#define XX(name, value, msg) {value, #name, msg},
    KVB_STATUS_MAP(XX)
#undef XX
};
#define N_ENTRIES (sizeof entries / sizeof entries[0])

/* Codes that are not in the map, including ones inside each range and at the int extremes. */
static const int unknown_codes[] = {1,    2,    100,  -99,   -98,     -107,    -199,
                                    -250, -299, -300, -1000, INT_MIN, INT_MAX, INT_MIN + 1};

static int is_known(int code)
{
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (entries[i].value == code)
            return 1;
    return 0;
}

TestSuite(status, .timeout = 30);

Test(status, map_values_are_distinct)
{
    for (size_t i = 0; i < N_ENTRIES; i++)
        for (size_t j = i + 1; j < N_ENTRIES; j++)
            cr_assert_neq(entries[i].value, entries[j].value, "%s and %s share value %d",
                          entries[i].name, entries[j].name, entries[i].value);
}

Test(status, ok_is_zero_and_errors_are_negative)
{
    cr_assert_eq(KVB_OK, 0);
    for (size_t i = 0; i < N_ENTRIES; i++) {
        if (strcmp(entries[i].name, "OK") == 0)
            cr_assert_eq(entries[i].value, 0);
        else
            cr_assert_lt(entries[i].value, 0, "%s is %d", entries[i].name, entries[i].value);
    }
}

Test(status, every_code_has_its_own_name)
{
    for (size_t i = 0; i < N_ENTRIES; i++) {
        const char *name = kvb_status_name(entries[i].value);
        cr_assert_not_null(name, "code %d", entries[i].value);
        cr_assert_gt(strlen(name), 0, "code %d", entries[i].value);
        cr_assert_str_eq(name, entries[i].name, "code %d", entries[i].value);
        for (size_t j = 0; j < i; j++)
            cr_assert_str_neq(name, kvb_status_name(entries[j].value), "codes %d and %d",
                              entries[i].value, entries[j].value);
    }
}

Test(status, every_code_has_its_own_message)
{
    for (size_t i = 0; i < N_ENTRIES; i++) {
        const char *msg = kvb_strerror(entries[i].value);
        cr_assert_not_null(msg, "code %d", entries[i].value);
        cr_assert_gt(strlen(msg), 0, "code %d", entries[i].value);
        cr_assert_str_eq(msg, entries[i].msg, "code %d", entries[i].value);
        for (size_t j = 0; j < i; j++)
            cr_assert_str_neq(msg, kvb_strerror(entries[j].value), "codes %d and %d",
                              entries[i].value, entries[j].value);
    }
}

Test(status, enum_constants_match_their_names)
{
    /* Spot checks that the generated enum and the generated functions agree. */
    cr_assert_str_eq(kvb_status_name(KVB_OK), "OK");
    cr_assert_str_eq(kvb_status_name(KVB_ERR_PEER_LOST), "ERR_PEER_LOST");
    cr_assert_str_eq(kvb_status_name(KVB_ERR_ACCESS_DENIED), "ERR_ACCESS_DENIED");
    cr_assert_str_eq(kvb_strerror(KVB_OK), "success");
}

Test(status, unknown_codes_get_generic_text)
{
    const char *generic_name = kvb_status_name(unknown_codes[0]);
    const char *generic_msg = kvb_strerror(unknown_codes[0]);
    for (size_t k = 0; k < sizeof unknown_codes / sizeof unknown_codes[0]; k++) {
        int code = unknown_codes[k];
        cr_assert(!is_known(code), "test table lists known code %d", code);
        const char *name = kvb_status_name(code);
        const char *msg = kvb_strerror(code);
        cr_assert_not_null(name, "code %d", code);
        cr_assert_not_null(msg, "code %d", code);
        cr_assert_gt(strlen(name), 0, "code %d", code);
        cr_assert_gt(strlen(msg), 0, "code %d", code);
        /* Generic: the same text for every unknown code, and not any real code's text. */
        cr_assert_str_eq(name, generic_name, "code %d", code);
        cr_assert_str_eq(msg, generic_msg, "code %d", code);
        for (size_t i = 0; i < N_ENTRIES; i++) {
            cr_assert_str_neq(name, entries[i].name, "code %d", code);
            cr_assert_str_neq(msg, entries[i].msg, "code %d", code);
        }
    }
}

Test(status, peer_error_range_boundaries)
{
    cr_assert(!KVB_IS_PEER_ERROR(0));
    cr_assert(!KVB_IS_PEER_ERROR(1));
    cr_assert(!KVB_IS_PEER_ERROR(-1));
    cr_assert(!KVB_IS_PEER_ERROR(-99));
    cr_assert(KVB_IS_PEER_ERROR(-100));
    cr_assert(KVB_IS_PEER_ERROR(-150));
    cr_assert(KVB_IS_PEER_ERROR(-199));
    cr_assert(!KVB_IS_PEER_ERROR(-200));
    cr_assert(!KVB_IS_PEER_ERROR(-299));
    cr_assert(!KVB_IS_PEER_ERROR(INT_MIN));
    cr_assert(!KVB_IS_PEER_ERROR(INT_MAX));
    for (int s = -1000; s <= 1000; s++)
        cr_assert_eq(KVB_IS_PEER_ERROR(s) ? 1 : 0, (s <= -100 && s >= -199) ? 1 : 0, "status %d",
                     s);
}

Test(status, peer_error_classifies_every_code_by_range)
{
    for (size_t i = 0; i < N_ENTRIES; i++) {
        int v = entries[i].value;
        int expect = v <= -100 && v >= -199;
        cr_assert_eq(KVB_IS_PEER_ERROR(v) ? 1 : 0, expect, "%s (%d)", entries[i].name, v);
    }
    /* The connection-fatal codes the engine relies on. */
    cr_assert(KVB_IS_PEER_ERROR(KVB_ERR_PEER_LOST));
    cr_assert(KVB_IS_PEER_ERROR(KVB_ERR_PROTOCOL));
    cr_assert(KVB_IS_PEER_ERROR(KVB_ERR_VERSION));
    cr_assert(KVB_IS_PEER_ERROR(KVB_ERR_PEER_RESTARTED));
    cr_assert(!KVB_IS_PEER_ERROR(KVB_ERR_REMOTE_NOT_REGISTERED));
    cr_assert(!KVB_IS_PEER_ERROR(KVB_ERR_ACCESS_DENIED));
    cr_assert(!KVB_IS_PEER_ERROR(KVB_ERR_TIMEOUT));
}

Test(status, peer_error_macro_evaluates_expressions)
{
    /* The argument is parenthesised: an expression classifies like its value. */
    int base = -50;
    cr_assert(KVB_IS_PEER_ERROR(base * 2));
    cr_assert(!KVB_IS_PEER_ERROR(base - 150));
    cr_assert(KVB_IS_PEER_ERROR(base + -149));
}
