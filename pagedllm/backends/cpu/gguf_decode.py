"""The C++ GGUF block decoder (``csrc/gguf_decode.cpp``), the CPU's ``gguf_decode`` kernel.

It turns the blocks of every GGUF type a group-wise format holds but Q8_0
(``models.gguf.plan.KEPT_AS``; uint8 ``[N, row bytes]`` and the type's name) into the arrays
of ``int4_groups`` / ``int8_groups`` / ``q6_k_groups``, bit for bit, in one threaded pass per
tensor: the numpy definitions make several, which was most of a 4-bit file's load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.backends.cpu.dense_gemm import gemm_ops

BlockDecoder = Callable[[torch.Tensor, str], tuple[torch.Tensor, ...]]


def gguf_block_decoder() -> BlockDecoder | None:
    """The decoder, or None where the extension does not build (the numpy definitions run)."""
    ops = gemm_ops()
    return None if ops is None else ops.decode_gguf_blocks
