"""The decoders that run a model's decode steps on a state: eager (`EagerDecoder`, every device; the base of
the compiled CPU path in model/decode/compiled/decoder.py), padded to a few batch sizes, and replayed as CUDA graphs.
model/decode/choice.py's `make_decoder` picks one.

On a GPU a decode step of a small model is a few hundred tiny kernels, and
launching them one by one from Python costs more than running them. A CUDA
graph replays all of a step's kernels with one launch, but only for the
shapes and tensor addresses it was captured with. So the step is captured
once per padded batch size (1, 2, 4, ... up to the slot count) on static
buffers: the token buffer, the preallocated state slots and the logits. A
step with n live rows replays the smallest captured size >= n. Live rows
are always rows [0, n) (the engine compacts them), so the padding rows are
free slots: what a step writes there is never read, and a sequence that
joins resets its row first.

Only kinds whose decode step has fixed shapes can be captured (declared
`graphable` in their capabilities, e.g. the constant-size states of linear
and Linformer). Softmax and Reformer read a prefix whose length changes
every step; they run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from ..attention.classes import kinds_where
from .sampling import BatchSampling, sample
from ..state import ModelState
from ..transformer import Transformer

if TYPE_CHECKING:
    from .compiled.background import CompileGate
    from .compiled.lifecycle import CompileLog

log = logging.getLogger("rnnserve.cuda_graphs")

WARMUP_STEPS = 3  # eager runs before capture: cuBLAS handles, allocator pools


def padded_sizes(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch: 1, 2, 4, ..., max_batch."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


class EagerDecoder:
    """Decode steps on the first n rows of a preallocated state, as launched."""

    def __init__(self, model: Transformer, state: ModelState):
        self.model = model
        self.state = state

    @property
    def graphed(self) -> bool:
        return False

    @property
    def compiled(self) -> bool:
        """Whether steps run through torch.compile graphs (model/decode/compiled/decoder.py)."""
        return False

    def describe_route(self) -> str:
        """What the steps run on now (a CPU's vector route, compiled or eager), for /v1/models."""
        return "eager steps on PyTorch's operators"

    def sample(self, logits: torch.Tensor, params: BatchSampling, position: torch.Tensor) -> torch.Tensor:
        """Draw the next tokens from these rows' logits (`model.decode.sampling.sample`)."""
        return sample(logits, params, position)

    def step_and_sample(
        self, tokens: torch.Tensor, params: BatchSampling, position: torch.Tensor, drawn: torch.Tensor
    ) -> torch.Tensor:
        """A step on tokens (n,) for rows [0, n), then each row's next token drawn from its logits (as `sample`
        draws it, at `position` (n,)) into `drawn` (n,): a token of a generation. Returns the logits (n, V)."""
        logits = self(tokens)
        drawn.copy_(self.sample(logits, params, position))
        return logits

    def compile(
        self, background: bool = False, batch: int | None = None, gate: CompileGate | None = None
    ) -> CompileLog | None:
        """Nothing to compile for these steps (see CompiledDecoder): None."""
        return None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background compile to end; True once nothing is left to compile."""
        return True

    def adopt_compiled(self) -> None:
        """(The stepping thread, between steps.) Nothing compiled elsewhere to take in (see CompiledDecoder)."""

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens (n,) for rows [0, n) -> their next-token logits (n, V)."""
        return self.model.decode_step(tokens, self.state.slice(0, tokens.shape[0]))


class PaddedDecoder(EagerDecoder):
    """Decode steps run at the smallest of `sizes` >= n, on static buffers."""

    def __init__(self, model: Transformer, state: ModelState, sizes: list[int]):
        super().__init__(model, state)
        # Padding rows restart at position 0 every step: harmless when a row's state is fixed-size or
        # written by position; Reformer does not declare it (not tested for it).
        if not model.capabilities.paddable:
            paddable = ", ".join(kinds_where(lambda c: c.paddable))
            raise ValueError(f"{model.config.attention} decode steps cannot be padded; padded kinds: {paddable}")
        if not sizes or max(sizes) > state.batch_size:
            raise ValueError(f"padded sizes {sizes} must be non-empty and fit the state's {state.batch_size} rows")
        self.sizes = sorted(sizes)
        self.tokens = torch.zeros(self.sizes[-1], dtype=torch.long, device=model.device)  # valid ids when padding
        self.logits = torch.zeros(self.sizes[-1], model.config.vocab_out, device=model.device)

    def size_for(self, n: int) -> int:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise ValueError(f"{n} rows is more than the largest padded size {self.sizes[-1]}")
        return self.sizes[i]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        size = self.size_for(n)
        self.tokens[:n].copy_(tokens)
        self.state.lengths[n:size] = 0  # padding rows: any in-range position will do
        self._run(size)
        return self.logits[:n]

    def _run(self, size: int) -> None:
        self._step(size)

    def _step(self, size: int) -> None:
        self.logits[:size] = self.model.decode_step(self.tokens[:size], self.state.slice(0, size)).float()


class CudaGraphDecoder(PaddedDecoder):
    """A PaddedDecoder whose step at each size is one CUDA graph replay."""

    def __init__(self, model: Transformer, state: ModelState, sizes: list[int]):
        super().__init__(model, state, sizes)
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    @property
    def graphed(self) -> bool:
        return True

    def _capture(self) -> None:
        # Warm up on a side stream, as torch.cuda.graph asks; the steps scribble on the state.
        side = torch.cuda.Stream(self.model.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(self.sizes[-1])
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self.state.lengths.zero_()  # capture records kernels only, but keep positions in range anyway
            graph = torch.cuda.CUDAGraph()
            # thread_local: another engine's thread using CUDA meanwhile does not break this capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._step(size)
            pool = graph.pool()
            self.graphs[size] = graph
        self.state.reset_rows(range(self.state.batch_size))  # undo the warm-up steps

    def _run(self, size: int) -> None:
        self.graphs[size].replay()
