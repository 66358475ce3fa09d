"""The explicit list of attention kinds: name -> where its class lives. Plain data, importing nothing, so that
the config (which validates a kind's name) and the registry (which imports the classes) both read it without
importing each other.

Adding a kind: write a module with a subclass of `model.attention.Attention` (its capabilities and per-token
cost included) and add one line here. Tests add a kind for their duration with
`monkeypatch.setitem(ATTENTION_CLASSES, name, "module:Class")`.
"""

from __future__ import annotations

# kind -> "module:Class"
ATTENTION_CLASSES: dict[str, str] = {
    "softmax": "model.softmax_attention:SoftmaxAttention",
    "linear": "model.linear_attention:LinearAttention",
    "linformer": "model.linformer_attention:LinformerAttention",
    "reformer": "model.reformer_attention:ReformerAttention",
}


def attention_kinds() -> tuple[str, ...]:
    """Every registered kind, in registry order."""
    return tuple(ATTENTION_CLASSES)
