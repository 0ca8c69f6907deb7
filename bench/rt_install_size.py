"""The install size of aotpack-rt (``runtime/pyproject.toml``): its own files and every distribution
its dependencies pull, resolved from the installed distributions' metadata (markers evaluated
for this interpreter), none of them torch.

    python bench/rt_install_size.py [--extras numpy,trust] [--wheels DIR] [--limit-mb 60] [--json]

Installed bytes are the sizes each distribution's RECORD lists (what ``pip install`` wrote);
with ``--wheels DIR`` (``pip download aotpack-rt`` or the wheels staged for a GPU machine), the
bytes of the closure's wheels found there too. Exits 1 when a dependency is not installed here,
torch is in the closure, or the total passes ``--limit-mb`` (the issue's target: 60 MB, wheels of
all dependencies).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "runtime" / "pyproject.toml"
FORBIDDEN = ("torch", "triton", "sympy")  # what the runtime exists to do without


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extras: tuple[str, ...] = ()) -> list[str]:
    """aotpack-rt's requirements as its pyproject declares them, with ``extras``."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"aotpack-rt has no extra {extra!r}; it has {sorted(optional)}")
        found += optional[extra]
    return found


def _applies(req, extras: set[str]) -> bool:
    """Whether ``req`` applies here, asked for with ``extras`` of the distribution requiring it."""
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *sorted(extras)))


def closure(reqs: list[str]) -> dict[str, md.Distribution]:
    """Every installed distribution ``reqs`` pull, by canonical name (markers evaluated for this
    interpreter, extras followed); ``LookupError`` naming a requirement not installed."""
    from packaging.requirements import Requirement

    out: dict[str, md.Distribution] = {}
    asked: dict[str, set[str]] = {}  # the extras each distribution was asked for
    todo = [r for r in map(Requirement, reqs) if _applies(r, set())]
    while todo:
        req = todo.pop()
        name, extras = _canonical(req.name), set(req.extras)
        if name in out and extras <= asked[name]:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise LookupError(
                f"{req} is not installed here; install aotpack-rt's dependencies first"
            ) from None
        out[name], asked[name] = dist, asked.get(name, set()) | extras
        todo += [r for r in map(Requirement, dist.requires or ()) if _applies(r, asked[name])]
    return out


def installed_bytes(dist: md.Distribution) -> int:
    """The bytes of a distribution's files as its RECORD lists them (the file's size where the
    RECORD has none)."""
    total = 0
    for f in dist.files or ():
        if f.size is not None:
            total += f.size
        else:
            path = Path(str(dist.locate_file(f)))
            total += path.stat().st_size if path.is_file() else 0
    return total


def own_bytes() -> int:
    """aotpack-rt's own files: the torch-free core (``aot/``) and ``runtime/``, Python only."""
    return sum(p.stat().st_size for d in ("aot", "runtime") for p in (ROOT / d).rglob("*.py"))


def wheel_bytes(folder: Path, names: set[str]) -> dict[str, int]:
    """The bytes of the wheel of each of ``names`` found in ``folder`` (the largest where several)."""
    out: dict[str, int] = {}
    for wheel in folder.glob("*.whl"):
        name = _canonical(wheel.name.split("-")[0])
        if name in names:
            out[name] = max(out.get(name, 0), wheel.stat().st_size)
    return out


def report(extras: tuple[str, ...] = (), wheels: Path | None = None) -> dict:
    dists = closure(requirements(extras))
    sizes = {name: installed_bytes(d) for name, d in sorted(dists.items())}
    out = {
        "extras": list(extras),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "distributions": {n: {"version": dists[n].version, "installed_bytes": b} for n, b in sizes.items()},
        "aotpack_rt_bytes": own_bytes(),
        "forbidden_in_closure": sorted(n for n in sizes if n in FORBIDDEN),
    }
    out["installed_total_bytes"] = sum(sizes.values()) + out["aotpack_rt_bytes"]
    if wheels is not None:
        found = wheel_bytes(wheels, set(sizes))
        out["wheels"] = found
        out["wheels_missing"] = sorted(set(sizes) - set(found))
        out["wheels_total_bytes"] = sum(found.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="", help="comma-separated extras of aotpack-rt (numpy, trust)")
    ap.add_argument("--wheels", type=Path, help="a folder of wheels (pip download) to sum as well")
    ap.add_argument("--limit-mb", type=float, default=60.0, help="fail above this many MB (1e6 bytes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    extras = tuple(e for e in args.extras.split(",") if e)
    try:
        got = report(extras, args.wheels)
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    total = got["wheels_total_bytes"] if args.wheels is not None else got["installed_total_bytes"]
    if args.wheels is not None and got["wheels_missing"]:
        print(f"error: no wheel in {args.wheels} for {got['wheels_missing']}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(got, indent=1, sort_keys=True))
    else:
        for name, d in got["distributions"].items():
            print(f"{name:24} {d['version']:12} {d['installed_bytes'] / 1e6:7.1f} MB installed")
        print(f"{'aotpack-rt':24} {'':12} {got['aotpack_rt_bytes'] / 1e6:7.1f} MB")
        print(f"installed total {got['installed_total_bytes'] / 1e6:.1f} MB (Python {got['python']})")
        if args.wheels is not None:
            print(
                f"wheels total {got['wheels_total_bytes'] / 1e6:.1f} MB, missing: {got['wheels_missing'] or 'none'}"
            )
    if got["forbidden_in_closure"]:
        print(f"error: aotpack-rt's dependencies pull {got['forbidden_in_closure']}", file=sys.stderr)
        return 1
    if total > args.limit_mb * 1e6:
        print(f"error: {total / 1e6:.1f} MB, over the {args.limit_mb:g} MB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
