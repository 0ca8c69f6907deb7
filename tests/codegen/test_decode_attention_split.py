"""Split-KV decode attention (``aot.codegen.decode_attention``, ``render_split_decode_attention``):
the partial kernel (grid (B * KV, splits), each program a range of whole blocks of the cache) and
the combine kernel (grid (B * KV,)), run one after the other by Triton's interpreter on the CPU,
against ``torch.nn.functional.scaled_dot_product_attention`` in float64 on the same inputs; the
cache the partial kernel leaves where it appends equals eager's ``index_put_`` (with RoPE: of the
keys eager rotated) bit for bit. Most cases shrink ``SPLIT_BLOCK_N`` to 16 so that a small cache
spans several blocks (one at the built-in 128). Tolerances as ``test_decode_attention.py``'s:
float32 1e-4, float16 2e-2, absolute plus relative to the largest output. bfloat16 checks the
cache only (Triton's interpreter computes ``tl.dot`` of bfloat16 operands wrongly); the GPU test
(``tests/gpu/test_decode_attention_gpu.py``) checks its output.

Then the choice of form (``decode_splits``, ``AOTPACK_DECODE_SPLIT``) and a decode program with a
cache longer than the one-kernel form's limit.
"""

from __future__ import annotations

import pytest

from tests.codegen.conftest import decode_kernel_checks, interpreted_json

# (name, dtype, batch, heads, kv_heads, head_dim, context, splits, SPLIT_BLOCK_N, the slot
#  appended (None: no append), mask ("add", "bool", "shared"), rotary dim (0: none))
CASES = [
    # append in the first split; whole splits masked by left padding (bool: m at the floor, l = 0)
    ("first_split_bool_fp32", "float32", 2, 8, 2, 16, 100, 4, 16, 3, "bool", 0),
    # append in a middle split, one KV head for four query heads
    ("middle_split_fp16", "float16", 1, 4, 1, 32, 160, 5, 16, 70, "add", 0),
    # the last slot (a negative index) in the last split; a head dim that pads its block; a context
    # no multiple of the block; as many splits as blocks (the cache loaded before the wait)
    ("last_split_d24_fp32", "float32", 2, 4, 4, 24, 90, 6, 16, -1, "shared", 0),
    # no append; 4 blocks over 3 splits (one of two blocks)
    ("gqa_read_fp16", "float16", 3, 8, 2, 16, 64, 3, 16, None, "bool", 0),
    # the built-in block of 128 slots: three blocks, one per split
    ("default_block_fp32", "float32", 1, 2, 1, 16, 300, 3, 128, 200, "add", 0),
    # rotary embedding of the queries and the new keys in the kernel
    ("rope_gqa_fp32", "float32", 2, 8, 2, 32, 80, 5, 16, 50, "add", 32),
    ("rope_partial_fp16", "float16", 1, 4, 2, 32, 72, 4, 16, 71, "add", 16),
    ("append_bf16", "bfloat16", 1, 4, 2, 16, 64, 4, 16, 20, "bool", 0),
    ("rope_bf16", "bfloat16", 2, 4, 2, 16, 48, 3, 16, 0, "add", 16),
]

SCRIPT = r"""
import importlib.util, json, math, tempfile
import torch
from aot.codegen import decode_attention_render
from aot.codegen.decode_sites import Append, DecodeSite, NewRows, Rotary

def load(r):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(r.source)
    spec = importlib.util.spec_from_file_location(r.name, f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, r.name)

def truncated(t):  # the interpreter's float32 -> bfloat16: toward zero
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

def rotate(x, cos, sin, R):  # eager, in x's dtype: x [B, n, 1, D], cos/sin [B, 1, R]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, rest = x[..., :R], x[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2 :]
    if x.dtype == torch.bfloat16:
        turned = torch.cat((-x2, x1), -1)
        out = truncated(truncated(xr.float() * c.float()).float() + truncated(turned.float() * s.float()).float())
    else:
        out = xr * c + torch.cat((-x2, x1), -1) * s
    return torch.cat((out, rest), -1) if R < x.shape[-1] else out

out = {}
for name, dtype, B, H, KV, D, C, S, BN, slot, masking, R in CASES:
    decode_attention_render.SPLIT_BLOCK_N = BN
    torch.manual_seed(sum(map(ord, name)))
    dt = getattr(torch, dtype)
    width = (H + 2 * KV) * D  # a fused projection's rows: q, then k, then v
    rows = torch.randn(B, width, dtype=dt)
    q = rows[:, : H * D].reshape(B, H, 1, D)
    k = torch.randn(B, KV, C, D, dtype=dt)
    v = torch.randn(B, KV, C, D, dtype=dt)
    shared = masking == "shared"
    keep = torch.ones(1 if shared else B, C, dtype=torch.bool)
    keep[:, C // 2 + 1 :] = False  # slots after the query's: the last splits masked whole
    if not shared:
        keep[-1, : C // 3] = False  # left padding: the first splits of the last row masked whole
    if slot is not None:
        keep[:, slot] = True  # the new token attends to itself
    q_rot = None
    tables = ()
    if R:
        positions = torch.randint(0, 4000, (B, 1)).float()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
        angles = torch.cat([positions[:, :, None] * inv_freq] * 2, -1)  # [B, 1, R]
        cos, sin = angles.cos().to(dt), angles.sin().to(dt)
        tables = (cos, sin)
        q_rot = Rotary(NewRows("rows", width, 0), "cos", "sin", R, R, 0, "q_rotated")
        q = rotate(q, cos, sin, R)
    append, new = None, ()
    k_eager, v_eager = k.clone(), v.clone()
    if slot is not None:
        k_rot = Rotary(NewRows("rows", width, H * D), "cos", "sin", R, R, 1, "k_rotated") if R else None
        append = Append(
            k_state="k", v_state="v", pos="pos", pos_dtype="int64",
            k_new=NewRows("k_rotated", KV * D, 0) if R else NewRows("rows", width, H * D),
            v_new=NewRows("rows", width, (H + KV) * D), k_write=2, v_write=3, k_result="kr", v_result="vr",
            k_rotary=k_rot,
        )
        new = (rows, rows, torch.tensor([slot], dtype=torch.int64))
        kn = rows[:, H * D : (H + KV) * D].reshape(B, KV, 1, D)
        if R:
            kn = rotate(kn, cos, sin, R)
        k_eager[:, :, slot] = kn[:, :, 0]
        v_eager[:, :, slot] = rows[:, (H + KV) * D :].reshape(B, KV, D)
    boolean = masking == "bool"
    mask = keep if boolean else torch.where(keep, 0.0, torch.finfo(dt).min).to(dt)
    site = DecodeSite(
        step=4, q="q", q_batch_stride=width, q_column=0, k="k", v="v", mask="m",
        mask_batch_stride=0 if shared else C, out="o", batch=str(B), heads=H, kv_heads=KV, context=C,
        head_dim=D, scale=1.0 / math.sqrt(D), dtype=dtype, mask_dtype="bool" if boolean else dtype,
        append=append, q_rotary=q_rot,
    )
    partial, combine, workspace = decode_attention_render.render_split_decode_attention(site, S)
    (ws_name, ws_spec), = workspace.items()
    ws = torch.full([int(x) for x in ws_spec.shape], float("nan"), dtype=torch.float32)
    o = torch.full((B, H, 1, D), float("nan"), dtype=dt)
    k1, v1 = k.clone(), v.clone()  # the cache as the one-kernel form finds it
    load(partial)[(B * KV, S)](rows, k, v, *new, *tables, mask.contiguous(), ws, B, num_warps=partial.num_warps)
    load(combine)[(B * KV,)](ws, o, B, num_warps=combine.num_warps)
    # the same split in one kernel: its counters (one row more than this call's) zeroed, as a
    # runner allocates them; the last program of each (row, KV head) combines
    one, one_ws, (counts_name, counts_spec) = decode_attention_render.render_split_combined_decode_attention(site, S, B + 1)
    counts = torch.zeros([int(x) for x in counts_spec.shape], dtype=torch.int32)
    ws1 = torch.full([int(x) for x in ws_spec.shape], float("nan"), dtype=torch.float32)
    o1 = torch.full((B, H, 1, D), float("nan"), dtype=dt)
    load(one)[(B * KV, S)](rows, k1, v1, *new, *tables, mask.contiguous(), ws1, o1, counts, B, num_warps=one.num_warps)
    # (row, split) pairs whose slots are all masked: their partial holds m at the floor and l = 0
    bn = partial.config["BLOCK_N"]
    blocks = -(-C // bn)
    bounds = [(s * blocks // S * bn, min(C, (s + 1) * blocks // S * bn)) for s in range(S)]
    empty = sum(not bool(keep[r, lo:hi].any()) for r in range(keep.shape[0]) for lo, hi in bounds)
    G = H // KV
    m4 = mask[:, None, None, :] if boolean else mask.double()[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k_eager.double().repeat_interleave(G, 1), v_eager.double().repeat_interleave(G, 1),
        attn_mask=m4,
    )
    out[name] = {
        "names": [partial.name, combine.name], "grids": [list(partial.grid), list(combine.grid)],
        "outputs": [list(partial.outputs), list(combine.outputs)], "ws": ws_name,
        "ws_shape": list(ws_spec.shape), "empty_splits": empty, "block_n": bn,
        "cache_equal": bool(torch.equal(k, k_eager) and torch.equal(v, v_eager)),
        "max_err": float((o.double() - ref).abs().max()), "ref_max": float(ref.abs().max()),
        "nan": bool(o.isnan().any()),
        "one": {
            "name": one.name, "grid": list(one.grid), "outputs": list(one.outputs),
            "workspace": sorted(one_ws), "counters": [counts_name, list(counts_spec.shape)],
            "counters_zero": bool((counts == 0).all()),
            "same_output": bool(torch.equal(o1, o)) if dtype != "bfloat16" else None,
            "cache_equal": bool(torch.equal(k1, k_eager) and torch.equal(v1, v_eager)),
            "ops": list(one.ops),
        },
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_json(SCRIPT.replace("CASES", repr(CASES)))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_split_decode_attention_matches_sdpa(interpreted, case):
    name, dtype, B, H, KV, D, _, S, slot, masking = *case[:8], case[9], case[10]
    got = interpreted[name]
    assert got["grids"] == [[str(B * KV), str(S)], [str(B * KV)]], got
    assert got["block_n"] == case[8], got
    assert got["ws_shape"] == [str(B), str(KV), str(S), str(H // KV), str(D + 2)], got
    appended = ["kr", "vr"] if slot is not None else []
    assert got["outputs"] == [[got["ws"], *appended], ["o"]], got
    if masking == "bool":  # left padding and the slots after the query's mask whole splits
        assert got["empty_splits"] > 0, got
    assert got["cache_equal"], f"{name}: the cache differs from eager's index_put_ at slot {slot}: {got}"
    if dtype == "bfloat16":
        return  # the interpreter's bfloat16 tl.dot is wrong: the output is checked on the GPU
    assert not got["nan"], f"{name}: unwritten or NaN outputs"
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert got["max_err"] <= tol * (1 + got["ref_max"]), got


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_split_form_in_one_kernel_equals_the_two_kernel_form(interpreted, case):
    """The split form in one kernel (``render_split_combined_decode_attention``): the partial
    kernel's grid, the output and the cache in place as the one-kernel form writes them, its
    workspace, and one int32 arrival counter per program of the grid's first dim at the largest
    batch given (one row more here); after the launch every counter is zero again, and the
    output is bit for bit the two-kernel form's (the last program combines in the combine
    kernel's order; bfloat16: the cache only, as above)."""
    name, dtype, B, _, KV, _, _, S, slot = *case[:8], case[9]
    one = interpreted[name]["one"]
    assert one["name"].endswith("_split_combined"), one
    assert one["grid"] == [str(B * KV), str(S)], one
    appended = ["kr", "vr"] if slot is not None else []
    assert one["outputs"] == ["o", *appended, interpreted[name]["ws"]], one
    assert one["workspace"] == [interpreted[name]["ws"]], one
    assert one["counters"] == ["o_splitkv_arrivals", [str((B + 1) * KV)]], one
    assert one["counters_zero"], f"{name}: a counter was left non-zero"
    assert one["cache_equal"], f"{name}: the cache differs from eager's index_put_ at slot {slot}"
    assert one["ops"] == (["aten.index_put_.default"] if slot is not None else []) + [
        "aten.scaled_dot_product_attention.default"
    ], one
    if dtype != "bfloat16":
        assert one["same_output"], f"{name}: the one-kernel split's output differs from the two kernels'"


def _site(context: int, batch: str = "1", kv_heads: int = 2, append: bool = True):
    from aot.codegen.decode_sites import Append, DecodeSite, NewRows

    a = None
    if append:
        a = Append(
            k_state="k", v_state="v", pos="pos", pos_dtype="int64", k_new=NewRows("kn", 16 * kv_heads, 0),
            v_new=NewRows("vn", 16 * kv_heads, 0), k_write=0, v_write=1, k_result="kr", v_result="vr",
        )  # fmt: skip
    return DecodeSite(
        step=0, q="q", q_batch_stride=64 * kv_heads, q_column=0, k="k", v="v", mask="m",
        mask_batch_stride=context, out="o", batch=batch, heads=4 * kv_heads, kv_heads=kv_heads,
        context=context, head_dim=16, scale=0.25, dtype="float16", append=a,
    )  # fmt: skip


def test_built_in_choice_splits_caches_from_512_slots(monkeypatch):
    """A cache of fewer than ``SPLIT_MIN_CONTEXT`` slots keeps the one-kernel form; one of
    ``SPLIT_MIN_CONTEXT`` to ``ONE_KERNEL_MAX_CONTEXT`` takes ``SHORT_SPLITS`` splits (measured
    at 512 slots: 8 of 64 slots); a longer one (SDPA before) enough splits to fill the GPU, no
    program walking more than ``ONE_KERNEL_MAX_CONTEXT`` slots, within ``MAX_SPLITS`` and the
    cache's blocks."""
    from aot.codegen import decode_attention as da

    monkeypatch.delenv(da.SPLIT_ENV, raising=False)
    assert da.split_setting() is None
    for context in (16, 160, 511):
        assert da.decode_splits(_site(context)) == 1, context
    for context in (512, 1000, 1024):
        assert da.decode_splits(_site(context)) == da.SHORT_SPLITS == 8, context
    partial, _, _ = da.render_split_decode_attention(_site(512), 8)
    assert partial.config["BLOCK_N"] == 64  # the form measured
    for context, batch, kv in (
        (1025, "1", 2),
        (2048, "1", 8),
        (4096, "8", 8),
        (32768, "1", 8),
        (32768, "s0", 32),
    ):
        splits = da.decode_splits(_site(context, batch, kv))
        blocks = -(-context // da.SPLIT_BLOCK_N)
        assert 2 <= splits <= min(da.MAX_SPLITS, blocks), (context, splits)
        assert -(-blocks // splits) * da.SPLIT_BLOCK_N <= da.ONE_KERNEL_MAX_CONTEXT, (context, splits)
    # few programs (batch 1, 2 KV heads): enough splits to fill the GPU, one block each at most
    assert da.decode_splits(_site(2048)) == 16


@pytest.mark.parametrize(
    "text, short, long",
    [("off", 1, None), ("4", 4, 4), (" 64 ", 32, 64), ("3", 3, 3), ("16", 16, 16)],
)
def test_the_environment_chooses_the_form(monkeypatch, text, short, long):
    """``AOTPACK_DECODE_SPLIT=off``: the one-kernel form, and SDPA past its limit (None);
    ``=N``: N splits, in smaller blocks where 128 slots make fewer than N, down to blocks of
    16 (512 slots: 32 at most)."""
    from aot.codegen import decode_attention as da

    monkeypatch.setenv(da.SPLIT_ENV, text)
    setting = da.split_setting()
    assert da.decode_splits(_site(512), setting) == short
    assert da.decode_splits(_site(4096), setting) == long
    assert da.decode_splits(_site(100), setting) == 1  # one block: nothing to split
    if isinstance(setting, int):  # N splits of whole blocks: 128 slots, halved until there are N
        partial, _, _ = da.render_split_decode_attention(_site(512), short)
        assert partial.config["BLOCK_N"] == {3: 128, 4: 128, 16: 32, 32: 16}[short]


@pytest.mark.parametrize("text", ["on", "1", "65", "-2", "2.5", "0"])
def test_a_bad_split_setting_is_refused(monkeypatch, text):
    from aot.codegen import decode_attention as da
    from aot.errors import CodegenError

    monkeypatch.setenv(da.SPLIT_ENV, text)
    with pytest.raises(CodegenError) as e:
        da.split_setting()
    assert str(e.value) == (
        f"AOTPACK_DECODE_SPLIT={text!r}: expected 'off' (the one-kernel decode attention; caches over "
        "1024 slots keep the library's SDPA) or a number of splits from 2 to 64; unset it for the "
        "built-in choice"
    )


@pytest.mark.parametrize("appends, splits, early", [(True, 4, True), (True, 3, False), (False, 4, False)])
def test_split_cache_loads_before_the_wait_only_where_this_kernel_appends(appends, splits, early):
    """The split form loads its block of the cache before the wait for the kernel before only
    where every program holds one block (as many splits as blocks) and the kernel appends the
    step's key and value itself: no step before writes the cache then (see ``loads_early``)."""
    from aot.codegen.decode_attention import render_split_decode_attention

    partial, combine, _ = render_split_decode_attention(_site(512, append=appends), splits)
    lines = partial.source.splitlines()
    wait = next(i for i, line in enumerate(lines) if "gdc_wait()" in line)
    load = next(i for i, line in enumerate(lines) if line.strip().startswith("k = tl.load(k_ptr"))
    assert (load < wait) == early, "\n".join(lines)
    stores = [line for line in lines if "tl.store(k_ptr" in line]
    assert len(stores) == appends and all("mask=put" in s for s in stores)
    if appends:  # one program stores slot pos: the one whose range holds it
        assert any("(slot >= lo) & (slot < hi)" in line for line in lines)
    assert "tl.store(out_ptr" not in partial.source and "tl.store(out_ptr" in combine.source


def test_the_one_kernel_split_lets_the_kernel_after_start_once_its_partial_is_counted():
    """Under dependent launch the split form in one kernel waits for the kernel before in its
    prologue, as every kernel does, but lets the kernel after start only after its arrival is
    counted (the two-kernel form's partials let theirs start at once); the last program then
    combines and zeroes its counter."""
    from aot.codegen.decode_attention_render import render_split_combined_decode_attention

    one, _, _ = render_split_combined_decode_attention(_site(512), 8, 4)
    lines = [line.strip() for line in one.source.splitlines()]
    wait = lines.index("tl.extra.cuda.gdc_wait()")
    launch = lines.index("tl.extra.cuda.gdc_launch_dependents()")
    arrive = next(
        i for i, line in enumerate(lines) if line.startswith("arrived = tl.atomic_add(count_ptr + pid")
    )
    last = lines.index(
        "if arrived == SPLITS - 1:  # the others' partials are stored: combine, then zero the counter"
    )
    assert lines.count("tl.extra.cuda.gdc_launch_dependents()") == 1
    assert wait < arrive < launch < last, lines
    assert lines[last + 1 :].count("tl.store(count_ptr + pid, 0)") == 1
    assert "cache_modifier='.cg'" in one.source  # the others' partials read from L2


def test_at_one_row_the_one_kernel_split_lets_the_kernel_after_start_before_its_wait():
    """With ``launch_first`` (the step after it does not touch the state), at one row (``B == 1``)
    the split form in one kernel lets the kernel after start before its wait, as the one-kernel
    form does; at more rows after its arrival is counted, as without. Each program lets it start
    once: the two launches are under opposite conditions."""
    from aot.codegen.decode_attention_render import LAUNCH_FIRST_ROWS, render_split_combined_decode_attention

    one, _, _ = render_split_combined_decode_attention(_site(512), 8, 4, launch_first=True)
    lines = [line.strip() for line in one.source.splitlines()]
    first, wait = lines.index(f"if {LAUNCH_FIRST_ROWS}:"), lines.index("tl.extra.cuda.gdc_wait()")
    arrive = next(
        i for i, line in enumerate(lines) if line.startswith("arrived = tl.atomic_add(count_ptr + pid")
    )
    later = lines.index(f"if not ({LAUNCH_FIRST_ROWS}):")
    launches = [i for i, line in enumerate(lines) if line == "tl.extra.cuda.gdc_launch_dependents()"]
    assert launches == [first + 1, later + 1] and first < wait < arrive < later, lines


@pytest.mark.slow
def test_a_long_cache_takes_the_split_form(tmp_path, monkeypatch):
    """A tiny Llama (4 query heads over 2 KV heads, at most 2 rows) with a 2048-slot cache, over
    the one-kernel form's 1024: its decode program runs no SDPA; each layer's attention is the
    split form in one kernel, writing the cache in place and the workspace the program declares,
    counting on 2 x 2 int32 counters the program keeps as scratch, standing for the cache writes,
    the RoPE kernels and the SDPA step. With ``AOTPACK_DECODE_COMBINE=separate`` it is the split
    form's two kernels: the partials (the cache and the workspace), standing for the cache
    writes, then the combine, standing for the rest. Every kernel of either, run by the
    interpreter at batch 2 (one row left-padded by whole splits), matches its reference, and the
    counters are zero after each launch. With ``AOTPACK_DECODE_SPLIT=off`` the same model keeps
    SDPA, as it does where the combine kernel fails to compile."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.codegen.decode_attention import COMBINE_ENV, SPLIT_ENV
    from aot.codegen.decode_sites import SDPA
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.schema import StepKind
    from aot.tracer import trace
    from tests.hf.test_causal_lm import tiny_llama

    def build():
        spec = causal_lm(tiny_llama(), max_batch=2, max_context=2048, name="t")
        return generate(trace(spec), ("sm_90",))

    def decode_programs(compiled):
        out = [p for p in (compiled.program, *compiled.program.variants) if p.inputs[0].spec.shape[1] == "1"]
        assert out
        return out

    def kinds_of(p):
        kernels = {k.id: k for k in p.kernels}
        assert not any(s.kind == StepKind.ATEN and s.target == SDPA for s in p.steps)
        return kernels, [
            kernels[s.target].config["kind"] if s.kind == StepKind.KERNEL else None for s in p.steps
        ]

    monkeypatch.delenv(SPLIT_ENV, raising=False)
    monkeypatch.delenv(COMBINE_ENV, raising=False)
    compiled = build()
    for p in decode_programs(compiled):
        kernels, kinds = kinds_of(p)
        at = [i for i, kind in enumerate(kinds) if kind == "decode_attention_split_combined"]
        assert len(at) == 1 and "decode_attention_combine" not in kinds, kinds
        step = p.steps[at[0]]
        assert set(step.in_place.values()) <= set(p.state) and len(step.in_place) == 2
        (counts,) = p.scratch
        assert p.buffers[counts].dtype == "int32" and p.buffers[counts].shape == ("4",), p.buffers[counts]
        assert counts in step_args(step) and counts not in step.outputs
        assert p.buffers[step.outputs[-1]].dtype == "float32"  # its workspace
        targets = [r.target for r in step.reference]
        assert targets.count("aten.index_put_.default") == 2 and targets[-1] == SDPA, targets
        assert kernels[step.target].config["SPLITS"] == 16
    bundle = tmp_path / "t.tpk"
    pack(compiled, bundle)
    checks = decode_kernel_checks(bundle, position=1500, padding=300)
    # the output, the keys' and the values' cache, and the counters left zeroed
    attention = [c for c in checks if c[0].startswith("decode_attention")]
    assert len(attention) == 4 * len(decode_programs(compiled)), checks
    assert sum(c[1] == counts for c in attention) == len(decode_programs(compiled)), checks
    assert all(ok for *_, ok in checks), [c for c in checks if not c[3]]

    monkeypatch.setenv(COMBINE_ENV, "separate")
    compiled = build()
    for p in decode_programs(compiled):
        kernels, kinds = kinds_of(p)
        at = [i for i, kind in enumerate(kinds) if kind == "decode_attention_split"]
        assert len(at) == 1 and kinds[at[0] + 1] == "decode_attention_combine", kinds
        assert not p.scratch
        partial, combine = p.steps[at[0]], p.steps[at[0] + 1]
        assert set(partial.in_place.values()) <= set(p.state) and len(partial.in_place) == 2
        assert p.buffers[partial.outputs[0]].dtype == "float32" and partial.outputs[0] in step_args(combine)
        # the partials stand for the cache writes (and the new keys' RoPE), the combine for the rest
        writes = [r.target for r in partial.reference]
        assert writes.count("aten.index_put_.default") == 2 and SDPA not in writes, writes
        assert set(partial.in_place) <= {o for r in partial.reference for o in r.outputs}
        targets = [r.target for r in combine.reference]
        assert targets[-1] == SDPA and "aten.index_put_.default" not in targets, targets
        assert kernels[partial.target].config["SPLITS"] == 16
    bundle = tmp_path / "t2.tpk"
    pack(compiled, bundle)
    checks = decode_kernel_checks(bundle, position=1500, padding=300)
    # the partials' cache writes against the two index_put_ steps (the workspace is the combine's
    # to stand for), the combine's output against the SDPA step
    attention = [c for c in checks if c[0].startswith("decode_attention")]
    partials = [c for c in attention if c[0].endswith("_split")]
    assert len(partials) == 2 * len(decode_programs(compiled)), checks  # the keys' cache and the values'
    combines = [c[0] for c in attention if c not in partials]
    assert combines == ["decode_attention_combine_g2_d16"] * len(decode_programs(compiled)), checks
    assert all(ok for *_, ok in checks), [c for c in checks if not c[3]]

    monkeypatch.setenv(SPLIT_ENV, "off")
    for p in build().program.variants:
        if p.inputs[0].spec.shape[1] == "1":
            assert any(s.kind == StepKind.ATEN and s.target == SDPA for s in p.steps)

    # the combine fails to compile: the site keeps SDPA, and the partial kernel goes too
    import aot.codegen as codegen

    compile_all = codegen.compile_kernels

    def combine_fails(rendered, archs, say, what="kernel"):
        results, failed, hits = compile_all(rendered, archs, say, what)
        failed.update(
            {k: "refused" for k, r in rendered.items() if r.name.startswith("decode_attention_combine")}
        )
        return results, failed, hits

    monkeypatch.delenv(SPLIT_ENV)
    monkeypatch.setattr(codegen, "compile_kernels", combine_fails)
    compiled = build()
    for p in (compiled.program, *compiled.program.variants):
        assert not any(k.config.get("kind", "").startswith("decode_attention") for k in p.kernels)
        if p.inputs[0].spec.shape[1] == "1":
            assert any(s.kind == StepKind.ATEN and s.target == SDPA for s in p.steps)
    assert not {kid for kid, _ in compiled.cubins} - {
        k.id for p in (compiled.program, *compiled.program.variants) for k in p.kernels
    }


def step_args(step) -> set[str]:
    return {a.name for a in step.args if hasattr(a, "name")}


def test_layers_alike_share_their_split_kernels():
    """Two sites alike but for their buffers (two layers) render the same two sources (one
    compile each), each with a workspace of its own for the memory planner."""
    from dataclasses import replace

    from aot.codegen.decode_attention import render_split_decode_attention

    one = render_split_decode_attention(_site(2048), 16)
    other = render_split_decode_attention(replace(_site(2048), out="o2", q="q2", k="k2", v="v2"), 16)
    assert [r.source for r in one[:2]] == [r.source for r in other[:2]]
    assert set(one[2]) != set(other[2]) and list(one[2].values()) == list(other[2].values())
