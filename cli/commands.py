"""The ``aotpack`` verbs: each parses its options and calls the stage, review or verify function
that does the work; what they print about bundles is in ``aot.cli.reports``."""

from __future__ import annotations

import json
import os
import sys
import time

import click

from aot.cli.progress import PROGRESS
from aot.cli.reports import checks_note, mb
from aot.errors import AotError, printable

_info = PROGRESS.say  # progress: dropped under --quiet
_result = PROGRESS.result  # results and warnings: always shown


def _output_mode(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value:
        return
    chosen = ctx.find_root().meta.setdefault("aotpack.output", set())
    chosen.add(param.name)
    if chosen == {"quiet", "verbose"}:
        raise click.UsageError("--quiet and --verbose contradict each other; give one")
    if param.name == "quiet":
        PROGRESS.quiet = True
    else:
        os.environ["AOTPACK_VERBOSE"] = "1"  # read by the tracer's quiet_torch


def output_options() -> list[click.Option]:
    """``-q/--quiet`` and ``-v/--verbose``, taken before or after the command name."""
    return [
        click.Option(
            ["-q", "--quiet"],
            is_flag=True,
            expose_value=False,
            callback=_output_mode,
            help="print results, warnings and errors only (no progress)",
        ),
        click.Option(
            ["-v", "--verbose"],
            is_flag=True,
            expose_value=False,
            callback=_output_mode,
            help="also show torch's own logs and graph dumps while tracing",
        ),
    ]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="aotpack")
def cli() -> None:
    """Ahead-of-time packaging of PyTorch models: build a bundle, load it, review its guards."""


@cli.command()
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
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):  # found before the trace, not after
        raise click.ClickException(f"cannot write {output}: {folder} is not a folder this user can write to")
    _check_output(output, [model, weights], force)
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
    for sym in traced.guards.symbols:
        if (sym.min, sym.max, sym.modulus, sym.excluded) != (sym.declared_min, sym.declared_max, 1, ()):
            from aot.admissible import admissible_text

            sites = "; ".join(f"{s.text} at {s.file}:{s.line}: {s.code}" for s in sym.sources) or "tracing"
            _result(
                f"  warning: narrowed as allowed: {sym.name} declared {sym.declared_min}..{sym.declared_max} "
                f"admits only {admissible_text(sym)} ({sites})"
            )
    with PROGRESS.heartbeat("generating kernels"):
        compiled = generate(
            traced,
            archs,
            progress=_info,
            fuse=not no_fuse,
            gemm_candidates=gemm_candidates and not no_fuse,
            stack_siblings=not keep_siblings,
            channels_last=not no_channels_last,
        )
    pack(compiled, output, split_weights=split_weights)
    size = os.path.getsize(output)
    n_kernels = len({k.id for p in (compiled.program, *compiled.program.variants) for k in p.kernels})
    _result(
        f"wrote {output} ({mb(size)}, {n_kernels} kernels for "
        f"{', '.join(archs)}) in {time.perf_counter() - start:.1f}s"
    )


def _check_output(output: str, inputs: list[str | None], force: bool) -> None:
    """Refuse to overwrite an input of the build, or (without ``--force``) a file that is not a bundle."""
    from aot.packager.files import is_bundle

    if not os.path.lexists(output):
        return
    for given in filter(None, inputs):
        if os.path.exists(given) and os.path.exists(output) and os.path.samefile(given, output):
            raise click.ClickException(
                f"-o {output} is {given}, an input of this build; give the bundle another path"
            )
    if not force and not is_bundle(output):
        raise click.ClickException(
            f"-o {output} exists and is not an aotpack bundle; give another path, or --force to overwrite it"
        )


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "--inputs",
    "inputs_file",
    type=click.Path(dir_okay=False),
    help="safetensors file with one tensor per input name [default: the bundle's example inputs]",
)
@click.option(
    "--sizes", help="run at these sizes with generated inputs, e.g. batch=3,seq=77 (others: the example's)"
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, or auto")
@click.option(
    "--iters",
    "--runs",
    "iters",
    default=20,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="timed calls",
)
@click.option(
    "--warmup",
    default=3,
    show_default=True,
    type=click.IntRange(0, 1_000_000),
    help="untimed calls first (CUDA-graph capture happens in the first)",
)
@click.option(
    "--atol",
    type=float,
    help="max abs error allowed vs the reference [default: the dtype's tolerance "
    "× the reference's scale]; a FAIL exits 2",
)
@click.option(
    "--json", "as_json", is_flag=True, help="print one JSON object (sizes, latency_ms, max_abs_err, ...)"
)
@click.option(
    "--save-outputs", type=click.Path(dir_okay=False), help="write the outputs to this safetensors file"
)
@click.option("--no-graphs", is_flag=True, help="launch step by step instead of replaying CUDA graphs")
@click.option(
    "--max-memory",
    callback=lambda ctx, param, value: None if value is None else _parse_bytes(value),
    help="refuse the bundle if one call may need more activation memory than this, e.g. 2GiB, 512MB",
)
@click.option(
    "--capture",
    type=click.Choice(["lazy", "all"]),
    default="lazy",
    show_default=True,
    help="capture each bucket's CUDA graph on its first call, or all at load (largest first)",
)
@click.option(
    "--trust",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="public key file (KEY.pub of `aotpack keygen`); repeatable: load only bundles signed by one "
    "of them [default: $AOTPACK_TRUST, os.pathsep-separated]",
)
def load(
    bundle: str,
    inputs_file: str | None,
    sizes: str | None,
    device: str,
    iters: int,
    warmup: int,
    atol: float | None,
    as_json: bool,
    save_outputs: str | None,
    no_graphs: bool,
    max_memory: int | None,
    capture: str,
    trust: tuple[str, ...],
) -> None:
    """Load BUNDLE, run it, time it, and check it against a reference: the eager outputs recorded
    at build time (example inputs) or, on a GPU, the same bundle on the CPU. Exit 2 on FAIL."""
    import torch

    from aot.cli import bench
    from aot.loader import load as load_bundle

    if inputs_file and sizes:
        raise click.UsageError("--inputs and --sizes both choose the inputs; give one")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    trusted = list(trust) or None  # None: $AOTPACK_TRUST
    runner = load_bundle(
        bundle,
        device=device,
        capture="none" if no_graphs else capture,
        trust=trusted,
        max_memory=max_memory,
    )
    _info(f"loaded {bundle} on {device} in {time.perf_counter() - start:.2f}s")
    reference, reference_name = None, None
    if inputs_file:
        from safetensors.torch import load_file

        try:
            inputs = load_file(inputs_file, device=str(runner.device))
        except Exception as e:
            raise click.ClickException(f"cannot read inputs {inputs_file}: {e}") from None
    elif sizes:
        inputs = runner.inputs_at(_parse_sizes(sizes))
    else:
        inputs, reference, reference_name = (
            runner.example_inputs(),
            runner.reference_outputs(),
            "build reference",
        )
    if reference is None and runner.device.type == "cuda":
        from aot.pytree import leaves

        on_cpu = load_bundle(bundle, device="cpu", trust=trusted)
        reference = leaves(on_cpu(**{k: v.cpu() for k, v in inputs.items()}))
        reference_name = "cpu program"
    report = bench.run(runner, bundle, inputs, reference, reference_name, iters, warmup, atol)
    if save_outputs:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in report.tensors.items()}, save_outputs)
        _info(f"wrote {save_outputs}")
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        for line in report.lines():
            click.echo(printable(line))  # output names come from the bundle
    if report.passed is False:
        sys.exit(2)


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def _parse_bytes(text: str) -> int:
    """``"2GiB"`` → 2147483648; a number with an optional unit (B, KB, MB, GB, TB, KiB, ... TiB)."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number) :].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _BYTE_UNITS or not 0 < value * _BYTE_UNITS[unit] < 2**63:
        raise click.BadParameter(f"expected a size such as 2GiB, 512MB or 1000000, got {text!r}")
    return int(value * _BYTE_UNITS[unit])


def _parse_sizes(text: str) -> dict[str, int]:
    """``"batch=3,seq=77"`` → ``{"batch": 3, "seq": 77}``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if not name.strip().isidentifier() or not value.strip().isdigit():
            raise click.UsageError(f"--sizes expects name=N,... (e.g. batch=3,seq=77); got {part!r}")
        out[name.strip()] = int(value)
    if not out:
        raise click.UsageError("--sizes expects name=N,... (e.g. batch=3,seq=77)")
    return out


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


@cli.command()
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="write the manifest to this file")
@click.option("--arch", default="sm_80,sm_90", show_default=True, help=_ARCH_HELP)
def guards(target: str, output: str | None, arch: str) -> None:
    """Print the guard manifest of a BUNDLE, a MODEL.py (traced, nothing compiled) or a manifest
    file (rewritten in canonical form)."""
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
        except click.UsageError as e:
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


@cli.command("diff", cls=_VerdictCommand)
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--arch", default="sm_80,sm_90", show_default=True, help=_ARCH_HELP)
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


@cli.command("check", cls=_VerdictCommand)
@click.argument("model", type=click.Path(dir_okay=False))
@click.option(
    "--against",
    required=True,
    type=click.Path(dir_okay=False),
    help="the committed manifest file (or a bundle) to compare with",
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--arch", default="sm_80,sm_90", show_default=True, help=_ARCH_HELP)
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


@cli.command()
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="private key file; KEY.pub beside it",
)
def keygen(output: str) -> None:
    """Make an Ed25519 key pair for signing bundles: KEY (private, PEM PKCS#8, mode 0600: keep it
    secret, e.g. in the CI's secret store) and KEY.pub (public: give it to servers with --trust)."""
    from aot.signing import write_key_pair

    fingerprint = write_key_pair(output)
    _result(f"wrote {output} (private: keep it secret) and {output}.pub (public), key {fingerprint}")


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "--key", required=True, type=click.Path(dir_okay=False), help="private key file (aotpack keygen)"
)
def sign(bundle: str, key: str) -> None:
    """Sign BUNDLE: add a signature of its manifest (which pins every member's sha256), replacing
    any earlier one. Servers that trust the key's KEY.pub then load it; any change is refused."""
    from aot.loader import open_bundle
    from aot.packager.sign import sign_bundle

    open_bundle(bundle).close()  # sign only a bundle that verifies
    sig = sign_bundle(bundle, key)
    _result(f"signed {bundle} with key {sig.fingerprint}")


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def inspect(bundle: str, as_json: bool) -> None:
    """Summarize a bundle: members, program, kernels, buckets, environment."""
    from aot.cli.reports import bundle_summary, summary_text

    manifest, info = bundle_summary(bundle)
    if as_json:
        click.echo(json.dumps(info, indent=1, sort_keys=True))
    else:
        click.echo(summary_text(manifest, info), nl=False)


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), help="write the tuned bundle here [default: in place]"
)
@click.option(
    "--bucket",
    "bucket_texts",
    multiple=True,
    help="tune only buckets with these sizes, e.g. batch=1 or batch=8,seq=128 (repeatable) [default: all]",
)
@click.option(
    "--entry",
    "entries",
    multiple=True,
    help="tune only this entry point's programs, e.g. decode (repeatable) [default: all]",
)
@click.option("--repeats", default=50, show_default=True, type=int, help="timed CUDA-graph replays per form")
@click.option("--device", default="cuda", show_default=True, help="the GPU to tune on")
@click.option(
    "--no-library-free",
    is_flag=True,
    help="keep the checked choices: do not move every GEMM site onto a candidate where that leaves "
    "no cuBLAS call at the buckets for at most 2% of the whole program",
)
def tune(
    bundle: str,
    output: str | None,
    bucket_texts: tuple[str, ...],
    entries: tuple[str, ...],
    repeats: int,
    device: str,
    no_library_free: bool,
) -> None:
    """On the target GPU: time each GEMM site's library call against the Triton candidates the
    build compiled (--gemm-candidates), per bucket, and record the winners in BUNDLE (tuning.json).
    Where every GEMM site can run a candidate at every bucket for at most 2% of the whole program,
    they all do, and no call at a bucket loads cuBLAS (--no-library-free: the checked choices)."""
    import torch

    from aot.errors import EnvError

    if not torch.cuda.is_available():
        raise EnvError("aotpack tune needs a CUDA GPU; torch sees none")
    from aot.verify.tune import tune as run_tune

    buckets = [_parse_sizes(t) for t in bucket_texts]
    result = run_tune(
        bundle,
        output,
        buckets or None,
        repeats,
        device,
        say=_info,
        entries=entries,
        library_free=not no_library_free,
    )
    chosen = sum(c.choice != "library" for c in result.table.choices)
    set_back = sum(not c.kept for c in result.table.checks)
    library_free = sum(c.library_free for c in result.table.checks)
    whole = sum(c.whole_plan for c in result.table.checks)
    _result(
        f"wrote {result.output}: {chosen}/{len(result.table.choices)} site-buckets use a Triton candidate "
        f"on {result.table.device} ({result.table.arch})" + checks_note(set_back, library_free, whole)
    )
    if result.signature_dropped:
        _result(
            f"the bundle was signed; its signature no longer matches: re-sign it with `aotpack sign {result.output} --key KEY`"
        )


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--device", default="cuda", show_default=True, help="the GPU to verify on")
def verify(bundle: str, device: str) -> None:
    """On a GPU: every kernel against its reference decomposition and the whole program against
    the CPU reference path, at the bundle's buckets; prints max errors, exits 2 on a mismatch."""
    import torch

    from aot.errors import EnvError
    from aot.verify.device import passed, program_tolerance, reference_noise
    from aot.verify.device import verify as run_verify

    if not torch.cuda.is_available():
        raise EnvError("aotpack verify needs a CUDA GPU; torch sees none")
    reports = run_verify(bundle, device)
    from aot.loader.bundle import open_bundle

    opened = open_bundle(bundle)
    dtype = opened.manifest.dtype
    noise = reference_noise(opened.manifest)
    opened.close()
    failed = 0
    for r in reports:
        ok = passed(r, dtype, noise)
        failed += not ok
        worst = max(r.kernel_errs.items(), key=lambda kv: kv[1], default=("-", 0.0))
        graph = "-" if r.graph_err is None else f"{r.graph_err:.3g}"
        where = f"[{r.program}] " if len({x.program for x in reports}) > 1 else ""
        click.echo(
            printable(
                f"{'ok  ' if ok else 'FAIL'} {where}{', '.join(f'{k}={v}' for k, v in r.sizes.items()):24} "
                f"program vs CPU {r.program_err:.3g} (scale {r.program_scale:.3g})  graph vs launches {graph}  "
                f"{len(r.kernel_errs)} kernels, worst {worst[0]} {worst[1]:.3g}"
            )
        )
    why = f", {dtype} eager differs from float32 by {noise:.2g} of its scale" if noise else ""
    click.echo(
        f"{len(reports) - failed}/{len(reports)} sizes passed (program tolerance "
        f"{program_tolerance(dtype, noise):.2g} of the output scale{why})"
    )
    if failed:
        sys.exit(2)


def _parse_prompts(text: str) -> list[list[int]]:
    """``"1,2,3;4,5"`` → ``[[1, 2, 3], [4, 5]]``."""
    prompts = []
    for part in text.split(";"):
        ids = [t.strip() for t in part.split(",") if t.strip()]
        if not ids or not all(t.isascii() and t.isdigit() and len(t) <= 18 for t in ids):
            raise click.UsageError(
                f"--prompt-ids expects token ids like 1,2,3 (prompts separated by ;), got {part!r}"
            )
        prompts.append([int(t) for t in ids])
    return prompts


@cli.command("generate")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "--prompt-ids", required=True, help="token ids, comma-separated; several prompts separated by ;"
)
@click.option(
    "--max-new-tokens", required=True, type=click.IntRange(1, 1 << 20), help="tokens to generate per prompt"
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, or auto")
@click.option("--eos-token-id", type=int, help="a prompt stops after this token (kept in its output)")
@click.option("--pad-token-id", type=int, help="fed to prompts that stopped [default: eos, else 0]")
@click.option("--sample", is_flag=True, help="sample instead of greedy decoding")
@click.option("--temperature", default=1.0, show_default=True, type=float, help="with --sample")
@click.option("--top-k", type=click.IntRange(1), help="with --sample: only the k most likely tokens")
@click.option("--seed", type=int, help="with --sample: seed of the sampling generator")
@click.option("--no-graphs", is_flag=True, help="launch step by step instead of replaying CUDA graphs")
@click.option(
    "--trust",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="public key file: load only bundles signed by one of them [default: $AOTPACK_TRUST]",
)
def generate_tokens(
    bundle: str,
    prompt_ids: str,
    max_new_tokens: int,
    device: str,
    eos_token_id: int | None,
    pad_token_id: int | None,
    sample: bool,
    temperature: float,
    top_k: int | None,
    seed: int | None,
    no_graphs: bool,
    trust: tuple[str, ...],
) -> None:
    """Generate tokens with a causal-LM BUNDLE (aot.hf.causal_lm: prefill and decode over a KV
    cache): prints each prompt's new token ids, space-separated, one line per prompt (the last
    line for one prompt); tokens/s on stderr."""
    import torch

    from aot.loader import load as load_bundle

    prompts = _parse_prompts(prompt_ids)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    runner = load_bundle(
        bundle, device=device, capture="none" if no_graphs else "lazy", trust=list(trust) or None
    )
    _info(f"loaded {bundle} on {device} in {time.perf_counter() - start:.2f}s")
    stamps: list[float] = []

    def on_token(step: int, tokens: list[int]) -> None:
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    out = runner.generate(
        prompts,
        max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        do_sample=sample,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        on_token=on_token,
    )
    total = time.perf_counter() - start
    for tokens in out:
        click.echo(" ".join(map(str, tokens)))
    new = sum(len(t) for t in out)
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    steps = f", decode {(len(stamps) - 1) * len(prompts) / decode:.1f} tokens/s" if decode > 0 else ""
    _result(
        f"{new} new tokens for {len(prompts)} prompt(s) in {total:.3f}s: {new / total:.1f} tokens/s "
        f"(prefill {(stamps[0] - start) * 1e3:.1f} ms{steps})",
    )


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--name", help="the model's name on the server [default: the bundle's model name]")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--host",
    "--address",
    "address",
    default="127.0.0.1",
    show_default=True,
    help="address the endpoints listen on (0.0.0.0: every interface)",
)
@click.option("--http-port", type=int, default=8000, show_default=True, help="KServe v2 over HTTP")
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="KServe v2 over gRPC")
@click.option("--metrics-port", type=int, default=8002, show_default=True, help="Prometheus metrics")
@click.option(
    "--max-queue-delay-us",
    type=click.IntRange(0),
    default=2000,
    show_default=True,
    help="how long a request may wait for others to join its batch",
)
@click.option(
    "--drain-timeout",
    type=click.IntRange(0),
    default=30,
    show_default=True,
    help="seconds SIGTERM waits for requests in flight",
)
@click.option(
    "--io-dtype",
    type=click.Choice(["bundle", "float32"]),
    default="bundle",
    show_default=True,
    help="dtype of float16/bfloat16 inputs and outputs on the wire: float32 casts them inside the model "
    "backend, for KServe v2 JSON clients (Triton refuses FP16 and BF16 in JSON both ways); binary and "
    "gRPC clients can keep the bundle's dtype",
)
def serve(
    bundle: str,
    name: str | None,
    device: str,
    address: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    max_queue_delay_us: int,
    drain_timeout: int,
    io_dtype: str,
) -> None:
    """Serve BUNDLE on Triton Inference Server (KServe v2 over HTTP and gRPC, health, metrics),
    configured from its guard manifest, on 127.0.0.1 unless --host says otherwise. Requests are
    joined (dynamic batching at the CUDA-graph buckets) only along a dim the build proved
    row-independent; otherwise each runs alone, and serve says why at start. HTTP requests are
    checked against the guards before the server allocates for them (400 with the reason).
    float16 bundles: KServe v2 JSON on Triton cannot carry FP16, so JSON clients need
    --io-dtype float32. SIGTERM drains and exits 0; a dead model process exits non-zero.
    Needs `pip install 'aotpack[serve]'`."""
    from aot.serve.triton import serve as run_server

    def on_ready(server, spec) -> None:
        batching = (
            f"batches up to {spec.max_batch_size} on {spec.batch_symbol}, preferred "
            f"{list(spec.preferred_batch_sizes)}"
            if spec.max_batch_size
            else "no batching: request by request"
        )
        _result(spec.batching)
        click.echo(  # on stdout, once the model is ready: a script may wait for this line
            f"serving {spec.name} on {server.url} (gRPC :{server.grpc_port}, metrics "
            f":{server.public_metrics_port}/metrics); {batching}; SIGTERM to drain and stop"
        )
        sys.stdout.flush()

    echo = (lambda line: click.echo(line, err=True)) if os.environ.get("AOTPACK_VERBOSE") else None
    run_server(
        bundle,
        name=name,
        device=device,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        address=address,
        max_queue_delay_us=max_queue_delay_us,
        drain_timeout=drain_timeout,
        on_ready=on_ready,
        echo=echo,
        io_dtype="" if io_dtype == "bundle" else io_dtype,
    )
    _info("drained and stopped")
    # drained, files removed: skip tearing torch down (about 2 s on a loaded 2-core box), so that
    # SIGTERM returns promptly
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@cli.command("triton-repo")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="the model repository")
@click.option("--name", help="the model's name [default: the bundle's model name]")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--max-queue-delay-us", type=click.IntRange(0), default=2000, show_default=True)
@click.option("--force", is_flag=True, help="replace OUTPUT/NAME when it exists")
def triton_repo(
    bundle: str, output: str, name: str | None, device: str, max_queue_delay_us: int, force: bool
) -> None:
    """Write a Triton model repository serving BUNDLE (config.pbtxt, a Python-backend model.py,
    the bundle), for an existing tritonserver (Kubernetes, KServe)."""
    from aot.serve.triton import write_repository

    folder = write_repository(bundle, output, name, device, max_queue_delay_us, force)
    _result(f"wrote {folder} ({folder.name}/config.pbtxt, {folder.name}/1/model.py); see {output}/README.md")
