"""The real tritonserver (from the nvidia-pytriton wheel) serving bundles on loopback ports: KServe
v2 answers over HTTP and gRPC equal the runner's, concurrent requests are batched and each gets its
own answer, requests outside the guards get the GuardError text as a 400-class error while the
server keeps serving, metrics are exported, SIGTERM drains and exits 0, a model that fails to load
is reported in one line, a ``triton-repo`` repository serves as it is, and the backend stub embeds
this interpreter whatever ``python3`` PATH finds first."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from aot.errors import EnvError
from tests.serve.conftest import free_ports

pytestmark = pytest.mark.slow

ATOL = 1e-5
STARTUP_S = 120
MODEL = "branchy"  # float32, batch 1..16, seq even and >= 10
BANNER = re.compile(r"serving \S+ on http://127\.0\.0\.1:(\d+) \(gRPC :(\d+), metrics :(\d+)/metrics\)")


class Served:
    """``aotpack serve`` running in a subprocess on free loopback ports."""

    def __init__(self, bundle, *extra: str):
        # port 0: serve picks free ports and names them in the banner (ports picked here and
        # handed over could be taken meanwhile by another test's server on a busy machine)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "aot.cli", "serve", str(bundle), "--address", "127.0.0.1"]
            + ["--http-port=0", "--grpc-port=0", "--metrics-port=0", "--drain-timeout=10", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready, _, _ = select.select([self.process.stdout], [], [], STARTUP_S)  # the banner: model ready
        if not ready:
            self.process.kill()
            pytest.fail(
                f"aotpack serve printed nothing in {STARTUP_S} s: {self.process.communicate()[1][-2000:]}"
            )
        self.banner = self.process.stdout.readline()
        if not self.banner.startswith("serving "):
            self.process.kill()
            pytest.fail(f"aotpack serve did not start: {self.banner} {self.process.communicate()[1][-2000:]}")
        ports = BANNER.match(self.banner)
        assert ports, self.banner
        self.http, self.grpc, self.metrics = (int(p) for p in ports.groups())

    def stop(self, timeout: float = 60, signal_it: bool = True) -> tuple[int, str]:
        if signal_it:
            self.process.send_signal(signal.SIGTERM)
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, err

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10).read().decode()
        found = re.search(rf'^{name}{{[^}}]*model="{MODEL}"[^}}]*}} (\S+)$', text, re.M)
        assert found, f"{name} not in metrics"
        return float(found.group(1))


@pytest.fixture(scope="module")
def runner(bundles):
    import aot.loader

    return aot.loader.load(bundles(MODEL))


@pytest.fixture(scope="module")
def served(bundles):
    server = Served(bundles(MODEL))
    yield server
    if server.process.poll() is None:
        server.stop()


def x_of(rows: int, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, seq, 16)).astype(np.float32)


def expected(runner, x: np.ndarray) -> np.ndarray:
    return runner(torch.from_numpy(x)).numpy()


def test_http_and_grpc_answers_equal_the_runner(served, runner):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    assert served.banner.startswith(f"serving {MODEL} on http://127.0.0.1:{served.http}")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{served.http}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    try:
        assert http.is_server_live() and http.is_server_ready() and http.is_model_ready(MODEL)
        meta = http.get_model_metadata(MODEL)
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 16]}]
        for rows, seq in ((1, 16), (3, 10), (16, 32)):
            x = x_of(rows, seq, seed=rows)
            want = expected(runner, x)
            for client, module in ((http, httpclient), (grpc, grpcclient)):
                given = module.InferInput("x", list(x.shape), "FP32")
                given.set_data_from_numpy(x)
                got = client.infer(MODEL, [given]).as_numpy("output")
                np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    finally:
        http.close()
        grpc.close()


def test_concurrent_single_rows_are_batched_and_each_gets_its_answer(served, runner):
    import tritonclient.grpc as grpcclient

    before = served.metric("nv_inference_exec_count"), served.metric("nv_inference_request_success")
    inputs = [x_of(1, 16, seed=100 + i) for i in range(16)]
    start = threading.Barrier(16)

    def one(x):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
        given = grpcclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        start.wait()
        try:
            return client.infer(MODEL, [given]).as_numpy("output")
        finally:
            client.close()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, inputs))
    for x, got in zip(inputs, answers):
        np.testing.assert_allclose(got, expected(runner, x), atol=ATOL, rtol=0)
    executions = served.metric("nv_inference_exec_count") - before[0]
    assert served.metric("nv_inference_request_success") - before[1] == 16
    assert 1 <= executions < 16, f"16 concurrent requests took {executions} executions: not batched"


def test_out_of_contract_requests_get_the_guard_text_and_the_server_keeps_serving(served, runner):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    bad = x_of(2, 7)
    with pytest.raises(Exception) as caught:
        runner(torch.from_numpy(bad))
    guard_text = str(caught.value)
    assert "seq" in guard_text and "got 7" in guard_text
    http = httpclient.InferenceServerClient(f"127.0.0.1:{served.http}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    try:
        for client, module, status in (
            (http, httpclient, "400"),
            (grpc, grpcclient, "StatusCode.INVALID_ARGUMENT"),
        ):
            given = module.InferInput("x", list(bad.shape), "FP32")
            given.set_data_from_numpy(bad)
            with pytest.raises(InferenceServerException) as refused:
                client.infer(MODEL, [given])
            assert str(refused.value.status()) == status
            assert refused.value.message() == guard_text
        # raw HTTP: the status line itself says 400, and the body carries the guard text
        body = (
            b'{"inputs": [{"name": "x", "shape": [1, 7, 16], "datatype": "FP32", "data": ['
            + b", ".join([b"0.5"] * 112)
            + b"]}]}"
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{served.http}/v2/models/{MODEL}/infer", data=body, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as http_error:
            urllib.request.urlopen(request, timeout=30)
        assert http_error.value.code == 400 and "got 7" in http_error.value.read().decode()
        x = x_of(2, 12)
        given = grpcclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        np.testing.assert_allclose(
            grpc.infer(MODEL, [given]).as_numpy("output"), expected(runner, x), atol=ATOL, rtol=0
        )
        assert http.is_server_live()
    finally:
        http.close()
        grpc.close()


def test_metrics_endpoint(served):
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics}/metrics", timeout=10).read().decode()
    for name in ("nv_inference_request_success", "nv_inference_exec_count", "nv_inference_queue_duration_us"):
        assert f'{name}{{model="{MODEL}",version="1"}}' in text


def _pending(server: Served, model: str, want: int, within: float) -> int:
    """Triton's count of requests waiting for ``model``, polled until it reaches ``want`` or
    ``within`` seconds pass."""
    pattern = re.compile(rf'nv_inference_pending_request_count\{{model="{model}",version="1"\}} (\d+)')
    deadline, count = time.monotonic() + within, 0
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=5).read().decode()
        found = pattern.search(text)
        count = int(found.group(1)) if found else 0
        if count >= want or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def test_sigterm_drains_and_exits_zero(bundles, runner):
    """Requests still waiting in the batcher's queue (a 3 s queue delay) when SIGTERM comes, one over
    gRPC and one over HTTP, are answered before the server exits 0."""
    import queue

    import tritonclient.grpc as grpcclient

    server = Served(bundles(MODEL), "--max-queue-delay-us=3000000")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    x = x_of(3)
    given = grpcclient.InferInput("x", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    answers: queue.Queue = queue.Queue()
    client.async_infer(
        MODEL, [given], callback=lambda result, error: answers.put((result, error, time.monotonic()))
    )
    # 3 rows each, 6 together: no preferred size (the batch buckets above 1: 2, 4, 8, 16) is met in whichever
    # order they arrive, so both wait in the queue (2 rows alone met one and ran at once)
    x2 = x_of(3, seed=5)
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [3, 16, 16], "datatype": "FP32", "data": x2.flatten().tolist()}]}
    ).encode()
    url = f"http://127.0.0.1:{server.http}/v2/models/{MODEL}/infer"
    over_http: queue.Queue = queue.Queue()

    def post() -> None:
        answer = urllib.request.urlopen(urllib.request.Request(url, body), timeout=30).read()
        over_http.put((answer, time.monotonic()))

    threading.Thread(target=post, daemon=True).start()
    # SIGTERM once both wait in the batcher's queue (Triton's pending-request gauge), well inside
    # the 3 s delay: a fixed sleep lost the HTTP request on a loaded machine, before it was sent
    assert _pending(server, MODEL, want=2, within=2.5) == 2, "the two requests never reached the queue"
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    result, error, answered = answers.get(timeout=30)
    assert error is None, error
    np.testing.assert_allclose(result.as_numpy("output"), expected(runner, x), atol=ATOL, rtol=0)
    answer, answered_http = over_http.get(timeout=30)
    (output,) = json.loads(answer)["outputs"]
    np.testing.assert_allclose(
        np.reshape(output["data"], output["shape"]), expected(runner, x2), atol=ATOL, rtol=0
    )
    assert min(answered, answered_http) > start  # they were still in flight when SIGTERM came
    # the client's keep-alive connection is still open: the drain must not turn that into a failure
    code, err = server.stop(signal_it=False)
    client.close()
    assert code == 0, err
    assert "Traceback" not in err and "error" not in err.lower()
    assert time.monotonic() - start < 40


def test_a_model_that_fails_to_load_is_reported_in_one_line(tmp_path, bundles):
    from aot.serve.config import open_spec
    from aot.serve.triton import TritonServer, write_model

    spec = open_spec(bundles(MODEL))
    write_model(tmp_path, spec, "1/missing.tpk", "cpu", 100)
    server = TritonServer(tmp_path, spec.name, 0, 0, 0, address="127.0.0.1")
    with pytest.raises(EnvError) as caught:
        server.start(timeout=120)
    message = str(caught.value)
    assert "\n" not in message and "\\n" not in message, message
    assert f"failed to load '{MODEL}'" in message and "BundleError" in message and "missing.tpk" in message


def _answers_like_the_runner(repo, name: str, x: np.ndarray, runner) -> None:
    """tritonserver on the model repository ``repo``: one HTTP request of ``x`` to model ``name``
    gets the runner's answer, and the server then stops with exit status 0."""
    import tritonclient.http as httpclient

    from aot.serve.triton import TritonServer

    server = TritonServer(repo, name, 0, 0, 0, address="127.0.0.1", drain_timeout=5)
    server.start(timeout=120)
    try:
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        given = httpclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        got = client.infer(name, [given]).as_numpy("output")
        client.close()
        np.testing.assert_allclose(got, expected(runner, x), atol=ATOL, rtol=0)
    finally:
        assert server.stop() == 0


def test_a_triton_repo_repository_is_served_by_the_real_server(tmp_path, bundles, runner):
    from aot.serve.triton import write_repository

    repo = tmp_path / "repo"
    write_repository(bundles(MODEL), repo, name="served-repo")
    _answers_like_the_runner(repo, "served-repo", x_of(4, 20, seed=7), runner)


def test_the_stub_embeds_this_interpreter_whatever_python3_path_finds_first(
    tmp_path, bundles, runner, monkeypatch
):
    from aot.serve.config import open_spec
    from aot.serve.triton import write_model

    # The stub's Python takes the first python3 on PATH as its own; another install's (here the
    # system's, if any) would give it the wrong standard library, site-packages and numpy.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    spec = open_spec(bundles(MODEL))
    write_model(tmp_path, spec, str(bundles(MODEL)), "cpu", 100)
    _answers_like_the_runner(tmp_path, spec.name, x_of(2, 12, seed=3), runner)


def _ready(client, process: subprocess.Popen, model: str) -> bool:
    """Whether ``model`` became ready on tritonserver ``process`` before it exited (False) or
    ``STARTUP_S`` passed (a failure)."""
    for _ in range(int(STARTUP_S / 0.5)):
        try:
            if client.is_model_ready(model):
                return True
        except Exception:
            pass
        if process.poll() is not None:
            return False
        time.sleep(0.5)
    pytest.fail(f"model {model!r} was not ready after {STARTUP_S} s")


def test_a_triton_repo_repository_loads_with_the_documented_command(tmp_path, bundles, runner):
    """The README's command, with the tritonserver of the serve extra: no backend folder, no
    LD_LIBRARY_PATH, only the environment's bin first on PATH (an activated venv); ports added."""
    import os

    import tritonclient.http as httpclient

    from aot.serve.triton import find_tritonserver, write_repository

    repo = tmp_path / "repo"
    write_repository(bundles(MODEL), repo, name="documented")
    assert "--model-repository=$PWD" in (repo / "README.md").read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "AOTPACK_SITE_DIRS")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    log = tmp_path / "tritonserver.log"
    for attempt in range(3):  # a port free here may be taken before tritonserver listens on it
        http, grpc, metrics = free_ports(3)
        command = [str(find_tritonserver().server), f"--model-repository={repo}"]
        command += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        if _ready(client, process, "documented"):
            break
        process.kill()
        process.wait()
        assert attempt < 2 and "failed to start" in log.read_text(), log.read_text()[-2000:]
    try:
        x = x_of(2, 12, seed=11)
        given = httpclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        np.testing.assert_allclose(
            client.infer("documented", [given]).as_numpy("output"), expected(runner, x), atol=ATOL, rtol=0
        )
        client.close()
    finally:
        process.kill()
        process.wait()
