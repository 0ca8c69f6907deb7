"""A/B of a tuned bundle's plans on one GPU, in one process, as a caller sees them: the table as
tune wrote it (a bucket's whole plan where its check took one), every site on its own choice (no
whole-program checks), and the untuned bundle; the median wall time of a synchronized call at one
shape, two rounds interleaved. Tune ranks whole plans by a CUDA graph of the whole program; this
times the calls themselves (graph replay, output tail, copies).

    python3 bench/ab_plans.py .bundles/gpt-tuned.tpk .bundles/gpt-gemm.tpk batch=1 seq=128
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def variants(tuned: Path, out: Path) -> dict[str, Path]:
    from dataclasses import replace

    from aot.loader import open_bundle
    from aot.tuning import read_tuning
    from aot.verify.tune import choose, make_table, write_tuned

    b = open_bundle(tuned)
    try:
        program = b.program()
        m = b.manifest
        programs = [program, *program.variants]
        buckets = [e.buckets for e in m.programs] if m.programs else [m.buckets]
        table = read_tuning(b, programs, buckets)
    finally:
        b.close()
    paths = {"as tuned": tuned}
    choices = [replace(c, choice=choose(c.times_us, table.min_gain)) for c in table.choices]
    path = out / "site-by-site.tpk"
    write_tuned(tuned, path, make_table(table.arch, table.device, choices, table.min_gain))
    paths["site by site"] = path
    return paths


def median_ms(path: Path, sizes: dict[str, int], calls: int = 300) -> float:
    import torch

    from aot.loader import load

    runner = load(path, device="cuda")
    inputs = runner.inputs_at(sizes, seed=0)
    for _ in range(30):
        runner(**inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        runner(**inputs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def main() -> None:
    tuned, plain = Path(sys.argv[1]), Path(sys.argv[2])
    sizes = {k: int(v) for k, v in (a.split("=") for a in sys.argv[3:])}
    paths = variants(tuned, tuned.parent)
    paths["untuned"] = plain
    for _ in range(2):  # two rounds, interleaved
        for name, path in paths.items():
            print(f"{name:28} {median_ms(path, sizes):.4f} ms", flush=True)


if __name__ == "__main__":
    main()
