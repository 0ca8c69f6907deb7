"""Launch cubins through the CUDA driver API with ctypes: no triton, no C compiler.

``cuModuleLoadData`` loads a cubin the build compiled (the bundle's sha256 was checked first),
``cuLaunchKernel`` launches it on torch's current stream. Triton's ABI: the PTX entry takes the
user arguments, then ``scratch_params`` trailing pointers (global and profile scratch), passed as
NULL since the build only emits kernels that need none. Dynamic shared memory above 48 KiB needs
``cuFuncSetAttribute`` first.

A kernel whose cubin waits for the kernel before it (``Kernel.dependent_launch``) is launched with
``cuLaunchKernelEx`` and the programmatic-stream-serialization attribute, so the GPU may start it
before the kernel before it ends (its blocks wait inside; see ``codegen.kernel_source``); stream
capture records that as a programmatic edge of the CUDA graph. That needs a driver of CUDA 12.3 or
later; ``AOTPACK_DEPENDENT_LAUNCH=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from aot.errors import EnvError
from aot.settings import setting

ALIGNMENT = 16  # kernels assume 16-byte aligned pointers (the cubins were specialized so)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_SHARED_LIMIT = 48 * 1024
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
DEPENDENT_LAUNCH_DRIVER = 12030  # CUDA 12.3: programmatic edges in captured graphs
DEPENDENT_LAUNCH_ENV = "AOTPACK_DEPENDENT_LAUNCH"


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (the first version's layout)
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
    ]


_lib = None
_lib_lock = threading.Lock()


def driver() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise EnvError(
                    f"cannot load the CUDA driver libcuda.so.1 ({e}); is an NVIDIA driver installed?"
                ) from None
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            lib.cuModuleGetFunction.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.c_char_p,
            ]
            lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.cuLaunchKernel.argtypes = [
                ctypes.c_void_p,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
            lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
            lib.cuGraphInstantiateWithFlags.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.c_ulonglong,
            ]
            lib.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
            lib.cuGraphDestroy.argtypes = [ctypes.c_void_p]
            lib.cuMemsetD8Async.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
            lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
            if hasattr(lib, "cuStreamGetCaptureInfo_v2"):  # CUDA 11.3 on
                lib.cuStreamGetCaptureInfo_v2.argtypes = [
                    ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_int),
                    ctypes.POINTER(ctypes.c_uint64),
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)),
                    ctypes.POINTER(ctypes.c_size_t),
                ]
            if hasattr(lib, "cuGraphExecKernelNodeSetParams"):
                lib.cuGraphExecKernelNodeSetParams.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.POINTER(_KernelNodeParams),
                ]
            if hasattr(lib, "cuLaunchKernelEx"):  # CUDA 12.0 on
                lib.cuLaunchKernelEx.argtypes = [
                    ctypes.POINTER(_LaunchConfig),
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                ]
            _lib = lib
    return _lib


def check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise EnvError(f"CUDA driver: {what} failed with error {result} ({text})")


def driver_version() -> int:
    v = ctypes.c_int()
    check(driver().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return v.value


def dependent_launch_allowed(version: int) -> bool:
    """Whether kernels built for it may launch early under a driver of ``version``
    (``driver_version()``): CUDA 12.3 or later, and ``AOTPACK_DEPENDENT_LAUNCH`` not ``0``."""
    if setting(DEPENDENT_LAUNCH_ENV, "1", ("0", "1")) == "0":
        return False
    return version >= DEPENDENT_LAUNCH_DRIVER and hasattr(driver(), "cuLaunchKernelEx")


class Context:
    """The CUDA context torch made current; bound to each thread that launches."""

    def __init__(self):
        import torch

        torch.cuda.init()
        torch.cuda.current_stream()  # makes torch's primary context current on this thread
        ctx = ctypes.c_void_p()
        check(driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise EnvError("no CUDA context is current after torch initialised CUDA")
        self.handle = ctx.value
        self._bound = threading.local()

    def bind(self) -> None:
        if getattr(self._bound, "ok", False):
            return
        cur = ctypes.c_void_p()
        check(driver().cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value != self.handle:
            check(driver().cuCtxSetCurrent(self.handle), "cuCtxSetCurrent")
        self._bound.ok = True


CU_STREAM_NON_BLOCKING = 1
_capture_streams: dict[int, tuple[Any, threading.Lock]] = {}


def capture_stream(device) -> tuple[Any, threading.Lock]:
    """The process's one stream per device for warm-ups and CUDA-graph captures, made with the
    driver (a ``torch.cuda.ExternalStream``), and the lock a capture on it holds.

    ``torch.cuda.Stream()`` would create torch's whole stream pool on first use (32 streams per
    priority), which on an H200 and an H100 with torch 2.11 took 68 MiB of device memory. The
    stream is never destroyed: the caching allocator keeps the blocks of a graph's pool tied to
    the stream they were captured on (a stream destroyed with its runner crashed the process at
    exit)."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    with _lib_lock:
        found = _capture_streams.get(index)
    if found is not None:
        return found
    with torch.cuda.device(index):  # the device's primary context, current on this thread
        Context().bind()
        handle = ctypes.c_void_p()
        check(driver().cuStreamCreate(ctypes.byref(handle), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        made = (torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index)), threading.Lock())
    with _lib_lock:
        return _capture_streams.setdefault(index, made)  # a racing thread's stream leaks: harmless


def raw_stream(index: int) -> int:
    """The current stream's handle on device ``index`` (torch's fast path where it has one)."""
    import torch

    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


CU_STREAM_CAPTURE_STATUS_ACTIVE = 1


def capture_tail(stream: int) -> int | None:
    """The node the capture on ``stream`` (a raw handle) added last, where it is the capture's one
    dependency (a kernel launch adds one node and depends on it); 0 before the capture's first
    node; None where that cannot be told (no capture, several dependencies, a driver without
    ``cuStreamGetCaptureInfo_v2``)."""
    lib = _lib or driver()
    if not hasattr(lib, "cuStreamGetCaptureInfo_v2"):
        return None
    status, ident, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    deps, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
    result = lib.cuStreamGetCaptureInfo_v2(
        stream,
        ctypes.byref(status),
        ctypes.byref(ident),
        ctypes.byref(graph),
        ctypes.byref(deps),
        ctypes.byref(count),
    )
    if result != 0 or status.value != CU_STREAM_CAPTURE_STATUS_ACTIVE or count.value > 1:
        return None
    return deps[0] if count.value else 0


def copy_bytes(dst, src, stream: int) -> bool:
    """Enqueue ``dst``'s bytes := ``src``'s on ``stream`` (a raw handle) by the driver, where both
    are dense tensors of one dtype, shape and device: True. False, having done nothing, for any
    other pair (the caller copies with torch). What ``dst.copy_(src)`` does there, in less host
    time: a CUDA-graph call of the example mlp (one input and one output copied) took 35.1 µs of
    the host's against 38.3 with torch's copies (an H200, torch 2.11: ``bench/host_path.py --ab``)."""
    if (
        dst.shape != src.shape
        or dst.dtype != src.dtype
        or dst.device != src.device
        or not dst.is_contiguous()
        or not src.is_contiguous()
    ):
        return False
    nbytes = src.numel() * src.element_size()
    if nbytes:
        check(
            (_lib or driver()).cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, stream), "cuMemcpyAsync"
        )
    return True


def zeros(shape: list[int], dtype, device):
    """A zero-filled tensor by the driver's memset, not ATen's fill kernel: on an H200 with torch
    2.11 the first ATen elementwise kernel of a process took about 90 MiB of device memory, which
    a runner whose every kernel is its own or a library's never needs to pay."""
    import torch

    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel():
        nbytes = out.numel() * out.element_size()
        check(
            driver().cuMemsetD8Async(out.data_ptr(), 0, nbytes, raw_stream(out.device.index)),
            "cuMemsetD8Async",
        )
    return out


CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


class Graph:
    """A CUDA graph captured, instantiated and launched through the driver, its memory from a
    ``torch.cuda.MemPool`` (kept alive by the graph: the captured kernels address its blocks).

    Not ``torch.cuda.CUDAGraph``: its ``capture_begin`` fills the default generator's seed and
    offset tensors with ATen's fill kernel, and on an H200 with torch 2.11 a process's first ATen
    kernel took about 90 MiB of device memory, which a program of our own kernels and library
    calls never needs. Nothing here uses random numbers, so there is no generator state to
    register. Capture is thread-local (other threads may keep using CUDA); the caching allocator
    notices the capture on the stream and allocates as it does for torch's graphs."""

    def __init__(self, pool):
        self.pool = pool
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()

    def capture(self, stream, fn):
        """Run ``fn()`` under capture on ``stream`` (a torch stream), allocating from the pool;
        returns what ``fn`` returned."""
        import torch

        lib = driver()
        device = stream.device
        with torch.cuda.stream(stream), torch.cuda.use_mem_pool(self.pool, device):
            check(
                lib.cuStreamBeginCapture_v2(stream.cuda_stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture",
            )
            try:
                result = fn()
            finally:
                ended = lib.cuStreamEndCapture(stream.cuda_stream, ctypes.byref(self._graph))
            check(ended, "cuStreamEndCapture")
        check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, 0), "cuGraphInstantiate")
        check(lib.cuGraphUpload(self._exec, stream.cuda_stream), "cuGraphUpload")
        return result

    def set_kernel_args(
        self, node: int, fn: Function, grid: tuple[int, int, int], params: ctypes.Array
    ) -> bool:
        """Give the kernel node ``node`` (of the captured graph, launching ``fn`` on ``grid``) the
        arguments ``params`` (``pack_params``'s) from the graph's next launch on; launches already
        enqueued keep theirs. False where the driver cannot or will not."""
        lib = _lib or driver()
        if not self._exec.value or not hasattr(lib, "cuGraphExecKernelNodeSetParams"):
            return False
        node_params = _KernelNodeParams(
            func=fn.handle, shared=fn.shared, params=ctypes.cast(params, ctypes.c_void_p)
        )
        node_params.grid[:] = grid
        node_params.block[:] = (fn.block, 1, 1)
        return lib.cuGraphExecKernelNodeSetParams(self._exec, node, ctypes.byref(node_params)) == 0

    def replay(self, stream: int) -> None:
        """Launch on ``stream``, a raw handle (``raw_stream``)."""
        check(_lib.cuGraphLaunch(self._exec, stream), "cuGraphLaunch")

    def __del__(self):
        lib = _lib
        if lib is None:
            return
        if self._exec.value:
            lib.cuGraphExecDestroy(self._exec)
        if self._graph.value:
            lib.cuGraphDestroy(self._graph)


class Function:
    """One kernel of one loaded cubin."""

    def __init__(self, cubin: bytes, name: str, shared: int, num_warps: int, dependent: bool = False):
        """``dependent``: the cubin waits for the kernel before it, so it launches early
        (``dependent_launch_allowed`` decides whether it may)."""
        lib = driver()
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # must outlive the load call
        module = ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(module), self._image), f"cuModuleLoadData({name})")
        fn = ctypes.c_void_p()
        check(
            lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), f"cuModuleGetFunction({name})"
        )
        if shared > DEFAULT_SHARED_LIMIT:
            check(
                lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                f"cuFuncSetAttribute({name}, shared={shared})",
            )
        self.module = module
        self.handle = fn.value
        self.name = name
        self.shared = shared
        self.block = 32 * num_warps
        self.dependent = dependent
        if dependent:  # what every launch's config shares (a config is made per launch: threads)
            attr = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value[0] = 1  # programmaticStreamSerializationAllowed
            self._attrs = ctypes.pointer(attr)
            self._block = (ctypes.c_uint * 3)(self.block, 1, 1)

    def launch(self, grid: tuple[int, int, int], stream: int, params: ctypes.Array) -> None:
        if self.dependent:
            config = _LaunchConfig()
            config.grid[:] = grid
            config.block = self._block
            config.shared = self.shared
            config.stream = stream
            config.attrs = self._attrs
            config.num_attrs = 1
            check(
                _lib.cuLaunchKernelEx(ctypes.byref(config), self.handle, params, None),
                f"cuLaunchKernelEx({self.name})",
            )
            return
        check(
            _lib.cuLaunchKernel(
                self.handle, grid[0], grid[1], grid[2], self.block, 1, 1, self.shared, stream, params, None
            ),
            f"cuLaunchKernel({self.name})",
        )


def pack_params(values: list[tuple[str, int]]) -> tuple[ctypes.Array, list]:
    """[(kind, value)] → the ``void**`` array cuLaunchKernel takes, plus the storage it points to
    (keep both alive as long as the array is used)."""
    storage = []
    for kind, value in values:
        if kind == "ptr":
            storage.append(ctypes.c_uint64(value))
        elif kind == "i32":
            storage.append(ctypes.c_int32(value))
        elif kind == "i64":
            storage.append(ctypes.c_int64(value))
        else:
            raise EnvError(f"unknown kernel parameter kind {kind!r}")
    array = (ctypes.c_void_p * max(len(storage), 1))(
        *[ctypes.cast(ctypes.byref(s), ctypes.c_void_p) for s in storage]
    )
    return array, storage
