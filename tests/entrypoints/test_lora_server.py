"""LoRA over HTTP: ``--lora-modules`` served by name, /v1/models, run-time load and unload,
and errors in OpenAI's shape that name the adapter while the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.entrypoints.conftest import API_KEY, start_server
from tests.lora.adapters import ATTN, MLP, make_adapter, peft_greedy

BASE = "tiny-llama"
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-adapters")
    return {
        "a1": make_adapter(llama_path, root / "a1", rank=8, targets=ATTN + MLP, seed=21),
        "a2": make_adapter(llama_path, root / "a2", rank=16, targets=ATTN, seed=22, std=0.2),
        "big": make_adapter(llama_path, root / "big", rank=32, targets=["q_proj"], seed=23),
    }


@pytest.fixture(scope="module")
def servers(llama_path: Path, adapters: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """Two apps over one engine core: run-time updates on (port A) and off (port B)."""
    import httpx

    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = EngineCoreClient.from_engine_args(
        str(llama_path),
        "cpu",
        dtype="float32",
        num_kv_blocks=128,
        block_size=8,
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        log_stats_interval=None,
    )
    on = ServerSettings(
        api_key=API_KEY,
        lora_modules=(("a1", str(adapters["a1"])),),
        enable_lora_runtime_updates=True,
    )
    off = ServerSettings(api_key=API_KEY)
    started = []
    clients = {}
    for key, settings in (("on", on), ("off", off)):
        app = build_app(engine, model_info(engine, [BASE]), settings, owns_engine=key == "on")
        srv, thread, port = start_server(app)
        started.append((srv, thread))
        clients[key] = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            timeout=60,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    yield clients
    for c in clients.values():
        c.close()
    for srv, thread in reversed(started):
        srv.should_exit = True
        thread.join(30)


def _complete(http: Any, model: str, prompt: list[int]) -> Any:
    return http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    )


def _tokens(resp: Any) -> list[str]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def _error(resp: Any, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err


def test_models_lists_adapters_with_parent(servers: dict[str, Any]) -> None:
    data = servers["on"].get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id[BASE]["parent"] is None
    assert by_id["a1"]["parent"] == BASE


def test_model_field_picks_the_adapter(
    servers: dict[str, Any], llama_path: Path, adapters: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    prompt = tok.encode("The quick brown fox")
    http = servers["on"]
    resp = _complete(http, "a1", prompt)
    got_lora = _tokens(resp)
    assert resp.json()["model"] == "a1"
    got_base = _tokens(_complete(http, BASE, prompt))
    ref_lora = peft_greedy(llama_path, adapters["a1"], [prompt], MAX_NEW)[0].token_ids
    ref_base = peft_greedy(llama_path, None, [prompt], MAX_NEW)[0].token_ids
    assert ref_lora != ref_base
    assert got_lora == [tok.decode([t]) for t in ref_lora]
    assert got_base == [tok.decode([t]) for t in ref_base]


def test_unknown_model_is_404_naming_it(servers: dict[str, Any]) -> None:
    _error(_complete(servers["on"], "nope", [5, 6]), 404, "'nope'")


def test_load_use_unload_at_run_time(servers: dict[str, Any], adapters: dict[str, Path]) -> None:
    http = servers["on"]
    resp = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])}
    )
    assert resp.status_code == 200, resp.text
    assert any(m["id"] == "a2" for m in http.get("/v1/models").json()["data"])
    assert len(_tokens(_complete(http, "a2", [5, 6, 7]))) == MAX_NEW
    _error(
        http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "x"}),
        400,
        "'a2'",
    )
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    _error(_complete(http, "a2", [5, 6, 7]), 404, "'a2'")
    _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}), 404, "'a2'")


def test_bad_adapters_are_400_and_the_server_goes_on(
    servers: dict[str, Any], adapters: dict[str, Path], tmp_path: Path
) -> None:
    http = servers["on"]
    missing = {"lora_name": "ghost", "lora_path": str(tmp_path / "none")}
    _error(http.post("/v1/load_lora_adapter", json=missing), 400, "'ghost'", "does not exist")
    big = {"lora_name": "big", "lora_path": str(adapters["big"])}
    _error(http.post("/v1/load_lora_adapter", json=big), 400, "'big'", "max_lora_rank")
    names = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert "ghost" not in names and "big" not in names
    assert len(_tokens(_complete(http, "a1", [5, 6, 7]))) == MAX_NEW


def test_runtime_updates_refused_without_the_flag(
    servers: dict[str, Any], adapters: dict[str, Path]
) -> None:
    http = servers["off"]
    body = {"lora_name": "a2", "lora_path": str(adapters["a2"])}
    _error(http.post("/v1/load_lora_adapter", json=body), 403, "--enable-lora-runtime-updates")
    _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}), 403)


def test_cli_generate_with_lora(
    llama_path: Path, adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    from pagedllm.entrypoints import cli

    prompt = "def fibonacci(n):"
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    ref = peft_greedy(llama_path, adapters["a1"], [tok.encode(prompt)], 6)[0].token_ids
    args = ["generate", str(llama_path), "--prompt", prompt, "--max-tokens", "6"]
    args += ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16"]
    code = cli.main([*args, "--lora", f"a1={adapters['a1']}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == prompt + tok.decode(ref) + "\n"


def test_cli_lora_flags_need_enable_lora(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints import cli

    assert cli.main(["serve", "m", "--lora-modules", "a=/x"]) == 2
    assert "--enable-lora" in capsys.readouterr().err
    assert cli.main(["generate", "m", "--prompt", "A", "--lora", "no-equals-sign"]) == 2
    assert "name=path" in capsys.readouterr().err
