"""Reformer: the bucketed parallel path equals the dense reference semantics."""

import pytest
import torch
import torch.nn.functional as F

from model.reformer.bucketed import attend_bucketed as _lsh_attend_bucketed
from model.reformer.dense import lsh_attend as _lsh_attend


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

    got = _lsh_attend_bucketed(q, F.normalize(q, dim=-1), v, buckets, n, window)
    ref = _lsh_attend(q, F.normalize(q, dim=-1), v, buckets, buckets, pos, pos, window)
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


def test_local_round_lets_a_query_see_its_neighbour_in_another_bucket():
    # Every position alone in its bucket: the hashed round only ever sees itself, so
    # the output at i moves with v[i - 1] only through the local round.
    t, d = 6, 4
    q = torch.randn(1, 1, t, d)
    v = torch.randn(1, 1, t, d)
    buckets = torch.arange(t).view(1, 1, 1, t)
    v2 = v.clone()
    v2[..., 2, :] += 1.0
    for window, moved in [(0, [2]), (1, [2, 3]), (3, [2, 3, 4, 5])]:
        before = _lsh_attend_bucketed(q, F.normalize(q, dim=-1), v, buckets, t, window)
        after = _lsh_attend_bucketed(q, F.normalize(q, dim=-1), v2, buckets, t, window)
        changed = (after - before).abs().amax(dim=-1)[0, 0] > 1e-6
        assert changed.nonzero().flatten().tolist() == moved
