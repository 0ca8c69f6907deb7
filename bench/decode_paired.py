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
result says whether A's and B's agree and at which step they first part; with ``--score`` as well,
each bundle's tokens are then scored by the model in float32 (eager, teacher-forced on that
bundle's own tokens): at every step, the float32 logit of float32's best token less that of the
token the bundle chose (0 where they agree). A change of a sum's order leaves both bundles as close
to float32 as each other; a change that loses precision shows as more steps off float32's choice
and larger gaps.

    python3 bench/decode_paired.py gpt2 A.tpk B.tpk --batch 1,8 --rounds 12 --json out/paired.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import LAYERS_ENV, dtype_name, make_model, prompts, workload  # noqa: E402


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


def float32_gaps(module, ids: list[list[int]], tokens: list[list[int]]) -> list[list[float]]:
    """Per row and step: float32's best logit less the logit of the token chosen (module docstring)."""
    import torch

    device = next(module.parameters()).device
    seq = torch.tensor([p + t[:-1] for p, t in zip(ids, tokens)], device=device)
    with torch.no_grad():
        logits = module(seq).logits[:, len(ids[0]) - 1 :].float()
    chosen = torch.tensor(tokens, device=device).unsqueeze(-1)
    return (logits.max(-1).values - logits.gather(-1, chosen).squeeze(-1)).tolist()


def score(module, ids: list[list[int]], want: dict[str, list[list[int]]]) -> dict:
    """Each bundle's steps off float32's choice, and the gaps' largest and mean."""
    out = {}
    for name, tokens in want.items():
        gaps = [g for row in float32_gaps(module, ids, tokens) for g in row]
        off = [g for g in gaps if g > 0]
        out[name] = {
            "steps": len(gaps),
            "steps_off_float32": len(off),
            "largest_gap": max(gaps),
            "mean_gap_off": statistics.mean(off) if off else 0.0,
        }
    return out


def paired(
    model: str,
    runners: dict,
    batch: int,
    rounds: int,
    tiny: bool,
    may_differ: bool = False,
    reference=None,
) -> dict:
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
    scored = score(reference, ids, want) if reference is not None and parted is not None else None
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
        "float32_score": scored,
        "per_round": times,
    }
    print(
        f"{model} batch {batch}: a {result['ms_per_token']['a']:.4f} ms, b "
        f"{result['ms_per_token']['b']:.4f} ms a token; b / a {result['b_over_a']:.3f}, "
        f"b faster in {result['b_faster_rounds']} of {rounds} rounds"
        + ("" if parted is None else f" (tokens part at step {parted})"),
        flush=True,
    )
    for name, sc in (scored or {}).items():
        print(
            f"  {name}: {sc['steps_off_float32']} of {sc['steps']} steps off float32's choice, gap largest "
            f"{sc['largest_gap']:.4f}, mean where off {sc['mean_gap_off']:.4f}",
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
    ap.add_argument(
        "--score",
        action="store_true",
        help="where tokens part, score each bundle's tokens by the model in float32 (module docstring)",
    )
    ap.add_argument("--layers", type=int, help="the bundles' decoder layers (decode.py --layers)")
    args = ap.parse_args()
    if args.layers:
        os.environ[LAYERS_ENV] = str(args.layers)

    import aot.loader

    runners = {n: aot.loader.load(p, device=args.device) for n, p in (("a", args.a), ("b", args.b))}
    reference = None
    if args.score:
        import torch

        # the bundles' weights (rounded to their dtype), computed in float32
        dtype = getattr(torch, dtype_name(args.model, args.device))
        reference = make_model(args.model, args.tiny, dtype, args.device).float()
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        results.append(
            {
                **paired(
                    args.model, runners, batch, args.rounds, args.tiny, args.tokens_may_differ, reference
                ),
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
