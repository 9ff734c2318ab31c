# SPDX-License-Identifier: Apache-2.0
"""The KV layer's binding: layouts, descriptors, the guard, routes and plans (pure functions), and
agents between a prefill and a decode process - pull, push, layer-wise push, every block's bytes
checked and every other block checked untouched, a refused link, a peer killed mid-request."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvbridge import Engine, Op, errors, kv
from helpers import BLOCK_BYTES, BLOCKS, LAYERS, block, kv_cache, pattern

PREFILL = """
import kvbridge
from kvbridge import errors, kv
eng = kvbridge.Engine()
layout, arrays = kv_cache(1)
agent = kv.Agent(eng, layout, kv.Role.PREFILL)
result = eng.name
"""


def test_layout_validate_encode_decode():
    layout, _arrays = kv_cache(None)
    layout.validate()
    desc = layout.encode()
    assert '"test-model"' in desc
    back = kv.Layout.decode(desc)
    assert back == layout
    with pytest.raises(errors.InvalidArgError, match="INVALID_ARG"):
        kv.Layout.decode(desc.replace('"test-model"', '""'))
    bad = kv.Layout(layout.model, layout.dtype, layout.tokens_per_block, layout.attn,
                    layout.num_kv_heads, layout.num_layers, layout.slots[:-2])
    with pytest.raises(errors.InvalidArgError) as ei:
        bad.validate()
    assert "layer" in ei.value.detail  # the reason names the layer and slot
    other, _ = kv_cache(None, kv.DType.BF16)
    with pytest.raises(errors.InvalidArgError, match="dtype"):
        layout.check_pair(other)
    assert layout.topo() == kv.Topo(1, 1, kv.Attn.GQA, 2, kv.Order.HND)


def test_guard_route_plan():
    a, _ = kv_cache(None)
    b, _ = kv_cache(None)
    assert kv.guard(a, b)[0] == kv.Verdict.ALLOW_HOMO
    p = kv.Topo(1, 2, kv.Attn.GQA, 8, kv.Order.HND)
    d = kv.Topo(1, 4, kv.Attn.GQA, 8, kv.Order.HND)
    v, why = kv.guard(p, d)
    assert v == kv.Verdict.ALLOW_HETERO and why
    assert kv.guard(p, kv.Topo(1, 4, kv.Attn.GQA, 8, kv.Order.NHD))[0] == \
        kv.Verdict.INVALID_REMOTE
    routes = kv.route(p, d)
    assert [(r.src_rank, r.dst_rank, r.head_begin, r.head_end) for r in routes] == \
        [(0, 0, 0, 2), (0, 1, 2, 4), (1, 2, 4, 6), (1, 3, 6, 8)]
    with pytest.raises(TypeError):
        kv.guard(a, p)
    reqs = kv.plan(a, b, Op.READ, 7, [1, 2, 3, 9], [4, 5, 6, 0], layers=[1])
    # runs 1-3 -> 4-6 and 9 -> 0, for K and V of layer 1
    assert len(reqs) == 4 and all(r.segment == 7 and r.op == Op.READ for r in reqs)
    k1 = b.slots[2]
    assert reqs[0].remote == k1.base + 1 * BLOCK_BYTES and reqs[0].length == 3 * BLOCK_BYTES
    with pytest.raises(errors.InvalidArgError):
        kv.plan(a, b, Op.READ, 7, [1, 1], [2, 3])  # duplicate source
    with pytest.raises(errors.InvalidArgError):
        kv.plan(a, b, Op.READ, 7, [BLOCKS], [0])  # out of range


def _check(arrays, src_arrays_seed, src, dst):
    """Every dst block holds its src block of pattern(seed); every other block is zero."""
    for (layer, kind), a in arrays.items():
        ref = pattern(src_arrays_seed + 10 * layer + kind, BLOCKS * BLOCK_BYTES)
        moved = dict(zip(dst, src))
        for j in range(BLOCKS):
            want = block(ref, moved[j]) if j in moved else np.zeros(BLOCK_BYTES, np.uint8)
            assert np.array_equal(block(a, j), want), (layer, kind, j)


def test_pull_push_layerwise(spawn):
    p = spawn()
    pname = p.run(PREFILL)
    with Engine() as e:
        layout, arrays = kv_cache(None)
        agent = kv.Agent(e, layout, kv.Role.DECODE)
        link = agent.link(pname)
        assert link.verdict == kv.Verdict.ALLOW_HOMO and link.has_route
        assert link.remote_layout.model == "test-model"
        p.run("plink = agent.link(%r)" % e.name)
        # pull: decode reads, prefill waits for the notice
        src, dst = [1, 2, 3, 9], [4, 5, 6, 0]
        p.run("agent.expect('r1', [plink], 10)")
        link.pull("r1", src, dst, timeout=10)
        assert p.run("result = agent.wait('r1', 10)") is True
        _check(arrays, 1, src, dst)
        # push: prefill writes every layer, decode waits
        for a in arrays.values():
            a[:] = 0
        src, dst = [0, 15, 7], [15, 0, 8]
        agent.expect("r2", [link], 10)
        p.run("plink.push('r2', %r, %r, 10)" % (src, dst))
        assert agent.wait("r2", 10) is True
        _check(arrays, 1, src, dst)
        # layer by layer
        for a in arrays.values():
            a[:] = 0
        agent.expect("r3", [link], 10)
        assert agent.wait("r3", 0.05) is False  # nothing yet
        p.run("x = plink.begin('r3', kvbridge.Op.WRITE, [5, 6], [1, 2], 10)")
        for layer in range(LAYERS):
            p.run("x.layer(%d)" % layer)
        p.run("x.finish(); assert x.settle() is True; x.close()")
        assert agent.wait("r3", 10)
        _check(arrays, 1, [5, 6], [1, 2])
        # a request the decode gives up on before reading: the prefill hears at once
        p.run("agent.expect('r5', [plink], 10)")
        link.give_up("r5")
        assert p.run("""
try:
    agent.wait('r5', 10)
    result = 'done'
except errors.CanceledError:
    result = 'canceled'
""") == "canceled"
        with pytest.raises(errors.InvalidArgError):
            link.begin("r4", Op.READ, [1, 2], [3])
        with pytest.raises(errors.InvalidArgError):
            link.begin("r4", Op.READ, [BLOCKS + 1], [3])
        assert agent.notify_recv(0) is None
        # a push whose layers cannot start (a slot unregistered under the prefill's agent): the
        # decode hears of the failure at once - push() used to leave without finish(), and the
        # decode waited until its deadline
        agent.expect("r6", [link], 30)
        assert p.run("""
eng.unregister(int(arrays[(0, 0)].__array_interface__['data'][0]))
try:
    plink.push('r6', [1], [1], 10)
    result = 'pushed'
except errors.Error as e:
    result = type(e).__name__
""") != "pushed"
        t0 = time.monotonic()
        with pytest.raises(errors.Error):
            agent.wait("r6", 20)
        assert time.monotonic() - t0 < 5
        link.close()
        agent.close()


def test_closing_out_of_order_is_safe(tmp_path):
    """Closing an engine first closes its agents, theirs links and their transfers; closing
    them afterwards does nothing (it used to free the agent against a destroyed engine)."""
    code = """
import kvbridge
from kvbridge import errors, kv
from helpers import kv_cache
e1, e2 = kvbridge.Engine(), kvbridge.Engine()
l1, a1 = kv_cache(1)
l2, a2 = kv_cache(None)
p = kv.Agent(e1, l1, kv.Role.PREFILL)
d = kv.Agent(e2, l2, kv.Role.DECODE)
link = d.link(e1.name)
x = link.begin("r", kvbridge.Op.READ, [0], [0], 5)
e2.close()
x.close(); link.close(); d.close()
try:
    link.begin("r2", kvbridge.Op.READ, [0], [0], 5)
    raise SystemExit("a closed link took a transfer")
except errors.Error:
    pass
p.close(); e1.close(); p.close()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_incompatible_link_and_peer_killed(spawn):
    p = spawn()
    pname = p.run(PREFILL)
    with Engine() as e:
        layout, _arrays = kv_cache(None, kv.DType.BF16)
        with kv.Agent(e, layout, kv.Role.DECODE) as agent:
            with pytest.raises(errors.IncompatibleError, match="dtype"):
                agent.link(pname)
    with Engine() as e2:
        with pytest.raises(errors.NotFoundError):  # a peer without an agent
            kv.Agent(e2, kv_cache(None)[0], kv.Role.DECODE).link(
                _plain_peer(spawn))
    # the prefill expects a request from a decode process that dies
    d = spawn()
    with Engine() as e3:
        layout, _ = kv_cache(2)
        agent = kv.Agent(e3, layout, kv.Role.PREFILL)
        d.run("import kvbridge\nfrom kvbridge import kv\neng = kvbridge.Engine()\n"
              "layout, arrays = kv_cache(None)\nagent = kv.Agent(eng, layout, kv.Role.DECODE)\n"
              "link = agent.link(%r)\nresult = eng.name" % e3.name)
        dname = d.run("result = eng.name")
        link = agent.link(dname)
        agent.expect("r9", [link], 20)
        d.proc.kill()
        with pytest.raises(errors.PeerLostError):
            agent.wait("r9", 10)
        link.close()
        agent.close()


def _plain_peer(spawn):
    q = spawn()
    return q.run("import kvbridge\neng = kvbridge.Engine()\nresult = eng.name")
