"""What the docs tests share: the repository's text files, and the headings and anchors of a Markdown file."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {".venv", "node_modules", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist"}


def repository_files(suffixes: set[str], names: frozenset[str] = frozenset()) -> list[Path]:
    """Files under the repository with one of these suffixes or names, outside virtual environments and caches."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED and not d.endswith(".egg-info")]
        found += [Path(folder) / f for f in files if Path(f).suffix in suffixes or f in names]
    return sorted(found)


def markdown_files() -> list[Path]:
    return repository_files({".md"})


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The text of every heading of a Markdown file, outside fenced code, in order."""
    found, in_code = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: a repeated heading's gets -1, -2, ..."""
    found, seen = set(), {}
    for heading in headings(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found
