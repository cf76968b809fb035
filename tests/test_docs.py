"""The documentation's references hold: every relative link of the user-facing pages (README, SECURITY,
CONTRIBUTING, the benchmarks' README, docs/) resolves to a file of the repository, and to a heading of it
where the link names one; every module or folder a package README's table names exists; every Python block
of those pages is one that `tests/integration/test_readme.py` runs. (`tests/test_layout.py` checks the converse
of the second: every module of a package is named in its README.)"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PAGES = ["README.md", "SECURITY.md", "CONTRIBUTING.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PACKAGE_READMES = sorted(
    str(p.relative_to(ROOT)) for tree in ("planner", "solvers") for p in (ROOT / tree).rglob("README.md"))

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
"""A Markdown link or image: `[text](target)` / `![alt](target)`."""
TABLE_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|", re.M)
"""A table row whose first cell is one name in backticks: `| `trace.py` | ... |`."""


PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
"""A fenced Python block, as the README harness reads it."""


def _code_free(text: str) -> str:
    """The page without its fenced and inline code, where a bracket is code, not a link."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def broken_links(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Each relative link of `page` whose file (inside `root`), or heading, is not there."""
    broken = []
    for match in LINK.finditer(_code_free(page.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not the repository's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or root not in (file, *file.parents):
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    return broken


@pytest.mark.parametrize("name", PAGES)
def test_every_relative_link_resolves(name: str) -> None:
    page = ROOT / name
    assert page.is_file(), f"{name} is missing"
    assert not broken_links(page), f"{name}: links that lead nowhere: {broken_links(page)}"


def test_a_broken_link_is_found(tmp_path: pathlib.Path) -> None:
    (tmp_path / "there.md").write_text("# Set up\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#set-up) [web](https://pytorch.org) `[code](gone.md)`\n"
        "[gone](gone.md) [no heading](there.md#quickstart) ![plot](gone.png)\n"
    )
    assert broken_links(page, tmp_path) == ["gone.md", "there.md#quickstart", "gone.png"]


@pytest.mark.parametrize("name", PACKAGE_READMES)
def test_every_module_a_package_readme_names_exists(name: str) -> None:
    readme = ROOT / name
    named = [n for n in TABLE_ROW.findall(readme.read_text()) if n.endswith((".py", "/"))]
    missing = [n for n in named if not (readme.parent / n).exists()]
    assert not missing, f"{name} names modules that do not exist: {missing}"


def unrun_blocks(pages: list[pathlib.Path], run: list[str]) -> list[str]:
    """The first line of each Python block of `pages` that is not among the blocks `run`."""
    return [f"{page.name}: {block.splitlines()[0]}" for page in pages for block in PYTHON_BLOCK.findall(page.read_text())
            if block not in run]


def test_every_python_block_of_the_pages_runs() -> None:
    """A block moved out of the README (to docs/training.md, say) still runs where it went."""
    from tests.integration.test_readme import _blocks

    run = _blocks()
    assert not unrun_blocks([ROOT / name for name in PAGES], run), "blocks the README harness does not run"


def test_an_unrun_block_is_found(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\ny = 2\n```\n\n```text\nz\n```\n")
    assert unrun_blocks([page], ["x = 1\n"]) == ["page.md: y = 2"]
