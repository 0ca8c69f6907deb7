"""Convolutions as Triton kernels, for library-free programs (``aot.codegen.library_free``).

A default build leaves ``aten.convolution.default`` to cuDNN; ``--library-free`` makes each 1-D or
2-D convolution that is not transposed one kernel (``render_convolution``), in one of two forms:

- ``conv_igemm``, an implicit GEMM: the output is a [positions, output channels] matrix per image
  and group, the product of the input's windows as rows of ``C_in/groups * KH * KW`` values (never
  written out: each K block is gathered from the input as the product needs it) and the weight as a
  [K, C_out/groups] matrix, read in place (a ``[C_out, C_in/groups, KH, KW]`` weight is that matrix
  transposed). Each program takes one image, a block of output positions and a block of output
  channels of one group, accumulates in float32 (TF32 never: float32 inputs multiply as IEEE), adds
  the bias when the step has one, and rounds once to the output dtype.
- ``conv_depthwise``, a direct form for one input channel per group (depthwise, with any channel
  multiplier): ``tl.dot`` would waste a 16-wide K on a single channel, so each program takes a block
  of positions and a block of channels and multiplies window by window, as a max pool does.

Padding reads as zero. Input and output are indexed by their strides (``TensorSpec.order``), the
weight too; an input that is a permute of a row-major buffer (a convnext block's channels-last
activations viewed NCHW for its next convolution) is read from that buffer in place. Channels and
the kernel's window must be static; the batch may be symbolic (the grid's first axis), and so may
the map: a 1-D convolution's length (audio samples, a sequence: wav2vec 2, HuBERT, SqueezeBERT), a
2-D one's height and width (images of a declared range of sizes: a patch embedding, a CNN), the
sizes and strides they enter then arguments and the grid's position blocks counted per call. The convolution's bias, when a weight, is usually moved into the
kernel after it first (``layouts.split_conv_bias``); a bias left on the step is added here.
"""

from __future__ import annotations

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, memory_strides, signature_of, size_arguments
from aot.codegen.launch import MAX_GRID_YZ, cdiv_text, max_value
from aot.codegen.render import Rendered
from aot.codegen.triton_types import FLOAT_DTYPES, STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, TensorSpec

CONVOLUTION = "aten.convolution.default"
HEURISTIC = "conv-implicit-gemm-v1"
MAX_WINDOW = 121  # KH * KW unrolled by the depthwise form (11 x 11)
BLOCK_P = 64  # output positions per program instance
DEPTHWISE_TILE = 2048  # positions x channels per program instance of the depthwise form


class Conv:
    """A convolution step's geometry, 1-D ones as 2-D with a height of 1."""

    def __init__(self, x: TensorSpec, w: TensorSpec, o: TensorSpec, args: list):
        self.x, self.w, self.o = x, w, o
        one_d = len(x.shape) == 3
        self.one_d = one_d
        pad = lambda v, first: [first, *v] if one_d else list(v)  # noqa: E731
        rank = len(x.shape) - 2
        stride, padding, dilation = (_expanded(v, rank) for v in args[3:6])
        self.stride, self.padding, self.dilation = pad(stride, 1), pad(padding, 0), pad(dilation, 1)
        self.groups = args[8]
        # the map's sizes may be symbolic: a 1-D convolution's length (a sequence's: ConvBERT,
        # wav2vec 2's samples), a 2-D one's height and width (images of any declared size)
        dims = [ix.parse_size(d) for d in x.shape[1:]]
        self.c_in = int(dims[0])
        self.h, self.w_in = (sympy.Integer(1), dims[1]) if one_d else (dims[1], dims[2])
        wdims = [int(d) for d in w.shape]
        self.c_out, self.cpg = wdims[0], wdims[1]
        self.kh, self.kw = (1, wdims[2]) if one_d else (wdims[2], wdims[3])
        odims = [ix.parse_size(d) for d in o.shape[1:]]
        self.oh, self.ow = (sympy.Integer(1), odims[1]) if one_d else (odims[1], odims[2])
        self.opg = self.c_out // self.groups

    @property
    def depthwise(self) -> bool:
        return self.cpg == 1 and self.kh * self.kw <= MAX_WINDOW


def _expanded(v, n: int):
    """A stride, padding or dilation of one element for each of ``n`` dims, as ATen reads it
    (SigLIP's ``padding="valid"`` is ``[0]``)."""
    return list(v) * n if isinstance(v, (list, tuple)) and len(v) == 1 else v


def _ints(v, n: int) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == n and all(type(e) is int for e in v)


def _permuted_input(
    name: str, program: Program, specs: dict[str, TensorSpec]
) -> tuple[str, list[int]] | None:
    """(the buffer, element strides) a convolution input that is ``permute(base, [0, ...])`` of a
    row-major ``base`` with static dims after the batch reads in place (a convnext block's
    channels-last activations viewed NCHW); None for any other input."""
    step = next((s for s in program.steps if name in s.outputs), None)
    if step is None or step.kind != StepKind.ATEN or step.target != "aten.permute.default":
        return None
    base, order = step.args[0], step.args[1]
    spec = specs.get(base.name) if isinstance(base, Buf) else None
    if (
        spec is None
        or spec.order
        or not _ints(order, len(spec.shape))
        or sorted(order) != list(range(len(spec.shape)))
    ):
        return None
    if order[0] != 0 or not all(d.isdigit() for d in spec.shape[1:]):
        return None
    base_strides = [int(x) for x in ix.strides(tuple(ix.parse_size(d) for d in spec.shape))[1:]]
    return base.name, [0, *(base_strides[d - 1] for d in order[1:])]


def _geometry(step: Step, specs: dict[str, TensorSpec]) -> Conv | None:
    """The convolution ``step`` is, when a kernel form covers it (module docstring); else None."""
    if step.kind != StepKind.ATEN or step.target != CONVOLUTION or step.kwargs or len(step.args) != 9:
        return None
    x_arg, w_arg, b_arg, stride, padding, dilation, transposed, _, groups = step.args
    if (
        not isinstance(x_arg, Buf)
        or not isinstance(w_arg, Buf)
        or not (b_arg is None or isinstance(b_arg, Buf))
    ):
        return None
    if transposed is not False or type(groups) is not int or groups < 1:
        return None
    if not step.outputs or step.outputs[0] is None or any(o is not None for o in step.outputs[1:]):
        return None
    x, w, o = specs.get(x_arg.name), specs.get(w_arg.name), specs.get(step.outputs[0])
    if x is None or w is None or o is None or len(x.shape) not in (3, 4):
        return None
    rank = len(x.shape) - 2
    if len(w.shape) != len(x.shape) or len(o.shape) != len(x.shape):
        return None
    stride, padding, dilation = (_expanded(v, rank) for v in (stride, padding, dilation))
    if not all(_ints(v, rank) for v in (stride, padding, dilation)):
        return None
    if min(*stride, *dilation) < 1 or min(padding) < 0:
        return None
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype or o.dtype != x.dtype:
        return None
    if b_arg is not None:
        b = specs.get(b_arg.name)
        if b is None or b.dtype != x.dtype or list(b.shape) != [w.shape[0]] or b.order:
            return None
    static = (x.shape[1], *w.shape, o.shape[1])  # channels and the window; the map may be symbolic
    if not all(d.isdigit() for d in static) or x.shape[0] != o.shape[0]:
        return None
    conv = Conv(x, w, o, list(step.args))
    if conv.c_in != conv.cpg * groups or conv.c_out % groups or int(o.shape[1]) != conv.c_out:
        return None
    positions = sympy.sympify(conv.oh * conv.ow)
    if conv.c_out == 0 or conv.cpg == 0 or (positions.is_Integer and int(positions) == 0):
        return None
    return conv


def conv_sites(program: Program) -> list[Step]:
    """The convolution steps a kernel form covers (``_geometry``)."""
    specs = tensor_specs(program)
    return [s for s in program.steps if _geometry(s, specs) is not None]


def _input_strides(conv: Conv, step: Step, program: Program, specs) -> tuple[Buf, list[int]]:
    """The buffer the kernel reads the input from and its strides (as 4, batch first): the input
    itself, or the row-major buffer a permute of it views (``_permuted_input``)."""
    permuted = _permuted_input(step.args[0].name, program, specs)
    if permuted is None:
        return step.args[0], _strides(conv.x, conv.one_d)
    base, strides = permuted
    batch_stride = ix.strides(tuple(ix.parse_size(d) for d in specs[base].shape))[0]
    strides = [batch_stride, *strides[1:]]
    return Buf(base), ([strides[0], strides[1], 0, strides[2]] if conv.one_d else strides)


def _strides(spec: TensorSpec, one_d: bool) -> list[sympy.Expr]:
    """Element strides of a 3-D or 4-D tensor in its memory order, as 4 (a 1-D one's height: 0);
    symbolic where the map's sizes are."""
    out = memory_strides(spec)
    return [out[0], out[1], sympy.Integer(0), out[2]] if one_d else out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def render_convolution(step: Step, program: Program, ranges: dict[str, tuple[int, int]]) -> Rendered | None:
    """The Triton kernel for one step of ``conv_sites``; None where its grid would pass CUDA's limits."""
    specs = tensor_specs(program)
    conv = _geometry(step, specs)
    assert conv is not None, step
    x, w, o = conv.x, conv.w, conv.o
    bias = step.args[2]
    batch = ix.parse_size(x.shape[0])
    biggest = max(
        max_value(sympy.expand(batch * conv.c_in * conv.h * conv.w_in), ranges),
        max_value(sympy.expand(batch * conv.c_out * conv.oh * conv.ow), ranges),
        conv.c_out * conv.cpg * conv.kh * conv.kw,
    )
    index = "i64" if biggest >= 2**31 - 1 else "i32"
    x_buf, xs = _input_strides(conv, step, program, specs)
    ws, os_ = _strides(w, conv.one_d), _strides(o, conv.one_d)
    positions = sympy.sympify(conv.oh * conv.ow)
    store = TL_TYPE[STORAGE[x.dtype]]
    consts = {
        "C_IN": conv.c_in, "H": conv.h, "W": conv.w_in, "C_OUT": conv.c_out, "OH": conv.oh, "OW": conv.ow,
        "CPG": conv.cpg, "OPG": conv.opg, "KH": conv.kh, "KW": conv.kw,
        "SH": conv.stride[0], "SW": conv.stride[1], "PH": conv.padding[0], "PW": conv.padding[1],
        "DH": conv.dilation[0], "DW": conv.dilation[1],
        "XN": xs[0], "XC": xs[1], "XH": xs[2], "XW": xs[3],
        "WO": ws[0], "WI": ws[1], "WH": ws[2], "WW": ws[3],
        "ON": os_[0], "OC": os_[1], "OH_S": os_[2], "OW_S": os_[3],
    }  # fmt: skip
    # a symbolic map (a 1-D length, a 2-D height and width): the sizes and strides they enter are
    # arguments the call evaluates
    consts, size_params, size_args = size_arguments(consts, index)
    wide = ".to(tl.int64)" if index == "i64" else ""
    params = [KernelParam("x_ptr", ParamKind.PTR, x.dtype), KernelParam("w_ptr", ParamKind.PTR, w.dtype)]
    args: list = [x_buf, step.args[1]]
    if bias is not None:
        params.append(KernelParam("b_ptr", ParamKind.PTR, x.dtype))
        args.append(bias)
    params.append(KernelParam("out_ptr", ParamKind.PTR, o.dtype))
    args.append(Buf(step.outputs[0]))
    params += size_params
    args += size_args
    signature = signature_of(tuple(params), index)
    most = max_value(positions, ranges)
    if conv.depthwise:
        name, config, body, grid = _depthwise(conv, positions, most, wide, bias is not None, store)
    else:
        name, config, body, grid = _implicit_gemm(
            conv, positions, most, wide, bias is not None, store, x.dtype
        )
    if grid is None:
        return None
    grid = (ix.size_text(batch), *grid)
    shape = "x".join(str(d) for d in (conv.kh, conv.kw)[conv.one_d :])
    doc = [
        f"{'1' if conv.one_d else '2'}-D convolution {shape}, stride {conv.stride[conv.one_d :]}, padding "
        f"{conv.padding[conv.one_d :]}, dilation {conv.dilation[conv.one_d :]}, groups {conv.groups}"
        f"{', bias' if bias is not None else ''}: [{', '.join(x.shape)}] {x.dtype} -> [{', '.join(o.shape)}].",
        "",
        "Padding reads as zero; products accumulate in float32 and round once to the output dtype.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, {**consts, **config["consts"]}, name, signature, body)
    traffic = batch * (conv.c_in * conv.h * conv.w_in + conv.c_out * positions) * ITEMSIZE[x.dtype]
    traffic += conv.c_out * conv.cpg * conv.kh * conv.kw * ITEMSIZE[w.dtype]
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=tuple(args),
        outputs=(step.outputs[0],),
        grid=grid,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        config={k: v for k, v in config.items() if k != "consts"} | dict(config["consts"]),
        ops=(step.target,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def _implicit_gemm(
    conv: Conv, positions: sympy.Expr, most: int, wide: str, bias: bool, store: str, dtype: str
):
    """(name, config, body, grid after the batch) of the implicit-GEMM form; ``most``: the most
    output positions an image has (``positions`` at the declared maximum)."""
    k_total = conv.cpg * conv.kh * conv.kw
    block_p = min(BLOCK_P, max(16, _pow2(most)))
    block_co = min(64, max(16, _pow2(conv.opg)))
    block_k = min(32, max(16, _pow2(k_total)))
    co_blocks = -(-conv.opg // block_co)
    grid_p, grid_c = cdiv_text(positions, block_p), conv.groups * co_blocks
    if -(-most // block_p) > MAX_GRID_YZ or grid_c > MAX_GRID_YZ:
        return "", {}, [], None
    precision = ", input_precision='ieee'" if dtype == "float32" else ""
    body = [
        f"n = tl.program_id(0){wide}",
        f"p = tl.program_id(1){wide} * BLOCK_P + tl.arange(0, BLOCK_P)",
        f"g = tl.program_id(2){wide} // CO_BLOCKS",
        f"co = (tl.program_id(2){wide} % CO_BLOCKS) * BLOCK_CO + tl.arange(0, BLOCK_CO)",
        "p_ok = p < OH * OW",
        "co_ok = co < OPG",
        "oc = g * OPG + co",
        "oy = p // OW",
        "ox = p % OW",
        "acc = tl.zeros([BLOCK_P, BLOCK_CO], tl.float32)",
        "for k0 in range(0, CPG * KH * KW, BLOCK_K):",
        "    k = k0 + tl.arange(0, BLOCK_K)",
        "    k_ok = k < CPG * KH * KW",
        "    ci = k // (KH * KW)",
        "    ky = (k // KW) % KH",
        "    kx = k % KW",
        "    iy = oy[:, None] * SH - PH + ky[None, :] * DH",
        "    ix = ox[:, None] * SW - PW + kx[None, :] * DW",
        "    a_ok = p_ok[:, None] & k_ok[None, :] & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)",
        "    a = tl.load(x_ptr + n * XN + (g * CPG + ci)[None, :] * XC + iy * XH + ix * XW, mask=a_ok, other=0.0)",
        "    b = tl.load(",
        "        w_ptr + oc[None, :] * WO + (ci * WI + ky * WH + kx * WW)[:, None],",
        "        mask=k_ok[:, None] & co_ok[None, :],",
        "        other=0.0,",
        "    )",
        f"    acc = tl.dot(a, b, acc{precision})",
    ]
    if bias:
        body.append("acc += tl.load(b_ptr + oc, mask=co_ok, other=0.0).to(tl.float32)[None, :]")
    body += [
        "tl.store(",
        "    out_ptr + n * ON + oc[None, :] * OC + (oy * OH_S + ox * OW_S)[:, None],",
        f"    acc.to({store}),",
        "    mask=p_ok[:, None] & co_ok[None, :],",
        ")",
    ]
    config = {
        "kind": "conv_igemm",
        "heuristic": HEURISTIC,
        "num_warps": 4,
        "num_stages": 2,
        "consts": {"BLOCK_P": block_p, "BLOCK_CO": block_co, "BLOCK_K": block_k, "CO_BLOCKS": co_blocks},
    }
    return "conv_igemm", config, body, (str(grid_p), str(grid_c))


def _depthwise(conv: Conv, positions: sympy.Expr, most: int, wide: str, bias: bool, store: str):
    """(name, config, body, grid after the batch) of the depthwise form (one input channel per group)."""
    block_c = min(128, max(1, _pow2(conv.c_out)))
    block_p = min(max(1, DEPTHWISE_TILE // block_c), _pow2(most))
    grid_p, grid_c = cdiv_text(positions, block_p), -(-conv.c_out // block_c)
    if -(-most // block_p) > MAX_GRID_YZ or grid_c > MAX_GRID_YZ:
        return "", {}, [], None
    body = [
        f"n = tl.program_id(0){wide}",
        f"p = tl.program_id(1){wide} * BLOCK_P + tl.arange(0, BLOCK_P)",
        f"oc = tl.program_id(2){wide} * BLOCK_C + tl.arange(0, BLOCK_C)",
        "p_ok = p < OH * OW",
        "c_ok = oc < C_OUT",
        "ci = oc // OPG",  # the input channel of each output channel (one per group)
        "oy = p // OW",
        "ox = p % OW",
        "acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)",
        "for ky in tl.static_range(KH):",
        "    iy = oy * SH - PH + ky * DH",
        "    for kx in tl.static_range(KW):",
        "        ix = ox * SW - PW + kx * DW",
        "        ok = p_ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)",
        "        v = tl.load(",
        "            x_ptr + n * XN + (iy * XH + ix * XW)[:, None] + ci[None, :] * XC,",
        "            mask=ok[:, None] & c_ok[None, :],",
        "            other=0.0,",
        "        )",
        "        wv = tl.load(w_ptr + oc * WO + ky * WH + kx * WW, mask=c_ok, other=0.0)",
        "        acc += v.to(tl.float32) * wv.to(tl.float32)[None, :]",
    ]
    if bias:
        body.append("acc += tl.load(b_ptr + oc, mask=c_ok, other=0.0).to(tl.float32)[None, :]")
    body += [
        "tl.store(",
        "    out_ptr + n * ON + oc[None, :] * OC + (oy * OH_S + ox * OW_S)[:, None],",
        f"    acc.to({store}),",
        "    mask=p_ok[:, None] & c_ok[None, :],",
        ")",
    ]
    config = {
        "kind": "conv_depthwise",
        "heuristic": HEURISTIC,
        "num_warps": 4,
        "num_stages": 1,
        "consts": {"BLOCK_P": block_p, "BLOCK_C": block_c},
    }
    return "conv_depthwise", config, body, (str(grid_p), str(grid_c))
