"""The one-row GEMV forms with an RMSNorm prologue and the stacked gate/up SiLU·mul epilogue on a
GPU, at Llama-3.2-1B's shapes (bench/decode.py's ``llama-3.2-1b``: hidden 2048, intermediate 8192,
32 query heads over 8 KV heads, head dim 64, vocab 128256, bfloat16; 2 of its 16 layers, so that
the CPU side of ``verify`` stays short), built by default for this GPU's arch (the built-in
table applies on sm_90 only):

- the decode plan at batch 1 runs 5 kernels per decoder layer (q/k/v with RMSNorm, decode
  attention with RoPE and the cache write, o, gate/up with RMSNorm and SiLU·mul, down);
- ``aot.verify.device.verify``: every kernel of each bucket's plan against its reference steps
  on the GPU (bfloat16 tolerance), the whole program against the CPU path, the CUDA graph's
  replay against the launches.

    pytest -m gpu tests/gpu/test_gemm_norm_gpu.py

Never run in CI (no GPU there).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

LAYERS = 2
KERNELS_PER_LAYER = 5


def build_llama_1b(tmp_path_factory, batch_buckets: tuple[int, ...], env: dict[str, str] | None = None):
    """(bundle path, compiled, arch): ``LAYERS`` layers of Llama-3.2-1B's shapes, bfloat16, built
    by default for this GPU's arch at ``batch_buckets`` (with ``env`` set for the build); skips
    where there is no GPU, no transformers, or the GPU is not the built-in table's arch."""
    return build_shaped("llama-3.2-1b", tmp_path_factory, batch_buckets, env)


def build_shaped(
    model: str, tmp_path_factory, batch_buckets: tuple[int, ...], env: dict[str, str | None] | None = None
):
    """``build_llama_1b`` for any of ``bench/decode.py``'s models (its shapes, ``LAYERS`` layers)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.codegen.gemm_defaults import DEFAULT_ARCH
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from bench.decode import ATTENTION, LAYERS_ENV, config, instantiate

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    if arch != DEFAULT_ARCH:
        pytest.skip(f"the built-in GEMM table is for {DEFAULT_ARCH}, this GPU is {arch}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAYERS_ENV, str(LAYERS))
        cls, cfg = config(model, False)
    cfg.pad_token_id = 0
    cfg.eos_token_id = None
    spec = causal_lm(
        lambda: instantiate(cls, cfg),
        max_batch=max(batch_buckets),
        max_context=64,
        dtype="bfloat16",
        name=model,
        batch_buckets=batch_buckets,
        attn_implementation=ATTENTION.get(model),
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (env or {}).items():
            if value is None:  # unset: the default
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        compiled = generate(trace(spec), (arch,))
    path = tmp_path_factory.mktemp(model.replace(".", "_")) / f"{model}.tpk"
    pack(compiled, path, split_weights=True)
    return path, compiled, arch


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    return build_llama_1b(tmp_path_factory, (1, 2))


LIBRARY_GEMMS = ("aten.mm.default", "aten.addmm.default")


def decode_plans(compiled, arch: str, library: bool = False):
    """(the decode program, {bucket key: its plan's kernel names in order}) of a causal LM's
    bundle (the program whose input is one position), each plan checked to call no library GEMM
    (``library``: where a bucket keeps the library's, not checked)."""
    from aot.schema import StepKind
    from aot.tuning import tuned_plans

    programs = [compiled.program, *compiled.program.variants]
    (index,) = [i for i, p in enumerate(programs) if p.inputs[0].spec.shape[1:] == ("1",)]
    program = programs[index]
    kernels = {k.id: k for k in program.kernels}
    out = {}
    for key, plan in tuned_plans(compiled.tuning, index, program, arch).items():
        assert library or not any(s.target in LIBRARY_GEMMS for s in plan), key
        out[key] = [kernels[s.target].name for s in plan if s.kind == StepKind.KERNEL]
    return program, out


def test_decode_plan_runs_five_kernels_per_layer(llama_1b):
    """At batch 1 a decoder layer is 5 kernels: q/k/v with the RMSNorm in its prologue (the first
    layer's reading the embedding's rows itself, so no gather kernel), the decode attention with
    RoPE and the cache write, o, gate/up with the RMSNorm and SiLU·mul, down; the library
    program's 8 a layer (the norms and SiLU·mul kernels apart) and the gather: 3 a layer and 1
    more."""
    from aot.schema import StepKind

    _, compiled, arch = llama_1b
    program, plans = decode_plans(compiled, arch)
    names = plans[(1,)]
    first = next(i for i, n in enumerate(names) if n.startswith("gemm_"))
    layers = names[first : first + KERNELS_PER_LAYER * LAYERS]
    expected = (
        "gemm_norm_mm_vec",
        "decode_attention_append_rope",
        "gemm_mm_vec",
        "gemm_norm_halves_epilogue_vec",
        "gemm_mm_vec",
    )
    for i in range(0, len(layers), KERNELS_PER_LAYER):
        assert all(
            n.startswith(p) for n, p in zip(layers[i : i + KERNELS_PER_LAYER], expected, strict=True)
        ), names
    assert "gather_rows" not in names and names[-1].startswith("gemm_mm_vec")  # the head after the last norm
    library = sum(s.kind == StepKind.KERNEL or s.target in LIBRARY_GEMMS for s in program.steps)
    assert library - len(names) == 3 * LAYERS + 1, names


def verified_kernels(path) -> set[str]:
    """``aot.verify.device.verify`` of the bundle at ``path``, every report within bfloat16's
    tolerance (and the reference's own noise): the names of the kernels it checked."""
    from aot.loader.bundle import open_bundle
    from aot.verify.device import passed, reference_noise, verify

    reports = verify(str(path))
    bundle = open_bundle(path)
    try:
        noise = reference_noise(bundle.manifest)
    finally:
        bundle.close()
    assert reports
    failed = [r for r in reports if not passed(r, "bfloat16", noise)]
    assert not failed, failed[:2]
    return {name for r in reports for name in r.kernel_errs}


def test_verify_passes_with_the_fused_forms(llama_1b):
    path, _, _ = llama_1b
    fused = {name for name in verified_kernels(path) if name.startswith("gemm_norm_")}
    assert fused, "no fused GEMV form was checked"


@pytest.mark.parametrize(
    "model, fused, env",
    [
        # post-norm, add and pre-norm: two means (measured slower, so only where asked)
        ("gemma-2-2b", "gemm_norm_halves_epilogue_vec", {"AOTPACK_ROW_NORM_MEANS": "2"}),
        ("qwen3-0.6b", "decode_attention_append_normed_rope", {}),  # each q and k head normed in the kernel
        # the norm (after a dropout's clone) in gate/up's prologue, the split halves' SiLU product
        # in its epilogue
        ("phi-3-mini", "gemm_norm_halves_epilogue_vec", {}),
        # the post-attention norm and add in gate/up's prologue, which also stores the sum
        ("olmo-2-1b", "gemm_norm_halves_epilogue_vec", {}),
    ],
)
def test_verify_passes_on_more_shapes(model, fused, env, tmp_path_factory):
    """Two layers of Gemma-2-2B's shapes (bfloat16, eager attention: its capped scores; with
    ``AOTPACK_ROW_NORM_MEANS=2`` its post-norm, the residual add and the next pre-norm inside the
    one-row GEMVs' prologues, head dim 256) and of Qwen3-0.6B's (each query and key head RMSNormed
    in the decode attention kernel, head dim 128), of Phi-3-mini's (32 heads over 32 KV heads of
    96; its norms in the q/k/v and gate/up GEMVs' prologues, the SiLU product of its split gate/up
    in the epilogue) and of OLMo-2-1B's (16 heads of 128; its post-norms with their adds in the
    next GEMV's prologue, which stores the sum for the residual), built for this GPU: ``verify``
    passes, the fused forms among the kernels it checked (H200, 2026-11-30: gemma-2-2b and
    qwen3-0.6b passed; phi-3-mini and olmo-2-1b not yet run on a GPU)."""
    path, _, _ = build_shaped(model, tmp_path_factory, (1, 2), env)
    assert any(name.startswith(fused) for name in verified_kernels(path)), fused


@pytest.mark.parametrize(
    "model, fused",
    [
        ("gpt2", ("gemm_ln_addmm_vec_1x4x1024_factored", "gemm_ln_addmm_epilogue_vec_1x4x1024_factored")),
        (
            "llama-3.2-1b",
            ("gemm_norm_mm_vec_1x2x1024_factored", "gemm_norm_halves_epilogue_vec_1x2x1024_factored"),
        ),
    ],
)
def test_factored_one_row_forms_verify(model, fused, tmp_path_factory):
    """With ``AOTPACK_ONE_ROW_FACTORED=on`` the one-row forms apply the norm after their products
    (``gemm_prologue.FACTORED``): GPT-2's LayerNorms through the build's column sums (fp16),
    Llama-3.2-1B's RMSNorms through their factored statistic (bf16); two layers of each, built for
    this GPU: the decode plan at one row runs them and ``verify`` passes, having checked them."""
    from aot.codegen.gemm_prologue import FACTORED_ENV

    path, compiled, arch = build_shaped(model, tmp_path_factory, (1, 2), {FACTORED_ENV: "on"})
    _, plans = decode_plans(compiled, arch)
    assert set(fused) <= set(plans[(1,)]), plans[(1,)]
    assert set(fused) <= verified_kernels(path)
