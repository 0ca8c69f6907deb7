"""Greedy decoding's argmax over a wide vocabulary on the GPU: ``Tensor.argmax`` against the
two-stage reduction of ``aot.loader.generate.argmax`` at several chunk counts, each timed as 200
calls inside one CUDA graph (µs per call), on rows of bfloat16 logits.

    python3 bench/argmax_sweep.py --vocab 128256 32000 50257 --rows 1 8 --json out/argmax.json
"""

from __future__ import annotations

import argparse
import json

import torch

CALLS = 200


def two_stage(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    rows, vocab = logits.shape
    values, index = logits.view(rows, chunks, vocab // chunks).max(-1)
    best = values.argmax(-1, keepdim=True)
    return torch.add(index.gather(-1, best), best, alpha=vocab // chunks)[:, 0]


def graph_us(fn) -> float:
    fn()  # warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 32000, 50257])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--json")
    args = p.parse_args()
    rows_out = []
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device="cuda")
            want = logits.argmax(-1)
            row = {"vocab": vocab, "rows": rows, "argmax": graph_us(lambda x=logits: x.argmax(-1))}
            for chunks in (8, 16, 32, 64, 128, 256, 512, 1024):
                if vocab % chunks:
                    continue
                assert torch.equal(two_stage(logits, chunks), want)
                row[f"two_stage_{chunks}"] = graph_us(lambda c=chunks, x=logits: two_stage(x, c))
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
