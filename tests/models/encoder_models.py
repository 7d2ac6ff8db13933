"""Helpers of the encoder tests: an encoder loaded as the worker loads it, and its step metadata."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.kv_layout import AttentionMetadata, build_attention_metadata
from pagedllm.models.model_loader import load_hf_config, load_model


def load_packed(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Our model as the worker makes it: the real loader, then the CPU backend's kernels."""
    backend = CpuBackend()
    model = load_model(
        str(folder),
        load_hf_config(str(folder)),
        attn_backend=backend.attention("torch"),
        device=torch.device("cpu"),
        dtype=dtype,
    )
    backend.prepare_model(model)
    return model


def encoder_meta(lens: list[int]) -> AttentionMetadata:
    """What an encoder step reads: the query start offsets (no slots, no block tables)."""
    return build_attention_metadata(
        num_prefills=len(lens),
        seq_lens=lens,
        query_lens=lens,
        slot_mapping=[],
        block_tables=[[] for _ in lens],
        block_size=16,
        device=torch.device("cpu"),
    )
