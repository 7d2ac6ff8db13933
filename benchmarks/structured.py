"""Structured output: a batch of JSON-schema-constrained requests vs the same batch unconstrained.

64 requests arrive at once. The constrained run asks each for JSON that validates against a
realistic schema (strings with patterns, an enum, bounded integers, a bounded array, a nested
object); the unconstrained run then generates exactly as many tokens per request
(``ignore_eos``, ``max_tokens`` = that request's constrained length), so both runs have the same
batch shape at every step and the ratio of output tokens/s is the cost of the constraint alone:
compiling (cached), filling one bitmask row per request per step, applying the masks and advancing
the matchers. Target: the constrained run keeps at least 85% of the unconstrained tokens/s.

The model is the random-weight Llama the other benchmarks use (56M parameters, 32k vocabulary),
with a byte-level BPE tokenizer trained here on the Python standard library's sources.

    python benchmarks/structured.py
    python benchmarks/structured.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams
from pagedllm.core.guided_params import GuidedDecodingParams

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,8}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "address", "active"],
    "additionalProperties": False,
}


def train_tokenizer(folder: Path, vocab_size: int, num_files: int) -> None:
    """A byte-level BPE tokenizer on the standard library's sources (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(json.__file__).resolve().parent.parent.glob("*.py"))[:num_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.read_text(errors="ignore") for f in files), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))


def run_batch(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> dict[str, Any]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    return {
        "wall_s": wall,
        "output_tokens": sum(lengths),
        "output_tok_s": sum(lengths) / wall,
        "lengths": lengths,
        "parsed_json": valid,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    n = 4 if args.smoke else args.num_requests
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", spec)
        train_tokenizer(model, spec["vocab_size"], 40 if args.smoke else 400)
        engine = Engine(str(model), device="cpu", dtype="float32", max_num_seqs=n, kv_cache_space=2)
        vocab = len(engine.tokenizer)
        prompts = [f"Record {i}: a person as JSON.\n" for i in range(n)]
        guided = GuidedDecodingParams(json=SCHEMA)
        warm = SamplingParams(max_tokens=4, guided_decoding=guided)
        engine.generate(prompts[:1], warm, use_tqdm=False)  # tokenizer conversion, compile
        constrained = run_batch(
            engine,
            prompts,
            [
                SamplingParams(
                    temperature=1.0, seed=i, max_tokens=args.max_tokens, guided_decoding=guided
                )
                for i in range(n)
            ],
        )
        plain = run_batch(
            engine,
            prompts,
            [
                SamplingParams(temperature=1.0, seed=i, max_tokens=length, ignore_eos=True)
                for i, length in enumerate(constrained["lengths"])
            ],
        )
        engine.shutdown()
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    ratio = constrained["output_tok_s"] / plain["output_tok_s"]
    for r in (constrained, plain):
        r.pop("lengths")
    plain.pop("parsed_json")
    print(
        json.dumps(
            {
                "benchmark": "structured",
                "date": time.strftime("%Y-%m-%d"),
                "processor": cpu_model_name(),
                "isa": resolve_isa(),
                "torch_threads": torch.get_num_threads(),
                "grammar_library": "llguidance",
                "model_vocab": spec["vocab_size"],
                "tokenizer_vocab": vocab,
                "num_requests": n,
                "constrained": constrained,
                "unconstrained": plain,
                "constrained_over_unconstrained": ratio,
                "target": 0.85,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
