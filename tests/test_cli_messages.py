"""What the command line tells a newcomer at the rough edges: a huge Dim max, a model the build
would narrow, a rebuild over a signed bundle, a torch.save file given as --inputs, a GPU asked for
where there is none, a switch set to a wrong value, and counts that read right. Each pins the exit
code and the line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aot import Dim
from aot.errors import counted
from tests.conftest import model_path
from tests.test_cli_trust import cli


def test_counts_read_right():
    assert [counted(1, "kernel"), counted(0, "kernel"), counted(2, "kernel launch", "kernel launches")] == [
        "1 kernel",
        "0 kernels",
        "2 kernel launches",
    ]


def test_a_huge_dim_max_warns_with_its_buckets_and_peak(capsys):
    from aot.cli.build import _warn_on_buckets

    def manifest(max_size: int, peak: int):
        sizes = Dim("batch", 1, max_size).default_buckets()
        return SimpleNamespace(
            buckets=(SimpleNamespace(symbol="batch", sizes=sizes),),
            stats=SimpleNamespace(
                memory_plan=tuple(
                    SimpleNamespace(sizes={"batch": s}, peak_bytes=peak * s // sizes[-1]) for s in sizes
                )
            ),
        )

    _warn_on_buckets(manifest(64, 1 << 20))
    assert capsys.readouterr().err == ""
    _warn_on_buckets(manifest(10**9, 32 * 10**9))
    assert capsys.readouterr().err.splitlines() == [
        "  warning: 31 CUDA-graph buckets (31 for batch), peak activations 32.0 GB at batch=1000000000; "
        "bound them with a smaller Dim max or Dim(..., buckets=(...)) in the model file"
    ]


def test_load_says_what_its_options_expect(capsys, built, tmp_path):
    bundle = str(built("branchy"))
    saved = tmp_path / "inputs.pt"
    torch.save({"x": torch.ones(2, 12, 16)}, saved)
    code, lines = cli(capsys, "load", bundle, "--inputs", str(saved), "--runs", "1")
    assert (code, lines[-1]) == (
        1,
        f"error: --inputs {saved} looks like a torch.save file; it expects safetensors: write one with "
        f"safetensors.torch.save_file({{'x': tensor, ...}}, '{saved}.safetensors')",
    )
    if not torch.cuda.is_available():
        assert cli(capsys, "load", bundle, "--device", "cuda") == (
            1,
            ["error: --device cuda: torch sees no CUDA GPU; run with --device cpu (or --device auto)"],
        )


HUGE_MODEL = """
from torch import nn
from aot import Dim, Input, ModelSpec

spec = ModelSpec(module=lambda: nn.Linear(16, 16), inputs=[Input("x", (Dim("batch", 1, 10**9), 16))],
                 dtype="float32")
"""


@pytest.mark.slow
def test_build_warns_of_huge_buckets_and_a_dropped_signature(capsys, tmp_path):
    from aot.signing import write_key_pair

    model, out = tmp_path / "huge.py", tmp_path / "huge.tpk"
    model.write_text(HUGE_MODEL)
    code, lines = cli(capsys, "build", str(model), "-o", str(out), "--no-fuse", "-q")
    assert code == 0
    assert lines[0] == (
        "  warning: 31 CUDA-graph buckets (31 for batch), peak activations 64.0 GB at batch=1000000000; "
        "bound them with a smaller Dim max or Dim(..., buckets=(...)) in the model file"
    ), lines
    write_key_pair(tmp_path / "key")
    assert cli(capsys, "sign", str(out), "--key", str(tmp_path / "key"))[0] == 0
    code, lines = cli(capsys, "build", str(model), "-o", str(out), "--no-fuse", "-q")
    assert code == 0 and lines[1] == (
        f"  warning: {out} was signed; the rebuilt bundle is not (a signature covers one build): "
        f"sign it again with `aotpack sign {out} --key KEY`"
    ), lines


@pytest.mark.slow
def test_guards_of_a_model_the_build_would_refuse_say_so(capsys):
    reshape = model_path("guards/reshape")
    code, lines = cli(capsys, "guards", str(reshape))
    assert (code, lines) == (
        0,
        [
            "warning: `aotpack build` refuses this model without --allow-narrowing: seq declared 1..64 admits "
            f"only 2 <= seq <= 64, seq % 2 == 0 (seq % 2 == 0 at {reshape.relative_to(reshape.parents[3])}:17: "
            "x = x.reshape(B, T // 2, 2 * C).reshape(B, T, C))"
        ],
    )


TWO_PROGRAMS_NARROWED = """
from torch import nn
from aot import Dim, Input, ModelSpec

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):  # x: [B, T, C]
        B, T, C = x.shape
        if B > 4:
            x = x * 2
        x = x.reshape(B, T // 2, 2 * C).reshape(B, T, C)
        return self.proj(x).relu()

spec = ModelSpec(module=Net, inputs=[Input("x", (Dim("batch", 1, 8), Dim("seq", 1, 64), 16))], name="net")
"""


@pytest.mark.slow
def test_a_narrowing_is_named_once_though_two_programs_meet_it(capsys, tmp_path):
    model = tmp_path / "twice.py"
    model.write_text(TWO_PROGRAMS_NARROWED)
    code, lines = cli(capsys, "build", str(model), "-o", str(tmp_path / "t.tpk"), "--no-fuse", "-q")
    assert (code, lines) == (
        1,
        [
            "error: the build cannot cover every declared size: seq 1..64 admits only 2 <= seq <= 64, "
            "seq % 2 == 0 (seq % 2 == 0 at twice.py:14: x = x.reshape(B, T // 2, 2 * C).reshape(B, T, C)); "
            "the model needs seq to be a multiple of 2: declare Dim('seq', 2, 64, multiple_of=2) and pad or resize "
            "inputs to a multiple of 2 (the loader refuses other sizes with a GuardError that names it); "
            "change the model at those lines, declare narrower Dims, or accept the narrower contract with "
            "--allow-narrowing (ModelSpec(allow_narrowing=True))"
        ],
    )


def test_a_switch_set_to_a_wrong_value_stops_the_build_in_one_line(capsys, tmp_path, monkeypatch):
    """An ``AOTPACK_*`` switch outside its choices (``docs/settings.md``) ends the build with one
    line naming the variable, the value and the choices, and writes no bundle."""
    out = tmp_path / "mlp.tpk"
    monkeypatch.setenv("AOTPACK_LAUNCH_FIRST", "bogus")
    code, lines = cli(capsys, "build", str(model_path("mlp")), "-o", str(out), "-q")
    assert code == 1 and not out.exists()
    assert lines == [
        "error: AOTPACK_LAUNCH_FIRST='bogus': expected 'on' or 'off'; unset it for the default"
    ], lines
