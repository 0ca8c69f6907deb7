"""Closed-loop gRPC load on Triton: a bundle behind ``aotpack serve``'s model vs the same model
eager behind a Python-backend model of the same shape, in one tritonserver.

Both models get the same ``config.pbtxt`` (rendered from the bundle's manifest: same dynamic batching,
preferred sizes and queue delay) and the same request batching code (``aot.serve.batching``); only
the call differs: the bundle's runner, or the model file's ``nn.Module`` in eager mode (random
weights from the spec's seed: the weights do not change the time). PyTriton's own binding is not
used for the eager side: its proxy needs a Python whose libpython matches the one the stub links.

For each model and each concurrency C (default 1, 8, 32, 64), C client threads each send one
single-row request over gRPC, wait for the answer and send the next, for ``--seconds``; the report
gives throughput (requests/s), p50/p99 latency (ms, at the client) and the mean batch Triton ran
(inferences / executions, from its metrics). JSON to ``--json``, a markdown table to stdout (and
``--md``).

    python bench/serve_load.py models/mlp.py mlp.tpk --device cpu --seconds 15

On the GPU machine (no network, no nvidia-pytriton, numpy 2, at most 64 MiB carried a call; the
pytriton wheel alone is 55 MB): stage the wheels and bundles here with
``bash bench/stage_serve_wheels.sh``, then make two calls on one warm machine, the second at once
(the machine and its /tmp stay warm 30 s):

    bash bench/device_serve.sh install1     # carry: .whl-serve1
    bash bench/device_serve.sh measure      # carry: .whl-serve2 .bundles

``measure`` serves from a venv with numpy 1.26 where the image's numpy breaks the backend stub
(nvidia-pytriton 0.7's stubs read tensors wrongly under numpy 2; the stub runs isolated, so
PYTHONPATH does not reach it), runs tests/gpu/test_serve_gpu.py, then this script for mlp and gpt
with ``--device cuda --seconds 10``. Logs, JSON and tables come back in ``$OUT/serve.tgz``; copy the
tables into bench/RESULTS.md with the card, driver and torch version (``report.log``, ``gpu.txt``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

CONCURRENCY = (1, 8, 32, 64)
SECONDS = 15.0
WARMUP_REQUESTS = 20

# The eager model: the model file's module, called on the joined requests like the bundle is.
EAGER_MODEL_PY = '''"""Eager baseline for bench/serve_load.py: the model file's nn.Module behind the Python backend."""

import json
import os
import site

for _folder in filter(None, os.environ.get("AOTPACK_SITE_DIRS", "").split(os.pathsep)):
    site.addsitedir(_folder)

import numpy as np  # noqa: E402
import torch  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb

        from aot.serve.batching import run_requests
        from aot.serve.triton_model import check_numpy_bridge
        from aot.tracer import load_model_file

        check_numpy_bridge(pb)
        self.pb, self.run_requests = pb, run_requests
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        spec = load_model_file(params["model_file"])
        torch.manual_seed(spec.seed)
        self.device = torch.device(params["device"])
        self.module = spec.module().to(getattr(torch, spec.dtype)).to(self.device).eval()
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        self.max_rows = int(config["max_batch_size"])

    def _call(self, values):
        with torch.no_grad():
            out = self.module(*values)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def execute(self, requests):
        pb = self.pb
        values = [
            [torch.from_numpy(pb.get_input_tensor_by_name(r, n).as_numpy().copy()).to(self.device) for n in self.inputs]
            for r in requests
        ]
        answers = []
        for reply in self.run_requests(self._call, values, self.max_rows):
            if reply.ok:
                tensors = [pb.Tensor(n, t.cpu().numpy()) for n, t in zip(self.outputs, reply.outputs)]
                answers.append(pb.InferenceResponse(output_tensors=tensors))
            else:
                answers.append(pb.InferenceResponse(error=pb.TritonError(reply.error)))
        return answers
'''


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def metric(port: int, name: str, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def load(
    grpc_port: int, metrics_port: int, model: str, inputs: dict, concurrency: int, seconds: float
) -> dict:
    """``concurrency`` closed loops of single requests for ``seconds``: throughput, p50/p99, mean batch."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def request():
        given = []
        for name, value in inputs.items():
            t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            t.set_data_from_numpy(value)
            given.append(t)
        return given

    warm = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    for _ in range(WARMUP_REQUESTS):
        warm.infer(model, request())
    warm.close()
    before = (
        metric(metrics_port, "nv_inference_count", model),
        metric(metrics_port, "nv_inference_exec_count", model),
    )
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start = threading.Barrier(concurrency + 1)
    stop_at = [0.0]

    def loop(i: int) -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        given = request()
        start.wait()
        while time.perf_counter() < stop_at[0]:
            t0 = time.perf_counter()
            try:
                client.infer(model, given)
            except Exception:
                errors[i] += 1
                continue
            latencies[i].append(time.perf_counter() - t0)
        client.close()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join(seconds + 60)
    elapsed = time.perf_counter() - began
    done = sorted(x for lat in latencies for x in lat)
    count = metric(metrics_port, "nv_inference_count", model) - before[0]
    execs = metric(metrics_port, "nv_inference_exec_count", model) - before[1]
    return {
        "model": model,
        "concurrency": concurrency,
        "requests": len(done),
        "errors": sum(errors),
        "seconds": round(elapsed, 2),
        "throughput_rps": round(len(done) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(done), 3) if done else None,
        "p99_ms": round(1000 * done[min(len(done) - 1, int(0.99 * len(done)))], 3) if done else None,
        "mean_batch": round(count / execs, 2) if execs else None,
    }


def markdown(rows: list[dict], device: str, request: str) -> str:
    lines = [
        f"Closed-loop gRPC load, one request = {request}, device {device}:",
        "",
        "| model | concurrency | requests/s | p50 ms | p99 ms | mean batch | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {r['throughput_rps']} | {r['p50_ms']} | {r['p99_ms']} | "
            f"{r['mean_batch']} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def write(rows: list[dict], device: str, request: str, json_path: str | None, md_path: str | None) -> str:
    """The rows so far to ``--json`` and ``--md``, after each load: a run cut off keeps what it did."""
    table = markdown(rows, device, request)
    if json_path:
        text = json.dumps({"device": device, "request": request, "rows": rows}, indent=1)
        Path(json_path).write_text(text + "\n")
    if md_path:
        Path(md_path).write_text(table)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_file", help="the model file the bundle was built from (the eager baseline)")
    ap.add_argument("bundle")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seconds", type=float, default=SECONDS)
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--max-queue-delay-us", type=int, default=2000)
    ap.add_argument("--systems", default="aotpack,eager", help="which of aotpack, eager to load")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="time the aotpack model's stages (read, join/split, runner, write) inside the server "
        "and print them per request beside the client's latency and the runner called in process",
    )
    args = ap.parse_args()

    import aot.loader
    from aot.serve.config import open_spec
    from aot.serve.triton import TritonServer, write_model
    from aot.serve.triton_model import ENV_PROFILE

    spec = open_spec(args.bundle)
    example = aot.loader.load(args.bundle).example_inputs()
    inputs = {n: v[:1].numpy() if spec.max_batch_size else v.numpy() for n, v in example.items()}
    request = ", ".join(f"{n} {list(v.shape)} {v.dtype}" for n, v in inputs.items())
    systems = [s for s in args.systems.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        repo = Path(tmp)
        if "aotpack" in systems:
            aot_spec = dataclasses.replace(spec, name="aotpack")
            write_model(
                repo, aot_spec, str(Path(args.bundle).resolve()), args.device, args.max_queue_delay_us
            )
        if "eager" in systems:
            eager = dataclasses.replace(spec, name="eager")
            folder = write_model(repo, eager, "unused", args.device, args.max_queue_delay_us)
            config = folder / "config.pbtxt"
            model_file = json.dumps(str(Path(args.model_file).resolve()))
            config.write_text(
                config.read_text()
                + f'parameters {{\n  key: "model_file"\n  value: {{ string_value: {model_file} }}\n}}\n'
            )
            (folder / "1" / "model.py").write_text(EAGER_MODEL_PY)
        profile = repo / "profile.json"
        if args.profile:
            os.environ[ENV_PROFILE] = str(profile)
        http, grpc, metrics = free_ports(3)
        server = TritonServer(
            repo, "aotpack" if "aotpack" in systems else "eager", http, grpc, metrics, "127.0.0.1"
        )
        server.start()
        try:
            for model in systems:
                for c in (int(x) for x in args.concurrency.split(",")):
                    row = load(grpc, metrics, model, inputs, c, args.seconds)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    write(rows, args.device, request, args.json, args.md)
        finally:
            server.stop()
        if args.profile and profile.is_file():
            print(profile_text(json.loads(profile.read_text()), rows, args.bundle, inputs, args.device))
    print(write(rows, args.device, request, args.json, args.md))


def profile_text(stages: dict, rows: list[dict], bundle: str, inputs: dict, device: str) -> str:
    """Where an aotpack request's time went, per request (µs): the model's stages inside the
    server, against the client's median latency at concurrency 1 and the runner in process."""
    import torch

    import aot.loader

    runner = aot.loader.load(bundle, device=device)
    given = {n: torch.from_numpy(v).to(runner.device) for n, v in inputs.items()}
    for _ in range(WARMUP_REQUESTS):
        runner(**given)
    start, calls = time.perf_counter(), 200
    for _ in range(calls):
        runner(**given)
    in_process = (time.perf_counter() - start) / calls * 1e6
    n = max(1, stages["requests"])
    per = {k: stages[k] / n * 1e6 for k in ("read", "join_split", "runner", "write")}
    lines = [
        f"aotpack model, {stages['requests']:.0f} requests in {stages['executions']:.0f} executions "
        f"(all concurrencies), µs per request:"
    ]
    lines += [f"  {k:<10} {v:8.1f}" for k, v in per.items()]
    inside = sum(per.values())
    lines.append(f"  {'execute':<10} {inside:8.1f}  (the model's share)")
    single = [r for r in rows if r.get("model") == "aotpack" and r.get("concurrency") == 1]
    if single:
        p50 = single[0]["p50_ms"] * 1e3
        lines.append(
            f"  client p50 at concurrency 1: {p50:.1f} µs; outside execute (gRPC, Triton, stub IPC): {p50 - inside:.1f}"
        )
    lines.append(f"  runner in process: {in_process:.1f} µs per call")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
