"""Engine settings: the KV budget and the batching limits."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV page
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # device KV pool size
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_num_seqs: int = 64  # running requests at once
    max_model_len: int | None = None  # defaults to the model's context window
    enable_prefix_caching: bool = True  # reuse cached pages across requests (off: every prompt is computed)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
