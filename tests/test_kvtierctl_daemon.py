"""kvtierctl against the real daemon: every command, as tables and as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from waiting import wait_until


def ctl(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtierd.cli.ctl", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def ctl_json(daemon, *args: str) -> dict:
    done = ctl(daemon, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_tiers_stats_and_prefixes_reflect_the_daemon(daemon):
    with daemon.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "A long shared preamble about caches. " * 6}],
            "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
    status = ctl_json(daemon, "status")
    assert status["model"]["num_layers"] == 30 and status["engine"]["block_size"] == 16
    assert status["socket"] == str(daemon.socket)
    assert status["engine"]["attention_backend"] == "torch-reference"  # no GPU here: the reference path
    assert status["engine"]["matmul_backend"] == "torch"  # float32, the daemon tests' mode: no quantized kernel
    device, host, disk = ctl_json(daemon, "tiers")["tiers"]
    assert device["name"] == "device" and device["query_tokens"] > 0
    assert (host["name"], disk["name"]) == ("host", "disk") and host["healthy"] and disk["healthy"]
    assert disk["capacity_bytes"] > 0 and host["pinned"] is False  # no GPU here
    assert (host["codec"], disk["codec"]) == ("raw", "raw")  # auto: float32 KV is stored raw
    assert disk["reconciled"] == {"orphan_values": 0, "orphan_rows": 0}  # a new state dir: nothing to settle
    assert device["eviction_policy"] == "lru" and set(device["evictions"]) == {"capacity", "expired", "invalidated"}
    assert ctl_json(daemon, "stats")["requests"] >= 1
    prefixes = ctl_json(daemon, "prefixes", "ls", "--limit", "5")["prefixes"]
    assert 0 < len(prefixes) <= 5
    assert all(p["num_tokens"] == 16 * p["pages"] and p["tier"] == "device" for p in prefixes)
    for command in (["status"], ["tiers"], ["stats"], ["prefixes", "ls"]):
        done = ctl(daemon, *command)
        assert done.returncode == 0 and done.stdout.strip() and not done.stderr, (command, done.stderr)


def test_sessions_ls_show_rm(daemon):
    headers = {"X-Kvtierd-Tenant": "ctl-test"}
    with daemon.client(**headers) as c:
        sid = c.post("/v1/sessions", json={"title": "ctl session"}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 3}).status_code == 200
    listed = ctl_json(daemon, "sessions", "ls", "--tenant", "ctl-test")["sessions"]
    assert [s["id"] for s in listed] == [sid] and listed[0]["num_messages"] == 2
    shown = ctl_json(daemon, "sessions", "show", sid)
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"]
    kv = shown["kv"]  # its context pool: the prompt and the reply but the last token
    assert kv["num_tokens"] == shown["messages"][1]["prompt_tokens"] + shown["messages"][1]["completion_tokens"] - 1
    assert kv["resident_tokens"] == kv["num_tokens"] and kv["pages"][0]["tier"] == "device"
    assert "Context pool" in ctl(daemon, "sessions", "show", sid).stdout
    assert "ctl session" in ctl(daemon, "sessions", "ls", "--tenant", "ctl-test").stdout
    removed = ctl(daemon, "sessions", "rm", sid)
    assert removed.returncode == 0 and sid in removed.stdout
    missing = ctl(daemon, "sessions", "show", sid)
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr


def test_tiers_by_tenant_and_the_under_share_counter(daemon):
    for tenant in ("shares-quiet", "shares-noisy"):
        with daemon.client(**{"X-Kvtierd-Tenant": tenant}) as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"The {tenant} tenant's own document. " * 6}],
                "max_tokens": 2, "temperature": 0, "retention": {"priority": 5, "duration_s": 3600}})
            assert r.status_code == 200
    data = ctl_json(daemon, "tiers")
    assert data["tiers"][0]["pages_retained"] >= 4  # both documents' pages, held ahead of ordinary ones
    assert data["cache_shares"] is True
    rows = {t["tenant"]: t for t in data["tenants"]}
    for tenant in ("shares-quiet", "shares-noisy"):
        assert rows[tenant]["device_pages"] >= 2 and rows[tenant]["weight"] == 1.0 and rows[tenant]["share_pages"] > 0
    with daemon.client(**{"X-Kvtierd-Tenant": "shares-quiet"}) as c:  # a session's turn is written to disk
        sid = c.post("/v1/sessions", json={"system_prompt": "The quiet tenant's session. " * 6}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 2}).status_code == 200

    def disk_of(tenant: str) -> dict | None:
        row = next((t for t in ctl_json(daemon, "tiers")["tenants"] if t["tenant"] == tenant), None)
        return row if row and row["disk_chunks"] else None

    quiet = wait_until(lambda: disk_of("shares-quiet"), "the quiet tenant's turn on disk")
    assert quiet["disk_bytes"] > 0 and quiet["disk_over_limit"] == 0
    table = ctl(daemon, "tiers", "--tenant")
    assert table.returncode == 0 and "shares-quiet" in table.stdout and "Under share" in table.stdout
    assert "Disk chunks" in table.stdout and "Remote chunks" in table.stdout
    with daemon.client() as c:
        metrics = c.get("/metrics").text
    assert "kvtierd_cache_evictions_under_share_total " in metrics
    assert "shares-quiet" not in metrics  # tenants are never labels
