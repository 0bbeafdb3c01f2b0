"""Rotary position embeddings in the Hugging Face "rotate half" layout."""

from __future__ import annotations

import math

import torch

from kvtierd.model.config import ModelConfig, RopeScaling


def _inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3's long-context scaling: slow frequencies divided by `factor`, fast kept, a ramp between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    ramp = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, ramp, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position up to the context window."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = _inverse_frequencies(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        # sin with rotate-half's sign folded in: rotate_half(x) * sin == roll(x, half) * signed_sin, exactly
        # (a negation is exact), in two ops fewer per layer.
        self.signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[num_tokens, 1, head_dim]` for the given positions, looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotates `x [num_tokens, heads, head_dim]` by the tables from `tables`."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
