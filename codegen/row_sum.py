"""Two one-row GEMVs joined across a residual add: the first adds the residual to its products
and writes the sum; the second's norm prologue reads that one row.

At one row (a decode step at batch 1) a pre-norm decoder layer's o and down projections hand their
products to the next GEMV (gate/up, the next layer's q/k/v), whose norm prologue
(``gemm_render._vec_steps_norm``, ``_vec_steps_ln``) adds the residual to them (two row inputs), rounds the sum as
the reference does, writes it for the steps after (its first N tile) and normalizes it. So every
block of that GEMV (1,536 of q/k/v and 4,096 of gate/up at Llama-3.2-1B's shapes) loads two rows
after its wait for the kernel before. Joined, the first GEMV's epilogue adds the residual to its
products as it would have stored them, one element per output, and stores the sum rounded as the
norm kernel rounds it; the second's prologue loads that row alone and writes nothing. The same
numbers, bit for bit: the add and its rounding are the norm kernel's own steps
(``RowNorm.row_ops`` before the sum), evaluated over the first's columns instead of the second's
K. A chain of plain GEMVs measured it 3.7% faster (``bench/prologue_reads.py``); in the build's
forms Llama-3.2-1B's whole step 0.4%, where GPT-2's (LayerNorms) lost 3% (``DEFAULT``: "rms").

Taken where both sites' forms are one-row GEMVs (``vec_*``: the second with its norm prologue)
and the second's norm is an RMSNorm-like row norm of one mean (``RowNorm.more`` empty) whose sum
later steps read (``RowNorm.sum_out``, before the statistics), computed from the row inputs alone
and rounded to its dtype, no other step of the norm reading the inputs or the values that make
the sum; or a LayerNorm of ``x + y`` whose sum later steps read (GPT-2's ``ln_1`` and ``ln_2``
after the mlp out and o projections, their biases added first). ``AOTPACK_ROW_SUM``: "rms"
(the default) joins before row norms (RMSNorms) alone, "on" before LayerNorms too, "off" nowhere.
Only one-row buckets change: the sites of the models measured (the example mlp and GPT,
transformers' GPT-2 and Llama as causal LMs) keep every other bucket's plan.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

from aot.codegen.gemm_prologue import RowNorm, row_load
from aot.codegen.gemm_render import (
    _early_biases,
    _epilogue_lines,
    _k_loop,
    _opening,
    _render_fused,
    _site_epilogue,
    _tag,
    split_index,
)
from aot.codegen.gemm_sites import Site
from aot.codegen.gemm_stats import _join_kernel
from aot.codegen.kernel_source import on_off
from aot.codegen.render import Rendered, kernel_id
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.errors import CodegenError
from aot.schema import TensorSpec
from aot.settings import setting

ENV = "AOTPACK_ROW_SUM"
# On: Llama-3.2-1B's 16 layers at batch 1 on an H100 (the residual loaded beside A's row; paired
# as below; decode/paired-llama-3.2-1b-b1-row-sum-h100-2026-12-06c.json): 0.9599 joined against
# 0.9637 ms a token apart (0.4% faster, 12 of 12 rounds), the same tokens; batches 8 and 32 run
# the same plans (1.098 / 1.095 and 1.218 / 1.214 in processes of their own). Before that:
# Llama-3.2-1B's first 8 layers at batch 1 on an H100 (bf16, 32 + 128 tokens, both bundles in
# one process, ``bench/decode_paired.py``, 12 rounds, 2026-12-06;
# decode/paired-llama-3.2-1b-8layers-b1-row-sum-h100-2026-12-06b.json): joined 0.5707 against
# 0.5698 ms a token apart (0.2% slower, apart faster in 12 of 12 rounds), the same tokens. The
# chain of plain GEMVs had promised 3.7% (``bench/prologue_reads.py``); in the build's forms the
# second's two row loads issue together, so dropping one saves little of its wait, while the first
# loaded the residual after its products (a memory latency at its end, on the step's chain). It
# now loads it right after the wait, beside A's row: the first 4 layers, paired the same way
# (decode/paired-llama-3.2-1b-4layers-b1-row-sum-early-h100-2026-12-06b.json), 0.3752 joined
# against 0.3761 apart (0.2% faster, 10 of 12 rounds), the same tokens. The join's other effect
# (joined sites take a form at a bucket only where both have one) leaves the plans of every
# bucket but one row's as they were in the models above; an H200 has not measured it.
# Not before LayerNorms: GPT-2's decode (fp16, 448 + 64 tokens, batch 1, paired as above, H100,
# 2026-12-06; decode/paired-gpt2-b1-row-sum-h100-2026-12-06d.json) took 0.2140 ms a token joined
# against 0.2075 apart (3.2% slower, apart faster in 12 of 12 rounds), the same tokens.
DEFAULT = "rms"
SETTINGS = ("rms", "on", "off")
# ptxas issues a global load where its value is first read: the residual, read by the epilogue
# alone, is issued after the products (sm_90 SASS, ``bench/sass_waves.py``: GPT-2's o and mlp out
# 2 waves of loads after the wait where 1 is the least, Llama-3.2-1B's o 2 and down 3), a memory
# latency at the kernel's end. Tied (``_tied``, ``AOTPACK_ROW_SUM_TIE=on``), its loads issue with
# A's row: GPT-2's o and mlp out 1 wave, Llama-3.2-1B's o 1 and down 2; but Qwen3-0.6B's down
# (K 3072, one row of W a block) 4 against 2, ptxas then interleaving A's loads with the
# products. Timed at batch 1 on an H100 (bf16/fp16, both bundles in one process, 12 rounds,
# 2026-12-06; decode/paired-gpt2-b1-row-sum-*-h100-2026-12-06e.json,
# decode/paired-llama-3.2-1b-b1-tie-off-vs-on-h100-2026-12-06e.json): GPT-2 joined before its
# LayerNorms 0.2067 tied against 0.2131 untied (the join's 3% loss gone) and 0.2067 apart (a tie:
# apart faster in 10 of 12 rounds by 0.2%); Llama-3.2-1B (16 layers) 0.9622 tied against 0.9586
# untied (0.3% slower, 0 of 12 rounds faster). Tokens equal. So off: it makes the LayerNorm join
# even, not a gain, and costs the RMSNorm join that is on.
TIE_ENV = "AOTPACK_ROW_SUM_TIE"
_ROW_VAR = re.compile(r"\b[a-z]\w*_@")


def mode() -> str:
    """``AOTPACK_ROW_SUM`` where set (one of ``SETTINGS``), else ``DEFAULT``; any other value is
    a ``CodegenError`` naming them."""
    return setting(ENV, DEFAULT, SETTINGS, error=CodegenError)


def tie() -> bool:
    """Whether the residual's loads are tied to the first product (``TIE_ENV``, off by default)."""
    return on_off(TIE_ENV, "off")


def _tied(loop: list[str], loaded: list[str], cfg: Any) -> list[str]:
    """``loop`` (a one-row form's K steps, its partial sums starting at zero) with the first
    partial sums starting from ``tie``: the residual rows ``loaded`` where M (the rows) is negative,
    which it never is, else 0.0. The same zero, but a value ptxas cannot tell from the loads, so
    it issues them before the first product, beside A's row, not after the products."""
    if cfg.block_m != 1:
        raise CodegenError(f"{cfg.name}: a residual tied to the first product needs one row a block")
    start = "part0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)"
    if start not in loop:  # gemm_render._vec_steps writes it; a change there must come here too
        raise CodegenError(f"{cfg.name}: no line {start!r} to tie the residual to in its K steps")
    i = loop.index(start)
    rows = " + ".join(loaded)
    tie_line = f"tie = tl.where(M < 0, tl.reshape({rows}, (BLOCK_N, 1)), 0.0)  # 0.0: M is never negative"
    return [*loop[:i], tie_line, f"{start} + tie", *loop[i + 1 :]]


def _refs(expr: str) -> set[str]:
    return set(_ROW_VAR.findall(expr))


def _sum_ops(norm: RowNorm) -> list[tuple[str, str, int]] | None:
    """The row ops that make the norm's sum (``sum_out``'s variable) from its row inputs, in order;
    None where the sum is not such a value (it reads a vector, is not rounded to its dtype, as an
    input as loaded is not, or another step of the norm reads what makes it)."""
    if norm.sum_out is None or norm.more or norm.stage_of(norm.sum_out[1]) != 0:
        return None
    _, var, dtype = norm.sum_out
    ops = {v: (v, e, st) for v, e, st in norm.row_ops}
    need, stack = set(), [var]
    while stack:
        v = stack.pop()
        if v in need:
            continue
        if v not in ops:
            return None
        need.add(v)
        if not v.startswith("x"):  # an input's load reads no row variable
            stack.extend(_refs(ops[v][1]))
    if any(v.startswith("v") for v in need):
        return None  # a vector (the norm's weight) in the sum
    if not ops[var][1].endswith(f".to({TL_TYPE[STORAGE[dtype]]}).to(tl.float32)"):
        return None  # the second's statistics read the sum unrounded: a stored one would differ
    inputs = {f"x{i}_@" for i in range(len(norm.inputs))}
    if not inputs <= need:
        return None  # an input the sum does not read: the second would still load it
    rest = [e for v, e, _ in norm.row_ops if v not in need]
    rest += [norm.reduced, norm.out, *(norm.factored or ())]
    if any(_refs(e) & (need - {var}) for e in rest):
        return None
    return [ops[v] for v, _, _ in norm.row_ops if v in need]


def joins(pair: Any, f: Any, s: Any) -> bool:
    """Whether forms ``f`` (the first site's) and ``s`` (the second's) of ``pair`` join here."""
    first, second = pair.first, pair.second
    pro = second.prologue
    what = mode()
    return (
        (what == "on" or (what == "rms" and pro.norm is not None))
        and not f.cfg.dot
        and not s.cfg.dot
        and len(f.kernels) == 1
        and len(s.kernels) == 1
        and not f.pre
        and not s.pre
        and first.prologue is None
        and not pro.gathered
        and pro.sum_out is not None
        and f.cfg.split_k == 1
        and s.cfg.split_k == 1
        and not any(c.rows_apart for c in (f.cfg, s.cfg))
        and (
            _sum_ops(pro.norm) is not None
            if pro.norm is not None
            else pro.y is not None  # a LayerNorm of x + y (``gemm_pairs.layer_norms`` allowed it)
        )
    )


def render(
    pair: Any,
    f: Any,
    s: Any,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
) -> tuple[tuple[Rendered, str], ...]:
    """The two kernels of the join (``joins`` holds), each with its id."""
    first, second = pair.first, pair.second
    pro = second.prologue
    at = (buffers, known, ranges)
    if pro.norm is None:  # a LayerNorm of x + y: the second reads the sum as x
        one = _first_kernel(
            first, f.cfg, lambda held: _layer_norm_sum(pro, first, held), pro.sum_out, first.dtype, *at
        )
        two = _second_kernel(second, s.cfg, replace(pro, x=pro.sum_out, y=None, sum_out=None), "_ln", *at)
    else:
        norm = pro.norm
        ops = _sum_ops(norm)
        sum_buf, var, dtype = norm.sum_out
        one = _first_kernel(first, f.cfg, lambda held: _row_norm_sum(norm, ops, held), sum_buf, dtype, *at)
        # the second: one row input, the sum as stored (its load, in fp32, is the rounded sum)
        need = {v for v, _, _ in ops}
        row_ops = (
            ("x0_@", row_load("x0", second.k, "rk@", "kmask@"), 0),
            (var, "x0_@", 0),
            *((v, e, st) for v, e, st in norm.row_ops if v not in need),
        )
        one_input = replace(norm, inputs=((sum_buf, dtype),), row_ops=row_ops, sum_out=None)
        two = _second_kernel(
            second, s.cfg, replace(pro, norm=one_input, x=sum_buf, y=None, sum_out=None), "_rms", *at
        )
    return tuple((r, kernel_id(r.source, r.signature, r.config)) for r in (one, two))


class _SumLines(NamedTuple):
    """What a ``_sum`` kernel adds to the first GEMV: ``before``, lines right after the wait (the
    other row inputs' loads, beside A's row, so that no memory latency follows the products);
    ``loaded``, the variables they load; ``after``, lines after the epilogue; ``params``, the
    loads' parameters (name, buffer, dtype); ``value``, the sum's variable."""

    before: list[str]
    loaded: list[str]
    after: list[str]
    params: list[tuple[str, str, str]]
    value: str


def _as_stored(held: tuple[str, str]) -> str:
    """The epilogue's value as its store would round it, in fp32."""
    val, dtype = held
    return f"{val}.to({TL_TYPE[STORAGE[dtype]]}).to(tl.float32)"


def _row_norm_sum(norm: RowNorm, ops: list[tuple[str, str, int]], held: dict) -> _SumLines:
    """A row norm's sum over the block's columns: its own row ops (``_sum_ops``), ``@`` as ``n``."""
    ours = {f"x{i}_@": buf for i, (buf, _) in enumerate(norm.inputs) if buf in held}
    loads = [(v, e) for v, e, _ in ops if v.startswith("x") and v not in ours]
    loaded = [v.replace("@", "n") for v, _ in loads]
    before = [
        "rkn = rn",
        "kmaskn = mask",
        *(f"{v} = {e.replace('@', 'n')}" for v, (_, e) in zip(loaded, loads)),
    ]
    after = [
        f"{v.replace('@', 'n')} = {_as_stored(held[ours[v]]) if v in ours else e.replace('@', 'n')}"
        for v, e, _ in ops
        if (v, e) not in loads
    ]
    more = [(f"x{i}_ptr", buf, dt) for i, (buf, dt) in enumerate(norm.inputs) if buf not in held]
    return _SumLines(before, loaded, after, more, norm.sum_out[1].replace("@", "n"))


def _layer_norm_sum(pro: Any, first: Site, held: dict) -> _SumLines:
    """A LayerNorm prologue's ``x + y`` over the block's columns, as ``gemm_render._prologue_rows``
    adds them."""
    before, loaded, after, more = [], [], [], []
    for name, buf in (("x", pro.x), ("y", pro.y)):
        if buf in held:
            after.append(f"{name}_t = {_as_stored(held[buf])}")
        else:
            before.append(
                f"{name}_t = tl.load({name}_ptr + rm[:, None] * {first.n} + rn[None, :], mask=mask, other=0.0)"
                ".to(tl.float32)"
            )
            loaded.append(f"{name}_t")
            more.append((f"{name}_ptr", buf, first.dtype))
    after.append("xs = x_t + y_t")
    return _SumLines(before, loaded, after, more, "xs")


def _first_kernel(
    site: Site,
    cfg: Any,
    lines: Callable[[dict[str, tuple[str, str]]], _SumLines],
    sum_buf: str,
    dtype: str,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
) -> Rendered:
    """``site``'s one-row form whose epilogue ends in the next GEMV's residual add: what it would
    store (read by nothing but the norm: ``gemm_pairs.Pair``) stays in registers, rounded as the
    store would round it (``lines`` takes those values by buffer); the add's other row inputs are
    loaded at the block's columns right after the wait; the sum, rounded to ``dtype``, is stored
    to ``sum_buf``."""
    index = split_index(site, cfg, ranges)
    ep = _site_epilogue(site, buffers, known)
    before, loaded, after, more, value = lines({buf: (val, dt) for buf, val, dt in ep.stores})
    early, body = _opening(site, cfg, index, "0", site.k)
    biases, bias = _early_biases(site) if early else ([], None)
    early += biases
    body += ["# the next GEMV's residual at this block's columns, loaded beside A's row", *before]
    loop = _k_loop(site, cfg, "0", site.k, index)
    if loaded and tie():
        loop = _tied(loop, loaded, cfg)
    body += loop + _epilogue_lines(site, ep, store=False, bias=bias)
    body += ["# the next GEMV's residual add over this block's columns, its sum stored", *after]
    body.append(
        f"tl.store(sum_ptr + rm[:, None] * {site.n} + rn[None, :], {value}.to({TL_TYPE[STORAGE[dtype]]}), mask=mask)"
    )
    return _join_kernel(
        site,
        cfg,
        ep,
        f"gemm_{_tag(site)}_{cfg.name}_sum",
        "fused, then the next GEMV's residual add, its sum stored",
        body,
        [*more, ("sum_ptr", sum_buf, dtype)],
        [sum_buf],
        index,
        early,
        stores=False,
    )


def _second_kernel(
    second: Site,
    cfg: Any,
    prologue: Any,
    suffix: str,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
) -> Rendered:
    """``second``'s one-row form (``cfg``, named with its prologue's ``suffix``) with ``prologue``:
    one row input, the sum the first stored, which it no longer writes."""
    site = replace(second, prologue=prologue, outputs=tuple(o for o in second.outputs if o != prologue.x))
    cfg = replace(cfg, name=cfg.name.removesuffix(suffix))
    return _render_fused(site, _site_epilogue(site, buffers, known), cfg, split_index(site, cfg, ranges))
