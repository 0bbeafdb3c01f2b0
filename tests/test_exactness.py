"""Logits through the paged cache equal transformers' on the same GGUF weights (fp32, 1e-3)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import oracle_logits

from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.kernels.paged_batch import PagedBatch

TOL = 1e-3
pytestmark = pytest.mark.slow


def record_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Wraps the real runner so each request's sampled-from logits rows are kept, in order."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(plan):
        idx, logits = execute(plan)
        for row, i in enumerate(idx):
            seen.setdefault(plan.scheduled[i].request.request_id, []).append(logits[row].clone())
        return idx, logits

    engine.runner.execute = recording
    return seen


def prompt(loaded, words: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    vocab = ["cache", "page", "token", "the", "a", "GPU", "memory", "reuse", "prefix", "session", "of", "and"]
    text = " ".join(vocab[int(i)] for i in torch.randint(len(vocab), (words,), generator=g))
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_one_prefill_all_positions(loaded, hf_oracle, make_engine, block_size):
    engine = make_engine(block_size=block_size, kv_tokens=1024)
    ids = prompt(loaded, 60, seed=1)
    alloc = engine.kv.allocate_slots("p", len(ids))
    batch = PagedBatch.build(block_size, 0, [len(ids)], [len(ids)], [engine.kv.block_ids("p")], alloc.slots, torch.device("cpu"))
    hidden = loaded.model.forward(torch.tensor(ids), torch.arange(len(ids)), engine.pool.kv_caches, batch)
    ours = loaded.model.compute_logits(hidden)
    assert (ours - oracle_logits(hf_oracle, ids)).abs().max().item() < TOL


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_prefill_then_40_decode_steps(loaded, hf_oracle, make_engine, block_size):
    engine = make_engine(block_size=block_size, kv_tokens=1024)
    seen = record_logits(engine)
    ids = prompt(loaded, 10, seed=2)  # 40 decodes from here cross 16-token pages twice
    rid = engine.add_request(ids, SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.token_ids)
    full = ids + out
    ref = oracle_logits(hf_oracle, full)[len(ids) - 1 : len(full) - 1]
    ours = torch.stack(seen[rid])
    assert ours.shape == ref.shape == (41, loaded.config.vocab_size)
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_eight_sequences_chunked_and_batched(loaded, hf_oracle, make_engine, block_size):
    # A 48-token budget forces chunked prefills that share steps with decodes.
    engine = make_engine(block_size=block_size, kv_tokens=4096, max_num_batched_tokens=48)
    seen = record_logits(engine)
    prompts = [prompt(loaded, 3 + 11 * i, seed=10 + i) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    mixed_steps = 0
    while engine.has_unfinished():
        plan_seqs = len(engine.scheduler.running)
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
        mixed_steps += plan_seqs > 1
    assert mixed_steps > 0
    for rid, p in zip(rids, prompts):
        full = p + outs[rid]
        ref = oracle_logits(hf_oracle, full)[len(p) - 1 : len(full) - 1]
        assert (torch.stack(seen[rid]) - ref).abs().max().item() < TOL, rid


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about memory."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colours."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Explain what a cache is in one sentence."},
    ],
    [{"role": "user", "content": "Count from one to ten in words."}],
    [{"role": "user", "content": "What is 12 times 12?"}],
]


def test_greedy_chat_output_equals_transformers(loaded, hf_oracle, make_engine):
    engine = make_engine(block_size=16, kv_tokens=4096)
    prompts = [loaded.tokenizer.encode_chat(c) for c in CHATS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))  # all in one batch
    eos = next(iter(loaded.tokenizer.eos_token_ids))
    for p, mine in zip(prompts, ours):
        with torch.inference_mode():
            g = hf_oracle.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            )
        assert mine == g[0, len(p):].tolist()


def test_a_prompt_cut_into_pieces_beside_a_decode_by_the_prefill_share(loaded, hf_oracle, make_engine):
    """With prefill_share set, a long prompt sent while another request decodes goes in pieces of a few tokens
    (each step's cost as the engine measured it), and both requests' logits still equal transformers'."""
    engine = make_engine(block_size=16, kv_tokens=4096, prefill_share=0.25)
    seen = record_logits(engine)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short, long = prompt(loaded, 5, seed=31), prompt(loaded, 200, seed=32)
    first = engine.add_request(short, params)
    outs: dict[str, list[int]] = {first: []}
    for o in engine.step():
        outs[o.request_id].extend(o.token_ids)
    second = engine.add_request(long, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs[second] = []
    pieces = []  # the long prompt's tokens in each step it shared with the decode
    while engine.has_unfinished():
        req = engine.requests.get(second)
        before = req.num_computed_tokens if req is not None else None
        decoding = first in engine.requests
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
        if decoding and req is not None and before < len(long) and second in engine.requests:
            pieces.append(req.num_computed_tokens - before)
    assert len([p for p in pieces if p > 0]) > 1 and max(pieces) < len(long)
    for rid, p in ((first, short), (second, long)):
        full = p + outs[rid]
        ref = oracle_logits(hf_oracle, full)[len(p) - 1 : len(full) - 1]
        assert (torch.stack(seen[rid]) - ref).abs().max().item() < TOL, rid
