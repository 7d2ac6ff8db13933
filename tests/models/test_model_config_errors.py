"""A model folder whose config.json is missing or wrong gets a ValueError naming the file and
the field, not a traceback from inside transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm.entrypoints.demo import DEMO_MODEL
from pagedllm.models.model_loader import load_hf_config


def _copy_config(tmp_path: Path, **changes: object) -> Path:
    config = json.loads((Path(DEMO_MODEL) / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_mistyped_field_names_the_file_and_the_field(tmp_path: Path) -> None:
    folder = _copy_config(tmp_path, num_attention_heads="eight")
    with pytest.raises(ValueError, match=r"config\.json.*num_attention_heads"):
        load_hf_config(str(folder))


def test_no_folder_and_no_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: .* is not a local model folder"):
        load_hf_config(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"config\.json: missing"):
        load_hf_config(str(tmp_path))


def test_the_demo_config_loads(tmp_path: Path) -> None:
    shutil.copy(Path(DEMO_MODEL) / "config.json", tmp_path / "config.json")
    assert load_hf_config(str(tmp_path)).num_attention_heads == 8
