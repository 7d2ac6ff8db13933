"""Start-up errors are one line on stderr, found before the model loads, with exit status 2/1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm.entrypoints import cli

NO_MODEL = "/nonexistent/model-folder"  # loading it would fail: these errors must come first


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", NO_MODEL, "--port", "70000"], "--port"),
        (["serve", NO_MODEL, "--port", "0"], "--port"),
        (["serve", NO_MODEL, "--max-logprobs", "-1"], "--max-logprobs"),
        (["serve", NO_MODEL, "--chat-template-timeout", "inf"], "--chat-template-timeout"),
        (["serve", NO_MODEL, "--chat-template-timeout", "nan"], "--chat-template-timeout"),
        (["serve", NO_MODEL, "--chat-template-timeout", "0"], "--chat-template-timeout"),
        (
            ["serve", NO_MODEL, "--chat-template", "{% for m in messages %}{{ m }"],
            "--chat-template",
        ),
        (["serve", NO_MODEL, "--kv-cache-space", "1000000"], "--kv-cache-space"),
        (["serve", NO_MODEL, "--device", "cuda"], "--device"),
        (["generate", NO_MODEL, "--prompt", "x", "--device", "xpu"], "--device"),
        (["generate", NO_MODEL, "--prompt", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_bad_settings_are_one_line_before_loading(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--device" in argv:
        from pagedllm.backends.registry import backend_class

        device = argv[argv.index("--device") + 1]
        if backend_class(device).is_available():
            pytest.skip(f"{device} is available here")
    if argv[0] == "serve" and "--port" not in argv:  # port 8000 may be taken on this machine
        from tests.entrypoints.conftest import free_port

        argv = [*argv, "--port", str(free_port())]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


def test_config_not_matching_the_weights_names_tensor_and_file(
    llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "wide"
    shutil.copytree(llama_path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] *= 2
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", str(broken), "--prompt", "x", "--device", "cpu"])
    message = str(exc.value.code)
    assert len(message.splitlines()) == 1, message
    assert "config.json" in message and "checkpoint tensor 'model." in message


def test_unexpected_errors_are_one_line_unless_debug(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something broke\nwith a second line")

    monkeypatch.setattr("pagedllm.Engine", explode)
    argv = ["generate", str(llama_path), "--prompt", "x", "--device", "cpu"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "pagedllm generate: RuntimeError: something broke (--log-level debug shows the traceback)"
    )
    with pytest.raises(RuntimeError, match="something broke"):
        cli.main([*argv, "--log-level", "debug"])
