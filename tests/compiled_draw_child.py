"""A child process of tests/test_compiled_decode.py: compiles a tiny linear model's decode steps and draws on
the product's path and prints, as JSON, how many of its compiled draws differ from eager ones. The parent runs it
under different ATEN_CPU_CAPABILITY values over one inductor cache."""

from __future__ import annotations

import json

import torch

from conftest import make_tiny_model
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.sampling import BatchSampling, SamplingParams, sample

ROWS = 8


def compiled_decoder() -> CompiledDecoder:
    model = make_tiny_model("linear")
    decoder = CompiledDecoder(model, model.new_state(ROWS))
    compiled = decoder.compile_now(batch=ROWS)
    assert compiled.error is None and decoder.captured(ROWS), compiled
    return decoder


@torch.inference_mode()
def differing_draws(decoder: CompiledDecoder, positions: int = 40) -> int:
    logits = torch.randn(ROWS, decoder.model.config.vocab_out, generator=torch.Generator().manual_seed(3)) * 3
    temperatures = [0.0 if row % 4 == 3 else 0.6 + row / 5 for row in range(ROWS)]
    params = BatchSampling.from_params([SamplingParams(temperature=t, seed=row) for row, t in enumerate(temperatures)])
    differing = 0
    for position in range(positions):
        where = torch.full((ROWS,), position)
        differing += int((decoder.sample(logits, params, where) != sample(logits, params, where)).sum())
    return differing


if __name__ == "__main__":
    print(json.dumps({"differing": differing_draws(compiled_decoder()), "draws": 40 * ROWS}))
