"""The particle grid's table: one row per kind and occlusion, one column per particle count.

Reads the cells `benchmarks/particle_grid.sh` wrote (benchmarks/results/particles/KIND-OCCLUSION-pK.json,
each the JSON of one `rnnserve eval --completions --particles K`) and prints a Markdown table of the
share of completions the project's classifier reads as the true digit, with the digit count of each cell,
beside the occluded input alone; then images/s and mean resamplings per digit.
Run: `.venv/bin/python -m benchmarks.particle_table [FOLDER]`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from model.attention.kinds import attention_kinds

OCCLUSIONS = ("right-half", "centre-box")
PARTICLES = (1, 4, 16, 64)
CELL_NAME = re.compile(r"(?P<kind>[a-z0-9_]+)-(?P<occlusion>right-half|centre-box)-p(?P<k>\d+)\.json")


def read_cells(folder: Path) -> dict[tuple[str, str, int], dict]:
    """(kind, occlusion, particles) -> the eval's result for that cell, for every cell file in `folder`."""
    cells = {}
    for path in folder.glob("*.json"):
        name = CELL_NAME.fullmatch(path.name)
        if name:
            (result,) = json.loads(path.read_text()).values()
            cells[name["kind"], name["occlusion"], int(name["k"])] = result
    return cells


def _share(cell: dict | None) -> str:
    if cell is None:
        return "-"
    return f"{100 * cell['read_as_true_completed']:.0f}% ({cell['digits']})"


def _rate(cell: dict | None) -> str:
    return "-" if cell is None else f"{cell['images_per_s']:.3g}"


def _resamplings(cell: dict | None) -> str:
    return "-" if cell is None else f"{cell['mean_resamplings']:.1f}"


def _occluded(cells: dict, kind: str, occlusion: str) -> str:
    """The occluded input alone, read once per digit set: from the cell with the most digits."""
    row = [cell for (k, o, _p), cell in cells.items() if (k, o) == (kind, occlusion)]
    if not row:
        return "-"
    widest = max(row, key=lambda cell: cell["digits"])
    return f"{100 * widest['read_as_true_occluded']:.0f}% ({widest['digits']})"


def tables(cells: dict) -> str:
    """Two Markdown tables: shares read as the true digit; images/s and resamplings per digit."""
    head = " | ".join(f"K = {k}" for k in PARTICLES)
    quality = [f"| kind | unknown | occluded input alone | {head} |", "|---|---|---:|" + "---:|" * len(PARTICLES)]
    speed = [
        "| kind | unknown | "
        + " | ".join(f"images/s, K = {k}" for k in PARTICLES)
        + " | "
        + " | ".join(f"resamplings per digit, K = {k}" for k in PARTICLES)
        + " |",
        "|---|---|" + "---:|" * (2 * len(PARTICLES)),
    ]
    for kind in attention_kinds():
        for occlusion in OCCLUSIONS:
            row = [cells.get((kind, occlusion, k)) for k in PARTICLES]
            if not any(row):
                continue
            quality.append(
                f"| {kind} | {occlusion} | {_occluded(cells, kind, occlusion)} | "
                + " | ".join(_share(c) for c in row)
                + " |"
            )
            speed.append(
                f"| {kind} | {occlusion} | "
                + " | ".join(_rate(c) for c in row)
                + " | "
                + " | ".join(_resamplings(c) for c in row)
                + " |"
            )
    return "\n".join(quality) + "\n\n" + "\n".join(speed)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "benchmarks/results/particles")
    print(tables(read_cells(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
