"""Two decode bundles of one model timed in one process, round by round (an A/B of a build change).

``bench/decode.py`` times each system in a process of its own, and two runs of one bundle there
differ by 2-4% (GPT-2 at batch 1, H200): more than a change of a launch or two moves a step. Here
both bundles are loaded once, and every round generates with each (the order alternating), the
decode step's time taken as ``decode.py`` takes it (the first token's arrival to the last's, over
the steps between, the blocks of steps per launch as the default). Reported per bundle: the median
ms a token over the rounds, and B / A per round (its median, and in how many rounds B was faster),
per batch size (a JSON list); the tokens of every round must equal the first round's of A, or the run fails.
With ``--tokens-may-differ`` (a change of a sum's order: random weights' logits lie close, so greedy
tokens part after a few steps) each bundle's rounds must equal its own first round's, and the
result says whether A's and B's agree and at which step they first part.

    python3 bench/decode_paired.py gpt2 A.tpk B.tpk --batch 1,8 --rounds 12 --json out/paired.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import prompts, workload  # noqa: E402


def step_ms(runner, ids: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """ms a decode step of one generation, and its tokens (as ``decode.worker`` measures)."""
    stamps: list[float] = []
    tokens = runner.generate(ids, new_tokens, on_token=lambda step, toks: stamps.append(time.perf_counter()))
    return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1), tokens


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first step at which any row's tokens of ``a`` and ``b`` part (None: they agree)."""
    steps = [i for x, y in zip(a, b) for i, (s, t) in enumerate(zip(x, y)) if s != t]
    steps += [min(len(x), len(y)) for x, y in zip(a, b) if len(x) != len(y)]
    return min(steps) if steps else None


def paired(model: str, runners: dict, batch: int, rounds: int, tiny: bool, may_differ: bool = False) -> dict:
    """One batch size's rounds (module docstring)."""
    prompt, new_tokens = workload(model, tiny)
    vocab = runners["a"].reference_outputs()[0].shape[-1]
    ids = prompts(batch, prompt, vocab).tolist()
    want: dict[str, list[list[int]]] = {}
    for name, runner in runners.items():  # warm-up: captures the graphs
        _, want[name] = step_ms(runner, ids, new_tokens)
    parted = first_difference(want["a"], want["b"])
    if parted is not None and not may_differ:
        raise SystemExit(f"batch {batch}: bundle b's tokens differ from bundle a's (from step {parted})")
    times: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            ms, tokens = step_ms(runners[name], ids, new_tokens)
            if tokens != want[name]:
                raise SystemExit(
                    f"batch {batch}, round {r}: bundle {name}'s tokens differ from its first round's"
                )
            times[name].append(ms)
    ratios = [b / a for a, b in zip(times["a"], times["b"])]
    result = {
        "model": model,
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "ms_per_token": {n: statistics.median(t) for n, t in times.items()},
        "b_over_a": statistics.median(ratios),
        "b_faster_rounds": sum(x < 1 for x in ratios),
        "tokens_equal": parted is None,
        "tokens_part_at_step": parted,
        "per_round": times,
    }
    print(
        f"{model} batch {batch}: a {result['ms_per_token']['a']:.4f} ms, b "
        f"{result['ms_per_token']['b']:.4f} ms a token; b / a {result['b_over_a']:.3f}, "
        f"b faster in {result['b_faster_rounds']} of {rounds} rounds"
        + ("" if parted is None else f" (tokens part at step {parted})"),
        flush=True,
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the decode bench's model name (its prompt and new tokens)")
    ap.add_argument("a", type=Path, help="bundle A (the baseline)")
    ap.add_argument("b", type=Path, help="bundle B (the change)")
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated [default: 1]")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself")
    ap.add_argument(
        "--tiny", action="store_true", help="the tiny model's workload (bundles built with --tiny)"
    )
    ap.add_argument(
        "--tokens-may-differ",
        action="store_true",
        help="time bundles whose greedy tokens part (each must still repeat its own)",
    )
    args = ap.parse_args()

    import aot.loader

    runners = {n: aot.loader.load(p, device=args.device) for n, p in (("a", args.a), ("b", args.b))}
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        results.append(
            {
                **paired(args.model, runners, batch, args.rounds, args.tiny, args.tokens_may_differ),
                "a": str(args.a),
                "b": str(args.b),
            }
        )
        if args.json:  # after every batch: a run cut off keeps what was measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
