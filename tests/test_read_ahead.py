"""Values of a remote request's next chunks read ahead of their loads: in one call (or, spaced, one a call),
each taken once, dropped ones never read; and through a Redis that answers late, a request's later chunks are
asked for beside its loads' own calls (a proxy the test holds counts them), with the same output and each value
read once."""

from __future__ import annotations

import secrets
import threading

import pytest
from redis_fixtures import GatedProxy
from test_tiers_engine import ask
from test_transfers_engine import add_looked_up, cold_run, run_rest, slow_prefill

from engine_runs import assert_same_output, run_one
from kvtierd.storage.redis_gets import ReadGets
from kvtierd.tiers.config import RemoteConfig, TierConfig
from kvtierd.tiers.read_ahead import ReadAhead
from kvtierd.tiers.restore_planner import LOADS_AHEAD


class Server:
    """A store's `send_gets` that records its calls and answers when the test opens its gate."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self.gate = threading.Event()
        self.busy = threading.Event()

    def __call__(self, keys):
        self.calls.append(list(keys))
        self.busy.set()
        self.gate.wait()
        return None if b"down" in keys else ReadGets([None if k == b"gone" else k.upper() for k in keys])


def test_values_are_read_in_one_call_and_each_is_taken_once():
    server = Server()
    ahead = ReadAhead(server, threads=1)
    ahead.start([b"a", b"b", b"gone"])
    ahead.start([b"a"])  # on its way already
    server.gate.set()
    assert ahead.take(b"a").read() == b"A"
    assert ahead.take(b"gone").read() is None  # not in the store
    assert ahead.take(b"a") is None  # taken: a later load asks the store itself
    assert server.calls == [[b"a", b"b", b"gone"]] and len(ahead) == 1
    ahead.close()


def test_a_failed_call_answers_none_for_each_of_its_values():
    server = Server()
    server.gate.set()
    ahead = ReadAhead(server, threads=1)
    ahead.start([b"down", b"x"])
    assert ahead.take(b"x").read() is None and ahead.take(b"down").read() is None
    ahead.close()


def test_a_call_whose_values_are_all_dropped_never_starts_and_the_limit_holds():
    server = Server()
    ahead = ReadAhead(server, threads=1, limit=4)
    ahead.start([b"x"])
    assert server.busy.wait(60)  # the one thread is held by the call for x
    ahead.start([b"y", b"z"])
    ahead.start([b"p", b"q"])  # one past the limit: q is not read ahead
    assert len(ahead) == 4
    ahead.drop([b"y"])  # z is still wanted: its call stays
    ahead.drop([b"z", b"p"])  # none of y, z's call is wanted now, nor of p's (q was past the limit)
    server.gate.set()
    assert ahead.take(b"x").read() == b"X"
    ahead.close()
    assert server.calls == [[b"x"]]


def test_spaced_values_go_in_a_call_each_and_one_whose_turn_has_not_come_is_never_sent():
    server = Server()
    server.gate.set()
    ahead = ReadAhead(server)
    ahead.start([b"a", b"b", b"c"], spacing_s=0.01)
    assert [ahead.take(k).read() for k in (b"a", b"b", b"c")] == [b"A", b"B", b"C"]
    assert sorted(server.calls) == [[b"a"], [b"b"], [b"c"]]
    ahead.start([b"x", b"y"], spacing_s=3600)  # y's turn comes in an hour
    assert ahead.take(b"x").read() == b"X"
    ahead.drop([b"y"])
    ahead.close()  # wakes y's call: it is not sent
    assert [b"y"] not in server.calls and len(server.calls) == 4


@pytest.fixture
def held_redis(redis_server):
    proxy = GatedProxy(redis_server.port)
    yield proxy
    proxy.close()


def remote_engine(make_engine, url: str, secret: bytes, fleet: str, admission: str):
    remote = RemoteConfig(url=url, secret=secret, fleet=fleet, op_timeout_ms=600_000, admission=admission)
    return make_engine(kv_tokens=1024, tiers=TierConfig(host_bytes=0, disk_bytes=0, chunk_pages=1, remote=remote))


def test_a_late_redis_is_asked_for_a_requests_later_chunks_beside_its_loads(loaded, make_engine, redis_server,
                                                                          held_redis):
    tok = loaded.tokenizer
    secret, fleet = secrets.token_bytes(32), f"ahead-{secrets.token_hex(4)}"
    prompt = ask(tok, "the remote tier and its round trips")
    writer = remote_engine(make_engine, f"redis://127.0.0.1:{redis_server.port}", secret, fleet, "all")
    run_one(writer, prompt)
    writer.tiers.wait()  # its chunks are in Redis
    writer.close()
    engine = remote_engine(make_engine, held_redis.url, secret, fleet, "sessions")
    slow_prefill(engine)  # its deadline is minutes away: it waits for Redis whatever this machine's speed
    engine.tiers.remote_tier.read_ahead_past_s = 0.0  # reads ahead however fast this Redis answered its lookups
    rid = add_looked_up(engine, prompt)
    held_redis.hold()
    engine.step()  # its loads start, and the values of the next chunks are asked for in a call of their own
    assert held_redis.wait_held(LOADS_AHEAD + 1), "only the loads' own calls reached Redis"
    held_redis.release()
    outs = run_rest(engine, rid)
    plan = outs[0].restore
    assert plan.decision == "load" and plan.num_chunks > LOADS_AHEAD + 1
    assert outs[0].cached_tokens_by_tier["remote"] >= 16 * (len(prompt) // 16)
    assert engine.tiers.remote.stats().num_gets == plan.num_chunks  # each read once: loads took those read ahead
    assert_same_output(outs, cold_run(make_engine, prompt))
    assert engine.kv.pool.num_used_blocks == 0
    engine.close()
