"""aotpack-rt: run library-free bundles on the CUDA driver alone, without torch.

``load(path) -> Runner`` verifies the bundle (the same archive, signature, guard and memory checks
as the torch loader: ``aot.bundle``, ``aot.signature``, ``aot.guards``, ``aot.memory``) and loads
it on a GPU through NVIDIA's ``cuda-bindings``; ``runner(**inputs)`` takes DLPack arrays (torch,
CuPy, JAX on the GPU, NumPy on the host) and returns ``DeviceArray``s. ``check(path)`` does every
check that needs no GPU. Importing this package never imports torch (a test proves it).
"""

from aot.runtime.arrays import DeviceArray
from aot.runtime.plan import Checked
from aot.runtime.plan import check_bundle as check
from aot.runtime.runner import Runner, load

__all__ = ["Checked", "DeviceArray", "Runner", "check", "load"]
