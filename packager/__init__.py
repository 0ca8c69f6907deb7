"""Packager stage: ``Compiled`` → ``.tpk``, deterministically and atomically.

The archive is a zip: ``manifest.json`` first (readable, sorted keys), then members in sorted
order with fixed timestamps. Weights are safetensors, stored uncompressed and 64-byte aligned so
the loader can map them; the program is canonical JSON compressed with zstd. The manifest holds a
sha256 for every member. Output goes to a temporary file and ``os.replace``: a failed or killed
build never leaves a partial bundle at the target path, and a bundle already there stays intact
until the new one is complete.

A build killed mid-write (SIGKILL, power loss) leaves its temporary file ``.NAME.HOST-PID.*.partial``
beside the target. The next build of the same target removes those whose process no longer runs on
this machine; files of a live build, and of builds on other machines sharing the directory, are
left alone.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import socket
import struct
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from aot import schema, serde
from aot.manifest_text import manifest_of_bundle, render_manifest
from aot.packager.plan import memory_plan
from aot.schema import Manifest, Member
from aot.stages import Compiled, environment

ZIP_DATE = (1980, 1, 1, 0, 0, 0)
ZSTD_LEVEL = 10
ALIGN_EXTRA_ID = 0xD935  # the id zipalign uses for padding extras


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def _safetensors(tensors) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in sorted(tensors.items())})


def build_members(compiled: Compiled) -> dict[str, bytes]:
    """Every archive member except the manifest."""
    traced = compiled.traced
    members: dict[str, bytes] = {
        schema.PROGRAM_PATH: _zstd(serde.canonical_json(compiled.program)),
        schema.WEIGHTS_PATH: _safetensors(traced.weights),
    }
    reference = {f"{schema.REFERENCE_INPUT_PREFIX}{k}": v for k, v in traced.reference_inputs.items()}
    reference.update(
        {f"{schema.REFERENCE_OUTPUT_PREFIX}{i}": v for i, v in enumerate(traced.reference_outputs)}
    )
    members[schema.REFERENCE_PATH] = _safetensors(reference)
    for kernel in {
        k.id: k for p in (compiled.program, *compiled.program.variants) for k in p.kernels
    }.values():
        members[schema.KERNEL_SOURCE_FORMAT.format(kernel=kernel.id)] = kernel.source.encode()
        for arch in kernel.archs:
            members[schema.KERNEL_CUBIN_FORMAT.format(kernel=kernel.id, arch=arch)] = compiled.cubins[
                (kernel.id, arch)
            ]
    return members


def make_manifest(compiled: Compiled, members: dict[str, bytes], external_weights: str = "") -> Manifest:
    traced = compiled.traced
    env = environment(compiled.archs, traced.torch_version, compiled.triton_version, compiled.cuda_versions)
    steps = [s for p in (compiled.program, *compiled.program.variants) for s in p.steps]
    ops = sorted(
        {s.target for s in steps if s.kind == "aten"} | {r.target for s in steps for r in s.reference}
    )
    n_ref = sum(len(s.reference) if s.kind == "kernel" else 1 for s in compiled.program.steps)
    stats = replace(
        compiled.stats,
        steps=len(compiled.program.steps),
        aten_ops_replaced=n_ref,
        weights_bytes=len(members[schema.WEIGHTS_PATH]),
        reference_noise=traced.reference_noise,
        memory_plan=memory_plan(compiled.program, traced.buckets),
    )
    return Manifest(
        format=schema.FORMAT_NAME,
        schema_version=schema.SCHEMA_VERSION,
        name=traced.name,
        dtype=traced.dtype,
        guards=traced.guards,
        environment=env,
        buckets=traced.buckets,
        members={
            p: Member(sha256=hashlib.sha256(b).hexdigest(), size=len(b)) for p, b in sorted(members.items())
        },
        ops=tuple(ops),
        stats=stats,
        external_weights=external_weights,
        programs=tuple(
            schema.ProgramEntry(name=p.name, guards=p.guards, buckets=p.buckets) for p in traced.programs
        ),
    )


def _zipinfo(name: str, compress: bool) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    info.create_system = 3
    info.external_attr = 0o644 << 16
    return info


def _write_aligned(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    """Store ``data`` uncompressed with its first byte on a ``WEIGHTS_ALIGNMENT`` boundary."""
    info = _zipinfo(name, compress=False)
    header_end = zf.fp.tell() + 30 + len(name.encode()) + 4
    pad = (-header_end) % schema.WEIGHTS_ALIGNMENT
    info.extra = struct.pack("<HH", ALIGN_EXTRA_ID, pad) + b"\0" * pad
    zf.writestr(info, data)


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file that appears at ``path`` whole or not at all: written beside it, fsynced, renamed."""
    fd, tmp = _mkstemp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_bundle(path: str | os.PathLike, manifest: Manifest, members: dict[str, bytes]) -> None:
    """Write the archive to a temporary file beside ``path`` and move it into place."""
    write_archive(path, serde.canonical_json(manifest), members)


def write_archive(path: str | os.PathLike, manifest: bytes, members: dict[str, bytes]) -> None:
    """``write_bundle`` with the manifest's bytes as given (signing keeps them exactly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_file(path) as f, zipfile.ZipFile(f, "w") as zf:
        zf.writestr(_zipinfo(schema.MANIFEST_PATH, compress=True), manifest)
        for name in sorted(members):
            data = members[name]
            if name.endswith(".safetensors") or name.endswith(".cubin"):
                _write_aligned(zf, name, data)
            else:
                zf.writestr(_zipinfo(name, compress=name.endswith((".txt", ".py"))), data)


def external_weights_path(bundle: str | os.PathLike, sha256: str) -> Path:
    """``model.tpk`` → ``model.weights.<sha256[:16]>.safetensors`` beside it. Named by content, so
    a new build never replaces the weights an existing bundle at the same path still uses."""
    bundle = Path(bundle)
    return bundle.with_name(f"{bundle.stem}.weights.{sha256[:16]}.safetensors")


def pack(compiled: Compiled, path: str | os.PathLike, split_weights: bool = False) -> Manifest:
    """Write ``compiled`` as a bundle at ``path``; returns the manifest written.

    ``split_weights``: write the weights to ``<name>.weights.<sha>.safetensors`` beside the bundle
    (same bytes, same sha256 in the manifest) so the archive itself stays small, e.g. to ship
    kernels and weights separately; rebuilding with unchanged weights reuses the file.
    """
    members = build_members(compiled)
    weights_file = None
    if split_weights:
        weights_file = external_weights_path(path, hashlib.sha256(members[schema.WEIGHTS_PATH]).hexdigest())
    external = weights_file.name if weights_file else ""
    draft = make_manifest(compiled, members, external)
    members[schema.GUARDS_PATH] = render_manifest(manifest_of_bundle(draft)).encode()
    manifest = make_manifest(compiled, members, external)
    if weights_file is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        data = members.pop(schema.WEIGHTS_PATH)
        if not (weights_file.is_file() and weights_file.stat().st_size == len(data)):
            _write_atomic(weights_file, data)
    write_bundle(path, manifest, members)
    return manifest


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def remove_stale_partials(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed builds of ``path`` left beside it: those named for
    this machine and a process id that no longer runs. Returns what was removed."""
    path = Path(path)
    prefix = f".{path.name}.{_host()}-"
    removed = []
    for partial in path.parent.glob(glob.escape(prefix) + "*.partial"):
        pid = partial.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            partial.unlink()
            removed.append(partial)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (the new directory entry survives a power loss)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkstemp_beside(path: Path) -> tuple[int, str]:
    """A temporary file in the target's directory (so ``os.replace`` is atomic), with the
    permissions a plain ``open`` would give it; stale ones of killed builds are removed first."""
    remove_stale_partials(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.{_host()}-{os.getpid()}.", suffix=".partial", dir=path.parent
    )
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def _write_atomic(path: Path, data: bytes) -> None:
    with _atomic_file(path) as f:
        f.write(data)
