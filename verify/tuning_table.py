"""The tuning table: ``tuning.json`` as ``aotpack tune`` writes it (sorted, times rounded, no
timestamps) and the bundle rewritten with it as a member."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from aot import schema, serde
from aot.buckets import buckets_by_program
from aot.errors import EnvError
from aot.loader.bundle import open_bundle
from aot.loader.tuning import TUNING_FORMAT, parse_tuning
from aot.schema import Member, TuningCheck, TuningChoice, TuningTable
from aot.verify.tune_rules import MIN_GAIN

TIME_DECIMALS = 2  # microseconds
CHECKS_SCHEMA = (1, 4)  # the schema that brought TuningTable.checks
LIBRARY_FREE_SCHEMA = (1, 6)  # the schema that brought TuningCheck.library_free
WHOLE_PLAN_SCHEMA = (1, 7)  # the schema that brought TuningCheck.whole_plan


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
        parse_tuning(
            data, programs, buckets_by_program(manifest), path
        )  # what tune writes, the loader accepts
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
