"""The trust check: with a trust list, a bundle loads only when it carries a signature of its exact
``manifest.json`` bytes by one of the trusted keys, or when its detached OpenSSF Model Signing
signature ``BUNDLE.sig`` by one of them covers its bytes (``aot.loader.detached``).

It runs right after the zip directory is read and before anything else of the bundle is parsed:
it reads the manifest's bytes and the signature member only (bounded), so an unsigned, foreign or
tampered bundle is refused before its manifest, program or weights reach a parser. Since the
manifest pins every member's sha256, the checksum checks that follow extend the signature to the
whole bundle.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

from aot import schema, signing
from aot.errors import SignatureError
from aot.loader.bundle import MAX_MANIFEST_BYTES
from aot.loader.detached import check_detached, read_detached
from aot.signing import Signature

TRUST_ENV = "AOTPACK_TRUST"  # os.pathsep-separated public key files, for a whole server


def trusted_keys(trust: Sequence[str | os.PathLike] | None) -> tuple[bytes, ...]:
    """The raw public keys of ``trust`` (key files), or of ``$AOTPACK_TRUST`` when ``trust`` is None;
    empty when neither names a key (then bundles are not checked)."""
    if trust is None:
        trust = [p for p in os.environ.get(TRUST_ENV, "").split(os.pathsep) if p.strip()]
    return tuple(signing.read_public_key(p) for p in trust)


def _member(zf: zipfile.ZipFile, name: str, limit: int, path: Path) -> bytes | None:
    """A member's bytes, at most ``limit`` of them; None when absent."""
    infos = [i for i in zf.infolist() if i.filename == name]
    if not infos:
        return None
    info = infos[0]
    if len(infos) > 1:
        raise SignatureError(f"{path}: member {name} appears {len(infos)} times; not a bundle aotpack wrote")
    if info.file_size > limit:
        raise SignatureError(f"{path}: member {name} is {info.file_size} bytes (limit {limit})")
    if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise SignatureError(
            f"{path}: member {name} is encrypted or oddly compressed; bundles are stored or deflated"
        )
    try:
        with zf.open(info) as f:
            data = f.read(limit + 1)
    except Exception as e:  # zlib.error, BadZipFile (CRC), EOFError, OSError ...
        raise SignatureError(f"{path}: member {name} is unreadable: {type(e).__name__}") from None
    if len(data) > limit:
        raise SignatureError(f"{path}: member {name} holds more than its {info.file_size} bytes")
    return data


def _signature(zf: zipfile.ZipFile, path: Path) -> Signature | None:
    data = _member(zf, schema.SIGNATURE_PATH, signing.MAX_SIGNATURE_BYTES, path)
    return None if data is None else signing.decode(data, str(path))


def _manifest(zf: zipfile.ZipFile, path: Path) -> bytes:
    return _member(zf, schema.MANIFEST_PATH, MAX_MANIFEST_BYTES, path) or b""


def read_signature(zf: zipfile.ZipFile, path: Path) -> tuple[Signature, bytes] | None:
    """The bundle's signature and the manifest bytes it is meant to sign; None when unsigned."""
    sig = _signature(zf, path)
    return None if sig is None else (sig, _manifest(zf, path))


def check_signature(zf: zipfile.ZipFile, path: Path, trusted: tuple[bytes, ...]) -> bytes:
    """Refuse the bundle unless one of the ``trusted`` keys signed its manifest (the signature
    member) or its bytes (``BUNDLE.sig``); returns the manifest's bytes that were verified, for
    the loader to parse. When neither holds, the member's reason is given where there is one."""
    keys = ", ".join(signing.fingerprint(k) for k in trusted)
    member_error = None
    sig = _signature(zf, path)
    if sig is not None:
        try:
            return _check_member(zf, path, sig, trusted, keys)
        except SignatureError as e:
            member_error = e
    try:
        detached = read_detached(path)  # read only when needed: a valid member never depends on it
        if detached is not None:
            return check_detached(zf, path, detached, trusted)
    except SignatureError:
        if member_error is None:
            raise
    if member_error is not None:
        raise member_error
    raise SignatureError(
        f"{path}: the bundle is not signed, and this loader trusts only bundles signed by {keys}; "
        f"sign it with `aotpack sign {path} --key KEY`"
    )


def _check_member(
    zf: zipfile.ZipFile, path: Path, sig: Signature, trusted: tuple[bytes, ...], keys: str
) -> bytes:
    if sig.public_key not in trusted:
        raise SignatureError(
            f"{path}: signed by {sig.fingerprint}, which is not a trusted key ({keys}); trust its public "
            f"key (--trust / {TRUST_ENV}) or re-sign the bundle with a trusted key"
        )
    manifest = _manifest(zf, path)
    if not signing.verifies(sig.public_key, sig, manifest):
        raise SignatureError(
            f"{path}: its signature by {sig.fingerprint} does not match its manifest: the bundle was "
            f"changed after signing; rebuild and re-sign it, or re-copy the signed original"
        )
    return manifest
