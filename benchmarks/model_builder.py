"""Random-weight Llama checkpoints of a chosen shape, written straight in their 16-bit dtype.

The benchmarks need real-sized checkpoints (the 1B shape is 2.2 GB in bfloat16) without a
download. Building them the obvious way (``LlamaForCausalLM(config)`` then ``.to(bfloat16)``)
allocates and initialises a float32 copy first: twice the memory and most of the time. Here the
model is built on the meta device, materialised empty in the target dtype, and filled in place,
so the only allocation is the checkpoint itself.

    from benchmarks.model_builder import LLAMA_1B, build_random_llama
    build_random_llama(Path("/tmp/llama-1b-bf16"), LLAMA_1B)              # ~2.2 GB, bfloat16

    python benchmarks/model_builder.py /tmp/llama-1b-bf16 --size 1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

# Llama-3.2-1B's shape with a 32k vocabulary and an untied head (2.2 GB in bfloat16).
LLAMA_1B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=32000,
    tie_word_embeddings=False,
    rope_theta=500000.0,
)
# Small enough for CI smoke runs and memory tests (a few MB).
LLAMA_TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    tie_word_embeddings=False,
)
SIZES = {"1b": LLAMA_1B, "tiny": LLAMA_TINY}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_random_llama(
    folder: Path,
    spec: dict[str, Any],
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_positions: int = 2048,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """Save a random ``LlamaForCausalLM`` of shape ``spec`` in ``dtype`` to ``folder``.

    Reuses the folder when it already holds a checkpoint of the same shape and dtype. Weights
    are ``N(0, std)`` (norms are ones), drawn in ``dtype`` from a seeded generator, so a shape and
    seed always give the same checkpoint.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, **spec
    )
    config.dtype = dtype
    if _matches(folder, config):
        return folder
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device="cpu")  # allocates in dtype only, never float32
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm scales
            else:
                param.normal_(0.0, std, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    return folder


def _matches(folder: Path, config: Any) -> bool:
    """Whether ``folder`` already holds a checkpoint built from an equal config."""
    saved = folder / "config.json"
    if not saved.exists() or not list(folder.glob("*.safetensors")):
        return False
    old = json.loads(saved.read_text())
    new = config.to_dict()
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    )
    dtype_of = lambda d: str(d.get("dtype") or d.get("torch_dtype"))  # noqa: E731
    return all(old.get(k) == new.get(k) for k in keys) and dtype_of(old) == dtype_of(new)


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--max-positions", type=int, default=2048)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    build_random_llama(
        args.folder, SIZES[args.size], dtype=_DTYPES[args.dtype], max_positions=args.max_positions
    )
    seconds = time.perf_counter() - start
    info = {"folder": str(args.folder), "bytes": checkpoint_bytes(args.folder), "seconds": seconds}
    print(json.dumps(info))


if __name__ == "__main__":
    main()
