"""In-process decoding benchmark: every attention kind on one architecture.

Three measurements, all under torch.inference_mode and with no HTTP (run
in the reverse of this order, lightest first):
  * images/s for whole MNIST generations (784 tokens from BOS) at several
    batch sizes, through model.decode.generate.generate;
  * the paper's baseline: softmax with no cache, re-running the whole prefix
    at every step. It is measured for the first pixels only and at a few
    sampled later positions, then summed over all positions by linear
    interpolation: an extrapolation, and labelled as one;
  * time of one decoding step and decode-state bytes per sequence against
    position, on a text-shaped copy of the architecture (sinusoidal
    positions, max_len past --max-position) whose state is advanced by
    chunked prefills of random tokens; for the constant-state kinds, also
    steps timed in alternation on two states, near position 100 and 16,000
    (the flatness figure the targets use).

Times are wall-clock seconds from time.perf_counter; on CUDA every timed
region ends with a synchronize. Each timed quantity keeps its minimum over
repeats (the least-disturbed run on a shared machine) and, where there are
several samples, the median as well.

This module runs them in that order and gathers the report; each job is a module of its own: the settings
(benchmarks/decode_settings.py), the models (benchmarks/decode_models.py), the three measurements
(benchmarks/decode_images.py, benchmarks/decode_no_cache.py, benchmarks/decode_positions.py), timing
(benchmarks/decode_timing.py), the machine (benchmarks/decode_environment.py), the report
(benchmarks/decode_report.py) and the targets it is judged by (benchmarks/decode_targets.py).
"""

from __future__ import annotations

from dataclasses import asdict

from model.attention.kinds import attention_kinds
from model.transformer import Transformer

from .decode_environment import environment, machine_load, one_call_kinds
from .decode_images import ImageResult, compare, measure_images
from .decode_models import cached_number_bytes, image_models, position_model, preset_config
from .decode_no_cache import NoCacheResult, measure_no_cache
from .decode_positions import (
    FLAT_FAR,
    FLAT_NEAR,
    FLAT_ROUNDS,
    FLAT_STEPS_PER_ROUND,
    choose_positions,
    closest,
    measure_flatness,
    measure_positions,
)
from .decode_report import DecodeReport, ModelInfo
from .decode_settings import DTYPES, IMAGE_TOKENS, DecodeSettings
from .decode_targets import evaluate_targets
from .errors import BenchError
from .roofline import probe_machine, roofline


def run_decode_bench(settings: DecodeSettings, progress=print) -> DecodeReport:
    _check(settings)
    load_before = machine_load()
    models = image_models(settings)
    kinds = [k for k in settings.kinds if k in models]
    infos = {k: _model_info(k, m, src, settings.image_tokens) for k, (m, src) in models.items()}
    peers = _build_peers(settings) if settings.peers else []
    sweep, flatness = _measure_steps(models, kinds, settings, progress)
    images, compile_seconds = measure_images({k: models[k][0] for k in kinds}, settings, progress, peers)
    no_cache = _measure_no_cache(models, settings, progress)
    _add_ratios(images, no_cache)
    report = DecodeReport(asdict(settings), environment(settings), infos, images, no_cache, sweep, flatness)
    report.compile_seconds, report.comparisons = compile_seconds, compare(images)
    report.environment["one_call_steps"] = one_call_kinds({k: models[k][0] for k in kinds}, settings)
    report.peers = [asdict(p.spec) for p in peers]
    report.machine = (
        probe_machine(DTYPES[settings.dtype]) if settings.device == "cpu" else {}
    )  # a GPU is judged by its datasheet
    batch = max(settings.batch_sizes)
    report.roofline = {
        k: roofline(
            models[k][0].config, settings.image_tokens, batch, report.machine, cached_number_bytes(models[k][0])
        )
        for k in kinds
    }
    report.load = {"before": load_before, "after": machine_load()}
    report.targets = evaluate_targets(report)
    return report


def _measure_steps(models: dict, kinds: list[str], settings: DecodeSettings, progress):
    """Step time against position, and flatness: lightest first (right after the large batch-64
    allocations, single-token steps ran slower for a while: benchmarks/results/NOTES.md, "Measurements
    behind design choices")."""
    positions = list(settings.positions) or choose_positions(settings.max_position)
    max_len = max(positions) + max(settings.steps_per_position, FLAT_ROUNDS * FLAT_STEPS_PER_ROUND) + 1
    text_models = {kind: position_model(models[kind][0], max_len, settings.seed) for kind in kinds}
    sweep = measure_positions(text_models, positions, settings, progress)
    near, far = closest(positions, FLAT_NEAR), closest(positions, FLAT_FAR)
    flatness = measure_flatness(text_models, near, far, settings, progress) if near < far else []
    return sweep, flatness  # the text models go: their caches reach tens of MB per kind


def _measure_no_cache(models: dict, settings: DecodeSettings, progress) -> list[NoCacheResult]:
    if "softmax" not in models:
        return []
    results = []
    for batch in settings.batch_sizes:
        results.append(measure_no_cache(models["softmax"][0], batch, settings))
        progress(f"no-cache softmax   batch {batch:4d}: {results[-1].images_per_s:10.4f} images/s (extrapolated)")
    return results


def _build_peers(settings: DecodeSettings) -> list:
    from .peers import build_peers

    if settings.weights is not None:
        raise BenchError("--peers compares random-weight models of a preset's sizes; drop --weights")
    return build_peers(settings.preset, settings.image_tokens, settings.seed, DTYPES[settings.dtype])


def _check(settings: DecodeSettings) -> None:
    unknown = [k for k in settings.kinds if k not in attention_kinds()]
    if unknown:
        raise BenchError(
            f"unknown attention kind(s) {', '.join(unknown)}; expected some of {', '.join(attention_kinds())}"
        )
    if settings.weights is None:
        preset_config(settings.preset, "linear")  # raises on an unknown preset
    if settings.dtype not in DTYPES:
        raise BenchError(f"--dtype {settings.dtype!r}: expected one of {', '.join(DTYPES)}")
    if settings.kv_cache_dtype not in (None, *DTYPES):
        raise BenchError(f"--kv-cache-dtype {settings.kv_cache_dtype!r}: expected one of {', '.join(DTYPES)}")
    for name in ("repeats", "steps_per_position", "position_batch", "image_tokens", "max_position"):
        if getattr(settings, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}")
    if not settings.batch_sizes or min(settings.batch_sizes) < 1:
        raise BenchError(f"--batch-sizes must be positive integers, got {settings.batch_sizes}")
    if list(settings.positions) != sorted(set(settings.positions)) or min(settings.positions, default=3) < 3:
        raise BenchError(
            f"--positions must be increasing and >= 3 (two warm-up steps come first), got {settings.positions}"
        )
    for flag, value in (("--workers", settings.workers), *(("--peer-workers", n) for n in settings.peer_workers)):
        if value < 1:
            raise BenchError(f"{flag} must be >= 1, got {value}")
        if value > 1 and settings.device != "cpu":
            raise BenchError(f"{flag} {value}: worker processes are a CPU layout; use --device cpu or {flag} 1")
    if settings.image_tokens > IMAGE_TOKENS:
        raise BenchError(f"--image-tokens must be <= {IMAGE_TOKENS} (one MNIST image), got {settings.image_tokens}")


def _model_info(kind: str, model: Transformer, source: str, tokens: int) -> ModelInfo:
    cfg = model.config
    return ModelInfo(
        kind,
        source,
        {k: v for k, v in asdict(cfg).items() if k != "extra"},
        model.num_parameters(),
        model.state_bytes_per_sequence(min(tokens, cfg.max_len)),
    )


def _add_ratios(images: list[ImageResult], no_cache: list[NoCacheResult]) -> None:
    softmax = {r.batch: r for r in images if r.kind == "softmax"}
    baseline = {r.batch: r.images_per_s for r in no_cache}
    for r in images:
        if r.batch in softmax:
            r.vs_softmax_cache = r.images_per_s / softmax[r.batch].images_per_s
            r.vs_softmax_cache_cpu = r.images_per_cpu_s / softmax[r.batch].images_per_cpu_s
        if r.batch in baseline:
            r.vs_no_cache = r.images_per_s / baseline[r.batch]
