"""How many particles an image completion runs, and how the answer reports them.

Pixels are generated in raster order. When every known pixel comes before
every unknown one (bottom half unknown), conditioning on the prompt is
exact and one particle is enough. When a known pixel follows an unknown one
(right half, centre box, any mask), sequential Monte Carlo weighs each
particle by the known pixels it meets (model/decode/particles.py); the server then
defaults to DEFAULT_PARTICLES per sample, fewer when n x particles would
exceed the slots a model has (--max-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from server.api.errors import invalid_request
from server.api.imaging import OccludedImage
from model.decode.particles import log_mean_exp
from server.engine.types import ParticleSummary

DEFAULT_PARTICLES = 16
MAX_PARTICLES = 256
PREFIX_ONLY = (
    "every known pixel comes before the first unknown one, so the prompt conditions exactly and one particle is used"
)
NOTHING_KNOWN = "no pixel is known, so the completion is an unconditional sample and one particle is used"


@dataclass(frozen=True)
class ParticlePlan:
    count: int  # particles per sample
    note: str | None = None  # why the count differs from what was asked, when it does


def plan_particles(
    asked: int | None, occluded: OccludedImage, n: int, max_batch: int, temperature: float
) -> ParticlePlan:
    """The particles per sample for this image; a 400 when the ask cannot be met."""
    weighed = bool(occluded.forced())
    if asked is not None and asked > 1:
        _check_asked(asked, occluded, temperature)  # n x particles against --max-batch: validation.py
        return ParticlePlan(asked) if weighed else ParticlePlan(1, PREFIX_ONLY)
    if asked is None and weighed and temperature > 0:
        return ParticlePlan(max(1, min(DEFAULT_PARTICLES, max_batch // n)))
    if weighed:
        return ParticlePlan(1)
    return ParticlePlan(1, NOTHING_KNOWN if occluded.unknown.all() else PREFIX_ONLY)


def _check_asked(asked: int, occluded: OccludedImage, temperature: float) -> None:
    if occluded.unknown.all():
        raise invalid_request(
            f"particles={asked} needs known pixels to weigh completions by, and the mask marks "
            "every pixel unknown; leave particles out or keep some pixels",
            "particles",
        )
    if temperature == 0:
        raise invalid_request(
            f"particles={asked} needs temperature > 0: greedy decoding gives every particle the same pixels",
            "particles",
        )


def entry_report(summary: ParticleSummary | None) -> dict[str, Any]:
    """One completion's particle figures, for its entry in the answer."""
    if summary is None:
        return {}
    return {
        "particles": {
            "resamplings": summary.resamplings,
            "effective_sample_size": summary.effective_sample_size,
            "known_log_likelihood": _finite(summary.known_log_likelihood),
        }
    }


def usage_report(plan: ParticlePlan, summaries: list[ParticleSummary]) -> dict[str, Any]:
    """The request's particle figures: resamplings over all samples, the lowest final effective sample
    size, and log p(known pixels) in nats (the samples' estimates averaged in probability)."""
    report: dict[str, Any] = {"per_sample": plan.count}
    if summaries:
        report["resamplings"] = sum(s.resamplings for s in summaries)
        report["effective_sample_size"] = min(s.effective_sample_size for s in summaries)
        report["known_log_likelihood"] = _finite(log_mean_exp([s.known_log_likelihood for s in summaries]))
    if plan.note:
        report["note"] = plan.note
    return {"particles": report}


def _finite(value: float) -> float | None:
    """JSON has no infinity: None when the known pixels had probability 0 (top-k/top-p excluded them)."""
    return round(value, 4) if math.isfinite(value) else None
