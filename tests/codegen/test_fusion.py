"""Fusion decisions and the kernel-step contract the GPU launcher relies on."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from aot import schema
from aot.codegen import generate
from aot.codegen.classify import VIEW_OPS, returns_view
from aot.loader.bundle import open_bundle
from aot.program import buffers_in
from aot.schema import Buf
from aot.symexpr import compile_expr

SLOW = pytest.mark.slow  # building GPT-2-small, ResNet-18 or the d-1024 MLP takes tens of seconds
EXAMPLES = (*(pytest.param(n, marks=SLOW) for n in ("mlp", "gpt", "cnn")), "branchy")


def program_of(path):
    b = open_bundle(path)
    try:
        return b.program(), b.manifest
    finally:
        b.close()


def kernel_steps(program):
    return [s for s in program.steps if s.kind == "kernel"]


@SLOW
def test_gpt_block_fuses_into_two_kernels_per_layer(built):
    program, manifest = program_of(built("gpt"))
    steps = kernel_steps(program)
    # per layer: residual add + ln_2, residual add + next ln_1 (GELU rides in the fc matmul's
    # cuBLASLt epilogue); plus embeddings add + ln_1 of layer 0 (reading the position table in
    # place), the last residual add + ln_f, and the token lookup's gather kernel
    assert len(steps) == 2 * 12 + 2
    # each distinct kernel compiled once (the program also holds the default GEMV forms its tuning
    # plans launch on sm_90: aot.codegen.gemm_defaults)
    assert len({s.target for s in steps}) == 4
    assert Counter(s.target for s in steps).most_common(1)[0][1] == 2 * 12 - 1
    fused = Counter(r.target for s in steps for r in s.reference)
    assert fused["aten.native_layer_norm.default"] == 2 * 12 + 1
    assert fused["aten.add.Tensor"] == 2 * 12 + 1
    assert fused["aten.embedding.default"] == 1
    left = Counter(s.target for s in program.steps if s.kind == "aten")
    for op in (
        "aten.native_layer_norm.default",
        "aten.gelu.default",
        "aten.add.Tensor",
        "aten.embedding.default",
        "aten.arange.start_step",
    ):
        assert left[op] == 0, f"{op} left as a library call"
    assert left["aten.addmm.default"] == 3 * 12
    assert left["aten._addmm_activation.default"] == 12  # fc + bias + tanh-GELU in one library call
    assert left["aten.scaled_dot_product_attention.default"] == 12
    assert manifest.stats.kernel_steps == 26
    assert manifest.stats.activations_folded == 12
    cubins = [n for n in manifest.members if n.endswith(".cubin")]
    assert sorted(cubins) == sorted(
        schema.KERNEL_CUBIN_FORMAT.format(kernel=k.id, arch=a)
        for k in program.kernels
        for a in manifest.environment.archs  # a bundle of two archs: tests/loader/test_driver.py
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_models_fuse_without_fallbacks(built, name):
    program, manifest = program_of(built(name))
    assert manifest.stats.fallbacks == 0
    assert manifest.stats.unfused_ops == 0
    assert kernel_steps(program)
    # every pointwise/normalization op of the examples ends up inside a kernel
    left = {s.target for s in program.steps if s.kind == "aten"}
    for op in (
        "aten.relu.default",
        "aten.gelu.default",
        "aten.native_layer_norm.default",
        "aten._native_batch_norm_legit_no_training.default",
        "aten.mean.dim",
        "aten.mul.Tensor",
    ):
        assert op not in left, f"{name}: {op} stayed a library call"
    if name == "cnn":  # no ATen kernel left, and no cuBLAS: cuDNN's convolutions only (the small
        # classifier head is a Triton kernel, codegen/gemm.small_gemm_kernels)
        assert left == {"aten.convolution.default"}, left


@pytest.mark.parametrize("name", EXAMPLES)
def test_kernel_steps_follow_the_launcher_contract(built, name):
    program, manifest = program_of(built(name))
    kernels = {k.id: k for k in program.kernels}
    ranges = {g.name: (g.min, g.max) for g in manifest.guards.symbols}
    # who produces each buffer, over the CPU path (kernel steps expanded to their references)
    producer = {}
    for s in program.steps:
        for r in s.reference if s.kind == "kernel" else (s,):
            for o in r.outputs:
                if o is not None:
                    producer.setdefault(o, r.target)
    roots = {i.name for i in program.inputs} | {w.name for w in program.weights}
    later_reads: Counter = Counter()
    for s in program.steps:
        later_reads.update(_bufs(s.args) + _bufs(list(s.kwargs.values())))
    for k in program.kernels:
        assert re.fullmatch(r"[a-z0-9_]{1,80}", k.id)
        assert k.name.isidentifier() and f"def {k.name}(" in k.source
        assert k.archs == manifest.environment.archs and set(k.shared) == set(k.archs)
        assert k.scratch_params == 2
        assert k.config["global_scratch_size"] == 0 and k.config["profile_scratch_size"] == 0
        assert k.config["heuristic"] and k.config["kind"] in (
            "pointwise",
            "reduction-single",
            "reduction-loop",
            "gather",  # an embedding lookup (aot.codegen.embeddings)
            "pool",  # a max pool (aot.codegen.pooling)
            "gemm",  # a small head (aot.codegen.gemm.small_gemm_kernels)
            "attention",  # flash attention, on by default in float16 (aot.codegen.flash)
        )
        assert {p.kind for p in k.params} <= {"ptr", "i32", "i64"}
        compile_expr(k.bytes_moved)
    for s in kernel_steps(program):
        k = kernels[s.target]
        assert s.kwargs == {} and len(s.args) == len(k.params)
        assert 1 <= len(s.grid) <= 3
        for g in s.grid:
            assert compile_expr(g).symbols <= set(ranges)
        ptrs = []
        for a, p in zip(s.args, k.params):
            if p.kind == "ptr":
                name = a.name
                ptrs.append(name)
                assert program.buffers.get(name, None) is not None or name in roots
                # a GEMM kernel reads its A where the program left it (the launcher lays out a
                # view that is not in the kernel's order); fused kernels fold their views in
                if name not in roots and name not in s.outputs and k.config["kind"] != "gemm":
                    target = producer[name]
                    assert target not in VIEW_OPS and not returns_view(target), (
                        f"{k.name} reads {name}, the result of view {target}"
                    )
                spec = (
                    program.buffers[name]
                    if name in program.buffers
                    else next(t.spec for t in program.inputs + program.weights if t.name == name)
                )
                assert p.dtype == spec.dtype
            else:  # i32 unless the dim range (or the buffers it sizes) can pass 2**31
                hi = compile_expr(a.text)({n: r[1] for n, r in ranges.items()})
                index = k.config["index"] if "index" in k.config else k.params[-1].kind  # a GEMM's: M's
                assert p.kind == index and (hi < 2**31 or p.kind == "i64")
        assert set(s.outputs) <= set(ptrs)
        for o in s.outputs:  # only buffers used outside the kernel are materialized
            assert later_reads[o] > 0 or o in program.outputs, f"{k.name} materializes internal {o}"
        inside = {o for r in s.reference for o in r.outputs if o is not None}
        for o in inside - set(s.outputs):
            assert later_reads[o] == 0 and o not in program.outputs, f"{o} is needed but not written"


def _bufs(value) -> list[str]:
    return list(buffers_in(value))


def test_unknown_op_stays_a_library_call(pattern):
    _, compiled, _, _, messages = pattern("unknown")
    steps = compiled.program.steps
    assert [s.kind for s in steps] == ["kernel", "aten", "kernel"]
    assert steps[1].target == "aten.cumsum.default"
    assert compiled.stats.fallbacks == 0


def test_views_fold_into_kernels_without_copies(pattern):
    _, compiled, _, _, _ = pattern("views")
    steps = compiled.program.steps
    assert all(s.kind == "kernel" for s in steps), [s.target for s in steps if s.kind != "kernel"]
    for s in steps:
        for a in s.args:
            if isinstance(a, Buf) and a.name not in s.outputs:
                assert a.name == "x"  # every kernel reads the input itself, never a view of it


def test_reductions_fuse_with_prologue_and_epilogue(pattern):
    _, compiled, _, _, _ = pattern("norms")
    steps = kernel_steps(compiled.program)
    big = max(steps, key=lambda s: len(s.reference))
    ops = {r.target for r in big.reference}
    # residual add, layer norm, RMS norm (pow/mean/rsqrt) and var_mean in one kernel
    assert {
        "aten.add.Tensor",
        "aten.native_layer_norm.default",
        "aten.pow.Tensor_Scalar",
        "aten.mean.dim",
        "aten.rsqrt.default",
        "aten.var_mean.correction",
    } <= ops
    _, looped, _, _, _ = pattern("looped")
    (k,) = looped.program.kernels
    assert k.config["kind"] == "reduction-loop"
    _, soft, _, _, _ = pattern("softmax")
    kinds = {k.config["kind"] for k in soft.program.kernels}
    assert kinds == {"reduction-single"}
    masked = next(s for s in kernel_steps(soft.program) if any("arange" in r.target for r in s.reference))
    assert {"aten.where.self", "aten.ge.Tensor", "aten._softmax.default"} <= {
        r.target for r in masked.reference
    }


def test_large_dim_ranges_index_with_int64(pattern):
    _, compiled, _, _, _ = pattern("big")
    assert len(compiled.program.kernels) == 2
    for k in compiled.program.kernels:
        assert k.config["index"] == "i64"
        assert [p.kind for p in k.params if p.kind != "ptr"] == ["i64"]
        assert "tl.program_id(0).to(tl.int64)" in k.source
    _, small, _, _, _ = pattern("pointwise")
    assert {k.config["index"] for k in small.program.kernels} == {"i32"}


def test_no_fuse_keeps_the_aten_program(pattern):
    traced, _, _, _, _ = pattern("unknown")
    plain = generate(traced, ("sm_90",), fuse=False)
    assert plain.program == traced.program and not plain.cubins


def test_a_norm_over_strided_channels_takes_wide_row_tiles(pattern):
    """LayerNorm over the channels of NCHW (ConvNeXt): each channel sits 120 elements from the
    next, consecutive rows (positions) are adjacent, so a program takes 64 rows and its loads read
    64 adjacent elements per channel; a norm over contiguous elements keeps the 1024-element tile
    (``codegen.launch``). The interpreter test checks the kernels' values."""
    from aot.codegen.launch import STRIDED_TILE

    compiled = pattern("channel_norm")[1]
    norm = next(k for k in compiled.program.kernels if "layer_norm" in k.name)
    assert "ROWS = tl.constexpr(64)" in norm.source and "BLOCK_R = tl.constexpr(32)" in norm.source
    assert 64 * 32 <= STRIDED_TILE
    plain = next(k for k in pattern("norms")[1].program.kernels if "layer_norm" in k.name)
    assert "ROWS = tl.constexpr(16)" in plain.source and "BLOCK_R = tl.constexpr(64)" in plain.source


def test_a_pointwise_group_that_reads_transposed_is_tiled(pattern):
    """``y + x`` with y read back in NHWC order while the output is NCHW: a flat index would read
    y 24 elements apart from lane to lane, so the kernel runs 64 x 64 tiles on a 2-D grid (rows:
    channels of each image; columns: its 120 positions), y read down the rows, x and the output
    along them. Pointwise groups that read nothing transposed keep the flat index (the example
    models' goldens)."""
    compiled = pattern("channel_norm")[1]
    add = next(k for k in compiled.program.kernels if k.name == "fused_add")
    step = next(s for s in compiled.program.steps if s.target == add.id)
    assert step.grid == ("(24*batch + 63)//64", "2")
    assert "c = tl.program_id(1) * BLOCK_R" in add.source
    assert "tl.load(in0 + (c * 24 + (r % 24) + (r // 24) * 2880)" in add.source  # down the rows
    assert "tl.store(out0 + (c + r * 120)" in add.source
    flat = next(k for k in pattern("pointwise")[1].program.kernels)
    assert "x = tl.program_id(0) * BLOCK" in flat.source
