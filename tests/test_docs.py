"""The README and docs/ hold together: CI runs the README's second command as written, every
relative link in them leads to a file (and heading) that exists, the README stays a front page,
and the test extra installs nothing that breaks the environment it is installed in."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 200


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_ci_runs_the_readme_commands_as_written():
    first, second = (b.strip() for b in _bash_blocks((ROOT / "README.md").read_text())[:2])
    assert "aotpack build" in first and second.endswith("&& pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert second in ci, f".ci/run must run the README's second command as written: {second}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_somewhere(page):
    bad = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_test_extra_leaves_torchvision_out():
    """The package index's torchvision wheels are CUDA builds: beside a CPU torch they fail to
    import, and transformers' model classes with them. timm requires torchvision."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0].lower() for r in extras["test"]}
    assert not names & {"torchvision", "timm"}
    assert {"torchvision", "timm"} <= {re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0] for r in extras["vision"]}
