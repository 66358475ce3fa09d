"""How the recurrent state's memory layout changes a decode step's state update and read.

    python -m benchmarks.state_layout [--batch 64] [--rounds 7] [--calls 200]

Times one layer's state update and read of a decode step, eager and through torch.compile
(the options of model/compiled_decode.py), for two layouts of each constant-state kind:
  * linear: [S | Z] as (B, H, D, D + 1), the read phi(q)^T [S | Z] summing down columns,
    against the transposed (B, H, D + 1, D), the read summing along rows;
  * Linformer: V~ as (B, H, k, D), updated by a batched outer product, against V~^T as
    (B, H, D, k), updated elementwise (`addcmul_`); K~ is (B, H, k, D) in both.
The variants take turns in every round; medians of the rounds, milliseconds per call, one thread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch

from model.compiled_decode import INDUCTOR_OPTIONS

HEADS, D_HEAD, SLOTS = 4, 32, 64  # the cpu preset: 4 heads of 32; Linformer k = 64


def linear_columns(sz, q, k, v):  # sz (B, H, D, D + 1)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    sz.addcmul_(k[..., :, None], v1[..., None, :])
    out = (q[..., None, :] @ sz)[..., 0, :]
    return out[..., :-1] / (out[..., -1:] + 1e-6)


def linear_rows(sz_t, q, k, v):  # sz_t (B, H, D + 1, D)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    sz_t.addcmul_(v1[..., :, None], k[..., None, :])
    out = (q[..., None, :] @ sz_t.transpose(-1, -2))[..., 0, :]
    return out[..., :-1] / (out[..., -1:] + 1e-6)


def linformer_outer(keys, values, q, k, v, e):  # values (B, H, k, D)
    keys.add_(e.transpose(-1, -2) @ k)
    values.add_(e.transpose(-1, -2) @ v)
    attn = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return attn @ values


def linformer_transposed(keys, values_t, q, k, v, e):  # values_t (B, H, D, k)
    keys.addcmul_(e.transpose(-1, -2), k)
    values_t.addcmul_(v.transpose(-1, -2), e)
    attn = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return attn @ values_t.transpose(-1, -2)


def cases(batch: int) -> dict[str, tuple[Callable, tuple]]:
    """name -> (function, arguments); each variant gets its own state."""
    b, h, d = batch, HEADS, D_HEAD
    q, k, v = (torch.rand(b, h, d) for _ in range(3))
    q4, k4, v4 = (x[:, :, None] for x in (q, k, v))
    e = torch.rand(b, 1, 1, SLOTS)
    return {
        "linear, [S \\| Z] (B, H, D, D + 1)": (linear_columns, (torch.rand(b, h, d, d + 1), q, k, v)),
        "linear, [S \\| Z]^T (B, H, D + 1, D)": (linear_rows, (torch.rand(b, h, d + 1, d), q, k, v)),
        "Linformer, V~ (B, H, k, D), outer products": (
            linformer_outer, (torch.rand(b, h, SLOTS, d), torch.rand(b, h, SLOTS, d), q4, k4, v4, e)),
        "Linformer, V~^T (B, H, D, k), addcmul_": (
            linformer_transposed, (torch.rand(b, h, SLOTS, d), torch.rand(b, h, d, SLOTS), q4, k4, v4, e)),
    }


def timed(fn: Callable, args: tuple, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e3


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = {}
    for name, (fn, fn_args) in cases(args.batch).items():
        compiled = torch.compile(fn, fullgraph=True, options=INDUCTOR_OPTIONS)
        for mode, f in (("eager", fn), ("compiled", compiled)):
            state_copy = tuple(a.clone() for a in fn_args)  # eager and compiled update their own state
            f(*state_copy)  # compiles
            runs[(name, mode)] = (f, state_copy)
    times = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, (f, fn_args) in runs.items():
            times[key].append(timed(f, fn_args, args.calls))
    print(f"| layout, batch {args.batch}, one layer | eager, ms | compiled, ms |\n|---|---:|---:|")
    for name in cases(1):
        print(f"| {name} | {statistics.median(times[(name, 'eager')]):.3f} | {statistics.median(times[(name, 'compiled')]):.3f} |")


if __name__ == "__main__":
    main()
