"""Compiling kernels without a GPU: metadata, the content-addressed cache, and fallbacks."""

from __future__ import annotations

import torch

from aot.codegen import compile as cc
from aot.codegen import generate
from aot.loader import load
from aot.packager import pack
from aot.tracer import example_inputs, instantiate, load_model_file


def _job(compiled, arch: str) -> cc.Job:
    k = compiled.program.kernels[0]
    return cc.Job(k.id, k.name, k.source, dict(k.config["signature"]), k.num_warps, k.num_stages, arch)


def test_compile_for_two_archs_and_cache(pattern, tmp_path, monkeypatch):
    _, compiled, _, _, _ = pattern("unknown")
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path / "cache"))
    kernel = compiled.program.kernels[0]
    results = {}
    for arch in ("sm_80", "sm_90"):
        res = cc.compile_job(_job(compiled, arch))
        assert not res.cached
        assert res.cubin[:4] == b"\x7fELF"
        assert res.meta["name"] == kernel.name
        assert res.meta["global_scratch_size"] == 0 and res.meta["profile_scratch_size"] == 0
        assert res.meta["ptx_params"] == len(kernel.params) + 2  # Triton appends two scratch pointers
        results[arch] = res
    assert results["sm_80"].cubin != results["sm_90"].cubin
    entries = sorted(p.name for p in (tmp_path / "cache").glob("??/*"))  # <key[:2]>/<key>.{cubin,json}
    assert len(entries) == 4 and not [e for e in entries if e.endswith(".tmp")]
    again = cc.compile_job(_job(compiled, "sm_90"))
    assert again.cached and again.cubin == results["sm_90"].cubin
    # a damaged entry is recompiled, never trusted
    key = cc.cache_key(_job(compiled, "sm_90"))
    (tmp_path / "cache" / key[:2] / f"{key}.cubin").write_bytes(b"garbage")
    fixed = cc.compile_job(_job(compiled, "sm_90"))
    assert not fixed.cached and fixed.cubin == results["sm_90"].cubin


def test_cache_key_covers_source_arch_and_options(pattern):
    _, compiled, _, _, _ = pattern("unknown")
    job = _job(compiled, "sm_90")
    keys = {
        cc.cache_key(job),
        cc.cache_key(cc.Job(**{**job.__dict__, "arch": "sm_80"})),
        cc.cache_key(cc.Job(**{**job.__dict__, "num_warps": job.num_warps * 2})),
        cc.cache_key(cc.Job(**{**job.__dict__, "source": job.source + "\n"})),
    }
    assert len(keys) == 4


def test_kernel_that_fails_to_compile_falls_back_to_aten(pattern, monkeypatch, tmp_path):
    """The failed kernel's steps run as ATen calls, the build says so, and the bundle still computes
    the model: its outputs are compared with eager PyTorch, not with another run of the same steps."""
    traced, good, _, model, _ = pattern("unknown")
    bad = good.program.kernels[0]
    real = cc.compile_job

    def flaky(job):
        if job.kernel_id == bad.id:
            raise RuntimeError("ptxas exploded")
        return real(job)

    monkeypatch.setattr(cc, "compile_job", flaky)
    messages: list[str] = []
    compiled = generate(traced, ("sm_90",), progress=messages.append)
    # reported: in the progress, the build counters and the bundle's manifest
    assert compiled.stats.fallbacks == 1
    warning = [m for m in messages if "failed to compile" in m]
    assert len(warning) == 1 and f"kernel {bad.name} ({bad.id})" in warning[0], messages
    assert "ptxas exploded" in warning[0] and "stay library calls" in warning[0]
    assert any("1 fallbacks" in m for m in messages if "codegen done" in m), messages
    assert bad.id not in {k.id for k in compiled.program.kernels}
    assert len(compiled.program.kernels) == len(good.program.kernels) - 1
    assert not [k for k, _ in compiled.cubins if k == bad.id]
    # its launches became its reference steps, as library calls, and nothing else changed kind
    replaced = [
        r for s in good.program.steps if s.kind == "kernel" and s.target == bad.id for r in s.reference
    ]
    aten = [s for s in compiled.program.steps if s.kind == "aten"]
    assert replaced and all(r in aten for r in replaced)
    assert len(aten) == len(replaced) + sum(s.kind == "aten" for s in good.program.steps)
    path = tmp_path / "fallback.tpk"
    pack(compiled, path)
    runner = load(path)
    try:
        assert runner.manifest.stats.fallbacks == 1
        spec = load_model_file(model)
        module = instantiate(spec)
        for batch in (1, 5, 8):  # 1..8 declared
            inputs = example_inputs(spec, {"batch": batch}, seed=batch)
            with torch.no_grad():
                want = module(**inputs)
            got = runner(**inputs)
            assert got.shape == want.shape
            # float32, the same ATen ops as eager: only summation order may differ
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        runner.bundle.close()


def test_progress_reports_compiles(pattern):
    _, _, _, _, messages = pattern("norms")
    assert any(m.strip().startswith("compiling ") and "archs:" in m for m in messages)
    assert any("codegen done" in m for m in messages)
