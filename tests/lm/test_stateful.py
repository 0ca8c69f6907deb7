"""Stateful bundles on the CPU: a tiny GQA decoder with a real KV cache (tests/data/tiny_lm.py,
written to the LM contract of ``aot.hf.causal_lm``), built once per session: its state writes run
in place, its entry points have their own programs and guards, and ``Runner.generate`` gives the
tokens of an eager loop of the same module, token for token."""

from __future__ import annotations

import json

import pytest
import torch

from aot.errors import BundleError, GuardError, TraceError
from aot.manifest_text import parse_guards_text
from tests.conftest import ROOT, run_aotpack
from tests.hostile_util import aten_step, eager_module, program_json, read_entries, resigned_program

ARCHS = ("sm_90",)
MODEL = "tiny_lm"


@pytest.fixture(scope="session")
def tiny_lm(built):
    return built(MODEL, ARCHS)


@pytest.fixture(scope="session")
def runner(tiny_lm):
    import aot.loader

    return aot.loader.load(tiny_lm)


def eager_generate(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of the eager module, left-padded as generate pads, with its own caches."""
    import importlib

    lm = importlib.import_module("tests.data.tiny_lm")
    model = eager_module(MODEL)
    batch, longest, context = len(prompts), max(map(len, prompts)), lm.MAX_CONTEXT
    caches = [torch.zeros(batch, lm.KV_HEADS, context, lm.HEAD_DIM) for _ in range(2 * lm.LAYERS)]
    ids = torch.zeros(batch, longest, dtype=torch.int64)
    mask = torch.zeros(batch, context, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) : longest] = 1
    pos = (mask[:, :longest].cumsum(-1) - 1).masked_fill(mask[:, :longest] == 0, 1)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        logits = model(ids, pos, torch.arange(longest), mask, *caches)
        last = pos[:, -1].clone()
        for step in range(n):
            token = logits.argmax(-1)
            for i in range(batch):
                out[i].append(int(token[i]))
            mask[:, longest + step] = 1
            last += 1
            logits = model(token[:, None], last[:, None], torch.tensor([longest + step]), mask, *caches)
    return out


def test_generate_equals_the_eager_loop_token_for_token(runner):
    prompts = [[5, 6, 7, 8, 9, 10], [1, 2, 3], [40]]
    assert runner.generate(prompts, 12) == eager_generate(prompts, 12)
    # one prompt alone: a flat list in and out; left padding in a batch changed nothing
    assert runner.generate([1, 2, 3], 12) == eager_generate([[1, 2, 3]], 12)[0]
    assert runner.generate([1, 2, 3], 12) == runner.generate(prompts, 12)[1]


def test_generate_from_a_left_padded_tensor(runner):
    ids = torch.tensor([[0, 0, 1, 2, 3], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert runner.generate(ids, 6, attention_mask=mask) == eager_generate([[1, 2, 3], [5, 6, 7, 8, 9]], 6)
    with pytest.raises(GuardError, match="is not left padding"):
        runner.generate(ids, 6, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))


def test_eos_stops_a_row_and_keeps_the_eos(runner):
    full = runner.generate([[5, 6, 7], [1, 2]], 10)
    eos = full[0][3]
    cut = runner.generate([[5, 6, 7], [1, 2]], 10, eos_token_id=eos)
    for got, want in zip(cut, full):
        stop = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:stop]


def test_running_ahead_of_the_host_changes_no_token(runner, monkeypatch):
    """What a GPU does for greedy decoding (the next step launched before the host reads this
    step's tokens), forced on the CPU: the same tokens, eos cut-offs and on_token calls, and no
    step launched past the last token."""
    import aot.loader.generate as gen

    prompts = [[5, 6, 7], [1, 2]]
    want = runner.generate(prompts, 10)
    eos = want[0][3]
    want_eos = runner.generate(prompts, 10, eos_token_id=eos)
    want_seen: list[list[int]] = []
    runner.generate(prompts, 10, on_token=lambda step, values: want_seen.append(values))
    alone = runner.generate([5, 6, 7], 10)
    want_cut = runner.generate([5, 6, 7], 10, eos_token_id=alone[2])
    assert len(want_cut) < 10

    decodes = []
    entry = runner.entry

    def counting_entry(name):
        call = entry(name)
        return (lambda **inputs: decodes.append(1) or call(**inputs)) if name == "decode" else call

    monkeypatch.setattr(runner, "entry", counting_entry)
    monkeypatch.setattr(gen, "_runs_ahead", lambda device, do_sample: not do_sample)
    seen: list[list[int]] = []
    assert runner.generate(prompts, 10, on_token=lambda step, values: seen.append(values)) == want
    assert seen == want_seen
    assert len(decodes) == 9  # 10 tokens: the prefill's and 9 decode steps
    assert runner.generate(prompts, 10, eos_token_id=eos) == want_eos
    decodes.clear()
    assert runner.generate([5, 6, 7], 10, eos_token_id=alone[2]) == want_cut
    assert len(decodes) == len(want_cut)  # one step ran ahead of the eos nobody had read yet


def test_tune_generates_inputs_each_entry_points_programs_admit(runner):
    """``aotpack tune`` times every program at its buckets: a decode program fixes seq to 1 where
    the bundle's contract leaves it free, so its inputs are made at seq 1 (checked without a GPU)."""
    from aot.verify.tune import pinned_sizes

    for index, program in enumerate(runner.manifest.programs):
        pinned = pinned_sizes(runner.manifest, index)
        assert pinned == ({"seq": 1} if program.entry == "decode" else {})
        for batch in (1, 2):
            inputs = runner.inputs_at({**pinned, "batch": batch})
            sizes = runner.executors[index].admits(inputs)
            assert sizes is not None and sizes["batch"] == batch


def test_sampling_is_reproducible_with_a_seed(runner):
    a = runner.generate([[5, 6, 7]], 16, do_sample=True, temperature=1.5, top_k=20, seed=7)
    b = runner.generate([[5, 6, 7]], 16, do_sample=True, temperature=1.5, top_k=20, seed=7)
    c = runner.generate([[5, 6, 7]], 16, do_sample=True, temperature=1.5, top_k=20, seed=8)
    assert a == b
    assert a != c
    assert a != runner.generate([[5, 6, 7]], 16)  # not greedy
    # top_k=1 is greedy whatever the seed
    assert runner.generate([[5, 6, 7]], 8, do_sample=True, top_k=1, seed=3) == runner.generate([[5, 6, 7]], 8)


def test_overflow_and_misuse_are_guard_errors_before_running(runner):
    with pytest.raises(
        GuardError, match=r"a prompt of 30 tokens plus 5 new tokens needs 35 cache slots.*holds 32"
    ):
        runner.generate([list(range(30))], 5)
    with pytest.raises(GuardError, match="5 prompts, the bundle's batch admits at most 4"):
        runner.generate([[1]] * 5, 2)
    with pytest.raises(GuardError, match="max_new_tokens must be a positive int"):
        runner.generate([1, 2], 0)
    with pytest.raises(GuardError, match="at least one token"):
        runner.generate([[1], []], 2)


def test_state_is_written_in_place_not_copied(runner):
    program = runner.program  # prefill; decode is its variant
    for p in (program, *program.variants):
        assert p.state == ("key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1")
        # each write a step, or in the reference of the kernel that runs it (the decode attention
        # kernel appends the step's keys and values itself)
        writes = [
            r
            for s in p.steps
            for r in (s.reference if s.kind == "kernel" else (s,))
            if r.target.startswith("aten.index_put")
        ]
        assert [s.target for s in writes] == ["aten.index_put_.default"] * 4
        assert [s.args[0].name for s in writes] == list(p.state)
        # no functional copy of the cache, no trailing copy_
        assert not [s for s in p.steps if s.target in ("aten.copy_.default", "aten.index_put.default")]
    runner.reset()
    state = dict(runner.state.tensors)
    pointers = {k: v.data_ptr() for k, v in state.items()}
    runner.entry("prefill")(
        input_ids=torch.tensor([[1, 2, 3]]),
        position_ids=torch.tensor([[0, 1, 2]]),
        cache_position=torch.tensor([0, 1, 2]),
        attention_mask=torch.tensor([[1, 1, 1] + [0] * 29]),
    )
    k = runner.state.tensors["key_cache_0"]
    assert {n: t.data_ptr() for n, t in runner.state.tensors.items()} == pointers
    assert k[0, :, :3].abs().sum() > 0 and k[0, :, 3:].abs().sum() == 0 and k[1:].abs().sum() == 0
    runner.entry("decode")(
        input_ids=torch.tensor([[4]]),
        position_ids=torch.tensor([[3]]),
        cache_position=torch.tensor([3]),
        attention_mask=torch.tensor([[1, 1, 1, 1] + [0] * 28]),
    )
    assert k[0, :, 3].abs().sum() > 0 and k[0, :, 4:].abs().sum() == 0
    runner.reset(rows=[1])
    assert k[0].abs().sum() > 0
    runner.reset(rows=0)
    assert k.abs().sum() == 0
    with pytest.raises(GuardError, match=r"reset rows must be ints in 0\.\.3"):
        runner.reset(rows=[4])


def test_state_is_the_runners_not_the_callers(runner):
    with pytest.raises(GuardError, match="input 'key_cache_0' is state: the runner owns it"):
        runner.entry("decode")(
            input_ids=torch.tensor([[4]]),
            position_ids=torch.tensor([[3]]),
            cache_position=torch.tensor([3]),
            attention_mask=torch.ones(1, 32, dtype=torch.int64),
            key_cache_0=torch.zeros(1, 2, 32, 8),
        )
    assert runner.input_names == ("input_ids", "position_ids", "cache_position", "attention_mask")
    assert runner.state_names == ("key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1")


def test_entry_points_have_their_own_programs_and_guards(runner, tiny_lm):
    assert runner.entry_points == ("prefill", "decode")
    decode = runner.entry("decode")
    with pytest.raises(GuardError, match=r"expected static size 1, got 2"):
        decode(
            input_ids=torch.tensor([[4, 5]]),
            position_ids=torch.tensor([[3, 4]]),
            cache_position=torch.tensor([3, 4]),
            attention_mask=torch.ones(1, 32, dtype=torch.int64),
        )
    with pytest.raises(
        GuardError, match=r"no entry point 'score'; its entry points are \['prefill', 'decode'\]"
    ):
        runner.entry("score")
    text = runner.guards_text()
    assert "state key_cache_0: float32[batch, 2, 32, 8]\n" in text
    assert "input attention_mask: int64[batch, 32]\n" in text
    assert "entry prefill\nentry decode\n" in text
    assert "program prefill  admits  1 <= batch <= 4; 1 <= seq <= 32\n" in text
    assert "program decode  admits  seq == 1; 1 <= batch <= 4\n" in text
    parsed = parse_guards_text(text)
    assert parsed.entry_points == ("prefill", "decode")
    assert [i.name for i in parsed.guards.inputs if i.state] == list(runner.state_names)
    entries = runner.manifest.programs
    assert [e.entry for e in entries] == ["prefill", "decode"]
    assert [b.symbol for b in entries[1].buckets] == ["batch"]  # seq is static in decode


def test_a_plain_call_goes_to_the_narrowest_entry_point_that_admits_it(runner):
    def call(seq: int):
        return dict(
            input_ids=torch.tensor([[4] * seq]),
            position_ids=torch.arange(seq)[None],
            cache_position=torch.arange(seq),
            attention_mask=torch.ones(1, 32, dtype=torch.int64),
        )

    bind = runner.guards.bind
    one, _ = runner._dispatch(bind((), call(1)))
    two, _ = runner._dispatch(bind((), call(2)))
    assert (one.entry, two.entry) == ("decode", "prefill")
    runner.reset()
    via_plain = runner(**call(1))
    runner.reset()
    via_decode = runner.entry("decode")(**call(1))
    runner.reset()
    torch.testing.assert_close(via_plain, via_decode, rtol=0, atol=0)


def test_guards_of_the_model_file_match_the_bundle(tiny_lm):
    done = run_aotpack(
        "check", str(ROOT / "tests/data/tiny_lm.py"), "--against", str(tiny_lm), "--arch", "sm_90"
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_state_write_into_anything_but_state_is_refused_at_load(tmp_path, tiny_lm):
    import aot.loader

    data = tiny_lm.read_bytes()
    prog = program_json(read_entries(data))
    weight = prog["weights"][0]["name"]
    for target, first in [
        ("aten.copy_.default", {"buf": weight}),  # a weight
        ("aten.index_put_.default", {"buf": "attention_mask"}),  # a caller's input
    ]:
        hostile = json.loads(json.dumps(prog))
        step = aten_step(target, [first, [None], {"buf": "input_ids"}], ["evil"])
        if target == "aten.copy_.default":
            step = aten_step(target, [first, {"buf": weight}], ["evil"])
        hostile["steps"].insert(0, step)
        hostile["buffers"]["evil"] = {"dtype": "float32", "shape": ["1"]}
        path = tmp_path / f"{target}.tpk"
        path.write_bytes(resigned_program(data, hostile))
        with pytest.raises(BundleError, match=r"writes into .*which is not a state input of the program"):
            aot.loader.load(path)
    # a program that claims a state the bundle's guards do not have
    hostile = json.loads(json.dumps(prog))
    hostile["state"] = [*hostile["state"], "attention_mask"]
    path = tmp_path / "claims.tpk"
    path.write_bytes(resigned_program(data, hostile))
    with pytest.raises(BundleError, match="declares state"):
        aot.loader.load(path)


def test_a_kernel_writing_in_place_into_anything_but_state_is_refused_at_load(tmp_path, tiny_lm):
    """``Step.in_place`` (a decode attention kernel appending to its KV cache) names a buffer the
    kernel writes through a pointer it is given: only the program's state may be, only by a
    kernel step, each buffer once."""
    import aot.loader

    data = tiny_lm.read_bytes()
    prog = program_json(read_entries(data))
    kernel_at = next(i for i, s in enumerate(prog["steps"]) if s["kind"] == "kernel")
    kernel = prog["steps"][kernel_at]
    given = [a["buf"] for a in kernel["args"] if isinstance(a, dict) and "buf" in a]
    weights = {w["name"] for w in prog["weights"]}
    cases = [
        # a kernel step writing a weight (or a caller's input) it reads
        (
            kernel_at,
            {kernel["outputs"][0]: next(g for g in given if g in weights)},
            "which is not a state input",
        ),
        # a buffer the kernel is not given
        (kernel_at, {kernel["outputs"][0]: prog["state"][0]}, "only a kernel step may"),
        # an ATen step claiming a write in place
        (
            next(i for i, s in enumerate(prog["steps"]) if s["kind"] == "aten" and s["args"]),
            None,
            "only a kernel step may",
        ),
    ]
    for n, (at, in_place, message) in enumerate(cases):
        hostile = json.loads(json.dumps(prog))
        step = hostile["steps"][at]
        if in_place is None:
            first = step["args"][0]["buf"] if isinstance(step["args"][0], dict) else prog["state"][0]
            in_place = {step["outputs"][0]: first}
        step["in_place"] = in_place
        path = tmp_path / f"in_place_{n}.tpk"
        path.write_bytes(resigned_program(data, hostile))
        with pytest.raises(BundleError, match=message):
            aot.loader.load(path)


def test_state_counts_against_max_memory(tiny_lm):
    import aot.errors
    import aot.loader

    with pytest.raises(aot.errors.EnvError, match="max_memory"):
        aot.loader.load(tiny_lm, max_memory=64 << 10)  # the state alone is 64 KiB


def _write_model(tmp_path, body: str, inputs: str):
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom torch import nn\nfrom aot import Dim, Input, ModelSpec\n"
        "batch = Dim('batch', 1, 4)\n"
        f"class M(nn.Module):\n{body}\n"
        f"spec = ModelSpec(module=M, inputs=[{inputs}])\n"
    )
    return path


def test_writes_into_inputs_or_buffers_that_are_not_state_are_trace_errors(tmp_path):
    from aot.tracer import load_model_file, trace

    path = _write_model(
        tmp_path,
        "    def forward(self, x, cache):\n        cache.add_(x)\n        return cache * 2\n",
        "Input('x', (batch, 8)), Input('cache', (batch, 8))",
    )
    with pytest.raises(
        TraceError, match=r"m\.py:7: the model writes into its input 'cache' in place, which is not state"
    ):
        trace(load_model_file(path))
    path = _write_model(
        tmp_path,
        "    def __init__(self):\n        super().__init__()\n        self.register_buffer('total', torch.zeros(8))\n"
        "    def forward(self, x):\n        self.total.add_(x.sum(0))\n        return x + self.total\n",
        "Input('x', (batch, 8))",
    )
    with pytest.raises(TraceError, match=r"m\.py:10: the model writes into its buffer 'total' in place"):
        trace(load_model_file(path))


def test_a_state_read_after_its_write_is_stored_by_a_trailing_copy(tmp_path):
    """The old value is read after the write: the write stays functional and a trailing copy_
    stores it; each call sees the state the previous one left."""
    import aot.loader
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = _write_model(
        tmp_path,
        "    def forward(self, x, total):\n        before = total * 1.0\n        total.add_(x)\n"
        "        return before + total\n",
        "Input('x', (batch, 8)), Input('total', (batch, 8), state=True)",
    )
    traced = trace(load_model_file(path))
    assert traced.program.steps[-1].target == "aten.copy_.default"
    out = tmp_path / "m.tpk"
    pack(generate(traced, ARCHS), out)
    runner = aot.loader.load(out)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    total = torch.zeros(4, 8)
    for _ in range(3):
        want = total[:2] * 1.0 + (total[:2] + x)
        total[:2] += x
        torch.testing.assert_close(runner(x=x), want, rtol=0, atol=0)
    torch.testing.assert_close(runner.state.tensors["total"], total, rtol=0, atol=0)


def test_cli_generate_and_load(tiny_lm, runner):
    cmd = ["generate", str(tiny_lm), "--prompt-ids", "5,6,7;1,2", "--max-new-tokens", "6"]
    done = run_aotpack(*cmd)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    want = runner.generate([[5, 6, 7], [1, 2]], 6)
    assert lines == [" ".join(map(str, w)) for w in want]
    assert "tokens/s" in done.stderr
    done = run_aotpack(*cmd, "--steps-per-launch", "2")  # blocks of two steps: the same tokens
    assert done.returncode == 0 and done.stdout.strip().splitlines() == lines, done.stderr
    done = run_aotpack(*cmd, "--steps-per-launch", "0")
    assert done.returncode == 2 and "--steps-per-launch" in done.stderr and "Traceback" not in done.stderr
    done = run_aotpack(*cmd[:2], "--prompt-ids", ",".join(["1"] * 30), "--max-new-tokens", "5")
    assert done.returncode == 1 and "needs 35 cache slots" in done.stderr and "Traceback" not in done.stderr
    done = run_aotpack("load", str(tiny_lm), "--iters", "2", "--warmup", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout


def test_diff_compares_entry_points_and_state(runner):
    from aot.review.manifest_changes import diff_manifests

    text = runner.guards_text()
    base = parse_guards_text(text)
    assert diff_manifests(base, base) == []

    def kinds(new_text: str) -> list[tuple[str, str, bool]]:
        return [(c.kind, c.subject, c.breaking) for c in diff_manifests(base, parse_guards_text(new_text))]

    narrowed = text.replace(
        "program decode  admits  seq == 1; 1 <= batch <= 4",
        "program decode  admits  seq == 1; 1 <= batch <= 2",
    )
    assert ("narrowed", "entry point decode batch", True) in kinds(narrowed)
    widened = text.replace("seq == 1; 1 <= batch <= 4", "1 <= seq <= 2; 1 <= batch <= 4")
    assert ("widened", "entry point decode seq", False) in kinds(widened)
    removed = text.replace("entry decode\n", "").replace(
        "program decode  admits  seq == 1; 1 <= batch <= 4\n", ""
    )
    assert ("entry point removed", "entry point decode", True) in kinds(removed)
    assert ("entry point added", "entry point decode", False) in [
        (c.kind, c.subject, c.breaking) for c in diff_manifests(parse_guards_text(removed), base)
    ]
    flipped = text.replace("state value_cache_1:", "input value_cache_1:")
    assert ("state", "input value_cache_1", True) in kinds(flipped)
    dropped = text.replace("state value_cache_1: float32[batch, 2, 32, 8]\n", "")
    assert kinds(dropped) == [("state removed", "state value_cache_1", False)]


@pytest.mark.parametrize("slot", [32, 99, -1])
def test_a_cache_position_outside_the_state_is_a_guard_error_before_anything_runs(runner, slot):
    """Checked before the call on every device (on a GPU an index past the state is a device-side
    assert that ends the process; a negative one wraps around to another slot everywhere), and
    the state is untouched."""
    runner.reset()
    before = {n: t.clone() for n, t in runner.state.tensors.items()}
    with pytest.raises(GuardError) as err:
        runner.entry("decode")(
            input_ids=torch.tensor([[4]]),
            position_ids=torch.tensor([[3]]),
            cache_position=torch.tensor([slot]),
            attention_mask=torch.ones(1, 32, dtype=torch.int64),
        )
    assert str(err.value).startswith(
        f"cache_position holds slot {slot}, the state 'key_cache_0' has 32 slots"
    )
    for name, t in runner.state.tensors.items():
        assert torch.equal(t, before[name]), name


def test_the_index_inputs_of_state_writes_are_found(runner):
    for entry in runner._entries:
        assert {(n, b) for n, _, b in entry.index_bounds} == {("cache_position", 32)}
        assert {s for _, s, _ in entry.index_bounds} == set(runner.state_names)


def test_generations_on_one_runner_run_one_at_a_time(runner):
    import threading

    prompts = [[[5, 6, 7]], [[1, 2, 3, 4]], [[9]], [[2, 2]]]
    want = [runner.generate(p, 10) for p in prompts]
    got: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i: got.update({i: runner.generate(prompts[i], 10)}))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == want


@pytest.mark.parametrize("steps", [2, 3, 8])
def test_blocks_of_steps_give_the_step_by_step_tokens(runner, steps, monkeypatch):
    """Several greedy steps per launch (``aot.loader.decode_blocks``; on a GPU one CUDA graph per
    block, here the same steps run eagerly): the argmax, the end-of-sequence bookkeeping and the
    next step's inputs written on the device give the tokens, cut-offs and ``on_token`` calls of
    one step at a time, whether the steps fill whole blocks or leave a remainder."""
    from aot.loader import decode_blocks

    launches = []
    launch = decode_blocks._Block.launch
    monkeypatch.setattr(decode_blocks._Block, "launch", lambda block: launches.append(1) or launch(block))
    prompts = [[5, 6, 7, 8, 9, 10], [1, 2, 3], [40]]
    for n in (1, 2, steps + 1, 2 * steps + 1, 11):
        want_seen: list = []
        want = runner.generate(prompts, n, on_token=lambda s, v, out=want_seen: out.append((s, v)))
        assert not launches
        seen: list = []
        got = runner.generate(
            prompts, n, steps_per_launch=steps, on_token=lambda s, v, out=seen: out.append((s, v))
        )
        assert got == want, n
        assert seen == want_seen, n
        # step 0 runs alone (on a GPU it captures the bucket's graph), the last step feeds nothing
        assert len(launches) == max(0, n - 2) // steps, n
        launches.clear()
    full = runner.generate(prompts, 11)
    eos = full[1][4]
    want_eos = runner.generate(prompts, 11, eos_token_id=eos)
    assert any(len(row) < 11 for row in want_eos)
    assert runner.generate(prompts, 11, eos_token_id=eos, steps_per_launch=steps) == want_eos
    # a generation after blocks starts from the reset state: no carry leaks between calls
    assert runner.generate([1, 2, 3], 9, steps_per_launch=steps) == full[1][:9]
    with pytest.raises(GuardError, match="steps_per_launch must be a positive int"):
        runner.generate([1, 2, 3], 4, steps_per_launch=0)
