"""mkdocs hook: the site's home page is the repository's README.md, its links to `docs/X`
pointed at the page X (mkdocs.yml names this file under `hooks`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_README = Path(__file__).resolve().parents[1] / "README.md"
_DOCS_LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """docs/index.md's text is replaced by README.md's (see docs/index.md)."""
    if page.file.src_uri != "index.md":
        return markdown
    return _DOCS_LINK.sub("](", _README.read_text(encoding="utf-8"))
