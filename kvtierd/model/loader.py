"""One entry point for every model source: the bundled default, a GGUF file, an HF directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvtierd.model.bundled import bundled_gguf_path
from kvtierd.model.config import ModelConfig
from kvtierd.model.errors import ModelLoadError
from kvtierd.model.fingerprint import digest_files, model_fingerprint
from kvtierd.model.gguf_loader import load_gguf_weights, open_gguf, read_gguf_config
from kvtierd.model.hf_loader import load_hf_weights, read_hf_config
from kvtierd.model.llama import LlamaModel
from kvtierd.model.model_cache import ModelCache
from kvtierd.model.tokenizer import ChatTokenizer


@dataclass(slots=True)
class LoadedModel:
    name: str
    source: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: ChatTokenizer
    fingerprint: str  # weights digest + dtype + geometry: the KV namespace


def default_dtype(device: torch.device) -> torch.dtype:
    # float32 on CPU (exact against transformers); half precision on GPUs.
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(source: str | Path | None = None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               cache_dir: Path | None = None) -> LoadedModel:
    """Loads `source`: None for the bundled SmolLM2, a `.gguf` file, or a Hugging Face directory. With
    `cache_dir`, a GGUF's conversion is kept there and later loads map it (`model_cache.py`)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    path = bundled_gguf_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        config = read_hf_config(path)
        weights, files = load_hf_weights(path, config, dtype, device)
        tokenizer = ChatTokenizer.from_hf_dir(path)
        digest = digest_files(files)
    elif path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        digest = digest_files([path])
        cache = ModelCache(cache_dir) if cache_dir is not None else None
        cached = cache.get(digest, dtype, device) if cache is not None else None
        if cached is not None:
            config, weights, tokenizer = cached
        else:
            reader = open_gguf(path)
            config = read_gguf_config(reader)
            weights = load_gguf_weights(reader, config, dtype, device)
            tokenizer = ChatTokenizer.from_gguf(path, reader=reader)
            if cache is not None:
                cache.put(digest, dtype, config, weights, tokenizer)
    else:
        raise ModelLoadError(f"model not found: {path} (give a .gguf file or a Hugging Face model directory)")
    return LoadedModel(
        name=path.stem if path.is_file() else path.name,
        source=path,
        config=config,
        model=LlamaModel(config, weights, device, dtype),
        tokenizer=tokenizer,
        fingerprint=model_fingerprint(digest, config, dtype),
    )
