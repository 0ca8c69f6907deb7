"""The CUDA-graph buckets of a bundle, written once: which belong to which program, their size
combinations, what a bucket list must be to load, and the bundle-wide buckets of several programs.

A bundle of one program keeps its buckets in ``Manifest.buckets``; a bundle of several keeps each
program's in its ``ProgramEntry`` (``Manifest.buckets`` is then the contract's, for review).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace

from aot.admissible import admissible_text, admits
from aot.errors import BundleError
from aot.schema import Bucket, Guards, Manifest, Program

MAX_BUCKETS = 1024  # CUDA-graph sizes per symbol


def program_buckets(manifest: Manifest, index: int) -> tuple[Bucket, ...]:
    """The buckets the graphs of program ``index`` (0: the general one) serve."""
    return manifest.programs[index].buckets if manifest.programs else manifest.buckets


def buckets_by_program(manifest: Manifest) -> list[tuple[Bucket, ...]]:
    """``program_buckets`` of every program, in program order."""
    return [e.buckets for e in manifest.programs] if manifest.programs else [manifest.buckets]


def bucket_sizes(program: Program, buckets: Sequence[Bucket]) -> list[dict[str, int]]:
    """Every bucket combination of ``program`` (the CUDA-graph keys), as symbol → size in the
    program's symbol order, the last symbol varying fastest; [] where a symbol has no bucket."""
    by_symbol = {b.symbol: b.sizes for b in buckets}
    symbols = list(dict.fromkeys(s.symbol for s in program.symbols))
    if any(s not in by_symbol for s in symbols):
        return []
    return [dict(zip(symbols, combo)) for combo in itertools.product(*(by_symbol[s] for s in symbols))]


def largest_first(sizes: Mapping[str, int]) -> list[int]:
    """Sort key: the bucket with the largest first size first (captures share one pool, so the
    largest goes first)."""
    return [-v for v in sizes.values()]


def is_bucket(sizes: Mapping[str, int], program: Program, buckets: Sequence[Bucket]) -> bool:
    """Whether ``sizes`` names exactly the program's symbols, each at one of its bucket sizes."""
    symbols = [s.symbol for s in program.symbols]
    by_symbol = {b.symbol: b.sizes for b in buckets}
    return set(sizes) == set(symbols) and all(sizes[s] in by_symbol.get(s, ()) for s in symbols)


def check_buckets(buckets: Sequence[Bucket], guards: Guards, where: str) -> None:
    """Bucket sizes are sizes the guards admit, ascending, for distinct symbols of the guards;
    else a ``BundleError`` that starts with ``where``."""
    symbols = {g.name: g for g in guards.symbols}
    seen: set[str] = set()
    for b in buckets:
        g = symbols.get(b.symbol)
        if g is None or b.symbol in seen:
            raise BundleError(
                f"{where}: bucket for {b.symbol[:40]!r}, which is not a symbol of the guards or repeats"
            )
        seen.add(b.symbol)
        sizes = list(b.sizes)
        if (
            not 1 <= len(sizes) <= MAX_BUCKETS
            or sizes != sorted(set(sizes))
            or not all(admits(g, v) for v in sizes)
        ):
            raise BundleError(
                f"{where}: buckets of {b.symbol!r} must be 1..{MAX_BUCKETS} ascending sizes its guards "
                f"admit ({admissible_text(g)}), got {sizes[:8]}"
            )


def contract_buckets(
    declared: Sequence[Bucket], programs: Sequence[tuple[str, Sequence[Bucket]]]
) -> tuple[Bucket, ...]:
    """The bundle-wide buckets of several programs: ``declared`` (the model file's, over the whole
    contract), each paddable only where every program (name, its buckets) that has the symbol
    checked its padding; a refusal is kept as the first program's that refused it."""
    out = []
    for bucket in declared:
        if bucket.paddable:
            own = [(name, b) for name, bs in programs for b in bs if b.symbol == bucket.symbol]
            refused = [(name, b) for name, b in own if not b.paddable]
            if refused:
                name, b = refused[0]
                why = b.pad_check.removeprefix("refused: ") or "not checked"
                bucket = replace(bucket, paddable=False, pad_check=f"refused: {why} (program {name})")
            elif own:
                bucket = replace(bucket, pad_check=own[0][1].pad_check)
        out.append(bucket)
    return tuple(out)
