"""Each name list is one table: the CLI's choices, the config's messages, the module that acts
on a name and the docs all read it, and the CLI lists them without importing torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import names
from pagedllm.core.policy import POLICIES
from pagedllm.engine.cpu_binding import BIND_MODES
from pagedllm.entrypoints.cli_args import LOG_LEVELS, build_parser
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

ROOT = Path(__file__).resolve().parents[1]


def _choices(subcommand: str) -> dict[str, list[str] | None]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[subcommand]._actions
    return {a.dest: (list(a.choices) if a.choices is not None else None) for a in actions}


TABLES = [
    ("dtype", names.DTYPES),
    ("kv_cache_dtype", tuple(names.KV_CACHE_DTYPES)),
    ("quantization", names.QUANTIZATION_METHODS),
    ("preemption_mode", names.PREEMPTION_MODES),
    ("distributed_executor_backend", names.EXECUTOR_BACKENDS),
    ("router", names.ROUTERS),
    ("scheduling_policy", tuple(POLICIES)),
    ("tool_call_parser", tuple(TOOL_PARSERS)),
    ("cpu_bind", BIND_MODES),
    ("log_level", LOG_LEVELS),
]


@pytest.mark.parametrize(("flag", "table"), TABLES, ids=[t[0] for t in TABLES])
def test_cli_choices_are_the_table(flag: str, table: tuple[str, ...]) -> None:
    assert _choices("serve")[flag] == list(table)


def test_the_modules_that_act_on_a_name_read_the_table() -> None:
    from pagedllm.backends.kv_layout import KV_CACHE_DTYPES
    from pagedllm.engine.router import POLICIES as ROUTER_POLICIES
    from pagedllm.layers.quantization import _METHODS, QUANTIZATION_METHODS

    assert [*KV_CACHE_DTYPES] == [n for n, t in names.KV_CACHE_DTYPES.items() if t is not None]
    assert QUANTIZATION_METHODS == names.QUANTIZATION_METHODS
    assert {*_METHODS, "int4"} == set(names.QUANTIZATION_METHODS)
    assert ROUTER_POLICIES == names.ROUTERS
    assert all(name == cls.name for name, cls in TOOL_PARSERS.items())


@pytest.mark.parametrize(
    ("kwargs", "table"),
    [
        ({"router": "nope"}, names.ROUTERS),
        ({"kv_cache_dtype": "nope"}, tuple(names.KV_CACHE_DTYPES)),
        ({"quantization": "nope"}, names.QUANTIZATION_METHODS),
        ({"dtype": "nope"}, names.DTYPES),
    ],
)
def test_config_messages_list_the_table(kwargs: dict[str, str], table: tuple[str, ...]) -> None:
    from pagedllm.engine_args import EngineArgs

    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"^{field}: must be one of") as exc:
        EngineArgs(model="m", **kwargs).create_config(model_max_len=64, device="cpu")
    assert all(name in str(exc.value) for name in table)


def test_router_and_tool_parser_names_are_in_the_serving_docs() -> None:
    text = (ROOT / "docs" / "serving.md").read_text()
    for name in (*names.ROUTERS, *TOOL_PARSERS):
        assert f"`{name}`" in text or f" {name}`" in text, name


def test_the_cli_lists_every_choice_without_torch() -> None:
    code = (
        "import sys\n"
        "from pagedllm.entrypoints.cli_args import build_parser\n"
        "build_parser().parse_args(['serve', 'm'])\n"
        "import pagedllm.config, pagedllm.engine_args\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
