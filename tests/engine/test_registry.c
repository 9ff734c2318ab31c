/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the memory registry (src/engine/registry.c): registration rules, lookups at every
 * boundary, access rights, and the pin protocol that makes unregistering wait for transfers.
 * Leaks and use-after-free in the pin paths are caught when this runs under AddressSanitizer. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/registry.h"

static kvb_registry_t reg;
static int reg_ready;

static void setup(void)
{
    cr_assert_eq(kvb__registry_init(&reg), KVB_OK);
    reg_ready = 1;
}

static void teardown(void)
{
    kvb__registry_fini(&reg);
}

TestSuite(registry, .init = setup, .fini = teardown, .timeout = 30);

/* --- helpers ------------------------------------------------------------------------------ */

#define MISSING KVB_ERR_REMOTE_NOT_REGISTERED

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static int check(uint64_t addr, uint64_t len, unsigned access)
{
    return kvb__registry_check(&reg, addr, len, access, MISSING, NULL);
}

static size_t count_regions(void)
{
    kvb_region_desc_t *v = NULL;
    size_t n = 12345;
    cr_assert_eq(kvb__registry_list(&reg, &v, &n), KVB_OK);
    free(v);
    return n;
}

/* --- add / remove ------------------------------------------------------------------------- */

Test(registry, fixture_initialised)
{
    cr_assert(reg_ready);
    cr_assert_eq(count_regions(), 0);
}

Test(registry, add_list_remove)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x3000, 0x1000, "cpu", KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, "cpu:0", KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x5000, 0x800, "cpu:1", KVB_ACCESS_WRITE), KVB_OK);
    cr_assert_eq(count_regions(), 3);
    cr_assert_eq(check(0x1000, 0x1000, 0), KVB_OK);
    cr_assert_eq(check(0x3000, 0x1000, 0), KVB_OK);
    cr_assert_eq(check(0x5000, 0x800, 0), KVB_OK);

    cr_assert_eq(kvb__registry_remove(&reg, 0x3000, 0), KVB_OK);
    cr_assert_eq(count_regions(), 2);
    cr_assert_eq(check(0x3000, 1, 0), MISSING);
    cr_assert_eq(check(0x1000, 1, 0), KVB_OK);
    cr_assert_eq(check(0x5000, 1, 0), KVB_OK);
    cr_assert_eq(kvb__registry_remove(&reg, 0x3000, 0), KVB_ERR_NOT_FOUND, "removed twice");

    /* The freed range can be registered again. */
    cr_assert_eq(kvb__registry_add(&reg, 0x3000, 0x2000, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(check(0x4fff, 1, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_OK);
    cr_assert_eq(kvb__registry_remove(&reg, 0x3000, 0), KVB_OK);
    cr_assert_eq(kvb__registry_remove(&reg, 0x5000, 0), KVB_OK);
    cr_assert_eq(count_regions(), 0);
}

Test(registry, remove_unknown_address_not_found)
{
    cr_assert_eq(kvb__registry_remove(&reg, 0, 0), KVB_ERR_NOT_FOUND, "empty registry");
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    /* Only the start address names a region. */
    cr_assert_eq(kvb__registry_remove(&reg, 0x1001, 0), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1fff, 0), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__registry_remove(&reg, 0x2000, 0), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__registry_remove(&reg, 0xfff, 0), KVB_ERR_NOT_FOUND);
    cr_assert_eq(kvb__registry_remove(&reg, UINT64_MAX, 0), KVB_ERR_NOT_FOUND);
    cr_assert_eq(count_regions(), 1);
    cr_assert_eq(check(0x1000, 0x1000, 0), KVB_OK);
}

Test(registry, overlap_refused)
{
    const uint64_t A = 0x10000, L = 0x10000; /* [0x10000, 0x20000) */
    cr_assert_eq(kvb__registry_add(&reg, A, L, NULL, KVB_ACCESS_RW), KVB_OK);
    const struct {
        const char *what;
        uint64_t addr, len;
    } cases[] = {
        {"exact", A, L},
        {"partial left", A - 0x1000, 0x2000},
        {"partial left by one byte", A - 0x1000, 0x1001},
        {"partial right", A + L - 0x1000, 0x2000},
        {"partial right by one byte", A + L - 1, 0x1000},
        {"containing", A - 0x1000, L + 0x2000},
        {"containing from start", A, L + 1},
        {"containing to end", A - 1, L + 1},
        {"contained", A + 0x1000, 0x1000},
        {"contained at start", A, 1},
        {"contained at end", A + L - 1, 1},
        {"containing everything", 0, UINT64_MAX},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_assert_eq(kvb__registry_add(&reg, cases[i].addr, cases[i].len, NULL, KVB_ACCESS_RW),
                     KVB_ERR_OVERLAP, "%s", cases[i].what);
    cr_assert_eq(count_regions(), 1);
}

Test(registry, overlap_with_right_neighbour_refused)
{
    /* A new range that starts in a gap must still be checked against the region after it. */
    cr_assert_eq(kvb__registry_add(&reg, 0x10000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x20000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x18000, 0x8001, NULL, KVB_ACCESS_RW), KVB_ERR_OVERLAP);
    cr_assert_eq(kvb__registry_add(&reg, 0x0, 0x10001, NULL, KVB_ACCESS_RW), KVB_ERR_OVERLAP);
    cr_assert_eq(kvb__registry_add(&reg, 0x11000, 0x20000, NULL, KVB_ACCESS_RW), KVB_ERR_OVERLAP,
                 "spans the whole right neighbour");
    /* Exactly filling the gap touches both neighbours and overlaps neither. */
    cr_assert_eq(kvb__registry_add(&reg, 0x11000, 0xF000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(count_regions(), 3);
}

Test(registry, adjacent_allowed)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x10000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x11000, 0x1000, NULL, KVB_ACCESS_READ), KVB_OK,
                 "right neighbour");
    cr_assert_eq(kvb__registry_add(&reg, 0xF000, 0x1000, NULL, KVB_ACCESS_WRITE), KVB_OK,
                 "left neighbour");
    cr_assert_eq(kvb__registry_add(&reg, 0xEFFF, 1, NULL, KVB_ACCESS_RW), KVB_OK, "one byte");
    cr_assert_eq(count_regions(), 4);
    /* Each byte belongs to the right one. */
    cr_assert_eq(check(0xEFFF, 1, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(check(0xFFFF, 1, KVB_ACCESS_WRITE), KVB_OK);
    cr_assert_eq(check(0xFFFF, 1, KVB_ACCESS_READ), KVB_ERR_ACCESS_DENIED);
    cr_assert_eq(check(0x10000, 1, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(check(0x11000, 1, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(check(0x11000, 1, KVB_ACCESS_WRITE), KVB_ERR_ACCESS_DENIED);
}

Test(registry, invalid_arguments_rejected)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0, NULL, KVB_ACCESS_RW), KVB_ERR_INVALID_ARG,
                 "len 0");
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, 0), KVB_ERR_INVALID_ARG, "access 0");
    const unsigned bad_access[] = {4, 5, 7, 8, 0x100, 0x80000000u, ~0u};
    for (size_t i = 0; i < sizeof bad_access / sizeof bad_access[0]; i++)
        cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, bad_access[i]),
                     KVB_ERR_INVALID_ARG, "access 0x%x", bad_access[i]);
    cr_assert_eq(count_regions(), 0, "a rejected add must not register anything");
}

Test(registry, address_overflow_rejected)
{
    cr_assert_eq(kvb__registry_add(&reg, UINT64_MAX, 1, NULL, KVB_ACCESS_RW), KVB_ERR_OVERFLOW);
    cr_assert_eq(kvb__registry_add(&reg, UINT64_MAX - 9, 10, NULL, KVB_ACCESS_RW),
                 KVB_ERR_OVERFLOW);
    cr_assert_eq(kvb__registry_add(&reg, 1, UINT64_MAX, NULL, KVB_ACCESS_RW), KVB_ERR_OVERFLOW);
    cr_assert_eq(kvb__registry_add(&reg, UINT64_MAX, UINT64_MAX, NULL, KVB_ACCESS_RW),
                 KVB_ERR_OVERFLOW);
    cr_assert_eq(count_regions(), 0);
    /* Ending exactly at the top of the address space does not wrap. */
    cr_assert_eq(kvb__registry_add(&reg, UINT64_MAX - 10, 10, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(check(UINT64_MAX - 1, 1, 0), KVB_OK);
    cr_assert_eq(check(UINT64_MAX - 10, 10, 0), KVB_OK);
    cr_assert_eq(check(UINT64_MAX - 1, 2, 0), MISSING, "ends past the region");
    cr_assert_eq(check(UINT64_MAX, 1, 0), MISSING);
    cr_assert_eq(check(UINT64_MAX - 5, UINT64_MAX, 0), MISSING, "wrapping lookup");
    cr_assert_eq(kvb__registry_add(&reg, 0, UINT64_MAX - 10, NULL, KVB_ACCESS_RW), KVB_OK,
                 "everything below it");
    cr_assert_eq(check(0, UINT64_MAX, 0), MISSING, "spans two regions");
}

Test(registry, location_rules)
{
    char loc[KVB_LOCATION_MAX + 2];
    memset(loc, 'x', sizeof loc);
    loc[KVB_LOCATION_MAX + 1] = '\0'; /* one over */
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, loc, KVB_ACCESS_RW), KVB_ERR_INVALID_ARG);
    cr_assert_eq(count_regions(), 0);
    loc[KVB_LOCATION_MAX] = '\0'; /* at the limit, but not a memory kind */
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, loc, KVB_ACCESS_RW), KVB_ERR_INVALID_ARG);
    memcpy(loc, "cpu:", 4);
    memset(loc + 4, '0', KVB_LOCATION_MAX - 5);
    loc[KVB_LOCATION_MAX - 1] = '7'; /* "cpu:000...07", at the limit */
    loc[KVB_LOCATION_MAX] = '\0';
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, loc, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x2000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x3000, 0x1000, "cpu", KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x4000, 0x1000, "*", KVB_ACCESS_RW), KVB_OK);
    /* Device memory is recognised (the engine refuses it unless a data path serves it). */
    cr_assert_eq(kvb__registry_add(&reg, 0x5000, 0x1000, "cuda:3", KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_remove(&reg, 0x5000, 1000), KVB_OK);
    static const char *const bad[] = {"",      "gpu",    "cpu:",   "cpu:x",    "cuda",
                                      "cuda:", "cpu:-1", "cpu:1a", "cuda:1:2", "cpu:99999999",
                                      "CPU:0", " cpu:0", "cpux"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(kvb__registry_add(&reg, 0x6000, 0x1000, bad[i], KVB_ACCESS_RW),
                     KVB_ERR_INVALID_ARG, "location '%s'", bad[i]);

    kvb_region_desc_t *v;
    size_t n;
    cr_assert_eq(kvb__registry_list(&reg, &v, &n), KVB_OK);
    cr_assert_eq(n, 4);
    cr_assert_str_eq(v[0].info.location, loc);
    cr_assert_str_eq(v[1].info.location, "cpu", "NULL location defaults to cpu");
    cr_assert_str_eq(v[2].info.location, "cpu");
    cr_assert_str_eq(v[3].info.location, "*");
    free(v);
    kvb_mem_kind_t kind;
    int dev;
    cr_assert_eq(kvb__mem_kind_parse("cuda:12", &kind, &dev), KVB_OK);
    cr_assert_eq(kind, KVB_MEM_CUDA);
    cr_assert_eq(dev, 12);
    cr_assert_eq(kvb__mem_kind_parse("cpu:1", &kind, &dev), KVB_OK);
    cr_assert_eq(kind, KVB_MEM_CPU);
    cr_assert_eq(dev, 1);
}

/* --- lookups ------------------------------------------------------------------------------ */

Test(registry, lookup_bounds)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(check(0x1000, 0x1000, 0), KVB_OK, "whole region");
    cr_assert_eq(check(0x1000, 1, 0), KVB_OK, "first byte");
    cr_assert_eq(check(0x1fff, 1, 0), KVB_OK, "last byte");
    cr_assert_eq(check(0x1800, 0x800, 0), KVB_OK, "tail");
    cr_assert_eq(check(0x1800, 0x801, 0), MISSING, "straddles the end");
    cr_assert_eq(check(0x1000, 0x1001, 0), MISSING, "one byte too long");
    cr_assert_eq(check(0x2000, 1, 0), MISSING, "one byte past");
    cr_assert_eq(check(0xfff, 1, 0), MISSING, "one byte before");
    cr_assert_eq(check(0xfff, 2, 0), MISSING, "straddles the start");
    cr_assert_eq(check(0, 0x10000, 0), MISSING, "contains the region");
    cr_assert_eq(check(0x1000, 0, 0), MISSING, "zero length");
    cr_assert_eq(check(0x1fff, UINT64_MAX, 0), MISSING, "wrapping length");
    cr_assert_eq(check(0, 1, 0), MISSING);
    cr_assert_eq(check(UINT64_MAX, 1, 0), MISSING);
}

Test(registry, lookup_spanning_two_adjacent_regions_refused)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x2000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(check(0x1fff, 2, 0), MISSING);
    cr_assert_eq(check(0x1000, 0x2000, 0), MISSING);
    cr_assert_eq(check(0x1800, 0x1000, KVB_ACCESS_READ), MISSING);
    cr_assert_eq(check(0x1fff, 1, 0), KVB_OK);
    cr_assert_eq(check(0x2000, 1, 0), KVB_OK);
}

Test(registry, lookup_in_gap_between_regions)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x4000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    cr_assert_eq(check(0x2000, 0x1000, 0), MISSING);
    cr_assert_eq(check(0x3fff, 1, 0), MISSING);
    cr_assert_eq(check(0x3fff, 2, 0), MISSING);
    cr_assert_eq(check(0x5000, 1, 0), MISSING);
}

Test(registry, rights)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x2000, 0x1000, NULL, KVB_ACCESS_WRITE), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x3000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);

    cr_assert_eq(check(0x1000, 8, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(check(0x1000, 8, KVB_ACCESS_WRITE), KVB_ERR_ACCESS_DENIED);
    cr_assert_eq(check(0x1000, 8, KVB_ACCESS_RW), KVB_ERR_ACCESS_DENIED);
    cr_assert_eq(check(0x1000, 8, 0), KVB_OK, "0 asks for nothing");

    cr_assert_eq(check(0x2000, 8, KVB_ACCESS_WRITE), KVB_OK);
    cr_assert_eq(check(0x2000, 8, KVB_ACCESS_READ), KVB_ERR_ACCESS_DENIED);
    cr_assert_eq(check(0x2000, 8, KVB_ACCESS_RW), KVB_ERR_ACCESS_DENIED);

    cr_assert_eq(check(0x3000, 8, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(check(0x3000, 8, KVB_ACCESS_WRITE), KVB_OK);
    cr_assert_eq(check(0x3000, 8, KVB_ACCESS_RW), KVB_OK);

    /* A denied range is not pinned: the region can still be removed at once. */
    kvb_region_t *pin = (kvb_region_t *)(uintptr_t)0x1;
    cr_assert_eq(kvb__registry_check(&reg, 0x1000, 8, KVB_ACCESS_WRITE, MISSING, &pin),
                 KVB_ERR_ACCESS_DENIED);
    cr_assert_eq(pin, (kvb_region_t *)(uintptr_t)0x1, "pin set on failure");
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_OK);
}

Test(registry, missing_code_is_the_callers)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_READ), KVB_OK);
    const int codes[] = {KVB_ERR_LOCAL_NOT_REGISTERED, KVB_ERR_REMOTE_NOT_REGISTERED,
                         KVB_ERR_NOT_FOUND, -12345};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        kvb_region_t *pin = NULL;
        cr_assert_eq(kvb__registry_check(&reg, 0x3000, 1, 0, codes[i], &pin), codes[i]);
        cr_assert_null(pin, "pin set on failure");
        cr_assert_eq(kvb__registry_check(&reg, 0x1fff, 2, KVB_ACCESS_READ, codes[i], &pin),
                     codes[i]);
        cr_assert_null(pin);
        /* Outside the region wins over a rights mismatch. */
        cr_assert_eq(kvb__registry_check(&reg, 0x1fff, 2, KVB_ACCESS_WRITE, codes[i], &pin),
                     codes[i]);
        cr_assert_null(pin);
    }
    /* Empty registry. */
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_OK);
    cr_assert_eq(kvb__registry_check(&reg, 0x1000, 1, 0, KVB_ERR_LOCAL_NOT_REGISTERED, NULL),
                 KVB_ERR_LOCAL_NOT_REGISTERED);
}

/* --- pins --------------------------------------------------------------------------------- */

Test(registry, pin_and_unpin_counts)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_region_t *a = NULL, *b = NULL;
    cr_assert_eq(kvb__registry_check(&reg, 0x1000, 0x10, KVB_ACCESS_READ, MISSING, &a), KVB_OK);
    cr_assert_not_null(a);
    cr_assert_eq(a->addr, 0x1000);
    cr_assert_eq(a->len, 0x1000);
    cr_assert_eq(a->access, KVB_ACCESS_RW);
    cr_assert_str_eq(a->location, "cpu");
    cr_assert_eq(atomic_load(&a->refs), 2);
    cr_assert_eq(kvb__registry_check(&reg, 0x1800, 0x10, KVB_ACCESS_WRITE, MISSING, &b), KVB_OK);
    cr_assert_eq(b, a, "both pins name the same region");
    cr_assert_eq(atomic_load(&a->refs), 3);
    kvb__region_unpin(&reg, b);
    kvb__region_unpin(&reg, a);
    cr_assert_eq(atomic_load(&a->refs), 1);
    /* No pins left: removing does not wait. */
    uint64_t t0 = now_ms();
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 10000), KVB_OK);
    cr_assert_lt(now_ms() - t0, 1000);
}

Test(registry, remove_while_pinned_is_busy_after_timeout)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, "cpu:0", KVB_ACCESS_RW), KVB_OK);
    kvb_region_t *pin = NULL;
    cr_assert_eq(kvb__registry_check(&reg, 0x1000, 0x1000, KVB_ACCESS_RW, MISSING, &pin), KVB_OK);

    uint64_t t0 = now_ms();
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 150), KVB_ERR_BUSY);
    uint64_t waited = now_ms() - t0;
    cr_assert_geq(waited, 140, "gave up after %llu ms, before the timeout",
                  (unsigned long long)waited);
    cr_assert_lt(waited, 5000);

    /* Unregistered: no new lookups find it. But its memory may still be in use, so nothing may
     * be registered over it, and asking again waits again (still BUSY while pinned). */
    cr_assert_eq(check(0x1000, 1, 0), MISSING);
    cr_assert_eq(count_regions(), 0);
    cr_assert(kvb__registry_overlaps(&reg, 0x1800, 1), "a draining region still counts");
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x800, NULL, KVB_ACCESS_READ), KVB_ERR_OVERLAP);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_ERR_BUSY);
    cr_assert_eq(pin->addr, 0x1000);
    cr_assert_str_eq(pin->location, "cpu:0");
    kvb__region_unpin(&reg, pin);
    /* Now the caller learns that the memory is free, and the range may be registered again. */
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_OK);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_ERR_NOT_FOUND);
    cr_assert_not(kvb__registry_overlaps(&reg, 0x1800, 1));
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x800, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(check(0x1000, 0x800, KVB_ACCESS_READ), KVB_OK, "new region unaffected");
}

Test(registry, remove_while_pinned_zero_timeout_is_busy_at_once)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    kvb_region_t *p1 = NULL, *p2 = NULL;
    cr_assert_eq(kvb__registry_check(&reg, 0x1000, 1, 0, MISSING, &p1), KVB_OK);
    cr_assert_eq(kvb__registry_check(&reg, 0x1001, 1, 0, MISSING, &p2), KVB_OK);
    uint64_t t0 = now_ms();
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_ERR_BUSY);
    cr_assert_lt(now_ms() - t0, 1000);
    /* The registration's reference stays with the draining region until a remove succeeds. */
    kvb__region_unpin(&reg, p1);
    cr_assert_eq(atomic_load(&p2->refs), 2);
    kvb__region_unpin(&reg, p2);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_OK);
}

typedef struct {
    kvb_region_t *pins[4];
    int npins;
    int delay_ms;
} unpinner_t;

static void *unpin_later(void *arg)
{
    unpinner_t *u = arg;
    for (int i = 0; i < u->npins; i++) {
        sleep_ms(u->delay_ms);
        kvb__region_unpin(&reg, u->pins[i]);
    }
    return NULL;
}

Test(registry, remove_waits_for_unpin_from_another_thread)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    unpinner_t u = {.npins = 1, .delay_ms = 100};
    cr_assert_eq(kvb__registry_check(&reg, 0x1000, 8, 0, MISSING, &u.pins[0]), KVB_OK);
    pthread_t t;
    uint64_t t0 = now_ms();
    cr_assert_eq(pthread_create(&t, NULL, unpin_later, &u), 0);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 10000), KVB_OK);
    uint64_t waited = now_ms() - t0;
    pthread_join(t, NULL);
    cr_assert_geq(waited, 90, "returned after %llu ms, before the unpin",
                  (unsigned long long)waited);
    cr_assert_lt(waited, 5000, "woken late: %llu ms", (unsigned long long)waited);
    cr_assert_eq(count_regions(), 0);
}

Test(registry, remove_without_timeout_waits_for_every_pin)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    unpinner_t u = {.npins = 3, .delay_ms = 30};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvb__registry_check(&reg, 0x1000 + (uint64_t)i, 8, 0, MISSING, &u.pins[i]),
                     KVB_OK);
    pthread_t t;
    uint64_t t0 = now_ms();
    cr_assert_eq(pthread_create(&t, NULL, unpin_later, &u), 0);
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, -1), KVB_OK);
    uint64_t waited = now_ms() - t0;
    pthread_join(t, NULL);
    cr_assert_geq(waited, 80, "returned after %llu ms, before the last unpin",
                  (unsigned long long)waited);
}

/* One helper thread drops the last pin at the moment the main thread removes the region, many
 * times over: every interleaving of the unpin and the remover's check must end with KVB_OK, the
 * region freed exactly once and nothing touched after it is freed. */
typedef struct {
    pthread_barrier_t go;
    kvb_region_t *pin;
    int rounds;
} racer_t;

static void *race_unpin(void *arg)
{
    racer_t *rc = arg;
    for (int i = 0; i < rc->rounds; i++) {
        pthread_barrier_wait(&rc->go);
        kvb__region_unpin(&reg, rc->pin);
        pthread_barrier_wait(&rc->go);
    }
    return NULL;
}

Test(registry, remove_racing_last_unpin)
{
    racer_t rc = {.rounds = 3000};
    cr_assert_eq(pthread_barrier_init(&rc.go, NULL, 2), 0);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, race_unpin, &rc), 0);
    for (int i = 0; i < rc.rounds; i++) {
        cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
        cr_assert_eq(kvb__registry_check(&reg, 0x1000, 1, 0, MISSING, &rc.pin), KVB_OK);
        pthread_barrier_wait(&rc.go);
        int r = kvb__registry_remove(&reg, 0x1000, -1);
        pthread_barrier_wait(&rc.go);
        cr_assert_eq(r, KVB_OK, "round %d", i);
    }
    pthread_join(t, NULL);
    pthread_barrier_destroy(&rc.go);
}

/* Readers pin and unpin a region in a loop while it is removed; the remove must return once the
 * in-flight pins drain, and readers must then see it as missing. */
typedef struct {
    atomic_int pins_done;
    atomic_bool saw_missing;
    atomic_int errors; /* Criterion asserts belong on the test's own thread */
} reader_t;

static void *reader_loop(void *arg)
{
    reader_t *rd = arg;
    for (;;) {
        kvb_region_t *pin = NULL;
        int rc = kvb__registry_check(&reg, 0x1000, 0x100, KVB_ACCESS_READ, MISSING, &pin);
        if (rc == MISSING) {
            atomic_store(&rd->saw_missing, true);
            return NULL;
        }
        if (rc != KVB_OK || pin == NULL || pin->addr != 0x1000) {
            atomic_fetch_add(&rd->errors, 1);
            return NULL;
        }
        atomic_fetch_add(&rd->pins_done, 1);
        kvb__region_unpin(&reg, pin);
    }
}

Test(registry, remove_while_readers_pin)
{
    cr_assert_eq(kvb__registry_add(&reg, 0x1000, 0x1000, NULL, KVB_ACCESS_RW), KVB_OK);
    reader_t rd;
    atomic_init(&rd.pins_done, 0);
    atomic_init(&rd.saw_missing, false);
    atomic_init(&rd.errors, 0);
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, reader_loop, &rd), 0);
    while (atomic_load(&rd.pins_done) < 10000 && atomic_load(&rd.errors) == 0)
        sched_yield();
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 10000), KVB_OK);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    cr_assert_eq(atomic_load(&rd.errors), 0);
    cr_assert(atomic_load(&rd.saw_missing));
}

/* --- snapshots and scale ------------------------------------------------------------------ */

Test(registry, list_snapshot_sorted_and_independent)
{
    kvb_region_desc_t *v = (kvb_region_desc_t *)(uintptr_t)0x1;
    size_t n = 99;
    cr_assert_eq(kvb__registry_list(&reg, &v, &n), KVB_OK);
    cr_assert_eq(n, 0);
    free(v);

    const uint64_t addrs[] = {0x9000, 0x1000, 0x5000, 0x3000, 0x7000};
    for (size_t i = 0; i < 5; i++)
        cr_assert_eq(kvb__registry_add(&reg, addrs[i], 0x100 * (i + 1), i % 2 ? "cpu:1" : NULL,
                                       1 + (unsigned)(i % 3)),
                     KVB_OK);
    cr_assert_eq(kvb__registry_list(&reg, &v, &n), KVB_OK);
    cr_assert_eq(n, 5);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(v[i].info.addr, 0x1000 + 0x2000 * i, "entry %zu", i);
        size_t src = 0;
        while (addrs[src] != v[i].info.addr)
            src++;
        cr_assert_eq(v[i].info.len, 0x100 * (src + 1));
        cr_assert_eq(v[i].info.access, 1 + (unsigned)(src % 3));
        cr_assert_str_eq(v[i].info.location, src % 2 ? "cpu:1" : "cpu");
    }
    /* Later changes do not reach a snapshot already taken. */
    cr_assert_eq(kvb__registry_remove(&reg, 0x1000, 0), KVB_OK);
    cr_assert_eq(kvb__registry_add(&reg, 0x0, 0x10, NULL, KVB_ACCESS_READ), KVB_OK);
    cr_assert_eq(v[0].info.addr, 0x1000);
    cr_assert_eq(v[0].info.len, 0x200);
    free(v);
}

Test(registry, many_regions_random_order)
{
    enum { N = 1000 };
    const uint64_t base = 0x7f0000000000ull, stride = 0x3000;
    size_t order[N];
    for (size_t i = 0; i < N; i++)
        order[i] = i;
    uint64_t seed = 0xA5A5A5A5DEADBEEFull;
    for (size_t i = N - 1; i > 0; i--) {
        size_t j = (size_t)(rng_next(&seed) % (i + 1));
        size_t tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
#define REG_ADDR(i) (base + (uint64_t)(i)*stride)
#define REG_LEN(i)  (0x1000 + ((uint64_t)(i) % 3) * 0x800) /* leaves a gap before the next */
#define REG_ACC(i)  (1 + (unsigned)((i) % 3))
    for (size_t k = 0; k < N; k++) {
        size_t i = order[k];
        cr_assert_eq(kvb__registry_add(&reg, REG_ADDR(i), REG_LEN(i), NULL, REG_ACC(i)), KVB_OK,
                     "region %zu", i);
    }
    /* Overlaps are still found among many. */
    for (size_t k = 0; k < 50; k++) {
        size_t i = order[k];
        cr_assert_eq(kvb__registry_add(&reg, REG_ADDR(i) + 1, 1, NULL, KVB_ACCESS_RW),
                     KVB_ERR_OVERLAP);
        cr_assert_eq(kvb__registry_add(&reg, REG_ADDR(i) - 1, 2, NULL, KVB_ACCESS_RW),
                     KVB_ERR_OVERLAP, "region %zu", i);
        cr_assert_eq(
            kvb__registry_add(&reg, REG_ADDR(i) + REG_LEN(i) - 1, stride, NULL, KVB_ACCESS_RW),
            KVB_ERR_OVERLAP, "region %zu", i);
    }

    kvb_region_desc_t *v;
    size_t n;
    cr_assert_eq(kvb__registry_list(&reg, &v, &n), KVB_OK);
    cr_assert_eq(n, N);
    for (size_t i = 0; i < N; i++) {
        cr_assert_eq(v[i].info.addr, REG_ADDR(i));
        cr_assert_eq(v[i].info.len, REG_LEN(i));
        cr_assert_eq(v[i].info.access, REG_ACC(i));
    }
    free(v);

    for (size_t k = 0; k < N; k++) {
        size_t i = order[(k * 7) % N]; /* a different order from the inserts */
        cr_assert_eq(check(REG_ADDR(i), REG_LEN(i), REG_ACC(i)), KVB_OK, "region %zu", i);
        cr_assert_eq(check(REG_ADDR(i) + REG_LEN(i) - 1, 1, 0), KVB_OK);
        cr_assert_eq(check(REG_ADDR(i) + REG_LEN(i), 1, 0), MISSING, "gap after %zu", i);
        cr_assert_eq(check(REG_ADDR(i), REG_LEN(i) + 1, 0), MISSING);
        cr_assert_eq(check(REG_ADDR(i) - 1, 1, 0), MISSING, "gap before %zu", i);
        if (REG_ACC(i) != KVB_ACCESS_RW)
            cr_assert_eq(check(REG_ADDR(i), 1, KVB_ACCESS_RW), KVB_ERR_ACCESS_DENIED);
    }

    /* Remove the odd ones in shuffled order; the even ones must still be found. */
    for (size_t k = 0; k < N; k++)
        if (order[k] % 2)
            cr_assert_eq(kvb__registry_remove(&reg, REG_ADDR(order[k]), 0), KVB_OK);
    cr_assert_eq(count_regions(), N / 2);
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(check(REG_ADDR(i), 1, 0), i % 2 ? MISSING : KVB_OK, "region %zu", i);
#undef REG_ADDR
#undef REG_LEN
#undef REG_ACC
}
