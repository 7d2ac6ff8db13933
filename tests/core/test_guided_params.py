"""GuidedDecodingParams: exactly one kind, each error naming its field, a JSON-able round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "guided_decoding: exactly one"),
        ({"regex": "a", "choice": ["a"]}, "guided_decoding: exactly one"),
        ({"json": "{not json"}, "guided_decoding.json"),
        ({"json": 3}, "guided_decoding.json"),
        ({"choice": []}, "guided_decoding.choice"),
        ({"choice": ["a", 3]}, "guided_decoding.choice"),
        ({"regex": ""}, "guided_decoding.regex"),
        ({"grammar": 7}, "guided_decoding.grammar"),
        ({"json_object": "yes"}, "guided_decoding.json_object"),
    ],
)
def test_bad_constraints_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        GuidedDecodingParams(**kwargs)


def test_json_text_is_parsed_and_keys_are_canonical() -> None:
    a = GuidedDecodingParams(json='{"type": "object", "required": ["a"]}')
    b = GuidedDecodingParams(json={"required": ["a"], "type": "object"})
    assert a.json == b.json and a.key() == b.key() and a.kind == "json"
    assert GuidedDecodingParams(regex="a+").key() != GuidedDecodingParams(grammar="a+").key()


def test_sampling_params_round_trip_through_json() -> None:
    """The engine-core process serialises SamplingParams generically: only plain values inside."""
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]), seed=3)
    wire = json.loads(json.dumps(dataclasses.asdict(params)))
    again = SamplingParams(**wire)
    assert again.guided_decoding == params.guided_decoding
    assert again.clone().guided_decoding == params.guided_decoding


def test_sampling_params_refuse_unknown_fields_and_beam_search() -> None:
    with pytest.raises(ValueError, match="^guided_decoding: unknown"):
        SamplingParams(guided_decoding={"regexp": "a"})
    with pytest.raises(ValueError, match="^guided_decoding:"):
        SamplingParams(
            guided_decoding={"regex": "a"}, use_beam_search=True, best_of=2, temperature=0
        )
