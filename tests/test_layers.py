"""The import layers, by test: consumers on top, then the stages in pipeline order, then the core.

    cli  →  review, verify  →  tracer → codegen → packager → loader  →  core (aot/)
    cli  →  serve  →  loader  →  core (aot/)
    runtime (aotpack-rt, no torch)  →  core (aot/)

The core imports no stage and no consumer; a stage imports the core and earlier stages only
(never a later one); the loader imports the core alone, so a serving host needs nothing of the
build; review and verify sit above the stages and below the CLI; serve (the serving engines) sits
above the loader and imports only it and the core, so a serving host needs nothing of the build. Every import counts, including
those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# folder → (its module prefix, what it may import besides itself and the standard/third-party world)
STAGES = ["tracer", "codegen", "packager", "loader"]
CONSUMERS = ["verify", "review", "serve", "cli"]
FOLDERS = {"aot": "aot", **{f: f"aot.{f}" for f in STAGES + CONSUMERS}, "runtime": "aot.runtime"}


def allowed(folder: str) -> set[str]:
    """The aotpack folders whose modules ``folder`` may import (besides its own)."""
    if folder == "aot":
        return set()
    if folder in ("loader", "runtime"):
        return {"aot"}
    if folder in STAGES:
        return {"aot", *STAGES[: STAGES.index(folder)]}
    if folder in ("verify", "review"):
        return {"aot", *STAGES}
    if folder == "serve":
        return {"aot", "loader"}
    return {"aot", *STAGES, "verify", "review", "serve"}  # cli


def folder_of(module: str) -> str | None:
    """``aot.codegen.index`` → ``codegen``; ``aot.schema`` → ``aot``; not aotpack → None."""
    parts = module.split(".")
    if parts[0] != "aot":
        return None
    if len(parts) > 1 and parts[1] in FOLDERS and parts[1] != "aot":
        return parts[1]
    return "aot"


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "aot":  # ``from aot import schema`` imports aot.schema
                out += [(node.lineno, f"aot.{a.name}") for a in node.names]
    return out


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []


@pytest.mark.parametrize("folder", list(FOLDERS))
def test_each_folder_imports_only_what_its_layer_allows(folder):
    may = allowed(folder) | {folder}
    bad = []
    for path in sources(folder):
        for line, module in imports(path):
            target = folder_of(module)
            if target is not None and target not in may:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({folder} → {target})")
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


def test_every_product_folder_is_placed_in_a_layer():
    mapped = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {
        "tests",
        "models",
        "bench",
        "examples",
        "docs",
    }
    assert mapped <= set(FOLDERS), f"folders with no layer: {sorted(mapped - set(FOLDERS))}"
    # the rules are not vacuous: each folder has modules, and the stages do import the core
    for folder in FOLDERS:
        if folder in ("review", "cli") and not sources(folder):
            continue  # not split out yet
        assert sources(folder), folder
    assert any(folder_of(m) == "aot" for p in sources("loader") for _, m in imports(p))


def test_the_checker_catches_a_breach(tmp_path):
    """A later stage imported from an earlier one is reported (the rule can fail)."""
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from aot.loader import load\n")
    assert imports(fake) == [(2, "aot.loader")]
    assert folder_of("aot.loader") not in allowed("codegen") | {"codegen"}
    assert folder_of("aot.codegen.index") in allowed("packager")
    assert folder_of("aot.tracer") not in allowed("serve") and folder_of("aot.serve.ray") in allowed("cli")
