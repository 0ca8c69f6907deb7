"""What every stage must agree on about a program's steps, written once: which buffers a step
reads and writes, which ops return a view of their input, the steps a device runs without the
kernels, and when each buffer dies.

The tracer writes programs, codegen rewrites them, the packager plans their memory, the loader
and the verifiers run them; all of them ask these questions here.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aot.allowed_ops import STATE_WRITE_OPS
from aot.dtypes import ITEMSIZE
from aot.errors import BundleError, EnvError
from aot.schema import Buf, Program, Step, StepKind, TensorSpec
from aot.symexpr import compile_expr

# The views that give their input a new shape and keep each element at its row-major index
# (the rows of a GEMM's A read through one are its input's rows); ``aot.codegen.lower_views``
# folds a wider set that also keeps the flat index (``SAME_INDEX_VIEWS``: squeezes, aliases).
RESHAPE_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})

# Ops whose result may share storage with their first tensor argument: they allocate nothing, a
# kernel reads through them by index arithmetic, and the buffer they view lives as long as they do.
VIEW_OPS = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.permute.default",
        "aten.transpose.int",
        "aten.t.default",
        "aten.expand.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.narrow.default",
        "aten.alias.default",
        "aten.detach.default",
        "aten.as_strided.default",
        "aten.split_with_sizes.default",
        "aten.split.Tensor",
        "aten.unbind.int",
    }
)


# The loader runs only ``aot.allowed_ops`` (of these: mm, addmm, _addmm_activation, bmm, the ones
# ``aot.codegen.gemm`` makes sites of and ``TAIL_PRODUCERS`` names); the rest are
# here so that an op added there counts without a second look. Not counted: convolution (cuDNN),
# and scaled_dot_product_attention, whose flash and memory-efficient kernels call no library (only
# its math fallback, listed, runs bmm: a head size those kernels refuse, float64).
CUBLAS_OPS = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten._addmm_activation",
        "aten.bmm",
        "aten.baddbmm",
        "aten.addbmm",
        "aten.mv",
        "aten.addmv",
        "aten.dot",
        "aten.vdot",
        "aten.inner",
        "aten.linear",
        "aten.bilinear",
        "aten._trilinear",
        "aten.matmul",
        "aten.einsum",
        "aten.tensordot",
        "aten.chain_matmul",
        "aten.linalg_multi_dot",
        "aten.cdist",
        "aten._cdist_forward",
        "aten._euclidean_dist",
        "aten._scaled_mm",
        "aten._int_mm",
        "aten._scaled_dot_product_attention_math",
    }
)
CUDNN_OPS = frozenset(
    {"aten.convolution", "aten.cudnn_convolution", "aten.conv2d", "aten.conv1d", "aten.conv3d"}
)
ATTENTION_OPS = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention"})
# what a process pays the first time a library runs, on an H100 with torch 2.11 (device MiB,
# bench/memory_stages.py): ATen's kernel images (its elementwise, copy and pooling kernels; gpt
# took 90 MiB less once its lookups were kernels, with its flash attention still ATen's), and
# cuBLAS's kernels and workspace
FIRST_CALL_MIB = {"aten": 92, "cublas": 98}


def calls_cublas(step: Step) -> bool:
    """Whether ``step`` is a library call that runs cuBLAS (``CUBLAS_OPS``)."""
    return step.kind == StepKind.ATEN and ".".join(step.target.split(".")[:2]) in CUBLAS_OPS


def library_of(step: Step) -> str | None:
    """Which library a GPU run of ``step`` launches: ``"cublas"``, ``"cudnn"``, ``"attention"``
    (ATen's flash or memory-efficient attention), ``"aten"`` (ATen's other kernels), or None (a
    kernel step of the bundle's, or a view, which launches nothing). Every convolution counts as
    cuDNN's, which is how the codegen lays them out to run (channels-last, half precision); ATen
    keeps a few kernels of its own (an fp32 NCHW depthwise convolution may run one)."""
    if step.kind != StepKind.ATEN or step.target in VIEW_OPS:
        return None
    op = ".".join(step.target.split(".")[:2])
    if op in CUBLAS_OPS:
        return "cublas"
    if op in CUDNN_OPS:
        return "cudnn"
    return "attention" if op in ATTENTION_OPS else "aten"


def fresh_name(base: str, *taken: Container[str]) -> str:
    """``base``, with ``_`` appended until none of ``taken`` (buffer specs, names) holds it: the
    name of a buffer a rewrite adds."""
    name = base
    while any(name in t for t in taken):
        name += "_"
    return name


def buffers_in(value: Any) -> Iterator[str]:
    """Every buffer an argument names, in order, however deep (``aten.cat([w, x])``)."""
    if isinstance(value, Buf):
        yield value.name
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from buffers_in(v)


def tensor_specs(program: Program) -> dict[str, TensorSpec]:
    """The spec of every tensor the program names: its weights, inputs and buffers."""
    return {
        **{w.name: w.spec for w in program.weights},
        **{i.name: i.spec for i in program.inputs},
        **program.buffers,
    }


def given_names(program: Program) -> list[str]:
    """The buffers that exist before the program's first step: its weights, its inputs, and the
    scratch the runner keeps for its kernels (``Program.scratch``)."""
    return [*(w.name for w in program.weights), *(i.name for i in program.inputs), *program.scratch]


def check_scratch(program: Program, where: str) -> None:
    """``Program.scratch`` as the runners rely on it: each name a buffer with a static int32 spec
    (arrival counters), neither a weight nor an input, that no step writes as an output and only
    kernel steps read (``BundleError`` otherwise). ``scratch_shapes`` gives their shapes to allocate."""
    taken = {w.name for w in program.weights} | {i.name for i in program.inputs}
    for name in program.scratch:
        spec = program.buffers.get(name)
        if spec is None or spec.dtype != "int32" or name in taken or not all(d.isdigit() for d in spec.shape):
            raise BundleError(
                f"{where}: scratch {name[:40]!r} must be an int32 buffer of its own, of a static shape "
                f"(got {spec.dtype + str(list(spec.shape)) if spec else 'no spec'}"
                f"{', a weight or input name' if name in taken else ''})"
            )
    scratch = set(program.scratch)
    for step in program.steps:
        bad = scratch & set(step_writes(step))
        if not bad and step.kind != StepKind.KERNEL:
            bad = scratch & set(step_reads(step))
        if bad:
            raise BundleError(
                f"{where}: step {step.target[:40]!r} writes or reads scratch {sorted(bad)[0][:40]!r}; "
                "only kernels read it, and nothing writes it as an output"
            )


# The greedy step's kernel (``Program.greedy``, ``aot.codegen.greedy``): its parameters (name,
# kind, element type; "" where it follows the program: the logits' and the attention mask's), in
# the order the loader passes them.
GREEDY_PARAMS = (
    ("logits", "ptr", ""),
    ("logits_stride", "i64", ""),
    ("tokens", "ptr", "int64"),
    ("tokens_stride", "i64", ""),
    ("step", "i64", ""),
    ("input_ids", "ptr", "int64"),
    ("position_ids", "ptr", "int64"),
    ("cache_position", "ptr", "int64"),
    ("attention_mask", "ptr", ""),
    ("mask_stride", "i64", ""),
    ("finished", "ptr", "bool"),
    ("padding", "ptr", "int64"),
    ("eos_ids", "ptr", "int64"),
    ("n_eos", "i64", ""),
    ("values", "ptr", "float32"),
    ("indices", "ptr", "int32"),
    ("counts", "ptr", "int32"),
    ("rows", "i64", ""),
)


def greedy_params(values: dict[str, int]) -> list[tuple[str, int]]:
    """The greedy kernel's launch parameters, (kind, value) in ``GREEDY_PARAMS`` order, from
    ``values`` by name (a pointer's device address, a size): what both loaders pack."""
    return [(kind, values[name]) for name, kind, _ in GREEDY_PARAMS]


def check_greedy(program: Program, where: str) -> None:
    """``Program.greedy`` as the loader relies on it: a kernel of the program, taking exactly
    ``GREEDY_PARAMS`` (the logits' element type the program's first output's, the mask's its
    ``attention_mask`` input's); ``BundleError`` otherwise."""
    if not program.greedy:
        return
    kernel = next((k for k in program.kernels if k.id == program.greedy), None)
    if kernel is None:
        raise BundleError(
            f"{where}: greedy names kernel {program.greedy[:40]!r}, which the program does not define"
        )
    specs = tensor_specs(program)
    follows = {
        "logits": specs[program.outputs[0]].dtype if program.outputs and program.outputs[0] in specs else "?",
        "attention_mask": specs["attention_mask"].dtype if "attention_mask" in specs else "?",
    }
    want = [(name, kind, dtype or follows.get(name, "")) for name, kind, dtype in GREEDY_PARAMS]
    got = [(p.name, p.kind.value, p.dtype) for p in kernel.params]
    if got != want:
        bad = next((g, w) for g, w in zip([*got, None], [*want, None]) if g != w)
        raise BundleError(
            f"{where}: greedy kernel {kernel.name[:40]!r} takes parameter {bad[0]}, expected {bad[1]} "
            "(aot.program.GREEDY_PARAMS); rebuild the bundle"
        )


def scratch_shapes(program: Program) -> dict[str, tuple[int, ...]]:
    """Each scratch buffer's shape (``check_scratch`` made them static), by name."""
    return {name: tuple(int(d) for d in program.buffers[name].shape) for name in program.scratch}


def scratch_args(step: Step, program: Program) -> list[str]:
    """The scratch buffers (``Program.scratch``) ``step`` is passed, which it must leave zeroed."""
    return [a.name for a in step.args if isinstance(a, Buf) and a.name in program.scratch]


def step_reads(step: Step) -> list[str]:
    """The buffers ``step`` reads, in argument order (a kernel's output pointers excluded)."""
    reads = [*buffers_in(step.args), *buffers_in(tuple(step.kwargs.values()))]
    if step.kind == StepKind.KERNEL:
        written = set(step.outputs)
        reads = [r for r in reads if r not in written]
    return reads


def all_steps(program: Program) -> list[Step]:
    """The program's steps and those of its GEMM candidates (what a tuning table's plans run)."""
    return [*program.steps, *(s for site in program.alternatives for c in site.candidates for s in c.steps)]


def buffers_read(steps: Iterable[Step]) -> set[str]:
    """The buffers ``steps`` read on either path: their arguments and their reference steps'."""
    read: set[str] = set()
    for step in steps:
        read.update(step_reads(step))
        for ref in step.reference:
            read.update(step_reads(ref))
    return read


def producer_of(steps: Sequence[Step]) -> dict[str, int]:
    """Each buffer → the index of the step whose outputs name it (the last, should two)."""
    return {o: i for i, s in enumerate(steps) for o in s.outputs if o is not None}


def readers_of(steps: Sequence[Step]) -> dict[str, list[int]]:
    """Each buffer → the indices of the steps that read it (``step_reads``), ascending, each once."""
    out: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        for r in dict.fromkeys(step_reads(s)):
            out.setdefault(r, []).append(i)
    return out


def step_writes(step: Step) -> list[str]:
    return [o for o in step.outputs if o is not None]


def is_view(step: Step) -> bool:
    """Whether the step's result shares its first argument's memory: a view, or a state write
    (``aot.allowed_ops.STATE_WRITE_OPS``), whose result is the state it wrote into."""
    return step.kind == StepKind.ATEN and (step.target in VIEW_OPS or step.target in STATE_WRITE_OPS)


def state_aliases(program: Program) -> set[str]:
    """The program's state (``Program.state``) and every buffer that shares its memory: views of
    it, state writes' results, a kernel's in-place outputs into it."""
    names = set(program.state)
    for step in program.steps:
        if is_view(step) and step.args and isinstance(step.args[0], Buf) and step.args[0].name in names:
            names.update(step_writes(step))
        names.update(o for o, target in step.in_place.items() if target in names)
    return names


def state_next(program: Program, last: int, state: set[str]) -> bool:
    """Whether the first step after ``last`` that launches anything (views launch nothing) reads
    or writes ``state`` (``state_aliases``); False where no step follows."""
    for step in program.steps[last + 1 :]:
        if {*step_reads(step), *step_writes(step)} & state:
            return True
        if not (step.kind == StepKind.ATEN and step.target in VIEW_OPS):
            return False
    return False


def reference_steps(program: Program) -> list[Step]:
    """The program with each kernel step replaced by its reference ATen steps: what a device
    without the kernels (the CPU) runs."""
    out: list[Step] = []
    for step in program.steps:
        out.extend(step.reference if step.kind == StepKind.KERNEL else (step,))
    return out


def frees_after(steps: Sequence[Step], given: Iterable[str], outputs: Sequence[str]) -> list[tuple[str, ...]]:
    """For each step, the buffers to drop after it (those it was the last to use), checking on the
    way that every read comes after its write and every output is written. ``given``: the
    buffers that exist before the first step (inputs, weights); they and the outputs are kept."""
    known = set(given)
    keep = known | set(outputs)
    last_use: dict[str, int] = {}
    for i, step in enumerate(steps):
        reads = step_reads(step)
        missing = set(reads) - known
        if missing:
            raise BundleError(
                f"step {i} ({step.target[:60]}) reads {sorted(missing)[:3]} before they are written"
            )
        for r in reads:
            last_use[r] = i
        known.update(step_writes(step))
    unwritten = set(outputs) - known
    if unwritten:
        raise BundleError(f"program outputs {sorted(unwritten)[:3]} are never written")
    frees: list[list[str]] = [[] for _ in steps]
    for name, i in last_use.items():
        if name not in keep:
            frees[i].append(name)
    for i, step in enumerate(steps):  # written but never read (unused multi-outputs): dead at once
        frees[i].extend(o for o in step_writes(step) if o not in last_use and o not in keep)
    return [tuple(f) for f in frees]


def lifetimes(program: Program) -> list[tuple[str, int, int]]:
    """(buffer, first step, last step) for every buffer that owns memory: a view's uses count as
    uses of the buffer it views; outputs live past the last step."""
    root: dict[str, str] = {}
    born: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, step in enumerate(program.steps):
        reads = step_reads(step)
        for r in reads:
            last[root.get(r, r)] = i
        for o in step_writes(step):
            if o in step.in_place:  # a kernel's write into a buffer it was given (its state)
                root[o] = root.get(step.in_place[o], step.in_place[o])
            elif is_view(step) and reads:
                root[o] = root.get(reads[0], reads[0])
            else:
                born[o] = i
                last.setdefault(o, i)
    for o in program.outputs:
        last[root.get(o, o)] = len(program.steps)
    return [(b, born[b], last[b]) for b in born]


def spec_bytes(spec: TensorSpec, sizes: dict[str, int]) -> int:
    """Bytes of a tensor of ``spec`` at ``sizes``."""
    n = ITEMSIZE.get(spec.dtype, 8)
    for s in spec.shape:
        n *= compile_expr(s)(sizes)
    return n


def peak_bytes(program: Program, sizes: dict[str, int]) -> int:
    """The most bytes the program's buffers hold at once at ``sizes``, freeing each after its last
    use (``lifetimes``): the memory plan's number for one bucket."""
    return peak_of(program, lambda spec: spec_bytes(spec, sizes))


def peak_of(program: Program, nbytes: Callable[[TensorSpec], int]) -> int:
    """The most bytes the program's buffers hold at once, each buffer taking ``nbytes(spec)``."""
    events: list[tuple[int, int]] = []
    for name, first, end in lifetimes(program):
        spec = program.buffers.get(name)
        if spec is None:
            raise BundleError(f"step result {name[:60]!r} has no declared buffer (dtype and shape)")
        n = nbytes(spec)
        events += [(first, n), (end + 1, -n)]
    peak = live = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    return peak


# What a runtime without libraries (``aot.runtime``) runs besides compiled kernels, and what
# ``aotpack build --library-free`` may leave: views whose result is the same bytes read in the
# same row-major order (kernels get the base's address), and copies the driver makes.
SAME_BYTES_VIEWS = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.alias.default",
        "aten.detach.default",
        "aten.flatten.using_ints",
    }
)
DRIVER_COPIES = frozenset({"aten.clone.default", "aten.contiguous.default"})  # of a row-major buffer


# Outputs of at least this many bytes per bucket are computed after a CUDA graph, into memory the
# caller owns, rather than copied out of the graph's (``aot.loader.gpu``, ``aot.runtime.runner``).
# Below it, one more eager launch per call costs more host time than the copy costs the GPU.
TAIL_MIN_BYTES = 4 << 20


# What may compute an output after the graph: a kernel, or these library calls, whose results are
# always new memory (an op that may return a view of its input, such as ``diagonal``, must not:
# its result would be graph or weight memory handed to the caller)
TAIL_PRODUCERS = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten._addmm_activation.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.convolution.default",
    }
)


def output_tail(steps: tuple[Step, ...], outputs: tuple[str, ...]) -> int | None:
    """Where the steps that only compute ``outputs`` begin: each output's producing step (the
    first step behind it that is not a view: a kernel or a ``TAIL_PRODUCERS`` call) and the views
    between, when they are the program's last steps with nothing else among them; None when there
    are none such (an output that is an input or weight, or another step after the producer) or
    they are the whole program."""
    writer = {w: i for i, step in enumerate(steps) for w in step_writes(step)}
    chain: set[int] = set()
    for name in outputs:
        i = writer.get(name)
        while i is not None and is_view(steps[i]):
            chain.add(i)
            reads = step_reads(steps[i])
            i = writer.get(reads[0]) if reads else None
        if i is None or not (steps[i].kind == StepKind.KERNEL or steps[i].target in TAIL_PRODUCERS):
            return None
        chain.add(i)
    start = min(chain)
    if start == 0 or any(i not in chain and not is_view(steps[i]) for i in range(start, len(steps))):
        return None
    return start


def live_steps(program: Program) -> tuple[Step, ...]:
    """``program.steps`` without the steps whose results nothing reads (a weight's transpose that
    a GEMM kernel no longer needs: the kernel reads the weight itself)."""
    needed = set(program.outputs)
    keep = []
    for step in reversed(program.steps):
        if step.kind == StepKind.KERNEL or any(o in needed for o in step_writes(step)):
            keep.append(step)
            needed.update(step_reads(step))
    return tuple(reversed(keep))


ROW_SLICE = "aten.slice.Tensor"  # of the last dim, step 1: rows apart, copied out with a 2-D copy


@dataclass(frozen=True)
class Alias:
    """Where a view's elements are: in ``base`` (a buffer, input or weight), from element
    ``offset``; with ``width`` > 0, rows of ``width`` elements ``pitch`` apart (a slice of the last
    dim: ``gpt``'s logits cut from their padded GEMM), which only a 2-D driver copy reads."""

    base: str
    offset: int = 0
    width: int = 0
    pitch: int = 0


def _order_kept(step: Step, src: TensorSpec) -> bool:
    """A permute that moves only dims of one element (``[B, H, 1, D] -> [B, 1, H, D]``): the
    elements keep their order in memory, so it is a view at the same address."""
    from aot.manifest_text import static_size

    if step.target != "aten.permute.default" or len(step.args) != 2 or src.order:
        return False
    dims = step.args[1]
    rank = len(src.shape)
    if not isinstance(dims, (list, tuple)) or sorted(
        d % max(rank, 1) for d in dims if type(d) is int
    ) != list(range(rank)):
        return False
    moved = [d % rank for d in dims if static_size(src.shape[d % rank]) != 1]
    return moved == sorted(moved)


def _whole(step: Step, src: TensorSpec, out: TensorSpec) -> bool:
    """A slice that keeps every element (``x[:, 0:]``, ``h[:, -1:]`` of ``[B, 1, C]``: its shape
    is its input's) or a select of a dim of one element (``logits[:, -1]`` of ``[B, 1, V]``): a
    view at the same address, its elements in order."""
    from aot.manifest_text import static_size

    args = [*step.args[1:], None, None, None, None][:4]
    rank = len(src.shape)
    if src.order or not rank or type(args[0]) is not int:
        return False
    if step.target == "aten.slice.Tensor":
        return args[3] in (None, 1) and tuple(out.shape) == tuple(src.shape)
    if step.target == "aten.select.int":
        return static_size(src.shape[args[0] % rank]) == 1 and args[1] in (0, -1)
    return False


def _slice_args(step: Step) -> tuple:
    """(dim, start, end, step) of an ``aten.slice.Tensor`` step, its defaults filled in (end None:
    to the end)."""
    args = [*step.args[1:], *([None] * 4)][:4]
    return args[0], args[1] or 0, args[2], args[3] or 1


def _leading_run(step: Step, src: TensorSpec) -> int | None:
    """Where a slice of step 1 whose dims before the sliced one all hold one element starts, in
    elements from its input's (``position_ids[:, :seq]`` of ``[1, P]``): its elements are one run
    in row-major order, a view at that offset. None for any other slice, or where the offset
    depends on a size (the dims after the sliced one are not static)."""
    from aot.manifest_text import static_size

    dim, start, _, every = _slice_args(step)
    rank = len(src.shape)
    if src.order or not rank or type(dim) is not int or type(start) is not int or every != 1 or start < 0:
        return None
    dim %= rank
    if any(static_size(d) != 1 for d in src.shape[:dim]):
        return None
    inner = 1
    for d in src.shape[dim + 1 :]:
        size = static_size(d)
        if size is None:
            return None if start else 0
        inner *= size
    return start * inner


def aliases(program: Program, steps: Sequence[Step]) -> dict[str, Alias]:
    """Every view's ``Alias`` among ``steps`` (``SAME_BYTES_VIEWS``, slices that keep one run of
    elements and ``ROW_SLICE``s); a view that is neither is left out (``check_library_free``
    refuses it)."""
    from aot.manifest_text import static_size

    specs = tensor_specs(program)
    out: dict[str, Alias] = {}
    for step in steps:
        for result, target in step.in_place.items():  # a kernel's write into its state: the state
            out[result] = out.get(target, Alias(target))
        if step.kind != StepKind.ATEN or not step.args or not isinstance(step.args[0], Buf):
            continue
        src = step.args[0].name
        at = out.get(src, Alias(src))
        result = step.outputs[0] if step.outputs else None
        spec, src_spec = specs.get(result or ""), specs.get(src)
        if result is None or spec is None or src_spec is None:
            continue
        if step.target in SAME_BYTES_VIEWS or _order_kept(step, src_spec) or _whole(step, src_spec, spec):
            if at.width and (not spec.shape or static_size(spec.shape[-1]) != at.width):
                continue  # rows apart must stay rows: only the dims before them may change
            out[result] = at
        elif step.target == ROW_SLICE and not at.width and (lead := _leading_run(step, src_spec)) is not None:
            out[result] = Alias(at.base, at.offset + lead)
        elif step.target == ROW_SLICE and not at.width:
            dim, start, end, stride = _slice_args(step)
            rank = len(src_spec.shape)
            size = static_size(src_spec.shape[-1]) if rank else None
            if type(dim) is not int or dim % max(rank, 1) != rank - 1 or stride != 1 or size is None:
                continue
            if type(start) is not int or (end is not None and type(end) is not int):
                continue
            end = size if end is None else min(end, size)
            if not 0 <= start < end:
                continue
            out[result] = Alias(at.base, at.offset + start, end - start, size)
    return out


def check_library_free(
    program: Program, steps: Sequence[Step], where: str, line_of: Callable[[Step], str] | None = None
) -> None:
    """Refuse (``EnvError``) the first of ``steps`` (``live_steps``) that is not a compiled kernel, a
    view (``aliases``) or a copy in ``DRIVER_COPIES`` (of no sliced rows): what a runtime without libraries
    (``aot.runtime``) cannot run, then a tensor that is not row-major. The message names the
    program, step, target and result, and the model line that made it where ``line_of`` knows it."""
    views = aliases(program, steps)
    rows_apart = {name for name, alias in views.items() if alias.width}
    runs = [
        (
            step.kind == StepKind.KERNEL
            or step.target in DRIVER_COPIES
            or all(o in views for o in step.outputs if o)
        )
        and not rows_apart
        & set(step_reads(step) if step.kind == StepKind.KERNEL or step.target in DRIVER_COPIES else ())
        for step in steps
    ]
    # a library call first; a view that only feeds one (a weight's transpose) is named only alone
    calls = [i for i, ok in enumerate(runs) if not ok and not is_view(steps[i])]
    refused = [i for i, ok in enumerate(runs) if not ok]
    if refused:
        i = (calls or refused)[0]
        step = steps[i]
        out = ", ".join(o for o in step.outputs if o) or "-"
        what = "a library call" if calls else "a view whose layout a kernel cannot read in place"
        line = line_of(step) if line_of is not None else ""
        made = f", made at {line}" if line else ""
        raise EnvError(
            f"{where}: step {i} ({step.target} -> {out}{made}) is {what}; aotpack-rt runs library-free "
            f"bundles only (every step a compiled kernel or a driver copy): rebuild with "
            f"`aotpack build --library-free`, or load it with the torch loader (`aotpack load`)"
        )
    for name, spec in [*((w.name, w.spec) for w in program.weights), *program.buffers.items()]:
        if spec.order and list(spec.order) != list(range(len(spec.shape))):
            raise EnvError(
                f"{where}: tensor {name!r} is laid out in memory order {list(spec.order)}; aotpack-rt runs "
                f"row-major bundles: rebuild with --no-channels-last --library-free"
            )
