"""Decode attention (``aot.codegen.decode_attention``) on the GPU at the decode bench's shapes,
against SDPA in float32 on the same inputs (the library's own result, cast up, is the spread we
allow: the kernel must be no further from float32 than twice that, plus 1e-3 of the output's
scale). Greedy tokens against the CPU's (the SDPA reference) are ``test_generate_gpu.py``'s.

    pytest -m gpu tests/gpu/test_decode_attention_gpu.py
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

# (dtype, batch, heads, kv_heads, head_dim, context, q from a projection's rows)
SHAPES = [
    ("bfloat16", 1, 32, 8, 64, 160, False),  # llama-3.2-1b at the anchors' context
    ("float16", 1, 32, 8, 64, 512, False),  # the 0.58B Llama
    ("float16", 8, 12, 12, 64, 512, True),  # GPT-2 small, q read from the fused QKV rows
    ("bfloat16", 32, 32, 8, 64, 512, False),
    # wide heads in the one-kernel form (its block halved until two stages fit shared memory):
    # Llama-3-8B's heads at 384 slots, Gemma 2's head dim of 256 at the anchors' context
    ("bfloat16", 1, 32, 8, 128, 384, False),
    ("bfloat16", 1, 8, 4, 256, 160, False),
]


# the one-kernel form's two kinds (``decode_attention_render.VECTOR_FORM``)
FORMS = ("tile", "vector")


def _grid(form: str, B: int, H: int, KV: int) -> tuple[int, ...]:
    """The one-kernel form's grid: a program per row and KV head, or per row and query head."""
    return (B * KV,) if form == "tile" else (B * KV, H // KV)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}-b{s[1]}-h{s[2]}-kv{s[3]}-c{s[5]}" for s in SHAPES])
def test_decode_attention_matches_sdpa_on_gpu(shape, append, form, tmp_path):
    """``append``: the kernel also writes this step's key and value (from the projection's rows,
    as GPT-2's fused QKV and a Llama's stacked q/k/v hold them) into a slot of the cache first,
    exactly as ``index_put_`` does, and attends over the cache with them."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen.decode_attention import render_decode_attention
    from aot.codegen.decode_sites import Append, DecodeSite, NewRows

    dtype, B, H, KV, D, C, projection = shape
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    width = (H + 2 * KV) * D if projection or append else H * D  # q, then k, then v
    column = 0
    rows = torch.randn(B, width, dtype=dt, device="cuda")
    q = rows[:, column : column + H * D].reshape(B, H, 1, D)
    k = torch.randn(B, KV, C, D, dtype=dt, device="cuda")
    v = torch.randn(B, KV, C, D, dtype=dt, device="cuda")
    keep = torch.ones(B, C, dtype=torch.bool, device="cuda")
    keep[:, C - C // 4 :] = False
    keep[0, : C // 3] = False  # left padding on the first row
    slot = C - C // 4 - 1  # the last valid slot: this step's
    extra, expect_k, expect_v = (), None, None
    a = None
    if append:
        a = Append(
            k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=NewRows("rows", width, H * D),
            v_new=NewRows("rows", width, (H + KV) * D), k_write=0, v_write=1, k_result="kr", v_result="vr",
        )  # fmt: skip
        expect_k, expect_v = k.clone(), v.clone()
        expect_k[:, :, slot] = rows[:, H * D : (H + KV) * D].reshape(B, KV, D)
        expect_v[:, :, slot] = rows[:, (H + KV) * D :].reshape(B, KV, D)
        extra = (rows, rows, torch.tensor([slot], device="cuda"))
    mask = torch.where(keep, 0.0, torch.finfo(dt).min).to(dt)
    site = DecodeSite(
        step=0, q="q", q_batch_stride=width, q_column=column, k="k", v="v", mask="m",
        mask_batch_stride=C, out="o", batch=str(B), heads=H, kv_heads=KV, context=C,
        head_dim=D, scale=1.0 / math.sqrt(D), dtype=dtype, append=a,
    )  # fmt: skip
    r = render_decode_attention(site, vector=form == "vector")
    path = tmp_path / f"{r.name}.py"
    path.write_text(r.source)
    spec = importlib.util.spec_from_file_location(r.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = torch.full((B, H, 1, D), float("nan"), dtype=dt, device="cuda")
    getattr(module, r.name)[_grid(form, B, H, KV)](
        rows, k, v, *extra, mask, out, B, num_warps=r.num_warps, num_stages=2
    )
    torch.cuda.synchronize()
    if append:
        assert torch.equal(k, expect_k) and torch.equal(v, expect_v)  # that slot, and nothing else
    G = H // KV
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    m4 = mask[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kk.float(), vv.float(), attn_mask=m4.float()
    )
    library = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=m4).float()
    assert not out.isnan().any()
    spread = (library - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * spread + 1e-3 * ref.abs().max().item(), (err, spread)


# (dtype, batch, heads, kv_heads, head_dim, rotary dim, context)
ROTARY_SHAPES = [
    ("bfloat16", 1, 32, 8, 64, 64, 160),  # llama-3.2-1b at the anchors' context
    ("bfloat16", 8, 32, 8, 64, 64, 512),
    ("float16", 2, 16, 16, 128, 32, 256),  # GPT-NeoX-style partial rotary
]


def _llama3_inv_freq(dim: int) -> torch.Tensor:
    """Llama 3's scaled inverse frequencies (factor 32, low/high frequency factors 1 and 4, 8192
    original positions), as transformers computes them."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / inv
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    scaled = torch.where(wavelen > low, inv / 32.0, inv)
    middle = (wavelen <= low) & (wavelen >= high)
    return torch.where(middle, (1 - smooth) * scaled / 32.0 + smooth * scaled, scaled)


@pytest.mark.parametrize(
    "shape", ROTARY_SHAPES, ids=[f"{s[0]}-b{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-r{s[5]}" for s in ROTARY_SHAPES]
)
@pytest.mark.parametrize("form", FORMS)
def test_rotary_decode_attention_matches_eager_on_gpu(shape, form, tmp_path):
    """The kernel that rotates the queries and new keys itself (``Rotary``): the cache it leaves
    equals eager's (``q * cos + rotate_half(q) * sin`` in the model's dtype, then ``index_put_``)
    bit for bit, and its output is as close to SDPA in float32 over eager's rotated queries as
    the library's own SDPA is (the bound of the test above)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen.decode_attention import render_decode_attention
    from aot.codegen.decode_sites import Append, DecodeSite, NewRows, Rotary

    dtype, B, H, KV, D, R, C = shape
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    width = (H + 2 * KV) * D  # a fused projection's rows: q, then k, then v
    rows = torch.randn(B, width, dtype=dt, device="cuda")
    positions = torch.randint(0, 100000, (B, 1), device="cuda")
    freqs = positions[..., None].float() * _llama3_inv_freq(R).cuda()  # [B, 1, R/2], float32
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)  # [B, 1, R]

    def rotate(x):  # [B, n, 1, D], as transformers' apply_rotary_pos_emb (partial: the first R)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        xr, rest = x[..., :R], x[..., R:]
        turned = torch.cat((-xr[..., R // 2 :], xr[..., : R // 2]), dim=-1)
        return torch.cat((xr * c + turned * s, rest), dim=-1)

    k = torch.randn(B, KV, C, D, dtype=dt, device="cuda")
    v = torch.randn(B, KV, C, D, dtype=dt, device="cuda")
    keep = torch.ones(B, C, dtype=torch.bool, device="cuda")
    keep[:, C - C // 4 :] = False
    keep[0, : C // 3] = False
    slot = C - C // 4 - 1
    expect_k, expect_v = k.clone(), v.clone()
    expect_k[:, :, slot] = rotate(rows[:, H * D : (H + KV) * D].reshape(B, KV, 1, D))[:, :, 0]
    expect_v[:, :, slot] = rows[:, (H + KV) * D :].reshape(B, KV, D)
    a = Append(
        k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=NewRows("k_rotated", KV * D, 0),
        v_new=NewRows("rows", width, (H + KV) * D), k_write=2, v_write=3, k_result="kr", v_result="vr",
        k_rotary=Rotary(NewRows("rows", width, H * D), "cos", "sin", R, R, 1, "k_rotated"),
    )  # fmt: skip
    mask = torch.where(keep, 0.0, torch.finfo(dt).min).to(dt)
    site = DecodeSite(
        step=4, q="q_rotated", q_batch_stride=H * D, q_column=0, k="k", v="v", mask="m",
        mask_batch_stride=C, out="o", batch=str(B), heads=H, kv_heads=KV, context=C, head_dim=D,
        scale=1.0 / math.sqrt(D), dtype=dtype, append=a,
        q_rotary=Rotary(NewRows("rows", width, 0), "cos", "sin", R, R, 0, "q_rotated"),
    )  # fmt: skip
    r = render_decode_attention(site, vector=form == "vector")
    path = tmp_path / f"{r.name}.py"
    path.write_text(r.source)
    spec = importlib.util.spec_from_file_location(r.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = torch.full((B, H, 1, D), float("nan"), dtype=dt, device="cuda")
    pos = torch.tensor([slot], device="cuda")
    getattr(module, r.name)[_grid(form, B, H, KV)](
        rows, k, v, rows, rows, pos, cos, sin, mask, out, B, num_warps=r.num_warps, num_stages=2
    )
    torch.cuda.synchronize()
    # v and every other slot: eager's bits. The rotated keys at the slot: within the dtype's
    # tolerance (on an H200 some differed from eager's bits; every product and the sum are rounded
    # as eager rounds them in the kernel's source, but the GPU's code need not keep each rounding)
    assert torch.equal(v, expect_v)
    others = torch.ones(C, dtype=torch.bool, device="cuda")
    others[slot] = False
    assert torch.equal(k[:, :, others], expect_k[:, :, others])
    torch.testing.assert_close(k[:, :, slot].float(), expect_k[:, :, slot].float(), rtol=1e-2, atol=1e-2)
    q = rotate(rows[:, : H * D].reshape(B, H, 1, D))
    G = H // KV
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    m4 = mask[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kk.float(), vv.float(), attn_mask=m4.float()
    )
    library = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=m4).float()
    assert not out.isnan().any()
    spread = (library - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * spread + 1e-3 * ref.abs().max().item(), (err, spread)


# (dtype, batch, heads, kv_heads, head_dim, context)
SPLIT_SHAPES = [
    ("bfloat16", 1, 32, 8, 64, 512),  # the 0.58B Llama's decode cache
    ("float16", 1, 12, 12, 64, 512),  # GPT-2 small's
    ("bfloat16", 8, 32, 8, 64, 512),
    ("float16", 8, 12, 12, 64, 512),
    ("bfloat16", 1, 32, 8, 64, 4096),  # past the one-kernel form: the built-in split count
    ("float16", 1, 12, 12, 64, 4096),
    ("bfloat16", 8, 32, 8, 64, 4096),
    ("float16", 8, 32, 8, 128, 4096),
]


def _load_kernel(r, tmp_path):
    path = tmp_path / f"{r.name}.py"
    path.write_text(r.source)
    spec = importlib.util.spec_from_file_location(r.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, r.name)


@pytest.mark.parametrize("splits", [0, 3, 16], ids=["built-in", "3-splits", "16-splits"])
@pytest.mark.parametrize(
    "shape", SPLIT_SHAPES, ids=[f"{s[0]}-b{s[1]}-h{s[2]}-kv{s[3]}-d{s[4]}-c{s[5]}" for s in SPLIT_SHAPES]
)
def test_split_decode_attention_matches_sdpa_on_gpu(shape, splits, tmp_path, monkeypatch):
    """The split-KV form (``render_split_decode_attention``: partials over ranges of the cache,
    then the combine kernel): it appends this step's key and value exactly as ``index_put_`` does
    (one program stores the slot), its output is as close to SDPA in float32 as the library's own
    SDPA (the bound of the tests above), one row's first splits masked whole by left padding, and
    two runs give the same bits (the combine reads the partials in a fixed order). ``splits`` 0:
    the count a build takes (``decode_splits``); 3: three splits of uneven whole blocks; 16: blocks of 32 slots at 512."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen import decode_attention as da
    from aot.codegen.decode_sites import Append, DecodeSite, NewRows

    monkeypatch.delenv(da.SPLIT_ENV, raising=False)
    dtype, B, H, KV, D, C = shape
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    width = (H + 2 * KV) * D  # a fused projection's rows: q, then k, then v
    rows = torch.randn(B, width, dtype=dt, device="cuda")
    q = rows[:, : H * D].reshape(B, H, 1, D)
    k = torch.randn(B, KV, C, D, dtype=dt, device="cuda")
    v = torch.randn(B, KV, C, D, dtype=dt, device="cuda")
    keep = torch.ones(B, C, dtype=torch.bool, device="cuda")
    keep[:, C - C // 4 :] = False
    keep[0, : C // 2] = False  # left padding on the first row: its first splits masked whole
    slot = C - C // 4 - 1  # the last valid slot: this step's
    expect_k, expect_v = k.clone(), v.clone()
    expect_k[:, :, slot] = rows[:, H * D : (H + KV) * D].reshape(B, KV, D)
    expect_v[:, :, slot] = rows[:, (H + KV) * D :].reshape(B, KV, D)
    a = Append(
        k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=NewRows("rows", width, H * D),
        v_new=NewRows("rows", width, (H + KV) * D), k_write=0, v_write=1, k_result="kr", v_result="vr",
    )  # fmt: skip
    mask = torch.where(keep, 0.0, torch.finfo(dt).min).to(dt)
    site = DecodeSite(
        step=0, q="q", q_batch_stride=width, q_column=0, k="k", v="v", mask="m", mask_batch_stride=C,
        out="o", batch=str(B), heads=H, kv_heads=KV, context=C, head_dim=D, scale=1.0 / math.sqrt(D),
        dtype=dtype, append=a,
    )  # fmt: skip
    S = da.decode_splits(site, splits or None)
    assert S >= 2
    partial, combine, workspace = da.render_split_decode_attention(site, S)
    (ws_spec,) = workspace.values()
    ws = torch.empty([int(x) for x in ws_spec.shape], dtype=torch.float32, device="cuda")
    run_partial, run_combine = _load_kernel(partial, tmp_path), _load_kernel(combine, tmp_path)
    pos = torch.tensor([slot], device="cuda")
    outs = []
    for _ in range(2):
        out = torch.full((B, H, 1, D), float("nan"), dtype=dt, device="cuda")
        ws.fill_(float("nan"))
        run_partial[(B * KV, S)](
            rows,
            k,
            v,
            rows,
            rows,
            pos,
            mask,
            ws,
            B,
            num_warps=partial.num_warps,
            num_stages=partial.num_stages,
        )
        run_combine[(B * KV,)](ws, out, B, num_warps=combine.num_warps, num_stages=combine.num_stages)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)  # that slot, and nothing else
    assert torch.equal(outs[0], outs[1])  # deterministic
    # the same split in one kernel, its last program of each (row, KV head) combining: the same
    # cache and the same bits as the two kernels, launched back to back many times (whichever
    # program arrives last), every counter zero after, and none beyond this call's rows touched
    one, _, (_, counts_spec) = da.render_split_combined_decode_attention(site, S, B + 1)
    run_one = _load_kernel(one, tmp_path)
    counts = torch.zeros([int(x) for x in counts_spec.shape], dtype=torch.int32, device="cuda")
    k1, v1 = k.clone(), v.clone()
    k1[:, :, slot], v1[:, :, slot] = 0, 0
    ones = torch.full((20, B, H, 1, D), float("nan"), dtype=dt, device="cuda")
    for i in range(20):
        run_one[(B * KV, S)](
            rows, k1, v1, rows, rows, pos, mask, ws, ones[i], counts, B,
            num_warps=one.num_warps, num_stages=one.num_stages,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(k1, expect_k) and torch.equal(v1, expect_v)
    assert not counts.any(), counts
    assert all(torch.equal(ones[i], outs[0]) for i in range(20)), "the one-kernel split differs"
    G = H // KV
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    m4 = mask[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kk.float(), vv.float(), attn_mask=m4.float()
    )
    library = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=m4).float()
    out = outs[0]
    assert not out.isnan().any()
    spread = (library - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * spread + 1e-3 * ref.abs().max().item(), (err, spread)


@pytest.mark.parametrize("combine", ["kernel", "separate"])
def test_verify_checks_the_split_forms_cache_write(combine, tmp_path, monkeypatch):
    """``aotpack verify`` on a bundle whose decode attention takes the split form (a tiny Llama
    with a 2048-slot cache): in one kernel (the default), its output and cache writes compared
    with the steps it stands for and its counters zero after each launch; in two
    (``AOTPACK_DECODE_COMBINE=separate``), the partial kernel's cache write compared with the two
    ``index_put_`` steps it stands for, the combine's output with SDPA. The bundle passes, and the
    tokens the runner's graphs generate are the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.realmodels.conftest import require

    require("transformers")
    import transformers

    from aot.codegen import generate
    from aot.codegen.decode_attention import COMBINE_ENV, SPLIT_ENV
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from aot.verify.device import passed, verify

    monkeypatch.delenv(SPLIT_ENV, raising=False)
    monkeypatch.setenv(COMBINE_ENV, combine)
    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
    )  # fmt: skip
    spec = causal_lm(lambda: transformers.LlamaForCausalLM(cfg), max_batch=2, max_context=2048, name="t")
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    path = tmp_path / "t.tpk"
    pack(generate(trace(spec), (arch,)), path)
    reports = verify(str(path))
    assert reports and all(passed(r, "float32") for r in reports), reports[:2]
    checked = {name for r in reports for name in r.kernel_errs}
    if combine == "kernel":
        assert any(n.startswith("decode_attention") and n.endswith("_split_combined") for n in checked), (
            checked
        )
        assert not any(n.startswith("decode_attention_combine") for n in checked), checked
    else:
        assert any(n.startswith("decode_attention") and n.endswith("_split") for n in checked), checked
        assert any(n.startswith("decode_attention_combine") for n in checked), checked
    from aot.loader import load

    prompts = [list(range(3, 40)), [7, 8, 9]]  # two rows, the second left-padded
    cpu, gpu = load(path, device="cpu"), load(path, device="cuda")
    want = cpu.generate(prompts, 12)
    assert gpu.generate(prompts, 12) == want
    assert gpu.generate(prompts, 12) == want  # the graphs replayed, the counters as they were left


def test_the_side_programs_prefetch_and_change_no_token(tmp_path, monkeypatch):
    """``AOTPACK_ATTENTION_AHEAD=on``: the decode attention kernels with side programs streaming
    gate/up's weight into L2 (a tiny Llama, bfloat16, Llama-3.2-1B's head shape); ``aotpack verify``
    passes, and the GPU's greedy tokens, in blocks of steps and one step a launch, are those of the
    same model built without the side programs (which load into L2 alone and write nothing: the
    same kernels otherwise, so the same bits). Against the CPU's tokens this bfloat16 model
    parts at a near tie (H100, 2026-12-07: one step later, in one row of two), as any other
    build of it may."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.realmodels.conftest import require

    require("transformers")
    import transformers

    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from aot.verify.device import passed, verify

    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=True,
    )  # fmt: skip
    spec = causal_lm(
        lambda: transformers.LlamaForCausalLM(cfg), max_batch=2, max_context=160, name="t", dtype="bfloat16"
    )
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    traced = trace(spec)
    paths = {}
    for setting in ("off", "on"):
        monkeypatch.setenv("AOTPACK_ATTENTION_AHEAD", setting)
        compiled = generate(traced, (arch,))
        kernels = [k.name for p in (compiled.program, *compiled.program.variants) for k in p.kernels]
        ahead = sum(name.startswith("decode_attention") and name.endswith("_ahead") for name in kernels)
        assert ahead == (2 if setting == "on" else 0), kernels
        paths[setting] = tmp_path / f"t-{setting}.tpk"
        pack(compiled, paths[setting])
    reports = verify(str(paths["on"]))
    assert reports and all(passed(r, "bfloat16") for r in reports), reports[:2]
    prompts = [list(range(3, 40)), [7, 8, 9]]
    want = load(paths["off"], device="cuda").generate(prompts, 16)
    assert len({t for row in want for t in row}) > 2, (
        "the tokens barely vary; the comparison would prove little"
    )
    gpu = load(paths["on"], device="cuda")
    assert gpu.generate(prompts, 16) == want
    assert gpu.generate(prompts, 16, steps_per_launch=1) == want
