"""The changes between two bundles beyond their guards: toolchain, ATen ops, program and kernels,
and weights tensor by tensor (safetensors headers read by the loader's own parser)."""

from __future__ import annotations

import hashlib

from aot.review.verdict import Change, change

MAX_WEIGHT_DIFF_BYTES = 8 << 30  # above this, weights compare by member checksum only


def _tensor_digests(data: bytes, where: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (dtype, shape, sha256 of its bytes), from a safetensors file's bytes."""
    from aot.loader.weights import parse_safetensors

    view = memoryview(data)
    return {
        name: (str(dtype).removeprefix("torch."), tuple(shape), hashlib.sha256(view[begin:end]).hexdigest())
        for name, (dtype, shape, begin, end) in sorted(parse_safetensors(data, where).items())
    }


def diff_bundles(old_path: str, new_path: str) -> list[Change]:
    """Kernel, op, program and weight changes between two bundles (guards are compared apart)."""
    from aot import schema
    from aot.bundle import open_bundle

    a, b = open_bundle(old_path), open_bundle(new_path)
    try:
        changes = []
        ea, eb = a.manifest.environment, b.manifest.environment
        for label, x, y in (
            ("torch", ea.torch_built, eb.torch_built),
            ("triton", ea.triton_built, eb.triton_built),
            ("python", ea.python_built, eb.python_built),
        ):
            if x != y:
                changes.append(change("toolchain", f"built with {label}", x or "-", y or "-"))
        ops_a, ops_b = set(a.manifest.ops), set(b.manifest.ops)
        for op in sorted(ops_b - ops_a):
            changes.append(
                change(
                    "ops",
                    "ATen op",
                    new=op,
                    summary=f"ATen op added: {op}",
                    details=("the serving torch must provide it",),
                )
            )
        for op in sorted(ops_a - ops_b):
            changes.append(change("ops", "ATen op", old=op, summary=f"ATen op no longer used: {op}"))
        ma, mb = a.manifest.members, b.manifest.members
        if ma[schema.PROGRAM_PATH].sha256 != mb[schema.PROGRAM_PATH].sha256:
            pa, pb = a.program(), b.program()
            changes += _kernel_changes(pa.kernels, pb.kernels)
            changes.append(
                change(
                    "program",
                    "program",
                    f"{len(pa.steps)} steps",
                    f"{len(pb.steps)} steps",
                    (
                        f"{sum(s.kind == 'kernel' for s in pa.steps)} -> "
                        f"{sum(s.kind == 'kernel' for s in pb.steps)} kernel launches",
                    ),
                )
            )
        if ma[schema.WEIGHTS_PATH].sha256 != mb[schema.WEIGHTS_PATH].sha256:
            changes += _weight_changes(a, b, schema.WEIGHTS_PATH)
        return changes
    finally:
        a.close()
        b.close()


def _kernel_changes(old, new) -> list[Change]:
    changes = []
    a = {k.id: k for k in old}
    b = {k.id: k for k in new}
    a_names = {k.name: k for k in old if k.id not in b}
    b_names = {k.name: k for k in new if k.id not in a}

    def ops(k) -> str:
        return f"{len(k.ops)} ops [{', '.join(k.ops[:6])}{', …' if len(k.ops) > 6 else ''}]"

    for name in sorted(a_names.keys() & b_names.keys()):
        x, y = a_names[name], b_names[name]
        changes.append(
            change(
                "kernel",
                f"kernel {name}",
                f"{x.id} {ops(x)}",
                f"{y.id} {ops(y)}",
                summary=f"kernel {name} changed: {x.id} -> {y.id}",
            )
        )
    for name in sorted(a_names.keys() - b_names.keys()):
        changes.append(
            change(
                "kernel",
                f"kernel {name}",
                old=f"{a_names[name].id} {ops(a_names[name])}",
                summary=f"kernel removed: {name} {ops(a_names[name])}",
            )
        )
    for name in sorted(b_names.keys() - a_names.keys()):
        changes.append(
            change(
                "kernel",
                f"kernel {name}",
                new=f"{b_names[name].id} {ops(b_names[name])}",
                summary=f"kernel added: {name} {ops(b_names[name])}",
            )
        )
    return changes


def _weight_changes(a, b, member: str) -> list[Change]:
    sizes = a.manifest.members[member].size + b.manifest.members[member].size
    if sizes > MAX_WEIGHT_DIFF_BYTES:
        return [
            change(
                "weights",
                "weights",
                a.manifest.members[member].sha256[:12],
                b.manifest.members[member].sha256[:12],
                ("too large to compare tensor by tensor",),
            )
        ]
    x = _tensor_digests(a.read(member), str(a.path))
    y = _tensor_digests(b.read(member), str(b.path))
    changed = sorted(n for n in x.keys() & y.keys() if x[n][2] != y[n][2] and x[n][:2] == y[n][:2])
    reshaped = sorted(n for n in x.keys() & y.keys() if x[n][:2] != y[n][:2])
    details = []

    def names(ns: list[str]) -> str:
        return ", ".join(ns[:5]) + (f", … ({len(ns)} in all)" if len(ns) > 5 else "")

    for label, ns in (
        ("values changed", changed),
        ("dtype/shape changed", reshaped),
        ("added", sorted(y.keys() - x.keys())),
        ("removed", sorted(x.keys() - y.keys())),
    ):
        if ns:
            details.append(f"{label}: {names(ns)}")
    if not details:
        details.append("same tensors; the file differs only in layout or metadata")
    n = len(changed) + len(reshaped) + len(y.keys() ^ x.keys())
    return [
        change(
            "weights",
            "weights",
            summary=f"weights: {n} of {len(x.keys() | y.keys())} tensors differ",
            details=tuple(details),
        )
    ]


# ---------------------------------------------------------------------------------------------
