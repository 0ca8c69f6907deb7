"""What the stages hand each other: plain frozen dataclasses, no torch.fx objects.

``trace`` → ``Traced`` → ``generate`` → ``Compiled`` → ``pack`` → ``.tpk``. Tensors (weights and
reference data) travel as a name → tensor mapping; everything else is schema records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from aot.schema import Bucket, Guards, Program


@dataclass(frozen=True)
class Traced:
    name: str
    dtype: str
    program: Program  # every step an ATen call
    guards: Guards
    weights: Mapping[str, Any]  # name -> torch.Tensor, contiguous, on CPU
    reference_inputs: Mapping[str, Any]  # example inputs, by input name
    reference_outputs: tuple[Any, ...]  # eager outputs on the example inputs
    buckets: tuple[Bucket, ...]
    torch_version: str
    trace_seconds: float = 0.0


@dataclass(frozen=True)
class Compiled:
    traced: Traced
    program: Program  # with fused kernel steps
    archs: tuple[str, ...]
    cubins: Mapping[tuple[str, str], bytes] = field(default_factory=dict)  # (kernel id, arch) -> cubin
    triton_version: str = ""
    stats: Mapping[str, Any] = field(default_factory=dict)
