"""Time-bounded steps: the scheduler on a real KV cache manager, with step costs injected into the cost model
(no clock is read: the hold uses a fake one). The engine is played by `Sim`: it applies each plan as the
model runner and the sampler would."""

from __future__ import annotations

import pytest

from fake_clock import FakeClock
from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.loading import LoadTicket
from kvtierd.engine.config import QosConfig
from kvtierd.engine.request import Request
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.engine.scheduler import HELD_STEP_DECODES, LOWER_JOIN_EVERY, RESTORED_STEP_SHARE, Scheduler, StepPlan
from kvtierd.engine.step_cost import StepCost, StepCostModel, StepShape
from kvtierd.tiers.restore_planner import NOTHING_BELOW

ROOT = namespace_root("model-1", "")
BLOCK = 16
TOKENS_PER_STEP = 512
# 10 ms a step, 1 ms a prefill token, 0.5 ms a decode: a full step of prefill costs 522 ms.
COST = StepCost(overhead_s=0.010, prefill_token_s=0.001, decode_token_s=0.0005)
OFF = {"high": 0.0, "normal": 0.0, "low": 0.0}


class Sim:
    def __init__(self, step_budget_ms: dict, hold_s: float = 2.0, num_blocks: int = 1024,
                 cost: StepCost = COST, prefill_share: float = 0.0, chunk_beside_decodes: int = 0) -> None:
        self.clock = FakeClock(100.0)
        self.cost = StepCostModel(prior=cost)  # nothing observed: its costs are the prior's
        self.scheduler = Scheduler(KVCacheManager(num_blocks, BLOCK, public_root=ROOT), TOKENS_PER_STEP, 64,
                                   qos=QosConfig(step_budget_ms=step_budget_ms, step_budget_hold_s=hold_s),
                                   step_cost=self.cost, clock=self.clock, prefill_share=prefill_share,
                                   prefill_chunk_beside_decodes=chunk_beside_decodes)
        self.requests: dict[str, Request] = {}
        self.token = 1000

    def add(self, rid: str, qos_class: str, prompt_len: int, max_tokens: int, history: list[int] = ()) -> Request:
        # Distinct prompts (past a `history` they continue): nothing else is shared through the prefix cache.
        prompt = [*history, *range(self.token, self.token + prompt_len)]
        self.token += prompt_len
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), None, self.clock.now, ROOT,
                      qos_class=qos_class)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def step(self) -> StepPlan:
        """Plans a step and applies it; a step takes a simulated 0.1 s."""
        plan = self.scheduler.schedule()
        for s in plan.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.scheduler.kv.commit(req.request_id, req.cache_root, req.token_ids, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(7)
                if req.num_output_tokens >= req.params.max_tokens:
                    self.scheduler.remove(req)
                    del self.requests[req.request_id]
        self.clock.advance(0.1)
        return plan

    def run(self) -> list[StepPlan]:
        plans = []
        while self.requests:
            plans.append(self.step())
            assert len(plans) < 500
        return plans


def ids(plan: StepPlan) -> set[str]:
    return {s.request.request_id for s in plan.scheduled}


def tokens_of(plan: StepPlan, rid: str) -> int:
    return sum(s.num_new_tokens for s in plan.scheduled if s.request.request_id == rid)


@pytest.mark.parametrize("qos_class", ["low", "high"])
def test_with_one_class_only_steps_are_as_today(qos_class):
    """Budgets on (auto, or 50 ms) change nothing when no other class is present: the same steps as with them
    off, and prefill in full chunks of the token budget."""
    runs = []
    for budget in (OFF, {"high": None, "normal": None, "low": None}, {"high": 50.0, "normal": 50.0, "low": 50.0}):
        sim = Sim(budget)
        for i in range(3):
            sim.add(f"r{i}", qos_class, prompt_len=700, max_tokens=4)
        runs.append([(sorted(ids(p)), p.num_tokens) for p in sim.run()])
    assert runs[0] == runs[1] == runs[2]
    assert [n for _, n in runs[0][:4]] == [TOKENS_PER_STEP] * 4  # 2,100 prompt tokens in steps of 512


def test_a_high_request_arriving_during_a_low_flood_is_in_the_next_step():
    """Running lows fill the token budget with prefill, more wait; a high request added now is admitted into
    the very next step with its whole prompt, ahead of the low chunks (step budgets off: admission order alone)."""
    sim = Sim(OFF)
    for i in range(6):
        sim.add(f"low{i}", "low", prompt_len=1000, max_tokens=64)
    first = sim.step()
    assert first.num_tokens == TOKENS_PER_STEP and "high" not in ids(first)
    sim.add("high", "high", prompt_len=40, max_tokens=8)
    plan = sim.step()
    assert tokens_of(plan, "high") == 40
    assert plan.num_tokens == TOKENS_PER_STEP  # the lows get what is left


def test_a_step_stays_within_its_budget_while_a_high_request_waits_or_runs():
    budget_ms = 100.0
    sim = Sim({"high": budget_ms, "normal": 0.0, "low": 0.0})
    for i in range(6):
        sim.add(f"low{i}", "low", prompt_len=1000, max_tokens=8)
    assert sim.step().num_tokens == TOKENS_PER_STEP  # no high yet: a full step
    sim.add("high", "high", prompt_len=40, max_tokens=8)
    plans = []
    while "high" in sim.requests:
        plans.append(sim.step())
    assert tokens_of(plans[0], "high") == 40 and all(tokens_of(p, "high") == 1 for p in plans[1:])
    assert len(plans) == 8  # its prefill, then one decode a step: never starved by low prefill
    for p in plans:
        assert COST.seconds(p.shape) <= budget_ms / 1e3 + 1e-9
        assert p.num_tokens > tokens_of(p, "high")  # the lows still move, in finer chunks
    assert max(s.num_new_tokens for p in plans for s in p.prefills if s.request.qos_class == "low") < 100


def test_an_auto_budget_lets_the_lower_classes_join_one_top_class_step_in_a_few_within_one_decode():
    sim = Sim({"high": None, "normal": None, "low": None})
    one_decode = COST.seconds(StepShape(num_decodes=1))  # 10.5 ms
    for i in range(4):
        sim.add(f"low{i}", "low", prompt_len=1000, max_tokens=8)
    for i in range(3):
        sim.add(f"normal{i}", "normal", prompt_len=300, max_tokens=30)
    sim.add("high", "high", prompt_len=40, max_tokens=2 * LOWER_JOIN_EVERY)
    plans = [sim.step() for _ in range(2 * LOWER_JOIN_EVERY)]
    own = [StepShape(num_prefill_tokens=40)] + [StepShape(num_decodes=1)] * (2 * LOWER_JOIN_EVERY - 1)
    for i, (p, shape) in enumerate(zip(plans, own), start=1):
        assert tokens_of(p, "high") == shape.num_prefill_tokens + shape.num_decodes
        if i % LOWER_JOIN_EVERY:
            assert len(p.scheduled) == 1  # the top class's work alone: its steps stay short
        else:
            assert len(p.scheduled) > 1  # the others move too
            assert COST.seconds(p.shape) <= COST.seconds(shape) + one_decode + 1e-9
    # With high gone (and its hold over), normal is the top class: it runs unbounded, low is cut.
    sim.clock.advance(10.0)
    p = sim.step()
    assert p.num_tokens == TOKENS_PER_STEP and {s.request.qos_class for s in p.scheduled} == {"normal"}


def test_an_auto_budget_held_by_a_gone_high_request_allows_a_few_lone_decodes():
    """High gone (its hold not over): the lows' steps may cost HELD_STEP_DECODES lone decodes, more than while
    it ran; a high request arriving again brings back its own work plus one decode."""
    sim = Sim({"high": None, "normal": None, "low": None}, hold_s=2.0)
    one_decode = COST.seconds(StepShape(num_decodes=1))
    for i in range(6):
        sim.add(f"low{i}", "low", prompt_len=1000, max_tokens=8)
    sim.add("high", "high", prompt_len=40, max_tokens=2)
    running = [sim.step(), sim.step()]
    assert "high" not in sim.requests
    held = [sim.step() for _ in range(5)]
    assert all(COST.seconds(p.shape) <= HELD_STEP_DECODES * one_decode + 1e-9 for p in held)
    assert min(COST.seconds(p.shape) for p in held) > COST.seconds(running[1].shape)  # more room than while it ran
    sim.add("high2", "high", prompt_len=40, max_tokens=3)
    sim.step()
    p = sim.step()  # its decode
    assert tokens_of(p, "high2") == 1 and COST.seconds(p.shape) <= 2 * one_decode + 1e-9


def test_steps_stay_bounded_for_the_hold_after_the_last_high_request_then_full_chunks_return():
    sim = Sim({"high": 60.0, "normal": 0.0, "low": 0.0}, hold_s=2.0)
    for i in range(20):
        sim.add(f"low{i}", "low", prompt_len=1000, max_tokens=2)
    sim.add("high", "high", prompt_len=20, max_tokens=1)
    sim.step()
    assert "high" not in sim.requests
    bounded = [sim.step() for _ in range(19)]  # 1.9 s of simulated steps after it left
    assert all(COST.seconds(p.shape) <= 0.060 + 1e-9 for p in bounded)
    sim.clock.advance(1.0)  # past the hold
    assert sim.step().num_tokens == TOKENS_PER_STEP


def restored(sim: Sim, history_len: int, new_len: int) -> Request:
    """A request whose first `history_len` prompt tokens were loaded from below: they are in the prefix index
    (computed here by an earlier request), and it is admitted with them as its loaded prefix."""
    history = sim.add("history", "normal", prompt_len=history_len, max_tokens=1).prompt_token_ids
    while "history" in sim.requests:
        sim.step()
    req = sim.add("restored", "normal", prompt_len=new_len, max_tokens=2, history=history)
    # What its loads left it when they arrived (cache/loading.py): its history, loaded from disk.
    req.loaded = LoadTicket([], [], [], NOTHING_BELOW, False, None, 0, tokens_by_tier={"disk": history_len})
    return req


def test_a_restored_request_computes_its_rest_in_pieces_within_a_share_of_the_decoding_streams_step():
    """Streams decoding, a request admitted with 2,048 tokens loaded and 16 to compute: its rest goes in
    pieces, each keeping the step within RESTORED_STEP_SHARE of the streams' own step."""
    sim = Sim(OFF)
    for i in range(3):
        sim.add(f"stream{i}", "normal", prompt_len=40, max_tokens=100)
    sim.step()
    req = restored(sim, history_len=2048, new_len=16)
    plans = []
    while req.num_computed_tokens < req.num_prompt_tokens:
        plans.append(sim.step())
    pieces = [tokens_of(p, "restored") for p in plans]
    assert req.num_cached_tokens == 2048 and req.tokens_from_below == {"disk": 2048}
    assert pieces[0] > 0  # admitted at once with its loaded prefix
    assert sum(pieces) == 16 and all(pieces) and len(pieces) > 1
    for p in plans:
        streams = StepShape(num_decodes=sum(s.request.request_id.startswith("stream") for s in p.scheduled))
        assert streams.num_decodes == 3  # never left out
        assert COST.seconds(p.shape) <= (1 + RESTORED_STEP_SHARE) * COST.seconds(streams) + 1e-9


def test_a_restored_request_with_a_long_rest_or_alone_computes_it_in_full_chunks():
    """A rest that would take more than RESTORED_MAX_PIECES pieces (1,500 new tokens): full chunks, as for a
    load that missed its deadline; with nobody else decoding, nothing to spare: full chunks too."""
    sim = Sim(OFF)
    for i in range(3):
        sim.add(f"stream{i}", "normal", prompt_len=40, max_tokens=100)
    sim.step()
    restored(sim, history_len=2048, new_len=1500)
    assert tokens_of(sim.step(), "restored") == TOKENS_PER_STEP - 3
    alone = Sim(OFF)
    restored(alone, history_len=2048, new_len=16)
    assert tokens_of(alone.step(), "restored") == 16


def streams_cost(plan: StepPlan) -> float:
    """What the streams' decodes in `plan` cost alone (prompts of 40 tokens, so their contexts are short)."""
    decodes = [s for s in plan.decodes if s.request.request_id.startswith("stream")]
    return COST.seconds(StepShape(0, len(decodes), sum(s.context_len for s in decodes)))


def test_with_a_prefill_share_a_prompt_beside_decoding_streams_goes_in_pieces_within_it():
    """prefill_share 0.25: a 400-token prompt sent while three chat streams decode computes in pieces that
    keep every step within 1.25x the streams' decodes alone, also once each stream's next request (admitted
    after the prompt, so behind it in the running order; the streams' turns end apart) decodes; once the streams end, the rest goes in one
    chunk. Without the share, the same prompt takes its chunk whole beside them."""
    sim = Sim(OFF, prefill_share=0.25)
    for i in range(3):
        sim.add(f"stream{i}-0", "normal", prompt_len=40, max_tokens=8 + i)  # turns of 8, 9, 10 steps
    sim.step()
    prompt = sim.add("prompt", "normal", prompt_len=400, max_tokens=2)
    pieces, turns = [], 0
    while turns < 30:
        plan = sim.step()
        pieces.append(tokens_of(plan, "prompt"))
        streams = [s for s in plan.scheduled if s.request.request_id.startswith("stream")]
        assert len(streams) == 3 and all(s.num_new_tokens == 1 for s in streams)
        shape = StepShape(0, 3, sum(s.context_len for s in streams))
        assert COST.seconds(plan.shape) <= 1.25 * COST.seconds(shape) + 1e-9
        for i in range(3):  # a stream's next turn: one new token, as short as a decode
            if not any(r.startswith(f"stream{i}-") for r in sim.requests):
                turns += 1
                sim.add(f"stream{i}-{turns}", "normal", prompt_len=1, max_tokens=8 + i)
    assert 0 < max(pieces) < 10 and all(pieces) and prompt.num_computed_tokens < 400
    while any(r.startswith("stream") for r in sim.requests):
        sim.step()
    left = prompt.num_prompt_tokens - prompt.num_computed_tokens
    assert tokens_of(sim.step(), "prompt") == left

    off = Sim(OFF)
    for i in range(3):
        off.add(f"stream{i}", "normal", prompt_len=40, max_tokens=60)
    off.step()
    off.add("prompt", "normal", prompt_len=400, max_tokens=2)
    assert tokens_of(off.step(), "prompt") == 400


def test_a_prefill_share_keeps_a_prompt_within_it_beside_its_own_class_or_a_higher_one_only():
    """A high prompt beside normal streams takes its chunk whole; a low one is cut beside them."""
    sim = Sim(OFF, prefill_share=0.25)
    for i in range(3):
        sim.add(f"stream{i}", "normal", prompt_len=40, max_tokens=60)
    sim.step()
    sim.add("high", "high", prompt_len=300, max_tokens=2)
    sim.add("low", "low", prompt_len=300, max_tokens=2)
    plan = sim.step()
    assert tokens_of(plan, "high") == 300 and tokens_of(plan, "low") == 0
    plan = sim.step()  # the high one decodes now: the low prompt is cut to the share over all four decodes
    decodes = [s for s in plan.decodes if s.request.request_id != "low"]
    assert len(decodes) == 4 and 0 < tokens_of(plan, "low") < 10
    assert COST.seconds(plan.shape) <= 1.25 * COST.seconds(StepShape(0, 4, sum(s.context_len for s in decodes)))


def test_a_prompt_beside_decoding_streams_goes_in_chunks_of_its_size_and_alone_in_the_token_budgets():
    """prefill_chunk_beside_decodes 64: a 400-token prompt sent while streams decode computes 64 tokens a step
    beside them (each step one such chunk's); sent alone, it takes the token budget's 512 at once. A high
    prompt beside normal streams is not held to it (as with the share)."""
    sim = Sim(OFF, chunk_beside_decodes=64)
    for i in range(3):
        sim.add(f"stream{i}", "normal", prompt_len=40, max_tokens=60)
    sim.step()
    prompt = sim.add("prompt", "normal", prompt_len=400, max_tokens=2)
    chunks = []
    while prompt.num_computed_tokens < 400:
        plan = sim.step()
        chunks.append(tokens_of(plan, "prompt"))
        assert sum(s.num_new_tokens == 1 for s in plan.scheduled) == 3  # the streams decode in every step
    assert chunks == [64] * 6 + [16]
    sim.add("high", "high", prompt_len=300, max_tokens=2)
    assert tokens_of(sim.step(), "high") == 300

    alone = Sim(OFF, chunk_beside_decodes=64)
    alone.add("prompt", "normal", prompt_len=400, max_tokens=2)
    assert tokens_of(alone.step(), "prompt") == 400


def test_a_high_request_is_not_held_behind_low_ones_that_aged_past_it():
    """Lows waiting long enough outscore a fresh high in the queue (aging); they may be admitted first, but when
    the step's time is spent for them the high one behind still goes into this step."""
    sim = Sim({"high": 30.0, "normal": 0.0, "low": 0.0})
    for i in range(4):
        sim.add(f"low{i}", "low", prompt_len=1000, max_tokens=2)
    sim.step()
    for i in range(4, 8):
        sim.add(f"low{i}", "low", prompt_len=200, max_tokens=2)
    sim.clock.advance(300.0)  # they waited 300 s: weight 1 + 30 beats a fresh high's 8
    sim.add("high", "high", prompt_len=40, max_tokens=2)
    assert sim.scheduler.waiting.peek().qos_class == "low"
    assert tokens_of(sim.step(), "high") == 40


def test_a_high_request_takes_pages_from_running_lows_even_when_waiting_lows_aged_past_it():
    sim = Sim({"high": 100.0, "normal": 0.0, "low": 0.0}, num_blocks=68)
    for i in range(2):
        sim.add(f"low{i}", "low", prompt_len=520, max_tokens=30)
    for _ in range(3):  # no high yet: full steps; the two lows hold 66 of the 68 pages
        sim.step()
    sim.add("low-queued", "low", prompt_len=500, max_tokens=2)
    sim.clock.advance(300.0)  # it outscores a fresh high now
    sim.add("high", "high", prompt_len=40, max_tokens=2)
    assert sim.scheduler.waiting.peek().request_id == "low-queued"
    plan = sim.step()
    assert tokens_of(plan, "high") == 40 and [r.request_id for r in plan.preempted] == ["low1"]


def test_a_budget_below_the_step_overhead_still_moves_the_lower_classes():
    """5 ms cannot hold even a step's fixed 10 ms: with no high request left to run, a held step still carries
    a page of low prefill, so the engine never stalls."""
    sim = Sim({"high": 5.0, "normal": 0.0, "low": 0.0}, hold_s=100.0)
    sim.add("high", "high", prompt_len=20, max_tokens=1)
    sim.step()
    sim.add("low", "low", prompt_len=100, max_tokens=1)
    plans = [sim.step() for _ in range(3)]
    assert [p.num_tokens for p in plans] == [BLOCK] * 3


def test_a_lower_long_prompt_moves_while_the_top_class_decodes_on():
    """Each chunk of a long prompt attends over the prompt so far: past ~100 tokens here that alone costs more
    than the auto budget adds to the high request's step (one decode), and nothing of it would ever fit while
    the high request decodes. One step in LOWER_JOIN_EVERY moves it by a page anyway, so it finishes."""
    sim = Sim({"high": None, "normal": None, "low": None},
              cost=StepCost(overhead_s=0.010, prefill_token_s=0.001, decode_token_s=0.0005, context_token_s=0.0001))
    sim.add("high", "high", prompt_len=20, max_tokens=100_000)
    sim.add("doc", "normal", prompt_len=640, max_tokens=1)
    plans = []
    while "doc" in sim.requests:
        plans.append(sim.step())
        assert len(plans) <= 2 * LOWER_JOIN_EVERY * 640 // BLOCK, "the normal prompt stopped moving"
    assert all(tokens_of(p, "high") >= 1 for p in plans)  # the high request ran every step
    assert all(tokens_of(p, "doc") <= BLOCK for p in plans[LOWER_JOIN_EVERY * 8 :])  # in pages, past its start


# --- the cost model -------------------------------------------------------------------------------------------


def test_the_cost_model_fits_overhead_and_per_token_costs_from_observed_steps():
    truth = StepCost(overhead_s=0.040, prefill_token_s=0.0008, decode_token_s=0.002, context_token_s=0.00001)
    model = StepCostModel()
    # Decodes over short and long contexts, prefill chunks over none or a cached prefix: steps as they come.
    shapes = [StepShape(p, d, p + cached + d * ctx) for p in (0, 16, 128, 512, 2048) for cached in (0, 1000)
              for d in (0, 1, 8, 32) for ctx in (40, 1000) if p or d]
    for _ in range(5):
        for s in shapes:
            model.observe(s, truth.seconds(s))
    fit = model.current
    assert fit.overhead_s == pytest.approx(truth.overhead_s, rel=0.02)
    assert fit.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=0.02)
    assert fit.decode_token_s == pytest.approx(truth.decode_token_s, rel=0.02)
    assert fit.context_token_s == pytest.approx(truth.context_token_s, rel=0.02)
    # A chunk after 200 cached tokens: each of its n tokens costs prefill + context, and its 200 cached ones too.
    shape = StepShape(0, 10, 10 * 100)
    spare = 0.100 - truth.seconds(shape) - 200 * truth.context_token_s  # 28 ms: 34 tokens
    assert abs(fit.prefill_tokens_within(shape, 0.100, 200) - spare / (0.0008 + 0.00001)) <= 1


def test_the_cost_model_follows_a_change_and_keeps_what_it_cannot_see_at_the_prior():
    prior = StepCost(overhead_s=0.02, prefill_token_s=0.001, decode_token_s=0.001)
    model = StepCostModel(prior=prior, half_life_steps=16)
    assert model.current == prior
    slow = StepCost(overhead_s=0.1, prefill_token_s=0.004, decode_token_s=0.003)
    for i in range(200):  # only decodes: the prefill cost cannot be told apart, it stays the prior's
        shape = StepShape(0, 1 + i % 16)
        model.observe(shape, slow.seconds(shape))
    assert model.current.prefill_token_s == pytest.approx(prior.prefill_token_s, rel=0.05)
    assert model.current.seconds(StepShape(0, 8)) == pytest.approx(slow.seconds(StepShape(0, 8)), rel=0.05)
    fast = StepCost(overhead_s=0.01, prefill_token_s=0.0005, decode_token_s=0.0005)
    for i in range(200):  # the machine got faster: the old steps fade
        shape = StepShape(64 * (i % 5), i % 7)
        model.observe(shape, fast.seconds(shape))
    assert model.current.seconds(StepShape(256, 4)) == pytest.approx(fast.seconds(StepShape(256, 4)), rel=0.05)


def test_the_cost_model_keeps_its_coefficients_non_negative():
    model = StepCostModel()
    for n in (1, 2, 4, 8, 16, 32):  # more decodes, less time: a noisy machine can say so
        model.observe(StepShape(0, n), 0.05 - 0.001 * n)
    fit = model.current
    assert min(fit.overhead_s, fit.prefill_token_s, fit.decode_token_s, fit.context_token_s) >= 0


def test_the_cost_model_fits_a_quantized_mode_s_two_regimes_apart():
    """Past 4 tokens a quantized mode's step runs the dense matrices: a regime with its own overhead and
    per-token costs, fitted from its own steps; a chunk that would cross into it is charged for it (or kept
    small enough to stay below)."""
    large = StepCost(overhead_s=0.060, prefill_token_s=0.0003, decode_token_s=0.0006, context_token_s=0.00001)
    truth = StepCost(overhead_s=0.025, prefill_token_s=0.002, decode_token_s=0.002, context_token_s=0.00001,
                     large=large, small_step_max_tokens=4)
    model = StepCostModel(regime_max_tokens=(4,))
    shapes = [StepShape(p, d, p + d * ctx) for p in (0, 1, 2, 3, 8, 16, 64, 512) for d in (0, 1, 2, 8)
              for ctx in (100, 1000) if p or d]
    for _ in range(5):
        for s in shapes:
            model.observe(s, truth.seconds(s))
    fit = model.current
    for s in (StepShape(0, 1, 100), StepShape(3, 1, 1100), StepShape(16, 1, 1100), StepShape(512, 8, 9000)):
        assert fit.seconds(s) == pytest.approx(truth.seconds(s), rel=0.02)
    decode = StepShape(0, 1, 100)
    # 60 ms: one decode (28 ms) leaves no room for a large step (70 ms with one decode), so the chunk stays
    # within the small step's 3 tokens.
    assert fit.prefill_tokens_within(decode, 0.060) == 3
    # 100 ms: a large step, 60.6 + 1 ms of the decode's context, then (100 - 61.6) / 0.31 ms = 123 tokens.
    assert abs(fit.prefill_tokens_within(decode, 0.100) - 123) <= 1
    assert StepCostModel().current.large is None  # a dense mode: one regime


def test_the_cost_model_fits_three_regimes_apart_and_chunks_across_them():
    """int4 with the tile kernel: torch's kernel to 3 tokens (steep per row), the tiles to 48 (nearly flat),
    then the dense matrices. Each span is fitted from its own steps; a chunk is charged for the regime its
    step ends in."""
    dense = StepCost(overhead_s=0.050, prefill_token_s=0.0006, decode_token_s=0.0006, context_token_s=0.00001)
    tiles = StepCost(overhead_s=0.030, prefill_token_s=0.0002, decode_token_s=0.0003, context_token_s=0.00001,
                     large=dense, small_step_max_tokens=48)
    truth = StepCost(overhead_s=0.020, prefill_token_s=0.002, decode_token_s=0.002, context_token_s=0.00001,
                     large=tiles, small_step_max_tokens=3)
    model = StepCostModel(regime_max_tokens=(3, 48))
    shapes = [StepShape(p, d, p + d * ctx) for p in (0, 1, 2, 3, 4, 8, 16, 30, 64, 512) for d in (0, 1, 2, 8)
              for ctx in (100, 1000) if p or d]
    for _ in range(5):
        for s in shapes:
            model.observe(s, truth.seconds(s))
    fit = model.current
    assert (fit.small_step_max_tokens, fit.large.small_step_max_tokens, fit.large.large.large) == (3, 48, None)
    for s in (StepShape(0, 1, 100), StepShape(2, 1, 1100), StepShape(16, 1, 1100), StepShape(512, 8, 9000)):
        assert fit.seconds(s) == pytest.approx(truth.seconds(s), rel=0.02)
    decode = StepShape(0, 1, 100)  # 23 ms alone
    # 30 ms: 2 tokens keep torch's regime; a tile step costs 31.3 ms before any.
    assert fit.prefill_tokens_within(decode, 0.030) == 2
    # 40 ms: a tile step, (40 - 31.3) / 0.21 ms = 41 tokens.
    assert abs(fit.prefill_tokens_within(decode, 0.040) - 41) <= 1
    # 70 ms: the dense regime would take (70 - 51.6) / 0.61 ms = 30, fewer than a tile step's 47.
    assert fit.prefill_tokens_within(decode, 0.070) == 47
    # 100 ms: (100 - 51.6) / 0.61 ms = 79 in the dense regime.
    assert abs(fit.prefill_tokens_within(decode, 0.100) - 79) <= 1


def test_a_flood_of_large_steps_leaves_what_a_lone_decode_costs_as_measured():
    """Under a flood nearly every step is large; what a small step costs (the unit of the step budget) stays
    what small steps measured, however many large steps follow."""
    large = StepCost(overhead_s=0.080, prefill_token_s=0.0003, decode_token_s=0.004, context_token_s=0.00001)
    truth = StepCost(overhead_s=0.025, prefill_token_s=0.002, decode_token_s=0.002, large=large,
                     small_step_max_tokens=4)
    model = StepCostModel(regime_max_tokens=(4,), half_life_steps=16)
    for i in range(50):
        s = StepShape(0, 1, 40 + i)
        model.observe(s, truth.seconds(s))
    for i in range(2000):
        s = StepShape(16 * (i % 8), 8 + i % 5, 8000 + 10 * i)
        model.observe(s, truth.seconds(s))
    assert model.current.seconds(StepShape(0, 1, 60)) == pytest.approx(truth.seconds(StepShape(0, 1, 60)), rel=0.03)


def test_the_budget_s_unit_is_a_lone_decode_as_measured_not_as_extrapolated():
    """Before any lone decode ran, its cost is the fit's prediction; then it is the lower quartile of the last
    ones measured, whatever the flood's steps make the fit say about a step that small."""
    model = StepCostModel(prior=COST)
    assert model.one_decode_s == pytest.approx(COST.seconds(StepShape(0, 1)))
    for seconds in (0.021, 0.019, 0.020, 0.022, 0.090, 0.080, 0.085, 0.075):  # half slowed by arrivals
        model.observe(StepShape(0, 1, 50), seconds)
    for i in range(500):  # long-context steps, all alike: overhead and context cost cannot be told apart
        model.observe(StepShape(0, 4, 4000 + i % 3), 0.070)
    assert model.one_decode_s == pytest.approx(0.021)
    assert model.current.seconds(StepShape(0, 1, 50)) > 0.025  # what the fit alone would have planned with
