"""The command line on hostile bundles: every one is a one-line ``error:`` and exit 1 (4 for
``diff``), never an internal error; and strings from a bundle reach the terminal escaped, so a
newline or an escape sequence in a manifest can neither forge a line nor colour the screen.

Each bundle is rewritten as an attacker would (members re-checksummed, ``tests/hostile_util``)
and run through the real executable.
"""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch

from aot.errors import BundleError, GuardError
from aot.loader import load
from aot.loader.weights import parse_safetensors
from aot.serde import upgrade_manifest
from tests.hostile_util import (
    manifest_bytes,
    manifest_of,
    program_json,
    read_entries,
    with_manifest_text,
    with_member,
    with_program_text,
    write_entries,
)
from tests.test_cli import aotpack

FORGED = "\nerror: forged \x1b[31m"


@pytest.fixture(scope="module")
def base(built):
    return built("branchy")


def _write(tmp_path, name: str, entries) -> str:
    path = tmp_path / name
    path.write_bytes(write_entries(entries))
    return str(path)


def _with_manifest(entries, change) -> list:
    m = copy.deepcopy(manifest_of(entries))
    change(m)
    return with_manifest_text(entries, manifest_bytes(m))


def _first_error(r, code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    return r.stderr.splitlines()[0]


# ---------------------------------------------------------------------------------------------
# Hostile bundles: one line each, found where the bundle is parsed.


def test_inspect_refuses_a_malformed_memory_plan_of_an_older_schema(tmp_path, base):
    def old_plan(m):
        m["schema_version"] = [1, 1]
        m["stats"]["memory_plan"] = {"batch=8=9,seq=16": 1024}

    path = _write(tmp_path, "plan.tpk", _with_manifest(read_entries(base.read_bytes()), old_plan))
    assert _first_error(aotpack("inspect", path), 1) == (
        "error: bundle field manifest.stats.memory_plan: expected keys such as 'batch=8,seq=128', "
        "got 'batch=8=9,seq=16'"
    )


def test_older_memory_plans_still_upgrade():
    stats = {"steps": 3, "memory_plan": {"batch=8,seq=128": 4096, "": 1}}
    up = upgrade_manifest({"schema_version": [1, 1], "stats": stats})
    assert up["stats"] == {
        "steps": 3,
        "memory_plan": [{"sizes": {"batch": 8, "seq": 128}, "peak_bytes": 4096}],
    }
    for key in ("batch=x", "batch=²", "batch", "batch=" + "9" * 5000, "=1"):
        with pytest.raises(BundleError, match="manifest.stats.memory_plan"):
            upgrade_manifest({"schema_version": [1, 1], "stats": {"memory_plan": {key: 1}}})


def _safetensors(header: bytes, body: bytes = bytes(4)) -> bytes:
    return struct.pack("<Q", len(header)) + header + body


_ENTRY = '{"w": {"dtype": "F32", "shape": %s, "data_offsets": %s}}'
MALFORMED_HEADERS = {
    "entry a list": b'{"w": [1, 2]}',
    "infinite size": (_ENTRY % ("[1e400]", "[0, 4]")).encode(),
    "infinite offset": (_ENTRY % ("[1]", "[0, 4e400]")).encode(),
    "fractional size": (_ENTRY % ("[1.5]", "[0, 4]")).encode(),
    "size a string": (_ENTRY % ('"1"', "[0, 4]")).encode(),
    "size a boolean": (_ENTRY % ("[true]", "[0, 4]")).encode(),
    "deeply nested size": (_ENTRY % ("[" * 900 + "1" + "]" * 900, "[0, 4]")).encode(),
    "three offsets": (_ENTRY % ("[1]", "[0, 4, 4]")).encode(),
    "unknown field": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 0}}',
}


@pytest.mark.parametrize("label", MALFORMED_HEADERS)
def test_safetensors_entries_are_checked_for_their_types(label):
    with pytest.raises(BundleError, match=r"^w\.tpk: malformed safetensors entry 'w': expected"):
        parse_safetensors(_safetensors(MALFORMED_HEADERS[label]), "w.tpk")


def test_safetensors_headers_that_are_no_object_or_too_deep():
    with pytest.raises(BundleError, match="header is not an object"):
        parse_safetensors(_safetensors(b"[1, 2]"), "w.tpk")
    with pytest.raises(BundleError, match="header is not JSON"):
        parse_safetensors(_safetensors(b"[" * 100_000 + b"]" * 100_000), "w.tpk")


def test_diff_refuses_malformed_weights_headers(tmp_path, base):
    entries = read_entries(base.read_bytes())
    for i, label in enumerate(("infinite size", "deeply nested size")):
        path = _write(
            tmp_path,
            f"w{i}.tpk",
            with_member(entries, "weights.safetensors", _safetensors(MALFORMED_HEADERS[label])),
        )
        assert _first_error(aotpack("diff", str(base), path), 4) == (
            f"error: {path}: malformed safetensors entry 'w': expected an object of a known dtype name, "
            f"a shape of ints and two integer data_offsets"
        ), label


def test_diff_refuses_a_static_size_that_is_no_number(tmp_path, base):
    def superscript(m):
        m["guards"]["inputs"][0]["shape"][2] = "²"

    path = _write(tmp_path, "sq.tpk", _with_manifest(read_entries(base.read_bytes()), superscript))
    assert _first_error(aotpack("diff", str(base), path), 4) == (
        "error: manifest of branchy: input x has size '²', which is neither a static size nor a "
        "symbol it declares; regenerate the manifest"
    )


def test_load_refuses_a_step_that_names_its_own_device(tmp_path, base):
    """A string device argument would leave an output on the meta device (no data to read back)."""
    entries = read_entries(base.read_bytes())
    program = program_json(entries)
    out = program["outputs"][0]
    program["steps"].append(
        {
            "kind": "aten",
            "target": "aten._to_copy.default",
            "args": [{"buf": out}],
            "kwargs": {"device": "meta"},
            "outputs": ["moved"],
        }
    )
    program["buffers"]["moved"] = program["buffers"][out]
    program["outputs"] = ["moved"]
    entries = with_program_text(entries, json.dumps(program).encode())
    entries = _with_manifest(entries, lambda m: m.update(ops=sorted([*m["ops"], "aten._to_copy.default"])))
    path = _write(tmp_path, "meta.tpk", entries)
    assert _first_error(aotpack("load", path), 1) == (
        "error: step aten._to_copy.default passes device='meta'; a bundle's steps run on the runner's "
        "device (the tagged value {'device': 'runtime'}): not a bundle aotpack wrote, rebuild it"
    )


# ---------------------------------------------------------------------------------------------
# Strings from a bundle on the terminal.


@pytest.fixture(scope="module")
def forged(base, tmp_path_factory) -> str:
    """The bundle with a newline and an escape sequence in its name and every guard's file and code."""

    def forge(m):
        m["name"] += FORGED
        for sym in m["guards"]["symbols"]:
            for src in sym["sources"]:
                src["file"] += FORGED
                src["code"] += FORGED

    path = tmp_path_factory.mktemp("forged") / "forged.tpk"
    path.write_bytes(write_entries(_with_manifest(read_entries(base.read_bytes()), forge)))
    return str(path)


def _clean(text: str) -> None:
    assert "\x1b" not in text
    assert not any(line.startswith("error: forged") for line in text.splitlines())


@pytest.mark.parametrize("command", ["inspect", "guards", "diff"])
def test_manifest_strings_are_escaped_on_the_terminal(forged, base, command):
    args = [command, str(base), forged] if command == "diff" else [command, forged]
    r = aotpack(*args)
    assert r.returncode == (1 if command == "diff" else 0), r.stderr
    _clean(r.stdout + r.stderr)
    assert "forged \\x1b[31m" in r.stdout  # shown, escaped
    if command == "inspect":  # guards and diff read the manifest as its text, where a newline is a space
        assert "\\nerror: forged" in r.stdout


def test_guard_error_messages_escape_the_guard_site(forged):
    runner = load(forged)
    try:
        with pytest.raises(GuardError) as e:
            runner(torch.ones(2, 7, 16))
    finally:
        runner.bundle.close()
    message = str(e.value)
    _clean(message)
    assert "\n" not in message and "if T > 8:\\nerror: forged \\x1b[31m" in message
    r = aotpack("load", forged, "--sizes", "seq=7")
    _first_error(r, 1)
    loaded, error = r.stderr.splitlines()  # progress, then the one error line
    assert loaded.startswith("loaded ") and error.startswith(
        "error: requested size (seq): expected 10 <= seq"
    )
    _clean(r.stderr)
