"""Bilinear resizes without ATen kernels (``F.interpolate(mode="bilinear")``: SegFormer's and
MobileViT's decoder heads, DPT's and UperNet's feature pyramids), for library-free programs.

``aten.upsample_bilinear2d.vec`` (an output size, or scale factors) becomes one Triton kernel:
each program takes one image, a block of output positions and a block of channels, and blends the
four input pixels around each position's source point as ATen does. The source point is
``scale * (dst + 0.5) - 0.5`` clamped at 0 (``align_corners=False``; ``scale`` the input's size
over the output's, or one over a given scale factor) or ``scale * dst`` with ``scale`` the
input's size less one over the output's less one (``align_corners=True``); its floor and the pixel
after it (the last pixel's own where none is), weighted by the fraction, in float32, rounded once
to the output dtype. Input and output are indexed by their strides (NCHW or NHWC; an input that
is a view of another buffer, SegFormer's head's permute of its MLP's rows, read in place through
its views, ``cache_writes.strided_view``); channels must
be static, the batch and the map may be symbolic (their sizes and strides arguments, the scale
then computed in the kernel from them, divided correctly rounded as ATen's float division is).
The antialiased forms (``antialias=True``: ``_upsample_bicubic2d_aa``, ``_upsample_bilinear2d_aa``;
timm's position embeddings resampled to the patch grid) are kernels too, to a size with the
corners not aligned. The plain bicubic one is no ATen op in a program (``torch.export``
decomposes it into index arithmetic, ``codegen/lower_gather.py``), and a nearest one is read
inside the kernel that uses it (``lower_pointwise._lower_upsample_nearest``).
"""

from __future__ import annotations

import numpy as np
import sympy

from aot.codegen import index as ix
from aot.codegen.cache_writes import strided_view
from aot.codegen.kernel_source import kernel_module, memory_strides, signature_of, size_arguments
from aot.codegen.launch import max_value, min_value
from aot.codegen.pooling import map_tiles
from aot.codegen.render import Rendered
from aot.codegen.triton_types import FLOAT_DTYPES, STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind

BILINEAR = "aten.upsample_bilinear2d.vec"
# antialiased resizes (timm's position embeddings resampled to the patch grid): the taps of a
# filter of a = -0.5 (bicubic) or a triangle (bilinear), as wide as the scale where it shrinks
AA = {"aten._upsample_bicubic2d_aa.default": 2.0, "aten._upsample_bilinear2d_aa.default": 1.0}  # support
HEURISTIC = "bilinear-v1"


def _arguments(step: Step) -> tuple[bool, list[float] | None] | None:
    """(align_corners, the scale factors or None) of a resize step; None where they are not
    plain values (an antialiased one: its corners not aligned, no scales given)."""
    if step.target in AA:
        names = ("output_size", "align_corners", "scales_h", "scales_w")
        given = dict(zip(names, step.args[1:])) | dict(step.kwargs)
        plain = (
            given.get("align_corners") is False
            and given.get("scales_h") is None
            and given.get("scales_w") is None
        )
        return (False, None) if plain and not step.kwargs.keys() - set(names) else None
    names = ("output_size", "align_corners", "scale_factors")
    given = dict(zip(names, step.args[1:])) | dict(step.kwargs)
    if step.kwargs.keys() - set(names) or type(given.get("align_corners")) is not bool:
        return None
    factors = given.get("scale_factors")
    if factors is None:
        return given["align_corners"], None
    if not (isinstance(factors, (list, tuple)) and len(factors) == 2):
        return None
    if not all(type(f) in (int, float) and f > 0 for f in factors):
        return None
    return given["align_corners"], [float(f) for f in factors]


def resize_sites(program: Program) -> list[Step]:
    """The bilinear resizes the kernel can replace: a 4-D float input with static channels, an
    output of the same dtype and channels, plain arguments."""
    specs = tensor_specs(program)
    out = []
    for s in program.steps:
        if (
            s.kind != StepKind.ATEN
            or s.target not in (BILINEAR, *AA)
            or not s.args
            or not isinstance(s.args[0], Buf)
        ):
            continue
        if not s.outputs or s.outputs[0] is None or _arguments(s) is None:
            continue
        x, o = specs.get(s.args[0].name), specs.get(s.outputs[0])
        if x is None or o is None or len(x.shape) != 4 or len(o.shape) != 4:
            continue
        if x.dtype not in FLOAT_DTYPES or o.dtype != x.dtype or x.shape[0] != o.shape[0]:
            continue
        if not x.shape[1].isdigit() or x.shape[1] != o.shape[1] or x.shape[1] == "0":
            continue
        positions = ix.parse_size(o.shape[2]) * ix.parse_size(o.shape[3])
        if positions.is_Integer and int(positions) == 0:
            continue
        out.append(s)
    return out


def _scale(n_in: sympy.Expr, n_out: sympy.Expr, name: str, align: bool, factor: float | None) -> str:
    """The source-index scale of one dim as ATen computes it in float32 (``area_pixel_compute_scale``):
    source text, a constant where the sizes are static."""
    if not align:
        return ix.pixel_scale(n_in, n_out, factor, name, "O" + name)
    if n_in.is_Integer and n_out.is_Integer:
        return (
            ix.float32_literal(np.float32(int(n_in) - 1) / np.float32(int(n_out) - 1))
            if int(n_out) > 1
            else "0.0"
        )
    return (
        f"tl.where(O{name} > 1, tl.math.div_rn(({name} - 1).to(tl.float32), "
        f"tl.maximum(O{name} - 1, 1).to(tl.float32)), 0.0)"
    )


def _aa_taps(target: str, n_in: sympy.Expr, n_out: sympy.Expr, axis: str, ranges) -> dict[str, int]:
    """The most input pixels one output pixel of an antialiased resize reads along an axis: its
    filter's support, times the scale where it shrinks, at the declared sizes' largest scale."""
    scale = max(1.0, max_value(n_in, ranges) / max(1, min_value(n_out, ranges)))
    return {f"TAPS_{axis}": int(np.ceil(AA[target] * scale)) * 2 + 1}


def _weight(target: str, var: str, distance: str, taken: str) -> list[str]:
    """Source setting ``var`` to the filter of an antialiased resize at ``distance`` (0 where
    ``taken`` is false): PIL's bicubic (a = -0.5) or a triangle."""
    t = f"{var}_t"
    if AA[target] == 2.0:
        value = (
            f"tl.where({t} < 1.0, (1.5 * {t} - 2.5) * {t} * {t} + 1.0, "
            f"tl.where({t} < 2.0, ((-0.5 * {t} + 2.5) * {t} - 4.0) * {t} + 2.0, 0.0))"
        )
    else:
        value = f"tl.maximum(1.0 - {t}, 0.0)"
    return [f"{t} = tl.abs({distance})", f"{var} = tl.where({taken}, {value}, 0.0)"]


def _aa_body(target: str, store: str) -> list[str]:
    """An antialiased resize's blend as ATen computes it (``_compute_weights_aa``, in float32):
    along each axis the taps from ``int(center - support + 0.5)`` (at least 0) to ``int(center +
    support + 0.5)`` (at most the size), each weighed by the filter at its distance from the
    center (in output pixels where the resize shrinks), the weights normalized by their sum."""
    support = AA[target]
    lines = []
    for axis, o, n, sc in (("y", "oy", "H", "scale_h"), ("x", "ox", "W", "scale_w")):
        lines += [
            f"sup_{axis} = tl.where({sc} >= 1.0, {support} * {sc}, {support})",
            f"inv_{axis} = tl.where({sc} >= 1.0, 1.0 / {sc}, 1.0)",
            f"c_{axis} = {sc} * ({o}.to(tl.float32) + 0.5)",
            f"lo_{axis} = tl.maximum((c_{axis} - sup_{axis} + 0.5).to(tl.int32), 0)",
            f"hi_{axis} = tl.minimum((c_{axis} + sup_{axis} + 0.5).to(tl.int32), {n})",
            f"tot_{axis} = tl.zeros_like(c_{axis})",
            f"for t in range(0, TAPS_{axis.upper()}):",
            *(
                "    " + line
                for line in _weight(
                    target,
                    "w",
                    f"(t + lo_{axis} - c_{axis} + 0.5) * inv_{axis}",
                    f"lo_{axis} + t < hi_{axis}",
                )
            ),
            f"    tot_{axis} += w",
            f"tot_{axis} = tl.where(tot_{axis} != 0.0, tot_{axis}, 1.0)",
        ]
    return [
        *lines,
        "base = x_ptr + XOFF + n * XN + ch[None, :] * XC",
        "acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)",
        "for ty in range(0, TAPS_Y):",
        "    yy = lo_y + ty",
        *("    " + line for line in _weight(target, "wy", "(ty + lo_y - c_y + 0.5) * inv_y", "yy < hi_y")),
        "    row = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)",
        "    for tx in range(0, TAPS_X):",
        "        xx = lo_x + tx",
        *(
            "        " + line
            for line in _weight(target, "wx", "(tx + lo_x - c_x + 0.5) * inv_x", "xx < hi_x")
        ),
        "        take = ok & ((yy < hi_y) & (xx < hi_x))[:, None]",
        "        at = (tl.minimum(yy, H - 1) * XH + tl.minimum(xx, W - 1) * XW)[:, None]",
        "        v = tl.load(base + at, mask=take, other=0.0)",
        "        row += (wx / tot_x)[:, None] * v.to(tl.float32)",
        "    acc += (wy / tot_y)[:, None] * row",
        "tl.store(",
        "    out_ptr + n * ON + (oy * OH_S + ox * OW_S)[:, None] + ch[None, :] * OC,",
        f"    acc.to({store}),",
        "    mask=ok,",
        ")",
    ]


def render_resize(step: Step, program: Program, ranges: dict[str, tuple[int, int]]) -> Rendered | None:
    """The Triton kernel for one step of ``resize_sites``; None where its grid would pass CUDA's
    limits."""
    specs = tensor_specs(program)
    x, o = specs[step.args[0].name], specs[step.outputs[0]]
    align, factors = _arguments(step)
    c = int(x.shape[1])
    h, w = ix.parse_size(x.shape[2]), ix.parse_size(x.shape[3])
    oh, ow = ix.parse_size(o.shape[2]), ix.parse_size(o.shape[3])
    positions = sympy.expand(oh * ow)
    batch = ix.parse_size(x.shape[0])
    tiles = map_tiles(batch, c, h * w, positions, ranges)
    if tiles is None:
        return None
    block_p, block_c, grid, index = tiles
    xs, os_ = memory_strides(x), memory_strides(o)
    x_buf, x_offset = step.args[0], sympy.Integer(0)
    view = None if x.order else strided_view(x_buf.name, program)
    if view is not None and view.base != x_buf.name:  # read in place through its views
        x_buf, xs, x_offset = Buf(view.base), list(view.strides), view.offset
    consts = {
        "C": c, "H": h, "W": w, "OH": oh, "OW": ow, "XOFF": x_offset,
        "XN": xs[0], "XC": xs[1], "XH": xs[2], "XW": xs[3],
        "ON": os_[0], "OC": os_[1], "OH_S": os_[2], "OW_S": os_[3],
        "BLOCK_P": block_p, "BLOCK_C": block_c,
    }  # fmt: skip
    consts, size_params, size_args = size_arguments(consts, index)
    params = (
        KernelParam("x_ptr", ParamKind.PTR, x.dtype),
        KernelParam("out_ptr", ParamKind.PTR, x.dtype),
        *size_params,
    )
    signature = signature_of(params, index)
    wide = ".to(tl.int64)" if index == "i64" else ""
    fy, fx = factors if factors is not None else (None, None)
    if align:
        source = ["sy = oy.to(tl.float32) * scale_h", "sx = ox.to(tl.float32) * scale_w"]
    else:
        source = [
            "sy = tl.maximum(scale_h * (oy.to(tl.float32) + 0.5) - 0.5, 0.0)",
            "sx = tl.maximum(scale_w * (ox.to(tl.float32) + 0.5) - 0.5, 0.0)",
        ]
    store = TL_TYPE[STORAGE[x.dtype]]
    head = [
        f"n = tl.program_id(0){wide}",
        f"p = tl.program_id(1){wide} * BLOCK_P + tl.arange(0, BLOCK_P)",
        f"ch = tl.program_id(2){wide} * BLOCK_C + tl.arange(0, BLOCK_C)",
        "p_ok = p < OH * OW",
        "c_ok = ch < C",
        "ok = p_ok[:, None] & c_ok[None, :]",
        "oy = p // OW",
        "ox = p % OW",
        f"scale_h = {_scale(h, oh, 'H', align, fy)}",
        f"scale_w = {_scale(w, ow, 'W', align, fx)}",
    ]
    body = [
        *head,
        *source,
        f"y0 = sy.to({TL_TYPE[index]})",  # the source point is at least 0: its floor
        f"x0 = sx.to({TL_TYPE[index]})",
        "y1 = y0 + (y0 < H - 1).to(y0.dtype)",
        "x1 = x0 + (x0 < W - 1).to(x0.dtype)",
        "ly = tl.minimum(tl.maximum(sy - y0.to(tl.float32), 0.0), 1.0)[:, None]",
        "lx = tl.minimum(tl.maximum(sx - x0.to(tl.float32), 0.0), 1.0)[:, None]",
        "base = x_ptr + XOFF + n * XN + ch[None, :] * XC",
        "v00 = tl.load(base + (y0 * XH + x0 * XW)[:, None], mask=ok, other=0.0).to(tl.float32)",
        "v01 = tl.load(base + (y0 * XH + x1 * XW)[:, None], mask=ok, other=0.0).to(tl.float32)",
        "v10 = tl.load(base + (y1 * XH + x0 * XW)[:, None], mask=ok, other=0.0).to(tl.float32)",
        "v11 = tl.load(base + (y1 * XH + x1 * XW)[:, None], mask=ok, other=0.0).to(tl.float32)",
        "top = (1.0 - lx) * v00 + lx * v01",
        "bottom = (1.0 - lx) * v10 + lx * v11",
        "tl.store(",
        "    out_ptr + n * ON + (oy * OH_S + ox * OW_S)[:, None] + ch[None, :] * OC,",
        f"    ((1.0 - ly) * top + ly * bottom).to({store}),",
        "    mask=ok,",
        ")",
    ]
    name, what = "bilinear2d", "Bilinear resize"
    blend = "The four pixels around each source point blended in float32 and rounded once, as ATen's."
    if step.target in AA:
        blend = (
            "The taps of each output pixel weighed by the filter, normalized, summed in float32, as ATen's."
        )
        name, what = (
            ("bicubic2d_aa", "Antialiased bicubic resize")
            if AA[step.target] == 2.0
            else ("bilinear2d_aa", "Antialiased bilinear resize")
        )
        consts.update(_aa_taps(step.target, h, oh, "Y", ranges) | _aa_taps(step.target, w, ow, "X", ranges))
        body = [*head, *_aa_body(step.target, store)]
    how = "the corners aligned" if align else "half-pixel centers"
    scaled = f", scale factors {factors}" if factors is not None else ""
    doc = [
        f"{what} ({how}{scaled}): [{', '.join(x.shape)}] {x.dtype} "
        f"({'NHWC' if x.order else 'NCHW'}) -> [{', '.join(o.shape)}] ({'NHWC' if o.order else 'NCHW'}).",
        "",
        blend,
        f"grid: ({', '.join(grid)},)",
    ]
    source_text = kernel_module(doc, consts, name, signature, body)
    traffic = batch * (c * h * w + c * positions) * ITEMSIZE[x.dtype]
    return Rendered(
        name=name,
        source=source_text,
        signature=signature,
        params=params,
        args=(x_buf, Buf(step.outputs[0]), *size_args),
        outputs=(step.outputs[0],),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={
            "kind": "resize",
            "BLOCK_P": block_p,
            "BLOCK_C": block_c,
            "heuristic": HEURISTIC,
            "num_warps": 4,
            "num_stages": 1,
        },
        ops=(step.target,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )
