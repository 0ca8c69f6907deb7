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

On a CPU (tests) a block runs the same steps eagerly, one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Steps per block on a GPU: fewer launches and host round trips per token the more, but
# ``on_token`` sees the tokens in batches of this many, and up to this many steps run past the
# step where every row has finished.
GPU_BLOCK_STEPS = 8


class DecodeBlocks:
    """Blocks of greedy decode steps over one generation's ``decode`` entry point (see the
    module docstring). ``mask``: the generation's attention mask [batch, context] (its
    ``slot`` columns are set as the blocks write them); ``finished``, ``padding``, ``eos_ids``:
    the token loop's end-of-sequence tensors (``eos_ids`` None: no end token)."""

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
        self.device = mask.device
        self.graphs: dict[tuple, _Block] = {}
        self.current: _Block | None = None

    def block_for(self, inputs: dict[str, torch.Tensor]) -> _Block | None:
        """The block graph for a step called with ``inputs`` (as the step-by-step loop would call
        ``decode``), captured on first use; None where the call runs no captured graph (a CPU
        runner runs its blocks eagerly instead)."""
        runner = self.runner
        values = runner.guards.bind((), dict(inputs))
        entry, sizes = runner._dispatch(values, self.decode._entries)
        if entry.gpu is None:
            key = ("cpu", *sorted(sizes.items()))
            if key not in self.graphs:
                self.graphs[key] = _Block(self, _EagerCalls(runner, entry, sizes, inputs))
            return self.graphs[key]
        graphs = entry.graphs
        key = graphs.bucket_for(sizes) if graphs is not None else None
        if key is None or key not in graphs.graphs:
            return None  # no graph at this bucket, or not captured yet: a plain step captures it
        if key not in self.graphs:
            self.graphs[key] = _Block(self, _GraphCalls(runner, graphs, key))
        return self.graphs[key]

    def run(self, block: _Block, logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
        """Launch ``block``'s steps; ``logits`` and ``inputs``: the step before it's logits and
        inputs (read only when the block before was another graph)."""
        if self.current is not block:
            if self.current is not None:  # a block of another bucket before it: its carries
                logits = self.current.logits
                inputs = {**inputs, "position_ids": self.current.inputs["position_ids"]}
            block.start(logits, inputs)
            self.current = block
        block.launch()

    def handoff(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, position_ids) after the last block: where the step-by-step loop goes on."""
        block = self.current
        self.current = None
        return block.logits.clone(), block.inputs["position_ids"].clone()


class _Block:
    """One block graph: its carries (the step's inputs, the logits, the tokens it chose)."""

    def __init__(self, blocks: DecodeBlocks, calls: Any):
        self.blocks = blocks
        self.calls = calls
        self.inputs = calls.inputs  # the decode program's inputs, static
        vocab_rows = (blocks.batch, calls.vocab)
        self.logits = torch.empty(vocab_rows, dtype=calls.logits_dtype, device=blocks.device)
        self.tokens = torch.empty((blocks.batch, blocks.steps), dtype=torch.int64, device=blocks.device)
        self.context = self.inputs["attention_mask"].shape[1]
        calls.capture(self._steps)

    def start(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
        """The carries from the step before: its logits and inputs (the mask read from the
        generation's, whose every written slot is set)."""
        self.logits.copy_(logits)
        for name in ("input_ids", "position_ids", "cache_position"):
            self.inputs[name].copy_(inputs[name])
        self.inputs["attention_mask"].copy_(self.blocks.mask[:, : self.context])

    def _steps(self, call: Callable[[], list[torch.Tensor]]) -> None:
        """What the graph holds: per step, the token from the logits before it, the next inputs
        in place, the decode program; the last logits kept for the next block."""
        b = self.blocks
        ids, positions = self.inputs["input_ids"], self.inputs["position_ids"]
        slot, mask = self.inputs["cache_position"], self.inputs["attention_mask"]
        logits = self.logits
        for j in range(b.steps):
            token = b.argmax(logits)
            if b.eos_ids is not None:
                token = torch.where(b.finished, b.padding, token)
                b.finished.logical_or_(token[:, None].eq(b.eos_ids[None, :]).any(-1))
            self.tokens[:, j].copy_(token)
            ids.copy_(token[:, None])
            positions.add_(1)
            slot.add_(1)
            mask.scatter_(1, slot.expand(b.batch, 1), 1)
            logits = _logits(call())
        self.logits.copy_(logits)

    def launch(self) -> None:
        self.calls.replay()


class _GraphCalls:
    """The decode program at one bucket, called inside one CUDA graph (``capture_calls``)."""

    def __init__(self, runner: Any, graphs: Any, key: tuple):
        self.runner, self.graphs, self.key = runner, graphs, key
        captured = graphs.graphs[key]
        self.inputs = graphs.static_inputs(key)
        logits = _logits(captured.outputs)
        self.vocab, self.logits_dtype = logits.shape[-1], logits.dtype
        self.graph = None

    def capture(self, steps: Callable[[Callable[[], list[torch.Tensor]]], None]) -> None:
        self.graph = self.graphs.capture_calls(self.key, self.inputs, steps)

    def replay(self) -> None:
        with self.runner._state_lock:  # the state's calls, one at a time, in stream order
            self.runner._after_last_state_call()
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
        self.steps = None

    def capture(self, steps: Callable[[Callable[[], list[torch.Tensor]]], None]) -> None:
        self.steps = steps

    def call(self) -> list[torch.Tensor]:
        runner = self.runner
        return self.entry.aten({**self.inputs, **runner.state.views(self.sizes)}, self.sizes)

    def replay(self) -> None:
        with self.runner._state_lock:
            self.steps(self.call)


def _logits(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (list, tuple)) else out
