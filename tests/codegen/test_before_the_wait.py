"""What a kernel does before its wait for the kernel before (programmatic dependent launch).

Every kernel touches memory only after ``griddepcontrol.wait`` but the weights, which its early
lines may load while the kernel before still runs. A GEMM site's kernels may also let the kernel
after them start before their own wait (``kernel_source.GDC_LAUNCH_FIRST``,
``AOTPACK_LAUNCH_FIRST``): not where the step after the site touches the program's state (the
decode attention loads its cache before its wait, so the kernel before it must wait first). A bias
that a kernel computes is no weight: the forms load it after the wait.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.codegen import kernel_source
from aot.codegen.decode_attention_render import LAUNCH_FIRST_ROWS
from aot.codegen.kernel_source import (
    GDC_LAUNCH_FIRST,
    GDC_PROLOGUE,
    LAUNCH_FIRST_ENV,
    kernel_module,
    launch_first_where,
)
from aot.errors import CodegenError
from aot.schema import StepKind
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)


def _indented(lines) -> str:
    return "\n".join("    " + ln for ln in lines)


def test_the_kernel_after_may_start_before_the_wait():
    args = (["A kernel."], {}, "k", {"x_ptr": "*fp16"}, ["tl.store(x_ptr, 1.0)"], ["w = 1"])
    plain = kernel_module(*args)
    first = kernel_module(*args, launch_first=True)
    # the early lines, then (launch, wait) in that order, then the body
    assert _indented(GDC_PROLOGUE) in plain and _indented(GDC_LAUNCH_FIRST) not in plain
    assert _indented(["w = 1", *GDC_LAUNCH_FIRST, "tl.store(x_ptr, 1.0)"]) in first
    launch, wait = first.index("gdc_launch_dependents()"), first.index("gdc_wait()")
    assert first.index("w = 1") < launch < wait < first.index("tl.store")
    assert plain.index("gdc_wait()") < plain.index("gdc_launch_dependents()")
    where = kernel_module(*args, launch_first="B == 1")
    assert _indented(launch_first_where("B == 1")) in where and where.count("gdc_launch_dependents()") == 2


def test_the_setting(monkeypatch):
    monkeypatch.delenv(LAUNCH_FIRST_ENV, raising=False)
    assert kernel_source.launch_first() is kernel_source.LAUNCH_FIRST
    monkeypatch.setenv(LAUNCH_FIRST_ENV, "on")
    assert kernel_source.launch_first() is True
    monkeypatch.setenv(LAUNCH_FIRST_ENV, "off")
    assert kernel_source.launch_first() is False
    monkeypatch.setenv(LAUNCH_FIRST_ENV, "yes")
    with pytest.raises(CodegenError, match="AOTPACK_LAUNCH_FIRST='yes': expected 'on' or 'off'"):
        kernel_source.launch_first()


def test_the_state_rule_on_a_program():
    """``aot.program.state_aliases``: the state, its views, a state write's result and a kernel's
    in-place output into it; ``state_next``: whether the first step after a given one that is not
    a view touches any of them (a view of the state counts: it reads it)."""
    from aot.program import state_aliases, state_next
    from aot.schema import Buf, NamedTensor, Program, Step, TensorSpec

    spec = TensorSpec("float16", ("4", "8"))

    def aten(target, args, out):
        return Step(kind="aten", target=target, args=args, kwargs={}, outputs=(out,))

    steps = (
        aten("aten.mm.default", (Buf("x"), Buf("w")), "y"),  # 0: then a view, then the state write
        aten("aten.view.default", (Buf("y"), [4, 8]), "yv"),  # 1
        aten("aten.index_put_.default", (Buf("cache"), [Buf("i")], Buf("yv")), "c1"),  # 2
        aten("aten.mm.default", (Buf("x"), Buf("w")), "z"),  # 3: then a plain op
        aten("aten.relu.default", (Buf("z"),), "r"),  # 4
        aten("aten.slice.Tensor", (Buf("c1"), 0, 0, 2), "cs"),  # 5: a view of the state's write
        Step(kind="kernel", target="k", args=(Buf("cs"), Buf("r")), kwargs={}, outputs=("o",)),  # 6
        aten("aten.mm.default", (Buf("o"), Buf("w")), "last"),  # 7: nothing after
    )
    program = Program(
        inputs=(
            NamedTensor("x", spec),
            NamedTensor("i", TensorSpec("int64", ("4",))),
            NamedTensor("cache", spec),
        ),
        weights=(NamedTensor("w", TensorSpec("float16", ("8", "8"))),),
        buffers={},
        steps=steps,
        outputs=("last",),
        symbols=(),
        state=("cache",),
    )
    state = state_aliases(program)
    assert state == {"cache", "c1", "cs"}
    assert state_next(program, 0, state)  # past the view, the write
    assert not state_next(program, 3, state)  # relu
    assert state_next(program, 4, state)  # past the state's view, the kernel reading it
    assert not state_next(program, 7, state)


def _next_launch(program, last: int):
    """The first step after ``last`` that is not a view, or None."""
    from aot.program import VIEW_OPS

    steps = program.steps[last + 1 :]
    return next((s for s in steps if not (s.kind == StepKind.ATEN and s.target in VIEW_OPS)), None)


@pytest.mark.slow  # a tiny Llama's decode program traced once, built twice
def test_gemvs_launch_first_but_before_the_decode_attention():
    """Tiny Llama (2 layers, float16) with ``AOTPACK_LAUNCH_FIRST=on``: every dot-free GEMM form
    (the one-row GEMVs) lets the kernel after start first, but q/k/v's, whose next step is the
    decode attention (it writes and reads the KV cache, loading it before its wait); the tensor-core
    forms wait first (so do the reduce kernels that run the next norm); the decode attention lets
    the o projection start first at one row (``B == 1``); no other kernel does. With the setting
    off every source is the same but for those lines."""
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.realmodels.conftest import unusable

    if (why := unusable("transformers")) is not None:
        pytest.skip(why)
    from tests.hf.test_causal_lm import factory

    traced = trace(
        causal_lm(factory("llama"), max_batch=2, max_context=16, dtype="float16", batch_buckets=(1, 2))
    )
    builds = {}
    for setting in ("on", "off"):  # one trace, built both ways
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(LAUNCH_FIRST_ENV, setting)
            builds[setting] = generate(traced, ARCHS)
    on, off = builds["on"], builds["off"]
    programs = [on.program, *on.program.variants]
    (program,) = [p for p in programs if p.inputs[0].spec.shape[1:] == ("1",)]  # the decode step
    kernels = {k.id: k for p in programs for k in p.kernels}
    launched = {"first": set(), "waits": set(), "dot": set()}
    for site in program.alternatives:
        nxt = _next_launch(program, site.library[-1])
        before_state = (
            nxt is not None
            and nxt.kind == StepKind.KERNEL
            and kernels[nxt.target].name.startswith("decode_attention")
        )
        for cand in site.candidates:
            for step in cand.steps:
                kernel = kernels[step.target]
                if kernel.config.get("kind") != "gemm":
                    continue  # the norm kernel before a form without the norm in its prologue
                dot = "tl.dot(" in kernel.source
                first = _indented(GDC_LAUNCH_FIRST) in kernel.source
                # a joined pair's kernels (``row_sum``: down's, then the next q/k/v's): the last is
                # the one before the site's next launch
                before = before_state and step is cand.steps[-1]
                assert first is not (before or dot), (site.id, cand.name, kernel.name)
                launched["dot" if dot else "waits" if before else "first"].add(
                    (site.id, cand.name, kernel.name)
                )
    # the one-row forms: q/k/v's of both layers wait first; o's, gate/up's and down's of both and
    # the head's launch first
    assert len(launched["waits"]) == 2 and len(launched["first"]) == 7 and launched["dot"], launched
    attention = [
        kernels[s.target]
        for s in program.steps
        if s.kind == StepKind.KERNEL and kernels[s.target].name.startswith("decode_attention")
    ]
    at_one_row = _indented(launch_first_where(LAUNCH_FIRST_ROWS))
    assert len(attention) == 2 and all(at_one_row in k.source for k in attention)
    others = [k for k in kernels.values() if k.config.get("kind") != "gemm" and k not in attention]
    assert others and not any(_indented(GDC_LAUNCH_FIRST) in k.source for k in others)
    plain = {
        k.source.replace(_indented(GDC_LAUNCH_FIRST), _indented(GDC_PROLOGUE)).replace(
            at_one_row, _indented(GDC_PROLOGUE)
        )
        for k in kernels.values()
    }
    assert plain == {k.source for p in [off.program, *off.program.variants] for k in p.kernels}


@pytest.mark.slow  # the interpreter at two row counts
def test_a_bias_a_kernel_computes_loads_after_the_wait(tmp_path):
    """``gemm_bias_computed.py``: the Linear's bias is ``bias * s``, which a kernel computes. Its
    forms (the GEMV at one row, the K-sliced form's reduce at 8) load it after the wait, where a
    weight's bias loads before (``test_gemm_pairs``); every candidate matches the library steps in
    Triton's interpreter at 1 and 8 rows within float16's tolerance."""
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    compiled = generate(trace(load_model_file(MODELS / "gemm_bias_computed.py")), ARCHS)
    site, second = compiled.program.alternatives
    kernels = {k.id: k for k in compiled.program.kernels}
    loads = {}
    for cand in site.candidates:
        for step in cand.steps:
            k = kernels[step.target]
            if "b0_ptr" in k.source:
                before, _, after = k.source.partition("    if GDC:")
                assert "tl.load(b0_ptr" not in before, k.name
                loads[k.name] = after.count("tl.load(b0_ptr")
    assert sorted(loads) == [
        "gemm_addmm_fews_splitk8_16x64x64_reduce",
        "gemm_addmm_vec_1x2x1024",
    ] and all(loads.values()), loads
    # the second site's bias, a weight, loads before the wait at one row
    (gemv,) = [kernels[s.target] for c in second.candidates for s in c.steps if c.name.startswith("vec_")]
    assert "tl.load(b0_ptr" in gemv.source.partition("    if GDC:")[0]
    path = tmp_path / "bias.tpk"
    pack(compiled, path)
    sizes = [{"batch": b} for b in (1, 8)]
    (result,) = interpret_in_subprocess(
        [(path, MODELS / "gemm_bias_computed.py", sizes, None, True)], timeout=HANG_GUARD_S
    )
    checked = {c.name for cs in result.values() for c in cs}
    assert {f"{s.id}/{c.name}" for s in (site, second) for c in s.candidates} <= checked, checked
    bad = [c for cs in result.values() for c in cs if not c.ok]
    assert not bad, bad[:3]
