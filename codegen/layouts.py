"""Convolutions as cuDNN runs them fastest: channels-last, with the bias added by the kernel after.

``channels_last`` chooses which buffers and weights a program keeps NHWC in memory. cuDNN convolves half-precision NCHW tensors by transposing the input to NHWC, convolving, and
transposing the result back: two extra kernels per convolution (on an H200, resnet50 at batch 1
spent 35 x 3.5 us and 19 x 1.7 us on them, half its convolution time). Fed NHWC tensors and NHWC
weights it runs one kernel and returns NHWC, and its depthwise kernels are twice as fast. So the
codegen gives ``aot.layout.CHANNELS_LAST`` to

- every 4-D convolution's output, and its weight (laid out so when the bundle loads), unless the
  output reaches the program's outputs, through views or directly (a caller gets row-major
  tensors), or the weight is also read by something else;
- the input of such a convolution, where a kernel writes it (its stores follow the order) and every
  convolution reading it is channels-last too (one that is not would return NHWC where the program
  declares NCHW: still right, but a copy for every kernel that reads it);
- the output of a pooling op whose input is channels-last, as ATen's pooling keeps its input's
  layout (and such a pool's input only when its output may be).

``split_conv_bias`` moves a convolution's bias into the pointwise kernel that follows it.
``relayout_conv_inputs`` gives a channels-last convolution whose input no kernel writes (a program
input, say an image) a copy kernel that writes it NHWC: else ATen copies it with a kernel of its own
inside the convolution, and a process's first ATen kernel loads ATen's kernel images (92 MiB of
device memory on an H100, ``bench/memory_stages.py``).

A layout is a matter of speed alone: kernels index their loads and stores by it, the loader
allocates kernel outputs in it, and any tensor reaching a kernel in another layout is copied into
the declared one first (``aot.loader.gpu``).
"""

from __future__ import annotations

from dataclasses import replace

from aot.codegen.classify import classify
from aot.layout import CHANNELS_LAST
from aot.program import VIEW_OPS, fresh_name, producer_of, readers_of, tensor_specs
from aot.schema import Buf, NamedTensor, Program, Step, StepKind, TensorSpec

CONVOLUTION = "aten.convolution.default"
# ATen pooling whose result takes its input's layout
POOLS = frozenset(
    {
        "aten.max_pool2d_with_indices.default",
        "aten.max_pool2d.default",
        "aten.avg_pool2d.default",
        "aten._adaptive_avg_pool2d.default",
        "aten.adaptive_avg_pool2d.default",
    }
)
FLOATS = frozenset({"float16", "bfloat16", "float32"})


def split_conv_bias(program: Program) -> tuple[Program, int]:
    """``convolution(x, w, b)`` → ``convolution(x, w, None) + b.view(1, C, 1, 1)`` for a 2-D
    convolution whose bias is a weight: ATen adds a cuDNN convolution's bias with a kernel of its
    own (convnext_tiny at batch 8 spent 18 x 3.8 us a forward on them on an H200), while the
    add, a pointwise step, joins the kernel that reads the convolution. The same two roundings
    as ATen's on a GPU (convolution to the dtype, then the add). Returns how many were split."""
    weights = {w.name: w.spec for w in program.weights}
    steps: list[Step] = []
    buffers = dict(program.buffers)
    n = 0
    for step in program.steps:
        bias = step.args[2] if step.target == CONVOLUTION and len(step.args) > 2 else None
        out = step.outputs[0] if step.outputs else None
        spec = buffers.get(out) if out else None
        raw, row = f"{out}_nobias", f"{getattr(bias, 'name', '')}_row_{n}"
        if not (
            isinstance(bias, Buf)
            and bias.name in weights
            and spec is not None
            and len(spec.shape) == 4
            and weights[bias.name].dtype == spec.dtype  # the add then rounds as ATen's does
            and raw not in buffers
            and row not in buffers
        ):
            steps.append(step)
            continue
        buffers[raw] = spec
        buffers[row] = TensorSpec(spec.dtype, ("1", spec.shape[1], "1", "1"))
        steps.append(replace(step, args=(*step.args[:2], None, *step.args[3:]), outputs=(raw,)))
        steps.append(Step(StepKind.ATEN, "aten.view.default", (bias, [1, -1, 1, 1]), {}, (row,)))
        steps.append(Step(StepKind.ATEN, "aten.add.Tensor", (Buf(raw), Buf(row)), {}, (out,)))
        n += 1
    return (replace(program, steps=tuple(steps), buffers=buffers), n) if n else (program, 0)


def channels_last(program: Program) -> tuple[Program, int]:
    """``program`` with channels-last orders on its convolutions' buffers and weights (see the
    module doc); and how many convolutions run channels-last."""
    # before partitioning: no kernel step yet, so a step's reads are all the buffers it names
    steps = program.steps
    readers = {name: [steps[i] for i in idx] for name, idx in readers_of(steps).items()}
    producer = {name: steps[i] for name, i in producer_of(steps).items()}
    outputs, state = set(program.outputs), set(program.state)

    def reaches_output(name: str, seen: set[str]) -> bool:
        if name in outputs:
            return True
        for r in readers.get(name, []):
            if r.kind == StepKind.ATEN and r.target in VIEW_OPS:
                for o in r.outputs:
                    if o is not None and o not in seen:
                        seen.add(o)
                        if reaches_output(o, seen):
                            return True
        return False

    def eligible(name: str | None, any_dtype: bool = False) -> bool:
        spec = program.buffers.get(name) if name else None
        return (
            spec is not None
            and len(spec.shape) == 4
            and (any_dtype or spec.dtype in FLOATS)
            and name not in state
            and not reaches_output(name, {name})
        )

    def first_buf(step: Step) -> str | None:
        return step.args[0].name if step.args and isinstance(step.args[0], Buf) else None

    def _may_write(src: str) -> bool:  # a kernel writes it, and no row-major convolution reads it
        return (
            eligible(src)
            and _kernel_written(producer.get(src), program)
            and _conv_readers_agree(src, readers, cl_convs)
        )

    convs = [s for s in program.steps if s.kind == StepKind.ATEN and s.target == CONVOLUTION]
    convs = [s for s in convs if len(s.args) > 1 and isinstance(s.args[1], Buf)]
    cl_convs = {id(s) for s in convs if eligible(s.outputs[0])}
    pools = [s for s in program.steps if s.kind == StepKind.ATEN and s.target in POOLS]
    marked: set[str] = set()
    changed = True
    while changed:  # demotions only, so this ends
        changed = False
        marked = {s.outputs[0] for s in convs if id(s) in cl_convs}
        for s in convs:  # an input a kernel writes, when every convolution reading it is channels-last
            src = first_buf(s)
            if src is not None and src not in marked and _may_write(src):
                marked.add(src)
        for pool in pools:  # a pool keeps its input's layout
            src, outs = first_buf(pool), [o for o in pool.outputs if o is not None]
            if not all(
                eligible(o, any_dtype=True) and _conv_readers_agree(o, readers, cl_convs) for o in outs
            ):
                continue
            if src in marked or (src is not None and _may_write(src)):
                marked.add(src)
                marked.update(outs)
        # a row-major convolution, or a pool whose output may not be NHWC, must not be handed an
        # NHWC input: the convolution that makes it goes back to row-major
        for s in (*convs, *pools):
            src = first_buf(s)
            nhwc_out = (
                id(s) in cl_convs
                if s.target == CONVOLUTION
                else all(o in marked for o in s.outputs if o is not None)
            )
            maker = producer.get(src) if src in marked and not nhwc_out else None
            if maker is not None and id(maker) in cl_convs:
                cl_convs.discard(id(maker))
                changed = True
    cl_weights = set()
    for s in convs:
        w = s.args[1].name
        if id(s) in cl_convs and all(
            r.target == CONVOLUTION and id(r) in cl_convs and first_buf(r) != w for r in readers.get(w, [])
        ):
            cl_weights.add(w)
    if not cl_convs:
        return program, 0
    buffers = {
        name: replace(spec, order=CHANNELS_LAST) if name in marked else spec
        for name, spec in program.buffers.items()
    }
    weights = tuple(
        NamedTensor(w.name, replace(w.spec, order=CHANNELS_LAST))
        if w.name in cl_weights and len(w.spec.shape) == 4
        else w
        for w in program.weights
    )
    return replace(program, buffers=buffers, weights=weights), len(cl_convs)


def _kernel_written(step: Step | None, program: Program) -> bool:
    """Whether ``step``'s result comes out of a kernel (a step the fuser computes), whose stores
    can take any order."""
    return step is not None and classify(step, program.buffers) in ("pointwise", "reduction", "generator")


def _conv_readers_agree(name: str, readers: dict[str, list[Step]], cl_convs: set[int]) -> bool:
    return all(
        id(r) in cl_convs
        for r in readers.get(name, [])
        if r.kind == StepKind.ATEN and r.target == CONVOLUTION and r.args and r.args[0] == Buf(name)
    )


def relayout_conv_inputs(program: Program) -> tuple[Program, int]:
    """``convolution(x, w, ...)`` → ``convolution(clone(x), w, ...)`` where the convolution is
    channels-last (its weight is) and ``x`` is not: the clone, a pointwise step, becomes a kernel
    whose stores follow its output's NHWC order (module docstring). One copy per such input,
    shared by every convolution that reads it. Returns the program and how many copies."""
    weights = {w.name: w.spec for w in program.weights}
    specs = tensor_specs(program)
    copies: dict[str, str] = {}  # input -> its NHWC copy
    buffers = dict(program.buffers)
    steps: list[Step] = []
    for step in program.steps:
        x = step.args[0] if step.target == CONVOLUTION and step.args else None
        w = step.args[1] if x is not None and len(step.args) > 1 else None
        spec = specs.get(x.name) if isinstance(x, Buf) else None
        if (
            spec is None
            or not isinstance(w, Buf)
            or w.name not in weights
            or weights[w.name].order != CHANNELS_LAST
            or len(spec.shape) != 4
            or spec.order
            or spec.dtype not in FLOATS
        ):
            steps.append(step)
            continue
        if x.name not in copies:
            name = fresh_name(f"{x.name}_nhwc", specs, buffers)
            copies[x.name] = name
            buffers[name] = replace(spec, order=CHANNELS_LAST)
            steps.append(Step(StepKind.ATEN, "aten.clone.default", (x,), {}, (name,)))
        steps.append(replace(step, args=(Buf(copies[x.name]), *step.args[1:])))
    if not copies:
        return program, 0
    return replace(program, steps=tuple(steps), buffers=buffers), len(copies)
