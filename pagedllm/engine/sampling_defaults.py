"""The model's own sampling defaults, for the fields a request leaves out (vLLM's
``--generation-config``).

``SamplingParams``' neutral defaults (temperature 1, no top-k/top-p) make small models ramble;
the people who publish a model say how to sample it, in ``generation_config.json`` (a Hugging
Face folder) or in ``general.sampling.*`` metadata (a GGUF file). Most GGUF files say nothing,
while their publisher's model card does: a ``generation_config.json``-shaped file beside the
GGUF file, named after it (``model.Q4_1.gguf`` -> ``model.Q4_1.generation_config.json``), carries
those values (the demo's fetch writes one). A GGUF file with neither gets llama.cpp's defaults,
since that is what its users have been getting from it. The setting
``generation_config`` picks: ``auto`` (the model's), ``none`` (``SamplingParams``' own), or a
JSON object of fields that override the model's. Parsing is torch-free (``engine_args`` checks
the setting before anything loads); only reading a GGUF file touches the model code.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from pagedllm.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' name: the fields vLLM takes from it.
HF_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata keys (gguf-py's Keys.General.SAMPLING_*) -> SamplingParams' name.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# llama.cpp's common_params_sampling defaults, for a GGUF file that names none of its own.
LLAMA_CPP_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
FIELDS = tuple(dict.fromkeys(HF_FIELDS.values()))
MODES = ("auto", "none")


def parse_generation_config(value: Any) -> tuple[str, dict[str, Any]]:
    """``(mode, overrides)`` from ``"auto"``, ``"none"``, a JSON object string or a dict.

    A JSON object means ``auto`` with its fields on top. A ValueError names ``generation_config``
    (and the field, where one is wrong).
    """
    if isinstance(value, str) and value.strip().lower() in MODES:
        return value.strip().lower(), {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"generation_config: must be auto, none or a JSON object, got {value!r} ({exc})"
            ) from exc
    if not isinstance(value, dict):
        raise ValueError(
            f"generation_config: must be auto, none or a JSON object, got {type(value).__name__}"
        )
    overrides = {HF_FIELDS.get(k, k): v for k, v in value.items()}
    unknown = sorted(k for k in overrides if k not in FIELDS)
    if unknown:
        raise ValueError(
            f"generation_config: {unknown[0]}: unknown field; known ones are {list(FIELDS)}"
        )
    try:
        SamplingParams(**overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"generation_config: {exc}") from exc
    return "auto", overrides


def sampling_defaults(model: str, mode: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The defaults a request's unset fields take (SamplingParams names); ``{}`` for ``none``."""
    if mode == "none":
        return {}
    return {**model_defaults(model), **overrides}


def model_defaults(model: str) -> dict[str, Any]:
    """What the model itself says: its GGUF metadata (else llama.cpp's defaults), or its
    folder's ``generation_config.json``; values SamplingParams would refuse are left out."""
    from pagedllm.models.gguf.reader import gguf_path_of

    gguf_path = gguf_path_of(model)
    if gguf_path is not None:
        return _checked(_from_gguf(gguf_path), str(gguf_path))
    path = Path(model) / "generation_config.json"
    return _checked(_from_generation_config(path), str(path))


def _from_gguf(path: Path) -> dict[str, Any]:
    from pagedllm.models.gguf.loading import open_gguf

    gguf = open_gguf(path)
    found = {
        name: _shortest(gguf.metadata(key)) for key, name in GGUF_KEYS.items() if gguf.has(key)
    }
    if found:
        return found
    beside = _from_generation_config(sidecar_path(path))
    if beside:
        logger.info(
            "sampling defaults from %s (the publisher's, beside the file)", sidecar_path(path)
        )
        return beside
    return dict(LLAMA_CPP_DEFAULTS)


def sidecar_path(gguf_path: Path) -> Path:
    """Where a GGUF file's publisher defaults sit: beside it, under its own name."""
    return gguf_path.with_suffix(".generation_config.json")


def _shortest(value: Any) -> Any:
    """GGUF stores float32: 0.95 reads back as 0.949999988; /v1/models should say 0.95."""
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _from_generation_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("%s: not read (%s); no sampling defaults from it", path, exc)
        return {}
    if not isinstance(data, dict):
        return {}
    return {name: data[key] for key, name in HF_FIELDS.items() if data.get(key) is not None}


def _checked(found: dict[str, Any], source: str) -> dict[str, Any]:
    """Each value alone through SamplingParams' checks: a model file must not stop a start."""
    out: dict[str, Any] = {}
    for name, value in found.items():
        if isinstance(value, float) and math.isfinite(value) and name in ("top_k", "max_tokens"):
            value = int(value) if value.is_integer() else value
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as exc:
            logger.warning("%s: %s ignored as a sampling default (%s)", source, name, exc)
            continue
        out[name] = value
    return out


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` for a caller that gave none (vLLM's get_default_sampling_params).

    A ``max_tokens`` default stays None here: ``add_request`` caps the model's default at the
    room the prompt leaves, which only it knows.
    """
    fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if "max_tokens" in defaults:
        fields["max_tokens"] = None
    return SamplingParams(**fields)
