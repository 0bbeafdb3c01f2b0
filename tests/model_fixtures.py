"""Session-wide model fixtures: the bundled SmolLM2 and transformers as the oracle.

Loaded once per test session; every test that needs the real model shares them.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle never downloads anything

from kvtierd.engine.config import EngineConfig  # noqa: E402
from kvtierd.engine.llm_engine import LLMEngine  # noqa: E402
from kvtierd.model.loader import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    # float32: the exact mode, which the logits-equality tests compare with transformers.
    return load_model(dtype="float32")


@pytest.fixture(scope="session")
def hf_oracle(loaded: LoadedModel):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        loaded.source.parent, gguf_file=loaded.source.name, dtype=torch.float32
    ).eval()


@pytest.fixture
def make_engine(loaded: LoadedModel):
    """Builds engines on the shared model with small KV budgets (tokens, not bytes)."""

    def make(block_size: int = 16, kv_tokens: int = 8192, **kw) -> LLMEngine:
        bytes_per_token = 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4
        return LLMEngine(loaded, EngineConfig(block_size=block_size, kv_cache_bytes=kv_tokens * bytes_per_token, **kw))

    return make


def oracle_logits(hf_oracle, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits `[len, vocab]` for every position of one sequence."""
    with torch.inference_mode():
        return hf_oracle(torch.tensor([token_ids])).logits[0].float()
