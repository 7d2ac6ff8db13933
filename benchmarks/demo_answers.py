"""How often the demo model names Paris, pagedllm against llama.cpp on the same file: JSON out.

Issue 57's bar is "over 10 seeds, 'What is the capital of France?' names Paris in at least 9" at
the default sampling (the publisher's temperature 0.2, top_p 0.9). Ten seeds cannot tell 80%
from 90%, nor a sampling bug from the model's own odds, so this asks the question over many
seeds through both engines, with the same prompt tokens (pagedllm's chat template, its token ids
fed to llama.cpp) and the same settings (top_k and min_p off), and reports:

- the Paris rate per engine (and per sampler order, per pagedllm dtype) with a 95% Wilson
  interval; transformers (the GGUF dequantised to float32) is the reference function;
- the first token's distribution from each engine's own logits, at temperature 1 and after the
  0.2 / 0.9 sampling in both orders: pagedllm (as vLLM and transformers) divides by the
  temperature before the top-p cut; llama-cpp-python's chain (``Llama._init_sampler``:
  top_k, typical, top_p, min_p, temp, dist) cuts first, at temperature 1. Which order is used
  changes which first tokens survive, and the first token decides most answers here.

llama-cpp-python is optional (not a declared dependency): without it the llama.cpp rows say so.

    python benchmarks/demo_answers.py --seeds 100 > demo_answers.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np

QUESTION = "What is the capital of France?"
TEMPERATURE, TOP_P = 0.2, 0.9


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """The 95% Wilson score interval of a binomial rate k/n."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)]


def rate(answers: list[str]) -> dict[str, Any]:
    k = sum("Paris" in a for a in answers)
    return {
        "paris": k,
        "of": len(answers),
        "rate": round(k / len(answers), 3),
        "ci95": wilson(k, len(answers)),
    }


def after_sampling(logits: np.ndarray, order: str) -> np.ndarray:
    """Each token's probability of being drawn first at temperature 0.2 and top_p 0.9:
    ``temp_first`` (pagedllm, vLLM) or ``top_p_first`` (llama-cpp-python's chain)."""
    x = logits.astype(np.float64)

    def softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - v.max())
        return e / e.sum()

    def nucleus(p: np.ndarray) -> np.ndarray:
        order_ = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order_]) - p[order_]  # mass strictly above each token
        keep = np.zeros_like(p, dtype=bool)
        keep[order_[before < TOP_P]] = True
        return keep

    if order == "temp_first":
        p = softmax(x / TEMPERATURE)
        keep = nucleus(p)
    else:
        keep = nucleus(softmax(x))
        p = softmax(x / TEMPERATURE)
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def top_tokens(probs: np.ndarray, decode: Any, k: int = 6) -> list[list[Any]]:
    idx = np.argsort(-probs)[:k]
    return [[decode(int(i)), round(float(probs[i]), 4)] for i in idx if probs[i] > 1e-4]


def first_token_report(logits: np.ndarray, decode: Any) -> dict[str, Any]:
    e = np.exp(logits.astype(np.float64) - logits.max())
    return {
        "temperature_1": top_tokens(e / e.sum(), decode),
        "t0.2_p0.9_temp_first": top_tokens(after_sampling(logits, "temp_first"), decode),
        "t0.2_p0.9_top_p_first": top_tokens(after_sampling(logits, "top_p_first"), decode),
    }


def prompt_of(path: str) -> tuple[str, list[int]]:
    """The question through the file's chat template, as the server renders and encodes it."""
    from pagedllm.engine.prompts import load_tokenizer

    tok = load_tokenizer(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    return text, tok.encode(text, add_special_tokens=False)


def run_pagedllm(
    path: str, ids: list[int], dtype: str, seeds: int, max_tokens: int
) -> dict[str, Any]:
    from pagedllm import Engine, SamplingParams

    start = time.perf_counter()
    engine = Engine(path, "cpu", dtype=dtype, kv_cache_space=0.5, max_logprobs=1 << 20)
    tok = engine.get_tokenizer()
    params = [
        SamplingParams(
            temperature=TEMPERATURE, top_p=TOP_P, top_k=-1, min_p=0.0, seed=s, max_tokens=max_tokens
        )
        for s in range(seeds)
    ]
    outs = engine.generate([{"prompt_token_ids": ids}] * seeds, params, use_tqdm=False)
    answers = [o.outputs[0].text for o in outs]
    # The whole first-token distribution: every token's logprob at temperature 1.
    vocab = len(tok)
    probe = SamplingParams(temperature=1.0, max_tokens=1, logprobs=vocab, seed=0)
    (first,) = engine.generate([{"prompt_token_ids": ids}], probe, use_tqdm=False)
    entry = first.outputs[0].logprobs[0]
    logits = np.full(vocab, -np.inf)
    for token, lp in entry.items():
        logits[token] = lp
    engine.shutdown()
    return {
        "engine": f"pagedllm ({dtype})",
        "order": "temp_first",
        **rate(answers),
        "first_token": first_token_report(logits, lambda i: tok.decode([i])),
        "sample_answers": answers[:5],
        "seconds": round(time.perf_counter() - start, 1),
    }


def run_llama_cpp(
    path: str, text: str, ids: list[int], seeds: int, max_tokens: int
) -> list[dict[str, Any]]:
    """Both sampler orders on llama.cpp, each a sampler chain built by hand: llama-cpp-python's
    own (``_init_sampler`` with top_k 0, typical_p 1 and min_p 0 leaves top_p, temp, dist) and
    pagedllm's (temp, top_p, dist). One thread: under a loaded host llama.cpp's threads spin
    waiting for each other (two threads ran ~30x slower than one here)."""
    try:
        import llama_cpp
        from llama_cpp import _internals
    except ImportError:
        return [{"engine": "llama.cpp", "skipped": "llama-cpp-python is not installed"}]
    llm = llama_cpp.Llama(
        path, n_ctx=512, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False
    )
    eos = llm.token_eos()
    same_tokens = llm.tokenize(text.encode(), add_bos=False, special=True) == ids

    def decode(i: int) -> str:
        return llm.detokenize([i]).decode("utf-8", errors="replace")

    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)

    def answer(order: str, seed: int) -> str:
        chain = _internals.LlamaSampler()
        if order == "top_p_first":
            chain.add_top_p(TOP_P, 1)
            chain.add_temp(TEMPERATURE)
        else:
            chain.add_temp(TEMPERATURE)
            chain.add_top_p(TOP_P, 1)
        chain.add_dist(seed)
        llm.reset()
        llm.eval(ids)
        out: list[int] = []
        text = ""
        for _ in range(max_tokens):
            token = chain.sample(llm._ctx, -1)
            if token == eos:
                break
            chain.accept(token)
            out.append(token)
            text = llm.detokenize(out).decode("utf-8", errors="replace")
            if "Paris" in text:  # decided: the rest cannot change the count
                break
            llm.eval([token])
        chain.close()
        return text

    rows = []
    version = llama_cpp.__version__
    for order, name in [
        ("top_p_first", f"llama.cpp (llama-cpp-python {version}, its sampler order)"),
        ("temp_first", "llama.cpp, pagedllm's sampler order"),
    ]:
        start = time.perf_counter()
        answers = [answer(order, s) for s in range(seeds)]
        row = {"engine": name, "order": order, **rate(answers)}
        if order == "top_p_first":
            row["first_token"] = first_token_report(logits, decode)
            row["tokenizes_the_prompt_as_pagedllm"] = same_tokens
        rows.append(
            {**row, "sample_answers": answers[:5], "seconds": round(time.perf_counter() - start, 1)}
        )
    return rows


def run_transformers(path: str, ids: list[int], seeds: int, max_tokens: int) -> dict[str, Any]:
    """The reference function: transformers' own GGUF loading, dequantised to float32, sampling
    in its order (temperature, then top_p), all seeds as one batch from one generator."""
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    file = pathlib.Path(path)
    kwargs = {"gguf_file": file.name}
    model = AutoModelForCausalLM.from_pretrained(file.parent, dtype=torch.float32, **kwargs)
    tok = AutoTokenizer.from_pretrained(file.parent, **kwargs)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1].numpy()
        torch.manual_seed(0)
        out = model.generate(
            prompt.repeat(seeds, 1),
            attention_mask=torch.ones(seeds, len(ids), dtype=torch.long),
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            top_k=0,
            max_new_tokens=max_tokens,
            pad_token_id=tok.eos_token_id,
        )
    answers = tok.batch_decode(out[:, len(ids) :], skip_special_tokens=True)
    return {
        "engine": "transformers (GGUF dequantised, float32)",
        "order": "temp_first",
        **rate(answers),
        "first_token": first_token_report(logits, lambda i: tok.decode([i])),
        "sample_answers": answers[:5],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--dtypes", default="auto,float32", help="pagedllm dtypes, comma-separated")
    parser.add_argument(
        "--engines", default="pagedllm,transformers,llama.cpp", help="which, comma-separated"
    )
    parser.add_argument(
        "--llama-seeds", type=int, help="seeds per llama.cpp order (default: --seeds; it is slow)"
    )
    parser.add_argument("--smoke", action="store_true", help="4 seeds, 8 tokens (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.max_tokens, args.llama_seeds = 4, 8, 4

    from pagedllm.backends.cpu._ops import cpu_model_name
    from pagedllm.entrypoints.demo_model import fetch_demo_model

    fetched = fetch_demo_model(download=False)
    if fetched.path is None:
        print(json.dumps({"benchmark": "demo_answers", "skipped": fetched.reason}))
        return
    path = str(fetched.path)
    text, ids = prompt_of(path)
    engines = args.engines.split(",")
    runs: list[Any] = []
    if "pagedllm" in engines:
        for d in args.dtypes.split(","):
            runs.append(lambda d=d: [run_pagedllm(path, ids, d, args.seeds, args.max_tokens)])
    if "transformers" in engines:
        runs.append(lambda: [run_transformers(path, ids, args.seeds, args.max_tokens)])
    if "llama.cpp" in engines:
        seeds = args.llama_seeds or args.seeds
        runs.append(lambda: run_llama_cpp(path, text, ids, seeds, args.max_tokens))
    rows: list[dict[str, Any]] = []
    for run in runs:
        for row in run():
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)  # as they come
    print(
        json.dumps(
            {
                "benchmark": "demo_answers",
                "processor": cpu_model_name(),
                "date": time.strftime("%Y-%m-%d"),
                "question": QUESTION,
                "prompt_tokens": len(ids),
                "sampling": {
                    "temperature": TEMPERATURE,
                    "top_p": TOP_P,
                    "top_k": "off",
                    "min_p": 0,
                },
                "seeds": args.seeds,
                "max_tokens": args.max_tokens,
                "results": rows,
            },
            indent=2,
            ensure_ascii=False,
        )
    )


if __name__ == "__main__":
    main()
