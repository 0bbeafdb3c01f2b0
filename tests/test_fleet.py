"""Two daemons as two hosts of a fleet: one real redis-server as the shared remote
tier, one real PostgreSQL as the shared session store, each daemon with its own
socket and state dir. KV computed on one host serves the other, sessions move
between hosts, tenants stay apart, Redis going away loses no request, and a value
tampered with in Redis is never served.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_fixtures import Daemon, start_daemon
from waiting import wait_until

GREEDY = {"temperature": 0, "max_tokens": 6, "logprobs": True}
DOC = "Fleet notes: every host keeps its own device pages, and the remote tier holds chunks for all. " * 10


@pytest.fixture(scope="module")
def fleet(redis_server, postgres_server) -> Iterator[tuple[Daemon, Daemon]]:
    with tempfile.TemporaryDirectory(prefix="kvtfl-") as root:
        secret = Path(root) / "fleet.key"
        secret.write_text("a fleet secret of at least sixteen bytes\n")
        env = {"KVTIERD_REMOTE_URL": redis_server.url, "KVTIERD_REMOTE_SECRET_FILE": str(secret),
               "KVTIERD_STORE_URL": postgres_server.create_database("kvtierd_fleet"),
               # Where the KV comes from is what these tests check, not timeouts (test_lookup_off_step holds a slow
               # Redis): an op timeout a loaded machine never reaches, so no remote read is dropped as late.
               "KVTIERD_REMOTE_OP_TIMEOUT_MS": "5000",
               # Only these two tenants have remote limits: every other test's tenant writes as without them.
               "KVTIERD_TENANT_LIMITS": "fl-capped=remote:1, fl-ledger=remote:1GiB"}
        a = start_daemon(Path(root) / "a", env=env)
        b = start_daemon(Path(root) / "b", env=env)
        yield a, b
        assert a.stop() == 0, a.log_text()
        assert b.stop() == 0, b.log_text()


def chat(daemon: Daemon, tenant: str, messages: list[dict], **extra) -> dict:
    with daemon.client(**{"X-Kvtierd-Tenant": tenant}) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def tier_rows(daemon: Daemon) -> dict[str, dict]:
    with daemon.client() as c:
        return {t["name"]: t for t in c.get("/admin/tiers").json()["tiers"]}


def remote_tier(daemon: Daemon) -> dict:
    return tier_rows(daemon)["remote"]


def settled(daemon: Daemon) -> None:
    """Waits until the daemon's remote writes are stored."""
    wait_until(lambda: remote_tier(daemon)["pending_writes"] == 0, "the remote writes being stored")


def by_tier(reply: dict) -> dict:
    return reply["kvtierd"]["cached_tokens_by_tier"]


def same_reply(x: dict, y: dict) -> bool:
    lx = [t["logprob"] for t in x["choices"][0]["logprobs"]["content"]]
    ly = [t["logprob"] for t in y["choices"][0]["logprobs"]["content"]]
    return x["choices"][0]["message"]["content"] == y["choices"][0]["message"]["content"] and \
        lx == pytest.approx(ly, abs=1e-3)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": DOC + question}]


def test_a_document_computed_on_one_host_is_served_from_the_remote_tier_on_the_other(fleet):
    a, b = fleet
    cold = chat(a, "fl-doc", ask("What does each host keep?"))
    assert by_tier(cold)["remote"] == 0 and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    settled(a)
    before = tier_rows(b)
    warm = chat(b, "fl-doc", ask("What does each host keep?"))
    assert by_tier(warm)["remote"] >= 224 and by_tier(warm)["device"] == 0
    assert same_reply(warm, cold)
    # /admin/tiers counts the loaded chunks for the remote row, not for the device's.
    after = tier_rows(b)
    assert after["remote"]["healthy"] and after["remote"]["hits"] > before["remote"]["hits"]
    assert after["remote"]["hit_tokens"] - before["remote"]["hit_tokens"] >= by_tier(warm)["remote"]
    assert after["device"]["hit_tokens"] == before["device"]["hit_tokens"]


def test_tenants_stay_apart_across_hosts(fleet):
    a, b = fleet
    chat(a, "fl-iso-1", ask("Isolation?"))
    settled(a)
    other = chat(b, "fl-iso-2", ask("Isolation?"))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_session_started_on_one_host_continues_on_the_other_with_its_kv(fleet):
    a, b = fleet
    headers = {"X-Kvtierd-Tenant": "fl-sess"}
    with a.client(**headers) as c:
        sid = c.post("/v1/sessions", json={"system_prompt": "You answer about fleets."}).json()["id"]
        for q in ("What is a fleet?", DOC + "Summarise the notes."):
            assert c.post(f"/v1/sessions/{sid}/messages", json={"content": q, **GREEDY}).status_code == 200
    settled(a)
    with b.client(**headers) as c:
        r = c.post(f"/v1/sessions/{sid}/messages", json={"content": "And the device pages?", **GREEDY}).json()
        history = c.get(f"/v1/sessions/{sid}").json()["messages"]
    assert len(history) == 6 and history[2]["content"].startswith("Fleet notes")
    assert by_tier(r)["remote"] >= 224 and r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.8 * \
        r["usage"]["prompt_tokens"]


def test_a_value_tampered_with_in_redis_is_never_served(fleet, redis_server):
    a, b = fleet
    cold = chat(a, "fl-tamper", ask("Tampered?"))
    settled(a)
    with redis_server.client() as raw:
        for name in raw.scan_iter(match=b"kvtierd:*"):
            value = raw.get(name)
            if value and len(value) > 1000:
                raw.set(name, value[:500] + bytes([value[500] ^ 0xFF]) + value[501:], keepttl=True)
    corrupt_before = remote_tier(b)["corrupt"]
    warm = chat(b, "fl-tamper", ask("Tampered?"))
    assert by_tier(warm)["remote"] == 0 and same_reply(warm, cold)
    assert remote_tier(b)["corrupt"] > corrupt_before


def test_a_tenants_remote_limit_is_one_ledger_for_the_fleet(fleet):
    a, b = fleet

    def row(daemon: Daemon, tenant: str) -> dict:
        with daemon.client() as c:
            return next(t for t in c.get("/admin/tiers").json()["tenants"] if t["tenant"] == tenant)

    # One byte: every chunk of the tenant's is over its limit, so none is stored, and each is counted.
    chat(a, "fl-capped", ask("Capped?"))
    settled(a)
    assert row(a, "fl-capped")["remote_over_limit"] >= 1 and row(a, "fl-capped")["remote_chunks"] == 0
    assert by_tier(chat(b, "fl-capped", ask("Capped?")))["remote"] == 0
    # Within its limit: what either host writes is in the one ledger both read.
    chat(a, "fl-ledger", ask("Ledger?"))
    settled(a)
    chat(b, "fl-ledger", [{"role": "user", "content": "Another document. " * 80}])
    settled(b)
    on_a, on_b = row(a, "fl-ledger"), row(b, "fl-ledger")
    assert on_a["remote_chunks"] == on_b["remote_chunks"] >= 2 and on_a["remote_bytes"] == on_b["remote_bytes"] > 0
    assert on_a["remote_over_limit"] == on_b["remote_over_limit"] == 0


def test_redis_going_away_loses_no_request_and_its_return_brings_the_tier_back(fleet, redis_server):
    a, b = fleet
    redis_server.stop()
    try:
        for i in range(3):
            chat(b, "fl-down", ask(f"Down {i}?"))  # every request answered 200
        tier = remote_tier(b)
        assert not tier["healthy"] and tier["reason"]
    finally:
        redis_server.start()
    chat(a, "fl-up", ask("Back?"))

    def healthy_after_a_request(daemon: Daemon, tenant: str, question: str) -> bool:
        chat(daemon, tenant, ask(question))  # a request lets the circuit breaker probe
        return remote_tier(daemon)["healthy"]

    wait_until(lambda: remote_tier(a)["healthy"] or healthy_after_a_request(a, "fl-up", "Back?"),
               "host A finding the remote tier again", poll_s=0.5)
    settled(a)
    # B's circuit breaker probes again after its backoff (up to 30 s): other questions until it has.
    wait_until(lambda: remote_tier(b)["healthy"] or healthy_after_a_request(b, "fl-probe", "Still there?"),
               "host B's circuit breaker closing again", poll_s=0.5)
    warm = chat(b, "fl-up", ask("Back?"))
    assert by_tier(warm)["remote"] > 0 or by_tier(warm)["device"] > 0, warm["kvtierd"]


def test_a_remote_tier_without_its_secret_refuses_to_start_in_one_line(redis_server, tmp_path):
    d = start_daemon(tmp_path / "nosecret", env={"KVTIERD_REMOTE_URL": redis_server.url}, wait=False)
    assert d.process.wait(120) == 2
    log = d.log_text()
    assert "error: remote_url needs remote_secret_file" in log and "Traceback" not in log
