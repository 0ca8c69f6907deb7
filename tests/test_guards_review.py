"""Guard-manifest review: the text format (golden, round trip, parser errors), ``aotpack diff``'s
classification of every change class (golden reports built from pairs of small model files in
tests/data/guards/), the exact set comparison, exit codes through the CLI, and that the fast
trace-only path gives the same manifest as a full build.

Goldens live under tests/golden/; regenerate them with ``AOTPACK_UPDATE_GOLDEN=1 pytest
tests/test_guards_review.py`` and review the ``git diff`` like any other manifest change.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from aot.admissible import admits
from aot.errors import BundleError
from aot.manifest_text import GuardManifest, canonical, manifest_of_bundle, parse_guards_text, render_manifest
from aot.review import (
    EXIT_BREAKING,
    EXIT_ERROR,
    EXIT_SAFE,
    EXIT_SAME,
    Side,
    diff,
    diff_manifests,
    difference,
    read_side,
)
from aot.schema import SCHEMA_VERSION, GuardSource, InputGuard, Relation, SymbolGuard
from tests.conftest import HANG_GUARD_S, ROOT, model_path

GOLDEN = Path(__file__).resolve().parent / "golden"
FIXTURES = Path(__file__).resolve().parent / "data" / "guards"
UPDATE = os.environ.get("AOTPACK_UPDATE_GOLDEN") == "1"
ARCHS = ("sm_80", "sm_90")
# gpt and cnn take tens of seconds to trace and build: slow (CI runs them; the default run leaves them out)
EXAMPLES = (
    "mlp",
    pytest.param("gpt", marks=pytest.mark.slow),
    pytest.param("cnn", marks=pytest.mark.slow),
    "branchy",
)
FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("*.py"))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"no golden {path}; create it with AOTPACK_UPDATE_GOLDEN=1"
    expected = path.read_text()
    assert text == expected, "golden mismatch (AOTPACK_UPDATE_GOLDEN=1 regenerates):\n" + "".join(
        difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now")
    )


def fixture_path(name: str) -> Path:
    return FIXTURES / f"{name}.py" if (FIXTURES / f"{name}.py").is_file() else model_path(name)


@functools.cache
def traced(name: str) -> GuardManifest:
    """The trace-only manifest of an example model or a fixture, once per session."""
    from aot.tracer import guard_manifest, load_model_file

    return guard_manifest(load_model_file(fixture_path(name)), ARCHS)


def side(name: str) -> Side:
    return Side(name, traced(name))


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    """``aotpack ARGS`` in this process: (exit status, stdout, stderr)."""
    from aot.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


# ---------------------------------------------------------------------------------------------
# The manifest text.


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_manifest_golden(name):
    check_golden(f"guards/models/{name}.guards", render_manifest(traced(name)))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_manifest_golden(name):
    check_golden(f"guards/fixtures/{name}.guards", render_manifest(traced(name)))


@pytest.mark.parametrize("name", EXAMPLES + ("branch", "reshape", "input_added"))
def test_text_round_trips(name):
    """Also for guard lines whose code has runs of spaces (``if T > 8:  # long sequences``)."""
    m = traced(name)
    text = render_manifest(m)
    parsed = parse_guards_text(text)
    assert parsed == canonical(m)
    assert render_manifest(parsed) == text
    assert diff_manifests(parsed, m) == []  # a committed manifest matches a fresh trace
    # nothing machine-specific: no absolute path, no build versions
    assert str(ROOT) not in text and not re.search(r"(^|\s)/\w", text)
    assert m.environment.torch_built and m.environment.torch_built not in text.replace(">= ", "")


def test_text_is_sorted_and_order_invariant():
    m = traced("branchy")
    g = m.guards
    shuffled = replace(
        m,
        guards=replace(g, symbols=g.symbols[::-1]),
        buckets=m.buckets[::-1],
        environment=replace(m.environment, archs=("sm_90", "sm_80")),
    )
    assert render_manifest(shuffled) == render_manifest(m)
    seq = next(s for s in m.guards.symbols if s.name == "seq")
    assert [src.line for src in seq.sources] == sorted(src.line for src in seq.sources)
    lines = render_manifest(m).splitlines()
    assert lines.index("symbol batch: 1 <= batch <= 16  (declared 1..16)") < lines.index(
        "symbol seq: 10 <= seq <= 256, seq % 2 == 0  (declared 1..256)"
    )


def test_every_line_kind_round_trips():
    """Relations, specializations, residues with several values, exclusions, paddable buckets,
    CPU-only archs and guards without code: everything the format can hold parses back."""
    text = render_manifest(traced("branchy"))
    text = (
        text.replace(
            "symbol seq: 10 <= seq <= 256, seq % 2 == 0  (declared 1..256)",
            "symbol seq: 10 <= seq <= 250, (seq % 4 == 0 or seq % 4 == 2), seq != 12, seq != 14  (declared 1..256)\n"
            "  guard seq != 12  at <torch>:0",
        )
        .replace(
            "bucket batch: 1, 2, 4, 8, 16",
            "relation batch*seq <= 2048  at tests/data/branchy.py:18  return x\n"
            "specialized batch == 3  at tests/data/branchy.py:19  y = x[:3]\n\n"
            "bucket batch: 1, 2, 4, 8, 16  paddable",
        )
        .replace("env archs sm_80, sm_90", "env archs (none: CPU only)")
    )
    m = parse_guards_text(text)
    seq = next(s for s in m.guards.symbols if s.name == "seq")
    assert (seq.min, seq.max, seq.modulus, seq.residues, seq.excluded) == (10, 250, 4, (0, 2), (12, 14))
    assert GuardSource("seq != 12", "<torch>", 0, "") in seq.sources
    assert m.guards.relations == (
        Relation(
            "batch*seq <= 2048", GuardSource("batch*seq <= 2048", "tests/data/branchy.py", 18, "return x")
        ),
    )
    assert m.guards.specializations[0].text == "batch == 3"
    assert m.buckets[0].paddable and m.environment.archs == ()
    again = render_manifest(m)
    assert parse_guards_text(again) == m
    # the text is canonical: what we wrote is what render_manifest writes (relations after symbols, etc.)
    assert render_manifest(parse_guards_text(again)) == again


@pytest.mark.parametrize(
    "edit, message",
    [
        (("input x: float32[batch, seq, 16]", "input x float32[batch, seq, 16]"), "line 6: expected one of"),
        (("seq % 2 == 0  (declared", "seq % 99999 == 0  (declared"), "one modulus in 2..1024"),
        (("10 <= seq <= 256", "300 <= seq <= 256"), "LO <= HI"),
        (("10 <= seq <= 256", "10 <= batch <= 256"), "`LO <= seq <= HI`"),
        (("symbol batch: 1 <= batch <= 16  (declared 1..16)\n", ""), "no symbol batch"),
        (("model branchy\n", ""), "no model NAME line"),
        (("env archs sm_80, sm_90\n", ""), "no env archs line"),
        (("bucket seq: 16", "bucket seq: 16, x"), "expected one of"),
        (("bucket batch", "bucket other"), "buckets only for declared symbols"),
        (
            ("input x: float32[batch, seq, 16]", "input x: float32[batch, seq, 16]\ninput x: float32[1]"),
            "each input once",
        ),
        (
            ("  guard seq >= 9  at tests/data/branchy.py:15", "  guard seq >= 9  at tests/data/branchy.py"),
            "expected one of",
        ),
    ],
)
def test_parse_errors_name_the_line_and_what_was_expected(edit, message):
    text = render_manifest(traced("branchy")).replace(*edit)
    assert text != render_manifest(traced("branchy"))
    with pytest.raises(BundleError, match=r"^my\.guards line \d+: expected .*regenerate the file") as e:
        parse_guards_text(text, "my.guards")
    assert message in str(e.value)


# ---------------------------------------------------------------------------------------------
# The diff of every change class, from pairs of model files.

# (old, new, exit status, the kinds of change it must report)
PAIRS = [
    ("base", "base", EXIT_SAME, set()),
    ("base", "narrowed", EXIT_BREAKING, {"narrowed", "bucket"}),
    ("base", "widened", EXIT_SAFE, {"widened", "bucket"}),
    ("base", "static", EXIT_BREAKING, {"specialized", "bucket"}),
    # a branch on T no longer narrows: the build traces a second program for the other side
    ("base", "branch", EXIT_SAFE, {"new guard", "program"}),
    ("base", "reshape", EXIT_BREAKING, {"narrowed", "new guard", "bucket"}),
    ("base", "dtype", EXIT_BREAKING, {"dtype"}),
    ("base", "input_added", EXIT_BREAKING, {"input added"}),
    ("input_added", "base", EXIT_BREAKING, {"input removed"}),
    ("base", "rank", EXIT_BREAKING, {"rank", "bucket"}),
    ("branch", "base", EXIT_SAFE, {"removed guard", "program"}),
    ("branch", "branch_moved", EXIT_SAFE, {"moved guard"}),
    ("base", "buckets", EXIT_SAFE, {"bucket"}),
]


@pytest.mark.parametrize("old, new, code, kinds", PAIRS, ids=[f"{a}-{b}" for a, b, _, _ in PAIRS])
def test_diff_golden(old, new, code, kinds):
    result = diff(side(old), side(new))
    assert result.exit_code == code
    assert {c.kind for c in result.changes} == kinds
    check_golden(f"diff/{old}--{new}.txt", result.text())


def test_diff_exact_sets_in_the_reports():
    narrowed = diff(side("base"), side("narrowed")).changes[0]
    assert (narrowed.old, narrowed.new) == ("1 <= seq <= 64", "1 <= seq <= 32")
    assert "no longer accepted: seq in 33..64 (32 sizes)" in narrowed.details
    reshape = next(c for c in diff(side("base"), side("reshape")).changes if c.kind == "narrowed")
    assert "no longer accepted: seq in 1..63 step 2 (32 sizes)" in reshape.details
    guard = next(c for c in diff(side("base"), side("reshape")).changes if c.kind == "new guard")
    assert guard.new == (
        "seq % 2 == 0  at tests/data/guards/reshape.py:17  x = x.reshape(B, T // 2, 2 * C).reshape(B, T, C)"
    )
    static = diff(side("base"), side("static")).changes[0]
    assert static.subject == "input x dim 1" and static.new == "16"


def test_diff_json_golden():
    result = diff(side("base"), side("reshape"))
    data = result.to_json()
    assert data["verdict"] == "breaking" and data["exit_code"] == EXIT_BREAKING
    assert [c["kind"] for c in data["changes"]] == ["narrowed", "new guard", "bucket"]
    assert all(
        set(c) == {"kind", "breaking", "subject", "old", "new", "summary", "details"} for c in data["changes"]
    )
    check_golden("diff/base--reshape.json", json.dumps(data, indent=1, sort_keys=True) + "\n")


def _edited(name: str, *edits: tuple[str, str]) -> GuardManifest:
    text = render_manifest(traced(name))
    for a, b in edits:
        assert a in text, a
        text = text.replace(a, b)
    return parse_guards_text(text)


_MAJOR, _MINOR = SCHEMA_VERSION
# (edit to the base manifest, kind of change, breaking, kind of the reverse change, breaking)
ENV_EDITS = [
    (("env archs sm_80, sm_90", "env archs sm_90"), "arch dropped", True, "arch added", False),
    (("env archs sm_80, sm_90", "env archs sm_80, sm_90, sm_100"), "arch added", False, "arch dropped", True),
    ((f"env schema {_MAJOR}.{_MINOR}", f"env schema {_MAJOR}.{_MINOR + 1}"), "schema", True, "schema", False),
    ((f"env schema {_MAJOR}.{_MINOR}", f"env schema {_MAJOR + 1}.0"), "schema", True, "schema", True),
    (("env torch >= 2.11", "env torch >= 2.12"), "torch", True, "torch", False),
    (("model net", "model net2"), "model", False, "model", False),
    (("dtype float32", "dtype bfloat16"), "dtype", True, "dtype", True),
]


@pytest.mark.parametrize("edit, kind, breaking, back_kind, back_breaking", ENV_EDITS)
def test_environment_changes(edit, kind, breaking, back_kind, back_breaking):
    changes = diff_manifests(traced("base"), _edited("base", edit))
    assert [(c.kind, c.breaking) for c in changes] == [(kind, breaking)]
    back = diff_manifests(_edited("base", edit), traced("base"))
    assert [(c.kind, c.breaking) for c in back] == [(back_kind, back_breaking)]


def _manifest(inputs, symbols, relations=()) -> GuardManifest:
    base = traced("base")
    return replace(
        base,
        guards=replace(base.guards, inputs=tuple(inputs), symbols=tuple(symbols), relations=tuple(relations)),
        buckets=(),
    )


def _sym(name, lo, hi, **kw) -> SymbolGuard:
    return SymbolGuard(
        name=name, declared_min=kw.pop("dlo", lo), declared_max=kw.pop("dhi", hi), min=lo, max=hi, **kw
    )


def test_dims_that_must_now_be_equal_are_narrowed():
    apart = _manifest(
        [InputGuard("x", "float32", ("b", "s")), InputGuard("y", "float32", ("b", "t"))],
        [_sym("b", 1, 8), _sym("s", 1, 64), _sym("t", 1, 64)],
    )
    tied = _manifest(
        [InputGuard("x", "float32", ("b", "s")), InputGuard("y", "float32", ("b", "s"))],
        [_sym("b", 1, 8), _sym("s", 1, 64)],
    )
    narrowed = diff_manifests(apart, tied)
    assert [(c.kind, c.breaking) for c in narrowed] == [("narrowed", True)]
    assert "dims x.shape[1], y.shape[1] must now be equal" in narrowed[0].details[0]
    widened = diff_manifests(tied, apart)
    assert [(c.kind, c.breaking) for c in widened] == [("widened", False)]


def test_renamed_symbol_is_safe_and_its_sets_still_compared():
    old = _manifest([InputGuard("x", "float32", ("T",))], [_sym("T", 1, 64)])
    same = _manifest([InputGuard("x", "float32", ("seq",))], [_sym("seq", 1, 64)])
    assert [c.kind for c in diff_manifests(old, same)] == ["renamed"]
    smaller = _manifest([InputGuard("x", "float32", ("seq",))], [_sym("seq", 1, 32)])
    assert [(c.kind, c.breaking) for c in diff_manifests(old, smaller)] == [
        ("renamed", False),
        ("narrowed", True),
    ]


def test_static_size_changes_and_generalization():
    static = _manifest([InputGuard("x", "float32", ("16",))], [])
    other = _manifest([InputGuard("x", "float32", ("32",))], [])
    dynamic = _manifest([InputGuard("x", "float32", ("s",))], [_sym("s", 1, 64)])
    excluding = _manifest([InputGuard("x", "float32", ("s",))], [_sym("s", 17, 64)])
    assert [(c.kind, c.details) for c in diff_manifests(static, other)] == [
        ("narrowed", ("no longer accepted: size in 16 (1 size)", "newly accepted: size in 32 (1 size)"))
    ]
    assert [c.kind for c in diff_manifests(static, dynamic)] == ["widened"]
    assert [c.kind for c in diff_manifests(static, excluding)] == ["narrowed"]
    assert [c.kind for c in diff_manifests(dynamic, static)] == ["specialized"]


def test_declared_range_change_without_effect_is_reported_as_safe():
    old = _manifest([InputGuard("x", "float32", ("s",))], [_sym("s", 1, 64, dlo=1, dhi=64)])
    new = _manifest([InputGuard("x", "float32", ("s",))], [_sym("s", 1, 64, dlo=1, dhi=128)])
    changes = diff_manifests(old, new)
    assert [(c.kind, c.breaking, c.old, c.new) for c in changes] == [("declared", False, "1..64", "1..128")]


def test_relations_new_is_breaking_removed_and_moved_are_safe():
    inputs = [InputGuard("x", "float32", ("b", "s"))]
    symbols = [_sym("b", 1, 8), _sym("s", 1, 64)]
    rel = Relation("b*s <= 256", GuardSource("b*s <= 256", "m.py", 10, "y = x.view(-1)"))
    moved = Relation("b*s <= 256", GuardSource("b*s <= 256", "m.py", 12, "y = x.view(-1)"))
    none, one, two = (_manifest(inputs, symbols, r) for r in ((), (rel,), (moved,)))
    assert [(c.kind, c.breaking) for c in diff_manifests(none, one)] == [("new relation", True)]
    assert [(c.kind, c.breaking) for c in diff_manifests(one, none)] == [("removed guard", False)]
    assert [(c.kind, c.breaking) for c in diff_manifests(one, two)] == [("moved guard", False)]


# ---------------------------------------------------------------------------------------------
# The exact comparison of admissible sets.


def _brute(a: SymbolGuard, b: SymbolGuard) -> list[int]:
    return [v for v in range(min(a.min, b.min), max(a.max, b.max) + 1) if admits(a, v) and not admits(b, v)]


def _random_set(rng: random.Random, name: str) -> SymbolGuard:
    lo = rng.randint(1, 300)
    hi = lo + rng.randint(0, 700)
    m = rng.choice([1, 1, 2, 3, 4, 6, 8, 12, 64])
    residues = tuple(sorted(rng.sample(range(m), rng.randint(1, m)))) if m > 1 else (0,)
    excluded = tuple(sorted(rng.sample(range(lo, hi + 1), min(hi - lo + 1, rng.randint(0, 3)))))
    return SymbolGuard(name, 1, 1000, lo, hi, m, residues, excluded)


def test_difference_matches_brute_force():
    rng = random.Random(0)
    for _ in range(400):
        a, b = _random_set(rng, "a"), _random_set(rng, "b")
        expected = _brute(a, b)
        got = difference(a, b, limit=10**6)
        assert got.count == len(expected), (a, b)
        listed = [v for first, last in got.runs for v in range(first, last + 1)]
        assert listed == expected and not got.more, (a, b)
        if expected:
            assert got.last == expected[-1]
        shown = difference(a, b, limit=3)
        assert [v for f, l_ in shown.runs for v in range(f, l_ + 1)] == expected[
            : len([v for f, l_ in shown.runs for v in range(f, l_ + 1)])
        ]
        assert shown.count == len(expected)


def test_difference_over_the_largest_ranges_is_exact_and_fast(monkeypatch):
    import aot.review.sets as sets

    big = (1 << 31) - 1
    a = SymbolGuard("s", 1, big, 1, big)
    b = SymbolGuard("s", 1, big, 2, big - 5, modulus=6, residues=(0, 2), excluded=(12, 1 << 30))
    # the work is one period (6) per segment (a handful of cuts), not the 2**31 sizes of the range:
    # membership tests are counted, and refused past a bound far below the range's size
    real, tests = sets.admits, []

    def counted(guard, v):
        tests.append(v)
        assert len(tests) <= 1000, "difference() tests sizes one by one over the range"
        return real(guard, v)

    monkeypatch.setattr(sets, "admits", counted)
    lost = difference(a, b)
    assert 0 < len(tests) <= 2 * 6 * 8
    # members of b: v in [2, big-5] with v % 6 in {0, 2}, counted per residue, less 12 (1<<30 % 6 == 4)
    in_b = sum((big - 5 - r) // 6 - (2 - 1 - r) // 6 for r in (0, 2)) - 1
    assert lost.count == big - in_b
    assert lost.runs[0] == (1, 1) and lost.last == big
    assert difference(b, a).count == 0


# ---------------------------------------------------------------------------------------------
# Bundles: kernels, buckets, weights.


def test_bundle_diff_reports_buckets_and_weights(tmp_path):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    paths = {}
    for name in ("base", "buckets"):
        paths[name] = tmp_path / f"{name}.tpk"
        pack(generate(trace(load_model_file(fixture_path(name))), ARCHS), paths[name])
    same = diff(read_side(str(paths["base"])), read_side(str(paths["base"])))
    assert same.exit_code == EXIT_SAME
    result = diff(read_side(str(paths["base"])), read_side(str(paths["buckets"])))
    kinds = [c.kind for c in result.changes]
    assert result.exit_code == EXIT_SAFE and kinds[0] == "bucket" and kinds[-1] == "weights", kinds
    weights = result.changes[-1]
    assert weights.summary == "weights: 2 of 2 tensors differ"
    assert weights.details == ("values changed: proj.bias, proj.weight",)
    # a bundle against the committed text of the same model: guards only, no change
    text = tmp_path / "base.guards"
    text.write_text(render_manifest(traced("base")))
    assert diff(read_side(str(text)), read_side(str(paths["base"]))).exit_code == EXIT_SAME


def test_kernel_changes_by_id_and_name():
    from aot.review.bundle_changes import _kernel_changes
    from aot.schema import Kernel

    def kernel(kid, name, ops):
        return Kernel(
            id=kid,
            name=name,
            source="",
            params=(),
            num_warps=4,
            num_stages=1,
            shared={},
            archs=ARCHS,
            ops=ops,
            config={},
            bytes_moved="0",
        )

    old = (
        kernel("k1", "fused_gelu", ("aten.mul.Tensor", "aten.tanh.default")),
        kernel("k2", "norm", ("aten.mean.dim",)),
    )
    new = (kernel("k3", "fused_gelu", ("aten.mul.Tensor",)), kernel("k4", "softmax", ("aten.exp.default",)))
    changes = _kernel_changes(old, new)
    assert [c.summary for c in changes] == [
        "kernel fused_gelu changed: k1 -> k3",
        "kernel removed: norm 1 ops [aten.mean.dim]",
        "kernel added: softmax 1 ops [aten.exp.default]",
    ]
    assert not any(c.breaking for c in changes)


# ---------------------------------------------------------------------------------------------
# The command line: guards -o, diff and check exit codes.


@pytest.fixture
def guards_files(tmp_path, monkeypatch):
    """Manifest files of the fixtures in tmp_path, and the cwd set to the repository root."""
    monkeypatch.chdir(ROOT)
    files = {}
    for name in ("base", "narrowed", "widened"):
        files[name] = tmp_path / f"{name}.guards"
        files[name].write_text(render_manifest(traced(name)))
    return files


def test_cli_diff_exit_codes(guards_files, capsys, tmp_path):
    f = {k: str(v) for k, v in guards_files.items()}
    assert run_cli("diff", f["base"], f["base"], capsys=capsys) == (0, "no changes (exit 0)\n", "")
    code, out, _ = run_cli("diff", f["base"], f["widened"], capsys=capsys)
    assert code == EXIT_SAFE and out.startswith("safe      widened") and out.endswith("(exit 1)\n")
    code, out, _ = run_cli("diff", f["base"], f["narrowed"], capsys=capsys)
    assert code == EXIT_BREAKING and out.startswith("BREAKING  narrowed")
    code, out, _ = run_cli("diff", "--json", f["base"], f["narrowed"], capsys=capsys)
    data = json.loads(out)
    assert code == EXIT_BREAKING and data["verdict"] == "breaking" and data["old"] == f["base"]
    # a model file on one side is traced
    code, out, _ = run_cli("diff", "tests/data/guards/base.py", f["narrowed"], capsys=capsys)
    assert code == EXIT_BREAKING
    # failures to run exit 4, never 1 or 2
    junk = tmp_path / "junk.guards"
    junk.write_text("this is not a manifest\n")
    for args in (
        (f["base"], str(tmp_path / "missing.guards")),
        (f["base"], str(junk)),
        (f["base"],),
        ("--bogus", f["base"], f["base"]),
        (f["base"], "tests/data/untraceable.py"),
    ):
        code, out, err = run_cli("diff", *args, capsys=capsys)
        assert code == EXIT_ERROR, (args, code, err)
        assert "Traceback" not in err and err.strip()


def test_cli_check_gate(guards_files, capsys, tmp_path):
    base = str(guards_files["base"])
    code, out, _ = run_cli("check", "tests/data/guards/base.py", "--against", base, capsys=capsys)
    assert (code, out) == (0, f"{base} matches tests/data/guards/base.py\n")
    # comments and blank lines in the committed file do not matter; contents do
    edited = tmp_path / "edited.guards"
    edited.write_text("# reviewed\n\n" + guards_files["base"].read_text())
    assert run_cli("check", "tests/data/guards/base.py", "--against", str(edited), capsys=capsys)[0] == 0
    # any difference fails the gate with exit 2, safe or breaking, and prints the diff
    for model in ("widened", "narrowed"):
        code, out, err = run_cli("check", f"tests/data/guards/{model}.py", "--against", base, capsys=capsys)
        assert code == EXIT_BREAKING, (model, err)
        assert f"+++ tests/data/guards/{model}.py (traced now)" in out
        assert err.startswith(f"error: {base} is stale")
    code, out, err = run_cli("check", "tests/data/guards/narrowed.py", "--against", base, capsys=capsys)
    check_golden("check/base--narrowed.txt", out.replace(base, "base.guards"))
    assert "with breaking changes" in err
    code, out, _ = run_cli(
        "check", "--json", "tests/data/guards/widened.py", "--against", base, capsys=capsys
    )
    data = json.loads(out)
    assert code == EXIT_BREAKING and data["stale"] and data["verdict"] == "safe"
    assert (
        run_cli("check", "tests/data/guards/base.py", "--against", str(tmp_path / "none"), capsys=capsys)[0]
        == 4
    )
    assert run_cli("check", "tests/data/guards/base.py", capsys=capsys)[0] == 4  # --against is required


def test_cli_guards_writes_the_file_and_normalizes_text(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "b.guards"
    code, _, err = run_cli(
        "guards", "tests/data/guards/branch.py", "-o", str(out), "--arch", "sm_90,sm_80", capsys=capsys
    )
    assert code == 0 and f"wrote {out}" in err
    assert out.read_text() == render_manifest(traced("branch"))  # archs are sorted, whatever --arch's order
    noisy = tmp_path / "noisy.guards"
    noisy.write_text("# a comment\n" + out.read_text().replace("\n\n", "\n\n\n"))
    code, text, _ = run_cli("guards", str(noisy), capsys=capsys)
    assert (code, text) == (0, out.read_text())


def test_cli_exit_codes_in_a_real_process(guards_files):
    def aotpack(*args):
        return subprocess.run(
            [sys.executable, "-m", "aot.cli", *args],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            cwd=ROOT,
        )

    f = {k: str(v) for k, v in guards_files.items()}
    assert aotpack("diff", f["base"], f["base"]).returncode == 0
    assert aotpack("diff", f["base"], f["widened"]).returncode == 1
    assert aotpack("diff", f["base"], f["narrowed"]).returncode == 2
    assert aotpack("diff", f["base"], "nope.guards").returncode == 4
    r = aotpack("check", "tests/data/guards/narrowed.py", "--against", f["base"])
    assert r.returncode == 2 and "BREAKING  narrowed" in r.stdout


# ---------------------------------------------------------------------------------------------
# The fast path (uninitialized weights, export only) gives a full build's guards.


@pytest.mark.parametrize("name", ["branch", "reshape", "input_added", "dtype", "const_attr"])
def test_fast_export_has_the_full_exports_guards(name):
    from aot.tracer import export_model, instantiate_shapes_only, load_model_file

    spec = load_model_file(fixture_path(name))
    assert export_model(spec, fast=True).guards == export_model(spec).guards
    module = instantiate_shapes_only(spec)
    assert all(p.device.type == "cpu" for p in module.parameters())
    if name == "const_attr":  # the meta constant makes the fast export fail: it falls back
        assert module.scale.device.type == "meta"


@pytest.mark.parametrize("name", EXAMPLES)
def test_trace_only_manifest_equals_the_built_bundles(built, name):
    from aot.loader.bundle import open_bundle

    bundle = open_bundle(built(name, ARCHS))
    try:
        from_bundle = manifest_of_bundle(bundle.manifest)
    finally:
        bundle.close()
    # the build's row-independence notes are comments, not contract: compared without them
    assert render_manifest(traced(name)) == render_manifest(from_bundle, notes=False)


def test_check_names_its_own_exit_status_when_only_safe_changes_made_the_manifest_stale():
    from aot.review.check import StaleCheck
    from aot.review.verdict import Diff, change

    widened = Diff((change("widened", "symbol seq", "1 <= seq <= 8", "1 <= seq <= 16"),))
    assert widened.exit_code == EXIT_SAFE and widened.text().endswith("(exit 1)\n")
    stale = StaleCheck(
        "m.py", "m.guards", widened, "symbol seq: 1 <= seq <= 8\n", "symbol seq: 1 <= seq <= 16\n"
    )
    assert stale.exit_code == EXIT_BREAKING
    assert "1 change: 0 breaking, 1 safe (exit 2)\n" in stale.report()
    assert stale.advice() == (
        "error: m.guards is stale (safe changes only); regenerate it with "
        "`aotpack guards m.py -o m.guards` and review the change"
    )
