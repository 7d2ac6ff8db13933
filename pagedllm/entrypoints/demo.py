"""`make demo`: offline batched generation on the demo model that ships with the project."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from pagedllm import Engine, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo-model"

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    'def is_prime(n):\n    """Return True if n is a prime number."""',
    "for i in range(10):",
    "with open(filename) as f:",
    "def quicksort(items):",
    "try:\n    import json\nexcept ImportError:",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"demo model not found at {args.model}")
    engine = Engine(args.model, device=args.device, kv_cache_space=1)
    # Greedy, with a mild repetition penalty: a 5M-parameter model loops without one.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=1.2)
    start = time.perf_counter()
    outputs = engine.generate(DEMO_PROMPTS, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print("=" * 72)
        print(out.prompt + out.outputs[0].text)
    print("=" * 72)
    print(
        f"{len(outputs)} requests, {generated} generated tokens in {elapsed:.2f}s: "
        f"{generated / elapsed:.1f} output tokens/s, {len(outputs) / elapsed:.2f} requests/s"
    )


if __name__ == "__main__":
    main()
