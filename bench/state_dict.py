"""Write a model file's module state dict, at the model's dtype, to a safetensors file.

    python bench/state_dict.py MODEL.py OUT.safetensors

The module is the model file's own, seeded (``aot.tracer.instantiate``), as ``aotpack build``
makes it. The benchmark builds a bundle from this file (``aotpack build --weights``) and loads
it into every other system, so all of them run the same weights: a bundle's own split weights
cannot serve there, since the build stacks sibling matmuls' weights and pads unaligned ones.
"""

from __future__ import annotations

import json
import sys
import time


def main(model: str, out: str) -> None:
    start = time.time()
    from safetensors.torch import save_file

    from aot.tracer import instantiate, load_model_file

    state = instantiate(load_model_file(model)).state_dict()
    # clones: tied parameters (an embedding shared with the LM head) are stored under every name
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, out)
    print(json.dumps({"state_s": time.time() - start, "tensors": len(state)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
