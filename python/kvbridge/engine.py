# SPDX-License-Identifier: Apache-2.0
"""The native binding of the transfer engine (include/kvbridge/engine.h): Engine, Segment, Batch,
notifications and stats. Semantics are the C library's; this module turns status codes into
kvbridge.Error exceptions, sizes and addresses into Python ints, and timeouts into seconds."""

from __future__ import annotations

import ctypes
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _lib
from ._gate import Gate, sliced
from .errors import ShutdownError, check, make_error

_ERR_TIMEOUT = -4

ACCESS_READ = 1
ACCESS_WRITE = 2
ACCESS_RW = 3
NOTIFY_MAX = _lib.NOTIFY_MAX


class Op(enum.IntEnum):
    """A request's direction: READ copies remote -> local, WRITE local -> remote."""
    READ = 0
    WRITE = 1


class ReqState(enum.IntEnum):
    """State of one request of a batch (kvb_req_state_t)."""
    PENDING = 0
    COMPLETED = 1
    FAILED = 2
    TIMEOUT = 3
    CANCELED = 4


def _settle(call: Any, handle: int, timeout: float, what: str) -> bool:
    """Runs a settle call (kvb_batch_settle, kvb_kv_xfer_settle) for up to `timeout` seconds:
    True once settled, False while not (ERR_AGAIN); raises any other error."""
    if timeout < 0:
        raise ValueError("timeout must be >= 0")
    rc = call(handle, _ms(timeout))
    if rc == -6:  # ERR_AGAIN
        return False
    check(rc, what)
    return True


def _ms(timeout: Optional[float], none: int = -1) -> int:
    """Seconds (None: `none`) to the C API's milliseconds, clamped to a C int."""
    if timeout is None:
        return none
    if timeout <= 0:
        return 0
    return min(int(timeout * 1000 + 0.5), 2**31 - 1) or 1


def _b(s: Optional[Union[str, bytes]]) -> Optional[bytes]:
    if s is None or isinstance(s, bytes):
        return s
    return s.encode()


BufferLike = Any  # an int address, a buffer-protocol object, or an object with data_ptr()


def _readonly(obj: Any) -> bool:
    """Whether a buffer-protocol object is read-only (addresses and tensors are not)."""
    if isinstance(obj, int) or hasattr(obj, "data_ptr"):
        return False
    try:
        return memoryview(obj).readonly
    except TypeError:
        return False


def _set_int(struct: Any, key: str, value: Any) -> None:
    """Sets an integer field of a ctypes structure, refusing a value its type cannot hold
    (ctypes would wrap it silently: port 70000 as 4464, a timeout of -1 as 49 days)."""
    t = dict(struct._fields_)[key]
    v = int(value)
    bits = 8 * ctypes.sizeof(t)
    signed = t(-1).value < 0 if t is not ctypes.c_bool else False
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not lo <= v <= hi:  # InvalidArgError, also a ValueError
        raise make_error(-1, f"{key}={v} is out of range ({lo}..{hi})")
    setattr(struct, key, v)


def buffer_info(obj: BufferLike, length: Optional[int] = None) -> Tuple[int, int, Any, Optional[str]]:
    """Finds the memory behind `obj`: returns (address, length in bytes, keep-alive, location).

    `obj` is an int address (then `length` is required), an object with data_ptr() (a torch
    tensor: must be contiguous; CUDA tensors get location "cuda:N"), or a C-contiguous object with
    the buffer protocol (numpy array, bytearray, mmap, memoryview). Read-only buffers are accepted
    only when they expose __array_interface__ (a read-only numpy array). The keep-alive must be
    held while the address is used. `length`, if given with an object, may only shrink it."""
    if isinstance(obj, int):
        if length is None:
            raise ValueError("an address needs a length")
        return obj, int(length), None, None
    location = None
    if hasattr(obj, "data_ptr") and callable(obj.data_ptr):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("tensor is not contiguous")
        addr = int(obj.data_ptr())
        if hasattr(obj, "numel") and hasattr(obj, "element_size"):
            n = int(obj.numel()) * int(obj.element_size())
        else:
            n = int(obj.nbytes)
        if getattr(obj, "is_cuda", False):
            idx = obj.device.index
            location = f"cuda:{0 if idx is None else idx}"
        keep = obj
    else:
        mv = memoryview(obj)
        if not mv.c_contiguous:
            raise ValueError("buffer is not C-contiguous")
        n = mv.nbytes
        if mv.readonly:
            ai = getattr(obj, "__array_interface__", None)
            if ai is None:
                raise ValueError("read-only buffer without __array_interface__: pass a writable "
                                 "buffer (bytearray, numpy array) instead")
            addr = int(ai["data"][0])
            keep = (obj, mv)
        elif n == 0:
            addr, keep = 0, mv
        else:
            arr = (ctypes.c_char * n).from_buffer(mv)
            addr = ctypes.addressof(arr)
            keep = (mv, arr)
    if length is not None:
        if length > n or length < 0:
            raise ValueError(f"length {length} exceeds the object's {n} bytes")
        n = int(length)
    return addr, n, keep, location


def view(addr: int, length: int) -> memoryview:
    """A writable memoryview of `length` bytes at `addr` (for example of kvb_alloc memory); wrap
    it with numpy.frombuffer for an array. The memory must stay valid while the view is used."""
    if length == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


@dataclass(frozen=True)
class Request:
    """One one-sided request: READ copies [remote, remote+length) of `segment` into `local`,
    WRITE copies `local` there. `local` must lie in a locally registered region."""
    op: Op
    local: int
    segment: Union["Segment", int]
    remote: int
    length: int


@dataclass(frozen=True)
class RequestStatus:
    """A request's state, why it failed (a status code, 0 unless it did) and bytes placed."""
    state: ReqState
    error: int
    bytes: int

    @property
    def error_name(self) -> str:
        from .errors import status_name
        return status_name(self.error)


@dataclass(frozen=True)
class RegionInfo:
    """One registered region of a segment, as its owner declared it."""
    addr: int
    length: int
    access: int
    location: str


@dataclass(frozen=True)
class Notification:
    """A received notification: `sender` is the segment name the sender proved in its handshake."""
    sender: str
    data: bytes
    reply_to: int
    _raw: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Stats:
    """An engine's counters of its own requests, and operations and bytes per data path."""
    requests_completed: int
    requests_failed: int
    paths: Dict[str, Tuple[int, int]]

    def bytes(self, path: str) -> int:
        """Bytes the named path ("tcp", "shm", "cuda") moved; 0 if there is no such path."""
        return self.paths.get(path, (0, 0))[1]


_CONFIG_INT = ("port", "port_max", "progress_threads", "lanes", "timeout_ms", "connect_timeout_ms",
               "copy_threads", "metadata_ttl_ms", "peer_timeout_ms", "max_connections",
               "shm_map_max", "busy_poll_us", "linger_us")
_CONFIG_STR = ("bind_addr", "advertise_addr", "segment_name", "metadata", "protocol", "cluster",
               "fabric_provider", "tcp_congestion", "cpus")


class Engine:
    """A kvbridge engine: binds and listens, registers memory, opens peers' segments and moves
    bytes with one-sided READ/WRITE batches (kvb_engine_create).

    Keyword arguments are kvb_config_t's fields and keep its units and defaults (see
    include/kvbridge/engine.h): bind_addr ("127.0.0.1"), advertise_addr, port (0: any free),
    port_max, segment_name, metadata ("p2p", "etcd://...", "redis://...", "http://..."),
    progress_threads, lanes, timeout_ms, connect_timeout_ms, protocol ("auto", "tcp", "shm",
    "shm,tcp", ...), copy_threads, cluster, metadata_ttl_ms, secret (bytes or str, 16..4096 bytes;
    None: the file named by KVB_SECRET_FILE, if set), insecure, peer_timeout_ms, max_connections,
    shm_map_max, fabric_provider where the library has the libfabric path
    (kvbridge.has_fabric()), tcp_congestion (the TCP connections' congestion control, such as
    "cubic"; default KVB_TCP_CONGESTION, else the system's) and busy_poll_us (microseconds the
    engine's threads poll before they sleep, 0 to 100000; default KVB_BUSY_POLL_US, else 0: off),
    cpus (the CPUs of its data threads, a list such as "0-1,4": progress threads, then copy
    threads, one CPU each in turn; default KVB_CPUS, else unbound) and linger_us (microseconds a
    progress thread polls for more requests after some came in, 0 to 100000; default
    KVB_LINGER_US, else 100).
    Unknown keywords raise TypeError.

    Every method is thread-safe, close() included (see close()); blocking ones release the GIL.
    Use as a context manager or call close(); batches stay valid after close()."""

    def __init__(self, **config: Any):
        lib = _lib.load()
        ctype = _lib.config_type()
        cfg = ctype()
        lib.kvb_config_init_v(ctypes.byref(cfg), ctypes.sizeof(cfg))
        keep: List[Any] = []
        secret = config.pop("secret", None)
        insecure = config.pop("insecure", False)
        names = {f[0] for f in ctype._fields_}
        for key, value in config.items():
            if value is None:
                continue
            if key not in names or key in ("size", "secret", "secret_len"):
                raise TypeError(f"unknown engine option {key!r}")
            if key in _CONFIG_STR:
                b = _b(value)
                keep.append(b)
                setattr(cfg, key, b)
            else:
                _set_int(cfg, key, value)
        if secret is not None:
            sb = _b(secret)
            buf = ctypes.create_string_buffer(sb, len(sb))
            keep.append(buf)
            cfg.secret = ctypes.cast(buf, ctypes.c_void_p)
            cfg.secret_len = len(sb)
        cfg.insecure = 1 if insecure else 0
        h = ctypes.c_void_p()
        rc = lib.kvb_engine_create(ctypes.byref(cfg), ctypes.byref(h))
        if secret is not None:
            ctypes.memset(buf, 0, len(sb))  # the library keeps its own copy
        check(rc, "kvb_engine_create")
        self._lib = lib
        self._lock = threading.Lock()
        self._regions: Dict[int, Any] = {}  # registered address -> keep-alive
        regions = self._regions  # kept until the engine is destroyed (not self: no cycle)

        def destroy(handle: int) -> None:
            lib.kvb_engine_destroy(handle)
            regions.clear()

        # KV agents made on it (kvbridge.kv) hang their gates below this one: closed first, since
        # an agent's C object uses the engine until it is destroyed.
        self._gate = Gate(h.value, "engine", destroy)
        self.name: str = lib.kvb_engine_segment_name(h).decode()
        self.port: int = int(lib.kvb_engine_port(h))

    # ---- lifetime ----------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        """The kvb_engine_t pointer, for code that calls the C library itself (valid until
        close(), which does not wait for such code)."""
        return self._gate.peek()

    @property
    def fabric_provider(self) -> str:
        """The libfabric provider the fabric data path runs on; "" when it does not run here
        (or the library has no such path)."""
        fn = getattr(self._lib, "kvb_engine_fabric_provider", None)
        if fn is None:
            return ""
        with self._gate.use() as h:
            return (fn(h) or b"").decode()

    @property
    def tcp_congestion(self) -> str:
        """The congestion control the engine's TCP connections use ("" with an older library)."""
        fn = getattr(self._lib, "kvb_engine_tcp_congestion", None)
        if fn is None:
            return ""
        with self._gate.use() as h:
            return (fn(h) or b"").decode()

    @property
    def busy_poll_us(self) -> int:
        """The busy polling of the engine's threads in microseconds (0: off, or an older
        library)."""
        fn = getattr(self._lib, "kvb_engine_busy_poll_us", None)
        if fn is None:
            return 0
        with self._gate.use() as h:
            return int(fn(h))

    @property
    def linger_us(self) -> int:
        """How long the engine's progress threads poll for more requests after some came in, in
        microseconds (linger_us, or busy_poll_us where longer; 0 with an older library)."""
        fn = getattr(self._lib, "kvb_engine_linger_us", None)
        if fn is None:
            return 0
        with self._gate.use() as h:
            return int(fn(h))

    @property
    def cpus(self) -> str:
        """The CPUs the engine's data threads run on, as a list such as "0-1" ("" when the
        scheduler places them, or with an older library)."""
        fn = getattr(self._lib, "kvb_engine_cpus", None)
        if fn is None:
            return ""
        with self._gate.use() as h:
            return (fn(h) or b"").decode()

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def close(self) -> None:
        """Destroys the engine (kvb_engine_destroy): requests in flight end FAILED with
        ERR_SHUTDOWN. Calls on other threads may race it: from now on they raise ShutdownError,
        and those under way are waited for - each ends by its own deadline (an open_segment() by
        the connect timeout, an unregister() by the engine's timeout, a KV Transfer.finish() by
        its transfer's), a notify_recv() waiting raises ShutdownError within about 0.1 s. KV
        agents made on it are closed first (a call on an agent, link or transfer holds the
        engine open too). Idempotent: a second close() returns once the first has destroyed it.
        On a thread that is itself inside a call on this engine or below it (a signal handler),
        or if interrupted while it waits, the destruction is left to the last call's end."""
        self._gate.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<kvbridge.Engine {self.name!r}{' closed' if self.closed else ''}>"

    # ---- memory ------------------------------------------------------------------------------
    def register(self, buf: BufferLike, length: Optional[int] = None, *,
                 location: Optional[str] = None, access: Optional[int] = None) -> Tuple[int, int]:
        """Registers memory so peers may READ/WRITE it as `access` allows and local requests may
        use it (kvb_register). `buf` is an address (with `length`), a buffer-protocol object or
        an object with data_ptr(); the object is kept alive until unregister(). `location`: "cpu",
        "cpu:N", "cuda:N", "*" (detect); default "cpu", or "cuda:N" for a CUDA tensor. `access`:
        default ACCESS_RW, but ACCESS_READ for a read-only buffer (a numpy array not writeable),
        which refuses ACCESS_WRITE (ValueError): a peer's WRITE would change memory Python holds
        immutable. (Do not READ into such a buffer either: local requests are not checked.)
        Returns (address, length). Raises OverlapError if the range overlaps a registration."""
        addr, n, keep, loc = buffer_info(buf, length)
        if location is None:
            location = loc
        readonly = _readonly(buf)
        if access is None:
            access = ACCESS_READ if readonly else ACCESS_RW
        elif readonly and access & ACCESS_WRITE:  # InvalidArgError, also a ValueError
            raise make_error(-1, "a read-only buffer cannot be registered for peers' WRITEs")
        with self._gate.use() as h:
            check(self._lib.kvb_register(h, addr, n, _b(location), access),
                  f"kvb_register({addr:#x}, {n})")
        with self._lock:
            self._regions[addr] = keep
        return addr, n

    def unregister(self, buf: BufferLike) -> None:
        """Unregisters the region starting at `buf` (an address, or the object registered),
        waiting until nothing uses it any more (kvb_unregister; BusyError after the engine's
        timeout: keep the memory valid and call again). NotFoundError if none starts there."""
        addr = buf if isinstance(buf, int) else buffer_info(buf)[0]
        with self._gate.use() as h:
            check(self._lib.kvb_unregister(h, addr), f"kvb_unregister({addr:#x})")
        with self._lock:
            self._regions.pop(addr, None)

    def alloc(self, length: int, *, huge: bool = False) -> int:
        """Allocates `length` zeroed bytes that same-host peers can map directly (kvb_alloc);
        returns the address (see view()). Not registered: register it to use it. Valid until
        free() or close()."""
        out = ctypes.c_void_p()
        with self._gate.use() as h:
            check(self._lib.kvb_alloc(h, length, 1 if huge else 0, ctypes.byref(out)),
                  f"kvb_alloc({length})")
        return int(out.value or 0)

    def free(self, addr: int) -> None:
        """Frees alloc() memory (BusyError while a registered region lies inside it)."""
        with self._gate.use() as h:
            check(self._lib.kvb_free(h, addr), f"kvb_free({addr:#x})")

    # ---- segments ----------------------------------------------------------------------------
    def open_segment(self, name: str) -> "Segment":
        """Opens the segment `name` ("host:port" in p2p mode, else its published name): connects,
        authenticates and fetches its regions (kvb_segment_open; blocks up to the connect
        timeout). Opening an open segment returns another reference to the same handle."""
        out = ctypes.c_uint32()
        with self._gate.use() as h:
            check(self._lib.kvb_segment_open(h, _b(name), ctypes.byref(out)),
                  f"kvb_segment_open({name!r})")
        return Segment(self, int(out.value), name)

    def set_attr(self, key: str, value: Optional[Union[bytes, str]]) -> None:
        """Publishes a named attribute with this engine's segment; None removes it."""
        v = _b(value)
        with self._gate.use() as h:
            check(self._lib.kvb_engine_set_attr(h, _b(key), v, len(v) if v else 0),
                  f"kvb_engine_set_attr({key!r})")

    # ---- transfers ---------------------------------------------------------------------------
    def submit(self, requests: Sequence[Union[Request, Tuple[Any, ...]]], *,
               timeout: Optional[float] = None, notify: Optional[Union[bytes, str]] = None,
               notify_segment: Optional[Union["Segment", int]] = None) -> "Batch":
        """Submits requests as one batch (kvb_batch_submit; never blocks on the network).
        `timeout`: per-request deadline in seconds (None: the engine's). `notify`: a message sent
        to `notify_segment` (default: the first request's segment) once every request COMPLETED.
        Raises at once, submitting nothing, on an invalid argument, an unknown segment or an
        unregistered local range."""
        n = len(requests)
        if n == 0:
            raise make_error(-1, "empty batch")
        arr = (_lib.Request * n)()
        for i, r in enumerate(requests):
            op, local, seg, remote, length = (r.op, r.local, r.segment, r.remote, r.length) \
                if isinstance(r, Request) else r
            arr[i].opcode = int(op)
            arr[i].local = local
            arr[i].segment = seg.handle if isinstance(seg, Segment) else int(seg)
            arr[i].remote = remote
            arr[i].len = length
        opts = _lib.BatchOpts()
        opts.timeout_ms = _ms(timeout, 0) if timeout is not None else 0
        if timeout is not None and opts.timeout_ms == 0:
            opts.timeout_ms = 1
        nb = _b(notify)
        if nb is not None:
            if notify_segment is None:
                notify_segment = arr[0].segment
            opts.notify_segment = (notify_segment.handle if isinstance(notify_segment, Segment)
                                   else int(notify_segment))
            nbuf = ctypes.create_string_buffer(nb, len(nb))
            opts.notify = ctypes.cast(nbuf, ctypes.c_void_p)
            opts.notify_len = len(nb)
        out = ctypes.c_void_p()
        with self._gate.use() as h:
            check(self._lib.kvb_batch_submit(h, arr, n, ctypes.byref(opts), ctypes.byref(out)),
                  "kvb_batch_submit")
        return Batch(self._lib, int(out.value), n)

    def transfer(self, requests: Sequence[Union[Request, Tuple[Any, ...]]], *,
                 timeout: Optional[float] = None, notify: Optional[Union[bytes, str]] = None,
                 notify_segment: Optional[Union["Segment", int]] = None) -> None:
        """submit() then wait for the batch: returns once every request COMPLETED, else raises
        the first failed request's error."""
        with self.submit(requests, timeout=timeout, notify=notify,
                         notify_segment=notify_segment) as b:
            b.wait()

    def read(self, segment: Union["Segment", int], local: int, remote: int, length: int, *,
             timeout: Optional[float] = None) -> None:
        """One READ of `length` bytes from `remote` into `local`, waited for."""
        self.transfer([Request(Op.READ, local, segment, remote, length)], timeout=timeout)

    def write(self, segment: Union["Segment", int], local: int, remote: int, length: int, *,
              timeout: Optional[float] = None) -> None:
        """One WRITE of `length` bytes from `local` to `remote`, waited for."""
        self.transfer([Request(Op.WRITE, local, segment, remote, length)], timeout=timeout)

    # ---- notifications -----------------------------------------------------------------------
    def notify_send(self, segment: Union["Segment", int], msg: Union[bytes, str], *,
                    timeout: Optional[float] = None) -> None:
        """Sends a message (at most NOTIFY_MAX bytes) and waits until the peer queued it
        (kvb_notify_send; timeout None: the engine's)."""
        m = _b(msg) or b""
        seg = segment.handle if isinstance(segment, Segment) else int(segment)
        with self._gate.use() as h:
            check(self._lib.kvb_notify_send(h, seg, m, len(m), _ms(timeout)), "kvb_notify_send")

    def notify_recv(self, timeout: Optional[float] = 0) -> Optional[Notification]:
        """The oldest received notification, waiting at most `timeout` seconds (0: poll; None:
        until one arrives). Returns None if none arrived in time; ShutdownError once the engine
        is closed (a wait under way ends within about 0.1 s of the close)."""
        raw = _lib.Notification()
        rc = sliced(self._gate, lambda h, ms: self._lib.kvb_notify_recv(h, ctypes.byref(raw), ms),
                    timeout, _ERR_TIMEOUT)
        return _notification(rc, raw, "kvb_notify_recv")

    def notify_reply(self, received: Notification, msg: Union[bytes, str]) -> None:
        """Answers a received notification on the connection it came in on (kvb_notify_reply)."""
        m = _b(msg) or b""
        with self._gate.use() as h:
            check(self._lib.kvb_notify_reply(h, ctypes.byref(received._raw), m, len(m)),
                  "kvb_notify_reply")

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> Stats:
        """Counters of this engine's own requests and bytes per data path (kvb_engine_stats)."""
        st = _lib.Stats()
        with self._gate.use() as h:
            check(self._lib.kvb_engine_stats(h, ctypes.byref(st)), "kvb_engine_stats")
        paths = {st.paths[i].name.decode(): (int(st.paths[i].ops), int(st.paths[i].bytes))
                 for i in range(min(st.npaths, _lib.STATS_PATHS_MAX))}
        return Stats(int(st.requests_completed), int(st.requests_failed), paths)


def _notification(rc: int, raw: Any, what: str) -> Optional[Notification]:
    if rc in (-6, -4):  # ERR_AGAIN (poll), ERR_TIMEOUT
        return None
    check(rc, what)
    return Notification(raw.from_.decode(errors="replace"), bytes(raw.data[:raw.len]),
                        int(raw.reply_to), raw)


class Segment:
    """An opened remote segment (one reference to a kvb_segment_t). close() drops it; requests
    in flight on the last reference end FAILED with ERR_CANCELED."""

    def __init__(self, engine: Engine, handle: int, name: str):
        self.engine = engine
        self.handle = handle
        self.name = name
        self._closed = False
        self._lock = threading.Lock()

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<kvbridge.Segment {self.name!r} #{self.handle}>"

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drops this reference (kvb_segment_close). Idempotent, also racing other threads'
        close(); nothing to do once the engine is closed."""
        with self._lock:
            closed, self._closed = self._closed, True
        if closed or self.engine.closed:
            return
        try:
            with self.engine._gate.use() as h:
                check(self.engine._lib.kvb_segment_close(h, self.handle), "kvb_segment_close")
        except ShutdownError:
            pass  # the engine closed meanwhile, and its segments with it

    def regions(self, refresh: bool = False) -> List[RegionInfo]:
        """The segment's registered regions; `refresh` fetches them from the peer first."""
        lib, count = self.engine._lib, ctypes.c_size_t()
        with self.engine._gate.use() as h:
            check(lib.kvb_segment_regions(h, self.handle, 1 if refresh else 0, None, 0,
                                          ctypes.byref(count)), "kvb_segment_regions")
            while True:
                cap = count.value
                arr = (_lib.RegionInfo * max(cap, 1))()
                check(lib.kvb_segment_regions(h, self.handle, 0, arr, cap, ctypes.byref(count)),
                      "kvb_segment_regions")
                if count.value <= cap:
                    break
        return [RegionInfo(int(r.addr), int(r.len), int(r.access), r.location.decode())
                for r in arr[:count.value]]

    def attr(self, key: str) -> Optional[bytes]:
        """The segment's attribute `key` as learnt at open or refresh; None if not published."""
        lib, n = self.engine._lib, ctypes.c_size_t()
        with self.engine._gate.use() as h:
            rc = lib.kvb_segment_attr(h, self.handle, _b(key), None, 0, ctypes.byref(n))
            if rc == -7:  # ERR_NOT_FOUND
                return None
            check(rc, f"kvb_segment_attr({key!r})")
            while True:  # a refresh on another thread may lengthen it between the two calls
                cap = n.value
                buf = ctypes.create_string_buffer(max(cap, 1))
                rc = lib.kvb_segment_attr(h, self.handle, _b(key), buf, cap, ctypes.byref(n))
                if rc == -7:
                    return None
                check(rc, f"kvb_segment_attr({key!r})")
                if n.value <= cap:
                    return buf.raw[:n.value]

    def refresh(self) -> None:
        """Fetches the region list and attributes again (PeerRestartedError: reopen)."""
        with self.engine._gate.use() as h:
            check(self.engine._lib.kvb_segment_refresh(h, self.handle), "kvb_segment_refresh")

    @property
    def transport(self) -> str:
        """The data path host memory takes to this segment: "shm" or "tcp"."""
        out = ctypes.c_char_p()
        with self.engine._gate.use() as h:
            check(self.engine._lib.kvb_segment_transport(h, self.handle, ctypes.byref(out)),
                  "kvb_segment_transport")
        return (out.value or b"").decode()

    @property
    def incarnation(self) -> int:
        """The peer's incarnation id (random per engine start)."""
        out = ctypes.c_uint64()
        with self.engine._gate.use() as h:
            check(self.engine._lib.kvb_segment_incarnation(h, self.handle, ctypes.byref(out)),
                  "kvb_segment_incarnation")
        return int(out.value)


class Batch:
    """A submitted batch. wait() for it, read status() per request, cancel(); close() (or the
    context manager, or garbage collection) frees it, cancelling what is still pending. Several
    threads may wait on, poll, cancel or close one batch at once: a close() cancels what is
    pending, waits until the other threads' calls have returned, then frees it; calls after it
    raise ShutdownError."""

    def __init__(self, lib: Any, handle: int, size: int):
        self._lib = lib
        # No parent: a C batch stays valid after its engine is destroyed.
        self._gate = Gate(handle, "batch", lib.kvb_batch_free, hasten=lib.kvb_batch_cancel)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def status(self, i: int) -> RequestStatus:
        """Request `i`'s status, without blocking (a PENDING one past its deadline turns
        TIMEOUT)."""
        if not 0 <= i < self.size:
            raise IndexError(i)
        with self._gate.use() as h:
            return self._status(h, i)

    def statuses(self) -> List[RequestStatus]:
        """Every request's status."""
        with self._gate.use() as h:
            return [self._status(h, i) for i in range(self.size)]

    def _status(self, h: int, i: int) -> RequestStatus:
        st = _lib.ReqStatus()
        check(self._lib.kvb_batch_status(h, i, ctypes.byref(st)), "kvb_batch_status")
        return RequestStatus(ReqState(st.state), int(st.error), int(st.bytes))

    @property
    def done(self) -> bool:
        """True once no request is PENDING."""
        return all(s.state != ReqState.PENDING for s in self.statuses())

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits until every request (and the batch's notification) has ended, at most `timeout`
        seconds (None: until each request's own deadline). Returns True if all COMPLETED, False
        if the wait timed out with requests pending; raises the first failed request's error
        (TimedOutError past a request's deadline, PeerLostError, RemoteNotRegisteredError...)."""
        with self._gate.use() as h:
            rc = self._lib.kvb_batch_wait(h, _ms(timeout))
            if rc == 0:
                return True
            if rc == -6:  # ERR_AGAIN
                return False
            first = next((i for i in range(self.size) if self._status(h, i).error == rc), "?")
        check(rc, f"kvb_batch_wait: request {first} of {self.size}")
        return False  # not reached

    def cancel(self) -> None:
        """Marks every pending request CANCELED; afterwards no READ writes into their buffers
        (over shared memory a copy under way may still land: unregister waits for it)."""
        with self._gate.use() as h:
            check(self._lib.kvb_batch_cancel(h), "kvb_batch_cancel")

    def settle(self, timeout: float = 0.0) -> bool:
        """Waits up to `timeout` seconds (0: polls) until no request of the batch can still
        move data (kvb_batch_settle). True once settled. A request that timed out or was
        cancelled may still have a same-host peer's copy (or a NIC's) land in its buffer until
        the peer answers, and a WRITE is settled once acknowledged: settle before handing such
        buffers to other work."""
        with self._gate.use() as h:
            return _settle(self._lib.kvb_batch_settle, h, timeout, "kvb_batch_settle")

    def close(self) -> None:
        """Cancels what is pending and frees the batch (kvb_batch_free), once calls on other
        threads have returned (a wait() raises CanceledError at once; a settle() still takes
        until the batch settles or its timeout). Idempotent."""
        self._gate.close()


def set_log_level(level: int) -> None:
    """Library log verbosity: 0 errors, 1 warnings (default), 2 info, 3 debug."""
    _lib.load().kvb_log_set_level(level)
