"""Open a ``.tpk`` and verify it before anything in it is used.

The end-of-central-directory record is read first, so an archive whose directory is too large or
holds too many entries is refused before ``zipfile`` parses it. Every member's name is checked
against the schema's layout, its size against the manifest and the zip directory, its local header
and data against every other member's (no two overlap, all lie before the directory), and its
sha256 before it is parsed: at open for every member but the weights (checked when they are read).
Each member is read from the archive once and kept (``aot.archive``, the zip layer): the
signature check, the checksum and the parser see the same bytes, so a file rewritten while it loads
cannot slip a second version past the checks. Reads are bounded by the sizes the manifest declares, and the deflated
members together by ``MAX_INFLATED_TOTAL``, so a zip bomb, overlapping members or a lying
directory end in a ``BundleError``, not an allocation or minutes of inflating. The
program must agree with the manifest (inputs, ops, symbols, kernels) and every expression in it
must parse, so a hostile bundle is refused at load rather than on some later call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aot import schema
from aot.archive import (
    COMPRESSIONS,
    CORRUPT,
    LOCAL_HEADER,
    MAX_MANIFEST_BYTES,
    MAX_MEMBERS,
    Members,
    check_directory,
    check_layout,
    not_a_zip,
    read_bounded,
    unreadable,
)
from aot.buckets import check_buckets
from aot.digests import check_chunks, check_member, spans
from aot.digests import mismatch as chunk_mismatch
from aot.errors import BundleError, BundleWarning
from aot.program import all_steps, check_greedy, check_scratch
from aot.schema import Manifest, Program, StepKind, Sym, SymBool, SymFloat
from aot.serde import from_json, upgrade_manifest
from aot.signature import check_signature, signature_problem, trusted_keys
from aot.signing import MAX_SIGNATURE_BYTES
from aot.symexpr import FloatText, compile_expr

MAX_PROGRAM_BYTES = 16 << 20  # decompressed program JSON; GPT-2 small with its kernels is well under 1 MB
# JSON arrays and objects per manifest or program: each becomes a Python object (~60-100 bytes), so
# this bounds what parsing allocates (16 MiB of "[]," would otherwise be ~400 MB of lists).
MAX_JSON_CONTAINERS = 1 << 20
# JSON values (bounded by the commas between them): each is decoded into a record field at ~10 µs,
# so this bounds load time (GPT-2 small's program holds ~6,000)
MAX_JSON_VALUES = 1 << 19
MAX_DEFLATED_BYTES = 64 << 20  # a deflated member (manifest, guards, kernel source) inflates to at most this
MAX_INFLATION = 200  # uncompressed / compressed ratio beyond which a member is a zip bomb
# All deflated members together (manifest, guards, kernel sources): what opening a bundle inflates
# and hashes at most. GPT-2 small's are 20 kB; a model with a thousand kernels stays under 20 MB.
MAX_INFLATED_TOTAL = 64 << 20
MAX_JSON_DEPTH = 64  # nesting of manifest and program JSON; real bundles stay under 12
MAX_STEP_OUTPUTS = 1 << 16  # results of one step (split, unbind): far above any model's widest split
# Steps of all programs, kernels' reference steps included: each is run (and its arguments
# evaluated) on every call. GPT-2 small has 395, a 32-layer Llama about 1,500, a 100-layer
# decoder about 5,000.
MAX_STEPS = 20_000
# Syntax-tree nodes of all the programs' size expressions (shapes, arguments, grids), evaluated on
# every call: GPT-2 small has 3,248, about 8 a step.
MAX_EXPRESSION_NODES = 20 * MAX_STEPS
_REQUIRED = (schema.PROGRAM_PATH, schema.WEIGHTS_PATH, schema.REFERENCE_PATH, schema.GUARDS_PATH)
_KERNEL_MEMBER = re.compile(r"^kernels/[a-z0-9_]{1,80}\.(py|sm_[0-9]{2,3}a?\.cubin)$")
_EXTERNAL_WEIGHTS = re.compile(r"^[A-Za-z0-9_.-]{1,200}\.safetensors$")
_FIXED_MEMBERS = {
    schema.MANIFEST_PATH,
    schema.SIGNATURE_PATH,
    schema.PROGRAM_PATH,
    schema.WEIGHTS_PATH,
    schema.REFERENCE_PATH,
    schema.GUARDS_PATH,
    schema.TUNING_PATH,
}


def _valid_name(name: str) -> bool:
    return name in _FIXED_MEMBERS or bool(_KERNEL_MEMBER.match(name))


class WeightsStream:
    """The weights member's bytes (``Bundle.weights_stream``). ``read_at`` fills a buffer from an
    offset of the member: from any thread at any offset where ``positional`` (the member stored in
    the archive or in its own file), else front to back only (the zip's inflating stream).
    ``spans`` are the chunks the manifest lists a sha256 for (one span without chunk digests);
    the reader hashes each chunk's bytes where it uses them and hands the digest to ``check``;
    ``finish`` refuses the stream unless every chunk was checked, so the bytes checked are the
    bytes the caller copied."""

    def __init__(self, f, member: schema.Member, path: Path, start: int | None):
        """``start``: where the member begins in ``f``'s file, for positional reads; None: read
        ``f`` in order."""
        self._f, self.member, self.path = f, member, path
        self._start = start
        self.positional = start is not None and hasattr(os, "preadv")
        self.size = member.size
        self.spans = spans(member)
        self._at = 0  # the next offset of an in-order stream
        self._checked: set[int] = set()
        self._lock = threading.Lock()

    def read_at(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from byte ``offset`` of the member (fewer bytes only at its end); how
        many bytes came."""
        want = max(0, min(len(buffer), self.size - offset))
        got = 0
        try:
            if self.positional:
                fd = self._f.fileno()
                while got < want:
                    n = os.preadv(fd, [buffer[got:want]], self._start + offset + got)
                    if not n:
                        break
                    got += n
                return got
            assert offset == self._at, (offset, self._at)  # an in-order stream is read in order
            while got < want:
                n = self._f.readinto(buffer[got:want])
                if not n:
                    break
                got += n
            self._at += got
            return got
        except Exception as e:  # zlib.error, BadZipFile, OSError ...
            raise unreadable(self.path, schema.WEIGHTS_PATH, e) from None

    def check(self, index: int, digest: hashlib._Hash, end: int) -> None:
        """``BundleError`` unless chunk ``index`` was read to its end (``end``: where its reads
        stopped) and ``digest`` holds its sha256 as the manifest lists it."""
        begin, stop, want = self.spans[index]
        if end != stop or digest.hexdigest() != want:
            raise chunk_mismatch(self.path, schema.WEIGHTS_PATH, self.member, index)
        with self._lock:
            self._checked.add(index)

    def check_head(self, head: bytes) -> None:
        """``BundleError`` if a chunk holding ``head`` (the member's first bytes, read already:
        its safetensors header) is not as the manifest lists it; the rest of those chunks is read
        to know. What a reader runs once the header is refused, so that a damaged bundle is told
        it is damaged rather than what its header got wrong."""
        for index, (begin, end, _) in enumerate(self.spans):
            if begin >= len(head):
                break
            digest, at = hashlib.sha256(head[begin:end]), min(len(head), end)
            piece = memoryview(bytearray(min(1 << 20, max(end - at, 1))))
            while at < end and (n := self.read_at(at, piece[: end - at])):
                digest.update(piece[:n])
                at += n
            self.check(index, digest, at)

    def finish(self) -> None:
        """``BundleError`` unless every chunk was checked."""
        missing = set(range(len(self.spans))) - self._checked
        if missing:
            raise chunk_mismatch(self.path, schema.WEIGHTS_PATH, self.member, min(missing))


@dataclass
class Bundle:
    """An opened, verified bundle. ``read`` returns a member's bytes: those whose sha256 was checked
    at open, or for the weights, read and checked on the call."""

    path: Path
    manifest: Manifest
    _zip: zipfile.ZipFile
    _infos: dict[str, zipfile.ZipInfo]
    _members: Members

    def read(self, name: str) -> bytes:
        member = self.manifest.members.get(name)
        if member is None:
            raise BundleError(f"{self.path}: member {name!r} is missing; rebuild the bundle")
        if name == schema.WEIGHTS_PATH and self.manifest.external_weights:
            data = self._read_external(member.size)
        elif name == schema.WEIGHTS_PATH:
            data = read_bounded(self._zip, self._infos[name], member.size, self.path)
        else:
            data = self._members.read(self._infos[name], member.size)  # checked at open
        check_member(data, member, name, self.path)
        return data

    @contextlib.contextmanager
    def weights_stream(self) -> Iterator[WeightsStream]:
        """The weights member to read once, front to back, into memory the caller owns
        (``WeightsStream.readinto``): from its place in the archive where it is stored (the
        packager stores it), the split weights file, or the zip's inflating stream where it is
        deflated. Nothing is kept; the stream hashes what it hands on, and ``WeightsStream.finish``
        refuses a short read or a sha256 other than the manifest's, so the bytes checked are the
        bytes the caller copied."""
        member = self.manifest.members[schema.WEIGHTS_PATH]
        start = None  # where the member starts in the file opened, if stored
        try:
            if self.manifest.external_weights:
                path = self.external_path()
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
                f = open(fd, "rb", buffering=0)
                _check_regular(path, os.fstat(fd), member.size)
                start = 0
            else:
                info = self._infos[schema.WEIGHTS_PATH]
                if info.compress_type == zipfile.ZIP_STORED:
                    f = open(self.path, "rb", buffering=0)
                    f.seek(info.header_offset)
                    _, name_length, extra_length = LOCAL_HEADER.unpack(f.read(LOCAL_HEADER.size))
                    start = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
                    f.seek(start)
                else:
                    f = self._zip.open(info)
        except OSError as e:
            raise BundleError(
                f"{self.path}: its weights are unreadable ({e.strerror}); re-copy the bundle"
            ) from None
        try:
            yield WeightsStream(f, member, self.path, start)
        finally:
            f.close()

    def check_weights(self) -> None:
        """Hash the weights in bounded memory, keeping none of them: what a report on the bundle
        (``inspect``, ``guards``) checks, so that it never vouches for corrupt weights."""
        member = self.manifest.members[schema.WEIGHTS_PATH]
        if self.manifest.external_weights:
            check_member(self._read_external(member.size), member, schema.WEIGHTS_PATH, self.path)
            return
        try:
            with self._zip.open(self._infos[schema.WEIGHTS_PATH]) as f:
                for index, (begin, end, want) in enumerate(spans(member)):
                    digest, left = hashlib.sha256(), end - begin
                    while left and (piece := f.read(min(1 << 20, left))):
                        digest.update(piece)
                        left -= len(piece)
                    if left or digest.hexdigest() != want:
                        raise chunk_mismatch(self.path, schema.WEIGHTS_PATH, member, index)
                if f.read(1):
                    raise chunk_mismatch(self.path, schema.WEIGHTS_PATH, member, len(spans(member)) - 1)
        except BundleError:
            raise
        except Exception as e:  # zlib.error, BadZipFile (CRC), EOFError, OSError ...
            raise unreadable(self.path, schema.WEIGHTS_PATH, e) from None

    def external_path(self) -> Path:
        name = self.manifest.external_weights
        if not _EXTERNAL_WEIGHTS.match(name):
            raise BundleError(
                f"{self.path}: external weights name {name[:80]!r} is not a plain .safetensors file name"
            )
        return self.path.with_name(name)

    def _read_external(self, size: int) -> bytes:
        """The split weights file, once it is known to be a regular file of exactly ``size`` bytes:
        a FIFO or a device named like it would block the load or never end."""
        path = self.external_path()
        try:
            _check_regular(path, os.stat(path), size)
            # O_NONBLOCK: should the name be swapped for a FIFO after the stat, open does not wait
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
            with open(fd, "rb") as f:
                _check_regular(path, os.fstat(fd), size)
                return f.read(size)
        except OSError as e:
            raise BundleError(
                f"{self.path}: its weights file {path.name} is unreadable ({e.strerror}); "
                f"keep it beside the bundle"
            ) from None

    def program(self) -> Program:
        import zstandard

        data = self.read(schema.PROGRAM_PATH)
        try:
            size = zstandard.frame_content_size(data)
            if size < 0 or size > MAX_PROGRAM_BYTES:
                raise BundleError(f"{self.path}: program declares {size} bytes (limit {MAX_PROGRAM_BYTES})")
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_PROGRAM_BYTES)
            tree = _json_loads(raw, self.path, "program")
            _check_depth(tree, self.path, "program")
            _check_raw_steps(tree, self.path)
            program = from_json(Program, tree, "program")
        except BundleError:
            raise
        except (zstandard.ZstdError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise BundleError(f"{self.path}: program is unreadable: {type(e).__name__}: {e}") from None
        _check_program(program, self.manifest, self.path)
        return program

    def signature(self):
        """``(Signature, manifest bytes)`` of a signed bundle, not verified; None when unsigned. The
        manifest bytes are those this bundle's manifest was parsed from."""
        from aot.signing import decode

        data = self._members.signed(schema.SIGNATURE_PATH, MAX_SIGNATURE_BYTES)
        if data is None:
            return None
        return decode(data, str(self.path)), self._members.signed(schema.MANIFEST_PATH, MAX_MANIFEST_BYTES)

    def close(self) -> None:
        self._zip.close()


def _check_regular(path: Path, info: os.stat_result, size: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise BundleError(
            f"{path}: not a regular file; the bundle's weights file must be the plain file built with it"
        )
    if info.st_size != size:
        raise BundleError(
            f"{path}: {info.st_size} bytes, the bundle expects {size}; "
            f"copy the weights file that was built with this bundle"
        )


def _json_loads(raw: bytes, path: Path, what: str) -> object:
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise BundleError(
            f"{path}: {what} holds {containers} JSON arrays/objects (limit {MAX_JSON_CONTAINERS})"
        )
    values = raw.count(b",")
    if values > MAX_JSON_VALUES:
        raise BundleError(f"{path}: {what} holds {values} JSON values (limit {MAX_JSON_VALUES})")
    return json.loads(raw.decode("utf-8"))


def _check_depth(tree: object, path: Path, what: str) -> None:
    """Refuse JSON nested deeper than ``MAX_JSON_DEPTH`` before anything recurses over it."""
    level, depth = [tree], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise BundleError(
                f"{path}: {what} is nested deeper than {MAX_JSON_DEPTH} levels; not a bundle this loader wrote"
            )
        level = [
            v
            for node in level
            if isinstance(node, (list, dict))
            for v in (node.values() if isinstance(node, dict) else node)
        ]


def _check_raw_steps(tree: object, path: Path) -> None:
    """The step bounds on the raw program JSON, before it is decoded into records (decoding a
    million steps or step results alone would take a minute): at most ``MAX_STEPS`` steps over the
    program, its variants and kernels' reference steps, and at most ``MAX_STEP_OUTPUTS`` results
    per step. (Types are checked later.)"""
    programs, steps, count = [tree], [], 0
    while programs:
        program = programs.pop()
        if isinstance(program, dict):
            programs += _list(program.get("variants"))
            steps += _list(program.get("steps"))
            for site in _list(program.get("alternatives")):
                for cand in _list(site.get("candidates") if isinstance(site, dict) else None):
                    steps += _list(cand.get("steps") if isinstance(cand, dict) else None)
    while steps:
        step = steps.pop()
        count += 1
        if not isinstance(step, dict):
            continue
        steps += _list(step.get("reference"))
        outputs = _list(step.get("outputs"))
        if len(outputs) > MAX_STEP_OUTPUTS:
            raise BundleError(
                f"{path}: step {str(step.get('target'))[:80]} binds {len(outputs)} results "
                f"(limit {MAX_STEP_OUTPUTS}); rebuild the bundle with a trusted aotpack"
            )
        _check_step_count(count, path)


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _step_targets(steps) -> set[str]:
    out: set[str] = set()
    for step in steps:
        if step.kind == StepKind.ATEN:
            out.add(step.target)
        out |= _step_targets(step.reference)
    return out


def _check_program(program: Program, manifest: Manifest, path: Path) -> None:
    """The program must agree with the manifest that was checked before it: the same inputs as the
    guards, only ops the manifest lists (so the preflight of ``manifest.ops`` covers every call), and
    symbols that the guards bind."""
    _check_size(program, path)
    want = [(i.name, i.dtype, tuple(i.shape)) for i in manifest.guards.inputs]
    got = [(i.name, i.spec.dtype, tuple(i.spec.shape)) for i in program.inputs]
    if want != got:
        raise BundleError(
            f"{path}: the program's inputs {got[:4]} differ from the manifest's guards {want[:4]}"
        )
    unlisted = sorted(_step_targets(all_steps(program)) - set(manifest.ops))
    if unlisted:
        raise BundleError(
            f"{path}: the program calls {unlisted[0][:80]!r}, which the manifest's ops do not list"
        )
    symbols = {s.name for s in manifest.guards.symbols}
    names = {i.name: len(i.spec.shape) for i in program.inputs}
    for src in program.symbols:
        if src.symbol not in symbols or not 0 <= src.dim < names.get(src.input, 0):
            raise BundleError(
                f"{path}: program symbol {src.symbol[:40]!r} is read from {src.input[:40]!r} dim "
                f"{src.dim}, which the guards do not declare"
            )
    for p in (program, *program.variants):
        check_scratch(p, str(path))
        check_greedy(p, str(path))
    kernels = {k.id for k in program.kernels}
    for step in all_steps(program):
        if step.kind == StepKind.KERNEL and step.target not in kernels:
            raise BundleError(
                f"{path}: a step launches kernel {step.target[:40]!r}, which the program does not define"
            )
    for k in program.kernels:
        needed = [schema.KERNEL_SOURCE_FORMAT.format(kernel=k.id)]
        needed += [schema.KERNEL_CUBIN_FORMAT.format(kernel=k.id, arch=a) for a in k.archs]
        missing = [n for n in needed if n not in manifest.members or not _valid_name(n)]
        if missing:
            raise BundleError(f"{path}: kernel {k.id[:40]!r} has no member {missing[0][:80]!r}")
    if not program.outputs:
        raise BundleError(f"{path}: the program has no outputs")
    for p in (program, *program.variants):
        if p.alternatives:
            from aot.tuning import check_alternatives  # only tuned bundles have GEMM alternatives

            check_alternatives(p, path)
    # every size, argument and grid expression parses and uses only symbols the guards bind
    for text in _expressions(program):
        unknown = compile_expr(text, floats=isinstance(text, FloatText)).symbols - symbols
        if unknown:
            raise BundleError(
                f"{path}: program expression {text[:60]!r} uses {sorted(unknown)[0][:40]!r}, "
                f"which is not a symbol of the guards"
            )


def _check_step_count(steps: int, path: Path) -> None:
    if steps > MAX_STEPS:
        raise BundleError(
            f"{path}: the programs have {steps} steps (limit {MAX_STEPS}); not a bundle this aotpack wrote"
        )


def _check_size(program: Program, path: Path) -> None:
    """What a call costs the runner before any tensor math, beyond its steps (counted on the raw
    JSON by ``_check_raw_steps``): the size expressions it evaluates, over the program and its
    variants, within ``MAX_EXPRESSION_NODES``."""
    programs = [program, *program.variants]
    nodes = 0
    for p in programs:
        for text in _expressions(p):
            nodes += compile_expr(text, floats=isinstance(text, FloatText)).nodes
            if nodes > MAX_EXPRESSION_NODES:
                raise BundleError(
                    f"{path}: the programs' size expressions have more than {MAX_EXPRESSION_NODES} "
                    f"syntax nodes (the limit); not a bundle this aotpack wrote"
                )


def _expressions(program: Program):
    for spec in [
        *(i.spec for i in program.inputs),
        *(w.spec for w in program.weights),
        *program.buffers.values(),
    ]:
        yield from spec.shape
    steps = list(all_steps(program))
    while steps:
        step = steps.pop()
        yield from step.grid
        steps.extend(step.reference)
        values = [*step.args, *step.kwargs.values()]
        while values:
            v = values.pop()
            if isinstance(v, list):
                values.extend(v)
            elif isinstance(v, (Sym, SymBool)):
                yield v.text
            elif isinstance(v, SymFloat):
                yield FloatText(v.text)


def open_bundle(path: str | os.PathLike, trusted: tuple[bytes, ...] | None = None) -> Bundle:
    """Open and verify the directory, manifest and members of a bundle (the weights are checked
    when read). It must be signed by one of the ``trusted`` public keys (None: those of
    ``$AOTPACK_TRUST``, see ``aot.signature.trusted_keys``; ``()``: no trust list, for
    reading a bundle to sign it), checked before anything but the zip directory is read. Without a
    trust list, a signature that does not match the manifest is a ``BundleWarning``."""
    path = Path(path)
    if trusted is None:
        trusted = trusted_keys(None)
    if not path.is_file():
        raise BundleError(f"bundle {path} does not exist or is not a file")
    try:
        directory_start = check_directory(path)
        zf = zipfile.ZipFile(path, "r")
    except BundleError:
        raise
    except Exception as e:
        raise not_a_zip(path, f"not a readable zip archive: {type(e).__name__}") from None
    members = Members(zf, path)
    try:
        if trusted:
            manifest = lambda: members.signed(schema.MANIFEST_PATH, MAX_MANIFEST_BYTES) or b""  # noqa: E731
            verified = check_signature(
                members.signed(schema.SIGNATURE_PATH, MAX_SIGNATURE_BYTES), manifest, path, trusted, zf
            )
            if verified is not None:  # a detached signature covered the archive: parse its pass's bytes
                members.keep(schema.MANIFEST_PATH, verified)
        bundle = _verify(path, zf, directory_start, members)
        if not trusted:
            _warn_on_signature(bundle, members)
    except BaseException:
        zf.close()
        raise
    return bundle


def _warn_on_signature(bundle: Bundle, members: Members) -> None:
    """No trust list asked for a signature; a signed bundle whose signature fails still loads, with a
    warning (the signature member is read, bounded, only when there is one)."""
    info, manifest = bundle._infos.get(schema.SIGNATURE_PATH), bundle._infos[schema.MANIFEST_PATH]
    if info is None:
        return
    if info.file_size > MAX_SIGNATURE_BYTES:
        problem = (
            f"{bundle.path}: its signature member is {info.file_size} bytes (limit {MAX_SIGNATURE_BYTES})"
        )
    else:
        problem = signature_problem(
            members.read(info, info.file_size), members.read(manifest, manifest.file_size), bundle.path
        )
    if problem:
        warnings.warn(BundleWarning(problem), stacklevel=3)


def _verify(path: Path, zf: zipfile.ZipFile, directory_start: int, members: Members) -> Bundle:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise BundleError(f"{path}: {len(infos)} members (limit {MAX_MEMBERS}); not a bundle")
    by_name: dict[str, zipfile.ZipInfo] = {}
    archive_size = path.stat().st_size
    inflated = 0
    for info in infos:
        name = info.filename
        if not _valid_name(name) or info.orig_filename != name:  # zipfile cuts names at NUL
            raise BundleError(
                f"{path}: unexpected member {info.orig_filename[:80]!r}; bundles hold only the schema's members"
            )
        if name in by_name:
            raise BundleError(f"{path}: member {name!r} appears twice")
        if info.flag_bits & 0x1:
            raise BundleError(f"{path}: member {name!r} is encrypted")
        if info.compress_type not in COMPRESSIONS:
            raise BundleError(
                f"{path}: member {name!r} uses compression method {info.compress_type}; "
                f"bundles are stored or deflated"
            )
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > MAX_DEFLATED_BYTES:
            raise BundleError(
                f"{path}: member {name!r} inflates to {info.file_size} bytes "
                f"(limit {MAX_DEFLATED_BYTES} for compressed members)"
            )
        if info.compress_type == zipfile.ZIP_STORED and info.file_size > archive_size:
            raise BundleError(f"{path}: member {name!r} claims {info.file_size} bytes, more than the archive")
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_INFLATION * max(
            info.compress_size, 1
        ) + (1 << 20):
            raise BundleError(
                f"{path}: member {name!r} inflates {info.compress_size} → {info.file_size} bytes; refusing"
            )
        if info.compress_type != zipfile.ZIP_STORED:
            inflated += info.file_size
            if inflated > MAX_INFLATED_TOTAL:
                raise BundleError(
                    f"{path}: compressed members inflate to more than {MAX_INFLATED_TOTAL} bytes in all "
                    f"(the limit); not a bundle"
                )
        by_name[name] = info
    check_layout(path, infos, directory_start)
    if schema.MANIFEST_PATH not in by_name:
        raise BundleError(f"{path}: no {schema.MANIFEST_PATH}; not a bundle or truncated")
    minfo = by_name[schema.MANIFEST_PATH]
    if minfo.file_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: manifest is {minfo.file_size} bytes (limit {MAX_MANIFEST_BYTES})")
    raw = members.read(minfo, minfo.file_size)  # the bytes a trust check verified, if any
    try:
        data = _json_loads(raw, path, "manifest")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BundleError(
            f"{path}: manifest is not UTF-8 JSON ({type(e).__name__}): the bundle is {CORRUPT}"
        ) from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: manifest is not a JSON object")
    _check_depth(data, path, "manifest")
    if data.get("format") != schema.FORMAT_NAME:
        raise BundleError(f"{path}: not an aotpack bundle (format {str(data.get('format'))[:40]!r})")
    version = data.get("schema_version")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(type(v) is int and v >= 0 for v in version)
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
    manifest = from_json(Manifest, upgrade_manifest(data), "manifest")
    absent = [m for m in _REQUIRED if m not in manifest.members]
    if absent:
        raise BundleError(f"{path}: the manifest lists no {absent[0]}; every bundle has one, rebuild it")
    check_buckets(manifest.buckets, manifest.guards, str(path))
    listed = set(manifest.members) - ({schema.WEIGHTS_PATH} if manifest.external_weights else set())
    present = set(by_name) - {schema.MANIFEST_PATH, schema.SIGNATURE_PATH}
    if listed != present:
        missing, extra = sorted(listed - present), sorted(present - listed)
        raise BundleError(
            f"{path}: members do not match the manifest: missing {missing[:3]}, unlisted {extra[:3]}"
        )
    for name, member in manifest.members.items():
        if name in by_name and by_name[name].file_size != member.size:
            raise BundleError(
                f"{path}: member {name!r} is {by_name[name].file_size} bytes, the manifest says {member.size}"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", member.sha256):
            raise BundleError(f"{path}: member {name!r} has a malformed sha256")
        check_chunks(member, name, path)
    # Every member but the weights (which the loader reads, and checks, right away) is checked now,
    # so a corrupt bundle is refused at open even where a member is not used on this device.
    for name, member in manifest.members.items():
        if name in by_name and name != schema.WEIGHTS_PATH:
            check_member(members.read(by_name[name], member.size), member, name, path)
    return Bundle(path=path, manifest=manifest, _zip=zf, _infos=by_name, _members=members)
