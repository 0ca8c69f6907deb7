"""Where a decode step's kernels wait for memory, read from their sm_90 machine code, no GPU.

At a few rows a decode kernel runs as a few hundred programs or fewer, so nothing hides a wait
for memory: what a kernel costs beyond its bytes is how many times in a row each thread waits for
a load. ptxas orders the loads, not the source: it may move a sum up between two loads (so the
second is issued only after the first's data is back), and a load written after a reduction (a
bias, a norm's weight) waits for it. This script builds one of ``bench/decode.py``'s models (its
first layers) for sm_90 on the CPU, compiles every kernel of a bucket's decode plan, disassembles
it (``nvdisasm`` from Triton's bundle) and counts, per kernel, the global loads before the wait
for the kernel before (``griddepcontrol.wait``, SASS ``ACQBULK``: weights, which stream while the
kernel before runs) and after it, and the waves after it: runs of loads ended by the first
instruction that reads a register one of them is still filling. One wave after the wait is the
least a kernel that reads the kernel before's output can have. For a tensor-core form it also
counts the instructions and block barriers after the wait before its K loop's first asynchronous
copy (``before_first_copy``). Asynchronous copies (a tensor-core form's pipeline: ``LDGSTS``,
TMA) are not counted among the loads, nor constant-table loads (``LDG.E.CONSTANT``:
libdevice's cos/sin reading its table on the slow path for huge arguments, a branch a decode step
never takes; counted, Llama 3's rotary-angle kernel showed 17 waves). A static count: it says
where a kernel can wait, not how long; the split decode attention's waves cut from 6 to 3
(2026-12-02: its combine loading every partial at once, the mask row before the dot) timed no
faster, while the biases' second wave (``EARLY_BIAS``) was 7-10% of GPT-2's step at one row.

    python3 bench/sass_waves.py --model gpt2 --rows 1          # about a minute on the CPU box
    python3 bench/sass_waves.py --model llama-3.2-1b --rows 8 --layers 2
    python3 bench/sass_waves.py --model-file models/gpt.py --bucket 1,128   # a forward's plan

Found with it (2026-12-02): the split-K reduce that runs the next norm took 4 waves at
Llama-3.2-1B's rows and 13 at GPT-2's (now 1-4, ``gemm_render.render_reduce_norm``); every
one-row GEMV with a bias loads it after its sum's block barrier (a second wave;
``gemm_render.EARLY_BIAS``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_INSTR = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*(.*?);")
_WIDTH = {"64": 2, "128": 4}  # registers an LDG fills, by its width suffix


def _counted_load(op: str) -> bool:
    """A global load the waves count: not an asynchronous copy (``LDGSTS``) nor a constant-table
    load (``LDG.E.CONSTANT``)."""
    return (op == "LDG" or op.startswith("LDG.")) and ".CONSTANT" not in op


def _at_the_wait(sass: str) -> tuple[str, str]:
    """A kernel's SASS before and after the wait for the kernel before (``ACQBULK``); all of it
    after where it has none."""
    before, _, after = sass.partition("ACQBULK") if "ACQBULK" in sass else ("", "", sass)
    return before, after


def waves(sass: str) -> tuple[int, int, int]:
    """(loads before ``ACQBULK``, loads after it, waves after it) of a kernel's SASS."""
    before, after = _at_the_wait(sass)
    pending: set[int] = set()
    count, loads, in_wave = 0, 0, False
    for op, args in _INSTR.findall(after):
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", args)]
        if _counted_load(op):
            loads += 1
            count += not in_wave
            in_wave = True
            first = regs[0]
            pending.update(range(first, first + _WIDTH.get(op.rsplit(".", 1)[-1], 1)))
            continue
        sources = regs if op.startswith(("ST", "RED", "ATOM")) else regs[1:]
        if pending & set(sources):
            pending.clear()
            in_wave = False
    return sum(_counted_load(op) for op, _ in _INSTR.findall(before)), loads, count


_ASYNC = ("LDGSTS", "UTMALDG", "UBLKCP")  # asynchronous copies: a tensor-core form's pipeline


def before_first_copy(sass: str) -> tuple[int, int] | None:
    """(instructions, block barriers) after the wait before a kernel's first asynchronous copy
    (its K loop's pipeline starting); None where it makes none. Its work before the loop (loads
    whose data it waits for, reductions across its threads) holds the loop's first copies back:
    the statistics join's second tile ran 205-413 instructions and 5-12 barriers there before
    2026-12-06, 66-220 and none after, and timed 0.3-2.0% faster at 8-16 rows."""
    ops = [op for op, _ in _INSTR.findall(_at_the_wait(sass)[1])]
    first = next((i for i, op in enumerate(ops) if op.startswith(_ASYNC)), None)
    if first is None:
        return None
    return first, sum(op.startswith("BAR") for op in ops[:first])


def after_the_copies(sass: str) -> int | None:
    """Global loads after a kernel's last asynchronous copy (its K loop's last tiles, looped or
    unrolled): a load there is a round trip to memory at the kernel's end (an early-loaded W
    step's A tile, read after the loop unless ``gemm_render.HOLD_EARLY_A`` holds it from the wait
    on; an epilogue's operand); None where the kernel makes no asynchronous copy."""
    found = _INSTR.findall(_at_the_wait(sass)[1])
    last = max((i for i, (op, _) in enumerate(found) if op.startswith(_ASYNC)), default=None)
    if last is None:
        return None
    return sum(_counted_load(op) for op, _ in found[last + 1 :])


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _run_on(cubin: bytes, *args: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([*args, str(path)], capture_output=True, text=True, check=True).stdout


def sass(cubin: bytes) -> str:
    """``cubin``'s machine code as ``nvdisasm`` prints it."""
    return _run_on(cubin, _tool("nvdisasm"), "-c")


def registers(cubin: bytes) -> int:
    """The registers a thread of ``cubin``'s kernel takes (``cuobjdump -res-usage``): with the
    warps, how many of its blocks an SM holds at once."""
    found = re.search(r"\bREG:(\d+)", _run_on(cubin, _tool("cuobjdump"), "-res-usage"))
    if found is None:
        raise ValueError("cuobjdump -res-usage printed no register count")
    return int(found.group(1))


def _decode_plan(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The decode program of one of ``bench/decode.py``'s models (its first ``--layers``) and
    its plan at ``--rows``."""
    import decode

    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.tracer import trace
    from aot.tuning import tuned_plans

    os.environ[decode.LAYERS_ENV] = str(args.layers)
    cls, cfg = decode.config(args.model, False)
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    buckets = tuple(sorted({1, 8, args.rows}))  # a dynamic batch, as bench/decode.py builds it
    spec = causal_lm(
        lambda: decode.instantiate(cls, cfg),
        max_batch=max(buckets),
        max_context=args.context,
        dtype=decode.dtype_name(args.model, "cuda"),  # as bench/decode.py builds it for the GPU
        name=args.model,
        batch_buckets=buckets,
        attn_implementation=decode.ATTENTION.get(args.model),
    )
    compiled = generate(trace(spec), ("sm_90",))
    program = compiled.program.variants[-1] if compiled.program.variants else compiled.program
    index = [compiled.program, *compiled.program.variants].index(program)
    plan = tuned_plans(compiled.tuning, index, program, "sm_90")
    (steps,) = [p for key, p in plan.items() if key[-1] == args.rows]  # a key ends with its batch bucket
    return program, steps, f"{args.model}, {args.layers} layers, decode plan at {args.rows} rows (sm_90)"


def _file_plan(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The (first) program of a model file, as ``aotpack build`` traces it, and its plan at the
    bucket ``--bucket`` (one size per symbol, in the program's order, e.g. ``1,128`` for
    models/gpt.py's batch and sequence)."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace
    from aot.tuning import tuned_plans

    compiled = generate(trace(load_model_file(args.model_file)), ("sm_90",))
    plan = tuned_plans(compiled.tuning, 0, compiled.program, "sm_90")
    key = tuple(int(v) for v in args.bucket.split(","))
    if key not in plan:
        raise SystemExit(f"--bucket {args.bucket}: the plans' buckets are {sorted(plan)}")
    return compiled.program, plan[key], f"{args.model_file}, plan at bucket {key} (sm_90)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2", help="one of bench/decode.py's models")
    ap.add_argument("--rows", type=int, default=1, help="the batch bucket whose decode plan is read")
    ap.add_argument("--layers", type=int, default=2, help="the model's first N layers")
    ap.add_argument("--context", type=int, default=512, help="the cache's slots")
    ap.add_argument("--model-file", type=Path, help="a model file's forward instead (e.g. models/gpt.py)")
    ap.add_argument("--bucket", default="1,128", help="with --model-file: the plan's bucket, a size a symbol")
    ap.add_argument("--dump", type=Path, help="also write each kernel's source and SASS into this folder")
    args = ap.parse_args()
    sys.path[:0] = [str(HERE), str(ROOT)]

    from aot.codegen.compile import Job, _compile
    from aot.codegen.triton_types import STORAGE
    from aot.schema import ParamKind, StepKind

    program, steps, title = _file_plan(args) if args.model_file else _decode_plan(args)
    kernels = {k.id: k for k in program.kernels}
    print(title)
    print(
        f"{'kernel':64s} {'warps':>5s} {'registers':>9s} {'loads before the wait':>22s} {'after':>6s} "
        f"{'waves after':>12s} {'before the first copy':>22s} {'after the copies':>16s}"
    )
    seen: set[str] = set()
    for step in steps:
        if step.kind != StepKind.KERNEL or step.target in seen:
            continue
        seen.add(step.target)
        k = kernels[step.target]
        sig = {p.name: "*" + STORAGE[p.dtype] if p.kind == ParamKind.PTR else p.kind.value for p in k.params}
        cubin, _ = _compile(Job(k.id, k.name, k.source, sig, k.num_warps, k.num_stages, "sm_90"))
        text = sass(cubin)
        pre, post, count = waves(text)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{k.name}.py").write_text(k.source)
            (args.dump / f"{k.name}.sass").write_text(text)
        copy = before_first_copy(text)
        start = "-" if copy is None else f"{copy[0]} ({copy[1]} barriers)"
        tail = after_the_copies(text)
        print(
            f"{k.name[:64]:64s} {k.num_warps:5d} {registers(cubin):9d} {pre:22d} {post:6d} {count:12d} "
            f"{start:>22s} {'-' if tail is None else str(tail):>16s}"
        )


if __name__ == "__main__":
    main()
