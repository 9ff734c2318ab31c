# SPDX-License-Identifier: Apache-2.0
"""A minimal in-tree PEP 517/660 build backend for the kvbridge package (pure Python, one
package directory): builds a py3-none-any wheel, an sdist, and an editable wheel with the
standard library only, so installing needs neither network nor setuptools."""

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "kvbridge"


def _meta():
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    try:
        import tomllib
        proj = tomllib.loads(text)["project"]
    except ImportError:  # Python < 3.11: the few keys we need, read plainly
        proj = dict(re.findall(r'^(name|version|description|requires-python)\s*=\s*"([^"]*)"',
                               text, re.M))
    return proj["name"], proj["version"], proj.get("description", ""), \
        proj.get("requires-python", "")


def _metadata_text():
    name, version, desc, py = _meta()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             f"Summary: {desc}", "License: Apache-2.0"]
    if py:
        lines.append(f"Requires-Python: {py}")
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + open(readme, encoding="utf-8").read()
    return "\n".join(lines) + "\n" + body


def _dist_info(name, version):
    return f"{name}-{version}.dist-info"


def _package_files():
    base = os.path.join(ROOT, PACKAGE)
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith((".py", ".typed")):
                full = os.path.join(d, f)
                yield full, os.path.relpath(full, ROOT).replace(os.sep, "/")


def _write_wheel(wheel_directory, entries):
    name, version, _, _ = _meta()
    di = _dist_info(name, version)
    fname = f"{name}-{version}-py3-none-any.whl"
    entries = list(entries) + [
        (f"{di}/METADATA", _metadata_text().encode()),
        (f"{di}/WHEEL", b"Wheel-Version: 1.0\nGenerator: kvb_build\nRoot-Is-Purelib: true\n"
                        b"Tag: py3-none-any\n"),
        (f"{di}/top_level.txt", f"{PACKAGE}\n".encode()),
    ]
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, fname), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in entries:
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arc},sha256={digest.decode()},{len(data)}")
        record.append(f"{di}/RECORD,,")
        z.writestr(f"{di}/RECORD", "\n".join(record) + "\n")
    return fname


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory,
                        [(arc, open(full, "rb").read()) for full, arc in _package_files()])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth line puts the source tree on sys.path: edits take effect without reinstalling.
    return _write_wheel(wheel_directory, [(f"_{PACKAGE}_editable.pth", (ROOT + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    name, version, _, _ = _meta()
    base = f"{name}-{version}"
    fname = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, fname), "w:gz") as t:
        for rel in ["pyproject.toml", "README.md", "_build/kvb_build.py"]:
            if os.path.exists(os.path.join(ROOT, rel)):
                t.add(os.path.join(ROOT, rel), f"{base}/{rel}")
        for full, arc in _package_files():
            t.add(full, f"{base}/{arc}")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        data = _metadata_text().encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return fname
