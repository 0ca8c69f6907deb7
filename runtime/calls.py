"""What a call on the runtime without torch runs, per program and size, and what it checks first.

``Prepared`` is one program at one set of sizes, made by the runner the first time a call comes
at those sizes: the steps it runs (its bucket's tuned plan, or the program's), each kernel's
parameters packed for the driver with every buffer's address (arena, weights or state), the
driver copies, and the outputs' places, shapes and row pitches. Where a program's last steps only
compute its outputs (``aot.program.output_tail``), those kernels run after the rest into each
call's own memory, their buffers given as offsets there and packed per call. A program exactly at
a bucket is captured as a CUDA graph on first use (``on_bucket``).

``check_slots`` and ``check_values`` hold a call's integer inputs to the state's slots
(``aot.state``) and to the rows of the weights they index (``aot.values``), with the torch
loader's texts, reading their values to the host (``host_ints``).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

from aot.dtypes import ITEMSIZE
from aot.errors import BundleError, GuardError
from aot.program import DRIVER_COPIES, tensor_specs
from aot.runtime import driver as drv
from aot.runtime.arrays import CPU, ArrayView, array_bytes
from aot.runtime.plan import ArenaLayout, Entry
from aot.schema import Buf, ParamKind, StepKind, Sym
from aot.state import slots_error
from aot.symexpr import compile_expr
from aot.values import value_error


class Prepared:
    """One program at one set of sizes: the steps it runs (``steps``: its bucket's tuned plan, or
    the program's), where each buffer lives, and the ops that run them: ``ops`` in the arena (a
    CUDA graph's), then, where the outputs are computed after it (``tail``), ``tail_ops`` into
    each call's own memory of ``tail_bytes`` (their pointers there are offsets, packed per call)."""

    def __init__(
        self, runner: Any, entry: Entry, sizes: dict[str, int], steps: tuple, layout: ArenaLayout
    ):  # runner: the ``aot.runtime.runner.Runner`` preparing it (its kernels, records, addresses)
        self.entry, self.sizes, self.steps, self.layout = entry, sizes, steps, layout
        self.graph: Any = None
        self.on_bucket = on_bucket(entry, sizes)  # captured as a CUDA graph on first use
        self.blocks: dict[tuple, Any] = {}  # blocks of decode calls (``aot.runtime.generate``)
        program = entry.program
        specs = tensor_specs(program)
        tail = layout.tail
        self.tail_bytes = tail.size if tail is not None else 0

        def where(name: str) -> tuple[str, int]:
            """("ptr", address) of a buffer in the arena, weights or state; ("tail", offset) of one
            the tail writes into the call's own memory."""
            if tail is not None and name in tail.places:
                return ("tail", tail.places[name])
            return ("ptr", runner.address(name, layout))

        self.ops: list[tuple] = []
        self.tail_ops: list[tuple] = []  # (kernel, grid, [(kind, value)]): packed per call
        for i, step in enumerate(steps):
            if step.kind == StepKind.KERNEL:
                kernel = runner.kernels[step.target]
                record = runner.records[step.target]
                if len(step.args) != len(record.params):
                    raise BundleError(
                        f"kernel step {record.id} passes {len(step.args)} args for {len(record.params)} params"
                    )
                values = []
                for param, arg in zip(record.params, step.args):
                    if param.kind == ParamKind.PTR and isinstance(arg, Buf):
                        values.append(where(arg.name))
                    elif param.kind != ParamKind.PTR and isinstance(arg, Sym):
                        values.append((ParamKind(param.kind).value, compile_expr(arg.text)(sizes)))
                    else:
                        raise BundleError(
                            f"kernel {record.id}: parameter {param.name} gets {type(arg).__name__}"
                        )
                values.extend([("ptr", 0)] * record.scratch_params)
                grid = tuple(compile_expr(g)(sizes) for g in step.grid) + (1,) * (3 - len(step.grid))
                if min(grid) <= 0:
                    continue
                if tail is not None and i >= tail.start:
                    self.tail_ops.append((kernel, grid, values))
                else:
                    self.ops.append(("kernel", kernel, grid, *drv.pack_params(values)))
            elif step.target in DRIVER_COPIES:  # never in a tail (``output_tail``)
                src = step.args[0].name
                nbytes = _spec_bytes(specs[step.outputs[0]], sizes)
                self.ops.append(
                    ("copy", runner.address(step.outputs[0], layout), runner.address(src, layout), nbytes)
                )
            else:
                assert all(o in layout.views for o in step.outputs if o), step.target  # checked at load
        self.inputs = [
            (i.name, runner.address(i.name, layout)) for i in program.inputs if i.name not in program.state
        ]
        # (where: ("ptr", address) or ("tail", offset), dtype, shape, bytes, (row bytes, pitch
        # bytes) when rows are apart)
        self.outputs = []
        for name in program.outputs:
            spec = specs[name]
            shape = tuple(compile_expr(s)(sizes) for s in spec.shape)
            alias = layout.views.get(name)
            item = ITEMSIZE[spec.dtype]
            rows = (alias.width * item, alias.pitch * item) if alias and alias.width else None
            self.outputs.append((where(name), spec.dtype, shape, _spec_bytes(spec, sizes), rows))

    def release(self) -> None:
        if self.graph is not None:
            drv.destroy_graph(*self.graph)
            self.graph = None
        for block in self.blocks.values():
            block.release()
        self.blocks.clear()

    def launch(self, device: drv.Device) -> None:
        """The ops in the arena (what a graph captures)."""
        stream = device.stream
        for op in self.ops:
            if op[0] == "kernel":
                op[1].launch(op[2], stream, op[3])
            else:
                device.copy(op[1], op[2], op[3])

    def launch_tail(self, device: drv.Device, base: int) -> None:
        """The tail's kernels, writing into the call's memory at ``base``."""
        for kernel, grid, values in self.tail_ops:
            params, storage = drv.pack_params(
                [("ptr", base + v) if kind == "tail" else (kind, v) for kind, v in values]
            )
            kernel.launch(grid, device.stream, params)  # the driver copies the parameters here
            del storage


def _spec_bytes(spec, sizes) -> int:
    return array_bytes(spec.dtype, [compile_expr(s)(sizes) for s in spec.shape])


def bucket_keys(entry: Entry) -> list[tuple[int, ...]]:
    """Every bucket combination of ``entry``, largest first; none unless every symbol has buckets."""
    if not entry.buckets or {b.symbol for b in entry.buckets} != {s.symbol for s in entry.program.symbols}:
        return []
    keys = itertools.product(*[b.sizes for b in entry.buckets])
    return sorted(keys, key=lambda k: [-v for v in k])


def on_bucket(entry: Entry, sizes: dict[str, int]) -> bool:
    """Whether every symbol of ``sizes`` sits exactly on one of its buckets."""
    buckets = {b.symbol: b.sizes for b in entry.buckets}
    return bool(sizes) and all(s in buckets and v in buckets[s] for s, v in sizes.items())


def host_ints(view: ArrayView, device: drv.Device) -> list[int]:
    """The values of an integer array (host or device) as Python ints; a device array is copied
    to the host (a sync: index inputs are a few slots)."""
    fmt = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B"}.get(view.dtype)
    if fmt is None or not view.nbytes:
        return []
    data = ctypes.create_string_buffer(view.nbytes)
    if view.device_type == CPU:
        ctypes.memmove(data, view.ptr, view.nbytes)
    else:
        device.synchronize()
        device.to_host(ctypes.addressof(data), view.ptr, view.nbytes)
    return list(memoryview(data.raw).cast(fmt))


def check_slots(bounds, views: dict[str, ArrayView], device: drv.Device) -> None:
    """``GuardError`` unless every index input addresses slots of the state it writes."""
    for name, state, slots in bounds:
        values = host_ints(views[name], device) if name in views else []
        if values and (min(values) < 0 or max(values) >= slots):
            raise GuardError(slots_error(name, state, slots, min(values) if min(values) < 0 else max(values)))


def check_values(bounds, views: dict[str, ArrayView], device: drv.Device) -> None:
    """``GuardError`` unless every input that indexes a weight's rows holds values in its range
    (``aot.values``: the torch loader's check and text)."""
    for name, low, high, table, op in bounds:
        values = host_ints(views[name], device) if name in views else []
        if values and (min(values) < low or max(values) > high):
            raise value_error(name, min(values) if min(values) < low else max(values), low, high, table, op)
