"""GGUF files, side by side in one run: pagedllm vs llama.cpp (llama-cpp-python) on the same file.

(Not ``gguf.py``: this folder is first on ``sys.path`` for every benchmark, and a ``gguf.py``
here would shadow ggml's ``gguf`` package.)

Models: SmolLM2-135M-Instruct Q4_1 (the demo model, fetched from the package registry), a
random-weight Llama-3.2-1B-shaped model (``model_builder.LLAMA_1B``) written as an F16 GGUF by
``llama_cpp_bench.export_gguf`` and quantised to Q4_0, Q4_K_M and Q8_0 by llama.cpp's own
quantiser (``llama_model_quantize``), and on request a random-weight Gemma-2-2B-shaped model
(``gemma2-2b-q4_k_m``: soft caps, alternating windows, a 256,000-token tied table) and a
random-weight model of Qwen3-30B-A3B's layers (``qwen3moe-q4_k_m``: 128 experts, top-8, 4 of its
48 layers) and one of Mixtral-8x7B's (``mixtral-q4_k_m``: 8 experts of 14,336, top-2, 2 of its
32 layers, written as llama.cpp writes Mixtral: a llama file with expert stacks); files are
cached under ``build/bench/gguf``.

Each engine runs in its own subprocess per file, so start-up (imports included, from the
process's first line to the engine ready) and peak RSS are its own. Per file and engine:
throughput at 16 and 64 parallel sequences (as many requests, prompts 32-128 tokens, outputs
32-96, greedy, every request generating its whole length; pagedllm ``max_num_seqs`` = llama.cpp
``n_parallel``), single-stream decode (one request, 16-token prompt, 64 tokens), start-up and
its part after the imports (``load_seconds``: the engine built, or the model loaded), peak
RSS. ``--single-rounds N`` then runs the single stream alone N more times per engine, our engine
and llama.cpp alternating (a fresh process each, one unmeasured warm-up request first), and
reports each round's ratio and their median: on a shared host single-stream decode follows the
memory bandwidth of the minute, and two figures taken a minute apart once disagreed by 30%.
The rounds also report each engine's share of the read bandwidth measured around them (weight
bytes a token streams times tokens a second): a ratio bar over llama.cpp above 1 / its share
asks more than the memory gives.
``--decode-stack off`` runs our decode steps layer by layer (the reference path) instead of
the whole stack in one C++ call. With ``--decode-rows`` pagedllm also times decode steps at 1,
4 and 8 sequences, for the 4-bit file and for the bf16 checkpoint quantised to int8 at load (our
int8 path), and reports the share of the measured read bandwidth at one sequence (weight bytes a
step reads: each linear layer as stored, quantised or in the compute dtype, plus the LM head in
the compute dtype).
Prints one JSON object with the processor, the ISA path, the linear-layer paths and the ratios.

    python benchmarks/gguf_bench.py                      # everything (~20 minutes on 2 cores)
    python benchmarks/gguf_bench.py --models smollm2     # the demo model only
    python benchmarks/gguf_bench.py --models 1b-q4_k_m --single-rounds 5
    python benchmarks/gguf_bench.py --models gemma2-2b-q4_k_m --single-rounds 3  # ~10 GB RAM
    python benchmarks/gguf_bench.py --models qwen3moe-q4_k_m --single-rounds 3   # ~12 GB RAM
    python benchmarks/gguf_bench.py --models mixtral-q4_k_m --single-rounds 3    # ~16 GB RAM
    python benchmarks/gguf_bench.py --smoke              # a tiny Q4_0 file, seconds (CI)
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # start-up is measured from here, before the imports

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

# Nothing heavier is imported here: llama.cpp's start-up must not carry PyTorch's import (our
# helpers below import torch, so they are imported where used, after start-up is measured).
sys.path.insert(0, str(Path(__file__).parent))
if TYPE_CHECKING:
    from throughput import Request

CACHE = Path(__file__).resolve().parent.parent / "build" / "bench" / "gguf"
# llama.cpp's file types (llama.h's llama_ftype) for its quantiser. The last four need llama.cpp
# (the gguf package cannot write K-quants or IQ types).
FTYPES = {
    "q4_0": 2,
    "q8_0": 7,
    "q4_k_m": 15,
    "q3_k_m": 12,
    "q5_k_m": 17,
    "iq4_nl": 25,
    "iq4_xs": 30,
}
PARALLEL = (16, 64)
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}  # our compute dtype's element size


def model_files(names: list[str], smoke: bool) -> dict[str, Path]:
    """name -> GGUF file (made and cached here; the demo model fetched)."""
    import llama_cpp_bench
    from model_builder import LLAMA_1B, LLAMA_TINY, build_random_llama

    files: dict[str, Path] = {}
    if smoke:
        folder = build_random_llama(CACHE / "tiny-f32", LLAMA_TINY)
        files["tiny-q4_0"] = _quantized(folder, "tiny", "q4_0", llama_cpp_bench)
        return files
    if "smollm2" in names:
        from pagedllm.entrypoints.demo_model import fetch_demo_model

        fetched = fetch_demo_model()
        if fetched.path is None:
            raise SystemExit(f"SmolLM2 unavailable: {fetched.reason}")
        files["smollm2-q4_1"] = fetched.path
    wanted = [n for n in names if n.startswith("1b-")]
    if wanted:
        import torch

        folder = build_random_llama(CACHE / "llama-1b-bf16", LLAMA_1B, dtype=torch.bfloat16)
        for name in wanted:
            files[name] = _quantized(folder, "1b", name.removeprefix("1b-"), llama_cpp_bench)
    for name in names:
        if name.startswith("gemma2-2b-"):
            files[name] = _gemma2_2b(name.removeprefix("gemma2-2b-"))
        if name.startswith("qwen3moe-"):
            files[name] = _qwen3_moe(name.removeprefix("qwen3moe-"))
        if name.startswith("mixtral-"):
            files[name] = _mixtral(name.removeprefix("mixtral-"))
    return files


def _quantized(folder: Path, size: str, quant: str, llama_cpp_bench: Any) -> Path:
    out = CACHE / f"llama-{size}-{quant}.gguf"
    if out.exists():
        return out
    try:
        import llama_cpp as lib
    except ImportError:  # CI: the gguf package's own quantiser (no K-quants)
        return llama_cpp_bench.export_gguf(folder, out, quant)
    f16 = llama_cpp_bench.export_gguf(folder, CACHE / f"llama-{size}-f16.gguf", "f16")
    return _llama_cpp_quantize(lib, f16, out, quant)


def _llama_cpp_quantize(lib: Any, f16: Path, out: Path, quant: str) -> Path:
    params = lib.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = 2
    tmp = out.with_suffix(".partial")
    if lib.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantise {f16} to {quant}")
    tmp.rename(out)
    return out


# Gemma 2 2B's shape (google/gemma-2-2b's config), for random weights.
GEMMA2_2B = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=8192,
    sliding_window=4096,
    query_pre_attn_scalar=256,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)


def _gemma2_2b(quant: str) -> Path:
    """A Gemma-2-2B-shaped model of random weights (normal 0.02; norms 0.1 around the stored 0
    of Gemma's ``1 + w``); see :func:`_random_model_file`."""

    def init(name: str, p: Any) -> None:
        p.normal_(0.0, 0.02 if p.dim() > 1 else 0.1)

    return _random_model_file("gemma2-2b", "Gemma2", GEMMA2_2B, init, quant)


def _random_model_file(
    stem: str, family: str, config: dict[str, Any], init: Any, quant: str
) -> Path:
    """A random-weight model of transformers' ``<family>ForCausalLM`` (bf16, ``init(name,
    param)`` per parameter) written to F16 GGUF by the tests' GGUF writer (llama.cpp's
    conventions: ``tests/models/test_gguf.py`` and ``test_gguf_moe.py`` check that llama.cpp
    reads its files as transformers reads the models) and quantised by llama.cpp's own
    quantiser; cached as ``<stem>-<quant>.gguf``."""
    out = CACHE / f"{stem}-{quant}.gguf"
    if out.exists():
        return out
    import llama_cpp as lib
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' GGUF writer
    from tests.models.gguf_files import write_gguf

    f16 = CACHE / f"{stem}-f16.gguf"
    if not f16.exists():
        torch.manual_seed(0)
        cfg = getattr(transformers, f"{family}Config")(**config)
        with torch.device("meta"):
            model = getattr(transformers, f"{family}ForCausalLM")(cfg)
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for name, param in model.named_parameters():
                init(name, param)
        folder = CACHE / f"{stem}-hf"
        model.save_pretrained(str(folder))
        del model
        meta = {"tokenizer.ggml.model": "none"}
        write_gguf(folder, f16, default="F16", with_tokenizer=False, metadata=meta)
    return _llama_cpp_quantize(lib, f16, out, quant)


# Qwen3-30B-A3B's layer (Qwen/Qwen3-30B-A3B's config: 128 experts of 768, top-8 renormalised,
# 32 query heads and 4 KV heads of 128), 4 of its 48 layers, a 32,000-token vocabulary: its
# expert GEMMs at their real shapes in a file of ~1.5 GB (Q4_K_M).
QWEN3_MOE_A3B_4L = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _qwen3_moe(quant: str) -> Path:
    """The Qwen3-MoE model above, random weights (:func:`_moe_init`); see
    :func:`_random_model_file`. ~12 GB of RAM while the F16 file is written."""
    return _random_model_file("qwen3moe-a3b-4l", "Qwen3Moe", QWEN3_MOE_A3B_4L, _moe_init, quant)


# Mixtral-8x7B's layer (mistralai/Mixtral-8x7B-v0.1's config: 8 experts of 14,336, top-2, 32
# query heads and 8 KV heads of 128, rope base 1e6: the class default), 2 of its 32 layers, its
# 32,000-token vocabulary: its expert GEMMs at their real shapes in a file of ~1.8 GB (Q4_K_M).
MIXTRAL_8X7B_2L = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _mixtral(quant: str) -> Path:
    """The Mixtral model above, random weights initialised as :func:`_qwen3_moe`'s."""
    return _random_model_file("mixtral-8x7b-2l", "Mixtral", MIXTRAL_8X7B_2L, _moe_init, quant)


def _moe_init(name: str, p: Any) -> None:
    """Normal 0.02; routers 0.3 (decisive choices); norms around 1."""
    if p.dim() > 1:
        p.normal_(0.0, 0.3 if name.endswith("mlp.gate.weight") else 0.02)
    else:
        p.uniform_(0.8, 1.2)


# --- one engine on one file, in its own process -----------------------------------------------


def _workloads(vocab: int, args: argparse.Namespace) -> dict[str, list[Request]]:
    """The measured workloads; with ``--only-single`` (a round of ``--single-rounds``) the
    single stream twice, the first an unmeasured warm-up (``warmup_``)."""
    from throughput import make_workload

    single = make_workload(1, vocab, (16, 16), (16 if args.smoke else 64,) * 2, 7)
    if args.only_single:
        return {"warmup_single": single, "single": single}
    parallel = (2, 4) if args.smoke else PARALLEL
    out = {
        f"parallel_{p}": make_workload(p, vocab, (32, 128), (8, 16) if args.smoke else (32, 96), p)
        for p in parallel
    }
    out["single"] = single
    return out


# Our two arithmetics: activations as the model's dtype (the default), and rounded to int8 per
# group in the 4-bit layers' rows, prefill and decode (``int8_activations``, as llama.cpp
# computes).
OURS = ("pagedllm", "pagedllm-int8act")


def run_pagedllm(
    path: Path, args: argparse.Namespace, *, int8_activations: bool = False
) -> dict[str, Any]:
    """pagedllm as users start it; ``int8_activations``: the 4-bit layers' rows rounded to int8
    per group (llama.cpp's arithmetic), the ``pagedllm-int8act`` engine."""
    from pagedllm import Engine, SamplingParams
    from pagedllm.backends.cpu._ops import resolve_isa

    imported = time.perf_counter()
    first = Engine(
        str(path),
        device="cpu",
        skip_tokenizer_init=True,
        max_num_seqs=max(PARALLEL),
        kv_cache_space=args.kv_cache_space,
        int8_activations=int8_activations,
    )
    startup = time.perf_counter() - PROCESS_START
    vocab = first.vocab_size
    result: dict[str, Any] = {
        "startup_seconds": startup,
        "load_seconds": time.perf_counter() - imported,
        "isa": resolve_isa(),
        "dtype": str(first.executor.worker.dtype).removeprefix("torch."),
        "linear_path": first.executor.collective_rpc("linear_path")[0],
    }
    for name, reqs in _workloads(vocab, args).items():
        # P requests at once: all P run together (max_num_seqs is the largest P).
        prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
        ]
        start = time.perf_counter()
        first.generate(prompts, params, use_tqdm=False)
        if not name.startswith("warmup_"):
            seconds = time.perf_counter() - start
            result[f"{name}_tok_s"] = sum(r.output_len for r in reqs) / seconds
    if args.decode_rows and not args.only_single:
        from throughput import _decode_step_seconds

        spec = {"vocab_size": vocab}
        result["decode_step_seconds"] = {n: _decode_step_seconds(first, spec, n) for n in (1, 4, 8)}
    return result


def run_int8_reference(args: argparse.Namespace) -> dict[str, Any]:
    """Our int8 weight-only path on the same 1B weights (the bf16 checkpoint, quantised at load):
    decode steps at 1, 4 and 8 sequences, to set the 4-bit file's against."""
    from throughput import _decode_step_seconds

    from pagedllm import Engine

    eng = Engine(
        str(CACHE / "llama-1b-bf16"),
        device="cpu",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        quantization="int8",
        kv_cache_space=args.kv_cache_space,
    )
    spec = {"vocab_size": eng.vocab_size}
    return {
        "linear_path": eng.executor.collective_rpc("linear_path")[0],
        "decode_step_seconds": {n: _decode_step_seconds(eng, spec, n) for n in (1, 4, 8)},
    }


def run_llama_cpp(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp as lib
    import llama_cpp_bench

    threads = args.threads
    imported = time.perf_counter()
    lib.llama_log_set(ctypes.cast(None, lib.llama_log_callback), ctypes.c_void_p())
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    startup = time.perf_counter() - PROCESS_START
    loaded = time.perf_counter() - imported
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    lib.llama_model_free(model)
    result: dict[str, Any] = {
        "startup_seconds": startup,
        "load_seconds": loaded,
        "threads": threads,
    }
    for name, reqs in _workloads(vocab, args).items():
        n_parallel = len(reqs) if name != "single" else 1
        run = llama_cpp_bench.run_llama_cpp(path, reqs, n_parallel=n_parallel, threads=threads)
        if not name.startswith("warmup_"):
            result[f"{name}_tok_s"] = sum(r.output_len for r in reqs) / run["seconds"]
    return result


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    if args.run_one == "int8-reference":
        result = run_int8_reference(args)
    elif args.run_one in OURS:
        result = run_pagedllm(args.file, args, int8_activations=args.run_one != "pagedllm")
    else:
        result = run_llama_cpp(args.file, args)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    return result


def _in_subprocess(
    engine: str, path: Path | None, args: argparse.Namespace, *, only_single: bool = False
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--run-one",
        engine,
        "--kv-cache-space",
        str(args.kv_cache_space),
    ]
    cmd += ["--file", str(path)] if path else []
    # llama.cpp gets the threads PyTorch (so pagedllm) uses, without importing PyTorch itself.
    cmd += ["--threads", str(_torch_threads())]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--decode-rows"] if args.decode_rows and engine in OURS else []
    cmd += ["--only-single"] if only_single else []
    # Our engines read the switch at start; llama.cpp ignores it.
    env = {**os.environ, "PAGEDLLM_DECODE_STACK": "1" if args.decode_stack == "on" else "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _read_through(path: Path) -> None:
    """The file into the page cache before any engine starts: the first engine of a file paid
    its cold reads in start-up (1.7-3.7 s more than the next one in one run), the others not."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# --- the side-by-side run ----------------------------------------------------------------------


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in ours:
        if key.endswith("_tok_s") and key in theirs:
            out[key.removesuffix("_tok_s")] = ours[key] / theirs[key]
    if "startup_seconds" in theirs:
        out["startup_vs_llama_cpp"] = ours["startup_seconds"] / theirs["startup_seconds"]
    if "load_seconds" in theirs:  # the same without the imports (PyTorch's alone is ~1-1.4 s)
        out["load_vs_llama_cpp"] = ours["load_seconds"] / theirs["load_seconds"]
    return out


def _streamed_bytes(path: Path, compute_bytes: int, *, as_file: bool = False) -> int:
    """Weight bytes one decode step reads: each linear layer and the LM head as the engine keeps
    them in the default engine (the file's bytes for 4-bit and Q8_0; Q6_K at 6.625 bits a weight
    where the build reads its q at 6 bits, else 8.625 as int8; the compute dtype for what is
    dequantised), or with ``as_file`` as the file holds them (llama.cpp's reading). The
    embedding's rows are gathered, not streamed."""
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.backends.cpu.dense_gemm import gemm_ops
    from pagedllm.models.gguf.config import family_of
    from pagedllm.models.gguf.loading import open_gguf
    from pagedllm.models.gguf.names import NOT_WEIGHTS, hf_name
    from pagedllm.models.gguf.plan import plan_layers, tensor_format

    gguf = open_gguf(path)
    family = family_of(gguf)
    plan = plan_layers(gguf, family, CpuBackend().kernel("linear").formats)
    head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    ops = gemm_ops()
    q6_k_bits = 6.625 if ops is not None and ops.groupwise_six_bits() else 8.625
    total = 0
    for name, t in gguf.tensors.items():
        if name in NOT_WEIGHTS or len(t.shape) != 2:
            continue
        module = hf_name(name, family)[1]
        if name != head and (module is None or name == "token_embd.weight"):
            continue  # not a linear layer, or the table of an untied head (rows gathered)
        elements = t.shape[0] * t.shape[1]
        fmt = tensor_format(plan, name, module)  # a fused layer's parts may differ
        if as_file:
            total += int(t.raw.nbytes)
        elif fmt == "q6_k":
            total += elements * q6_k_bits / 8
        elif fmt is not None:
            total += int(t.raw.nbytes)
        else:
            total += elements * compute_bytes
    return int(total)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny Q4_0 file (CI)")
    parser.add_argument("--models", default="smollm2,1b-q4_0,1b-q4_k_m,1b-q8_0")
    parser.add_argument("--engines", default=",".join((*OURS, "llama.cpp")))
    parser.add_argument("--decode-rows", action="store_true", help="decode steps at 1-8 seqs")
    parser.add_argument("--kv-cache-space", type=float, default=2.0, help="GiB (pagedllm)")
    parser.add_argument(
        "--single-rounds", type=int, default=0, help="single stream again, engines alternating"
    )
    parser.add_argument(
        "--decode-stack",
        choices=("on", "off"),
        default="on",
        help="off: our decode steps run layer by layer (PAGEDLLM_DECODE_STACK=0), the reference",
    )
    parser.add_argument("--only-single", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print(json.dumps(run_one(args)))
        return
    from llama_cpp_bench import available

    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    engines = args.engines.split(",")
    missing = available()
    if missing and "llama.cpp" in engines:
        engines.remove("llama.cpp")
    files = model_files(args.models.split(","), args.smoke)
    report: dict[str, Any] = {
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "decode_stack": args.decode_stack,
        "llama_cpp": missing or "llama-cpp-python " + _version("llama_cpp"),
        "llama_cpp_build": None if missing else _llama_cpp_build(),
        "models": {},
    }
    for name, path in files.items():
        _read_through(path)
        entry = {e: _in_subprocess(e, path, args) for e in engines}
        entry["file_mib"] = path.stat().st_size / (1 << 20)
        theirs = entry.get("llama.cpp", {})
        for engine in OURS:
            ours = entry.get(engine, {})
            if ours and "error" not in ours and theirs and "error" not in theirs:
                entry[f"{engine}_vs_llama_cpp"] = _ratios(ours, theirs)
        if args.single_rounds > 0 and "llama.cpp" in engines:
            dtype = entry.get("pagedllm", {}).get("dtype", "bfloat16")
            entry["single_rounds"] = _single_rounds(path, engines, args, DTYPE_BYTES.get(dtype, 2))
        report["models"][name] = entry
    if (
        args.decode_rows
        and "1b-q4_0" in files
        and "error" not in report["models"]["1b-q4_0"]["pagedllm"]
    ):
        report["decode_rows"] = _decode_rows(report, files["1b-q4_0"], args)
    print(json.dumps(report, indent=2))


def _single_rounds(
    path: Path, engines: list[str], args: argparse.Namespace, compute_bytes: int = 2
) -> dict[str, Any]:
    """Single-stream tok/s, ``args.single_rounds`` rounds; in each, every engine in a fresh
    process, back to back (who goes first alternates), and our engines' ratios to llama.cpp's
    in that round: a ratio of neighbours in time, which the host's drift moves least."""
    import statistics

    from throughput import read_bandwidth

    tok_s: dict[str, list[float]] = {e: [] for e in engines}
    bandwidth = [read_bandwidth()]
    for i in range(args.single_rounds):
        for engine in engines if i % 2 == 0 else engines[::-1]:
            got = _in_subprocess(engine, path, args, only_single=True)
            tok_s[engine].append(got.get("single_tok_s", float("nan")))
    bandwidth.append(read_bandwidth())
    out: dict[str, Any] = {"tok_s": tok_s}
    out.update(_bandwidth_shares(path, tok_s, max(bandwidth), compute_bytes))
    out["read_bandwidth_gb_s"] = [b / 1e9 for b in bandwidth]
    for engine in (e for e in engines if e in OURS):
        ratios = [a / b for a, b in zip(tok_s[engine], tok_s["llama.cpp"], strict=True)]
        out[f"{engine}_vs_llama_cpp"] = ratios
        out[f"{engine}_vs_llama_cpp_median"] = statistics.median(ratios)
    return out


def _bandwidth_shares(
    path: Path, tok_s: dict[str, list[float]], bandwidth: float, compute_bytes: int
) -> dict[str, Any]:
    """Each engine's single stream as a share of the read bandwidth (the better of the figures
    taken before and after the rounds): weight bytes a token streams (ours as we keep them,
    llama.cpp's as the file holds them) times tokens a second, prefill and sampling counted in
    the time. Where llama.cpp's share is s, no engine can pass 1/s times its speed on this
    host, which says what a ratio bar asks of the memory."""
    ours = _streamed_bytes(path, compute_bytes)
    theirs = _streamed_bytes(path, compute_bytes, as_file=True)
    shares: dict[str, list[float]] = {}
    for engine, rates in tok_s.items():
        per_token = theirs if engine == "llama.cpp" else ours
        shares[engine] = [rate * per_token / bandwidth for rate in rates]
    return {
        "streamed_bytes_per_token": {"pagedllm": ours, "llama.cpp": theirs},
        "share_of_read_bandwidth": shares,
    }


def _decode_rows(report: dict[str, Any], path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from throughput import read_bandwidth

    q4 = report["models"]["1b-q4_0"]["pagedllm"]
    int8 = _in_subprocess("int8-reference", None, args)
    out: dict[str, Any] = {"int8": int8}
    for engine in OURS:
        steps = report["models"]["1b-q4_0"].get(engine, {}).get("decode_step_seconds")
        if steps and "error" not in int8:
            suffix = "" if engine == "pagedllm" else "_int8act"
            out[f"q4_0{suffix}"] = steps
            out[f"q4_0{suffix}_vs_int8_speedup"] = {
                n: int8["decode_step_seconds"][n] / t for n, t in steps.items()
            }
    size = DTYPE_BYTES[q4["dtype"]]
    streamed = _streamed_bytes(path, size)
    bandwidth = read_bandwidth()
    one = q4["decode_step_seconds"]["1"]
    out.update(
        streamed_bytes_per_step=streamed,
        read_bandwidth_gb_s=bandwidth / 1e9,
        share_of_read_bandwidth_at_1=streamed / one / bandwidth,
    )
    return out


def _llama_cpp_build() -> str:
    """The instruction sets llama.cpp was compiled for (its own system info): a build without
    AVX2 or its repacked layouts would flatter every ratio here."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return "?"


if __name__ == "__main__":
    main()
