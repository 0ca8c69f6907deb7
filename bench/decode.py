"""Decode latency of causal LMs: ms per token (median of the decode steps) and tokens/s, per batch,
for each system in a fresh process, beside the physical floor of a decode step.

Systems: ``hf_eager`` (transformers ``generate``, dynamic cache), ``hf_static_compile``
(transformers ``generate`` with a static cache, decode steps compiled with
``mode="reduce-overhead"``: the gpt-fast recipe, as transformers runs it on a GPU: its own
compile of static-cache decoding; on a CPU, where transformers compiles nothing,
``torch.compile(model.forward)``), ``aotpack`` (a bundle of
``aot.hf.causal_lm``, ``Runner.generate``: one prefill, one decode call per token) and
``aotpack-tuned`` (the same built with GEMM candidates and ``aotpack tune --entry decode`` on this
GPU; needs a GPU). Models:
GPT-2 small, a Llama-style model with grouped-query attention (0.58B, 32 query heads over 8 KV
heads) and ``llama-3.2-1b``, shaped as Llama-3.2-1B (hidden 2048, intermediate 8192, 16 layers, 32
query heads over 8 KV heads, head dim 64, vocab 128256, tied embeddings, llama3 RoPE) in bfloat16
at the published anchors' workload (a 32-token prompt, 128 new tokens). Every system gets the same random-weight model (``torch.manual_seed(0)``) and the same prompts;
a decode step's time is the mean over the decode steps: from the first token on the host to
the last, over the steps between (each token read when it is on the host; aotpack's blocks of
several steps per launch hand theirs over together, so the gap between two tokens is no step's
time: ``median_gap_ms``, the median of those gaps, was the metric before blocks).

The floor of one decode step: the bytes it must read (every weight once, and the KV cache of
every row up to the context) over the device's memory bandwidth (``--bandwidth``, default by
device name: H100 3.35 TB/s, H200 4.8 TB/s); ``pct_hbm`` is that floor over the measured step, in
percent. ``launches_per_step``: the kernels a decode step launches, counted by torch's profiler
(CUPTI sees each kernel of a CUDA graph) as the difference between two generates of N and 2N new
tokens, over N (the prefill and the set-up cancel out).

    python bench/decode.py --out bench/results/decode              # on a GPU: GPT-2 small, Llama-style
    python bench/decode.py --device cpu --tiny --out /tmp/decode   # tiny configs, end to end on a CPU

Writes ``decode.json`` (one row per model, system and batch) and ``decode.md`` (the table). A
bundle stays in ``--bundles`` with its ``build_key`` beside it; a later run of the same code,
switches and sizes takes it as it is instead of tracing and building again (``--rebuild``: always
build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/realmodels/conftest.py, for a CPU torch (see _transformers)
sys.path.insert(0, str(ROOT / "bench"))
from common import synchronize  # noqa: E402  (the bench's own helpers, beside this file)

SYSTEMS = ("aotpack", "aotpack-tuned", "hf_static_compile", "hf_eager")
# also: "aotpack-sdpa", the default build with its decode attention left to the library (SDPA),
# and "aotpack-nopdl", the default build with programmatic dependent launch off (every kernel
# launched when the one before has ended)
# and "aotpack-aten-greedy", the default build with the ATen steps between decode steps instead
# of the greedy step's kernel (the argmax, the end rule and the next inputs)
NO_EARLY_LAUNCH = {
    "aotpack-nopdl": {"AOTPACK_DEPENDENT_LAUNCH": "0"},
    "aotpack-aten-greedy": {"AOTPACK_GREEDY_KERNEL": "off"},
}
# and "aotpack-step", the default bundle generating one step per launch (``steps_per_launch=1``:
# the argmax, the next inputs and the token's copy launched by the host around each step's graph)
STEPS_PER_LAUNCH = {"aotpack-step": 1}
# and "aotpack-rt", a --library-free build of the model on the runtime without torch
# (``aot.runtime``: blocks of 8 decode calls, one CUDA graph each), its ms per token measured as
# the torch loader's (``on_token``), and over whole blocks alone (``rt_row``)
MODELS = ("gpt2", "llama", "llama-3.2-1b")
# also: "gemma-2-2b", shaped as Gemma-2-2B (26 layers, head dim 256, attention scores capped), and
# "qwen3-0.6b", shaped as Qwen3-0.6B (28 layers, head dim 128, each query and key head normed
# before the rotary), "phi-3-mini", shaped as Phi-3-mini-4k-instruct (32 layers, 32 heads of 96,
# q/k/v one projection, gate/up one split in halves), and "olmo-2-1b", shaped as OLMo-2-0425-1B
# (16 layers, 16 heads of 128, post-norms, q and k normed over all heads), in bfloat16 at
# llama-3.2-1b's workload; and "bloom-560m", shaped as BLOOM-560m (24 layers, 16 heads of 64, ALiBi
# biases from the mask, q/k/v interleaved per head in one projection), in float16 at that workload
# Full-size runs: a 512-token context (448-token prompt + 64 new tokens) at batch 1, 8 and 32.
BATCHES = (1, 8, 32)
PROMPT, NEW_TOKENS = 448, 64
# --tiny: small configs that run on a CPU in seconds.
TINY_BATCHES = (1, 2, 4)
TINY_PROMPT, TINY_NEW_TOKENS = 24, 8
# Generations per batch: the first compiles or captures, the last is timed (its median step).
RUNS = 2
# Per model: (prompt, new tokens) where it differs from the default, and the dtype on a GPU. The
# llama-3.2-1b rows take the workload of the published anchors (batch 1, 32 input tokens, 128
# outputs, bf16: msaroufim/megakernels-vs-cuda-graphs, llama/docs/RESULTS.md).
WORKLOAD = {
    "llama-3.2-1b": (32, 128),
    "gemma-2-2b": (32, 128),
    "qwen3-0.6b": (32, 128),
    "phi-3-mini": (32, 128),
    "olmo-2-1b": (32, 128),
    "bloom-560m": (32, 128),
}
# Gemma 2 in eager attention, its scores capped (some transformers versions pick SDPA for it,
# which drops the cap)
ATTENTION = {"gemma-2-2b": "eager"}
GPU_DTYPE = {
    "llama-3.2-1b": "bfloat16",
    "gemma-2-2b": "bfloat16",
    "qwen3-0.6b": "bfloat16",
    "phi-3-mini": "bfloat16",
    "olmo-2-1b": "bfloat16",
    "bloom-560m": "float16",
}
LAUNCH_STEPS = 8  # launches per step: generates of LAUNCH_STEPS and 2 * LAUNCH_STEPS new tokens
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s by device name


def _transformers():
    """transformers, importable on a CPU torch too (the index's torchvision wheels are built for
    CUDA torch: ``tests/realmodels/conftest.py`` says how that is worked around)."""
    try:
        from tests.realmodels.conftest import import_torchvision

        import_torchvision()
    except Exception:  # no torchvision, or the real one loads: transformers copes either way
        pass
    import transformers

    return transformers


# "N" (``--layers``): every model built with its first N decoder layers only, for a quicker A/B
# of a change on a model's shapes (a row says ``layers``); the parent sets it for its workers
LAYERS_ENV = "AOTPACK_BENCH_LAYERS"


def config(model: str, tiny: bool):
    cls, cfg = _config(model, tiny)
    given = os.environ.get(LAYERS_ENV, "").strip()
    if given:
        fields = {**cfg.to_dict(), "num_hidden_layers": int(given)}
        fields.pop("layer_types", None)  # recomputed for the new depth (sliding and full layers)
        cfg = type(cfg)(**fields)
    return cls, cfg


def _config(model: str, tiny: bool):
    tf = _transformers()

    if model == "gpt2":
        if tiny:
            return tf.GPT2LMHeadModel, tf.GPT2Config(
                n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64
            )
        return tf.GPT2LMHeadModel, tf.GPT2Config()  # 124M: 12 layers, d 768, vocab 50257
    if model == "gemma-2-2b":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(**gemma_2_2b(tiny))
    if model == "qwen3-0.6b":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**qwen3_0_6b(tiny))
    if model == "phi-3-mini":
        return tf.Phi3ForCausalLM, tf.Phi3Config(**phi_3_mini(tiny))
    if model == "olmo-2-1b":
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**olmo_2_1b(tiny))
    if model == "bloom-560m":
        return tf.BloomForCausalLM, tf.BloomConfig(**bloom_560m(tiny))
    if model == "llama-3.2-1b":
        cfg = tf.LlamaConfig(**llama_3_2_1b(tiny))
        cfg.tie_word_embeddings = True  # whatever the config class makes of the keyword
        return tf.LlamaForCausalLM, cfg
    if tiny:
        cfg = tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=64,
        )
    else:  # about 0.58B parameters, GQA 32/8
        cfg = tf.LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=10,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=2048,
        )
    return tf.LlamaForCausalLM, cfg


def llama_3_2_1b(tiny: bool) -> dict:
    """Llama-3.2-1B's configuration (its ``config.json``), random weights; tiny: the same kinds
    (tied embeddings, llama3 RoPE, GQA 4:1 over two KV heads) at a CPU's size."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    shape = dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
    )
    if tiny:
        shape = dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=256,
            max_position_embeddings=131072,
        )
    return dict(
        shape,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        attention_bias=False,
        mlp_bias=False,
    )


# the tiny configs' shape (gemma-2-2b's, qwen3-0.6b's, phi-3-mini's and olmo-2-1b's): a CPU runs
# them end to end in seconds
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
)


def gemma_2_2b(tiny: bool) -> dict:
    """Gemma-2-2B's configuration (its ``config.json``), random weights: attention scores capped at
    50 (eager attention), logits at 30, sliding-window layers (4096 slots) beside full ones, GeGLU,
    tied embeddings; tiny: the same kinds at a CPU's size."""
    shape = dict(
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=256000,
        max_position_embeddings=8192,
        sliding_window=4096,
        query_pre_attn_scalar=256,
    )
    if tiny:
        shape.update(TINY, sliding_window=16, query_pre_attn_scalar=32)
    return dict(
        shape,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
    )


def qwen3_0_6b(tiny: bool) -> dict:
    """Qwen3-0.6B's configuration (its ``config.json``), random weights: 16 query heads over 8 KV
    heads of 128, each query and key head RMSNormed before the rotary, tied embeddings; tiny: the
    same kinds at a CPU's size."""
    shape = dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    )
    if tiny:
        shape.update(TINY)
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    return dict(
        shape, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_parameters=rope, attention_bias=False
    )


def tiny_multi_head() -> dict:
    """``TINY`` for Phi-3's and OLMo 2's config classes: as many KV heads as query heads (both are
    multi-head), no ``head_dim`` (neither class has one: hidden / heads, TINY's 32), and token ids
    inside the tiny vocabulary (the published ones lie past it; the bench sets its own anyway)."""
    shape = {k: v for k, v in TINY.items() if k != "head_dim"}
    assert shape["hidden_size"] // shape["num_attention_heads"] == TINY["head_dim"]
    return dict(
        shape,
        num_key_value_heads=TINY["num_attention_heads"],
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )


def phi_3_mini(tiny: bool) -> dict:
    """Phi-3-mini-4k-instruct's configuration (its ``config.json``), random weights: 32 heads over
    32 KV heads of 96 (hidden / heads), q/k/v one projection and gate/up one split in halves,
    untied embeddings; tiny: the same kinds at a CPU's size. Its 2047-slot sliding window is left
    out: the bench's contexts stay inside it (a ``--workload`` past 2047 tokens would attend
    further back than Phi-3 does)."""
    shape = dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        max_position_embeddings=4096,
    )
    if tiny:
        shape.update(tiny_multi_head())
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return dict(shape, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters=rope)


def olmo_2_1b(tiny: bool) -> dict:
    """OLMo-2-0425-1B's configuration (its ``config.json``), random weights: 16 heads over 16 KV
    heads of 128 (hidden / heads), each sublayer's output normed before the residual add, the
    queries and keys normed over all heads, untied embeddings; tiny: the same kinds at a CPU's
    size."""
    shape = dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=100352,
        max_position_embeddings=4096,
    )
    if tiny:
        shape.update(tiny_multi_head())
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    return dict(
        shape, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_parameters=rope, attention_bias=False
    )


def bloom_560m(tiny: bool) -> dict:
    """BLOOM-560m's configuration (its ``config.json``), random weights: 24 layers of 16 heads of 64,
    ALiBi biases built from the 2-D mask (no positions), a LayerNorm on the embeddings, q/k/v one
    projection interleaved per head, tied embeddings; tiny: ``TINY``'s sizes."""
    shape = dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=250880)
    if tiny:
        shape = dict(
            hidden_size=TINY["hidden_size"],
            n_layer=TINY["num_hidden_layers"],
            n_head=TINY["num_attention_heads"],
            vocab_size=TINY["vocab_size"],
        )
    return dict(shape, tie_word_embeddings=True, layer_norm_epsilon=1e-5, bos_token_id=1, pad_token_id=0)


# "PROMPT,NEW" (``--workload``): every model's prompt and new tokens instead, e.g. a long cache;
# the parent sets it for its workers
WORKLOAD_ENV = "AOTPACK_BENCH_WORKLOAD"


def workload(model: str, tiny: bool) -> tuple[int, int]:
    """(prompt tokens, new tokens) of a model's runs."""
    given = os.environ.get(WORKLOAD_ENV, "").strip()
    if given:
        prompt, _, new = given.partition(",")
        if not (prompt.isdigit() and new.isdigit() and int(prompt) > 0 and int(new) > 0):
            raise SystemExit(f"{WORKLOAD_ENV}={given!r}: expected 'PROMPT,NEW' (two positive integers)")
        return int(prompt), int(new)
    if tiny:
        return TINY_PROMPT, TINY_NEW_TOKENS
    return WORKLOAD.get(model, (PROMPT, NEW_TOKENS))


DTYPE_ENV = "DECODE_DTYPE"  # float16 or bfloat16: every model in it on the GPU (an A/B of dtypes)


def dtype_name(model: str, device: str) -> str:
    if device == "cpu":
        return "float32"
    return os.environ.get(DTYPE_ENV) or GPU_DTYPE.get(model, "float16")


def instantiate(cls, cfg):
    """``cls(cfg)``, its output embedding tied to its input embedding where the config says so
    (transformers versions differ in whether a config built from keywords ties them)."""
    module = cls(cfg)
    if getattr(cfg, "tie_word_embeddings", False):
        out, emb = module.get_output_embeddings(), module.get_input_embeddings()
        if out is not None and out.weight is not emb.weight:
            out.weight = emb.weight
    return module


def make_model(model: str, tiny: bool, dtype, device):
    import torch

    cls, cfg = config(model, tiny)
    cfg.pad_token_id = 0
    cfg.eos_token_id = None
    torch.manual_seed(0)
    return instantiate(cls, cfg).to(dtype).to(device).eval()


def prompts(batch: int, length: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + batch)
    return torch.randint(1, vocab, (batch, length), generator=gen)


def floor_ms(module, batch: int, context: int, bandwidth: float) -> float:
    """Bytes a decode step reads (weights once, every row's KV cache up to ``context``) / bandwidth.
    A lookup table (an ``nn.Embedding`` whose weight is not also the output projection's) is
    read one row per batch row, not whole; a tensor shared by two modules counts once."""
    import torch

    out = module.get_output_embeddings()
    head = out.weight if out is not None else None
    tables = {
        id(m.weight): m.weight
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding) and m.weight is not head
    }
    unique = {id(p): p for p in module.parameters()}  # by identity: a tensor shared by two modules once
    weights = sum(p.numel() * p.element_size() for key, p in unique.items() if key not in tables)
    weights += sum(batch * t.shape[1] * t.element_size() for t in tables.values())
    cfg = module.config
    layers = cfg.num_hidden_layers
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = next(module.parameters()).element_size()
    cache = 2 * layers * batch * heads * context * head_dim * item
    return (weights + cache) / bandwidth * 1e3


# ---------------------------------------------------------------------------------------------
# One system in a fresh process.


def _hf_steps(module, ids, new_tokens: int, device: str, static: bool) -> tuple[list[float], list[list[int]]]:
    """Token times of one transformers ``generate`` call (a logits processor stamps each step)."""
    import torch

    tf = _transformers()
    LogitsProcessor, LogitsProcessorList = tf.LogitsProcessor, tf.LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            synchronize(device)
            stamps.append(time.perf_counter())
            return scores

    # static, on a GPU: transformers compiles the decode step itself (CompileConfig's default is
    # mode="reduce-overhead") and copies the logits out of the CUDA graph's memory before the next
    # replay; compiling model.forward by hand instead makes generate read logits a later replay
    # overwrote (torch 2.11, transformers 5.17: "accessing tensor output of CUDAGraphs that has been
    # overwritten by a subsequent run")
    kwargs = dict(cache_implementation="static") if static else {}
    with torch.no_grad():
        out = module.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([Stamp()]),
            **kwargs,
        )
    return stamps, out[:, ids.shape[1] :].tolist()


def profile_step(
    runner, ids, new_tokens: int, device: str, path: Path, steps_per_launch: int | None = None
) -> dict:
    """Where a decode step's time goes: one more ``generate`` under torch's profiler; writes its
    kernel table to ``path`` and returns the device time per token (every kernel's time, summed:
    the GPU is busy that long per token) beside the wall time per token (the host loop included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        runner.generate(ids.tolist(), new_tokens, steps_per_launch=steps_per_launch)
        synchronize(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    attr = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    busy_us = sum(
        getattr(e, attr, 0)
        for e in events
        if getattr(e, attr, 0) > 0 and not e.key.startswith("ProfilerStep")
    )
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    path.write_text(events.table(sort_by=sort, row_limit=60, max_name_column_width=90))
    row = {
        "profile_device_ms_per_token": busy_us / 1e3 / new_tokens,
        "profile_wall_ms_per_token": wall * 1e3 / new_tokens,
    }
    if device.startswith("cuda"):
        table, overlapped = critical_path(kernel_spans(prof), new_tokens)
        path.with_name(path.stem + "-critical.txt").write_text(table)
        row["profile_overlapped_share"] = overlapped
    return row


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start, end in µs) of each GPU kernel a torch profile saw (CUPTI sees each kernel
    of a CUDA graph too); copies and memsets left out."""
    import torch

    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.lower().startswith(("memcpy", "memset"))
    ]


def critical_path(
    spans: list[tuple[str, float, float]], tokens: int, per: str = "token"
) -> tuple[str, float]:
    """Where a chain of dependent kernels spends its time: ``spans`` (name, start, end in µs, one
    stream's kernels) in launch order, each kernel charged with how far it moved the chain's end
    (its end less the end of the kernel before it: under dependent launch a kernel starts before
    the one before it ends and waits inside, so its own span overlaps; these charges add up to
    the chain's time). A table by kernel name (launches, µs charged a ``per`` (``tokens`` of
    them) and per launch, the mean span), and the share of kernels that started before the one
    before them ended (0 where the profiler kept every launch apart)."""
    spans = sorted(spans, key=lambda s: s[1])
    charged: dict[str, list[float]] = {}
    span: dict[str, float] = {}
    overlapped = 0
    for (_, _, prev_end), (name, start, end) in zip(spans, spans[1:]):
        overlapped += start < prev_end
        gap = end - max(prev_end, start)  # time the chain's end moved; idle gaps not charged
        charged.setdefault(name, []).append(max(gap, 0.0))
        span[name] = span.get(name, 0.0) + end - start
    total = sum(sum(v) for v in charged.values())
    lines = [
        f"{'kernel':<60} {'launches':>9} {'us/' + per:>9} {'us/launch':>10} {'span us':>8} {'share':>6}",
    ]
    for name, gaps in sorted(charged.items(), key=lambda kv: -sum(kv[1])):
        lines.append(
            f"{name[:60]:<60} {len(gaps):>9} {sum(gaps) / tokens:>9.2f} {sum(gaps) / len(gaps):>10.2f} "
            f"{span[name] / len(gaps):>8.2f} {sum(gaps) / total if total else 0:>6.1%}"
        )
    lines.append(f"charged {total / tokens:.1f} us a {per} over {len(spans)} kernels")
    share = overlapped / max(1, len(spans) - 1)
    lines.append(f"{share:.0%} of the kernels started before the kernel before them ended")
    return "\n".join(lines) + "\n", share


def kernels_launched(run, device: str) -> int:
    """The GPU kernels ``run()`` launches (``kernel_spans``)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        synchronize(device)
    return len(kernel_spans(prof))


def launches_per_step(generate, device: str) -> float | None:
    """Kernels per decode step: ``generate(n)`` runs a whole generation of ``n`` new tokens; the
    difference between 2N and N tokens, over N, leaves out the prefill and the set-up."""
    if not device.startswith("cuda"):
        return None
    short = kernels_launched(lambda: generate(LAUNCH_STEPS), device)
    long = kernels_launched(lambda: generate(2 * LAUNCH_STEPS), device)
    return (long - short) / LAUNCH_STEPS


def worker(
    system: str,
    model: str,
    tiny: bool,
    device: str,
    bundle: str | None,
    profile: Path | None = None,
    batches: tuple[int, ...] | None = None,
) -> list[dict]:
    import torch

    dtype = getattr(torch, dtype_name(model, device))
    batches = batches or (TINY_BATCHES if tiny else BATCHES)
    prompt, new_tokens = workload(model, tiny)
    rows = []
    if system == "aotpack-rt":
        import aot.runtime

        runner = aot.runtime.load(bundle)
        vocab = rt_vocab(runner)
    elif system.startswith("aotpack"):
        import aot.loader

        runner = aot.loader.load(bundle, device=device)
        vocab = runner.reference_outputs()[0].shape[-1]
    else:
        module = make_model(model, tiny, dtype, device)
        vocab = module.config.vocab_size
        out_emb, in_emb = module.get_output_embeddings(), module.get_input_embeddings()
        tied = out_emb is not None and out_emb.weight is in_emb.weight
        print(
            f"{model}: {sum(p.numel() for p in module.parameters())} parameters, tied {tied}", file=sys.stderr
        )
        if system == "hf_static_compile" and device == "cpu":  # no auto-compile there (see _hf_steps)
            module.forward = torch.compile(module.forward, mode="reduce-overhead", fullgraph=True)
    for batch in batches:
        ids = prompts(batch, prompt, vocab).to(device)
        row = {
            "model": model,
            "system": system,
            "batch": batch,
            "prompt": prompt,
            "new_tokens": new_tokens,
            "dtype": dtype_name(model, device),
        }
        try:
            if system == "aotpack-rt":
                rows.append(rt_row(runner, row, ids.tolist(), new_tokens))
                print(json.dumps(rows[-1]), flush=True)
                continue
            for run in range(RUNS):  # the first run compiles or captures; time the last
                start = time.perf_counter()
                if system.startswith("aotpack"):
                    stamps = []

                    # the tokens are on the host when on_token runs: no sync, which would also
                    # wait for the step generate launched ahead of them
                    def stamp(step: int, tokens: list[int], stamps: list[float] = stamps) -> None:
                        stamps.append(time.perf_counter())

                    tokens = runner.generate(
                        ids.tolist(),
                        new_tokens,
                        on_token=stamp,
                        steps_per_launch=STEPS_PER_LAUNCH.get(system),
                    )
                else:
                    stamps, tokens = _hf_steps(module, ids, new_tokens, device, system == "hf_static_compile")
                print(
                    f"{system} batch {batch} run {run}: {time.perf_counter() - start:.1f}s", file=sys.stderr
                )
            # Mean of the decode steps: the first token's arrival to the last's, over the steps
            # between. (Blocks of several steps per launch hand their tokens over together, so
            # the gaps between tokens are no step's time; their median was the metric before.)
            ms = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)
            gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
            row.update(
                ms_per_token=ms,
                median_gap_ms=statistics.median(gaps),
                tokens_per_s=batch * 1e3 / ms,
                tokens=tokens[0][:16],
            )
            if system.startswith("aotpack"):
                row["launches_per_step"] = launches_per_step(
                    lambda n, ids=ids: runner.generate(
                        ids.tolist(), n, steps_per_launch=STEPS_PER_LAUNCH.get(system)
                    ),
                    device,
                )
            else:
                row["launches_per_step"] = launches_per_step(
                    lambda n, ids=ids: _hf_steps(module, ids, n, device, system == "hf_static_compile"),
                    device,
                )
            if profile and system.startswith("aotpack"):
                row.update(
                    profile_step(
                        runner,
                        ids,
                        new_tokens,
                        device,
                        profile / f"{model}-{system}-b{batch}.txt",
                        STEPS_PER_LAUNCH.get(system),
                    )
                )
        except Exception as e:  # one system failing (a compile error) must not lose the others
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        rows.append(row)
        print(json.dumps(row), flush=True)  # one line per batch: a run cut off keeps the batches done
    return rows


def rt_vocab(runner) -> int:
    """The logits' width of an ``aot.runtime`` runner's decode program."""
    from aot.program import tensor_specs

    program = next(e.program for e in runner.checked.entries if e.entry == "decode")
    return int(tensor_specs(program)[program.outputs[0]].shape[-1])


def rt_row(runner, row: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    """``row`` with aotpack-rt's ms per token as the torch loader's rows measure it: the mean
    decode step, the first token's arrival to the last's (``on_token``) over the steps between,
    of the last of ``RUNS`` generations (the first captures the graphs). ``blocks_ms_per_token``:
    a generation of ``new_tokens`` less one of half as many, over the tokens between (whole
    blocks only: the prefill and the steps past the last block cancel out)."""
    half = new_tokens // 2
    for _ in range(RUNS):
        stamps: list[float] = []
        start = time.perf_counter()
        runner.generate(prompts, half)
        mid = time.perf_counter()
        tokens = runner.generate(
            prompts, new_tokens, on_token=lambda step, t, stamps=stamps: stamps.append(time.perf_counter())
        )
        end = time.perf_counter()
    ms = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)
    blocks = ((end - mid) - (mid - start)) * 1e3 / (new_tokens - half)
    return {
        **row,
        "ms_per_token": ms,
        "blocks_ms_per_token": blocks,
        "tokens_per_s": row["batch"] * 1e3 / ms,
        "tokens": tokens[0][:16],
    }


# ---------------------------------------------------------------------------------------------
# The parent: builds bundles, spawns one process per system and model, writes the table.


# Each aotpack system's bundle, by the name after the model's stem; systems that only run the
# "aotpack" bundle differently (NO_EARLY_LAUNCH, STEPS_PER_LAUNCH) are not here.
BUILT_AS = {
    "aotpack": ".tpk",
    "aotpack-rt": "-lf.tpk",
    "aotpack-sdpa": "-sdpa.tpk",
    "aotpack-tuned": "-tuned.tpk",
}
# The folders whose code makes a bundle: a change to any file in them builds it again.
BUILD_CODE = ("aot", "tracer", "codegen", "packager", "verify")


def build_key(model: str, tiny: bool, batches: tuple[int, ...], archs: tuple[str, ...], context: int) -> str:
    """What a bundle of ``build_bundles`` is a function of: the model and its sizes, the archs, the
    layers (``--layers``), every ``AOTPACK_`` switch set, the versions of torch, triton and
    transformers, and the content of every source file of the build (``BUILD_CODE``). A bundle kept
    under an equal key is the bundle this run would build (the weights are seeded), so it is reused
    instead of traced and built again (a Llama-3.2-1B trace and build takes 2-3 minutes)."""
    import hashlib

    import torch
    import triton

    digest = hashlib.sha256()
    for folder in BUILD_CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return json.dumps(
        {
            "model": model,
            "tiny": tiny,
            "batches": list(batches),
            "archs": list(archs),
            "context": context,
            "layers": os.environ.get(LAYERS_ENV, "").strip(),
            "attention": ATTENTION.get(model),
            "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("AOTPACK_")},
            "versions": [torch.__version__, triton.__version__, _transformers().__version__],
            "code": digest.hexdigest(),
        },
        sort_keys=True,
    )


def _key_file(bundle: Path) -> Path:
    """Where ``bundle``'s build key lies: beside it."""
    return bundle.with_name(bundle.name + ".key")


def _kept(bundle: Path, key: str) -> bool:
    """``bundle`` exists and was built under ``key``."""
    mark = _key_file(bundle)
    return bundle.is_file() and mark.is_file() and mark.read_text() == key


def _keep(bundle: Path, key: str) -> None:
    _key_file(bundle).write_text(key)


def build_bundles(
    model: str,
    tiny: bool,
    device: str,
    out: Path,
    systems: list[str],
    batches: tuple[int, ...] | None = None,
    reuse: bool = True,
) -> dict[str, Path]:
    """The bundle of each aotpack system: ``aotpack`` the default build, ``aotpack-tuned`` a build
    with GEMM candidates tuned on this GPU at the decode entry point (``aotpack tune --entry
    decode``). One trace serves both. ``reuse``: a bundle already in ``out`` under this run's
    ``build_key`` is taken as it is (no trace where every wanted bundle is)."""
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace

    wanted = [s for s in systems if s.startswith("aotpack")]
    if not wanted:
        return {}
    cls, cfg = config(model, tiny)
    cfg.pad_token_id = 0
    cfg.eos_token_id = None
    batches = batches or (TINY_BATCHES if tiny else BATCHES)
    if max(batches) == 1:  # a batch dim of size 1 alone would be specialized away by export
        batches = (1, 2)
    prompt, new_tokens = workload(model, tiny)
    archs = ("sm_90",)
    if device.startswith("cuda"):
        import torch

        major, minor = torch.cuda.get_device_capability()
        archs = (f"sm_{major}{minor}",)
    spec = causal_lm(
        lambda: instantiate(cls, cfg),
        max_batch=max(batches),
        max_context=prompt + new_tokens,
        dtype=dtype_name(model, device),
        name=model,
        batch_buckets=batches,
        attn_implementation=ATTENTION.get(model),
    )
    stem = f"{model}{'-tiny' if tiny else ''}"
    if os.environ.get(LAYERS_ENV, "").strip():
        stem += f"-{os.environ[LAYERS_ENV].strip()}layers"

    def say(message: str) -> None:  # what the codegen did with the decode program's attention
        if "decode attention" in message:
            print(message.strip(), file=sys.stderr)

    if set(wanted) & {"aotpack-nopdl", "aotpack-step", "aotpack-aten-greedy"} and "aotpack" not in wanted:
        wanted.append("aotpack")
    key = build_key(model, tiny, batches, archs, prompt + new_tokens)
    built_as = {system: out / f"{stem}{name}" for system, name in BUILT_AS.items()}
    paths = {}
    for system, path in built_as.items():  # bundles this code built before under the same key
        if system in wanted and reuse and _kept(path, key):
            paths[system] = path
            print(
                f"reused {paths[system]} (built before with this code, these switches and sizes)",
                file=sys.stderr,
            )
    if "aotpack" in paths:
        paths["aotpack-nopdl"] = paths["aotpack-step"] = paths["aotpack-aten-greedy"] = paths["aotpack"]
    wanted = [s for s in wanted if s not in paths and (s != "aotpack-tuned" or device.startswith("cuda"))]
    if not wanted:
        return paths
    for system in wanted:  # a build cut off half way leaves no key that would claim it
        if system in built_as:
            _key_file(built_as[system]).unlink(missing_ok=True)
    start = time.perf_counter()
    traced = trace(spec)
    print(f"traced {model} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if "aotpack" in wanted:
        start = time.perf_counter()
        paths["aotpack"] = built_as["aotpack"]
        # split weights: a bundle over 2 GiB of weights (llama-3.2-1b) as one zip member does not load
        pack(generate(traced, archs, progress=say), paths["aotpack"], split_weights=True)
        _keep(paths["aotpack"], key)
        print(f"built {paths['aotpack']} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        # the same bundle: every kernel launched after the one before; one step per launch
        paths["aotpack-nopdl"] = paths["aotpack-step"] = paths["aotpack-aten-greedy"] = paths["aotpack"]
    if "aotpack-rt" in wanted:
        start = time.perf_counter()
        paths["aotpack-rt"] = built_as["aotpack-rt"]
        compiled = generate(traced, archs, gemm_candidates=True, library_free=True)
        pack(compiled, paths["aotpack-rt"], split_weights=True)
        _keep(paths["aotpack-rt"], key)
        print(f"built {paths['aotpack-rt']} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if "aotpack-sdpa" in wanted:
        start = time.perf_counter()
        paths["aotpack-sdpa"] = built_as["aotpack-sdpa"]
        pack(generate(traced, archs, decode_attention=False), paths["aotpack-sdpa"], split_weights=True)
        _keep(paths["aotpack-sdpa"], key)
        print(f"built {paths['aotpack-sdpa']} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if "aotpack-tuned" in wanted and device.startswith("cuda"):  # tuning needs the GPU
        from aot.verify.tune import tune

        start = time.perf_counter()
        untuned = out / f"{stem}-gemm.tpk"
        pack(generate(traced, archs, gemm_candidates=True), untuned, split_weights=True)
        built = time.perf_counter() - start
        paths["aotpack-tuned"] = built_as["aotpack-tuned"]
        result = tune(untuned, paths["aotpack-tuned"], repeats=20, entries=("decode",))
        _keep(paths["aotpack-tuned"], key)
        chosen = sum(c.choice != "library" for c in result.table.choices)
        from aot.verify.tuning_table import tuning_bytes

        (out / f"{stem}-tuning.json").write_bytes(tuning_bytes(result.table))  # every form's time per site
        print(
            f"built {untuned} in {built:.1f}s, tuned decode in {time.perf_counter() - start - built:.1f}s: "
            f"{chosen}/{len(result.table.choices)} site-buckets chose a Triton candidate",
            file=sys.stderr,
        )
    return paths


def bandwidth_of(device: str, given: float | None) -> float:
    if given:
        return given
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name()
        for key, bw in BANDWIDTH.items():
            if key in name:
                return bw
    return 50e9  # a CPU's memory, roughly


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| model | batch | system | ms/token | tokens/s | floor ms | % of HBM bandwidth | launches/step "
        "| vs hf_static_compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    compiled = {
        (r["model"], r["batch"]): r.get("ms_per_token") for r in rows if r["system"] == "hf_static_compile"
    }
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['system']} | failed: {r['error'][:80]} | | | | | |"
            )
            continue
        ms, floor = r["ms_per_token"], r["floor_ms"]
        base = compiled.get((r["model"], r["batch"]))
        ratio = f"{ms / base:.2f}" if base else "-"
        launches = r.get("launches_per_step")
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['system']} | {ms:.3f} | {r['tokens_per_s']:.0f} | "
            f"{floor:.3f} | {r['pct_hbm']:.1f} | {'-' if launches is None else f'{launches:.1f}'} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a CPU run end to end)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--batches", help="comma-separated batch sizes [default: 1,8,32; --tiny 1,2,4]")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one system may take [default: 600]")
    ap.add_argument("--bandwidth", type=float, help="bytes/s for the floor [default: by device name]")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode"))
    ap.add_argument("--bundles", help="where to build the bundles [default: OUT]")
    ap.add_argument(
        "--rebuild",
        action="store_true",
        help="trace and build every bundle, even one kept in --bundles under this run's build key",
    )
    ap.add_argument(
        "--workload",
        metavar="PROMPT,NEW",
        help="every model's prompt and new tokens (a long cache: e.g. 1984,64) [default: per model]",
    )
    ap.add_argument(
        "--layers",
        type=int,
        help="build each model with its first N decoder layers (a quicker A/B) [default: all]",
    )
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "MODEL"), help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile one generate of each aotpack system and batch (kernel tables in OUT, and each kernel's share of the chain: *-critical.txt)",
    )
    args = ap.parse_args()
    if args.workload:
        os.environ[WORKLOAD_ENV] = args.workload  # the workers' too
    if args.layers:
        os.environ[LAYERS_ENV] = str(args.layers)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
    if args.worker:
        worker(
            *args.worker,
            args.tiny,
            args.device,
            args.bundle,
            Path(args.profile_to) if args.profile_to else None,
            batches,
        )
        return

    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = bandwidth_of(args.device, args.bandwidth)
    env = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "bandwidth_bytes_per_s": bandwidth,
        "tiny": args.tiny,
        "workload": {m: workload(m, args.tiny) for m in args.models.split(",")},
        "dtype": {m: dtype_name(m, args.device) for m in args.models.split(",")},
        # the build and load switches this run's bundles and workers see (an A/B arm's, e.g.
        # AOTPACK_FORM_STAGES, which changes no kernel name), so each file says which arm it is
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("AOTPACK_")},
    }
    if args.device.startswith("cuda"):
        import triton

        env["triton"] = triton.__version__
        env["transformers"] = _transformers().__version__
    header = (
        f"Decode latency on {env['device']} (torch {env['torch']}; "
        f"{'tiny configs' if args.tiny else 'GPT-2 small, Llama-style 0.58B, Llama-3.2-1B-shaped'}; "
        f"dtypes {env['dtype']}; (prompt, new tokens) {env['workload']}; median of decode steps; "
        "each system a fresh process)"
    )
    rows: list[dict] = []

    def save() -> None:  # after every system: a run cut off keeps what was measured
        (out / "decode.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
        (out / "decode.md").write_text(markdown(rows, header))

    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    for model in args.models.split(","):
        bundles = Path(args.bundles or out)
        bundles.mkdir(parents=True, exist_ok=True)
        built = build_bundles(
            model, args.tiny, args.device, bundles, args.systems.split(","), batches, reuse=not args.rebuild
        )
        module = make_model(model, args.tiny, getattr(torch, dtype_name(model, args.device)), "meta")
        context = sum(workload(model, args.tiny))
        for system in args.systems.split(","):
            if system.startswith("aotpack") and system not in built:
                rows.append({"model": model, "system": system, "batch": 0, "error": "tuning needs a GPU"})
                continue
            bundle = built.get(system)
            cmd = [sys.executable, __file__, "--worker", system, model, "--device", args.device]
            cmd += ["--tiny"] * args.tiny + (["--bundle", str(bundle)] if bundle else [])
            cmd += ["--profile-to", str(out)] if args.profile else []
            cmd += ["--batches", args.batches] if args.batches else []
            try:
                done = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": path, **NO_EARLY_LAUNCH.get(system, {})},
                    timeout=args.timeout,
                )
                stdout, stderr = done.stdout, done.stderr
                error = (stderr.strip().splitlines() or ["no output"])[-1][:200] if done.returncode else ""
            except subprocess.TimeoutExpired as e:
                stdout, stderr = (
                    x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)
                )
                error = f"timed out after {args.timeout:.0f}s"
            (out / f"{model}-{system}.log").write_text(stderr)
            done_rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            for row in done_rows:
                row["floor_ms"] = floor_ms(module, row["batch"], context, bandwidth)
                if args.layers:
                    row["layers"] = args.layers
                if "ms_per_token" in row:
                    row["pct_hbm"] = 100 * row["floor_ms"] / row["ms_per_token"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
            if error:
                rows.append({"model": model, "system": system, "batch": 0, "error": error})
                print(f"{model} {system}: {error}", file=sys.stderr)
            save()
    print(markdown(rows, header))


if __name__ == "__main__":
    main()
