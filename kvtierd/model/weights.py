"""Weights of a Llama-family model in the layout the forward uses.

Linear weights are `[out_features, in_features]` as in `torch.nn.functional.linear`.
q, k and v are fused into one matrix, and gate and up into another, so that a
decode step streams each layer's weights in two large reads instead of five.
In a quantized mode (weight_modes.py) each matrix is a `QuantizedLinear` instead. On a CPU with
bfloat16 kernels, the model runs its bfloat16 matrices packed (`packed_for_cpu`, packed_matrix.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from kvtierd.kernels.cpu_int4_matmul import CpuInt4Matmul, fits, tile_codes
from kvtierd.model.packed_matrix import PackedMatrix, pack
from kvtierd.model.quantized import QuantizedLinear

Matrix = torch.Tensor | QuantizedLinear | PackedMatrix


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: Matrix  # [hidden, heads * head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [2 * intermediate, hidden]
    down: Matrix  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Matrix  # [vocab, hidden]; the same tensor as embed when tied (dense modes)
    # Quantized modes: the float32 LM head the top logits are recomputed from (llama.py); embed when tied.
    lm_head_exact: torch.Tensor | None = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, a quantized matrix's parts apart (a tied head under both names)."""
        out: dict[str, torch.Tensor] = {}

        def add(name: str, t: Matrix | None) -> None:
            if isinstance(t, QuantizedLinear):
                out.update({f"{name}.packed": t.packed, f"{name}.scales": t.scales, f"{name}.dense": plain(t.dense)})
            elif t is not None:
                out[name] = plain(t)

        for name in ("embed", "final_norm", "lm_head", "lm_head_exact"):
            add(name, getattr(self, name))
        for i, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                add(f"layers.{i}.{f.name}", getattr(layer, f.name))
        return out

    def num_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step reads: every matrix once, one embedding row."""
        total = _bytes_read(self.lm_head) + self.embed.shape[1] * self.embed.element_size()
        for layer in self.layers:
            for t in (layer.attn_norm, layer.qkv, layer.qkv_bias, layer.o, layer.ffn_norm, layer.gate_up, layer.down):
                if t is not None:
                    total += _bytes_read(t)
        return total + _bytes_read(self.final_norm)


def packed_for_cpu(weights: ModelWeights) -> ModelWeights:
    """`weights` with every bfloat16 matrix (a quantized one's dense copy too) packed for the CPU's
    oneDNN kernels; the embedding, norms, biases and float32 rows stay as they are. The plain matrices
    are not kept: the packed ones hold the same values (`named_tensors` gives them back plain)."""
    def packed(t: Matrix) -> Matrix:
        if isinstance(t, QuantizedLinear):
            return replace(t, dense=packed(t.dense))
        if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
            return pack(t)
        return t

    layers = [replace(layer, qkv=packed(layer.qkv), o=packed(layer.o), gate_up=packed(layer.gate_up),
                      down=packed(layer.down)) for layer in weights.layers]
    # A head tied to the embedding stays that tensor: the tie is what the model cache keys on.
    lm_head = weights.lm_head if weights.lm_head is weights.embed else packed(weights.lm_head)
    return replace(weights, layers=layers, lm_head=lm_head)


def with_tile_kernel(weights: ModelWeights, kernel: CpuInt4Matmul) -> ModelWeights:
    """`weights` with every int4 matrix of the tile kernel's shape also in its layout, and the kernel."""
    def tiled(t: Matrix) -> Matrix:
        if isinstance(t, QuantizedLinear) and t.kind == "int4" and fits(t.packed.shape[0], t.packed.shape[1] * 2):
            return replace(t, tile_codes=tile_codes(t.packed), tile_kernel=kernel)
        return t

    layers = [replace(layer, qkv=tiled(layer.qkv), o=tiled(layer.o), gate_up=tiled(layer.gate_up),
                      down=tiled(layer.down)) for layer in weights.layers]
    return replace(weights, layers=layers, lm_head=tiled(weights.lm_head))


def plain(t: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """A matrix as a plain tensor (a packed one unpacked)."""
    return t.to_dense() if isinstance(t, PackedMatrix) else t


def _bytes_read(t: Matrix) -> int:
    if isinstance(t, QuantizedLinear):
        return t.num_bytes_streamed()
    if isinstance(t, PackedMatrix):
        return t.num_bytes()
    return t.numel() * t.element_size()


def fuse_layer(
    *,
    attn_norm: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_bias: torch.Tensor | None,
    v_bias: torch.Tensor | None,
    o: torch.Tensor,
    ffn_norm: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> LayerWeights:
    """Builds one layer's fused weights from the separate HF-layout matrices."""
    biases = (q_bias, k_bias, v_bias)
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        raise ValueError("attention biases must be given for all of q, k and v or for none")
    qkv_bias = torch.cat(biases).contiguous() if q_bias is not None else None
    return LayerWeights(
        attn_norm=attn_norm.contiguous(),
        qkv=torch.cat([q, k, v]).contiguous(),
        qkv_bias=qkv_bias,
        o=o.contiguous(),
        ffn_norm=ffn_norm.contiguous(),
        gate_up=torch.cat([gate, up]).contiguous(),
        down=down.contiguous(),
    )
