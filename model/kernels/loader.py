"""C++ kernels for CPU decode steps, built on first use with the machine's C++ compiler.

Kernels registered as operators so that eager steps call them and
torch.compile keeps each as one call inside its graphs:
  * `torch.ops.rnnserve.softmax_decode_attention`: softmax attention of one
    query per row over its KV cache (model/kernels/softmax_decode.cpp), which
    a softmax decode step spends most of its time in at batch 64, and
    `reformer_decode_attention`, the same over the keys a Reformer query's
    rounds show (only those are read);
  * `torch.ops.rnnserve.packed_linear` (and `pack_linear_weight`): a linear
    layer on weights packed once (model/kernels/packed_linear.cpp), which the
    compiled decode steps use for every linear layer (model/kernels/packed_linear.py).
  * `torch.ops.rnnserve.linear_attention_prefill`: causal linear attention over
    a prompt as a recurrence into its rows' state (model/kernels/linear_prefill.cpp),
    which a linear model's prefill runs on once the kernels are on;
  * `torch.ops.rnnserve.linear_decode_step`: a whole decode step of a linear
    model on its decode twin's packed weights (model/kernels/linear_step.cpp),
    which the CPU decoders call for the models it takes (model/decode/compiled/linear_step.py);
  * `torch.ops.rnnserve.categorical_draw`: the unfiltered draw of model/decode/sampling.py
    (model/kernels/categorical_draw.cpp), alone or, `linear_decode_step_draw`, right after that step in
    its call: what those decoders draw with.
  * `torch.ops.rnnserve.hybrid_decode_attention`: a hybrid-attention decode step
    (model/kernels/hybrid_decode.cpp): the ring's leaving key into the sums, the
    window's softmax and the linear read with one normaliser, in place; and
    `hybrid_decode_step`, a whole decode step of a hybrid model as linear_decode_step is of a linear one
    (model/kernels/hybrid_step.cpp, model/decode/compiled/hybrid_step.py).

The build runs once per machine, ahead of serving (`rnnserve build-kernels`, which `make install` and the
container build run), and uses the vector instructions inductor picks for this CPU. torch keeps the library
under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR), here in a folder of its own per sources, flags,
torch and Python environment: two checkouts on one machine would otherwise rebuild over each other's library.
A server only loads a library built ahead (`load_kernels(build=False)`): no compiler runs beside requests.
When none was built, or a build fails (no compiler), that is logged once and decoding keeps PyTorch's operators.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .cpu_features import read_cpu_features

log = logging.getLogger("rnnserve.cpu_kernels")

SOURCES = tuple(
    Path(__file__).parent / name
    for name in (
        "softmax_decode.cpp",
        "packed_linear.cpp",
        "linear_prefill.cpp",
        "linear_step.cpp",
        "categorical_draw.cpp",
        "hybrid_decode.cpp",
        "hybrid_step.cpp",
    )
)
# What the sources include (the vector types, the packed product): part of what a build's folder is keyed on.
HEADERS = tuple(
    Path(__file__).parent / name
    for name in ("vectors.h", "packed_product.h", "packed_product_bf16.h", "decode_block.h", "hybrid_attention.h")
)
LIBRARY = "rnnserve_cpu_kernels"
_BUILD_LOCK = threading.Lock()  # one build per process, whichever model's compile thread asks first


@dataclass(frozen=True)
class KernelBuild:
    """Whether the kernels are usable in this process, how long loading them took, and why not."""

    ok: bool
    seconds: float
    error: str | None = None
    route: str | None = None  # the route the library was built for (cpu_route), once it loaded


ROUTE_VARIABLE = "RNNSERVE_CPU_ROUTE"
# Route -> the compiler flags its kernels build with. avx512 and avx2 use the intrinsics of those instruction
# sets; generic uses the compiler's vector extensions (8-float vectors: NEON on ARM, SSE/AVX on x86), which
# any GCC or Clang target builds; scalar uses none.
ROUTE_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "avx2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"],
    "generic": ["-DRNNSERVE_GENERIC_VECTORS", "-ffp-contract=fast"],
    "scalar": [],
}
# Where the packed linear kernel beats PyTorch's products (benchmarks/results/NOTES.md, "CPU routes"): elsewhere the
# decode twin keeps PyTorch's linear layers, unless the route is forced. The generic route is slower than MKL at
# 64 rows on x86 (which takes the avx2 route anyway) and unmeasured on ARM, so it stays opt-in.
PACKED_LINEAR_ROUTES = frozenset({"avx512", "avx2"})


def cpu_route() -> str:
    """The kernels' route: RNNSERVE_CPU_ROUTE when set (so that a route can be forced and tested on any CPU that
    runs it), else the one this CPU's class takes, capped as PyTorch's own vector code is (`aten_capped`)."""
    forced = os.environ.get(ROUTE_VARIABLE, "").strip().lower()
    if forced and forced != "auto":
        if forced not in ROUTE_FLAGS:
            raise ValueError(f"{ROUTE_VARIABLE}={forced!r}: expected one of auto, {', '.join(ROUTE_FLAGS)}")
        return forced
    route = {"AVX-512": "avx512", "AVX2": "avx2", "ARM NEON": "generic"}.get(read_cpu_features().cpu_class, "scalar")
    return aten_capped(route)


ATEN_CAPABILITY_VARIABLE = "ATEN_CPU_CAPABILITY"


def aten_capped(route: str) -> str:
    """PyTorch's ATEN_CPU_CAPABILITY caps its kernels' and inductor's vector instructions (avx2 on an AVX-512 CPU,
    default for none); the C++ kernels follow it down, never up, so that one variable makes a whole decode step
    run as it would on the narrower CPU."""
    capability = os.environ.get(ATEN_CAPABILITY_VARIABLE, "")  # matched exactly, as PyTorch and inductor match it
    if capability == "avx2" and route == "avx512":
        return "avx2"
    if capability == "default":
        return "scalar"
    return route


def route_forced() -> bool:
    return os.environ.get(ROUTE_VARIABLE, "auto").strip().lower() not in ("", "auto")


def vector_flags() -> list[str]:
    """Compiler flags for this process's route (see `cpu_route`); on x86 the generic route also gets the
    CPU's AVX2 and FMA, as a compiler targeting the machine would, and the avx512 route the bfloat16 dot product
    where the CPU has it (the bfloat16 packed linear layer multiplies with it)."""
    route = cpu_route()
    flags = list(ROUTE_FLAGS[route])
    cpu_flags = read_cpu_features().flags
    if route == "generic" and {"avx2", "fma"} <= cpu_flags:
        flags += ["-mavx2", "-mfma"]
    if route == "avx512" and "avx512_bf16" in cpu_flags:
        flags += ["-mavx512bf16", "-DRNNSERVE_AVX512_BF16"]
    return flags


def packed_linear_wins() -> bool:
    """Whether the decode twin's linear layers run the packed kernel: on the routes where it beats PyTorch's
    products (measured in benchmarks/results/NOTES.md), or on any route that is forced."""
    return route_forced() or cpu_route() in PACKED_LINEAR_ROUTES


# Rows from which a bfloat16 linear layer is PyTorch's product rather than the packed kernel's, on CPUs with AMX
# tiles (oneDNN multiplies bfloat16 on them): a few rows read the weight at the kernel's pace, more are
# arithmetic, which the tiles do many times faster than vector instructions.
BF16_DENSE_ROWS = 8


def bf16_dense_rows() -> int:
    """Above how many rows the decode twin's bfloat16 layers hand the product to PyTorch (0: never): on the avx512
    route of a CPU with AMX; elsewhere (no tiles, or PyTorch capped below them) the kernel takes every row count."""
    return BF16_DENSE_ROWS if cpu_route() == "avx512" and "amx_bf16" in read_cpu_features().flags else 0


def load_kernels(build: bool = True) -> KernelBuild:
    """Register the kernels, once per process (later calls return the first result): built here if need be, or
    (build=False, what a server does) only if a library built ahead is there."""
    with _BUILD_LOCK:
        return _load_once(build)


def wait_for_build(seconds: float) -> bool:
    """Wait up to `seconds` for a build running in this process; True once none is. Its compiler runs in
    child processes, which an exit would leave writing the build folder while the next start builds there."""
    if not _BUILD_LOCK.acquire(timeout=seconds):
        return False
    _BUILD_LOCK.release()
    return True


@functools.cache
def _load_once(build: bool) -> KernelBuild:
    start = time.perf_counter()
    try:
        # OpenMP as torch's own: the kernel splits rows over torch's intra-op threads (its libgomp, already loaded).
        flags = ["-O3", "-fopenmp", *vector_flags()]
        directory = build_directory(flags)
        if build:
            _build(directory, flags)
        elif (directory / f"{LIBRARY}.so").is_file():
            # torch leaves load_library unannotated
            torch.ops.load_library(str(directory / f"{LIBRARY}.so"))  # type: ignore[no-untyped-call]
        else:
            log.warning(
                "the CPU decode kernels were not built ahead (run `rnnserve build-kernels`, as `make install` "
                "does); decoding with PyTorch's operators"
            )
            return KernelBuild(False, time.perf_counter() - start, "not built; run `rnnserve build-kernels`")
        torch.library.register_fake("rnnserve::softmax_decode_attention")(_fake_softmax_decode_attention)
        torch.library.register_fake("rnnserve::reformer_decode_attention")(_fake_reformer_decode_attention)
        torch.library.register_fake("rnnserve::packed_linear")(_fake_packed_linear)
        torch.library.register_fake("rnnserve::packed_linear_or_dense")(_fake_packed_linear_or_dense)
        torch.library.register_fake("rnnserve::linear_attention_prefill")(_fake_linear_attention_prefill)
        torch.library.register_fake("rnnserve::hybrid_decode_attention")(_fake_hybrid_decode_attention)
    except Exception as exc:  # no compiler, no Python headers, a read-only cache
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning(
            "%s the CPU decode kernels failed (%s); decoding with PyTorch's operators",
            "building" if build else "loading",
            error,
        )
        return KernelBuild(False, time.perf_counter() - start, error)
    result = KernelBuild(True, time.perf_counter() - start, route=cpu_route())
    log.info("CPU decode kernels (%s route) ready in %.1f s", result.route, result.seconds)
    return result


def _build(directory: Path, flags: list[str]) -> None:
    from torch.utils.cpp_extension import load

    with exclusive_build(directory):
        load(
            name=LIBRARY,
            sources=[str(source) for source in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )


def build_directory(flags: list[str]) -> Path:
    """The build folder for this source file, its text, these flags, this torch and this Python environment
    (the compile commands name the last two's headers), made if missing."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch puts extensions (honours the env)

    inputs = [text for source in (*SOURCES, *HEADERS) for text in (str(source), source.read_text())]
    inputs += [*flags, torch.__version__, sys.prefix]
    key = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:12]
    return Path(_get_build_directory(f"{LIBRARY}-{key}", verbose=False))


@contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Build alone: an flock on the folder, which the kernel releases if this process dies. torch's own
    build lock (the file `lock`) is not released then, and torch waits on it forever; under the flock,
    any such file was left by a build that died, so it is removed."""
    with open(directory / "rnnserve.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        baton = directory / "lock"
        if baton.exists():
            log.warning("removed %s, left by a build of the CPU decode kernels that did not finish", baton)
            baton.unlink(missing_ok=True)
        yield


def _fake_softmax_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    return q.new_empty(q.shape)  # (B, H, 1, D), contiguous: what the kernel returns


def _fake_reformer_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_buckets: torch.Tensor,
    query_buckets: torch.Tensor,
    last: torch.Tensor,
    window: int,
) -> torch.Tensor:
    return q.new_empty(q.shape)  # (B, H, 1, D), contiguous: what the kernel returns


def _fake_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))  # contiguous: what the kernel returns


def _fake_packed_linear_or_dense(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, dense_weight: torch.Tensor, rows: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))  # contiguous: what the kernel (or PyTorch's linear) returns


def _fake_linear_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, eps: float
) -> torch.Tensor:
    return v.new_empty(v.shape)  # (B, H, T, D), contiguous: what the kernel returns


def _fake_hybrid_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    mix: torch.Tensor,
    map_weight: torch.Tensor | None,
    map_bias: torch.Tensor | None,
    map_kind: int,
    eps: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)  # (B, H, 1, D), contiguous: what the kernel returns; the state moves on in place


def _kernel_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "cpu_decode_kernel")]


def use_cpu_kernels(model: torch.nn.Module, build: bool = True) -> KernelBuild | None:
    """Turn on the kernels in every layer of a CPU model that has one; None when none applies.
    build=False: only a library built ahead (see load_kernels)."""
    layers = _kernel_layers(model)
    if not layers or next(model.parameters()).device.type != "cpu":
        return None
    loaded = load_kernels(build)
    for layer in layers:
        setattr(layer, "cpu_decode_kernel", loaded.ok)  # the kernel layers' flag, which nn.Module does not type
    return loaded


def turn_off_cpu_kernels(model: torch.nn.Module) -> None:
    """Back to PyTorch's operators in every layer (the eager path the bench compares with)."""
    for layer in _kernel_layers(model):
        setattr(layer, "cpu_decode_kernel", False)
