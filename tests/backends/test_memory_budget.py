"""One KV-cache budget formula for every accelerator, over the four primitives each supplies.

Budget = total x utilisation - held before profiling (weights, runtime context, other processes)
- the allocator's activation peak - memory that grew outside the allocator. Each device class
runs the same arithmetic on its own runtime's calls, faked here so that it is checked on any
machine. On XPU the weights were once left out of the sum (the budget ignored what the device
already held).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.gpu.backend import CudaBackend
from pagedllm.backends.xpu.backend import XpuBackend

GIB = 1 << 30


class FakeAllocator:
    """A device with 100 GiB: 20 GiB held (18 allocated by the weights), 80 GiB free."""

    def __init__(self) -> None:
        self.free, self.alloc, self.peak, self.reserved = 80 * GIB, 18 * GIB, 18 * GIB, 19 * GIB

    def profile(self) -> None:
        """5 GiB of activations, 6 GiB more reserved, 1 GiB outside the allocator."""
        self.peak = self.alloc + 5 * GIB
        self.reserved += 6 * GIB
        self.free -= 7 * GIB

    def install(self, monkeypatch: pytest.MonkeyPatch, module: object) -> None:
        fns = {
            "mem_get_info": lambda dev=None: (self.free, 100 * GIB),
            "memory_allocated": lambda dev=None: self.alloc,
            "max_memory_allocated": lambda dev=None: self.peak,
            "memory_reserved": lambda dev=None: self.reserved,
            "reset_peak_memory_stats": lambda dev=None: None,
            "synchronize": lambda dev=None: None,
            "empty_cache": lambda: None,
            "get_device_properties": lambda dev=None: type("P", (), {"total_memory": 100 * GIB}),
        }
        for name, fn in fns.items():
            monkeypatch.setattr(module, name, fn, raising=False)


@pytest.mark.parametrize("backend_cls", [CudaBackend, XpuBackend], ids=lambda c: c.name)
def test_budget_subtracts_weights_activations_and_outside_memory(
    backend_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch, torch.cuda if backend_cls is CudaBackend else torch.xpu)
    budget = backend_cls().kv_cache_budget_bytes(
        profile=fake.profile, gpu_memory_utilization=0.9, cpu_kv_cache_bytes=0
    )
    assert budget == 90 * GIB - 20 * GIB - 5 * GIB - 1 * GIB, budget / GIB


@pytest.mark.parametrize("backend_cls", [CudaBackend, XpuBackend], ids=lambda c: c.name)
def test_budget_never_negative(backend_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch, torch.cuda if backend_cls is CudaBackend else torch.xpu)
    budget = backend_cls().kv_cache_budget_bytes(
        profile=fake.profile, gpu_memory_utilization=0.1, cpu_kv_cache_bytes=0
    )
    assert budget == 0


def test_cpu_budget_is_the_explicit_one() -> None:
    ran: list[bool] = []
    budget = CpuBackend().kv_cache_budget_bytes(
        profile=lambda: ran.append(True), gpu_memory_utilization=0.9, cpu_kv_cache_bytes=123
    )
    # No profiling pass: it decided nothing on the CPU and was most of a 1B model's start.
    assert budget == 123 and ran == []
