# SPDX-License-Identifier: Apache-2.0
"""kvbridge's exceptions: one class per status code of include/kvbridge/status.h, grouped as the C
library groups them (local errors, peer errors that end the connection, per-request errors the
remote side reported), all under kvbridge.Error."""

from __future__ import annotations

from typing import Dict, Optional, Type

# (name, value) as in KVB_STATUS_MAP; the message comes from kvb_strerror() at raise time.
_STATUS = [
    ("ERR_INVALID_ARG", -1), ("ERR_NOMEM", -2), ("ERR_OVERFLOW", -3), ("ERR_TIMEOUT", -4),
    ("ERR_CANCELED", -5), ("ERR_AGAIN", -6), ("ERR_NOT_FOUND", -7), ("ERR_OVERLAP", -8),
    ("ERR_LOCAL_NOT_REGISTERED", -9), ("ERR_SYSTEM", -10), ("ERR_ADDR_IN_USE", -11),
    ("ERR_SHUTDOWN", -12), ("ERR_BAD_SEGMENT", -13), ("ERR_UNSUPPORTED", -14),
    ("ERR_TOO_LARGE", -15), ("ERR_BUSY", -16), ("ERR_INCOMPATIBLE", -17),
    ("ERR_SEGMENT_NOT_FOUND", -18), ("ERR_META_UNREACHABLE", -19), ("ERR_DEVICE", -20),
    ("ERR_PEER_LOST", -100), ("ERR_CONNECT", -101), ("ERR_PROTOCOL", -102), ("ERR_VERSION", -103),
    ("ERR_PEER_RESTARTED", -104), ("ERR_RESOLVE", -105), ("ERR_AUTH", -106),
    ("ERR_REMOTE_NOT_REGISTERED", -200), ("ERR_ACCESS_DENIED", -201),
    ("ERR_REMOTE_NO_SPACE", -202), ("ERR_SHM_COPY", -203), ("ERR_REMOTE_DEVICE", -204),
]


class Error(Exception):
    """A kvbridge call failed. `status` is the negative kvb_status_t code, `name` its name without
    prefix (for example "ERR_PEER_LOST"), `message` the library's text for it, and `detail`
    what the binding knows about the call (the function, a KV-layer reason)."""

    def __init__(self, status: int, name: str, message: str, detail: str = ""):
        self.status = status
        self.name = name
        self.message = message
        self.detail = detail
        text = f"{name}: {message}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


class LocalError(Error):
    """Errors decided locally (arguments, resources, the registry): -1 .. -99."""


class PeerError(Error):
    """The connection to the peer is gone or unusable (-100 .. -199, KVB_IS_PEER_ERROR): every
    request in flight on it failed; reopen the segment."""


class RemoteError(Error):
    """A per-request error the remote side reported (-200 .. -299); the connection stays up."""


# Names that would shadow Python's built-in exceptions get one of their own.
_RENAMED = {"ERR_TIMEOUT": "TimedOutError", "ERR_OVERFLOW": "ArithmeticOverflowError",
            "ERR_SYSTEM": "SystemCallError"}


def _class_name(name: str) -> str:
    if name in _RENAMED:
        return _RENAMED[name]
    return "".join(w.capitalize() for w in name[len("ERR_"):].split("_")) + "Error"


_BY_STATUS: Dict[int, Type[Error]] = {}


def _make_classes() -> None:
    g = globals()
    for name, value in _STATUS:
        base: Type[Error] = LocalError if value > -100 else PeerError if value > -200 else RemoteError
        bases: tuple = (base,)
        if name == "ERR_TIMEOUT":
            bases = (base, TimeoutError)  # `except TimeoutError` catches it too
        elif name == "ERR_INVALID_ARG":
            bases = (base, ValueError)  # `except ValueError` catches it too
        cls = type(_class_name(name), bases, {
            "__doc__": f"Status {name} ({value}).", "__module__": "kvbridge.errors"})
        g[cls.__name__] = cls
        _BY_STATUS[value] = cls


_make_classes()

# The generated classes (one per status code), named here for readers and type checkers.
InvalidArgError: Type[Error]
NomemError: Type[Error]
ArithmeticOverflowError: Type[Error]
TimedOutError: Type[Error]
CanceledError: Type[Error]
AgainError: Type[Error]
NotFoundError: Type[Error]
OverlapError: Type[Error]
LocalNotRegisteredError: Type[Error]
SystemCallError: Type[Error]
BadSegmentError: Type[Error]
UnsupportedError: Type[Error]
BusyError: Type[Error]
IncompatibleError: Type[Error]
SegmentNotFoundError: Type[Error]
PeerLostError: Type[Error]
ConnectError: Type[Error]
PeerRestartedError: Type[Error]
AuthError: Type[Error]
RemoteNotRegisteredError: Type[Error]
AccessDeniedError: Type[Error]


def status_name(status: int) -> str:
    """The code's name without prefix, e.g. "ERR_PEER_LOST" (kvb_status_name)."""
    from . import _lib
    return _lib.load().kvb_status_name(status).decode()


def strerror(status: int) -> str:
    """The library's message for a status code (kvb_strerror)."""
    from . import _lib
    return _lib.load().kvb_strerror(status).decode()


def error_class(status: int) -> Type[Error]:
    """The exception class for a status code (Error for codes this version does not know)."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if -200 < status <= -100:
        return PeerError
    if status <= -200:
        return RemoteError
    return LocalError


def make_error(status: int, detail: str = "") -> Error:
    """Builds the exception for `status` with the library's name and message."""
    return error_class(status)(status, status_name(status), strerror(status), detail)


def check(status: int, detail: str = "", reason: Optional[bytes] = None) -> int:
    """Raises the matching Error if `status` is negative; returns it otherwise. `reason` is a KV
    layer's reason buffer, appended to the detail when not empty."""
    if status < 0:
        if reason:
            text = reason.decode(errors="replace")
            detail = f"{detail}: {text}" if detail else text
        raise make_error(status, detail)
    return status
