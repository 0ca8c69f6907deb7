"""Run a library-free bundle on the CUDA driver alone: ``load(path) -> Runner``, ``runner(**inputs)``.

Memory: one device allocation holds every weight (each at a multiple of ``ALIGN`` bytes, streamed
from the checked safetensors bytes straight into place: ``aot.runtime.weights``, beside the
cubins' loading), one the state (a KV cache) and one the kernels' scratch (``Program.scratch``),
both zeroed at load, and one holds the activation arena (``aot.runtime.plan.ArenaLayout``), allocated by
the first call and grown when a later call needs more (a server that wants no growth loads with
``arena="largest"``: sized for the largest bucket). A call checks its arrays against the guards
(and its index inputs' values: ``aot.runtime.calls``), copies them into the arena, runs the
program's kernels and driver copies at its sizes (``calls.Prepared``, made once per program and
sizes) — as a CUDA graph captured with the driver API when every symbol sits exactly on a bucket,
else launch by launch — and returns each output as a ``DeviceArray`` in memory of its own (a
block ``driver.Device.take`` hands out, kept for later outputs when the array goes), which the
caller owns: a later call never overwrites it.

A call exactly at a bucket runs the bucket's tuned plan where the bundle's tuning table chose forms
there (``Checked.plans``: a library-free build's one-row GEMV forms), as the torch loader does; a
call off the buckets runs the program's steps at its own sizes (the runtime pads no dim; the torch
loader runs a paddable dim padded to its bucket, with that bucket's plan).
Large outputs are computed after the graph straight into the caller's memory, as the torch loader
computes them (``aot.program.output_tail``: where a call's outputs come to ``TAIL_MIN_BYTES`` or
more and the program's last steps only compute them, gpt's logits): the arena then holds no output
(gpt at batch 8 x seq 128: 98 MiB of logits), and no copy of them is made per call (a slice of
wider rows, gpt's logits cut from their padded GEMM, is handed out as a strided ``DeviceArray``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from aot import schema
from aot.archs import arch_of
from aot.dtypes import ITEMSIZE
from aot.errors import BundleError, EnvError, GuardError
from aot.program import TAIL_MIN_BYTES, tensor_specs
from aot.pytree import unflatten
from aot.runtime import driver as drv
from aot.runtime.arrays import (
    CPU,
    CUDA,
    DTYPES,
    ArrayView,
    DeviceArray,
    array_bytes,
    from_bytes,
    from_dlpack,
    strides_at_pitch,
)
from aot.runtime.calls import Prepared, bucket_keys, check_slots, check_values
from aot.runtime.plan import ArenaLayout, Checked, Entry, check_bundle, scratch_layout, tail_start
from aot.runtime.weights import Upload
from aot.schema import StepKind
from aot.tuning import bucket_key

ARENA_MODES = ("lazy", "largest")


def pick_arch(archs: Sequence[str], capability: tuple[int, int]) -> str:
    """The cubin arch for a device: exact, else the newest of the same major not above its minor."""
    major, minor = capability
    exact = f"sm_{major}{minor}"
    if exact in archs:
        return exact
    same = sorted(
        (a for a in archs if a[3:].isdigit() and int(a[3:-1]) == major and int(a[-1]) <= minor),
        key=lambda a: int(a[3:]),
    )
    if not same:
        raise EnvError(
            f"this GPU is {exact}, the bundle has cubins for {', '.join(archs) or 'no arch'}; "
            f"rebuild with --arch {','.join([*archs, exact])}"
        )
    return same[-1]


class _Memory:
    """A block of device memory (``driver.Device.take``), given back when the last array over it goes."""

    __slots__ = ("ptr", "size", "device")

    def __init__(self, device: drv.Device, nbytes: int):
        self.device = device
        self.ptr, self.size = device.take(nbytes)

    def __del__(self):
        self.device.give(self.ptr, self.size)


class Runner:
    """A bundle loaded on a GPU without torch; callable like the model (module docstring)."""

    def __init__(
        self,
        checked: Checked,
        device: int | drv.Device = 0,
        graphs: bool = True,
        arena: str = "lazy",
    ):
        """``device``: a GPU ordinal, or a ``driver.Device`` made already."""
        if arena not in ARENA_MODES:
            raise ValueError(f"arena must be one of {ARENA_MODES}, got {arena!r}")
        mark = time.perf_counter()
        self.timings: dict[str, float] = {}  # seconds of each load phase
        self.checked = checked
        self.manifest = checked.manifest
        self.gpu = drv.Device(device) if isinstance(device, int) else device
        self.gpu.bind()
        free, total = self.gpu.memory()
        self.context_bytes = total - free  # the device's used bytes before the bundle takes any
        self.timings["context_s"], mark = time.perf_counter() - mark, time.perf_counter()
        self.graphs = graphs
        self._lock = threading.Lock()
        env = self.manifest.environment
        self.arch = pick_arch(tuple(env.archs), self.gpu.capability)
        built = env.cuda_built.get(self.arch, "")
        if built.split(".")[0].isdigit() and self.gpu.driver_version // 1000 < int(built.split(".")[0]):
            raise EnvError(
                f"the bundle's kernels were compiled for CUDA {built}; this driver supports CUDA "
                f"{self.gpu.driver_version // 1000}.{self.gpu.driver_version % 1000 // 10}: update the NVIDIA driver"
            )
        self.records = {k.id: k for e in checked.entries for k in e.program.kernels}
        # per program, bucket key -> the steps a call at that bucket runs on this GPU's arch (a
        # tuning table's forms: the torch loader's ``tuned_plans``, applied where it applies them)
        self.plans = checked.plans(arch_of(self.gpu.capability))
        used = {
            s.target
            for steps in [
                *(e.steps for e in checked.entries),
                *(p for plans in self.plans.values() for p in plans.values()),
            ]
            for s in steps
            if s.kind == StepKind.KERNEL
        }
        self.kernels = {}
        # the weights stream in a thread of their own while the cubins load here: reading, hashing
        # and the driver's module loads all let go of the GIL
        upload = Upload(self.gpu, checked, self.plans)
        try:
            self._load_kernels(sorted(used))
        finally:
            self.timings["kernels_s"], mark = time.perf_counter() - mark, time.perf_counter()
            upload.join()
        weights = upload.result()
        self.weights_stream_s = upload.seconds  # beside the kernels' loading
        # one allocation (``weights_bytes`` at ``weights_base``), each weight at its offset there
        self.weights_base, self.weights_bytes = weights.base, weights.nbytes
        self.weight_offsets = weights.offsets
        self.weights = set(self.weight_offsets)
        # the state (a KV cache): one allocation, zeroed, at its largest batch; calls update it in place
        state = checked.state
        self.state_offsets = dict(state.offsets)
        self.state_writes = {k: v for e in checked.entries for k, v in (e.state_writes or {}).items()}
        self.state_base = self.gpu.alloc(state.size) if state.size else 0
        if state.size:
            self.gpu.zero(self.state_base, state.size)
        # the kernels' scratch (arrival counters): one allocation, zeroed once; every kernel that
        # counts on it leaves it zeroed, so each call finds it so
        self.scratch_offsets, scratch_size = scratch_layout(checked.scratch)
        self.scratch_base = self.gpu.alloc(scratch_size) if scratch_size else 0
        if scratch_size:
            self.gpu.zero(self.scratch_base, scratch_size)
        self.itemsize = {
            name: ITEMSIZE[spec.dtype]
            for e in checked.entries
            for name, spec in tensor_specs(e.program).items()
        }
        self.timings["weights_s"] = time.perf_counter() - mark  # waited for them, and the state
        free, total = self.gpu.memory()
        # device bytes the load took beyond the context: the weights' and the state's allocations,
        # and what the driver took for the cubins' modules
        self.loaded_bytes = total - free - self.context_bytes
        # the arena: allocated on the first call and grown when a call needs more (every plan and
        # graph then made again); ``arena="largest"`` sizes it at load for the largest bucket
        self._prepared: dict[tuple, Prepared] = {}
        self._readback: Any = None  # generate's page-locked token buffers (``generate.readback``)
        self.arena_bytes, self.arena = 0, 0
        if arena == "largest":
            for entry in checked.entries:
                keys = bucket_keys(entry)
                if keys:
                    sizes = dict(zip([b.symbol for b in entry.buckets], keys[0]))
                    self._prepare(entry, sizes)
        self._done = self.gpu.event()  # recorded after each call's output copies
        self.gpu.synchronize()

    def _load_kernels(self, ids: list[str]) -> None:
        """Each kernel's cubin for this GPU's arch, loaded as a driver module."""
        bundle = self.checked.bundle
        for kid in ids:
            record = self.records.get(kid)
            if record is None:
                raise BundleError(f"{bundle.path}: a step launches unknown kernel {kid[:40]!r}")
            if self.arch not in record.archs:
                raise EnvError(
                    f"kernel {record.name} has no cubin for {self.arch} (it has {', '.join(record.archs)})"
                )
            cubin = bundle.read(schema.KERNEL_CUBIN_FORMAT.format(kernel=kid, arch=self.arch))
            dependent = self.arch in record.dependent_launch and self.gpu.dependent_launch
            self.kernels[kid] = drv.Kernel(
                cubin, record.name, int(record.shared.get(self.arch, 0)), record.num_warps, dependent
            )

    def address(self, name: str, layout: ArenaLayout) -> int:
        alias = layout.views.get(name)
        base, offset = (alias.base, alias.offset * self.itemsize[name]) if alias else (name, 0)
        base = self.state_writes.get(base, base)
        if base in self.weight_offsets:
            return self.weights_base + self.weight_offsets[base] + offset
        if base in self.state_offsets:
            return self.state_base + self.state_offsets[base] + offset
        if base in self.scratch_offsets:
            return self.scratch_base + self.scratch_offsets[base] + offset
        return self.arena + layout.offsets[base] + offset

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.checked.input_names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(args, kwargs)

    @property
    def entry_points(self) -> tuple[str, ...]:
        return self.checked.entry_points

    @property
    def state_names(self) -> tuple[str, ...]:
        """The runner-owned state tensors (a KV cache), by name."""
        return tuple(self.checked.state.specs)

    def entry(self, name: str) -> Any:
        """The entry point ``name`` as a callable (``runner.entry("decode")(input_ids=...)``)."""
        if name not in self.entry_points:
            raise GuardError(
                f"the bundle has no entry point {str(name)[:40]!r}; its entry points are "
                f"{list(self.entry_points) or '(none: call the runner itself)'}"
            )

        def call(*args: Any, numpy: bool = False, **kwargs: Any) -> Any:
            return self.run(args, kwargs, numpy=numpy, entry_point=name)

        return call

    def reset(self, rows: int | Sequence[int] | None = None) -> None:
        """Zero the state: every row, or the given batch rows, before new sequences use it."""
        spans = self.checked.state.spans(rows)
        with self._lock:
            self.gpu.bind()
            for offset, nbytes in spans:
                self.gpu.zero(self.state_base + offset, nbytes)

    def generate(self, prompt_ids: Any, max_new_tokens: int, **options: Any) -> Any:
        """Greedy tokens after each prompt with a causal-LM bundle (``aot.runtime.generate``)."""
        from aot.runtime.generate import generate

        return generate(self, prompt_ids, max_new_tokens, **options)

    def run(
        self,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        numpy: bool = False,
        entry_point: str | None = None,
    ) -> Any:
        """One call: outputs as ``DeviceArray``s in the model's structure, NumPy arrays with
        ``numpy``; ``entry_point``: run one of that entry point's programs."""
        self.gpu.bind()
        views = self.checked.arrays(args, dict(kwargs or {}), self.gpu.stream_handle)
        return self.run_views(views, numpy, entry_point)

    def run_views(
        self,
        views: Sequence[ArrayView],
        numpy: bool = False,
        entry_point: str | None = None,
        check_indices=True,
    ) -> Any:
        """``run`` on inputs already taken as ``ArrayView``s, in the bundle's input order."""
        entry, sizes = self.checked.bind(views, entry_point)
        if check_indices and (entry.index_bounds or entry.value_bounds):
            named = dict(zip(self.checked.input_names, views))
            check_slots(entry.index_bounds, named, self.gpu)
            check_values(entry.value_bounds, named, self.gpu)
        with self._lock:
            prepared = self._prepare(entry, sizes)
            for view, (name, address) in zip(views, prepared.inputs):
                self._copy_in(view, address, name)
            if prepared.graph is None and self.graphs and prepared.on_bucket:
                prepared.graph = self.gpu.capture(lambda: prepared.launch(self.gpu))
            if prepared.graph is not None:
                self.gpu.replay(prepared.graph[1])
            else:
                prepared.launch(self.gpu)
            tail = None
            if prepared.tail_bytes:  # the outputs' last steps, into memory the caller owns
                tail = _Memory(self.gpu, prepared.tail_bytes)
                prepared.launch_tail(self.gpu, tail.ptr)
            outputs = []  # (memory the array keeps alive, its address, dtype, shape, strides)
            done = self._done  # re-recorded by later calls: waiting on it then waits a little longer
            for (kind, at), dtype, shape, nbytes, rows in prepared.outputs:
                address = tail.ptr + at if kind == "tail" else at
                if kind == "tail":  # the caller's already: no copy (rows apart: a strided array)
                    strides = (
                        strides_at_pitch(shape, rows[1] // ITEMSIZE[dtype]) if rows is not None else None
                    )
                    outputs.append((tail, address, dtype, shape, strides))
                    continue
                memory = _Memory(self.gpu, nbytes)
                if rows is None:
                    self.gpu.copy(memory.ptr, address, nbytes)
                else:  # rows apart in the arena (a slice of the last dim): packed by a 2-D copy
                    self.gpu.copy_rows(memory.ptr, address, rows[0], rows[1], nbytes // max(rows[0], 1))
                outputs.append((memory, memory.ptr, dtype, shape, None))
            self.gpu.record(done)
        gpu = self.gpu

        def ready(stream: int | None, done=done) -> None:
            gpu.wait(done, stream)

        arrays = [
            DeviceArray(address, dtype, shape, (CUDA, gpu.ordinal), m, gpu.to_host, ready, strides)
            for m, address, dtype, shape, strides in outputs
        ]
        flat = [a.numpy() for a in arrays] if numpy else arrays
        return unflatten(entry.program.output_tree, flat)

    def array(self, host: Any, dtype: str | None = None, shape: Sequence[int] | None = None) -> DeviceArray:
        """A copy of a host array (NumPy, any CPU DLPack producer, a buffer such as a
        ``memoryview``) in device memory of its own, to pass to calls without a host-to-device
        copy each time. With ``dtype`` and ``shape``: ``host`` is raw bytes of that array (row-major)."""
        if dtype is not None:
            view = from_bytes(host, dtype, tuple(shape or ()), "array")
        else:
            view = from_dlpack(host, "array")
        if view.device_type != CPU or not view.contiguous:
            raise EnvError("runner.array takes a contiguous host array (NumPy)")
        memory = _Memory(self.gpu, view.nbytes)
        self.gpu.to_device(memory.ptr, view.ptr, view.nbytes)
        self.gpu.synchronize()
        return DeviceArray(
            memory.ptr, view.dtype, view.shape, (CUDA, self.gpu.ordinal), memory, self.gpu.to_host
        )

    def inputs_from(self, path: str | os.PathLike, where: str | None = None) -> dict[str, DeviceArray]:
        """The tensors of safetensors file ``path``, one per input of the bundle, each copied to
        device memory of its own (``array``) from the mapped file: inputs without numpy.
        ``GuardError`` naming ``where`` (default: the path) unless the file holds exactly the
        bundle's inputs."""
        import mmap

        from aot.weights import parse_header

        where = where or str(path)
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        tensors = parse_header(data, where)
        names = self.checked.input_names
        missing = [n for n in names if n not in tensors]
        extra = sorted(set(tensors) - set(names))
        if missing or extra:
            raise GuardError(
                f"{where}: expected one tensor per input {list(names)}, got {sorted(tensors)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; not inputs {extra}" if extra else "")
            )
        return {
            name: self.array(data[begin:end], dtype, shape)
            for name, (dtype, shape, begin, end) in ((n, tensors[n]) for n in names)
        }

    def zeros(self, dtype: str, shape: Sequence[int]) -> DeviceArray:
        """An array of zeros in device memory of its own (what ``aotpack-rt load`` passes when
        no inputs are given: no host array, so no numpy)."""
        if dtype not in DTYPES:
            raise GuardError(f"dtype {str(dtype)[:20]!r} is not one of {sorted(DTYPES)}")
        nbytes = array_bytes(dtype, shape)
        memory = _Memory(self.gpu, nbytes)
        self.gpu.zero(memory.ptr, nbytes)
        self.gpu.synchronize()  # zero before any consumer's stream reads it, as ``array``
        return DeviceArray(
            memory.ptr, dtype, tuple(shape), (CUDA, self.gpu.ordinal), memory, self.gpu.to_host
        )

    def _copy_in(self, view: ArrayView, address: int, name: str) -> None:
        """``view`` packed row-major at ``address``: one copy, or one 2-D copy of rows at a pitch."""
        on_device = view.device_type == CUDA and view.device_id == self.gpu.ordinal
        rows = view.rows
        if rows is not None and (on_device or view.device_type == CPU):
            self.gpu.copy_rows(address, view.ptr, *rows, from_host=view.device_type == CPU)
        elif view.device_type == CPU:
            self.gpu.to_device(address, view.ptr, view.nbytes)
        elif on_device:
            self.gpu.copy(address, view.ptr, view.nbytes)
        else:
            raise EnvError(
                f"input {name!r} is on DLPack device {view.device_type}:{view.device_id}; expected the host "
                f"or CUDA device {self.gpu.ordinal}"
            )

    def _prepare(self, entry: Entry, sizes: dict[str, int]) -> Prepared:
        key = (entry.name, *sorted(sizes.items()))
        prepared = self._prepared.get(key)
        if prepared is None:
            # not in the arena
            resident = (
                self.weights | set(self.state_offsets) | set(self.state_writes) | set(self.scratch_offsets)
            )
            steps = self.plans[entry.name].get(bucket_key(entry.program, sizes), entry.steps)
            tail = tail_start(entry.program, steps, sizes, TAIL_MIN_BYTES)
            layout = ArenaLayout(entry.program, steps, sizes, resident, tail)
            if layout.size > self.arena_bytes:  # the first call, or one larger than every call before
                self.gpu.synchronize()
                for old in self._prepared.values():
                    old.release()
                self._prepared.clear()  # every plan points into the old arena
                self.gpu.free(self.arena)
                self.arena_bytes, self.arena = layout.size, self.gpu.alloc(layout.size)
            prepared = self._prepared[key] = Prepared(self, entry, sizes, steps, layout)
        return prepared

    def close(self) -> None:
        self.gpu.synchronize()
        for prepared in self._prepared.values():
            prepared.release()
        self.gpu.free(self.arena)
        self.gpu.free(self.weights_base)
        self.gpu.free(self.state_base)
        self.gpu.free(self.scratch_base)
        self.gpu.release_blocks()  # outputs' blocks no array holds
        if self._readback is not None:
            self._readback.close()
            self._readback = None
        self.arena = self.weights_base = self.state_base = self.scratch_base = 0


def load(
    path: str | os.PathLike,
    trust: Sequence[str | os.PathLike] | None = None,
    device: int = 0,
    graphs: bool = True,
    max_memory: int | None = None,
    arena: str = "lazy",
) -> Runner:
    """Verify ``path`` (``aot.runtime.plan.check_bundle``) and load it on GPU ``device``;
    ``graphs=False`` launches kernel by kernel; ``arena``: ``"lazy"`` or ``"largest"`` (module docstring)."""
    start = time.perf_counter()
    drv.start(device)  # cuInit and the context take 0.1-0.2 s: meanwhile the bundle is verified
    checked = check_bundle(path, trust, max_memory)
    verify_s = time.perf_counter() - start
    mark = time.perf_counter()
    gpu = drv.started(device)
    waited_s = time.perf_counter() - mark
    runner = Runner(checked, gpu, graphs, arena)
    runner.timings = {
        "verify_s": verify_s,
        "waited_for_driver_s": waited_s + runner.timings.pop("context_s"),
        **runner.timings,
    }
    return runner
