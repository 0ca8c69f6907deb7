"""The import layers, by test: consumers on top, then the stages in pipeline order, then the core.

    cli  →  review, verify  →  tracer → codegen → packager → loader  →  core (aot/)
    cli  →  serve  →  loader  →  core (aot/)
    runtime (aotpack-rt, no torch)  →  core (aot/)

The core imports no stage and no consumer; a stage imports the core and earlier stages only
(never a later one); the loader imports the core alone, so a serving host needs nothing of the
build; review and verify sit above the stages and below the CLI; serve (the serving engines) sits
above the loader and imports only it and the core, so a serving host needs nothing of the build. Every import counts, including
those inside functions.

Inside a folder, modules import each other one way: no import circle (two modules that need each
other are one module, or share a third that both import).
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


# circles that another change removes (``loader/bundle.py`` <-> ``loader/signature.py``, with the
# split of the CLI); the check fails when one is gone, so that its line goes too
KNOWN_CIRCLES: list[list[str]] = []


def module_name(root: Path, path: Path) -> str:
    """``codegen/gemm.py`` → ``aot.codegen.gemm``; ``aot/schema.py`` → ``aot.schema``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "aot" else ["aot", *parts])


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each aotpack module → the aotpack modules it imports (``from aot.codegen import index``
    imports ``aot.codegen.index``; ``from aot.codegen import generate``, ``aot.codegen``)."""
    paths = {
        module_name(root, p): p
        for folder in FOLDERS
        if (root / folder).is_dir()
        for p in sorted((root / folder).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if sub in paths else node.module)
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of two modules or more,
    each sorted, in sorted order (Tarjan's algorithm, iterative)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in order:
            continue
        work = [(start, iter(sorted(graph[start])))]
        order[start] = low[start] = len(order)
        stack.append(start)
        while work:
            node, edges = work[-1]
            nxt = next((t for t in edges if t not in order or t in stack), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt in order:  # on the stack: a way back
                low[node] = min(low[node], order[nxt])
            else:
                order[nxt] = low[nxt] = len(order)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
    return sorted(found)


def test_no_folder_has_an_import_circle():
    found = circles(import_graph(ROOT))
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circles (each module needs the others):\n" + "\n".join(
        " <-> ".join(c) for c in new
    )
    gone = [c for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"these circles are gone: take them out of KNOWN_CIRCLES: {gone}"


def test_the_circle_check_catches_a_circle(tmp_path):
    """The circle gemm.py <-> flash.py once had: a module-level import one way, one inside a
    function the other way; a third module that both import makes no circle."""
    (tmp_path / "codegen").mkdir()
    (tmp_path / "codegen" / "__init__.py").write_text("")
    (tmp_path / "codegen" / "gemm.py").write_text(
        "from aot.codegen import index\n\ndef f():\n    from aot.codegen.flash import g\n"
    )
    (tmp_path / "codegen" / "flash.py").write_text("from aot.codegen.gemm import FLOAT_DTYPES\n")
    (tmp_path / "codegen" / "index.py").write_text("import aot.codegen\n")
    graph = import_graph(tmp_path)
    assert graph["aot.codegen.gemm"] == {"aot.codegen.index", "aot.codegen.flash"}
    assert circles(graph) == [["aot.codegen.flash", "aot.codegen.gemm"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
