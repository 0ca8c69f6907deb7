"""What a call will allocate and compute, known before any of its steps runs.

The memory bound (``aot.loader.memory``) holds each step's result to its declared buffer, but a
step can only be measured after it allocated: a bundle accepted under 64 MiB could allocate 2 GiB
on every call before it was refused. So before the first call at given sizes, the steps run on the
meta device (shapes only: no memory, no arithmetic, microseconds a step), each result is held to
its declared bytes, and the call's arithmetic is counted (``flops_of``) and held to the budget:
the caller's ``max_flops``, and, without one, what the program needs at its largest admitted sizes
(computed at load, where the caller can read it as ``Runner.flops``): a program that computes more
at small sizes than at its largest is not one aotpack wrote. Checked sizes are remembered
(``CHECKED_SIZES``), so later calls at them pay a dictionary lookup.

Steps whose result size depends on values (``nonzero``, a boolean mask's index) end the walk:
steps after them are held to their declared bytes once they ran, as before.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from aot.aten import DTYPES, AtenCall
from aot.errors import AotError, BundleError, EnvError
from aot.loader.memory import largest_sizes
from aot.program import spec_bytes, tensor_specs
from aot.schema import Guards, Program, Step, StepKind
from aot.symexpr import compile_expr

CHECKED_SIZES = 4096  # distinct call sizes remembered as checked (one tuple each)
# what the meta walk may meet from a step that passed its contract: an op without a meta kernel for
# these arguments, or one whose result size depends on values
_META_FAILURES = (RuntimeError, NotImplementedError, ValueError, TypeError, IndexError)
MATMULS = frozenset(
    {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten._addmm_activation.default"}
)


def flops_of(op: str, args: list, result: Any) -> int:
    """Arithmetic of one step from its operands' and result's shapes: 2·m·n·k for matrix
    products, 2 per multiply-add of a convolution and of attention's two products, else an
    operation per element read or written."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    results = [
        r for r in (result if isinstance(result, (list, tuple)) else [result]) if isinstance(r, torch.Tensor)
    ]
    if op in MATMULS and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        return 2 * math.prod(a.shape) * (b.shape[-1] if b.dim() else 1)
    if op == "aten.convolution.default" and len(tensors) >= 2 and results:
        weight = tensors[1]
        return 2 * results[0].numel() * math.prod(weight.shape[1:])
    if op == "aten.scaled_dot_product_attention.default" and len(tensors) >= 3:
        q, k = tensors[0], tensors[1]
        return 4 * math.prod(q.shape) * (k.shape[-2] if k.dim() >= 2 else 1)
    return sum(t.numel() for t in tensors) + sum(r.numel() for r in results)


class PreRun:
    """The meta walk of one program on one path (``calls``: its prepared steps, as the executor
    runs them; ``steps``: the same, as written)."""

    def __init__(
        self,
        name: str,
        program: Program,
        steps: list[Step],
        calls: list[Any],
        weights: dict[str, torch.Tensor],
        guards: Guards,
        max_flops: int | None,
    ):
        self.name, self.program, self.steps, self.calls = name, program, steps, calls
        self.weights = {n: torch.empty_like(w, device="meta") for n, w in weights.items()}
        self.specs = tensor_specs(program)
        self.inputs = [
            (i.name, DTYPES.get(i.spec.dtype), [compile_expr(s) for s in i.spec.shape])
            for i in program.inputs
        ]
        self.max_flops = max_flops
        self.checked: set[tuple] = set()
        self.flops: int | None = None  # at the largest admitted sizes, where the walk gets through
        self.flops, _ = self._walk(largest_sizes(guards), budget=None, at_load=True)
        if max_flops is not None and self.flops is not None and self.flops > max_flops:
            raise EnvError(
                f"program {name!r} computes about {self.flops:.3g} operations per call at its largest "
                f"admitted sizes ({_sizes_text(largest_sizes(guards))}), more than max_flops {max_flops:.3g}; "
                f"raise max_flops, or rebuild with smaller declared ranges"
            )

    def check(self, sizes: dict[str, int]) -> None:
        """``BundleError`` (``EnvError`` for the caller's ``max_flops``) before a call at ``sizes``
        runs, if some step would make more than its declared bytes or the call would compute more
        than its budget."""
        key = tuple(sorted(sizes.items()))
        if key in self.checked:
            return
        budget = self.max_flops if self.max_flops is not None else self.flops
        self._walk(sizes, budget)
        if len(self.checked) >= CHECKED_SIZES:
            self.checked.clear()
        self.checked.add(key)

    def _walk(
        self, sizes: dict[str, int], budget: int | None, at_load: bool = False
    ) -> tuple[int | None, int]:
        """(the operations counted, the steps walked); ``None`` operations where the walk stopped
        early at load (a value-dependent size, or sizes the guards' relations do not admit)."""
        env: dict[str, Any] = dict(self.weights)
        try:
            for name, dtype, dims in self.inputs:
                env[name] = torch.empty([d(sizes) for d in dims], dtype=dtype, device="meta")
        except (AotError, *_META_FAILURES):
            return None, 0
        flops = 0
        for i, (step, call) in enumerate(zip(self.steps, self.calls)):
            if step.kind == StepKind.KERNEL:
                for out in step.outputs:
                    spec = self.specs.get(out) if out is not None else None
                    if spec is not None:
                        shape = [compile_expr(s)(sizes) for s in spec.shape]
                        env[out] = torch.empty(shape, dtype=DTYPES.get(spec.dtype), device="meta")
                continue
            assert isinstance(call, AtenCall)
            try:
                args = _meta_run(call, env, sizes)
            except (AotError, *_META_FAILURES):
                if at_load:
                    return None, i
                return flops, i  # a value-dependent size: the rest is held to its bytes as it runs
            result = (
                env[step.outputs[0]] if len(step.outputs) == 1 else [env.get(o) for o in step.outputs if o]
            )
            for out in step.outputs:
                value = env.get(out) if out is not None else None
                if not isinstance(value, torch.Tensor) or out not in self.program.buffers:
                    continue
                declared = spec_bytes(self.program.buffers[out], sizes)
                made = value.numel() * value.element_size()
                if made > declared:
                    raise BundleError(
                        f"step {i} ({step.target}) would make {out[:60]!r} of {made} bytes at sizes "
                        f"{_sizes_text(sizes)}, its buffer declares {declared}; refused before it ran: "
                        f"the program is wrong, rebuild the bundle"
                    )
            flops += flops_of(step.target, args, result)
            if budget is not None and flops > budget:
                self._over_budget(flops, budget, sizes, i, step)
        return flops, len(self.steps)

    def _over_budget(self, flops: int, budget: int, sizes: dict[str, int], i: int, step: Step) -> None:
        if self.max_flops is not None:
            raise EnvError(
                f"a call at sizes {_sizes_text(sizes)} computes more than {flops:.3g} operations (by step "
                f"{i}, {step.target}), more than max_flops {budget:.3g}; call with smaller inputs or "
                f"raise max_flops"
            )
        raise BundleError(
            f"a call at sizes {_sizes_text(sizes)} computes more than {flops:.3g} operations (by step {i}, "
            f"{step.target}), more than the {budget:.3g} the program needs at its largest admitted sizes; "
            f"not a program aotpack wrote: rebuild the bundle"
        )


def _meta_run(call: AtenCall, env: dict[str, Any], sizes: dict[str, int]) -> list:
    """Run ``call`` on the meta device (its contract checked as on a real call); returns its
    arguments."""
    meta = torch.device("meta")
    args, kwargs = call.arguments(env, sizes)
    args = [meta if isinstance(v, torch.device) else v for v in args]
    kwargs = {k: meta if isinstance(v, torch.device) else v for k, v in kwargs.items()}
    if call.contract is not None:
        call.contract.check(args, kwargs)
    result = call.op(*args, **kwargs)
    if len(call.outputs) == 1:
        env[call.outputs[0]] = result
    else:
        for name, v in zip(call.outputs, result):
            if name is not None:
                env[name] = v
    return args


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) or "static sizes"
