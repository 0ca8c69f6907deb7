"""Loader stage: ``.tpk`` → ``Runner``.

Opens and verifies the bundle, preflights the environment (schema, ops this torch must have),
loads the weights, and serves calls: every call's inputs are checked against the guards, then the
program runs. This package imports only ``aot`` core, torch, safetensors and zstandard: never
the tracer, codegen, packager, triton, sympy, torch._dynamo or torch._inductor.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from aot import schema
from aot.errors import BundleError, EnvError
from aot.loader.bundle import Bundle, open_bundle
from aot.loader.guards import GuardChecker
from aot.loader.program import DTYPES, AtenProgram, resolve_op
from aot.loader.weights import to_device
from aot.manifest_text import manifest_of_bundle, render
from aot.schema import Manifest

__all__ = ["Runner", "load", "open_bundle"]

CAPTURE_MODES = ("lazy", "all", "none")


def _load_tensors(bundle: Bundle, name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = bundle.read(name)
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise BundleError(f"{bundle.path}: {name} is not valid safetensors: {e}") from None


class Runner:
    """A loaded bundle, callable like the model: ``runner(x)`` or ``runner(x=x)``.

    Thread-safe: each call keeps its intermediates to itself.
    """

    def __init__(self, bundle: Bundle, device: str | torch.device = "cpu", capture: str = "lazy"):
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
        self.bundle = bundle
        self.manifest: Manifest = bundle.manifest
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EnvError("device cuda requested but torch sees no CUDA GPU; load with device='cpu'")
        for op in self.manifest.ops:
            resolve_op(op)
        self.program = bundle.program()
        weights = to_device(bundle.read(schema.WEIGHTS_PATH), self.device, f"{bundle.path}: {schema.WEIGHTS_PATH}")
        for w in self.program.weights:
            t = weights.get(w.name)
            if t is None:
                raise BundleError(f"{bundle.path}: weight {w.name!r} is missing from {schema.WEIGHTS_PATH}")
            if str(t.dtype).removeprefix("torch.") != w.spec.dtype or [str(s) for s in t.shape] != list(w.spec.shape):
                raise BundleError(
                    f"{bundle.path}: weight {w.name!r} is {t.dtype} {list(t.shape)}, the program expects "
                    f"{w.spec.dtype} {list(w.spec.shape)}"
                )
        self.weights = weights
        self._weight_ptrs = frozenset(w.data_ptr() for w in weights.values())
        self.guards = GuardChecker(self.manifest.guards, DTYPES)
        self._gpu = None
        self._graphs = None
        if self.device.type == "cuda":
            from aot.loader.gpu import GpuProgram, GraphRunner

            self._gpu = GpuProgram(bundle, self.program, self.weights, self.device)
            if capture != "none":
                self._graphs = GraphRunner(self._gpu, self.manifest.buckets)
                if capture == "all":
                    self._graphs.capture_all()
        else:
            self._aten = AtenProgram(self.program, self.weights, self.device)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.guards.names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = self.guards.bind(args, dict(kwargs))
        sizes = self.guards.check(values, self.device)
        inputs = dict(zip(self.guards.names, values))
        if self._gpu is None:
            outputs = self._aten(inputs, sizes)
        else:
            key = self._graphs.bucket_for(sizes) if self._graphs is not None else None
            if key is not None:
                return _unpack(self._graphs(key, inputs, sizes))  # copied out of the graph: caller-owned
            outputs = self._gpu(inputs, sizes)
        # outputs must never alias a weight or an input the caller may mutate
        owned = self._weight_ptrs | {v.data_ptr() for v in values}
        return _unpack([o.clone() if o.data_ptr() in owned else o for o in outputs])

    def example_inputs(self) -> dict[str, torch.Tensor]:
        ref = _load_tensors(self.bundle, schema.REFERENCE_PATH)
        missing = [n for n in self.input_names if schema.REFERENCE_INPUT_PREFIX + n not in ref]
        if missing:
            raise BundleError(f"{self.bundle.path}: {schema.REFERENCE_PATH} has no example for inputs {missing[:3]}")
        return {n: ref[schema.REFERENCE_INPUT_PREFIX + n].to(self.device) for n in self.input_names}

    def reference_outputs(self) -> list[torch.Tensor]:
        ref = _load_tensors(self.bundle, schema.REFERENCE_PATH)
        outs = sorted(
            (int(k.removeprefix(schema.REFERENCE_OUTPUT_PREFIX)), v)
            for k, v in ref.items()
            if k.startswith(schema.REFERENCE_OUTPUT_PREFIX) and k[len(schema.REFERENCE_OUTPUT_PREFIX):].isdecimal()
        )
        return [v for _, v in outs]

    def guards_text(self) -> str:
        return render(manifest_of_bundle(self.manifest))


def _unpack(outputs: list[torch.Tensor]) -> Any:
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def load(path: str | os.PathLike, device: str | torch.device = "cpu", capture: str = "lazy") -> Runner:
    """Open, verify and prepare a bundle for calls on ``device``.

    On CUDA, ``capture`` picks when CUDA graphs are captured: ``"lazy"`` (a bucket's graph on its
    first call: the fastest start), ``"all"`` (every bucket at load, largest first), or ``"none"``
    (kernels launched one by one on every call).
    """
    bundle = open_bundle(path)
    try:
        return Runner(bundle, device, capture)
    except BaseException:
        bundle.close()  # a server that retries a bad bundle must not leak its file handle
        raise
