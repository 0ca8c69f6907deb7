"""Every generated kernel, run on CPU by Triton's interpreter, against its reference decomposition.

One fresh interpreter process (``TRITON_INTERPRET=1``) checks all example models, another all
pattern models. Sizes cover at least two values of every dynamic dim, including sizes that are not
multiples of any block size. Tolerances (``aot.dtypes.TOLERANCE``): fp16 1e-2 absolute +
1e-2 relative (kernels round once, the ATen reference after every op), fp32 1e-4 + 1e-4.
"""

from __future__ import annotations

import json

import pytest

from aot.verify.interpret import interpret_in_subprocess
from tests.conftest import model_path

# model -> (sizes, interpret at most this many launches of each distinct kernel)
EXAMPLE_SIZES = {
    "mlp": ([{"batch": 1}, {"batch": 37}], None),
    "gpt": ([{"batch": 1, "seq": 1}, {"batch": 2, "seq": 37}], 2),
    "cnn": ([{"batch": 1}, {"batch": 2}], None),
    "branchy": ([{"batch": 1, "seq": 10}, {"batch": 3, "seq": 52}], None),
}
PATTERN_SIZES = {
    "pointwise": [{"batch": 1, "seq": 2}, {"batch": 3, "seq": 37}],
    "norms": [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 37}],
    "softmax": [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 33}, {"batch": 1, "seq": 96}],
    "looped": [{"batch": 1}, {"batch": 3}],
    "views": [{"batch": 1, "seq": 2}, {"batch": 3, "seq": 37}],
    "unknown": [{"batch": 1}, {"batch": 5}],
    "big": [{"batch": 1}, {"batch": 3}],
    "concat": [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 37}],
    "siblings": [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 37}],
    "channel_norm": [{"batch": 1}, {"batch": 3}],
    "conv_layouts": [{"batch": 1}, {"batch": 3}],
}


def _assert_all_pass(name, results, sizes, bundle_kernels):
    assert set(results) == {json.dumps(s, sort_keys=True) for s in sizes}
    for size, checks in results.items():
        assert checks, f"{name} at {size}: no kernel was checked"
        assert {c.kernel for c in checks} == bundle_kernels, f"{name} at {size}: some kernels never ran"
        bad = [c for c in checks if not c.ok]
        assert not bad, f"{name} at {size}: " + "; ".join(
            f"{c.name} {c.output}: max abs err {c.max_abs_error:.3g} ({c.worst_ratio:.2f}x tolerance)"
            for c in bad
        )


@pytest.fixture(scope="module")
def example_results(built):
    plan = [(built(n), model_path(n), sizes, launches) for n, (sizes, launches) in EXAMPLE_SIZES.items()]
    return dict(zip(EXAMPLE_SIZES, interpret_in_subprocess(plan)))


@pytest.fixture(scope="module")
def pattern_results(pattern):
    plan = [(pattern(n)[2], pattern(n)[3], sizes, None) for n, sizes in PATTERN_SIZES.items()]
    return dict(zip(PATTERN_SIZES, interpret_in_subprocess(plan)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLE_SIZES))
def test_example_model_kernels_match_reference(built, example_results, name):
    from aot.loader.bundle import open_bundle

    b = open_bundle(built(name))
    try:
        kernels = launched(b.program())
    finally:
        b.close()
    _assert_all_pass(name, example_results[name], EXAMPLE_SIZES[name][0], kernels)


def launched(program) -> set[str]:
    """The kernels the program's own steps launch (a GEMM site's default GEMV form runs in a
    tuning plan on sm_90 only; ``tests/codegen/test_gemm.py`` checks those forms)."""
    from aot.schema import StepKind

    return {s.target for s in program.steps if s.kind == StepKind.KERNEL}


@pytest.mark.parametrize("name", list(PATTERN_SIZES))
def test_pattern_kernels_match_reference(pattern, pattern_results, name):
    kernels = launched(pattern(name)[1].program)
    _assert_all_pass(name, pattern_results[name], PATTERN_SIZES[name], kernels)
