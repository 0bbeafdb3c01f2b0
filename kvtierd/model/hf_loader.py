"""Loads a Llama-family model from a Hugging Face directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kvtierd.model.config import ModelConfig, RopeScaling
from kvtierd.model.errors import ModelLoadError, UnsupportedModelError
from kvtierd.model.weights import ModelWeights, fuse_layer

log = logging.getLogger(__name__)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    # transformers 5 writes "rope_parameters"; older configs "rope_scaling".
    rs = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (supported: default, llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def read_hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory: config.json is missing")
    cfg = json.loads(config_file.read_text())
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or cfg.get('model_type')!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    heads = int(cfg["num_attention_heads"])
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
    if window and window < max_pos:
        # Without sliding-window attention the model is exact only up to the window.
        log.warning("%s: context capped at its sliding window of %d tokens", path.name, window)
        max_pos = int(window)
    rope = cfg.get("rope_parameters") or {}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=_rope_scaling(cfg),
    )


def load_hf_weights(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[ModelWeights, list[Path]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (other formats are not loaded)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                tensors[key] = st.get_tensor(key)

    def get(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{path} lacks tensor {name!r}")
        return t.to(device=device, dtype=as_dtype)

    def norm(name: str) -> torch.Tensor:
        return get(name, torch.float32)  # norms are float32 in every mode (weight_modes.py)

    def maybe(name: str) -> torch.Tensor | None:
        return get(name) if config.attention_bias else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            fuse_layer(
                attn_norm=norm(p + "input_layernorm.weight"),
                q=get(p + "self_attn.q_proj.weight"),
                k=get(p + "self_attn.k_proj.weight"),
                v=get(p + "self_attn.v_proj.weight"),
                q_bias=maybe(p + "self_attn.q_proj.bias"),
                k_bias=maybe(p + "self_attn.k_proj.bias"),
                v_bias=maybe(p + "self_attn.v_proj.bias"),
                o=get(p + "self_attn.o_proj.weight"),
                ffn_norm=norm(p + "post_attention_layernorm.weight"),
                gate=get(p + "mlp.gate_proj.weight"),
                up=get(p + "mlp.up_proj.weight"),
                down=get(p + "mlp.down_proj.weight"),
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=norm("model.norm.weight"), lm_head=lm_head), files
