"""Loading Hugging Face model directories, with transformers as the oracle.

Each case is a tiny random model that transformers itself builds and saves
(`save_pretrained(..., safe_serialization=True)`), next to a small byte-level
BPE tokenizer and a chat template. kvtierd loads the directory and must give
transformers' logits through the paged KV cache (a cached prefix, then the
rest of the prompt, at block sizes 1 and 16) and transformers' greedy tokens.

Weights are drawn wider than transformers' default init (std 0.02 makes every
attention near-uniform, which would hide RoPE and masking bugs), and norm
weights and q/k/v biases are drawn too (their defaults, ones and zeros, would
hide a dropped norm or bias).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.kernels.paged_batch import PagedBatch
from kvtierd.model.config import RopeScaling
from kvtierd.model.errors import ModelLoadError, UnsupportedModelError
from kvtierd.model.hf_loader import read_hf_config
from kvtierd.model.loader import LoadedModel, load_model
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing is downloaded

import transformers  # noqa: E402  (the test-only oracle)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

CPU = torch.device("cpu")
ATOL = 1e-4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache keeps keys and values in fixed-size pages.",
    "Hello, world! How are you today? Fine, thanks.",
    "Pages move between the GPU, host memory, SSD and Redis.",
]
CONVERSATION = [{"role": "user", "content": "Hello, world! The quick brown fox keeps the pages."}]  # 44 tokens
PREFIX_LEN = 17  # cached first chunk: one page and a bit at block size 16, so chunk 2 starts mid-page

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # 64 with head_dim 16 and theta 5e5: one frequency kept, one on the ramp, six divided by 8.
    "original_max_position_embeddings": 64,
}

# name -> (config class, model class, config kwargs beyond the shared tiny geometry)
CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False, "rope_theta": 10000.0}),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral-no-window": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


# -- factories -----------------------------------------------------------------


def make_hf_tokenizer():
    """A byte-level BPE trained on CORPUS, wrapped as a transformers fast tokenizer with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def make_hf_model(case: str, vocab_size: int, special_ids: dict[str, int], seed: int = 0):
    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        **special_ids,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    return model


def save_model_dir(path: Path, model, hf_tok) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    hf_tok.save_pretrained(path)
    return path


@dataclass(slots=True)
class Case:
    name: str
    path: Path
    hf_model: object
    hf_tok: object  # the tokenizer transformers reads back from `path`
    loaded: LoadedModel


@pytest.fixture(scope="module")
def hf_tokenizer():
    return make_hf_tokenizer()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, hf_tokenizer) -> Case:
    special_ids = {
        "bos_token_id": hf_tokenizer.bos_token_id,
        "eos_token_id": hf_tokenizer.eos_token_id,
        "pad_token_id": hf_tokenizer.pad_token_id,
    }
    hf_model = make_hf_model(request.param, len(hf_tokenizer), special_ids)
    path = save_model_dir(tmp_path_factory.mktemp(request.param), hf_model, hf_tokenizer)
    # The oracle is what transformers reads back, so the saved files are what both sides see.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    return Case(request.param, path, hf_model, hf_tok, load_model(path, dtype=torch.float32))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, hf_tokenizer) -> tuple[Path, Path]:
    """Two directories with the same config and tokenizer but weights from different seeds."""
    ids = {"bos_token_id": hf_tokenizer.bos_token_id, "eos_token_id": hf_tokenizer.eos_token_id}
    return tuple(
        save_model_dir(tmp_path_factory.mktemp(f"seed{seed}"), make_hf_model("llama-untied", len(hf_tokenizer), ids, seed), hf_tokenizer)
        for seed in (0, 1)
    )


def prompt_ids(c: Case) -> list[int]:
    ids = c.loaded.tokenizer.encode_chat(CONVERSATION)
    assert 2 * PREFIX_LEN <= len(ids) <= 64, f"the prompt should be ~40 tokens, got {len(ids)}"
    return ids


def paged_prefill_logits(lm: LoadedModel, ids: list[int], block_size: int, prefix_len: int) -> torch.Tensor:
    """Logits of every prompt token, computed in two chunks over the paged cache.

    Another sequence takes a page between the chunks, so the prompt's pages are
    not contiguous in the pool.
    """
    c = lm.config
    g = KVGeometry(c.num_layers, c.num_kv_heads, c.head_dim, block_size, torch.float32)
    pool = DeviceKVPool(g, len(ids) // block_size + 4, CPU)
    kv = KVCacheManager(pool.num_blocks, block_size)
    n1, n2 = prefix_len, len(ids) - prefix_len
    assert n1 > 1 and n2 > 1, "a one-token chunk would be a decode"

    a = kv.allocate_slots("a", n1)
    b = PagedBatch.build(block_size, 0, [n1], [n1], [kv.block_ids("a")], a.slots, CPU)
    h1 = lm.model.forward(torch.tensor(ids[:n1]), torch.arange(n1), pool.kv_caches, b)

    assert kv.allocate_slots("other", 1) is not None
    a = kv.allocate_slots("a", n2)
    assert a is not None and not a.copies
    b = PagedBatch.build(block_size, 0, [n2], [n1 + n2], [kv.block_ids("a")], a.slots, CPU)
    h2 = lm.model.forward(torch.tensor(ids[n1:]), torch.arange(n1, n1 + n2), pool.kv_caches, b)
    return lm.model.compute_logits(torch.cat([h1, h2]))


def edit_config(path: Path, **changes) -> None:
    config_file = path / "config.json"
    cfg = json.loads(config_file.read_text())
    cfg.update(changes)
    config_file.write_text(json.dumps(cfg))


# -- the oracle ----------------------------------------------------------------


def test_config_matches_what_transformers_built(case: Case) -> None:
    hc, mc = case.hf_model.config, case.loaded.config
    assert mc.architecture == ARCHITECTURES[CASES[case.name][1]]
    assert mc.vocab_size == hc.vocab_size == len(case.hf_tok)
    assert (mc.hidden_size, mc.intermediate_size, mc.num_layers) == (64, 128, 2)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (4, 2, 16)
    assert mc.max_position_embeddings == 256
    assert mc.tie_word_embeddings == hc.tie_word_embeddings
    assert mc.attention_bias == (case.name == "qwen2-bias-tied")
    if case.name == "llama3-rope-tied":
        assert mc.rope_theta == 500000.0
        assert mc.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    else:
        assert mc.rope_theta == 10000.0
        assert mc.rope_scaling is None


def test_tied_model_shares_one_embedding_tensor(case: Case) -> None:
    w = case.loaded.model.weights
    assert (w.lm_head is w.embed) == case.loaded.config.tie_word_embeddings


@pytest.mark.slow
def test_chat_prompt_matches_transformers(case: Case) -> None:
    ours = case.loaded.tokenizer
    assert ours.render_chat(CONVERSATION) == case.hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    theirs = case.hf_tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert ours.encode_chat(CONVERSATION) == theirs["input_ids"]
    assert ours.eos_token_ids == {case.hf_tok.eos_token_id}


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_logits_match_transformers(case: Case, block_size: int) -> None:
    ids = prompt_ids(case)
    with torch.no_grad():
        expected = case.hf_model(torch.tensor([ids])).logits[0].float()
    got = paged_prefill_logits(case.loaded, ids, block_size, PREFIX_LEN)
    assert got.shape == expected.shape == (len(ids), case.loaded.config.vocab_size)
    err = (got - expected).abs().max().item()
    assert err <= ATOL, f"{case.name} at block size {block_size}: max abs logit error {err:.2e}"
    # The logits spread widely enough that an error of ATOL would show.
    assert expected.std().item() > 0.5


@pytest.mark.slow
def test_greedy_continuation_matches_transformers(case: Case) -> None:
    ids = prompt_ids(case)
    mc = case.loaded.config
    page = KVGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, torch.float32).bytes_per_block
    # A 16-token step budget: the 44-token prompt is prefilled in three chunks, then decoded.
    engine = LLMEngine(case.loaded, EngineConfig(kv_cache_bytes=8 * page, max_num_batched_tokens=16))
    [ours] = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        out = case.hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=10,
            min_new_tokens=10,
            pad_token_id=case.hf_tok.pad_token_id,
        )
    assert ours == out[0, len(ids) :].tolist()


# -- config spellings ------------------------------------------------------------


def test_transformers_4_rope_spelling_reads_the_same(tmp_path: Path) -> None:
    """Older configs keep rope_theta at the top level and the scaling under rope_scaling."""
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, rope_parameters=LLAMA3_ROPE
    ).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    new = read_hf_config(tmp_path)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_hf_config(tmp_path) == new
    assert new.rope_theta == 500000.0 and new.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


def test_mistral_sliding_window_caps_the_context(tmp_path: Path) -> None:
    cfg = transformers.MistralConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=128
    )
    cfg.architectures = ["MistralForCausalLM"]
    cfg.save_pretrained(tmp_path)
    assert read_hf_config(tmp_path).max_position_embeddings == 128


# -- errors ------------------------------------------------------------------------


@pytest.fixture
def broken_dir(tmp_path: Path, model_dirs: tuple[Path, Path]) -> Path:
    """A private copy of a valid model directory, for a test to break."""
    return Path(shutil.copytree(model_dirs[0], tmp_path / "model"))


@pytest.mark.parametrize(
    ("missing", "named"),
    [("config.json", "config.json"), ("model.safetensors", "safetensors"), ("tokenizer.json", "tokenizer.json")],
)
def test_missing_file_is_named(broken_dir: Path, missing: str, named: str) -> None:
    (broken_dir / missing).unlink()
    with pytest.raises(ModelLoadError, match=named):
        load_model(broken_dir)


def test_missing_directory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nowhere")


def test_unsupported_architecture_is_named(broken_dir: Path) -> None:
    edit_config(broken_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(broken_dir)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},  # transformers 4 spelling
    ],
    ids=["rope_parameters", "rope_scaling"],
)
def test_unsupported_rope_type_is_named(broken_dir: Path, rope: dict) -> None:
    edit_config(broken_dir, **rope)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(broken_dir)


# -- fingerprint ---------------------------------------------------------------------


def test_fingerprint_is_stable_across_loads_and_locations(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    first, _ = model_dirs
    moved = shutil.copytree(first, tmp_path / "elsewhere")
    fp = load_model(first).fingerprint
    assert load_model(first).fingerprint == fp
    assert load_model(moved).fingerprint == fp


def test_fingerprint_differs_with_weights(model_dirs: tuple[Path, Path]) -> None:
    a, b = (load_model(d) for d in model_dirs)
    assert a.config == b.config
    assert a.fingerprint != b.fingerprint


def test_fingerprint_differs_with_dtype(model_dirs: tuple[Path, Path]) -> None:
    first, _ = model_dirs
    assert load_model(first, dtype=torch.float32).fingerprint != load_model(first, dtype=torch.bfloat16).fingerprint
