"""One side of a review: a bundle, a guard-manifest text file, or a model file (traced, nothing
compiled), read into its guard manifest; and ``diff``, which classifies every change between two."""

from __future__ import annotations

import os

from aot.errors import BundleError
from aot.manifest_text import manifest_of_bundle, parse_guards_text
from aot.review.bundle_changes import diff_bundles
from aot.review.manifest_changes import diff_manifests
from aot.review.verdict import Diff, Side

MAX_MANIFEST_FILE = 16 << 20
ZIP_MAGIC = b"PK\x03\x04"


def read_side(path: str, archs: tuple[str, ...] | None = None) -> Side:
    """A bundle (zip), a model file (``.py``, traced for ``archs``) or a manifest text file."""
    if path.endswith(".py"):
        from aot.tracer import guard_manifest, load_model_file

        return Side(path, guard_manifest(load_model_file(path), archs or ("sm_80", "sm_90")))
    if not os.path.isfile(path):
        raise BundleError(
            f"{path} does not exist or is not a file; expected a bundle, a manifest file "
            f"(`aotpack guards MODEL.py -o FILE`) or a model file"
        )
    with open(path, "rb") as f:
        head = f.read(4)
    if head == ZIP_MAGIC:
        from aot.bundle import open_bundle

        bundle = open_bundle(path)
        try:
            bundle.check_weights()  # a review never vouches for a bundle whose weights are corrupt
            return Side(path, manifest_of_bundle(bundle.manifest), bundle_path=path)
        finally:
            bundle.close()
    if os.path.getsize(path) > MAX_MANIFEST_FILE:
        raise BundleError(
            f"{path} is {os.path.getsize(path)} bytes; a manifest file is at most "
            f"{MAX_MANIFEST_FILE} (is it the right file?)"
        )
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
