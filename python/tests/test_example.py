# SPDX-License-Identifier: Apache-2.0
"""The example connector (python/examples/pd_connector.py) runs with one command and verifies
every byte it moved."""

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "pd_connector.py")


def _run(*args):
    return subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True,
                          timeout=25)


def test_pd_connector_numpy():
    r = _run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every byte verified" in r.stdout


def test_pd_connector_torch():
    pytest.importorskip("torch", reason="torch is not installed (Debian python3-torch)")
    r = _run("--torch")
    assert r.returncode == 0, r.stdout + r.stderr
