"""GPU timing for ``aotpack tune``: a form or a whole program captured in a CUDA graph and timed
between CUDA events, with an optional L2 flush so that a form reads its weights cold, as in a call."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aot.loader.executor import ProgramExecutor

DEFAULT_REPEATS = 50  # timed graph replays per form
REPLAYS = 10  # copies of the form captured back to back in one graph (launch cost amortized)
WARMUP = 3


def graph_us(run: Callable[[], None], device, copies: int, repeats: int) -> float:
    """Median microseconds per copy of ``run``: warmed up on a side stream (library handles and
    workspaces exist before capture), captured ``copies`` times in one CUDA graph, replayed
    ``repeats`` times between CUDA events."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        for _ in range(copies):
            run()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / copies)
    del graph
    return statistics.median(times)


@dataclass(frozen=True)
class L2Flush:
    """A buffer twice the GPU's L2 cache (at least 64 MiB), whose write evicts what a form read,
    and the median microseconds of that write, timed once and taken off every form's time."""

    buffer: torch.Tensor
    us: float


def l2_flush(device, repeats: int) -> L2Flush:
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    buffer = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device=device)
    return L2Flush(buffer, graph_us(buffer.zero_, device, REPLAYS, repeats))


def time_form(
    executor: ProgramExecutor,
    calls: list[Any],
    env: dict[str, Any],
    sizes: dict[str, int],
    repeats: int,
    flush: L2Flush | None = None,
) -> float:
    """Median microseconds of one run of ``calls`` (``executor``'s), replayed in a CUDA graph; with
    ``flush``, each run after a write of its buffer (L2 cold, as in a call), the write's own time
    taken off."""
    local = dict(env)

    def run() -> None:
        if flush is not None:
            flush.buffer.zero_()
        executor.run(calls, local, sizes)

    us = graph_us(run, executor.device, REPLAYS, repeats)
    return max(us - flush.us, 0.0) if flush is not None else us


def time_program(
    executor: ProgramExecutor,
    calls: list[Any],
    frees: list[tuple[str, ...]],
    env: dict[str, Any],
    sizes: dict[str, int],
    repeats: int,
) -> float:
    """Median microseconds of one whole call of a program's ``calls`` on ``env`` (weights, inputs,
    state), dropping each buffer after its last use (``frees``) as a call does."""

    def run() -> None:
        local = dict(env)
        for call, free in zip(calls, frees):
            executor.run((call,), local, sizes)
            for name in free:
                local.pop(name, None)

    return graph_us(run, executor.device, 1, repeats)
