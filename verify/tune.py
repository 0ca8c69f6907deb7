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

This module walks the bundle's programs and buckets on the GPU; ``tune_rules`` decides on the
times alone (and holds the thresholds), ``timing`` measures, ``tuning_table`` writes the table.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aot.archs import arch_of
from aot.buckets import bucket_sizes, program_buckets
from aot.dtypes import tolerance
from aot.errors import EnvError
from aot.loader import load
from aot.loader.executor import ProgramExecutor
from aot.loader.tuning import LIBRARY, plan_steps
from aot.manifest_text import fixed_sizes
from aot.program import producer_of, step_reads, step_writes
from aot.schema import Program, TuningCheck, TuningChoice, TuningTable
from aot.verify.interpret import looser_dtype
from aot.verify.timing import DEFAULT_REPEATS, L2Flush, l2_flush, time_form, time_program
from aot.verify.tune_rules import (
    check_bucket,
    choose,
    describe_check,
    describe_choice,
    describe_free_bucket,
    describe_library_free,
    library_free_plan,
    sizes_text,
)
from aot.verify.tuning_table import TIME_DECIMALS, make_table, write_tuned


@dataclass(frozen=True)
class TuneResult:
    table: TuningTable
    output: Path
    signature_dropped: bool


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    tol = tolerance(dtype)
    if got.shape != want.shape:
        return False
    g, w = got.double(), want.double()
    return bool(((g - w).abs() <= tol.atol + tol.rtol * w.abs()).all().item())


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
    writer = producer_of(program.steps)
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
    executor: ProgramExecutor,
    env: dict[str, Any],
    sizes: dict[str, int],
    repeats: int,
    flush: L2Flush | None = None,
) -> TuningChoice | None:
    """Time the library form and each candidate of ``site`` at ``sizes`` on the live buffers of
    ``env`` (left as they were: every form writes into a copy); None when no candidate serves
    this bucket."""
    program, gpu = executor.program, executor.gpu
    forms = [c for c in site.candidates if sizes in c.buckets]
    if not forms:
        return None
    lib_calls, _ = gpu.prepare(tuple(program.steps[i] for i in site.library), plan=False)
    want = dict(env)
    executor.run(lib_calls, want, sizes)
    times = {LIBRARY: time_form(executor, lib_calls, env, sizes, repeats, flush)}
    rejected = []
    for cand in forms:
        cand_calls, _ = gpu.prepare(cand.steps, plan=False)
        got = dict(env)
        executor.run(cand_calls, got, sizes)
        a_dtype = gpu.kernels[cand.steps[0].target].params[0].dtype
        if not all(
            _close(got[o], want[o], looser_dtype(program.buffers[o].dtype, a_dtype)) for o in site.outputs
        ):
            rejected.append(cand.name)
            continue
        times[cand.name] = time_form(executor, cand_calls, env, sizes, repeats, flush)
    times = {k: round(float(t), TIME_DECIMALS) for k, t in times.items()}  # chosen on the times recorded
    return TuningChoice(index, site.id, sizes, choose(times), times, tuple(rejected))


def call_env(runner: Any, executor: ProgramExecutor, sizes: dict[str, int]) -> dict[str, Any] | None:
    """What a call of ``executor``'s program at bucket ``sizes`` starts from: the weights, generated
    inputs and the state's views (a stateful bundle's KV cache, this runner's own); None where the
    program does not serve the bucket (another program does, or it is out of this one's contract)."""
    try:
        inputs = runner.inputs_at({**pinned_sizes(runner.manifest, executor.index), **sizes})
    except Exception:
        return None
    if executor.admits(inputs) is None:
        return None
    return executor.environment(inputs, sizes)


def _out_of_memory(entry: str, sizes: dict[str, int], dev) -> EnvError:
    free, total = torch.cuda.mem_get_info(dev)
    return EnvError(
        f"the GPU ran out of memory tuning {entry} at {sizes_text(sizes)} ({free / 2**30:.1f} of "
        f"{total / 2**30:.1f} GiB free now); free the GPU of other processes, or tune fewer "
        "buckets (--bucket batch=8)"
    )


def _time_plan(
    executor: ProgramExecutor,
    given: dict[str, Any],
    sizes: dict[str, int],
    repeats: int,
    plan: dict[str, str],
) -> float:
    """Microseconds of one whole call of ``executor``'s program at ``sizes`` with ``plan`` (site ->
    candidate; ``{}``: the library steps, as the runner plans them)."""
    gpu = executor.gpu
    calls, frees = gpu.prepare(plan_steps(gpu.program, plan)) if plan else (gpu.calls, gpu.frees)
    return time_program(executor, calls, frees, given, sizes, repeats)


def _time_plans(
    runner: Any, repeats: int, index: int, sizes: dict[str, int], plans: Sequence[dict[str, str]]
) -> list[float]:
    """``TimePlans`` on the GPU: program ``index``'s whole call at ``sizes`` with each plan, one
    after another, as ``check_bucket`` times it."""
    executor = runner.executors[index]
    executor.gpu.context.bind()
    given = call_env(runner, executor, sizes)
    assert given is not None, "only buckets tune timed before"
    try:
        with torch.no_grad():
            return [
                time_program(
                    executor,
                    *executor.gpu.prepare(plan_steps(executor.program, chosen)),
                    given,
                    sizes,
                    repeats,
                )
                for chosen in plans
            ]
    except torch.OutOfMemoryError:
        raise _out_of_memory(executor.name, sizes, runner.device) from None
    finally:
        del given
        torch.cuda.empty_cache()


def _tune_bucket(
    executor: ProgramExecutor,
    calls: list[Any],
    frees: list[tuple[str, ...]],
    env: dict[str, Any],
    sizes: dict[str, int],
    repeats: int,
    flush: L2Flush,
    say: Callable[[str], None],
) -> tuple[list[TuningChoice], TuningCheck | None]:
    """One bucket of one program: each site timed as a run of the program on ``env`` reaches it,
    then the whole-program check (``check_bucket``). ``env`` is emptied on the way: the run's
    buffers go before the whole program is timed."""
    given = dict(env)  # what a call starts from, for the whole-program check
    bucket: list[TuningChoice] = []
    for site in walk_sites(
        executor.program, calls, frees, env, lambda call, env: executor.run((call,), env, sizes)
    ):
        choice = _tune_site(executor.index, site, executor, env, sizes, repeats, flush)
        if choice is not None:
            bucket.append(choice)
            say(describe_choice(executor.name, site, choice))
    env.clear()
    where = f"  [{executor.name}] at {sizes_text(sizes)}: "
    bucket, check = check_bucket(
        executor.index,
        bucket,
        sizes,
        functools.partial(_time_plan, executor, given, sizes, repeats),
        say=lambda msg: say(where + msg),
    )
    if check is not None:
        say(describe_check(executor.name, check))
    return bucket, check


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
    arch = arch_of(torch.cuda.get_device_capability(dev))
    choices: list[TuningChoice] = []
    checks: list[TuningCheck] = []
    served: list[list[dict[str, int]]] = []  # per program, the buckets its graphs serve
    flush = l2_flush(dev, repeats)
    for executor in runner.executors:
        index, program, gpu = executor.index, executor.program, executor.gpu
        every = bucket_sizes(program, program_buckets(runner.manifest, index))
        if not program.alternatives or (entries and executor.entry_point not in entries):
            served.append(every)  # left out: it runs the library at each of them
            continue
        served.append([])
        gpu.context.bind()
        # The program runs step by step, dropping each buffer after its last use as a plain call
        # does; each site is timed when the run reaches it, while its inputs are live. (Keeping
        # every buffer of a large bucket, gpt at batch 32 x seq 1024, ran out of an 80 GB GPU.)
        calls, frees = gpu.prepare(program.steps, plan=True)
        for sizes in every:
            env = call_env(runner, executor, sizes)
            if env is None:  # a bucket another program serves, or out of this one's contract
                continue
            served[index].append(sizes)
            if buckets and not any(all(sizes.get(k) == v for k, v in b.items()) for b in buckets):
                continue
            try:
                with torch.no_grad():
                    bucket, check = _tune_bucket(executor, calls, frees, env, sizes, repeats, flush, say)
            except torch.OutOfMemoryError:
                raise _out_of_memory(executor.name, sizes, dev) from None
            del env
            torch.cuda.empty_cache()
            if check is not None:
                checks.append(check)
            choices.extend(bucket)
    del flush
    if library_free and choices:
        programs = [e.program for e in runner.executors]
        time_plans = functools.partial(_time_plans, runner, repeats)
        freed = library_free_plan(programs, served, choices, checks, time_plans)
        for b in freed.timed:
            say(describe_free_bucket(runner.executors[b.program].name, b))
        say(describe_library_free(freed))
        choices, checks = list(freed.choices), list(freed.checks)
    table = make_table(arch, torch.cuda.get_device_name(dev), choices, checks=checks)
    runner.bundle.close()  # the bundle may be rewritten in place
    out = Path(output) if output is not None else Path(path)
    dropped = write_tuned(path, out, table)
    return TuneResult(table, out, dropped)
