"""Library-free bundles run the default build's one-row GEMV forms (``aot.codegen.library_free``):
at a bucket of one row each GEMM site runs the form the built-in table names
(``aot.codegen.gemm_defaults``: ``vec_*``, its ``_ln``/``_rms`` variant taking the norm kernel
before it into its prologue), a tile form at every other bucket; the choice is the bundle's
``tuning.json`` for sm_90, and the runtime without torch applies it through the torch loader's
``aot.tuning.tuned_plans``, so both run the same kernels at every bucket. And the runtime's memory:
the outputs' last computation runs after the graph into the caller's memory
(``aot.program.output_tail``), so the arena never holds the logits.

``lm_head.py`` (a residual Linear, LayerNorm, a 512-wide head, float16) is built with two forms
compiled (the tile form the library-free program takes and the one-row form), so the default run
stays cheap; the slow tests build models/mlp.py with every form, and run ``lm_head.py``'s kernels
through the runtime in Triton's interpreter against eager PyTorch (``aot.dtypes.TOLERANCE``).
``tests/runtime/test_gpu_one_row.py`` runs the same comparisons on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aot.schema import StepKind

HERE = Path(__file__).resolve().parent
FORMS = ("tile_16x64x128", "vec_1x2x512")  # what the cheap build compiles: the library-free tile, the GEMV


def build_library_free(model: Path, out: Path, forms: tuple[str, ...] | None = None) -> Path:
    """``model`` built ``--library-free`` for sm_90 into ``out``; ``forms``: only these candidate
    configs compiled (None: every one, as ``aotpack build --library-free``)."""
    from aot.codegen import gemm_render, generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    saved = gemm_render.CONFIGS
    if forms is not None:
        gemm_render.CONFIGS = tuple(c for c in saved if c.name in forms)
    try:
        pack(
            generate(trace(load_model_file(model)), ("sm_90",), gemm_candidates=True, library_free=True), out
        )
    finally:
        gemm_render.CONFIGS = saved
    return out


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Path:
    return build_library_free(HERE / "lm_head.py", tmp_path_factory.mktemp("one_row") / "head.tpk", FORMS)


def kernel_names(program, steps) -> list[str]:
    kernels = {k.id: k for k in program.kernels}
    return [kernels[s.target].name for s in steps if s.kind == StepKind.KERNEL]


def torch_loader_plans(path: Path, arch: str) -> list[dict[tuple, tuple]]:
    """Per program, bucket key -> the steps the torch loader runs there on a GPU of ``arch``: its
    own table (``Runner.tuning``) through the function its ``GpuProgram`` takes its plans from."""
    from aot.loader import load
    from aot.tuning import tuned_plans

    runner = load(path)
    programs = [e.program for e in runner._entries]
    return [tuned_plans(runner.tuning, i, p, arch) for i, p in enumerate(programs)]


def test_the_one_row_bucket_runs_the_default_tables_forms(head):
    """At batch 1 the two GEMMs run ``vec_1x2x512`` and ``vec_1x2x512_ln`` (the LayerNorm kernel
    gone: 2 launches where the tile plan has 3); at batch 8 the tile form and the LayerNorm kernel;
    on an sm_80 GPU (no table for it) the tile form at both, as a default build runs the library."""
    from aot.bundle import open_bundle
    from aot.codegen.gemm_defaults import DEFAULT_ARCH
    from aot.program import live_steps
    from aot.runtime import check
    from aot.schema import TUNING_PATH
    from aot.tuning import parse_tuning

    bundle = open_bundle(head)
    program = bundle.program()
    table = parse_tuning(bundle.read(TUNING_PATH), [program], [bundle.manifest.buckets])
    assert table.arch == DEFAULT_ARCH
    assert sorted((c.site, c.choice, tuple(c.sizes.items())) for c in table.choices) == [
        ("gemm_0", "vec_1x2x512", (("batch", 1),)),
        ("gemm_1", "vec_1x2x512_ln", (("batch", 1),)),
    ]
    base = kernel_names(program, live_steps(program))
    assert len(base) == 3 and "layer_norm" in base[1]  # the tile plan keeps the LayerNorm kernel
    # every site's one alternative stands over the tile form's kernels
    forms = {c.name for s in program.alternatives for c in s.candidates}
    assert forms == {"vec_1x2x512", "vec_1x2x512_ln"}

    checked = check(head)
    (plans,) = checked.plans("sm_90").values()
    assert list(plans) == [(1,)]
    one_row = kernel_names(program, plans[(1,)])
    assert len(one_row) == 2 and not set(one_row) & set(base)  # both GEMVs, no LayerNorm kernel
    candidates = {s.target for site in program.alternatives for c in site.candidates for s in c.steps}
    assert {s.target for s in plans[(1,)] if s.kind == StepKind.KERNEL} == candidates
    assert checked.plans("sm_80") == {"general": {}}


class RecordingKernel:
    """A launch recorded, nothing computed (the plans and allocations are what is checked)."""

    def __init__(self, log, cubin, name, shared, num_warps, dependent=False):
        self.log, self.name = log, name

    def launch(self, grid, stream, params):
        self.log.append(("launch", self.name, grid))


@pytest.fixture
def fake(monkeypatch):
    from aot.runtime import driver as drv
    from tests.runtime.test_runner_fake_driver import FakeDevice

    device = FakeDevice()
    monkeypatch.setattr(drv, "Kernel", lambda *a: RecordingKernel(device.log, *a))
    monkeypatch.setattr(drv, "destroy_graph", lambda *a: None)
    return device


def test_the_runtime_runs_the_torch_loaders_plan_at_every_bucket(head, fake):
    """The runtime's steps at each bucket, and off the buckets, are the torch loader's on a GPU of
    the same arch (sm_90: the tuned plan at batch 1); the launches a call makes are them."""
    from aot.program import live_steps
    from aot.runtime import check
    from aot.runtime.runner import Runner

    checked = check(head)
    runner = Runner(checked, fake)
    (entry,) = checked.entries
    (theirs,) = torch_loader_plans(head, "sm_90")
    for batch in (1, 8, 5):
        ours = runner._prepare(entry, {"batch": batch}).steps
        want = theirs.get((batch,), entry.program.steps)
        assert ours == live_steps(type(entry.program)(**{**entry.program.__dict__, "steps": want}))
        fake.log.clear()
        runner.run((), {"x": np.zeros((batch, 64), np.float16)})
        launched = [e[1] for e in fake.log if e[0] == "launch"]
        names = kernel_names(entry.program, ours)
        assert launched == (names * 2 if batch != 5 else names)  # a capture records them, a replay runs them
    assert len(kernel_names(entry.program, runner._prepare(entry, {"batch": 1}).steps)) == 2


def test_the_arena_holds_no_output_the_steps_after_the_graph_compute(head, fake, monkeypatch):
    """The head's logits (the last kernel's result, 1152 columns, of which the output is a slice of
    1100) are computed after the graph into memory of the call's own and handed out as that slice
    (rows 1152 apart, no copy), as the torch loader hands them out: the arena holds the input, the
    first GEMM's result and the LayerNorm's (1 KiB each at batch 8), never the 18 KiB of logits.
    With the tail off (outputs below ``TAIL_MIN_BYTES``) the arena holds them too and a call packs
    them into memory of its own, as before."""
    from aot.runtime import check
    from aot.runtime import runner as rt

    padded, logits = 8 * 1152 * 2, 8 * 1100 * 2
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float16)
    for tail in (True, False):
        monkeypatch.setattr(rt, "TAIL_MIN_BYTES", 1 if tail else 1 << 62)
        fake.log.clear()
        runner = rt.Runner(check(head), fake, arena="largest")  # sized at load for batch 8
        # the device allocations at load: the weights (each at a 256-byte offset) and the arena
        weights, arena = [e[1] for e in fake.log if e[0] == "alloc"]
        # mix's W and bias; the head's W and bias padded to 1152 rows (the LayerNorm's scale and
        # shift folded into them by the build, ``tracer.norm_scales``)
        assert weights == runner.weights_bytes == 64 * 64 * 2 + 256 + 1152 * 2 + 1152 * 64 * 2
        assert arena == runner.arena_bytes == (3 * 1024 if tail else 3 * 1024 + padded)
        prepared = runner._prepared[("general", ("batch", 8))]
        # the head's padded product (its logits a slice of it): in the arena only without the tail
        assert any(b.endswith("_padded") for b in prepared.layout.offsets) is not tail
        assert prepared.tail_bytes == (padded if tail else 0)
        # a call's activations and logits, either way: the build's memory plan at batch 8, the
        # input (the graph's static copy of it) and the first GEMM's 1 KiB the logits cannot reuse;
        # without the tail, each call packs a copy of the logits on top (below)
        (plan,) = [m.peak_bytes for m in runner.manifest.stats.memory_plan if m.sizes == {"batch": 8}]
        assert arena + prepared.tail_bytes == plan + 1024 + 1024
        runner.run((), {"x": x})  # captures the graph
        fake.log.clear()
        out = runner.run((), {"x": x})
        assert out.shape == (8, 1100) and out.dtype == "float16"
        replayed = [("replay",), *[e for e in fake.log if e[0] == "launch"][: 2 if tail else 3]]
        if tail:  # the graph, then the head's launch straight into the output's memory
            assert fake.log == [*replayed, ("alloc", padded), fake.log[-1]] and fake.log[-1][0] == "launch"
            assert out.ptr in fake.buffers and out.strides == (1152, 1)  # the allocation itself
        else:  # the graph computes the logits in the arena, then a 2-D copy packs them
            assert fake.log == [*replayed, ("alloc", logits), ("copy_rows", False)] and out.strides is None
        runner.close()


@pytest.mark.slow  # models/mlp.py built with every candidate form
def test_the_mlps_one_row_bucket_runs_the_default_builds_forms(tmp_path, built):
    """models/mlp.py built ``--library-free``: at batch 1 every GEMM runs the form its default build
    runs there (``vec_1x4x1024_ln`` for up, four rows of W a block with the LayerNorm kernel in its
    prologue, ``gemm_defaults.PROLOGUE_ROWS``; ``vec_1x2x1024`` for down), and the runtime's plan at every bucket is the torch loader's."""
    from aot.bundle import open_bundle
    from aot.program import live_steps
    from aot.runtime import check
    from aot.schema import TUNING_PATH
    from aot.tuning import parse_tuning
    from tests.conftest import model_path

    free = build_library_free(model_path("mlp"), tmp_path / "mlp-lf.tpk")
    default = open_bundle(built("mlp", ("sm_90",)))
    want_table = parse_tuning(default.read(TUNING_PATH), [default.program()], [default.manifest.buckets])
    bundle = open_bundle(free)
    program = bundle.program()
    table = parse_tuning(bundle.read(TUNING_PATH), [program], [bundle.manifest.buckets])

    # the default build's few-row choices (2-16 rows) are its own: the library-free tiles run
    # there; a site it joins with the next (``gemm_pairs``: a block's down projection and the next
    # block's LayerNorm and up projection) names both sites' forms, ``first__second``
    def in_order(choices):
        return sorted(choices, key=lambda c: int(c.site.rsplit("_", 1)[1]))

    assert all(c.sizes == {"batch": 1} for c in table.choices)
    assert [c.choice for c in in_order(table.choices)] == [
        form for c in in_order(want_table.choices) if c.sizes == {"batch": 1} for form in c.choice.split("__")
    ]
    assert {c.choice for c in table.choices} == {"vec_1x4x1024_ln", "vec_1x2x1024"}
    checked = check(free)
    (plans,) = checked.plans("sm_90").values()
    (theirs,) = torch_loader_plans(free, "sm_90")
    assert list(plans) == list(theirs) == [(1,)]
    assert plans[(1,)] == live_steps(type(program)(**{**program.__dict__, "steps": theirs[(1,)]}))
    # 4 blocks' LayerNorm kernels go into the up GEMVs; the final LayerNorm stays
    assert len(kernel_names(program, live_steps(program))) - len(kernel_names(program, plans[(1,)])) == 4


@pytest.mark.slow  # models/gpt.py (GPT-2-small) built with every candidate form
def test_gpts_one_token_bucket_runs_a_gemv_at_every_site_and_its_logits_leave_the_arena(tmp_path, fake):
    """models/gpt.py built ``--library-free``: at batch 1 x seq 1 every GEMM site (q/k/v, out,
    fc, proj of 12 layers and the LM head) runs a one-row form, the LayerNorms in the prologues
    of the GEMVs that read them (24 kernels fewer); the runtime's plan at each bucket is the torch
    loader's; at batch 8 x seq 128 the 98 MiB of logits are computed after the graph, into the
    caller's memory, not the arena."""
    from dataclasses import replace

    from aot.program import live_steps
    from aot.runtime import check
    from aot.runtime.runner import Runner
    from tests.conftest import model_path

    free = build_library_free(model_path("gpt"), tmp_path / "gpt-lf.tpk")
    checked = check(free)
    (entry,) = checked.entries
    program = entry.program
    (theirs,) = torch_loader_plans(free, "sm_90")
    assert list(checked.plans("sm_90")["general"]) == list(theirs) == [(1, 1)]
    runner = Runner(checked, fake)
    names = {}
    for batch, seq in ((1, 1), (8, 128), (2, 16)):
        sizes = {"batch": batch, "seq": seq}
        prepared = runner._prepare(entry, sizes)
        want = theirs.get((batch, seq), program.steps)
        assert prepared.steps == live_steps(replace(program, steps=want))
        names[(batch, seq)] = kernel_names(program, prepared.steps)
    sites = [s for s in program.alternatives if s.id.startswith("gemm_")]
    assert len(sites) == 12 * 4 + 1
    one_token = names[(1, 1)]
    assert sum("_vec_" in n for n in one_token) == len(sites)
    assert len(names[(8, 128)]) - len(one_token) == 24  # each layer's two LayerNorm kernels
    prepared = runner._prepare(entry, {"batch": 8, "seq": 128})
    logits = 8 * 128 * 50304 * 2  # the head's padded GEMM, of which the logits are a slice
    # the arena: what the layers hold at once (the fc GEMM's 6 MiB result beside its input, the
    # residual stream, the inputs), 12 MiB where it held the logits too (103 MiB) before
    assert prepared.tail_bytes == logits and runner.arena_bytes < 16 << 20


INTERPRETED = """
import aot.runtime.runner
aot.runtime.runner.TAIL_MIN_BYTES = 1  # the head's kernel after the others, into the output's memory
inputs = json.loads(sys.argv[2])
out = {}
for batch, x in inputs.items():
    got = runner.run((), {"x": np.array(x, np.float16)}, numpy=True)
    steps = runner._prepare(runner.checked.entries[0], {"batch": int(batch)}).steps
    names = [runner.records[s.target].name for s in steps if s.target in runner.records]
    out[batch] = [got.astype(np.float32).tolist(), names]
print(json.dumps(out))
"""


@pytest.mark.slow  # every launch of three calls in Triton's interpreter
def test_the_runtimes_outputs_at_every_bucket_match_eager_in_the_interpreter(head):
    """The runtime over the stand-in driver, each kernel run by its Triton source in the
    interpreter: the one-row forms at batch 1, the tile forms at batch 8 and 5, the head's kernel
    after the others into the output's own memory; each within float16's tolerance of eager
    PyTorch."""
    import torch

    from aot.dtypes import TOLERANCE
    from aot.tracer import example_inputs, instantiate, load_model_file
    from tests.codegen.conftest import interpreted_json
    from tests.runtime.test_runner_interpreted import DRIVER

    spec = load_model_file(HERE / "lm_head.py")
    module = instantiate(spec)
    xs = {b: example_inputs(spec, {"batch": b}, seed=b)["x"] for b in (1, 8, 5)}
    payload = json.dumps({str(b): x.float().tolist() for b, x in xs.items()})
    script = (
        f"import sys\nsys.argv = ['x', {str(head)!r}, {payload!r}]\nimport numpy as np\n"
        + DRIVER
        + INTERPRETED
    )
    got = interpreted_json(script)
    tol = TOLERANCE["float16"]
    for b, x in xs.items():
        with torch.no_grad():
            want = module(x).float()
        out, names = got[str(b)]
        torch.testing.assert_close(torch.tensor(out), want, atol=tol.atol, rtol=tol.rtol)
        assert any(n.startswith("gemm") for n in names)
        assert (len(names) == 2) == (b == 1), (b, names)
