"""A norm's per-column scale (and a LayerNorm's shift) folded into the weights of the
projections that read it.

A pre-norm decoder layer multiplies its normalized row by the norm's weight ``g`` (Llama's,
Mistral's, Qwen's RMSNorm: ``g * (x * rstd).to(dtype)``) and hands the product to the linear
layers that follow (q, k, v; gate, up). Each of those computes ``(g * y) @ W^T = y @ (W * g)^T``,
so the build may multiply ``g`` into every such ``W``'s columns once and drop the multiply from
the program: a one-row GEMV whose prologue runs the norm then loads no ``g`` beside its weights
and every other form runs one multiply fewer. On an H100 (2026-12-06, Llama-3.2-1B's first 8
layers, bf16, batch 1, both bundles in one process, ``bench/decode_paired.py``, 12 rounds;
decode/paired-llama-3.2-1b-8layers-b1-fold-norm-scales-h100-2026-12-06b.json): 0.5733 against
0.5780 ms a token (0.8% faster, 12 of 12 rounds), the same greedy tokens; ``aotpack verify``
passes on Llama-3.2-1B's and GPT-2's shapes.

A LayerNorm (GPT-2's ``ln_1``, ``ln_2``; ``native_layer_norm`` with a scale s and a shift t) is
folded the same way, its shift into the bias: ``(y * s + t) @ W^T + b = y @ (W * s)^T + (b +
W @ t)``; the LayerNorm keeps its statistics and loses its scale and shift, and a projection
without a bias (``mm``) gets ``W @ t`` as one (``addmm``). The one-row forms' prologues then load
neither vector, the statistics joins store the residual sum alone (``gemm_stats``) and read W's
row sums as their column sums (``norm_sums``). On an H100 (2026-12-06, both bundles in one
process, 12 rounds; decode/paired-gpt2-b1-b8-fold-layer-norms-h100-2026-12-06c.json,
ab-{gpt,mlp}-fold-layer-norms-h100-2026-12-06c.json): GPT-2's decode 1.4% faster at batch 1 and
0.2% at batch 8, the same greedy tokens; the example GPT 1.5% faster at batch 1, 2.1% at 128
tokens; the example mlp 0.9% faster at batch 1, 0.6% slower at batch 8.

The pass rewrites the exported graph, so every entry point and bucket sees the same program: the
``mul`` goes (a LayerNorm's scale and shift arguments), and each weight is read through
``mul(W, g)`` (and ``sum(W * t)`` in the bias), steps of weights alone that
``aot.tracer.folding`` computes at build time (a weight ``folded.<digest>``; the original ``W``,
then read by nothing else, leaves the bundle). ``W * g`` is rounded to the weights' dtype once,
where the reference rounds ``g * y`` in every call: the products differ by that rounding (about
one unit in the last place of a weight), as two libraries' do.

Folded only where nothing else could see the difference:

- ``g`` (and ``t``) is a weight of one dim, the row's last (K), of the row's dtype and the
  product's;
- the product (the LayerNorm's normalized output; its mean and 1/std do not change) reaches
  only matmuls (``mm``, ``addmm`` without ``beta``/``alpha``, through views that keep K the last
  dim) as their left operand, whose right operand is a weight ``W`` [N, K] through its transpose
  (``nn.Linear``) or a weight [K, N] as it is (GPT-2's ``Conv1D``);
- each such ``W`` is read by nothing else and shares its tensor with no other weight (a tied
  LM head's weight is the embedding's too: folding it would store both);
- in float16, ``W * g`` and ``W @ t`` stay finite.

``AOTPACK_FOLD_NORM_SCALES``: "on" (the default) folds both kinds, "rms" the multiplies by a
scale alone (RMSNorms), "off" keeps the graph as exported.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind

from aot.errors import CodegenError
from aot.settings import setting

ATEN = torch.ops.aten
ENV = "AOTPACK_FOLD_NORM_SCALES"
DEFAULT = "on"
SETTINGS = ("on", "rms", "off")  # on: RMSNorm scales and LayerNorms; rms: the scales alone
VIEWS = (ATEN.view.default, ATEN._unsafe_view.default, ATEN.reshape.default)
TRANSPOSES = (ATEN.t.default, ATEN.permute.default, ATEN.transpose.int)


def mode() -> str:
    """``AOTPACK_FOLD_NORM_SCALES`` where set (one of ``SETTINGS``), else ``DEFAULT``; any other
    value is a ``CodegenError`` naming them."""
    return setting(ENV, DEFAULT, SETTINGS, error=CodegenError)


def _weights(ep) -> dict[torch.fx.Node, torch.Tensor]:
    """Each weight placeholder of ``ep``'s graph, with its tensor."""
    out = {}
    state = {**ep.state_dict, **ep.constants}  # non-persistent buffers are constants
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        if (
            spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
            and spec.target in state
        ):
            out[node] = state[spec.target]
    return out


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _transposed_weight(node, weights) -> torch.fx.Node | None:
    """``W`` where ``node`` is ``W``'s transpose (``t``, ``permute(1, 0)``, ``transpose(0, 1)``) and
    ``W`` a 2-D weight."""
    if node.op != "call_function" or node.target not in TRANSPOSES:
        return None
    if node.target is ATEN.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if node.target is ATEN.transpose.int and node.args[1] % 2 == node.args[2] % 2:
        return None  # transpose(W, d, d): W as it is
    w = node.args[0]
    val = _val(w)
    return w if w in weights and val is not None and val.dim() == 2 else None


def _right_weight(node, k: int, weights) -> tuple[torch.fx.Node, bool] | None:
    """``(W, transposed)`` where a matmul's right operand ``node`` [K, N] is a 2-D weight's
    transpose (``nn.Linear``'s W [N, K]: ``transposed``) or the weight itself (GPT-2's ``Conv1D``,
    W [K, N])."""
    w = _transposed_weight(node, weights)
    if w is not None:
        return (w, True) if _val(w).shape[1] == k else None
    val = _val(node)
    if node in weights and val is not None and val.dim() == 2 and val.shape[0] == k:
        return node, False
    return None


def _readers(node, k: int, weights, found: list) -> bool:
    """Whether every reader of ``node`` (through views that keep ``k`` the last dim) is a matmul
    taking it on the left and a weight (transposed or not: ``_right_weight``) on the right; those
    ``(matmul, right operand, W, transposed)`` are appended to ``found``."""
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target in VIEWS:
            val = _val(user)
            if val is None or val.dim() == 0 or val.shape[-1] != k or not _readers(user, k, weights, found):
                return False
            continue
        if user.target is ATEN.addmm.default:
            if user.kwargs:  # beta, alpha: a scaled bias or product
                return False
            left, right = user.args[1], user.args[2]
        elif user.target is ATEN.mm.default:
            left, right = user.args[0], user.args[1]
        else:
            return False
        if left is not node or right is node:
            return False
        weight = _right_weight(right, k, weights)
        if weight is None:
            return False
        found.append((user, right, *weight))
    return True


def _sole_readers(found: list, weights, shared: Counter, dtype) -> bool:
    """Whether each W of ``found`` is of ``dtype``, shares its tensor with no other weight, and is
    read by nothing but these matmuls (through their transposes)."""
    matmuls = {m for m, _, _, _ in found}
    rights = {r if t else m for m, r, _, t in found}  # what reads W: its transpose, else the matmul
    for _, right, w, transposed in found:
        if _val(w).dtype != dtype or shared[id(weights[w])] > 1 or not set(w.users) <= rights:
            return False
        if transposed and not set(right.users) <= matmuls:
            return False
    return True


def _fits(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (in its dtype)."""
    return bool(torch.isfinite(tensor).all())


def _scale_fits(w: torch.Tensor, g: torch.Tensor, transposed: bool) -> bool:
    """Whether ``W * g`` (g along K) stays finite in W's dtype: the largest |W| of each K times
    |g|, exact in the dtype's own arithmetic up to the product's rounding."""
    if w.dtype != torch.float16:  # bfloat16 and float32 share float32's range
        return True
    col = w.abs().amax(dim=0 if transposed else 1).float()
    return bool((col * g.abs().float()).amax() <= torch.finfo(w.dtype).max)


def _node(graph, fake, target, args: tuple, before):
    """A new call of ``target`` on ``args`` before ``before``, its fake value computed."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    with fake:
        node.meta["val"] = target(*[_val(a) if isinstance(a, torch.fx.Node) else a for a in args])
    return node


def _along_k(graph, fake, vec, transposed: bool, before):
    """``vec`` [K] as it multiplies W along K: as it is against W [N, K] (``transposed``), a column
    ``vec[:, None]`` against W [K, N]."""
    return vec if transposed else _node(graph, fake, ATEN.unsqueeze.default, (vec, 1), before)


def _scale_weights(graph, fake, found: list, g) -> None:
    """Each W of ``found`` read as ``W * g`` (g along K) by its matmuls (through their transposes):
    a step of weights alone, which the build folds, before the first of those readers."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers: dict = {}
    for matmul, right, w, transposed in found:
        readers.setdefault((w, transposed), set()).add(right if transposed else matmul)
    for (w, transposed), nodes in readers.items():
        first = min(nodes, key=order.__getitem__)
        scaled = _node(graph, fake, ATEN.mul.Tensor, (w, _along_k(graph, fake, g, transposed, first)), first)
        for r in nodes:
            r.replace_input_with(w, scaled)


def _shift_biases(graph, fake, found: list, shift) -> None:
    """Each matmul of ``found`` given ``W @ shift`` (W as [N, K], unscaled) in its bias:
    ``addmm(b, y, Wt)`` takes ``b + W @ shift``, ``mm(y, Wt)`` becomes ``addmm(W @ shift, y, Wt)``."""
    for matmul, _, w, transposed in found:
        column = _along_k(graph, fake, shift, transposed, matmul)
        products = _node(graph, fake, ATEN.mul.Tensor, (w, column), matmul)
        # W @ shift: [N]
        shifted = _node(graph, fake, ATEN.sum.dim_IntList, (products, [1 if transposed else 0]), matmul)
        if matmul.target is ATEN.addmm.default:
            bias = _node(graph, fake, ATEN.add.Tensor, (matmul.args[0], shifted), matmul)
            matmul.args = (bias, *matmul.args[1:])
            continue
        biased = _node(graph, fake, ATEN.addmm.default, (shifted, *matmul.args), matmul)
        matmul.replace_all_uses_with(biased)
        graph.erase_node(matmul)


def _fold_scale(graph, fake, node, weights, shared: Counter) -> bool:
    """``g * y`` at ``node`` folded where the module docstring says; whether it was."""
    a, b = node.args
    g, y = (a, b) if a in weights else (b, a)
    gv, yv, out = _val(g), _val(y), _val(node)
    if g not in weights or gv is None or yv is None or out is None or gv.dim() != 1:
        return False
    k = gv.shape[0]
    if yv.dim() == 0 or yv.shape[-1] != k or not (gv.dtype == yv.dtype == out.dtype):
        return False
    if not out.is_floating_point() or tuple(out.shape) != tuple(yv.shape):
        return False
    found: list = []
    if not node.users or not _readers(node, k, weights, found):
        return False
    if not _sole_readers(found, weights, shared, gv.dtype):
        return False
    if not all(_scale_fits(weights[w], weights[g], t) for _, _, w, t in found):
        return False
    _scale_weights(graph, fake, found, g)
    node.replace_all_uses_with(y)
    graph.erase_node(node)
    return True


def _fold_layer_norm(graph, fake, node, weights, shared: Counter) -> bool:
    """A LayerNorm's scale and shift at ``node`` folded into the projections that alone read its
    output; whether they were."""
    x, shape, scale, shift = node.args[:4]
    xv = _val(x)
    if xv is None or not xv.is_floating_point() or len(shape) != 1 or (scale is None and shift is None):
        return False
    k = xv.shape[-1]
    for vec in (v for v in (scale, shift) if v is not None):
        val = _val(vec)
        if vec not in weights or val is None or val.shape != (k,) or val.dtype != xv.dtype:
            return False
    outs = list(node.users)
    if any(u.target is not operator.getitem for u in outs):
        return False
    normed = [u for u in outs if u.args[1] == 0]  # the mean and 1/std do not change
    found: list = []
    if len(normed) != 1 or not normed[0].users or not _readers(normed[0], k, weights, found):
        return False
    if not _sole_readers(found, weights, shared, xv.dtype):
        return False
    if scale is not None and not all(_scale_fits(weights[w], weights[scale], t) for _, _, w, t in found):
        return False
    if shift is not None:
        shifted = (torch.mv(weights[w] if t else weights[w].t(), weights[shift]) for _, _, w, t in found)
        if not all(_fits(c) for c in shifted):
            return False
    if scale is not None:
        _scale_weights(graph, fake, found, scale)
    if shift is not None:  # W @ shift of the unscaled W
        _shift_biases(graph, fake, found, shift)
    node.args = (x, shape, None, None, *node.args[4:])
    return True


def fold_norm_scales(ep) -> int:
    """Fold each norm scale (and LayerNorm shift) the module docstring describes; the number of
    norms folded."""
    what = mode()
    if what == "off":
        return 0
    graph = ep.graph
    weights = _weights(ep)
    shared = Counter(id(t) for t in weights.values())
    fake = detect_fake_mode([v for n in graph.nodes if (v := _val(n)) is not None])
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is ATEN.mul.Tensor and len(node.args) == 2:
            folded += _fold_scale(graph, fake, node, weights, shared)
        elif node.target is ATEN.native_layer_norm.default and what == "on" and len(node.args) == 5:
            folded += _fold_layer_norm(graph, fake, node, weights, shared)
    return folded
