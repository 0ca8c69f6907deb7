"""The greedy step between two decode steps, as one kernel (``Program.greedy``).

Between two steps of greedy decoding the runner picks each row's token (the first index of its
largest logit, ``argmax`` with its NaN rule: a NaN is the largest), applies the end-of-sequence
rule (a finished row takes its padding token; a row whose token is an end token is finished),
records the token, and writes the next step's inputs in place: ``input_ids`` the token,
``position_ids`` one more, ``cache_position`` one more, ``attention_mask`` the new slot set. With
ATen that is an argmax of two stages and seven small kernels (``loader/decode_blocks.py``: about
20 µs a token on an H200, against a decode step of 0.26 ms for GPT-2). This kernel does all of it
in one launch, on a grid of (chunks of the vocabulary, rows):

- every program reduces ``CHUNK`` logits of its row to their largest and its first index (the
  first NaN where there is one), stores them to a workspace, and counts its arrival on its row's
  int32 counter (a CTA barrier, then one ``atomic_add`` with acquire-release semantics at GPU
  scope, as the split-KV decode attention counts);
- the row's last program reads every chunk's result in chunk order (``.cg``: from L2), so the
  token's bits never depend on which program came last; it applies the end rule, stores the token
  and the next inputs of its row, reads the cache position, sets the mask's new slot, zeroes its
  row's counter and counts the row on a last counter;
- the last row stores the new cache position (every row read the old one before counting) and
  zeroes that counter; one row alone stores it without counting (a second atomic's round trip
  on the step's critical path, at batch 1).

The build adds it to every decode program of a causal LM (``greedy_kernel``: the inputs
``input_ids`` and ``position_ids`` of [batch, 1], ``cache_position`` of [1], ``attention_mask``
[batch, context], a first output of logits [batch, vocab]); the loader's decode blocks launch it
between the steps they capture (``aot.loader.decode_blocks``), with a workspace and counters of
their own, zeroed once. Its parameters are fixed (``PARAMS``): the loader passes them by
position, and refuses a bundle whose greedy kernel takes others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.render import Rendered, compile_site_kernels, kernel_id
from aot.dtypes import ITEMSIZE
from aot.program import GREEDY_PARAMS
from aot.schema import KernelParam, ParamKind, Program

HEURISTIC = "greedy-step-v2"
CHUNK = 2048  # logits per program: 4 KiB of a half-precision row
MAX_CHUNKS = 128  # a wider vocabulary takes longer chunks, so the last program reads at most this many
# one row stores the new cache position without counting the rows (module docstring); False
# renders the counter at every batch, for measuring (a ``sitecustomize`` sets it)
ONE_ROW_STORE = True
LOGITS_DTYPES = ("float16", "bfloat16", "float32")
MASK_DTYPES = ("int64", "int32", "bool")


def params(logits_dtype: str, mask_dtype: str) -> tuple[KernelParam, ...]:
    """The greedy kernel's parameters, in the order the loader passes them (``GREEDY_PARAMS``)."""
    follows = {"logits": logits_dtype, "attention_mask": mask_dtype}
    return tuple(
        KernelParam(name, ParamKind(kind), dtype or follows.get(name, ""))
        for name, kind, dtype in GREEDY_PARAMS
    )


def chunk_of(vocab: int) -> int:
    """Logits per program: ``CHUNK``, or longer (a power of two) where the vocabulary would
    need more than ``MAX_CHUNKS`` chunks."""
    chunk = CHUNK
    while -(-vocab // chunk) > MAX_CHUNKS:
        chunk *= 2
    return chunk


def chunks_of(vocab: int) -> int:
    return -(-vocab // chunk_of(vocab))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cache_position_store(one_row: bool) -> list[str]:
    """The lines that store the new cache position once every row has read the old one."""
    counted = [
        "done_rows = tl.atomic_add(counts + rows, 1, sem='acq_rel', scope='gpu')",
        "if done_rows == rows - 1:  # the last row: every row has read the old cache position",
        "    tl.store(cache_position, slot)",
        "    tl.store(counts + rows, 0)",
    ]
    if not one_row:
        return ["    " + line for line in counted]
    return [
        "    if rows == 1:  # the only row: no other reads the old cache position",
        "        tl.store(cache_position, slot)",
        "    else:",
        *("        " + line for line in counted),
    ]


def render_greedy(vocab: int, logits_dtype: str, mask_dtype: str) -> Rendered:
    """The greedy step's kernel for rows of ``vocab`` logits of ``logits_dtype`` and an attention
    mask of ``mask_dtype`` (module docstring); its grid is the loader's: (chunks, rows)."""
    chunk, chunks = chunk_of(vocab), chunks_of(vocab)
    ps = params(logits_dtype, mask_dtype)
    signature = signature_of(ps, "i64")
    set_mask = "1" if mask_dtype != "bool" else "True"
    body = [
        "p = tl.program_id(0)",
        "b = tl.program_id(1).to(tl.int64)",
        "offs = p * CHUNK + tl.arange(0, CHUNK)",
        "inside = offs < VOCAB",
        "x = tl.load(logits + b * logits_stride + offs, mask=inside, other=float('-inf')).to(tl.float32)",
        "nan = (x != x) & inside",
        "key = tl.where(nan, float('-inf'), x)",
        "top = tl.max(key, 0)",
        "first = tl.min(tl.where((key == top) & inside, offs, VOCAB), 0)",
        "first_nan = tl.min(tl.where(nan, offs, VOCAB), 0)",
        "value = tl.where(first_nan < VOCAB, float('nan'), top)",
        "tl.store(values + b * CHUNKS + p, value)",
        "tl.store(indices + b * CHUNKS + p, tl.where(first_nan < VOCAB, first_nan, first))",
        "tl.debug_barrier()  # every thread's store before the arrival is counted",
        "arrived = tl.atomic_add(counts + b, 1, sem='acq_rel', scope='gpu')",
        "if arrived == CHUNKS - 1:  # the row's last program: the token, then the next inputs",
        "    c = tl.arange(0, CHUNKS_P2)",
        "    valid = c < CHUNKS",
        "    v = tl.load(values + b * CHUNKS + c, mask=valid, other=float('-inf'), cache_modifier='.cg')",
        "    i = tl.load(indices + b * CHUNKS + c, mask=valid, other=0, cache_modifier='.cg')",
        "    v_nan = (v != v) & valid",
        "    v_key = tl.where(v_nan, float('-inf'), v)",
        "    best = tl.max(v_key, 0)",
        "    at_best = tl.min(tl.where((v_key == best) & valid, c, CHUNKS_P2), 0)",
        "    at_nan = tl.min(tl.where(v_nan, c, CHUNKS_P2), 0)",
        "    at = tl.where(at_nan < CHUNKS_P2, at_nan, at_best)",
        "    token = tl.sum(tl.where(c == at, i, 0), 0).to(tl.int64)",
        "    if n_eos > 0:  # a finished row takes its padding; an end token finishes its row",
        "        done = tl.load(finished + b) != 0",
        "        token = tl.where(done, tl.load(padding + b), token)",
        "        for e in range(n_eos):",
        "            done = done | (tl.load(eos_ids + e) == token)",
        "        tl.store(finished + b, done)",
        "    tl.store(tokens + b * tokens_stride + step, token)",
        "    tl.store(input_ids + b, token)",
        "    tl.store(position_ids + b, tl.load(position_ids + b) + 1)",
        "    slot = tl.load(cache_position) + 1",
        f"    tl.store(attention_mask + b * mask_stride + slot, {set_mask})",
        "    tl.store(counts + b, 0)",
        *_cache_position_store(ONE_ROW_STORE),
    ]
    consts = {"VOCAB": vocab, "CHUNK": chunk, "CHUNKS": chunks, "CHUNKS_P2": _pow2(chunks)}
    doc = [
        f"The greedy step between two decode steps over {vocab} logits ({logits_dtype}): each row's",
        "first largest logit, the end-of-sequence rule, the token and the next step's inputs in place.",
        "",
        "grid: (CHUNKS, rows); counts: rows + 1 int32 counters, zero before and after a launch",
    ]
    source = kernel_module(doc, consts, "greedy_step", signature, body)
    return Rendered(
        name="greedy_step",
        source=source,
        signature=signature,
        params=ps,
        args=(),
        outputs=(),
        grid=(str(chunks), "rows"),
        num_warps=4,
        num_stages=1,
        config={
            "kind": "greedy_step",
            "heuristic": HEURISTIC,
            "CHUNK": chunk,
            "CHUNKS": chunks,
            "VOCAB": vocab,
        },
        ops=("aten.argmax.default",),
        bytes_moved=f"rows*{vocab * ITEMSIZE[logits_dtype]}",
    )


def decode_io(program: Program) -> tuple[int, str, str] | None:
    """(vocab, logits dtype, mask dtype) where ``program`` is a causal LM's decode step as
    ``aot.hf.causal_lm`` makes it (module docstring), else None."""
    inputs = {i.name: i.spec for i in program.inputs}
    need = ("input_ids", "position_ids", "cache_position", "attention_mask")
    if not all(n in inputs for n in need) or not program.state or not program.outputs:
        return None
    ids, positions, slot, mask = (inputs[n] for n in need)
    logits = program.buffers.get(program.outputs[0])
    if any(s.dtype != "int64" for s in (ids, positions, slot)) or mask.dtype not in MASK_DTYPES:
        return None
    if len(ids.shape) != 2 or ids.shape[1] != "1" or tuple(positions.shape) != tuple(ids.shape):
        return None
    if tuple(slot.shape) != ("1",) or len(mask.shape) != 2 or mask.shape[0] != ids.shape[0]:
        return None
    if logits is None or logits.dtype not in LOGITS_DTYPES or len(logits.shape) != 2:
        return None
    if logits.shape[0] != ids.shape[0] or not logits.shape[1].isdigit():
        return None
    return int(logits.shape[1]), logits.dtype, mask.dtype


def greedy_kernel(
    program: Program,
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], Any]]:
    """``program`` with its greedy step's kernel (``Program.greedy``) where it is a causal LM's
    decode step (``decode_io``), and that kernel's cubins; unchanged elsewhere, and where the
    kernel fails to compile (the loader then picks tokens with ATen)."""
    io = decode_io(program)
    if io is None:
        return program, {}
    rendered = render_greedy(*io)
    built = compile_site_kernels(
        program, [rendered], archs, compile_kernels, say, "greedy step", "tokens are picked with ATen"
    )
    kid = kernel_id(rendered.source, rendered.signature, rendered.config)
    if kid in built.failed:
        return program, {}
    say(
        f"  the greedy step between decode steps as one kernel ({io[0]} logits, {chunks_of(io[0])} chunks a row)"
    )
    kernels = program.kernels if kid not in built.records else (*program.kernels, built.records[kid])
    return replace(program, kernels=kernels, greedy=kid), built.cubins
