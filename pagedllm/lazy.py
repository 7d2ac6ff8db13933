"""The package's one lazy loader: ``"module:Name"`` strings resolved on first use.

Registries (devices, kernels, model architectures) name their classes as strings so that
``import pagedllm`` never imports an optional dependency (triton, IPEX, the C++ toolchain) or a
model family that is not used.
"""

from __future__ import annotations

import importlib
from typing import Any


def load_object(target: str) -> Any:
    """The object ``target`` names, ``"package.module:Name"``; ImportError if it cannot load."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"lazy target: {target!r} is not of the form 'module:Name'")
    return getattr(importlib.import_module(module_name), attr)
