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
bucket where some site has a candidate that matched, the whole program is timed (one call a
replay, buffers dropped as a call drops them) with the library steps, with the chosen candidates,
and with whole plans: every site on its fastest matching candidate (``fastest_plan``), win or lose
alone, and the same but only where that candidate is within ``NEAR_LOSS`` of the library alone.
On sm_90 the kernels launch early, each waiting inside for the one before (programmatic dependent
launch), which a kernel timed alone does not show and a library call between two kernels stops.
The faster whole plan replaces the choices when it is faster than they are by ``WHOLE_MIN_GAIN``; the
plan that is left stands only when the whole program is faster with it than with the library by
``WHOLE_MIN_GAIN`` (beyond the noise of two timings), else every site of the bucket goes back to
the library (``TuningCheck``, recorded beside the choices; ``whole_plan`` says which plan stood).

Last, the library-free plan (``library_free_plan``; ``--no-library-free`` skips it). The first
cuBLAS call in a process loads cuBLAS's kernels and allocates its workspace (96-98 MiB on an H100);
a model whose one library GEMM is a classifier's head pays that for a GEMM whose Triton form wins
alone but moves the whole program by less than ``WHOLE_MIN_GAIN``. So where every GEMM site
(``gemm_<n>``) of every program has, at every bucket its graphs serve, a candidate that matched the
library, and no other step calls cuBLAS (``aot.program.CUBLAS_OPS``), each bucket where a GEMM site kept the
library is timed again: the library steps, the choices as they stood, and every GEMM site on its
fastest matching candidate (attention sites as they were). If at every such bucket that plan is
at most ``FREE_MAX_LOSS`` slower than the library and than the choices as they stood, it is taken
at all of them (``TuningCheck.library_free``); else nothing changes: one bucket on the library
loads cuBLAS for the process. A call outside every bucket still runs the library steps.

The result is ``tuning.json`` (``aot.schema.TuningTable``): canonical JSON, sorted, times rounded to
``TIME_DECIMALS``, no timestamps, so the same measurements give the same bytes. It is added to the
bundle (written to ``-o`` or in place, atomically); every other member keeps its bytes. The
manifest lists the new member, so a signature no longer matches: the bundle must be signed again.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from aot import schema, serde
from aot.bundle import open_bundle
from aot.dtypes import tolerance
from aot.errors import EnvError
from aot.loader import load
from aot.loader.gpu import KernelCall
from aot.manifest_text import fixed_sizes
from aot.program import calls_cublas, step_reads, step_writes
from aot.schema import Member, Program, TuningCheck, TuningChoice, TuningTable
from aot.tuning import GEMM_SITE, LIBRARY, TUNING_FORMAT, parse_tuning, plan_steps
from aot.verify.interpret import looser_dtype

MIN_GAIN = 0.03  # a candidate must be at least this much faster than the library
WHOLE_MIN_GAIN = 0.01  # and the whole program with a bucket's choices, than with the library
# a whole plan may put a site on a candidate this much slower alone than the library: an H100
# ran 48 GEMMs at 128 rows 0.6 us each faster launched early (programmatic dependent launch, in one
# graph: bench/results/gemm-chain-m128-h100-2026-11-26.json), about a tenth of each
NEAR_LOSS = 0.10
FREE_MAX_LOSS = 0.02  # a library-free plan may be this much slower: the noise of whole-program timings
# (cnn on an H100: the same plan came out 1% ahead, then more than 1% behind, in two tunes)
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


def graph_us(run: Callable[[], None], device, copies: int, repeats: int) -> float:
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
    return L2Flush(buffer, graph_us(buffer.zero_, device, REPLAYS, repeats))


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

    us = graph_us(run, device, REPLAYS, repeats)
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

    return graph_us(run, device, 1, repeats)


CHECKS_SCHEMA = (1, 4)  # the schema that brought TuningTable.checks
LIBRARY_FREE_SCHEMA = (1, 6)  # the schema that brought TuningCheck.library_free
WHOLE_PLAN_SCHEMA = (1, 7)  # the schema that brought TuningCheck.whole_plan


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


def fastest_match(c: TuningChoice) -> str | None:
    """The fastest candidate of ``c`` that matched the library (ties: first in sort order), None
    where none did."""
    matched = sorted(k for k in c.times_us if k not in (LIBRARY, *c.rejected))
    return min(matched, key=lambda k: c.times_us[k]) if matched else None


def fastest_plan(bucket: Sequence[TuningChoice], near: float | None = None) -> dict[str, str]:
    """Every site of ``bucket`` on its fastest candidate that matched the library, whether or not
    it beat the library alone; sites with none keep the library. ``near``: only where that
    candidate is at most this fraction slower than the library alone."""
    plan = {}
    for c in bucket:
        best = fastest_match(c)
        if best is not None and (near is None or c.times_us[best] <= (1.0 + near) * c.times_us[LIBRARY]):
            plan[c.site] = best
    return plan


def check_bucket(
    index: int,
    gpu: Any,
    bucket: list[TuningChoice],
    given: dict[str, Any],
    sizes: dict[str, int],
    dev,
    repeats: int,
    say: Callable[[str], None] = lambda msg: None,
) -> tuple[list[TuningChoice], TuningCheck | None]:
    """Time the whole program at ``sizes`` with the library steps, with ``bucket``'s chosen
    candidates, and with the whole plans where they differ (kernels launched one after another
    gain together what each does not alone): every site on its fastest matching candidate within
    ``NEAR_LOSS`` of the library alone, and every site on its fastest (``fastest_plan``). The
    fastest whole plan replaces the choices when faster than they are by ``WHOLE_MIN_GAIN``; the
    plan left stands when it beats the library by ``WHOLE_MIN_GAIN``, else every site goes back
    to the library. No check (None) where no site has a candidate that matched."""
    chosen = {c.site: c.choice for c in bucket if c.choice != LIBRARY}
    wholes = []
    for plan in (fastest_plan(bucket, NEAR_LOSS), fastest_plan(bucket)):
        if plan and plan != chosen and plan not in wholes:
            wholes.append(plan)
    if not chosen and not wholes:
        return bucket, None

    def timed(plan: dict[str, str]) -> float:
        return time_program(*gpu.prepare(plan_steps(gpu.program, plan)), given, sizes, dev, repeats)

    library_us = time_program(gpu.calls, gpu.frees, given, sizes, dev, repeats)
    tuned_us = timed(chosen) if chosen else math.inf
    whole = None
    if wholes:
        times = [timed(plan) for plan in wholes]
        for plan, us in zip(wholes, times):
            say(f"whole plan, {len(plan)}/{len(bucket)} sites on candidates: {us:.2f}µs")
        best = min(range(len(wholes)), key=times.__getitem__)
        if times[best] <= (1.0 - WHOLE_MIN_GAIN) * tuned_us:  # (inf where nothing was chosen)
            whole, tuned_us = wholes[best], times[best]
            bucket = [replace(c, choice=whole.get(c.site, LIBRARY)) for c in bucket]
    kept = tuned_us <= (1.0 - WHOLE_MIN_GAIN) * library_us
    if not kept:
        bucket = [replace(c, choice=LIBRARY) for c in bucket]
    return bucket, TuningCheck(
        index, dict(sizes), library_us, tuned_us, kept, whole_plan=whole is not None and kept
    )


# (program index, bucket sizes, plans: site -> candidate, {} for the library steps) -> the whole
# program's microseconds with each plan, timed one after another
TimePlans = Callable[[int, dict[str, int], Sequence[dict[str, str]]], list[float]]


@dataclass(frozen=True)
class FreeBucket:
    """One bucket timed for the library-free plan: the whole program with the library steps, with
    the plan that stood before (None where every site ran the library) and with ``chosen``, where
    every GEMM site runs a candidate."""

    program: int
    sizes: dict[str, int]
    chosen: dict[str, str]
    library_us: float
    kept_us: float | None
    free_us: float

    @property
    def within(self) -> bool:
        """No slower than the library, nor than the plan that stood, by more than FREE_MAX_LOSS."""
        kept = self.kept_us if self.kept_us is not None else math.inf
        return self.free_us <= (1.0 + FREE_MAX_LOSS) * min(self.library_us, kept)


@dataclass(frozen=True)
class LibraryFree:
    """What the library-free rule made of a tuning: ``why_not``, why it does not apply ("" when it
    does); ``timed``, the buckets it timed (up to the first that lost); ``adopted``, whether their
    plans replaced the choices; ``choices`` and ``checks`` as they stand after it."""

    why_not: str
    timed: tuple[FreeBucket, ...]
    adopted: bool
    choices: tuple[TuningChoice, ...]
    checks: tuple[TuningCheck, ...]


def _bucket_key(program: int, sizes: dict[str, int]) -> tuple:
    return program, tuple(sorted(sizes.items()))


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "its one size"


def library_free_plan(
    programs: Sequence[Program],
    buckets: Sequence[Sequence[dict[str, int]]],
    choices: Sequence[TuningChoice],
    checks: Sequence[TuningCheck],
    time_plans: TimePlans,
) -> LibraryFree:
    """The library-free rule (module docstring) on a tuning's ``choices`` and ``checks``;
    ``buckets``: per program, the buckets its graphs serve. It applies where every GEMM site has,
    at every bucket, a candidate that matched the library, and no cuBLAS call lies outside a GEMM
    site. Each bucket where a GEMM site kept the library is timed with every such site on its
    fastest matching candidate (the other choices as they are); when each is within
    ``FREE_MAX_LOSS`` of the library and of the plan that stood, those plans replace the buckets'
    choices, all of them or none (cuBLAS is loaded per process)."""

    def unchanged(why_not: str, timed: tuple[FreeBucket, ...] = ()) -> LibraryFree:
        return LibraryFree(why_not, timed, False, tuple(choices), tuple(checks))

    for index, program in enumerate(programs):
        in_sites = {i for s in program.alternatives if s.id.startswith(GEMM_SITE) for i in s.library}
        for i, step in enumerate(program.steps):
            if calls_cublas(step) and i not in in_sites:
                return unchanged(
                    f"program {index} step {i} ({step.target}) calls cuBLAS outside any GEMM site"
                )
    by_bucket: dict[tuple, dict[str, TuningChoice]] = {}
    for c in choices:
        by_bucket.setdefault(_bucket_key(c.program, c.sizes), {})[c.site] = c
    todo: list[tuple[int, dict[str, int], dict[str, str], dict[str, str]]] = []  # plan, plan that stood
    for index, program in enumerate(programs):
        gemm_sites = [s.id for s in program.alternatives if s.id.startswith(GEMM_SITE)]
        for sizes in buckets[index] if gemm_sites else ():
            bucket = by_bucket.get(_bucket_key(index, sizes), {})
            stood = {site: c.choice for site, c in bucket.items() if c.choice != LIBRARY}
            chosen = dict(stood)
            for site in gemm_sites:
                c = bucket.get(site)
                if c is None:
                    return unchanged(
                        f"GEMM site {site} of program {index} was not timed at {_sizes_text(sizes)} (no "
                        "candidate compiled for that bucket, or the bucket or its entry point left out)"
                    )
                best = fastest_match(c)
                if best is None:
                    return unchanged(
                        f"GEMM site {site} of program {index} has no candidate that matched the library "
                        f"at {_sizes_text(sizes)}"
                    )
                if c.choice == LIBRARY:
                    chosen[site] = best
            if chosen != stood:
                todo.append((index, sizes, chosen, stood))
    timed: list[FreeBucket] = []
    for index, sizes, chosen, stood in todo:
        plans = [{}, chosen, stood] if stood else [{}, chosen]
        times = time_plans(index, sizes, plans)
        timed.append(FreeBucket(index, dict(sizes), chosen, times[0], times[2] if stood else None, times[1]))
        if not timed[-1].within:
            return unchanged("", tuple(timed))
    if not timed:
        return unchanged("")  # every GEMM site runs a candidate already
    free = {_bucket_key(b.program, b.sizes): b for b in timed}
    new_choices = []
    for c in choices:
        b = free.get(_bucket_key(c.program, c.sizes))
        new_choices.append(replace(c, choice=b.chosen.get(c.site, LIBRARY)) if b is not None else c)
    new_checks = [c for c in checks if _bucket_key(c.program, c.sizes) not in free]
    new_checks += [
        TuningCheck(b.program, dict(b.sizes), b.library_us, b.free_us, True, library_free=True) for b in timed
    ]
    return LibraryFree("", tuple(timed), True, tuple(new_choices), tuple(new_checks))


def _describe_free_bucket(entry: str, b: FreeBucket) -> str:
    stood = f", as chosen {b.kept_us:.2f}µs" if b.kept_us is not None else ""
    verdict = f"within {FREE_MAX_LOSS:.0%}" if b.within else f"more than {FREE_MAX_LOSS:.0%} slower"
    return (
        f"  [{entry}] library-free at {_sizes_text(b.sizes)}: library {b.library_us:.2f}µs{stood}, "
        f"every GEMM site on a candidate {b.free_us:.2f}µs -> {verdict}"
    )


def _describe_library_free(freed: LibraryFree) -> str:
    if freed.why_not:
        return f"library-free: does not apply: {freed.why_not}"
    if freed.adopted:
        return (
            "library-free: every GEMM site on a Triton candidate at every bucket, no cuBLAS call at a "
            f"bucket's sizes (~100 MiB less device memory on an H100); whole program within "
            f"{FREE_MAX_LOSS:.0%} of the library at the {len(freed.timed)} bucket(s) this changed"
        )
    if not freed.timed:
        return "library-free: every GEMM site already runs a Triton candidate at every bucket"
    lost = freed.timed[-1]
    return (
        f"library-free: not taken: the whole program at {_sizes_text(lost.sizes)} (program "
        f"{lost.program}) is slower by more than {FREE_MAX_LOSS:.0%} with every GEMM site on a "
        "candidate; the choices stay as checked"
    )


def _describe_check(entry: str, c: TuningCheck) -> str:
    verdict = "the choices stand" if c.kept else "every site back to the library"
    if c.whole_plan:
        verdict = "every site on its fastest candidate (the whole program is faster so)"
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


def program_buckets(manifest: Any, index: int) -> tuple[Any, ...]:
    return manifest.programs[index].buckets if manifest.programs else manifest.buckets


def call_env(runner: Any, index: int, sizes: dict[str, int]) -> dict[str, Any] | None:
    """What a call of program ``index`` at bucket ``sizes`` starts from: the weights, generated
    inputs and the state's views (a stateful bundle's KV cache, this runner's own); None where the
    program does not serve the bucket (another program does, or it is out of this one's contract)."""
    entry = runner._entries[index]
    try:
        inputs = runner.inputs_at({**pinned_sizes(runner.manifest, index), **sizes})
        entry.guards.check([inputs[n] for n in runner.input_names], runner.device)
    except Exception:
        return None
    env: dict[str, Any] = dict(entry.gpu.weights)
    env.update(inputs)
    env.update(runner.state.views(sizes))
    return env


def _out_of_memory(entry: str, sizes: dict[str, int], dev) -> EnvError:
    free, total = torch.cuda.mem_get_info(dev)
    return EnvError(
        f"the GPU ran out of memory tuning {entry} at {_sizes_text(sizes)} ({free / 2**30:.1f} of "
        f"{total / 2**30:.1f} GiB free now); free the GPU of other processes, or tune fewer "
        "buckets (--bucket batch=8)"
    )


def _time_plans(
    runner: Any, repeats: int, index: int, sizes: dict[str, int], plans: Sequence[dict[str, str]]
) -> list[float]:
    """``TimePlans`` on the GPU: program ``index``'s whole call at ``sizes`` with each plan, one
    after another, as ``check_bucket`` times it."""
    entry, dev = runner._entries[index], runner.device
    entry.gpu.context.bind()
    given = call_env(runner, index, sizes)
    assert given is not None, "only buckets tune timed before"
    try:
        with torch.no_grad():
            return [
                time_program(
                    *entry.gpu.prepare(plan_steps(entry.program, chosen)), given, sizes, dev, repeats
                )
                for chosen in plans
            ]
    except torch.OutOfMemoryError:
        raise _out_of_memory(entry.name, sizes, dev) from None
    finally:
        del given
        torch.cuda.empty_cache()


def tune(
    path: str | os.PathLike,
    output: str | os.PathLike | None = None,
    buckets: list[dict[str, int]] | None = None,
    repeats: int = DEFAULT_REPEATS,
    device: str = "cuda",
    say: Callable[[str], None] = lambda msg: None,
    entries: tuple[str, ...] = (),
    library_free: bool = True,
) -> TuneResult:
    """Measure and write (see the module docstring); ``buckets``: only these bucket sizes (a
    partial dict matches every bucket with those values); ``entries``: only these entry points'
    programs (a language model's ``decode``), every program when empty; ``library_free``: try the
    library-free plan after the checks (it applies only when every program and bucket was tuned)."""
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
    served: list[list[dict[str, int]]] = []  # per program, the buckets its graphs serve
    flush = l2_flush(dev, repeats)
    for index, entry in enumerate(runner._entries):
        program, gpu = entry.program, entry.gpu
        every = bucket_sizes(program, program_buckets(runner.manifest, index))
        if not program.alternatives or (entries and entry.entry not in entries):
            served.append(every)  # left out: it runs the library at each of them
            continue
        served.append([])
        gpu.context.bind()
        # The program runs step by step, dropping each buffer after its last use as a plain call
        # does; each site is timed when the run reaches it, while its inputs are live. (Keeping
        # every buffer of a large bucket, gpt at batch 32 x seq 1024, ran out of an 80 GB GPU.)
        calls, frees = gpu.prepare(program.steps, plan=True)
        for sizes in every:
            env = call_env(runner, index, sizes)
            if env is None:  # a bucket another program serves, or out of this one's contract
                continue
            served[index].append(sizes)
            if buckets and not any(all(sizes.get(k) == v for k, v in b.items()) for b in buckets):
                continue
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
                    where = f"  [{entry.name}] at {_sizes_text(sizes)}: "
                    bucket, check = check_bucket(
                        index,
                        gpu,
                        bucket,
                        given,
                        sizes,
                        dev,
                        repeats,
                        say=lambda msg, where=where: say(where + msg),
                    )
                    if check is not None:
                        checks.append(check)
                        say(_describe_check(entry.name, check))
                    choices.extend(bucket)
            except torch.OutOfMemoryError:
                raise _out_of_memory(entry.name, sizes, dev) from None
            del given
            torch.cuda.empty_cache()
    del flush
    if library_free and choices:
        programs = [e.program for e in runner._entries]
        time_plans = functools.partial(_time_plans, runner, repeats)
        freed = library_free_plan(programs, served, choices, checks, time_plans)
        for b in freed.timed:
            say(_describe_free_bucket(runner._entries[b.program].name, b))
        say(_describe_library_free(freed))
        choices, checks = list(freed.choices), list(freed.checks)
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
    # fields older loaders do not know: they refuse the bundle as too new rather than misread it
    if table.checks:
        new = replace(new, schema_version=max(tuple(new.schema_version), CHECKS_SCHEMA))
    if any(c.library_free for c in table.checks):
        new = replace(new, schema_version=max(tuple(new.schema_version), LIBRARY_FREE_SCHEMA))
    if any(c.whole_plan for c in table.checks):
        new = replace(new, schema_version=max(tuple(new.schema_version), WHOLE_PLAN_SCHEMA))
    write_archive(output, serde.canonical_json(new), members)
    return signed
