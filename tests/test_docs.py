"""The user-facing docs stay usable: the README fits on a few screens, and every relative link in
the README and in docs/*.md leads to a file in the tree (anchors stripped; web and mail links
are not followed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _links import broken_links, relative_links

REPO = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15 * 1024
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_fits_its_budget():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move depth to docs/"


def test_the_docs_pages_exist_and_the_readme_links_each():
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert "design.md" in pages and len(pages) >= 8, pages
    linked = {Path(t).name for t in relative_links((REPO / "README.md").read_text()) if t.startswith("docs/")}
    assert set(pages) <= linked, f"docs pages the README does not link: {sorted(set(pages) - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert relative_links(page.read_text()) or page.name != "README.md", "the README links nothing"
    missing = broken_links(page)
    assert not missing, f"{page.relative_to(REPO)} links files that do not exist: {missing}"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a) [web](https://example.com/x) [mail](mailto:a@b.c) [anchor](#here)\n"
        f"`[code](nowhere.md)` [gone](missing.md#sec) ![img](gone.png) [abs]({tmp_path / 'there.md'})\n"
    )
    assert broken_links(page) == ["missing.md", "gone.png", str(tmp_path / "there.md")]
