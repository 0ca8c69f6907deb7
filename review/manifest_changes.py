"""The changes between two guard manifests: inputs, symbols' admissible sets, relations, guards
and where they come from, buckets, and the environment (archs, schema, torch)."""

from __future__ import annotations

from aot.admissible import admissible_text
from aot.errors import BundleError
from aot.manifest_text import GuardManifest, canonical, program_sets, site_text, static_size
from aot.review.sets import Sizes, compare_sets, declared_text, difference, sizes_text, static_set
from aot.review.verdict import Change, change
from aot.schema import GuardSource


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


def _guard_changes(
    subject: str,
    old: tuple[GuardSource, ...],
    new: tuple[GuardSource, ...],
    new_kind: str = "new guard",
    lost: Sizes | None = None,
    name: str = "",
) -> list[Change]:
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
                changes.append(
                    change(
                        "moved guard",
                        subject,
                        site_text(match),
                        site_text(n),
                        summary=f"{subject}: {n.text}  {site_text(match)}  ->  {site_text(n)}",
                    )
                )
    for s in old_left:
        changes.append(change("removed guard", subject, old=f"{s.text}  {site_text(s)}"))
    for s in new_left:
        rejected = _rejects(s.text, name, lost) if lost is not None and lost.count else None
        details = (
            (f"this line rejects {name} = {rejected}, which was accepted",) if rejected is not None else ()
        )
        changes.append(change(new_kind, subject, new=f"{s.text}  {site_text(s)}", details=details))
    return changes


def _arch_list(archs) -> str:
    return ", ".join(archs) if archs else "(none: CPU only)"


def diff_manifests(old: GuardManifest, new: GuardManifest) -> list[Change]:
    """Every change between two guard manifests, classified."""
    old, new = canonical(old), canonical(new)
    for m in (old, new):
        declared = {s.name for s in m.guards.symbols}
        for i in m.guards.inputs:
            unknown = [d for d in i.shape if static_size(d) is None and d not in declared]
            if unknown:
                raise BundleError(
                    f"manifest of {m.name}: input {i.name} has size {unknown[0][:40]!r}, which is "
                    f"neither a static size nor a symbol it declares; regenerate the manifest"
                )
    changes: list[Change] = []
    if old.name != new.name:
        changes.append(change("model", "model name", old.name, new.name))
    if old.dtype and new.dtype and old.dtype != new.dtype:
        changes.append(
            change("dtype", "model dtype", old.dtype, new.dtype, ("outputs computed in another dtype",))
        )
    changes += _input_changes(old, new)
    changes += _entry_changes(old, new)
    if old.programs != new.programs:
        # The contract (the symbols above) is what callers see; how it is split into programs is
        # worth a reviewer's glance but never breaks a caller by itself (an entry point's own
        # contract is compared by ``_entry_changes``).
        for line in old.programs:
            if line not in new.programs:
                changes.append(change("program", "program", old=line, summary=f"program removed: {line}"))
        for line in new.programs:
            if line not in old.programs:
                changes.append(change("program", "program", new=line, summary=f"program added: {line}"))
    old_rel = {r.expr: r for r in old.guards.relations}
    new_rel = {r.expr: r for r in new.guards.relations}
    for expr in sorted(old_rel.keys() | new_rel.keys()):
        subject = "relation"
        if expr not in new_rel:
            changes.append(change("removed guard", subject, old=f"{expr}  {site_text(old_rel[expr].source)}"))
        elif expr not in old_rel:
            changes.append(
                change(
                    "new relation",
                    subject,
                    new=f"{expr}  {site_text(new_rel[expr].source)}",
                    details=("may reject calls the old manifest accepted",),
                )
            )
        else:
            changes += _guard_changes(subject, (old_rel[expr].source,), (new_rel[expr].source,))
    changes += _guard_changes(
        "specialized", old.guards.specializations, new.guards.specializations, new_kind="specialized"
    )
    changes += _bucket_changes(old, new)
    changes += _env_changes(old, new)
    return changes


def _entry_changes(old: GuardManifest, new: GuardManifest) -> list[Change]:
    """Entry points added or removed, and per entry point of one program on both sides, its
    sizes widened or narrowed (the bundle's contract is the union over entry points, so a
    narrower ``decode`` may leave it unchanged)."""
    changes = []
    for name in old.entry_points:
        if name not in new.entry_points:
            changes.append(
                change(
                    "entry point removed",
                    f"entry point {name}",
                    old=name,
                    details=(f"runner.entry({name!r}) now fails",),
                )
            )
    for name in new.entry_points:
        if name not in old.entry_points:
            changes.append(change("entry point added", f"entry point {name}", new=name))

    def lines_of(m: GuardManifest, name: str) -> list[str]:
        return [line for line in m.programs if line.partition("  admits  ")[0] == name]

    for name in (e for e in old.entry_points if e in new.entry_points):
        a, b = lines_of(old, name), lines_of(new, name)
        if len(a) != 1 or len(b) != 1 or a == b:
            continue
        sa, sb = program_sets(a[0]), program_sets(b[0])
        if sa is None or sb is None:
            continue
        for sym in sorted(sa.keys() & sb.keys()):
            changes += compare_sets(f"entry point {name} {sym}", sa[sym], sb[sym], sym)
    return changes


def _input_changes(old: GuardManifest, new: GuardManifest) -> list[Change]:
    changes = []
    old_in = {i.name: i for i in old.guards.inputs}
    new_in = {i.name: i for i in new.guards.inputs}

    def shape_text(i) -> str:
        return f"{i.dtype}[{', '.join(i.shape)}]"

    def kind(i) -> str:
        return "state" if i.state else "input"

    for i in old.guards.inputs:
        if i.name not in new_in:
            if i.state:
                changes.append(change("state removed", f"state {i.name}", old=shape_text(i)))
            else:
                changes.append(change("input removed", f"input {i.name}", old=shape_text(i)))
    for i in new.guards.inputs:
        if i.name not in old_in:
            if i.state:
                changes.append(
                    change(
                        "state added",
                        f"state {i.name}",
                        new=shape_text(i),
                        details=("runner-owned: callers pass nothing new",),
                    )
                )
            else:
                changes.append(
                    change(
                        "input added",
                        f"input {i.name}",
                        new=shape_text(i),
                        details=("every call must now pass it",),
                    )
                )
    for i in old.guards.inputs:
        j = new_in.get(i.name)
        if j is not None and i.state != j.state:
            changes.append(
                change(
                    "state",
                    f"input {i.name}",
                    kind(i),
                    kind(j),
                    (
                        "callers must no longer pass it: the runner owns it"
                        if j.state
                        else "every call must now pass it",
                    ),
                )
            )
    common_old = [i.name for i in old.guards.inputs if i.name in new_in and not i.state]
    common_new = [i.name for i in new.guards.inputs if i.name in old_in and not i.state]
    if common_old != common_new:
        changes.append(
            change(
                "input order",
                "inputs",
                ", ".join(common_old),
                ", ".join(common_new),
                ("positional calls bind to other inputs",),
            )
        )
    old_sym = {s.name: s for s in old.guards.symbols}
    new_sym = {s.name: s for s in new.guards.symbols}
    pairs: dict[tuple[str, str], list[str]] = {}  # (old symbol, new symbol) -> dims where they meet
    for name in common_old:
        a, b = old_in[name], new_in[name]
        if a.dtype != b.dtype:
            changes.append(change("dtype", f"input {name}", a.dtype, b.dtype))
        if len(a.shape) != len(b.shape):
            changes.append(
                change(
                    "rank",
                    f"input {name}",
                    f"{shape_text(a)} (rank {len(a.shape)})",
                    f"{shape_text(b)} (rank {len(b.shape)})",
                )
            )
            continue
        for d, (x, y) in enumerate(zip(a.shape, b.shape)):
            where = f"input {name} dim {d}"
            sx, sy = static_size(x), static_size(y)
            if sx is not None and sy is not None:
                changes += compare_sets(where, static_set(sx), static_set(sy), "size")
            elif sx is not None:
                changes += compare_sets(where, static_set(sx), new_sym[y], y)
            elif sy is not None:
                sizes = difference(old_sym[x], static_set(sy))
                if sizes.count:
                    changes.append(
                        change(
                            "specialized",
                            where,
                            f"{x} ({admissible_text(old_sym[x])})",
                            y,
                            (
                                f"dynamic -> static: only {y} is accepted",
                                f"no longer accepted: {x} in {sizes_text(sizes)}",
                            ),
                        )
                    )
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
            changes.append(
                change(
                    "narrowed",
                    f"symbol {y}",
                    " / ".join(sorted(xs)),
                    y,
                    (f"dims {', '.join(dims)} must now be equal; they were independent",),
                )
            )
    for x, ys in sorted(by_old.items()):
        if len(ys) > 1:
            dims = sorted(d for (xx, y), ds in pairs.items() if xx == x for d in ds)
            changes.append(
                change(
                    "widened",
                    f"symbol {x}",
                    x,
                    " / ".join(sorted(ys)),
                    (f"dims {', '.join(dims)} no longer must be equal",),
                )
            )
    for (x, y), dims in sorted(pairs.items()):
        a, b = old_sym[x], new_sym[y]
        subject = f"symbol {y}" if x == y else f"symbol {x} -> {y}"
        if x != y and len(by_new[y]) == 1 and len(by_old[x]) == 1:
            changes.append(change("renamed", f"symbol {x}", x, y, (f"at {', '.join(dims)}",)))
        found = compare_sets(subject, a, b, y)
        if not found and declared_text(a) != declared_text(b):
            found = [
                change(
                    "declared",
                    subject,
                    declared_text(a),
                    declared_text(b),
                    (f"admissible set unchanged: {admissible_text(b)}",),
                )
            ]
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
                details = [
                    f"{label}: {', '.join(map(str, s))}"
                    for label, s in (("sizes dropped", dropped), ("sizes added", added))
                    if s
                ]
                if x.paddable != y.paddable:
                    details.append("padding now allowed" if y.paddable else "padding no longer allowed")
            summary = (
                f"bucket {sym} removed: {text(x)}"
                if y is None
                else f"bucket {sym} added: {text(y)}"
                if x is None
                else ""
            )
            changes.append(
                change(
                    "bucket",
                    f"bucket {sym}",
                    text(x) if x else "",
                    text(y) if y else "",
                    tuple(details),
                    summary=summary,
                )
            )
    return changes


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in text.split("."))


def _env_changes(old: GuardManifest, new: GuardManifest) -> list[Change]:
    changes = []
    ea, eb = old.environment, new.environment
    dropped = [a for a in ea.archs if a not in eb.archs]
    added = [a for a in eb.archs if a not in ea.archs]
    if dropped:
        changes.append(
            change(
                "arch dropped",
                "env archs",
                _arch_list(ea.archs),
                _arch_list(eb.archs),
                (f"no kernels for {', '.join(dropped)}: GPUs of that arch cannot load it",),
            )
        )
    if added:
        changes.append(change("arch added", "env archs", _arch_list(ea.archs), _arch_list(eb.archs)))
    va, vb = old.schema_version, new.schema_version
    if va != vb:
        newer = vb > va
        why = (
            (
                f"a loader of schema {va[0]}.x reads only bundles of that major"
                if vb[0] != va[0]
                else "loaders older than schema {}.{} reject it".format(*vb)
            )
            if newer
            else "older loaders read it"
        )
        changes.append(
            change(
                "schema",
                "env schema",
                f"{va[0]}.{va[1]}",
                f"{vb[0]}.{vb[1]}",
                (why,),
                breaking=newer or vb[0] != va[0],
            )
        )
    if ea.torch_min != eb.torch_min:
        raised = _version(eb.torch_min) > _version(ea.torch_min)
        changes.append(
            change(
                "torch",
                "env torch",
                f">= {ea.torch_min}",
                f">= {eb.torch_min}",
                ("serving hosts need a newer torch" if raised else "older torch accepted",),
                breaking=raised,
            )
        )
    return changes
