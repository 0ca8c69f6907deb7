"""One program of a loaded bundle, as the tools that drive it step by step see it.

``aotpack verify`` compares each GPU kernel with its reference steps and the whole program with
the CPU path; ``aotpack tune`` times a site's forms on the live buffers of a run. Both need more
than a call: the program's steps at a bucket (its tuned plan where it has one), the buffers a run
starts from, each step run on an environment of named buffers whose intermediates they read, and
a call of exactly this program (its graphs included). ``Runner.executors`` hands them out; nothing
outside the loader reaches into the runner's own records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aot.errors import GuardError
from aot.schema import Bucket, Guards, Program, Step

__all__ = ["ProgramExecutor"]


class ProgramExecutor:
    """Program ``index`` of ``runner`` (0: the general one). ``gpu`` (an ``aot.loader.gpu.GpuProgram``:
    ``prepare(steps)`` → calls and frees, ``context.bind()``) on a CUDA runner, ``cpu`` (an
    ``aot.loader.program.AtenProgram``) on a CPU one; the other is None."""

    def __init__(self, runner: Any, index: int):
        self._runner = runner
        self._entry = runner._entries[index]
        self.index = index

    @property
    def name(self) -> str:
        """What the program covers ("general", "batch == 1")."""
        return self._entry.name

    @property
    def entry_point(self) -> str:
        """The entry point it serves ("prefill", "decode"); "" without entry points."""
        return self._entry.entry

    @property
    def program(self) -> Program:
        return self._entry.program

    @property
    def guards(self) -> Guards:
        """The guards a call must satisfy to run this program."""
        return self._entry.guards.guards

    @property
    def gpu(self) -> Any:
        return self._entry.gpu

    @property
    def cpu(self) -> Any:
        return self._entry.aten

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        return self._runner.weights

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets whose CUDA graphs it captures (none on a CPU runner, or without capture)."""
        graphs = self._entry.graphs
        return tuple(graphs.buckets.values()) if graphs is not None else ()

    def admits(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, int] | None:
        """The symbol values of a call of ``inputs`` (by input name) when this program's guards
        admit it, else None."""
        try:
            return self._entry.guards.check(
                [inputs[n] for n in self._runner.input_names], self._runner.device
            )
        except GuardError:
            return None

    def bucket_for(self, sizes: Mapping[str, int]) -> tuple | None:
        """The key of the captured bucket a call at ``sizes`` replays, None when it runs uncaptured."""
        graphs = self._entry.graphs
        return graphs.bucket_for(dict(sizes)) if graphs is not None else None

    def plan_at(self, sizes: Mapping[str, int]) -> tuple[tuple[Step, ...], list[Any]]:
        """(steps, prepared calls) that a GPU call at ``sizes`` runs: its bucket's tuned plan where
        the tuning table chose one, else the program's steps."""
        gpu = self._entry.gpu
        key = self.bucket_for(sizes)
        steps = gpu.plan_steps.get(key, gpu.steps) if key is not None else gpu.steps
        calls = gpu.plans[key][0] if key in gpu.plans else gpu.calls
        return steps, calls

    def environment(self, inputs: Mapping[str, torch.Tensor], sizes: Mapping[str, int]) -> dict[str, Any]:
        """What a run at ``sizes`` starts from: the weights, ``inputs``, and the runner's state
        (a KV cache) as this call sees it. Steps run on it add their buffers by name."""
        env: dict[str, Any] = dict(self.gpu.weights if self.gpu is not None else self._runner.weights)
        if self.gpu is not None:
            env.update(self.gpu.scratch)
        env.update(inputs)
        env.update(self._runner.state.views(dict(sizes)))
        return env

    def run(self, calls: Sequence[Any], env: dict[str, Any], sizes: Mapping[str, int]) -> None:
        """Run prepared GPU ``calls`` (``gpu.prepare``, ``plan_at``) one after another on ``env``,
        on the current stream: their outputs land in ``env``."""
        from aot.loader.gpu import KernelCall

        stream = torch.cuda.current_stream(self._runner.device).cuda_stream
        sizes = dict(sizes)
        for call in calls:
            if type(call) is KernelCall:
                call(env, sizes, stream)
            else:
                call(env, sizes)

    def __call__(self, **inputs: Any) -> Any:
        """A call of this program alone, as the runner makes it (guards, graphs, state, outputs)."""
        return self._runner._call([self._entry], (), inputs)
