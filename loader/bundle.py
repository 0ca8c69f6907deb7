"""Open a ``.tpk`` and verify it before anything in it is used.

Every member's name is checked against the schema's layout, its size against the manifest and the
zip directory, and its sha256 before it is parsed. Reads are bounded by the sizes the manifest
declares, so a zip bomb or a lying directory ends in a ``BundleError``, not an allocation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from aot import schema
from aot.errors import BundleError
from aot.schema import Manifest, Program, from_json

MAX_MEMBERS = 4096
MAX_MANIFEST_BYTES = 16 << 20
MAX_PROGRAM_BYTES = 512 << 20
MAX_INFLATION = 200  # uncompressed / compressed ratio beyond which a member is a zip bomb
_KERNEL_MEMBER = re.compile(r"^kernels/[a-z0-9_]{1,80}\.(py|sm_[0-9]{2,3}a?\.cubin)$")
_EXTERNAL_WEIGHTS = re.compile(r"^[A-Za-z0-9_.-]{1,200}\.safetensors$")
_FIXED_MEMBERS = {
    schema.MANIFEST_PATH,
    schema.PROGRAM_PATH,
    schema.WEIGHTS_PATH,
    schema.REFERENCE_PATH,
    schema.GUARDS_PATH,
}


def _valid_name(name: str) -> bool:
    return name in _FIXED_MEMBERS or bool(_KERNEL_MEMBER.match(name))


@dataclass
class Bundle:
    """An opened, verified bundle. ``read`` returns a member's bytes after checking its sha256."""

    path: Path
    manifest: Manifest
    _zip: zipfile.ZipFile
    _infos: dict[str, zipfile.ZipInfo]

    def has(self, name: str) -> bool:
        return name in self.manifest.members

    def read(self, name: str) -> bytes:
        member = self.manifest.members.get(name)
        if member is None:
            raise BundleError(f"{self.path}: member {name!r} is missing; rebuild the bundle")
        if name == schema.WEIGHTS_PATH and self.manifest.external_weights:
            data = self._read_external(member.size)
        else:
            data = _read_bounded(self._zip, self._infos[name], member.size, self.path)
        if hashlib.sha256(data).hexdigest() != member.sha256:
            raise BundleError(
                f"{self.path}: checksum mismatch in {name!r} (expected sha256 {member.sha256[:16]}…); "
                f"the bundle is corrupt, rebuild or re-copy it"
            )
        return data

    def external_path(self) -> Path:
        name = self.manifest.external_weights
        if not _EXTERNAL_WEIGHTS.match(name):
            raise BundleError(f"{self.path}: external weights name {name[:80]!r} is not a plain .safetensors file name")
        return self.path.with_name(name)

    def _read_external(self, size: int) -> bytes:
        path = self.external_path()
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != size:
                    raise BundleError(
                        f"{path}: {os.fstat(f.fileno()).st_size} bytes, the bundle expects {size}; "
                        f"copy the weights file that was built with this bundle"
                    )
                return f.read(size)
        except OSError as e:
            raise BundleError(f"{self.path}: its weights file {path.name} is unreadable ({e.strerror}); "
                              f"keep it beside the bundle") from None

    def program(self) -> Program:
        import zstandard

        data = self.read(schema.PROGRAM_PATH)
        try:
            size = zstandard.frame_content_size(data)
            if size < 0 or size > MAX_PROGRAM_BYTES:
                raise BundleError(f"{self.path}: program declares {size} bytes (limit {MAX_PROGRAM_BYTES})")
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_PROGRAM_BYTES)
            return from_json(Program, json.loads(raw.decode("utf-8")), "program")
        except BundleError:
            raise
        except (zstandard.ZstdError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise BundleError(f"{self.path}: program is unreadable: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        self._zip.close()


def _read_bounded(zf: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, path: Path) -> bytes:
    try:
        with zf.open(info) as f:
            data = f.read(size + 1)
    except BundleError:
        raise
    except Exception as e:  # zlib.error, BadZipFile (CRC), EOFError, OSError, NotImplementedError ...
        raise BundleError(f"{path}: member {info.filename!r} is unreadable: {type(e).__name__}: {e}") from None
    if len(data) != size:
        raise BundleError(f"{path}: member {info.filename!r} holds {len(data)}+ bytes, the manifest says {size}")
    return data


def open_bundle(path: str | os.PathLike) -> Bundle:
    """Open and verify the directory and manifest of a bundle (members are checked on read)."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"bundle {path} does not exist or is not a file")
    try:
        zf = zipfile.ZipFile(path, "r")
    except Exception as e:
        raise BundleError(f"{path} is not a bundle (not a readable zip archive: {type(e).__name__}: {e})") from None
    try:
        return _verify(path, zf)
    except BaseException:
        zf.close()
        raise


def _verify(path: Path, zf: zipfile.ZipFile) -> Bundle:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise BundleError(f"{path}: {len(infos)} members (limit {MAX_MEMBERS}); not a bundle")
    by_name: dict[str, zipfile.ZipInfo] = {}
    archive_size = path.stat().st_size
    for info in infos:
        name = info.filename
        if not _valid_name(name):
            raise BundleError(f"{path}: unexpected member {name[:80]!r}; bundles hold only the schema's members")
        if name in by_name:
            raise BundleError(f"{path}: member {name!r} appears twice")
        if info.flag_bits & 0x1:
            raise BundleError(f"{path}: member {name!r} is encrypted")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size > archive_size:
            raise BundleError(f"{path}: member {name!r} claims {info.file_size} bytes, more than the archive")
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_INFLATION * max(info.compress_size, 1) + (1 << 20):
            raise BundleError(f"{path}: member {name!r} inflates {info.compress_size} → {info.file_size} bytes; refusing")
        by_name[name] = info
    if schema.MANIFEST_PATH not in by_name:
        raise BundleError(f"{path}: no {schema.MANIFEST_PATH}; not a bundle or truncated")
    minfo = by_name[schema.MANIFEST_PATH]
    if minfo.file_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: manifest is {minfo.file_size} bytes (limit {MAX_MANIFEST_BYTES})")
    raw = _read_bounded(zf, minfo, minfo.file_size, path)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BundleError(f"{path}: manifest is not valid UTF-8 JSON: {e}") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: manifest is not a JSON object")
    if data.get("format") != schema.FORMAT_NAME:
        raise BundleError(f"{path}: not an aotpack bundle (format {str(data.get('format'))[:40]!r})")
    version = data.get("schema_version")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(type(v) is int for v in version)
    ):
        raise BundleError(f"{path}: manifest has no valid schema_version")
    if version[0] != schema.SCHEMA_VERSION[0]:
        raise BundleError(
            f"{path}: bundle schema {version[0]}.{version[1]} is not readable by this loader "
            f"(schema {schema.SCHEMA_VERSION[0]}.{schema.SCHEMA_VERSION[1]}); rebuild it with this aotpack "
            f"or load it with a matching one"
        )
    if version[1] > schema.SCHEMA_VERSION[1]:
        raise BundleError(
            f"{path}: bundle schema {version[0]}.{version[1]} is newer than this loader's "
            f"{schema.SCHEMA_VERSION[0]}.{schema.SCHEMA_VERSION[1]}; upgrade aotpack"
        )
    manifest = from_json(Manifest, data, "manifest")
    listed = set(manifest.members) - ({schema.WEIGHTS_PATH} if manifest.external_weights else set())
    present = set(by_name) - {schema.MANIFEST_PATH}
    if listed != present:
        missing, extra = sorted(listed - present), sorted(present - listed)
        raise BundleError(f"{path}: members do not match the manifest: missing {missing[:3]}, unlisted {extra[:3]}")
    for name, member in manifest.members.items():
        if name in by_name and by_name[name].file_size != member.size:
            raise BundleError(
                f"{path}: member {name!r} is {by_name[name].file_size} bytes, the manifest says {member.size}"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", member.sha256):
            raise BundleError(f"{path}: member {name!r} has a malformed sha256")
    return Bundle(path=path, manifest=manifest, _zip=zf, _infos=by_name)
