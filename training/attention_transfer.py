"""The first stage of linearizing (`rnnserve linearize --transfer-steps N`): teach a linearized model's new
attention parts (feature maps, and a hybrid's window/linear mix) to stand in for the softmax attention they replace,
before anything else is trained.

Every other weight is still the softmax model's, so each layer can be taught on the teacher's own inputs, read from
the teacher's forward pass, one layer at a time (a layer's graph is freed before the next is built). Two losses:
- `output-mse` (LoLCATs, Zhang et al. 2025): each layer's attention output against the teacher's, mean squared
  error relative to the teacher output's mean square (so layers weigh alike); any kind, any map.
- `weight-ce` (Hedgehog, Zhang et al. 2024): a linear model's weight on key j for query i, phi(q_i)·phi(k_j)
  normalised over j <= i, against the teacher's softmax(q_i·k_j / sqrt(D)), cross-entropy at a random subset of
  query rows (a 784-pixel image's full T x T weights per head and layer would leave room for few sequences).

The teacher's forward pass and, for output-mse, the student's attention run under the training's autocast (bfloat16
where the CPU has it natively, as the second stage runs): in float32 the teacher's pass is half of a step. The
losses are taken in float32.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from model import Transformer

QUERY_ROWS = 128  # query positions scored per batch
WEIGHT_EPS = 1e-6  # as linear attention's own denominator guard


@dataclass(frozen=True)
class TransferResult:
    steps: int
    first_loss: float  # of the first batch, before any step
    last_loss: float  # the mean of the last few batches
    seconds: float


def teacher_queries_keys(teacher: Transformer, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's queries and keys in the teacher's own forward pass: (B, H, T, D) each. The teacher's own
    projection splits q, k and v by their real sizes and turns q and k by rotary positions if it has them; in
    grouped-query attention each key head is repeated for its group of query heads, as softmax attention reads it
    (query head h reads key head h // G), so the weights compared are the ones the teacher attended with."""
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for b in teacher.blocks]
    try:
        with torch.no_grad():
            teacher.token_log_probs(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    pairs = []
    start = tokens.new_zeros(tokens.shape[0])
    with torch.no_grad():
        for block, x in zip(teacher.blocks, inputs):
            q, k, _ = block.attn._project(x, start)  # (B, H, T, D), (B, KV, T, D)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, T, D)
            pairs.append((q.float(), k.float()))
    return pairs


def transfer_loss(student: Transformer, pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor):
    """Mean over layers of the cross-entropy between the teacher's and the student's weights at query `rows`."""
    total = torch.zeros((), device=rows.device)
    for block, (q, k) in zip(student.blocks, pairs):
        length = k.shape[2]
        causal = rows[:, None] >= torch.arange(length, device=rows.device)[None, :]  # (R, T)
        q_rows = q[:, :, rows]  # (B, H, R, D)
        logits = (q_rows @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, R, T)
        target = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        phi = block.attn.feature_map
        scores = (phi(q_rows) @ phi(k).transpose(-1, -2)) * causal  # (B, H, R, T), >= 0
        weights = scores / (scores.sum(-1, keepdim=True) + WEIGHT_EPS)
        total = total - (target * torch.log(weights + 1e-12)).sum(-1).mean()
    return total / len(pairs)


def teacher_attention_io(teacher: Transformer, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's attention input (after its norm) and output in the teacher's forward pass: (B, T, C) each."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [b.attn.register_forward_hook(lambda _, args, out: seen.append((args[0], out[0]))) for b in teacher.blocks]
    try:
        with torch.no_grad():
            teacher.token_log_probs(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return [(x.float(), y.float()) for x, y in seen]


def output_step(
    student: Transformer,
    tokens: torch.Tensor,
    teacher: Transformer,
    autocast: AbstractContextManager = nullcontext(),
) -> float:
    """Back-propagate each layer's relative output error in turn (gradients accumulate); returns their mean."""
    total = 0.0
    with autocast:
        pairs = teacher_attention_io(teacher, tokens)
    start = tokens.new_zeros(tokens.shape[0])
    for block, (x, target) in zip(student.blocks, pairs):
        with autocast:
            y, _ = block.attn(x.to(block.attn.proj.weight.dtype), start, None)  # (B, T, C)
        loss = (y.float() - target).pow(2).mean() / (target.pow(2).mean() + WEIGHT_EPS) / len(pairs)
        loss.backward()
        total += float(loss.detach())
    return total


def weight_step(
    student: Transformer,
    tokens: torch.Tensor,
    teacher: Transformer,
    generator: torch.Generator,
    autocast: AbstractContextManager = nullcontext(),
) -> float:
    with autocast:
        pairs = teacher_queries_keys(teacher, tokens)
    length = pairs[0][1].shape[2]
    rows = torch.randperm(length, generator=generator)[: min(QUERY_ROWS, length)].sort().values
    loss = transfer_loss(student, pairs, rows.to(student.device))
    loss.backward()
    return float(loss.detach())


def taught_parameters(student: Transformer) -> list[torch.nn.Parameter]:
    """What the first stage trains: the feature maps and, in a hybrid, the per-head mix."""
    maps = [p for block in student.blocks for p in block.attn.feature_map.parameters()]
    mixes = [block.attn.mix for block in student.blocks if isinstance(getattr(block.attn, "mix", None), torch.Tensor)]
    return maps + mixes


def transfer(
    student: Transformer,
    teacher: Transformer,
    next_batch,
    steps: int,
    lr: float,
    generator: torch.Generator,
    log,
    loss: str = "output-mse",
    autocast: AbstractContextManager = nullcontext(),
) -> TransferResult:
    """`steps` AdamW steps on the taught parameters alone; `next_batch()` gives (B, T) token batches; `autocast` as
    the training's (train.autocast_context), or none."""
    parameters = taught_parameters(student)
    if not parameters:
        raise ValueError("the feature map has no parameters to teach (elu): attention transfer needs t2r or hedgehog")
    student.requires_grad_(False)
    for parameter in parameters:
        parameter.requires_grad_(True)
    opt = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    losses, started = [], time.monotonic()
    try:
        for step in range(steps):
            tokens = next_batch().to(student.device)
            opt.zero_grad(set_to_none=True)
            if loss == "output-mse":
                losses.append(output_step(student, tokens, teacher, autocast))
            else:
                losses.append(weight_step(student, tokens, teacher, generator, autocast))
            opt.step()
            if (step + 1) % 50 == 0 or step + 1 == steps:
                log(f"attention transfer step {step + 1} {loss} {statistics_tail(losses):.4f}")
    finally:
        student.requires_grad_(True)
    return TransferResult(steps, losses[0], statistics_tail(losses), time.monotonic() - started)


def statistics_tail(losses: list[float], count: int = 20) -> float:
    tail = losses[-count:]
    return sum(tail) / len(tail)
