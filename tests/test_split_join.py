"""A split join on the real model: a cached prompt's last token, due beside running decodes, goes through the
first half of the layers in one step and the rest in the next. Its tokens and logprobs are those it gets
alone, the streams' are those they get without it, and it leaves no page behind (aborted between its parts
too)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kvtierd.engine.sampling_params import SamplingParams

STREAM = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


class Recorder:
    """Steps an engine and keeps every request's outputs."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.outs: dict[str, list] = defaultdict(list)

    def step(self) -> list:
        outs = self.engine.step()
        for o in outs:
            self.outs[o.request_id].append(o)
        return outs

    def finish(self) -> None:
        while self.engine.has_unfinished():
            self.step()

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outs[rid] for t in o.token_ids]

    def logprobs(self, rid: str) -> list:
        return [lp for o in self.outs[rid] for lp in o.logprobs]


@pytest.fixture
def make_engine(make_engine):
    """Engines in which any context splits: the test's are far shorter than those that split by their cost."""

    def make(**kw):
        engine = make_engine(**kw)
        engine.scheduler.join_split_share = 0.0
        return engine

    return make


@pytest.fixture
def long_prompt(loaded) -> list[int]:
    """Whole pages: cached, all of it is found but its last token, which is left to compute (a one-token rest)."""
    ids = chat(loaded, "Summarise this. " + "The pages hold the keys and values. " * 30)
    return ids[: len(ids) // 16 * 16]


def started(engine, loaded, long_prompt: list[int]) -> tuple[Recorder, list[str]]:
    """`engine` with `long_prompt`'s pages cached and two streams decoding, and their ids."""
    engine.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))
    run = Recorder(engine)
    streams = [engine.add_request(chat(loaded, f"Count from {i} to twenty."), STREAM) for i in range(2)]
    while not all(engine.requests[s].num_output_tokens for s in streams):
        run.step()
    return run, streams


def test_a_split_join_gives_the_tokens_and_logprobs_the_prompt_gets_alone(loaded, make_engine,
                                                                          long_prompt):
    alone = Recorder(make_engine())
    alone.engine.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))  # its last token: a decode
    reference = alone.engine.add_request(long_prompt, LONG)
    alone.finish()
    plain, plain_streams = started(make_engine(), loaded, long_prompt)
    plain.finish()

    run, streams = started(make_engine(), loaded, long_prompt)
    rid = run.engine.add_request(long_prompt, LONG)
    req = run.engine.requests[rid]
    outs = run.step()  # admitted: its last token through the first half of the layers, the streams' tokens
    assert req.join_hidden is not None and req.num_computed_tokens == len(long_prompt) - 1
    assert {o.request_id for o in outs} == set(streams)
    run.step()  # the rest of them: its first token
    assert req.join_hidden is None and len(run.outs[rid]) == 1
    run.finish()

    assert run.tokens(rid) == alone.tokens(reference)
    for got, want in zip(run.logprobs(rid), alone.logprobs(reference), strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert [run.tokens(s) for s in streams] == [plain.tokens(s) for s in plain_streams]
    assert run.engine.kv.num_free_blocks == run.engine.kv.pool.num_blocks


def test_without_running_decodes_a_cached_prompt_last_token_is_not_split(loaded, make_engine,
                                                                        long_prompt):
    engine = make_engine()
    engine.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))
    rid = engine.add_request(long_prompt, LONG)
    outs = engine.step()
    assert [o for o in outs if o.request_id == rid]  # its first token in the step it was admitted in


def test_a_request_aborted_between_the_parts_of_its_join_leaves_no_page_and_the_streams_go_on(
        loaded, make_engine, long_prompt):
    run, streams = started(make_engine(), loaded, long_prompt)
    rid = run.engine.add_request(long_prompt, LONG)
    run.step()
    assert run.engine.requests[rid].join_hidden is not None
    run.engine.abort_request(rid)
    run.finish()
    assert all(run.outs[s][-1].finished for s in streams) and not run.outs[rid]
    assert run.engine.kv.num_free_blocks == run.engine.kv.pool.num_blocks


def alone_tokens(engine, cached: list[int], prompt: list[int]) -> list[int]:
    """`prompt`'s tokens (LONG) on `engine` with `cached`'s pages cached and nothing else running."""
    engine.generate([cached], SamplingParams(max_tokens=1, temperature=0.0))
    run = Recorder(engine)
    rid = engine.add_request(prompt, LONG)
    run.finish()
    return run.tokens(rid)


def one_stream_with_its_last_token_due(engine, loaded, cached: list[int]) -> tuple[Recorder, str]:
    """`engine` with `cached`'s pages cached and a stream of two tokens that has its first: its next step is
    its last."""
    engine.generate([cached], SamplingParams(max_tokens=1, temperature=0.0))
    run = Recorder(engine)
    stream = engine.add_request(chat(loaded, "Count to three."), SamplingParams(max_tokens=2, temperature=0.0,
                                                                                 ignore_eos=True))
    while not engine.requests[stream].num_output_tokens:
        run.step()
    return run, stream


def test_a_split_join_whose_streams_end_with_its_first_part_takes_the_rest_alone(loaded, make_engine,
                                                                                long_prompt):
    expected = alone_tokens(make_engine(), long_prompt, long_prompt)
    engine = make_engine()
    run, stream = one_stream_with_its_last_token_due(engine, loaded, long_prompt)
    rid = engine.add_request(long_prompt, LONG)
    req = engine.requests[rid]
    run.step()  # its first part, and the stream's last token
    assert req.join_hidden is not None and run.outs[stream][-1].finished
    run.step()  # the rest of its layers with nothing else to run
    assert req.join_hidden is None and len(run.outs[rid]) == 1
    run.finish()
    assert run.tokens(rid) == expected
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_a_one_token_piece_of_a_longer_prefill_is_not_split(loaded, make_engine, long_prompt):
    """A step's room can cut a prompt's prefill to one token beside the decodes: that token is no join (the
    prompt has more to compute), and when the room grows the next step its next piece is longer than one."""
    prompt = long_prompt + chat(loaded, "Why?")[-3:]  # cached pages, then three tokens to compute
    expected = alone_tokens(make_engine(), long_prompt, prompt)
    engine = make_engine(max_num_batched_tokens=2)  # a decode and one token of a prefill
    run, stream = one_stream_with_its_last_token_due(engine, loaded, long_prompt)
    rid = engine.add_request(prompt, LONG)
    req = engine.requests[rid]
    run.step()  # the stream's last token, and one token of the prompt's three
    assert run.outs[stream][-1].finished and req.num_computed_tokens == len(long_prompt) + 1
    assert req.join_hidden is None
    run.step()  # the room is the prompt's alone: its other two tokens in one piece
    assert req.num_computed_tokens == len(prompt)
    run.finish()
    assert run.tokens(rid) == expected
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
