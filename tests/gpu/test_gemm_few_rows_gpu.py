"""The few-row GEMM forms (``aot.codegen.gemm_defaults.FEW_ROWS``, off by default) on a GPU, at
Llama-3.2-1B's shapes (bench/decode.py's ``llama-3.2-1b``, bfloat16; 2 of its 16 layers), built by
default for this GPU's arch with the entry on (``AOTPACK_FEW_ROWS`` where set, else once with
``few_16x16x256`` and once with ``NEW``: the forms that load W's first K steps before the
dependent-launch wait, their ``_rms`` forms in one pass over A, bfloat16 being one-pass's dtype)
and batch buckets 1, 2 and 8:

- the decode plan at 2 and 8 rows runs the few-row forms at every GEMM (q/k/v and gate/up as
  their ``_rms`` forms, the RMSNorm kernels gone), as many kernels as at one row but for a split-K
  form's reduce kernel;
- ``aot.verify.device.verify``: every kernel of each bucket's plan against its reference steps on
  the GPU (bfloat16 tolerance), the whole program against the CPU path, the CUDA graph's replay
  against the launches.

    pytest -m gpu tests/gpu/test_gemm_few_rows_gpu.py
    AOTPACK_FEW_ROWS=few_16x32x256 pytest -m gpu tests/gpu/test_gemm_few_rows_gpu.py

Never run in CI (no GPU there).
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.test_gemm_norm_gpu import LAYERS, build_llama_1b, build_shaped, decode_plans, verified_kernels

pytestmark = pytest.mark.gpu

BATCHES = (2, 8)
NEW = "fewe_16x32x256,fewe_splitk_16x64x128,fewe_16x64x128"
FORMS = [os.environ["AOTPACK_FEW_ROWS"]] if os.environ.get("AOTPACK_FEW_ROWS") else ["few_16x16x256", NEW]


@pytest.fixture(scope="module", params=FORMS)
def llama_1b_few(tmp_path_factory, request):
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV

    path, compiled, arch = build_llama_1b(tmp_path_factory, (1, *BATCHES), {FEW_ROWS_ENV: request.param})
    return path, compiled, arch, tuple(request.param.split(","))


def test_decode_plan_runs_the_few_row_forms(llama_1b_few):
    _, compiled, arch, forms = llama_1b_few
    program, plans = decode_plans(compiled, arch)
    launches = {}
    for key, names in plans.items():
        launches[key] = sum(not n.endswith("_reduce") for n in names)  # a split-K form's reduce apart
        if key != (1,):
            assert sum(n.startswith("gemm_norm_") and n.endswith(forms) for n in names) == 2 * LAYERS
            if forms[0].startswith("fewe_"):  # the early-W forms' cubins wait under dependent launch
                early = [k for k in program.kernels if k.name in names]
                assert any(k.name.endswith(forms) and k.dependent_launch for k in early), key
    assert sorted(launches) == [(1,), *((b,) for b in BATCHES)]
    assert len(set(launches.values())) == 1, launches


def test_verify_passes_with_the_few_row_forms(llama_1b_few):
    path, _, _, forms = llama_1b_few
    few = {name for name in verified_kernels(path) if name.endswith(forms)}
    assert few, "no few-row form was checked"


@pytest.fixture(scope="module")
def llama_1b_built_in(tmp_path_factory):
    """Built with the built-in entry (no forms named): past 8 MiB the swapped forms at 2-16 rows,
    at every site at 17-32 rows."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    return build_llama_1b(tmp_path_factory, (1, *BATCHES, 32))


def test_the_built_in_entry_runs_the_swapped_forms_at_large_weights(llama_1b_built_in):
    """At 2 and 8 rows the decode plan runs the built-in entry's swapped forms
    (``gemm_defaults.BUILT_IN_LARGE``) at q/k/v (12 MiB, in K slices), gate/up (64 MiB) and down
    (32 MiB, split-K); at 32 rows (``BUILT_IN_32``) the 32-row swapped forms at q/k/v and o (in K
    slices), gate/up (whole), down (split-K) and the LM head (whole); each after the norm
    kernel where one feeds it, no cuBLAS call; and ``aot.verify.device.verify`` passes with them
    (every kernel against its reference steps on the GPU, bfloat16 tolerance)."""
    path, compiled, arch = llama_1b_built_in
    _, plans = decode_plans(compiled, arch)
    assert sorted(plans) == [(1,), (2,), (8,), (32,)]
    for key, names in plans.items():
        tile = "32x64x" if key == (32,) else "16x64x"
        sliced = [n for n in names if "_fews_splitk" in n and tile in n and n.endswith("_partial")]
        # at 2-16 rows joined with o's 16-row tile through its sums of squares (``gemm_stats``)
        gate_up = [
            n
            for n in names
            if n.startswith(("gemm_halves", "gemm_norm_halves"))
            and n.endswith((f"_fews_{tile}128", "_from_stats"))
        ]
        rows = 0 if key == (1,) else LAYERS
        assert len(gate_up) == rows, (key, names)
        if key == (32,):
            assert len(sliced) == 3 * LAYERS, names  # q/k/v, o, down
            assert sum(n.endswith("_fews_32x64x128") for n in names) == LAYERS + 1, names  # the LM head
        else:
            assert len(sliced) == 2 * rows, (key, names)  # q/k/v, down
    checked = verified_kernels(path)
    assert any("_32x64x" in n for n in checked) and any("_16x64x" in n for n in checked), checked


def test_a_stacked_gate_up_runs_whole_by_its_rows_and_verifies(tmp_path_factory):
    """The 0.58B Llama's shapes (``bench/decode.py``'s ``llama``: TinyLlama's 2048 -> 2 x 5632,
    float16; ``LAYERS`` layers) built by default: at 8 rows each layer's gate/up runs the whole
    swapped form (its 11264 rows of W are wide: ``gemm_defaults.BUILT_IN_LARGE``), not the
    K-sliced one (its RMSNorm applied from the o tile's sums of squares, ``_from_stats``:
    ``gemm_pairs.ROW_NORM_STATS``), and ``aot.verify.device.verify`` passes with it."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_shaped("llama", tmp_path_factory, (1, 8))
    names = decode_plans(compiled, arch)[1][(8,)]
    whole = [n for n in names if "halves_epilogue_fews_16x64x128" in n]
    assert len(whole) == LAYERS, names
    assert not any("halves" in n and "splitk" in n for n in names), names
    assert set(whole) <= verified_kernels(path)


def test_the_reduce_runs_the_next_norm_and_verifies(tmp_path_factory):
    """A default build (``aot.codegen.gemm_pairs``), Llama-3.2-1B's shapes at 1, 8 and 32 rows:
    where a split-K reduce precedes a norm kernel, the reduce runs the norm (the down
    projection's before the next layer's q/k/v at 8 and 32 rows; o's before gate/up at 32,
    where o runs in K slices) and that norm kernel goes; at one row the plan is as with
    ``AOTPACK_REDUCE_NORM=off``; ``aot.verify.device.verify`` passes with them. A joined pair's
    last kernel carries both sites' reference steps: verify checks the pair's output there (the
    kernel after the reduce that ran the norm) and the residual sum through the program's."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_llama_1b(tmp_path_factory, (1, 8, 32))
    _, plans = decode_plans(compiled, arch)
    joined = {key[0]: sum(n.endswith("_reduce_norm") for n in names) for key, names in plans.items()}
    assert joined == {1: 0, 8: LAYERS - 1, 32: 2 * LAYERS - 1}, joined
    norms = {
        key[0]: sum(n.startswith("fused_") and "pow_mean" in n for n in names) for key, names in plans.items()
    }
    # o's norm kernel gone at both: at 32 rows o's reduce runs it, at 8 o's tile and gate/up join
    # through the tile's sums of squares (``gemm_pairs.ROW_NORM_STATS``)
    assert norms[8] == norms[32], norms
    checked = verified_kernels(path)
    # what ends a joined pair at 8 rows (q/k/v's K-slice sum) and at 32 (gate/up's SiLU product)
    assert "gemm_mm_fews_splitk3_16x64x64_reduce" in checked, checked
    assert "gemm_halves_epilogue_fews_32x64x128" in checked, checked


def test_the_reduce_runs_the_next_layer_norm_and_verifies(tmp_path_factory):
    """GPT-2 small's shapes (``build_shaped``: two layers, bfloat16) at 1, 8 and 32 rows: the MLP
    down projection (fc2) runs in K slices at 8 and 32 rows, and its reduce runs the next layer's
    residual add + LayerNorm (``ln_1``) before q/k/v, so that kernel goes (one a layer but the
    last's, whose LayerNorm is ``ln_f``), as a default build joins them;
    ``aot.verify.device.verify`` passes with them."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    from aot.codegen.gemm_pairs import ENV

    path, compiled, arch = build_shaped("gpt2", tmp_path_factory, (1, 8, 32), {ENV: None})
    _, plans = decode_plans(compiled, arch)
    joined = {key[0]: sum(n.endswith("_reduce_norm") for n in names) for key, names in plans.items()}
    assert joined == {1: 0, 8: LAYERS - 1, 32: LAYERS - 1}, joined
    checked = verified_kernels(path)
    # what ends a joined pair (q/k/v's form after the reduce that ran ``ln_1``) at 8 and 32 rows
    assert {"gemm_addmm_gemv_16x32x128", "gemm_addmm_tile_64x32x128"} <= checked, checked


def test_the_tiles_of_33_to_128_rows_keep_the_join_and_verify(tmp_path_factory):
    """GPT-2 small's shapes (``build_shaped``: two layers, bfloat16) at 8 and 128 rows, built with
    ``AOTPACK_MANY_ROWS=short``: at 128 rows the tiles held to 33-128 rows
    (``gemm_defaults.MANY_ROWS``) at every site of K 768 but the q/k/v after fc2 (K 3072, the
    library there), which joins fc2 at 8 rows, where fc2's reduce runs ``ln_1``: a bucket where
    one of two joined sites keeps the library runs it at both (``gemm_pairs.join``), and the join
    stays; ``aot.verify.device.verify`` passes."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV, MANY_ROWS_ENV, many_row_tile
    from aot.codegen.gemm_pairs import ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_shaped(
        "gpt2", tmp_path_factory, (8, 128), {ENV: None, MANY_ROWS_ENV: "short"}
    )
    _, named = decode_plans(compiled, arch, library=True)  # fc2 and the q/k/v after it: the library
    plans = {key[0]: names for key, names in named.items()}
    tiles = [n for n in plans[128] if "_tilem" in n]  # tilem_ or tileme_
    # o and fc in both layers, the first layer's q/k/v (after the embedding, not a GEMM)
    assert len(tiles) == 2 * LAYERS + 1, plans[128]
    assert sum(n.endswith("_reduce_norm") for n in plans[8]) == LAYERS - 1, plans[8]
    # (``AOTPACK_MANY_ROWS_EARLY`` where set: its forms, W's first K step before the wait)
    # o and fc are one site (their 16-row tiles join through o's statistics at 8 rows,
    # ``gemm_pairs.TILE_STATS``): at 128 rows its candidate runs o's tile, ``ln_2``'s kernel and
    # fc's tile apart, each checked against its own site's steps (``gemm_pairs.Joined.steps``)
    o, fc = f"gemm_addmm_{many_row_tile(768)}", f"gemm_addmm_epilogue_{many_row_tile(3072)}"
    assert sum(n == o for n in plans[128]) == LAYERS, plans[128]
    assert {o, fc} <= verified_kernels(path)


def test_the_sliced_tiles_of_33_to_128_rows_run_the_next_layer_norm_and_verify(tmp_path_factory):
    """GPT-2 small's shapes (two layers, bfloat16) at 8 and 128 rows, a default build
    (``AOTPACK_MANY_ROWS`` "split"): at 128 rows the first layer's fc2 (K 3072, N 768) runs the
    64-row tile in K slices and its reduce the next layer's ``ln_1`` (that LayerNorm kernel gone),
    joined with that layer's q/k/v tile; the last fc2 in K slices too, its reduce a plain one
    (``ln_f``'s kernel before the vocabulary head, the library's). ``aot.verify.device.verify``
    passes: a split-K partial and a joined pair's reduce are checked through the kernel that ends
    them (``verify.device``), here the last fc2's plain reduce and the q/k/v tile after the
    joined reduce."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV, MANY_ROWS_ENV, many_row_tile
    from aot.codegen.gemm_pairs import ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_shaped("gpt2", tmp_path_factory, (8, 128), {ENV: None, MANY_ROWS_ENV: None})
    _, named = decode_plans(compiled, arch, library=True)  # the vocabulary head: the library
    plans = {key[0]: names for key, names in named.items()}
    sliced = many_row_tile(768, sliced=True).replace("splitk", "splitk4")  # 24 column tiles x 4 slices
    assert sum(n == f"gemm_addmm_{sliced}_partial" for n in plans[128]) == LAYERS, plans[128]
    assert sum(n == f"gemm_addmm_{sliced}_reduce_norm" for n in plans[128]) == LAYERS - 1, plans[128]
    # the first ln_1, every ln_2 and ln_f: the other ln_1s run in the reduces
    assert sum(n.endswith("_layer_norm") and not n.startswith("gemm_") for n in plans[128]) == LAYERS + 2
    checked = verified_kernels(path)
    assert {f"gemm_addmm_{sliced}_reduce", f"gemm_addmm_{many_row_tile(2304)}"} <= checked, checked


@pytest.mark.parametrize("mode", ["on", None])
def test_tiles_joined_through_their_row_statistics_verify(mode, tmp_path_factory):
    """GPT-2 small's shapes (two layers, bfloat16) at 8 and 128 rows with ``AOTPACK_TILE_STATS=on``
    (by default, None: "few", ``gemm_pairs.TILE_STATS``, only at 8 rows, the 16-row tiles; at 128
    the LayerNorm kernels stay): the o projection's tile writes the residual sum,
    the sum times ``ln_2``'s scale and its rows' statistics per column tile; fc's tile multiplies
    the scaled rows and applies ``ln_2`` after its products with the build's column sums
    (``norm_sums``), and every ``ln_2`` kernel goes. ``aot.verify.device.verify`` passes, fc's
    tile (which ends the pair) among the kernels it checked, at both buckets."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV, MANY_ROWS_ENV, many_row_tile
    from aot.codegen.gemm_pairs import ENV, TILE_STATS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_shaped(
        "gpt2", tmp_path_factory, (8, 128), {ENV: None, MANY_ROWS_ENV: None, TILE_STATS_ENV: mode}
    )
    _, named = decode_plans(compiled, arch, library=True)  # the vocabulary head: the library
    plans = {key[0]: names for key, names in named.items()}
    if mode is None:
        assert not any(n.endswith(("_stats", "_from_stats")) for n in plans[128]), plans[128]
        assert sum(n.endswith("_from_stats") for n in plans[8]) == LAYERS, plans[8]
        checked = verified_kernels(path)
        assert any(n.endswith("_from_stats") and "16x" in n for n in checked), checked
        return
    fc = f"gemm_ln_addmm_epilogue_{many_row_tile(3072)}_from_stats"  # GELU (gelu_new) its epilogue
    assert sum(n == f"gemm_addmm_{many_row_tile(768)}_stats" for n in plans[128]) == LAYERS, plans[128]
    assert sum(n == fc for n in plans[128]) == LAYERS, plans[128]
    # the first ln_1 and ln_f: the other ln_1s run in the fc2 reduces, every ln_2 in fc's tile
    assert sum(n.endswith("_layer_norm") and not n.startswith("gemm_") for n in plans[128]) == 2
    assert sum(n.endswith("_from_stats") for n in plans[8]) == LAYERS, plans[8]
    checked = verified_kernels(path)
    assert fc in checked and any(n.endswith("_from_stats") and "16x" in n for n in checked), checked


def test_o_and_gate_up_join_through_the_o_tiles_sums_of_squares_and_verify(tmp_path_factory):
    """Llama-3.2-1B's shapes (two layers, bfloat16) built by default at 1 and 8 rows: at 8 rows
    each layer's o projection (8 MiB, the 16-row tile) writes the residual sum, the sum times the
    RMSNorm's weight and each row's sum of squares per column tile, and gate/up (the swapped form,
    SiLU(gate) * up in its epilogue) reads the scaled rows and applies 1/rms after its products
    (``gemm_pairs.ROW_NORM_STATS``, on by default since 2026-12-04; ``gemm_pairs.TILE_STATS``
    "few", ``gemm_stats``): the RMSNorm kernel before gate/up goes. ``aot.verify.device.verify``
    passes, gate/up's joined form among the kernels it checked (H200, 2026-12-04: passed)."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV
    from aot.codegen.gemm_pairs import ROW_NORM_STATS_ENV, TILE_STATS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_shaped(
        "llama-3.2-1b", tmp_path_factory, (1, 8), {TILE_STATS_ENV: None, ROW_NORM_STATS_ENV: None}
    )
    names = decode_plans(compiled, arch)[1][(8,)]
    joined = "gemm_norm_halves_epilogue_fews_16x64x128_from_stats"
    assert sum(n == "gemm_mm_gemv_16x32x128_stats" for n in names) == LAYERS, names
    assert sum(n == joined for n in names) == LAYERS, names
    assert joined in verified_kernels(path)


@pytest.mark.parametrize("model", ["qwen3-0.6b", "gemma-2-2b", "phi-3-mini", "olmo-2-1b"])
def test_the_default_forms_verify_at_8_rows_on_other_architectures(model, tmp_path_factory):
    """The decode bench's other bfloat16 models (Qwen3's per-head norms, Gemma 2's post-norms and
    capped scores, Phi-3's fused q/k/v and gate/up, OLMo 2's post-norms; ``LAYERS`` layers each),
    built by default at 1 and 8 rows, where the joins of ``gemm_pairs`` (the reduce that runs
    the next norm, the RMSNorm statistics join) take what their structure allows:
    ``aot.verify.device.verify`` passes, with no library GEMM in either plan."""
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV

    if os.environ.get(FEW_ROWS_ENV):
        pytest.skip(f"{FEW_ROWS_ENV} names forms: the built-in entry is not in effect")
    path, compiled, arch = build_shaped(model, tmp_path_factory, (1, 8))
    _, plans = decode_plans(compiled, arch)
    assert sorted(plans) == [(1,), (8,)]
    checked = verified_kernels(path)
    assert any(n.startswith("gemm_") for n in checked), checked
