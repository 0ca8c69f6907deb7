"""Hostile but self-consistent programs: re-signed bundles whose steps try to read or write memory
outside their tensors, touch autograd or the process's random generator, alias the runner's
weights, hand back other outputs than they declare, or make loading slow.

Cases that crashed the process before the loader refused them run in a subprocess, so that a
regression fails the test instead of killing the run.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aot.errors import BundleError
from aot.loader import load
from aot.program import frees_after
from aot.schema import Buf, Step, StepKind
from tests.conftest import HANG_GUARD_S, ROOT
from tests.hostile_util import (
    aten_step,
    program_json,
    read_entries,
    resigned_program,
    with_program_text,
    write_entries,
)

CPU = {"device": "runtime"}
F32 = {"dtype": "float32"}
I64 = {"dtype": "int64"}


@pytest.fixture(scope="module")
def branchy(built) -> tuple[bytes, dict]:
    """The bundle of tests/data/branchy.py (weights proj.weight [16, 16], proj.bias [16]: 64
    bytes) and its program's JSON tree."""
    data = built("branchy").read_bytes()
    return data, program_json(read_entries(data))


def with_steps(
    prog: dict,
    steps: list[dict],
    output: str | None = None,
    spec: dict | None = None,
    declare: dict[str, dict] | None = None,
) -> dict:
    """``prog`` with ``steps`` run first and the buffers in ``declare`` declared (as a
    self-consistent attacker would declare its steps' results); with ``output``, the program
    returns that buffer alone."""
    p = copy.deepcopy(prog)
    p["steps"][0:0] = steps
    p["buffers"].update(declare or {})
    if output is not None:
        p["outputs"] = [output]
        p["buffers"][output] = spec
    return p


DRIVER = r"""
import json, sys
import torch
from aot.errors import AotError
from aot.loader import load

for path in sys.argv[1:]:
    try:
        runner = load(path)
    except AotError as e:
        print(json.dumps([path, type(e).__name__ + "@load", str(e)]), flush=True)
        continue
    try:
        runner(torch.ones(2, 16, 16))
        print(json.dumps([path, "accepted", ""]), flush=True)
    except AotError as e:
        print(json.dumps([path, type(e).__name__ + "@call", str(e)]), flush=True)
"""


def outcomes_in_subprocess(paths: list[Path]) -> dict[str, tuple[str, str]]:
    """Load and call each bundle in a fresh process: path → (outcome, message). A crash fails."""
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=ROOT,
    )
    done = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    assert r.returncode == 0, (
        f"the process died (status {r.returncode}) after {len(done)} of {len(paths)} bundles, "
        f"at {paths[len(done)] if len(done) < len(paths) else '?'}: {r.stderr[-2000:]}"
    )
    return {path: (outcome, message) for path, outcome, message in done}


def memory_unsafe_programs(prog: dict) -> dict[str, tuple[str, dict]]:
    """label → (the op that must be named, program): each read the heap or crashed the process
    when any ATen op was reachable."""
    out_spec = lambda *shape: {"dtype": "float32", "shape": [str(s) for s in shape]}  # noqa: E731
    return {
        # 256 KiB of the heap past the 64-byte bias, returned to the caller
        "_reshape_alias reads past a weight": (
            "aten._reshape_alias.default",
            with_steps(
                prog,
                [
                    aten_step("aten._reshape_alias.default", [{"buf": "proj.bias"}, [65536], [1]], ["zz_v"]),
                    aten_step("aten.clone.default", [{"buf": "zz_v"}], ["zz_leak"]),
                ],
                "zz_leak",
                out_spec(65536),
            ),
        ),
        "_reshape_alias with a huge stride": (
            "aten._reshape_alias.default",
            with_steps(
                prog,
                [
                    aten_step(
                        "aten._reshape_alias.default", [{"buf": "proj.bias"}, [4], [1 << 40]], ["zz_v"]
                    ),
                    aten_step("aten.clone.default", [{"buf": "zz_v"}], ["zz_out"]),
                ],
                "zz_out",
                out_spec(4),
            ),
        ),
        "_sparse_coo_tensor_unsafe + _to_dense writes out of bounds": (
            "aten._sparse_coo_tensor_unsafe.default",
            with_steps(
                prog,
                [
                    aten_step("aten.full.default", [[2, 1], 1 << 30], ["zz_idx"], dtype=I64, device=CPU),
                    aten_step("aten.full.default", [[1], 7.0], ["zz_val"], dtype=F32, device=CPU),
                    aten_step(
                        "aten._sparse_coo_tensor_unsafe.default",
                        [{"buf": "zz_idx"}, {"buf": "zz_val"}, [4, 4]],
                        ["zz_sp"],
                    ),
                    aten_step("aten._to_dense.default", [{"buf": "zz_sp"}], ["zz_out"]),
                ],
                "zz_out",
                out_spec(4, 4),
            ),
        ),
        "segment_reduce unsafe": (
            "aten.segment_reduce.default",
            with_steps(
                prog,
                [
                    aten_step("aten.full.default", [[1], 1 << 30], ["zz_len"], dtype=I64, device=CPU),
                    aten_step(
                        "aten.segment_reduce.default",
                        [{"buf": "proj.bias"}, "sum"],
                        ["zz_out"],
                        lengths={"buf": "zz_len"},
                        unsafe=True,
                    ),
                ],
                "zz_out",
                out_spec(1),
            ),
        ),
    }


def test_memory_unsafe_ops_are_refused_at_load(tmp_path, branchy):
    base, prog = branchy
    cases = memory_unsafe_programs(prog)
    paths = []
    for i, (_, p) in enumerate(cases.values()):
        paths.append(tmp_path / f"case{i}.tpk")
        paths[-1].write_bytes(resigned_program(base, p))
    got = outcomes_in_subprocess(paths)
    for path, (label, (op, _)) in zip(paths, cases.items()):
        outcome, message = got[str(path)]
        assert outcome == "BundleError@load", (label, outcome, message)
        assert op in message and "rebuild the bundle with a trusted aotpack" in message, (label, message)


@pytest.mark.parametrize(
    "op, step",
    [
        # set a caller's parameter .grad through autograd
        (
            "aten._backward.default",
            aten_step("aten._backward.default", [{"buf": "x"}, [], None, None, False], [None]),
        ),
        # advance the process-wide generator
        ("aten.randn.default", aten_step("aten.randn.default", [[4]], ["zz_r"], dtype=F32, device=CPU)),
        ("aten.bernoulli.p", aten_step("aten.bernoulli.p", [{"buf": "x"}, 0.5], ["zz_r"])),
        (
            "aten.native_dropout.default",
            aten_step("aten.native_dropout.default", [{"buf": "x"}, 0.5, True], ["zz_r", None]),
        ),
        (
            "dropout_p=0.5",
            aten_step(
                "aten.scaled_dot_product_attention.default",
                [{"buf": "x"}, {"buf": "x"}, {"buf": "x"}, None, 0.5],
                ["zz_r"],
            ),
        ),
    ],
)
def test_ops_with_effects_outside_the_bundle_are_refused_at_load(tmp_path, branchy, op, step):
    base, prog = branchy
    path = tmp_path / "case.tpk"
    results = {o: {"dtype": "float32", "shape": ["4"]} for o in step["outputs"] if o is not None}
    path.write_bytes(resigned_program(base, with_steps(prog, [step], declare=results)))
    rng = torch.get_rng_state()
    with pytest.raises(BundleError, match=r"rebuild the bundle with a trusted aotpack") as e:
        load(path)(torch.ones(2, 16, 16))
    assert op in str(e.value)
    assert torch.equal(torch.get_rng_state(), rng)


def test_strided_view_of_a_weight_is_checked_at_load(tmp_path, branchy):
    """``as_strided`` over the 16-float bias reaching float 40: refused before any call."""
    base, prog = branchy
    step = aten_step("aten.as_strided.default", [{"buf": "proj.bias"}, [4], [10], 2], ["zz_v"])
    path = tmp_path / "case.tpk"
    declare = {"zz_v": {"dtype": "float32", "shape": ["4"]}}
    path.write_bytes(resigned_program(base, with_steps(prog, [step], declare=declare)))
    with pytest.raises(
        BundleError, match=r"aten.as_strided.default cannot view weight 'proj.bias'.*trusted aotpack"
    ):
        load(path)


def test_size_dependent_strided_view_is_checked_per_call(tmp_path, branchy):
    """A view whose geometry depends on the call's sizes fits at some sizes and not at others:
    refused at the call that would reach outside its base, and the runner keeps serving."""
    base, prog = branchy
    step = aten_step("aten.as_strided.default", [{"buf": "x"}, [{"sym": "seq*seq"}], [16], 0], ["zz_v"])
    path = tmp_path / "case.tpk"
    declare = {"zz_v": {"dtype": "float32", "shape": ["seq*seq"]}}
    path.write_bytes(resigned_program(base, with_steps(prog, [step], declare=declare)))
    runner = load(path)
    runner(torch.ones(16, 16, 16))  # seq*seq rows of 16 floats fit in batch*seq rows while seq <= batch
    with pytest.raises(BundleError, match=r"aten.as_strided.default.*out of bounds"):
        runner(torch.ones(2, 16, 16))
    runner(torch.ones(16, 16, 16))


def test_check_in_storage_refuses_views_beyond_their_storage():
    from aot.aten import check_in_storage

    w = torch.zeros(16)
    check_in_storage(w[4:], "aten.slice.Tensor")
    check_in_storage(w.expand(3, 16), "aten.expand.default")
    check_in_storage(torch.zeros(0)[:0], "aten.slice.Tensor")
    for size, stride in (([65536], [1]), ([4], [1 << 40])):
        unchecked = torch.ops.aten._reshape_alias.default(w, size, stride)  # never read
        with pytest.raises(BundleError, match=r"reaches outside its 64-byte storage"):
            check_in_storage(unchecked, "aten._reshape_alias.default")


def test_calls_record_no_autograd_graph(built):
    """An input that requires grad gives outputs without a graph, which stay ordinary tensors:
    writable in place and usable in the caller's own autograd."""
    runner = load(built("branchy"))
    x = torch.randn(2, 16, 16, requires_grad=True)
    out = runner(x)
    assert not out.requires_grad and out.grad_fn is None and x.grad is None
    assert not any(w.requires_grad or w.grad is not None for w in runner.weights.values())
    head = torch.ones(16, requires_grad=True)
    (out * head).sum().backward()
    assert head.grad is not None and x.grad is None
    out.add_(1)  # an inference tensor would refuse this


def test_output_that_views_a_weight_is_the_callers_own(built):
    """``self.prompt[1:]`` is a slice of the runner's weight: editing it must not change the
    weight, nor what later calls return (CPU path; the GPU path clones through the same rule)."""
    runner = load(built("prompt_slice"))
    x = torch.randn(2, 8)
    first = runner(x)
    kept = [t.clone() for t in first]
    torch.testing.assert_close(kept[1], runner.weights["prompt"][1:], rtol=0, atol=0)
    for t in first:
        t.add_(100.0)
    again = runner(x)
    for got, want in zip(again, kept):
        assert torch.equal(got, want)


def test_output_that_views_an_input_is_the_callers_own(tmp_path, branchy):
    """A program whose output is a reshape of the input: the caller's later edit of the input
    must not reach the output it was handed, nor the reverse."""
    base, prog = branchy
    p = copy.deepcopy(prog)
    p["steps"].append(aten_step("aten.slice.Tensor", [{"buf": "x"}, 1, 1, 9223372036854775807], ["zz_s"]))
    p["outputs"] = ["zz_s"]
    p["buffers"]["zz_s"] = {"dtype": "float32", "shape": ["batch", "seq - 1", "16"]}
    path = tmp_path / "case.tpk"
    path.write_bytes(resigned_program(base, p))
    x = torch.randn(2, 16, 16)
    out = load(path)(x)
    assert torch.equal(out, x[:, 1:])
    x.add_(1)
    assert not torch.equal(out, x[:, 1:])


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"dtype": "float64"},
            r"'relu' is torch.float32 \[2, 16, 16\] on cpu, the program declares torch.float64 \[2, 16, 16\]",
        ),
        (
            {"shape": ["batch", "seq", "17"]},
            r"'relu' is torch.float32 \[2, 16, 16\] on cpu, the program declares torch.float32 \[2, 16, 17\]",
        ),
        (  # the same bytes in another shape: only the output check can tell
            {"shape": ["seq", "batch", "16"]},
            r"'relu' is torch.float32 \[2, 16, 16\] on cpu, the program declares torch.float32 \[16, 2, 16\]",
        ),
    ],
)
def test_outputs_are_checked_against_their_specs(tmp_path, branchy, change, expected):
    base, prog = branchy
    p = copy.deepcopy(prog)
    p["buffers"]["relu"] = {**p["buffers"]["relu"], **change}
    path = tmp_path / "case.tpk"
    path.write_bytes(resigned_program(base, p))
    with pytest.raises(BundleError, match=expected + r".*rebuild it with a trusted aotpack"):
        load(path)(torch.ones(2, 16, 16))


def _split_then_cat(n: int) -> tuple[list[Step], tuple[str, ...]]:
    """One step binds ``n`` results, the next reads them all, the last to use each."""
    names = tuple(f"o{i}" for i in range(n))
    steps = [
        Step(kind=StepKind.ATEN, target="aten.split.Tensor", args=(Buf("x"), 1), kwargs={}, outputs=names),
        Step(
            kind=StepKind.ATEN,
            target="aten.cat.default",
            args=([Buf(o) for o in names],),
            kwargs={},
            outputs=("y",),
        ),
    ]
    return steps, names


def _lines_run(module, fn, *args) -> int:
    """The Python lines of ``module`` that ``fn(*args)`` runs: its work, counted, not timed."""
    count, source = 0, module.__file__

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == source else None

    sys.settrace(calls)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


class _Hung(Exception):
    pass


def _on_hang(signum, frame):
    raise _Hung()


def test_liveness_of_many_buffers_freed_at_one_step_is_linear():
    """One step reads the 300,000 results of another, the last to use each: all are freed after
    it, in linear time (a tuple grown one name at a time took hours)."""
    import aot.program

    # the lines run grow with the buffers, not with their square: 4x the buffers, about 4x the work
    small, large = (
        _lines_run(aot.program, frees_after, _split_then_cat(k)[0], ["x"], ["y"]) for k in (2000, 8000)
    )
    assert large <= 4.2 * small, (small, large)
    steps, names = _split_then_cat(300_000)
    old = signal.signal(signal.SIGALRM, _on_hang)
    signal.alarm(30)  # a hang guard, far above the fraction of a second this takes on an idle machine
    try:
        frees = frees_after(steps, ["x"], ["y"])
    except _Hung:
        frees = None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert frees is not None, "frees_after() hung on 300,000 buffers freed at one step"
    assert frees[0] == () and sorted(frees[1]) == sorted(names)


def _refuse_decoding_the_program(monkeypatch) -> list[type]:
    """Make decoding the program JSON into records (the costly step: seconds for a million
    values) fail the test; returns the record of any attempt."""
    import aot.loader.bundle as bundle_module
    from aot.schema import Program

    decoded: list[type] = []
    real = bundle_module.from_json

    def from_json(cls, *args, **kwargs):
        if cls is Program:
            decoded.append(cls)
            raise AssertionError("the program was decoded into records before its bounds were checked")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(bundle_module, "from_json", from_json)
    return decoded


@pytest.mark.parametrize(
    "n, refusal",
    [
        (1_500_000, r"program holds 1500\d\d\d JSON values \(limit 524288\)"),
        (100_000, r"step aten.split.Tensor binds 100000 results \(limit 65536\)"),
    ],
)
def test_a_step_with_a_million_outputs_is_refused_at_load(tmp_path, branchy, n, refusal, monkeypatch):
    """0.6 MB of bundle whose one extra step binds 1.5 million unused results (and a smaller one
    of 100,000): refused on the raw JSON in about a second (decoding it took over 20 s)."""
    base, prog = branchy
    step = aten_step("aten.split.Tensor", [{"buf": "x"}, 1], [f"{i:x}" for i in range(n)])
    path = tmp_path / "case.tpk"
    path.write_bytes(resigned_program(base, with_steps(prog, [step])))
    assert path.stat().st_size < 2 << 20
    decoded = _refuse_decoding_the_program(monkeypatch)
    with pytest.raises(BundleError, match=refusal):
        load(path)
    assert decoded == []  # refused on the raw JSON, before its records are built


def test_a_program_of_millions_of_values_is_refused_at_load(tmp_path, branchy, monkeypatch):
    """8 MB of program holding 4 million integers (a view's size list): refused before decoding
    (decoding them into records took 40 s)."""
    base, prog = branchy
    step = aten_step("aten.view.default", [{"buf": "x"}, [1] * 4_000_000], ["zz_v"])
    path = tmp_path / "case.tpk"
    path.write_bytes(resigned_program(base, with_steps(prog, [step])))
    decoded = _refuse_decoding_the_program(monkeypatch)
    with pytest.raises(BundleError, match=r"program holds 4000\d\d\d JSON values \(limit 524288\)"):
        load(path)
    assert decoded == []  # counted on the raw JSON (the refusal says so), never decoded into records


@pytest.mark.parametrize(
    "where, value",
    [
        (("steps",), 1.5),
        (("steps", 0, "reference"), -1),
        (("steps", 0, "outputs"), True),
        (("variants",), "x"),
    ],
)
def test_wrong_types_around_step_results_are_bundle_errors(tmp_path, branchy, where, value):
    """The bound on step results reads the raw JSON before its types are checked."""
    base, prog = branchy
    p = copy.deepcopy(prog)
    parent = p
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    path = tmp_path / "case.tpk"
    path.write_bytes(write_entries(with_program_text(read_entries(base), json.dumps(p).encode())))
    with pytest.raises(BundleError):
        load(path)


@pytest.mark.parametrize(
    "scratch, declare, why",
    [
        ("proj.weight", {}, "an int32 buffer of its own"),  # a weight: kernels would write into it
        ("zz_c", {"zz_c": {"dtype": "int32", "shape": ["batch"]}}, "static shape"),
        ("zz_c", {}, "no spec"),
    ],
)
def test_scratch_a_runner_cannot_keep_is_refused_at_load(tmp_path, branchy, scratch, declare, why):
    """``Program.scratch`` naming a weight, a buffer of a size that varies per call, or no buffer:
    refused when the bundle opens, before the runner would allocate or zero anything."""
    base, prog = branchy
    p = copy.deepcopy(prog)
    p["scratch"] = [scratch]
    p["buffers"].update(declare)
    path = tmp_path / "case.tpk"
    path.write_bytes(resigned_program(base, p))
    with pytest.raises(BundleError, match=why):
        load(path)


def test_scratch_a_step_writes_is_refused_at_load(tmp_path, branchy):
    """A scratch buffer that an ATen step writes as its result (so a plan could reuse its memory,
    and the runner's zeroed counters would not be what a kernel finds): refused at open."""
    base, prog = branchy
    step = aten_step("aten.zeros.default", [[4]], ["zz_c"], dtype=3)
    p = with_steps(prog, [step], declare={"zz_c": {"dtype": "int32", "shape": ["4"]}})
    p["scratch"] = ["zz_c"]
    path = tmp_path / "case.tpk"
    path.write_bytes(resigned_program(base, p))
    with pytest.raises(BundleError, match="nothing writes it as an output"):
        load(path)
