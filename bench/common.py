"""Shared pieces of the benchmark: model files, shapes, inputs, model construction from a weights
file, timing.

Models: the example models (``models/{mlp,gpt,cnn}.py``) and real ones from the libraries users
deploy (``bench/models/{llama,resnet50,convnext_tiny}.py``: transformers and timm). Every system
loads the same fp16 weights from a safetensors file (not random init, which would put seconds of
initialization into every cold start but aotpack's).

``AOTPACK_BENCH_SMOKE=1`` (``bench/run.py --smoke``) checks the harness without a GPU: tiny
shapes, a few calls, and the real-model files switch to tiny configurations.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIRS = (ROOT / "models", ROOT / "bench" / "models")
SMOKE = os.environ.get("AOTPACK_BENCH_SMOKE") == "1"
# The shapes each model is timed at: symbol values. Every one is a CUDA-graph bucket of its model
# file, so no system pads, and `aotpack tune --bucket` tunes exactly these.
GPU_SHAPES = {
    "mlp": [{"batch": 1}, {"batch": 8}],
    "gpt": [{"batch": 1, "seq": 128}, {"batch": 8, "seq": 128}, {"batch": 1, "seq": 1}],
    "gpt_bf16": [{"batch": 1, "seq": 128}, {"batch": 8, "seq": 128}, {"batch": 1, "seq": 1}],
    "cnn": [{"batch": 1}, {"batch": 8}],
    "llama": [{"batch": 1, "seq": 128}, {"batch": 8, "seq": 128}, {"batch": 1, "seq": 1}],
    "resnet50": [{"batch": 1}, {"batch": 8}],
    "convnext_tiny": [{"batch": 1}, {"batch": 8}],
}
SMOKE_SHAPES = {
    "mlp": [{"batch": 1}, {"batch": 2}],
    "gpt": [{"batch": 1, "seq": 8}, {"batch": 1, "seq": 1}],
    "gpt_bf16": [{"batch": 1, "seq": 8}, {"batch": 1, "seq": 1}],
    "cnn": [{"batch": 1}, {"batch": 2}],
    "llama": [{"batch": 1, "seq": 8}, {"batch": 2, "seq": 8}, {"batch": 1, "seq": 1}],
    "resnet50": [{"batch": 1}, {"batch": 2}],
    "convnext_tiny": [{"batch": 1}, {"batch": 2}],
}
SHAPES = SMOKE_SHAPES if SMOKE else GPU_SHAPES
WARMUP = 2 if SMOKE else 20
CALLS = 5 if SMOKE else 200


def shape_label(sizes: dict[str, int]) -> str:
    return " ".join(f"{k[0].upper()}={v}" for k, v in sizes.items())


def model_file(model: str) -> Path:
    for folder in MODEL_DIRS:
        path = folder / f"{model}.py"
        if path.is_file():
            return path
    raise SystemExit(f"no model file {model}.py in {' or '.join(str(d) for d in MODEL_DIRS)}")


@functools.cache
def load_spec(model: str):
    """The model file's ``spec``. Real-model files import their library only when the module is
    built, so reading the spec (for the inputs) stays cheap in every worker."""
    from aot.tracer import load_model_file

    return load_model_file(model_file(model))


def make_inputs(model: str, sizes: dict[str, int], device: str = "cuda") -> list:
    """The spec's inputs at ``sizes``, seeded by the sizes: token ids below the input's ``high``,
    float values (standard normal) at the model's dtype."""
    import torch

    from aot import Dim

    spec = load_spec(model)
    gen = torch.Generator().manual_seed(1234 + sum(sizes.values()))
    out = []
    for inp in spec.inputs:
        shape = [sizes[s.name] if isinstance(s, Dim) else s for s in inp.shape]
        dtype = getattr(torch, inp.dtype or spec.dtype)
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=gen).to(dtype)
        else:
            x = torch.randint(int(inp.low), int(inp.high), shape, generator=gen, dtype=dtype)
        out.append(x.to(device))
    return out


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters created on the meta device (their initialization costs nothing), buffers for
    real: non-persistent buffers (a rotary embedding's ``inv_freq``) are computed when the module
    is built and are in no weights file."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_module(model: str, weights: str, device: str = "cuda"):
    """The model file's module at its dtype on ``device`` with weights read from ``weights``:
    parameters built on the meta device (no init cost), materialized empty, tied parameters
    re-tied, then loaded; buffers the weights file lacks keep the values they were built with."""
    import torch
    from safetensors.torch import load_file

    spec = load_spec(model)
    with parameters_on_meta():
        module = spec.module()
    ties: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    module = module.to(getattr(torch, spec.dtype))
    buffers = {name: b.to(device) for name, b in module.named_buffers()}
    module = module.to_empty(device=device)
    for name, b in buffers.items():
        module.get_buffer(name).copy_(b)
    state = load_file(weights, device=device)
    expected = module.state_dict()
    for k, v in state.items():  # aotpack pads unaligned matmul weights with zero rows: drop them
        if k in expected and v.dim() == 2 and v.shape[0] > expected[k].shape[0]:
            state[k] = v[: expected[k].shape[0]]
    for names in ties.values():
        present = [n for n in names if n in state]
        for n in names:
            if n not in state and present:
                state[n] = state[present[0]]
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise RuntimeError(
            f"weights {weights} do not fit {model}: missing {missing[:3]} unexpected {unexpected[:3]}"
        )
    return module.eval()


def to_host(t):
    """``t`` on the CPU without device work: the memory its view spans copied as it lies (one
    plain copy), the view rebuilt on the host. (``.cpu()`` of a strided view, gpt's logits sliced
    out of their padded GEMM, first makes it contiguous with an ATen kernel on the device, which
    would charge the system with ATen's kernel images: 92 MiB on an H100.)"""
    import torch

    if t.is_contiguous() or t.numel() == 0 or t.device.type == "cpu":
        return t.cpu()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).cpu()
    return torch.as_strided(flat, t.shape, t.stride(), 0)


def first_tensor(out):
    """The first tensor of a model's output: a tensor, tuple, list, dict, ``ModelOutput`` (a dict
    of its non-None fields) or a bundle's ``Record``: a causal LM's logits."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if hasattr(out, "values") else out
    for v in values:
        if v is not None:
            found = first_tensor(v)
            if found is not None:
                return found
    return None


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_us(fn, calls: int, before=None) -> float:
    """The median of ``calls`` calls of ``fn`` (µs, the host's clock), ``before()`` untimed ahead
    of each (a synchronize: the GPU idle when the timed call starts)."""
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def chain_row(row: dict, run, repeats: int, diff=None, per_us=None) -> dict:
    """One row of a kernel-chain bench (``tma_gemv``, ``attention_chain``, ``megakernel_chain``):
    ``run`` once and synchronized, ``row["max_rel_diff"] = diff()`` where given (the output
    against the reference; ``diff`` may raise to fail the row), then µs per ``run`` replayed in a
    CUDA graph (``aot.verify.timing.graph_us``) and ``per_us(us)``'s fields beside. An exception
    (a form that does not compile or fit) goes into ``row["error"]`` instead, so the other forms
    still run. Prints the row as one JSON line and returns it."""
    import torch

    from aot.verify import timing

    try:
        run()
        torch.cuda.synchronize()
        if diff is not None:
            row["max_rel_diff"] = diff()
        us = timing.graph_us(run, torch.device("cuda"), 1, repeats)
        row["us"] = round(us, 2)
        if per_us is not None:
            row.update(per_us(us))
    except Exception as e:
        lines = str(e).strip().splitlines() or [""]
        tail = f" ... {lines[-1][:200]}" if len(lines) > 1 else ""  # a compile error's own line is its last
        row["error"] = f"{type(e).__name__}: {lines[0][:200]}{tail}"
    print(json.dumps(row), flush=True)
    return row


def timed_calls(fn, inputs, calls: int = CALLS, warmup: int = WARMUP, device: str = "cuda") -> list[float]:
    for _ in range(warmup):
        fn(*inputs)
    synchronize(device)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*inputs)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def paired_rounds(
    systems: dict, rounds: int, calls: int, warmup: int = 20
) -> tuple[dict[str, object], dict[str, list[float]], list[dict[str, float]]]:
    """Systems timed alternately in one process, so that each sees the same machine: ``warmup``
    calls each, then ``rounds`` rounds in which each makes ``calls`` calls, synchronized after
    every one. ``systems``: name -> (call, synchronize). Returns each system's last warm-up
    result, every call's seconds per system, and each round's median seconds per system."""
    last = {}
    for name, (call, sync) in systems.items():  # warm: graphs captured, arenas sized
        for _ in range(warmup):
            last[name] = call()
        sync()
    times: dict[str, list[float]] = {name: [] for name in systems}
    medians = []
    for _ in range(rounds):
        round_medians = {}
        for name, (call, sync) in systems.items():
            got = []
            for _ in range(calls):
                t0 = time.perf_counter()
                call()
                sync()
                got.append(time.perf_counter() - t0)
            times[name] += got
            round_medians[name] = statistics.median(got)
        medians.append(round_medians)
    return last, times, medians
