"""Max and average pooling without ATen kernels.

A GPU call that launches any ATen kernel makes the process load ATen's kernel images (92 MiB of
device memory on an H100 with torch 2.11, ``bench/memory_stages.py``). A ResNet's stem max pool was
its only ATen kernel besides the copy cuDNN's convolution made of the image (``layouts.
relayout_conv_inputs``), and ATen's NHWC pool took 18.7 µs at batch 1 on an H200, four times what
reading its input costs. So a 2-D max pool whose indices nothing reads becomes one Triton kernel:
each program takes one image, a block of output positions and a block of channels, and takes the
maximum over the window, NaN propagating as ATen's does; padding is -inf, as ATen pads. An average
pool (ResNet-D's and the NF-Nets' downsampling shortcuts, Inception's branches) is the same kernel
summing in float32 over the window, padding read as 0, divided as ATen divides: by the window
clipped to the padded image (``count_include_pad``), to the image itself, or by
``divisor_override``.

The input and output keep whatever layout the program gives them (``TensorSpec.order``, NCHW or
NHWC): the kernel indexes both by their strides. Channels must be static; the batch may be
symbolic (the grid's first axis), and so may the height and width (images of a declared range of
sizes; a 1-D pool over time as a 2-D one of height 1: SEW's squeeze of its frames, an
``AvgPool1d`` over a symbolic sample count), where no window passes the padded map at the declared
range's narrowest: the sizes and strides they enter are arguments the call evaluates.
"""

from __future__ import annotations

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, memory_strides, signature_of, size_arguments
from aot.codegen.launch import MAX_GRID_YZ, cdiv_text, max_value, min_value
from aot.codegen.render import Rendered
from aot.codegen.triton_types import FLOAT_DTYPES, STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import step_reads, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind

MAX_POOLS = ("aten.max_pool2d_with_indices.default", "aten.max_pool2d.default")
AVG_POOLS = ("aten.avg_pool2d.default",)
MAX_WINDOW = 64  # kernel_h * kernel_w unrolled in the kernel
TILE = 2048  # output elements per program instance
HEURISTIC = {"max": "max-pool-v1", "avg": "avg-pool-v1"}
FILL = {"max": "float('-inf')", "avg": "0.0"}  # what padding reads as


def _pair(v, default: list[int] | None = None) -> list[int] | None:
    """A pooling argument (an int, or a list of one or two) as two ints; ``default`` for ``[]``."""
    if type(v) is int:
        return [v, v]
    if isinstance(v, (list, tuple)) and all(type(e) is int for e in v):
        if len(v) == 0:
            return default
        if len(v) in (1, 2):
            return [v[0], v[-1]]
    return None


def _window(
    step: Step, image: tuple[int, int | None] | None = None
) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(kernel, stride, padding, dilation) of a pool's arguments; None where not plain ints (an
    average pool's dilation is 1) or the window is larger than ``MAX_WINDOW``. With the ``image``'s
    height and width, a window past the padded image is clipped to it (EfficientNet's pooler, an
    ``AvgPool2d(1280, ceil_mode=True)`` over a smaller map): ATen ends every window there, so the
    sums, maxima and counts are the same. A width of None (symbolic) is not clipped."""
    found = _avg_window(step) if step.target in AVG_POOLS else _max_window(step)
    if found is None:
        return None
    kernel, stride, padding, dilation = found
    if image is not None and dilation == [1, 1]:
        kernel = [k if n is None else min(k, n + 2 * p) for k, n, p in zip(kernel, image, padding)]
    return None if kernel[0] * kernel[1] > MAX_WINDOW else (kernel, stride, padding, dilation)


def _fits(window, image: tuple[sympy.Expr, sympy.Expr], ranges: dict[str, tuple[int, int]]) -> bool:
    """Whether a pool's ``window`` (``_window``'s) never passes the padded image in the declared
    ``ranges`` along a symbolic height or width (so none needs the clip ``_window`` makes of a
    static one's): the window's extent at most the narrowest padded size."""
    kernel, _, padding, dilation = window
    return all(
        n.is_Integer or (k - 1) * d + 1 <= min_value(n, ranges) + 2 * p
        for k, n, p, d in zip(kernel, image, padding, dilation)
    )


def _max_window(step: Step) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """``_window`` of ``max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)``."""
    args = [*step.args[1:], None, None, None, None][:5]
    kernel = _pair(args[0])
    if kernel is None or step.kwargs.keys() - {"stride", "padding", "dilation", "ceil_mode"}:
        return None
    given = {
        "stride": step.kwargs.get("stride", args[1] if args[1] is not None else []),
        "padding": step.kwargs.get("padding", args[2] if args[2] is not None else 0),
        "dilation": step.kwargs.get("dilation", args[3] if args[3] is not None else 1),
    }
    stride = _pair(given["stride"], default=kernel)
    padding, dilation = _pair(given["padding"]), _pair(given["dilation"])
    if stride is None or padding is None or dilation is None:
        return None
    if min(*kernel, *stride, *dilation) < 1 or min(padding) < 0:
        return None
    return kernel, stride, padding, dilation


def _avg_window(step: Step) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """``_window`` of ``avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad,
    divisor_override)``."""
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    if step.kwargs.keys() - set(names):
        return None
    given = dict(zip(names, step.args[1:])) | dict(step.kwargs)
    kernel = _pair(given.get("kernel_size"))
    stride = _pair(given.get("stride", []), default=kernel)
    padding = _pair(given.get("padding", 0))
    if kernel is None or stride is None or padding is None or type(_divisor(step)) not in (int, type(None)):
        return None
    if min(*kernel, *stride) < 1 or min(padding) < 0:
        return None
    return kernel, stride, padding, [1, 1]


def _divisor(step: Step) -> int | None | str:
    """An average pool's ``divisor_override`` (None: ATen's window count); "" where not an int."""
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    value = (dict(zip(names, step.args[1:])) | dict(step.kwargs)).get("divisor_override")
    return value if value is None or (type(value) is int and value != 0) else ""


def _count_include_pad(step: Step) -> bool:
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
    return bool((dict(zip(names, step.args[1:])) | dict(step.kwargs)).get("count_include_pad", True))


def _average(divisor: int | None, include_pad: bool) -> list[str]:
    """The kernel's lines that divide the window's sum ``acc`` as ATen's average pool does: by
    ``divisor``, else by the window clipped to the padded image (``include_pad``) or to the image."""
    if divisor is not None:
        return [f"acc = acc / {float(divisor)!r}"]
    lines = [
        "y0 = oy * SH - PH",
        "x0 = ox * SW - PW",
        "y1 = tl.minimum(y0 + KH, H + PH)",
        "x1 = tl.minimum(x0 + KW, W + PW)",
    ]
    if include_pad:
        lines.append("count = (y1 - y0) * (x1 - x0)")
    else:
        lines.append(
            "count = (tl.minimum(y1, H) - tl.maximum(y0, 0)) * (tl.minimum(x1, W) - tl.maximum(x0, 0))"
        )
    return [*lines, "acc = acc / tl.maximum(count, 1).to(tl.float32)[:, None]"]


def map_tiles(
    batch: sympy.Expr, c: int, pixels: sympy.Expr, positions: sympy.Expr, ranges: dict[str, tuple[int, int]]
) -> tuple[int, int, tuple[str, str, str], str] | None:
    """(positions a program, channels a program, the grid, the index type) of a kernel over an
    image's output ``positions`` and ``c`` channels, each program a block of both (pools, resizes);
    None where the grid would pass CUDA's limits at the declared ``ranges``."""
    most = max_value(positions, ranges)
    block_c = min(128, 1 << max(0, (c - 1).bit_length()))
    block_p = min(max(1, TILE // block_c), 1 << max(0, (most - 1).bit_length()))
    grid_c = -(-c // block_c)
    if -(-most // block_p) > MAX_GRID_YZ or grid_c > MAX_GRID_YZ:
        return None
    biggest = max(
        max_value(sympy.expand(batch * c * pixels), ranges),
        max_value(sympy.expand(batch * c * positions), ranges),
    )
    index = "i64" if biggest >= 2**31 - 1 else "i32"
    return block_p, block_c, (ix.size_text(batch), cdiv_text(positions, block_p), str(grid_c)), index


def pool_sites(program: Program, ranges: dict[str, tuple[int, int]] | None = None) -> list[Step]:
    """The pool steps the kernel can replace: a 4-D float input with static channels and a static
    map (or, with the dims' ``ranges``, a symbolic height or width whose windows fit its narrowest:
    ``_fits``), an output of the same dtype, a max pool's indices that nothing reads."""
    specs = tensor_specs(program)
    read = {r for s in program.steps for r in step_reads(s)} | set(program.outputs)
    out = []
    for s in program.steps:
        if (
            s.kind != StepKind.ATEN
            or s.target not in (*MAX_POOLS, *AVG_POOLS)
            or not s.args
            or not isinstance(s.args[0], Buf)
        ):
            continue
        if not s.outputs or s.outputs[0] is None or any(o is not None and o in read for o in s.outputs[1:]):
            continue
        x, o = specs.get(s.args[0].name), specs.get(s.outputs[0])
        if x is None or o is None or len(x.shape) != 4 or len(o.shape) != 4:
            continue
        if x.dtype not in FLOAT_DTYPES or o.dtype != x.dtype:
            continue
        if not x.shape[1].isdigit() or x.shape[1] != o.shape[1] or x.shape[0] != o.shape[0]:
            continue
        image = (ix.parse_size(x.shape[2]), ix.parse_size(x.shape[3]))
        static = tuple(int(n) if n.is_Integer else None for n in image)
        if None not in static:
            if not (o.shape[2].isdigit() and o.shape[3].isdigit()) or _window(s, static) is None:
                continue
        else:
            window = None if ranges is None else _window(s, static)
            if window is None or not _fits(window, image, ranges):
                continue
        positions = ix.parse_size(o.shape[2]) * ix.parse_size(o.shape[3])
        if positions.is_Integer and int(positions) == 0:
            continue
        out.append(s)
    return out


def render_pool(step: Step, program: Program, ranges: dict[str, tuple[int, int]]) -> Rendered | None:
    """The Triton kernel for one pool step of ``pool_sites``; None where its grid would pass
    CUDA's limits."""
    specs = tensor_specs(program)
    x, o = specs[step.args[0].name], specs[step.outputs[0]]
    c = int(x.shape[1])
    h, w = ix.parse_size(x.shape[2]), ix.parse_size(x.shape[3])  # symbolic where the map is
    oh, ow = ix.parse_size(o.shape[2]), ix.parse_size(o.shape[3])
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _window(
        step, tuple(int(n) if n.is_Integer else None for n in (h, w))
    )
    positions = sympy.expand(oh * ow)
    batch = ix.parse_size(x.shape[0])
    tiles = map_tiles(batch, c, h * w, positions, ranges)
    if tiles is None:
        return None
    block_p, block_c, grid, index = tiles
    xs, os_ = memory_strides(x), memory_strides(o)
    kind = "avg" if step.target in AVG_POOLS else "max"
    name = f"{kind}_pool2d"
    layout = "NHWC" if x.order else "NCHW"
    divisor, include_pad = (_divisor(step), _count_include_pad(step)) if kind == "avg" else (None, False)
    divided = (
        f"divided by {divisor}"
        if divisor is not None
        else "divided by the window clipped to the padded image"
        if include_pad
        else "divided by the window clipped to the image"
    )
    doc = [
        f"{kind.capitalize()} pool {kh}x{kw}, stride {sh}x{sw}, padding {ph}x{pw}, dilation {dh}x{dw}: "
        f"[{', '.join(x.shape)}] {x.dtype} ({layout}) -> [{', '.join(o.shape)}] "
        f"({'NHWC' if o.order else 'NCHW'}).",
        "",
        "Padding reads as -inf; NaN propagates, as in ATen's max pool."
        if kind == "max"
        else f"A float32 sum over the window, padding read as 0, {divided}, as in ATen's average pool.",
        f"grid: ({', '.join(grid)},)",
    ]
    consts = {
        "C": c, "H": h, "W": w, "OH": oh, "OW": ow,
        "KH": kh, "KW": kw, "SH": sh, "SW": sw, "PH": ph, "PW": pw, "DH": dh, "DW": dw,
        "XN": xs[0], "XC": xs[1], "XH": xs[2], "XW": xs[3],
        "ON": os_[0], "OC": os_[1], "OH_S": os_[2], "OW_S": os_[3],
        "BLOCK_P": block_p, "BLOCK_C": block_c,
    }  # fmt: skip
    # a symbolic map: the sizes and strides it enters are arguments the call evaluates
    consts, size_params, size_args = size_arguments(consts, index)
    params = (
        KernelParam("x_ptr", ParamKind.PTR, x.dtype),
        KernelParam("out_ptr", ParamKind.PTR, x.dtype),
        *size_params,
    )
    signature = signature_of(params, index)
    wide = ".to(tl.int64)" if index == "i64" else ""  # every index: one image may pass 2**31 too
    body = [
        f"n = tl.program_id(0){wide}",
        f"p = tl.program_id(1){wide} * BLOCK_P + tl.arange(0, BLOCK_P)",
        f"ch = tl.program_id(2){wide} * BLOCK_C + tl.arange(0, BLOCK_C)",
        "p_ok = p < OH * OW",
        "c_ok = ch < C",
        "oy = p // OW",
        "ox = p % OW",
        f"acc = tl.full([BLOCK_P, BLOCK_C], {FILL[kind]}, tl.float32)",
        "for ky in tl.static_range(KH):",
        "    iy = oy * SH - PH + ky * DH",
        "    for kx in tl.static_range(KW):",
        "        ix = ox * SW - PW + kx * DW",
        "        ok = p_ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)",
        "        v = tl.load(",
        "            x_ptr + n * XN + (iy * XH + ix * XW)[:, None] + ch[None, :] * XC,",
        "            mask=ok[:, None] & c_ok[None, :],",
        f"            other={FILL[kind]},",
        "        )",
        "        acc = tl.maximum(acc, v.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)"
        if kind == "max"
        else "        acc += v.to(tl.float32)",
        *(_average(divisor, include_pad) if kind == "avg" else []),
        "tl.store(",
        "    out_ptr + n * ON + (oy * OH_S + ox * OW_S)[:, None] + ch[None, :] * OC,",
        f"    acc.to({TL_TYPE[STORAGE[x.dtype]]}),",
        "    mask=p_ok[:, None] & c_ok[None, :],",
        ")",
    ]
    source = kernel_module(doc, consts, name, signature, body)
    traffic = batch * (c * h * w + c * positions) * ITEMSIZE[x.dtype]
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=params,
        args=(step.args[0], Buf(step.outputs[0]), *size_args),
        outputs=(step.outputs[0],),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={
            "kind": "pool",
            "BLOCK_P": block_p,
            "BLOCK_C": block_c,
            "heuristic": HEURISTIC[kind],
            "num_warps": 4,
            "num_stages": 1,
        },
        ops=(step.target,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )
