"""Loader stage: ``.tpk`` → ``Runner``.

Opens and verifies the bundle, preflights the environment (schema, ops this torch must have),
loads the weights, and serves calls: every call's inputs are checked against the guards, then the
program runs. This package imports only ``aot`` core, torch, safetensors and zstandard: never
the tracer, codegen, packager, triton, sympy, torch._dynamo or torch._inductor.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from aot import bundle as _bundle
from aot import memory as _memory
from aot import schema
from aot import signature as _signature
from aot import tuning as _tuning
from aot.allowed_ops import STATE_WRITE_OPS
from aot.archs import arch_of
from aot.aten import DTYPES, resolve_op, state_writes_checked
from aot.buckets import check_buckets
from aot.bundle import Bundle, open_bundle
from aot.errors import BundleError, EnvError, GuardError
from aot.layout import check_order
from aot.loader.cuda import raw_stream
from aot.loader.executor import ProgramExecutor
from aot.loader.guards import GuardChecker
from aot.loader.program import AtenProgram, OutputSpecs, Storages, storage_span
from aot.loader.state import State, check_index_bounds
from aot.loader.values import check_values, integers_like, value_bounds
from aot.loader.variants import check_programs
from aot.loader.weights import header_limit, to_device, weights_size_limit
from aot.manifest_text import manifest_of_bundle, render_manifest
from aot.memory import check_max_memory, check_plan, planned_peak
from aot.program import all_steps, buffers_read, reference_steps
from aot.pytree import flatten_inputs, match_leaves, unflatten
from aot.pytree import validate as validate_tree
from aot.schema import Manifest
from aot.signature import trusted_keys

__all__ = ["Runner", "load", "open_bundle"]

# The torch-free pieces moved to the core (``aot.runtime`` shares them); their old names still import.
for _name, _module in (
    ("bundle", _bundle),
    ("memory", _memory),
    ("signature", _signature),
    ("tuning", _tuning),
):
    sys.modules[f"{__name__}.{_name}"] = globals()[_name] = _module

CAPTURE_MODES = ("lazy", "all", "none")
OUTPUT_MODES = ("copy", "borrow")


def _load_tensors(bundle: Bundle, name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = bundle.read(name)
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise BundleError(f"{bundle.path}: {name} is not valid safetensors: {e}") from None


def admitted_count(guards: GuardChecker) -> int:
    """How many size combinations a program's guards admit at most (the product of its symbols'
    ranges): the smaller, the narrower the program."""
    count = 1
    for g in guards.symbols.values():
        count *= g.max - g.min + 1
    return count


def weights_read(programs: tuple[schema.Program, ...], candidates: bool = False) -> set[str]:
    """The buffers some step of ``programs`` reads, on either path (kernel arguments or their
    reference steps), and their outputs; with ``candidates`` (a GPU, where a tuning table's plans
    run) also what the sites' candidate steps read (a LayerNorm's column sums that only a joined
    pair of tiles reads, ``aot.codegen.norm_sums``)."""
    read: set[str] = set()
    for p in programs:
        read.update(p.outputs)
        read |= buffers_read(all_steps(p) if candidates else p.steps)
    return read


def _check_options(capture: str, outputs: str, max_memory: int | None, max_flops: int | None) -> None:
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
    if outputs not in OUTPUT_MODES:
        raise ValueError(f"outputs must be one of {OUTPUT_MODES}, got {outputs!r}")
    if max_memory is not None and (type(max_memory) is not int or max_memory <= 0):
        raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
    if max_flops is not None and (type(max_flops) is not int or max_flops <= 0):
        raise ValueError(f"max_flops must be a positive number of operations, got {max_flops!r}")


def _device_of(device: str | torch.device) -> torch.device:
    """The torch device a runner loads on; a CUDA one with its index (the GPU current at load)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise EnvError(
            f"device {str(device)[:40]!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise EnvError(f"bundles run on 'cpu' or 'cuda' devices, not {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EnvError("device cuda requested but torch sees no CUDA GPU; load with device='cpu'")
    if device.type == "cuda" and device.index is None:
        # the GPU current at load: weights live there, and calls are checked against it
        # without asking torch for the current device every call
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Entry:
    """One program of the bundle, ready to run: its guards, and its CPU or GPU executor."""

    __slots__ = (
        "name",
        "entry",
        "program",
        "guards",
        "outputs",
        "aten",
        "gpu",
        "graphs",
        "index_bounds",
        "value_bounds",
    )

    def __init__(
        self, name: str, program: schema.Program, guards: GuardChecker, device: torch.device, entry: str = ""
    ):
        self.name, self.program, self.guards, self.entry = name, program, guards, entry
        self.outputs = OutputSpecs(program, device)
        self.aten = self.gpu = self.graphs = None
        self.index_bounds: tuple[tuple[str, str, int], ...] = ()  # caller's inputs that index the state
        self.value_bounds: tuple = ()  # caller's inputs that index a weight's rows (aot.loader.values)


class EntryRunner:
    """One entry point of a loaded bundle (``runner.entry("decode")``), callable like the runner:
    each call runs the first of that entry point's programs whose guards admit it."""

    def __init__(self, runner: Runner, name: str):
        self.runner, self.name = runner, name
        self._entries = [e for e in runner._entries if e.entry == name]
        # Index inputs (cache_position) are checked against the state's slots on every call;
        # ``generate`` turns this off for the calls it makes, whose slots it checked up front.
        self.check_indices = True

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.runner.input_names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner._call(self._entries, args, kwargs, self.check_indices)

    def __repr__(self) -> str:
        return f"<entry point {self.name} of {self.runner.manifest.name}: {len(self._entries)} program(s)>"


class Runner:
    """A loaded bundle, callable like the model: ``runner(x)`` or ``runner(x=x)``; returns what
    the model returned (a tensor, tuple, dict, or a ``Record`` for a ``ModelOutput``).

    A bundle may hold several programs (``batch == 1`` beside the general trace); each call runs
    the first whose guards admit it. Thread-safe: each call keeps its intermediates to itself.

    A stateful bundle (an LLM with a KV cache: ``Input(state=True)``) holds its state here,
    allocated once at load (``aot.loader.state``); each call updates the rows it runs on in place,
    ``reset()`` zeroes it, and calls are serialized (they share the state). Its entry points
    (``entry_points``: "prefill", "decode") are callables of their own: ``runner.entry("decode")``;
    ``generate`` runs prefill then decode steps.
    """

    def __init__(
        self,
        bundle: Bundle,
        device: str | torch.device = "cpu",
        capture: str = "lazy",
        max_memory: int | None = None,
        outputs: str = "copy",
        max_flops: int | None = None,
    ):
        _check_options(capture, outputs, max_memory, max_flops)
        self.borrow = outputs == "borrow"
        self.bundle = bundle
        self.manifest: Manifest = bundle.manifest
        self.device = _device_of(device)
        programs = self._read_programs()
        entries = self._program_entries(programs)
        check_programs(self.manifest, programs, [e[1] for e in entries], bundle.path)
        check_plan(self.manifest, self.program, bundle.path)
        self.state = State(self.manifest.guards, DTYPES, self.device, str(bundle.path))
        aliases = self._check_programs(entries, programs, max_memory)
        self.weights = self._load_weights(programs)
        self._weight_storages = Storages(self.weights.values())
        self.guards = GuardChecker(self.manifest.guards, DTYPES)
        self._nested = any("." in n for n in self.guards.names)  # runner(inputs={"image": x}) spreads
        self._input_set = frozenset(self.guards.names)
        # with several programs, a call must also satisfy the contract's relations among symbols,
        # which a program's own guards may leave out (``aot.loader.variants`` checks the rest)
        self._contract_relations = bool(self.manifest.guards.relations) and len(entries) > 1
        self.state.allocate()
        # memory the runner owns, never handed to a caller as an output: weights, and the state
        self._owned_storages = [self._weight_storages]
        if self.state.tensors:
            self._owned_storages.append(Storages(self.state.tensors.values()))
        self._state_lock = threading.Lock()
        self._generate_lock = threading.Lock()  # a generation owns the state from prefill to its last token
        self._decode_blocks: dict = {}  # generate's block graphs, kept for later generations (decode_blocks)
        from aot.tuning import read_tuning

        # checked wherever the bundle loads; applied only on a GPU of the arch it was measured on
        self.tuning = read_tuning(bundle, programs, [e[2] for e in entries])
        self._state_order = None
        if self.device.type == "cuda" and self.state.tensors:
            from aot.loader.gpu import StreamOrder

            self._state_order = StreamOrder(self.device)
        self._entries = self._load_programs(entries, programs, aliases, capture, max_memory, max_flops)
        if capture == "all" and self.state.tensors:
            self.state.reset()  # the captures' warm-ups wrote into it
        # A plain call on a bundle with entry points goes to the narrowest program that admits it
        # (a one-token call to decode, whose program is made for it, not to prefill). The programs
        # of one entry point admit disjoint sizes, so reordering them changes nothing; a bundle
        # without entry points keeps its order.
        self._dispatch_order = (
            sorted(self._entries, key=lambda e: admitted_count(e.guards))
            if self.entry_points
            else self._entries
        )

    def _read_programs(self) -> tuple[schema.Program, ...]:
        """The bundle's programs (the general one, then its variants), their ops resolved in this
        torch and their output trees checked."""
        for op in self.manifest.ops:  # whether a state write writes state is checked per step below
            resolve_op(op, state_write=op in STATE_WRITE_OPS)
        self.program = self.bundle.program()
        programs = (self.program, *self.program.variants)
        for p in programs:
            if p.variants and p is not self.program:
                raise BundleError(f"{self.bundle.path}: a program variant has variants of its own")
            if p.output_tree is not None:
                validate_tree(p.output_tree, len(p.outputs))
        return programs

    def _program_entries(self, programs: tuple[schema.Program, ...]) -> list[tuple]:
        """Per program: (name, guards, buckets, entry point), as the manifest lists them; each
        program's own buckets checked against its guards."""
        path = self.bundle.path
        if self.manifest.programs:
            if len(self.manifest.programs) != len(programs):
                raise BundleError(
                    f"{path}: the manifest lists {len(self.manifest.programs)} programs, "
                    f"the program member holds {len(programs)}"
                )
            for e in self.manifest.programs:  # the bundle checks the top-level buckets; these, here
                check_buckets(e.buckets, e.guards, f"{path}: program {e.name[:40]!r}")
            return [(e.name, e.guards, e.buckets, e.entry) for e in self.manifest.programs]
        if len(programs) != 1:
            raise BundleError(
                f"{path}: the program member holds {len(programs)} programs but the "
                f"manifest lists no guards for them"
            )
        return [("general", self.manifest.guards, self.manifest.buckets, "")]

    def _check_programs(
        self, entries: list[tuple], programs: tuple[schema.Program, ...], max_memory: int | None
    ) -> list[Any]:
        """Each program against the state and the memory limit; per program, the state aliases
        of its reference steps."""
        aliases = []
        for (name, guards, _, _), program in zip(entries, programs):
            self.state.check_program(program, str(self.bundle.path))
            # a program writes nothing but its own state, on either path (kernels' references run on CPU)
            state_writes_checked(program.steps, program.state)
            aliases.append(state_writes_checked(reference_steps(program), program.state))
            peak, sizes = planned_peak(program, guards, cpu=self.device.type == "cpu")
            if max_memory is not None:
                check_max_memory(peak + self.state.nbytes, sizes, max_memory, name)
        return aliases

    def _load_weights(self, programs: tuple[schema.Program, ...]) -> dict[str, torch.Tensor]:
        """The weights some step reads, on the device, laid out as the codegen chose, each checked
        against the program's dtype and shape."""
        bundle = self.bundle
        declared = {w.name: w for p in programs for w in p.weights}
        used = weights_read(programs, candidates=self.device.type == "cuda")
        where = f"{bundle.path}: {schema.WEIGHTS_PATH}"
        limit = weights_size_limit({n: w.spec for n, w in declared.items()}, where)
        size = self.manifest.members[schema.WEIGHTS_PATH].size
        if size > limit:
            raise BundleError(
                f"{where} is {size} bytes, more than the {limit} that the program's {len(declared)} "
                f"weights take; not a bundle this aotpack wrote"
            )
        orders = {}  # laid out as the codegen chose (``aot.layout``) on a GPU; row-major on CPU
        if self.device.type == "cuda":
            for w in declared.values():
                if w.spec.order and w.name in used:
                    orders[w.name] = check_order(
                        w.spec.order, len(w.spec.shape), f"{where}: weight {w.name!r}"
                    )
        weights = to_device(
            bundle.read(schema.WEIGHTS_PATH),
            self.device,
            where,
            keep=used & set(declared),
            max_header=header_limit(len(declared)),
            orders=orders,
        )
        for w in declared.values():
            if w.name not in used:
                continue  # never copied: no step reads it
            t = weights.get(w.name)
            if t is None:
                raise BundleError(f"{bundle.path}: weight {w.name!r} is missing from {schema.WEIGHTS_PATH}")
            if str(t.dtype).removeprefix("torch.") != w.spec.dtype or [str(s) for s in t.shape] != list(
                w.spec.shape
            ):
                raise BundleError(
                    f"{bundle.path}: weight {w.name!r} is {t.dtype} {list(t.shape)}, the program expects "
                    f"{w.spec.dtype} {list(w.spec.shape)}"
                )
        return weights

    def _load_programs(
        self,
        entries: list[tuple],
        programs: tuple[schema.Program, ...],
        aliases: list[Any],
        capture: str,
        max_memory: int | None,
        max_flops: int | None,
    ) -> list[_Entry]:
        """Each program ready to run: its guards, and its GPU program (with its tuned plans and
        CUDA graphs) or its CPU one."""
        from aot.tuning import tuned_plans

        loaded: list[_Entry] = []
        arena = None
        if self.device.type == "cuda" and capture != "none":
            from aot.loader.gpu import Arena

            arena = Arena(self.device)  # every program's graphs share one pool
        for index, ((name, guards, buckets, entry_name), program, state_aliases) in enumerate(
            zip(entries, programs, aliases)
        ):
            checker = self.guards if len(entries) == 1 else GuardChecker(guards, DTYPES)
            if set(checker.names) != set(self.guards.names) or checker.state_names != self.guards.state_names:
                raise BundleError(
                    f"{self.bundle.path}: program {name[:40]!r} takes inputs {list(checker.names)[:8]}, "
                    f"the bundle {list(self.guards.names)[:8]}"
                )
            entry = _Entry(name, program, checker, self.device, entry_name)
            entry.index_bounds = self.state.index_bounds(program)
            entry.value_bounds = value_bounds(program, self.weights)
            if self.device.type == "cuda":
                from aot.loader.gpu import GpuProgram, GraphRunner

                arch = arch_of(torch.cuda.get_device_capability(self.device))
                plans = tuned_plans(self.tuning, index, program, arch)
                if max_memory is not None:  # a tuned plan's workspaces count too
                    for steps in {id(s): s for s in plans.values()}.values():
                        peak, sizes = planned_peak(replace(program, steps=steps), guards, cpu=False)
                        check_max_memory(peak, sizes, max_memory, name)
                entry.gpu = GpuProgram(
                    self.bundle, program, self.weights, self.device, plans, state_aliases, max_flops
                )
                if capture != "none":
                    entry.graphs = GraphRunner(
                        entry.gpu,
                        buckets,
                        arena,
                        entry.outputs,
                        self._weight_storages,
                        self.state,
                        relations=tuple(r.expr for r in guards.relations),
                    )
                    if capture == "all":
                        entry.graphs.capture_all()
            else:
                entry.aten = AtenProgram(
                    program, self.weights, self.device, state_aliases=state_aliases, max_flops=max_flops
                )
            loaded.append(entry)
        return loaded

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.guards.names

    @property
    def executors(self) -> tuple[ProgramExecutor, ...]:
        """Each program of the bundle, in bundle order, as ``aotpack verify`` and ``tune`` drive it:
        step by step, on buffers they read (``aot.loader.executor``)."""
        return tuple(ProgramExecutor(self, i) for i in range(len(self._entries)))

    @property
    def programs(self) -> tuple[str, ...]:
        """The names of the bundle's programs, in dispatch order."""
        return tuple(e.name for e in self._entries)

    @property
    def entry_points(self) -> tuple[str, ...]:
        """The bundle's named entry points ("prefill", "decode"), in declaration order; empty for
        a bundle of one unnamed entry point."""
        return tuple(dict.fromkeys(e.entry for e in self._entries if e.entry))

    @property
    def state_names(self) -> tuple[str, ...]:
        """The runner-owned state tensors (a KV cache), by name."""
        return tuple(self.state.tensors)

    def entry(self, name: str) -> EntryRunner:
        """The entry point ``name`` as a callable (``runner.entry("decode")(input_ids=...)``)."""
        if name not in self.entry_points:
            raise GuardError(
                f"the bundle has no entry point {str(name)[:40]!r}; its entry points are "
                f"{list(self.entry_points) or '(none: call the runner itself)'}"
            )
        return EntryRunner(self, name)

    def generate(
        self,
        prompt_ids: Any = None,
        max_new_tokens: int | None = None,
        attention_mask: Any = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        on_token: Any = None,
        input_features: Any = None,
        decoder_prompt_ids: Sequence[int] | None = None,
        steps_per_launch: int | None = None,
        input_ids: Any = None,
    ) -> list[list[int]] | list[int]:
        """Generate up to ``max_new_tokens`` tokens after each prompt, with a bundle of a causal LM
        (``aot.hf.causal_lm``: entry points ``prefill`` and ``decode`` over a KV cache) or of an
        encoder-decoder (``aot.hf.seq2seq``: entry points ``encode``, ``prefill`` and ``decode``).

        ``prompt_ids``: one prompt (a list of ints: the result is a list of ints), several (a list
        of lists, left-padded here), or an int tensor [batch, seq] whose ``attention_mask`` marks
        left padding with 0. ``input_ids`` is another name for it, transformers': a tokenizer's
        output passes as ``generate(**batch, max_new_tokens=n)``. Greedy unless ``do_sample``
        (softmax of ``logits / temperature`` over the ``top_k`` most likely, drawn from a generator
        seeded with ``seed``). A row stops after
        ``eos_token_id`` (which it keeps); rows that stopped are fed ``pad_token_id``. Returns each
        prompt's new tokens; ``on_token(step, tokens)`` sees each step's tokens as they come.
        ``GuardError`` before anything runs when the prompts and new tokens overflow the context
        or the batch. ``steps_per_launch``: greedy steps per CUDA graph launch (default 8 on a GPU,
        ``aot.loader.decode_blocks``: the argmax and the next step's inputs on the device, the
        tokens copied back once per block, ``on_token`` called for each of them then); 1 launches
        every step on its own. On a CPU it defaults to 1 (more runs the same steps in blocks). The state's rows ``0..batch-1`` are reset first; generations on one runner run
        one at a time.

        Encoder-decoder bundles: the prompts feed the encoder (lists are padded on the right; a
        tensor's ``attention_mask`` may pad either side), or, for an audio encoder (Whisper),
        ``input_features`` [batch, mel_bins, frames] does (one [mel_bins, frames] gives one list of
        tokens); the decoder starts from the model's decoder start token, followed by
        ``decoder_prompt_ids`` when given (the same for every row), and the new tokens come after
        them. A prompt longer than the bundle's ``max_source``, or more decoder tokens than its
        ``max_target`` slots, is a ``GuardError`` before anything runs.
        """
        from aot.loader.generate import generate, is_seq2seq, seq2seq_generate

        if input_ids is not None:
            if prompt_ids is not None:
                raise GuardError(
                    "generate takes the prompts once: prompt_ids, or input_ids (transformers' name for "
                    "them), not both"
                )
            prompt_ids = input_ids
        with self._generate_lock:
            if is_seq2seq(self):
                if steps_per_launch not in (None, 1):
                    raise GuardError(
                        f"steps_per_launch={steps_per_launch!r}: blocks of decode steps are for causal-LM "
                        "bundles (aot.hf.causal_lm); an encoder-decoder bundle decodes step by step: leave it out"
                    )
                return seq2seq_generate(
                    self,
                    prompt_ids,
                    max_new_tokens,
                    attention_mask=attention_mask,
                    input_features=input_features,
                    decoder_prompt_ids=decoder_prompt_ids,
                    eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id,
                    do_sample=do_sample,
                    temperature=temperature,
                    top_k=top_k,
                    seed=seed,
                    on_token=on_token,
                )
            if input_features is not None or decoder_prompt_ids is not None:
                raise GuardError(
                    "input_features and decoder_prompt_ids are for encoder-decoder bundles (aot.hf.seq2seq); "
                    f"this one has entry points {list(self.entry_points)}"
                )
            return generate(
                self,
                prompt_ids,
                max_new_tokens,
                attention_mask=attention_mask,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                seed=seed,
                on_token=on_token,
                steps_per_launch=steps_per_launch,
            )

    def reset(self, rows: int | Sequence[int] | None = None) -> None:
        """Zero the state (every row, or the given batch rows) before new sequences use it."""
        with self._state_lock:
            self._after_last_state_call()
            self.state.reset(rows)

    def _after_last_state_call(self) -> None:
        """On a GPU: order this call's stream after the last call that touched the state on
        another stream (``aot.loader.gpu.StreamOrder``); the caller holds ``_state_lock``."""
        if self._state_order is not None:
            self._state_order.after_last_call(raw_stream(self.device.index))

    def _dispatch(
        self, values: list[Any], entries: list[_Entry] | None = None
    ) -> tuple[_Entry, dict[str, int]]:
        """The first program whose guards admit the call, and its symbol values. Only a call that
        no program admits is checked against the bundle's whole contract, for its error."""
        errors = []
        for entry in entries if entries is not None else self._dispatch_order:
            try:
                return entry, entry.guards.check(values, self.device)
            except GuardError as e:
                errors.append(f"program {entry.name}: {e}")
        self.guards.check(values, self.device)  # out of the contract: the error names input, dim and line
        raise GuardError(
            "the inputs satisfy the bundle's declared guards, but no program admits this combination "
            "of sizes: " + "; ".join(errors)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model. ``out=`` (unless the model has an input of that name): buffers shaped
        like the model's output (a tensor, tuple, list, dict or ``Record`` of contiguous tensors
        of exactly the outputs' dtypes, shapes and device for this call) to write the results
        into; they are returned. ``GuardError`` for a buffer that does not fit or shares memory
        with the inputs, the weights, the state or another buffer."""
        return self._call(None, args, kwargs)

    def _call(
        self, entries: list[_Entry] | None, args: tuple, kwargs: dict, check_indices: bool = True
    ) -> Any:
        out = kwargs.pop("out", None) if "out" not in self._input_set else None
        if self._nested and kwargs:
            kwargs = flatten_inputs(kwargs, self.guards.names)
        values = self.guards.bind(args, dict(kwargs))
        if entries is None and len(self._entries) == 1:
            entry, sizes = self._entries[0], self.guards.check(values, self.device)
        else:
            entry, sizes = self._dispatch(values, entries)
            if self._contract_relations:  # the bundle's relations hold whichever program runs
                self.guards.check(values, self.device)
        buffers = None
        if out is not None:
            try:
                buffers = match_leaves(entry.program.output_tree, len(entry.program.outputs), out)
            except ValueError as e:
                raise GuardError(f"out= is not shaped like the model's output: {e}") from None
            taken = [storage_span(v) for v in values if isinstance(v, torch.Tensor)]
            entry.outputs.check_out(buffers, sizes, taken, self._owned_storages)
        if check_indices and entry.value_bounds:
            check_values(entry.value_bounds, dict(zip(self.guards.names, values)))
        grad = torch.is_grad_enabled()
        if grad:  # no autograd graph, whatever the inputs require (no_grad's manager costs µs)
            torch._C._set_grad_enabled(False)
        try:
            if entry.program.state:
                if check_indices and entry.index_bounds:
                    check_index_bounds(entry.index_bounds, dict(zip(self.guards.names, values)))
                with self._state_lock:  # calls share the state: one at a time, in stream order
                    self._after_last_state_call()
                    outputs = self._run(entry, values, sizes, buffers)
            else:
                outputs = self._run(entry, values, sizes, buffers)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
        return out if out is not None else unflatten(entry.program.output_tree, outputs)

    def _run(
        self, entry: _Entry, values: list[Any], sizes: dict[str, int], out: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        inputs = dict(zip(self.guards.names, values))
        if entry.gpu is None:
            outputs = entry.aten({**inputs, **self.state.views(sizes)}, sizes)
        else:
            key = entry.graphs.bucket_for(sizes) if entry.graphs is not None else None
            if key is not None:
                # copied out of the graph (caller-owned), into ``out``, or lent until the next call;
                # the graph's outputs were checked against their specs when it was captured
                return entry.graphs(key, inputs, sizes, out=out, borrow=self.borrow)
            outputs = entry.gpu({**inputs, **self.state.views(sizes)}, sizes)
        entry.outputs.check(outputs, sizes)
        if out is not None:
            return [buf.copy_(result) for buf, result in zip(out, outputs)]
        # an output must never share memory with a weight, the state, or an input the caller may mutate
        inputs_at = [storage_span(v) for v in values]
        owned = []
        for out in outputs:
            start, end = storage_span(out)
            shared = any(o.overlaps(start, end) for o in self._owned_storages) or any(
                s < end and start < e for s, e in inputs_at
            )
            owned.append(out.clone() if shared else out)
        return owned

    def example_inputs(self) -> dict[str, torch.Tensor]:
        ref = _load_tensors(self.bundle, schema.REFERENCE_PATH)
        missing = [n for n in self.input_names if schema.REFERENCE_INPUT_PREFIX + n not in ref]
        if missing:
            raise BundleError(
                f"{self.bundle.path}: {schema.REFERENCE_PATH} has no example for inputs {missing[:3]}"
            )
        return {n: ref[schema.REFERENCE_INPUT_PREFIX + n].to(self.device) for n in self.input_names}

    def inputs_at(self, sizes: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
        """Generated inputs at ``sizes`` (symbol -> value; the example inputs' sizes for the symbols
        not named): floats standard normal, integers and bools as ``aot.loader.values.integers_like``
        draws them from the example inputs (token ids within the range the examples span, masks
        in the examples' pattern, positions counting up). ``GuardError`` for sizes the bundle
        does not admit, naming the symbol and its admissible set."""
        examples = self.example_inputs()
        values = [examples[n] for n in self.input_names]
        unknown = sorted(set(sizes) - set(self.guards.symbols))
        if unknown:
            raise GuardError(
                f"unknown size symbol(s) {unknown}; the bundle's symbols are {sorted(self.guards.symbols)}"
            )
        at = {**self.guards.check(values, self.device), **sizes}
        for name, value in sizes.items():
            self.guards.check_symbol(name, value, "requested size")
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for (name, _, _, dims), example in zip(self.guards.inputs, values):
            shape = [at[d] if isinstance(d, str) else d for d in dims]
            if example.dtype.is_floating_point:
                value = torch.randn(shape, generator=generator).to(example.dtype)
            else:
                value = integers_like(example, shape, generator)
            out[name] = value.to(self.device)
        return out

    def reference_outputs(self) -> list[torch.Tensor]:
        """The eager model's outputs on ``example_inputs()`` at build time, flat (``aot.pytree.leaves``
        order)."""
        ref = _load_tensors(self.bundle, schema.REFERENCE_PATH)
        outs = sorted(
            (int(k.removeprefix(schema.REFERENCE_OUTPUT_PREFIX)), v)
            for k, v in ref.items()
            if k.startswith(schema.REFERENCE_OUTPUT_PREFIX)
            and k[len(schema.REFERENCE_OUTPUT_PREFIX) :].isdecimal()
        )
        return [v for _, v in outs]

    def guards_text(self) -> str:
        return render_manifest(manifest_of_bundle(self.manifest))


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    capture: str = "lazy",
    trust: Sequence[str | os.PathLike] | None = None,
    max_memory: int | None = None,
    outputs: str = "copy",
    max_flops: int | None = None,
) -> Runner:
    """Open, verify and prepare a bundle for calls on ``device``.

    On CUDA, ``capture`` picks when CUDA graphs are captured: ``"lazy"`` (a bucket's graph on its
    first call: the fastest start), ``"all"`` (every bucket at load, largest first), or ``"none"``
    (kernels launched one by one on every call).

    ``trust``: public key files (``aotpack keygen``'s ``KEY.pub``); the bundle must be signed by one
    of them (``SignatureError`` otherwise, before anything but its manifest is read). None reads
    them from ``$AOTPACK_TRUST`` (``os.pathsep``-separated); with neither, signatures are not checked.
    ``max_memory`` (bytes): refuse, with ``EnvError``, a bundle whose program may need more
    activation memory than this for one call at any size its guards admit (for a real model: at the
    largest), on this device's path; weights and inputs are not counted. Without it, the bundle's
    own memory plan is still checked (``aot.memory``).
    ``outputs``: ``"copy"`` (default) returns outputs the caller owns; ``"borrow"`` returns, on a
    CUDA-graph replay, the graph's own output memory without a copy: valid until the runner's
    next call (as CUDA-graph trees and serving engines do), so read or copy it before calling
    again, and call from one thread at a time. Elsewhere outputs are the caller's in both modes.
    ``runner(..., out=buffers)`` writes into the caller's own buffers instead.
    ``max_flops``: refuse, with ``EnvError``, a call that would compute more operations than this
    (counted from each step's operand shapes before it runs: ``aot.loader.prerun``). Every step that
    could make more than its declared buffer is held to it before it runs, too.
    """
    bundle = open_bundle(path, trusted_keys(trust))
    try:
        return Runner(bundle, device, capture, max_memory, outputs, max_flops)
    except BaseException:
        bundle.close()  # a server that retries a bad bundle must not leak its file handle
        raise
