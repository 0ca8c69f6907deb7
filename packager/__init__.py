"""Packager stage: ``Compiled`` → ``.tpk``, deterministically and atomically.

The archive is a zip: ``manifest.json`` first (readable, sorted keys), then members in sorted
order with fixed timestamps. Weights are safetensors, stored uncompressed and 64-byte aligned so
the loader can map them; the program is canonical JSON compressed with zstd. The manifest holds a
sha256 for every member. Output goes to a temporary file and ``os.replace``: a failed or killed
build never leaves a partial bundle at the target path, and a bundle already there stays intact
until the new one is complete.

A build killed mid-write (SIGKILL, power loss) leaves its temporary file ``.NAME.HOST-PID.*.partial``
beside the target. The next build of the same target removes those no live process holds locked
(``aot.packager.files``); it also removes the earlier ``NAME.weights.*`` files that no bundle refers
to any more. A write the system refuses (disk full, read-only) is an ``EnvError`` that
says what to do, with nothing left behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import struct
import zipfile
from dataclasses import replace
from pathlib import Path

from aot import schema, serde
from aot.digests import chunk_sha256
from aot.errors import CodegenError, EnvError
from aot.manifest_text import manifest_of_bundle, render_manifest
from aot.packager.files import atomic_file, collect_weights, weights_in_place
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


def _check_weights(compiled: Compiled) -> None:
    """Every weight a program declares and some step of it reads (a candidate's too, which only a
    GPU runs; ``aot.loader.weights_read``'s rule on a GPU) is in the weights the bundle holds: a
    bundle that would load on a CPU and fail on a GPU is a build's error, caught here."""
    from aot.program import all_steps, buffers_read

    held = compiled.traced.weights
    for index, program in enumerate((compiled.program, *compiled.program.variants)):
        declared = {w.name for w in program.weights}
        missing = sorted((buffers_read(all_steps(program)) & declared) - set(held))
        if missing:
            raise CodegenError(
                f"program {index} reads weights the bundle would not hold: {missing[:3]}; "
                "an aotpack bug: please report it with the model"
            )


def build_members(compiled: Compiled) -> dict[str, bytes]:
    """Every archive member except the manifest."""
    _check_weights(compiled)
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
    if compiled.tuning is not None:  # the build's built-in table (aot.codegen.gemm_defaults)
        members[schema.TUNING_PATH] = serde.canonical_json(compiled.tuning)
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
        members={p: _member(p, b) for p, b in sorted(members.items())},
        ops=tuple(ops),
        stats=stats,
        external_weights=external_weights,
        programs=tuple(
            schema.ProgramEntry(name=p.name, guards=p.guards, buckets=p.buckets, entry=p.entry)
            for p in traced.programs
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


def _member(name: str, data: bytes) -> Member:
    """A member's manifest entry; the weights also get the sha256 of each chunk, which the loaders
    check on several threads (``aot.digests``)."""
    chunk_bytes, chunks = chunk_sha256(data) if name == schema.WEIGHTS_PATH else (0, ())
    return Member(
        sha256=hashlib.sha256(data).hexdigest(), size=len(data), chunk_bytes=chunk_bytes, chunk_sha256=chunks
    )


def write_bundle(path: str | os.PathLike, manifest: Manifest, members: dict[str, bytes]) -> None:
    """Write the archive to a temporary file beside ``path`` and move it into place."""
    write_archive(path, serde.canonical_json(manifest), members)


def write_archive(path: str | os.PathLike, manifest: bytes, members: dict[str, bytes]) -> None:
    """``write_bundle`` with the manifest's bytes as given (signing keeps them exactly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f, zipfile.ZipFile(f, "w") as zf:
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
    kernels and weights separately; rebuilding with unchanged weights reuses the file when its
    content still matches. Earlier weights files of ``path`` that no bundle refers to any more are
    removed, whether or not this build splits its own.
    A write the system refuses raises ``EnvError``; the target keeps what it held before.
    """
    path = Path(path)
    members = build_members(compiled)
    weights_sha256 = hashlib.sha256(members[schema.WEIGHTS_PATH]).hexdigest() if split_weights else ""
    weights_file = external_weights_path(path, weights_sha256) if split_weights else None
    external = weights_file.name if weights_file else ""
    draft = make_manifest(compiled, members, external)
    members[schema.GUARDS_PATH] = render_manifest(manifest_of_bundle(draft)).encode()
    manifest = make_manifest(compiled, members, external)
    size = sum(map(len, members.values()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as held:
            if weights_file is not None:
                held.enter_context(
                    weights_in_place(weights_file, members.pop(schema.WEIGHTS_PATH), weights_sha256)
                )
            write_bundle(path, manifest, members)
    except OSError as e:
        collect_weights(path)  # weights written for a bundle that never appeared
        raise EnvError(_cannot_write(path, e, size)) from None
    collect_weights(path)
    return manifest


def _cannot_write(path: Path, e: OSError, size: int) -> str:
    what = f"cannot write {path}: {e.strerror or e} ({errno.errorcode.get(e.errno or 0, 'OSError')})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{what}; the bundle needs about {size / 1e6:.1f} MB: free space there or write it elsewhere"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{what}; write it to a folder this user can write to"
    return f"{what}; nothing was written, check that folder and build again"
