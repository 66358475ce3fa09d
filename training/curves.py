"""`rnnserve curves`: the training curves that `rnnserve train` stores, drawn to one PNG.

`rnnserve train` keeps a point every 50 steps (step, examples seen, wall time,
moving-average training loss) in its checkpoint, so the curve survives stops and
resumes, and writes the whole curve into the model file's metadata at the end.
This command reads either kind of file, plots training loss against examples
seen (bits/dim for MNIST, nats/byte for text), marks each finished model's
held-out result, and prints how much each curve still moved over its last
quarter: a curve is flat when that change is small against the gap to a target.
The flags are defined in training/arguments.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from model.weights_io import WeightsError, read_metadata

from .checkpoint import METADATA_KEY

UNITS = {"mnist": "bits/dim", "text": "nats/byte"}
SCALE = {"mnist": 1 / math.log(2), "text": 1.0}  # training losses are stored in nats


class CurveError(ValueError):
    """A file without a curve, or files of different tasks."""


@dataclass(frozen=True)
class Curve:
    label: str
    task: str
    examples: list[int]
    loss: list[float]  # in UNITS[task]
    hours: float
    held_out: float | None  # the model file's evaluation, in UNITS[task]; None for a checkpoint

    def last_quarter_change(self) -> float:
        """Loss at the end minus loss a quarter of the examples earlier (negative: still falling)."""
        cut = self.examples[-1] * 0.75
        earlier = min(range(len(self.examples)), key=lambda i: abs(self.examples[i] - cut))
        return self.loss[-1] - self.loss[earlier]


def read_curve(path: str) -> Curve:
    """The curve of a model file (info["curve"]) or of a checkpoint (its progress)."""
    if not Path(path).is_file():
        raise CurveError(f"{path}: no such file; expected a model .safetensors or a training checkpoint .ckpt")
    try:
        with safe_open(path, framework="pt") as f:
            header = (f.metadata() or {}).get(METADATA_KEY)
    except (SafetensorError, OSError) as exc:
        raise CurveError(f"{path}: not a safetensors file ({exc}); expected a model .safetensors or a .ckpt") from exc
    if header is not None:
        checkpoint = json.loads(header)
        return _curve(path, checkpoint["config"]["task"], checkpoint["progress"].get("curve", []), None)
    try:
        config, info = read_metadata(path)
    except WeightsError as exc:
        raise CurveError(str(exc)) from exc
    evaluation = info.get("eval", {})
    held_out = evaluation.get("bits_per_dim", evaluation.get("loss_nats_per_byte"))
    return _curve(path, config.task, info.get("curve", {}).get("points", []), held_out)


def _curve(path: str, task: str, points: list[list[float]], held_out: float | None) -> Curve:
    if not points:
        raise CurveError(f"{path}: no training curve stored; `rnnserve train` records one (a point every 50 steps "
                         "and the last step) since curves were introduced, so older files and checkpoints have none")
    scale = SCALE[task]
    return Curve(label=Path(path).name, task=task, examples=[int(p[1]) for p in points],
                 loss=[p[3] * scale for p in points], hours=points[-1][2] / 3600, held_out=held_out)


def draw(curves: list[Curve], out: str, target: float | None, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    task = curves[0].task
    fig, ax = plt.subplots(figsize=(8, 5))
    for curve in curves:
        line, = ax.plot(curve.examples, curve.loss, ".-" if len(curve.loss) < 20 else "-", label=f"{curve.label} (training, {curve.hours:.1f} h)")
        if curve.held_out is not None:
            ax.plot([curve.examples[-1]], [curve.held_out], "*", markersize=12, color=line.get_color(),
                    label=f"{curve.label}: held-out {curve.held_out:.3f}")
    if target is not None:
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target:g}")
    ax.set_xlabel("examples seen")
    ax.set_ylabel(f"training loss, {UNITS[task]} (moving average over ~50 steps)")
    ax.set_title(title or f"{task}: training curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def summary_line(curve: Curve, target: float | None) -> str:
    unit = UNITS[curve.task]
    line = (f"{curve.label}: {curve.examples[-1]:,} examples, {curve.hours:.2f} h, training loss {curve.loss[-1]:.3f} "
            f"{unit}, last quarter {curve.last_quarter_change():+.3f}")
    if curve.held_out is not None:
        line += f", held-out {curve.held_out:.3f}"
        if target is not None:
            line += f" ({curve.held_out - target:+.3f} from the target {target:g})"
    return line


def run(args: argparse.Namespace) -> int:
    try:
        curves = [read_curve(path) for path in args.files]
        tasks = {c.task for c in curves}
        if len(tasks) > 1:
            raise CurveError(f"the files are of different tasks ({', '.join(sorted(tasks))}); "
                             "draw one task per picture, its losses share a unit")
    except CurveError as exc:
        print(f"rnnserve curves: error: {exc}", file=sys.stderr)
        return 2
    draw(curves, args.out, args.target, args.title)
    for curve in curves:
        print(summary_line(curve, args.target))
    print(f"wrote {args.out}")
    return 0
