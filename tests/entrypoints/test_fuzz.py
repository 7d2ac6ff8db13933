"""Fuzzing the live server: random request bodies while innocent greedy streams run.

Every body (types, sizes, ranges, unicode, nesting, unknown fields) must get a 200 or an
OpenAI-shaped 4xx before any stream starts; the innocent streams must keep producing exactly
their baseline text; afterwards every KV block is free and memory does not grow over repeated
identical bursts. ``PAGEDLLM_FUZZ_EXAMPLES`` sets how many bodies (300 in CI; the long mode is
e.g. ``PAGEDLLM_FUZZ_EXAMPLES=20000``). Loopback only, bounded in count.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedllm.config import env_fuzz_examples
from tests.entrypoints.conftest import API_KEY, MODEL_NAME

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
EDGE_INTS = [
    -(2**64),
    -(2**63) - 1,
    -(2**63),
    -1,
    0,
    1,
    2,
    3,
    20,
    21,
    64,
    65,
    128,
    257,
    511,
    512,
    513,
    1000,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
]
EDGE_FLOATS = [-1e400, 1e400, float("nan"), -0.0, 1e-300, 1e-5, 0.5, 1.0, 2.0, 1e20, 1e308]
NUMERIC_FIELDS = [
    "n",
    "best_of",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "top_k",
    "seed",
    "priority",
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
OTHER_FIELDS = [
    "prompt",
    "messages",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "stream",
    "stream_options",
    "echo",
    "suffix",
    "ignore_eos",
    "tools",
    "tool_choice",
    "response_format",
    "functions",
    "user",
    "model",
    "tokens",
    "add_special_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "chat_template_kwargs",
]
INNOCENT = ["The quick brown fox", "def fibonacci(n):", "Paged attention keeps"]
INNOCENT_TOKENS = 24

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 70),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGE_FLOATS),
    st.text(max_size=24),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=16,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | json_values,
            "content": st.text(max_size=40) | json_values,
        }
    ),
    max_size=3,
)
prompts = st.one_of(
    st.text(max_size=60),
    st.lists(st.integers(-3, 600), max_size=20),
    st.lists(st.text(max_size=10), max_size=3),
    json_values,
)


def _number_for(field: str) -> st.SearchStrategy[Any]:
    return st.sampled_from(EDGE_INTS) | st.sampled_from(EDGE_FLOATS) | scalars


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, Any]:
    route = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 19)) == 0:  # not an object at all
        return route, draw(json_values)
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
    if route == "/v1/chat/completions" or (route == "/tokenize" and draw(st.booleans())):
        body["messages"] = draw(messages | st.just([{"role": "user", "content": "hi"}]))
    else:
        body["prompt"] = draw(prompts)
    if route == "/detokenize":
        body["tokens"] = draw(st.lists(st.integers(-3, 600), max_size=10) | json_values)
    for field in draw(st.lists(st.sampled_from(NUMERIC_FIELDS), max_size=4, unique=True)):
        body[field] = draw(_number_for(field))
    for field in draw(st.lists(st.sampled_from(OTHER_FIELDS), max_size=3, unique=True)):
        body[field] = draw(json_values)
    for key in draw(st.lists(st.text(max_size=12), max_size=2)):
        body[key] = draw(json_values)
    _bound_work(body)
    return route, body


def _bound_work(body: dict[str, Any]) -> None:
    """Keep valid requests cheap on a CPU: many sequences get few tokens."""

    def small_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 512

    seqs = max([v for v in (body.get("n"), body.get("best_of")) if small_int(v)] or [1])
    for key in ("max_tokens", "max_completion_tokens"):
        if small_int(body.get(key)) and seqs * body[key] > 64:
            body[key] = max(1, 64 // seqs)


class Innocents(threading.Thread):
    """Greedy streams, again and again, until stopped; any text off its baseline is recorded."""

    def __init__(self, base: str, baseline: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.base, self.baseline = base, baseline
        self.stop = threading.Event()
        self.runs = 0
        self.bad: list[tuple[str, str]] = []

    def run(self) -> None:
        with httpx.Client(
            base_url=self.base, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as c:
            while not self.stop.is_set():
                for p in INNOCENT:
                    text = _stream_text(c, p)
                    if text != self.baseline[p]:
                        self.bad.append((p, text))
                    self.runs += 1


def _stream_text(c: httpx.Client, prompt: str) -> str:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": INNOCENT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    parts = []
    with c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                parts.append(chunk["choices"][0]["text"] if "choices" in chunk else repr(chunk))
    return "".join(parts)


def _encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def check_response(r: httpx.Response, route: str, body: Any) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", (events[-3:], body)
        for e in events[:-1]:
            assert "error" not in json.loads(e), (e, body)
    else:
        assert isinstance(r.json(), dict)


def _send(c: httpx.Client, route: str, body: Any) -> httpx.Response:
    return c.post(route, content=_encode(body), headers={"Content-Type": "application/json"})


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_fuzzed_bodies_never_hurt_innocent_streams(server: Any) -> None:
    with httpx.Client(
        base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        baseline = {p: _stream_text(c, p) for p in INNOCENT}
        innocents = Innocents(server.base_url, baseline)
        innocents.start()
        seen: dict[int, int] = {}

        @settings(
            max_examples=env_fuzz_examples(),
            deadline=None,
            database=None,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=list(HealthCheck),
        )
        @given(bodies())
        def fuzz(case: tuple[str, Any]) -> None:
            route, body = case
            r = _send(c, route, body)
            check_response(r, route, body)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1

        try:
            fuzz()
        finally:
            innocents.stop.set()
            innocents.join(120)
        print(f"fuzz: statuses {sorted(seen.items())}, innocent streams {innocents.runs}")
        assert sum(seen.values()) >= min(env_fuzz_examples(), 100)
        assert seen.get(200) and seen.get(400), seen  # both accepted and refused bodies ran
        assert innocents.runs >= len(INNOCENT) and not innocents.bad, innocents.bad[:3]
        server.assert_all_blocks_free()
        usage = [
            ln
            for ln in c.get("/metrics").text.splitlines()
            if ln.startswith("pagedllm:kv_cache_usage_perc ")
        ]
        assert usage and math.isclose(float(usage[0].split()[1]), 0.0), usage


BURST: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "n": 257}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "top_k": 2**63, "temperature": 0.8}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi " * 200, "max_tokens": 4}),
    (
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": "x",
            "max_tokens": 3,
            "n": 2,
            "temperature": 1.0,
            "seed": 1,
        },
    ),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, "stream": True}),
    (
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "é🚀" * 10}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 5,
        },
    ),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": {"nested": [[[]]]}}),
    ("/tokenize", {"model": MODEL_NAME, "prompt": "\ud800 lone surrogate"}),
    ("/v1/completions", [1, 2, 3]),
]


def test_memory_is_flat_over_identical_bursts(server: Any) -> None:
    with httpx.Client(
        base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        rss = []
        for _ in range(4):
            for _ in range(15):
                for route, body in BURST:
                    check_response(_send(c, route, body), route, body)
            server.assert_all_blocks_free()
            rss.append(_rss_kib())
    growth = rss[-1] - rss[1]  # the first burst warms caches up
    assert growth < 16 * 1024, f"RSS grew {growth} KiB over identical bursts: {rss}"
