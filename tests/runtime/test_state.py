"""Stateful bundles in the runtime without torch, on the CPU: the state's layout read from a bundle
(tests/data/tiny_lm.py: four KV caches [batch, 2, 32, 8] float32 at the largest batch, 4), the
reset spans, the state writes placed at their state, the slot bounds of ``cache_position``, the
LM contract ``generate`` reads, its argument checks (before any device is touched), the greedy
pick on float16 logits, host int64 arrays as ``ArrayView``s, the ``aotpack-rt generate`` argument
errors, and all of the plan's part in an interpreter where importing torch fails."""

from __future__ import annotations

import struct

import pytest

from aot.errors import GuardError
from tests.codegen.test_cache_kernels import tiny_lm_free  # noqa: F401 - the fixture
from tests.runtime.test_torch_free import run_torch_free

CACHE = (4, 2, 32, 8)  # tiny_lm: [MAX_BATCH, KV_HEADS, MAX_CONTEXT, HEAD_DIM]
CACHE_BYTES = 4 * 2 * 32 * 8 * 4
CACHES = ["key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, built):
    """tests/data/tiny_lm.py packed unfused (no compile: the plan is what is tested here), from the
    session's trace of it."""
    from aot.codegen import generate
    from aot.packager import pack

    out = tmp_path_factory.mktemp("state") / "tiny_lm.tpk"
    pack(generate(built.traced("tiny_lm"), ("sm_90",), fuse=False), out)
    return out


class _Checked:
    """What ``generate`` reads of a ``Checked``, for a bundle the runtime would refuse to run."""

    def __init__(self, bundle):
        from aot.dtypes import ITEMSIZE
        from aot.guards import GuardCore

        self.guards = GuardCore(bundle.manifest.guards, ITEMSIZE)
        self.input_names = self.guards.names
        self.entry_points = tuple(dict.fromkeys(p.entry for p in bundle.manifest.programs if p.entry))


def test_state_layout_reset_spans_and_slot_bounds(tiny_lm):
    from aot.bundle import open_bundle
    from aot.dtypes import ITEMSIZE
    from aot.program import live_steps
    from aot.runtime.plan import ALIGN, StateLayout, state_writes
    from aot.state import index_bounds, state_specs

    bundle = open_bundle(tiny_lm)
    specs = state_specs(bundle.manifest.guards, ITEMSIZE, str(tiny_lm))
    assert list(specs) == CACHES
    assert {(s.dtype, s.shape, s.batch) for s in specs.values()} == {("float32", CACHE, "batch")}
    layout = StateLayout(specs)
    assert CACHE_BYTES % ALIGN == 0
    assert [layout.offsets[n] for n in CACHES] == [i * CACHE_BYTES for i in range(4)]
    assert layout.size == 4 * CACHE_BYTES and layout.rows == 4
    assert layout.spans() == [(0, 4 * CACHE_BYTES)]
    row = CACHE_BYTES // 4
    assert layout.spans([2, 0]) == [(i * CACHE_BYTES + r * row, row) for i in range(4) for r in (0, 2)]
    with pytest.raises(
        GuardError, match=r"reset rows must be ints in 0\.\.3 \(the state's batch rows\), got \[4\]"
    ):
        layout.spans([1, 4])
    program = bundle.program()
    for p in (program, *program.variants):
        shapes = {n: s.shape for n, s in specs.items()}
        assert index_bounds(p, shapes) == tuple(("cache_position", n, 32) for n in sorted(CACHES))
        writes = state_writes(p, live_steps(p))
        assert sorted(set(writes.values())) == sorted(CACHES)  # every cache written, its result placed there
        assert not set(writes) & set(CACHES)


def test_generate_refuses_bad_arguments_before_running(tiny_lm):
    from aot.bundle import open_bundle
    from aot.runtime.generate import generate, lm_contract

    checked = _Checked(open_bundle(tiny_lm))
    assert lm_contract(checked) == (4, 32)

    class Runner:  # runs nothing: every case is refused first
        def __init__(self):
            self.checked = checked

        def run_views(self, *a, **k):
            raise AssertionError("ran")

        def reset(self, rows):
            raise AssertionError("reset")

    runner = Runner()
    cases = [
        (([1, 2], 0), r"max_new_tokens must be a positive int, got 0"),
        (([[1]] * 5, 2), r"5 prompts, the bundle's batch admits at most 4"),
        (
            ([1] * 30, 3),
            r"a prompt of 30 tokens plus 3 new tokens needs 33 cache slots, the bundle's context holds 32",
        ),
        (([[1, 2], []], 2), r"prompt 1: expected a non-empty list of int token ids"),
        (([1, 2.5], 2), r"prompt 0: expected a non-empty list of int token ids"),
        (("12", 2), r"prompt_ids: expected a list of token ids"),
    ]
    for (prompt, n), message in cases:
        with pytest.raises(GuardError, match=message):
            generate(runner, prompt, n)
    checked.entry_points = ()
    with pytest.raises(
        GuardError, match=r"generate needs a bundle with entry points \['prefill', 'decode'\]"
    ):
        lm_contract(checked)


def test_the_greedy_pick_is_the_first_largest_logit(monkeypatch):
    from aot.runtime.generate import argmax_rows

    rows = [[0.5, 2.0, -1.0, 2.0], [-3.0, -2.0, -2.5, -7.0], [1.0, 1.0, 1.0, 1.0]]
    data = struct.pack(f"<{12}e", *[v for r in rows for v in r])
    assert argmax_rows(data, "float16", 3, 4) == [1, 1, 0]
    import builtins

    real = builtins.__import__

    def no_numpy(name, *a, **k):
        if name == "numpy":
            raise ImportError("no numpy")
        return real(name, *a, **k)

    # bfloat16 (Llama-3's dtype): values torch rounds apart, a negative row, ties, infinities;
    # against torch's argmax of the same bytes
    import torch

    halves = torch.tensor(
        [[1.0, 1.0078125, -5.0, 1.0], [-3.0, -2.0, -2.0, -7.0], [float("-inf"), -1e30, 3e38, float("inf")]],
        dtype=torch.bfloat16,
    )
    raw = halves.view(torch.int16).numpy().tobytes()
    expected = halves.float().argmax(-1).tolist()
    assert expected == [1, 1, 3]
    assert argmax_rows(raw, "bfloat16", 3, 4) == expected
    monkeypatch.setattr(builtins, "__import__", no_numpy)
    assert argmax_rows(data, "float16", 3, 4) == [1, 1, 0]  # the pure-Python path
    assert argmax_rows(raw, "bfloat16", 3, 4) == expected
    with pytest.raises(
        GuardError, match="reads float32, float16, bfloat16 or float64 logits, the bundle returns int8"
    ):
        argmax_rows(data, "int8", 3, 4)


def test_host_int64_arrays_are_array_views():
    import ctypes

    from aot.runtime.arrays import CPU
    from aot.runtime.generate import HostInt64

    view = HostInt64([[1, 2, 3], [4, 5, 6]]).view()
    assert (view.device_type, view.dtype, view.shape, view.contiguous, view.nbytes) == (
        CPU,
        "int64",
        (2, 3),
        True,
        48,
    )
    assert list((ctypes.c_int64 * 6).from_address(view.ptr)) == [1, 2, 3, 4, 5, 6]
    flat = HostInt64([7, 8]).view()
    assert flat.shape == (2,) and list((ctypes.c_int64 * 2).from_address(flat.ptr)) == [7, 8]


def test_the_state_plan_needs_no_torch(tiny_lm):
    got = run_torch_free(f"""
        import json
        from aot.bundle import open_bundle
        from aot.dtypes import ITEMSIZE
        from aot.runtime.plan import StateLayout
        from aot.runtime.generate import HostInt64, lm_contract
        from aot.state import state_specs
        import aot.runtime
        bundle = open_bundle({str(tiny_lm)!r})
        layout = StateLayout(state_specs(bundle.manifest.guards, ITEMSIZE, "b"))
        try:
            aot.runtime.check({str(tiny_lm)!r})
            refused = ""
        except Exception as e:
            refused = str(e)
        print(json.dumps([layout.size, layout.rows, HostInt64([1, 2]).view().nbytes, refused]))
    """)
    size, rows, nbytes, refused = got
    assert (size, rows, nbytes) == (4 * CACHE_BYTES, 4, 16)
    # unfused, its steps are library calls: the runtime names the first, no longer the state
    assert "is a library call" in refused and "keeps state" not in refused


def test_the_cli_refuses_bad_generate_arguments_in_one_line(tmp_path, capsys):
    from aot.runtime.cli import main

    for argv, message in (
        (["--prompt-ids", "1,x", "--max-new-tokens", "2"], "error: --prompt-ids '1,x': expected token ids"),
        (
            ["--prompt-ids", "1,2", "--max-new-tokens", "0"],
            "error: --max-new-tokens must be at least 1, got 0",
        ),
        (
            ["--prompt-ids", "1,2", "--max-new-tokens", "2", "--steps-per-launch", "0"],
            "error: --steps-per-launch must be at least 1, got 0",
        ),
    ):
        assert main(["generate", str(tmp_path / "none.tpk"), *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and "\n" not in err, err


@pytest.mark.slow  # the library-free build of tiny_lm
def test_a_library_free_stateful_bundle_is_checked_without_torch(tiny_lm_free):  # noqa: F811
    """The runtime's plan of tiny_lm built --library-free, in an interpreter where importing torch
    fails: both entry points, the slot bounds of every cache write, the state laid out."""
    free, _ = tiny_lm_free
    got = run_torch_free(f"""
        import json
        import aot.runtime
        checked = aot.runtime.check({str(free)!r})
        print(json.dumps([
            [e.entry for e in checked.entries],
            [sorted(map(list, e.index_bounds)) for e in checked.entries],
            checked.state.size,
            list(checked.entry_points),
        ]))
    """)
    entries, bounds, size, entry_points = got
    assert entries == ["prefill", "decode"] and entry_points == ["prefill", "decode"]
    assert bounds == [[["cache_position", n, 32] for n in sorted(CACHES)]] * 2
    assert size == 4 * CACHE_BYTES
