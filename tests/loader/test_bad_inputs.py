"""Bad call inputs: each a ``GuardError`` that says what was expected (exact text pinned), and the
layout decision of ``aot.loader.guards``: non-contiguous and overlapping inputs are copied to a
contiguous tensor, give the eager result, and are never written.

``branchy`` takes ``x: float32[batch, seq, 16]`` with ``1 <= batch <= 16`` and
``10 <= seq <= 256, seq % 2 == 0``; ``small_mlp`` takes ``x: float16[batch, 32]``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from aot.errors import GuardError
from aot.loader import load
from tests.conftest import HANG_GUARD_S
from tests.hostile_util import eager_module

ATOL = {torch.float32: 1e-5, torch.float16: 2e-2}


@pytest.fixture(scope="module")
def branchy(built):
    runner = load(built("branchy"))
    yield runner
    runner.bundle.close()


def x(batch: int = 2, seq: int = 12, c: int = 16, **kw) -> torch.Tensor:
    return torch.randn(batch, seq, c, generator=torch.Generator().manual_seed(batch * 1000 + seq), **kw)


SEQ_GUARDS = r"10 <= seq <= 256, seq % 2 == 0"

# (label, call, exact message or regex): every rejection names the input, what was expected, what came
BAD_CALLS = [
    (
        "rank 2",
        lambda r: r(torch.zeros(2, 16)),
        "input 'x': expected rank 3 [batch, seq, 16], got rank 2 [2, 16]",
    ),
    (
        "rank 4",
        lambda r: r(torch.zeros(1, 2, 12, 16)),
        "input 'x': expected rank 3 [batch, seq, 16], got rank 4 [1, 2, 12, 16]",
    ),
    ("scalar", lambda r: r(torch.tensor(1.0)), "input 'x': expected rank 3 [batch, seq, 16], got rank 0 []"),
    ("dtype float64", lambda r: r(x(dtype=torch.float64)), "input 'x': expected dtype float32, got float64"),
    ("dtype float16", lambda r: r(x().half()), "input 'x': expected dtype float32, got float16"),
    (
        "dtype int64",
        lambda r: r(torch.zeros(2, 12, 16, dtype=torch.int64)),
        "input 'x': expected dtype float32, got int64",
    ),
    (
        "device meta",
        lambda r: r(torch.empty(2, 12, 16, device="meta")),
        "input 'x': expected a tensor on cpu, got one on meta",
    ),
    ("static dim", lambda r: r(x(c=15)), "input 'x' dim 2: expected static size 16, got 15"),
    (
        "seq below the guard",
        lambda r: r(x(seq=8)),
        re.escape(f"input 'x' dim 1 (seq): expected {SEQ_GUARDS}, got 8 (guard seq >= 9 from ")
        + r"\S*branchy\.py:15: if T > 8:\)",
    ),
    (
        "seq odd",
        lambda r: r(x(seq=13)),
        re.escape(f"input 'x' dim 1 (seq): expected {SEQ_GUARDS}, got 13 (guard seq % 2 == 0 from ")
        + r"\S*branchy\.py:17: "
        + re.escape("pairs = x.reshape(B, T // 2, 2 * C))"),
    ),
    (
        "seq above the range",
        lambda r: r(x(seq=258)),
        re.escape(f"input 'x' dim 1 (seq): expected {SEQ_GUARDS}, got 258 (declared in the model file)"),
    ),
    (
        "batch above the range",
        lambda r: r(x(batch=17)),
        re.escape("input 'x' dim 0 (batch): expected 1 <= batch <= 16, got 17 (declared in the model file)"),
    ),
    (
        "empty batch",
        lambda r: r(x(batch=0)),
        re.escape("input 'x' dim 0 (batch): expected 1 <= batch <= 16, got 0 (declared in the model file)"),
    ),
    ("too many", lambda r: r(x(), x()), re.escape("expected at most 1 inputs ['x'], got 2")),
    ("none", lambda r: r(), re.escape("missing input 'x'; expected inputs ['x']")),
    ("wrong name", lambda r: r(y=x()), re.escape("missing input 'x'; expected inputs ['x']")),
    ("extra name", lambda r: r(x(), y=x()), re.escape("unexpected input(s) ['y']; expected inputs ['x']")),
    (
        "twice",
        lambda r: r(x(), x=x()),
        re.escape("input(s) ['x'] given both by position and by name; expected inputs ['x']"),
    ),
    ("list", lambda r: r([[0.0] * 16] * 12), "input 'x': expected a tensor, got list"),
    (
        "numpy",
        lambda r: r(np.zeros((2, 12, 16), dtype=np.float32)),
        "input 'x': expected a tensor, got ndarray",
    ),
    ("None", lambda r: r(None), "input 'x': expected a tensor, got NoneType"),
    ("int", lambda r: r(3), "input 'x': expected a tensor, got int"),
    (
        "sparse",
        lambda r: r(x().to_sparse()),
        "input 'x': expected a dense (strided) tensor, got a sparse_coo one",
    ),
    (
        "nested",
        lambda r: r(torch.nested.nested_tensor([torch.zeros(12, 16), torch.zeros(10, 16)])),
        "input 'x': expected a dense (strided) tensor, got a nested one",
    ),
]


@pytest.mark.parametrize("label, call, message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call_is_a_guard_error_that_says_what_was_expected(branchy, label, call, message):
    with pytest.raises(GuardError) as info:
        call(branchy)
    text = str(info.value)
    if message.startswith("input '") and "\\" not in message:
        assert text == message
    else:
        assert re.fullmatch(message, text), text
    assert "\n" not in text


def test_device_index_is_checked():
    """A runner on a named device refuses a tensor on another index of the same type (no GPU needed:
    the check runs before anything touches the device)."""
    from aot.aten import DTYPES
    from aot.loader.guards import GuardChecker
    from aot.schema import Guards, InputGuard

    checker = GuardChecker(
        Guards(inputs=(InputGuard("x", "float32", ("4",)),), symbols=(), relations=()), DTYPES
    )
    fake = torch.empty(4, device="meta")
    with pytest.raises(GuardError, match=r"input 'x': expected a tensor on cuda:1, got one on meta"):
        checker.check([fake], torch.device("cuda", 1))


def _views(seq: int = 12, batch: int = 3) -> dict[str, torch.Tensor]:
    """Inputs of shape [batch, seq, 16] whose memory is not one contiguous row-major block."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4096, generator=g)
    return {
        "transposed": torch.randn(seq, batch, 16, generator=g).transpose(0, 1),
        "sliced": torch.randn(batch, seq + 5, 16, generator=g)[:, 2 : seq + 2, :],
        "every other column": torch.randn(batch, seq, 32, generator=g)[:, :, ::2],
        "expanded batch (stride 0)": torch.randn(1, seq, 16, generator=g).expand(batch, seq, 16),
        "expanded everything": torch.randn(1, 1, 1, generator=g).expand(batch, seq, 16),
        "as_strided, rows overlap": base.as_strided((batch, seq, 16), (16, 8, 1)),
        "as_strided, batch overlaps": base.as_strided((batch, seq, 16), (0, 16, 1)),
    }


@pytest.mark.parametrize("label", list(_views()))
def test_non_contiguous_and_overlapping_inputs_are_copied_and_match_eager(branchy, label):
    value = _views()[label]
    before = value.clone()
    storage_before = value.untyped_storage().tolist() if value.numel() else None
    got = branchy(value)
    with torch.no_grad():
        expected = eager_module("branchy")(value.contiguous())
    torch.testing.assert_close(got, expected, atol=ATOL[torch.float32], rtol=1e-5)
    assert torch.equal(got, branchy(value.contiguous()))
    assert torch.equal(value, before) and value.untyped_storage().tolist() == storage_before
    assert got.is_contiguous()
    assert got.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()


def _layouts(batch: int = 3, seq: int = 12) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same values [batch, seq, 16] in several memory layouts, and whether each is contiguous."""
    g = torch.Generator().manual_seed(9)
    values = torch.randn(batch, seq, 16, generator=g)
    pad = torch.randn(batch, seq, 16, generator=g)
    return values, {
        "contiguous": values.clone(),
        "contiguous at an offset (rows of a larger batch)": torch.cat([pad[:2], values])[2:],
        "transposed": values.transpose(0, 1).contiguous().transpose(0, 1),
        "sliced along seq": torch.cat([pad[:, :3], values, pad[:, :2]], dim=1)[:, 3 : 3 + seq],
        "every other column": torch.stack([values, pad], dim=-1).flatten(-2)[..., ::2],
        "channels in the middle": values.permute(0, 2, 1).contiguous().permute(0, 2, 1),
    }


def test_every_layout_of_the_same_values_gives_the_eager_result(branchy, monkeypatch):
    """Layout is not part of the contract: contiguous inputs (also at a storage offset) are used as
    they are, the others copied once to a contiguous tensor, and every layout gives the same
    outputs, which match eager within float32 accumulation noise (1e-5 absolute and relative)."""
    values, layouts = _layouts()
    with torch.no_grad():
        want = eager_module("branchy")(values)
    reference = branchy(values)
    torch.testing.assert_close(reference, want, atol=ATOL[torch.float32], rtol=1e-5)
    copied = []
    original = torch.Tensor.contiguous

    def spy(self, *a, **k):
        copied.append((self.data_ptr(), tuple(self.stride())))
        return original(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    for label, value in layouts.items():
        assert torch.equal(value, values)
        copied.clear()
        got = branchy(value)
        assert torch.equal(got, reference), f"{label}: another layout, another result"
        mine = [c for c in copied if c == (value.data_ptr(), tuple(value.stride()))]
        if value.is_contiguous():
            assert not mine, f"{label}: a contiguous input was copied"
        else:
            assert len(mine) == 1, f"{label}: copied {len(mine)} times, expected once"


def test_fp16_model_bad_inputs_and_strided_views(built):
    runner = load(built("small_mlp"))
    try:
        with pytest.raises(GuardError, match=r"^input 'x': expected dtype float16, got float32$"):
            runner(torch.zeros(4, 32))
        with pytest.raises(
            GuardError, match=re.escape("input 'x' dim 0 (batch): expected 1 <= batch <= 64, got 65")
        ):
            runner(torch.zeros(65, 32, dtype=torch.float16))
        wide = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).half()
        got = runner(wide[:, ::2])
        with torch.no_grad():
            expected = eager_module("small_mlp")(wide[:, ::2].contiguous())
        torch.testing.assert_close(got, expected, atol=ATOL[torch.float16], rtol=1e-2)
    finally:
        runner.bundle.close()


def test_cli_reports_bad_inputs_in_one_line(tmp_path, built):
    from safetensors.torch import save_file

    cases = {
        "rank": (
            {"x": torch.zeros(2, 16)},
            "error: input 'x': expected rank 3 [batch, seq, 16], got rank 2 [2, 16]",
        ),
        "dtype": (
            {"x": torch.zeros(2, 12, 16, dtype=torch.float64)},
            "error: input 'x': expected dtype float32, got float64",
        ),
        "name": ({"y": torch.zeros(2, 12, 16)}, "error: missing input 'x'; expected inputs ['x']"),
    }
    files = []
    for label, (tensors, _) in cases.items():
        files.append(tmp_path / f"{label}.safetensors")
        save_file(tensors, files[-1])
    # one interpreter for the three runs keeps this test fast; each run goes through the CLI's main()
    script = (
        "import sys\nfrom aot.cli import main\n"
        "for f in sys.argv[2:]:\n"
        "    try:\n"
        "        main(['load', sys.argv[1], '--inputs', f, '--runs', '1'])\n"
        "    except SystemExit as e:\n"
        "        print(f'exit {e.code}', file=sys.stderr, flush=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(built("branchy")), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("loaded ")]
    expected = []
    for _, message in cases.values():
        expected += [message, "exit 1"]
    assert lines == expected, r.stderr
