"""Two ways to write each kind's attention in a decode step, eager and compiled.

    python -m benchmarks.step_kernels [--batch 64] [--prefix 392] [--rounds 7] [--calls 200]

Times one layer's attention of a decode step (state update and read), eager and through
torch.compile (the options of model/decode/compiled/decoder.py), in two forms per kind:
  * linear: [S | Z] as (B, H, D, D + 1), the read phi(q)^T [S | Z] summing down columns,
    against the transposed (B, H, D + 1, D), the read summing along rows;
  * Linformer: V~ as (B, H, k, D), updated by a batched outer product, against V~^T as
    (B, H, D, k), updated elementwise (`addcmul_`); K~ is (B, H, k, D) in both; and with V~^T,
    the state updated then read, against the model's step, whose compiled form reads the state
    before its update and adds the update's share apart;
  * softmax: one query over a cached prefix of --prefix positions (one row at half of it, so
    the mask matters), by the fused `scaled_dot_product_attention` against the product, masked
    softmax and product written out (`model.attention.softmax.attend_one_query`).
The variants take turns in every round; medians of the rounds, milliseconds per call, one thread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch

import torch.nn.functional as F

from model.decode.compiled.graphs import inductor_options
from model.transformer import build_model
from model.attention.linear import LinearAttention, LinearState
from model.attention.linformer import LinformerAttention, LinformerState
from model.attention.softmax import attend_one_query

from .decode_models import preset_config

# The old forms are written out here; the current ones are the models' own decode steps, at the cpu preset's sizes.


def linear_columns(sz, q, k, v):  # sz (B, H, D, D + 1)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    sz.addcmul_(k[..., :, None], v1[..., None, :])
    out = (q[..., None, :] @ sz)[..., 0, :]
    return out[..., :-1] / (out[..., -1:] + 1e-6)


def linear_rows(attention: LinearAttention) -> Callable:
    def step(sz_t, q, k, v):  # sz_t (B, H, D + 1, D)
        return attention._step(q, k, v, LinearState(sz_t))

    return step


def linformer_outer(keys, values, q, k, v, e):  # values (B, H, k, D)
    keys.add_(e.transpose(-1, -2) @ k)
    values.add_(e.transpose(-1, -2) @ v)
    attn = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return attn @ values


def linformer_update_then_read(keys, values_t, q, k, v, e):  # the transposed layout's first compiled form
    keys.addcmul_(e.transpose(-1, -2), k)
    values_t.addcmul_(v.transpose(-1, -2), e)
    attn = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return attn @ values_t.transpose(-1, -2)


def linformer_transposed(attention: LinformerAttention) -> Callable:
    def step(keys, values_t, q, k, v, e):  # values_t (B, H, D, k); E = F, as in linformer_outer
        return attention._step(q, k, v, e, e, LinformerState(keys, values_t))

    return step


def softmax_fused(q, keys, values, visible):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)


def cases(batch: int, prefix: int) -> dict[str, tuple[Callable, tuple]]:
    """name -> (function, arguments), in pairs (Linformer: three): forms of one computation."""
    linear, linformer = (attention_of(kind) for kind in ("linear", "linformer"))
    b, h, d, slots = batch, linear.n_heads, linear.proj.in_features // linear.n_heads, linformer.slots
    positions = torch.full((b,), prefix - 1)
    positions[0] = prefix // 2
    visible = (torch.arange(prefix) <= positions[:, None])[:, None, None]  # (B, 1, 1, L)
    cache = (torch.rand(b, h, 1, d), torch.rand(b, h, prefix, d), torch.rand(b, h, prefix, d), visible)
    q, k, v = (torch.rand(b, h, d) for _ in range(3))
    q4, k4, v4 = (x[:, :, None] for x in (q, k, v))
    e = torch.rand(b, 1, 1, slots)
    sz, keys, values = torch.rand(b, h, d, d + 1), torch.rand(b, h, slots, d), torch.rand(b, h, slots, d)
    # Each pair holds the same state in its two layouts, so both forms give the same output (tested).
    return {
        "linear, [S \\| Z] (B, H, D, D + 1)": (linear_columns, (sz, q, k, v)),
        "linear, [S \\| Z]^T (B, H, D + 1, D)": (linear_rows(linear), (_transposed(sz), q, k, v)),
        "Linformer, V~ (B, H, k, D), outer products": (linformer_outer, (keys, values, q4, k4, v4, e)),
        "Linformer, V~^T (B, H, D, k), update then read": (
            linformer_update_then_read,
            (keys.clone(), _transposed(values), q4, k4, v4, e),
        ),
        "Linformer, V~^T (B, H, D, k), the model's step (compiled: reads the state before its update)": (
            linformer_transposed(linformer),
            (keys.clone(), _transposed(values), q4, k4, v4, e),
        ),
        f"softmax, prefix {prefix}: fused scaled_dot_product_attention": (softmax_fused, cache),
        f"softmax, prefix {prefix}: product, masked softmax, product": (attend_one_query, cache),
    }


LINFORMER_K = 64  # `rnnserve train --linformer-k`'s default: the shipped Linformer models' k


def attention_of(kind: str):
    """The first layer's attention of a cpu-preset model of this kind (Linformer with the shipped models' k)."""
    return build_model(preset_config("cpu", kind).replace(linformer_k=LINFORMER_K)).blocks[0].attn


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2).contiguous()


def timed(fn: Callable, args: tuple, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e3


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=392, help="softmax's cached positions (392: a generation's mean)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = {}
    for name, (fn, fn_args) in cases(args.batch, args.prefix).items():
        compiled = torch.compile(fn, fullgraph=True, options=inductor_options())
        compiled(*(a.clone() for a in fn_args))  # compiles outside the timings
        for mode, f in (("eager", fn), ("compiled", compiled)):
            runs[(name, mode)] = (f, tuple(a.clone() for a in fn_args))  # each updates its own state
    times = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, (f, fn_args) in runs.items():
            times[key].append(timed(f, fn_args, args.calls))
    print(f"| kind and form, batch {args.batch}, one layer | eager, ms | compiled, ms |\n|---|---:|---:|")
    for name in cases(1, args.prefix):
        print(
            f"| {name} | {statistics.median(times[(name, 'eager')]):.3f} | {statistics.median(times[(name, 'compiled')]):.3f} |"
        )


if __name__ == "__main__":
    main()
