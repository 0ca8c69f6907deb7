"""Golden bytes of a tiny bundle: the archive a build writes is pinned byte for byte.

``tests/data/small_mlp.py`` built without kernels (so the bytes depend on torch and the packager,
not on triton's compiler) for sm_90. A change to the archive layout, member order, zip metadata,
manifest fields or weight layout shows as a diff of ``goldens/small_mlp.manifest.json`` and a new
archive digest; regenerate with ``AOTPACK_UPDATE_GOLDEN=1`` after checking the diff is intended.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import model_path

GOLDENS = Path(__file__).parent / "goldens"
PINNED_TORCH = "2.13.0"  # the README's torch; other versions trace other programs
PINNED_PYTHON = (3, 11)  # the manifest records the build's Python minor


def _golden(name: str, text: str) -> None:
    path = GOLDENS / name
    if os.environ.get("AOTPACK_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden {path}; create it with AOTPACK_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed (AOTPACK_UPDATE_GOLDEN=1 regenerates after review)"


def test_tiny_bundle_bytes_are_pinned(tmp_path):
    import torch

    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    if torch.__version__.split("+")[0] != PINNED_TORCH or sys.version_info[:2] != PINNED_PYTHON:
        pytest.skip(f"goldens are for torch {PINNED_TORCH} on Python {PINNED_PYTHON[0]}.{PINNED_PYTHON[1]}")
    out = tmp_path / "small_mlp.tpk"
    pack(generate(trace(load_model_file(model_path("small_mlp"))), ("sm_90",), fuse=False), out)
    data = out.read_bytes()
    with zipfile.ZipFile(out) as zf:
        manifest = zf.read("manifest.json").decode()
        members = [f"{i.filename} {i.file_size} {i.compress_type} {i.date_time}" for i in zf.infolist()]
    _golden("small_mlp.manifest.json", manifest)
    layout = "\n".join([*members, f"sha256 {hashlib.sha256(data).hexdigest()}", f"bytes {len(data)}"]) + "\n"
    _golden("small_mlp.archive.txt", layout)
    assert json.loads(manifest)["environment"]["triton_built"] == ""  # no kernels: triton is not needed
