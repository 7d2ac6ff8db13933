"""What a first-run build of the C++ kernels says while it compiles.

torch's ``cpp_extension.load`` runs ninja with its output captured, so a build is minutes of
silence; a user cannot tell a compile from a hang. Ninja writes one object file per source into
the build directory as each finishes, which is the progress we can see from outside: a watcher
thread counts them and reports each one, and the time now and then while none finishes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType


def object_names(sources: Sequence[str]) -> list[str]:
    """The object files torch's ninja build writes for ``sources`` (``<stem>.o`` each)."""
    return [f"{Path(s).stem}.o" for s in sources]


def progress_line(label: str, done: int, total: int, elapsed: float) -> str:
    """One progress report: how many sources are compiled, or that the link is running."""
    stage = f"{done}/{total} sources compiled" if done < total else "linking"
    return f"still building {label}: {stage}, {elapsed:.0f} s so far"


class BuildProgress:
    """A context manager that reports a running build: when another source is compiled, and
    every ``quiet`` seconds without one (so a long compile still shows the build is alive).

    Leftover objects of an interrupted build count as done: the build directory is keyed by the
    sources and flags, so ninja reuses them.
    """

    def __init__(
        self,
        build_dir: Path,
        sources: Sequence[str],
        label: str,
        report: Callable[[str], None],
        *,
        poll: float = 1.0,
        quiet: float = 20.0,
    ) -> None:
        self._dir = build_dir
        self._objects = object_names(sources)
        self._label = label
        self._report = report
        self._poll = poll
        self._quiet = quiet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-build-progress", daemon=True)
        self._started = 0.0

    def done(self) -> int:
        """How many of the build's object files exist."""
        return sum((self._dir / name).exists() for name in self._objects)

    def _run(self) -> None:
        last_done, last_report = self.done(), self._started
        while not self._stop.wait(self._poll):
            now, done = time.monotonic(), self.done()
            if done != last_done or now - last_report >= self._quiet:
                total = len(self._objects)
                self._report(progress_line(self._label, done, total, now - self._started))
                last_done, last_report = done, now

    def __enter__(self) -> BuildProgress:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
