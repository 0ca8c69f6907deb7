"""Run a program's steps with ATen library calls: the CPU path, and the fallback on any device.

Steps are prepared once at load (``aot.aten``: each overload resolved, a missing one an
``EnvError`` naming it). A kernel step runs its reference decomposition here. Buffers are dropped
after their last use, and every result is held to its declared buffer's bytes at the call's sizes
(``aot.memory``): a step that makes more than its program declares is a ``BundleError``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from typing import Any

import torch

from aot.allowed_ops import STATE_WRITE_OPS
from aot.aten import CALL_BUDGET, DTYPES, AtenCall
from aot.errors import AotError, BundleError, GuardError
from aot.loader.prerun import Budget, itemsizes
from aot.memory import OutputBytes
from aot.program import frees_after, reference_steps, step_writes, tensor_specs
from aot.schema import Program, Step
from aot.symexpr import Expr, compile_expr


class AtenProgram:
    """Executes the program with ATen calls only; stateless per call, so thread-safe."""

    def __init__(
        self,
        program: Program,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        steps: list[Step] | None = None,
        state_aliases: frozenset[str] = frozenset(),
        max_flops: int | None = None,
    ):
        self.program = program
        self.max_flops = max_flops
        self.weights = weights
        steps = steps if steps is not None else reference_steps(program)
        undeclared = [o for s in steps for o in step_writes(s) if o not in program.buffers]
        if undeclared:
            raise BundleError(
                f"step result {undeclared[0][:60]!r} has no declared buffer (dtype and shape); "
                f"rebuild the bundle"
            )
        specs = tensor_specs(program)
        self.calls = [AtenCall(s, device, weights, state_aliases, specs, i) for i, s in enumerate(steps)]
        self.frees = frees_after(
            steps, [*weights, *(i.name for i in program.inputs), *program.scratch], program.outputs
        )
        self.declared = OutputBytes(program)
        self.itemsizes = itemsizes(program)

    def __call__(self, inputs: dict[str, torch.Tensor], sizes: dict[str, int]) -> list[torch.Tensor]:
        env: dict[str, Any] = dict(self.weights)
        env.update(inputs)
        declared = self.declared.at(sizes)
        env[CALL_BUDGET] = Budget(declared, self.itemsizes, self.max_flops, sizes)
        try:
            for call, frees in zip(self.calls, self.frees):
                call(env, sizes)
                for name in call.outputs:
                    if name is not None and _nbytes(env[name]) > declared[name]:
                        raise BundleError(
                            f"step {self.calls.index(call)} ({call.name}) made {name[:60]!r} of "
                            f"{_nbytes(env[name])} bytes at sizes {sizes}, its buffer declares "
                            f"{declared[name]}; the program is wrong, rebuild the bundle"
                        )
                for name in frees:
                    del env[name]
        except (AotError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # the inputs passed the guards, so the program itself is at fault
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:300]
            if call.name in STATE_WRITE_OPS and isinstance(e, (IndexError, RuntimeError)):
                # guards check sizes, not values: an index input (cache_position) beyond the state
                raise GuardError(
                    f"step {self.calls.index(call)} ({call.name}) writes the state out of its bounds at sizes "
                    f"{sizes}: {first}; index inputs such as cache_position must address slots of the state "
                    f"(0 <= slot < its size)"
                ) from None
            raise BundleError(
                f"step {self.calls.index(call)} ({call.name}) failed at sizes {sizes}: {type(e).__name__}: {first}; "
                f"the inputs passed the bundle's guards, so its program or guards are wrong: rebuild the bundle"
            ) from None
        return [env[o] for o in self.program.outputs]


class OutputSpecs:
    """The dtype, shape and device the program declares for each output, checked after every call
    (a few comparisons per output) so that a program cannot hand the caller something else."""

    def __init__(self, program: Program, device: torch.device):
        specs = tensor_specs(program)
        self.device_type, self.device_index = device.type, device.index
        self.where = device.type if device.index is None else f"{device.type}:{device.index}"
        self.expected: list[tuple[str, torch.dtype, list[int | Expr]]] = []
        for name in program.outputs:
            spec = specs.get(name)
            if spec is None or spec.dtype not in DTYPES:
                raise BundleError(f"program output {name[:40]!r} has no tensor spec; rebuild the bundle")
            dims = [compile_expr(s) for s in spec.shape]
            self.expected.append((name, DTYPES[spec.dtype], [d({}) if d.is_constant else d for d in dims]))

    def _fits(self, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        return (
            t.dtype == dtype
            and t.shape == shape
            and t.device.type == self.device_type
            and (self.device_index is None or t.device.index == self.device_index)
        )

    def check(self, outputs: list[Any], sizes: dict[str, int]) -> None:
        for (name, dtype, dims), out in zip(self.expected, outputs):
            shape = tuple(d if type(d) is int else d(sizes) for d in dims)
            if type(out) is not torch.Tensor or not self._fits(out, dtype, shape):
                got = (
                    f"{out.dtype} {list(out.shape)} on {out.device}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise BundleError(
                    f"program output {name!r} is {got}, the program declares {dtype} {list(shape)} on "
                    f"{self.where}; the bundle's program is wrong: rebuild it with a trusted aotpack"
                )

    def check_out(
        self, out: list[Any], sizes: dict[str, int], taken: list[tuple[int, int]], owned: list[Storages]
    ) -> None:
        """Caller-provided output buffers (``runner(..., out=...)``): each must be a contiguous
        tensor of exactly the output's dtype, shape and device at these sizes, sharing no memory
        with ``taken`` (the inputs' storages), ``owned`` (the weights, the state) or another buffer.
        ``GuardError`` otherwise, before anything runs."""
        spans = list(taken)
        for i, ((name, dtype, dims), buf) in enumerate(zip(self.expected, out)):
            shape = tuple(d if type(d) is int else d(sizes) for d in dims)
            if not self._fits(buf, dtype, shape):
                raise GuardError(
                    f"out buffer {i} (output {name!r}) is {buf.dtype} {list(buf.shape)} on {buf.device}; "
                    f"expected {dtype} {list(shape)} on {self.where} for this call: allocate it with that "
                    f"dtype, shape and device"
                )
            if not buf.is_contiguous():
                raise GuardError(
                    f"out buffer {i} (output {name!r}) is not contiguous (strides {list(buf.stride())}); "
                    f"pass a contiguous tensor (torch.empty(...))"
                )
            start = buf.data_ptr()
            end = start + buf.numel() * buf.element_size()
            if any(o.overlaps(start, end) for o in owned) or any(s < end and start < e for s, e in spans):
                raise GuardError(
                    f"out buffer {i} (output {name!r}) shares memory with an input, a weight, the state "
                    f"or another out buffer; pass buffers of their own"
                )
            spans.append((start, end))


class Storages:
    """Memory the runner owns (its weights), as sorted byte ranges, so that an output sharing any
    of it, a view of a weight included, is told apart in logarithmic time."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        spans = sorted(storage_span(t) for t in tensors)
        self.starts = [s for s, _ in spans]
        self.ends = list(itertools.accumulate((e for _, e in spans), max))  # furthest end so far

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self.starts, end)  # ranges starting before ``end``
        return i > 0 and self.ends[i - 1] > start


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of the whole storage ``t`` views."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0
