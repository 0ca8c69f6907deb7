"""Real architectures, unmodified, built into bundles and compared with eager PyTorch on CPU at
batch 1, seq 1, odd sizes and the maximum; no declared range may be narrowed.

Tolerance (float32): max |bundle - eager| <= 1e-4 * max(1, max |eager|) per output: the CPU path
runs the same ATen ops as eager, except where the build rewrote them (SDPA without an explicit
causal mask, fused kernels' reference decompositions), which changes rounding only.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.realmodels.zoo import ZOO

pytest.importorskip("transformers")

RTOL = 1e-4
ARCHS = ("sm_90",)


class Built:
    def __init__(self, tmp_path_factory):
        self.base = tmp_path_factory.mktemp("realmodels")
        self.cache: dict[str, tuple] = {}

    def __call__(self, name: str):
        if name not in self.cache:
            from aot.codegen import generate
            from aot.loader import load
            from aot.packager import pack
            from aot.tracer import instantiate, trace

            spec = ZOO[name].spec()
            start = time.perf_counter()
            compiled = generate(trace(spec), ARCHS)
            path = self.base / f"{name}.tpk"
            pack(compiled, path)
            seconds = time.perf_counter() - start
            self.cache[name] = (spec, instantiate(spec), load(path), compiled, seconds)
        return self.cache[name]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return Built(tmp_path_factory)


def _library(name: str) -> None:
    lib = ZOO[name].library
    if lib in ("timm", "torchvision"):
        from tests.realmodels.zoo import import_torchvision

        try:
            import_torchvision()
        except Exception as e:  # a torchvision that cannot load at all on this torch
            pytest.skip(f"torchvision does not import here: {type(e).__name__}: {e}")
    pytest.importorskip(lib)


@pytest.mark.parametrize("name", list(ZOO))
def test_matches_eager_at_batch_one_odd_sizes_and_the_maximum(built, name):
    from aot.pytree import leaves
    from aot.tracer import call_model, example_inputs

    _library(name)
    spec, module, runner, compiled, seconds = built(name)
    for sizes in ZOO[name].sizes:
        inputs = example_inputs(spec, sizes, seed=7 + sum(sizes.values()))
        with torch.no_grad():
            want = call_model(spec, module, inputs)
        got = runner(**inputs)
        assert type(got).__name__ in ("Tensor", "Record", "tuple", "dict"), type(got)
        if hasattr(want, "keys"):  # a ModelOutput comes back as a Record with the same fields
            assert list(got.keys()) == list(want.keys()), (list(got.keys()), list(want.keys()))
        w, g = leaves(want), leaves(got)
        assert len(w) == len(g)
        for a, b in zip(g, w):
            assert a.shape == b.shape, f"{name} at {sizes}: shape {list(a.shape)} vs eager {list(b.shape)}"
            err = (a.float() - b.float()).abs().max().item()
            scale = max(1.0, b.float().abs().max().item())
            assert err <= RTOL * scale, f"{name} at {sizes}: max abs error {err:.3g} (output scale {scale:.3g})"


@pytest.mark.parametrize("name", list(ZOO))
def test_declared_ranges_are_not_narrowed(built, name):
    _library(name)
    _, _, runner, _, _ = built(name)
    for g in runner.manifest.guards.symbols:
        assert (g.min, g.max, g.modulus, g.excluded) == (g.declared_min, g.declared_max, 1, ()), (
            f"{name}: {g.name} declared {g.declared_min}..{g.declared_max} narrowed to {runner.guards_text()}"
        )
    for e in runner.manifest.programs:  # every guard of every program names a source line
        for s in e.guards.symbols:
            for src in s.sources:
                assert src.file != "<torch>" and src.line > 0 and "/bin/" not in src.file, src
