"""``aot.runtime.driver.start``/``started``: the device made on a thread of its own, begun before
the runtime's imports or the bundle's checks and handed to ``load`` once; a failed start raises its
error where the device is taken and is tried again by the next start. No GPU: ``Device`` is a
stand-in that counts how often it is made."""

from __future__ import annotations

import threading

import pytest

from aot.errors import EnvError
from aot.runtime import driver as drv


class Made(list):
    """The ordinals of the devices made, in order; ``open()`` lets the waiting starts finish."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def open(self):
        self.gate.set()


@pytest.fixture
def made(monkeypatch):
    monkeypatch.setattr(drv, "_starting", {})
    made = Made()
    gate = made.gate

    class Device:
        def __init__(self, ordinal):
            gate.wait()  # still starting while the caller goes on
            made.append(ordinal)
            if ordinal == 7:
                raise EnvError("GPU 7 requested, this machine has 1")
            self.ordinal = ordinal

    monkeypatch.setattr(drv, "Device", Device)
    return made


def test_a_started_device_is_made_once_and_handed_over_once(made):
    drv.start(0)
    drv.start(0)  # under way already
    made.open()
    first = drv.started(0)
    assert first.ordinal == 0 and made == [0]
    second = drv.started(0)  # handed over already: another is made
    assert second is not first and made == [0, 0]


def test_started_without_start_makes_one(made):
    made.open()
    assert drv.started(3).ordinal == 3 and made == [3]


def test_a_failed_start_raises_where_the_device_is_taken_and_is_tried_again(made):
    drv.start(7)
    made.open()
    with pytest.raises(EnvError, match="GPU 7 requested"):
        drv.started(7)
    drv.start(7)
    drv._starting[7][0].join()
    drv.start(7)  # the last one failed: started again
    with pytest.raises(EnvError, match="GPU 7 requested"):
        drv.started(7)
    assert made == [7, 7, 7]


def test_output_blocks_are_kept_by_size_class_and_handed_out_again(monkeypatch):
    """``Device.take``/``give``: a block given back serves the next output of its size class
    without a new allocation; past ``KEEP_BYTES`` of kept blocks a given block is freed."""
    assert [drv.block_size(n) for n in (0, 1, 512, 513, 2048, 2 << 20, (2 << 20) + 1, 98 << 20)] == [
        512, 512, 512, 1024, 2048, 2 << 20, 4 << 20, 98 << 20,
    ]  # fmt: skip
    gpu = object.__new__(drv.Device)
    gpu._blocks, gpu._kept, gpu._blocks_lock = {}, 0, threading.Lock()
    log = []
    addresses = iter(range(4096, 1 << 40, 4096))
    gpu.alloc = lambda n: log.append(("alloc", n)) or next(addresses)
    gpu.free = lambda ptr: log.append(("free", ptr))
    a, size = gpu.take(2000)
    assert size == 2048 and log == [("alloc", 2048)]
    gpu.give(a, size)
    assert gpu.take(1500) == (a, 2048) and len(log) == 1  # the same block, no allocation
    b, big = gpu.take(300 << 20)
    c, _ = gpu.take(300 << 20)
    gpu.give(b, big)  # kept: 300 MiB of the 512
    gpu.give(c, big)  # past KEEP_BYTES: back to the driver
    assert log[-1] == ("free", c) and gpu.take(300 << 20) == (b, big)
    gpu.give(a, 2048)
    gpu.release_blocks()
    assert log[-1] == ("free", a) and gpu._kept == 0
