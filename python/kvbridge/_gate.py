# SPDX-License-Identifier: Apache-2.0
"""The handle of a C object that several threads call while one of them may close it.

A method of Engine, Batch, Agent, Link or Transfer holds the object's gate open (`with
gate.use() as handle:`) for as long as its C call runs, with the GIL released. Gates nest as the
objects do (engine > agent > link > transfer): a call on a link holds its agent's and its
engine's gates open too, since the C link uses both. close() shuts the gate: no call starts from
then on (on it or below it), calls in flight are hastened where the object has a way to (a
batch's pending requests are cancelled) and waited for, and only then are the object's children
closed and the handle freed - never under a call that still uses it, and never before its
children: a gate holds its children's gates (not the Python objects, which may be collected in any
order - the cycle collector clears weak references before it runs __del__), and closes them
first. A second close() (another thread's, or a parent's closing its children) returns once
the first has freed it. A close on a thread that is itself inside a call on the object or below
it (a signal handler interrupting a wait) cannot wait for that call: the free is left to the
last call to leave, and a second close on that thread returns at once. Calls that could
otherwise wait without end (for a notification, for a request id) wait in slices of about
SLICE_S, so a close ends them within a slice."""
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Set

from .errors import make_error

SLICE_S = 0.05  # a wait in slices sees a close within about this long
_ERR_SHUTDOWN = -12
log = logging.getLogger("kvbridge")


class Gate:
    """One C handle, the calls using it and the gates of its children (see the module's text).
    `free(handle)` frees it, `hasten(handle)` makes calls in flight end sooner (optional)."""

    __slots__ = ("_mu", "_cv", "_h", "_calls", "_by", "_what", "_parent", "_kids", "_free",
                 "_hasten", "_closing", "_freed", "_deferred", "_pending", "_then")

    def __init__(self, handle: int, what: str, free: Callable[[int], object],
                 parent: Optional["Gate"] = None,
                 hasten: Optional[Callable[[int], object]] = None):
        # Reentrant: a signal handler may run on a thread while it is inside a locked section
        # here; its close() must then not block on the lock (it is recorded, see close()).
        self._mu = threading.RLock()
        self._cv = threading.Condition(self._mu)
        self._h: Optional[int] = handle
        self._calls = 0
        self._by: Dict[int, int] = {}  # thread id -> its calls in flight (its own and below)
        self._what = what
        self._parent = parent
        self._kids: Set["Gate"] = set()
        self._free, self._hasten = free, hasten
        self._closing: Optional[threading.Thread] = None  # waiting for calls, or freeing
        self._freed = threading.Event()
        self._deferred: Optional[Callable[[], None]] = None  # the free, left to the last call
        self._pending = False  # a close asked for inside one of our locked sections
        self._then: List[Callable[[], None]] = []  # a parent's finish waiting for our free
        if parent is not None:  # made inside a call on the parent: it cannot be freed meanwhile
            with parent._mu:
                parent._kids.add(self)

    @property
    def closed(self) -> bool:
        return self._h is None

    def peek(self) -> int:
        """The handle while open (for code that calls the C library itself); raises once
        closed."""
        h = self._h
        if h is None:
            raise make_error(_ERR_SHUTDOWN, f"{self._what} is closed")
        return h

    def use(self) -> "Gate":
        """`with gate.use() as handle:` - the handle, kept valid (and its parents') until the
        block ends; ShutdownError once it or a parent is closed."""
        return self

    def __enter__(self) -> int:
        if self._parent is not None:
            self._parent.__enter__()
        try:
            me = threading.get_ident()
            with self._mu:
                h = self._h
                if h is None:
                    raise make_error(_ERR_SHUTDOWN, f"{self._what} is closed")
                self._calls += 1
                self._by[me] = self._by.get(me, 0) + 1
        except BaseException:
            if self._parent is not None:
                self._parent.__exit__(None, None, None)
            raise
        finally:
            self._run_pending()
        return h

    def __exit__(self, *exc: object) -> None:
        try:
            me = threading.get_ident()
            run = None
            with self._mu:
                self._calls -= 1
                left = self._by[me] - 1
                if left:
                    self._by[me] = left
                else:
                    del self._by[me]
                if self._calls == 0:
                    self._cv.notify_all()
                    run, self._deferred = self._deferred, None
            if run is not None:  # a close left the free to the last call: this one
                try:
                    run()
                except Exception:  # the call's own outcome stands
                    log.exception("closing a %s after its last call", self._what)
            self._run_pending()
        finally:
            if self._parent is not None:
                self._parent.__exit__(*exc)

    def _run_pending(self) -> None:
        """A close recorded inside a locked section, run once outside every one - unless the
        gate was shut meanwhile (that close is under way, or done)."""
        if self._pending and not self._mu._is_owned():
            self._pending = False
            if self._h is not None:
                self.close()

    def close(self) -> None:
        """Shuts the gate; once no call uses the handle, closes the children's gates and frees
        it. If another thread closed it already, returns once that one has freed it."""
        if self._mu._is_owned():  # a signal handler inside this gate's own bookkeeping
            self._pending = True  # run as that section ends
            return
        me = threading.current_thread()
        with self._mu:
            h, mine = self._h, me.ident in self._by
            if h is None:
                # Not for itself: a thread inside a call (the free waits for that call), or the
                # one that is closing it (a handler interrupting that close).
                wait = not mine and self._closing is not me
            else:
                self._h, busy = None, self._calls > 0
                self._closing = None if mine else me
        if h is None:
            if wait:
                self._freed.wait()
            return
        err: Optional[BaseException] = None
        try:
            if busy and self._hasten is not None:
                self._hasten(h)
            with self._mu:
                if mine:  # our own call is under way: the last call to leave frees it
                    self._deferred = lambda: self._finish(h)
                    return
                while self._calls > 0:
                    self._cv.wait()
        except BaseException as ex:  # interrupted (KeyboardInterrupt): the last call frees it
            with self._mu:
                if self._calls > 0:
                    self._closing = None
                    self._deferred = lambda: self._finish(h)
                    raise
            err = ex
        self._finish(h)
        if err is not None:
            raise err

    def _finish(self, h: int) -> None:
        """The children's gates closed (no call uses any: each would hold ours), then the free;
        the first error is raised after both. A child whose close is under way lower on this
        very thread's stack (a signal handler closing us interrupted it) is not freed yet: the
        rest of this finish is then left to run after that child's free."""
        self._closing = threading.current_thread()
        err: Optional[BaseException] = None
        try:
            with self._mu:
                kids = list(self._kids)
            for kid in kids:
                try:
                    kid.close()
                except BaseException as ex:
                    err = err or ex
                if not kid._freed.is_set():
                    kid._then.append(lambda: self._finish(h))
                    self._closing = None
                    return
            self._free(h)
        except BaseException:
            self._done()
            raise
        self._done()
        if err is not None:
            raise err

    def _done(self) -> None:
        """Freed: out of the parent's children, waiters released, then what waited for it."""
        if self._parent is not None:
            with self._parent._mu:
                self._parent._kids.discard(self)
            self._parent._run_pending()
        self._freed.set()
        self._closing = None  # last: a handler's close meanwhile must not wait for us
        then, self._then = self._then, []
        for fn in then:
            try:
                fn()
            except Exception:
                log.exception("closing a parent of a %s after its free", self._what)


def sliced(gate: Gate, call: Callable[[int, int], int], timeout: Optional[float],
           nothing_yet: int) -> int:
    """Runs `call(handle, timeout_ms)`, a wait that returns `nothing_yet` when its time passed,
    for up to `timeout` seconds (None: until it returns something else) in slices of at most
    SLICE_S, each with the gate open: a close() between two slices ends the wait with
    ShutdownError. 0 polls once. Returns the last call's status."""
    if timeout is not None and timeout <= 0:
        with gate.use() as h:
            return call(h, 0)
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SLICE_S if end is None else min(SLICE_S, end - time.monotonic())
        with gate.use() as h:
            rc = call(h, max(1, int(left * 1000 + 0.5)) if left > 0 else 0)
        if rc != nothing_yet or (end is not None and time.monotonic() >= end):
            return rc
