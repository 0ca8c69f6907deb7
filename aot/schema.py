"""The bundle schema: every record a ``.tpk`` holds, as frozen dataclasses of primitives.

This is the one file that defines the on-disk format. Change a field and you must bump
``SCHEMA_VERSION`` (``tests/aot/test_schema.py`` fails otherwise): a new optional field is a minor
bump, anything a loader of the same major could misread is a major bump.

Records are (de)serialized by ``aot.serde`` (``to_json`` / ``from_json``), which validates every
field's type, so a hostile manifest becomes a ``BundleError``, never an ``AttributeError`` deep in
the loader.

A step's arguments are ``Arg`` values: JSON scalars, lists, and small tagged records, each stored
as a one-key object::

    Buf      {"buf": "addmm_3"}       a buffer of the program
    Sym      {"sym": "batch*seq"}     a size expression, evaluated per call
    SymBool  {"symbool": "seq > 1"}   a size comparison, evaluated to a bool per call
    SymFloat {"symfloat": "4/(h//7)"}  a float computed from sizes (an interpolation's scale), per call
    DType    {"dtype": "float16"}
    Device   {"device": "runtime"}    the device the bundle is loaded on
    Layout   {"layout": "strided"}
    MemoryFormat  {"memory_format": "contiguous_format"}
    SpecialFloat  {"float": "inf"}    inf, -inf and nan (JSON has no literal for them)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = (1, 13)
FORMAT_NAME = "aotpack-bundle"
# The oldest torch whose ATen ops the loader has been checked against.
TORCH_MIN = "2.11"

# Archive layout: every member path is one of these.
MANIFEST_PATH = "manifest.json"
PROGRAM_PATH = "program.json.zst"
WEIGHTS_PATH = "weights.safetensors"
REFERENCE_PATH = "reference.safetensors"
GUARDS_PATH = "guards.txt"
# Ed25519 signature of MANIFEST_PATH's bytes (``aot.signing``); optional, and outside the manifest
# it signs, so adding or replacing it changes no other member.
SIGNATURE_PATH = "signature.json"
# ``aotpack tune``'s measurements and choices (``TuningTable``); optional, listed in the manifest.
TUNING_PATH = "tuning.json"
KERNELS_DIR = "kernels/"
KERNEL_SOURCE_FORMAT = KERNELS_DIR + "{kernel}.py"
KERNEL_CUBIN_FORMAT = KERNELS_DIR + "{kernel}.{arch}.cubin"
WEIGHTS_ALIGNMENT = 64
# A field with this metadata is left out of the JSON while empty, so records written before it
# existed serialize unchanged.
OMIT_EMPTY = {"omit_empty": True}

# Reference tensors are stored under these prefixes in REFERENCE_PATH.
REFERENCE_INPUT_PREFIX = "input."
REFERENCE_OUTPUT_PREFIX = "output."


class StepKind(str, enum.Enum):
    ATEN = "aten"
    KERNEL = "kernel"


class ParamKind(str, enum.Enum):
    PTR = "ptr"  # a tensor
    I32 = "i32"  # a runtime size
    I64 = "i64"


class TreeKind(str, enum.Enum):
    TENSOR = "tensor"
    NONE = "none"
    TUPLE = "tuple"
    LIST = "list"
    DICT = "dict"
    RECORD = "record"


# ---------------------------------------------------------------------------------------------
# Step arguments: tagged records (see the module docstring).


@dataclass(frozen=True)
class Buf:
    TAG: ClassVar[str] = "buf"
    name: str


@dataclass(frozen=True)
class Sym:
    TAG: ClassVar[str] = "sym"
    text: str


@dataclass(frozen=True)
class SymBool:
    TAG: ClassVar[str] = "symbool"
    text: str


@dataclass(frozen=True)
class SymFloat:
    TAG: ClassVar[str] = "symfloat"
    text: str  # the grammar of ``aot.symexpr`` with ``/`` and float constants (``floats=True``)


@dataclass(frozen=True)
class DType:
    TAG: ClassVar[str] = "dtype"
    name: str


@dataclass(frozen=True)
class Device:
    TAG: ClassVar[str] = "device"
    name: str = "runtime"


@dataclass(frozen=True)
class Layout:
    TAG: ClassVar[str] = "layout"
    name: str


@dataclass(frozen=True)
class MemoryFormat:
    TAG: ClassVar[str] = "memory_format"
    name: str


@dataclass(frozen=True)
class SpecialFloat:
    TAG: ClassVar[str] = "float"
    name: str  # "inf", "-inf" or "nan"


TAGGED_ARGS: tuple[type, ...] = (
    Buf,
    Sym,
    SymBool,
    SymFloat,
    DType,
    Device,
    Layout,
    MemoryFormat,
    SpecialFloat,
)
# Which values each tag admits, where the set is closed; the loader refuses anything else.
ARG_VALUES: dict[type, frozenset[str]] = {
    Device: frozenset({"runtime"}),
    Layout: frozenset({"strided"}),
    MemoryFormat: frozenset({"contiguous_format", "preserve_format", "channels_last"}),
    SpecialFloat: frozenset({"inf", "-inf", "nan"}),
}
# A step argument: a JSON scalar, a tagged record, or a list of arguments.
Arg = (
    None
    | bool
    | int
    | float
    | str
    | Buf
    | Sym
    | SymBool
    | SymFloat
    | DType
    | Device
    | Layout
    | MemoryFormat
    | SpecialFloat
    | list
)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype and shape; each size is expression text (``"768"``, ``"batch*seq"``).

    ``order``: the dims from the outermost in memory to the innermost, where the codegen lays the
    tensor out other than row-major (``(0, 2, 3, 1)``: channels-last); empty for row-major
    (``aot.layout``)."""

    dtype: str
    shape: tuple[str, ...]
    order: tuple[int, ...] = field(default=(), metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class NamedTensor:
    name: str
    spec: TensorSpec


@dataclass(frozen=True)
class SymbolSource:
    """Where a symbol's value is read at call time: ``inputs[input].shape[dim]``."""

    symbol: str
    input: str
    dim: int


@dataclass(frozen=True)
class Step:
    """One step of the program.

    ``StepKind.ATEN``: ``target`` is an ATen overload (``aten.addmm.default``) called with
    ``args``/``kwargs``; its results bind to ``outputs`` (``None`` for results nobody uses).
    ``StepKind.KERNEL``: ``target`` is a kernel id from ``Program.kernels``; ``args`` are the
    kernel's runtime arguments in parameter order (``Buf`` for pointers, ``Sym`` for sizes),
    ``grid`` its launch grid, and ``reference`` the ATen steps it replaces (what the CPU path runs
    and ``aotpack verify`` compares against).

    ``in_place`` (kernel steps only): output → the buffer among ``args`` that the kernel writes in
    place, which that output then names (no memory of its own). Only a program's state (and what
    aliases it) may be written so (``aot.aten.state_writes_checked``): a decode attention kernel
    appends the step's keys and values to its KV cache as the ``index_put_`` steps of its
    reference do.
    """

    kind: StepKind
    target: str
    args: tuple[Arg, ...]
    kwargs: dict[str, Arg]
    outputs: tuple[str | None, ...]
    grid: tuple[str, ...] = ()
    reference: tuple[Step, ...] = ()
    in_place: dict[str, str] = field(default_factory=dict, metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class KernelParam:
    name: str
    kind: ParamKind
    dtype: str = ""


@dataclass(frozen=True)
class Kernel:
    """A fused Triton kernel: source kept for review, cubins per arch, launch metadata."""

    id: str
    name: str
    source: str
    params: tuple[KernelParam, ...]
    num_warps: int
    num_stages: int
    shared: dict[str, int]  # arch -> dynamic shared memory bytes
    archs: tuple[str, ...]
    ops: tuple[str, ...]  # the ATen ops it fuses
    config: dict[str, Any]  # block sizes and the heuristic that chose them
    bytes_moved: str  # estimate of bytes read + written, as expression text
    scratch_params: int = 2  # trailing pointer params Triton's ABI appends
    # the archs whose cubin waits for the kernel before it (griddepcontrol.wait) before touching
    # memory: there the loader may launch it early (programmatic dependent launch)
    dependent_launch: tuple[str, ...] = field(default=(), metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class TreeSpec:
    """The structure of a model's outputs, so the runner returns what the model returned.

    ``kind``: ``TENSOR`` (the next flat output), ``NONE``, ``TUPLE``, ``LIST``, ``DICT``, or
    ``RECORD`` (a dataclass, named tuple or HF ``ModelOutput``: ordered ``keys``, its class named
    in ``type`` for display; the loader returns an ``aot.pytree.Record``, never the class).
    """

    kind: TreeKind
    type: str = ""
    keys: tuple[str, ...] = ()
    children: tuple[TreeSpec, ...] = ()


@dataclass(frozen=True)
class GemmCandidate:
    """A Triton form of one GEMM site: ``steps`` (kernel steps; the split-K form has two) compute
    the site's outputs from its inputs; the last step's ``reference`` is the library steps it
    replaces. ``buckets``: the bucket sizes (symbol → size) it was compiled for and may be chosen at.
    """

    name: str  # "tile_16x64x128", "splitk4_16x64x128"
    steps: tuple[Step, ...]
    buckets: tuple[dict[str, int], ...] = ()


@dataclass(frozen=True)
class GemmSite:
    """A library GEMM of the program (and the epilogue kernel it absorbs): ``library`` are the
    indices in ``Program.steps`` of the steps a candidate replaces (ascending), ``outputs`` the
    buffers the site hands to later steps; ``m``/``n``/``k`` its shape (``m`` as size text)."""

    id: str  # "gemm_3"
    library: tuple[int, ...]
    outputs: tuple[str, ...]
    m: str
    n: int
    k: int
    candidates: tuple[GemmCandidate, ...]


# Fields written only when they hold something: a bundle that does not use them keeps the bytes
# of the schema that had none.


@dataclass(frozen=True)
class Program:
    """A straight-line program over named buffers with symbolic sizes.

    ``variants``: further programs of the same model, each traced under its own guards (e.g. a
    ``batch == 1`` specialization beside the general trace, or another entry point such as
    ``decode``); ``Manifest.programs`` holds their guards, in the same order after this one's.
    They share this program's weights, and its state.

    ``state``: the inputs the runner owns (``Input(state=True)``, a KV cache), by name; they are
    among ``inputs``. Only ``aot.allowed_ops.STATE_WRITE_OPS`` steps write, and only into them
    (or into a state write's result, which aliases its state).

    ``scratch``: buffers of ``buffers`` that kernels keep between their programs (the arrival
    counters of a kernel whose last program combines the others' partials), by name: the runner
    allocates each once, at its largest, zeroed, and passes the same memory to every call; no step
    writes one as an output, and a kernel that changes one leaves it zeroed when it ends. The
    dataflow treats them as given, as the weights.
    """

    inputs: tuple[NamedTensor, ...]
    weights: tuple[NamedTensor, ...]
    buffers: dict[str, TensorSpec]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    symbols: tuple[SymbolSource, ...]
    kernels: tuple[Kernel, ...] = ()
    output_tree: TreeSpec | None = None
    variants: tuple[Program, ...] = ()
    alternatives: tuple[GemmSite, ...] = field(default=(), metadata=OMIT_EMPTY)
    state: tuple[str, ...] = field(default=(), metadata=OMIT_EMPTY)
    scratch: tuple[str, ...] = field(default=(), metadata=OMIT_EMPTY)
    # a causal LM's decode step: the kernel (of ``kernels``) that picks each row's greedy token
    # and writes the next step's inputs between two steps (``aot.codegen.greedy``), which the
    # loader's decode blocks launch with a workspace of their own; no step launches it
    greedy: str = field(default="", metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class InputGuard:
    """Declared contract of one input: dtype, rank, and per-dim size (int text or symbol).

    ``state``: the runner owns it (a KV cache): allocated once at its largest size, never passed
    by the caller; a call on ``b`` rows of its first dim sees rows ``0..b-1``."""

    name: str
    dtype: str
    shape: tuple[str, ...]
    state: bool = False


@dataclass(frozen=True)
class GuardSource:
    """One guard discovered while tracing, with the user's line that caused it."""

    text: str  # its effect, simplified: "seq >= 9", "seq % 2 == 0"
    file: str
    line: int
    code: str


@dataclass(frozen=True)
class SymbolGuard:
    """A dynamic symbol's admissible set: ``min <= v <= max``, ``v % modulus in residues``,
    ``v not in excluded``; ``declared_*`` is what the model file asked for (``declared_multiple``:
    its ``Dim(..., multiple_of=m)``, 0 when it declared none).

    ``rows_independent``: the build proved that every program keeps the rows along this symbol
    apart (``aot.rows``) and confirmed it on the eager model, so a server may join requests along
    it; ``rows_check`` says what was checked, or why they are not independent (empty: not checked,
    e.g. a bundle older than the check)."""

    name: str
    declared_min: int
    declared_max: int
    min: int
    max: int
    modulus: int = 1
    residues: tuple[int, ...] = (0,)
    excluded: tuple[int, ...] = ()
    sources: tuple[GuardSource, ...] = ()
    rows_independent: bool = field(default=False, metadata=OMIT_EMPTY)
    rows_check: str = field(default="", metadata=OMIT_EMPTY)
    declared_multiple: int = field(default=0, metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class Relation:
    """A residual guard over several symbols, as a boolean expression."""

    expr: str
    source: GuardSource


@dataclass(frozen=True)
class Environment:
    """What the serving host must offer. ``cuda_built``: per arch, the CUDA release of the ptxas
    that compiled its cubins (``{"sm_80": "12.9", "sm_90": "13.4"}``); a driver of an older CUDA
    major cannot load them (the loader checks). Empty when the bundle has no kernels."""

    archs: tuple[str, ...]
    torch_built: str
    torch_min: str
    triton_built: str
    python_built: str
    cuda_built: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Guards:
    inputs: tuple[InputGuard, ...]
    symbols: tuple[SymbolGuard, ...]
    relations: tuple[Relation, ...]
    specializations: tuple[GuardSource, ...] = ()


@dataclass(frozen=True)
class Bucket:
    """CUDA-graph sizes for one symbol; ``paddable`` only when the build checked padding."""

    symbol: str
    sizes: tuple[int, ...]
    paddable: bool = False
    pad_check: str = ""  # what the build checked, e.g. "max abs diff 0 on real rows at seq=3->4"


@dataclass(frozen=True)
class ProgramEntry:
    """One program of the bundle: the guards a call must satisfy to run it, and its buckets.

    A call runs the first program whose guards admit it; ``Manifest.guards`` is the bundle's
    contract as a whole (every size some program admits)."""

    name: str  # what it covers, e.g. "batch == 1"; "general" for the first
    guards: Guards
    buckets: tuple[Bucket, ...]
    # The entry point it serves (``aot.spec.EntryPoint``: "prefill", "decode"); "" in a bundle
    # without named entry points. A call of an entry point runs the first of its programs that
    # admits it.
    entry: str = ""


@dataclass(frozen=True)
class BucketMemory:
    """The peak activation memory a CUDA-graph capture at these sizes holds."""

    sizes: dict[str, int]
    peak_bytes: int


@dataclass(frozen=True)
class BuildStats:
    """What the build did and measured, for ``aotpack inspect`` and for verification."""

    steps: int = 0  # steps of the first program
    aten_ops_replaced: int = 0  # ATen ops the first program stands for (kernels counted by what they fuse)
    kernels: int = 0  # distinct kernels, all programs
    kernel_steps: int = 0  # kernel launches of the first program
    aten_ops_fused: int = 0
    fallbacks: int = 0  # kernels that failed to compile and stayed ATen calls
    unfused_ops: int = 0  # ops the fuser does not know (library calls)
    activations_folded: int = 0
    weights_padded: int = 0
    weights_bytes: int = 0
    programs: int = 1
    # Half-precision models: how far eager at the model dtype is from eager float32 on the example
    # inputs, relative to the output scale (what ``aotpack verify`` may expect at best).
    reference_noise: float = 0.0
    memory_plan: tuple[BucketMemory, ...] = ()  # one per bucket combination, largest first


@dataclass(frozen=True)
class Member:
    sha256: str
    size: int
    # The sha256 of each ``chunk_bytes`` of the member in order (the last chunk may be shorter),
    # so a loader checks its chunks on several threads at once; the packager writes them for
    # weights larger than one chunk. Empty: ``sha256`` over the whole member is its check.
    chunk_bytes: int = field(default=0, metadata=OMIT_EMPTY)
    chunk_sha256: tuple[str, ...] = field(default=(), metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class Manifest:
    format: str
    schema_version: tuple[int, int]
    name: str
    dtype: str
    guards: Guards
    environment: Environment
    buckets: tuple[Bucket, ...]
    members: dict[str, Member]
    ops: tuple[str, ...]  # every ATen overload the program calls; the loader checks they exist
    stats: BuildStats = BuildStats()
    # When set, WEIGHTS_PATH is not inside the archive but in this file beside it (``--split-weights``);
    # its sha256 and size are still in ``members``.
    external_weights: str = ""
    # Empty for a bundle of one program (its guards and buckets are the fields above); else one
    # entry per program, in dispatch order: ``Program`` itself, then ``Program.variants``.
    programs: tuple[ProgramEntry, ...] = ()


@dataclass(frozen=True)
class TuningChoice:
    """One GEMM site at one bucket, as ``aotpack tune`` measured it: median microseconds per
    form (``"library"`` and each candidate that matched the library's results), the candidates
    refused for differing results, and the form chosen (``"library"`` unless a candidate won by
    ``TuningTable.min_gain``)."""

    program: int  # 0: the first program, i: its variant i - 1
    site: str
    sizes: dict[str, int]
    choice: str
    times_us: dict[str, float]
    rejected: tuple[str, ...] = ()


@dataclass(frozen=True)
class TuningCheck:
    """One bucket's whole program, timed with every site's library steps and with the bucket's
    chosen candidates: the choices stand only when the whole program is faster with them (a GEMM
    timed alone can win where, among its neighbours, it does not); ``kept`` false: every site of
    the bucket was set back to ``"library"``.

    ``library_free``: the choices stand (``kept``) without that gain, because with them every GEMM
    site of every bucket runs a candidate and no call at a bucket loads cuBLAS; ``tuned_us`` is
    then the whole program with that plan, timed beside ``library_us`` (at most tune's
    ``FREE_MAX_LOSS`` slower)."""

    program: int
    sizes: dict[str, int]
    library_us: float
    tuned_us: float
    kept: bool
    library_free: bool = field(default=False, metadata=OMIT_EMPTY)
    # the choices are a whole plan: every site on its fastest candidate that matched the library
    # (every site, or those within tune's NEAR_LOSS of the library alone), taken because the whole
    # program ran faster with it than with the choices made site by site (a kernel among kernels
    # launched early, programmatic dependent launch, gains what it does not alone)
    whole_plan: bool = field(default=False, metadata=OMIT_EMPTY)


@dataclass(frozen=True)
class TuningTable:
    """``TUNING_PATH``: what ``aotpack tune`` chose on a GPU of ``arch``; applied only there."""

    format: str  # "aotpack-tuning"
    arch: str  # "sm_90"
    device: str  # the GPU's name, for the reader
    min_gain: float  # the fraction a candidate had to win by
    choices: tuple[TuningChoice, ...]
    checks: tuple[TuningCheck, ...] = ()  # per bucket where some site chose a candidate


RECORDS: tuple[type, ...] = (
    TensorSpec,
    NamedTensor,
    SymbolSource,
    *TAGGED_ARGS,
    Step,
    KernelParam,
    Kernel,
    TreeSpec,
    GemmCandidate,
    GemmSite,
    Program,
    InputGuard,
    GuardSource,
    SymbolGuard,
    Relation,
    Environment,
    Guards,
    Bucket,
    ProgramEntry,
    BucketMemory,
    BuildStats,
    Member,
    Manifest,
    TuningChoice,
    TuningCheck,
    TuningTable,
)
ENUMS: tuple[type[enum.Enum], ...] = (StepKind, ParamKind, TreeKind)
