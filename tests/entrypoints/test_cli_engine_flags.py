"""The CLI's engine flags are generated from the EngineArgs fields: one place per argument."""

from __future__ import annotations

import dataclasses

from pagedllm.backends.registry import device_names
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints import cli


def _engine_actions() -> dict[str, object]:
    parser = cli.build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {a.dest: a for a in serve._actions}


def test_every_cli_field_has_a_flag_with_help() -> None:
    actions = _engine_actions()
    for f in dataclasses.fields(EngineArgs):
        if f.metadata.get("cli", True) and f.name not in ("model",):
            action = actions[f.name]
            flag = "--" + f.name.replace("_", "-")
            # A switch that is on by default also has its off form (--no-enable-chunked-prefill).
            off = ["--no-" + flag[2:]] if f.default is True else []
            assert action.option_strings == [flag, *off]
            assert action.help, f.name
    assert "served_model_name" in actions  # the server's own --served-model-name (nargs=+)
    assert "trust_remote_code" not in actions and "skip_tokenizer_init" not in actions


def test_device_choices_come_from_the_registry() -> None:
    assert _engine_actions()["device"].choices == device_names()


def test_a_new_field_becomes_a_flag(monkeypatch) -> None:
    """A field added to EngineArgs reaches the CLI and EngineArgs without another edit."""

    @dataclasses.dataclass
    class Extended(EngineArgs):
        new_knob: int | None = None

    import pagedllm.engine_args as engine_args

    monkeypatch.setattr(engine_args, "EngineArgs", Extended)
    args = cli.build_parser().parse_args(["serve", "m", "--new-knob", "3", "--seed", "5"])
    assert cli.engine_kwargs(args) == {"new_knob": 3, "seed": 5}
