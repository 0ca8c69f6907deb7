"""Signing a bundle: ``aotpack sign BUNDLE --key KEY``.

The bundle is rewritten with a signature member (``schema.SIGNATURE_PATH``) over the exact bytes of
its manifest, replacing an earlier signature, atomically. Every other member is written as the
packager writes it, so the archive stays byte-for-byte deterministic: the same bundle signed with
the same key (Ed25519 signatures are deterministic) gives the same bytes, and its members are the
unsigned bundle's. Only a bundle whose members match its manifest's checksums is signed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

from aot import schema, serde, signing
from aot.errors import BundleError, EnvError
from aot.packager import write_archive
from aot.schema import Manifest
from aot.signing import Signature


def _members(path: Path) -> tuple[bytes, dict[str, bytes]]:
    """The manifest's bytes and every other member (an earlier signature left out)."""
    try:
        with zipfile.ZipFile(path) as zf:
            manifest = zf.read(schema.MANIFEST_PATH)
            members = {
                i.filename: zf.read(i)
                for i in zf.infolist()
                if i.filename not in (schema.MANIFEST_PATH, schema.SIGNATURE_PATH)
            }
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise BundleError(f"{path}: not a readable bundle ({type(e).__name__}: {e})") from None
    return manifest, members


def _check_checksums(path: Path, manifest: Manifest, members: dict[str, bytes]) -> None:
    external = {schema.WEIGHTS_PATH} if manifest.external_weights else set()
    if set(members) != set(manifest.members) - external:
        raise BundleError(f"{path}: its members do not match its manifest; rebuild it before signing")
    for name, data in members.items():
        if hashlib.sha256(data).hexdigest() != manifest.members[name].sha256:
            raise BundleError(f"{path}: checksum mismatch in {name!r}; rebuild the bundle before signing")


def sign_bundle(path: str | os.PathLike, key: str | os.PathLike) -> Signature:
    """Sign the bundle at ``path`` with the private key file ``key``; returns the signature."""
    path = Path(path)
    private_key = signing.read_private_key(key)
    manifest_bytes, members = _members(path)
    try:
        data = serde.upgrade_manifest(json.loads(manifest_bytes))
    except (ValueError, AttributeError):
        raise BundleError(f"{path}: its manifest is not JSON; not a bundle") from None
    _check_checksums(path, serde.from_json(Manifest, data, "manifest"), members)
    sig = signing.sign(private_key, manifest_bytes)
    try:
        write_archive(path, manifest_bytes, {**members, schema.SIGNATURE_PATH: signing.encode(sig)})
    except OSError as e:  # the bundle as it was stays in place
        raise EnvError(f"cannot write the signed bundle to {path}: {e.strerror or e}") from None
    return sig
