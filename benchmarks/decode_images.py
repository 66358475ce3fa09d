"""Images/s of whole MNIST generations (784 tokens from BOS), a batch at a time, through model.decode.generate.generate:
rnnserve's decoders, their eager paths and the peers, in this process or in worker processes
(benchmarks/decode_workers.py); and rnnserve's rows against the others'."""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Callable

import torch

from model.config import BOS_TOKEN
from model.decode.choice import make_decoder
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.generate import generate
from model.decode.sampling import BatchSampling
from model.kernels.loader import turn_off_cpu_kernels
from model.transformer import Transformer

from .decode_models import image_models
from .decode_settings import DTYPES, DecodeSettings
from .decode_timing import sampling_for, timed
from .decode_workers import WorkerPool
from .docs_tables import layout_text
from .errors import BenchError


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
        sampling = sampling_for(batch, model.device)
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
