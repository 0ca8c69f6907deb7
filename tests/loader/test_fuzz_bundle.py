"""Fuzz the loader with corrupted and hostile bundles of two small models.

A seeded generator mutates valid bundles of ``tests/data/branchy.py`` (float32, discovered guards)
and ``tests/data/small_mlp.py`` (a small copy of ``models/mlp.py``, float16): bit flips in every
member, in every local header and in the central directory; truncation at many offsets; members
removed, duplicated, renamed, reordered; zip bombs (a member that inflates far beyond its declared
size, and headers that lie about sizes); hostile names; invalid UTF-8 / JSON in the manifest; wrong
schema versions; wrong types in every manifest field; huge numbers in shapes; symbolic expressions
that try to call, import or take attributes; ops that would touch files or process state; bundles
that would cost far more than their size (overlapping members, inflation beyond the total, too many
members, a huge weights header, programs and guard relations beyond their bounds).

Every case is written to a temporary directory, loaded with ``aot.loader.load`` and called once with
the original example inputs. Its outcome must be one of:

- ``BundleError`` / ``EnvError`` from ``load``, or ``BundleError`` / ``EnvError`` / ``GuardError`` from the
  first call;
- accepted, and then (policy ``same``) every output equals the original bundle's bit for bit, or
  (policy ``clean``, only for re-signed programs, i.e. a different but well-formed program) any
  result. Cases of policy ``error`` (corruption, bombs, hostile names and ops, ...) must be refused.

"Re-signed" cases rewrite a member and its sha256 in the manifest, as an attacker would, so that
the mutation reaches the parsers and validators behind the checksum; the rest are raw corruption.

Each case runs under a hang-guard timer (``CASE_TIMEOUT_S``) and an audit hook that records any file write,
process spawn or ``exec`` while the loader runs; canary files outside the case directory must stay
untouched and ``torch`` process state (grad mode, ``torch.ops.aten``) unchanged. Memory: cases of the
categories in ``TRACED`` (bombs, huge members, deep JSON, ...) run under ``tracemalloc`` with a peak
bound (``CASE_PEAK_BYTES``); the whole run's peak RSS growth is bounded too (``RSS_GROWTH_LIMIT``).
The summary (cases per category and outcome) is printed; run with ``-s`` to see it, or set
``AOT_FUZZ_SUMMARY=path`` to write it (and a per-case log beside it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from aot import serde
from aot.errors import BundleError, EnvError, GuardError
from aot.loader import load
from tests.conftest import HANG_GUARD_S
from tests.hostile_util import (
    Entry,
    bomb_archive,
    crc_patched,
    deflated_members,
    eager_module,
    find_eocd,
    manifest_bytes,
    manifest_of,
    overlapping,
    patch,
    program_json,
    read_entries,
    safetensors_bytes,
    with_manifest_text,
    with_member,
    with_program_text,
    write_entries,
    zip_layout,
)

SEED = 20240607
CASE_TIMEOUT_S = 60.0  # a hang guard, far above what any case takes
CASE_PEAK_BYTES = 64 << 20  # Python-level peak per case; the bundles are ~10-20 kB
RSS_GROWTH_LIMIT = 768 << 20  # whole run (observed ~260 MiB, mostly the allocator keeping freed memory)
BOMB_BYTES = 128 << 20
MODELS = tuple(os.environ.get("AOT_FUZZ_MODELS", "branchy,small_mlp").split(","))

SAME, CLEAN = "same", "clean"
# Sample sizes per base bundle (the whole suite must stay within a few minutes on 2 cores).
LOCAL_HEADER_FLIPS = 150
DIRECTORY_FLIPS = 250
WRONG_VALUES_PER_FIELD = 4
PROGRAM_PATHS = 60
NAMESPACE_OPS = 60  # ops drawn from the aten namespace, off the allowlist, per base bundle
VIEW_ARG_VALUES = [-(2**63), -(2**31), -2, -1, 0, 1, 3, 2**31 + 1, 2**40, 2**62, 2**63 - 1]
# Categories whose cases run under tracemalloc (it slows a case about 5x); the bulk categories,
# which only flip, cut or retype small fields, are bounded by the whole run's peak RSS instead.
# (tracemalloc sees Python objects only; tensor memory shows in the RSS bound.)
TRACED = (
    "bomb:",
    "members:",
    "manifest:text",
    "program:zstd",
    "program:deep",
    "program:json",
    "shapes:symbol-excluded",
    "tensors:",
    "resources:zip",
)

# Hostile symbolic expressions: calls, imports, attributes, power towers, deep nesting, odd text.
HOSTILE_EXPRS = [
    "__import__('os').system('echo pwned')",
    "__import__('os')",
    "().__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "seq.__class__",
    "open('/etc/passwd')",
    "eval('1')",
    "exec('import os')",
    "getattr(seq, 'real')",
    "globals()",
    "9**9**9",
    "seq ** 2",
    "2 ** 62 * 4",
    "4611686018427387904 * 4",
    "-4611686018427387904 * 4",
    "9" * 4000,
    "1" + "+1" * 1500,
    "(" * 150 + "seq" + ")" * 150,
    "(" * 1000 + "seq" + ")" * 1000,
    "-" * 3000 + "1",
    "not " * 900 + "1",
    "max(" * 60 + "1" + ")" * 60,
    "max(*[seq])",
    "max()",
    "max(1, 2, 3, 4, 5, 6, 7, 8, 9)",
    "min(seq=1)",
    "max(seq, key=abs)",
    "lambda: 0",
    "seq if seq else 0",
    "[seq]",
    "{seq: 1}",
    "seq[0]",
    "f'{seq}'",
    "seq @ 2",
    "seq / 2",
    "seq // 0",
    "seq % 0",
    "seq << 70",
    "1.5",
    "'seq'",
    "b'x'",
    "...",
    "None",
    "(seq := 3)",
    "seq; 1",
    "seq\n1",
    "# comment",
    "",
    " ",
    "\x00",
    "seq\x00",
    "\ud800",
    "nosuchsymbol",
    "__builtins__",
    "ｓｅｑ",  # NFKC-normalizes to an existing symbol name: allowed, same meaning
    "a" * 5000,
    "seq < batch < 3",
]

# Ops a bundle must never reach: file access, process state, in-place writes, and attribute tricks
# that the op-name grammar would otherwise let through.
HOSTILE_OPS = [
    "aten.save.default",
    "aten.from_file.default",
    "aten._print.default",
    "aten.warn.default",
    "aten.set_grad_enabled.default",
    "aten.manual_seed.default",
    "aten.seed.default",
    "aten.add_.Tensor",
    "aten.copy_.default",
    "aten.fill_.Scalar",
    "aten.add.out",
    "aten.set_.source_Tensor",
    "aten.resize_.default",
    "aten.__setattr__.__call__",
    "aten.__delattr__.__call__",
    "aten.__class__.__subclasses__",
    "aten.__dict__.get",
    "aten.__init__.__call__",
    "aten.__getattr__.__call__",
    "prims.view_of.default",
    "os.system",
    "builtins.eval",
    "torch.load",
    "aten..default",
    "aten.nonexistent_op_xyz.default",
    "aten.add.Tensor.extra",
    "aten.add",
    "",
    "a" * 5000,
    # memory-unsafe: views over any memory, unchecked indices
    "aten._reshape_alias.default",
    "aten._sparse_coo_tensor_unsafe.default",
    "aten._to_dense.default",
    "aten.segment_reduce.default",
    "aten.empty.memory_format",
    # effects outside the bundle: autograd, the process's random generator
    "aten._backward.default",
    "aten.randn.default",
    "aten.native_dropout.default",
    "aten.bernoulli.p",
]

WRONG_VALUES = [None, True, 0, -1, 2**64, 1.5, "", "x", [], {}, [[[[]]]], "\ud800"]
HUGE_INTS = [2**31 + 1, 2**62, 2**63, 2**64, 10**30, -1, -(2**63) - 1]
HUGE_SIZE_TEXTS = [
    "99999999999999999999",
    "9" * 5000,
    "-1",
    "0",
    "²",
    "٣",
    " 16",
    "16 ",
    "0x10",
    "1e9",
    "16.0",
]


@dataclass(frozen=True)
class Case:
    category: str
    label: str
    data: bytes
    policy: str = SAME


# ---------------------------------------------------------------------------------------------
# JSON tree helpers.


def json_paths(obj, prefix=()) -> Iterator[tuple]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from json_paths(v, prefix + (i,))


def get_at(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def set_at(obj, path, value):
    out = copy.deepcopy(obj)
    parent = get_at(out, path[:-1])
    parent[path[-1]] = value
    return out


def del_at(obj, path):
    out = copy.deepcopy(obj)
    del get_at(out, path[:-1])[path[-1]]
    return out


def dumps(obj, deep: int = 0) -> bytes:
    text = json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False)
    if deep:
        text = text.replace('"@@DEEP@@"', "[" * deep + "]" * deep)
    return text.encode("utf-8", "surrogatepass")


def path_text(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


# ---------------------------------------------------------------------------------------------
# Case generators.


def _inflates_to(archive: bytes | bytearray, rec) -> bytes | None:
    """The content a reader takes from a deflated member: the first ``file_size`` bytes its stream
    decodes to (what follows is never read), or None where the stream does not decode."""
    data = bytes(archive[rec.data_start : rec.data_start + rec.compress_size])
    try:
        return zlib.decompressobj(-15).decompress(data, rec.file_size)
    except zlib.error:
        return None


def raw_cases(base: bytes, rng: random.Random) -> Iterator[Case]:
    layout = zip_layout(base)
    eocd = find_eocd(base)
    # bit flips in every member's data: the zip CRC or the manifest's sha256 must catch each, unless
    # the flip lands in a deflate stream's bits that decode to nothing (the member's content is
    # unchanged: then the bundle must run exactly as before)
    for rec in layout:
        for pos in rng.sample(
            range(rec.data_start, rec.data_start + rec.compress_size), min(12, rec.compress_size)
        ):
            flipped = bytearray(base)
            flipped[pos] ^= 1 << rng.randrange(8)
            policy = "error"
            if rec.method == 8 and _inflates_to(flipped, rec) == _inflates_to(base, rec):
                policy = SAME
            yield Case("bitflip:member-data", f"{rec.name}@{pos}", bytes(flipped), policy)
    # one random bit in each of a sample of bytes of the local headers, and of the central directory
    # and its end record (all of their fields: sizes, offsets, CRCs, name lengths, flags, counts)
    local = [pos for rec in layout for pos in range(rec.local_offset, rec.data_start)]
    for pos in sorted(rng.sample(local, min(LOCAL_HEADER_FLIPS, len(local)))):
        flipped = bytearray(base)
        flipped[pos] ^= 1 << rng.randrange(8)
        yield Case("bitflip:local-header", f"@{pos}", bytes(flipped))
    directory = range(eocd.cd_start, len(base))
    for pos in sorted(rng.sample(directory, min(DIRECTORY_FLIPS, len(directory)))):
        flipped = bytearray(base)
        flipped[pos] ^= 1 << rng.randrange(8)
        yield Case("bitflip:central-directory", f"@{pos}", bytes(flipped))
    # truncation: every offset in the directory region, a spread elsewhere
    offsets = set(range(max(0, eocd.cd_start - 64), len(base))) | set(
        range(0, len(base), max(1, len(base) // 150))
    )
    for n in sorted(offsets):
        yield Case("truncate", f"{n}/{len(base)}", base[:n], "error")
    hole = len(base) // 3
    while base[hole : hole + 64] == bytes(64):  # zeros over zeros (a cubin's padding) change nothing
        hole += 64
    yield Case("truncate", "hole", base[:hole] + bytes(64) + base[hole + 64 :], "error")
    yield Case("append", "trailing garbage", base + b"garbage" * 10)
    yield Case("append", "leading garbage", b"MZ" + bytes(100) + base)
    yield Case("append", "two archives", base + base)


def member_cases(base: bytes, rng: random.Random) -> Iterator[Case]:
    entries = read_entries(base)
    names = [e.name for e in entries]
    for e in entries:
        rest = [x for x in entries if x is not e]
        yield Case("members:removed", e.name, write_entries(rest), "error")
        if e.name != "manifest.json":
            m = manifest_of(rest)
            del m["members"][e.name]
            policy = "error" if e.name in ("program.json.zst", "weights.safetensors") else SAME
            yield Case(
                "members:removed+unlisted",
                e.name,
                write_entries(with_manifest_text(rest, manifest_bytes(m))),
                policy,
            )
        yield Case("members:duplicated", e.name, write_entries(entries + [e]), "error")
        yield Case(
            "members:duplicated-different",
            e.name,
            write_entries(entries + [replace(e, data=e.data + b"!")]),
            "error",
        )
        for other in names:
            if other != e.name:
                renamed = [replace(x, name=other) if x is e else x for x in entries]
                yield Case("members:renamed", f"{e.name}->{other}", write_entries(renamed), "error")
        yield Case(
            "members:renamed",
            f"{e.name}->kernels/x.py",
            write_entries([replace(x, name="kernels/x.py") if x is e else x for x in entries]),
            "error",
        )
    for i in range(6):
        order = entries[:]
        rng.shuffle(order)
        yield Case("members:reordered", str(i), write_entries(order))
    yield Case("members:reordered", "reversed", write_entries(entries[::-1]))
    yield Case(
        "members:added-unlisted",
        "kernels/k.py",
        write_entries(entries + [Entry("kernels/k.py", b"x=1\n")]),
        "error",
    )
    yield Case(
        "members:added-listed", "kernels/k.py", write_entries(with_member(entries, "kernels/k.py", b"x=1\n"))
    )
    yield Case(
        "members:stored-as-deflated", "all", write_entries([replace(e, deflate=True) for e in entries])
    )
    yield Case("members:none", "empty zip", write_entries([]), "error")


HOSTILE_NAMES = [
    "../manifest.json",
    "/etc/passwd",
    "/manifest.json",
    "kernels/../../x.py",
    "kernels/../manifest.json",
    "C:\\windows\\x.py",
    "\\\\server\\share\\x",
    "manifest.json/",
    "kernels/",
    "kernels/A.py",
    "kernels/a.sm_90.cubin/../../b",
    "ｍanifest.json",
    "x" * 300,
    "",
]


def name_cases(base: bytes) -> Iterator[Case]:
    entries = read_entries(base)
    for e in entries:
        for bad in HOSTILE_NAMES:
            yield Case(
                "names:hostile",
                f"{e.name}->{bad[:30]!r}",
                write_entries([replace(x, name=bad) if x is e else x for x in entries]),
                "error",
            )
            # also as an extra member beside the real one
            yield Case(
                "names:hostile-extra", f"+{bad[:30]!r}", write_entries(entries + [Entry(bad, b"x")]), "error"
            )
        n = len(e.name.encode())
        # NUL inside the name (zipfile cuts names at NUL), invalid UTF-8 with the UTF-8 flag set
        nul = (e.name[: n // 2] + "\x00" + e.name[n // 2 + 1 :]).encode()
        raw = [replace(x, raw_name=nul) if x is e else x for x in entries]
        yield Case("names:nul", e.name, write_entries(raw), "error")
        bad_utf8 = b"\xff\xfe" + e.name.encode()[2:]
        data = write_entries([replace(x, raw_name=bad_utf8) if x is e else x for x in entries])
        rec = next(
            r
            for r in zip_layout(data)
            if r.cd_offset and data[r.cd_offset + 46 : r.cd_offset + 48] == b"\xff\xfe"
        )
        flags = struct.unpack("<H", data[rec.cd_offset + 8 : rec.cd_offset + 10])[0] | 0x800
        data = patch(patch(data, rec.cd_offset + 8, "<H", flags), rec.local_offset + 6, "<H", flags)
        yield Case("names:invalid-utf8", e.name, data, "error")
        yield Case(
            "names:cp437",
            e.name,
            write_entries([replace(x, raw_name=bad_utf8) if x is e else x for x in entries]),
            "error",
        )
    # a NUL name that zipfile would shorten to a member that is really there
    extra = Entry("guards.txt.XXXX", b"evil")
    yield Case(
        "names:nul",
        "guards.txt\\0XXXX shadow",
        write_entries(entries + [replace(extra, raw_name=b"guards.txt\x00XXXX")]),
        "error",
    )


def bomb_cases(base: bytes) -> Iterator[Case]:
    entries = read_entries(base)
    layout = zip_layout(base)
    for e in entries:
        real = len(e.data)
        # a deflated member that inflates to BOMB_BYTES while its headers declare the real size
        yield Case(
            "bomb:inflates-beyond-declared", e.name, bomb_archive(entries, e.name, BOMB_BYTES, real), "error"
        )
        # honest headers, absurd ratio
        yield Case(
            "bomb:declared-huge", e.name, bomb_archive(entries, e.name, BOMB_BYTES, BOMB_BYTES), "error"
        )
    for rec in layout:
        for size in (0, rec.file_size + 1, 2**31, 2**32 - 1):
            if size == rec.file_size:
                continue
            lied = patch(base, rec.cd_offset + 24, "<I", size)
            yield Case("bomb:directory-lies-size", f"{rec.name}={size}", lied, "error")
            yield Case(
                "bomb:both-headers-lie-size",
                f"{rec.name}={size}",
                patch(lied, rec.local_offset + 22, "<I", size),
                "error",
            )
        for csize in (0, rec.compress_size + 1, 2**32 - 1):
            # zipfile reads a stored member by its uncompressed size, so some of these are harmless
            yield Case(
                "bomb:directory-lies-compressed-size",
                f"{rec.name}={csize}",
                patch(base, rec.cd_offset + 20, "<I", csize),
            )
        for method in (zipfile_BZIP2, zipfile_LZMA, 99):
            yield Case(
                "bomb:compression-method",
                f"{rec.name}={method}",
                patch(patch(base, rec.cd_offset + 10, "<H", method), rec.local_offset + 8, "<H", method),
                "error",
            )
        yield Case("bomb:encrypted-flag", rec.name, patch(base, rec.cd_offset + 8, "<H", 1), "error")
    # a member really compressed with bzip2 / lzma (zipfile would inflate it without bounds)
    import zipfile as zf_mod

    for method in (zf_mod.ZIP_BZIP2, zf_mod.ZIP_LZMA):
        import io

        buf = io.BytesIO()
        with zf_mod.ZipFile(buf, "w") as zf:
            for e in entries:
                zf.writestr(
                    zf_mod.ZipInfo(e.name, (1980, 1, 1, 0, 0, 0)),
                    e.data,
                    compress_type=method if e.name == "guards.txt" else zf_mod.ZIP_STORED,
                )
        yield Case("bomb:compression-method", f"guards.txt really {method}", buf.getvalue(), "error")
    # a huge manifest (whitespace): bounded read
    m = manifest_of(entries)
    yield Case(
        "bomb:huge-manifest",
        "17 MiB",
        write_entries(with_manifest_text(entries, manifest_bytes(m) + b" " * (17 << 20))),
        "error",
    )


zipfile_BZIP2, zipfile_LZMA = 12, 14


def manifest_text_cases(base: bytes) -> Iterator[Case]:
    entries = read_entries(base)
    m = manifest_of(entries)
    text = manifest_bytes(m)

    def case(label, data, policy="error", cat="manifest:text"):
        return Case(cat, label, write_entries(with_manifest_text(entries, data)), policy)

    yield case("invalid utf-8", b"\xff" + text)
    yield case("invalid utf-8 inside", text.replace(b'"format"', b'"f\xc3\x28rmat"'))
    yield case("utf-16", text.decode().encode("utf-16"))
    yield case("bom", b"\xef\xbb\xbf" + text)
    yield case("empty", b"")
    for n in (1, len(text) // 2, len(text) - 3):
        yield case(f"cut at {n}", text[:n])
    yield case("trailing brace", text + b"}")
    yield case("equals", text.replace(b'":', b'"='))
    yield case("single quotes", text.replace(b'"', b"'"))
    for top in (b"[]", b'""', b"null", b"1", b"true", b"[" * 100000 + b"]" * 100000, b"{" * 50000):
        yield case(f"top {top[:12]!r}", top)
    yield case("NaN", text.replace(b'"size": ', b'"size": NaN, "x": ', 1))
    yield case(
        "duplicate key",
        text.replace(b'"format": "aotpack-bundle"', b'"format": "aotpack-bundle", "format": "evil"'),
    )
    for fmt in ("", "aotpack-bundle ", "AOTPACK-BUNDLE", None, 1):
        yield case(f"format={fmt!r}", manifest_bytes({**m, "format": fmt}), cat="manifest:format")
    for v in (
        [2, 0],
        [0, 0],
        [0, 9],
        [1, 99],
        [99, 0],
        [-1, 0],
        [1],
        [1, 0, 0],
        "1.0",
        [True, 0],
        [1.0, 0],
        [2**70, 0],
        None,
        [None, None],
        {},
    ):
        yield case(
            f"schema_version={v!r}", manifest_bytes({**m, "schema_version": v}), cat="manifest:schema-version"
        )
    no_version = {k: v for k, v in m.items() if k != "schema_version"}
    yield case("schema_version missing", manifest_bytes(no_version), cat="manifest:schema-version")
    # member records that lie
    for name in m["members"]:
        rec = m["members"][name]
        for label, value in (
            ("size+1", {**rec, "size": rec["size"] + 1}),
            ("size-1", {**rec, "size": rec["size"] - 1}),
            ("size huge", {**rec, "size": 2**62}),
            ("sha upper", {**rec, "sha256": rec["sha256"].upper()}),
            ("sha short", {**rec, "sha256": rec["sha256"][:63]}),
            ("sha other", {**rec, "sha256": "0" * 64}),
            ("sha non-hex", {**rec, "sha256": "z" * 64}),
        ):
            mm = copy.deepcopy(m)
            mm["members"][name] = value
            yield case(f"{name} {label}", manifest_bytes(mm), cat="manifest:members")


def manifest_type_cases(base: bytes, rng: random.Random) -> Iterator[Case]:
    """Every field of the manifest, replaced by values of the wrong type, deleted, or joined by an unknown one."""
    entries = read_entries(base)
    m = manifest_of(entries)
    for path in json_paths(m):
        if not path:
            continue
        current = get_at(m, path)
        for value in rng.sample(WRONG_VALUES, WRONG_VALUES_PER_FIELD):
            if type(value) is type(current) and value == current:
                continue
            yield Case(
                "manifest:wrong-type",
                f"{path_text(path)}={value!r}"[:80],
                write_entries(with_manifest_text(entries, dumps(set_at(m, path, value)))),
            )
        yield Case(
            "manifest:wrong-type",
            f"{path_text(path)}=deep",
            write_entries(with_manifest_text(entries, dumps(set_at(m, path, "@@DEEP@@"), deep=5000))),
        )
        yield Case(
            "manifest:deleted",
            path_text(path),
            write_entries(with_manifest_text(entries, dumps(del_at(m, path)))),
        )
        if isinstance(current, dict):
            yield Case(
                "manifest:unknown-field",
                path_text(path),
                write_entries(with_manifest_text(entries, dumps(set_at(m, path + ("zz_unknown",), 1)))),
            )


def manifest_shape_cases(base: bytes) -> Iterator[Case]:
    """Huge and malformed numbers where the manifest holds sizes and bounds."""
    entries = read_entries(base)
    m = manifest_of(entries)

    def case(cat, label, mm):
        return Case(cat, label, write_entries(with_manifest_text(entries, dumps(mm))))

    for i, inp in enumerate(m["guards"]["inputs"]):
        for d in range(len(inp["shape"])):
            for text in HUGE_SIZE_TEXTS + HOSTILE_EXPRS[:12]:
                yield case(
                    "shapes:guard-input",
                    f"{inp['name']}[{d}]={text[:20]!r}",
                    set_at(m, ("guards", "inputs", i, "shape", d), text),
                )
    for i, sym in enumerate(m["guards"]["symbols"]):
        for field in ("min", "max", "declared_min", "declared_max", "modulus"):
            for v in HUGE_INTS:
                yield case(
                    "shapes:symbol-bounds",
                    f"{sym['name']}.{field}={v}",
                    set_at(m, ("guards", "symbols", i, field), v),
                )
        for v in ([], [2**64], [-1], list(range(5000))):
            yield case(
                "shapes:symbol-residues",
                f"{sym['name']}.residues={str(v)[:20]}",
                set_at(m, ("guards", "symbols", i, "residues"), v),
            )
        yield case(
            "shapes:symbol-excluded",
            f"{sym['name']}.excluded=20k",
            set_at(m, ("guards", "symbols", i, "excluded"), list(range(20000))),
        )
        for text in HOSTILE_EXPRS:
            src = {"code": "x", "file": "m.py", "line": 1, "text": text}
            yield case(
                "symexpr:guard-source",
                f"{sym['name']}: {text[:30]!r}",
                set_at(m, ("guards", "symbols", i, "sources"), [src]),
            )
    for text in HOSTILE_EXPRS:
        rel = {"expr": text, "source": {"code": "x", "file": "m.py", "line": 1, "text": text}}
        yield case("symexpr:relation", repr(text[:30]), set_at(m, ("guards", "relations"), [rel]))
    for i, b in enumerate(m["buckets"]):
        for v in HUGE_INTS:
            yield case("shapes:buckets", f"{b['symbol']}={v}", set_at(m, ("buckets", i, "sizes"), [v]))
    for op in HOSTILE_OPS:
        yield case("ops:manifest", repr(op[:40]), set_at(m, ("ops",), m["ops"] + [op]))


def program_cases(base: bytes, rng: random.Random, canary_dir: Path) -> Iterator[Case]:
    entries = read_entries(base)
    prog = program_json(entries)
    m = manifest_of(entries)

    def signed(p, deep=0, ops=None):
        out = with_program_text(entries, dumps(p, deep=deep))
        if ops is not None:
            mm = manifest_of(out)
            mm["ops"] = sorted(set(mm["ops"]) | set(ops))
            out = with_manifest_text(out, manifest_bytes(mm))
        return write_entries(out)

    # wrong types, deletions and unknown fields: a seeded sample of the program's paths
    paths = [p for p in json_paths(prog) if p]
    for path in rng.sample(paths, min(PROGRAM_PATHS, len(paths))):
        current = get_at(prog, path)
        for value in rng.sample(WRONG_VALUES, WRONG_VALUES_PER_FIELD):
            if type(value) is type(current) and value == current:
                continue
            yield Case(
                "program:wrong-type",
                f"{path_text(path)}={value!r}"[:80],
                signed(set_at(prog, path, value)),
                CLEAN,
            )
        yield Case("program:deleted", path_text(path), signed(del_at(prog, path)), CLEAN)
    for depth in (100, 900, 5000, 200000):
        yield Case(
            "program:deep-args",
            str(depth),
            signed(set_at(prog, ("steps", 0, "args", 0), "@@DEEP@@"), deep=depth),
            CLEAN,
        )
    yield Case(
        "program:not-zstd",
        "raw json",
        write_entries(with_member(entries, "program.json.zst", dumps(prog))),
        "error",
    )
    yield Case(
        "program:zstd-lies",
        "content size",
        write_entries(with_member(entries, "program.json.zst", _zstd_lying_size(dumps(prog)))),
        "error",
    )
    yield Case(
        "program:zstd-bomb",
        "1 GiB declared",
        write_entries(with_member(entries, "program.json.zst", _zstd_zeros(1 << 30))),
        "error",
    )
    yield Case(
        "program:invalid-utf8", "", write_entries(with_program_text(entries, b"\xff" + dumps(prog))), "error"
    )
    # JSON that would cost far more memory as Python objects than as text (~400 MB for 16 MiB of "[],")
    for unit in (b"[],", b"{},"):
        bloat = b"[" + unit * ((15 << 20) // len(unit)) + b"0]"
        yield Case(
            "program:json-bloat", unit.decode(), write_entries(with_program_text(entries, bloat)), "error"
        )
    yield Case("program:top-level", "list", write_entries(with_program_text(entries, b"[]")), "error")

    # hostile symbolic expressions wherever the program holds one
    sym_paths = [p for p in paths if p[-1] == "sym"]
    shape_paths = [p for p in paths if len(p) >= 2 and p[-2] == "shape"]
    for path in sym_paths[:1] + shape_paths[:1]:
        for text in HOSTILE_EXPRS:
            yield Case(
                "symexpr:program", f"{path_text(path)}={text[:30]!r}", signed(set_at(prog, path, text)), CLEAN
            )
    # huge numbers in shapes and in step arguments
    for path in (
        shape_paths[:4]
        + [p for p in paths if p[:2] == ("inputs", 0) and p[-2:-1] == ("shape",)][:2]
        + [p for p in paths if p[0] == "weights" and len(p) >= 2 and p[-2] == "shape"][:2]
    ):
        for text in HUGE_SIZE_TEXTS:
            yield Case(
                "shapes:program-spec",
                f"{path_text(path)}={text[:20]!r}",
                signed(set_at(prog, path, text)),
                CLEAN,
            )
    int_arg_paths = [p for p in paths if p[0] == "steps" and "args" in p and type(get_at(prog, p)) is int]
    for path in int_arg_paths[:4]:
        for v in HUGE_INTS:
            yield Case("shapes:step-int-arg", f"{path_text(path)}={v}", signed(set_at(prog, path, v)), CLEAN)
    for path in sym_paths[:2]:
        for v in ("4611686018427387904", "4611686018427387904*2", "batch*4611686018427387903"):
            yield Case("shapes:step-sym-arg", f"{path_text(path)}={v}", signed(set_at(prog, path, v)), CLEAN)
    # allocation requests far beyond memory
    first_in = prog["inputs"][0]["name"]
    for shape in ([2**40], [2**31, 2**31], [2**62], [-5]):
        step = {
            "kind": "aten",
            "target": "aten.empty.memory_format",
            "args": [shape],
            "kwargs": {"dtype": {"dtype": "float32"}, "device": {"device": "runtime"}},
            "outputs": ["zz_big"],
            "grid": [],
            "reference": [],
        }
        p = copy.deepcopy(prog)
        p["steps"].insert(0, step)
        yield Case("program:huge-allocation", str(shape), signed(p, ops=["aten.empty.memory_format"]), CLEAN)

    # ops that must never run, with and without being listed in the manifest
    for op in HOSTILE_OPS:
        for listed in (False, True):
            p = set_at(prog, ("steps", 0, "target"), op)
            yield Case(
                "ops:step-target",
                f"{op[:40]!r} listed={listed}",
                signed(p, ops=[op] if listed else None),
                "error",
            )
    # any op of the aten namespace that is not on the allowlist: refused by name at load
    first_step = lambda op: {  # noqa: E731
        "kind": "aten",
        "target": op,
        "args": [{"buf": first_in}],
        "kwargs": {},
        "outputs": ["zz_ns"],
        "grid": [],
        "reference": [],
    }
    for op in rng.sample(unlisted_aten_ops(), NAMESPACE_OPS):
        p = copy.deepcopy(prog)
        p["steps"].insert(0, first_step(op))
        yield Case("ops:aten-namespace", op, signed(p, ops=[op]), "error")
    victim = canary_dir / "victim.bin"
    target = canary_dir / "written-by-bundle.bin"
    crafted = {
        "save": [
            {
                "target": "aten.save.default",
                "args": [[{"buf": first_in}], str(target)],
                "kwargs": {},
                "outputs": [None],
            }
        ],
        "from_file+fill_": [
            {
                "target": "aten.from_file.default",
                "args": [str(victim), True, 4],
                "kwargs": {"dtype": {"dtype": "float32"}},
                "outputs": ["zz_ff"],
            },
            {
                "target": "aten.fill_.Scalar",
                "args": [{"buf": "zz_ff"}, 7.0],
                "kwargs": {},
                "outputs": ["zz_ff2"],
            },
        ],
        "setattr on torch.ops.aten": [
            {"target": "aten.__setattr__.__call__", "args": ["add", 1], "kwargs": {}, "outputs": [None]}
        ],
        "in-place on input": [
            {
                "target": "aten.add_.Tensor",
                "args": [{"buf": first_in}, 1.0],
                "kwargs": {},
                "outputs": ["zz_inplace"],
            }
        ],
        "in-place on weight": [
            {
                "target": "aten.mul_.Scalar",
                "args": [{"buf": prog["weights"][0]["name"]}, 0.0],
                "kwargs": {},
                "outputs": ["zz_w"],
            }
        ],
    }
    for label, steps in crafted.items():
        steps = [{"kind": "aten", "grid": [], "reference": [], **s} for s in steps]
        for listed in (False, True):
            p = copy.deepcopy(prog)
            p["steps"][0:0] = steps
            yield Case(
                "ops:crafted",
                f"{label} listed={listed}",
                signed(p, ops=[s["target"] for s in steps] if listed else None),
                "error",
            )
    # inconsistent program/manifest pairs
    p = set_at(prog, ("inputs", 0, "name"), "renamed")
    yield Case("program:inconsistent", "input renamed", signed(p), "error")
    p = set_at(prog, ("outputs",), ["nosuchbuffer"])
    yield Case("program:inconsistent", "unknown output", signed(p), "error")
    p = copy.deepcopy(prog)
    p["steps"] = p["steps"][1:]
    yield Case("program:inconsistent", "first step removed", signed(p), CLEAN)
    p = copy.deepcopy(prog)
    p["steps"].append(copy.deepcopy(p["steps"][0]))
    yield Case("program:inconsistent", "step repeated", signed(p), CLEAN)
    p = copy.deepcopy(prog)
    p["steps"][0]["kind"] = "kernel"
    yield Case("program:inconsistent", "aten step as kernel", signed(p), CLEAN)
    p = copy.deepcopy(prog)
    p["steps"][0] = {**p["steps"][0], "kind": "kernel", "reference": [{**p["steps"][0], "kind": "kernel"}]}
    yield Case("program:inconsistent", "nested kernel reference", signed(p), CLEAN)
    del m


def _zstd_lying_size(data: bytes) -> bytes:
    from tests.hostile_util import zstd

    frame = bytearray(zstd(data))
    # frame header: magic(4) FHD(1) [window] content size; with level 3 and write_content_size the
    # FHD says how many bytes the size field has; set it to the maximum representable value.
    fhd = frame[4]
    fcs_code = fhd >> 6
    single = (fhd >> 5) & 1
    size_len = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fcs_code]
    start = 5 + (0 if single else 1)
    frame[start : start + size_len] = b"\xff" * size_len
    return bytes(frame)


def _zstd_zeros(n: int) -> bytes:
    import zstandard

    c = zstandard.ZstdCompressor(level=1, write_content_size=True)
    return c.compress(bytes(1 << 20)) if n <= 1 << 20 else _zstd_declared(n)


@functools.lru_cache(maxsize=2)
def _zstd_declared(n: int) -> bytes:
    """A zstd frame that declares ``n`` bytes of content and really holds that many zeros (streamed)."""
    import zstandard

    c = zstandard.ZstdCompressor(level=1, write_content_size=True)
    chunk, out = bytes(1 << 20), []
    obj = c.compressobj(size=n)
    for _ in range(n // len(chunk)):
        out.append(obj.compress(chunk))
    out.append(obj.flush())
    return b"".join(out)


def tensor_member_cases(base: bytes) -> Iterator[Case]:
    entries = read_entries(base)
    from safetensors.torch import load as st_load

    for name in ("weights.safetensors", "reference.safetensors"):
        data = next(e.data for e in entries if e.name == name)
        tensors = st_load(data)
        hlen = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + hlen])
        policy = "error" if name == "weights.safetensors" else SAME

        def signed(blob, label, pol=policy, name=name):
            return Case(
                f"tensors:{name.split('.')[0]}", label, write_entries(with_member(entries, name, blob)), pol
            )

        yield signed(struct.pack("<Q", 2**64 - 1) + data[8:], "header length 2**64-1")
        yield signed(struct.pack("<Q", hlen + 1) + data[8:], "header length +1")
        yield signed(data[:8] + b"\xff" + data[9:], "header not utf-8")
        yield signed(data[: 8 + hlen // 2], "cut in header")
        yield signed(data[:-3], "cut in data")
        first = next(k for k in header if k != "__metadata__")
        for label, change in (
            ("huge shape", {"shape": [2**40, 2**40]}),
            ("negative shape", {"shape": [-1]}),
            ("dtype", {"dtype": "F64" if header[first]["dtype"] != "F64" else "F32"}),
            ("unknown dtype", {"dtype": "Q99"}),
            ("offsets beyond", {"data_offsets": [0, 2**62]}),
            ("offsets reversed", {"data_offsets": header[first]["data_offsets"][::-1]}),
            ("shape type", {"shape": "16"}),
        ):
            h = copy.deepcopy(header)
            h[first] = {**h[first], **change}
            hb = json.dumps(h).encode()
            hb += b" " * (-len(hb) % 8)
            yield signed(struct.pack("<Q", len(hb)) + hb + data[8 + hlen :], f"{first}: {label}")
        if len(tensors) > 1:
            rest = {k: v for k, v in tensors.items() if k != sorted(tensors)[0]}
            yield signed(safetensors_bytes(rest), "one tensor removed")
        changed = {k: (v.double() if v.is_floating_point() else v) for k, v in tensors.items()}
        yield signed(safetensors_bytes(changed), "every float tensor float64")
        reshaped = {k: v.reshape(-1) for k, v in tensors.items()}
        yield signed(safetensors_bytes(reshaped), "every tensor flattened")
        yield signed(safetensors_bytes({**tensors, "zz_extra": torch.zeros(3)}), "extra tensor", SAME)
        # a valid header of odd length: every tensor's data starts off its dtype's alignment
        hb = json.dumps(header).encode()
        hb += b" " * (1 + len(hb) % 2)
        yield signed(struct.pack("<Q", len(hb)) + hb + data[8 + hlen :], "header of odd length")
        if name == "reference.safetensors":  # reference outputs that the program's outputs do not match
            outputs = {k: v for k, v in tensors.items() if k.startswith("output.")}
            inputs = {k: v for k, v in tensors.items() if not k.startswith("output.")}
            yield signed(safetensors_bytes(inputs), "outputs missing")
            yield signed(
                safetensors_bytes({**tensors, "output.0": tensors["output.0"].reshape(-1)}),
                "output flattened",
            )
            yield signed(
                safetensors_bytes({**tensors, "output.9": tensors["output.0"].clone()}), "extra output"
            )
            yield signed(
                safetensors_bytes({**inputs, **{f"output.x{k}": v for k, v in outputs.items()}}),
                "output named x",
            )


def checksum_cases(base: bytes, rng: random.Random) -> Iterator[Case]:
    """Corruption that the zip layer cannot see (CRC fixed up): only the sha256 can catch it."""
    for rec in zip_layout(base):
        if rec.method != 0:
            continue
        data = base[rec.data_start : rec.data_start + rec.compress_size]
        for pos in rng.sample(range(len(data)), min(8, len(data))):
            bad = bytearray(data)
            bad[pos] ^= 1 << rng.randrange(8)
            yield Case(
                "checksum:crc-fixed", f"{rec.name}@{pos}", crc_patched(base, rec.name, bytes(bad)), "error"
            )


@functools.cache
def unlisted_aten_ops() -> list[str]:
    """Every overload of torch's aten namespace that is not on the allowlist, sorted."""
    from aot.allowed_ops import ALLOWED_OPS

    out = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out += [f"aten.{name}.{o}" for o in packet.overloads() if f"aten.{name}.{o}" not in ALLOWED_OPS]
    return sorted(out)


def _int_slots(value, path=()) -> Iterator[tuple]:
    """Paths of the integer literals inside a step argument (lists included)."""
    if type(value) is int:
        yield path
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _int_slots(v, path + (i,))


def view_arg_cases(base: bytes, rng: random.Random) -> Iterator[Case]:
    """Hostile sizes, strides, offsets, dims and ranks in the program's view steps, and strided
    views over weights and inputs: each refused, or run within its base's storage."""
    from aot.program import VIEW_OPS

    entries = read_entries(base)
    prog = program_json(entries)
    first_in = prog["inputs"][0]["name"]

    def signed(p, ops=()):
        out = with_program_text(entries, dumps(p))
        mm = manifest_of(out)
        mm["ops"] = sorted(set(mm["ops"]) | set(ops))
        return write_entries(with_manifest_text(out, manifest_bytes(mm)))

    # every view step of the program and of its kernels' references
    views = []
    for i, step in enumerate(prog["steps"]):
        if step["target"] in VIEW_OPS:
            views.append(("steps", i))
        views += [
            ("steps", i, "reference", j) for j, r in enumerate(step["reference"]) if r["target"] in VIEW_OPS
        ]
    for where in views:
        step = get_at(prog, where)
        for a, arg in enumerate(step["args"]):
            for slot in _int_slots(arg):
                for v in rng.sample(VIEW_ARG_VALUES, 8):
                    p = set_at(prog, (*where, "args", a, *slot), v)
                    yield Case(
                        "views:int-arg",
                        f"{step['target']}{path_text(where)}[{a}]{list(slot)}={v}",
                        signed(p),
                        CLEAN,
                    )
            if isinstance(arg, list):
                for label, value in (("empty", []), ("longer", [*arg, 1]), ("huge", [2**62] * len(arg))):
                    p = set_at(prog, (*where, "args", a), value)
                    yield Case(
                        "views:list-arg", f"{step['target']}{path_text(where)}[{a}] {label}", signed(p), CLEAN
                    )
    # strided views of a weight (geometry fixed: checked at load) and of an input (sized by the
    # call's symbols), then read through a copy
    weight = min(prog["weights"], key=lambda w: len(w["spec"]["shape"]))["name"]
    dtypes = {t["name"]: t["spec"]["dtype"] for t in (*prog["weights"], *prog["inputs"])}
    geometries = [
        ([4], [1], 0),
        ([4], [1], 2**40),
        ([65536], [1], 0),
        ([4], [2**40], 0),
        ([2, 2], [0, 1], 3),
        ([2**31, 2**31], [1, 1], 0),
        ([4], [1], -1),
        ([-1], [1], 0),
        ([4], [-1], 0),
        ([4, 4], [1], 0),
        ([{"sym": "batch*seq"}], [{"sym": "seq"}], 0),
        ([{"sym": "seq"}], [1], {"sym": "batch*4611686018427387903"}),
    ]
    for base_name in (weight, first_in):
        for size, stride, offset in geometries:
            p = copy.deepcopy(prog)
            p["steps"][0:0] = [
                {
                    "kind": "aten",
                    "target": "aten.as_strided.default",
                    "args": [{"buf": base_name}, size, stride, offset],
                    "kwargs": {},
                    "outputs": ["zz_view"],
                    "grid": [],
                    "reference": [],
                },
                {
                    "kind": "aten",
                    "target": "aten.clone.default",
                    "args": [{"buf": "zz_view"}],
                    "kwargs": {},
                    "outputs": ["zz_read"],
                    "grid": [],
                    "reference": [],
                },
            ]
            # declared as the view's own geometry, so each reaches the storage checks
            shape = [d["sym"] if isinstance(d, dict) else str(d) for d in size]
            for name in ("zz_view", "zz_read"):
                p["buffers"][name] = {"dtype": dtypes[base_name], "shape": shape}
            yield Case(
                "views:as_strided",
                f"{base_name} {size} {stride} {offset}"[:80],
                signed(p, ["aten.as_strided.default", "aten.clone.default"]),
                CLEAN,
            )


def resource_cases(base: bytes) -> Iterator[Case]:
    """Self-consistent bundles that would cost the loader far more than their size: overlapping
    members, deflated members beyond the total, a directory of too many entries, a weights header
    of 16 MiB, a program beyond the step bound, guard relations beyond theirs."""
    from aot.archive import MAX_MEMBERS
    from aot.loader.bundle import MAX_INFLATED_TOTAL, MAX_STEPS
    from aot.loader.guards import MAX_RELATIONS

    entries = read_entries(base)
    stored = [r.name for r in sorted(zip_layout(base), key=lambda r: r.local_offset) if r.method == 0]
    for name in stored[:-1]:
        yield Case("resources:zip-overlapping", name, overlapping(entries, name), "error")
    count = MAX_INFLATED_TOTAL // (1 << 20) + 8
    yield Case(
        "resources:zip-inflated-total",
        f"{count} x 1 MiB",
        write_entries(deflated_members(entries, count, 1 << 20)),
        "error",
    )
    many = entries + [Entry(f"kernels/k{i}.py", b"") for i in range(MAX_MEMBERS)]
    yield Case("resources:zip-many-members", str(len(many)), write_entries(many), "error")
    data = next(e.data for e in entries if e.name == "weights.safetensors")
    n = struct.unpack("<Q", data[:8])[0]
    text = data[8 : 8 + n] + b" " * (16 << 20)
    yield Case(
        "resources:weights-header",
        "16 MiB",
        write_entries(
            with_member(entries, "weights.safetensors", struct.pack("<Q", len(text)) + text + data[8 + n :])
        ),
        "error",
    )
    prog = program_json(entries)
    step = next(s for s in prog["steps"] if s["kind"] == "aten" and s["outputs"][0] is not None)
    source = step["outputs"][0]
    p = copy.deepcopy(prog)
    for i in range(MAX_STEPS + 1):
        p["steps"].append({**step, "outputs": [f"zz_{i}"]})
        p["buffers"][f"zz_{i}"] = p["buffers"][source]
    yield Case(
        "resources:program-steps",
        str(len(p["steps"])),
        write_entries(with_program_text(entries, dumps(p))),
        "error",
    )
    m = manifest_of(entries)
    symbol = m["guards"]["symbols"][0]["name"]
    source_line = {"text": "", "file": "model.py", "line": 1, "code": "x"}
    m["guards"]["relations"] = [{"expr": f"{symbol} >= {i % 2}", "source": source_line}] * (MAX_RELATIONS + 1)
    yield Case(
        "resources:guard-relations",
        str(MAX_RELATIONS + 1),
        write_entries(with_manifest_text(entries, manifest_bytes(m))),
        "error",
    )


def all_cases(model: str, base: bytes, canary_dir: Path) -> Iterator[Case]:
    rng = random.Random(f"{SEED}:{model}")
    yield from raw_cases(base, rng)
    yield from checksum_cases(base, rng)
    yield from member_cases(base, rng)
    yield from name_cases(base)
    yield from bomb_cases(base)
    yield from manifest_text_cases(base)
    yield from manifest_type_cases(base, rng)
    yield from manifest_shape_cases(base)
    yield from tensor_member_cases(base)
    yield from program_cases(base, rng, canary_dir)
    yield from resource_cases(base)


# ---------------------------------------------------------------------------------------------
# The harness.


class CaseTimeout(BaseException):
    """Raised by the timer; a BaseException so that no ``except Exception`` in the loader eats it."""


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_FS_EVENTS = {
    "os.remove",
    "os.rename",
    "os.replace",
    "os.mkdir",
    "os.rmdir",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.chmod",
    "os.chown",
    "os.utime",
    "os.system",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.putenv",
    "os.unsetenv",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
    "shutil.copytree",
    "tempfile.mkstemp",
    "tempfile.mkdtemp",
    "subprocess.Popen",
    "os.posix_spawn",
    "os.spawn",
    "os.exec",
    "pty.spawn",
    "exec",
    "pickle.find_class",
    "marshal.loads",
    "socket.connect",
    "socket.bind",
    "urllib.Request",
    "ctypes.dlopen",
    "ctypes.call_function",
}


class Watch:
    """Records side effects (file writes, spawns, exec, unpickling) while ``active``."""

    active = False
    events: list[tuple[str, str]] = []
    installed = False

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            sys.addaudithook(cls._hook)
            cls.installed = True

    @classmethod
    def _hook(cls, event: str, args) -> None:
        if not cls.active:
            return
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and flags & _WRITE_FLAGS
            )
            if writes:
                cls.events.append((event, str(path)))
        elif event in _FS_EVENTS:
            cls.events.append((event, repr(args)[:200]))


@dataclass
class Result:
    outcome: str
    seconds: float
    peak: int
    detail: str = ""


def run_case(case: Case, path: Path, inputs: dict, expected: list[torch.Tensor]) -> Result:
    path.write_bytes(case.data)
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    Watch.active = True
    runner = None
    try:
        try:
            runner = load(path)
        except (BundleError, EnvError) as e:
            return Result(f"{type(e).__name__}@load", 0, 0, str(e))
        try:
            out = runner(**{k: v.clone() for k, v in inputs.items()})
        except (BundleError, EnvError, GuardError) as e:
            return Result(f"{type(e).__name__}@call", 0, 0, str(e))
        out = list(out) if isinstance(out, tuple) else [out]
        same = len(out) == len(expected) and all(
            isinstance(o, torch.Tensor) and o.dtype == r.dtype and o.shape == r.shape and torch.equal(o, r)
            for o, r in zip(out, expected)
        )
        # the rest of what ``aotpack load`` touches must be clean too
        for extra in (runner.guards_text, runner.example_inputs, runner.reference_outputs):
            try:
                extra()
            except BundleError:
                pass
        return Result("accepted:same" if same else "accepted:changed", 0, 0)
    except CaseTimeout:
        return Result("TIMEOUT", 0, 0)
    except Exception as e:  # the failure this suite exists to find
        import traceback

        return Result(f"ESCAPED {type(e).__name__}", 0, 0, "".join(traceback.format_exception(e))[-1500:])
    finally:
        Watch.active = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        if runner is not None:
            runner.bundle.close()


def _on_alarm(signum, frame):
    raise CaseTimeout()


def measured(case, path, inputs, expected) -> Result:
    traced = case.category.startswith(TRACED)
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        r = run_case(case, path, inputs, expected)
    finally:
        r_peak = tracemalloc.get_traced_memory()[1] if traced else 0
        tracemalloc.stop()
    r.seconds = time.perf_counter() - start
    r.peak = r_peak
    return r


def allowed(case: Case, r: Result) -> bool:
    if r.outcome.startswith(("BundleError@", "EnvError@", "GuardError@call")):
        return True
    if r.outcome == "accepted:same":
        return case.policy in (SAME, CLEAN)
    if r.outcome == "accepted:changed":
        return case.policy == CLEAN
    return False


@pytest.mark.slow
def test_fuzz_bundles(tmp_path: Path, built) -> None:
    work = tmp_path / "work"
    canary = tmp_path / "outside"
    work.mkdir()
    canary.mkdir()
    victim = canary / "victim.bin"
    victim.write_bytes(b"\x01" * 64)
    before_cwd = sorted(os.listdir(os.getcwd()))

    Watch.install()
    old_alarm = signal.signal(signal.SIGALRM, _on_alarm)
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counts: dict[str, Counter] = defaultdict(Counter)
    log: list[str] = []
    seconds: Counter = Counter()
    failures: list[str] = []
    slowest = (0.0, "")
    peak = (0, "")
    total = 0
    t0 = time.perf_counter()
    bases = {model: built(model) for model in MODELS}  # before any case can disturb the process
    serde.schema_fingerprint()  # resolves the records' annotations (typing evaluates them) up front
    try:
        for model in MODELS:
            base_path = bases[model]
            base = base_path.read_bytes()
            runner = load(base_path)
            inputs = runner.example_inputs()
            expected = runner(**inputs)
            expected = list(expected) if isinstance(expected, tuple) else [expected]
            eager = eager_module(model)(**inputs)
            tol = 1e-2 if expected[0].dtype == torch.float16 else 1e-5
            torch.testing.assert_close(expected[0], eager, atol=tol, rtol=tol)
            runner.bundle.close()
            rng_state = torch.get_rng_state()  # after the eager model's seeded initialization
            for case in all_cases(model, base, canary):
                r = measured(case, work / "case.tpk", inputs, expected)
                total += 1
                seconds[case.category] += r.seconds
                log.append(f"{model}\t{case.category}\t{case.label!r}\t{r.outcome}\t{r.detail[:200]!r}")
                key = f"{case.category}"
                counts[key][r.outcome.split(" ")[0] if r.outcome.startswith("ESCAPED") else r.outcome] += 1
                where = f"[{model}] {case.category} {case.label!r}"
                if not allowed(case, r):
                    failures.append(f"{where}: {r.outcome} (policy {case.policy}) {r.detail[-600:]}")
                if r.seconds > slowest[0]:
                    slowest = (r.seconds, where)
                if r.peak > peak[0]:
                    peak = (r.peak, where)
                if r.seconds > CASE_TIMEOUT_S:
                    failures.append(f"{where}: took {r.seconds:.1f}s")
                if r.peak > CASE_PEAK_BYTES:
                    failures.append(f"{where}: peak Python allocation {r.peak / 2**20:.0f} MiB")
                if not (
                    torch.is_grad_enabled() and isinstance(torch.ops.aten.add, torch._ops.OpOverloadPacket)
                ):
                    failures.append(f"{where}: changed process state (grad mode or torch.ops.aten)")
                    torch.set_grad_enabled(True)
                if Watch.events:
                    failures.append(f"{where}: side effects {Watch.events[:3]}")
                    Watch.events.clear()
                if not torch.equal(torch.get_rng_state(), rng_state):
                    failures.append(f"{where}: advanced the process's random generator")
                    torch.set_rng_state(rng_state)
    finally:
        signal.signal(signal.SIGALRM, old_alarm)
    elapsed = time.perf_counter() - t0
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start

    outcomes = Counter()
    lines = [
        f"bundle fuzz: {total} cases in {elapsed:.1f}s (slowest {slowest[0] * 1e3:.0f} ms: {slowest[1]}; "
        f"peak Python allocation {peak[0] / 2**20:.1f} MiB: {peak[1]}; peak RSS growth {rss_growth / 2**20:.0f} MiB)"
    ]
    for cat in sorted(counts):
        outcomes.update(counts[cat])
        lines.append(
            f"  {cat:40s} {sum(counts[cat].values()):6d} {seconds[cat]:6.1f}s  "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts[cat].items()))
        )
    lines.append("  total: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    summary = "\n".join(lines)
    print(summary)
    if os.environ.get("AOT_FUZZ_SUMMARY"):  # for reports; failures in full
        Path(os.environ["AOT_FUZZ_SUMMARY"]).write_text(summary + "\n\n" + "\n".join(failures) + "\n")
        Path(os.environ["AOT_FUZZ_SUMMARY"] + ".log").write_text("\n".join(log) + "\n")

    assert victim.read_bytes() == b"\x01" * 64, "a bundle wrote into a file outside the case directory"
    assert sorted(os.listdir(canary)) == ["victim.bin"], f"a bundle created files: {os.listdir(canary)}"
    assert sorted(os.listdir(os.getcwd())) == before_cwd, "a bundle created files in the working directory"
    assert sorted(os.listdir(work)) == ["case.tpk"], f"the loader wrote beside the bundle: {os.listdir(work)}"
    assert isinstance(torch.ops.aten.add, torch._ops.OpOverloadPacket), "a bundle replaced torch.ops.aten.add"
    assert torch.is_grad_enabled(), "a bundle changed the grad mode"
    assert rss_growth < RSS_GROWTH_LIMIT, f"peak RSS grew by {rss_growth / 2**20:.0f} MiB"
    assert total > 3000
    assert not failures, f"{len(failures)} of {total} cases failed:\n" + "\n".join(failures[:40])


CASE_DRIVER = r"""
import json, signal, sys
from pathlib import Path

import torch

from aot.loader import load
from tests.loader import test_fuzz_bundle as fuzz

base, folder = sys.argv[1], Path(sys.argv[2])
runner = load(base)
inputs = runner.example_inputs()
expected = runner(**inputs)
expected = list(expected) if isinstance(expected, tuple) else [expected]
runner.bundle.close()
signal.signal(signal.SIGALRM, fuzz._on_alarm)
rng = torch.get_rng_state()
for i, (category, label, policy) in enumerate(json.loads((folder / "index.json").read_text())):
    case = fuzz.Case(category, label, (folder / f"{i}.tpk").read_bytes(), policy)
    r = fuzz.run_case(case, folder / "case.tpk", inputs, expected)
    clean = torch.is_grad_enabled() and torch.equal(torch.get_rng_state(), rng)
    print(json.dumps([i, r.outcome, fuzz.allowed(case, r) and clean, r.detail[-400:]]), flush=True)
"""


def run_in_subprocess(base: Path, cases: list[Case], folder: Path) -> list[tuple[Case, str, bool, str]]:
    """Each case loaded and called once in a fresh process (for cases that could crash one):
    (case, outcome, allowed, detail). A process that dies fails the test, naming the case."""
    folder.mkdir()
    for i, case in enumerate(cases):
        (folder / f"{i}.tpk").write_bytes(case.data)
    (folder / "index.json").write_text(json.dumps([[c.category, c.label, c.policy] for c in cases]))
    r = subprocess.run(
        [sys.executable, "-c", CASE_DRIVER, str(base), str(folder)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=Path(__file__).resolve().parents[2],
    )
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    if r.returncode != 0:
        at = cases[len(rows)] if len(rows) < len(cases) else None
        pytest.fail(
            f"the process died (status {r.returncode}) at case {len(rows)} of {len(cases)}: "
            f"{at.category if at else ''} {at.label if at else ''!r}; {r.stderr[-1500:]}"
        )
    return [(cases[i], outcome, ok, detail) for i, outcome, ok, detail in rows]


@pytest.mark.slow
def test_view_arguments_are_refused_or_stay_in_storage(tmp_path: Path, built) -> None:
    """Hostile sizes, strides, offsets and ranks in every view step, and strided views of weights
    and inputs: refused at load or at the call, or run within their base's storage (never a crash,
    in a subprocess so that a crash names its case)."""
    counts: Counter = Counter()
    bad = []
    for model in MODELS:
        cases = list(view_arg_cases(built(model).read_bytes(), random.Random(f"{SEED}:views:{model}")))
        for case, outcome, ok, detail in run_in_subprocess(built(model), cases, tmp_path / model):
            counts[(case.category, outcome)] += 1
            if not ok:
                bad.append(f"[{model}] {case.category} {case.label!r}: {outcome} {detail}")
    print("\n".join(f"  {c:20s} {o:24s} {n}" for (c, o), n in sorted(counts.items())))
    assert sum(counts.values()) > 150, counts
    assert counts[("views:as_strided", "BundleError@load")] >= 8, counts
    assert counts[("views:as_strided", "BundleError@call")] >= 4, counts
    assert not bad, f"{len(bad)} cases failed:\n" + "\n".join(bad[:30])


@pytest.mark.slow
def test_every_unlisted_aten_op_is_refused_at_load(tmp_path: Path, built) -> None:
    """Each overload of the aten namespace that is off the allowlist, called by a re-signed step
    that the manifest lists, is refused at load with a BundleError naming it (in a subprocess)."""
    base = built("branchy")
    entries = read_entries(base.read_bytes())
    prog = program_json(entries)
    cases = []
    for op in unlisted_aten_ops():
        p = copy.deepcopy(prog)
        p["steps"].insert(
            0,
            {
                "kind": "aten",
                "target": op,
                "args": [{"buf": prog["inputs"][0]["name"]}],
                "kwargs": {},
                "outputs": ["zz_op"],
                "grid": [],
                "reference": [],
            },
        )
        out = with_program_text(entries, dumps(p))
        m = manifest_of(out)
        m["ops"] = sorted({*m["ops"], op})
        cases.append(
            Case("ops:aten-namespace", op, write_entries(with_manifest_text(out, manifest_bytes(m))), "error")
        )
    assert len(cases) > 1500
    rows = run_in_subprocess(base, cases, tmp_path / "ops")
    bad = [
        f"{case.label}: {outcome} {detail[:200]}"
        for case, outcome, _, detail in rows
        if outcome != "BundleError@load" or case.label not in detail
    ]
    assert len(rows) == len(cases) and not bad, f"{len(bad)} ops not refused at load:\n" + "\n".join(bad[:30])


CLI_DRIVER = r"""
import contextlib, io, json, sys
from aot.cli import main

results = []
for path in sys.argv[1:]:
    for command in (["load", path, "--runs", "1"], ["inspect", path], ["guards", path]):
        err = io.StringIO()
        code = 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main(command)
            except SystemExit as e:
                code = e.code
        results.append({"command": command[0], "path": path, "code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""


def _one_line(stderr: str) -> bool:
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("loaded ")]
    return len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr


@pytest.mark.slow
def test_cli_prints_one_line_for_hostile_bundles(tmp_path: Path, built) -> None:
    """A sample of the fuzz cases through the CLI: two refused ones of every category, for which
    ``load`` exits 1 with exactly one ``error:`` line (``inspect`` and ``guards`` read less of a bundle:
    they succeed or do the same), and every altered reference member (what ``aotpack load``
    compares against), which may load or not. Never a traceback or an internal error."""
    canary = tmp_path / "outside"
    canary.mkdir()
    base_path = built("branchy")
    base = base_path.read_bytes()
    runner = load(base_path)
    inputs = runner.example_inputs()
    expected = [runner(**inputs)]
    runner.bundle.close()
    serde.schema_fingerprint()
    taken: Counter = Counter()
    paths: list[Path] = []
    may_load: set[str] = set()
    for case in all_cases("branchy", base, canary):
        if case.category == "tensors:reference":
            may_load.add(str(tmp_path / f"case{len(paths):03d}.tpk"))
        elif taken[case.category] >= 2 or not run_case(
            case, tmp_path / "probe.tpk", inputs, expected
        ).outcome.startswith(("BundleError", "EnvError")):
            continue
        taken[case.category] += 1
        paths.append(tmp_path / f"case{len(paths):03d}.tpk")
        paths[-1].write_bytes(case.data)
    assert len(taken) >= 40 and len(may_load) >= 15, taken
    r = subprocess.run(
        [sys.executable, "-c", CLI_DRIVER, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == 3 * len(paths)
    bad = [
        x
        for x in results
        if "Traceback" in x["stderr"]
        or "internal error" in x["stderr"]
        or (x["command"] == "load" and x["code"] == 0 and x["path"] not in may_load)
        or (x["code"] != 0 and (x["code"] != 1 or not _one_line(x["stderr"])))
    ]
    assert not bad, bad[:5]
    # and the real executable, for two of them
    for path in [p for p in paths if str(p) not in may_load][:2]:
        r = subprocess.run(
            [sys.executable, "-m", "aot.cli", "load", str(path)],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert r.returncode == 1 and _one_line(r.stderr), r.stderr


def _random_expr(rng: random.Random, depth: int = 0) -> str:
    """An expression of aotpack's grammar (what the tracer writes), with Python's meaning."""
    if depth > 4 or rng.random() < 0.25:
        return rng.choice(["batch", "seq", str(rng.randrange(0, 2000)), str(rng.choice([1, 2, 4, 8]))])
    kind = rng.randrange(6)
    a, b = _random_expr(rng, depth + 1), _random_expr(rng, depth + 1)
    if kind == 0:
        return f"({a} {rng.choice(['+', '-', '*'])} {b})"
    if kind == 1:
        return f"({a} {rng.choice(['//', '%'])} {rng.choice(['2', '3', '7', 'seq', 'batch'])})"
    if kind == 2:
        return f"{rng.choice(['max', 'min'])}({a}, {b})"
    if kind == 3:
        return f"(-{a})"
    cmp = f"({a} {rng.choice(['==', '!=', '<', '<=', '>', '>='])} {b})"
    if kind == 4:
        return cmp
    return f"({cmp} {rng.choice(['and', 'or'])} not {cmp})"


LINES_PER_CHAR = 100  # Python lines of aot.symexpr run per char of text to compile and evaluate it


class _TooMuchWork(BaseException):  # not an Exception: no handler in the code under test catches it
    pass


@contextlib.contextmanager
def _lines_counted(module, bound: int) -> Iterator[list[int]]:
    """Count the Python lines of ``module`` run inside the block: its work, not its time. Past
    ``bound`` the block is stopped (a loop that never ends fails at once instead of hanging)."""
    lines, source = [0], module.__file__

    def local(frame, event, arg):
        if event == "line":
            lines[0] += 1
            if lines[0] > bound:
                raise _TooMuchWork()
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == source else None

    sys.settrace(calls)
    try:
        yield lines
    except _TooMuchWork:
        pass
    finally:
        sys.settrace(None)


def test_symexpr_agrees_with_python_and_refuses_the_rest():
    """Random expressions of the grammar evaluate exactly as Python evaluates them (the test may use
    ``eval``: it generated the text); random corruptions of them compile or raise ``BundleError``,
    nothing else, each within a bound."""
    from aot import symexpr
    from aot.symexpr import compile_expr

    rng = random.Random(SEED)
    env = {"batch": 7, "seq": 300}
    alphabet = "()[]{}.,:;'\"\\@*/%+-<>=!~^&|_ \t\nabcxyz0123456789éλ\x00"
    compiled = refused = 0
    for _ in range(1500):
        text = _random_expr(rng)
        expr = compile_expr(text)
        assert expr(env) == int(eval(text, {"__builtins__": {}, "max": max, "min": min}, dict(env))), text
        compiled += 1
        for _ in range(3):
            chars = list(text)
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(chars) + 1)
                if rng.random() < 0.5 and chars:
                    del chars[min(i, len(chars) - 1)]
                else:
                    chars.insert(i, rng.choice(alphabet))
            mutated = "".join(chars)
            bound = LINES_PER_CHAR * (len(mutated) + 1)  # linear in the text (these reach ~32 per char)
            with _lines_counted(symexpr, bound) as lines:
                try:
                    compile_expr(mutated)(env)
                    compiled += 1
                except BundleError:
                    refused += 1
            assert lines[0] <= bound, (mutated, lines[0])
    assert compiled > 1500 and refused > 1000, (compiled, refused)
