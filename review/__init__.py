"""Guard-manifest review: ``aotpack guards``, ``diff`` and ``check`` compare two artifacts (bundles,
manifest files or model files) and classify every change by what it means to callers.

The question a reviewer asks is "does the new artifact reject a call the old one accepted?"
(``verdict``); admissible sets are compared exactly (``sets``); manifests (``manifest_changes``)
and bundle contents (``bundle_changes``) each have their own comparison; ``side`` reads an artifact.
"""

from aot.review.bundle_changes import diff_bundles
from aot.review.manifest_changes import diff_manifests
from aot.review.sets import Sizes, difference
from aot.review.side import diff, read_side
from aot.review.verdict import EXIT_BREAKING, EXIT_ERROR, EXIT_SAFE, EXIT_SAME, Change, Diff, Side

__all__ = [
    "Change",
    "Diff",
    "Side",
    "Sizes",
    "diff",
    "diff_manifests",
    "diff_bundles",
    "difference",
    "read_side",
    "EXIT_SAME",
    "EXIT_SAFE",
    "EXIT_BREAKING",
    "EXIT_ERROR",
]
