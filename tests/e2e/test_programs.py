"""Bundles of several guarded programs, keyword inputs and output trees, against eager PyTorch."""

from __future__ import annotations

import pytest
import torch

from aot.errors import TraceError
from aot.loader import load
from aot.pytree import Record, leaves
from aot.schema import Buf, Sym, SymBool
from aot.tracer import call_model, example_inputs, instantiate, load_model_file, trace
from tests.conftest import model_path

ATOL = 1e-5  # float32: the bundle runs the same ATen ops as eager


def _compare(spec, module, runner, sizes: dict[str, int]) -> None:
    inputs = example_inputs(spec, sizes, seed=sum(sizes.values()))
    with torch.no_grad():
        want = call_model(spec, module, inputs)
    got = runner(**inputs)
    assert len(leaves(got)) == len(leaves(want))
    for g, w in zip(leaves(got), leaves(want)):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() <= ATOL, f"at {sizes}"


def test_a_size_one_branch_and_a_length_branch_get_programs_of_their_own(built):
    spec = load_model_file(model_path("size_one"))
    runner = load(built("size_one", ("sm_90",)))
    # the general trace's `B != 1` is size-oblivious, but eager differs at 1: the build's check
    # against eager refuses to relax it, so batch 1 gets its own program; T > 4 splits seq.
    assert len(runner.programs) >= 3, runner.programs
    assert any("batch == 1" in p for p in runner.programs)
    for g in runner.manifest.guards.symbols:  # nothing declared is lost
        assert (g.min, g.max, g.modulus, g.excluded) == (g.declared_min, g.declared_max, 1, ())
    module = instantiate(spec)
    for sizes in (
        {"batch": 1, "seq": 1},
        {"batch": 1, "seq": 9},
        {"batch": 3, "seq": 4},
        {"batch": 5, "seq": 5},
        {"batch": 6, "seq": 16},
    ):
        _compare(spec, module, runner, sizes)
    text = runner.guards_text()
    assert "program general  admits" in text and "tests/data/size_one.py:17" in text, text


def test_a_range_no_program_can_cover_fails_the_build_with_its_site():
    spec = load_model_file(model_path("guards/reshape"))
    with pytest.raises(TraceError) as e:
        trace(spec)
    msg = str(e.value)
    assert "cannot cover every declared size" in msg and "seq % 2 == 0" in msg
    assert "tests/data/guards/reshape.py:" in msg and "--allow-narrowing" in msg
    narrowed = trace(spec, allow_narrowing=True)
    (seq,) = [g for g in narrowed.guards.symbols if g.name == "seq"]
    assert seq.modulus == 2


def test_keyword_inputs_constant_kwargs_and_output_trees(built):
    spec = load_model_file(model_path("structured"))
    runner = load(built("structured", ("sm_90",)))
    inputs = example_inputs(spec, {"batch": 3}, seed=5)
    out = runner(**inputs)
    assert isinstance(out, dict) and list(out) == ["hidden", "pair", "masked", "extra"]
    assert isinstance(out["pair"], Record) and out["pair"].type_name.endswith("Pair")
    assert out["pair"].high is out["pair"]["high"] is out["pair"][1]
    assert isinstance(out["masked"], tuple) and out["masked"][1] is None
    assert isinstance(out["extra"], list) and out["extra"][0].shape == ()
    module = instantiate(spec)
    for sizes in ({"batch": 1}, {"batch": 3}, {"batch": 8}):
        _compare(spec, module, runner, sizes)
    with torch.no_grad():
        want = module(features=inputs["features"], mask=inputs["mask"], scale=2.0, return_extra=True)
    assert torch.allclose(out["masked"][0], want["masked"][0], atol=ATOL)


def test_constant_kwargs_must_be_plain_values():
    from aot import Input, ModelSpec
    from aot.errors import SpecError

    with pytest.raises(SpecError, match="constant keyword arguments must be"):
        ModelSpec(module=torch.nn.Identity, inputs=[Input("input", (2,))], kwargs={"t": torch.ones(1)})


def test_the_model_files_manifest_matches_its_bundles(built):
    """``aotpack guards MODEL.py`` (trace only) agrees with the bundle, programs included, so
    ``aotpack check`` passes on a fresh build."""
    from aot.manifest_text import manifest_of_bundle, render_manifest
    from aot.tracer import guard_manifest

    for name in ("size_one", "structured"):
        runner = load(built(name, ("sm_90",)))
        spec = load_model_file(model_path(name))
        # the row-independence notes are comments, outside the contract `aotpack check` compares
        assert render_manifest(guard_manifest(spec, ("sm_90",)), notes=False) == render_manifest(
            manifest_of_bundle(runner.manifest), notes=False
        )


def test_size_comparisons_are_bools_evaluated_per_call():
    """``is_causal=q_len > 1`` traced symbolically (torch 2.11) is stored as a ``symbool``."""
    from aot.loader.program import AtenCall
    from aot.schema import Step

    step = Step(
        kind="aten",
        target="aten.scaled_dot_product_attention.default",
        args=(Buf("q"), Buf("k"), Buf("v"), None, 0.0, SymBool("seq > 1")),
        kwargs={},
        outputs=("out",),
    )
    call = AtenCall(step, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for seq in (1, 5):
        q, k, v = (torch.randn(2, 3, seq, 8, generator=gen) for _ in range(3))
        env = {"q": q, "k": k, "v": v}
        call(env, {"seq": seq})
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=seq > 1)
        assert torch.equal(env["out"], want)


def test_views_run_on_layouts_the_trace_did_not_see():
    """A CUDA attention kernel returns another layout than the CPU one the program was traced
    with; a ``view`` the trace found valid must still give the traced values (as a reshape)."""
    from aot.loader.program import AtenCall
    from aot.schema import Step

    step = Step(
        kind="aten", target="aten.view.default", args=(Buf("x"), [2, Sym("seq*8")]), kwargs={}, outputs=("y",)
    )
    call = AtenCall(step, torch.device("cpu"))
    x = (
        torch.arange(2 * 5 * 8, dtype=torch.float32).reshape(2, 8, 5).transpose(1, 2)
    )  # [2, 5, 8], not contiguous
    env = {"x": x}
    call(env, {"seq": 5})
    assert torch.equal(env["y"], x.reshape(2, 40))
    with pytest.raises(RuntimeError):
        x.view(2, 40)  # what a plain view does with this layout


def test_nested_inputs_by_path_and_called_nested(built):
    spec = load_model_file(model_path("nested"))
    runner = load(built("nested", ("sm_90",)))
    assert runner.input_names == ("inputs.image", "inputs.scale", "past.0", "past.1")
    module = instantiate(spec)
    for b in (1, 3, 8):
        flat = example_inputs(spec, {"batch": b}, seed=b)
        with torch.no_grad():
            want = module(
                {"image": flat["inputs.image"], "scale": flat["inputs.scale"]},
                (flat["past.0"], flat["past.1"]),
            )
        nested = runner(
            inputs={"image": flat["inputs.image"], "scale": flat["inputs.scale"]},
            past=(flat["past.0"], flat["past.1"]),
        )
        assert (nested - want).abs().max().item() <= ATOL
        assert torch.equal(runner(**flat), nested)  # by dotted name too
    assert "input inputs.image: float32[batch, 4]" in runner.guards_text()
    from aot.manifest_text import parse_guards_text

    assert [i.name for i in parse_guards_text(runner.guards_text()).guards.inputs][0] == "inputs.image"


def test_output_trees_no_build_writes_are_refused():
    from aot.errors import BundleError
    from aot.pytree import unflatten, validate
    from aot.schema import TreeSpec
    from aot.serde import from_json

    leaf = TreeSpec(kind="tensor")
    good = TreeSpec(kind="record", type="m.Out", keys=("a", "b"), children=(leaf, TreeSpec(kind="none")))
    validate(good, 1)
    assert unflatten(good, ["x"]) == {"a": "x", "b": None}
    with pytest.raises(BundleError, match="holds 1 tensors, the program has 2 outputs"):
        validate(good, 2)
    with pytest.raises(BundleError, match="kind: expected one of 'tensor', 'none'"):
        from_json(TreeSpec, {"kind": "pickle"})
    with pytest.raises(BundleError, match="2 keys for 1 children"):
        validate(TreeSpec(kind="dict", keys=("a", "b"), children=(leaf,)), 1)
    deep = leaf
    for _ in range(40):
        deep = TreeSpec(kind="tuple", children=(deep,))
    with pytest.raises(BundleError, match="nests deeper"):
        validate(deep, 1)


def test_a_bundle_whose_programs_disagree_with_its_manifest_is_refused(built, tmp_path):
    """A re-signed manifest that drops a program's guards must not let that program run unguarded."""
    from aot.errors import BundleError
    from tests.hostile_util import (
        manifest_bytes,
        manifest_of,
        read_entries,
        with_manifest_text,
        write_entries,
    )

    entries = read_entries(built("size_one", ("sm_90",)).read_bytes())
    m = manifest_of(entries)
    assert len(m["programs"]) >= 3
    bad = tmp_path / "bad.tpk"
    bad.write_bytes(
        write_entries(with_manifest_text(entries, manifest_bytes({**m, "programs": m["programs"][:1]})))
    )
    with pytest.raises(BundleError, match="lists 1 programs, the program member holds"):
        load(bad)


@pytest.mark.parametrize("sizes", [[1, 8], [1 << 40], [2, 2], []])
def test_a_programs_own_buckets_are_checked_at_load(built, tmp_path, sizes):
    """Each program's buckets (the ones its graphs capture) must be sizes its own guards admit:
    a bundle whose general program (seq <= 4, the longer sequences have programs of their own)
    lists seq 8 is refused, not captured."""
    from aot.errors import BundleError
    from tests.hostile_util import (
        manifest_bytes,
        manifest_of,
        read_entries,
        with_manifest_text,
        write_entries,
    )

    entries = read_entries(built("size_one", ("sm_90",)).read_bytes())
    m = manifest_of(entries)
    general = m["programs"][0]
    assert general["name"] == "general"
    (at,) = [i for i, b in enumerate(general["buckets"]) if b["symbol"] == "seq"]
    general["buckets"][at]["sizes"] = sizes
    bad = tmp_path / "bad.tpk"
    bad.write_bytes(write_entries(with_manifest_text(entries, manifest_bytes(m))))
    with pytest.raises(BundleError) as e:
        load(bad)
    assert "program 'general': buckets of 'seq' must be 1..1024 ascending sizes its guards admit" in str(
        e.value
    ), e.value


def test_paddable_dims_shared_by_two_inputs_are_checked_not_crashed(built):
    runner = load(built("shared_paddable", ("sm_90",)))
    checks = {b.symbol: b for b in runner.manifest.buckets}
    for sym in ("batch", "seq"):  # rows are independent: padding either dim leaves real rows alone
        assert checks[sym].paddable and "padded to" in checks[sym].pad_check, checks[sym]
    spec = load_model_file(model_path("shared_paddable"))
    _compare(spec, instantiate(spec), runner, {"batch": 3, "seq": 7})
