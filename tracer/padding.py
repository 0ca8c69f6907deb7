"""Check, at build time, that padding a paddable dim leaves the real rows' outputs unchanged.

A call whose size has no CUDA graph of its own may run in a larger bucket's graph with its inputs
padded. That is only sound when (1) every output dim that depends on the padded symbol is exactly
that symbol (so the real rows can be sliced out) and (2) the real rows do not depend on the padded
ones. (1) is read off the traced output shapes; (2) is tested by running the model at a size ``n``
and padded to the next bucket with random values in the padding, then comparing the real rows.
A dim that fails either is not padded, and the bundle records why.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.admissible import admits
from aot.dtypes import tolerance
from aot.schema import Bucket, Guards
from aot.spec import ModelSpec
from aot.tracer.export import example_size

# Real rows may differ by ``aot.dtypes.tolerance(dtype).rtol`` of the output's scale: a different
# size can change a library's blocking and hence rounding (a few ulps); padding that leaks differs by O(1).


def check_padding(spec: ModelSpec, exported: Any, progress=None) -> tuple[Bucket, ...]:
    """``exported.buckets`` with each paddable one checked (``pad_check`` says what was found)."""
    import torch

    from aot.tracer.lower import tensor_leaves as leaves
    from aot.tracer.model import call_model, example_inputs, user_input_nodes

    guards: Guards = exported.guards
    ep, module = exported.ep, exported.module
    symbols = {g.name: g for g in guards.symbols}
    out_shapes = [v.shape for v in _output_vals(ep)]
    sym_of = {}
    nodes = user_input_nodes(ep, spec)
    for inp in spec.inputs:
        for declared, size in zip(inp.shape, nodes[inp.name].meta["val"].shape):
            if hasattr(declared, "name") and isinstance(size, torch.SymInt):
                sym_of.setdefault(declared.name, size.node.expr)
    result = []
    for bucket in exported.buckets:
        if not bucket.paddable:
            result.append(bucket)
            continue
        name = bucket.symbol
        expr = sym_of.get(name)
        reason = None
        state = [i.name for i in spec.state_inputs() if getattr(i.shape[0], "name", None) == name]
        if state:  # padded rows would write into rows of the state that other calls own
            reason = f"{name} is the batch of state input {state[0]!r}"
            if progress:
                progress(f"  {name} is marked paddable but will not be padded: {reason}")
            result.append(replace(bucket, paddable=False, pad_check=f"refused: {reason}"))
            continue
        for i, shape in enumerate(out_shapes):
            for d, size in enumerate(shape):
                e = size.node.expr if isinstance(size, torch.SymInt) else None
                if e is not None and expr in e.free_symbols and e != expr:
                    reason = f"output {i} dim {d} is {e}, not {name} alone"
        g = symbols[name]
        pair = _sizes_to_check(g, bucket.sizes)
        if reason is None and pair is None:
            result.append(replace(bucket, pad_check="every admitted size is a bucket: padding never needed"))
            continue
        if reason is None:
            n, b = pair
            base = {d.name: example_size(d, exported.ranges[d.name]) for d in spec.dims()}
            real = example_inputs(spec, {**base, name: n}, seed=spec.seed + 1)
            padded = example_inputs(spec, {**base, name: b}, seed=spec.seed + 2)
            for inp in spec.inputs:
                dims = [d for d, s in enumerate(inp.shape) if getattr(s, "name", None) == name]
                index = tuple(slice(0, n) if d in dims else slice(None) for d in range(len(inp.shape)))
                padded[inp.name][index] = real[inp.name]
            with torch.no_grad():
                want = leaves(call_model(spec, module, real))
                got = leaves(call_model(spec, module, padded))
            diff, scale = 0.0, 1.0
            for w, p in zip(want, got):
                # the real rows: every dim where the padded output is larger (only dims that are
                # exactly ``name`` can be, checked above)
                index = tuple(slice(0, ws) for ws in w.shape)
                if not w.dtype.is_floating_point:
                    diff = max(diff, float((p[index] != w).any()))
                    continue
                diff = max(diff, (p[index].float() - w.float()).abs().max().item())
                scale = max(scale, w.float().abs().max().item())
            if diff <= tolerance(spec.dtype).rtol * scale:
                result.append(
                    replace(
                        bucket, pad_check=f"{name} {n} padded to {b}: real rows differ by at most {diff:.3g}"
                    )
                )
                continue
            reason = f"padding {name} {n} to {b} changed real rows by {diff:.3g}"
        if progress:
            progress(f"  {name} is marked paddable but will not be padded: {reason}")
        result.append(replace(bucket, paddable=False, pad_check=f"refused: {reason}"))
    return tuple(result)


def _sizes_to_check(g, sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """The smallest admitted size that is not a bucket, and the bucket it pads to."""
    for b_prev, b in zip((g.min - 1, *sizes), sizes):
        for n in range(b_prev + 1, b):
            if admits(g, n):
                return n, b
    return None


def _output_vals(ep) -> list:
    out = next(n for n in ep.graph.nodes if n.op == "output")
    return [a.meta["val"] for a in out.args[0] if a is not None and hasattr(a, "meta")]
