"""The kernel registry: which implementation of each op runs on a device, and why not the others.

Every kernel the backends offer is one :class:`Kernel` row of :data:`KERNELS`: the op it computes,
its implementation family, the devices whose tensors it takes, the weight formats it multiplies
as stored (linear and MoE rows) and a lazily loaded ``"module:object"`` target. A device declares
per op the implementations it prefers, best first (``DeviceBackend.kernel_order``);
:func:`select` walks that order and answers a :class:`Selection`: the kernel that runs, and for
every other row of the op a :class:`Refusal` saying why it did not (the way ggml's backends
answer "supports op"). A kernel written for one device may run on another (Triton's interpreter
and IPEX's CPU build take CPU tensors): its row lists every such device once, so no device
folder names another.

What a target is depends on the op:

* built ops (:data:`BUILT_OPS`: attention, lora, sample, int8_quantize, gguf_decode): a callable
  taking no arguments (an ``AttentionBackend`` class, a factory) that returns the kernel, or None
  when it cannot run on this machine (its C++ extension did not build, say); raising ImportError,
  RuntimeError or OSError means the same, with the reason;
* installed ops (:data:`INSTALLED_OPS`: linear, moe, norm, activation, rotary,
  encoder_attention, decode_stack): an installer ``(model, *, int8_activations) -> str |
  Mapping[str, str]`` that fills the layers' fast slots (``fast_linear``, ``fast_moe``,
  ``fast_norm``, ``fast_act``, ``fast_rotary``, ``fast_encoder_attn``; the model's
  ``fast_decode``) and describes what it put in; layers it cannot serve keep their PyTorch
  definition.

An op with no kernel on a device runs its layer's own PyTorch definition (the sampler's
``draw_reference``, ``quantize_per_channel``, the numpy GGUF decoders, ``F.linear``...).

This module imports no torch: the CLI lists devices and kernels without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pagedllm.lazy import load_object

logger = logging.getLogger(__name__)

Op = Literal[
    "attention",
    "linear",
    "moe",
    "lora",
    "sample",
    "int8_quantize",
    "gguf_decode",
    "norm",
    "activation",
    "rotary",
    "encoder_attention",
    "decode_stack",
]
Impl = Literal["cpp", "torch", "triton", "ipex", "reference", "cuda_graph"]
OPS: tuple[Op, ...] = get_args(Op)
IMPLS: tuple[Impl, ...] = get_args(Impl)
#: A device's preference per op, best first (``DeviceBackend.kernel_order``).
KernelOrder = Mapping[Op, tuple[Impl, ...]]
BUILT_OPS: frozenset[Op] = frozenset(
    {"attention", "lora", "sample", "int8_quantize", "gguf_decode"}
)
INSTALLED_OPS: tuple[Op, ...] = (
    "linear",
    "moe",
    "norm",
    "activation",
    "rotary",
    "encoder_attention",
    # Last: it reads what the linear, norm, activation and rotary installers put in.
    "decode_stack",
)
# The installers whose description is the model's ``linear_path`` (the others: ``layer_kernels``).
_LINEAR_OPS = ("linear", "moe")

#: The group-wise weight formats (``layers/quantization/groupwise.FORMATS``; a test keeps the two
#: equal) that the CPU GEMMs multiply without dequantising them first.
_GROUPWISE = frozenset({"int4", "q8_0", "q6_k", "q5_k"})
_TRITON_DEVICES = ("cuda", "xpu", "cpu")  # compiled on CUDA/XPU, interpreted on CPU tensors
# On XPU the Triton kernels need triton's Intel backend (pytorch-triton-xpu).
_TRITON_ON_XPU = (("xpu", "pagedllm.backends.xpu.backend:triton_supports_xpu"),)


@dataclass(frozen=True)
class Kernel:
    """One implementation of one op: where it lives and what it takes."""

    op: Op
    impl: Impl
    target: str  # "module:object", see the module docstring for what it is per op
    devices: tuple[str, ...]
    #: Weight formats the kernel multiplies as stored (linear, MoE); empty: it claims none, and
    #: layers in other formats reach it dequantised (or keep their PyTorch path).
    formats: frozenset[str] = frozenset()
    #: ``(device, "module:predicate")``: on that device the kernel runs only when
    #: ``predicate()`` is true (a library's optional backend is installed, say).
    requires: tuple[tuple[str, str], ...] = ()


KERNELS: tuple[Kernel, ...] = (
    # -- attention (AttentionBackend classes) ---------------------------------------------------
    Kernel(
        "attention", "cpp", "pagedllm.backends.cpu.kernel_attention:CppPagedAttention", ("cpu",)
    ),
    Kernel("attention", "torch", "pagedllm.backends.cpu.attention:TorchPagedAttention", ("cpu",)),
    Kernel(
        "attention",
        "triton",
        "pagedllm.backends.gpu.attention:TritonPagedAttention",
        _TRITON_DEVICES,
        requires=_TRITON_ON_XPU,
    ),
    # IPEX's ops pick their implementation from the tensors' device: XPU, or its CPU build.
    Kernel(
        "attention", "ipex", "pagedllm.backends.xpu.attention:IpexPagedAttention", ("xpu", "cpu")
    ),
    # The slow plain-PyTorch oracle runs anywhere (debugging inside the engine).
    Kernel(
        "attention",
        "reference",
        "pagedllm.backends.reference:ReferenceAttention",
        ("cpu", "cuda", "xpu"),
    ),
    # -- linear and mixture-of-experts layers (installers) --------------------------------------
    Kernel(
        "linear",
        "cpp",
        "pagedllm.backends.cpu.packed_linear:pack_linear_layers",
        ("cpu",),
        formats=_GROUPWISE,
    ),
    Kernel(
        "moe",
        "cpp",
        "pagedllm.backends.cpu.fused_moe:pack_moe_layers",
        ("cpu",),
        formats=_GROUPWISE,
    ),
    Kernel(
        "moe",
        "triton",
        "pagedllm.backends.gpu.fused_moe:install_fused_moe",
        _TRITON_DEVICES,
        requires=_TRITON_ON_XPU,
    ),
    # -- the layers' row-wise ops (installers) --------------------------------------------------
    Kernel("norm", "cpp", "pagedllm.backends.cpu.layer_kernels:install_norm_kernels", ("cpu",)),
    Kernel(
        "activation", "cpp", "pagedllm.backends.cpu.layer_kernels:install_act_kernels", ("cpu",)
    ),
    Kernel("rotary", "cpp", "pagedllm.backends.cpu.layer_kernels:install_rotary_kernels", ("cpu",)),
    # -- bidirectional attention without a cache (encoders; installer) -------------------------
    Kernel(
        "encoder_attention",
        "torch",
        "pagedllm.backends.encoder_attention:install_encoder_attention",
        ("cpu", "cuda", "xpu"),
    ),
    # -- a decode step's whole layer stack in one call (installer; fills model.fast_decode) ---
    Kernel(
        "decode_stack", "cpp", "pagedllm.backends.cpu.decode_stack:install_decode_stack", ("cpu",)
    ),
    # The layer loop of a decode step captured as CUDA graphs, one per batch bucket.
    Kernel(
        "decode_stack",
        "cuda_graph",
        "pagedllm.backends.gpu.decode_graphs:install_cuda_graphs",
        ("cuda",),
    ),
    # -- multi-LoRA shrink/expand (LoRAKernel classes) ------------------------------------------
    Kernel("lora", "torch", "pagedllm.lora.ops:TorchLoRAOps", ("cpu", "cuda", "xpu")),
    Kernel(
        "lora",
        "triton",
        "pagedllm.backends.gpu.lora:TritonLoRAOps",
        _TRITON_DEVICES,
        requires=_TRITON_ON_XPU,
    ),
    # -- the sampler and the load-time kernels (factories: the kernel, or None) -----------------
    Kernel("sample", "cpp", "pagedllm.backends.cpu.layer_kernels:sample_kernel", ("cpu",)),
    Kernel(
        "int8_quantize", "cpp", "pagedllm.backends.cpu.dense_gemm:cpp_weight_quantizer", ("cpu",)
    ),
    Kernel("gguf_decode", "cpp", "pagedllm.backends.cpu.gguf_decode:gguf_block_decoder", ("cpu",)),
)

RefusalReason = Literal[
    "not registered for the device",  # no row of this impl takes the device's tensors
    "not in the device's order",  # it could run, but the device does not prefer it
    "format not claimed",  # it does not multiply the asked weight format as stored
    "requirement unmet",  # a ``requires`` predicate answered False
    "import failed",  # its module (or a library it needs) did not import
    "unavailable",  # it loaded but cannot run here (returned None or raised)
    "an earlier choice won",  # listed after the kernel that was chosen: never tried
]


@dataclass(frozen=True)
class Refusal:
    """Why one implementation does not run an op on a device."""

    impl: Impl
    reason: RefusalReason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.impl}: {self.detail or self.reason}"


@dataclass(frozen=True)
class Selection:
    """The registry's answer for one op (and weight format) on one device."""

    op: Op
    device: str
    format: str | None
    kernel: Kernel | None  # None: no kernel; the layer's PyTorch definition runs
    value: Any  # the built kernel (built ops) or the installer (installed ops); None with it
    refused: tuple[Refusal, ...]

    @property
    def formats(self) -> frozenset[str]:
        """The weight formats the chosen kernel multiplies as stored (none without one)."""
        return self.kernel.formats if self.kernel is not None else frozenset()

    def require(self) -> Any:
        """The chosen kernel; ImportError naming every refusal when there is none."""
        if self.kernel is None:
            raise ImportError(f"no kernel for {self.explain()}")
        return self.value

    def failures(self) -> list[Refusal]:
        """The refusals of implementations the device asked for that could not run here."""
        tried = ("requirement unmet", "import failed", "unavailable")
        return [r for r in self.refused if r.reason in tried]

    def explain(self) -> str:
        """One line for logs: what runs, and why each other implementation does not."""
        chosen = self.kernel.impl if self.kernel is not None else "none (PyTorch definition)"
        fmt = f" [{self.format}]" if self.format else ""
        why = "; ".join(f"{r.impl}: {r.reason}{f' ({r.detail})' if r.detail else ''}"
                        for r in self.refused)  # fmt: skip
        return f"{self.op}{fmt} on {self.device}: {chosen}" + (f" ({why})" if why else "")


def _check_op(op: str) -> Op:
    for known in OPS:
        if known == op:
            return known
    raise ValueError(f"kernel op: unknown op {op!r}; choose one of {list(OPS)}")


def entries(op: str) -> tuple[Kernel, ...]:
    """Every row of ``op``, in registry order; ValueError for an unknown op."""
    _check_op(op)
    return tuple(k for k in KERNELS if k.op == op)


def entry(op: str, impl: str) -> Kernel:
    """The row of ``impl`` for ``op``; ValueError naming the registered ones when there is none."""
    rows = entries(op)
    for row in rows:
        if row.impl == impl:
            return row
    raise ValueError(
        f"kernel: no {impl!r} implementation of {op!r}; registered: {[r.impl for r in rows]}"
    )


def impls_on(op: str, device: str) -> list[Impl]:
    """The implementations of ``op`` that take ``device``'s tensors, in registry order."""
    return [k.impl for k in entries(op) if device in k.devices]


def load(kernel: Kernel) -> Any:
    """The row's target object; ImportError when its module cannot load."""
    return load_object(kernel.target)


def build(kernel: Kernel) -> Any:
    """The kernel object of a row: built ops call their target, installers are the target."""
    target = load(kernel)
    return target() if kernel.op in BUILT_OPS else target


def _requirement_unmet(kernel: Kernel, device: str) -> str | None:
    for where, predicate in kernel.requires:
        if where == device and not load_object(predicate)():
            return f"{predicate.rpartition(':')[2]}() is false"
    return None


def _try(kernel: Kernel, device: str) -> tuple[Any, Refusal | None]:
    """Build one row for ``device``; the built kernel, or the refusal that says why not."""
    try:
        unmet = _requirement_unmet(kernel, device)
        if unmet is not None:
            return None, Refusal(kernel.impl, "requirement unmet", unmet)
        target = load(kernel)
    except ImportError as exc:
        return None, Refusal(kernel.impl, "import failed", str(exc))
    if kernel.op not in BUILT_OPS:
        return target, None
    try:
        value = target()
    except (ImportError, RuntimeError, OSError) as exc:
        return None, Refusal(kernel.impl, "unavailable", str(exc))
    if value is None:
        return None, Refusal(kernel.impl, "unavailable", "cannot run on this machine")
    return value, None


def select(op: str, device: str, order: tuple[Impl, ...], *, fmt: str | None = None) -> Selection:
    """The first implementation in ``order`` that runs ``op`` (on weights in ``fmt``) on
    ``device``, and a refusal for every other implementation the registry has for ``op``.

    Only the rows in ``order`` up to the chosen one are loaded (imports are lazy and may build an
    extension); the others are refused from their rows alone.
    """
    rows = entries(op)
    for impl in order:
        if impl not in IMPLS:
            raise ValueError(f"kernel order of {op!r}: unknown implementation {impl!r}")
    refused: list[Refusal] = []
    chosen: Kernel | None = None
    value: Any = None
    for impl in order:
        row = next((r for r in rows if r.impl == impl), None)
        if row is None or device not in row.devices:
            refused.append(Refusal(impl, "not registered for the device"))
        elif chosen is not None:
            refused.append(Refusal(row.impl, "an earlier choice won", chosen.impl))
        elif fmt is not None and fmt not in row.formats:
            refused.append(Refusal(row.impl, "format not claimed", fmt))
        else:
            value, refusal = _try(row, device)
            if refusal is None:
                chosen = row
            else:
                refused.append(refusal)
    for row in rows:
        if row.impl not in order:
            reason: RefusalReason = (
                "not in the device's order"
                if device in row.devices
                else "not registered for the device"
            )
            refused.append(Refusal(row.impl, reason))
    return Selection(_check_op(op), device, fmt, chosen, value, tuple(refused))


def install(
    model: Any,
    device: str,
    order: KernelOrder,
    *,
    int8_activations: bool,
    enforce_eager: bool = False,
) -> tuple[str, str]:
    """Run the chosen installer of every installed op on ``model``; returns ``(linear_path,
    layer_kernels)``: what the linear and MoE installers put in (``"kind=path, ..."``, "" for
    none) and what the row-wise ones did (``"rms_norm x33, ..."``, ``"none"`` for nothing).
    ``enforce_eager`` leaves out the ``decode_stack`` op: decode steps run the layer loop."""
    linear: list[str] = []
    layer: list[str] = []
    for op in INSTALLED_OPS:
        if op == "decode_stack" and enforce_eager:
            if order.get(op):
                logger.info("decode: layer by layer (enforce_eager)")
            continue
        chosen = select(op, device, order.get(op, ()))
        if chosen.value is None:
            continue
        done = chosen.value(model, int8_activations=int8_activations)
        if isinstance(done, Mapping):
            done = ", ".join(f"{kind}={path}" for kind, path in done.items())
        if done:
            (linear if op in _LINEAR_OPS else layer).append(done)
    layer_kernels = ", ".join(layer) or "none"
    if layer:
        logger.info("layer kernels: %s", layer_kernels)
    return ", ".join(linear), layer_kernels
