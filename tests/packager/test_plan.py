from aot.packager.plan import memory_plan, peak_bytes
from aot.program import lifetimes
from aot.schema import Bucket, Buf, NamedTensor, Program, Step, SymbolSource, TensorSpec


def _program() -> Program:
    f32 = lambda *shape: TensorSpec("float32", shape)  # noqa: E731
    steps = (
        Step("aten", "aten.relu.default", (Buf("x"),), {}, ("a",)),  # a: [n, 4]
        Step("aten", "aten.view.default", (Buf("a"), [-1]), {}, ("a_flat",)),  # view of a
        Step("aten", "aten.relu.default", (Buf("x"),), {}, ("b",)),  # b: [n, 4]
        Step("aten", "aten.sum.default", (Buf("a_flat"),), {}, ("s",)),  # last use of a
        Step("aten", "aten.mul.Tensor", (Buf("b"), Buf("s")), {}, ("out",)),
    )
    return Program(
        inputs=(NamedTensor("x", f32("n", "4")),),
        weights=(),
        buffers={
            "a": f32("n", "4"),
            "a_flat": f32("n*4"),
            "b": f32("n", "4"),
            "s": f32(),
            "out": f32("n", "4"),
        },
        steps=steps,
        outputs=("out",),
        symbols=(SymbolSource("n", "x", 0),),
    )


def test_views_extend_their_base_and_allocate_nothing():
    live = {name: (first, last) for name, first, last in lifetimes(_program())}
    assert "a_flat" not in live
    assert live["a"] == (0, 3)  # read through its view at step 3
    assert live["out"] == (4, 5)  # outputs live past the last step


def test_peak_counts_only_simultaneously_live_buffers():
    # at step 3: a (16n bytes) + b (16n) + s (4) live; at step 4: b + s + out
    assert peak_bytes(_program(), {"n": 10}) == 160 + 160 + 4
    plan = memory_plan(_program(), (Bucket("n", (1, 8)),))
    assert [b.sizes for b in plan] == [{"n": 8}, {"n": 1}]  # largest first, the capture order
    assert plan[0].peak_bytes == 128 + 128 + 4
