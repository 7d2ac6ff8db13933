"""speculative_config: parsing and the errors that name the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import Engine
from pagedllm.engine_args import EngineArgs
from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config


def test_dict_and_json_give_the_same_config() -> None:
    a = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    b = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert a == b == SpeculativeConfig("ngram", 3)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
        ({"num_speculative_tokens": 3}, "speculative_config.method"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": -2},
            "speculative_config.num_speculative_tokens",
        ),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": True},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 1,
                "prompt_lookup_min": 3,
            },
            "speculative_config.prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "speculative_config.k"),
        ("{not json", "speculative_config"),
        ([1, 2], "speculative_config"),
    ],
)
def test_bad_values_name_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + r"\b"):
        parse_speculative_config(value)


def test_tensor_parallel_refused() -> None:
    args = EngineArgs(
        model="m",
        tensor_parallel_size=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match="^speculative_config: not supported with tensor"):
        args.create_config(model_max_len=64, device="cpu")


def test_lora_refused() -> None:
    args = EngineArgs(
        model="m",
        enable_lora=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match="^speculative_config: not supported together with"):
        args.create_config(model_max_len=64, device="cpu")


def test_engine_refuses_unknown_method(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="^speculative_config.method"):
        Engine(
            str(llama_path),
            device="cpu",
            speculative_config={"method": "x", "num_speculative_tokens": 1},
        )


def test_draft_with_another_vocabulary_is_refused(
    llama_path: Path, small_vocab_paths: tuple[Path, Path]
) -> None:
    spec = {
        "method": "draft_model",
        "model": str(small_vocab_paths[1]),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ValueError, match=r"^speculative_config\.model: the draft's vocabulary"):
        Engine(str(llama_path), device="cpu", num_kv_blocks=32, speculative_config=spec)


def test_cli_flag_is_generated() -> None:
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        [
            "generate",
            "m",
            "--prompt",
            "x",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
        ]
    )
    assert args.speculative_config == '{"method": "ngram", "num_speculative_tokens": 2}'
    from pagedllm.entrypoints.cli import engine_kwargs

    kwargs = engine_kwargs(args)
    config = EngineArgs.from_kwargs("m", **kwargs).create_config(model_max_len=64, device="cpu")
    assert config.speculative == SpeculativeConfig("ngram", 2)
