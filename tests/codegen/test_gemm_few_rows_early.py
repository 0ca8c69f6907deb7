"""The few-row forms that load W early and compute the row norm in one pass (``fewe_*``,
``fewp_16x32x256``; ``gemm_forms.TileConfig.w_early`` and ``norm_one_pass``): the built-in table's
at vocabulary heads (``gemm_defaults.BUILT_IN_FEW_ROWS``), at every site where ``FEW_ROWS`` or
``AOTPACK_FEW_ROWS`` names them.

``gemm_models/gemm_rms16.py`` (float16, K = 600: two K steps of 256 loaded before the wait, the
third, partial, in the loop) built with ``fewe_16x32x256``: the W tiles of the first two K steps
load before the dependent-launch wait and nothing else does; its ``_rms`` forms are the one-pass
ones (no statistics pass over A) where the site's dtype allows (``ONE_PASS_DTYPES``: bfloat16;
Triton's interpreter computes bfloat16 ``tl.dot`` wrongly, so the float16 model is built with
float16 admitted, its values far from float16's range); every form matches the library steps it
replaces in the interpreter at 8 and 3 rows (``aot.dtypes.TOLERANCE``, float16: 1e-2 +
1e-2·|ref|), the residual sums they write exactly. A split-K form with early W tiles (a test
config of 16x16x128 tiles, K in two slices of 384, the second partial) the same.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from aot.codegen import gemm, gemm_defaults, gemm_forms, gemm_render, row_sum
from aot.codegen.gemm_defaults import FEW_ROWS_ENV, FEW_ROWS_PROLOGUE_ENV, default_form
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
EARLY = "fewe_16x32x256"
SPLIT = "fewe_splitk_16x16x128"  # a test config: K = 600 in two slices


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(FEW_ROWS_ENV, raising=False)
    monkeypatch.delenv(FEW_ROWS_PROLOGUE_ENV, raising=False)
    # the few-row forms' sites as they stand apart: the one-row join (``row_sum``) would make
    # gemm_rms16's down projection and the projection after it one site at every bucket
    monkeypatch.setenv(row_sum.ENV, "off")


def test_the_new_forms_and_the_override(monkeypatch):
    names = {c.name: c for c in gemm_forms.FEW_ROW_CONFIGS}
    for base in ("16x16x256", "16x16x512", "16x32x256", "16x64x128", "splitk_16x64x128", "splitk_16x16x512"):
        old, new = names["few_" + base], names["fewe_" + base]
        assert (new.block_n, new.block_k, new.split_k) == (old.block_n, old.block_k, old.split_k)
        assert new.w_early == 2 and old.w_early == 0 and new.norm_one_pass == old.row_norm
    assert names["fewp_16x32x256"].norm_one_pass and not names["fewp_16x32x256"].w_early
    # 12 MiB: the built-in entry's swapped form in K slices (gemm_defaults.BUILT_IN_LARGE)
    assert all(default_form(r, 2048, "bfloat16", n=3072) == "fews_splitk_16x64x64" for r in (2, 8, 16))
    monkeypatch.setenv(FEW_ROWS_ENV, "fewe_16x32x256,fewe_splitk_16x64x128,fewe_16x64x128")
    assert default_form(8, 2048, "bfloat16", n=2048) == "fewe_16x32x256"
    assert default_form(8, 8192, "bfloat16", n=2048) == "fewe_splitk_16x64x128"
    assert default_form(8, 2048, "bfloat16", n=16384) == "fewe_16x64x128"


def _build(tmp_path_factory, form: str, configs=None):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(row_sum.ENV, "off")  # as ``_no_override``
        mp.setattr(gemm_defaults, "FEW_ROWS", form)
        mp.setattr(gemm_render, "ONE_PASS_DTYPES", ("bfloat16", "float16"))
        if configs is not None:
            for module in (gemm, gemm_defaults):
                mp.setattr(module, "FEW_ROW_CONFIGS", configs)
        compiled = generate(trace(load_model_file(MODELS / "gemm_rms16.py")), ARCHS)
    path = tmp_path_factory.mktemp("few_early") / "rms16.tpk"
    pack(compiled, path)
    return compiled, path


@pytest.fixture(scope="module")
def early(tmp_path_factory):
    return _build(tmp_path_factory, EARLY)


def _before_wait(source: str) -> str:
    """The kernel's statements before the wait for the kernel before (its signature and
    comments left out)."""
    body = source.split("@triton.jit")[1].split("if GDC:")[0].splitlines()
    return "\n".join(ln for ln in body if ln.strip() and not ln.strip().startswith(("def ", "#")))


def test_w_loads_before_the_wait_and_the_norm_in_one_pass(early):
    compiled, _ = early
    kernels = {k.id: k for k in compiled.program.kernels}
    forms = [
        (site.k, c.name, kernels[c.steps[-1].target].source)
        for site in compiled.program.alternatives
        for c in site.candidates
        if EARLY in c.name
    ]
    assert {name for _, name, _ in forms} == {EARLY, EARLY + "_rms"}
    assert sorted(k for k, _, _ in forms) == [64, 600, 600]  # down; gate/up and proj
    for k, name, source in forms:
        head = _before_wait(source)
        # the first K steps' W tiles (two, or one where K is one step), of each weight; nothing
        # of A or of what a kernel writes
        steps = min(2, -(-k // 256))
        loads = [ln.strip() for ln in head.splitlines() if "tl.load(" in ln]
        assert loads and all(ln.startswith(("w0_e", "w1_e")) for ln in loads), head
        assert f"w0_e{steps - 1} = tl.load" in head and f"_e{steps}" not in head
        assert not any(p in head for p in ("a_ptr", "x0_ptr", "x1_ptr", "sum_ptr", "out0_ptr")), head
        assert f"for k0 in range({steps * 256}, {k}, BLOCK_K):" in source
        if name.endswith("_rms"):
            assert "for c0 in range" not in source  # no statistics pass over A
            assert source.count("s_sum +=") == 3 and "acc0 = acc0 * (s4)[:, None]" in source


def test_a_float16_site_keeps_the_statistics_pass(tmp_path_factory):
    """Without float16 in ``ONE_PASS_DTYPES`` (the built-in setting), the float16 model's
    ``_rms`` form reads the statistics in a pass of its own; the W tiles still load early."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm_defaults, "FEW_ROWS", EARLY)
        compiled = generate(trace(load_model_file(MODELS / "gemm_rms16.py")), ARCHS)
    kernels = {k.id: k for k in compiled.program.kernels}
    (source, *_) = [
        kernels[c.steps[-1].target].source
        for site in compiled.program.alternatives
        for c in site.candidates
        if c.name == EARLY + "_rms"
    ]
    assert "for c0 in range" in source and "w0_e1 = tl.load" in _before_wait(source)


def _interpret(compiled, path, form: str, batches=(8, 3)):
    from aot.verify.interpret import interpret_in_subprocess

    (result,) = interpret_in_subprocess(
        [(path, MODELS / "gemm_rms16.py", [{"batch": b} for b in batches], None, True)],
        timeout=HANG_GUARD_S,
    )
    comparisons = [c for per in result.values() for c in per]
    few = [c for c in comparisons if form in c.name and not c.name.endswith("/rerun")]
    bad = [c for c in comparisons if not c.ok]
    assert not bad, bad[:3]
    return few


@pytest.mark.slow  # the interpreter at two row counts
def test_the_early_and_one_pass_forms_match_their_reference_in_the_interpreter(early):
    compiled, path = early
    program = compiled.program
    few = _interpret(compiled, path, EARLY)
    assert {c.name.split("/")[1] for c in few} == {EARLY, EARLY + "_rms"}
    sums = {site.outputs[-1] for site in program.alternatives if len(site.outputs) == 2}
    written = [c for c in few if c.output in sums]
    assert written and all(c.max_abs_error == 0.0 for c in written)  # x + r, exact in float16


@pytest.mark.slow  # another build and the interpreter
def test_a_split_k_form_with_early_w_matches_its_reference(tmp_path_factory):
    base = next(c for c in gemm_forms.FEW_ROW_CONFIGS if c.name == "fewe_splitk_16x64x128")
    test_cfg = replace(base, name=SPLIT, block_n=16, block_k=128, min_k=256)
    compiled, path = _build(tmp_path_factory, SPLIT, (*gemm_forms.FEW_ROW_CONFIGS, test_cfg))
    kernels = {k.id: k for k in compiled.program.kernels}
    partial = [k for k in kernels.values() if k.name.endswith("fewe_splitk2_16x16x128_partial")]
    assert len(partial) == 2  # gate/up (after its norm kernel) and proj; down's K is too short
    for k in partial:
        head = _before_wait(k.source)
        assert "ks = tl.program_id(2)" in head and "w0_e1 = tl.load" in head and "x0_ptr" not in head
    few = _interpret(compiled, path, "fewe_splitk2_16x16x128", batches=(8,))
    assert len({c.name for c in few}) == 2


@pytest.mark.slow  # the interpreter again, on a broken kernel
def test_a_one_pass_form_without_its_statistic_is_caught(early, tmp_path):
    """The one-pass form's last line of the norm (1/rms on the accumulator) dropped: the
    comparison fails for that candidate alone."""
    from tests.codegen.conftest import failing_candidates

    compiled, _ = early
    site = compiled.program.alternatives[2]  # proj: RMSNorm of the second sum, then Linear(600, 48)
    cand = next(c for c in site.candidates if c.name == EARLY + "_rms")
    failed = failing_candidates(
        compiled,
        MODELS / "gemm_rms16.py",
        cand.steps[-1].target,
        "acc0 = acc0 * (s4)[:, None]",
        "acc0 = acc0 * 1.0",
        {"batch": 8},
        tmp_path / "bad.tpk",
    )
    assert failed == {f"{site.id}/{cand.name}"}


def _early_sources(compiled) -> list[str]:
    kernels = {k.id: k for k in compiled.program.kernels}
    return [
        kernels[c.steps[-1].target].source
        for site in compiled.program.alternatives
        for c in site.candidates
        if EARLY in c.name
    ]


def test_the_early_steps_products_come_after_the_loop(early):
    """By default (``gemm_render.EARLY_STEPS_LAST``) the products of the W tiles loaded before
    the wait come after the K loop, so the loop's first copies issue right after the wait."""
    compiled, _ = early
    sources = _early_sources(compiled)
    assert len(sources) == 3
    for source in sources:
        assert "w0_e0 = tl.load" in _before_wait(source)
        assert source.index("for k0 in range(") < source.index("# K step 0: W loaded early")


@pytest.mark.slow  # another build and the interpreter
def test_the_early_steps_products_before_the_loop_match_their_reference(tmp_path_factory, monkeypatch):
    """``AOTPACK_EARLY_STEPS_LAST=off``: the products of the early W tiles come before the K
    loop (the order before 2026-12-06, kept for measuring); the same loads before the wait, every
    form within the interpreter's tolerance of the library and the residual sums exact."""
    monkeypatch.setenv(gemm_render.EARLY_STEPS_LAST_ENV, "off")
    compiled, path = _build(tmp_path_factory, EARLY)
    sources = _early_sources(compiled)
    assert len(sources) == 3
    for source in sources:
        assert "w0_e0 = tl.load" in _before_wait(source)
        assert source.index("# K step 0: W loaded early") < source.index("for k0 in range(")
    few = _interpret(compiled, path, EARLY)
    sums = {site.outputs[-1] for site in compiled.program.alternatives if len(site.outputs) == 2}
    written = [c for c in few if c.output in sums]
    assert written and all(c.max_abs_error == 0.0 for c in written)
