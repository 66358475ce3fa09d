"""The block's parts besides attention, declared as options the way the attention kinds declare theirs
(model/attention/kinds.py): plain data, importing nothing. Each option is a config key stored in every model file's
metadata, with a default that is what rnnserve's own models (and files from before the option) have: GPT-2's
block (LayerNorm, a GELU feed-forward, biases everywhere, one key and value head per query head).

An imported Llama-family model sets them (model/io/hf_import.py): RMSNorm, SwiGLU, rotary positions (the
`pos_encoding` field), grouped-query attention, the biases each family has, Mistral's sliding window. The model
builds each part from a table keyed by its option (model/transformer.py), not by branching on a family.
"""

from __future__ import annotations

from .attention.kinds import KindOption

NORMS = ("layer", "rms")
FEED_FORWARDS = ("gelu", "swiglu")
ROPE_SCALINGS = ("none", "linear", "llama3")

BLOCK_OPTIONS: tuple[KindOption, ...] = (
    KindOption("norm", "layer", "LayerNorm with a bias (GPT-2), or RMSNorm with a weight only (Llama)", NORMS),
    KindOption(
        "feed_forward",
        "gelu",
        "gelu: down(gelu(up x)) (GPT-2); swiglu: down(silu(gate x) * up x) (Llama)",
        FEED_FORWARDS,
    ),
    KindOption("kv_heads", 0, "key and value heads, each shared by n_heads / kv_heads query heads (0: n_heads)", (), 0),
    KindOption("qkv_bias", True, "the query, key and value projections have a bias"),
    KindOption("attn_out_bias", True, "the attention's output projection has a bias"),
    KindOption("ff_bias", True, "the feed-forward's projections have a bias"),
    KindOption("head_bias", True, "an untied output layer has a bias"),
    KindOption("rope_theta", 10000.0, "rotary positions' base (pos_encoding rotary)", (), 1.0),
    KindOption("rope_scaling", "none", "rotary frequencies stretched for a longer context", ROPE_SCALINGS),
    KindOption("rope_factor", 1.0, "how much longer the context is (rope_scaling linear or llama3)", (), 1.0),
    KindOption("rope_low_freq_factor", 1.0, "llama3: wavelengths above original / this are scaled whole", (), 0.0),
    KindOption("rope_high_freq_factor", 4.0, "llama3: wavelengths below original / this are kept", (), 0.0),
    KindOption("rope_original_max_len", 8192, "llama3: the context the model was trained for", (), 1),
    KindOption("sliding_window", 0, "softmax attends only to the last W positions (0: all of them)", (), 0),
)

# Options only some attention kinds implement, and which value each kind without them must keep.
NEEDS_KIND_SUPPORT = {"kv_heads": 0, "sliding_window": 0, "qkv_bias": True, "attn_out_bias": True}


def block_options() -> dict[str, KindOption]:
    return {option.key: option for option in BLOCK_OPTIONS}
