"""A model file's earlier runs, so that its training curve covers its whole history.

A run started from another file's weights (`rnnserve train --init-from FILE`) stores in
its info["lineage"] the runs that made FILE, oldest first: FILE's own lineage, then
FILE's run. They are read when the run starts and kept in its checkpoint, so a resume
keeps them even after FILE has been replaced (a continued run's command often names
the file it ships to). Each entry keeps that run's curve points, wall time, examples seen and
held-out result, so `rnnserve curves` can draw the runs end to end, with the hours
and examples of all of them, from the one file a user has.
"""

from __future__ import annotations

from typing import Any

from model.io.weights import read_metadata


def run_record(info: dict[str, Any]) -> dict[str, Any]:
    """One finished run, as a later run's lineage keeps it."""
    evaluation = info.get("eval") or {}
    return {
        "command": info.get("command"),
        "examples_seen": info.get("examples_seen", 0),
        "wall_time_s": info.get("wall_time_s", 0.0),
        "held_out": evaluation.get("bits_per_dim", evaluation.get("loss_nats_per_byte")),
        "points": (info.get("curve") or {}).get("points", []),
    }


def inherited_lineage(init_from: str | None) -> list[dict[str, Any]]:
    """The runs behind the --init-from file, oldest first, its own run last ([] without one).
    Called when a run starts, after the file's weights have loaded (so it is a readable model file)."""
    if not init_from:
        return []
    _, info = read_metadata(init_from)
    return list(info.get("lineage", [])) + [run_record(info)]
