"""The files a build leaves beside its bundle: split weights checked by content and collected when
no bundle refers to them any more, and a write the system refuses (disk full) reported as an
``EnvError`` with nothing left behind."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from aot.errors import EnvError
from aot.loader import load
from aot.packager import pack
from aot.packager.files import host
from tests.conftest import HANG_GUARD_S


def _outputs(path: Path) -> torch.Tensor:
    runner = load(path)
    try:
        got = runner(**runner.example_inputs())
        assert torch.equal(got, runner.reference_outputs()[0])
        return got
    finally:
        runner.bundle.close()


def _weights_files(folder: Path) -> list[str]:
    """The split weights files of ``m.tpk`` in ``folder``."""
    return sorted(
        p.name for p in folder.iterdir() if re.fullmatch(r"m\.weights\.[0-9a-f]{16}\.safetensors", p.name)
    )


def test_a_damaged_split_weights_file_is_rewritten(tmp_path: Path, built) -> None:
    out = tmp_path / "m.tpk"
    pack(built.compiled("small_mlp"), out, split_weights=True)
    (weights,) = tmp_path.glob("m.weights.*.safetensors")
    good = weights.read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF  # same size, one byte off: the loader refuses it
    weights.write_bytes(bytes(damaged))
    pack(built.compiled("small_mlp"), out, split_weights=True)
    assert weights.read_bytes() == good
    assert hashlib.sha256(good).hexdigest().startswith(weights.name.split(".")[2])
    _outputs(out)


def test_split_weights_builds_collect_the_weights_no_bundle_refers_to(tmp_path: Path, built) -> None:
    out = tmp_path / "m.tpk"
    pack(built.compiled("small_mlp"), out, split_weights=True)
    (first,) = _weights_files(tmp_path)
    shutil.copy(out, tmp_path / "renamed.tpk")  # a bundle under another name still uses them
    bystanders = [
        "m.weights.notes.safetensors",
        f"{first}.bak",
        f"other.{first.removeprefix('m.')}",
        "m.weights.0123456789ABCDEF.safetensors",
        "mm.weights.0123456789abcdef.safetensors",
    ]
    for name in bystanders:
        (tmp_path / name).write_bytes(b"not ours")
    dead_partial = f".m.weights.0123456789abcdef.safetensors.{host()}-1.abcd1234.partial"
    (tmp_path / dead_partial).write_bytes(b"x")

    pack(built.compiled("branchy"), out, split_weights=True)
    second = [n for n in _weights_files(tmp_path) if n != first]
    assert first in _weights_files(tmp_path) and len(second) == 1  # kept: renamed.tpk refers to it
    assert not (tmp_path / dead_partial).exists()
    expected = _outputs(tmp_path / "renamed.tpk")

    (tmp_path / "renamed.tpk").unlink()
    pack(built.compiled("branchy"), out, split_weights=True)
    assert first not in _weights_files(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(["m.tpk", *second, *bystanders])
    _outputs(out)

    pack(built.compiled("small_mlp"), out, split_weights=True)  # back to the first weights
    assert _weights_files(tmp_path) == [first]
    assert torch.equal(_outputs(out), expected)
    pack(built.compiled("small_mlp"), out)  # weights inside the bundle: the file is nobody's now
    assert sorted(os.listdir(tmp_path)) == sorted(["m.tpk", *bystanders])


def test_weights_a_running_build_holds_or_an_unreadable_bundle_may_use_are_kept(
    tmp_path: Path, built
) -> None:
    out = tmp_path / "m.tpk"
    pack(built.compiled("small_mlp"), out, split_weights=True)
    (first,) = _weights_files(tmp_path)
    with open(tmp_path / first, "rb") as f:  # as a build does from writing them to its rename
        fcntl.flock(f, fcntl.LOCK_SH)
        pack(built.compiled("branchy"), out, split_weights=True)
    assert len(_weights_files(tmp_path)) == 2

    junk = tmp_path / "broken.tpk"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)  # a zip we cannot read: it may refer to any
    pack(built.compiled("branchy"), out, split_weights=True)
    assert len(_weights_files(tmp_path)) == 2
    junk.unlink()
    pack(built.compiled("branchy"), out, split_weights=True)
    assert len(_weights_files(tmp_path)) == 1 and first not in _weights_files(tmp_path)


def _refuse_writes_after(monkeypatch, calls: int, error: int) -> None:
    original = zipfile.ZipFile.writestr
    count = []

    def refusing(self, *a, **k):
        count.append(1)
        if len(count) > calls:
            raise OSError(error, os.strerror(error))
        return original(self, *a, **k)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", refusing)


@pytest.mark.parametrize("split_weights", [False, True])
def test_a_full_disk_is_an_env_error_that_leaves_the_old_bundle_and_nothing_else(
    tmp_path: Path, built, monkeypatch, split_weights: bool
) -> None:
    out = tmp_path / "m.tpk"
    pack(built.compiled("small_mlp"), out, split_weights=split_weights)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _refuse_writes_after(monkeypatch, 2, errno.ENOSPC)
    with pytest.raises(EnvError) as err:
        pack(built.compiled("branchy"), out, split_weights=split_weights)
    message = str(err.value)
    assert "\n" not in message and f"cannot write {out}" in message, message
    assert "No space left on device (ENOSPC)" in message and "free space there" in message, message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    _outputs(out)


def test_another_write_error_is_an_env_error_too(tmp_path: Path, built, monkeypatch) -> None:
    out = tmp_path / "m.tpk"
    _refuse_writes_after(monkeypatch, 0, errno.EIO)
    with pytest.raises(
        EnvError, match=r"cannot write .*m\.tpk: Input/output error \(EIO\); nothing was written"
    ):
        pack(built.compiled("small_mlp"), out)
    assert os.listdir(tmp_path) == []


# Runs the CLI with every zip member write refused, as on a full disk.
FULL_DISK = """
import errno, os, sys, zipfile
def full(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
zipfile.ZipFile.writestr = full
from aot.cli import main
main(sys.argv[1:])
"""


def test_cli_build_on_a_full_disk_is_one_line_and_not_an_internal_error(tmp_path: Path) -> None:
    from tests.conftest import model_path

    out = tmp_path / "m.tpk"
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK, "build", str(model_path("branchy")), "-o", str(out), "--no-fuse"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot write {out}: No space left"), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert os.listdir(tmp_path) == []


def test_without_flock_a_build_still_writes_and_removes_nothing(tmp_path: Path, built, monkeypatch) -> None:
    """A file system without locks (some network and FUSE ones): nothing can tell a dead build's
    files from a live one's, so nothing is removed, and the build goes on."""
    out = tmp_path / "m.tpk"
    pack(built.compiled("small_mlp"), out, split_weights=True)
    (first,) = _weights_files(tmp_path)
    partial = tmp_path / f".m.tpk.{host()}-1.abcd1234.partial"
    partial.write_bytes(b"x")

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    pack(built.compiled("branchy"), out, split_weights=True)
    assert partial.exists() and first in _weights_files(tmp_path) and len(_weights_files(tmp_path)) == 2
    monkeypatch.undo()
    _outputs(out)
