"""`kvtierd bench quality`: each weight mode against float32 on a fixed text corpus and fixed chats.

Teacher-forced: each corpus text is fed whole and every position's next-token distribution is
compared with float32's: top-1 agreement and the mean KL(float32 || mode) in nats per token. The
quantized kernels are forced for every step size, so the matrices decode streams are the ones
measured (the dense copies that prefill uses hold the same values). Greedy: the replies to fixed
chats through the engine, compared with float32's token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.kernels.paged_batch import PagedBatch
from kvtierd.model.loader import LoadedModel
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry

CORPUS = (
    "A cache keeps a copy of data close to where it is used, so that the next request for the same data "
    "is served without going back to the slower store. Its hit rate depends on how often programs reuse "
    "what they touched recently, and on how much room the cache has.",
    "The river rose through the night, and by morning the low fields were under water. Farmers moved "
    "their animals to the hills, and the school opened its doors to the families who had nowhere to go.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes place in the "
    "chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light.",
    "To make a simple bread, mix flour, water, salt and yeast, knead the dough for ten minutes, and let it "
    "rise in a warm place until it has doubled in size. Shape it, let it rise again, and bake it until the "
    "crust is brown and the loaf sounds hollow when you tap it.",
    "The meeting is moved to Thursday at three o'clock. Please bring the quarterly figures and the draft "
    "of the new budget, and send your questions to the team before Wednesday evening.",
    "In 1969 two astronauts walked on the Moon while a third orbited above them. They collected rocks, "
    "planted a flag, and returned to Earth four days later, landing in the Pacific Ocean.",
    "User: How do I reverse a list in Python?\nAssistant: Use slicing, my_list[::-1], which returns a new "
    "list, or call my_list.reverse(), which reverses the list in place and returns None.",
)
CHATS = (
    "What is a KV cache in one sentence?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain recursion to a child.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "List two benefits of exercise.",
)
REPLY_TOKENS = 24


@dataclass(slots=True)
class ModeQuality:
    mode: str
    top1_agreement: float  # share of positions whose argmax equals float32's
    mean_kl_nats: float  # KL(float32 || mode) per token
    identical_replies: int  # greedy replies equal to float32's, of len(CHATS)
    reply_token_agreement: float  # share of reply tokens before the first divergence, over all chats


def position_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float32: the model's logits at every position of one prefill."""
    model, c = loaded.model, loaded.config
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    pool = DeviceKVPool(KVGeometry(c.num_layers, c.num_kv_heads, c.head_dim, block_size, model.kv_dtype),
                        num_blocks, model.device)
    batch = PagedBatch.build(block_size, 0, [len(ids)], [len(ids)], [list(range(num_blocks))],
                             list(range(len(ids))), model.device)
    saved, model.quantized_max_tokens = model.quantized_max_tokens, len(ids)  # the quantized kernels throughout
    try:
        hidden = model.forward(torch.tensor(ids, device=model.device), torch.arange(len(ids), device=model.device),
                               pool.kv_caches, batch)
        return model.compute_logits(hidden)
    finally:
        model.quantized_max_tokens = saved


def teacher_forced(reference: LoadedModel, other: LoadedModel, texts=CORPUS) -> tuple[float, float]:
    """(top-1 agreement, mean KL in nats per token) of `other` against `reference` over `texts`."""
    agree, kl, n = 0, 0.0, 0
    for text in texts:
        ids = reference.tokenizer.encode(text)
        ref = position_logits(reference, ids).log_softmax(-1)
        out = position_logits(other, ids).log_softmax(-1)
        agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
        kl += float((ref.exp() * (ref - out)).sum())
        n += len(ids)
    return agree / n, kl / n


def greedy_replies(loaded: LoadedModel, chats=CHATS, max_tokens: int = REPLY_TOKENS) -> list[list[int]]:
    """Each chat's greedy reply, all chats decoded together in one engine."""
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=len(chats), kv_cache_bytes=64 << 20))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(loaded.tokenizer.encode_chat([{"role": "user", "content": c}]), params) for c in chats]
    replies: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            replies[o.request_id].extend(o.token_ids)
    engine.close()
    return [replies[i] for i in ids]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure_quality(reference: LoadedModel, other: LoadedModel,
                    reference_replies: list[list[int]] | None = None) -> ModeQuality:
    top1, kl = teacher_forced(reference, other)
    reference_replies = reference_replies or greedy_replies(reference)
    replies = greedy_replies(other)
    common = sum(_common_prefix(r, o) for r, o in zip(reference_replies, replies))
    return ModeQuality(other.model.mode.name, top1, kl, sum(r == o for r, o in zip(reference_replies, replies)),
                       common / sum(len(r) for r in reference_replies))
