"""``aotpack verify``: on a GPU, check every kernel step against its reference decomposition and
the whole program against the CPU reference path, at the bundle's buckets.

Kernel steps are checked in place: the program runs step by step on the GPU, and before each kernel
launch its reference ATen steps run on the same inputs; the kernel's outputs must match theirs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from aot.admissible import admits
from aot.aten import AtenCall, state_writes_checked
from aot.dtypes import tolerance
from aot.loader import Runner, load
from aot.loader.executor import ProgramExecutor
from aot.loader.gpu import KernelCall
from aot.loader.program import AtenProgram
from aot.loader.values import integers_like
from aot.program import scratch_args
from aot.pytree import leaves
from aot.schema import Bucket, Guards, Program, StepKind

# Two half-precision evaluations of one network differ by up to about twice their distance from
# the exact result; a few times the build's measure of that distance is what a bundle may differ by.
NOISE_FACTOR = 4


@dataclass
class BucketReport:
    sizes: dict[str, int]
    program: str = "general"
    program_err: float = 0.0
    program_scale: float = 0.0
    graph_err: float | None = None
    kernel_errs: dict[str, float] = field(default_factory=dict)  # kernel name -> worst relative error


def check_sizes(guards: Guards, buckets: tuple[Bucket, ...], max_per_symbol: int = 8) -> list[dict[str, int]]:
    """Each symbol's buckets in turn, the other symbols at a small admitted size."""
    symbols = {g.name: g for g in guards.symbols}
    base = {}
    for name, g in symbols.items():
        base[name] = next((v for v in range(min(g.max, 4), g.max + 1) if admits(g, v)), g.min)
    out = [dict(base)]
    for b in buckets:
        sizes = list(b.sizes)
        if len(sizes) > max_per_symbol:
            step = (len(sizes) - 1) / (max_per_symbol - 1)
            sizes = sorted({sizes[round(i * step)] for i in range(max_per_symbol)})
        for v in sizes:
            s = {**base, b.symbol: v}
            if s not in out:
                out.append(s)
    return out


def _inputs(
    runner: Runner, program: Program, sizes: dict[str, int], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    ref = runner.example_inputs()
    out = {}
    for inp in program.inputs:
        shape = [sizes[s] if s in sizes else int(s) for s in inp.spec.shape]
        if inp.name in program.state:  # the runner's state starts zeroed (a fresh KV cache)
            out[inp.name] = torch.zeros(shape, dtype=getattr(torch, inp.spec.dtype))
            continue
        example = ref[inp.name]
        if example.dtype.is_floating_point:
            lo, hi = example.min().item(), example.max().item()
            t = torch.rand(shape, generator=gen) * (hi - lo) + lo
        else:
            t = integers_like(example, shape, gen)
        out[inp.name] = t.to(example.dtype)
    return out


def verify(path: str, device: str = "cuda") -> list[BucketReport]:
    """Every program of the bundle at its bucket sizes (see the module docstring).

    TF32 is off while it runs: with it, cuDNN and cuBLAS round float32 to a 10-bit mantissa, and a
    deep network's float32 outputs then move by as much as float16's, hiding what verify is for."""
    with _exact_float32():
        gpu_runner = load(path, device=device, capture="lazy")
        cpu_runner = load(path, device="cpu")
        reports = []
        for on_gpu, on_cpu in zip(gpu_runner.executors, cpu_runner.executors):
            reports += _verify_program(gpu_runner, on_gpu, on_cpu)
    return reports


@contextlib.contextmanager
def _exact_float32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _verify_program(
    gpu_runner: Runner, executor: ProgramExecutor, on_cpu: ProgramExecutor
) -> list[BucketReport]:
    gpu = executor.gpu
    reports = []
    gen = torch.Generator().manual_seed(0)
    cpu_prog: AtenProgram = on_cpu.cpu
    for sizes in check_sizes(executor.guards, executor.buckets):
        # a tuned bucket launches its plan's GEMM candidates: check those kernels there
        steps, calls = executor.plan_at(sizes)
        # what a kernel's reference steps may write: the state (a KV-cache write folded into decode
        # attention or a cache-write kernel), as the CPU path allows it
        flat = [r for s in steps for r in (s.reference if s.kind == StepKind.KERNEL else (s,))]
        state = state_writes_checked(flat, gpu.program.state)
        references = {
            i: [AtenCall(s, gpu.device, state_aliases=state) for s in step.reference]
            for i, step in enumerate(steps)
            if step.kind == StepKind.KERNEL
        }
        # what each reference produced: a split-K partial sum, a split-KV decode attention's
        # workspace are the next step's to stand for (their reduce, their combine is checked)
        produced = {i: {o for ref in steps[i].reference for o in ref.outputs} for i in references}
        inputs = _inputs(gpu_runner, gpu.program, sizes, gen)
        report = BucketReport(sizes=sizes, program=executor.name)
        # each path writes into a state of its own (the CPU program writes in place)
        want = cpu_prog({k: v.clone() if k in gpu.program.state else v for k, v in inputs.items()}, sizes)
        env = dict(gpu.weights)
        env.update(gpu.scratch)
        env.update({k: v.to(gpu.device) for k, v in inputs.items()})
        gpu.context.bind()
        for i, call in enumerate(calls):
            if type(call) is not KernelCall:
                executor.run((call,), env, sizes)
                continue
            ref_env = dict(env)  # the reference runs on the buffers as the kernel finds them
            for target in steps[i].in_place.values():  # a state the kernel writes: its own copy
                ref_env[target] = env[target].clone()
            for ref in references[i]:
                ref(ref_env, sizes)
            executor.run((call,), env, sizes)
            if any(env[name].any() for name in scratch_args(steps[i], gpu.program)):
                report.kernel_errs[call.name] = float("inf")  # it must leave the scratch it counts on zeroed
            for name in call.outputs:
                if name not in produced[i]:
                    continue
                expected = ref_env[name].float()
                err = (env[name].float() - expected).abs().max().item() if expected.numel() else 0.0
                rel = err / max(1.0, expected.abs().max().item() if expected.numel() else 1.0)
                report.kernel_errs[call.name] = max(report.kernel_errs.get(call.name, 0.0), rel)
        got = [env[o] for o in gpu.program.outputs]
        for w, g in zip(want, got):
            report.program_err = max(report.program_err, (g.float().cpu() - w.float()).abs().max().item())
            report.program_scale = max(report.program_scale, w.float().abs().max().item())
        if executor.bucket_for(sizes) is not None:
            given = {k: inputs[k].to(gpu.device) for k in gpu_runner.input_names}
            # a stateful program's first call captures on its own inputs (no replay); the second replays
            for _ in range(2 if gpu.program.state else 1):
                gpu_runner.reset()  # the runner's own state, zeroed as the program's above was
                replayed = leaves(executor(**given))
            report.graph_err = max((r.float() - g.float()).abs().max().item() for r, g in zip(replayed, got))
        reports.append(report)
    return reports


def reference_noise(manifest) -> float:
    """The build's measure of the model's own half-precision error (``stats.reference_noise``);
    0.0 when not a fraction in [0, 1)."""
    noise = manifest.stats.reference_noise
    return noise if 0 <= noise < 1 else 0.0


def program_tolerance(dtype: str, reference_noise: float = 0.0) -> float:
    """Relative tolerance of the whole program against the CPU path: the dtype's, or, for a
    network whose own half-precision error is larger (the build measured eager at the model dtype
    against float32: ``reference_noise``), a few times that: two half-precision evaluations of the
    same network differ by up to about twice their distance from the exact result."""
    return max(tolerance(dtype).rtol, NOISE_FACTOR * reference_noise)


def passed(report: BucketReport, dtype: str, reference_noise: float = 0.0) -> bool:
    tol = tolerance(dtype).rtol
    program_tol = program_tolerance(dtype, reference_noise)
    return (
        report.program_err <= program_tol * max(1.0, report.program_scale)
        and all(e <= tol for e in report.kernel_errs.values())
        and (report.graph_err is None or report.graph_err <= program_tol * max(1.0, report.program_scale))
    )
