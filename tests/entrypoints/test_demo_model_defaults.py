"""The real demo model served with no sampling fields in the request answers sensibly: its GGUF
file names no sampling settings, so llama.cpp's defaults apply (temperature 0.8, top-k 40,
top-p 0.95, min-p 0.05), where temperature 1 with nothing cut made it ramble.

Skipped when the demo model is not in the cache (``make demo`` or
``tests/models/test_gguf_real_model.py`` fetches it).
"""

from __future__ import annotations

import pytest

from pagedllm.engine.sampling_defaults import LLAMA_CPP_DEFAULTS
from pagedllm.entrypoints.demo_model import fetch_demo_model
from tests.entrypoints.conftest import start_server

SEEDS = range(10)


@pytest.fixture(scope="module")
def demo_server():
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    fetched = fetch_demo_model(download=False)
    if fetched.path is None:
        pytest.skip(f"the demo model is not cached: {fetched.reason}")
    engine = EngineCoreClient.from_engine_args(
        str(fetched.path), "cpu", kv_cache_space=0.25, max_model_len=256, log_stats_interval=None
    )
    app = build_app(engine, model_info(engine, ["demo"]), ServerSettings())
    srv, thread, port = start_server(app)
    yield f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    thread.join(30)
    engine.stop()


# Measured (seeds 0-9, CPU, bf16): 7 of 10 name Paris at llama.cpp's defaults, 8 of 10 at the
# model card's temperature 0.2 / top-p 0.9. The first token is nearly flat ("The" 17%, "L" 13%,
# "La" 10%), so only near-greedy sampling reaches 9; kept as the bar, not yet met.
@pytest.mark.xfail(reason="issue 57's bar (9 of 10) is above what sampling gives this model")
def test_the_capital_of_france_is_paris_at_the_default_settings(demo_server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=demo_server, api_key="x", max_retries=0)
    assert client.models.list().data[0].model_extra["sampling_defaults"] == LLAMA_CPP_DEFAULTS
    answers = [
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            seed=seed,
        )
        .choices[0]
        .message.content
        for seed in SEEDS
    ]
    assert sum("Paris" in a for a in answers) >= 9, answers
