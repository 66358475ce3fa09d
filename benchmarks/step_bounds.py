"""A decode step as the decoders run it against the limits of its parts, for a kind whose state has a fixed size, one thread.

    python -m benchmarks.step_bounds [--kind linear] [--batches 1,32,64] [--steps 400] [--rounds 3]
    benchmarks/as_avx2.sh .venv/bin/python -m benchmarks.step_bounds ...   (as an AVX2-only CPU would run it)

Random weights of the `cpu` preset. Per batch size, each the best of `rounds` rounds that take the three in turn:
  * step: the step as the bench's and the server's decoders run it (model.decode.choice.make_decoder): one C++ call
    for the linear and hybrid models model/decode/compiled/one_call.py takes, a compiled graph for the others;
  * graph step: the compiled graph's step, where the step is one call (else the same as step): what one call saves;
  * products: the step's linear layers alone, one after another in the model's order, on the weights the
    compiled step uses (the decode twin's packed ones where the CPU kernel takes them, else torch's), and
    their FLOP rate, to read against `python -m benchmarks.fma_peak`;
  * state pass: one in-place multiply over every layer's recurrent state: a read and a write of each number,
    the traffic a step cannot do without, and its rate;
  * rest: step - products - state pass. At batch 1 it is nearly all of a step that does not grow with its rows
    (operator calls, the graph's wrapper, weights fetched from the caches);
  * draw: the decoder's draw of a token per row from (batch, V) logits (unfiltered: in C++ for the one-call models,
    compiled for the others), called alone;
  * token: a token of `model.decode.generate` with that decoder (a generation of `steps` tokens from BOS, over steps),
    and loop = token - step - draw: what the loop around them costs, caches the step and draw evict included. A
    one-call model's generation draws inside its step's call (`step_and_sample`), not in a call of its own: read
    draw + loop = token - step for what the draws and the loop cost together.
A step that is at its products plus its state pass has nothing left to win but those two. Times are wall clock
on a shared machine: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.kernels.cpu_features import read_cpu_features
from model.kernels.loader import cpu_route, load_kernels
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.choice import make_decoder
from model.decode.generate import generate
from model.kernels.packed_linear import PackedLinear, decode_twin, packs
from model.attention.classes import kinds_where
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import Transformer, build_model

from .decode_environment import machine_load
from .decode_models import preset_config


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def best_interleaved(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Seconds per call of each function, the best of `rounds` rounds that take them in turn (after a
    warm-up), so that a host that slows down for a while slows every column alike."""
    for fn in fns.values():
        seconds_per_call(fn, min(calls, 20))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], seconds_per_call(fn, calls))
    return best


def step_linear_layers(model: Transformer) -> list[nn.Module]:
    """The layers a compiled step multiplies with, in the model's order: packed where the kernel takes them."""
    source = decode_twin(model) if packs(model) and load_kernels().ok else model
    return [m for m in source.modules() if isinstance(m, (nn.Linear, PackedLinear))]


def in_width(layer: nn.Module) -> int:
    return layer.packed.shape[1] if isinstance(layer, PackedLinear) else layer.in_features


def products(layers: list[nn.Module], batch: int) -> tuple[Callable[[], None], int]:
    """A call of every layer's operator on (batch, in) inputs (not through nn.Module's call: the compiled step
    calls the operators from C++), and its FLOPs."""
    calls = []
    for m in layers:
        x = torch.randn(batch, in_width(m))
        if isinstance(m, PackedLinear):
            calls.append(partial(torch.ops.rnnserve.packed_linear, x, m.packed, m.bias, m.out_features))
        else:
            calls.append(partial(F.linear, x, m.weight, m.bias))

    def run() -> None:
        for call in calls:
            call()

    return run, sum(2 * batch * in_width(m) * m.out_features for m in layers)


def state_tensors(model: Transformer, batch: int) -> list[torch.Tensor]:
    """Every layer's floating-point state tensors (not the row lengths)."""
    values = (getattr(layer, f.name) for layer in model.new_state(batch).layers for f in dataclasses.fields(layer))
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


@torch.inference_mode()
def measure(kind: str, batch: int, steps: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", kind)).eval()
    decoder = make_decoder(model, model.new_state(batch), cuda_graphs=False, compiled=True)
    decoder.compile(batch=batch)
    graphed = CompiledDecoder(model, model.new_state(batch), one_call=False) if decoder.one_call_steps else decoder
    graphed.compile(batch=batch)
    tokens = torch.zeros(batch, dtype=torch.long)
    steps = min(steps, model.config.max_len - 30)  # rows reset between rounds, inside max_len

    def step(decoder: CompiledDecoder) -> None:
        if int(decoder.state.lengths[0]) >= steps:
            decoder.state.reset_rows(range(batch))
        decoder(tokens)

    run_products, flops = products(step_linear_layers(model), batch)
    states = state_tensors(model, batch)
    state_bytes = 2 * sum(t.numel() * t.element_size() for t in states)  # read and written

    def state_pass() -> None:
        for t in states:
            t.mul_(1.0)

    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=row) for row in range(batch)])
    logits = torch.randn(batch, model.config.vocab_out)
    position = torch.zeros(batch, dtype=torch.long)
    prompt = torch.zeros(batch, 0, dtype=torch.long)
    generations = iter(range(10**9))

    def token() -> None:  # a whole generation every `steps` calls: each call a step's share of one
        if next(generations) % steps == 0:
            generate(model, prompt, steps, sampling, decoder=decoder)

    timed = {"step": partial(step, decoder), "graph": partial(step, graphed), "products": run_products}
    timed |= {"draw": partial(decoder.sample, logits, sampling, position), "token": token}
    best = best_interleaved(timed | {"state": state_pass}, steps, rounds)
    step_s, products_s, state_s = best["step"], best["products"], best["state"]
    return {
        "batch": batch,
        "step_ms": 1e3 * step_s,
        "graph_step_ms": 1e3 * best["graph"],
        "products_ms": 1e3 * products_s,
        "products_gflops": flops / products_s / 1e9,
        "state_pass_ms": 1e3 * state_s,
        "state_gb_per_s": state_bytes / state_s / 1e9,
        "rest_ms": 1e3 * (step_s - products_s - state_s),
        "draw_ms": 1e3 * best["draw"],
        "token_ms": 1e3 * best["token"],
        "loop_ms": 1e3 * (best["token"] - step_s - best["draw"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="linear", choices=kinds_where(lambda c: c.compilable and c.constant_state))
    parser.add_argument("--batches", default="1,32,64", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_kernels()
    print(
        f"{args.kind}, one thread, {read_cpu_features().cpu_class} CPU, kernels' route {cpu_route()}, "
        f"load {machine_load()}"
    )
    print(
        "| batch | step ms | graph step ms | products ms | products GFLOP/s | state pass ms | state GB/s | rest ms "
        "| draw ms | token ms | loop ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        r = measure(args.kind, batch, args.steps, args.rounds)
        print(
            f"| {batch} | {r['step_ms']:.3f} | {r['graph_step_ms']:.3f} | {r['products_ms']:.3f} | {r['products_gflops']:.1f} | "
            f"{r['state_pass_ms']:.3f} | {r['state_gb_per_s']:.1f} | {r['rest_ms']:.3f} | {r['draw_ms']:.3f} | "
            f"{r['token_ms']:.3f} | {r['loop_ms']:.3f} |"
        )


if __name__ == "__main__":
    main()
