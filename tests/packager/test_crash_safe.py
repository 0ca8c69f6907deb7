"""Killing ``aotpack build`` never leaves a bundle-looking file at the output path.

A bundle (of another model) already sits at the output path. Builds are SIGKILLed at seeded random
points: over the whole run (import, trace, compile, write), and inside the write itself, which a
small wrapper around the real CLI slows down so the kill lands between members, during the fsync,
or just before the ``os.replace``. After every kill the output path holds either the old bundle,
byte for byte, or (when the build had finished) a complete bundle that loads and reproduces its
reference outputs. Nothing else appears beside it but the killed build's ``.NAME.HOST-PID.*.partial``
file, and the next build removes those no live process holds locked (and only those).
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from aot.loader import load
from tests.conftest import DEFAULT_ARCHS, HANG_GUARD_S, ROOT, model_path

SEED = 11
WHOLE_RUN_KILLS = 2  # at random times over a full build (seconds drawn from WHOLE_RUN_SPAN)
WHOLE_RUN_SPAN = (0.3, 9.0)
WRITE_KILLS = 4  # at random times inside the slowed-down write
SLOW_WRITE_S = 0.12  # per zip member and before the rename, in the instrumented build
BUILD_TIMEOUT_S = 300

# Runs the real CLI with the write slowed down and announced on stderr.
WRAPPER = r"""
import os, sys, time, zipfile
import aot.packager as packager

slow = float(os.environ["AOT_TEST_SLOW_WRITE"])
writing = False
writestr, write_bundle, replace = zipfile.ZipFile.writestr, packager.write_bundle, os.replace

def slow_writestr(self, *a, **k):
    if writing:
        time.sleep(slow)
    return writestr(self, *a, **k)

def announced_write_bundle(*a, **k):
    global writing
    writing = True
    print("AOT-TEST writing", flush=True, file=sys.stderr)
    return write_bundle(*a, **k)

def slow_replace(src, dst, *a, **k):
    if writing:
        print("AOT-TEST replacing", flush=True, file=sys.stderr)
        time.sleep(slow)
    return replace(src, dst, *a, **k)

zipfile.ZipFile.writestr = slow_writestr
packager.write_bundle = announced_write_bundle
os.replace = slow_replace
from aot.cli import main
sys.argv[0] = "aotpack"
main()
"""


class Build:
    """``aotpack build`` in a subprocess whose stderr lines are collected as they come."""

    def __init__(self, out: Path, instrumented: bool):
        # for the archs ``built`` builds for: the bundle's members are built("branchy")'s (the
        # kill window is counted from them) and its kernels come from the kernel cache
        args = ["build", str(model_path("branchy")), "-o", str(out), "--arch", ",".join(DEFAULT_ARCHS)]
        cmd = (
            [sys.executable, "-c", WRAPPER, *args]
            if instrumented
            else [sys.executable, "-m", "aot.cli", *args]
        )
        env = {**os.environ, "AOT_TEST_SLOW_WRITE": str(SLOW_WRITE_S), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=out.parent
        )
        self.lines: list[str] = []
        self.marks = {"writing": threading.Event(), "replacing": threading.Event()}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            for mark, event in self.marks.items():
                if line.startswith(f"AOT-TEST {mark}"):
                    event.set()

    def kill(self) -> bool:
        """SIGKILL; returns whether the build was still running."""
        running = self.proc.poll() is None
        if running:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        return running

    def wait(self) -> int:
        rc = self.proc.wait(timeout=BUILD_TIMEOUT_S)
        self._reader.join(timeout=10)
        return rc


def output_state(out: Path, old: bytes) -> str:
    """The output path holds the old bundle byte for byte, or a complete new one that loads and
    reproduces its reference outputs; anything else fails the test."""
    if out.read_bytes() == old:
        return "old bundle intact"
    runner = load(out)
    try:
        got = runner(**runner.example_inputs())
        assert torch.equal(got, runner.reference_outputs()[0]), (
            "the new bundle does not reproduce its reference"
        )
        assert runner.manifest.name == "branchy"
    finally:
        runner.bundle.close()
    return "new bundle complete"


def strays(out: Path, pids: set[int]) -> list[str]:
    """Files beside the output other than the partials of the given (killed) builds."""
    partial = re.compile(rf"^\.{re.escape(out.name)}\.[A-Za-z0-9-]+-(\d+)\.[a-z0-9_]+\.partial$")
    return [
        p.name
        for p in out.parent.iterdir()
        if p != out and not ((m := partial.match(p.name)) and int(m.group(1)) in pids)
    ]


@pytest.mark.slow
def test_sigkill_during_build_never_leaves_a_partial_bundle(tmp_path: Path, built) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.tpk"
    old = built("small_mlp").read_bytes()
    rng = random.Random(SEED)
    states, killed = [], set()

    kills = [("whole run", rng.uniform(*WHOLE_RUN_SPAN)) for _ in range(WHOLE_RUN_KILLS)]
    window = SLOW_WRITE_S * (len(zipfile.ZipFile(built("branchy")).infolist()) + 1)
    kills += [("in write", rng.uniform(0, window)) for _ in range(WRITE_KILLS - 1)] + [("before rename", 0.0)]
    for where, delay in kills:
        out.write_bytes(old)
        build = Build(out, instrumented=where != "whole run")
        if where == "in write":
            assert build.marks["writing"].wait(BUILD_TIMEOUT_S), "".join(build.lines)
        elif where == "before rename":
            assert build.marks["replacing"].wait(BUILD_TIMEOUT_S), "".join(build.lines)
        time.sleep(delay)
        was_running = build.kill()
        killed.add(build.proc.pid)
        state = output_state(out, old)
        assert not strays(out, killed), f"files beside the output after a kill: {strays(out, killed)}"
        states.append(f"{where} +{delay:.2f}s: {'killed' if was_running else 'had finished'}, {state}")
        if where != "whole run":
            assert was_running and state == "old bundle intact", states[-1]

    leftovers = sorted(p.name for p in out_dir.iterdir() if p != out)
    assert any(name.endswith(".partial") for name in leftovers), f"no kill landed in a write: {states}"
    # the next build completes, replaces the old bundle, and removes the killed builds' partials,
    # but not a live build's (one this process holds locked) nor another machine's
    live = out_dir / f".{out.name}.{_host()}-{os.getpid()}.live0000.partial"
    other_host = out_dir / f".{out.name}.elsewhere-1.remote00.partial"
    live.write_bytes(b"x")
    other_host.write_bytes(b"x")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        final = Build(out, instrumented=False)
        assert final.wait() == 0, "".join(final.lines)
    assert output_state(out, old) == "new bundle complete"
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([out.name, live.name, other_host.name]), states
    print("\n".join(states))


def _host() -> str:
    from aot.packager.files import host

    return host()


def test_failed_write_keeps_the_old_bundle_and_removes_its_temporary(
    tmp_path: Path, built, monkeypatch
) -> None:
    """In-process: an exception (or KeyboardInterrupt) in the middle of the write."""
    from aot import packager

    old = built("small_mlp").read_bytes()
    out = tmp_path / "model.tpk"
    out.write_bytes(old)
    with zipfile.ZipFile(built("branchy")) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    manifest_json = members.pop("manifest.json")
    from aot.loader.bundle import open_bundle

    manifest = open_bundle(built("branchy")).manifest
    calls = []
    original = zipfile.ZipFile.writestr

    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", failing)
    with pytest.raises(KeyboardInterrupt):
        packager.write_bundle(out, manifest, members)
    assert out.read_bytes() == old and sorted(os.listdir(tmp_path)) == ["model.tpk"]
    monkeypatch.setattr(zipfile.ZipFile, "writestr", original)
    packager.write_bundle(out, manifest, members)
    with zipfile.ZipFile(out) as zf:
        assert zf.read("manifest.json") == manifest_json
    assert sorted(os.listdir(tmp_path)) == ["model.tpk"]


# Holds an exclusive lock on the file named by argv[1] until its stdin closes: a live build, seen
# from another PID namespace (its process id means nothing here).
HOLDER = """
import fcntl, sys
f = open(sys.argv[1], "rb")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_stale_partials_are_the_ones_no_process_holds_locked(tmp_path: Path) -> None:
    """A partial named for a process id that does not run here may be a live build's in another
    PID namespace; one named for a running process may be a dead build's whose id was reused.
    The lock decides, not the process id."""
    from aot.packager.files import remove_stale_partials

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(done.stdout)  # that process has exited
    host = _host()
    names = {
        "dead": f".m.tpk.{host}-{dead}.abcd1234.partial",
        "live elsewhere": f".m.tpk.{host}-{dead}.efgh5678.partial",
        "id reused": f".m.tpk.{host}-{os.getpid()}.abcd1234.partial",
        "dead weights": f".m.weights.0123456789abcdef.safetensors.{host}-{dead}.ijkl9012.partial",
        "other host": f".m.tpk.otherhost-{dead}.abcd1234.partial",
        "other target": f".n.tpk.{host}-{dead}.abcd1234.partial",
        "not ours": ".m.tpk.notes",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / names["live elsewhere"])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        removed = remove_stale_partials(tmp_path / "m.tpk")
    finally:
        holder.communicate("", timeout=HANG_GUARD_S)
    stale = ("dead", "id reused", "dead weights")
    assert sorted(p.name for p in removed) == sorted(names[k] for k in stale)
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k not in stale)
    assert [p.name for p in remove_stale_partials(tmp_path / "m.tpk")] == [names["live elsewhere"]]


@pytest.mark.slow
def test_split_weights_kill_between_renames_keeps_the_old_pair(tmp_path: Path, monkeypatch, built) -> None:
    from aot import packager

    out = tmp_path / "model.tpk"
    packager.pack(built.compiled("small_mlp"), out, split_weights=True)
    old = load(out)
    expected = old(**old.example_inputs())
    old.bundle.close()

    def killed(*a, **k):
        raise KeyboardInterrupt  # as if SIGKILLed after the weights file was replaced

    new = built.compiled("branchy")
    monkeypatch.setattr(packager, "write_bundle", killed)
    with pytest.raises(KeyboardInterrupt):
        packager.pack(new, out, split_weights=True)
    runner = load(out)  # the old bundle must still load with its own weights
    assert torch.equal(runner(**runner.example_inputs()), expected)
