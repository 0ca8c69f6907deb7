"""Run a program's steps with ATen library calls: the CPU path, and the fallback on any device.

Steps are prepared once at load (``aot.aten``: each overload resolved, a missing one an
``EnvError`` naming it). A kernel step runs its reference decomposition here. Buffers are dropped
after their last use, and every result is held to its declared buffer's bytes at the call's sizes
(``aot.loader.memory``): a step that makes more than its program declares is a ``BundleError``.
"""

from __future__ import annotations

from typing import Any

import torch

from aot.aten import AtenCall
from aot.errors import AotError, BundleError
from aot.loader.memory import OutputBytes
from aot.program import frees_after, reference_steps, step_writes
from aot.schema import Program, Step


class AtenProgram:
    """Executes the program with ATen calls only; stateless per call, so thread-safe."""

    def __init__(
        self,
        program: Program,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        steps: list[Step] | None = None,
    ):
        self.program = program
        self.weights = weights
        steps = steps if steps is not None else reference_steps(program)
        undeclared = [o for s in steps for o in step_writes(s) if o not in program.buffers]
        if undeclared:
            raise BundleError(
                f"step result {undeclared[0][:60]!r} has no declared buffer (dtype and shape); "
                f"rebuild the bundle"
            )
        self.calls = [AtenCall(s, device) for s in steps]
        self.frees = frees_after(steps, [*weights, *(i.name for i in program.inputs)], program.outputs)
        self.declared = OutputBytes(program)

    def __call__(self, inputs: dict[str, torch.Tensor], sizes: dict[str, int]) -> list[torch.Tensor]:
        env: dict[str, Any] = dict(self.weights)
        env.update(inputs)
        declared = self.declared.at(sizes)
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
            raise BundleError(
                f"step {self.calls.index(call)} ({call.name}) failed at sizes {sizes}: {type(e).__name__}: {first}; "
                f"the inputs passed the bundle's guards, so its program or guards are wrong: rebuild the bundle"
            ) from None
        return [env[o] for o in self.program.outputs]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0
