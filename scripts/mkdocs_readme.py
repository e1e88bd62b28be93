"""A MkDocs hook: the home page's quick start, model zoo and citation are the README's own sections, copied in at
build time from a marker line (``<!-- README: Quick start -->``), so the site and the README cannot say different
things. The README's links into docs/ become the site's page links."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- README: (?P<title>[^>]+?) -->$", re.MULTILINE)
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_section(title: str, text: str) -> str:
    """The README's ``## title`` section, heading included, up to the next ``## `` heading; KeyError if absent."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise KeyError(f"README.md has no section '## {title}'")
    body = re.sub(r"\]\(docs/", "](", match.group(1))  # a link into docs/ is a page link on the site
    return f"## {title}\n{body.rstrip()}\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if not MARKER.search(markdown):
        return markdown
    text = README.read_text(encoding="utf-8")
    return MARKER.sub(lambda m: readme_section(m.group("title"), text), markdown)
