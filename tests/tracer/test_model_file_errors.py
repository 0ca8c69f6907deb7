"""Model files a newcomer writes, through ``aotpack build``: the exit code and the one ``error:``
line for a spec mistake, a model whose shapes depend on tensor values or that computes a float from
sizes (its line and the integer form to write instead), and a helper module beside the model file
that imports as it would under ``python model.py``; a library file in an error is named relative to
its package, as in guard lines."""

from __future__ import annotations

import sys
import textwrap

import pytest

from aot.cli import main

HEAD = """\
import torch
from torch import nn
from aot import Dim, Input, ModelSpec
"""


def _build(tmp_path, capsys, body: str, name: str = "model.py") -> tuple[int, list[str]]:
    """``aotpack build`` of a model file made of ``HEAD`` and ``body``: (exit code, stderr lines)."""
    model = tmp_path / name
    model.write_text(HEAD + textwrap.dedent(body))
    with pytest.raises(SystemExit) as e:
        main(["build", str(model), "-o", str(tmp_path / "out.tpk"), "--arch", "sm_90"])
    return e.value.code, capsys.readouterr().err.splitlines()


def _error(lines: list[str]) -> str:
    assert not any("Traceback" in line for line in lines), lines
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, lines
    return errors[0]


def test_two_dims_of_one_name_with_different_ranges_are_refused(tmp_path, capsys):
    code, lines = _build(
        tmp_path,
        capsys,
        """
        class M(nn.Module):
            def forward(self, x, y):
                return x.sum() + y.sum()

        spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 64), 4)), Input("y", (Dim("batch", 1, 32), 4))])
        """,
    )
    assert code == 1
    assert _error(lines) == (
        f"error: {tmp_path / 'model.py'}: two different Dims are named 'batch': Dim('batch', 1, 64) on input "
        "'x' and Dim('batch', 1, 32) on input 'y'; use one Dim for both, or give them distinct names"
    )


def test_a_module_beside_the_model_file_imports(tmp_path, capsys, monkeypatch):
    """As under ``python model.py``, the model file's folder is on sys.path: ``import helper``
    finds helper.py beside it (the build then goes on: here to its one-line error at export)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder added is taken off after the test
    (tmp_path / "helper_beside_the_model.py").write_text("SCALE = 3\n")
    code, lines = _build(
        tmp_path,
        capsys,
        """
        from helper_beside_the_model import SCALE

        class M(nn.Module):
            def forward(self, x):
                return x * SCALE

        spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 8), 4))])
        """,
    )
    assert code == 0 and not [line for line in lines if line.startswith("error:")], lines
    assert (tmp_path / "out.tpk").is_file()


@pytest.mark.parametrize(
    "forward, expected",
    [
        (
            "return torch.nonzero(x > 0).float().sum(0)",
            "model.py:7: return torch.nonzero(x > 0).float().sum(0): torch.nonzero returns one row per "
            "nonzero element, so its size (u0, at most 4*batch, 32 at the declared maximum) depends on tensor "
            "values; a bundle plans its programs, memory and CUDA graphs from input sizes alone and cannot hold "
            "it. Build the rest: move this line out of the bundle, returning the tensors it selects from and "
            "the mask as outputs",
        ),
        (
            "return torch.zeros(int((x > 0).sum().item()))",
            "the model turns a tensor value into a Python number (.item(), int(t), t.tolist()); a bundle's "
            "shapes follow its inputs' shapes alone",
        ),
        (
            "return x * 2 if x.sum() > 0 else x",
            "the model branches on tensor values (an `if` on a tensor); use torch.where or torch.cond, or "
            "torch._check to state the assumption",
        ),
    ],
    ids=["nonzero", "item", "branch"],
)
def test_value_dependent_shapes_are_named_for_what_they_are(tmp_path, capsys, forward, expected):
    code, lines = _build(
        tmp_path,
        capsys,
        f"""
        class M(nn.Module):
            def forward(self, x):
                {forward}

        spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 8), 4))])
        """,
    )
    line = _error(lines)
    assert code == 1 and expected in line, line
    assert "declare that input dim" not in line


def test_forward_with_star_args_gets_a_spec_error(tmp_path, capsys):
    code, lines = _build(
        tmp_path,
        capsys,
        """
        class M(nn.Module):
            def forward(self, *xs):
                return xs[0] + xs[1]

        spec = ModelSpec(module=M, inputs=[Input("a", (Dim("batch", 1, 8), 4)), Input("b", (Dim("batch", 1, 8), 4))])
        """,
    )
    assert code == 1
    assert _error(lines) == (
        "error: M.forward takes a, b through *xs, which torch.export cannot trace as separate inputs; give "
        "forward one parameter per Input (forward(self, a, b)), or wrap the model in a module whose "
        "forward does"
    )


@pytest.mark.parametrize(
    "forward, line",
    [
        (  # an interpolation by a scale factor computed from the image size: export guards on the float
            "return nn.functional.interpolate(x, scale_factor=(x.shape[2] / 4, x.shape[3] / 4), mode='bicubic')",
            "(return nn.functional.interpolate(x, scale_factor=(x.shape[2] / 4, x.shape[3] / 4), mode='bicubic')): "
            "a guard is Eq(IntTrueDiv(h, 4), 1.0)",
        ),
    ],
    ids=["interpolate-scale"],
)
def test_a_float_computed_from_sizes_names_its_line_and_the_integer_form(tmp_path, capsys, forward, line):
    code, lines = _build(
        tmp_path,
        capsys,
        f"""
        class M(nn.Module):
            def forward(self, x):
                {forward}

        spec = ModelSpec(module=M, inputs=[Input("x", (1, 2, Dim("h", 2, 16), Dim("w", 2, 16)))])
        """,
    )
    error = _error(lines)
    assert code == 1 and "model.py:7: a float is computed from input sizes" in error and line in error, error
    assert (
        "a bundle stores floats of sizes only as arguments made of true division, + - * and constants, and its "
        "guards as integer size arithmetic (+ - * // %, comparisons, min/max); compute what the float is for as "
        "an integer size on that line instead (F.interpolate(x, size=(h // p, w // p)) rather than "
        "scale_factor=(h / p / n, w / p / n)"
    ) in error


def test_errors_at_library_lines_name_the_file_relative_to_its_package():
    import torch
    import torch.fx

    from aot.tracer.lower import _model_line
    from aot.tracer.sites import library_relative

    assert library_relative(torch.nn.functional.__file__) == "torch/nn/functional.py"
    assert library_relative("/somewhere/model.py") == "/somewhere/model.py"
    node = torch.fx.Graph().placeholder("x")
    node.meta["stack_trace"] = (
        f'  File "/somewhere/model.py", line 3, in forward\n    y = F.gelu(x)\n'
        f'  File "{torch.nn.functional.__file__}", line 120, in gelu\n    return torch._C.gelu(x)\n'
    )
    assert _model_line(node) == "torch/nn/functional.py:120: "


def test_an_export_error_that_is_a_heading_names_its_first_item():
    """torch.export's error for dims it found static under ``Dim.DYNAMIC`` hints (``aot.hf``'s
    wrappers pass those) is a heading and a list: the one line names the heading, the first
    conflict and how many more there are, then what to do."""
    from types import SimpleNamespace

    from aot.tracer.export import export_error

    items = [
        f"- Received user-specified dim hint Dim.DYNAMIC(min=1, max=2), but tracing inferred a static shape of 2 "
        f"for dimension inputs['{name}'].shape[0]."
        for name in ("input_ids", "position_ids", "attention_mask")
    ]
    heading = (
        "Found the following conflicts between user-specified ranges and inferred ranges from model tracing:"
    )
    error = str(export_error(ValueError("\n".join([heading, *items])), SimpleNamespace(extra={})))
    assert error == (
        f"cannot export the model: ValueError: {heading} {items[0][2:]} (and 2 more); torch.export traces a "
        "dynamic dim as at least 2, so a range of 1 to 2 leaves it only 2; widen the range (a max of 3 or more) "
        "or make that dim static"
    ), error
    # a range of more sizes that the code fixed: the general advice
    wider = [item.replace("max=2", "max=8") for item in items]
    error = str(export_error(ValueError("\n".join([heading, *wider])), SimpleNamespace(extra={})))
    assert error.endswith(
        "; a Dim was specialized or its range conflicts with the code; make that dim static or change the code"
    ), error


def test_an_export_error_for_dims_the_code_fixed_names_the_declared_dim():
    """torch.export's ``Constraints violated`` for dims the code turned into constants (Funnel's
    ``seq``) names the input, its declared Dim, the value, the other inputs it fixed, and what
    to do, in the words of the check after export (not only the heading)."""
    from aot import Dim, Input, ModelSpec
    from aot.tracer.export import export_error

    seq = Dim("seq", 1, 16)
    spec = ModelSpec(
        module=lambda: None,
        inputs=[
            Input("input_ids", (1, seq), dtype="int64"),
            Input("attention_mask", (1, seq), dtype="int64"),
        ],
    )
    items = [
        f"  - You marked L['{name}'].size()[1] as dynamic but your code specialized it to be a constant (4). "
        f"If you're using mark_dynamic, either remove it or use maybe_mark_dynamic."
        for name in ("input_ids", "attention_mask")
    ]
    heading = (
        "Constraints violated (L['attention_mask'].size()[1], L['input_ids'].size()[1])! For more information"
    )
    error = str(export_error(RuntimeError("\n".join([heading, *items])), spec))
    assert error == (
        "cannot export the model: input 'input_ids' dim 1 (seq) was specialized to 4 while tracing (so were "
        "attention_mask dim 1); make it a static size or remove the code that fixes it (or, where 4 is also the "
        "length of a tensor that seq slices, trace at another example: Dim(..., example=N)); "
        'TORCH_LOGS="+dynamic" shows the line'
    ), error
