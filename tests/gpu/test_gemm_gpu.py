"""GEMM candidates on a GPU: tune a bundle built with ``--gemm-candidates`` on the CPU box, check
the tuned bundle against the untuned one and against eager, and ``aotpack verify`` it.

    AOTPACK_GPU_BUNDLES=/path/with/{mlp,gpt}-gemm.tpk pytest -m gpu tests/gpu/test_gemm_gpu.py

(``aotpack build models/mlp.py -o mlp-gemm.tpk --gemm-candidates``; ``bench/gemm_tune.sh`` does it
all.) Never run in CI (no GPU there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

BUNDLES = Path(os.environ.get("AOTPACK_GPU_BUNDLES", "bundles"))
ROOT = Path(__file__).resolve().parents[2]
# tuned vs untuned, fp16: both sides are GEMMs with fp32 accumulation over the same K; the Triton
# epilogue rounds once where the library path rounds after each op (a few fp16 ulps of the scale)
TOLERANCE = {"mlp": 2e-2, "gpt": 6e-2}
SHAPES = {
    "mlp": [{"batch": 1}, {"batch": 8}, {"batch": 3}, {"batch": 64}],
    "gpt": [{"batch": 1, "seq": 1}, {"batch": 1, "seq": 128}, {"batch": 3, "seq": 100}],
}


def _bundle(name: str) -> Path:
    path = BUNDLES / f"{name}-gemm.tpk"
    if not path.is_file():
        pytest.skip(f"no prebuilt bundle {path} (aotpack build models/{name}.py --gemm-candidates)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return path


def _copy(src: Path, folder: Path, name: str | None = None) -> Path:
    """``src`` copied into ``folder`` (as ``name``) with its split weights, which a bundle reads from
    beside itself (the weights file keeps its name: the bundle checks it by its sha256)."""
    dst = folder / (name or src.name)
    dst.write_bytes(src.read_bytes())
    for weights in src.parent.glob(f"{src.stem}.weights.*.safetensors"):
        (folder / weights.name).write_bytes(weights.read_bytes())
    return dst


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    from aot.verify.tune import tune

    out = {}

    def get(name: str) -> tuple[Path, Path, object]:
        if name not in out:
            src = _bundle(name)
            folder = tmp_path_factory.mktemp("tuned")
            src = _copy(src, folder)  # the tuned bundle goes beside the weights it shares
            dst = folder / f"{name}-tuned.tpk"
            buckets = [{"batch": 1}, {"batch": 8}] if name == "mlp" else [{"batch": 1}]
            result = tune(src, dst, buckets=buckets, repeats=20)
            out[name] = (src, dst, result)
        return out[name]

    return get


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_tune_writes_a_table_the_loader_accepts(tuned, name):
    from aot.loader import load
    from aot.verify.tune_rules import FREE_MAX_LOSS

    src, dst, result = tuned(name)
    table = result.table
    assert table.choices and table.arch == "sm_{}{}".format(*torch.cuda.get_device_capability())
    checks = {(k.program, tuple(sorted(k.sizes.items()))): k for k in table.checks}
    for c in table.choices:
        assert "library" in c.times_us and all(0 < t < 1e6 for t in c.times_us.values())
        if c.choice == "library":
            continue
        check = checks[(c.program, tuple(sorted(c.sizes.items())))]
        if check.whole_plan:  # every site on its fastest matching candidate, winning alone or not
            matched = [k for k in c.times_us if k not in ("library", *c.rejected)]
            assert c.times_us[c.choice] == min(c.times_us[k] for k in matched)
        else:  # chosen site by site: a candidate that won alone
            assert c.times_us[c.choice] <= 0.97 * c.times_us["library"]
    # a candidate stands only where its bucket's whole program was faster with the choices, or
    # within FREE_MAX_LOSS where they leave no cuBLAS call (library_free)
    for c in table.choices:
        if c.choice != "library":
            check = checks[(c.program, tuple(sorted(c.sizes.items())))]
            assert check.kept and (check.tuned_us < check.library_us or check.library_free)
    for k in table.checks:
        assert 0 < k.library_us < 1e6 and 0 < k.tuned_us < 1e6
        assert k.tuned_us < k.library_us or not k.kept or k.library_free
        assert not k.library_free or k.tuned_us <= (1 + FREE_MAX_LOSS) * k.library_us + 0.01  # rounded
    runner = load(dst, device="cuda")
    assert runner.tuning == table
    plans = [e.gpu.plans for e in runner._entries]
    assert bool(any(plans)) == any(c.choice != "library" for c in table.choices)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_tuned_matches_untuned(tuned, name):
    from aot.loader import load
    from aot.pytree import leaves

    src, dst, _ = tuned(name)
    plain, fast = load(src, device="cuda"), load(dst, device="cuda")
    for sizes in SHAPES[name]:
        inputs = plain.inputs_at(sizes, seed=1)
        want = [t.float() for t in leaves(plain(**inputs))]
        got = [t.float() for t in leaves(fast(**inputs))]
        for w, g in zip(want, got):
            scale = max(1.0, w.abs().max().item())
            assert (g - w).abs().max().item() <= TOLERANCE[name] * scale, sizes


def test_same_measurements_same_bytes(tuned):
    from aot import schema
    from aot.loader import open_bundle
    from aot.verify.tuning_table import write_tuned

    src, dst, result = tuned("mlp")
    again = dst.parent / "again.tpk"
    write_tuned(src, again, result.table)
    a, b = open_bundle(dst), open_bundle(again)
    try:
        assert a.read(schema.TUNING_PATH) == b.read(schema.TUNING_PATH)
    finally:
        a.close(), b.close()
    assert dst.read_bytes() == again.read_bytes()


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_verify_passes_on_the_tuned_bundle(tuned, name):
    _, dst, _ = tuned(name)
    proc = subprocess.run(
        [sys.executable, "-m", "aot.cli", "verify", str(dst)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_tune_cli_reports_signature(tuned, tmp_path):
    """A signed bundle: tune writes it and says in one line that it must be signed again."""
    pytest.importorskip("cryptography")
    from aot.packager.sign import sign_bundle
    from aot.signing import write_key_pair

    key = tmp_path / "k.key"
    write_key_pair(str(key))
    signed = _copy(_bundle("mlp"), tmp_path, "signed.tpk")
    sign_bundle(str(signed), str(key))
    proc = subprocess.run(
        [sys.executable, "-m", "aot.cli", "tune", str(signed), "--bucket", "batch=1", "--repeats", "5"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sum("re-sign it with" in line for line in proc.stderr.splitlines()) == 1  # results go to stderr


def test_a_tuned_stateful_lm_generates_the_untuned_tokens(tmp_path):
    """A causal LM bundle with GEMM candidates (built here for this GPU's arch), tuned at its
    decode buckets: the KV cache is bound while timing, and the tuned bundle generates the tokens
    of the untuned one (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from aot.verify.tune import tune
    from tests.hf.test_causal_lm import factory
    from tests.realmodels.conftest import require

    require("transformers")
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    spec = causal_lm(factory("llama"), max_batch=4, max_context=16, name="llama")
    plain = tmp_path / "llama.tpk"
    pack(generate(trace(spec), (arch,), gemm_candidates=True), plain)
    tuned = tmp_path / "llama-tuned.tpk"
    result = tune(plain, tuned, repeats=3)
    runner = load(plain, device="cuda")
    decode = {i for i, p in enumerate(runner.manifest.programs) if p.entry == "decode"}
    assert {c.program for c in result.table.choices} & decode  # decode's programs were timed too
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    want = runner.generate(prompts, 6)
    assert load(tuned, device="cuda").generate(prompts, 6) == want


def test_a_library_free_cnn_calls_no_cublas_at_its_buckets(tmp_path):
    """ResNet-18's one library GEMM is its classifier head, which moves the whole program by less
    than 1%: built with candidates for this GPU and tuned at every bucket, tune says once whether
    the library-free plan was taken; where it was, no bucket's plan calls cuBLAS and the tuned
    bundle computes what the untuned one does."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import calls_cublas
    from aot.pytree import leaves
    from aot.tracer import load_model_file, trace
    from aot.verify.tune import tune

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    plain = tmp_path / "cnn.tpk"
    pack(generate(trace(load_model_file(ROOT / "models" / "cnn.py")), (arch,), gemm_candidates=True), plain)
    said: list[str] = []
    result = tune(plain, tmp_path / "cnn-tuned.tpk", repeats=10, say=said.append)
    summary = [line for line in said if line.startswith("library-free: ")]
    assert len(summary) == 1, said[-10:]
    if not any(k.library_free for k in result.table.checks):
        pytest.skip(f"the library-free plan was not taken on this GPU: {summary[0]}")
    tuned = load(result.output, device="cuda")  # a bucket's call runs its graph, of the plan
    for program, sizes in {(c.program, tuple(sorted(c.sizes.items()))) for c in result.table.choices}:
        entry = tuned._entries[program]
        key = tuple(dict(sizes)[s.symbol] for s in entry.program.symbols)
        assert not any(calls_cublas(s) for s in entry.gpu.steps_at(key)), (program, sizes)
    inputs = tuned.inputs_at({"batch": 8}, seed=1)
    want = [t.float() for t in leaves(load(plain, device="cuda")(**inputs))]
    got = [t.float() for t in leaves(tuned(**inputs))]
    for w, g in zip(want, got):
        assert (g - w).abs().max().item() <= 2e-2 * max(1.0, w.abs().max().item())


def test_transformers_gpt2_candidates_match_the_library_on_the_gpu(tmp_path):
    """HF GPT-2 (the zoo's tiny config): its Conv1D projections (W stored [K, N]) and its
    attention, as transformers shapes the heads, are sites; tuned on this GPU, every candidate
    matches the library's results there (tune refuses one that does not), and the tuned bundle
    computes what the untuned one does."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.pytree import leaves
    from aot.tracer import trace
    from aot.verify.tune import tune
    from tests.realmodels.zoo import ZOO

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    plain = tmp_path / "gpt2.tpk"
    compiled = generate(trace(ZOO["gpt2"]()), (arch,), gemm_candidates=True)
    ids = [s.id for s in compiled.program.alternatives]
    assert sum(i.startswith("gemm_") for i in ids) >= 8 and sum(i.startswith("attn_") for i in ids) == 2
    pack(compiled, plain)
    result = tune(plain, tmp_path / "gpt2-tuned.tpk", repeats=10)
    assert result.table.choices and not [c for c in result.table.choices if c.rejected]
    tuned = load(result.output, device="cuda")
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}):
        inputs = tuned.inputs_at(sizes, seed=2)
        want = [t.float() for t in leaves(load(plain, device="cuda")(**inputs))]
        got = [t.float() for t in leaves(tuned(**inputs))]
        for w, g in zip(want, got):
            assert (g - w).abs().max().item() <= 2e-2 * max(1.0, w.abs().max().item()), sizes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_flash_forms_match_the_library_on_the_gpu(dtype, tmp_path, monkeypatch):
    """The flash forms a default build runs at attention sites without a mask (``gemm_defaults.
    default_attention_form``), in ``dtype`` (Triton's interpreter computes a bfloat16 ``tl.dot``
    wrongly, so only a GPU checks that dtype), against the
    same model built with the library's attention (``AOTPACK_DEFAULT_ATTENTION=off``), at one
    query, a short and the longest length: within the dtype's two-evaluation spread, and the
    flash bundle's plan runs the attention kernels."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from dataclasses import replace

    from aot.codegen import gemm_defaults, generate
    from aot.dtypes import tolerance
    from aot.loader import load
    from aot.packager import pack
    from aot.pytree import leaves
    from aot.tracer import load_model_file, trace

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    spec = replace(load_model_file(ROOT / "tests" / "codegen" / "gemm_models" / "attn_fused.py"), dtype=dtype)
    flash, library = tmp_path / "flash.tpk", tmp_path / "library.tpk"
    compiled = generate(trace(spec), (arch,))
    flash_choices = [c for c in compiled.tuning.choices if c.site.startswith("attn_")]
    assert flash_choices and all(c.choice.startswith("flash_") for c in flash_choices), compiled.tuning
    pack(compiled, flash)
    monkeypatch.setenv(gemm_defaults.ATTENTION_ENV, "off")
    pack(generate(trace(spec), (arch,)), library)
    ours, theirs = load(flash, device="cuda"), load(library, device="cuda")
    tol = tolerance(dtype)
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 2, "seq": 13}, {"batch": 8, "seq": 96}):
        inputs = ours.inputs_at(sizes, seed=3)
        want = [t.float() for t in leaves(theirs(**inputs))]
        got = [t.float() for t in leaves(ours(**inputs))]
        for w, g in zip(want, got):
            assert torch.isfinite(g).all(), sizes
            assert (g - w).abs().max().item() <= 2 * tol.rtol * max(1.0, w.abs().max().item()), sizes
