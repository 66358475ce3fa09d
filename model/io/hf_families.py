"""The Hugging Face model families `rnnserve import hf` takes: how each one's config.json becomes a ModelConfig
and how its tensor names map to rnnserve's. Every value that would make rnnserve compute something other than
`transformers` is refused, one line naming the field and its value (HFImportError).

GPT-2 is rnnserve's own block with a tied output layer and GELU's tanh form. Llama, Qwen2 and Mistral share one
block (model/architecture.py): RMSNorm, SwiGLU, rotary positions and grouped-query attention; Qwen2 adds biases
to its query, key and value projections, Mistral may attend over a sliding window. Their q, k and v projections
are stored as one matrix, queries first, as rnnserve's attention reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
GPT2_TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
LLAMA_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


class HFImportError(ValueError):
    """The folder cannot be imported; the message says what is wrong and what is expected."""


@dataclass(frozen=True)
class Family:
    config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields
    tensors: Callable[[dict[str, Any], int], dict[str, Any]]  # their tensors, layers -> rnnserve's tensors


def refuse(field: str, value: Any, expected: str) -> HFImportError:
    return HFImportError(f"config.json: unsupported {field} {value!r}; {expected}")


def require(hf: dict[str, Any], field: str, allowed: tuple[Any, ...], expected: str, default: Any = None) -> Any:
    value = hf.get(field, default)
    if value not in allowed:
        raise refuse(field, value, expected)
    return value


# -- GPT-2 -----------------------------------------------------------------------------------------------------
def gpt2_config(hf: dict[str, Any]) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise refuse("activation_function", activation, f"expected one of {', '.join(GPT2_ACTIVATIONS)}")
    require(hf, "tie_word_embeddings", (True,), "expected true: GPT-2's output layer is its embedding", True)
    require(hf, "scale_attn_by_inverse_layer_idx", (False,), "expected false (attention scaled by 1/sqrt(d))", False)
    require(hf, "scale_attn_weights", (True,), "expected true (attention scores scaled by 1/sqrt(d))", True)
    require(hf, "reorder_and_upcast_attn", (False,), "expected false", False)
    d = hf.get("n_embd", 768)
    return dict(
        d_model=d,
        n_layers=hf.get("n_layer", 12),
        n_heads=hf.get("n_head", 12),
        d_ff=hf.get("n_inner") or 4 * d,
        max_len=hf.get("n_positions", 1024),
        vocab_size=hf.get("vocab_size", 50257),
        bos_token=start_token(hf, 50256),
        eos_token=end_token(hf, 50256),
        tied_head=True,
        gelu=GPT2_ACTIVATIONS[activation],
        ln_eps=hf.get("layer_norm_epsilon", 1e-5),
    )


def gpt2_tensors(weights: dict[str, Any], layers: int) -> dict[str, Any]:
    """GPT-2's names (with or without the `transformer.` prefix) -> rnnserve's, Conv1D matrices transposed to
    nn.Linear's (out, in); the tied lm_head and the causal-mask buffers are dropped."""
    names = {"wte.weight": "tok_emb.weight", "wpe.weight": "pos_emb.weight"}
    names |= {f"ln_f.{kind}": f"ln_f.{kind}" for kind in ("weight", "bias")}
    parts = {
        "ln_1": "ln_attn",
        "attn.c_attn": "attn.qkv",
        "attn.c_proj": "attn.proj",
        "ln_2": "ln_ff",
        "mlp.c_fc": "ff.up",
        "mlp.c_proj": "ff.down",
    }
    for i in range(layers):
        for theirs, ours in parts.items():
            for kind in ("weight", "bias"):
                names[f"h.{i}.{theirs}.{kind}"] = f"blocks.{i}.{ours}.{kind}"
    state = {}
    for name, tensor in weights.items():
        key = name.removeprefix("transformer.")
        if key in names:
            state[names[key]] = tensor.t().contiguous() if key.endswith(GPT2_TRANSPOSED) else tensor
    return state


# -- Llama, Qwen2, Mistral -------------------------------------------------------------------------------------
def llama_config(hf: dict[str, Any], qkv_bias: bool, out_bias: bool, window: int = 0) -> dict[str, Any]:
    require(hf, "hidden_act", ("silu",), "expected silu (SwiGLU)", "silu")
    d, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    head_dim = hf.get("head_dim") or d // heads
    if head_dim * heads != d:
        raise refuse("head_dim", head_dim, f"expected hidden_size / num_attention_heads = {d // heads}")
    tied = bool(hf.get("tie_word_embeddings", False))
    return dict(
        d_model=d,
        n_layers=hf.get("num_hidden_layers", 32),
        n_heads=heads,
        d_ff=hf.get("intermediate_size", 11008),
        max_len=hf.get("max_position_embeddings", 2048),
        vocab_size=hf.get("vocab_size", 32000),
        bos_token=start_token(hf, 1),
        eos_token=end_token(hf, 2),
        tied_head=tied,
        ln_eps=hf.get("rms_norm_eps", 1e-6),
        pos_encoding="rotary",
        norm="rms",
        feed_forward="swiglu",
        kv_heads=hf.get("num_key_value_heads") or heads,
        qkv_bias=qkv_bias,
        attn_out_bias=out_bias,
        ff_bias=bool(hf.get("mlp_bias", False)),
        head_bias=False,
        sliding_window=window,
        **rope(hf),
    )


def rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Rotary positions' base and scaling: `rope_parameters` (transformers 5), or `rope_theta` and `rope_scaling`."""
    parameters = hf.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {"rope_theta": float(theta), **rope_scaling(parameters or hf.get("rope_scaling"))}


def rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any]:
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_factor": float(scaling["factor"])}
    if kind not in LLAMA_ROPE_KEYS:
        raise refuse("rope_scaling.rope_type", kind, "expected default, linear or llama3")
    missing = [key for key in LLAMA_ROPE_KEYS[kind] if key not in scaling]
    if missing:
        raise refuse("rope_scaling", scaling, f"llama3 scaling needs {', '.join(missing)}")
    return {
        "rope_scaling": "llama3",
        "rope_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_original_max_len": int(scaling["original_max_position_embeddings"]),
    }


def plain_llama_config(hf: dict[str, Any]) -> dict[str, Any]:
    require(hf, "pretraining_tp", (1, None), "expected 1 (tensor-parallel slices computed as one)", 1)
    bias = bool(hf.get("attention_bias", False))
    return llama_config(hf, qkv_bias=bias, out_bias=bias)


def qwen2_config(hf: dict[str, Any]) -> dict[str, Any]:
    require(hf, "use_sliding_window", (False, None), "expected false (a window on some layers only)", False)
    return llama_config(hf, qkv_bias=True, out_bias=False)


def mistral_config(hf: dict[str, Any]) -> dict[str, Any]:
    window = hf.get("sliding_window") or 0
    if not isinstance(window, int) or window < 0:
        raise refuse("sliding_window", window, "expected a number of positions, or null")
    return llama_config(hf, qkv_bias=False, out_bias=False, window=window)


def llama_tensors(weights: dict[str, Any], layers: int) -> dict[str, Any]:
    """Llama's names -> rnnserve's; q, k and v stacked into one projection, queries first."""
    import torch

    state = {}
    direct = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "ln_f.weight"}
    direct["lm_head.weight"] = "head.weight"
    for i in range(layers):
        theirs, ours = f"model.layers.{i}.", f"blocks.{i}."
        direct[theirs + "input_layernorm.weight"] = ours + "ln_attn.weight"
        direct[theirs + "post_attention_layernorm.weight"] = ours + "ln_ff.weight"
        for kind in ("weight", "bias"):
            direct[f"{theirs}self_attn.o_proj.{kind}"] = f"{ours}attn.proj.{kind}"
            for part in ("gate", "up", "down"):
                direct[f"{theirs}mlp.{part}_proj.{kind}"] = f"{ours}ff.{part}.{kind}"
            qkv = [weights[name] for p in "qkv" if (name := f"{theirs}self_attn.{p}_proj.{kind}") in weights]
            if len(qkv) == 3:
                state[f"{ours}attn.qkv.{kind}"] = torch.cat(qkv, dim=0)
    state.update({direct[name]: tensor for name, tensor in weights.items() if name in direct})
    return state


def start_token(hf: dict[str, Any], default: int) -> int:
    """The start token: an empty prompt starts from it. A family without one (Qwen2) starts from its end token."""
    value = hf.get("bos_token_id", default)
    value = value if value is not None else hf.get("eos_token_id")
    return first_id("bos_token_id", value)


def end_token(hf: dict[str, Any], default: int) -> int:
    value = hf.get("eos_token_id", default)
    return -1 if value is None else first_id("eos_token_id", value)


def first_id(field: str, value: Any) -> int:
    """A token id, or the first of a list of them (Llama 3 lists several end tokens)."""
    if isinstance(value, list) and value:
        value = value[0]
    if not isinstance(value, int) or value < 0:
        raise refuse(field, value, "expected a token id")
    return value


FAMILIES = {
    "gpt2": Family(gpt2_config, gpt2_tensors),
    "llama": Family(plain_llama_config, llama_tensors),
    "qwen2": Family(qwen2_config, llama_tensors),
    "mistral": Family(mistral_config, llama_tensors),
}
ARCHITECTURES = "GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"
