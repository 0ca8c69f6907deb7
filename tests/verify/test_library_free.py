"""``aotpack tune``'s library-free plan (``aot.verify.tune_rules.library_free_plan``), without a GPU: the
decision on a hand-made program and a fake timer, the table it makes through the loader's checks,
and a bundle built with ``--gemm-candidates`` tuned library-free on paper, whose plans then call
no cuBLAS at any bucket."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from aot import schema, serde
from aot.errors import BundleError
from aot.schema import Buf, GemmCandidate, GemmSite, Program, Step, StepKind, TensorSpec

GEMM_MLP = Path(__file__).resolve().parents[1] / "codegen" / "gemm_models" / "gemm_mlp.py"
BUCKETS = [{"batch": 1}, {"batch": 8}, {"batch": 16}]
LIBRARY_US = 100.0
# what each site's choice saves of the whole program's LIBRARY_US, in the fake timer
SAVES_US = {("gemm_0", "tile_a"): 4.0, ("attn_0", "flash_a"): 1.0, ("gemm_1", "tile_b"): -0.5}


def _aten(target: str, args: tuple, out: str) -> Step:
    return Step(kind=StepKind.ATEN, target=target, args=args, kwargs={}, outputs=(out,))


def _kernel(name: str, reads: tuple[str, ...], out: str) -> Step:
    return Step(
        kind=StepKind.KERNEL, target=name, args=tuple(Buf(r) for r in reads), kwargs={}, outputs=(out,)
    )


def _candidates(reads: tuple[str, ...], out: str, names: tuple[str, ...]) -> tuple[GemmCandidate, ...]:
    return tuple(GemmCandidate(n, (_kernel(f"k_{out}_{n}", reads, out),), tuple(BUCKETS)) for n in names)


def _program(attn_target: str = "aten.relu.default", gemm_1_site: bool = True) -> Program:
    """x @ w1^T, an elementwise step standing for an attention site (the rule goes by site ids),
    then @ w2^T: GEMM sites gemm_0 and gemm_1, attention site attn_0 over ``attn_target``."""

    def spec(*shape: str) -> TensorSpec:
        return TensorSpec("float16", shape)

    steps = (
        _aten("aten.permute.default", (Buf("w1"), [1, 0]), "w1t"),
        _aten("aten.mm.default", (Buf("x"), Buf("w1t")), "h"),
        _aten(attn_target, (Buf("h"),) if "relu" in attn_target else (Buf("h"), Buf("h")), "a"),
        _aten("aten.permute.default", (Buf("w2"), [1, 0]), "w2t"),
        _aten("aten.mm.default", (Buf("a"), Buf("w2t")), "y"),
    )
    sites = [
        GemmSite(
            "gemm_0", (0, 1), ("h",), "batch", 16, 8, _candidates(("x", "w1"), "h", ("tile_a", "tile_b"))
        ),
        GemmSite("attn_0", (2,), ("a",), "batch", 16, 16, _candidates(("h",), "a", ("flash_a",))),
    ]
    if gemm_1_site:
        names = ("tile_a", "tile_b", "tile_c")
        sites.append(GemmSite("gemm_1", (3, 4), ("y",), "batch", 4, 16, _candidates(("a", "w2"), "y", names)))
    return Program(
        inputs=(schema.NamedTensor("x", spec("batch", "8")),),
        weights=(schema.NamedTensor("w1", spec("16", "8")), schema.NamedTensor("w2", spec("4", "16"))),
        buffers={
            "w1t": spec("8", "16"),
            "h": spec("batch", "16"),
            "a": spec("batch", "16"),
            "w2t": spec("16", "4"),
            "y": spec("batch", "4"),
        },
        steps=steps,
        outputs=("y",),
        symbols=(schema.SymbolSource("batch", "x", 0),),
        alternatives=tuple(sites),
    )


def _tuned() -> tuple[list[schema.TuningChoice], list[schema.TuningCheck]]:
    """Choices and checks as tune's per-bucket pass leaves them: at batch 1 gemm_0 and attn_0 won
    and their check kept them, gemm_1 stayed on the library (tile_c refused: its results differed);
    at batch 8 the check set every site back; at batch 16 no site won, so there is no check."""

    def choice(site: str, sizes: dict, chosen: str = "library") -> schema.TuningChoice:
        times = {
            "gemm_0": {"library": 10.0, "tile_a": 9.0, "tile_b": 9.5},
            "attn_0": {"library": 6.0, "flash_a": 3.0},
            "gemm_1": {"library": 5.0, "tile_a": 4.9, "tile_b": 4.8},
        }[site]
        rejected = ("tile_c",) if site == "gemm_1" else ()
        return schema.TuningChoice(0, site, dict(sizes), chosen, times, rejected)

    one, eight, sixteen = BUCKETS
    choices = [
        choice("gemm_0", one, "tile_a"),
        choice("attn_0", one, "flash_a"),
        choice("gemm_1", one),
        *(choice(site, sizes) for sizes in (eight, sixteen) for site in ("gemm_0", "attn_0", "gemm_1")),
    ]
    checks = [
        schema.TuningCheck(0, dict(one), LIBRARY_US, 95.0, True),
        schema.TuningCheck(0, dict(eight), LIBRARY_US, 99.5, False),
    ]
    return choices, checks


class Timer:
    """``time_plans`` as measured: the library takes LIBRARY_US, each chosen form saves SAVES_US
    (``extra``: (sizes, plan) → microseconds added); records every plan it was asked to time."""

    def __init__(self, extra=None):
        self.extra = extra or (lambda sizes, plan: 0.0)
        self.asked: list[tuple[int, dict, list[dict]]] = []

    def __call__(self, program: int, sizes: dict, plans) -> list[float]:
        self.asked.append((program, dict(sizes), [dict(p) for p in plans]))
        return [
            LIBRARY_US - sum(SAVES_US.get(item, 0.0) for item in plan.items()) + self.extra(sizes, plan)
            for plan in plans
        ]


def _decide(programs=None, choices=None, checks=None, timer=None):
    from aot.verify.tune_rules import library_free_plan

    default_choices, default_checks = _tuned()
    programs = programs or [_program()]
    timer = timer or Timer()
    freed = library_free_plan(
        programs,
        [BUCKETS] * len(programs),
        default_choices if choices is None else choices,
        default_checks if checks is None else checks,
        timer,
    )
    return freed, timer


def _chosen_at(choices, sizes: dict) -> dict[str, str]:
    return {c.site: c.choice for c in choices if c.sizes == sizes}


def test_every_gemm_site_takes_its_fastest_matching_candidate():
    freed, timer = _decide()
    assert freed.why_not == "" and freed.adopted
    one, eight, sixteen = BUCKETS
    # gemm_1: tile_b is the fastest that matched; tile_c was refused; attention sites as they were
    assert _chosen_at(freed.choices, one) == {"gemm_0": "tile_a", "attn_0": "flash_a", "gemm_1": "tile_b"}
    for sizes in (eight, sixteen):
        assert _chosen_at(freed.choices, sizes) == {
            "gemm_0": "tile_a",
            "attn_0": "library",
            "gemm_1": "tile_b",
        }
    # the measurements stay as they were
    assert [c.times_us for c in freed.choices] == [c.times_us for c in _tuned()[0]]
    # each bucket timed once: the library, the library-free plan, and the plan that stood if any
    plan_one = {"gemm_0": "tile_a", "attn_0": "flash_a", "gemm_1": "tile_b"}
    plan_rest = {"gemm_0": "tile_a", "gemm_1": "tile_b"}
    assert timer.asked == [
        (0, one, [{}, plan_one, {"gemm_0": "tile_a", "attn_0": "flash_a"}]),
        (0, eight, [{}, plan_rest]),
        (0, sixteen, [{}, plan_rest]),
    ]
    assert [(b.library_us, b.kept_us, b.free_us) for b in freed.timed] == [
        (100.0, 95.0, 95.5),
        (100.0, None, 96.5),
        (100.0, None, 96.5),
    ]
    # one check per bucket it changed, replacing the check's record there
    assert sorted(freed.checks, key=lambda c: c.sizes["batch"]) == [
        schema.TuningCheck(0, one, 100.0, 95.5, True, library_free=True),
        schema.TuningCheck(0, eight, 100.0, 96.5, True, library_free=True),
        schema.TuningCheck(0, sixteen, 100.0, 96.5, True, library_free=True),
    ]


def test_a_refused_candidate_is_never_taken():
    """Even where a table times a candidate it refused (tune itself does not), it stays out."""
    choices = [
        replace(c, times_us={**c.times_us, "tile_c": 1.0}) if c.site == "gemm_1" else c for c in _tuned()[0]
    ]
    freed, _ = _decide(choices=choices)
    assert freed.adopted and {c.choice for c in freed.choices if c.site == "gemm_1"} == {"tile_b"}


def _unchanged(freed) -> None:
    choices, checks = _tuned()
    assert not freed.adopted
    assert list(freed.choices) == choices and list(freed.checks) == checks


@pytest.mark.parametrize(
    "extra, timed",
    [
        # 6.5% slower than the library at batch 16: the last bucket loses, nothing changes
        (lambda sizes, plan: 10.0 if sizes["batch"] == 16 and "gemm_1" in plan else 0.0, 3),
        # within 2% of the library at batch 1 (100.5), but 5.8% slower than the plan that stood (95)
        (lambda sizes, plan: 5.0 if sizes["batch"] == 1 and "gemm_1" in plan else 0.0, 1),
    ],
)
def test_one_bucket_beyond_the_margin_keeps_every_choice(extra, timed):
    freed, timer = _decide(timer=Timer(extra))
    _unchanged(freed)
    assert freed.why_not == "" and len(freed.timed) == timed  # stops at the first bucket that loses
    assert not freed.timed[-1].within and all(b.within for b in freed.timed[:-1])


def test_the_margin_is_two_percent_of_the_library_and_of_the_plan_that_stood():
    from aot.verify.tune_rules import FREE_MAX_LOSS, FreeBucket

    assert FREE_MAX_LOSS == 0.02
    assert FreeBucket(0, {}, {}, 100.0, None, 102.0).within
    assert not FreeBucket(0, {}, {}, 100.0, None, 102.01).within
    assert FreeBucket(0, {}, {}, 100.0, 95.0, 96.85).within
    assert not FreeBucket(0, {}, {}, 100.0, 95.0, 97.0).within
    assert not FreeBucket(0, {}, {}, 90.0, 95.0, 92.0).within  # a plan that stood slower: the library counts


def test_a_site_without_a_matching_candidate_at_one_bucket_keeps_every_choice():
    choices, _ = _tuned()
    last = next(i for i, c in enumerate(choices) if c.site == "gemm_1" and c.sizes == BUCKETS[2])
    choices[last] = replace(choices[last], times_us={"library": 5.0}, rejected=("tile_a", "tile_b", "tile_c"))
    freed, timer = _decide(choices=choices)
    assert (
        "GEMM site gemm_1 of program 0 has no candidate that matched the library at batch=16" in freed.why_not
    )
    assert not freed.adopted and freed.choices == tuple(choices) and not timer.asked


def test_a_bucket_left_untimed_keeps_every_choice():
    """--bucket, --entry, or no candidate compiled for a bucket: the library runs there."""
    choices = [c for c in _tuned()[0] if c.sizes != BUCKETS[2]]
    freed, timer = _decide(choices=choices)
    assert "GEMM site gemm_0 of program 0 was not timed at batch=16" in freed.why_not
    assert not freed.adopted and not timer.asked


@pytest.mark.parametrize(
    "programs, step",
    [
        ([_program(gemm_1_site=False)], "program 0 step 4 (aten.mm.default)"),  # a GEMM outside any site
        ([_program(attn_target="aten.bmm.default")], "program 0 step 2 (aten.bmm.default)"),  # inside attn_0
        ([_program(), _program(gemm_1_site=False)], "program 1 step 4 (aten.mm.default)"),  # another program
    ],
)
def test_a_cublas_call_outside_the_gemm_sites_keeps_every_choice(programs, step):
    choices, checks = _tuned()
    if len(programs[0].alternatives) == 2:
        choices = [c for c in choices if c.site != "gemm_1"]
    freed, timer = _decide(programs=programs, choices=choices)
    assert freed.why_not == f"{step} calls cuBLAS outside any GEMM site"
    assert not freed.adopted and freed.choices == tuple(choices) and freed.checks == tuple(checks)
    assert not timer.asked


def test_already_library_free_times_nothing():
    choices = [replace(c, choice="tile_a") if c.site.startswith("gemm_") else c for c in _tuned()[0]]
    freed, timer = _decide(choices=choices)
    assert freed.why_not == "" and not freed.adopted and not freed.timed and not timer.asked


def test_which_ops_count_as_cublas():
    from aot.allowed_ops import ALLOWED_OPS
    from aot.codegen.gemm_sites import GEMM_TARGETS
    from aot.loader.gpu import TAIL_PRODUCERS
    from aot.program import calls_cublas

    def step(target: str, kind: StepKind = StepKind.ATEN) -> Step:
        return Step(kind=kind, target=target, args=(), kwargs={}, outputs=("o",))

    # of what a bundle may call, these five (cdist's euclidean distance is a matrix product on the
    # GPU); attention and convolution call other libraries
    assert {t for t in ALLOWED_OPS if calls_cublas(step(t))} == {
        "aten._cdist_forward.default",
        "aten.mm.default",
        "aten.addmm.default",
        "aten._addmm_activation.default",
        "aten.bmm.default",
    }
    assert all(calls_cublas(step(t)) for t in GEMM_TARGETS)
    assert {t for t in TAIL_PRODUCERS if not calls_cublas(step(t))} == {"aten.convolution.default"}
    assert calls_cublas(step("aten.baddbmm.default")) and calls_cublas(step("aten.linear.default"))
    assert not calls_cublas(step("aten.mm.default", StepKind.KERNEL))
    assert not calls_cublas(step("aten.scaled_dot_product_attention.default"))


# ---------------------------------------------------------------------------------------------
# The table it makes, through the loader's checks


def _table(freed):
    from aot.verify.tuning_table import make_table

    return make_table("sm_90", "Test GPU", list(freed.choices), checks=list(freed.checks))


def test_the_table_round_trips_through_the_loaders_checks():
    from aot.loader.tuning import parse_tuning
    from aot.verify.tuning_table import tuning_bytes

    program = _program()
    freed, _ = _decide()
    table = _table(freed)
    data = tuning_bytes(table)
    assert parse_tuning(data, [program], [(schema.Bucket("batch", (1, 8, 16)),)]) == table
    assert json.loads(data)["checks"][0]["library_free"] is True
    # a check kept on its own merit is written as before the field existed
    kept = _table(replace(freed, checks=(schema.TuningCheck(0, {"batch": 1}, 100.0, 95.0, True),)))
    assert b"library_free" not in tuning_bytes(kept)


HOSTILE = {
    "not kept": (lambda check: check.update(kept=False), "library_free says the choices stand"),
    "not a boolean": (lambda check: check.update(library_free="yes"), "a boolean"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_library_free_checks_are_refused(case):
    from aot.loader.tuning import parse_tuning

    edit, message = HOSTILE[case]
    tree = serde.to_json(_table(_decide()[0]))
    edit(tree["checks"][0])
    if case == "not kept":  # the choices set back too, so only the new field is at fault
        sizes = tree["checks"][0]["sizes"]
        for c in tree["choices"]:
            c["choice"] = "library" if c["sizes"] == sizes else c["choice"]
    with pytest.raises(BundleError, match=message):
        parse_tuning(json.dumps(tree).encode(), [_program()], [(schema.Bucket("batch", (1, 8, 16)),)])


def test_a_library_free_check_where_a_gemm_site_runs_the_library_is_refused():
    from aot.loader.tuning import parse_tuning

    tree = serde.to_json(_table(_decide()[0]))
    sizes = tree["checks"][0]["sizes"]
    for c in tree["choices"]:
        if c["sizes"] == sizes and c["site"] == "gemm_1":
            c["choice"] = "library"
    with pytest.raises(BundleError, match="library_free, yet GEMM site 'gemm_1' runs the library there"):
        parse_tuning(json.dumps(tree).encode(), [_program()], [(schema.Bucket("batch", (1, 8, 16)),)])


# ---------------------------------------------------------------------------------------------
# A bundle built with --gemm-candidates


# A one-row form and a form of any row count: a candidate at every bucket, two kernels per site
# compiled instead of every form's
FORMS = ("vec_1x2x512", "tile_64x128x64")


@pytest.fixture(scope="module")
def gemm_mlp(tmp_path_factory):
    from aot.codegen import gemm_forms, generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from tests.codegen.conftest import forms_offered

    path = tmp_path_factory.mktemp("library_free") / "gemm_mlp.tpk"
    with forms_offered(tuple(c for c in gemm_forms.CONFIGS if c.name in FORMS)):
        compiled = generate(trace(load_model_file(GEMM_MLP)), ("sm_90",), gemm_candidates=True)
    pack(compiled, path)
    return path


def test_a_library_free_bundle_calls_no_cublas_at_any_bucket(gemm_mlp, tmp_path):
    """gemm_mlp's two GEMM sites, the library chosen everywhere and set back at batch 16: the
    library-free plan (timed on paper) puts both on a candidate at every bucket; the written bundle
    says schema 1.6 (a loader that does not know the field refuses it as too new), and each
    bucket's plan launches no cuBLAS call."""
    from aot.cli.reports import bundle_summary, summary_text
    from aot.loader import load
    from aot.loader.tuning import tuned_plans
    from aot.program import calls_cublas
    from aot.verify import tune_rules, tuning_table
    from tests.hostile_util import (
        manifest_bytes,
        manifest_of,
        read_entries,
        with_manifest_text,
        write_entries,
    )

    runner = load(gemm_mlp)
    program = runner.program
    assert any(calls_cublas(s) for s in program.steps)  # the untuned bundle calls cuBLAS
    buckets = [{"batch": b} for b in runner.manifest.buckets[0].sizes]
    choices = []
    for site in program.alternatives:
        for sizes in buckets:
            times = {"library": 10.0} | {c.name: 9.9 for c in site.candidates if sizes in c.buckets}
            choices.append(schema.TuningChoice(0, site.id, sizes, "library", times))
    checks = [schema.TuningCheck(0, {"batch": 16}, 30.0, 29.9, False)]
    freed = tune_rules.library_free_plan(
        [program], [buckets], choices, checks, lambda i, sizes, plans: [30.0, 30.2, 29.0][: len(plans)]
    )
    assert freed.adopted and len(freed.timed) == len(buckets)
    table = _table(freed)
    assert all(c.library_free and c.kept for c in table.checks) and len(table.checks) == len(buckets)

    entries = read_entries(gemm_mlp.read_bytes())
    older = dict(manifest_of(entries), schema_version=[1, 3])
    (tmp_path / "old.tpk").write_bytes(write_entries(with_manifest_text(entries, manifest_bytes(older))))
    tuning_table.write_tuned(tmp_path / "old.tpk", tmp_path / "free.tpk", table)
    tuned = load(tmp_path / "free.tpk")
    assert tuned.manifest.schema_version == tuning_table.LIBRARY_FREE_SCHEMA == (1, 6)
    assert tuned.tuning == table
    plans = tuned_plans(tuned.tuning, 0, tuned.program, "sm_90")
    assert sorted(plans) == [(b["batch"],) for b in buckets]
    for key, steps in plans.items():
        assert not any(calls_cublas(s) for s in steps), key
    m, info = bundle_summary(str(tmp_path / "free.tpk"))
    note = f"; {len(buckets)} bucket(s) kept library-free (every GEMM site on a candidate, no cuBLAS)"
    assert note in summary_text(m, info)
    # the same choices kept on their own merit: the schema the checks need, no more
    tuning_table.write_tuned(tmp_path / "old.tpk", tmp_path / "kept.tpk", replace(table, checks=()))
    assert load(tmp_path / "kept.tpk").manifest.schema_version == (1, 3)


@pytest.mark.parametrize("flag, library_free", [((), True), (("--no-library-free",), False)])
def test_tune_cli_passes_no_library_free_on_and_counts_library_free_buckets(monkeypatch, flag, library_free):
    """The CLI without a GPU: tune itself replaced by one that records what it was asked."""
    import torch
    from click.testing import CliRunner

    from aot.cli.commands import cli
    from aot.verify import tune as tune_mod

    asked = {}
    freed, _ = _decide()
    table = _table(freed)

    def fake_tune(path, output, buckets, repeats, device, say, entries, library_free):
        asked["library_free"] = library_free
        return tune_mod.TuneResult(table, Path(path), False)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    result = CliRunner().invoke(cli, ["tune", "b.tpk", *flag])
    assert result.exit_code == 0, result.output
    assert asked == {"library_free": library_free}
    assert (
        "wrote b.tpk: 7/9 site-buckets use a Triton candidate on Test GPU (sm_90); "
        "3 bucket(s) kept library-free (every GEMM site on a candidate, no cuBLAS)"
    ) in result.output
