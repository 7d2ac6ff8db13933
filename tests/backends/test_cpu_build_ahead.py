"""The CPU kernels' build ahead of the first run (``python -m pagedllm.backends.cpu.build``, run
by ``make setup``) and the progress a run-time build reports while it compiles.

torch's compiler run is replaced by a fake that writes the object files one by one, so these
tests take seconds; ``make setup`` is the real build."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from pagedllm.backends.cpu import _ops, build
from pagedllm.backends.cpu.build_progress import BuildProgress, object_names, progress_line


def test_progress_line_counts_sources_then_says_linking() -> None:
    assert progress_line("ext_avx2", 2, 5, 21.4) == (
        "still building ext_avx2: 2/5 sources compiled, 21 s so far"
    )
    assert "linking" in progress_line("ext_avx2", 5, 5, 80.0)
    assert object_names(["a.cpp", "sub/b.cc"]) == ["a.o", "b.o"]


def test_progress_reports_objects_as_they_appear(tmp_path: Path) -> None:
    """A line for each object written, one now and then while none is, none after the build."""
    lines: list[str] = []
    sources = ["a.cpp", "b.cpp", "c.cpp"]
    with BuildProgress(tmp_path, sources, "ext", lines.append, poll=0.02, quiet=0.1):
        time.sleep(0.35)  # the first compile is slow: heartbeats
        for name in object_names(sources):
            (tmp_path / name).touch()
            time.sleep(0.25)
        time.sleep(0.2)
    count = len(lines)
    time.sleep(0.15)
    assert len(lines) == count, "the reporter stops with the build"
    seen = [line.split(": ")[1].split(",")[0] for line in lines]
    assert seen[:2] == ["0/3 sources compiled"] * 2
    assert "1/3 sources compiled" in seen and "2/3 sources compiled" in seen
    assert seen[-1] == "linking"


def _fake_torch_build(calls: list[str], delay: float):
    """Stands in for ``cpp_extension.load``: writes each object after ``delay`` seconds."""

    def load(*, name: str, sources: list[str], build_directory: str, **_: object) -> ModuleType:
        calls.append(name)
        for obj in object_names(sources):
            time.sleep(delay)
            (Path(build_directory) / obj).touch()
        return ModuleType(name)

    return load


@pytest.fixture
def fake_compiler(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import torch.utils.cpp_extension

    calls: list[str] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_torch_build(calls, 0.01))
    monkeypatch.setattr(_ops, "_check_toolchain", lambda: None)
    monkeypatch.setattr(_ops, "_import_built", lambda build_dir, name: ModuleType(name))
    return calls


def test_build_command_builds_once_then_is_a_no_op(
    tmp_path: Path, fake_compiler: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert build.main(["--build-root", str(tmp_path), "--isa", "scalar"]) == 0
    first = capsys.readouterr().out.splitlines()
    names = [name for name, _, _ in _ops.EXTENSIONS]
    assert fake_compiler == [f"{name}_scalar" for name in names]
    assert len(first) == len(names)
    assert all(" built in " in line and "scalar" in line for line in first)

    _ops._load.cache_clear()  # a second process: only the markers on disk remain
    assert build.main(["--build-root", str(tmp_path), "--isa", "scalar"]) == 0
    second = capsys.readouterr().out.splitlines()
    assert fake_compiler == [f"{name}_scalar" for name in names], "nothing compiled again"
    assert len(second) == len(names) and all("already built" in line for line in second)


def test_run_time_build_reports_progress(
    tmp_path: Path,
    fake_compiler: list[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A build at run time (none done at install) announces itself, reports progress while it
    compiles, and says when it is done."""
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_torch_build(fake_compiler, 0.3))
    real_progress = BuildProgress

    def fast_progress(*args: object, **kwargs: object) -> BuildProgress:
        return real_progress(*args, **{**kwargs, "poll": 0.02})  # type: ignore[arg-type]

    monkeypatch.setattr(_ops, "BuildProgress", fast_progress)
    caplog.set_level("WARNING", logger=_ops.__name__)
    _ops.load_kernels(tmp_path, isa="scalar")
    text = caplog.text
    assert "building CPU kernels for this processor (first run only" in text
    assert "still building pagedllm_cpu_kernels_scalar: " in text
    assert "built pagedllm_cpu_kernels_scalar in " in text


def test_build_failure_is_one_line_and_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> None:
        raise RuntimeError("cannot build the C++ CPU kernels: no C++ compiler (`c++`) on PATH")

    monkeypatch.setattr(_ops, "_check_toolchain", no_compiler)
    caplog.set_level("ERROR")
    assert build.main(["--build-root", str(tmp_path), "--isa", "scalar"]) == 1
    assert "no C++ compiler" in caplog.text and "PyTorch ops" in caplog.text


def test_every_extension_is_listed_for_the_build_ahead() -> None:
    """An extension missing from ``EXTENSIONS`` would still compile silently at first use."""
    names = {value for key, value in vars(_ops).items() if key.endswith("_EXTENSION")}
    assert names == {name for name, _, _ in _ops.EXTENSIONS}


def test_progress_thread_is_gone_after_a_failed_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError), BuildProgress(tmp_path, ["a.cpp"], "x", print, poll=5):
        raise ValueError("compile error")
    assert not any(t.name == "cpu-build-progress" for t in threading.enumerate())
