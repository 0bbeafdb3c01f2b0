"""Running one request through an engine to the end, and comparing two runs' outputs exactly."""

from __future__ import annotations

import pytest

from kvtierd.engine.sampling_params import SamplingParams

# Greedy with logprobs: the tokens and their probabilities must match between a cached and a cold run.
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=2)


def run_one(engine, prompt, params: SamplingParams = PARAMS, looked_up: bool = False, **request) -> list:
    """The request's outputs; `request` goes to add_request (tenant, session_id, tag). `looked_up`: its lookup of
    the lower tiers (started as it arrives) answers before the first step, whatever the deadline."""
    rid = engine.add_request(prompt, params, **request)
    if looked_up:
        engine.tiers.transfers.wait_lookups()
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_same_output(warm, cold) -> None:
    assert tokens(warm) == tokens(cold)
    for w, c in zip(warm, cold):
        assert w.logprobs[0].logprob == pytest.approx(c.logprobs[0].logprob, abs=1e-3)
        assert [t for t, _ in w.logprobs[0].top] == [t for t, _ in c.logprobs[0].top]
