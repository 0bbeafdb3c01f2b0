"""Reuse on the real model: session turns, edited histories, public prefixes and tags
change no output. Each reply and its logprobs are compared with the same prompt
computed from scratch by an engine with prefix caching off."""

from __future__ import annotations

import time

import pytest
from engine_runs import assert_same_output, run_one, tokens

from kvtierd.engine.llm_engine import PUBLIC_NAMESPACE

SYSTEM = {"role": "system", "content": "You are a terse assistant for a KV-cache daemon. " * 3}


@pytest.fixture
def cold(loaded, make_engine):
    engine = make_engine(enable_prefix_caching=False)
    return lambda prompt: run_one(engine, prompt)


def test_session_turns_compute_only_new_tokens_and_change_nothing(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = make_engine()
    messages = [SYSTEM, {"role": "user", "content": "What is a KV page?"}]
    previous = 0
    for question in ("And a page table?", "Why copy on write?", "Thanks."):
        prompt = tok.encode_chat(messages)
        warm = run_one(engine, prompt, session_id="s1")
        assert_same_output(warm, cold(prompt))
        if previous:
            # Everything the last turn computed that this prompt starts with, to the token.
            common = next((i for i, (a, b) in enumerate(zip(prompt, previous)) if a != b), len(previous))
            assert warm[0].num_cached_tokens == common and warm[0].cache_source == "session"
        reply = tok.decode(tokens(warm))
        previous = prompt + tokens(warm)[:-1]  # the last token is sampled, never computed
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def test_an_edited_history_reuses_up_to_the_first_differing_token(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = make_engine()
    original = [SYSTEM, {"role": "user", "content": "Describe the block pool in one line."}]
    first = run_one(engine, tok.encode_chat(original), session_id="s")
    edited = [SYSTEM, {"role": "user", "content": "Describe the scheduler in one line."}]
    prompt = tok.encode_chat(edited)
    first_diff = next(i for i, (a, b) in enumerate(zip(prompt, tok.encode_chat(original))) if a != b)
    warm = run_one(engine, prompt, session_id="s")
    assert warm[0].num_cached_tokens == first_diff and warm[0].cache_source == "session"
    assert first_diff % engine.config.block_size != 0  # inside a page: more than the prefix index could give
    assert_same_output(warm, cold(prompt))
    assert tokens(first)  # the original turn ran


def test_a_prompt_cached_to_its_last_token_computes_that_token_alone_and_changes_nothing(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = make_engine()
    bs = engine.config.block_size
    ids = tok.encode_chat([SYSTEM, {"role": "user", "content": "Why page the KV cache?"}])
    prompt = ids[: len(ids) // bs * bs]  # whole pages: each is indexed once computed
    first = run_one(engine, prompt)
    again = run_one(engine, prompt)
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == len(prompt) - 1 and again[0].cache_source == "prefix"
    assert_same_output(again, cold(prompt))


def test_a_public_prefix_is_hit_by_every_tenant_and_changes_nothing(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = make_engine()
    run_one(engine, tok.encode_chat([SYSTEM], add_generation_prompt=False), tenant=PUBLIC_NAMESPACE)
    for tenant in ("alice", "bob"):
        prompt = tok.encode_chat([SYSTEM, {"role": "user", "content": f"Hello from {tenant}."}])
        warm = run_one(engine, prompt, tenant=tenant)
        assert warm[0].cache_source == "public" and warm[0].num_cached_tokens >= 32
        assert_same_output(warm, cold(prompt))
    # What alice computed after the public part is hers: bob's identical prompt gets only the public pages.
    prompt = tok.encode_chat([SYSTEM, {"role": "user", "content": "The same long question, asked by both. " * 3}])
    alice = run_one(engine, prompt, tenant="alice")
    again = run_one(engine, prompt, tenant="alice")
    bob = run_one(engine, prompt, tenant="bob")
    assert again[0].num_cached_tokens > bob[0].num_cached_tokens == alice[0].num_cached_tokens


def test_invalidating_a_tag_makes_its_document_miss(loaded, make_engine):
    tok = loaded.tokenizer
    engine = make_engine()
    doc = "Release notes, version 3: pages are now 16 tokens. " * 6
    def ask(q, tag=None):
        return run_one(engine, tok.encode_chat([{"role": "user", "content": doc + q}]), tag=tag)

    ask("Summarise.", tag="doc:v3")
    assert ask("What changed?")[0].num_cached_tokens >= 64
    assert engine.invalidate_tag("doc:v3") > 0
    assert ask("What changed?")[0].num_cached_tokens == 0


def test_after_a_model_change_nothing_hits(loaded, make_engine):
    prompt = loaded.tokenizer.encode_chat([SYSTEM, {"role": "user", "content": "Hi"}])
    engine = make_engine()
    run_one(engine, prompt, session_id="s")
    assert engine.invalidate_model("another-model") == 0
    assert run_one(engine, prompt)[0].num_cached_tokens > 0
    assert engine.invalidate_model(loaded.fingerprint) > 0
    assert run_one(engine, prompt, session_id="s")[0].num_cached_tokens == 0


def test_an_idle_session_loses_its_kv(loaded, make_engine):
    tok = loaded.tokenizer
    engine = make_engine(session_idle_ttl_s=0.2)
    prompt = tok.encode_chat([{"role": "user", "content": "A private question nobody else asks. " * 4}])
    run_one(engine, prompt, session_id="s")
    assert engine.session_view("s") is not None
    time.sleep(0.25)
    engine.kv.expire()
    assert engine.session_view("s") is None
    assert run_one(engine, prompt, session_id="s")[0].num_cached_tokens == 0
