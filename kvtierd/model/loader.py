"""One entry point for every model source: the bundled default, a GGUF file, an HF directory."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
from kvtierd.model.weight_modes import convert_weights, resolve_kv_dtype, resolve_weight_mode


@dataclass(slots=True)
class LoadedModel:
    name: str
    source: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: ChatTokenizer
    fingerprint: str  # weights digest + weight mode + KV dtype + geometry: the KV namespace
    weights_digest: str  # SHA-256 of the weight files


def convert_loaded(loaded: LoadedModel, dtype: str, kv_dtype: str | torch.dtype | None = None) -> LoadedModel:
    """The same model in another weight mode (and KV dtype), converted from `loaded`'s float32 weights
    without reading the files again: how the quality benchmark and its test build each mode."""
    assert loaded.model.mode.name == "float32", "modes are converted from the exact float32 weights"
    mode = resolve_weight_mode(dtype, loaded.model.device)
    kv = resolve_kv_dtype(kv_dtype, mode)
    model = LlamaModel(loaded.config, convert_weights(loaded.model.weights, mode), loaded.model.device, mode, kv)
    return replace(loaded, model=model, fingerprint=model_fingerprint(loaded.weights_digest, loaded.config, mode.name, kv))


def load_model(source: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, cache_dir: Path | None = None,
               kv_dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Loads `source`: None for the bundled SmolLM2, a `.gguf` file, or a Hugging Face directory.
    `dtype` is a weight mode (weight_modes.py; None: the device's default), `kv_dtype` the KV
    cache's (None: the mode's compute dtype). With `cache_dir`, a GGUF's conversion is kept there
    and later loads map it (`model_cache.py`)."""
    device = torch.device(device)
    mode = resolve_weight_mode(dtype, device)
    kv = resolve_kv_dtype(kv_dtype, mode)
    if device.type != "cpu" and kv != mode.compute_dtype:
        raise ModelLoadError(f"on {device.type} the KV dtype is the weights' ({mode.compute_dtype})")
    # A quantized mode is built from float32 weights (a GGUF's are dequantized to them first).
    dtype = torch.float32 if mode.quantization else mode.compute_dtype
    path = bundled_gguf_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        config = read_hf_config(path)
        weights, files = load_hf_weights(path, config, dtype, device)
        weights = convert_weights(weights, mode)
        tokenizer = ChatTokenizer.from_hf_dir(path)
        digest = digest_files(files)
    elif path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        digest = digest_files([path])
        cache = ModelCache(cache_dir) if cache_dir is not None else None
        cached = cache.get(digest, mode, device) if cache is not None else None
        if cached is not None:
            config, weights, tokenizer = cached
        else:
            reader = open_gguf(path)
            config = read_gguf_config(reader)
            weights = convert_weights(load_gguf_weights(reader, config, dtype, device), mode)
            tokenizer = ChatTokenizer.from_gguf(path, reader=reader)
            if cache is not None:
                cache.put(digest, mode, config, weights, tokenizer)
    else:
        raise ModelLoadError(f"model not found: {path} (give a .gguf file or a Hugging Face model directory)")
    return LoadedModel(
        name=path.stem if path.is_file() else path.name,
        source=path,
        config=config,
        model=LlamaModel(config, weights, device, mode, kv),
        tokenizer=tokenizer,
        fingerprint=model_fingerprint(digest, config, mode.name, kv),
        weights_digest=digest,
    )
