"""The Triton Python-backend model that serves a bundle: ``TritonPythonModel`` for ``model.py``.

Triton's Python backend runs ``model.py`` in its own interpreter (the backend stub) and calls
``initialize`` once per instance and ``execute`` with the requests its dynamic batcher gathered.
``initialize`` loads the bundle named by the config's ``bundle`` parameter (a path relative to the
model's folder, or absolute) on the config's ``device``; ``execute`` runs the requests through
``aot.serve.batching`` and answers each one: its outputs, or its error as ``INVALID_ARG`` (outside
the guards: HTTP 400, gRPC INVALID_ARGUMENT) or ``INTERNAL``. PyTriton's own model binding cannot
fail one request of a batch, which is why the bundle is bound here rather than through it.

``triton_python_backend_utils`` exists only inside the stub, so it is imported in ``initialize``.
``initialize`` first checks that the stub moves tensor bytes intact under this numpy
(``check_numpy_bridge``): nvidia-pytriton's stubs (0.7) were built with a pybind11 that predates
numpy 2, and under numpy 2 they read every input wrongly and send empty outputs, without an error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from aot.errors import EnvError, GuardError
from aot.pytree import leaves
from aot.serve.batching import GUARD, BatchStats, run_requests
from aot.serve.config import HALF_DTYPES
from aot.serve.requests import RequestCheck

ENV_SITE_DIRS = "AOTPACK_SITE_DIRS"
ENV_PROFILE = "AOTPACK_SERVE_PROFILE"
# execute's stages: reading and checking the inputs, joining and splitting (run_requests less the
# runner), the runner's calls, writing the outputs
PROFILE_STAGES = ("read", "join_split", "runner", "runner_seen", "write", "executions", "requests")


def check_numpy_bridge(pb_utils: Any) -> None:
    """``EnvError`` unless a tensor read back through the stub's C++ side (the path every request's
    inputs take) has the bytes that were put in."""
    sent = np.arange(1, 5, dtype=np.float32)
    back = pb_utils.Tensor.from_dlpack("probe", pb_utils.Tensor("probe", sent).to_dlpack()).as_numpy()
    if back.shape != sent.shape or not np.array_equal(back, sent):
        raise EnvError(
            f"Triton's Python backend stub reads tensors wrongly under numpy {np.__version__} "
            f"(read back {back.tolist()} for {sent.tolist()}): nvidia-pytriton's stubs need numpy<2. "
            f"Install numpy<2 in the environment of the stub's Python ({sys.executable}): it runs "
            "isolated, so PYTHONPATH does not reach it"
        )


class TritonPythonModel:
    """One instance of the bundle's model in Triton."""

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        import aot.loader

        check_numpy_bridge(pb_utils)
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        folder = args["model_repository"]  # the model's folder: REPO/NAME
        bundle = os.path.join(folder, params["bundle"])  # an absolute parameter stays absolute
        device = params.get("device", "cpu")
        if device == "cuda" and args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.runner = aot.loader.load(bundle, device=device)
        # --io-dtype float32: half-precision inputs arrive as float32 and outputs leave as float32
        io_dtype = params.get("io_dtype", "")
        guards = self.runner.manifest.guards
        self.casts = {
            i.name: getattr(torch, i.dtype) for i in guards.inputs if io_dtype and i.dtype in HALF_DTYPES
        }
        self.io_dtype = getattr(torch, io_dtype) if io_dtype else None
        self.check = RequestCheck(guards, {n: io_dtype for n in self.casts})
        self.device = self.runner.device
        self.inputs = [i["name"] for i in config["input"]]
        self.bf16 = {i["name"] for i in config["input"] if i["data_type"] == "TYPE_BF16"}
        self.outputs = [(o["name"], o["data_type"]) for o in config["output"]]
        self.max_rows = int(config.get("max_batch_size", 0))
        self.stats = BatchStats()
        # AOTPACK_SERVE_PROFILE=FILE: seconds spent per stage of execute, written at finalize
        self.profile_path = os.environ.get(ENV_PROFILE, "")
        self.profile = dict.fromkeys(PROFILE_STAGES, 0.0) if self.profile_path else None

    def _call(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.profile is None:
            return leaves(self.runner(**dict(zip(self.inputs, values))))
        start = time.perf_counter()
        try:
            return leaves(self.runner(**dict(zip(self.inputs, values))))
        finally:
            self.profile["runner"] += time.perf_counter() - start

    def _tensor(self, request: Any, name: str) -> torch.Tensor:
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise KeyError(name)
        if name in self.bf16:  # numpy has no bfloat16: through DLPack
            value = torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).clone()
        else:
            array = tensor.as_numpy()
            value = torch.from_numpy(array if array.flags.writeable else array.copy())
        cast = self.casts.get(name)
        return value.to(self.device, dtype=cast) if cast is not None else value.to(self.device)

    def _output(self, name: str, value: torch.Tensor) -> Any:
        value = value.detach().contiguous().cpu()
        if self.io_dtype is not None and value.dtype in (torch.float16, torch.bfloat16):
            value = value.to(self.io_dtype)
        if value.dtype == torch.bfloat16:
            return self.pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value))
        return self.pb.Tensor(name, np.ascontiguousarray(value.numpy()))

    def _read(self, request: Any) -> list[torch.Tensor]:
        """The request's inputs, once their declared shapes are within the guards (reading a
        tensor allocates what its shape says: ``[1, 2**62, 16]`` killed the stub); ``GuardError``
        for a shape outside."""
        shapes = {}
        for name in self.inputs:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise GuardError(f"missing input {name!r}; expected inputs {self.inputs}")
            shapes[name] = [int(s) for s in tensor.shape()]
        self.check.shapes(shapes, relations=False)  # the runner checks the relations
        return [self._tensor(request, n) for n in self.inputs]

    def execute(self, requests: list[Any]) -> list[Any]:
        if self.profile is None:
            return self._execute(requests)
        marks = [time.perf_counter()]
        answers = self._execute(requests, marks)
        marks.append(time.perf_counter())
        stages = self.profile
        stages["read"] += marks[1] - marks[0]
        stages["join_split"] += marks[2] - marks[1] - (stages["runner"] - stages["runner_seen"])
        stages["runner_seen"] = stages["runner"]
        stages["write"] += marks[3] - marks[2]
        stages["executions"] += 1
        stages["requests"] += len(requests)
        return answers

    def _execute(self, requests: list[Any], marks: list[float] | None = None) -> list[Any]:
        pb = self.pb
        values, answers = [], [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                values.append((i, self._read(request)))
            except GuardError as e:
                answers[i] = pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG))
            except Exception as e:  # an unreadable input: this request's error only
                answers[i] = pb.InferenceResponse(
                    error=pb.TritonError(f"{type(e).__name__}: {e}", pb.TritonError.INVALID_ARG)
                )
        if marks is not None:
            marks.append(time.perf_counter())
        replies = run_requests(self._call, [v for _, v in values], self.max_rows, self.stats)
        if marks is not None:
            marks.append(time.perf_counter())
        for (i, _), reply in zip(values, replies):
            if reply.ok:
                tensors = [self._output(n, t) for (n, _), t in zip(self.outputs, reply.outputs)]
                answers[i] = pb.InferenceResponse(output_tensors=tensors)
            else:
                code = pb.TritonError.INVALID_ARG if reply.kind == GUARD else pb.TritonError.INTERNAL
                answers[i] = pb.InferenceResponse(error=pb.TritonError(reply.error, code))
        return answers

    def finalize(self) -> None:
        self.runner = None
        if self.profile is not None:
            with open(self.profile_path, "w") as f:
                json.dump({k: v for k, v in self.profile.items() if k != "runner_seen"}, f)
