"""``aotpack serve`` against hostile clients, on 127.0.0.1 with a fixed number of requests:
malformed bodies, lying and oversized shapes, data shorter than its shape are answered 400 with
the reason (and counted as failures) while every good request between them gets the runner's
answer; two clients of a model whose dim 0 mixes rows each get their own answers; a model whose
backend process dies makes the server exit non-zero."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from tests.serve.test_triton_server import Served

pytestmark = pytest.mark.slow

ATOL = 1e-5


def post(port: int, model: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=body, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def kserve(x: np.ndarray, shape=None, data=None) -> bytes:
    entry = {"name": "x", "shape": list(shape or x.shape), "datatype": "FP32"}
    entry["data"] = x.flatten().tolist() if data is None else data
    return json.dumps({"inputs": [entry]}).encode()


def answer(reply: dict) -> np.ndarray:
    (output,) = reply["outputs"]
    return np.reshape(np.asarray(output["data"], dtype=np.float32), output["shape"])


def refused_count(server: Served, model: str) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=10).read().decode()
    found = re.search(
        rf'^nv_inference_request_failure{{model="{model}",reason="REJECTED"[^}}]*}} (\d+)$', text, re.M
    )
    assert found, text[-2000:]
    return int(found.group(1))


def test_hostile_requests_are_refused_and_every_good_one_answered(bundles):
    import aot.loader

    runner = aot.loader.load(bundles("branchy"))
    server = Served(bundles("branchy"))
    try:
        good = np.random.default_rng(0).standard_normal((2, 12, 16)).astype(np.float32)
        want = runner(torch.from_numpy(good)).numpy()
        ones = [0.5] * 32
        hostile = [
            (b"{not json", "the request body is not JSON: "),
            (b'{"outputs": []}', 'expected a KServe v2 body {"inputs": '),
            (kserve(good, data=[0.5] * 10), "input 'x': data holds 10 values, shape [2, 12, 16] needs 384"),
            (
                kserve(good, shape=[1, 2**40, 16], data=ones),
                "input 'x' dim 1 (seq): expected 10 <= seq <= 256",
            ),
            (
                kserve(good, shape=[1, 2**62, 16], data=ones),
                "input 'x' dim 1 (seq): expected 10 <= seq <= 256",
            ),
            (kserve(good, shape=[1, 7, 16], data=[0.5] * 112), "got 7 (guard seq >= 9 from"),
            (kserve(good, shape=[-1, 12, 16], data=ones), "input 'x' dim 0: expected a size, got '-1'"),
            (kserve(good, data=["a"] * 384), "data holds a str, expected numbers"),
        ]
        before = refused_count(server, "branchy")
        for body, reason in hostile:
            status, reply = post(server.http, "branchy", body)
            assert status == 400 and reason in reply["error"], (status, reply)
            status, reply = post(server.http, "branchy", kserve(good))
            assert status == 200, reply
            np.testing.assert_allclose(answer(reply), want, atol=ATOL, rtol=0)
        assert refused_count(server, "branchy") - before == len(hostile)
        assert (
            urllib.request.urlopen(f"http://127.0.0.1:{server.http}/v2/health/ready", timeout=10).status
            == 200
        )
        code, err = server.stop()
        assert code == 0, err
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_two_clients_of_a_model_that_mixes_dim_0_get_their_own_answers(bundles):
    """Sequence-first attention: dim 0 is seq. Two clients send 8 requests each at once; with
    requests joined along dim 0 (as before the row check) each got answers mixed with the other's."""
    import aot.loader

    runner = aot.loader.load(bundles("seq_first_attention"))
    server = Served(bundles("seq_first_attention"), "--max-queue-delay-us=200000")
    try:
        assert "no batching" in server.banner
        inputs = {
            c: [
                np.random.default_rng(10 * c + i).standard_normal((3, 2, 16)).astype(np.float32)
                for i in range(8)
            ]
            for c in (1, 2)
        }
        start = threading.Barrier(2)
        got: dict[int, list] = {}

        def client(c: int) -> None:
            start.wait()
            got[c] = [post(server.http, "seq_first_attention", kserve(x)) for x in inputs[c]]

        threads = [threading.Thread(target=client, args=(c,)) for c in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for c in (1, 2):
            for x, (status, reply) in zip(inputs[c], got[c]):
                assert status == 200, reply
                np.testing.assert_allclose(
                    answer(reply), runner(torch.from_numpy(x)).numpy(), atol=ATOL, rtol=0
                )
    finally:
        if server.process.poll() is None:
            server.stop()


def test_a_dead_backend_process_makes_the_server_exit_non_zero(bundles):
    server = Served(bundles("branchy"))
    try:
        stubs = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit()
            and b"triton_python_backend_stub" in open(f"/proc/{p}/cmdline", "rb").read()
            and str(server.process.pid) in _ancestors(int(p))
        ]
        assert stubs
        os.kill(stubs[0], signal.SIGKILL)
        code, err = server.stop(timeout=60, signal_it=False)
        assert code == 1, err
        (line,) = [line for line in err.splitlines() if line.startswith("error:")]
        assert line.startswith("error: the backend process of model 'branchy' died (pid ")
        assert "so that an orchestrator restarts it" in line and "Traceback" not in err
    finally:
        if server.process.poll() is None:
            server.process.kill()


def _ancestors(pid: int) -> list[str]:
    out = []
    while pid > 1:
        try:
            pid = int(open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        out.append(str(pid))
    return out


def test_sigterm_when_idle_stops_once_drained_without_waiting_for_the_unload(bundles, monkeypatch):
    """Idle, SIGTERM used to take 5 to 8 s here: tritonserver waits for the backend's interpreter to
    tear torch down and polls once a second. Once every inference is done the server is stopped
    (its log, echoed, never gets to the end of the unload)."""
    monkeypatch.setenv("AOTPACK_VERBOSE", "1")
    server = Served(bundles("branchy"))
    server.process.send_signal(signal.SIGTERM)
    code, err = server.stop(timeout=60, signal_it=False)
    assert code == 0, err
    assert "All models are stopped, unloading models" in err and "successfully unloaded" not in err
    assert err.rstrip().endswith("drained and stopped")
