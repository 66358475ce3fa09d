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
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from model.config import BOS_TOKEN, ModelConfig
from model.kernels.cpu_features import read_cpu_features
from model.kernels.loader import (
    ATEN_CAPABILITY_VARIABLE,
    cpu_route,
    load_kernels,
    packed_linear_wins,
    route_forced,
    turn_off_cpu_kernels,
)
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.choice import make_decoder
from model.decode.generate import generate
from model.attention.kinds import attention_kinds, kind_options
from model.decode.compiled.linear_step import whole_step_refusal
from model.kernels.packed_linear import decode_twin, packs
from model.decode.sampling import BatchSampling, SamplingParams, sample
from model.transformer import Transformer, build_model, with_bos
from model.io.weights import load_model, read_metadata
from training.presets import PRESETS

from .decode_workers import WorkerPool
from .docs_tables import layout_text
from .errors import BenchError
from .roofline import FP32, probe_machine, roofline

IMAGE_TOKENS = 784  # 28 x 28 grey levels in raster order
PREFILL_CHUNK = 256  # tokens per prefill call while advancing a state: bounds the (T, L) masks
STEP_ROUNDS = 4  # turns the kinds take at each position of the step-time sweep
# Flatness of constant-state kinds: step time at the position nearest FLAT_FAR against nearest FLAT_NEAR.
FLAT_NEAR, FLAT_FAR = 100, 16000
FLAT_ROUNDS, FLAT_STEPS_PER_ROUND = 32, 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DecodeSettings:
    kinds: tuple[str, ...] = field(default_factory=attention_kinds)
    preset: str = "cpu"
    weights: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    image_tokens: int = IMAGE_TOKENS
    repeats: int = 1
    max_position: int = 16_384
    positions: tuple[int, ...] = ()  # empty: chosen from max_position
    steps_per_position: int = 16
    position_batch: int = 1
    nocache_pixels: int = 64
    nocache_samples: int = 4
    device: str = "cpu"
    dtype: str = "float32"  # model weights; linear and Linformer states stay float32
    kv_cache_dtype: str | None = None  # softmax's cached keys and values; None: as dtype
    cuda_graphs: bool = True  # on CUDA, decode steps of graphable kinds replay captured graphs
    compiled: bool = True  # on the CPU, decode steps of compilable kinds run through torch.compile
    eager_too: bool = True  # with compiled: also time each compiled kind's eager path, "KIND (eager)"
    peers: bool = False  # also time other implementations (benchmarks/peers.py)
    peer_batch_sizes: tuple[int, ...] = ()  # batch sizes for the peers; empty: the largest only
    seed: int = 0
    workers: int = 1  # rnnserve's contestants as this many processes, as the server's engine workers
    peer_workers: tuple[int, ...] = ()  # the peers' layouts (processes), each timed; empty: as workers


@dataclass
class ModelInfo:
    kind: str
    source: str  # "preset NAME (random weights)" or a file path
    config: dict
    parameters: int
    state_bytes_per_sequence: int  # at image_tokens


@dataclass
class ImageResult:
    kind: str
    batch: int
    seconds: float  # best wall-clock time of the repeats, one whole batch
    images_per_s: float
    tokens_per_s: float
    all_seconds: list[float]
    # Process CPU time (all threads): on a shared machine it barely moves when
    # other jobs take the cores, so ratios of it are the steadier comparison.
    cpu_seconds: float
    images_per_cpu_s: float
    vs_softmax_cache: float | None = None
    vs_no_cache: float | None = None
    vs_softmax_cache_cpu: float | None = None
    cuda_graphs: bool = False  # decode steps replayed CUDA graphs
    compiled: bool = False  # decode steps and draws ran through torch.compile graphs
    group: str = "rnnserve"  # "rnnserve", "eager" (a compiled kind's eager path) or "peer"
    rival: str | None = None  # for "eager" and "peer" rows: the rnnserve kind they are compared with
    workers: int = 1  # processes that shared the batch's rows, started together (benchmarks/decode_workers.py)
    threads_per_worker: int | None = None  # intra-op threads of each; None: the bench process's


@dataclass
class NoCacheResult:
    batch: int
    measured_pixels: int
    measured_seconds: float  # the first measured_pixels steps, really run
    sampled_steps: list[dict]  # {"position", "seconds"}: one step at a later position
    seconds: float  # whole image, extrapolated
    images_per_s: float
    tokens_per_s: float
    extrapolated: bool = True
    method: str = (
        "first pixels measured step by step; later steps timed at sampled positions; "
        "total = measured + linear interpolation of step time over the remaining positions"
    )


@dataclass
class PositionPoint:
    position: int  # tokens already in the state when the step runs
    step_seconds_min: float
    step_seconds_median: float
    state_bytes_per_sequence: int


@dataclass
class FlatnessResult:
    """A constant-state kind's step time far into a sequence against near its start."""

    kind: str
    near: int  # positions of the two states when timing began
    far: int
    near_seconds_median: float
    far_seconds_median: float
    near_seconds_min: float
    far_seconds_min: float
    ratio: float  # far / near, medians of steps timed in alternation
    steps: int  # per position


@dataclass
class DecodeReport:
    settings: dict
    environment: dict
    models: dict[str, ModelInfo]
    images: list[ImageResult]
    no_cache: list[NoCacheResult]
    positions: dict[str, list[PositionPoint]]
    flatness: list[FlatnessResult] = field(default_factory=list)
    machine: dict = field(default_factory=dict)  # measured copy bandwidth and matmul rate
    roofline: dict[str, dict] = field(default_factory=dict)  # kind -> per-token cost and bounds
    targets: list[dict] = field(default_factory=list)
    compile_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # "KIND batch N" -> class -> s
    comparisons: list[dict] = field(default_factory=list)  # rnnserve against its eager path and its peers
    peers: list[dict] = field(default_factory=list)  # what each peer is: cache, sampling
    load: dict = field(default_factory=dict)  # /proc/loadavg before and after the run

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- models


def preset_config(preset: str, kind: str, task: str = "mnist", max_len: int = IMAGE_TOKENS) -> ModelConfig:
    if preset not in PRESETS:
        raise BenchError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    # The training presets' shapes for every kind ("cpu": the CPU-trained MNIST models, "paper": the MNIST
    # model of "Transformers are RNNs"); Reformer as `rnnserve train` builds it, so timings match trained models.
    return ModelConfig(
        attention=kind,
        task=task,
        max_len=max_len,
        reformer_local_window=kind_options()["reformer_local_window"].train_default,
        **PRESETS[preset].architecture(),
    )


def image_models(settings: DecodeSettings) -> dict[str, tuple[Transformer, str]]:
    """kind -> (model, source): trained MNIST weights when --weights is given, else a random preset."""
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    if settings.weights is None:
        out = {}
        for kind in settings.kinds:
            torch.manual_seed(settings.seed)
            model = build_model(preset_config(settings.preset, kind)).to(device=device, dtype=dtype).eval()
            out[kind] = (with_cache_dtype(model, settings), f"preset {settings.preset} (random weights)")
        return out
    files = _mnist_weight_files(Path(settings.weights), settings.kinds)
    return {
        kind: (with_cache_dtype(load_model(path, device, dtype)[0].eval(), settings), str(path))
        for kind, path in files.items()
    }


def cached_number_bytes(model: Transformer) -> int:
    dtype = model.cache_dtype()
    return dtype.itemsize if dtype is not None else FP32


def with_cache_dtype(model: Transformer, settings: DecodeSettings) -> Transformer:
    model.kv_cache_dtype = DTYPES[settings.kv_cache_dtype] if settings.kv_cache_dtype else None
    return model


def _mnist_weight_files(folder: Path, kinds: tuple[str, ...]) -> dict[str, Path]:
    if not folder.is_dir():
        raise BenchError(f"--weights {folder}: not a directory; expected a folder of .safetensors files")
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        cfg, _ = read_metadata(path)
        if cfg.task == "mnist" and cfg.attention in kinds and cfg.attention not in found:
            found[cfg.attention] = path
    if not found:
        raise BenchError(f"--weights {folder}: no MNIST model of kind {', '.join(kinds)} in any .safetensors file")
    return found


def position_model(image_model: Transformer, max_len: int, seed: int) -> Transformer:
    """Same architecture as `image_model`, text task, sinusoidal positions, long max_len, random weights.

    Random weights are fine here: step time and state size depend on shapes
    only (Reformer's bucket occupancy depends on hashing, see README).
    """
    cfg = image_model.config.replace(task="text", max_len=max_len, pos_encoding="sinusoidal", dropout=0.0)
    torch.manual_seed(seed)
    model = build_model(cfg).to(device=image_model.device, dtype=image_model.dtype).eval()
    model.kv_cache_dtype = image_model.kv_cache_dtype
    return model


# ---------------------------------------------------------------- timing helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sampling(batch: int, device: torch.device) -> BatchSampling:
    return BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(batch)], device)


# ---------------------------------------------------------------- images/s


@dataclass
class Contestant:
    """One row of the images table: a way to generate whole images, a batch at a time, from BOS."""

    name: str  # the row's label: "linear", "linear (eager)", "peer: ..."
    kind: str  # rnnserve's kind it is, or the one it is compared with
    group: str  # "rnnserve", "eager" or "peer"
    generate: Callable[[int], torch.Tensor] | None  # tokens -> (batch, tokens); None: it runs in workers (`timed`)
    compiled: bool = False
    graphed: bool = False
    timed: Callable[[int], tuple[float, float]] | None = None  # set: timed in worker processes, not this one
    workers: int = 1
    threads_per_worker: int | None = None  # None: in this process, on its threads


def check_generated(name: str, out: torch.Tensor, batch: int, tokens: int) -> None:
    """A timed run counts only if it produced batch x tokens tokens (bytes, or a peer's byte + BOS vocabulary)."""
    if tuple(out.shape) != (batch, tokens) or int(out.min()) < 0 or int(out.max()) > BOS_TOKEN:
        raise BenchError(
            f"{name} produced {tuple(out.shape)} tokens in [{int(out.min())}, {int(out.max())}], "
            f"not {batch} x {tokens} tokens"
        )


def timed_generation(contestant: Contestant, batch: int, tokens: int, device: torch.device) -> tuple[float, float]:
    """(wall, CPU) seconds of one checked generation of `tokens` tokens in every row."""
    if contestant.timed is not None:
        return contestant.timed(tokens)
    out: list[torch.Tensor] = []
    cpu = time.process_time()
    wall = timed(lambda: out.append(contestant.generate(tokens)), device)
    cpu = time.process_time() - cpu
    check_generated(contestant.name, out[0], batch, tokens)
    return wall, cpu


def with_decoder(decoder: EagerDecoder, sampling: BatchSampling, tokens: int) -> torch.Tensor:
    prompt = torch.zeros(decoder.state.batch_size, 0, dtype=torch.long, device=decoder.model.device)  # (B, 0)
    return generate(decoder.model, prompt, tokens, sampling, decoder=decoder)


@torch.inference_mode()
def rnnserve_contestants(
    models: dict[str, Transformer], batch: int, settings: DecodeSettings, compile_seconds: dict, progress
) -> list[Contestant]:
    """Each kind's decoder as the server makes it (CUDA graphs or compiled, made once per batch size
    outside the timings, as a server does at start-up), and the eager path beside each compiled one."""
    out = []
    for kind, model in models.items():
        sampling = _sampling(batch, model.device)
        decoder = make_decoder(
            model, model.new_state(batch), settings.cuda_graphs, sizes=[batch], compiled=settings.compiled
        )
        log = decoder.compile(batch=batch)
        if log is not None:
            compile_seconds[f"{kind} batch {batch}"] = timings = dict(log.seconds)
            if log.kernels is not None and log.kernels.ok:  # built once per machine, then loaded
                timings["C++ kernels"] = log.kernels.seconds
            progress(
                f"compile {kind:9s} batch {batch:4d}: "
                + (log.error or ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items()))
            )
        out.append(
            Contestant(
                kind, kind, "rnnserve", partial(with_decoder, decoder, sampling), decoder.compiled, decoder.graphed
            )
        )
        if decoder.compiled and settings.eager_too:
            eager = EagerDecoder(pytorch_operators_only(model), model.new_state(batch))
            out.append(Contestant(f"{kind} (eager)", kind, "eager", partial(with_decoder, eager, sampling)))
    return out


def pytorch_operators_only(model: Transformer) -> Transformer:
    """A copy of the model that decodes as with the fast path turned off: no C++ kernels (model/kernels/loader.py)."""
    plain = copy.deepcopy(model)
    turn_off_cpu_kernels(plain)
    return plain


def peer_contestants(peers: list, batch: int) -> list[Contestant]:
    return [Contestant(f"peer: {p.spec.name}", p.spec.rival, "peer", partial(p.run, batch)) for p in peers]


def measure_images(
    models: dict[str, Transformer], settings: DecodeSettings, progress, peers: list | None = None
) -> tuple[list[ImageResult], dict]:
    """Every contestant at every batch size (peers at theirs), best of `repeats`; and compile times.

    The contestants take turns within each repeat, so a slow spell on a shared
    machine hits all of them rather than one.
    """
    results, compile_seconds = [], {}
    device = torch.device(settings.device)
    peer_batches = settings.peer_batch_sizes or (max(settings.batch_sizes),)
    for batch in settings.batch_sizes:
        with contextlib.ExitStack() as pools:
            contestants = _batch_contestants(models, batch, settings, compile_seconds, progress, pools)
            if batch in peer_batches and peers:
                contestants += _peer_contestants(peers, batch, settings, pools, progress)
            results += _time_contestants(contestants, batch, settings, device, progress)
    return results, compile_seconds


def _batch_contestants(models, batch: int, settings: DecodeSettings, compile_seconds: dict, progress, pools):
    if settings.workers == 1:
        return rnnserve_contestants(models, batch, settings, compile_seconds, progress)
    pool = pools.enter_context(_worker_pool(settings, "rnnserve", batch, settings.workers, progress))
    for name, seconds in pool.compile_seconds.items():
        compile_seconds[f"{name}, one of {len(pool.rows)} workers"] = seconds
    return _pooled(pool)


def _peer_contestants(peers: list, batch: int, settings: DecodeSettings, pools, progress) -> list[Contestant]:
    """The peers in each of their layouts (the rows' `workers` and `threads_per_worker` tell them apart)."""
    out = []
    layouts = settings.peer_workers or (settings.workers,)
    for workers in layouts:
        if workers == 1:
            built = peer_contestants(peers, batch)
        else:
            built = _pooled(pools.enter_context(_worker_pool(settings, "peer", batch, workers, progress)))
        out += built
    return out


@contextlib.contextmanager
def _worker_pool(settings: DecodeSettings, group: str, batch: int, workers: int, progress):
    pool = WorkerPool(settings, group, batch, workers, torch.get_num_threads(), worker_contestants, check_generated)
    progress(f"workers {group:9s} batch {batch:4d}: {_layout_text(len(pool.rows), pool.threads)}, rows {pool.rows}")
    try:
        yield pool
    finally:
        pool.close()


def worker_contestants(settings: DecodeSettings, group: str, rows: int) -> tuple[list[Contestant], dict]:
    """(In a worker process.) One group's contestants for `rows` rows, built as in this process, and compile times."""
    settings = replace(settings, workers=1, peer_workers=())
    compile_seconds: dict = {}
    if group == "peer":
        from .peers import build_peers

        peers = build_peers(settings.preset, settings.image_tokens, settings.seed, DTYPES[settings.dtype])
        return peer_contestants(peers, rows), compile_seconds
    models = {k: m for k, (m, _) in image_models(settings).items()}
    return rnnserve_contestants(models, rows, settings, compile_seconds, progress=lambda _: None), compile_seconds


def _pooled(pool: WorkerPool) -> list[Contestant]:
    return [
        Contestant(
            **asdict(r),
            generate=None,
            timed=partial(pool.timed_run, r.name),
            workers=len(pool.rows),
            threads_per_worker=pool.threads,
        )
        for r in pool.contestants
    ]


def _time_contestants(contestants: list[Contestant], batch: int, settings: DecodeSettings, device, progress):
    for contestant in contestants:
        if contestant.timed is None:  # pooled ones warmed up in their workers
            timed_generation(contestant, batch, min(8, settings.image_tokens), device)  # allocator, kernels
    runs: list[list[tuple[float, float]]] = [[] for _ in contestants]  # a peer's name recurs in each layout
    for _ in range(settings.repeats):
        for contestant, timings in zip(contestants, runs):
            timings.append(timed_generation(contestant, batch, settings.image_tokens, device))
    results = []
    for contestant, timings in zip(contestants, runs):
        results.append(_image_result(contestant, batch, timings, settings.image_tokens))
        progress(f"images  {contestant.name:40s} batch {batch:4d}: {results[-1].images_per_s:10.3f} images/s")
    return results


def _image_result(contestant: Contestant, batch: int, timings: list[tuple[float, float]], tokens: int) -> ImageResult:
    wall = min(w for w, _ in timings)
    cpu = min(c for _, c in timings)
    return ImageResult(
        contestant.name,
        batch,
        wall,
        batch / wall,
        batch * tokens / wall,
        [w for w, _ in timings],
        cpu,
        batch / cpu,
        cuda_graphs=contestant.graphed,
        compiled=contestant.compiled,
        group=contestant.group,
        rival=None if contestant.group == "rnnserve" else contestant.kind,
        workers=contestant.workers,
        threads_per_worker=contestant.threads_per_worker,
    )


# ---------------------------------------------------------------- no-cache baseline


@torch.inference_mode()
def _no_cache_step(model: Transformer, tokens: torch.Tensor, position: int, sampling: BatchSampling) -> torch.Tensor:
    """Predict tokens[:, position] by re-running the whole prefix: what cache-less reference code does."""
    logits, _ = model(with_bos(tokens[:, : position + 1]), None)  # (B, position+1, V)
    where = torch.full((tokens.shape[0],), position, dtype=torch.long, device=tokens.device)
    return sample(logits[:, -1], sampling, where)


def measure_no_cache(model: Transformer, batch: int, settings: DecodeSettings) -> NoCacheResult:
    """Softmax without a cache: first pixels run for real, later steps sampled, total interpolated."""
    device, total = model.device, settings.image_tokens
    measured = min(settings.nocache_pixels, total)
    sampling = _sampling(batch, device)
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)  # (B, 784)
    _no_cache_step(model, tokens, 0, sampling)  # warm-up

    def step(pos: int) -> None:
        tokens[:, pos] = _no_cache_step(model, tokens, pos, sampling)

    first = [timed(lambda p=pos: step(p), device) for pos in range(measured)]
    gen = torch.Generator().manual_seed(settings.seed)
    tokens[:, measured:] = torch.randint(0, 256, (batch, total - measured), generator=gen).to(device)
    sampled = [
        {"position": pos, "seconds": timed(lambda p=pos: _no_cache_step(model, tokens, p, sampling), device)}
        for pos in _later_positions(measured, total, settings.nocache_samples)
    ]
    rest = _interpolated_sum(first, sampled, measured, total)
    seconds = sum(first) + rest
    return NoCacheResult(batch, measured, sum(first), sampled, seconds, batch / seconds, batch * total / seconds)


def _later_positions(measured: int, total: int, count: int) -> list[int]:
    if measured >= total or count < 1:
        return []
    return sorted({int(round(p)) for p in np.linspace(measured, total - 1, count)})


def _interpolated_sum(first: list[float], sampled: list[dict], measured: int, total: int) -> float:
    """Sum of step times over positions measured..total-1, linear between known points."""
    if measured >= total:
        return 0.0
    xs = [measured - 1] + [s["position"] for s in sampled]
    ys = [statistics.median(first[-4:])] + [s["seconds"] for s in sampled]  # end of the real run, denoised
    return float(np.interp(np.arange(measured, total), xs, ys).sum())


# ---------------------------------------------------------------- step time against position


def choose_positions(max_position: int) -> list[int]:
    """Default sample positions: 100 and 16,000 (the issue's targets) plus a spread up to max_position."""
    wanted = [100, 1000, 2000, 4000, 8000, 12000, 16000, max_position]
    chosen = sorted({p for p in wanted if 1 <= p <= max_position})
    if len(chosen) < 4:
        chosen = sorted({max(1, int(p)) for p in np.linspace(max_position / 8, max_position, 4)})
    return chosen


@torch.inference_mode()
def _advance(model: Transformer, state, target: int, gen: torch.Generator) -> None:
    """Prefill random tokens in chunks until every row holds `target` tokens."""
    batch = state.batch_size
    while int(state.lengths[0]) < target:
        n = min(PREFILL_CHUNK, target - int(state.lengths[0]))
        chunk = torch.randint(0, 256, (batch, n), generator=gen).to(model.device)  # (B, n)
        model(chunk, state)


@torch.inference_mode()
def step_decoder(model: Transformer, settings: DecodeSettings, batch: int) -> EagerDecoder:
    """A decoder as the server makes it (compiled here and now when it is compiled) on a new state."""
    decoder = make_decoder(
        model, model.new_state(batch), settings.cuda_graphs, sizes=[batch], compiled=settings.compiled
    )
    decoder.compile(batch=batch)
    return decoder


@torch.inference_mode()
def measure_positions(
    models: dict[str, Transformer], positions: list[int], settings: DecodeSettings, progress
) -> dict[str, list[PositionPoint]]:
    """Per kind, one state advanced through increasing positions; timed single-token steps at each,
    through the decoder the server would use (compiled, CUDA graphs or eager).

    At each position the kinds take turns in a few rounds, so a noisy spell
    on a shared machine does not land on one kind only.
    """
    batch = settings.position_batch
    decoders = {kind: step_decoder(model, settings, batch) for kind, model in models.items()}
    gens = {kind: torch.Generator().manual_seed(settings.seed) for kind in models}
    points: dict[str, list[PositionPoint]] = {kind: [] for kind in models}
    rounds = min(STEP_ROUNDS, settings.steps_per_position)
    for decoder in decoders.values():  # warm-up, untimed: first calls allocate and pick kernels
        _time_steps(decoder, 2)
    for pos in positions:
        times: dict[str, list[float]] = {kind: [] for kind in models}
        for kind, model in models.items():
            if pos < int(decoders[kind].state.lengths[0]):
                raise BenchError(
                    f"positions must grow by more than --steps-per-position; {pos} is too close to the one before"
                )
            _advance(model, decoders[kind].state, pos, gens[kind])
        state_bytes = {kind: d.state.nbytes_in_use() // batch for kind, d in decoders.items()}
        for r in range(rounds):
            steps = settings.steps_per_position // rounds + (r < settings.steps_per_position % rounds)
            for kind, decoder in decoders.items():
                times[kind] += _time_steps(decoder, steps)
        for kind, t in times.items():
            points[kind].append(PositionPoint(pos, min(t), statistics.median(t), state_bytes[kind]))
        progress(
            f"steps   at {pos:6d}: "
            + ", ".join(f"{k} {p[-1].step_seconds_min * 1e3:.3f} ms" for k, p in points.items())
        )
    return points


@torch.inference_mode()
def measure_flatness(
    models: dict[str, Transformer], near: int, far: int, settings: DecodeSettings, progress
) -> list[FlatnessResult]:
    """Kinds with a constant-size state: one state at `near`, one at `far`, single steps timed
    in alternation (FLAT_ROUNDS rounds, the order flipping each round). The sweep visits each
    position once, so a slow spell of a shared machine there can double one position's time;
    here both positions sample the same spells, and the ratio of medians cancels them."""
    results = []
    for kind, model in models.items():
        if not model.capabilities.constant_state:
            continue
        decoders = {pos: step_decoder(model, settings, 1) for pos in (near, far)}
        for pos, decoder in decoders.items():
            _advance(model, decoder.state, pos, torch.Generator().manual_seed(settings.seed))
        times: dict[int, list[float]] = {near: [], far: []}
        for r in range(FLAT_ROUNDS):
            for pos in (near, far) if r % 2 == 0 else (far, near):
                times[pos] += _time_steps(decoders[pos], FLAT_STEPS_PER_ROUND)
        medians = {pos: statistics.median(t) for pos, t in times.items()}
        results.append(
            FlatnessResult(
                kind,
                near,
                far,
                medians[near],
                medians[far],
                min(times[near]),
                min(times[far]),
                medians[far] / medians[near],
                len(times[near]),
            )
        )
        progress(
            f"flat    {kind:9s}: {medians[far] * 1e3:.3f} ms at {far} vs {medians[near] * 1e3:.3f} ms at {near} "
            f"(medians of {len(times[near])} alternating steps): {results[-1].ratio:.2f}x"
        )
    return results


def _time_steps(decoder: EagerDecoder, steps: int) -> list[float]:
    token = torch.zeros(decoder.state.batch_size, dtype=torch.long, device=decoder.model.device)  # (B,)
    return [timed(lambda: decoder(token), decoder.model.device) for _ in range(steps)]


# ---------------------------------------------------------------- the whole run


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
    near, far = _closest(positions, FLAT_NEAR), _closest(positions, FLAT_FAR)
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


def compare(images: list[ImageResult]) -> list[dict]:
    """rnnserve's kind against its eager path and against each peer, at every batch both ran."""
    ours = {(r.kind, r.batch): r for r in images if r.group == "rnnserve"}
    rows = []
    for r in images:
        mine = ours.get((r.rival, r.batch))
        if r.group == "rnnserve" or mine is None:
            continue
        rows.append(
            {
                "batch": r.batch,
                "rnnserve": mine.kind,
                "against": r.kind,
                "group": r.group,
                "rnnserve_images_per_s": mine.images_per_s,
                "against_images_per_s": r.images_per_s,
                "ratio": mine.images_per_s / r.images_per_s,
                "ratio_cpu_time": mine.images_per_cpu_s / r.images_per_cpu_s,
                "rnnserve_layout": layout(mine),
                "against_layout": layout(r),
            }
        )
    return rows


def layout(result: ImageResult) -> str:
    """How a row ran: "in-process", or "N processes x T threads" (benchmarks/decode_workers.py)."""
    return _layout_text(result.workers, result.threads_per_worker)


def _layout_text(workers: int, threads: int | None) -> str:
    return "in-process" if threads is None else layout_text(workers, threads)


def machine_load() -> dict:
    """The 1, 5 and 15-minute load averages: how shared the machine was."""
    try:
        one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
        return {"load_1min": float(one), "load_5min": float(five), "load_15min": float(fifteen)}
    except (OSError, ValueError):
        return {}


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


# The variables that cap PyTorch's, inductor's, MKL's and oneDNN's vector code (benchmarks/as_avx2.sh sets them).
VECTOR_CAPS = (ATEN_CAPABILITY_VARIABLE, "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def vector_caps() -> dict[str, str]:
    """The caps set in this process's environment."""
    return {name: os.environ[name] for name in VECTOR_CAPS if name in os.environ}


def measured_class(hardware_class: str, route: str) -> str:
    """The CPU class a run stands for, kept apart from runs on other hardware: an AVX-512 CPU whose PyTorch and
    kernels are both capped at AVX2 is an emulated AVX2 one; any other capped or forced run says so."""
    caps = vector_caps()
    if hardware_class == "AVX-512" and caps.get(ATEN_CAPABILITY_VARIABLE) == "avx2" and route == "avx2":
        return "AVX2, emulated on an AVX-512 CPU"
    if caps or route_forced():
        settings = ", ".join(f"{name}={value}" for name, value in caps.items())
        return f"{hardware_class}, capped or forced ({settings or 'RNNSERVE_CPU_ROUTE'}; kernels' route {route})"
    return hardware_class


def environment(settings: DecodeSettings) -> dict:
    cpu, route = read_cpu_features(), cpu_route()
    env = {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_class": measured_class(cpu.cpu_class, route),  # the benchmarks' tables are kept per class
        "vector_features": cpu.vector_features,
        "vector_caps": vector_caps(),
        "cpu_route": route,  # the kernels' route (RNNSERVE_CPU_ROUTE forces one)
        "packed_linear": packed_linear_wins(),  # whether the compiled steps' linear layers run the packed kernel
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": settings.device,
    }
    if settings.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(settings.device))
    return env


def one_call_kinds(models: dict[str, Transformer], settings: DecodeSettings) -> list[str]:
    """The kinds whose rnnserve steps ran as one C++ call each (model/decode/compiled/linear_step.py), as the bench's
    compiled decoders found them once their kernels had loaded."""
    if not settings.compiled or settings.device != "cpu" or not load_kernels().ok:
        return []
    return [kind for kind, model in models.items() if packs(model) and whole_step_refusal(decode_twin(model)) is None]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------- targets (issues 5 and 16)

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


def _closest(positions: list[int], target: int) -> int:
    return min(positions, key=lambda p: abs(p - target))


def _target(name: str, measured: float | None, minimum: float) -> dict:
    return {
        "name": name,
        "measured": measured,
        "threshold": f">= {minimum:g}",
        "met": measured is not None and measured >= minimum,
    }
