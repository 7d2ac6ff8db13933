"""``pagedllm kv-cache ls|clear --kv-cache-dir DIR``: what the disk KV tier holds, and removing it.

Each fingerprint folder belongs to one model under one set of settings (see
``pagedllm/kv_tiers/fingerprint.py``); ``ls`` names them, ``clear`` deletes them (all, or the
one given by ``--fingerprint``). Clearing while a server uses the folder is safe but wasteful:
its blocks become misses.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any


def add_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "kv-cache",
        help="list or clear the disk KV tier's folder",
        description="What a --kv-cache-dir holds (one folder per model and settings), or "
        "delete it.",
    )
    p.add_argument("action", choices=["ls", "clear"])
    p.add_argument("--kv-cache-dir", required=True, metavar="DIR", help="the folder")
    p.add_argument("--fingerprint", help="clear: only this folder (as `ls` names it)")
    p.set_defaults(handler=run)


def _describe(meta: dict[str, Any]) -> str:
    model = str(meta.get("model_path", "?"))
    fields = [
        f"{meta.get('dtype', '?')}",
        f"kv {meta.get('kv_cache_dtype', '?')}",
        f"block {meta.get('block_size', '?')}",
        f"{meta.get('device', '?')}",
    ]
    return f"{model} ({', '.join(fields)})"


def run(args: argparse.Namespace) -> int:
    from pagedllm.kv_tiers import folders

    try:
        if args.action == "clear":
            gone = folders.clear(args.kv_cache_dir, args.fingerprint)
            total = sum(c.bytes for c in gone)
            print(f"removed {len(gone)} folder(s), {total / (1 << 30):.2f} GiB")
            return 0
        found = folders.cache_folders(args.kv_cache_dir)
    except ValueError as exc:
        print(f"pagedllm kv-cache: {exc}", file=sys.stderr)
        return 2
    if not found:
        print(f"{args.kv_cache_dir}: no KV blocks")
        return 0
    for c in found:
        used = (
            "never"
            if c.last_used is None
            else time.strftime("%Y-%m-%d %H:%M", time.localtime(c.last_used))
        )
        print(
            f"{c.fingerprint}  {c.blocks:8d} blocks  {c.bytes / (1 << 30):8.2f} GiB  "
            f"last used {used}  {_describe(c.meta)}"
        )
    return 0
