"""The server's sampling defaults come from the model (``generation_config``): a request's unset
fields take them, its own fields win, and ``/v1/models`` shows them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.serving_base import ModelInfo, ServingBase
from tests.entrypoints.conftest import CHAT_TEMPLATE, start_server

DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "max_tokens": 6}


def serving(defaults: dict) -> ServingBase:
    """Only what ``sampling_params`` and ``_default_length`` read."""
    base = ServingBase.__new__(ServingBase)
    base.model = ModelInfo(("m",), "/m", 64, 512, 0, sampling_defaults=defaults)
    base.max_logprobs = 20
    return base


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_unset_fields_take_the_models_defaults_and_set_ones_win() -> None:
    base = serving(DEFAULTS)
    sp = base.sampling_params(chat(), max_tokens=None, logprobs=None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.0, 0.9, 5, 0.0)
    sp = base.sampling_params(chat(temperature=0.7, top_k=-1), max_tokens=None, logprobs=None)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.7, 0.9, -1)
    none = serving({}).sampling_params(chat(), max_tokens=None, logprobs=None)
    assert (none.temperature, none.top_p, none.top_k) == (1.0, 1.0, -1)
    completion = CompletionRequest(model="m", prompt="x", repetition_penalty=1.3)
    sp = base.sampling_params(completion, max_tokens=completion.max_tokens, logprobs=None)
    assert (sp.temperature, sp.repetition_penalty, sp.max_tokens) == (0.0, 1.3, 16)


def test_the_default_length_is_capped_by_the_room_left() -> None:
    base = serving(DEFAULTS)
    assert base._default_length(SamplingParams(max_tokens=None), 10).max_tokens == 6
    assert base._default_length(SamplingParams(max_tokens=None), 61).max_tokens == 3
    assert base._default_length(SamplingParams(max_tokens=30), 10).max_tokens == 30
    assert serving({})._default_length(SamplingParams(max_tokens=None), 10).max_tokens is None


@pytest.fixture(scope="module")
def greedy_server(llama_path: Path, tmp_path_factory: pytest.TempPathFactory):
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    path = tmp_path_factory.mktemp("gen-config-server") / "model"
    shutil.copytree(llama_path, path)
    config = {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "max_new_tokens": 6}
    (path / "generation_config.json").write_text(json.dumps(config))
    engine = EngineCoreClient.from_engine_args(
        str(path),
        "cpu",
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        log_stats_interval=None,
    )
    settings = ServerSettings(chat_template=CHAT_TEMPLATE)
    app = build_app(engine, model_info(engine, ["tiny"]), settings)
    srv, thread, port = start_server(app)
    yield f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    thread.join(30)
    engine.stop()


def test_models_shows_the_defaults_and_requests_use_them(greedy_server: str) -> None:
    models = httpx.get(greedy_server + "/models", timeout=30).json()
    assert models["data"][0]["sampling_defaults"] == DEFAULTS
    body = {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}]}
    greedy = {**body, "temperature": 0, "max_tokens": 6}
    expected = httpx.post(greedy_server + "/chat/completions", json=greedy, timeout=60).json()
    for _ in range(2):  # at temperature 1 (no defaults) the tiny model would not repeat itself
        got = httpx.post(greedy_server + "/chat/completions", json=body, timeout=60).json()
        assert got["choices"][0]["message"] == expected["choices"][0]["message"]
        assert got["usage"]["completion_tokens"] <= 6
