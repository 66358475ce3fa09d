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
(model/decode/compiled/linear_step.py), from the moment the kernels load, without a graph; so does a hybrid
model of that block whose sizes the hybrid attention kernel takes (model/decode/compiled/hybrid_step.py);
its unfiltered draws run in C++ too (model/kernels/categorical_draw.cpp), inside the step's call where a
generation asks for both (`step_and_sample`). Only its draws are compiled, for the batches the C++ draw does
not take as they are (other dtypes).

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

import logging
import threading
import time
from dataclasses import replace
from typing import Sequence
from contextlib import nullcontext

import torch
import torch._inductor.config

from ...attention.classes import kinds_where
from ...kernels.loader import load_kernels, use_cpu_kernels
from ...kernels.packed_linear import decode_twin, packs
from ...state import ModelState
from ...transformer import Transformer
from ..eager_and_cuda_graphs import EagerDecoder
from ..sampling import BatchSampling, draw_unfiltered, sample
from .background import BACKGROUND_COMPILE_NICENESS, COMPILE_THREAD, CompileGate, lower_thread_priority
from .compile_child import PARTLY_COMPILED, CompileJob, become_compile_child, compile_in_child
from .drawing import draw_inputs, kernel_draw_rows, kernel_takes_logits
from .graphs import progress_bars_lock_this_process_only, same_cache_keys_in_every_process
from .lifecycle import CompileLog, classes_to_compile, first_line
from .one_call import one_call_step
from .routing import ROW_CLASSES, RowClass, RowRoutes
from .warm_up import ClassGraphs
from .whole_step import StepOnRows, WholeStep

log = logging.getLogger("rnnserve.compiled_decode")


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
        self.graphs = ClassGraphs(self.row_classes)  # each class's compiled step and draw
        self.routes = RowRoutes(state.batch_size)  # which class's graphs serve n rows, once ready
        self.log = CompileLog()
        self._finished = threading.Event()  # compile_now has run to its end (compiled or failed)
        with torch.inference_mode(self._inference_tensors):
            self._token_buffer = torch.zeros(state.batch_size, dtype=torch.long, device=model.device)
        self._row_views: dict[int, ModelState] = {}
        self._twin: Transformer | None = None  # the model's decode twin, once the kernels are built (use_kernels)
        self._whole_step: WholeStep | None = None  # its steps as one C++ call, for the models that takes
        self._whole_step_rows: dict[int, StepOnRows] = {}  # that call on the row views, made once per n and step
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

    @property
    def ready(self) -> set[int]:
        """The `fewest` of the row classes whose graphs are compiled."""
        return self.routes.ready

    def class_for(self, rows: int) -> int | None:
        """The `fewest` of the compiled row class that serves `rows` rows (`RowRoutes.class_for`); None in
        training mode (graphs are traced in eval mode)."""
        return None if self.model.training else self.routes.class_for(rows)

    @property
    def one_call_steps(self) -> bool:
        """Whether its steps run as one C++ call each (model/decode/compiled/one_call.py): from the moment the
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
            return f"{kernels.route}: one-call steps on the packed kernel, draws in C++{compiling}"
        layers = "the packed kernel" if self.compiled and self._twin is not None else "PyTorch's products"
        return f"{kernels.route}: {steps}, linear layers on {layers}"

    def _route_rows(self) -> None:
        self.routes.reroute(failed=self.log.error is not None)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        if self._whole_step is not None and self.one_call_steps:  # needs no graph: from the moment the kernels load
            return self._one_call_rows(self._whole_step, n)(self._tokens(tokens))
        row_class = self.class_for(n)
        if row_class is not None:
            try:  # no dynamo config patch per step (entering one is not free): it only matters when compiling, in _warm_up
                step = self.graphs.steps[row_class]
                logits: torch.Tensor = step(row_class, self._stepped_model, self._tokens(tokens), self._rows(n))
                return logits
            except Exception as exc:  # a recompile that failed: it stopped before running the step
                self._fail("decode step", exc)
        return super().__call__(tokens)

    def captured(self, rows: int) -> bool:
        """Whether n rows' draws, and their steps unless those are one C++ call, run their class's graphs without
        guard checks."""
        row_class = self.class_for(rows)
        return row_class is not None and self.graphs.captured(row_class, self._compiles_steps)

    @property
    def _compiles_steps(self) -> bool:
        """Whether compiling makes step graphs besides the draws: not where the steps are one C++ call (a graph
        they would never run is not worth its compile)."""
        return self._whole_step is None

    def step_inputs_accepted(self, n: int) -> bool:
        """Whether the graph captured for n rows passes its guards on this decoder's n-row inputs: what its
        guard-free calls assume (the tests check it for every call of a generation)."""
        row_class = self.class_for(n)
        return row_class is not None and self.graphs.steps[row_class].accepts(row_class, *self._step_inputs(n))

    def _step_inputs(self, n: int) -> tuple[Transformer, torch.Tensor, ModelState]:
        """The arguments an n-row step passes its graph (the token buffer read as it is, not written)."""
        return self._stepped_model, self._token_buffer[:n], self._rows(n)

    def _rows(self, n: int) -> ModelState:
        """The state's rows [0, n), made once per n: views of the same tensors every step."""
        if n not in self._row_views:
            self._row_views[n] = self.state.slice(0, n)
        return self._row_views[n]

    def _one_call_rows(self, step: WholeStep, n: int) -> StepOnRows:
        """The one-call step on the state's rows [0, n), made once per n as their views are: its arguments, the
        per-layer state tensors among them, are the same every step. Kept for that step only: one taken since
        (`_whole_step` set again) gathers its own weights."""
        rows = self._whole_step_rows.get(n)
        if rows is None or rows.step is not step:
            rows = self._whole_step_rows[n] = step.on_rows(self._rows(n))
        return rows

    def _tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens in a buffer of unit stride: a strided column would compile again."""
        buffer = self._token_buffer[: tokens.shape[0]]
        buffer.copy_(tokens)
        return buffer

    def sample(self, logits: torch.Tensor, params: BatchSampling, position: torch.Tensor) -> torch.Tensor:
        """`model.decode.sampling.sample`; a batch that asks for no top-k or top-p draws in C++ where the steps are
        one C++ call (model/kernels/categorical_draw.cpp), else, once this many rows' graphs are compiled, through
        one compiled graph (temperature, uniforms, inverse CDF, argmax), guard-free."""
        rows = kernel_draw_rows(params, position) if self._draws_in_kernel else None
        if rows is not None and kernel_takes_logits(logits):
            drawn = torch.empty(logits.shape[0], dtype=torch.long)
            torch.ops.rnnserve.categorical_draw(logits, *rows, drawn)
            return drawn
        row_class = self.class_for(logits.shape[0])
        # Filtered batches and rows whose graphs are not ready sample eagerly: no layout work for them.
        args = (
            draw_inputs(logits, params.temperature, params.seed, position)
            if params.filters is False and row_class is not None
            else None
        )
        if args is None or row_class is None:
            return sample(logits, params, position)
        try:
            graph_drawn: torch.Tensor = self.graphs.draws[row_class](row_class, *args)
            return graph_drawn
        except Exception as exc:  # a failed recompile stops before running: the same draw, eagerly
            self._fail("sampling", exc)
            return draw_unfiltered(*args)

    def step_and_sample(
        self, tokens: torch.Tensor, params: BatchSampling, position: torch.Tensor, drawn: torch.Tensor
    ) -> torch.Tensor:
        """`EagerDecoder.step_and_sample`: where the steps are one C++ call, an unfiltered batch draws inside it
        (`WholeStep.with_draw`), with no operator between a step and its draw."""
        n = tokens.shape[0]
        rows = kernel_draw_rows(params, position) if self._draws_in_kernel else None
        step = self._whole_step
        if rows is None or step is None or not step.head_inside or drawn.dtype != torch.long:
            return super().step_and_sample(tokens, params, position, drawn)
        return self._one_call_rows(step, n).with_draw(self._tokens(tokens), rows, drawn)

    @property
    def _draws_in_kernel(self) -> bool:
        """Whether unfiltered draws run in C++ (model/kernels/categorical_draw.cpp): with the one-call steps, whose
        kernels they are built with."""
        return self.one_call_steps

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
        return classes_to_compile(self.row_classes, batch, self.model, self.log.left_out)

    def use_kernels(self, build: bool = True) -> None:
        if self.log.kernels is None:
            # The attention kernels of the layers that have one, and the linear layers' kernel for the twin.
            packed = packs(self.model)
            self.log.kernels = use_cpu_kernels(self.model, build) or (load_kernels(build) if packed else None)
            if packed and self.log.kernels is not None and self.log.kernels.ok:
                self._twin = decode_twin(self.model)
                self._whole_step = self._one_call_step(self._twin) if self._one_call_allowed else None

    def _one_call_step(self, twin: Transformer) -> WholeStep | None:
        """The twin's one-call step, or None (the compiled graphs then run the steps): should gathering its
        weights fail, that is logged, and nothing else changes (it runs on a background compile's thread)."""
        try:
            return one_call_step(twin)
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

    def _capture(self, row_class: RowClass) -> None:
        self.graphs.capture(row_class, self.model, self.state.batch_size, self._step_inputs, self._compiles_steps)

    def _warm_up(self, row_class: RowClass) -> None:
        self.graphs.warm_up(row_class, self.model, self._stepped_model, self._inference_tensors, self._compiles_steps)


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
