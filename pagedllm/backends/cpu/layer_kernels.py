"""The C++ row-wise layer kernels (``csrc/pointwise.cpp``) installed into a model's slots, and the
C++ sampler (``csrc/sampling.cpp``) the model runner's ``Sampler`` calls.

RMSNorm (residual add fused), the gated SiLU / GELU (tanh) and the rotary embedding are each a
chain of small ATen ops in PyTorch; at decode sizes the chain costs more than the arithmetic
(10.7 ms of a 90 ms decode step of a 1B int8 model at 16 sequences), so the backend's
``prepare_model`` puts one-pass kernels into the layers' ``fast_norm`` / ``fast_act`` /
``fast_rotary`` slots (three installers, one row each in ``backends/kernels.py``). Each kernel
rounds where the layer's ``forward_native`` rounds (results
differ at most in the last bit of a float32 sum or exp), and any input it cannot take (another
device or dtype, a view it cannot walk as rows, norm weights in another dtype than the
activations) goes to ``forward_native``.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
from torch import nn

from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.sampler import SampleKernel, sample_reference

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def layer_ops() -> ModuleType | None:
    """The extension holding the kernels for this processor's ISA level, or None without it."""
    from pagedllm.backends.cpu._ops import load_kernels

    try:
        return load_kernels()
    except (ImportError, RuntimeError, OSError) as exc:
        logger.warning("C++ layer kernels unavailable (%s); norms and activations use PyTorch", exc)
        return None


# These run a few times per layer of every decode step, where each needless tensor call (a
# ``device`` object built, a ``view`` that changes nothing) costs about as much as the
# kernel's arithmetic on one row: the checks read only cheap attributes, and 2-D inputs, the
# decoder's own case, pass through without a view.


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as a 2-D [rows, last dim] view with unit inner stride, or None if it has none."""
    if not x.is_cpu or x.dtype not in _DTYPES or x.stride(-1) != 1:
        return None
    dim = x.dim()
    if dim == 2:
        return x
    if dim > 2 and x.is_contiguous():
        return x.view(-1, x.shape[-1])
    return None


def norm_kernel(ops: ModuleType, module: nn.Module):
    """``fast_norm`` for one RMSNorm: the fused kernel, else the definition."""
    rms_norm = ops.rms_norm

    def norm(x: torch.Tensor, residual: torch.Tensor | None = None):
        rows = _as_rows(x)
        weight = module.weight
        if rows is None or weight.dtype != x.dtype or not weight.is_cpu:
            return module.forward_native(x, residual)
        if residual is None:
            out, _ = rms_norm(rows, weight, module.eps, module.offset, None)
            return (out if rows is x else out.view(x.shape)), x
        res = _as_rows(residual)
        if res is None or residual.shape != x.shape:
            return module.forward_native(x, residual)
        out, h = rms_norm(rows, weight, module.eps, module.offset, res)
        if rows is x:
            return out, h
        return out.view(x.shape), h.view(x.shape)

    return norm


def act_kernel(ops: ModuleType, module: nn.Module):
    """``fast_act`` for one SiluAndMul, or a GeluAndMul with the tanh approximation."""
    kernel = ops.silu_and_mul if isinstance(module, SiluAndMul) else ops.gelu_tanh_and_mul

    def act(x: torch.Tensor) -> torch.Tensor:
        rows = _as_rows(x)
        if rows is None or x.shape[-1] % 2:
            return module.forward_native(x)
        if rows is x:
            return kernel(rows)
        return kernel(rows).view(*x.shape[:-1], x.shape[-1] // 2)

    return act


def rotary_kernel(ops: ModuleType, module: nn.Module):
    """``fast_rotary`` for one RotaryEmbedding: rotates q and k in place."""

    rotary_embedding = ops.rotary_embedding

    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = module.cos, module.sin
        ok = (
            q.dim() == 3
            and k.dim() == 3
            and q.dtype == k.dtype
            and q.dtype in _DTYPES
            and q.is_cpu
            and k.is_cpu
            and positions.is_cpu
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and positions.dim() == 1
            and cos.dtype == sin.dtype == torch.float32
            and cos.is_cpu
            and sin.is_cpu
            and cos.is_contiguous()
            and sin.is_contiguous()
        )
        if not ok:
            return module.forward_native(positions, q, k)
        pos = positions
        if pos.dtype != torch.long or not pos.is_contiguous():
            pos = pos.long().contiguous()
        rotary_embedding(pos, q, k, cos, sin, module.rotary_dim)
        return q, k

    return rotary


def _install(model: nn.Module, ops: ModuleType, slot: str) -> dict[str, int]:
    """Fill one kind of slot (``fast_norm``, ``fast_act`` or ``fast_rotary``) of every layer that
    has it; returns how many layers of each kernel got one."""
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    counts: dict[str, int] = {}
    for module in model.modules():
        if slot == "fast_norm" and isinstance(module, RMSNorm):
            module.fast_norm = norm_kernel(ops, module)
            name = "rms_norm"
        elif slot == "fast_act" and isinstance(module, SiluAndMul):
            module.fast_act = act_kernel(ops, module)
            name = "silu_and_mul"
        elif slot == "fast_act" and isinstance(module, GeluAndMul) and module.approximate == "tanh":
            module.fast_act = act_kernel(ops, module)
            name = "gelu_tanh_and_mul"
        elif slot == "fast_rotary" and isinstance(module, RotaryEmbedding):
            module.fast_rotary = rotary_kernel(ops, module)
            name = "rotary"
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def _installer(slot: str, names: tuple[str, ...]):
    """The registry's installer of one slot: returns e.g. ``"rms_norm x33"`` ("" for none)."""

    def install(model: nn.Module, *, int8_activations: bool = False) -> str:
        del int8_activations  # these kernels keep the activations' dtype
        ops = layer_ops()
        if ops is None:
            return ""
        counts = _install(model, ops, slot)
        return ", ".join(f"{name} x{counts[name]}" for name in names if counts.get(name))

    return install


install_norm_kernels = _installer("fast_norm", ("rms_norm",))
install_act_kernels = _installer("fast_act", ("silu_and_mul", "gelu_tanh_and_mul"))
install_rotary_kernels = _installer("fast_rotary", ("rotary",))


def install_layer_kernels(model: nn.Module) -> str:
    """Fill the norm, activation and rotary slots of every layer; returns what was installed
    (e.g. ``"rms_norm x33, silu_and_mul x16, rotary x16"``, or ``"none"``)."""
    parts = [
        install(model)
        for install in (install_norm_kernels, install_act_kernels, install_rotary_kernels)
    ]
    return ", ".join(p for p in parts if p) or "none"


def sample_kernel() -> SampleKernel | None:
    """The C++ ``SampleKernel`` (``csrc/sampling.cpp``), or None without the extension; rows it
    cannot read (another device or dtype, a strided last dim) go to ``draw_reference``."""
    ops = layer_ops()
    if ops is None:
        return None

    def sample(
        logits: torch.Tensor,
        raw: torch.Tensor | None,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if all(_as_rows(t) is not None and t.dim() == 2 for t in (logits, raw) if t is not None):
            return ops.sample_rows(logits, raw, temperature, top_k, top_p, min_p, u)
        return sample_reference(logits, raw, temperature, top_k, top_p, min_p, u)

    return sample
