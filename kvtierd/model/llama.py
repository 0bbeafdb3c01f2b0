"""The Llama-family forward pass over a paged KV cache.

Tokens of all sequences in a step are flattened into one `[num_tokens]` batch;
attention is the only place that knows about sequences, through `PagedBatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtierd.kernels.backend import select_backend
from kvtierd.kernels.cpu_int4_matmul import cpu_int4_matmul_kernel
from kvtierd.kernels.cpu_rms_norm import CpuRmsNorm, cpu_rms_norm_kernel
from kvtierd.kernels.cpu_rope_kv import cpu_rope_kv_kernel
from kvtierd.kernels.paged_batch import PagedBatch
from kvtierd.model.config import ModelConfig
from kvtierd.model.packed_matrix import PackedMatrix, can_pack
from kvtierd.model.quantized import TORCH_INT4_MAX_ROWS, QuantizedLinear
from kvtierd.model.rope import RotaryEmbedding
from kvtierd.model.weight_modes import WeightMode
from kvtierd.model.weights import Matrix, ModelWeights, packed_for_cpu, with_tile_kernel

# Steps of at most this many tokens run the quantized kernels; larger ones the dense copies
# (quantized.py). Measured over the bundled model's matrices: torch's int4 kernel adds ~2 ms a row, and
# from about 6 rows the packed bf16 GEMM (packed_matrix.py), flat to a few dozen rows, is faster.
QUANTIZED_MAX_TOKENS = 4
# A quantized LM head's logits are approximate; this many of each row's largest are recomputed from its
# float32 rows, so the tokens sampling can pick (greedy, top-k/top-p) are ranked exactly: an 8-bit head's
# rounding moved near-ties (bench quality, int4: top-1 96.3% -> 97.9%, KL 0.0024 -> 0.0010).
REFINED_TOP_K = 64


def top_k_indices(x: torch.Tensor, k: int, block: int = 128) -> torch.Tensor:
    """The indices of each row's k largest values (in no order), as `x.topk(k).indices`, in two levels:
    the k blocks of `block` values with the largest maxima hold the k largest values (a value in any other
    block has k block maxima at least as large), so only they are searched. torch's topk over a 49,152-token
    vocabulary is ~1.6x slower than block maxima plus a topk over k blocks."""
    n, width = x.shape
    if width % block or width // block < 2 * k:
        return x.topk(k, dim=-1, sorted=False).indices
    blocks = x.view(n, width // block, block)
    best = blocks.amax(dim=-1).topk(k, dim=-1, sorted=False).indices  # [n, k]
    candidates = blocks.gather(1, best.unsqueeze(-1).expand(n, k, block)).view(n, k * block)
    within = candidates.topk(k, dim=-1, sorted=False).indices
    return best.gather(1, within // block) * block + within % block


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
             kernel: CpuRmsNorm | None = None) -> torch.Tensor:
    """The float32 residual stream normed (float32 weights, as transformers does), handed to the matrices in
    the compute dtype: by `kernel` in one call where given (bfloat16 on a CPU), else by torch's ops."""
    if kernel is not None and dtype == torch.bfloat16:
        return kernel(h, weight, eps)
    x = F.rms_norm(h, weight.shape, weight, eps)
    return x if x.dtype == dtype else x.to(dtype)


def linear(x: torch.Tensor, w: Matrix, quantized: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, QuantizedLinear):
        y = w.matmul(x, quantized)
        return y if bias is None else y.add_(bias)
    if isinstance(w, PackedMatrix):
        return w.matmul(x, bias)
    return F.linear(x, w, bias)


def linear_add(h: torch.Tensor, x: torch.Tensor, w: Matrix, quantized: bool) -> torch.Tensor:
    """`h + x @ w.T` into the float32 residual stream `h`. Float32 weights: the add is folded into the
    GEMM (beta=1), one pass over h fewer."""
    if isinstance(w, QuantizedLinear):
        return h.add_(w.matmul(x, quantized))
    if isinstance(w, PackedMatrix):
        return h.add_(w.matmul(x))
    if w.dtype == h.dtype:
        return torch.addmm(h, x, w.t())
    return h.add_(F.linear(x, w))


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, mode: WeightMode,
                 kv_dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.mode = mode
        self.dtype = mode.compute_dtype  # activations
        self.weights = packed_for_cpu(weights) if can_pack(device, self.dtype) else weights
        self.kv_dtype = kv_dtype
        self.quantized_max_tokens = QUANTIZED_MAX_TOKENS
        self.matmul_backend = "torch"  # reported by `kvtierctl status`
        # The step sizes (tokens) past which other kernels run: the step cost model fits each span apart.
        self.step_regimes: tuple[int, ...] = (QUANTIZED_MAX_TOKENS,) if mode.quantization else ()
        tile_kernel = cpu_int4_matmul_kernel() if device.type == "cpu" and mode.quantization == "int4" else None
        if tile_kernel is not None:
            self.weights = with_tile_kernel(self.weights, tile_kernel)
            # int4 steps up to the kernel's rows read 4-bit weights (cpu_int4_matmul.py)
            self.quantized_max_tokens = tile_kernel.max_rows
            self.matmul_backend = f"cpu-int4-{tile_kernel.isa}"
            self.step_regimes = (TORCH_INT4_MAX_ROWS, tile_kernel.max_rows)
        # 16-bit modes on a CPU: each norm and its cast in one C call (cpu_rms_norm.py), and a layer's rotary
        # embedding and KV write in another (cpu_rope_kv.py)
        cpu_16_bit = device.type == "cpu" and self.dtype == kv_dtype == torch.bfloat16
        self.norm_kernel = cpu_rms_norm_kernel() if cpu_16_bit else None
        self.rope_kv = cpu_rope_kv_kernel() if cpu_16_bit else None
        self.rope = RotaryEmbedding(config, device, self.dtype)
        self.attention = select_backend(device, self.dtype, kv_dtype, config.head_dim)
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
        """Returns the final hidden states `[num_tokens, hidden]` float32 (normed, before the LM head)."""
        h = self.embed(input_ids)
        h = self.run_layers(h, positions, kv_caches, batch, range(self.config.num_layers))
        return self.final_norm(h)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream `[num_tokens, hidden]` of these tokens before the first layer. It stays float32 in
        every mode: rounding it to 16 bits after each of the 60 adds is what moved near-tie tokens (bench
        quality: bfloat16 top-1 97.9% -> 98.9% with it in float32)."""
        return F.embedding(input_ids, self.weights.embed).float()

    @torch.inference_mode()
    def run_layers(
        self,
        h: torch.Tensor,  # [num_tokens, hidden] float32: the residual stream entering layers[0]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) pools, all of them
        batch: PagedBatch,
        layers: range,
    ) -> torch.Tensor:
        """The residual stream after `layers` (consecutive), each writing its K/V of the batch's tokens."""
        c = self.config
        attn_backend = self.attention
        plan = attn_backend.build_plan(batch)
        cos, signed_sin = self.rope.tables(positions)
        num_qk_heads = c.num_heads + c.num_kv_heads
        quantized = h.shape[0] <= self.quantized_max_tokens
        for i in layers:
            layer, (k_cache, v_cache) = self.weights.layers[i], kv_caches[i]
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps, self.dtype, self.norm_kernel)
            qkv = linear(x, layer.qkv, quantized, layer.qkv_bias)
            if self.rope_kv is not None:  # rotated in place, k and v written to the cache: one call
                self.rope_kv(qkv, cos, signed_sin, batch.slot_mapping, k_cache, v_cache, c.num_heads)
                q = qkv[:, : self._q_size].view(-1, c.num_heads, c.head_dim)
            else:
                qk, v = qkv.split([self._q_size + self._kv_size, self._kv_size], dim=-1)
                # q and k heads sit side by side in qkv: one rotation covers both.
                qk = self.rope.apply(qk.view(-1, num_qk_heads, c.head_dim), cos, signed_sin)
                q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
                attn_backend.write_kv(k_cache, v_cache, k, v.view(-1, c.num_kv_heads, c.head_dim),
                                      batch.slot_mapping)
            attn = attn_backend.paged_attention(plan, q, k_cache, v_cache, self.scale)
            h = linear_add(h, attn.view(-1, self._q_size), layer.o, quantized)
            x = rms_norm(h, layer.ffn_norm, c.rms_norm_eps, self.dtype, self.norm_kernel)
            gate, up = linear(x, layer.gate_up, quantized).chunk(2, dim=-1)
            h = linear_add(h, F.silu(gate, inplace=True).mul_(up), layer.down, quantized)
        return h

    @torch.inference_mode()
    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.weights.final_norm, self.config.rms_norm_eps, torch.float32)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` float32 `-> [n, vocab]` float32."""
        logits = linear(hidden.to(self.dtype), self.weights.lm_head, hidden.shape[0] <= self.quantized_max_tokens)
        logits = logits.float()
        exact = self.weights.lm_head_exact
        if exact is None:
            return logits
        top = top_k_indices(logits, min(REFINED_TOP_K, logits.shape[-1]))  # [n, k]
        rows = exact.index_select(0, top.flatten()).view(*top.shape, -1)  # [n, k, hidden]
        return logits.scatter_(-1, top, torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1))
