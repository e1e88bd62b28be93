"""A MkDocs hook: the package's docstrings name code with Sphinx's roles (:func:`name`), which the API page's
Google-style rendering would print as they are ("(:mod:" before the name). Each role before a rendered code name is
dropped, leaving the name as code."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|const):(?=<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return ROLE.sub("", html)
