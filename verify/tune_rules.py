"""The rules ``aotpack tune`` chooses by (see ``aot.verify.tune``), on measured times alone: a
site's form, a bucket's whole-program check, the library-free plan, and the lines that say what
each decided. Nothing here touches a GPU: the timings come in as numbers or as callables."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aot.loader.tuning import GEMM_SITE, LIBRARY
from aot.program import calls_cublas
from aot.schema import Program, TuningCheck, TuningChoice

MIN_GAIN = 0.03  # a candidate must be at least this much faster than the library
WHOLE_MIN_GAIN = 0.01  # and the whole program with a bucket's choices, than with the library
# a whole plan may put a site on a candidate this much slower alone than the library: an H100
# ran 48 GEMMs at 128 rows 0.6 us each faster launched early (programmatic dependent launch, in one
# graph: bench/results/gemm-chain-m128-h100-2026-11-26.json), about a tenth of each
NEAR_LOSS = 0.10
FREE_MAX_LOSS = 0.02  # a library-free plan may be this much slower: the noise of whole-program timings
# (cnn on an H100: the same plan came out 1% ahead, then more than 1% behind, in two tunes)


def choose(times_us: dict[str, float], min_gain: float = MIN_GAIN) -> str:
    """The fastest candidate when it beats the library by ``min_gain``, else ``"library"``; ties
    go to the name first in sort order, so the choice depends on the times alone."""
    lib = times_us[LIBRARY]
    best = min(sorted(times_us), key=lambda k: times_us[k])
    return best if best != LIBRARY and times_us[best] <= (1.0 - min_gain) * lib else LIBRARY


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
    bucket: list[TuningChoice],
    sizes: dict[str, int],
    time_plan: Callable[[dict[str, str]], float],
    say: Callable[[str], None] = lambda msg: None,
) -> tuple[list[TuningChoice], TuningCheck | None]:
    """Time the whole program at ``sizes`` (``time_plan(plan)``: its microseconds with ``plan``,
    site -> candidate, ``{}`` for the library steps) with the library steps, with ``bucket``'s
    chosen candidates, and with the whole plans where they differ (kernels launched one after
    another gain together what each does not alone): every site on its fastest matching candidate
    within ``NEAR_LOSS`` of the library alone, and every site on its fastest (``fastest_plan``).
    The fastest whole plan replaces the choices when faster than they are by ``WHOLE_MIN_GAIN``;
    the plan left stands when it beats the library by ``WHOLE_MIN_GAIN``, else every site goes back
    to the library. No check (None) where no site has a candidate that matched."""
    chosen = {c.site: c.choice for c in bucket if c.choice != LIBRARY}
    wholes = []
    for plan in (fastest_plan(bucket, NEAR_LOSS), fastest_plan(bucket)):
        if plan and plan != chosen and plan not in wholes:
            wholes.append(plan)
    if not chosen and not wholes:
        return bucket, None

    library_us = time_plan({})
    tuned_us = time_plan(chosen) if chosen else math.inf
    whole = None
    if wholes:
        times = [time_plan(plan) for plan in wholes]
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


def sizes_text(sizes: dict[str, int]) -> str:
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
                        f"GEMM site {site} of program {index} was not timed at {sizes_text(sizes)} (no "
                        "candidate compiled for that bucket, or the bucket or its entry point left out)"
                    )
                best = fastest_match(c)
                if best is None:
                    return unchanged(
                        f"GEMM site {site} of program {index} has no candidate that matched the library "
                        f"at {sizes_text(sizes)}"
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


def describe_free_bucket(entry: str, b: FreeBucket) -> str:
    stood = f", as chosen {b.kept_us:.2f}µs" if b.kept_us is not None else ""
    verdict = f"within {FREE_MAX_LOSS:.0%}" if b.within else f"more than {FREE_MAX_LOSS:.0%} slower"
    return (
        f"  [{entry}] library-free at {sizes_text(b.sizes)}: library {b.library_us:.2f}µs{stood}, "
        f"every GEMM site on a candidate {b.free_us:.2f}µs -> {verdict}"
    )


def describe_library_free(freed: LibraryFree) -> str:
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
        f"library-free: not taken: the whole program at {sizes_text(lost.sizes)} (program "
        f"{lost.program}) is slower by more than {FREE_MAX_LOSS:.0%} with every GEMM site on a "
        "candidate; the choices stay as checked"
    )


def describe_check(entry: str, c: TuningCheck) -> str:
    verdict = "the choices stand" if c.kept else "every site back to the library"
    if c.whole_plan:
        verdict = "every site on its fastest candidate (the whole program is faster so)"
    return (
        f"  [{entry}] whole program at {', '.join(f'{k}={v}' for k, v in c.sizes.items())}: "
        f"library {c.library_us:.2f}µs, tuned {c.tuned_us:.2f}µs -> {verdict}"
    )


def describe_choice(entry: str, site: Any, c: TuningChoice) -> str:
    return (
        f"  [{entry}] {site.id} M={site.m} N={site.n} K={site.k} at "
        f"{', '.join(f'{k}={v}' for k, v in c.sizes.items())}: "
        + "  ".join(f"{k} {v:.2f}µs" for k, v in sorted(c.times_us.items(), key=lambda kv: kv[1]))
        + (f"  rejected {', '.join(c.rejected)}" if c.rejected else "")
        + f" -> {c.choice}"
    )
