"""``aotpack load``: run a bundle, time it and check it, as ``trtexec`` users expect.

Inputs are the bundle's example inputs, generated ones at ``--sizes``, or a user's safetensors
file. The reference is the eager output recorded at build time (example inputs), or the same bundle
run on the CPU when the device is a GPU (any inputs); on the CPU with other inputs there is none,
so no verdict. The default ``atol`` is the dtype's tolerance times the reference's scale
(``aot.dtypes.tolerance``), the rule every comparison in aotpack uses.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from aot.dtypes import name_of, tolerance
from aot.errors import BundleError


@dataclass
class LoadReport:
    bundle: str
    device: str
    sizes: dict[str, int]
    outputs: list[dict[str, Any]]  # name, dtype, shape, max_abs_err
    latency_ms: dict[str, float]
    iters: int
    warmup: int
    reference: str | None = None  # "build reference", "cpu program" or None
    max_abs_err: float | None = None
    atol: float | None = None
    tensors: dict[str, Any] = field(default_factory=dict, repr=False)  # output name -> tensor

    @property
    def passed(self) -> bool | None:
        if self.max_abs_err is None or self.atol is None:
            return None
        return self.max_abs_err <= self.atol

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle": self.bundle,
            "device": self.device,
            "sizes": self.sizes,
            "outputs": self.outputs,
            "latency_ms": self.latency_ms,
            "iters": self.iters,
            "warmup": self.warmup,
            "reference": self.reference,
            "max_abs_err": self.max_abs_err,
            "atol": self.atol,
            "passed": self.passed,
        }

    def lines(self) -> list[str]:
        out = []
        for o in self.outputs:
            line = f"output {o['name']}: {o['dtype']}{o['shape']}"
            if o.get("max_abs_err") is not None:
                line += f"  max abs error vs {self.reference} {o['max_abs_err']:.3g}"
            out.append(line)
        lat = self.latency_ms
        out.append(
            f"latency: median {lat['median']:.3f} ms, p90 {lat['p90']:.3f} ms over {self.iters} calls "
            f"(min {lat['min']:.3f}, p99 {lat['p99']:.3f}, max {lat['max']:.3f}; {self.warmup} warm-up)"
        )
        if self.passed is not None:
            verdict = "PASS" if self.passed else "FAIL"
            out.append(
                f"{verdict}: max abs error {self.max_abs_err:.3g} {'<=' if self.passed else '>'} atol "
                f"{self.atol:.3g} vs the {self.reference}"
            )
        return out


def percentile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * q))]


def run(
    runner,
    bundle: str,
    inputs: dict[str, Any],
    reference: list | None,
    reference_name: str | None,
    iters: int,
    warmup: int,
    atol: float | None,
) -> LoadReport:
    """Call ``runner`` once for its outputs, ``warmup`` more times untimed, then ``iters`` timed calls."""
    import torch

    from aot.pytree import leaf_paths, leaves

    cuda = runner.device.type == "cuda"
    outputs = leaves(runner(**inputs))
    names = leaf_paths(runner.program.output_tree, len(outputs))
    if reference is not None and [tuple(r.shape) for r in reference] != [tuple(o.shape) for o in outputs]:
        raise BundleError(
            f"{bundle}: its reference outputs have shapes {[list(r.shape) for r in reference][:4]}, "
            f"the program gives {[list(o.shape) for o in outputs][:4]}; the bundle is inconsistent"
        )
    for _ in range(warmup):
        runner(**inputs)
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner(**inputs)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    latency = {
        "min": times[0],
        "median": statistics.median(times),
        "p90": percentile(times, 0.9),
        "p99": percentile(times, 0.99),
        "max": times[-1],
    }
    report = LoadReport(
        bundle,
        str(runner.device),
        runner.guards.check(list(inputs[n] for n in runner.input_names)),
        [],
        latency,
        iters,
        warmup,
        tensors=dict(zip(names, outputs)),
    )
    worst, bound = None, None
    for i, out in enumerate(outputs):
        entry = {"name": names[i], "dtype": name_of(out.dtype), "shape": list(out.shape), "max_abs_err": None}
        if reference is not None and out.numel():
            want = reference[i].detach().cpu()
            got = out.detach().cpu()
            if want.dtype.is_floating_point:
                err = (got.float() - want.float()).abs().max().item()
                scale = max(1.0, want.float().abs().max().item())
                limit = tolerance(name_of(want.dtype)).rtol * scale
            else:
                err, limit = float((got != want).any()), 0.0
            entry["max_abs_err"] = err
            worst = err if worst is None else max(worst, err)
            bound = limit if bound is None else max(bound, limit)
        report.outputs.append(entry)
    if worst is not None:
        report.reference, report.max_abs_err = reference_name, worst
        report.atol = atol if atol is not None else bound
    return report
