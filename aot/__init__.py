"""aotpack: ahead-of-time packaging of PyTorch models into verifiable bundles.

Model files import ``Dim``, ``Input``, ``EntryPoint`` and ``ModelSpec`` from here. This package imports only the
standard library, so the loader stays light.
"""

from aot.errors import AotError, BundleError, CodegenError, EnvError, GuardError, SpecError, TraceError
from aot.spec import Dim, EntryPoint, Input, ModelSpec

__version__ = "0.1.0"

__all__ = [
    "AotError",
    "BundleError",
    "CodegenError",
    "Dim",
    "EntryPoint",
    "EnvError",
    "GuardError",
    "Input",
    "ModelSpec",
    "SpecError",
    "TraceError",
    "__version__",
]
