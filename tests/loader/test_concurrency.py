"""One loaded runner, called from 8 threads at once with different shapes, on CPU.

Every call must give the eager result for its own inputs (tolerances as in the end-to-end tests),
outputs must belong to their caller (mutating one never changes another call's result), and a
thread's failure must fail the test rather than vanish. Rejections are concurrent too: threads
that pass bad shapes get their own ``GuardError`` while the others keep computing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from aot.errors import GuardError
from aot.loader import load
from tests.hostile_util import eager_module

THREADS = 8
CALLS_PER_THREAD = 12
ATOL = {torch.float32: 1e-5, torch.float16: 2e-2}
# per model: one shape per thread (all different), plus a shape outside the guards
SHAPES = {
    "branchy": [(1, 10), (2, 12), (3, 16), (4, 30), (5, 64), (7, 2 * 50), (8, 128), (16, 256)],
    "small_mlp": [(1,), (2,), (3,), (5,), (8,), (13,), (33,), (64,)],
}
OUTSIDE = {"branchy": (2, 11), "small_mlp": (65,)}
FEATURES = {"branchy": (16,), "small_mlp": (32,)}


def _inputs(model: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, *FEATURES[model], generator=g).to(dtype)


def _run_threads(work, n: int) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def target(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            work(i)
        except BaseException as e:  # a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("model", ["branchy", "small_mlp"])
def test_eight_threads_different_shapes_give_eager_results(built, model):
    runner = load(built(model))
    dtype = torch.float16 if model == "small_mlp" else torch.float32
    module = eager_module(model)
    shapes = SHAPES[model]
    assert len(shapes) == THREADS and len(set(shapes)) == THREADS
    # per thread and call: its own inputs and the eager result, computed before the threads start
    cases = [
        [_inputs(model, shapes[i], 1000 * i + k, dtype) for k in range(CALLS_PER_THREAD)]
        for i in range(THREADS)
    ]
    with torch.no_grad():
        expected = [[module(v) for v in row] for row in cases]
    results: list[list[torch.Tensor | None]] = [[None] * CALLS_PER_THREAD for _ in range(THREADS)]

    def work(i: int) -> None:
        for k in range(CALLS_PER_THREAD):
            out = runner(cases[i][k])
            results[i][k] = out.clone()
            out.fill_(float("nan"))  # the caller owns it: this must not reach any other call

    errors = _run_threads(work, THREADS)
    runner.bundle.close()
    assert not errors, errors[:3]
    for i in range(THREADS):
        for k in range(CALLS_PER_THREAD):
            got = results[i][k]
            assert got.shape == expected[i][k].shape, (i, k)
            torch.testing.assert_close(
                got,
                expected[i][k],
                atol=ATOL[dtype],
                rtol=ATOL[dtype],
                msg=f"thread {i} call {k} shape {shapes[i]}",
            )


def test_rejections_and_calls_interleave(built):
    """Half the threads pass shapes outside the guards; the others still get correct results."""
    runner = load(built("branchy"))
    module = eager_module("branchy")
    good = _inputs("branchy", (3, 20), 7, torch.float32)
    bad = _inputs("branchy", OUTSIDE["branchy"], 8, torch.float32)
    with torch.no_grad():
        expected = module(good)
    rejected = [0] * THREADS

    def work(i: int) -> None:
        for _ in range(CALLS_PER_THREAD):
            if i % 2:
                try:
                    runner(bad)
                except GuardError as e:
                    assert "(seq): expected 10 <= seq <= 256, seq % 2 == 0, got 11" in str(e)
                    rejected[i] += 1
            else:
                torch.testing.assert_close(runner(good), expected, atol=1e-5, rtol=1e-5)

    errors = _run_threads(work, THREADS)
    runner.bundle.close()
    assert not errors, errors[:3]
    assert rejected == [0, CALLS_PER_THREAD] * (THREADS // 2)
