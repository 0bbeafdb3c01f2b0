"""kvtierctl pin | unpin | pins against the real daemon: prefixes and sessions, with and without a TTL, as
text and as JSON, the pin budget, and the errors a user sees."""

from __future__ import annotations

import re

from test_kvtierctl_daemon import ctl, ctl_json

TENANT = "ctl-pins"
PINNED = re.compile(r"^pinned (prefix|session) as (pin_\w+): (\d+) pages \((\d+) of (\d+) pinned pages used\)$")
TTL_S = 600


def make_session(daemon) -> str:
    """A session with one turn: its context pool holds the prompt and the reply."""
    with daemon.client(**{"X-Kvtierd-Tenant": TENANT}) as c:
        sid = c.post("/v1/sessions", json={"title": "pinned"}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 2}).status_code == 200
    return sid


def pin_text(daemon, *args: str) -> tuple[str, str, int]:
    """Runs `kvtierctl pin` for its text answer: (kind, pin id, pages)."""
    done = ctl(daemon, "pin", *args)
    assert done.returncode == 0 and not done.stderr, done.stderr
    m = PINNED.match(done.stdout.strip())
    assert m, done.stdout
    return m.group(1), m.group(2), int(m.group(3))


def admin_pins(daemon) -> dict[str, dict]:
    with daemon.client() as c:
        return {p["id"]: p for p in c.get("/admin/pins").json()["pins"]}


def test_pin_prefixes_and_sessions_with_and_without_ttl_list_and_unpin(daemon):
    text = "The reference manual of the paged KV cache, chapter one: pages, page tables and the block pool. " * 2
    kind, prefix_id, prefix_pages = pin_text(daemon, "--text", text, "--tenant", TENANT)
    assert (kind, prefix_pages) == ("prefix", 2)  # 47 tokens: two full pages of 16
    kind, prefix_ttl_id, _ = pin_text(daemon, "--text", "Chapter two: " + text, "--tenant", TENANT,
                                      "--ttl", str(TTL_S))
    assert kind == "prefix"
    session, session_ttl = make_session(daemon), make_session(daemon)
    session_pin = ctl_json(daemon, "pin", "--session", session)["pin"]
    session_ttl_pin = ctl_json(daemon, "pin", "--session", session_ttl, "--ttl", str(TTL_S))["pin"]
    assert (session_pin["kind"], session_pin["session_id"], session_pin["tenant"]) == ("session", session, TENANT)
    assert session_pin["pages"] >= 1 and session_pin["expires_in_s"] is None
    assert 0 < session_ttl_pin["expires_in_s"] <= TTL_S
    mine = {prefix_id, prefix_ttl_id, session_pin["id"], session_ttl_pin["id"]}

    listed = ctl_json(daemon, "pins")
    by_id = {p["id"]: p for p in listed["pins"] if p["id"] in mine}
    assert by_id.keys() == mine
    assert (by_id[prefix_id]["kind"], by_id[prefix_id]["tenant"], by_id[prefix_id]["pages"]) == ("prefix", TENANT, 2)
    assert by_id[prefix_id]["num_tokens"] // 16 == 2  # every token of the text is kept (for restarts)
    assert [by_id[i]["expires_in_s"] is None for i in (prefix_id, prefix_ttl_id)] == [True, False]
    assert 0 < by_id[prefix_ttl_id]["expires_in_s"] <= TTL_S
    # The two sessions share their first page (the same template and message): pins count it once.
    assert max(p["pages"] for p in by_id.values()) <= listed["pinned_pages"] <= listed["budget_pages"]
    assert admin_pins(daemon).keys() >= mine  # the route kvtierctl reads

    table = ctl(daemon, "pins")
    assert table.returncode == 0 and not table.stderr
    rows = {pin_id: line for line in table.stdout.splitlines() for pin_id in mine if pin_id in line}
    assert rows.keys() == mine
    assert "never" in rows[prefix_id] and "never" in rows[session_pin["id"]]
    assert "never" not in rows[prefix_ttl_id] and "never" not in rows[session_ttl_pin["id"]]
    assert session in rows[session_pin["id"]] and "prefix" in rows[prefix_id]

    for pin_id in sorted(mine):
        done = ctl(daemon, "unpin", pin_id)
        assert done.returncode == 0 and re.fullmatch(rf"unpinned {pin_id} \(\d+ pages\)", done.stdout.strip())
    assert not admin_pins(daemon).keys() & mine
    assert not {p["id"] for p in ctl_json(daemon, "pins")["pins"]} & mine


def test_unpin_of_an_unknown_id_is_a_clear_error(daemon):
    done = ctl(daemon, "unpin", "pin_doesnotexist")
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.startswith("error:") and "no pin 'pin_doesnotexist'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_pin_over_the_budget_is_refused_and_nothing_is_pinned(daemon):
    before = ctl_json(daemon, "pins")
    pages = before["budget_pages"] - before["pinned_pages"] + 1  # one page more than the budget leaves
    token_ids = ",".join(str(3000 + i) for i in range(pages * 16))
    done = ctl(daemon, "pin", "--token-ids", token_ids, "--tenant", TENANT)
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.startswith("error:") and "pin budget" in done.stderr and "Traceback" not in done.stderr
    after = ctl_json(daemon, "pins")
    assert [p["id"] for p in after["pins"]] == [p["id"] for p in before["pins"]]
    assert after["pinned_pages"] == before["pinned_pages"]


def test_pin_needs_a_session_or_a_prefix_but_not_both(daemon):
    for args in ([], ["--session", "sess_x", "--text", "hello"]):
        done = ctl(daemon, "pin", *args)
        assert done.returncode == 2 and done.stderr.startswith("error: give --session ID or a prefix")
