"""The default build's built-in tuning table (``aot.codegen.gemm_defaults``): a half-precision GEMM
at a bucket of one row runs a dot-free GEMV form on sm_90 GPUs without ``aotpack tune``; every
other site, bucket and arch keeps the library. The forms' numerics are the candidates' (checked in
Triton's interpreter by ``tests/codegen/test_gemm.py``); here: which sites, which buckets, and
that the bundle's table is what the loader accepts and applies only on its arch."""

from __future__ import annotations

import pytest

from aot.codegen.gemm_defaults import DEFAULT_ARCH, FORMS, LONG_K, VOCAB_N, default_form, prologue_rows
from aot.tuning import LIBRARY, parse_tuning, tuned_plans


def test_the_rule_names_a_form_for_one_half_precision_row_only():
    assert default_form(1, 2048, "bfloat16") == "vec_1x2x1024"
    assert default_form(1, LONG_K, "float16") == "vec_1x2x1024"
    assert default_form(1, 8192, "bfloat16") == "vec_1x2x1024"
    assert default_form(1, 5632, "bfloat16") == "vec_1x2x1024"
    assert (
        default_form(1, 768, "float16") == "vec_1x2x1024"
    )  # one masked step of 1024, not 512 and a masked one
    assert default_form(1, 1024, "float16") == "vec_1x2x512"
    assert default_form(1, 3072, "float16") == "vec_1x1x512"
    for rows, dtype in [(2, "float16"), (8, "bfloat16"), (1, "float32")]:
        assert default_form(rows, 2048, dtype) is None  # N not known at few rows, float32 anywhere
    # a vocabulary head of short K (GPT-2's LM head): four rows of W per block; of long K as any site
    assert default_form(1, 768, "float16", 50257) == "vec_1x4x512"
    assert default_form(1, 768, "float16", VOCAB_N - 1) == "vec_1x2x1024"
    assert default_form(1, 2048, "bfloat16", 128256) == "vec_1x2x1024"
    shapes = [(k, 0) for k in (64, 1024, 2048, 3072, 4096, 16384)] + [(768, 50257)]
    assert {default_form(1, k, "float16", n) for k, n in shapes} == set(FORMS)


@pytest.fixture(scope="module")
def mlp_bundle(built):
    from aot.loader.bundle import open_bundle

    path = built("mlp", ("sm_80", "sm_90"))
    bundle = open_bundle(path)
    try:
        yield bundle
    finally:
        bundle.close()


def test_a_default_build_carries_the_table_for_its_one_and_few_row_buckets(mlp_bundle):
    """models/mlp.py (float16, batch 1..64, 8 MiB weights per site): every GEMM runs the default
    form at batch 1 (the up projection on four rows of W a block, ``PROLOGUE_ROWS``, as its
    ``_ln`` variant: the LayerNorm kernel goes into its prologue) and the few-row entry's form at batches 2-16 (the weights are small:
    ``gemv_16x32x128``, and at the down projection's N 1024 x K 4096 the swapped form in 8 K
    slices, ``fews_splitk8_16x64x64``), the 32-row swapped forms in K slices at 32 (``BUILT_IN_32``:
    K 1024 in 2 slices, K 4096 in 8). A block's down projection and the next block's LayerNorm
    and up projection are one site (``gemm_pairs``: its choice names both forms,
    ``first__second``; at 2-32 rows the down projection's reduce runs the LayerNorm). At 64 rows
    the last down projection (N 1024: few column tiles) runs the 64-row tile in 3 K slices
    (``MANY_ROWS`` "split"); the joined sites keep the library there, as their up projection
    (N 4096) does. The table is recorded for sm_90 and parses as tune's do."""
    from aot.buckets import buckets_by_program
    from aot.schema import TUNING_PATH

    program = mlp_bundle.program()
    assert TUNING_PATH in mlp_bundle.manifest.members
    table = parse_tuning(mlp_bundle.read(TUNING_PATH), [program], buckets_by_program(mlp_bundle.manifest))
    assert table.arch == DEFAULT_ARCH and "built-in" in table.device
    sites = {s.id: s for s in program.alternatives}
    assert sites and {c.site for c in table.choices} == set(sites)
    assert {c.sizes["batch"] for c in table.choices} == {1, 2, 4, 8, 16, 32, 64}
    (last,) = [c for c in table.choices if c.sizes["batch"] == 64]
    assert last.site == program.alternatives[-1].id  # the last block's down projection
    # the first three blocks' down projections, each with the next block's up projection
    joined = {c.site for c in table.choices if "__" in c.choice}
    assert len(joined) == 3 and all(("__" in c.choice) == (c.site in joined) for c in table.choices)
    for c in table.choices:
        assert c.choice != LIBRARY
        rows = c.sizes["batch"]
        for part in c.choice.split("__"):
            up = part.startswith(("vec_1x4x1024", "gemv_", "fews_splitk2_"))  # K 1024 (else 4096)
            k, n = (1024, 4096) if up else (4096, 1024)
            form = default_form(rows, k, "float16", n=n)
            if rows == 1:  # the up projection: four rows of W a block, its LayerNorm the prologue
                assert part == (prologue_rows(form, k) + "_ln" if up else form)
                assert part == ("vec_1x4x1024_ln" if up else "vec_1x2x1024")
            elif rows == 64:
                assert part == form.replace("splitk_", "splitk3_") == "tileme_splitk3_64x32x128"
            elif rows == 32:
                assert part == form.replace("splitk_", "splitk2_" if up else "splitk8_")
                assert form == "fews_splitk_32x64x64"
            else:
                assert part == ("gemv_16x32x128" if up else "fews_splitk8_16x64x64")
                assert part == form.replace("splitk_", "splitk8_")  # K 4096 in 8 slices
        # only the default forms were compiled, each for its buckets
        (cand,) = [k for k in sites[c.site].candidates if k.name == c.choice]
        assert c.sizes in cand.buckets
    assert sorted(len(s.candidates) for s in sites.values()) == [3, 3, 3, 3, 4]  # the last: 64 rows too


def test_the_table_changes_the_steps_on_its_arch_only(mlp_bundle):
    from aot.buckets import buckets_by_program
    from aot.schema import TUNING_PATH, StepKind

    program = mlp_bundle.program()
    table = parse_tuning(mlp_bundle.read(TUNING_PATH), [program], buckets_by_program(mlp_bundle.manifest))
    assert tuned_plans(table, 0, program, "sm_80") == {}
    plans = tuned_plans(table, 0, program, DEFAULT_ARCH)
    assert list(plans) == [(1,), (2,), (4,), (8,), (16,), (32,), (64,)]
    kernels = {k.id: k for k in program.kernels}
    sites = {s.id: s for s in program.alternatives}
    for (rows,), steps in plans.items():
        gemm = [s for s in steps if s.kind == StepKind.KERNEL and kernels[s.target].name.startswith("gemm")]
        # one kernel with reference steps per GEMM site; a joined pair's (``gemm_pairs``: its
        # name "first__second") two where their forms run apart (at one row), one where they
        # fuse (the first's reduce runs the norm); at 64 rows the last down projection's alone
        # (the rest keep cuBLAS)
        chosen = [
            next(c for c in sites[t.site].candidates if c.name == t.choice)
            for t in table.choices
            if t.sizes == {"batch": rows}
        ]
        fused = ("_reduce_norm", "_from_stats")
        expected = sum(
            2 if "__" in c.name and not any(kernels[x.target].name.endswith(fused) for x in c.steps) else 1
            for c in chosen
        )
        assert expected == (1 if rows == 64 else len(program.alternatives) + (3 if rows == 1 else 0))
        assert sum(bool(s.reference) for s in gemm) == expected
        # no cuBLAS call left at 1-32 rows (so a process serving them never loads it)
        assert (rows == 64) == any(s.target in ("aten.mm.default", "aten.addmm.default") for s in steps)
        # each site's kernels end with the one that stands for the library steps it replaced (a
        # split-K form's partial sums, a joined site's first GEMM and its reduce come before it)
        assert gemm[-1].reference and all(
            kernels[s.target].name.endswith(("_partial", "_reduce_norm")) or s.reference or nxt.reference
            for s, nxt in zip(gemm, gemm[1:])
        )


def test_no_table_without_sm_90(built):
    from aot.loader.bundle import open_bundle
    from aot.schema import TUNING_PATH

    compiled = built.compiled("mlp", ("sm_80",))
    assert compiled.tuning is None and not compiled.program.alternatives
    bundle = open_bundle(built("mlp", ("sm_80",)))
    try:
        assert TUNING_PATH not in bundle.manifest.members
    finally:
        bundle.close()


def test_a_default_build_runs_the_flash_forms_at_the_query_lengths_measured(built):
    """models/gpt.py (float16, head dim 64, causal SDPA without a mask): at every bucket of at most
    ``ATTENTION_MAX_T`` queries each attention site runs a Triton flash form in the built-in table
    (the 16-row form below ``ATTENTION_WIDE_T`` queries, the 64-row one from there), and the
    library's SDPA call at longer ones; the plan at such a bucket on sm_90 has no SDPA step left.
    The forms' numerics are the candidates' (``tests/codegen/test_attention_candidates.py``)."""
    from aot.buckets import bucket_sizes, buckets_by_program
    from aot.codegen.gemm_defaults import (
        ATTENTION_MAX_T,
        ATTENTION_SHORT,
        ATTENTION_WIDE,
        ATTENTION_WIDE_T,
        default_attention_form,
    )
    from aot.loader.bundle import open_bundle
    from aot.schema import TUNING_PATH
    from aot.tuning import ATTENTION_SITE

    bundle = open_bundle(built("gpt", ("sm_80", "sm_90")))
    try:
        program = bundle.program()
        table = parse_tuning(bundle.read(TUNING_PATH), [program], buckets_by_program(bundle.manifest))
        sizes_all = bucket_sizes(program, buckets_by_program(bundle.manifest)[0])
    finally:
        bundle.close()
    attention = [s for s in program.alternatives if s.id.startswith(ATTENTION_SITE)]
    assert len(attention) == 12  # one per layer
    chosen = {(c.site, c.sizes["batch"], c.sizes["seq"]): c.choice for c in table.choices}
    seqs = sorted({b["seq"] for b in sizes_all})
    assert min(seqs) < ATTENTION_WIDE_T and max(seqs) > ATTENTION_MAX_T  # every branch of the rule
    for site in attention:
        for sizes in sizes_all:
            seq = sizes["seq"]
            want = (
                None
                if seq > ATTENTION_MAX_T
                else ATTENTION_SHORT
                if seq < ATTENTION_WIDE_T
                else ATTENTION_WIDE
            )
            assert chosen.get((site.id, sizes["batch"], seq)) == want, (site.id, sizes)
    from dataclasses import replace

    from aot.codegen.flash import find_attention_sites
    from aot.tuning import bucket_key

    (found, *_) = find_attention_sites(program)
    assert default_attention_form(found, 1) == ATTENTION_SHORT
    assert default_attention_form(replace(found, dtype="bfloat16"), 1) == ATTENTION_SHORT
    assert (
        default_attention_form(replace(found, dtype="float32"), 1) is None
    )  # only measured in half precision
    assert default_attention_form(replace(found, head_dim=128), 64) is None  # nor past head dim 64
    short = next(b for b in sizes_all if b["seq"] == 1)
    steps = tuned_plans(table, 0, program, DEFAULT_ARCH)[bucket_key(program, short)]
    assert not any(s.target == "aten.scaled_dot_product_attention.default" for s in steps)
    assert tuned_plans(table, 0, program, "sm_80") == {}


def test_the_attention_entry_can_be_turned_off_for_measuring(monkeypatch, built):
    from aot.codegen.flash import find_attention_sites
    from aot.codegen.gemm_defaults import ATTENTION_ENV, default_attention_form
    from aot.errors import CodegenError

    (site, *_) = find_attention_sites(built.compiled("gpt", ("sm_80", "sm_90")).program)
    monkeypatch.setenv(ATTENTION_ENV, "off")
    assert default_attention_form(site, 1) is None
    monkeypatch.setenv(ATTENTION_ENV, "maybe")
    with pytest.raises(CodegenError, match=r"AOTPACK_DEFAULT_ATTENTION='maybe': expected 'on' or 'off'"):
        default_attention_form(site, 1)


def test_the_few_row_override_takes_tunes_tile_forms_at_2_to_16_rows(monkeypatch, built):
    """``AOTPACK_FEW_ROWS`` may name the tensor-core forms tune chooses among at few rows
    (``gemv_16x32x128``, ``splitk_16x64x128``): each runs at buckets of 2-16 rows only, the
    one-row form keeps batch 1, 32 rows the built-in entry's forms there (``BUILT_IN_32``), and
    64 ``MANY_ROWS``' (the down projections in K slices of the 64-row tile, the up the library)."""
    from aot.codegen import gemm_pairs, generate
    from aot.codegen.gemm_defaults import FEW_ROWS_ENV, FEW_ROWS_PROLOGUE_ENV

    monkeypatch.setenv(gemm_pairs.ENV, "off")  # each site its own forms (no joined pair)
    monkeypatch.setenv(FEW_ROWS_ENV, "gemv_16x32x128,splitk_16x64x128")
    monkeypatch.setenv(FEW_ROWS_PROLOGUE_ENV, "0")
    table = generate(built.traced("mlp"), ("sm_90",)).tuning
    by_batch: dict[int, set[str]] = {}
    for c in table.choices:
        by_batch.setdefault(c.sizes["batch"], set()).add(c.choice)
    assert by_batch.pop(1) == {"vec_1x4x1024_ln", "vec_1x2x1024"}
    assert by_batch.pop(32) == {"fews_splitk2_32x64x64", "fews_splitk8_32x64x64"}
    assert by_batch.pop(64) == {"tileme_splitk3_64x32x128"}
    assert set(by_batch) == {2, 4, 8, 16}  # the mlp's buckets of 2-16 rows
    assert all(forms == {"gemv_16x32x128", "splitk8_16x64x128"} for forms in by_batch.values())


def test_a_forms_stages_can_be_set_for_measuring(monkeypatch, built):
    """``AOTPACK_FORM_STAGES`` sets a form's pipeline stages at every site and bucket that runs it
    (the mlp at 2-16 rows runs ``gemv_16x32x128``, 6 stages of its own): the kernels of that form
    compile with the count given, the others with their own; a name that is no form, or a count
    outside 1-8, stops the build naming the variable."""
    from aot.codegen import generate
    from aot.codegen.gemm_defaults import FORM_STAGES_ENV
    from aot.codegen.gemm_forms import CONFIGS
    from aot.errors import CodegenError

    def stages(program) -> dict[str, set[int]]:
        found: dict[str, set[int]] = {}
        for k in program.kernels:
            if k.config.get("kind") == "gemm":
                found.setdefault(k.config["candidate"], set()).add(k.num_stages)
        return found

    own = next(c.num_stages for c in CONFIGS if c.name == "gemv_16x32x128")
    before = stages(generate(built.traced("mlp"), ("sm_90",)).program)
    assert before["gemv_16x32x128"] == {own}
    monkeypatch.setenv(FORM_STAGES_ENV, "gemv_16x32x128=3")
    after = stages(generate(built.traced("mlp"), ("sm_90",)).program)
    assert after.pop("gemv_16x32x128") == {3}
    before.pop("gemv_16x32x128")
    assert after == before  # every other form as it was
    for wrong in ("gemv_16x32x128=9", "gemv_16x32x128", "no_such_form=4", "gemv_16x32x128=x"):
        monkeypatch.setenv(FORM_STAGES_ENV, wrong)
        with pytest.raises(
            CodegenError, match=rf"{FORM_STAGES_ENV}='{wrong}': expected '<form>=<stages 1-8>"
        ):
            generate(built.traced("mlp"), ("sm_90",))
