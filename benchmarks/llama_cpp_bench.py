"""llama.cpp on the same weights, for the throughput benchmark's side-by-side comparison.

Two parts, both optional (the benchmark reports "not installed" without them):

* :func:`export_gguf` writes a Hugging Face Llama folder as a GGUF file (``f16`` or ``q8_0``)
  with the ``gguf`` package. The benchmark feeds token ids, so the file carries no vocabulary
  (``tokenizer.ggml.model = "none"``). Q and K projections are permuted from Hugging Face's
  half-split rotary layout to GGML's interleaved one, as llama.cpp's own converter does, so the
  model computes the same function.
* :func:`run_llama_cpp` generates greedily for every request with llama-cpp-python's low-level
  API: prompts are prefilled in batches, then all running sequences decode together, one
  ``llama_decode`` per step with one sequence id each (llama.cpp's "parallel sequences").

    pip install llama-cpp-python gguf    # builds llama.cpp from source: several minutes
"""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class RequestLike(Protocol):
    prompt: list[int]
    output_len: int


def available() -> str | None:
    """None when both packages import, else what is missing."""
    missing = []
    for name in ("llama_cpp", "gguf"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return f"not installed: {', '.join(missing)}" if missing else None


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's rotate-half rows -> GGML's interleaved pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")  # model.layers.<i>.<rest>
    return f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:])]}"


_QUANTS = {
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}


def export_gguf(folder: Path, out: Path, quant: str) -> Path:
    """Write ``folder`` (a Llama checkpoint) as GGUF ``quant`` ("f16" | "q8_0" | "q4_0", by the
    ``gguf`` package's own quantiser); cached."""
    import gguf
    from safetensors import safe_open

    if out.exists():
        return out
    cfg = json.loads((folder / "config.json").read_text())
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("none")
    type_name, file_type = _QUANTS[quant]
    writer.add_file_type(gguf.LlamaFileType[file_type])
    qtype = gguf.GGMLQuantizationType[type_name]
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                w = f.get_tensor(name).float().numpy()
                if name.endswith("q_proj.weight"):
                    w = _unpermute_rotary(w, n_heads)
                elif name.endswith("k_proj.weight"):
                    w = _unpermute_rotary(w, n_kv)
                if w.ndim == 1:  # norms stay float32, as llama.cpp's converter keeps them
                    writer.add_tensor(_gguf_name(name), w.astype(np.float32))
                    continue
                data = gguf.quants.quantize(w, qtype)
                writer.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


class _Batch:
    """A llama_batch with a Python-side fill helper."""

    def __init__(self, lib: Any, capacity: int, n_seq_max: int) -> None:
        self.lib, self.capacity = lib, capacity
        self.raw = lib.llama_batch_init(capacity, 0, n_seq_max)

    def fill(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence id, wants logits)."""
        b = self.raw
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(items)

    def free(self) -> None:
        self.lib.llama_batch_free(self.raw)


def _argmax(lib: Any, ctx: Any, index: int, n_vocab: int) -> int:
    ptr = lib.llama_get_logits_ith(ctx, index)
    return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())


def run_llama_cpp(
    gguf_path: Path, reqs: list[RequestLike], *, n_parallel: int, threads: int
) -> dict[str, Any]:
    """Greedy generation of every request, ``n_parallel`` sequences decoding together."""
    import llama_cpp as lib

    lib.llama_log_set(ctypes.cast(None, lib.llama_log_callback), ctypes.c_void_p())
    lib.llama_backend_init()
    load_start = time.perf_counter()
    model = lib.llama_model_load_from_file(
        str(gguf_path).encode(), lib.llama_model_default_params()
    )
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    load_seconds = time.perf_counter() - load_start
    per_seq = max(len(r.prompt) + r.output_len for r in reqs)
    params = lib.llama_context_default_params()
    params.n_ctx = per_seq * n_parallel
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = n_parallel
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = _Batch(lib, 512, n_parallel)
    try:
        start = time.perf_counter()
        produced = _generate(lib, ctx, batch, reqs, n_parallel, n_vocab)
        seconds = time.perf_counter() - start
    finally:
        batch.free()
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    assert produced == sum(r.output_len for r in reqs)
    return {"seconds": seconds, "load_seconds": load_seconds, "n_parallel": n_parallel}


def _generate(
    lib: Any, ctx: Any, batch: _Batch, reqs: list[RequestLike], n_parallel: int, n_vocab: int
) -> int:
    """Continuous batching as llama.cpp's server does it: every step decodes one token of each
    running slot and fills the rest of the batch with prompt tokens of slots still prefilling; a
    finished slot takes the next request."""
    pending = list(range(len(reqs)))[::-1]
    slots: dict[int, _Slot] = {}
    mem = lib.llama_get_memory(ctx)
    produced = 0
    while pending or slots:
        for slot in range(n_parallel):
            if slot not in slots and pending:
                lib.llama_memory_seq_rm(mem, slot, -1, -1)
                slots[slot] = _Slot(reqs[pending.pop()])
        items: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []
        for s, st in sorted(slots.items()):
            if st.made:
                items.append((st.last, st.pos, s, True))
                owners.append(s)
        for s, st in sorted(slots.items()):
            room = batch.capacity - len(items)
            if st.made or room <= 0:
                continue
            chunk = st.prompt[st.pos : st.pos + room]
            for j, t in enumerate(chunk):
                final = st.pos + j == len(st.prompt) - 1
                items.append((t, st.pos + j, s, final))
                if final:
                    owners.append(s)
            st.pos += len(chunk)
        batch.fill(items)
        if lib.llama_decode(ctx, batch.raw) != 0:
            raise RuntimeError("llama_decode failed")
        logit_rows = [i for i, item in enumerate(items) if item[3]]
        for row, s in zip(logit_rows, owners, strict=True):
            st = slots[s]
            if st.made:
                st.pos += 1
            st.last = _argmax(lib, ctx, row, n_vocab)
            st.made += 1
            produced += 1
            if st.made >= st.output_len:
                del slots[s]
    return produced


class _Slot:
    def __init__(self, req: RequestLike) -> None:
        self.prompt, self.output_len = req.prompt, req.output_len
        self.pos = 0  # prompt tokens fed so far, then the next position to decode at
        self.last = 0
        self.made = 0
