"""Which tensors the codegen lays out channels-last (``aot.codegen.layouts``), how kernels index
them, and the layout helpers the loader uses (``aot.layout``). That the kernels compute the right
values in these layouts is checked by the interpreter (``test_interpreter``, pattern
``conv_layouts`` and the cnn example) and against eager by the loader tests."""

from __future__ import annotations

import pytest
import torch

from aot.codegen import index as ix
from aot.layout import CHANNELS_LAST, empty_ordered, has_order, to_order
from aot.schema import Buf
from tests.conftest import HANG_GUARD_S


@pytest.fixture(scope="module")
def laid_out(pattern):
    from aot.codegen.layouts import CONVOLUTION, channels_last

    traced, compiled, *_ = pattern("conv_layouts")
    program, n = channels_last(traced.program)
    by_target = {}
    for s in program.steps:
        by_target.setdefault(s.target, []).append(s)
    return program, n, by_target[CONVOLUTION], compiled


def test_convolutions_run_channels_last_unless_their_output_is_the_models(laid_out):
    program, n, convs, _ = laid_out
    assert n == 4 and len(convs) == 5
    orders = [program.buffers[c.outputs[0]].order for c in convs]
    assert orders == [CHANNELS_LAST] * 4 + [()]  # the last is the model's output
    assert program.outputs[0] == convs[-1].outputs[0]
    weights = {w.name: w.spec.order for w in program.weights}
    assert [weights[c.args[1].name] for c in convs] == [CHANNELS_LAST] * 4 + [()]


def test_inputs_are_nhwc_only_where_a_kernel_writes_them_and_every_reader_agrees(laid_out):
    program, _, convs, _ = laid_out
    first, pooled, block, head, out = (c.args[0].name for c in convs)
    assert program.buffers.get(first) is None  # the model's input: its caller's layout
    assert program.buffers[pooled].order == CHANNELS_LAST  # a max pool of an NHWC kernel output
    assert program.buffers[block].order == CHANNELS_LAST  # the residual block's ReLU, written NHWC
    # read by the channels-last head and by the row-major output convolution: stays row-major
    assert head == out and program.buffers[head].order == ()


def test_a_convolution_bias_joins_the_kernel_after_it(pattern):
    from aot.codegen.layouts import CONVOLUTION

    traced, compiled, *_ = pattern("conv_layouts")
    biased = [
        s.args[2].name for s in traced.program.steps if s.target == CONVOLUTION and s.args[2] is not None
    ]
    assert biased == ["dw.bias", "head.bias"]
    convs = [s for s in compiled.program.steps if s.target == CONVOLUTION]
    assert len(convs) == 5 and all(s.args[2] is None for s in convs)
    kernels = {k.id: k.name for k in compiled.program.kernels}
    readers = {
        b: [kernels[s.target] for s in compiled.program.steps if s.kind == "kernel" and Buf(b) in s.args]
        for b in biased
    }
    assert readers == {"dw.bias": ["fused_add_layer_norm"], "head.bias": ["fused_add_softmax"]}


def test_off_keeps_every_tensor_row_major(pattern):
    from aot.codegen import generate

    traced, *_ = pattern("conv_layouts")
    compiled = generate(traced, ("sm_90",), channels_last=False)
    assert not any(s.order for s in compiled.program.buffers.values())
    assert not any(w.spec.order for w in compiled.program.weights)


def test_a_kernel_walks_an_nhwc_output_in_memory_order(laid_out):
    """The stem's BatchNorm + ReLU reads the NHWC convolution and writes NHWC: both at ``x``."""
    *_, compiled = laid_out
    sources = [k.source for k in compiled.program.kernels if "batch_norm_relu" in k.name]
    assert sources
    assert any("tl.load(in0 + (x)" in s and "tl.store(out0 + (x)" in s and "(x % 16)" in s for s in sources)


def test_memory_index_round_trip():
    shape = tuple(ix.parse_size(s) for s in ("batch", "16", "6", "5"))
    x = ix.atom("x", ix.numel(shape))
    assert ix.triton_index(ix.to_memory(ix.from_memory(x, shape, CHANNELS_LAST), shape, CHANNELS_LAST)) == "x"
    assert ix.triton_index(ix.to_memory(x, shape, (0, 1, 2, 3))) == "x"


def test_layout_helpers():
    t = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    cl = to_order(t, CHANNELS_LAST)
    assert (
        torch.equal(cl, t) and cl.is_contiguous(memory_format=torch.channels_last) and not cl.is_contiguous()
    )
    assert has_order(cl, CHANNELS_LAST) and not has_order(cl, ()) and to_order(cl, CHANNELS_LAST) is cl
    assert to_order(cl, ()).is_contiguous() and torch.equal(to_order(cl, ()), t)
    e = empty_ordered([2, 3, 4, 5], CHANNELS_LAST, torch.float16, "cpu")
    assert e.shape == (2, 3, 4, 5) and e.stride() == (60, 1, 15, 3)
    assert empty_ordered([2, 3], (), torch.float16, "cpu").is_contiguous()


@pytest.mark.slow  # two builds through the CLI, each in a fresh process
def test_the_build_command_keeps_row_major_when_asked(tmp_path):
    import subprocess
    import sys

    from aot.loader import load
    from tests.codegen.conftest import PATTERNS

    orders = {}
    for flag in ([], ["--no-channels-last"]):
        out = tmp_path / f"b{len(flag)}.tpk"
        cmd = [sys.executable, "-m", "aot.cli", "build", str(PATTERNS / "conv_layouts.py"), "-o", str(out)]
        r = subprocess.run(
            cmd + flag + ["--arch", "sm_90"], capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        assert r.returncode == 0, r.stderr
        program = load(out).program
        orders[bool(flag)] = [s.order for s in program.buffers.values() if s.order]
    assert orders[False] and all(o == CHANNELS_LAST for o in orders[False])
    assert orders[True] == []
