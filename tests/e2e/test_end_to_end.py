"""Build each example model, load the bundle on CPU, and compare with eager PyTorch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from aot.errors import GuardError, TraceError
from aot.loader import load
from aot.tracer import example_inputs, instantiate, load_model_file
from tests.conftest import HANG_GUARD_S, model_path

# (model, shapes to check, a shape outside the declared ranges, what the error must name)
SLOW = pytest.mark.slow  # GPT-2-small, ResNet-18 and the d-1024 MLP take tens of seconds to build
CASES = [
    ("mlp", [{"batch": 1}, {"batch": 5}, {"batch": 64}], {"batch": 65}, "batch"),
    (
        "gpt",
        [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 37}, {"batch": 3, "seq": 128}],
        {"batch": 1, "seq": 1025},
        "seq",
    ),
    ("cnn", [{"batch": 1}, {"batch": 3}], {"batch": 33}, "batch"),
    ("branchy", [{"batch": 1, "seq": 10}, {"batch": 3, "seq": 52}], {"batch": 2, "seq": 9}, "seq"),
]
# fp16 models: the bundle runs the same ATen ops as eager, so differences are accumulation-order noise.
ATOL = {"float16": 2e-2, "float32": 1e-5}


@pytest.mark.parametrize(
    "name, shapes, outside, symbol",
    [pytest.param(*c, id=c[0], marks=SLOW if c[0] != "branchy" else ()) for c in CASES],
)
def test_bundle_matches_eager_and_rejects_outside(built, name, shapes, outside, symbol):
    spec = load_model_file(model_path(name))
    module = instantiate(spec)
    runner = load(built(name), device="cpu")
    for sizes in shapes:
        inputs = example_inputs(spec, sizes, seed=sum(sizes.values()))
        with torch.no_grad():
            expected = module(*inputs.values())
        got = runner(**inputs)
        assert got.shape == expected.shape
        err = (got.float() - expected.float()).abs().max().item()
        assert err <= ATOL[spec.dtype], f"{name} at {sizes}: max abs error {err}"
    with pytest.raises(GuardError, match=rf"\({symbol}\): expected .* got {outside[symbol]}"):
        runner(**example_inputs(spec, outside))


def test_reference_outputs_reproduce_on_load(built):
    runner = load(built("small_mlp"))  # fp16, as models/mlp.py
    out = runner(**runner.example_inputs())
    assert torch.equal(out, runner.reference_outputs()[0])


@SLOW
def test_weights_are_stored_aligned_and_once(built):
    import zipfile

    from aot import schema

    path = built("gpt")
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(schema.WEIGHTS_PATH)
        assert info.compress_type == zipfile.ZIP_STORED
        with open(path, "rb") as f:
            f.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        assert (info.header_offset + 30 + name_len + extra_len) % schema.WEIGHTS_ALIGNMENT == 0
        weights_bytes = info.file_size
    n_params = sum(p.numel() for p in instantiate(load_model_file(model_path("gpt"))).parameters())
    # tied lm_head/wte stored once: the file is the fp16 parameters plus a small header
    assert 2 * n_params <= weights_bytes <= 2 * n_params * 1.01
    assert path.stat().st_size <= 1.05 * 2 * n_params


BRANCHY_GUARDS = """\
input x: float32[batch, seq, 16]

symbol batch: 1 <= batch <= 16  (declared 1..16)
# rows along batch: independent, a server may join requests along it (no step mixes rows; changing row 1 of 3 left the other rows of every output bitwise equal)
symbol seq: 10 <= seq <= 256, seq % 2 == 0  (declared 1..256)
  guard seq >= 9  at tests/data/branchy.py:15  if T > 8:
  guard seq % 2 == 0  at tests/data/branchy.py:17  pairs = x.reshape(B, T // 2, 2 * C)
# rows along seq: not independent, a server never joins requests along it: step 1 (view.default) reshapes across seq ([batch, seq, 16] to [batch, seq//2, 32])
"""


def test_branch_and_reshape_guards_are_simplified_with_their_lines(built):
    # the whole manifest text is pinned by the golden files of the guard-review tests
    text = load(built("branchy")).guards_text()
    assert BRANCHY_GUARDS in text, text


def test_untraceable_model_names_the_line():
    from aot.tracer import trace

    with pytest.raises(
        TraceError, match=r"untraceable\.py:10: cannot export the model \(if x\.sum\(\) > 0:\)"
    ):
        trace(load_model_file(model_path("untraceable")))


def test_a_size_fixed_while_decomposing_is_a_trace_error_and_another_example_builds(tmp_path):
    """tests/data/sliced_by_size.py traced at ctx == 16 (its buffer's length): decomposing fixes
    ctx there, so the build refuses rather than admit 1..16; traced at its own example, 8, the
    program holds at other sizes, matching eager."""
    from dataclasses import replace

    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import trace

    spec = load_model_file(model_path("sliced_by_size"))
    mask = next(i for i in spec.inputs if i.name == "mask")
    at_16 = replace(mask, shape=(1, replace(mask.shape[1], example=16)))
    with pytest.raises(TraceError, match=r"input 'mask' dim 1 \(ctx\) was specialized to 16.*example=N"):
        trace(replace(spec, inputs=[at_16 if i is mask else i for i in spec.inputs]))
    pack(generate(trace(spec), ("sm_90",)), tmp_path / "sliced.tpk")  # its own example: 8
    runner, module = load(tmp_path / "sliced.tpk"), instantiate(spec)
    for sizes in ({"seq": 3, "ctx": 5}, {"seq": 1, "ctx": 16}, {"seq": 16, "ctx": 1}):
        inputs = example_inputs(spec, sizes, seed=1)
        torch.testing.assert_close(runner(**inputs), module(**inputs), rtol=1e-5, atol=1e-5)


def test_loader_imports_no_compiler(built):
    path = built("small_mlp")  # a bundle with kernels; any would do
    code = f"""
import sys
import aot.loader
runner = aot.loader.load({str(path)!r})
runner(**runner.example_inputs())
banned = ("triton", "sympy", "torch._dynamo", "torch._inductor", "aot.tracer", "aot.codegen", "aot.packager")
print(sorted(m for m in sys.modules if m.startswith(banned)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_inputs_sharing_dims_bind_one_symbol(built):
    runner = load(built("shared_dims"))
    assert runner(torch.ones(3, 5, 4), torch.full((3, 5), 2.0)).eq(2).all()
    with pytest.raises(
        GuardError, match=r"input 'mask' dim 1 \(seq\): expected 5, the size of seq in input 'x' dim 1, got 6"
    ):
        runner(torch.ones(3, 5, 4), torch.ones(3, 6))


def test_dims_the_model_forces_equal_become_a_relation(built):
    runner = load(built("forced_equal"))
    assert "relation a == b  at tests/data/forced_equal.py:10  return x + y" in runner.guards_text()
    assert runner(torch.ones(3, 4), torch.ones(3, 4)).eq(2).all()
    with pytest.raises(
        GuardError, match=r"inputs violate a == b with a=3, b=2 \(guard from tests/data/forced_equal.py:10"
    ):
        runner(torch.ones(3, 4), torch.ones(2, 4))


def test_a_missing_library_op_is_an_env_error(tmp_path, built):
    """A bundle built against a torch with an op this torch lacks names the op at load."""
    from dataclasses import replace

    from aot.codegen import generate
    from aot.errors import EnvError
    from aot.packager import pack

    traced = built.traced("branchy")  # replaced, not changed: other tests share it
    steps = list(traced.program.steps)
    i = next(i for i, s in enumerate(steps) if s.target == "aten.relu.default")
    steps[i] = replace(steps[i], target="aten.relu_from_the_future.default")
    traced = replace(traced, program=replace(traced.program, steps=tuple(steps)))
    pack(generate(traced, fuse=False), tmp_path / "future.tpk")
    with pytest.raises(
        EnvError, match=r"has no ATen op aten\.relu_from_the_future\.default, which the bundle needs"
    ):
        load(tmp_path / "future.tpk")
