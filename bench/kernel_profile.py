"""Where the GPU time goes: top CUDA kernels of aotpack vs reduce-overhead at one shape, and
aotpack's calls through their CUDA graphs with each kernel charged with how far it moved the
chain's end (``decode.critical_path``: under dependent launch the kernels' spans overlap).

python bench/kernel_profile.py gpt 8 128 [ROWS]      (ROWS: kernels listed per system, default 12)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


CALLS = 10


def top(fn, x, label: str, n: int = 12, chain: bool = False) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn(x)
        torch.cuda.synchronize()
    print(f"== {label}")
    if not chain:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=70))
        return
    from decode import critical_path, kernel_spans

    table, _ = critical_path(kernel_spans(prof), CALLS, per="call")
    print("\n".join(table.splitlines()[: n + 1] + table.splitlines()[-2:]))


def main(model: str, batch: int, seq: int, rows: int = 12) -> None:
    import torch
    from common import build_module, make_inputs

    from aot.loader import load

    bundles = Path(".bundles")
    weights = next(iter(bundles.glob(f"{model}.weights.*.safetensors")), None)  # split weights, if built
    (x,) = make_inputs(model, {"batch": batch, "seq": seq})
    runner = load(bundles / f"{model}.tpk", device="cuda", capture="none")
    graphs = load(bundles / f"{model}.tpk", device="cuda")
    with torch.inference_mode():
        top(runner, x, "aotpack (kernels launched one by one)", rows)
        top(graphs, x, "aotpack in its CUDA graphs: µs each kernel moved the chain's end", rows, chain=True)
        if weights is None:
            print(f"(no {model}.weights.*.safetensors beside the bundle: reduce-overhead not profiled)")
            return
        module = build_module(model, str(weights))
        compiled = torch.compile(module, mode="reduce-overhead")
        top(compiled, x, "reduce-overhead", rows)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(int, sys.argv[4:5]))
