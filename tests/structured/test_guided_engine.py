"""Constrained decoding in the engine, on a random-weight model.

Whatever the weights, every constrained output must parse and validate against its schema, match
its regex or equal one of its choices; unconstrained requests batched with them must produce what
they produce alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.core.guided_params import GuidedDecodingParams
from tests.conftest import PROMPTS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}(\.(com|org))?"
CHOICES = ["yes", "no", "maybe so", "ask again later"]
GRAMMAR = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,3}/\n'
PER_KIND = 50


def guided(kind: str) -> GuidedDecodingParams:
    return {
        "json": GuidedDecodingParams(json=SCHEMA),
        "regex": GuidedDecodingParams(regex=REGEX),
        "choice": GuidedDecodingParams(choice=CHOICES),
        "grammar": GuidedDecodingParams(grammar=GRAMMAR),
    }[kind]


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", text), text


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=1024, max_num_seqs=256)


def plain_requests() -> list[tuple[str, SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [(p, greedy) for p in PROMPTS[:4]] + [
        (p, SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12))
        for i, p in enumerate(PROMPTS[:4])
    ]


def test_every_constrained_output_is_valid_and_neighbours_are_unchanged(engine: Engine) -> None:
    plain = plain_requests()
    alone = engine.generate([p for p, _ in plain], [s for _, s in plain], use_tqdm=False)
    prompts, params, kinds = [], [], []
    for kind in ("json", "regex", "choice"):
        for i in range(PER_KIND):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(
                SamplingParams(temperature=1.0, seed=i, max_tokens=80, guided_decoding=guided(kind))
            )
            kinds.append(kind)
    # The unconstrained requests sit in the middle of the batch.
    mid = len(prompts) // 2
    prompts[mid:mid] = [p for p, _ in plain]
    params[mid:mid] = [s for _, s in plain]
    kinds[mid:mid] = ["plain"] * len(plain)
    outs = engine.generate(prompts, params, use_tqdm=False)
    plain_outs = [o for o, k in zip(outs, kinds, strict=True) if k == "plain"]
    assert [o.outputs[0].token_ids for o in plain_outs] == [o.outputs[0].token_ids for o in alone]
    for out, kind in zip(outs, kinds, strict=True):
        if kind == "plain":
            continue
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (kind, completion.text)
        check(kind, completion.text)


def test_grammar_and_json_object(engine: Engine) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, guided_decoding=guided("grammar"))
        for i in range(10)
    ]
    for out in engine.generate(["Sum:"] * 10, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        check("grammar", out.outputs[0].text)
    # Any JSON object: a random model rarely closes one, but whatever it writes is a valid
    # prefix, and a greedy run that stops has written a complete object.
    obj = SamplingParams(
        temperature=0.0, max_tokens=30, guided_decoding=GuidedDecodingParams(json_object=True)
    )
    out = engine.generate(["{"], obj, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_forks_get_their_own_matchers(engine: Engine) -> None:
    params = SamplingParams(
        n=3, best_of=5, temperature=1.0, seed=7, max_tokens=40, guided_decoding=guided("regex")
    )
    out = engine.generate(["hello"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        check("regex", c.text)
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=20, guided_decoding=guided("choice")
    )
    texts = [c.text for c in engine.generate(["hi"], params, use_tqdm=False)[0].outputs]
    assert all(t in CHOICES for t in texts)


def test_seeded_output_is_reproducible_and_stop_strings_apply(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=80, guided_decoding=guided("json"))
    a = engine.generate(["A"], params, use_tqdm=False)[0].outputs[0]
    b = engine.generate(["A"], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    cut = engine.generate(["A"], params.clone(stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"'
    assert a.text.startswith(cut.text) and '"age"' not in cut.text


@pytest.mark.parametrize(
    "kwargs",
    [
        {
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 24,
            "enable_prefix_caching": True,
        },
        {"enable_prefix_caching": True, "num_kv_blocks": 20, "preemption_mode": "recompute"},
        {"num_kv_blocks": 20, "preemption_mode": "swap"},
    ],
    ids=["chunked-prefix", "preempt-recompute", "preempt-swap"],
)
def test_matchers_survive_scheduling_features(
    llama_path: Path, engine: Engine, kwargs: dict
) -> None:
    """Chunked prefill, prefix caching and preemption change neither validity nor tokens."""
    long = "The quick brown fox jumps over the lazy dog and keeps running. " * 2
    prompts = [long + p for p in PROMPTS[:6]]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=60,
            guided_decoding=guided("json" if i % 2 else "regex"),
        )
        for i in range(6)
    ]
    expected = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    other = Engine(str(llama_path), device="cpu", block_size=8, **kwargs)
    outs = other.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    finished = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= len(outs) // 2  # the rest ran into max_tokens mid-structure
    for i, out in enumerate(outs):
        if out.outputs[0].finish_reason == "stop":
            check("json" if i % 2 else "regex", out.outputs[0].text)
    stats = other.get_stats()
    if "preemption_mode" in kwargs:
        assert stats["num_preemptions_total"] > 0, stats
    if kwargs.get("enable_chunked_prefill"):
        assert stats["chunked_prefill_steps"] > 0, stats
    assert not other.guided.manager._matchers  # every matcher released
    other.shutdown()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            "guided_decoding.json",
        ),
        ({"regex": "(unclosed"}, "guided_decoding.regex"),
        ({"grammar": "start: ???"}, "guided_decoding.grammar"),
    ],
)
def test_invalid_constraints_raise_naming_the_field(engine: Engine, spec: dict, field: str) -> None:
    params = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(**spec))
    with pytest.raises(ValueError, match=f"^{field}"):
        engine.generate(["x"], params, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_compiling_request_waits_while_others_step(engine: Engine) -> None:
    """add_request returns at once; the request is scheduled when its grammar is ready."""
    schema = dict(SCHEMA, title="fresh schema, not in the cache")
    engine.add_request(
        "g",
        "hi",
        SamplingParams(
            max_tokens=60,
            temperature=1.0,
            seed=1,
            guided_decoding=GuidedDecodingParams(json=schema),
        ),
    )
    engine.add_request("p", "hi", SamplingParams(max_tokens=3, temperature=0.0))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    check("json", done["g"].outputs[0].text)
    assert len(done["p"].outputs[0].token_ids) == 3
    # An invalid constraint found after add_request ends that request with the error.
    bad = GuidedDecodingParams(regex="(x")
    engine.add_request("bad", "hi", SamplingParams(max_tokens=3, guided_decoding=bad))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].failed
    assert outs[-1].error.startswith("guided_decoding.regex")
