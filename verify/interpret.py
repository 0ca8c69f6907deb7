"""Run every kernel of a program on CPU with Triton's interpreter and compare it with its reference.

``TRITON_INTERPRET=1`` makes ``@triton.jit`` kernels run on CPU tensors, but it must be set
before ``triton`` is first imported, so this runs in a fresh process:
``interpret_in_subprocess([(bundle, model, sizes_list, launches)])`` runs
``python -m aot.verify.interpret`` and returns its results. In that process, each step of the
bundle's program runs in order: ATen steps as the loader runs them; a kernel step runs its
reference decomposition *and* the kernel (outputs pre-filled with NaN or a sentinel, so an element
the kernel fails to write shows up), and every output is compared. Later steps continue from the
reference values, so errors do not compound.

An element passes when ``|kernel - reference| <= atol + rtol * |reference|`` (``aot.dtypes.TOLERANCE``).
The kernels compute half-precision chains in fp32 and round once, while the reference rounds after
every op, hence the fp16 tolerance.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from aot.dtypes import tolerance

INT_SENTINEL = -7


@dataclass(frozen=True)
class KernelOutputComparison:
    step: int
    kernel: str  # kernel id
    name: str  # kernel function name
    output: str  # buffer name
    dtype: str
    max_abs_error: float
    worst_ratio: float  # max |err| / (atol + rtol*|ref|); <= 1 passes
    ok: bool


def _sizes_env(sizes: dict[str, int]) -> dict[str, int]:
    return {k: int(v) for k, v in sizes.items()}


def interpret_kernels(
    program,
    weights: dict,
    inputs: dict,
    sizes: dict[str, int],
    launches_per_kernel: int | None = None,
    from_kernels: dict | None = None,
) -> list[KernelOutputComparison]:
    """Run ``program``'s kernels in the interpreter; needs ``TRITON_INTERPRET=1`` before triton loads.

    ``launches_per_kernel``: interpret only the first N launches of each distinct kernel (the
    interpreter costs milliseconds per program instance); later launches run their reference only.
    ``from_kernels``: later steps read the kernels' outputs (and the states they wrote), not
    their references', every step runs, and this dict gets every buffer's final value: the
    program's outputs as the kernels compute them, end to end.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "interpret_kernels needs TRITON_INTERPRET=1 set before triton is imported; use interpret_in_subprocess"
        )
    import torch

    from aot.aten import DTYPES, AtenCall, state_writes_checked
    from aot.codegen.compile import load_function
    from aot.layout import empty_ordered, to_order
    from aot.program import scratch_args, scratch_shapes, tensor_specs
    from aot.schema import ParamKind, StepKind
    from aot.symexpr import evaluate

    cpu = torch.device("cpu")
    specs = tensor_specs(program)
    env: dict[str, Any] = dict(weights)
    # the kernels' scratch (arrival counters), zeroed as a runner allocates it; each kernel must
    # leave what it uses zeroed again (compared below as one of its outputs)
    env.update({n: torch.zeros(shape, dtype=torch.int32) for n, shape in scratch_shapes(program).items()})
    env.update(inputs)
    kernels = {k.id: k for k in program.kernels}
    functions: dict[str, Any] = {}
    launches: dict[str, int] = {}
    last = max((i for i, s in enumerate(program.steps) if s.kind == StepKind.KERNEL), default=-1)
    results: list[KernelOutputComparison] = []
    flat = [r for s in program.steps for r in (s.reference if s.kind == StepKind.KERNEL else (s,))]
    state = state_writes_checked(flat, program.state)  # what the state writes may write into
    upto = len(program.steps) if from_kernels is not None else last + 1
    for index, step in enumerate(program.steps[:upto]):
        if step.kind == StepKind.ATEN:
            AtenCall(step, cpu, state_aliases=state)(env, sizes)
            continue
        kernel = kernels[step.target]
        # a kernel that writes a state in place (a KV-cache write) and names no result: it runs on
        # a copy of the state as it was, compared with the state its reference steps leave
        written = [
            a.name
            for a, p in zip(step.args, kernel.params)
            if not step.outputs and p.kind == ParamKind.PTR and a.name in program.state
        ]
        # a kernel that names what it writes in place (``Step.in_place``: decode attention appending
        # to its cache, a cache write): it too runs on a copy of the state, compared as the output
        # that names it
        before = {n: env[n].clone() for n in [*written, *step.in_place.values()]}
        ref_env = dict(env)
        for r in step.reference:
            AtenCall(r, cpu, state_aliases=state)(ref_env, sizes)
        launches[kernel.id] = launches.get(kernel.id, 0) + 1
        # past its launches, a kernel's outputs are its references' (a GEMM form's prologue has
        # none of its own: it runs on)
        if (
            launches_per_kernel is not None
            and launches[kernel.id] > launches_per_kernel
            and all(o in ref_env for o in step.outputs)
        ):
            env.update({o: ref_env[o] for o in step.outputs})
            continue
        if kernel.id not in functions:
            functions[kernel.id] = load_function(kernel.id, kernel.name, kernel.source)
        outs: dict[str, torch.Tensor] = dict(before)
        for o in step.outputs:
            if o in step.in_place:
                outs[o] = outs[step.in_place[o]]
                continue
            spec = program.buffers[o]
            shape = [evaluate(s, sizes) for s in spec.shape]
            dtype = DTYPES[spec.dtype]
            fill = (
                float("nan") if dtype.is_floating_point else (False if dtype == torch.bool else INT_SENTINEL)
            )
            outs[o] = empty_ordered(shape, spec.order, dtype, cpu).fill_(fill)
        args = []
        for a, p in zip(step.args, kernel.params):
            if p.kind == ParamKind.PTR:
                spec = specs.get(a.name)
                args.append(
                    outs[a.name] if a.name in outs else to_order(env[a.name], spec.order if spec else ())
                )
            else:
                args.append(evaluate(a.text, sizes))
        grid = tuple(evaluate(g, sizes) for g in step.grid)
        if all(g > 0 for g in grid):
            functions[kernel.id][grid](*args)
        scratch = scratch_args(step, program)
        for name in scratch:  # compared below with the zeros it must be left as
            outs[name], ref_env[name] = env[name], torch.zeros_like(env[name])
        # the precision the reference computed in: a float32 output of float16 steps (GPT-J's RoPE
        # cast up after it) is compared at float16's tolerance, as the reference rounded to it
        reference_dtype = functools.reduce(
            looser_dtype, (specs[x].dtype for r in step.reference for x in r.outputs if x in specs), "float64"
        )
        for o in [*step.outputs, *written, *scratch]:
            if o not in ref_env:  # a GEMM form's prologue: the GEMM step after it has the references
                env[o] = outs[o]
                continue
            spec = specs[o]
            got, want = outs[o], ref_env[o]
            tol_dtype = (
                looser_dtype(spec.dtype, reference_dtype) if got.dtype.is_floating_point else spec.dtype
            )
            results.append(_compare(index, kernel.id, kernel.name, o, spec.dtype, got, want, tol_dtype))
        if from_kernels is not None:
            env.update({o: outs[o] for o in [*step.outputs, *written]})
            env.update({state: outs[state] for state in step.in_place.values()})
            continue
        for o in step.outputs:
            if o in ref_env:
                env[o] = ref_env[o]
    if from_kernels is not None:
        from_kernels.update(env)
    return results


def _compare(
    index, kernel_id, name, output, dtype, got, want, tol_dtype: str | None = None
) -> KernelOutputComparison:
    """A kernel's output ``got`` against its reference's ``want``: floats within the tolerance of
    ``tol_dtype`` (default ``dtype``), where NaN against NaN and an infinity against the same
    infinity agree and an element left unwritten (NaN) against a number does not; integers and
    booleans exactly."""
    import torch

    tol = tolerance(tol_dtype or dtype)
    if got.shape != want.shape:
        err, ratio = float("inf"), float("inf")
    elif got.numel() == 0:
        err, ratio = 0.0, 0.0
    elif got.dtype.is_floating_point:
        g64, w64 = got.double(), want.double()
        both_nan = torch.isnan(g64) & torch.isnan(w64)
        same_inf = torch.isinf(w64) & (g64 == w64)
        diff = (g64 - w64).abs().masked_fill(both_nan | same_inf, 0.0).nan_to_num(nan=float("inf"))
        err = diff.max().item()
        scale = tol.atol + tol.rtol * w64.abs().nan_to_num(0.0, 0.0, 0.0)
        ratio = (diff / scale).max().item() if (tol.atol or tol.rtol) else (float("inf") if err else 0.0)
    else:
        err = (
            (got.long() - want.long()).abs().max().item()
            if got.dtype != torch.bool
            else float((got != want).sum().item())
        )
        ratio = float("inf") if err else 0.0
    return KernelOutputComparison(
        index, kernel_id, name, output, dtype, float(err), float(ratio), bool(ratio <= 1.0)
    )


def looser_dtype(a: str, b: str) -> str:
    """Of two dtypes, the one with the looser tolerance: a float32 output of a float16 GEMM is
    compared at float16's, since the reference rounded its intermediates to float16."""
    return a if tolerance(a).rtol >= tolerance(b).rtol else b


def run_candidate(program, candidate, env: dict, sizes: dict[str, int], functions: dict) -> dict:
    """Run a GEMM candidate's kernel steps in the interpreter on ``env`` (not modified); returns
    the buffers they wrote. Outputs start as NaN, so an element never written shows up."""
    import torch

    from aot.aten import DTYPES
    from aot.codegen.compile import load_function
    from aot.schema import ParamKind
    from aot.symexpr import evaluate

    kernels = {k.id: k for k in program.kernels}
    local = dict(env)
    written = {}
    for step in candidate.steps:
        kernel = kernels[step.target]
        if kernel.id not in functions:
            functions[kernel.id] = load_function(kernel.id, kernel.name, kernel.source)
        for o in step.outputs:
            spec = program.buffers[o]
            local[o] = written[o] = torch.full(
                [evaluate(d, sizes) for d in spec.shape], float("nan"), dtype=DTYPES[spec.dtype]
            )
        args = [
            (local[a.name] if a.name in written else local[a.name].contiguous())
            if p.kind == ParamKind.PTR
            else evaluate(a.text, sizes)
            for a, p in zip(step.args, kernel.params)
        ]
        grid = tuple(evaluate(g, sizes) for g in step.grid)
        if all(g > 0 for g in grid):
            functions[kernel.id][grid](*args)
    return written


def interpret_alternatives(
    program, weights: dict, inputs: dict, sizes: dict[str, int], repeat: bool = True
) -> list[KernelOutputComparison]:
    """Every GEMM candidate of ``program`` (``Program.alternatives``) in the interpreter against
    the library steps it replaces, on the values the reference path computes at ``sizes``; needs
    ``TRITON_INTERPRET=1``. ``repeat``: run each split-K candidate once more and compare the
    two runs bit for bit (an ``exact`` comparison named ``<site>/<candidate>/rerun``; every
    output and workspace starts as NaN in each run, so the runs differ only where a kernel does
    not compute what it reads the same way twice)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret_alternatives needs TRITON_INTERPRET=1 set before triton is imported")
    import torch

    from aot.aten import AtenCall
    from aot.program import reference_steps

    cpu = torch.device("cpu")
    env: dict[str, Any] = dict(weights)
    env.update(inputs)
    for step in reference_steps(program):  # nothing freed: every site's inputs and outputs stay
        AtenCall(step, cpu)(env, sizes)
    functions: dict = {}
    results = []
    kernels = {k.id: k for k in program.kernels}
    for site in program.alternatives:
        for cand in site.candidates:
            got = run_candidate(program, cand, env, sizes, functions)
            label = f"{site.id}/{cand.name}"
            gemm_dtype = kernels[cand.steps[0].target].params[0].dtype  # A's
            for o in site.outputs:
                results.append(
                    _compare(
                        site.library[-1],
                        cand.steps[-1].target,
                        label,
                        o,
                        looser_dtype(program.buffers[o].dtype, gemm_dtype),
                        got[o],
                        env[o],
                    )
                )
            if repeat and len(cand.steps) > 1:
                again = run_candidate(program, cand, env, sizes, functions)
                for o in site.outputs:
                    same = bool(torch.equal(got[o], again[o]))
                    results.append(
                        KernelOutputComparison(
                            site.library[-1],
                            cand.steps[-1].target,
                            label + "/rerun",
                            o,
                            "exact",
                            0.0 if same else 1.0,
                            0.0 if same else float("inf"),
                            same,
                        )
                    )
    return results


def interpret_bundle(
    bundle: str | os.PathLike,
    model: str | os.PathLike,
    sizes_list: list[dict[str, int]],
    seed: int = 0,
    launches_per_kernel: int | None = None,
    alternatives: bool = False,
) -> dict[str, list[KernelOutputComparison]]:
    """Check ``bundle``'s kernels at each size, with the model file's example inputs at those sizes."""
    from safetensors.torch import load as load_safetensors

    from aot import schema
    from aot.bundle import open_bundle
    from aot.tracer import example_inputs, load_model_file

    spec = load_model_file(model)
    b = open_bundle(bundle)
    try:
        program = b.program()
        weights = load_safetensors(b.read(schema.WEIGHTS_PATH))
    finally:
        b.close()
    out = {}
    for sizes in sizes_list:
        inputs = example_inputs(spec, sizes, seed=seed + sum(sizes.values()))
        key = json.dumps(sizes, sort_keys=True)
        if alternatives:
            out[key] = interpret_alternatives(program, weights, inputs, _sizes_env(sizes))
        else:
            out[key] = interpret_kernels(program, weights, inputs, _sizes_env(sizes), launches_per_kernel)
    return out


def interpret_in_subprocess(
    plan: list[tuple], timeout: float = 1800
) -> list[dict[str, list[KernelOutputComparison]]]:
    """``interpret_bundle`` for several ``(bundle, model, sizes_list, launches_per_kernel)`` in one
    fresh Python with ``TRITON_INTERPRET=1``; a fifth item ``True`` checks the bundle's GEMM
    candidates instead of its kernels (``interpret_alternatives``)."""
    import tempfile

    items = [
        {
            "bundle": str(p[0]),
            "model": str(p[1]),
            "sizes": p[2],
            "launches": p[3],
            "alternatives": bool(p[4:5] and p[4]),
        }
        for p in plan
    ]
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(items, f)
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "aot.verify.interpret", plan_path]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter check failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return [{k: [KernelOutputComparison(**r) for r in v] for k, v in item.items()} for item in data]


def main(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    with open(argv[0]) as f:
        plan = json.load(f)
    out = []
    for item in plan:
        results = interpret_bundle(
            item["bundle"],
            item["model"],
            item["sizes"],
            launches_per_kernel=item["launches"],
            alternatives=item.get("alternatives", False),
        )
        out.append({k: [asdict(r) for r in v] for k, v in results.items()})
    print(json.dumps(out))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("TRITON_INTERPRET must be set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    if len(sys.argv) != 2:
        raise SystemExit(
            "usage: python -m aot.verify.interpret PLAN.json  "
            '(a list of {"bundle", "model", "sizes": [{"batch": 2}], "launches": null})'
        )
    main(sys.argv[1:])
