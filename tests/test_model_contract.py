"""The chunk-and-state contract every attention kind must keep.

`logits, state = model(tokens, state)`: a sequence fed as one parallel chunk
or as any split into chunks with a carried state gives the same logits; no
output depends on a later token; the attention math matches the reference
formulas written out; a chunk past max_len is refused.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model import SequenceTooLong
from model.attention.head_shapes import split_heads
from model.attention.linformer import BLOCK as LINFORMER_BLOCK
from model.attention.kinds import attention_kinds
from model.io.weights import load_model, save_model

from conftest import KINDS, TINY_MAX_LEN, make_tiny_config, make_tiny_model, make_tokens

CHUNK_TOLERANCE = 1e-4  # float32: what chunked and parallel paths must agree to
# derandomize: a property failure must reproduce on every run, not once in a while.
PROPERTY_SETTINGS = settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def draw_chunk_sizes(data, length: int, largest: int = 40) -> list[int]:
    """Random chunk sizes (each >= 1) that add up to `length`."""
    sizes: list[int] = []
    while sum(sizes) < length:
        sizes.append(data.draw(st.integers(1, min(largest, length - sum(sizes))), label="chunk"))
    return sizes


@torch.no_grad()
def run_chunked(model, tokens: torch.Tensor, sizes: list[int]):
    """Feed `tokens` (B, T) chunk by chunk with one carried state -> (B, T, V) logits, state."""
    state = model.new_state(tokens.shape[0])
    outputs, start = [], 0
    for size in sizes:
        logits, returned = model(tokens[:, start : start + size], state)
        assert returned is state  # updated in place and handed back
        outputs.append(logits)
        start += size
    return torch.cat(outputs, dim=1), state


@torch.no_grad()
def run_parallel(model, tokens: torch.Tensor) -> torch.Tensor:
    logits, state = model(tokens, None)
    assert state is None  # the parallel path keeps no state
    return logits


# ---------------------------------------------------------------- chunk invariance


@PROPERTY_SETTINGS
@given(data=st.data())
def test_chunked_logits_equal_parallel_logits(kind, data):
    length = data.draw(st.integers(1, TINY_MAX_LEN), label="length")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    sizes = draw_chunk_sizes(data, length)
    model = make_tiny_model(kind)
    tokens = make_tokens(seed, 2, length)
    expected = run_parallel(model, tokens)
    got, state = run_chunked(model, tokens, sizes)
    assert got.shape == (2, length, 256)
    torch.testing.assert_close(got, expected, atol=CHUNK_TOLERANCE, rtol=0)
    assert state.lengths.tolist() == [length, length]


def test_token_by_token_decoding_equals_parallel_over_full_max_len(kind):
    # The longest decode the tiny model allows: every cache slot gets used.
    model = make_tiny_model(kind)
    tokens = make_tokens(7, 2, TINY_MAX_LEN)
    got, _ = run_chunked(model, tokens, [1] * TINY_MAX_LEN)
    torch.testing.assert_close(got, run_parallel(model, tokens), atol=CHUNK_TOLERANCE, rtol=0)


# ---------------------------------------------------------------- causality


@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data())
def test_changing_a_token_never_changes_earlier_outputs(kind, data):
    length = data.draw(st.integers(3, 64), label="length")
    j = data.draw(st.integers(1, length - 2), label="changed position")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    sizes = draw_chunk_sizes(data, length, largest=24)
    model = make_tiny_model(kind)
    tokens = make_tokens(seed, 1, length)
    changed = tokens.clone()
    changed[0, j] = (tokens[0, j] + 1 + seed % 200) % 256
    for outputs in (run_parallel, lambda m, t: run_chunked(m, t, sizes)[0]):
        before, after = outputs(model, tokens), outputs(model, changed)
        torch.testing.assert_close(after[:, :j], before[:, :j], atol=1e-6, rtol=0)
        # And the change does travel forward, so the check above is not vacuous.
        assert (after[:, j:] - before[:, j:]).abs().max() > 1e-3


def test_later_positions_see_earlier_tokens_through_attention(kind):
    # Position j's own token reaches logits[j] through the residual; a change at
    # position 1 can reach logits[5] only through attention.
    model = make_tiny_model(kind)
    tokens = make_tokens(3, 1, 6)
    changed = tokens.clone()
    changed[0, 1] = (tokens[0, 1] + 100) % 256
    diff = (run_parallel(model, changed)[0, 5] - run_parallel(model, tokens)[0, 5]).abs().max()
    assert diff > 1e-3


# ---------------------------------------------------------------- reference math per kind


def _attention_input(attn, seed: int, length: int = 20):
    """Random attention input (B, T, C) from position 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, attn.proj.in_features, generator=gen)  # (B, T, C)
    start = torch.zeros(2, dtype=torch.long)
    return x, start


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)  # (B, H, T, D)


def _merge(y: torch.Tensor) -> torch.Tensor:
    b, h, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, h * d)


def reference_softmax(attn, x):
    q, k, v = (_heads(t, attn.n_heads) for t in attn.qkv(x).chunk(3, dim=-1))
    t, d = q.shape[2], q.shape[3]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return attn.proj(_merge(scores.softmax(-1) @ v))


def reference_phi(attn, x):
    """The feature map's formula, written out: elu + 1; relu(W x + b); [softmax(W x + b), softmax(-(W x + b))]."""
    name = type(attn.feature_map).__name__
    if name == "EluFeatureMap":
        return F.elu(x) + 1
    w, b = attn.feature_map.weight, attn.feature_map.bias  # (H, P, D), (H, P)
    projected = torch.stack([x[:, h] @ w[h].T + b[h] for h in range(w.shape[0])], dim=1)  # (B, H, T, P)
    if name == "T2RFeatureMap":
        return projected.clamp(min=0)
    assert name == "HedgehogFeatureMap", name
    return torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1)


def reference_linear(attn, x):
    """out_i = phi(q_i)^T S_i / (phi(q_i)^T Z_i + eps), prefix sums written out."""
    q, k, v = (_heads(t, attn.n_heads) for t in attn.qkv(x).chunk(3, dim=-1))
    phi_q, phi_k = reference_phi(attn, q), reference_phi(attn, k)
    s = torch.einsum("bhjd,bhje->bhjde", phi_k, v).cumsum(dim=2)  # (B, H, T, F, D): S_i
    z = phi_k.cumsum(dim=2)  # (B, H, T, F): Z_i
    num = torch.einsum("bhid,bhide->bhie", phi_q, s)
    den = torch.einsum("bhid,bhid->bhi", phi_q, z) + attn.eps
    return attn.proj(_merge(num / den[..., None]))


def reference_linformer(attn, x):
    """K~_i = sum_{j<=i} E[:, j] k_j^T, V~_i likewise with F; out_i = softmax(q_i K~_i^T / sqrt(d)) V~_i."""
    q, k, v = (_heads(t, attn.n_heads) for t in attn.qkv(x).chunk(3, dim=-1))
    b, h, t, d = q.shape
    f_param = attn.e if attn.f is None else attn.f
    out = torch.zeros_like(q)
    for head in range(h):
        proj = head if attn.e.shape[0] > 1 else 0  # per-head E, F unless shared
        e, f = attn.e[proj, :, :t], f_param[proj, :, :t]  # (k, T)
        k_tilde = torch.einsum("kj,bjd->bjkd", e, k[:, head]).cumsum(dim=1)  # (B, T, k, D)
        v_tilde = torch.einsum("kj,bjd->bjkd", f, v[:, head]).cumsum(dim=1)
        scores = torch.einsum("bid,bikd->bik", q[:, head], k_tilde) / math.sqrt(d)
        out[:, head] = torch.einsum("bik,bikd->bid", scores.softmax(-1), v_tilde)
    return attn.proj(_merge(out))


def reference_reformer(attn, x):
    """Shared-QK LSH attention: earlier keys in the query's bucket, itself only when
    the bucket holds nothing earlier; rounds weighted by softmax of their logsumexp.
    With a local window W, one more round whose keys are the W positions before."""
    q = _heads(attn.qk(x), attn.n_heads)
    v = _heads(attn.v(x), attn.n_heads)
    keys = F.normalize(q, dim=-1)
    rotated = torch.einsum("bhtd,rdn->bhrtn", keys, attn.rotations)
    buckets = torch.cat([rotated, -rotated], dim=-1).argmax(-1)  # (B, H, R, T)
    t, d = q.shape[2], q.shape[3]
    dots = (q @ keys.transpose(-1, -2)) / math.sqrt(d)  # (B, H, T, T)
    earlier = torch.ones(t, t, dtype=torch.bool).tril(-1)
    rounds = [
        (buckets[:, :, r, :, None] == buckets[:, :, r, None, :]) & earlier  # (B, H, T, T)
        for r in range(attn.rotations.shape[0])
    ]
    if attn.window:
        rounds.append(earlier & ~torch.ones(t, t, dtype=torch.bool).tril(-attn.window - 1))
    lse, outs = [], []
    for allowed in rounds:
        alone = ~allowed.any(dim=-1)  # nothing earlier in the bucket: attend to itself
        allowed = allowed | (torch.eye(t, dtype=torch.bool) & alone[..., None])
        scores = dots.masked_fill(~allowed, float("-inf"))
        lse.append(scores.logsumexp(-1))
        outs.append(scores.softmax(-1) @ v)
    weights = torch.stack(lse).softmax(dim=0)  # (R, B, H, T)
    return attn.proj(_merge((weights[..., None] * torch.stack(outs)).sum(0)))


def max_bucket_occupancy(attn, x) -> int:
    keys = F.normalize(_heads(attn.qk(x), attn.n_heads), dim=-1)
    buckets = attn.hash(keys)  # (B, H, R, T)
    return int(F.one_hot(buckets, attn.n_buckets).sum(dim=3).max())


REFERENCES = {
    "softmax": reference_softmax,
    "linear": reference_linear,
    "linformer": reference_linformer,
    "reformer": reference_reformer,
}


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("softmax", {}),
        ("linear", {}),
        ("linear+t2r", {}),
        ("linear+hedgehog", {}),
        ("linformer", {"linformer_sharing": "none"}),
        ("linformer", {"linformer_sharing": "headwise"}),
        ("linformer", {"linformer_sharing": "kv"}),
        ("reformer", {"reformer_rounds": 1}),
        ("reformer", {}),
        ("reformer", {"reformer_local_window": 0}),
        ("reformer", {"reformer_local_window": 1}),
        ("reformer", {"reformer_local_window": 64}),  # wider than the input: every earlier position
    ],
)
@torch.no_grad()
def test_attention_matches_reference_formula(kind, overrides):
    attn = make_tiny_model(kind, **overrides).blocks[0].attn
    x, start = _attention_input(attn, seed=11)
    got, state = attn(x, start, None)
    assert state is None
    torch.testing.assert_close(got, REFERENCES[kind.partition("+")[0]](attn, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 24])  # 24 does not divide 512: a padded last block
@torch.no_grad()
def test_reformer_bucketed_parallel_path_matches_reference_and_decoding(window):
    cfg = make_tiny_config("reformer", reformer_buckets=16, max_len=512, reformer_local_window=window)
    assert cfg.reformer_buckets // 2 == cfg.d_head  # square rotations, so they can be orthogonal
    attn = make_tiny_model("reformer", reformer_buckets=16, max_len=512, reformer_local_window=window).blocks[0].attn
    gen = torch.Generator().manual_seed(0)
    # Identity QK and orthogonal rotations: keys uniform on the sphere fall in equally
    # likely buckets, balanced enough for the bucketed (sort and pad) parallel path.
    attn.qk.weight.copy_(torch.eye(cfg.d_model))
    attn.qk.bias.zero_()
    for r in range(cfg.reformer_rounds):
        attn.rotations[r].copy_(torch.linalg.qr(torch.randn(cfg.d_head, cfg.d_head, generator=gen))[0])
    x = torch.randn(2, 512, cfg.d_model, generator=gen)  # (B, T, C)
    occupancy = max_bucket_occupancy(attn, x)
    # Same threshold as model.attention.reformer.bucketed.is_even: below it the bucketed form runs.
    assert 4 * attn.n_buckets * occupancy**2 <= 512**2, "buckets too uneven: test would not reach the bucketed path"
    start = torch.zeros(2, dtype=torch.long)
    parallel = attn(x, start, None)[0]
    torch.testing.assert_close(parallel, reference_reformer(attn, x), atol=1e-5, rtol=1e-5)
    state, outputs = attn.new_state(2, x.device, x.dtype), []
    for lo, hi in [(0, 200), (200, 201), (201, 202), (202, 512)]:
        outputs.append(attn(x[:, lo:hi], start + lo, state)[0])
    torch.testing.assert_close(torch.cat(outputs, dim=1), parallel, atol=CHUNK_TOLERANCE, rtol=0)


@pytest.mark.parametrize("window", [0, 16])
def test_reformer_long_sequence_decodes_like_the_parallel_path(window):
    model = make_tiny_model("reformer", reformer_buckets=16, max_len=256, reformer_local_window=window)
    tokens = make_tokens(21, 2, 256)
    expected = run_parallel(model, tokens)
    for sizes in ([1] * 256, [100, 1, 60, 95]):
        got, _ = run_chunked(model, tokens, sizes)
        torch.testing.assert_close(got, expected, atol=CHUNK_TOLERANCE, rtol=0)


# ---------------------------------------------------------------- max_len


def test_parallel_chunk_up_to_max_len_runs_and_past_it_raises(kind):
    model = make_tiny_model(kind, max_len=16)
    assert run_parallel(model, make_tokens(0, 1, 16)).shape == (1, 16, 256)
    with pytest.raises(SequenceTooLong, match=r"max_len is 16"):
        model(make_tokens(0, 1, 17), None)


@torch.no_grad()
def test_chunk_past_max_len_raises_and_leaves_the_state_usable(kind):
    model = make_tiny_model(kind, max_len=16)
    tokens = make_tokens(4, 2, 16)
    state = model.new_state(2)
    first, _ = model(tokens[:, :10], state)
    with pytest.raises(SequenceTooLong) as err:
        model(make_tokens(5, 2, 7), state)
    assert "max_len" in str(err.value) and "16" in str(err.value) and "17" in str(err.value)
    assert state.lengths.tolist() == [10, 10]  # refused before anything was written
    rest, _ = model(tokens[:, 10:], state)  # exactly up to max_len is fine
    torch.testing.assert_close(torch.cat([first, rest], 1), run_parallel(model, tokens), atol=CHUNK_TOLERANCE, rtol=0)
    with pytest.raises(SequenceTooLong, match="max_len"):
        model(tokens[:, :1], state)


# ---------------------------------------------------------------- Linformer sharing


def linformer_projection_parameters(sharing: str, cfg) -> int:
    per_matrix = cfg.linformer_k * cfg.max_len
    per_layer = {"none": 2 * cfg.n_heads * per_matrix, "headwise": 2 * per_matrix, "kv": per_matrix}[sharing]
    return cfg.n_layers * per_layer


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
def test_linformer_sharing_has_expected_parameter_count(sharing):
    cfg = make_tiny_config("linformer", linformer_sharing=sharing)
    model = make_tiny_model("linformer", linformer_sharing=sharing)
    softmax = make_tiny_model("softmax")  # same qkv, projections, blocks; no E, F
    extra = model.num_parameters() - softmax.num_parameters()
    assert extra == linformer_projection_parameters(sharing, cfg)
    has_f = any(name.endswith("attn.f") for name in model.state_dict())
    assert has_f == (sharing != "kv")


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
@settings(max_examples=10, deadline=None, derandomize=True)
@given(data=st.data())
def test_linformer_sharing_options_are_chunk_invariant(sharing, data):
    length = data.draw(st.integers(1, TINY_MAX_LEN), label="length")
    sizes = draw_chunk_sizes(data, length)
    model = make_tiny_model("linformer", linformer_sharing=sharing)
    tokens = make_tokens(length, 2, length)
    got, _ = run_chunked(model, tokens, sizes)
    torch.testing.assert_close(got, run_parallel(model, tokens), atol=CHUNK_TOLERANCE, rtol=0)


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
@torch.no_grad()
def test_linformer_blocked_form_matches_the_reference_across_blocks(sharing):
    """Several blocks and a partial last one, from position 0 and from a carried state
    with chunks that start and end inside blocks."""
    length = 2 * LINFORMER_BLOCK + 5
    attn = make_tiny_model("linformer", linformer_sharing=sharing, max_len=length).blocks[0].attn
    x, start = _attention_input(attn, seed=12, length=length)  # (B, T, C)
    expected = reference_linformer(attn, x)
    torch.testing.assert_close(attn(x, start, None)[0], expected, atol=1e-5, rtol=1e-5)
    state, outputs = attn.new_state(2, x.device, x.dtype), []
    for lo, hi in [(0, 3), (3, 4), (4, LINFORMER_BLOCK + 10), (LINFORMER_BLOCK + 10, length)]:
        outputs.append(attn(x[:, lo:hi], start + lo, state)[0])
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=CHUNK_TOLERANCE, rtol=0)


@pytest.mark.parametrize("sharing", ["none", "kv"])
@torch.no_grad()
def test_linformer_compiled_form_of_a_step_equals_the_eager_form(sharing):
    """The decode step torch.compile traces reads the state before its update and adds the update's
    share apart; run eagerly here, it must give the eager step's output and updated state."""
    attn = make_tiny_model("linformer", linformer_sharing=sharing).blocks[0].attn
    x, start = _attention_input(attn, seed=3, length=7)
    state = attn.new_state(2, x.device, x.dtype)
    attn(x[:, :6], start, state)  # a state with something in it
    q, k, v = (split_heads(t, attn.n_heads) for t in attn.qkv(x[:, 6:]).chunk(3, dim=-1))  # (B, H, 1, D)
    e = attn._columns(attn.e, start + 6, 1, state)
    f = e if attn.f is None else attn._columns(attn.f, start + 6, 1, state)
    fused_state = type(state)(state.keys_projected.clone(), state.values_projected_t.clone())
    expected = attn._step(q, k, v, e, f, state)
    got = attn._fused_step(q, k, v, e, f, fused_state)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_state.keys_projected, state.keys_projected, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused_state.values_projected_t, state.values_projected_t, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- Reformer hashing


def _keys_for_hashing(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(2, 4, 64, 8, generator=gen), dim=-1)  # (B, H, T, D)


def test_eval_reformer_hashes_and_predicts_the_same_every_time(tmp_path):
    model = make_tiny_model("reformer", reformer_buckets=16)
    attn = model.blocks[0].attn
    keys = _keys_for_hashing()
    assert torch.equal(attn.hash(keys), attn.hash(keys))
    tokens = make_tokens(1, 2, 40)
    first = run_parallel(model, tokens)
    assert torch.equal(run_parallel(model, tokens), first)
    path = tmp_path / "reformer.safetensors"
    save_model(model, path)
    loaded, _ = load_model(path)
    assert torch.equal(loaded.blocks[0].attn.rotations, attn.rotations)  # rotations travel with the weights
    assert torch.equal(loaded.blocks[0].attn.hash(keys), attn.hash(keys))
    assert torch.equal(run_parallel(loaded, tokens), first)


def test_training_reformer_draws_fresh_rotations_without_touching_the_stored_ones():
    model = make_tiny_model("reformer", reformer_buckets=16).train()
    attn = model.blocks[0].attn
    stored = attn.rotations.clone()
    keys = _keys_for_hashing()
    torch.manual_seed(0)
    assert not torch.equal(attn.hash(keys), attn.hash(keys))
    assert torch.equal(attn.rotations, stored)
    attn.eval()
    assert torch.equal(attn.hash(keys), attn.hash(keys))


def test_training_reformer_without_fresh_rotations_hashes_with_stored_ones():
    model = make_tiny_model("reformer", reformer_buckets=16, extra={"reformer_fresh_rotations": False})
    attn = model.blocks[0].attn
    keys = _keys_for_hashing()
    eval_buckets = attn.hash(keys)
    attn.train()
    assert torch.equal(attn.hash(keys), eval_buckets)


def test_every_kind_is_listed():
    # The parametrised `kind` fixture must cover exactly the kinds the config accepts.
    assert tuple(KINDS) == tuple(attention_kinds())
