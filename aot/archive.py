"""The zip layer of a bundle: the directory's bounds, each member's place in the file, and each
member's bytes, read once.

``check_directory`` reads the end-of-central-directory record before ``zipfile`` parses the
directory, so one too large to parse is refused first; ``check_layout`` checks that no two members
overlap and all lie before the directory. ``Members`` reads each member from the archive once and
keeps its bytes: the signature check, the checksum and the parser see the same bytes, so a file
rewritten while it loads cannot slip a second version past the checks. Every damaged archive ends
in one ``BundleError`` that says it is corrupt or truncated.
"""

from __future__ import annotations

import hashlib
import struct
import zipfile
from pathlib import Path

from aot import schema
from aot.errors import BundleError, SignatureError

MAX_MANIFEST_BYTES = 16 << 20  # manifest.json, read before anything else of the bundle

MAX_MEMBERS = 4096
# Central directory bytes: an entry is 46 fixed bytes, a name of at most ~100 and extras (zip64
# sizes, weights alignment) of at most ~100; real bundles stay under 200 bytes an entry.
MAX_DIRECTORY_BYTES = MAX_MEMBERS * 512
COMPRESSIONS = (
    zipfile.ZIP_STORED,
    zipfile.ZIP_DEFLATED,
)  # what the packager writes; others inflate unbounded
LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then (at 26) name and extra lengths
CORRUPT = "corrupt or truncated: rebuild or re-copy it"  # what every damaged bundle is told


class Members:
    """The archive's members, each read from it once and kept: the bytes a signature or checksum
    was checked over are the bytes handed to a parser, even if the file changes underneath (a
    member is never reopened by name after its check). The weights are not kept: ``Bundle.read``
    reads and checks them on each call."""

    def __init__(self, zf: zipfile.ZipFile, path: Path):
        self.zf, self.path = zf, path
        self._data: dict[str, bytes] = {}

    def read(self, info: zipfile.ZipInfo, size: int) -> bytes:
        """The member's bytes, exactly ``size`` of them; read from the archive on first use only."""
        data = self._data.get(info.filename)
        if data is None:
            data = self._data[info.filename] = read_bounded(self.zf, info, size, self.path)
        return data

    def keep(self, name: str, data: bytes) -> None:
        """Hold ``data`` as the member's bytes: those a signature over the whole archive verified."""
        self._data[name] = data

    def signed(self, name: str, limit: int) -> bytes | None:
        """A member the trust check reads before the zip directory is verified (the signature,
        the manifest): at most ``limit`` bytes; None when absent."""
        infos = [i for i in self.zf.infolist() if i.filename == name]
        if not infos:
            return None
        info = infos[0]
        if len(infos) > 1:
            raise SignatureError(
                f"{self.path}: member {name} appears {len(infos)} times; not a bundle aotpack wrote"
            )
        if info.file_size > limit:
            raise SignatureError(f"{self.path}: member {name} is {info.file_size} bytes (limit {limit})")
        if info.flag_bits & 0x1 or info.compress_type not in COMPRESSIONS:
            raise SignatureError(
                f"{self.path}: member {name} is encrypted or oddly compressed; bundles are stored or deflated"
            )
        return self.read(info, info.file_size)


def read_bounded(zf: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, path: Path) -> bytes:
    try:
        with zf.open(info) as f:
            data = f.read(size + 1)
    except BundleError:
        raise
    except Exception as e:  # zlib.error, BadZipFile (CRC), EOFError, OSError, NotImplementedError ...
        raise unreadable(path, info.filename, e) from None
    if len(data) != size:
        raise BundleError(
            f"{path}: member {info.filename!r} holds {len(data)}+ bytes, the manifest says {size}"
        )
    return data


def check_sha256(data: bytes, member: schema.Member, name: str, path: Path) -> None:
    if hashlib.sha256(data).hexdigest() != member.sha256:
        raise mismatch(path, name, member)


def mismatch(path: Path, name: str, member: schema.Member) -> BundleError:
    return BundleError(
        f"{path}: checksum mismatch in {name!r} (expected sha256 {member.sha256[:16]}…): the bundle is {CORRUPT}"
    )


def unreadable(path: Path, name: str, e: Exception) -> BundleError:
    """A member zipfile cannot inflate or whose CRC fails; the library's own text (raw zlib
    errors) says nothing a user can act on."""
    return BundleError(
        f"{path}: member {name!r} cannot be read ({type(e).__name__}): the bundle is {CORRUPT}"
    )


def not_a_zip(path: Path, why: str) -> BundleError:
    """A file that starts as a zip archive does but does not read as one was cut short or damaged;
    anything else is not a bundle at all."""
    try:
        with open(path, "rb") as f:
            started = f.read(4) == zipfile.stringFileHeader
    except OSError:
        started = False
    if started:
        return BundleError(f"{path}: {why}: the bundle is {CORRUPT}")
    return BundleError(f"{path} is not a bundle ({why}); give a .tpk that `aotpack build` wrote")


def check_directory(path: Path) -> int:
    """Read the end-of-central-directory record (the one ``zipfile`` reads next, found the same
    way) and refuse a directory too large to parse; returns where the directory starts."""
    with open(path, "rb") as f:
        end = zipfile._EndRecData(f)  # zipfile's own reader: the same record it will use
    if not end:
        raise not_a_zip(path, "no zip directory at its end")
    # the record's fields: [4] entries in total, [5] directory size, [9] where the record starts
    entries, size, location = end[4], end[5], end[9]
    if entries > MAX_MEMBERS or size > MAX_DIRECTORY_BYTES:
        raise BundleError(
            f"{path}: zip directory of {entries} entries in {size} bytes (limit {MAX_MEMBERS} entries, "
            f"{MAX_DIRECTORY_BYTES} bytes); not a bundle"
        )
    zip64 = end[0] == zipfile.stringEndArchive64
    return location - size - (zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator if zip64 else 0)


def check_layout(path: Path, infos: list[zipfile.ZipInfo], directory_start: int) -> None:
    """Each member's local header and data lie before the central directory and overlap no other
    member's: overlapping members would let a small archive inflate one deflate stream many times."""
    extents = []
    with open(path, "rb") as f:
        for info in infos:
            header = b""
            if 0 <= info.header_offset < directory_start:
                f.seek(info.header_offset)
                header = f.read(LOCAL_HEADER.size)
            if len(header) != LOCAL_HEADER.size or header[:4] != zipfile.stringFileHeader:
                raise BundleError(
                    f"{path}: member {info.filename!r} has no local header at offset {info.header_offset}"
                )
            _, name_length, extra_length = LOCAL_HEADER.unpack(header)
            end = info.header_offset + LOCAL_HEADER.size + name_length + extra_length + info.compress_size
            extents.append((info.header_offset, end, info.filename))
    extents.sort()
    for (_, end, name), (start, _, following) in zip(extents, extents[1:]):
        if end > start:
            raise BundleError(
                f"{path}: members {name!r} and {following!r} overlap in the archive; not a bundle"
            )
    if extents and extents[-1][1] > directory_start:
        raise BundleError(
            f"{path}: member {extents[-1][2]!r} runs past the start of the zip directory; not a bundle"
        )
