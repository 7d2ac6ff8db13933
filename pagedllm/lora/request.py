"""``LoRARequest``: which adapter a request runs under (plain data, torch-free, picklable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, integer id (> 0; 0 is the base model) and PEFT folder.

    The names are vLLM's (``lora_name``, ``lora_int_id``, ``lora_path``); ``name``, ``id`` and
    ``path`` read the same fields.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request: lora_name must be a non-empty string")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id <= 0
        ):
            raise ValueError(
                f"lora_request {self.lora_name!r}: lora_int_id must be a positive integer, "
                f"got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request {self.lora_name!r}: lora_path must be a folder path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``name=path`` (the CLI's ``--lora`` / ``--lora-modules``) -> ``(name, path)``."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"lora_modules: expected name=path, got {spec!r}")
    return name.strip(), path.strip()
