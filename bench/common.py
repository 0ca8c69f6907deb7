"""Shared pieces of the benchmark: model construction from a weights file, inputs, shapes.

Every system loads the same fp16 weights from a safetensors file (not random init, which would
put seconds of initialization into every cold start but aotpack's).
"""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The shapes each model is timed at: symbol values.
SHAPES = {
    "mlp": [{"batch": 1}, {"batch": 8}],
    "gpt": [{"batch": 1, "seq": 128}, {"batch": 8, "seq": 128}, {"batch": 1, "seq": 1}],
    "cnn": [{"batch": 1}, {"batch": 8}],
}
WARMUP = 20
CALLS = 200


def shape_label(sizes: dict[str, int]) -> str:
    return " ".join(f"{k[0].upper()}={v}" for k, v in sizes.items())


def make_inputs(model: str, sizes: dict[str, int], device: str = "cuda") -> list:
    import torch

    gen = torch.Generator().manual_seed(1234 + sum(sizes.values()))
    if model == "mlp":
        x = torch.randn(sizes["batch"], 1024, generator=gen).half()
    elif model == "gpt":
        x = torch.randint(0, 50257, (sizes["batch"], sizes["seq"]), generator=gen)
    else:
        x = torch.randn(sizes["batch"], 3, 224, 224, generator=gen).half()
    return [x.to(device)]


def load_spec(model: str):
    from aot.tracer import load_model_file

    return load_model_file(ROOT / "models" / f"{model}.py")


def build_module(model: str, weights: str, device: str = "cuda"):
    """The model file's module in fp16 on ``device`` with weights read from ``weights``: built on
    the meta device (no init cost), materialized empty, tied parameters re-tied, then loaded."""
    import torch
    from safetensors.torch import load_file

    spec = load_spec(model)
    with torch.device("meta"):
        module = spec.module()
    ties: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    module = module.to(getattr(torch, spec.dtype)).to_empty(device=device)
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


def timed_calls(fn, inputs, calls: int = CALLS, warmup: int = WARMUP) -> list[float]:
    import torch

    for _ in range(warmup):
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*inputs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times
