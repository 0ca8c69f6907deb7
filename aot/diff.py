"""Compare two guard manifests and classify every change by what it means to callers.

``aotpack diff OLD NEW`` and ``aotpack check`` use this. Each side is a bundle, a manifest text
file, or a model file (traced, nothing compiled). The question a reviewer asks is "does the new
artifact reject a call the old one accepted?", so every change is **breaking** (it may: narrowed,
specialized, dtype/rank, inputs added/removed/reordered, a new relation, an arch dropped, a newer
schema or torch required) or **safe** (it cannot: widened, removed or moved guards, arch added,
buckets, kernels, weights). Admissible sets are compared exactly: they are bounded, and within a
range a set only depends on ``v % modulus`` apart from a few excluded values, so the difference
of two sets is counted segment by segment, one period at a time (``aot.admissible.admits``
decides membership), whatever the size of the ranges.

Exit status (``exit_code``): 0 no change, 1 only safe changes, 2 at least one breaking change.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass

from aot.errors import BundleError
from aot.admissible import admissible_text, admits
from aot.manifest_text import GuardManifest, canonical, manifest_of_bundle, parse_guards_text, site_text
from aot.schema import GuardSource, SymbolGuard

EXIT_SAME = 0
EXIT_SAFE = 1
EXIT_BREAKING = 2
EXIT_ERROR = 4  # a side could not be read (3 is the CLI's internal error)

RUNS_SHOWN = 6  # runs of sizes listed when a set gains or loses values
MAX_PERIOD_WORK = 1 << 24  # bound on the exact set comparison: period × segments
MAX_MANIFEST_FILE = 16 << 20
MAX_WEIGHT_DIFF_BYTES = 8 << 30  # above this, weights compare by member checksum only
ZIP_MAGIC = b"PK\x03\x04"

BREAKING_KINDS = ("narrowed", "specialized", "dtype", "rank", "input added", "input removed", "input order",
                  "new relation", "arch dropped", "schema", "torch")
SAFE_KINDS = ("widened", "declared", "renamed", "new guard", "removed guard", "moved guard", "arch added",
              "model", "bucket", "kernel", "ops", "program", "weights", "toolchain")


@dataclass(frozen=True)
class Change:
    """One classified change. ``summary`` is the human line; ``details`` further lines."""

    kind: str
    breaking: bool
    subject: str
    old: str = ""
    new: str = ""
    summary: str = ""
    details: tuple[str, ...] = ()


def _change(kind: str, subject: str, old: str = "", new: str = "", details: tuple[str, ...] = (),
            breaking: bool | None = None, summary: str = "") -> Change:
    if breaking is None:
        assert kind in BREAKING_KINDS or kind in SAFE_KINDS, kind
        breaking = kind in BREAKING_KINDS
    if not summary:
        summary = f"{subject}: {old} -> {new}" if old and new else f"{subject}: {old or new}"
    return Change(kind=kind, breaking=breaking, subject=subject, old=old, new=new, summary=summary,
                  details=tuple(details))


@dataclass(frozen=True)
class Side:
    """One side of a diff: its guard manifest, and the bundle it came from when it is one."""

    label: str
    manifest: GuardManifest
    bundle_path: str | None = None


@dataclass(frozen=True)
class Diff:
    changes: tuple[Change, ...]

    @property
    def breaking(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.breaking)

    @property
    def exit_code(self) -> int:
        if not self.changes:
            return EXIT_SAME
        return EXIT_BREAKING if self.breaking else EXIT_SAFE

    @property
    def verdict(self) -> str:
        return {EXIT_SAME: "same", EXIT_SAFE: "safe", EXIT_BREAKING: "breaking"}[self.exit_code]

    def text(self) -> str:
        """The human report: one line per change (details indented), then a one-line verdict."""
        lines = []
        for c in self.changes:
            lines.append(f"{'BREAKING' if c.breaking else 'safe':<9} {c.kind:<14} {c.summary}")
            lines.extend(f"{'':<24} {d}" for d in c.details)
        n_break = len(self.breaking)
        n_safe = len(self.changes) - n_break
        if not self.changes:
            lines.append("no changes (exit 0)")
        else:
            lines.append(f"{len(self.changes)} change{'s' if len(self.changes) != 1 else ''}: {n_break} breaking, "
                         f"{n_safe} safe (exit {self.exit_code})")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "exit_code": self.exit_code,
                "changes": [{**asdict(c), "details": list(c.details)} for c in self.changes]}


# ---------------------------------------------------------------------------------------------
# Exact comparison of admissible sets.


@dataclass(frozen=True)
class Sizes:
    """A set of sizes: how many, and its first runs ``(first, last)`` in increasing order."""

    count: int
    runs: tuple[tuple[int, int], ...]
    more: bool  # more runs exist than ``runs`` shows
    last: int = 0  # the largest size in the set

    def text(self) -> str:
        """``33..64``, ``1, 3, 5`` or, for a longer progression, ``130..256 step 2``."""
        starts = [a for a, b in self.runs]
        if self.more and all(a == b for a, b in self.runs) and len(starts) > 2:
            step = starts[1] - starts[0]
            if all(y - x == step for x, y in zip(starts, starts[1:])) and \
                    self.count == (self.last - starts[0]) // step + 1:
                return f"{starts[0]}..{self.last} step {step}"
        shown = [str(a) if a == b else (f"{a}, {b}" if b == a + 1 else f"{a}..{b}") for a, b in self.runs]
        return ", ".join(shown + ([f"…, {self.last}"] if self.more else []))


def static_set(size: int) -> SymbolGuard:
    return SymbolGuard(name=str(size), declared_min=size, declared_max=size, min=size, max=size)


def difference(a: SymbolGuard, b: SymbolGuard, limit: int = RUNS_SHOWN) -> Sizes:
    """The sizes ``a`` admits and ``b`` does not, counted exactly.

    Cut ``a``'s range where ``b``'s range starts or ends and around every excluded value; inside a
    segment, membership in both sets depends only on ``v % lcm(a.modulus, b.modulus)``, so one
    period of it gives the count for the whole segment and the pattern of its runs.
    """
    lo, hi = a.min, a.max
    if lo > hi:
        return Sizes(0, (), False)
    period = math.lcm(max(a.modulus, 1), max(b.modulus, 1))
    cuts = {lo, hi + 1}
    for v in (b.min, b.max + 1, *a.excluded, *b.excluded, *(e + 1 for e in (*a.excluded, *b.excluded))):
        if lo < v <= hi:
            cuts.add(v)
    cuts = sorted(cuts)
    if period * len(cuts) > MAX_PERIOD_WORK:
        raise BundleError(
            f"cannot compare the sets of {a.name} and {b.name}: moduli {a.modulus} and {b.modulus} with "
            f"{len(cuts)} cut points exceed the comparison bound; simplify the guards"
        )
    count, runs, more, last = 0, [], False, 0

    def add(first: int, last: int) -> None:
        nonlocal more
        if runs and runs[-1][1] + 1 == first:
            runs[-1] = (runs[-1][0], last)
        elif len(runs) < limit:
            runs.append((first, last))
        else:
            more = True

    for start, end in zip(cuts, cuts[1:]):  # segment [start, end)
        n = end - start
        hits = [k for k in range(min(n, period)) if admits(a, start + k) and not admits(b, start + k)]
        if not hits:
            continue
        if n > period:  # whole periods, then the partial one at the end
            count += (n // period) * len(hits) + sum(k < n % period for k in hits)
        else:
            count += len(hits)
        last = max(start + k + (end - 1 - start - k) // period * period for k in hits)
        if more:
            continue
        if len(hits) == period:
            add(start, end - 1)
            continue
        q = 0
        while not more and start + q * period < end:
            for k in hits:
                v = start + q * period + k
                if v >= end or more:
                    break
                add(v, v)
            q += 1
    return Sizes(count, tuple(runs), more, last)


def _set_text(g: SymbolGuard) -> str:
    return g.name if g.name.isdigit() else admissible_text(g)


def _sizes_text(sizes: Sizes) -> str:
    return f"{sizes.text()} ({sizes.count} size{'s' * (sizes.count != 1)})"


def _compare_sets(subject: str, a: SymbolGuard, b: SymbolGuard, name: str) -> list[Change]:
    """widened / narrowed (or nothing) for the same dim or symbol with set ``a`` before, ``b`` after."""
    lost, gained = difference(a, b), difference(b, a)
    if not lost.count and not gained.count:
        return []
    details = []
    symbolic = not a.name.isdigit() and not b.name.isdigit()
    if symbolic and (a.declared_min, a.declared_max) != (b.declared_min, b.declared_max):
        details.append(f"declared {a.declared_min}..{a.declared_max} -> {b.declared_min}..{b.declared_max}")
    if lost.count:
        details.append(f"no longer accepted: {name} in {_sizes_text(lost)}")
    if gained.count:
        details.append(f"newly accepted: {name} in {_sizes_text(gained)}")
    kind = "narrowed" if lost.count else "widened"
    return [_change(kind, subject, _set_text(a), _set_text(b), tuple(details))]


# ---------------------------------------------------------------------------------------------
# The manifest diff.


def _rejects(text: str, name: str, lost: Sizes) -> int | None:
    """A size among ``lost`` (the first of each run, and the last) that guard ``text`` rejects."""
    from aot.symexpr import compile_expr

    try:
        check = compile_expr(text)
        if check.symbols != {name}:
            return None
        return next((v for v in [a for a, _ in lost.runs] + [lost.last] if not check({name: v})), None)
    except (BundleError, ArithmeticError):
        return None


def _guard_changes(subject: str, old: tuple[GuardSource, ...], new: tuple[GuardSource, ...],
                   new_kind: str = "new guard", lost: Sizes | None = None, name: str = "") -> list[Change]:
    """Guards matched by text: the same text at another line (or with other code) has moved."""
    old_left = [s for s in old if s not in new]
    new_left = [s for s in new if s not in old]
    changes = []
    for key in (lambda s: (s.text, s.code), lambda s: s.text):
        for n in list(new_left):
            match = next((o for o in old_left if key(o) == key(n)), None)
            if match is not None:
                old_left.remove(match)
                new_left.remove(n)
                changes.append(_change("moved guard", subject, site_text(match), site_text(n),
                                       summary=f"{subject}: {n.text}  {site_text(match)}  ->  {site_text(n)}"))
    for s in old_left:
        changes.append(_change("removed guard", subject, old=f"{s.text}  {site_text(s)}"))
    for s in new_left:
        rejected = _rejects(s.text, name, lost) if lost is not None and lost.count else None
        details = (f"this line rejects {name} = {rejected}, which was accepted",) if rejected is not None else ()
        changes.append(_change(new_kind, subject, new=f"{s.text}  {site_text(s)}", details=details))
    return changes


def _arch_list(archs) -> str:
    return ", ".join(archs) if archs else "(none: CPU only)"


def diff_manifests(old: GuardManifest, new: GuardManifest) -> list[Change]:
    """Every change between two guard manifests, classified."""
    old, new = canonical(old), canonical(new)
    for m in (old, new):
        declared = {s.name for s in m.guards.symbols}
        for i in m.guards.inputs:
            unknown = [d for d in i.shape if not d.isdigit() and d not in declared]
            if unknown:
                raise BundleError(f"manifest of {m.name}: input {i.name} uses symbol {unknown[0][:40]!r}, "
                                  f"which it does not declare; regenerate the manifest")
    changes: list[Change] = []
    if old.name != new.name:
        changes.append(_change("model", "model name", old.name, new.name))
    if old.dtype and new.dtype and old.dtype != new.dtype:
        changes.append(_change("dtype", "model dtype", old.dtype, new.dtype,
                               ("outputs computed in another dtype",)))
    changes += _input_changes(old, new)
    if old.programs != new.programs:
        # The contract (the symbols above) is what callers see; how it is split into programs is
        # worth a reviewer's glance but never breaks a caller by itself.
        for line in old.programs:
            if line not in new.programs:
                changes.append(_change("program", "program", old=line, summary=f"program removed: {line}"))
        for line in new.programs:
            if line not in old.programs:
                changes.append(_change("program", "program", new=line, summary=f"program added: {line}"))
    old_rel = {r.expr: r for r in old.guards.relations}
    new_rel = {r.expr: r for r in new.guards.relations}
    for expr in sorted(old_rel.keys() | new_rel.keys()):
        subject = "relation"
        if expr not in new_rel:
            changes.append(_change("removed guard", subject, old=f"{expr}  {site_text(old_rel[expr].source)}"))
        elif expr not in old_rel:
            changes.append(_change("new relation", subject, new=f"{expr}  {site_text(new_rel[expr].source)}",
                                   details=("may reject calls the old manifest accepted",)))
        else:
            changes += _guard_changes(subject, (old_rel[expr].source,), (new_rel[expr].source,))
    changes += _guard_changes("specialized", old.guards.specializations, new.guards.specializations,
                              new_kind="specialized")
    changes += _bucket_changes(old, new)
    changes += _env_changes(old, new)
    return changes


def _input_changes(old: GuardManifest, new: GuardManifest) -> list[Change]:
    changes = []
    old_in = {i.name: i for i in old.guards.inputs}
    new_in = {i.name: i for i in new.guards.inputs}

    def shape_text(i) -> str:
        return f"{i.dtype}[{', '.join(i.shape)}]"

    for i in old.guards.inputs:
        if i.name not in new_in:
            changes.append(_change("input removed", f"input {i.name}", old=shape_text(i)))
    for i in new.guards.inputs:
        if i.name not in old_in:
            changes.append(_change("input added", f"input {i.name}", new=shape_text(i),
                                   details=("every call must now pass it",)))
    common_old = [i.name for i in old.guards.inputs if i.name in new_in]
    common_new = [i.name for i in new.guards.inputs if i.name in old_in]
    if common_old != common_new:
        changes.append(_change("input order", "inputs", ", ".join(common_old), ", ".join(common_new),
                               ("positional calls bind to other inputs",)))
    old_sym = {s.name: s for s in old.guards.symbols}
    new_sym = {s.name: s for s in new.guards.symbols}
    pairs: dict[tuple[str, str], list[str]] = {}  # (old symbol, new symbol) -> dims where they meet
    for name in common_old:
        a, b = old_in[name], new_in[name]
        if a.dtype != b.dtype:
            changes.append(_change("dtype", f"input {name}", a.dtype, b.dtype))
        if len(a.shape) != len(b.shape):
            changes.append(_change("rank", f"input {name}", f"{shape_text(a)} (rank {len(a.shape)})",
                                   f"{shape_text(b)} (rank {len(b.shape)})"))
            continue
        for d, (x, y) in enumerate(zip(a.shape, b.shape)):
            where = f"input {name} dim {d}"
            if x.isdigit() and y.isdigit():
                changes += _compare_sets(where, static_set(int(x)), static_set(int(y)), "size")
            elif x.isdigit():
                changes += _compare_sets(where, static_set(int(x)), new_sym[y], y)
            elif y.isdigit():
                sizes = difference(old_sym[x], static_set(int(y)))
                if sizes.count:
                    changes.append(_change("specialized", where, f"{x} ({admissible_text(old_sym[x])})", y, (
                        f"dynamic -> static: only {y} is accepted", f"no longer accepted: {x} in {_sizes_text(sizes)}")))
            else:
                pairs.setdefault((x, y), []).append(f"{name}.shape[{d}]")
    changes += _symbol_changes(pairs, old_sym, new_sym, old, new)
    return changes


def _symbol_changes(pairs, old_sym, new_sym, old: GuardManifest, new: GuardManifest) -> list[Change]:
    """Symbols that meet at the same input dims: compare their sets and guards; notice dims that
    now must be equal (narrowed) or no longer must (widened), and renames."""
    changes = []
    by_new: dict[str, set[str]] = {}
    by_old: dict[str, set[str]] = {}
    for x, y in pairs:
        by_new.setdefault(y, set()).add(x)
        by_old.setdefault(x, set()).add(y)
    for y, xs in sorted(by_new.items()):
        if len(xs) > 1:
            dims = sorted(d for (x, yy), ds in pairs.items() if yy == y for d in ds)
            changes.append(_change("narrowed", f"symbol {y}", " / ".join(sorted(xs)), y, (
                f"dims {', '.join(dims)} must now be equal; they were independent",)))
    for x, ys in sorted(by_old.items()):
        if len(ys) > 1:
            dims = sorted(d for (xx, y), ds in pairs.items() if xx == x for d in ds)
            changes.append(_change("widened", f"symbol {x}", x, " / ".join(sorted(ys)), (
                f"dims {', '.join(dims)} no longer must be equal",)))
    for (x, y), dims in sorted(pairs.items()):
        a, b = old_sym[x], new_sym[y]
        subject = f"symbol {y}" if x == y else f"symbol {x} -> {y}"
        if x != y and len(by_new[y]) == 1 and len(by_old[x]) == 1:
            changes.append(_change("renamed", f"symbol {x}", x, y, (f"at {', '.join(dims)}",)))
        found = _compare_sets(subject, a, b, y)
        if not found and (a.declared_min, a.declared_max) != (b.declared_min, b.declared_max):
            found = [_change("declared", subject, f"{a.declared_min}..{a.declared_max}",
                             f"{b.declared_min}..{b.declared_max}",
                             (f"admissible set unchanged: {admissible_text(b)}",))]
        changes += found
        if x == y:
            changes += _guard_changes(subject, a.sources, b.sources, lost=difference(a, b), name=y)
    return changes


def _bucket_changes(old: GuardManifest, new: GuardManifest) -> list[Change]:
    changes = []
    a = {b.symbol: b for b in old.buckets}
    b = {b.symbol: b for b in new.buckets}

    def text(bk) -> str:
        return ", ".join(map(str, bk.sizes)) + ("  paddable" if bk.paddable else "")

    for sym in sorted(a.keys() | b.keys()):
        x, y = a.get(sym), b.get(sym)
        if x is None or y is None or text(x) != text(y):
            details = []
            if x is not None and y is not None:
                dropped = sorted(set(x.sizes) - set(y.sizes))
                added = sorted(set(y.sizes) - set(x.sizes))
                details = [f"{label}: {', '.join(map(str, s))}" for label, s in
                           (("sizes dropped", dropped), ("sizes added", added)) if s]
                if x.paddable != y.paddable:
                    details.append("padding now allowed" if y.paddable else "padding no longer allowed")
            summary = (f"bucket {sym} removed: {text(x)}" if y is None else f"bucket {sym} added: {text(y)}"
                       if x is None else "")
            changes.append(_change("bucket", f"bucket {sym}", text(x) if x else "", text(y) if y else "",
                                   tuple(details), summary=summary))
    return changes


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in text.split("."))


def _env_changes(old: GuardManifest, new: GuardManifest) -> list[Change]:
    changes = []
    ea, eb = old.environment, new.environment
    dropped = [a for a in ea.archs if a not in eb.archs]
    added = [a for a in eb.archs if a not in ea.archs]
    if dropped:
        changes.append(_change("arch dropped", "env archs", _arch_list(ea.archs), _arch_list(eb.archs),
                               (f"no kernels for {', '.join(dropped)}: GPUs of that arch cannot load it",)))
    if added:
        changes.append(_change("arch added", "env archs", _arch_list(ea.archs), _arch_list(eb.archs)))
    va, vb = old.schema_version, new.schema_version
    if va != vb:
        newer = vb > va
        why = (f"a loader of schema {va[0]}.x reads only bundles of that major" if vb[0] != va[0] else
               "loaders older than schema {}.{} reject it".format(*vb)) if newer else "older loaders read it"
        changes.append(_change("schema", "env schema", f"{va[0]}.{va[1]}", f"{vb[0]}.{vb[1]}", (why,),
                               breaking=newer or vb[0] != va[0]))
    if ea.torch_min != eb.torch_min:
        raised = _version(eb.torch_min) > _version(ea.torch_min)
        changes.append(_change("torch", "env torch", f">= {ea.torch_min}", f">= {eb.torch_min}",
                               ("serving hosts need a newer torch" if raised else "older torch accepted",),
                               breaking=raised))
    return changes


# ---------------------------------------------------------------------------------------------
# Bundles: kernels, ops, program, weights.


def _tensor_digests(data: bytes, where: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (dtype, shape, sha256 of its bytes), from a safetensors file's bytes."""
    try:
        n = int.from_bytes(data[:8], "little")
        if not 0 < n <= len(data) - 8:
            raise ValueError(f"header length {n}")
        header = json.loads(data[8:8 + n])
        base = 8 + n
        out = {}
        view = memoryview(data)
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= len(data) - base:
                raise ValueError(f"tensor {name} offsets {start}..{end}")
            out[name] = (str(info["dtype"]), tuple(info["shape"]),
                         hashlib.sha256(view[base + start:base + end]).hexdigest())
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{where}: weights are not valid safetensors: {e}") from None


def diff_bundles(old_path: str, new_path: str) -> list[Change]:
    """Kernel, op, program and weight changes between two bundles (guards are compared apart)."""
    from aot import schema
    from aot.loader.bundle import open_bundle

    a, b = open_bundle(old_path), open_bundle(new_path)
    try:
        changes = []
        ea, eb = a.manifest.environment, b.manifest.environment
        for label, x, y in (("torch", ea.torch_built, eb.torch_built), ("triton", ea.triton_built, eb.triton_built),
                            ("python", ea.python_built, eb.python_built)):
            if x != y:
                changes.append(_change("toolchain", f"built with {label}", x or "-", y or "-"))
        ops_a, ops_b = set(a.manifest.ops), set(b.manifest.ops)
        for op in sorted(ops_b - ops_a):
            changes.append(_change("ops", "ATen op", new=op, summary=f"ATen op added: {op}",
                                   details=("the serving torch must provide it",)))
        for op in sorted(ops_a - ops_b):
            changes.append(_change("ops", "ATen op", old=op, summary=f"ATen op no longer used: {op}"))
        ma, mb = a.manifest.members, b.manifest.members
        if ma[schema.PROGRAM_PATH].sha256 != mb[schema.PROGRAM_PATH].sha256:
            pa, pb = a.program(), b.program()
            changes += _kernel_changes(pa.kernels, pb.kernels)
            changes.append(_change("program", "program", f"{len(pa.steps)} steps", f"{len(pb.steps)} steps",
                                   (f"{sum(s.kind == 'kernel' for s in pa.steps)} -> "
                                    f"{sum(s.kind == 'kernel' for s in pb.steps)} kernel launches",)))
        if ma[schema.WEIGHTS_PATH].sha256 != mb[schema.WEIGHTS_PATH].sha256:
            changes += _weight_changes(a, b, schema.WEIGHTS_PATH)
        return changes
    finally:
        a.close()
        b.close()


def _kernel_changes(old, new) -> list[Change]:
    changes = []
    a = {k.id: k for k in old}
    b = {k.id: k for k in new}
    a_names = {k.name: k for k in old if k.id not in b}
    b_names = {k.name: k for k in new if k.id not in a}

    def ops(k) -> str:
        return f"{len(k.ops)} ops [{', '.join(k.ops[:6])}{', …' if len(k.ops) > 6 else ''}]"

    for name in sorted(a_names.keys() & b_names.keys()):
        x, y = a_names[name], b_names[name]
        changes.append(_change("kernel", f"kernel {name}", f"{x.id} {ops(x)}", f"{y.id} {ops(y)}",
                               summary=f"kernel {name} changed: {x.id} -> {y.id}"))
    for name in sorted(a_names.keys() - b_names.keys()):
        changes.append(_change("kernel", f"kernel {name}", old=f"{a_names[name].id} {ops(a_names[name])}",
                               summary=f"kernel removed: {name} {ops(a_names[name])}"))
    for name in sorted(b_names.keys() - a_names.keys()):
        changes.append(_change("kernel", f"kernel {name}", new=f"{b_names[name].id} {ops(b_names[name])}",
                               summary=f"kernel added: {name} {ops(b_names[name])}"))
    return changes


def _weight_changes(a, b, member: str) -> list[Change]:
    sizes = a.manifest.members[member].size + b.manifest.members[member].size
    if sizes > MAX_WEIGHT_DIFF_BYTES:
        return [_change("weights", "weights", a.manifest.members[member].sha256[:12],
                        b.manifest.members[member].sha256[:12], ("too large to compare tensor by tensor",))]
    x = _tensor_digests(a.read(member), str(a.path))
    y = _tensor_digests(b.read(member), str(b.path))
    changed = sorted(n for n in x.keys() & y.keys() if x[n][2] != y[n][2] and x[n][:2] == y[n][:2])
    reshaped = sorted(n for n in x.keys() & y.keys() if x[n][:2] != y[n][:2])
    details = []

    def names(ns: list[str]) -> str:
        return ", ".join(ns[:5]) + (f", … ({len(ns)} in all)" if len(ns) > 5 else "")

    for label, ns in (("values changed", changed), ("dtype/shape changed", reshaped),
                      ("added", sorted(y.keys() - x.keys())), ("removed", sorted(x.keys() - y.keys()))):
        if ns:
            details.append(f"{label}: {names(ns)}")
    if not details:
        details.append("same tensors; the file differs only in layout or metadata")
    n = len(changed) + len(reshaped) + len(y.keys() ^ x.keys())
    return [_change("weights", "weights", summary=f"weights: {n} of {len(x.keys() | y.keys())} tensors differ",
                    details=tuple(details))]


# ---------------------------------------------------------------------------------------------
# Reading a side: bundle, manifest text file, or model file.


def read_side(path: str, archs: tuple[str, ...] | None = None) -> Side:
    """A bundle (zip), a model file (``.py``, traced for ``archs``) or a manifest text file."""
    if path.endswith(".py"):
        from aot.tracer import guard_manifest, load_model_file

        return Side(path, guard_manifest(load_model_file(path), archs or ("sm_80", "sm_90")))
    if not os.path.isfile(path):
        raise BundleError(f"{path} does not exist or is not a file; expected a bundle, a manifest file "
                          f"(`aotpack guards MODEL.py -o FILE`) or a model file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == ZIP_MAGIC:
        from aot.loader.bundle import open_bundle

        bundle = open_bundle(path)
        try:
            return Side(path, manifest_of_bundle(bundle.manifest), bundle_path=path)
        finally:
            bundle.close()
    if os.path.getsize(path) > MAX_MANIFEST_FILE:
        raise BundleError(f"{path} is {os.path.getsize(path)} bytes; a manifest file is at most "
                          f"{MAX_MANIFEST_FILE} (is it the right file?)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BundleError(f"{path} is neither a bundle (zip) nor a manifest text file (not UTF-8)") from None
    return Side(path, parse_guards_text(text, path))


def diff(old: Side, new: Side) -> Diff:
    """Classify every change from ``old`` to ``new``; bundle contents too when both are bundles."""
    changes = diff_manifests(old.manifest, new.manifest)
    if old.bundle_path and new.bundle_path:
        changes += diff_bundles(old.bundle_path, new.bundle_path)
    return Diff(tuple(changes))


__all__ = ["Change", "Diff", "Side", "Sizes", "diff", "diff_manifests", "diff_bundles", "difference",
           "read_side", "EXIT_SAME", "EXIT_SAFE", "EXIT_BREAKING", "EXIT_ERROR"]
