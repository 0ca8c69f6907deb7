"""A norm's row inputs read straight from their lookups' tables (``gemm_sites.Gathered``): a
decode step's first LayerNorm (GPT-2: token + position rows) or RMSNorm (Llama: the token's row,
which the residual reads later too) runs in the next GEMM's prologue with the lookups in it, so
the step launches no gather kernel at one row.

``gemm_models/gemm_lookup.py`` built with the one-row forms as candidates: the ``_ln`` / ``_rms``
forms take the tables and the ids, the plain forms run the lookup kernels first; every candidate
matches the library steps it replaces in Triton's interpreter at 1 and 3 rows (float16:
``aot.dtypes.TOLERANCE``), the sum and the token rows the fused forms write exactly; a row read
through a wrong id is caught; an id outside the table gives the row NaN, as the lookup's kernel
does; the 16-row forms with a norm prologue read the lookups too (slow). A norm whose sum the same GEMM's epilogue reads (``h + W @ norm(h)``) keeps its kernel: the
first N tile writes the sum the other tiles would read.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from aot import schema
from tests.codegen.conftest import failing_candidates, forms_offered, interpreted_json
from tests.conftest import HANG_GUARD_S

MODEL = Path(__file__).resolve().parent / "gemm_models" / "gemm_lookup.py"
ARCHS = ("sm_90",)
ONE_ROW_FORMS = ("vec_1x2x512", "vec_1x2x1024")


def _built(traced, names: tuple[str, ...], configs=None):
    """``traced`` built with the forms ``names`` (of ``configs``, default the codegen's) as its
    GEMM candidates, each eligible at every bucket."""
    from aot.codegen import gemm_forms, generate

    offered = tuple(replace(c, max_m=1 << 62) for c in configs or gemm_forms.CONFIGS if c.name in names)
    with forms_offered(offered):
        return generate(traced, ARCHS, gemm_candidates=True)


def _interpreted(compiled, path: Path, model: Path, sizes: dict) -> list:
    """``compiled`` packed at ``path`` and every candidate compared with the library steps it
    replaces in Triton's interpreter at ``sizes``: the comparisons, every one of them ok."""
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    pack(compiled, path)
    (result,) = interpret_in_subprocess([(path, model, [sizes], None, True)], timeout=HANG_GUARD_S)
    (comparisons,) = result.values()
    bad = [c for c in comparisons if not c.ok]
    assert not bad, bad[:3]
    return comparisons


@pytest.fixture(scope="module")
def traced():
    from aot.tracer import load_model_file, trace

    return trace(load_model_file(MODEL))


@pytest.fixture(scope="module")
def lookup_forms(traced):
    """The model built with the one-row forms, eligible at every bucket."""
    return _built(traced, ONE_ROW_FORMS)


def _sites(program):
    """The two sites whose A is a norm of lookups: GPT-2's and Llama's first projections."""
    kernels = {k.id: k for k in program.kernels}
    return [
        s for s in program.alternatives if any(c.name.endswith(("_ln", "_rms")) for c in s.candidates)
    ], kernels


def test_the_fused_forms_read_the_tables_and_the_plain_forms_run_the_lookups(lookup_forms):
    compiled = lookup_forms
    program = compiled.program
    (ln_site, rms_site), kernels = _sites(program)
    for site, suffix, tables, ids, written in (
        (ln_site, "_ln", ["wte.weight", "wpe.weight"], ["ids", "positions"], "add_"),
        (rms_site, "_rms", ["embed.weight"], ["ids"], "embedding"),
    ):
        gathers = [program.steps[i] for i in site.library if program.steps[i].kind == schema.StepKind.KERNEL]
        assert sum(kernels[s.target].name == "gather_rows" for s in gathers) == len(tables)
        assert site.outputs[-1].startswith(written)  # the sum, or the token's rows, for the residual
        for cand in site.candidates:
            names = [kernels[s.target].name for s in cand.steps]
            if cand.name.endswith(suffix):
                (step,) = cand.steps
                args = [a.name for a in step.args if isinstance(a, schema.Buf)]
                assert args[: len(tables)] == tables and args[len(tables) : 2 * len(tables)] == ids, args
                source = kernels[step.target].source
                assert "_ids_ptr + rm" in source and "float('nan')" in source and "sum_ptr" in source
                assert step.outputs[-1] == site.outputs[-1]
            else:  # the lookups, the norm kernel, the GEMM
                assert names[: len(tables)] == ["gather_rows"] * len(tables) and len(names) == len(tables) + 2


def test_the_default_build_runs_no_lookup_kernel_at_one_row(traced):
    """The built-in table's one-row forms take the lookups: at one row the plan launches the
    two GEMMs of each half and nothing else (no gather, no norm, no residual kernel)."""
    from aot.codegen import generate
    from aot.tuning import tuned_plans

    compiled = generate(traced, ARCHS)
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    plan = tuned_plans(compiled.tuning, 0, program, "sm_90")[(1,)]
    names = [kernels[s.target].name for s in plan if s.kind == schema.StepKind.KERNEL]
    assert "gather_rows" in {k.name for k in program.kernels}
    assert len(names) == 4 and not any(n.startswith(("gather", "fused")) for n in names), names
    assert sum(n.startswith(("gemm_ln_", "gemm_norm_")) for n in names) == 2, names


@pytest.mark.parametrize("rows", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_every_lookup_form_matches_its_reference(lookup_forms, rows, tmp_path):
    compiled = lookup_forms
    (ln_site, rms_site), _ = _sites(compiled.program)
    comparisons = _interpreted(compiled, tmp_path / "lookup.tpk", MODEL, {"batch": rows})
    n_cands = sum(len(s.candidates) for s in compiled.program.alternatives)
    assert len({c.name for c in comparisons if not c.name.endswith("/rerun")}) == n_cands
    for site, suffix in ((ln_site, "_ln"), (rms_site, "_rms")):
        written = [c for c in comparisons if c.name.endswith(suffix) and c.output == site.outputs[-1]]
        forms = [c for c in site.candidates if c.name.endswith(suffix)]  # the built-in entry's four rows too
        assert len(forms) >= len(ONE_ROW_FORMS) and len(written) == len(forms), written
        assert all(c.max_abs_error == 0.0 for c in written), written


@pytest.mark.slow  # two more interpreter runs
def test_a_row_read_through_a_wrong_id_is_caught(lookup_forms, tmp_path):
    compiled = lookup_forms
    (ln_site, rms_site), _ = _sites(compiled.program)
    for site, suffix, old in (
        (ln_site, "_ln", "y_row = tl.where(y_in, y_id, 0)"),
        (rms_site, "_rms", "x0_row = tl.where(x0_in, x0_id, 0)"),
    ):
        cand = next(c for c in site.candidates if c.name == "vec_1x2x512" + suffix)
        new = old.replace("_id, 0)", "_id + 1, 0)")
        failed = failing_candidates(
            compiled, MODEL, cand.steps[-1].target, old, new, {"batch": 1}, tmp_path / "bad.tpk"
        )
        assert failed == {f"{site.id}/{cand.name}"}, old


def test_an_id_outside_the_table_gives_a_row_of_nan(lookup_forms):
    """The ``_ln`` form on ids 3, -1 and 50 of a 50-row table (positions 0, 1, 2): the second and
    third rows of its product and of the sum it writes are NaN, the first is the LayerNorm of
    wte[3] + wpe[0] times W (float16 tolerance) and that sum exactly. (The build folds the
    LayerNorm's scale and shift into W and the bias, ``tracer.norm_scales``: the form normalizes
    alone, and W, b stand for the folded ones.)"""
    compiled = lookup_forms
    (ln_site, _), kernels = _sites(compiled.program)
    (step,) = next(c for c in ln_site.candidates if c.name == "vec_1x2x512_ln").steps
    kernel = kernels[step.target]
    script = f"""
import json, torch
from aot.codegen.compile import load_function
fn = load_function({kernel.id!r}, {kernel.name!r}, {kernel.source!r})
g = torch.Generator().manual_seed(0)
wte, wpe = torch.randn(50, 600, generator=g).half(), torch.randn(32, 600, generator=g).half()
w, b = (0.05 * torch.randn(128, 600, generator=g)).half(), (0.1 * torch.randn(128, generator=g)).half()
ids, positions = torch.tensor([3, -1, 50]), torch.tensor([0, 1, 2])
h, out = torch.zeros(3, 600, dtype=torch.half), torch.zeros(3, 128, dtype=torch.half)
fn[(64, 3)](wte, wpe, ids, positions, h, w, b, out, 3)
h0 = wte[3] + wpe[0]
want = torch.nn.functional.layer_norm(h0.float(), (600,)).half().float() @ w.float().T + b.float()
print(json.dumps([
    bool(torch.equal(h[0], h0)), bool(torch.allclose(out[0].float(), want, atol=1e-2, rtol=1e-2)),
    bool(h[1:].isnan().all()), bool(out[1:].isnan().all()),
]))
"""
    assert interpreted_json(script) == [True, True, True, True]


def test_a_norm_whose_sum_the_same_gemms_epilogue_reads_keeps_its_kernel(tmp_path):
    """``h + W @ norm(h)``: the epilogue would read the sum that the prologue's first N tile
    writes, in no set order across the blocks; the site takes no ``_ln`` / ``_rms`` form."""
    from aot.tracer import load_model_file, trace

    model = tmp_path / "same_site.py"
    model.write_text(
        MODEL.read_text()
        .replace("self.fc_out(self.fc(self.ln(h)))", "self.fc_sq(self.ln(h))")
        .replace(
            "self.fc = nn.Linear(600, 128)",
            "self.fc = nn.Linear(600, 128)\n        self.fc_sq = nn.Linear(600, 600)",
        )
    )
    compiled = _built(trace(load_model_file(model)), ONE_ROW_FORMS)
    first = compiled.program.alternatives[0]
    assert first.n == 600  # fc_sq: h + fc_sq(ln(h)) in one site
    assert not [c.name for c in first.candidates if c.name.endswith("_ln")], [
        c.name for c in first.candidates
    ]
    assert [c.name for s in compiled.program.alternatives for c in s.candidates if c.name.endswith("_rms")]


@pytest.mark.slow  # tensor-core forms compiled and interpreted at 3 rows
def test_the_few_row_forms_read_the_lookups_too(traced, tmp_path):
    """The forms of 16-row blocks that take a norm prologue (statistics before the K loop,
    ``few_16x16x256``; the RMSNorm's one pass, ``fewe_16x16x256``; the LayerNorm's,
    ``gemv_16x16x256``) read the lookups' rows the same way and match the library steps at 3
    rows (rows 3..15 of the block masked), the written sums exact."""
    from aot.codegen.gemm_defaults import default_configs

    compiled = _built(traced, ("few_16x16x256", "fewe_16x16x256", "gemv_16x16x256"), default_configs())
    (ln_site, rms_site), kernels = _sites(compiled.program)
    fused = {  # the built-in entry's one-row form of four rows a block aside
        s.id: sorted(
            c.name for c in s.candidates if c.name.endswith(("_ln", "_rms")) and "vec_" not in c.name
        )
        for s in (ln_site, rms_site)
    }
    assert fused == {
        ln_site.id: ["few_16x16x256_ln", "fewe_16x16x256_ln", "gemv_16x16x256_ln"],
        rms_site.id: ["few_16x16x256_rms", "fewe_16x16x256_rms"],
    }, fused
    for site in (ln_site, rms_site):
        for cand in site.candidates:
            if cand.name.endswith(("_ln", "_rms")):
                assert "_ids_ptr + rm" in kernels[cand.steps[-1].target].source, cand.name
    comparisons = _interpreted(compiled, tmp_path / "few.tpk", MODEL, {"batch": 3})
    for site in (ln_site, rms_site):
        written = [
            c for c in comparisons if c.name.endswith(("_ln", "_rms")) and c.output == site.outputs[-1]
        ]
        assert written and all(c.max_abs_error == 0.0 for c in written), written


SHARED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec
from tests.codegen.gemm_models.gemm_lookup import RMSNorm

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(600)
        self.w1 = nn.Linear(600, 128, bias=False)
        self.w2 = nn.Linear(128, 600)

    def forward(self, x, r):  # the GEMM reads the norm's output a directly; the residual reads it too
        a = self.norm(x + r)
        return a + self.w2(self.w1(a))

batch = Dim("batch", 1, 4, buckets=(1, 3, 4))
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 600)), Input("r", (batch, 600))], dtype="float16")
"""


def test_a_norm_output_the_gemm_reads_directly_and_a_later_step_too_stays_a_prologue(tmp_path):
    """The rule above counts the site's own epilogue among the sum's readers, not its GEMM: A
    read straight by the GEMM (no view between) and by the residual after the next GEMM is
    still a row-norm prologue whose first N tile writes A (OLMo 2's case, 2-D rows), and the
    ``_rms`` form matches the library steps in the interpreter, A exactly."""
    from aot.tracer import load_model_file, trace

    model = tmp_path / "shared.py"
    model.write_text(SHARED)
    compiled = _built(trace(load_model_file(model)), ("vec_1x2x512",))
    first = compiled.program.alternatives[0]
    # and the built-in entry's four rows a block where the norm is the prologue (PROLOGUE_ROWS)
    assert sorted(c.name for c in first.candidates) == [
        "vec_1x2x512",
        "vec_1x2x512_rms",
        "vec_1x4x1024",
        "vec_1x4x1024_rms",
    ]
    a = first.outputs[-1]  # the norm's output, written for the residual
    comparisons = _interpreted(compiled, tmp_path / "shared.tpk", model, {"batch": 1})
    written = [c for c in comparisons if c.name.endswith("_rms") and c.output == a]
    assert written and all(c.max_abs_error == 0.0 for c in written), written
