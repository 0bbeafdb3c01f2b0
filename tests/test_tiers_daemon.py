"""Sessions outlive the daemon through the disk tier: stopped with SIGTERM (the drain flushes to disk)
or killed with kill -9 (each finished turn was written through), a restarted daemon on the same state
directory serves the session's next turn from disk, with the reply an uninterrupted daemon gives."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest

from daemon_fixtures import Daemon, start_daemon
from waiting import wait_until

ENV = {"KVTIERD_HOST_BYTES": "64MiB", "KVTIERD_DISK_BYTES": "1GiB"}
GREEDY = {"temperature": 0, "max_tokens": 12, "logprobs": True}
SYSTEM = "You are a terse assistant for a KV-cache daemon; answer in one short sentence. " * 45
QUESTIONS = ("What is a KV page?", "And a page table?", "Why copy on write?", "What does the disk tier keep?")


def new_session(daemon: Daemon) -> str:
    with daemon.client() as c:
        r = c.post("/v1/sessions", json={"system_prompt": SYSTEM})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def turn(daemon: Daemon, sid: str, question: str) -> dict:
    with daemon.client() as c:
        r = c.post(f"/v1/sessions/{sid}/messages", json={"content": question, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def tiers(daemon: Daemon) -> dict[str, dict]:
    with daemon.client() as c:
        return {t["name"]: t for t in c.get("/admin/tiers").json()["tiers"]}


def logprobs(reply: dict) -> list[float]:
    return [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def uninterrupted() -> list[dict]:
    """The four turns on one daemon that keeps running."""
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        d = start_daemon(Path(root), env=ENV)
        sid = new_session(d)
        replies = [turn(d, sid, q) for q in QUESTIONS]
        assert d.stop() == 0, d.log_text()
    return replies


def assert_continued_from_disk(reply: dict, expected: dict) -> None:
    usage = reply["usage"]
    by_tier = reply["kvtierd"]["cached_tokens_by_tier"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"], usage
    assert by_tier["disk"] >= 0.95 * usage["prompt_tokens"] and by_tier["device"] == 0, by_tier
    assert reply["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert logprobs(reply) == pytest.approx(logprobs(expected), abs=1e-3)


def test_a_session_continues_from_disk_after_a_graceful_restart(uninterrupted):
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        first = start_daemon(Path(root), env=ENV)
        sid = new_session(first)
        for q in QUESTIONS[:3]:
            turn(first, sid, q)
        assert first.stop() == 0, first.log_text()
        assert "flushed to the disk tier" in first.log_text()
        second = start_daemon(Path(root), env=ENV)
        try:
            assert_continued_from_disk(turn(second, sid, QUESTIONS[3]), uninterrupted[3])
            disk = tiers(second)["disk"]
            assert disk["healthy"] and disk["hits"] > 0 and disk["entries"] > 0
        finally:
            assert second.stop() == 0, second.log_text()


def test_a_session_continues_from_disk_after_kill_9(uninterrupted):
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        first = start_daemon(Path(root), env=ENV)
        sid = new_session(first)
        for q in QUESTIONS[:3]:
            turn(first, sid, q)
        # A turn's chunks are committed by the disk writer a moment after its reply.
        wait_until(lambda: tiers(first)["disk"]["pending_writes"] == 0, "the disk writer committing the turns")
        first.process.kill()
        first.process.wait(30)
        second = start_daemon(Path(root), env=ENV)  # replaces the stale socket
        try:
            assert_continued_from_disk(turn(second, sid, QUESTIONS[3]), uninterrupted[3])
        finally:
            assert second.stop() == 0, second.log_text()


def sql(daemon: Daemon, query: str, *args) -> list[tuple]:
    with sqlite3.connect(daemon.state_dir / "kvtierd.sqlite3") as db:
        db.execute("PRAGMA foreign_keys=ON")  # as the daemon has it: rows go with their session
        return db.execute(query, args).fetchall()


def test_startup_reconciles_the_disk_tier_with_the_chunk_catalog_and_warms_recent_sessions():
    """Orphans on either side go at startup: the chunks of a session deleted while the daemon was down,
    and a catalog row whose chunk the disk does not hold; the surviving session is copied up to the host
    tier and resumes from there."""
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        first = start_daemon(Path(root), env=ENV)
        kept, dropped = new_session(first), new_session(first)
        turn(first, kept, QUESTIONS[0])
        turn(first, dropped, "Another question, about LMDB pages and how they are written?")
        assert first.stop() == 0, first.log_text()
        catalog = sql(first, "SELECT session_id, chunk_key FROM session_chunks")
        keys_of = {sid: {bytes(k) for s, k in catalog if s == sid} for sid in (kept, dropped)}
        assert keys_of[kept] and keys_of[dropped]  # every full chunk of each turn, named in the turn's transaction
        only_dropped = keys_of[dropped] - keys_of[kept]  # the chunks past their shared system prompt
        assert only_dropped
        # While the daemon is down, the session goes from the database (an admin, or a fleet peer) and a
        # row appears that names a chunk the disk never held.
        sql(first, "DELETE FROM sessions WHERE id = ?", dropped)
        store = sql(first, "SELECT store FROM session_chunks LIMIT 1")[0][0]
        sql(first, "INSERT INTO session_chunks (tenant, session_id, store, chunk_key, created_at) "
                   "VALUES ('root', ?, ?, ?, '2026-12-01 00:00:00')", kept, store, b"\0" * 16)

        second = start_daemon(Path(root), env=ENV)
        try:
            disk = tiers(second)["disk"]
            assert disk["reconciled"] == {"orphan_values": len(only_dropped), "orphan_rows": 1}, disk
            assert {bytes(k) for (k,) in sql(second, "SELECT chunk_key FROM session_chunks")} == keys_of[kept]
            with second.client() as c:
                metrics = c.get("/metrics").text
            assert f'kvtierd_disk_orphans_removed_total{{side="values"}} {float(len(only_dropped))}' in metrics
            assert 'kvtierd_disk_orphans_removed_total{side="rows"} 1.0' in metrics
            assert "1 orphan row(s) removed" in second.log_text()
            # The surviving session was warmed into the host tier at startup: its next turn loads from memory.
            wait_until(lambda: "warmed into the host tier" in second.log_text(), "the startup warm-up ending")
            assert tiers(second)["host"]["entries"] == len(keys_of[kept]), second.log_text()
            reply = turn(second, kept, QUESTIONS[1])
            assert reply["kvtierd"]["cached_tokens_by_tier"]["disk"] >= 0.9 * reply["usage"]["prompt_tokens"]
            with second.client() as c:
                loads = [line for line in c.get("/metrics").text.splitlines()
                         if line.startswith("kvtierd_tier_load_bytes_per_second{")]
            assert [line.split('"')[1] for line in loads] == ["host"], loads  # counted for the disk, read from RAM
        finally:
            assert second.stop() == 0, second.log_text()
