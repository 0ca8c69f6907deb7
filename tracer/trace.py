"""``trace``: model spec → ``Traced``, and ``guard_manifest``: the same trace's contract alone.

Export with the model file's dynamic dims (``export_programs``), decompose to core ATen (attention
stays a library call), lower to a device-neutral ``Program``, measure whether padding the paddable
dims is sound, prove which dims keep their rows independent (``aot.tracer.independence``), and
record the eager reference the later stages compare against.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from aot.buckets import contract_buckets
from aot.errors import TraceError
from aot.schema import Bucket, InputGuard, Program
from aot.spec import ModelSpec, plan_buckets
from aot.stages import Traced, TracedProgram
from aot.tracer.export import Exported, export_error, quiet_torch, symbol_names
from aot.tracer.folding import FOLDED_PREFIX
from aot.tracer.independence import check_rows
from aot.tracer.model import call_model, run_eager, tree_spec, user_input_nodes
from aot.tracer.programs import contract, export_entry_points, program_entries

# ATen ops kept whole (library calls at run time) even where a decomposition exists.
KEEP_OPS = ("scaled_dot_product_attention.default",)
# Core ATen ops decomposed further: a batch norm over its own statistics with no running ones
# (``F.batch_norm(w, None, None, training=True)``: timm's weight-standardized convolutions of the
# NF-Nets, in eval mode too) is a pure function of its input, made of means, variances and
# pointwise ops; kept whole it reads as the training-mode batch norm a bundle may not run.
DECOMPOSE_OPS = ("_native_batch_norm_legit.no_stats",)


def guard_manifest(spec: ModelSpec, archs: tuple[str, ...], weights: str | None = None):
    """The guard manifest (``aot.manifest_text.GuardManifest``) a build of ``spec`` for ``archs``
    would have, from export alone: no weight init, decomposition or kernels."""
    import torch

    from aot.manifest_text import GuardManifest, entry_point_names, program_lines
    from aot.schema import SCHEMA_VERSION
    from aot.stages import environment

    programs = export_entry_points(spec, weights, fast=True, allow_narrowing=True)
    guards = contract(spec, programs)
    return GuardManifest(
        name=spec.name or "model",
        guards=guards,
        environment=environment(archs, torch.__version__.split("+")[0]),
        buckets=plan_buckets(spec, guards),
        schema_version=SCHEMA_VERSION,
        dtype=spec.dtype,
        programs=program_lines(program_entries(spec, programs), guards),
        entry_points=entry_point_names(program_entries(spec, programs)),
    )


def _lower(
    spec: ModelSpec,
    exported: Exported,
    progress=None,
    constant_suffix: str = "",
    contract_inputs: tuple[InputGuard, ...] | None = None,
) -> tuple[Program, dict[str, Any], tuple[Bucket, ...], dict[str, str]]:
    """Decompose one export to core ATen, lower it to a ``Program``, and check its padding; and
    the model line of each step's result (``Lowering.lines``). ``contract_inputs``: given for the
    bundle's first program, whose inputs are the contract's (every Dim by name, a Dim of one size
    that size) even where this trace fixed a size (MobileViT's ``int(h / 2)``: its own guards say
    which)."""
    import torch
    import torch.fx.experimental._config as fx_config
    from torch._decomp import get_decompositions
    from torch.export import default_decompositions

    from aot.tracer.complex_parts import split_complex
    from aot.tracer.filled import cat_filled_empties
    from aot.tracer.lower import Lowering, symbol_sources
    from aot.tracer.norm_scales import fold_norm_scales
    from aot.tracer.padding import check_padding

    # keep attention (and friends) whole; everything else to core ATen
    table = default_decompositions()

    def aten_op(name: str):
        packet, overload = name.split(".")
        return getattr(getattr(torch.ops.aten, packet), overload)

    for name in KEEP_OPS:
        table.pop(aten_op(name), None)
    table.update(get_decompositions([aten_op(name) for name in DECOMPOSE_OPS]))
    try:
        with fx_config.patch(backed_size_oblivious=True):
            with quiet_torch():
                ep = exported.ep.run_decompositions(table)
    except Exception as e:
        raise export_error(e, spec) from None
    rewritten = split_complex(ep.graph)  # complex tensors (rotary embeddings) as real pairs
    rewritten += cat_filled_empties(ep.graph)  # an empty tensor filled slice by slice: a cat
    rewritten += fold_norm_scales(ep)  # a norm's scale multiplied into the projections' weights
    if rewritten:
        ep.graph_module.recompile()
    static = {n: lo for n, (lo, hi) in exported.ranges.items() if lo == hi}
    nodes = user_input_nodes(ep, spec)
    order = sorted(spec.inputs, key=lambda i: list(ep.graph.nodes).index(nodes[i.name]))
    state = frozenset(i.name for i in spec.state_inputs())
    # check=True: decomposing can fix a size at its example that export left dynamic (a slice of a
    # buffer by an input's size, traced where the two are equal); the guards would then admit sizes
    # the program cannot run
    lowering = Lowering(
        ep, [i.name for i in order], symbol_names(ep, spec, check=True, static=static), state, constant_suffix
    )
    program, weight_tensors = lowering.run()
    # Inputs keep their declared dim names even where export unified two Dims (the guards then
    # hold the relation between them); sizes read from the inputs bind every declared symbol.
    declared = {g.name: g.shape for g in contract_inputs or exported.guards.inputs}
    inputs = tuple(replace(i, spec=replace(i.spec, shape=declared[i.name])) for i in program.inputs)
    program = replace(
        program,
        inputs=inputs,
        symbols=symbol_sources([i for i in inputs if i.name not in state]),
        output_tree=tree_spec(ep.call_spec.out_spec, lowering.none_outputs),
    )
    buckets = check_padding(spec, exported, progress)
    return program, weight_tensors, buckets, lowering.lines


def trace(
    spec: ModelSpec, weights: str | None = None, progress=None, allow_narrowing: bool | None = None
) -> Traced:
    """Export, decompose, collect guards and lower ``spec`` to a ``Traced``: one program, or
    several when one trace cannot cover the declared ranges (see ``export_programs``)."""
    import torch

    from aot.tracer.lower import tensor_leaves as leaves

    exported = export_entry_points(spec, weights, allow_narrowing=allow_narrowing, progress=progress)
    whole = contract(_entry_spec(spec, exported[0]), exported)
    first = whole.inputs if not spec.entry_points else None
    lowered = [
        _lower(_entry_spec(spec, ex), ex, progress, contract_inputs=first if k == 0 else None)
        for k, ex in enumerate(exported)
    ]
    weight_tensors = dict(lowered[0][1])
    for k, ex in enumerate(exported[1:], 1):
        # steps of weights alone that this program folded and the first did not: named by their bytes
        weight_tensors.update({n: t for n, t in lowered[k][1].items() if n.startswith(FOLDED_PREFIX)})
        w = lowered[k][1]
        if _weight_differences(weight_tensors, w, partial=True) and not _weight_differences(
            weight_tensors, w, _constants(ex), partial=True
        ):
            # only tensors made in forward differ (a mask built for another window layout): this
            # program keeps its own under names of its own, beside the general program's
            lowered[k] = _lower(_entry_spec(spec, ex), ex, progress, constant_suffix=f".program{k}")
            w = lowered[k][1]
            weight_tensors.update({n: t for n, t in w.items() if n not in weight_tensors})
        if differ := _weight_differences(weight_tensors, w, partial=True):
            raise TraceError(
                f"the program for {ex.name} uses other weights than the general one ({differ}); every program "
                f"of a bundle shares one set of parameters and buffers (a program may keep only the tensors "
                f"the model makes in forward, such as torch.tensor(...), under names of its own): build the "
                f"model once and change no parameter or buffer in forward by the input's size (a window "
                f"layout chosen from it), or declare Dims that one program covers (the build lists the "
                f"programs it traced)"
            )
    read = {w.name for p, *_ in lowered for w in p.weights}  # not those only folded steps read
    weight_tensors = {n: t for n, t in weight_tensors.items() if n in read}
    main = exported[0]
    spec = _entry_spec(spec, main)  # the reference runs the first program's entry point
    state = {i.name for i in spec.state_inputs()}
    # the eager reference runs on fresh (zero) state, as a freshly loaded runner's first call does;
    # the state is the runner's, so the bundle's example inputs leave it out
    examples = {k: v.zero_() if k in state else v for k, v in main.examples.items()}
    ref = run_eager(spec, main.module, {k: v.clone() if k in state else v for k, v in examples.items()})
    noise = _half_precision_noise(
        spec, main.module, {k: v.clone() if k in state else v for k, v in examples.items()}, leaves(ref)
    )
    programs = tuple(
        TracedProgram(name=ex.name, program=p, guards=ex.guards, buckets=b, entry=ex.entry, model_lines=lines)
        for ex, (p, _, b, lines) in zip(exported, lowered)
    )
    guards = check_rows(spec, main.module, [p.program for p in programs], whole, progress)
    return Traced(
        name=spec.name or "model",
        dtype=spec.dtype,
        program=programs[0].program,
        guards=guards,
        weights=weight_tensors,
        reference_inputs={k: v for k, v in examples.items() if k not in state},
        reference_outputs=tuple(o.detach().contiguous() for o in leaves(ref)),
        buckets=programs[0].buckets
        if len(programs) == 1
        else contract_buckets(plan_buckets(spec, guards), [(p.name, p.buckets) for p in programs]),
        torch_version=torch.__version__.split("+")[0],
        trace_seconds=time.perf_counter() - main.start,
        programs=programs if len(programs) > 1 or spec.entry_points else (),
        reference_noise=noise,
        model_lines={k: v for p in reversed(programs) for k, v in p.model_lines.items()},
    )


def _entry_spec(spec: ModelSpec, ex: Exported) -> ModelSpec:
    """``spec`` as the entry point of ``ex`` calls ``forward`` (its constant kwargs)."""
    ep = next((e for e in spec.entry_points if e.name == ex.entry), None)
    return spec.for_entry(ep) if ep is not None else spec


def _constants(ex: Exported) -> frozenset[str]:
    """The names of the tensors ``ex``'s model made in forward (lifted constants, not parameters)."""
    from torch.export.graph_signature import InputKind

    specs = ex.ep.graph_signature.input_specs
    return frozenset(s.target for s in specs if s.kind == InputKind.CONSTANT_TENSOR and s.target)


def _weight_differences(
    general: dict[str, Any],
    other: dict[str, Any],
    ignore: frozenset[str] = frozenset(),
    partial: bool = False,
) -> str:
    """What differs between two programs' weights, by name (at most three), or "" when nothing;
    ``ignore``: names not compared; ``partial``: the general set may hold more (other programs')."""
    import torch

    out = (
        []
        if partial
        else [f"{k} only in the general program" for k in sorted(set(general) - set(other) - ignore)]
    )
    out += [f"{k} only in this one" for k in sorted(set(other) - set(general) - ignore)]
    for k in sorted(set(general) & set(other) - ignore):
        a, b = general[k], other[k]
        if a.shape != b.shape:
            out.append(f"{k} of shape {list(b.shape)}, not {list(a.shape)}")
        elif a.dtype != b.dtype or not torch.equal(a, b):
            out.append(f"{k} with other values")
    return ", ".join(out[:3]) + (f" and {len(out) - 3} more" if len(out) > 3 else "")


def _half_precision_noise(spec: ModelSpec, module, examples: dict[str, Any], outputs: list) -> float:
    """For a float16/bfloat16 model: max |eager - eager float32| / max |eager float32| over the
    floating outputs at the example inputs; 0.0 for other dtypes."""
    import copy

    import torch

    from aot.tracer.lower import tensor_leaves
    from aot.tracer.programs import float32_copy_fits

    if spec.dtype not in ("float16", "bfloat16") or not float32_copy_fits(module):
        return 0.0
    wide = copy.deepcopy(module).float()
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in examples.items()}
    with torch.no_grad():
        exact = tensor_leaves(call_model(spec, wide, inputs))
    worst = 0.0
    for half, ref in zip(outputs, exact):
        if ref.is_floating_point() and ref.numel():
            scale = ref.abs().max().item()
            if scale > 0:
                worst = max(worst, (half.float() - ref).abs().max().item() / scale)
    return round(worst, 6)
