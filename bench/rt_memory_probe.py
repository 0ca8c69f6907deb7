"""Where the runtime's device memory goes past the weights, step by step, on a GPU: the device's
used bytes (``cuMemGetInfo``) after the driver starts, the load, one 256-byte stream-ordered
allocation from the device's default pool (what a call's outputs came from before ``Device.take``), one plain
``cuMemAlloc`` of 256 bytes, the first call (arena, CUDA graph, output), a second call, and the
first call of a runner that launches without a graph. One process per bundle.

    python bench/rt_memory_probe.py BUNDLE.tpk [BUNDLE.tpk ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = r"""
import json, sys
import aot.runtime
from aot.runtime.cli import _inputs
path, graphs = sys.argv[1], sys.argv[2] == "1"
runner = aot.runtime.load(path, graphs=graphs)
gpu = runner.gpu
total = gpu.memory()[1]
MiB = 2**20
marks = {"context": runner.context_bytes / MiB}

def mark(name):
    gpu.synchronize()
    marks[name] = (total - gpu.memory()[0]) / MiB

mark("loaded")
if graphs:
    from cuda.bindings import driver as cu
    p = cu.cuMemAllocAsync(256, gpu.stream)[1]
    mark("pool_256B")
    cu.cuMemFreeAsync(p, gpu.stream)
    q = gpu.alloc(256)
    mark("cuMemAlloc_256B")
    gpu.free(q)
inputs = _inputs(runner, {})
mark("inputs")
out = runner(**inputs)
mark("first_call")
del out
out = runner(**inputs)
mark("second_call")
print(json.dumps({"bundle": path, "graphs": graphs, "used_mib": marks,
                  "weights_mib": runner.weights_bytes / MiB, "arena_mib": runner.arena_bytes / MiB}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for bundle in args.bundles:
        for graphs in ("1", "0"):
            done = subprocess.run(
                [sys.executable, "-c", PROBE, bundle, graphs], capture_output=True, text=True
            )
            if done.returncode:
                print(bundle, graphs, "failed:", done.stderr[-1500:])
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
