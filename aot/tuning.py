"""GEMM alternatives and the tuning table: checked on every device, applied on a GPU of its arch.

A program built with ``--gemm-candidates`` lists, per GEMM site, the indices of its library steps
and the Triton candidates that may replace them (``Program.alternatives``). ``aotpack tune`` writes
``tuning.json`` (``TuningTable``): per site and bucket, the form that won on the GPU it ran on.

``check_alternatives`` refuses alternatives that could not have come from a build (unknown kernels,
overlapping or out-of-range sites, a candidate that reads what is not yet written or writes what
another step owns); ``read_tuning`` refuses a table naming an unknown program, site, candidate or
bucket, holding hostile values, or keeping a bucket's plan for being library-free
(``TuningCheck.library_free``) where a GEMM site runs the library. Both run wherever the bundle is
loaded, the CPU included.
``tuned_plans`` turns a table into the steps each bucket's CUDA graph launches, only on a GPU of
the table's arch; without a table (or elsewhere) every call runs the program's own steps, exactly
as an untuned bundle does. ``plan_steps`` is the one place a choice becomes steps.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from aot import schema
from aot.buckets import is_bucket
from aot.errors import BundleError
from aot.program import frees_after, given_names, readers_of, step_reads, step_writes
from aot.schema import Bucket, GemmSite, Program, Step, StepKind, TuningTable
from aot.serde import from_json

TUNING_FORMAT = "aotpack-tuning"
LIBRARY = "library"  # the choice that keeps a site's library steps
GEMM_SITE = "gemm_"  # a GEMM site's id begins so
ATTENTION_SITE = "attn_"  # an attention site's
MAX_SITES = 4096
MAX_CANDIDATES = 32  # per site (a candidates build offers about 17 at a one-row norm-prologue site)
MAX_CANDIDATE_STEPS = 6  # two joined sites in K slices (4), the attention a q/k/v site takes in (5)
MAX_TUNING_BYTES = 8 << 20
MAX_TIME_US = 1e9  # a measurement beyond this is no measurement
_ID = re.compile(
    rf"^({GEMM_SITE}|{ATTENTION_SITE})[0-9]{{1,6}}$"
)  # a GEMM site, or an attention site (aot.codegen.flash)
_NAME = re.compile(r"^[a-z0-9_]{1,64}$")
_ARCH = re.compile(r"^sm_[0-9]{2,3}a?$")


def plan_steps(program: Program, chosen: Mapping[str, str]) -> tuple[Step, ...]:
    """``program.steps`` with each chosen site's library steps replaced by the steps of its
    candidate (site id → candidate name; ``"library"`` or an absent site keeps the library
    steps), placed where the site's last library step was."""
    return spliced(program, chosen)[0]


def spliced(
    program: Program, chosen: Mapping[str, str]
) -> tuple[tuple[Step, ...], dict[str, tuple[int, ...]]]:
    """``plan_steps``, and where each chosen site's candidate steps landed (site id → their
    indices in the new steps, ascending)."""
    if not chosen:
        return program.steps, {}
    sites = {s.id: s for s in program.alternatives}
    replace_at: dict[int, tuple[str, tuple[Step, ...]]] = {}
    dropped: set[int] = set()
    for site_id, name in chosen.items():
        if name == LIBRARY:
            continue
        site = sites.get(site_id)
        if site is None:
            raise BundleError(f"tuning names GEMM site {site_id[:40]!r}, which the program does not have")
        cand = next((c for c in site.candidates if c.name == name), None)
        if cand is None:
            raise BundleError(
                f"tuning names candidate {name[:40]!r} of {site_id}, which the program does not have"
            )
        dropped.update(site.library)
        replace_at[site.library[-1]] = (site_id, cand.steps)
    out: list[Step] = []
    spans: dict[str, tuple[int, ...]] = {}
    for i, step in enumerate(program.steps):
        if i in replace_at:
            site_id, steps = replace_at[i]
            spans[site_id] = tuple(range(len(out), len(out) + len(steps)))
            out.extend(steps)
        elif i not in dropped:
            out.append(step)
    return tuple(out), spans


def bucket_key(program: Program, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The key of a call at ``sizes`` among ``tuned_plans``' (sizes in ``program.symbols`` order)."""
    return tuple(sizes[s.symbol] for s in program.symbols)


def check_alternatives(program: Program, path: Path | str) -> None:
    """Refuse ``program.alternatives`` that a build could not have written (module docstring)."""
    alts = program.alternatives
    if not alts:
        return
    if len(alts) > MAX_SITES:
        raise BundleError(
            f"{path}: {len(alts)} GEMM sites (limit {MAX_SITES}); not a bundle this aotpack wrote"
        )
    kernels = {k.id for k in program.kernels}
    n_steps = len(program.steps)
    given = given_names(program)
    written_at: dict[str, int] = {}  # buffer -> the first step that writes it
    for i, s in enumerate(program.steps):
        for o in step_writes(s):
            written_at.setdefault(o, i)
    readers = readers_of(program.steps)
    all_read = set(readers) | set(program.outputs)
    taken: set[int] = set()
    ids: set[str] = set()
    for site in alts:
        where = f"{path}: GEMM site {site.id[:40]!r}"
        if not _ID.match(site.id) or site.id in ids:
            raise BundleError(f"{where}: ids are gemm_<n> or attn_<n>, and unique")
        ids.add(site.id)
        lib = list(site.library)
        if not lib or lib != sorted(set(lib)) or lib[0] < 0 or lib[-1] >= n_steps or taken & set(lib):
            raise BundleError(
                f"{where}: its library steps {lib[:8]} must be ascending indices of the program's "
                f"{n_steps} steps, shared with no other site"
            )
        taken.update(lib)
        lib_writes = {o for i in lib for o in step_writes(program.steps[i])}
        # a candidate stands in the last library step's place and writes what the site hands on: an
        # output an earlier library step wrote (a LayerNorm prologue's sum) is read by no step the
        # site keeps before that place
        if not site.outputs or not set(site.outputs) <= lib_writes:
            raise BundleError(
                f"{where}: its outputs {list(site.outputs)[:4]} are not written by its library steps"
            )
        lib_set = set(lib)
        for o in site.outputs:
            early = sorted(r for r in readers.get(o, ()) if written_at[o] < r < lib[-1] and r not in lib_set)
            if early:
                raise BundleError(
                    f"{where}: its output {o[:40]!r} is read by step {early[0]} before the site's last step"
                )
        internal = lib_writes - set(site.outputs)
        leaked = sorted(b for b in internal if set(readers.get(b, ())) - lib_set or b in program.outputs)
        if leaked:
            raise BundleError(
                f"{where}: {leaked[0][:40]!r} is read outside the site but not among its outputs"
            )
        if not 1 <= len(site.candidates) <= MAX_CANDIDATES:
            raise BundleError(f"{where}: 1 to {MAX_CANDIDATES} candidates, has {len(site.candidates)}")
        names: set[str] = set()
        for cand in site.candidates:
            what = f"{where} candidate {cand.name[:40]!r}"
            if not _NAME.match(cand.name) or cand.name == LIBRARY or cand.name in names:
                raise BundleError(f"{what}: names are [a-z0-9_], unique, not {LIBRARY!r}")
            names.add(cand.name)
            if not 1 <= len(cand.steps) <= MAX_CANDIDATE_STEPS:
                raise BundleError(f"{what}: 1 to {MAX_CANDIDATE_STEPS} steps, has {len(cand.steps)}")
            for step in cand.steps:
                if step.kind != StepKind.KERNEL or step.target not in kernels:
                    raise BundleError(f"{what}: its steps must launch kernels of the program")
            writes = [o for s in cand.steps for o in step_writes(s)]
            # besides the site's outputs, buffers of its own: new ones, or what its library steps
            # alone write and read (two joined sites' middle product, ``aot.codegen.gemm_pairs``)
            scratch = set(writes) - set(site.outputs) - internal
            if not set(site.outputs) <= set(writes) or len(writes) != len(set(writes)):
                raise BundleError(f"{what}: must write each of the site's outputs once")
            clash = sorted(
                (scratch & (set(written_at) | all_read | set(given))) | (set(writes) - set(program.buffers))
            )
            if clash:
                raise BundleError(
                    f"{what}: writes {clash[0][:40]!r}, a buffer it does not own or that has no spec"
                )
            for sizes in cand.buckets:
                if not all(type(v) is int and v >= 0 for v in sizes.values()):
                    raise BundleError(f"{what}: bucket sizes must be integers")
            # in place of the site's last library step, everything it reads is written before it
            # (by an earlier step the site keeps, or by the candidate's own earlier steps)
            available = set(given)
            for step in cand.steps:
                for r in step_reads(step):
                    i = written_at.get(r)
                    if r not in available and (i is None or i >= lib[-1] or i in lib_set):
                        raise BundleError(
                            f"{what}: the program with it in place is wrong: it reads {r[:40]!r} before it is written"
                        )
                available.update(step_writes(step))


def read_tuning(
    bundle, programs: Sequence[Program], buckets: Sequence[tuple[Bucket, ...]]
) -> TuningTable | None:
    """The bundle's tuning table, checked against its programs and their buckets; None when the
    bundle has none."""
    if schema.TUNING_PATH not in bundle.manifest.members:
        return None
    data = bundle.read(schema.TUNING_PATH)  # sha256 checked
    return parse_tuning(data, programs, buckets, bundle.path)


def parse_tuning(
    data: bytes,
    programs: Sequence[Program],
    buckets: Sequence[tuple[Bucket, ...]],
    path: Path | str = "tuning",
) -> TuningTable:
    where = f"{path}: {schema.TUNING_PATH}"
    if len(data) > MAX_TUNING_BYTES:
        raise BundleError(f"{where} is {len(data)} bytes (limit {MAX_TUNING_BYTES})")
    try:
        tree = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BundleError(f"{where} is not JSON: {str(e)[:120]}") from None
    table = from_json(TuningTable, tree, "tuning")
    if table.format != TUNING_FORMAT:
        raise BundleError(f"{where}: format {table.format[:40]!r}, expected {TUNING_FORMAT!r}")
    if not _ARCH.match(table.arch):
        raise BundleError(f"{where}: arch {table.arch[:40]!r} is not like sm_90")
    if len(table.device) > 200 or not math.isfinite(table.min_gain) or not 0 <= table.min_gain < 1:
        raise BundleError(f"{where}: device name over 200 characters or min_gain outside [0, 1)")
    seen: set[tuple] = set()
    for c in table.choices:
        what = f"{where}: choice for program {c.program} site {c.site[:40]!r} at {dict(list(c.sizes.items())[:4])}"
        if not 0 <= c.program < len(programs):
            raise BundleError(f"{what}: the bundle has {len(programs)} programs")
        program = programs[c.program]
        site = next((s for s in program.alternatives if s.id == c.site), None)
        if site is None:
            raise BundleError(f"{what}: the program has no such GEMM site")
        names = {cand.name: cand for cand in site.candidates}
        if c.choice != LIBRARY and c.choice not in names:
            raise BundleError(f"{what}: unknown candidate {c.choice[:40]!r}")
        _check_bucket(c.sizes, program, buckets[c.program], what)
        if c.choice != LIBRARY and c.sizes not in names[c.choice].buckets:
            raise BundleError(f"{what}: candidate {c.choice!r} was not compiled for this bucket")
        for form, us in c.times_us.items():
            if form != LIBRARY and form not in names:
                raise BundleError(f"{what}: times an unknown form {form[:40]!r}")
            _check_time(us, what)
        if any(r not in names for r in c.rejected) or c.choice in c.rejected:
            raise BundleError(f"{what}: rejected candidates must be the site's, and not the choice")
        key = (c.program, c.site, tuple(sorted(c.sizes.items())))
        if key in seen:
            raise BundleError(f"{what}: listed twice")
        seen.add(key)
    # bucket (program, sizes) -> the sites that run a candidate there, and which
    plans: dict[tuple, dict[str, str]] = {}
    for c in table.choices:
        if c.choice != LIBRARY:
            plans.setdefault((c.program, tuple(sorted(c.sizes.items()))), {})[c.site] = c.choice
    gemm_sites = [[s.id for s in p.alternatives if s.id.startswith(GEMM_SITE)] for p in programs]
    checked_at: set[tuple] = set()
    for check in table.checks:
        what = f"{where}: whole-program check of program {check.program} at {dict(list(check.sizes.items())[:4])}"
        if not 0 <= check.program < len(programs):
            raise BundleError(f"{what}: the bundle has {len(programs)} programs")
        _check_bucket(check.sizes, programs[check.program], buckets[check.program], what)
        for us in (check.library_us, check.tuned_us):
            _check_time(us, what)
        key = (check.program, tuple(sorted(check.sizes.items())))
        if key in checked_at:
            raise BundleError(f"{what}: listed twice")
        checked_at.add(key)
        if not check.kept and key in plans:
            raise BundleError(f"{what}: the choices were set back to the library, yet a candidate is chosen")
        if check.whole_plan and not check.kept:
            raise BundleError(f"{what}: whole_plan says a plan stood, yet kept is false")
        if check.library_free:
            if not check.kept:
                raise BundleError(f"{what}: library_free says the choices stand, yet kept is false")
            on_library = [s for s in gemm_sites[check.program] if s not in plans.get(key, {})]
            if on_library:
                raise BundleError(
                    f"{what}: library_free, yet GEMM site {on_library[0]!r} runs the library there"
                )
    # every bucket's combination of choices makes a program whose reads follow their writes
    checked: set[tuple] = set()
    for (index, _), chosen in plans.items():
        ident = (index, tuple(sorted(chosen.items())))
        if ident in checked:
            continue
        checked.add(ident)
        program = programs[index]
        given = given_names(program)
        try:
            frees_after(plan_steps(program, chosen), given, program.outputs)
        except BundleError as e:
            raise BundleError(
                f"{where}: the choices {dict(list(chosen.items())[:4])} make a wrong program: {e}"
            ) from None
    return table


def _check_time(us: float, what: str) -> None:
    if not math.isfinite(us) or not 0 <= us <= MAX_TIME_US:
        raise BundleError(f"{what}: time {us!r} µs is not a measurement")


def _check_bucket(sizes: Mapping[str, int], program: Program, buckets: Sequence[Bucket], what: str) -> None:
    if not is_bucket(sizes, program, buckets):
        symbols = [s.symbol for s in program.symbols]
        raise BundleError(f"{what}: not a bucket of the program (symbols {symbols[:4]})")


def _no_constant(text: str):
    raise ValueError(f"{text} is not a number JSON allows")


def tuned_plans(
    table: TuningTable | None, program_index: int, program: Program, arch: str
) -> dict[tuple[int, ...], tuple[Step, ...]]:
    """Bucket key (sizes in ``program.symbols`` order) → the steps its CUDA graph launches, for
    the buckets where the table chose some candidate; empty unless the table was measured on
    ``arch`` (the GPU's own ``sm_XY``)."""
    if table is None or table.arch != arch:
        return {}
    chosen: dict[tuple[int, ...], dict[str, str]] = {}
    for c in table.choices:
        if c.program == program_index and c.choice != LIBRARY:
            chosen.setdefault(bucket_key(program, c.sizes), {})[c.site] = c.choice
    plans: dict[tuple[int, ...], tuple[Step, ...]] = {}
    shared: dict[tuple, tuple[Step, ...]] = {}  # one plan for buckets with the same choices
    for key, sites in sorted(chosen.items()):
        ident = tuple(sorted(sites.items()))
        if ident not in shared:
            shared[ident] = plan_steps(program, sites)
        plans[key] = shared[ident]
    return plans


def site_of(program: Program, site_id: str) -> GemmSite:
    site = next((s for s in program.alternatives if s.id == site_id), None)
    if site is None:
        raise BundleError(f"the program has no GEMM site {site_id[:40]!r}")
    return site
