"""The few-row entry of the built-in GEMM table (``aot.codegen.gemm_defaults``): by default tune's
few-row tiles at small weights and ``fewe_16x64x128`` at vocabulary heads only
(``BUILT_IN_FEW_ROWS``), the library (cuBLAS) elsewhere at 2-16 rows; where ``FEW_ROWS`` names a
form of ``gemm_forms.FEW_ROW_CONFIGS`` or one of tune's tiles (``few_row_configs``; the module setting, or ``AOTPACK_FEW_ROWS`` for a build), a
half-precision GEMM site at a bucket of 2-16 rows runs that tensor-core form, as its ``_rms``
variant where an RMSNorm kernel (with the residual add in it) made A, so the norm kernel goes at
those buckets as it does at one row.

``gemm_models/gemm_rms16.py`` (float16, K = 600: the last K step partial; buckets 1 and 8), built
by default with the entry on: each site compiles its one-row form for bucket 1 and the few-row
form for bucket 8, nothing else; at 8 rows the plan runs as many kernels as at one row, three fewer
than the library plan; every form matches the library steps it replaces in Triton's interpreter at
8 rows (``aot.dtypes.TOLERANCE``, float16: 1e-2 + 1e-2·|ref|), the residual sums they write exactly;
the same for GPT-2's LayerNorm (``gemm_gpt2.py``, ``<form>_ln``) at 3 rows.
A transformers Llama (tests/hf's tiny config, float16, batch buckets 1, 2, 4, 8), built the same
way (slow): its decode plan runs the few-row forms at 2, 4 and 8 rows, and its logits and cache
writes there, every kernel run in the interpreter from the kernels' own outputs, equal the eager
model's (float16, on the CPU) within the float16 tolerance, the greedy tokens exactly (measured:
0.42-0.60 of the tolerance at worst; eager in float32 is itself 1.2 times the tolerance away from
eager in float16 at 8 rows, as are the library plan and the one-row plan).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aot import schema
from aot.codegen import gemm_defaults, row_sum
from aot.codegen.gemm_defaults import (
    FEW_ROWS_ENV,
    FEW_ROWS_PROLOGUE_ENV,
    FORMS,
    PROLOGUE_FORMS,
    default_form,
    prologue_rows,
)
from aot.errors import CodegenError
from tests.codegen.conftest import failing_candidates, interpreted_json
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
FEW = "few_16x16x256"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(FEW_ROWS_ENV, raising=False)
    monkeypatch.delenv(FEW_ROWS_PROLOGUE_ENV, raising=False)
    # the few-row forms' sites as they stand apart: the one-row join (``row_sum``) would make
    # gemm_rms16's down projection and the projection after it one site at every bucket
    monkeypatch.setenv(row_sum.ENV, "off")


def test_the_built_in_entry_takes_small_and_large_weights_and_vocabulary_heads():
    """With no form named for every site, a half-precision site at 2-16 rows runs tune's few-row
    tile where its weight is at most 8 MiB (``gemv_16x32x128``: the example mlp's up, Llama-3.2-1B's
    o projection; at K up to 768, GPT-2's q/k/v and o, with W's first steps before the wait,
    ``gemve_16x32x128``: ``gemm_defaults.SMALL_EARLY``), or where that tile makes too few blocks (N under 2048, K from
    2048: GPT-2's mlp out, the mlp's down) the swapped form in K slices, ``fewe_16x64x128``
    where its N is a vocabulary's (an LM head, at any size), and past 8 MiB the swapped forms
    (``BUILT_IN_LARGE``: Llama-3.2-1B's q/k/v in K slices, gate/up whole, down in K slices); the
    library where N is not known, and in float32."""
    assert gemm_defaults.FEW_ROWS is None and gemm_defaults.FEW_ROWS_LONG_K is None
    for rows in (2, 3, 8, 16):
        assert default_form(rows, 2048, "bfloat16") is None  # N not known
        assert default_form(rows, 768, "float16", n=2304) == "gemve_16x32x128"  # GPT-2 q/k/v
        assert default_form(rows, 3072, "float16", n=768) == "fews_splitk_16x64x64"  # its mlp out: few tiles
        assert default_form(rows, 768, "float16", n=50257) == "fewe_16x64x128"  # its LM head
        assert default_form(rows, 2048, "bfloat16", n=128256) == "fewe_16x64x128"  # Llama's
        assert (
            default_form(rows, 4096, "bfloat16", n=128256) == "fewe_16x64x128"
        )  # a vocabulary at long K too
        assert default_form(rows, 1024, "float16", n=4096) == "gemv_16x32x128"  # the mlp's up, 8 MiB
        assert default_form(rows, 4096, "float16", n=1024) == "fews_splitk_16x64x64"  # its down: few tiles
        assert default_form(rows, 768, "float16", n=768) == "gemve_16x32x128"  # GPT-2's o: short K
        assert default_form(rows, 4096, "float16", n=2048) == "fews_splitk_16x64x128"  # 16 MiB, long K
        assert default_form(rows, 2048, "bfloat16", n=2048) == "gemv_16x32x128"  # Llama-3.2-1B's o
        for k, n, form in (
            (2048, 2049, "fews_splitk_16x64x64"),  # just past 8 MiB
            (2048, 3072, "fews_splitk_16x64x64"),  # Llama-3.2-1B's q/k/v
            (2048, 16384, "fews_16x64x128"),  # its gate/up (N >= WIDE_N)
            (8192, 2048, "fews_splitk_16x64x128"),  # its down (K >= LONG_K)
        ):
            assert default_form(rows, k, "bfloat16", n=n) == form, (k, n)
        # a stacked gate/up is wide by its 2N rows of W (TinyLlama's 2 x 5632), its bytes a half's
        # against 8 MiB (Qwen3-0.6B's 2 x 3072 x 1024 keeps tune's tile)
        assert default_form(rows, 2048, "bfloat16", n=5632) == "fews_splitk_16x64x64"
        assert default_form(rows, 2048, "bfloat16", n=5632, halves=True) == "fews_16x64x128"
        assert default_form(rows, 1024, "bfloat16", n=3072, halves=True) == "gemv_16x32x128"
        assert default_form(rows, 8192, "bfloat16", n=2048, halves=True) == "fews_splitk_16x64x128"
        assert default_form(rows, 768, "float32", n=2304) is None
    for rows in (17, 24, 32):  # 17-32 rows: the swapped forms, but the tile at K below 1024
        assert default_form(rows, 768, "float16", n=2304) == "tile_64x32x128"  # GPT-2 q/k/v
        assert default_form(rows, 3072, "float16", n=768) == "fews_splitk_32x64x64"  # its mlp out
        assert default_form(rows, 768, "float16", n=50257) == "fews_32x64x128"  # its LM head
        assert default_form(rows, 4096, "float16", n=1024) == "fews_splitk_32x64x64"  # the mlp's down
        assert default_form(rows, 2048, "bfloat16", n=2048) == "fews_splitk_32x64x64"  # Llama's o
        assert default_form(rows, 768, "float16", n=768) == "tile_64x32x128"  # GPT-2's o: K < 1024
        assert default_form(rows, 1024, "float16", n=4096) == "fews_splitk_32x64x64"  # the mlp's up
        assert default_form(rows, 2048, "bfloat16", n=3072) == "fews_splitk_32x64x64"  # q/k/v, 12 MiB
        assert default_form(rows, 2048, "bfloat16", n=16384) == "fews_32x64x128"  # its gate/up
        assert default_form(rows, 2048, "bfloat16", n=8192, halves=True) == "fews_32x64x128"  # stacked
        assert default_form(rows, 2048, "bfloat16", n=5632, halves=True) == "fews_32x64x128"  # 0.58B's
        assert default_form(rows, 8192, "bfloat16", n=2048) == "fews_splitk_32x64x128"  # its down
        assert default_form(rows, 2048, "bfloat16", n=128256) == "fews_32x64x128"  # its LM head
        assert default_form(rows, 2048, "bfloat16") is None  # N not known
        assert default_form(rows, 768, "float32", n=2304) is None
    # 33-128 rows by default: a tile of 64 rows at K below 1024, in K slices at longer K where N
    # makes few tiles, else the library
    assert default_form(33, 768, "float16", n=2304) == "tileme_64x64x128"  # GPT-2's q/k/v
    assert default_form(128, 768, "float16", n=768) == "tileme_64x32x128"  # its o
    assert default_form(128, 3072, "float16", n=768) == "tileme_splitk_64x32x128"  # its mlp out
    assert default_form(64, 4096, "float16", n=1024) == "tileme_splitk_64x32x128"  # the mlp's down
    assert default_form(64, 1024, "float16", n=4096) is None  # its up: N makes tiles enough
    assert default_form(128, 2048, "bfloat16", n=2048) is None  # Llama-3.2-1B's o
    assert default_form(33, 2048, "bfloat16", n=16384) is None
    assert default_form(129, 768, "float16", n=2304) is None  # past 128 rows: the library
    held = {c.name: (c.min_m, c.max_m) for c in gemm_defaults.default_configs()}
    assert all(held[form] == (17, 32) for form in gemm_defaults.BUILT_IN_32), held
    names = {c.name for c in gemm_defaults.few_row_configs()}
    assert set(gemm_defaults.BUILT_IN_LARGE) <= names
    assert default_form(1, 2048, "bfloat16") == "vec_1x2x1024"
    assert default_form(1, 1024, "float16", n=50257) == "vec_1x4x512"  # one row: a short-K vocabulary head


def test_the_setting_and_its_override(monkeypatch):
    monkeypatch.setattr(gemm_defaults, "FEW_ROWS", "few_16x32x256")
    assert [default_form(r, 2048, "bfloat16") for r in (1, 2, 16, 17)] == [
        "vec_1x2x1024",
        "few_16x32x256",
        "few_16x32x256",
        None,
    ]
    assert default_form(8, 8192, "float16") == "few_16x32x256"  # no long-K form: the same one
    assert default_form(8, 2048, "float32") is None
    monkeypatch.setenv(FEW_ROWS_ENV, "few_16x16x512, few_splitk_16x16x512")
    assert default_form(4, 2048, "float16") == "few_16x16x512"
    assert default_form(4, 4096, "float16") == "few_splitk_16x16x512"
    monkeypatch.setenv(FEW_ROWS_ENV, "off")
    assert default_form(4, 2048, "float16") is None
    monkeypatch.setenv(FEW_ROWS_ENV, "few_16x16x1024")
    with pytest.raises(CodegenError, match="few_16x16x1024.*expected one of few_16x16x256"):
        default_form(4, 2048, "float16")
    # the third form runs at wide N (N >= WIDE_N)
    monkeypatch.setenv(FEW_ROWS_ENV, "few_16x32x256,few_splitk_16x64x128,few_16x64x128")
    assert default_form(8, 2048, "bfloat16", n=2048) == "few_16x32x256"
    assert default_form(8, 2048, "bfloat16", n=16384) == "few_16x64x128"
    assert default_form(8, 8192, "bfloat16", n=16384) == "few_splitk_16x64x128"
    monkeypatch.setenv(FEW_ROWS_ENV, "a,b,c,d")
    with pytest.raises(CodegenError, match="expected 'off' or '<form>"):
        default_form(4, 2048, "float16")
    monkeypatch.setenv(FEW_ROWS_ENV, FEW)
    monkeypatch.setenv(FEW_ROWS_PROLOGUE_ENV, "yes")
    with pytest.raises(CodegenError, match="expected '0' or '1'"):
        default_form(4, 2048, "float16")


@pytest.fixture(scope="module")
def rms16(tmp_path_factory):
    """``gemm_rms16.py`` built by default with the few-row entry on: (compiled, bundle path, the
    config names each ``render_candidates`` call was offered)."""
    from aot.codegen import gemm, generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    offered: list[tuple[str, ...]] = []
    render = gemm.render_candidates

    def recording(site, buffers, known, ranges, configs=None):
        assert configs is not None, "every GEMM form rendered in a default build"
        offered.append(tuple(c.name for c in configs))
        return render(site, buffers, known, ranges, configs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(row_sum.ENV, "off")  # as ``_no_override``
        mp.setattr(gemm_defaults, "FEW_ROWS", FEW)
        mp.setattr(gemm, "render_candidates", recording)
        compiled = generate(trace(load_model_file(MODELS / "gemm_rms16.py")), ARCHS)
    path = tmp_path_factory.mktemp("few_rows") / "rms16.tpk"
    pack(compiled, path)
    return compiled, path, offered


def _launches(steps, kernels) -> int:
    return sum(
        s.kind == schema.StepKind.KERNEL or s.target in ("aten.mm.default", "aten.addmm.default")
        for s in steps
    )


def one_row_form(k: int, prologue: bool) -> str:
    """The table's one-row form at K ``k`` (float16), where a norm is its prologue or not."""
    form = default_form(1, k, "float16")
    return prologue_rows(form, k) if prologue else form


def test_the_few_row_form_runs_at_its_buckets_only_and_absorbs_the_norms(rms16):
    from aot.tuning import tuned_plans

    compiled, _, offered = rms16
    program = compiled.program
    # only the two forms the table names were rendered (and so compiled) per site
    assert offered and all(
        set(names) <= {*FORMS, *PROLOGUE_FORMS, FEW} and len(names) <= 2 for names in offered
    )
    gate_up, down, proj = program.alternatives
    for site, prologue in ((gate_up, True), (down, False), (proj, True)):
        suffix = "_rms" if prologue else ""
        assert [(c.name, c.buckets) for c in site.candidates] == [
            (one_row_form(site.k, prologue) + suffix, ({"batch": 1},)),
            (FEW + suffix, ({"batch": 8},)),
        ]
    choices = {(c.site, c.sizes["batch"]): c.choice for c in compiled.tuning.choices}
    assert choices[(gate_up.id, 8)] == FEW + "_rms" and choices[(down.id, 8)] == FEW
    kernels = {k.id: k for k in program.kernels}
    plans = tuned_plans(compiled.tuning, 0, program, "sm_90")
    assert sorted(plans) == [(1,), (8,)]
    names = [kernels[s.target].name for s in plans[(8,)] if s.kind == schema.StepKind.KERNEL]
    assert sum(n.endswith(FEW) for n in names) == 3 and sum(n.startswith("gemm_norm_") for n in names) == 2
    assert not any("mean" in n or "sigmoid" in n for n in names), names  # the norm and SiLU kernels went
    assert _launches(plans[(8,)], kernels) == _launches(plans[(1,)], kernels)
    assert _launches(plans[(8,)], kernels) == _launches(program.steps, kernels) - 3
    source = kernels[gate_up.candidates[1].steps[0].target].source
    assert "tl.dot" in source and "s_sum +=" in source and "sum_ptr" in source


def test_the_few_row_forms_match_their_reference_in_the_interpreter(rms16):
    from aot.verify.interpret import interpret_in_subprocess

    compiled, path, _ = rms16
    program = compiled.program
    (result,) = interpret_in_subprocess(
        [(path, MODELS / "gemm_rms16.py", [{"batch": 8}], None, True)], timeout=HANG_GUARD_S
    )
    (comparisons,) = result.values()
    few = [c for c in comparisons if FEW in c.name and not c.name.endswith("/rerun")]
    assert {c.name.split("/")[1] for c in few} == {FEW, FEW + "_rms"}
    assert len({c.name for c in few}) == len(program.alternatives)
    bad = [c for c in comparisons if not c.ok]
    assert not bad, bad[:3]
    sums = {site.outputs[-1] for site in program.alternatives if len(site.outputs) == 2}
    written = [c for c in few if c.output in sums]
    assert len(written) == 2 and all(c.max_abs_error == 0.0 for c in written)  # x + r, exact in float16


@pytest.mark.slow  # the interpreter again, on a broken kernel
def test_a_wrong_few_row_norm_is_caught(rms16, tmp_path):
    compiled, _, _ = rms16
    site = compiled.program.alternatives[2]
    cand = next(c for c in site.candidates if c.name == FEW + "_rms")
    failed = failing_candidates(
        compiled,
        MODELS / "gemm_rms16.py",
        cand.steps[-1].target,
        "(s_mean + 1e-05)",
        "(s_mean + 1.0)",
        {"batch": 8},
        tmp_path / "bad.tpk",
    )
    assert failed == {f"{site.id}/{cand.name}"}


@pytest.mark.slow  # another build and interpreter run; the LayerNorm prologue of the dot forms predates them
@pytest.mark.parametrize("setting", [FEW, None])
def test_gpt2_layer_norm_runs_in_the_few_row_form_and_matches(setting, tmp_path, monkeypatch):
    """``gemm_gpt2.py`` (LayerNorm of a sum before fc, GELU after it; float16, K = 600; buckets 1,
    3, 4) with the entry on: where ``FEW_ROWS`` names a ``few_`` form, fc runs ``<few>_ln`` at 3
    and 4 rows (the sum r + x written exactly), proj the plain form; with the built-in entry (its
    weights are small) both run tune's few-row tile with W early (K 600: ``gemve_16x32x128``,
    ``gemm_defaults.SMALL_EARLY``), the LayerNorm kernel kept before fc (its K steps of 128 take no
    prologue). Every form matches its reference in the interpreter at 3
    rows."""
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.tuning import tuned_plans
    from aot.verify.interpret import interpret_in_subprocess

    model = MODELS / "gemm_gpt2.py"
    monkeypatch.setattr(gemm_defaults, "FEW_ROWS", setting)
    few_form = setting or gemm_defaults.SMALL_EARLY_FORM
    fc_form = few_form + "_ln" if setting else few_form
    compiled = generate(trace(load_model_file(model)), ARCHS)
    pack(compiled, tmp_path / "gpt2.tpk")
    fc, proj = compiled.program.alternatives
    assert {c.name: c.buckets for c in fc.candidates}[fc_form] == ({"batch": 3}, {"batch": 4})
    assert len(fc.candidates) == len(proj.candidates) == 2 and few_form in {c.name for c in proj.candidates}
    layer_norm = compiled.program.steps[fc.library[0]].reference
    if not setting:  # the LayerNorm kernel stays in front of the plain form
        kernels = {k.id: k for k in compiled.program.kernels}
        plan = tuned_plans(compiled.tuning, 0, compiled.program, "sm_90")[(3,)]
        names = [kernels[s.target].name for s in plan if s.kind == schema.StepKind.KERNEL]
        assert any("layer_norm" in n for n in names) and layer_norm, names
    (result,) = interpret_in_subprocess(
        [(tmp_path / "gpt2.tpk", model, [{"batch": 3}], None, True)], timeout=HANG_GUARD_S
    )
    (comparisons,) = result.values()
    few = [c for c in comparisons if few_form in c.name and not c.name.endswith("/rerun")]
    assert {c.name for c in few} == {f"{fc.id}/{fc_form}", f"{proj.id}/{few_form}"}
    bad = [c for c in comparisons if not c.ok]
    assert not bad, bad[:3]
    if setting:  # the _ln form writes the sum r + x for the residual after proj
        sums = [c for c in few if c.output == fc.outputs[-1]]
        assert len(sums) == 1 and sums[0].max_abs_error == 0.0


# ---------------------------------------------------------------------------------------------
# A transformers Llama's decode step at 2, 4 and 8 rows

BATCHES = (2, 4, 8)


@pytest.fixture(scope="module")
def llama_few(tmp_path_factory):
    """tests/hf's tiny Llama (2 layers, hidden 32, float16), built by default for sm_90 with the
    few-row entry on and batch buckets 1, 2, 4, 8: (bundle path, compiled, decode program index)."""
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
        factory("llama"),
        max_batch=8,
        max_context=16,
        dtype="float16",
        name="llama",
        batch_buckets=(1, *BATCHES),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(row_sum.ENV, "off")  # as ``_no_override``
        mp.setattr(gemm_defaults, "FEW_ROWS", FEW)
        compiled = generate(trace(spec), ARCHS)
    path = tmp_path_factory.mktemp("llama_few") / "llama.tpk"
    pack(compiled, path)
    programs = [compiled.program, *compiled.program.variants]
    (index,) = [
        i
        for i, p in enumerate(programs)
        if len(p.inputs[0].spec.shape) == 2 and p.inputs[0].spec.shape[1] == "1"
    ]
    return path, compiled, index


@pytest.mark.slow  # a transformers Llama traced and built
def test_llama_decode_runs_the_few_row_forms_at_2_to_8_rows(llama_few):
    from aot.tuning import tuned_plans

    _, compiled, index = llama_few
    program = [compiled.program, *compiled.program.variants][index]
    kernels = {k.id: k for k in program.kernels}
    plans = tuned_plans(compiled.tuning, index, program, "sm_90")
    assert sorted(plans) == [(1,), *((b,) for b in BATCHES)]
    layers = 2
    for b in BATCHES:
        names = [kernels[s.target].name for s in plans[(b,)] if s.kind == schema.StepKind.KERNEL]
        # per layer q/k/v, o, gate/up, down; and the LM head
        assert sum(n.endswith(FEW) for n in names) == 4 * layers + 1, names
        assert sum(n.startswith("gemm_norm_") for n in names) == 2 * layers  # q/k/v and gate/up
        assert not any(s.target in ("aten.mm.default", "aten.addmm.default") for s in plans[(b,)])
        assert _launches(plans[(b,)], kernels) == _launches(plans[(1,)], kernels)


@pytest.mark.slow  # the interpreter over a decode step's every kernel, three times
def test_llama_decode_at_2_to_8_rows_equals_eager_in_the_interpreter(llama_few):
    """The decode step at 2, 4 and 8 rows, every kernel in Triton's interpreter: eager's tokens,
    its cache writes within the float16 tolerance, and logits within it of float32's or no further
    from them than eager's own in float16 (with trained-looking norms the folded scales round in
    other places than eager: at 8 rows 0.95 of the tolerance from float32's against eager's 1.74)."""
    path, _, index = llama_few
    script = f"""
import json
import sys
from dataclasses import replace

import torch
from safetensors.torch import load

sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.realmodels.conftest import unusable

assert unusable("transformers") is None
from aot.bundle import open_bundle
from aot.buckets import buckets_by_program
from aot.hf import Decoder
from aot.schema import WEIGHTS_PATH
from aot.tuning import read_tuning, tuned_plans
from aot.verify.interpret import interpret_kernels
from tests.hf.test_causal_lm import built

b = open_bundle({str(path)!r})
main = b.program()
programs = [main, *main.variants]
table = read_tuning(b, programs, buckets_by_program(b.manifest))
weights = load(b.read(WEIGHTS_PATH))
program = programs[{index}]
plans = tuned_plans(table, {index}, program, "sm_90")
model = built("llama").to(torch.float16)  # the model as the spec builds it, in its dtype
embed = model.get_input_embeddings().weight
assert any(w.shape == embed.shape and torch.equal(w, embed) for w in weights.values())
eager = Decoder(model, 16).eval()
exact = Decoder(built("llama"), 16).eval()  # float32: what both float16 computations approximate
out = []
for batch in {BATCHES!r}:
    g = torch.Generator().manual_seed(batch)
    inputs = {{
        "input_ids": torch.randint(1, 96, (batch, 1), generator=g),
        "position_ids": torch.randint(5, 9, (batch, 1), generator=g),
        "cache_position": torch.tensor([5]),
        "attention_mask": (torch.arange(16) <= 5).to(torch.int64)[None].repeat(batch, 1),
    }}
    for t in program.inputs:
        if t.name.startswith(("key_cache", "value_cache")):
            shape = [batch, *(int(d) for d in t.spec.shape[1:])]
            inputs[t.name] = (0.5 * torch.randn(shape, generator=g)).to(torch.float16)
    state = {{k: v.clone() for k, v in inputs.items() if k.startswith(("key_cache", "value_cache"))}}
    env = {{}}
    fused = replace(program, steps=plans[(batch,)])
    results = interpret_kernels(fused, weights, {{k: v.clone() for k, v in inputs.items()}}, {{"batch": batch}}, from_kernels=env)
    plain = {{k: v for k, v in inputs.items() if k not in state}}
    with torch.no_grad():
        truth = exact(**plain, **{{k: v.float() for k, v in state.items()}}).float()
        want = eager(**plain, **state)
    got = env[program.outputs[0]].float()
    want = want.float()
    tol = (1e-2, 1e-2)  # aot.dtypes.TOLERANCE["float16"]
    def worst(a, b):
        return ((a - b).abs() / (tol[0] + tol[1] * b.abs())).max().item()
    kernels = {{k.id: k.name for k in program.kernels}}
    ran = sorted({{kernels[s.target] for s in fused.steps if s.kind.value == "kernel"}})
    out.append({{
        "batch": batch,
        "logits": worst(got, truth),
        "eager_logits": worst(want, truth),
        "cache": max(worst(env[k].float(), state[k].float()) for k in state),
        "tokens_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
        "bad": [r.name for r in results if not r.ok],
        "kernels": ran,
        "shape": list(got.shape),
    }})
print(json.dumps(out))
"""
    results = interpreted_json(script)
    assert [r["batch"] for r in results] == list(BATCHES)
    for r in results:
        assert r["shape"] == [r["batch"], 96]
        assert any(n.endswith(FEW) for n in r["kernels"]), r["kernels"]
        # the logits within the float16 tolerance of float32's, or no further from them than eager's
        # own float16 logits (the folded norm scales round elsewhere than eager does)
        assert r["logits"] <= max(1.0, r["eager_logits"]) and r["cache"] <= 1.0, r
        assert r["tokens_equal"] and not r["bad"], r


# ---------------------------------------------------------------------------------------------
# The dot-free forms of a few rows (``vecm_``: each row of A summed apart, W loaded once per block)


@pytest.mark.parametrize(
    "form",
    [
        "vecm_8x4x256",
        pytest.param("vecm_8x2x512", marks=pytest.mark.slow),
        pytest.param("vecm_4x4x256", marks=pytest.mark.slow),
    ],
)
def test_the_dot_free_few_row_forms_match_in_the_interpreter(form, tmp_path, monkeypatch):
    """Named by ``AOTPACK_FEW_ROWS``, a ``vecm_`` form runs every half-precision GEMM site at the
    buckets of 2 to its BLOCK_M rows, plain (the norm kernel before it kept: it has no prologue
    form), with its epilogue: ``gemm_rms16.py``'s stacked gate/up with SiLU·mul, down, and the
    projection after an RMSNorm kernel (K = 600: the last K step partial) at 8 rows where the form
    takes 8, and ``gemm_gpt2.py``'s fc with GELU after the LayerNorm kernel, and proj, at 3 rows
    (rows of the block past M masked). Every form matches the library steps it replaces in
    Triton's interpreter (``aot.dtypes.TOLERANCE``, float16)."""
    from aot.codegen import generate
    from aot.codegen.gemm_forms import VECM_CONFIGS
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    (cfg,) = [c for c in VECM_CONFIGS if c.name == form]
    monkeypatch.setenv(FEW_ROWS_ENV, form)
    jobs = []
    for name, rows in (("gemm_rms16", 8), ("gemm_gpt2", 3)):
        if rows > cfg.max_m:
            continue
        model = MODELS / f"{name}.py"
        compiled = generate(trace(load_model_file(model)), ARCHS)
        for site in compiled.program.alternatives:
            at = [c for c in site.candidates if {"batch": rows} in c.buckets]
            assert [c.name for c in at] == [form], (site.id, [(c.name, c.buckets) for c in site.candidates])
            (kernel,) = [s.target for s in at[0].steps if s.kind == schema.StepKind.KERNEL][-1:]
            source = next(k.source for k in compiled.program.kernels if k.id == kernel)
            assert "tl.dot" not in source and f"part0_{cfg.block_m - 1} +=" in source
        pack(compiled, tmp_path / f"{name}.tpk")
        jobs.append((tmp_path / f"{name}.tpk", model, [{"batch": rows}], None, True))
    results = interpret_in_subprocess(jobs, timeout=HANG_GUARD_S)
    assert len(results) == len(jobs) >= 1
    for result in results:
        (comparisons,) = result.values()
        assert any(form in c.name for c in comparisons), comparisons
        bad = [c for c in comparisons if not c.ok]
        assert not bad, bad[:3]


# ---------------------------------------------------------------------------------------------
# The swapped few-row forms (``fews_``: W's rows on the product's wide side, C^T = W @ A^T)

# (model, the forms AOTPACK_FEW_ROWS names: every site, K >= LONG_K, N >= WIDE_N)
MODELS_FEWS = (
    ("gemm_rms16", "fews_16x64x64"),
    ("gemm_long_k16", ",".join(gemm_defaults.BUILT_IN_LARGE)),
)


def test_the_swapped_few_row_forms_match_in_the_interpreter(tmp_path, monkeypatch):
    """The ``fews_`` forms (named by ``AOTPACK_FEW_ROWS``) at every half-precision GEMM site at 8
    rows: ``gemm_rms16.py``'s stacked gate/up with SiLU·mul, down, and the projection (K = 600:
    the last K step partial; N = 600 and 48: the last W tile partial), the RMSNorm kernels kept
    before them (no ``_rms`` forms); ``gemm_long_k16.py`` on the built-in entry's large-weight
    forms: K = 4096 on the split-K form with the residual add, K = 1024 on the K-sliced form of
    middle K, each with the second kernel that sums its slices (K = 96: the library, too short
    for either). Every kernel turns the product
    around (W's tile @ A^T loaded as such) and matches the library steps it replaces in
    Triton's interpreter (``aot.dtypes.TOLERANCE``, float16)."""
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    jobs, expected = [], {}
    for name, forms in MODELS_FEWS:
        monkeypatch.setenv(FEW_ROWS_ENV, forms)
        model = MODELS / f"{name}.py"
        compiled = generate(trace(load_model_file(model)), ARCHS)
        kernels = {k.id: k for k in compiled.program.kernels}
        for site in compiled.program.alternatives:
            at8 = [c for c in site.candidates if {"batch": 8} in c.buckets]
            if not at8:
                assert name == "gemm_long_k16" and site.k == 96, site.id  # no form that short
                continue
            (cand,) = at8
            steps = [kernels[s.target] for s in cand.steps if s.kind == schema.StepKind.KERNEL]
            sources = [k.source for k in steps if k.name.startswith("gemm_")]  # a norm kernel may come first
            first = sources[0]
            assert "tl.dot(w0_e0, a_t" in first and "tl.trans(acc0)" in first, cand.name
            expected[(name, f"{site.id}/{cand.name}")] = len(sources)
        pack(compiled, tmp_path / f"{name}.tpk")
        jobs.append((tmp_path / f"{name}.tpk", model, [{"batch": 8}], None, True))
    assert sorted(n.split("/")[1] for _, n in expected) == [
        "fews_16x64x64",
        "fews_16x64x64",
        "fews_16x64x64",
        "fews_splitk8_16x64x128",
        "fews_splitk8_16x64x64",
    ], expected
    assert all(count == 2 for (_, n), count in expected.items() if "splitk" in n)  # slices, then their sum
    results = interpret_in_subprocess(jobs, timeout=HANG_GUARD_S)
    assert len(results) == len(jobs)
    for (name, _), result in zip(MODELS_FEWS, results):
        (comparisons,) = result.values()
        bad = [c for c in comparisons if not c.ok]
        assert not bad, bad[:3]
        compared = {c.name.removesuffix("/rerun") for c in comparisons}
        assert {n for m, n in expected if m == name} <= compared, (name, compared)


@pytest.mark.parametrize("early", ["off", "on"])
def test_the_forms_for_17_to_32_rows_match_in_the_interpreter(early, tmp_path, monkeypatch):
    """``gemm_rows32.py`` built by default (buckets 1, 8 and 32): at 32 rows the built-in entry's
    forms for 17-32 rows (``BUILT_IN_32``): the swapped form of 32 rows (A's rows on the product's
    narrow side) in K slices at K = 4096 (the residual add in the kernel that sums the slices) and
    K = 1024, ``tile_64x32x128`` at K = 96 (with ``AOTPACK_ROWS32_EARLY=on`` ``tilee_64x32x128``,
    W's first K step before the wait); at 8 rows the 2-16-row forms. Every kernel
    matches the library steps it replaces in Triton's interpreter at 20 rows (the bucket of 32
    padded) (``aot.dtypes.TOLERANCE``, float16)."""
    from aot.codegen import generate
    from aot.codegen.gemm_defaults import ROWS32_EARLY_ENV
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    monkeypatch.setenv(ROWS32_EARLY_ENV, early)
    tile = "tilee_64x32x128" if early == "on" else "tile_64x32x128"
    model = MODELS / "gemm_rows32.py"
    compiled = generate(trace(load_model_file(model)), ARCHS)
    forms = {}
    for site in compiled.program.alternatives:
        for cand in site.candidates:
            for sizes in cand.buckets:
                forms[(site.k, sizes["batch"])] = cand.name
    assert forms == {
        (4096, 1): "vec_1x2x1024",
        (4096, 8): "fews_splitk8_16x64x64",  # a small site of long K (SMALL_SLICED)
        (4096, 32): "fews_splitk8_32x64x64",  # few tiles, long K
        (1024, 1): "vec_1x2x512",
        (1024, 8): "gemv_16x32x128",
        (1024, 32): "fews_splitk8_32x64x64",
        (96, 1): "vec_1x2x512",
        (96, 8): "gemve_16x32x128",  # K at most 768: W early (SMALL_EARLY)
        (96, 32): tile,
    }, forms
    pack(compiled, tmp_path / "rows32.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "rows32.tpk", model, [{"batch": 20}], None, True)], timeout=HANG_GUARD_S
    )
    for comparisons in result.values():
        assert not [c for c in comparisons if not c.ok], comparisons
        compared = {c.name.removesuffix("/rerun") for c in comparisons}
        assert {
            "gemm_0/fews_splitk8_32x64x64",
            f"gemm_1/{tile}",
            "gemm_2/fews_splitk8_32x64x64",
        } <= compared


@pytest.mark.parametrize("early", ["off", "on"])
def test_the_tiles_for_33_to_128_rows_match_in_the_interpreter(early, tmp_path, monkeypatch):
    """``gemm_rows128.py`` (buckets 64 and 128): by default (``MANY_ROWS`` "split") a tile held to
    33-128 rows (``gemm_forms.MANY_ROW_TILES``), ``tilem_64x64x128`` at K = 96 (N 2048), and at
    K = 4096 (N 96: few column tiles) the narrow tile in 8 K slices, the site of K = 1024 and N 2048
    on the library ("short": the first only); with ``AOTPACK_MANY_ROWS=on`` ``tilem_64x32x128``
    at K = 4096 and 1024 too; a weight past 8 MiB and a vocabulary head keep the library; "off"
    the library everywhere, a bad value a CodegenError. ``AOTPACK_MANY_ROWS_EARLY=on``: the
    ``tileme_`` forms (W's first K step before the wait). Built "on", every kernel matches the
    library steps it replaces in Triton's interpreter at 100 rows (the bucket of 128 padded)
    (``aot.dtypes.TOLERANCE``, float16)."""
    from aot.codegen import generate
    from aot.codegen.gemm_defaults import MANY_ROWS_EARLY_ENV, MANY_ROWS_ENV
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    def forms_of(compiled) -> dict:
        return {
            (site.k, site.n, sizes["batch"]): cand.name
            for site in compiled.program.alternatives
            for cand in site.candidates
            for sizes in cand.buckets
        }

    tile = "tileme_" if early == "on" else "tilem_"
    model = MODELS / "gemm_rows128.py"
    traced = trace(load_model_file(model))
    monkeypatch.delenv(MANY_ROWS_ENV, raising=False)
    monkeypatch.setenv(MANY_ROWS_EARLY_ENV, early)
    whole = {(96, 2048, 64): tile + "64x64x128", (96, 2048, 128): tile + "64x64x128"}
    sliced = {(4096, 96, 64): tile + "splitk8_64x32x128", (4096, 96, 128): tile + "splitk8_64x32x128"}
    assert forms_of(generate(traced, ARCHS)) == whole | sliced
    monkeypatch.setenv(MANY_ROWS_ENV, "short")
    assert forms_of(generate(traced, ARCHS)) == whole
    monkeypatch.setenv(MANY_ROWS_ENV, "off")
    assert default_form(128, 96, "float16", n=2048) is None
    monkeypatch.setenv(MANY_ROWS_ENV, "32")
    with pytest.raises(CodegenError, match="expected 'on', 'split', 'short' or 'off'"):
        default_form(128, 96, "float16", n=2048)
    monkeypatch.setenv(MANY_ROWS_ENV, "split")
    assert default_form(128, 4096, "float16", n=96) == tile + "splitk_64x32x128"  # K-sliced
    assert default_form(128, 1024, "float16", n=4096) is None  # many columns: the library
    assert default_form(128, 96, "float16", n=2048) == tile + "64x64x128"  # short K: whole
    monkeypatch.setenv(MANY_ROWS_ENV, "on")
    assert default_form(128, 768, "float16", n=50257) is None  # a vocabulary head: the library
    assert default_form(128, 4096, "float16", n=2048) is None  # 16 MiB: the library
    with monkeypatch.context() as m:
        m.setenv(MANY_ROWS_EARLY_ENV, "1")
        with pytest.raises(CodegenError, match="expected 'on' or 'off'"):
            default_form(128, 96, "float16", n=2048)
    compiled = generate(traced, ARCHS)
    forms = forms_of(compiled)
    assert {key: form for key, form in forms.items() if key[2] == 128} == {
        (4096, 96, 128): tile + "64x32x128",
        (96, 2048, 128): tile + "64x64x128",
        (1024, 2048, 128): tile + "64x32x128",
    }, forms
    pack(compiled, tmp_path / "rows128.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "rows128.tpk", model, [{"batch": 100}], None, True)], timeout=HANG_GUARD_S
    )
    for comparisons in result.values():
        assert not [c for c in comparisons if not c.ok], comparisons
        compared = {c.name.removesuffix("/rerun") for c in comparisons}
        sites = {site.id for site in compiled.program.alternatives}
        assert {n.split("/")[0] for n in compared if f"/{tile}" in n} == sites, compared


def test_a_stacked_gate_up_takes_the_whole_swapped_form_by_its_rows(monkeypatch):
    """``gemm_halves16.py``'s stacked gate/up (N 4608 a half, 9216 rows of W, 9 MiB a half): a
    default build renders the one-row form and the whole swapped form for its buckets, not the
    K-sliced one that N alone would take (and that measured 23-58% slower at 2 x 5632 and
    2 x 4864 rows on an H200: ``gemm_defaults.BUILT_IN_LARGE``). (Rendering is recorded, not
    compiled.)"""
    from aot.codegen import gemm, generate
    from aot.tracer import load_model_file, trace

    offered: list[tuple] = []

    def recording(site, buffers, known, ranges, configs=None):
        offered.append((site.n, site.halves, tuple(c.name for c in configs or ())))
        return []

    monkeypatch.setattr(gemm, "render_candidates", recording)
    generate(trace(load_model_file(MODELS / "gemm_halves16.py")), ARCHS)
    assert offered == [(4608, True, ("vec_1x2x512", "fews_16x64x128"))]


def test_a_candidates_build_offers_tune_the_built_in_large_weight_form(monkeypatch):
    """A ``--gemm-candidates`` build renders, for a site the built-in entry gives a swapped form
    (``gemm_wide16.py``: 12 MiB), CONFIGS and that form, so that ``aotpack tune`` chooses among
    the forms a default build would run too; for a vocabulary head (``gemm_vocab_head.py``)
    CONFIGS and ``fewe_16x64x128``; for a small site (``gemm_rms16.py``, K 600) CONFIGS and the
    small form with W early (``gemm_defaults.SMALL_EARLY``), and at its norm-prologue sites the
    one-row form of four rows a block (``PROLOGUE_ROWS``); the forms
    for 17-32 rows where a bucket takes them (``gemm_rows32.py``). (Rendering is recorded, not
    compiled.)"""
    from aot.codegen import gemm, generate
    from aot.codegen.gemm_forms import CONFIGS
    from aot.tracer import load_model_file, trace

    offered: list[tuple[str, ...]] = []

    def recording(site, buffers, known, ranges, configs=None):
        offered.append(tuple(c.name for c in (CONFIGS if configs is None else configs)))
        return []

    monkeypatch.setattr(gemm, "render_candidates", recording)
    plain = tuple(c.name for c in CONFIGS)
    generate(trace(load_model_file(MODELS / "gemm_wide16.py")), ARCHS, gemm_candidates=True)
    assert offered == [(*plain, "fews_splitk_16x64x64")]
    offered.clear()
    generate(trace(load_model_file(MODELS / "gemm_rms16.py")), ARCHS, gemm_candidates=True)
    # and, where the norm is the prologue (gate/up, the projection after; K 600), four rows a block
    early = "gemve_16x32x128"
    expected = [(*plain, early), (*plain, "vec_1x4x1024", early), (*plain, "vec_1x4x1024", early)]
    assert sorted(offered) == sorted(expected)
    offered.clear()  # a vocabulary head: the built-in entry's fewe_ form at 2-16 rows
    generate(trace(load_model_file(MODELS / "gemm_vocab_head.py")), ARCHS, gemm_candidates=True)
    assert offered == [(*plain, "fewe_16x64x128")]
    offered.clear()  # buckets 1, 8 and 32: the forms for 17-32 rows beside those for 2-16
    generate(trace(load_model_file(MODELS / "gemm_rows32.py")), ARCHS, gemm_candidates=True)
    assert offered == [
        (*plain, "fews_splitk_16x64x64", "fews_splitk_32x64x64"),  # K 4096, N 96
        (*plain, "gemve_16x32x128"),  # K 96: W early at 8 rows, the tile of CONFIGS at 32
        (*plain, "fews_splitk_32x64x64"),  # K 1024
    ], offered
