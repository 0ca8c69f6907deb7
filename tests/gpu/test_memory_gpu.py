"""GPU side of where results go (tests/loader/test_outputs.py has the CPU side): borrowed outputs
are the graph's own memory and equal the copied ones; ``out=`` buffers receive a replay's results
without a new allocation; all programs and buckets of a runner capture into one pool.

    AOTPACK_GPU_BUNDLES=/path/with/{mlp,gpt}.tpk pytest -m gpu tests/gpu/test_memory_gpu.py

Never run in CI (no GPU there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from aot.loader import load
from aot.pytree import leaves

pytestmark = pytest.mark.gpu

BUNDLES = Path(os.environ.get("AOTPACK_GPU_BUNDLES", "bundles"))


def _bundle(name: str) -> Path:
    path = BUNDLES / f"{name}.tpk"
    if not path.is_file():
        pytest.skip(f"no prebuilt bundle {path}")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return path


@pytest.mark.parametrize("name,sizes", [("mlp", {"batch": 8}), ("gpt", {"batch": 2, "seq": 64})])
def test_borrowed_outputs_are_the_graphs_memory_and_equal_copied_ones(name, sizes):
    owned = load(_bundle(name), device="cuda")
    borrowed = load(_bundle(name), device="cuda", outputs="borrow")
    x = owned.inputs_at(sizes, seed=3)
    expected = [t.clone() for t in leaves(owned(**x))]
    first = leaves(borrowed(**x))
    ptrs = [t.data_ptr() for t in first]
    for a, b in zip(first, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    second = leaves(borrowed(**borrowed.inputs_at(sizes, seed=4)))
    assert [t.data_ptr() for t in second] == ptrs  # lent again, not copied


@pytest.mark.parametrize("name,sizes", [("mlp", {"batch": 8}), ("gpt", {"batch": 8, "seq": 128})])
def test_out_buffers_take_no_new_allocation(name, sizes):
    runner = load(_bundle(name), device="cuda")
    x = runner.inputs_at(sizes, seed=5)
    expected = runner(**x)  # captures the bucket's graph
    out = (
        torch.empty_like(expected)
        if isinstance(expected, torch.Tensor)
        else type(expected)(torch.empty_like(t) for t in expected)
    )
    runner(**x, out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runner(**x, out=out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak - before < 1 << 20, f"an out= call allocated {(peak - before) / 2**20:.1f} MiB"
    for a, b in zip(leaves(out), leaves(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_every_program_and_bucket_shares_one_pool():
    runner = load(_bundle("gpt"), device="cuda")
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 2, "seq": 64}):
        runner(**runner.inputs_at(sizes))
    graphs = [e.graphs for e in runner._entries if e.graphs is not None]
    assert graphs and len({g.pool for g in graphs}) == 1 and len({id(g.lock) for g in graphs}) == 1
