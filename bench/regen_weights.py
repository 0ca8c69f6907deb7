"""Re-create the split weights file of a bundle from its model file's seeded initialisation.

Bundles of the example models carry random, seeded weights. A serving box that receives
``model.tpk`` without its ``model.weights.<sha>.safetensors`` (e.g. a size-limited transfer) can rebuild the
file here; the bundle's sha256 then proves the bytes are exactly what the build wrote.

    python bench/regen_weights.py models/gpt.py gpt.tpk
"""

from __future__ import annotations

import hashlib
import sys

import torch

from aot import schema
from aot.bundle import open_bundle
from aot.packager import _safetensors
from aot.tracer import instantiate, load_model_file


def main(model: str, bundle_path: str) -> None:
    bundle = open_bundle(bundle_path)
    if not bundle.manifest.external_weights:  # its weights are inside it: nothing to re-create
        print(f"{bundle_path}: its weights are inside the bundle")
        return
    program = bundle.program()
    state = instantiate(load_model_file(model)).state_dict()
    tensors = {}
    for w in program.weights:
        if w.name not in state:  # a step of weights alone, computed by the build (aot.tracer.folding)
            sys.exit(
                f"{w.name} is not a parameter of {model} but a tensor the build computed; build the bundle here"
            )
        t = state[w.name].detach()
        rows = (
            int(w.spec.shape[0])
            if w.spec.shape and w.spec.shape[0].isdigit()
            else t.shape[0]
            if t.dim()
            else 0
        )
        if t.dim() == 2 and rows > t.shape[0]:  # the build pads unaligned matmul weights with zero rows
            t = torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
        tensors[w.name] = t.contiguous()
    data = _safetensors(tensors)
    want = bundle.manifest.members[schema.WEIGHTS_PATH].sha256
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        sys.exit(f"regenerated weights differ from the build's (sha256 {got[:16]} vs {want[:16]})")
    bundle.external_path().write_bytes(data)
    print(f"wrote {bundle.external_path()} ({len(data)} bytes, sha256 matches the bundle)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
