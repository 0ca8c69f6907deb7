"""The verbs that ship a bundle: ``keygen``, ``sign``, ``inspect``, ``serve``, ``triton-repo``."""

from __future__ import annotations

import json
import os
import sys

import click

from aot.cli.options import trust_option
from aot.cli.progress import PROGRESS

_info = PROGRESS.say  # progress: dropped under --quiet
_result = PROGRESS.result  # results and warnings: always shown


@click.command()
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="private key file; KEY.pub beside it",
)
@click.option(
    "--algorithm",
    type=click.Choice(["ed25519", "ecdsa-p256"]),
    default="ed25519",
    show_default=True,
    help="ecdsa-p256: for BUNDLE.sig signatures that `model_signing verify key` checks too",
)
def keygen(output: str, algorithm: str) -> None:
    """Make a key pair for signing bundles (Ed25519 by default): KEY (private, PEM PKCS#8, mode 0600:
    keep it secret, e.g. in the CI's secret store) and KEY.pub (public: give it to servers with --trust)."""
    from aot.signing import write_key_pair

    fingerprint = write_key_pair(output, algorithm)
    _result(f"wrote {output} (private: keep it secret) and {output}.pub (public), key {fingerprint}")


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option(
    "--key", required=True, type=click.Path(dir_okay=False), help="private key file (aotpack keygen)"
)
def sign(bundle: str, key: str) -> None:
    """Sign BUNDLE: add a signature of its manifest (which pins every member's sha256), replacing
    any earlier one, and write BUNDLE.sig beside it (OpenSSF Model Signing v1.0, as `model_signing`
    verifies it). Servers that trust the key's KEY.pub then load it; any change is refused. An
    ECDSA (P-256/384/521) key writes BUNDLE.sig only."""
    from aot.loader import open_bundle
    from aot.oms import signature_path
    from aot.packager.sign import sign_bundle

    open_bundle(bundle, ()).close()  # sign only a bundle that verifies (whatever $AOTPACK_TRUST says)
    fingerprint = sign_bundle(bundle, key)
    _result(f"signed {bundle} with key {fingerprint}")
    _result(f"wrote {signature_path(bundle)} (OpenSSF Model Signing v1.0)")


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option(
    "--verify",
    "full",
    is_flag=True,
    help="also run every check a load does (each program against the manifest and the guards, "
    "the weights decoded, the memory plan), on the CPU",
)
@trust_option
def inspect(bundle: str, as_json: bool, full: bool) -> None:
    """Summarize a bundle: members, program, kernels, buckets, environment. Every member's sha256
    is checked (exit 1 on a corrupt bundle); --verify also loads it."""
    from aot.cli.reports import bundle_summary, summary_text

    manifest, info = bundle_summary(bundle)
    if full:
        from aot.loader import load

        load(bundle, device="cpu", capture="none").bundle.close()
        _info(f"verified {bundle}: every member's sha256, and it loads on the CPU")
    if as_json:
        click.echo(json.dumps(info, indent=1, sort_keys=True))
    else:
        click.echo(summary_text(manifest, info), nl=False)


@click.command()
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
@click.option(
    "--http-port",
    type=int,
    default=8000,
    show_default=True,
    help="KServe v2 over HTTP (0: any free port, named in the banner)",
)
@click.option(
    "--grpc-port", type=int, default=8001, show_default=True, help="KServe v2 over gRPC (0: any free port)"
)
@click.option(
    "--metrics-port", type=int, default=8002, show_default=True, help="Prometheus metrics (0: any free port)"
)
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
@trust_option
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


@click.command("triton-repo")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="the model repository")
@click.option("--name", help="the model's name [default: the bundle's model name]")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--max-queue-delay-us", type=click.IntRange(0), default=2000, show_default=True)
@click.option("--force", is_flag=True, help="replace OUTPUT/NAME when it exists")
@trust_option
def triton_repo(
    bundle: str, output: str, name: str | None, device: str, max_queue_delay_us: int, force: bool
) -> None:
    """Write a Triton model repository serving BUNDLE (config.pbtxt, a Python-backend model.py,
    the bundle), for an existing tritonserver (Kubernetes, KServe)."""
    from aot.serve.triton import write_repository

    folder = write_repository(bundle, output, name, device, max_queue_delay_us, force)
    _result(f"wrote {folder} ({folder.name}/config.pbtxt, {folder.name}/1/model.py); see {output}/README.md")
