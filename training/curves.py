"""`rnnserve curves`: the training curves that `rnnserve train` stores, drawn to one PNG.

`rnnserve train` keeps a point every 50 steps (step, examples seen, wall time,
moving-average training loss) in its checkpoint, so the curve survives stops and
resumes, and writes the whole curve into the model file's metadata at the end.
This command reads either kind of file, plots training loss against examples
seen (bits/dim for MNIST, nats/byte for text), one panel per file, with the
runs its weights came from before it (info["lineage"], training/lineage.py)
drawn first, marks each run's held-out result, and prints how much the file's
own run still moved over its last quarter: a curve is flat when that change is
small against the gap to a target.
The flags are defined in training/arguments.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open

from model.io.weights import WeightsError, read_metadata

from .checkpoint import METADATA_KEY

UNITS = {"mnist": "bits/dim", "text": "nats/byte"}
SCALE = {"mnist": 1 / math.log(2), "text": 1.0}  # training losses are stored in nats


class CurveError(ValueError):
    """A file without a curve, or files of different tasks."""


@dataclass(frozen=True)
class Curve:
    """A file's training curve, its earlier runs (info["lineage"]) first: examples and hours count all of them."""

    label: str
    task: str
    examples: list[int]  # seen by the end of each point, counting the earlier runs'
    loss: list[float]  # in UNITS[task]
    hours: float  # wall time of every run
    held_out: float | None  # the model file's evaluation, in UNITS[task]; None for a checkpoint
    run_ends: list[tuple[int, float | None]] = field(default_factory=list)  # each earlier run: examples, held-out
    own_start: int = 0  # index of the file's own run's first point

    def last_quarter_change(self) -> float:
        """The file's own run: loss at its end minus loss a quarter of its examples earlier (negative: still falling)."""
        xs, ys = self.examples[self.own_start :], self.loss[self.own_start :]
        start = self.run_ends[-1][0] if self.run_ends else 0
        cut = xs[-1] - 0.25 * (xs[-1] - start)
        earlier = min(range(len(xs)), key=lambda i: abs(xs[i] - cut))
        return ys[-1] - ys[earlier]


def read_curve(path: str) -> Curve:
    """The curve of a model file (its lineage, then info["curve"]) or of a checkpoint (its progress)."""
    if not Path(path).is_file():
        raise CurveError(f"{path}: no such file; expected a model .safetensors or a training checkpoint .ckpt")
    try:
        with safe_open(path, framework="pt") as f:
            header = (f.metadata() or {}).get(METADATA_KEY)
    except (SafetensorError, OSError) as exc:
        raise CurveError(f"{path}: not a safetensors file ({exc}); expected a model .safetensors or a .ckpt") from exc
    if header is not None:
        checkpoint = json.loads(header)
        progress = checkpoint["progress"]
        return _curve(path, checkpoint["config"]["task"], progress.get("curve", []), None, progress.get("lineage", []))
    try:
        config, info = read_metadata(path)
    except WeightsError as exc:
        raise CurveError(str(exc)) from exc
    evaluation = info.get("eval", {})
    held_out = evaluation.get("bits_per_dim", evaluation.get("loss_nats_per_byte"))
    return _curve(path, config.task, info.get("curve", {}).get("points", []), held_out, info.get("lineage", []))


def _curve(path: str, task: str, points: list[list[float]], held_out: float | None, lineage: list[dict]) -> Curve:
    if not points:
        raise CurveError(
            f"{path}: no training curve stored; `rnnserve train` records one (a point every 50 steps "
            "and the last step) since curves were introduced, so older files and checkpoints have none"
        )
    scale = SCALE[task]
    examples, loss, run_ends, done, seconds = [], [], [], 0, 0.0  # done: examples of the runs so far
    for run in lineage:  # oldest first; a run from before curves has none, but its examples and time still count
        examples += [done + int(p[1]) for p in run["points"]]
        loss += [p[3] * scale for p in run["points"]]
        done += int(run["examples_seen"])
        run_ends.append((done, run.get("held_out")))
        seconds += float(run["wall_time_s"])
    own_start = len(examples)
    examples += [done + int(p[1]) for p in points]
    loss += [p[3] * scale for p in points]
    return Curve(
        label=Path(path).name,
        task=task,
        examples=examples,
        loss=loss,
        hours=(seconds + points[-1][2]) / 3600,
        held_out=held_out,
        run_ends=run_ends,
        own_start=own_start,
    )


def draw(curves: list[Curve], out: str, targets: list[float], title: str | None) -> None:
    """One panel per file, so that each history gets the whole width."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    task = curves[0].task
    fig, axes = plt.subplots(len(curves), 1, figsize=(8, 1.0 + 2.6 * len(curves)), squeeze=False)
    for ax, curve in zip(axes[:, 0], curves):
        _draw_one(ax, curve, targets)
    axes[-1, 0].set_xlabel("examples seen, all runs")
    fig.suptitle(title or f"{task}: training curves (training loss, moving average over ~50 steps; stars: held-out)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _draw_one(ax, curve: Curve, targets: list[float]) -> None:
    (line,) = ax.plot(curve.examples, curve.loss, ".-" if len(curve.loss) < 20 else "-", linewidth=1, label="training")
    stars = [(x, held) for x, held in curve.run_ends if held is not None]
    for x, _ in curve.run_ends:
        ax.axvline(x, linestyle=":", color="grey", linewidth=0.8)
    if curve.held_out is not None:
        stars.append((curve.examples[-1], curve.held_out))
    if stars:
        ax.plot(*zip(*stars), "*", markersize=9, color=line.get_color(), label="held-out at each run's end")
    for target in targets:
        ax.axhline(target, linestyle="--", color="grey", linewidth=1)
        ax.annotate(
            f"target {target:g}", (0, target), xycoords=("axes fraction", "data"), fontsize=7, va="bottom", color="grey"
        )
    shown = curve.loss[len(curve.loss) // 20 :] + [held for _, held in stars] + targets  # the first steps fall far
    ax.set_ylim(min(shown) - 0.02, max(shown) + 0.02)
    runs = len(curve.run_ends) + 1
    ax.set_title(
        f"{curve.label}: {runs} run{'s' if runs > 1 else ''}, {curve.examples[-1]:,} examples, {curve.hours:.1f} h",
        fontsize=9,
    )
    ax.set_ylabel(UNITS[curve.task], fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def summary_line(curve: Curve, targets: list[float]) -> str:
    unit = UNITS[curve.task]
    line = (
        f"{curve.label}: {curve.examples[-1]:,} examples, {curve.hours:.2f} h, training loss {curve.loss[-1]:.3f} "
        f"{unit}, last quarter {curve.last_quarter_change():+.3f}"
    )
    if curve.run_ends:
        line += f" (its own run, after {len(curve.run_ends)} earlier)"
    if curve.held_out is not None:
        line += f", held-out {curve.held_out:.3f}"
        if targets:
            line += " (" + ", ".join(f"{curve.held_out - t:+.3f} from the target {t:g}" for t in targets) + ")"
    earlier = [f"{held:.3f}" if held is not None else "-" for _, held in curve.run_ends]
    if earlier:
        line += f"; held-out at the earlier runs' ends: {', '.join(earlier)}"
    return line


def run(args: argparse.Namespace) -> int:
    try:
        curves = [read_curve(path) for path in args.files]
        tasks = {c.task for c in curves}
        if len(tasks) > 1:
            raise CurveError(
                f"the files are of different tasks ({', '.join(sorted(tasks))}); "
                "draw one task per picture, its losses share a unit"
            )
    except CurveError as exc:
        print(f"rnnserve curves: error: {exc}", file=sys.stderr)
        return 2
    targets = args.target or []
    draw(curves, args.out, targets, args.title)
    for curve in curves:
        print(summary_line(curve, targets))
    print(f"wrote {args.out}")
    return 0
