# SPDX-License-Identifier: Apache-2.0
"""close() racing calls on other threads: an engine, a batch or an agent is freed only once no
call uses it any more, calls after it raise ShutdownError, waits that could go on without end
are cut short, two closers free once and both return after it, and a close from a signal
handler on a thread inside a call leaves the free to that call's end - never a call inside freed
memory."""

import contextlib
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

import kvbridge
from kvbridge import Engine, Op, ReqState, errors, kv
from conftest import start_target, wait_for
from helpers import addr, kv_cache, local_and_segment


class _Call(threading.Thread):
    """Runs fn on its own thread; keeps what it returned or raised."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as ex:  # kept for the test to look at
            self.error = ex


class _Spy:
    """The library, every call logged as ("begin"|"end", name) in the order they happened;
    `slow` names calls that sleep that long before they run."""

    def __init__(self, lib, slow=None):
        self._lib, self._slow, self.log = lib, slow or {}, []

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def call(*args):
            self.log.append(("begin", name))
            time.sleep(self._slow.get(name, 0))
            try:
                return fn(*args)
            finally:
                self.log.append(("end", name))
        return call

    def at(self, what, name):
        return self.log.index((what, name))


def _spy_on(spy, obj, free, hasten=None):
    """Routes obj's calls, and its gate's free (and hasten), through `spy`."""
    obj._lib = spy
    obj._gate._free = getattr(spy, free)
    if hasten:
        obj._gate._hasten = getattr(spy, hasten)


def _spy_on_chain(engine, agent, link, slow=None):
    """One spy over an engine, its agent and a link of the agent, and their frees."""
    spy = _Spy(engine._lib, slow)
    _spy_on(spy, engine, "kvb_engine_destroy")
    _spy_on(spy, agent, "kvb_kv_agent_destroy")
    _spy_on(spy, link, "kvb_kv_link_close")
    return spy


def _inside(gate, thread):
    """True once `thread` holds a call open on `gate`."""
    return wait_for(lambda: thread.ident in gate._by, 5)


@contextlib.contextmanager
def _engine_in_a_blocked_open():
    """(engine, spy, call): an engine, its destroy spied on, with a call in flight on another
    thread - opening a listener that never answers, blocked in C for the connect timeout (1 s)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        e = Engine(connect_timeout_ms=1000)
        spy = _Spy(e._lib)
        _spy_on(spy, e, "kvb_engine_destroy")
        call = _Call(lambda: e.open_segment("127.0.0.1:%d" % silent.getsockname()[1]))
        assert _inside(e._gate, call)
        yield e, spy, call


def test_close_waits_for_a_call_in_flight():
    with _engine_in_a_blocked_open() as (e, spy, call):
        e.close()
        call.join(5)
        assert not call.is_alive()
        assert isinstance(call.error, kvbridge.Error), call.error
        # the engine was destroyed only after the call had left it
        assert spy.at("end", "kvb_segment_open") < spy.at("begin", "kvb_engine_destroy")
        with pytest.raises(errors.ShutdownError):
            e.stats()


def test_closing_a_batch_that_another_thread_waits_for(spawn):
    t = start_target(spawn, protocol="tcp")
    with Engine(protocol="tcp") as e:
        local, seg = local_and_segment(e, t)
        t["peer"].signal(signal.SIGSTOP)  # the READ stays pending
        try:
            b = e.submit([(Op.READ, addr(local), seg, t["addr"], t["size"])], timeout=20)
            spy = _Spy(b._lib)
            _spy_on(spy, b, "kvb_batch_free", "kvb_batch_cancel")
            waiting = _Call(b.wait)
            assert _inside(b._gate, waiting)
            t0 = time.monotonic()
            b.close()
            assert time.monotonic() - t0 < 2
            waiting.join(5)
            assert isinstance(waiting.error, errors.CanceledError), waiting.error
            assert spy.at("end", "kvb_batch_wait") < spy.at("begin", "kvb_batch_free")
            with pytest.raises(errors.ShutdownError):
                b.status(0)
            b.close()  # idempotent
        finally:
            t["peer"].signal(signal.SIGCONT)


def test_calls_racing_engine_close(target):
    """Threads submit and wait, read stats and regions and receive notifications while the
    engine closes under them: each ends with ShutdownError, nothing else, and promptly."""
    for _ in range(5):
        e = Engine()
        local = np.zeros(1 << 20, np.uint8)
        e.register(local)
        seg = e.open_segment(target["name"])

        # Until the step raises: a loop told to stop once close() returned could end without
        # an error - its last step begun and ended before the close, its look at a stop flag
        # after it - and say nothing of the calls the close should fail (join(5) bounds it).
        def loop(step):
            while True:
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
        assert _inside(e._gate, calls[3])
        time.sleep(0.05)  # the loops going
        e.close()
        closed = time.monotonic()
        for c in calls:
            c.join(5)
            assert not c.is_alive()
            assert isinstance(c.error, errors.ShutdownError), repr(c.error)
        assert time.monotonic() - closed < 5


_KEEP = []  # the agents' KV arrays: registered memory must outlive the engines


def _agents(e1, e2):
    l1, a1 = kv_cache(1)
    l2, a2 = kv_cache(None)
    _KEEP.extend((a1, a2))
    p = kv.Agent(e1, l1, kv.Role.PREFILL)
    d = kv.Agent(e2, l2, kv.Role.DECODE)
    return p, d, p.link(e2.name), d.link(e1.name)


def test_agent_close_ends_a_wait():
    with Engine() as e1, Engine() as e2:
        p, d, link, back = _agents(e1, e2)
        p.expect("r1", [link], 30)
        waiting = _Call(lambda: p.wait("r1"))  # until the request's deadline, 30 s
        assert _inside(p._gate, waiting)
        t0 = time.monotonic()
        p.close()
        waiting.join(5)
        assert not waiting.is_alive()
        assert isinstance(waiting.error, errors.ShutdownError), waiting.error
        assert time.monotonic() - t0 < 1
        with pytest.raises(errors.ShutdownError):
            link.verdict  # closed with its agent
        back.close()
        d.close()


def test_parent_and_child_closed_at_once():
    """An agent closing on one thread (its destroy made slow) while the engine closes on
    another: the engine waits for the agent's destroy before it is destroyed itself."""
    e1, e2 = Engine(), Engine()
    try:
        p, d, link, back = _agents(e1, e2)
        spy = _spy_on_chain(e1, p, link, slow={"kvb_kv_agent_destroy": 0.3})
        closing = _Call(p.close)
        assert wait_for(lambda: ("begin", "kvb_kv_agent_destroy") in spy.log, 5)
        e1.close()
        assert ("end", "kvb_kv_agent_destroy") in spy.log  # returned after the agent's free
        assert spy.at("end", "kvb_kv_agent_destroy") < spy.at("begin", "kvb_engine_destroy")
        assert spy.log.count(("begin", "kvb_kv_agent_destroy")) == 1
        assert spy.at("end", "kvb_kv_link_close") < spy.at("begin", "kvb_kv_agent_destroy")
        closing.join(5)
        assert closing.error is None
    finally:
        e1.close()
        e2.close()


def _close_on_signal(target, after_inside, gate):
    """Installs a SIGUSR1 handler that closes `target`, and sends the signal from another
    thread once the main thread holds a call open on `gate`; returns the old handler."""
    old = signal.signal(signal.SIGUSR1, lambda *_: target.close())
    main = threading.main_thread()

    def fire():
        if _inside(gate, main):
            time.sleep(after_inside)
            os.kill(os.getpid(), signal.SIGUSR1)
    threading.Thread(target=fire, daemon=True).start()
    return old


def test_close_from_a_signal_handler_on_the_waiting_thread():
    """The main thread waits for a notification; a signal handler - run on the main thread,
    between two slices of the wait or inside one - closes the engine: the wait ends with
    ShutdownError and the engine is destroyed after the call in flight left it."""
    e = Engine()
    spy = _Spy(e._lib)
    _spy_on(spy, e, "kvb_engine_destroy")
    old = _close_on_signal(e, 0.1, e._gate)
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.ShutdownError):
            e.notify_recv(10)
        assert time.monotonic() - t0 < 2
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert e.closed
    last_recv = len(spy.log) - 1 - spy.log[::-1].index(("end", "kvb_notify_recv"))
    assert last_recv < spy.at("begin", "kvb_engine_destroy")
    assert spy.log.count(("begin", "kvb_engine_destroy")) == 1


def test_engine_closed_from_a_signal_handler_during_an_agent_wait():
    """The main thread waits in agent.wait(); a signal handler closes the engine: the agent's
    call holds the engine open, so the engine is destroyed only after the wait left - and
    after its agent and the agent's links, in that order."""
    e1, e2 = Engine(), Engine()
    try:
        p, d, link, back = _agents(e1, e2)
        spy = _spy_on_chain(e1, p, link)
        p.expect("r1", [link], 30)
        old = _close_on_signal(e1, 0.1, p._gate)
        try:
            t0 = time.monotonic()
            with pytest.raises(errors.ShutdownError):
                p.wait("r1")
            assert time.monotonic() - t0 < 2
        finally:
            signal.signal(signal.SIGUSR1, old)
        assert e1.closed and p._gate.closed and link._gate.closed
        last_wait = len(spy.log) - 1 - spy.log[::-1].index(("end", "kvb_kv_wait"))
        assert last_wait < spy.at("begin", "kvb_kv_link_close")
        assert spy.at("end", "kvb_kv_link_close") < spy.at("begin", "kvb_kv_agent_destroy")
        assert spy.at("end", "kvb_kv_agent_destroy") < spy.at("begin", "kvb_engine_destroy")
    finally:
        e1.close()
        e2.close()


def test_a_close_waiting_for_a_call_interrupted():
    """A close interrupted while it waits for another thread's call (Ctrl-C) leaves the free to
    that call: the object is still freed, once, and a later close returns."""
    with _engine_in_a_blocked_open() as (e, spy, call):
        old = signal.signal(signal.SIGUSR1, signal.default_int_handler)  # KeyboardInterrupt
        try:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            with pytest.raises(KeyboardInterrupt):
                e.close()  # waits for the open (1 s)
        finally:
            signal.signal(signal.SIGUSR1, old)
        assert ("begin", "kvb_engine_destroy") not in spy.log  # the open is still inside
        e.close()  # again, on the same thread: returns once the open's end has freed it
        assert ("end", "kvb_engine_destroy") in spy.log
        assert spy.log.count(("begin", "kvb_engine_destroy")) == 1
        assert spy.at("end", "kvb_segment_open") < spy.at("begin", "kvb_engine_destroy")
        call.join(5)
        assert isinstance(call.error, kvbridge.Error), call.error


def test_a_close_inside_the_gates_own_bookkeeping():
    """A signal handler that closes an object while its thread is inside the gate's own locked
    section (taking or dropping a call) must not block on that lock: the close is recorded and
    runs as the section ends - here as a call is taken, so the free waits for that call."""
    from kvbridge._gate import Gate
    freed = []
    g = Gate(7, "thing", freed.append)
    with g._mu:  # where such a handler finds the thread
        g.close()
        assert not g.closed and not freed
    with g.use() as h:  # the section that ends next: the close runs, and defers to this call
        assert h == 7 and g.closed and not freed
    assert freed == [7]
    with pytest.raises(errors.ShutdownError):
        with g.use():
            pass
    g.close()  # idempotent
    assert freed == [7]
    # recorded inside a section of a gate already shut, with its free left to a call: dropped
    # (that close is under way), not waited for by the call that must run it
    g2 = Gate(8, "thing", freed.append)
    with g2.use():
        g2.close()  # deferred to this call
        with g2._mu:
            g2.close()  # recorded
    assert freed == [7, 8] and not g2._pending


def test_objects_in_a_collected_cycle_are_freed_children_first():
    """The cycle collector runs __del__ in any order and clears weak references first: an
    engine, its agent and the agent's link dropped together in a cycle are still freed link,
    agent, engine."""
    import gc
    e1, e2 = Engine(), Engine()
    try:
        p, d, link, back = _agents(e1, e2)
        spy = _spy_on_chain(e1, p, link)
        cycle = {"objs": [e1, p, link]}
        cycle["self"] = cycle
        del p, link, cycle
        e1 = None
        gc.collect()
        assert spy.log.count(("begin", "kvb_engine_destroy")) == 1
        assert spy.at("end", "kvb_kv_link_close") < spy.at("begin", "kvb_kv_agent_destroy")
        assert spy.at("end", "kvb_kv_agent_destroy") < spy.at("begin", "kvb_engine_destroy")
    finally:
        if e1 is not None:
            e1.close()
        e2.close()


def test_a_transfer_outlives_the_link_object_it_came_from():
    """`x = agent.link(seg).begin(...)` keeps the link: the transfer is not closed under the
    caller when the link object is dropped."""
    with Engine() as e1, Engine() as e2:
        p, d, link, back = _agents(e1, e2)
        x = d.link(e1.name).begin("r1", Op.READ, [1, 2], [3, 4], 10)
        x.all()
        x.finish()
        assert x.settle() is True
        x.close()


def test_a_parent_closed_by_a_handler_while_its_child_closes_on_the_same_thread():
    """A thread closing a child waits for another thread's call; a signal handler on it (here:
    the child's hasten, which runs at that point) closes the parent. The parent's finish finds
    the child's close under way lower on the same stack: the parent is freed after the child,
    not before."""
    from kvbridge._gate import Gate
    freed = []
    parent = Gate(1, "parent", lambda h: freed.append("parent"))
    leave = threading.Event()

    def hasten(h):
        leave.set()  # the other thread's call ends soon
        parent.close()

    child = Gate(2, "child", lambda h: freed.append("child"), parent, hasten)

    def call():
        with child.use():
            leave.wait(5)
    worker = _Call(call)
    assert _inside(child, worker)
    child.close()
    worker.join(5)
    assert freed == ["child", "parent"], freed
    assert parent.closed and child.closed
