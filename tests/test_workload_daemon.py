"""The workload recorder in a real daemon: chat requests and session turns over the Unix socket, read back
with `kvtierctl advise --json`, and the record kept across a restart (its own daemon, so the counts are exact)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from daemon_fixtures import start_daemon
from test_kvtierctl_daemon import ctl, ctl_json

CHAT = [  # (messages, priority)
    ([{"role": "user", "content": "Name three colours."}], "normal"),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a page table? " * 4}],
     "high"),
]
TURNS = ["Hello there.", "Tell me about caches.", "And about tiers, briefly?"]


def send(c, path: str, body: dict) -> dict:
    r = c.post(path, json={**body, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def nearest_rank(values: list[int], q: float) -> int:
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)]


def test_advise_reads_what_was_sent_and_the_record_survives_a_restart():
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        d = start_daemon(Path(root))
        try:
            with d.client() as c:
                replies = [send(c, "/v1/chat/completions", {"messages": m, "priority": p}) for m, p in CHAT]
                sid = c.post("/v1/sessions", json={"title": "advice"}).json()["id"]
                replies += [send(c, f"/v1/sessions/{sid}/messages", {"content": t}) for t in TURNS]
            last_turn_end = time.time()
            report = ctl_json(d, "advise")
            table = ctl(d, "advise")
        finally:
            assert d.stop() == 0, d.log_text()
        assert table.returncode == 0 and "Recorded workload" in table.stdout and "not enough data" in table.stdout

        w, config = report["workload"], report["config"]
        usage = [r["usage"] for r in replies]
        prompts = [u["prompt_tokens"] for u in usage]
        assert (w["num_requests"], w["num_sessions"], w["num_returns"]) == (5, 1, 2)
        assert w["prompt_tokens"]["count"] == 5 and w["prompt_tokens"]["max"] == max(prompts)
        assert (w["prompt_tokens"]["p50"], w["prompt_tokens"]["p90"]) == (nearest_rank(prompts, 0.5),
                                                                          nearest_rank(prompts, 0.9))
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
        assert w["computed_tokens"] == sum(u["total_tokens"] for u in usage) - sum(cached)
        by_tier = {t: sum(r["kvtierd"]["cached_tokens_by_tier"][t] for r in replies)
                   for t in ("device", "host", "disk")}
        assert {t: w["cached_tokens_by_tier"][t] for t in by_tier} == by_tier
        sources = [r["kvtierd"]["cache_source"] for r in replies]
        assert w["requests_by_source"] == {s: sources.count(s) for s in set(sources)}
        assert sources[3:] == ["session", "session"]  # the later turns start from the session's pool
        session_lengths = [u["total_tokens"] for u in usage[2:]]
        assert w["session_tokens"]["max"] == max(session_lengths) and w["idle_gap_s"]["count"] == 2
        high_pages = math.ceil(usage[1]["total_tokens"] / config["block_size"])
        assert w["request_pages"]["high"]["max"] == high_pages and w["high_pages"]["count"] == 1
        assert w["high_pages"]["max"] >= high_pages - 1  # sampled while it ran: its last token's page may be missing
        assert config["device_pages"] > 0 and config["context_window"] > 0
        assert [a["setting"] for a in report["advice"]] == ["block_size", "kv_cache_bytes", "host_bytes",
                                                            "disk_bytes", "reserved_share"]
        assert all(a["recommended"] is None and a["why"].startswith("not enough data") for a in report["advice"])

        assert (Path(root) / "state" / "workload.json").exists()  # saved at shutdown
        d = start_daemon(Path(root))
        try:
            assert ctl_json(d, "advise")["workload"] == w
            with d.client() as c:
                idle = time.time() - last_turn_end
                send(c, f"/v1/sessions/{sid}/messages", {"content": "One more."})
            again = ctl_json(d, "advise")["workload"]
        finally:
            assert d.stop() == 0, d.log_text()
        assert (again["num_requests"], again["num_sessions"], again["num_returns"]) == (6, 1, 3)
        assert again["idle_gap_s"]["max"] >= idle  # this gap spans the restart
