"""Helpers for the tests of the CPU kernels (model/kernels/): the mark that skips them where no C++ compiler can
build the kernels, a fixture that builds (or finds) and loads them once per test module, and the comparison of a
one-call step (model/decode/compiled/whole_step.py) with the eager model's.

A test module takes the fixture, named `kernels`, by importing it (pytest finds fixtures among a module's names):
`from kernel_support import loaded_kernels  # noqa: F401`; pytest.mark.usefixtures("kernels") in its `pytestmark`
loads them for every test of the module.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence

import pytest
import torch

from model.kernels.loader import KernelBuild, load_kernels
from model.state import ModelState
from model.transformer import Transformer

from conftest import random_bytes


def compiler_on_path() -> bool:
    """Whether a C++ compiler is on PATH: the kernels are built with it (model/kernels/loader.py)."""
    return any(shutil.which(c) for c in ("c++", "g++", "clang++"))


needs_compiler = pytest.mark.skipif(
    not compiler_on_path(), reason="no C++ compiler on PATH: the CPU kernels cannot be built here"
)


@pytest.fixture(scope="module", name="kernels")
def loaded_kernels() -> KernelBuild:
    """The CPU kernels, built here if need be and loaded: a build that fails fails the test, with the error."""
    build = load_kernels()
    assert build.ok, build.error
    return build


def run_both(
    model: Transformer,
    step: Callable[[torch.Tensor, ModelState], torch.Tensor],
    eager: ModelState,
    one_call: ModelState,
    steps: int,
) -> float:
    """Greedy steps of the eager model on `eager` and of a one-call step on `one_call` (two equal states) from the
    same tokens, each taking the eager model's pick: the largest logit difference. The states are left as the steps
    left them (`assert_states_close`)."""
    with torch.inference_mode():
        tokens, worst = random_bytes(2, eager.batch_size, 1)[:, 0], 0.0
        for _ in range(steps):
            want, got = model.decode_step(tokens, eager), step(tokens, one_call)
            assert got.shape == want.shape
            worst = max(worst, float((want - got).abs().max()))
            tokens = want.argmax(-1)
    return worst


def assert_states_close(got: ModelState, want: ModelState, names: Sequence[str]) -> None:
    """The same row lengths, and each layer's state tensors `names` (its kind's fields) close."""
    assert torch.equal(got.lengths, want.lengths)
    for got_layer, want_layer in zip(got.layers, want.layers, strict=True):
        for name in names:
            torch.testing.assert_close(getattr(got_layer, name), getattr(want_layer, name), rtol=1e-5, atol=1e-4)
