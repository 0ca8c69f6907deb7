"""Every ``AOTPACK_*`` switch is read by one parser (``aot.settings.setting``): a value outside its
choices stops the build (``CodegenError``) or the load (``EnvError``) with a message naming the
variable, the value and the choices, never a silent default."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from aot.errors import CodegenError, EnvError
from aot.settings import setting

ROOT = Path(__file__).resolve().parents[2]
ENV = "AOTPACK_TEST_SETTING"


def test_the_parser(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert setting(ENV, "b", ("a", "b")) == "b"
    assert setting(ENV, None, ("a", "b")) is None  # unset: the caller's rule
    monkeypatch.setenv(ENV, "  a ")
    assert setting(ENV, "b", ("a", "b")) == "a"
    monkeypatch.setenv(ENV, "A")  # any case, every switch alike
    assert setting(ENV, "b", ("a", "b")) == "a"
    monkeypatch.setenv(ENV, "C")
    with pytest.raises(
        EnvError, match=re.escape(f"{ENV}='C': expected 'a' or 'b'; unset it for the default")
    ):
        setting(ENV, "b", ("a", "b"))
    monkeypatch.setenv(ENV, "0")
    assert setting(ENV, "on", ("on", "off"), aliases={"0": "off"}) == "off"
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(CodegenError, match=re.escape("expected 'x', 'y' or 'z'")):
        setting(ENV, "x", ("x", "y", "z"), error=CodegenError)
    monkeypatch.setenv(ENV, "")
    assert setting(ENV, "b", ("a", "b")) == "b"  # set but empty reads as unset


def _reduce_norm():
    from aot.codegen import gemm_pairs

    return gemm_pairs.enabled(), gemm_pairs.layer_norms()


def _runtime_dependent_launch():
    from aot.runtime.driver import Device

    return Device.dependent_launch.fget(SimpleNamespace(driver_version=13000))


def _greedy():
    from aot.loader.decode_blocks import greedy_kernel

    return greedy_kernel(None)


def _call(module: str, name: str, *args):
    def read():
        return getattr(importlib.import_module(f"aot.{module}"), name)(*args)

    return read


# (variable, reader, {value: what the reader returns}, the error a wrong value raises)
SWITCHES = [
    (
        "AOTPACK_REDUCE_NORM",
        _reduce_norm,
        {
            None: (True, True),
            "on": (True, True),
            "rms": (True, False),
            "off": (False, True),  # off: no pair is joined, at any norm
            "0": (False, True),
        },
        CodegenError,
    ),
    (
        "AOTPACK_TILE_STATS",
        _call("codegen.gemm_pairs", "tile_stats_mode"),
        {"few": "few", "ON": "on", "0": "off"},
        CodegenError,
    ),
    (
        "AOTPACK_ATTENTION_AHEAD",
        _call("codegen.decode_attention", "ahead_setting"),
        {None: 0, "off": 0, "0": 0, "on": 16, "ON": 16, "24": 24, "256": 256},
        CodegenError,
    ),
    (
        "AOTPACK_LAUNCH_FIRST",
        _call("codegen.kernel_source", "launch_first"),
        {"on": True, "Off": False},
        CodegenError,
    ),
    (
        "AOTPACK_DECODE_HEAD_NORM",
        _call("codegen.decode_sites", "head_norms"),
        {None: True, "off": False},
        CodegenError,
    ),
    (
        "AOTPACK_ROW_NORM_MEANS",
        _call("codegen.gemm_prologue", "_max_means"),
        {None: 1, "1": 1, "2": 2},
        CodegenError,
    ),
    (
        "AOTPACK_DECODE_COMBINE",
        _call("codegen.decode_attention", "combine_in_kernel"),
        {None: True, "kernel": True, "Separate": False},
        CodegenError,
    ),
    (
        "AOTPACK_DECODE_WARPS",
        _call("codegen.decode_attention_render", "_warps", 1),
        {None: 2, "4": 4, "16": 16},
        CodegenError,
    ),
    (
        "AOTPACK_MANY_ROWS_EARLY",
        _call("codegen.gemm_defaults", "many_row_tile", 4096),
        {None: "tileme_64x64x128", "ON": "tileme_64x64x128", "off": "tilem_64x64x128"},
        CodegenError,
    ),
    (
        "AOTPACK_MANY_ROWS",
        _call("codegen.gemm_defaults", "many_rows"),
        {None: "split", "Short": "short", "off": "off"},
        CodegenError,
    ),
    (
        "AOTPACK_SMALL_EARLY",
        _call("codegen.gemm_defaults", "small_early"),
        {None: "short", "ON": "on", "off": "off"},
        CodegenError,
    ),
    (
        "AOTPACK_EARLY_STEPS_LAST",
        _call("codegen.gemm_render", "early_steps_last"),
        {None: True, "ON": True, "off": False},
        CodegenError,
    ),
    (
        "AOTPACK_HOLD_EARLY_A",
        _call("codegen.gemm_render", "hold_early_a"),
        {None: True, "On": True, "off": False},
        CodegenError,
    ),
    (
        "AOTPACK_HOLD_EPILOGUE_LOADS",
        _call("codegen.gemm_render", "hold_epilogue_loads"),
        {None: False, "On": True, "off": False},
        CodegenError,
    ),
    (
        "AOTPACK_STATS_AFTER_LOOP",
        _call("codegen.gemm_stats", "stats_after_loop"),
        {None: True, "on": True, "OFF": False},
        CodegenError,
    ),
    (
        "AOTPACK_DECODE_VECTOR",
        _call("codegen.decode_attention_render", "vector_form"),
        {None: False, "on": True, "OFF": False},
        CodegenError,
    ),
    (
        "AOTPACK_SLICED_PROLOGUE",
        _call("codegen.gemm_sites", "through_slices"),
        {None: False, "on": True},
        CodegenError,
    ),
    (
        "AOTPACK_ONE_ROW_FACTORED",
        _call("codegen.gemm_prologue", "factored_one_row", False),
        {"off": False},
        CodegenError,
    ),
    (
        "AOTPACK_DIRECT_BINDING",
        _call("loader.bindings", "enabled"),
        {None: False, "1": True, "0": False},
        EnvError,
    ),
    ("AOTPACK_GREEDY_KERNEL", _greedy, {None: None, "off": None}, EnvError),
    (
        "AOTPACK_DEPENDENT_LAUNCH",
        _call("loader.cuda", "dependent_launch_allowed", 0),
        {"0": False, "1": False},  # driver 0: too old either way; the switch is read first
        EnvError,
    ),
    ("AOTPACK_DEPENDENT_LAUNCH", _runtime_dependent_launch, {"0": False, "1": True}, EnvError),
]


@pytest.mark.parametrize(
    "env, read, values, error", SWITCHES, ids=[f"{s[0]}-{i}" for i, s in enumerate(SWITCHES)]
)
def test_each_switch_takes_its_values_and_refuses_others(env, read, values, error, monkeypatch):
    for value, expected in values.items():
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        assert read() == expected, (env, value)
    monkeypatch.setenv(env, "yes please")
    with pytest.raises(error, match=re.escape(f"{env}='yes please': expected ")):
        read()


def test_the_names_match_the_modules():
    """The variables above are the modules' own (a renamed variable would leave the test reading
    another)."""
    from aot.codegen import (
        decode_attention,
        decode_attention_render,
        decode_sites,
        gemm_defaults,
        gemm_pairs,
        gemm_prologue,
        gemm_render,
        gemm_sites,
        gemm_stats,
        kernel_source,
    )
    from aot.loader import bindings, cuda, decode_blocks

    named = {
        gemm_pairs.ENV,
        gemm_pairs.TILE_STATS_ENV,
        kernel_source.LAUNCH_FIRST_ENV,
        decode_sites.HEAD_NORM_ENV,
        gemm_prologue.MEANS_ENV,
        gemm_prologue.FACTORED_ENV,
        decode_attention.COMBINE_ENV,
        decode_attention.AHEAD_ENV,
        decode_attention_render.WARPS_ENV,
        decode_attention_render.VECTOR_ENV,
        gemm_defaults.MANY_ROWS_EARLY_ENV,
        gemm_defaults.MANY_ROWS_ENV,
        gemm_stats.STATS_AFTER_LOOP_ENV,
        gemm_render.EARLY_STEPS_LAST_ENV,
        gemm_render.HOLD_EARLY_A_ENV,
        gemm_render.HOLD_EPILOGUE_LOADS_ENV,
        gemm_defaults.SMALL_EARLY_ENV,
        gemm_sites.SLICED_PROLOGUE_ENV,
        bindings.DIRECT_BINDING_ENV,
        decode_blocks.GREEDY_ENV,
        cuda.DEPENDENT_LAUNCH_ENV,
    }
    assert named == {env for env, *_ in SWITCHES}


# Environment reads that are not a switch among choices, each parsed where it is read: paths, form
# names checked against the forms, a number of splits in a range, a verbose flag, the interpreter's.
OTHER_READS = {
    ("aot/signature.py", "TRUST_ENV"),  # key files, a path list
    ("codegen/compile.py", "CACHE_ENV"),  # a cache folder
    ("codegen/decode_attention.py", "SPLIT_ENV"),  # "off" or 2-MAX_SPLITS: refused past them
    ("codegen/decode_attention.py", "AHEAD_ENV"),  # "off", "on" or 1-AHEAD_MAX_MIB: refused past them
    ("codegen/gemm_defaults.py", "FEW_ROWS_ENV"),  # form names: refused unless forms
    ("codegen/gemm_defaults.py", "ONE_ROW_PROLOGUE_ENV"),  # a form name: refused unless a form
    ("codegen/gemm_defaults.py", "FORM_STAGES_ENV"),  # form names and counts: refused unless both
    ("tracer/export.py", '"AOTPACK_VERBOSE"'),
    ("tracer/export.py", '"AOTPACK_DEBUG"'),
    ("cli/__init__.py", '"AOTPACK_DEBUG"'),
    ("cli/ship.py", '"AOTPACK_VERBOSE"'),
    ("verify/interpret.py", '"TRITON_INTERPRET"'),
    ("serve/triton.py", '"{ENV_SITE_DIRS}"'),  # a generated model file's folder list
    ("serve/triton_model.py", "ENV_PROFILE"),  # a file to write
}


def test_no_setting_is_read_beside_the_parser():
    """Outside ``aot/settings.py`` the packages read the environment only at ``OTHER_READS``: a new
    switch goes through ``setting`` (or is added there with the reason it parses on its own)."""
    read = re.compile(r"os\.(?:environ\.get|getenv)\(\s*([^,)]+)")
    found = set()
    for folder in ("aot", "codegen", "loader", "runtime", "tracer", "packager", "verify", "cli", "serve"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "aot/settings.py":
                continue
            found |= {(rel, m.group(1).strip()) for m in read.finditer(path.read_text())}
    assert found == OTHER_READS


def test_docs_settings_names_every_variable_and_no_other():
    """``docs/settings.md`` lists every ``AOTPACK_*`` variable the packages, tests and benchmarks read, and none
    that nothing reads."""
    name = re.compile(r"(?<=[\"'`])AOTPACK_[A-Z0-9_]*[A-Z0-9]")  # quoted: a name, not a constant
    in_code = set()
    for folder in (
        "aot",
        "codegen",
        "loader",
        "runtime",
        "tracer",
        "packager",
        "verify",
        "cli",
        "serve",
        "tests",
        "bench",
    ):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "test_settings.py":
                in_code |= set(name.findall(path.read_text()))
    documented = set(name.findall((ROOT / "docs" / "settings.md").read_text()))
    assert documented == in_code, (sorted(in_code - documented), sorted(documented - in_code))
