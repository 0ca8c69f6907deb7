"""A LayerNorm's column sums with the weight of the GEMM after it, computed at build time.

``gemm_stats`` applies a LayerNorm after the GEMM that reads it (``LN(h) @ W^T = rstd * ((h *
scale) @ W^T) - rstd * mean * u + c``), which needs, per column n of the GEMM's output,
``u[n] = sum_k scale[k] W[n, k]`` and ``c[n] = sum_k shift[k] W[n, k]``. Both depend on weights
alone, so the build computes them once (fp32, from the weights as the bundle stores them) and
adds them to the program's weights as ``<W>`` + ``SCALE_SUM`` and ``SHIFT_SUM``: two ``[N]``
vectors a GEMM (24 KiB for GPT-2's fc), which only the joined kernels read; where they are
absent the two GEMMs are not joined (``gemm_pairs``). The build computes them for every GEMM that
qualifies, before it knows which will join, and drops those no kernel reads once the sites'
forms are chosen (``drop_unread_sums``).

A GEMM qualifies where its A is, through views (and slices that keep every value, where asked), the normalized output of a
``native_layer_norm`` over the last dim whose scale is a weight or absent (folded into W by the
trace: u is then W's row sums), and its W a 2-D weight of
static shape read as ``permute(W, [1, 0])`` (``weight_layout``'s ``[N, K]`` form).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.codegen.splice import whole_slice
from aot.program import RESHAPE_VIEWS, all_steps, buffers_read
from aot.schema import Buf, NamedTensor, Program, StepKind, TensorSpec

SCALE_SUM = ".ln_scale_sum"
SHIFT_SUM = ".ln_shift_sum"
_A_AT = {"aten.mm.default": 0, "aten.addmm.default": 1, "aten._addmm_activation.default": 1}


def add_layer_norm_sums(
    program: Program, weights: dict[str, Any], slices: bool = False
) -> tuple[Program, dict[str, Any], int]:
    """The program and weights with the column sums of each qualifying GEMM added, and how many
    GEMMs got them. ``slices``: A may also be a slice of the normalized rows (a decode step's
    final norm before the vocabulary head), which only a norm prologue found through slices
    reads (``gemm_sites.through_slices``)."""
    import torch

    specs = {w.name: w.spec for w in program.weights}
    made: dict[str, tuple[str, str | None]] = {}  # LayerNorm output -> (scale, shift)
    root: dict[str, str] = {}  # a view's buffer -> the LayerNorm output it views
    permuted: dict[str, str] = {}  # permute(W, [1, 0]) -> W
    added: dict[str, torch.Tensor] = {}
    new: list[NamedTensor] = []
    taken = {*specs, *program.buffers, *(i.name for i in program.inputs)}
    norms: dict[str, set] = {}  # W -> the (scale, shift) before each GEMM reading it (None: no LayerNorm)
    gemms = 0
    for step in program.steps:
        if step.kind != StepKind.ATEN or not step.outputs or step.outputs[0] is None:
            continue
        out, args = step.outputs[0], step.args
        if step.target == "aten.native_layer_norm.default" and len(args) == 5:
            x, shape, scale, shift = args[0], args[1], args[2], args[3]
            if (
                isinstance(x, Buf)
                and (scale is None or (isinstance(scale, Buf) and scale.name in specs))
                and (shift is None or (isinstance(shift, Buf) and shift.name in specs))
                and len(shape) == 1
            ):
                made[out] = tuple(v.name if v is not None else None for v in (scale, shift))
        elif step.target in RESHAPE_VIEWS and args and isinstance(args[0], Buf):
            src = args[0].name
            if src in made or src in root:
                root[out] = root.get(src, src)
        elif slices and whole_slice(step, program.buffers):  # as a prologue is found (``[:, -1:]`` of one)
            src = args[0].name
            if src in made or src in root:
                root[out] = root.get(src, src)
        elif step.target == "aten.permute.default" and isinstance(args[0], Buf) and list(args[1]) == [1, 0]:
            if args[0].name in specs and len(specs[args[0].name].shape) == 2:
                permuted[out] = args[0].name
        elif step.target in _A_AT:
            at = _A_AT[step.target]
            a, w = args[at], args[at + 1] if len(args) > at + 1 else None
            if not (isinstance(a, Buf) and isinstance(w, Buf)) or w.name not in permuted:
                continue
            norm = made.get(root.get(a.name, a.name))
            weight = permuted[w.name]
            if norm is not None and all(d.isdigit() for d in specs[weight].shape):
                norms.setdefault(weight, set()).add(norm)
            else:
                norms.setdefault(weight, set()).add(None)
    for weight, of in norms.items():
        # one LayerNorm before every GEMM that reads the weight: the sums are the GEMMs' (named by W)
        if len(of) != 1 or None in of or weight + SCALE_SUM in taken:
            continue
        ((scale, shift),) = of
        n, k = (int(d) for d in specs[weight].shape)
        if any(v is not None and tuple(specs[v].shape) != (str(k),) for v in (scale, shift)):
            continue
        wt = weights[weight].float()
        # u: W @ scale, or W's row sums where the scale is folded into W (``tracer.norm_scales``)
        sums = {SCALE_SUM: wt @ weights[scale].float() if scale is not None else wt.sum(1)}
        if shift is not None:
            sums[SHIFT_SUM] = wt @ weights[shift].float()
        for suffix, vec in sums.items():
            added[weight + suffix] = vec.contiguous()  # [N]
            new.append(NamedTensor(weight + suffix, TensorSpec("float32", (str(n),))))
        gemms += 1
    if not new:
        return program, weights, 0
    return replace(program, weights=(*program.weights, *new)), {**weights, **added}, gemms


def drop_unread_sums(program: Program, weights: dict[str, Any]) -> tuple[Program, dict[str, Any], int]:
    """The program and weights without the column sums that no step, no candidate step and no
    reference step reads, and how many went."""
    read = buffers_read(all_steps(program))
    unread = {
        w.name for w in program.weights if w.name.endswith((SCALE_SUM, SHIFT_SUM)) and w.name not in read
    }
    if not unread:
        return program, weights, 0
    kept = tuple(w for w in program.weights if w.name not in unread)
    return replace(program, weights=kept), {n: t for n, t in weights.items() if n not in unread}, len(unread)
