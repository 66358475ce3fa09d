"""The command line of a benchmark that writes one JSON report: its parser with the flags such benchmarks share
(--quick, --out), progress lines on standard error, and the report written where --out says."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def report_parser(module: str, doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A parser for `python -m module`, described by the first line of its `doc`, with --quick and --out."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, help="write the results as JSON here (default: standard output)")
    return parser


def progress(line: str) -> None:
    """A progress line on standard error, so standard output holds only the report."""
    print(line, file=sys.stderr, flush=True)


def write_report(report: dict, module: str, argv: list[str] | None, out: Path | None) -> None:
    """The report with the command that made it, as JSON in `out` (or on standard output)."""
    report["command"] = f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(report, indent=1, default=str)
    if out:
        out.write_text(text + "\n")
    else:
        print(text)
