"""The Llama-family forward pass over a paged KV cache.

Tokens of all sequences in a step are flattened into one `[num_tokens]` batch;
attention is the only place that knows about sequences, through `PagedBatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtierd.kernels.backend import select_backend
from kvtierd.kernels.paged_batch import PagedBatch
from kvtierd.model.config import ModelConfig
from kvtierd.model.rope import RotaryEmbedding
from kvtierd.model.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised in float32 whatever the weights' dtype, as transformers does;
    # one fused op in float32, which matters at batch 1 where op count is the cost.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.rope = RotaryEmbedding(config, device, dtype)
        self.attention = select_backend(device)
        self.scale = config.head_dim**-0.5
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) pools
        batch: PagedBatch,
    ) -> torch.Tensor:
        """Returns the final hidden states `[num_tokens, hidden]` (normed, before the LM head)."""
        c = self.config
        attn_backend = self.attention
        plan = attn_backend.build_plan(batch)
        cos, sin = self.rope.tables(positions)
        h = F.embedding(input_ids, self.weights.embed)
        num_qk_heads = c.num_heads + c.num_kv_heads
        for layer, (k_cache, v_cache) in zip(self.weights.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            qk, v = qkv.split([self._q_size + self._kv_size, self._kv_size], dim=-1)
            # q and k heads sit side by side in qkv: one rotation covers both.
            qk = self.rope.apply(qk.view(-1, num_qk_heads, c.head_dim), cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            attn_backend.write_kv(k_cache, v_cache, k, v.view(-1, c.num_kv_heads, c.head_dim), batch.slot_mapping)
            attn = attn_backend.paged_attention(plan, q, k_cache, v_cache, self.scale)
            # Residual adds folded into the GEMMs (beta=1): one pass over h fewer per projection.
            h = torch.addmm(h, attn.view(-1, self._q_size), layer.o.t())
            x = rms_norm(h, layer.ffn_norm, c.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = torch.addmm(h, F.silu(gate, inplace=True).mul_(up), layer.down.t())
        return rms_norm(h, self.weights.final_norm, c.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden] -> [n, vocab]` in float32."""
        return F.linear(hidden, self.weights.lm_head).float()
