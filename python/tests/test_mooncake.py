# SPDX-License-Identifier: Apache-2.0
"""kvbridge.mooncake.TransferEngine, method for method, against peers in real processes (Mooncake
drop-ins and native engines): return conventions, every byte verified, failures (unknown segment,
bad addresses, a peer killed mid-transfer and restarted, timeouts), 8 threads at once."""

import signal
import sys
import threading
import time

import numpy as np
import pytest

import kvbridge
from kvbridge import mooncake
from kvbridge.mooncake import TransferEngine, TransferNotify, TransferOpcode
from conftest import (MOONCAKE_TARGET, dead_port, quiet_port, shared_target, start_target,
                      wait_for)
from helpers import addr, digest, pattern


@pytest.fixture
def te():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield e
    e.close()


@pytest.fixture(params=["mooncake", "native"])
def peer(request, spawn_shared):
    """A target process running either API, 4 MiB of pattern(1) registered (shared by the
    module's tests, reset for each)."""
    return shared_target(spawn_shared, request.param)


def test_module_surface():
    assert TransferOpcode.Read == TransferOpcode.READ == 0 == mooncake.Read
    assert TransferOpcode.Write == TransferOpcode.WRITE == 1 == mooncake.Write
    assert TransferEngine.TransferOpcode is TransferOpcode
    n = TransferNotify("a", "b")
    assert (n.name, n.msg) == ("a", "b") and TransferNotify().name == ""
    assert "initialize" in mooncake.DEVIATIONS


def test_initialize_variants(caplog):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    with pytest.warns(RuntimeWarning, match="no RDMA path"):
        TransferEngine._warned_rdma = False
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # already initialized
    port = e.get_rpc_port()
    assert port > 0 and e.get_session_id() == f"127.0.0.1:{port}"
    e.close()
    e.close()
    with pytest.raises(RuntimeError):
        e.get_rpc_port()
    p = dead_port()
    e2 = TransferEngine()
    assert e2.initialize(f"127.0.0.1:{p}", "P2PHANDSHAKE", "tcp", "") == 0
    assert p <= e2.get_rpc_port() <= p + 1000  # p itself unless another process took it since
    e2.close()
    e3 = TransferEngine()  # a store that is not there: create fails
    assert e3.initialize_ext("127.0.0.1", f"127.0.0.1:{dead_port()}", "tcp", "", "http") == -1
    e4 = TransferEngine()  # a non-loopback host without a cluster secret is refused
    assert e4.initialize("0.0.0.0", "P2PHANDSHAKE", "tcp", "") == -1
    e5 = TransferEngine(secret=b"k" * 32)
    assert e5.initialize("0.0.0.0", "P2PHANDSHAKE", "tcp", "") == 0
    e5.close()
    with pytest.raises(NotImplementedError):
        e5.get_engine()
    with pytest.raises(NotImplementedError):
        e5.get_engine_ptr()
    assert e5.get_local_topology() == "{}" and e5.warmup_efa_segment("x") == 0


def test_register_memory(te):
    a = np.zeros(1 << 16, np.uint8)
    b = np.zeros(1 << 16, np.uint8)
    assert te.register_memory(addr(a), a.nbytes) == 0
    assert te.register_memory(addr(a) + 8, 8) == -1  # overlaps
    assert te.unregister_memory(addr(a)) == 0
    assert te.unregister_memory(addr(a)) == -1
    assert te.batch_register_memory([addr(a), addr(b)], [a.nbytes]) == -1
    assert te.batch_register_memory([addr(a), addr(b)], [a.nbytes, b.nbytes], "cpu:0") == 0
    assert te.register_memory(addr(b), 1, "cuda:99") == -1
    assert te.batch_unregister_memory([addr(a), addr(b)]) == 0
    assert te.batch_unregister_memory([addr(a)]) == -1
    # a failing batch undoes what it registered
    assert te.batch_register_memory([addr(a), addr(a)], [16, 16]) == -1
    assert te.register_memory(addr(a), 16) == 0


def test_sync_transfers_every_byte(te, peer):
    name, raddr, n = peer["name"], peer["addr"], peer["size"]
    local = np.zeros(n, np.uint8)
    assert te.register_memory(addr(local), n) == 0
    assert te.transfer_sync_read(name, addr(local), raddr, n) == 0
    assert np.array_equal(local, pattern(1, n))
    src = pattern(5, n)
    assert te.register_memory(addr(src), n) == 0
    assert te.transfer_sync_write(name, addr(src), raddr, n) == 0
    assert peer["peer"].run("result = digest(buf)") == digest(src)
    # scattered blocks, the way a paged KV cache moves
    blocks = [7, 3, 12, 0]
    bs = 64 << 10
    assert te.batch_transfer_sync_write(name, [addr(src) + i * bs for i in range(4)],
                                        [raddr + b * bs for b in blocks], [bs] * 4) == 0
    local[:] = 0
    assert te.batch_transfer_sync_read(name, [addr(local) + b * bs for b in blocks],
                                       [raddr + b * bs for b in blocks], [bs] * 4) == 0
    for i, b in enumerate(blocks):
        assert np.array_equal(local[b * bs:(b + 1) * bs], src[i * bs:(i + 1) * bs])
    assert te.batch_transfer_sync_read(name, [addr(local)], [raddr], [1, 2]) == -1
    assert te.batch_transfer_sync_write(name, [], [], []) == 0
    assert te.transfer_sync(name, addr(local), raddr, 10, TransferOpcode.READ) == 0
    assert te.batch_transfer_sync(name, [addr(src)], [raddr], [10], TransferOpcode.Write) == 0
    assert te.get_first_buffer_address(name) == raddr


def test_failures(te, peer):
    name, raddr = peer["name"], peer["addr"]
    local = np.zeros(4096, np.uint8)
    te.register_memory(addr(local), local.nbytes)
    unknown = f"127.0.0.1:{dead_port()}"
    assert te.transfer_sync_read(unknown, addr(local), raddr, 16) == -1
    assert te.batch_transfer_async_read(unknown, [addr(local)], [raddr], [16]) == 0
    assert te.transfer_submit_write(unknown, addr(local), raddr, 16) == 0
    assert te.send_probe(unknown) == -1
    assert te.get_first_buffer_address(unknown) == 0
    assert te.transfer_sync_read(name, addr(local), raddr - 4096, 16) == -1  # bad remote
    assert te.transfer_sync_write(name, 8, raddr, 16) == -1  # bad local
    assert te.get_batch_transfer_status([12345]) == -1
    assert te.transfer_check_status(12345) == -1
    assert te.transfer_sync_read(name, addr(local), raddr, 4096) == 0  # still fine


def test_async_and_status(te, peer):
    name, raddr, n = peer["name"], peer["addr"], peer["size"]
    local = np.zeros(n, np.uint8)
    te.register_memory(addr(local), n)
    half = n // 2
    ids = [te.batch_transfer_async_read(name, [addr(local)], [raddr], [half]),
           te.batch_transfer_async(name, [addr(local) + half], [raddr + half], [half],
                                   TransferOpcode.READ)]
    assert all(ids) and ids[0] != ids[1]
    assert te.get_batch_transfer_status(ids) == 0
    assert np.array_equal(local, pattern(1, n))
    assert te.get_batch_transfer_status(ids) == -1  # freed
    src = pattern(6, 4096)
    te.register_memory(addr(src), 4096)
    bid = te.batch_transfer_async_write(name, [addr(src)], [raddr], [4096])
    bad = te.batch_transfer_async_write(name, [addr(src)], [raddr - 4096], [4096])
    assert bid and bad and te.get_batch_transfer_status([bid, bad]) == -1
    bid = te.transfer_submit_write(name, addr(src), raddr + 4096, 4096)
    assert wait_for(lambda: te.transfer_check_status(bid) != 0)
    assert te.transfer_check_status(bid) == -1  # completed, then freed
    assert peer["peer"].run("result = digest(buf[:8192])") == digest(np.concatenate([src, src]))
    bid = te.transfer_submit_write(name, addr(src), raddr - 4096, 4096)
    assert wait_for(lambda: te.transfer_check_status(bid) == -1)
    # Every request of a batch counts: its first completing is not the batch completing.
    two = te.batch_transfer_async_write(name, [addr(src), addr(src)], [raddr, raddr - 4096],
                                        [4096, 4096])
    seen = []
    assert wait_for(lambda: seen.append(te.transfer_check_status(two)) or seen[-1] != 0)
    assert seen[-1] == -1, seen


def test_pending_timeout_and_peer_killed(spawn):
    # The target takes a port no other socket is handed by the kernel, so that the one that
    # replaces it below finds it free (a port of the ephemeral range could go to another test's
    # connection meanwhile).
    first = spawn()
    t = first.run(MOONCAKE_TARGET.replace('"127.0.0.1", "P2PHANDSHAKE"',
                                          f'"127.0.0.1:{quiet_port()}", "P2PHANDSHAKE"')
                  .format(size=4 << 20))
    t["peer"] = first
    te = TransferEngine(transfer_timeout=0.5, protocol="tcp")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = np.zeros(t["size"], np.uint8)
    te.register_memory(addr(local), local.nbytes)
    name = t["name"]
    assert te.transfer_sync_read(name, addr(local), t["addr"], 4096) == 0
    t["peer"].signal(signal.SIGSTOP)
    bid = te.transfer_submit_write(name, addr(local), t["addr"], 4096)
    assert te.transfer_check_status(bid) == 0  # pending
    seen = []
    assert wait_for(lambda: seen.append(te.transfer_check_status(bid)) or seen[-1] == -2,
                    timeout=5), seen
    assert te.transfer_sync_read(name, addr(local), t["addr"], 4096) == -1  # timed out
    bid = te.batch_transfer_async_read(name, [addr(local)], [t["addr"]], [t["size"]])
    port = int(name.rsplit(":", 1)[1])
    t["peer"].proc.kill()  # mid-transfer
    t["peer"].proc.wait()
    t0 = time.monotonic()
    assert te.get_batch_transfer_status([bid]) == -1
    assert time.monotonic() - t0 < 3
    # a new process on the same port: the next call reconnects - an asynchronous one too, with
    # no probe or synchronous call between (the lost peer's segment was kept, and every
    # asynchronous transfer to it failed)
    p2 = spawn()
    code = MOONCAKE_TARGET.replace('"127.0.0.1", "P2PHANDSHAKE"',
                                   f'"127.0.0.1:{port}", "P2PHANDSHAKE"')
    info = p2.run(code.format(size=1 << 20))
    assert info["name"] == name, "the old port was taken by another process meanwhile"
    bid = te.batch_transfer_async_read(name, [addr(local)], [info["addr"]], [4096])
    assert bid and te.get_batch_transfer_status([bid]) == 0
    assert te.send_probe(name) == 0
    assert te.get_first_buffer_address(name) == info["addr"]
    assert te.transfer_sync_read(name, addr(local), info["addr"], 1 << 20) == 0
    assert np.array_equal(local[:1 << 20], pattern(1, 1 << 20))
    te.close()


def test_failed_read_returns_once_nothing_can_land(spawn):
    """Mooncake's callers reuse a buffer as soon as a transfer reports -1. Over shared memory a
    peer that stalled still owes its copy: the call returns only once the peer has answered (it
    copies nothing past the deadline), and the buffer stays as it was."""
    t = start_target(spawn, kind="mooncake")
    te = TransferEngine(transfer_timeout=0.5)
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0  # same host: shm
    at = te.allocate_managed_buffer(t["size"])  # memfd: the peer maps it and copies itself
    local = np.frombuffer(kvbridge.view(at, t["size"]), np.uint8)
    name = t["name"]
    assert te.transfer_sync_read(name, at, t["addr"], 4096) == 0  # linked
    assert te._eng().stats().bytes("shm") == 4096
    local[:] = 0
    t["peer"].signal(signal.SIGSTOP)
    out = {}

    def read():
        out["rc"] = te.transfer_sync_read(name, at, t["addr"], t["size"])
        out["at"] = time.monotonic()

    th = threading.Thread(target=read)
    th.start()
    time.sleep(1.5)  # past the 0.5 s deadline
    assert th.is_alive(), "returned while the stopped peer still owed its copy"
    resumed = time.monotonic()
    t["peer"].signal(signal.SIGCONT)
    th.join(10)
    assert out["rc"] == -1
    assert out["at"] >= resumed
    assert not local.any(), "the resumed peer copied past the deadline"
    assert te.transfer_sync_read(name, at, t["addr"], t["size"]) == 0
    assert np.array_equal(local, pattern(1, t["size"]))
    del local
    te.close()


def test_notifies(te, peer):
    name, raddr = peer["name"], peer["addr"]
    src = pattern(9, 1 << 16)
    te.register_memory(addr(src), src.nbytes)
    assert te.transfer_sync(name, addr(src), raddr, src.nbytes, TransferOpcode.WRITE,
                            TransferNotify("req-7", "kv done")) == 0
    assert te.batch_transfer_sync(name, [addr(src)], [raddr], [16], TransferOpcode.WRITE,
                                  TransferNotify(te.get_session_id(), "plain")) == 0
    if peer["peer"].run("result = 'te' in globals()"):
        got = peer["peer"].run(
            "import time\nr = []\nfor _ in range(100):\n"
            "    r += [[n.name, n.msg] for n in te.get_notifies()]\n"
            "    if len(r) >= 2: break\n    time.sleep(0.02)\nresult = r")
        assert got == [["req-7", "kv done"], [te.get_session_id(), "plain"]]
    else:  # a native receiver sees the plain message as sent
        got = peer["peer"].run("n1 = eng.notify_recv(5); n2 = eng.notify_recv(5); "
                               "result = [n2.sender, n2.data.decode()]")
        assert got == [te.get_session_id(), "plain"]
    assert peer["peer"].run("result = digest(buf[:%d])" % src.nbytes) == digest(src)
    # a native sender's notification reaches get_notifies() with its segment name
    peer["peer"].run(
        "import kvbridge\nx = kvbridge.Engine(); s = x.open_segment(%r); "
        "x.notify_send(s, 'hi'); result = x.name" % te.get_session_id())
    assert wait_for(lambda: bool(_collect(te)))
    assert te._got[-1].msg == "hi"
    assert te.get_notifies() == []


def _collect(te):
    got = te.get_notifies()
    te._got = getattr(te, "_got", []) + got
    return got


def test_managed_buffers(te):
    a = te.allocate_managed_buffer(100)
    b = te.allocate_managed_buffer(100)
    assert a and b and a != b
    assert te.write_bytes_to_buffer(a, b"hello world", 5) == 0
    assert te.read_bytes_from_buffer(a, 5) == b"hello"
    assert te.free_managed_buffer(a, 100) == 0
    assert te.allocate_managed_buffer(50) == a  # reused
    big = te.allocate_managed_buffer(80 << 20)
    assert big and te.register_memory(big, 10) == -1  # registered already
    te.write_bytes_to_buffer(big + (80 << 20) - 3, bytearray(b"xyz"), 3)
    assert te.read_bytes_from_buffer(big + (80 << 20) - 3, 3) == b"xyz"
    assert te.free_managed_buffer(big, 80 << 20) == 0
    assert te.free_managed_buffer(b, 1 << 40) == -1
    # Only a buffer in use, with a length of its size class: a second free would hand it out
    # twice, a larger length as a larger buffer running past its slab.
    assert te.free_managed_buffer(b, 1 << 20) == -1
    assert te.free_managed_buffer(b, 100) == 0
    assert te.free_managed_buffer(b, 100) == -1  # freed already
    assert te.free_managed_buffer(12345, 100) == -1  # never handed out
    c, d = te.allocate_managed_buffer(100), te.allocate_managed_buffer(100)
    assert c and d and c != d


def test_managed_buffer_transfer(te, peer):
    buf = te.allocate_managed_buffer(1 << 20)
    assert te.transfer_sync_read(peer["name"], buf, peer["addr"], 1 << 20) == 0
    assert te.read_bytes_from_buffer(buf, 1 << 20) == pattern(1, 1 << 20).tobytes()


def test_eight_threads(te, peer):
    name, raddr, n = peer["name"], peer["addr"], peer["size"]
    part = n // 8
    errs = []

    def worker(k):
        try:
            rng = np.random.default_rng(k)
            mine = np.zeros(part, np.uint8)
            assert te.register_memory(addr(mine), part) == 0
            for i in range(8):
                ln = int(rng.integers(1, part))
                data = rng.integers(0, 256, ln, dtype=np.uint8)
                mine[:ln] = data
                assert te.transfer_sync_write(name, addr(mine), raddr + k * part, ln) == 0
                mine[:] = 0
                if i % 2:
                    bid = te.batch_transfer_async_read(name, [addr(mine)], [raddr + k * part],
                                                       [ln])
                    assert te.get_batch_transfer_status([bid]) == 0
                else:
                    assert te.transfer_sync_read(name, addr(mine), raddr + k * part, ln) == 0
                assert np.array_equal(mine[:ln], data)
                assert te.send_probe(name) == 0
                m = te.allocate_managed_buffer(4096)
                assert m and te.free_managed_buffer(m, 4096) == 0
            assert te.unregister_memory(addr(mine)) == 0
        except BaseException as ex:
            errs.append(ex)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs


def test_install():
    saved = {k: sys.modules.get(k) for k in ("mooncake", "mooncake.engine")}
    try:
        for k in saved:
            sys.modules.pop(k, None)
        assert mooncake.install() is mooncake
        from mooncake.engine import TransferEngine as T, TransferOpcode as O
        import mooncake.engine as me
        assert T is TransferEngine and O is TransferOpcode and me is mooncake
        assert mooncake.install() is mooncake  # idempotent
        import types
        sys.modules["mooncake.engine"] = types.ModuleType("mooncake.engine")
        with pytest.raises(RuntimeError):
            mooncake.install()
        assert mooncake.install(replace=True) is mooncake
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_rdma_on_the_fabric_path(spawn):
    """Where the library has the libfabric path, protocol "rdma" uses it (here over libfabric's
    tcp;ofi_rxm provider, which stands in for verbs) and does not warn."""
    if not kvbridge.has_fabric():
        pytest.skip("this libkvbridge.so has no libfabric data path")
    opts = dict(fabric_provider="tcp;ofi_rxm", protocol="fabric")
    te = TransferEngine(**opts)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") != 0:
            pytest.skip("libfabric's tcp;ofi_rxm provider is not available here")
    p = spawn()
    info = p.run("from kvbridge.mooncake import TransferEngine\n"
                 "te = TransferEngine(fabric_provider='tcp;ofi_rxm', protocol='fabric')\n"
                 "assert te.initialize('127.0.0.1', 'P2PHANDSHAKE', 'rdma', '') == 0\n"
                 "buf = pattern(1, 1 << 20)\nassert te.register_memory(addr(buf), buf.nbytes) == 0\n"
                 "result = [te.get_session_id(), addr(buf)]")
    local = np.zeros(1 << 20, np.uint8)
    assert te.register_memory(addr(local), local.nbytes) == 0
    assert te.transfer_sync_read(info[0], addr(local), info[1], local.nbytes) == 0
    assert np.array_equal(local, pattern(1, 1 << 20))
    assert te.get_kvbridge_engine().stats().bytes("fabric") == 1 << 20
    te.close()
