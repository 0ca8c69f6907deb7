"""Decode attention (``aot.codegen.decode_attention``): the kernel, run by Triton's interpreter on
the CPU, against ``torch.nn.functional.scaled_dot_product_attention`` in float64 on the same
inputs (grouped-query heads, a cache length that is no multiple of the block, left padding that
masks a row's first slots, a query read from a projection's rows, a mask row shared by every
row); and the sites found in a decode program. Tolerances: float32 1e-4, float16 2e-2, each
absolute plus relative to the largest output (the output is rounded to float16 once). bfloat16
is checked on the GPU only (``tests/gpu/test_decode_attention_gpu.py``): Triton's interpreter
(3.9) computes ``tl.dot`` of bfloat16 operands wrongly (a 16x16 product off by 1e10)."""

from __future__ import annotations

import pytest

from aot.schema import Buf
from tests.codegen.conftest import assert_decode_kernels_match, interpreted_json

# (name, dtype, batch, heads, kv_heads, head_dim, context, q rows from a projection, shared mask,
#  boolean mask, the slot this step appends to the cache (None: no append))
CASES = [
    ("gqa_fp32", "float32", 2, 8, 2, 64, 40, False, False, False, None),
    ("mha_projection_fp32", "float32", 2, 3, 3, 32, 20, True, True, False, None),
    ("gqa_fp16", "float16", 1, 4, 1, 64, 300, False, False, False, None),
    ("gqa_projection_bool_mask_fp32", "float32", 3, 4, 2, 8, 32, True, False, True, None),
    # the cache write folded in: new keys and values from a projection's rows, a slot past the
    # first block, the last slot (as a negative index), a head dim that pads its block
    ("append_gqa_fp32", "float32", 2, 8, 2, 64, 40, True, False, False, 33),
    ("append_mha_fp16_last", "float16", 1, 4, 4, 24, 300, True, True, False, -1),
    ("append_bool_mask_fp32", "float32", 3, 4, 2, 8, 32, False, False, True, 0),
    # a head dim of 256 (Gemma's): blocks of 64 slots, so that two stages fit shared memory
    ("append_d256_fp16", "float16", 1, 4, 2, 256, 160, True, False, False, 130),
    # bfloat16: the vector form only (no tl.dot), Llama-3.2-1B's heads at its bench cache's length
    ("append_gqa_bf16", "bfloat16", 1, 32, 8, 64, 160, True, False, False, 150),
]
# the one-kernel form's two kinds (``decode_attention_render.VECTOR_FORM``): one program per KV
# head on the tensor cores ("tile"), or one per query head without them ("vector")
FORMS = ("tile", "vector")

SCRIPT = r"""
import importlib.util, json, math, sys, tempfile
import torch
from aot.codegen.decode_attention import render_decode_attention
from aot.codegen.decode_sites import Append, DecodeSite, NewRows

cases = json.loads(sys.argv[1]) if len(sys.argv) > 1 else CASES
out = {}
runs = [(c, form) for c in cases for form in ("tile", "vector") if form == "vector" or c[1] != "bfloat16"]
for (name, dtype, B, H, KV, D, C, projection, shared, boolean, slot), form in runs:
    torch.manual_seed(hash(name) % 1000)
    dt = getattr(torch, dtype)
    width = (H + 2 * KV) * D if projection else H * D  # a fused projection: q, then k, then v
    column = 0
    rows = torch.randn(B, width, dtype=dt)
    q = rows[:, column : column + H * D].reshape(B, H, 1, D)
    k = torch.randn(B, KV, C, D, dtype=dt)
    v = torch.randn(B, KV, C, D, dtype=dt)
    keep = torch.ones(1 if shared else B, C, dtype=torch.bool)
    keep[:, C // 2 + 1 :] = False  # slots after the query's
    if not shared:
        keep[-1, : min(C // 3, 70)] = False  # left padding: a whole first block masked on one row
    append, new = None, ()
    if slot is not None:
        keep[:, slot] = True  # the new token attends to itself
        if projection:  # the new keys and values: head views of the projection's rows
            kn_rows, vn_rows = rows, rows
            k_at, v_at = NewRows("rows", width, H * D), NewRows("rows", width, (H + KV) * D)
        else:  # buffers of their own, [B, KV, 1, D]
            kn_rows, vn_rows = torch.randn(B, KV * D, dtype=dt), torch.randn(B, KV * D, dtype=dt)
            k_at, v_at = NewRows("kn", KV * D, 0), NewRows("vn", KV * D, 0)
        kn = kn_rows[:, k_at.column : k_at.column + KV * D].reshape(B, KV, D)
        vn = vn_rows[:, v_at.column : v_at.column + KV * D].reshape(B, KV, D)
        k_before, v_before = k.clone(), v.clone()
        pos = torch.tensor([slot], dtype=torch.int64)
        append = Append(
            k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=k_at, v_new=v_at,
            k_write=0, v_write=1, k_result="kr", v_result="vr",
        )
        new = (kn_rows, vn_rows, pos)
    mask = keep if boolean else torch.where(keep, 0.0, torch.finfo(dt).min).to(dt)
    site = DecodeSite(
        step=0, q="q", q_batch_stride=width, q_column=column, k="k", v="v", mask="m",
        mask_batch_stride=0 if shared else C, out="o", batch=str(B), heads=H, kv_heads=KV,
        context=C, head_dim=D, scale=1.0 / math.sqrt(D), dtype=dtype,
        mask_dtype="bool" if boolean else dtype, append=append,
    )
    r = render_decode_attention(site, vector=form == "vector")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(r.source)
    spec = importlib.util.spec_from_file_location(r.name, f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    o = torch.full((B, H, 1, D), float("nan"), dtype=dt)
    grid = (B * KV,) if form == "tile" else (B * KV, H // KV)
    getattr(module, r.name)[grid](rows, k, v, *new, mask.contiguous(), o, B, num_warps=r.num_warps)
    written_ok = True
    if slot is not None:  # the kernel wrote the slot, and nothing else, as index_put_ does
        k_before[:, :, slot], v_before[:, :, slot] = kn, vn
        written_ok = bool(torch.equal(k, k_before) and torch.equal(v, v_before))
    G = H // KV
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    m4 = mask[:, None, None, :] if boolean else mask.double()[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=m4)
    err = (o.double() - ref).abs()
    out[f"{name}-{form}"] = {
        "max_err": float(err.max()), "ref_max": float(ref.abs().max()), "nan": bool(o.isnan().any()),
        "written": written_ok,
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    script = SCRIPT.replace("CASES", repr(CASES))
    return interpreted_json(script)


# bfloat16 in the vector form only: the interpreter's tl.dot of bfloat16 is wrong (the GPU checks it)
RUNS = [(case, form) for case in CASES for form in FORMS if form == "vector" or case[1] != "bfloat16"]


@pytest.mark.parametrize("case, form", RUNS, ids=[f"{c[0]}-{f}" for c, f in RUNS])
def test_decode_attention_matches_sdpa(interpreted, case, form):
    name, dtype = case[0], case[1]
    got = interpreted[f"{name}-{form}"]
    assert not got["nan"], f"{name}: unwritten or NaN outputs"
    assert got["written"], f"{name}: the cache differs from index_put_'s (the new slot, or another)"
    tol = 1e-4 if dtype == "float32" else 2e-2  # float16, bfloat16 (8 bits of mantissa: 2e-2 as well)
    assert got["max_err"] <= tol * (1 + got["ref_max"]), got


@pytest.mark.slow
def test_decode_program_sites_found_and_kernel_replaces_sdpa(tmp_path):
    """A Llama-3.2-shaped tiny causal LM (grouped-query 4:1 over two KV heads, so that the codegen
    folds the query heads into rows, tied embeddings): its decode program's SDPA calls become
    decode attention kernels, one per layer, rotating the queries and keys from the projection's
    rows themselves, whose reference ends with the SDPA step; the prefill program's (queries of
    any length) stay."""
    from tests.realmodels.conftest import require

    require("transformers")
    import transformers

    from aot.codegen import generate
    from aot.codegen.decode_sites import SDPA
    from aot.hf import causal_lm
    from aot.schema import StepKind
    from aot.tracer import trace

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    spec = causal_lm(
        lambda: transformers.LlamaForCausalLM(cfg),
        max_batch=2,
        max_context=32,
        name="t",
        batch_buckets=(1, 2),
    )
    program = generate(trace(spec), ("sm_90",)).program
    by_entry = {}
    for p in (program, *program.variants):
        kernels = {k.id: k for k in p.kernels}
        decode = [
            s
            for s in p.steps
            if s.kind == StepKind.KERNEL and kernels[s.target].config.get("kind") == "decode_attention"
        ]
        library = [s for s in p.steps if s.kind == StepKind.ATEN and s.target == SDPA]
        by_entry.setdefault(len(decode), []).append(len(library))
        for s in decode:  # the SDPA call, after the cache writes it folds in and their views
            targets = [r.target for r in s.reference]
            assert targets[-1] == SDPA and targets.count("aten.index_put_.default") == 2, targets
            assert set(s.in_place.values()) <= set(p.state)
            source = kernels[s.target].source
            assert "GROUPS = tl.constexpr(4)" in source and "KV_HEADS = tl.constexpr(2)" in source
            assert "_rope_" in kernels[s.target].name and targets.count("aten.neg.default") == 2
    assert by_entry == {0: [2], 2: [0]} or by_entry == {2: [0], 0: [2]}, by_entry


def test_tiny_lm_decode_program_runs_decode_attention(built):
    """tests/data/tiny_lm.py (a GQA decoder of its own, 4 query heads over 2 KV heads, its queries
    a head view of a projection, the cache expanded and reshaped per query head): each layer's
    SDPA of the decode program is a decode attention kernel step reading the query where the
    projection wrote it and the cache where it lives, and appending the step's keys and values to
    it; the prefill program keeps SDPA."""
    from aot.codegen.decode_sites import SDPA
    from aot.loader.bundle import open_bundle
    from aot.schema import StepKind

    b = open_bundle(built("tiny_lm", ("sm_90",)))
    try:
        program = b.program()
    finally:
        b.close()
    prefill, decode = program, program.variants[0]
    assert sum(s.target == SDPA for s in prefill.steps) == 2
    kernels = {k.id: k for k in decode.kernels}
    steps = [
        s
        for s in decode.steps
        if s.kind == StepKind.KERNEL and kernels[s.target].config["kind"] == "decode_attention"
    ]
    assert len(steps) == 2 and not any(s.target == SDPA for s in decode.steps)
    state = {"key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"}
    for step in steps:
        assert [r.target for r in step.reference if r.target == SDPA] == [SDPA]
        source = kernels[step.target].source
        assert "GROUPS = tl.constexpr(2)" in source and "KV_HEADS = tl.constexpr(2)" in source
        # the step's keys and values appended by the kernel (read where the stacked k/v projection
        # wrote them, through its view and permute), into the cache where it lives
        writes = [r for r in step.reference if r.target == "aten.index_put_.default"]
        assert len(writes) == 2 and {w.args[0].name for w in writes} <= state
        assert {step.args[1].name, step.args[2].name} <= state
    assert not any(s.target == "aten.index_put_.default" for s in decode.steps)


@pytest.mark.parametrize("appends", [False, True])
def test_the_cache_is_read_before_the_wait_only_where_no_step_before_writes_it(appends):
    """A cache of one block of slots is loaded before the kernel waits for the one before it
    (dependent launch) only where this kernel appends the step's key and value itself. Where a
    step before writes the cache (a cache-write step, then attention), an early load would race
    that write and read the slot's old key and value."""
    from aot.codegen.decode_attention import render_decode_attention
    from aot.codegen.decode_sites import Append, DecodeSite, NewRows

    append = None
    if appends:
        append = Append(
            k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=NewRows("kn", 16, 0),
            v_new=NewRows("vn", 16, 0), k_write=0, v_write=1, k_result="kr", v_result="vr",
        )  # fmt: skip
    site = DecodeSite(
        step=0, q="q", q_batch_stride=32, q_column=0, k="k", v="v", mask="m", mask_batch_stride=32,
        out="o", batch="2", heads=4, kv_heads=2, context=32, head_dim=8, scale=0.35,
        dtype="float32", mask_dtype="float32", append=append,
    )  # fmt: skip
    lines = render_decode_attention(site).source.splitlines()
    wait = next(i for i, line in enumerate(lines) if "gdc_wait()" in line)
    load = next(i for i, line in enumerate(lines) if line.strip().startswith("k = tl.load(k_ptr"))
    assert (load < wait) == appends, "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["falcon", "gpt_bigcode"])
def test_multi_query_models_decode_programs_run_decode_attention(kind, tmp_path):
    """Multi-query models, one KV head for every query head: Falcon's SDPA call broadcasts its
    [B, 1, C, D] cache against the query heads, GPTBigCode's expands it and splits its queries,
    keys and values off rows it unsqueezed first. Both decode programs run decode attention kernels
    over the one KV head (``KV_HEADS = 1``, every query head a row of its tile) and append to the
    caches (Falcon's new values: the rows an ``index`` of their head wrote, through a permute of
    unit dims), and every kernel, run by the interpreter at batch 2 (one row left-padded),
    matches its reference: the caches exactly, the rest within float32's tolerance."""

    compiled, kernels, attention = _hf_decode_attention(kind, max_batch=2, max_context=16)
    for s in attention:
        assert "KV_HEADS = tl.constexpr(1)" in kernels[s.target].source and len(s.in_place) == 2
    assert_decode_kernels_match(compiled, tmp_path / f"{kind}.tpk", "decode_attention")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama4", "gemma3", "llama4_chunked", "gemma2", "gemma2_gqa", "gpt_oss"])
def test_llama4_and_mixed_window_models_run_decode_attention(kind, tmp_path):
    """Llama 4's text model (grouped-query heads; queries normed, scaled by its temperature and
    cast back before the permute to [B, H, 1, D], so the grouped-query fold views a permute of a
    buffer a kernel wrote, not a projection's rows; layers without RoPE; a layer of experts), Gemma
    3 (a sliding-window layer of 4 slots beside a full-attention one: a mask per kind of layer) and
    Llama 4 with attention in chunks of 4 slots beside a full layer, and Gemma 2 (eager attention:
    scores capped as ``0.5 * tanh(s / 0.5)``, softmax in float32, a sliding-window layer beside a
    full one; with two query heads per KV head, repeat_kv's copy of the cache folded in with the
    writes) and GPT-OSS (eager attention with a learned sink logit per head, its rotary over
    halves, a window beside a full layer): each decode program runs a decode attention kernel with the cache writes at both
    layers, and every kernel, run by the interpreter at batch 2 (one row left-padded, the query
    at slot 9: the window hides slots), matches its reference: the caches exactly, the rest within
    float32's tolerance."""

    compiled, kernels, attention = _hf_decode_attention(kind, max_batch=4, max_context=32)
    assert all(kernels[s.target].name.startswith("decode_attention_append") for s in attention), attention
    if kind == "gpt_oss":  # its rotary over the halves torch.chunk made, tables of half the head
        assert all("_rope" in kernels[s.target].name for s in attention), attention
    assert_decode_kernels_match(compiled, tmp_path / f"{kind}.tpk", "decode_attention")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_per_head_norms_before_the_rotary_fold_into_the_kernel(kind, tmp_path):
    """Qwen3 and Gemma 3 norm each query and key head (RMSNorm over the head dim: Qwen3 before
    the transpose, Gemma 3 after it, its weight as ``1 + w``) before the rotary; a kernel computed
    the norm and the rotary of each, two launches a layer. Now the decode attention kernel loads
    the projection's rows, norms each head (a rotary partner with its head's statistics), rotates
    and appends. Built in bfloat16, as these models run: no kernel of the decode program reads a
    q_norm weight but the attention kernels, and the keys' norms fold in too. Built in float32:
    every kernel, run by the interpreter at batch 2 (one row left-padded), matches its reference
    (the norm and rotary kernels' steps included) within float32's tolerance, the caches among
    them. A key's norm stays a kernel where the fuser put it with the rotary tables, which other
    steps read (both of this two-layer Gemma 3's, each layer with tables of its own; a model with
    several layers of a kind computes them apart): the attention then reads its rotated keys."""

    import torch

    from tests.hf.test_causal_lm import factory

    norms: dict[str, list] = {"q_norm": [], "k_norm": []}

    def make():
        """The model with random per-head norm weights, the queries' apart from the keys' (as
        initialized they are all alike, and fold to one weight)."""
        model, gen = factory(kind)(), torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.rsplit(".", 2)[-2] in norms:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                    norms[name.rsplit(".", 2)[-2]].append(p.detach().clone())
        return model

    def reading(compiled, which: str) -> list:
        """The decode program's steps that read the ``which`` norms' weights, as the program names
        them: the model's weight, or one folded at build time (Gemma 3's ``1 + w``)."""
        values = norms[which][-2:]  # this build's (the model is made once a trace)
        names = {
            name
            for name, t in compiled.traced.weights.items()
            for v in values
            if t.shape == v.shape
            and any(torch.allclose(t.float(), w, atol=2e-2, rtol=0) for w in (v.float(), 1 + v.float()))
        }
        assert len(names) == 2, (which, sorted(names))
        (decode,) = [
            p for p in (compiled.program, *compiled.program.variants) if p.inputs[0].spec.shape[1] == "1"
        ]
        return [s for s in decode.steps if any(isinstance(a, Buf) and a.name in names for a in s.args)]

    for dtype in ("bfloat16", "float32"):
        compiled, kernels, attention = _hf_decode_attention(
            kind, max_batch=4, max_context=32, dtype=dtype, make=make
        )
        assert all("_normed_rope" in kernels[s.target].name for s in attention), attention
        assert sorted(reading(compiled, "q_norm"), key=id) == sorted(attention, key=id)
        keys = [s for s in reading(compiled, "k_norm") if s in attention]
        assert len(keys) == (2 if kind == "qwen3" else 0), [kernels[s.target].name for s in keys]
    assert_decode_kernels_match(compiled, tmp_path / f"{kind}.tpk", "decode_attention")


@pytest.mark.parametrize(
    "head_dim, context, dtype, block",
    [
        (64, 160, "bfloat16", 256),  # Llama-3.2-1B's: one block, as before
        (128, 160, "bfloat16", 256),  # one block of 256: loaded once
        (128, 400, "bfloat16", 128),  # Llama-3-8B's past 256 slots: 260 KiB in blocks of 256
        (256, 160, "bfloat16", 64),  # Gemma's: 264 KiB in one block of 256
        (128, 300, "float32", 64),
    ],
)
@pytest.mark.parametrize("form", FORMS)
def test_the_one_kernel_form_fits_shared_memory(head_dim, context, dtype, block, form):
    """The one-kernel form's block at wide heads (``decode_attention_render._block_n``): every
    such kernel compiles for sm_90 within its shared memory (before, a head dim of 256 past 128
    slots and of 128 past 256 did not, and their SDPA stayed); the vector form (its cache in
    registers, not shared memory) for sm_80 too."""
    import math

    from aot.codegen import compile_kernels
    from aot.codegen.decode_attention_render import render_decode_attention
    from aot.codegen.decode_sites import Append, DecodeSite, NewRows

    heads, kv, width = 8, 4, (8 + 2 * 4) * head_dim
    append = Append(
        k_state="k",
        v_state="v",
        pos="pos",
        pos_dtype="int64",
        k_new=NewRows("rows", width, heads * head_dim),
        v_new=NewRows("rows", width, (heads + kv) * head_dim),
        k_write=0,
        v_write=1,
        k_result="kr",
        v_result="vr",
    )
    site = DecodeSite(
        step=0,
        q="rows",
        q_batch_stride=width,
        q_column=0,
        k="k",
        v="v",
        mask="m",
        mask_batch_stride=context,
        out="o",
        batch="batch",
        heads=heads,
        kv_heads=kv,
        context=context,
        head_dim=head_dim,
        scale=1 / math.sqrt(head_dim),
        dtype=dtype,
        append=append,
    )
    rendered = render_decode_attention(site, vector=form == "vector")
    assert f"BLOCK_N = tl.constexpr({block})" in rendered.source
    assert rendered.name.endswith("_vector") == (form == "vector")
    archs = ("sm_80", "sm_90") if form == "vector" else ("sm_90",)
    _, failed, _ = compile_kernels({"attention": rendered}, archs, lambda message: None)
    assert not failed, failed


def _hf_decode_attention(
    kind: str, max_batch: int, max_context: int, dtype: str = "float32", make=None
) -> tuple:
    """A tiny two-layer ``kind`` (``tests.hf``) through ``aot.hf.causal_lm``, generated for sm_90:
    (the compiled programs, its decode program's kernels by id, its decode attention steps),
    having checked there is one such step per layer and no SDPA call left. ``make``: the model's
    factory, where not ``tests.hf``'s."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.codegen.decode_sites import SDPA
    from aot.hf import causal_lm
    from aot.schema import StepKind
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    spec = causal_lm(
        make or factory(kind), max_batch=max_batch, max_context=max_context, name=kind, dtype=dtype
    )
    compiled = generate(trace(spec), ("sm_90",))
    (decode,) = [
        p for p in (compiled.program, *compiled.program.variants) if p.inputs[0].spec.shape[1] == "1"
    ]
    kernels = {k.id: k for k in decode.kernels}
    attention = [
        s for s in decode.steps if s.kind == StepKind.KERNEL and kernels[s.target].name.startswith("decode_")
    ]
    assert len(attention) == 2 and not any(s.target == SDPA for s in decode.steps), decode.steps
    return compiled, kernels, attention


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_capped_scores_and_sinks_split_across_the_cache(kind, tmp_path, monkeypatch):
    """The split-KV form (forced: two splits of a 32-slot cache, in blocks of 16 slots) with Gemma 2's capped scores and
    GPT-OSS's sinks (counted once, by the first split's partial): every kernel of the decode
    program matches its reference in the interpreter, as the one-kernel form does."""
    from aot.codegen import decode_attention, decode_attention_render

    monkeypatch.setenv(decode_attention.SPLIT_ENV, "2")
    for module in (decode_attention, decode_attention_render):  # a cache of one 128-slot block never splits
        monkeypatch.setattr(module, "SPLIT_BLOCK_N", 16)
    compiled, kernels, attention = _hf_decode_attention(kind, max_batch=4, max_context=32)
    assert all("_split" in kernels[s.target].name for s in attention), [
        kernels[s.target].name for s in attention
    ]
    from aot.packager import pack
    from tests.codegen.conftest import decode_kernel_checks

    pack(compiled, tmp_path / f"{kind}.tpk")
    checks = decode_kernel_checks(tmp_path / f"{kind}.tpk", position=9, padding=2)
    ours = [c for c in checks if c[0].startswith("decode_attention")]
    outputs = {c[1] for c in ours if not c[1].startswith("index_put") and not c[1].endswith("_arrivals")}
    assert len(outputs) == 2 and {c[0] for c in ours} == {kernels[s.target].name for s in attention}, ours
    assert all(ok for *_, ok in checks), [c for c in checks if not c[3]]


def test_the_decode_attention_warps_setting(monkeypatch):
    """``AOTPACK_DECODE_WARPS`` sets every decode attention program's warps (for measuring); unset,
    a key tile of ``WIDE_TILE`` elements or more gets 8, one of ``SMALL_TILE`` or fewer (GPT-2's
    split form: 64 slots x 64) 2, one between them 4; another value is a ``CodegenError`` naming
    the ones it takes."""
    from aot.codegen import decode_attention_render as r
    from aot.errors import CodegenError

    monkeypatch.delenv(r.WARPS_ENV, raising=False)
    assert (r._warps(r.WIDE_TILE), r._warps(r.WIDE_TILE - 1)) == (8, 4)
    assert (r._warps(64 * 64), r._warps(r.SMALL_TILE), r._warps(r.SMALL_TILE + 1)) == (2, 2, 4)
    monkeypatch.setenv(r.WARPS_ENV, "4")
    assert r._warps(r.WIDE_TILE * 4) == 4
    monkeypatch.setenv(r.WARPS_ENV, "3")
    with pytest.raises(CodegenError, match="expected '2', '4', '8' or '16'"):
        r._warps(1)
