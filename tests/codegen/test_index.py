"""Index arithmetic: sizes, digit splitting and joining, and view chains checked against torch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from aot.codegen import index as ix
from aot.codegen.classify import lower
from aot.codegen.valuegraph import Builder
from aot.schema import Buf, Step, Sym, TensorSpec

B, T = ix.symbol("batch"), ix.symbol("seq")


def test_size_text_round_trip():
    for text in ("768", "batch", "batch*seq", "3072*batch*seq", "seq//2", "-1 + seq", "max(1, seq)"):
        e = ix.parse_size(text)
        assert ix.parse_size(ix.size_text(e)) == e
    assert ix.parse_size("seq*batch") == ix.parse_size("batch*seq")
    assert ix.same(ix.parse_size("24*(seq - 1)"), ix.parse_size("24*seq - 24"))


def test_divides_and_nonneg():
    assert ix.divides(ix.parse_size("768"), ix.parse_size("768*batch*seq"))
    assert ix.divides(ix.parse_size("-1 + seq"), ix.parse_size("24*batch*(seq - 1)"))
    assert not ix.divides(ix.parse_size("5"), ix.parse_size("768*batch"))
    assert not ix.divides(ix.parse_size("seq"), ix.parse_size("768*batch"))
    assert ix.nonneg(ix.parse_size("24*seq - 24"))  # dims are >= 1
    assert not ix.nonneg(ix.parse_size("24 - seq"))


def test_a_number_divides_a_sum_only_when_it_divides_every_term():
    # the spatial size of a strided convolution's output, (h' + 1)*(w' + 1), is no multiple of its 16
    # channels: once ``cancel`` spread the 1/16 over the expanded sum, ``divides`` said it was, and a
    # channels-last squeeze-excite multiply got the index (r // (h'*w'/16 + ...)), which cannot render
    hw = ix.parse_size("(h//2 + 1)*(w//2 + 1)")
    assert not ix.divides(ix.parse_size("16"), hw)
    assert not ix.divides(ix.parse_size("2"), ix.parse_size("h*w + 1"))
    assert ix.divides(ix.parse_size("16"), ix.canon(16 * hw))
    assert ix.divides(ix.parse_size("2"), ix.parse_size("2*h*w + 4"))
    assert ix.divides(ix.parse_size("h//2 + 1"), hw)


def test_split_then_join_cancels():
    rows = B * T
    r = ix.atom("r", rows)
    per = ix.unflatten(r, (B, T))
    assert [ix.triton_index(p) for p in per] == ["(r // s_seq)", "(r % s_seq)"]
    assert ix.flatten(per, (B, T)) == r


def test_row_value_broadcast_is_read_at_its_own_row():
    # layer norm: x [B, T, 768] at r*768 + c, its mean [B, T, 1] must be read at r
    full = ix.make_lin([(768, ix.Frag("r", B * T)), (1, ix.Frag("c", 768))])
    assert ix.broadcast_in(full, (B, T, 768), (B, T, 1)) == ix.atom("r", B * T)
    assert ix.triton_index(ix.broadcast_in(full, (B, T, 768), (T, 768))) == "c + (r % s_seq) * 768"
    assert ix.triton_index(ix.broadcast_in(full, (B, T, 768), (768,))) == "c"


def test_channel_broadcast_of_nchw_is_static_arithmetic():
    x = ix.atom("x", ix.canon(B * 512 * 49))
    assert ix.triton_index(ix.broadcast_in(x, (B, 512, 7, 7), (512, 1, 1))) == "((x // 49) % 512)"


def test_unflatten_falls_back_to_division_when_digits_do_not_align():
    # a flat index of a [B, 6] tensor read as [B*3, 2] then as [B, 6] again: digits (x//2, x%2)
    x = ix.atom("x", ix.canon(B * 6))
    per = ix.unflatten(x, (B * 3, 2))
    back = ix.flatten(per, (B * 3, 2))
    assert back == x
    weird = ix.unflatten(ix.make_lin([(5, ix.Frag("x", 7))]), (3, 4))  # 5*x over [3, 4]: no digits
    assert all(p.terms for p in weird)


# ---------------------------------------------------------------------------------------------
# Random view chains: the index a chain computes must pick the element torch's views pick.


class _Tl:  # enough of triton.language for rendered index text evaluated with numpy
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)


def _sym_text(e) -> object:
    return int(e) if e.is_Integer else Sym(ix.size_text(e))


def _random_chain(rng: random.Random):
    """Steps applying random views to ``x`` [batch, seq, 12], and the same views in torch."""
    shape = [B, T, ix.sympy.Integer(12)]
    steps, torch_ops, buffers = [], [], {}
    cur = "x"
    for n in range(rng.randint(1, 5)):
        rank = len(shape)
        choice = rng.choice(["permute", "transpose", "view_merge", "view_split", "expand", "slice", "select"])
        name = f"v{n}"
        if choice == "permute":
            perm = list(range(rank))
            rng.shuffle(perm)
            target, args, new = "aten.permute.default", [Buf(cur), perm], [shape[p] for p in perm]
            torch_ops.append(lambda t, perm=perm: t.permute(*perm))
        elif choice == "transpose" and rank >= 2:
            d0, d1 = rng.sample(range(rank), 2)
            new = list(shape)
            new[d0], new[d1] = new[d1], new[d0]
            target, args = "aten.transpose.int", [Buf(cur), d0, d1]
            torch_ops.append(lambda t, d0=d0, d1=d1: t.transpose(d0, d1))
        elif choice == "view_merge" and rank >= 2:
            k = rng.randrange(rank - 1)
            new = shape[:k] + [ix.canon(shape[k] * shape[k + 1])] + shape[k + 2 :]
            target, args = "aten.view.default", [Buf(cur), [_sym_text(s) for s in new]]
            torch_ops.append(lambda t, k=k: t.reshape(*t.shape[:k], -1, *t.shape[k + 2 :]))
        elif choice == "view_split":
            k = next(
                (k for k, s in enumerate(shape) if s.is_Integer and int(s) % 2 == 0 and int(s) > 2), None
            )
            if k is None:
                continue
            new = shape[:k] + [ix.sympy.Integer(2), ix.sympy.Integer(int(shape[k]) // 2)] + shape[k + 1 :]
            target, args = "aten.view.default", [Buf(cur), [_sym_text(s) for s in new]]
            torch_ops.append(lambda t, k=k: t.reshape(*t.shape[:k], 2, -1, *t.shape[k + 1 :]))
        elif choice == "expand":
            k = rng.randrange(rank + 1)
            unsq = shape[:k] + [ix.ONE] + shape[k:]
            steps.append(Step("aten", "aten.unsqueeze.default", (Buf(cur), k), {}, (f"u{n}",)))
            buffers[f"u{n}"] = unsq
            new = shape[:k] + [ix.sympy.Integer(3)] + shape[k:]
            target, args = "aten.expand.default", [Buf(f"u{n}"), [_sym_text(s) for s in new]]
            torch_ops.append(lambda t, k=k: t.unsqueeze(k).expand(*t.shape[:k], 3, *t.shape[k:]))
        elif choice in ("slice", "select"):
            k = next(
                (k for k in rng.sample(range(rank), rank) if shape[k].is_Integer and int(shape[k]) > 2), None
            )
            if k is None:
                continue
            size = int(shape[k])
            if choice == "slice":
                start, step = rng.randrange(size - 1), rng.choice([1, 2])
                count = len(range(start, size, step))
                new = shape[:k] + [ix.sympy.Integer(count)] + shape[k + 1 :]
                target, args = "aten.slice.Tensor", [Buf(cur), k, start, size, step]
                torch_ops.append(
                    lambda t, k=k, start=start, step=step: t.narrow(k, start, t.shape[k] - start)[
                        (slice(None),) * k + (slice(None, None, step),)
                    ]
                )
            else:
                index = rng.randrange(-size, size)
                new = shape[:k] + shape[k + 1 :]
                target, args = "aten.select.int", [Buf(cur), k, index]
                torch_ops.append(lambda t, k=k, index=index: t.select(k, index))
        else:
            continue
        steps.append(Step("aten", target, tuple(args), {}, (name,)))
        buffers[name] = new
        shape, cur = new, name
    return steps, torch_ops, buffers, cur, shape


@pytest.mark.parametrize("seed", range(80))
def test_random_view_chains_match_torch(seed):
    rng = random.Random(seed)
    steps, torch_ops, shapes, out, out_shape = _random_chain(rng)
    if not steps:
        return
    buffers = {n: TensorSpec("float32", tuple(ix.size_text(s) for s in sh)) for n, sh in shapes.items()}
    known = {"x": TensorSpec("float32", ("batch", "seq", "12"))}
    b = Builder(buffers, known)
    for s in steps:
        lower(b, s)
    node = b.env[out]
    lin = ix.atom("x", ix.numel(tuple(out_shape)))
    while node.kind == "remap":
        lin = node.remap(lin)
        node = node.inputs[0]
    assert node.kind == "load" and node.buf == "x"
    for batch, seq in ((1, 1), (2, 5), (3, 7)):
        t = torch.arange(batch * seq * 12).reshape(batch, seq, 12)
        for op in torch_ops:
            t = op(t)
        expected = t.reshape(-1).numpy()
        env = {"x": np.arange(expected.size), "s_batch": batch, "s_seq": seq, "tl": _Tl}
        got = np.broadcast_to(eval(ix.triton_index(lin), env), expected.shape)  # noqa: S307 (test-only)
        assert (got == expected).all(), f"seed {seed} at batch={batch}, seq={seq}: {ix.triton_index(lin)}"
