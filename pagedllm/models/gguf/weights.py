"""A GGUF file's tensors as the named checkpoint tensors our models load.

Each tensor gets its Hugging Face name (:mod:`.names`); what it becomes depends on the layer's
plan (:mod:`.plan`): the arrays of a group-wise format where the layer stays quantised (decoded
by the device's kernel, else by the numpy definitions of :mod:`.blocks`), else dequantised by
ggml's own ``gguf.quants`` to float32 here and rounded to the compute dtype as it is copied in.
Expert stacks stream one expert (or one decoded stack) at a time. llama.cpp's converter
interleaves the q/k rows of Llama-family models for its rotary kernel; the rows are put back (a
row permutation, so it applies to quantised rows too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from pagedllm.models.gguf.blocks import (
    dequantized,
    int4_groups,
    int8_groups,
    q5_k_groups,
    q6_k_groups,
)
from pagedllm.models.gguf.config import Family
from pagedllm.models.gguf.names import (
    BLOCK_NAME,
    EXPERT_STACKS,
    NOT_WEIGHTS,
    hf_name,
    is_expert_stack,
)
from pagedllm.models.gguf.plan import KEPT_AS, STACK_OF, LayerFormat, tensor_format
from pagedllm.models.gguf.reader import GGUFFile, GGUFTensor
from pagedllm.models.safetensors_reader import CheckpointError

# A device backend's kernel for int4_groups, int8_groups and q6_k_groups: (blocks uint8
# [N, row bytes], type name) -> their arrays as torch tensors, bit for bit.
BlockDecoder = Callable[[torch.Tensor, str], tuple[torch.Tensor, ...]]


def _read_interleaved(gate: GGUFTensor, up: GGUFTensor) -> np.ndarray:
    """Raw blocks ``[E, 2I, row bytes]``: each expert's gate rows, then its up rows, read from
    the file straight into place (a concatenation would be one more round of fresh memory)."""
    experts, rows = gate.shape[0], gate.shape[1]
    if gate.path is None or up.path is None:  # in-memory tensors
        pair = (gate.read().reshape(experts, rows, -1), up.read().reshape(experts, rows, -1))
        return np.concatenate(pair, axis=1)
    row_bytes = gate.raw.nbytes // (experts * rows)
    out = np.empty((experts, 2 * rows, row_bytes), dtype=np.uint8)
    with gate.path.open("rb", buffering=0) as f:
        for half, t in enumerate((gate, up)):
            for e in range(experts):
                t.read_into(f, e * rows * row_bytes, out[e, half * rows : (half + 1) * rows])
    return out


# What ``_decoded`` returns per format: the q (``.weight``) and its factors, by name suffix.
_GROUPWISE_SUFFIXES = {
    "int4": ("", "_scale", "_offset"),
    "q5_k": ("", "_scale", "_offset"),
    "q8_0": ("", "_scale"),
    "q6_k": ("", "_scale", "_super"),
}


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave: within each head, rows ``2i`` and ``2i+1`` go back
    to ``i`` and ``i + head_dim/2`` (the Hugging Face "rotate half" order)."""
    rows = t.shape[0]
    half = rows // heads // 2
    return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class GGUFWeights:
    """Iterates a GGUF file's tensors as (Hugging Face name, tensor) for ``load_weights``."""

    def __init__(
        self,
        gguf: GGUFFile,
        family: Family,
        hf_config: object,
        plan: dict[str, LayerFormat],
        *,
        block_decoder: BlockDecoder | None = None,
        expert_plan: dict[str, str] | None = None,
    ):
        self.gguf, self.family, self.plan = gguf, family, plan
        self.expert_plan = expert_plan or {}
        self.block_decoder = block_decoder
        # Checkpoint layers (names without ".weight") whose group-wise tensors are skipped,
        # neither decoded nor yielded: their packed form comes from a backend's cache
        # (``model_loader.leave_unread``).
        self.unread: Callable[[str], bool] | None = None
        self.heads = int(hf_config.num_attention_heads)  # type: ignore[attr-defined]
        self.kv_heads = int(hf_config.num_key_value_heads)  # type: ignore[attr-defined]

    def _permute(self, gguf_name: str, t: torch.Tensor) -> torch.Tensor:
        if not self.family.permuted_qk:
            return t
        if ".attn_q." in gguf_name:
            return unpermute_rows(t, self.heads)
        if ".attn_k." in gguf_name:
            return unpermute_rows(t, self.kv_heads)
        return t

    def _decoded(self, tensor: GGUFTensor) -> tuple[torch.Tensor, ...]:
        """``int4_groups``, ``int8_groups`` or ``q6_k_groups`` of ``tensor``, by the device's
        kernel if any (Q8_0 too: numpy's strided copy of its q and scales was a third of a 1B
        Q8_0 file's start-up on a Xeon, the threaded pass a tenth of that)."""
        kind = tensor.type_name
        numpy_definition = {
            "int4": int4_groups,
            "q8_0": int8_groups,
            "q6_k": q6_k_groups,
            "q5_k": q5_k_groups,
        }[KEPT_AS[kind]]
        if self.block_decoder is None:
            return tuple(torch.from_numpy(a) for a in numpy_definition(tensor))
        rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
        blocks = torch.from_numpy(tensor.read().view(np.uint8).reshape(rows, -1))
        return self.block_decoder(blocks, tensor.type_name)

    def _experts(self, gguf_name: str, tensor: GGUFTensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A stack ``[E, N, K]`` as each expert's ``[N, K]`` under its Hugging Face name: its
        group-wise tensors where the plan keeps the stack quantised, else dequantised, one
        expert at a time (a whole stack in float32 would be ~4-8x its bytes)."""
        from gguf.quants import dequantize

        match = BLOCK_NAME.match(gguf_name)
        assert match is not None
        layer, kind, _ = match.groups()
        fmt = self.expert_plan.get(f"layers.{layer}.mlp.experts.{STACK_OF[kind]}")
        if len(tensor.shape) != 3:
            raise CheckpointError(
                f"{self.gguf.path}: tensor {gguf_name!r} has shape {list(tensor.shape)}; "
                "an expert stack is [experts, rows, columns]"
            )
        experts, rows, cols = (int(d) for d in tensor.shape)
        if fmt is not None:
            if kind == "ffn_up_exps":
                return  # decoded with its gate stack, into one [E, 2I, ...] stack
            yield from self._groupwise_stack(gguf_name, tensor, fmt, layer, kind)
            return
        raw = tensor.read().reshape(experts, rows, -1)
        for e in range(experts):
            values = np.asarray(dequantize(raw[e], tensor.qtype), dtype=np.float32)
            stem = f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_STACKS[kind]}"
            yield f"{stem}.weight", torch.from_numpy(values.reshape(rows, cols))

    def _groupwise_stack(
        self, gguf_name: str, tensor: GGUFTensor, fmt: str, layer: str, kind: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A group-wise stack decoded in one pass as the whole ``FusedMoE`` stack: down as it
        is, gate with its up stack (``[E, 2I]`` rows). The decoder's output then becomes the
        parameter: no per-expert copies into a second stack (each round of fresh memory cost
        ~1 ms a MB on first touch on these hosts)."""
        experts, rows, cols = (int(d) for d in tensor.shape)

        def decoded(t: GGUFTensor) -> list[torch.Tensor]:
            raw = t.read().reshape(experts * rows, -1)
            whole = GGUFTensor(t.name, t.type_name, (experts * rows, cols), raw, t.qtype)
            return [a.reshape(experts, rows, -1) for a in self._decoded(whole)]

        stack = "w2_weight"
        if kind == "ffn_gate_exps":
            up = self.gguf.tensors.get(gguf_name.replace("ffn_gate_exps", "ffn_up_exps"))
            if up is None or up.shape != tensor.shape:
                raise CheckpointError(
                    f"{self.gguf.path}: {gguf_name!r} has no ffn_up_exps stack of its shape"
                )
            stack = "w13_weight"
            if up.type_name == tensor.type_name:  # one pass over both stacks' blocks
                raw = _read_interleaved(tensor, up)
                both = GGUFTensor(gguf_name, tensor.type_name, (2 * rows, cols), raw, tensor.qtype)
                rows *= 2
                arrays = decoded(both)
            else:  # two types of one format (Q4_0 gate, Q4_1 up): decoded apart, then joined
                arrays = [
                    torch.cat(p, dim=1) for p in zip(decoded(tensor), decoded(up), strict=True)
                ]
        else:
            arrays = decoded(tensor)
        for suffix, array in zip(_GROUPWISE_SUFFIXES[fmt], arrays, strict=True):
            yield f"model.layers.{layer}.mlp.experts.{stack}{suffix}", array

    def _groupwise(
        self, stem: str, fmt: str, tensor: GGUFTensor, gguf_name: str = ""
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A tensor kept in group-wise format ``fmt``: its q (``.weight``) and factors."""
        arrays = self._decoded(tensor)
        for suffix, array in zip(_GROUPWISE_SUFFIXES[fmt], arrays, strict=True):
            yield f"{stem}.weight{suffix}", self._permute(gguf_name, array)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gguf_name, tensor in self.gguf.tensors.items():
            if gguf_name in NOT_WEIGHTS:
                continue
            if self.family.moe and is_expert_stack(gguf_name):
                yield from self._experts(gguf_name, tensor)
                continue
            name, module = hf_name(gguf_name, self.family)
            fmt = tensor_format(self.plan, gguf_name, module)
            if fmt is not None and name.endswith(".weight"):
                stem = name.removesuffix(".weight")
                if self.unread is None or not self.unread(stem):
                    yield from self._groupwise(stem, fmt, tensor, gguf_name)
                continue
            values = torch.from_numpy(dequantized(tensor))
            if gguf_name.endswith(".ffn_gate_inp_shexp.weight"):
                values = values.reshape(1, -1)  # a vector in the file, a [1, H] layer here
            if self.family.norm_plus_one and name.endswith("norm.weight"):
                values = values - 1.0
            yield name, self._permute(gguf_name, values).contiguous()
