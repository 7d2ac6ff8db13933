"""Shared fixtures of the backend tests."""

from __future__ import annotations

import shutil

import pytest

from pagedllm.backends.cpu._ops import load_kernels, supported_isas


@pytest.fixture(scope="module", params=supported_isas())
def ops(request: pytest.FixtureRequest):
    """The CPU ops extension (attention, layer kernels, sampler) at each ISA level this
    processor runs; modules testing another extension define their own ``ops``."""
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain (c++ and ninja) to build the CPU kernels")
    module = load_kernels(isa=request.param)
    assert module.built_isa() == request.param
    return module
