"""Loads a Llama-family model from a GGUF file with the `gguf` package.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 and then cast to
the requested dtype. llama.cpp's converter permutes the rows of the q and k
projections so that RoPE rotates adjacent pairs; the loader undoes that, so the
forward uses the Hugging Face "rotate half" layout and matches transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from kvtierd.model.config import ModelConfig
from kvtierd.model.errors import ModelLoadError, UnsupportedModelError
from kvtierd.model.weights import ModelWeights, fuse_layer

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def read_gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size", 0) or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_scaling != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {rope_scaling!r} is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: per head, (half, pair) -> (pair, half)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def load_gguf_weights(reader: GGUFReader, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, unpermute_heads: int = 0, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            arr = dequantize(t.data, t.tensor_type) if t.tensor_type == GGMLQuantizationType.BF16 else np.asarray(t.data)
            arr = arr.astype(np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        else:
            arr = dequantize(t.data, t.tensor_type)
        if unpermute_heads:
            arr = _unpermute_rows(arr, unpermute_heads)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=as_dtype)

    def norm(name: str) -> torch.Tensor:
        return get(name, as_dtype=torch.float32)  # norms are float32 in every mode (weight_modes.py)

    def maybe(name: str, unpermute_heads: int = 0) -> torch.Tensor | None:
        return get(name, unpermute_heads) if name in tensors else None

    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        # Only llama.cpp's "llama" converter permutes q/k; qwen2 GGUFs keep HF order.
        permuted = config.architecture in ("llama", "mistral")
        q_heads, k_heads = (config.num_heads, config.num_kv_heads) if permuted else (0, 0)
        layers.append(
            fuse_layer(
                attn_norm=norm(p + "attn_norm.weight"),
                q=get(p + "attn_q.weight", q_heads),
                k=get(p + "attn_k.weight", k_heads),
                v=get(p + "attn_v.weight"),
                q_bias=maybe(p + "attn_q.bias", q_heads),
                k_bias=maybe(p + "attn_k.bias", k_heads),
                v_bias=maybe(p + "attn_v.bias"),
                o=get(p + "attn_output.weight"),
                ffn_norm=norm(p + "ffn_norm.weight"),
                gate=get(p + "ffn_gate.weight"),
                up=get(p + "ffn_up.weight"),
                down=get(p + "ffn_down.weight"),
            )
        )
    embed = get("token_embd.weight")
    lm_head = embed if config.tie_word_embeddings else get("output.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=norm("output_norm.weight"), lm_head=lm_head)


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return GGUFReader(path)
    # A cut or garbled file fails wherever gguf's parser runs off its data: an index past the end, a view
    # that does not fit, an enum value that does not exist.
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
