"""The documentation a fresh clone has: every relative link in README.md and docs/*.md leads to a
file inside the repository (and an ``#anchor`` to a heading of that file), and nothing in the
README, the docs or the package points outside the repository (``../shared``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def links(page: Path) -> list[str]:
    """Link targets in the page's text (code blocks and code spans are not links)."""
    text = _CODE.sub("", _FENCE.sub("", page.read_text()))
    return _LINK.findall(text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to -."""
    text = _FENCE.sub("", page.read_text())
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_pages_are_there() -> None:
    names = {p.name for p in PAGES}
    assert {"design.md", "structure.md", "serving.md", "backends.md", "performance.md"} <= names
    readme = links(ROOT / "README.md")
    for name in ("design.md", "serving.md", "backends.md", "performance.md", "structure.md"):
        assert f"docs/{name}" in {t.split("#")[0] for t in readme}, f"README does not link {name}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert dest.is_file(), f"{page.name}: {target} is not a file of the repository"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.name}: {target}: no such heading"


def test_nothing_points_outside_the_repository() -> None:
    files = [*PAGES, *(ROOT / "pagedllm").rglob("*.py"), *(ROOT / "pagedllm").rglob("*.md")]
    bad = [str(f.relative_to(ROOT)) for f in files if "../shared" in f.read_text(errors="ignore")]
    assert not bad, f"these point outside the repository: {bad}"
