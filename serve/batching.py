"""Running a batch of serving requests through one runner, so that each request gets its own answer.

Engines hand the model several requests at once (Triton's dynamic batcher, Ray's ``@serve.batch``).
``run_requests`` joins those of the same shape along the batch dim, up to the largest batch the
bundle admits, runs each group as one call, and splits the outputs back by rows. When a joint call
fails (its guards, or anything else), its requests run again one by one, so that only the bad ones
fail: a request outside the contract gets the ``GuardError`` text (a 400-class error), a call that
fails otherwise an internal error. Engine-free, so that it is tested without a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aot.errors import GuardError

GUARD = "guard"  # the request is outside the bundle's contract: INVALID_ARG / HTTP 400
INTERNAL = "internal"  # the call failed for another reason: INTERNAL / HTTP 500


@dataclass(frozen=True)
class Reply:
    """One request's answer: its flat outputs, or an error of ``kind`` GUARD or INTERNAL."""

    outputs: tuple[torch.Tensor, ...] = ()
    error: str = ""
    kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.kind


@dataclass
class BatchStats:
    """What ``run_requests`` did, for tests and metrics: calls made and rows they held."""

    calls: int = 0
    joint_calls: int = 0
    rows: int = 0
    reruns: int = 0


# Calls the flat outputs of the runner for one request's inputs (in the bundle's input order).
Call = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def _signature(request: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.dtype, tuple(t.shape[1:]), t.dim()) for t in request)


def _rows(request: Sequence[torch.Tensor]) -> int:
    return int(request[0].shape[0]) if request and request[0].dim() else 0


def groups(requests: Sequence[Sequence[torch.Tensor]], max_rows: int) -> list[list[int]]:
    """Indices of requests that may run as one call: same dtypes and sizes past dim 0, at least one
    row each, at most ``max_rows`` rows together, in arrival order within a group. A request that
    cannot be joined (no batch dim, empty, or alone too large) is a group of its own."""
    out: list[list[int]] = []
    open_groups: dict[tuple, tuple[list[int], int]] = {}
    for i, request in enumerate(requests):
        rows = _rows(request)
        joinable = bool(request) and all(t.dim() >= 1 for t in request)
        joinable = joinable and all(int(t.shape[0]) == rows for t in request) and 0 < rows <= max_rows
        if not joinable:
            out.append([i])
            continue
        key = _signature(request)
        members, held = open_groups.get(key, (None, 0))
        if members is None or held + rows > max_rows:
            members, held = [], 0
            out.append(members)
        members.append(i)
        open_groups[key] = (members, held + rows)
    return out


def _one(call: Call, request: Sequence[torch.Tensor], stats: BatchStats) -> Reply:
    stats.calls += 1
    try:
        outputs = tuple(call(request))
        stats.rows += _rows(request)
        return Reply(outputs=outputs)
    except GuardError as e:
        return Reply(error=str(e), kind=GUARD)
    except Exception as e:  # one request's failure must not take the server down
        return Reply(error=f"{type(e).__name__}: {e}", kind=INTERNAL)


def run_requests(
    call: Call,
    requests: Sequence[Sequence[torch.Tensor]],
    max_rows: int,
    stats: BatchStats | None = None,
) -> list[Reply]:
    """Each request's reply, in order. ``max_rows`` > 0 allows joining requests along dim 0 up to
    that many rows (the bundle's largest batch); 0 runs every request alone."""
    stats = stats if stats is not None else BatchStats()
    replies: list[Reply | None] = [None] * len(requests)
    batches = groups(requests, max_rows) if max_rows > 0 else [[i] for i in range(len(requests))]
    for members in batches:
        if len(members) == 1:
            replies[members[0]] = _one(call, requests[members[0]], stats)
            continue
        rows = [_rows(requests[i]) for i in members]
        total = sum(rows)
        joined = [torch.cat([requests[i][k] for i in members]) for k in range(len(requests[members[0]]))]
        stats.calls += 1
        stats.joint_calls += 1
        try:
            outputs = list(call(joined))
            if any(o.dim() == 0 or int(o.shape[0]) != total for o in outputs):
                raise RuntimeError(
                    f"a joint call of {total} rows returned outputs of first dims "
                    f"{[tuple(o.shape[:1]) for o in outputs]}"
                )
        except Exception:  # only the bad requests may fail: run each alone
            stats.reruns += len(members)
            for i in members:
                replies[i] = _one(call, requests[i], stats)
            continue
        stats.rows += total
        pieces = [o.split(rows) for o in outputs]
        for j, i in enumerate(members):
            replies[i] = Reply(outputs=tuple(p[j] for p in pieces))
    return [r if r is not None else Reply(error="no reply", kind=INTERNAL) for r in replies]
