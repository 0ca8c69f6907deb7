"""What the stages hand each other: plain frozen dataclasses, no torch.fx objects.

``trace`` → ``Traced`` → ``generate`` → ``Compiled`` → ``pack`` → ``.tpk``. Tensors (weights and
reference data) travel as a name → tensor mapping; everything else is schema records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aot.schema import TORCH_MIN, Bucket, BuildStats, Environment, Guards, Program


@dataclass(frozen=True)
class TracedProgram:
    """One traced program and the guards under which it is valid (see ``ProgramEntry``)."""

    name: str
    program: Program
    guards: Guards
    buckets: tuple[Bucket, ...]
    entry: str = ""  # the entry point it serves ("prefill", "decode"); "" without entry points


@dataclass(frozen=True)
class Traced:
    name: str
    dtype: str
    program: Program  # every step an ATen call; the first of ``programs``
    guards: Guards  # the bundle's contract: every size some program admits
    weights: Mapping[str, Any]  # name -> torch.Tensor, contiguous, on CPU
    reference_inputs: Mapping[str, Any]  # example inputs, by input name
    reference_outputs: tuple[Any, ...]  # eager outputs on the example inputs
    buckets: tuple[Bucket, ...]
    torch_version: str
    trace_seconds: float = 0.0
    # Every program in dispatch order when one trace could not cover the declared ranges (the
    # first is ``program``); empty when ``program`` covers them alone.
    programs: tuple[TracedProgram, ...] = ()
    # Half-precision models: how far eager at the model dtype is from eager float32 on the
    # example inputs, relative to the output scale (what ``aotpack verify`` may expect at best).
    reference_noise: float = 0.0


@dataclass(frozen=True)
class Compiled:
    traced: Traced
    program: Program  # with fused kernel steps
    archs: tuple[str, ...]
    cubins: Mapping[tuple[str, str], bytes] = field(default_factory=dict)  # (kernel id, arch) -> cubin
    triton_version: str = ""
    # arch -> CUDA release of the ptxas that compiled its cubins (empty without kernels)
    cuda_versions: Mapping[str, str] = field(default_factory=dict)
    stats: BuildStats = BuildStats()


def environment(
    archs: tuple[str, ...],
    torch_built: str,
    triton_built: str = "",
    cuda_built: Mapping[str, str] | None = None,
) -> Environment:
    """The environment guards of a bundle built for ``archs``."""
    import sys

    return Environment(
        archs=tuple(archs),
        torch_built=torch_built,
        torch_min=TORCH_MIN,
        triton_built=triton_built,
        python_built=f"{sys.version_info[0]}.{sys.version_info[1]}",
        cuda_built=dict(cuda_built or {}),
    )
