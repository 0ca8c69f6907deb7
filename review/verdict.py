"""What a review concludes: each change classified **breaking** (the new artifact may reject a call
the old one accepted: narrowed, specialized, dtype/rank, inputs added/removed/reordered, a new
relation, an arch dropped, a newer schema or torch required) or **safe** (it cannot: widened,
removed or moved guards, arch added, buckets, kernels, weights), and the report and exit status.

Exit status (``Diff.exit_code``): 0 no change, 1 only safe changes, 2 at least one breaking change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aot.errors import printable
from aot.manifest_text import GuardManifest

EXIT_SAME = 0
EXIT_SAFE = 1
EXIT_BREAKING = 2
EXIT_ERROR = 4  # a side could not be read (3 is the CLI's internal error)


BREAKING_KINDS = (
    "narrowed",
    "specialized",
    "dtype",
    "rank",
    "input added",
    "input removed",
    "input order",
    "state",
    "entry point removed",
    "new relation",
    "arch dropped",
    "schema",
    "torch",
)
SAFE_KINDS = (
    "widened",
    "declared",
    "renamed",
    "new guard",
    "removed guard",
    "moved guard",
    "arch added",
    "model",
    "bucket",
    "kernel",
    "ops",
    "program",
    "state added",
    "state removed",
    "entry point added",
    "weights",
    "toolchain",
)


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


def change(
    kind: str,
    subject: str,
    old: str = "",
    new: str = "",
    details: tuple[str, ...] = (),
    breaking: bool | None = None,
    summary: str = "",
) -> Change:
    if breaking is None:
        assert kind in BREAKING_KINDS or kind in SAFE_KINDS, kind
        breaking = kind in BREAKING_KINDS
    if not summary:
        summary = f"{subject}: {old} -> {new}" if old and new else f"{subject}: {old or new}"
    return Change(
        kind=kind,
        breaking=breaking,
        subject=subject,
        old=old,
        new=new,
        summary=summary,
        details=tuple(details),
    )


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

    def text(self, exit_code: int | None = None) -> str:
        """The human report: one line per change (details indented), then a one-line verdict naming
        ``exit_code`` (the diff's own unless a caller such as ``check`` exits otherwise)."""
        exit_code = self.exit_code if exit_code is None else exit_code
        lines = []
        for c in self.changes:
            lines.append(f"{'BREAKING' if c.breaking else 'safe':<9} {c.kind:<14} {c.summary}")
            lines.extend(f"{'':<24} {d}" for d in c.details)
        n_break = len(self.breaking)
        n_safe = len(self.changes) - n_break
        if not self.changes:
            lines.append(f"no changes (exit {exit_code})")
        else:
            lines.append(
                f"{len(self.changes)} change{'s' if len(self.changes) != 1 else ''}: {n_break} breaking, "
                f"{n_safe} safe (exit {exit_code})"
            )
        return "\n".join(map(printable, lines)) + "\n"  # manifest strings reach a terminal: escaped

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "changes": [{**asdict(c), "details": list(c.details)} for c in self.changes],
        }
