"""Fusion loses no work and duplicates none: each ATen step of the program fusion was given is, in
the fused program, either kept as a library step or in the reference decomposition of exactly one
kernel step, and nothing else is there. Views (and ``arange``) are the exception: a kernel reads
through them by index arithmetic, so one may be folded into several kernels and also stay for a
library call; each must still appear at least once."""

from __future__ import annotations

from collections import Counter

import pytest

from aot.program import VIEW_OPS, reference_steps
from aot.schema import StepKind

# size_one: several programs (variants); building the three larger models takes tens of seconds
EXAMPLES = (*(pytest.param(n, marks=pytest.mark.slow) for n in ("mlp", "gpt", "cnn")), "branchy", "size_one")


def _key(step) -> tuple:
    # a step is its target, arguments and outputs: a reference step is the original step unchanged
    return step.target, repr(step.args), repr(sorted(step.kwargs.items())), step.outputs


def _may_repeat(step) -> bool:
    return step.target in VIEW_OPS or step.target.startswith("aten.arange")


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_step_is_kept_or_replaced_exactly_once(built, name):
    compiled = built.compiled(name)
    given = built.fusion_inputs(name)
    fused = (compiled.program, *compiled.program.variants)
    assert len(given) == len(fused)
    assert any(s.kind == StepKind.KERNEL for p in fused for s in p.steps), f"{name}: nothing was fused"
    for before, after in zip(given, fused):
        assert all(s.kind == StepKind.ATEN for s in before.steps)
        want = Counter(_key(s) for s in before.steps if not _may_repeat(s))
        got = Counter(_key(s) for s in reference_steps(after) if not _may_repeat(s))
        dropped, doubled, new = want - got, got - want, set(got) - set(want)
        assert not dropped, f"{name}: steps neither kept nor in a kernel: {sorted(dropped)[:5]}"
        assert not doubled and not new, (
            f"{name}: steps run more than once or out of nowhere: {sorted(doubled)[:5]}"
        )
        views_before = {_key(s) for s in before.steps if _may_repeat(s)}
        views_after = {_key(s) for s in reference_steps(after) if _may_repeat(s)}
        assert views_before == views_after, f"{name}: views lost {sorted(views_before - views_after)[:5]}"
