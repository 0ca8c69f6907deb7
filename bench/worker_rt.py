"""One ``aotpack-rt`` measurement in a fresh process that never imports torch (``bench/run.py``'s
system ``aotpack-rt``), shaped like ``bench/worker.py``'s result.

    python bench/worker_rt.py MODEL --spawned-at T --bundle MODEL-lf.tpk --inputs DIR/MODEL.inputs.npz \
        --first DIR/MODEL.first.safetensors --labels JSON --out DIR

``DIR/MODEL.inputs.npz`` (written by ``bench/run.py``, with torch, before this process starts)
holds the inputs of each measured shape, ``{shape index}.{input index}``. Cold start is the wall
time from spawning this process to the first shape's output on the host (the GPU work done),
split into phases (``cold_start_phases_s``: interpreter, import, verify, waited_for_driver,
kernels, weights, load_other, inputs, first_call).
Then per shape: ``WARMUP`` calls, ``CALLS`` timed calls synchronized after each (median, p90).
Device memory: the device's used bytes beyond the context (``cuMemGetInfo``: weights, arena,
outputs, the runtime's allocations) at its highest sample. Outputs go to
``DIR/MODEL.aotpack-rt.safetensors`` in float32 for ``bench/run.py``'s comparison with eager.
"""

from __future__ import annotations

import time

STARTED = time.time()  # the interpreter is up: what came before is its start

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def first(out):
    return out if hasattr(out, "dtype") else out[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--spawned-at", type=float, required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--first", required=True, help="the first shape's inputs by name (safetensors)")
    ap.add_argument("--labels", required=True, help="JSON list of the shapes' labels")
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()

    import aot.runtime

    aot.runtime.start_driver(0)  # the driver starts beside the imports and the bundle's checks
    import aot.runtime.runner  # noqa: F401 - what load imports, counted as import

    imported = time.time()
    runner = aot.runtime.load(args.bundle)
    loaded = time.time()
    context = runner.context_bytes
    # the first call's inputs: a safetensors file read as raw bytes (``Runner.inputs_from``), as a
    # server reads its requests off the wire (no numpy before the answer)
    inputs = runner.inputs_from(args.first)
    called = time.time()
    first(runner.run((), inputs)).tobytes()
    done = time.time()
    free_after_first = runner.gpu.memory()[0]
    import numpy as np

    stored = np.load(args.inputs)
    labels = json.loads(args.labels)
    shapes = [
        [
            stored[k]
            for k in sorted(
                (k for k in stored.files if k.startswith(f"{i}.")), key=lambda k: int(k.split(".")[1])
            )
        ]
        for i in range(len(labels))
    ]
    lowest_free: list[int] = []

    def sample_free() -> None:
        runner.gpu.synchronize()
        lowest_free.append(runner.gpu.memory()[0])

    result = {"system": "aotpack-rt", "model": args.model, "cold_start_s": done - args.spawned_at}
    # where the cold start went: interpreter start, imports (aot.runtime's modules, while
    # the driver starts on its own thread: its bindings' import, cuInit, the context), load's
    # phases (``Runner.timings``: the bundle verified, the wait for the driver, cubins loaded,
    # weights streamed), the inputs read, the first call
    result["cold_start_phases_s"] = {
        "interpreter": STARTED - args.spawned_at,
        "import": imported - STARTED,
        **{k.removesuffix("_s"): v for k, v in runner.timings.items()},
        "load_other": (loaded - imported) - sum(runner.timings.values()),
        "inputs": called - loaded,
        "first_call": done - called,
    }
    # the weights' own stream (read, hashed, copied), on a thread beside the kernels' loading:
    # ``kernels`` + ``weights`` (the wait for it after them) is the wall time it took
    result["weights_stream_s"] = runner.weights_stream_s
    # whether the runtime's modules came from bytecode (compiled at install) or were compiled now
    result["bytecode_cached"] = os.path.exists(importlib.util.cache_from_source(aot.runtime.runner.__file__))
    sample_free()
    result["shapes"], outputs = {}, {}
    for label, host in zip(labels, shapes):
        inputs = [runner.array(x) for x in host]
        for _ in range(args.warmup):
            runner.run(inputs)
        runner.gpu.synchronize()
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            runner.run(inputs)
            runner.gpu.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        sample_free()
        out = first(runner.run(inputs))
        outputs[label] = out.numpy().astype(np.float32)
        result["shapes"][label] = {
            "median_ms": times[len(times) // 2] * 1e3,
            "p90_ms": times[int(len(times) * 0.9)] * 1e3,
            "input_bytes": sum(x.nbytes for x in host),
            "output_bytes": out.nbytes,
        }
    _, total = runner.gpu.memory()
    result["device_mem_mb"] = (total - min(lowest_free) - context) / 2**20
    # where the device memory went: the load (weights, state, the cubins' modules), the first call
    # (its arena, CUDA graph and output), the calls at every shape (arenas grown, graphs, outputs
    # kept in the stream-ordered pool)
    loaded = runner.loaded_bytes
    first_call = total - free_after_first - context - loaded
    result["device_mem_phases_mb"] = {
        "load": loaded / 2**20,
        "load_beyond_weights_and_state": (loaded - runner.weights_bytes - runner.checked.state.size) / 2**20,
        "first_call": first_call / 2**20,
        "later_calls": (total - min(lowest_free) - context - loaded - first_call) / 2**20,
    }
    result["weights_mb"] = runner.weights_bytes / 2**20
    result["arena_mb"] = runner.arena_bytes / 2**20
    result["torch_imported"] = "torch" in sys.modules
    from safetensors.numpy import save_file

    save_file(outputs, f"{args.out}/{args.model}.aotpack-rt.safetensors")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
