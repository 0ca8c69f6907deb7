"""The guard manifest as stable, sorted, line-oriented text: what ``aotpack guards`` prints and
what teams commit and review. One fact per line so ``git diff`` shows exactly what changed, and a
parser for it, so a committed manifest can be compared with a bundle or a freshly traced model.

The format (``#`` lines and blank lines are comments)::

    model branchy
    dtype float32

    input x: float32[batch, seq, 16]                     # in call order: positional calls bind by it

    symbol batch: 1 <= batch <= 16  (declared 1..16)       # sorted by name
    symbol seq: 10 <= seq <= 256, seq % 2 == 0  (declared 1..256)
    symbol height: 32 <= height <= 512, height % 32 == 0  (declared 32..512 multiple_of 32)
      guard seq >= 9  at tests/data/branchy.py:15  if T > 8:
      guard seq % 2 == 0  at tests/data/branchy.py:17  pairs = x.reshape(B, T // 2, 2 * C)
    # rows along seq: not independent, a server never joins requests along it: ...
                                                           # a bundle's finding (aot.rows), a comment
    relation batch*seq <= 4096  at models/m.py:30  ...     # multi-symbol guards, sorted
    specialized ...  at FILE:LINE  CODE                    # sizes tracing fixed, sorted

    bucket seq: 16, 32, 64, 128, 256  paddable

    program general  admits  2 <= batch <= 16; 10 <= seq <= 256     # when one trace could not cover
    program batch == 1  admits  10 <= seq <= 256                    # the declared ranges: dispatch order

A stateful bundle (an LLM with a KV cache) lists its state after its inputs, and its entry points,
each program under the entry point it serves with the sizes that entry point fixes::

    input input_ids: int64[batch, seq]
    state key_cache_0: float16[batch, 8, 2048, 64]       # runner-owned, allocated at the largest batch

    entry prefill
    entry decode
    program prefill  admits  1 <= batch <= 8; 1 <= seq <= 2048
    program decode  admits  seq == 1; 1 <= batch <= 8

    env schema 1.0
    env archs sm_80, sm_90
    env torch >= 2.11

Fields within a line are separated by two spaces; guard text, expressions and file paths never
hold two spaces in a row, so a line splits back unambiguously. Nothing machine- or time-specific
is written: the build's own torch/triton/python versions stay in the bundle, not here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from aot.admissible import admissible_text
from aot.archs import sort_key as arch_sort_key
from aot.errors import BundleError, printable
from aot.schema import (
    Bucket,
    Environment,
    Guards,
    GuardSource,
    InputGuard,
    Manifest,
    Relation,
    SymbolGuard,
)
from aot.symexpr import static_size  # noqa: F401 - importers of the name here

HEADER = (
    "# aotpack guard manifest: a call whose inputs fall outside these guards is rejected with GuardError.\n"
    "# Regenerate: aotpack guards MODEL.py -o FILE   Review a change: aotpack diff OLD NEW\n"
)
CPU_ONLY = "(none: CPU only)"
# Bounds on what a parsed manifest may hold, so a hand-edited or hostile file cannot make the
# exact set comparison in ``aot.review.sets`` (whose cost grows with the modulus) run for long.
MAX_MODULUS = 1024
MAX_EXCLUDED = 1024
MAX_SIZE = 1 << 62


@dataclass(frozen=True)
class GuardManifest:
    """What the manifest text holds: a bundle's contract without its kernels and weights."""

    name: str
    guards: Guards
    environment: Environment
    buckets: tuple[Bucket, ...] = ()
    schema_version: tuple[int, int] = (0, 0)
    dtype: str = ""  # the model's compute dtype ("" when unknown)
    programs: tuple[str, ...] = ()  # "NAME  admits  SETS" per program, in dispatch order (several only)
    entry_points: tuple[str, ...] = ()  # the bundle's named entry points, in declaration order


def program_lines(entries, contract: Guards | None = None) -> tuple[str, ...]:
    """One line per ``ProgramEntry``: its name (its entry point's, where it serves one) and what
    its guards admit; for an entry point, first the sizes it fixes (``seq == 1``), read off its
    inputs against the bundle's ``contract``."""
    out = []
    for e in entries:
        fixed = [f"{name} == {size}" for name, size in fixed_sizes(e.guards, contract)] if e.entry else []
        sets = "; ".join(
            [*sorted(fixed), *(admissible_text(s) for s in sorted(e.guards.symbols, key=lambda s: s.name))]
        )
        rel = "; ".join(r.expr for r in e.guards.relations)
        what = "; ".join(x for x in (sets, rel) if x) or "its static sizes"
        out.append(f"{_one_line(e.entry or e.name)}  admits  {_one_line(what)}")
    return tuple(out)


def fixed_sizes(guards: Guards, contract: Guards | None) -> list[tuple[str, int]]:
    """The sizes a program's ``guards`` fix that the bundle's ``contract`` leaves free, read off
    the inputs (a decode entry point's ``input_ids [batch, 1]`` against ``[batch, seq]``: ``seq``
    is 1), each (symbol, size) once, in input order."""
    declared = {i.name: i.shape for i in contract.inputs} if contract is not None else {}
    fixed: list[tuple[str, int]] = []
    for inp in guards.inputs:
        for mine, theirs in zip(inp.shape, declared.get(inp.name, ())):
            size = static_size(mine)
            if size is not None and static_size(theirs) is None and (theirs, size) not in fixed:
                fixed.append((theirs, size))
    return fixed


def entry_point_names(entries) -> tuple[str, ...]:
    """The distinct entry points of ``ProgramEntry``s, in order."""
    return tuple(dict.fromkeys(e.entry for e in entries if e.entry))


def manifest_of_bundle(m: Manifest) -> GuardManifest:
    return GuardManifest(
        name=m.name,
        guards=m.guards,
        environment=m.environment,
        buckets=m.buckets,
        schema_version=m.schema_version,
        dtype=m.dtype,
        programs=program_lines(m.programs, m.guards),
        entry_points=entry_point_names(m.programs),
    )


def canonical(m: GuardManifest) -> GuardManifest:
    """``m`` as its text holds it: sorted, build-only environment fields dropped. For any ``m``,
    ``parse_guards_text(render_manifest(m)) == canonical(m)``."""
    g = m.guards
    symbols = tuple(
        replace(
            s,
            residues=tuple(sorted(s.residues)),
            excluded=tuple(sorted(s.excluded)),
            sources=tuple(sorted({_one_line_source(src) for src in s.sources}, key=_source_key)),
            rows_independent=False,  # a build's finding, shown as a comment line (``render_manifest``)
            rows_check="",
        )
        for s in sorted(g.symbols, key=lambda s: s.name)
    )
    relations = tuple(
        sorted(
            {
                Relation(expr=_one_line(r.expr), source=_one_line_source(replace(r.source, text=r.expr)))
                for r in g.relations
            },
            key=lambda r: (r.expr, *_source_key(r.source)),
        )
    )
    specializations = tuple(
        sorted({_one_line_source(s) for s in g.specializations}, key=lambda s: (s.text, *_source_key(s)))
    )
    env = Environment(
        archs=tuple(sorted(set(m.environment.archs), key=arch_sort_key)),
        torch_built="",
        torch_min=m.environment.torch_min,
        triton_built="",
        python_built="",
    )
    # "paddable" as declared: a padding the build checked and refused still reads paddable here,
    # so a model file's manifest (traced without running the model) matches its bundle's.
    buckets = tuple(
        replace(
            b,
            sizes=tuple(sorted(set(b.sizes))),
            pad_check="",
            paddable=b.paddable or b.pad_check.startswith("refused"),
        )
        for b in sorted(m.buckets, key=lambda b: b.symbol)
    )
    return GuardManifest(
        name=_one_line(m.name),
        guards=Guards(inputs=g.inputs, symbols=symbols, relations=relations, specializations=specializations),
        environment=env,
        buckets=buckets,
        schema_version=tuple(m.schema_version),
        dtype=m.dtype,
        programs=tuple(m.programs),
        entry_points=tuple(m.entry_points),
    )


def _source_key(s: GuardSource) -> tuple[str, int, str, str]:
    return (s.file, s.line, s.text, s.code)


def _one_line(text: str) -> str:
    """No line breaks or runs of spaces inside a field (they would split the line differently), and
    no other control characters (escape sequences): those are shown escaped."""
    return printable(re.sub(r"\s+", " ", text).strip())


def _one_line_source(src: GuardSource) -> GuardSource:
    return GuardSource(
        text=_one_line(src.text), file=_one_line(src.file), line=src.line, code=_one_line(src.code)
    )


def site_text(src: GuardSource) -> str:
    """``at FILE:LINE  CODE``: where a guard came from."""
    code = _one_line(src.code)
    return f"at {_one_line(src.file)}:{src.line}" + (f"  {code}" if code else "")


def rows_note(g: SymbolGuard) -> str:
    """Whether a server may join requests along ``g`` (its rows independent, ``aot.rows``), as the
    build found it; "" when the build did not check (a model file traced alone, an older bundle)."""
    if not g.rows_check:
        return ""
    if g.rows_independent:
        return f"rows along {g.name}: independent, a server may join requests along it ({g.rows_check})"
    return f"rows along {g.name}: not independent, a server never joins requests along it: {g.rows_check}"


MAX_NOTE_COMBINATIONS = 1 << 15  # combinations of sizes a relation's note enumerates


def relation_note(rel: Relation, symbols: tuple[SymbolGuard, ...]) -> str:
    """The declared sizes a relation refuses though each symbol's set admits them (a model line
    that refuses large images, ``height*width <= 256``), counted with a few of them: a call there
    gets a GuardError. "" when it refuses none; beyond ``MAX_NOTE_COMBINATIONS``, not counted."""
    import itertools
    import math

    from aot.admissible import admits
    from aot.symexpr import compile_expr

    try:
        expr = compile_expr(rel.expr)
    except BundleError:
        return ""
    by_name = {g.name: g for g in symbols}
    names = sorted(expr.symbols)
    if not names or any(n not in by_name for n in names):
        return ""
    spans = [by_name[n].max - by_name[n].min + 1 for n in names]
    if math.prod(spans) > MAX_NOTE_COMBINATIONS:
        return f"relation {rel.expr}: may refuse declared sizes (too many combinations to count here)"
    values = [[v for v in range(by_name[n].min, by_name[n].max + 1) if admits(by_name[n], v)] for n in names]
    refused = [c for c in itertools.product(*values) if not expr(dict(zip(names, c)))]
    if not refused:
        return ""
    shown = "; ".join(", ".join(f"{n}={v}" for n, v in zip(names, c)) for c in refused[:3])
    return (
        f"relation {rel.expr} refuses {len(refused)} of {math.prod(map(len, values))} combinations of "
        f"{', '.join(names)} that the symbols admit, e.g. {shown}{'; ...' if len(refused) > 3 else ''}"
    )


def render_manifest(m: GuardManifest, notes: bool = True) -> str:
    """The manifest text of ``m`` (canonicalized first). ``notes``: under each symbol, a comment
    line with the build's row-independence finding (``rows_note``); comments are not part of the
    contract, so ``aotpack check`` compares the text without them."""
    found = {g.name: rows_note(g) for g in m.guards.symbols} if notes else {}
    m = canonical(m)
    lines = [f"model {_one_line(m.name)}"]
    if m.dtype:
        lines.append(f"dtype {m.dtype}")
    lines.append("")
    for inp in m.guards.inputs:
        kind = "state" if inp.state else "input"
        lines.append(f"{kind} {inp.name}: {inp.dtype}[{', '.join(inp.shape)}]")
    if m.guards.symbols or m.guards.relations or m.guards.specializations:
        lines.append("")
    for sym in m.guards.symbols:
        lines.append(
            f"symbol {sym.name}: {admissible_text(sym)}  (declared {sym.declared_min}..{sym.declared_max}"
            + (f" multiple_of {sym.declared_multiple})" if sym.declared_multiple > 1 else ")")
        )
        for src in sym.sources:
            lines.append(f"  guard {_one_line(src.text)}  {site_text(src)}")
        if found.get(sym.name):
            lines.append(f"# {_one_line(found[sym.name])}")
    for rel in m.guards.relations:
        lines.append(f"relation {_one_line(rel.expr)}  {site_text(rel.source)}")
        if notes and (refused := relation_note(rel, m.guards.symbols)):
            lines.append(f"# {_one_line(refused)}")
    for spec in m.guards.specializations:
        lines.append(f"specialized {_one_line(spec.text)}  {site_text(spec)}")
    if m.buckets:
        lines.append("")
        for b in m.buckets:
            pad = "  paddable" if b.paddable else ""
            lines.append(f"bucket {b.symbol}: {', '.join(map(str, b.sizes))}{pad}")
    if m.programs or m.entry_points:
        lines.append("")
        lines += [f"entry {e}" for e in m.entry_points]
        lines += [f"program {p}" for p in m.programs]
    env = m.environment
    lines += [
        "",
        f"env schema {m.schema_version[0]}.{m.schema_version[1]}",
        f"env archs {', '.join(env.archs) if env.archs else CPU_ONLY}",
        f"env torch >= {env.torch_min}",
    ]
    return HEADER + "\n".join(map(printable, lines)) + "\n"


# ---------------------------------------------------------------------------------------------
# Parsing: the text back into a GuardManifest.

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_INT = r"-?[0-9]{1,19}"
_SITE = r"  at (?P<file>.+?):(?P<line>[0-9]{1,9})(?:  (?P<code>.*))?$"
_LINES = {
    "model": re.compile(r"^model (?P<name>.+)$"),
    "dtype": re.compile(rf"^dtype (?P<dtype>{_IDENT})$"),
    "input": re.compile(
        rf"^(?P<kind>input|state) (?P<name>{_IDENT}(?:\.[A-Za-z0-9_]+)*): (?P<dtype>{_IDENT})\[(?P<shape>[^\]]*)\]$"
    ),
    "symbol": re.compile(
        rf"^symbol (?P<name>{_IDENT}): (?P<set>.+)  \(declared (?P<lo>{_INT})\.\.(?P<hi>{_INT})"
        rf"(?: multiple_of (?P<multiple>{_INT}))?\)$"
    ),
    "guard": re.compile(r"^  guard (?P<text>.+?)" + _SITE),
    "relation": re.compile(r"^relation (?P<text>.+?)" + _SITE),
    "specialized": re.compile(r"^specialized (?P<text>.+?)" + _SITE),
    "bucket": re.compile(
        rf"^bucket (?P<name>{_IDENT}): (?P<sizes>[0-9]{{1,19}}(?:, [0-9]{{1,19}})*)(?P<pad>  paddable)?$"
    ),
    "entry": re.compile(rf"^entry (?P<name>{_IDENT})$"),
    "program": re.compile(r"^program (?P<text>.+  admits  .+)$"),
    "schema": re.compile(r"^env schema (?P<major>[0-9]{1,6})\.(?P<minor>[0-9]{1,6})$"),
    "archs": re.compile(r"^env archs (?P<archs>.+)$"),
    "torch": re.compile(r"^env torch >= (?P<version>\S+)$"),
}
_RANGE = re.compile(rf"^(?P<lo>{_INT}) <= (?P<name>{_IDENT}) <= (?P<hi>{_INT})$")
_RESIDUE = re.compile(rf"^(?P<name>{_IDENT}) % (?P<m>[0-9]{{1,9}}) == (?P<r>[0-9]{{1,9}})$")
_EXCLUDED = re.compile(rf"^(?P<name>{_IDENT}) != (?P<v>{_INT})$")
_EXPECTED = (
    "one of: model NAME | dtype DTYPE | input NAME: DTYPE[dims] | state NAME: DTYPE[dims] | "
    "symbol NAME: SET  (declared A..B[ multiple_of M]) | "
    "  guard TEXT  at FILE:LINE  CODE | relation ... | specialized ... | bucket SYM: sizes | "
    "entry NAME | program NAME  admits  SETS | env schema/archs/torch"
)


class _Parser:
    def __init__(self, source: str):
        self.source = source
        self.lineno = 0

    def fail(self, expected: str, got: str) -> BundleError:
        return BundleError(
            f"{self.source} line {self.lineno}: expected {expected}, got {got[:120]!r}; "
            f"regenerate the file with `aotpack guards MODEL.py -o FILE`"
        )

    def int(self, text: str, what: str) -> int:
        value = int(text)
        if abs(value) > MAX_SIZE:
            raise self.fail(f"{what} within ±2**62", text)
        return value

    def symbol(self, m: re.Match) -> SymbolGuard:
        name = m["name"]
        parts = m["set"].split(", ")
        rng = _RANGE.match(parts[0])
        if not rng or rng["name"] != name:
            raise self.fail(f"an admissible set starting `LO <= {name} <= HI`", m["set"])
        modulus, residues, excluded = 1, (0,), []
        for part in parts[1:]:
            ex = _EXCLUDED.match(part)
            if ex and ex["name"] == name:
                excluded.append(self.int(ex["v"], "an excluded size"))
                continue
            terms = part[1:-1].split(" or ") if part.startswith("(") and part.endswith(")") else [part]
            found = [_RESIDUE.match(t) for t in terms]
            if modulus != 1 or excluded or not all(f and f["name"] == name for f in found):
                raise self.fail(f"`{name} % M == R`, `({name} % M == R or ...)` or `{name} != V`", part)
            moduli = {int(f["m"]) for f in found}
            modulus = moduli.pop()
            residues = tuple(sorted({int(f["r"]) for f in found}))
            if moduli or not 2 <= modulus <= MAX_MODULUS or residues[-1] >= modulus:
                raise self.fail(f"one modulus in 2..{MAX_MODULUS} with residues below it", part)
        if len(excluded) > MAX_EXCLUDED:
            raise self.fail(f"at most {MAX_EXCLUDED} excluded sizes", f"{len(excluded)}")
        lo, hi = self.int(rng["lo"], "a size"), self.int(rng["hi"], "a size")
        dlo, dhi = self.int(m["lo"], "a size"), self.int(m["hi"], "a size")
        if not (lo <= hi and dlo <= dhi):
            raise self.fail("ranges with LO <= HI", m["set"])
        multiple = self.int(m["multiple"], "a multiple") if m["multiple"] else 0
        if m["multiple"] and multiple < 2:
            raise self.fail("multiple_of 2 or more", m["multiple"])
        return SymbolGuard(
            name=name,
            declared_min=dlo,
            declared_max=dhi,
            min=lo,
            max=hi,
            modulus=modulus,
            residues=residues,
            excluded=tuple(sorted(excluded)),
            declared_multiple=multiple,
        )

    def source_of(self, m: re.Match) -> GuardSource:
        return GuardSource(text=m["text"], file=m["file"], line=int(m["line"]), code=m["code"] or "")


_SET_ITEM = re.compile(
    rf"^(?:(?P<fixed>{_IDENT}) == (?P<v>[0-9]{{1,19}})|-?[0-9]{{1,19}} <= (?P<name>{_IDENT}) <= .+)$"
)


def program_sets(line: str) -> dict[str, SymbolGuard] | None:
    """What a ``program`` line admits, per symbol (``seq == 1; 1 <= batch <= 4``), or None when a
    part is not a symbol's set (a relation, ``its static sizes``)."""
    _, _, what = line.partition("  admits  ")
    parts = [p.strip() for p in what.split("; ")]
    out: dict[str, SymbolGuard] = {}
    p = _Parser("<program line>")
    for part in parts:
        m = _SET_ITEM.match(part)
        if m is None:
            return None
        if m["fixed"]:
            v = int(m["v"])
            out[m["fixed"]] = SymbolGuard(name=m["fixed"], declared_min=v, declared_max=v, min=v, max=v)
            continue
        rng = _RANGE.match(part.split(", ")[0])
        if rng is None:
            return None
        fake = re.match(
            r"^(?P<name>\S+) (?P<set>.+) (?P<lo>\S+) (?P<hi>\S+)(?P<multiple>)$",  # a program's sets declare no multiple
            f"{m['name']} {part} {rng['lo']} {rng['hi']}",
        )
        try:
            out[m["name"]] = p.symbol(fake)
        except BundleError:
            return None
    return out


def parse_guards_text(text: str, source: str = "<manifest>") -> GuardManifest:
    """Parse manifest text (as ``render_manifest`` writes it) back into a ``GuardManifest``.

    Raises ``BundleError`` naming the line that does not parse and what was expected there."""
    p = _Parser(source)
    name = dtype = None
    inputs: list[InputGuard] = []
    symbols: list[SymbolGuard] = []
    sources: dict[str, list[GuardSource]] = {}
    relations: list[Relation] = []
    specializations: list[GuardSource] = []
    buckets: list[Bucket] = []
    programs: list[str] = []
    entry_points: list[str] = []
    schema_version = archs = torch_min = None
    for p.lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        kind, m = next(((k, m) for k, rx in _LINES.items() if (m := rx.match(line))), (None, None))
        if m is None:
            raise p.fail(_EXPECTED, line)
        if kind == "model":
            name = m["name"]
        elif kind == "dtype":
            dtype = m["dtype"]
        elif kind == "input":
            shape = tuple(s.strip() for s in m["shape"].split(",")) if m["shape"].strip() else ()
            if any(not re.fullmatch(rf"[0-9]{{1,19}}|{_IDENT}", s) for s in shape):
                raise p.fail("input dims that are sizes or symbol names, separated by `, `", line)
            inputs.append(
                InputGuard(name=m["name"], dtype=m["dtype"], shape=shape, state=m["kind"] == "state")
            )
        elif kind == "symbol":
            symbols.append(p.symbol(m))
            sources[symbols[-1].name] = []
        elif kind == "guard":
            if not symbols:
                raise p.fail("a `symbol` line before its `  guard` lines", line)
            sources[symbols[-1].name].append(p.source_of(m))
        elif kind == "relation":
            src = p.source_of(m)
            relations.append(Relation(expr=src.text, source=src))
        elif kind == "specialized":
            specializations.append(p.source_of(m))
        elif kind == "bucket":
            sizes = tuple(p.int(s, "a bucket size") for s in m["sizes"].split(", "))
            buckets.append(Bucket(symbol=m["name"], sizes=sizes, paddable=bool(m["pad"])))
        elif kind == "entry":
            entry_points.append(m["name"])
        elif kind == "program":
            programs.append(m["text"])
        elif kind == "schema":
            schema_version = (int(m["major"]), int(m["minor"]))
        elif kind == "archs":
            archs = () if m["archs"] == CPU_ONLY else tuple(a.strip() for a in m["archs"].split(","))
        elif kind == "torch":
            torch_min = m["version"]
    p.lineno = len(text.splitlines())
    missing = [
        what
        for what, v in (
            ("model NAME", name),
            ("env schema", schema_version),
            ("env archs", archs),
            ("env torch", torch_min),
        )
        if v is None
    ]
    if missing or not inputs:
        raise p.fail("a complete manifest", f"no {', '.join(missing or ['input'])} line")
    _check_names(p, inputs, symbols, buckets, tuple(entry_points))
    guards = Guards(
        inputs=tuple(inputs),
        symbols=tuple(replace(s, sources=tuple(sources[s.name])) for s in symbols),
        relations=tuple(relations),
        specializations=tuple(specializations),
    )
    env = Environment(archs=archs, torch_built="", torch_min=torch_min, triton_built="", python_built="")
    return canonical(
        GuardManifest(
            name=name,
            guards=guards,
            environment=env,
            buckets=tuple(buckets),
            schema_version=schema_version,
            dtype=dtype or "",
            programs=tuple(programs),
            entry_points=tuple(entry_points),
        )
    )


def _check_names(
    p: _Parser,
    inputs: list[InputGuard],
    symbols: list[SymbolGuard],
    buckets: list[Bucket],
    entry_points: tuple[str, ...] = (),
) -> None:
    declared = {s.name for s in symbols}
    for kind, names in (
        ("input", [i.name for i in inputs]),
        ("entry", list(entry_points)),
        ("symbol", [s.name for s in symbols]),
        ("bucket", [b.symbol for b in buckets]),
    ):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise p.fail(f"each {kind} once", f"{dup[0]} more than once")
    used = {d for i in inputs for d in i.shape if static_size(d) is None}
    for sym in sorted(used - declared):
        raise p.fail("a `symbol` line for every symbol the inputs use", f"no symbol {sym}")
    for sym in sorted({b.symbol for b in buckets} - declared):
        raise p.fail("buckets only for declared symbols", f"bucket {sym}")
