"""Size-only causal masks are dropped from SDPA calls; masks that read an input stay."""

from __future__ import annotations

import torch

from aot.codegen.attention import SDPA
from aot.loader import load
from aot.schema import Buf
from aot.tracer import call_model, example_inputs, instantiate, load_model_file


def test_causal_mask_from_sizes_becomes_is_causal_and_input_masks_stay(pattern):
    _, compiled, path, model, _ = pattern("masked_attention")  # traced and built once per session
    spec = load_model_file(model)
    sdpa = [s for p in (compiled.program, *compiled.program.variants) for s in p.steps if s.target == SDPA]
    dropped = [s for s in sdpa if len(s.args) > 3 and s.args[3] is None]
    kept = [s for s in sdpa if len(s.args) > 3 and isinstance(s.args[3], Buf)]
    assert dropped and kept, [s.args[3:] for s in sdpa]
    for s in dropped:  # causal where the query is longer than one token, as eager's is_causal
        assert s.kwargs.get("is_causal") in (True, None)
    assert any(s.kwargs.get("is_causal") is True for s in dropped)
    runner = load(path)
    module = instantiate(spec)
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 2, "seq": 7}, {"batch": 4, "seq": 32}):
        inputs = example_inputs(spec, sizes, seed=3)
        with torch.no_grad():
            want = call_model(spec, module, inputs)
        got = runner(**inputs)
        assert (got - want).abs().max().item() <= 1e-5, sizes
