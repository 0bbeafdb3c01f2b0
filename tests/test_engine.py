"""Engine behaviour on the real model: scheduling, preemption, stopping, sampling, errors."""

from __future__ import annotations

import pytest

from kvtierd.engine.errors import RequestError
from kvtierd.engine.request import FinishReason
from kvtierd.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_preempted_requests_resume_with_identical_output(loaded, make_engine):
    prompts = [chat(loaded, f"Tell me fact number {i} about paging.") for i in range(6)]
    roomy = make_engine(block_size=4, kv_tokens=2048).generate(prompts, GREEDY)
    # Room for about three of the six sequences at full length: preemption must happen.
    tight = make_engine(block_size=4, kv_tokens=3 * (len(prompts[0]) + 16))
    ids = [tight.add_request(p, GREEDY) for p in prompts]
    outs = run(tight)
    assert [[t for o in outs[i] for t in o.token_ids] for i in ids] == roomy
    assert tight.kv.num_free_blocks == tight.kv.pool.num_blocks


def test_preemption_is_counted(loaded, make_engine):
    engine = make_engine(block_size=4, kv_tokens=2 * (len(chat(loaded, "x" * 5)) + 40))
    reqs = [engine.add_request(chat(loaded, f"Story {i}"), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(4)]
    preempted = 0
    while engine.has_unfinished():
        plan_before = {r: engine.requests[r].num_preemptions for r in engine.requests}
        engine.step()
        preempted += sum(
            engine.requests[r].num_preemptions - n for r, n in plan_before.items() if r in engine.requests
        )
    assert preempted > 0 and len(reqs) == 4


def test_a_request_that_can_never_fit_is_refused_with_a_clear_error(loaded, make_engine):
    engine = make_engine(block_size=16, kv_tokens=64)
    with pytest.raises(RequestError, match="can never fit the KV cache"):
        engine.add_request(chat(loaded, "hello"), SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="context window"):
        make_engine().add_request([1] * 8190, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([loaded.config.vocab_size], SamplingParams(max_tokens=1))
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_invalid_sampling_params_name_the_parameter():
    for kwargs, param in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0.0}, "top_p"), ({"top_logprobs": 21}, "top_logprobs"), ({"stop": ("",)}, "stop")]:
        with pytest.raises(RequestError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param


def test_abort_frees_pages_at_once(loaded, make_engine):
    engine = make_engine()
    rid = engine.add_request(chat(loaded, "A long story please."), SamplingParams(max_tokens=100, temperature=0.0))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.pool.num_blocks
    engine.abort_request(rid)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks and not engine.has_unfinished()


def test_finish_reasons(loaded, make_engine):
    engine = make_engine()
    p = chat(loaded, "What is the capital of France?")
    (free_run,) = engine.generate([p], SamplingParams(max_tokens=40, temperature=0.0))
    assert free_run[-1] in loaded.tokenizer.eos_token_ids  # the model ends its answer

    outs = run_one(engine, p, SamplingParams(max_tokens=3, temperature=0.0))
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 3

    outs = run_one(engine, p, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(free_run[2],)))
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].num_output_tokens == 3

    full_text = loaded.tokenizer.decode(free_run)
    stop = full_text.split()[2]
    outs = run_one(engine, p, SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,)))
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert stop not in text and full_text.startswith(text)


def run_one(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    return run(engine)[rid]


def test_streamed_text_equals_the_decoded_tokens(loaded, make_engine):
    engine = make_engine()
    outs = run_one(engine, chat(loaded, "Say hello in French and Japanese."), SamplingParams(max_tokens=30, temperature=0.0))
    tokens = [t for o in outs for t in o.token_ids]
    assert "".join(o.text for o in outs) == loaded.tokenizer.decode(tokens)


def test_seeded_sampling_is_reproducible_and_batch_independent(loaded, make_engine):
    p = chat(loaded, "Invent a name for a cat.")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = make_engine().generate([p], params)[0]
    crowd = make_engine().generate([chat(loaded, "Other request"), p, chat(loaded, "Third")], params)[1]
    assert alone == crowd
    other_seed = make_engine().generate([p], SamplingParams(max_tokens=12, temperature=1.0, seed=8))[0]
    assert other_seed != alone


def test_top_k_one_is_greedy(loaded, make_engine):
    p = chat(loaded, "Name a planet.")
    greedy = make_engine().generate([p], SamplingParams(max_tokens=8, temperature=0.0))[0]
    top1 = make_engine().generate([p], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3))[0]
    assert greedy == top1


def test_logprobs_and_top_alternatives(loaded, make_engine):
    outs = run_one(make_engine(), chat(loaded, "Hi"), SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3))
    for o in outs:
        (lp,) = o.logprobs
        assert len(lp.top) == 3 and lp.logprob <= 0
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)  # greedy picks the best
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert run_one(make_engine(), chat(loaded, "Hi"), SamplingParams(max_tokens=2, temperature=0.0))[0].logprobs == []


def test_prefix_reuse_computes_only_new_tokens_and_changes_nothing(loaded, make_engine):
    doc = "Paged attention stores the KV cache in fixed-size pages. " * 6
    first = chat(loaded, doc + "Summarise this.")
    second = chat(loaded, doc + "What is a page?")
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)
    cold = run_one(make_engine(), second, params)

    engine = make_engine()
    run_one(engine, first, params)
    warm = run_one(engine, second, params)
    assert warm[-1].num_cached_tokens >= 64 and cold[-1].num_cached_tokens == 0
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    for w, c in zip(warm, cold):
        assert w.logprobs[0].logprob == pytest.approx(c.logprobs[0].logprob, abs=1e-3)


def test_tenants_do_not_share_cached_pages(loaded, make_engine):
    p = chat(loaded, "A shared document about caches. " * 8)
    engine = make_engine()
    engine.add_request(p, GREEDY, tenant="alice")
    run(engine)
    bob = engine.add_request(p, GREEDY, tenant="bob")
    assert run(engine)[bob][-1].num_cached_tokens == 0
    alice = engine.add_request(p, GREEDY, tenant="alice")
    assert run(engine)[alice][-1].num_cached_tokens > 0


def test_prefix_caching_can_be_turned_off(loaded, make_engine):
    p = chat(loaded, "The same long question about caches, asked twice. " * 4)
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request(p, GREEDY)
    run(engine)
    again = engine.add_request(p, GREEDY)
    assert run(engine)[again][-1].num_cached_tokens == 0


def test_the_eviction_policy_and_prefix_ttl_reach_the_prefix_cache(loaded, make_engine):
    p = chat(loaded, "A question about caches, asked twice after a while. " * 3)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    keep = make_engine(block_size=4, eviction_policy="cost")
    assert keep.kv.pool.eviction_policy == "cost"
    run_one(keep, p, short)
    assert run_one(keep, p, short)[-1].num_cached_tokens > 0
    forget = make_engine(block_size=4, eviction_policy="lfu", prefix_ttl_s=1e-6)  # expired as soon as idle
    run_one(forget, p, short)
    assert run_one(forget, p, short)[-1].num_cached_tokens == 0
    assert forget.kv.pool.evictions.expired > 0


def test_requests_sent_together_share_a_document_being_computed(loaded, make_engine):
    doc = "Section 4 explains how pages are shared between requests. " * 12
    prompts = [chat(loaded, doc + f"Question {i}: what is section {i} about?") for i in range(4)]
    engine = make_engine(kv_tokens=4096)
    ids = [engine.add_request(p, SamplingParams(max_tokens=1, temperature=0.0)) for p in prompts]
    outs = run(engine)
    cached = [outs[i][-1].num_cached_tokens for i in ids]
    # The first computes the document; the others wait for its pages instead of computing them again.
    assert cached[0] == 0 and all(c >= 96 for c in cached[1:]), cached


def test_a_vanishing_temperature_is_greedy_not_a_crash(loaded, make_engine):
    """Found by the API fuzzer: logits / 5e-324 overflow to inf and sampling failed the whole step."""
    p = chat(loaded, "Name a planet.")
    greedy = make_engine().generate([p], SamplingParams(max_tokens=6, temperature=0.0))[0]
    for t in (5e-324, 1e-30, 1e-5):
        assert make_engine().generate([p], SamplingParams(max_tokens=6, temperature=t, seed=1))[0] == greedy


def test_a_vanishing_top_p_keeps_the_best_token_not_a_crash(loaded, make_engine):
    """Found by the API fuzzer: a top_p under float32's least value compared as 0, every token was dropped and
    sampling failed the whole step. The nucleus always holds the best token: so tiny a top_p is greedy."""
    p = chat(loaded, "Name a planet.")
    greedy = make_engine().generate([p], SamplingParams(max_tokens=6, temperature=0.0))[0]
    for top_p in (5e-324, 1e-300):
        params = SamplingParams(max_tokens=6, temperature=1.0, top_p=top_p, seed=1)
        assert make_engine().generate([p], params)[0] == greedy
