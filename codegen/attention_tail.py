"""The decode attention run at the end of the q/k/v projection's GEMV: one launch less a layer.

At one row (a decode step at batch 1) a layer's q/k/v projection is a GEMV (a ``vec_*`` form: a
program per BLOCK_N columns of W) and its decode attention (``aot.codegen.decode_attention``) a
kernel of one program per (row, KV head) reading the rows the GEMV wrote. Here one kernel does
both:

- the GEMV's programs are taken KV head by KV head: program p computes column block
  ``column_block(p)``, the head ``p // TAIL_PROGRAMS``'s query heads' columns first, then its
  key's, then its value's (the rows q | k | v as the attention reads them: every head's queries,
  then the keys, then the values, each head's columns side by side);
- once its columns are stored each program counts its arrival on its (row, KV head)'s int32
  counter (a CTA barrier, then one ``atomic_add`` with acquire-release semantics at GPU scope, as
  the split decode attention's combine does); the one that arrives last runs that head's attention
  (the one-kernel attention's body as a function of the program it stands for, its q and new keys
  and values loaded ``.cg``: from L2, where the other programs stored them) and stores 0 to the
  counter, so every launch leaves the counters zeroed (``Program.scratch``).

So the heads whose columns are done first run their attention while later programs still stream
W, and the attention's launch goes: 4 kernels a Llama layer at batch 1 (q/k/v with the attention,
o, gate/up, down). The kernel runs the GEMV's warps, so the GEMV sums over K in its own order and
the greedy tokens are the two kernels' (the attention's blocks and rounding as in its own kernel).
``AOTPACK_ATTENTION_TAIL`` ("on"/"off") overrides ``ENABLED`` at build time;
``AOTPACK_ATTENTION_TAIL_WARPS`` the joined kernel's warps and ``AOTPACK_ATTENTION_TAIL_BLOCK`` the
attention's blocks of slots at most, for measuring.

Measured slower, so off. Llama-3.2-1B's first 8 layers at batch 1, a 160-slot cache:

- H100 (2026-12-05, ``bench/decode_paired.py``, 10 rounds; ``bench/results/decode/paired-llama-
  3.2-1b-8layers-b1-attention-tail-h100-2026-12-05.json``): 0.6552 ms a token against 0.5821 with
  the attention a kernel of its own (slower in 10 of 10 rounds), 37 launches a step against 45;
  the same at 2 warps (255 registers and a spill) and at 8 (80 registers).
- H200 (2026-12-05, second session; ``bench/decode.py --profile``, the chain's charges in
  ``bench/results/decode/profile-llama-3.2-1b-8layers-b1-attention-tail{,-off}-critical-h200-
  2026-12-05b.txt``), 8 warps: 0.538 against 0.447 ms a token. The joined kernel is charged 17.9 us
  a layer where q/k/v's GEMV and the attention are charged 4.5 + 5.1, and gate/up after it 21.4
  against 18.3.

What it costs is the joined kernel's residency: a kernel has one register count and one warp count
for all its programs, and the attention's set them. q/k/v's GEMV alone (2 warps, 100 registers,
sm_90 cubin built here) keeps 9 programs resident an SM; joined, 8 warps at 80 registers keep 3
and 2 warps at 255 keep 4 (2 warps with the attention's blocks at 64 slots, 165 registers: 6). So
the 1,536 programs that loaded their W before the wait under dependent launch become a few waves
that each load W after the one before ends, and the head whose programs end last runs its
attention only then, its cache loaded after its arrival. The launch saved (about 1 us) does not
pay for that. ``aotpack verify`` passes with both warp counts (Llama-3.2-1B's and Qwen3-0.6B's
shapes, 2 layers); at the GEMV's warps the 40 greedy tokens equal the two kernels'. At 8 warps they
parted at step 14 (float32 scoring: 10 of 128 steps off float32's choice against 2, largest logit
gap 0.049 against 0.017), hence the GEMV's warps by default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aot.codegen.decode_attention_render import row_sources
from aot.codegen.decode_sites import DecodeSite
from aot.codegen.kernel_source import module_head, on_off, setting
from aot.codegen.render import Rendered
from aot.schema import Buf, Kernel, KernelParam, ParamKind, Step

ENABLED = "off"  # measured slower: the module docstring
ENV = "AOTPACK_ATTENTION_TAIL"
WARPS_ENV = "AOTPACK_ATTENTION_TAIL_WARPS"
BLOCK_ENV = "AOTPACK_ATTENTION_TAIL_BLOCK"  # the attention's blocks of slots at most (its registers)
PREFIX = "A_"  # the attention kernel's constants, renamed apart from the GEMV's
_CONST = re.compile(r"^(\w+) = tl\.constexpr\((.*)\)")


def enabled() -> bool:
    return on_off(ENV, ENABLED)


def max_block_n() -> int:
    """The tail attention's blocks of slots at most: ``BLOCK_ENV`` where set, else 0 (the
    attention kernel's own)."""
    given = setting(BLOCK_ENV, None, ("16", "32", "64", "128", "256"))
    return 0 if given is None else int(given)


def _warps(gemv: Kernel) -> int:
    """The joined kernel's warps: ``WARPS_ENV`` where set, else the GEMV's, so that it sums over K
    in its own order (the greedy tokens are the two kernels'; more warps take fewer registers a
    thread: Llama-3.2-1B's q/k/v at 160 slots, sm_90, 2 warps 255 registers and a spill, 8 warps
    80, neither faster)."""
    given = setting(WARPS_ENV, None, ("2", "4", "8", "16"))
    return gemv.num_warps if given is None else int(given)


@dataclass(frozen=True)
class _Module:
    """A kernel module as ``kernel_source.kernel_module`` writes it: its docstring's lines, its
    constants (name -> value text), the function's name, parameters and body lines (indented
    once)."""

    doc: list[str]
    consts: dict[str, str]
    name: str
    params: list[str]
    body: list[str]


def _parse(source: str) -> _Module | None:
    head, sep, func = source.partition("@triton.jit\n")
    if not sep or not head.startswith('"""'):
        return None
    doc = head[3:].split('"""', 1)[0].rstrip("\n").split("\n")
    consts = {}
    for line in head.split("\n"):
        m = _CONST.match(line)
        if m:
            consts[m[1]] = m[2]
    lines = func.rstrip("\n").split("\n")
    m = re.match(r"^def (\w+)\((.*)\):$", lines[0])
    if m is None or any(ln and not ln.startswith("    ") for ln in lines[1:]):
        return None
    return _Module(doc, consts, m[1], [p.strip() for p in m[2].split(",")], lines[1:])


def _without_gdc(body: list[str]) -> list[str]:
    """``body`` less its ``if GDC:`` blocks (the wait for the kernel before: the GEMV's, already
    passed where the attention runs)."""
    out, skip = [], None
    for ln in body:
        indent = len(ln) - len(ln.lstrip())
        if skip is not None and indent > skip:
            continue
        skip = None
        if ln.strip().startswith("if GDC:"):
            skip = indent
            continue
        out.append(ln)
    return out


def _renamed(lines: list[str], names) -> list[str]:
    if not names:
        return lines
    pattern = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
    return [pattern.sub(lambda m: PREFIX + m[1], ln) for ln in lines]


def tail_kernel(
    gemv: Kernel, step: Step, n: int, attention: Rendered, site: DecodeSite, counts: str
) -> Rendered | None:
    """The GEMV ``gemv`` (the last step of a candidate of a site of ``n`` columns, launched by
    ``step``) with ``attention`` (``render_decode_attention_tail`` of ``site``, which reads the rows the GEMV
    writes) as its tail, counting on ``counts`` (module docstring); None where the GEMV is not a
    one-row form this joins or its rows are not q | k | v as laid out above."""
    config = gemv.config
    if config.get("kind") != "gemm" or not str(config.get("candidate", "")).startswith("vec_"):
        return None
    if config.get("BLOCK_M") != 1 or config.get("split_k", 1) != 1 or len(step.grid) != 2:
        return None
    bn, d, heads, kv = config.get("BLOCK_N"), site.head_dim, site.heads, site.kv_heads
    if site.append is None or not isinstance(bn, int) or d % bn:
        return None
    q, k, v = row_sources(site)
    one_row = site.batch == "1"  # (where the batch is one row its stride is never taken)
    layout = [(r.base, n if one_row else r.batch_stride, r.column, r.head_stride) for r in (q, k, v)]
    rows = step.outputs[0] if step.outputs else None
    expected = [(rows, n, 0, 0), (rows, n, heads * d, 0), (rows, n, (heads + kv) * d, 0)]
    if layout != expected or n != (heads + 2 * kv) * d or step.grid[0] != str(n // bn):
        return None
    g_mod, a_mod = _parse(gemv.source), _parse(attention.source)
    if g_mod is None or a_mod is None or "tl.program_id(0)" not in "\n".join(g_mod.body):
        return None
    a_consts = {k: v for k, v in a_mod.consts.items() if k != "GDC"}
    if {PREFIX + k for k in a_consts} & set(g_mod.consts) or any(p.startswith("a_") for p in g_mod.params):
        return None  # (never so: the GEMV's constants are BLOCK_* and GDC, its pointers x, w, out)
    q_blocks, kv_blocks = heads * d // bn, kv * d // bn  # column blocks of q, and of k (or v)
    per_q, per_kv = q_blocks // kv, d // bn  # one KV head's: of its query heads, of its key
    tail = per_q + 2 * per_kv
    a_name = f"{a_mod.name}_of"
    a_body = _renamed(_without_gdc(a_mod.body), a_consts)
    pid_line = "    pid = tl.program_id(0).to(tl.int64)"
    if pid_line not in a_body:
        return None
    a_body[a_body.index(pid_line)] = (
        "    pid = tail_pid.to(tl.int64)  # the (row, KV head) this call stands for"
    )
    a_params = [f"a_{p}" for p in a_mod.params]
    g_body = [ln.replace("tl.program_id(0)", "column_block") for ln in g_mod.body]
    comment, g_body = g_body[0], g_body[1:]
    head_lines = [
        "tail_head = tl.program_id(0) // TAIL_PROGRAMS  # the KV head whose columns this program computes",
        "tail_at = tl.program_id(0) % TAIL_PROGRAMS",
        "column_block = tl.where(",
        "    tail_at < TAIL_Q,",
        "    tail_head * TAIL_Q + tail_at,  # its query heads' columns",
        "    tl.where(",
        "        tail_at < TAIL_Q + TAIL_KV,",
        "        Q_BLOCKS + tail_head * TAIL_KV + tail_at - TAIL_Q,  # its key's",
        "        Q_BLOCKS + KV_BLOCKS + tail_head * TAIL_KV + tail_at - TAIL_Q - TAIL_KV,  # its value's",
        "    ),",
        ")",
    ]
    tail_lines = [
        "# this program's columns stored: the last of its KV head's programs runs the head's attention",
        "tl.debug_barrier()  # every thread's stores before the arrival (which releases them)",
        "tail_pid = tl.program_id(1) * A_KV_HEADS + tail_head",
        "arrived = tl.atomic_add(count_ptr + tail_pid, 1, sem='acq_rel', scope='gpu')",
        "if arrived == TAIL_PROGRAMS - 1:  # the head's q, k and v are stored: its attention, then the counter zeroed",
        f"    {a_name}(tail_pid, {', '.join(a_params)})",
        "    tl.store(count_ptr + tail_pid, 0)",
    ]
    params = [*g_mod.params, *a_params, "count_ptr"]
    consts = {
        **g_mod.consts,
        "TAIL_PROGRAMS": tail,
        "TAIL_Q": per_q,
        "TAIL_KV": per_kv,
        "Q_BLOCKS": q_blocks,
        "KV_BLOCKS": kv_blocks,
        **{PREFIX + k: v for k, v in a_consts.items()},
    }
    consts.pop("GDC")
    name = f"{gemv.name}_attention"
    doc = [
        g_mod.doc[0].rstrip(".")
        + ", then the decode attention of each KV head (aot.codegen.attention_tail).",
        *g_mod.doc[1:],
        "",
        f"Programs taken KV head by KV head ({tail} a head: {per_q} column blocks of its query heads, {per_kv} of its",
        f"key, {per_kv} of its value); the last of a head's programs to store its columns runs:",
        "",
        *a_mod.doc,
    ]
    source = "\n".join(
        [
            *module_head(doc, consts),
            "@triton.jit",
            f"def {a_name}(tail_pid, {', '.join(a_mod.params)}):",
            *a_body,
            "",
            "",
            "@triton.jit",
            f"def {name}({', '.join(params)}):",
            comment,
            *("    " + ln for ln in head_lines),
            *g_body,
            *("    " + ln for ln in tail_lines),
        ]
    )
    signature = {
        **config["signature"],
        **{f"a_{p}": t for p, t in attention.signature.items()},
        "count_ptr": "*i32",
    }
    kernel_params = (
        *gemv.params,
        *(KernelParam(f"a_{p.name}", p.kind, p.dtype) for p in attention.params),
        KernelParam("count_ptr", ParamKind.PTR, "int32"),
    )
    warps = _warps(gemv)
    kept = {
        k: v
        for k, v in config.items()
        if k not in ("signature", "global_scratch_size", "profile_scratch_size")
    }
    return Rendered(
        name=name,
        source=source + "\n",
        signature=signature,
        params=kernel_params,
        args=(*step.args, *attention.args, Buf(counts)),
        outputs=(*step.outputs, *attention.outputs),
        grid=step.grid,
        num_warps=warps,
        num_stages=gemv.num_stages,
        config={
            **kept,
            "num_warps": warps,
            "attention": attention.config,
            "tail_programs": tail,
        },
        ops=tuple(dict.fromkeys((*gemv.ops, *attention.ops))),
        bytes_moved=f"({gemv.bytes_moved}) + ({attention.bytes_moved})",
    )
