"""Weights on the device: one allocation, every weight aligned, in the memory order asked for."""

import torch
from safetensors.torch import save

from aot.layout import CHANNELS_LAST, has_order
from aot.loader.weights import WEIGHT_ALIGN, host_tensors, one_allocation, to_device


def _file() -> tuple[bytes, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "conv.weight": torch.randn(8, 3, 5, 5, generator=gen).half(),  # 600 elements: 1200 bytes
        "odd": torch.randn(7, generator=gen).half(),  # 14 bytes: the next tensor would be misaligned
        "ids": torch.arange(5, dtype=torch.int64),
        "skipped": torch.ones(3),
        "norm.weight": torch.randn(33, generator=gen),
    }
    return save(tensors), tensors


def test_one_allocation_aligns_orders_and_keeps_values():
    data, tensors = _file()
    keep = {"conv.weight", "odd", "ids", "norm.weight"}
    hosts = host_tensors(data, "w", keep, 1 << 20, {"conv.weight": CHANNELS_LAST})
    out = one_allocation(hosts, torch.device("cpu"))
    assert set(out) == keep  # "skipped" is never copied
    storages = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(storages) == 1, "every weight views the one allocation"
    (base,) = storages  # cudaMalloc's base is 256-aligned; the CPU allocator's 64
    for name, t in out.items():
        assert t.dtype == tensors[name].dtype and t.shape == tensors[name].shape
        assert torch.equal(t, tensors[name]), name
        assert (t.data_ptr() - base) % WEIGHT_ALIGN == 0, name
    assert has_order(out["conv.weight"], CHANNELS_LAST) and not out["conv.weight"].is_contiguous()
    assert out["odd"].is_contiguous() and out["ids"].is_contiguous()


def test_cpu_weights_stay_row_major_tensors_of_their_own():
    data, tensors = _file()
    out = to_device(data, torch.device("cpu"), "w", {"conv.weight", "odd"})
    assert torch.equal(out["conv.weight"], tensors["conv.weight"]) and out["conv.weight"].is_contiguous()
    assert out["odd"].untyped_storage().data_ptr() != out["conv.weight"].untyped_storage().data_ptr()
