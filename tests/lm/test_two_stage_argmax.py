"""``aot.loader.generate.argmax``: the two-stage reduction picks what ``argmax(-1)`` picks, the
first index of each row's maximum, ties across and within chunks included."""

from __future__ import annotations

import pytest
import torch

from aot.loader.generate import argmax


@pytest.mark.parametrize("vocab", [128256, 65536, 50257, 8192])
def test_two_stage_argmax_is_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(torch.bfloat16)
    top = logits.max(-1).values
    logits[1, vocab - 3] = top[1]  # a tie with a later chunk
    logits[2, :] = 0.0  # every logit tied: index 0
    logits[3, 7] = logits[3, 9] = top[3] + 1  # a tie inside one chunk
    logits[4, vocab // 2] = float("inf")
    got = argmax(logits, two_stage=True)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(-1).tolist()
    assert got[2] == 0 and got[3] == 7
