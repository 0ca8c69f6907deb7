"""Real architectures, unmodified, built into bundles and run on the CPU against eager PyTorch.

Per zoo model: the bundle matches eager at every declared size (batch 1 and seq 1, odd sizes and
the maximum among them) where the outputs do depend on the inputs; its guards admit every
declared size, name their source lines and are what ``aotpack guards MODEL.py`` writes; padded
attention masks give eager's results (also when the build saw only all-ones masks); constant
keyword arguments reach ``forward``; and every fused kernel matches its reference decomposition
in Triton's interpreter (the CPU path runs the references, so this is where CI sees these
models' kernels at all).

Tolerance (float32): max |bundle - eager| <= 1e-4 * max(1, max |eager|) per output. The CPU path
runs eager's ATen ops except where the build rewrote them (SDPA called with the mask export
materializes, or with ``is_causal`` once that mask is dropped; fused kernels' reference
decompositions), which changes rounding only. Seen on a 2-core CPU (torch 2.13): most models
bit-exact, the Llama family 2.4e-7, efficientnet_b0 5.9e-6 (at batch 1; logits of scale ~100).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
from collections.abc import Mapping

import pytest
import torch

from tests.realmodels.conftest import ARCHS, ROOT, require, unusable
from tests.realmodels.zoo import ZOO

RTOL = 1e-4
INPUT_EFFECT = 100  # another input must move every output by this many tolerances (whisper: ~150)
# zoo models with an attention_mask input; llama-attention_mask and t5-encoder are built with all-ones masks
MASKED = ("bert", "minilm", "roberta", "t5-encoder", "llama-attention_mask")
PADDED_SIZES = ({"batch": 2, "seq": 2}, {"batch": 3, "seq": 13}, {"batch": 4, "seq": 32})
# constant kwargs of forward (ModelSpec.kwargs): in transformers 5 these are **kwargs, not parameters
KWARGS = {
    "bert+return_dict=False": ("bert", {"return_dict": False}),
    "gpt2+output_hidden_states": ("gpt2", {"output_hidden_states": True}),
}
pytestmark = pytest.mark.slow  # fourteen real architectures built from scratch: minutes

INTERPRETED_LAUNCHES = 1  # per distinct kernel: the interpreter costs milliseconds per program instance


def eager(spec, module, inputs: dict[str, torch.Tensor]):
    """The library module called as a user calls it: inputs by keyword, the spec's constant kwargs,
    and ``use_cache=False`` where ``forward`` takes it (a bundle returns no cache)."""
    kwargs = dict(spec.kwargs)
    if "use_cache" in inspect.signature(module.forward).parameters:
        kwargs.setdefault("use_cache", False)
    with torch.no_grad():
        return module(**inputs, **kwargs)


def tensors(out) -> list[torch.Tensor]:
    """An output tree's tensors in field order: a ``ModelOutput`` (an OrderedDict of its non-None
    fields), the runner's ``Record``, dicts, tuples and lists; None carries none. Written here, not
    taken from ``aot.pytree``, so that eager and bundle outputs are flattened independently of it."""
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    raise TypeError(f"output of type {type(out).__name__} holds no tensors")


def structure(out):
    """The tree's shape without its values: field names of records and dicts, lengths of sequences."""
    if isinstance(out, Mapping):
        return {k: structure(v) for k, v in out.items() if v is not None}
    if isinstance(out, (tuple, list)):
        return ("seq", [structure(v) for v in out])
    return "tensor" if isinstance(out, torch.Tensor) else repr(out)


def difference(got, want) -> str | None:
    """Why ``got`` (the bundle's outputs) is not eager's ``want``, or None."""
    if structure(got) != structure(want):
        return f"output structure {structure(got)} vs eager {structure(want)}"
    for i, (a, b) in enumerate(zip(tensors(got), tensors(want))):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {a.dtype} {list(a.shape)} vs eager {b.dtype} {list(b.shape)}"
        if a.numel() == 0:
            continue
        err = (a.double() - b.double()).abs().max().item()
        scale = max(1.0, b.double().abs().max().item())
        if not err <= RTOL * scale:  # NaN fails too
            return f"output {i}: max abs error {err:.3g} > {RTOL:g} x output scale {scale:.3g}"
    return None


def declared_sizes(spec) -> list[dict[str, int]]:
    dims = spec.dims()
    return [
        dict(zip([d.name for d in dims], v))
        for v in itertools.product(*[range(d.min, d.max + 1) for d in dims])
    ]


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {next((ln for ln in str(e).splitlines() if ln.strip()), '')[:300]}"


@pytest.mark.parametrize("name", list(ZOO))
def test_matches_eager_at_every_declared_size(zoo_build, name):
    from aot.tracer import example_inputs

    require(ZOO[name].library)
    b = zoo_build(name).ok()
    sizes_list = declared_sizes(b.spec)
    failures = []
    for sizes in sizes_list:
        inputs = example_inputs(b.spec, sizes, seed=7 + sum(sizes.values()))
        want = eager(b.spec, b.module, inputs)
        try:
            got = b.runner(**inputs)
        except Exception as e:
            failures.append(f"{sizes} run: {one_line(e)}")
            continue
        why = difference(got, want)
        if why:
            failures.append(f"{sizes} compare: {why}")
    assert not failures, f"{name}: {len(failures)} of {len(sizes_list)} sizes fail: " + "; ".join(
        failures[:4]
    )


@pytest.mark.parametrize("name", list(ZOO))
def test_outputs_depend_on_the_inputs(zoo_build, name):
    """The comparisons above mean something only if another input moves every output by far more
    than the tolerance: a network that is degenerate at initialization (all images give the same
    logits) would let a bundle that ignores its input pass."""
    from aot.tracer import example_inputs

    require(ZOO[name].library)
    b = zoo_build(name)
    if b.module is None:
        b.ok()
    for sizes in ({d.name: d.min for d in b.spec.dims()}, {d.name: d.max for d in b.spec.dims()}):
        first = tensors(eager(b.spec, b.module, example_inputs(b.spec, sizes, seed=1)))
        second = tensors(eager(b.spec, b.module, example_inputs(b.spec, sizes, seed=2)))
        for i, (x, y) in enumerate(zip(first, second)):
            moved = (x.double() - y.double()).abs().max().item()
            tolerance = RTOL * max(1.0, y.double().abs().max().item())
            assert moved >= INPUT_EFFECT * tolerance, (
                f"{name} at {sizes}: output {i} moves only {moved:.3g} between two inputs, "
                f"{moved / tolerance:.3g}x the tolerance {tolerance:.3g} (want {INPUT_EFFECT}x)"
            )


@pytest.mark.parametrize("name", list(ZOO))
def test_declared_ranges_are_not_narrowed(zoo_build, name):
    from aot.admissible import admissible_text

    require(ZOO[name].library)
    guards = zoo_build(name).ok().runner.manifest.guards
    narrowed = [
        f"{g.name} declared {g.declared_min}..{g.declared_max} admits {admissible_text(g)} ("
        + "; ".join(f"guard {s.text} at {s.file}:{s.line}: {s.code}" for s in g.sources)
        + ")"
        for g in guards.symbols
        if (g.min, g.max, g.modulus, tuple(g.excluded)) != (g.declared_min, g.declared_max, 1, ())
    ]
    narrowed += [
        f"relation {r.expr} at {r.source.file}:{r.source.line}: {r.source.code}" for r in guards.relations
    ]
    narrowed += [f"specialized {s.text} at {s.file}:{s.line}: {s.code}" for s in guards.specializations]
    assert not narrowed, f"{name}: " + " | ".join(narrowed)


@pytest.mark.parametrize("name", list(ZOO))
def test_every_guard_names_its_source_line(zoo_build, name):
    require(ZOO[name].library)
    manifest = zoo_build(name).ok().runner.manifest
    # the bundle's contract, and each program's own guards (a one-program bundle lists none)
    for program, guards in [("contract", manifest.guards), *((e.name, e.guards) for e in manifest.programs)]:
        sources = [s for g in guards.symbols for s in g.sources]
        sources += [r.source for r in guards.relations] + list(guards.specializations)
        for s in sources:
            assert s.file != "<torch>" and s.line > 0 and "/bin/" not in s.file, (program, s)


@pytest.mark.parametrize("name", list(ZOO))
def test_guards_from_the_model_match_the_bundle(zoo_build, name):
    """``aotpack guards MODEL.py`` (trace only, uninitialized weights) writes the manifest that
    ``aotpack check`` compares in CI: it must be the bundle's, or the gate reports a stale manifest."""
    import difflib

    from aot.manifest_text import manifest_of_bundle, render_manifest
    from aot.tracer import guard_manifest

    require(ZOO[name].library)
    b = zoo_build(name).ok()
    # without the row-independence notes: comments, outside the contract `aotpack check` compares
    from_model = render_manifest(guard_manifest(b.spec, ARCHS), notes=False)
    from_bundle = render_manifest(manifest_of_bundle(b.runner.manifest), notes=False)
    diff = difflib.unified_diff(
        from_model.splitlines(),
        from_bundle.splitlines(),
        "aotpack guards MODEL.py",
        "bundle",
        lineterm="",
        n=0,
    )
    if from_model != from_bundle:
        pytest.fail(f"{name}: the manifests differ:\n" + "\n".join(diff), pytrace=False)


def right_padded(batch: int, seq: int) -> torch.Tensor:
    """Rows of different lengths, as a tokenizer pads a batch: row r keeps its first
    max(1, seq - 3r) tokens, row 0 all of them."""
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(1, batch):
        mask[row, max(1, seq - 3 * row) :] = 0
    return mask


@pytest.mark.parametrize("name", MASKED)
def test_padded_attention_mask_matches_eager(zoo_build, name):
    from aot.tracer import example_inputs

    require(ZOO[name].library)
    b = zoo_build(name).ok()
    assert "attention_mask" in [i.name for i in b.spec.inputs]
    for sizes in PADDED_SIZES:
        inputs = example_inputs(b.spec, sizes, seed=11)
        inputs["attention_mask"] = right_padded(sizes["batch"], sizes["seq"])
        want = eager(b.spec, b.module, inputs)
        unpadded = eager(
            b.spec, b.module, {**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}
        )
        assert difference(want, unpadded) is not None, (
            f"{name} at {sizes}: padding does not change eager's outputs"
        )
        why = difference(b.runner(**inputs), want)
        assert why is None, f"{name} at {sizes} with a right-padded mask: {why}"


@pytest.mark.parametrize("key", list(KWARGS))
def test_constant_kwargs_reach_forward(zoo_build, key):
    from aot.tracer import example_inputs

    name, kwargs = KWARGS[key]
    require(ZOO[name].library)
    b = zoo_build(key, lambda: dataclasses.replace(ZOO[name](), kwargs=kwargs)).ok()
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}):
        inputs = example_inputs(b.spec, sizes, seed=5)
        want = eager(b.spec, b.module, inputs)
        assert structure(want) != structure(eager(dataclasses.replace(b.spec, kwargs={}), b.module, inputs))
        why = difference(b.runner(**inputs), want)
        assert why is None, f"{key} at {sizes}: {why}"


@pytest.fixture(scope="session")
def kernel_checks(zoo_build, tmp_path_factory, request):
    """The selected zoo bundles' kernels in one Triton-interpreter process, at batch 1 (seq 1) and
    an odd size, each model from a model file that imports its spec from the zoo."""
    from aot.verify.interpret import interpret_in_subprocess

    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.originalname == "test_kernels_match_their_reference_in_the_interpreter"
    }
    base = tmp_path_factory.mktemp("realmodel-files")
    plan, names = [], []
    for name, case in ZOO.items():
        b = zoo_build(name) if name in selected and unusable(case.library) is None else None
        if b is None or b.failure is not None:
            continue
        model = base / f"{name.replace('-', '_')}.py"
        model.write_text(
            f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            f"from tests.realmodels.zoo import ZOO\nspec = ZOO[{name!r}]()\n"
        )
        plan.append((b.path, model, [case.sizes[0], case.sizes[-2]], INTERPRETED_LAUNCHES))
        names.append(name)
    return dict(zip(names, interpret_in_subprocess(plan))) if plan else {}


@pytest.mark.parametrize("name", list(ZOO))
def test_kernels_match_their_reference_in_the_interpreter(zoo_build, kernel_checks, name):
    from aot.loader.bundle import open_bundle

    require(ZOO[name].library)
    b = zoo_build(name).ok()
    bundle = open_bundle(b.path)
    try:
        kernels = {k.id for k in bundle.program().kernels}
    finally:
        bundle.close()
    case = ZOO[name]
    results = kernel_checks[name]
    assert set(results) == {json.dumps(s, sort_keys=True) for s in (case.sizes[0], case.sizes[-2])}
    for size, checks in results.items():
        assert {c.kernel for c in checks} == kernels, f"{name} at {size}: some kernels never ran"
        bad = [
            f"{c.name} {c.output}: max abs err {c.max_abs_error:.3g} ({c.worst_ratio:.2f}x tolerance)"
            for c in checks
            if not c.ok
        ]
        assert not bad, f"{name} at {size}: " + "; ".join(bad)
