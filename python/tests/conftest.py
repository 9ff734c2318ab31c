# SPDX-License-Identifier: Apache-2.0
"""Test harness: the package under test is python/ (not an installed copy); each test has a
timeout of its own (pytest-timeout is not in Debian): SIGALRM fails the test, and faulthandler
dumps every thread's stack and ends the run if that does not stop it; peers are real processes
started through peer.py, killed at teardown and whenever the test process dies."""

import faulthandler
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

TEST_TIMEOUT = float(os.environ.get("KVB_PY_TEST_TIMEOUT", "30"))


class TestTimeout(Exception):
    """A test ran past TEST_TIMEOUT."""


def _alarm(signum, frame):
    raise TestTimeout(f"test ran past its timeout of {TEST_TIMEOUT:g} s")


_real_stderr = None


def _stderr(config):
    """The terminal's stderr (pytest's capture has fd 2 while a test runs), for the hard stop."""
    global _real_stderr
    if _real_stderr is None:
        fd = 2
        try:  # pytest keeps the original fd 2 here while it captures
            capman = config.pluginmanager.getplugin("capturemanager")
            fd = capman._global_capturing.err.targetfd_save
        except Exception:
            pass
        _real_stderr = os.fdopen(os.dup(fd), "w")
    return _real_stderr


def pytest_unconfigure(config):
    if _real_stderr is not None:
        _real_stderr.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Soft: SIGALRM raises in the test (it fails with its traceback; fixtures kill the peers).
    # Hard, for a thread stuck where no signal handler runs: every stack to the terminal, exit.
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
    faulthandler.dump_traceback_later(TEST_TIMEOUT + 15, exit=True, file=_stderr(item.config))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


class Peer:
    """A peer process; run(code) executes code there and returns its `result`."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "peer.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env=dict(os.environ))

    def run(self, code: str):
        self.proc.stdin.write(json.dumps({"code": code}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited (status {self.proc.poll()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError("peer failed:\n" + reply["error"])
        return reply["result"]

    def send(self, code: str) -> None:
        """Starts code without waiting for its answer (collect it with answer())."""
        self.proc.stdin.write(json.dumps({"code": code}) + "\n")
        self.proc.stdin.flush()

    def answer(self):
        reply = json.loads(self.proc.stdout.readline())
        if not reply["ok"]:
            raise RuntimeError("peer failed:\n" + reply["error"])
        return reply["result"]

    def signal(self, sig: int) -> None:
        """Sends `sig`; for SIGSTOP returns only once every thread of the peer has stopped (the
        signal is asynchronous: a progress thread could otherwise still serve a request)."""
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            assert wait_for(self._stopped, timeout=5), "peer did not stop"

    def _stopped(self) -> bool:
        task = f"/proc/{self.proc.pid}/task"
        try:
            for tid in os.listdir(task):
                with open(f"{task}/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
        except FileNotFoundError:
            return False
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _spawner():
    peers = []

    def start() -> Peer:
        p = Peer()
        peers.append(p)
        return p

    return start, peers


@pytest.fixture
def spawn():
    """Starts peers; every one is killed when the test ends."""
    start, peers = _spawner()
    yield start
    for p in peers:
        p.kill()


@pytest.fixture(scope="module")
def spawn_shared():
    """Starts peers shared by a module's tests (killed when the module ends)."""
    start, peers = _spawner()
    yield start
    for p in peers:
        p.kill()


RESET = """
buf[:] = pattern(1, buf.nbytes)
if "eng" in globals():
    while eng.notify_recv(0): pass
else:
    te.get_notifies()
"""


# A native peer with a registered 4 MiB buffer holding pattern(1); `name`, `addr`, `size`.
NATIVE_TARGET = """
import kvbridge, numpy as np
eng = kvbridge.Engine(protocol={protocol!r})
buf = pattern(1, {size})
eng.register(buf)
result = {{"name": eng.name, "addr": addr(buf), "size": buf.nbytes}}
"""

MOONCAKE_TARGET = """
import numpy as np
from kvbridge.mooncake import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = pattern(1, {size})
assert te.register_memory(addr(buf), buf.nbytes) == 0
result = {{"name": "127.0.0.1:%d" % te.get_rpc_port(), "addr": addr(buf), "size": buf.nbytes}}
"""


_shared = {}


@pytest.fixture
def target(spawn_shared):
    """A native peer process (protocol auto) with 4 MiB of pattern(1) registered, shared by the
    module's tests and reset for each."""
    return shared_target(spawn_shared, "native")


def shared_target(spawn_shared, kind):
    info = _shared.get((spawn_shared, kind))
    if info is None or info["peer"].proc.poll() is not None:
        info = start_target(spawn_shared, kind=kind)
        _shared[(spawn_shared, kind)] = info
    info["peer"].run(RESET)
    return info


def start_target(spawn, kind="native", protocol="auto", size=4 << 20):
    p = spawn()
    code = NATIVE_TARGET if kind == "native" else MOONCAKE_TARGET
    info = p.run(code.format(protocol=protocol, size=size))
    info["peer"] = p
    return info


def dead_port() -> int:
    """A loopback port nothing listens on (bound to port 0, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def quiet_port() -> int:
    """A free loopback port below the kernel's ephemeral range: no socket bound to port 0 and no
    outgoing connection - of this test or of another one running beside it - is ever given it,
    so a process that exits can be followed by another on the same port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_for(cond, timeout=5.0, step=0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()
