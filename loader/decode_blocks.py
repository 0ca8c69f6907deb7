"""Several greedy decode steps per launch: the host out of the token loop.

A decode step on its own is one graph launch plus the host's work around it: the argmax, the
next step's inputs (the token, its position, the cache slot, the mask's new column), each a
small launch of its own, and the token's copy to the host. A block of ``n`` steps is one CUDA
graph holding, ``n`` times over, the argmax of the logits before it (with the end-of-sequence
bookkeeping), the next inputs written in place, and the decode program itself
(``GraphRunner.capture_calls``); its ``n`` tokens come back in one copy, and the host launches
the next block before it reads them. The tokens are those of one step at a time: the same
argmax, the same inputs, the same program at the same bucket.

A block's graph reads and writes carries of its own: the inputs of the step (``input_ids``,
``position_ids``, ``cache_position``, ``attention_mask``, written in place by each step for the
next), the logits the next argmax reads, and the rows that finished. They are set from the
generation's state when a block starts on another graph than the block before it, and handed
back when the blocks end, so the step-by-step loop (``aot.loader.generate.decode_loop``) goes on
where they stopped: before the first block (its bucket's graph is captured by a plain step, whose
warm-up creates the library handles a capture needs), at the end of a context bucket, and for
the last steps that do not fill a block.

Where the decode program carries its greedy step as one kernel (``Program.greedy``, the build's
``aot.codegen.greedy``), a block on a GPU launches that kernel between its steps instead of the
ATen steps (an argmax of two stages and seven small kernels: about 20 µs a token on an H200):
the same tokens, finished rows and next inputs, bit for bit. The block keeps the kernel's
workspace (each row's chunk results) and counters (zeroed once; every launch leaves them zeroed).
``AOTPACK_GREEDY_KERNEL=off`` keeps the ATen steps, for measuring.

On a CPU (tests) a block runs the same steps eagerly, one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from aot.settings import setting

GREEDY_ENV = "AOTPACK_GREEDY_KERNEL"  # "off": the ATen steps between decode steps, for measuring
# Steps per block on a GPU: fewer launches and host round trips per token the more, but
# ``on_token`` sees the tokens in batches of this many, and up to this many steps run past the
# step where every row has finished.
GPU_BLOCK_STEPS = 8


class DecodeBlocks:
    """Blocks of greedy decode steps for one generation over ``decode`` (see the module
    docstring). ``mask``: the generation's attention mask [batch, context] (a block starts from
    it; the generation sets the slots a block writes); ``finished``, ``padding``, ``eos_ids``: the
    token loop's end-of-sequence tensors (``eos_ids`` None: no end token). The block graphs are
    the runner's, kept for its later generations (one per bucket, block length and number of
    end tokens): their carries are their own, copied in at a block's start and out at the end."""

    def __init__(
        self,
        runner: Any,
        decode: Any,
        batch: int,
        steps: int,
        mask: torch.Tensor,
        finished: torch.Tensor,
        padding: torch.Tensor,
        eos_ids: torch.Tensor | None,
        argmax: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.runner, self.decode, self.batch, self.steps = runner, decode, batch, steps
        self.mask, self.finished, self.padding, self.eos_ids = mask, finished, padding, eos_ids
        self.argmax = argmax
        self.current: _Block | None = None
        self.cache: dict[tuple, _Block] = runner._decode_blocks

    def block_for(self, inputs: dict[str, torch.Tensor]) -> _Block | None:
        """The block graph for a step called with ``inputs`` (as the step-by-step loop would call
        ``decode``); None where that call runs no captured graph (the bucket has none, or a plain
        step has not captured it yet). A CPU runner's blocks run eagerly."""
        runner = self.runner
        values = runner.guards.bind((), dict(inputs))
        entry, sizes = runner._dispatch(values, self.decode._entries)
        ends = 0 if self.eos_ids is None else self.eos_ids.numel()
        if entry.gpu is None:
            key = (entry.name, "cpu", *sorted(sizes.items()), self.steps, ends)
            calls = lambda: _EagerCalls(runner, entry, sizes, inputs)  # noqa: E731
        else:
            graphs = entry.graphs
            bucket = graphs.bucket_for(sizes) if graphs is not None else None
            if bucket is None or bucket not in graphs.graphs:
                return None  # no graph at this bucket, or not captured yet: a plain step captures it
            key = (entry.name, bucket, self.steps, ends)
            calls = lambda: _GraphCalls(runner, graphs, bucket)  # noqa: E731
        if key not in self.cache:
            self.cache[key] = _Block(
                calls(), self.batch, self.steps, ends, self.argmax, greedy_kernel(entry.gpu)
            )
        return self.cache[key]

    def run(self, block: _Block, logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
        """Launch ``block``'s steps; ``logits`` and ``inputs``: the step before it's logits and
        inputs (read only when the block before was another graph, or none)."""
        if self.current is not block:
            if self.current is not None:  # a block of another bucket before it: its carries
                self.finished.copy_(self.current.finished)
                logits = self.current.logits
                inputs = {**inputs, "position_ids": self.current.inputs["position_ids"]}
            block.start(self, logits, inputs)
            self.current = block
        block.launch()

    def handoff(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, position_ids) after the last block, where the step-by-step loop goes on; the
        generation's ``finished`` rows updated."""
        block, self.current = self.current, None
        self.finished.copy_(block.finished)
        return block.logits.clone(), block.inputs["position_ids"].clone()


class _Block:
    """One block graph and its carries: the decode program's inputs (static, written in place by
    each step for the next), the logits the next argmax reads, the tokens the steps chose, and
    the end-of-sequence rows."""

    def __init__(
        self, calls: Any, batch: int, steps: int, ends: int, argmax: Callable, greedy: _Greedy | None = None
    ):
        self.calls, self.batch, self.steps, self.argmax = calls, batch, steps, argmax
        self.inputs = calls.inputs
        device = self.inputs["input_ids"].device
        self.logits = torch.empty((batch, calls.vocab), dtype=calls.logits_dtype, device=device)
        self.tokens = torch.empty((batch, steps), dtype=torch.int64, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.padding = torch.zeros(batch, dtype=torch.int64, device=device)
        self.eos_ids = torch.zeros(ends, dtype=torch.int64, device=device) if ends else None
        self.context = self.inputs["attention_mask"].shape[1]
        # the greedy step's kernel, where the inputs are as it indexes them; its workspace
        fits = greedy is not None and all(
            self.inputs[n].is_contiguous()
            for n in ("input_ids", "position_ids", "cache_position", "attention_mask")
        )
        self.greedy = greedy if fits else None
        if self.greedy is not None:
            chunks = self.greedy.chunks
            self.values = torch.empty((batch, chunks), dtype=torch.float32, device=device)
            self.indices = torch.empty((batch, chunks), dtype=torch.int32, device=device)
            self.counts = torch.zeros(batch + 1, dtype=torch.int32, device=device)
            self.no_eos = torch.zeros(1, dtype=torch.int64, device=device)

    def start(self, blocks: DecodeBlocks, logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
        """The carries from the step before: its logits and inputs, the generation's mask (whose
        every written slot is set) and end-of-sequence state."""
        self.logits.copy_(logits)
        for name in ("input_ids", "position_ids", "cache_position"):
            self.inputs[name].copy_(inputs[name])
        self.inputs["attention_mask"].copy_(blocks.mask[:, : self.context])
        self.finished.copy_(blocks.finished)
        self.padding.copy_(blocks.padding)
        if self.eos_ids is not None:
            self.eos_ids.copy_(blocks.eos_ids)

    def _steps(self, call: Callable[[], list[torch.Tensor]]) -> None:
        """What the graph holds: per step, the token from the logits before it, the next inputs
        in place, the decode program; the last logits kept for the next block."""
        ids, positions = self.inputs["input_ids"], self.inputs["position_ids"]
        slot, mask = self.inputs["cache_position"], self.inputs["attention_mask"]
        logits = self.logits
        for j in range(self.steps):
            if self.greedy is not None and logits.stride(-1) == 1:
                self._greedy_step(logits, j)
                logits = logits_of(call())
                continue
            token = self.argmax(logits)
            if self.eos_ids is not None:
                token = torch.where(self.finished, self.padding, token)
                self.finished.logical_or_(token[:, None].eq(self.eos_ids[None, :]).any(-1))
            self.tokens[:, j].copy_(token)
            ids.copy_(token[:, None])
            positions.add_(1)
            slot.add_(1)
            mask.scatter_(1, slot.expand(self.batch, 1), 1)
            logits = logits_of(call())
        self.logits.copy_(logits)

    def _greedy_step(self, logits: torch.Tensor, j: int) -> None:
        """The ATen steps of ``_steps`` between two decode steps, as the greedy kernel's one launch."""
        ins = self.inputs
        self.greedy.launch(
            {
                "logits": logits,
                "logits_stride": logits.stride(0),
                "tokens": self.tokens,
                "tokens_stride": self.tokens.stride(0),
                "step": j,
                **{n: ins[n] for n in ("input_ids", "position_ids", "cache_position", "attention_mask")},
                "mask_stride": ins["attention_mask"].stride(0),
                "finished": self.finished,
                "padding": self.padding,
                "eos_ids": self.eos_ids if self.eos_ids is not None else self.no_eos,
                "n_eos": 0 if self.eos_ids is None else self.eos_ids.numel(),
                "values": self.values,
                "indices": self.indices,
                "counts": self.counts,
                "rows": self.batch,
            },
            self.batch,
        )

    def launch(self) -> None:
        self.calls.launch(self._steps)


class _Greedy:
    """The decode program's greedy kernel (``Program.greedy``), loaded: ``launch`` passes its
    parameters (``aot.program.GREEDY_PARAMS``, which the bundle's check held it to) in order."""

    def __init__(self, gpu: Any, kernel: Any):
        self.gpu, self.kernel = gpu, kernel
        self.function = gpu.function(kernel)
        self.chunks = int(kernel.config["CHUNKS"])

    def launch(self, args: dict[str, Any], rows: int) -> None:
        """Launch over ``rows`` rows; ``args``: each parameter by name, a tensor or a size."""
        from aot.loader.cuda import pack_params
        from aot.program import greedy_params

        values = {n: a.data_ptr() if isinstance(a, torch.Tensor) else int(a) for n, a in args.items()}
        params, storage = pack_params([*greedy_params(values), *[("ptr", 0)] * self.kernel.scratch_params])
        self.gpu.context.bind()
        stream = torch.cuda.current_stream(self.gpu.device).cuda_stream
        self.function.launch((self.chunks, rows, 1), stream, params)
        del storage  # the launch (or the graph capturing it) has the values


def greedy_kernel(gpu: Any) -> _Greedy | None:
    """The greedy kernel of ``gpu``'s program (a ``GpuProgram``), loaded; None where it has none,
    on a CPU, or with ``AOTPACK_GREEDY_KERNEL=off``."""
    flag = setting(GREEDY_ENV, "on", ("on", "off"))
    if gpu is None or flag == "off" or not gpu.program.greedy:
        return None
    kernel = gpu.kernels.get(gpu.program.greedy)
    return _Greedy(gpu, kernel) if kernel is not None else None


class _GraphCalls:
    """The decode program at one bucket, called inside one CUDA graph: its first launch runs the
    block for real as the graph's warm-up (its writes are the block's own), and captures it
    (``GraphRunner.capture_calls``); later launches replay it."""

    def __init__(self, runner: Any, graphs: Any, key: tuple):
        self.runner, self.graphs, self.key = runner, graphs, key
        self.inputs = graphs.static_inputs(key)
        logits = logits_of(graphs.graphs[key].outputs)
        self.vocab, self.logits_dtype = logits.shape[-1], logits.dtype
        self.graph = None

    def launch(self, steps: Callable[[Callable[[], list[torch.Tensor]]], None]) -> None:
        with self.runner._state_lock:  # the state's calls, one at a time, in stream order
            self.runner._after_last_state_call()
            if self.graph is None:
                self.graph = self.graphs.capture_calls(self.key, self.inputs, steps)
            else:
                self.graphs.replay_calls(self.graph)


class _EagerCalls:
    """The decode program at one bucket's sizes, run eagerly (a CPU runner): a block's steps
    one after the other, as the graph would run them."""

    def __init__(self, runner: Any, entry: Any, sizes: dict[str, int], inputs: dict[str, torch.Tensor]):
        self.runner, self.entry, self.sizes = runner, entry, sizes
        self.inputs = {name: value.clone() for name, value in inputs.items()}
        out = entry.program.buffers[entry.program.outputs[0]]
        self.vocab = int(out.shape[-1])
        from aot.aten import DTYPES

        self.logits_dtype = DTYPES[out.dtype]

    def call(self) -> list[torch.Tensor]:
        runner = self.runner
        return self.entry.aten({**self.inputs, **runner.state.views(self.sizes)}, self.sizes)

    def launch(self, steps: Callable[[Callable[[], list[torch.Tensor]]], None]) -> None:
        with self.runner._state_lock:
            steps(self.call)


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a program's result: the tensor itself, a model output's ``logits``, or the
    first of several results."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]
