"""One log format for every pagedllm process: the CLI and API server, an engine-core process and
a Ray replica all write ``HH:MM:SS LEVEL logger: message``, so their lines interleave readably
on one terminal (the logger name says which part spoke)."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def setup_logging(level: str | int = "info") -> None:
    """The root logger's level and format (a no-op where a handler is already installed)."""
    if isinstance(level, str):
        level = getattr(logging, level.upper())
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=DATE_FORMAT)
