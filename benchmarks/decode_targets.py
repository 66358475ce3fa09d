"""The issues' CPU targets, computed from one run of the decoding benchmark only (ratios measured side by side)."""

from __future__ import annotations

from .decode_positions import FLAT_NEAR
from .decode_report import DecodeReport

BATCH1_LINEAR_STEP_BEFORE = (
    1.03e-3  # seconds: linear's eager step at position 100, batch 1, which the batch-1 target was set against
)


def evaluate_targets(report: DecodeReport) -> list[dict]:
    """The issues' CPU targets, computed from this run only (ratios measured side by side)."""
    return _issue5_targets(report) + _issue16_targets(report)


def _issue5_targets(report: DecodeReport) -> list[dict]:
    targets = []
    largest = max((r.batch for r in report.images), default=None)
    linear = next((r for r in report.images if r.kind == "linear" and r.batch == largest), None)
    if linear is not None:
        targets.append(
            _target(f"linear images/s >= 4x softmax-with-cache (batch {largest})", linear.vs_softmax_cache, 4.0)
        )
        targets.append(
            _target(
                f"same, by CPU time: steadier on a shared machine (batch {largest})", linear.vs_softmax_cache_cpu, 4.0
            )
        )
        targets.append(
            _target(
                f"linear images/s >= 100x softmax no-cache, extrapolated (batch {largest})", linear.vs_no_cache, 100.0
            )
        )
    flat = next((f for f in report.flatness if f.kind == "linear"), None)
    if flat is not None:
        targets.append(
            {
                "name": f"linear step time at {flat.far} within 10% of at {flat.near} (alternating steps)",
                "measured": flat.ratio,
                "threshold": "<= 1.10",
                "met": flat.ratio <= 1.10,
            }
        )
    points = report.positions.get("linear", [])
    if len(points) >= 2:
        sizes = {p.state_bytes_per_sequence for p in points}
        targets.append(
            {
                "name": "linear state bytes identical at every position",
                "measured": sorted(sizes),
                "threshold": "one value",
                "met": len(sizes) == 1,
            }
        )
    return targets


def _issue16_targets(report: DecodeReport) -> list[dict]:
    largest = max((r.batch for r in report.images), default=None)
    # Like for like where the peer ran in rnnserve's layout too: those comparisons come last and win.
    ordered = sorted(
        (c for c in report.comparisons if c["batch"] == largest),
        key=lambda c: c.get("rnnserve_layout") == c.get("against_layout"),
    )
    chosen = {(c["rnnserve"], c["against"]): c for c in ordered}
    targets = []
    for kind, against, minimum in (
        ("linear", "peer: fast-transformers recurrent linear", 2.0),
        ("linear", "peer: plain PyTorch linear recurrence, in place", 3.0),
        ("softmax", "peer: HF GPT-2 generate, static cache", 2.0),
        ("linformer", "linformer (eager)", 1.5),
    ):
        if (c := chosen.get((kind, against))) is not None:
            name = f"{kind} images/s >= {minimum:g}x {against} (batch {largest}{_layouts_clause(c)})"
            targets.append(_target(name, c["ratio"], minimum))
    linear = next((r for r in report.images if r.kind == "linear" and r.batch == largest), None)
    bound = report.roofline.get("linear", {}).get("bound_images_per_s_here")
    if linear is not None and bound:
        targets.append(
            _target(
                f"linear images/s >= 50% of its bound on this machine (batch {largest})",
                linear.images_per_s / bound,
                0.5,
            )
        )
    points = report.positions.get("linear", [])
    if points:
        near = min(points, key=lambda p: abs(p.position - FLAT_NEAR))
        targets.append(
            {
                "name": f"linear ms per step at position {near.position}, batch {report.settings['position_batch']}"
                f" (best step): <= half of {BATCH1_LINEAR_STEP_BEFORE * 1e3:.2f} ms",
                "measured": near.step_seconds_min * 1e3,
                "threshold": f"<= {BATCH1_LINEAR_STEP_BEFORE * 500:.3f}",
                "met": near.step_seconds_min <= BATCH1_LINEAR_STEP_BEFORE / 2,
            }
        )
    return targets


def _layouts_clause(comparison: dict) -> str:
    ours, theirs = comparison.get("rnnserve_layout", "in-process"), comparison.get("against_layout", "in-process")
    if ours == theirs == "in-process":
        return ""
    return f"; both {ours}" if ours == theirs else f"; rnnserve {ours}, against {theirs}"


def _target(name: str, measured: float | None, minimum: float) -> dict:
    return {
        "name": name,
        "measured": measured,
        "threshold": f">= {minimum:g}",
        "met": measured is not None and measured >= minimum,
    }
