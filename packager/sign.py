"""Signing a bundle: ``aotpack sign BUNDLE --key KEY``.

With an Ed25519 key (``aotpack keygen``'s), the bundle is rewritten with a signature member
(``schema.SIGNATURE_PATH``) over the exact bytes of its manifest, replacing an earlier signature,
atomically. Every other member is written as the packager writes it, so the archive stays
byte-for-byte deterministic: the same bundle signed with the same key (Ed25519 signatures are
deterministic) gives the same bytes, and its members are the unsigned bundle's.

With any key, Ed25519 or ECDSA, an OpenSSF Model Signing signature (``aot.oms``) of the ``.tpk``
as written (and of its split weights file) is then written beside it as ``BUNDLE.sig``: the format
``model_signing`` verifies (with an ECDSA key: model_signing 1.1 has no Ed25519) and KServe and
model registries consume. The member travels inside the bundle and is checked before anything is
parsed; the detached file is what other tools read. An ECDSA key writes the detached file only (the
member holds Ed25519 signatures) and leaves the ``.tpk`` as it is.

Only a bundle whose members (and split weights) match its manifest's checksums is signed.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zipfile
from pathlib import Path

from aot import oms, schema, serde, signing
from aot.errors import BundleError, EnvError
from aot.packager import write_archive
from aot.packager.files import write_atomic
from aot.schema import Manifest


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


def sign_bundle(path: str | os.PathLike, key: str | os.PathLike) -> str:
    """Sign the bundle at ``path`` with the private key file ``key``: the signature member (Ed25519
    keys) and ``BUNDLE.sig`` (every key). Returns the key's fingerprint."""
    path = Path(path)
    private_key = signing.read_private_key(key)
    manifest_bytes, members = _members(path)
    try:
        data = serde.upgrade_manifest(json.loads(manifest_bytes))
    except (ValueError, AttributeError):
        raise BundleError(f"{path}: its manifest is not JSON; not a bundle") from None
    manifest = serde.from_json(Manifest, data, "manifest")
    _check_checksums(path, manifest, members)
    if manifest.external_weights:  # checked before anything is written
        weights = path.with_name(manifest.external_weights)
        if _sha256_of(weights, path) != manifest.members[schema.WEIGHTS_PATH].sha256:
            raise BundleError(
                f"{path}: checksum mismatch in its weights file {weights.name}; rebuild the bundle before signing"
            )
    if signing.is_ed25519(private_key):
        sig = signing.sign(private_key, manifest_bytes)
        try:
            write_archive(path, manifest_bytes, {**members, schema.SIGNATURE_PATH: signing.encode(sig)})
        except OSError as e:  # the bundle as it was stays in place
            raise EnvError(f"cannot write the signed bundle to {path}: {e.strerror or e}") from None
    _write_oms_signature(path, manifest, private_key)
    return signing.fingerprint(signing.public_bytes(private_key.public_key()))


def _write_oms_signature(path: Path, manifest: Manifest, private_key) -> None:
    """``BUNDLE.sig``: the bundle as model_signing signs a single file, or with split weights as
    it signs the folder holding the two (the signature file itself left out, as model_signing does)."""
    target = oms.signature_path(path)
    digest = _sha256_of(path, path)
    if manifest.external_weights:  # its digest checked against the manifest's before signing
        files = {path.name: digest, manifest.external_weights: manifest.members[schema.WEIGHTS_PATH].sha256}
        model_name, ignore = path.resolve().parent.name, (*oms.GIT_PATHS, target.name)
    else:
        files, model_name, ignore = {oms.SINGLE_FILE: digest}, path.name, oms.GIT_PATHS
    try:
        write_atomic(target, oms.sign(private_key, model_name, files, ignore))
    except OSError as e:
        raise EnvError(f"cannot write the bundle's signature to {target}: {e.strerror or e}") from None


def _sha256_of(file: Path, bundle: Path) -> str:
    """The sha256 of a regular file's bytes (a FIFO named like it must not block signing)."""
    h = hashlib.sha256()
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BundleError(
                    f"{bundle}: {file.name} is not a regular file; sign the files the build wrote"
                )
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise BundleError(
            f"{bundle}: {file.name} is unreadable ({e.strerror}); keep it beside the bundle"
        ) from None
    return h.hexdigest()
