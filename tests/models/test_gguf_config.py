"""A GGUF file's light config (no transformers import) holds what transformers' config class for
the family holds, attribute by attribute, for every family and the metadata variants files have.

Both are built from the same keyword arguments (``config_values`` of one file, some keys dropped
or set as other files have them). Compared: every attribute the light config has; every
attribute transformers' config has, except those the engine never reads (checked by scanning
the package's source for every attribute read off a config); and the views the model code takes
(rope parameters, the partial rotary factor, the maximum length, the dtype).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from pagedllm.layers.rotary import rope_parameters
from pagedllm.models.gguf.config import config_values, hf_config_from_gguf, transformers_config
from pagedllm.models.gguf.light_config import GGUFConfig, light_config
from pagedllm.models.gguf.loading import open_gguf
from pagedllm.models.llama import rope_partial_factor
from pagedllm.models.model_loader import config_dtype, max_model_len_of
from tests.conftest import build_model
from tests.models.gguf_files import write_gguf
from tests.models.moe_models import build_moe
from tests.models.test_more_families import GGUF_GEMMA2, build_family

MISSING = object()
PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"
# transformers' bookkeeping and training-time fields: never read by the engine (asserted below).
NOT_READ = {
    "_attn_implementation_internal",
    "_experts_implementation_internal",
    "_name_or_path",
    "_output_attentions",
    "_post_init_done",
    "attention_dropout",
    "chunk_size_feed_forward",
    "embd_pdrop",
    "id2label",
    "ignore_keys_at_rope_validation",
    "initializer_range",
    "is_encoder_decoder",
    "label2id",
    "max_window_layers",
    "output_hidden_states",
    "pretraining_tp",
    "output_router_logits",
    "problem_type",
    "resid_pdrop",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "return_dict",
    "transformers_version",
    "use_bidirectional_attention",
    "use_cache",
}
_READ = re.compile(
    r"(?:config|cfg)\.([a-z_]+)|getattr\(\s*[a-z_]*(?:config|cfg)\s*,\s*\"([a-z_]+)\""
)


# Modules whose GGUF files never get the light config: the BERT-family encoders (GGUF's
# `bert` files get transformers' BertConfig, ``Family.light`` False). Their config attributes
# (num_labels, type_vocab_size, ...) come from a Hugging Face folder or that class.
NOT_FROM_GGUF = {"bert.py"}


def attributes_read() -> set[str]:
    """Every attribute name the package reads off something called ``*config`` / ``cfg``."""
    names: set[str] = set()
    for file in PACKAGE.rglob("*.py"):
        if file.parent.name == "models" and file.name in NOT_FROM_GGUF:
            continue
        for match in _READ.finditer(file.read_text()):
            names.add(match.group(1) or match.group(2))
    return names


MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-config")
    sources = {
        "llama": build_model(root / "llama", "llama"),
        "mistral": build_model(root / "mistral", "mistral"),
        "qwen2": build_model(root / "qwen2", "qwen2"),
        **{name: build_family(root / name, name) for name in ("phi3", "gemma", "qwen3")},
        "gemma2": build_family(root / "gemma2", "gemma2", **GGUF_GEMMA2),
        **{name: build_moe(root / name, name) for name in MOE},
    }
    out = {name: write_gguf(src, root / f"{name}.gguf") for name, src in sources.items()}
    out["mistral-arch"] = write_gguf(sources["mistral"], root / "m.gguf", arch="mistral")
    return out


def variants(values: dict) -> dict[str, dict]:
    """The file's values, and as files that say less (class defaults) or more."""
    out = {"as written": values}
    for key in ("max_position_embeddings", "rms_norm_eps", "head_dim"):
        out[f"no {key}"] = {k: v for k, v in values.items() if k != key}
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    out["no special ids"] = {k: v for k, v in values.items() if k not in ids}
    out["sliding window"] = {**values, "sliding_window": 64}
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    out["partial rotary"] = {**values, "partial_rotary_factor": 0.5}
    out["frequency factors"] = {**values, "rope_freq_factors": [1.0] * (head_dim // 2)}
    out["rope theta"] = {**values, "rope_theta": 500000.0}
    return out


@pytest.mark.parametrize(
    "name",
    ["llama", "mistral", "mistral-arch", "qwen2", "qwen3", "phi3", "gemma", "gemma2", *MOE],
)
def test_light_config_equals_the_transformers_config(files: dict[str, Path], name: str) -> None:
    gguf = open_gguf(files[name])
    family, values = config_values(gguf)
    read = attributes_read()
    assert not read & NOT_READ, f"the engine reads {sorted(read & NOT_READ)}: compare them too"
    for case, kwargs in variants(values).items():
        light = light_config(gguf, family.model_type, copy.deepcopy(kwargs))
        hf = transformers_config(gguf, family, copy.deepcopy(kwargs))
        names = (set(vars(light)) | set(vars(hf)) | read | {"rope_scaling"}) - NOT_READ
        for attr in sorted(names):
            ours, theirs = getattr(light, attr, MISSING), getattr(hf, attr, MISSING)
            assert ours == theirs, f"{name}, {case}: {attr} is {ours!r}, transformers {theirs!r}"
        assert rope_parameters(light) == rope_parameters(hf), (name, case)
        assert rope_partial_factor(light) == rope_partial_factor(hf), (name, case)
        assert max_model_len_of(light) == max_model_len_of(hf), (name, case)
        assert config_dtype(light) == config_dtype(hf), (name, case)


def test_plain_rope_files_do_not_build_a_transformers_config(files: dict[str, Path]) -> None:
    for name in ("llama", "qwen2", "phi3", "gemma", "gemma2", *MOE):
        assert isinstance(hf_config_from_gguf(open_gguf(files[name])), GGUFConfig), name


def test_scaled_rope_files_get_the_transformers_config(tmp_path: Path) -> None:
    """Linear and YaRN rope tables come from transformers' functions, which read its class."""
    scaled = build_model(
        tmp_path / "scaled", "llama", rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(scaled, tmp_path / "scaled.gguf", metadata=meta)
    config = hf_config_from_gguf(open_gguf(path))
    assert type(config).__name__ == "LlamaConfig"
    assert rope_parameters(config)["rope_type"] == "linear"
