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


# gpt at batch 2 x seq 16: 3 MiB of logits, below TAIL_MIN_BYTES, so the graph computes them
@pytest.mark.parametrize("name,sizes", [("mlp", {"batch": 8}), ("gpt", {"batch": 2, "seq": 16})])
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
    reserved = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    runner(**x, out=out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    tail = any(c.tail for e in runner._entries if e.graphs for c in e.graphs.graphs.values())
    # outputs computed after the graph (gpt's logits) pass through one transient buffer, which the
    # allocator hands back on the next call: no new memory from the device
    allowed = sum(t.untyped_storage().nbytes() for t in leaves(expected)) + (1 << 20) if tail else 1 << 20
    assert peak - before < allowed, f"an out= call allocated {(peak - before) / 2**20:.1f} MiB"
    assert torch.cuda.memory_reserved() == reserved
    for a, b in zip(leaves(out), leaves(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_large_outputs_are_computed_after_the_graph_into_memory_the_caller_owns(monkeypatch):
    """gpt's logits at batch 8 x seq 128 (98 MiB) come from the GEMM run after the replay: the
    same values as when the graph computes them, a new tensor per call (the first call's result
    unchanged by the second), and no copy of them left in the graphs' pool."""
    import aot.loader.gpu as gpu

    sizes = {"batch": 8, "seq": 128}
    after = load(_bundle("gpt"), device="cuda")
    x, y = after.inputs_at(sizes, seed=6), after.inputs_at(sizes, seed=7)
    first = after(**x)
    kept = first.clone()
    second = after(**y)
    entry = next(e for e in after._entries if e.graphs is not None)
    captured = next(iter(entry.graphs.graphs.values()))
    assert captured.tail is not None
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    monkeypatch.setattr(gpu, "TAIL_MIN_BYTES", 1 << 62)
    inside = load(_bundle("gpt"), device="cuda")
    torch.testing.assert_close(inside(**x), kept, rtol=0, atol=0)
    torch.testing.assert_close(inside(**y), second, rtol=0, atol=0)
    assert next(iter(next(e for e in inside._entries if e.graphs).graphs.graphs.values())).tail is None
    torch.cuda.synchronize()
    pools = {}
    for name, runner in (("after", after), ("inside", inside)):
        pool = next(e for e in runner._entries if e.graphs is not None).graphs.pool
        pools[name] = sum(seg["total_size"] for seg in pool.snapshot())
    logits = 8 * 128 * 50257 * 2
    assert pools["inside"] - pools["after"] >= logits, pools


def test_every_program_and_bucket_shares_one_pool():
    runner = load(_bundle("gpt"), device="cuda")
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 2, "seq": 64}):
        runner(**runner.inputs_at(sizes))
    graphs = [e.graphs for e in runner._entries if e.graphs is not None]
    assert graphs and len({g.pool for g in graphs}) == 1 and len({id(g.lock) for g in graphs}) == 1


# One fresh process per measurement: device memory is the process's, and what an earlier test
# loaded (ATen's kernels, cuBLAS) would hide what a runner costs. The process's own device memory
# comes from NVML's per-process accounting where it lists this process: the device-wide free count
# (the fallback) also moves with whatever other processes on the GPU do meanwhile, as parallel test
# workers' runners did.
_PROBE = """
import ctypes, os, sys, torch
from aot.loader import load

class _Proc(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]

def _nvml():
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        handle = ctypes.c_void_p()
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
        if lib.nvmlInit_v2() or lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)):
            return None
        return lib, handle
    except (OSError, AttributeError):
        return None

def used(nvml):
    if nvml is not None:
        lib, handle = nvml
        procs, count = (_Proc * 256)(), ctypes.c_uint(256)
        if not lib.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), procs):
            mine = [p.used for p in procs[: count.value] if p.pid == os.getpid()]
            if mine:
                return mine[0], "process"
    free, total = torch.cuda.mem_get_info()
    return total - free, "device"

torch.cuda.init(); torch.cuda.synchronize()
nvml = _nvml()
base, _ = used(nvml)
runner = load(sys.argv[1], device="cuda", capture=sys.argv[2])
weights = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in runner.weights.values()}.values())
reserved = torch.cuda.memory_reserved()
for batch in (1, 8):
    x = runner.inputs_at({"batch": batch}, seed=1)
    for _ in range(3):
        runner(**x)
torch.cuda.synchronize()
now, how = used(nvml)
print(how, (now - base) / 2**20, reserved / 2**20, weights / 2**20)
"""


def _probe(path: Path, capture: str) -> tuple[float, float, float, str]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), capture], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    how, *values = done.stdout.split()[-4:]
    device, reserved, weights = map(float, values)
    return device, reserved, weights, how


def test_cuda_graphs_and_weights_cost_the_mlp_next_to_no_device_memory():
    """Graphs captured through the driver launch no ATen kernel (torch.cuda.CUDAGraph's capture
    did: ~92 MiB on an H200 for a process's first one), and the weights are one allocation (one
    by one, the allocator served each 8 MiB matrix from a 20 MiB segment)."""
    path = _bundle("mlp")
    graphs, reserved, weights, how = _probe(path, "lazy")
    plain, _, _, how_plain = _probe(path, "none")
    assert how == how_plain, f"the two probes measured differently ({how} vs {how_plain}): not comparable"
    assert graphs - plain <= 16, (
        f"CUDA graphs took {graphs - plain:.0f} MiB more than none ({graphs:.0f} vs {plain:.0f}; "
        f"measured per {how}: 'device' counts other processes on the GPU too)"
    )
    assert reserved - weights <= 4, (
        f"after load the allocator holds {reserved:.1f} MiB for {weights:.1f} MiB of weights"
    )
