"""Greedy token generation on the runtime without torch: one prefill call, then one decode call per token.

The bundle follows the LM wrapper contract of ``aot.hf.causal_lm`` (as the torch loader's
``aot.loader.generate``): entry points ``prefill`` and ``decode``, keyword inputs ``input_ids``
[batch, seq], ``position_ids`` [batch, seq], ``cache_position`` [seq] and ``attention_mask``
[batch, max_context], a KV cache as state, the logits of each row's last position as output.
Prompts of different lengths are left-padded to the longest, each row's positions counting its
own tokens, so a row's tokens are those it gets alone. The inputs are host arrays made here
(``ctypes``, no NumPy). The next token is the first index of the row's largest logit, as
``argmax`` picks: where the decode program carries its greedy kernel (``Program.greedy``, the
build's ``aot.codegen.greedy``) it runs on the device after each call and only the tokens come
back (``DeviceArgmax``: 8 bytes a row, not the row's logits: 256 KiB of Llama-3's); else, and
after the prefill, the logits come back and the host picks (with NumPy where installed, else in
Python).

**Blocks of steps** (``DecodeBlock``, ``steps_per_launch``: 8 by default where the greedy kernel
is there): after the prefill's token, ``steps_per_launch`` decode calls run as one enqueue with
no host work between them: each call, then the greedy kernel on its logits, which applies the
end-of-sequence rule (finished rows take the padding token), stores the row's token in its column
of the block's tokens, and writes the next call's inputs in place in the arena (the token, the
position and cache slot one on, the mask's new slot). The host copies the inputs in once, at the
block's start, and reads the block's tokens back in one copy. At a bucket (a CUDA graph for the
call) the block is one CUDA graph too, captured on its first use and kept with the call's
plan. The steps after the last whole block run as one block of their own (a plan keeps a block
per step count it has run), launched from the host's inputs once the block before is taken; with
``steps_per_launch=1`` every step is a call of its own. The tokens are the same either way.

**The host a block ahead** (``Readback``): where another whole block follows, it is launched
before the host waits for the one before: it starts from the inputs that block's last greedy
kernel left in the arena, and its finished rows are the device's. Each block's tokens are copied
into page-locked memory of their own, in stream order, so the next block's tokens never
overwrite them, and the host waits on that copy's event alone. The GPU runs the next block while
the host takes a block's tokens, so the host's work per block (the callbacks' tokens, the inputs'
mirror) no longer leaves it idle. A generation whose rows all end inside a block waits for the
block launched ahead of it before returning; its steps only wrote cache slots the generation
had room for (a block is launched ahead only where all its steps fit).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

from aot.errors import GuardError
from aot.runtime.arrays import CPU, ArrayView

BLOCK_STEPS = 8  # decode calls per block where the greedy kernel is there (the torch loader's too)

LM_INPUTS = ("input_ids", "position_ids", "cache_position", "attention_mask")
ENTRY_POINTS = ("prefill", "decode")
LOGIT_FORMATS = {"float32": "f", "float16": "e", "float64": "d", "bfloat16": "H"}  # bfloat16: raw halves


def lm_contract(checked: Any) -> tuple[int, int]:
    """(max batch, max context) of a checked bundle that follows the LM contract; ``GuardError`` if not."""
    missing = [e for e in ENTRY_POINTS if e not in checked.entry_points]
    if missing or set(checked.input_names) != set(LM_INPUTS):
        raise GuardError(
            f"generate needs a bundle with entry points {list(ENTRY_POINTS)} and inputs {list(LM_INPUTS)} "
            f"(as aot.hf.causal_lm builds), this one has entry points {list(checked.entry_points)} and "
            f"inputs {list(checked.input_names)}"
        )
    dims = {name: d for name, _, _, d in checked.guards.inputs}
    mask, ids = dims["attention_mask"], dims["input_ids"]
    context = mask[1] if len(mask) == 2 and type(mask[1]) is int else None
    symbols = checked.guards.symbols
    # a batch of one size (``max_batch=1``) is that size in the guards, not a symbol
    batch = ids[0] if type(ids[0]) is int else symbols[ids[0]].max if ids[0] in symbols else None
    if context is None or batch is None:
        raise GuardError(
            f"generate needs attention_mask of shape [batch, max_context] and a batch dim, the bundle "
            f"declares input_ids {list(ids)}, attention_mask {list(mask)}"
        )
    return batch, context


class HostInt64:
    """A row-major int64 host array over a ``ctypes`` buffer, taken by the runner as an ``ArrayView``."""

    def __init__(self, rows: Sequence[Sequence[int]] | Sequence[int]):
        flat = [list(r) for r in rows] if rows and not isinstance(rows[0], int) else None
        values = [v for r in flat for v in r] if flat is not None else list(rows)
        self.shape = (len(flat), len(flat[0]) if flat else 0) if flat is not None else (len(values),)
        self.data = (ctypes.c_int64 * max(len(values), 1))(*values)

    def view(self) -> ArrayView:
        strides = (self.shape[1], 1) if len(self.shape) == 2 else (1,)
        return ArrayView(ctypes.addressof(self.data), CPU, 0, "int64", self.shape, strides, self.data)


def prompts_of(prompt_ids: Any) -> tuple[list[list[int]], bool]:
    """The prompts as lists of ints, and whether one prompt (a flat list) was given."""
    if not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)) or not prompt_ids:
        raise GuardError(
            f"prompt_ids: expected a list of token ids or a list of such lists, got {prompt_ids!r:.80}"
        )
    flat = not any(isinstance(t, Sequence) for t in prompt_ids)
    rows = [list(prompt_ids)] if flat else [list(r) if isinstance(r, Sequence) else [r] for r in prompt_ids]
    for i, r in enumerate(rows):
        if not r or not all(type(t) is int for t in r):
            raise GuardError(f"prompt {i}: expected a non-empty list of int token ids, got {r!r:.80}")
    return rows, flat


def argmax_rows(data: bytes, dtype: str, rows: int, vocab: int) -> list[int]:
    """Each row's first index of its largest value (``argmax``) of row-major logits in ``data``.
    bfloat16 logits are read as the float32 values they are the upper halves of."""
    fmt = LOGIT_FORMATS.get(dtype)
    if fmt is None:
        raise GuardError(
            f"generate reads float32, float16, bfloat16 or float64 logits, the bundle returns {dtype}"
        )
    try:  # with NumPy (the runtime's numpy extra): one pass in C over 128k logits rather than ~10 ms
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        values = np.frombuffer(data, f"<{fmt}", rows * vocab)
        if dtype == "bfloat16":
            values = (values.astype("<u4") << 16).view("<f4")
        return [int(i) for i in values.reshape(rows, vocab).argmax(-1)]
    values = struct.unpack(f"<{rows * vocab}{fmt}", data[: rows * vocab * struct.calcsize(fmt)])
    if dtype == "bfloat16":
        values = struct.unpack(
            f"<{len(values)}f", struct.pack(f"<{len(values)}I", *(v << 16 for v in values))
        )
    out = []
    for r in range(rows):
        row = values[r * vocab : (r + 1) * vocab]
        best = max(range(vocab), key=lambda i: (row[i], -i))  # ties: the first index
        out.append(best)
    return out


class DeviceArgmax:
    """The decode program's greedy kernel (``aot.codegen.greedy``) run for its argmax alone: no end
    tokens (the host keeps the end-of-sequence rule), the next inputs it also writes going to
    buffers of its own, never read; one allocation for them, its workspace and its counters,
    zeroed here, freed by ``close``. ``tokens`` launches it on a decode call's logits and copies
    back each row's token."""

    def __init__(self, runner: Any, kernel_id: str, rows: int, calls: int):
        from aot.dtypes import ITEMSIZE
        from aot.runtime.plan import packed

        self.runner, self.rows = runner, rows
        self.kernel, self.record = runner.kernels[kernel_id], runner.records[kernel_id]
        self.chunks = int(self.record.config["CHUNKS"])
        mask = next(p.dtype for p in self.record.params if p.name == "attention_mask")
        # the mask's new slot moves one column a launch: a row of ``calls`` + 2 columns holds them all
        self.width = calls + 2
        sizes = {
            "tokens": rows * 8,
            "input_ids": rows * 8,
            "position_ids": rows * 8,
            "cache_position": 8,
            "attention_mask": rows * self.width * ITEMSIZE[mask],
            "finished": rows,
            "padding": rows * 8,
            "eos_ids": 8,
            "values": rows * self.chunks * 4,
            "indices": rows * self.chunks * 4,
            "counts": (rows + 1) * 4,
        }
        self.at, total = packed(sizes)
        self.base = runner.gpu.alloc(total)
        runner.gpu.zero(self.base, total)
        self.host = (ctypes.c_int64 * rows)()

    def tokens(self, logits: Any) -> list[int]:
        """Each row's token of ``logits`` (a ``DeviceArray`` [rows, vocab]), on the device."""
        from aot.program import greedy_params
        from aot.runtime import driver as drv

        ptr = {name: self.base + offset for name, offset in self.at.items()}
        stride = logits.strides[0] if logits.strides is not None else logits.shape[1]
        values = greedy_params(
            {
                **ptr,
                "logits": logits.ptr,
                "logits_stride": stride,
                "tokens_stride": 1,
                "step": 0,
                "mask_stride": self.width,
                "n_eos": 0,
                "rows": self.rows,
            }
        )
        values += [("ptr", 0)] * self.record.scratch_params
        params, storage = drv.pack_params(values)
        gpu = self.runner.gpu
        self.kernel.launch((self.chunks, self.rows, 1), gpu.stream, params)
        gpu.synchronize()
        gpu.to_host(ctypes.addressof(self.host), ptr["tokens"], self.rows * 8)
        del storage
        return list(self.host)

    def close(self) -> None:
        self.runner.gpu.free(self.base)
        self.base = 0


class DecodeBlock:
    """``steps`` decode calls of ``rows`` rows at one plan (``prepared``: the decode program at its
    sizes), the greedy kernel after each (module docstring), and the memory they write besides the
    arena: the tokens [rows, steps], the finished rows, the padding token, the end tokens, the
    kernel's workspace and counters (zeroed once; every launch leaves them zeroed), and, where the
    logits are computed after the call's graph (``Prepared.tail_bytes``), their memory. Kept in
    ``prepared.blocks``, released with the plan (its CUDA graph and memory)."""

    def __init__(self, runner: Any, prepared: Any, kernel_id: str, rows: int, steps: int, ends: int):
        from aot.dtypes import ITEMSIZE
        from aot.program import greedy_params
        from aot.runtime import driver as drv
        from aot.runtime.plan import packed
        from aot.symexpr import compile_expr

        self.runner, self.prepared, self.rows, self.steps = runner, prepared, rows, steps
        self.kernel, record = runner.kernels[kernel_id], runner.records[kernel_id]
        self.chunks = int(record.config["CHUNKS"])
        (kind, at), dtype, shape, _, pitch = prepared.outputs[0]  # the logits [rows, vocab]
        sizes = {
            "tokens": rows * steps * 8,
            "finished": rows,
            "padding": rows * 8,
            "eos_ids": max(ends, 1) * 8,
            "values": rows * self.chunks * 4,
            "indices": rows * self.chunks * 4,
            "counts": (rows + 1) * 4,
            "tail": prepared.tail_bytes,
        }
        self.at, total = packed(sizes)
        self.base = runner.gpu.alloc(total)
        runner.gpu.zero(self.base, total)
        ptr = {name: self.base + offset for name, offset in self.at.items()}
        self.tail = ptr["tail"] if prepared.tail_bytes else 0
        inputs = dict(prepared.inputs)
        mask = next(i.spec for i in prepared.entry.program.inputs if i.name == "attention_mask")
        mask_width = compile_expr(mask.shape[1])(prepared.sizes)
        common = {
            **ptr,
            **{name: inputs[name] for name in LM_INPUTS},
            "logits": self.tail + at if kind == "tail" else at,
            "logits_stride": pitch[1] // ITEMSIZE[dtype] if pitch is not None else shape[1],
            "tokens_stride": steps,
            "mask_stride": mask_width,
            "n_eos": ends,
            "rows": rows,
        }
        # each step's parameters, packed once (the storage must outlive every launch and capture)
        self.params = [
            drv.pack_params(greedy_params({**common, "step": j}) + [("ptr", 0)] * record.scratch_params)
            for j in range(steps)
        ]
        self.graph: Any = None

    def enqueue(self) -> None:
        """The block's launches: per step, the decode call, then the greedy kernel."""
        gpu, prepared = self.runner.gpu, self.prepared
        for params, _ in self.params:
            prepared.launch(gpu)
            if self.tail:
                prepared.launch_tail(gpu, self.tail)
            self.kernel.launch((self.chunks, self.rows, 1), gpu.stream, params)

    def launch(
        self,
        views: Sequence[ArrayView] | None,
        done: Sequence[bool],
        pad: int,
        eos: Sequence[int],
        readback: Readback,
    ) -> int:
        """Enqueue the block, then the copy of its tokens into one of ``readback``'s buffers; that
        buffer's index (``take``). ``views``: the decode call's inputs (in the bundle's order),
        copied in with the rows already finished and the end-of-sequence rule; None: the block
        goes on from what the block before left on the device."""
        runner, gpu = self.runner, self.runner.gpu
        with runner._lock:
            gpu.bind()
            if views is not None:
                for view, (name, address) in zip(views, self.prepared.inputs):
                    runner._copy_in(view, address, name)
                starts = (
                    ("finished", bytes(bool(d) for d in done)),
                    ("padding", struct.pack(f"<{self.rows}q", *[pad] * self.rows)),
                    ("eos_ids", struct.pack(f"<{len(eos)}q", *eos)),
                )
                for name, data in starts:
                    if data:  # from pageable memory: staged before the call returns
                        host = ctypes.create_string_buffer(data, len(data))
                        gpu.to_device(self.base + self.at[name], ctypes.addressof(host), len(data))
            if runner.graphs and self.prepared.on_bucket:
                if self.graph is None:
                    self.graph = gpu.capture(self.enqueue)
                gpu.replay(self.graph[1])
            else:
                self.enqueue()
            slot = readback.claim()
            gpu.to_host_async(readback.host[slot], self.base + self.at["tokens"], self.rows * self.steps * 8)
            gpu.record(readback.events[slot])
        return slot

    def take(self, readback: Readback, slot: int) -> list[list[int]]:
        """The tokens of the block launched into ``readback``'s buffer ``slot``, a list per step,
        once its copy is done."""
        self.runner.gpu.wait(readback.events[slot], None)
        host = (ctypes.c_int64 * (self.rows * self.steps)).from_address(readback.host[slot])
        return [[host[r * self.steps + j] for r in range(self.rows)] for j in range(self.steps)]

    def release(self) -> None:
        from aot.runtime import driver as drv

        if self.graph is not None:
            drv.destroy_graph(*self.graph)
            self.graph = None
        if self.base:
            self.runner.gpu.free(self.base)
            self.base = 0


class Readback:
    """Two page-locked host buffers of a block's tokens and an event for each copy into them: the
    tokens of one block come back while the next one runs (module docstring). The runner keeps
    one (``readback``), freed by ``close``; ``claim`` alternates between the two (a generation
    takes a block's tokens before it launches the second block after it, and has taken every
    block's, or waited for the one launched ahead, when it returns)."""

    def __init__(self, gpu: Any, nbytes: int):
        self.gpu, self.next, self.nbytes = gpu, 0, nbytes
        self.host = [gpu.host_alloc(nbytes) for _ in range(2)]
        self.events = [gpu.event() for _ in range(2)]

    def claim(self) -> int:
        slot, self.next = self.next, 1 - self.next
        return slot

    def close(self) -> None:
        for ptr in self.host:
            self.gpu.free_host(ptr)
        for event in self.events:
            self.gpu.destroy_event(event)
        self.host, self.events = [], []


def readback(runner: Any, nbytes: int) -> Readback:
    """The runner's ``Readback`` of at least ``nbytes`` a buffer: made at its first generation in
    blocks and kept (page-locked allocations take longer than a decode step), made again larger
    where a generation's blocks need more; ``Runner.close`` frees it. A runner runs one generation
    at a time, as its state's rows are that generation's."""
    kept = runner._readback
    if kept is None or kept.nbytes < nbytes:
        if kept is not None:
            kept.close()
        kept = runner._readback = Readback(runner.gpu, nbytes)
    return kept


def decode_block(runner: Any, views: Sequence[ArrayView], steps: int, ends: int, rows: int) -> DecodeBlock:
    """The ``DecodeBlock`` of ``steps`` decode calls from the call on ``views`` with ``ends`` end
    tokens and ``rows`` rows: made once per plan and those counts, kept with the plan."""
    entry, sizes = runner.checked.bind(views, "decode")
    with runner._lock:
        runner.gpu.bind()
        prepared = runner._prepare(entry, sizes)
        key = (steps, ends, rows)
        block = prepared.blocks.get(key)
        if block is None:
            block = prepared.blocks[key] = DecodeBlock(
                runner, prepared, entry.program.greedy, rows, steps, ends
            )
        return block


def decode_inputs(
    tokens: Sequence[int], positions: Sequence[int], slot: int, mask: Sequence[Sequence[int]]
) -> dict[str, HostInt64]:
    """A decode call's inputs on the host: each row's token and position, the cache slot, the mask."""
    return {
        "input_ids": HostInt64([[t] for t in tokens]),
        "position_ids": HostInt64([[p] for p in positions]),
        "cache_position": HostInt64([slot]),
        "attention_mask": HostInt64(mask),
    }


def greedy_kernel(runner: Any) -> str | None:
    """The id of the bundle's decode program's greedy kernel, its cubin loaded on the first
    generation, not at load; None where it has none (the host picks)."""
    for entry in runner.checked.entries:
        kid = entry.program.greedy
        if entry.entry == "decode" and kid:
            if kid not in runner.kernels:
                runner._load_kernels([kid])
            return kid
    return None


def generate(
    runner: Any,
    prompt_ids: Any,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    steps_per_launch: int | None = None,
    on_token: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]] | list[int]:
    """Greedy tokens after each prompt (module docstring): a list of ints for one prompt, a list of
    lists for several. A row stops after ``eos_token_id`` (which it keeps), then is fed
    ``pad_token_id``. ``steps_per_launch``: decode calls per block (``DecodeBlock``; 1: call by
    call; default ``BLOCK_STEPS`` where the decode program carries its greedy kernel, else 1).
    ``on_token(step, tokens)`` sees each step's tokens, one per row (a finished row's padding
    token), as the host takes them: a block's together, once its copy is done (the torch
    loader's callback).
    ``GuardError`` before anything runs when the prompts and new tokens overflow the context or
    the batch. The state's rows ``0..batch-1`` are reset first."""
    prompts, flat = prompts_of(prompt_ids)
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise GuardError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if steps_per_launch is not None and (type(steps_per_launch) is not int or steps_per_launch < 1):
        raise GuardError(f"steps_per_launch must be a positive int, got {steps_per_launch!r}")
    max_batch, context = lm_contract(runner.checked)
    if len(prompts) > max_batch:
        raise GuardError(f"{len(prompts)} prompts, the bundle's batch admits at most {max_batch}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise GuardError(
            f"a prompt of {longest} tokens plus {max_new_tokens} new tokens needs {longest + max_new_tokens} "
            f"cache slots, the bundle's context holds {context}; shorten the prompt or max_new_tokens"
        )
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    batch = len(prompts)
    ids = [[pad] * (longest - len(p)) + p for p in prompts]
    mask = [[0] * (longest - len(p)) + [1] * len(p) + [0] * (context - longest) for p in prompts]
    # positions count each row's own tokens (padding slots get 1, as transformers does; masked anyway)
    positions = [[1] * (longest - len(p)) + list(range(len(p))) for p in prompts]
    last = [row[-1] for row in positions]
    order = runner.checked.input_names

    greedy = greedy_kernel(runner) if max_new_tokens > 1 else None
    # a block picks its tokens with the greedy kernel: without it, call by call
    block_steps = (steps_per_launch or BLOCK_STEPS) if greedy else 1
    # call by call, the greedy kernel still picks each call's tokens
    on_device = DeviceArgmax(runner, greedy, batch, max_new_tokens) if greedy and block_steps == 1 else None
    ends = sorted(eos)
    taken: Readback | None = None  # the runner's, at the first block
    ahead = None  # (block, readback buffer): launched from what the block before left on the device

    def call(entry: str, inputs: dict[str, HostInt64]) -> list[int]:
        out = runner.run_views([inputs[n].view() for n in order], entry_point=entry, check_indices=False)
        logits = out if hasattr(out, "dtype") else (out.logits if hasattr(out, "logits") else out[0])
        if entry == "decode" and on_device is not None:
            return on_device.tokens(logits)
        rows, vocab = logits.shape
        data = ctypes.create_string_buffer(logits.nbytes)
        runner.gpu.synchronize()
        runner.gpu.to_host(ctypes.addressof(data), logits.ptr, logits.nbytes)
        return argmax_rows(data.raw, logits.dtype, rows, vocab)

    runner.reset(range(batch))
    try:  # every slot written is < longest + max_new_tokens <= context (checked above)
        pending = [
            call(
                "prefill",
                {
                    "input_ids": HostInt64(ids),
                    "position_ids": HostInt64(positions),
                    "cache_position": HostInt64(list(range(longest))),
                    "attention_mask": HostInt64(mask),
                },
            )
        ]  # tokens picked, not yet taken: the prefill's, then a call's or a block's
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * batch
        for step in range(max_new_tokens):
            tokens = [pad if done[i] else t for i, t in enumerate(pending.pop(0))]
            for i, t in enumerate(tokens):
                if not done[i]:
                    new[i].append(t)
                    done[i] = t in eos
            if on_token is not None:
                on_token(step, tokens)
            if step + 1 == max_new_tokens or all(done):
                break
            slot = longest + step
            for row in mask:
                row[slot] = 1
            last = [p + 1 for p in last]
            if pending:  # a block's next token: its call ran already (the host mirrors its inputs)
                continue
            if block_steps > 1:  # a whole block, or the steps left as a block of their own
                steps = min(block_steps, max_new_tokens - 1 - step)
                if taken is None:
                    taken = readback(runner, batch * block_steps * 8)
                if ahead is None:
                    inputs = decode_inputs(tokens, last, slot, mask)
                    views = [inputs[n].view() for n in order]
                    block = decode_block(runner, views, steps, len(ends), batch)
                    at = block.launch(views, done, pad, ends, taken)
                else:
                    (block, at), ahead = ahead, None
                if max_new_tokens - 1 - (step + steps) >= block_steps:  # another whole block
                    ahead = (block, block.launch(None, done, pad, ends, taken))
                pending.extend(block.take(taken, at))
            else:
                pending.append(call("decode", decode_inputs(tokens, last, slot, mask)))
        return new[0] if flat else new
    finally:
        if ahead is not None:  # the rows ended inside the block before it: its steps still run
            runner.gpu.synchronize()
        if on_device is not None:
            on_device.close()
