"""A bundle checked for the runtime without torch, before any device is touched.

``check_bundle`` opens and verifies the archive (``aot.bundle``: checksums, layout, resource
bounds; ``aot.signature`` with a trust list), checks the memory plan at the guards' largest sizes
(``aot.memory``), and refuses a bundle that is not library-free: after the steps nobody reads are
dropped, every step must be a compiled kernel, a view that keeps a row-major buffer row-major at
the same address (the kernels index the buffer it views), or a copy the driver makes. The first
step that is none of these is named with its program, index, target and result.

A bundle's tuning table (``tuning.json``: a library-free build's one-row GEMV forms, or
``aotpack tune``'s choices) is read and checked as the torch loader reads it (``aot.tuning``); every
plan it makes on the table's arch must be library-free too, and is held to ``max_memory``.
``Checked.plans`` hands each program's plans for a GPU's arch (``aot.tuning.tuned_plans``, the
torch loader's own), so both loaders run the same steps at every bucket.

``Checked.bind`` checks a call's arrays against the guards with the same code and texts as the
torch loader (``aot.guards.GuardCore``) and picks the first program whose guards admit it.
``Checked.layout`` places, per size, every buffer of a program in one activation arena
(``ArenaLayout``: offsets by liveness, views at their base's address).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from aot.allowed_ops import STATE_WRITE_OPS
from aot.bundle import Bundle, open_bundle
from aot.dtypes import ITEMSIZE
from aot.errors import BundleError, GuardError
from aot.guards import GuardCore
from aot.memory import check_max_memory, check_plan, planned_peak
from aot.program import (
    aliases,
    check_library_free,
    lifetimes,
    live_steps,
    output_tail,
    scratch_shapes,
    step_reads,
    step_writes,
)
from aot.pytree import flatten_inputs
from aot.runtime.arrays import ArrayView, from_dlpack
from aot.schema import Bucket, Buf, Program, Step, StepKind
from aot.signature import trusted_keys
from aot.state import StateSpec, index_bounds, state_specs
from aot.symexpr import compile_expr
from aot.tuning import read_tuning, tuned_plans
from aot.values import value_bounds

ALIGN = 256  # bytes: every buffer of the arena and every weight starts at a multiple


@dataclass(frozen=True)
class Entry:
    """One program of the bundle: its guards, buckets and the steps the runtime runs."""

    name: str
    program: Program
    guards: GuardCore
    buckets: tuple[Bucket, ...]
    steps: tuple[Step, ...]  # the program's steps, those nobody reads dropped
    entry: str = ""  # the entry point it serves ("prefill", "decode"), "" without named ones
    index_bounds: tuple[tuple[str, str, int], ...] = ()  # (input, state, slots): ``aot.state.index_bounds``
    state_writes: dict[str, str] | None = None  # a state write's result -> the state it is
    # (input, lowest, highest, weight, op): a caller's integer input that indexes a weight's rows
    # (``aot.values.value_bounds``), checked on every call as by the torch loader
    value_bounds: tuple[tuple[str, int, int, str, str], ...] = ()


def _static_shapes(program: Program) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, where every dim is a number."""
    return {
        w.name: tuple(map(int, w.spec.shape))
        for w in program.weights
        if all(d.isdigit() for d in w.spec.shape)
    }


class Checked:
    """A verified bundle the runtime can run (module docstring); no device touched yet."""

    def __init__(self, bundle: Bundle, max_memory: int | None = None):
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.program = bundle.program()
        programs = (self.program, *self.program.variants)
        if self.manifest.programs:
            if len(self.manifest.programs) != len(programs):
                raise BundleError(
                    f"{bundle.path}: the manifest lists {len(self.manifest.programs)} programs, "
                    f"the program member holds {len(programs)}"
                )
            heads = [(e.name, e.guards, e.buckets, e.entry) for e in self.manifest.programs]
        else:
            if len(programs) != 1:
                raise BundleError(f"{bundle.path}: {len(programs)} programs but the manifest has no guards")
            heads = [("general", self.manifest.guards, self.manifest.buckets, "")]
        check_plan(self.manifest, self.program, bundle.path)
        # checked wherever the bundle opens, as the torch loader checks it; applied by ``plans``
        self.tuning = read_tuning(bundle, programs, [head[2] for head in heads])
        self.guards = GuardCore(self.manifest.guards, ITEMSIZE)
        self.state = StateLayout(state_specs(self.manifest.guards, ITEMSIZE, str(bundle.path)))
        self.entries: list[Entry] = []
        self.scratch: dict[str, tuple[int, ...]] = {}  # every program's ``Program.scratch``, at its largest
        for index, ((name, guards, buckets, entry_point), program) in enumerate(zip(heads, programs)):
            where = f"{bundle.path}: program {name!r}"
            steps = live_steps(program)
            check_library_free(program, steps, where)
            tuned = tuned_plans(self.tuning, index, program, self.tuning.arch) if self.tuning else {}
            for key, plan in tuned.items():
                check_library_free(program, live_steps(replace(program, steps=plan)), f"{where} at {key}")
            if max_memory is not None:  # a tuned plan's buffers count too
                for plan in {id(p): p for p in (program.steps, *tuned.values())}.values():
                    peak, sizes = planned_peak(replace(program, steps=plan), guards, cpu=False)
                    check_max_memory(peak, sizes, max_memory, name)
            core = self.guards if len(heads) == 1 else GuardCore(guards, ITEMSIZE)
            if core.names != self.guards.names:
                raise BundleError(
                    f"{where} takes inputs {list(core.names)[:8]}, the bundle {list(self.guards.names)[:8]}"
                )
            if set(program.state) != set(self.state.specs):
                raise BundleError(
                    f"{where} declares state {sorted(program.state)[:8]}, the bundle's guards "
                    f"{sorted(self.state.specs)[:8]}"
                )
            shapes = {n: sp.shape for n, sp in self.state.specs.items()}
            for name, shape in scratch_shapes(program).items():
                # programs share a name's memory (each kernel indexes only what its grid covers)
                self.scratch[name] = max(self.scratch.get(name, (0,)), shape, key=math.prod)
            self.entries.append(
                Entry(
                    name,
                    program,
                    core,
                    tuple(buckets),
                    steps,
                    entry_point,
                    index_bounds(program, shapes),
                    state_writes(program, steps),
                    value_bounds(program, _static_shapes(program)),
                )
            )

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.guards.names

    def plans(self, arch: str) -> dict[str, dict[tuple[int, ...], tuple[Step, ...]]]:
        """Program name -> bucket key (``aot.tuning.bucket_key``) -> the live steps a call exactly
        at that bucket runs on a GPU of ``arch`` (``sm_90``), where the tuning table chose forms
        there (``aot.tuning.tuned_plans``: empty unless the table was made for ``arch``); every
        other call runs ``Entry.steps``."""
        out: dict[str, dict[tuple[int, ...], tuple[Step, ...]]] = {}
        for index, entry in enumerate(self.entries):
            shared: dict[int, tuple[Step, ...]] = {}  # buckets with the same choices share a plan
            plans = tuned_plans(self.tuning, index, entry.program, arch)
            for plan in plans.values():
                if id(plan) not in shared:
                    shared[id(plan)] = live_steps(replace(entry.program, steps=plan))
            out[entry.name] = {key: shared[id(plan)] for key, plan in plans.items()}
        return out

    def arrays(
        self, args: Sequence[Any], kwargs: dict[str, Any], stream: int | None = None
    ) -> list[ArrayView]:
        """The call's inputs in the bundle's order, as ``ArrayView``s (DLPack, or a NumPy array)."""
        kwargs = (
            flatten_inputs(kwargs, self.guards.names) if any("." in n for n in self.guards.names) else kwargs
        )
        values = self.guards.bind(args, dict(kwargs))
        return [from_dlpack(v, name, stream) for v, name in zip(values, self.guards.names)]

    @property
    def entry_points(self) -> tuple[str, ...]:
        """The bundle's named entry points ("prefill", "decode"), in declaration order."""
        return tuple(dict.fromkeys(e.entry for e in self.entries if e.entry))

    def bind(
        self, views: Sequence[ArrayView], entry_point: str | None = None
    ) -> tuple[Entry, dict[str, int]]:
        """The first program (of ``entry_point``'s, when given) whose guards admit ``views``, and
        the symbols' values. ``GuardError`` (the first program's text) when none does."""
        if entry_point is not None and entry_point not in self.entry_points:
            raise GuardError(
                f"the bundle has no entry point {str(entry_point)[:40]!r}; its entry points are "
                f"{list(self.entry_points) or '(none: call the runner itself)'}"
            )
        first: GuardError | None = None
        for entry in self.entries:
            if entry_point is not None and entry.entry != entry_point:
                continue
            try:
                return entry, check_views(entry.guards, views)
            except GuardError as e:
                first = first or e
        assert first is not None
        raise first


def check_views(guards: GuardCore, views: Sequence[ArrayView]) -> dict[str, int]:
    """``GuardCore``'s checks on arrays: dtype and rank here, dims and relations shared."""
    sizes: dict[str, int] = {}
    where: dict[str, tuple[str, int]] = {}
    for (name, _, dtype_name, dims), view in zip(guards.inputs, views):
        if view.dtype != dtype_name:
            raise GuardError(f"input {name!r}: expected dtype {dtype_name}, got {view.dtype}")
        if len(view.shape) != len(dims):
            raise GuardError(
                f"input {name!r}: expected rank {len(dims)} [{', '.join(map(str, dims))}], "
                f"got rank {len(view.shape)} {list(view.shape)}"
            )
        guards.bind_dims(name, dims, view.shape, sizes, where)
        if not view.contiguous and view.rows is None:
            raise GuardError(
                f"input {name!r}: expected a contiguous (row-major) array or rows of one at a constant "
                f"pitch (x[:, :n]), got shape {list(view.shape)} strides {list(view.strides)}; pass a "
                f"contiguous copy"
            )
    guards.check_relations(sizes)
    return sizes


def state_writes(program: Program, steps: Sequence[Step]) -> dict[str, str]:
    """Each result of a state write (``aot.allowed_ops.STATE_WRITE_OPS``, as an ATen step or as a
    kernel's reference) -> the state it writes in place: the runtime places it at the state's
    address, never in the arena."""
    out: dict[str, str] = {}
    state = set(program.state)
    for step in steps:
        writes = step.reference if step.kind == StepKind.KERNEL else (step,)
        for ref in writes:
            if ref.target not in STATE_WRITE_OPS or not ref.args or not isinstance(ref.args[0], Buf):
                continue
            target = out.get(ref.args[0].name, ref.args[0].name)
            if target in state:  # the write's own results only: a kernel's other outputs are its own
                out.update((o, target) for o in ref.outputs if o and o not in state)
        for result, written in step.in_place.items():  # a kernel's declared in-place writes
            target = out.get(written, written)
            if target in state and result not in state:
                out[result] = target
    return out


def packed(nbytes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Buffers of ``nbytes`` (bytes, by name) one after the other in one allocation, each at a
    multiple of ``ALIGN``: (offset in bytes by name, size)."""
    offsets, size = {}, 0
    for name, n in nbytes.items():
        offsets[name] = size
        size += -(-n // ALIGN) * ALIGN
    return offsets, size


def scratch_layout(scratch: dict[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    """The scratch buffers (``Checked.scratch``: int32 arrival counters, ``aot.program.check_scratch``)
    in one device allocation, which the runner zeroes once: (offset in bytes by name, size)."""
    return packed({name: math.prod(shape) * ITEMSIZE["int32"] for name, shape in scratch.items()})


class StateLayout:
    """The bundle's state tensors (``aot.state.state_specs``, at their largest) in one device
    allocation: ``offsets`` (bytes), ``size``; ``rows``: the batch rows a reset may name."""

    def __init__(self, specs: dict[str, StateSpec]):
        self.specs = specs
        self.offsets, self.size = packed({name: self.nbytes(name) for name in specs})
        self.rows = max((spec.shape[0] for spec in specs.values()), default=0)

    def nbytes(self, name: str) -> int:
        spec = self.specs[name]
        n = ITEMSIZE[spec.dtype]
        for s in spec.shape:
            n *= s
        return n

    def spans(self, rows: int | Sequence[int] | None = None) -> list[tuple[int, int]]:
        """(offset, bytes) to zero for a reset of every row (``None``) or of the given batch rows
        (a state without a batch dim is shared by every row: all of it); ``GuardError`` for a row
        outside ``0..rows-1``."""
        if rows is None:
            return [(0, self.size)] if self.size else []
        picked = [rows] if isinstance(rows, int) else list(rows)
        bad = [r for r in picked if type(r) is not int or not 0 <= r < self.rows]
        if bad:
            raise GuardError(
                f"reset rows must be ints in 0..{self.rows - 1} (the state's batch rows), got {bad[:4]}"
            )
        out = []
        for name, spec in self.specs.items():
            if spec.batch is None:
                if picked:
                    out.append((self.offsets[name], self.nbytes(name)))
                continue
            row = self.nbytes(name) // spec.shape[0]
            out += [(self.offsets[name] + r * row, row) for r in sorted(set(picked))]
        return out


class TailLayout:
    """The buffers the steps from ``start`` on write (``aot.program.output_tail``: the outputs'
    last computation), placed in each call's own allocation of ``size`` bytes: ``places`` (bytes
    from its start; views at their base's place plus their offset)."""

    def __init__(self, start: int, places: dict[str, int], size: int):
        self.start, self.places, self.size = start, places, size


class ArenaLayout:
    """Every buffer of ``steps`` at ``sizes`` placed in one allocation: ``offsets`` (bytes from the
    arena's start; inputs included, so a CUDA graph's static inputs live there too), ``size``.
    Buffers whose lifetimes do not overlap share bytes (first fit, in order of birth); a view sits
    at its base's offset (``aot.program.aliases``); weights are not here (``base`` names them).
    ``tail_start``: the steps from there on write into each call's own memory (``tail``), not the
    arena, which then keeps only what they read alive to the end."""

    def __init__(
        self,
        program: Program,
        steps: tuple[Step, ...],
        sizes: dict[str, int],
        weights: set[str],
        tail_start: int | None = None,
    ):
        specs = {i.name: i.spec for i in program.inputs} | dict(program.buffers)
        self.views = aliases(program, steps)  # view -> where its elements are (``aot.program.Alias``)
        head, kept = steps, program.outputs
        if tail_start is not None:
            head = steps[:tail_start]
            written = {w for step in head for w in step_writes(step)}
            kept = tuple(
                dict.fromkeys(r for step in steps[tail_start:] for r in step_reads(step) if r in written)
            )
        plan = Program(
            inputs=program.inputs,
            weights=program.weights,
            buffers=program.buffers,
            steps=head,
            outputs=kept,
            symbols=program.symbols,
        )
        spans = [(i.name, -1, len(head)) for i in program.inputs] + lifetimes(plan)
        self.nbytes: dict[str, int] = {}
        placed: list[tuple[int, int, int]] = []  # (offset, end, last step)
        self.offsets: dict[str, int] = {}
        size = 0
        for name, born, last in sorted(spans, key=lambda s: s[1]):
            if name in weights or name in self.views:
                continue
            n = _bytes(specs[name], sizes)
            self.nbytes[name] = n
            live = sorted((o, e) for o, e, end in placed if end >= born)
            offset = 0
            for o, e in live:
                if offset + n <= o:
                    break
                offset = max(offset, -(-e // ALIGN) * ALIGN)
            placed.append((offset, offset + n, last))
            self.offsets[name] = offset
            size = max(size, offset + n)
        self.size = -(-size // ALIGN) * ALIGN
        self.tail: TailLayout | None = None
        if tail_start is not None:
            places: dict[str, int] = {}
            end = 0
            for step in steps[tail_start:]:
                for name in step_writes(step):
                    if name and name not in self.views and name not in places:
                        places[name] = end
                        end += -(-_bytes(specs[name], sizes) // ALIGN) * ALIGN
            for name, alias in self.views.items():
                if alias.base in places:
                    places[name] = places[alias.base] + alias.offset * ITEMSIZE[specs[name].dtype]
            self.tail = TailLayout(tail_start, places, end)


def _bytes(spec, sizes: dict[str, int]) -> int:
    n = ITEMSIZE[spec.dtype]
    for s in spec.shape:
        n *= compile_expr(s)(sizes)
    return n


def tail_start(
    program: Program, steps: tuple[Step, ...], sizes: dict[str, int], min_bytes: int
) -> int | None:
    """Where the steps that only compute the outputs begin (``aot.program.output_tail``), when the
    outputs come to ``min_bytes`` or more at ``sizes`` and the program keeps no state (a stateful
    call's outputs are one step's logits, as the torch loader's rule has it); else None."""
    specs = [program.buffers.get(o) for o in program.outputs]
    if (
        program.state
        or any(spec is None for spec in specs)
        or sum(_bytes(s, sizes) for s in specs) < min_bytes
    ):
        return None
    return output_tail(steps, program.outputs)


def check_bundle(
    path: str | os.PathLike, trust: Sequence[str | os.PathLike] | None = None, max_memory: int | None = None
) -> Checked:
    """Open, verify and check ``path`` for the runtime (module docstring); no device needed."""
    return Checked(open_bundle(path, trusted_keys(trust)), max_memory)
