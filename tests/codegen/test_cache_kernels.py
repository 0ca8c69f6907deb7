"""Library-free LMs (``aot.codegen.cache_writes``, ``aot.codegen.cache_attention``).

``strided_view`` resolves a chain of views to a base buffer, an offset and strides: checked
against torch, by reading the base with ``as_strided`` and comparing with the views applied
eagerly, at several sizes. tests/data/tiny_lm.py built ``--library-free`` (slow: GEMM candidates
compiled): every KV-cache write and every attention over the cache is a kernel step, no library
call is left (the runtime without torch accepts the bundle), every kernel matches its reference
in Triton's interpreter (the cache writes exactly; float32 kernels within the verifier's
tolerance), and on the CPU the bundle generates the tokens its default build generates.
"""

from __future__ import annotations

import pytest
import torch

from aot.codegen import index as ix
from aot.codegen.cache_writes import strided_view
from aot.schema import Buf, NamedTensor, Program, Step, StepKind, Sym, SymbolSource, TensorSpec
from tests.conftest import ROOT


def _chain_program():
    """x [B*T, 64] -> columns 32..63 -> [B, T, 2, 2, 8] -> permute -> select -> squeeze, as a
    K/V projection's rows become a cache write's values."""
    steps = [
        Step(StepKind.ATEN, "aten.slice.Tensor", (Buf("x"), 1, 32, 64), {}, ("cols",)),
        Step(
            StepKind.ATEN,
            "aten.view.default",
            (Buf("cols"), [Sym("batch"), Sym("seq"), 2, 2, 8]),
            {},
            ("v5",),
        ),
        Step(StepKind.ATEN, "aten.permute.default", (Buf("v5"), [2, 0, 3, 1, 4]), {}, ("p",)),
        Step(StepKind.ATEN, "aten.select.int", (Buf("p"), 0, 1), {}, ("k",)),
        Step(StepKind.ATEN, "aten.unsqueeze.default", (Buf("k"), 0), {}, ("u",)),
        Step(StepKind.ATEN, "aten.squeeze.dims", (Buf("u"), [0]), {}, ("s",)),
        Step(StepKind.ATEN, "aten.transpose.int", (Buf("s"), 2, 3), {}, ("t",)),
    ]
    buffers = {
        "cols": TensorSpec("float32", ("batch*seq", "32")),
        "v5": TensorSpec("float32", ("batch", "seq", "2", "2", "8")),
        "p": TensorSpec("float32", ("2", "batch", "2", "seq", "8")),
        "k": TensorSpec("float32", ("batch", "2", "seq", "8")),
        "u": TensorSpec("float32", ("1", "batch", "2", "seq", "8")),
        "s": TensorSpec("float32", ("batch", "2", "seq", "8")),
        "t": TensorSpec("float32", ("batch", "2", "8", "seq")),
    }
    return Program(
        inputs=(NamedTensor("x", TensorSpec("float32", ("batch*seq", "64"))),),
        weights=(),
        buffers=buffers,
        steps=tuple(steps),
        outputs=("t",),
        symbols=(SymbolSource("batch", "x", 0),),
    )


@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 5), (3, 4)])
def test_strided_view_reads_what_the_views_read(batch, seq):
    program = _chain_program()
    x = torch.arange(batch * seq * 64, dtype=torch.float32).view(batch * seq, 64)
    want = (
        x[:, 32:64]
        .view(batch, seq, 2, 2, 8)
        .permute(2, 0, 3, 1, 4)[1]
        .unsqueeze(0)
        .squeeze(0)
        .transpose(2, 3)
    )
    sizes = {ix.symbol("batch"): batch, ix.symbol("seq"): seq}
    for name, eager in (("cols", x[:, 32:64]), ("t", want)):
        view = strided_view(name, program)
        assert view is not None and view.base == "x"
        shape = [int(s.subs(sizes)) for s in view.shape]
        strides = [int(s.subs(sizes)) for s in view.strides]
        got = torch.as_strided(x, shape, strides, int(view.offset.subs(sizes)))
        assert torch.equal(got, eager), name


def test_strided_view_follows_splits():
    """GPT-2's fused QKV: ``split`` of the projection's rows, then a head view."""
    steps = (
        Step(StepKind.ATEN, "aten.view.default", (Buf("x"), [Sym("batch"), 3, 48]), {}, ("v",)),
        Step(StepKind.ATEN, "aten.split.Tensor", (Buf("v"), 16, 2), {}, ("q", "k", "w")),
        Step(StepKind.ATEN, "aten.view.default", (Buf("k"), [Sym("batch"), 3, 2, 8]), {}, ("heads",)),
        Step(StepKind.ATEN, "aten.transpose.int", (Buf("heads"), 1, 2), {}, ("kt",)),
        Step(StepKind.ATEN, "aten.split_with_sizes.default", (Buf("v"), [8, 40], 2), {}, ("a", "b")),
    )
    specs = {
        "v": ("batch", "3", "48"),
        "q": ("batch", "3", "16"),
        "k": ("batch", "3", "16"),
        "w": ("batch", "3", "16"),
        "heads": ("batch", "3", "2", "8"),
        "kt": ("batch", "2", "3", "8"),
        "a": ("batch", "3", "8"),
        "b": ("batch", "3", "40"),
    }
    program = Program(
        inputs=(NamedTensor("x", TensorSpec("float32", ("3*batch", "48"))),),
        weights=(),
        buffers={k: TensorSpec("float32", v) for k, v in specs.items()},
        steps=steps,
        outputs=("kt", "b"),
        symbols=(SymbolSource("batch", "x", 0),),
    )
    x = torch.arange(2 * 3 * 48, dtype=torch.float32).view(6, 48)
    v = x.view(2, 3, 48)
    for name, eager in (
        ("kt", v.split(16, 2)[1].view(2, 3, 2, 8).transpose(1, 2)),
        ("b", v.split([8, 40], 2)[1]),
    ):
        view = strided_view(name, program)
        sizes = {ix.symbol("batch"): 2}
        got = torch.as_strided(
            x,
            [int(s.subs(sizes)) for s in view.shape],
            [int(s.subs(sizes)) for s in view.strides],
            int(view.offset),
        )
        assert torch.equal(got, eager), name


def test_a_view_that_copies_is_not_followed():
    """``view`` of a transposed tensor across the transposed dims has no strides: None."""
    program = _chain_program()
    steps = (
        *program.steps,
        Step(StepKind.ATEN, "aten.view.default", (Buf("t"), [Sym("batch"), 16, Sym("seq")]), {}, ("merged",)),
        Step(StepKind.ATEN, "aten.view.default", (Buf("t"), [Sym("batch"), 2, Sym("8*seq")]), {}, ("bad",)),
    )
    buffers = {
        **program.buffers,
        "merged": TensorSpec("float32", ("batch", "16", "seq")),
        "bad": TensorSpec("float32", ("batch", "2", "8*seq")),
    }
    program = Program(**{**program.__dict__, "steps": steps, "buffers": buffers})
    assert strided_view("merged", program) is not None  # heads and head dim merge: still a view
    assert strided_view("bad", program) is None  # head dim and tokens do not


def test_a_slice_from_the_end_is_not_followed():
    """``x[:, -3:]`` starts 3 before the end, clamped at the front where the dim is shorter (ATen):
    no one offset says both, so it is no strided view (its offset was read as -3 from the front)."""
    program = _chain_program()
    steps = (
        *program.steps,
        Step(StepKind.ATEN, "aten.slice.Tensor", (Buf("cols"), 1, -3, 2**63 - 1), {}, ("tail",)),
    )
    buffers = {**program.buffers, "tail": TensorSpec("float32", ("batch*seq", "3"))}
    program = Program(**{**program.__dict__, "steps": steps, "buffers": buffers})
    assert strided_view("cols", program) is not None and strided_view("tail", program) is None


@pytest.fixture(scope="module")
def tiny_lm_free(tmp_path_factory, built):
    """tests/data/tiny_lm.py built library-free, and its default build (the lm tests' build): both
    from the session's trace of it."""
    from aot.codegen import generate
    from aot.packager import pack

    free = tmp_path_factory.mktemp("lm_free") / "free.tpk"
    pack(generate(built.traced("tiny_lm"), ("sm_90",), gemm_candidates=True, library_free=True), free)
    return free, built("tiny_lm", ("sm_90",))


@pytest.mark.slow  # two builds of tiny_lm, one with GEMM candidates compiled
def test_tiny_lm_builds_library_free(tiny_lm_free):
    from aot.bundle import open_bundle
    from aot.program import live_steps
    from aot.runtime import check

    free, _ = tiny_lm_free
    b = open_bundle(free)
    program = b.program()
    prefill, decode = program, program.variants[0]
    writes_ops = {"aten.index_put_.default", "aten.index_copy_.default"}
    for p, attention in ((prefill, "cache_attention"), (decode, "decode_attention")):
        kinds = {k.id: k.config["kind"] for k in p.kernels}
        live = [s for s in live_steps(p) if s.kind == StepKind.KERNEL]
        assert [kinds[s.target] for s in live].count(attention) == 2, [kinds[s.target] for s in live]
        # every cache write runs in a kernel: a cache write kernel, or one that folds it in
        written = [r for s in live for r in s.reference if r.target in writes_ops]
        assert len(written) == 4 and {r.args[0].name for r in written} <= set(p.state), written
        aten = {s.target for s in live_steps(p) if s.kind == StepKind.ATEN}
        assert not aten & {*writes_ops, "aten.scaled_dot_product_attention.default"}, aten
        writes = [s for s in live if kinds[s.target] == "cache_write"]
        # the state, in place, declared: the write's result names the state it was written into
        assert all(s.args[2].name in p.state and s.in_place == {s.outputs[0]: s.args[2].name} for s in writes)
        if p is prefill:  # the prefill's writes are cache write kernels
            assert len(writes) == 4
    assert [e.entry for e in check(free).entries] == ["prefill", "decode"]


@pytest.mark.slow
def test_tiny_lm_kernels_match_their_references_in_the_interpreter(tiny_lm_free):
    from aot.verify.interpret import interpret_in_subprocess

    free, _ = tiny_lm_free
    (results,) = interpret_in_subprocess(
        [(free, ROOT / "tests/data/tiny_lm.py", [{"batch": 2, "seq": 5}], None)]
    )
    for size, checks in results.items():
        names = [c.name for c in checks]
        assert names.count("cache_write") == 4 and names.count("cache_attention_g2_d8") == 2, names
        assert all(c.max_abs_error == 0.0 for c in checks if c.name == "cache_write")
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


@pytest.mark.slow
def test_tiny_lm_library_free_generates_as_its_default_build_on_the_cpu(tiny_lm_free):
    from aot.loader import load

    free, default = tiny_lm_free
    prompts = [[3, 14, 15, 9, 2], [6, 5]]
    assert load(free).generate(prompts, 6) == load(default).generate(prompts, 6)
