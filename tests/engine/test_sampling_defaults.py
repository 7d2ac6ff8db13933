"""The model's sampling defaults (``generation_config``): read from a Hugging Face folder's
``generation_config.json`` or a GGUF file (its ``general.sampling.*`` keys, else llama.cpp's
defaults), overridden by a JSON object or switched off with ``none``; ``generate`` and
``add_request`` use them only when given no ``SamplingParams``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.engine.sampling_defaults import (
    LLAMA_CPP_DEFAULTS,
    default_sampling_params,
    model_defaults,
    parse_generation_config,
    sampling_defaults,
)
from tests.conftest import build_model
from tests.models.gguf_files import write_gguf

# Greedy by default, and a short default length: both visible in what generate() returns.
FILE = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 6, "do_sample": True, "bos_token_id": 0}
PROMPT = [5, 9, 12, 3]


@pytest.fixture(scope="module")
def greedy_path(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(llama_path, path)
    (path / "generation_config.json").write_text(json.dumps(FILE))
    return path


def test_the_setting_parses_and_a_bad_one_names_generation_config() -> None:
    assert parse_generation_config("auto") == ("auto", {})
    assert parse_generation_config("None") == ("none", {})
    assert parse_generation_config('{"temperature": 0.5, "max_new_tokens": 9}') == (
        "auto",
        {"temperature": 0.5, "max_tokens": 9},
    )
    assert parse_generation_config({"top_p": 0.9}) == ("auto", {"top_p": 0.9})
    for bad, also in (
        ("{temperature: 1", "JSON"),
        ("[1, 2]", "JSON object"),
        ('{"beams": 2}', "beams"),
        ('{"temperature": -1}', "temperature"),
        (3, "int"),
    ):
        with pytest.raises(ValueError, match="generation_config") as info:
            parse_generation_config(bad)
        assert also in str(info.value)


def test_a_folder_gives_its_generation_config_fields(greedy_path: Path) -> None:
    assert model_defaults(str(greedy_path)) == {"temperature": 0.0, "top_k": 5, "max_tokens": 6}
    # A JSON object goes over the file's fields; none keeps SamplingParams' own.
    assert sampling_defaults(str(greedy_path), "auto", {"temperature": 0.7}) == {
        "temperature": 0.7,
        "top_k": 5,
        "max_tokens": 6,
    }
    assert sampling_defaults(str(greedy_path), "none", {}) == {}


def test_values_a_request_could_not_carry_are_dropped(greedy_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(greedy_path, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": -2, "top_p": 0.5}))
    assert model_defaults(str(path)) == {"top_p": 0.5}
    (path / "generation_config.json").unlink()
    assert model_defaults(str(path)) == {}


def test_a_gguf_file_gives_its_own_keys_else_llama_cpps(tmp_path: Path) -> None:
    folder = build_model(tmp_path / "llama", "llama")
    plain = write_gguf(folder, tmp_path / "plain.gguf")
    assert model_defaults(str(plain)) == LLAMA_CPP_DEFAULTS
    assert LLAMA_CPP_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    own = write_gguf(
        folder,
        tmp_path / "own.gguf",
        metadata={"general.sampling.top_p": 0.95, "general.sampling.top_k": 7},
    )
    assert model_defaults(str(own)) == {"top_p": 0.95, "top_k": 7}  # stored as float32


def test_a_gguf_file_without_keys_takes_its_publishers_file_beside_it(tmp_path: Path) -> None:
    folder = build_model(tmp_path / "llama", "llama")
    plain = write_gguf(folder, tmp_path / "model.Q4_1.gguf")
    beside = tmp_path / "model.Q4_1.generation_config.json"
    beside.write_text(json.dumps({"temperature": 0.2, "top_p": 0.9, "source": "a model card"}))
    assert model_defaults(str(plain)) == {"temperature": 0.2, "top_p": 0.9}
    own = write_gguf(folder, tmp_path / "own.gguf", metadata={"general.sampling.top_k": 7})
    (tmp_path / "own.generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert model_defaults(str(own)) == {"top_k": 7}  # the file's own keys first


def test_the_demo_fetch_records_its_publishers_sampling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.entrypoints import demo_model

    cached = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.write_bytes(b"\0" * 16)
    monkeypatch.setattr(demo_model, "model_path", lambda: cached)
    monkeypatch.setattr(demo_model, "SIZE", 16)
    assert demo_model.fetch_demo_model(download=False).path == cached
    beside = json.loads(
        (tmp_path / "SmolLM2-135M-Instruct.Q4_1.generation_config.json").read_text()
    )
    assert {k: beside[k] for k in ("temperature", "top_p")} == demo_model.PUBLISHER_SAMPLING
    assert demo_model.PUBLISHER_SAMPLING == {"temperature": 0.2, "top_p": 0.9}


def test_generate_without_params_uses_the_defaults(greedy_path: Path) -> None:
    engine = Engine(str(greedy_path), device="cpu", dtype="float32", attention_backend="torch")
    assert engine.sampling_defaults == {"temperature": 0.0, "top_k": 5, "max_tokens": 6}
    default = engine.get_default_sampling_params()
    assert (default.temperature, default.top_k) == (0.0, 5)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    expected = engine.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):  # temperature 1 (SamplingParams' own) would not repeat the greedy tokens
        got = engine.generate([PROMPT], use_tqdm=False)[0].outputs[0]
        assert got.token_ids == expected
        assert len(got.token_ids) <= 6
    # An explicit SamplingParams is never changed: max_tokens None is the whole room left.
    explicit = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    out = engine.generate([PROMPT], explicit, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 6


def test_engine_arguments_choose_and_check_the_setting(greedy_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config"):
        Engine(str(greedy_path), device="cpu", generation_config="{not json")
    engine = Engine(
        str(greedy_path), device="cpu", dtype="float32", attention_backend="torch",
        generation_config="none",
    )  # fmt: skip
    assert engine.sampling_defaults == {}
    assert engine.get_default_sampling_params() == SamplingParams()


def test_a_max_tokens_default_is_left_for_add_request() -> None:
    params = default_sampling_params({"temperature": 0.5, "max_tokens": 6})
    assert params.temperature == 0.5 and params.max_tokens is None
    assert default_sampling_params({}).max_tokens == SamplingParams().max_tokens
