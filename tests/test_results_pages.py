"""bench/RESULTS.md and the pages beside it are what `python bench/report.py` renders from the
committed JSON, byte for byte: the summary first on a main page a reader can take in (<= 20 KB),
one page per subject linked from it and saying what it measures and where, and no link in any of
them that leads nowhere."""

from __future__ import annotations

import pytest
from _bench import BENCH, load_bench
from _links import broken_links

MAIN = BENCH / "RESULTS.md"
MAX_MAIN_BYTES = 20 * 1024
# The pages the report writes: the main page, its subject pages, each machine folder's one page.
FOLDERS = [(BENCH / "results", MAIN)] + [(p.parent, p) for p in sorted((BENCH / "results").glob("*/RESULTS.md"))]
PAGES = [MAIN, *sorted(BENCH.glob("RESULTS-*.md")), *(page for _, page in FOLDERS[1:])]


@pytest.fixture
def report(monkeypatch):
    # storage's table imports bench/storage_table.py by plain name while it renders, as
    # `python bench/report.py` would find it.
    monkeypatch.syspath_prepend(str(BENCH))
    return load_bench("report")


def test_main_page_opens_with_the_summary_and_fits():
    text = MAIN.read_text()
    assert len(text.encode()) <= MAX_MAIN_BYTES, f"bench/RESULTS.md is {len(text.encode()):,} bytes"
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0].startswith("## Summary"), headings[:3]


@pytest.mark.parametrize("results, page", FOLDERS, ids=lambda p: str(p.relative_to(BENCH)))
def test_pages_are_what_the_report_renders(report, results, page):
    pages = report.render(results, page)
    committed = set(BENCH.glob("RESULTS*.md")) if page == MAIN else {page}
    assert set(pages) == committed, "run `python bench/report.py`: pages written and pages committed differ"
    for path, text in pages.items():
        assert path.read_text() == text, f"{path.relative_to(BENCH)} is stale: run `python bench/report.py`"


def test_every_subject_page_is_linked_and_says_what_and_where(report):
    main = MAIN.read_text()
    subject_pages = sorted(BENCH.glob("RESULTS-*.md"))
    assert len(subject_pages) >= 5, subject_pages
    for path in subject_pages:
        assert f"]({path.name})" in main, f"bench/RESULTS.md does not link {path.name}"
        title, what = report.SUBJECTS[path.stem.removeprefix("RESULTS-")]
        lines = path.read_text().splitlines()
        assert lines[0] == f"# {title}" and lines[2].startswith(what), lines[:3]
        assert "Measured on **" in lines[2], lines[2]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(BENCH)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)
