"""The plain PyTorch peer of `rnnserve bench --peers`: its in-place recurrence computes what the out-of-place one
(new S and Z every step, one einsum each, as fast-transformers' recurrent code does) computes, on the same weights,
and keeps its sums in the same tensors from step to step."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.peers import LINEAR_EPS, plain_recurrence
from training.presets import PRESETS

SIZES = PRESETS["tiny"].architecture()
MAX_LEN = 40


def out_of_place_layer(layer, x: torch.Tensor, state):
    """The recurrence as the peer computed it before: S and Z summed into new tensors every step."""
    b = x.shape[0]
    q, k, v = (t.view(b, layer.heads, -1) for t in layer.qkv(layer.ln1(x)).chunk(3, dim=-1))  # (B, H, D)
    q, k = F.elu(q) + 1, F.elu(k) + 1
    s, z = state if state is not None else (k.new_zeros(*k.shape, k.shape[-1]), torch.zeros_like(k))
    s = s + torch.einsum("bhd,bhe->bhde", k, v)
    z = z + k
    out = torch.einsum("bhd,bhde->bhe", q, s) / (torch.einsum("bhd,bhd->bh", q, z)[..., None] + LINEAR_EPS)
    x = x + layer.proj(out.reshape(b, -1))
    return x + layer.down(F.gelu(layer.up(layer.ln2(x)))), (s, z)


class OutOfPlaceStack(nn.Module):
    """The in-place stack's own layers and weights, stepped the out-of-place way."""

    def __init__(self, stack: nn.Module):
        super().__init__()
        self.stack = stack

    def forward(self, x: torch.Tensor, state):
        state = state or [None] * len(self.stack.layers)
        for i, layer in enumerate(self.stack.layers):
            x, state[i] = out_of_place_layer(layer, x, state[i])
        return self.stack.norm(x), state


def seeded_model():
    torch.manual_seed(0)
    model, _ = plain_recurrence(SIZES, MAX_LEN)
    for parameter in model.parameters():  # wider than the default init: outputs far from one another
        parameter.data.normal_(0, 0.3)
    return model


@torch.inference_mode()
def test_in_place_steps_give_the_out_of_place_recurrences_logits_in_the_same_state_tensors():
    model = seeded_model()
    reference = OutOfPlaceStack(model.step_module)
    tokens = torch.randint(0, 256, (3, MAX_LEN), generator=torch.Generator().manual_seed(1))  # (B, T)
    state, reference_state, storage = None, None, None
    for pos in range(MAX_LEN):
        x = model.tok(tokens[:, pos]) + model.pos.weight[pos]  # (B, d)
        y, state = model.step_module(x, state)
        expected, reference_state = reference(x, reference_state)
        torch.testing.assert_close(model.head(y), model.head(expected), rtol=1e-5, atol=1e-5)
        storage = storage or [sums.sz_t.data_ptr() for sums in state]
        assert [sums.sz_t.data_ptr() for sums in state] == storage  # updated in place, never reallocated
    s, z = reference_state[0]  # (B, H, D, D), (B, H, D)
    torch.testing.assert_close(state[0].sz_t[..., :-1, :], s.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0].sz_t[..., -1, :], z, rtol=1e-5, atol=1e-5)


def test_the_peer_generates_the_out_of_place_recurrences_tokens():
    model = seeded_model()
    reference = copy.deepcopy(model)
    reference.step_module = OutOfPlaceStack(reference.step_module)
    tokens = model.generate(4, MAX_LEN)  # (B, T), rnnserve's sampler seeded per row
    assert tokens.shape == (4, MAX_LEN) and len(set(tokens.flatten().tolist())) > 10
    assert torch.equal(tokens, reference.generate(4, MAX_LEN))
