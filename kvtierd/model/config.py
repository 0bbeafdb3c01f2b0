"""The geometry of a Llama-family model, as every layer above the loader sees it."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.model.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling; `None` on a ModelConfig means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama", "mistral" or "qwen2": all share one forward
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.num_heads} attention heads cannot share {self.num_kv_heads} KV heads evenly")
