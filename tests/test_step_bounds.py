"""benchmarks/step_bounds.py times the products and the state traffic that the roofline counts (benchmarks/roofline.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.roofline import attention_cost, dense_flops
from benchmarks.step_bounds import products, state_tensors, step_linear_layers
from model.kernels.packed_linear import PackedLinear

from conftest import make_tiny_model


@pytest.mark.parametrize("kind", ["linear", "linformer"])
def test_its_products_and_state_pass_are_the_roofline_s_flops_and_bytes(kind):
    model = make_tiny_model(kind)
    batch = 3
    layers = step_linear_layers(model)
    run, flops = products(layers, batch)
    run()
    assert flops == batch * dense_flops(model.config)
    moved = 2 * sum(t.numel() * t.element_size() for t in state_tensors(model, batch))  # read and written
    assert moved == batch * attention_cost(model.config, 100)[1]


def test_it_times_the_layers_the_compiled_step_multiplies_with():
    """The packed twin's layers where the kernel takes the model's (else the model's own), in the model's order:
    each computes what the model's layer in its place does."""
    model = make_tiny_model("linear")
    layers = step_linear_layers(model)
    own = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(layers) == len(own) == 4 * model.config.n_layers + 1  # qkv, proj, up, down a block; the head
    assert len({isinstance(layer, PackedLinear) for layer in layers}) == 1  # all packed or none
    for layer, linear in zip(layers, own):
        x = torch.randn(2, linear.in_features)
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
