"""`rnnserve eval FILE --attention-share`: how much of a hybrid model's attention comes from its linear part.

A hybrid layer (model/attention/hybrid.py) divides by one normaliser per query, the sum of its weights:

    g sum_{window} exp(s_ij - m_i)  +  (1 - g) sum_{older} phi(q_i) . phi(k_j)

A hybrid can learn to lean on its window and leave the linear part unused (then it is a sliding-window model that
forgets everything older). This measures the linear part's share of that sum, per layer and query head, averaged
over every query that has keys older than the window (position >= W) in the given sequences. It recomputes each
layer's weights from the layer's own inputs in the model's forward pass, as the whole (T x T) matrix, so it takes
a batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import Transformer


@dataclass
class ShareTotals:
    """Running sums over queries past the window: the linear share's sum per layer and head, and the count."""

    linear: torch.Tensor  # (L, H) float64
    queries: int = 0

    def result(self) -> dict:
        share = (self.linear / max(self.queries, 1)).tolist()
        flat = [value for layer in share for value in layer]
        return {
            "linear_share": share,  # [layer][head]; the window's share is 1 minus it
            "mean_linear_share": sum(flat) / len(flat),
            "queries_per_head": self.queries,
        }


def check_hybrid(model: Transformer, name: str) -> None:
    if model.config.attention != "hybrid":
        raise ValueError(
            f"{name} is a {model.config.attention} model; --attention-share measures a hybrid model's linear "
            "part against its window"
        )


def layer_inputs(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention input (after its norm) in the model's own forward pass: (B, T, C) each."""
    seen: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _, args: seen.append(args[0])) for b in model.blocks]
    try:
        model.token_log_probs(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def normaliser_parts(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's and the linear part's terms of each query's normaliser, mix included: (B, H, T) each."""
    b, t, _ = x.shape
    start = torch.zeros(b, dtype=torch.long, device=x.device)  # (B,): a whole sequence from position 0
    q, k, _ = attn._project(x, start, widen=True)  # (B, H, T, D), (B, KV, T, D), float32 as the hybrid computes
    group = q.shape[1] // k.shape[1]  # query head h reads key head h // group
    phi_q = attn.feature_map(q)  # (B, H, T, F)
    phi_k = attn.feature_map(k).repeat_interleave(group, dim=1)  # (B, H, T, F)
    k = k.repeat_interleave(group, dim=1)  # (B, H, T, D)
    query, key = torch.arange(t, device=x.device)[:, None], torch.arange(t, device=x.device)[None, :]
    in_window = (key <= query) & (key > query - attn.window)  # (T, T)
    older = key <= query - attn.window
    scores = ((q @ k.transpose(-1, -2)) * attn.d_head**-0.5).masked_fill(~in_window, float("-inf"))  # (B, H, T, T)
    window = torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1)  # (B, H, T)
    linear = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~older, 0.0).sum(-1)  # (B, H, T)
    g = torch.sigmoid(attn.mix.float())[None, :, None]  # (1, H, 1)
    return g * window, (1 - g) * linear


@torch.inference_mode()
def add_batch(model: Transformer, tokens: torch.Tensor, totals: ShareTotals) -> None:
    """Add a (B, T) batch's queries past the window to `totals`."""
    inputs = layer_inputs(model, tokens)
    past = slice(model.config.hybrid_window, None)  # queries with keys older than the window
    for layer, (block, x) in enumerate(zip(model.blocks, inputs)):
        window, linear = normaliser_parts(block.attn, x.float())
        share = linear[:, :, past] / (window[:, :, past] + linear[:, :, past])  # (B, H, T - W)
        totals.linear[layer] += share.double().sum((0, 2)).cpu()
    totals.queries += tokens.shape[0] * max(inputs[0].shape[1] - model.config.hybrid_window, 0)


def attention_share(model: Transformer, batches) -> dict:
    """The linear part's share of the normaliser per layer and head over `batches` of (B, T) tokens."""
    totals = ShareTotals(torch.zeros(model.config.n_layers, model.config.n_heads, dtype=torch.float64))
    for tokens in batches:
        add_batch(model, tokens.long().to(model.device), totals)
    return {**totals.result(), "window": model.config.hybrid_window}


def format_share(result: dict) -> list[str]:
    """A table: a row per layer, the linear part's share per head (the window has the rest)."""
    heads = len(result["linear_share"][0])
    lines = [
        f"linear part's share of the attention normaliser (window {result['window']}, "
        f"{result['queries_per_head']:,} queries per head past the window; the window has the rest)",
        "| layer | " + " | ".join(f"head {h}" for h in range(heads)) + " | mean |",
        "|---:|" + "---:|" * (heads + 1),
    ]
    for layer, shares in enumerate(result["linear_share"]):
        cells = " | ".join(f"{share:.3f}" for share in shares)
        lines.append(f"| {layer} | {cells} | {sum(shares) / heads:.3f} |")
    lines.append(f"mean over layers and heads: {result['mean_linear_share']:.3f}")
    return lines
