"""A GGUF file served over the OpenAI API: the official client's chat completion uses the chat
template the file carries and returns what the offline engine generates on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from tests.conftest import build_model
from tests.entrypoints.conftest import start_server
from tests.models.gguf_files import write_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf-server")
    folder = build_model(root / "llama", "llama")
    return write_gguf(folder, root / "tiny.Q4_0.gguf", default="Q4_0")


def test_chat_over_a_gguf_file_uses_its_template(gguf_path: Path) -> None:
    import openai

    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    kwargs = dict(dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128)
    engine = EngineCoreClient.from_engine_args(
        str(gguf_path), "cpu", log_stats_interval=None, **kwargs
    )
    app = build_app(engine, model_info(engine, ["tiny-gguf"]), ServerSettings())
    srv, thread, port = start_server(app)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny-gguf",
            messages=[{"role": "user", "content": "The quick brown fox"}],
            max_tokens=8,
            temperature=0,
        )
    finally:
        srv.should_exit = True
        thread.join(30)
        engine.stop()
    offline = Engine(str(gguf_path), device="cpu", **kwargs)
    prompt = "<s>user\nThe quick brown fox</s>\n<s>assistant\n"  # the file's template
    expected = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert reply.choices[0].message.content == expected[0].outputs[0].text
    assert reply.usage.prompt_tokens == len(expected[0].prompt_token_ids)
