"""Reformer: the bucketed parallel path equals the dense reference semantics."""

import pytest
import torch
import torch.nn.functional as F

from model.reformer_attention import _lsh_attend, _lsh_attend_bucketed


@pytest.mark.parametrize("rounds", [1, 3])
def test_bucketed_path_matches_dense_reference(rounds):
    torch.manual_seed(rounds)
    b, h, t, d, n = 2, 2, 400, 8, 16
    q = torch.randn(b, h, t, d, requires_grad=True)
    v = torch.randn(b, h, t, d)
    buckets = torch.randint(0, n, (b, h, rounds, t))
    counts = F.one_hot(buckets, n).sum(3)
    assert 4 * n * int(counts.max()) ** 2 <= t * t, "test must exercise the bucketed path"
    pos = torch.arange(t).expand(b, t)

    got = _lsh_attend_bucketed(q, F.normalize(q, dim=-1), v, buckets, n)
    ref = _lsh_attend(q, F.normalize(q, dim=-1), v, buckets, buckets, pos, pos)
    assert torch.allclose(got, ref, atol=1e-5)

    (grad_got,) = torch.autograd.grad(got.square().sum(), q)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), q)
    assert torch.allclose(grad_got, grad_ref, atol=1e-4)


def test_first_member_of_a_bucket_attends_to_itself():
    # Every position in its own bucket: nothing earlier anywhere, so out_i = v_i.
    t, d = 6, 4
    q = torch.randn(1, 1, t, d)
    v = torch.randn(1, 1, t, d)
    buckets = torch.arange(t).view(1, 1, 1, t)
    pos = torch.arange(t).expand(1, t)
    out = _lsh_attend(q, F.normalize(q, dim=-1), v, buckets, buckets, pos, pos)
    assert torch.allclose(out, v, atol=1e-6)
