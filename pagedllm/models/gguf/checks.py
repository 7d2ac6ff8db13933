"""A GGUF file's hyper-parameters held against its architecture and its own tensors.

The reader bounds the file's structure; this says whether what it describes is a model the
family's code can run: the numbers that size allocations and divide (head counts, widths,
layers, context) and the ones that feed the arithmetic (rope base, norm epsilons) are checked
before either happens, and each tensor a block of the family needs is required by name (the
list comes from the architecture, not from whatever the file holds). A file that fails says
so in one line naming the key or tensor as the file spells it; a file that passed these
checks and still loads wrong weights would have to lie in its tensor data, which GGUF does
not checksum (``pagedllm inspect --verify-sha256``).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from pagedllm.models.gguf.config import Family, family_of
from pagedllm.models.gguf.encoder_checks import check_encoder
from pagedllm.models.gguf.names import NOT_WEIGHTS, hf_name, is_expert_stack
from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError
from pagedllm.models.safetensors_reader import CheckpointError

logger = logging.getLogger(__name__)

# The rotary table (cos and sin, float32, per position) may take at most this share of the
# host's memory: a context length beyond it is capped, with a log line.
_ROTARY_TABLE_SHARE = 64
# No model has a context near this; a length beyond it is a damaged or hostile file.
MAX_CONTEXT = 1 << 26
_SPECIAL_TOKENS = ("bos", "eos", "unknown", "separator", "padding", "eot", "eom")


def _blocks_of(family: Family, arch: str) -> list[tuple[str, ...]]:
    """Groups of tensor kinds every block needs; a group of alternatives is written
    ``"a|b"`` (Phi-3 ships its attention fused or apart)."""
    attention = ("attn_qkv|attn_q", "attn_qkv|attn_k", "attn_qkv|attn_v", "attn_output")
    groups: list[tuple[str, ...]] = [("attn_norm", "ffn_norm"), attention]
    if family.sandwich_norms:
        groups.append(("post_attention_norm", "post_ffw_norm"))
    if arch in ("qwen3", "gemma3"):
        groups.append(("attn_q_norm", "attn_k_norm"))
    if family.moe:
        groups.append(("ffn_down_exps|ffn_down",))
    elif family.model_type == "phi3":
        groups.append(("ffn_up", "ffn_down"))
    else:
        groups.append(("ffn_gate", "ffn_up", "ffn_down"))
    return groups


def check_model(gguf: GGUFFile) -> None:
    """Refuse, in one line naming the key or tensor, a file whose hyper-parameters or tensors
    the family's model cannot run; see the module docstring."""
    family = family_of(gguf)
    arch = gguf.architecture
    _check_names(gguf, family)
    sizes = _sizes(gguf, arch)
    _check_floats(gguf, arch)
    if family.encoder:  # BERT's tensors and norms: encoder_checks.py
        check_encoder(gguf, arch, sizes)
    else:
        _check_blocks(gguf, family, arch, sizes["block_count"])
        _check_widths(gguf, family, arch, sizes)
    if family.moe:
        _check_experts(gguf, family, arch, sizes)
    _check_vocabulary(gguf, arch)


def _check_names(gguf: GGUFFile, family: Family) -> None:
    """Every tensor has a place in the family's model (what loading maps it to)."""
    for name in gguf.tensors:
        if name in NOT_WEIGHTS or (family.moe and is_expert_stack(name)):
            continue
        try:
            hf_name(name, family)
        except CheckpointError as exc:
            raise _fail(gguf, str(exc)) from None


def _fail(gguf: GGUFFile, what: str) -> GGUFFileError:
    return GGUFFileError(f"{gguf.path}: {what}")


def _first(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    """A value that may be written per layer (a list): its first element."""
    value = gguf.metadata(key, default)
    if isinstance(value, list):
        if not value:
            raise _fail(gguf, f"{key} is an empty list")
        return value[0]
    return value


def _positive_int(gguf: GGUFFile, key: str, default: Any = None) -> int | None:
    value = gguf.metadata(key, default)
    for v in value if isinstance(value, list) else [value]:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _fail(gguf, f"{key} is {v!r} (must be a positive whole number)")
    return _first(gguf, key, default)


def _size(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    """A positive whole number the file must hold (or ``default`` where it may leave it out)."""
    value = _positive_int(gguf, key, default)
    if value is None:
        raise _fail(gguf, f"{key} is missing (a positive whole number is needed)")
    return int(value)


def _sizes(gguf: GGUFFile, arch: str) -> dict[str, int]:
    required = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
    sizes: dict[str, int] = {}
    for key in required:
        gguf.metadata(f"{arch}.{key}")  # a missing key: named
        sizes[key] = _size(gguf, f"{arch}.{key}")
    heads, hidden = sizes["attention.head_count"], sizes["embedding_length"]
    kv = _size(gguf, f"{arch}.attention.head_count_kv", heads)
    if heads % kv:
        raise _fail(
            gguf,
            f"{arch}.attention.head_count is {heads}, not a multiple of "
            f"{arch}.attention.head_count_kv {kv}",
        )
    sizes["attention.head_count_kv"] = kv
    head = _positive_int(gguf, f"{arch}.attention.key_length")
    if head is None:
        if hidden % heads:
            raise _fail(
                gguf,
                f"{arch}.embedding_length {hidden} is not a multiple of "
                f"{arch}.attention.head_count {heads} (and no attention.key_length gives the "
                "head size)",
            )
        head = hidden // heads
    sizes["head"] = head
    sizes["value"] = _positive_int(gguf, f"{arch}.attention.value_length") or head
    rotary = _positive_int(gguf, f"{arch}.rope.dimension_count")
    if rotary is not None and (rotary > head or rotary % 2):
        raise _fail(
            gguf, f"{arch}.rope.dimension_count is {rotary} (must be even and at most {head})"
        )
    context = _positive_int(gguf, f"{arch}.context_length")
    if context is not None and context > MAX_CONTEXT:
        raise _fail(
            gguf, f"{arch}.context_length is {context} (at most {MAX_CONTEXT} positions are run)"
        )
    return sizes


def _check_floats(gguf: GGUFFile, arch: str) -> None:
    for key in (
        "rope.freq_base",
        "rope.scaling.factor",
        "attention.layer_norm_rms_epsilon",
        "attention.layer_norm_epsilon",
    ):
        value = gguf.metadata(f"{arch}.{key}", None)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise _fail(gguf, f"{arch}.{key} is {value!r} (must be a finite positive number)")


def _check_blocks(gguf: GGUFFile, family: Family, arch: str, blocks: int) -> None:
    present = {int(name.split(".")[1]) for name in gguf.tensors if _block_index(name)}
    if blocks > len(gguf.tensors):  # cheap bound first: each block needs tensors
        raise _fail(
            gguf,
            f"{arch}.block_count is {blocks}, but the file holds {len(gguf.tensors)} tensors "
            f"(blocks {_span(present)})",
        )
    extra = sorted(i for i in present if i >= blocks)
    if extra:
        raise _fail(
            gguf, f"{arch}.block_count is {blocks}, but the file has tensors of blk.{extra[0]}"
        )
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in gguf.tensors:
            raise _fail(gguf, f"{name} is missing ({arch} needs it)")
    groups = _blocks_of(family, arch)
    for i in range(blocks):
        for group in groups:
            for kinds in group:
                if not any(f"blk.{i}.{k}.weight" in gguf.tensors for k in kinds.split("|")):
                    wanted = "/".join(k.split("|")[-1] for k in group)
                    raise _fail(
                        gguf,
                        f"blk.{i}.{kinds.split('|')[-1]}.weight is missing ({arch} needs "
                        f"{wanted} in every block; {arch}.block_count is {blocks})",
                    )


def _block_index(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()


def _span(present: set[int]) -> str:
    return f"0-{max(present)}" if present else "none"


def _expect(gguf: GGUFFile, name: str, shape: tuple[int, ...], why: str) -> None:
    tensor = gguf.tensors.get(name)
    if tensor is not None and tuple(tensor.shape) != shape:
        raise _fail(gguf, f"{name} has shape {list(tensor.shape)} where {why} make {list(shape)}")


def _check_widths(gguf: GGUFFile, family: Family, arch: str, sizes: dict[str, int]) -> None:
    """Every attention, norm and (dense) MLP tensor as wide as the hyper-parameters say, in
    PyTorch order ``[rows, columns]``: a mismatch is one line here, not a reshape error."""
    hidden, heads = sizes["embedding_length"], sizes["attention.head_count"]
    kv, head, value = sizes["attention.head_count_kv"], sizes["head"], sizes["value"]
    ffn = sizes["feed_forward_length"]
    h = f"{arch}.embedding_length"
    q_why = f"{arch}.attention.head_count {heads} x head size {head} and {h} {hidden}"
    kv_why = f"{arch}.attention.head_count_kv {kv} x head size {head} and {h} {hidden}"
    _expect(gguf, "output_norm.weight", (hidden,), h)
    for i in range(sizes["block_count"]):
        b = f"blk.{i}"
        for norm in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"):
            _expect(gguf, f"{b}.{norm}.weight", (hidden,), h)
        # Per head (Qwen3, Gemma 3), or over the whole projection (OLMoE).
        whole = arch == "olmoe"
        q_norm, k_norm = (heads * head, kv * head) if whole else (head, head)
        _expect(gguf, f"{b}.attn_q_norm.weight", (q_norm,), q_why if whole else f"head {head}")
        _expect(gguf, f"{b}.attn_k_norm.weight", (k_norm,), kv_why if whole else f"head {head}")
        _expect(gguf, f"{b}.attn_q.weight", (heads * head, hidden), q_why)
        _expect(gguf, f"{b}.attn_k.weight", (kv * head, hidden), kv_why)
        _expect(gguf, f"{b}.attn_v.weight", (kv * value, hidden), kv_why)
        _expect(gguf, f"{b}.attn_output.weight", (hidden, heads * value), q_why)
        _expect(gguf, f"{b}.attn_qkv.weight", ((heads + 2 * kv) * head, hidden), q_why)
        if family.moe:
            continue
        f_why = f"{arch}.feed_forward_length {ffn} and {h} {hidden}"
        up_rows = 2 * ffn if family.model_type == "phi3" else ffn
        _expect(gguf, f"{b}.ffn_gate.weight", (ffn, hidden), f_why)
        _expect(gguf, f"{b}.ffn_up.weight", (up_rows, hidden), f_why)
        _expect(gguf, f"{b}.ffn_down.weight", (hidden, ffn), f_why)


def _check_experts(gguf: GGUFFile, family: Family, arch: str, sizes: dict[str, int]) -> None:
    """The expert counts, and every router and expert stack as the hyper-parameters shape it
    (``[experts, rows, columns]``): a routed block with a stack short of an expert or of the
    wrong width is one line here, not an index error in the middle of a forward pass."""
    experts = _size(gguf, f"{arch}.expert_count")
    used = _size(gguf, f"{arch}.expert_used_count")
    if used > experts:
        raise _fail(
            gguf, f"{arch}.expert_used_count is {used}, more than {arch}.expert_count {experts}"
        )
    hidden, h = sizes["embedding_length"], f"{arch}.embedding_length"
    key = f"{arch}.feed_forward_length"
    width: int | None = sizes["feed_forward_length"]
    if not family.experts_sized_by_ffn:
        key = f"{arch}.expert_feed_forward_length"
        width = _positive_int(gguf, key)
        first = next(
            (t for n, t in gguf.tensors.items() if n.endswith(".ffn_gate_exps.weight")), None
        )
        if width is None and first is not None and len(first.shape) == 3:
            key, width = "the first ffn_gate_exps stack's rows", int(first.shape[1])
    why = f"{arch}.expert_count {experts}, {key} {width} and {h} {hidden}"
    r_why = f"{arch}.expert_count {experts} and {h} {hidden}"
    for i in range(sizes["block_count"]):
        b = f"blk.{i}"
        if f"{b}.ffn_gate_inp.weight" not in gguf.tensors:
            continue  # a dense block (Qwen-MoE's mlp_only_layers; config.py refuses the rest)
        _check_routed_block(gguf, b, arch, (experts, width, hidden), why)
        _expect(gguf, f"{b}.ffn_gate_inp.weight", (experts, hidden), r_why)
    shared = _positive_int(gguf, f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        s_why = f"{arch}.expert_shared_feed_forward_length {shared} and {h} {hidden}"
        for i in range(sizes["block_count"]):
            for kind, shape in (("gate", (shared, hidden)), ("up", (shared, hidden))):
                _expect(gguf, f"blk.{i}.ffn_{kind}_shexp.weight", shape, s_why)
            _expect(gguf, f"blk.{i}.ffn_down_shexp.weight", (hidden, shared), s_why)


def _check_routed_block(
    gguf: GGUFFile, b: str, arch: str, dims: tuple[int, int | None, int], why: str
) -> None:
    """A routed block's three stacks: present, each holding every expert, each as wide as the
    experts are. (One tensor per expert, llama.cpp's early-2024 layout, is refused by name.)"""
    experts, width, hidden = dims
    for proj in ("gate", "up", "down"):
        name = f"{b}.ffn_{proj}_exps.weight"
        stack = gguf.tensors.get(name)
        if stack is None:
            raise _fail(
                gguf,
                f"{name} is missing ({b}.ffn_gate_inp.weight routes to experts; {arch} needs "
                "ffn_gate_exps/ffn_up_exps/ffn_down_exps there)",
            )
        if len(stack.shape) != 3:
            raise _fail(
                gguf, f"{name} has shape {list(stack.shape)} (a stack is [experts, rows, columns])"
            )
        if stack.shape[0] != experts:
            raise _fail(
                gguf,
                f"{name} stacks {stack.shape[0]} experts where {arch}.expert_count says {experts}",
            )
        if width is not None:
            rows, cols = (hidden, width) if proj == "down" else (width, hidden)
            _expect(gguf, name, (experts, rows, cols), why)


def _check_vocabulary(gguf: GGUFFile, arch: str) -> None:
    """One vocabulary size across the token list, the embedding table, the head and
    ``<arch>.vocab_size``; special token ids inside it."""
    hidden = int(_first(gguf, f"{arch}.embedding_length"))
    embed = gguf.tensors["token_embd.weight"]
    if len(embed.shape) != 2 or embed.shape[1] != hidden:
        raise _fail(
            gguf,
            f"token_embd.weight has shape {list(embed.shape)} where {arch}.embedding_length "
            f"{hidden} makes [vocabulary, {hidden}]",
        )
    rows = embed.shape[0]
    sources = {"token_embd.weight rows": rows}
    head = gguf.tensors.get("output.weight")
    if head is not None and tuple(head.shape) != (rows, hidden):
        raise _fail(
            gguf,
            f"output.weight has shape {list(head.shape)} where token_embd.weight makes "
            f"{[rows, hidden]}",
        )
    tokens = gguf.array_length("tokenizer.ggml.tokens")
    if tokens is not None:
        sources["tokenizer.ggml.tokens"] = tokens
    declared = gguf.metadata(f"{arch}.vocab_size", None)
    if declared is not None:
        sources[f"{arch}.vocab_size"] = declared
    if len(set(sources.values())) > 1:
        found = ", ".join(f"{k} {v}" for k, v in sources.items())
        raise _fail(gguf, f"the vocabulary sizes differ ({found}; they must be equal)")
    for kind in ("scores", "token_type"):
        n = gguf.array_length(f"tokenizer.ggml.{kind}")
        if n is not None and tokens is not None and n != tokens:
            raise _fail(
                gguf, f"tokenizer.ggml.{kind} has {n} entries, tokenizer.ggml.tokens {tokens}"
            )
    for special in _SPECIAL_TOKENS:
        key = f"tokenizer.ggml.{special}_token_id"
        value = gguf.metadata(key, None)
        if value is not None and (not isinstance(value, int) or not 0 <= value < rows):
            raise _fail(gguf, f"{key} is {value!r}, outside the vocabulary of {rows} tokens")


def check_tokenizer(gguf: GGUFFile) -> None:
    """Every merge joins two tokens of the list into a third (a BPE vocabulary's rule, which
    the tokenizers library enforces with its own exception)."""
    if not gguf.has("tokenizer.ggml.merges") or not gguf.has("tokenizer.ggml.tokens"):
        return
    tokens = gguf.metadata("tokenizer.ggml.tokens")
    merges = gguf.metadata("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise _fail(gguf, "tokenizer.ggml.tokens is not a list of strings")
    if not isinstance(merges, list):
        raise _fail(gguf, "tokenizer.ggml.merges is not a list of strings")
    known = set(tokens)
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise _fail(gguf, f"tokenizer.ggml.merges entry {i} is {merge!r} (must be 'a b')")
        for token in (*parts, "".join(parts)):
            if token not in known:
                raise _fail(
                    gguf,
                    f"tokenizer.ggml.merges entry {i} ({merge!r}) needs {token!r}, which "
                    f"tokenizer.ggml.tokens ({len(tokens)} tokens) lacks",
                )


def cap_context(gguf: GGUFFile, config: Any) -> None:
    """``config.max_position_embeddings`` capped (with a log line) at the positions whose
    rotary table (float32 cos and sin per position, sized at start-up) fits in a
    ``1/_ROTARY_TABLE_SHARE`` share of the host's memory: 2^40 positions asked for 8 TB."""
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int):
        return
    heads = int(config.num_attention_heads)
    rotary = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    config.max_position_embeddings = _capped(gguf, context, rotary)


def _capped(gguf: GGUFFile, context: int, rotary_dim: int) -> int:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 1 << 36
    cap = max(1, memory // _ROTARY_TABLE_SHARE // (8 * max(rotary_dim, 1)))
    if context > cap:
        logger.warning(
            "%s: %s.context_length %d is more than this host can hold a rotary table for; "
            "capped at %d positions",
            gguf.path.name,
            gguf.architecture,
            context,
            cap,
        )
        return cap
    return context
