"""A tensor-core form's epilogue rows held through its K loop (``gemm_render.HOLD_EPILOGUE_LOADS``,
``AOTPACK_HOLD_EPILOGUE_LOADS=on``, off by default): the residual a statistics join's first tile
adds (``gemm_stats``) loads right after the wait for the kernel before and stays in registers
through the loop (an opaque identity, ``gemm_render._held``, reads it back after it); and by
default (``gemm_render.EARLY_BIAS``) a tensor-core tile that loads no W early loads its bias before
the wait, its indices there too. Triton's interpreter (no ``GDC``) loads the rows after the loop as
before, so it checks the else branch's sums; the GPU checks the held ones
(``tests/gpu/test_gemm_few_rows_gpu.py``'s joins with the switch on, ``aotpack verify``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.codegen import gemm_pairs, gemm_render
from tests.conftest import HANG_GUARD_S

MODELS = Path(__file__).resolve().parent / "gemm_models"
ARCHS = ("sm_90",)
HELD = "tl.inline_asm_elementwise("


def _build(model: str, hold: str, module=gemm_pairs, **attrs):
    """``model`` built with ``AOTPACK_HOLD_EPILOGUE_LOADS=hold`` and ``module``'s ``attrs`` set."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gemm_render.HOLD_EPILOGUE_LOADS_ENV, hold)
        mp.delenv(gemm_pairs.TILE_STATS_ENV, raising=False)
        for name, value in attrs.items():
            mp.setattr(module, name, value)
        return generate(trace(load_model_file(MODELS / model)), ARCHS)


def _sources(compiled) -> dict[str, str]:
    return {k.name: k.source.split("@triton.jit")[1] for k in compiled.program.kernels}


def _parts(source: str) -> tuple[str, str, str]:
    """(before the wait, from the wait to the K loop, after the loop) of a kernel's body."""
    head, rest = source.split("tl.extra.cuda.gdc_wait()", 1)
    before_loop, after = rest.split("for k0 in range(", 1)
    return head, before_loop, after.split("\n    acc0 = ", 1)[-1]


def _row_loads(text: str, ptr: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if f"tl.load({ptr} +" in ln]


def test_the_first_tiles_residual_loads_after_the_wait_and_is_held():
    """GPT-2's o, ln_2 and fc at 8 rows (``gemm_tile_ln_few.py``, the LayerNorm join): the first
    tile's residual ``r`` (``x_ptr``; its own product is the add's other term) loads once between
    the wait and the K loop, as stored, and after the loop ``x_t`` is that tile through the identity where GDC holds, else loaded then;
    off (the default), only after the loop. At 32 rows the plain 64-row tile (no early W)
    loads its bias before the wait either way (EARLY_BIAS), after the loop where that is off."""
    off = _sources(_build("gemm_tile_ln_few.py", "off"))
    on = _sources(_build("gemm_tile_ln_few.py", "on"))
    assert set(on) == set(off)
    stats = "gemm_addmm_gemve_16x32x128_stats"
    head, before_loop, after = _parts(off[stats])
    assert not _row_loads(head + before_loop, "x_ptr") and len(_row_loads(after, "x_ptr")) == 1
    assert "held_" not in off[stats]
    head, before_loop, after = _parts(on[stats])
    assert not _row_loads(head, "x_ptr")  # a kernel before writes it: never before the wait
    (held,) = _row_loads(before_loop, "x_ptr")
    assert held.startswith("held_x_t = tl.load(") and not held.endswith(".to(tl.float32)")
    assert f"x_t = {HELD}" in after and "[held_x_t], dtype=tl.float16" in after
    assert len(_row_loads(after, "x_ptr")) == 1  # the else branch: the interpreter, sm_80
    tile = "gemm_addmm_tile_64x32x128"
    assert on[tile] == off[tile]
    head, before_loop, after = _parts(off[tile])
    assert "b0_e = tl.load(b0_ptr" in head and "rn = tl.program_id(1)" in head
    assert "tl.load(b0_ptr" not in before_loop + after and "acc0 = acc0 + b0_e" in off[tile]
    late = _sources(_build("gemm_tile_ln_few.py", "off", module=gemm_render, EARLY_BIAS=False))
    assert "tl.load(b0_ptr" not in _parts(late[tile])[0] and "acc0 = acc0 + tl.load(b0_ptr" in late[tile]


def test_a_row_norm_joins_residual_is_held():
    """The RMSNorm join (``gemm_tile_rms.py``: o on the 16-row tile, the residual add, gate/up):
    the o tile's other row input of the norm (``x1_ptr``, the residual) loads after the wait and
    is read back after the loop through the identity."""
    compiled = _build("gemm_tile_rms.py", "on", ONE_PASS_DTYPES=("bfloat16", "float16"))
    stats = [s for name, s in _sources(compiled).items() if name.endswith("_stats") and "_from_" not in name]
    assert stats
    for source in stats:
        _, before_loop, after = _parts(source)
        (held,) = [ln.strip() for ln in before_loop.splitlines() if "held_x" in ln]
        assert held.startswith("held_x0_n = tl.load(x0_ptr + rm[:, None] * 1024 + rn[None, :], mask=mask,")
        assert f"x0_n = {HELD}" in after and len(_row_loads(after, "x0_ptr")) == 1


@pytest.mark.slow  # a build and the interpreter
def test_the_held_forms_match_their_reference_in_the_interpreter(tmp_path):
    """Held, the joined kernels and the 32-row tile still match the library steps in Triton's
    interpreter at 5 and 20 rows (float16's tolerance), bit for bit from run to run."""
    from aot.packager import pack
    from aot.verify.interpret import interpret_in_subprocess

    compiled = _build("gemm_tile_ln_few.py", "on")
    pack(compiled, tmp_path / "held.tpk")
    (result,) = interpret_in_subprocess(
        [(tmp_path / "held.tpk", MODELS / "gemm_tile_ln_few.py", [{"batch": 5}, {"batch": 20}], None, True)],
        timeout=HANG_GUARD_S,
    )
    comparisons = [c for per_size in result.values() for c in per_size]
    assert comparisons and not [c for c in comparisons if not c.ok]
    (site,) = compiled.program.alternatives
    names = {c.name for c in comparisons}
    assert {f"{site.id}/{c.name}" for c in site.candidates} <= names
