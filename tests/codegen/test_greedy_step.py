"""The greedy step's kernel (``aot.codegen.greedy``) in Triton's interpreter, against the ATen
steps it stands for (``aot.loader.decode_blocks``: ``argmax``, the end-of-sequence rule, the token
and the next step's inputs in place): the same tokens, finished rows, input ids, positions, cache
position and mask, bit for bit, step after step; its counters zero after every launch.

Cases: ties (the first index wins, across chunks and within one), NaN (the first NaN wins, as
``argmax`` has it), rows of -inf, a vocabulary of one chunk and of many (``CHUNK`` shrunk so a
small vocabulary spans 7 and 40 chunks), logits of float16, bfloat16 and float32 as a slice of
wider rows, end tokens (none, one, two) with rows finishing and finished rows taking their
padding, masks of int64 and bool. Then the build: a tiny causal LM's decode program carries the
kernel (``Program.greedy``), its prefill does not, and a bundle whose greedy kernel takes other
parameters is refused when it opens.
"""

from __future__ import annotations

import json

import pytest

from tests.codegen.conftest import interpreted_json

SCRIPT = r"""
import json, sys
import torch
from aot.aten import DTYPES
from aot.codegen import greedy
from aot.codegen.compile import load_function
from aot.codegen.render import kernel_id

cases = json.loads(sys.argv[1])
results = []
for case in cases:
    greedy.CHUNK = case["chunk"]
    vocab, rows, steps = case["vocab"], case["rows"], 3
    dtype, mask_dtype = DTYPES[case["dtype"]], DTYPES[case["mask"]]
    r = greedy.render_greedy(vocab, case["dtype"], case["mask"])
    fn = load_function(kernel_id(r.source, r.signature, r.config), r.name, r.source)
    chunks = greedy.chunks_of(vocab)
    gen = torch.Generator().manual_seed(case["seed"])
    context = 16

    def fresh():
        return {
            "tokens": torch.full((rows, steps), -1, dtype=torch.int64),
            "ids": torch.zeros(rows, 1, dtype=torch.int64),
            "positions": torch.arange(rows, dtype=torch.int64)[:, None] + 4,
            "slot": torch.tensor([5], dtype=torch.int64),
            "mask": (torch.arange(context)[None, :] <= 5).expand(rows, context).to(mask_dtype).contiguous(),
            "finished": torch.tensor([r % 3 == 2 for r in range(rows)], dtype=torch.bool),
            "padding": torch.arange(rows, dtype=torch.int64) + 90,
        }

    eos = torch.tensor(case["eos"], dtype=torch.int64)
    ours, want = fresh(), fresh()
    values = torch.empty(rows, chunks, dtype=torch.float32)
    indices = torch.empty(rows, chunks, dtype=torch.int32)
    counts = torch.zeros(rows + 1, dtype=torch.int32)
    zero_counts = True
    for j in range(steps):
        wide = torch.randint(-3, 4, (rows, vocab + 7), generator=gen).to(dtype)  # ties on purpose
        logits = wide[:, :vocab]
        for row, at in case.get("top", []):  # a row's largest logit at a given index
            logits[row, at] = 9
        for row, at in case.get("nan", []):
            logits[row, at] = float("nan")
        for row in case.get("ninf", []):
            logits[row] = float("-inf")
        if eos.numel() and j == 1:  # row 0 ends on an end token
            logits[0, int(eos[0])] = 20
        # the ATen steps (loader/decode_blocks.py _Block._steps)
        token = logits.argmax(-1)
        if eos.numel():
            token = torch.where(want["finished"], want["padding"], token)
            want["finished"].logical_or_(token[:, None].eq(eos[None, :]).any(-1))
        want["tokens"][:, j].copy_(token)
        want["ids"].copy_(token[:, None])
        want["positions"].add_(1)
        want["slot"].add_(1)
        want["mask"].scatter_(1, want["slot"].expand(rows, 1), 1)
        fn[(chunks, rows)](
            logits, logits.stride(0), ours["tokens"], steps, j, ours["ids"], ours["positions"], ours["slot"],
            ours["mask"], context, ours["finished"], ours["padding"], eos if eos.numel() else torch.zeros(1, dtype=torch.int64),
            eos.numel(), values, indices, counts, rows,
        )
        zero_counts = zero_counts and not counts.any().item()
    results.append({
        "same": {k: torch.equal(ours[k], want[k]) for k in want},
        "tokens": ours["tokens"].tolist(),
        "want": want["tokens"].tolist(),
        "zero_counts": zero_counts,
        "chunks": chunks,
    })
print(json.dumps(results))
"""

CASES = [
    # one chunk, float16, ties everywhere, int64 mask, no end token
    {"vocab": 50, "rows": 3, "chunk": 2048, "dtype": "float16", "mask": "int64", "eos": [], "seed": 0},
    # 7 chunks, a row's largest at the first index of a later chunk and at the very last index
    {
        "vocab": 100,
        "rows": 4,
        "chunk": 16,
        "dtype": "bfloat16",
        "mask": "int64",
        "eos": [],
        "seed": 1,
        "top": [[1, 48], [2, 99], [3, 0]],
    },
    # 40 chunks, NaN (two in a row: the first wins) and a row of -inf, float32
    {
        "vocab": 637,
        "rows": 3,
        "chunk": 16,
        "dtype": "float32",
        "mask": "int64",
        "eos": [],
        "seed": 2,
        "nan": [[0, 300], [0, 17], [2, 636]],
        "ninf": [1],
    },
    # end tokens: one, then two; finished rows take their padding; a bool mask
    {"vocab": 100, "rows": 5, "chunk": 16, "dtype": "float16", "mask": "bool", "eos": [7], "seed": 3},
    {"vocab": 300, "rows": 3, "chunk": 64, "dtype": "bfloat16", "mask": "int64", "eos": [11, 3], "seed": 4},
    # one row (batch 1): the cache position stored without the rows' counter
    {"vocab": 100, "rows": 1, "chunk": 16, "dtype": "float16", "mask": "int64", "eos": [7], "seed": 5},
]


def test_the_greedy_kernel_equals_the_aten_steps_in_the_interpreter():
    script = f"import sys\nsys.argv = ['x', {json.dumps(json.dumps(CASES))}]\n" + SCRIPT
    results = interpreted_json(script)
    assert len(results) == len(CASES)
    for case, got in zip(CASES, results):
        assert all(got["same"].values()), (case, got)
        assert got["zero_counts"], case
    assert [r["chunks"] for r in results] == [1, 7, 40, 7, 5, 7]
    assert results[2]["tokens"][0] == [17, 17, 17] and results[2]["tokens"][1] == [0, 0, 0]
    assert [results[1]["tokens"][r][0] for r in (1, 2, 3)] == [48, 99, 0]
    assert results[3]["tokens"][0][1] == 7 and results[3]["tokens"][0][2] == 90  # ended, then padding


def test_a_decode_program_carries_the_greedy_kernel(built):
    """tests/data/tiny_lm.py: its decode program has the greedy kernel for its vocabulary, with
    the parameters the loader passes (``aot.program.GREEDY_PARAMS``), compiled for every arch;
    the prefill has none."""
    from aot.bundle import open_bundle
    from aot.program import GREEDY_PARAMS

    b = open_bundle(built("tiny_lm", ("sm_80", "sm_90")))
    try:
        prefill, decode = b.program(), b.program().variants[0]
        assert not prefill.greedy and decode.greedy
        (kernel,) = [k for k in decode.kernels if k.id == decode.greedy]
        assert [p.name for p in kernel.params] == [name for name, _, _ in GREEDY_PARAMS]
        assert kernel.archs == ("sm_80", "sm_90") and kernel.config["kind"] == "greedy_step"
        assert kernel.config["VOCAB"] == int(b.program().buffers[decode.outputs[0]].shape[-1])
        assert decode.greedy not in {s.target for s in decode.steps}  # the loader launches it, no step
    finally:
        b.close()


def test_a_greedy_kernel_of_other_parameters_is_refused(built, tmp_path):
    """A re-signed bundle whose decode program names a greedy kernel it lacks, or one taking
    other parameters, is refused when it opens, naming what differs."""
    from dataclasses import replace

    from aot.bundle import open_bundle
    from aot.errors import BundleError
    from aot.program import check_greedy
    from aot.schema import KernelParam, ParamKind

    b = open_bundle(built("tiny_lm", ("sm_90",)))
    try:
        decode = b.program().variants[0]
    finally:
        b.close()
    check_greedy(decode, "here")  # as built
    with pytest.raises(BundleError, match=r"greedy names kernel 'k_nothing'"):
        check_greedy(replace(decode, greedy="k_nothing"), "here")
    kernels = tuple(
        replace(k, params=(*k.params[:-1], KernelParam("rows", ParamKind.I32)))
        if k.id == decode.greedy
        else k
        for k in decode.kernels
    )
    with pytest.raises(
        BundleError, match=r"takes parameter \('rows', 'i32', ''\), expected \('rows', 'i64', ''\)"
    ):
        check_greedy(replace(decode, kernels=kernels), "here")


@pytest.mark.parametrize("ends", [0, 2])
def test_the_loaders_block_passes_every_greedy_parameter(ends):
    """A decode block's launch of the greedy kernel names every parameter of
    ``aot.program.GREEDY_PARAMS`` (packed in that order by ``greedy_params``): the step, the rows
    and the end tokens' count as the block has them (CPU tensors stand in for the device's)."""
    import torch

    from aot.loader import decode_blocks
    from aot.program import GREEDY_PARAMS, greedy_params

    class Calls:
        inputs = {
            "input_ids": torch.zeros(2, 1, dtype=torch.int64),
            "position_ids": torch.zeros(2, 1, dtype=torch.int64),
            "cache_position": torch.zeros(1, dtype=torch.int64),
            "attention_mask": torch.zeros(2, 8, dtype=torch.int64),
        }
        vocab, logits_dtype = 10, torch.float16

    class Greedy:  # records what ``_Greedy.launch`` would pack
        chunks = 3

        def launch(self, args, rows):
            self.args, self.rows = args, rows

    greedy = Greedy()
    block = decode_blocks._Block(Calls(), 2, 4, ends, None, greedy)
    block._greedy_step(block.logits, 1)
    assert list(greedy.args) == [name for name, _, _ in GREEDY_PARAMS] and greedy.rows == 2
    packed = dict(
        zip(greedy.args, greedy_params({n: 0 if torch.is_tensor(a) else a for n, a in greedy.args.items()}))
    )
    assert packed["step"] == ("i64", 1) and packed["rows"] == ("i64", 2) and packed["n_eos"] == ("i64", ends)
    assert packed["logits_stride"] == ("i64", 10) and packed["mask_stride"] == ("i64", 8)
