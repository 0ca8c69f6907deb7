"""Compiling kernels without a GPU: metadata, the content-addressed cache, and fallbacks."""

from __future__ import annotations

import torch

from aot.codegen import compile as cc
from aot.codegen import generate
from aot.loader.program import AtenProgram


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


def test_kernel_that_fails_to_compile_falls_back_to_aten(pattern, monkeypatch):
    traced, good, _, _, _ = pattern("unknown")
    bad_id = good.program.kernels[0].id
    real = cc.compile_job

    def flaky(job):
        if job.kernel_id == bad_id:
            raise RuntimeError("ptxas exploded")
        return real(job)

    monkeypatch.setattr(cc, "compile_job", flaky)
    messages: list[str] = []
    compiled = generate(traced, ("sm_90",), progress=messages.append)
    assert compiled.stats.fallbacks == 1
    assert any("failed to compile" in m and "ptxas exploded" in m for m in messages)
    assert bad_id not in {k.id for k in compiled.program.kernels}
    assert len(compiled.program.kernels) == len(good.program.kernels) - 1
    # the fallen-back steps run as ATen calls, with the same results
    x = traced.reference_inputs["x"]
    sizes = {"batch": x.shape[0]}
    ref = AtenProgram(good.program, dict(traced.weights), torch.device("cpu"))({"x": x}, sizes)
    got = AtenProgram(compiled.program, dict(traced.weights), torch.device("cpu"))({"x": x}, sizes)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_progress_reports_compiles(pattern):
    _, _, _, _, messages = pattern("norms")
    assert any(m.strip().startswith("compiling ") and "archs:" in m for m in messages)
    assert any("codegen done" in m for m in messages)
