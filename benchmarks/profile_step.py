"""Where a decode step's time goes: eager against compiled, one kind at one batch size.

    python -m benchmarks.profile_step [--kind linear] [--batch 64] [--steps 300] [--threads 1]

Random weights of the `cpu` preset. Profiles `steps` decode steps and, apart,
`steps` draws (model.decode.sampling.sample, temperature 1, no filter) with
torch.profiler, for the eager decoder and the compiled one (inductor's kernels
named with cpp.enable_kernel_profile; its Python wrapper, so that the matrix
products show), and sorts each operator's own time into a few groups. The profiler's clock is wall time: on a shared machine compare the
shares and the two paths within one run, not single figures across runs.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from unittest.mock import patch

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from model.decode.compiled.graphs import INDUCTOR_OPTIONS
from model.decode.eager_and_cuda_graphs import EagerDecoder
from model.decode.choice import make_decoder
from model.attention.classes import kinds_where
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import build_model

from .decode_environment import machine_load
from .decode_models import preset_config

# First match wins; names are torch.profiler's (aten operators, inductor kernels, dynamo regions).
GROUPS = (
    (
        "matrix products (linear layers, output head)",
        ("aten::addmm", "aten::mm", "mkl::", "mkldnn::", "rnnserve::packed_linear"),
    ),
    ("attention state: update and read-out", ("addcmul", "aten::bmm", "aten::cat")),
    (
        "torch.compile: guards, wrapper, graph entry",
        ("Dynamo", "CompiledFxGraph", "Compiled Region", "Pregraph", "AOTDispatcher"),
    ),
    ("other operators / fused kernels (norms, GELU, residuals, feature map, embeddings)", ("",)),
)


def group_of(name: str) -> str:
    return next(group for group, keys in GROUPS if any(k in name for k in keys))


def profile_ms(fn, steps: int) -> tuple[dict[str, float], float]:
    """Self time per group (ms per call) and the thread's CPU time per call (ms)."""
    for _ in range(10):
        fn()
    cpu = time.thread_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    cpu = (time.thread_time() - cpu) / steps * 1e3
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        groups[group_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return dict(groups), cpu


def decoders(kind: str, batch: int) -> dict[str, EagerDecoder]:
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", kind)).eval()
    # The C++ wrapper calls the matrix products where the profiler cannot see them: attribute with
    # inductor's Python wrapper, which calls the same kernels (the bench times the C++ one).
    with (
        torch._inductor.config.patch({"cpp.enable_kernel_profile": True}),
        patch.dict(INDUCTOR_OPTIONS, {"cpp_wrapper": False}),
    ):
        compiled = make_decoder(model, model.new_state(batch), cuda_graphs=False, compiled=True)
        compiled.compile(batch=batch)
    return {"eager": EagerDecoder(model, model.new_state(batch)), "compiled": compiled}


@torch.inference_mode()
def run(kind: str, batch: int, steps: int) -> None:
    tokens = torch.zeros(batch, dtype=torch.long)
    logits = torch.randn(batch, 256, generator=torch.Generator().manual_seed(0))
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(batch)])
    position = torch.full((batch,), 100)
    print(f"{kind}, batch {batch}, {steps} steps each; load {machine_load()}")
    for name, decoder in decoders(kind, batch).items():

        def step():
            if int(decoder.state.lengths[0]) >= decoder.model.config.max_len - 1:
                decoder.state.reset_rows(range(batch))
            decoder(tokens)

        model_groups, model_cpu = profile_ms(step, steps)
        draw_groups, draw_cpu = profile_ms(lambda: decoder.sample(logits, sampling, position), steps)
        print(f"\n{name}: decode step {model_cpu:.3f} ms + draw {draw_cpu:.3f} ms of thread CPU time per step")
        print("| where (profiler self time, ms per step) | decode step | draw |\n|---|---:|---:|")
        for group, _ in GROUPS:
            print(f"| {group} | {model_groups.get(group, 0):.3f} | {draw_groups.get(group, 0):.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="linear", choices=kinds_where(lambda c: c.compilable))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    run(args.kind, args.batch, args.steps)


if __name__ == "__main__":
    main()
