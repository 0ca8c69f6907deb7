"""What a hostile but self-consistent bundle (members rewritten and re-signed in the manifest) can
make the loader spend: inflated bytes, zip directory size, a weights file beside the bundle, the
weights header, memory per call, program length and guard relations. Each is refused at load with
a ``BundleError`` (or, for a caller's ``max_memory``, an ``EnvError``) before the cost is paid.
Large hostile files are made here, in ``tmp_path``, and each test stays within seconds."""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import aot.loader.bundle as bundle_module
from aot.archive import MAX_DIRECTORY_BYTES, MAX_MEMBERS
from aot.errors import BundleError, EnvError
from aot.loader import load
from aot.loader.bundle import MAX_INFLATED_TOTAL, MAX_STEPS
from aot.loader.guards import MAX_RELATION_NODES, MAX_RELATIONS
from aot.loader.weights import header_limit, parse_safetensors
from aot.schema import Program
from aot.symexpr import MAX_NODES, compile_expr
from tests.conftest import HANG_GUARD_S
from tests.hostile_util import (
    deflated_members,
    manifest_bytes,
    manifest_of,
    overlapping,
    patch,
    program_json,
    read_entries,
    safetensors_bytes,
    with_manifest_text,
    with_member,
    with_program_text,
    write_entries,
    zip_layout,
)


def _write(tmp_path, data: bytes, name: str = "b.tpk"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.fixture
def entries(built):
    return read_entries(built("branchy").read_bytes())


@pytest.fixture
def member_reads(monkeypatch):
    """Members opened (inflated) through zipfile, recorded."""
    opened: list[str] = []
    real = zipfile.ZipFile.open

    def spy(self, name, *args, **kwargs):
        opened.append(getattr(name, "filename", name))
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    return opened


# ---------------------------------------------------------------------------------------------
# Zip layout: overlapping members, inflation in total, the directory's size.


def test_overlapping_members_are_refused_before_any_is_inflated(tmp_path, entries, member_reads):
    stored = [r.name for r in sorted(zip_layout(write_entries(entries)), key=lambda r: r.local_offset)]
    name = next(n for n, following in zip(stored, stored[1:]) if n.endswith(".cubin"))
    path = _write(tmp_path, overlapping(entries, name))
    with zipfile.ZipFile(path) as zf:
        assert zf.read(name) == next(e.data for e in entries if e.name == name)  # zipfile sees no fault
    member_reads.clear()
    with pytest.raises(BundleError, match=rf"members '{name}' and '.+' overlap in the archive"):
        load(path)
    assert member_reads == []


def test_member_data_past_the_directory_is_refused(tmp_path, entries):
    archive = write_entries(entries)
    last = max(zip_layout(archive), key=lambda r: r.local_offset)
    path = _write(tmp_path, patch(archive, last.cd_offset + 20, "<I", last.compress_size + 100))
    with pytest.raises(BundleError, match=rf"member '{last.name}' runs past the start of the zip directory"):
        load(path)


def test_deflated_members_are_bounded_in_total(tmp_path, entries, member_reads, monkeypatch):
    count = MAX_INFLATED_TOTAL // (1 << 20) + 8  # each 1 MiB member is far within the per-member limit
    path = _write(tmp_path, write_entries(deflated_members(entries, count, 1 << 20)))
    assert path.stat().st_size < 2 << 20
    member_reads.clear()
    inflating: list[int] = []
    real = zipfile._get_decompressor

    def decompressor(compress_type):  # every zipfile read of a deflated member starts here
        inflating.append(compress_type)
        return real(compress_type)

    monkeypatch.setattr(zipfile, "_get_decompressor", decompressor)
    with pytest.raises(BundleError, match=rf"compressed members inflate to more than {MAX_INFLATED_TOTAL}"):
        load(path)
    # refused on the sizes the directory declares: no member opened, not a byte inflated
    assert member_reads == [] and inflating == []


def test_many_small_deflated_members_within_the_total_still_load(tmp_path, entries):
    path = _write(tmp_path, write_entries(deflated_members(entries, 40, 1 << 16)))
    load(path).bundle.close()


def _zip_of(names_and_extras: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, extra in names_and_extras:
            info = zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0))
            info.extra = extra
            zf.writestr(info, b"")
    return buf.getvalue()


@pytest.mark.parametrize(
    "what, archive",
    [
        ("entries", lambda: _zip_of([(f"kernels/k{i}.py", b"") for i in range(MAX_MEMBERS + 1)])),
        (
            "bytes",
            lambda: _zip_of(
                [
                    (f"kernels/k{i}.py", struct.pack("<HH", 0xCAFE, 65000) + bytes(65000))
                    for i in range(MAX_DIRECTORY_BYTES // 65000 + 1)
                ]
            ),
        ),
    ],
)
def test_an_oversized_zip_directory_is_refused_before_zipfile_parses_it(tmp_path, monkeypatch, what, archive):
    parsed = []
    real = zipfile.ZipFile._RealGetContents
    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", lambda self: parsed.append(1) or real(self))
    path = _write(tmp_path, archive())
    with pytest.raises(BundleError, match=r"zip directory of \d+ entries in \d+ bytes \(limit"):
        load(path)
    assert parsed == []


# ---------------------------------------------------------------------------------------------
# Split weights: the file beside the bundle.


@pytest.fixture
def split_bundle(tmp_path, built):
    from aot.packager import pack

    path = tmp_path / "split.tpk"
    pack(built.compiled("branchy"), path, split_weights=True)
    weights = next(p for p in tmp_path.iterdir() if p.name.endswith(".safetensors"))
    return path, weights


def test_a_fifo_named_like_the_weights_file_is_refused_without_blocking(split_bundle):
    path, weights = split_bundle
    weights.unlink()
    os.mkfifo(weights)

    def hung(signum, frame):
        pytest.fail("load blocked on the FIFO")  # not an OSError: the loader's handlers do not catch it

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)  # a hang guard (a blocking open never returns), far above the load's own time
    try:
        with pytest.raises(BundleError, match=rf"{weights.name}: not a regular file"):
            load(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_device_named_like_the_weights_file_is_refused(split_bundle):
    path, weights = split_bundle
    weights.unlink()
    weights.symlink_to("/dev/zero")
    with pytest.raises(BundleError, match="not a regular file"):
        load(path)


def test_a_huge_neighbour_file_is_refused_before_it_is_read(split_bundle, monkeypatch):
    path, weights = split_bundle
    huge = 1 << 30
    with open(weights, "r+b") as f:
        f.truncate(huge)  # sparse: no disk used
    archive = read_entries(path.read_bytes())
    m = manifest_of(archive)
    m["members"]["weights.safetensors"] = {"sha256": "0" * 64, "size": huge}
    path.write_bytes(write_entries(with_manifest_text(archive, manifest_bytes(m))))
    reads = []
    monkeypatch.setattr(bundle_module.Bundle, "_read_external", lambda self, size: reads.append(size))
    with pytest.raises(
        BundleError, match=rf"is {huge} bytes, more than the \d+ that the program's 2 weights"
    ):
        load(path)
    assert reads == []


def test_split_weights_still_load(split_bundle, built):
    path, _ = split_bundle
    runner = load(path)
    inputs = runner.example_inputs()
    torch.testing.assert_close(runner(**inputs), load(built("branchy"))(**inputs), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The weights' safetensors header, and tensors no step reads.


def _weights(entries):
    data = next(e.data for e in entries if e.name == "weights.safetensors")
    n = struct.unpack("<Q", data[:8])[0]
    return data, n, json.loads(data[8 : 8 + n])


def test_an_oversized_weights_header_is_refused_before_it_is_parsed(tmp_path, entries, monkeypatch):
    data, n, header = _weights(entries)
    text = json.dumps(header).encode() + b" " * (16 << 20)
    blob = struct.pack("<Q", len(text)) + text + data[8 + n :]
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(len(s)) or real(s, *a, **k))
    path = _write(tmp_path, write_entries(with_member(entries, "weights.safetensors", blob)))
    with pytest.raises(BundleError, match=r"more than the \d+ that the program's 2 weights take"):
        load(path)
    assert max(parsed) < 1 << 20  # the manifest and program, never the header
    # the header itself, where the file's size leaves room for it (the slack between tensors)
    with pytest.raises(
        BundleError, match=rf"header of {len(text)} bytes, more than the 67584 its tensors need"
    ):
        parse_safetensors(blob, "weights", header_limit(2))
    assert max(parsed) < 1 << 20


def test_weights_no_step_reads_are_not_kept(tmp_path, entries, built):
    from safetensors.torch import load as st_load

    data, _, _ = _weights(entries)
    tensors = {**st_load(data), "zz_unread": torch.zeros(2)}
    path = _write(
        tmp_path, write_entries(with_member(entries, "weights.safetensors", safetensors_bytes(tensors)))
    )
    runner = load(path)
    assert sorted(runner.weights) == sorted(st_load(data))
    inputs = runner.example_inputs()
    assert torch.equal(runner(**inputs), load(built("branchy"))(**inputs))


def test_many_unread_tensors_are_refused_by_the_weights_size(tmp_path, entries):
    from safetensors.torch import load as st_load

    data, _, _ = _weights(entries)
    tensors = {**st_load(data), **{f"zz_{i}": torch.zeros(1) for i in range(20000)}}
    path = _write(
        tmp_path, write_entries(with_member(entries, "weights.safetensors", safetensors_bytes(tensors)))
    )
    with pytest.raises(BundleError, match=r"more than the \d+ that the program's 2 weights take"):
        load(path)


# ---------------------------------------------------------------------------------------------
# Memory per call.


def test_max_memory_refuses_a_bundle_whose_peak_exceeds_it(built):
    path = built("branchy")
    peak = load(path).manifest.stats.memory_plan[0].peak_bytes  # the largest bucket: batch=16, seq=256
    with pytest.raises(
        EnvError,
        match=r"program 'general' needs up to 0\.5 MiB of activations per call \(at the sizes its guards "
        r"admit, up to batch=16, seq=256\), more than max_memory 0\.1 MiB; raise max_memory",
    ):
        load(path, max_memory=100_000)
    assert peak == 524288
    load(path, max_memory=peak).bundle.close()


def test_cli_max_memory(built):
    path = str(built("branchy"))
    refused = subprocess.run(
        [sys.executable, "-m", "aot.cli", "load", path, "--max-memory", "100KB", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "error: program 'general' needs up to 0.5 MiB of activations per call (at the sizes its guards "
        "admit, up to batch=16, seq=256), more than max_memory 0.1 MiB; raise max_memory, or rebuild "
        "with smaller declared ranges"
    ]


def test_cli_max_memory_sizes():
    import click

    from aot.cli.options import parse_bytes

    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512 MB") == 512_000_000
    assert parse_bytes("1.5kib") == 1536
    assert parse_bytes("1000000") == 1_000_000
    for bad in ("lots", "-1GB", "0", "2XB", "1e30"):
        with pytest.raises(click.BadParameter, match="expected a size such as 2GiB"):
            parse_bytes(bad)


def _allocating(entries, shape: str, declared: str) -> bytes:
    """The program with a first step that makes a float32 tensor of ``shape`` (a size expression)
    into a buffer declared ``declared``, read by nothing."""
    p = program_json(entries)
    p["steps"].insert(
        0,
        {
            "kind": "aten",
            "target": "aten.zeros.default",
            "args": [[{"sym": shape}]],
            "kwargs": {"dtype": {"dtype": "float32"}, "device": {"device": "runtime"}},
            "outputs": ["zz_big"],
            "grid": [],
            "reference": [],
        },
    )
    p["buffers"]["zz_big"] = {"dtype": "float32", "shape": [declared]}
    out = with_program_text(entries, json.dumps(p).encode())
    m = manifest_of(out)
    m["ops"] = sorted(set(m["ops"]) | {"aten.zeros.default"})
    return write_entries(with_manifest_text(out, manifest_bytes(m)))


def test_a_plan_that_understates_the_programs_buffers_is_refused(tmp_path, entries):
    # 1 GiB at the largest bucket, declared honestly, while the plan still claims 0.5 MiB
    path = _write(tmp_path, _allocating(entries, "batch*seq*65536", "batch*seq*65536"))
    with pytest.raises(
        BundleError,
        match=r"the memory plan says 524288 bytes at batch=16, seq=256, the program's buffers take",
    ):
        load(path)


def test_max_memory_bounds_every_admitted_size_not_only_the_largest(tmp_path, entries):
    """A buffer that shrinks as ``seq`` grows: at the largest sizes the peak is within the budget,
    at the smallest it is not; the bound covers both (the manifest's plan re-signed to match)."""
    from aot.program import peak_bytes
    from aot.schema import Program
    from aot.serde import from_json

    shrinking = "max(1, 1000000 - seq*4000)"  # 3.8 MB of float32 at seq=10, 4 bytes at seq=256
    archive = read_entries(_allocating(entries, shrinking, shrinking))
    program = from_json(Program, program_json(archive))
    m = manifest_of(archive)
    for entry in m["stats"]["memory_plan"]:
        entry["peak_bytes"] = peak_bytes(program, entry["sizes"])
    path = _write(tmp_path, write_entries(with_manifest_text(archive, manifest_bytes(m))))
    runner = load(path)  # the plan agrees with the program now
    inputs = runner.inputs_at({"seq": 10})  # the smallest seq branchy admits
    runner(**inputs)  # makes the 3.8 MB buffer: what max_memory must count
    with pytest.raises(
        EnvError,
        match=r"needs up to 3\.7 MiB of activations per call \(at the sizes its guards admit, up to batch=16, seq=256\)",
    ):
        load(path, max_memory=1 << 20)


def test_a_step_that_makes_more_than_its_buffer_declares_is_refused(tmp_path, entries):
    """Refused before the step allocates (``aot.loader.prerun``): a call used to allocate it first."""
    path = _write(tmp_path, _allocating(entries, "batch*seq*4", "batch"))
    runner = load(path)
    inputs = runner.example_inputs()
    with pytest.raises(
        BundleError,
        match=r"step 0 aten\.zeros\.default would make 'zz_big' of \d+ bytes .* refused before it ran",
    ):
        runner(**inputs)


# ---------------------------------------------------------------------------------------------
# Program length, expressions, relations.


def test_program_length_is_bounded(tmp_path, entries, monkeypatch):
    p = program_json(entries)
    step = next(s for s in p["steps"] if s["kind"] == "aten" and s["outputs"][0] is not None)
    source = step["outputs"][0]
    extra = []
    for i in range(MAX_STEPS + 1 - sum(1 + len(s["reference"]) for s in p["steps"])):
        extra.append({**copy.deepcopy(step), "outputs": [f"zz_{i}"]})
        p["buffers"][f"zz_{i}"] = p["buffers"][source]
    p["steps"] = p["steps"] + extra
    path = _write(tmp_path, write_entries(with_program_text(entries, json.dumps(p).encode())))
    decoded: list[object] = []
    real = bundle_module.from_json

    def from_json(cls, *args, **kwargs):
        if cls is Program:
            decoded.append(cls)
            raise AssertionError("the program's steps were decoded before they were counted")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(bundle_module, "from_json", from_json)
    with pytest.raises(BundleError, match=rf"the programs have {MAX_STEPS + 1} steps \(limit {MAX_STEPS}\)"):
        load(path)
    assert decoded == []  # counted in the JSON, before its steps are decoded into records


def test_an_expression_of_too_many_nodes_is_refused(tmp_path, entries):
    p = program_json(entries)
    p["buffers"][p["steps"][0]["outputs"][0]]["shape"][0] += "+0" * MAX_NODES
    path = _write(tmp_path, write_entries(with_program_text(entries, json.dumps(p).encode())))
    with pytest.raises(BundleError, match=rf"syntax nodes \(limit {MAX_NODES}\)"):
        load(path)


def _with_relations(entries, exprs: list[str]) -> bytes:
    m = manifest_of(entries)
    source = {"text": "", "file": "model.py", "line": 1, "code": "x"}
    m["guards"]["relations"] = [{"expr": e, "source": source} for e in exprs]
    return write_entries(with_manifest_text(entries, manifest_bytes(m)))


def _balanced_sum(leaves: int) -> str:
    if leaves == 1:
        return "batch"
    return f"({_balanced_sum(leaves // 2)} + {_balanced_sum(leaves - leaves // 2)})"


def test_guard_relations_are_bounded(tmp_path, entries):
    path = _write(tmp_path, _with_relations(entries, ["batch <= seq + 1000"] * (MAX_RELATIONS + 1)))
    with pytest.raises(
        BundleError, match=rf"guards hold {MAX_RELATIONS + 1} relations \(limit {MAX_RELATIONS}\)"
    ):
        load(path)
    big = f"{_balanced_sum(60)} >= 0"  # each within MAX_NODES, together beyond MAX_RELATION_NODES
    nodes = compile_expr(big).nodes
    assert nodes <= MAX_NODES and 9 * nodes > MAX_RELATION_NODES
    path = _write(tmp_path, _with_relations(entries, [big] * 9), "nodes.tpk")
    with pytest.raises(BundleError, match=rf"more than {MAX_RELATION_NODES} syntax nodes in all"):
        load(path)
    path = _write(tmp_path, _with_relations(entries, ["batch <= seq + 1000"] * 3), "few.tpk")
    load(path).bundle.close()


def test_real_programs_are_far_inside_the_bounds(built):
    """A model with kernels, variants and several inputs: its steps, expression nodes and relations
    take a small fraction of each bound (GPT-2 small: 395 steps, 3,248 expression nodes)."""
    from aot.loader.bundle import MAX_EXPRESSION_NODES, _expressions, open_bundle

    for model in ("small_mlp", "size_one", "forced_equal"):
        bundle = open_bundle(built(model))
        program = bundle.program()
        programs = [program, *program.variants]
        steps = sum(len(p.steps) + sum(len(s.reference) for s in p.steps) for p in programs)
        nodes = sum(compile_expr(t).nodes for p in programs for t in _expressions(p))
        assert steps < MAX_STEPS / 100 and nodes < MAX_EXPRESSION_NODES / 100, (model, steps, nodes)
        assert len(bundle.manifest.guards.relations) <= 1
        bundle.close()
