"""Bundles of unmodified transformers encoder-decoders (``aot.hf.seq2seq``) generate exactly the
tokens of transformers' greedy ``generate`` (fp32, CPU): BART by default (one source, then three
sources of different lengths padded on the right), T5 and Whisper (log-mel features through the
Python API) and the CLI in the slow run. Each bundle is built once per session; the configs and
the reference ``generate`` call are those of tests/hf/test_seq2seq.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from aot.allowed_ops import STATE_WRITE_OPS
from aot.errors import GuardError
from tests.conftest import HANG_GUARD_S
from tests.realmodels.conftest import unusable

MAX_BATCH = 4
NEW_TOKENS = 6


class Seq2SeqBundles:
    """Each kind's bundle and its eager model (as ModelSpec builds it), built once."""

    def __init__(self, base):
        self.base = base
        self._made: dict[str, tuple] = {}

    def __call__(self, kind: str):
        if kind not in self._made:
            import aot.loader
            from aot.codegen import generate
            from aot.hf import seq2seq
            from aot.packager import pack
            from aot.tracer import trace
            from tests.hf.test_seq2seq import MAX_TARGET, built, factory, max_source

            spec = seq2seq(
                factory(kind),
                max_batch=MAX_BATCH,
                max_source=max_source(kind),
                max_target=MAX_TARGET,
                name=kind,
            )
            path = self.base / f"{kind}.tpk"
            pack(generate(trace(spec), ("sm_90",)), path)
            self._made[kind] = (path, aot.loader.load(path), built(kind))
        return self._made[kind]


@pytest.fixture(scope="session")
def seq2seq_bundles(tmp_path_factory):
    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)
    return Seq2SeqBundles(tmp_path_factory.mktemp("seq2seq_bundles"))


@pytest.mark.parametrize(
    "kind",
    [
        "bart",
        pytest.param("t5", marks=pytest.mark.slow),
        pytest.param("whisper", marks=pytest.mark.slow),
        pytest.param("switch", marks=pytest.mark.slow),
    ],
)
def test_generate_equals_transformers_greedy_generate(seq2seq_bundles, kind):
    from tests.hf.test_seq2seq import hf_greedy, sources

    _, runner, model = seq2seq_bundles(kind)
    assert runner.entry_points == ("prefill", "encode", "decode")
    batch = sources(kind, 3)  # token sources: rows 1 and 2 padded on the right (mask 0 there)
    want = hf_greedy(model, batch, NEW_TOKENS).tolist()
    assert len({t for row in want for t in row}) > 2, (
        "the tokens barely vary; the comparison would prove little"
    )
    one = hf_greedy(model, {k: v[:1] for k, v in batch.items()}, NEW_TOKENS)[0].tolist()
    if kind == "whisper":  # log-mel features [batch, mel_bins, frames]; one [mel_bins, frames] is one list
        features = batch["input_features"]
        assert runner.generate(input_features=features, max_new_tokens=NEW_TOKENS) == want
        assert runner.generate(input_features=features[0], max_new_tokens=NEW_TOKENS) == one
        return
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert runner.generate(ids, NEW_TOKENS, attention_mask=mask) == want
    # lists of prompts are padded on the right here: the same tokens
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    assert runner.generate(rows, NEW_TOKENS) == want
    assert runner.generate(rows[0], NEW_TOKENS) == one
    # a decoder prompt after the start token goes through the prefill entry point
    prompted = hf_greedy(model, batch, NEW_TOKENS, decoder_prompt=[5, 17]).tolist()
    assert runner.generate(ids, NEW_TOKENS, attention_mask=mask, decoder_prompt_ids=[5, 17]) == prompted


def test_each_entry_point_writes_its_caches_in_place(seq2seq_bundles):
    """encode writes the cross caches (and the source mask) and the start token's self-attention
    slot; prefill and decode write the self-attention caches alone and read the cross caches."""
    _, runner, _ = seq2seq_bundles("bart")
    prefill, encode, decode = (runner.program, *runner.program.variants)

    def written(program) -> set[str]:
        return {s.args[0].name for s in program.steps if s.target in STATE_WRITE_OPS}

    self_caches = {f"{k}_cache_{i}" for k in ("key", "value") for i in range(2)}
    cross_caches = {f"cross_{k}_{i}" for k in ("key", "value") for i in range(2)}
    assert written(encode) == self_caches | cross_caches | {"cross_mask"}
    assert written(prefill) == written(decode) == self_caches
    text = runner.guards_text()
    assert "program encode  admits  seq == 1; 1 <= batch <= 4; 1 <= source <= 8\n" in text
    assert "program decode  admits  seq == 1; source == 1; 1 <= batch <= 4\n" in text


def test_inputs_past_the_bundle_are_refused_before_anything_runs(seq2seq_bundles):
    from tests.hf.test_seq2seq import MAX_TARGET

    _, runner, _ = seq2seq_bundles("bart")
    with pytest.raises(
        GuardError, match=r"a prompt of 9 tokens, the bundle's encoder takes at most 8 \(max_source\)"
    ):
        runner.generate(list(range(3, 12)), 2)
    with pytest.raises(
        GuardError,
        match=r"the start token, 0 decoder prompt tokens and 13 new tokens need 13 decoder cache slots, the bundle "
        r"holds 12 \(max_target\); lower max_new_tokens to at most 12",
    ):
        runner.generate([5, 17, 30], MAX_TARGET + 1)
    with pytest.raises(GuardError, match="2 decoder prompt tokens and 11 new tokens need 13"):
        runner.generate([5, 17, 30], MAX_TARGET - 1, decoder_prompt_ids=[4, 4])
    assert len(runner.generate([5, 17, 30], MAX_TARGET)) == MAX_TARGET
    with pytest.raises(GuardError, match="5 prompts, the bundle's batch admits at most 4"):
        runner.generate([[5]] * 5, 2)
    with pytest.raises(GuardError, match="encoder takes token ids: pass prompt_ids"):
        runner.generate(input_features=torch.zeros(1, 16, 24), max_new_tokens=2)
    with pytest.raises(GuardError, match="every prompt needs at least one token"):
        runner.generate([[5, 6], []], 2)
    with pytest.raises(GuardError, match="max_new_tokens must be a positive int, got None"):
        runner.generate([5, 6])
    with pytest.raises(
        GuardError, match="steps_per_launch=4: blocks of decode steps are for causal-LM bundles"
    ):
        runner.generate([5, 6], 2, steps_per_launch=4)
    assert runner.generate([5, 17, 30], 3, steps_per_launch=1) == runner.generate([5, 17, 30], 3)


@pytest.mark.slow
def test_whisper_refuses_features_of_another_shape(seq2seq_bundles):
    _, runner, _ = seq2seq_bundles("whisper")
    with pytest.raises(GuardError, match=r"input_features: expected \[batch, 16, 24\] .*, got \[1, 16, 30\]"):
        runner.generate(input_features=torch.zeros(1, 16, 30), max_new_tokens=2)
    with pytest.raises(GuardError, match="takes log-mel features, not token ids: pass input_features"):
        runner.generate([5, 17], 2)


@pytest.mark.slow
def test_cli_generate_on_a_seq2seq_bundle(seq2seq_bundles):
    from tests.hf.test_seq2seq import hf_greedy

    path, _, model = seq2seq_bundles("bart")
    want = hf_greedy(model, {"input_ids": torch.tensor([[5, 17, 30]])}, NEW_TOKENS)[0].tolist()
    cmd = [sys.executable, "-m", "aot.cli", "generate", str(path), "--prompt-ids", "5,17,30"]
    done = subprocess.run(
        [*cmd, "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == " ".join(map(str, want))
    done = subprocess.run(
        [*cmd, "--max-new-tokens", "40", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode != 0 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]  # after the line that says the bundle loaded
    assert "Traceback" not in done.stderr
    assert (
        last.startswith("error: ") and "need 40 decoder cache slots, the bundle holds 12 (max_target)" in last
    )
