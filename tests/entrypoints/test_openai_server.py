"""The OpenAI-compatible server driven with the official ``openai`` client."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm import SamplingParams
from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL_NAME

PROMPT = "The quick brown fox"


def _tokens(http: Any, prompt: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _stream_text(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)


def test_models_health_version(server: Any, client: Any, http: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME, "alias"]
    assert models[0].max_model_len == MAX_MODEL_LEN  # type: ignore[attr-defined]
    assert http.get("/health").json() == {"status": "ok"}
    import pagedllm

    assert http.get("/version").json() == {"version": pagedllm.__version__}


def test_completion_matches_engine_and_counts_usage(server: Any, client: Any, http: Any) -> None:
    expected = server.offline([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL_NAME
    choice = r.choices[0]
    assert choice.index == 0 and choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(_tokens(http, PROMPT)) == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The alias serves the same model; responses name the first served name.
    r2 = client.completions.create(model="alias", prompt=PROMPT, max_tokens=10, temperature=0)
    assert r2.choices[0].text == choice.text and r2.model == MODEL_NAME


def test_completion_stream_equals_non_stream(server: Any, client: Any) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    for prompt in ["Paged attention", "你好", "def fibonacci(n):"]:
        full = client.completions.create(prompt=prompt, **kw)
        chunks = list(
            client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
            )
        )
        assert _stream_text(chunks) == full.choices[0].text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])
        usage = chunks[-1].usage
        assert not chunks[-1].choices and usage is not None
        assert usage.completion_tokens == 12 == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens
        assert all(c.usage is None for c in chunks[:-1])
    server.assert_all_blocks_free()


def test_chat_stream_equals_non_stream(server: Any, client: Any, http: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The quick brown fox"},
    ]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    rendered = http.post("/tokenize", json={"messages": messages}).json()
    assert full.usage.prompt_tokens == rendered["count"]
    text = "system: You are terse.\nuser: The quick brown fox\nassistant:"
    assert rendered["tokens"] == _tokens(http, text)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_cut_the_text(server: Any, client: Any) -> None:
    kw = dict(
        model=MODEL_NAME,
        prompt="Continuous batching",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kw).choices[0].text
    assert len(text) >= 6, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.index(stop)]
    r = client.completions.create(stop=[stop, "never-seen-stop"], **kw)
    c = r.choices[0]
    assert c.text == expected and c.finish_reason == "stop"
    assert c.stop_reason == stop  # type: ignore[attr-defined]
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert _stream_text(chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_sampling(server: Any, client: Any) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason == "length"}
    assert finished == {0, 1}
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        n=2,
        max_tokens=4,
        temperature=1.0,
        messages=[{"role": "user", "content": "hi"}],
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    server.assert_all_blocks_free()


def test_several_prompts_and_token_id_prompts(server: Any, client: Any, http: Any) -> None:
    ids = _tokens(http, PROMPT)
    r = client.completions.create(
        model=MODEL_NAME, prompt=[ids, _tokens(http, "Paged")], max_tokens=5, temperature=0, n=1
    )
    assert [c.index for c in r.choices] == [0, 1]
    by_text = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Paged"], max_tokens=5, temperature=0
    )
    assert [c.text for c in r.choices] == [c.text for c in by_text.choices]
    single = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert single.choices[0].text == r.choices[0].text
    assert r.usage.prompt_tokens == len(ids) + len(_tokens(http, "Paged"))
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=[PROMPT, "Paged"], max_tokens=5, temperature=0, stream=True
        )
    )
    for i in (0, 1):
        assert _stream_text(chunks, i) == by_text.choices[i].text


def test_logprobs_and_echo(server: Any, client: Any, http: Any) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the most likely
    echo = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    c = echo.choices[0]
    n_prompt = len(_tokens(http, PROMPT))
    assert c.text == PROMPT + r.choices[0].text
    assert len(c.logprobs.tokens) == n_prompt + 4 and c.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert c.logprobs.text_offset[n_prompt] == len(PROMPT)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_sampling_fields_are_accepted(server: Any, client: Any) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 5.0, "7": -100},
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [1],
            "ignore_eos": False,
        },
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    again = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 5.0, "7": -100},
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [1],
            "ignore_eos": False,
        },
    )
    assert again.choices[0].text == r.choices[0].text  # seeded sampling is reproducible


def test_tokenize_detokenize_roundtrip(server: Any, http: Any) -> None:
    ids = _tokens(http, PROMPT)
    r = http.post("/detokenize", json={"tokens": ids, "model": MODEL_NAME})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    r = http.post("/tokenize", json={"prompt": PROMPT, "model": MODEL_NAME})
    assert r.json()["count"] == len(ids) and r.json()["max_model_len"] == MAX_MODEL_LEN


def test_metrics_endpoint(server: Any, client: Any, http: Any) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for gauge in (
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
    ):
        assert f"pagedllm:{gauge}" in values
    for counter in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ):
        assert f"pagedllm:{counter}" in values
    stats = server.wait_idle()
    assert values["pagedllm:generation_tokens_total"] > 0
    assert values["pagedllm:generation_tokens_total"] <= stats["generation_tokens_total"]
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert values[f"pagedllm:{hist}_count"] >= 1
    assert values['pagedllm:request_success_total{finished_reason="length"}'] >= 1
