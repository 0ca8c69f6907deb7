"""Attention over keys and values read through their views (``aot.codegen.cache_attention``'s
strided form, what a library-free Llama's prefill runs): the kernel against ``torch``'s
``scaled_dot_product_attention`` in Triton's interpreter, with the same operands and mask.

Cases: grouped-query heads (query head h reads KV head h // (H / KV)) under an additive
``[B, 1, T, S]`` mask with more keys than queries (two key blocks), padding, a query row masked
everywhere by the dtype's minimum (SDPA averages its values) and one masked everywhere by -inf
(SDPA gives 0); a query read through a transposing view, under a mask shared by every row (one
of its rows at the minimum); ``repeat_kv``'s copy ``[B, KV, G, S, D]`` read as ``[B, H, S, D]``
under ``is_causal`` at an odd length (two query blocks); the same causal call reading the
grouped KV heads directly (``enable_gqa``) with strides the kernel holds as constants; T5's
attention (``scale=1.0``, the query drawn at 1 / sqrt(D) as T5's weights make it) under a float
mask per query head: ``[B, H, T, S]`` row-major, a position bias with the padding added in (one
head's query row masked everywhere by the dtype's minimum, another head's by -inf), and a
``[T, S, H]`` lookup read as ``[1, H, T, S]`` (keys ``H`` apart, shared by the rows) over grouped
KV heads, one head's query row at the minimum. The reference is SDPA's
math on the CPU in float64 on the same rounded inputs: on an H200 (torch 2.11) CUDA's SDPA departed
from it by 0.22 and 0.87 in the two cases with a row masked everywhere by float32's or bfloat16's
minimum (the math averages such a row's values, as the kernel does). Tolerances: float32 1e-5 (IEEE
dots); float16 4e-3 and bfloat16 2e-2 absolute (the kernel rounds the probabilities to the operands' dtype before their dot with
the values, as flash kernels do). Triton's interpreter (3.9) computes ``tl.dot`` of bfloat16
operands wrongly (``test_decode_attention.py``), so bfloat16 runs in the ``gpu`` test only:

    pytest -m gpu tests/codegen/test_strided_attention.py
"""

from __future__ import annotations

import pytest

from aot.codegen.cache_attention import NO_MASK, CacheSite, KeysValues, render_cache_attention
from aot.schema import Sym

# float16: the probabilities rounded to float16 before their dot with the values (2^-11 of each,
# on values up to ~4: ~2e-3) plus the output's own rounding (2^-11 of up to ~2): 4e-3 (measured
# 3.4e-3 on an H200 in head_bias_view's peaked rows)
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
HEAD_DIM = 16


def _site(case: str, dtype: str) -> CacheSite:
    """The site of each case: q a row-major [B, H, T, D] buffer, keys and values as views."""
    d = HEAD_DIM
    if case == "gqa_mask":  # k, v: [B, 2, keys, D] buffers of their own; 4 query heads
        heads, kv, keys, causal, mask = 4, 2, "keys", False, "mask"
        k_at = ("0", f"{kv * d}*keys", f"{d}*keys", str(d))
    elif case == "repeat_causal":  # k, v: [B, 2, 2, seq, D] copies viewed as [B, 4, seq, D]
        heads, kv, keys, causal, mask = 4, 4, "seq", True, None
        k_at = ("0", f"{heads * d}*seq", f"{d}*seq", str(d))
    elif case == "query_view":  # q: a [B, T, H, D] buffer read as [B, H, T, D]; one mask row block
        heads, kv, keys, causal, mask = 4, 2, "keys", False, "mask"
        k_at = ("0", f"{kv * d}*keys", f"{d}*keys", str(d))
    elif case in ("head_bias", "head_bias_view"):  # T5's: a mask per query head, scale 1
        heads, kv, keys, causal, mask = 4, 4 if case == "head_bias" else 2, "keys", False, "mask"
        k_at = ("0", f"{kv * d}*keys", f"{d}*keys", str(d))
    else:  # "gqa_causal_constant": k, v [B, 2, 70, D] (a fixed length: constant strides)
        heads, kv, keys, causal, mask = 4, 2, "70", True, None
        k_at = ("0", str(kv * 70 * d), str(70 * d), str(d))
    shared = case == "query_view"  # the mask [1, 1, T, S], shared by the rows
    mask_at = ("0", "keys*seq" if mask and not shared else "0", "0", "keys", "1") if mask else NO_MASK
    if case == "head_bias":  # [B, H, T, S] row-major: the bias [1, H, T, S] plus the padding [B, 1, 1, S]
        mask_at = ("0", f"{heads}*keys*seq", "keys*seq", "keys", "1")
    elif case == "head_bias_view":  # a [T, S, H] lookup read as [1, H, T, S] (T5's permute, unsqueeze)
        mask_at = ("0", "0", "1", f"{heads}*keys", str(heads))
    return CacheSite(
        step=0,
        q="q",
        q_batch_t=heads * d,
        q_token=d,
        q_head=0,
        q_head_t=d,
        q_column=0,
        k="k",
        v="v",
        mask=mask,
        mask_at=mask_at,
        mask_dtype=dtype,
        out="out",
        batch="batch",
        seq="seq",
        heads_apart=(),
        heads=heads,
        kv_heads=kv,
        context=0,
        head_dim=d,
        scale=1.0 if case.startswith("head_bias") else 0.3,
        dtype=dtype,
        strided=KeysValues("k", k_at, "v", k_at, keys),
        causal=causal,
        q_strided=(("0", f"{heads * d}*seq", str(d), str(heads * d)) if case == "query_view" else None),
    )


SCRIPT = """
import json, torch
from aot.codegen.compile import load_function
F = torch.nn.functional
dtype = getattr(torch, {dtype!r})
torch.set_default_device({device!r})
fn = load_function("k0", {name!r}, {source!r})
case, b, t, s, heads, d = {case!r}, {batch}, {seq}, {keys}, 4, {head_dim}
sizes = {{"batch": b, "seq": t, "keys": s}}
g = torch.Generator({device!r}).manual_seed(t)
q = torch.randn(b, heads, t, d, generator=g)
if case.startswith("head_bias"):  # T5 folds 1 / sqrt(d) into its query weights and calls with scale 1
    q = q / d**0.5
q = q.to(dtype)
mask = None
if case == "gqa_mask":
    k, v = (torch.randn(b, 2, s, d, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = (x.repeat_interleave(2, dim=1) for x in (k, v))
    low = torch.finfo(dtype).min
    mask = torch.randn(b, 1, t, s, generator=g).to(dtype)
    mask[1, :, :, :3] = low  # padding: the row's first slots
    mask[1, :, 0, :] = low  # a query that sees nothing: SDPA averages every value
    mask[0, :, 1, :] = float("-inf")  # nothing at all: SDPA gives 0
    mask[0, :, 2, 5:] = float("-inf")
    args = [q, k, v, mask]
elif case == "query_view":
    rows = torch.randn(b, t, heads, d, generator=g).to(dtype)
    q = rows.transpose(1, 2)
    k, v = (torch.randn(b, 2, s, d, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = (x.repeat_interleave(2, dim=1) for x in (k, v))
    mask = torch.randn(1, 1, t, s, generator=g).to(dtype)
    mask[..., 1, :] = torch.finfo(dtype).min
    args = [rows, k, v, mask]
elif case == "head_bias":
    k, v = (torch.randn(b, heads, s, d, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = k, v
    low = torch.finfo(dtype).min
    padding = torch.zeros(b, 1, 1, s)
    padding[1, ..., :3] = low
    mask = (torch.randn(1, heads, t, s, generator=g) + padding).to(dtype)  # [B, H, T, S]
    mask[1, 2, 0, :] = low  # one head's query sees nothing: SDPA averages every value
    mask[0, 1, 1, :] = float("-inf")  # nothing at all, in one head: SDPA gives 0
    args = [q, k, v, mask]
elif case == "head_bias_view":
    k, v = (torch.randn(b, 2, s, d, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = (x.repeat_interleave(2, dim=1) for x in (k, v))
    bias = torch.randn(t, s, heads, generator=g).to(dtype)  # [T, S, H]: a lookup per relative position
    bias[2, :, 3] = torch.finfo(dtype).min
    mask = bias.permute(2, 0, 1).unsqueeze(0)  # [1, H, T, S], keys H apart
    args = [q, k, v, bias]
elif case == "repeat_causal":
    k, v = (torch.randn(b, 2, 1, s, d, generator=g).expand(b, 2, 2, s, d).to(dtype).contiguous() for _ in range(2))
    want_k, want_v = (x.view(b, heads, s, d) for x in (k, v))
    args = [q, k, v]
else:
    k, v = (torch.randn(b, 2, s, d, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = (x.repeat_interleave(2, dim=1) for x in (k, v))
    args = [q, k, v]
out = torch.full((b, heads, t, d), float("nan"), dtype=dtype)
args.append(out)
args += [eval(a, {{}}, sizes) for a in {sizes_args!r}]
fn[tuple(eval(x, {{}}, sizes) for x in {grid!r})](*args)
want = F.scaled_dot_product_attention(  # SDPA's definition: its math, on the CPU, in float64
    q.double().cpu(), want_k.double().cpu(), want_v.double().cpu(),
    attn_mask=None if mask is None else mask.double().cpu(), is_causal={causal!r}, scale={scale!r},
)
got = out.double().cpu()
print(json.dumps([float((got - want).abs().max()), bool(got.isnan().any()), bool(want.isnan().any())]))
"""


CASES = [
    ("gqa_mask", 2, 5, 70),
    ("query_view", 3, 6, 11),
    ("repeat_causal", 2, 19, 19),
    ("gqa_causal_constant", 1, 70, 70),
    ("head_bias", 2, 5, 70),
    ("head_bias_view", 2, 37, 9),
]


def _run(case, batch, seq, keys, dtype, device: str):
    """(largest error, NaN in the kernel's output, NaN in SDPA's) from a fresh Python: the
    kernel in Triton's interpreter on ``cpu``, compiled by Triton on ``cuda``."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import HANG_GUARD_S

    site = _site(case, dtype)
    r = render_cache_attention(site)
    sizes_args = [a.text for a in r.args if isinstance(a, Sym)]
    script = SCRIPT.format(
        dtype=dtype,
        name=r.name,
        source=r.source,
        case=case,
        batch=batch,
        seq=seq,
        keys=keys,
        head_dim=HEAD_DIM,
        sizes_args=sizes_args,
        grid=list(r.grid),
        causal=site.causal,
        scale=site.scale,
        device=device,
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case,batch,seq,keys", CASES)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("float16", marks=pytest.mark.slow)])
def test_the_strided_kernel_matches_sdpa_in_the_interpreter(case, batch, seq, keys, dtype):
    error, nan, nan_wanted = _run(case, batch, seq, keys, dtype, "cpu")
    assert not nan and not nan_wanted
    assert error <= TOLERANCE[dtype], (case, dtype, error)


@pytest.mark.gpu
@pytest.mark.parametrize("case,batch,seq,keys", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_strided_kernel_matches_sdpa_on_the_gpu(case, batch, seq, keys, dtype):
    error, nan, nan_wanted = _run(case, batch, seq, keys, dtype, "cuda")
    assert not nan and not nan_wanted
    assert error <= TOLERANCE[dtype], (case, dtype, error)


def test_keys_held_as_constants_or_arguments():
    """Integer strides are constants of the kernel (the compiler sees the rows' alignment);
    symbolic ones are arguments, after the key length."""
    fixed = render_cache_attention(_site("gqa_causal_constant", "float16"))
    assert "\nK_B = tl.constexpr(2240)\n" in fixed.source and "b * K_B + kh * K_H + rn * K_N" in fixed.source
    assert [a.text for a in fixed.args if isinstance(a, Sym)] == ["seq", "70"]
    masked = render_cache_attention(_site("gqa_mask", "float16"))
    assert [a.text for a in masked.args if isinstance(a, Sym)] == [
        "seq",
        "keys",
        "32*keys",
        "16*keys",
        "32*keys",
        "16*keys",
        "keys*seq",
        "keys",
    ]
    assert masked.name == "attention_g2_d16" and fixed.name == "attention_g2_d16_causal"
    # the mask's strides too: a head stride and a key stride the kernel holds as constants
    per_head = render_cache_attention(_site("head_bias_view", "float16"))
    assert [a.text for a in per_head.args if isinstance(a, Sym)][-1] == "4*keys"
    assert (
        "\nMASK_H = tl.constexpr(1)\n" in per_head.source
        and "\nMASK_N = tl.constexpr(4)\n" in per_head.source
    )
    assert "b * MASK_B + h[:, None] * MASK_H + t[:, None] * mask_t + rn[None, :] * MASK_N" in per_head.source


def _bias_program(bias_shape: tuple[str, ...], views: list[tuple[str, tuple]]):
    """SDPA(q, k, v, mask, scale=1.0) over [B, 4, T, 16] inputs, its mask made from the input
    ``bias`` by ``views`` ((target, args) in order), float32."""
    from aot.schema import Buf, NamedTensor, Program, Step, StepKind, TensorSpec

    f32 = lambda *shape: TensorSpec("float32", shape)  # noqa: E731
    qkv = f32("b", "4", "t", "16")
    steps, buffers, at = [], {}, "bias"
    for i, (target, args, shape) in enumerate(views):
        steps.append(Step(StepKind.ATEN, target, (Buf(at), *args), {}, (f"m{i}",)))
        buffers[f"m{i}"], at = f32(*shape), f"m{i}"
    sdpa = "aten.scaled_dot_product_attention.default"
    steps.append(Step(StepKind.ATEN, sdpa, (Buf("q"), Buf("k"), Buf("v"), Buf(at)), {"scale": 1.0}, ("out",)))
    buffers["out"] = qkv
    inputs = tuple(NamedTensor(n, qkv) for n in "qkv") + (NamedTensor("bias", f32(*bias_shape)),)
    return Program(
        inputs=inputs, weights=(), steps=tuple(steps), outputs=("out",), symbols=(), buffers=buffers
    )


def test_a_mask_per_head_is_read_through_its_views():
    """T5's position bias: a ``[T, S, H]`` lookup permuted and unsqueezed to ``[1, H, T, S]``,
    expanded over the rows: a site reading the lookup in place (batch stride 0, heads 1 apart,
    keys H apart), scale 1; a ``[B, H, T, S]`` buffer: its row-major strides; a mask whose head
    dim is neither 1 nor H: no site."""
    from aot.codegen.cache_attention import find_cache_sites

    lookup = [
        ("aten.permute.default", ([2, 0, 1],), ("4", "t", "t")),
        ("aten.unsqueeze.default", (0,), ("1", "4", "t", "t")),
        ("aten.expand.default", ([Sym("b"), 4, Sym("t"), Sym("t")],), ("b", "4", "t", "t")),
    ]
    (site,) = find_cache_sites(_bias_program(("t", "t", "4"), lookup))
    assert (site.mask, site.mask_at, site.scale, site.heads) == ("bias", ("0", "0", "1", "4*t", "4"), 1.0, 4)
    (site,) = find_cache_sites(_bias_program(("b", "4", "t", "t"), []))
    assert (site.mask, site.mask_at) == ("bias", ("0", "4*(t*t)", "t*t", "t", "1"))
    assert find_cache_sites(_bias_program(("b", "2", "t", "t"), [])) == []


@pytest.fixture(scope="module")
def zoo_llama(tmp_path_factory):
    """The zoo's plain ``LlamaForCausalLM`` (no cache: causal attention over the prompt, RoPE,
    4 query heads over 2 KV heads through ``repeat_kv``) built ``--library-free``: SDPA reads the
    KV heads with ``enable_gqa`` (``attention.fold_gqa_repeats``), no copy made."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import instantiate, trace
    from tests.realmodels.zoo import ZOO

    spec = ZOO["llama"]()
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    out = tmp_path_factory.mktemp("zoo_llama") / "llama.tpk"
    pack(compiled, out)
    return spec, instantiate(spec), compiled, out


@pytest.mark.slow  # a library-free build: GEMM candidates compiled
def test_the_zoo_llama_attention_is_the_strided_kernel(zoo_llama):
    from aot.program import live_steps
    from aot.runtime import check
    from aot.schema import StepKind

    _, _, compiled, bundle = zoo_llama
    program = compiled.program
    names = {k.id: k.name for k in program.kernels}
    attention = [
        s for s in live_steps(program) if s.kind == StepKind.KERNEL and "attention" in names[s.target]
    ]
    # no step copies the keys and values for repeat_kv: the kernel reads each KV head for 2 query heads
    assert not [r for s in live_steps(program) for r in (s, *s.reference) if r.target == "aten.clone.default"]
    assert [names[s.target] for s in attention] == ["attention_g2_d16_causal"] * 2
    assert all(s.reference[0].target == "aten.scaled_dot_product_attention.default" for s in attention)
    assert [e.name for e in check(bundle).entries] == ["general"]


@pytest.mark.slow
def test_the_zoo_llama_cpu_path_matches_eager(zoo_llama):
    from aot.loader import load
    from aot.tracer import example_inputs
    from tests.realmodels.test_realmodels import difference, eager

    spec, module, _, bundle = zoo_llama
    runner = load(bundle)
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}):
        inputs = example_inputs(spec, sizes, seed=7)
        assert difference(runner(**inputs), eager(spec, module, inputs)) is None, sizes


@pytest.mark.slow
def test_the_zoo_llama_kernels_match_their_references_in_the_interpreter(zoo_llama, tmp_path):
    """Every kernel of the bundle (its attention among them) against its reference steps, in
    Triton's interpreter, at seq 1 and at an odd length (float32: the verifier's tolerance)."""
    from aot.verify.interpret import interpret_in_subprocess
    from tests.conftest import ROOT

    _, _, _, bundle = zoo_llama
    model = tmp_path / "zoo_llama.py"
    model.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.realmodels.zoo import ZOO\nspec = ZOO['llama']()\n"
    )
    (results,) = interpret_in_subprocess(
        [(bundle, model, [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 13}], 1)]
    )
    for size, checks in results.items():
        names = [c.name for c in checks]
        assert "attention_g2_d16_causal" in names, names
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


SDPA_MODEL = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class Attention(nn.Module):
    def forward(self, q, k, v, mask):  # q [B, 4, T, D], k and v [B, 2, T, D], mask [B, 1, T, T]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True) * 2.0

batch, seq = Dim("batch", 1, 3), Dim("seq", 1, 24)
spec = ModelSpec(
    module=Attention,
    inputs=[
        Input("q", (batch, 4, seq, HEAD_DIM)),
        Input("k", (batch, 2, seq, HEAD_DIM)),
        Input("v", (batch, 2, seq, HEAD_DIM)),
        Input("mask", (batch, 1, seq, seq)),
    ],
)
"""


def _sdpa_model(tmp_path, head_dim: int):
    path = tmp_path / "sdpa.py"
    path.write_text(SDPA_MODEL.replace("HEAD_DIM", str(head_dim)))
    return path


@pytest.mark.slow  # a build and an interpreter run
def test_grouped_query_attention_under_a_mask_input_builds_library_free(tmp_path):
    """``enable_gqa`` over inputs, under an additive mask the caller passes: one kernel step (the
    mask read where it lies), kernels equal to their references in the interpreter, the CPU path
    equal to eager."""
    import torch

    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.schema import StepKind
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = _sdpa_model(tmp_path, 16)
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    names = {k.id: k.name for k in compiled.program.kernels}
    attention = [
        s for s in compiled.program.steps if s.kind == StepKind.KERNEL and "attention" in names[s.target]
    ]
    assert [names[s.target] for s in attention] == ["attention_g2_d16"]
    assert attention[0].args[3].name == "mask"
    pack(compiled, tmp_path / "sdpa.tpk")
    (results,) = interpret_in_subprocess([(tmp_path / "sdpa.tpk", path, [{"batch": 2, "seq": 7}], None)])
    checks = results['{"batch": 2, "seq": 7}']
    assert "attention_g2_d16" in [c.name for c in checks] and all(c.ok for c in checks), checks
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 16, generator=g), *torch.randn(2, 2, 2, 9, 16, generator=g)
    mask = torch.randn(2, 1, 9, 9, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True
    )
    torch.testing.assert_close(load(tmp_path / "sdpa.tpk")(q, k, v, mask), want * 2.0, rtol=1e-5, atol=1e-5)


def test_attention_no_form_covers_is_refused_with_its_step_and_model_line(tmp_path):
    """A head dim past the kernels' (``MAX_HEAD_DIM``, the query rows held in registers): the
    library-free build names the SDPA step and the model line that called it."""
    import re

    from aot.codegen import generate
    from aot.errors import CodegenError
    from aot.tracer import load_model_file, trace

    path = _sdpa_model(tmp_path, 320)
    line = next(
        i for i, text in enumerate(SDPA_MODEL.splitlines(), 1) if "scaled_dot_product_attention(" in text
    )
    with pytest.raises(CodegenError) as e:
        generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    pattern = rf"step \d+ \(aten\.scaled_dot_product_attention\.default -> \w+, made at \S*sdpa\.py:{line}\) is a library call"
    assert re.search(pattern, str(e.value)), str(e.value)
