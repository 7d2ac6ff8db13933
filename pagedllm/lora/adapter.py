"""Reading PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``).

Every error is a ValueError that names the adapter, so a server can answer 4xx and go on.
PEFT names a module's weights ``base_model.model.<module path>.lora_A.weight`` (and
``lora_B``); the module path is the transformers one (``model.layers.0.self_attn.q_proj``),
which :func:`resolve_target` maps onto this engine's (possibly fused) layers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Transformers' separate projections that this engine fuses: name -> (fused layer, slice).
FUSED_PARTS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class AdapterWeights:
    """One adapter read from its folder: per transformers module path, A, B and the scale."""

    name: str
    rank: int  # the largest rank of any module
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"lora {name!r}: {message}")


def read_config(name: str, folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise _fail(name, f"adapter folder {str(folder)!r} does not exist")
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise _fail(name, f"{cfg_path} is missing (not a PEFT adapter folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(name, f"{cfg_path} is not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise _fail(name, f"{cfg_path} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _fail(name, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise _fail(name, "DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise _fail(name, f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _fail(name, f"modules_to_save {cfg['modules_to_save']!r} is not supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise _fail(name, f"{key} must be a positive number, got {value!r}")
    return cfg


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``alpha_pattern``/``rank_pattern``: a key matches the module path's tail."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf".*\.{key}", module):
            return value
    return default


def read_adapter(name: str, path: str, *, max_rank: int) -> AdapterWeights:
    """Read and check an adapter folder; tensors stay on the host in their checkpoint dtype."""
    folder = Path(path)
    cfg = read_config(name, folder)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise _fail(name, f"{weights_path} is missing (adapter_model.bin is not supported)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise _fail(name, f"cannot read {weights_path} ({exc})") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(name, f"tensor {key!r} is not a LoRA A/B weight")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise _fail(name, f"{weights_path} holds no LoRA weights")
    out = AdapterWeights(name=name, rank=0)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"module {module!r} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise _fail(
                name,
                f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "do not form a LoRA pair",
            )
        r = int(a.shape[0])
        if r > max_rank:
            raise _fail(name, f"rank {r} of module {module!r} exceeds max_lora_rank ({max_rank})")
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8)))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out.modules[module] = (a, b, scale)
        out.rank = max(out.rank, r)
    return out


def resolve_target(module: str, layers: dict[str, Any]) -> tuple[str, int | None] | None:
    """This engine's layer path and slice for a transformers module path (None: no such layer).

    Leading path components are dropped until a layer matches, so ``model.layers.0...`` finds
    ``layers.0...`` (Llama) and ``model.decoder.layers.0...`` finds ``decoder.layers.0...``
    (OPT). A fused part gives its slice; a whole layer gives None.
    """
    parts = module.split(".")
    leaf = parts[-1]
    candidates: list[tuple[list[str], int | None]] = [(parts, None)]
    if leaf in FUSED_PARTS:
        fused, index = FUSED_PARTS[leaf]
        candidates.insert(0, ([*parts[:-1], fused], index))
    for cand, index in candidates:
        for start in range(len(cand)):
            path = ".".join(cand[start:])
            if path in layers:
                return path, index
    return None
