"""Helpers for the tests of the CPU kernels (model/kernels/): the mark that skips them where no C++ compiler can
build the kernels, and a fixture that builds (or finds) and loads them once per test module.

A test module takes the fixture, named `kernels`, by importing it (pytest finds fixtures among a module's names):
`from kernel_support import loaded_kernels  # noqa: F401`; pytest.mark.usefixtures("kernels") in its `pytestmark`
loads them for every test of the module.
"""

from __future__ import annotations

import shutil

import pytest

from model.kernels.loader import KernelBuild, load_kernels


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
