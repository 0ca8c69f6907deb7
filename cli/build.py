"""The verbs that make and review a bundle: ``build``, ``guards``, ``diff``, ``check``."""

from __future__ import annotations

import json
import os
import sys
import time

import click

from aot.cli.options import trust_option
from aot.cli.progress import PROGRESS
from aot.cli.reports import mb, sizes_text
from aot.errors import AotError, EnvError, counted

_info = PROGRESS.say  # progress: dropped under --quiet
_result = PROGRESS.result  # results and warnings: always shown

# A build warns when its CUDA graphs may hold more than this at the largest bucket, or when a
# symbol has more buckets than this: what a huge Dim max (1e9: 31 powers of two) costs a server.
LARGE_PEAK_BYTES = 8 << 30
MANY_BUCKETS = 16


@click.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), help="bundle path [default: MODEL's name .tpk]"
)
@click.option("--arch", default="sm_80,sm_90", show_default=True, help="GPU archs to compile kernels for")
@click.option(
    "--weights",
    type=click.Path(dir_okay=False),
    help="the module's state dict: a safetensors file, or a torch.save checkpoint (.pt, read with weights_only=True)",
)
@click.option(
    "--split-weights",
    is_flag=True,
    help="write the weights beside the bundle as OUT.weights.SHA.safetensors (checksummed by the bundle)",
)
@click.option("--no-fuse", is_flag=True, help="keep every ATen op a library call (no kernels compiled)")
@click.option(
    "--allow-narrowing",
    is_flag=True,
    help="build even when the traced programs cannot cover every declared size (the bundle then "
    "admits less than declared, as `aotpack guards` shows)",
)
@click.option(
    "--gemm-candidates",
    is_flag=True,
    help="also compile Triton candidates (fused epilogues, split-K) for the library GEMMs; "
    "`aotpack tune` picks them on the target GPU, an untuned bundle runs the library calls",
)
@click.option(
    "--library-free",
    is_flag=True,
    help="every step a compiled kernel or a driver copy (no cuBLAS, cuDNN or ATen call on the GPU), "
    "so `aotpack-rt` runs it without torch: GEMMs, attention, convolutions and KV-cache writes take "
    "Triton forms, tensors stay row-major; refused, naming the step and its model line, where no form exists",
)
@click.option(
    "--keep-siblings",
    is_flag=True,
    help="keep matmuls that read the same input apart (q/k/v, gate/up) instead of stacking their "
    "weights into one GEMM: with --gemm-candidates, a gated MLP gets a dual-GEMM candidate",
)
@click.option(
    "--no-channels-last",
    is_flag=True,
    help="keep every tensor row-major: convolutions then take and return NCHW, which cuDNN "
    "transposes to NHWC and back around each one",
)
@click.option("--force", is_flag=True, help="overwrite OUTPUT even when it is not a bundle")
def build(
    model: str,
    output: str | None,
    arch: str,
    weights: str | None,
    split_weights: bool,
    no_fuse: bool,
    allow_narrowing: bool,
    gemm_candidates: bool,
    library_free: bool,
    keep_siblings: bool,
    no_channels_last: bool,
    force: bool,
) -> None:
    """Trace MODEL.py, fuse and compile its kernels, and write a bundle."""
    from aot.codegen import generate, parse_archs
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    archs = parse_archs(arch)
    if not no_fuse:
        from aot.codegen.compile import check_archs

        check_archs(archs)  # before the trace: a minute of tracing must not end in a ptxas crash
    output = output or os.path.splitext(os.path.basename(model))[0] + ".tpk"
    _check_folder(output)  # found before the trace, not after
    was_signed = _check_output(output, [model, weights], force)
    start = time.perf_counter()
    spec = load_model_file(model)
    _info(f"tracing {model} …")
    with PROGRESS.heartbeat("tracing"):
        traced = trace(spec, weights=weights, progress=_info, allow_narrowing=allow_narrowing or None)
    programs = f" in {len(traced.programs)} programs" if traced.programs else ""
    _info(
        f"  traced in {traced.trace_seconds:.1f}s: {len(traced.program.steps)} ATen steps{programs}, "
        f"{len(traced.weights)} weights"
    )
    for narrowed in _narrowings(traced.guards):
        _result(f"  warning: narrowed as allowed: {narrowed}")
    with PROGRESS.heartbeat("generating kernels"):
        compiled = generate(
            traced,
            archs,
            progress=_info,
            fuse=not no_fuse,
            gemm_candidates=(gemm_candidates or library_free) and not no_fuse,
            library_free=library_free,
            stack_siblings=not keep_siblings,
            channels_last=not no_channels_last,
        )
    manifest = pack(compiled, output, split_weights=split_weights)
    _warn_on_buckets(manifest)
    if was_signed:
        _result(
            f"  warning: {output} was signed; the rebuilt bundle is not (a signature covers one build): "
            f"sign it again with `aotpack sign {output} --key KEY`"
        )
    size = os.path.getsize(output)
    n_kernels = len({k.id for p in (compiled.program, *compiled.program.variants) for k in p.kernels})
    _result(
        f"wrote {output} ({mb(size)}, {counted(n_kernels, 'kernel')} for "
        f"{', '.join(archs)}) in {time.perf_counter() - start:.1f}s"
    )


def _warn_on_buckets(manifest) -> None:
    """A huge Dim max builds, but the loader captures a CUDA graph per bucket up to it: say how
    many and what the largest holds, and how to bound them."""
    plan = manifest.stats.memory_plan
    largest = max(plan, key=lambda b: b.peak_bytes, default=None)
    many = any(len(b.sizes) > MANY_BUCKETS for b in manifest.buckets)
    if largest is None or (largest.peak_bytes <= LARGE_PEAK_BYTES and not many):
        return
    counts = ", ".join(f"{len(b.sizes)} for {b.symbol}" for b in manifest.buckets)
    _result(
        f"  warning: {len(plan)} CUDA-graph buckets ({counts}), peak activations "
        f"{largest.peak_bytes / 1e9:.1f} GB at {sizes_text(largest.sizes)}; bound them with a smaller "
        f"Dim max or Dim(..., buckets=(...)) in the model file"
    )


def _check_folder(output: str) -> None:
    """The bundle's folder exists and this user may write in it."""
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.exists(folder):
        raise EnvError(f"cannot write {output}: the folder {folder} does not exist; create it first")
    if not os.path.isdir(folder):
        raise EnvError(f"cannot write {output}: {folder} is not a folder")
    if not os.access(folder, os.W_OK):
        raise EnvError(f"cannot write {output}: this user may not write to the folder {folder}")


def _narrowings(guards) -> list[str]:
    """Each symbol that admits less than its declared range: what, and the model lines why."""
    from aot.admissible import admissible_text

    out = []
    for sym in guards.symbols:
        declared = (sym.declared_min, sym.declared_max, max(sym.declared_multiple, 1), (0,), ())
        if (sym.min, sym.max, sym.modulus, sym.residues, sym.excluded) != declared:
            sites = "; ".join(f"{s.text} at {s.file}:{s.line}: {s.code}" for s in sym.sources) or "tracing"
            out.append(
                f"{sym.name} declared {sym.declared_min}..{sym.declared_max} admits only "
                f"{admissible_text(sym)} ({sites})"
            )
    return out


def _check_output(output: str, inputs: list[str | None], force: bool) -> bool:
    """Refuse to overwrite an input of the build, or (without ``--force``) a file that is not a
    bundle; whether the bundle it replaces was signed."""
    from aot.packager.files import is_bundle

    if not os.path.lexists(output):
        return False
    for given in filter(None, inputs):
        if os.path.exists(given) and os.path.exists(output) and os.path.samefile(given, output):
            raise click.ClickException(
                f"-o {output} is {given}, an input of this build; give the bundle another path"
            )
    if not force and not is_bundle(output):
        raise click.ClickException(
            f"-o {output} exists and is not an aotpack bundle; give another path, or --force to overwrite it"
        )
    return _signed(output)


def _signed(path: str) -> bool:
    import zipfile

    from aot import schema

    try:
        with zipfile.ZipFile(path) as zf:
            return schema.SIGNATURE_PATH in zf.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _read_side(target: str, arch: str):
    """A bundle, a manifest text file, or a model file traced for ``arch`` (nothing compiled)."""
    from aot.review import read_side

    archs = None
    if target.endswith(".py"):
        from aot.codegen import parse_archs

        archs = parse_archs(arch)
    return read_side(target, archs)


def _manifest_text(target: str, arch: str = "sm_80,sm_90") -> str:
    """Guard text of a bundle, a model file (trace only), or a committed manifest file."""
    from aot.manifest_text import render_manifest

    return render_manifest(_read_side(target, arch).manifest)


_ARCH_HELP = "archs a build of MODEL.py targets (env archs in its manifest)"


@click.command()
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="write the manifest to this file")
@click.option("--arch", default="sm_80,sm_90", show_default=True, help=_ARCH_HELP)
@trust_option
def guards(target: str, output: str | None, arch: str) -> None:
    """Print the guard manifest of a BUNDLE, a MODEL.py (traced, nothing compiled) or a manifest
    file (rewritten in canonical form). For a MODEL.py, says where the build would narrow the
    declared ranges (and refuse to, without --allow-narrowing)."""
    if target.endswith(".py"):
        from aot.codegen import parse_archs
        from aot.manifest_text import render_manifest
        from aot.tracer import guard_manifest, load_model_file

        spec = load_model_file(target)
        manifest = guard_manifest(spec, parse_archs(arch))
        for narrowed in _narrowings(manifest.guards):
            if spec.allow_narrowing:
                _result(f"warning: narrowed as the model file allows: {narrowed}")
            else:
                _result(f"warning: `aotpack build` refuses this model without --allow-narrowing: {narrowed}")
        text = render_manifest(manifest)
    else:
        text = _manifest_text(target, arch)
    if output:
        with open(output, "w", newline="\n") as f:
            f.write(text)
        _info(f"wrote {output}")
    else:
        click.echo(text, nl=False)


class _VerdictCommand(click.Command):
    """``diff`` and ``check`` exit 0/1/2 with their verdict, so a failure to run at all (bad
    usage, unreadable file, model that does not trace) exits ``aot.review.EXIT_ERROR`` (4) instead
    of the usual 1 or 2; an internal error still exits 3."""

    def make_context(self, *args, **kwargs):
        from aot.review import EXIT_ERROR

        try:
            return super().make_context(*args, **kwargs)
        except (click.UsageError, AotError) as e:  # a bad option, a bad --trust key
            e.exit_code = EXIT_ERROR
            raise

    def invoke(self, ctx):
        from aot.review import EXIT_ERROR

        try:
            return super().invoke(ctx)
        except (AotError, click.ClickException) as e:
            e.exit_code = EXIT_ERROR
            raise
        except OSError as e:
            err = click.ClickException(f"{e.filename or ''}: {e.strerror or e}")
            err.exit_code = EXIT_ERROR
            raise err from None


@click.command("diff", cls=_VerdictCommand)
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--arch", default="sm_80,sm_90", show_default=True, help=_ARCH_HELP)
@trust_option
def diff_command(old: str, new: str, as_json: bool, arch: str) -> None:
    """Classify every change from OLD to NEW: each a bundle, a manifest file or a MODEL.py.

    Guards, environment and buckets always; kernels, ops and weights too when both are bundles.
    Exit status: 0 no change, 1 only safe changes (widened, removed guard, arch added, ...),
    2 at least one breaking change (narrowed, specialized, dtype/rank, input added/removed,
    arch dropped, ...), 4 an input could not be read, 3 internal error.
    """
    from aot.review import diff

    result = diff(_read_side(old, arch), _read_side(new, arch))
    if as_json:
        click.echo(json.dumps({"old": old, "new": new, **result.to_json()}, indent=1, sort_keys=True))
    else:
        click.echo(result.text(), nl=False)
    sys.exit(result.exit_code)  # click's non-standalone mode would swallow ctx.exit's code


@click.command("check", cls=_VerdictCommand)
@click.argument("model", type=click.Path(dir_okay=False))
@click.option(
    "--against",
    required=True,
    type=click.Path(dir_okay=False),
    help="the committed manifest file (or a bundle) to compare with",
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--arch", default="sm_80,sm_90", show_default=True, help=_ARCH_HELP)
@trust_option
def stale_manifest_command(model: str, against: str, as_json: bool, arch: str) -> None:
    """Re-trace MODEL.py (nothing compiled) and fail if the committed manifest no longer matches.

    Exit status: 0 it matches; 2 it does not, whatever the change (the report says which changes
    are breaking; regenerate with `aotpack guards MODEL.py -o FILE` and review); 4 an input could
    not be read or MODEL.py does not trace; 3 internal error.
    """
    from aot.review.check import check_manifest

    result = check_manifest(model, against, _read_side(against, arch), _read_side(model, arch))
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1, sort_keys=True))
    else:
        click.echo(result.report(), nl=False)
        if result.stale:
            _info(result.advice())
    sys.exit(result.exit_code)
