"""The trust check: with a trust list, a bundle loads only when it carries a signature of its exact
``manifest.json`` bytes by one of the trusted keys, or when its detached OpenSSF Model Signing
signature ``BUNDLE.sig`` by one of them covers its bytes (``aot.detached``).

``aot.bundle`` runs it right after the zip directory is read and before anything else of the
bundle is parsed, over the bytes it read of the signature and manifest members: the manifest bytes
checked here are the bytes it then parses, never a second read of the file. Since the manifest pins
every member's sha256, the checksum checks that follow extend the signature to the whole bundle.
This module reads no archive itself.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from aot import signing
from aot.errors import EnvError, SignatureError

TRUST_ENV = "AOTPACK_TRUST"  # os.pathsep-separated public key files, for a whole server


def trusted_keys(trust: Sequence[str | os.PathLike] | None) -> tuple[bytes, ...]:
    """The raw public keys of ``trust`` (key files), or of ``$AOTPACK_TRUST`` when ``trust`` names
    none (None or empty: an empty list never switches off a server's trust list); empty when
    neither names a key (then bundles are not checked against a trust list)."""
    if not trust:
        trust = [p for p in os.environ.get(TRUST_ENV, "").split(os.pathsep) if p.strip()]
    return tuple(signing.read_public_key(p) for p in trust)


def check_signature(
    signature: bytes | None,
    manifest: Callable[[], bytes],
    path: Path,
    trusted: tuple[bytes, ...],
    zf: zipfile.ZipFile | None = None,
) -> bytes | None:
    """Refuse the bundle unless one of the ``trusted`` keys signed its manifest (the signature
    member) or its bytes (the detached OpenSSF Model Signing ``BUNDLE.sig``, ``aot.detached``, read
    through ``zf`` and only when the member does not hold). ``signature``: the signature member's
    bytes (None: unsigned); ``manifest`` gives the manifest's bytes, read only once the signer is
    known to be trusted. Returns None when the member held (the manifest bytes it read are the
    ones to parse), else the manifest bytes of the archive pass the detached signature verified.
    When neither holds, the member's reason is given where there is one."""
    keys = ", ".join(signing.fingerprint(k) for k in trusted)
    member_error = None
    if signature is not None:
        try:
            _check_member(signature, manifest, path, trusted, keys)
            return None
        except SignatureError as e:
            member_error = e
    if zf is not None:
        from aot.detached import check_detached, read_detached  # only for a bundle signed beside it

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
    signature: bytes, manifest: Callable[[], bytes], path: Path, trusted: tuple[bytes, ...], keys: str
) -> None:
    sig = signing.decode(signature, str(path))
    if sig.public_key not in trusted:
        raise SignatureError(
            f"{path}: signed by {sig.fingerprint}, which is not a trusted key ({keys}); trust its public "
            f"key (--trust / {TRUST_ENV}) or re-sign the bundle with a trusted key"
        )
    if not signing.verifies(sig.public_key, sig, manifest()):
        raise SignatureError(
            f"{path}: its signature by {sig.fingerprint} does not match its manifest: the bundle was "
            f"changed after signing; rebuild and re-sign it, or re-copy the signed original"
        )


def signature_problem(signature: bytes, manifest: bytes, path: Path) -> str | None:
    """Without a trust list: why a signed bundle's signature does not hold, for a warning; None
    when it does, or when the cryptography package is not installed to check it."""
    try:
        sig = signing.decode(signature, str(path))
        if signing.verifies(sig.public_key, sig, manifest):
            return None
    except SignatureError as e:
        return str(e)
    except EnvError:
        return None
    return (
        f"{path}: its signature by {sig.fingerprint} does not match its manifest: the bundle was "
        f"changed after signing; loading it anyway (no trust list set: --trust / {TRUST_ENV})"
    )
