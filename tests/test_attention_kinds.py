"""A sixth attention kind, added the documented way: one class and one registry entry.

`MeanAttention` below outputs, at each position, the mean of the values of
every position so far, scaled by a hyperparameter of its own (`mean_scale`,
declared in its registry entry), with a constant-size running sum as its state. The
module's `kind` fixture registers it for this module's duration (as
model/attention/classes.py says: `monkeypatch.setitem(ATTENTION_KINDS, ...)`), and
the chunk-and-state contract tests of the four shipped kinds run again for it,
unchanged. The other tests check that config validation, the CLI, the
capability-derived lists, decoding, the roofline and the benchmark all pick
the new kind up without an edit of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from benchmarks.decode import run_decode_bench
from benchmarks.decode_settings import DecodeSettings
from benchmarks.roofline import attention_cost
from benchmarks.run import QUICK
from model.attention.base import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from model.config import ConfigError, ModelConfig
from model.attention.kinds import AttentionKind, KindOption
from model.decode.compiled.decoder import CompiledDecoder
from model.decode.eager_and_cuda_graphs import EagerDecoder, PaddedDecoder
from model.decode.choice import make_decoder
from model.attention.head_shapes import chunk_positions, merge_heads, split_heads
from model.attention.classes import ATTENTION_KINDS, attention_class, attention_kinds, kinds_where
from model.state import RowState
from model.io.weights import load_model, save_model
from training.train import build_config
from rnnserve_cli import parse_args

from conftest import make_tiny_config, make_tiny_model, random_bytes

# The contract every kind keeps, collected again here so that it runs with this module's `kind`.
from test_model_contract import (
    test_changing_a_token_never_changes_earlier_outputs,  # noqa: F401
    test_chunk_past_max_len_raises_and_leaves_the_state_usable,
    test_chunked_logits_equal_parallel_logits,
    test_later_positions_see_earlier_tokens_through_attention,
    test_parallel_chunk_up_to_max_len_runs_and_past_it_raises,
    test_token_by_token_decoding_equals_parallel_over_full_max_len,
)
from test_model_state import (
    test_copied_rows_generate_identically_and_spare_other_rows,  # noqa: F401
    test_decoding_a_view_of_the_live_rows_matches_and_spares_the_rest,
    test_reset_row_behaves_like_a_fresh_sequence_and_spares_other_rows,
    test_rows_at_different_positions_match_their_own_sequences,
)

NEW_KIND = "mean"
MEAN_OPTIONS = (KindOption("mean_scale", 1.0, "multiplies the mean of the values", minimum=0.0, parameter_free=True),)


@dataclass
class RunningSum(RowState):
    total: torch.Tensor  # (B, H, D) float32: sum of the values so far


class MeanAttention(Attention):
    """out_i = mean of v_j over j <= i (a causal average: no queries, no keys)."""

    capabilities = Capabilities(constant_state=True, graphable=True, paddable=True, compilable=True)
    projections = 2  # values and output

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # One add and one divide per number; the running sum is read and written whole.
        return TokenCost(flops=2 * cfg.d_model, state_bytes=2 * cfg.d_model * STATE_NUMBER_BYTES)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.scale = cfg.mean_scale
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> RunningSum:
        return RunningSum(torch.zeros(batch, self.n_heads, self.v.out_features // self.n_heads, device=device))

    def forward(self, x: torch.Tensor, start: torch.Tensor, state: RunningSum | None):
        sums = split_heads(self.v(x), self.n_heads).float().cumsum(dim=2)  # (B, H, T, D)
        if state is not None:
            sums = sums + state.total[:, :, None]
            state.total.copy_(sums[:, :, -1])
        counts = chunk_positions(start, x.shape[1]) + 1  # (B, T) positions seen so far
        means = self.scale * sums / counts[:, None, :, None]
        return self.proj(merge_heads(means.to(x.dtype))), state


@pytest.fixture(scope="module")
def kind():
    """The new kind, registered for this module only (module scope: hypothesis tests use it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(ATTENTION_KINDS, NEW_KIND, AttentionKind(f"{__name__}:MeanAttention", MEAN_OPTIONS))
        yield NEW_KIND


def test_config_cli_and_capability_lists_include_the_new_kind(kind):
    assert ModelConfig(attention=kind).attention == kind
    assert attention_kinds()[-1] == kind and attention_class(kind) is MeanAttention
    assert kind in kinds_where(lambda c: c.constant_state) and kind in kinds_where(lambda c: c.graphable)
    args = parse_args(["train", "--task", "text", "--attention", kind, "--data", "x.txt", "--out", "m.safetensors"])
    assert args.attention == kind
    assert kind in DecodeSettings().kinds  # the benchmark's default: every kind


def test_the_new_kind_s_own_hyperparameter_is_a_config_key_a_flag_and_a_check(kind, tmp_path):
    config = ModelConfig(attention=kind, mean_scale=0.5)
    assert config.mean_scale == 0.5 and '"mean_scale": 0.5' in config.to_json()
    assert ModelConfig.from_json(config.to_json()) == config
    assert ModelConfig.from_dict({"attention": kind}).mean_scale == 1.0  # a file without it: the declared default
    with pytest.raises(ConfigError, match="mean_scale must be >= 0.0, got -1"):
        ModelConfig(attention=kind, mean_scale=-1)
    with pytest.raises(ConfigError, match="mean_scale must be a number, got 'x'"):
        ModelConfig.from_dict({"attention": kind, "mean_scale": "x"})
    train = ["train", "--task", "text", "--attention", kind, "--data", "x.txt", "--out", "m.safetensors"]
    assert build_config(parse_args(train)).mean_scale == 1.0
    assert build_config(parse_args(train + ["--mean-scale", "0.25"])).mean_scale == 0.25
    halved, whole = make_tiny_model(kind, mean_scale=0.5), make_tiny_model(kind)
    save_model(halved, tmp_path / "halved.safetensors")
    loaded, _ = load_model(tmp_path / "halved.safetensors")
    assert loaded.config.mean_scale == 0.5 and loaded.blocks[0].attn.scale == 0.5
    tokens = random_bytes(1, 2, 6)
    with torch.inference_mode():  # the class reads it: same weights, other outputs
        assert not torch.allclose(loaded(tokens)[0], whole(tokens)[0])
        torch.testing.assert_close(loaded(tokens)[0], halved(tokens)[0])


def test_the_model_builds_with_the_new_attention_and_a_constant_state(kind):
    model = make_tiny_model(kind)
    assert all(isinstance(block.attn, MeanAttention) for block in model.blocks)
    assert model.capabilities == MeanAttention.capabilities
    assert model.state_bytes_per_sequence(1) == model.state_bytes_per_sequence()


@torch.inference_mode()
def test_padded_decode_steps_of_the_new_kind_match_exact_steps(kind):
    model = make_tiny_model(kind)
    eager, padded = EagerDecoder(model, model.new_state(3)), PaddedDecoder(model, model.new_state(4), [4])
    tokens = random_bytes(1, 3, 10)
    for step in range(10):
        torch.testing.assert_close(padded(tokens[:, step]), eager(tokens[:, step]), atol=1e-5, rtol=0)


def test_the_declared_compilable_capability_picks_the_compiled_cpu_decoder(kind, monkeypatch):
    model = make_tiny_model(kind)
    assert type(make_decoder(model, model.new_state(2), cuda_graphs=False, compiled=True)) is CompiledDecoder
    monkeypatch.setattr(MeanAttention, "capabilities", replace(MeanAttention.capabilities, compilable=False))
    assert type(make_decoder(model, model.new_state(2), cuda_graphs=False, compiled=True)) is EagerDecoder
    with pytest.raises(ValueError, match=f"{kind} decode steps are not compiled; compilable kinds: softmax, linear"):
        CompiledDecoder(model, model.new_state(2))


def test_roofline_reads_the_declared_cost_which_matches_the_real_state(kind):
    cfg = make_tiny_config(kind)
    flops, moved = attention_cost(cfg, 50)
    assert (flops, moved) == (cfg.n_layers * 2 * cfg.d_model, cfg.n_layers * 2 * cfg.d_model * STATE_NUMBER_BYTES)
    assert moved == 2 * make_tiny_model(kind).state_bytes_per_sequence(50)  # the whole sum, read and written


def test_the_benchmark_checks_the_flatness_of_the_new_constant_state_kind(kind):
    settings = replace(
        DecodeSettings(**QUICK),
        kinds=("softmax", kind),
        batch_sizes=(1,),
        image_tokens=8,
        max_position=128,
        steps_per_position=1,
        nocache_pixels=2,
        nocache_samples=1,
    )
    report = run_decode_bench(settings, progress=lambda line: None)
    assert [f.kind for f in report.flatness] == [kind]  # constant state: measured; softmax: not
    assert set(report.positions) == {"softmax", kind} and set(report.roofline) == {"softmax", kind}


def test_an_unregistered_kind_is_refused_with_the_registered_ones_listed(kind, capsys):
    with pytest.raises(ConfigError, match=f"unknown attention 'lstm'; expected one of .*{kind}"):
        ModelConfig(attention="lstm")
    with pytest.raises(SystemExit):
        parse_args(["train", "--task", "text", "--attention", "lstm", "--data", "x", "--out", "y"])
    assert "argument --attention: invalid choice: 'lstm'" in capsys.readouterr().err


def test_a_class_without_capabilities_or_outside_the_base_is_refused(monkeypatch):
    with pytest.raises(TypeError, match="must declare `capabilities = Capabilities"):
        type("Undeclared", (Attention,), {})
    monkeypatch.setitem(ATTENTION_KINDS, "plain", AttentionKind("torch.nn:Linear"))
    with pytest.raises(TypeError, match="'plain' names torch.nn:Linear, which is not an Attention subclass"):
        attention_class("plain")
