"""QoS scheduling: admission by class, fair queuing between tenants, aging, preemption of lower classes."""

from __future__ import annotations

import pytest

from fake_clock import FakeClock
from kvtierd.cache.block_hash import namespace_root
from kvtierd.engine.config import QosConfig
from kvtierd.engine.qos_queue import QosQueue
from kvtierd.engine.request import FinishReason, Request
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.tiers.config import TierConfig

TENANT_A = namespace_root("model-1", "a")
TENANT_B = namespace_root("model-1", "b")
WEIGHTS = {"high": 8.0, "normal": 4.0, "low": 1.0}


def make_request(rid: str, qos_class: str = "normal", tenant: bytes = TENANT_A, arrival: float = 100.0,
                 prompt_len: int = 10) -> Request:
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=1), None, arrival, tenant, qos_class=qos_class)


def drain(queue: QosQueue, n: int) -> list[Request]:
    out = []
    for _ in range(n):
        req = queue.peek()
        queue.admitted(req, req.num_prompt_tokens)
        out.append(req)
    return out


def test_high_goes_first_then_normal_then_low():
    q = QosQueue(WEIGHTS, aging_s=10.0, clock=FakeClock(100.0))
    for rid, cls in (("l", "low"), ("n", "normal"), ("h", "high")):
        q.add(make_request(rid, cls))
    assert [r.request_id for r in drain(q, 3)] == ["h", "n", "l"]


def test_a_tenants_burst_does_not_starve_another_of_equal_weight():
    """Tenant A queues 20 requests at once, then B queues 5: while both wait, B gets every other
    admission (its share stays within one request of half)."""
    q = QosQueue(WEIGHTS, aging_s=10.0, clock=FakeClock(100.0))
    for i in range(20):
        q.add(make_request(f"a{i}", tenant=TENANT_A))
    drain(q, 4)  # A alone for a while: that service is not held against it later, nor banked by B
    for i in range(5):
        q.add(make_request(f"b{i}", tenant=TENANT_B))
    order = [r.cache_root for r in drain(q, 10)]
    assert abs(order.count(TENANT_B) - 5) <= 1
    for k in range(2, 11, 2):  # at every point, within one request of an equal share
        assert abs(order[:k].count(TENANT_A) - order[:k].count(TENANT_B)) <= 1


def test_a_waiting_low_request_ages_past_a_steady_stream_of_high_ones():
    clock = FakeClock(100.0)
    q = QosQueue(WEIGHTS, aging_s=1.0, clock=clock)
    q.add(make_request("low", "low", arrival=clock.now))
    served = []
    for step in range(20):
        q.add(make_request(f"h{step}", "high", arrival=clock.now))  # a fresh high request every second
        served.append(drain(q, 1)[0].request_id)
        clock.advance(1.0)
    # weight 1 + waited beats a fresh high's 8 once it has waited 8 s (ties go to the higher class).
    assert "low" in served and served.index("low") == 8


def test_requests_past_their_class_limit_time_out():
    clock = FakeClock(100.0)
    q = QosQueue(WEIGHTS, aging_s=1.0, clock=clock)
    q.add(make_request("h", "high", arrival=100.0))
    q.add(make_request("l", "low", arrival=100.0))
    clock.advance(5.0)
    late = q.timed_out({"high": 2.0, "normal": 0.0, "low": 0.0})
    assert [r.request_id for r in late] == ["h"] and len(q) == 1


def test_queued_low_requests_are_shed_once_a_high_one_has_waited_long_enough():
    clock = FakeClock(100.0)
    q = QosQueue(WEIGHTS, aging_s=10.0, clock=clock)
    for rid, cls in (("l1", "low"), ("l2", "low"), ("n", "normal")):
        q.add(make_request(rid, cls, arrival=clock.now))
    preempted = make_request("l-preempted", "low", arrival=clock.now)
    preempted.first_scheduled_time = clock.now  # it ran already: no longer the queue's to refuse
    q.add(preempted, front=True)
    clock.advance(30.0)
    assert q.shed_low(2.0) == []  # low alone waits as long as it likes (up to its own max_queue_s)
    q.add(make_request("h", "high", arrival=clock.now))
    clock.advance(1.0)
    assert q.shed_low(2.0) == [] and q.shed_low(0.0) == []  # high has not waited long enough; 0 is off
    clock.advance(1.0)
    assert [r.request_id for r in q.shed_low(2.0)] == ["l1", "l2"]
    assert sorted(r.request_id for r in q) == ["h", "l-preempted", "n"]


# --- the engine, on the real model ----------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    return outs


def test_a_high_request_preempts_low_ones_which_resume_with_identical_output(loaded, make_engine):
    prompts = [chat(loaded, f"Tell me fact number {i} about paging.") for i in range(4)]
    urgent = chat(loaded, "Quick: name a prime number.")
    roomy = make_engine(block_size=4, kv_tokens=2048).generate(prompts + [urgent], GREEDY)
    # Room for about two sequences at full length and no reserve: high must take the low ones' pages.
    tight = make_engine(block_size=4, kv_tokens=2 * (len(prompts[0]) + 16))
    lows = [tight.add_request(p, GREEDY, qos_class="low") for p in prompts]
    outs: dict[str, list[int]] = {}
    for _ in range(3):  # the low requests fill the pages
        for o in tight.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    high = tight.add_request(urgent, GREEDY, qos_class="high")
    first_token_step, step = None, 0
    while tight.has_unfinished():
        step += 1
        for o in tight.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.request_id == high and first_token_step is None:
                first_token_step = step
    assert first_token_step == 1  # admitted at once, beside (or instead of) the low ones
    assert tight.counters.preemptions > 0
    assert [outs[r] for r in lows + [high]] == roomy
    assert tight.kv.pool.num_high_blocks == 0 and tight.kv.num_free_blocks == tight.kv.pool.num_blocks


def test_preempted_requests_resume_from_the_host_tier_their_evicted_pages_went_to(loaded, make_engine):
    """Preemption frees a request's pages without forgetting them: its full pages stay indexed, and when the
    high request's allocations evict them they are saved to the host tier on the way out. A resumed request
    looks below only once the pages evicted in its step are saved (its lookup runs off the step), and waits
    for pages for its loads while the high one holds them. It loads them back and ends as if never stopped.
    The planner estimates recomputing at an hour a token, so no wait reaches its deadline, whatever this
    machine's speed."""
    prompts = [chat(loaded, f"Tell me fact number {i} about paging, at some length please.") for i in range(4)]
    urgent = chat(loaded, "Quick: name a prime number, and then another one, and a third.")
    roomy = make_engine(block_size=4, kv_tokens=4096).generate(prompts + [urgent], GREEDY)
    tight = make_engine(block_size=4, kv_tokens=2 * (len(prompts[0]) + 16),
                        tiers=TierConfig(host_bytes=64 << 20, disk_bytes=0, chunk_pages=2))
    tight.tiers.planner.recompute_cost = lambda tokens: 3600.0 * tokens
    lows = [tight.add_request(p, GREEDY, qos_class="low") for p in prompts]
    outs: dict[str, list[int]] = {}
    for _ in range(3):
        for o in tight.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    high = tight.add_request(urgent, GREEDY, qos_class="high")
    while tight.has_unfinished():
        for o in tight.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    host = tight.tier_stats()[0]
    assert tight.counters.preemptions > 0 and host.writes > 0 and host.hits > 0
    assert [outs[r] for r in lows + [high]] == roomy
    assert tight.kv.num_free_blocks == tight.kv.pool.num_blocks


def test_low_completes_under_sustained_high_load(loaded, make_engine):
    engine = make_engine(block_size=4, kv_tokens=1024, max_num_seqs=1,
                         qos=QosConfig(aging_s=0.05, weights={"high": 8.0, "normal": 4.0, "low": 1.0}))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    low = engine.add_request(chat(loaded, "low"), params, qos_class="low")
    for i in range(4):
        engine.add_request(chat(loaded, f"high {i}"), params, qos_class="high")
    done: list[str] = []
    while low not in done:
        engine.add_request(chat(loaded, "more high"), params, qos_class="high")  # never fewer than 4 waiting
        done += [o.request_id for o in engine.step() if o.finished]
        assert len(done) < 200, "the low request starved"


@pytest.mark.parametrize("shed_low_after_s", [0.0, 1e-6])
def test_a_waiting_high_request_sheds_queued_low_ones_only_when_shedding_is_on(loaded, make_engine, shed_low_after_s):
    """One seat: a high request runs, a low one queues, then a second high one queues behind the first (high
    does not preempt high). 1e-6 s: shed as soon as a high request has waited one step."""
    engine = make_engine(block_size=4, kv_tokens=1024, max_num_seqs=1, qos=QosConfig(shed_low_after_s=shed_low_after_s))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(chat(loaded, "first high"), params, qos_class="high")
    engine.step()
    low = engine.add_request(chat(loaded, "low"), params, qos_class="low")
    assert engine.step() and low in engine.requests  # waiting behind a running high: not shed
    engine.add_request(chat(loaded, "second high"), params, qos_class="high")
    finished: dict[str, FinishReason] = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o.finish_reason) for o in engine.step() if o.finished)
    if shed_low_after_s:
        assert finished[low] is FinishReason.SHED and engine.counters.shed == 1
    else:
        assert finished[low] is FinishReason.LENGTH and engine.counters.shed == 0
    assert engine.counters.rejected == {"high": 0, "normal": 0, "low": 0}
    assert list(finished.values()).count(FinishReason.LENGTH) == (2 if shed_low_after_s else 3)
