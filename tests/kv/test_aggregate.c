/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for src/kv/aggregate.c: fan-in completion, duplicates and late notices ignored, first
 * error wins, deadlines, argument checks, and memory bounded by max_active + max_finished. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kv/aggregate.h"
#include "kvbridge/status.h"

#define NEVER UINT64_MAX

static kvb_agg_t *agg;

static void setup(void)
{
    cr_assert_eq(kvb__agg_create(8, 4, &agg), KVB_OK);
}

static void teardown(void)
{
    kvb__agg_destroy(agg);
}

TestSuite(aggregate, .init = setup, .fini = teardown, .timeout = 30);

static void expect_state(const char *id, uint64_t now, int want, int want_err)
{
    int err = 12345;
    int st = kvb__agg_poll(agg, id, now, &err);
    cr_assert_eq(st, want, "%s: state %d want %d", id, st, want);
    if (st >= 0)
        cr_assert_eq(err, want_err, "%s: error %s want %s", id, kvb_status_name(err),
                     kvb_status_name(want_err));
}

Test(aggregate, single_sender_done)
{
    uint32_t s[] = {3};
    cr_assert_eq(kvb__agg_expect(agg, "req-1", s, 1, NEVER), KVB_OK);
    expect_state("req-1", 0, KVB_AGG_PENDING, KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "req-1", 3, KVB_OK, 10), KVB_AGG_COUNTED);
    expect_state("req-1", 10, KVB_AGG_DONE, KVB_OK);
}

Test(aggregate, fan_in_waits_for_every_sender_in_any_order)
{
    uint32_t s[] = {0, 1, 2, 3};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 4, NEVER), KVB_OK);
    uint32_t order[] = {2, 0, 3};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(kvb__agg_add(agg, "r", order[i], KVB_OK, 1), KVB_AGG_COUNTED);
        expect_state("r", 1, KVB_AGG_PENDING, KVB_OK);
    }
    cr_assert_eq(kvb__agg_add(agg, "r", 1, KVB_OK, 1), KVB_AGG_COUNTED);
    expect_state("r", 1, KVB_AGG_DONE, KVB_OK);
}

Test(aggregate, duplicates_do_not_count)
{
    uint32_t s[] = {5, 9};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 2, NEVER), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 9, KVB_OK, 1), KVB_AGG_COUNTED);
    cr_assert_eq(kvb__agg_add(agg, "r", 9, KVB_OK, 2), KVB_AGG_DUPLICATE);
    cr_assert_eq(kvb__agg_add(agg, "r", 9, KVB_ERR_PEER_LOST, 3), KVB_AGG_DUPLICATE,
                 "a sender's first word stands");
    expect_state("r", 3, KVB_AGG_PENDING, KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 5, KVB_OK, 4), KVB_AGG_COUNTED);
    expect_state("r", 4, KVB_AGG_DONE, KVB_OK);
}

Test(aggregate, first_error_fails_the_request)
{
    uint32_t s[] = {0, 1, 2};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 3, NEVER), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 1), KVB_AGG_COUNTED);
    cr_assert_eq(kvb__agg_add(agg, "r", 2, KVB_ERR_REMOTE_NOT_REGISTERED, 2), KVB_AGG_COUNTED);
    expect_state("r", 2, KVB_AGG_FAILED, KVB_ERR_REMOTE_NOT_REGISTERED);
    cr_assert_eq(kvb__agg_add(agg, "r", 1, KVB_ERR_PEER_LOST, 3), KVB_AGG_LATE);
    expect_state("r", 3, KVB_AGG_FAILED, KVB_ERR_REMOTE_NOT_REGISTERED);
}

Test(aggregate, deadline_times_out)
{
    uint32_t s[] = {0, 1};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 2, 1000), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 999), KVB_AGG_COUNTED);
    expect_state("r", 999, KVB_AGG_PENDING, KVB_OK);
    expect_state("r", 1000, KVB_AGG_TIMEOUT, KVB_ERR_TIMEOUT);
    cr_assert_eq(kvb__agg_add(agg, "r", 1, KVB_OK, 1001), KVB_AGG_LATE);
    expect_state("r", 5, KVB_AGG_TIMEOUT, KVB_ERR_TIMEOUT); /* terminal states stay */
}

Test(aggregate, notice_at_the_deadline_is_late)
{
    uint32_t s[] = {0};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 1, 1000), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 1000), KVB_AGG_LATE);
    expect_state("r", 1000, KVB_AGG_TIMEOUT, KVB_ERR_TIMEOUT);
}

Test(aggregate, done_before_deadline_stays_done)
{
    uint32_t s[] = {0};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 1, 1000), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 10), KVB_AGG_COUNTED);
    expect_state("r", 5000, KVB_AGG_DONE, KVB_OK);
}

Test(aggregate, late_duplicates_after_completion_and_release)
{
    uint32_t s[] = {0};
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 1, NEVER), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 1), KVB_AGG_COUNTED);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 2), KVB_AGG_LATE);
    cr_assert_eq(kvb__agg_release(agg, "r"), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 0, KVB_OK, 3), KVB_AGG_LATE, "remembered after release");
    cr_assert_eq(kvb__agg_add(agg, "r", 77, KVB_OK, 3), KVB_AGG_LATE);
    expect_state("r", 3, KVB_ERR_NOT_FOUND, 0);
    cr_assert_eq(kvb__agg_release(agg, "r"), KVB_ERR_NOT_FOUND);
}

Test(aggregate, released_ids_are_forgotten_oldest_first)
{
    /* max_finished 4: after 5 more releases the first id is forgotten; memory stays bounded. */
    uint32_t s[] = {0};
    char id[16];
    for (int i = 0; i < 6; i++) {
        snprintf(id, sizeof id, "r%d", i);
        cr_assert_eq(kvb__agg_expect(agg, id, s, 1, NEVER), KVB_OK);
        cr_assert_eq(kvb__agg_release(agg, id), KVB_OK);
    }
    cr_assert_eq(kvb__agg_add(agg, "r0", 0, KVB_OK, 1), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__agg_add(agg, "r1", 0, KVB_OK, 1), KVB_ERR_NOT_FOUND);
    for (int i = 2; i < 6; i++) {
        snprintf(id, sizeof id, "r%d", i);
        cr_assert_eq(kvb__agg_add(agg, id, 0, KVB_OK, 1), KVB_AGG_LATE, "%s", id);
    }
    /* A forgotten id may be reused; a remembered one may not (its late notices would count). */
    cr_assert_eq(kvb__agg_expect(agg, "r0", s, 1, NEVER), KVB_OK);
    cr_assert_eq(kvb__agg_expect(agg, "r5", s, 1, NEVER), KVB_ERR_BUSY);
}

Test(aggregate, unknown_ids_and_senders)
{
    uint32_t s[] = {1, 2};
    cr_assert_eq(kvb__agg_add(agg, "nope", 1, KVB_OK, 1), KVB_ERR_NOT_FOUND);
    expect_state("nope", 1, KVB_ERR_NOT_FOUND, 0);
    cr_assert_eq(kvb__agg_release(agg, "nope"), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 2, NEVER), KVB_OK);
    cr_assert_eq(kvb__agg_add(agg, "r", 3, KVB_OK, 1), KVB_ERR_INVALID_ARG,
                 "not an expected sender");
    cr_assert_eq(kvb__agg_add(agg, NULL, 1, KVB_OK, 1), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__agg_add(NULL, "r", 1, KVB_OK, 1), KVB_ERR_NOT_FOUND);
    expect_state("r", 1, KVB_AGG_PENDING, KVB_OK);
    cr_assert_eq(kvb__agg_poll(agg, "r", 1, NULL), KVB_AGG_PENDING, "error out-param optional");
}

Test(aggregate, expect_argument_checks)
{
    uint32_t s[] = {1, 2, 1};
    char id[KVB_AGG_ID_MAX + 2];
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 3, NEVER), KVB_ERR_INVALID_ARG, "sender twice");
    cr_assert_eq(kvb__agg_expect(agg, "r", s, 0, NEVER), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_expect(agg, "r", NULL, 1, NEVER), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_expect(agg, "r", s, KVB_AGG_SENDERS_MAX + 1, NEVER), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_expect(agg, "", s, 1, NEVER), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_expect(agg, NULL, s, 1, NEVER), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_expect(NULL, "r", s, 1, NEVER), KVB_ERR_INVALID_ARG);
    memset(id, 'x', sizeof id);
    id[KVB_AGG_ID_MAX + 1] = '\0';
    cr_assert_eq(kvb__agg_expect(agg, id, s, 1, NEVER), KVB_ERR_INVALID_ARG, "id one over");
    id[KVB_AGG_ID_MAX] = '\0';
    cr_assert_eq(kvb__agg_expect(agg, id, s, 1, NEVER), KVB_OK, "id at the limit");
    cr_assert_eq(kvb__agg_expect(agg, id, s, 1, NEVER), KVB_ERR_BUSY, "already active");
    cr_assert_eq(kvb__agg_active(agg), 1);
}

Test(aggregate, many_senders)
{
    static uint32_t s[KVB_AGG_SENDERS_MAX];
    for (uint32_t i = 0; i < KVB_AGG_SENDERS_MAX; i++)
        s[i] = KVB_AGG_SENDERS_MAX * 3 - i * 3; /* unsorted, sparse */
    cr_assert_eq(kvb__agg_expect(agg, "big", s, KVB_AGG_SENDERS_MAX, NEVER), KVB_OK);
    for (uint32_t i = 0; i < KVB_AGG_SENDERS_MAX; i++) {
        cr_assert_eq(kvb__agg_add(agg, "big", s[i] + 1, KVB_OK, 1), KVB_ERR_INVALID_ARG);
        cr_assert_eq(kvb__agg_add(agg, "big", s[i], KVB_OK, 1), KVB_AGG_COUNTED);
    }
    expect_state("big", 1, KVB_AGG_DONE, KVB_OK);
}

Test(aggregate, capacity_is_bounded)
{
    uint32_t s[] = {0};
    char id[16];
    for (int i = 0; i < 8; i++) {
        snprintf(id, sizeof id, "a%d", i);
        cr_assert_eq(kvb__agg_expect(agg, id, s, 1, NEVER), KVB_OK);
    }
    cr_assert_eq(kvb__agg_expect(agg, "one-more", s, 1, NEVER), KVB_ERR_BUSY);
    cr_assert_eq(kvb__agg_active(agg), 8);
    cr_assert_eq(kvb__agg_release(agg, "a3"), KVB_OK, "a pending request may be abandoned");
    cr_assert_eq(kvb__agg_active(agg), 7);
    cr_assert_eq(kvb__agg_expect(agg, "one-more", s, 1, NEVER), KVB_OK);
}

Test(aggregate, long_run_stays_bounded)
{
    /* 20000 requests through 8 active slots and 4 tombstones; ASan's leak check runs at exit. */
    uint32_t s[] = {0, 1};
    char id[32];
    for (int i = 0; i < 20000; i++) {
        snprintf(id, sizeof id, "req-%d", i);
        cr_assert_eq(kvb__agg_expect(agg, id, s, 2, (uint64_t)i + 100), KVB_OK);
        if (i % 3)
            kvb__agg_add(agg, id, 0, KVB_OK, (uint64_t)i);
        if (i % 5)
            kvb__agg_add(agg, id, 1, i % 7 ? KVB_OK : KVB_ERR_PEER_LOST, (uint64_t)i);
        int st = kvb__agg_poll(agg, id, (uint64_t)i + (i % 11 ? 0 : 200), NULL);
        cr_assert_geq(st, KVB_AGG_PENDING);
        cr_assert_eq(kvb__agg_release(agg, id), KVB_OK);
        cr_assert_eq(kvb__agg_active(agg), 0);
    }
}

Test(aggregate, create_checks)
{
    kvb_agg_t *a = NULL;
    cr_assert_eq(kvb__agg_create(0, 4, &a), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_create(4, 4, NULL), KVB_ERR_INVALID_ARG);
    cr_assert_eq(kvb__agg_create(SIZE_MAX, 4, &a), KVB_ERR_INVALID_ARG);
    cr_assert_null(a);
    cr_assert_eq(kvb__agg_create(1, 0, &a), KVB_OK, "no tombstones");
    uint32_t s[] = {0};
    cr_assert_eq(kvb__agg_expect(a, "x", s, 1, NEVER), KVB_OK);
    cr_assert_eq(kvb__agg_release(a, "x"), KVB_OK);
    cr_assert_eq(kvb__agg_add(a, "x", 0, KVB_OK, 1), KVB_ERR_NOT_FOUND);
    kvb__agg_destroy(a);
    kvb__agg_destroy(NULL);
    cr_assert_eq(kvb__agg_active(NULL), 0);
}
