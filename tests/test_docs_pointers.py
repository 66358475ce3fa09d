"""Every pointer into the docs from code and docs resolves: files, sections and #anchors.

tests/test_docs_links.py checks Markdown links. This checks the pointers written as plain text, which nothing else
follows when a page is restructured:
- `FILE.md, "Heading"` (also `FILE.md "Heading"`, `FILE.md, section "Heading"`): the file exists and has a heading
  that is, or begins with, the quoted text (case and backticks aside);
- `FILE.md#anchor` outside a Markdown link: the file exists and has a heading with GitHub's anchor;
- a path under a top-level folder of the repository (`server/engine/core.py`, `docs/api.md`) in code: it exists.
A pointer may wrap over lines of a comment or docstring. Files are named from the repository's root, or from the
file that names them.
"""

from __future__ import annotations

import re
from pathlib import Path

from docs_support import ROOT, anchors, headings, repository_files

CODE_SUFFIXES = {".py", ".cpp", ".h", ".js", ".sh"}
CODE_NAMES = frozenset({"Makefile", "Dockerfile"})
SECTION = re.compile(r"""([\w./-]+\.md)[)`]*,?\s+\(?(?:section\s+)?"([^"]{2,160})\"""")
ANCHOR = re.compile(r"(?<!\]\()(?<![\w./-])([\w./-]+\.md)#([\w-]+)")
SOURCE_SUFFIXES = r"py|cpp|h|js|sh|md"
MOST_LINES = {"README.md": 200, "benchmarks/README.md": 300, "HISTORY.md": 300}  # pages a user reads first


def unwrapped(text: str) -> str:
    """Lines joined with their comment markers dropped, so that a pointer wrapped over comment lines reads whole."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#+|//+|\*)?[ \t]*", " ", text)


def resolved(name: str, source: Path, root: Path) -> Path | None:
    for candidate in (root / name, source.parent / name):
        if candidate.is_file():
            return candidate
    return None


def normalised(heading: str) -> str:
    return " ".join(heading.replace("`", "").replace("\\", "").lower().split())


def names_a_heading(quoted: str, path: Path) -> bool:
    """The quoted text is a heading of the file, or the start of one up to a word's end ("Row classes")."""
    wanted = normalised(quoted)
    for heading in map(normalised, headings(path)):
        if heading == wanted or (heading.startswith(wanted) and not heading[len(wanted)].isalnum()):
            return True
    return False


def path_pattern(root: Path) -> re.Pattern:
    """Paths under the repository's top-level folders, ending in a source or docs suffix."""
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    folders = [f for f in folders if f not in {"build", "dist", "node_modules"} and not f.endswith(".egg-info")]
    return re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, folders))})/[\w/.-]*\.(?:{SOURCE_SUFFIXES}))\b")


def broken_pointers(path: Path, root: Path = ROOT) -> list[str]:
    text, where = unwrapped(path.read_text(errors="replace")), path.relative_to(root)
    broken = []
    for name, quoted in SECTION.findall(text):
        target = resolved(name, path, root)
        if target is None:
            broken.append(f'{where}: {name}, "{quoted}": no such file')
        elif not names_a_heading(quoted, target):
            broken.append(f'{where}: {name}, "{quoted}": no such heading')
    for name, anchor in ANCHOR.findall(text):
        target = resolved(name, path, root)
        if target is None:
            broken.append(f"{where}: {name}#{anchor}: no such file")
        elif anchor not in anchors(target):
            broken.append(f"{where}: {name}#{anchor}: no heading with that anchor")
    broken += [f"{where}: {p}: no such file" for p in path_pattern(root).findall(text) if not resolved(p, path, root)]
    return broken


def code_files() -> list[Path]:
    """Every source file but this one, whose broken pointers are its examples."""
    return [p for p in repository_files(CODE_SUFFIXES, CODE_NAMES) if p != Path(__file__).resolve()]


def test_every_pointer_in_code_resolves():
    files = code_files()
    assert ROOT / "server" / "app.py" in files and ROOT / "Makefile" in files
    assert [b for path in files for b in broken_pointers(path)] == []


def test_every_pointer_in_the_docs_resolves():
    files = repository_files({".md"})
    assert ROOT / "docs" / "benchmarks.md" in files
    assert [b for path in files for b in broken_pointers(path)] == []


def test_a_pointer_to_a_missing_heading_file_or_anchor_is_found(tmp_path):
    for page in ("docs/benchmarks.md", "docs/operations.md", "benchmarks/results/NOTES.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text())
    (tmp_path / "server" / "engine").mkdir(parents=True)
    module = tmp_path / "server" / "engine" / "module.py"
    module.write_text(
        '# see docs/benchmarks.md, "Which table\n'
        '# is yours"\n'  # wraps over two comment lines; bold text in the page, not a heading
        '"""docs/operations.md, section "Engine workers" and docs/operations.md#engine-workers resolve;\n'
        "docs/operations.md#no-such-anchor, docs/no-such-page.md#x and server/engine/particles.py do not.\n"
        'benchmarks/results/NOTES.md, "Row classes" names a heading by its start."""\n'
    )
    assert [b.split(": ", 1)[1] for b in broken_pointers(module, root=tmp_path)] == [
        'docs/benchmarks.md, "Which table is yours": no such heading',
        "docs/operations.md#no-such-anchor: no heading with that anchor",
        "docs/no-such-page.md#x: no such file",
        "docs/no-such-page.md: no such file",
        "server/engine/particles.py: no such file",
    ]


def test_the_front_pages_stay_short():
    lengths = {name: len((ROOT / name).read_text().splitlines()) for name in MOST_LINES}
    assert {name: n for name, n in lengths.items() if n > MOST_LINES[name]} == {}, MOST_LINES
