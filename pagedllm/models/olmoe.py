"""OLMoE: Llama-shaped attention whose q and k get an RMSNorm over the whole projection (not per
head), optional ``clip_qkv`` clamping, and 64-expert top-8 routing (renormalised only when
``norm_topk_prob``, weights rounded to the activations' dtype).

Under tensor parallelism a rank holds a slice of q and k, so the norm's mean of squares is
completed with an all-reduce of the partial sums before scaling.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.backends.base import AttentionMetadata
from pagedllm.layers.linear import with_loader
from pagedllm.layers.parallel import TPContext
from pagedllm.models.llama import LlamaAttention
from pagedllm.models.moe_base import MoeForCausalLM


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector split across ranks: this rank's ``shard`` of ``full`` features."""

    def __init__(self, full: int, shard: int, eps: float, tp: TPContext) -> None:
        super().__init__()
        self.full, self.shard, self.eps, self.tp = full, shard, eps, tp
        self.weight = with_loader(
            nn.Parameter(torch.ones(shard), requires_grad=False), self.load_weight
        )

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.full:
            raise ValueError(f"norm weight has {loaded.shape[0]} features, expected {self.full}")
        param.data.copy_(loaded.narrow(0, self.tp.rank * self.shard, self.shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, shard]
        xf = x.float()
        sq = xf.pow(2).sum(-1, keepdim=True)  # [T, 1]
        if self.tp.size > 1:
            sq = self.tp.all_reduce(sq.contiguous())
        xf = xf * torch.rsqrt(sq / self.full + self.eps)
        return self.weight * xf.to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["qkv_bias"] = bool(getattr(config, "attention_bias", False))
        super().__init__(config, *args, **kwargs)
        tp: TPContext = kwargs["tp"]
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if tp.size > 1 and kv_heads % tp.size:
            raise ValueError(
                f"tensor_parallel_size: OLMoE's k norm spans all {kv_heads} "
                f"num_key_value_heads, which must divide by {tp.size}"
            )
        head = config.hidden_size // heads
        if self.head_size != head:
            raise ValueError(f"head_dim: OLMoE derives it as hidden_size // heads ({head})")
        eps = config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(heads * head, self.num_heads * head, eps, tp)
        self.k_norm = ShardedRMSNorm(kv_heads * head, self.num_kv_heads * head, eps, tp)
        self.clip = getattr(config, "clip_qkv", None)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k = self.rotary(
            positions,
            q.reshape(n, self.num_heads, self.head_size),
            k.reshape(n, self.num_kv_heads, self.head_size),
        )
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, kv_cache, meta)
        return self.o_proj(out)


class OlmoeForCausalLM(MoeForCausalLM):
    attention_cls = OlmoeAttention
    moe_intermediate_field = "intermediate_size"
