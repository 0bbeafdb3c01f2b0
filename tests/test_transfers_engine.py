"""Two-phase loads on the real model: a request whose prefix is below the device waits in the loading state
while the engine steps the others; it shares a chunk's load with another request, gives up at its deadline
and recomputes (the same output), or is cancelled and gives its pages back. Stores copy their pages out
before the pages are reused. Loads are held back by occupying the transfer workers (a barrier job the test
releases), never by waiting on a clock."""

from __future__ import annotations

import threading
from dataclasses import replace
from functools import partial

import engine_runs
import pytest
from engine_runs import assert_same_output
from test_tiers_engine import TOPICS, ask, push_out, tiered

from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.engine.step_cost import StepShape
from kvtierd.tiers.background_work import BACKGROUND_WORK, LEND_SHARE
from kvtierd.tiers.config import TierConfig

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2)
run_one = partial(engine_runs.run_one, params=PARAMS)


class HeldWorkers:
    """Occupies every transfer worker until released: loads submitted meanwhile stay queued."""

    def __init__(self, engine) -> None:
        self.gate = threading.Event()
        transfers = engine.tiers.transfers
        self.jobs = [transfers.run(self.gate.wait) for _ in range(transfers.num_workers)]

    def release(self) -> None:
        self.gate.set()
        for job in self.jobs:
            job.result()


def slow_prefill(engine) -> None:
    """Makes the planner estimate recomputing at about a token a second: a load's deadline is minutes away,
    so a held load is waited for whatever this machine's speed."""
    engine.tiers.planner.recompute_cost = float


def add_looked_up(engine, prompt: list[int], **kw) -> str:
    """Adds a request and waits for its lookup of the lower tiers (started as it arrives) to answer, so its
    admission starts its loads at once."""
    rid = engine.add_request(prompt, PARAMS, **kw)
    engine.tiers.transfers.wait_lookups()
    return rid


def run_rest(engine, rid: str) -> list:
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def prompt_below_the_device(make_engine, tok):
    """A tiered engine and a prompt whose KV it computed and then pushed out of the device to the host tier."""
    engine = tiered(make_engine)
    prompt = ask(tok, TOPICS[0])
    push_out(engine, tok, prompt)
    return engine, prompt


def cold_run(make_engine, prompt) -> list:
    return run_one(make_engine(enable_prefix_caching=False), prompt)


def test_a_loading_request_waits_while_others_step_then_runs_with_the_same_output(loaded, make_engine):
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    slow_prefill(engine)
    held = HeldWorkers(engine)
    rid = add_looked_up(engine, prompt)
    other = engine.add_request(tok.encode("A short question about pages?"), PARAMS)
    steps_of_other = 0
    while other in engine.requests:  # the other request runs to its end while the first one's loads wait
        assert engine.step() is not None
        steps_of_other += 1
        assert [r.request_id for r in engine.scheduler.loading] == [rid]
    assert steps_of_other >= PARAMS.max_tokens and engine.tiers.transfers.num_in_flight >= 2
    held.release()
    warm = run_rest(engine, rid)
    assert warm[0].cached_tokens_by_tier["host"] >= 64 and warm[0].restore.decision == "load"
    assert_same_output(warm, cold_run(make_engine, prompt))
    assert engine.kv.pool.num_used_blocks == 0


def test_a_load_that_lands_in_a_lend_is_indexed_there_and_its_request_joins_the_next_step(loaded, make_engine):
    """While another request decodes, loads run only in the time the engine lends them before each forward. The
    one that lands in a lend is collected right after it (indexed; its request queues), so the step that admits
    it next does not index it too."""
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    slow_prefill(engine)
    held = HeldWorkers(engine)
    rid = add_looked_up(engine, prompt)
    other = engine.add_request(tok.encode("A short question about pages?"),
                               SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    engine.step()
    assert [r.request_id for r in engine.scheduler.loading] == [rid]
    BACKGROUND_WORK.engine_computes(True)  # as the daemon's loop says while requests run: loads go in lends
    try:
        held.release()
        while engine.scheduler.loading:
            engine.step()
            assert other in engine.requests, "the other request ended before the load landed"
    finally:
        BACKGROUND_WORK.engine_computes(False)
    # It left `loading` after its step was planned, in that step's lend: queued, not yet running.
    assert [r.request_id for r in engine.scheduler.waiting] == [rid]
    assert rid not in {r.request_id for r in engine.scheduler.running}
    joined = [o for o in engine.step() if o.request_id == rid]  # its first token, when its rest fit this step
    assert rid in {r.request_id for r in engine.scheduler.running}
    engine.abort_request(other)
    warm = joined + run_rest(engine, rid)
    assert warm[0].cached_tokens_by_tier["host"] >= 64 and warm[0].restore.decision == "load"
    assert_same_output(warm, cold_run(make_engine, prompt))
    assert engine.kv.pool.num_used_blocks == 0


def loads_held_beside_a_decode(loaded, make_engine) -> tuple:
    """An engine whose request below the device has its loads queued (the workers held, the planner patient)
    while another request decodes, one step in: (engine, the held workers, the decoding request's id)."""
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    slow_prefill(engine)
    held = HeldWorkers(engine)
    add_looked_up(engine, prompt)
    other = engine.add_request(tok.encode("A short question about pages?"),
                               SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    engine.step()
    return engine, held, other


def lends_recorded(monkeypatch) -> list[float]:
    """The seconds of each lend from now on (each still lends them)."""
    lends: list[float] = []
    lend = BACKGROUND_WORK.lend
    monkeypatch.setattr(BACKGROUND_WORK, "lend", lambda seconds: (lends.append(seconds), lend(seconds)))
    return lends


def test_a_lend_is_a_share_of_the_step_the_cost_model_predicts_not_of_a_slow_last_step(loaded, make_engine,
                                                                                       monkeypatch):
    """A step that ran long (the machine, not the step's work) does not make the next step lend long: the lend
    is LEND_SHARE of what the step about to run is predicted to cost."""
    engine, held, other = loads_held_beside_a_decode(loaded, make_engine)
    lends = lends_recorded(monkeypatch)
    BACKGROUND_WORK.engine_computes(True)
    try:
        engine.last_step = replace(engine.last_step, total_s=10.0)  # as if the machine had stalled it
        shape = StepShape(num_decodes=1, num_context_tokens=engine.requests[other].num_tokens + 1)
        predicted = engine.step_cost.current.seconds(shape)
        engine.step()  # its loads are queued (the workers held): it lends
    finally:
        BACKGROUND_WORK.engine_computes(False)
        held.release()
    assert lends == [pytest.approx(LEND_SHARE * predicted, rel=0.01)]  # 3 s when lent a share of the last step's 10
    engine.abort_request(other)
    run_rest(engine, other)


def test_a_step_that_also_computes_a_prompt_lends_a_share_of_its_decodes_time(loaded, make_engine, monkeypatch):
    """A step that admits a new prompt beside a decode is the decode's longest gap already: its lend is a share of
    the decode's own step, not of the prompt's."""
    engine, held, other = loads_held_beside_a_decode(loaded, make_engine)
    question = "Another question, about swapping, and what it costs the others? " * 3
    add_looked_up(engine, loaded.tokenizer.encode(question))
    lends = lends_recorded(monkeypatch)
    BACKGROUND_WORK.engine_computes(True)
    try:
        decodes = StepShape(num_decodes=1, num_context_tokens=engine.requests[other].num_tokens + 1)
        predicted = engine.step_cost.current.seconds(decodes)
        engine.step()  # the new prompt and the decode; the loads queued (the workers held): it lends
    finally:
        BACKGROUND_WORK.engine_computes(False)
        held.release()
    assert engine.last_step.num_tokens > 20  # the prompt was in it
    assert lends == [pytest.approx(LEND_SHARE * predicted, rel=0.01)]
    engine.abort_request(other)
    run_rest(engine, other)


def test_two_requests_needing_the_same_chunks_share_one_load_each(loaded, make_engine):
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    slow_prefill(engine)
    held = HeldWorkers(engine)
    first = add_looked_up(engine, prompt)
    engine.step()
    loads = engine.tiers.transfers.num_in_flight
    pages_taken = engine.kv.pool.num_used_blocks
    second = add_looked_up(engine, prompt, tenant="")  # same tenant: same chunks
    engine.step()
    assert {r.request_id for r in engine.scheduler.loading} == {first, second}
    assert loads >= 2 and engine.tiers.transfers.num_in_flight == loads  # joined, not loaded again
    held.release()
    outs: dict[str, list] = {first: [], second: []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    cold = cold_run(make_engine, prompt)
    for rid in (first, second):
        assert outs[rid][0].cached_tokens_by_tier["host"] >= 64
        assert_same_output(outs[rid], cold)
    assert pages_taken > 0 and engine.kv.pool.num_used_blocks == 0
    chunks = outs[first][0].restore.num_chunks
    assert chunks >= loads and engine.tier_stats()[0].hits == chunks  # one read per chunk, for both requests


def test_a_loading_request_cancelled_mid_load_gives_its_pages_back(loaded, make_engine):
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    free_before = engine.kv.pool.num_free_blocks
    slow_prefill(engine)
    held = HeldWorkers(engine)
    rid = add_looked_up(engine, prompt)
    engine.step()
    assert [r.request_id for r in engine.scheduler.loading] == [rid]
    assert engine.kv.pool.num_free_blocks < free_before  # its destination pages and device prefix are held
    engine.abort_request(rid)  # the client hung up
    assert not engine.scheduler.loading and not engine.has_unfinished()
    assert engine.kv.pool.num_free_blocks == free_before and engine.kv.pool.num_used_blocks == 0
    held.release()
    engine.tiers.transfers.run(lambda: None).result()
    engine.step()  # nothing was left to give back
    assert engine.kv.pool.num_used_blocks == 0 and engine.tiers.transfers.num_in_flight == 0
    assert engine.tier_stats()[0].hits == 0  # the queued loads never ran
    # The chunks are still below: the next request loads them and computes the same output.
    warm = run_one(engine, prompt)
    assert warm[0].cached_tokens_by_tier["host"] >= 64
    assert_same_output(warm, cold_run(make_engine, prompt))


def test_a_load_past_its_deadline_turns_into_a_recompute_with_the_same_output(loaded, make_engine):
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    planner = engine.tiers.planner
    # Loading still wins the plan, but recomputing is estimated at nanoseconds: the deadline passes at once.
    planner.observe_load("host", 10**15, 1.0)
    planner.recompute_cost = lambda tokens: tokens * 1e-9
    held = HeldWorkers(engine)
    rid = add_looked_up(engine, prompt)
    engine.step()  # it starts loading; the loads stay queued behind the held workers
    outs = run_rest(engine, rid)  # the next step finds its deadline passed: it recomputes
    by_tier = outs[0].cached_tokens_by_tier
    assert outs[0].restore.decision == "load" and by_tier["host"] == 0  # (a shared head may be on the device)
    assert outs[0].num_cached_tokens == by_tier["device"] < 64
    assert engine.tiers.transfers.stats.loads_past_deadline == 1
    assert_same_output(outs, cold_run(make_engine, prompt))
    held.release()
    engine.tiers.transfers.run(lambda: None).result()
    engine.kv.reap_loads()
    # The late loads were dropped: their pages are back, nothing they read was indexed.
    assert engine.kv.pool.num_used_blocks == 0 and engine.tiers.transfers.num_in_flight == 0


def test_a_lookup_slower_than_its_share_of_the_recompute_estimate_turns_into_a_recompute(loaded, make_engine):
    """A lookup is waited for a tenth of the estimate of recomputing (`lookup_wait_share`), not the whole of it:
    a tier slow to answer (a Redis with a delay) would be as slow to load."""
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    slow_prefill(engine)  # the whole estimate: minutes
    now = [0.0]
    engine.kv.loading._clock = lambda: now[0]  # the lookup's deadline, on a clock the test moves
    gate = threading.Event()
    stuck = [engine.tiers.transfers.look_up(lambda: gate.wait() and []) for _ in range(2)]  # every lookup worker
    rid = engine.add_request(prompt, PARAMS)  # its lookup queues behind them
    engine.step()
    assert [r.request_id for r in engine.scheduler.loading] == [rid]
    deadline = engine.kv.loading._tickets[rid].deadline
    assert 0 < deadline <= 0.1 * len(prompt)  # the estimate, in seconds, is at most its prompt's tokens
    now[0] = deadline - 1e-3
    engine.step()
    assert [r.request_id for r in engine.scheduler.loading] == [rid]  # within its share: it still waits
    now[0] = deadline + 1e-3
    outs = run_rest(engine, rid)
    assert outs[0].num_cached_tokens == outs[0].cached_tokens_by_tier["device"] < 64  # nothing came from below
    assert engine.tiers.transfers.stats.loads_past_deadline == 1
    assert_same_output(outs, cold_run(make_engine, prompt))
    gate.set()
    for f in stuck:
        f.result()
    engine.tiers.transfers.wait_lookups()
    assert engine.kv.pool.num_used_blocks == 0


def test_when_lookups_lately_took_longer_than_its_share_a_request_does_not_wait_for_its_own(loaded, make_engine):
    tok = loaded.tokenizer
    engine, prompt = prompt_below_the_device(make_engine, tok)
    engine.tiers.planner.recompute_cost = lambda tokens: tokens * 1e-9  # a share no real lookup answers within
    add_looked_up(engine, ask(tok, TOPICS[1]))  # a lookup answered: its time is the recent one
    run_rest(engine, None)
    gate = threading.Event()
    stuck = [engine.tiers.transfers.look_up(lambda: gate.wait() and []) for _ in range(2)]  # every lookup worker
    stats = engine.tiers.transfers.stats
    before = stats.loads_past_deadline
    rid = engine.add_request(prompt, PARAMS)  # its lookup queues behind them
    outs = [o for o in engine.step() if o.request_id == rid]
    assert not engine.scheduler.loading  # admitted in its first step: it computes, not waits
    outs += run_rest(engine, rid)
    assert outs[0].num_cached_tokens == outs[0].cached_tokens_by_tier["device"] < 64  # nothing came from below
    assert stats.loads_past_deadline == before + 1
    assert_same_output(outs, cold_run(make_engine, prompt))
    gate.set()
    for f in stuck:
        f.result()
    engine.tiers.transfers.wait_lookups()


def test_a_store_in_flight_keeps_its_copy_while_its_pages_are_reused(loaded, make_engine, tmp_path):
    tok = loaded.tokenizer
    engine = tiered(make_engine, host=False, disk=tmp_path, disk_admission="all")
    prompt = ask(tok, TOPICS[0])
    gate = threading.Event()
    writer = engine.tiers.disk_tier.writer
    writer.run(gate.wait)  # the disk writer is busy: every store of the eviction below waits in its queue
    push_out(engine, tok, prompt)  # its pages were evicted, demoted, and written over by the other prompts
    assert writer.num_pending >= 2 and writer.num_written == 0
    gate.set()
    engine.tiers.wait()
    warm = run_one(engine, prompt)
    assert warm[0].cached_tokens_by_tier["disk"] >= 64  # what was stored is the KV before the pages were reused
    assert_same_output(warm, cold_run(make_engine, prompt))
    engine.close()


def test_a_store_still_copying_keeps_its_pages_until_its_copy_is_made(loaded, make_engine, tmp_path):
    tok = loaded.tokenizer
    disk = TierConfig(host_bytes=0, disk_bytes=256 << 20, disk_path=tmp_path, chunk_pages=4)
    engine = make_engine(kv_tokens=400, tiers=disk)  # 25 pages: room for the others beside the held ones
    gate = threading.Event()
    engine.tiers._store_copier.submit(gate.wait)  # the store-copy thread is busy: the turn's copies wait
    prompt = ask(tok, TOPICS[0])
    rid = engine.add_request(prompt, PARAMS, session_id="s")
    first = run_rest(engine, rid)
    held = engine.kv.pool.num_used_blocks
    assert held >= 8  # the finished turn's full pages, referenced by its store until their copy is made
    for topic in TOPICS[1:]:  # prompts that need pages: they get others, the held ones keep their KV
        run_one(engine, ask(tok, topic))
    assert engine.kv.pool.num_used_blocks == held and engine.tiers.disk_tier.writer.num_written == 0
    assert all(p.resident for p in engine.session_view("s").pages[:held])
    gate.set()
    engine.tiers.wait()
    engine.kv.reap_loads()
    assert engine.kv.pool.num_used_blocks == 0 and engine.tiers.disk_tier.writer.num_written >= 2
    engine.close()
    # What the disk got is the turn's KV: a new engine on the same disk loads it and computes the same output.
    again = make_engine(kv_tokens=400, tiers=disk)
    warm = run_one(again, prompt)
    assert warm[0].cached_tokens_by_tier["disk"] >= 64
    assert_same_output(warm, cold_run(make_engine, prompt))
    assert_same_output(first, warm)
    again.close()


def test_loaded_requests_that_fill_the_pool_all_run(loaded, make_engine):
    """Three requests whose loads together take every page (as after a restart, three session turns sent side
    by side with their KV below the device). Once loaded, a request queued for admission holds no pages: the
    first one admitted needs a page more than its loaded prefix to compute its rest, and takes it from the
    others' loaded prefixes (they recompute what it took). Had each held its loaded pages until its own
    admission, none would ever be admitted (the daemon refused them after max_queue_s)."""
    tok = loaded.tokenizer
    prompts = [ask(tok, topic) for topic in ("paging", "eviction", "checksums")]
    pages = [[tuple(p[i : i + 16]) for i in range(0, len(p) - 16, 16)] for p in prompts]
    shared = next(i for i, page in enumerate(zip(*pages)) if len(set(page)) > 1)  # the chat template's head
    below = [(len(p) - 1) // 16 - shared for p in prompts]  # each prompt's own full pages: loaded
    engine = make_engine(kv_tokens=(shared + sum(below)) * 16, tiers=TierConfig(host_bytes=64 << 20, chunk_pages=4))
    colds = [run_one(engine, p) for p in prompts]
    for topic in ("quotas", "drains", "sessions"):  # they push the three out to the host tier
        run_one(engine, ask(tok, topic))
    slow_prefill(engine)
    rids = [add_looked_up(engine, p) for p in prompts]
    engine.step()  # the three start loading: their loads take every page
    assert len(engine.scheduler.loading) == 3 and engine.kv.pool.num_free_blocks == 0
    outs: dict[str, list] = {rid: [] for rid in rids}

    def step() -> None:
        for o in engine.step():
            outs[o.request_id].append(o)

    while engine.scheduler.loading:
        step()
    for _ in range(10 * PARAMS.max_tokens):  # each one's prefill and decodes, one request at a time at worst
        step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the loaded requests wait for pages nobody gives back"
    for rid, cold in zip(rids, colds, strict=True):
        assert_same_output(outs[rid], cold)
    for rid in rids:  # what it loaded and was taken before its admission counts for no tier
        assert min(outs[rid][0].cached_tokens_by_tier.values()) >= 0
    assert sum(outs[rid][0].cached_tokens_by_tier["host"] for rid in rids) >= 64
    assert engine.kv.pool.num_used_blocks == 0
