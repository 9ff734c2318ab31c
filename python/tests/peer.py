# SPDX-License-Identifier: Apache-2.0
"""A peer process for the tests: runs Python snippets sent as JSON lines on stdin in one namespace
and answers each with a JSON line on stdout ({"ok", "result"} or {"ok": false, "error"}). It dies
with its parent (PR_SET_PDEATHSIG) and when stdin closes, so a test that fails or times out leaves
no process behind."""

import ctypes
import json
import os
import signal
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the package under test (python/)
sys.path.insert(0, HERE)


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        sys.exit(1)  # the parent is already gone
    out = sys.stdout
    sys.stdout = sys.stderr  # prints from snippets must not corrupt the answers
    ns = {"__name__": "peer"}
    exec("from helpers import *", ns)
    for line in sys.stdin:
        msg = json.loads(line)
        ns["result"] = None
        try:
            exec(msg["code"], ns)
            reply = {"ok": True, "result": ns.get("result")}
        except BaseException:  # report everything, SystemExit included
            reply = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
