"""What the stages hand each other: plain frozen dataclasses, no torch.fx objects.

``trace`` → ``Traced`` → ``generate`` → ``Compiled`` → ``pack`` → ``.tpk``. Tensors (weights and
reference data) travel as a name → tensor mapping; everything else is schema records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from aot.archs import parse_arch
from aot.schema import TORCH_MIN, Bucket, BuildStats, Environment, Guards, Program, TuningTable

DEFAULT_ARCHS = ("sm_80", "sm_90")


@dataclass(frozen=True)
class TracedProgram:
    """One traced program and the guards under which it is valid (see ``ProgramEntry``)."""

    name: str
    program: Program
    guards: Guards
    buckets: tuple[Bucket, ...]
    entry: str = ""  # the entry point it serves ("prefill", "decode"); "" without entry points
    model_lines: Mapping[str, str] = field(default_factory=dict)  # a step's result -> "model.py:12"


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
    # The model line that made each step's result ("model.py:12"), of every program (the first
    # program's where two name a result alike), for errors that name a step (a --library-free
    # build's refusal).
    model_lines: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildOptions:
    """How ``generate`` builds: the cubin archs, and the switches of ``aotpack build``.

    ``fuse=False`` keeps every ATen step; ``gemm_candidates`` also compiles Triton candidates for
    the library GEMMs (``aotpack tune`` picks); ``stack_siblings=False`` keeps sibling matmuls
    apart; ``channels_last=False`` keeps every tensor row-major; ``decode_attention=False`` keeps
    one-token SDPA calls over a KV cache library calls (``aot.codegen.decode_attention``);
    ``library_free`` (with ``gemm_candidates``) makes every step a kernel or a copy, or fails
    (``aot.codegen.library_free``)."""

    archs: tuple[str, ...] = DEFAULT_ARCHS
    fuse: bool = True
    gemm_candidates: bool = False
    stack_siblings: bool = True
    channels_last: bool = True
    decode_attention: bool = True
    library_free: bool = False

    def __post_init__(self):
        if isinstance(self.archs, str) or not self.archs:
            raise ValueError(
                f"BuildOptions.archs is a tuple of arch names such as ('sm_90',), got {self.archs!r}"
            )
        names = tuple(dict.fromkeys(parse_arch(a).name for a in self.archs))
        if names != tuple(self.archs):
            raise ValueError(
                f"BuildOptions.archs must be distinct sm_ names, got {self.archs!r}; use {names!r}"
            )
        switches = {
            "fuse": self.fuse,
            "gemm_candidates": self.gemm_candidates,
            "stack_siblings": self.stack_siblings,
            "channels_last": self.channels_last,
            "decode_attention": self.decode_attention,
            "library_free": self.library_free,
        }
        for name, value in switches.items():
            if type(value) is not bool:
                raise ValueError(f"BuildOptions.{name} is True or False, got {value!r}")

    def hash(self) -> str:
        """A digest of every option (for cache keys and reports)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    # the build's own tuning table (``aot.codegen.gemm_defaults``: forms a GPU of its arch runs
    # without a tune), written as the bundle's tuning member; None: none
    tuning: TuningTable | None = None


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
