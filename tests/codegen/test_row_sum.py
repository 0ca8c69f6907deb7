"""Two one-row GEMVs joined across a residual add (``codegen/row_sum.py``): the first GEMV's
epilogue adds the residual to its products and stores the sum rounded as the norm kernel rounds
it; the next GEMV's norm prologue reads that one row and writes nothing.

``gemm_rms16.py`` (float16): the down projection hands its products to the next RMSNorm's
prologue (the residual add before it, the sum a model output); ``gemm_reduce_ln.py`` (float16,
GPT-2's mlp out with its bias, then ``ln_1`` of the sum and q/k/v) to a LayerNorm's. (The
bfloat16 twin ``gemm_rms.py`` is not interpreted: the interpreter's bfloat16 tensor-core products
of its 8-row forms fail their comparison with or without this join; on the GPU ``aotpack verify``
checks them.) At one row, joined: the first GEMV is a ``_sum`` kernel and the next one's prologue
loads one row input (no second row's pointer, no ``sum_ptr``); apart (``AOTPACK_ROW_SUM=off``), as
before. Every kernel of the joined one-row plan matches the library steps it replaces in Triton's
interpreter (``aot.dtypes.TOLERANCE``), and the sum is exact (the reference's add, rounded once).
A ``_sum`` kernel that drops the residual fails the comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.codegen import row_sum
from tests.codegen.conftest import failing_candidates
from tests.codegen.test_factored_one_row import _one_row_plan
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
ONE_ROW = {"batch": 1}


def _build(model: str, setting: str):
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(row_sum.ENV, setting)
        return generate(trace(load_model_file(MODELS / f"{model}.py")), ARCHS)


def _source(compiled, kernel_id: str) -> str:
    return next(k.source for k in compiled.program.kernels if k.id == kernel_id)


# model: the second GEMV's kernel name's start, its second row input's pointer
CASES = {"gemm_rms16": ("gemm_norm_mm_", "x1_ptr"), "gemm_reduce_ln": ("gemm_ln_addmm_", "y_ptr")}


@pytest.mark.parametrize("tied", ["off", "on"])
@pytest.mark.parametrize("model", list(CASES))
def test_the_gemv_before_a_norm_prologue_writes_the_residual_sum(model, tied, tmp_path, monkeypatch):
    """(``tied``: ``AOTPACK_ROW_SUM_TIE``, the residual's loads tied to the first product: the
    same numbers, bit for bit.)"""
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    monkeypatch.setenv(row_sum.TIE_ENV, tied)
    prefix, other = CASES[model]
    apart, joined = _build(model, "off"), _build(model, "on")
    before, after = _one_row_plan(apart), _one_row_plan(joined)
    assert len(before) == len(after)
    assert not any(n.endswith("_sum") for n, _ in before)
    (summed,) = [k for n, k in after if n.endswith("_sum")]
    (second,) = [k for n, k in after if n.startswith(prefix)]
    assert "tl.store(sum_ptr" in _source(joined, summed)
    assert ("tie = tl.where(M < 0" in _source(joined, summed)) == (tied == "on")
    source = _source(joined, second)
    assert other not in source and "sum_ptr" not in source, source
    (old_second,) = [k for n, k in before if n.startswith(prefix)]
    assert other in _source(apart, old_second) and "sum_ptr" in _source(apart, old_second)

    pack(joined, tmp_path / "joined.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "joined.tpk", MODELS / f"{model}.py", [ONE_ROW], None, True)], timeout=HANG_GUARD_S
    )
    comparisons = result[next(iter(result))]
    assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    # the pair's candidate is checked at its last kernel, against both sites' steps: the
    # projection's product within the tolerance, the sum (written by the first kernel) exact
    (step,) = [
        st
        for site in joined.program.alternatives
        for c in site.candidates
        for st in c.steps
        if st.target == summed
    ]
    (sum_buf,) = step.outputs
    checked = {c.output: c for c in comparisons if c.kernel == second and not c.name.endswith("/rerun")}
    assert sum_buf in checked and len(checked) == 2, checked
    assert checked[sum_buf].max_abs_error == 0.0, checked[sum_buf]


@pytest.mark.slow  # another interpreter run
def test_a_sum_without_the_residual_is_caught(tmp_path):
    compiled = _build("gemm_rms16", "on")
    (kernel,) = [k for n, k in _one_row_plan(compiled) if n.endswith("_sum")]
    old = "(x0_n + x1_n)"
    assert old in _source(compiled, kernel)
    failed = failing_candidates(
        compiled, MODELS / "gemm_rms16.py", kernel, old, "(x1_n + x1_n)", ONE_ROW, tmp_path / "bad.tpk"
    )
    assert failed, "a sum without the residual passed"


def test_by_default_the_join_comes_before_row_norms_alone(monkeypatch):
    """ "rms", the default: ``gemm_rms16``'s down projection writes the sum its RMSNorm reads;
    ``gemm_reduce_ln``'s LayerNorm keeps the add in its prologue, as "off" does (GPT-2's decode
    measured 3.2% slower joined on an H100)."""
    monkeypatch.delenv(row_sum.ENV, raising=False)
    for model, joined in (("gemm_rms16", True), ("gemm_reduce_ln", False)):
        from aot.codegen import generate
        from aot.tracer import load_model_file, trace

        plan = _one_row_plan(generate(trace(load_model_file(MODELS / f"{model}.py")), ARCHS))
        assert any(n.endswith("_sum") for n, _ in plan) == joined, (model, plan)
        assert [n.removesuffix("_sum") for n, _ in plan] == [
            n for n, _ in _one_row_plan(_build(model, "off"))
        ]


def test_the_join_is_a_setting(monkeypatch):
    from aot.errors import CodegenError

    monkeypatch.setenv(row_sum.ENV, "yes")
    with pytest.raises(CodegenError, match="AOTPACK_ROW_SUM"):
        row_sum.mode()
    monkeypatch.setenv(row_sum.ENV, "OFF")
    assert row_sum.mode() == "off"
    monkeypatch.delenv(row_sum.ENV)
    # RMSNorms by default: Llama-3.2-1B 0.4% faster at batch 1, GPT-2's LayerNorms 3.2% slower (H100)
    assert row_sum.mode() == "rms"


def _waves_after_the_wait(compiled, kernel_id: str) -> int:
    """The waves of global loads after the dependent-launch wait in ``kernel_id``'s sm_90 cubin
    (``bench/sass_waves.py``: runs of loads that end at the first instruction reading one)."""
    from bench.sass_waves import sass, waves

    text = sass(compiled.cubins[(kernel_id, "sm_90")])
    assert "ACQBULK" in text, "no dependent-launch wait in the sm_90 cubin"
    return waves(text)[2]


@pytest.mark.parametrize("model", list(CASES))
def test_the_residual_loads_issue_beside_as_row(model, monkeypatch):
    """ptxas issues a load where its value is first read: untied, the residual that only the
    ``_sum`` kernel's epilogue reads is loaded after the products, a second wave of loads after
    the wait; tied to the first product (``row_sum._tied``, ``AOTPACK_ROW_SUM_TIE=on``; off by
    default: timed even on GPT-2, 0.3% slower on Llama-3.2-1B) it issues with A's row:
    one wave, the least a kernel reading the kernel before's output can have. (At
    ``gemm_rms16``'s K of 600 ptxas issues it early either way; at GPT-2's mlp out, K 3072, not.)"""
    counts = {}
    for setting in ("on", "off"):
        monkeypatch.setenv(row_sum.TIE_ENV, setting)
        compiled = _build(model, "on")
        (summed,) = [k for n, k in _one_row_plan(compiled) if n.endswith("_sum")]
        assert ("tie = tl.where(M < 0" in _source(compiled, summed)) == (setting == "on")
        counts[setting] = _waves_after_the_wait(compiled, summed)
    assert counts["on"] == 1, counts
    assert counts["off"] == (2 if model == "gemm_reduce_ln" else 1), counts


def test_the_tie_names_a_k_loop_it_cannot_tie_to():
    """``_tied`` finds the first partial sum by the line ``gemm_render._vec_steps`` writes; K
    steps without it are refused with a ``CodegenError`` naming the form, not a bare ValueError."""
    from aot.codegen.gemm_forms import CONFIGS
    from aot.errors import CodegenError

    cfg = next(c for c in CONFIGS if c.name == "vec_1x2x1024")
    steps = ["part0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)", "part0 += w0_0 * a"]
    tied = row_sum._tied(steps, ["r0"], cfg)
    assert tied[0].startswith("tie = tl.where(M < 0, tl.reshape(r0, (BLOCK_N, 1)), 0.0)")
    assert tied[1:] == [steps[0] + " + tie", steps[1]]
    with pytest.raises(CodegenError, match="vec_1x2x1024: no line 'part0 = tl.zeros"):
        row_sum._tied(["acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)"], ["r0"], cfg)
