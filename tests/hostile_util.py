"""Shared helpers for the hostile-bundle tests: tools to take an archive apart and put (possibly
malformed) ones together.

The zip tools write archives member by member so that tests can reorder, duplicate, rename,
mis-size or mis-compress members, and patch raw header fields. Bundles themselves come from the
session fixture ``built`` in ``tests/conftest.py``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import struct
import zipfile
import zlib
from dataclasses import dataclass, replace

ZIP_DATE = (1980, 1, 1, 0, 0, 0)


@functools.cache
def eager_module(model: str):
    """The model file's module, as the build instantiated it (same seed, dtype, eval mode)."""
    from aot.tracer import instantiate, load_model_file
    from tests.conftest import model_path

    return instantiate(load_model_file(model_path(model)))


# ---------------------------------------------------------------------------------------------
# Archives as lists of entries.


@dataclass(frozen=True)
class Entry:
    name: str
    data: bytes
    deflate: bool = False
    raw_name: bytes | None = None  # written into both headers instead of ``name`` (same length)


def read_entries(archive: bytes) -> list[Entry]:
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return [Entry(i.filename, zf.read(i), i.compress_type == zipfile.ZIP_DEFLATED) for i in zf.infolist()]


def write_entries(entries: list[Entry]) -> bytes:
    """A zip of ``entries`` in order, with fixed timestamps (duplicates allowed)."""
    import warnings

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point of some cases
        with zipfile.ZipFile(buf, "w") as zf:
            for e in entries:
                info = zipfile.ZipInfo(e.name, date_time=ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED if e.deflate else zipfile.ZIP_STORED
                info.external_attr = 0o644 << 16
                zf.writestr(info, e.data)
    data = buf.getvalue()
    for e in entries:
        if e.raw_name is not None:
            placeholder = e.name.encode("utf-8")
            assert len(placeholder) == len(e.raw_name), "raw_name must keep the name's length"
            assert data.count(placeholder) == 2, "placeholder name must occur in exactly two headers"
            data = data.replace(placeholder, e.raw_name)
    return data


def manifest_of(entries: list[Entry]) -> dict:
    return json.loads(next(e.data for e in entries if e.name == "manifest.json"))


def manifest_bytes(manifest) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def with_member(entries: list[Entry], name: str, data: bytes, resign: bool = True) -> list[Entry]:
    """Replace (or add) member ``name``; with ``resign`` the manifest's sha256 and size follow it."""
    out = [replace(e, data=data) if e.name == name else e for e in entries]
    if not any(e.name == name for e in entries):
        out.append(Entry(name, data))
    if resign:
        m = manifest_of(out)
        m["members"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        out = [replace(e, data=manifest_bytes(m)) if e.name == "manifest.json" else e for e in out]
    return out


def with_manifest_text(entries: list[Entry], text: bytes) -> list[Entry]:
    return [replace(e, data=text) if e.name == "manifest.json" else e for e in entries]


def program_json(entries: list[Entry]) -> dict:
    import zstandard

    raw = next(e.data for e in entries if e.name == "program.json.zst")
    return json.loads(zstandard.ZstdDecompressor().decompress(raw))


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)


def with_program_text(entries: list[Entry], text: bytes) -> list[Entry]:
    """Replace the program JSON text (compressed and re-signed, as an attacker would)."""
    return with_member(entries, "program.json.zst", zstd(text))


def safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in sorted(tensors.items())})


def crc_patched(archive: bytes, name: str, new_data: bytes) -> bytes:
    """Swap a STORED member's bytes for same-length ``new_data`` and fix its CRC-32 in both headers:
    the corruption the zip layer cannot see, only the manifest's sha256 can."""
    layout = zip_layout(archive)
    rec = next(r for r in layout if r.name == name)
    assert rec.method == 0 and len(new_data) == rec.compress_size
    out = bytearray(archive)
    out[rec.data_start : rec.data_start + len(new_data)] = new_data
    crc = struct.pack("<I", zlib.crc32(new_data) & 0xFFFFFFFF)
    out[rec.local_offset + 14 : rec.local_offset + 18] = crc
    out[rec.cd_offset + 16 : rec.cd_offset + 20] = crc
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Raw layout: where each header field lives, so tests can lie in exactly one place.


@dataclass(frozen=True)
class Record:
    name: str
    method: int
    compress_size: int
    file_size: int
    cd_offset: int  # central directory entry (46 fixed bytes + name + extra + comment)
    cd_length: int
    local_offset: int  # local header (30 fixed bytes + name + extra)
    data_start: int


@dataclass(frozen=True)
class Eocd:
    offset: int
    cd_start: int
    cd_size: int


def find_eocd(archive: bytes) -> Eocd:
    pos = archive.rfind(b"PK\x05\x06")
    assert pos >= 0
    cd_size, cd_start = struct.unpack("<II", archive[pos + 12 : pos + 20])
    return Eocd(pos, cd_start, cd_size)


def zip_layout(archive: bytes) -> list[Record]:
    eocd = find_eocd(archive)
    out, p = [], eocd.cd_start
    while p < eocd.cd_start + eocd.cd_size:
        assert archive[p : p + 4] == b"PK\x01\x02"
        (method,) = struct.unpack("<H", archive[p + 10 : p + 12])
        csize, usize, nlen, xlen, clen = struct.unpack("<IIHHH", archive[p + 20 : p + 34])
        (local,) = struct.unpack("<I", archive[p + 42 : p + 46])
        name = archive[p + 46 : p + 46 + nlen].decode("utf-8", "replace")
        lnlen, lxlen = struct.unpack("<HH", archive[local + 26 : local + 30])
        length = 46 + nlen + xlen + clen
        out.append(Record(name, method, csize, usize, p, length, local, local + 30 + lnlen + lxlen))
        p += length
    return out


def patch(archive: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(archive)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@functools.lru_cache(maxsize=4)
def deflate_bomb(inflated_size: int, chunk: int = 1 << 20) -> bytes:
    """A raw deflate stream of ``inflated_size`` zero bytes (about 1000:1), made in bounded memory."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros, parts, left = bytes(chunk), [], inflated_size
    while left > 0:
        parts.append(comp.compress(zeros[: min(chunk, left)]))
        left -= chunk
    parts.append(comp.flush())
    return b"".join(parts)


def bomb_archive(entries: list[Entry], name: str, inflated_size: int, declared_size: int) -> bytes:
    """``entries`` with member ``name`` replaced by a deflate stream of ``inflated_size`` zeros whose
    headers declare ``declared_size`` uncompressed bytes (CRC left as zipfile computed it)."""
    stream = deflate_bomb(inflated_size)
    placeholder = bytes(len(stream))
    archive = write_entries(
        [replace(e, data=placeholder, deflate=False) if e.name == name else e for e in entries]
    )
    rec = next(r for r in zip_layout(archive) if r.name == name)
    out = bytearray(archive)
    out[rec.data_start : rec.data_start + len(stream)] = stream
    for base in (rec.local_offset, rec.cd_offset):
        method_at = base + 8 if base == rec.local_offset else base + 10
        usize_at = base + 22 if base == rec.local_offset else base + 24
        struct.pack_into("<H", out, method_at, zipfile.ZIP_DEFLATED)
        struct.pack_into("<I", out, usize_at, declared_size)
    return bytes(out)


def resigned_program(archive: bytes, program: dict, replan: bool = False) -> bytes:
    """``archive`` with its program replaced by ``program`` (a JSON tree), re-signed, and every op
    the program calls listed in the manifest: the self-consistent bundle an attacker would write.
    ``replan``: the manifest's memory plan recomputed for the new program, as an attacker would."""
    entries = with_program_text(read_entries(archive), json.dumps(program, sort_keys=True).encode())
    m = manifest_of(entries)
    steps = [s for p in (program, *program.get("variants", ())) for s in p["steps"]]
    ops = {s["target"] for s in steps if s["kind"] == "aten"} | {
        r["target"] for s in steps for r in s["reference"]
    }
    m["ops"] = sorted(set(m["ops"]) | ops)
    if replan:
        from aot.program import peak_bytes
        from aot.schema import Program
        from aot.serde import from_json

        decoded = from_json(Program, program, "program")
        for entry in m["stats"]["memory_plan"]:
            entry["peak_bytes"] = peak_bytes(decoded, entry["sizes"])
    return write_entries(with_manifest_text(entries, manifest_bytes(m)))


def aten_step(target: str, args: list, outputs: list, **kwargs) -> dict:
    """An ATen step of a program's JSON tree; ``{"buf": name}`` args name buffers."""
    return {
        "kind": "aten",
        "target": target,
        "args": args,
        "kwargs": kwargs,
        "outputs": outputs,
        "grid": [],
        "reference": [],
    }


def overlapping(entries: list[Entry], name: str) -> bytes:
    """The archive of ``entries`` with stored member ``name``'s compressed size stretched over the
    next member's header and data in the directory: a stored member is read by its uncompressed
    size, so it still reads right, but its data range covers the next member."""
    archive = write_entries(entries)
    layout = sorted(zip_layout(archive), key=lambda r: r.local_offset)
    i = next(i for i, r in enumerate(layout) if r.name == name)
    rec, following = layout[i], layout[i + 1]
    stretched = following.data_start + following.compress_size - rec.data_start
    return patch(archive, rec.cd_offset + 20, "<I", stretched)


def deflated_members(entries: list[Entry], count: int, size: int) -> list[Entry]:
    """``entries`` plus ``count`` listed kernel sources of ``size`` zero bytes each, deflated."""
    data = bytes(size)
    digest = hashlib.sha256(data).hexdigest()
    m = manifest_of(entries)
    extra = [Entry(f"kernels/zz_{i:04d}.py", data, deflate=True) for i in range(count)]
    for e in extra:
        m["members"][e.name] = {"sha256": digest, "size": size}
    return with_manifest_text(entries, manifest_bytes(m)) + extra


def with_chunk_digests(entries: list[Entry], chunk_bytes: int, deflate: bool = False) -> list[Entry]:
    """The weights' manifest entry given the sha256 of every ``chunk_bytes`` (what the packager
    writes for weights over ``aot.digests.CHUNK_BYTES``); ``deflate``: the weights deflated, read
    in order."""
    from aot.digests import chunk_sha256

    manifest = manifest_of(entries)
    weights = next(e.data for e in entries if e.name == "weights.safetensors")
    size, chunks = chunk_sha256(weights, chunk_bytes)
    manifest["members"]["weights.safetensors"].update(chunk_bytes=size, chunk_sha256=list(chunks))
    out = [Entry(e.name, e.data, deflate) if e.name == "weights.safetensors" else e for e in entries]
    return with_manifest_text(out, manifest_bytes(manifest))
