/* SPDX-License-Identifier: Apache-2.0 */
/* CPU lists and the engine's named, optionally pinned, threads (cpus.h). */
#include "common/cpus.h"

#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"

/* A decimal CPU number at *p, below CPU_SETSIZE: 0, advancing *p past it; -1 if there is no
 * number there, -2 if it is too large. */
static int cpu_number(const char **p, unsigned *out)
{
    const char *s = *p;
    unsigned v = 0;
    if (*s < '0' || *s > '9')
        return -1;
    for (; *s >= '0' && *s <= '9'; s++) {
        v = v * 10 + (unsigned)(*s - '0');
        if (v >= CPU_SETSIZE)
            return -2;
    }
    *p = s;
    *out = v;
    return 0;
}

int kvb__cpus_parse(const char *s, kvb_cpus_t *out, char *err, size_t errlen)
{
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof allowed, &allowed)) {
        snprintf(err, errlen, "cannot read the CPUs this process may run on: %s", strerror(errno));
        return -1;
    }
    kvb_cpus_t c; /* built here, copied out only whole */
    c.n = 0;
    const char *p = s ? s : "";
    for (;;) {
        unsigned a, b;
        const char *at = p;
        int bad = cpu_number(&p, &a);
        b = a;
        if (!bad && *p == '-' && (p++, bad = cpu_number(&p, &b), !bad && b < a)) {
            snprintf(err, errlen, "\"%.64s\": the range at \"%.16s\" is not a-b with a <= b", s,
                     at);
            return -1;
        }
        if (bad) {
            snprintf(err, errlen,
                     bad == -2 ? "\"%.64s\": at \"%.16s\", a CPU number over %d"
                               : "\"%.64s\" is not a CPU list such as 0-3,8 (at \"%.16s\")",
                     s ? s : "", at, CPU_SETSIZE - 1);
            return -1;
        }
        for (unsigned cpu = a; cpu <= b; cpu++) {
            if (!CPU_ISSET(cpu, &allowed)) {
                snprintf(err, errlen, "\"%.64s\": CPU %u is not one this process may run on", s,
                         cpu);
                return -1;
            }
            if (c.n == KVB_CPUS_MAX) {
                snprintf(err, errlen, "\"%.64s\" names more than %d CPUs", s, KVB_CPUS_MAX);
                return -1;
            }
            c.cpu[c.n++] = (uint16_t)cpu;
        }
        if (*p == '\0')
            break;
        if (*p++ != ',') {
            snprintf(err, errlen, "\"%.64s\" is not a CPU list such as 0-3,8 (at \"%.16s\")", s,
                     p - 1);
            return -1;
        }
    }
    memcpy(out, &c, sizeof c);
    return 0;
}

size_t kvb__cpus_format(const kvb_cpus_t *c, char *buf, size_t bufsz)
{
    size_t len = 0;
    if (bufsz)
        buf[0] = '\0';
    for (int i = 0; i < c->n;) {
        int j = i;
        while (j + 1 < c->n && c->cpu[j + 1] == c->cpu[j] + 1)
            j++;
        char piece[16];
        int k = j > i ? snprintf(piece, sizeof piece, "%s%u-%u", i ? "," : "", c->cpu[i], c->cpu[j])
                      : snprintf(piece, sizeof piece, "%s%u", i ? "," : "", c->cpu[i]);
        if (len + (size_t)k < bufsz)
            memcpy(buf + len, piece, (size_t)k + 1);
        else if (bufsz)
            buf[len < bufsz ? len : bufsz - 1] = '\0';
        len += (size_t)k;
        i = j + 1;
    }
    return len;
}

typedef struct {
    void *(*fn)(void *);
    void *arg;
    char name[16];
} start_t;

/* Names the thread before it runs its function, so that whatever it does is seen under its name
 * (kvb__thread_create names it too, so that it is named when that returns, whichever runs first).
 */
static void *start(void *p)
{
    start_t st = *(start_t *)p;
    free(p);
    if (st.name[0])
        (void)pthread_setname_np(pthread_self(), st.name); /* only for people reading `top` */
    return st.fn(st.arg);
}

int kvb__cpus_usable(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int kvb__threads_per_side(int conns)
{
    int cpus = kvb__cpus_usable(), t = cpus >= 2 ? cpus / 2 : 1;
    return conns < 1 ? 1 : t < conns ? t : conns;
}

int kvb__thread_create(pthread_t *t, const kvb_cpus_t *cpus, int ordinal, const char *name,
                       int index, void *(*fn)(void *), void *arg)
{
    char label[16] = ""; /* the most a thread name holds, with its NUL */
    if (name && index >= 0)
        snprintf(label, sizeof label, "%.10s-%u", name, (unsigned)index % 10000u);
    else if (name)
        snprintf(label, sizeof label, "%.15s", name);
    start_t *st = calloc(1, sizeof *st);
    if (!st)
        return ENOMEM;
    *st = (start_t){.fn = fn, .arg = arg};
    memcpy(st->name, label, sizeof label);
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc) {
        free(st);
        return rc;
    }
    if (cpus && cpus->n > 0 && ordinal >= 0) {
        /* Set before the thread exists, so that it never runs anywhere else: a thread moved
         * after it started may already have touched its memory from another CPU. */
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus->cpu[ordinal % cpus->n], &one);
        rc = pthread_attr_setaffinity_np(&attr, sizeof one, &one);
    }
    if (!rc)
        rc = pthread_create(t, &attr, start, st);
    pthread_attr_destroy(&attr);
    if (rc)
        free(st);
    else if (label[0]) /* not st->name: st is the thread's once it runs */
        (void)pthread_setname_np(*t, label);
    return rc;
}

bool kvb__thread_move_off(int cpu)
{
    cpu_set_t all, others;
    pthread_t self = pthread_self();
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getcpu() != cpu ||
        pthread_getaffinity_np(self, sizeof all, &all) != 0 || !CPU_ISSET(cpu, &all) ||
        CPU_COUNT(&all) < 2)
        return false;
    others = all;
    CPU_CLR(cpu, &others);
    /* A running thread whose mask no longer holds its CPU is moved before the call returns. */
    if (pthread_setaffinity_np(self, sizeof others, &others) != 0)
        return false;
    int rc = pthread_setaffinity_np(self, sizeof all, &all);
    if (rc != 0) /* it keeps running, on fewer CPUs than it may */
        KVB_WARN("cannot give a thread back its CPUs: %s", strerror(rc));
    return sched_getcpu() != cpu;
}
