"""The GPU runtime: kernel steps launched from cubins, library steps through ATen, and CUDA-graph
capture per bucket, replayed on every call that fits one.

Memory plan: every buffer is released after its last use (liveness computed once at load), so
inside a capture the runner's memory pool hands the same memory to later buffers; all buckets
capture into one shared pool (graphs captured through the driver: ``aot.loader.cuda.Graph``).
Replays are serialized by one lock per runner (calls on one GPU stream serialize anyway); outputs
are copied out of the graph's static buffers before the lock is released, so the caller owns them
and a later call never overwrites them. The lock orders the launches, not the GPU work: a call on
another stream than the runner's last call first waits for what that call enqueued, so its copy
into the static inputs and its replay cannot run while the last call's graph, or its copies out
of the pool, still do (``StreamOrder``). A stateful bundle orders every call and reset that touches
its state the same way (``aot.loader.Runner``).

Large outputs are not copied: where a bucket's outputs come to ``TAIL_MIN_BYTES`` or more and the
last steps of the program are only what computes them (one library call or kernel per output, and
views of it: gpt's logits GEMM), those steps are left out of the graph (``output_tail``) and run
after each replay into memory the caller owns. The graph's pool then holds no copy of any bucket's
outputs, and no copy is made per call (gpt at batch 8 x seq 128: 98 MiB of logits each).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from aot.archs import arch_of, best_arch
from aot.aten import CALL_BUDGET, DTYPES, AtenCall
from aot.bundle import Bundle
from aot.errors import BundleError, EnvError
from aot.layout import check_order, empty_ordered, has_order, to_order
from aot.loader import bindings
from aot.loader.bindings import Bindings, Recorder
from aot.loader.cuda import (
    ALIGNMENT,
    Context,
    Function,
    Graph,
    capture_stream,
    copy_bytes,
    dependent_launch_allowed,
    driver_version,
    pack_params,
    raw_stream,
    zeros,
)
from aot.loader.prerun import Budget, itemsizes
from aot.loader.program import OutputSpecs, Storages, storage_span
from aot.memory import OutputBytes
from aot.program import (  # noqa: F401 - TAIL_PRODUCERS, output_tail: the loader's names for them too
    TAIL_MIN_BYTES,
    TAIL_PRODUCERS,
    frees_after,
    output_tail,
    scratch_shapes,
    spec_bytes,
    step_reads,
    step_writes,
    tensor_specs,
)
from aot.schema import (
    KERNEL_CUBIN_FORMAT,
    Bucket,
    Buf,
    Kernel,
    ParamKind,
    Program,
    Step,
    StepKind,
    Sym,
    TensorSpec,
)
from aot.symexpr import Expr, compile_expr

MAX_GRID = (2**31 - 1, 65535, 65535)  # blocks a launch may have along x, y, z (every CUDA GPU)


def pick_arch(archs: tuple[str, ...], capability: tuple[int, int]) -> str:
    """The cubin arch to load on a device (``aot.archs.best_arch``): its own, else its ``a`` arch
    (sm_90a on sm_90), else the newest of the same major whose minor does not exceed the device's
    (sm_80 code runs on sm_86/sm_89); ``EnvError`` when none runs there."""
    picked = best_arch(archs, capability)
    if picked is not None:
        return picked
    exact = arch_of(capability)
    raise EnvError(
        f"this GPU is {exact}, the bundle has cubins for {', '.join(archs) or 'no arch'}; "
        f"rebuild with --arch {','.join([*archs, exact])}"
    )


def check_driver(cuda_built: str, driver: int) -> None:
    """Cubins from the ptxas of CUDA ``cuda_built`` (``"12.9"``) load on a driver of that CUDA major
    or newer (minor-version compatibility); ``driver`` is ``cuDriverGetVersion``'s 12080-style number."""
    major = cuda_built.split(".")[0]
    if not major.isdigit():  # bundles of schema 1.0/1.1 did not record it
        return
    if driver // 1000 < int(major):
        raise EnvError(
            f"the bundle's kernels were compiled for CUDA {cuda_built} (needs a driver of CUDA {major}.x or newer), "
            f"this driver supports CUDA {driver // 1000}.{driver % 1000 // 10}; update the NVIDIA driver, or "
            f"rebuild with a triton whose ptxas is CUDA {driver // 1000}.x"
        )


class KernelCall:
    """One prepared kernel step: function, parameter getters, grid, output allocations."""

    __slots__ = (
        "fn",
        "params",
        "grid",
        "allocs",
        "outputs",
        "name",
        "scratch",
        "in_place",
        "writes",
        "fresh",
    )

    def __init__(
        self,
        step: Step,
        kernel: Kernel,
        fn: Function,
        program: Program,
        specs: dict[str, TensorSpec],
        device: torch.device,
    ):
        """``specs``: every tensor's spec in ``program`` (``aot.program.tensor_specs``)."""
        if len(step.args) != len(kernel.params):
            raise BundleError(
                f"kernel step {kernel.id} passes {len(step.args)} args for {len(kernel.params)} params"
            )
        self.fn = fn
        self.name = kernel.name
        # outputs the kernel writes in place into a buffer it is given (its state): no memory of their own
        self.in_place = tuple(step.in_place.items())
        written = set(step.in_place.values())
        self.params: list[tuple[str, Any]] = []
        for param, arg in zip(kernel.params, step.args):
            if param.kind == ParamKind.PTR:
                if not isinstance(arg, Buf):
                    raise BundleError(f"kernel {kernel.id}: pointer parameter {param.name} needs a buffer")
                spec = specs.get(arg.name)
                order = check_order(spec.order, len(spec.shape), f"buffer {arg.name!r}") if spec else ()
                self.params.append(("ptr" if arg.name not in written else "state", (arg.name, order)))
            else:
                if not isinstance(arg, Sym):
                    raise BundleError(
                        f"kernel {kernel.id}: integer parameter {param.name} needs an expression"
                    )
                self.params.append((ParamKind(param.kind).value, compile_expr(arg.text)))
        self.scratch = kernel.scratch_params
        if not 1 <= len(step.grid) <= 3:
            raise BundleError(f"kernel {kernel.id}: grid must have 1 to 3 dims, has {len(step.grid)}")
        self.grid = [compile_expr(g) for g in step.grid] + [compile_expr("1")] * (3 - len(step.grid))
        self.outputs = tuple(step.outputs)
        self.allocs = []
        for name in self.outputs:
            if name in step.in_place:
                continue
            spec = program.buffers.get(name)
            if spec is None or spec.dtype not in DTYPES:
                raise BundleError(f"kernel {kernel.id}: output {name!r} has no buffer spec")
            order = check_order(spec.order, len(spec.shape), f"kernel {kernel.id}: output {name!r}")
            shape = [compile_expr(s) for s in spec.shape]
            self.allocs.append((name, DTYPES[spec.dtype], shape, order, device))
        # the arguments it writes, and those allocated for it (``aot.loader.bindings``)
        named = [what[0] if kind in ("ptr", "state") else None for kind, what in self.params]
        self.writes = tuple(i for i, n in enumerate(named) if n is not None and n in self.outputs)
        made = {a[0] for a in self.allocs}
        self.fresh = tuple(i for i, n in enumerate(named) if n in made)

    def __call__(self, env: dict, sizes: dict, stream: int) -> tuple | None:
        """Launch on ``env``; returns what ``aot.loader.bindings.Recorder.kernel`` takes (None
        where the grid is empty)."""
        for name, dtype, shape, order, device in self.allocs:
            env[name] = empty_ordered([s(sizes) for s in shape], order, dtype, device)
        values = []
        copied = []  # the storages torch copied from for this launch (a library read)
        for kind, what in self.params:
            if kind == "ptr":
                name, order = what
                t = env[name]
                if not has_order(t, order):  # another layout than the kernel indexes: lay it out so
                    copied.append(storage_span(t))
                    t = env[name] = to_order(t, order)
                elif t.data_ptr() % ALIGNMENT:
                    copied.append(storage_span(t))
                    t = env[name] = t.clone(memory_format=torch.preserve_format)
                values.append(("ptr", t.data_ptr()))
            elif kind == "state":  # written in place: a copy would lose the write
                name, order = what
                t = env[name]
                if not has_order(t, order) or t.data_ptr() % ALIGNMENT:
                    raise BundleError(
                        f"kernel {self.name} writes into {name!r} in place, which is not laid out as it "
                        f"indexes it (shape {tuple(t.shape)}, strides {t.stride()})"
                    )
                values.append(("ptr", t.data_ptr()))
            else:
                values.append((kind, what(sizes)))
        for out, target in self.in_place:
            env[out] = env[target]
        values.extend([("ptr", 0)] * self.scratch)
        grid = (self.grid[0](sizes), self.grid[1](sizes), self.grid[2](sizes))
        if min(grid) <= 0:
            return None
        if grid[0] > MAX_GRID[0] or grid[1] > MAX_GRID[1] or grid[2] > MAX_GRID[2]:
            raise EnvError(
                f"kernel {self.name} at {dict(sizes)}: grid {grid} exceeds CUDA's {MAX_GRID}; "
                "rebuild the bundle with smaller declared maxima, or report the model"
            )
        params, storage = pack_params(values)
        self.fn.launch(grid, stream, params)
        del storage
        return grid, values, self.writes, self.fresh, copied


class GpuProgram:
    """Runs the program on a CUDA device, step by step (no graph).

    ``plans``: bucket key → the steps to run there instead of the program's own (a tuning
    table's GEMM choices, ``aot.tuning.tuned_plans``); every other call runs
    ``program.steps``. Cubins are loaded for the kernels some plan launches, only."""

    def __init__(
        self,
        bundle: Bundle,
        program: Program,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        plans: dict[tuple, tuple[Step, ...]] | None = None,
        state_aliases: frozenset[str] = frozenset(),
        max_flops: int | None = None,
    ):
        self.program = program
        self.max_flops = max_flops
        self.declared = OutputBytes(program)
        self.itemsizes = itemsizes(program)
        self.weights = weights
        self.device = device
        # its kernels' scratch (``Program.scratch``): allocated once, zeroed, the same on every call
        self.scratch = {
            name: torch.zeros(shape, dtype=torch.int32, device=device)
            for name, shape in scratch_shapes(program).items()
        }
        self.context = Context()
        self.bundle = bundle
        self.state_aliases = state_aliases
        self.kernels = {k.id: k for k in program.kernels}
        self.specs = tensor_specs(program)
        self.arch = None
        self._functions: dict[str, Function] = {}
        self.dependent_launch = False
        if self.kernels:
            archs = bundle.manifest.environment.archs
            self.arch = pick_arch(tuple(archs), torch.cuda.get_device_capability(device))
            version = driver_version()
            check_driver(bundle.manifest.environment.cuda_built.get(self.arch, ""), version)
            self.dependent_launch = dependent_launch_allowed(version)
            for k in self.kernels.values():
                if self.arch not in k.archs:
                    raise EnvError(
                        f"kernel {k.name} has no cubin for {self.arch} (it has {', '.join(k.archs)})"
                    )
        self.steps = program.steps
        self._touches: dict[int, tuple[str, ...]] = {}  # a library call's buffers (by id of the call)
        self.calls, self.frees = self.prepare(program.steps)
        self.plans: dict[tuple, tuple[list[Any], list[tuple[str, ...]]]] = {}
        self.plan_steps: dict[tuple, tuple[Step, ...]] = dict(plans or {})
        prepared: dict[int, tuple[list[Any], list[tuple[str, ...]]]] = {}
        for key, steps in (plans or {}).items():
            if id(steps) not in prepared:
                prepared[id(steps)] = self.prepare(steps)
            self.plans[key] = prepared[id(steps)]

    def function(self, kernel: Kernel) -> Function:
        if kernel.id not in self._functions:
            cubin = self.bundle.read(
                KERNEL_CUBIN_FORMAT.format(kernel=kernel.id, arch=self.arch)
            )  # sha256 checked
            self._functions[kernel.id] = Function(
                cubin,
                kernel.name,
                int(kernel.shared.get(self.arch, 0)),
                kernel.num_warps,
                dependent=self.arch in kernel.dependent_launch and self.dependent_launch,
            )
        return self._functions[kernel.id]

    def prepare(self, steps: tuple[Step, ...], plan: bool = True) -> tuple[list[Any], list[tuple[str, ...]]]:
        """The calls that run ``steps`` and the buffers to drop after each; ``plan=False`` for a
        part of a program (``aotpack tune`` runs one GEMM site): nothing is dropped."""
        calls: list[Any] = []
        for i, step in enumerate(steps):
            if step.kind == StepKind.KERNEL:
                k = self.kernels.get(step.target)
                if k is None:
                    raise BundleError(f"kernel step names unknown kernel {step.target[:40]!r}")
                calls.append(KernelCall(step, k, self.function(k), self.program, self.specs, self.device))
            else:
                calls.append(AtenCall(step, self.device, self.weights, self.state_aliases, self.specs, i))
                self._touches[id(calls[-1])] = (*step_reads(step), *step_writes(step))
        if not plan:
            return calls, [() for _ in calls]
        frees = frees_after(
            steps,
            [*self.weights, *(i.name for i in self.program.inputs), *self.program.scratch],
            self.program.outputs,
        )
        return calls, frees

    def steps_at(self, key: tuple | None) -> tuple[Step, ...]:
        """The steps a call at bucket ``key`` runs (a tuning plan's, or the program's)."""
        return self.plan_steps.get(key, self.steps) if key is not None else self.steps

    def __call__(
        self,
        inputs: dict[str, torch.Tensor],
        sizes: dict[str, int],
        key: tuple | None = None,
        span: tuple[int, int | None] | None = None,
        returns: tuple[str, ...] | None = None,
        recorder: Recorder | None = None,
    ) -> list[torch.Tensor]:
        """Run the steps at bucket ``key`` on ``inputs`` (and the weights); ``span``: only the
        steps ``[start, stop)`` of them (``stop`` None: to the end), ``inputs`` then holding what earlier steps wrote that
        these read; returns the buffers ``returns`` (default: the program's outputs). ``recorder``:
        a capture's, told every launch and library call (``aot.loader.bindings``)."""
        self.context.bind()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        env: dict[str, Any] = dict(self.weights)
        env.update(self.scratch)
        env.update(inputs)
        env[CALL_BUDGET] = Budget(self.declared.at(sizes), self.itemsizes, self.max_flops, sizes)
        calls, frees = (
            self.plans.get(key, (self.calls, self.frees)) if key is not None else (self.calls, self.frees)
        )
        if span is not None:
            calls, frees = calls[span[0] : span[1]], frees[span[0] : span[1]]
        for call, free in zip(calls, frees):
            if recorder is not None:
                self._record(recorder, call, env, sizes, stream)
            elif type(call) is KernelCall:
                call(env, sizes, stream)
            else:
                call(env, sizes)
            for name in free:
                del env[name]
        return [env[o] for o in (self.program.outputs if returns is None else returns)]

    def _record(self, recorder: Recorder, call: Any, env: dict, sizes: dict, stream: int) -> None:
        before = recorder.tail()
        if type(call) is KernelCall:
            launched = call(env, sizes, stream)
            if launched is not None:
                recorder.kernel(call.fn, launched, before)
            return
        call(env, sizes)
        ranges = []
        for name in self._touches.get(id(call), ()):
            value = env.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    ranges.append(storage_span(t))
        recorder.library(before, ranges)


def _owned_copy(t: torch.Tensor, stream: int) -> torch.Tensor:
    """A copy of ``t`` the caller owns, enqueued on ``stream``: by the driver where ``t`` is dense
    (``copy_bytes``), else ``clone``."""
    if t.is_contiguous():
        out = torch.empty_like(t)
        if copy_bytes(out, t, stream):
            return out
    return t.clone()


class _Captured:
    __slots__ = (
        "key",
        "graph",
        "inputs",
        "outputs",
        "sizes",
        "lendable",
        "tail",
        "checked",
        "binds",
    )

    def __init__(self, key, graph, inputs, outputs, sizes, lendable, tail=None, binds=None):
        self.key, self.graph, self.inputs, self.outputs, self.sizes = key, graph, inputs, outputs, sizes
        self.binds: Bindings | None = binds  # what a call may bind (``aot.loader.bindings``)
        self.checked = tail is None  # the outputs' specs: checked at capture, or after the first replay
        self.lendable = lendable  # per output: graph memory that may be lent (not a weight's)
        # (first step after the graph, the buffers it hands them) when the outputs are computed
        # after each replay (``output_tail``); ``outputs`` are then those buffers
        self.tail: tuple[int, tuple[str, ...]] | None = tail


class Arena:
    """What every CUDA graph of one runner shares, whatever its program or bucket: one memory
    pool (a bucket's intermediates reuse the memory another bucket's capture freed), one side
    stream to capture on, and one lock, since graphs that share a pool must never replay at once."""

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.MemPool()
        # one stream per device for every runner's captures (not torch's stream pool: see there)
        self.stream, self.capture_lock = capture_stream(device)
        self.lock = threading.Lock()
        self.order = StreamOrder(device)  # the pool and static inputs are shared by every call


class StreamOrder:
    """Orders the GPU work of calls that share memory (a graph's pool and static inputs, a
    stateful bundle's state) across the streams they come on: a lock orders their launches, not
    their work, so a call on another stream than the last one's first waits for what that call
    enqueued. Free when every call comes on one stream, as most do."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last_stream: int | None = None  # the stream the last call was launched on

    def after_last_call(self, stream: int) -> None:
        """Order ``stream`` (a raw handle; the caller holds the lock of what is shared) after the
        work the last call launched on another stream."""
        last = self.last_stream
        if last is not None and last != stream:
            here = torch.cuda.ExternalStream(stream, device=self.device)
            here.wait_stream(torch.cuda.ExternalStream(last, device=self.device))
        self.last_stream = stream


class GraphRunner:
    """CUDA graphs per bucket: captured lazily on first use (``capture="lazy"``) or all at load,
    largest first (``capture="all"``), into the runner's arena.

    A stateful program (``Program.state``, a KV cache) captures the runner's state where it lives
    (the row views of ``aot.loader.state.State`` at the bucket's batch), so a replay updates it in
    place and nothing is copied in or out. Its calls are never padded (padded rows or positions
    would write into the state), and a lazy capture warms up on the call's own inputs: the
    warm-up's state writes are the ones the call makes anyway, and its outputs are the call's.
    """

    def __init__(
        self,
        gpu: GpuProgram,
        buckets: tuple[Bucket, ...],
        arena: Arena,
        specs: OutputSpecs,
        weights: Storages,
        state: Any = None,
        relations: tuple[str, ...] = (),
    ):
        """``specs``: the program's output specs; ``weights``: the runner's weights, whose memory
        is never lent out; ``relations``: the program's guards among symbols (``height == width``
        of a program traced for a square grid): a bucket combination that breaks one is never
        captured (the program was not traced for it), a call padded onto one runs without a graph."""
        self.gpu = gpu
        self._relations = [compile_expr(r) for r in relations]
        index = gpu.device.index
        self.device_index = torch.cuda.current_device() if index is None else index
        self.buckets = {b.symbol: b for b in buckets}
        self.arena = arena
        self.pool, self.stream, self.lock = arena.pool, arena.stream, arena.lock
        self.capture_lock = arena.capture_lock  # the stream is the process's: one capture at a time
        self.graphs: dict[tuple, _Captured] = {}
        self.bind = bindings.enabled()  # kernels pointed at the calls' own tensors (``aot.loader.bindings``)
        self._weights = weights
        self._specs = specs
        program = gpu.program
        self.state = state if program.state else None
        owned = set(program.state)
        self.symbols = [s.symbol for s in program.symbols]
        self._input_shapes = {
            i.name: [compile_expr(s) for s in i.spec.shape] for i in program.inputs if i.name not in owned
        }
        self._input_dtypes = {i.name: DTYPES[i.spec.dtype] for i in program.inputs if i.name not in owned}
        # outputs: which dims are exactly a symbol (sliceable after padding)
        self._out_dims: list[list[tuple[int, Expr]]] = []
        for name in program.outputs:
            spec = program.buffers.get(name) or next((i.spec for i in program.inputs if i.name == name), None)
            self._out_dims.append([(d, compile_expr(s)) for d, s in enumerate(spec.shape)] if spec else [])

    def bucket_for(self, sizes: dict[str, int]) -> tuple | None:
        key = []
        for sym in self.symbols:
            value = sizes[sym]
            b = self.buckets.get(sym)
            if b is None:
                return None
            if value in b.sizes:
                key.append(value)
            elif b.paddable and self.state is None:
                bigger = [s for s in b.sizes if s >= value]
                if not bigger:
                    return None
                key.append(bigger[0])
            else:
                return None
        return tuple(key) if self._admits(tuple(key)) else None

    def _admits(self, key: tuple) -> bool:
        if not self._relations:
            return True
        sizes = dict(zip(self.symbols, key))
        return all(r(sizes) for r in self._relations if r.symbols <= sizes.keys())

    def all_keys(self) -> list[tuple]:
        import itertools

        sizes = [self.buckets[s].sizes for s in self.symbols]
        keys = [k for k in itertools.product(*sizes) if self._admits(k)]
        return sorted(keys, key=lambda k: [-v for v in k])

    def capture(
        self, key: tuple, call: dict[str, torch.Tensor] | None = None
    ) -> tuple[_Captured, list[torch.Tensor]]:
        """Capture the bucket ``key``'s graph; warm up on ``call``'s inputs when given (their sizes
        are the bucket's), else on zeros. Returns the graph and the warm-up's outputs (none when it
        warmed up on zeros: nobody reads them, and the capture reuses their memory)."""
        gpu = self.gpu
        sizes = dict(zip(self.symbols, key))
        inputs = self.static_inputs(key)
        if call is not None:
            for name, value in call.items():
                inputs[name].copy_(value)
        bound = {**inputs, **(self.state.views(sizes) if self.state is not None else {})}
        tail = self._tail(key, sizes)
        span, returns = ((0, tail[0]), tail[1]) if tail is not None else (None, None)
        # Warm up and capture on one stream of our own: library handles and workspaces (cuBLAS
        # keeps one per stream) exist before capture, and exist once. The warm-up allocates from
        # the arena's pool too, so the capture reuses its memory instead of the caching allocator
        # keeping a second copy of the bucket's intermediates (and outputs) reserved beside the pool.
        side = self.stream
        with self.capture_lock:
            side.wait_stream(torch.cuda.current_stream(gpu.device))
            with torch.cuda.stream(side), torch.cuda.use_mem_pool(self.pool, gpu.device):
                warm = gpu(bound, sizes, key, span, returns)
                if call is None or tail is not None:
                    warm = []
            torch.cuda.current_stream(gpu.device).wait_stream(side)
            graph = Graph(self.pool)
            torch.cuda.synchronize(gpu.device)
            recorder = Recorder(side.cuda_stream) if self.bind and self.state is None else None
            outputs = graph.capture(side, lambda: gpu(bound, sizes, key, span, returns, recorder))
        lendable = [not self._weights.overlaps(*storage_span(o)) for o in outputs]
        binds = None
        if recorder is not None:  # outputs computed after the graph are the caller's already
            binds = Bindings.of(recorder, graph, inputs, outputs if tail is None else None)
        captured = _Captured(key, graph, inputs, outputs, sizes, lendable, tail, binds)
        if tail is None:  # once: replays and slices keep dtype, device and shape exprs
            self._specs.check(outputs, sizes)
        self.graphs[key] = captured
        return captured, warm

    def static_inputs(self, key: tuple) -> dict[str, torch.Tensor]:
        """Input buffers of the bucket ``key``'s sizes (zeros), for ``capture_calls``."""
        sizes = dict(zip(self.symbols, key))
        return {
            name: zeros([s(sizes) for s in shape], self._input_dtypes[name], self.gpu.device)
            for name, shape in self._input_shapes.items()
        }

    def capture_calls(
        self, key: tuple, inputs: dict[str, torch.Tensor], body: Callable[[Callable[[], list]], Any]
    ) -> Graph:
        """Run ``body(call)`` once, then capture it as a graph: ``call()`` runs the bucket's
        program on ``inputs`` (``static_inputs``) and the state, returning its outputs, as many
        times as ``body`` calls it, with the caller's own work between the calls (several decode
        steps per launch: ``aot.loader.decode_blocks``). The run is the capture's warm-up and the
        caller's first launch: its writes are the ones a replay makes, and its allocations come
        from the pool, which the capture then reuses (an allocation the pool cannot serve would
        call cudaMalloc inside the capture and fail it). The bucket's own graph must be captured
        (its warm-up made the library handles and workspaces); the graph shares its pool, so it
        replays under the same lock (``replay_calls``)."""
        if key not in self.graphs:
            raise RuntimeError(f"capture_calls: the bucket {key}'s own graph is not captured yet")
        sizes = dict(zip(self.symbols, key))
        bound = {**inputs, **(self.state.views(sizes) if self.state is not None else {})}
        gpu = self.gpu

        def run() -> Any:
            return body(lambda: gpu(bound, sizes, key, None, None))

        with self.lock, self.capture_lock:
            current = torch.cuda.current_stream(gpu.device)
            self.arena.order.after_last_call(current.cuda_stream)
            side = self.stream
            side.wait_stream(current)
            with torch.cuda.stream(side), torch.cuda.use_mem_pool(self.pool, gpu.device):
                run()
            current.wait_stream(side)
            graph = Graph(self.pool)
            torch.cuda.synchronize(gpu.device)
            graph.capture(side, run)
        return graph

    def replay_calls(self, graph: Graph) -> None:
        """Launch a graph of ``capture_calls`` on the current stream."""
        with self.lock:
            stream = raw_stream(self.device_index)
            self.arena.order.after_last_call(stream)
            graph.replay(stream)

    def _tail(self, key: tuple, sizes: dict[str, int]) -> tuple[int, tuple[str, ...]] | None:
        """Where the steps after the graph begin and what the graph hands them, when the bucket's
        outputs are large enough to compute after it (module docstring); None otherwise."""
        if self.state is not None:
            return None  # a stateful call's outputs are small (one step's logits), its writes in place
        program = self.gpu.program
        specs = [program.buffers.get(o) for o in program.outputs]
        if any(spec is None for spec in specs) or sum(spec_bytes(s, sizes) for s in specs) < TAIL_MIN_BYTES:
            return None
        steps = self.gpu.steps_at(key)
        start = output_tail(steps, program.outputs)
        if start is None:
            return None
        before = {w for step in steps[:start] for w in step_writes(step)}
        handed = tuple(dict.fromkeys(r for step in steps[start:] for r in step_reads(step) if r in before))
        return start, handed

    def _run_tail(self, captured: _Captured, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The steps after the graph, on what its replay left, at the bucket's sizes, on the
        caller's stream: their results come from the caller's own allocations, which the
        allocator reuses in stream order once the caller drops them. (On the capture stream, with
        ``record_stream`` for the caller's, each freed result waited on an event the host ran
        ahead of: 21 unsynchronized calls of gpt at batch 8 held 1.4 GiB of logits.)"""
        start, handed = captured.tail
        env = {**inputs, **dict(zip(handed, captured.outputs))}
        return self.gpu(env, captured.sizes, captured.key, (start, None))

    @staticmethod
    def _bind(
        binds: Bindings,
        inputs: dict[str, torch.Tensor],
        out: list[torch.Tensor] | None,
        borrow: bool,
        used: dict[str, torch.Tensor],
    ) -> tuple[dict[Any, torch.Tensor], dict[str, torch.Tensor]]:
        """The call's tensors the graph's kernels can read and write in place of its static
        buffers (``Bindings.point``'s keys), and the inputs the steps after the graph then read
        (``used``, the static ones, with the bound ones in their place)."""
        given: dict[Any, torch.Tensor] = {}
        used = dict(used)
        spans = []
        for name, (static, _) in binds.inputs.items():
            value = inputs.get(name)
            if value is not None and bindings.fits(static, value):
                given["in", name] = used[name] = value
                spans.append(storage_span(value))
        for i, (static, _) in binds.outputs.items():
            if out is None:
                if not borrow:  # borrowed outputs are the graph's own memory: nothing to allocate
                    given["out", i] = torch.empty_like(static)
            elif bindings.fits(static, out[i]) and not any(
                bindings.overlaps(*storage_span(out[i]), *s) for s in spans
            ):  # an output written over an input the graph still reads: copied after it instead
                given["out", i] = out[i]
        return given, used

    def capture_all(self) -> None:
        with self.lock:
            for key in self.all_keys():
                if key not in self.graphs:
                    self.capture(key)

    def __call__(
        self,
        key: tuple,
        inputs: dict[str, torch.Tensor],
        sizes: dict[str, int],
        out: list[torch.Tensor] | None = None,
        borrow: bool = False,
    ) -> list[torch.Tensor]:
        """Replay the bucket's graph on ``inputs``. The outputs are copies the caller owns; with
        ``out``, written into those buffers (no allocation); with ``borrow``, the graph's own
        output memory, valid until this runner's next call (an output that is a weight is still
        copied)."""
        with self.lock:
            stream = raw_stream(self.device_index)
            self.arena.order.after_last_call(stream)  # before a capture too: it warms up in the shared pool
            captured = self.graphs.get(key)
            if captured is None and self.state is not None:
                # the warm-up ran this very call (its state writes included): its outputs are the call's
                _, warm = self.capture(key, inputs)
                if out is not None:
                    return [buf.copy_(result) for buf, result in zip(out, warm)]
                return [result.clone() for result in warm]  # once per bucket: caller-owned
            if captured is None:
                captured, _ = self.capture(key)
            padded = captured.sizes != sizes
            binds = captured.binds
            given: dict[Any, torch.Tensor] = {}  # what the graph's kernels read and write this call
            used = captured.inputs  # the inputs the steps after the graph read
            if binds is not None and not padded:
                given, used = self._bind(binds, inputs, out, borrow, used)
            for name, value in inputs.items():
                static = captured.inputs[name]
                if ("in", name) in given:
                    continue
                if padded and static.shape != value.shape:
                    static[tuple(slice(0, n) for n in value.shape)].copy_(value)
                elif not copy_bytes(
                    static, value, stream
                ):  # the driver's copy: a few µs less before the replay
                    static.copy_(value)
            if binds is not None:
                binds.point(captured.graph, given)
            captured.graph.replay(stream)
            if captured.tail is not None:
                outputs, fresh = self._run_tail(captured, used), True
                if not captured.checked:  # after a replay: the steps ran on what the graph wrote
                    self._specs.check(outputs, captured.sizes)
                    captured.checked = True
            else:
                outputs, fresh = captured.outputs, False
            results = []
            for i, (result, dims) in enumerate(zip(outputs, self._out_dims)):
                if ("out", i) in given:  # the graph wrote it where the caller owns it
                    results.append(given["out", i])
                    continue
                if padded:
                    result = result[tuple(slice(0, e(sizes)) for _, e in dims)]
                if out is not None:
                    results.append(out[i].copy_(result))
                elif fresh:  # computed after the graph: the caller's own; a padded one copied smaller
                    results.append(result.clone() if padded and not borrow else result)
                elif borrow and captured.lendable[i]:
                    results.append(result)
                else:
                    results.append(_owned_copy(result, stream))
            return results
