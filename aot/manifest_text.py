"""The guard manifest as stable, sorted, line-oriented text: what ``aotpack guards`` prints and
what teams commit and review. One fact per line so ``git diff`` shows exactly what changed."""

from __future__ import annotations

from aot.guardtext import admissible_text
from aot.schema import Bucket, Environment, Guards


def guards_text(name: str, guards: Guards, environment: Environment, buckets: tuple[Bucket, ...] = (),
                schema_version: tuple[int, int] = (0, 0)) -> str:
    lines = [
        f"# aotpack guard manifest for {name}",
        "# A call whose inputs fall outside these guards is rejected with GuardError.",
        "",
    ]
    for inp in guards.inputs:
        lines.append(f"input {inp.name}: {inp.dtype}[{', '.join(inp.shape)}]")
    lines.append("")
    for sym in guards.symbols:
        lines.append(f"symbol {sym.name}: {admissible_text(sym)}  (declared {sym.declared_min}..{sym.declared_max})")
        for src in sym.sources:
            lines.append(f"  guard {src.text}  at {src.file}:{src.line}  {src.code}".rstrip())
    for rel in guards.relations:
        src = rel.source
        lines.append(f"relation {rel.expr}  at {src.file}:{src.line}  {src.code}".rstrip())
    for spec in guards.specializations:
        lines.append(f"specialized {spec.text}  at {spec.file}:{spec.line}  {spec.code}".rstrip())
    if buckets:
        lines.append("")
        for b in buckets:
            pad = "  paddable" if b.paddable else ""
            lines.append(f"bucket {b.symbol}: {', '.join(map(str, b.sizes))}{pad}")
    lines += [
        "",
        f"env schema {schema_version[0]}.{schema_version[1]}",
        f"env archs {', '.join(environment.archs) if environment.archs else '(none: CPU only)'}",
        f"env torch >= {environment.torch_min}",
    ]
    return "\n".join(lines) + "\n"
