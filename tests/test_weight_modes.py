"""Weight modes and the KV dtype: quantized matrices, the converted-model cache per mode, and the KV
namespace that keeps a bfloat16 KV chunk from ever being served to a float32 engine."""

from __future__ import annotations

import pytest
import torch

from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.errors import ModelLoadError
from kvtierd.model.loader import convert_loaded
from kvtierd.model.model_cache import ModelCache
from kvtierd.model.llama import top_k_indices
from kvtierd.model.packed_matrix import can_pack, pack
from kvtierd.model.quantized import INT4_GROUP, quantize
from kvtierd.model.weight_modes import WEIGHT_MODES, resolve_kv_dtype, resolve_weight_mode
from kvtierd.model.weights import plain
from kvtierd.tiers.config import TierConfig


def test_int8_codes_times_scales_are_the_dense_copy_and_the_kernel_computes_with_them():
    w = torch.randn(32, 64)
    q = quantize(w, "int8", torch.bfloat16)
    assert q.packed.dtype == torch.int8 and q.packed.abs().max() == 127
    assert torch.equal(q.dense, (q.packed.float() * q.scales.float()[:, None]).bfloat16())
    # Half a step of the code, plus bfloat16's rounding of the dense copy.
    assert (q.dense.float() - w).abs().max() <= q.scales.float().max() / 2 + w.abs().max() * 2**-8
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(q.matmul(x, quantized=True), q.matmul(x, quantized=False), rtol=0.02, atol=0.05)


def test_int4_gives_a_q4_1_group_back_as_stored():
    # A Q4_1 block: 32 codes spanning 0..15 times a scale, plus the block's minimum.
    codes = torch.arange(INT4_GROUP).remainder(16).float().repeat(16, 2)  # [16, 64]
    scale, low = 0.0625, -0.5  # both exact in bfloat16
    w = codes * scale + low
    q = quantize(w, "int4", torch.bfloat16)
    assert torch.equal(q.dense.float(), w)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(q.matmul(x, quantized=True).float(), x.float() @ w.t(), rtol=0.02, atol=0.05)


def test_modes_and_kv_dtypes_resolve_by_name_and_say_what_is_wrong():
    cpu = torch.device("cpu")
    assert resolve_weight_mode("float32", cpu).compute_dtype == torch.float32
    assert resolve_weight_mode(torch.bfloat16, cpu) is WEIGHT_MODES["bfloat16"]
    assert resolve_kv_dtype(None, WEIGHT_MODES["int8"]) == torch.bfloat16  # the compute dtype
    assert resolve_kv_dtype("float32", WEIGHT_MODES["int8"]) == torch.float32
    with pytest.raises(ModelLoadError, match="unknown weight dtype 'int3'"):
        resolve_weight_mode("int3", cpu)
    with pytest.raises(ModelLoadError, match="CPU only"):
        resolve_weight_mode("int8", torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="unknown KV dtype"):
        resolve_kv_dtype("int8", WEIGHT_MODES["float32"])


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 kernels")
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
def test_a_packed_matrix_computes_what_the_plain_one_does(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(200, 96).bfloat16(), torch.randn(200).bfloat16()
    x = torch.randn(rows, 192).bfloat16()[:, ::2]  # a strided input, as a chunk of a fused matrix's output is
    packed = pack(w)
    torch.testing.assert_close(packed.matmul(x, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(packed.to_dense(), w) and packed.num_bytes() == w.numel() * 2


@pytest.mark.parametrize("case", ["spread", "one block", "narrow"])
def test_the_two_level_top_k_finds_what_topk_finds(case):
    torch.manual_seed(1)
    x = torch.randn(4, 300 if case == "narrow" else 49152)
    if case == "one block":
        x[:, 1280:1408] += 100  # every row's 64 largest values sit in one block of 128
    found = top_k_indices(x, 64).sort(dim=-1).values
    assert torch.equal(found, x.topk(64, dim=-1).indices.sort(dim=-1).values)


def test_the_converted_model_cache_keys_entries_by_mode(loaded, tmp_path):
    int8 = convert_loaded(loaded, "int8")
    cache = ModelCache(tmp_path)
    cache.put(int8.weights_digest, int8.model.mode, int8.config, int8.model.weights, int8.tokenizer)
    assert cache.get(int8.weights_digest, WEIGHT_MODES["float32"], torch.device("cpu")) is None
    _, weights, _ = cache.get(int8.weights_digest, int8.model.mode, torch.device("cpu"))
    layer, stored = int8.model.weights.layers[3], weights.layers[3]
    assert torch.equal(stored.gate_up.packed, layer.gate_up.packed) and torch.equal(stored.down.scales, layer.down.scales)
    assert torch.equal(weights.lm_head.dense, plain(int8.model.weights.lm_head.dense))  # the model runs it packed
    assert weights.num_bytes_per_token() == int8.model.weights.num_bytes_per_token()
    assert weights.num_bytes_per_token() < loaded.model.weights.num_bytes_per_token() / 3


def _disk_engine(loaded, directory) -> LLMEngine:
    tiers = TierConfig(host_bytes=0, disk_bytes=256 << 20, disk_path=directory, chunk_pages=2, disk_admission="all")
    return LLMEngine(loaded, EngineConfig(kv_cache_bytes=16 << 20, tiers=tiers))


def _cached_on_disk(loaded, directory, prompt: list[int]) -> int:
    engine = _disk_engine(loaded, directory)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), session_id="s")
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.close()
    return outs[0].cached_tokens_by_tier["disk"]


def test_a_bfloat16_kv_chunk_is_never_served_to_a_float32_engine(loaded, tmp_path):
    bf16_kv = convert_loaded(loaded, "float32", kv_dtype="bfloat16")  # same weights, KV stored in bfloat16
    assert bf16_kv.fingerprint != loaded.fingerprint and bf16_kv.model.kv_dtype == torch.bfloat16
    prompt = loaded.tokenizer.encode("The pages of a KV cache move between tiers as chunks. " * 12)
    assert _cached_on_disk(bf16_kv, tmp_path, prompt) == 0  # a session: its chunks are written through to disk
    assert _cached_on_disk(loaded, tmp_path, prompt) == 0  # float32: none of them is found
    assert _cached_on_disk(bf16_kv, tmp_path, prompt) >= 64  # the same KV dtype finds them


def test_the_daemon_serves_the_mode_it_was_given_and_reports_it():
    """`--dtype int4`: /v1/models and kvtierctl status name the weights and the KV dtype (bfloat16, the
    mode's compute dtype), and a chat is answered; the model cache keeps the int4 conversion apart."""
    import os
    import tempfile
    from pathlib import Path

    from daemon_fixtures import start_daemon
    from test_kvtierctl_daemon import ctl

    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        daemon = start_daemon(Path(root), "--dtype", "int4")
        try:
            reply = daemon.openai().chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0)
            assert reply.choices[0].message.content
            with daemon.client() as c:
                card = c.get("/v1/models").json()["data"][0]
                status = c.get("/admin/status").json()["model"]
            assert (card["dtype"], card["kv_dtype"]) == ("int4", "bfloat16")
            assert (status["dtype"], status["kv_dtype"]) == ("int4", "bfloat16")
            shown = ctl(daemon, "status")
            assert shown.returncode == 0 and "int4 / bfloat16" in shown.stdout, shown.stdout
            cache = Path(os.environ["KVTIERD_MODEL_CACHE_DIR"])  # the test session's (conftest.py)
            assert any(p.name.endswith("-int4") for p in cache.iterdir())
        finally:
            assert daemon.stop() == 0, daemon.log_text()
