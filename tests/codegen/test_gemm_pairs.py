"""Two GEMM sites joined where a row norm sits between them (``aot.codegen.gemm_pairs``): in a
default build (unless ``AOTPACK_REDUCE_NORM=off``) the split-K reduce of the first runs the norm
the second has as its prologue, at the buckets where the second runs its plain form after the
norm kernel; the norm kernel's launch goes. Checked with RMSNorm (``gemm_models/gemm_reduce_norm.py``) and
LayerNorm (``gemm_reduce_ln.py``), float16, against the library steps in Triton's interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.codegen import gemm_pairs
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)


def _plans(compiled) -> dict[int, list[str]]:
    """Bucket (batch) -> the kernels its default plan launches, in order."""
    from aot.schema import StepKind
    from aot.tuning import tuned_plans

    program = compiled.program
    kernels = {k.id: k.name for k in program.kernels}
    plans = tuned_plans(compiled.tuning, 0, program, ARCHS[0])
    return {
        key[0]: [kernels[s.target] for s in plan if s.kind == StepKind.KERNEL] for key, plan in plans.items()
    }


def _build(model: str, env: str | None = None):
    """``model`` built with ``AOTPACK_REDUCE_NORM=env``; None: unset (the default)."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    with pytest.MonkeyPatch.context() as mp:
        if env is None:
            mp.delenv(gemm_pairs.ENV, raising=False)
        else:
            mp.setenv(gemm_pairs.ENV, env)
        return generate(trace(load_model_file(MODELS / model)), ARCHS)


def test_the_reduce_runs_the_norm_at_the_buckets_of_plain_forms():
    """``gemm_reduce_norm.py`` (a down projection's shape, then the norm and a projection): at 8
    and 32 rows the first runs in K slices and the second its swapped form after the norm kernel;
    joined, the reduce runs the norm and the norm kernel goes (one launch fewer); at one row the
    norm is the GEMV's prologue, as without, its residual added by the GEMV before."""
    compiled = _build("gemm_reduce_norm.py")
    separate = _build("gemm_reduce_norm.py", "off")
    (site,) = compiled.program.alternatives  # the two sites as one
    first, second = separate.program.alternatives
    # the first's steps have a hole (A's view before its GEMM), which stays outside the pair
    assert len(first.library) < first.library[-1] - first.library[0] + 1
    assert site.library == (*first.library, *second.library)
    assert {c.name for c in site.candidates} == {
        "vec_1x2x1024__vec_1x2x1024_rms",
        "fews_splitk4_16x64x128__fews_splitk8_16x64x64",
        "fews_splitk4_32x64x128__fews_splitk8_32x64x64",
    }
    plans = _plans(compiled)
    apart = _plans(separate)
    # (the RMSNorm applied after the GEMV's products: ``gemm_prologue.FACTORED``'s default); joined,
    # the first GEMV adds the residual and writes the sum the norm reads (``row_sum``)
    assert apart[1] == ["gemm_mm_vec_1x2x1024", "gemm_norm_mm_vec_1x2x1024_factored"]
    assert plans[1] == ["gemm_mm_vec_1x2x1024_sum", "gemm_norm_mm_vec_1x2x1024_factored"]
    for rows, tile in ((8, "16"), (32, "32")):
        assert apart[rows] == [
            f"gemm_mm_fews_splitk4_{tile}x64x128_partial",
            f"gemm_mm_fews_splitk4_{tile}x64x128_reduce",
            "fused_add_cast_pow_mean_etc",
            f"gemm_mm_fews_splitk8_{tile}x64x64_partial",
            f"gemm_mm_fews_splitk8_{tile}x64x64_reduce",
        ]
        assert plans[rows] == [
            f"gemm_mm_fews_splitk4_{tile}x64x128_partial",
            f"gemm_mm_fews_splitk4_{tile}x64x128_reduce_norm",
            f"gemm_mm_fews_splitk8_{tile}x64x64_partial",
            f"gemm_mm_fews_splitk8_{tile}x64x64_reduce",
        ]


def test_the_reduce_runs_a_layer_norm():
    """``gemm_reduce_ln.py`` (GPT-2's MLP down projection, the next ``ln_1`` and q/k/v, with
    biases): at 8 and 32 rows the first runs in K slices and the second its plain form after the
    add + LayerNorm kernel; by default the reduce runs the LayerNorm and that kernel goes; at one
    row the LayerNorm is the GEMV's prologue, as without (``row_sum`` joins before RMSNorms
    alone by default). ``AOTPACK_REDUCE_NORM=rms`` (row norms only) keeps these sites apart, as
    ``off`` does."""
    compiled = _build("gemm_reduce_ln.py")
    separate = _build("gemm_reduce_ln.py", "rms")
    assert len(separate.program.alternatives) == 2
    assert _plans(_build("gemm_reduce_ln.py", "off")) == _plans(separate)
    (site,) = compiled.program.alternatives
    first, second = separate.program.alternatives
    assert site.library == (*first.library, *second.library)
    plans = _plans(compiled)
    apart = _plans(separate)
    # K 768: the LayerNorm's GEMV on four rows of W a block (gemm_defaults.PROLOGUE_ROWS)
    # (and at 8 rows the small form with W early at K 768: gemm_defaults.SMALL_EARLY)
    assert plans[1] == apart[1] == ["gemm_addmm_vec_1x1x512", "gemm_ln_addmm_vec_1x4x1024"]
    for rows, tile, form in ((8, "16", "gemve_16x32x128"), (32, "32", "tile_64x32x128")):
        split = f"gemm_addmm_fews_splitk8_{tile}x64x64"
        assert apart[rows] == [
            f"{split}_partial",
            f"{split}_reduce",
            "fused_add_layer_norm",
            f"gemm_addmm_{form}",
        ]
        assert plans[rows] == [f"{split}_partial", f"{split}_reduce_norm", f"gemm_addmm_{form}"]


def test_sites_stay_apart_without_a_norm_between_them():
    """``gemm_long_k16.py`` (a residual add, no norm, between its GEMMs) has no pair to join."""
    from aot.codegen.gemm_sites import find_sites
    from aot.tracer import load_model_file, trace

    program = trace(load_model_file(MODELS / "gemm_long_k16.py")).program
    assert len(find_sites(program)) == 3
    assert gemm_pairs.find_pairs(program, find_sites(program)) == []


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemm_reduce_norm_small.py", "gemm_reduce_ln_small.py"])
def test_the_joined_forms_match_in_the_interpreter(tmp_path, model):
    """``gemm_reduce_norm_small.py`` (RMSNorm) and ``gemm_reduce_ln_small.py`` (LayerNorm, with
    biases) joined (the default; rows of 640: the norm in one chunk of 1024 columns, ragged): each candidate, the reduce that runs the norm in both, against the library
    steps (the first GEMM, the residual add and the norm, the second GEMM) in Triton's
    interpreter at 3 rows (the bucket of 8, padded) and 20 (of 32): the second GEMM's output and
    the residual sum the norm writes within float16's tolerance (``aot.dtypes.TOLERANCE``), and
    bit for bit from run to run."""
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    compiled = _build(model)
    plans = _plans(compiled)
    assert [sum(n.endswith("_reduce_norm") for n in plans[rows]) for rows in (8, 32)] == [1, 1], plans
    assert not any(n.startswith("fused_") for names in plans.values() for n in names), plans
    pack(compiled, tmp_path / "small.tpk")
    (result,) = interpret_in_subprocess(
        [
            (
                tmp_path / "small.tpk",
                MODELS / model,
                [{"batch": 3}, {"batch": 20}],
                None,
                True,
            )
        ],
        timeout=HANG_GUARD_S,
    )
    assert len(result) == 2
    (site,) = compiled.program.alternatives
    for comparisons in result.values():
        assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
        names = {(c.name, c.output) for c in comparisons}
        for cand in site.candidates:
            for out in site.outputs:
                assert (f"{site.id}/{cand.name}", out) in names and (
                    f"{site.id}/{cand.name}/rerun",
                    out,
                ) in names


def test_biases_loaded_before_the_wait_match_in_the_interpreter(tmp_path):
    """``gemm_render.EARLY_BIAS`` (the default since it was timed on an H200): the forms whose
    indices come before the wait for the kernel before load their biases there too.
    ``gemm_bias_small.py`` (both GEMMs with a bias) built with the sites apart: at one row both
    GEMVs, at 8 rows the first's split-K reduce and the second's small form with W early
    (``gemm_defaults.SMALL_EARLY``, K 768), take the bias before the wait; every candidate matches the library steps in
    Triton's interpreter at 1 and 3 rows within float16's tolerance."""
    from aot.codegen import gemm_render
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    assert gemm_render.EARLY_BIAS
    compiled = _build("gemm_bias_small.py", "off")
    early = []
    for k in compiled.program.kernels:
        if k.config.get("kind") == "gemm" and "b0_ptr" in k.source:
            before, _, after = k.source.partition("    if GDC:")
            if "b0_e = tl.load(b0_ptr" in before:
                early.append(k.name)
                assert "tl.load(b0_ptr" not in after and "acc0 + b0_e" in after, k.name
            else:
                assert "tl.dot" in k.source and "acc0 + tl.load(b0_ptr" in after, k.name
    assert len(early) == 4 and sum(n.endswith("_reduce") for n in early) == 1, early
    pack(compiled, tmp_path / "bias.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "bias.tpk", MODELS / "gemm_bias_small.py", [{"batch": 1}, {"batch": 3}], None, True)],
        timeout=HANG_GUARD_S,
    )
    assert len(result) == 2
    (site, second) = compiled.program.alternatives
    checked = {c.name for cs in result.values() for c in cs}
    assert {f"{s.id}/{c.name}" for s in (site, second) for c in s.candidates} <= checked, checked
    assert all(c.ok for cs in result.values() for c in cs), [
        c for cs in result.values() for c in cs if not c.ok
    ][:3]


@pytest.mark.parametrize("early", ["off", "on", pytest.param("unheld", marks=pytest.mark.slow)])
def test_the_sliced_tiles_of_33_to_128_rows_run_the_next_layer_norm(early, tmp_path, monkeypatch):
    """``gemm_reduce_ln_many.py`` (buckets 64 and 128), a default build (``AOTPACK_MANY_ROWS``
    "split"): the first GEMM (K 2048, N 640) in K slices of the 64-row tile
    (``tilem_splitk5_64x32x128``: 20 column tiles, 5 slices), the second (K 640) on the 64-row
    tile, joined: the slices' reduce runs the add + LayerNorm and that kernel goes; with "short"
    the first keeps the library (K 2048) and the second runs its tile after the add + LayerNorm
    kernel. ``AOTPACK_MANY_ROWS_EARLY``: ``tileme_`` forms (W's first K step
    before the wait), with ``gemm_render.HOLD_EARLY_A`` (the default: the first step's A tile
    loaded after the wait, where the kernel waits, and its product after the loop from
    registers; the interpreter runs the plain load after the loop); "unheld": those with
    ``AOTPACK_HOLD_EARLY_A=off`` (A's tile loaded after the loop everywhere). Every kernel matches the
    library steps in Triton's interpreter at 100 rows (the bucket of 128, padded) within
    float16's tolerance, and bit for bit from run to run."""
    from aot.codegen import gemm_render
    from aot.codegen.gemm_defaults import MANY_ROWS_EARLY_ENV, MANY_ROWS_ENV
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    tile = "tilem_" if early == "off" else "tileme_"
    monkeypatch.setenv(MANY_ROWS_EARLY_ENV, "off" if early == "off" else "on")
    monkeypatch.setenv(gemm_render.HOLD_EARLY_A_ENV, "off" if early == "unheld" else "on")
    monkeypatch.setenv(MANY_ROWS_ENV, "short")
    short = _plans(_build("gemm_reduce_ln_many.py"))
    assert short == {rows: ["fused_add_layer_norm", f"gemm_addmm_{tile}64x32x128"] for rows in (64, 128)}
    monkeypatch.delenv(MANY_ROWS_ENV, raising=False)
    compiled = _build("gemm_reduce_ln_many.py")
    (site,) = compiled.program.alternatives
    split = f"{tile}splitk5_64x32x128"
    assert {c.name: c.buckets for c in site.candidates} == {
        f"{split}__{tile}64x32x128": ({"batch": 64}, {"batch": 128})
    }
    plans = _plans(compiled)
    for rows in (64, 128):
        assert plans[rows] == [
            f"gemm_addmm_{split}_partial",
            f"gemm_addmm_{split}_reduce_norm",
            f"gemm_addmm_{tile}64x32x128",
        ], plans
    kernels = {k.id: k for k in compiled.program.kernels}
    tiles = [
        kernels[s.target].source for s in site.candidates[0].steps if "_reduce" not in kernels[s.target].name
    ]
    assert len(tiles) == 2
    for source in tiles:  # the partial kernel and the second GEMM's tile
        held = "a_e0 = tl.load(" in source
        assert held == (early == "on")
        if held:  # loaded after the wait, before the loop; taken after it
            wait, load, loop = (
                source.index(t) for t in ("gdc_wait()", "a_e0 = tl.load(", "for k0 in range(")
            )
            assert wait < load < loop < source.index("[a_e0], dtype=tl.float16")
    pack(compiled, tmp_path / "many.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "many.tpk", MODELS / "gemm_reduce_ln_many.py", [{"batch": 100}], None, True)],
        timeout=HANG_GUARD_S,
    )
    (comparisons,) = result.values()
    assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    names = {(c.name, c.output) for c in comparisons}
    (cand,) = site.candidates
    for out in site.outputs:
        assert {(f"{site.id}/{cand.name}", out), (f"{site.id}/{cand.name}/rerun", out)} <= names


@pytest.mark.parametrize(
    "model, tiles, sizes",
    [
        ("gemm_tile_ln_many.py", {64: "tileme_64x32x128", 128: "tileme_64x32x128"}, [{"batch": 100}]),
        ("gemm_tile_ln_few.py", {8: "gemve_16x32x128", 32: "tile_64x32x128"}, [{"batch": 5}, {"batch": 20}]),
    ],
)
def test_two_tiles_join_through_the_first_tiles_row_statistics(model, tiles, sizes, tmp_path, monkeypatch):
    """Two GEMMs on tensor-core tiles without K slices, a residual add + LayerNorm between them
    (GPT-2's o projection, ``ln_2`` and fc): at 33-128 rows (``gemm_tile_ln_many.py``) the
    64-row tiles, at 8 rows the 16-row tile, at 32 ``BUILT_IN_32``'s (``gemm_tile_ln_few.py``).
    With ``AOTPACK_TILE_STATS=on`` the first tile writes the residual sum, the sum times the
    LayerNorm's scale and its rows' statistics over its 20 column tiles; the second multiplies
    the scaled sum's rows and applies the LayerNorm after its products, with the column sums
    the build computed (``norm_sums``, checked against W @ scale and W @ shift): the add +
    LayerNorm kernel goes. Off, the kernel stays and the bundle holds no sums; by default ("few":
    ``gemm_pairs.TILE_STATS``) only the 16-row tiles join. Every kernel matches the library steps
    in Triton's interpreter at rows between the buckets (padded) within float16's tolerance, and
    bit for bit from run to run."""
    import torch

    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
    from aot.loader import weights_read
    from aot.packager import pack
    from aot.tracer import norm_scales
    from aot.verify.interpret import interpret_in_subprocess

    # the LayerNorm as exported, its scale and shift its own (folded into W: test_norm_scales.py)
    monkeypatch.setenv(norm_scales.ENV, "rms")
    monkeypatch.setenv(gemm_pairs.TILE_STATS_ENV, "off")
    separate = _build(model)
    apart, apart_weights = _plans(separate), {w.name for w in separate.program.weights}
    assert apart == {
        rows: [f"gemm_addmm_{t}", "fused_add_layer_norm", f"gemm_addmm_{t}"] for rows, t in tiles.items()
    }
    monkeypatch.delenv(gemm_pairs.TILE_STATS_ENV)  # the default: the 16-row tiles alone join
    default = _plans(_build(model))
    assert default == {
        rows: [f"gemm_addmm_{t}_stats", f"gemm_ln_addmm_{t}_from_stats"]
        if t.startswith(("gemv_16x", "gemve_16x"))
        else apart[rows]
        for rows, t in tiles.items()
    }
    monkeypatch.setenv(gemm_pairs.TILE_STATS_ENV, "on")
    compiled = _build(model)
    (site,) = compiled.program.alternatives
    expected = {}
    for rows, t in tiles.items():
        expected.setdefault(f"{t}__{t}", []).append({"batch": rows})
    assert {c.name: list(c.buckets) for c in site.candidates} == expected
    assert _plans(compiled) == {
        rows: [f"gemm_addmm_{t}_stats", f"gemm_ln_addmm_{t}_from_stats"] for rows, t in tiles.items()
    }
    # the LayerNorm's column sums with the second's W, computed by the build (norm_sums), fp32
    weights = compiled.traced.weights
    w, scale, shift = (weights[n].float() for n in ("proj.weight", "norm.weight", "norm.bias"))
    torch.testing.assert_close(weights["proj.weight" + SCALE_SUM], w @ scale, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights["proj.weight" + SHIFT_SUM], w @ shift, rtol=1e-6, atol=1e-6)
    assert not {n for n in apart_weights if n.endswith((SCALE_SUM, SHIFT_SUM))}  # off: none held
    # only the joined candidate reads them: a GPU's loader keeps them, a CPU's copies none
    sums = {"proj.weight" + SCALE_SUM, "proj.weight" + SHIFT_SUM}
    assert sums <= weights_read((compiled.program,), candidates=True)
    assert not sums & weights_read((compiled.program,))
    stats = {b: spec.shape for b, spec in compiled.program.buffers.items() if b.endswith("_stats")}
    # per column tile of 32 (640 columns): each row's sum and squared deviations
    assert stats == {f"{site.id}_{t}_stats": ("20", "2", "batch") for t in tiles.values()}
    pack(compiled, tmp_path / "tiles.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "tiles.tpk", MODELS / model, sizes, None, True)],
        timeout=HANG_GUARD_S,
    )
    comparisons = [c for per_size in result.values() for c in per_size]
    assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    names = {(c.name, c.output) for c in comparisons}
    for cand in site.candidates:
        for out in site.outputs:
            assert {(f"{site.id}/{cand.name}", out), (f"{site.id}/{cand.name}/rerun", out)} <= names


def test_column_sums_only_where_one_layer_norm_precedes_every_use_of_the_weight(monkeypatch):
    """``norm_sums``: a weight read by GEMMs after two different LayerNorms gets no column sums
    (named by the weight, one pair could not serve both), one after a single LayerNorm does, with
    its values W @ scale and W @ shift in fp32; the pass leaves the program's steps as they are."""
    import torch
    from torch import nn

    from aot import Dim, Input, ModelSpec
    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM, add_layer_norm_sums
    from aot.tracer import norm_scales, trace

    monkeypatch.setenv(norm_scales.ENV, "rms")  # the LayerNorms keep their scales and shifts

    class TwoNorms(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.LayerNorm(64), nn.LayerNorm(64)
            self.shared, self.alone = nn.Linear(64, 32), nn.Linear(64, 16)

        def forward(self, x):  # x: [B, 64]
            return self.shared(self.a(x)) + self.shared(self.b(x)), self.alone(self.b(x))

    batch = Dim("batch", 1, 8)
    traced = trace(ModelSpec(module=TwoNorms, inputs=[Input("x", (batch, 64))], dtype="float32"))
    program, weights, gemms = add_layer_norm_sums(traced.program, dict(traced.weights))
    added = {w.name for w in program.weights} - {w.name for w in traced.program.weights}
    assert gemms == 1 and added == {"alone.weight" + SCALE_SUM, "alone.weight" + SHIFT_SUM}, added
    w = weights["alone.weight"].float()
    torch.testing.assert_close(weights["alone.weight" + SCALE_SUM], w @ weights["b.weight"].float())
    torch.testing.assert_close(weights["alone.weight" + SHIFT_SUM], w @ weights["b.bias"].float())
    assert program.steps == traced.program.steps


def test_a_bundle_holds_the_column_sums_its_forms_read_and_no_others(tmp_path):
    """A transformers GPT-2 (128 wide, two layers, float16) built as a causal LM at batch buckets
    1 and 8: its decode step at 8 rows and its prompts of 2-16 rows join the 16-row tiles through
    their statistics (``TILE_STATS`` "few"), each fc and the second layer's q/k/v (after the first
    fc2's tile) reading their LayerNorm's column sums. The bundle holds those sums, for every
    program that reads them, and no others (the first q/k/v's after the embedding, the head's:
    computed, then dropped by ``norm_sums.drop_unread_sums``); a build whose weights lost a sum
    a form reads is refused at packing (a GPU would fail to load it where a CPU would not)."""
    from dataclasses import replace

    from tests.realmodels.conftest import require

    require("transformers")  # (its import of torchvision's fake ops mended first: tests.realmodels)
    import transformers as tf

    from aot.codegen import generate
    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
    from aot.errors import CodegenError
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import norm_scales, trace

    cfg = tf.GPT2Config(
        n_embd=128, n_layer=2, n_head=2, n_positions=64, vocab_size=96, bos_token_id=None, eos_token_id=None
    )
    spec = causal_lm(
        lambda: tf.GPT2LMHeadModel(cfg), max_batch=8, max_context=64, dtype="float16", batch_buckets=(1, 8)
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(gemm_pairs.TILE_STATS_ENV, raising=False)
        mp.setenv(norm_scales.ENV, "rms")  # the LayerNorms keep their scales and shifts
        compiled = generate(trace(spec), ARCHS)
    decode = next(p for p in compiled.program.variants if p.inputs[0].spec.shape[1:] == ("1",))
    names = {k.id: k.name for k in decode.kernels}
    from aot.tuning import tuned_plans

    index = 1 + compiled.program.variants.index(decode)
    plan = tuned_plans(compiled.tuning, index, decode, ARCHS[0])[(8,)]
    assert sum(names.get(s.target, "").endswith("_from_stats") for s in plan) == 3
    layer = "model.transformer.h.{}.{}.weight.nk"
    summed = {layer.format(0, "mlp.c_fc"), layer.format(1, "attn.c_attn"), layer.format(1, "mlp.c_fc")}
    held = {n for n in compiled.traced.weights if n.endswith((SCALE_SUM, SHIFT_SUM))}
    assert held == {w + s for w in summed for s in (SCALE_SUM, SHIFT_SUM)}
    for program in (compiled.program, *compiled.program.variants):
        assert {w.name for w in program.weights if w.name.endswith((SCALE_SUM, SHIFT_SUM))} <= held
    pack(compiled, tmp_path / "lm.tpk")
    lost = layer.format(1, "mlp.c_fc") + SHIFT_SUM
    weights = {n: t for n, t in compiled.traced.weights.items() if n != lost}
    with pytest.raises(CodegenError, match="reads weights the bundle would not hold"):
        pack(replace(compiled, traced=replace(compiled.traced, weights=weights)), tmp_path / "bad.tpk")


def test_a_row_norm_joins_two_tiles_through_the_first_tiles_sums_of_squares(tmp_path, monkeypatch):
    """An o projection on the 16-row tile, the residual add and Llama's RMSNorm, then the stacked
    gate/up on the swapped form with SiLU(gate) * up (``gemm_tile_rms.py``, 8 and 16 rows): in
    bfloat16, by default (``gemm_pairs.ROW_NORM_STATS`` "on", ``TILE_STATS`` "few"), the o tile writes the residual sum, the sum times
    the norm's weight and each row's sum of squares over its 32 columns; gate/up's K loop reads
    the scaled rows as stored and multiplies its products by 1/rms from those 32 sums (an
    RMSNorm's statistic factors out of A, no column sums needed). The norm kernel goes. With
    ``AOTPACK_TILE_STATS_ROW_NORM=off``, with ``TILE_STATS`` off, or in float16 (x * g may pass its range where the normed row does not: ``ONE_PASS_DTYPES``), it
    stays. Triton's interpreter computes bfloat16's ``tl.dot`` wrongly, so the model is float16
    and the join is let in for it here (the GPU checks bfloat16:
    ``test_decode_plan_joins_o_and_gate_up_at_8_rows_and_verifies``): both kernels match the
    library at 5 and 8 rows (float16's tolerance), and repeat bit for bit."""
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    tile, swapped = "gemve_16x32x128", "fews_16x64x128"
    norm = "fused_add_cast_pow_mean_etc"
    apart = {r: [f"gemm_mm_{tile}", norm, f"gemm_halves_epilogue_{swapped}"] for r in (8, 16)}
    monkeypatch.delenv(gemm_pairs.TILE_STATS_ENV, raising=False)
    monkeypatch.setattr(gemm_pairs, "ONE_PASS_DTYPES", ("bfloat16", "float16"))
    monkeypatch.setenv(gemm_pairs.ROW_NORM_STATS_ENV, "off")
    assert _plans(_build("gemm_tile_rms.py")) == apart  # switched off: apart
    monkeypatch.delenv(gemm_pairs.ROW_NORM_STATS_ENV)  # the default: joined (below)
    monkeypatch.setattr(gemm_pairs, "ONE_PASS_DTYPES", ("bfloat16",))
    assert _plans(_build("gemm_tile_rms.py")) == apart  # float16: apart
    monkeypatch.setattr(gemm_pairs, "ONE_PASS_DTYPES", ("bfloat16", "float16"))
    monkeypatch.setenv(gemm_pairs.TILE_STATS_ENV, "off")
    assert _plans(_build("gemm_tile_rms.py")) == apart
    monkeypatch.delenv(gemm_pairs.TILE_STATS_ENV)
    compiled = _build("gemm_tile_rms.py")
    joined = [f"gemm_mm_{tile}_stats", f"gemm_norm_halves_epilogue_{swapped}_from_stats"]
    assert _plans(compiled) == {8: joined, 16: joined}
    (site,) = compiled.program.alternatives
    stats = {b: spec.shape for b, spec in compiled.program.buffers.items() if b.endswith("_stats")}
    assert stats == {f"{site.id}_{tile}_stats": ("32", "1", "batch")}  # 1024 columns, tiles of 32
    pack(compiled, tmp_path / "rms.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "rms.tpk", MODELS / "gemm_tile_rms.py", [{"batch": 5}, {"batch": 8}], None, True)],
        timeout=HANG_GUARD_S,
    )
    comparisons = [c for per_size in result.values() for c in per_size]
    assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    (cand,) = site.candidates
    names = {(c.name, c.output) for c in comparisons}
    for out in site.outputs:  # the SiLU product and h
        assert {(f"{site.id}/{cand.name}", out), (f"{site.id}/{cand.name}/rerun", out)} <= names


def test_the_small_form_loads_w_early_at_short_k():
    """``gemm_defaults.SMALL_EARLY`` "short" (the default): the built-in small form of 2-16 rows
    loads W's first two K steps before the wait (``gemve_16x32x128``) where K is at most
    SMALL_EARLY_MAX_K (768: GPT-2's q/k/v, o, fc), else ``gemv_16x32x128`` (the example mlp's up
    at K 1024, Llama-3.2-1B's o at 2048); "on" at every small site, "off" at none."""
    from aot.codegen import gemm_defaults
    from aot.codegen.gemm_defaults import default_form

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(gemm_defaults.SMALL_EARLY_ENV, raising=False)
        assert [default_form(r, 768, "float16", n=768) for r in (2, 8, 16)] == ["gemve_16x32x128"] * 3
        assert default_form(8, 1024, "float16", n=1024) == "gemv_16x32x128"
        assert default_form(8, 2048, "bfloat16", n=2048) == "gemv_16x32x128"
        assert default_form(17, 768, "float16", n=768) != "gemve_16x32x128"  # 17-32 rows: a tile
        mp.setenv(gemm_defaults.SMALL_EARLY_ENV, "on")
        assert default_form(8, 2048, "bfloat16", n=2048) == "gemve_16x32x128"
        mp.setenv(gemm_defaults.SMALL_EARLY_ENV, "off")
        assert default_form(8, 768, "float16", n=768) == "gemv_16x32x128"


@pytest.mark.slow  # three builds and the interpreter
def test_the_small_form_loads_w_early_and_joins(tmp_path, monkeypatch):
    """The built-in small form of 2-16 rows at K 768 is ``gemve_16x32x128`` (SMALL_EARLY "short",
    the default): W's first two K steps loaded before the wait for the kernel before and nothing
    else; the LayerNorm statistics join takes it as it takes ``gemv_16x32x128``
    (``gemm_tile_ln_few.py``: GPT-2's o, ``ln_2`` and fc at 8 rows, the plain form where
    ``AOTPACK_SMALL_EARLY=off``), 32 rows keep their tile. Both joined kernels match the library in
    Triton's interpreter at 5 rows (float16's tolerance), and bit for bit from run to run."""
    from aot.codegen import gemm_defaults
    from aot.errors import CodegenError
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    monkeypatch.setenv(gemm_defaults.SMALL_EARLY_ENV, "off")
    plain = _plans(_build("gemm_tile_ln_few.py"))
    assert plain[8] == ["gemm_addmm_gemv_16x32x128_stats", "gemm_ln_addmm_gemv_16x32x128_from_stats"]
    monkeypatch.delenv(gemm_defaults.SMALL_EARLY_ENV, raising=False)
    compiled = _build("gemm_tile_ln_few.py")
    plans = _plans(compiled)
    assert plans == {**plain, 8: [name.replace("_gemv_", "_gemve_") for name in plain[8]]}
    sources = {k.name: k.source for k in compiled.program.kernels}
    for name in plans[8]:
        head = sources[name].split("@triton.jit")[1].split("if GDC:")[0]
        loads = sorted(ln.strip().split(" =")[0] for ln in head.splitlines() if "tl.load(" in ln)
        assert [ln for ln in loads if ln.startswith("w0_")] == ["w0_e0", "w0_e1"], head
        # weights only (W's tiles, the bias, the column sums): nothing a kernel before writes
        assert not any(p in head for p in ("a_ptr +", "x_ptr +", "sum_ptr +", "stats_ptr +")), head
    monkeypatch.setenv(gemm_defaults.SMALL_EARLY_ENV, "nope")
    with pytest.raises(CodegenError, match="AOTPACK_SMALL_EARLY"):
        _build("gemm_tile_ln_few.py")
    (site,) = compiled.program.alternatives
    pack(compiled, tmp_path / "early.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "early.tpk", MODELS / "gemm_tile_ln_few.py", [{"batch": 5}], None, True)],
        timeout=HANG_GUARD_S,
    )
    comparisons = [c for per_size in result.values() for c in per_size]
    assert not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    names = {(c.name, c.output) for c in comparisons}
    (cand,) = [c for c in site.candidates if "gemve_" in c.name]
    for out in site.outputs:
        assert {(f"{site.id}/{cand.name}", out), (f"{site.id}/{cand.name}/rerun", out)} <= names


def test_the_second_tile_combines_the_statistics_after_its_k_loop(monkeypatch):
    """By default (``gemm_stats.STATS_AFTER_LOOP``) the second tile of a join loads the first's
    statistics before its K loop and combines them after it, so its first copies of A and W do
    not wait for them; ``AOTPACK_STATS_AFTER_LOOP=off`` combines them before the loop (the older
    form). Both joins: a LayerNorm's mean and 1/std (``gemm_tile_ln_few.py``), an RMSNorm's sum of
    squares (``gemm_tile_rms.py``). Compiled for sm_90, the default runs fewer instructions and
    block barriers after the wait before the loop's first copy (``bench/sass_waves.py``), none of
    them at the LayerNorm's tile. The interpreter tests above run the default."""
    from aot.codegen import gemm_stats
    from bench.sass_waves import before_first_copy, sass

    monkeypatch.delenv(gemm_pairs.TILE_STATS_ENV, raising=False)  # the default: 16-row tiles join
    monkeypatch.setattr(gemm_pairs, "ONE_PASS_DTYPES", ("bfloat16", "float16"))  # as above
    for model, combine in (
        ("gemm_tile_ln_few.py", "mean = tl.sum(t_sum"),
        ("gemm_tile_rms.py", "s_sum = tl.sum(t_sum"),
    ):
        copies = {}
        for after in (None, "off"):
            if after is None:
                monkeypatch.delenv(gemm_stats.STATS_AFTER_LOOP_ENV, raising=False)
            else:
                monkeypatch.setenv(gemm_stats.STATS_AFTER_LOOP_ENV, after)
            compiled = _build(model)
            joined = [k for k in compiled.program.kernels if k.name.endswith("_from_stats")]
            assert joined, model
            for kernel in joined:
                lines = [line.strip() for line in kernel.source.splitlines()]
                load = next(i for i, line in enumerate(lines) if line.startswith("t_sum = tl.load("))
                loop = next(i for i, line in enumerate(lines) if line.startswith("for k0 in range("))
                (stat,) = [i for i, line in enumerate(lines) if line.startswith(combine)]
                assert load < loop, model
                assert (stat > loop) if after is None else (load < stat < loop), (model, after)
                copy = before_first_copy(sass(compiled.cubins[(kernel.id, "sm_90")]))
                assert copy is not None, (kernel.name, after)  # a tensor-core loop's copies
                copies[kernel.name, after] = copy
        for (name, after), copy in copies.items():
            if after is None:
                older = copies[name, "off"]
                assert copy[0] < older[0] and copy[1] < older[1], (name, copy, older)
                assert copy[1] == 0 or "norm" in name, (name, copy)  # the RMSNorm form: its early W step


@pytest.mark.slow  # one more interpreter run
def test_a_row_norm_join_without_its_statistic_is_caught(tmp_path, monkeypatch):
    from tests.codegen.conftest import failing_candidates

    monkeypatch.delenv(gemm_pairs.TILE_STATS_ENV, raising=False)
    monkeypatch.delenv(gemm_pairs.ROW_NORM_STATS_ENV, raising=False)  # the default: joined
    monkeypatch.setattr(gemm_pairs, "ONE_PASS_DTYPES", ("bfloat16", "float16"))  # as above
    compiled = _build("gemm_tile_rms.py")
    (site,) = compiled.program.alternatives
    (cand,) = site.candidates
    kernel = cand.steps[-1].target
    source = next(k.source for k in compiled.program.kernels if k.id == kernel)
    line = next(ln for ln in source.splitlines() if ln.strip().startswith("acc0 = acc0 * ("))
    failed = failing_candidates(
        compiled,
        MODELS / "gemm_tile_rms.py",
        kernel,
        line,
        line.split(" = ")[0] + " = acc0",
        {"batch": 5},
        tmp_path / "bad.tpk",
    )
    assert failed == {f"{site.id}/{cand.name}"}


def test_a_layer_norm_folded_into_w_joins_two_tiles_through_ws_row_sums(tmp_path, monkeypatch):
    """``gemm_tile_ln_few.py`` with its LayerNorm's scale and shift folded into the projection
    after it (``tracer.norm_scales``, ``AOTPACK_FOLD_NORM_SCALES=on``): the two tiles still join
    through the first's row statistics at 8 and 32 rows (``AOTPACK_TILE_STATS=on``), the first now
    storing the residual sum alone (no scaled copy), the second reading the build's column sums of
    W as folded: u its row sums, and no c (the shift is in the projection's bias). Both kernels
    match the library in Triton's interpreter at 5 and 20 rows (padded), and repeat bit for bit."""
    import torch

    from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
    from aot.packager import pack
    from aot.tracer import norm_scales
    from aot.tracer.folding import FOLDED_PREFIX
    from aot.verify.interpret import interpret_in_subprocess

    monkeypatch.setenv(norm_scales.ENV, "on")
    monkeypatch.setenv(gemm_pairs.TILE_STATS_ENV, "on")
    compiled = _build("gemm_tile_ln_few.py")
    tiles = {8: "gemve_16x32x128", 32: "tile_64x32x128"}
    assert _plans(compiled) == {
        rows: [f"gemm_addmm_{t}_stats", f"gemm_ln_addmm_{t}_from_stats"] for rows, t in tiles.items()
    }
    (layer_norm,) = [s for s in compiled.traced.program.steps if s.target == "aten.native_layer_norm.default"]
    assert layer_norm.args[2] is None and layer_norm.args[3] is None
    weights = compiled.traced.weights
    (u,) = [n for n in weights if n.endswith((SCALE_SUM, SHIFT_SUM))]
    assert u.startswith(FOLDED_PREFIX) and u.endswith(SCALE_SUM), u
    w = weights[u[: -len(SCALE_SUM)]].float()
    torch.testing.assert_close(weights[u], w.sum(1), rtol=1e-6, atol=1e-6)
    assert not [b for b in compiled.program.buffers if b.endswith("_scaled")]
    pack(compiled, tmp_path / "folded.tpk")
    (result,) = interpret_in_subprocess(
        [
            (
                tmp_path / "folded.tpk",
                MODELS / "gemm_tile_ln_few.py",
                [{"batch": 5}, {"batch": 20}],
                None,
                True,
            )
        ],
        timeout=HANG_GUARD_S,
    )
    comparisons = [c for per_size in result.values() for c in per_size]
    assert comparisons and not [c for c in comparisons if not c.ok], [c for c in comparisons if not c.ok][:3]
    (site,) = compiled.program.alternatives
    checked = {c.name for c in comparisons}
    assert {f"{site.id}/{c.name}" for c in site.candidates} <= checked
    assert {f"{site.id}/{c.name}/rerun" for c in site.candidates} <= checked
