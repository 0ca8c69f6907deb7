"""The grouped GEMM kernel of Mixture-of-Experts layers (``aot.codegen.grouped_gemm``), run by
Triton's interpreter on the CPU against a per-expert loop of float64 matmuls on the same inputs:
experts that get no rows, one expert taking every row, row counts, K and N that are no multiple of
their blocks, weights stored [E, N, K] (transformers' layout, read transposed) and [E, K, N].
Offsets that are no valid grouping (decreasing, past the rows) read nothing outside the operands
and still write every output row (the last group ends at the last row). Row tiles of 16, 32 and 64.
Rows gathered from the tokens by an index (the ``aten.index`` step folded into the kernel), an
index outside the tokens reading the nearest token's row. Tolerances: float32 1e-4, float16 2e-2, each absolute plus
relative to the largest output (the output is rounded to float16 once); bfloat16 is checked on the
GPU only (Triton's interpreter computes ``tl.dot`` of bfloat16 operands wrongly)."""

from __future__ import annotations

import json

import pytest

from tests.codegen.conftest import interpreted_json

# (name, dtype, rows S, K, N, experts, transposed, group sizes or None for random routing,
#  offsets given as they are (no grouping), row tile, rows gathered from T tokens (0: given as rows;
#  a negative T: some indices outside the tokens))
CASES = [
    ("decode_fp32", "float32", 6, 32, 64, 4, True, [2, 0, 3, 1], False, 16, 0),
    ("one_expert_takes_all_fp32", "float32", 37, 40, 72, 5, True, [0, 0, 37, 0, 0], False, 16, 0),
    ("prefill_odd_fp32", "float32", 83, 48, 100, 8, False, None, False, 32, 0),
    ("prefill_fp16", "float16", 70, 64, 96, 6, True, None, False, 64, 0),
    ("hostile_offsets_fp32", "float32", 20, 32, 64, 4, True, [9, 3, 40, -5], True, 16, 0),
    ("gathered_fp32", "float32", 26, 32, 64, 5, True, None, False, 16, 13),
    ("gathered_fp16", "float16", 70, 64, 96, 6, True, None, False, 32, 35),
    ("hostile_gather_fp32", "float32", 12, 32, 64, 3, True, None, False, 16, -6),
]

SCRIPT = r"""
import importlib.util, json, tempfile
import torch
from aot.codegen.grouped_gemm import GroupedSite, render_grouped_gemm

out = {}
for name, dtype, S, K, N, E, transposed, groups, raw, block, tokens in CASES:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    dt = getattr(torch, dtype)
    if groups is None:
        ids = torch.randint(0, E, (S,), generator=gen).sort().values
        groups = torch.bincount(ids, minlength=E).tolist()
    offsets = torch.tensor(groups if raw else torch.tensor(groups).cumsum(0).tolist(), dtype=torch.int32)
    T = abs(tokens)
    if T:
        source = torch.randn(T, K, generator=gen).to(dt)
        index = torch.randint(0, T, (S,), generator=gen)
        if tokens < 0:
            index[::3] = torch.tensor([-1, T, 1 << 40, -(1 << 40)]).repeat(S)[: len(index[::3])]
        x = source[index.clamp(0, T - 1)]  # the rows the kernel reads: an index outside, the nearest
    else:
        x = torch.randn(S, K, generator=gen).to(dt)
    w = torch.randn(E, N, K, generator=gen).to(dt) if transposed else torch.randn(E, K, N, generator=gen).to(dt)
    stacked = w.transpose(1, 2) if transposed else w  # [E, K, N]
    gather = dict(gather_step=1, source="src", index="idx", t=str(T)) if T else {}
    site = GroupedSite(step=0, rows="x", weights="w", offsets="o", out="y", s=str(S), k=K, n=N,
                       experts=E, transposed=transposed, dtype=dtype, **gather)
    r = render_grouped_gemm(site, block)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(r.source)
    spec = importlib.util.spec_from_file_location(r.name, f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    y = torch.full((S, N), float("nan"), dtype=dt)
    grid = ((S + block - 1) // block + E, int(r.grid[1]))
    rows = (source, index) if T else (x,)
    sizes = (S, T) if T else (S,)
    getattr(module, r.name)[grid](*rows, w.contiguous(), offsets, y, *sizes, num_warps=r.num_warps)
    # the reference: the offsets clamped as the kernel documents, a float64 matmul per group
    ref = torch.zeros(S, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        end = S if e == E - 1 else min(max(end, start), S)
        ref[start:end] = x[start:end].double() @ stacked[e].double()
        start = end
    err = (y.double() - ref).abs()
    out[name] = {"max_err": float(err.max()), "ref_max": float(ref.abs().max()), "nan": bool(y.isnan().any()),
                 "grid": list(r.grid)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    script = SCRIPT.replace("CASES", json.dumps(CASES).replace("false", "False").replace("true", "True"))
    script = script.replace("null", "None")
    return interpreted_json(script)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_grouped_gemm_matches_a_matmul_per_expert(interpreted, case):
    name, dtype = case[0], case[1]
    got = interpreted[name]
    assert not got["nan"], f"{name}: unwritten or NaN outputs"
    tol = 1e-4 if dtype == "float32" else 2e-2  # float16
    assert got["max_err"] <= tol * (1 + got["ref_max"]), got
    block, experts = case[-2], case[5]
    assert got["grid"][0] == f"({case[2]} + {block - 1})//{block} + {experts}"


def test_the_row_tile_follows_the_rows_per_expert_at_the_largest_size():
    from aot.codegen.grouped_gemm import GroupedSite, block_m

    def site(s: str, experts: int) -> GroupedSite:
        return GroupedSite(0, "x", "w", "o", "y", s, 32, 64, experts, True, "float32")

    assert block_m(site("2*batch", 8), {"batch": (1, 8)}) == 16  # decode: 16 rows over 8 experts
    assert block_m(site("8*batch*seq", 128), {"batch": (1, 2), "seq": (1, 256)}) == 32
    assert block_m(site("2*batch*seq", 8), {"batch": (1, 8), "seq": (1, 2048)}) == 64


def test_sites_need_a_grouped_layout_they_can_read():
    """A ``_grouped_mm`` over a [S, K] buffer, a permuted [E, N, K] weight and int32 offsets is a
    site read transposed; a bias, a weight view other than the last two dims swapped, or int64
    offsets keep the library step."""
    from aot.codegen.grouped_gemm import GROUPED_MM, find_grouped_sites
    from aot.schema import Buf, NamedTensor, Program, Step, StepKind, TensorSpec

    def program(perm=(0, 2, 1), offsets_dtype="int32", extra=()):
        buffers = {
            "x": TensorSpec("float32", ("3*batch", "32")),
            "w": TensorSpec("float32", ("4", "64", "32")),
            "wt": TensorSpec("float32", tuple(("4", "64", "32")[p] for p in perm)),
            "offs": TensorSpec(offsets_dtype, ("4",)),
            "y": TensorSpec("float32", ("3*batch", "64")),
        }
        steps = (
            Step(StepKind.ATEN, "aten.permute.default", (Buf("w"), list(perm)), {}, ("wt",)),
            Step(StepKind.ATEN, GROUPED_MM, (Buf("x"), Buf("wt"), Buf("offs"), *extra), {}, ("y",)),
        )
        return Program(
            inputs=(NamedTensor("x", buffers["x"]), NamedTensor("offs", buffers["offs"])),
            weights=(NamedTensor("w", buffers["w"]),),
            steps=steps,
            outputs=("y",),
            buffers=buffers,
            symbols=(),
        )

    (site,) = find_grouped_sites(program())
    assert (site.rows, site.weights, site.offsets, site.out, site.s) == ("x", "w", "offs", "y", "3*batch")
    assert (site.k, site.n, site.experts, site.transposed) == (32, 64, 4, True)
    assert find_grouped_sites(program(perm=(1, 0, 2))) == []
    assert find_grouped_sites(program(offsets_dtype="int64")) == []
    assert find_grouped_sites(program(extra=(Buf("y"),))) == []
