"""How a program's dtypes look inside a kernel: the type values are computed in, the pointer
element type they are stored as, and the ``tl.*`` spelling of each.

Half types compute in fp32 and round only where the program casts or stores. The value graph
(``valuegraph``) reads ``COMPUTE``; the source writer (``kernel_source``) and the kernel
parameters (``launch``) read ``STORAGE`` and ``TL_TYPE``.
"""

from __future__ import annotations

# the float dtypes the hand-written kernels (GEMM and attention forms, gathers, pooling) take
FLOAT_DTYPES = ("float16", "bfloat16", "float32")

# dtype of the program → type values are computed in inside a kernel
COMPUTE = {
    "float16": "fp32",
    "bfloat16": "fp32",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "i1",
}
# dtype of the program → Triton pointer element type
STORAGE = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "i1",
}
# Triton type name → its ``tl`` dtype in kernel source
TL_TYPE = {
    "fp16": "tl.float16",
    "bf16": "tl.bfloat16",
    "fp32": "tl.float32",
    "fp64": "tl.float64",
    "i8": "tl.int8",
    "u8": "tl.uint8",
    "i16": "tl.int16",
    "i32": "tl.int32",
    "i64": "tl.int64",
    "i1": "tl.int1",
}
