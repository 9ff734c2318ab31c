# SPDX-License-Identifier: Apache-2.0
"""The handle of a C object that several threads call while one of them may close it.

A method of Engine, Batch, Agent, Link or Transfer holds the object's gate open (`use()`) for
as long as its C call runs, with the GIL released. close() shuts the gate: no call starts from
then on, calls in flight are hastened where the object has a way to (a batch's pending requests
are cancelled) and waited for, and only then is the handle freed - never under a call that still
uses it. Calls that could otherwise wait without end (for a notification) wait in slices of
SLICE_S, so a close waits for them at most one slice."""
import threading
import time
from typing import Callable, Optional

from .errors import make_error

SLICE_S = 0.05  # a close waits this long at most for a call waiting in slices
_ERR_SHUTDOWN = -12


class Gate:
    """One C handle and the calls using it (see the module's text)."""

    __slots__ = ("_mu", "_cv", "_h", "_calls", "_what")

    def __init__(self, handle: int, what: str):
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)
        self._h: Optional[int] = handle
        self._calls = 0
        self._what = what

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
        """`with gate.use() as handle:` - the handle, kept valid until the block ends;
        ShutdownError once closed."""
        return self

    def __enter__(self) -> int:
        with self._mu:
            h = self._h
            if h is None:
                raise make_error(_ERR_SHUTDOWN, f"{self._what} is closed")
            self._calls += 1
        return h

    def __exit__(self, *exc: object) -> None:
        with self._mu:
            self._calls -= 1
            if self._calls == 0:
                self._cv.notify_all()

    def shut(self, hasten: Optional[Callable[[int], object]] = None) -> Optional[int]:
        """Closes the gate and returns the handle once no call uses it, for the caller to free;
        None if it was closed already (by another thread, which frees it). `hasten(handle)` is
        called first if calls are in flight."""
        with self._cv:
            h, self._h = self._h, None
            busy = self._calls > 0
        if h is None:
            return None
        if busy and hasten is not None:
            hasten(h)
        with self._cv:
            while self._calls > 0:
                self._cv.wait()
        return h


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
