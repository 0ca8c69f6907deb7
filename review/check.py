"""``aotpack check``: is a committed guard manifest still what the model traces to now?

Stale means the manifest text differs, whatever the change; the report classifies the changes
(``verdict``) and shows the text diff, and says how to regenerate the file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from aot.manifest_text import render_manifest
from aot.review.side import diff
from aot.review.verdict import EXIT_BREAKING, EXIT_SAME, Diff, Side


@dataclass(frozen=True)
class StaleCheck:
    model: str
    against: str
    result: Diff
    before: str  # the committed manifest text
    after: str  # the manifest text the model traces to now

    @property
    def stale(self) -> bool:
        return self.before != self.after or bool(self.result.changes)

    @property
    def exit_code(self) -> int:
        return EXIT_BREAKING if self.stale else EXIT_SAME

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "against": self.against,
            "stale": self.stale,
            "exit_code": self.exit_code,
            "verdict": self.result.verdict,
            "changes": self.result.to_json()["changes"],
        }

    def report(self) -> str:
        """The classified changes, then the unified diff of the manifest text."""
        if not self.stale:
            return f"{self.against} matches {self.model}\n"
        head = (
            self.result.text(self.exit_code)
            if self.result.changes
            else "no change in the guards; the manifest text differs\n"
        )
        text = "".join(
            difflib.unified_diff(
                self.before.splitlines(keepends=True),
                self.after.splitlines(keepends=True),
                fromfile=self.against,
                tofile=f"{self.model} (traced now)",
            )
        )
        return head + "\n" + text

    def advice(self) -> str:
        """The one-line error of a stale manifest, with the command that fixes it."""
        kind = {"breaking": "with breaking changes", "safe": "safe changes only"}.get(
            self.result.verdict, "text only"
        )
        if self.against.endswith(".tpk"):  # never suggest writing manifest text over a bundle
            fix = f"rebuild it with `aotpack build {self.model} -o {self.against}`"
        else:
            fix = f"regenerate it with `aotpack guards {self.model} -o {self.against}`"
        return f"error: {self.against} is stale ({kind}); {fix} and review the change"


def check_manifest(model: str, against: str, committed: Side, current: Side) -> StaleCheck:
    """Compare the committed side (manifest file or bundle) with the model traced now."""
    return StaleCheck(
        model,
        against,
        diff(committed, current),
        render_manifest(committed.manifest, notes=False),
        render_manifest(current.manifest, notes=False),
    )
