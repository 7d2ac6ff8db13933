"""The device registry: a name (``cpu``, ``cuda``, ``xpu``) -> its :class:`DeviceBackend` class,
imported lazily, and the order ``device="auto"`` tries them in.

A backend whose optional dependency (triton, intel-extension-for-pytorch, the C++ toolchain) is
missing stays importable: its ``is_available()`` answers False and ``get_backend`` explains why.
The kernels each device runs are chosen in ``backends/kernels.py`` (the kernel registry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.lazy import load_object

if TYPE_CHECKING:  # the registry itself imports no torch: the CLI lists devices without it
    from pagedllm.backends.base import DeviceBackend

_DEVICES: dict[str, str] = {
    "cpu": "pagedllm.backends.cpu.backend:CpuBackend",
    "cuda": "pagedllm.backends.gpu.backend:CudaBackend",
    "xpu": "pagedllm.backends.xpu.backend:XpuBackend",
}
# "auto" tries accelerators first and always ends on the CPU.
_AUTO_ORDER = ("cuda", "xpu", "cpu")


def device_names() -> list[str]:
    """Device names this build knows (``"auto"`` first), whether or not this machine has them."""
    return ["auto", *_DEVICES]


def backend_class(name: str) -> type[DeviceBackend]:
    """The backend class for a resolved device name, without checking the device is here."""
    return load_object(_DEVICES[name])


def resolve_device(name: str) -> str:
    """Map "auto" to the first available device; validate explicit names."""
    if name == "auto":
        for candidate in _AUTO_ORDER:
            try:
                if backend_class(candidate).is_available():
                    return candidate
            except ImportError:
                continue
        return "cpu"
    if name not in _DEVICES:
        raise ValueError(f"device: unknown device {name!r}; choose one of {device_names()}")
    return name


def get_backend(name: str) -> DeviceBackend:
    """Instantiate the backend for a resolved device name; a clear error if it cannot run."""
    resolved = resolve_device(name)
    cls = backend_class(resolved)
    if not cls.is_available():
        raise RuntimeError(
            f"device={resolved!r} was requested but is not available on this machine"
        )
    return cls()
