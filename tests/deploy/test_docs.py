"""The documentation site builds with `mkdocs build --strict` (no warning: no broken link or
anchor, no page left out of the nav), and every code block marked runnable (an HTML comment
`<!-- runnable -->` on the line before its fence, docs/development.md) runs and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
# the Markdown the site is built from: docs/ and the files it includes where they live
SOURCES = sorted(
    [ROOT / "README.md", ROOT / "serving" / "README.md", ROOT / "bench" / "RESULTS.md"]
    + list((ROOT / "docs").rglob("*.md"))
)
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w-]*)")


def runnable_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the fence, language, code) of each fenced block that follows a
    runnable marker; fences nested inside another block (an example of the marker) are
    code, not blocks."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        marked = start > 0 and lines[start - 1].strip() == MARKER
        i += 1
        while i < len(lines) and not (
            lines[i].startswith(fence[0] * len(fence)) and not lines[i].strip(fence[0]).strip()
        ):
            i += 1
        if marked:
            blocks.append((start + 1, lang, "\n".join(lines[start + 1 : i]) + "\n"))
        i += 1
    return blocks


def _all_blocks() -> list[tuple[str, int, str, str]]:
    return [
        (str(path.relative_to(ROOT)), line, lang, code)
        for path in SOURCES
        for line, lang, code in runnable_blocks(path.read_text(encoding="utf-8"))
    ]


BLOCKS = _all_blocks()


def test_the_marker_parser_by_hand():
    text = (
        "text\n<!-- runnable -->\n```python\nprint(1)\n```\n\n```bash\nnot marked\n```\n"
        "````markdown\n<!-- runnable -->\n```python\ninside an example\n```\n````\n"
        "<!-- runnable -->\n```bash\necho 2\n```\n"
    )
    assert runnable_blocks(text) == [(3, "python", "print(1)\n"), (17, "bash", "echo 2\n")]


def test_site_builds_without_warnings(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    # the home page is README.md with its docs/ links pointed at the pages
    home = (site / "index.html").read_text(encoding="utf-8")
    assert (
        "The two commands" in home
        and 'href="install/"' in home
        and "docs/" not in re.sub(r"<code>[^<]*</code>", "", home)
    )
    # the pages included where they live
    assert "jaxpaged.v1.Admin" in (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "Offline throughput" in (site / "benchmarks" / "index.html").read_text("utf-8")


def test_the_docs_mark_runnable_blocks():
    assert len(BLOCKS) >= 5, BLOCKS
    assert {lang for _, _, lang, _ in BLOCKS} == {"python", "bash"}


@pytest.mark.parametrize("source,line,lang,code", BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_runnable_block_runs(source, line, lang, code, tmp_path):
    """Each block alone, in a fresh process in an empty folder, within a minute."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (
        f"{source}:{line} ({lang})\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )
