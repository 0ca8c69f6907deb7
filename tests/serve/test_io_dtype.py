"""``aotpack serve --io-dtype float32``: a float16 bundle answers KServe v2 JSON (which Triton
refuses for FP16 both ways) with float32 on the wire, cast inside the model backend; the answer
is the runner's float16 answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.serve.test_hostile_clients import answer, post
from tests.serve.test_triton_server import Served

pytestmark = pytest.mark.slow


def test_a_float16_bundle_answers_float32_json(bundles):
    import aot.loader

    runner = aot.loader.load(bundles("small_mlp"))
    x = np.random.default_rng(3).standard_normal((3, 32)).astype(np.float32)
    want = runner(torch.from_numpy(x).half()).float().numpy()
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [3, 32], "datatype": "FP32", "data": x.flatten().tolist()}]}
    )
    server = Served(bundles("small_mlp"), "--io-dtype", "float32")
    try:
        status, reply = post(server.http, "small_mlp", body.encode())
        assert status == 200, reply
        assert reply["outputs"][0]["datatype"] == "FP32"
        np.testing.assert_array_equal(answer(reply), want)  # the same float16 values, widened
        status, reply = post(server.http, "small_mlp", body.replace('"FP32"', '"FP16"').encode())
        assert (status, reply["error"]) == (400, "input 'x': expected datatype FP32, got FP16")
    finally:
        if server.process.poll() is None:
            server.stop()
