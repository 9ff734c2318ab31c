/* SPDX-License-Identifier: Apache-2.0 */
/* Runs the kvbridge command for CLI tests, with stdout and stderr captured through pipes. */
#include "helpers/cli.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXARGS 24

static void read_all(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    ssize_t k;
    while (n < cap - 1 && (k = read(fd, buf + n, cap - 1 - n)) > 0)
        n += (size_t)k;
    buf[n] = '\0';
    close(fd);
}

int test_run_cli(const char *sub, const char *const *args, char *out, size_t out_cap, char *err,
                 size_t err_cap)
{
    const char *bin = getenv("KVB_BIN");
    const char *argv[MAXARGS] = {bin, sub};
    int argc = 2;
    for (; args[argc - 2] && argc < MAXARGS - 1; argc++)
        argv[argc] = args[argc - 2];
    argv[argc] = NULL;
    int po[2], pe[2];
    if (!bin || !*bin || pipe(po) != 0)
        return -2;
    if (pipe(pe) != 0) {
        close(po[0]);
        close(po[1]);
        return -2;
    }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(po[1], 1);
        dup2(pe[1], 2);
        close(po[0]);
        close(pe[0]);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(po[1]);
    close(pe[1]);
    /* The outputs are small, so reading stdout to its end before stderr cannot fill the stderr
     * pipe and stall the child. */
    read_all(po[0], out, out_cap);
    read_all(pe[0], err, err_cap);
    int st;
    if (pid < 0 || waitpid(pid, &st, 0) != pid)
        return -2;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
