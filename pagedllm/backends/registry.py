"""Device name -> backend class, imported lazily so that ``import pagedllm`` works anywhere.

A backend whose optional dependency (triton, intel-extension-for-pytorch, the C++ toolchain) is
missing stays importable: its ``is_available()`` answers False and ``get_backend`` explains why.
"""

from __future__ import annotations

import importlib

from pagedllm.backends.base import DeviceBackend

_BACKENDS: dict[str, str] = {
    "cpu": "pagedllm.backends.cpu.backend:CpuBackend",
    "cuda": "pagedllm.backends.gpu.backend:CudaBackend",
    "xpu": "pagedllm.backends.xpu.backend:XpuBackend",
}
# "auto" tries accelerators first and always ends on the CPU.
_AUTO_ORDER = ("cuda", "xpu", "cpu")


def available_devices() -> list[str]:
    """Device names this build knows, whether or not this machine has them."""
    return list(_BACKENDS)


def backend_class(name: str) -> type[DeviceBackend]:
    """The backend class for a resolved device name, without checking the device is here."""
    return _load(name)


def _load(name: str) -> type[DeviceBackend]:
    module_name, _, cls_name = _BACKENDS[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, cls_name)


def resolve_device(name: str) -> str:
    """Map "auto" to the first available device; validate explicit names."""
    if name == "auto":
        for candidate in _AUTO_ORDER:
            try:
                if _load(candidate).is_available():
                    return candidate
            except ImportError:
                continue
        return "cpu"
    if name not in _BACKENDS:
        raise ValueError(f"device: unknown device {name!r}; choose one of {['auto', *_BACKENDS]}")
    return name


def get_backend(name: str) -> DeviceBackend:
    """Instantiate the backend for a resolved device name; a clear error if it cannot run."""
    resolved = resolve_device(name)
    cls = _load(resolved)
    if not cls.is_available():
        raise RuntimeError(
            f"device={resolved!r} was requested but is not available on this machine"
        )
    return cls()
