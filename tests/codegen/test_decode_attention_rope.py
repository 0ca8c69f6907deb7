"""Decode attention with the rotary embedding folded in (``aot.codegen.decode_attention``,
``Rotary``): the kernel reads the queries and this step's new keys un-rotated from a fused
projection's rows, rotates them with the step's cos/sin rows as the library computes
``x * cos + cat(-x2, x1) * sin`` (partial rotary: the first R elements of each head), appends the
keys to the cache and attends. Run by Triton's interpreter on the CPU against eager torch on the
same inputs: the cache it leaves equals the one eager's ``index_put_`` of the rotated keys leaves,
bit for bit, and the output matches SDPA in float64 over eager's rotated queries and
cache (float32 1e-4, float16 2e-2, absolute plus relative to the largest output). bfloat16 checks
the cache only, against eager's ops with each result rounded as the interpreter (3.9) rounds float32
to bfloat16, toward zero (the GPU rounds to nearest even, as torch does); and Triton's interpreter
computes ``tl.dot`` of bfloat16 operands wrongly (see ``test_decode_attention.py``). The GPU test
(``tests/gpu/test_decode_attention_gpu.py``) checks bfloat16 against eager itself, bit for bit.

The program side: a tiny Llama's decode program (``aot.hf.causal_lm``) launches no RoPE kernel,
its decode attention kernels hold them in their references, and the prefill program keeps them.
"""

from __future__ import annotations

import pytest

from tests.codegen.conftest import assert_decode_kernels_match, interpreted_json

# (name, dtype, batch, heads, kv_heads, head_dim, rotary dim, context, slot appended (None: the
#  queries alone rotated, no append), cos/sin one row shared by every batch row, the keys' cos/sin
#  buffers of their own)
CASES = [
    ("gqa4_d64_fp32", "float32", 1, 8, 2, 64, 64, 40, 33, False, False),
    ("gqa4_d64_bf16_last", "bfloat16", 2, 8, 2, 64, 64, 24, -1, False, False),
    ("mha_d128_fp16_first", "float16", 1, 2, 2, 128, 128, 20, 0, True, False),
    ("gqa2_d128_bf16", "bfloat16", 1, 4, 2, 128, 128, 16, 7, False, True),
    ("odd_d24_fp32", "float32", 2, 4, 2, 24, 24, 20, 19, False, False),  # a head dim that pads its block
    ("partial_d32_r16_fp16", "float16", 2, 4, 4, 32, 16, 24, 5, False, False),  # GPT-NeoX's rotary_pct 0.5
    ("partial_d80_r32_bf16", "bfloat16", 1, 4, 2, 80, 32, 16, -1, False, False),  # Phi's partial rotary
    ("queries_only_fp32", "float32", 2, 4, 2, 32, 32, 20, None, False, False),
    # GPT-NeoX's fused QKV: each head's q, k and v side by side (a head stride of 3 head dims)
    ("interleaved_heads_r8_fp16", "float16", 2, 4, 4, 32, 8, 20, None, False, False),
]

SCRIPT = r"""
import importlib.util, json, math, sys, tempfile
import torch
from aot.codegen.decode_attention import render_decode_attention
from aot.codegen.decode_sites import Append, DecodeSite, NewRows, Rotary

def truncated(t):  # the interpreter's float32 -> bfloat16: toward zero (the GPU's rounds to nearest even)
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

def rotate(x, cos, sin, R):  # eager, in x's dtype: x [B, n, 1, D], cos/sin [B or 1, 1, R]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, rest = x[..., :R], x[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2 :]
    if x.dtype == torch.bfloat16:  # eager's ops, each result rounded as the interpreter rounds
        out = truncated(truncated(xr.float() * c.float()).float() + truncated(torch.cat((-x2, x1), -1).float() * s.float()).float())
    else:
        out = xr * c + torch.cat((-x2, x1), -1) * s
    return torch.cat((out, rest), -1) if R < x.shape[-1] else out

out = {}
for (name, dtype, B, H, KV, D, R, C, slot, shared, own_tables), form in [(c, f) for c in CASES for f in ("tile", "vector")]:
    torch.manual_seed(hash(name) % 1000)
    dt = getattr(torch, dtype)
    width = (H + 2 * KV) * D  # a fused projection's rows: q, then k, then v
    interleaved = name.startswith("interleaved")
    rows = torch.randn(B, width, dtype=dt)
    q = rows[:, : H * D].reshape(B, H, D).unsqueeze(2)
    if interleaved:  # [B, H, 3 * D]: head h's q, k and v
        q = rows.reshape(B, H, 3 * D)[:, :, :D].unsqueeze(2)
    # the angles in float32, cos and sin cast to the model's dtype (Llama's rotary embedding)
    positions = torch.randint(0, 4000, (1 if shared else B, 1)).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
    angles = torch.cat([positions[:, :, None] * inv_freq] * 2, -1)  # [B or 1, 1, R]
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    k = torch.randn(B, KV, C, D, dtype=dt)
    v = torch.randn(B, KV, C, D, dtype=dt)
    keep = torch.ones(B, C, dtype=torch.bool)
    keep[:, C // 2 + 1 :] = False
    keep[-1, : C // 4] = False  # left padding on the last row
    at = (0 if shared else R)
    q_rot = Rotary(NewRows("rows", width, 0), "cos", "sin", at, R, 0, "q_rotated", 3 * D if interleaved else 0)
    new, append, tables = (), None, (cos, sin)
    if slot is not None:
        keep[:, slot] = True
        k_rot = Rotary(NewRows("rows", width, H * D), "kcos" if own_tables else "cos",
                       "ksin" if own_tables else "sin", at, R, 1, "k_rotated")
        append = Append(
            k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=NewRows("k_rotated", KV * D, 0),
            v_new=NewRows("rows", width, (H + KV) * D), k_write=2, v_write=3, k_result="kr", v_result="vr",
            k_rotary=k_rot,
        )
        new = (rows, rows, torch.tensor([slot], dtype=torch.int64))
        if own_tables:
            tables = (cos, sin, cos.clone(), sin.clone())
        kn = rotate(rows[:, H * D : (H + KV) * D].reshape(B, KV, D).unsqueeze(2), cos, sin, R)
        vn = rows[:, (H + KV) * D :].reshape(B, KV, 1, D)
        k_eager, v_eager = k.clone(), v.clone()
        k_eager[:, :, slot], v_eager[:, :, slot] = kn[:, :, 0], vn[:, :, 0]  # index_put_ at one slot
    else:
        k_eager, v_eager = k.clone(), v.clone()
    mask = torch.where(keep, 0.0, torch.finfo(dt).min).to(dt)
    site = DecodeSite(
        step=4, q="q_rotated", q_batch_stride=H * D, q_column=0, k="k", v="v", mask="m",
        mask_batch_stride=C, out="o", batch=str(B), heads=H, kv_heads=KV, context=C, head_dim=D,
        scale=1.0 / math.sqrt(D), dtype=dtype, append=append, q_rotary=q_rot,
    )
    r = render_decode_attention(site, vector=form == "vector")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(r.source)
    spec = importlib.util.spec_from_file_location(r.name, f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    o = torch.full((B, H, 1, D), float("nan"), dtype=dt)
    grid = (B * KV,) if form == "tile" else (B * KV, H // KV)
    getattr(module, r.name)[grid](rows, k, v, *new, *tables, mask, o, B, num_warps=r.num_warps)
    G = H // KV
    q_eager = rotate(q, cos, sin, R)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q_eager.double(), k_eager.double().repeat_interleave(G, 1), v_eager.double().repeat_interleave(G, 1),
        attn_mask=mask.double()[:, None, None, :],
    )
    out[f"{name}-{form}"] = {
        "name": r.name,
        "cache_equal": bool(torch.equal(k, k_eager) and torch.equal(v, v_eager)),
        "cache_err": float((k.double() - k_eager.double()).abs().max()),
        "max_err": float((o.double() - ref).abs().max()), "ref_max": float(ref.abs().max()),
        "nan": bool(o.isnan().any()),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_json(SCRIPT.replace("CASES", repr(CASES)))


@pytest.mark.parametrize("form", ["tile", "vector"])  # decode_attention_render.VECTOR_FORM
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rotary_decode_attention_matches_eager(interpreted, case, form):
    name, dtype, slot = case[0], case[1], case[8]
    got = interpreted[f"{name}-{form}"]
    assert "_rope_" in got["name"] and got["name"].endswith("_vector") == (form == "vector"), got
    assert got["cache_equal"], f"{name}: the cache differs from eager's (rotated keys at slot {slot}): {got}"
    if dtype == "bfloat16" and form == "tile":
        return  # the interpreter's bfloat16 tl.dot is wrong: the output is checked on the GPU
    assert not got["nan"], f"{name}: unwritten or NaN outputs"
    tol = 1e-4 if dtype == "float32" else 2e-2  # bfloat16 (the vector form, no tl.dot): 2e-2 too
    assert got["max_err"] <= tol * (1 + got["ref_max"]), got


ANGLES = """
import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Angles(nn.Module):  # a decode step's rotary angles, as Llama computes them: one position per row
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)))

    def forward(self, x, position_ids):  # x: [B, 1, 32], position_ids: [B, 1]
        FREQS
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, 1, 32]
        return x * emb.cos().to(x.dtype) + x * emb.sin().to(x.dtype)


spec = ModelSpec(
    module=Angles,
    inputs=[Input("x", (1, 1, 32)), Input("position_ids", (1, 1), dtype="int64", low=0, high=4000)],
    dtype="bfloat16",
)
"""


FREQS = {  # [B, 1, 16]
    "mul": "freqs = position_ids[..., None].float() * self.inv_freq.float()",  # transformers >= 4.56
    # before: an outer product as a matmul, a cuBLAS launch of its own
    "matmul": "freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)",
}


@pytest.mark.parametrize("form", sorted(FREQS))
def test_one_position_rotary_angles_compile_and_match(tmp_path, form):
    """A decode step's angles (one position: every lane of ``cat(freqs, freqs)`` reads the same
    position element, under the cat's lane conditions) fuse into one kernel that compiles (a
    scalar load under a lane mask failed to: the ops then stayed library calls) and matches
    its reference in the interpreter (bfloat16 tolerance). The angles as a matmul over an inner
    dim of one (``aot.codegen.outer_products``) join that kernel as a multiply."""
    from aot.codegen import generate
    from aot.packager import pack
    from aot.schema import StepKind
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "angles.py"
    path.write_text(ANGLES.replace("FREQS", FREQS[form]))
    compiled = generate(trace(load_model_file(path)), ("sm_90",))
    assert compiled.stats.fallbacks == 0
    program = compiled.program
    assert [s.kind for s in program.steps] == [StepKind.KERNEL], program.steps  # one launch
    assert not any(
        s.kind == StepKind.ATEN and s.target in ("aten.cos.default", "aten.sin.default")
        for s in program.steps
    )
    bundle = tmp_path / "angles.tpk"
    pack(compiled, bundle)
    (results,) = interpret_in_subprocess([(bundle, path, [{}], None)])
    checks = [c for cs in results.values() for c in cs]
    assert checks and all(c.ok for c in checks), checks


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "phi3", "stablelm", "gpt_neox"])
def test_rotary_models_decode_programs_match_their_references(kind, tmp_path):
    """A tiny Llama, Phi-3 (its rotary part sliced off the head with an empty rest), StableLM
    (partial rotary, a quarter of each head) and GPT-NeoX (partial rotary over heads whose q, k and
    v sit side by side: the kernel reads the new keys and values 3 * D apart): the decode program's
    attention kernels rotate the queries and keys themselves and write the cache, and every kernel
    of it, run by the interpreter at batch 2 (one row left-padded), matches its reference: the
    caches the attention kernels write exactly, the rest within float32's tolerance."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    compiled = generate(trace(causal_lm(factory(kind), max_batch=2, max_context=16, name=kind)), ("sm_90",))
    checks = assert_decode_kernels_match(compiled, tmp_path / f"{kind}.tpk", "decode_attention_append_rope_")
    assert not any(c[0] == "fused_mul_neg_cat_add" for c in checks), checks  # no RoPE kernel left
