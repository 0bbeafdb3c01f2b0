"""Sessions outlive the daemon through the disk tier: stopped with SIGTERM (the drain flushes to disk)
or killed with kill -9 (each finished turn was written through), a restarted daemon on the same state
directory serves the session's next turn from disk, with the reply an uninterrupted daemon gives."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from daemon_fixtures import Daemon, start_daemon

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
        deadline = time.monotonic() + 30
        while tiers(first)["disk"]["pending_writes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        first.process.kill()
        first.process.wait(30)
        second = start_daemon(Path(root), env=ENV)  # replaces the stale socket
        try:
            assert_continued_from_disk(turn(second, sid, QUESTIONS[3]), uninterrupted[3])
        finally:
            assert second.stop() == 0, second.log_text()
