"""The one-row forms that apply their norm after the products (``gemm_prologue.FACTORED``,
``AOTPACK_ONE_ROW_FACTORED``): an RMSNorm's statistic (``A @ W^T = r * ((g * x) @ W^T)``) and a
LayerNorm through the column sums the build computes (``norm_sums``: ``A @ W^T = rstd * ((x *
scale) @ W^T) - rstd * mean * (W @ scale) + W @ shift``), so that a block's products need not wait
for its row's statistics.

Built by default with the setting on, ``gemm_rms16.py`` (float16, two RMSNorm prologues, one of
them the stacked gate/up's) and ``gemm_gpt2.py`` (float16, GPT-2's LayerNorm with a trained scale
and shift before fc) run the ``_factored`` forms at one row; every kernel of their plans matches
the library steps it replaces in Triton's interpreter (``aot.dtypes.TOLERANCE``: half 1e-2 +
1e-2·|ref|) and repeats bit for bit, the residual sum the forms write is exact, and the column
sums equal W @ scale and W @ shift. Off, the forms are the statistics-first ones and the build
computes no sums; by default ("rms") the RMSNorms factor and the LayerNorms do not (no sums). A
form that drops the statistic, the mean's term or the shift's fails the comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.codegen import gemm_prologue
from aot.tracer import norm_scales
from tests.codegen.conftest import failing_candidates
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
ONE_ROW = {"batch": 1}


def _build(model: str, factored: str | None, fold: str = "rms"):
    """``model`` built by default with ``AOTPACK_ONE_ROW_FACTORED=factored`` (None: unset) and
    ``AOTPACK_FOLD_NORM_SCALES=fold`` ("rms": GPT-2's LayerNorm keeps its scale and shift)."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(norm_scales.ENV, fold)
        if factored is None:
            mp.delenv(gemm_prologue.FACTORED_ENV, raising=False)
        else:
            mp.setenv(gemm_prologue.FACTORED_ENV, factored)
        return generate(trace(load_model_file(MODELS / f"{model}.py")), ARCHS)


def _one_row_plan(compiled) -> list[tuple[str, str]]:
    """(kernel name, kernel id) of each kernel the one-row plan launches, in order."""
    from aot.schema import StepKind
    from aot.tuning import tuned_plans

    program = compiled.program
    names = {k.id: k.name for k in program.kernels}
    plan = tuned_plans(compiled.tuning, 0, program, ARCHS[0])[(1,)]
    return [(names[s.target], s.target) for s in plan if s.kind == StepKind.KERNEL]


def _sums(compiled) -> set[str]:
    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM

    return {w.name for w in compiled.program.weights if w.name.endswith((SCALE_SUM, SHIFT_SUM))}


# model: the norm-prologue forms its one-row plan runs (in order), and each W with column sums
# (Conv1D's stored [N, K] by the build as ``<name>.nk``) with its LayerNorm's scale and shift
CASES = {
    "gemm_rms16": (["gemm_norm_halves_epilogue_vec_1x4x1024", "gemm_norm_mm_vec_1x4x1024"], {}),
    "gemm_gpt2": (["gemm_ln_addmm_epilogue_vec_1x4x1024"], {"fc.weight.nk": ("ln.weight", "ln.bias")}),
}


@pytest.mark.parametrize("model", list(CASES))
def test_factored_one_row_forms_match_in_the_interpreter(model, tmp_path):
    import torch

    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    forms, summed = CASES[model]
    apart = _build(model, "off")
    assert [n for n, _ in _one_row_plan(apart) if n.startswith(("gemm_norm_", "gemm_ln_"))] == forms
    assert not _sums(apart)  # off: no column sums
    compiled = _build(model, "on")
    plan = _one_row_plan(compiled)
    assert [n for n, _ in plan if n.startswith(("gemm_norm_", "gemm_ln_"))] == [
        f + "_factored" for f in forms
    ]
    assert _sums(compiled) == {w + s for w in summed for s in (SCALE_SUM, SHIFT_SUM)}
    weights = compiled.traced.weights
    for w, (scale, shift) in summed.items():  # the column sums with W [N, K] as stored: fp32
        wt, scale, shift = (weights[n].float() for n in (w, scale, shift))
        torch.testing.assert_close(weights[w + SCALE_SUM], wt @ scale, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(weights[w + SHIFT_SUM], wt @ shift, rtol=1e-6, atol=1e-6)
    pack(compiled, tmp_path / "factored.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "factored.tpk", MODELS / f"{model}.py", [ONE_ROW], None, True)], timeout=HANG_GUARD_S
    )
    comparisons = result[next(iter(result))]
    assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    program = compiled.program
    checked = {c.name for c in comparisons if not c.name.endswith("/rerun")}  # every candidate, one row
    assert checked == {f"{site.id}/{c.name}" for site in program.alternatives for c in site.candidates}
    factored = {k for n, k in plan if n.endswith("_factored")}
    assert {c.kernel for c in comparisons} >= factored
    # the residual sum the forms write (an output of their site besides the product) is exact
    written = [c for c in comparisons if c.kernel in factored and c.output in _sum_outputs(program)]
    assert written and all(c.max_abs_error == 0.0 for c in written)


def test_a_folded_layer_norm_factors_with_ws_row_sums(tmp_path):
    """GPT-2's LayerNorm with its scale and shift folded into fc (``AOTPACK_FOLD_NORM_SCALES=on``):
    the factored one-row form applies the statistics with u, the row sums of W as folded (no c:
    the shift is in fc's bias), and matches the library in Triton's interpreter at one row."""
    import torch

    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
    from aot.packager import pack
    from aot.tracer.folding import FOLDED_PREFIX
    from aot.verify.interpret import interpret_in_subprocess

    compiled = _build("gemm_gpt2", "on", fold="on")
    (form,) = [n for n, _ in _one_row_plan(compiled) if n.startswith("gemm_ln_")]
    assert form == "gemm_ln_addmm_epilogue_vec_1x4x1024_factored"
    (u,) = _sums(compiled)
    assert u.startswith(FOLDED_PREFIX) and u.endswith(SCALE_SUM) and not u.endswith(SHIFT_SUM), u
    weights = compiled.traced.weights
    torch.testing.assert_close(weights[u], weights[u[: -len(SCALE_SUM)]].float().sum(1), rtol=1e-6, atol=1e-6)
    pack(compiled, tmp_path / "folded.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "folded.tpk", MODELS / "gemm_gpt2.py", [ONE_ROW], None, True)], timeout=HANG_GUARD_S
    )
    comparisons = result[next(iter(result))]
    assert comparisons and not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    factored = {k for n, k in _one_row_plan(compiled) if n.endswith("_factored")}
    assert factored and {c.kernel for c in comparisons} >= factored


def _sum_outputs(program) -> set[str]:
    return {site.outputs[-1] for site in program.alternatives if len(site.outputs) == 2}


@pytest.mark.slow  # three more interpreter runs
@pytest.mark.parametrize(
    "model, old, new",
    [
        ("gemm_rms16", " * (s4)[:, None]", ""),  # the statistic never applied
        ("gemm_gpt2", " - mean[:, None] * lnu", ""),  # the mean's term dropped
        ("gemm_gpt2", " + lnc", ""),  # the shift's term dropped
    ],
)
def test_a_wrong_factored_form_is_caught(model, old, new, tmp_path):
    compiled = _build(model, "on")
    (name, kernel), *_ = [(n, k) for n, k in _one_row_plan(compiled) if n.endswith("_factored")]
    source = next(k.source for k in compiled.program.kernels if k.id == kernel)
    assert old in source, source
    failed = failing_candidates(
        compiled, MODELS / f"{model}.py", kernel, old, new, ONE_ROW, tmp_path / "bad.tpk"
    )
    assert failed, f"{name} without {old!r} passed"


@pytest.mark.parametrize("model", list(CASES))
def test_by_default_rms_norms_factor_and_layer_norms_do_not(model):
    """The default ("rms"): ``gemm_rms16``'s RMSNorm forms factor, ``gemm_gpt2``'s LayerNorm form
    keeps its statistics first and the build stores no column sums; "rms" set by hand is the same."""
    forms, _ = CASES[model]
    expected = [f + "_factored" for f in forms] if model == "gemm_rms16" else forms
    for setting in (None, "rms"):
        compiled = _build(model, setting)
        assert [n for n, _ in _one_row_plan(compiled) if n.startswith(("gemm_norm_", "gemm_ln_"))] == expected
        assert not _sums(compiled)


def test_a_wrong_setting_is_a_clear_error(monkeypatch):
    from aot.errors import CodegenError

    monkeypatch.setenv(gemm_prologue.FACTORED_ENV, "yes")
    with pytest.raises(
        CodegenError, match="AOTPACK_ONE_ROW_FACTORED='yes': expected 'on', 'rms', 'head' or 'off'"
    ):
        gemm_prologue.factored_one_row(layer_norm=False)
    monkeypatch.setenv(gemm_prologue.FACTORED_ENV, "RMS")  # any case
    assert gemm_prologue.factored_one_row(layer_norm=False)
    assert not gemm_prologue.factored_one_row(layer_norm=True)
    assert not gemm_prologue.factored_one_row(layer_norm=True, head=True)
    monkeypatch.setenv(gemm_prologue.FACTORED_ENV, "head")  # LayerNorms at vocabulary heads only
    assert gemm_prologue.factored_one_row(layer_norm=False)
    assert gemm_prologue.factored_one_row(layer_norm=True, head=True)
    assert not gemm_prologue.factored_one_row(layer_norm=True)
    monkeypatch.setenv(gemm_prologue.FACTORED_ENV, "off")
    assert not gemm_prologue.factored_one_row(layer_norm=False)
