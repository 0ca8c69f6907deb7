"""The verbs that run a bundle: ``load``, ``generate``, and on a GPU ``tune`` and ``verify``."""

from __future__ import annotations

import json
import sys
import time

import click

from aot.cli.options import parse_bytes, parse_sizes, trust_option
from aot.cli.progress import PROGRESS
from aot.cli.reports import checks_note
from aot.errors import EnvError, printable

_info = PROGRESS.say  # progress: dropped under --quiet
_result = PROGRESS.result  # results and warnings: always shown


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "--inputs",
    "inputs_file",
    type=click.Path(dir_okay=False),
    help="safetensors file with one tensor per input name [default: the bundle's example inputs]",
)
@click.option(
    "--sizes", help="run at these sizes with generated inputs, e.g. batch=3,seq=77 (others: the example's)"
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, or auto")
@click.option(
    "--iters",
    "--runs",
    "iters",
    default=20,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="timed calls",
)
@click.option(
    "--warmup",
    default=3,
    show_default=True,
    type=click.IntRange(0, 1_000_000),
    help="untimed calls first (CUDA-graph capture happens in the first)",
)
@click.option(
    "--atol",
    type=float,
    help="max abs error allowed vs the reference [default: the dtype's tolerance "
    "× the reference's scale]; a FAIL exits 2",
)
@click.option(
    "--json", "as_json", is_flag=True, help="print one JSON object (sizes, latency_ms, max_abs_err, ...)"
)
@click.option(
    "--save-outputs", type=click.Path(dir_okay=False), help="write the outputs to this safetensors file"
)
@click.option("--no-graphs", is_flag=True, help="launch step by step instead of replaying CUDA graphs")
@click.option(
    "--max-memory",
    callback=lambda ctx, param, value: None if value is None else parse_bytes(value),
    help="refuse the bundle if one call may need more activation memory than this, e.g. 2GiB, 512MB",
)
@click.option(
    "--max-flops",
    type=click.FloatRange(min=1, max=2.0**63, min_open=False),
    help="refuse a call that would compute more operations than this (counted from each step's "
    "operand shapes before it runs), e.g. 1e12",
)
@click.option(
    "--capture",
    type=click.Choice(["lazy", "all"]),
    default="lazy",
    show_default=True,
    help="capture each bucket's CUDA graph on its first call, or all at load (largest first)",
)
@trust_option
def load(
    bundle: str,
    inputs_file: str | None,
    sizes: str | None,
    device: str,
    iters: int,
    warmup: int,
    atol: float | None,
    as_json: bool,
    save_outputs: str | None,
    no_graphs: bool,
    max_memory: int | None,
    max_flops: float | None,
    capture: str,
) -> None:
    """Load BUNDLE, run it, time it, and check it against a reference: the eager outputs recorded
    at build time (example inputs) or, on a GPU, the same bundle on the CPU. Exit 2 on FAIL."""

    from aot.cli import bench
    from aot.loader import load as load_bundle

    if inputs_file and sizes:
        raise click.UsageError("--inputs and --sizes both choose the inputs; give one")
    device = _device(device)
    start = time.perf_counter()
    runner = load_bundle(
        bundle,
        device=device,
        capture="none" if no_graphs else capture,
        max_memory=max_memory,
        max_flops=None if max_flops is None else int(max_flops),
    )
    _info(f"loaded {bundle} on {device} in {time.perf_counter() - start:.2f}s")
    reference, reference_name = None, None
    if inputs_file:
        from safetensors.torch import load_file

        try:
            inputs = load_file(inputs_file, device=str(runner.device))
        except Exception as e:
            raise click.ClickException(_inputs_problem(inputs_file, e)) from None
    elif sizes:
        inputs = runner.inputs_at(parse_sizes(sizes))
    else:
        inputs, reference, reference_name = (
            runner.example_inputs(),
            runner.reference_outputs(),
            "build reference",
        )
    if reference is None and runner.device.type == "cuda":
        from aot.pytree import leaves

        on_cpu = load_bundle(bundle, device="cpu")
        reference = leaves(on_cpu(**{k: v.cpu() for k, v in inputs.items()}))
        reference_name = "cpu program"
    report = bench.run(runner, bundle, inputs, reference, reference_name, iters, warmup, atol)
    if save_outputs:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in report.tensors.items()}, save_outputs)
        _info(f"wrote {save_outputs}")
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        for line in report.lines():
            click.echo(printable(line))  # output names come from the bundle
    if report.passed is False:
        sys.exit(2)


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), help="write the tuned bundle here [default: in place]"
)
@click.option(
    "--bucket",
    "bucket_texts",
    multiple=True,
    help="tune only buckets with these sizes, e.g. batch=1 or batch=8,seq=128 (repeatable) [default: all]",
)
@click.option(
    "--entry",
    "entries",
    multiple=True,
    help="tune only this entry point's programs, e.g. decode (repeatable) [default: all]",
)
@click.option("--repeats", default=50, show_default=True, type=int, help="timed CUDA-graph replays per form")
@click.option("--device", default="cuda", show_default=True, help="the GPU to tune on")
@click.option(
    "--no-library-free",
    is_flag=True,
    help="keep the checked choices: do not move every GEMM site onto a candidate where that leaves "
    "no cuBLAS call at the buckets for at most 2% of the whole program",
)
@trust_option
def tune(
    bundle: str,
    output: str | None,
    bucket_texts: tuple[str, ...],
    entries: tuple[str, ...],
    repeats: int,
    device: str,
    no_library_free: bool,
) -> None:
    """On the target GPU: time each GEMM site's library call against the Triton candidates the
    build compiled (--gemm-candidates), per bucket, and record the winners in BUNDLE (tuning.json).
    Where every GEMM site can run a candidate at every bucket for at most 2% of the whole program,
    they all do, and no call at a bucket loads cuBLAS (--no-library-free: the checked choices)."""
    import torch

    from aot.errors import EnvError

    if not torch.cuda.is_available():
        raise EnvError("aotpack tune needs a CUDA GPU; torch sees none")
    from aot.verify.tune import tune as run_tune

    buckets = [parse_sizes(t) for t in bucket_texts]
    result = run_tune(
        bundle,
        output,
        buckets or None,
        repeats,
        device,
        say=_info,
        entries=entries,
        library_free=not no_library_free,
    )
    chosen = sum(c.choice != "library" for c in result.table.choices)
    set_back = sum(not c.kept for c in result.table.checks)
    library_free = sum(c.library_free for c in result.table.checks)
    whole = sum(c.whole_plan for c in result.table.checks)
    _result(
        f"wrote {result.output}: {chosen}/{len(result.table.choices)} site-buckets use a Triton candidate "
        f"on {result.table.device} ({result.table.arch})" + checks_note(set_back, library_free, whole)
    )
    if result.signature_dropped:
        _result(
            f"the bundle was signed; its signature no longer matches: re-sign it with `aotpack sign {result.output} --key KEY`"
        )


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--device", default="cuda", show_default=True, help="the GPU to verify on")
@trust_option
def verify(bundle: str, device: str) -> None:
    """On a GPU: every kernel against its reference decomposition and the whole program against
    the CPU reference path, at the bundle's buckets; prints max errors, exits 2 on a mismatch."""
    import torch

    from aot.errors import EnvError
    from aot.verify.device import passed, program_tolerance, reference_noise
    from aot.verify.device import verify as run_verify

    if not torch.cuda.is_available():
        raise EnvError("aotpack verify needs a CUDA GPU; torch sees none")
    reports = run_verify(bundle, device)
    from aot.bundle import open_bundle

    opened = open_bundle(bundle)
    dtype = opened.manifest.dtype
    noise = reference_noise(opened.manifest)
    opened.close()
    failed = 0
    for r in reports:
        ok = passed(r, dtype, noise)
        failed += not ok
        worst = max(r.kernel_errs.items(), key=lambda kv: kv[1], default=("-", 0.0))
        graph = "-" if r.graph_err is None else f"{r.graph_err:.3g}"
        where = f"[{r.program}] " if len({x.program for x in reports}) > 1 else ""
        click.echo(
            printable(
                f"{'ok  ' if ok else 'FAIL'} {where}{', '.join(f'{k}={v}' for k, v in r.sizes.items()):24} "
                f"program vs CPU {r.program_err:.3g} (scale {r.program_scale:.3g})  graph vs launches {graph}  "
                f"{len(r.kernel_errs)} kernels, worst {worst[0]} {worst[1]:.3g}"
            )
        )
    why = f", {dtype} eager differs from float32 by {noise:.2g} of its scale" if noise else ""
    click.echo(
        f"{len(reports) - failed}/{len(reports)} sizes passed (program tolerance "
        f"{program_tolerance(dtype, noise):.2g} of the output scale{why})"
    )
    if failed:
        sys.exit(2)


# Option ranges of ``generate``: token ids are int64 tensor values; a temperature below 1e-3
# overflows float32 logits (±1e2 / 1e-45 is inf), and sampling that cold is greedy decoding anyway.
TOKEN_ID_MAX = 2**63 - 1
TEMPERATURES = (1e-3, 1e3)


def _device(device: str) -> str:
    """``--device``: "auto" picks the GPU when torch sees one; a GPU asked for that torch does not
    see is refused here, in the terms of the option."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        return device  # the loader says what a device is
    if kind == "cuda" and not torch.cuda.is_available():
        raise EnvError(f"--device {device}: torch sees no CUDA GPU; run with --device cpu (or --device auto)")
    return device


def _inputs_problem(path: str, e: Exception) -> str:
    """Why ``--inputs`` could not be read; a torch.save file (zip or pickle) is told what to write."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        return f"--inputs {path}: cannot be read ({err.strerror})"
    if head == b"PK\x03\x04" or head[:1] == b"\x80":
        return (
            f"--inputs {path} looks like a torch.save file; it expects safetensors: write one with "
            f"safetensors.torch.save_file({{'x': tensor, ...}}, '{path}.safetensors')"
        )
    return f"--inputs {path}: not a safetensors file ({printable(str(e))[:200]})"


MAX_STEPS_PER_LAUNCH = 256  # decode steps in one block: one CUDA graph of that many steps


def _parse_prompts(text: str) -> list[list[int]]:
    """``"1,2,3;4,5"`` → ``[[1, 2, 3], [4, 5]]``."""
    prompts = []
    for part in text.split(";"):
        ids = [t.strip() for t in part.split(",") if t.strip()]
        if not ids or not all(t.isascii() and t.isdigit() and len(t) <= 18 for t in ids):
            raise click.UsageError(
                f"--prompt-ids expects token ids like 1,2,3 (prompts separated by ;), got {part!r}"
            )
        prompts.append([int(t) for t in ids])
    return prompts


@click.command("generate")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "--prompt-ids", required=True, help="token ids, comma-separated; several prompts separated by ;"
)
@click.option(
    "--max-new-tokens", required=True, type=click.IntRange(1, 1 << 20), help="tokens to generate per prompt"
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, or auto")
@click.option(
    "--eos-token-id",
    type=click.IntRange(0, TOKEN_ID_MAX),
    help="a prompt stops after this token (kept in its output)",
)
@click.option(
    "--pad-token-id",
    type=click.IntRange(0, TOKEN_ID_MAX),
    help="fed to prompts that stopped [default: eos, else 0]",
)
@click.option("--sample", is_flag=True, help="sample instead of greedy decoding")
@click.option(
    "--temperature",
    default=1.0,
    show_default=True,
    type=click.FloatRange(*TEMPERATURES),
    help="with --sample: logits are divided by it (below 0.001 sampling is greedy decoding: leave out --sample)",
)
@click.option("--top-k", type=click.IntRange(1), help="with --sample: only the k most likely tokens")
@click.option(
    "--seed", type=click.IntRange(0, 2**64 - 1), help="with --sample: seed of the sampling generator"
)
@click.option("--no-graphs", is_flag=True, help="launch step by step instead of replaying CUDA graphs")
@click.option(
    "--steps-per-launch",
    type=click.IntRange(1, MAX_STEPS_PER_LAUNCH),
    help="greedy decode steps per CUDA graph launch, a causal LM's tokens read back once per block "
    "[default: 8 on a GPU, 1 on a CPU]; 1: every step on its own",
)
@trust_option
def generate_tokens(
    bundle: str,
    prompt_ids: str,
    max_new_tokens: int,
    device: str,
    eos_token_id: int | None,
    pad_token_id: int | None,
    sample: bool,
    temperature: float,
    top_k: int | None,
    seed: int | None,
    no_graphs: bool,
    steps_per_launch: int | None,
) -> None:
    """Generate tokens with a causal-LM BUNDLE (aot.hf.causal_lm: prefill and decode over a KV
    cache) or an encoder-decoder one (aot.hf.seq2seq: the prompts feed the encoder): prints each
    prompt's new token ids, space-separated, one line per prompt (the last line for one prompt;
    never the decoder start token); tokens/s on stderr."""

    from aot.loader import load as load_bundle

    prompts = _parse_prompts(prompt_ids)
    device = _device(device)
    start = time.perf_counter()
    runner = load_bundle(bundle, device=device, capture="none" if no_graphs else "lazy")
    _info(f"loaded {bundle} on {device} in {time.perf_counter() - start:.2f}s")
    stamps: list[float] = []

    def on_token(step: int, tokens: list[int]) -> None:
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    out = runner.generate(
        prompts,
        max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        do_sample=sample,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        on_token=on_token,
        steps_per_launch=steps_per_launch,
    )
    total = time.perf_counter() - start
    for tokens in out:
        click.echo(" ".join(map(str, tokens)))
    new = sum(len(t) for t in out)
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    steps = f", decode {(len(stamps) - 1) * len(prompts) / decode:.1f} tokens/s" if decode > 0 else ""
    _result(
        f"{new} new tokens for {len(prompts)} prompt(s) in {total:.3f}s: {new / total:.1f} tokens/s "
        f"(prefill {(stamps[0] - start) * 1e3:.1f} ms{steps})",
    )
