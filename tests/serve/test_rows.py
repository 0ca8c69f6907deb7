"""Row independence: the build proves, per dynamic dim, that the program keeps rows apart and
confirms it on the eager model; the manifest records it, ``guards`` and ``inspect`` show it, and
the servers join requests only along such a dim. Models whose dim 0 mixes rows (sequence-first
attention, a set model normalizing over its items, a flip over the batch) are never joined: before
the check, two clients of the attention model got answers computed from each other's inputs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from aot.rows import row_mixing
from aot.schema import Buf, NamedTensor, Program, Step, StepKind, Sym, TensorSpec
from tests.test_cli import aotpack

MIXING = {  # model → (dim 0's symbol, what the build says mixes its rows)
    "seq_first_attention": ("seq", "step 21 (scaled_dot_product_attention.default) attends across seq"),
    "set_norm": ("items", "step 0 (mean.dim) reduces, scans or sorts across items"),
    "flipped": ("batch", "step 3 (flip.default) flips across batch"),
}


# --- the analysis on small hand-written programs (no tracing) ------------------------------------


def _program(steps: list[tuple], shapes: dict[str, tuple[str, ...]], out: str, x=("batch", "seq", "8")):
    """x: [batch, seq, 8] → steps (target, args, output) → ``out``."""
    return Program(
        inputs=(NamedTensor("x", TensorSpec("float32", x)),),
        weights=(NamedTensor("w", TensorSpec("float32", ("8", "8"))),),
        buffers={n: TensorSpec("float32", s) for n, s in shapes.items()},
        steps=tuple(Step(StepKind.ATEN, t, tuple(a), {}, (o,)) for t, a, o in steps),
        outputs=(out,),
        symbols=(),
    )


SIZES = {"seq": 5}


def test_a_linear_over_flattened_rows_keeps_them_apart():
    p = _program(
        [
            ("aten.view.default", [Buf("x"), [Sym("batch*seq"), 8]], "flat"),
            ("aten.mm.default", [Buf("flat"), Buf("w")], "mm"),
            ("aten.view.default", [Buf("mm"), [Sym("batch"), Sym("seq"), 8]], "back"),
            ("aten._softmax.default", [Buf("back"), 1, False], "out"),
        ],
        {"flat": ("batch*seq", "8"), "mm": ("batch*seq", "8"), "back": ("batch", "seq", "8")}
        | {"out": ("batch", "seq", "8")},
        "out",
    )
    assert row_mixing(p, "batch", SIZES) is None
    # the same softmax mixes the rows of seq, and the view merges seq with an outer dim
    assert row_mixing(p, "seq", {"batch": 3}) == (
        "step 0 (view.default) reshapes across seq ([batch, seq, 8] to [batch*seq, 8])"
    )


@pytest.mark.parametrize(
    "step, shape, reason",
    [
        (
            ("aten.sum.dim_IntList", [Buf("x"), [0], True]),
            ("1", "seq", "8"),
            "reduces, scans or sorts across batch",
        ),
        (
            ("aten.cumsum.default", [Buf("x"), 0]),
            ("batch", "seq", "8"),
            "reduces, scans or sorts across batch",
        ),
        (("aten.sort.default", [Buf("x"), 0]), ("batch", "seq", "8"), "reduces, scans or sorts across batch"),
        (("aten.flip.default", [Buf("x"), [0]]), ("batch", "seq", "8"), "flips across batch"),
        (("aten.slice.Tensor", [Buf("x"), 0, 1, 3]), ("2", "seq", "8"), "slices across batch"),
        (("aten.mm.default", [Buf("w"), Buf("x")]), ("8", "8"), "contracts or mixes rows along batch"),
        (("aten.nonzero.default", [Buf("x")]), ("n", "3"), "is not known to keep rows along batch apart"),
        (
            ("aten.arange.default", [Sym("batch")]),
            ("batch",),
            "numbers positions along batch: a row's value depends on where it sits",
        ),
    ],
)
def test_steps_that_mix_rows_are_named(step, shape, reason):
    p = _program([(*step, "out")], {"out": shape}, "out")
    assert row_mixing(p, "batch", SIZES) == f"step 0 ({step[0].removeprefix('aten.')}) {reason}"


# --- traced models: what the build records and shows --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MIXING))
def test_models_that_mix_dim_0_are_recorded_shown_and_never_joined(bundles, name):
    from aot.loader import open_bundle
    from aot.serve.config import open_spec, serving_spec

    symbol, reason = MIXING[name]
    opened = open_bundle(bundles(name))
    manifest, program = opened.manifest, opened.program()
    opened.close()
    g = {s.name: s for s in manifest.guards.symbols}[symbol]
    assert (g.rows_independent, g.rows_check) == (False, reason)
    note = f"rows along {symbol}: not independent, a server never joins requests along it: {reason}"
    r = aotpack("guards", str(bundles(name)))
    assert r.returncode == 0 and f"\n# {note}\n" in r.stdout
    r = aotpack("inspect", str(bundles(name)))
    assert r.returncode == 0 and f"\n{note}\n" in r.stdout
    spec = open_spec(bundles(name))
    assert (spec.batch_symbol, spec.max_batch_size) == ("", 0)
    assert spec.batching == f"no dynamic batching along {symbol}: {note}"
    # a bundle that claims otherwise is checked against its own program
    claimed = replace(
        manifest,
        guards=replace(
            manifest.guards, symbols=tuple(replace(s, rows_independent=True) for s in manifest.guards.symbols)
        ),
    )
    spec = serving_spec(claimed, program)
    assert (spec.batch_symbol, spec.max_batch_size) == ("", 0)
    assert spec.batching == (
        f"no dynamic batching along {symbol}: the bundle records its rows as independent, but its "
        f"program does not keep them apart: {reason}"
    )


@pytest.mark.slow
def test_the_example_mlp_is_joined(bundles):
    from aot.serve.config import open_spec

    spec = open_spec(bundles("small_mlp"))
    assert (spec.batch_symbol, spec.max_batch_size) == ("batch", 64)
    assert spec.batching == "dynamic batching along batch: the build proved its rows independent"
    r = aotpack("inspect", str(bundles("small_mlp")), "--json")
    assert json.loads(r.stdout)["rows"] == {
        "batch": {
            "independent": True,
            "check": "no step mixes rows; changing row 1 of 3 left the other rows of every output bitwise equal",
        }
    }
    # a finding of the build, not part of the contract: a model file's manifest still matches
    r = aotpack("check", "tests/data/small_mlp.py", "--against", str(bundles("small_mlp")), "--arch", "sm_80")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_two_clients_of_sequence_first_attention_get_their_own_answers(bundles):
    """What a server's batcher does with two clients' requests of [seq 3, batch 2, 16]: joined
    along dim 0 (as before the check) client A's answer depends on client B's tokens."""
    import aot.loader
    from aot.pytree import leaves
    from aot.serve.batching import run_requests
    from aot.serve.config import open_spec

    bundle = bundles("seq_first_attention")
    runner = aot.loader.load(bundle)
    spec = open_spec(bundle)
    a, b = (torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2))

    def call(values):
        return leaves(runner(*values))

    replies = run_requests(call, [[a], [b]], spec.max_batch_size)
    for x, reply in zip((a, b), replies):
        assert reply.ok
        torch.testing.assert_close(reply.outputs[0], runner(x), atol=0, rtol=0)
    joined = run_requests(call, [[a], [b]], 16)  # what joining along seq gives: another answer
    assert not torch.allclose(joined[0].outputs[0], runner(a), atol=1e-3)


@pytest.mark.slow
def test_the_numerical_check_catches_what_the_analysis_missed(monkeypatch):
    """Were the program analysis wrong, the eager run would refuse: changing one item of the set
    model changes every other item's output."""
    import aot.tracer.independence as independence
    from aot.tracer import load_model_file, trace
    from tests.serve.conftest import MODELS

    monkeypatch.setattr(independence, "row_mixing", lambda *a: None)
    traced = trace(load_model_file(MODELS / "set_norm.py"))
    (g,) = traced.guards.symbols
    assert not g.rows_independent
    assert g.rows_check == (
        "the program's steps keep rows apart, but changing row 1 of 3 changed other rows of output 0 "
        "on the eager model"
    )
