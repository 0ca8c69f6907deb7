"""What the CLI prints about bundles: the ``inspect`` summary, ``load``'s outputs and latency,
and ``verify``'s per-size lines. Text only; the verbs (``aot.cli.commands``) decide what to run."""

from __future__ import annotations

from typing import Any

from aot.bundle import open_bundle
from aot.errors import printable
from aot.manifest_text import rows_note
from aot.program import FIRST_CALL_MIB, library_of
from aot.serde import to_json
from aot.tuning import ATTENTION_SITE


def sizes_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def bundle_summary(bundle: str) -> tuple[Any, dict[str, Any]]:
    """(manifest, the ``inspect --json`` object): members, steps per program, kernels, buckets.
    Every member's sha256 is checked, the weights' too: a corrupt bundle is a ``BundleError``."""
    b = open_bundle(bundle)
    try:
        b.check_weights()  # every member checked: "matches the manifest" then speaks for the bundle
        m = b.manifest
        program = b.program()
        signed = b.signature()
        from aot.tuning import read_tuning

        programs = (program, *program.variants)
        tuning = read_tuning(b, programs, [e.buckets for e in m.programs] if m.programs else [m.buckets])
    finally:
        b.close()
    names = (
        [f"{e.entry} ({e.name})" if e.entry else e.name for e in m.programs]
        if len(m.programs) == len(programs)
        else ["general"] * len(programs)
    )
    all_steps = [s for p in programs for s in p.steps]
    kernels = [
        {
            "id": k.id,
            "name": k.name,
            "ops": list(k.ops),
            "archs": list(k.archs),
            "dependent_launch": list(k.dependent_launch),
            "bytes_moved": k.bytes_moved,
            "num_warps": k.num_warps,
            "config": k.config,
            "launches": sum(s.kind == "kernel" and s.target == k.id for s in all_steps),
        }
        for k in {k.id: k for p in programs for k in p.kernels}.values()
    ]
    per_program = [
        {
            "name": n,
            "aten": sum(s.kind == "aten" for s in p.steps),
            "kernel": sum(s.kind == "kernel" for s in p.steps),
        }
        for n, p in zip(names, programs)
    ]
    steps = {
        "aten": sum(s.kind == "aten" for s in all_steps),
        "kernel": sum(s.kind == "kernel" for s in all_steps),
    }
    replaced = sum(len(s.reference) for s in all_steps if s.kind == "kernel")
    libraries: dict[str, dict[str, int]] = {}  # library -> ATen op -> calls, untuned
    for s in all_steps:
        lib = library_of(s)
        if lib is not None:
            ops = libraries.setdefault(lib, {})
            ops[s.target] = ops.get(s.target, 0) + 1
    info = {
        "name": m.name,
        "dtype": m.dtype,
        "schema_version": list(m.schema_version),
        "environment": to_json(m.environment),
        "members": {k: v.size for k, v in m.members.items()},
        "steps": steps,
        "programs": per_program,
        "state": [
            {"name": i.name, "dtype": i.dtype, "shape": list(i.shape)} for i in m.guards.inputs if i.state
        ],
        "aten_ops_fused": replaced,
        "libraries": libraries,
        "kernels": kernels,
        "buckets": to_json(m.buckets),
        "ops": list(m.ops),
        "stats": to_json(m.stats),
        "signature": _signature_info(signed),
        "gemm_sites": [
            {
                "program": i,
                "id": site.id,
                "m": site.m,
                "n": site.n,
                "k": site.k,
                "candidates": [c.name for c in site.candidates],
            }
            for i, p in enumerate(programs)
            for site in p.alternatives
        ],
        "tuning": to_json(tuning) if tuning is not None else None,
        "rows": {
            g.name: {"independent": g.rows_independent, "check": g.rows_check} for g in m.guards.symbols
        },
    }
    return m, info


def _signature_info(signed) -> dict[str, Any] | None:
    """The signer's key and whether its signature matches the manifest (None: cryptography is not
    installed to check). Whether the key is trusted is for the loader's trust list to say."""
    if signed is None:
        return None
    from aot.errors import EnvError
    from aot.signing import verifies

    sig, manifest = signed
    try:
        matches = verifies(sig.public_key, sig, manifest)
    except EnvError:
        matches = None
    return {"key": sig.fingerprint, "matches_manifest": matches}


def _signature_text(sig: dict[str, Any] | None) -> str:
    if sig is None:
        return "none (aotpack sign BUNDLE --key KEY)"
    check = {
        True: "matches the manifest",
        False: "DOES NOT match the manifest: changed after signing",
        None: "not checked: pip install 'aotpack[sign]'",
    }[sig["matches_manifest"]]
    return f"signed by {sig['key']} ({check})"


def checks_note(set_back: int, library_free: int, whole: int = 0) -> str:
    """What tune's whole-program check undid, the buckets it kept for leaving no cuBLAS call, and
    those on a whole plan, for a report line ("" when none)."""
    note = f"; {set_back} bucket(s) set back to the library by the whole-program check" if set_back else ""
    if library_free:
        note += f"; {library_free} bucket(s) kept library-free (every GEMM site on a candidate, no cuBLAS)"
    if whole:
        note += f"; {whole} bucket(s) on a whole plan (faster together than site by site)"
    return note


def _tuning_text(tuning: dict[str, Any] | None) -> str:
    if tuning is None:
        return "untuned: the library calls run (aotpack tune BUNDLE on the target GPU)"
    chosen = sum(c["choice"] != "library" for c in tuning["choices"])
    set_back = sum(not c["kept"] for c in tuning.get("checks", ()))
    library_free = sum(bool(c.get("library_free")) for c in tuning.get("checks", ()))
    whole = sum(bool(c.get("whole_plan")) for c in tuning.get("checks", ()))
    return (
        f"tuned on {tuning['device']} ({tuning['arch']}): {chosen}/{len(tuning['choices'])} "
        f"site-buckets use a candidate" + checks_note(set_back, library_free, whole)
    )


LIBRARY_NAMES = {"cudnn": "cuDNN", "cublas": "cuBLAS", "attention": "ATen attention", "aten": "ATen kernels"}


def _libraries_text(libraries: dict[str, dict[str, int]], tuning: dict[str, Any] | None) -> str:
    """Which libraries the library calls launch on a GPU, and what loading them costs a process
    (``aot.program.FIRST_CALL_MIB``): the line that says why a bundle takes the memory it does."""
    parts = []
    for lib in LIBRARY_NAMES:
        ops = libraries.get(lib)
        if ops:
            calls = ", ".join(f"{op.split('.')[1]} ×{n}" for op, n in sorted(ops.items()))
            parts.append(f"{LIBRARY_NAMES[lib]} ({calls})")
    text = "library calls launch: " + (
        "; ".join(parts) if parts else "nothing (every step a kernel or a view)"
    )
    costs = [f"{LIBRARY_NAMES[lib]} ~{mib} MiB" for lib, mib in FIRST_CALL_MIB.items() if lib in libraries]
    if costs:
        text += f"; loading them costs a process {', '.join(costs)} of device memory (H100)"
    if "cublas" in libraries and tuning and any(c.get("library_free") for c in tuning.get("checks", ())):
        text += "; tuned library-free: no cuBLAS call at the buckets"
    return text


def summary_text(m, info: dict[str, Any]) -> str:
    """The human ``inspect`` report."""
    per_program, kernels, replaced = info["programs"], info["kernels"], info["aten_ops_fused"]
    lines: list[str] = []
    lines.append(
        f"{m.name}  ({m.dtype}, schema {m.schema_version[0]}.{m.schema_version[1]}, "
        f"built with torch {m.environment.torch_built})"
    )
    lines.append("members:")
    for name, size in sorted(info["members"].items()):
        lines.append(f"  {size:>12,}  {name}")
    several = f" in {len(per_program)} programs" if len(per_program) > 1 else ""
    lines.append(
        f"program: {info['steps']['aten']} library calls, {info['steps']['kernel']} kernel launches{several} "
        f"({len(kernels)} distinct kernels fusing {replaced} ATen ops)"
    )
    if len(per_program) > 1:
        for p in per_program:
            lines.append(f"  program {p['name']}: {p['aten']} library calls, {p['kernel']} kernel launches")
    lines.append("  " + _libraries_text(info["libraries"], info["tuning"]))
    alternative = ("gemm", "attention")
    candidates = [k for k in kernels if k["config"].get("kind") in alternative]
    for k in kernels:
        if k["config"].get("kind") in alternative and not k["launches"]:
            continue  # GEMM and attention candidates: summarized below
        lines.append(
            f"  kernel {k['name']} ({k['id']}, {k['config'].get('kind', '?')}, ×{k['launches']}): "
            f"{len(k['ops'])} ops [{', '.join(k['ops'][:6])}"
            f"{', …' if len(k['ops']) > 6 else ''}] archs {','.join(k['archs'])} bytes≈{k['bytes_moved']}"
        )
    sites = info["gemm_sites"]
    if sites:
        n_cands = sum(len(x["candidates"]) for x in sites)
        n_attn = sum(str(x["id"]).startswith(ATTENTION_SITE) for x in sites)
        where = (
            f"{len(sites)} sites"
            if not n_attn
            else f"{len(sites) - n_attn} GEMM and {n_attn} attention sites"
        )
        lines.append(
            f"GEMM candidates: {n_cands} for {where} ({len(candidates)} kernels); "
            + _tuning_text(info["tuning"])
        )
    plan = m.stats.memory_plan
    if plan:
        lo, hi = min(plan, key=lambda b: b.peak_bytes), max(plan, key=lambda b: b.peak_bytes)
        lines.append(
            f"memory plan: {len(plan)} CUDA-graph buckets, peak activations {mb(lo.peak_bytes)} "
            f"({sizes_text(lo.sizes)}) .. {mb(hi.peak_bytes)} ({sizes_text(hi.sizes)})"
        )
    early = sorted({a for k in kernels for a in k["dependent_launch"]})
    lines.append(
        f"archs: {', '.join(m.environment.archs) or '(none: CPU only)'}"
        + (f"; {', '.join(early)}: kernels launch early (programmatic dependent launch)" if early else "")
    )
    lines.append(f"signature: {_signature_text(info['signature'])}")
    for bk in m.buckets:
        lines.append(
            f"bucket {bk.symbol}: {', '.join(map(str, bk.sizes))}{'  paddable' if bk.paddable else ''}"
        )
    for g in m.guards.symbols:
        lines.append(
            rows_note(g)
            or f"rows along {g.name}: not checked (built before the check), a server never joins requests along it"
        )
    return "\n".join(map(printable, lines)) + "\n"  # names and text from the bundle, escaped
