# SPDX-License-Identifier: Apache-2.0
"""A drop-in for Mooncake's Python binding (`from mooncake.engine import TransferEngine`) on
kvbridge: the same class, methods, arguments, defaults and return conventions (0 / -1 status
ints, batch ids with 0 for failure), so a serving engine switches with an import change:

    from kvbridge.mooncake import TransferEngine      # was: from mooncake.engine import ...

or, for code that cannot be edited, `import kvbridge.mooncake; kvbridge.mooncake.install()`
before it imports `mooncake.engine`. Deviations from Mooncake are listed in DEVIATIONS and in
the README ("Python: Mooncake drop-in"). Every method is thread-safe."""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _lib
from .engine import Batch, Engine, Op, ReqState, Request, Segment, view
from .errors import Error, PeerError, ShutdownError

log = logging.getLogger("kvbridge.mooncake")

P2PHANDSHAKE = "P2PHANDSHAKE"

# Build flags Mooncake's module exports; kvbridge serves CUDA memory itself but has none of these
# Mooncake transports.
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_CUDA = False

DEVIATIONS = """\
- initialize(): `protocol` "tcp" (and "", None) selects kvbridge's "auto" data paths (same-host
  shared memory, else TCP); "rdma" and "efa" add the libfabric path where the library has one and a
  provider runs here ("efa" names the provider), else they run on TCP/shared memory with one
  warning; other Mooncake protocols (nvlink, hip, ...) fail (-1).
  `device_name` is ignored. A bare metadata address means etcd, as in Mooncake.
- Peers authenticate with the cluster secret: set KVB_SECRET_FILE (or TransferEngine(secret=...))
  on every process; binding a non-loopback local_hostname without one fails (-1) unless
  TransferEngine(insecure=True).
- TransferNotify.name on the receiving side is the name the sender put in its TransferNotify; when
  the sender gave none (or its own segment name), it is the sender's authenticated segment name.
- Batch ids are small integers, not pointers; an unknown id is a failure (-1), not a crash.
- allocate_managed_buffer() hands out kvb_alloc (memfd) memory from size-class pools of 64 MiB
  slabs (Mooncake: 2 GiB), so same-host peers copy with one memcpy; sizes over 64 MiB get their own
  allocation.
- unregister_memory() waits until no transfer uses the memory (kvb_unregister) before returning.
- get_batch_transfer_status() waits for every batch (each bounded by its deadline) instead of
  returning at the first failure with the others still in flight; it frees them all either way.
- get_first_buffer_address() is the peer's lowest-addressed region (Mooncake: its first
  registered one); the C API lists regions sorted by address.
- transport_hint is accepted and ignored; the CUDA-stream calls (transfer_*_on_cuda), shared
  segments and the RPC interface are not provided.
- get_engine() / get_engine_ptr() raise NotImplementedError (there is no Mooncake engine object);
  get_local_topology() returns "{}"; warmup_efa_segment() is a no-op returning 0.
- Timeouts: MC_TRANSFER_TIMEOUT (seconds, at least 5; default 30) plus one second per GB, as in
  Mooncake, but as a per-request deadline enforced by the engine (no polling loop).
- A failed transfer reports -1 (-2 from transfer_check_status) only once no byte of it can still
  land in its local buffers: over shared memory (or RDMA) a peer that was late may still be
  copying, so the call waits for its answer, at most the engine's peer timeout (5 s unless
  peer_timeout_ms says otherwise) and a second, when the connection to a peer that never answered
  is gone; Mooncake returns at once, and a buffer reused then could take stale bytes.
- transfer_check_status() frees a batch that timed out (-2) as it does a failed one.
"""


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode enum (pybind11 exports Read/Write, and READ/WRITE on the class)."""
    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


# pybind11's export_values() puts the values in the module namespace too.
Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: `name` (who it is from, or a name the sender chose) and `msg`."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name,
                                                                                other.msg)


# A notification whose name differs from the sender's segment name carries it in front of the
# message: magic, 2-byte length, name. Plain messages (from native senders too) have no header.
_NOTIFY_MAGIC = b"\x00KVBMCN1"

_SLAB = 64 << 20
_SETTLE_MARGIN_S = 1.0  # past the engine's peer timeout, which ends every op still held
_CLASSES = [8 << 10 << i for i in range(14)]  # 8 KiB .. 64 MiB


def _enc(s: Any) -> bytes:
    if isinstance(s, bytes):
        return s
    return str(s).encode("utf-8", "surrogateescape")


def _dec(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


class TransferEngine:
    """Mooncake's TransferEngine on kvbridge. Construct, then initialize(...).

    Keyword arguments are kvbridge's, not Mooncake's, and all optional: `transfer_timeout`
    (seconds; replaces MC_TRANSFER_TIMEOUT's base), and the rest go to kvbridge.Engine (secret,
    insecure, lanes, progress_threads, ...), overriding what initialize() derives."""

    TransferOpcode = TransferOpcode

    def __init__(self, transfer_timeout: Optional[float] = None, **engine_options: Any):
        self._opts = dict(engine_options)
        self._engine: Optional[Engine] = None
        self._lock = threading.RLock()
        self._segments: Dict[str, Segment] = {}
        # batch id -> (batch, requests, target, segment): a peer error forgets the segment
        self._batches: Dict[int, Tuple[Batch, int, str, Segment]] = {}
        self._next_id = 1
        self._free: Dict[int, List[int]] = {}  # size class -> free addresses
        self._slabs: List[int] = []
        self._large: Dict[int, int] = {}  # address -> length
        self._out: Dict[int, int] = {}  # small buffers handed out: address -> size class
        timeout = os.environ.get("MC_TRANSFER_TIMEOUT")
        self._timeout_ns = max(5, int(timeout)) * 10**9 if timeout else 30 * 10**9
        if transfer_timeout is not None:
            self._timeout_ns = int(transfer_timeout * 1e9)

    def _settle(self, batch: Batch, what: str) -> None:
        """Waits until no byte of a failed batch can still land in its buffers (the caller
        reuses them as soon as it hears -1): at most the engine's peer timeout and a second, by
        when the connection to a peer that never answered is gone."""
        limit = (self._opts.get("peer_timeout_ms") or 5000) / 1000 + _SETTLE_MARGIN_S
        try:
            if not batch.settle(limit):
                log.error("%s: the peer has not answered in %.0f s; bytes of the failed transfer "
                          "may still land in its local buffers", what, limit)
        except Error as e:
            log.error("%s: cannot settle the failed transfer: %s", what, e)

    # ---- set-up ------------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Starts the engine. `local_hostname` is "host" or "host:port" (the port is the first
        tried; none: any free one); `metadata_server` "P2PHANDSHAKE" (no store: peers open
        "host:port"), or a store ("etcd://", "redis://", "http://"; a bare address is etcd).
        Returns 0, or -1 (the reason is logged)."""
        if metadata_server == P2PHANDSHAKE:
            mtype = ""
        elif "://" in (metadata_server or ""):
            mtype, metadata_server = metadata_server.split("://", 1)
        else:
            mtype = "etcd"
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, mtype)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """initialize() with the store's type given apart ("etcd", "redis", "http")."""
        with self._lock:
            if self._engine is not None:
                log.error("TransferEngine is already initialized")
                return -1
            try:
                opts = self._config(local_hostname, metadata_server, protocol, metadata_type)
                opts.update(self._opts)
                self._engine = Engine(**opts)
                if (protocol or "").lower() in ("rdma", "efa") and \
                        not self._engine.fabric_provider:
                    self._warn_no_rdma(protocol)
            except (Error, ValueError, TypeError) as e:
                log.error("initialize(%r, %r, %r) failed: %s", local_hostname, metadata_server,
                          protocol, e)
                return -1
            return 0

    def _config(self, local_hostname: str, metadata_server: str, protocol: Optional[str],
                metadata_type: str) -> Dict[str, Any]:
        host, port = local_hostname or "127.0.0.1", 0
        if host.startswith("[") and "]:" in host:  # [v6]:port
            h, p = host[1:].split("]:", 1)
            host, port = h, int(p)
        elif host.count(":") == 1:
            h, p = host.split(":")
            host, port = h, int(p)
        host = host.strip("[]")
        opts: Dict[str, Any] = {"bind_addr": host, "port": port}
        if port:
            opts["port_max"] = min(port + 1000, 65535)  # Mooncake also moves on when it is taken
        if metadata_server == P2PHANDSHAKE or not metadata_type:
            opts["metadata"] = "p2p"
        else:
            opts["metadata"] = f"{metadata_type}://{metadata_server}"
            opts["segment_name"] = local_hostname  # Mooncake names the segment after the host
        opts.update(self._protocol(protocol))
        return opts

    @staticmethod
    def _protocol(protocol: Optional[str]) -> Dict[str, Any]:
        """Engine options for a Mooncake protocol name."""
        p = (protocol or "tcp").lower()
        if p in ("tcp", "auto"):
            return {"protocol": "auto"}
        if p in ("rdma", "efa"):
            if _lib.has_fabric():
                # "auto" tries shm, then the fabric path, then TCP; "efa" names its provider.
                return {"protocol": "auto", "fabric_provider": "efa" if p == "efa" else None}
            return {"protocol": "auto"}  # initialize() warns that no RDMA path runs
        raise ValueError(f"protocol {protocol!r} is not supported by kvbridge "
                         "(use tcp, rdma or efa)")

    @staticmethod
    def _warn_no_rdma(protocol: str) -> None:
        if TransferEngine._warned_rdma:
            return
        TransferEngine._warned_rdma = True
        warnings.warn(f"kvbridge: protocol {protocol!r}: no RDMA path runs here; using TCP and "
                      "same-host shared memory", RuntimeWarning, stacklevel=4)

    _warned_rdma = False

    def _eng(self) -> Engine:
        e = self._engine
        if e is None:
            raise RuntimeError("TransferEngine is not initialized")
        return e

    def get_rpc_port(self) -> int:
        """The port peers reach this engine on (its segment is "host:port" in P2P mode)."""
        return self._eng().port

    def get_session_id(self) -> str:
        """This engine's segment name (what peers pass as target_hostname)."""
        return self._eng().name

    # ---- memory ------------------------------------------------------------------------------
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers [buffer_addr, buffer_addr+capacity) for reads and writes: 0 / -1."""
        try:
            self._eng().register(int(buffer_addr), int(capacity), location=location)
            return 0
        except (Error, RuntimeError, ValueError) as e:
            log.error("register_memory(%#x, %d) failed: %s", int(buffer_addr), int(capacity), e)
            return -1

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the region at buffer_addr (waits until no transfer uses it): 0 / -1."""
        try:
            self._eng().unregister(int(buffer_addr))
            return 0
        except (Error, RuntimeError) as e:
            log.error("unregister_memory(%#x) failed: %s", int(buffer_addr), e)
            return -1

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """Registers each (address, capacity); on a failure the ones registered are undone."""
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: lists differ in length")
            return -1
        done: List[int] = []
        for a, c in zip(buffer_addresses, capacities):
            if self.register_memory(a, c, location) != 0:
                for d in done:
                    self.unregister_memory(d)
                return -1
            done.append(a)
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters each address; -1 if any failed (the others are still unregistered)."""
        rc = 0
        for a in buffer_addresses:
            rc |= self.unregister_memory(a)
        return -1 if rc else 0

    def allocate_managed_buffer(self, length: int) -> int:
        """Registered memory of at least `length` bytes from the engine's pools; 0 on failure."""
        try:
            e = self._eng()
            with self._lock:
                cls = next((i for i, c in enumerate(_CLASSES) if length <= c), None)
                if cls is None:
                    addr = e.alloc(length)
                    try:
                        e.register(addr, length)
                    except Error:
                        e.free(addr)
                        raise
                    self._large[addr] = length
                    return addr
                free = self._free.setdefault(cls, [])
                if not free:
                    slab = e.alloc(_SLAB)
                    try:
                        e.register(slab, _SLAB)
                    except Error:
                        e.free(slab)
                        raise
                    self._slabs.append(slab)
                    free.extend(range(slab + _SLAB - _CLASSES[cls], slab - 1, -_CLASSES[cls]))
                addr = free.pop()
                self._out[addr] = cls
                return addr
        except (Error, RuntimeError) as ex:
            log.error("allocate_managed_buffer(%d) failed: %s", length, ex)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Returns a managed buffer (with the length it was allocated with): 0 / -1."""
        try:
            e = self._eng()
            with self._lock:
                if buffer_addr in self._large:
                    e.unregister(buffer_addr)  # BusyError: still in use, kept (call again)
                    del self._large[buffer_addr]
                    e.free(buffer_addr)
                    return 0
                # Only a buffer handed out and not yet returned, with a length of its size
                # class: a second free (two later allocations would share it) or a larger length
                # (it would be handed out as a larger buffer, past its slab) is refused.
                cls = next((i for i, c in enumerate(_CLASSES) if length <= c), None)
                if self._out.get(buffer_addr) is None:
                    log.error("free_managed_buffer(%#x): not a managed buffer in use",
                              buffer_addr)
                    return -1
                if cls != self._out[buffer_addr]:
                    log.error("free_managed_buffer(%#x, %d): it was allocated with a length of "
                              "another size class", buffer_addr, length)
                    return -1
                del self._out[buffer_addr]
                self._free.setdefault(cls, []).append(buffer_addr)
                return 0
        except (Error, RuntimeError) as ex:
            log.error("free_managed_buffer(%#x) failed: %s", buffer_addr, ex)
            return -1

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies `length` bytes of `src_ptr` to dest_address: 0."""
        view(int(dest_address), int(length))[:] = memoryview(src_ptr).cast("B")[:length]
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """The `length` bytes at source_address."""
        return bytes(view(int(source_address), int(length)))

    # ---- segments ----------------------------------------------------------------------------
    def _segment(self, target: str) -> Segment:
        with self._lock:
            seg = self._segments.get(target)
            if seg is not None:
                return seg
        seg = self._eng().open_segment(target)  # outside the lock: may block for the handshake
        with self._lock:
            old = self._segments.get(target)
            if old is not None:
                seg.close()  # another thread opened it meanwhile: one reference is enough
                return old
            self._segments[target] = seg
            return seg

    def _drop_segment(self, target: str, seg: Segment) -> None:
        """Forgets a segment whose peer is lost, so the next call reopens (reconnects) it."""
        with self._lock:
            if self._segments.get(target) is seg:
                del self._segments[target]
            else:
                return
        try:
            seg.close()
        except Error:
            pass

    def _timeout(self, total: int) -> float:
        return (self._timeout_ns + total) / 1e9  # Mooncake: the base plus 1 GB/s

    def _submit(self, target: str, buffers: Sequence[int], peers: Sequence[int],
                lengths: Sequence[int], op: int,
                notify: Optional[TransferNotify] = None) -> Tuple[Batch, Segment]:
        if not (len(buffers) == len(peers) == len(lengths)):
            raise ValueError("buffers, peer_buffer_addresses and lengths differ in length")
        seg = self._segment(target)
        reqs = [Request(Op(int(op)), int(b), seg, int(p), int(n))
                for b, p, n in zip(buffers, peers, lengths)]
        msg = self._notify_bytes(notify) if notify is not None else None
        try:
            return self._eng().submit(reqs, timeout=self._timeout(sum(lengths)), notify=msg,
                                      notify_segment=seg), seg
        except Error as e:
            if isinstance(e, PeerError) or e.name == "ERR_BAD_SEGMENT":
                self._drop_segment(target, seg)
            raise

    def _notify_bytes(self, notify: TransferNotify) -> bytes:
        name, msg = _enc(notify.name), _enc(notify.msg)
        if not name or name == self._eng().name.encode():
            return msg
        return _NOTIFY_MAGIC + len(name).to_bytes(2, "little") + name + msg

    def _run(self, target: str, buffers: Sequence[int], peers: Sequence[int],
             lengths: Sequence[int], op: int, notify: Optional[TransferNotify] = None,
             what: str = "transfer") -> int:
        try:
            if len(buffers) == 0 and len(buffers) == len(peers) == len(lengths):
                return 0
            batch, seg = self._submit(target, buffers, peers, lengths, op, notify)
            with batch:
                try:
                    batch.wait()
                except Error as e:
                    if isinstance(e, PeerError):
                        self._drop_segment(target, seg)
                    self._settle(batch, what)
                    raise
            return 0
        except (Error, ValueError, RuntimeError) as e:
            log.error("%s to %s failed: %s", what, target, e)
            return -1

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        """Writes `length` bytes from `buffer` to the peer's address; 0 once they are placed."""
        return self._run(target_hostname, [buffer], [peer_buffer_address], [length],
                         Op.WRITE, what="transfer_sync_write")

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        """Reads `length` bytes from the peer's address into `buffer`; 0 once they are here."""
        return self._run(target_hostname, [buffer], [peer_buffer_address], [length],
                         Op.READ, what="transfer_sync_read")

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode,
                      notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """One READ or WRITE, waited for; `notify` is delivered to the peer after the data."""
        return self._run(target_hostname, [buffer], [peer_buffer_address], [length], opcode,
                         notify, "transfer_sync")

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """WRITEs buffers[i] -> peer_buffer_addresses[i] as one batch: 0 / -1."""
        return self._run(target_hostname, buffers, peer_buffer_addresses, lengths, Op.WRITE,
                         what="batch_transfer_sync_write")

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        """READs peer_buffer_addresses[i] -> buffers[i] as one batch: 0 / -1."""
        return self._run(target_hostname, buffers, peer_buffer_addresses, lengths, Op.READ,
                         what="batch_transfer_sync_read")

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
                            transport_hint: str = "") -> int:
        """One batch of READs or WRITEs, waited for; `notify` follows the data."""
        return self._run(target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                         notify, "batch_transfer_sync")

    def _async(self, target: str, buffers: Sequence[int], peers: Sequence[int],
               lengths: Sequence[int], op: int, what: str) -> int:
        try:
            batch, seg = self._submit(target, buffers, peers, lengths, op)
        except (Error, ValueError, RuntimeError) as e:
            log.error("%s to %s failed: %s", what, target, e)
            return 0
        with self._lock:
            bid = self._next_id
            self._next_id += 1
            self._batches[bid] = (batch, len(buffers), target, seg)
        return bid

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int],
                                   lengths: Sequence[int], transport_hint: str = "") -> int:
        """Submits WRITEs; returns a batch id (0 on failure) for get_batch_transfer_status."""
        return self._async(target_hostname, buffers, peer_buffer_addresses, lengths, Op.WRITE,
                           "batch_transfer_async_write")

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Submits READs; returns a batch id (0 on failure) for get_batch_transfer_status."""
        return self._async(target_hostname, buffers, peer_buffer_addresses, lengths, Op.READ,
                           "batch_transfer_async_read")

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode, transport_hint: str = "") -> int:
        """Submits READs or WRITEs; returns a batch id, 0 on failure."""
        return self._async(target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                           "batch_transfer_async")

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        """Submits one WRITE; returns a batch id (0 on failure) for transfer_check_status."""
        return self._async(target_hostname, [buffer], [peer_buffer_address], [length], Op.WRITE,
                           "transfer_submit_write")

    def _take(self, bid: int) -> Optional[Tuple[Batch, int, str, Segment]]:
        with self._lock:
            return self._batches.pop(int(bid), None)

    def _peer_failed(self, entry: Tuple[Batch, int, str, Segment], peer_lost: bool) -> None:
        """A batch of `entry` failed; a lost peer's segment is forgotten, so the next transfer
        to it reconnects (a restarted peer) rather than fail on the dead connection forever."""
        if peer_lost:
            self._drop_segment(entry[2], entry[3])

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits until every batch has finished and frees them: 0 if all completed, -1 if any
        failed or timed out (or an id is unknown)."""
        entries = []
        rc = 0
        for bid in batch_ids:
            entry = self._take(bid)
            if entry is None:
                log.error("get_batch_transfer_status: unknown batch id %r", bid)
                rc = -1
            else:
                entries.append(entry)
        for entry in entries:
            b = entry[0]
            with b:
                try:
                    b.wait()
                except Error as e:
                    log.error("batch transfer failed: %s", e)
                    self._peer_failed(entry, isinstance(e, PeerError))
                    self._settle(b, "batch transfer")
                    rc = -1
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """Polls a batch: 1 every request completed, 0 one is still pending, -1 one failed, -2
        one timed out (and none failed otherwise). Mooncake polls the first request only, which
        for a batch of several would report one that failed as done. A batch that ended is
        freed (the id is then unknown: -1), a failed one once settled."""
        with self._lock:  # held while polling: another thread may free the batch otherwise
            entry = self._batches.get(int(batch_id))
            if entry is None:
                return -1
            sts = entry[0].statuses()
            if any(x.state == ReqState.PENDING for x in sts):
                return 0
            del self._batches[int(batch_id)]
        bad = [x for x in sts if x.state != ReqState.COMPLETED]
        if bad:  # outside the lock: other transfers go on meanwhile
            self._peer_failed(entry, any(-200 < x.error <= -100 for x in bad))
            self._settle(entry[0], "transfer")
        entry[0].close()
        if not bad:
            return 1
        return -2 if all(x.state == ReqState.TIMEOUT for x in bad) else -1

    # ---- peers -------------------------------------------------------------------------------
    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first region the peer registered; 0 if none (or unreachable)."""
        try:
            seg = self._segment(segment_name)
            try:
                regions = seg.regions(refresh=True)
            except PeerError:
                self._drop_segment(segment_name, seg)
                regions = self._segment(segment_name).regions()
            return regions[0].addr if regions else 0
        except (Error, RuntimeError) as e:
            log.error("get_first_buffer_address(%r) failed: %s", segment_name, e)
            return 0

    def send_probe(self, peer_server_name: str) -> int:
        """Checks that the peer answers (a fresh authenticated handshake): 0, or -1."""
        try:
            seg = self._segment(peer_server_name)
            try:
                seg.refresh()
            except PeerError:
                self._drop_segment(peer_server_name, seg)
                self._segment(peer_server_name)  # reopen: the peer may be back
            return 0
        except (Error, RuntimeError) as e:
            log.info("send_probe(%r) failed: %s", peer_server_name, e)
            return -1

    def get_notifies(self) -> List[TransferNotify]:
        """Every notification received so far (never blocks)."""
        out: List[TransferNotify] = []
        e = self._engine
        if e is None:
            return out
        while True:
            try:
                n = e.notify_recv(0)
            except ShutdownError:  # closed by another thread meanwhile: nothing more to read
                return out
            except Error as ex:
                log.error("get_notifies failed: %s", ex)
                return out
            if n is None:
                return out
            data, name = n.data, n.sender
            if data.startswith(_NOTIFY_MAGIC) and len(data) >= len(_NOTIFY_MAGIC) + 2:
                k = len(_NOTIFY_MAGIC)
                ln = int.from_bytes(data[k:k + 2], "little")
                name, data = _dec(data[k + 2:k + 2 + ln]), data[k + 2 + ln:]
            out.append(TransferNotify(name, _dec(data)))

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """Mooncake's RDMA NIC topology as JSON; kvbridge has none to report: "{}"."""
        return "{}"

    def warmup_efa_segment(self, segment_name: str) -> int:
        """A no-op (as in Mooncake builds without EFA): 0."""
        return 0

    def get_engine(self) -> Any:
        """Not provided: there is no Mooncake engine object behind this class."""
        raise NotImplementedError("kvbridge.mooncake has no Mooncake TransferEngine object; "
                                  "use get_kvbridge_engine() for the kvbridge.Engine")

    def get_engine_ptr(self) -> int:
        """Not provided (see get_engine)."""
        raise NotImplementedError("kvbridge.mooncake has no Mooncake TransferEngine pointer")

    def get_kvbridge_engine(self) -> Engine:
        """The kvbridge.Engine behind this object (kvbridge's own API)."""
        return self._eng()

    def close(self) -> None:
        """Closes segments, frees batches and managed buffers and destroys the engine (Mooncake
        does this in its destructor). Idempotent."""
        with self._lock:
            e, self._engine = self._engine, None
            batches = [entry[0] for entry in self._batches.values()]
            self._batches.clear()
            segs = list(self._segments.values())
            self._segments.clear()
            # The engine's memory goes with it: no buffer of it may be handed out after a new
            # initialize().
            self._free.clear()
            self._slabs.clear()
            self._large.clear()
            self._out.clear()
        for b in batches:
            b.close()
        if e is None:
            return
        for s in segs:
            try:
                s.close()
            except Error:
                pass
        e.close()  # frees kvb_alloc memory too

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def install(replace: bool = False) -> types.ModuleType:
    """Registers this module as `mooncake.engine` (and a `mooncake` package holding it), so code
    doing `from mooncake.engine import TransferEngine` gets kvbridge's. Refuses (RuntimeError) to
    shadow a real mooncake.engine already imported unless `replace`. Returns the module."""
    me = sys.modules[__name__]
    cur = sys.modules.get("mooncake.engine")
    if cur is not None and cur is not me and not replace:
        raise RuntimeError("mooncake.engine is already imported; install(replace=True) to "
                           "replace it")
    pkg = sys.modules.get("mooncake")
    if pkg is None or replace:
        pkg = types.ModuleType("mooncake")
        pkg.__path__ = []  # a package, so `import mooncake.engine` resolves through sys.modules
        pkg.__doc__ = "kvbridge's stand-in for Mooncake (kvbridge.mooncake.install())"
        sys.modules["mooncake"] = pkg
    pkg.engine = me  # type: ignore[attr-defined]
    sys.modules["mooncake.engine"] = me
    return me
