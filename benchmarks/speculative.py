"""Speculative decoding side by side: plain vs n-gram vs draft model, batch 1 and 8, in one run.

Target: the shipped demo model (a real 5.5M-parameter Llama trained on Python code). Workloads:
- ``code-edit``: "rewrite this code" prompts, greedy; the output repeats spans of the prompt
  and of itself, which n-gram prompt lookup proposes.
- ``no-repeat``: prose-like prompts sampled at temperature 1.0 (seeded): little repetition, so
  proposals are rare and mostly rejected; speculation must cost little there.
Draft model: a copy of the target's first ``--draft-layers`` layers with its embeddings, final
norm and head (self-speculation by layer skipping; no training), saved next to the run.

Prints JSON: output tokens/s per (workload, batch, method), acceptance rate, mean accepted
length, and the speedup over plain decoding of the same workload and batch.

    python benchmarks/speculative.py
    python benchmarks/speculative.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedllm import Engine, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parent.parent / "pagedllm" / "assets" / "demo-model"

_CODE = [
    '''def parse_header(line, sep=":"):
    """Split one header line into a name and a value."""
    name, _, value = line.partition(sep)
    name = name.strip().lower()
    value = value.strip()
    if not name:
        raise ValueError("empty header name: %r" % line)
    return name, value
''',
    """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, amount=1):
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]
""",
    """def read_config(path):
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result
""",
]
_PROSE = [
    "The committee met on a cold morning to discuss the",
    "Once upon a time, in a village by the sea, there lived",
    "Quarterly revenue grew while operating costs",
    "The recipe calls for flour, two eggs and",
]


def code_edit_prompts(n: int) -> list[str]:
    """Rewrite-this-code prompts: the answer restates the code with a small change."""
    out = []
    for i in range(n):
        code = _CODE[i % len(_CODE)]
        out.append(f"# Original:\n{code}\n\n# The same code with type hints added:\n{code[:24]}")
    return out


def no_repeat_prompts(n: int) -> list[str]:
    return [_PROSE[i % len(_PROSE)] for i in range(n)]


def make_draft(target: Path, folder: Path, layers: int) -> Path:
    """The target's first ``layers`` decoder layers with its embeddings, norm and head."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target))
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, folder / name)
    return folder


def run_one(
    model: Path,
    prompts: list[str],
    params: SamplingParams,
    spec: dict[str, Any] | None,
    batch: int,
) -> dict[str, Any]:
    engine = Engine(
        str(model), device="cpu", max_num_seqs=batch, kv_cache_space=1, speculative_config=spec
    )
    engine.generate(prompts[:1], params.clone(max_tokens=8), use_tqdm=False)  # warm-up
    warm = engine.get_stats()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    proposed = stats["spec_decode_num_draft_tokens"] - warm["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - warm["spec_decode_num_accepted_tokens"]
    runs = stats["spec_decode_num_verify_runs"] - warm["spec_decode_num_verify_runs"]
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": (accepted + runs) / runs if runs else None,
        "draft_time_s": stats["spec_decode_draft_time_seconds"]
        - warm["spec_decode_draft_time_seconds"],
        "verify_time_s": stats["spec_decode_verify_time_seconds"]
        - warm["spec_decode_verify_time_seconds"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    max_tokens = 8 if args.smoke else args.max_tokens
    batches = [1] if args.smoke else [int(b) for b in args.batches.split(",")]
    model = Path(args.model)
    workloads = {
        "code-edit": (
            code_edit_prompts,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        ),
        "no-repeat": (
            no_repeat_prompts,
            SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True),
        ),
    }
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        draft = make_draft(model, Path(tmp) / "draft", args.draft_layers)
        methods: dict[str, dict[str, Any] | None] = {
            "plain": None,
            "ngram": {
                "method": "ngram",
                "num_speculative_tokens": args.k,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            },
            "draft_model": {
                "method": "draft_model",
                "model": str(draft),
                "num_speculative_tokens": min(args.k, 3),
            },
        }
        for workload, (make_prompts, params) in workloads.items():
            for batch in batches:
                prompts = make_prompts(batch)
                base = None
                for method, spec in methods.items():
                    r = run_one(model, prompts, params, spec, batch)
                    base = base or r["output_tokens_per_s"]
                    r.update(workload=workload, batch=batch, method=method)
                    r["speedup"] = r["output_tokens_per_s"] / base
                    results.append(r)
    print(
        json.dumps(
            {
                "benchmark": "speculative",
                "model": model.name,
                "draft": f"first {args.draft_layers} layers of the target",
                "max_tokens": max_tokens,
                "num_speculative_tokens": args.k,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
