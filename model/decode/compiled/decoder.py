"""Decode steps and sampling compiled for the CPU with torch.compile: the default fast path.

On a CPU a decode step of a small model is a few hundred small operators,
and at batch 64 launching them one by one costs about as much as the
matrix products. torch.compile (inductor) traces `Transformer.decode_step`
once and emits a few C++ loops per layer that fuse the small operators
(layer norms, biases, feature maps, the state update and read-out, the
residuals) between the matrix products; sampling a batch that asks for no
top-k or top-p (the temperature, each row's uniform, the weights' running sum
and the count of sums below the row's target, the greedy rows' argmax) becomes
a few loops as well. Filtered batches sample eagerly:
their sort of the vocabulary costs far more than the loop saves.

Every linear layer runs a C++ kernel on weights packed once
(model/kernels/packed_linear.py, model/kernels/packed_linear.cpp): the steps run the
model's decode twin, its layers swapped for packed ones. For float32 models
on CPUs with AVX-512 or AVX2, once the kernels are built; otherwise the model as it is.
A linear model of the paper's shape (elu + 1 features, learned positions, exact
GELU) goes further: each step is one C++ call on the twin's weights
(model/decode/compiled/linear_step.py), from the moment the kernels load, without a graph;
its draws still run compiled, and only they are compiled for it.

The batch dimension is compiled symbolically, so one graph serves every
batch of 2 rows or more, and a second one the single row (torch.compile
specialises sizes 0 and 1). Inductor splits a loop over threads only where
the work it sees when tracing pays for the split, and it sees the row count
it traced with: a graph traced on 2 rows leaves most of its fused loops on
one thread, one traced for many rows splits them, which pays at many rows
and costs at few. So a decoder of `MANY_ROWS.fewest` rows or more of a constant-state kind,
given more than one thread, compiles a third graph, for that many rows or
more, traced with that row count as the size's hint: two or three compiles
per model, whatever --max-batch.
Softmax's growing prefix is symbolic too. Rows are those of the state the
decoder was made with, [0, n), as for the eager decoder: no padding needed.

Once a row class is warmed up, its steps and draws call the graphs dynamo
compiled for them directly, without dynamo's per-call guard checks
(model/decode/compiled/guard_free.py): the decoder fixes its inputs' layouts itself, so the
checks, done once at capture, could only pass again (the draw's temperature
lives in its graph for the same reason).

Compiling takes seconds to a minute per graph on a small CPU. `compile()`
does it in the caller (generate, the bench, `rnnserve build-kernels`);
`compile(background=True)` (the server: start-up is not held up) decodes
eagerly meanwhile and compiles in a child process (model/decode/compiled/compile_child.py),
at a lower CPU priority so that the eager steps serving requests keep their
cores, holding a `gate` (a lock several decoders share: the server's models
compile one at a time, and each is fast sooner). The thread that runs the
steps then adopts the graphs between two steps (`adopt_compiled`), from
inductor's cache: no compiler runs in the serving process, and no trace runs
beside a step. Each compile is logged with its time. A compile that fails
(e.g. no C++ compiler) is logged and that decoder stays eager.

Which kinds are compiled is what they declare (`compilable` in
model/attention/base.py's capabilities). Reformer's step masks a cache written by
position (model/attention/reformer/decode.py), so its prefix is symbolic as softmax's.
"""

from __future__ import annotations

import copyreg
import logging
import os
import threading
import time
import types
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch._inductor.config
from torch._inductor.cpu_vec_isa import pick_vec_isa

from .compile_child import PARTLY_COMPILED, CompileJob, become_compile_child, compile_in_child
from ...kernels.loader import KernelBuild, load_kernels, use_cpu_kernels
from ..eager_and_cuda_graphs import EagerDecoder
from ...kernels.packed_linear import decode_twin, packs
from .guard_free import GuardFreeGraphs
from .linear_step import WholeLinearStep, whole_linear_step
from ...attention.classes import kinds_where
from ..sampling import BatchSampling, draw_unfiltered, sample
from ...state import ModelState
from ...transformer import Transformer

log = logging.getLogger("rnnserve.compiled_decode")

# Inductor: store any intermediate read by more than one loop instead of recomputing it in each
# (the feature map elu + 1 was recomputed for every element of the state update otherwise), and
# call the kernels from compiled C++ rather than Python (less host work per step, which counts most at batch 1).
# No precompiled headers: to find a cached graph's library, inductor would otherwise run the C++ preprocessor
# over its headers once in every process, so a server would start compilers even with everything built ahead.
INDUCTOR_OPTIONS = {"realize_opcount_threshold": 2, "cpp_wrapper": True, "cpp_cache_precompile_headers": False}


def inductor_options() -> dict:
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
# A background compile's niceness above its process's: under load the eager steps get about 90% of a core
# it shares with them (Linux weighs nice 0 against nice 10 as 1024 to 110); idle, the compile runs at full speed.
BACKGROUND_COMPILE_NICENESS = 10
COMPILE_THREAD = "compile-decode"
# What a background compile holds while it runs, so that a server's models compile in turn (server/engine/compile_gate.py).
CompileGate = AbstractContextManager[object]


@dataclass(frozen=True)
class RowClass:
    """Steps of `fewest` rows or more (up to the next class's fewest) run one graph, traced with `fewest` as
    the row count's size hint, so that its loops are split over threads where that many rows pay for it."""

    fewest: int
    name: str

    @property
    def scratch_rows(self) -> int:
        """Rows of the scratch state it is traced on: a hint stands in for more (no state of that size made)."""
        return min(self.fewest, 2)

    @property
    def hinted(self) -> bool:
        """Traced with a size hint: an optional class, whose rows a class of fewer rows serves without it."""
        return self.fewest > self.scratch_rows


ONE_ROW = RowClass(1, "1 row")
FEW_ROWS = RowClass(2, "2 or more rows")
# A graph traced for many rows splits loops that do not pay for their threads' start and join at few rows:
# at 2 and 8 rows it ran slower, at 48 and 64 faster (benchmarks/results/NOTES.md, "Row classes"); where between
# them it starts to pay was not measured finely.
MANY_ROWS = RowClass(48, "48 or more rows")
ROW_CLASSES = (FEW_ROWS, ONE_ROW, MANY_ROWS)  # compile order: the most used first


def _memory_format_named(name: str) -> torch.memory_format:
    return getattr(torch, name)


def _reduce_memory_format(memory_format: torch.memory_format) -> tuple:
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


@dataclass
class CompileLog:
    """What was compiled and how long it took (seconds per shape class), and what failed."""

    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    kernels: KernelBuild | None = None  # the C++ kernels the steps call (model/kernels/loader.py); None: none apply
    left_out: list[str] = field(default_factory=list)  # optional row classes whose compile failed


def background_compiles_running() -> bool:
    """Whether a decoder's background compile thread is still at work in this process."""
    return any(thread.name == COMPILE_THREAD and thread.is_alive() for thread in threading.enumerate())


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's niceness (Linux: per thread, inherited by the threads and processes it
    starts); nothing where threads have no priority of their own."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError as exc:  # e.g. a sandbox that forbids it: compile at the same priority
        log.debug("could not lower the compile thread's priority: %s", exc)


def _decode_step(model: Transformer, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
    return model.decode_step(tokens, state)


def code_of_its_own(fn: Callable) -> Callable:
    """`fn` with a code object (and a name) of its own. Dynamo keeps its graphs and the shapes it has seen per
    code object and name: with the plain function, a second model in a process would be traced with the sizes
    that differ from the first model's made symbolic, a graph unlike the one its compile child (a fresh
    process) built, so the adopt would miss inductor's cache. With its own code, each decoder is traced as
    in a fresh process."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{uuid.uuid4().hex[:12]}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledDecoder(EagerDecoder):
    """Decode steps (and draws) on rows [0, n) of a preallocated state through compiled graphs, once ready."""

    def __init__(
        self,
        model: Transformer,
        state: ModelState,
        row_classes: Sequence[RowClass] = ROW_CLASSES,
        one_call: bool = True,
    ):
        """one_call=False: the compiled graphs even for a model whose steps could be one C++ call (to compare)."""
        super().__init__(model, state)
        self._one_call_allowed = one_call
        if not model.capabilities.compilable:
            raise ValueError(
                f"{model.config.attention} decode steps are not compiled; compilable kinds: "
                f"{', '.join(kinds_where(lambda c: c.compilable))}"
            )
        if model.device.type != "cpu":
            raise ValueError(f"the compiled decode path is for the CPU, this model is on {model.device}")
        self.row_classes = [c for c in row_classes if c.fewest <= state.batch_size]
        # One compiled function per row class and job, each with a code of its own: dynamo keeps a class's
        # graph apart from the others' (which a call's guards alone could not tell apart). Once a class is
        # warmed up, its steps skip dynamo's per-call guard checks (model/decode/compiled/guard_free.py).
        self._graphs = {c.fewest: compiled_guard_free(_decode_step) for c in self.row_classes}
        self._draws = {c.fewest: compiled_guard_free(draw_unfiltered) for c in self.row_classes}
        self.ready: set[int] = set()  # the `fewest` of the row classes whose graphs are compiled
        self._class_by_rows: list[int | None] = [None] * (state.batch_size + 1)
        self.log = CompileLog()
        self._finished = threading.Event()  # compile_now has run to its end (compiled or failed)
        with torch.inference_mode(self._inference_tensors):
            self._token_buffer = torch.zeros(state.batch_size, dtype=torch.long, device=model.device)
        self._row_views: dict[int, ModelState] = {}
        self._twin: Transformer | None = None  # the model's decode twin, once the kernels are built (use_kernels)
        self._whole_step: WholeLinearStep | None = None  # its steps as one C++ call, for the models that takes
        self._compiled_elsewhere = threading.Event()  # a background compile's child is done: adopt its graphs
        self._background_batch: int | None = None

    @property
    def _inference_tensors(self) -> bool:
        """Whether the state is made of inference tensors: the graphs' guards tell them from ordinary ones,
        so the decoder's own buffers and its warm-up's scratch inputs are made the same way."""
        return self.state.lengths.is_inference()

    @property
    def compiled(self) -> bool:
        """Whether steps run compiled: a graph is ready and nothing has failed."""
        return bool(self.ready) and self.log.error is None

    def class_for(self, rows: int) -> int | None:
        """The `fewest` of the compiled row class that serves `rows` rows: the most rows' class that takes
        them (while a class is compiling, one of fewer rows takes its steps); None: none ready, or failed."""
        if self.model.training or not 0 <= rows < len(self._class_by_rows):  # graphs are traced in eval mode
            return None
        return self._class_by_rows[rows]

    @property
    def one_call_steps(self) -> bool:
        """Whether its steps run as one C++ call each (model/decode/compiled/linear_step.py): from the moment the
        kernels load, for the models that call takes, in eval mode."""
        return self._whole_step is not None and not self.model.training

    def describe_route(self) -> str:
        """E.g. 'avx512: compiled steps, linear layers on the packed kernel' (or, for a model the one-call step
        takes, 'avx2: one-call steps on the packed kernel, compiled sampling'): the route of the kernels this
        decoder loaded (not the one the process would pick), and whether its steps run compiled yet."""
        compiling = "" if self._finished.is_set() else " (compiling)"
        steps = ("compiled steps" if self.compiled else "eager steps") + compiling
        kernels = self.log.kernels
        if kernels is None or not kernels.ok:
            return f"{steps} on PyTorch's operators"
        if self.one_call_steps:
            sampling = "compiled" if self.compiled else "eager"
            return f"{kernels.route}: one-call steps on the packed kernel, {sampling} sampling{compiling}"
        layers = "the packed kernel" if self.compiled and self._twin is not None else "PyTorch's products"
        return f"{kernels.route}: {steps}, linear layers on {layers}"

    def _route_rows(self) -> None:
        """`class_for`'s table, made again whenever a class compiles or a compile fails (a step looks its
        class up rather than searching for it)."""
        self._class_by_rows = [self._serving_class(n) for n in range(self.state.batch_size + 1)]

    def _serving_class(self, rows: int) -> int | None:
        if self.log.error is not None or rows == 0:
            return None
        if rows == 1:
            return 1 if 1 in self.ready else None
        return max((c for c in self.ready if 2 <= c <= rows), default=None)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        if self._whole_step is not None and self.one_call_steps:  # needs no graph: from the moment the kernels load
            return self._whole_step(self._tokens(tokens), self._rows(n))
        row_class = self.class_for(n)
        if row_class is not None:
            try:  # no dynamo config patch per step (entering one is not free): it only matters when compiling, in _warm_up
                step = self._graphs[row_class]
                return step(row_class, self._stepped_model, self._tokens(tokens), self._rows(n))
            except Exception as exc:  # a recompile that failed: it stopped before running the step
                self._fail("decode step", exc)
        return super().__call__(tokens)

    def captured(self, rows: int) -> bool:
        """Whether n rows' draws, and their steps unless those are one C++ call, run their class's graphs without
        guard checks."""
        row_class = self.class_for(rows)
        jobs = (self._graphs, self._draws) if self._compiles_steps else (self._draws,)
        return row_class is not None and all(g[row_class].captured(row_class) for g in jobs)

    @property
    def _compiles_steps(self) -> bool:
        """Whether compiling makes step graphs besides the draws: not where the steps are one C++ call (a graph
        they would never run is not worth its compile)."""
        return self._whole_step is None

    def step_inputs_accepted(self, n: int) -> bool:
        """Whether the graph captured for n rows passes its guards on this decoder's n-row inputs: what its
        guard-free calls assume (the tests check it for every call of a generation)."""
        row_class = self.class_for(n)
        return row_class is not None and self._graphs[row_class].accepts(row_class, *self._step_inputs(n))

    def _step_inputs(self, n: int) -> tuple:
        """The arguments an n-row step passes its graph (the token buffer read as it is, not written)."""
        return self._stepped_model, self._token_buffer[:n], self._rows(n)

    def _rows(self, n: int) -> ModelState:
        """The state's rows [0, n), made once per n: views of the same tensors every step."""
        if n not in self._row_views:
            self._row_views[n] = self.state.slice(0, n)
        return self._row_views[n]

    def _tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens in a buffer of unit stride: a strided column would compile again."""
        buffer = self._token_buffer[: tokens.shape[0]]
        buffer.copy_(tokens)
        return buffer

    def sample(self, logits: torch.Tensor, params: BatchSampling, position: torch.Tensor) -> torch.Tensor:
        """`model.decode.sampling.sample`; once this many rows' graphs are compiled, a batch that asks for no top-k
        or top-p draws through one compiled graph (temperature, uniforms, inverse CDF, argmax), guard-free."""
        row_class = self.class_for(logits.shape[0])
        # Filtered batches and rows whose graphs are not ready sample eagerly: no layout work for them.
        args = (
            self._draw_inputs(logits, params.temperature, params.seed, position)
            if params.filters is False and row_class is not None
            else None
        )
        if args is None or row_class is None:
            return sample(logits, params, position)
        try:
            return self._draws[row_class](row_class, *args)
        except Exception as exc:  # a failed recompile stops before running: the same draw, eagerly
            self._fail("sampling", exc)
            return draw_unfiltered(*args)

    @staticmethod
    def _draw_inputs(logits: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The draw's inputs in the one layout its graphs were captured with, which their guard-free calls rely
        on: (n, V) float32 logits, then temperature float32, seed and position int64, (n,) each; unit strides
        (a prefill's last position is a strided view); made under inference mode. None for other shapes."""
        if logits.dim() != 2 or any(t.shape != logits.shape[:1] for t in rows):
            return None
        typed = (logits.float(), rows[0].float(), rows[1].long(), rows[2].long())
        return tuple(
            t if t.is_contiguous() and t.is_inference() else t.clone(memory_format=torch.contiguous_format)
            for t in typed
        )

    # -- compiling ----------------------------------------------------------------
    def compile(
        self, background: bool = False, batch: int | None = None, gate: CompileGate | None = None
    ) -> CompileLog | None:
        """Compile now (returns what was compiled), or in the background while steps run eagerly (returns
        None): a child process compiles (model/decode/compiled/compile_child.py), and the thread that runs the steps
        then adopts its graphs between two steps (`adopt_compiled`). batch: only the graph a batch of that many rows
        uses (a fixed-batch loop); None: all the decoder's. gate: held while the child compiles."""
        if not background:
            return self.compile_now(batch)
        job = CompileJob(
            self.model,
            self.state.batch_size,
            self._inference_tensors,
            torch.get_num_threads(),  # the caller's: an engine's share of the server's CPUs
            batch,
            logging.getLogger("rnnserve").getEffectiveLevel(),
            tuple(self.row_classes),
        )
        self._background_batch = batch
        threading.Thread(target=self._compile_in_child, args=(job, gate), name=COMPILE_THREAD, daemon=True).start()
        return None

    def _compile_in_child(self, job: CompileJob, gate: CompileGate | None) -> None:
        lower_thread_priority(BACKGROUND_COMPILE_NICENESS)  # inherited by the child and its compilers
        # Before waiting for a turn: the kernels speed up the eager steps too. Only kernels built ahead
        # (`rnnserve build-kernels`): requests are being served meanwhile, so nothing is built here.
        self.use_kernels(build=False)
        job = replace(job, one_call=not self._compiles_steps)  # the child compiles what this decoder will trace
        with gate if gate is not None else nullcontext():
            outcome = compile_in_child(job, compile_job)
        if outcome.error is None:
            if outcome.optional_left_out:  # not traced here either: it would compile beside the steps
                self.log.left_out += [c.name for c in self.row_classes if c.hinted]
            self._compiled_elsewhere.set()
            return
        self.log.error = f"background compile: {outcome.error}"
        self._route_rows()
        log.warning(
            "compiling the %s decode steps failed (%s); decoding eagerly", self.model.config.attention, outcome.error
        )
        self._finished.set()

    def adopt_compiled(self) -> None:
        """(The thread that runs the steps, between two of them.) Once the child has compiled, trace the steps
        here: every graph comes from inductor's cache, and no step runs meanwhile. A failure leaves them eager."""
        if not self._compiled_elsewhere.is_set() or self._finished.is_set():
            return
        self._compiled_elsewhere.clear()
        # Traced as the child traced them (outside inference mode, which the engine's loop runs in), so that
        # the graphs are the same and come from the cache; should it miss anyway, no pool of workers here.
        with torch.inference_mode(False), torch._inductor.config.patch(compile_threads=1):
            self.compile_now(self._background_batch, verb="adopted")

    def compile_now(self, batch: int | None = None, verb: str = "compiled") -> CompileLog:
        """Compile the shape classes here and now, one log line each; a failure leaves decoding eager."""
        same_cache_keys_in_every_process()
        progress_bars_lock_this_process_only()
        self.use_kernels()  # first, so that the graphs call them
        for row_class in self._classes_to_compile(batch):
            if row_class.fewest in self.ready or self.log.error is not None:
                continue
            start = time.perf_counter()
            try:
                self._warm_up(row_class)
                self._capture(row_class)
            except Exception as exc:  # a missing C++ compiler, an operator it cannot trace
                if row_class.hinted:  # optional: the class of fewer rows serves its rows
                    self._leave_out(row_class, exc)
                    continue
                self._fail("decode step", exc)
                break
            self.log.seconds[row_class.name] = time.perf_counter() - start
            self.ready.add(row_class.fewest)
            self._route_rows()
            log.info(
                "%s the %s %s for %s in %.1f s",
                verb,
                self.model.config.attention,
                "decode step and sampling" if self._compiles_steps else "sampling (its steps are one C++ call)",
                row_class.name,
                self.log.seconds[row_class.name],
            )
        self._finished.set()
        return self.log

    def _leave_out(self, row_class: RowClass, exc: Exception) -> None:
        self.log.left_out.append(row_class.name)
        log.warning(
            "compiling the %s decode step for %s failed (%s: %s); fewer rows' graph serves them",
            self.model.config.attention,
            row_class.name,
            type(exc).__name__,
            first_line(exc),
        )

    def _classes_to_compile(self, batch: int | None) -> list[RowClass]:
        """All the decoder's row classes, or the one a fixed batch of `batch` rows runs; a hinted class only
        where it pays. (With one thread, the caller's or the compile child's, the same, inductor splits no
        loop: a hinted class would compile the 2-row graph again.)"""
        classes = [
            c for c in self.row_classes if not c.hinted or (self._many_rows_pay() and c.name not in self.log.left_out)
        ]
        if batch is None:
            return classes
        return [max((c for c in classes if c.fewest <= max(batch, 1)), key=lambda c: c.fewest)]

    def _many_rows_pay(self) -> bool:
        """Whether a graph traced for many rows is worth its compile: with more than one thread, for the kinds
        of constant state, whose state update runs in the fused loops. Softmax's attention runs in its own
        kernel, and its steps measured no faster on such a graph (benchmarks/results/NOTES.md, "Row classes")."""
        return torch.get_num_threads() > 1 and self.model.capabilities.constant_state

    def use_kernels(self, build: bool = True) -> None:
        if self.log.kernels is None:
            # The attention kernels of the layers that have one, and the linear layers' kernel for the twin.
            packed = packs(self.model)
            self.log.kernels = use_cpu_kernels(self.model, build) or (load_kernels(build) if packed else None)
            if packed and self.log.kernels is not None and self.log.kernels.ok:
                self._twin = decode_twin(self.model)
                self._whole_step = self._one_call_step(self._twin) if self._one_call_allowed else None

    def _one_call_step(self, twin: Transformer) -> WholeLinearStep | None:
        """The twin's one-call step, or None (the compiled graphs then run the steps): should gathering its
        weights fail, that is logged, and nothing else changes (it runs on a background compile's thread)."""
        try:
            return whole_linear_step(twin)
        except Exception as exc:
            log.warning("the one-call %s step is off (%s: %s)", self.model.config.attention, type(exc).__name__, exc)
            return None

    @property
    def _stepped_model(self) -> Transformer:
        """What the compiled steps run: the model's decode twin (model/kernels/packed_linear.py) once it is made; the
        model itself before, without the kernels, or in training mode (the twin is a snapshot)."""
        return self._twin if self._twin is not None and not self.model.training else self.model

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def _fail(self, what: str, exc: Exception) -> None:
        self.log.error = f"{what}: {type(exc).__name__}: {first_line(exc)}"
        self._route_rows()
        log.warning(
            "compiling the %s %s failed (%s); decoding eagerly", self.model.config.attention, what, self.log.error
        )

    @torch.inference_mode()
    def _capture(self, row_class: RowClass) -> None:
        """Pick the warmed-up graphs for this decoder's own inputs of that row class (its state views, its
        token buffer; read only, as steps may be running on another thread), and the draw's for inputs laid
        out as `_draw_inputs` lays them: graphs that take the class's fewest rows, one more, and all the
        rows (a class of fewer rows serves more while a class of more is compiling)."""
        fewest, most = row_class.fewest, self.state.batch_size
        counts = [1] if fewest == 1 else sorted({n for n in (fewest, fewest + 1, most) if n <= most})
        key = row_class.fewest
        if self._compiles_steps:
            self._graphs[key].capture(key, [self._step_inputs(n) for n in counts])
        self._draws[key].capture(key, [self._draw_scratch(n) for n in counts])

    @torch.inference_mode()
    def _warm_up(self, row_class: RowClass) -> None:
        """A compiled step (unless the steps are one C++ call) and a compiled draw on a scratch state, made as
        the decoder's own state was (inference tensors or not), so that its steps find the graph compiled here;
        traced with the class's fewest rows as the row count's size hint."""
        rows = row_class.scratch_rows
        with torch.inference_mode(self._inference_tensors):
            scratch = self.model.new_state(rows)
            tokens = torch.zeros(rows, dtype=torch.long, device=self.model.device)
        draw = self._draw_scratch(rows)
        if rows > 1:
            # The row count is a size of its own from the first trace: traced as a plain 2 it would be taken
            # for any other size of 2 (two key heads in grouped-query attention) and stay specialised to it.
            hint = {"hint_override": row_class.fewest} if row_class.hinted else {}
            for t in [tokens, scratch.lengths, *(t for layer in scratch.layers for t in layer.tensors()), *draw]:
                torch._dynamo.mark_dynamic(t, 0, **hint)
        with torch._dynamo.config.patch(DYNAMO_OPTIONS):
            if self._compiles_steps:
                self._graphs[row_class.fewest](None, self._stepped_model, tokens, scratch)
            self._draws[row_class.fewest](None, *draw)

    def _draw_scratch(self, rows: int) -> tuple[torch.Tensor, ...]:
        """Inputs of an unfiltered draw for `rows` rows, laid out as `_draw_inputs` lays a caller's out."""
        device = self.model.device
        scratch = self._draw_inputs(
            torch.zeros(rows, self.model.config.vocab_out, device=device),
            torch.ones(rows, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
        )
        assert scratch is not None  # made in the layout the draw takes
        return scratch


def first_line(exc: Exception) -> str:
    """An error's first line: what a log line or `CompileLog.error` keeps of it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def compiled_guard_free(fn: Callable) -> GuardFreeGraphs:
    """torch.compile of a copy of `fn` with a code of its own, and its guard-free calls."""
    own = code_of_its_own(fn)
    return GuardFreeGraphs(own, torch.compile(own, dynamic=True, fullgraph=True, options=inductor_options()))


def compile_fresh(
    model: Transformer,
    rows: int,
    inference_tensors: bool = True,
    batch: int | None = None,
    row_classes: Sequence[RowClass] = ROW_CLASSES,
    one_call: bool = True,
) -> CompileLog:
    """Compile `model`'s steps for a state of `rows` rows here and now, as a server's background compile does
    (only kernels built ahead, no pool of worker processes): what its child and `rnnserve build-kernels` run.
    one_call=False: the step graphs even where the steps could be one C++ call (`CompiledDecoder`)."""
    model = model.eval()
    with torch.inference_mode(inference_tensors):
        state = model.new_state(rows)
    decoder = CompiledDecoder(model, state, row_classes, one_call)
    decoder.use_kernels(build=False)
    with torch._inductor.config.patch(compile_threads=1):
        return decoder.compile_now(batch)


def compile_job(job: CompileJob) -> None:
    """A background compile's child process (model/decode/compiled/compile_child.py); exit status 0 once compiled,
    PARTLY_COMPILED when an optional graph was left out."""
    become_compile_child(job)
    compiled = compile_fresh(job.model, job.rows, job.inference_tensors, job.batch, job.row_classes, job.one_call)
    raise SystemExit(1 if compiled.error is not None else PARTLY_COMPILED if compiled.left_out else 0)
