"""Partition a program into fusion groups, and rewrite it with one kernel step per group.

Steps are *virtual* (views, and values computed from the index alone such as ``arange``; they are
folded into every kernel that reads them) or *real*: pointwise and reduction steps, which join
fusion groups, and library steps, which stay ATen calls.

Greedy, in program order: a pointwise or reduction step joins the group(s) of the steps it reads
from (all of them together if possible, else the latest one, else a new group), provided

- the union stays *convex*: no path leaves it and comes back through other steps or groups (its
  kernel could not run before or after them), and
- the union renders as one kernel (``render.render_kernel``: same reduction rows and extent, outputs
  that are full or row values, rows read at their own row…).

A step that cannot render even alone stays a library call. ``rewrite`` then orders kernels, library
steps and the virtual steps that library calls still need (a stable topological sort, by first
original position), and records each kernel's reference: its steps and the virtual steps it
folded, unchanged and in program order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from aot.allowed_ops import STATE_WRITE_OPS
from aot.codegen.classify import classify, returns_view
from aot.codegen.render import Rendered, kernel_step, render_kernel
from aot.codegen.valuegraph import NotFusible
from aot.program import producer_of, step_reads
from aot.schema import Program, Step, TensorSpec


@dataclass(frozen=True)
class Group:
    members: tuple[int, ...]  # real steps computed by the kernel
    reference: tuple[int, ...]  # members and the virtual steps they fold, in program order
    rendered: Rendered


INDEX = "aten.index.Tensor"


class Graph:
    """Steps of a program with their kinds and the dependencies between real steps."""

    def __init__(self, program: Program, materialize: bool = False):
        self.program = program
        self.steps = program.steps
        self.buffers = program.buffers
        self.known: dict[str, TensorSpec] = {t.name: t.spec for t in program.inputs + program.weights}
        self.reads = [step_reads(s) for s in self.steps]
        self.producer = producer_of(self.steps)
        kinds = [classify(s, self.buffers) for s in self.steps]
        pure = [False] * len(self.steps)  # computed from the index alone
        for i, k in enumerate(kinds):
            srcs = [self.producer.get(b) for b in self.reads[i]]
            if k == "generator":
                pure[i] = True
            elif k in ("view", "pointwise") and srcs and all(p is not None and pure[p] for p in srcs):
                pure[i] = True
        if materialize:  # what a library call reads or the program returns is a buffer: the last
            # pointwise step computes it (a generator too: OPT's ones that only its cumsum reads)
            # (an index's positions stay computed: ``index_rows`` folds an ``arange`` they are)
            read = [
                (b, self.steps[i].target != INDEX)
                for i, k in enumerate(kinds)
                if k == "library"
                for b in self.reads[i]
            ]
            for b, any_kind in [*read, *((o, True) for o in program.outputs)]:
                p = self.producer.get(b)
                while p is not None and kinds[p] == "view" and pure[p] and self.reads[p]:
                    p = self.producer.get(self.reads[p][0])
                if (
                    p is not None
                    and pure[p]
                    and (kinds[p] == "pointwise" or any_kind and kinds[p] == "generator")
                ):
                    pure[p] = False
                    kinds[p] = "pointwise"
        self.kinds = ["virtual" if k == "view" or pure[i] else k for i, k in enumerate(kinds)]
        # outputs of library calls that return views: a kernel never takes those as pointers
        self.not_roots = frozenset(
            o
            for i, s in enumerate(self.steps)
            if kinds[i] == "library" and returns_view(s.target)
            for o in s.outputs
            if o is not None
        )
        self._sources: dict[str, tuple[str, ...]] = {}
        # real steps each real step reads from (through virtual steps), and the reverse
        self.deps: list[set[int]] = [set() for _ in self.steps]
        self.users: list[set[int]] = [set() for _ in self.steps]
        self.readers: dict[str, set[int]] = {}  # real buffer -> real steps reading it
        for i in range(len(self.steps)):
            if self.kinds[i] == "virtual":
                continue
            for b in self.reads[i]:
                for src in self.sources(b):
                    self.readers.setdefault(src, set()).add(i)
                    p = self.producer.get(src)
                    if p is not None:
                        self.deps[i].add(p)
                        self.users[p].add(i)
        self.program_outputs: set[str] = set()
        for o in program.outputs:
            self.program_outputs.update(self.sources(o))

    def is_real(self, i: int) -> bool:
        return self.kinds[i] != "virtual"

    def sources(self, buf: str) -> tuple[str, ...]:
        """The non-virtual buffers a buffer is computed from (itself unless a virtual step made it)."""
        if buf in self._sources:
            return self._sources[buf]
        stack, out, seen = [buf], [], set()
        while stack:
            b = stack.pop()
            if b in seen:
                continue
            seen.add(b)
            p = self.producer.get(b)
            if p is not None and self.kinds[p] == "virtual":
                stack.extend(reversed(self.reads[p]))
            else:
                out.append(b)
        self._sources[buf] = tuple(dict.fromkeys(out))
        return self._sources[buf]

    def virtual_closure(self, members: list[int]) -> list[int]:
        """Virtual steps the members read through, transitively (stopping at real steps)."""
        return self.virtual_behind([b for m in members for b in self.reads[m]])

    def virtual_behind(self, bufs: list[str]) -> list[int]:
        """Virtual steps the buffers ``bufs`` are computed through, transitively (stopping at real
        steps)."""
        found: set[int] = set()
        stack = list(bufs)
        while stack:
            b = stack.pop()
            p = self.producer.get(b)
            if p is not None and self.kinds[p] == "virtual" and p not in found:
                found.add(p)
                stack.extend(self.reads[p])
        return sorted(found)

    def outputs_of(self, members: set[int]) -> list[str]:
        """Buffers of ``members`` that something outside them reads (or the program returns)."""
        out = []
        for m in sorted(members):
            for o in self.steps[m].outputs:
                if o is None:
                    continue
                if o in self.program_outputs or self.readers.get(o, set()) - members:
                    out.append(o)
        return out


class Partitioner:
    def __init__(
        self, graph: Graph, ranges: dict[str, tuple[int, int]], log: Callable[[str], None] | None = None
    ):
        self.g = graph
        self.ranges = ranges
        self.log = log
        self.group_of: dict[int, int] = {}
        self.groups: dict[int, list[int]] = {}
        self.rendered: dict[int, Rendered] = {}
        self.library: set[int] = set()
        self._next = 0

    def try_render(self, members: set[int]) -> Rendered | None:
        g = self.g
        ref = sorted(set(members) | set(g.virtual_closure(sorted(members))))
        try:
            return render_kernel(
                [g.steps[i] for i in ref], g.outputs_of(members), g.buffers, g.known, self.ranges, g.not_roots
            )
        except NotFusible:
            return None
        except Exception as e:  # a gap in the fuser must never fail a build: keep the steps unfused
            if self.log:
                self.log(f"  internal: cannot render steps {sorted(members)[:4]}…: {type(e).__name__}: {e}")
            return None

    def unit_of(self, i: int) -> tuple[str, int]:
        return ("g", self.group_of[i]) if i in self.group_of else ("s", i)

    def convex(self, members: set[int]) -> bool:
        """No path from the union back into it through steps or groups outside it."""
        g = self.g
        top = max(members)
        seen: set[tuple[str, int]] = set()
        stack = [u for m in members for u in g.users[m] if u not in members]
        while stack:
            s = stack.pop()
            if s in members:
                return False
            unit = self.unit_of(s)
            if unit in seen:
                continue
            seen.add(unit)
            nodes = self.groups[unit[1]] if unit[0] == "g" else [s]
            if min(nodes) > top:
                continue
            for n in nodes:
                for u in g.users[n]:
                    if u in members:
                        return False
                    stack.append(u)
        return True

    def run(self) -> None:
        g = self.g
        for i, kind in enumerate(g.kinds):
            if kind not in ("pointwise", "reduction"):
                continue
            producers = sorted(
                {self.group_of[d] for d in g.deps[i] if d in self.group_of},
                key=lambda gid: -max(self.groups[gid]),
            )
            candidates = ([producers] if len(producers) > 1 else []) + [[p] for p in producers] + [[]]
            for cand in candidates:
                members = {i}.union(*[set(self.groups[c]) for c in cand])
                if cand and not self.convex(members):
                    continue
                rendered = self.try_render(members)
                if rendered is None:
                    continue
                gid = self._next
                self._next += 1
                for c in cand:
                    del self.groups[c]
                    self.rendered.pop(c, None)
                self.groups[gid] = sorted(members)
                self.rendered[gid] = rendered
                for m in members:
                    self.group_of[m] = gid
                break
            else:
                self.library.add(i)
                if self.log:
                    self.log(f"  {g.steps[i].target} (step {i}) stays a library call")

    def result(self) -> list[Group]:
        out = []
        for gid in sorted(self.groups, key=lambda k: self.groups[k][0]):
            members = self.groups[gid]
            ref = sorted(set(members) | set(self.g.virtual_closure(members)))
            out.append(Group(tuple(members), tuple(ref), self.rendered[gid]))
        return out


def partition(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    log: Callable[[str], None] | None = None,
    materialize: bool = False,
) -> tuple[Graph, list[Group], list[int]]:
    """(graph, fusion groups, fusible-kind steps that stayed library calls). ``materialize`` (a
    library-free build): a value computed from the index alone (``arange`` arithmetic: T5's
    relative position buckets) that a library call reads is computed by a kernel, where it
    would otherwise stay ATen steps that no kernel folds."""
    graph = Graph(program, materialize)
    p = Partitioner(graph, ranges, log)
    p.run()
    return graph, p.result(), sorted(p.library)


def rewrite(graph: Graph, groups: list[Group], kernel_ids: list[str]) -> tuple[Step, ...]:
    """The program's steps with each group replaced by one kernel step, topologically ordered."""
    steps = graph.steps
    in_group: dict[int, int] = {m: gi for gi, grp in enumerate(groups) for m in grp.members}
    # virtual steps that library calls or the program's outputs still need as ATen steps
    unfused = [b for i in range(len(steps)) if graph.is_real(i) and i not in in_group for b in graph.reads[i]]
    needed = set(graph.virtual_behind([*unfused, *graph.program.outputs]))

    # units: ("k", group index) or ("s", step index)
    units: list[tuple[str, int]] = [("k", gi) for gi in range(len(groups))]
    units += [("s", i) for i in range(len(steps)) if (graph.is_real(i) and i not in in_group) or i in needed]
    unit_of_step: dict[int, tuple[str, int]] = {}
    for gi, grp in enumerate(groups):
        for m in grp.members:
            unit_of_step[m] = ("k", gi)
    for u in units:
        if u[0] == "s":
            unit_of_step[u[1]] = u

    def unit_reads(u: tuple[str, int]) -> list[str]:
        if u[0] == "s":
            return graph.reads[u[1]]
        grp = groups[u[1]]
        inside = {o for i in grp.reference for o in steps[i].outputs if o is not None}
        return [b for i in grp.reference for b in graph.reads[i] if b not in inside]

    def key(u: tuple[str, int]) -> int:
        return groups[u[1]].members[0] if u[0] == "k" else u[1]

    deps: dict[tuple[str, int], set[tuple[str, int]]] = {u: set() for u in units}
    users: dict[tuple[str, int], set[tuple[str, int]]] = {u: set() for u in units}
    for u in units:
        for b in unit_reads(u):
            p = graph.producer.get(b)
            if p is None:
                continue
            pu = unit_of_step.get(p)
            if pu is None:
                raise AssertionError(f"buffer {b} is read but its step is not scheduled")
            if pu != u:
                deps[u].add(pu)
                users[pu].add(u)
    # A state write (``aot.allowed_ops.STATE_WRITE_OPS``) comes after every unit that reads the
    # state's old value and came before it in the program: nothing orders them through the data.
    for w in units:
        if w[0] != "s" or steps[w[1]].target not in STATE_WRITE_OPS or not unit_reads(w):
            continue
        state = graph.sources(unit_reads(w)[0])
        for u in units:
            if u != w and key(u) < key(w) and any(set(graph.sources(b)) & set(state) for b in unit_reads(u)):
                if u not in deps[w]:
                    deps[w].add(u)
                    users[u].add(w)
    ready = [(key(u), u) for u in units if not deps[u]]
    heapq.heapify(ready)
    order: list[tuple[str, int]] = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in users[u]:
            deps[v].discard(u)
            if not deps[v]:
                heapq.heappush(ready, (key(v), v))
    if len(order) != len(units):
        raise AssertionError("fusion groups form a cycle")
    out: list[Step] = []
    for u in order:
        if u[0] == "s":
            out.append(steps[u[1]])
            continue
        grp = groups[u[1]]
        r = grp.rendered
        out.append(kernel_step(kernel_ids[u[1]], r, tuple(steps[i] for i in grp.reference)))
    return tuple(out)
