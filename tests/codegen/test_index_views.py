"""Library views read as plain views (``aot.codegen.index_views``): a padding mask built as
transformers 5 builds it (``mask[arange(B)[:, None, None, None], arange(S)[None, None, None, :]]``)
becomes views of the mask, and the steps after it one kernel, so that the attention under it
builds library-free; ``as_strided`` at a fresh tensor's row-major strides an alias (timm's
ConvNeXt head). The zoo's BERT and Llama with a mask input build library-free, their CPU path
equal to eager and their kernels to their references in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from aot.schema import Buf, NamedTensor, Program, Step, StepKind, Sym, TensorSpec

MODEL = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.o = nn.Linear(32, 32)

    def forward(self, x, attention_mask, table):  # x [B, S, 32], attention_mask [B, S] (1: a token), table [S, B]
        b, s, _ = x.shape
        mask = attention_mask.to(torch.bool)
        batch_arange = torch.arange(0, b, device=x.device)
        kv_arange = torch.arange(0, s, device=x.device) + 0
        q_arange = torch.arange(0, s, device=x.device) + 0
        # transformers 5's masking_utils: padding through an index, and-ed with a size-only mask
        padding = mask[batch_arange[:, None, None, None], kv_arange[None, None, None, :]]
        allowed = torch.full((), True, device=x.device) & (q_arange[None, None, :, None] >= 0)
        allowed = (allowed & padding).expand(b, -1, s, s)
        q, k, v = (t.view(b, s, 2, 16).transpose(1, 2) for t in self.qkv(x).split(32, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        # the indices on axes in the other order: table transposed
        flipped = table[kv_arange[None, :], batch_arange[:, None]] * 2.0
        return self.o(y.transpose(1, 2).reshape(b, s, 32)), flipped

batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 24)
spec = ModelSpec(
    module=Encoder,
    inputs=[
        Input("x", (batch, seq, 32)),
        Input("attention_mask", (batch, seq), dtype="int64", low=1, high=2),
        Input("table", (seq, batch)),
    ],
)
"""

SIZES = [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 7}, {"batch": 4, "seq": 24}]


def _model(tmp_path):
    path = tmp_path / "encoder.py"
    path.write_text(MODEL)
    return path


def _inputs(sizes: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of different lengths: the mask's zeros pad all but the first (each keeps a token)."""
    b, s = sizes["batch"], sizes["seq"]
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, s, dtype=torch.int64)
    for row in range(1, b):
        mask[row, max(1, s - 2 * row) :] = 0
    return {
        "x": torch.randn(b, s, 32, generator=g),
        "attention_mask": mask,
        "table": torch.randn(s, b, generator=g),
    }


def test_an_index_by_whole_aranges_becomes_views_of_the_mask(tmp_path):
    """The index is the mask with two dims of one element inserted (no step gathers); the
    aranges only it read are gone, the one the size-only mask compares stays; the transposed
    table is a permute; the CPU path of the rewritten program equals eager."""
    from aot.codegen.index_views import indexes_as_views
    from aot.loader import load
    from aot.packager import pack
    from aot.stages import Compiled
    from aot.tracer import instantiate, load_model_file, trace

    spec = load_model_file(_model(tmp_path))
    traced = trace(spec)
    before = [s.target for s in traced.program.steps]
    assert before.count("aten.index.Tensor") == 2 and before.count("aten.arange.start_step") == 3
    program, n = indexes_as_views(traced.program)
    assert n == 2
    targets = [s.target for s in program.steps]
    assert "aten.index.Tensor" not in targets
    assert targets.count("aten.arange.start_step") == 1  # q_arange: the ``>= 0`` reads it
    made = {s.outputs[0]: s for s in program.steps}
    cast = next(s.outputs[0] for s in program.steps if s.target == "aten._to_copy.default")
    padding = next(
        s for s in program.steps if s.target == "aten.unsqueeze.default" and s.args[0].name == cast
    )
    view = made[next(s.outputs[0] for s in program.steps if s.args and s.args[0] == Buf(padding.outputs[0]))]
    assert (padding.args[1], view.target, view.args[1]) == (1, "aten.unsqueeze.default", 2)
    assert program.buffers[view.outputs[0]].shape == ("batch", "1", "1", "seq")
    flip = next(s for s in program.steps if s.target == "aten.permute.default" and s.args[0] == Buf("table"))
    assert flip.args[1] == [1, 0]

    from dataclasses import replace

    rewritten = replace(traced, program=program)
    pack(Compiled(traced=rewritten, program=program, archs=("sm_90",)), tmp_path / "views.tpk")
    runner, module = load(tmp_path / "views.tpk"), instantiate(spec)
    for sizes in SIZES:
        inputs = _inputs(sizes)
        got, want = runner(**inputs), module(**inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _index_program(first: tuple, second: tuple, end: str = "a") -> Program:
    """``x [a, b]`` indexed by ``arange(0, end)`` viewed to ``first`` and ``arange(0, b)`` to
    ``second``."""
    i64 = lambda *shape: TensorSpec("int64", shape)  # noqa: E731
    steps = (
        Step(StepKind.ATEN, "aten.arange.start_step", (0, Sym(end)), {}, ("ra",)),
        Step(
            StepKind.ATEN,
            "aten.view.default",
            (Buf("ra"), [Sym(d) if d != "1" else 1 for d in first]),
            {},
            ("ia",),
        ),
        Step(StepKind.ATEN, "aten.arange.start_step", (0, Sym("b")), {}, ("rb",)),
        Step(
            StepKind.ATEN,
            "aten.view.default",
            (Buf("rb"), [Sym(d) if d != "1" else 1 for d in second]),
            {},
            ("ib",),
        ),
        Step(StepKind.ATEN, "aten.index.Tensor", (Buf("x"), [Buf("ia"), Buf("ib")]), {}, ("out",)),
    )
    out = tuple(first[i] if first[i] != "1" else second[i] for i in range(len(first)))
    return Program(
        inputs=(),
        weights=(),
        steps=steps,
        outputs=("out",),
        symbols=(),
        buffers={
            "x": TensorSpec("float32", ("a", "b")),
            "ra": i64(end),
            "ia": i64(*first),
            "rb": i64("b"),
            "ib": i64(*second),
            "out": TensorSpec("float32", out),
        },
    )


def test_only_whole_aranges_on_axes_of_their_own_become_views():
    from aot.codegen.index_views import indexes_as_views

    program, n = indexes_as_views(_index_program(("a", "1"), ("1", "b")))
    assert n == 1 and [s.target for s in program.steps] == ["aten.alias.default"]  # x itself
    program, n = indexes_as_views(_index_program(("1", "a"), ("b", "1")))
    assert n == 1 and [(s.target, s.args[1:]) for s in program.steps] == [("aten.permute.default", ([1, 0],))]
    # arange(0, a - 1) is not the whole dim; arange(0, b) on the axis of a's index: a diagonal
    for kept in (_index_program(("a - 1", "1"), ("1", "b"), end="a - 1"), _index_program(("a",), ("b",))):
        program, n = indexes_as_views(kept)
        assert n == 0 and program is kept


def test_as_strided_at_row_major_strides_of_a_fresh_tensor_is_an_alias():
    """ConvNeXt's head: ``as_strided(mean, [B, C, 1, 1], [C, 1, C, C])``; other strides, another
    shape, or a view's result stay."""
    from aot.codegen.index_views import strides_as_views

    f32 = lambda *shape: TensorSpec("float32", shape)  # noqa: E731

    def strided(src: str, out: str, size: list, stride: list) -> Step:
        return Step(StepKind.ATEN, "aten.as_strided.default", (Buf(src), size, stride), {}, (out,))

    steps = (
        Step(StepKind.ATEN, "aten.mean.dim", (Buf("x"), [-1, -2], True), {}, ("mean",)),
        strided("mean", "same", [Sym("b"), 8, 1, 1], [8, 1, 8, 8]),
        strided("mean", "other", [Sym("b"), 8, 1, 1], [1, Sym("b"), 8, 8]),
        strided("mean", "flat", [Sym("b"), 8], [8, 1]),
        Step(StepKind.ATEN, "aten.permute.default", (Buf("mean"), [1, 0, 2, 3]), {}, ("swapped",)),
        strided("swapped", "of_view", [8, Sym("b"), 1, 1], [Sym("b"), 1, 1, 1]),
    )
    program = Program(
        inputs=(),
        weights=(),
        steps=steps,
        outputs=("same",),
        symbols=(),
        buffers={
            "x": f32("b", "8", "3", "3"),
            "mean": f32("b", "8", "1", "1"),
            "same": f32("b", "8", "1", "1"),
            "other": f32("b", "8", "1", "1"),
            "flat": f32("b", "8"),
            "swapped": f32("8", "b", "1", "1"),
            "of_view": f32("8", "b", "1", "1"),
        },
    )
    out, n = strides_as_views(program)
    assert n == 1
    assert [s.target for s in out.steps][1:] == [
        "aten.alias.default",
        *["aten.as_strided.default"] * 2,
        "aten.permute.default",
        "aten.as_strided.default",
    ]


@pytest.mark.slow  # a library-free build and an interpreter run
def test_attention_under_a_mask_built_through_an_index_builds_library_free(tmp_path):
    """No library step left: the mask is made by a kernel that reads the caller's mask in place;
    every kernel equals its reference steps in Triton's interpreter (float32, the verifier's
    tolerance) and the CPU path equals eager, with padded rows."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import live_steps
    from aot.tracer import instantiate, load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = _model(tmp_path)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    steps = live_steps(compiled.program)
    assert not [
        s for s in steps if s.kind == StepKind.ATEN and s.target.startswith(("aten.index", "aten.arange"))
    ]
    refs = [r.target for s in steps if s.kind == StepKind.KERNEL for r in s.reference]
    assert "aten._to_copy.default" in refs and "aten.index.Tensor" not in refs
    pack(compiled, tmp_path / "encoder.tpk")
    (results,) = interpret_in_subprocess([(tmp_path / "encoder.tpk", path, SIZES[1:2], None)])
    checks = results['{"batch": 3, "seq": 7}']
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    runner, module = load(tmp_path / "encoder.tpk"), instantiate(spec)
    for sizes in SIZES:
        inputs = _inputs(sizes, seed=1)
        for a, b in zip(runner(**inputs), module(**inputs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # library-free builds of zoo models and interpreter runs
@pytest.mark.parametrize("name", ["bert", "minilm", "llama-attention_mask", "t5-encoder"])
def test_zoo_models_with_a_mask_input_build_library_free(name, tmp_path):
    """The zoo's BERT and MiniLM (a padded mask in their example inputs; MiniLM looks up its
    buffered token types through a gather), Llama with a mask input and T5's encoder (its
    attention under a position bias per head with the padding added in, ``scale=1.0``: the
    strided attention kernel, ``aot.codegen.cache_attention``), built ``--library-free``: the CPU
    path equals eager at the zoo's sizes, the kernels their references in the interpreter at
    batch 1 x seq 1 and 3 x 13."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import example_inputs, instantiate, trace
    from aot.verify.interpret import interpret_in_subprocess
    from tests.conftest import ROOT
    from tests.realmodels.conftest import require
    from tests.realmodels.test_realmodels import difference, eager
    from tests.realmodels.zoo import ZOO

    require("transformers")
    spec = ZOO[name]()
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    bundle = tmp_path / "model.tpk"
    pack(compiled, bundle)
    runner, module = load(bundle), instantiate(spec)
    for sizes in ZOO[name].sizes:
        inputs = example_inputs(spec, sizes, seed=7)
        if (
            name in ("llama-attention_mask", "t5-encoder") and sizes["batch"] > 1
        ):  # pad the rows after the first
            inputs["attention_mask"][1:, max(1, sizes["seq"] // 2) :] = 0
        assert difference(runner(**inputs), eager(spec, module, inputs)) is None, sizes
    model = tmp_path / "zoo_model.py"
    model.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.realmodels.zoo import ZOO\nspec = ZOO[{name!r}]()\n"
    )
    (results,) = interpret_in_subprocess(
        [(bundle, model, [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}], 1)]
    )
    for size, checks in results.items():
        assert checks and all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


RELATIVE = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class Relative(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # x [B, S, 8]
        s = x.shape[1]
        ctx = torch.arange(s, device=x.device)[:, None]
        mem = torch.arange(s, device=x.device)[None, :]
        rel = (mem - ctx).abs().clamp(max=15)  # [S, S]: T5's relative positions, from sizes alone
        h = x + self.bias(rel).transpose(1, 2).mean(-1)[None]  # [S, 8]: the mean over the keys
        return self.head(h[:, 0])  # the first token's row (BERT's pooler): a strided GEMM input

spec = ModelSpec(module=Relative, inputs=[Input("x", (Dim("batch", 1, 4), Dim("seq", 1, 24), 8))])
"""


def test_a_gemm_input_read_through_a_strided_view_is_copied_first():
    from aot.codegen.library_free import copy_strided_operands

    f32 = lambda *shape: TensorSpec("float32", shape)  # noqa: E731
    steps = (
        Step(StepKind.ATEN, "aten.select.int", (Buf("h"), 1, 0), {}, ("first",)),
        Step(StepKind.ATEN, "aten.permute.default", (Buf("w"), [1, 0]), {}, ("wt",)),
        Step(StepKind.ATEN, "aten.addmm.default", (Buf("b"), Buf("first"), Buf("wt")), {}, ("y",)),
        Step(StepKind.ATEN, "aten.view.default", (Buf("h"), [Sym("n*s"), 8]), {}, ("rows",)),
        Step(StepKind.ATEN, "aten.mm.default", (Buf("rows"), Buf("wt")), {}, ("z",)),
    )
    program = Program(
        inputs=(),
        weights=(),
        steps=steps,
        outputs=("y", "z"),
        symbols=(),
        buffers={
            "h": f32("n", "s", "8"),
            "first": f32("n", "8"),
            "wt": f32("8", "4"),
            "y": f32("n", "4"),
            "rows": f32("n*s", "8"),
            "z": f32("n*s", "4"),
        },
    )
    out, n = copy_strided_operands(program)
    assert n == 1
    assert [(s.target, [a.name for a in s.args if isinstance(a, Buf)]) for s in out.steps] == [
        ("aten.select.int", ["h"]),
        ("aten.permute.default", ["w"]),
        ("aten.clone.default", ["first"]),
        ("aten.addmm.default", ["b", "first_rows", "wt"]),
        ("aten.view.default", ["h"]),
        ("aten.mm.default", ["rows", "wt"]),  # a view at its base's address: read in place
    ]
    assert out.buffers["first_rows"] == f32("n", "8")


@pytest.mark.slow  # a library-free build and an interpreter run
def test_index_only_values_a_lookup_reads_and_a_strided_gemm_input_build_library_free(tmp_path):
    """T5's relative positions (``arange`` arithmetic, which kernels otherwise recompute where
    they read it) computed by a kernel for the lookup that reads them; the first token's row
    copied by a kernel for the GEMM: no library step left, the kernels equal to their
    references in the interpreter, the CPU path equal to eager."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import live_steps
    from aot.tracer import instantiate, load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "relative.py"
    path.write_text(RELATIVE)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    steps = live_steps(compiled.program)
    assert all(
        s.kind == StepKind.KERNEL or s.target in ("aten.view.default", "aten.unsqueeze.default")
        for s in steps
    ), [s.target for s in steps if s.kind != StepKind.KERNEL]
    pack(compiled, tmp_path / "relative.tpk")
    (results,) = interpret_in_subprocess([(tmp_path / "relative.tpk", path, [{"batch": 3, "seq": 19}], None)])
    checks = results['{"batch": 3, "seq": 19}']
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    runner, module = load(tmp_path / "relative.tpk"), instantiate(spec)
    g = torch.Generator().manual_seed(3)
    for b, s in ((1, 1), (3, 19), (4, 24)):
        x = torch.randn(b, s, 8, generator=g)
        torch.testing.assert_close(runner(x=x), module(x), rtol=1e-5, atol=1e-5)


def test_a_gather_by_a_weights_leading_positions_is_a_slice():
    """``gather(types.expand(1, -1), 1, positions[:, :seq])`` with ``positions`` holding 0..P-1 is
    ``types[:, :seq]``; positions that are not 0..P-1, or a gather along another dim, stay."""
    from aot.codegen.index_views import gathers_as_slices

    i64 = lambda *shape: TensorSpec("int64", shape)  # noqa: E731

    def program(positions: str = "positions", dim: int = 1) -> Program:
        steps = (
            Step(StepKind.ATEN, "aten.slice.Tensor", (Buf(positions), 1, 0, Sym("seq")), {}, ("first",)),
            Step(StepKind.ATEN, "aten.expand.default", (Buf("types"), [1, -1]), {}, ("wide",)),
            Step(StepKind.ATEN, "aten.gather.default", (Buf("wide"), dim, Buf("first")), {}, ("picked",)),
        )
        return Program(
            inputs=(),
            weights=tuple(NamedTensor(w, i64("1", "64")) for w in ("positions", "shuffled", "types")),
            steps=steps,
            outputs=("picked",),
            symbols=(),
            buffers={"first": i64("1", "seq"), "wide": i64("1", "64"), "picked": i64("1", "seq")},
        )

    weights = {
        "positions": torch.arange(64)[None],
        "shuffled": torch.arange(64).flip(0)[None],
        "types": torch.zeros(1, 64, dtype=torch.int64),
    }
    out, n = gathers_as_slices(program(), weights)
    assert n == 1
    assert [(s.target, s.args) for s in out.steps][2] == (
        "aten.slice.Tensor",
        (Buf("wide"), 1, 0, Sym("seq")),
    )
    for kept in (program("shuffled"), program(dim=0)):
        assert gathers_as_slices(kept, weights) == (kept, 0)
