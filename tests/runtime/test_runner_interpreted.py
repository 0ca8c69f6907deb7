"""The runtime's stateful path end to end without a GPU: ``aot.runtime.runner.Runner`` over the
recording stand-in for the driver (``test_runner_fake_driver.FakeDevice``: device memory is host
memory) whose kernels run their Triton source in Triton's interpreter on the pointers and sizes
the runner packed. tests/data/tiny_lm.py built ``--library-free``: the runtime's greedy
``generate`` (its state allocation, cache writes in place, the prefill and decode programs of
the entry points, slot bookkeeping, host argmax) gives the tokens the torch loader's CPU path gives
on the same bundle, for one prompt and for two of different lengths; a reset then generates them
again; tiny GPT-2 and Llama through ``aot.hf.causal_lm`` alike. The GPU tests run the same on the
driver (``test_gpu_state.py``)."""

from __future__ import annotations

import json

import pytest

from tests.codegen.conftest import interpreted_json
from tests.codegen.test_cache_kernels import tiny_lm_free  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow  # the library-free build, and every launch interpreted

PROMPTS = [[3, 14, 15, 9, 2], [6, 5]]
NEW = 4

# The runtime over the stand-in driver, every launch run by the kernel's Triton source in the
# interpreter (``TRITON_INTERPRET=1``, ``interpreted_json``): ``runner`` on the bundle at sys.argv[1].
DRIVER = """
import ctypes, hashlib, json, sys
import torch
from aot.aten import DTYPES
from aot.bundle import open_bundle
from aot.codegen.compile import load_function
from aot.runtime import check, driver as drv
from aot.runtime.runner import Runner
from aot.schema import KERNEL_CUBIN_FORMAT, ParamKind
from tests.runtime.test_runner_fake_driver import FakeDevice

bundle_path = sys.argv[1]
b = open_bundle(bundle_path)
program = b.program()
records = {k.id: k for p in (program, *program.variants) for k in p.kernels}
by_cubin = {
    hashlib.sha256(b.read(KERNEL_CUBIN_FORMAT.format(kernel=k, arch="sm_90"))).hexdigest(): r
    for k, r in records.items()
}


class Device(FakeDevice):
    def zero(self, dst, nbytes):
        ctypes.memset(dst, 0, nbytes)

    def host_tensor(self, address, dtype):
        base = max(a for a in self.buffers if a <= address)
        end = base + len(self.buffers[base])
        assert address < end, "a pointer outside every allocation"
        item = torch.empty((), dtype=dtype).element_size()
        raw = (ctypes.c_char * (end - address)).from_address(address)
        return torch.frombuffer(raw, dtype=torch.uint8)[: (end - address) // item * item].view(dtype)


class Interpreted:
    def __init__(self, cubin, name, shared, num_warps, dependent=False):
        self.record = by_cubin[hashlib.sha256(cubin).hexdigest()]
        self.fn = load_function(self.record.id, self.record.name, self.record.source)

    def launch(self, grid, stream, params):
        args = []
        for i, p in enumerate(self.record.params):
            at = params[i]
            if p.kind == ParamKind.PTR:
                address = ctypes.cast(at, ctypes.POINTER(ctypes.c_uint64)).contents.value
                args.append(device.host_tensor(address, DTYPES[p.dtype]))
            else:
                kind = ctypes.c_int32 if p.kind == ParamKind.I32 else ctypes.c_int64
                args.append(ctypes.cast(at, ctypes.POINTER(kind)).contents.value)
        self.fn[grid](*args)


device = Device()
drv.Kernel = Interpreted
drv.destroy_graph = lambda *a: None
runner = Runner(check(bundle_path), device, graphs=False)
"""

SCRIPT = (
    DRIVER
    + """
from aot.runtime import generate as generate_module
on_device = []  # decode calls whose tokens the greedy kernel picked (``DeviceArgmax``)
picked = generate_module.DeviceArgmax.tokens
generate_module.DeviceArgmax.tokens = lambda self, logits: on_device.append(1) or picked(self, logits)
in_blocks = []  # decode calls run in blocks (``DecodeBlock``)
launch = generate_module.DecodeBlock.launch
generate_module.DecodeBlock.launch = lambda self, *a: in_blocks.append(self.steps) or launch(self, *a)
prompts, new = json.loads(sys.argv[2]), int(sys.argv[3])
both = runner.generate(prompts, new)  # the default: every decode call in one block (new - 1 < 8)
one = runner.generate(prompts[0], new, steps_per_launch=1)  # call by call
again = runner.generate(prompts, new, steps_per_launch=1)
print(json.dumps([both, one, again, runner.state_names, runner.checked.state.size, len(on_device), sum(in_blocks)]))
"""
)


def test_the_runtime_generates_the_torch_loaders_tokens_in_the_interpreter(tiny_lm_free):  # noqa: F811
    from aot.loader import load

    free, _ = tiny_lm_free
    script = f"import sys\nsys.argv = ['x', {str(free)!r}, {json.dumps(PROMPTS)!r}, '{NEW}']\n" + SCRIPT
    both, one, again, state_names, state_size, on_device, in_blocks = interpreted_json(script)
    # every decode call's tokens picked on the device: in a block, or a call's by DeviceArgmax
    assert in_blocks == NEW - 1 and on_device == 2 * (NEW - 1)
    cpu = load(free)
    want = cpu.generate(PROMPTS, NEW)
    assert both == want and again == want
    assert one == cpu.generate(PROMPTS[0], NEW)
    assert state_names == ["key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"]
    assert state_size == 4 * (4 * 2 * 32 * 8 * 4)  # four caches [4, 2, 32, 8] float32


BLOCKS_SCRIPT = (
    DRIVER
    + """
from aot.runtime import generate as generate_module
blocks = []  # each block launched: its steps, and whether it went on from the device's inputs
launch = generate_module.DecodeBlock.launch
generate_module.DecodeBlock.launch = lambda self, views, *a: blocks.append(
    [self.steps, views is None]
) or launch(self, views, *a)
prompts, new, eos, early = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
loaded = [e for e in device.log if e[0] in ("host_alloc", "free_host")]  # the load's staging buffers
seen = []  # on_token's (step, tokens) of the generation with an end token
out = [
    runner.generate(prompts, new, steps_per_launch=3),
    runner.generate(prompts, new, steps_per_launch=1),
    runner.generate(prompts, new, eos_token_id=eos, steps_per_launch=3, on_token=lambda *a: seen.append(a)),
    runner.generate(prompts[1], new, steps_per_launch=4),
    runner.generate(prompts[0], new, eos_token_id=early, steps_per_launch=2),
]
counts = []  # every block's counters, after its launches
for prepared in runner._prepared.values():
    for block in prepared.blocks.values():
        at = block.base + block.at["counts"]
        counts += device.host_tensor(at, torch.int32)[: block.rows + 1].tolist()
pinned = [e for e in device.log if e[0] in ("host_alloc", "free_host")][len(loaded):]
runner.close()
freed = [e for e in device.log if e[0] in ("host_alloc", "free_host")][len(loaded) + len(pinned):]
print(json.dumps([out, blocks, counts, seen, pinned, freed]))
"""
)


def test_blocks_of_decode_calls_generate_the_torch_loaders_tokens_in_the_interpreter(tiny_lm_free):  # noqa: F811
    """``DecodeBlock``: blocks of 3 (and, for one prompt, 4 and 2) decode calls with the greedy
    kernel between them, the steps left after them as a shorter block, or call by call with
    ``steps_per_launch=1``, through the stand-in driver: the torch loader's
    CPU tokens, with and without an end token that stops row 0 inside a block (it then takes the
    padding token, fed to it as the next input, as the step-by-step loop does), and every block
    leaves the kernel's counters zero. Each block after a generation's first is launched before
    the host takes the tokens of the one before, from the inputs on the device
    (``Readback``); where the only row ends inside a block, the block launched ahead of it runs
    and its tokens are dropped. ``on_token`` sees each step's tokens as the host takes them. The
    blocks' page-locked token buffers are the runner's: allocated once, freed by ``close``."""
    from aot.loader import load

    free, _ = tiny_lm_free
    new = 12  # 11 decode calls: 3 blocks of 3, then one of 2 (one prompt: 2 blocks of 4, then one of 3)
    cpu = load(free)
    want = cpu.generate(PROMPTS, new)
    eos = want[0][4]  # row 0 ends at its fifth token, inside the second block
    early = cpu.generate(PROMPTS[0], new)[4]  # prompt 0 alone ends at its fifth token: blocks of 2
    args = [str(free), json.dumps(PROMPTS), str(new), str(eos), str(early)]
    script = f"import sys\nsys.argv = ['x', *{args!r}]\n" + BLOCKS_SCRIPT
    (blocks3, single, ended, one, alone), blocks, counts, seen, pinned, freed = interpreted_json(script)
    # the runner's two page-locked token buffers (2 rows x 3 steps x 8 bytes), made at the first
    # generation in blocks, reused by the four after it, freed by close
    assert pinned == [["host_alloc", 48]] * 2 and freed == [["free_host"]] * 2, (pinned, freed)
    assert blocks3 == want and single == want
    assert ended == cpu.generate(PROMPTS, new, eos_token_id=eos)
    assert ended[0][-1] == eos and len(ended[0]) <= 5 and ended[1] == want[1][: len(ended[1])]
    # on_token saw every step in order, each row's token, the finished row's padding (eos) after its end
    assert [step for step, _ in seen] == list(range(len(ended[1])))
    for row, got in enumerate(ended):
        assert [tokens[row] for _, tokens in seen] == got + [eos] * (len(seen) - len(got))
    assert one == cpu.generate(PROMPTS[1], new)
    assert alone == cpu.generate(PROMPTS[0], new, eos_token_id=early) and alone[-1] == early
    assert len(alone) == 5, alone
    # row 1 keeps row 0's run going past its end; the 2 (one prompt: 3) steps after the last
    # whole block run as a block of their own, from the host's inputs
    host, ahead, rest = [3, False], [3, True], [2, False]
    assert blocks == [host, ahead, ahead, rest] * 2 + [[4, False], [4, True], [3, False]] + [
        [2, False],
        [2, True],
        [2, True],
    ], blocks
    assert counts and not any(counts), counts


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_hf_causal_lms_generate_the_torch_loaders_tokens_in_the_interpreter(kind, tmp_path):
    """Tiny GPT-2, Llama and Mistral (one KV head, a sliding window in the prefill's mask) through
    ``aot.hf.causal_lm`` built ``--library-free`` (the wrapper's
    last-position pick a row gather computing its positions, ``aot.codegen.index_rows``; the
    logits' whole slice and one-element select views at the same address): the runtime's greedy
    tokens through the stand-in driver equal the torch loader's CPU path's on the same bundle."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    bundle = tmp_path / f"{kind}.tpk"
    spec = causal_lm(factory(kind), max_batch=4, max_context=16, name=kind)
    pack(generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True), bundle)
    prompts = [[5, 17, 42, 8, 3], [11, 9]]
    script = f"import sys\nsys.argv = ['x', {str(bundle)!r}, {json.dumps(prompts)!r}, '3']\n" + SCRIPT
    both, one, again, _, _, on_device, in_blocks = interpreted_json(script)
    assert on_device == 2 * 2 and in_blocks == 2
    cpu = load(bundle)
    want = cpu.generate(prompts, 3)
    assert both == want and again == want
    assert one == cpu.generate(prompts[0], 3)


def test_a_causal_lm_of_one_batch_row_generates_the_torch_loaders_tokens_in_the_interpreter(tmp_path):
    """Tiny GPT-2 through ``aot.hf.causal_lm(max_batch=1)`` built ``--library-free`` (the batch a
    static size of 1 in its contract): the runtime opens it and generates the torch loader's tokens."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    bundle = tmp_path / "one_row.tpk"
    spec = causal_lm(factory("gpt2"), max_batch=1, max_context=16, name="gpt2")
    pack(generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True), bundle)
    prompt = [5, 17, 42, 8, 3]
    script = (
        f"import sys\nsys.argv = ['x', {str(bundle)!r}]\n"
        + DRIVER
        + f"\nprint(json.dumps(runner.generate({prompt}, 3)))\n"
    )
    assert interpreted_json(script) == load(bundle).generate(prompt, 3)


def test_the_split_decode_attentions_counters_are_allocated_and_left_zero(tmp_path, monkeypatch):
    """A tiny Llama through ``aot.hf.causal_lm`` at a 256-slot cache, built ``--library-free`` with
    the split-KV decode attention forced on (``AOTPACK_DECODE_SPLIT=2``): its one kernel counts
    arrivals on int32 counters the program keeps as scratch (``Program.scratch``), which the
    runtime allocates zeroed beside the state. Through the stand-in driver it generates the torch
    loader's CPU tokens, and every counter is zero again after the generation."""
    from aot.bundle import open_bundle
    from aot.codegen import generate
    from aot.codegen.decode_attention import SPLIT_ENV
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import tiny_llama
    from tests.realmodels.conftest import require

    require("transformers")

    monkeypatch.setenv(SPLIT_ENV, "2")
    bundle = tmp_path / "split.tpk"
    spec = causal_lm(tiny_llama(max_position_embeddings=256), max_batch=2, max_context=256, name="llama")
    pack(generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True), bundle)
    b = open_bundle(bundle)
    try:
        decode = next(p for p in (b.program(), *b.program().variants) if p.scratch)
        kinds = {k.id: k.config.get("kind") for k in decode.kernels}
        assert "decode_attention_split_combined" in kinds.values(), sorted(set(kinds.values()))
        counters = sum(int(decode.buffers[n].shape[0]) for n in decode.scratch)
    finally:
        b.close()
    prompts = [[5, 17, 42, 8, 3], [11, 9]]
    script = (
        f"import sys\nsys.argv = ['x', {str(bundle)!r}]\n"
        + DRIVER
        + f"""
tokens = runner.generate({prompts}, 3)
counts = device.host_tensor(runner.scratch_base, torch.int32)
print(json.dumps([tokens, counts.tolist(), sorted(runner.scratch_offsets), {counters}]))
"""
    )
    tokens, counts, names, n = interpreted_json(script)
    assert tokens == load(bundle).generate(prompts, 3)
    assert names == sorted(decode.scratch) and n > 0
    assert len(counts) >= n and not any(counts), counts
