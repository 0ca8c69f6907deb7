"""Serving a bundle with Ray Serve: ``deployment(bundle_path)`` is an application for ``serve.run``.

Each replica loads the bundle once. Calls are gathered with ``@serve.batch`` (counted in rows, up to
the largest CUDA-graph bucket of the batch dim) and answered through ``aot.serve.batching``, so a
request outside the guards fails alone. Two ways in:

- a deployment handle: ``await handle.remote({"x": array})`` returns ``{output name: numpy array}``
  (bfloat16 outputs as float32), and raises ``GuardError`` for a request out of contract;
- HTTP: a KServe v2 JSON body ``{"inputs": [{"name", "shape", "datatype", "data"}]}`` answered with
  ``{"model_name", "outputs": [...]}``, or status 400 and ``{"error": GuardError text}``.

Needs ``pip install 'aotpack[ray]'``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from ray import serve

from aot.errors import AotError, GuardError
from aot.serve.batching import GUARD, Reply, run_requests
from aot.serve.config import TRITON_DTYPES, ServingSpec, open_spec

DEFAULT_BATCH_WAIT_S = 0.002  # how long the first call of a batch waits for others
KSERVE_DTYPES = {v: k for k, v in TRITON_DTYPES.items()}  # "FP16" -> "float16"


def _rows(items: Sequence[Any]) -> int:
    """A batch's size in rows, as ``@serve.batch`` counts it (a call that cannot join counts 1)."""
    total = 0
    for item in items:
        first = item[0] if isinstance(item, list) and item else None
        total += int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1
    return total


def from_kserve(body: Any, spec: ServingSpec) -> list[torch.Tensor]:
    """A KServe v2 JSON request's tensors, in the bundle's input order; ``GuardError`` for a body
    that is not one (the client's mistake: a 400 too)."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise GuardError('expected a KServe v2 body {"inputs": [{"name", "shape", "datatype", "data"}]}')
    given = {}
    for entry in body["inputs"]:
        if not isinstance(entry, dict) or not {"name", "shape", "datatype", "data"} <= set(entry):
            raise GuardError("each KServe v2 input needs name, shape, datatype and data")
        dtype = KSERVE_DTYPES.get(entry["datatype"])
        if dtype is None:
            raise GuardError(
                f"input {str(entry['name'])[:60]!r}: datatype {str(entry['datatype'])[:20]!r} is not one of "
                f"{sorted(KSERVE_DTYPES)}"
            )
        try:
            value = torch.tensor(entry["data"], dtype=getattr(torch, dtype)).reshape(
                [int(s) for s in entry["shape"]]
            )
        except (TypeError, ValueError, RuntimeError) as e:
            raise GuardError(f"input {str(entry['name'])[:60]!r}: data does not fit its shape: {e}") from None
        given[entry["name"]] = value
    return _ordered(given, spec)


def _ordered(given: dict[str, Any], spec: ServingSpec) -> list[torch.Tensor]:
    names = [s.name for s in spec.inputs]
    missing = [n for n in names if n not in given]
    extra = sorted(set(given) - set(names))
    if missing or extra:
        raise GuardError(f"expected inputs {names}, got {sorted(given)}")
    return [torch.as_tensor(given[n]) for n in names]


def to_kserve(reply: Reply, spec: ServingSpec) -> dict[str, Any]:
    outputs = []
    for slot, value in zip(spec.outputs, reply.outputs):
        value = value.detach().cpu()
        data = value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
        outputs.append(
            {
                "name": slot.name,
                "shape": list(value.shape),
                "datatype": slot.triton_dtype,
                "data": data.flatten().tolist(),
            }
        )
    return {"model_name": spec.name, "outputs": outputs}


class BundleDeployment:
    """One replica: the bundle loaded on ``device``; batched calls through ``aot.serve.batching``."""

    def __init__(self, bundle_path: str, name: str | None, device: str, max_batch_size: int, wait_s: float):
        import aot.loader

        self.spec = open_spec(bundle_path, name)
        self.runner = aot.loader.load(bundle_path, device=device)
        self.max_rows = self.spec.max_batch_size  # 0 unless the build proved the rows independent
        logging.getLogger("ray.serve").info("aotpack %s: %s", self.spec.name, self.spec.batching)
        # per instance: @serve.batch on the class would share one queue (and its event loop, and
        # its batch size) among every replica object of this class in the process
        self.handle_batch = serve.batch(
            max_batch_size=max(1, max_batch_size), batch_wait_timeout_s=wait_s, batch_size_fn=_rows
        )(self._run_batch)

    def _call(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        from aot.pytree import leaves

        inputs = {s.name: v.to(self.runner.device) for s, v in zip(self.spec.inputs, values)}
        return leaves(self.runner(**inputs))

    async def _run_batch(self, requests: list[list[torch.Tensor]]) -> list[Reply]:
        return run_requests(self._call, requests, self.max_rows)

    async def __call__(self, request: Any) -> Any:
        if isinstance(request, dict):  # a deployment handle's call
            reply = await self.handle_batch(_ordered(request, self.spec))
            if not reply.ok:
                raise GuardError(reply.error) if reply.kind == GUARD else AotError(reply.error)
            return {
                slot.name: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
                for slot, v in zip(self.spec.outputs, reply.outputs)
            }
        from starlette.responses import JSONResponse

        try:
            values = from_kserve(await request.json(), self.spec)
        except GuardError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except ValueError as e:  # not JSON
            return JSONResponse({"error": f"the body is not JSON: {e}"}, status_code=400)
        reply = await self.handle_batch(values)
        if not reply.ok:
            return JSONResponse({"error": reply.error}, status_code=400 if reply.kind == GUARD else 500)
        return JSONResponse(to_kserve(reply, self.spec))


def deployment(
    bundle_path: str | os.PathLike,
    name: str | None = None,
    device: str = "cpu",
    max_batch_size: int | None = None,
    batch_wait_timeout_s: float = DEFAULT_BATCH_WAIT_S,
    **options: Any,
) -> Any:
    """A Ray Serve application serving the bundle: ``serve.run(deployment("mlp.tpk"))``.

    ``max_batch_size``: rows gathered into one call [default: the largest CUDA-graph bucket of the
    batch dim, within the bundle's maximum; 1 when the bundle has no batch dim]. Calls are joined
    only along a dim whose rows the build proved independent (``ServingSpec.batching`` says why
    not, and is logged at start); otherwise each runs alone whatever this says. ``options`` go to
    ``serve.deployment`` (``num_replicas``, ``ray_actor_options={"num_gpus": 1}``,
    ``autoscaling_config``, ...). The bundle path must be readable where the replicas run."""
    spec = open_spec(bundle_path, name)
    if max_batch_size is None:
        largest = max(spec.buckets, default=spec.max_batch_size)
        max_batch_size = min(largest, spec.max_batch_size) if spec.max_batch_size else 1
    options.setdefault("name", spec.name)
    options.setdefault("max_ongoing_requests", max(100, 2 * max_batch_size))
    app = serve.deployment(**options)(BundleDeployment)
    return app.bind(str(bundle_path), name, device, int(max_batch_size), float(batch_wait_timeout_s))
