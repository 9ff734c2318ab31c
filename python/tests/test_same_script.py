# SPDX-License-Identifier: Apache-2.0
"""The same small script (same_script.py) through kvbridge.mooncake.TransferEngine and through
the native API, each against a Mooncake-style and a native peer: same bytes, same digest, and the
peer holds exactly what was written."""

import os
import subprocess
import sys

import pytest

from conftest import start_target
from helpers import digest, pattern

HERE = os.path.dirname(os.path.abspath(__file__))
BS, NBLOCKS = 64 << 10, 16


@pytest.mark.parametrize("peer_kind", ["mooncake", "native"])
def test_same_script_both_apis(spawn, peer_kind):
    t = start_target(spawn, kind=peer_kind, size=BS * NBLOCKS)
    out = {}
    for api in ("mooncake", "native"):
        t["peer"].run("buf[:] = 0")
        r = subprocess.run([sys.executable, os.path.join(HERE, "same_script.py"), api,
                            t["name"], str(t["addr"])], capture_output=True, text=True,
                           timeout=20)
        assert r.returncode == 0, r.stderr
        out[api] = r.stdout.strip()
        src = pattern(7, BS * NBLOCKS)
        order = [(i * 5) % NBLOCKS for i in range(NBLOCKS)]
        want = bytearray(BS * NBLOCKS)
        for i, b in enumerate(order):
            want[b * BS:(b + 1) * BS] = src[i * BS:(i + 1) * BS].tobytes()
        assert t["peer"].run("result = digest(buf)") == digest(want)
    assert out["mooncake"] == out["native"] == digest(pattern(7, BS * NBLOCKS))
