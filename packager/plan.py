"""The memory plan: buffer liveness over the program, resolved at each CUDA-graph bucket.

A buffer lives from the step that writes it to the last step that reads it or any view of it
(view ops alias their input and allocate nothing). The loader frees every buffer after its last
use, so inside a capture the graph pool hands that memory to later buffers; this plan is the
peak the program needs at each bucket's sizes, recorded in the manifest so ``aotpack inspect``
shows what a capture will hold and ``aotpack load`` can report it against what was reserved.
"""

from __future__ import annotations

import itertools

from aot.program import peak_bytes
from aot.schema import Bucket, BucketMemory, Program

__all__ = ["memory_plan", "peak_bytes"]


def memory_plan(program: Program, buckets: tuple[Bucket, ...]) -> tuple[BucketMemory, ...]:
    """Peak activation bytes at every combination of bucket sizes, largest first."""
    order = [s.symbol for s in program.symbols]
    by_symbol = {b.symbol: b.sizes for b in buckets}
    if any(s not in by_symbol for s in order):
        return ()
    keys = sorted(itertools.product(*(by_symbol[s] for s in order)), key=lambda k: [-v for v in k])
    return tuple(
        BucketMemory(sizes=dict(zip(order, key)), peak_bytes=peak_bytes(program, dict(zip(order, key))))
        for key in keys
    )
