"""GEMM candidates (``aot.codegen.gemm``), their alternatives in the bundle, the tuning table and
the plans it makes (``aot.loader.tuning``), and ``aotpack tune`` without a GPU.

Every candidate of the pattern models in ``gemm_models/`` runs in Triton's interpreter
against the library steps it replaces at M = 1 and 3, the tensor-core forms at M = 37 too (fp16:
1e-2 + 1e-2·|ref|, fp32: 1e-4 + 1e-4·|ref|, ``aot.dtypes.TOLERANCE``); split-K forms run twice
more and must agree bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from aot import schema, serde
from aot.errors import BundleError, EnvError
from tests.codegen.conftest import SIZE_TIERS, failing_candidates, forms_offered, tier_sizes
from tests.conftest import HANG_GUARD_S, run_aotpack

MODELS = Path(__file__).resolve().parent / "gemm_models"  # apart from the fusion pattern models
ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("sm_90",)
# Every candidate is checked at these rows: one, and a few (each row a block of its own in the
# one-row forms, a ragged tile of the tensor-core forms).
ROWS = (1, 3)
# The tensor-core forms are checked at this many rows too (slow run): row tiles of 16, the last one
# ragged. The one-row forms are not: a block per row runs the same code at any row count (3 rows
# above), and at 16 and 37 rows their 1,700 blocks a row took the interpreter over 20 minutes.
TILE_ROWS = 37


# The forms the default run builds for each small model and checks in the interpreter: one of each
# family (one-row, one-row split-K, skinny, skinny split-K, tile, split-K tile; the default
# table's other one-row forms are checked by tests/codegen/test_gemm_norm.py). The slow tests
# build and check every form: at K = 4096 (the forms built only there)
# (test_long_k_candidates_match_in_the_interpreter) and with the LayerNorm prologue
# (test_every_form_takes_the_prologue).
FAMILIES = (
    "vec_1x2x512",
    "splitk_1x8x512",
    "gemv_16x16x256",
    "splitk_16x16x256",
    "tile_16x64x128",
    "splitk_16x64x128",
)


def _all_configs(every: bool = False):
    """The configs of ``FAMILIES`` (``every``: every config), eligible at every bucket and site
    (a vocabulary head's form too), so each form is built and checked in the tests."""
    from aot.codegen import gemm_forms

    return tuple(
        replace(c, min_m=1, max_m=1 << 62, min_n=0) for c in gemm_forms.CONFIGS if every or c.name in FAMILIES
    )


def _build(path: Path, out: Path, gemm_candidates: bool = True, stack_siblings: bool = True):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    traced = trace(load_model_file(path))
    compiled = generate(traced, ARCHS, gemm_candidates=gemm_candidates, stack_siblings=stack_siblings)
    pack(compiled, out)
    return compiled


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name → (compiled, bundle path, model path), built with every config eligible."""
    with forms_offered(_all_configs()):
        base = tmp_path_factory.mktemp("gemm")
        out = {}
        for name in ("gemm_mlp", "gemm_mlp32", "gemm_swiglu", "gemm_acts", "gemm_ln", "gemm_conv1d"):
            model = MODELS / f"{name}.py"
            # the dual-GEMM models keep their siblings apart (--keep-siblings), or they would be stacked
            apart = name in ("gemm_swiglu", "gemm_acts")
            compiled = _build(model, base / f"{name}.tpk", stack_siblings=not apart)
            out[name] = (compiled, base / f"{name}.tpk", model)
        return out


SIZES = {  # every candidate (the default run: the first size)
    "gemm_mlp": [{"batch": m} for m in ROWS],
    "gemm_mlp32": [{"batch": m} for m in ROWS],
    "gemm_acts": [{"batch": m} for m in ROWS],
    "gemm_swiglu": [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 3}],  # 6 rows of 2 sequences
    "gemm_ln": [{"batch": m} for m in ROWS],
    "gemm_conv1d": [{"batch": m} for m in ROWS],
}
# the tensor-core candidates alone, in the slow run (16 rows, one whole tile, is checked at 37's
# first tiles)
TILE_SIZES = {name: [{"batch": TILE_ROWS}] for name in SIZES}
TILE_SIZES["gemm_swiglu"] = [{"batch": TILE_ROWS, "seq": 1}]


def _one_row(program, candidate) -> bool:
    """Whether ``candidate`` is a one-row form: its GEMM kernel a block per row of A (a plain form
    at a prologue's site runs the program's norm kernel first)."""
    configs = {k.id: k.config for k in program.kernels}
    gemm = next(configs[s.target] for s in candidate.steps if configs[s.target]["kind"] == "gemm")
    return gemm["BLOCK_M"] == 1


def _without_one_row_forms(compiled, out: Path) -> Path:
    """``compiled`` packed to ``out`` with only its tensor-core candidates (each site has some)."""
    from aot.packager import pack

    program = compiled.program
    sites = tuple(
        replace(s, candidates=tuple(c for c in s.candidates if not _one_row(program, c)))
        for s in program.alternatives
    )
    pack(replace(compiled, program=replace(program, alternatives=sites)), out)
    return out


@pytest.fixture(scope="module")
def interpreted(built, request, tmp_path_factory):
    """name → {sizes: comparisons} at the sizes of the tier ``request.param`` (``SIZE_TIERS``):
    every candidate at ``SIZES``, and in the slow tier the tensor-core ones at ``TILE_SIZES`` too;
    all models in one interpreter process."""
    from aot.verify.interpret import interpret_in_subprocess

    sizes = tier_sizes(SIZES, request.param)
    plan = [(name, built[name][1], sizes[name]) for name in SIZES]
    if request.param == "rest":
        base = tmp_path_factory.mktemp("tiles")
        plan += [
            (name, _without_one_row_forms(built[name][0], base / f"{name}.tpk"), TILE_SIZES[name])
            for name in SIZES
        ]
    results = interpret_in_subprocess(
        [(bundle, built[name][2], s, None, True) for name, bundle, s in plan], timeout=HANG_GUARD_S
    )
    out: dict[str, dict] = {name: {} for name in SIZES}
    for (name, _, s), result in zip(plan, results):
        assert len(result) == len(s), f"{name}: {len(result)} sizes checked of {s}"
        out[name].update(result)
    return out


def test_weights_stored_k_by_n_are_transposed_or_read_as_stored(built):
    """transformers' Conv1D (``addmm(b, x, W)`` with W [K, N]): a weight read by GEMMs alone is
    stored [N, K] under a new name and read through its transpose (``weight_layout``), so its site
    gets the one-row forms too; one also read as a tensor keeps its layout, and its site's kernels
    read W [K, N] as stored (N contiguous), without the one-row forms (which stream W's rows
    along K)."""
    compiled = built["gemm_conv1d"][0]
    program, weights = compiled.program, compiled.traced.weights
    up, down = program.alternatives
    assert [program.steps[i].target for i in up.library] == [
        "aten.permute.default",
        "aten._addmm_activation.default",
    ]
    assert program.steps[up.library[0]].args[0] == schema.Buf("up.weight.nk")
    assert "up.weight" not in weights and tuple(weights["up.weight.nk"].shape) == (192, 64)
    assert weights["up.weight.nk"].is_contiguous()
    assert [program.steps[i].target for i in down.library][0] == "aten.addmm.default"
    assert tuple(weights["down.weight"].shape) == (192, 64)  # [K, N] as the model stores it
    assert (up.n, up.k, down.n, down.k) == (192, 64, 64, 192)
    kernels = {k.id: k for k in program.kernels}
    assert "vec_1x2x512" in {c.name for c in up.candidates}
    assert down.candidates and not any(c.name.startswith("vec_") for c in down.candidates)
    for site, at, layout in (
        (up, "rn[None, :] * 64 + rk[:, None]", "W[N, K]^T"),
        (down, "rk[:, None] * 64 + rn[None, :]", "W[K, N]"),
    ):
        source = kernels[site.candidates[-1].steps[-1].target].source
        assert at in source and layout in source


def test_sites_and_epilogues_found(built):
    alts = {n: built[n][0].program.alternatives for n in built}
    kinds = {n: [len(s.candidates) for s in a] for n, a in alts.items()}
    # mlp: up + GELU epilogue (a one-row GEMV, a skinny form and a tile of FAMILIES), down + bias +
    # residual (the same + split-K at K = 1024; the narrow split-K forms need K >= 2048)
    assert kinds["gemm_mlp"] == [3, 4] and kinds["gemm_mlp32"] == [3, 4]
    up, down = alts["gemm_mlp"]
    program = built["gemm_mlp"][0].program
    assert [program.steps[i].target for i in up.library][-2:] == [
        "aten.addmm.default",
        program.steps[up.library[-1]].target,
    ]
    assert program.steps[up.library[-1]].kind == schema.StepKind.KERNEL  # the GELU kernel is absorbed
    assert up.outputs == ("gelu",) and (up.n, up.k) == (1024, 64)
    assert (down.n, down.k) == (64, 1024)
    split = down.candidates[-1]
    assert split.name.startswith("splitk") and len(split.steps) == 2 and split.steps[0].reference == ()
    # swiglu: gate and up in one dual GEMM with the SiLU*up product; down with the residual
    swiglu = built["gemm_swiglu"][0].program
    gate = swiglu.alternatives[0]
    mms = [swiglu.steps[i].target for i in gate.library].count("aten.mm.default")
    assert mms == 2 and len(swiglu.alternatives) == 2
    kernels = {k.id: k for k in swiglu.kernels}
    source = kernels[gate.candidates[0].steps[-1].target].source
    assert "w1_ptr" in source and "tl.sigmoid" in source
    # acts: dual GEMM with biases; relu folded into _addmm_activation; tanh-GELU + cast epilogue
    acts = built["gemm_acts"][0].program
    targets = [[acts.steps[i].target for i in s.library] for s in acts.alternatives]
    assert targets[0].count("aten.addmm.default") == 2
    assert "aten._addmm_activation.default" in targets[1]
    assert acts.buffers[acts.alternatives[2].outputs[0]].dtype == "float32"
    # ln: each LayerNorm kernel is absorbed as its GEMM's prologue; the second one's sum (read
    # later: a model output) is written by the candidates, which read x and the down GEMM's result
    ln = built["gemm_ln"][0].program
    first, _, last = ln.alternatives
    for site in (first, last):
        head = ln.steps[site.library[0]]
        assert head.kind == schema.StepKind.KERNEL
        assert [r.target for r in head.reference][-1] == "aten.native_layer_norm.default"
    assert last.outputs[-1] in ln.outputs and len(last.outputs) == 2
    kernels = {k.id: k for k in ln.kernels}
    forms = {c.name: c for c in last.candidates}
    source = kernels[forms["gemv_16x16x256_ln"].steps[-1].target].source
    assert "LayerNorm of a sum prologue" in source and "sum_ptr" in source and "rstd" in source
    # the same configs without the prologue run the program's LayerNorm kernel first
    plain = forms["gemv_16x16x256"]
    assert plain.steps[0].target == ln.steps[last.library[0]].target and len(plain.steps) == 2
    assert "prologue" not in kernels[plain.steps[-1].target].source
    # only skinny, unsplit blocks with long K steps get the prologue form
    assert [n for n in forms if n.endswith("_ln")] == [
        "vec_1x2x512_ln",
        "gemv_16x16x256_ln",
    ]
    assert "tl.dot" not in kernels[forms["vec_1x2x512_ln"].steps[-1].target].source


@pytest.mark.parametrize("interpreted", SIZE_TIERS, indirect=True)
@pytest.mark.parametrize("name", list(SIZES))
def test_every_candidate_matches_its_reference(interpreted, built, name):
    results = interpreted[name]
    program = built[name][0].program
    every = {f"{s.id}/{c.name}" for s in program.alternatives for c in s.candidates}
    tiles = {
        f"{s.id}/{c.name}" for s in program.alternatives for c in s.candidates if not _one_row(program, c)
    }
    for sizes, comparisons in results.items():
        checked = {c.name for c in comparisons if not c.name.endswith("/rerun")}
        assert checked == (tiles if json.loads(sizes) in TILE_SIZES[name] else every), sizes
        bad = [c for c in comparisons if not c.ok]
        assert not bad, f"{name} at {sizes}: {bad[:3]}"


@pytest.mark.parametrize("interpreted", SIZE_TIERS, indirect=True)
def test_split_k_is_bit_identical_across_runs(interpreted):
    reruns = [c for r in interpreted.values() for cs in r.values() for c in cs if c.name.endswith("/rerun")]
    assert reruns and all(c.ok and c.max_abs_error == 0.0 for c in reruns)


def test_interpreter_check_can_fail(built, tmp_path):
    """A candidate whose epilogue is wrong (the bias added twice) is caught: on gemm_acts' ReLU
    site (N 32: at most 16 programs a form at one row, where gemm_mlp's up projection runs 512)."""
    compiled, _, model = built["gemm_acts"]
    site = compiled.program.alternatives[1]
    kid = site.candidates[0].steps[-1].target
    failed = failing_candidates(
        compiled,
        model,
        kid,
        "acc0 = acc0 + b0_e",  # its bias loaded before the wait (gemm_render.EARLY_BIAS)
        "acc0 = 2 * acc0 + b0_e",
        {"batch": 1},  # one row: every form runs, at the interpreter's least cost
        tmp_path / "bad.tpk",
    )
    assert failed == {f"{site.id}/{site.candidates[0].name}"}


# ---------------------------------------------------------------------------------------------
# Bundles with and without candidates


def test_default_build_compiles_only_the_built_in_forms(tmp_path, monkeypatch):
    """Without the flag the default build renders and compiles, per GEMM site, only the forms the
    built-in table names (``aot.codegen.gemm_defaults``: a one-row GEMV on sm_90, at 2-16 rows
    the built-in few-row form, the small mlp's weights being small, at 17-32 rows its form there,
    and at 33-64 rows a tile held to 33-128 rows: its K is below 1024), and the whole candidate
    set never; the table names exactly the candidates there are, each at its buckets."""
    from aot.codegen import gemm, gemm_render
    from aot.codegen.gemm_defaults import (
        BUILT_IN_32,
        BUILT_IN_FEW_ROWS,
        FORMS,
        SMALL_EARLY_FORM,
        SMALL_SLICED,
    )
    from aot.codegen.gemm_forms import MANY_ROW_TILES

    model = ROOT / "tests" / "data" / "small_mlp.py"
    rendered: list[tuple[str, ...]] = []
    render = gemm_render.render_candidates

    def only_default_forms(site, buffers, known, ranges, configs=None):
        assert configs is not None, "every GEMM form rendered without --gemm-candidates"
        rendered.append(tuple(c.name for c in configs))
        return render(site, buffers, known, ranges, configs)

    monkeypatch.setattr(gemm, "render_candidates", only_default_forms)
    compiled = _build(model, tmp_path / "a.tpk", gemm_candidates=False)
    assert rendered and all(
        sum(n in FORMS for n in names) == 1
        and set(names) - set(FORMS)
        <= {*BUILT_IN_FEW_ROWS, SMALL_EARLY_FORM, SMALL_SLICED, *BUILT_IN_32}
        | {c.name for c in MANY_ROW_TILES}
        and len(names) <= 4
        for names in rendered
    )
    # small_mlp has buckets of 2-16, 17-32 and 33-64 rows
    assert any(len(names) == 4 for names in rendered), rendered
    sites = {s.id: s for s in compiled.program.alternatives}
    assert all(1 <= len(s.candidates) <= 4 for s in sites.values())
    table = compiled.tuning
    assert table is not None and {
        (c.site, c.choice, tuple(sorted(c.sizes.items()))) for c in table.choices
    } == {
        (s.id, cand.name, tuple(sorted(sizes.items())))
        for s in sites.values()
        for cand in s.candidates
        for sizes in cand.buckets
    }


@pytest.mark.slow  # builds models/mlp.py twice, once with every GEMM form compiled
def test_candidates_bundle_runs_like_the_default_on_cpu(tmp_path):
    """models/mlp.py built with --gemm-candidates: same outputs on the CPU as the default bundle."""
    import torch

    from aot.loader import load

    model = ROOT / "models" / "mlp.py"
    _build(model, tmp_path / "plain.tpk", gemm_candidates=False)
    compiled = _build(model, tmp_path / "gemm.tpk", gemm_candidates=True)
    assert len(compiled.program.alternatives) == 8
    plain, cand = load(tmp_path / "plain.tpk"), load(tmp_path / "gemm.tpk")
    for batch in (1, 5):
        x = torch.randn(batch, 1024, generator=torch.Generator().manual_seed(batch)).half()
        assert torch.equal(plain(x), cand(x))


def test_candidates_build_stacks_siblings_like_the_default(built, tmp_path):
    """gate and up read the same input: a --gemm-candidates build stacks them as the default
    build does (same steps, same weights), and the stacked GEMM is a site with candidates of its
    own; --keep-siblings keeps them apart with a dual-GEMM site instead (``built``'s swiglu, with
    the forms of ``FAMILIES`` as here)."""
    model = MODELS / "gemm_swiglu.py"
    plain = _build(model, tmp_path / "plain.tpk", gemm_candidates=False)
    with forms_offered(_all_configs()):
        cand = _build(model, tmp_path / "cand.tpk")
    apart = built["gemm_swiglu"][0]
    assert cand.program.steps == plain.program.steps
    assert sorted(cand.traced.weights) == sorted(plain.traced.weights)
    assert any(name.endswith(".stacked2") for name in plain.traced.weights)
    # the stacked GEMM's site takes the SiLU * up kernel that reads its two column halves: each
    # candidate computes both halves of its columns (N: one half's), as the dual GEMM does
    site = cand.program.alternatives[0]
    permute = cand.program.steps[site.library[0]]
    assert permute.args[0].name.endswith(".stacked2")
    assert site.n == apart.program.alternatives[0].n and site.candidates
    steps = [cand.program.steps[i] for i in site.library]
    assert steps[-1].kind == schema.StepKind.KERNEL and "aten.sigmoid.default" in {
        r.target for r in steps[-1].reference
    }
    kernels = {k.id: k for k in cand.program.kernels}
    assert all("w1_ptr" in kernels[c.steps[-1].target].source for c in site.candidates)
    gate = apart.program.alternatives[0]
    assert [apart.program.steps[i].target for i in gate.library].count("aten.mm.default") == 2


# ---------------------------------------------------------------------------------------------
# Hostile alternatives


def _rewrite_program(bundle: Path, out: Path, edit) -> Path:
    from tests.hostile_util import program_json, read_entries, with_program_text, write_entries

    entries = read_entries(bundle.read_bytes())
    tree = program_json(entries)
    edit(tree)
    out.write_bytes(write_entries(with_program_text(entries, json.dumps(tree).encode())))
    return out


def _site(tree, i=0):
    return tree["alternatives"][i]


HOSTILE_ALTERNATIVES = {
    "index past the steps": (lambda t: _site(t).update(library=[0, 999]), "library steps"),
    "unsorted library": (
        lambda t: _site(t).update(library=list(reversed(_site(t)["library"]))),
        "library steps",
    ),
    "overlapping sites": (lambda t: _site(t, 1).update(library=_site(t)["library"]), "library steps"),
    "bad id": (lambda t: _site(t).update(id="../x"), "ids are gemm_"),
    "duplicate id": (lambda t: _site(t, 1).update(id=_site(t)["id"]), "ids are gemm_"),
    "output not written": (lambda t: _site(t).update(outputs=["x"]), "outputs"),
    "internal buffer read later": (lambda t: _site(t).update(outputs=[]), "outputs"),
    # a candidate writes its outputs where the site's last step was: one an earlier library step
    # wrote (a LayerNorm prologue's sum) may not be read by a step the site keeps before that
    "output read before the site's last step": (
        lambda t: (
            t["alternatives"].pop(1),
            _site(t).update(library=[0, 1, 3], outputs=["addmm", "permute_1"]),
        ),
        "before the site's last step",
    ),
    "unknown kernel": (
        lambda t: _site(t)["candidates"][0]["steps"][0].update(target="k_0000000000000000"),
        "does not define",
    ),
    "aten step": (lambda t: _site(t)["candidates"][0]["steps"][0].update(kind="aten"), "do not list"),
    "writes an input": (
        lambda t: _site(t)["candidates"][0]["steps"][0].update(
            outputs=_site(t)["candidates"][0]["steps"][0]["outputs"] + ["x"]
        ),
        "does not own",
    ),
    # besides its outputs a candidate may write only new buffers or its own site's internal ones
    "writes another site's output": (
        lambda t: _site(t)["candidates"][0]["steps"][0].update(
            outputs=_site(t)["candidates"][0]["steps"][0]["outputs"] + _site(t, 1)["outputs"][:1]
        ),
        "does not own",
    ),
    "named library": (lambda t: _site(t)["candidates"][0].update(name="library"), "names are"),
    "reads before written": (
        lambda t: _site(t)["candidates"][0]["steps"][0]["args"].__setitem__(0, {"buf": "addmm_1"}),
        "is wrong",
    ),
    "no candidates": (lambda t: _site(t).update(candidates=[]), "candidates"),
    "unknown field": (lambda t: _site(t).update(evil=1), "unknown"),
}


@pytest.mark.parametrize("case", list(HOSTILE_ALTERNATIVES))
def test_hostile_alternatives_are_refused(built, tmp_path, case):
    from aot.loader import load

    edit, message = HOSTILE_ALTERNATIVES[case]
    path = _rewrite_program(built["gemm_mlp"][1], tmp_path / "bad.tpk", edit)
    with pytest.raises(BundleError, match=message):
        load(path)


# ---------------------------------------------------------------------------------------------
# Tuning tables


def _table(program, arch="sm_90", program_index=0):
    """A table as ``aotpack tune`` would write it: the first candidate of every site wins at
    every bucket it was compiled for."""
    from aot.verify.tuning_table import make_table

    choices = []
    for site in program.alternatives:
        cand = site.candidates[0]
        for sizes in cand.buckets:
            times = {"library": 10.0, cand.name: 8.0}
            choices.append(schema.TuningChoice(program_index, site.id, sizes, cand.name, times))
    return make_table(arch, "Test GPU", choices)


def _programs_and_buckets(bundle: Path):
    from aot.loader import open_bundle

    opened = open_bundle(bundle)
    try:
        program = opened.program()
        m = opened.manifest
        return [program, *program.variants], ([e.buckets for e in m.programs] if m.programs else [m.buckets])
    finally:
        opened.close()


def test_tuning_table_bytes_are_deterministic(built):
    from aot.verify.tuning_table import make_table, tuning_bytes

    table = _table(built["gemm_mlp"][0].program)
    shuffled = make_table(table.arch, table.device, list(reversed(table.choices)))
    assert tuning_bytes(table) == tuning_bytes(shuffled)
    again = make_table(
        table.arch,
        table.device,
        [replace(c, times_us={k: v + 1e-9 for k, v in c.times_us.items()}) for c in table.choices],
    )
    assert tuning_bytes(again) == tuning_bytes(table)  # rounded: the same measurements, the same bytes


@pytest.mark.parametrize("name", ["gemm_mlp", "gemm_swiglu", "gemm_acts"])
def test_tune_walk_times_each_site_once_with_its_inputs_and_frees_the_rest(built, name):
    """``aotpack tune`` walks the program as a call does, dropping buffers after their last use (a
    run that kept every buffer of gpt's largest bucket ran out of an 80 GB GPU), and times every
    site once, when each buffer it reads exists: checked with placeholder buffers, no GPU."""
    from aot.program import frees_after, step_reads, step_writes
    from aot.verify.tune import site_inputs, walk_sites

    program = built[name][0].program
    assert program.alternatives
    given = [*(w.name for w in program.weights), *(i.name for i in program.inputs)]
    frees = frees_after(program.steps, given, program.outputs)
    env = {n: object() for n in given}
    live, timed = [], []

    def run(step, env):
        missing = [r for r in step_reads(step) if r not in env]
        assert not missing, (step.target, missing)
        env.update({w: object() for w in step_writes(step)})
        live.append(len(env))

    for site in walk_sites(program, list(program.steps), frees, env, run):
        assert site_inputs(program, site) <= env.keys(), site.id
        timed.append(site.id)
    assert sorted(timed) == sorted(s.id for s in program.alternatives)
    assert set(env) == set(given) | set(program.outputs)  # every intermediate dropped
    assert max(live) < len(given) + len(program.steps)  # not every buffer at once


def test_choose_needs_a_three_percent_win():
    from aot.verify.tune_rules import choose

    assert choose({"library": 10.0, "tile_a": 9.8}) == "library"
    assert choose({"library": 10.0, "tile_a": 9.7, "tile_b": 9.69}) == "tile_b"
    assert choose({"library": 10.0, "tile_a": 9.0, "tile_b": 9.0}) == "tile_a"


def test_tuned_table_changes_the_gpu_plan(built, tmp_path):
    """The plan a GPU of the table's arch would launch replaces the chosen sites' library steps by
    the candidates' kernels; another arch, or no table, keeps the program's steps."""
    from aot.loader import load
    from aot.loader.tuning import read_tuning, tuned_plans
    from aot.program import frees_after
    from aot.verify.tuning_table import write_tuned

    compiled, bundle, _ = built["gemm_mlp"]
    program = compiled.program
    tuned = tmp_path / "tuned.tpk"
    assert write_tuned(bundle, tuned, _table(program)) is False
    runner = load(tuned)  # CPU: the table is checked, not applied
    assert runner.tuning is not None and len(runner.tuning.choices) == 8
    plans = tuned_plans(runner.tuning, 0, runner.program, "sm_90")
    assert set(plans) == {(1,), (16,), (37,), (64,)}
    steps = plans[(1,)]
    launched = {s.target for s in steps if s.kind == schema.StepKind.KERNEL}
    for site in program.alternatives:
        assert site.candidates[0].steps[-1].target in launched
        assert not any(program.steps[i] in steps for i in site.library if program.steps[i].kind == "aten")
    assert len(steps) < len(program.steps)
    frees_after(steps, [*(w.name for w in program.weights), "x"], program.outputs)
    assert tuned_plans(runner.tuning, 0, runner.program, "sm_80") == {}
    assert tuned_plans(None, 0, runner.program, "sm_90") == {}
    # the CPU runs the untuned program, identically
    import torch

    x = torch.randn(3, 64).half()
    assert torch.equal(runner(x), load(bundle)(x))
    programs, buckets = _programs_and_buckets(tuned)
    assert read_tuning is not None and programs[0].alternatives == program.alternatives


def test_signed_bundle_must_be_signed_again(built, tmp_path):
    from aot.packager.sign import sign_bundle
    from aot.signing import write_key_pair
    from aot.verify.tuning_table import write_tuned

    key = tmp_path / "k.key"
    write_key_pair(str(key))
    signed = tmp_path / "signed.tpk"
    signed.write_bytes(built["gemm_mlp"][1].read_bytes())
    sign_bundle(str(signed), str(key))
    assert write_tuned(signed, signed, _table(built["gemm_mlp"][0].program)) is True
    from aot.loader import load

    assert load(signed).tuning is not None  # unsigned now; a server with --trust refuses it
    with pytest.raises(BundleError):
        load(signed, trust=[str(key) + ".pub"])
    sign_bundle(str(signed), str(key))  # signed again, the tuned bundle is trusted
    assert load(signed, trust=[str(key) + ".pub"]).tuning is not None


def _with_tuning(bundle: Path, out: Path, data: bytes) -> Path:
    from tests.hostile_util import read_entries, with_member, write_entries

    out.write_bytes(write_entries(with_member(read_entries(bundle.read_bytes()), schema.TUNING_PATH, data)))
    return out


def _tree(program):
    return serde.to_json(_table(program))


def _choice0(t):
    return t["choices"][0]


HOSTILE_TABLES = {
    "unknown site": (lambda t: _choice0(t).update(site="gemm_99"), "no such GEMM site"),
    "unknown candidate": (lambda t: _choice0(t).update(choice="tile_1x1x1"), "unknown candidate"),
    "unknown bucket": (lambda t: _choice0(t).update(sizes={"batch": 3}), "not a bucket"),
    "unknown symbol": (lambda t: _choice0(t).update(sizes={"seq": 1}), "not a bucket"),
    "program index": (lambda t: _choice0(t).update(program=5), "programs"),
    "negative time": (lambda t: _choice0(t)["times_us"].update(library=-1.0), "not a measurement"),
    "huge time": (lambda t: _choice0(t)["times_us"].update(library=1e300), "not a measurement"),
    "unknown timed form": (lambda t: _choice0(t)["times_us"].update(evil=1.0), "unknown form"),
    "arch": (lambda t: t.update(arch="x86"), "arch"),
    "format": (lambda t: t.update(format="other"), "format"),
    "min gain": (lambda t: t.update(min_gain=2.0), "min_gain"),
    "duplicate": (lambda t: t["choices"].append(dict(_choice0(t))), "listed twice"),
    "rejected choice": (lambda t: _choice0(t).update(rejected=[_choice0(t)["choice"]]), "rejected"),
    "wrong type": (lambda t: _choice0(t).update(sizes={"batch": "1"}), "expected an integer"),
    "unknown field": (lambda t: t.update(evil=True), "unknown"),
    "check set back yet chosen": (
        lambda t: t["checks"].append(_check(t, kept=False)),
        "set back to the library",
    ),
    "check at no bucket": (lambda t: t["checks"].append(_check(t, sizes={"batch": 3})), "not a bucket"),
    "check time": (lambda t: t["checks"].append(_check(t, tuned_us=-2.0)), "not a measurement"),
    "check program": (lambda t: t["checks"].append(_check(t, program=7)), "programs"),
    "check twice": (lambda t: t["checks"].extend([_check(t), _check(t)]), "listed twice"),
}


def _check(t, **fields):
    """A whole-program check (JSON) at the first choice's bucket: kept, tuned faster."""
    check = {
        "program": 0,
        "sizes": dict(_choice0(t)["sizes"]),
        "library_us": 20.0,
        "tuned_us": 16.0,
        "kept": True,
    }
    check.update(fields)
    return check


@pytest.mark.parametrize("case", list(HOSTILE_TABLES))
def test_hostile_tuning_tables_are_refused(built, tmp_path, case):
    from aot.loader import load

    edit, message = HOSTILE_TABLES[case]
    tree = _tree(built["gemm_mlp"][0].program)
    edit(tree)
    path = _with_tuning(built["gemm_mlp"][1], tmp_path / "bad.tpk", json.dumps(tree).encode())
    with pytest.raises(BundleError, match=message):
        load(path)


def test_a_bucket_set_back_by_its_whole_program_check_runs_the_library(built, tmp_path):
    """``check_bucket`` (tune's last step per bucket) keeps the choices only where the whole
    program was faster with them; set back, the table loads and that bucket has no plan."""
    from aot.loader import load
    from aot.verify import tuning_table
    from aot.verify.tune_rules import check_bucket

    program = built["gemm_mlp"][0].program
    table = _table(program)
    sizes = table.choices[0].sizes
    bucket = [c for c in table.choices if c.sizes == sizes]

    def timer(library_us: float, tuned_us: float):
        """The whole program as measured: the library's steps take library_us, the chosen ones tuned_us."""
        return lambda plan: tuned_us if plan else library_us

    cases = (
        (20.0, 16.0, True),
        (20.0, 19.8, True),
        (20.0, 19.9, False),
        (20.0, 20.0, False),
        (20.0, 23.0, False),
    )
    for library_us, tuned_us, kept in cases:  # kept: faster by at least 1% (WHOLE_MIN_GAIN)
        got, check = check_bucket(0, bucket, sizes, timer(library_us, tuned_us))
        assert check == schema.TuningCheck(0, sizes, library_us, tuned_us, kept)
        assert [c.choice != "library" for c in got] == [kept] * len(bucket)
        assert [c.times_us for c in got] == [c.times_us for c in bucket]  # the measurements stay
    others = [c for c in table.choices if c.sizes != sizes]
    set_back = tuning_table.make_table(table.arch, table.device, [*got, *others], checks=[check])
    path = _with_tuning(built["gemm_mlp"][1], tmp_path / "t.tpk", tuning_table.tuning_bytes(set_back))
    runner = load(path)
    assert runner.tuning.checks == (check,)
    # a bundle of schema 1.3 tuned with checks says 1.4: a 1.3 loader refuses it as too new
    from tests.hostile_util import (
        manifest_bytes,
        manifest_of,
        read_entries,
        with_manifest_text,
        write_entries,
    )

    entries = read_entries(built["gemm_mlp"][1].read_bytes())
    older = dict(manifest_of(entries), schema_version=[1, 3])
    (tmp_path / "old.tpk").write_bytes(write_entries(with_manifest_text(entries, manifest_bytes(older))))
    assert load(tmp_path / "old.tpk").manifest.schema_version == (1, 3)
    tuning_table.write_tuned(tmp_path / "old.tpk", tmp_path / "w.tpk", set_back)
    assert load(tmp_path / "w.tpk").manifest.schema_version == tuning_table.CHECKS_SCHEMA == (1, 4)
    from aot.cli.reports import bundle_summary, summary_text

    m, info = bundle_summary(str(tmp_path / "w.tpk"))
    assert "; 1 bucket(s) set back to the library by the whole-program check" in summary_text(m, info)
    tuning_table.write_tuned(tmp_path / "old.tpk", tmp_path / "w2.tpk", replace(set_back, checks=()))
    assert load(tmp_path / "w2.tpk").manifest.schema_version == (1, 3)  # no checks: readable as before
    unmatched = [replace(c, rejected=tuple(k for k in c.times_us if k != "library")) for c in got]
    got_none, none = check_bucket(0, unmatched, sizes, lambda plan: pytest.fail("timed"))  # times nothing
    assert none is None and got_none == unmatched  # no candidate matched: nothing to check


def test_the_whole_plan_stands_where_the_program_is_faster_with_it(built):
    """Where a site's candidate loses alone, ``check_bucket`` also times every site on its fastest
    matching candidate (``fastest_plan``): that plan replaces the choices made site by site when the
    whole program is faster with it by WHOLE_MIN_GAIN, and stands only where it beats the library."""
    from aot.verify import tune_rules
    from aot.verify.tune_rules import check_bucket

    program = built["gemm_mlp"][0].program
    table = _table(program)
    sizes = table.choices[0].sizes
    bucket = [c for c in table.choices if c.sizes == sizes]
    assert len(bucket) >= 2, "the test needs two sites at one bucket"
    first, rest = bucket[0], bucket[1:]
    # the first site's candidate wins alone; the others' lose alone by a little
    bucket = [
        first,
        *(replace(c, choice="library", times_us={"library": 10.0, c.choice: 10.4}) for c in rest),
    ]
    chosen = {first.site: first.choice}
    fastest = tune_rules.fastest_plan(bucket)
    assert fastest == {c.site: next(k for k in c.times_us if k != "library") for c in bucket}
    plans = {"chosen": chosen, "fastest": fastest}

    def timer(times: dict[str, float]):
        def time_plan(plan):
            if not plan:
                return times["library"]
            return next(times[k] for k, p in plans.items() if k in times and p == plan)

        return time_plan

    cases = (  # library, chosen, fastest -> which plan stands (None: the library), whole_plan
        (20.0, 19.0, 17.0, "fastest"),
        (20.0, 19.0, 18.9, "chosen"),  # not faster than the choices by 1%
        (20.0, 19.0, 18.8, "fastest"),
        (20.0, 19.9, 19.5, "fastest"),  # beats the library by 2.5%
        (20.0, 20.0, 19.9, None),  # faster than the choices, not than the library by 1%
        (20.0, 21.0, 25.0, None),
    )
    for library_us, chosen_us, fastest_us, stands in cases:
        times = {"library": library_us, "chosen": chosen_us, "fastest": fastest_us}
        got, check = check_bucket(0, bucket, sizes, timer(times))
        plan = {"fastest": fastest, "chosen": chosen, None: {}}[stands]
        assert {c.site: c.choice for c in got if c.choice != "library"} == plan, (times, stands)
        tuned_us = fastest_us if fastest_us <= 0.99 * chosen_us else chosen_us
        assert check == schema.TuningCheck(
            0, sizes, library_us, tuned_us, stands is not None, whole_plan=stands == "fastest"
        ), (times, stands)
        assert [c.times_us for c in got] == [c.times_us for c in bucket]  # the measurements stay
    # a site whose candidate loses alone by more than NEAR_LOSS: the near plan leaves it on the
    # library, the fastest plan does not, and the faster of the two whole plans is the one tried
    slow = {"library": 10.0}
    far = [  # nothing wins alone; the last site's candidate loses by more than NEAR_LOSS
        *(
            replace(
                c, choice="library", times_us=dict(slow, **{k: 10.4 for k in c.times_us if k != "library"})
            )
            for c in bucket[:-1]
        ),
        replace(
            bucket[-1],
            choice="library",
            times_us=dict(
                slow,
                **{k: 10.0 * (1 + tune_rules.NEAR_LOSS) + 1 for k in bucket[-1].times_us if k != "library"},
            ),
        ),
    ]
    near = tune_rules.fastest_plan(far, tune_rules.NEAR_LOSS)
    assert (
        near == {k: v for k, v in fastest.items() if k != bucket[-1].site}
        and tune_rules.fastest_plan(far) == fastest
    )
    plans["near"] = near
    for near_us, fastest_us, stands in ((17.0, 18.0, near), (18.0, 17.0, fastest), (19.9, 19.9, {})):
        times = {"library": 20.0, "near": near_us, "fastest": fastest_us}
        got, check = check_bucket(0, far, sizes, timer(times))
        assert {c.site: c.choice for c in got if c.choice != "library"} == stands
        assert check.whole_plan == bool(stands) and check.tuned_us == min(near_us, fastest_us)
    del plans["near"]
    # nothing chosen site by site: the whole plan is timed against the library alone
    alone = [
        replace(
            c, choice="library", times_us={"library": 10.0, **{k: 10.4 for k in c.times_us if k != "library"}}
        )
        for c in bucket
    ]
    plans["fastest"] = tune_rules.fastest_plan(alone)
    for fastest_us, kept in ((18.0, True), (19.9, False)):
        got, check = check_bucket(0, alone, sizes, timer({"library": 20.0, "fastest": fastest_us}))
        assert check == schema.TuningCheck(0, sizes, 20.0, fastest_us, kept, whole_plan=kept)
        assert all((c.choice != "library") == kept for c in got)


@pytest.mark.parametrize("text", [b"{", b"\xff", b'{"format": NaN}', b"[]", b"1" * 10])
def test_malformed_tuning_member_is_refused(built, tmp_path, text):
    from aot.loader import load

    path = _with_tuning(built["gemm_mlp"][1], tmp_path / "bad.tpk", text)
    with pytest.raises(BundleError):
        load(path)


def test_nan_time_is_refused(built, tmp_path):
    from aot.loader import load

    text = json.dumps(_tree(built["gemm_mlp"][0].program)).replace("10.0", "NaN", 1).encode()
    with pytest.raises(BundleError, match="NaN"):
        load(_with_tuning(built["gemm_mlp"][1], tmp_path / "bad.tpk", text))


def test_table_for_a_bundle_without_candidates_is_refused(tmp_path):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.tuning_table import write_tuned

    bundle = tmp_path / "plain.tpk"  # for sm_80: no built-in GEMV forms (aot.codegen.gemm_defaults)
    compiled = generate(trace(load_model_file(ROOT / "tests" / "data" / "small_mlp.py")), ("sm_80",))
    assert not compiled.program.alternatives
    pack(compiled, bundle)
    choice = schema.TuningChoice(0, "gemm_0", {"batch": 1}, "library", {"library": 1.0})
    from aot.verify.tuning_table import make_table

    with pytest.raises(BundleError, match="no such GEMM site"):
        write_tuned(bundle, tmp_path / "t.tpk", make_table("sm_90", "x", [choice]))
    assert not (tmp_path / "t.tpk").exists()


# ---------------------------------------------------------------------------------------------
# tune without a GPU


def test_tune_refuses_without_a_gpu(built):
    import torch

    from aot.verify.tune import tune

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(EnvError, match="needs a CUDA GPU"):
        tune(built["gemm_mlp"][1])
    proc = run_aotpack("tune", str(built["gemm_mlp"][1]))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == ["error: aotpack tune needs a CUDA GPU; torch sees none"]


@pytest.mark.slow
def test_every_form_takes_the_prologue(tmp_path):
    """gemm_ln built with every form (the default run builds FAMILIES): each candidate, the
    LayerNorm-prologue forms among them, matches its reference at one row and at 3."""
    from aot.codegen import gemm_render
    from aot.verify.interpret import interpret_in_subprocess

    saved = gemm_render.CONFIGS
    gemm_render.CONFIGS = _all_configs(every=True)
    try:
        compiled = _build(MODELS / "gemm_ln.py", tmp_path / "ln.tpk")
    finally:
        gemm_render.CONFIGS = saved
    names = {c.name.removesuffix("_ln") for s in compiled.program.alternatives for c in s.candidates}
    one_row = {c.name for c in _all_configs(every=True) if not c.dot}
    assert one_row - names <= {"splitk_1x8x512"}  # K of gemm_ln is below the one-row split-K's minimum
    # 3 rows, not 16: a ragged tile of every tensor-core form (whole tiles: the dot forms of
    # test_long_k_candidates_match_in_the_interpreter at 37 rows), and the one-row forms, a block
    # per row, run the same code at any row count
    (result,) = interpret_in_subprocess(
        [(tmp_path / "ln.tpk", MODELS / "gemm_ln.py", [{"batch": 1}, {"batch": 3}], None, True)],
        timeout=HANG_GUARD_S,
    )
    n_cands = sum(len(s.candidates) for s in compiled.program.alternatives)
    for sizes, comparisons in result.items():
        assert len({c.name for c in comparisons if not c.name.endswith("/rerun")}) == n_cands, sizes
        assert all(c.ok for c in comparisons), [c for c in comparisons if not c.ok][:3]


# ---------------------------------------------------------------------------------------------
# The big shape


@pytest.mark.slow
@pytest.mark.parametrize(
    "forms, rows, expected",
    [
        # the tensor-core forms (2 skinny + 4 tiles + split-K per site, the narrow split-K at
        # K = 4096 only) at 37 rows: several row tiles, the last one ragged. Every form is checked
        # at 1 and 3 rows on gemm_ln's shapes (test_every_form_takes_the_prologue)
        ("dot", (37,), 16),
        # the one-row forms at the bucket they are built for (4 per site, the one-row split-K at
        # K = 4096 only); rows past the first are checked on the small models above
        ("one-row", (1,), 9),
    ],
)
def test_long_k_candidates_match_in_the_interpreter(tmp_path, forms, rows, expected):
    """Linear(64→4096) + bias + GELU and Linear(4096→64) + bias: every candidate against its
    reference, the forms built only at K = 4096 among them (the one-row split-K, the narrow
    tensor-core split-K). The one-row forms are those of models/mlp.py's shapes (1024→4096→1024);
    at 64 columns in and out the interpreter runs a sixteenth of their programs' work (it took
    about 5 of this test's CPU minutes each at the mlp's shapes). ``expected`` counts the forms
    of CONFIGS; the candidates build also offers the built-in entry's swapped form in K slices
    at the down projection and its small form with W early at the up projection (K 64:
    ``gemm_defaults.SMALL_EARLY``), compared beside them."""
    from aot.codegen import gemm, gemm_render
    from aot.verify.interpret import interpret_in_subprocess

    model = tmp_path / "big.py"
    model.write_text(
        (MODELS / "gemm_mlp.py")
        .read_text()
        .replace("nn.Linear(64, 1024)", "nn.Linear(64, 4096)")
        .replace("nn.Linear(1024, 64)", "nn.Linear(4096, 64)")
    )
    saved = gemm_render.CONFIGS, gemm.CONFIGS  # gemm's: beside a built-in entry's form (the down site)
    gemm_render.CONFIGS = gemm.CONFIGS = tuple(
        c for c in _all_configs(every=True) if c.dot == (forms == "dot")
    )
    try:
        compiled = _build(model, tmp_path / "big.tpk")
    finally:
        gemm_render.CONFIGS, gemm.CONFIGS = saved
    long_k = {c.name for c in compiled.program.alternatives[1].candidates}  # the down projection's
    assert ("splitk4_1x8x512" if forms == "one-row" else "splitk8_16x16x256") in long_k, sorted(long_k)
    (result,) = interpret_in_subprocess(
        [(tmp_path / "big.tpk", model, [{"batch": m} for m in rows], None, True)], timeout=HANG_GUARD_S
    )
    assert len(result) == len(rows)
    for sizes, comparisons in result.items():
        names = {c.name for c in comparisons if not c.name.endswith("/rerun")}
        built_in = {n for n in names if "/fews_" in n or "/gemve_" in n}
        assert len(names - built_in) == expected, (sizes, sorted(names))
        assert len(built_in) <= 2, sorted(built_in)
        assert all(c.ok for c in comparisons), [c for c in comparisons if not c.ok][:3]


def test_inspect_reports_candidates_and_tuning(built, tmp_path):
    from aot.cli.reports import bundle_summary, summary_text
    from aot.verify.tuning_table import write_tuned

    compiled, bundle, _ = built["gemm_mlp"]
    m, info = bundle_summary(str(bundle))
    assert [s["candidates"] for s in info["gemm_sites"]] == [
        [c.name for c in s.candidates] for s in compiled.program.alternatives
    ]
    assert info["tuning"] is None
    text = summary_text(m, info)
    assert "GEMM candidates: 7 for 2 sites (8 kernels); untuned" in text
    assert "archs: sm_90; sm_90: kernels launch early (programmatic dependent launch)" in text
    tuned = tmp_path / "tuned.tpk"
    write_tuned(bundle, tuned, _table(compiled.program))
    m, info = bundle_summary(str(tuned))
    assert "tuned on Test GPU (sm_90): 8/8 site-buckets use a candidate" in summary_text(m, info)


def test_candidate_builds_are_byte_identical(built, tmp_path):
    with forms_offered(_all_configs()):
        _build(MODELS / "gemm_swiglu.py", tmp_path / "again.tpk", stack_siblings=False)  # as `built`
    assert (tmp_path / "again.tpk").read_bytes() == built["gemm_swiglu"][1].read_bytes()


# ---------------------------------------------------------------------------------------------
# The small head in the default build


def test_a_small_head_runs_as_a_triton_kernel_in_the_default_build(tmp_path):
    """The default build of a model whose only library GEMM is a small head runs the head as a
    Triton kernel, so its process never loads cuBLAS: no step calls cuBLAS, the kernel's reference
    is the library steps (what the CPU runs, identically), and in the interpreter the kernel
    matches them at every bucket (fp16: 1e-2 + 1e-2·|ref|); with --gemm-candidates the head stays a
    library step and a site for tune, and a model with GEMMs besides its head keeps them all."""
    import torch

    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import calls_cublas
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    model = MODELS / "gemm_head.py"
    traced = trace(load_model_file(model))  # one trace, built both ways
    compiled = generate(traced, ARCHS)
    program = compiled.program
    assert not any(calls_cublas(s) for s in program.steps)
    kernels = {k.id: k for k in program.kernels}
    (head,) = [
        s
        for s in program.steps
        if s.kind == schema.StepKind.KERNEL and kernels[s.target].config["kind"] == "gemm"
    ]
    assert kernels[head.target].config["candidate"] == "gemv_16x16x256"
    assert "aten.addmm.default" in [r.target for r in head.reference]
    path = tmp_path / "head.tpk"
    pack(compiled, path)
    runner = load(path)  # CPU: the reference steps
    assert runner.program.steps == program.steps
    assert runner(torch.randn(5, 3, 8, 8).half()).shape == (5, 10)
    (result,) = interpret_in_subprocess([(path, model, [{"batch": 1}, {"batch": 5}, {"batch": 32}], None)])
    checked = [c for cs in result.values() for c in cs if c.kernel == head.target]
    assert len(checked) == 3 and all(c.ok for c in checked), checked
    assert all(c.ok for cs in result.values() for c in cs)
    # the candidates build (of the forms of FAMILIES) leaves the head to tune; gemm_mlp's two GEMMs
    # stay cuBLAS calls
    with forms_offered(_all_configs()):
        cand = generate(traced, ARCHS, gemm_candidates=True).program
    assert any(calls_cublas(s) for s in cand.steps) and len(cand.alternatives) == 1
    mlp = generate(trace(load_model_file(MODELS / "gemm_mlp.py")), ARCHS).program
    assert sum(calls_cublas(s) for s in mlp.steps) == 2
