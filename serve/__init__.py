"""Serving stage: a bundle behind the serving engines people already run.

``aot.serve.triton``: ``serve`` runs Triton Inference Server (the ``tritonserver`` that the
nvidia-pytriton wheel ships) on the bundle, KServe v2 over HTTP and gRPC; ``write_repository``
writes a model repository for an existing Triton deployment. ``aot.serve.ray``: a Ray Serve
deployment. ``aot.serve.config`` renders the engines' configuration from the guard manifest
(joining requests only along a dim the build proved row-independent), ``aot.serve.batching``
answers each request of a batch on its own, ``aot.serve.requests`` checks a request's declared
shapes and data before anything allocates, and ``aot.serve.front`` is serve's HTTP front. This package sits above the
loader and imports only the core and the loader; the engines are imported by the modules that use
them, so ``import aot.serve`` needs neither.
"""

from __future__ import annotations

from aot.serve.config import ServingSpec, render_config, serving_spec

__all__ = ["ServingSpec", "render_config", "serving_spec"]
