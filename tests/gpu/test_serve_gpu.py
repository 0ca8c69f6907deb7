"""``aotpack serve --device cuda`` on a GPU: the bundle's answers over gRPC equal the runner's on the
same GPU, and concurrent single-row requests are batched. Needs nvidia-pytriton's tritonserver on the
GPU machine (bench/device_serve.sh carries its wheels there and runs this test).

    AOTPACK_GPU_BUNDLES=/path/with/mlp.tpk pytest -m gpu tests/gpu/test_serve_gpu.py
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

BUNDLES = Path(os.environ.get("AOTPACK_GPU_BUNDLES", "bundles"))


@pytest.fixture(scope="module")
def served():
    from aot.errors import EnvError
    from aot.serve.config import open_spec
    from aot.serve.triton import TritonServer, find_tritonserver, write_model

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    try:  # the wheel's files only (importing pytriton would import its client and its needs)
        find_tritonserver()
    except EnvError as e:
        pytest.skip(str(e))
    bundle = BUNDLES / "mlp.tpk"
    if not bundle.is_file():
        pytest.skip(f"no {bundle}")
    import tempfile

    repo = Path(tempfile.mkdtemp(prefix="serve-gpu-"))
    spec = open_spec(bundle)
    write_model(repo, spec, str(bundle.resolve()), "cuda", 2000)
    server = TritonServer(repo, spec.name, 0, 0, 0, address="127.0.0.1", drain_timeout=5)
    server.start(timeout=300)
    yield server, spec, bundle
    assert server.stop() == 0


def test_grpc_answers_equal_the_runner_on_the_gpu(served):
    import tritonclient.grpc as grpcclient

    import aot.loader

    server, spec, bundle = served
    runner = aot.loader.load(bundle, device="cuda")
    inputs = [runner.inputs_at({spec.batch_symbol: 1}, seed=i)[spec.inputs[0].name] for i in range(16)]

    def one(x: torch.Tensor) -> np.ndarray:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        given = grpcclient.InferInput(spec.inputs[0].name, list(x.shape), spec.inputs[0].triton_dtype)
        given.set_data_from_numpy(x.cpu().numpy())
        try:
            return client.infer(spec.name, [given]).as_numpy(spec.outputs[0].name)
        finally:
            client.close()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, inputs))
    for x, got in zip(inputs, answers):
        want = runner(x).float().cpu().numpy()
        # fp16 on the GPU: a row computed in a batch of several may differ from one computed alone
        np.testing.assert_allclose(got.astype(np.float32), want, atol=2e-2, rtol=2e-2)
