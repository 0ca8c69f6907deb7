"""A norm's per-column scale folded into the weights of the projections that read it.

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

The pass rewrites the exported graph, so every entry point and bucket sees the same program: the
``mul`` goes, and each weight is read through ``mul(W, g)``, a step of weights alone that
``aot.tracer.folding`` computes at build time (a weight ``folded.<digest>``; the original ``W``,
then read by nothing else, leaves the bundle). ``W * g`` is rounded to the weights' dtype once,
where the reference rounds ``g * y`` in every call: the products differ by that rounding (about
one unit in the last place of a weight), as two libraries' do.

Folded only where nothing else could see the difference:

- ``g`` is a weight of one dim, the row's last (K), of the row's dtype and the product's;
- the product reaches only matmuls (``mm``, ``addmm``, through views that keep K the
  last dim) as their left operand, whose right operand is a weight ``W`` [N, K] through its
  transpose;
- each such ``W`` is read by nothing else and shares its tensor with no other weight (a tied
  LM head's weight is the embedding's too: folding it would store both).

``AOTPACK_FOLD_NORM_SCALES=off`` keeps the graph as exported.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind

from aot.errors import CodegenError
from aot.settings import setting

ATEN = torch.ops.aten
ENV = "AOTPACK_FOLD_NORM_SCALES"
DEFAULT = "on"
VIEWS = (ATEN.view.default, ATEN._unsafe_view.default, ATEN.reshape.default)
TRANSPOSES = (ATEN.t.default, ATEN.permute.default, ATEN.transpose.int)


def enabled() -> bool:
    """``AOTPACK_FOLD_NORM_SCALES`` ("on"/"off") where set, else ``DEFAULT``; any other value is a
    ``CodegenError`` naming the two."""
    return setting(ENV, DEFAULT, ("on", "off"), error=CodegenError) == "on"


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


def _readers(node, k: int, weights, found: list) -> bool:
    """Whether every reader of ``node`` (through views that keep ``k`` the last dim) is a matmul
    taking it on the left and a weight's transpose on the right; those ``(matmul, transpose, W)``
    are appended to ``found``."""
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target in VIEWS:
            val = _val(user)
            if val is None or val.dim() == 0 or val.shape[-1] != k or not _readers(user, k, weights, found):
                return False
            continue
        if user.target is ATEN.addmm.default:
            left, right = user.args[1], user.args[2]
        elif user.target is ATEN.mm.default:
            left, right = user.args[0], user.args[1]
        else:
            return False
        if left is not node or right is node:
            return False
        w = _transposed_weight(right, weights)
        if w is None or _val(w).shape[1] != k:
            return False
        found.append((user, right, w))
    return True


def fold_norm_scales(ep) -> int:
    """Fold each norm scale the module docstring describes; the number folded."""
    if not enabled():
        return 0
    graph = ep.graph
    weights = _weights(ep)
    shared = Counter(id(t) for t in weights.values())
    fake = detect_fake_mode([v for n in graph.nodes if (v := _val(n)) is not None])
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ATEN.mul.Tensor or len(node.args) != 2:
            continue
        a, b = node.args
        g, y = (a, b) if a in weights else (b, a)
        gv, yv, out = _val(g), _val(y), _val(node)
        if g not in weights or gv is None or yv is None or out is None or gv.dim() != 1:
            continue
        k = gv.shape[0]
        if (
            yv.dim() == 0
            or yv.shape[-1] != k
            or not (gv.dtype == yv.dtype == out.dtype)
            or not out.is_floating_point()
        ):
            continue
        if tuple(out.shape) != tuple(yv.shape):
            continue
        found: list = []
        if not node.users or not _readers(node, k, weights, found):
            continue
        matmuls = {m for m, _, _ in found}
        transposes = {t for _, t, _ in found}
        if any(
            _val(w).dtype != gv.dtype
            or shared[id(weights[w])] > 1
            or not set(w.users) <= transposes
            or any(not set(t.users) <= matmuls for t in w.users)
            for _, _, w in found
        ):
            continue
        for _, t, w in found:
            if w not in t.args:  # a transpose read by two matmuls: rewritten once
                continue
            with graph.inserting_before(t):
                scaled = graph.call_function(ATEN.mul.Tensor, (w, g))
            with fake:
                scaled.meta["val"] = ATEN.mul.Tensor(_val(w), gv)
            t.replace_input_with(w, scaled)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        folded += 1
    return folded
