/* SPDX-License-Identifier: Apache-2.0 */
/* CPU lists (engine.h, `cpus`): every malformed list, out-of-range number and CPU this process
 * may not run on is refused with a sentence and leaves the output alone; lists are read in the
 * order given and written back with runs as ranges; a thread started on a list runs where its
 * ordinal says from the start and carries its name; a thread moved off its CPU runs on another and
 * keeps the CPUs it had. */
#include <criterion/criterion.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/cpus.h"

TestSuite(cpus, .timeout = 30);

/* The CPUs this process may run on: the first, the last, and the first one it may not (or -1). */
static void allowed(int *first, int *last, int *missing)
{
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    *first = *last = *missing = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) {
            *first = *first < 0 ? c : *first;
            *last = c;
        } else if (*missing < 0) {
            *missing = c;
        }
    cr_assert_geq(*first, 0);
}

Test(cpus, refuses_what_is_not_a_list_of_cpus_it_may_run_on)
{
    int first, last, missing;
    allowed(&first, &last, &missing);
    char unallowed[16], reversed[32], huge[(KVB_CPUS_MAX + 1) * 6]; /* CPUs < 1024: 4 digits */
    snprintf(unallowed, sizeof unallowed, "%d", missing);
    snprintf(reversed, sizeof reversed, "%d-%d", first + 1, first);
    /* KVB_CPUS_MAX + 1 entries, each one this process may run on: too many. */
    size_t len = 0;
    for (int i = 0; i <= KVB_CPUS_MAX && len < sizeof huge; i++)
        len += (size_t)snprintf(huge + len, sizeof huge - len, "%s%d", i ? "," : "", first);
    cr_assert_lt(len, sizeof huge);
    const char *bad[] = {"",
                         "x",
                         "0-",
                         "-1",
                         "0,,0",
                         "0,",
                         ",0",
                         "0 ",
                         " 0",
                         "0;1",
                         "0x1",
                         "1024",
                         "0-1024",
                         "99999999999999999999",
                         reversed,
                         huge,
                         missing >= 0 ? unallowed : "x"};
    kvb_cpus_t c;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        memset(&c, 0x5a, sizeof c);
        char err[160] = "";
        cr_expect_eq(kvb__cpus_parse(bad[i], &c, err, sizeof err), -1, "\"%.40s\" accepted",
                     bad[i]);
        cr_expect_gt(strlen(err), 10, "\"%.40s\": no reason given", bad[i]);
        cr_expect_eq(c.n, 0x5a5a5a5a, "\"%.40s\": the output was written", bad[i]);
    }
    char err[160] = "";
    cr_expect_eq(kvb__cpus_parse(NULL, &c, err, sizeof err), -1);
    if (missing >= 0) {
        cr_expect_eq(kvb__cpus_parse(unallowed, &c, err, sizeof err), -1);
        cr_expect(strstr(err, "may run on"), "%s", err);
    }
}

Test(cpus, reads_in_order_and_writes_runs_as_ranges)
{
    int first, last, missing;
    allowed(&first, &last, &missing);
    char list[64], err[160] = "";
    snprintf(list, sizeof list, "%d,%d-%d,%d", last, first, last, first);
    kvb_cpus_t c;
    cr_assert_eq(kvb__cpus_parse(list, &c, err, sizeof err), 0, "%s", err);
    cr_assert_eq(c.n, 2 + (last - first + 1));
    cr_expect_eq(c.cpu[0], last);
    cr_expect_eq(c.cpu[1], first);
    cr_expect_eq(c.cpu[c.n - 1], first);

    kvb_cpus_t w = {.n = 7, .cpu = {0, 1, 2, 3, 8, 5, 6}};
    char out[64];
    cr_expect_eq(kvb__cpus_format(&w, out, sizeof out), strlen("0-3,8,5-6"));
    cr_expect_str_eq(out, "0-3,8,5-6");
    kvb_cpus_t one = {.n = 2, .cpu = {1, 1}};
    kvb__cpus_format(&one, out, sizeof out);
    cr_expect_str_eq(out, "1,1");
    kvb_cpus_t none = {.n = 0};
    cr_expect_eq(kvb__cpus_format(&none, out, sizeof out), 0);
    cr_expect_str_eq(out, "");
    /* Cut short: what fits, terminated; the length it needed all the same. */
    char small[5];
    cr_expect_eq(kvb__cpus_format(&w, small, sizeof small), strlen("0-3,8,5-6"));
    cr_expect_str_eq(small, "0-3");
    cr_expect_eq(kvb__cpus_format(&w, NULL, 0), strlen("0-3,8,5-6"));
}

typedef struct {
    char name[16];
    cpu_set_t set;
} seen_t;

static void *report(void *arg)
{
    seen_t *s = arg;
    pthread_getname_np(pthread_self(), s->name, sizeof s->name);
    sched_getaffinity(0, sizeof s->set, &s->set);
    return NULL;
}

Test(cpus, a_thread_runs_where_its_ordinal_says_and_is_named)
{
    int first, last, missing;
    allowed(&first, &last, &missing);
    kvb_cpus_t c = {.n = 2, .cpu = {(uint16_t)last, (uint16_t)first}};
    for (int ordinal = -1; ordinal < 3; ordinal++) {
        seen_t s;
        memset(&s, 0, sizeof s);
        pthread_t t;
        cr_assert_eq(kvb__thread_create(&t, &c, ordinal, "kvb-test", ordinal, report, &s), 0);
        cr_assert_eq(pthread_join(t, NULL), 0);
        char want[16] = "kvb-test";
        if (ordinal >= 0)
            snprintf(want, sizeof want, "kvb-test-%d", ordinal);
        cr_expect_str_eq(s.name, want);
        if (ordinal < 0) { /* no ordinal: wherever this process may run */
            cpu_set_t mine;
            cr_assert_eq(sched_getaffinity(0, sizeof mine, &mine), 0);
            cr_expect(CPU_EQUAL(&s.set, &mine));
            continue;
        }
        cr_expect_eq(CPU_COUNT(&s.set), 1, "ordinal %d", ordinal);
        cr_expect(CPU_ISSET(c.cpu[ordinal % 2], &s.set), "ordinal %d", ordinal);
    }
    /* No list: unbound, still named; a name too long for a thread cut to fit, its index kept. */
    seen_t s;
    memset(&s, 0, sizeof s);
    pthread_t t;
    cr_assert_eq(kvb__thread_create(&t, NULL, 0, "kvb-a-long-name", 12345, report, &s), 0);
    cr_assert_eq(pthread_join(t, NULL), 0);
    cr_expect_str_eq(s.name, "kvb-a-long-2345");
    cpu_set_t mine;
    cr_assert_eq(sched_getaffinity(0, sizeof mine, &mine), 0);
    cr_expect(CPU_EQUAL(&s.set, &mine));
}

/* Threads per side of a stream count the CPUs this process may run on (a cpuset, taskset), not
 * the host's: half of them, at most one per stream, at least one. */
Test(cpus, threads_per_side_follow_the_usable_cpus)
{
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    int cpus = CPU_COUNT(&set), half = cpus / 2 < 1 ? 1 : cpus / 2;
    cr_assert_eq(kvb__cpus_usable(), cpus);
    cr_expect_eq(kvb__threads_per_side(0), 1);
    cr_expect_eq(kvb__threads_per_side(1), 1);
    cr_expect_eq(kvb__threads_per_side(16), half < 16 ? half : 16);
    /* Down to one CPU: one thread, whatever the streams. */
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) {
            CPU_SET(c, &one);
            break;
        }
    cr_assert_eq(sched_setaffinity(0, sizeof one, &one), 0);
    cr_expect_eq(kvb__cpus_usable(), 1);
    cr_expect_eq(kvb__threads_per_side(2), 1);
    cr_assert_eq(sched_setaffinity(0, sizeof set, &set), 0);
}

/* Moving off a CPU: the thread then runs on another and may again run on every CPU it could
 * before; bound to one CPU, it stays there with its CPUs unchanged. */
Test(cpus, a_thread_moves_off_its_cpu_and_keeps_its_cpus)
{
    cpu_set_t mine, now;
    cr_assert_eq(sched_getaffinity(0, sizeof mine, &mine), 0);
    cr_expect_not(kvb__thread_move_off(-1));
    cr_expect_not(kvb__thread_move_off(CPU_SETSIZE));
    if (CPU_COUNT(&mine) >= 2) {
        /* The scheduler may move this thread between reading its CPU and the call (false then):
         * a few tries. */
        bool moved = false;
        for (int i = 0; i < 100 && !moved; i++)
            moved = kvb__thread_move_off(sched_getcpu());
        cr_expect(moved);
        cr_assert_eq(sched_getaffinity(0, sizeof now, &now), 0);
        cr_expect(CPU_EQUAL(&now, &mine));
    }
    int here = sched_getcpu();
    cr_assert_geq(here, 0);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(here, &one);
    cr_assert_eq(sched_setaffinity(0, sizeof one, &one), 0);
    cr_expect_not(kvb__thread_move_off(here));
    cr_expect_eq(sched_getcpu(), here);
    cr_assert_eq(sched_getaffinity(0, sizeof now, &now), 0);
    cr_expect(CPU_EQUAL(&now, &one));
    cr_assert_eq(sched_setaffinity(0, sizeof mine, &mine), 0);
}
