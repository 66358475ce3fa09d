"""Peers for `rnnserve bench --peers`: other implementations of the same models, built at the
preset's sizes and timed in the same run as rnnserve's kinds.

  * fast-transformers' recurrent linear transformer (`RecurrentEncoderBuilder`, attention "linear":
    phi = elu + 1, post-norm layers), with an embedding, learned positions and an output layer
    around it; one `encoder(x, state)` call per token;
  * a plain PyTorch recurrence of the same pre-norm model, as fast as plain PyTorch makes it: S and Z
    of every (row, head) kept in one preallocated tensor [S | Z]^T and updated in place
    ([S | Z]^T += [v; 1] phi(k)^T, one `addcmul_` per layer), read with one batched product over
    batch x heads (phi(q)^T S and phi(q)^T Z together), phi applied in place, in inference mode;
    fast-transformers (above) is the out-of-place recurrence, new S and Z every step;
  * Hugging Face transformers' GPT-2 (`GPT2LMHeadModel.generate`), with its static cache
    (preallocated for the whole length, every step attends over all of it with a mask) and with
    its default dynamic cache (grown by concatenation);
  * Hugging Face's `ReformerModelWithLMHead.generate` with its LSH cache: local and LSH layers
    alternating, 1 hashing round over 32 buckets, chunks of 32.

Sampling: the two recurrences draw with rnnserve's own `model.decode.sampling.sample` (inverse CDF with a
counter-based uniform per row, temperature 1, no filter); the Hugging Face models with `generate(do_sample=True,
top_k=0, top_p=1.0, temperature=1.0)` (softmax then `torch.multinomial`): the same distribution,
drawn another way. Every run is checked to have produced batch x tokens tokens.

The peers install with `benchmarks/install_peers.sh` (transformers, and fast-transformers built
without the CUDA compiler on PATH).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.config import BOS_TOKEN, BYTE_VOCAB
from model.decode.sampling import BatchSampling, SamplingParams, sample
from training.presets import PRESETS

from .errors import BenchError

HF_VOCAB = BYTE_VOCAB + 1  # bytes and BOS in one vocabulary: HF models predict over their input vocabulary
REFORMER_CHUNK, REFORMER_BUCKETS = 32, 32
PLAIN_RECURRENCE = "plain PyTorch linear recurrence, in place"
LINEAR_EPS = 1e-6  # added to phi(q)^T Z, as the peers always have


@dataclass(frozen=True)
class PeerSpec:
    name: str
    rival: str  # the rnnserve kind it is compared with
    cache: str  # what it keeps between steps
    sampling: str


PEERS = (
    PeerSpec(
        "fast-transformers recurrent linear",
        "linear",
        "S, Z per layer (fast-transformers' recurrent state)",
        "rnnserve's inverse-CDF draw, temperature 1",
    ),
    PeerSpec(
        PLAIN_RECURRENCE,
        "linear",
        "[S | Z] per layer, one preallocated tensor updated in place",
        "rnnserve's inverse-CDF draw, temperature 1",
    ),
    PeerSpec(
        "HF GPT-2 generate, static cache",
        "softmax",
        "static KV cache of the whole length, masked",
        "HF multinomial, top_k=0, temperature 1",
    ),
    PeerSpec(
        "HF GPT-2 generate, dynamic cache",
        "softmax",
        "dynamic KV cache, grown each step",
        "HF multinomial, top_k=0, temperature 1",
    ),
    PeerSpec(
        "HF Reformer generate, LSH cache",
        "reformer",
        "past buckets and states (LSH and local layers)",
        "HF multinomial, top_k=0, temperature 1",
    ),
)


class Peer:
    """One contestant: `run(batch, tokens)` generates (batch, tokens) tokens from BOS (the bench checks them)."""

    def __init__(self, spec: PeerSpec, module: nn.Module, run: Callable[[int, int], torch.Tensor]):
        self.spec, self.module = spec, module
        self._run = run

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def run(self, batch: int, tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            return self._run(batch, tokens)


def build_peers(preset: str, max_len: int, seed: int, dtype: torch.dtype = torch.float32) -> list[Peer]:
    """All peers at the preset's sizes, weights and activations in `dtype` (the bench's own, so
    rnnserve and its peers are compared like for like); a clear error when their packages are missing."""
    sizes = PRESETS[preset].architecture()
    try:
        import fast_transformers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise BenchError(
            f"--peers needs transformers and fast-transformers ({exc}); install them with benchmarks/install_peers.sh"
        ) from None
    builders = (_fast_transformers, plain_recurrence, _gpt2_static, _gpt2_dynamic, _reformer)
    peers = []
    for spec, build in zip(PEERS, builders, strict=True):
        torch.manual_seed(seed)
        peers.append(Peer(spec, *build(sizes, max_len, dtype)))
    return peers


# ---------------------------------------------------------------- recurrent linear transformers


class _Recurrent(nn.Module):
    """Embedding + learned positions -> `step(x, state)` -> output layer, sampled with rnnserve's sampler."""

    def __init__(self, sizes: dict, max_len: int, step: nn.Module):
        super().__init__()
        d = sizes["d_model"]
        self.tok, self.pos, self.step_module = nn.Embedding(BYTE_VOCAB + 1, d), nn.Embedding(max_len, d), step
        self.head = nn.Linear(d, BYTE_VOCAB)

    @torch.inference_mode()
    def generate(self, batch: int, tokens: int) -> torch.Tensor:
        sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(batch)])
        out = torch.empty(batch, tokens, dtype=torch.long)
        token, state = torch.full((batch,), BOS_TOKEN), None
        for pos in range(tokens):
            x = self.tok(token) + self.pos.weight[pos]
            y, state = self.step_module(x, state)
            token = sample(self.head(y), sampling, torch.full((batch,), pos))
            out[:, pos] = token
        return out


def _fast_transformers(sizes: dict, max_len: int, dtype: torch.dtype):
    from fast_transformers.builders import RecurrentEncoderBuilder

    d, h = sizes["d_model"], sizes["n_heads"]
    encoder = RecurrentEncoderBuilder.from_kwargs(
        attention_type="linear",
        n_layers=sizes["n_layers"],
        n_heads=h,
        feed_forward_dimensions=sizes["d_ff"],
        query_dimensions=d // h,
        value_dimensions=d // h,
        activation="gelu",
        dropout=0.0,
        attention_dropout=0.0,
    ).get()
    model = _Recurrent(sizes, max_len, encoder).to(dtype).eval()
    return model, model.generate


class _PlainLayer(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def new_sums(self, batch: int, d: int, dtype: torch.dtype) -> LinearSums:
        return LinearSums(batch, self.heads, d // self.heads, dtype)

    def forward(self, x: torch.Tensor, sums: LinearSums) -> torch.Tensor:
        """One token per row: x (B, d) -> (B, d); `sums` advanced in place."""
        b, d = x.shape
        qkv = self.qkv(self.ln1(x))  # (B, 3d): a fresh tensor, so phi may overwrite its q and k in place
        F.elu(qkv[:, : 2 * d], inplace=True).add_(1)  # phi = elu + 1 on q and k at once
        q, k, v = (t.view(b, self.heads, -1) for t in qkv.split(d, dim=-1))  # (B, H, D) each
        out = sums.step(q, k, v)  # (B, H, D)
        x = self.proj(out.reshape(b, d)).add_(x)  # residuals added into the products' fresh outputs
        return self.down(F.gelu(self.up(self.ln2(x)))).add_(x)


class LinearSums:
    """One layer's S and Z for every row and head, in one preallocated tensor that every step updates in place.

    Stored as [S | Z]^T, (B, H, D + 1, D): row e < D holds S[:, e] (sum of v_e phi(k)), row D holds Z (sum of
    phi(k)). A step is one elementwise rank-1 update and one batched product that gives numerator and denominator
    together; the elementwise update is the quicker of the two in-place updates PyTorch offers on a CPU (rnnserve's
    own eager step chose it over a batched `baddbmm_`: benchmarks/results/NOTES.md, "Measurements behind design
    choices")."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype):
        self.sz_t = torch.zeros(batch, heads, head_dim + 1, head_dim, dtype=dtype)  # (B, H, D + 1, D)
        self.v1 = torch.ones(batch, heads, head_dim + 1, dtype=dtype)  # (B, H, D + 1): [v; 1], the 1 kept
        self.read = torch.empty(batch * heads, head_dim + 1, 1, dtype=dtype)  # (B*H, D + 1, 1)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k feature-mapped and v, (B, H, D) each -> phi(q)^T S / (phi(q)^T Z + eps), (B, H, D)."""
        b, h, d = v.shape
        self.v1[..., :d].copy_(v)
        self.sz_t.addcmul_(self.v1[..., :, None], k[..., None, :])  # [S | Z]^T += [v; 1] phi(k)^T
        torch.bmm(self.sz_t.view(b * h, d + 1, d), q.reshape(b * h, d, 1), out=self.read)  # over batch x heads
        read = self.read.view(b, h, d + 1)
        return read[..., :d] / read[..., d:].add_(LINEAR_EPS)


class _PlainStack(nn.Module):
    def __init__(self, sizes: dict):
        super().__init__()
        self.layers = nn.ModuleList(
            _PlainLayer(sizes["d_model"], sizes["n_heads"], sizes["d_ff"]) for _ in range(sizes["n_layers"])
        )
        self.norm = nn.LayerNorm(sizes["d_model"])

    def forward(self, x: torch.Tensor, state: list[LinearSums] | None):
        """x (B, d) -> (B, d) and the layers' sums: made at the first step, the same tensors at every later one."""
        if state is None:
            state = [layer.new_sums(x.shape[0], x.shape[1], x.dtype) for layer in self.layers]
        for layer, sums in zip(self.layers, state, strict=True):
            x = layer(x, sums)
        return self.norm(x), state


def plain_recurrence(sizes: dict, max_len: int, dtype: torch.dtype = torch.float32):
    """The plain PyTorch peer alone (it needs neither fast-transformers nor transformers): (model, generate)."""
    model = _Recurrent(sizes, max_len, _PlainStack(sizes)).to(dtype).eval()
    return model, model.generate


# ---------------------------------------------------------------- Hugging Face generate()


def hf_generate(model, batch: int, tokens: int, **options) -> torch.Tensor:
    bos = torch.full((batch, 1), BOS_TOKEN)
    out = model.generate(
        bos,
        attention_mask=torch.ones_like(bos),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        pad_token_id=0,
        eos_token_id=None,
        **options,
    )
    return out[:, 1:]


def _gpt2(sizes: dict, max_len: int, dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=HF_VOCAB,
        n_positions=max_len + 1,
        n_embd=sizes["d_model"],
        n_layer=sizes["n_layers"],
        n_head=sizes["n_heads"],
        n_inner=sizes["d_ff"],
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS_TOKEN,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(cfg).to(dtype).eval()


def _gpt2_static(sizes: dict, max_len: int, dtype: torch.dtype):
    model = _gpt2(sizes, max_len, dtype)
    return model, lambda batch, tokens: hf_generate(model, batch, tokens, cache_implementation="static")


def _gpt2_dynamic(sizes: dict, max_len: int, dtype: torch.dtype):
    model = _gpt2(sizes, max_len, dtype)
    return model, lambda batch, tokens: hf_generate(model, batch, tokens)


def _reformer(sizes: dict, max_len: int, dtype: torch.dtype):
    from transformers import ReformerConfig, ReformerModelWithLMHead

    d, h = sizes["d_model"], sizes["n_heads"]
    cfg = ReformerConfig(
        vocab_size=HF_VOCAB,
        hidden_size=d,
        num_attention_heads=h,
        attention_head_size=d // h,
        feed_forward_size=sizes["d_ff"],
        attn_layers=["local", "lsh"] * (sizes["n_layers"] // 2) + ["local"] * (sizes["n_layers"] % 2),
        num_hashes=1,
        num_buckets=REFORMER_BUCKETS,
        lsh_attn_chunk_length=REFORMER_CHUNK,
        local_attn_chunk_length=REFORMER_CHUNK,
        axial_pos_embds=False,
        max_position_embeddings=max_len + 1,
        is_decoder=True,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        bos_token_id=BOS_TOKEN,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = ReformerModelWithLMHead(cfg).to(dtype).eval()
    return model, lambda batch, tokens: _quiet(hf_generate, model, batch, tokens)


def _quiet(fn: Callable, *args) -> torch.Tensor:
    """fn(*args) with its prints dropped: transformers 5's Reformer prints a line per step
    ("Warning: logits_to_keep is not a recognized input."), thousands per generation."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)
