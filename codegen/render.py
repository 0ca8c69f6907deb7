"""Render one fusion group as a readable Triton kernel.

A group is a list of ATen steps (the kernel's reference decomposition) and the buffers it must
write. ``render_kernel`` lowers the steps to a value graph (``classify.lower``), plans the launch
(``launch``: kernel shape, block sizes, grid), writes the source (``kernel_source``) and hands
the partitioner a ``Rendered``: the source, its signature and parameters, the step arguments in
parameter order, the grid and config, and a traffic estimate.

Indices are int32 unless a buffer of the group can hold 2**31 or more elements within the
declared dim ranges.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.classify import lower
from aot.codegen.kernel_source import (
    SourceWriter,
    kernel_name,
    module_source,
    prologue,
    strided_rows,
    transposed_width,
    write_body,
)
from aot.codegen.launch import (
    HEURISTIC,
    NUM_STAGES,
    Launch,
    index_type,
    kernel_params,
    max_value,
    plan_launch,
    plan_tiled,
)
from aot.codegen.valuegraph import Builder, NotFusible, Unsupported, walk
from aot.dtypes import ITEMSIZE
from aot.layout import is_row_major
from aot.schema import Buf, Kernel, KernelParam, Program, Step, StepKind, TensorSpec


@dataclass(frozen=True)
class Rendered:
    name: str  # the @triton.jit function (and PTX entry) name
    source: str
    signature: dict[str, str]  # parameter → Triton type ("*fp16", "i32")
    params: tuple[KernelParam, ...]
    args: tuple[Any, ...]  # step arguments in parameter order
    outputs: tuple[str, ...]
    grid: tuple[str, ...]
    num_warps: int
    num_stages: int
    config: dict[str, Any]
    ops: tuple[str, ...]
    bytes_moved: str


def kernel_id(source: str, signature: dict, config: dict) -> str:
    """Content hash of a kernel: identical kernels (12 GPT layers) share one id and one compile."""
    text = json.dumps({"source": source, "signature": signature, "config": config}, sort_keys=True)
    return "k_" + hashlib.sha256(text.encode()).hexdigest()[:16]


def kernel_record(kernel_id: str, r: Rendered, results: dict, archs: tuple[str, ...]) -> Kernel:
    """The bundle's record of a rendered kernel compiled for ``archs`` (``results``: (id, arch) →
    the compile result); its PTX entry's trailing scratch parameters are counted from the first arch."""
    ptx_params = results[(kernel_id, archs[0])].meta["ptx_params"]
    return Kernel(
        id=kernel_id,
        name=r.name,
        source=r.source,
        params=r.params,
        num_warps=r.num_warps,
        num_stages=r.num_stages,
        shared={a: results[(kernel_id, a)].meta["shared"] for a in archs},
        archs=archs,
        ops=r.ops,
        config=dict(r.config, global_scratch_size=0, profile_scratch_size=0, signature=dict(r.signature)),
        bytes_moved=r.bytes_moved,
        scratch_params=ptx_params - len(r.params),
        dependent_launch=tuple(a for a in archs if results[(kernel_id, a)].meta["dependent_launch"]),
    )


def kernel_step(
    kernel_id: str, r: Rendered, reference: tuple[Step, ...], in_place: dict[str, str] | None = None
) -> Step:
    """The program step that launches rendered kernel ``kernel_id`` on its own arguments and grid,
    standing for the ATen steps ``reference`` (``in_place``: ``Step.in_place``)."""
    return Step(
        kind=StepKind.KERNEL,
        target=kernel_id,
        args=r.args,
        kwargs={},
        outputs=r.outputs,
        grid=r.grid,
        reference=reference,
        in_place=in_place or {},
    )


@dataclass(frozen=True)
class SiteKernels:
    """A pass's kernels for its sites, compiled (``compile_site_kernels``): each site's kernel id
    (in the order given), the ids that failed to compile, the new kernels' records and cubins."""

    ids: list[str]
    failed: dict[str, str]
    records: dict[str, Kernel]
    cubins: dict[tuple[str, str], bytes]

    def program_with(self, program: Program, steps: list[Step | None]) -> Program:
        """``program`` with ``steps`` (None: a step folded into a kernel's reference) and the new
        kernels."""
        kept = tuple(s for s in steps if s is not None)
        return replace(program, steps=kept, kernels=program.kernels + tuple(self.records.values()))


def compile_site_kernels(
    program: Program,
    rendered: list[Rendered],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
    what: str,
    stays: str,
) -> SiteKernels:
    """Compile one kernel per site (identical kernels once); a kernel that fails is said (``what``
    kernel NAME failed to compile, ``stays``) and its sites keep their steps; a kernel the
    program already has gets no second record."""
    ids = [kernel_id(r.source, r.signature, r.config) for r in rendered]
    todo = dict(zip(ids, rendered))
    results, failed = compile_kernels(list(todo.items()))
    for kid, why in failed.items():
        say(f"  warning: {what} kernel {todo[kid].name} failed to compile, {stays}: {why}")
    existing = {k.id for k in program.kernels}
    records = {
        kid: kernel_record(kid, r, results, archs)
        for kid, r in todo.items()
        if kid not in failed and kid not in existing
    }
    cubins = {(kid, a): results[(kid, a)].cubin for kid in records for a in archs}
    return SiteKernels(ids, failed, records, cubins)


def steps_as_kernels(
    program: Program,
    at: list[int],
    rendered: list[Rendered],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
    what: str,
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with the step at each of ``at`` run by its ``rendered`` kernel, the step its
    reference; one whose kernel fails to compile stays the library call. Says how many run as
    kernels (``what``: the step's kind, "gather"); also the cubins."""
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, what, "the library call stays"
    )
    steps: list[Step | None] = list(program.steps)
    done = 0
    for i, kid, r in zip(at, built.ids, rendered):
        if kid not in built.failed:
            steps[i] = kernel_step(kid, r, (program.steps[i],))
            done += 1
    if done:
        say(f"  {done} {what}s run as kernels")
    return built.program_with(program, steps), built.cubins


def render_kernel(
    steps: list[Step],
    outputs: list[str],
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
    not_roots: frozenset[str] = frozenset(),
) -> Rendered:
    """The Triton kernel computing ``outputs`` with the ATen ``steps`` of one group."""
    b = Builder(buffers, known, not_roots)
    for step in steps:
        try:
            lower(b, step)
        except Unsupported as e:
            raise NotFusible(str(e)) from None
    try:
        out_nodes = [b.env[o] for o in outputs]
    except KeyError as e:
        raise NotFusible(f"output {e} is not computed by the group") from None
    if not out_nodes:
        raise NotFusible("nothing to compute")
    # a permutation back (``Node.order``) as an output: stored from its input, in that order
    permuted = {i: n.inputs[0] for i, n in enumerate(out_nodes) if n.kind == "remap" and n.order}
    permuted = {i: n for i, n in permuted.items() if is_row_major(b.spec(outputs[i]).order)}
    order = walk([permuted.get(i, n) for i, n in enumerate(out_nodes)])
    reduces = [n for n in order if n.kind == "reduce"]
    out_shapes = [b.shape(o) for o in outputs]

    def maxv(e) -> int:
        try:
            return max_value(sympy.sympify(e), ranges)
        except (TypeError, ValueError) as err:
            raise NotFusible(f"size {e} cannot be bounded: {err}") from None

    out_numels = [ix.numel(s) for s in out_shapes]
    out_dtypes = [b.spec(o).dtype for o in outputs]
    orders = [b.spec(o).order for o in outputs]
    layouts = [None if is_row_major(p) else (shape, p) for shape, p in zip(out_shapes, orders)]
    for i, stored in permuted.items():  # a row-major output (checked above)
        out_nodes[i], layouts[i] = stored, (stored.shape, out_nodes[i].order)

    def written(launch: Launch) -> SourceWriter:
        w = SourceWriter(launch)
        w.out_layouts = layouts
        write_body(w, launch, order, out_nodes, out_dtypes)
        return w

    launch = plan_launch(reduces, out_numels, maxv)
    first = next((lay for lay in layouts if lay is not None), None)
    if launch.mode == "pointwise" and first is not None:  # x walks that output's memory, in order
        launch = replace(launch, full_lin=ix.from_memory(launch.full_lin, *first))
    w = written(launch)
    width = transposed_width(w.load_lins) if launch.mode == "pointwise" else None
    tiled = plan_tiled(out_numels[0], width, len(outputs), maxv) if width is not None else None
    if tiled is not None:  # reads an input transposed: tiles coalesce both its loads and the stores
        launch, w = tiled, written(tiled)
    if launch.mode == "single" and strided_rows(w.load_lins):  # coalesce along the rows instead
        wide = plan_launch(reduces, out_numels, maxv, strided=True)
        if wide.config != launch.config:
            launch, w = wide, written(wide)

    # buffers touched, for the index width and the traffic estimate
    touched = [(buf, b.shape(buf), dt) for buf, dt in w.ptr_dtypes.items()] + [
        (o, s, dt) for o, s, dt in zip(outputs, out_shapes, out_dtypes)
    ]
    shapes = {ix.numel(n.shape) for n in order} | {ix.numel(s) for _, s, _ in touched}  # views included
    config = dict(launch.config)
    index_ty = index_type(max([launch.domain_max] + [maxv(n) for n in shapes]), config)
    traffic = sum((ix.numel(s) * ITEMSIZE[dt] for _, s, dt in touched), sympy.Integer(0))

    body = "\n".join(prologue(launch, index_ty) + w.outer)
    sizes = sorted({m for m in re.findall(r"\bs_([A-Za-z_][A-Za-z0-9_]*)\b", body)})
    unknown = [s for s in sizes if s not in ranges]
    if unknown:
        raise NotFusible(f"size symbols {unknown} have no declared range")
    params, signature, args = kernel_params(
        w.ptrs, w.ptr_dtypes, list(zip(outputs, out_dtypes)), sizes, index_ty
    )

    name = kernel_name(steps)
    config.update(
        {"heuristic": HEURISTIC, "index": index_ty, "num_warps": launch.num_warps, "num_stages": NUM_STAGES}
    )
    note = ""
    if reduces:
        note = f"rows = {ix.size_text(launch.rows)}, reduced extent = {ix.size_text(launch.width)}"
    elif launch.mode == "tiled":
        note = f"rows = {ix.size_text(launch.rows)}, columns = {ix.size_text(launch.width)}"
    source = module_source(name, steps, signature, config, launch.mode, body, launch.grid, note)
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=tuple(args),
        outputs=tuple(outputs),
        grid=launch.grid,
        num_warps=launch.num_warps,
        num_stages=NUM_STAGES,
        config=config,
        ops=tuple(s.target for s in steps),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def standalone_step(step: Step, rendered: Rendered, kernel_id: str, rendered_from: Step) -> Step:
    """The kernel step that stands for one ATen ``step`` (its reference), rendered on its own
    rather than fused (a lookup's gather, a max pool) from ``rendered_from``, the same step as the
    program had it then: the rendered arguments on ``step``'s own buffers, where they name the
    step's (a gather of a padded table's real rows reads the weight itself, a root)."""

    def bufs(args) -> list[str]:
        return [a.name for a in args if isinstance(a, Buf)]

    rename = dict(zip(bufs(rendered_from.args), bufs(step.args)))
    rename.update((a, b) for a, b in zip(rendered_from.outputs, step.outputs) if a is not None)
    return Step(
        kind=StepKind.KERNEL,
        target=kernel_id,
        args=tuple(Buf(rename.get(a.name, a.name)) if isinstance(a, Buf) else a for a in rendered.args),
        kwargs={},
        outputs=tuple(rename.get(o, o) for o in rendered.outputs),
        grid=rendered.grid,
        reference=(step,),
    )
