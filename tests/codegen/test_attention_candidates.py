"""Attention candidates (``aot.codegen.flash``): the SDPA sites found, their flash-attention
kernels in Triton's interpreter against the library steps they replace (causal and not, one query
token up to the largest length, a head dim that is not a power of two; fp16 1e-2 + 1e-2·|ref|, fp32
1e-4 + 1e-4·|ref|), the sites the matcher must leave alone, and a tuning table choosing one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from aot import schema
from tests.codegen.conftest import SIZE_TIERS, failing_candidates, forms_offered, tier_sizes
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
SIZES = {
    "attn_fused": [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 37}, {"batch": 1, "seq": 96}],
    "attn_separate": [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 17}],
    "attn_hf": [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 29}],
}


def _build(path: Path, out: Path):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    compiled = generate(trace(load_model_file(path)), ARCHS, gemm_candidates=True)
    pack(compiled, out)
    return compiled


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name → (compiled, bundle, model), every attention form offered at every length, and no GEMM
    form (``tests/codegen/test_gemm.py`` checks those): the projections stay library steps."""
    from aot.codegen import flash

    saved = flash.CONFIGS
    flash.CONFIGS = tuple(replace(c, min_t=1, max_t=1 << 62) for c in flash.CONFIGS)
    try:
        base = tmp_path_factory.mktemp("attn")
        with forms_offered(()):
            out = {
                n: (_build(MODELS / f"{n}.py", base / f"{n}.tpk"), base / f"{n}.tpk", MODELS / f"{n}.py")
                for n in SIZES
            }
    finally:
        flash.CONFIGS = saved
    for name, (compiled, _, _) in out.items():  # every alternative an attention site: no GEMM form built
        assert list(compiled.program.alternatives) == _attention(compiled.program), name
    return out


def _attention(program):
    return [s for s in program.alternatives if s.id.startswith("attn_")]


def test_sites_found_with_their_operands(built):
    from aot.codegen.flash import find_attention_sites

    fused = built["attn_fused"][0].program
    (site,) = find_attention_sites(fused)
    # one QKV GEMM's [B*T, 192] rows: q, k, v at columns 0, 64, 128
    assert [(o.width, o.column) for o in (site.q, site.k, site.v)] == [(192, 0), (192, 64), (192, 128)]
    assert site.q.base == site.k.base == site.v.base
    assert (site.heads, site.head_dim, site.causal, site.scale) == (4, 16, True, 0.25)
    targets = [fused.steps[i].target for i in site.library]
    assert targets.count("aten.scaled_dot_product_attention.default") == 1
    assert "aten.split_with_sizes.default" in targets and "aten.addmm.default" not in targets
    # the site hands on the [B, T, 64] rows the output projection's view reads
    assert fused.buffers[site.outputs[0]].shape == ("batch", "seq", "64")
    (alt,) = _attention(fused)
    assert alt.id == site.id and [c.name for c in alt.candidates] == [
        "flash_16x32",
        "flash_64x64",
        "flash_128x64",
    ]
    kernels = {k.id: k for k in fused.kernels}
    source = kernels[alt.candidates[0].steps[0].target].source
    assert "causal" in source and "rn[None, :] <= rm[:, None]" in source
    # separate q, k, v projections, stacked into one GEMM by the build: column slices of its rows
    separate = built["attn_separate"][0].program
    (site,) = find_attention_sites(separate)
    assert [(o.width, o.column) for o in (site.q, site.k, site.v)] == [(216, 0), (216, 72), (216, 144)]
    assert (site.heads, site.head_dim, site.causal, site.scale) == (3, 24, False, 0.3)
    kernels = {k.id: k for k in separate.kernels}
    source = kernels[_attention(separate)[0].candidates[0].steps[0].target].source
    assert "(rd < HEAD_DIM)" in source and "input_precision='ieee'" in source
    # heads viewed with -1, and SDPA's result viewed to its own shape before the heads merge
    hf = built["attn_hf"][0].program
    (site,) = find_attention_sites(hf)
    assert [(o.width, o.column) for o in (site.q, site.k, site.v)] == [(192, 0), (192, 64), (192, 128)]
    assert (site.heads, site.head_dim, site.causal) == (4, 16, True)
    assert [hf.steps[i].target for i in site.library].count("aten.view.default") >= 4


def test_default_buckets_offer_short_and_long_forms(tmp_path):
    """Without the test's override: the 16-row form up to 128 tokens, the 64-row one from 16, the
    128-row one from 128 (gpt's seq buckets 1..1024)."""
    with forms_offered(()):  # the GEMM sites' forms are test_gemm.py's
        compiled = _build(MODELS / "attn_fused.py", tmp_path / "a.tpk")
    (alt,) = compiled.program.alternatives
    seqs = {c.name: sorted({b["seq"] for b in c.buckets}) for c in alt.candidates}
    assert seqs == {"flash_16x32": [1, 16, 96], "flash_64x64": [16, 96]}


@pytest.fixture(scope="module")
def interpreted(built, request):
    """name → {sizes: comparisons} at the sizes of the tier ``request.param`` (``SIZE_TIERS``)."""
    from aot.verify.interpret import interpret_in_subprocess

    sizes = tier_sizes(SIZES, request.param)
    names = list(SIZES)
    results = interpret_in_subprocess(
        [(built[n][1], built[n][2], sizes[n], None, True) for n in names], timeout=HANG_GUARD_S
    )
    for name, result in zip(names, results):
        assert len(result) == len(sizes[name]), f"{name}: {len(result)} sizes checked of {sizes[name]}"
    return dict(zip(names, results))


@pytest.mark.parametrize("interpreted", SIZE_TIERS, indirect=True)
@pytest.mark.parametrize("name", list(SIZES))
def test_every_attention_candidate_matches_the_library_call(interpreted, built, name):
    program = built[name][0].program
    want = {f"{s.id}/{c.name}" for s in _attention(program) for c in s.candidates}
    assert len(want) == 3
    for sizes, comparisons in interpreted[name].items():
        got = [c for c in comparisons if c.name in want]
        assert {c.name for c in got} == want, sizes
        bad = [c for c in comparisons if not c.ok]
        assert not bad, f"{name} at {sizes}: {bad[:3]}"
        assert all(c.max_abs_error < 1e-2 for c in got)


@pytest.mark.slow  # interprets a candidate twice (~70 s); the GEMM forms' own such test runs by default
def test_interpreter_catches_a_wrong_attention_kernel(built, tmp_path):
    """The same check fails when a kernel's scale is off: the comparison can fail."""
    compiled, _, model = built["attn_fused"]
    (site,) = _attention(compiled.program)
    failed = failing_candidates(
        compiled,
        model,
        site.candidates[1].steps[0].target,
        "SCALE_LOG2E = tl.constexpr(0.36",
        "SCALE_LOG2E = tl.constexpr(0.46",
        {"batch": 1, "seq": 16},  # a whole bucket, 16 keys: the least interpreter work that shows the scale
        tmp_path / "bad.tpk",
    )
    assert failed == {f"{site.id}/{site.candidates[1].name}"}


def _model(tmp_path: Path, body: str, name: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import torch\nimport torch.nn.functional as F\nfrom torch import nn\nfrom aot import Dim, Input, ModelSpec\n\n"
        "class A(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.qkv = nn.Linear(64, 192)\n"
        "    def forward(self, x):\n"
        "        B, T, C = x.shape\n"
        "        q, k, v = [t.view(B, T, 4, 16).transpose(1, 2) for t in self.qkv(x).split(64, dim=2)]\n"
        f"{body}\n"
        "batch = Dim('batch', 1, 4)\nseq = Dim('seq', 1, 32)\n"
        "spec = ModelSpec(module=A, inputs=[Input('x', (batch, seq, 64))], dtype='float16')\n"
    )
    return path


@pytest.mark.parametrize(
    "name,body",
    [
        # the keys are also an output (as a KV cache write would read them): the view must stay
        (
            "keys_out",
            "        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
            "        return y.transpose(1, 2).reshape(B, T, C), k\n",
        ),
        # a mask that reads the input: only the library call knows how to apply it
        (
            "masked",
            "        m = (x[:, None, :, :1] > 0).expand(B, 4, T, T)\n"
            "        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)\n"
            "        return y.transpose(1, 2).reshape(B, T, C)\n",
        ),
        # the heads' result read as [B, H, T, D]: no [B, T, H*D] rows to write
        ("heads_out", "        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2\n"),
    ],
)
def test_sdpa_calls_the_kernel_cannot_stand_for_are_left_alone(tmp_path, name, body):
    from aot.codegen.flash import find_attention_sites
    from aot.tracer import load_model_file, trace

    traced = trace(load_model_file(_model(tmp_path, body, name)))
    program = traced.program
    assert any(s.target == "aten.scaled_dot_product_attention.default" for s in program.steps)
    assert find_attention_sites(program) == []


def test_a_tuned_attention_choice_makes_a_sound_plan(built, tmp_path):
    """A table choosing the attention kernel passes the loader's checks; the plan launches it in
    place of the SDPA call and its views, and every read still follows its write."""
    from aot.loader import load
    from aot.loader.tuning import tuned_plans
    from aot.program import frees_after
    from aot.verify.tuning_table import make_table, write_tuned

    compiled, bundle, _ = built["attn_fused"]
    program = compiled.program
    (site,) = _attention(program)
    cand = site.candidates[0]
    choices = [
        schema.TuningChoice(0, site.id, sizes, cand.name, {"library": 6.0, cand.name: 2.0})
        for sizes in cand.buckets
    ]
    tuned = tmp_path / "tuned.tpk"
    write_tuned(bundle, tuned, make_table("sm_90", "Test GPU", choices))
    runner = load(tuned)
    plans = tuned_plans(runner.tuning, 0, runner.program, "sm_90")
    steps = plans[(1, 1)]
    targets = [s.target for s in steps]
    assert cand.steps[0].target in targets
    assert "aten.scaled_dot_product_attention.default" not in targets
    frees_after(steps, [*(w.name for w in program.weights), "x"], program.outputs)
