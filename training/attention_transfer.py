"""Hedgehog's first stage (Zhang et al. 2024): teach a linearized model's feature maps to copy the softmax model's
attention weights before the whole model is fine-tuned (`rnnserve linearize --transfer-steps N`).

Every weight but the maps' is still the softmax model's, so each layer's queries and keys are the teacher's own,
read from its forward pass. The student's weight on key j for query i, phi(q_i)·phi(k_j) normalised over j <= i,
is pulled toward the teacher's softmax(q_i·k_j / sqrt(D)) by cross-entropy, layer by layer. Only a random subset
of query rows is scored per batch: a 784-pixel image's full T x T weights per head and layer would leave room for
few sequences. Only the feature maps learn; the fine-tuning that follows starts from them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from model import Transformer
from model.heads import split_heads

QUERY_ROWS = 128  # query positions scored per batch
WEIGHT_EPS = 1e-6  # as linear attention's own denominator guard


@dataclass(frozen=True)
class TransferResult:
    steps: int
    first_loss: float  # cross-entropy (nats per query row) of the first batch, before any step
    last_loss: float  # the mean of the last few batches
    seconds: float


def teacher_queries_keys(teacher: Transformer, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's queries and keys in the teacher's own forward pass: (B, H, T, D) each."""
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for b in teacher.blocks]
    try:
        with torch.no_grad():
            teacher.token_log_probs(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    pairs = []
    with torch.no_grad():
        for block, x in zip(teacher.blocks, inputs):
            q, k, _ = (split_heads(t, teacher.config.n_heads).float() for t in block.attn.qkv(x).chunk(3, dim=-1))
            pairs.append((q, k))
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


def feature_map_parameters(student: Transformer) -> list[torch.nn.Parameter]:
    return [p for block in student.blocks for p in block.attn.feature_map.parameters()]


def transfer(
    student: Transformer, teacher: Transformer, next_batch, steps: int, lr: float, generator: torch.Generator, log
) -> TransferResult:
    """`steps` AdamW steps on the feature maps alone; `next_batch()` gives (B, T) token batches."""
    parameters = feature_map_parameters(student)
    if not parameters:
        raise ValueError("the feature map has no parameters to teach (elu): attention transfer needs t2r or hedgehog")
    opt = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    losses, started = [], time.monotonic()
    for step in range(steps):
        pairs = teacher_queries_keys(teacher, next_batch().to(student.device))
        length = pairs[0][1].shape[2]
        rows = torch.randperm(length, generator=generator)[: min(QUERY_ROWS, length)].sort().values
        loss = transfer_loss(student, pairs, rows.to(student.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"attention transfer step {step + 1} loss {statistics_tail(losses):.4f}")
    return TransferResult(steps, losses[0], statistics_tail(losses), time.monotonic() - started)


def statistics_tail(losses: list[float], count: int = 20) -> float:
    tail = losses[-count:]
    return sum(tail) / len(tail)
