"""``python -m pagedllm.backends.cpu.build``: build the CPU kernels for this processor now.

``make setup`` runs it after installing, so a fresh clone's minutes of compiling happen there,
with a line per extension, instead of inside the first ``pagedllm serve`` after "loading". A
second run finds every build cached and only says so. Exit status 1 if a build fails (the CPU
backend then falls back to PyTorch ops at run time, as without this command).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pagedllm.backends.cpu import _ops
from pagedllm.log_setup import setup_logging


def build_all(
    isa: str | None = None,
    build_root: Path | None = None,
    report: Callable[[str], None] = print,
) -> list[str]:
    """Build (or find built) every extension for ``isa`` (default: the best this CPU runs);
    report one line per extension and return the names of those built by this call."""
    level = _ops.resolve_isa(isa)
    built = []
    for name, sources, headers in _ops.EXTENSIONS:
        build_dir = _ops.extension_dir(sources, headers, level, build_root)
        cached = _ops.is_built(build_dir)
        started = time.monotonic()
        _ops.load_extension(name, sources, headers, isa=level, build_root=build_root)
        elapsed = time.monotonic() - started
        if cached:
            report(f"CPU kernels {name} ({level}): already built in {build_dir}")
        else:
            built.append(name)
            report(f"CPU kernels {name} ({level}): built in {elapsed:.0f} s into {build_dir}")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.backends.cpu.build",
        description="Build the C++ CPU kernels for this processor (a no-op when cached).",
    )
    parser.add_argument(
        "--isa",
        default=None,
        help="ISA level to build (default: PAGEDLLM_CPU_ISA, else the best this CPU runs)",
    )
    parser.add_argument(
        "--build-root", type=Path, default=None, help="default: ~/.cache/pagedllm/cpu_ext"
    )
    args = parser.parse_args(argv)
    setup_logging("warning")  # the build's announcement and progress lines
    try:
        build_all(args.isa, args.build_root)
    except (RuntimeError, ImportError, OSError, ValueError) as exc:
        message = " ".join(str(exc).split())[:500]
        logging.getLogger(__name__).error(
            "could not build the CPU kernels (%s); the CPU backend will use PyTorch ops", message
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
