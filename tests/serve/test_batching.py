"""Joining requests into one call and answering each on its own (no server): joint results equal
the requests run alone, and only the requests outside the guards fail."""

from __future__ import annotations

import torch

from aot.errors import GuardError
from aot.serve.batching import GUARD, INTERNAL, BatchStats, groups, run_requests


def model(values):
    (x,) = values  # x: [B, T]
    if x.shape[1] % 2:
        raise GuardError(f"input 'x' dim 1 (seq): expected seq % 2 == 0, got {x.shape[1]}")
    if (x < -100).any():
        raise RuntimeError("boom")
    if x.shape[0] > 4:
        raise GuardError(f"input 'x' dim 0 (batch): expected 1 <= batch <= 4, got {x.shape[0]}")
    return [x * 2 + x.sum(1, keepdim=True), x[:, :1]]


def rows(n, t=4, seed=0):
    return [torch.randn(n, t, generator=torch.Generator().manual_seed(seed))]


def test_joint_results_equal_requests_run_alone():
    requests = [rows(1, seed=i) for i in range(3)] + [rows(1, seed=9)]
    stats = BatchStats()
    replies = run_requests(model, requests, max_rows=4, stats=stats)
    assert stats.calls == 1 and stats.joint_calls == 1 and stats.rows == 4
    for request, reply in zip(requests, replies):
        assert reply.ok
        for got, want in zip(reply.outputs, model(request)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_groups_follow_shape_and_row_limit():
    requests = [rows(1), rows(2), rows(1, t=6), rows(2), rows(1, t=6), rows(3)]
    assert groups(requests, max_rows=4) == [[0, 1], [2, 4], [3], [5]]  # 1+2+2 > 4: a new group
    assert groups([rows(5)], max_rows=4) == [[0]]  # too large alone: its own call, the guards answer
    assert groups([[torch.tensor(1.0)], rows(1)], 4) == [[0], [1]]  # no batch dim


def test_a_failing_joint_call_reruns_each_request_alone():
    good, odd = rows(1), rows(1, t=3)
    bad_value = [torch.full((1, 4), -1000.0)]
    stats = BatchStats()
    replies = run_requests(model, [good, bad_value, rows(2)], max_rows=4, stats=stats)
    assert stats.joint_calls == 1 and stats.reruns == 3 and stats.calls == 4
    assert [r.kind for r in replies] == ["", INTERNAL, ""]
    assert replies[1].error == "RuntimeError: boom"
    torch.testing.assert_close(replies[0].outputs[0], model(good)[0])
    replies = run_requests(model, [odd, good], max_rows=4)
    assert (
        replies[0].kind == GUARD and replies[0].error == "input 'x' dim 1 (seq): expected seq % 2 == 0, got 3"
    )
    assert replies[1].ok


def test_rows_beyond_the_guard_fail_alone_with_the_guard_text():
    replies = run_requests(model, [rows(5), rows(1)], max_rows=8)  # joined: 6 rows, too many
    assert replies[0].kind == GUARD and "expected 1 <= batch <= 4, got 5" in replies[0].error
    assert replies[1].ok


def test_no_batching_runs_every_request_alone():
    stats = BatchStats()
    replies = run_requests(model, [rows(1), rows(1)], max_rows=0, stats=stats)
    assert stats.calls == 2 and stats.joint_calls == 0 and all(r.ok for r in replies)


def test_outputs_that_do_not_split_by_rows_fall_back_to_single_calls():
    def scalar_out(values):
        return [values[0].sum()]

    stats = BatchStats()
    replies = run_requests(scalar_out, [rows(1), rows(1, seed=1)], max_rows=4, stats=stats)
    assert stats.reruns == 2 and all(r.ok for r in replies)
    torch.testing.assert_close(replies[1].outputs[0], rows(1, seed=1)[0].sum())
