"""The Ray Serve deployment: in Ray Serve's local testing mode (no cluster: the default run) handle
calls equal the runner, concurrent calls are batched and each gets its own answer, and a call
outside the guards fails alone with the GuardError; the KServe v2 JSON path answers 400 with the
guard text. The slow test serves over HTTP on a real local Ray instance."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from aot.errors import GuardError
from tests.serve.conftest import free_ports

pytest.importorskip("ray.serve")

MODEL = "branchy"
ATOL = 1e-5


@pytest.fixture(autouse=True)
def no_replica_context_warning(monkeypatch):
    """Ray 2.60's @serve.batch reads the replica context, which local testing mode (and a replica
    made outside Serve) never sets, only to log a warning about max_ongoing_requests."""
    import ray.serve.batching

    monkeypatch.setattr(
        ray.serve.batching._BatchQueue,
        "_warn_if_max_batch_size_exceeds_max_ongoing_requests",
        lambda self: None,
    )


@pytest.fixture(scope="module")
def runner(bundles):
    import aot.loader

    return aot.loader.load(bundles(MODEL))


def x_of(rows: int, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, seq, 16)).astype(np.float32)


def test_local_testing_mode_batches_and_answers_each_call(bundles, runner, monkeypatch):
    from ray import serve

    import aot.serve.ray as serve_ray

    calls = []
    real = serve_ray.run_requests
    monkeypatch.setattr(
        serve_ray,
        "run_requests",
        lambda call, requests, rows: calls.append(len(requests)) or real(call, requests, rows),
    )
    app = serve_ray.deployment(bundles(MODEL), batch_wait_timeout_s=0.05)
    handle = serve.run(app, _local_testing_mode=True)
    x = x_of(3)
    got = handle.remote({"x": x}).result()
    np.testing.assert_allclose(got["output"], runner(torch.from_numpy(x)).numpy(), atol=ATOL, rtol=0)
    inputs = [x_of(1, seed=i) for i in range(16)] + [x_of(1, seq=7)]
    pending = [handle.remote({"x": x}) for x in inputs]
    with pytest.raises(GuardError, match=r"dim 1 \(seq\).*got 7"):
        pending[-1].result()
    for x, call in zip(inputs[:-1], pending[:-1]):
        np.testing.assert_allclose(
            call.result()["output"], runner(torch.from_numpy(x)).numpy(), atol=ATOL, rtol=0
        )
    assert len(calls) < 1 + 17, calls  # the 17 calls came in fewer batches
    assert max(calls) > 1
    with pytest.raises(GuardError, match="expected inputs"):
        handle.remote({"y": x}).result()


class FakeRequest:
    def __init__(self, body):
        self.body = body

    async def json(self):
        if isinstance(self.body, bytes):
            return json.loads(self.body)
        return self.body


def kserve(x: np.ndarray) -> dict:
    return {
        "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}]
    }


def test_kserve_json_answers_and_400s(bundles, runner):
    from aot.serve.ray import BundleDeployment

    x, bad = x_of(2, 12), x_of(2, 7)
    with pytest.raises(GuardError) as caught:
        runner(torch.from_numpy(bad))
    bodies = [
        kserve(x),
        kserve(bad),
        {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0]}]},
        {"inputs": [{"name": "x", "shape": [1], "datatype": "STRING", "data": ["a"]}]},
        b"[1, 2]",
    ]

    async def ask_all():  # one event loop: the replica's batch queue lives on it
        replica = BundleDeployment(str(bundles(MODEL)), None, "cpu", 16, 0.001)
        answers = []
        for body in bodies:
            response = await asyncio.wait_for(replica(FakeRequest(body)), timeout=60)
            answers.append((response.status_code, json.loads(response.body)))
        return answers

    ok, guard, shape, dtype, not_kserve = asyncio.run(ask_all())
    assert ok[0] == 200 and ok[1]["model_name"] == MODEL
    (out,) = ok[1]["outputs"]
    assert out["name"] == "output" and out["datatype"] == "FP32" and out["shape"] == [2, 12, 16]
    want = runner(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(
        np.array(out["data"], np.float32).reshape(out["shape"]), want, atol=ATOL, rtol=0
    )
    assert guard == (400, {"error": str(caught.value)})
    assert shape[0] == 400 and "does not fit its shape" in shape[1]["error"]
    assert dtype[0] == 400 and "datatype" in dtype[1]["error"]
    assert not_kserve[0] == 400 and "KServe v2 body" in not_kserve[1]["error"]


@pytest.mark.slow
def test_http_on_a_real_local_ray_instance(bundles, runner):
    import ray
    import requests
    from ray import serve

    from aot.serve.ray import deployment

    (port,) = free_ports(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(bundles(MODEL)), route_prefix="/branchy")
        x = x_of(2, 10)
        answer = requests.post(f"http://127.0.0.1:{port}/branchy", json=kserve(x), timeout=60)
        assert answer.status_code == 200, answer.text
        (out,) = answer.json()["outputs"]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, runner(torch.from_numpy(x)).numpy(), atol=ATOL, rtol=0)
        refused = requests.post(f"http://127.0.0.1:{port}/branchy", json=kserve(x_of(1, 7)), timeout=60)
        assert refused.status_code == 400 and "got 7" in refused.json()["error"]
    finally:
        serve.shutdown()
        ray.shutdown()
