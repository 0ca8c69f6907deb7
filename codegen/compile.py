"""Compile rendered kernels to cubins with Triton, for any arch, without a GPU; cache the results.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole pipeline
(TTIR → TTGIR → LLVM IR → PTX → ptxas) on the build machine. Each (kernel, arch) result is kept in
a content-addressed cache (``AOTPACK_CACHE_DIR``, default ``~/.cache/aotpack/kernels``): the key
covers the source, signature, options, arch and the toolchain (Triton and ptxas versions), and
entries are written to a temporary file and moved into place, so concurrent builds never see
half-written entries. An entry is checked on every read: its metadata must be the object this
module writes, naming the same key, with the cubin's sha256; anything else (damaged, truncated,
copied from another kernel, ill-typed) is a miss, compiled again and rewritten. Triton's own cache
is not kept between compiles, so a miss really compiles the source. A cache directory that cannot
be written is no error: the kernel is compiled all the same and ``Result.cache_error`` says why
it was not stored.

The kernel's source is compiled under the file name it has in the bundle (``kernels/<id>.py``),
so line info in the cubin does not depend on where the build ran.
"""

from __future__ import annotations

import functools
import hashlib
import json
import linecache
import os
import re
import subprocess
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from aot.archs import arch_number
from aot.schema import KERNEL_SOURCE_FORMAT

CACHE_ENV = "AOTPACK_CACHE_DIR"
CACHE_FORMAT = 3  # bump when what an entry holds changes
POINTER_ALIGNMENT = 16  # root buffers are fresh allocations: pointers may assume 16-byte alignment
# Line info names the files of inlined Triton library code by absolute path (the build machine's
# site-packages), which would make cubins differ between machines; off, builds are reproducible.
LINE_INFO = False
MIN_ARCH = 75  # triton's oldest target (Turing)


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aotpack" / "kernels"


@dataclass(frozen=True)
class Job:
    kernel_id: str
    name: str
    source: str
    signature: dict[str, str]
    num_warps: int
    num_stages: int
    arch: str  # "sm_90"


@dataclass(frozen=True)
class Result:
    cubin: bytes
    meta: dict[str, Any]  # name, shared, global/profile scratch sizes, ptx_params
    cached: bool
    cache_error: str = ""  # why the result could not be stored in the cache ("" when it was)


# What an entry's metadata holds, and the type of each field; an entry that differs is a miss.
META_FIELDS = {
    "key": str,
    "name": str,
    "shared": int,
    "num_warps": int,
    "num_stages": int,
    "global_scratch_size": int,
    "profile_scratch_size": int,
    "ptx_params": int,
    "dependent_launch": int,  # 1: the cubin waits for the kernel before (GDC), may launch early
    "cubin_sha256": str,
}


def _options(job: Job) -> dict[str, Any]:
    return {"num_warps": job.num_warps, "num_stages": job.num_stages, "enable_fp_fusion": True}


def cache_key(job: Job) -> str:
    import triton

    text = json.dumps(
        {
            "format": CACHE_FORMAT,
            "source": job.source,
            "signature": job.signature,
            "options": _options(job),
            "arch": job.arch,
            "triton": triton.__version__,
            "ptxas": _ptxas(arch_number(job.arch)).version,
            "align": POINTER_ALIGNMENT,
            "line_info": LINE_INFO,
            "file": KERNEL_SOURCE_FORMAT.format(kernel=job.kernel_id),
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_function(kernel_id: str, name: str, source: str, dependent_launch: bool = False):
    """The ``@triton.jit`` function of ``source``, with the bundle's file name as its source file;
    ``dependent_launch``: the module's ``GDC`` set true (``kernel_source.DEPENDENT_LAUNCH``)."""
    filename = KERNEL_SOURCE_FORMAT.format(kernel=kernel_id)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"aotpack_kernel_{kernel_id}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    if dependent_launch:
        import triton.language as tl

        module.GDC = tl.constexpr(True)
    return getattr(module, name)


def dependent_launch(arch: str, source: str) -> bool:
    """Whether ``source`` compiles for ``arch`` with programmatic dependent launch: from sm_90 on,
    where the kernel has the ``GDC`` switch and this Triton has the grid-dependency calls."""
    if arch_number(arch) < 90 or "\nGDC = tl.constexpr(" not in source:
        return False
    import triton.language as tl

    cuda = getattr(tl.extra, "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def _ptx_params(ptx: str, name: str) -> int:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise RuntimeError(f"no .entry {name} in the PTX")
    return len(re.findall(r"\.param\b", m.group(1)))


def compile_job(job: Job) -> Result:
    """Compile one kernel for one arch (or read it from the cache)."""
    key = cache_key(job)
    base = cache_dir() / key[:2] / key
    cubin_path, meta_path = base.with_suffix(".cubin"), base.with_suffix(".json")
    cached = _read_entry(cubin_path, meta_path, key, job)
    if cached is not None:
        return cached
    cubin, meta = _compile(job)
    meta["key"] = key
    try:
        _write_atomic(cubin_path, cubin)
        _write_atomic(meta_path, json.dumps(meta, sort_keys=True).encode())
    except OSError as e:
        return Result(
            cubin, meta, cached=False, cache_error=f"{e.strerror or e} ({e.filename or cache_dir()})"
        )
    return Result(cubin, meta, cached=False)


def _read_entry(cubin_path: Path, meta_path: Path, key: str, job: Job) -> Result | None:
    """The cached result of ``key``, or None when the entry is missing or is not exactly what
    ``compile_job`` writes for this job."""
    try:
        meta = json.loads(meta_path.read_bytes())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not _valid_meta(meta) or meta["key"] != key or meta["name"] != job.name:
        return None
    if (meta["num_warps"], meta["num_stages"]) != (job.num_warps, job.num_stages):
        return None
    if hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"]:
        return None
    return Result(cubin, meta, cached=True)


def _valid_meta(meta: Any) -> bool:
    return (
        isinstance(meta, dict)
        and set(meta) == set(META_FIELDS)
        and all(
            type(meta[field]) is kind and (kind is str or meta[field] >= 0)
            for field, kind in META_FIELDS.items()
        )
    )


def _compile(job: Job) -> tuple[bytes, dict[str, Any]]:
    """Run Triton on ``job``: the cubin and its metadata (every field but the key). Triton's own
    cache lives in a fresh directory that is removed afterwards: what it would find in a lasting
    one is nothing this module has checked."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gdc = dependent_launch(job.arch, job.source)
    fn = load_function(job.kernel_id, job.name, job.source, gdc)
    attrs = {
        (i,): [["tt.divisibility", POINTER_ALIGNMENT]]
        for i, t in enumerate(job.signature.values())
        if t.startswith("*")
    }
    src = ASTSource(fn, signature=dict(job.signature), constexprs=None, attrs=attrs)
    cc = arch_number(job.arch)
    with (
        tempfile.TemporaryDirectory(prefix="aotpack-triton-") as scratch,
        triton.knobs.cache.scope(),
        triton.knobs.compilation.scope(),
    ):
        triton.knobs.cache.dir = scratch
        triton.knobs.compilation.disable_line_info = not LINE_INFO
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=_options(job))
    md = compiled.metadata
    cubin = compiled.asm["cubin"]
    return cubin, {
        "name": md.name,
        "shared": int(md.shared),
        "num_warps": int(md.num_warps),
        "num_stages": int(md.num_stages),
        "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
        "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
        "ptx_params": _ptx_params(compiled.asm["ptx"], md.name),
        "dependent_launch": int(gdc and "griddepcontrol.wait" in compiled.asm["ptx"]),
        "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
    }


class Ptxas(NamedTuple):
    release: str  # "12.9"
    version: str  # everything ``ptxas --version`` says, build included
    accepted: frozenset[str]  # the ``sm_*`` targets it compiles for


@functools.cache
def _ptxas(cc: int) -> Ptxas:
    """The ptxas triton compiles sm_{cc} with:
    triton >= 3.8 ships two, CUDA 12.x for sm_75..sm_89 and CUDA 13.x from sm_90 on."""
    from triton.backends.nvidia import compiler

    try:
        tool = compiler.get_ptxas(cc)
    except TypeError:  # older triton: one ptxas for every arch
        tool = compiler.get_ptxas()
    version = subprocess.run([tool.path, "--version"], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool.path, "--help"], capture_output=True, text=True).stdout
    start = usage.find("--gpu-name")
    end = usage.find("\n--", start + 1)
    m = re.search(r"release (\d+\.\d+)", version)
    accepted = frozenset(re.findall(r"'(sm_\w+)'", usage[start : end if end > 0 else None]))
    return Ptxas(m.group(1) if m else "", version.strip(), accepted)


def ptxas_release(arch: str) -> str:
    """The CUDA release of the ptxas that compiles ``arch``'s cubins (``"12.9"``, ``"13.4"``): a
    driver of an older CUDA major cannot load them, so the bundle records it per arch
    (``Environment.cuda_built``)."""
    return _ptxas(arch_number(arch)).release


def check_archs(archs: tuple[str, ...]) -> None:
    """Refuse, before any tracing, an arch this triton cannot compile cubins for."""
    import triton

    from aot.errors import CodegenError

    for arch in archs:
        release, _, accepted = _ptxas(arch_number(arch))
        if arch_number(arch) < MIN_ARCH or arch not in accepted:
            known = sorted(
                {
                    a
                    for cc in (MIN_ARCH, 90)
                    for a in _ptxas(cc).accepted
                    if re.fullmatch(r"sm_\d+", a)
                    and arch_number(a) >= MIN_ARCH
                    and (arch_number(a) < 90) == (cc < 90)
                },
                key=arch_number,
            )
            raise CodegenError(
                f"--arch {arch}: triton {triton.__version__} (ptxas of CUDA {release}) cannot compile cubins for it; "
                f"it can for {', '.join(known)}"
            )
