"""Two bundles of one model under the torch loader, in one process, paired: rounds alternate
between them (``--rounds`` of ``--calls`` calls each, synchronized after every call) so that both
see the same machine; per shape of ``bench/common.SHAPES``, each bundle's median over all its calls
and the median of the per-round ratios (B / A). For a build change that separate processes cannot
resolve (they differ by up to 9% from run to run): build A and B, then

    python bench/bundle_paired.py MODEL A.tpk B.tpk [--rounds 12] [--calls 100] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    from common import SHAPES, shape_label

    from aot.loader import load

    runners = {"a": load(args.a, device=args.device), "b": load(args.b, device=args.device)}

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    rows = []
    for sizes in SHAPES[args.model]:
        inputs = runners["a"].inputs_at(sizes, seed=0)
        outs = {}
        for key, runner in runners.items():  # warm: graphs captured, arenas sized
            for _ in range(20):
                out = runner(**inputs)
            sync()
            outs[key] = out[0] if isinstance(out, (tuple, list)) else out
        diff = (outs["a"].float() - outs["b"].float()).abs().max().item()
        times: dict[str, list[float]] = {k: [] for k in runners}
        ratios = []
        for _ in range(args.rounds):
            medians = {}
            for key, runner in runners.items():
                got = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    runner(**inputs)
                    sync()
                    got.append(time.perf_counter() - t0)
                times[key] += got
                medians[key] = statistics.median(got)
            ratios.append(medians["b"] / medians["a"])
        row = {
            "model": args.model,
            "shape": shape_label(sizes),
            "a": args.a,
            "b": args.b,
            "a_median_ms": statistics.median(times["a"]) * 1e3,
            "b_median_ms": statistics.median(times["b"]) * 1e3,
            "b_over_a_median_of_rounds": statistics.median(ratios),
            "b_over_a_rounds": [round(r, 4) for r in ratios],
            "max_abs_diff": diff,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
