"""The default build's built-in tuning table (``aot.codegen.gemm_defaults``): a half-precision GEMM
at a bucket of one row runs a dot-free GEMV form on sm_90 GPUs without ``aotpack tune``; every
other site, bucket and arch keeps the library. The forms' numerics are the candidates' (checked in
Triton's interpreter by ``tests/codegen/test_gemm.py``); here: which sites, which buckets, and
that the bundle's table is what the loader accepts and applies only on its arch."""

from __future__ import annotations

import pytest

from aot.codegen.gemm_defaults import DEFAULT_ARCH, FORMS, LONG_K, default_form
from aot.tuning import LIBRARY, parse_tuning, tuned_plans


def test_the_rule_names_a_form_for_one_half_precision_row_only():
    assert default_form(1, 2048, "bfloat16") == "vec_1x2x1024"
    assert default_form(1, LONG_K, "float16") == "vec_1x2x1024"
    assert default_form(1, 8192, "bfloat16") == "vec_1x2x1024"
    assert default_form(1, 5632, "bfloat16") == "vec_1x2x1024"
    assert default_form(1, 768, "float16") == "vec_1x2x512"
    assert default_form(1, 3072, "float16") == "vec_1x1x512"
    for rows, dtype in [(2, "float16"), (8, "bfloat16"), (1, "float32")]:
        assert default_form(rows, 2048, dtype) is None
    assert {default_form(1, k, "float16") for k in (64, 1024, 2048, 3072, 4096, 16384)} == set(FORMS)


@pytest.fixture(scope="module")
def mlp_bundle(built):
    from aot.loader.bundle import open_bundle

    path = built("mlp", ("sm_80", "sm_90"))
    bundle = open_bundle(path)
    try:
        yield bundle
    finally:
        bundle.close()


def test_a_default_build_carries_the_table_for_its_one_row_buckets(mlp_bundle):
    """models/mlp.py (float16, batch 1..N): every GEMM site runs the default form at batch 1 (its
    ``_ln`` variant where a LayerNorm kernel made its A: the kernel goes into its prologue), the
    library at every other bucket; the table is recorded for sm_90 and parses as tune's do."""
    from aot.buckets import buckets_by_program
    from aot.schema import TUNING_PATH

    program = mlp_bundle.program()
    assert TUNING_PATH in mlp_bundle.manifest.members
    table = parse_tuning(mlp_bundle.read(TUNING_PATH), [program], buckets_by_program(mlp_bundle.manifest))
    assert table.arch == DEFAULT_ARCH and "built-in" in table.device
    sites = {s.id: s for s in program.alternatives}
    assert sites and {c.site for c in table.choices} == set(sites)
    for c in table.choices:
        assert c.sizes == {"batch": 1} and c.choice != LIBRARY
        form = default_form(1, sites[c.site].k, "float16")
        assert c.choice in (form, form + "_ln")
        layer_norm = program.steps[sites[c.site].library[0]].reference
        assert c.choice.endswith("_ln") == (bool(layer_norm) and "layer_norm" in layer_norm[-1].target)
        (cand,) = sites[c.site].candidates  # only the default form was compiled
        assert cand.name == c.choice and cand.buckets == ({"batch": 1},)


def test_the_table_changes_the_steps_on_its_arch_only(mlp_bundle):
    from aot.buckets import buckets_by_program
    from aot.schema import TUNING_PATH, StepKind

    program = mlp_bundle.program()
    table = parse_tuning(mlp_bundle.read(TUNING_PATH), [program], buckets_by_program(mlp_bundle.manifest))
    assert tuned_plans(table, 0, program, "sm_80") == {}
    plans = tuned_plans(table, 0, program, DEFAULT_ARCH)
    assert list(plans) == [(1,)]
    (steps,) = plans.values()
    kernels = {k.id: k for k in program.kernels}
    vec = [s for s in steps if s.kind == StepKind.KERNEL and kernels[s.target].name.startswith("gemm")]
    assert len(vec) == len(program.alternatives)
    assert not any(s.target == "aten.mm.default" or s.target == "aten.addmm.default" for s in steps)
    # each kernel stands for the library steps it replaced (what the CPU and verify run)
    assert all(s.reference for s in vec)


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
