"""Which decoder runs a model's decode steps: CUDA graphs on a GPU, compiled steps on the CPU, else eager
(each in a file of its own: model/decode/eager_and_cuda_graphs.py, model/decode/compiled/decoder.py)."""

from __future__ import annotations

import logging

from .compiled.decoder import CompiledDecoder
from .eager_and_cuda_graphs import CudaGraphDecoder, EagerDecoder, padded_sizes
from ..state import ModelState
from ..transformer import Transformer

log = logging.getLogger("rnnserve.decoders")


def make_decoder(
    model: Transformer, state: ModelState, cuda_graphs: bool, sizes: list[int] | None = None, compiled: bool = False
) -> EagerDecoder:
    """CUDA graphs when asked for and possible (a CUDA model of a graphable kind); on the CPU,
    compiled steps when asked for and the kind is compilable (see model/decode/compiled/decoder.py: the
    caller starts the compile, `decoder.compile()`); else eager.
    A capture that fails (e.g. out of memory) is logged and decoding stays eager."""
    if compiled and model.device.type == "cpu" and model.capabilities.compilable:
        return CompiledDecoder(model, state)
    if cuda_graphs and model.device.type == "cuda" and model.capabilities.graphable:
        try:
            return CudaGraphDecoder(model, state, sizes or padded_sizes(state.batch_size))
        except RuntimeError as exc:
            log.warning("CUDA graph capture failed for a %s model (%s); decoding eagerly", model.config.attention, exc)
            state.reset_rows(range(state.batch_size))
    return EagerDecoder(model, state)
