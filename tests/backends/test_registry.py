"""The backends' registries: devices, attention kinds (kernels.py), the folders kept apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm.backends import kernels, registry
from pagedllm.backends.base import DeviceBackend
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.gpu.backend import CudaBackend
from pagedllm.backends.xpu.backend import XpuBackend
from pagedllm.lazy import load_object

BACKENDS = Path(registry.__file__).parent
DEVICE_FOLDERS = ("cpu", "gpu", "xpu")


@pytest.mark.parametrize("folder", DEVICE_FOLDERS)
def test_no_device_folder_names_another(folder: str) -> None:
    """Neither an import nor a string (importlib target, path) reaches another device's folder:
    a kernel that runs on several devices is found through the kernel registry."""
    others = "|".join(f for f in DEVICE_FOLDERS if f != folder)
    pattern = re.compile(rf"backends[./\\](?:{others})\b|from \.\.(?:{others})\b")
    offenders = [
        f"{path.relative_to(BACKENDS)}:{n}: {line.strip()}"
        for path in sorted((BACKENDS / folder).rglob("*"))
        if path.is_file() and path.suffix in (".py", ".cpp", ".h")
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def test_every_kind_is_registered_on_a_known_device_and_loads_lazily() -> None:
    devices = set(registry.device_names()) - {"auto"}
    for row in kernels.entries("attention"):
        assert set(row.devices) <= devices, row.impl
        module, _, name = row.target.partition(":")
        assert module.startswith("pagedllm.backends.") and name, row.target
    # Importing a class does not import its runtime (triton, IPEX are loaded at construction).
    assert kernels.load(kernels.entry("attention", "triton")).name == "triton"
    assert kernels.load(kernels.entry("attention", "ipex")).name == "ipex"


@pytest.mark.parametrize("cls", [CpuBackend, CudaBackend, XpuBackend], ids=lambda c: c.name)
def test_auto_order_is_a_subset_of_the_kinds_that_run_on_the_device(cls: type) -> None:
    backend: DeviceBackend = cls()
    offered = kernels.impls_on("attention", backend.name)
    auto = backend.kernel_order["attention"]
    assert auto and set(auto) <= set(offered)
    assert "reference" in offered


def test_cpu_kinds_and_refusal() -> None:
    assert kernels.impls_on("attention", "cpu") == ["cpp", "torch", "triton", "ipex", "reference"]
    assert kernels.impls_on("attention", "cuda") == ["triton", "reference"]
    assert CpuBackend().attention("torch").name == "torch"
    assert CpuBackend().attention("reference").name == "reference"
    with pytest.raises(ValueError, match=r"^attention_backend: 'cpp' does not run on device"):
        CudaBackend().attention("cpp")
    with pytest.raises(ValueError, match=r"^attention_backend: 'nope'"):
        CpuBackend().attention("nope")


def test_auto_falls_back_in_declared_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first kind that constructs wins; when none does, every failure is named."""

    def broken() -> None:
        raise OSError("no compiler")

    real = kernels.load
    monkeypatch.setattr(kernels, "load", lambda row: broken if row.impl == "cpp" else real(row))
    assert CpuBackend().attention().name == "torch"
    monkeypatch.setattr(kernels, "load", lambda row: broken)
    with pytest.raises(ImportError, match="cpp: no compiler; torch: no compiler"):
        CpuBackend().attention("auto")


def test_devices_and_lazy_loader() -> None:
    assert registry.device_names() == ["auto", "cpu", "cuda", "xpu"]
    assert registry.backend_class("cpu") is CpuBackend
    assert registry.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="^device: unknown device 'tpu'"):
        registry.resolve_device("tpu")
    assert load_object("pagedllm.backends.cpu.backend:CpuBackend") is CpuBackend
    with pytest.raises(ValueError, match="module:Name"):
        load_object("pagedllm.backends.cpu.backend")
    with pytest.raises(ImportError):
        load_object("pagedllm.no_such_module:X")
