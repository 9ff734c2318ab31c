# SPDX-License-Identifier: Apache-2.0
"""close() racing calls on other threads: an engine, a batch or an agent is freed only once no
call uses it any more, calls after it raise ShutdownError, and waits that could go on without
end are cut short - never a call inside freed memory."""

import signal
import socket
import threading
import time

import numpy as np
import pytest

import kvbridge
from kvbridge import Engine, Op, ReqState, errors, kv
from conftest import start_target
from helpers import addr, kv_cache


class _Call(threading.Thread):
    """Runs fn on its own thread; keeps what it returned or raised, and when it ended."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error, self.ended = fn, None, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as ex:  # noqa: B036 - kept for the test to look at
            self.error = ex
        self.ended = time.monotonic()


def test_close_waits_for_a_call_in_flight():
    # A listener that never answers: opening it blocks in C until the connect timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        e = Engine(connect_timeout_ms=1000)
        call = _Call(lambda: e.open_segment("127.0.0.1:%d" % silent.getsockname()[1]))
        time.sleep(0.3)  # inside kvb_segment_open
        assert call.is_alive()
        e.close()
        closed = time.monotonic()
        call.join(5)
        assert not call.is_alive()
        assert isinstance(call.error, kvbridge.Error), call.error
        # the engine was freed only after the call had left it
        assert call.ended <= closed, "close() returned %.3f s before the call in flight ended" % (
            call.ended - closed)
        with pytest.raises(errors.ShutdownError):
            e.stats()


def test_closing_a_batch_that_another_thread_waits_for(spawn):
    t = start_target(spawn, protocol="tcp")
    with Engine(protocol="tcp") as e:
        local = np.zeros(t["size"], np.uint8)
        e.register(local)
        seg = e.open_segment(t["name"])
        t["peer"].signal(signal.SIGSTOP)  # the READ stays pending
        try:
            b = e.submit([(Op.READ, addr(local), seg, t["addr"], t["size"])], timeout=20)
            waiting = _Call(b.wait)
            time.sleep(0.2)
            assert waiting.is_alive()
            t0 = time.monotonic()
            b.close()
            assert time.monotonic() - t0 < 2
            waiting.join(5)
            assert isinstance(waiting.error, errors.CanceledError), waiting.error
            assert waiting.ended <= time.monotonic()
            with pytest.raises(errors.ShutdownError):
                b.status(0)
            b.close()  # idempotent
        finally:
            t["peer"].signal(signal.SIGCONT)


def test_calls_racing_engine_close(target):
    """Threads submit and wait, read stats and regions and receive notifications while the
    engine closes under them: each ends with a kvbridge error, nothing else, and promptly."""
    for _ in range(5):
        e = Engine()
        local = np.zeros(1 << 20, np.uint8)
        e.register(local)
        seg = e.open_segment(target["name"])
        stop = threading.Event()

        def loop(step):
            while not stop.is_set():
                step()

        def transfer():
            with e.submit([(Op.READ, addr(local), seg, target["addr"], 1 << 20)], timeout=5) as b:
                try:
                    b.wait()
                except errors.ShutdownError:
                    raise
                except kvbridge.Error as ex:  # a request the close failed
                    assert b.status(0).state == ReqState.FAILED, ex
                    raise errors.make_error(-12, "failed by the close") from ex

        calls = [_Call(lambda: loop(transfer)), _Call(lambda: loop(e.stats)),
                 _Call(lambda: loop(seg.regions)), _Call(lambda: e.notify_recv(None)),
                 _Call(lambda: loop(lambda: e.notify_recv(0.01)))]
        time.sleep(0.2)
        e.close()
        closed = time.monotonic()
        stop.set()
        for c in calls:
            c.join(5)
            assert not c.is_alive()
            assert isinstance(c.error, errors.ShutdownError), repr(c.error)
        # a waiting receiver is cut short within a slice
        assert calls[3].ended - closed < 1


def test_agent_close_ends_a_wait():
    with Engine() as e1, Engine() as e2:
        l1, _ = kv_cache(1)
        l2, _ = kv_cache(None)
        p = kv.Agent(e1, l1, kv.Role.PREFILL)
        d = kv.Agent(e2, l2, kv.Role.DECODE)
        link = p.link(e2.name)
        d.link(e1.name)
        p.expect("r1", [link], 30)
        waiting = _Call(lambda: p.wait("r1"))  # until the request's deadline, 30 s
        time.sleep(0.2)
        assert waiting.is_alive()
        t0 = time.monotonic()
        p.close()
        waiting.join(5)
        assert not waiting.is_alive()
        assert isinstance(waiting.error, errors.ShutdownError), waiting.error
        assert waiting.ended - t0 < 1
        with pytest.raises(errors.ShutdownError):
            link.verdict  # closed with its agent
        d.close()
