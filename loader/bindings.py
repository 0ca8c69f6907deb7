"""Direct bindings: a CUDA graph's kernels pointed at the caller's own input and output tensors,
so that a call copies nothing into or out of the graph's static buffers.

A replay without them copies each input into its static buffer before the graph and each output
out of the pool after it: on an H200 (torch 2.11) the example mlp's batch-1 call spent about 12 µs
of host time enqueueing those two copies, and the GPU ran each as a node of its own between the
graphs (``bench/results/host``). TensorRT's ``enqueueV3`` binds the caller's addresses instead;
so does this, through ``cuGraphExecKernelNodeSetParams``, which changes a kernel node's arguments
for the graph's later launches only (launches already enqueued keep theirs).

While a bucket's graph is captured, ``Recorder`` keeps every kernel launch of ours (its node, its
arguments) and the address ranges each library call touched that enqueued GPU work. A buffer
binds where every reader and writer of its memory is a kernel of ours:

- an input: its static buffer lives outside the graph's pool, so every pointer argument into its
  range is an alias of it (a view at an offset); none of them may be written, and no library call
  (cuBLAS, an ATen kernel, a layout copy a kernel step made) may touch the range;
- an output: the tensor must cover its storage exactly, which a kernel of ours allocated; from that
  launch on (earlier launches used the memory for buffers that died before it) every pointer into
  the range is an alias, and no library call after it may touch the range;

and an input binds where at most ``MAX_INPUT_NODES`` nodes read it (re-pointing a node costs the
host about what copying a small input does). A call binds a tensor where it has the static
buffer's shape, dtype and device, is dense, and starts on a ``ALIGNMENT``-byte boundary (the
cubins were specialized so); anything else (a padded bucket, a strided view, an output given that
overlaps an input) is copied as before, and the nodes it bound last point back at the static
buffer. Arguments are changed only where they differ from the graph's current ones.

**Off by default** (``DIRECT_BINDING_ENV=1`` at load binds): measured slower than the copies on
an H200 (torch 2.11, driver 580; ``bench/host_path.py --ab``, ``bench/call_probe.py``, one process,
10 alternating rounds; ``bench/results/host``). The driver's change of a node's arguments took
2.9-6.2 µs of the host's, about what the driver's copy of a small input takes, and the GPU's copy
node it saves is short; so a call bringing a tensor of its own (a server's case) was slower bound:
the mlp 107 against 88 µs with its input bound (two nodes read it), gpt at one token 250.8
against 242.3 and the cnn 202.1 against 196.0 with one node each; with the same input tensor every
call (nothing to change) bound calls won 1-3 µs (gpt 238.8 against 241.9, cnn 194.4 against
195.7). The next call's outputs pointed at right after a launch (the change off the critical path)
made the mlp slower still (91.5 against 81.7 µs): the change seemed to wait for the graph's running
launch. Kept for callers whose buffers stay put (a serving engine's registered input regions), and
for a driver whose change is cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aot.errors import EnvError
from aot.loader.cuda import ALIGNMENT, Function, Graph, capture_tail, pack_params
from aot.loader.program import storage_span
from aot.settings import setting

DIRECT_BINDING_ENV = "AOTPACK_DIRECT_BINDING"
# An input binds where at most this many kernel nodes read it: re-pointing a node took 2.9-6.2 µs
# of the host's on an H200, about what the driver's copy of a small input takes, so an input
# several nodes read (the example mlp's: its LayerNorm and its residual add) costs more to
# re-point, when a call brings a tensor of its own, than to copy (107 against 88 µs a call).
MAX_INPUT_NODES = 1


def enabled() -> bool:
    """Off unless ``DIRECT_BINDING_ENV`` is ``1`` (the module docstring says why)."""
    return setting(DIRECT_BINDING_ENV, "0", ("0", "1")) == "1"


@dataclass
class Launch:
    """One kernel node of a captured graph: what it was launched with. ``values``: its arguments
    as ``pack_params`` takes them, the pointers re-pointed per call; ``writes``: the indices of
    the arguments it writes; ``fresh``: those whose buffer was allocated for this launch."""

    node: int
    fn: Function | None  # None in tests of the binding rules
    grid: tuple[int, int, int]
    values: list[tuple[str, int]]
    writes: frozenset[int] = frozenset()
    fresh: frozenset[int] = frozenset()
    seq: int = 0  # the step's place among the recorded launches and library calls
    # ``values`` packed once (packing took 9.4 µs of the host's on an H200, the driver's change
    # 2.9); a re-pointed argument is written into its packed value
    packed: Any = None
    storage: list | None = None


@dataclass(frozen=True)
class Slot:
    launch: int  # index into the recorded launches
    arg: int  # index into its arguments
    offset: int  # bytes from the buffer's start


@dataclass
class Recorder:
    """Collects a capture's launches (``kernel``) and library calls (``library``) in order;
    ``ok`` turns False where a launch's node cannot be told (no bindings for that graph)."""

    stream: int
    launches: list[Launch] = field(default_factory=list)
    library_ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, start, end)
    ok: bool = True
    _seq: int = 0

    def tail(self) -> int | None:
        return capture_tail(self.stream)

    def kernel(
        self,
        fn: Function,
        launched: tuple[tuple[int, int, int], list, tuple[int, ...], tuple[int, ...], list],
        before: int | None,
    ) -> None:
        """A kernel step's launch: (grid, argument values, written and fresh argument indices,
        ranges a layout copy read); ``before``: the capture's tail before the step."""
        self._seq += 1
        grid, values, writes, fresh, copied = launched
        for start, end in copied:  # torch copied these for the kernel: a library read
            self.library_ranges.append((self._seq, start, end))
        node = self.tail()
        if not node or node == before:
            self.ok = False
            return
        self.launches.append(
            Launch(node, fn, grid, list(values), frozenset(writes), frozenset(fresh), self._seq)
        )

    def library(self, before: int | None, ranges: list[tuple[int, int]]) -> None:
        """A library step, which touched ``ranges``; it enqueued work where the capture's tail moved."""
        self._seq += 1
        after = self.tail()
        if after is not None and after == before:
            return  # a view or other metadata: no node
        self.library_ranges.extend((self._seq, start, end) for start, end in ranges)


def overlaps(start: int, end: int, other_start: int, other_end: int) -> bool:
    return start < other_end and other_start < end


def _aliases(launches: list[Launch], start: int, end: int, first: int = 0) -> tuple[Slot, ...]:
    """Every pointer argument into ``[start, end)`` of the launches from ``first`` on."""
    return tuple(
        Slot(i, j, value - start)
        for i in range(first, len(launches))
        for j, (kind, value) in enumerate(launches[i].values)
        if kind == "ptr" and start <= value < end
    )


def input_slots(
    launches: list[Launch], library: list[tuple[int, int, int]], start: int, end: int
) -> tuple[Slot, ...] | None:
    """The arguments to re-point for an input whose static buffer is ``[start, end)``; None where
    it cannot bind (a library call touches it, or a kernel writes it)."""
    if any(overlaps(start, end, s, e) for _, s, e in library):
        return None
    slots = _aliases(launches, start, end)
    if any(s.arg in launches[s.launch].writes for s in slots):
        return None
    return slots


def output_slots(
    launches: list[Launch], library: list[tuple[int, int, int]], start: int, end: int
) -> tuple[Slot, ...] | None:
    """The arguments to re-point for an output whose storage is ``[start, end)``; None where it
    cannot bind (no kernel of ours allocated it, or a library call touches it after that)."""
    made = [i for i, launch in enumerate(launches) if any(launch.values[j][1] == start for j in launch.fresh)]
    if not made:
        return None
    first = made[-1]  # the storage's last allocation: the output's own (it is live to the end)
    since = launches[first].seq
    if any(seq >= since and overlaps(start, end, s, e) for seq, s, e in library):
        return None
    return _aliases(launches, start, end, first)


def _whole(t: Any) -> bool:
    """Whether ``t`` is dense and covers its storage exactly."""
    return (
        t.numel() > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def fits(static: Any, given: Any) -> bool:
    """Whether the caller's ``given`` can stand for the graph's ``static`` buffer."""
    return (
        given.shape == static.shape
        and given.dtype == static.dtype
        and given.device == static.device
        and given.is_contiguous()
        and given.data_ptr() % ALIGNMENT == 0
    )


class Bindings:
    """A captured graph's bindable inputs (by name) and outputs (by index), and the per-call
    re-pointing of its kernel nodes (``point``)."""

    def __init__(
        self,
        launches: list[Launch],
        inputs: dict[str, tuple[Any, tuple[Slot, ...]]],
        outputs: dict[int, tuple[Any, tuple[Slot, ...]]],
    ):
        self.launches = launches
        self.inputs = inputs  # name -> (static buffer, slots)
        self.outputs = outputs  # index -> (static buffer, slots)

    @classmethod
    def of(
        cls,
        recorder: Recorder,
        graph: Graph,
        inputs: dict[str, Any],
        outputs: list[Any] | None,
    ) -> Bindings | None:
        """What the capture ``recorder`` saw allows to bind, among the bucket's static ``inputs``
        and its ``outputs`` (None: none of them, as where its outputs are computed after the
        graph); None where nothing binds or the driver cannot change the graph's kernel nodes."""
        if not recorder.ok or not recorder.launches:
            return None
        launches, library = recorder.launches, recorder.library_ranges
        bound_in: dict[str, tuple[Any, tuple[Slot, ...]]] = {}
        for name, static in inputs.items():
            if static.numel() == 0:
                continue
            slots = input_slots(launches, library, *storage_span(static))
            if slots is not None and len({s.launch for s in slots}) <= MAX_INPUT_NODES:
                bound_in[name] = (static, slots)
        bound_out: dict[int, tuple[Any, tuple[Slot, ...]]] = {}
        taken: list[tuple[int, int]] = [storage_span(static) for static, _ in bound_in.values()]
        for i, result in enumerate(outputs or ()):
            if not _whole(result):
                continue
            start, end = storage_span(result)
            if any(overlaps(start, end, s, e) for s, e in taken):
                continue  # an input, or another output's memory: copied
            slots = output_slots(launches, library, start, end)
            if slots:
                bound_out[i] = (result, slots)
                taken.append((start, end))
        if not bound_in and not bound_out:
            return None
        bound = sorted({s.launch for _, slots in (*bound_in.values(), *bound_out.values()) for s in slots})
        for i in bound:  # the launches ``point`` changes, packed once
            launches[i].packed, launches[i].storage = pack_params(launches[i].values)
        # the driver must take a kernel node's arguments back as they were launched
        if bound and not _set(graph, launches[bound[0]]):
            return None
        return cls(launches, bound_in, bound_out)

    def point(self, graph: Graph, given: dict[Any, Any]) -> None:
        """Point the graph's nodes at ``given`` (``("in", name)`` or ``("out", index)`` -> the
        caller's tensor) and every other bound buffer at its static one."""
        dirty: set[int] = set()
        for key, (static, slots) in (
            *((("in", n), v) for n, v in self.inputs.items()),
            *((("out", i), v) for i, v in self.outputs.items()),
        ):
            target = given.get(key)
            base = (target if target is not None else static).data_ptr()
            for slot in slots:
                launch = self.launches[slot.launch]
                if launch.values[slot.arg][1] != base + slot.offset:
                    launch.values[slot.arg] = ("ptr", base + slot.offset)
                    launch.storage[slot.arg].value = base + slot.offset
                    dirty.add(slot.launch)
        for i in sorted(dirty):
            if not _set(graph, self.launches[i]):
                raise EnvError(
                    f"the CUDA driver refused to re-point kernel {self.launches[i].fn.name} of a captured graph "
                    f"at a call's tensors; set {DIRECT_BINDING_ENV}=0 to copy them instead, and report it"
                )


def _set(graph: Graph, launch: Launch) -> bool:
    return graph.set_kernel_args(launch.node, launch.fn, launch.grid, launch.packed)
