"""aotpack-rt beside the torch loader on the same library-free bundles, on one GPU.

    python bench/runtime_rt.py OUT.json BUNDLE:SIZES [BUNDLE:SIZES ...]   # e.g. .bundles/mlp-lf.tpk:batch=1

Per bundle and sizes, each system runs in a fresh process (the parent imports neither torch nor
the runtime): cold start is the wall time from spawning the process to its first result on the
host (the output copied back, so the GPU work is done); then ``ITERS`` calls, synchronized after
each, give the median latency; device memory is the device's used bytes (``cuMemGetInfo`` /
``torch.cuda.mem_get_info``: context, weights, plan, all) after the calls, and before the load
(the context alone). Both get the same input,
already on the device; both return outputs the caller owns. The outputs of the two are compared
afterwards, bit for bit. Rows of their own: ``import torch``, ``import aot.runtime`` and the
driver bindings' imports, each a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ITERS = 200
WARMUP = 20

CHILD_RT = r"""
import sys, time, json
import numpy as np
import aot.runtime
bundle, inp, out = sys.argv[1:4]
runner = aot.runtime.load(bundle)
loaded = time.time()
host = dict(np.load(inp))
x = {k: runner.array(v) for k, v in host.items()}
y = runner.run((), x)
first = y.numpy()
t_first = time.time()
np.save(out, first)
for _ in range(WARMUP):
    runner.run((), x)
runner.gpu.synchronize()
times = []
for _ in range(ITERS):
    t = time.perf_counter(); r = runner.run((), x); runner.gpu.synchronize(); times.append(time.perf_counter() - t)
free, total = runner.gpu.memory()
print(json.dumps({"t_first": t_first, "median_ms": 1e3 * sorted(times)[len(times) // 2],
                  "device_used_mib": (total - free) / 2**20, "weights_mib": runner.weights_bytes / 2**20,
                  "arena_mib": runner.arena_bytes / 2**20, "device": runner.gpu.name,
                  "load_phases_s": runner.timings, "device_used_before_load_mib": runner.context_bytes / 2**20, "first_call_s": t_first - loaded,
                  "driver": runner.gpu.driver_version, "arch": runner.arch}))
"""

CHILD_TORCH = r"""
import sys, time, json
import numpy as np
import torch
from aot.loader import load
bundle, inp, out = sys.argv[1:4]
torch.cuda.init()
free0, total0 = torch.cuda.mem_get_info()
runner = load(bundle, device="cuda")
x = {k: torch.from_numpy(v).cuda() for k, v in dict(np.load(inp)).items()}
y = runner(**x)
first = y.cpu().numpy()
t_first = time.time()
np.save(out, first)
for _ in range(WARMUP):
    runner(**x)
torch.cuda.synchronize()
times = []
for _ in range(ITERS):
    t = time.perf_counter(); r = runner(**x); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
free, total = torch.cuda.mem_get_info()
print(json.dumps({"t_first": t_first, "median_ms": 1e3 * sorted(times)[len(times) // 2],
                  "device_used_mib": (total - free) / 2**20, "torch": torch.__version__,
                  "device_used_before_load_mib": (total0 - free0) / 2**20}))
"""


def spawn(code: str, *args: str) -> tuple[float, dict]:
    """Run ``code`` in a fresh interpreter; (seconds from spawn to its ``t_first`` or its exit, its JSON)."""
    env = dict(os.environ, WARMUP=str(WARMUP), ITERS=str(ITERS))
    prelude = f"WARMUP = {WARMUP}\nITERS = {ITERS}\n"
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-c", prelude + code, *args], capture_output=True, text=True, env=env
    )
    end = time.time()
    if done.returncode != 0:
        return end - start, {"error": done.stderr[-2000:]}
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines else {}
    return report.pop("t_first", end) - start, report


def inputs(bundle: str, sizes: dict[str, int], path: str) -> None:
    """Seeded inputs at ``sizes`` from the bundle's guards (token ids below 50257)."""
    import numpy as np

    from aot.runtime import check

    rng = np.random.default_rng(0)
    checked = check(bundle)
    arrays = {}
    for name, _, dtype, dims in checked.entries[0].guards.inputs:
        shape = [d if type(d) is int else sizes[d] for d in dims]
        if dtype.startswith("int"):
            arrays[name] = rng.integers(0, 50257, size=shape).astype(dtype)
        else:
            arrays[name] = rng.standard_normal(shape).astype(dtype)
    np.savez(path, **arrays)


def main(out: str, configs: list[str]) -> None:
    import numpy as np

    rows = []
    for code, what in (
        ("import torch", "import torch"),
        # the package imports its modules when first used: what ``load`` imports
        ("import aot.runtime.runner", "import aot.runtime (its modules)"),
        ("import cuda.bindings.driver", "import cuda.bindings.driver"),
        ("import cuda.core", "import cuda.core"),
    ):
        times = [spawn(code)[0] for _ in range(3)]
        rows.append({"row": what, "seconds": sorted(times)[1]})
    tmp = tempfile.mkdtemp()
    for config in configs:
        bundle, _, text = config.partition(":")
        sizes = {k: int(v) for k, v in (p.split("=") for p in text.split(",") if p)}
        inp = os.path.join(tmp, "in.npz")
        inputs(bundle, sizes, inp)
        row = {"bundle": os.path.basename(bundle), "sizes": sizes}
        for system, code in (("aotpack-rt", CHILD_RT), ("torch loader", CHILD_TORCH)):
            got = os.path.join(tmp, f"{system[:5]}.npy")
            cold, report = spawn(code, bundle, inp, got)
            row[system] = {"cold_start_s": round(cold, 3), **report}
        try:
            a, b = np.load(os.path.join(tmp, "aotpa.npy")), np.load(os.path.join(tmp, "torch.npy"))
            row["bitwise_equal"] = bool(np.array_equal(a, b))
            row["max_abs_diff"] = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        except (OSError, ValueError) as e:
            row["compare_error"] = str(e)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"iters": ITERS, "rows": rows}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
