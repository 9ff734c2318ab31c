# SPDX-License-Identifier: Apache-2.0
"""The native API (kvbridge.Engine, Segment, Batch, notifications, stats) against peers in real
processes: every byte verified, failures (unknown segment, bad addresses, a stopped peer, a peer
killed mid-transfer, timeouts), 8 threads at once."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import kvbridge
from kvbridge import Engine, Op, ReqState, Request, errors
from conftest import dead_port, start_target
from helpers import addr, digest, local_and_segment, pattern


def test_status_names_and_classes():
    assert kvbridge.status_name(-100) == "ERR_PEER_LOST"
    assert "peer lost" in kvbridge.strerror(-100)
    e = errors.make_error(-100, "ctx")
    assert isinstance(e, errors.PeerLostError) and isinstance(e, kvbridge.PeerError)
    assert (e.status, e.name) == (-100, "ERR_PEER_LOST") and "ctx" in str(e)
    assert isinstance(errors.make_error(-4), TimeoutError)
    assert isinstance(errors.make_error(-200), kvbridge.RemoteError)
    assert type(errors.make_error(-77)) is kvbridge.LocalError  # a code this version lacks
    assert kvbridge.library_path()


def test_engine_config_and_lifetime():
    with Engine(lanes=1, timeout_ms=2000, segment_name="py-test-seg", secret=b"s" * 16) as e:
        assert e.name == "py-test-seg" and e.port > 0 and not e.closed
        assert "py-test-seg" in repr(e)
    assert e.closed
    e.close()  # idempotent
    with pytest.raises(errors.ShutdownError):
        e.register(1, 1)
    with pytest.raises(TypeError):
        Engine(no_such_option=1)
    assert issubclass(errors.InvalidArgError, ValueError)
    with pytest.raises(errors.InvalidArgError):
        Engine(bind_addr="0.0.0.0")  # not loopback and no secret
    with pytest.raises(errors.InvalidArgError):
        Engine(lanes=99)
    for bad in ({"port": 70000}, {"port": -1}, {"timeout_ms": -1}, {"lanes": 1 << 40}):
        with pytest.raises(errors.InvalidArgError):  # ctypes would wrap it: port 70000 as 4464
            Engine(**bad)


def test_register_forms():
    with Engine() as e:
        arr = np.zeros(8192, np.uint8)
        assert e.register(arr) == (addr(arr), 8192)
        with pytest.raises(errors.OverlapError):
            e.register(addr(arr) + 100, 10)
        e.unregister(arr)
        ba = bytearray(4096)
        a, n = e.register(ba, access=kvbridge.ACCESS_READ)
        assert n == 4096
        e.unregister(a)

        class FakeTensor:  # what torch.Tensor offers
            def __init__(self, a):
                self.a = a

            def data_ptr(self):
                return addr(self.a)

            nbytes = property(lambda self: self.a.nbytes)

        t = FakeTensor(np.zeros(1000, np.float32))
        assert e.register(t) == (addr(t.a), 4000)
        e.unregister(addr(t.a))
        ro = np.zeros(100, np.uint8)
        ro.setflags(write=False)
        with pytest.raises(errors.InvalidArgError):  # a peer's WRITE would change it
            e.register(ro, access=kvbridge.ACCESS_RW)
        assert e.register(ro)[1] == 100  # for peers' READs only
        e.unregister(ro)
        with pytest.raises(ValueError):
            e.register(b"read-only bytes")
        with pytest.raises(ValueError):
            e.register(np.zeros((4, 4), np.uint8)[:, 1])  # not contiguous
        with pytest.raises(errors.NotFoundError):
            e.unregister(12345)
        with pytest.raises(errors.InvalidArgError):
            e.register(addr(arr), 10, location="tpu:0")
        p = e.alloc(1 << 20)
        v = kvbridge.view(p, 1 << 20)
        v[:4] = b"abcd"
        e.register(p, 1 << 20)
        with pytest.raises(errors.BusyError):
            e.free(p)
        e.unregister(p)
        e.free(p)


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_read_write_every_byte(spawn, protocol):
    t = start_target(spawn, protocol=protocol)
    n = t["size"]
    with Engine(protocol=protocol) as e:
        local = np.zeros(n, np.uint8)
        e.register(local)
        with e.open_segment(t["name"]) as seg:
            assert seg.transport == ("tcp" if protocol == "tcp" else "shm")
            assert seg.regions() == [kvbridge.RegionInfo(t["addr"], n, 3, "cpu")]
            # READ everything in uneven pieces
            cuts = [0, 1, 4095, 70000, 1 << 20, n]
            reqs = [Request(Op.READ, addr(local) + a, seg, t["addr"] + a, b - a)
                    for a, b in zip(cuts, cuts[1:])]
            with e.submit(reqs) as b:
                assert b.wait(10) and len(b) == 5
                assert [s.state for s in b.statuses()] == [ReqState.COMPLETED] * 5
                assert sum(s.bytes for s in b.statuses()) == n
            assert np.array_equal(local, pattern(1, n))
            # WRITE a new pattern, the peer checks every byte
            src = pattern(2, n)
            e.register(src)
            e.transfer([Request(Op.WRITE, addr(src), seg, t["addr"], n)], timeout=10)
            assert t["peer"].run("result = digest(buf)") == digest(src)
            e.write(seg, addr(src) + 5, t["addr"] + 5, 7)
            e.read(seg, addr(local), t["addr"], n)
            assert np.array_equal(local, src)
            st = e.stats()
            assert st.requests_completed == 8 and st.requests_failed == 0
            assert st.bytes("tcp" if protocol == "tcp" else "shm") >= 3 * n


def test_unknown_segment_and_bad_addresses(target):
    with Engine() as e:
        with pytest.raises(errors.ConnectError):
            e.open_segment(f"127.0.0.1:{dead_port()}")
        with pytest.raises(errors.ResolveError):
            e.open_segment("no-such-host.invalid:1")
        local = np.zeros(4096, np.uint8)
        e.register(local)
        seg = e.open_segment(target["name"])
        with pytest.raises(errors.RemoteNotRegisteredError):
            e.read(seg, addr(local), target["addr"] + target["size"] - 10, 100)
        # the bad request fails alone; the good one in the same batch completes
        with e.submit([(Op.READ, addr(local), seg, 8, 16),
                       (Op.READ, addr(local) + 16, seg, target["addr"], 16)]) as b:
            with pytest.raises(errors.RemoteNotRegisteredError):
                b.wait(5)
            assert b.status(0).state == ReqState.FAILED
            assert b.status(0).error_name == "ERR_REMOTE_NOT_REGISTERED"
            assert b.status(1).state == ReqState.COMPLETED
        assert np.array_equal(local[16:32], pattern(1, 16))
        with pytest.raises(errors.LocalNotRegisteredError):
            e.submit([(Op.READ, 4096, seg, target["addr"], 16)])
        with pytest.raises(errors.BadSegmentError):
            e.submit([(Op.READ, addr(local), 9999, target["addr"], 16)])
        with pytest.raises(errors.InvalidArgError):
            e.submit([])
        seg.close()
        seg.close()  # idempotent
        with pytest.raises(errors.BadSegmentError):
            e.read(seg, addr(local), target["addr"], 16)


def test_stopped_peer_wait_timeout_cancel_deadline(spawn):
    t = start_target(spawn, protocol="tcp")
    with Engine(protocol="tcp") as e:
        local, seg = local_and_segment(e, t)
        t["peer"].signal(signal.SIGSTOP)
        try:
            b = e.submit([(Op.READ, addr(local), seg, t["addr"], t["size"])], timeout=20)
            t0 = time.monotonic()
            assert b.wait(0.2) is False  # still pending
            assert 0.15 < time.monotonic() - t0 < 2
            assert b.status(0).state == ReqState.PENDING and not b.done
            b.cancel()
            assert b.status(0).state == ReqState.CANCELED
            b.close()
            with e.submit([(Op.READ, addr(local), seg, t["addr"], 4096)], timeout=0.3) as b2:
                with pytest.raises(errors.TimedOutError):
                    b2.wait()
                assert b2.status(0).state == ReqState.TIMEOUT
                # settled at once: the lane still waits for the stopped peer's answer, but
                # drops its bytes
                assert b2.settle() is True
                with pytest.raises(ValueError):
                    b2.settle(-1)
            # a WRITE is settled only once the peer acknowledged it (it writes what is there)
            local[:4096] = pattern(1, 4096)
            with e.submit([(Op.WRITE, addr(local), seg, t["addr"], 4096)], timeout=0.3) as b3:
                with pytest.raises(errors.TimedOutError):
                    b3.wait()
                assert b3.settle() is False
                t["peer"].signal(signal.SIGCONT)
                assert b3.settle(10) is True
                t["peer"].signal(signal.SIGSTOP)
            assert e.stats().requests_failed == 2
        finally:
            t["peer"].signal(signal.SIGCONT)
        e.read(seg, addr(local), t["addr"], t["size"], timeout=10)  # the peer serves again
        assert np.array_equal(local, pattern(1, t["size"]))


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_peer_killed_mid_transfer(spawn, protocol):
    t = start_target(spawn, protocol=protocol, size=16 << 20)
    with Engine(protocol=protocol) as e:
        local, seg = local_and_segment(e, t)
        t["peer"].signal(signal.SIGSTOP)  # requests are in flight and stay there
        reqs = [(Op.READ, addr(local) + i * (1 << 20), seg, t["addr"] + i * (1 << 20), 1 << 20)
                for i in range(16)]
        b = e.submit(reqs, timeout=20)
        assert b.wait(0.1) is False
        t["peer"].proc.kill()
        t0 = time.monotonic()
        with pytest.raises(kvbridge.PeerError) as ei:
            b.wait(10)
        assert time.monotonic() - t0 < 3
        assert ei.value.name in ("ERR_PEER_LOST", "ERR_SHM_COPY")
        assert all(s.state == ReqState.FAILED for s in b.statuses())
        b.close()
        with pytest.raises(kvbridge.Error):
            e.read(seg, addr(local), t["addr"], 16, timeout=5)  # fails at once now


def test_notifications(target):
    p = target["peer"]
    with Engine() as e:
        src = pattern(3, 1 << 20)
        e.register(src)
        seg = e.open_segment(target["name"])
        # a batch's notification arrives after its data: the peer checks the bytes on receipt
        b = e.submit([(Op.WRITE, addr(src), seg, target["addr"], src.nbytes)], notify=b"req-1")
        assert b.wait(10)
        b.close()
        got = p.run("n = eng.notify_recv(5); result = [n.sender, n.data.decode(), "
                    "digest(buf[:%d])]" % src.nbytes)
        assert got == [e.name, "req-1", digest(src)]
        e.notify_send(seg, "hello", timeout=5)
        e.notify_send(seg, b"\x00\xffbin")
        assert p.run("result = [eng.notify_recv(5).data.hex() for _ in range(2)]") == \
            [b"hello".hex(), b"\x00\xffbin".hex()]
        e.notify_send(seg, "ping")
        p.run("n = eng.notify_recv(5); eng.notify_reply(n, b'pong:' + n.data)")
        n = e.notify_recv(5)
        assert (n.sender, n.data) == (target["name"], b"pong:ping")
        assert e.notify_recv(0) is None
        t0 = time.monotonic()
        assert e.notify_recv(0.1) is None and time.monotonic() - t0 >= 0.09
        with pytest.raises(errors.TooLargeError):
            e.notify_send(seg, b"x" * (kvbridge.NOTIFY_MAX + 1))


def test_segment_attrs_refresh_incarnation(target):
    p = target["peer"]
    p.run("eng.set_attr('model', 'llama'); buf2 = np.zeros(4096, np.uint8); eng.register(buf2)")
    with Engine() as e:
        seg = e.open_segment(target["name"])
        assert seg.attr("model") == b"llama" and seg.attr("nope") is None
        inc = seg.incarnation
        assert len(seg.regions()) == 2
        p.run("eng.set_attr('model', None); eng.unregister(buf2)")
        seg.refresh()
        assert seg.attr("model") is None and len(seg.regions()) == 1
        assert len(seg.regions(refresh=True)) == 1 and seg.incarnation == inc
        seg2 = e.open_segment(target["name"])  # another reference to the same handle
        assert seg2.handle == seg.handle
        seg2.close()
        assert seg.regions()  # still open


def test_eight_threads(target):
    n = target["size"]
    with Engine() as e:
        seg = e.open_segment(target["name"])
        errs = []

        def worker(k):
            try:
                rng = np.random.default_rng(100 + k)
                part = n // 8
                mine = np.zeros(part, np.uint8)
                e.register(mine)
                for _ in range(10):
                    off = int(rng.integers(0, part - 1))
                    ln = int(rng.integers(1, part - off + 1))
                    data = rng.integers(0, 256, ln, dtype=np.uint8)
                    mine[:ln] = data
                    e.write(seg, addr(mine), target["addr"] + k * part + off, ln, timeout=10)
                    mine[:ln] = 0
                    e.read(seg, addr(mine), target["addr"] + k * part + off, ln, timeout=10)
                    assert np.array_equal(mine[:ln], data)
                e.unregister(mine)
            except BaseException as ex:  # reported below
                errs.append(ex)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs, errs
        assert e.stats().requests_completed == 160


def test_blocking_calls_release_the_gil():
    with Engine() as e:
        ticks = []
        done = threading.Event()

        def counter():
            while not done.is_set():
                ticks.append(1)
                time.sleep(0.001)

        th = threading.Thread(target=counter)
        th.start()
        assert e.notify_recv(0.3) is None  # blocks in C for 300 ms
        done.set()
        th.join()
        assert len(ticks) > 50


def test_close_wakes_receiver():
    e = Engine()
    res = []
    th = threading.Thread(target=lambda: res.append(_recv_or_error(e)))
    th.start()
    time.sleep(0.1)
    e.close()
    th.join(5)
    assert not th.is_alive()


def _recv_or_error(e):
    try:
        return e.notify_recv(None)
    except kvbridge.Error as ex:
        return ex


def test_torch_tensors(target):
    torch = pytest.importorskip("torch", reason="torch is not installed (Debian python3-torch)")
    with Engine() as e:
        t = torch.zeros(target["size"], dtype=torch.uint8)
        assert e.register(t) == (t.data_ptr(), target["size"])
        seg = e.open_segment(target["name"])
        e.read(seg, t.data_ptr(), target["addr"], target["size"])
        assert np.array_equal(t.numpy(), pattern(1, target["size"]))
        with pytest.raises(ValueError):
            e.register(torch.zeros(4, 4)[:, 1])


def test_cluster_secret(spawn):
    p = spawn()
    name = p.run("import kvbridge\neng = kvbridge.Engine(secret=b'A' * 32)\nresult = eng.name")
    with Engine(secret=b"B" * 32) as e:
        with pytest.raises(errors.AuthError):
            e.open_segment(name)
    with Engine() as e:  # no secret at all
        with pytest.raises(errors.AuthError):
            e.open_segment(name)
    with Engine(secret="A" * 32) as e:  # str secrets are UTF-8 bytes
        assert e.open_segment(name).incarnation


def test_tcp_congestion():
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        system = f.read().strip()
    with Engine() as e:
        assert e.tcp_congestion == system
    with Engine(tcp_congestion="reno") as e:  # reno is always built in
        assert e.tcp_congestion == "reno"
    with pytest.raises(errors.InvalidArgError):
        Engine(tcp_congestion="no-such-cc")


def test_busy_poll():
    with Engine() as e:
        assert e.busy_poll_us == 0  # off by default
    with pytest.raises(errors.InvalidArgError):
        Engine(busy_poll_us=100001)
    with pytest.raises(errors.InvalidArgError):  # not a uint32_t
        Engine(busy_poll_us=-1)
    with Engine(busy_poll_us=200) as a, Engine(busy_poll_us=200) as b:
        assert a.busy_poll_us == 200
        src, dst = pattern(7, 1 << 20), np.zeros(1 << 20, np.uint8)
        b.register(src)
        a.register(dst)
        with a.open_segment(b.name) as seg:
            for size in (4096, 1 << 20):  # one connection (polled by the waiting thread), or all
                dst[:] = 0
                reqs = [Request(Op.READ, addr(dst) + o, seg, addr(src) + o, size)
                        for o in range(0, 1 << 20, size)]
                with a.submit(reqs) as batch:
                    assert batch.wait(10)
                assert np.array_equal(dst, src)


def test_linger(monkeypatch):
    monkeypatch.delenv("KVB_LINGER_US", raising=False)
    with Engine() as e:
        assert e.linger_us == 100  # on by default
    with Engine(linger_us=0) as e:
        assert e.linger_us == 0
    with Engine(linger_us=50, busy_poll_us=300) as e:
        assert e.linger_us == 300  # busy polling, where longer, takes its place
    with pytest.raises(errors.InvalidArgError):
        Engine(linger_us=100001)
    monkeypatch.setenv("KVB_LINGER_US", "12us")
    with pytest.raises(errors.InvalidArgError):
        Engine()
    monkeypatch.setenv("KVB_LINGER_US", "7")
    with Engine() as e:
        assert e.linger_us == 7


def test_cpus():
    with Engine(cpus="") as e:
        assert e.cpus == ""  # unbound
    for bad in ("x", "0-", "1-0", "1024"):
        with pytest.raises(errors.InvalidArgError):
            Engine(cpus=bad)
    mine = sorted(os.sched_getaffinity(0))
    listed = f"{mine[-1]},{mine[0]}"
    before = set(os.listdir("/proc/self/task"))  # engines of other tests may still be closing
    with Engine(cpus=listed, copy_threads=1, protocol="auto") as a:
        assert a.cpus == listed
        placed = {}
        for tid in set(os.listdir("/proc/self/task")) - before:  # a's threads, before b's
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name in ("kvb-tcp-0", "kvb-copy-0"):
                placed[name] = os.sched_getaffinity(int(tid))
        assert placed == {"kvb-tcp-0": {mine[-1]}, "kvb-copy-0": {mine[0]}}
        with Engine(protocol="tcp") as b:
            src, dst = pattern(9, 1 << 20), np.zeros(1 << 20, np.uint8)
            b.register(src)
            a.register(dst)
            with a.open_segment(b.name) as seg:
                with a.submit([Request(Op.READ, addr(dst), seg, addr(src), 1 << 20)]) as batch:
                    assert batch.wait(10)
            assert np.array_equal(dst, src)


def _fabric_engine(**kw):
    if not kvbridge.has_fabric():
        pytest.skip("this libkvbridge.so has no libfabric data path")
    try:
        return Engine(fabric_provider="tcp;ofi_rxm", protocol="fabric", **kw)
    except errors.InvalidArgError:
        pytest.skip("libfabric's tcp;ofi_rxm provider is not available here")


def test_fabric_path(spawn):
    with _fabric_engine() as e:
        assert e.fabric_provider == "tcp;ofi_rxm"
        p = spawn()
        t = p.run("import kvbridge\n"
                  "eng = kvbridge.Engine(protocol='fabric', fabric_provider='tcp;ofi_rxm')\n"
                  "buf = pattern(1, 4 << 20)\neng.register(buf)\n"
                  "result = {'name': eng.name, 'addr': addr(buf), 'size': buf.nbytes}")
        name = t["name"]
        seg = e.open_segment(name)
        assert seg.transport == "fabric"
        local = np.zeros(t["size"], np.uint8)
        e.register(local)
        e.read(seg, addr(local), t["addr"], t["size"], timeout=10)
        assert np.array_equal(local, pattern(1, t["size"]))
        assert e.stats().bytes("fabric") == t["size"]
