"""Every relative link in the repository's Markdown files reaches a file, and every #anchor a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs_support import ROOT, anchors, markdown_files

LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(path: Path) -> list[str]:
    broken = []
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []
