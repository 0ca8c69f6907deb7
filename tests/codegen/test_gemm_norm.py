"""One-row GEMV forms that absorb the kernels around a Llama decoder's GEMMs
(``aot.codegen.gemm_prologue``, ``gemm_sites``, ``gemm_render``): the RMSNorm kernel before a GEMM,
with the residual add in it, as a prologue (``<form>_rms``, the sum written by the first N tile),
and the SiLU(gate) * up kernel after the stacked gate/up GEMM as its epilogue (each block computes
both halves of its columns).

Every candidate of ``gemm_models/gemm_rms*.py`` (K = 600: vec_1x2x512 takes a partial second K
step) runs in Triton's interpreter against the library steps it replaces, in bfloat16, float16 and
float32, at 1 and 3 rows (the default run: float16 at one row; the rest is slow) (``aot.dtypes.TOLERANCE``: half 1e-2 + 1e-2·|ref|, fp32 1e-4 +
1e-4·|ref|); the sums the forms write are exact in float16 and float32 (in bfloat16 the
interpreter's rounding of the program's own norm kernel and of the forms alike differs from
ATen's by up to one bfloat16 ulp, within the tolerance). Built by default, ``gemm_rms16.py`` runs
3 kernels at one row with the built-in table where the library plan runs 6; a transformers Llama
built at batch 1 decode (float16) runs 7 kernels per decoder layer where the library plan runs 10,
and every kernel of that plan matches its reference steps in the interpreter (slow).

GPT-2's LayerNorm (``gemm_models/gemm_gpt2.py``: the residual add through inference dropout's
copy) runs in the one-row forms' prologue (``<form>_ln``) and its ``gelu_new`` in fc's epilogue:
every one-row form of the table, plain and ``_ln``, matches its reference in the interpreter at
one row (float16), and a transformers GPT-2 at batch 1 decode runs 5 kernels per layer where
the library plan runs 8 (slow, as Llama's).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from aot import schema
from tests.codegen.conftest import failing_candidates, forms_offered, interpreted_one_row_decode
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
RMS_MODELS = ("gemm_rms", "gemm_rms16", "gemm_rms32")  # bfloat16, float16, float32
ROWS = ({"batch": 1}, {"batch": 3})
ONE_ROW_FORMS = ("vec_1x2x512", "vec_1x2x1024")


def _one_row_configs():
    """Two one-row forms (K = 600: in two steps, the second partial, and in one partial step),
    eligible at every bucket so that they run at 3 rows too."""
    from aot.codegen import gemm_forms

    return tuple(replace(c, max_m=1 << 62) for c in gemm_forms.CONFIGS if c.name in ONE_ROW_FORMS)


class RmsBuilds:
    """name → (compiled, bundle path, model path), built with GEMM candidates of the one-row forms
    the first time a test asks for it (the default run needs the float16 model alone)."""

    def __init__(self, base: Path):
        self.base = base
        self._made: dict[str, tuple] = {}

    def __getitem__(self, name: str) -> tuple:
        if name not in self._made:
            from aot.codegen import generate
            from aot.packager import pack
            from aot.tracer import load_model_file, trace

            model = MODELS / f"{name}.py"
            with forms_offered(_one_row_configs()):
                compiled = generate(trace(load_model_file(model)), ARCHS, gemm_candidates=True)
            pack(compiled, self.base / f"{name}.tpk")
            self._made[name] = (compiled, self.base / f"{name}.tpk", model)
        return self._made[name]


@pytest.fixture(scope="module")
def rms_built(tmp_path_factory) -> RmsBuilds:
    return RmsBuilds(tmp_path_factory.mktemp("gemm_norm"))


# the same sites and forms in every dtype: float16 by default, bfloat16 in the slow run
@pytest.mark.parametrize("name", ["gemm_rms16", pytest.param("gemm_rms", marks=pytest.mark.slow)])
def test_norm_kernels_and_the_silu_product_are_absorbed(rms_built, name):
    program = rms_built[name][0].program
    gate_up, down, proj = program.alternatives
    kernels = {k.id: k for k in program.kernels}
    # gate/up: the norm kernel (with h = x + r), the stacked GEMM and the SiLU * up kernel
    steps = [program.steps[i] for i in gate_up.library]
    assert steps[0].kind == schema.StepKind.KERNEL and steps[-1].kind == schema.StepKind.KERNEL
    assert "aten.mean.dim" in {r.target for r in steps[0].reference}
    assert "aten.sigmoid.default" in {r.target for r in steps[-1].reference}
    assert (gate_up.n, gate_up.k) == (64, 600)  # each half: 64 columns
    assert gate_up.outputs == (steps[-1].outputs[0], "add")  # the product, and h for the residual
    forms = {c.name: c for c in gate_up.candidates}
    # and the built-in entry's form where the norm is the prologue (K 600: gemm_defaults.PROLOGUE_ROWS)
    assert sorted(forms) == [
        "vec_1x2x1024",
        "vec_1x2x1024_rms",
        "vec_1x2x512",
        "vec_1x2x512_rms",
        "vec_1x4x1024",
        "vec_1x4x1024_rms",
    ]
    fused = forms["vec_1x2x512_rms"]
    assert len(fused.steps) == 1  # the norm kernel is gone
    source = kernels[fused.steps[0].target].source
    assert "row norm (RMSNorm) of a sum prologue" in source and "two halves of a stacked GEMM" in source
    assert "sum_ptr" in source and "tl.sigmoid" in source and "tl.dot" not in source
    assert f"(w1_ptr + {64 * 600})" in source  # the second half: W's rows 64..127
    # the plain forms run the program's norm kernel first
    assert forms["vec_1x2x512"].steps[0].target == steps[0].target
    # down: no norm before it (its A is the SiLU product); proj: the second norm, its sum an output
    assert down.outputs == ("mm_2",) and [c.name for c in down.candidates] == ["vec_1x2x512", "vec_1x2x1024"]
    assert proj.outputs[-1] in program.outputs and "vec_1x2x1024_rms" in {c.name for c in proj.candidates}


# The default run interprets the float16 model at one row; the slow tier the rest (bfloat16,
# float32, and 3 rows).
RMS_TIERS = [
    pytest.param("first", id="fp16-one-row"),
    pytest.param("rest", id="other-dtypes-and-rows", marks=pytest.mark.slow),
]


def _tier_rows(tier: str) -> dict[str, list[dict]]:
    first = {"gemm_rms16": [ROWS[0]]}
    if tier == "first":
        return first
    return {n: [r for r in ROWS if r not in first.get(n, [])] for n in RMS_MODELS}


@pytest.fixture(scope="module")
def rms_interpreted(rms_built, request):
    """name → (rows, {sizes: comparisons}) at the rows of the tier ``request.param``."""
    from aot.verify.interpret import interpret_in_subprocess

    plan = _tier_rows(request.param)
    results = interpret_in_subprocess(
        [(rms_built[n][1], rms_built[n][2], rows, None, True) for n, rows in plan.items()],
        timeout=HANG_GUARD_S,
    )
    return {n: (rows, r) for (n, rows), r in zip(plan.items(), results)}


@pytest.mark.parametrize("rms_interpreted", RMS_TIERS, indirect=True)
def test_every_form_matches_its_reference(rms_built, rms_interpreted):
    for name, (rows, results) in rms_interpreted.items():
        program = rms_built[name][0].program
        sums = {site.outputs[-1] for site in program.alternatives if len(site.outputs) == 2}
        assert len(sums) == 2
        assert len(results) == len(rows)
        n_cands = sum(len(s.candidates) for s in program.alternatives)
        for sizes, comparisons in results.items():
            assert len({c.name for c in comparisons if not c.name.endswith("/rerun")}) == n_cands
            bad = [c for c in comparisons if not c.ok]
            assert not bad, f"{name} at {sizes}: {bad[:3]}"
            rms = [c for c in comparisons if c.name.endswith("_rms")]
            assert {c.output for c in rms} >= sums
            if name != "gemm_rms":  # float16, float32: the sum x + r is written exactly
                assert all(c.max_abs_error == 0.0 for c in rms if c.output in sums)


@pytest.mark.slow  # every candidate interpreted again; test_gemm.py's test_interpreter_check_can_fail runs by default
def test_a_wrong_norm_is_caught(rms_built, tmp_path):
    """The fused form with the statistics' epsilon dropped fails its comparison (float32)."""
    compiled, _, model = rms_built["gemm_rms32"]
    site = compiled.program.alternatives[0]
    cand = next(c for c in site.candidates if c.name == "vec_1x2x1024_rms")
    failed = failing_candidates(
        compiled,
        model,
        cand.steps[-1].target,
        "(s_mean + 1e-05)",
        "(s_mean + 1.0)",
        {"batch": 1},
        tmp_path / "bad.tpk",
    )
    assert failed == {f"{site.id}/{cand.name}"}


def test_what_is_not_a_row_norm_stays():
    """Steps with no mean over K, a mean without keepdim, or two row inputs too many are no prologue."""
    from aot.codegen.gemm_epilogue import NoSite
    from aot.codegen.gemm_prologue import lower_row_norm
    from aot.schema import Buf, DType, Step, StepKind, TensorSpec

    def step(target, args, out, **kw):
        return Step(StepKind.ATEN, target, tuple(args), kw, (out,))

    known = {"w": TensorSpec("float16", ("8",))}
    buffers = {
        n: TensorSpec(dt, shape)
        for n, dt, shape in [
            ("x", "float16", ("m", "8")),
            ("y", "float16", ("m", "8")),
            ("z", "float16", ("m", "8")),
            ("f", "float32", ("m", "8")),
            ("sq", "float32", ("m", "8")),
            ("ms", "float32", ("m", "1")),
            ("ms0", "float32", ("m",)),
            ("r", "float32", ("m", "1")),
            ("n", "float32", ("m", "8")),
            ("h", "float16", ("m", "8")),
            ("o", "float16", ("m", "8")),
        ]
    }
    cast = step("aten._to_copy.default", [Buf("x")], "f", dtype=DType("float32"))
    tail = [
        step("aten.rsqrt.default", [Buf("ms")], "r"),
        step("aten.mul.Tensor", [Buf("f"), Buf("r")], "n"),
        step("aten._to_copy.default", [Buf("n")], "h", dtype=DType("float16")),
        step("aten.mul.Tensor", [Buf("w"), Buf("h")], "o"),
    ]
    square = step("aten.pow.Tensor_Scalar", [Buf("f"), 2], "sq")
    good = (cast, square, step("aten.mean.dim", [Buf("sq"), [-1], True], "ms"), *tail)
    norm = lower_row_norm(good, ("o",), "o", "m", 8, buffers, known)
    assert norm.inputs == (("x", "float16"),) and norm.vectors == (("w", "float16"),) and norm.sum_out is None
    no_mean = (cast, square, *tail)
    no_keepdim = (cast, square, step("aten.mean.dim", [Buf("sq"), [-1]], "ms0"), *tail)
    three = (
        step("aten.add.Tensor", [Buf("x"), Buf("y")], "h"),
        step("aten.add.Tensor", [Buf("h"), Buf("z")], "o"),
        *good,
    )
    for steps in (no_mean, no_keepdim, three):
        with pytest.raises(NoSite):
            lower_row_norm(steps, ("o",), "o", "m", 8, buffers, known)


# ---------------------------------------------------------------------------------------------
# A transformers Llama at batch 1 decode

DECODE_KERNELS_PER_LAYER = {
    "llama": {"library": 10, "built-in table": 7},
    # LayerNorm, q/k/v, attention, o, add + LayerNorm, fc, GELU, proj; with the table the
    # LayerNorms (and their adds) and the GELU run inside the GEMVs
    "gpt2": {"library": 8, "built-in table": 5},
}


def _decode_build(kind: str, tmp_path_factory, env: dict[str, str] | None = None):
    """A tiny transformers model (tests/hf's config, 2 layers) in float16 (the interpreter computes
    the decode attention kernel's bfloat16 ``tl.dot`` wrongly: tests/codegen/test_decode_attention.py),
    built by default for sm_90, with the environment's variables ``env`` set for the build:
    (bundle path, the compiled build, the decode program's index)."""
    from tests.realmodels.conftest import unusable

    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    spec = causal_lm(
        factory(kind), max_batch=2, max_context=16, dtype="float16", name=kind, batch_buckets=(1, 2)
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        compiled = generate(trace(spec), ARCHS)
    path = tmp_path_factory.mktemp(f"{kind}_decode") / f"{kind}.tpk"
    pack(compiled, path)
    programs = [compiled.program, *compiled.program.variants]
    (index,) = [
        i
        for i, p in enumerate(programs)
        if len(p.inputs[0].spec.shape) == 2 and p.inputs[0].spec.shape[1] == "1"
    ]
    return path, compiled, index


@pytest.fixture(scope="module")
def llama_decode(tmp_path_factory):
    return _decode_build("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def llama_decode_sliced(tmp_path_factory):
    from aot.codegen.gemm_sites import SLICED_PROLOGUE_ENV

    return _decode_build("llama", tmp_path_factory, {SLICED_PROLOGUE_ENV: "on"})


@pytest.fixture(scope="module")
def gpt2_decode(tmp_path_factory):
    return _decode_build("gpt2", tmp_path_factory)


def _prologue_form_build(kind: str, form: str, tmp_path_factory):
    """``_decode_build`` whose norm-prologue sites run ``form`` at one row
    (``AOTPACK_ONE_ROW_PROLOGUE``)."""
    from aot.codegen.gemm_defaults import ONE_ROW_PROLOGUE_ENV

    return _decode_build(kind, tmp_path_factory, {ONE_ROW_PROLOGUE_ENV: form})


@pytest.fixture(scope="module")
def llama_decode_four(tmp_path_factory):
    return _prologue_form_build("llama", "vec_1x4x1024", tmp_path_factory)


@pytest.fixture(scope="module")
def gpt2_decode_four(tmp_path_factory):
    return _prologue_form_build("gpt2", "vec_1x4x1024", tmp_path_factory)


@pytest.fixture(scope="module")
def gpt2_decode_eight(tmp_path_factory):
    return _prologue_form_build("gpt2", "vec_1x8x1024", tmp_path_factory)


@pytest.fixture(scope="module")
def phi3_decode(tmp_path_factory):
    return _decode_build("phi3", tmp_path_factory)


def _two_means_build(kind: str, tmp_path_factory):
    """``_decode_build`` with prologues of two means (``AOTPACK_ROW_NORM_MEANS=2``)."""
    from aot.codegen.gemm_prologue import MEANS_ENV

    return _decode_build(kind, tmp_path_factory, {MEANS_ENV: "2"})


@pytest.fixture(scope="module")
def olmo2_decode(tmp_path_factory):
    return _decode_build("olmo2", tmp_path_factory)


@pytest.fixture(scope="module")
def gemma2_decode(tmp_path_factory):
    return _two_means_build("gemma2", tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3_decode(tmp_path_factory):
    return _two_means_build("gemma3", tmp_path_factory)


def _one_row_plan(build) -> tuple[schema.Program, dict, tuple, list[str]]:
    """A ``_decode_build``'s decode program, its kernels by id, the plan the built-in table gives
    it at one row on sm_90, and the names of the kernels that plan launches."""
    from aot.tuning import tuned_plans

    _, compiled, index = build
    program = [compiled.program, *compiled.program.variants][index]
    kernels = {k.id: k for k in program.kernels}
    plan = tuned_plans(compiled.tuning, index, program, "sm_90")[(1,)]
    names = [kernels[s.target].name for s in plan if s.kind == schema.StepKind.KERNEL]
    return program, kernels, plan, names


def _launches(steps, kernels) -> int:
    """Kernel launches and library GEMM calls of a plan (views and the like launch nothing)."""
    return sum(
        s.kind == schema.StepKind.KERNEL or s.target in ("aten.mm.default", "aten.addmm.default")
        for s in steps
    )


def test_the_default_build_runs_the_norms_and_the_silu_product_inside_the_gemvs():
    """``gemm_rms16.py`` built by default (no candidates): at one row on sm_90 the built-in table
    runs both RMSNorm kernels (the residual adds in them) as the prologues of the GEMVs after them
    and the SiLU * up kernel as the stacked gate/up GEMV's epilogue: three launches fewer than the
    library plan; at 8 rows tune's few-row tile takes the SiLU product (the weights are small; K 600,
    so W's first steps load before the wait: ``gemm_defaults.SMALL_EARLY``), the norm kernels stay. The same at one row on a
    transformers Llama: ``test_llama_decode_runs_fewer_kernels_per_layer`` (slow)."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace
    from aot.tuning import tuned_plans

    compiled = generate(trace(load_model_file(MODELS / "gemm_rms16.py")), ARCHS)
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    plans = tuned_plans(compiled.tuning, 0, program, "sm_90")
    assert list(plans) == [(1,), (8,)]
    names = [kernels[s.target].name for s in plans[(1,)] if s.kind == schema.StepKind.KERNEL]
    assert sum(n.startswith("gemm_norm_halves_epilogue_vec_") for n in names) == 1, names
    assert sum(n.startswith("gemm_norm_") for n in names) == 2
    assert not any("sigmoid" in n or "mean" in n for n in names), names
    assert _launches(plans[(1,)], kernels) == _launches(program.steps, kernels) - 3
    # at 8 rows tune's tile (the weights are small): the SiLU product in its epilogue, the norm
    # kernels before the GEMMs kept
    names = [kernels[s.target].name for s in plans[(8,)] if s.kind == schema.StepKind.KERNEL]
    assert sum(n.startswith("gemm_halves_epilogue_gemve_16x32x128") for n in names) == 1, names
    assert sum("mean" in n for n in names) == 2 and not any("sigmoid" in n for n in names), names
    assert _launches(plans[(8,)], kernels) == _launches(program.steps, kernels) - 1


@pytest.mark.slow  # a transformers Llama traced and built; the small model's test above runs by default
def test_llama_decode_runs_fewer_kernels_per_layer(llama_decode):
    program, kernels, plan, names = _one_row_plan(llama_decode)
    layers = 2
    assert sum(n.startswith("gemm_norm_halves_epilogue_vec") for n in names) == layers
    assert not any("sigmoid" in n for n in names)  # the SiLU * up kernel went into the gate/up GEMV
    # per layer, with the built-in table: q/k/v (+ RMSNorm, + the residual add), 2 RoPE, decode
    # attention, o, gate/up (+ RMSNorm, + the add, + SiLU * up), down; the rest is the positions,
    # mask, the final norm and the head, which both plans share, and the embedding lookup, which
    # the table's first q/k/v reads from the table (``gemm_sites.Gathered``)
    per_layer = DECODE_KERNELS_PER_LAYER["llama"]
    outside = _launches(program.steps, kernels) - per_layer["library"] * layers
    assert "gather_rows" in {kernels[s.target].name for s in program.steps if s.target in kernels}
    assert "gather_rows" not in names
    assert _launches(plan, kernels) == outside - 1 + per_layer["built-in table"] * layers


@pytest.mark.slow  # a transformers Llama traced and built once more
def test_the_final_norm_goes_into_the_heads_prologue_where_asked(llama_decode, llama_decode_sliced):
    """``AOTPACK_SLICED_PROLOGUE=on``: the decode step's final norm (with its residual add) runs
    in the vocabulary head's prologue, through the ``[:, -1:]`` of its one position: one launch
    fewer than the default plan (which keeps the norm kernel: it measured faster on an H200)."""
    plans = []
    for build in (llama_decode, llama_decode_sliced):
        _, kernels, plan, names = _one_row_plan(build)
        plans.append((names, _launches(plan, kernels)))
    (default, n_default), (sliced, n_sliced) = plans
    assert default[-1].startswith("gemm_mm_vec") and "mean" in default[-2], default[-3:]
    assert sliced[-1].startswith("gemm_norm_mm_vec"), sliced[-3:]
    assert n_sliced == n_default - 1


@pytest.mark.slow  # a transformers Phi-3 traced and built
def test_phi3_decode_runs_its_norms_and_silu_product_inside_the_gemvs(phi3_decode):
    """Phi-3 writes its sublayers' outputs through a dropout (a ``clone`` before the residual
    add) and computes gate and up as one projection whose output it splits in halves
    (``gate_up_proj(x).chunk(2, -1)``). The RMSNorm kernels (clone and add in them) go into q/k/v's
    and gate/up's prologues, the SiLU product into gate/up's epilogue (the split's halves as the
    stacked halves): five launches a layer at one row, as Llama's, where it had seven or eight."""
    _, kernels, plan, names = _one_row_plan(phi3_decode)
    layers = 2
    assert sum(n.startswith("gemm_norm_halves_epilogue_vec") for n in names) == layers, names
    assert sum(n.startswith("gemm_norm_mm_vec") for n in names) == layers, names  # q/k/v
    assert not any("sigmoid" in n for n in names), names
    assert sum("pow" in n or "mean" in n for n in names) == 1, names  # the final norm's kernel
    # and once a step: the mask, the rotary tables, the final norm, the head (the embedding
    # lookup is read from its table by the first q/k/v: ``gemm_sites.Gathered``)
    assert "gather_rows" not in names
    assert _launches(plan, kernels) == 5 * layers + 4


@pytest.mark.slow  # transformers Gemma 2 and Gemma 3 traced and built
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemmas_post_norms_run_inside_the_gemvs_where_asked(kind, request, tmp_path_factory):
    """Gemma 2 and 3 norm each sublayer's output before the residual add, then norm the sum for
    the next sublayer: a kernel of two means over the row between the GEMVs, twice a layer. With
    ``AOTPACK_ROW_NORM_MEANS=2`` it is the next GEMV's prologue at one row (``RowNorm.more``: the
    first N tile writes the sum the later add reads): gate/up after the attention's, the second
    layer's q/k/v after the first's MLP. What stays: the first layer's input norm (after the
    embedding's scale), the last layer's post-MLP norm with the final norm (before the head). By
    default (it measured slower on an H200) no prologue computes two means."""
    _, default, index = _decode_build(kind, tmp_path_factory)
    assert not any("s_sum2" in k.source for k in [default.program, *default.program.variants][index].kernels)
    _, kernels, plan, names = _one_row_plan(request.getfixturevalue(f"{kind}_decode"))
    layers = 2
    assert sum(n.startswith("gemm_norm_halves_epilogue_vec") for n in names) == layers, names
    assert sum(n.startswith("gemm_norm_mm_vec") for n in names) == layers - 1, names
    assert sum(n.startswith("fused") and "mean" in n for n in names) == 2, names
    # gate/up's prologue computes two means: its source names the second
    gate_up = next(
        kernels[s.target]
        for s in plan
        if s.target in kernels and kernels[s.target].name.startswith("gemm_norm_halves")
    )
    assert "s_sum2 = " in gate_up.source


@pytest.mark.slow  # a transformers OLMo 2 traced and built
def test_olmo2s_post_norms_run_inside_the_gemvs(olmo2_decode):
    """OLMo 2 norms each sublayer's output, then adds the residual; the sum is the next GEMM's A
    as it is (no pre-norm) and the next residual. At one row that kernel is the next GEMV's
    prologue, which stores A (the sum) from its first N tile for the add after: gate/up after
    the attention's, the second layer's q/k/v after the first's MLP. What stays: its q and k
    norms (over all heads, not per head) and the last layer's post-MLP norm before the head."""
    _, kernels, plan, names = _one_row_plan(olmo2_decode)
    layers = 2
    assert sum(n.startswith("gemm_norm_halves_epilogue_vec") for n in names) == layers, names
    assert sum(n.startswith("gemm_norm_mm_vec") for n in names) == layers - 1, names
    assert sum(n.startswith("fused") and "mean" in n for n in names) == 2 * layers + 1, names
    gate_up = next(
        kernels[s.target]
        for s in plan
        if s.target in kernels and kernels[s.target].name.startswith("gemm_norm_halves")
    )
    assert "tl.store(sum_ptr" in gate_up.source


@pytest.mark.slow  # a transformers GPT-2 traced and built twice, its decode step interpreted
def test_gpt2s_final_layer_norm_runs_after_the_heads_products_where_asked(tmp_path_factory, monkeypatch):
    """``AOTPACK_SLICED_PROLOGUE=on`` with ``AOTPACK_ONE_ROW_FACTORED=head``: GPT-2's final
    LayerNorm (the last layer's residual add in it) runs in the vocabulary head's one-row GEMV,
    applied after the products through the column sums the build computed through the
    ``[:, -1:]`` slice (``norm_sums``), while q/k/v's and fc's LayerNorms stay statistics-first:
    one launch fewer than the default plan, and every kernel of the step matches its reference
    in Triton's interpreter. The tiny model's 200-token vocabulary counts as one
    (``gemm_render.VOCAB_N`` lowered to 150 for the build: q/k/v's 96 and fc's 128 columns do not)."""
    from aot.codegen import gemm_render
    from aot.codegen.gemm_prologue import FACTORED_ENV
    from aot.codegen.gemm_sites import SLICED_PROLOGUE_ENV
    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
    from tests.hf import test_causal_lm

    config = test_causal_lm._config

    def wide_vocabulary(kind: str):
        cls, cfg = config(kind)
        cfg.vocab_size = 200
        return cls, cfg

    monkeypatch.setattr(test_causal_lm, "_config", wide_vocabulary)
    monkeypatch.setattr(gemm_render, "VOCAB_N", 150)
    default = _decode_build("gpt2", tmp_path_factory)
    head = _decode_build("gpt2", tmp_path_factory, {SLICED_PROLOGUE_ENV: "on", FACTORED_ENV: "head"})
    (_, kernels, plan, names), (program, head_kernels, head_plan, head_names) = map(
        _one_row_plan, (default, head)
    )
    assert names[-1].startswith("gemm_mm_vec") and "layer_norm" in names[-2], names[-3:]
    assert head_names[-1].startswith("gemm_ln_mm_vec") and head_names[-1].endswith("_factored"), head_names
    assert not any(n.endswith("_factored") for n in head_names[:-1]), head_names  # q/k/v and fc
    assert _launches(head_plan, head_kernels) == _launches(plan, kernels) - 1
    sums = {w.name for w in program.weights if w.name.endswith((SCALE_SUM, SHIFT_SUM))}
    assert "model.transformer.wte.weight" + SCALE_SUM in sums, sums
    path, _, index = head
    launched, results = interpreted_one_row_decode(path, index)
    assert sorted({r[0] for r in results}) == launched
    bad = [r for r in results if not r[3]]
    assert not bad, bad[:3]
    assert any(r[0] == launched[-1] and r[3] for r in results)  # the head's logits


@pytest.mark.slow  # a transformers GPT-2 traced and built; gemm_gpt2's forms are interpreted by default
def test_gpt2_decode_runs_fewer_kernels_per_layer(gpt2_decode):
    """GPT-2's Conv1D weights are stored [N, K] (``weight_layout``), so its decode GEMMs take the
    one-row forms; the LayerNorm kernels (with the residual adds) go into q/k/v's and fc's
    prologues, the GELU into fc's epilogue."""
    program, kernels, plan, names = _one_row_plan(gpt2_decode)
    layers = 2
    assert sum(n.startswith("gemm_ln_addmm_vec") for n in names) == layers  # q/k/v
    assert sum(n.startswith("gemm_ln_addmm_epilogue_vec") for n in names) == layers  # fc + GELU
    assert not any("tanh" in n for n in names)
    assert not any(s.target.startswith("aten.addmm") for s in plan)
    # the token and position lookups are read from their tables by the first q/k/v
    per_layer = DECODE_KERNELS_PER_LAYER["gpt2"]
    outside = _launches(program.steps, kernels) - per_layer["library"] * layers
    assert "gather_rows" not in names
    assert _launches(plan, kernels) == outside - 2 + per_layer["built-in table"] * layers


@pytest.mark.parametrize("kind, prefix", [("llama", "gemm_norm_"), ("gpt2", "gemm_ln_")])
def test_the_one_row_prologue_form_is_taken_where_a_norm_is_the_prologue(kind, prefix, request):
    """``AOTPACK_ONE_ROW_PROLOGUE`` names the one-row form of the sites whose norm the GEMV
    computes (Llama's q/k/v and gate/up, GPT-2's q/k/v and fc), over ``PROLOGUE_ROWS``'s rule
    (these tiny models' K of 32 take ``vec_1x2x512``, which it keeps); the others keep the
    table's form."""
    *_, names = _one_row_plan(request.getfixturevalue(f"{kind}_decode_four"))
    *_, default = _one_row_plan(request.getfixturevalue(f"{kind}_decode"))
    normed = [n for n in names if n.startswith(prefix)]
    # (Llama's RMSNorms applied after the products: ``gemm_prologue.FACTORED``'s default)
    assert len(normed) == 4 and all(n.removesuffix("_factored").endswith("_vec_1x4x1024") for n in normed)
    assert [n.replace("vec_1x4x1024", "vec_1x2x512") for n in names] == default


def test_the_one_row_prologue_switch_refuses_a_form_it_does_not_know(monkeypatch):
    from aot.codegen.gemm_defaults import ONE_ROW_PROLOGUE_ENV, one_row_prologue_form
    from aot.errors import CodegenError

    assert one_row_prologue_form() is None
    monkeypatch.setenv(ONE_ROW_PROLOGUE_ENV, "vec_1x4x1024")
    assert one_row_prologue_form() == "vec_1x4x1024"
    monkeypatch.setenv(ONE_ROW_PROLOGUE_ENV, "tile_64x64x128")
    with pytest.raises(CodegenError, match="vec_1x4x1024"):
        one_row_prologue_form()


@pytest.mark.slow  # the interpreter over a decode step's every kernel
@pytest.mark.parametrize(
    "kind, fused_prefix, fused",
    [
        ("llama", "gemm_norm_", 4),  # q/k/v and gate/up, 2 layers
        ("gpt2", "gemm_ln_", 4),  # q/k/v and fc
        ("llama_sliced", "gemm_norm_", 5),  # and the head, after the final norm
        ("gpt2_eight", "gemm_ln_", 4),  # eight rows of W a block where the norm is a prologue
        ("phi3", "gemm_norm_", 4),  # q/k/v and the split gate/up
        # gate/up after the post-attention norm, the add and the pre-MLP norm (two means), and
        # the second layer's q/k/v after the first's post-MLP norm, the add and its input norm
        ("gemma2", "gemm_norm_", 3),
        ("gemma3", "gemm_norm_", 3),
        # OLMo 2's post-norms with their adds: A itself stored for the residual after
        ("olmo2", "gemm_norm_", 3),
    ],
)
def test_decode_plan_matches_its_reference_in_the_interpreter(kind, fused_prefix, fused, request):
    base, _, variant = kind.partition("_")
    kind = f"{base}_decode" + (f"_{variant}" if variant else "")
    path, _, index = request.getfixturevalue(kind)
    launched, results = interpreted_one_row_decode(path, index)
    assert len({r[0] for r in results if r[1].startswith(fused_prefix)}) == fused
    # every kernel of the step against its own reference, the sums the fused forms write too: a
    # pair of sites joined at other buckets (GPT-2's o and fc: their 16-row tiles join at 2-16
    # rows, ``gemm_pairs``) runs its two one-row forms apart here, each with its site's steps
    assert sorted({r[0] for r in results}) == launched
    assert len(results) >= 15  # (fewer where ``row_sum`` joins a pair: its first kernel has no rows)
    bad = [r for r in results if not r[3]]
    assert not bad, bad[:3]


@pytest.mark.slow  # every form of three sites compiled and interpreted
def test_every_form_of_the_stacked_halves_matches_its_reference(tmp_path):
    """``gemm_rms16.py`` with every config eligible, split-K too (K = 600 gives 128-deep K steps
    two slices): the tile, skinny and split-K forms of the stacked gate/up site (both halves per
    block, the SiLU product in the epilogue, the norm kernel run first) match the library steps."""
    from aot.codegen import gemm_forms, gemm_render, generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    model = MODELS / "gemm_rms16.py"
    saved = gemm_render.CONFIGS
    gemm_render.CONFIGS = tuple(replace(c, min_m=1, max_m=1 << 62, min_k=1) for c in gemm_forms.CONFIGS)
    try:
        compiled = generate(trace(load_model_file(model)), ARCHS, gemm_candidates=True)
    finally:
        gemm_render.CONFIGS = saved
    pack(compiled, tmp_path / "all.tpk")
    gate_up = compiled.program.alternatives[0]
    names = {c.name for c in gate_up.candidates}
    assert any(n.startswith("splitk2_") for n in names) and "tile_64x64x128" in names
    (result,) = interpret_in_subprocess(
        [(tmp_path / "all.tpk", model, list(ROWS), None, True)], timeout=HANG_GUARD_S
    )
    n_cands = sum(len(s.candidates) for s in compiled.program.alternatives)
    for sizes, comparisons in result.items():
        assert len({c.name for c in comparisons if not c.name.endswith("/rerun")}) == n_cands
        bad = [c for c in comparisons if not c.ok]
        assert not bad, f"{sizes}: {bad[:3]}"


# ---------------------------------------------------------------------------------------------
# GPT-2's LayerNorm (with the residual add) and GELU around its MLP GEMMs

GPT2_MLP = MODELS / "gemm_gpt2.py"
FORMS_OF_TABLE = ("vec_1x2x512", "vec_1x1x512", "vec_1x2x1024", "vec_1x4x512")  # gemm_defaults.FORMS
PROLOGUE_FORM = "vec_1x4x1024"  # the table's at fc (K 768, its LayerNorm the prologue), offered beside


@pytest.fixture(scope="module")
def gpt2_traced():
    from aot.tracer import load_model_file, trace

    return trace(load_model_file(GPT2_MLP))


@pytest.fixture(scope="module")
def gpt2_forms(gpt2_traced, tmp_path_factory):
    """``gemm_gpt2.py`` built with every one-row form of the table as candidates: (compiled,
    bundle path)."""
    from aot.codegen import gemm_forms, generate
    from aot.packager import pack

    table = tuple(replace(c, max_m=1 << 62, min_n=0) for c in gemm_forms.CONFIGS if c.name in FORMS_OF_TABLE)
    with forms_offered(table):
        compiled = generate(gpt2_traced, ARCHS, gemm_candidates=True)
    path = tmp_path_factory.mktemp("gemm_gpt2") / "forms.tpk"
    pack(compiled, path)
    return compiled, path


def test_gpt2_layer_norm_and_gelu_run_inside_the_gemvs_by_default(gpt2_traced):
    """At one row the built-in table runs fc (K 768) as ``vec_1x4x1024_ln``: the residual add (through
    the dropout's copy) and the LayerNorm in its prologue, the sum written for the residual after
    proj, ``gelu_new`` (``x ** 3`` as products) in its epilogue; 2 launches where the library
    plan runs 5 (the LayerNorm, GELU and residual kernels, 2 cuBLAS calls)."""
    from aot.codegen import generate
    from aot.tuning import tuned_plans

    compiled = generate(gpt2_traced, ARCHS)
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    fc, proj = program.alternatives
    one_row = [c.choice for c in compiled.tuning.choices if set(c.sizes.values()) == {1}]
    assert one_row == ["vec_1x4x1024_ln", "vec_1x2x512"]
    plan = tuned_plans(compiled.tuning, 0, program, "sm_90")[(1,)]
    assert _launches(program.steps, kernels) == 5
    assert _launches(plan, kernels) == 2
    (fused,) = next(c for c in fc.candidates if c.name == "vec_1x4x1024_ln").steps
    source = kernels[fused.target].source
    assert "LayerNorm of a sum prologue" in source and "epilogue" in source and "sum_ptr" in source
    assert "rstd" in source and "tl.exp" in source and "tl.dot" not in source
    assert fused.outputs[-1] == fc.outputs[-1]  # h, which the residual after proj reads


def test_every_gpt2_one_row_form_matches_its_reference(gpt2_forms):
    """Each one-row form of the table (the vocabulary heads' one too, at these smaller N, and the
    four rows a block of a LayerNorm prologue's site), plain and ``_ln``, against the library steps it replaces
    in Triton's interpreter at one row (float16: ``aot.dtypes.TOLERANCE``); the sum h = r + x
    the ``_ln`` forms write is exact."""
    from aot.verify.interpret import interpret_in_subprocess

    compiled, path = gpt2_forms
    fc = compiled.program.alternatives[0]
    names = sorted(c.name for c in fc.candidates)
    forms = (*FORMS_OF_TABLE, PROLOGUE_FORM)
    assert names == sorted([*forms, *(f + "_ln" for f in forms)])
    (result,) = interpret_in_subprocess([(path, GPT2_MLP, [{"batch": 1}], None, True)], timeout=HANG_GUARD_S)
    n_cands = sum(len(s.candidates) for s in compiled.program.alternatives)
    for sizes, comparisons in result.items():
        assert len({c.name for c in comparisons if not c.name.endswith("/rerun")}) == n_cands
        bad = [c for c in comparisons if not c.ok]
        assert not bad, f"{sizes}: {bad[:3]}"
        sums = [c for c in comparisons if c.name.endswith("_ln") and c.output == fc.outputs[-1]]
        assert len(sums) == len(forms) and all(c.max_abs_error == 0.0 for c in sums)


@pytest.mark.slow  # two more interpreter runs
def test_a_wrong_gelu_power_or_layer_norm_is_caught(gpt2_forms, tmp_path):
    compiled, _ = gpt2_forms
    model = GPT2_MLP
    fc = compiled.program.alternatives[0]
    cand = next(c for c in fc.candidates if c.name == "vec_1x2x512_ln")
    kernel = cand.steps[-1].target
    source = next(k.source for k in compiled.program.kernels if k.id == kernel)
    cube = next(line.split(" = ", 1)[1] for line in source.splitlines() if " * acc0 * acc0" in line)
    for old, new in [(cube, cube.replace(" * acc0 * acc0", " * acc0", 1)), ("(var + 1e-05)", "(var + 1.0)")]:
        failed = failing_candidates(compiled, model, kernel, old, new, {"batch": 1}, tmp_path / "bad.tpk")
        assert failed == {f"{fc.id}/{cand.name}"}, old


def test_a_layer_norm_of_a_sum_of_three_rows_keeps_its_kernel(tmp_path):
    """A parallel block's next LayerNorm reads attention + MLP + residual: its kernel adds three
    rows, and the LayerNorm prologue of the one-row forms adds two. The projection after it takes
    no ``_ln`` form there (a form that read the kernel's partial sum made a bundle every load
    refused: "reads 'add_...' before it is written"); the bundle opens and computes the model."""
    import torch

    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import example_inputs, instantiate, load_model_file, trace

    model = MODELS / "gemm_ln_parallel.py"
    spec = load_model_file(model)
    compiled = generate(trace(spec), ARCHS)
    proj = compiled.program.alternatives[-1]
    assert proj.candidates and not [c.name for c in proj.candidates if c.name.endswith("_ln")], proj
    assert [c.name for c in compiled.program.alternatives[0].candidates if c.name.endswith("_ln")]  # ln_a's
    path = tmp_path / "parallel.tpk"
    pack(compiled, path)
    runner = load(path)
    module = instantiate(spec)
    for batch in (1, 5):
        inputs = example_inputs(spec, {"batch": batch}, seed=batch)
        with torch.no_grad():
            want = module(**inputs)
        for got, w in zip(runner(**inputs), want):  # float16: the same ATen ops as eager on the CPU
            torch.testing.assert_close(got, w, atol=1e-2, rtol=1e-2)


@pytest.mark.slow  # 8000 programs in the interpreter
def test_a_vocabulary_head_of_short_k_runs_four_rows_of_w_per_block(tmp_path):
    """The built-in table runs a vocabulary head of short K (N >= ``VOCAB_N``, K <= ``SHORT_K``:
    GPT-2's LM head) at one row as ``vec_1x4x512``, with the LayerNorm before it in its prologue;
    a head below ``VOCAB_N`` runs what any site of its K runs. It matches the library steps it replaces in
    Triton's interpreter (W's 32003 rows padded to 32064 by the build, the logits a slice)."""
    from aot.codegen import generate
    from aot.codegen.gemm_defaults import VOCAB_N, default_site_forms
    from aot.codegen.gemm_sites import find_sites
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    model = MODELS / "gemm_vocab_head.py"
    compiled = generate(trace(load_model_file(model)), ARCHS)
    (head,) = compiled.program.alternatives
    assert head.n == 32064  # padded (aot.codegen.weight_padding)
    assert sorted(c.name for c in head.candidates) == ["fewe_16x64x128", "vec_1x4x512_ln"]  # 8 rows: few-row
    assert {c.choice for c in compiled.tuning.choices if c.sizes == {"batch": 1}} == {"vec_1x4x512_ln"}
    (site,) = find_sites(compiled.program)
    assert default_site_forms(replace(site, n=VOCAB_N - 1))[0] == "vec_1x2x512_ln"  # K 64: as any site
    path = tmp_path / "head.tpk"
    pack(compiled, path)
    (result,) = interpret_in_subprocess([(path, model, [{"batch": 1}], None, True)], timeout=HANG_GUARD_S)
    (comparisons,) = result.values()
    assert f"{head.id}/vec_1x4x512_ln" in {c.name for c in comparisons}, comparisons
    bad = [c for c in comparisons if not c.ok]
    assert not bad, bad[:3]


def test_the_sliced_prologue_switch_reads_on_off_and_refuses_the_rest(monkeypatch):
    """``AOTPACK_SLICED_PROLOGUE`` (for measuring): ``on`` finds a norm prologue through a slice
    that keeps every value, unset or ``off`` does not, anything else is a ``CodegenError`` naming
    the values it takes."""
    from aot.codegen.gemm_sites import SLICED_PROLOGUE_ENV, through_slices
    from aot.errors import CodegenError

    monkeypatch.delenv(SLICED_PROLOGUE_ENV, raising=False)
    assert not through_slices()
    for text, expected in (("on", True), (" on ", True), ("off", False)):
        monkeypatch.setenv(SLICED_PROLOGUE_ENV, text)
        assert through_slices() is expected
    monkeypatch.setenv(SLICED_PROLOGUE_ENV, "no")
    with pytest.raises(CodegenError, match="expected 'on'.*or 'off'"):
        through_slices()
