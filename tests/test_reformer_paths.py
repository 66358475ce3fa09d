"""Reformer: every path computes the dense reference semantics, and hashing survives 16-bit models.

The bucketed (sorted, padded buckets) and causal (one fused causal attention with
bucket codes) parallel paths must equal the dense form, values and gradients; the
model built on the causal path must decode like it; rotations stay float32.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from model.attention.reformer.bucketed import attend_bucketed, bucket_sizes, is_even, local_round
from model.attention.reformer.causal import attend_causal
from model.attention.reformer.dense import lsh_attend
from model.attention.reformer.hashing import unit_keys
from model.io.weights import load_model, save_model

from conftest import make_tiny_model, make_tokens

CHUNK_TOLERANCE = 1e-4  # float32, as in test_model_contract


@pytest.mark.parametrize("rounds, window", [(1, 0), (3, 0), (1, 7), (2, 400)])
def test_bucketed_path_matches_dense_reference(rounds, window):
    torch.manual_seed(rounds)
    b, h, t, d, n = 2, 2, 400, 8, 16
    q = torch.randn(b, h, t, d, requires_grad=True)
    v = torch.randn(b, h, t, d)
    buckets = torch.randint(0, n, (b, h, rounds, t))
    counts = F.one_hot(buckets, n).sum(3)
    assert 4 * n * int(counts.max()) ** 2 <= t * t, "test must exercise the bucketed path"
    pos = torch.arange(t).expand(b, t)

    got = attend_bucketed(q, F.normalize(q, dim=-1), v, buckets, n, window)
    ref = lsh_attend(q, F.normalize(q, dim=-1), v, buckets, buckets, pos, pos, window)
    assert torch.allclose(got, ref, atol=1e-5)

    (grad_got,) = torch.autograd.grad(got.square().sum(), q)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), q)
    assert torch.allclose(grad_got, grad_ref, atol=1e-4)


@pytest.mark.parametrize("n_buckets, window", [(2, 0), (16, 0), (32, 1), (16, 7), (32, 32), (4, 400)])
def test_causal_path_matches_dense_reference(n_buckets, window):
    torch.manual_seed(n_buckets + window)
    b, h, t, d = 2, 2, 300, 8
    q = (3 * torch.randn(b, h, t, d)).requires_grad_(True)  # spread-out scores: the bucket codes must still win
    v = torch.randn(b, h, t, d, requires_grad=True)
    buckets = torch.randint(0, n_buckets, (b, h, 1, t))
    pos = torch.arange(t).expand(b, t)

    got = attend_causal(q, F.normalize(q, dim=-1), v, buckets, n_buckets, window)
    ref = lsh_attend(q, F.normalize(q, dim=-1), v, buckets, buckets, pos, pos, window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

    grad_got = torch.autograd.grad(got.square().sum(), (q, v))
    grad_ref = torch.autograd.grad(ref.square().sum(), (q, v))
    for g, r in zip(grad_got, grad_ref):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_itself", [False, True])
def test_local_round_backward_matches_finite_differences(with_itself):
    # The local round's backward is written by hand: check it, logsumexp and own-key counts included.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 11, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    itself = torch.rand(1, 2, 11, generator=gen) < 0.5 if with_itself else None
    assert torch.autograd.gradcheck(lambda *x: local_round(*x, window=4, itself=itself), (q, k, v))


def test_first_member_of_a_bucket_attends_to_itself():
    # Every position in its own bucket: nothing earlier anywhere, so out_i = v_i.
    t, d = 6, 4
    q = torch.randn(1, 1, t, d)
    v = torch.randn(1, 1, t, d)
    buckets = torch.arange(t).view(1, 1, 1, t)
    pos = torch.arange(t).expand(1, t)
    out = lsh_attend(q, F.normalize(q, dim=-1), v, buckets, buckets, pos, pos)
    assert torch.allclose(out, v, atol=1e-6)
    assert torch.allclose(attend_causal(q, F.normalize(q, dim=-1), v, buckets, t), v, atol=1e-6)


@pytest.mark.parametrize("path", [attend_bucketed, attend_causal])
def test_local_round_lets_a_query_see_its_neighbour_in_another_bucket(path):
    # Every position alone in its bucket: the hashed round only ever sees itself, so
    # the output at i moves with v[i - 1] only through the local round.
    t, d = 6, 4
    q = torch.randn(1, 1, t, d)
    v = torch.randn(1, 1, t, d)
    buckets = torch.arange(t).view(1, 1, 1, t)
    v2 = v.clone()
    v2[..., 2, :] += 1.0
    for window, moved in [(0, [2]), (1, [2, 3]), (3, [2, 3, 4, 5])]:
        before = path(q, F.normalize(q, dim=-1), v, buckets, t, window)
        after = path(q, F.normalize(q, dim=-1), v2, buckets, t, window)
        changed = (after - before).abs().amax(dim=-1)[0, 0] > 1e-6
        assert changed.nonzero().flatten().tolist() == moved


def _sequence_buckets_are_uneven(model, tokens) -> bool:
    """Run the parallel path and report whether every layer's buckets are too uneven for
    `bucketed`, so that its whole-sequence path is the causal one."""
    uneven = []

    def check(attn, inputs, _output):
        x = inputs[0]  # (B, T, C) the layer's normalised input
        keys = unit_keys(attn.qk(x).view(*x.shape[:2], attn.n_heads, -1).transpose(1, 2))
        uneven.append(not is_even(bucket_sizes(attn.hash(keys), attn.n_buckets), x.shape[1]))

    hooks = [block.attn.register_forward_hook(check) for block in model.blocks]
    model(tokens, None)
    for hook in hooks:
        hook.remove()
    return all(uneven)


@pytest.mark.parametrize("window", [0, 16])
@torch.no_grad()
def test_one_round_model_decodes_like_its_causal_parallel_path(window):
    model = make_tiny_model(
        "reformer", reformer_rounds=1, reformer_buckets=8, max_len=160, reformer_local_window=window
    )
    tokens = make_tokens(3, 2, 160)
    assert _sequence_buckets_are_uneven(model, tokens), "test must exercise the causal path"
    expected = model(tokens, None)[0]
    for sizes in ([1] * 160, [50, 1, 60, 49]):
        state, outputs, start = model.new_state(2), [], 0
        for size in sizes:
            outputs.append(model(tokens[:, start : start + size], state)[0])
            start += size
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=CHUNK_TOLERANCE, rtol=0)


# ---------------------------------------------------------------- rotations in float32


def _bf16_exact_keys() -> torch.Tensor:
    """(B, H, T, D) unit keys whose float32 values bfloat16 holds exactly: the same keys in both dtypes."""
    gen = torch.Generator().manual_seed(0)
    return F.normalize(torch.randn(2, 4, 512, 8, generator=gen), dim=-1).bfloat16().float()


def test_bfloat16_model_hashes_exactly_like_the_float32_model():
    model = make_tiny_model("reformer", reformer_buckets=16)
    keys = _bf16_exact_keys()
    half = copy.deepcopy(model).to(torch.bfloat16)
    for attn, half_attn in zip((b.attn for b in model.blocks), (b.attn for b in half.blocks)):
        assert half_attn.qk.weight.dtype == torch.bfloat16 and half_attn.rotations.dtype == torch.float32
        assert torch.equal(half_attn.rotations, attn.rotations)
        assert torch.equal(half_attn.hash(keys.bfloat16()), attn.hash(keys))


def test_bfloat16_save_and_load_keep_the_rotations_bit_exact(tmp_path):
    model = make_tiny_model("reformer", reformer_buckets=16)
    path = tmp_path / "reformer-bf16.safetensors"
    save_model(model, path, dtype=torch.bfloat16)
    loaded, _ = load_model(path, dtype=torch.bfloat16)
    keys = _bf16_exact_keys()
    for attn, loaded_attn in zip((b.attn for b in model.blocks), (b.attn for b in loaded.blocks)):
        assert loaded_attn.qk.weight.dtype == torch.bfloat16  # the parameters were cast
        assert loaded_attn.rotations.dtype == torch.float32
        assert torch.equal(loaded_attn.rotations, attn.rotations)
        assert torch.equal(loaded_attn.hash(keys.bfloat16()), attn.hash(keys))
