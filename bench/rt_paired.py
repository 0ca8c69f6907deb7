"""The runtime without torch and the torch loader on one library-free bundle, in one process,
paired: rounds alternate between the two (``--rounds`` of ``--calls`` calls each, synchronized
after every call) so that both see the same machine; per shape, each system's median over all its
calls and the median of the per-round ratios (runtime / torch loader). The runtime's inputs are
its own device arrays (``runner.array``), the torch loader's CUDA tensors: as each is fed in
``bench/run.py``'s workers.

    python bench/rt_paired.py MODEL BUNDLE-lf.tpk [--rounds 12] [--calls 100] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    from common import SHAPES, make_inputs, paired_rounds, shape_label

    import aot.runtime
    from aot.loader import load

    rt = aot.runtime.load(args.bundle)
    ref = load(args.bundle, device="cuda")
    rows = []
    for sizes in SHAPES[args.model]:
        tensors = make_inputs(args.model, sizes, "cuda")
        arrays = [rt.array(t.cpu().numpy()) for t in tensors]
        named = dict(zip([n for n, *_ in rt.checked.entries[0].guards.inputs], tensors))
        systems = {
            "aotpack-rt": (lambda arrays=arrays: rt.run(arrays), rt.gpu.synchronize),
            "aotpack-lf": (lambda named=named: ref(**named), torch.cuda.synchronize),
        }
        _, times, rounds = paired_rounds(systems, args.rounds, args.calls)
        ratios = [m["aotpack-rt"] / m["aotpack-lf"] for m in rounds]
        row = {
            "model": args.model,
            "shape": shape_label(sizes),
            **{f"{k}_median_ms": statistics.median(v) * 1e3 for k, v in times.items()},
            "rt_over_lf_median_of_rounds": statistics.median(ratios),
            "rt_over_lf_rounds": [round(r, 4) for r in ratios],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
