"""How the decoder's steps and draws become compiled graphs it calls without guard checks, the same in every process:
inductor's and dynamo's options, the process-wide settings that make a graph a compile child built found in
inductor's cache by the process that adopts it, and a compiled function with a code object of its own."""

from __future__ import annotations

import copyreg
import threading
import types
import uuid
from typing import Any, Callable

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa

from .guard_free import GuardFreeGraphs

# Inductor: store any intermediate read by more than one loop instead of recomputing it in each
# (the feature map elu + 1 was recomputed for every element of the state update otherwise), and
# call the kernels from compiled C++ rather than Python (less host work per step, which counts most at batch 1).
# No precompiled headers: to find a cached graph's library, inductor would otherwise run the C++ preprocessor
# over its headers once in every process, so a server would start compilers even with everything built ahead.
INDUCTOR_OPTIONS = {"realize_opcount_threshold": 2, "cpp_wrapper": True, "cpp_cache_precompile_headers": False}


def inductor_options() -> dict[str, Any]:
    """INDUCTOR_OPTIONS with the vector width inductor picks in this process named (`cpp.simdlen`). Left unnamed,
    ATEN_CPU_CAPABILITY picks it, which inductor's graph cache does not key on: a process capped at AVX2 found the
    graph an uncapped AVX-512 process had cached, loops stepping over 16 floats, and built it with 8-float vectors
    (draws that skipped half the vocabulary). Named, it is one of the options the cache keys on."""
    isa = pick_vec_isa()
    return INDUCTOR_OPTIONS | ({"cpp.simdlen": isa.bit_width()} if isa else {})


# Dynamo, while warming up (the only time it traces): softmax reads `int(lengths.max())` to size its
# prefix, traced as a symbolic integer, not a graph break. A model's Python floats (linear attention's eps)
# are constants of its graph: left to dynamo, whether one became a graph input depended on what the process
# had traced before (a linear model traced after a softmax one got another graph than its fresh compile
# child had built, and missed inductor's cache when adopting it).
DYNAMO_OPTIONS = {
    "capture_scalar_outputs": True,
    "specialize_float": True,
    "recompile_limit": 64,
    "accumulated_recompile_limit": 4096,
}


def _memory_format_named(name: str) -> torch.memory_format:
    memory_format: torch.memory_format = getattr(torch, name)
    return memory_format


def _reduce_memory_format(
    memory_format: torch.memory_format,
) -> tuple[Callable[[str], torch.memory_format], tuple[str]]:
    return _memory_format_named, (str(memory_format).removeprefix("torch."),)


def same_cache_keys_in_every_process() -> None:
    """Pickle memory formats by a name that does not depend on the process, so that inductor's cache keys do
    not either: a memory format pickles as a bare global, whose module pickle finds by scanning sys.modules,
    and the first module that imports torch differs between a process and its spawned children (a spawned
    child's main module comes first). The keys then differed, and a process adopting the graphs its compile
    child had built missed the cache and compiled them again itself. (Inductor's pickler copies copyreg's
    table whenever it is made.)"""
    copyreg.pickle(torch.memory_format, _reduce_memory_format)


def progress_bars_lock_this_process_only() -> None:
    """Give tqdm a thread lock before tracing makes its first progress bar. torch.fx's interpreter makes a
    (disabled) tqdm bar while tracing, and tqdm's first bar otherwise makes a lock shared across processes: a
    POSIX semaphore, registered with multiprocessing's resource tracker and released only by a clean exit. A
    compile child is killed with its process group when the server stops mid-compile, so the tracker, shared with
    the server, found it at shutdown and warned of a leaked semaphore. No bar here is shared between processes."""
    try:
        from tqdm import tqdm
    except ImportError:  # torch.fx makes no bar then
        return
    if "_lock" not in vars(tqdm):  # none made yet (once made, the semaphore exists: replacing it frees nothing)
        tqdm.set_lock(threading.RLock())


def code_of_its_own(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object (and a name) of its own. Dynamo keeps its graphs and the shapes it has seen per
    code object and name: with the plain function, a second model in a process would be traced with the sizes
    that differ from the first model's made symbolic, a graph unlike the one its compile child (a fresh
    process) built, so the adopt would miss inductor's cache. With its own code, each decoder is traced as
    in a fresh process."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{uuid.uuid4().hex[:12]}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compiled_guard_free(fn: Callable[..., Any]) -> GuardFreeGraphs:
    """torch.compile of a copy of `fn` with a code of its own, and its guard-free calls."""
    own = code_of_its_own(fn)
    return GuardFreeGraphs(own, torch.compile(own, dynamic=True, fullgraph=True, options=inductor_options()))
