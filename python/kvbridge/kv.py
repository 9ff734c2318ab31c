# SPDX-License-Identifier: Apache-2.0
"""The KV layer's binding (include/kvbridge/kv.h): layouts and their validation, JSON descriptors,
the topology guard, routes and plans, and the agent API - links checked once at open, transfers
that pull or push a request's blocks (whole or layer by layer), completion notices aggregated
over TP ranks."""

from __future__ import annotations

import contextlib
import ctypes
import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _lib
from ._gate import Gate, sliced
from .engine import (Engine, Notification, Op, Request, _b, _ms, _notification, _set_int,
                     _settle)
from .errors import Error, check, make_error

_ERR_TIMEOUT, _ERR_AGAIN = -4, -6

LAYOUT_ATTR = "kvbridge.kv.layout"
ROLE_ATTR = "kvbridge.kv.role"


class SlotKind(enum.IntEnum):
    K = 0
    V = 1
    LATENT = 2
    INDEX = 3
    K_SCALE = 4
    V_SCALE = 5


class Order(enum.IntEnum):
    NONE = 0
    HND = 1
    NHD = 2


class Attn(enum.IntEnum):
    GQA = 1
    MLA = 2


class DType(enum.IntEnum):
    FP32 = 1
    FP16 = 2
    BF16 = 3
    FP8_E4M3 = 4
    FP8_E5M2 = 5
    INT8 = 6
    UINT8 = 7


class Verdict(enum.IntEnum):
    ALLOW_HOMO = 0
    ALLOW_HETERO = 1
    DENY_HETERO = 2
    INVALID_LOCAL = 3
    INVALID_REMOTE = 4


class Role(enum.IntEnum):
    PREFILL = 1
    DECODE = 2


@dataclass
class Slot:
    """One buffer of one layer: num_blocks blocks of block_bytes at base (kvb_kv_slot_t).
    Head-split slots (K, V of GQA) also give num_heads, head_bytes and order."""
    layer: int
    kind: SlotKind
    base: int
    len: int
    block_bytes: int
    num_blocks: int
    num_heads: int = 0
    head_bytes: int = 0
    order: Order = Order.NONE


@dataclass
class Layout:
    """One TP rank's KV cache (kvb_kv_layout_t); the rules are kvb_kv_layout_validate()'s."""
    model: str
    dtype: DType
    tokens_per_block: int
    attn: Attn
    num_kv_heads: int
    num_layers: int
    slots: List[Slot] = field(default_factory=list)
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0

    def _c(self) -> Tuple[Any, Any]:
        """The C struct and its slot array (keep both alive while the struct is used)."""
        arr = (_lib.KvSlot * max(len(self.slots), 1))()
        for i, s in enumerate(self.slots):  # each field checked: ctypes would wrap it silently
            for name, v in (("layer", s.layer), ("kind", int(s.kind)), ("base", s.base),
                            ("len", s.len), ("block_bytes", s.block_bytes),
                            ("num_blocks", s.num_blocks), ("num_heads", s.num_heads),
                            ("head_bytes", s.head_bytes), ("order", int(s.order))):
                _set_int(arr[i], name, v)
        m = self.model.encode()
        if len(m) > _lib.KV_MODEL_MAX:
            raise make_error(-1, f"model id longer than {_lib.KV_MODEL_MAX} bytes")
        c = _lib.KvLayout(m)
        for name, v in (("dtype", int(self.dtype)), ("tokens_per_block", self.tokens_per_block),
                        ("attn", int(self.attn)), ("num_kv_heads", self.num_kv_heads),
                        ("dp_size", self.dp_size), ("dp_rank", self.dp_rank),
                        ("tp_size", self.tp_size), ("tp_rank", self.tp_rank),
                        ("num_layers", self.num_layers)):
            _set_int(c, name, v)
        c.slots = ctypes.cast(arr, ctypes.POINTER(_lib.KvSlot))
        c.num_slots = len(self.slots)
        return c, arr

    @classmethod
    def _from_c(cls, c: Any) -> "Layout":
        slots = [Slot(s.layer, SlotKind(s.kind), s.base, s.len, s.block_bytes, s.num_blocks,
                      s.num_heads, s.head_bytes, Order(s.order)) for s in c.slots[:c.num_slots]]
        return cls(c.model.decode(), DType(c.dtype), c.tokens_per_block, Attn(c.attn),
                   c.num_kv_heads, c.num_layers, slots, c.dp_size, c.dp_rank, c.tp_size,
                   c.tp_rank)

    def validate(self) -> None:
        """Raises InvalidArgError (with the reason naming layer and slot) if the layout is bad."""
        c, _keep = self._c()
        why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
        check(_lib.load().kvb_kv_layout_validate(ctypes.byref(c), why, len(why)),
              "kvb_kv_layout_validate", why.value)

    def check_pair(self, remote: "Layout") -> None:
        """Raises unless this layout and `remote` can be linked (kvb_kv_layout_check_pair)."""
        a, _ka = self._c()
        b, _kb = remote._c()
        why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
        check(_lib.load().kvb_kv_layout_check_pair(ctypes.byref(a), ctypes.byref(b), why,
                                                   len(why)), "kvb_kv_layout_check_pair",
              why.value)

    def topo(self) -> "Topo":
        """The layout's routing topology."""
        c, _keep = self._c()
        t = _lib.KvTopo()
        check(_lib.load().kvb_kv_layout_topo(ctypes.byref(c), ctypes.byref(t)),
              "kvb_kv_layout_topo")
        return Topo(t.dp_size, t.tp_size, Attn(t.attn), t.num_kv_heads, Order(t.order))

    def encode(self) -> str:
        """The layout as the JSON descriptor agents publish."""
        c, _keep = self._c()
        lib = _lib.load()
        n = ctypes.c_size_t()
        rc = lib.kvb_kv_layout_encode(ctypes.byref(c), None, 0, ctypes.byref(n))
        if rc != -15:  # ERR_TOO_LARGE carries the length
            check(rc, "kvb_kv_layout_encode")
        buf = ctypes.create_string_buffer(n.value + 1)
        check(lib.kvb_kv_layout_encode(ctypes.byref(c), buf, len(buf), ctypes.byref(n)),
              "kvb_kv_layout_encode")
        return buf.value.decode()

    @classmethod
    def decode(cls, desc: Union[str, bytes]) -> "Layout":
        """Parses a JSON descriptor strictly (InvalidArgError with the reason)."""
        d = _b(desc) or b""
        lib = _lib.load()
        out = ctypes.POINTER(_lib.KvLayout)()
        why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
        check(lib.kvb_kv_layout_decode(d, len(d), ctypes.byref(out), why, len(why)),
              "kvb_kv_layout_decode", why.value)
        try:
            return cls._from_c(out.contents)
        finally:
            lib.kvb_kv_layout_free(out)


@dataclass(frozen=True)
class Topo:
    """The part of a layout that decides routing (kvb_kv_topo_t)."""
    dp_size: int
    tp_size: int
    attn: Attn
    num_kv_heads: int
    order: Order = Order.NONE

    def _c(self) -> Any:
        return _lib.KvTopo(self.dp_size, self.tp_size, int(self.attn), self.num_kv_heads,
                           int(self.order))


@dataclass(frozen=True)
class Route:
    """One (prefill rank, decode rank) pair and the KV heads it moves (kvb_kv_route_t)."""
    src_rank: int
    dst_rank: int
    head_begin: int
    head_end: int


def guard(local: Union[Layout, Topo], remote: Union[Layout, Topo]) -> Tuple[Verdict, str]:
    """The topology guard on two layouts (kvb_kv_guard) or two topologies (kvb_kv_guard_topo):
    returns the verdict and its reason."""
    lib = _lib.load()
    why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
    if isinstance(local, Layout) and isinstance(remote, Layout):
        a, _ka = local._c()
        b, _kb = remote._c()
        v = lib.kvb_kv_guard(ctypes.byref(a), ctypes.byref(b), why, len(why))
    elif isinstance(local, Topo) and isinstance(remote, Topo):
        ta, tb = local._c(), remote._c()
        v = lib.kvb_kv_guard_topo(ctypes.byref(ta), ctypes.byref(tb), why, len(why))
    else:
        raise TypeError("guard() takes two Layouts or two Topos")
    return Verdict(v), why.value.decode(errors="replace")


def route(prefill: Topo, decode: Topo, decode_dp: int = 0) -> List[Route]:
    """Routes of a request whose decode dp group is `decode_dp` (kvb_kv_route)."""
    lib = _lib.load()
    a, b = prefill._c(), decode._c()
    n = ctypes.c_size_t()
    check(lib.kvb_kv_route(ctypes.byref(a), ctypes.byref(b), decode_dp, None, 0, ctypes.byref(n)),
          "kvb_kv_route")
    arr = (_lib.KvRoute * max(n.value, 1))()
    check(lib.kvb_kv_route(ctypes.byref(a), ctypes.byref(b), decode_dp, arr, n.value,
                           ctypes.byref(n)), "kvb_kv_route")
    return [Route(r.src_rank, r.dst_rank, r.head_begin, r.head_end) for r in arr[:n.value]]


def _u64(xs: Sequence[int]) -> Any:
    return (ctypes.c_uint64 * max(len(xs), 1))(*xs)


def plan(local: Layout, remote: Layout, op: Op, segment: int, src_blocks: Sequence[int],
         dst_blocks: Sequence[int], layers: Optional[Sequence[int]] = None,
         route: Optional[Route] = None) -> List[Request]:
    """Turns block lists into engine requests (kvb_kv_plan): dst_blocks[i] receives
    src_blocks[i]; the sending side is `remote` for READ and `local` for WRITE."""
    lib = _lib.load()
    a, _ka = local._c()
    b, _kb = remote._c()
    src, dst = _u64(src_blocks), _u64(dst_blocks)
    args = _lib.KvPlanArgs()
    args.op, args.segment = int(op), int(segment)
    args.src_blocks, args.num_src = ctypes.cast(src, ctypes.POINTER(ctypes.c_uint64)), len(src_blocks)
    args.dst_blocks, args.num_dst = ctypes.cast(dst, ctypes.POINTER(ctypes.c_uint64)), len(dst_blocks)
    if layers is not None:
        lay = (ctypes.c_uint32 * max(len(layers), 1))(*layers)
        args.layers, args.num_layers = ctypes.cast(lay, ctypes.POINTER(ctypes.c_uint32)), len(layers)
    if route is not None:
        r = _lib.KvRoute(route.src_rank, route.dst_rank, route.head_begin, route.head_end)
        args.route = ctypes.pointer(r)
    reqs = ctypes.POINTER(_lib.Request)()
    n = ctypes.c_size_t()
    why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
    check(lib.kvb_kv_plan(ctypes.byref(a), ctypes.byref(b), ctypes.byref(args), ctypes.byref(reqs),
                          ctypes.byref(n), why, len(why)), "kvb_kv_plan", why.value)
    try:
        return [Request(Op(r.opcode), int(r.local or 0), int(r.segment), int(r.remote), int(r.len))
                for r in reqs[:n.value]]
    finally:
        lib.kvb_kv_plan_free(reqs)


class Agent:
    """One TP rank's KV agent (kvb_kv_agent_create): validates `layout`, registers its buffers
    with `engine` and publishes the layout descriptor. From then on it consumes the engine's
    notifications (others: notify_recv()). Closing it closes its links first (and theirs, their
    transfers); closing the engine closes it. The buffers' memory must outlive the agent."""

    def __init__(self, engine: Engine, layout: Layout, role: Role):
        self.engine = engine
        self.layout = layout
        self.role = Role(role)
        self._c, self._keep = layout._c()
        lib = _lib.load()
        out = ctypes.c_void_p()
        why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
        self._lib = lib
        with engine._gate.use() as eh:  # an engine closing meanwhile waits, then closes us
            check(lib.kvb_kv_agent_create(eh, ctypes.byref(self._c), int(role), ctypes.byref(out),
                                          why, len(why)), "kvb_kv_agent_create", why.value)
            self._gate = Gate(int(out.value or 0), "agent", lib.kvb_kv_agent_destroy,
                              engine._gate)

    def close(self) -> None:
        """Closes its links, unregisters the buffers, withdraws the descriptor, frees the agent.
        Idempotent."""
        self._gate.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # one dropped without close() is freed (its children first)
        try:
            self.close()
        except Exception:
            pass

    def link(self, segment: str) -> "Link":
        """Opens a link to the rank serving `segment` and runs the guard once: IncompatibleError
        with the guard's reason for a refused pair, NotFoundError for a peer without an agent."""
        out = ctypes.c_void_p()
        why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
        with self._gate.use() as h:
            check(self._lib.kvb_kv_link_open(h, _b(segment), ctypes.byref(out), why, len(why)),
                  f"kvb_kv_link_open({segment!r})", why.value)
            return Link(self, int(out.value), segment)

    def expect(self, req_id: str, links: Sequence["Link"], timeout: float = 30.0) -> None:
        """Announces that `req_id` will be reported by every rank among `links` that routes here
        within `timeout` seconds. Call before those ranks can finish."""
        with contextlib.ExitStack() as held, self._gate.use() as h:
            arr = (ctypes.c_void_p * max(len(links), 1))(
                *[held.enter_context(l._gate.use()) for l in links])
            check(self._lib.kvb_kv_expect(h, _b(req_id), arr, len(links), _ms(timeout)),
                  f"kvb_kv_expect({req_id!r})")

    def wait(self, req_id: str, timeout: Optional[float] = None) -> bool:
        """Waits for `req_id`: True once every expected rank reported success, False if
        `timeout` seconds (None: the request's deadline; 0 polls) passed first; raises the first
        error a rank reported, PeerLostError once an expected rank's engine is gone (and the
        notices it sent before going are read), TimedOutError at the deadline, ShutdownError if
        the agent is closed meanwhile (within about 0.1 s)."""
        rid = _b(req_id)
        rc = sliced(self._gate, lambda h, ms: self._lib.kvb_kv_wait(h, rid, ms), timeout,
                    _ERR_AGAIN)
        if rc == _ERR_AGAIN:
            return False
        check(rc, f"kvb_kv_wait({req_id!r})")
        return True

    def notify_recv(self, timeout: Optional[float] = 0) -> Optional[Notification]:
        """A notification that was not the agent's; like Engine.notify_recv()."""
        raw = _lib.Notification()
        rc = sliced(self._gate,
                    lambda h, ms: self._lib.kvb_kv_agent_notify_recv(h, ctypes.byref(raw), ms),
                    timeout, _ERR_TIMEOUT)
        return _notification(rc, raw, "kvb_kv_agent_notify_recv")


class Link:
    """A link from an agent to one rank of the other side, checked once when opened."""

    def __init__(self, agent: Agent, handle: int, segment: str):
        self.agent = agent
        self.segment = segment
        self._lib = agent._lib
        self._gate = Gate(handle, "link", self._lib.kvb_kv_link_close, agent._gate)

    def close(self) -> None:
        """Frees its transfers (cancelling what is pending), then the link. Idempotent."""
        self._gate.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # one dropped without close() is freed (its children first)
        try:
            self.close()
        except Exception:
            pass

    @property
    def verdict(self) -> Verdict:
        """The guard's verdict (ALLOW_HOMO or ALLOW_HETERO)."""
        with self._gate.use() as h:
            return Verdict(self._lib.kvb_kv_link_verdict(h))

    @property
    def has_route(self) -> bool:
        """True if the two ranks of this link exchange data."""
        with self._gate.use() as h:
            return bool(self._lib.kvb_kv_link_has_route(h))

    @property
    def remote_layout(self) -> Layout:
        """The remote rank's layout, as published."""
        with self._gate.use() as h:
            return Layout._from_c(self._lib.kvb_kv_link_layout(h).contents)

    def begin(self, req_id: str, op: Op, src_blocks: Sequence[int], dst_blocks: Sequence[int],
              timeout: float = 30.0) -> "Transfer":
        """Plans a transfer of `req_id`: READ from the decode side (pull), WRITE from the
        prefill side (push); dst_blocks[i] (decode) receives src_blocks[i] (prefill). Nothing
        moves until Transfer.layer() or Transfer.all(). `timeout` bounds the whole transfer,
        from now: a layer started after it fails with a timeout, and so does finish()."""
        if len(src_blocks) != len(dst_blocks):
            raise make_error(-1, "src_blocks and dst_blocks differ in length")
        src, dst = _u64(src_blocks), _u64(dst_blocks)
        out = ctypes.c_void_p()
        why = ctypes.create_string_buffer(_lib.KV_REASON_MAX)
        with self._gate.use() as h:
            check(self._lib.kvb_kv_xfer_begin(h, _b(req_id), int(op), src, dst, len(src_blocks),
                                              _ms(timeout), ctypes.byref(out), why, len(why)),
                  f"kvb_kv_xfer_begin({req_id!r})", why.value)
            return Transfer(self, int(out.value))

    def pull(self, req_id: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
             timeout: float = 30.0) -> None:
        """Decode side: reads the request's blocks from the prefill rank, then tells it they
        landed. Raises the first error."""
        with self.begin(req_id, Op.READ, src_blocks, dst_blocks, timeout) as x:
            _all_then_finish(x)

    def give_up(self, req_id: str, timeout: float = 5.0) -> None:
        """Tells the other side that `req_id` will not be transferred over this link at all: its
        wait() raises CanceledError now (a prefill frees a leased prompt at once)."""
        with self._gate.use() as h:
            check(self._lib.kvb_kv_give_up(h, _b(req_id), _ms(timeout)),
                  f"kvb_kv_give_up({req_id!r})")

    def push(self, req_id: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
             timeout: float = 30.0) -> None:
        """Prefill side: writes the request's blocks to the decode rank (all layers), then
        tells it they landed. For layer-wise push use begin(..., Op.WRITE, ...) and layer()."""
        with self.begin(req_id, Op.WRITE, src_blocks, dst_blocks, timeout) as x:
            _all_then_finish(x)


def _all_then_finish(x: "Transfer") -> None:
    """Starts every layer and finishes the transfer - finished also when a layer could not
    start, so that the other side hears of the failure now rather than at its deadline (a
    transfer freed unfinished tells it nothing). Raises the first error."""
    try:
        x.all()
    except Error:
        try:
            x.finish()
        except Error:
            pass
        raise
    x.finish()


class Transfer:
    """One request's blocks over one link (kvb_kv_xfer_*)."""

    def __init__(self, link: Link, handle: int):
        self.link = link  # kept alive while the transfer is (the link's close still closes it)
        self._lib = link._lib
        self._gate = Gate(handle, "transfer", self._lib.kvb_kv_xfer_free, link._gate)

    def layer(self, layer: int) -> None:
        """Layer `layer` is ready: its blocks start moving now (each layer at most once)."""
        with self._gate.use() as h:
            check(self._lib.kvb_kv_xfer_layer(h, layer), f"kvb_kv_xfer_layer({layer})")

    def all(self) -> None:
        """Starts every layer not yet started."""
        with self._gate.use() as h:
            check(self._lib.kvb_kv_xfer_all(h), "kvb_kv_xfer_all")

    def finish(self) -> None:
        """Waits until every started layer landed, then notifies the other side of the outcome.
        Raises the first error. Call once."""
        with self._gate.use() as h:
            check(self._lib.kvb_kv_xfer_finish(h), "kvb_kv_xfer_finish")

    def settle(self, timeout: float = 0.0) -> bool:
        """Waits up to `timeout` seconds (0: polls) until no byte of the transfer can still land
        in this side's memory (kvb_kv_xfer_settle). True once settled. After a failed pull, keep
        the destination blocks out of use until it is."""
        with self._gate.use() as h:
            return _settle(self._lib.kvb_kv_xfer_settle, h, timeout, "kvb_kv_xfer_settle")

    def close(self) -> None:
        """Frees the transfer, cancelling what is pending. Idempotent."""
        self._gate.close()

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # one dropped without close() is freed (its children first)
        try:
            self.close()
        except Exception:
            pass
