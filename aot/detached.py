"""The trust check of a bundle's detached OpenSSF Model Signing signature, ``BUNDLE.sig``
(``aot.oms``): what ``aotpack sign`` writes beside a bundle and ``model_signing sign key`` writes
over a ``.tpk`` (and its split weights file).

Such a signature covers the ``.tpk``'s bytes, so the whole archive is hashed, once, through the
file object the zip reader reads every member from, and the manifest's bytes are kept from that
same pass: the loader parses those bytes, never a second read, and every other member is checked
against the checksums they pin. A split weights file is covered through the manifest too: the
signature must list it with the sha256 the manifest records, which the loader checks on read.
Whether a trusted key made the signature is decided first, from the signature file alone, so a
foreign or forged one is refused before the archive is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import zipfile
import zlib
from pathlib import Path

from aot import oms, schema, signing
from aot.archive import MAX_MANIFEST_BYTES
from aot.errors import SignatureError

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then (at 26) name and extra lengths
_CHUNK = 1 << 20


def read_detached(path: Path) -> bytes | None:
    """``BUNDLE.sig``'s bytes (at most ``oms.MAX_SIGNATURE_BYTES``); None when there is none."""
    target = oms.signature_path(path)
    try:
        # O_NONBLOCK: a FIFO named like it must not block the load
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SignatureError(f"{target}: the bundle's signature is unreadable ({e.strerror})") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SignatureError(
                f"{target}: not a regular file; a bundle's signature is the plain file `aotpack sign` wrote"
            )
        data = f.read(oms.MAX_SIGNATURE_BYTES + 1)
    if len(data) > oms.MAX_SIGNATURE_BYTES:
        raise SignatureError(
            f"{target}: more than {oms.MAX_SIGNATURE_BYTES} bytes; not a signature of one bundle"
        )
    return data


def check_detached(zf: zipfile.ZipFile, path: Path, data: bytes, trusted: tuple[bytes, ...]) -> bytes:
    """Refuse the bundle unless ``data`` (its ``BUNDLE.sig``) is a trusted key's signature of the
    archive as ``zf`` reads it; returns the manifest's bytes from the pass that was verified."""
    where = str(oms.signature_path(path))
    sig = oms.decode(data, where)
    key = sig.signer(trusted)
    if key is None:
        keys = ", ".join(signing.fingerprint(k) for k in trusted)
        raise SignatureError(
            f"{path}: signed by {sig.signer_name}, which is not a trusted key ({keys}); trust its public "
            f"key (--trust / AOTPACK_TRUST) or re-sign the bundle with a trusted key"
        )
    if not oms.verifies(key, sig):  # before the archive is read: a key's hint is public
        raise _changed(path, key, where)
    digest, manifest = _hash_archive(zf, path)
    if oms.mismatches(sig, {path.name: digest}, path.name):
        raise _changed(path, key, path.name)
    weights = _external_weights(manifest)  # parsed once the bytes are known to be signed
    if weights and oms.mismatches(sig, dict([weights])):
        raise _changed(path, key, weights[0])
    return manifest


def _changed(path: Path, key: bytes, what: str) -> SignatureError:
    return SignatureError(
        f"{path}: its signature by {signing.fingerprint(key)} does not match {what}: the bundle was "
        f"changed after signing; rebuild and re-sign it, or re-copy the signed original"
    )


def _hash_archive(zf: zipfile.ZipFile, path: Path) -> tuple[str, bytes]:
    """The sha256 of the archive's bytes and its manifest's bytes, both from one read through
    ``zf``'s own file object."""
    infos = [i for i in zf.infolist() if i.filename == schema.MANIFEST_PATH]
    if len(infos) != 1:
        raise SignatureError(
            f"{path}: {len(infos)} {schema.MANIFEST_PATH} members; not a bundle aotpack wrote"
        )
    info = infos[0]
    if info.file_size > MAX_MANIFEST_BYTES or info.compress_size > MAX_MANIFEST_BYTES:
        raise SignatureError(f"{path}: manifest is {info.file_size} bytes (limit {MAX_MANIFEST_BYTES})")
    # the member's local header, name, extra field (at most 2 x 64 KiB) and data
    start, end = info.header_offset, info.header_offset + _LOCAL_HEADER.size + (2 << 16) + info.compress_size
    h, kept, position = hashlib.sha256(), bytearray(), 0
    f = zf.fp
    f.seek(0)
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        lo, hi = max(position, start), min(position + len(chunk), end)
        if lo < hi:
            kept += chunk[lo - position : hi - position]
        position += len(chunk)
    return h.hexdigest(), _member_bytes(bytes(kept), info, path)


def _member_bytes(region: bytes, info: zipfile.ZipInfo, path: Path) -> bytes:
    """A member's content from the archive bytes at its local header, checked as zipfile checks it."""
    header = region[: _LOCAL_HEADER.size]
    raw = b""
    if len(header) == _LOCAL_HEADER.size:
        magic, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        name = region[_LOCAL_HEADER.size : _LOCAL_HEADER.size + name_length]
        at = _LOCAL_HEADER.size + name_length + extra_length
        data = region[at : at + info.compress_size]
        if (
            magic == zipfile.stringFileHeader
            and name == info.filename.encode()
            and len(data) == info.compress_size
        ):
            try:
                if info.compress_type == zipfile.ZIP_STORED:
                    raw = data
                elif info.compress_type == zipfile.ZIP_DEFLATED:
                    raw = zlib.decompressobj(-zlib.MAX_WBITS).decompress(data, info.file_size + 1)
            except zlib.error:
                raw = b""
    if len(raw) != info.file_size or zlib.crc32(raw) != info.CRC or not raw:
        raise SignatureError(f"{path}: member {info.filename} is unreadable; not a bundle aotpack wrote")
    return raw


def _external_weights(manifest: bytes) -> tuple[str, str] | None:
    """(file name, sha256) of the split weights file the manifest names; None when it has none."""
    try:
        data = json.loads(manifest)
        name, digest = data.get("external_weights"), data["members"][schema.WEIGHTS_PATH]["sha256"]
    except (ValueError, RecursionError, AttributeError, KeyError, TypeError):
        return None  # not a manifest: the loader refuses it next, by its own checks
    return (name, digest) if name and isinstance(name, str) and isinstance(digest, str) else None
