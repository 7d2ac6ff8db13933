"""A model may end a sequence with any of several EOS ids (generation_config's list): all of them
end it, and ``min_tokens`` keeps every one of them from being sampled, not only the smallest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams

SECOND_EOS = 7


@pytest.fixture(scope="module")
def two_eos_path(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("two-eos") / "model"
    shutil.copytree(llama_path, path)
    config = (
        json.loads((path / "generation_config.json").read_text())
        if (path / "generation_config.json").exists()
        else {}
    )
    config["eos_token_id"] = [1, SECOND_EOS]
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_min_tokens_bans_every_eos_id(two_eos_path: Path) -> None:
    engine = Engine(str(two_eos_path), device="cpu", dtype="float32", attention_backend="torch")
    assert engine.eos_token_ids == {1, SECOND_EOS}
    # The bias makes the second EOS id the greedy choice at every step.
    params = SamplingParams(
        temperature=0.0, min_tokens=4, max_tokens=10, logit_bias={SECOND_EOS: 50}
    )
    out = engine.generate([[5, 9, 12, 3]], params, use_tqdm=False)[0].outputs[0]
    assert SECOND_EOS not in out.token_ids[:4], out.token_ids
    assert 1 not in out.token_ids[:4], out.token_ids
    # Once min_tokens is reached the second EOS id is sampled and ends the sequence.
    assert out.token_ids[-1] == SECOND_EOS and len(out.token_ids) == 5, out.token_ids
    assert out.finish_reason == "stop"
