"""How a model's weights are held and computed: the `[model] dtype` setting.

    float32   exact: logits equal transformers' (the mode every exactness test runs in)
    bfloat16  weights and activations in bfloat16
    int8      int8 weights, one scale per output channel; bfloat16 activations
    int4      4-bit weights in groups of 32 with a scale and an offset each (the GGUF's Q4_1
              layout; the bfloat16 scale and offset that reconstruct each group best); bfloat16
              activations

A quantized mode is weight-only: the matrices' inputs, attention and the KV cache are in the
compute dtype. In every mode the residual stream and the norms (their weights too) are float32. `kvtierd bench quality` measures each mode against float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtierd.model.errors import ModelLoadError
from kvtierd.model.quantized import quantize
from kvtierd.model.weights import LayerWeights, ModelWeights


@dataclass(frozen=True, slots=True)
class WeightMode:
    name: str
    compute_dtype: torch.dtype  # activations; the default KV dtype
    quantization: str | None = None  # "int8" or "int4"; None: dense matrices in compute_dtype


WEIGHT_MODES: dict[str, WeightMode] = {m.name: m for m in (
    WeightMode("float32", torch.float32),
    WeightMode("bfloat16", torch.bfloat16),
    WeightMode("float16", torch.float16),
    WeightMode("int8", torch.bfloat16, "int8"),
    WeightMode("int4", torch.bfloat16, "int4"),
)}
KV_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The CPU default: the fastest mode that passes the quality gate (top-1 agreement with float32 >= 98%,
# mean KL <= 0.02 nats; tests/test_quality.py, `kvtierd bench quality`). int4 measures 98.9% and 0.006
# (with the float32 residual stream, its best-fitting bfloat16 scales and the exact top logits) and
# decodes fastest at batch 1; int8's one scale per row measures 96.3%.
CPU_DEFAULT_MODE = "int4"


def default_weight_mode(device: torch.device) -> WeightMode:
    if device.type == "cuda":
        return WEIGHT_MODES["bfloat16" if torch.cuda.is_bf16_supported() else "float16"]
    return WEIGHT_MODES[CPU_DEFAULT_MODE]


def resolve_weight_mode(mode: str | torch.dtype | None, device: torch.device) -> WeightMode:
    """A mode by name (or a torch dtype, for a dense mode); None or "auto": the device's default."""
    if mode is None or mode == "auto":
        return default_weight_mode(device)
    name = str(mode).removeprefix("torch.")
    if name not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown weight dtype {name!r} (one of auto, {', '.join(WEIGHT_MODES)})")
    chosen = WEIGHT_MODES[name]
    if chosen.quantization is not None and device.type != "cpu":
        raise ModelLoadError(f"{name} weights run on CPU only; use bfloat16 or float16 on {device.type}")
    return chosen


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, mode: WeightMode) -> torch.dtype:
    """The KV cache's dtype by name; None or "auto": the weights' compute dtype."""
    if kv_dtype is None or kv_dtype == "auto":
        return mode.compute_dtype
    name = str(kv_dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ModelLoadError(f"unknown KV dtype {name!r} (one of auto, {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]


def convert_weights(weights: ModelWeights, mode: WeightMode) -> ModelWeights:
    """`mode`'s weights from dense ones: cast for a dense mode (no copy of a tensor already in its dtype),
    quantized for a quantized one; the norms float32 in every mode. The LM head is quantized like the
    layers, with its float32 rows kept to recompute the top logits exactly (llama.py): with them, a 4-bit
    head passes the quality gate (bench quality: top-1 98.9%, KL 0.006) and decodes 13% faster than an
    8-bit one at batch 1, the head being a fifth of the weights read per token."""
    dtype, kind = mode.compute_dtype, mode.quantization
    if kind is None:
        cast = [LayerWeights(attn_norm=layer.attn_norm.float(), qkv=layer.qkv.to(dtype),
                             qkv_bias=None if layer.qkv_bias is None else layer.qkv_bias.to(dtype),
                             o=layer.o.to(dtype), ffn_norm=layer.ffn_norm.float(), gate_up=layer.gate_up.to(dtype),
                             down=layer.down.to(dtype))
                for layer in weights.layers]
        embed = weights.embed.to(dtype)
        lm_head = embed if weights.lm_head is weights.embed else weights.lm_head.to(dtype)
        return ModelWeights(embed=embed, layers=cast, final_norm=weights.final_norm.float(), lm_head=lm_head)
    layers = [
        LayerWeights(
            attn_norm=layer.attn_norm.float(),
            qkv=quantize(layer.qkv, kind, dtype),
            qkv_bias=None if layer.qkv_bias is None else layer.qkv_bias.to(dtype),
            o=quantize(layer.o, kind, dtype),
            ffn_norm=layer.ffn_norm.float(),
            gate_up=quantize(layer.gate_up, kind, dtype),
            down=quantize(layer.down, kind, dtype),
        )
        for layer in weights.layers
    ]
    assert isinstance(weights.lm_head, torch.Tensor), "convert_weights takes dense weights"
    # The embedding stays float32: a lookup reads one row a token, and the residual stream is float32.
    embed = weights.embed.float()
    lm_head_exact = embed if weights.lm_head is weights.embed else weights.lm_head.float()
    return ModelWeights(embed=embed, layers=layers, final_norm=weights.final_norm.float(),
                        lm_head=quantize(weights.lm_head, kind, dtype), lm_head_exact=lm_head_exact)
