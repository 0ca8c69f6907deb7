"""GPU runtime tests: run on a GPU machine against bundles built on the CPU build box.

    AOTPACK_GPU_BUNDLES=/path/with/{mlp,gpt,cnn}.tpk pytest -m gpu tests/gpu

Never run in CI (no GPU there).
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
# fp16 against eager fp16 on the same GPU: fused kernels reassociate sums and GELU/LayerNorm run in
# fp32 registers, so allow a few fp16 ulps of the output scale.
TOLERANCE = {"mlp": 3e-2, "gpt": 6e-2, "cnn": 6e-2}
SHAPES = {
    "mlp": [{"batch": 1}, {"batch": 8}, {"batch": 3}, {"batch": 64}],
    "gpt": [
        {"batch": 1, "seq": 128},
        {"batch": 8, "seq": 128},
        {"batch": 1, "seq": 1},
        {"batch": 3, "seq": 100},
        {"batch": 2, "seq": 77},
    ],
    "cnn": [{"batch": 1}, {"batch": 8}, {"batch": 3}],
}


def _bundle(name: str) -> Path:
    path = BUNDLES / f"{name}.tpk"
    if not path.is_file():
        pytest.skip(f"no prebuilt bundle {path}")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return path


@pytest.fixture(scope="module")
def eager():
    from aot.tracer import instantiate, load_model_file

    cache = {}

    def get(name):
        if name not in cache:
            spec = load_model_file(ROOT / "models" / f"{name}.py")
            cache[name] = (spec, instantiate(spec).cuda())
        return cache[name]

    return get


@pytest.mark.parametrize("capture", ["lazy", "none"])
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_matches_eager_fp16(name, capture, eager):
    from aot.loader import load
    from aot.tracer import example_inputs

    runner = load(_bundle(name), device="cuda", capture=capture)
    spec, module = eager(name)
    for sizes in SHAPES[name]:
        inputs = {k: v.cuda() for k, v in example_inputs(spec, sizes, seed=7).items()}
        with torch.no_grad():
            want = module(*inputs.values()).float()
        got = runner(**inputs).float()
        first = got.clone()
        runner(**inputs)  # a later call must not overwrite an earlier result
        assert torch.equal(first, got)
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= TOLERANCE[name] * max(1.0, scale), (
            f"{name} {sizes} capture={capture}: {err} (scale {scale})"
        )


def test_padded_bucket_matches_exact(eager):
    from aot.loader import load
    from aot.tracer import example_inputs

    runner = load(_bundle("mlp"), device="cuda")
    spec, _ = eager("mlp")
    x = example_inputs(spec, {"batch": 5}, seed=3)["x"].cuda()
    padded = runner(x)  # batch 5 runs in the batch-8 graph, padded
    assert runner.executors[0].bucket_for({"batch": 5}) == (8,)  # the one program's graphs
    exact = load(_bundle("mlp"), device="cuda", capture="none")(x)
    assert padded.shape == exact.shape
    assert (padded.float() - exact.float()).abs().max().item() <= 1e-2


def test_load_compiles_nothing():
    path = _bundle("gpt")
    code = f"""
import sys, torch
from aot.loader import load
r = load({str(path)!r}, device="cuda")
x = torch.randint(0, 50257, (2, 64), device="cuda")
r(x); torch.cuda.synchronize()
banned = ("triton", "torch._dynamo", "torch._inductor", "sympy", "aot.tracer", "aot.codegen", "aot.packager")
print(sorted(m for m in sys.modules if m.startswith(banned)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_missing_arch_is_an_env_error():
    from aot.errors import EnvError
    from aot.loader.gpu import pick_arch

    assert pick_arch(("sm_80", "sm_90"), (9, 0)) == "sm_90"
    assert pick_arch(("sm_80", "sm_90"), (8, 9)) == "sm_80"
    with pytest.raises(EnvError, match=r"this GPU is sm_100, the bundle has cubins for sm_80, sm_90"):
        pick_arch(("sm_80", "sm_90"), (10, 0))


def test_an_sm_90a_bundle_runs_on_sm_90(tmp_path, eager):
    """``--arch sm_90a`` builds; its cubins are the ones an H100/H200 (compute capability 9.0) loads."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a GPU of compute capability 9.0 (an H100 or H200)")
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import example_inputs, trace

    spec, module = eager("mlp")
    path = tmp_path / "mlp.tpk"
    pack(generate(trace(spec), ("sm_90a",)), path)
    runner = load(path, device="cuda")
    assert runner.manifest.environment.archs == ("sm_90a",)
    assert runner.executors[0].gpu.arch == "sm_90a"
    x = example_inputs(spec, {"batch": 3}, seed=3)["x"].cuda()
    with torch.no_grad():
        want = module(x).float()
    got = runner(x).float()
    assert (got - want).abs().max().item() <= TOLERANCE["mlp"] * max(1.0, want.abs().max().item())


def _two_stream_mismatches(runner, xs, wants, rounds: int = 10) -> int:
    """Calls of ``runner`` on two streams: the first queued behind a long sleep on its stream, the
    second not, so that its copy into the graph's static inputs would run at once, before the
    first call's (a graph's replays run in launch order; copies do not); how many results differ
    from ``wants``."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bad = 0
    for _ in range(rounds):
        outs = []
        for i, (x, stream) in enumerate(zip(xs, streams)):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                if i == 0:
                    torch.cuda._sleep(20_000_000)  # ~10 ms: the second call is launched meanwhile
                outs.append(runner(x))
        torch.cuda.synchronize()
        for got, want in zip(outs, wants):
            bad += (got.float() - want).abs().max().item() > 3e-2 * max(1.0, want.abs().max().item())
    return bad


def test_calls_on_two_streams_never_replay_at_once(eager, monkeypatch):
    """One runner called from two streams: every result is its own input's (the second call
    waits for what the first enqueued on its stream: the static inputs and the pool are shared).
    With that ordering taken out, the same calls give wrong results: the test can fail. (Calls
    that copy their inputs into the graph: bound ones (``aot.loader.bindings``) give each launch
    its own input, so this race cannot reach them; the pool is shared all the same.)"""
    from aot.loader import bindings, load
    from aot.loader.gpu import StreamOrder
    from aot.tracer import example_inputs

    monkeypatch.setenv(bindings.DIRECT_BINDING_ENV, "0")
    runner = load(_bundle("mlp"), device="cuda")
    spec, module = eager("mlp")
    xs = [example_inputs(spec, {"batch": 8}, seed=s)["x"].cuda() for s in (1, 2)]
    with torch.no_grad():
        wants = [module(x).float() for x in xs]
    runner(xs[0])  # captured before the race
    torch.cuda.synchronize()
    assert _two_stream_mismatches(runner, xs, wants) == 0
    ordered = StreamOrder.after_last_call
    try:
        StreamOrder.after_last_call = lambda self, stream: None
        assert _two_stream_mismatches(runner, xs, wants) > 0
    finally:
        StreamOrder.after_last_call = ordered


def test_concurrent_calls_with_graphs(eager):
    import threading

    from aot.loader import load
    from aot.tracer import example_inputs

    runner = load(_bundle("mlp"), device="cuda")
    spec, module = eager("mlp")
    errors = []

    def work(i):
        try:
            run(i)
        except Exception as e:  # a thread's exception must fail the test, not vanish
            errors.append((i, repr(e)))

    def run(i):
        torch.cuda.set_device(0)
        for j in range(5):
            sizes = {"batch": 1 + (i * 7 + j) % 64}
            x = example_inputs(spec, sizes, seed=i * 10 + j)["x"].cuda()
            with torch.no_grad():
                want = module(x).float()
            got = runner(x).float()
            if (got - want).abs().max().item() > 3e-2 * max(1.0, want.abs().max().item()):
                errors.append((i, j, sizes))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    # 8 threads, shapes spread over many buckets: captures happen while other threads run
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_an_id_in_the_padded_vocabulary_gives_nan_not_the_padding():
    """gpt's tied table is padded from 50257 to 50304 rows for the logits GEMM; a token id in the
    padding gets a NaN row from the gather (as any id outside the vocabulary), so the call's
    logits from that position on are NaN (and the earlier ones too where attention multiplies
    the NaN value row by a zero weight in the same block): visibly wrong, never plausible."""
    from aot.loader import load

    runner = load(_bundle("gpt"), device="cuda")
    idx = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    assert torch.isfinite(runner(idx)).all()
    idx[0, 3] = 50300
    logits = runner(idx)
    assert torch.isnan(logits[0, 3:]).all()


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_dependent_launch_gives_the_same_results_as_plain_launches(name, eager, monkeypatch):
    """On sm_90 the kernels launch early and wait inside for the one before (programmatic
    dependent launch): every result, in graphs and without, is bit for bit what plain launches
    (``AOTPACK_DEPENDENT_LAUNCH=0``) give the same way, over calls that reuse every buffer."""
    from aot.loader import load
    from aot.loader.cuda import DEPENDENT_LAUNCH_ENV
    from aot.tracer import example_inputs

    path = _bundle(name)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    spec, _ = eager(name)
    shapes = SHAPES[name]
    inputs = [
        {k: v.cuda() for k, v in example_inputs(spec, s, seed=11 + i).items()} for i, s in enumerate(shapes)
    ]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(DEPENDENT_LAUNCH_ENV, flag)
        for capture in ("lazy", "none"):
            runner = load(path, device="cuda", capture=capture)
            gpu = runner._entries[0].gpu
            early = {f.dependent for f in gpu._functions.values()}
            assert early == {flag == "1"}, (flag, early)  # every kernel of an sm_90 build, or none
            outs = []
            for _ in range(3):  # every buffer and graph reused between calls
                for x in inputs:
                    outs.append(runner(**x).float().cpu())
            results[(flag, capture)] = outs
    for capture in ("lazy", "none"):  # (graphs may pick other library kernels than plain calls)
        same = [torch.equal(a, b) for a, b in zip(results[("1", capture)], results[("0", capture)])]
        assert all(same), (capture, same)


def test_the_drivers_copy_takes_dense_pairs_only():
    """``aot.loader.cuda.copy_bytes`` (the graphs' input and output copies): a dense pair of one
    dtype, shape and device is copied on the given stream, bit for bit; a strided source, another
    dtype or shape is left to torch (False) and the destination untouched."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.loader.cuda import copy_bytes, raw_stream

    stream = raw_stream(torch.cuda.current_device())
    src = torch.randn(33, 17, device="cuda", dtype=torch.float16)
    dst = torch.zeros_like(src)
    assert copy_bytes(dst, src, stream)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    before = dst.clone()
    for other in (src.float() + 1, src[:32] + 1):  # another dtype, another shape
        assert not copy_bytes(dst, other, stream)
    strided = torch.zeros(17, 33, device="cuda", dtype=torch.float16)
    assert not copy_bytes(strided, src.t(), stream)  # the source strided
    torch.cuda.synchronize()
    assert torch.equal(dst, before) and not strided.any()
    empty = torch.empty(0, 5, device="cuda")
    assert copy_bytes(torch.empty_like(empty), empty, stream)  # nothing to copy


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_bound_calls_equal_copied_calls(name, eager, monkeypatch):
    """A graph's kernels pointed at the call's own tensors (``aot.loader.bindings``) give, bit for
    bit, what copies into and out of its static buffers give (``AOTPACK_DIRECT_BINDING=0``), over
    calls that bind (fresh tensors, one tensor again, ``out=``) and calls that cannot (a tensor off
    the 16-byte boundary, a strided one, a padded bucket) in turns, so that nodes bound by one call
    point back at the static buffers for the next; no result is overwritten by a later call; and
    the mlp's batch-1 graph binds its output (the feature is not inert)."""
    from aot.loader import bindings, load
    from aot.tracer import example_inputs

    path = _bundle(name)
    spec, _ = eager(name)
    first = SHAPES[name][0]
    calls = []
    for i, sizes in enumerate([first, first, SHAPES[name][2], first, first]):
        x = {k: v.cuda() for k, v in example_inputs(spec, sizes, seed=20 + i).items()}
        calls.append(x)
    (key, value), *_ = calls[0].items()
    wide = torch.zeros(value.numel() + 8, dtype=value.dtype, device="cuda")  # an input 1 element off
    off = wide[1 : value.numel() + 1].view(value.shape)
    off.copy_(value + 1 if value.is_floating_point() else value)
    calls.insert(2, {**calls[0], key: off})
    strided = torch.zeros(*value.shape[:-1], 2 * value.shape[-1], dtype=value.dtype, device="cuda")[..., ::2]
    strided.copy_(value)
    calls.insert(3, {**calls[0], key: strided})  # every other element of a wider tensor, same values
    calls.append(calls[-1])  # the same tensors again: nothing to re-point

    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(bindings.DIRECT_BINDING_ENV, flag)
        runner = load(path, device="cuda")
        outs = [runner(**x) for x in calls]
        held = [o.clone() for o in outs]
        buf = torch.empty_like(outs[0])
        given = runner(**calls[0], out=buf)
        assert given.data_ptr() == buf.data_ptr()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, held))  # later calls overwrote nothing
        results[flag] = [*[o.float().cpu() for o in outs], buf.float().cpu()]
        if flag == "1":  # borrowed outputs: the graph's own memory, read before the next call
            borrowing = load(path, device="cuda", outputs="borrow")
            results["borrow"] = [borrowing(**x).float().cpu() for x in calls]
        if flag == "1" and name == "mlp":
            graphs = runner._entries[0].graphs.graphs
            binds = graphs[(1,)].binds
            # its output binds; its input does not: two kernels read it (MAX_INPUT_NODES)
            assert binds is not None and 0 in binds.outputs and "x" not in binds.inputs, binds
    same = [torch.equal(a, b) for a, b in zip(results["1"], results["0"])]
    assert all(same), same
    lent = [torch.equal(a, b) for a, b in zip(results["borrow"], results["0"])]
    assert all(lent), lent


def test_an_input_off_the_runners_gpu_is_refused_and_one_on_it_runs(eager):
    """The guards' device test on a CUDA runner (``GuardChecker._placement``: ``is_cuda`` and the
    index, no ``torch.device`` made per input): a CPU tensor is refused with what was expected, a
    tensor on the runner's GPU (the runner loaded on plain "cuda" or on its index) runs and matches
    eager."""
    from aot.errors import GuardError
    from aot.loader import load
    from aot.tracer import example_inputs

    spec, module = eager("mlp")
    x = example_inputs(spec, {"batch": 3}, seed=5)["x"]
    with torch.no_grad():
        want = module(x.cuda()).float()
    for device in ("cuda", f"cuda:{torch.cuda.current_device()}"):
        runner = load(_bundle("mlp"), device=device)
        with pytest.raises(GuardError, match=r"input 'x': expected a tensor on cuda:\d+, got one on cpu"):
            runner(x)
        got = runner(x.cuda()).float()
        err = (got - want).abs().max().item()
        assert err <= TOLERANCE["mlp"] * max(1.0, want.abs().max().item()), f"{device}: {err}"
