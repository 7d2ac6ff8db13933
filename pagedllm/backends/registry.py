"""The two registries of the backends: devices and attention kinds, both imported lazily.

Devices: a name (``cpu``, ``cuda``, ``xpu``) -> its :class:`DeviceBackend` class, and the order
``device="auto"`` tries them in. Attention kinds: a kernel family (``cpp``, ``torch``, ``triton``,
``ipex``, ``reference``) -> its :class:`AttentionBackend` class and the devices it runs on. A
kernel family written for one device may run on another (Triton's interpreter and IPEX's CPU
build take CPU tensors); it is listed here once, so no device module names another device's
folder. Each device declares which kinds ``attention_backend="auto"`` tries, best first
(``DeviceBackend.attention_kinds``).

A backend whose optional dependency (triton, intel-extension-for-pytorch, the C++ toolchain) is
missing stays importable: its ``is_available()`` answers False and ``get_backend`` explains why.
Adding a kernel family is one entry in :data:`ATTENTION_KINDS` (plus the device's auto order if
it should be picked without being named).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.lazy import load_object

if TYPE_CHECKING:  # the registry itself imports no torch: the CLI lists devices without it
    from pagedllm.backends.base import AttentionBackend, DeviceBackend

_DEVICES: dict[str, str] = {
    "cpu": "pagedllm.backends.cpu.backend:CpuBackend",
    "cuda": "pagedllm.backends.gpu.backend:CudaBackend",
    "xpu": "pagedllm.backends.xpu.backend:XpuBackend",
}
# "auto" tries accelerators first and always ends on the CPU.
_AUTO_ORDER = ("cuda", "xpu", "cpu")


@dataclass(frozen=True)
class AttentionKind:
    """One kernel family: where its class lives and the devices whose tensors it takes."""

    target: str  # "module:Class"
    devices: tuple[str, ...]


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "cpp": AttentionKind("pagedllm.backends.cpu.kernel_attention:CppPagedAttention", ("cpu",)),
    "torch": AttentionKind("pagedllm.backends.cpu.attention:TorchPagedAttention", ("cpu",)),
    # Compiled on CUDA (and on XPU with triton's Intel backend); interpreted on CPU tensors.
    "triton": AttentionKind(
        "pagedllm.backends.gpu.attention:TritonPagedAttention", ("cuda", "xpu", "cpu")
    ),
    # IPEX's ops pick their implementation from the tensors' device: XPU, or its CPU build.
    "ipex": AttentionKind("pagedllm.backends.xpu.attention:IpexPagedAttention", ("xpu", "cpu")),
    # The slow plain-PyTorch oracle runs anywhere (debugging inside the engine).
    "reference": AttentionKind(
        "pagedllm.backends.reference:ReferenceAttention", ("cpu", "cuda", "xpu")
    ),
}


def device_names() -> list[str]:
    """Device names this build knows (``"auto"`` first), whether or not this machine has them."""
    return ["auto", *_DEVICES]


def backend_class(name: str) -> type[DeviceBackend]:
    """The backend class for a resolved device name, without checking the device is here."""
    return load_object(_DEVICES[name])


def attention_kinds_on(device: str) -> list[str]:
    """The attention kinds that can run on ``device``'s tensors, in registry order."""
    return [kind for kind, entry in ATTENTION_KINDS.items() if device in entry.devices]


def attention_class(kind: str) -> type[AttentionBackend]:
    """The class of an attention kind; ImportError when its module cannot load."""
    return load_object(ATTENTION_KINDS[kind].target)


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
