"""The memory plan: buffer liveness over the program, resolved at each CUDA-graph bucket.

A buffer lives from the step that writes it to the last step that reads it or any view of it
(view ops alias their input and allocate nothing). The loader frees every buffer after its last
use, so inside a capture the graph pool hands that memory to later buffers; this plan is the
peak the program needs at each bucket's sizes, recorded in the manifest so ``aotpack inspect``
shows what a capture will hold and ``aotpack load`` can report it against what was reserved.
"""

from __future__ import annotations

from aot.buckets import bucket_sizes, largest_first
from aot.program import peak_bytes
from aot.schema import Bucket, BucketMemory, Program

__all__ = ["memory_plan", "peak_bytes"]


def memory_plan(program: Program, buckets: tuple[Bucket, ...]) -> tuple[BucketMemory, ...]:
    """Peak activation bytes at every combination of bucket sizes, largest first."""
    every = sorted(bucket_sizes(program, buckets), key=largest_first)
    return tuple(BucketMemory(sizes=sizes, peak_bytes=peak_bytes(program, sizes)) for sizes in every)
