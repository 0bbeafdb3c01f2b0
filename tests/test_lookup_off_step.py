"""Lookups of the lower tiers run off the engine's step. A Redis that stops answering (a proxy the test holds)
holds only the request whose lookup waits on it: the running ones keep stepping, and it runs once Redis
answers, or recomputes at its deadline, with the same output; one that the fleet's directory answers waits for
no Redis at all; a load abandoned at its deadline teaches the restore planner nothing. Held by a gate, never by
a clock."""

from __future__ import annotations

import secrets

import pytest
from redis_fixtures import GatedProxy
from test_tiers_engine import KV_TOKENS, TOPICS, ask
from test_transfers_engine import PARAMS, cold_run, run_rest, slow_prefill
from waiting import wait_until

from engine_runs import assert_same_output, run_one
from kvtierd.tiers.config import RemoteConfig, TierConfig


@pytest.fixture
def held_redis(redis_server):
    proxy = GatedProxy(redis_server.port)
    yield proxy
    proxy.close()


def remote_engine(make_engine, proxy: GatedProxy, directory: bool = False, fleet: tuple[str, bytes] | None = None,
                  url: str | None = None, admission: str = "sessions"):
    name, secret = fleet or (f"lookup-{secrets.token_hex(4)}", secrets.token_bytes(32))
    remote = RemoteConfig(url=url or proxy.url, secret=secret, fleet=name, admission=admission, directory=directory,
                          op_timeout_ms=600_000)  # a held call waits for the test, not a timeout
    return make_engine(kv_tokens=KV_TOKENS, tiers=TierConfig(host_bytes=0, disk_bytes=0, chunk_pages=4, remote=remote))


def test_a_lookup_held_by_redis_does_not_hold_the_running_requests_steps(loaded, make_engine, held_redis):
    tok = loaded.tokenizer
    engine = remote_engine(make_engine, held_redis)
    slow_prefill(engine)  # its deadline is minutes away: it waits for Redis whatever this machine's speed
    other = engine.add_request(tok.encode("A short question about pages?"), PARAMS)
    engine.step()
    held_redis.hold()
    prompt = ask(tok, TOPICS[0])
    rid = engine.add_request(prompt, PARAMS)
    steps = 0
    while other in engine.requests:  # the other request decodes to its end while the lookup waits on Redis
        engine.step()
        steps += 1
        assert [r.request_id for r in engine.scheduler.loading] == [rid]
    assert steps >= PARAMS.max_tokens - 1 and held_redis.held >= 1 and engine.tiers.transfers.num_lookups >= 1
    held_redis.release()
    outs = run_rest(engine, rid)
    assert outs[0].restore.decision == "none"  # Redis answered: nothing of it below
    assert_same_output(outs, cold_run(make_engine, prompt))
    engine.close()


def test_a_lookup_past_its_deadline_turns_into_a_recompute_with_the_same_output(loaded, make_engine, held_redis):
    tok = loaded.tokenizer
    engine = remote_engine(make_engine, held_redis)
    engine.tiers.planner.recompute_cost = lambda tokens: tokens * 1e-9  # recomputing: nanoseconds, its deadline
    held_redis.hold()
    prompt = ask(tok, TOPICS[0])
    rid = engine.add_request(prompt, PARAMS)
    engine.step()  # it starts looking up; Redis holds the lookup
    outs = run_rest(engine, rid)  # a later step finds its deadline passed: it computes its prompt
    assert outs[0].num_cached_tokens == 0 and engine.tiers.transfers.stats.loads_past_deadline == 1
    assert held_redis.held >= 1
    assert_same_output(outs, cold_run(make_engine, prompt))
    held_redis.release()
    engine.tiers.transfers.wait_lookups()
    assert engine.kv.pool.num_used_blocks == 0
    engine.close()


def test_a_lookup_the_fleets_directory_answers_waits_for_no_held_redis(loaded, make_engine, held_redis):
    tok = loaded.tokenizer
    engine = remote_engine(make_engine, held_redis, directory=True)
    directory = engine.tiers.remote.directory
    wait_until(lambda: directory.complete, "the directory's first scan")
    held_redis.hold()
    prompt = ask(tok, TOPICS[0])
    rid = engine.add_request(prompt, PARAMS)
    # Asked, the held Redis would hold its lookup until the test releases it (the op timeout is minutes).
    wait_until(lambda: engine.tiers.transfers.num_lookups == 0, "its lookup, answered by the directory")
    outs = run_rest(engine, rid)
    assert outs[0].restore.decision == "none" and engine.tiers.transfers.stats.loads_past_deadline == 0
    assert_same_output(outs, cold_run(make_engine, prompt))
    held_redis.release()
    engine.close()


def test_a_load_abandoned_at_its_deadline_teaches_the_planner_nothing(loaded, make_engine, redis_server, held_redis):
    tok = loaded.tokenizer
    fleet, prompt = (f"abandon-{secrets.token_hex(4)}", secrets.token_bytes(32)), ask(tok, TOPICS[1])
    writer = remote_engine(make_engine, held_redis, fleet=fleet, url=redis_server.url, admission="all")
    run_one(writer, prompt)
    writer.tiers.wait()  # its chunks are in Redis
    writer.close()
    engine = remote_engine(make_engine, held_redis, fleet=fleet)
    planner = engine.tiers.planner
    rid = engine.add_request(prompt, PARAMS)
    engine.tiers.transfers.wait_lookups()  # found in Redis
    planner.recompute_cost = lambda tokens: tokens * 1e-9  # its loads' deadline passes at once
    held_redis.hold()
    engine.step()  # its loads start, and wait on the held Redis
    assert held_redis.wait_held(1)
    outs = run_rest(engine, rid)  # past the deadline: it recomputes, its loads abandoned
    assert outs[0].restore.decision == "load" and engine.tiers.transfers.stats.loads_past_deadline == 1
    held_redis.release()  # the abandoned loads end now, nobody waiting for them

    def ended() -> bool:
        engine.kv.reap_loads()
        return engine.kv.pool.num_used_blocks == 0
    wait_until(ended, "the abandoned loads' end")
    assert "remote" not in planner.load_costs()
    assert_same_output(outs, cold_run(make_engine, prompt))
    engine.close()
