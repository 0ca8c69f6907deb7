"""Argument contracts of the allowlisted ops (``aot/op_contracts.py``), through re-signed hostile
programs: an argument the op's kernel would trust is refused at load where it is constant, and on
the call where it is not; the process always survives (the cases that read the heap or trap run in
a subprocess). The fuzz over every allowlisted op is ``tests/aot/test_op_contracts.py``."""

from __future__ import annotations

import pytest
import torch

from aot.errors import BundleError
from aot.loader import load
from tests.hostile_util import aten_step, program_json, read_entries, resigned_program
from tests.loader.test_hostile_programs import outcomes_in_subprocess, with_steps

CPU = {"device": "runtime"}
F32 = {"dtype": "float32"}
I32 = {"dtype": "int32"}


@pytest.fixture(scope="module")
def branchy(built) -> tuple[bytes, dict]:
    data = built("branchy").read_bytes()
    return data, program_json(read_entries(data))


def _spec(*shape) -> dict:
    return {"dtype": "float32", "shape": [str(s) for s in shape]}


def batch_norm_over(prog: dict, channels: int | str) -> dict:
    """A batch norm over ``channels`` channels whose weight, bias and running statistics are the
    16-float ``proj.bias``: its CPU kernel reads each at every channel."""
    size = {"sym": channels} if isinstance(channels, str) else channels
    bias = {"buf": "proj.bias"}
    steps = [
        aten_step("aten.full.default", [[1, size, 1, 1], 1.0], ["zz_in"], dtype=F32, device=CPU),
        aten_step(
            "aten._native_batch_norm_legit_no_training.default",
            [{"buf": "zz_in"}, bias, bias, bias, bias, 0.1, 1e-5],
            ["zz_bn", None, None],
        ),
    ]
    declare = {"zz_in": _spec(1, channels, 1, 1)}
    return with_steps(prog, steps, "zz_bn", _spec(1, channels, 1, 1), declare)


def grid_sample_with(prog: dict, interpolation, padding) -> dict:
    steps = [
        aten_step("aten.full.default", [[1, 1, 4, 4], 1.0], ["zz_in"], dtype=F32, device=CPU),
        aten_step("aten.full.default", [[1, 4, 4, 2], 0.0], ["zz_grid"], dtype=F32, device=CPU),
        aten_step(
            "aten.grid_sampler_2d.default",
            [{"buf": "zz_in"}, {"buf": "zz_grid"}, interpolation, padding, False],
            ["zz_out"],
        ),
    ]
    declare = {"zz_in": _spec(1, 1, 4, 4), "zz_grid": _spec(1, 4, 4, 2)}
    return with_steps(prog, steps, "zz_out", _spec(1, 1, 4, 4), declare)


def test_batch_norm_with_short_per_channel_tensors_is_refused_at_load(tmp_path, branchy):
    """The issue's case: a 16-element bias under a 65,536-channel batch norm returned 256 KiB of
    the heap; with 2**26 channels the process died. Refused at load, naming step, op, argument."""
    base, prog = branchy
    paths = []
    for channels in (65536, 1 << 26):
        paths.append(tmp_path / f"bn{channels}.tpk")
        paths[-1].write_bytes(resigned_program(base, batch_norm_over(prog, channels), replan=True))
    got = outcomes_in_subprocess(paths)
    for path, channels in zip(paths, (65536, 1 << 26)):
        outcome, message = got[str(path)]
        assert outcome == "BundleError@load", (outcome, message)
        assert message == (
            f"step 1 aten._native_batch_norm_legit_no_training.default: argument weight: expected a "
            f"vector of {channels} values (one per channel of input dim 1), got shape [16]; the op "
            f"would read or return memory it does not own: rebuild the bundle with a trusted aotpack"
        )


def test_batch_norm_whose_channels_follow_the_call_is_checked_per_call(tmp_path, branchy):
    """Channels of ``seq`` (a call's size): 16 fit the 16-float tensors, 32 do not; refused on the
    call, before the kernel reads past them, and the runner keeps serving."""
    base, prog = branchy
    path = tmp_path / "bn.tpk"
    path.write_bytes(resigned_program(base, batch_norm_over(prog, "seq"), replan=True))
    runner = load(path)
    out = runner(torch.ones(2, 16, 16))
    want = torch.nn.functional.batch_norm(
        torch.ones(1, 16, 1, 1), *[runner.weights["proj.bias"]] * 2, *[runner.weights["proj.bias"]] * 2
    )
    torch.testing.assert_close(out, want, equal_nan=True)  # a negative "variance": NaN, as eager
    with pytest.raises(
        BundleError, match=r"argument weight: expected a vector of 32 values .* got shape \[16\]"
    ):
        runner(torch.ones(2, 32, 16))
    runner(torch.ones(2, 16, 16))


@pytest.mark.parametrize(
    "interpolation, padding, arg", [(7, 0, "interpolation_mode"), (0, 3, "padding_mode")]
)
def test_grid_sampler_mode_out_of_range_is_refused_at_load(tmp_path, branchy, interpolation, padding, arg):
    """The issue's case: mode 7 left the output unwritten, handing back freed memory."""
    base, prog = branchy
    path = tmp_path / "gs.tpk"
    path.write_bytes(resigned_program(base, grid_sample_with(prog, interpolation, padding)))
    bad = interpolation if arg == "interpolation_mode" else padding
    with pytest.raises(BundleError) as e:
        load(path)
    assert str(e.value) == (
        f"step 2 aten.grid_sampler_2d.default: argument {arg}: expected one of 0..2, got {bad}; the op "
        f"would read or return memory it does not own: rebuild the bundle with a trusted aotpack"
    )


def test_grid_sampler_mode_from_a_size_is_checked_per_call(tmp_path, branchy):
    base, prog = branchy
    path = tmp_path / "gs.tpk"
    path.write_bytes(resigned_program(base, grid_sample_with(prog, {"sym": "batch - 1"}, 0)))
    runner = load(path)
    assert torch.equal(runner(torch.ones(1, 16, 16)), torch.ones(1, 1, 4, 4))  # mode 0 (bilinear) at batch 1
    with pytest.raises(BundleError, match=r"argument interpolation_mode: expected one of 0..2, got 7"):
        runner(torch.ones(8, 16, 16))


INT_DIVISION_DRIVER = r"""
import json, sys
import torch
from aot.errors import AotError
from aot.loader import load

for path in sys.argv[1:]:
    runner = load(path)
    seen = []
    for x in (torch.full((2, 16, 16), -2.0**63), torch.full((2, 16, 16), -2.0**31), torch.full((2, 16, 16), 6.0)):
        try:
            seen.append(["ok", runner(x).flatten()[0].item()])
        except AotError as e:
            seen.append([type(e).__name__, str(e)])
    print(json.dumps([path, seen]), flush=True)
"""


def integer_division_by(prog: dict, target: str, dtype: str, divisor: str, **kwargs) -> dict:
    """``x`` (the caller's floats) cast to ``dtype`` and divided by ``divisor`` (-1 or 0): a
    tensor of it for the Tensor overloads, the number for the Scalar ones."""
    steps = [aten_step("aten._to_copy.default", [{"buf": "x"}], ["zz_i"], dtype={"dtype": dtype})]
    if target.endswith("Scalar_mode") or target.endswith("Scalar"):
        other = int(divisor)
    else:
        steps.append(
            aten_step("aten.full.default", [[1], int(divisor)], ["zz_m"], dtype={"dtype": dtype}, device=CPU)
        )
        other = {"buf": "zz_m"}
    steps.append(aten_step(target, [{"buf": "zz_i"}, other], ["zz_out"], **kwargs))
    spec = {"dtype": dtype, "shape": ["batch", "seq", "16"]}
    declare = {"zz_i": spec, "zz_m": {"dtype": dtype, "shape": ["1"]}}
    return with_steps(prog, steps, "zz_out", spec, declare)


def test_integer_division_overflow_and_zero_divisors_are_the_callers_error(tmp_path, branchy):
    """``trunc`` division of the int32/int64 minimum by -1 was a SIGFPE that killed the process (a
    server with it); by zero, a BundleError telling the user to rebuild. Both are GuardErrors
    naming the op and the buffer, the process lives on, and the runner serves the next call.
    Floor division, remainder and fmod define the minimum by -1 (as torch does): they run."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    base, prog = branchy
    cases = [
        ("aten.div.Tensor_mode", "int32", "-1", {"rounding_mode": "trunc"}),
        ("aten.div.Tensor_mode", "int64", "-1", {"rounding_mode": "trunc"}),
        ("aten.div.Scalar_mode", "int64", "-1", {"rounding_mode": "trunc"}),
        ("aten.div.Tensor_mode", "int64", "-1", {"rounding_mode": "floor"}),
        ("aten.remainder.Tensor", "int32", "-1", {}),
        ("aten.fmod.Scalar", "int64", "0", {}),
    ]
    paths = []
    for i, (target, dtype, divisor, kwargs) in enumerate(cases):
        paths.append(tmp_path / f"div{i}.tpk")
        paths[-1].write_bytes(
            resigned_program(base, integer_division_by(prog, target, dtype, divisor, **kwargs), replan=True)
        )
    r = subprocess.run(
        [sys.executable, "-c", INT_DIVISION_DRIVER, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"the process died (status {r.returncode}): {r.stderr[-2000:]}"
    got = dict(json.loads(line) for line in r.stdout.splitlines())
    trap = (
        "step {} {}: integer division of {} (the minimum of {}) by -1 overflows in argument self ('zz_i'), "
        "computed from this call's inputs; pass values the model's integer arithmetic can take"
    )
    int64_min, int32_min = -(2**63), -(2**31)
    int32_trap = ["GuardError", trap.format(2, "aten.div.Tensor_mode", int32_min, "int32")]
    assert got[str(paths[0])][1:] == [int32_trap, ["ok", -6]]  # (-2**63 cast to int32 is the platform's)
    assert got[str(paths[1])] == [
        ["GuardError", trap.format(2, "aten.div.Tensor_mode", int64_min, "int64")],
        ["ok", 2**31],
        ["ok", -6],
    ]
    assert got[str(paths[2])][0] == ["GuardError", trap.format(1, "aten.div.Scalar_mode", int64_min, "int64")]
    assert got[str(paths[3])] == [["ok", int64_min], ["ok", 2**31], ["ok", -6]]
    assert got[str(paths[4])][1:] == [["ok", 0], ["ok", 0]]
    zero = (
        "step 1 aten.fmod.Scalar: integer division by zero in argument self ('zz_i'), computed from this "
        "call's inputs; pass values the model's integer arithmetic can take"
    )
    assert got[str(paths[5])] == [["GuardError", zero]] * 3
