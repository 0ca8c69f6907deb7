"""Mixture-of-Experts layers as static-shape grouped GEMMs, for the duration of an export.

transformers' experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, ... : ``@use_experts_implementation``)
compute each token's top-k experts in one of two ways that a bundle cannot hold: the ``eager`` loop
runs once per expert that was hit (a graph that depends on the routing values), and the default
``grouped_mm`` calls ``torch._grouped_mm`` only outside a compiler, taking an opaque custom op
(``transformers::grouped_mm_fallback``, a host loop over the offsets) under ``torch.export``.

The number of routed rows is static, though: ``tokens * top_k``. So ``grouped_experts`` replaces each
experts module's forward, while the model is exported, by the same computation in a form whose
shapes do not depend on the routing: the routed rows sorted by expert id, per-expert offsets
computed on the device, one grouped GEMM for the gate/up projection and one for the down
projection (``aten._grouped_mm``: each row multiplied by its own expert's weights only, top-k of
the experts' work per token, never all of them), the routing weights applied, and the rows put back
in token order and summed over the top-k. The module is found by its structure (stacked expert
weights ``[E, ...]`` and a ``(hidden_states, top_k_index, top_k_weights)`` forward), not its name,
and the build's reference check still runs the library's own forward. DBRX keeps its experts'
weights flat instead (``mlp.w1``, ``v1``, ``w2``: ``[E * F, H]`` each, the gate's and the up
projection's ``[F, H]`` per expert as a linear layer's, the down projection's ``[F, H]`` applied
as ``h @ w2``) and loops over the experts hit like the ``eager`` implementation: the same grouped
GEMMs over views of them (``flat_glu``).

JetMoE routes its own way (``split_experts``): its router counts each expert's rows and reads the
counts into Python (``.tolist()``), and its "parallel experts" modules split the rows grouped by
expert by those counts, one linear layer per expert. For the export the counts stay on the device
(``DeviceCounts``, what ``.tolist()`` gives in the router's forward alone) and each parallel experts
module is one grouped GEMM over the offsets they sum to; the router's code, the gather of the rows
and their way back are the library's own.

Switch Transformers keeps each expert as a module of its own (``expert_0`` ... beside each other,
each ``wi``, an activation, ``wo``) and takes the router's top-1 choice as a one-hot dispatch mask
``[T, 1, E]``, zero for a token past its expert's capacity, looping over the experts hit: the same
grouped GEMMs over the experts' weights stacked (``module_experts``; the stack is of weights alone,
which the build folds into one weight of its own), a token past capacity weighing 0.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from aot.errors import TraceError

# The experts implementations of transformers that compute the plain top-k mixture (the others
# are device-specific kernels, which export could not hold either).
REPLACED_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")
# The CPU kernel of aten._grouped_mm reads its operands with strides that are multiples of 16 bytes.
GROUPED_MM_ALIGNMENT = 16
# How experts modules name their forward's parameters: the hidden states, then the routing as
# the router computed it ([tokens, top_k] expert ids and weights); GPT-OSS names them its own way.
FORWARD_PARAMETERS = (
    ("hidden_states", "top_k_index", "top_k_weights"),
    ("hidden_states", "router_indices", "routing_weights"),
)


def _expert_count(module: Any) -> int | None:
    """``module``'s ``num_experts`` where it is a positive int (not a bool), else None."""
    experts = getattr(module, "num_experts", None)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        return None
    return experts


def _forward_parameters(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The names of ``module.forward``'s parameters; None where its signature cannot be read."""
    try:
        return tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None


def is_experts_module(module: torch.nn.Module) -> bool:
    """A module of stacked expert weights (``gate_up_proj`` or ``up_proj``, and ``down_proj``,
    each ``[E, ...]`` with E its ``num_experts``; or DBRX's flat ones, ``flat_glu``) whose forward
    takes the routing as computed: ``(hidden_states, top_k_index, top_k_weights)`` (or GPT-OSS's
    names for them)."""
    experts = _expert_count(module)
    if experts is None:
        return False
    up = getattr(module, "gate_up_proj", None) if _has_gate(module) else getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    stacked = all(isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[0] == experts for w in (up, down))
    if not stacked and flat_glu(module) is None:
        return False
    params = _forward_parameters(module)
    return params is not None and params[:3] in FORWARD_PARAMETERS


def flat_glu(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """DBRX's experts weights (its ``DbrxExpertGLU`` as ``module.mlp``): the gate's, the up
    projection's and the down projection's, each viewed ``[E, F, H]`` from ``[E * F, H]``; the
    gate's and up's ``[F, H]`` per expert as a linear layer's weight, the down's applied as
    ``h @ w2`` (``[F, H]``: input by output). None where ``module`` keeps no such weights."""
    experts, mlp = _expert_count(module), getattr(module, "mlp", None)
    weights = [getattr(mlp, "w1", None), getattr(mlp, "v1", None), getattr(mlp, "w2", None)]
    if experts is None:
        return None
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):
        return None
    if len({tuple(w.shape) for w in weights}) != 1 or weights[0].shape[0] % experts:
        return None
    if not callable(getattr(mlp, "activation_fn", None)):
        return None
    hidden = weights[0].shape[1]
    return tuple(w.view(experts, -1, hidden) for w in weights)  # type: ignore[return-value]


def _has_gate(module: torch.nn.Module) -> bool:
    # transformers' decorator sets ``has_gate``; a class without it has a fused gate_up_proj
    return getattr(module, "has_gate", isinstance(getattr(module, "gate_up_proj", None), torch.Tensor))


def replaceable(module: torch.nn.Module) -> bool:
    """An experts module whose implementation computes the plain mixture, on one device (expert
    parallelism routes some rows elsewhere)."""
    if not is_experts_module(module) or getattr(module, "_is_expert_parallel", False):
        return False
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return implementation in REPLACED_IMPLEMENTATIONS


@contextlib.contextmanager
def grouped_experts(model: torch.nn.Module) -> Iterator[int]:
    """Every replaceable experts module of ``model`` computes as ``grouped_experts_forward`` for
    the duration, and every split experts module as one grouped GEMM over its router's counts
    (``split_experts``); yields how many experts modules there are."""
    found = [m for m in model.modules() if replaceable(m)]
    for m in found:
        m.forward = _routed_forward(m)
    owned = {m: e for m in model.modules() if (e := module_experts(m)) is not None}
    for m, experts in owned.items():
        m.forward = _module_experts_forward(m, experts)
    split = split_experts(model)
    for m in split:
        m.forward = _grouped_split_forward(m)
    routers = {id(r): r for m in split for r in split[m]}.values()
    for r in routers:
        r.forward = _counting_forward(r)
    try:
        yield len(found) + len(owned) + len(split)
    finally:
        for m in (*found, *owned, *split, *routers):
            del m.forward


def _routed_forward(module: torch.nn.Module):
    """``grouped_experts_forward`` on ``module``, taking its arguments by position or by the
    names its own forward gives them."""
    names = tuple(inspect.signature(module.forward).parameters)[:3]

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        values = [*args, *(kwargs.pop(n) for n in names[len(args) :] if n in kwargs)]
        if kwargs or len(values) != 3:
            raise TypeError(
                f"{type(module).__name__}.forward takes {names}, got {len(args)} and {sorted(kwargs)}"
            )
        return grouped_experts_forward(module, *values)

    return forward


# How experts kept as modules name their forward's parameters: the hidden states, the one-hot
# dispatch mask [T, 1, E], each token's weight [T, 1] (Switch Transformers').
DISPATCH_PARAMETERS = ("hidden_states", "selected_experts", "routing_weights")


def module_experts(module: torch.nn.Module) -> list[tuple[torch.nn.Linear, Any, torch.nn.Linear]] | None:
    """Each expert's (in projection, activation, out projection) where ``module`` keeps its
    ``num_experts`` experts as modules ``expert_0`` ... of their own, each two linear layers with an
    ``act`` between them (Switch Transformers' ``SwitchTransformersExperts``), and its forward takes
    ``(hidden_states, selected_experts, routing_weights)``; None otherwise."""
    experts = _expert_count(module)
    if experts is None:
        return None
    children = dict(module.named_children())
    if sorted(children) != sorted(f"expert_{e}" for e in range(experts)):
        return None
    found = []
    for e in range(experts):
        expert = children[f"expert_{e}"]
        linears = [m for m in expert.children() if isinstance(m, torch.nn.Linear)]
        act = getattr(expert, "act", None)
        if len(linears) != 2 or not callable(act):
            return None
        up, down = linears
        if up.out_features != down.in_features or up.in_features != down.out_features:
            return None
        found.append((up, act, down))
    shapes = {(up.weight.shape, up.bias is None, down.bias is None) for up, _, down in found}
    if len(shapes) != 1 or len({type(act) for _, act, _ in found}) != 1:
        return None
    return found if _forward_parameters(module) == DISPATCH_PARAMETERS else None


def _module_experts_forward(
    module: torch.nn.Module, experts: list[tuple[torch.nn.Linear, Any, torch.nn.Linear]]
):
    """The top-1 mixture of ``module``'s experts kept as modules (``experts``: ``module_experts``'s),
    as grouped GEMMs over their stacked weights: a token's expert is its dispatch mask's one, its
    weight its routing weight, or 0 where the mask is all zero (past its expert's capacity: the
    library leaves its row 0)."""

    def forward(hidden_states: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor):
        ups = [up for up, _, _ in experts]
        downs = [down for _, _, down in experts]
        act = experts[0][1]
        tokens = hidden_states.shape[0]
        dispatch = selected_experts.reshape(tokens, -1)  # [T, E], one-hot or all zero
        index = dispatch.argmax(-1, keepdim=True)  # [T, 1]
        routed = dispatch.sum(-1, keepdim=True).to(routing_weights.dtype)  # 0 past capacity
        weights = routing_weights.reshape(tokens, 1) * routed
        up_weight = torch.stack([m.weight for m in ups])  # [E, I, H]
        down_weight = torch.stack([m.weight for m in downs])  # [E, H, I]
        _check_alignment(module, up_weight, down_weight)
        expert_ids, order, rows, offsets = _routed_rows(hidden_states, index, len(experts))
        up_bias = torch.stack([m.bias for m in ups])[expert_ids] if ups[0].bias is not None else None
        projected = act(_grouped_linear(rows, up_weight, offsets, up_bias, False))
        down_bias = torch.stack([m.bias for m in downs])[expert_ids] if downs[0].bias is not None else None
        out = _grouped_linear(projected.to(down_weight.dtype), down_weight, offsets, down_bias, False)
        row_weights = weights.reshape(-1)[order].unsqueeze(-1)
        weighted = torch.where(row_weights != 0, out * row_weights, 0)  # a row past capacity: 0, never NaN
        return _token_order(weighted, order, tokens, 1).to(hidden_states.dtype)

    return forward


# How a split experts module names its forward's parameters: the grouped rows, the rows per expert.
SPLIT_PARAMETERS = ("inputs", "expert_size")


def is_split_experts(module: torch.nn.Module) -> bool:
    """A module of stacked expert weights (``weight``, ``[E, N, K]`` with E its ``num_experts``)
    whose forward takes the rows grouped by expert and how many rows each expert has,
    ``(inputs, expert_size)``: JetMoE's ``JetMoeParallelExperts``, a linear layer per expert over
    its slice of the rows."""
    experts, weight = _expert_count(module), getattr(module, "weight", None)
    if experts is None:
        return False
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[0] == experts):
        return False
    return _forward_parameters(module) == SPLIT_PARAMETERS


def split_experts(model: torch.nn.Module) -> dict[torch.nn.Module, list[torch.nn.Module]]:
    """Each split experts module of ``model`` (``is_split_experts``) with the routers that count
    its rows: the modules beside it (children of its parent) with as many experts that hold no
    expert weights themselves. One with no router beside it is left as it is (the export then
    names the line that reads sizes from values)."""
    found: dict[torch.nn.Module, list[torch.nn.Module]] = {}
    for parent in model.modules():
        children = list(parent.children())
        for m in children:
            if not is_split_experts(m):
                continue
            routers = [
                r
                for r in children
                if r is not m
                and getattr(r, "num_experts", None) == m.num_experts
                and not is_split_experts(r)
                and not is_experts_module(r)
            ]
            if routers:
                found[m] = routers
    return found


class DeviceCounts:
    """What ``.tolist()`` of a router's rows-per-expert counts gives while the model is exported:
    the counts kept on the device (``counts``, ``[E]`` integers), which a split experts module takes
    as the end of each expert's group of rows (``offsets``). Read as a Python list, it says why not."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts

    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.counts, 0).to(torch.int32)

    def _refuse(self, *_: Any) -> Any:
        raise TraceError(
            "a router's rows per expert were read into Python (.tolist()) and used beyond the experts "
            "modules that take them: a bundle's shapes cannot depend on them; keep the counts a tensor"
        )

    __iter__ = __len__ = __getitem__ = _refuse


def _counting_forward(module: torch.nn.Module):
    """``module``'s own forward, in which ``.tolist()`` of a 1-D integer tensor of one count per
    expert gives ``DeviceCounts``; every other ``.tolist()`` is torch's. (The export's own tensor
    classes define their ``tolist``: each is replaced alike, for the forward's duration.)"""
    forward, experts = module.forward, module.num_experts

    def counting(*args: Any, **kwargs: Any) -> Any:
        # torch.Tensor inherits its tolist from the C base class: given one for the duration
        classes = _tensor_classes()
        originals = [vars(c).get("tolist") for c in classes]
        for c in classes:
            c.tolist = _counted(c.tolist, experts)
        try:
            return forward(*args, **kwargs)
        finally:
            for c, tolist in zip(classes, originals):
                if tolist is None:
                    del c.tolist
                else:
                    c.tolist = tolist

    return counting


def _counted(tolist: Any, experts: int) -> Any:
    def counted(self: torch.Tensor) -> Any:
        if self.dim() == 1 and self.shape[0] == experts and not self.is_floating_point():
            return DeviceCounts(self)
        return tolist(self)

    return counted


def _tensor_classes() -> list[type]:
    """torch.Tensor and the tensor classes the export computes with (its fake and functional
    tensors, which define their own ``tolist``)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return [torch.Tensor, FakeTensor, FunctionalTensor]


def _grouped_split_forward(module: torch.nn.Module):
    """A split experts module's forward as one grouped GEMM: the rows grouped by expert, each
    through its own expert's ``[N, K]`` weight as a linear layer; the counts from its router."""

    def forward(inputs: torch.Tensor, expert_size: Any) -> torch.Tensor:
        if not isinstance(expert_size, DeviceCounts):
            raise TraceError(
                f"{type(module).__name__} was given its rows per expert as {type(expert_size).__name__}, "
                "not as its router's counts: the router beside it is not the one that counted them"
            )
        _check_alignment(module, module.weight)
        return _grouped_linear(inputs, module.weight, expert_size.offsets(), None, False)

    return forward


def grouped_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The top-k mixture of the experts ``self`` holds, with shapes fixed by the token count alone.

    Mathematically what transformers' experts implementations compute: for each token t and each
    of its k routed experts e with weight w, ``w * down_e(gate(up_e(x_t)))``, summed over the k.
    The products are summed in the order transformers' ``grouped_mm`` sums them."""
    # hidden_states: [T, H]; top_k_index, top_k_weights: [T, k]; S = T * k routed rows
    flat = flat_glu(self)
    if flat is not None:
        return _flat_glu_forward(self, flat, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    experts = self.num_experts
    transposed = getattr(self, "is_transposed", False)
    has_gate = _has_gate(self)
    has_bias = getattr(self, "has_bias", False)
    up_weight = self.gate_up_proj if has_gate else self.up_proj
    _check_alignment(self, up_weight, self.down_proj)

    # rows [S, H] grouped by expert, each its token's; offsets [E]: the end of each expert's rows
    expert_ids, order, rows, offsets = _routed_rows(hidden_states, top_k_index, experts)
    row_weights = top_k_weights.reshape(-1)[order]  # [S]

    up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias)[expert_ids] if has_bias else None
    projected = _grouped_linear(rows, up_weight, offsets, up_bias, transposed)  # [S, 2I] or [S, I]
    if has_gate:
        apply_gate = getattr(self, "_apply_gate", None)
        if apply_gate is not None:
            projected = apply_gate(projected)
        else:
            gate, up = projected.chunk(2, dim=-1)
            projected = self.act_fn(gate) * up  # [S, I]
    else:
        projected = self.act_fn(projected)
    down_bias = self.down_proj_bias[expert_ids] if has_bias else None
    out = _grouped_linear(projected, self.down_proj, offsets, down_bias, transposed)  # [S, H]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    weighted = out * row_weights.unsqueeze(-1)  # [S, H]
    return _token_order(weighted, order, tokens, top_k).to(hidden_states.dtype)


def _routed_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, experts: int):
    """The routed rows grouped by expert: (expert ids sorted, the order they came in, each row's
    token's hidden state, the end of each expert's group of rows on the device)."""
    top_k = top_k_index.shape[1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))  # any order within one expert
    rows = hidden_states[order // top_k]
    experts_range = torch.arange(experts, device=expert_ids.device)
    offsets = (expert_ids[None, :] <= experts_range[:, None]).sum(1, dtype=torch.int32)
    return expert_ids, order, rows, offsets


def _token_order(weighted: torch.Tensor, order: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Routed rows back in token order (``order[j]`` sits at j), summed over the top-k: [T, H]."""
    routed = torch.arange(order.shape[0], device=order.device)
    inverse = torch.zeros_like(order).scatter(0, order, routed)
    return weighted[inverse].view(tokens, top_k, -1).sum(dim=1)


def _flat_glu_forward(self: Any, flat, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """DBRX's mixture (``flat_glu``): each routed row through its expert's gate and up projections,
    ``act(gate) * up``, then ``@ w2``, weighted and summed over the top-k; the output viewed as its
    forward views it, ``[hidden_states.shape[0], -1, H]``."""
    gate_weight, up_weight, down_weight = flat
    hidden = gate_weight.shape[2]
    tokens, top_k = top_k_index.shape
    _check_alignment(self, gate_weight, down_weight)
    flat_states = hidden_states.reshape(-1, hidden)
    expert_ids, order, rows, offsets = _routed_rows(flat_states, top_k_index, self.num_experts)
    gate = _grouped_linear(rows, gate_weight, offsets, None, False)  # [S, F]
    up = _grouped_linear(rows, up_weight, offsets, None, False)
    down = _grouped_linear(self.mlp.activation_fn(gate) * up, down_weight, offsets, None, True)  # [S, H]
    weighted = down * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    out = _token_order(weighted, order, tokens, top_k).to(hidden_states.dtype)
    return out.view(hidden_states.shape[0], -1, hidden)


@torch.library.custom_op("aotpack::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``aten._grouped_mm(rows, weights, offsets)``, which the program runs: rows [S, K] grouped by
    expert, weights [E, K, N], offsets int32 [E] (the end of each group) -> [S, N]. It stands for
    that op during export only because ATen's shape function for it admits bfloat16 alone, where
    its CPU kernel (what a bundle runs on the CPU) takes every float dtype; the lowering names the
    ATen op (``aot.tracer.lower.STANDS_FOR``)."""
    return torch._grouped_mm(rows, weights, offsets)


@grouped_mm.register_fake
def _(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weights.shape[2])


def _grouped_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    transposed: bool,
) -> torch.Tensor:
    # rows: [S, K] grouped by expert; weight: [E, N, K] ([E, K, N] when transposed) -> [S, N]
    stacked = weight if transposed else weight.transpose(-2, -1)  # [E, K, N]
    out = grouped_mm(rows.to(weight.dtype), stacked, offsets)
    return out if bias is None else out + bias


def _check_alignment(module: Any, *weights: torch.Tensor) -> None:
    itemsize = weights[0].element_size()
    sizes = sorted({s for w in weights for s in w.shape[1:]})
    odd = [s for s in sizes if (s * itemsize) % GROUPED_MM_ALIGNMENT]
    if odd:
        raise TraceError(
            f"{type(module).__name__}: expert weights of sizes {sizes} ({weights[0].dtype}) cannot run as grouped "
            f"GEMMs: every expert dim times {itemsize} bytes must be a multiple of {GROUPED_MM_ALIGNMENT} bytes, "
            f"{odd} are not; use hidden and intermediate sizes that are multiples of {GROUPED_MM_ALIGNMENT // itemsize}"
        )
