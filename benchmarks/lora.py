"""Multi-LoRA serving: 64 requests over 8 rank-16 adapters vs the same requests on the base model.

One engine (``enable_lora``, ``max_loras=8``) runs the batch twice, side by side: once with the
requests spread round-robin over 8 random adapters (on every attention and MLP projection,
q/k/v/o and gate/up/down), once with no adapter. Both runs have the same prompts and lengths
(``ignore_eos``), so the ratio of output tokens/s is the cost of the adapters alone: the step's
token mapping and one shrink/expand GEMM pair per active adapter in every linear layer.
Target: LoRA serving keeps at least 70% of the base throughput at rank 16.

The model is the random-weight Llama the other benchmarks use (56M parameters); adapters are
written as PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``).

    python benchmarks/lora.py
    python benchmarks/lora.py --smoke
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams
from pagedllm.lora import LoRARequest

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(folder: Path, spec: dict[str, Any], rank: int, seed: int) -> Path:
    """A PEFT-format LoRA adapter with random A and B on every projection."""
    from safetensors.torch import save_file

    h, inter = spec["hidden_size"], spec["intermediate_size"]
    head = h // spec["num_attention_heads"]
    kv = spec["num_key_value_heads"] * head
    shapes = {  # (in, out)
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec["num_hidden_layers"]):
        for block, names in TARGETS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                a = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
                b = torch.randn(fan_out, rank, generator=gen) * 0.01
                tensors[f"{prefix}.lora_A.weight"] = a
                tensors[f"{prefix}.lora_B.weight"] = b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for names in TARGETS.values() for n in names],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run(
    engine: Engine,
    prompts: list[list[int]],
    lengths: list[int],
    loras: list[LoRARequest | None],
) -> dict[str, Any]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = engine.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + sum(map(len, prompts))) / wall,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each, alternating (best one reported)"
    )
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    n = 8 if args.smoke else args.num_requests
    num_adapters = 2 if args.smoke else args.num_adapters
    max_tokens = 8 if args.smoke else args.max_tokens
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, spec["vocab_size"]) for _ in range(rng.randint(32, 128))]
        for _ in range(n)
    ]
    lengths = [rng.randint(max_tokens // 2, max_tokens) for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", spec)
        adapters = [
            LoRARequest(
                f"adapter-{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", spec, args.rank, i))
            )
            for i in range(num_adapters)
        ]
        engine = Engine(
            str(model),
            device="cpu",
            dtype="float32",
            max_num_seqs=n,
            kv_cache_space=2,
            enable_lora=True,
            max_loras=num_adapters,
            max_lora_rank=args.rank,
            skip_tokenizer_init=True,
        )
        for a in adapters:
            engine.add_lora(a)  # read and packed up front, as a server's --lora-modules are
        spread = [adapters[i % num_adapters] for i in range(n)]
        run(engine, prompts, [2] * n, spread)  # warm-up: every prompt's prefill, a few decodes
        runs: dict[str, list[dict[str, Any]]] = {"lora": [], "base": []}
        for _ in range(1 if args.smoke else args.repeats):  # alternating: load drifts
            runs["lora"].append(run(engine, prompts, lengths, spread))
            runs["base"].append(run(engine, prompts, lengths, [None] * n))
        engine.shutdown()
    lora, base = (max(runs[k], key=lambda r: r["output_tok_s"]) for k in ("lora", "base"))
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    print(
        json.dumps(
            {
                "benchmark": "lora",
                "date": time.strftime("%Y-%m-%d"),
                "processor": cpu_model_name(),
                "isa": resolve_isa(),
                "torch_threads": torch.get_num_threads(),
                "model": {k: spec[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
                "num_requests": n,
                "num_adapters": num_adapters,
                "rank": args.rank,
                "lora": lora,
                "base": base,
                "all_output_tok_s": {k: [r["output_tok_s"] for r in v] for k, v in runs.items()},
                "lora_over_base": lora["output_tok_s"] / base["output_tok_s"],
                "target": 0.70,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
