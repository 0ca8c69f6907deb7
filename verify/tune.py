"""``aotpack tune``: choose, on the target GPU, between each GEMM site's library steps and the
Triton candidates the build compiled for it (``aotpack build --gemm-candidates``).

For every program, bucket and site: the program runs at the bucket's sizes (generated inputs), step
by step, dropping buffers after their last use as a plain call does, so the largest bucket needs no
more memory than a call of it; once every buffer a site reads exists, each form (``"library"`` and every candidate compiled
for that bucket) runs on those buffers. A candidate whose results differ from the library's
(``|cand - lib| > atol + rtol·|lib|``, the dtype's tolerance: fp16 1e-2 + 1e-2·|lib|) is refused.
Each remaining form is captured ``REPLAYS`` times back to back in one CUDA graph, each copy after
a write of a buffer twice the GPU's L2 cache, and timed with CUDA events over ``repeats`` replays;
the median per run, less that of the L2 write alone (timed once), counts. (Without the flush a GEMM
timed alone reads its weights from L2 from the second copy on, which in a call, one GEMM after another
over different weights, it never does: on an H200 the mlp's tuned bundle came out slower than its
untuned one.) A candidate is chosen only when it beats the library by ``MIN_GAIN``. Then, per
bucket where some site chose a candidate, the whole program is timed (one call a replay, buffers
dropped as a call drops them) with the library steps and with the chosen candidates; the choices
stand only when the whole program is faster with them by ``WHOLE_MIN_GAIN`` (beyond the noise of
two timings), else every site of the bucket goes back to the library (``TuningCheck``, recorded
beside the choices).

The result is ``tuning.json`` (``aot.schema.TuningTable``): canonical JSON, sorted, times rounded to
``TIME_DECIMALS``, no timestamps, so the same measurements give the same bytes. It is added to the
bundle (written to ``-o`` or in place, atomically); every other member keeps its bytes. The
manifest lists the new member, so a signature no longer matches: the bundle must be signed again.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from aot import schema, serde
from aot.dtypes import tolerance
from aot.errors import EnvError
from aot.loader import load
from aot.loader.bundle import open_bundle
from aot.loader.gpu import KernelCall
from aot.loader.tuning import LIBRARY, TUNING_FORMAT, parse_tuning, plan_steps
from aot.manifest_text import fixed_sizes
from aot.program import step_reads, step_writes
from aot.schema import Member, Program, TuningCheck, TuningChoice, TuningTable
from aot.verify.interpret import looser_dtype

MIN_GAIN = 0.03  # a candidate must be at least this much faster than the library
WHOLE_MIN_GAIN = 0.01  # and the whole program with a bucket's choices, than with the library
DEFAULT_REPEATS = 50  # timed graph replays per form
REPLAYS = 10  # copies of the form captured back to back in one graph (launch cost amortized)
WARMUP = 3
TIME_DECIMALS = 2  # microseconds


@dataclass(frozen=True)
class TuneResult:
    table: TuningTable
    output: Path
    signature_dropped: bool


def bucket_sizes(program: Program, buckets) -> list[dict[str, int]]:
    import itertools

    by_symbol = {b.symbol: b.sizes for b in buckets}
    symbols = list(dict.fromkeys(s.symbol for s in program.symbols))
    if any(s not in by_symbol for s in symbols):
        return []
    return [dict(zip(symbols, c)) for c in itertools.product(*(by_symbol[s] for s in symbols))]


def _run(calls: list[Any], env: dict[str, Any], sizes: dict[str, int], device: torch.device) -> None:
    stream = torch.cuda.current_stream(device).cuda_stream
    for call in calls:
        if type(call) is KernelCall:
            call(env, sizes, stream)
        else:
            call(env, sizes)


def _run_one(call: Any, env: dict[str, Any], sizes: dict[str, int], device: torch.device) -> None:
    _run([call], env, sizes, device)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    tol = tolerance(dtype)
    if got.shape != want.shape:
        return False
    g, w = got.double(), want.double()
    return bool(((g - w).abs() <= tol.atol + tol.rtol * w.abs()).all().item())


def _graph_us(run: Callable[[], None], device, copies: int, repeats: int) -> float:
    """Median microseconds per copy of ``run``: warmed up on a side stream (library handles and
    workspaces exist before capture), captured ``copies`` times in one CUDA graph, replayed
    ``repeats`` times between CUDA events."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        for _ in range(copies):
            run()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / copies)
    del graph
    return statistics.median(times)


@dataclass(frozen=True)
class L2Flush:
    """A buffer twice the GPU's L2 cache (at least 64 MiB), whose write evicts what a form read,
    and the median microseconds of that write, timed once and taken off every form's time."""

    buffer: torch.Tensor
    us: float


def l2_flush(device, repeats: int) -> L2Flush:
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    buffer = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device=device)
    return L2Flush(buffer, _graph_us(buffer.zero_, device, REPLAYS, repeats))


def time_form(
    calls: list[Any],
    env: dict[str, Any],
    sizes: dict[str, int],
    device,
    repeats: int,
    flush: L2Flush | None = None,
) -> float:
    """Median microseconds of one run of ``calls``, replayed in a CUDA graph; with ``flush``, each
    run after a write of its buffer (L2 cold, as in a call), the write's own time taken off."""
    local = dict(env)

    def run() -> None:
        if flush is not None:
            flush.buffer.zero_()
        _run(calls, local, sizes, device)

    us = _graph_us(run, device, REPLAYS, repeats)
    return max(us - flush.us, 0.0) if flush is not None else us


def time_program(
    calls: list[Any],
    frees: list[tuple[str, ...]],
    env: dict[str, Any],
    sizes: dict[str, int],
    device,
    repeats: int,
) -> float:
    """Median microseconds of one whole call of a program's ``calls`` on ``env`` (weights, inputs,
    state), dropping each buffer after its last use (``frees``) as a call does."""

    def run() -> None:
        local = dict(env)
        for call, free in zip(calls, frees):
            _run_one(call, local, sizes, device)
            for name in free:
                local.pop(name, None)

    return _graph_us(run, device, 1, repeats)


CHECKS_SCHEMA = (1, 4)  # the schema that brought TuningTable.checks


def choose(times_us: dict[str, float], min_gain: float = MIN_GAIN) -> str:
    """The fastest candidate when it beats the library by ``min_gain``, else ``"library"``; ties
    go to the name first in sort order, so the choice depends on the times alone."""
    lib = times_us[LIBRARY]
    best = min(sorted(times_us), key=lambda k: times_us[k])
    return best if best != LIBRARY and times_us[best] <= (1.0 - min_gain) * lib else LIBRARY


def make_table(
    arch: str,
    device_name: str,
    choices: list[TuningChoice],
    min_gain: float = MIN_GAIN,
    checks: Sequence[TuningCheck] = (),
) -> TuningTable:
    """The table as tune writes it: choices sorted by program, site number and sizes, checks by
    program and sizes; times rounded."""

    def key(c: TuningChoice):
        return (c.program, int(c.site.split("_")[-1]), c.site, sorted(c.sizes.items()))

    def us(t: float) -> float:
        return round(float(t), TIME_DECIMALS)

    checked = [
        replace(c, sizes=dict(sorted(c.sizes.items())), library_us=us(c.library_us), tuned_us=us(c.tuned_us))
        for c in checks
    ]

    rounded = [
        replace(
            c,
            sizes=dict(sorted(c.sizes.items())),
            times_us={k: round(float(v), TIME_DECIMALS) for k, v in sorted(c.times_us.items())},
            rejected=tuple(sorted(c.rejected)),
        )
        for c in choices
    ]
    return TuningTable(
        format=TUNING_FORMAT,
        arch=arch,
        device=device_name[:200],
        min_gain=min_gain,
        choices=tuple(sorted(rounded, key=key)),
        checks=tuple(sorted(checked, key=lambda c: (c.program, sorted(c.sizes.items())))),
    )


def tuning_bytes(table: TuningTable) -> bytes:
    return serde.canonical_json(table)


def pinned_sizes(manifest: Any, index: int) -> dict[str, int]:
    """The sizes program ``index`` fixes that the bundle's contract leaves free (a decode entry
    point's programs have ``seq == 1`` where the contract has a symbol ``seq``)."""
    if not manifest.programs:
        return {}
    return dict(fixed_sizes(manifest.programs[index].guards, manifest.guards))


def site_inputs(program: Program, site: Any) -> set[str]:
    """The buffers a site's library steps read that the site does not write itself."""
    steps = [program.steps[i] for i in site.library]
    return {r for st in steps for r in step_reads(st)} - {w for st in steps for w in step_writes(st)}


def walk_sites(
    program: Program,
    calls: list[Any],
    frees: list[tuple[str, ...]],
    env: dict[str, Any],
    run: Callable[[Any, dict[str, Any]], None],
) -> Iterator[Any]:
    """Run the program's ``calls`` on ``env`` step by step, dropping each buffer after its last use
    (``frees``) as a plain call does, and yield each GEMM site once every buffer it reads exists
    in ``env`` (the caller times it then): before the first step by which all its inputs have been
    written. A buffer whose last use comes before a pending site is held for it."""
    reads = {site.id: site_inputs(program, site) for site in program.alternatives}
    writer = {w: i for i, st in enumerate(program.steps) for w in step_writes(st)}
    points: dict[int, list[Any]] = {}  # step index -> the sites timed just before it
    for site in program.alternatives:
        ready = 1 + max((writer[r] for r in reads[site.id] if r in writer), default=-1)
        points.setdefault(ready, []).append(site)
    wanted = Counter(name for names in reads.values() for name in names)  # reads of untimed sites
    held: set[str] = set()
    for index, (call, free) in enumerate(zip(calls, frees)):
        for site in points.get(index, ()):
            yield site
            for name in reads[site.id]:
                wanted[name] -= 1
                if name in held and not wanted[name]:
                    held.discard(name)
                    env.pop(name, None)
        run(call, env)
        for name in free:
            if wanted[name]:
                held.add(name)
            else:
                env.pop(name, None)


def _tune_site(
    index: int,
    site: Any,
    gpu: Any,
    env: dict[str, Any],
    sizes: dict[str, int],
    dev,
    repeats: int,
    flush: L2Flush | None = None,
) -> TuningChoice | None:
    """Time the library form and each candidate of ``site`` at ``sizes`` on the live buffers of
    ``env`` (left as they were: every form writes into a copy); None when no candidate serves
    this bucket."""
    program = gpu.program
    forms = [c for c in site.candidates if sizes in c.buckets]
    if not forms:
        return None
    lib_calls, _ = gpu.prepare(tuple(program.steps[i] for i in site.library), plan=False)
    want = dict(env)
    _run(lib_calls, want, sizes, dev)
    times = {LIBRARY: time_form(lib_calls, env, sizes, dev, repeats, flush)}
    rejected = []
    for cand in forms:
        cand_calls, _ = gpu.prepare(cand.steps, plan=False)
        got = dict(env)
        _run(cand_calls, got, sizes, dev)
        a_dtype = gpu.kernels[cand.steps[0].target].params[0].dtype
        if not all(
            _close(got[o], want[o], looser_dtype(program.buffers[o].dtype, a_dtype)) for o in site.outputs
        ):
            rejected.append(cand.name)
            continue
        times[cand.name] = time_form(cand_calls, env, sizes, dev, repeats, flush)
    times = {k: round(float(t), TIME_DECIMALS) for k, t in times.items()}  # chosen on the times recorded
    return TuningChoice(index, site.id, sizes, choose(times), times, tuple(rejected))


def check_bucket(
    index: int,
    gpu: Any,
    bucket: list[TuningChoice],
    given: dict[str, Any],
    sizes: dict[str, int],
    dev,
    repeats: int,
) -> tuple[list[TuningChoice], TuningCheck | None]:
    """Time the whole program at ``sizes`` with the library steps and with ``bucket``'s chosen
    candidates; the choices as they stand when the tuned program is faster by ``WHOLE_MIN_GAIN``,
    else set back to the library. No check (None) where every site kept the library."""
    chosen = {c.site: c.choice for c in bucket if c.choice != LIBRARY}
    if not chosen:
        return bucket, None
    library_us = time_program(gpu.calls, gpu.frees, given, sizes, dev, repeats)
    calls, frees = gpu.prepare(plan_steps(gpu.program, chosen))
    tuned_us = time_program(calls, frees, given, sizes, dev, repeats)
    kept = tuned_us <= (1.0 - WHOLE_MIN_GAIN) * library_us
    if not kept:
        bucket = [replace(c, choice=LIBRARY) for c in bucket]
    return bucket, TuningCheck(index, dict(sizes), library_us, tuned_us, kept)


def _describe_check(entry: str, c: TuningCheck) -> str:
    verdict = "the choices stand" if c.kept else "every site back to the library"
    return (
        f"  [{entry}] whole program at {', '.join(f'{k}={v}' for k, v in c.sizes.items())}: "
        f"library {c.library_us:.2f}µs, tuned {c.tuned_us:.2f}µs -> {verdict}"
    )


def _describe(entry: str, site: Any, c: TuningChoice) -> str:
    return (
        f"  [{entry}] {site.id} M={site.m} N={site.n} K={site.k} at "
        f"{', '.join(f'{k}={v}' for k, v in c.sizes.items())}: "
        + "  ".join(f"{k} {v:.2f}µs" for k, v in sorted(c.times_us.items(), key=lambda kv: kv[1]))
        + (f"  rejected {', '.join(c.rejected)}" if c.rejected else "")
        + f" -> {c.choice}"
    )


def tune(
    path: str | os.PathLike,
    output: str | os.PathLike | None = None,
    buckets: list[dict[str, int]] | None = None,
    repeats: int = DEFAULT_REPEATS,
    device: str = "cuda",
    say: Callable[[str], None] = lambda msg: None,
    entries: tuple[str, ...] = (),
) -> TuneResult:
    """Measure and write (see the module docstring); ``buckets``: only these bucket sizes (a
    partial dict matches every bucket with those values); ``entries``: only these entry points'
    programs (a language model's ``decode``), every program when empty."""
    if not torch.cuda.is_available():
        raise EnvError("aotpack tune needs a CUDA GPU; torch sees none")
    if repeats < 1:
        raise EnvError(f"--repeats must be at least 1, got {repeats}")
    runner = load(path, device=device, capture="none")
    unknown = [e for e in entries if e not in runner.entry_points]
    if unknown:
        raise EnvError(
            f"--entry {unknown[0]!r}: the bundle's entry points are {list(runner.entry_points) or '(none)'}"
        )
    dev = runner.device
    major, minor = torch.cuda.get_device_capability(dev)
    arch = f"sm_{major}{minor}"
    choices: list[TuningChoice] = []
    checks: list[TuningCheck] = []
    flush = l2_flush(dev, repeats)
    for index, entry in enumerate(runner._entries):
        program, gpu = entry.program, entry.gpu
        if not program.alternatives or (entries and entry.entry not in entries):
            continue
        gpu.context.bind()
        program_buckets = (
            runner.manifest.programs[index].buckets if runner.manifest.programs else runner.manifest.buckets
        )
        pinned = pinned_sizes(runner.manifest, index)
        # The program runs step by step, dropping each buffer after its last use as a plain call
        # does; each site is timed when the run reaches it, while its inputs are live. (Keeping
        # every buffer of a large bucket, gpt at batch 32 x seq 1024, ran out of an 80 GB GPU.)
        calls, frees = gpu.prepare(program.steps, plan=True)
        for sizes in bucket_sizes(program, program_buckets):
            if buckets and not any(all(sizes.get(k) == v for k, v in b.items()) for b in buckets):
                continue
            try:
                inputs = runner.inputs_at({**pinned, **sizes})
                entry.guards.check([inputs[n] for n in runner.input_names], dev)
            except Exception:  # a bucket another program serves, or out of this one's contract
                continue
            env: dict[str, Any] = dict(gpu.weights)
            env.update(inputs)
            env.update(runner.state.views(sizes))  # a stateful bundle's KV cache (this runner's own)
            given = dict(env)  # what a call starts from, for the whole-program check
            run = functools.partial(_run_one, sizes=sizes, device=dev)
            try:
                with torch.no_grad():
                    bucket: list[TuningChoice] = []
                    for site in walk_sites(program, calls, frees, env, run):
                        choice = _tune_site(index, site, gpu, env, sizes, dev, repeats, flush)
                        if choice is not None:
                            bucket.append(choice)
                            say(_describe(entry.name, site, choice))
                    del env
                    bucket, check = check_bucket(index, gpu, bucket, given, sizes, dev, repeats)
                    if check is not None:
                        checks.append(check)
                        say(_describe_check(entry.name, check))
                    choices.extend(bucket)
            except torch.OutOfMemoryError:
                free, total = torch.cuda.mem_get_info(dev)
                raise EnvError(
                    f"the GPU ran out of memory tuning {entry.name} at "
                    f"{', '.join(f'{k}={v}' for k, v in sizes.items())} ({free / 2**30:.1f} of "
                    f"{total / 2**30:.1f} GiB free now); free the GPU of other processes, or tune fewer "
                    "buckets (--bucket batch=8)"
                ) from None
            del given
            torch.cuda.empty_cache()
    table = make_table(arch, torch.cuda.get_device_name(dev), choices, checks=checks)
    runner.bundle.close()  # the bundle may be rewritten in place
    out = Path(output) if output is not None else Path(path)
    dropped = write_tuned(path, out, table)
    return TuneResult(table, out, dropped)


def write_tuned(path: str | os.PathLike, output: str | os.PathLike, table: TuningTable) -> bool:
    """Write the bundle at ``path`` with ``table`` as its tuning member to ``output`` (atomically;
    ``output`` may be ``path``). Returns whether a signature was dropped (it no longer matched)."""
    from aot.packager import write_archive

    path, output = Path(path), Path(output)
    data = tuning_bytes(table)
    bundle = open_bundle(path)
    try:
        manifest = bundle.manifest
        programs = [bundle.program()]
        programs += list(programs[0].variants)
        buckets = [e.buckets for e in manifest.programs] if manifest.programs else [manifest.buckets]
        parse_tuning(data, programs, buckets, path)  # what tune writes, the loader accepts
        if manifest.external_weights and output.resolve().parent != path.resolve().parent:
            raise EnvError(
                f"{path} keeps its weights in {manifest.external_weights} beside it; write the tuned bundle "
                f"to the same folder"
            )
        members = {
            name: bundle.read(name)
            for name in manifest.members
            if name != schema.TUNING_PATH and not (name == schema.WEIGHTS_PATH and manifest.external_weights)
        }
        signed = bundle.signature() is not None
    finally:
        bundle.close()
    import hashlib

    members[schema.TUNING_PATH] = data
    listed = dict(manifest.members)
    listed[schema.TUNING_PATH] = Member(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    new = replace(manifest, members=dict(sorted(listed.items())))
    if table.checks:  # a field older loaders do not know: they refuse the bundle as too new
        new = replace(new, schema_version=max(tuple(manifest.schema_version), CHECKS_SCHEMA))
    write_archive(output, serde.canonical_json(new), members)
    return signed
