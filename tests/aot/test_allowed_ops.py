"""The allowlist of ATen ops (``aot/allowed_ops.py``): every listed op is a pure function this torch
has, every other op of the aten namespace is refused, and every op the tracer and codegen emit for
the example and test models is listed. (The real-model suite, ``tests/realmodels``, builds and
loads each of its models, and both the tracer and the loader refuse an op off the list.)"""

from __future__ import annotations

import textwrap

import pytest
import torch

from aot.allowed_ops import ALLOWED_OPS, CORE_OPS, STATE_WRITE_OPS, ZERO_ARGS
from aot.aten import resolve_op
from aot.errors import BundleError, TraceError
from tests.conftest import DATA, MODELS, ROOT


def overload(name: str) -> torch._ops.OpOverload:
    _, packet, over = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), over)


def all_aten_ops() -> list[str]:
    out = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out += [f"aten.{name}.{o}" for o in packet.overloads()]
    return sorted(out)


@pytest.mark.parametrize("name", sorted(ALLOWED_OPS))
def test_every_allowed_op_is_a_pure_function_this_torch_has(name):
    op = overload(name)
    assert resolve_op(name) is op
    schema = op._schema
    assert not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments), schema
    assert not any("Generator" in str(a.type) for a in schema.arguments), schema
    assert torch.Tag.nondeterministic_seeded not in op.tags or name in {o for o, _, _ in ZERO_ARGS}, schema
    assert "backward" not in name and "dropout" not in name


def test_core_ops_are_core_aten_ir():
    assert all(torch.Tag.core in overload(n).tags for n in CORE_OPS)


def test_every_other_aten_op_is_refused():
    others = [n for n in all_aten_ops() if n not in ALLOWED_OPS]
    assert len(others) > 1500
    for name in others:
        with pytest.raises(BundleError, match=r"(may not call|not an ATen op name)"):
            resolve_op(name)


def test_zero_args_name_the_argument_at_its_position():
    for name, arg, position in ZERO_ARGS:
        assert overload(name)._schema.arguments[position].name == arg


def test_every_op_codegen_knows_is_allowed():
    from aot.codegen.classify import GENERATOR_OPS, REDUCTION_OPS, VIEW_OPS
    from aot.codegen.lower_pointwise import POINTWISE
    from aot.program import VIEW_OPS as PROGRAM_VIEW_OPS

    known = set(POINTWISE) | GENERATOR_OPS | REDUCTION_OPS | VIEW_OPS | PROGRAM_VIEW_OPS
    assert known <= ALLOWED_OPS, sorted(known - ALLOWED_OPS)


EXAMPLES = sorted(
    # selections.py holds model factories (the refusals of value-dependent sizes), not a model file
    [p for p in (*MODELS.glob("*.py"), *DATA.glob("*.py")) if p.stem not in ("untraceable", "selections")]
    + list((ROOT / "tests" / "codegen" / "models").glob("*.py"))
)


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_op_of_every_example_bundle_is_allowed(path):
    """What the packager lists as the bundle's ops (ATen steps and kernels' references)."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    compiled = generate(trace(load_model_file(path)), ("sm_90",))
    steps = [s for p in (compiled.program, *compiled.program.variants) for s in p.steps]
    ops = {s.target for s in steps if s.kind == "aten"} | {r.target for s in steps for r in s.reference}
    assert ops and ops <= ALLOWED_OPS | STATE_WRITE_OPS, sorted(ops - ALLOWED_OPS - STATE_WRITE_OPS)
    if ops & STATE_WRITE_OPS:  # a stateful model (tests/data/tiny_lm.py): writes into its state only
        from aot.aten import state_writes_checked
        from aot.program import reference_steps

        for p in (compiled.program, *compiled.program.variants):
            assert p.state
            state_writes_checked(reference_steps(p), p.state)


def test_state_writes_write_and_are_resolved_only_as_state_writes():
    for name in STATE_WRITE_OPS:
        op = overload(name)
        assert op._schema.arguments[0].alias_info.is_write, name
        assert name not in ALLOWED_OPS
        with pytest.raises(BundleError, match="may not call"):
            resolve_op(name)
        assert resolve_op(name, state_write=True) is op


MODEL_FILE = """
import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop(self.proj(x))
        return torch.nn.functional.dropout(y, 0.25, training=self.training){extra}


spec = ModelSpec(module=Model, inputs=[Input("x", (Dim("batch", 1, 4), 8))], dtype="float32")
"""


def test_dropout_in_eval_traces_to_no_random_op(tmp_path):
    from aot.tracer import load_model_file, trace

    path = tmp_path / "dropout.py"
    path.write_text(textwrap.dedent(MODEL_FILE.format(extra="")))
    traced = trace(load_model_file(path))
    targets = {s.target for s in traced.program.steps}
    assert targets <= ALLOWED_OPS
    assert not any(torch.Tag.nondeterministic_seeded in overload(t).tags for t in targets), targets


def test_random_op_in_forward_fails_the_build_naming_the_line(tmp_path):
    from aot.tracer import load_model_file, trace

    path = tmp_path / "noisy.py"
    path.write_text(textwrap.dedent(MODEL_FILE.format(extra=" + torch.randn(8)")))
    with pytest.raises(
        TraceError, match=r"noisy\.py:\d+: the model calls aten\.randn\.default, which a bundle may not run"
    ):
        trace(load_model_file(path))
