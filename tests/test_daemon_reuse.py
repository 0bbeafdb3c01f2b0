"""Reuse through the real daemon: isolation in pairs (same tenant hits, another misses,
a public prefix hits for all, nothing hits after the model's cache is invalidated),
tags and invalidation over /admin/invalidate and kvtierctl, and session truncation
with replies equal to a cold computation of the kept prompt.

Its own daemon, with a 320-token window so a session outgrows it in a few turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from daemon_fixtures import Daemon, start_daemon

GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": True}
DOC = "The block pool hands out fixed-size pages and takes them back when requests finish. " * 4


@pytest.fixture(scope="module")
def small() -> Daemon:
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        d = start_daemon(Path(root), env={"KVTIERD_MAX_MODEL_LEN": "320", "KVTIERD_TRUNCATION_KEEP_TURNS": "2"})
        yield d
        assert d.stop() == 0, d.log_text()


def chat(daemon: Daemon, tenant: str, messages: list[dict], **extra) -> dict:
    with daemon.client(**{"X-Kvtierd-Tenant": tenant}) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def logprobs(reply: dict) -> list[float]:
    return [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]


def assert_same_reply(warm: dict, cold: dict) -> None:
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert logprobs(warm) == pytest.approx(logprobs(cold), abs=1e-3)


def admin(daemon: Daemon, method: str, path: str, body: dict | None = None) -> httpx.Response:
    with daemon.client() as c:
        return c.request(method, path, json=body)


def ctl(daemon: Daemon, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "kvtierd.cli.ctl", "--socket", str(daemon.socket), "--json", *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": DOC + question}]


def test_same_tenant_hits_and_another_tenant_misses(small):
    cold = chat(small, "iso-a", ask("Who hands out pages?"))
    warm = chat(small, "iso-a", ask("Who hands out pages?"))
    other = chat(small, "iso-b", ask("Who hands out pages?"))
    assert cached(cold) == 0 and cached(other) == 0
    assert cached(warm) >= 64 and warm["kvtierd"]["cache_source"] == "prefix"
    assert_same_reply(warm, cold)
    assert_same_reply(other, cold)


def test_a_public_prefix_hits_for_every_tenant(small):
    system = {"role": "system", "content": "You answer questions about a KV-cache daemon, briefly. " * 3}
    question = {"role": "user", "content": "What is a page?"}
    cold = chat(small, "pub-cold", [system, question])
    published = admin(small, "POST", "/admin/prefixes", {"messages": [system], "tag": "system:v1"})
    assert published.status_code == 200, published.text
    num_tokens = published.json()["num_tokens"]
    assert num_tokens >= 32 and published.json()["namespace"] == "public"
    for tenant in ("pub-x", "pub-y"):
        warm = chat(small, tenant, [system, question])
        assert warm["kvtierd"]["cache_source"] == "public" and cached(warm) >= num_tokens
        assert_same_reply(warm, cold)
    listed = ctl(small, "prefixes", "ls", "--tenant", "public")["prefixes"]
    assert [p["num_tokens"] for p in listed] == [num_tokens] and listed[0]["tags"] == ["system:v1"]
    # Published by text through kvtierctl too.
    text = ctl(small, "prefixes", "publish", "--text", DOC)
    assert text["pages"] == text["num_tokens"] // 16 > 0


def test_invalidating_a_tag_over_the_api_and_kvtierctl(small):
    first = chat(small, "tag-a", ask("Tagged question?"), prefix_tag="doc:v3")
    assert cached(first) == 0
    assert cached(chat(small, "tag-a", ask("Another question?"))) >= 64
    assert ctl(small, "invalidate", "--tag", "doc:v3")["invalidated_pages"] >= 4
    assert cached(chat(small, "tag-a", ask("A third question?"))) == 0


@pytest.mark.parametrize("target", ["tenant", "prefix", "hash"])
def test_invalidating_a_tenant_a_prefix_or_a_hash_makes_it_miss_and_spares_others(small, target):
    mine, theirs = f"inv-{target}", f"inv-{target}-other"
    for tenant in (mine, theirs):
        chat(small, tenant, ask("Warm it up."))
    if target == "tenant":
        body = {"tenant": mine}
    elif target == "prefix":
        body = {"prefix": {"messages": ask("Warm it up.")}, "tenant": mine}  # rendered as the chat was
    else:
        rows = admin(small, "GET", f"/admin/prefixes?tenant={mine}").json()["prefixes"]
        body = {"hash": rows[0]["hash"]}
    r = admin(small, "POST", "/admin/invalidate", body)
    assert r.status_code == 200 and r.json()["invalidated_pages"] > 0, r.text
    assert cached(chat(small, mine, ask("Warm it up."))) == 0
    assert cached(chat(small, theirs, ask("Warm it up."))) >= 64


def test_bad_invalidations_are_clear_400s(small):
    for body, param in (({}, "target"), ({"tag": "doc:v3", "hash": "00"}, "target"), ({"hash": "xyz"}, "hash"),
                        ({"tag": "no spaces"}, "tag"), ({"prefix": {"text": ""}}, "text"), ({"nope": 1}, "nope")):
        r = admin(small, "POST", "/admin/invalidate", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert admin(small, "POST", "/admin/invalidate", {"session_id": "no-such"}).status_code == 404
    assert admin(small, "POST", "/admin/prefixes", {"text": "short"}).status_code == 400


def test_a_session_that_outgrows_the_window_is_truncated_and_replies_as_if_computed_cold(small):
    headers = {"X-Kvtierd-Tenant": "trunc"}
    system = "You are brief."
    with small.client(**headers) as c:
        sid = c.post("/v1/sessions", json={"system_prompt": system}).json()["id"]
        turns = []
        for i in range(12):
            r = c.post(f"/v1/sessions/{sid}/messages", json={
                "content": f"Question {i}: " + "tell me about pages and page tables. " * 3, **GREEDY})
            assert r.status_code == 200, r.text
            turns.append(r.json())
            if r.json()["kvtierd"]["truncated"]:
                break
        stored = c.get(f"/v1/sessions/{sid}").json()["messages"]
    truncated = turns[-1]["kvtierd"]["truncated"]
    assert truncated is not None, "the session never outgrew the 320-token window"
    assert truncated["policy"] == "turns" and truncated["dropped_messages"] >= 2 and truncated["dropped_tokens"] > 0
    assert all(t["kvtierd"]["truncated"] is None for t in turns[:-1])
    assert len(stored) == 2 * len(turns)  # the store keeps every message
    # The reply equals a cold, stateless request for the kept messages (another tenant: nothing cached).
    kept = [{"role": m["role"], "content": m["content"]} for m in stored[truncated["dropped_messages"] : -1]]
    cold = chat(small, "trunc-cold", [{"role": "system", "content": system}] + kept)
    assert cached(cold) == 0
    assert_same_reply(turns[-1], cold)


def test_an_edited_history_replaces_the_stored_turns_and_reuses_up_to_the_edit(small):
    with small.openai(**{"X-Kvtierd-Tenant": "edit"}) as client, small.client(**{"X-Kvtierd-Tenant": "edit"}) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        history = []
        for q in ("What is a page?", "What is a page table?", "What is eviction?"):
            history.append({"role": "user", "content": q})
            r = client.chat.completions.create(model="default", messages=history, extra_body={"session_id": sid},
                                               **GREEDY)
            history.append({"role": "assistant", "content": r.choices[0].message.content})
        # Edit the second question; the client drops what followed it, as chat UIs do.
        edited = history[:2] + [{"role": "user", "content": "What is a block table?"}]
        r = client.chat.completions.create(model="default", messages=edited, extra_body={"session_id": sid},
                                           **GREEDY)
        warm = r.model_dump()
        stored = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert warm["kvtierd"]["cache_source"] == "session" and cached(warm) > 0
    assert [m["status"] for m in stored] == ["complete"] * 2 + ["superseded"] * 4 + ["complete"] * 2
    assert [m["content"] for m in stored if m["status"] == "complete"][:3] == [m["content"] for m in edited]
    cold = chat(small, "edit-cold", edited)
    assert_same_reply(warm, cold)


def test_a_session_request_with_another_system_prompt_is_a_clear_400(small):
    with small.client(**{"X-Kvtierd-Tenant": "edit"}) as http:
        sid = http.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
        r = http.post("/v1/chat/completions", json={
            "session_id": sid, "messages": [{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"
        assert http.get(f"/v1/sessions/{sid}").json()["messages"] == []
