"""Relative links in markdown pages (README.md, docs/, bench/RESULTS*.md): what the link tests
of test_docs.py and test_results_pages.py check."""

from __future__ import annotations

import re
from pathlib import Path

# [text](target) or [text](target "title"); images too. Code spans are removed first, so a
# bracketed expression inside backticks is never read as a link.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def relative_links(text: str) -> list[str]:
    """The link targets in markdown `text` that name a file of this tree, without their anchors."""
    out = []
    for target in LINK.findall(CODE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s):, mailto:, or an anchor within the page
        out.append(target.split("#", 1)[0])
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` that lead to no file beside it; an absolute path counts as
    broken (it resolves on one machine only)."""
    return [t for t in relative_links(page.read_text()) if Path(t).is_absolute() or not (page.parent / t).exists()]
