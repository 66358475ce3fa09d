"""A plain generation loop over the chunk-and-state contract (bench, eval pictures).

The server's engine does continuous batching itself; this is the simple
fixed-batch loop: one prefill chunk, then one token per step.
"""

from __future__ import annotations

import torch

from .eager_and_cuda_graphs import EagerDecoder
from .choice import make_decoder
from .sampling import BatchSampling, force_tokens
from ..transformer import SequenceTooLong, Transformer


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    total_len: int,
    sampling: BatchSampling,
    forced: torch.Tensor | None = None,
    decoder: EagerDecoder | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Extend (B, P) prompts to (B, total_len) tokens, P may be 0.

    forced (B, total_len) holds known tokens (>= 0) to keep instead of sampling.
    decoder: decode steps over a B-row state made once (e.g. CUDA graphs,
    `make_decoder`) and reused across calls; by default steps on a new state,
    compiled on the CPU for the kinds model/decode/compiled/decoder.py covers unless
    compiled=False (the first call compiles: seconds to a minute), else eager.
    """
    b, p = prompt.shape
    lead = model.config.prompt_lead(p)
    if len(lead) + total_len - 1 > model.config.max_len:  # decode steps do not check (see Transformer.decode_step)
        raise SequenceTooLong(f"cannot generate {total_len} tokens; this model's max_len is {model.config.max_len}")
    tokens = torch.empty(b, total_len, dtype=torch.long, device=model.device)
    tokens[:, :p] = prompt
    decoder = _empty_decoder(model, b, decoder, compiled)
    if p == total_len:
        return tokens
    logits = _prefill(model, decoder, lead, prompt)
    tokens[:, p:] = _draw_after(decoder, logits, sampling, forced, p, total_len).T
    return tokens


def _prefill(model: Transformer, decoder: EagerDecoder, lead: list[int], prompt: torch.Tensor) -> torch.Tensor:
    """The prompt after the model's lead (its start token, if it reads one) in one chunk: the logits (B, V) that
    predict position P. A prompt of the lead alone (a sample from scratch) is one decode step: the decoder's, not
    a prefill's pass."""
    b = prompt.shape[0]
    inputs = torch.cat([torch.tensor(lead, dtype=torch.long, device=model.device).expand(b, -1), prompt], dim=1)
    if inputs.shape[1] == 1:
        return decoder(inputs[:, 0])
    logits: torch.Tensor = model(inputs, decoder.state)[0][:, -1]
    return logits


def _draw_after(
    decoder: EagerDecoder,
    logits: torch.Tensor,
    sampling: BatchSampling,
    forced: torch.Tensor | None,
    p: int,
    total_len: int,
) -> torch.Tensor:
    """Positions [P, total_len) drawn one by one from `logits` (B, V) on: (total_len - P, B)."""
    b, device = logits.shape[0], logits.device
    # (T, B): each position's tokens and position numbers contiguous, as a step and a draw take them, viewed once
    # here rather than per token; the loop allocates nothing.
    by_position = torch.empty(total_len, b, dtype=torch.long, device=device)
    drawn = by_position.unbind(0)
    positions = torch.arange(total_len, device=device)[:, None].expand(total_len, b).contiguous().unbind(0)
    drawn[p].copy_(decoder.sample(logits, sampling, positions[p]))
    _keep_forced(drawn[p], forced, p)
    for pos in range(p + 1, total_len):
        # The step on the last token, then the draw from its logits: one call where the decoder can.
        decoder.step_and_sample(drawn[pos - 1], sampling, positions[pos], drawn[pos])
        _keep_forced(drawn[pos], forced, pos)
    return by_position[p:]


def _keep_forced(drawn: torch.Tensor, forced: torch.Tensor | None, pos: int) -> None:
    """Position `pos`'s drawn tokens (B,), in place: the known ones (forced >= 0) instead of the draws."""
    if forced is not None:
        drawn.copy_(force_tokens(drawn, forced[:, pos]))


def _empty_decoder(model: Transformer, rows: int, decoder: EagerDecoder | None, compiled: bool) -> EagerDecoder:
    """`decoder` with its state emptied, or a new one (compiled for `rows` rows where it can be)."""
    if decoder is None:
        decoder = make_decoder(model, model.new_state(rows), cuda_graphs=False, compiled=compiled)  # empty state
        decoder.compile(batch=rows)
    elif decoder.state.batch_size != rows:
        raise ValueError(f"decoder has {decoder.state.batch_size} rows for a batch of {rows}")
    else:
        decoder.state.reset_rows(range(rows))  # a reused state still holds the last generation
    return decoder
