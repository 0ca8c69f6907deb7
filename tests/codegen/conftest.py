"""Fixtures for codegen tests: the small pattern models of ``tests/codegen/models``, traced, fused
and compiled (sm_90 only, to keep CI short) once per session, and packed as bundles."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S, one_worker_at_a_time

PATTERNS = Path(__file__).resolve().parent / "models"
PATTERN_ARCHS = ("sm_90",)

# Interpreter checks over several sizes come in two tiers: the default run checks each model at its
# first size (with every form eligible there, every kernel runs), the slow run at the other sizes.
# A module-scoped fixture that runs them takes its tier as ``request.param``; parametrize the tests
# that use it with ``@pytest.mark.parametrize("<fixture>", SIZE_TIERS, indirect=True)``.
SIZE_TIERS = [
    pytest.param("first", id="first-size"),
    pytest.param("rest", id="other-sizes", marks=pytest.mark.slow),
]


def tier_sizes(sizes: dict[str, list[dict]], tier: str) -> dict[str, list[dict]]:
    """The sizes of each model that ``tier`` (``SIZE_TIERS``) checks."""
    assert tier in ("first", "rest"), tier
    return {name: s[:1] if tier == "first" else s[1:] for name, s in sizes.items()}


class PatternFactory:
    def __init__(self, base: Path, tmp_path_factory):
        self.base, self.tmp_path_factory = base, tmp_path_factory
        self.cache: dict[str, tuple] = {}

    def __call__(self, name: str):
        """``(traced, compiled, bundle path, model path)`` of ``models/<name>.py``."""
        if name not in self.cache:
            from aot.codegen import generate
            from aot.packager import pack
            from aot.tracer import load_model_file, trace

            model = PATTERNS / f"{name}.py"
            messages: list[str] = []
            with one_worker_at_a_time(self.tmp_path_factory, f"pattern-{name}"):
                traced = trace(load_model_file(model))
                compiled = generate(traced, PATTERN_ARCHS, progress=messages.append)
            out = self.base / f"{name}.tpk"
            pack(compiled, out)
            self.cache[name] = (traced, compiled, out, model, messages)
        return self.cache[name]


@pytest.fixture(scope="session")
def pattern(tmp_path_factory) -> PatternFactory:
    return PatternFactory(tmp_path_factory.mktemp("patterns"), tmp_path_factory)


@contextlib.contextmanager
def forms_offered(configs: tuple) -> Iterator[None]:
    """Builds inside the block offer the GEMM forms ``configs`` (``aot.codegen.gemm_forms.TileConfig``)
    in place of the built-in ones, where ``configs`` is not given by the caller
    (``aot.codegen.gemm_render`` reads them); the small sites' form with W early at 2-16 rows
    (``gemm_defaults.SMALL_EARLY``, a form CONFIGS lacks that a candidates build offers beside
    them) is not offered either."""
    from aot.codegen import gemm_defaults, gemm_render

    saved = gemm_render.CONFIGS, gemm_defaults.SMALL_EARLY
    gemm_render.CONFIGS = tuple(configs)
    gemm_defaults.SMALL_EARLY = "off"
    try:
        yield
    finally:
        gemm_render.CONFIGS, gemm_defaults.SMALL_EARLY = saved


def failing_candidates(
    compiled, model: Path, kernel_id: str, old: str, new: str, sizes: dict, out: Path
) -> set[str]:
    """The candidate checks (``<site>/<candidate>``) that fail in Triton's interpreter at
    ``sizes`` once kernel ``kernel_id``'s source has ``old`` replaced by ``new``: a wrong kernel
    the comparison must catch."""
    from dataclasses import replace

    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    program = compiled.program
    kernels = tuple(
        replace(k, source=k.source.replace(old, new)) if k.id == kernel_id else k for k in program.kernels
    )
    assert kernels != program.kernels, f"{old!r} is not in kernel {kernel_id}"
    pack(replace(compiled, program=replace(program, kernels=kernels)), out)
    (result,) = interpret_in_subprocess([(out, model, [sizes], None, True)], timeout=HANG_GUARD_S)
    return {c.name for c in next(iter(result.values())) if not c.ok}


def interpreted_json(script: str, timeout: float = HANG_GUARD_S):
    """Run ``script`` in a fresh Python with ``TRITON_INTERPRET=1`` (a kernel called on CPU
    tensors) and return the JSON its last printed line holds."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


DECODE_PROGRAM_SCRIPT = r"""
import json
import torch
from safetensors.torch import load as load_safetensors
from aot import schema
from aot.bundle import open_bundle
from aot.verify.interpret import interpret_kernels

b = open_bundle(BUNDLE)
try:
    programs = [b.program(), *b.program().variants]
    weights = load_safetensors(b.read(schema.WEIGHTS_PATH))
finally:
    b.close()
out = []
for p in programs:
    specs = {i.name: i.spec for i in p.inputs}
    if specs["input_ids"].shape[1] != "1":
        continue  # prefill
    symbolic = not specs["input_ids"].shape[0].isdigit()
    B = 2 if symbolic else int(specs["input_ids"].shape[0])
    torch.manual_seed(0)
    inputs = {}
    for name, spec in specs.items():
        shape = [B if not d.isdigit() else int(d) for d in spec.shape]
        if name == "input_ids":
            inputs[name] = torch.randint(0, 64, shape)
        elif name == "position_ids":  # row 1 left-padded
            inputs[name] = torch.tensor([[POS], [POS - PAD]][:B])
        elif name == "cache_position":
            inputs[name] = torch.tensor([POS])
        elif name == "attention_mask":
            mask = torch.ones(shape, dtype=torch.int64)
            mask[:, POS + 1 :] = 0
            mask[1:, :PAD] = 0
            inputs[name] = mask
        else:  # the KV cache as earlier steps left it
            inputs[name] = torch.randn(shape, dtype=getattr(torch, spec.dtype))
    for c in interpret_kernels(p, weights, inputs, {"batch": B} if symbolic else {}, LAUNCHES):
        out.append([c.name, c.output, c.max_abs_error, c.ok])
print(json.dumps(out))
"""


def decode_kernel_checks(bundle, position: int, padding: int, launches: int | None = None) -> list:
    """Every kernel of ``bundle``'s decode programs (one token a row) run by the interpreter
    (``interpret_kernels``, in a fresh Python) at batch 2, this step's token at ``position`` and
    row 1 left-padded by ``padding`` tokens, the cache random as earlier steps left it: a
    ``[name, output, max_abs_error, ok]`` row for each output compared with its reference.
    ``launches``: interpret only the first N launches of each distinct kernel (a layer's kernels
    are the layer before's: the same source, shapes and config), later ones run their reference."""
    script = DECODE_PROGRAM_SCRIPT.replace("BUNDLE", repr(str(bundle))).replace("LAUNCHES", repr(launches))
    return interpreted_json(script.replace("POS", str(position)).replace("PAD", str(padding)))


def assert_decode_kernels_match(compiled, bundle, attention: str) -> list:
    """Pack ``compiled`` (a two-layer causal LM's programs) to ``bundle`` and check every kernel of
    its decode program (``decode_kernel_checks``: slot 9, row 1 left-padded by 2): two layers of
    attention kernels named ``attention...`` (their output and both caches: six rows), every row
    within its tolerance, the caches exact (but where the kernel norms each head before it
    rotates, ``_normed``: the norm's mean is a sum in another order than the library's, so the
    keys it writes are held to the tolerance). The checks, for more assertions."""
    from aot.packager import pack

    pack(compiled, bundle)
    checks = decode_kernel_checks(bundle, position=9, padding=2)
    ours = [c for c in checks if c[0].startswith(attention)]
    assert len(ours) == 2 * 3, checks  # two layers: the output and both caches
    assert all(ok for *_, ok in checks), [c for c in checks if not c[3]]
    assert all(
        err == 0.0 for name, out, err, _ in ours if out.startswith("index_put") and "_normed" not in name
    ), ours
    return checks


def library_free_checked(tmp_path: Path, text: str, make_inputs, sizes: list[dict], interpret_at: int = 2):
    """Build the model file ``text`` library-free and check it: every live step a kernel or a view,
    the torch-free runtime takes the bundle, the CPU path agrees with eager (1e-5, NaN as NaN) at
    each of ``sizes`` (``make_inputs(size, generator)``: the call's arguments there) and every
    kernel with its reference in Triton's interpreter at the first ``interpret_at`` of them.
    Returns the ``Compiled``."""
    import torch

    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import is_view, live_steps
    from aot.runtime import check
    from aot.schema import StepKind
    from aot.tracer import instantiate, load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "model.py"
    path.write_text(text)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    live = live_steps(compiled.program)
    assert all(s.kind == StepKind.KERNEL or is_view(s) for s in live), [s.target for s in live]
    pack(compiled, tmp_path / "model.tpk")
    assert check(tmp_path / "model.tpk").entries  # the torch-free runtime takes it
    runner, module = load(tmp_path / "model.tpk"), instantiate(spec)  # the weights the trace read
    gen = torch.Generator().manual_seed(0)
    for size in sizes:
        args = make_inputs(size, gen)
        with torch.no_grad():
            want = module(*args)
        got = runner(*args)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    (results,) = interpret_in_subprocess([(tmp_path / "model.tpk", path, sizes[:interpret_at], None)])
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in compiled.program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
    return compiled, results


ONE_ROW_DECODE_SCRIPT = """
import json
from dataclasses import replace

import torch
from safetensors.torch import load

from aot.bundle import open_bundle
from aot.buckets import buckets_by_program
from aot.schema import WEIGHTS_PATH
from aot.tuning import read_tuning, tuned_plans
from aot.verify.interpret import interpret_kernels

b = open_bundle(bundle)
main = b.program()
programs = [main, *main.variants]
table = read_tuning(b, programs, buckets_by_program(b.manifest))
weights = load(b.read(WEIGHTS_PATH))
program = programs[index]
plan = tuned_plans(table, index, program, "sm_90")[(1,)]
kernels = tuple(replace(k, source=k.source.replace(old, new)) for k in program.kernels)
fused = replace(program, steps=plan, kernels=kernels)
g = torch.Generator().manual_seed(0)
inputs = {
    "input_ids": torch.tensor([[7]]),
    "position_ids": torch.tensor([[5]]),
    "cache_position": torch.tensor([5]),
    "attention_mask": (torch.arange(16) <= 5).to(torch.int64)[None],
}
for t in program.inputs:
    if t.name.startswith(("key_cache", "value_cache")):
        shape = [1, *(int(d) for d in t.spec.shape[1:])]
        inputs[t.name] = (0.5 * torch.randn(shape, generator=g)).to(torch.float16)
results = interpret_kernels(fused, weights, inputs, {"batch": 1})
# the kernels that stand for library steps (a joined pair's first kernel that writes the residual's
# sum, ``row_sum``, has none: the second, which stands for both sites' steps, checks it)
launched = [i for i, s in enumerate(fused.steps) if s.kind.value == "kernel" and s.reference]
print(json.dumps([launched, [[r.step, r.name, r.output, r.ok, r.max_abs_error] for r in results]]))
"""


def interpreted_one_row_decode(bundle, index: int, old: str = "", new: str = "") -> tuple[list, list]:
    """Every kernel of the one-row plan (sm_90's table) of program ``index`` of the causal LM
    ``bundle`` (a 16-slot cache, float16) against its reference in Triton's interpreter, at slot 5
    of a random cache, with ``old`` replaced by ``new`` in every kernel's source: (the plan's
    launched steps that stand for library steps, a ``[step, name, output, ok, max_abs_error]`` row
    per output compared)."""
    head = f"bundle, index, old, new = {str(bundle)!r}, {index}, {old!r}, {new!r}\n"
    launched, rows = interpreted_json(head + ONE_ROW_DECODE_SCRIPT)
    return launched, rows
