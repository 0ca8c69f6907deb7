"""Trace stage: model file → ``Traced``.

``torch.export`` with the model file's dynamic dims, decomposition to core ATen (attention,
matmuls and convolution stay library calls), guard collection with the user's file:line for each,
and lowering to a device-neutral ``Program``. This package's entry points, re-exported:
"""

from aot.tracer.export import export_model
from aot.tracer.model import call_model, call_plan, example_inputs, instantiate, instantiate_shapes_only
from aot.tracer.model_file import load_model_file
from aot.tracer.programs import MAX_PROGRAMS, contract, export_programs
from aot.tracer.trace import guard_manifest, trace

__all__ = [
    "load_model_file",
    "trace",
    "guard_manifest",
    "export_model",
    "export_programs",
    "contract",
    "example_inputs",
    "call_model",
    "call_plan",
    "instantiate",
    "instantiate_shapes_only",
    "MAX_PROGRAMS",
]
