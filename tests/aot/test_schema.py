"""The schema is pinned: changing a record without bumping SCHEMA_VERSION fails here, and the
fingerprint text (every record, field type and enum value) is a golden file, so a schema change
shows in review as a diff of ``schema_fingerprint.txt``."""

import hashlib
from pathlib import Path

import pytest

from aot import schema, serde
from aot.errors import BundleError

# SCHEMA_VERSION → sha256 of schema_fingerprint(). Bump the version and add a line when the schema changes.
PINNED = {
    (1, 0): "9d8b3cd95f2ca856d6db2f0e33e560896e33f680cc0a4c90cf5f9b5432024512",
    (
        1,
        1,
    ): "422f4746c2a64ba801725cb23aebefb695cbffb8c6a3821d2a13b299360bec77",  # output trees, several programs per bundle
    # typed step arguments and kinds (same JSON), typed build stats and memory plan, cuda_built per arch
    (1, 2): "8e2e745424196e9a8e5d3106f87d8a394dadcb79bc13ba397b5a533603623fca",
    # GEMM alternatives per program and the tuning table member; state inputs (Program.state,
    # InputGuard.state) and entry points (ProgramEntry.entry); new fields omitted when empty
    (1, 3): "e5e6766406893641adc3f5b3b599a68e754bb7ad724dda062f125628e0c2c9c2",
    # tune's whole-program check per bucket (TuningTable.checks, omitted when empty)
    (1, 4): "11d69a7da50bdd303ab798541a1c5d64d459984f1943e07491b06678cc2bcaeb",
    # memory orders of buffers and weights (TensorSpec.order, omitted when row-major)
    (1, 5): "a0cbbe479a2b1e9494cc92c819c4b5c5c7f9a1842e4210f53943a20297a937dc",
    # a bucket's plan kept for leaving no cuBLAS call (TuningCheck.library_free, omitted when false)
    (1, 6): "cf1afdb7efc96f976129ee23c0fb9d6a073e613f80711025d99afb732fc55af1",
    # the archs whose cubins launch early (Kernel.dependent_launch) and a bucket's plan of every
    # site's fastest candidate (TuningCheck.whole_plan), both omitted when empty
    (1, 7): "ddc76d007178d85ce5f50710c3e4629c3f4e8e05c0d6be5b24f8c177d9281380",
    # which dynamic dims keep their rows independent, so a server may join requests along them
    # (SymbolGuard.rows_independent, rows_check; omitted when empty)
    (1, 8): "ade8c0b07d9fab2587d55fa9eca037a36ab018d9740263a88e9c4b36f67232da",
    # a kernel step's outputs written in place into the program's state (Step.in_place: a decode
    # attention kernel appending to its KV cache; omitted when empty)
    (1, 9): "f30a0d159f08d81b7b679bf567654bf9a218c2edecda45a4d1bdceabb1b8d2a3",
    # with 1.9's: floats computed from sizes as step arguments (SymFloat, an interpolation's scale) and a Dim's
    # declared multiple (SymbolGuard.declared_multiple, omitted when none)
    (1, 10): "1a5419ac1c64d53903bfac96c21fbda8e15375182caab3159ea88baff514c983",
    # the sha256 of each fixed-size chunk of a member (Member.chunk_bytes, chunk_sha256; omitted
    # when empty), so the weights are checked on several threads
    (1, 11): "27852405f90407085e95700df47e4014bd61beb56fc5378fc200b01f0e35c183",
    # buffers the runner keeps zeroed for its kernels (Program.scratch: the split-KV decode
    # attention's arrival counters; omitted when empty)
    (1, 12): "63e28daccfb036e595cf21806c9837034b3aff5531b308816ce72240ee1c24bd",
    # a causal LM's decode step names the kernel the loader launches between two steps for the
    # greedy token and the next inputs (Program.greedy; omitted when empty)
    (1, 13): "fc626babb0ad6d66b0d4fa543a0cb5a3a97789b4bd29ff7d26444fb76fce9dae",
}
FINGERPRINT = Path(__file__).with_name("schema_fingerprint.txt")


def test_schema_fingerprint_matches_the_golden_text():
    assert serde.schema_fingerprint() == FINGERPRINT.read_text(), (
        f"the bundle schema changed; review the difference, bump SCHEMA_VERSION and rewrite {FINGERPRINT.name}"
    )


def test_schema_change_bumps_version():
    digest = hashlib.sha256(serde.schema_fingerprint().encode()).hexdigest()
    assert schema.SCHEMA_VERSION in PINNED, f"add SCHEMA_VERSION {schema.SCHEMA_VERSION} to PINNED"
    assert PINNED[schema.SCHEMA_VERSION] == digest, (
        "the bundle schema changed: bump SCHEMA_VERSION (minor for added optional fields, major otherwise) "
        f"and pin the new fingerprint {digest}"
    )


def test_roundtrip_and_validation():
    spec = schema.TensorSpec(dtype="float16", shape=("batch", "768"))
    step = schema.Step(
        kind="aten", target="aten.relu.default", args=(schema.Buf("x"),), kwargs={}, outputs=("y",)
    )
    program = schema.Program(
        inputs=(schema.NamedTensor("x", spec),),
        weights=(),
        buffers={"y": spec},
        steps=(step,),
        outputs=("y",),
        symbols=(schema.SymbolSource("batch", "x", 0),),
    )
    data = serde.to_json(program)
    assert serde.from_json(schema.Program, data) == program
    bad = dict(data, outputs="y")
    with pytest.raises(BundleError, match=r"Program.outputs: expected a list"):
        serde.from_json(schema.Program, bad)
    with pytest.raises(BundleError, match="unknown"):
        serde.from_json(schema.Program, dict(data, evil=1))
    with pytest.raises(BundleError, match="expected an integer"):
        serde.from_json(schema.SymbolSource, {"symbol": "b", "input": "x", "dim": True})


def test_canonical_json_is_sorted_and_stable():
    a = serde.canonical_json({"b": 1, "a": [1, 2]})
    assert a == serde.canonical_json({"a": [1, 2], "b": 1})
    assert a.index(b'"a"') < a.index(b'"b"')


@pytest.mark.parametrize(
    "change, why",
    [
        ({"buffers": {"c": schema.TensorSpec("float32", ("4",))}}, "int32 buffer of its own"),
        ({"buffers": {"c": schema.TensorSpec("int32", ("batch",))}}, "static shape"),
        ({"buffers": {}}, "no spec"),
        ({"writes": True}, "nothing writes it as an output"),
        ({"aten_reads": True}, "only kernels read it"),
    ],
)
def test_scratch_the_runners_cannot_keep_is_refused(change, why):
    """``Program.scratch`` (``aot.program.check_scratch``, run wherever a bundle opens): an int32
    buffer of a static shape, of its own, that no step writes as an output and only kernels
    read; anything else is a ``BundleError`` saying which."""
    from aot.program import check_scratch

    buffers = change.get("buffers", {"c": schema.TensorSpec("int32", ("4",))})
    y = schema.TensorSpec("float32", ("4",))
    if change.get("writes"):
        step = schema.Step(
            kind="aten", target="aten.zeros_like.default", args=(schema.Buf("x"),), kwargs={}, outputs=("c",)
        )
    elif change.get("aten_reads"):
        step = schema.Step(
            kind="aten",
            target="aten.add.Tensor",
            args=(schema.Buf("x"), schema.Buf("c")),
            kwargs={},
            outputs=("y",),
        )
    else:
        step = schema.Step(
            kind="aten", target="aten.relu.default", args=(schema.Buf("x"),), kwargs={}, outputs=("y",)
        )
    program = schema.Program(
        inputs=(schema.NamedTensor("x", y),), weights=(), buffers={**buffers, "y": y}, steps=(step,),
        outputs=("y",), symbols=(), scratch=("c",),
    )  # fmt: skip
    with pytest.raises(BundleError, match=why):
        check_scratch(program, "t.tpk")
    ok = schema.Program(
        inputs=program.inputs, weights=(), buffers={"c": schema.TensorSpec("int32", ("4",)), "y": y},
        steps=(schema.Step(kind="aten", target="aten.relu.default", args=(schema.Buf("x"),), kwargs={}, outputs=("y",)),),
        outputs=("y",), symbols=(), scratch=("c",),
    )  # fmt: skip
    check_scratch(ok, "t.tpk")  # the same program keeping its scratch as the runners do
