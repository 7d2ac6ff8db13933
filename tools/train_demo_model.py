"""Train the tiny demo model that ships in ``pagedllm/assets/demo-model/``.

Why: ``make demo`` (the first thing a new user runs) must work offline, so the repository carries a
small but real Llama-architecture checkpoint in Hugging Face format. It writes Python-looking code,
which shows engine bugs at a glance (a broken KV cache turns code into noise), and it is small
enough (<= 30 MB) to commit.

Corpus: the ``*.py`` files of the running interpreter's standard library (``sysconfig``'s
``stdlib`` path, ``Lib/`` in a CPython checkout), distributed under the PSF License Agreement, which
allows derived works. Excluded: ``site-packages`` (third-party code under other licences), the test
suites (directories ``test``, ``tests``, ``idle_test``), ``pydoc_data`` (a 750 kB string of
documentation), ``_sysconfigdata_*`` (this machine's build paths), generated codec tables (files
naming ``gencodec.py``) and non-UTF-8 files. Files whose CRC32 of the relative path is 0 mod 40 are
held out. With CPython 3.11.7: 640 train files (9,774,009 bytes, 2,729,913 tokens) and 24 held-out
files (353,041 bytes, 97,254 tokens); the model card records the numbers of the run that made it.

Tokenizer: byte-level BPE trained here with ``tokenizers`` (vocab 4096; ``<|endoftext|>`` is BOS,
EOS and padding, and the post-processor prepends it, as every training document began after one).
No normaliser and a byte-level pre-tokenizer and decoder, so ``decode(encode(x)) == x`` for every
corpus file, which is checked.

Model: ``LlamaForCausalLM`` (hidden 256, 6 layers, 8 heads, 4 KV heads, MLP 704, tied embeddings,
RoPE theta 10000, 1024 positions: 5,475,584 parameters, 21.9 MB in float32), trained in float32 on
the CPU with AdamW and a cosine schedule on random 256-token windows of the packed corpus, for
``--minutes`` of wall-clock time (cosine over elapsed time) or ``--steps`` steps (cosine over steps;
repeatable bit for bit on one machine and set of library versions).

Run (the machine is shared, hence ``nice``):
    nice -n 19 .venv/bin/python tools/train_demo_model.py --minutes 20
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger("train_demo_model")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "pagedllm" / "assets" / "demo-model"
EOT = "<|endoftext|>"
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"}
)
HELDOUT_MODULUS = 40  # ~2.5 % of the files, chosen by CRC32 of the relative path
MAX_BYTES_ON_DISK = 30 * 1024 * 1024
PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")


@dataclass(frozen=True)
class Corpus:
    """Relative path -> text, split by whole files so held-out text is never seen in training."""

    train: dict[str, str]
    heldout: dict[str, str]


@dataclass
class RunStats:
    """Numbers gathered during the run; they end up in the model card."""

    num_params: int = 0
    train_tokens: int = 0
    heldout_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    tokens_seen: int = 0
    train_loss: float = float("nan")
    heldout_loss: float = float("nan")
    loss_log: list[tuple[int, float]] = field(default_factory=list)
    completions: dict[str, str] = field(default_factory=dict)
    fibonacci_plausible: bool = False
    bytes_on_disk: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--minutes", type=float, default=20.0, help="training wall-clock budget")
    p.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes)")
    # One thread by default: on a loaded 2-core machine two OpenMP threads spin-wait on each other
    # and ran 5x slower than one (15.7 s vs 3.2 s a step, measured).
    for name, default in (
        ("seed", 0),
        ("vocab-size", 4096),
        ("hidden", 256),
        ("layers", 6),
        ("heads", 8),
        ("kv-heads", 4),
        ("intermediate", 704),
        ("seq-len", 256),
        ("batch-size", 8),
        ("warmup", 50),
        ("threads", 1),
        ("log-every", 25),
        ("lr", 2e-3),
        ("min-lr-ratio", 0.1),
        ("weight-decay", 0.1),
    ):
        p.add_argument(f"--{name}", type=type(default), default=default)
    return p.parse_args(argv)


def _is_excluded(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
        return True
    return rel.name.startswith("_sysconfigdata")


def collect_corpus(stdlib: Path) -> Corpus:
    """Read the stdlib sources in sorted (so reproducible) order and split off held-out files."""
    corpus = Corpus(train={}, heldout={})
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _is_excluded(rel) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if "gencodec.py" in text or not text.strip():
            continue
        name = rel.as_posix()
        heldout = zlib.crc32(name.encode()) % HELDOUT_MODULUS == 0
        (corpus.heldout if heldout else corpus.train)[name] = text
    return corpus


def _num_bytes(texts: dict[str, str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts.values())


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: all 256 bytes are in the alphabet, so any text (indentation included)
    round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    eot_id = tok.token_to_id(EOT)
    # A prompt starts like a document did in training: right after <|endoftext|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=1024
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Encode each file as ``<eot> text`` and check that decoding gives the text back byte for byte,
    or the demo would mangle indentation."""
    encoded = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    for text, ids in zip(texts, encoded, strict=True):
        if tokenizer.decode(ids, skip_special_tokens=True) != text:
            raise AssertionError(f"tokenizer round-trip failed on a {len(text)}-char text")
    return encoded


def pack(documents: list[list[int]]) -> torch.Tensor:
    """Concatenate ``<eot> doc <eot> doc ...`` into the stream training windows are cut from."""
    return torch.tensor([i for ids in documents for i in ids], dtype=torch.int64)  # [num_tokens]


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        hidden_act="silu",
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        initializer_range=0.02,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False
    )
    return model


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=gen)
    offsets = torch.arange(seq_len)
    return data[starts[:, None] + offsets[None, :]]  # [batch_size, seq_len]


def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps times a cosine in ``progress`` (0..1) down to
    ``min_ratio * peak``."""
    cosine = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * min(1.0, (step + 1) / warmup) * cosine


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-token loss over non-overlapping windows taken evenly across ``data``."""
    model.eval()
    num = data.numel() // seq_len
    idx = torch.linspace(0, num - 1, steps=min(num, max_windows)).long()
    windows = data[: num * seq_len].view(num, seq_len)[idx]  # [w, seq_len]
    losses = [model(input_ids=chunk, labels=chunk).loss.item() for chunk in windows.split(16)]
    weights = [len(chunk) for chunk in windows.split(16)]
    model.train()
    return sum(lo * w for lo, w in zip(losses, weights, strict=True)) / sum(weights)


def train(
    model: LlamaForCausalLM, data: torch.Tensor, args: argparse.Namespace, stats: RunStats
) -> None:
    """AdamW + cosine, for ``--steps`` steps (repeatable) or until ``--minutes`` have passed.

    In the timed mode the cosine follows elapsed time rather than a step count guessed up front:
    the machine is shared, its speed changes during a run, and a guess would either stop early at
    a high learning rate or overrun the budget.
    """
    params = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    model.train()
    start = time.monotonic()
    running: list[float] = []
    step = 0
    progress = 0.0
    while progress < 1.0:
        lr = lr_at(step, progress, args.lr, args.warmup, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(data, args.batch_size, args.seq_len, gen)  # [B, S]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running.append(loss.item())
        step += 1
        elapsed = time.monotonic() - start
        progress = step / args.steps if args.steps else elapsed / budget
        if step % args.log_every == 0 or progress >= 1.0:
            mean = sum(running) / len(running)
            stats.loss_log.append((step, mean))
            running.clear()
            logger.info("step %d loss %.4f lr %.2e %.0f s", step, mean, lr, elapsed)
    stats.steps = step
    stats.seconds = time.monotonic() - start
    stats.tokens_seen = step * args.batch_size * args.seq_len


def looks_like_python(prompt: str, completion: str) -> bool:
    """True when ``prompt + completion`` opens a definition whose indented body parses.

    Only whole lines count (generation stops mid-line). The longest prefix of them that still holds
    the first body line must parse: as is, with an open docstring closed, or, when it ends by
    opening a block, with a ``pass``.
    """
    lines = (prompt + completion).split("\n")[:-1]
    first_body = next((i for i, line in enumerate(lines) if i > 0 and line.strip()), None)
    if first_body is None or not lines[first_body][:1].isspace():
        return False
    for k in range(len(lines), first_body, -1):
        last = lines[k - 1]
        block = "\n" + last[: len(last) - len(last.lstrip())] + "    pass"
        for suffix in ("", '"""', block if last.rstrip().endswith(":") else ""):
            try:
                ast.parse("\n".join(lines[:k]) + suffix)
            except SyntaxError:
                continue
            return True
    return False


def complete(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, max_new_tokens: int
) -> str:
    """Greedy completion by transformers' own ``generate`` (the reference the engine must match)."""
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]  # [num_new_tokens]
    return tokenizer.decode(new, skip_special_tokens=True)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> int:
    """Write the HF folder and return its size in bytes (everything but the model card)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.json"), *out.glob("*.safetensors")]:
        stale.unlink()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 records its internal class name "TokenizersBackend"; the public alias loads on
    # 4.x and 5.x alike. Same for rope_theta, which 5.x nests under "rope_parameters".
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model_cfg_path = out / "config.json"
    model_cfg = json.loads(model_cfg_path.read_text())
    model_cfg.setdefault("rope_theta", model.config.rope_parameters["rope_theta"])
    model_cfg_path.write_text(json.dumps(model_cfg, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the package must be readable by all
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md")


CARD = """\
# pagedllm demo model

A {num_params:,}-parameter Llama-architecture model trained from scratch on the Python standard
library so that `make demo` runs offline. It writes Python-looking code and nothing more: it is
there to exercise the engine (a broken KV cache shows at once as garbled code), not to be useful.
Written by `tools/train_demo_model.py`; do not edit by hand.

## Corpus
- Source: the `*.py` files of the CPython {python} standard library
  (`sysconfig.get_paths()["stdlib"]`), in sorted path order.
- Excluded: `site-packages`, test suites (`test/`, `tests/`, `idle_test/`), `pydoc_data/`,
  `_sysconfigdata_*`, generated codec tables (files naming `gencodec.py`), non-UTF-8 files.
- Train: {n_train} files, {train_bytes:,} bytes, {train_tokens:,} tokens.
- Held out (CRC32 of the relative path = 0 mod {heldout_mod}): {n_heldout} files,
  {heldout_bytes:,} bytes, {heldout_tokens:,} tokens: {heldout_list}.
- Licence: the standard library is distributed by the Python Software Foundation under the PSF
  License Agreement, which permits derived works provided the PSF copyright notice is kept:
  "Copyright (c) 2001 Python Software Foundation; All Rights Reserved". The weights and tokenizer
  are derived from that text only.

## Tokenizer
Byte-level BPE trained on the train files with `tokenizers` {tokenizers}: vocabulary {vocab}, one
special token `<|endoftext|>` (id {eot_id}) as BOS, EOS and padding, which the post-processor
prepends to every text (each training document began after one). No normaliser;
`decode(encode(x), skip_special_tokens=True) == x` for every corpus file (checked in training).

## Model and training
| setting | value |
|---|---|
| architecture | `LlamaForCausalLM`: hidden {hidden}, {layers} layers, {heads} heads, \
{kv_heads} KV heads, MLP {intermediate}, tied embeddings |
| positions | RoPE theta 10000, max_position_embeddings 1024 |
| parameters | {num_params:,} (folder {bytes_on_disk:,} bytes, float32 safetensors) |
| data | random {seq_len}-token windows of the packed train stream, batch {batch} |
| optimiser | AdamW, betas 0.9/0.95, weight decay {wd} on matrices, grad-norm clip 1.0 |
| schedule | linear warm-up over {warmup} steps to {lr:g}, cosine to {min_lr:g} over {horizon} |
| run | {steps} steps, {tokens_seen:,} tokens ({epochs:.2f} epochs), {minutes:.1f} min, \
{threads} CPU thread(s) (shared machine, `nice -n 19`), float32, seed {seed} |
| software | Python {python}, torch {torch}, transformers {transformers}, {machine} |

## Results
- Final train loss ({eval_windows} evenly spaced train windows): **{train_loss:.4f}**
- Held-out loss (same, held-out files): **{heldout_loss:.4f}** (perplexity {heldout_ppl:.1f})
- Training loss by step: {loss_curve}

## Greedy completions ({max_new} new tokens, transformers `generate`)
{completions}
The `def fibonacci(n):` completion {plausible} (by the script's check: an
indented body whose whole lines parse once an open docstring or block is closed).

## Reproduce
```
nice -n 19 .venv/bin/python tools/train_demo_model.py {repro}
```
{repro_note}

## Load
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("pagedllm/assets/demo-model")
tokenizer = AutoTokenizer.from_pretrained("pagedllm/assets/demo-model")
```
"""
EVAL_WINDOWS = 128
MAX_NEW_TOKENS = 64


def _repro_flags(args: argparse.Namespace) -> str:
    """The command-line flags that differ from the defaults (``--out`` aside)."""
    defaults = vars(parse_args([]))
    flags = [
        f"--{name.replace('_', '-')} {value:g}"
        if isinstance(value, float)
        else f"--{name.replace('_', '-')} {value}"
        for name, value in vars(args).items()
        if name not in ("out", "stdlib") and value != defaults[name]
    ]
    return " ".join(flags)


def write_card(args: argparse.Namespace, corpus: Corpus, stats: RunStats, eot_id: int) -> None:
    curve = stats.loss_log[:: max(1, len(stats.loss_log) // 8)]
    if stats.loss_log and curve[-1] != stats.loss_log[-1]:
        curve.append(stats.loss_log[-1])
    completions = "".join(
        f"\n`{prompt!r}` →\n````python\n{prompt}{text}\n````\n"
        for prompt, text in stats.completions.items()
    )
    timed = args.steps is None
    text = CARD.format(
        python=platform.python_version(),
        heldout_mod=HELDOUT_MODULUS,
        n_train=len(corpus.train),
        train_bytes=_num_bytes(corpus.train),
        train_tokens=stats.train_tokens,
        n_heldout=len(corpus.heldout),
        heldout_bytes=_num_bytes(corpus.heldout),
        heldout_tokens=stats.heldout_tokens,
        heldout_list=", ".join(f"`{f}`" for f in corpus.heldout),
        tokenizers=sys.modules["tokenizers"].__version__,
        vocab=args.vocab_size,
        eot_id=eot_id,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        num_params=stats.num_params,
        bytes_on_disk=stats.bytes_on_disk,
        seq_len=args.seq_len,
        batch=args.batch_size,
        wd=args.weight_decay,
        warmup=args.warmup,
        lr=args.lr,
        min_lr=args.lr * args.min_lr_ratio,
        horizon=f"{args.minutes:g} min of wall-clock" if timed else f"{args.steps} steps",
        steps=stats.steps,
        tokens_seen=stats.tokens_seen,
        epochs=stats.tokens_seen / stats.train_tokens,
        minutes=stats.seconds / 60,
        threads=args.threads,
        seed=args.seed,
        torch=torch.__version__,
        transformers=transformers.__version__,
        machine=f"{platform.machine()} {platform.system()}",
        eval_windows=EVAL_WINDOWS,
        train_loss=stats.train_loss,
        heldout_loss=stats.heldout_loss,
        heldout_ppl=math.exp(stats.heldout_loss),
        loss_curve=", ".join(f"{s}: {lo:.3f}" for s, lo in curve),
        max_new=MAX_NEW_TOKENS,
        completions=completions,
        plausible="is plausible Python" if stats.fibonacci_plausible else "is NOT plausible Python",
        repro=_repro_flags(args),
        repro_note=(
            "The cosine followed wall-clock time, so a rerun takes a different number of steps "
            f"and gives a similar, not identical, model; `--steps {stats.steps}` runs as many "
            "steps with a step-based cosine, which is repeatable."
        )
        if timed
        else "Step-based cosine: repeatable on the same machine and library versions.",
    )
    (args.out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    corpus = collect_corpus(args.stdlib)
    logger.info(
        "corpus: %d train files (%d bytes), %d held-out files (%d bytes)",
        len(corpus.train),
        _num_bytes(corpus.train),
        len(corpus.heldout),
        _num_bytes(corpus.heldout),
    )
    tokenizer = train_tokenizer(list(corpus.train.values()), args.vocab_size)
    train_data = pack(encode_documents(tokenizer, list(corpus.train.values())))  # [n_train]
    heldout_data = pack(encode_documents(tokenizer, list(corpus.heldout.values())))  # [n_heldout]
    model = build_model(args, tokenizer)
    stats = RunStats(
        num_params=sum(p.numel() for p in model.parameters()),
        train_tokens=train_data.numel(),
        heldout_tokens=heldout_data.numel(),
    )
    logger.info(
        "tokens: %d train, %d held-out; model: %d parameters",
        stats.train_tokens,
        stats.heldout_tokens,
        stats.num_params,
    )
    train(model, train_data, args, stats)
    stats.train_loss = evaluate(model, train_data, args.seq_len, EVAL_WINDOWS)
    stats.heldout_loss = evaluate(model, heldout_data, args.seq_len, EVAL_WINDOWS)
    logger.info("train loss %.4f, held-out loss %.4f", stats.train_loss, stats.heldout_loss)
    stats.bytes_on_disk = save(model, tokenizer, args.out)

    # Check what ships, not what is in memory: reload the folder the way users will.
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    for prompt in PROMPTS:
        stats.completions[prompt] = complete(model, tokenizer, prompt, MAX_NEW_TOKENS)
        print(f"--- {prompt!r}\n{prompt}{stats.completions[prompt]}\n")
    stats.fibonacci_plausible = looks_like_python(PROMPTS[0], stats.completions[PROMPTS[0]])
    write_card(args, corpus, stats, tokenizer.bos_token_id)
    logger.info(
        "wrote %s (%d bytes); fibonacci completion plausible: %s",
        args.out,
        stats.bytes_on_disk,
        stats.fibonacci_plausible,
    )
    if stats.bytes_on_disk > MAX_BYTES_ON_DISK:
        logger.error(
            "model folder is %d bytes, over the %d limit", stats.bytes_on_disk, MAX_BYTES_ON_DISK
        )
        return 1
    return 0 if stats.fibonacci_plausible else 2


if __name__ == "__main__":
    sys.exit(main())
