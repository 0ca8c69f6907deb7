"""Two bundles of one model under the torch loader, in one process, paired: rounds alternate
between them (``--rounds`` of ``--calls`` calls each, synchronized after every call) so that both
see the same machine; per shape of ``bench/common.SHAPES``, each bundle's median over all its calls
and the median of the per-round ratios (B / A). For a build change that separate processes cannot
resolve (they differ by up to 9% from run to run): build A and B, then

    python bench/bundle_paired.py MODEL A.tpk B.tpk [--rounds 12] [--calls 100] [--json OUT]
                                  [--sizes batch=1,seq=32 --sizes batch=32 ...]

``--sizes`` (repeatable) times those shapes instead of the bench's.
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
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", action="append", help="a shape, e.g. batch=1,seq=32 (repeatable)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from common import SHAPES, first_tensor, paired_rounds, shape_label, synchronize

    from aot.loader import load

    runners = {"a": load(args.a, device=args.device), "b": load(args.b, device=args.device)}

    from aot.cli.options import parse_sizes

    rows = []
    for sizes in [parse_sizes(t) for t in args.sizes] if args.sizes else SHAPES[args.model]:
        inputs = runners["a"].inputs_at(sizes, seed=0)
        systems = {
            key: (lambda r=r, x=inputs: r(**x), lambda: synchronize(args.device))
            for key, r in runners.items()
        }
        last, times, rounds = paired_rounds(systems, args.rounds, args.calls)
        outs = {key: first_tensor(out) for key, out in last.items()}
        diff = (outs["a"].float() - outs["b"].float()).abs().max().item()
        ratios = [m["b"] / m["a"] for m in rounds]
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
